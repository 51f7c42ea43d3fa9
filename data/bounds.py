"""Scene boxes: a tight one from the training views' alpha masks (their visual hull), and one (with near/far)
from a capture's cameras or sparse points, for scenes that come without a box (nerfstudio).

A point can hold the object only if every view that sees it sees it inside the object's silhouette. Carving
the scene box with every view's mask and keeping the bounding box of what is left puts the whole voxel budget
on the object from the first step, instead of waiting for a coarse density that floaters blur (DirectVoxGO
shrinks to its coarse geometry; here the masks the scene ships with say it directly).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from data.scene import Scene


@torch.no_grad()
def mask_hull_box(scene: Scene, resolution: int = 96, threshold: float = 0.05, margin_cells: int = 2) -> torch.Tensor:
    """(2, 3) box of the points of ``scene.bbox`` that no view sees outside its mask, plus a margin.

    Args:
        scene: a split with ``alpha`` (V, H, W) and its cameras (per-view intrinsics and lens, data.rays).
        resolution: probe points per axis over the scene box.
        threshold: alpha below which a pixel is background.
        margin_cells: probe cells added on every side (the hull is sampled, and surfaces have thickness).
    Returns:
        The carved box (float32, on the scene's device), within ``scene.bbox``; ``scene.bbox`` itself when the
        scene has no alpha or nothing survives the carving (e.g. masks that do not match the cameras).
    """
    bbox = scene.bbox.float()
    if scene.alpha is None:
        return bbox
    device = scene.alpha.device
    low, high = bbox[0].to(device), bbox[1].to(device)
    axes = [torch.linspace(float(low[a]), float(high[a]), resolution, device=device) for a in range(3)]
    points = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1).reshape(-1, 3)
    inside = torch.ones(points.shape[0], dtype=torch.bool, device=device)
    limit = round(threshold * 255)
    c2w = scene.c2w.to(device)
    intrinsics = scene.intrinsics.tolist()
    for view in range(scene.num_views):
        rotation, origin = c2w[view, :3, :3], c2w[view, :3, 3]
        fx, fy, cx, cy = intrinsics[view]
        local = (points - origin) @ rotation  # rotation^T (p - o), per point
        depth = -local[:, 2]
        safe = depth.clamp_min(1e-9)
        if scene.lens is None:
            u = cx + fx * local[:, 0] / safe
            v = cy - fy * local[:, 1] / safe
        else:  # distorted: project through the lens (OpenCV axes), points behind the camera dropped below
            opencv = torch.stack([local[:, 0], -local[:, 1], safe], -1)
            distorted = scene.lens.take(torch.tensor(view)).to(device, points.dtype).project(opencv)
            u, v = cx + fx * distorted[:, 0], cy + fy * distorted[:, 1]
        seen = (depth > 0) & (u >= 0) & (u < scene.width) & (v >= 0) & (v < scene.height)
        cols = u.clamp(0, scene.width - 1).long()
        rows = v.clamp(0, scene.height - 1).long()
        background = scene.alpha[view][rows, cols] < limit
        inside &= ~(seen & background)
    if not bool(inside.any()):
        return bbox
    kept = points[inside]
    cell = (high - low) / (resolution - 1)
    box = torch.stack([kept.min(0).values - margin_cells * cell, kept.max(0).values + margin_cells * cell])
    return torch.maximum(torch.minimum(box, high), low).to(scene.bbox.device)


@dataclass
class Bounds:
    """A scene box (2, 3) float64 min and max corners, the rays' near/far, and where they came from; ``extent``:
    None, or (2, 3) how far the capture says the scene reaches (instant-ngp's aabb_scale box), beyond the box."""

    box: np.ndarray
    near: float
    far: float
    source: str
    extent: np.ndarray | None = None

    def describe(self) -> str:
        low, high = (np.round(corner, 3).tolist() for corner in self.box)
        text = f"scene box {low} .. {high} ({self.source}), near {self.near:.3g}, far {self.far:.3g}"
        if self.extent is not None:
            low, high = (np.round(corner, 3).tolist() for corner in self.extent)
            text += f"; the capture's aabb_scale box {low} .. {high}"
        return text


def focus_point(c2w: np.ndarray) -> np.ndarray | None:
    """The point nearest (least squares) to every camera's optical axis, or None when the axes are nearly
    parallel or the point is behind most cameras (a forward-facing capture: no object to look at)."""
    origins, forward = c2w[:, :3, 3], -c2w[:, :3, 2] / np.linalg.norm(c2w[:, :3, 2], axis=-1, keepdims=True)
    projectors = np.eye(3) - forward[:, :, None] * forward[:, None, :]  # I - d d^T per camera
    matrix, rhs = projectors.sum(0), (projectors @ origins[:, :, None]).sum(0)[:, 0]
    eigenvalues = np.linalg.eigvalsh(matrix)
    if eigenvalues[0] < 1e-3 * eigenvalues[-1]:
        return None
    point = np.linalg.solve(matrix, rhs)
    in_front = (((point - origins) * forward).sum(-1) > 0).mean()
    return point if in_front > 0.5 else None


def _box_option(scene_box: float | Sequence[float]) -> np.ndarray:
    if isinstance(scene_box, (int, float)) and not isinstance(scene_box, bool):
        if not scene_box > 0:
            raise ValueError(f"scene_box must be positive, got {scene_box}")
        return np.array([[-scene_box] * 3, [scene_box] * 3], np.float64)
    box = np.asarray(scene_box, np.float64).reshape(-1)
    if box.shape != (6,) or not np.isfinite(box).all() or not (box[3:] > box[:3]).all():
        raise ValueError(f"scene_box must be a half size or 6 numbers (min x y z, max x y z), got {scene_box!r}")
    return box.reshape(2, 3)


def capture_bounds(
    c2w: np.ndarray,
    intrinsics: np.ndarray,
    sizes: np.ndarray,
    points: np.ndarray | None = None,
    scene_box: float | Sequence[float] | None = None,
    near: float | None = None,
    far: float | None = None,
    foreground: bool = False,
) -> Bounds:
    """Scene box and near/far of a capture: (V, 4, 4) cameras, (V, 4) fx, fy, cx, cy, (V, 2) image (h, w).

    The box is ``scene_box`` when given (a half size s: [-s, s]^3; or min and max corners); else the 1st-99th
    percentile box of the sparse ``points`` plus 10% a side when there are at least 10; else a cube around the
    cameras' focus point (:func:`focus_point`) whose half size is the median camera distance times the tangent
    of the wider half field of view (what a camera sees across at the focus: a bounded grid's whole scene), or with
    ``foreground`` of the narrower one (the cube every camera sees whole: a contracted scene's full-resolution
    middle, where the wider one reaches almost to the cameras of a portrait capture; bench/README "The capture
    box, 3500 steps"). ``near`` is 0.9 x the
    smallest camera distance to the box (0 for a camera inside it) and ``far`` 1.1 x the largest distance to a
    box corner, unless given. ValueError when the box cannot be placed or near >= far.
    """
    origins = c2w[:, :3, 3]
    if scene_box is not None:
        box, source = _box_option(scene_box), "data.scene_box"
    elif points is not None and len(points) >= 10:
        low, high = np.percentile(points, [1.0, 99.0], axis=0)
        margin = 0.1 * np.maximum(high - low, 1e-6)
        box, source = np.stack([low - margin, high + margin]), f"{len(points)} sparse points"
    else:
        centre = focus_point(c2w)
        if centre is None:
            raise ValueError(
                "cannot place a scene box from the cameras (their optical axes do not meet in front of them, e.g. "
                "a forward-facing capture): set data.scene_box (and data.near / data.far)"
            )
        half_view = (np.minimum if foreground else np.maximum)(
            sizes[:, 1] / (2 * intrinsics[:, 0]), sizes[:, 0] / (2 * intrinsics[:, 1])
        )
        half = float(np.median(np.linalg.norm(origins - centre, axis=-1) * half_view))
        box, source = np.stack([centre - half, centre + half]), "the cameras' focus"
    outside = np.maximum(np.maximum(box[0] - origins, origins - box[1]), 0.0)
    corners = np.stack(np.meshgrid(*box.T, indexing="ij"), -1).reshape(-1, 3)
    corner_distance = np.linalg.norm(origins[:, None] - corners[None], axis=-1).max()
    near = 0.9 * float(np.linalg.norm(outside, axis=-1).min()) if near is None else float(near)
    far = 1.1 * float(corner_distance) if far is None else float(far)
    if not 0.0 <= near < far:
        raise ValueError(f"need 0 <= near < far, got near={near:g}, far={far:g}")
    return Bounds(box, near, far, source)


__all__ = ["mask_hull_box", "Bounds", "capture_bounds", "focus_point"]
