"""Camera rays through pixel positions, for full- and low-resolution renders.

Conventions
-----------
Cameras are pinhole (optionally distorted, below), OpenGL style (as in the NeRF-synthetic "blender" scenes): in
camera space the camera looks down -z, +y is up and +x is right. ``c2w`` maps camera to world: its columns are the
world-space right, up and backward axes and the camera position. Pixel positions are continuous: pixel (row y,
column x) covers [x, x+1) x [y, y+1) and its centre is (x + 0.5, y + 0.5). A camera's intrinsics are (fx, fy, cx,
cy) in pixels: the camera-space direction through position (u, v) is ((u - cx) / fx, -(v - cy) / fy, -1), so the
position (cx, cy) gives the optical axis. A single focal length f stands for (f, f, W/2, H/2) (square pixels,
principal point at the image centre, as in the blender scenes). Returned directions have unit length, so a distance
t along a ray is Euclidean (``near``/``far`` are distances).

A distorted camera adds a :class:`data.camera_models.Lens` (OpenCV radial-tangential or fisheye coefficients,
broadcasting like the intrinsics): the pixel's distorted coordinates ((u - cx) / fx, (v - cy) / fy) are undistorted
into a direction (data/camera_models.py; OpenCV axes there, so y and z flip). Without one (``lens=None``) the
pinhole formula above runs unchanged.

Low-resolution rays and bilinear upsampling (the image-space decoder)
---------------------------------------------------------------------
A decoder renders features at low resolution, one ray per s x s block of target pixels, and upsamples them by s
with ``F.interpolate(x, scale_factor=s, mode="bilinear", align_corners=False)``. That call treats low-res sample
j as sitting at output pixel-index coordinate (j + 0.5) * s - 0.5, i.e. at continuous position s * (j + 0.5):
the centre of block j. So low-res ray (i, j) must pass through continuous position

    (u, v) = (s * (j + 0.5), s * (i + 0.5))          (plus the patch corner (x0, y0) for a patch)

For odd s that is the centre of full-res pixel (s*j + (s-1)/2); for even s it is the corner shared by the four
middle pixels of the block. With the rays placed so, the upsampled features at full-res pixel centre x + 0.5
are the linear interpolation of the two low-res samples whose positions bracket it, which is exact for any
quantity linear in the pixel position. Within s/2 pixels of a patch's border the target pixel lies outside the
outermost low-res positions and ``F.interpolate`` clamps (repeats the edge sample) instead of extrapolating.
"""

from __future__ import annotations

import torch

from data.camera_models import Lens


def as_intrinsics(
    intrinsics: float | torch.Tensor, width: int | None, height: int | None, dtype: torch.dtype, device=None
) -> torch.Tensor:
    """(..., 4) tensor (fx, fy, cx, cy) in ``dtype``: a focal length in pixels becomes (f, f, W/2, H/2) (width and
    height needed); a tensor of intrinsics is converted (its last dimension must be 4)."""
    if isinstance(intrinsics, torch.Tensor):
        if intrinsics.shape[-1:] != (4,):
            raise ValueError(f"intrinsics must have shape (..., 4) (fx, fy, cx, cy), got {tuple(intrinsics.shape)}")
        return intrinsics.to(device=device if device is not None else intrinsics.device, dtype=dtype)
    if width is None or height is None:
        raise ValueError("a focal length needs the image width and height (principal point at the centre)")
    values = (float(intrinsics), float(intrinsics), 0.5 * width, 0.5 * height)
    return torch.tensor(values, dtype=dtype, device=device)


