"""Ray marching into packed samples: the typed wrapper of ``torch.ops.cuda_ext.march_rays`` and its fake kernel.

Two spaces: bounded (the occupancy grid spans the box; samples uniform in t) and contracted (``t_split`` given:
the grid spans the L-inf scene contraction of mip-NeRF 360 / DirectVoxGO v2 around the box, the cube [-2, 2]^3
as the grid's [-1, 1]^3; samples uniform in t up to ``t_split``, then uniform in disparity out to infinity).

The kernels (csrc/cpu/march.cpp, csrc/cuda/march.cu; the math in csrc/march.h) write the kept samples of each
ray straight into packed arrays, where the PyTorch reference (cuda_ext.reference.march_rays) builds the dense
(B, S) distances, points and mask and compacts them with nonzero(). Not differentiable: the samples' positions
are data, their densities and colours are what gets trained.
"""

from __future__ import annotations

import torch

from cuda_ext import _step_checks

__all__ = ["march_rays", "march_rays_capped"]


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
    t_split: torch.Tensor | None = None,
    slab: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples along B rays, kept where the occupancy grid is set, packed ray by ray.

    Bounded (``t_split`` None): sample k < max_samples of ray b lies at ``t = t_start[b] + (k + offset[b]) * step``;
    its point is the box coordinate ``u = (o + t d - lo) * 2 / (hi - lo) - 1``.
    Contracted (``t_split`` given): the first ``K = clamp(ceil((t_split[b] - t_start[b]) / step - offset[b]), 0,
    max_samples)`` samples are those linear ones; sample k >= K lies at ``t = (t_split[b] - P) + P / den`` with
    ``den = 1 - (k - K + offset[b]) * (step / P)`` (P: the box's smallest half size), uniform in disparity about
    ``t_split[b] - P`` with the linear step at ``t_split[b]``, while den > 0 (den -> 0: t -> infinity). Its point is
    the contracted coordinate ``u * ((2 - 1 / m) / m) / 2`` with ``m = max |u_a|`` where m > 1, else ``u / 2``: the
    box is the grid's middle [-0.5, 0.5]^3 and infinity its border.
    A sample is kept when the occupancy cell holding its point is True (cell ``trunc((p + 1) * R / 2)`` per axis,
    clamped to the grid) and, with a ``slab``, its cell along the first axis lies in it; the ray ends at its first
    sample with ``t >= t_end[b]`` (or den <= 0). Each operation is rounded on its own, so the result is bit for bit
    the reference's. A slab (a rank's part of the grid, models.space_split) also saves work: in the bounded space
    each ray walks only its samples near the slab, not its whole chord.

    Args:
        origins, directions: (B, 3) float32 or float64 rays (directions need not be unit).
        t_start, t_end: (B,) where each ray's samples start and must end before (same dtype and device).
        offset: (B,) each ray's sample offset in [0, 1) (jitter; 0.5 for interval midpoints).
        occupancy: (R0, R1, R2) bool cells over the box, on the rays' device.
        box: (2, 3) the box's min and max corners (the same dtype and device).
        step: distance between samples, a number > 0; max_samples: samples per ray at most, in [1, 2^24].
        t_split: None (bounded), or (B,) where each ray's linear spacing ends (same dtype and device; contracted).
        slab: None, or two ints [first, end): the occupancy's first-axis cells a sample may be kept in,
            0 <= first < end <= R0.
    Returns:
        ray (N,) int64 in increasing order, t (N,) increasing within each ray, points (N, 3) grid coordinates,
        ray_offsets (B + 1,) int64: ray b's samples are [ray_offsets[b], ray_offsets[b + 1]). One device sync
        on CUDA (the output size).
    Raises:
        TypeError / ValueError naming the argument: wrong types, dtypes, shapes or devices, step <= 0,
        max_samples out of range, a slab that is not two ints in range.
    """
    step, max_samples = _step_checks.check_march_inputs(
        origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split
    )
    slab = _step_checks.check_march_slab(slab, occupancy)
    return torch.ops.cuda_ext.march_rays(
        origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split, slab
    )


def march_rays_capped(
    origins: torch.Tensor,
    directions: torch.Tensor,
    t_start: torch.Tensor,
    t_end: torch.Tensor,
    offset: torch.Tensor,
    occupancy: torch.Tensor,
    box: torch.Tensor,
    step: float,
    max_samples: int,
    capacity: int,
    t_split: torch.Tensor | None = None,
    slab: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`march_rays`' samples in outputs of a fixed size, with no device sync: what a CUDA graph can replay.

    The first ``capacity`` samples in march_rays' packed order fill the first rows; ``ray_offsets`` are clamped to
    ``capacity``, so a batch with more samples keeps every ray whole up to the one that crosses it (cut short) and
    gives the rays after it no samples. The rows past the samples are padding: ray ``max(B - 1, 0)`` (the indices
    stay non-decreasing and valid), t 0, point 0 (the grid's centre); no ray's range covers them.

    Args:
        as :func:`march_rays`, and capacity: the outputs' row count, an int >= 0.
    Returns:
        ray (C,) int64, t (C,), points (C, 3), ray_offsets (B + 1,) int64 clamped to C, and total (1,) int64: the
        samples march_rays would return (total > C: an overflow, the caller's to act on when it next syncs).
    Raises:
        TypeError / ValueError naming the argument, as march_rays; capacity not an int >= 0.
    """
    capacity = _step_checks.check_capacity(capacity)
    step, max_samples = _step_checks.check_march_inputs(
        origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split, op="march_rays_capped"
    )
    slab = _step_checks.check_march_slab(slab, occupancy, op="march_rays_capped")
    return torch.ops.cuda_ext.march_rays_capped(
        origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, capacity, t_split, slab
    )


@torch.library.register_fake("cuda_ext::march_rays")
def _march_rays_fake(
    origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split=None, slab=None
):
    _step_checks.check_march_inputs(
        origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split
    )
    _step_checks.check_march_slab(slab, occupancy)
    n = torch.library.get_ctx().new_dynamic_size()  # data-dependent: how many samples the occupancy keeps
    return (
        origins.new_empty((n,), dtype=torch.int64),
        origins.new_empty((n,)),
        origins.new_empty((n, 3)),
        origins.new_empty((origins.shape[0] + 1,), dtype=torch.int64),
    )


@torch.library.register_fake("cuda_ext::march_rays_capped")
def _march_rays_capped_fake(
    origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, capacity, t_split=None, slab=None
):
    capacity = _step_checks.check_capacity(capacity)
    _step_checks.check_march_inputs(
        origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split, op="march_rays_capped"
    )
    _step_checks.check_march_slab(slab, occupancy, op="march_rays_capped")
    return (
        origins.new_empty((capacity,), dtype=torch.int64),
        origins.new_empty((capacity,)),
        origins.new_empty((capacity, 3)),
        origins.new_empty((origins.shape[0] + 1,), dtype=torch.int64),
        origins.new_empty((1,), dtype=torch.int64),
    )
