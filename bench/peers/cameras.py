"""Our cameras in gsplat's conventions.

Ours (data.rays): ``c2w`` camera-to-world in the OpenGL convention (the camera looks down -z, +y up, +x right);
intrinsics (fx, fy, cx, cy) in pixels, pixel (row i, column j) centred at (j + 0.5, i + 0.5).
gsplat: ``viewmats`` world-to-camera in the OpenCV convention (+z forward, +y down, +x right) and ``Ks`` the
3x3 pinhole matrices; it projects a camera-space point to (fx x / z + cx, fy y / z + cy) and evaluates pixel
(i, j) at (j + 0.5, i + 0.5), the same pixel positions as ours. So the only change is flipping the camera's y and
z axes and inverting: a wrong flip renders every view upside down or from behind (nothing at all).
"""

from __future__ import annotations

import torch

# camera axes OpenGL -> OpenCV: x stays, y and z flip
_FLIP = (1.0, -1.0, -1.0)


def viewmats_from_c2w(c2w: torch.Tensor) -> torch.Tensor:
    """(..., 4, 4) OpenGL camera-to-world -> (..., 4, 4) OpenCV world-to-camera (gsplat's ``viewmats``).

    Inverted in float64 (our rotation blocks may carry a uniform scale, so not just a transpose); returns
    c2w's dtype.
    """
    if c2w.shape[-2:] != (4, 4):
        raise ValueError(f"viewmats_from_c2w: c2w must have shape (..., 4, 4), got {tuple(c2w.shape)}")
    flip = torch.tensor(_FLIP + (1.0,), dtype=torch.float64, device=c2w.device)
    opencv_c2w = c2w.to(torch.float64) * flip  # scales the columns: the camera's y and z axes flip
    return torch.linalg.inv(opencv_c2w).to(c2w.dtype)


def intrinsics_matrices(intrinsics: torch.Tensor) -> torch.Tensor:
    """(..., 4) fx, fy, cx, cy -> (..., 3, 3) float32 pinhole matrices (gsplat's ``Ks``)."""
    if intrinsics.shape[-1:] != (4,):
        raise ValueError(f"intrinsics_matrices: intrinsics must be (..., 4), got {tuple(intrinsics.shape)}")
    fx, fy, cx, cy = intrinsics.to(torch.float32).unbind(-1)
    zero, one = torch.zeros_like(fx), torch.ones_like(fx)
    rows = [torch.stack([fx, zero, cx], -1), torch.stack([zero, fy, cy], -1), torch.stack([zero, zero, one], -1)]
    return torch.stack(rows, -2)


def project(viewmats: torch.Tensor, ks: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Pixel positions (u, v) of world points as gsplat projects them: viewmats (..., 4, 4), ks (..., 3, 3),
    points (..., 3) -> (..., 2). Points behind the camera get a negative depth and a mirrored position."""
    camera = (viewmats[..., :3, :3] @ points.unsqueeze(-1)).squeeze(-1) + viewmats[..., :3, 3]
    pixels = (ks @ camera.unsqueeze(-1)).squeeze(-1)
    return pixels[..., :2] / pixels[..., 2:3]


def scene_scale(c2w: torch.Tensor) -> float:
    """The cameras' extent as 3DGS and gsplat measure it: 1.1 x the largest distance of a camera centre from
    their mean. c2w: (V, 4, 4). It scales the means' learning rate and the densification's size thresholds."""
    centres = c2w[:, :3, 3].to(torch.float64)
    spread = torch.linalg.vector_norm(centres - centres.mean(0), dim=-1).max()
    return 1.1 * max(float(spread), 1e-6)
