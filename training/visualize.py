"""Pictures for humans: depth colouring, error maps, side-by-side comparisons and turntable videos (line plots and
the text drawing: training.plots).

Everything is rasterised with numpy (text glyphs come from Pillow's built-in font) and written with
imageio, so no plotting library is needed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from training.plots import PLOT_INK, draw_text, nice_ticks, text_mask, to_numpy

# Turbo colormap as a degree-5 polynomial per channel (coefficients of t^0..t^5): the published
# polynomial fit to Google's Turbo (a perceptual rainbow: dark blue -> cyan -> yellow -> dark red).
_TURBO_COEFFS = np.array(
    [
        [0.13572138, 0.09140261, 0.10667330],
        [4.61539260, 2.19418839, 12.64194608],
        [-42.66032258, 4.84296658, -60.58204836],
        [132.13108234, -14.18503333, 110.36276771],
        [-152.94239396, 4.27729857, -89.90310912],
        [59.28637943, 2.82956604, 27.34824973],
    ]
)

_INVALID_COLOR = np.zeros(3, np.uint8)  # depth pixels that are NaN or infinite are painted black
# error_map's scale when no vmax is given: channel-mean |gt - pred| of 0.25 (a quarter of the colour range) and
# above is dark red. Fixed, not the image's maximum, so the maps of different views and runs are comparable.
DEFAULT_ERROR_VMAX = 0.25


def _to_unit_float(name: str, image) -> np.ndarray:
    """(H, W, 3) float [0, 1] or uint8 [0, 255] image -> float64 array in [0, 1], shape checked."""
    image = to_numpy(name, image)
    if image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"{name} must have shape (H, W, 3), got {image.shape}")
    if image.dtype == np.uint8:
        return image.astype(np.float64) / 255.0
    if not np.issubdtype(image.dtype, np.floating):
        raise TypeError(f"{name} must be a float image in [0, 1] or uint8, got dtype {image.dtype}")
    if not np.isfinite(image).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return image.astype(np.float64)


def turbo(values: np.ndarray) -> np.ndarray:
    """Turbo colormap: (...) values in [0, 1] (clipped) -> (..., 3) float64 RGB in [0, 1]."""
    t = np.clip(np.asarray(values, np.float64), 0.0, 1.0)
    rgb = np.empty((*t.shape, 3))
    for channel in range(3):  # Horner's rule per channel: ~8x faster than a (..., 6) matrix of powers
        coefficients = _TURBO_COEFFS[::-1, channel]
        value = np.full(t.shape, coefficients[0])
        for coefficient in coefficients[1:]:
            value *= t
            value += coefficient
        rgb[..., channel] = value
    return np.clip(rgb, 0.0, 1.0, out=rgb)


def to_uint8(img) -> np.ndarray:
    """(H, W, C) or (H, W) float image in [0, 1] (tensor or array; clipped) -> uint8 array, rounded.

    uint8 input is returned as a copy, so callers need not track which form they hold.
    """
    img = to_numpy("img", img)
    if img.ndim not in (2, 3):
        raise ValueError(f"img must have shape (H, W, C) or (H, W), got {img.shape}")
    if img.dtype == np.uint8:
        return img.copy()
    if not np.issubdtype(img.dtype, np.floating):
        raise TypeError(f"img must be a float image in [0, 1] or uint8, got dtype {img.dtype}")
    if not np.isfinite(img).all():
        raise ValueError("img contains NaN or infinite values")
    return (np.clip(img, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def colorize_depth(depth, near: float, far: float) -> np.ndarray:
    """(H, W) or (H, W, 1) depth -> (H, W, 3) uint8 Turbo image: ``near`` dark blue, ``far`` dark red.

    Depths outside [near, far] are clipped; NaN or infinite depths are painted black.
    """
    depth = to_numpy("depth", depth)
    if depth.ndim == 3 and depth.shape[-1] == 1:
        depth = depth[..., 0]
    if depth.ndim != 2:
        raise ValueError(f"depth must have shape (H, W) or (H, W, 1), got {depth.shape}")
    if not (math.isfinite(near) and math.isfinite(far) and near < far):
        raise ValueError(f"colorize_depth needs finite near < far, got near={near}, far={far}")
    depth = depth.astype(np.float64)
    valid = np.isfinite(depth)
    colors = to_uint8(turbo((np.where(valid, depth, near) - near) / (far - near)))
    colors[~valid] = _INVALID_COLOR
    return colors


def error_map(gt, pred, vmax: float | None = None) -> np.ndarray:
    """Colour-mapped absolute error, (H, W, 3) uint8.

    gt, pred: (H, W, 3) float in [0, 1] or uint8. The per-pixel error is the channel mean of
    ``|gt - pred|`` (in [0, 1], 1 = the whole colour range), shown with Turbo from 0 (dark blue) to ``vmax``
    (dark red; larger errors are clipped to it). ``vmax=None`` means ``DEFAULT_ERROR_VMAX`` (0.25), a fixed
    scale, never the image's own maximum, so error maps of different views and runs can be compared.
    """
    gt = _to_unit_float("gt", gt)
    pred = _to_unit_float("pred", pred)
    if gt.shape != pred.shape:
        raise ValueError(f"gt and pred must have the same shape, got {gt.shape} and {pred.shape}")
    return to_uint8(turbo(np.abs(gt - pred).mean(axis=-1) / _error_vmax(vmax)))


def _error_vmax(vmax: float | None) -> float:
    vmax = DEFAULT_ERROR_VMAX if vmax is None else float(vmax)
    if not (math.isfinite(vmax) and vmax > 0):
        raise ValueError(f"vmax must be a finite number > 0, got {vmax}")
    return vmax


def ffmpeg_available() -> bool:
    """True when imageio can write mp4 (the imageio-ffmpeg plugin is installed)."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        return False
    return True


