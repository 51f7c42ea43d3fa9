"""What the live viewer (training/viewer.py) shows, without the viser package: camera conversions between our
cameras and viser's, frame sizes, and one rendered frame as an 8-bit picture.

Conventions. Our cameras are OpenGL camera-to-world matrices (data/rays.py): columns right, up, backward,
position; the camera looks down -z with y up. viser's camera (``client.camera.wxyz`` / ``.position``, and the
pose of ``scene.add_camera_frustum``) is OpenCV-style: the rotation's columns are right, down, forward in
world coordinates (looks down +z, y down). The two differ by flipping the camera's y and z axes:
``R_opencv = R_opengl @ diag(1, -1, -1)``, same position. viser's ``fov`` is the vertical field of view in
radians and ``aspect`` is width / height, so the focal length of an image H pixels high is
``0.5 * H / tan(fov / 2)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from data.rays import camera_rays
from models.model import VoxelNeRF
from models.render_views import infer_march
from training.inference import inference_chunk, render_view
from training.visualize import colorize_depth, to_uint8

MODES = ("rgb", "depth", "opacity", "diffuse")  # what a frame shows (diffuse: deferred shading only)
FLIP_YZ = np.diag([1.0, -1.0, -1.0])  # OpenGL camera axes <-> OpenCV camera axes
MIN_SIDE = 8  # smallest frame side, in pixels


def quaternion_to_matrix(wxyz) -> np.ndarray:
    """Unit quaternion (w, x, y, z) -> (3, 3) rotation matrix (normalised first)."""
    w, x, y, z = np.asarray(wxyz, dtype=np.float64) / np.linalg.norm(wxyz)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def matrix_to_quaternion(rotation) -> np.ndarray:
    """(3, 3) rotation matrix -> unit quaternion (w, x, y, z) with w >= 0 (Shepperd's method: stable)."""
    m = np.asarray(rotation, dtype=np.float64)
    trace = m[0, 0] + m[1, 1] + m[2, 2]
    if trace > 0:
        s = 2.0 * math.sqrt(1.0 + trace)
        q = [0.25 * s, (m[2, 1] - m[1, 2]) / s, (m[0, 2] - m[2, 0]) / s, (m[1, 0] - m[0, 1]) / s]
    elif m[0, 0] > m[1, 1] and m[0, 0] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[0, 0] - m[1, 1] - m[2, 2])
        q = [(m[2, 1] - m[1, 2]) / s, 0.25 * s, (m[0, 1] + m[1, 0]) / s, (m[0, 2] + m[2, 0]) / s]
    elif m[1, 1] > m[2, 2]:
        s = 2.0 * math.sqrt(1.0 + m[1, 1] - m[0, 0] - m[2, 2])
        q = [(m[0, 2] - m[2, 0]) / s, (m[0, 1] + m[1, 0]) / s, 0.25 * s, (m[1, 2] + m[2, 1]) / s]
    else:
        s = 2.0 * math.sqrt(1.0 + m[2, 2] - m[0, 0] - m[1, 1])
        q = [(m[1, 0] - m[0, 1]) / s, (m[0, 2] + m[2, 0]) / s, (m[1, 2] + m[2, 1]) / s, 0.25 * s]
    q = np.asarray(q) / np.linalg.norm(q)
    return -q if q[0] < 0 else q


def viser_to_c2w(wxyz, position) -> np.ndarray:
    """viser camera pose (OpenCV camera-to-world quaternion and position) -> (4, 4) OpenGL c2w (float64)."""
    c2w = np.eye(4)
    c2w[:3, :3] = quaternion_to_matrix(wxyz) @ FLIP_YZ
    c2w[:3, 3] = np.asarray(position, dtype=np.float64)
    return c2w


def c2w_to_viser(c2w) -> tuple[np.ndarray, np.ndarray]:
    """(4, 4) OpenGL c2w -> viser pose (wxyz, position): for frusta and for placing a client's camera."""
    c2w = np.asarray(c2w, dtype=np.float64)
    return matrix_to_quaternion(c2w[:3, :3] @ FLIP_YZ), c2w[:3, 3].copy()


