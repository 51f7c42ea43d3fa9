"""Training's march split by space over two ranks (issue 33; a prototype: the march and its compositing, not yet
the trainer's step).

Why: data-parallel ranks each pay a step's whole fixed cost (Adam over the occupied voxels, the gradient clears,
the TV) and exchange every touched voxel's gradient. Split by space instead, each rank owns half of the voxels:
it marches, looks up, shades and steps only those, and the ranks exchange a few values per ray.

How: rank 0 owns the grid vertices with x <= p, rank 1 those with x >= p (the vertex plane p is shared). Every rank
marches the whole batch and keeps the samples whose trilinear cell lies in its slab (cell x < p: rank 0), so a
sample's lookups read only its rank's vertices. Compositing is associative: on a ray the front slab's samples
come before the back slab's, so with each slab composited from a transmittance of 1,

    colour = C_front + T_front C_back,  opacity = O_front + T_front O_back,  depth = D_front + T_front D_back,

where T_front = 1 - O_front (rank 0 is in front on rays going towards +x). The back slab's no-grad pass (early
termination, the weight threshold) starts from the front's optical depth (``visible_samples``' start_depth). Two
exchanges a step, of per-ray values only: the no-grad optical depths, and the composited (colour, opacity, depth)
with their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from models.field import cell_coords, optical_depth
from models.regularizers import RenderedSamples
from models.render import PackedSamples

if TYPE_CHECKING:
    from models.model import VoxelNeRF

OPAQUE_DEPTH = 100.0  # visible_samples clips each sample's optical depth at this (cuda_ext._reference_rays)


@dataclass(frozen=True)
class Slabs:
    """Rank ``rank`` of two owns the vertices x <= ``plane`` (rank 0) or x >= ``plane`` (rank 1) of the grids' first
    axis."""

    plane: int
    rank: int

    def __post_init__(self):
        if self.rank not in (0, 1) or self.plane < 1:
            raise ValueError(f"Slabs: rank must be 0 or 1 and plane >= 1, got rank {self.rank}, plane {self.plane}")

    def owns(self, points: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        """(N,) bool: the (N, 3) grid points whose trilinear cell is in this rank's slab."""
        cell = cell_coords(points, shape)[0]
        return cell < self.plane if self.rank == 0 else cell >= self.plane

    def occupancy(self, mask: torch.Tensor) -> torch.Tensor:
        """The (R0-1, R1-1, R2-1) occupancy ``mask`` cut to this rank's slab: marched with it, ``march_rays`` emits
        exactly the samples :meth:`owns` (its cells are the lookups' trilinear cells, its sample positions a lattice
        that the mask only filters), with no filter pass and no count of its own."""
        slab = torch.zeros_like(mask)
        part = slice(None, self.plane) if self.rank == 0 else slice(self.plane, None)
        slab[part] = mask[part]
        return slab

    def in_front(self, directions: torch.Tensor) -> torch.Tensor:
        """(B,) bool: the rays on which this rank's slab comes first (rank 0 towards +x; ties: rank 0)."""
        towards_plus = directions[:, 0] >= 0
        return towards_plus if self.rank == 0 else ~towards_plus


