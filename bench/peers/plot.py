"""Held-out PSNR against training seconds, one curve per method on the same axes (a PNG, no matplotlib: drawn
with the helpers of training.plots, as the runs' own curves are)."""

from __future__ import annotations

import os

import imageio.v3 as iio
import numpy as np

from training.evaluation import spread_views
from training.plots import PLOT_BACKGROUND, PLOT_GRID, PLOT_INK, draw_text, nice_ticks, polyline_pixels, tick_label

# one colour per method, in order (colour-blind safe: Okabe-Ito)
COLOURS = np.array(
    [[0, 114, 178], [213, 94, 0], [0, 158, 115], [204, 121, 167], [230, 159, 0], [86, 180, 233]], np.float64
)
MARGINS = {"left": 64, "right": 20, "top": 36, "bottom": 48}


DEFAULT_CURVE_VIEWS = 4  # train.eval_views' default, for curve points that do not say how many views they used


def _on_curve_views(point: dict, entry: dict, total: int | None, count: int) -> float:
    """A curve point's PSNR on the curve's ``count`` spread views: as recorded for a periodic point, or, for the
    final evaluation on every view (``total``), the mean of its per-view PSNRs over those ``count`` views (the
    periodic evaluations' view subset, so one line never mixes two view sets)."""
    views = point.get("views")
    if total is None or views is None or views != total or views == count:
        return point["psnr"]
    final = next((e for e in entry.get("evaluations", []) if e.get("step") == point.get("step")), None)
    per_view = {v["view"]: v["psnr"] for v in (final or {}).get("per_view") or [] if "view" in v}
    subset = spread_views(total, count)
    if not all(view in per_view for view in subset):
        return point["psnr"]
    return float(np.mean([per_view[view] for view in subset]))


def method_curves(content: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per method in a results file, its curve as (training seconds, PSNR) arrays sorted by time, every point on
    the periodic evaluations' view subset (:func:`_on_curve_views`; the table keeps the all-view finals)."""
    curves, total = {}, content.get("eval_views")
    for name, entry in content.get("methods", {}).items():
        curve = entry.get("curve", [])
        counts = [p["views"] for p in curve if p.get("views") not in (None, total)]
        count = min(counts) if counts else DEFAULT_CURVE_VIEWS
        points = sorted((p["train_seconds"], _on_curve_views(p, entry, total, count)) for p in curve)
        if points:
            curves[name] = (np.array([p[0] for p in points], float), np.array([p[1] for p in points], float))
    return curves


def _range(values: np.ndarray, low_floor: float | None = None) -> tuple[float, float]:
    low, high = float(values.min()), float(values.max())
    if low_floor is not None:
        low = min(low, low_floor)
    span = max(high - low, 1e-6)
    return low - 0.05 * span, high + 0.05 * span


def plot_methods(
    curves: dict[str, tuple[np.ndarray, np.ndarray]], path: str | os.PathLike, title: str, size=(720, 440)
) -> None:
    """Write the curves (name -> (seconds, PSNR)) as one PNG with axes from 0 s, a legend, a marker per point."""
    if not curves:
        raise ValueError("plot_methods: no curve to draw (every method's curve is empty)")
    if len(curves) > len(COLOURS):
        raise ValueError(f"plot_methods: at most {len(COLOURS)} methods, got {len(curves)}")
    width, height = size
    left, right, top, bottom = (MARGINS[k] for k in ("left", "right", "top", "bottom"))
    plot_w, plot_h = width - left - right, height - top - bottom
    xs = np.concatenate([c[0] for c in curves.values()])
    ys = np.concatenate([c[1] for c in curves.values()])
    if not (np.isfinite(xs).all() and np.isfinite(ys).all()):
        raise ValueError("plot_methods: curves must be finite (training seconds and PSNR)")
    x_low, x_high = _range(xs, low_floor=0.0)
    y_low, y_high = _range(ys)

    def to_px(x):
        return left + (x - x_low) / (x_high - x_low) * (plot_w - 1)

    def to_py(y):
        return top + (y_high - y) / (y_high - y_low) * (plot_h - 1)

    canvas = np.broadcast_to(PLOT_BACKGROUND, (height, width, 3)).copy()
    for axis, (low, high) in (("x", (x_low, x_high)), ("y", (y_low, y_high))):
        ticks, step = nice_ticks(low, high)
        for tick in ticks:
            if axis == "x":
                column = int(round(to_px(tick)))
                canvas[top : top + plot_h, column] = PLOT_GRID
                draw_text(canvas, tick_label(tick, step), column, top + plot_h + 12)
            else:
                row = int(round(to_py(tick)))
                canvas[row, left : left + plot_w] = PLOT_GRID
                draw_text(canvas, tick_label(tick, step), left - 7, row, align="right")
    canvas[top : top + plot_h, left - 1] = PLOT_INK
    canvas[top + plot_h, left - 1 : left + plot_w] = PLOT_INK

    for index, (name, (x, y)) in enumerate(curves.items()):
        colour = COLOURS[index]
        px, py = polyline_pixels(to_px(x), to_py(y))
        for dx, dy in ((0, 0), (1, 0), (0, 1), (1, 1)):
            col = np.clip(np.round(px).astype(np.int64) + dx, left, left + plot_w - 1)
            row = np.clip(np.round(py).astype(np.int64) + dy, top, top + plot_h - 1)
            canvas[row, col] = colour
        for cx, cy in zip(to_px(x), to_py(y)):  # a 5x5 marker per evaluation
            rows = slice(max(int(round(cy)) - 2, top), min(int(round(cy)) + 3, top + plot_h))
            cols = slice(max(int(round(cx)) - 2, left), min(int(round(cx)) + 3, left + plot_w))
            canvas[rows, cols] = colour
        # the legend in the lower right, where rising PSNR curves rarely are
        legend_y = top + plot_h - 12 - 16 * (len(curves) - 1 - index)
        canvas[legend_y - 1 : legend_y + 2, left + plot_w - 150 : left + plot_w - 130] = colour
        draw_text(canvas, name, left + plot_w - 124, legend_y, align="left")

    draw_text(canvas, title, left + plot_w / 2, top / 2)
    draw_text(canvas, "training seconds (evaluation excluded)", left + plot_w / 2, height - 12)
    draw_text(canvas, "held-out PSNR (dB)", 14, top + plot_h / 2, rotate=True)
    iio.imwrite(path, np.clip(np.round(canvas), 0, 255).astype(np.uint8))


def plot_results(content: dict, path: str | os.PathLike) -> None:
    """The plot of a results file (bench.peers.results)."""
    scene, device = content.get("scene", "?"), content.get("device", "?")
    title = f"{scene}: held-out PSNR (periodic eval views) vs training time ({device})"
    plot_methods(method_curves(content), path, title)
