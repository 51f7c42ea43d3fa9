"""Line plots, and the text drawing they share with the labelled panels of training.visualize: everything
rasterised with numpy into (H, W, 3) canvases (float, or uint8 where the caller draws uint8 panels), text glyphs from
Pillow's built-in font, written with imageio; no plotting library needed."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def to_numpy(name: str, array) -> np.ndarray:
    if isinstance(array, torch.Tensor):
        array = array.detach().cpu().numpy()
    try:
        return np.asarray(array)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{name} must be a tensor or array-like, got {type(array).__name__}") from error


PLOT_BACKGROUND = np.array([255, 255, 255], np.float64)
PLOT_INK = np.array([0, 0, 0], np.float64)
PLOT_GRID = np.array([225, 225, 225], np.float64)
PLOT_LINE = np.array([31, 119, 180], np.float64)
_MARGINS = {"left": 72, "right": 20, "top": 30, "bottom": 44}  # pixels around the plotting area


@functools.lru_cache(maxsize=1)
def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default()  # decoded from an embedded file on every call: once is enough


@functools.lru_cache(maxsize=512)
def text_mask(text: str, rotate: bool = False) -> np.ndarray:
    """Coverage in [0, 1] of ``text`` in Pillow's built-in font: (h, w), or turned 90 degrees left. Cached (every
    render's titles and colour-bar labels are the same few strings); read-only."""
    font = _font()
    left, top, right, bottom = font.getbbox(text)
    canvas = Image.new("L", (max(right - left, 1), max(bottom - top, 1)))
    ImageDraw.Draw(canvas).text((-left, -top), text, font=font, fill=255)
    mask = np.asarray(canvas, np.float64) / 255.0
    mask = np.ascontiguousarray(np.rot90(mask) if rotate else mask)
    mask.flags.writeable = False
    return mask


def draw_text(canvas: np.ndarray, text: str, x: float, y: float, align: str = "center", rotate: bool = False) -> None:
    """Blend ``text`` into ``canvas`` (H, W, 3 float); (x, y) is the text's centre, right-middle or left-middle."""
    if not text:
        return
    mask = text_mask(text, rotate)
    h, w = mask.shape
    x0 = {"center": x - w / 2, "right": x - w, "left": x}[align]
    y0, x0 = int(round(y - h / 2)), int(round(x0))
    ys = slice(max(y0, 0), min(y0 + h, canvas.shape[0]))
    xs = slice(max(x0, 0), min(x0 + w, canvas.shape[1]))
    alpha = mask[ys.start - y0 : ys.stop - y0, xs.start - x0 : xs.stop - x0, None]
    blended = canvas[ys, xs] * (1 - alpha) + PLOT_INK * alpha
    canvas[ys, xs] = blended if canvas.dtype != np.uint8 else blended.round()  # uint8: rounded where it is drawn


def nice_ticks(low: float, high: float, count: int = 5) -> tuple[np.ndarray, float]:
    """About ``count`` round tick values (steps of 1, 2 or 5 times a power of ten) in [low, high], and the step."""
    raw = (high - low) / count
    magnitude = 10.0 ** math.floor(math.log10(raw))
    step = next(s * magnitude for s in (1, 2, 5, 10) if s * magnitude >= raw * (1 - 1e-9))
    first = math.ceil(low / step - 1e-9) * step
    ticks = np.arange(first, high + step * 1e-6, step)
    return ticks, step


def tick_label(value: float, step: float) -> str:
    if abs(value) < step * 1e-6:
        value = 0.0  # avoid "-0" and 1e-17 from accumulated round-off
    if step >= 1 and abs(value) < 1e7:
        return f"{value:.0f}"
    if step >= 1e-4 and abs(value) < 1e7:
        return f"{value:.{math.ceil(-math.log10(step) - 1e-9)}f}"
    return f"{value:.2e}"


def _axis_range(values: np.ndarray, pad_fraction: float) -> tuple[float, float]:
    low, high = float(values.min()), float(values.max())
    span = high - low
    if span <= 1e-12 * max(abs(low), abs(high), 1.0):  # constant data: give it a visible band
        half = max(abs(low) * 0.05, 0.5)
        return low - half, high + half
    return low - pad_fraction * span, high + pad_fraction * span