class _GatherRays(torch.autograd.Function):
    """Every rank's (B, C) per-ray values -> (2, B, C). Every rank computes the same loss L from the gathered values
    and backpropagates L / 2: what comes after the exchange (a per-pixel decoder, an appearance transform) then gets
    half its gradient on each rank, which the sum over the ranks makes whole, and rank r's own values get row r of
    the incoming gradient, times 2 (no reduction): their whole gradient."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, rank: int, group) -> torch.Tensor:
        parts = [torch.empty_like(values) for _ in range(2)]
        dist.all_gather(parts, values.contiguous(), group=group)
        ctx.rank = rank
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.rank] * 2.0, None, None


def _gather(values: torch.Tensor, slabs: Slabs, group) -> torch.Tensor:
    return _GatherRays.apply(values, slabs.rank, group)


def split_march(
    model: VoxelNeRF,
    slabs: Slabs,
    origins: torch.Tensor,
    directions: torch.Tensor,
    jitter: torch.Tensor,
    group=None,
    occupancy: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Training's march of B rays ((B, 3) origins and unit directions, (B,) sample offsets) by this rank's slab,
    composited with the other rank's over ``group`` (two ranks) -> dict(diffuse (B, 3), features (B, F-3), depth (B,),
    opacity (B,), samples: () this rank's count, packed: this rank's samples' RenderedSamples), what ``model.march``
    returns up to float rounding (bounded space,
    no pose refinement, no touched-row marks). Every rank passes the same rays."""
    c, space, step = model.config, model.space, model.step_size
    num_rays = origins.shape[0]
    t_start, t_end, t_split, num_samples = space.march_range(
        origins, directions, model.bbox, model.extent, model.near, model.far, step, c.max_samples
    )
    occupancy = slabs.occupancy(model.occupancy.mask) if occupancy is None else occupancy
    ray, t, points, offsets = model.ops.march_rays(
        origins, directions, t_start, t_end, jitter, occupancy, model.bbox, step, num_samples, t_split
    )
    samples = PackedSamples(ray, t, points)  # this slab's samples alone
    step_scale = space.sample_steps(samples.t, samples.ray, t_split, step / model.base_voxel, model.extent)
    front = slabs.in_front(directions)
    keep = None
    if c.early_termination > 0 or c.weight_threshold > 0:
        with torch.no_grad():
            depth = optical_depth(model.query_density(samples.points), c.density_shift, step_scale)
            clipped = depth.clamp(max=OPAQUE_DEPTH)
            totals = torch.zeros(num_rays, dtype=depth.dtype, device=depth.device).index_add_(0, samples.ray, clipped)
            parts = [torch.empty_like(totals) for _ in range(2)]
            dist.all_gather(parts, totals, group=group)
            start = torch.where(front, 0.0, parts[1 - slabs.rank])  # the front slab's optical depth, if not ours
            index, shown, offsets = model.ops.visible_samples(
                depth, offsets, c.early_termination, c.weight_threshold, start_depth=start
            )
            samples = samples.take(index)
            step_scale = step_scale[index] if isinstance(step_scale, torch.Tensor) else step_scale
            keep = shown if c.weight_threshold > 0 else None
    sigma_delta = optical_depth(model.query_density(samples.points), c.density_shift, step_scale)
    shaded = samples if keep is None else samples.take(keep)
    feats = model.query_features(shaded.points)
    values = model.decode_samples(feats, directions, shaded.ray) if model.per_sample else _deferred(feats)
    if keep is not None:
        values = values.new_zeros(len(samples), values.shape[1]).index_copy(0, keep, values)
    colour, opacity, depth = model.ops.volume_render(sigma_delta, values, samples.t, offsets, 0.0)
    local = torch.cat([colour, opacity[:, None], depth[:, None]], 1)
    both = _gather(local, slabs, group)  # (2, B, C + 2)
    rank0_in_front = (directions[:, 0] >= 0)[:, None]
    first = torch.where(rank0_in_front, both[0], both[1])
    second = torch.where(rank0_in_front, both[1], both[0])
    seen = first + (1.0 - first[:, -2:-1]) * second  # every channel, opacity and depth included, composites alike
    march = partial(space.march_coordinate, samples.t, samples.ray, t_split, model.extent)
    return {
        "diffuse": seen[:, :3],
        "features": seen[:, 3:-2],
        "opacity": seen[:, -2],
        "depth": seen[:, -1],
        "samples": torch.tensor(len(samples)),
        # this rank's samples only: a regulariser summed over a ray's samples gets this slab's part of the sum
        "packed": RenderedSamples(samples.ray, samples.t, sigma_delta, step, march, offsets),
    }


def _deferred(feats: torch.Tensor) -> torch.Tensor:
    """Deferred shading's composited channels: the diffuse colour squashed, the rest as they are."""
    return torch.cat([torch.sigmoid(feats[:, :3]), feats[:, 3:]], dim=1)


__all__ = ["Slabs", "split_march"]
