"""Training's march split by space over two ranks (issue 33; a prototype: the march and its compositing, not yet
the trainer's step).

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
    both = _gather(local, slabs, group)  # (2, B, C + 2)
    rank0_in_front = (directions[:, 0] >= 0)[:, None]
    first = torch.where(rank0_in_front, both[0], both[1])
    second = torch.where(rank0_in_front, both[1], both[0])
    seen = first + (1.0 - first[:, -2:-1]) * second  # every channel, opacity and depth included, composites alike
    return {
        "diffuse": seen[:, :DIFFUSE_CHANNELS],
        "features": seen[:, DIFFUSE_CHANNELS:-2],
        "opacity": seen[:, -2],
        "depth": seen[:, -1],
        "samples": out["samples"],
        # this rank's samples only: a regulariser summed over a ray's samples gets this slab's part of the sum
        "packed": out["packed"],
    }


__all__ = ["Slabs", "SlabPass", "ray_sums", "split_march"]
