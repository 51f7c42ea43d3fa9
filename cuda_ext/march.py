"""Ray marching into packed samples: the typed wrapper of ``torch.ops.cuda_ext.march_rays`` and its fake kernel.

The kernels (csrc/cpu/march.cpp, csrc/cuda/march.cu; the math in csrc/march.h) write the kept samples of each
ray straight into packed arrays, where the PyTorch reference (cuda_ext.reference.march_rays) builds the dense
(B, S) distances, points and mask and compacts them with nonzero(). Not differentiable: the samples' positions
are data, their densities and colours are what gets trained.
"""

from __future__ import annotations

import torch

from cuda_ext import _step_checks

__all__ = ["march_rays"]


def march_rays(
    origins: torch.Tensor,
    directions: torch.Tensor,
    t_start: torch.Tensor,
    t_end: torch.Tensor,
    offset: torch.Tensor,
    occupancy: torch.Tensor,
    box: torch.Tensor,
    step: float,
    max_samples: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform samples along B rays, kept where the occupancy grid is set, packed ray by ray.

    Sample k < max_samples of ray b lies at ``t = t_start[b] + (k + offset[b]) * step``; it is kept when
    ``t < t_end[b]`` and the occupancy cell holding its box coordinates ``u = (o + t d - lo) * 2 / (hi - lo) - 1``
    is True (cell ``trunc((u + 1) * R / 2)`` per axis, clamped to the grid: points outside use the border cell).
    Each operation is rounded on its own, so the result is bit for bit the reference's.

    Args:
        origins, directions: (B, 3) float32 or float64 rays (directions need not be unit).
        t_start, t_end: (B,) where each ray's samples start and must end before (same dtype and device).
        offset: (B,) each ray's sample offset in [0, 1) (jitter; 0.5 for interval midpoints).
        occupancy: (R0, R1, R2) bool cells over the box, on the rays' device.
        box: (2, 3) the box's min and max corners (the same dtype and device).
        step: distance between samples, a number > 0; max_samples: samples per ray at most, in [1, 2^24].
    Returns:
        ray (N,) int64 in increasing order, t (N,) increasing within each ray, points (N, 3) box coordinates,
        ray_offsets (B + 1,) int64: ray b's samples are [ray_offsets[b], ray_offsets[b + 1]). One device sync
        on CUDA (the output size).
    Raises:
        TypeError / ValueError naming the argument: wrong types, dtypes, shapes or devices, step <= 0,
        max_samples out of range.
    """
    step, max_samples = _step_checks.check_march_inputs(
        origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples
    )
    return torch.ops.cuda_ext.march_rays(origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples)


@torch.library.register_fake("cuda_ext::march_rays")
def _march_rays_fake(origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples):
    _step_checks.check_march_inputs(origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples)
    n = torch.library.get_ctx().new_dynamic_size()  # data-dependent: how many samples the occupancy keeps
    return (
        origins.new_empty((n,), dtype=torch.int64),
        origins.new_empty((n,)),
        origins.new_empty((n, 3)),
        origins.new_empty((origins.shape[0] + 1,), dtype=torch.int64),
    )
