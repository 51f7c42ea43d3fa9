"""Where the grids live: the scene box (bounded), or the L-inf scene contraction around it (unbounded scenes).

Contracted (``model.contraction: inf``; mip-NeRF 360's contraction with the L-inf norm, as nerfacto's "inf" and
DirectVoxGO v2): with u the box coordinate of a point (the box is [-1, 1]^3) and m = max |u_a|, the point maps to
u where m <= 1 and to (2 - 1 / m) u / m beyond, so all of space fits the cube [-2, 2]^3 and infinity is its
surface. The grids are cubes of R vertices spanning that cube (``grid_interpolate`` sees it halved, [-1, 1]^3):
the box gets the middle R/2 vertices per axis at full resolution, the shell around it the background out to
infinity at a resolution that falls with distance as 1 / distance^2.

Samples (cuda_ext.march_rays with ``t_split``): from ``near`` every ``step`` (a foreground voxel times
``step_ratio``) up to t_split, the ray's exit from the box (for rays missing the box: its closest approach to the
box's centre), then uniform in disparity about t_split - P (P: the box's smallest half size) out to infinity, which
is a constant step in contracted space for a ray leaving the box: P / step samples reach infinity. Each sample's
optical depth uses its own world-space step, dt/dk: ``step`` on the linear part and
``step * ((t - t_split + P) / P)^2`` beyond (:meth:`SceneSpace.sample_steps`).
"""

from __future__ import annotations

import functools
import math
from typing import Union

import torch

from cuda_ext.reference import contract_points
from models.config import CONTRACTIONS
from models.field import grid_shape, voxel_size
from models.render import num_samples_per_ray, ray_box_intersect

Box = Union[torch.Tensor, tuple[float, ...]]  # a (2, 3) box tensor, or the host's (3,) extent of it (box_radius)
HUGE_STEP = 1e30  # the world step of the cells at infinity (finite, so that 0 density times it stays 0)


def box_radius(box: torch.Tensor | tuple[float, ...]) -> torch.Tensor | float:
    """P: the box's smallest half size, the disparity spacing's radius (as march_rays computes it). A (2, 3) box
    tensor gives a 0-dim tensor; the host's (3,) extent (``model.extent``, the stored box's float32 sides) gives the
    same value as a float, with no device op (a training step asks for it three times)."""
    if isinstance(box, torch.Tensor):
        return ((box[1] - box[0]) * 0.5).min()
    return min(box) * 0.5


def split_distances(origins: torch.Tensor, directions: torch.Tensor, bbox: torch.Tensor, near: float) -> torch.Tensor:
    """(B,) where each of the (B, 3) rays (unit directions) stops being sampled linearly: its exit from the (2, 3)
    box, or for a ray that misses the box the distance of its closest approach to the box's centre; at least near."""
    t_in, t_out = ray_box_intersect(origins, directions, bbox, -math.inf, math.inf)
    closest = ((bbox.mean(0) - origins) * directions).sum(-1)
    return torch.where(t_out > t_in, t_out, closest).clamp(min=near)


