"""Training's march split by space over two ranks (issue 33; the trainer's side: training.space_parallel).

Why: data-parallel ranks each pay a step's whole fixed cost (Adam over the occupied voxels, the gradient clears,
the TV) and exchange every touched voxel's gradient. Split by space instead, each rank owns half of the voxels:
it marches, looks up, shades and steps only those, and the ranks exchange a few values per ray.

How: rank 0 owns the grid vertices with x <= p, rank 1 those with x >= p (the vertex plane p is shared). Every rank
marches the whole batch through the occupancy cut to its slab, so it emits only the samples whose trilinear cell
lies there (cell x < p: rank 0), and a sample's lookups read only its rank's vertices. Compositing is associative:
on a ray the front slab's samples come before the back slab's, so with each slab composited from a transmittance
of 1,

    colour = C_front + T_front C_back,  opacity = O_front + T_front O_back,  depth = D_front + T_front D_back,

where T_front = 1 - O_front (rank 0 is in front on rays going towards +x). The back slab's no-grad pass (early
termination, the weight threshold) starts from the front's optical depth (``visible_samples``' start_depth). Two
exchanges a step, of per-ray values only: the no-grad optical depths, and the composited (colour, opacity, depth)
with their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from models import render_views
from models.decoder import DIFFUSE_CHANNELS
from models.field import cell_coords

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


class _CompositeSlabs(torch.autograd.Function):
    """This rank's (B, C) per-ray values (colour, features, opacity, depth: the opacity in column C - 2), composited
    with the other rank's, exchanged: -> the rays' (B, C) values, split as (diffuse, features, opacity, depth).

    Every rank computes the same loss L from the composite and backpropagates L / 2: what comes after the exchange
    (a per-pixel decoder, an appearance transform) then gets half its gradient on each rank, which the sum over the
    ranks makes whole, and this rank's own values get their whole gradient (twice the half). One node with its
    backward written out, where the gather, the front/back selects, the composite and the column slices were ~20
    autograd nodes: ~40 host calls a step on the rank's critical path."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, in_front: torch.Tensor, rank: int, group) -> tuple[torch.Tensor, ...]:
        values = values.contiguous()
        parts = [torch.empty_like(values) for _ in range(2)]
        dist.all_gather(parts, values, group=group)
        mine = in_front[:, None]
        first = torch.where(mine, values, parts[1 - rank])
        second = torch.where(mine, parts[1 - rank], values)
        seen = torch.addcmul(first, 1.0 - first[:, -2:-1], second)  # every channel, opacity and depth included
        ctx.save_for_backward(mine, first, second)
        ctx.features = values.shape[1] - DIFFUSE_CHANNELS - 2
        diffuse, features, opacity, depth = seen.split([DIFFUSE_CHANNELS, ctx.features, 1, 1], 1)
        return diffuse, features, opacity.squeeze(1), depth.squeeze(1)

    @staticmethod
    def backward(ctx, diffuse, features, opacity, depth):
        mine, first, second = ctx.saved_tensors
        grad = torch.cat([diffuse, features, opacity[:, None], depth[:, None]], 1)
        through_front = grad.clone()  # d seen / d first: 1, and on the opacity -sum_c grad_c second_c
        through_front[:, -2] -= (grad * second).sum(1)
        through_back = grad * (1.0 - first[:, -2:-1])  # d seen / d second: the front's transmittance
        return torch.where(mine, through_front, through_back) * 2.0, None, None, None


@dataclass(frozen=True)
class SlabPass:
    """What :func:`models.render_views.march` needs to march one rank's slab: the occupancy cut to it
    (:meth:`Slabs.occupancy`) and, before the no-grad pass, the front slab's optical depth on each ray."""

    occupancy: torch.Tensor
    front: torch.Tensor  # (B,) bool: the rays on which this slab comes first
    rank: int
    group: Any = None

    def start_depth(self, depth: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(B,) the optical depth in front of this slab's samples on each ray: 0 where this slab is in front, else
        the other slab's clamped sum, exchanged (this rank sends its own: the (N,) optical depths of its samples,
        packed by ray along the (B + 1,) ``offsets``, the rows past ``offsets[-1]`` padding)."""
        totals = ray_sums(depth.clamp(max=OPAQUE_DEPTH), offsets)
        parts = [torch.empty_like(totals) for _ in range(2)]
        dist.all_gather(parts, totals, group=self.group)
        return torch.where(self.front, 0.0, parts[1 - self.rank])


def ray_sums(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(N,) values of samples packed by ray, (B + 1,) offsets ending at most at N -> (B,) each ray's sum, the rows
    past ``offsets[-1]`` (padding) left out. A difference of float64 prefix sums, not an ``index_add``: padding rows
    all name the last ray, and millions of atomics on one address serialise."""
    prefix = torch.cat([values.new_zeros(1, dtype=torch.float64), values.double().cumsum(0)])
    return (prefix[offsets[1:]] - prefix[offsets[:-1]]).to(values.dtype)


def split_march(
    model: VoxelNeRF,
    slabs: Slabs,
    origins: torch.Tensor,
    directions: torch.Tensor,
    jitter: torch.Tensor,
    group=None,
    occupancy: torch.Tensor | None = None,
    views: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Training's march of B rays ((B, 3) origins and unit directions, (B,) sample offsets, optional (B,) training
    images) by this rank's slab, composited with the other rank's over ``group`` (two ranks) -> dict(diffuse (B, 3),
    features (B, F-3), depth (B,), opacity (B,), samples: this rank's count, packed: this rank's samples'
    RenderedSamples), what ``model.march`` returns up to float rounding (bounded space, no pose refinement, no
    touched-row marks). Every rank passes the same rays; ``occupancy``: the occupancy mask cut to the slab
    (:meth:`Slabs.occupancy`, kept by the caller between refreshes), else cut here. The slab's own march is
    :func:`models.render_views.march` (with ``model.capped_samples``, in fixed sample capacities)."""
    occupancy = slabs.occupancy(model.occupancy.mask) if occupancy is None else occupancy
    slab = SlabPass(occupancy, slabs.in_front(directions), slabs.rank, group)
    out = render_views.march(model, origins, directions, jitter, views, slab=slab)
    local = torch.cat([out["diffuse"], out["features"], out["opacity"][:, None], out["depth"][:, None]], 1)
    diffuse, features, opacity, depth = _CompositeSlabs.apply(local, slab.front, slabs.rank, group)
    return {
        "diffuse": diffuse,
        "features": features,
        "opacity": opacity,
        "depth": depth,
        "samples": out["samples"],
        # this rank's samples only: a regulariser summed over a ray's samples gets this slab's part of the sum
        "packed": out["packed"],
    }


__all__ = ["Slabs", "SlabPass", "ray_sums", "split_march"]