def polyline_pixels(px: np.ndarray, py: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixel centres along straight segments between consecutive points (both ends finite), plus the points."""
    good = np.isfinite(px) & np.isfinite(py)
    pairs = good[:-1] & good[1:]
    start = np.stack([px[:-1][pairs], py[:-1][pairs]], axis=1)
    delta = np.stack([px[1:][pairs], py[1:][pairs]], axis=1) - start
    samples = (
        np.ceil(np.abs(delta).max(axis=1, initial=0.0)).astype(np.int64) + 1 if len(delta) else np.zeros(0, np.int64)
    )
    segment = np.repeat(np.arange(len(samples)), samples)
    index = np.arange(segment.size) - np.repeat(np.cumsum(samples) - samples, samples)
    t = index / np.maximum(samples[segment] - 1, 1)
    points = start[segment] + t[:, None] * delta[segment]
    points = np.concatenate([points, np.stack([px[good], py[good]], axis=1)])
    return points[:, 0], points[:, 1]


def plot_curve(
    xs,
    ys,
    path: str | os.PathLike,
    title: str = "",
    ylabel: str = "",
    xlabel: str = "",
    size: tuple[int, int] = (640, 400),
) -> None:
    """Write a line plot of ``ys`` against ``xs`` (1-D, same length) as a PNG of ``size`` (width, height).

    Draws axes, grid lines with round tick labels, the title and axis labels. Points where x or y is NaN or
    infinite are left out (the line breaks there); at least one finite point is required.
    """
    xs = to_numpy("xs", xs).astype(np.float64)
    ys = to_numpy("ys", ys).astype(np.float64)
    if xs.ndim != 1 or ys.ndim != 1 or xs.shape != ys.shape:
        raise ValueError(f"xs and ys must be 1-D of the same length, got shapes {xs.shape} and {ys.shape}")
    good = np.isfinite(xs) & np.isfinite(ys)
    if not good.any():
        raise ValueError("plot_curve needs at least one point where both xs and ys are finite")
    width, height = size
    left, right, top, bottom = (_MARGINS[k] for k in ("left", "right", "top", "bottom"))
    if width < left + right + 20 or height < top + bottom + 20:
        raise ValueError(f"size {size} leaves no room for the plot (minimum {left + right + 20}x{top + bottom + 20})")

    x_low, x_high = _axis_range(xs[good], 0.0)
    y_low, y_high = _axis_range(ys[good], 0.05)
    plot_w, plot_h = width - left - right, height - top - bottom

    def to_px(x):
        return left + (x - x_low) / (x_high - x_low) * (plot_w - 1)

    def to_py(y):
        return top + (y_high - y) / (y_high - y_low) * (plot_h - 1)

    canvas = np.broadcast_to(PLOT_BACKGROUND, (height, width, 3)).copy()
    x_ticks, x_step = nice_ticks(x_low, x_high)
    y_ticks, y_step = nice_ticks(y_low, y_high)
    for tick in x_ticks:
        column = int(round(to_px(tick)))
        canvas[top : top + plot_h, column] = PLOT_GRID
        canvas[top + plot_h : top + plot_h + 4, column] = PLOT_INK
        draw_text(canvas, tick_label(tick, x_step), column, top + plot_h + 12)
    for tick in y_ticks:
        row = int(round(to_py(tick)))
        canvas[row, left : left + plot_w] = PLOT_GRID
        canvas[row, left - 4 : left] = PLOT_INK
        draw_text(canvas, tick_label(tick, y_step), left - 7, row, align="right")
    canvas[top : top + plot_h, left - 1] = PLOT_INK  # y axis
    canvas[top + plot_h, left - 1 : left + plot_w] = PLOT_INK  # x axis

    px, py = polyline_pixels(to_px(xs), to_py(ys))
    for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):  # a 2x2 brush: a line that stays visible when scaled down
        col = np.clip(np.round(px).astype(np.int64) + dx, left, left + plot_w - 1)
        row = np.clip(np.round(py).astype(np.int64) + dy, top, top + plot_h - 1)
        canvas[row, col] = PLOT_LINE

    draw_text(canvas, title, left + plot_w / 2, top / 2)
    draw_text(canvas, xlabel, left + plot_w / 2, height - 12)
    draw_text(canvas, ylabel, 10, top + plot_h / 2, rotate=True)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    iio.imwrite(path, canvas.round().astype(np.uint8), extension=".png")