def write_turntable(frames: Sequence[np.ndarray], path: str | os.PathLike, fps: float = 20.0) -> Path:
    """Write frames, each (H, W, 3) uint8, as an animation and return the path actually written.

    ``.mp4`` is written when the imageio-ffmpeg plugin is installed; otherwise (and for any other suffix)
    a looping GIF is written, with the suffix changed to ``.gif``. GIF writers merge consecutive identical
    frames, so such frames read back as one.
    """
    if len(frames) == 0:
        raise ValueError("frames is empty")
    frames = [to_numpy(f"frames[{i}]", frame) for i, frame in enumerate(frames)]
    for i, frame in enumerate(frames):
        if frame.dtype != np.uint8 or frame.ndim != 3 or frame.shape[-1] != 3:
            raise ValueError(f"frames[{i}] must be uint8 of shape (H, W, 3), got {frame.dtype} {frame.shape}")
        if frame.shape != frames[0].shape:
            raise ValueError(f"frames[{i}] has shape {frame.shape}, frames[0] has {frames[0].shape}")
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"fps must be a finite number > 0, got {fps}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix.lower() == ".mp4" and ffmpeg_available():
        import imageio.v2 as imageio_v2  # the ffmpeg plugin is served through the v2 API

        imageio_v2.mimwrite(path, frames, fps=fps, macro_block_size=1)
        return path
    path = path.with_suffix(".gif")
    # each frame to 256 colours by Pillow's fast octree: 15x faster than the median cut imageio asks for (60 lego
    # frames of 400x800: 0.3 s against 4.5 s on a 2-core CPU), for a preview that looks the same
    images = [Image.fromarray(frame).quantize(256, method=Image.Quantize.FASTOCTREE) for frame in frames]
    images[0].save(path, format="GIF", save_all=True, append_images=images[1:], duration=1000.0 / fps, loop=0)
    return path


# ---------------------------------------------------------------------------------------- labelled panels

_PAD = 4  # pixels: around titles, between panels, after the colour bar's labels
_LINE_HEIGHT = text_mask("Ag|p(0.9)").shape[0]  # pixels of a line of text
_BAR_WIDTH = 12  # pixels of colour in a colour bar
_TICK_LENGTH = 3


@dataclass(frozen=True)
class PanelLayout:
    """Where a titled row of (H, W) panels sits in the (rows, columns) image ``shape``: each panel's title, column
    span [start, stop) (title centred in rows [0, title_height)) and top-left (row, column); the colour bar's top-left
    (H rows by ``_BAR_WIDTH`` columns, top row the high end, bottom row the low) and (row in the bar, label) ticks."""

    shape: tuple[int, int]
    title_height: int
    titles: tuple[str, ...]
    columns: tuple[tuple[int, int], ...]
    panels: tuple[tuple[int, int], ...]
    bar: tuple[int, int] | None
    ticks: tuple[tuple[int, str], ...]