class SceneSpace:
    """The grids' space for ``model.contraction`` (``none``: the box; ``inf``: the contracted cube around it)."""

    def __init__(self, contraction: str):
        if contraction not in CONTRACTIONS:
            raise ValueError(f"model.contraction: expected 'none' or 'inf', got {contraction!r}")
        self.contract = contraction == "inf"

    def shape(self, extent: tuple[float, float, float], resolution: int) -> tuple[int, int, int]:
        """Grid vertices per axis at ``resolution``: cubic voxels over the box, or the contracted cube R^3."""
        return (resolution,) * 3 if self.contract else grid_shape(extent, resolution)

    def voxel(self, extent: tuple[float, float, float], shape: tuple[int, ...]) -> float:
        """World edge of a voxel in the box (contracted: the box spans half the grid's vertices per axis)."""
        return voxel_size(extent, shape) * (2.0 if self.contract else 1.0)

    def march_range(
        self,
        origins: torch.Tensor,
        directions: torch.Tensor,
        bbox: torch.Tensor,
        extent: tuple[float, float, float],
        near: float,
        far: float,
        step: float,
        max_samples: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
        """march_rays' ray ranges for (B, 3) rays: t_start (B,), t_end (B,), t_split (B,) or None (bounded), and the
        samples per ray. Bounded: the box chord within [near, far]. Contracted: from near to infinity, linear up to
        :func:`split_distances` (at most far - near of it), then P / step samples in disparity; capped at
        ``max_samples``. ``extent``: the (2, 3) ``bbox``'s edge lengths as the host keeps them (the model's
        ``extent``): read from a CUDA box they would cost a device sync every step."""
        if not self.contract:
            t_start, t_end = ray_box_intersect(origins, directions, bbox, near, far)
            return t_start, t_end, None, num_samples_per_ray(extent, near, far, step, max_samples)
        t_split = split_distances(origins, directions, bbox, near)
        t_start = torch.full_like(t_split, near)
        t_end = torch.full_like(t_split, math.inf)
        linear = math.ceil((far - near) / step)
        disparity = math.ceil(min(extent) / 2 / step) + 1
        return t_start, t_end, t_split, max(1, min(max_samples, linear + disparity))

    def sample_steps(
        self, t: torch.Tensor, ray: torch.Tensor, t_split: torch.Tensor | None, step: float, box: Box
    ) -> torch.Tensor | float:
        """World step of each sample, for its optical depth: ``step`` when bounded (a number), else the (N,) dt/dk
        of the march for samples at t (N,) on rays ``ray`` (N,) with the rays' t_split (B,): step before t_split,
        step ((t - t_split + P) / P)^2 beyond (uniform disparity about t_split - P; P: :func:`box_radius` of ``box``,
        the (2, 3) box or the host's extent)."""
        if t_split is None:
            return step
        return step * ((t - t_split[ray]) / box_radius(box) + 1.0).clamp(min=1.0).square()

    def march_coordinate(
        self, t: torch.Tensor, ray: torch.Tensor, t_split: torch.Tensor | None, box: Box
    ) -> torch.Tensor:
        """(N,) where samples at t (N,) on rays ``ray`` (N,) sit in the march's own coordinate, in which consecutive
        samples are ``step`` apart: t when bounded (or before t_split), else t_split + P (1 - P / (t - t_split + P))
        (the integral of dk/dt = (P / (t - t_split + P))^2, see :meth:`sample_steps`; at most t_split + P)."""
        if t_split is None:
            return t
        split, radius = t_split[ray], box_radius(box)
        beyond = (t - split).clamp(min=0.0)
        return torch.minimum(t, split) + radius * beyond / (beyond + radius)

    def foreground(
        self, shape: tuple[int, int, int], device: torch.device, reach: float = 1.0
    ) -> tuple[torch.Tensor, ...] | None:
        """Per axis, (R_a,) bool: which vertex coordinates lie in the box (contracted: |x| <= 1 of the cube's
        [-2, 2], the middle half, boundary included; ``reach`` in [1, 2]: |x| <= reach, the box and the shell's
        inner part, out to 1 / (2 - reach) box half-sizes); None when bounded (every vertex is in the box)."""
        if not self.contract:
            return None
        return tuple(
            torch.linspace(-2.0, 2.0, r, device=device, dtype=torch.float64).abs() <= reach + 1e-3 / (r - 1)
            for r in shape
        )

    def foreground_ranges(self, shape: tuple[int, int, int]) -> tuple[tuple[int, int], ...] | None:
        """Per axis, the (first, last) vertex index of :meth:`foreground` (a contiguous run: the box is the
        cube's middle half), computed once per shape on the host; None when bounded."""
        if not self.contract:
            return None
        return _foreground_ranges(tuple(shape))

    def foreground_cells(
        self, shape: tuple[int, int, int], device: torch.device, reach: float = 1.0
    ) -> torch.Tensor | None:
        """(R0-1, R1-1, R2-1) bool: the cells of a grid of ``shape`` vertices that lie in the box (all 8 corners in
        :meth:`foreground`, out to ``reach``); None when bounded (every cell is in the box)."""
        axes = self.foreground(shape, device, reach)
        if axes is None:
            return None
        cells = [inside[:-1] & inside[1:] for inside in axes]
        return cells[0][:, None, None] & cells[1][None, :, None] & cells[2][None, None, :]

    def vertex_steps(self, shape: tuple[int, int, int], device: torch.device) -> torch.Tensor | float:
        """Per-vertex factor on the step for the occupancy grid's alpha: 1 (bounded), else (R0, R1, R2) the largest
        (distance / P)^2 over the cells around each vertex (the world step of a disparity sample there, so a cell
        counts as empty only if the largest step in it would leave it transparent); HUGE_STEP at infinity."""
        if not self.contract:
            return 1.0
        axes = [torch.linspace(-2.0, 2.0, r, device=device, dtype=torch.float64).abs() + 4.0 / (r - 1) for r in shape]
        norm = torch.stack(torch.meshgrid(*axes, indexing="ij")).amax(0)  # outermost contracted L-inf norm nearby
        distance = 1.0 / (2.0 - norm).clamp(min=1.0 / math.sqrt(HUGE_STEP))  # the uncontracted norm, m = 2 - 1/n
        return distance.clamp(min=1.0).square().float()


@functools.lru_cache(maxsize=16)
def _foreground_ranges(shape: tuple[int, int, int]) -> tuple[tuple[int, int], ...]:
    runs = [inside.nonzero()[:, 0] for inside in SceneSpace("inf").foreground(shape, torch.device("cpu"))]
    return tuple((int(run[0]), int(run[-1])) for run in runs)


__all__ = ["CONTRACTIONS", "SceneSpace", "box_radius", "contract_points", "split_distances"]
