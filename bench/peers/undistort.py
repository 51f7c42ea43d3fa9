"""Undistorting a capture's images to pinhole, for rasterisers that model pinhole cameras only (3DGS).

OpenCV's model (COLMAP ``OPENCV``; nerfstudio's ``k1..k4, p1, p2``): a normalised pinhole coordinate (x, y)
(OpenCV axes: +x right, +y down, ``x = (u - cx) / fx``) is seen at the distorted coordinate

    x' = x (1 + k1 r^2 + k2 r^4 + k3 r^6 + k4 r^8) + 2 p1 x y + p2 (r^2 + 2 x^2)
    y' = y (1 + k1 r^2 + k2 r^4 + k3 r^6 + k4 r^8) + p1 (r^2 + 2 y^2) + 2 p2 x y,      r^2 = x^2 + y^2

so the undistorted image at pixel position (u, v) is the photo sampled (bilinearly) at (fx x' + cx, fy y' + cy),
with the same intrinsics. Pixel positions follow data.rays: pixel (row i, column j) has its centre at
(j + 0.5, i + 0.5). Where the sample falls outside the photo the edge pixel is repeated (a band of a few pixels
on the fruit capture's borders).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from data.camera_models import COEFFICIENTS, distort


def check_coefficients(coefficients: Mapping[str, float]) -> dict[str, float]:
    """The six OpenCV coefficients as floats (missing ones 0); unknown keys are an error naming them."""
    unknown = sorted(set(coefficients) - set(COEFFICIENTS))
    if unknown:
        raise ValueError(f"distortion coefficients: unknown key(s) {unknown} (expected some of {list(COEFFICIENTS)})")
    return {key: float(coefficients.get(key, 0.0)) for key in COEFFICIENTS}


def opencv_distort(x: torch.Tensor, y: torch.Tensor, coefficients: Mapping[str, float]) -> torch.Tensor:
    """Normalised undistorted coordinates (*S) each -> (*S, 2) distorted coordinates (x', y') (module doc): the
    rays' own model, data.camera_models.distort."""
    c = check_coefficients(coefficients)
    values = torch.tensor([c[key] for key in COEFFICIENTS], dtype=x.dtype, device=x.device)
    return torch.stack(distort(x, y, values), dim=-1)


def undistort_image(
    image: torch.Tensor, intrinsics: torch.Tensor | tuple[float, float, float, float], coefficients: Mapping[str, float]
) -> torch.Tensor:
    """The pinhole image (same size and intrinsics) of a photo taken through OpenCV distortion.

    image: (H, W, C) float or uint8 (uint8 comes back rounded to uint8); intrinsics: fx, fy, cx, cy in pixels.
    Returns (H, W, C) of image's dtype.
    """
    if image.dim() != 3:
        raise ValueError(f"undistort_image: image must be (H, W, C), got shape {tuple(image.shape)}")
    fx, fy, cx, cy = (float(v) for v in (intrinsics.tolist() if torch.is_tensor(intrinsics) else intrinsics))
    if not (fx > 0 and fy > 0):
        raise ValueError(f"undistort_image: intrinsics fx, fy must be positive, got {fx}, {fy}")
    height, width = image.shape[:2]
    rows = torch.arange(height, dtype=torch.float64, device=image.device) + 0.5
    cols = torch.arange(width, dtype=torch.float64, device=image.device) + 0.5
    v, u = torch.meshgrid(rows, cols, indexing="ij")
    distorted = opencv_distort((u - cx) / fx, (v - cy) / fy, coefficients)
    source_u = fx * distorted[..., 0] + cx
    source_v = fy * distorted[..., 1] + cy
    # grid_sample, align_corners=False: -1 and +1 are the image's outer edges, i.e. positions 0 and W (or H)
    grid = torch.stack([2.0 * source_u / width - 1.0, 2.0 * source_v / height - 1.0], dim=-1)
    # positions in float64 (exact to well below a pixel), the sampling itself in float32 (fast on the CPU)
    values = image.permute(2, 0, 1)[None].to(torch.float32)
    out = F.grid_sample(values, grid[None].float(), mode="bilinear", padding_mode="border", align_corners=False)
    out = out[0].permute(1, 2, 0)
    if image.dtype == torch.uint8:
        return out.round().clamp(0, 255).to(torch.uint8)
    return out.to(image.dtype)