def _bar_ticks(low: float, high: float, height: int) -> tuple[tuple[int, str], ...]:
    """(row, label) ticks of a ``height``-pixel bar, row 0 showing ``high``: both ends, and round values between
    them where they keep clear of the other labels."""
    gap = _LINE_HEIGHT + 2
    ticks: list[tuple[int, str]] = []
    for value in (high, low, *nice_ticks(low, high, max(1, min(5, height // (2 * gap))))[0]):
        row = int(round((high - value) / (high - low) * (height - 1)))
        if len(ticks) < 2 or all(abs(row - kept) >= gap for kept, _ in ticks):
            ticks.append((row, f"{value:.4g}"))
    return tuple(ticks)


def _row_layout(height: int, width: int, titles: Sequence[str], bar_range: tuple[float, float] | None) -> PanelLayout:
    """Layout of titled (height, width) panels side by side, a colour bar for ``bar_range`` (low, high) after them."""
    title_height = _LINE_HEIGHT + 2 * _PAD
    columns, panels, x = [], [], 0
    for title in titles:
        column_width = max(width, text_mask(title).shape[1] + 2 * _PAD)
        columns.append((x, x + column_width))
        panels.append((title_height, x + (column_width - width) // 2))
        x += column_width + _PAD
    bar, ticks = None, ()
    if bar_range is not None:
        bar, ticks = (title_height, x + _PAD), _bar_ticks(*bar_range, height)
        x = bar[1] + _BAR_WIDTH + _TICK_LENGTH + 2 + max(text_mask(label).shape[1] for _, label in ticks) + _PAD
    shape = (title_height + height + _LINE_HEIGHT // 2 + 1, x)  # room below for the bar's low-end label
    return PanelLayout(shape, title_height, tuple(titles), tuple(columns), tuple(panels), bar, ticks)


def _draw_row(panels: Sequence[np.ndarray], layout: PanelLayout) -> np.ndarray:
    """Panels, each (H, W, 3) uint8, drawn on white into ``layout`` with their titles and colour bar: (H', W', 3)."""
    height, width = panels[0].shape[:2]
    canvas = np.full((*layout.shape, 3), 255, np.uint8)  # white; uint8 throughout (the panels are uint8)
    for panel, title, (row, col), (start, stop) in zip(panels, layout.titles, layout.panels, layout.columns):
        canvas[row : row + height, col : col + width] = panel
        draw_text(canvas, title, (start + stop) / 2, layout.title_height / 2)
    if layout.bar is not None:
        row, col = layout.bar
        colors = to_uint8(turbo(1.0 - np.arange(height) / max(height - 1, 1)))  # top row: Turbo(1), the high end
        canvas[row : row + height, col : col + _BAR_WIDTH] = colors[:, None]
        for tick_row, label in layout.ticks:
            canvas[row + tick_row, col + _BAR_WIDTH : col + _BAR_WIDTH + _TICK_LENGTH] = PLOT_INK
            draw_text(canvas, label, col + _BAR_WIDTH + _TICK_LENGTH + 2, row + tick_row, align="left")
    return canvas


def comparison_layout(height: int, width: int, vmax: float | None = None) -> PanelLayout:
    """Where ``comparison_image`` puts the panels, titles and colour bar for (height, width) images."""
    vmax = _error_vmax(vmax)
    titles = ["ground truth", "prediction", f"error |gt - pred| (0 .. {vmax:.4g})"]
    return _row_layout(height, width, titles, (0.0, vmax))


def comparison_image(gt, pred, vmax: float | None = None) -> np.ndarray:
    """Titled ``ground truth | prediction | error`` panels and a colour bar, (H', W', 3) uint8, from (H, W, 3) gt and
    pred (float in [0, 1] or uint8). The error panel is ``error_map(gt, pred, vmax)``: on the fixed scale 0 .. vmax
    (default ``DEFAULT_ERROR_VMAX`` = 0.25) stated in its title and bar. ``comparison_layout`` says where parts are."""
    errors = error_map(gt, pred, vmax)  # validates shapes and vmax first
    images = [to_uint8(_to_unit_float("gt", gt)), to_uint8(_to_unit_float("pred", pred)), errors]
    return _draw_row(images, comparison_layout(*errors.shape[:2], vmax))


def depth_with_legend(depth, near: float, far: float) -> np.ndarray:
    """``colorize_depth(depth, near, far)`` titled, with a colour bar labelled from ``near`` to ``far`` in scene
    units: (H', W', 3) uint8 from (H, W) or (H, W, 1) depth. Black pixels: no depth (NaN or infinite)."""
    colors = colorize_depth(depth, near, far)
    return _draw_row([colors], _row_layout(*colors.shape[:2], ["depth (scene units)"], (float(near), float(far))))