def pixel_rays(
    c2w: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    intrinsics: float | torch.Tensor,
    width: int | None = None,
    height: int | None = None,
    lens: Lens | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rays through continuous pixel positions.

    c2w: (*S, 4, 4) (or broadcastable to that; its first three rows, (*S, 3, 4), are all it reads), u, v: (*S)
    column and row positions in full-res pixel units.
    intrinsics: (*S, 4) (or broadcastable) fx, fy, cx, cy, or a focal length with width and height.
    lens: None (pinhole) or the cameras' distortion, coefficients (*S, 6) or broadcastable.
    Returns origins and unit directions, each (*S, 3), in c2w's dtype.
    """
    rot = c2w[..., :3, :3]
    k = as_intrinsics(intrinsics, width, height, c2w.dtype, c2w.device)
    if lens is None:
        dx = ((u - k[..., 2]) / k[..., 0]).unsqueeze(-1)
        dy = (-(v - k[..., 3]) / k[..., 1]).unsqueeze(-1)
        # rot @ (dx, dy, -1) written as a sum of columns: elementwise, so bit-identical for any thread count
        directions = rot[..., :, 0] * dx + rot[..., :, 1] * dy - rot[..., :, 2]
    else:
        local = lens.to(c2w.device, c2w.dtype).unproject((u - k[..., 2]) / k[..., 0], (v - k[..., 3]) / k[..., 1])
        # OpenCV (x, y, z) is OpenGL (x, -y, -z); with zero distortion this is the pinhole sum bit for bit
        directions = (
            rot[..., :, 0] * local[..., 0:1] - rot[..., :, 1] * local[..., 1:2] - rot[..., :, 2] * local[..., 2:3]
        )
    directions = directions / torch.linalg.vector_norm(directions, dim=-1, keepdim=True)
    origins = c2w[..., :3, 3].expand_as(directions).contiguous()
    return origins, directions


def block_centres(count: int, scale: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """(count,) positions s * (j + 0.5): the centres of consecutive blocks of ``scale`` pixels (see module doc)."""
    return (torch.arange(count, dtype=dtype, device=device) + 0.5) * scale


def camera_rays(
    c2w: torch.Tensor,
    height: int,
    width: int,
    intrinsics: float | torch.Tensor,
    scale: int = 1,
    lens: Lens | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ray per pixel centre (scale=1) or per centre of each s x s pixel block (scale=s).

    c2w: (4, 4) or (..., 4, 4); intrinsics: (4,) or (..., 4) fx, fy, cx, cy of the full-resolution image, or a
    focal length (principal point at the centre); lens: None or coefficients (6,) or (..., 6) (data.camera_models).
    Returns origins and unit directions, each
    (..., height//scale, width//scale, 3).
    With scale=s these are the low-resolution rays whose renders, upsampled by s (bilinear,
    align_corners=False), line up with the full-resolution pixels (see module doc).
    """
    if not isinstance(scale, int) or scale < 1:
        raise ValueError(f"camera_rays: scale must be a positive int, got {scale!r}")
    if height % scale or width % scale:
        raise ValueError(f"camera_rays: height {height} and width {width} must be divisible by scale {scale}")
    if c2w.shape[-2:] != (4, 4):
        raise ValueError(f"camera_rays: c2w must have shape (..., 4, 4), got {tuple(c2w.shape)}")
    dtype = c2w.dtype if c2w.is_floating_point() else torch.float32
    rows = block_centres(height // scale, scale, dtype, c2w.device)
    cols = block_centres(width // scale, scale, dtype, c2w.device)
    v, u = torch.meshgrid(rows, cols, indexing="ij")
    k = as_intrinsics(intrinsics, width, height, dtype, c2w.device)[..., None, None, :]
    if lens is not None:
        lens = Lens(lens.coefficients[..., None, None, :], lens.fisheye)
    return pixel_rays(c2w.to(dtype)[..., None, None, :, :], u, v, k, lens=lens)


def project_to_pixels(
    c2w: torch.Tensor,
    directions: torch.Tensor,
    intrinsics: float | torch.Tensor,
    width: int | None = None,
    height: int | None = None,
    lens: Lens | None = None,
) -> torch.Tensor:
    """Inverse of :func:`pixel_rays` for directions: (*S, 3) world directions -> (*S, 2) positions (u, v).

    c2w: (*S, 4, 4) or broadcastable; intrinsics and lens as for :func:`pixel_rays`. Used to check where rays
    pass.
    """
    rot = c2w[..., :3, :3]
    k = as_intrinsics(intrinsics, width, height, directions.dtype, directions.device)
    local = (rot * directions.unsqueeze(-1)).sum(-2)  # rot^T @ d
    if lens is not None:
        opencv = torch.stack([local[..., 0], -local[..., 1], -local[..., 2]], -1)
        distorted = lens.to(directions.device, directions.dtype).project(opencv)
        return torch.stack([k[..., 2] + k[..., 0] * distorted[..., 0], k[..., 3] + k[..., 1] * distorted[..., 1]], -1)
    depth = -local[..., 2]
    u = k[..., 2] + k[..., 0] * local[..., 0] / depth
    v = k[..., 3] - k[..., 1] * local[..., 1] / depth
    return torch.stack([u, v], dim=-1)