def focal_from_fov(fov: float, height: int) -> float:
    """Focal length in pixels of an image ``height`` pixels high with vertical field of view ``fov`` (radians)."""
    return 0.5 * height / math.tan(0.5 * fov)


def fov_from_focal(focal: float, height: int) -> float:
    """Vertical field of view (radians) of an image ``height`` pixels high with focal length ``focal``."""
    return 2.0 * math.atan(0.5 * height / focal)


def frame_size(max_side: int, aspect: float, multiple: int = 1) -> tuple[int, int]:
    """(height, width) of a frame whose longer side is about ``max_side`` at ``aspect`` = width / height, each a
    multiple of ``multiple`` (the model's upsample factor) and at least MIN_SIDE pixels."""
    if not (math.isfinite(aspect) and aspect > 0):
        aspect = 1.0
    width, height = (max_side, max_side / aspect) if aspect >= 1 else (max_side * aspect, max_side)

    def snap(side: float) -> int:
        return max(math.ceil(MIN_SIDE / multiple) * multiple, round(side / multiple) * multiple)

    return snap(height), snap(width)


def box_edges(bbox) -> np.ndarray:
    """(2, 3) box corners -> (12, 2, 3) line segments along its edges (float32)."""
    low, high = np.asarray(bbox, dtype=np.float64)
    corners = np.array([[(high if (i >> k) & 1 else low)[k] for k in range(3)] for i in range(8)])
    edges = [(i, i | 1 << k) for i in range(8) for k in range(3) if not (i >> k) & 1]
    return np.stack([corners[[a, b]] for a, b in edges]).astype(np.float32)


def available_modes(model: VoxelNeRF) -> tuple[str, ...]:
    """The frame kinds this model can show: per-sample shading composites one view-dependent colour (no
    separate diffuse colour), deferred shading composites the diffuse colour the decoder starts from."""
    return tuple(m for m in MODES if m != "diffuse" or not model.per_sample)


@torch.no_grad()
def render_frame(
    model: VoxelNeRF, c2w, height: int, width: int, focal: float, mode: str, near: float, far: float, chunk: int
) -> np.ndarray:
    """One (height, width, 3) uint8 frame of ``mode`` seen from OpenGL ``c2w``: training.inference's render_view
    (the shared inference path; ``chunk`` raised to its CUDA launch size) for rgb, depth (expected depth where
    the opacity is over 0.5, Turbo colours from near to far, black elsewhere) and opacity (grey); the composited
    diffuse colour over the model's background, marched per pixel (models.render_views.infer_march)."""
    if mode not in MODES:
        raise ValueError(f"render_frame: unknown mode {mode!r} (expected one of {MODES})")
    device = model.bbox.device
    c2w = torch.as_tensor(np.asarray(c2w, dtype=np.float32), device=device)
    if mode == "diffuse":
        if model.per_sample:
            raise ValueError("render_frame: per-sample shading composites no separate diffuse colour")
        origins, directions = (t.reshape(-1, 3) for t in camera_rays(c2w, height, width, focal, 1))
        parts, chunk = [], inference_chunk(device, chunk)
        for start in range(0, origins.shape[0], chunk):
            out = infer_march(model, origins[start : start + chunk], directions[start : start + chunk])
            parts.append(out["diffuse"] + (1.0 - out["opacity"])[:, None] * model.background)
        return to_uint8(torch.cat(parts).clamp(0.0, 1.0).reshape(height, width, 3).cpu())
    out = render_view(model, c2w, height, width, focal, chunk)
    if mode == "rgb":
        return to_uint8(out["rgb"].cpu())
    opacity = out["opacity"].clamp(0.0, 1.0)
    if mode == "opacity":
        return np.repeat(to_uint8(opacity.cpu())[..., None], 3, axis=-1)
    depth = torch.where(opacity > 0.5, out["depth"] / opacity.clamp_min(1e-6), torch.full_like(opacity, math.nan))
    return colorize_depth(depth.cpu().numpy(), near, far)
