"""A tight scene box from the training views' alpha masks (their visual hull).

A point can hold the object only if every view that sees it sees it inside the object's silhouette. Carving
the scene box with every view's mask and keeping the bounding box of what is left puts the whole voxel budget
on the object from the first step, instead of waiting for a coarse density that floaters blur (DirectVoxGO
shrinks to its coarse geometry; here the masks the scene ships with say it directly).
"""

from __future__ import annotations

import torch

from data.scene import Scene


@torch.no_grad()
def mask_hull_box(scene: Scene, resolution: int = 96, threshold: float = 0.05, margin_cells: int = 2) -> torch.Tensor:
    """(2, 3) box of the points of ``scene.bbox`` that no view sees outside its mask, plus a margin.

    Args:
        scene: a split with ``alpha`` (V, H, W) and pinhole cameras (data.rays conventions).
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
    for view in range(scene.num_views):
        rotation, origin = c2w[view, :3, :3], c2w[view, :3, 3]
        local = (points - origin) @ rotation  # rotation^T (p - o), per point
        depth = -local[:, 2]
        safe = depth.clamp_min(1e-9)
        u = 0.5 * scene.width + scene.focal * local[:, 0] / safe
        v = 0.5 * scene.height - scene.focal * local[:, 1] / safe
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


__all__ = ["mask_hull_box"]
