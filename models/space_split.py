"""Training's march split by space over S ranks (issue 33; the trainer's side: training.space_parallel).

Why: data-parallel ranks each pay a step's whole fixed cost (Adam over the occupied voxels, the gradient clears,
the TV) and exchange every touched voxel's gradient. Split by space instead, each rank owns a slab of the voxels:
it marches, looks up, shades and steps only those, and the ranks exchange a few values per ray.

How: the grids' first axis is cut at S - 1 vertex planes; rank r owns the vertices from plane r to plane r + 1
(neighbours share their plane) and the cells between them (:class:`Slabs`). Every rank marches the whole batch
with its slab's cells (``march_rays``' slab: each ray walks only its samples near them), so it emits only the
samples whose trilinear cell lies there, and a sample's lookups read only its rank's vertices. Compositing is
associative: along a ray the slabs come in rank order (towards +x) or the reverse, and with each slab composited
from a transmittance of 1,

    colour = sum_k T_k C_k,  opacity = sum_k T_k O_k,  depth = sum_k T_k D_k,  T_k = prod_{j<k} (1 - O_j)

over the slabs k by position. A slab's no-grad pass (early termination, the weight threshold) starts from the
optical depth of the slabs in front (``visible_samples``' start_depth). Two exchanges a step, of per-ray values
only: the no-grad optical depths, and the composited (colour, opacity, depth) with their gradients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from models import render_views
from models.decoder import DIFFUSE_CHANNELS
from models.field import cell_corners, cell_index

if TYPE_CHECKING:
    from models.model import VoxelNeRF

# torch >= 2.14 names it all_gather_single; torch 2.4 - 2.13 have all_gather_into_tensor alone (same arguments)
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
OPAQUE_DEPTH = 100.0  # visible_samples clips each sample's optical depth at this (cuda_ext._reference_rays)
# one row that Adam steps (train.sparse_adam=occupied, both grids), in shaded samples' work: 0.158 ns a row against
# ~4.8 ns a shaded sample's decoding and lookups (bench/rank_alone.py profiles, one H200, lego, 2026-11-29)
ROW_WORK = 0.033


@dataclass(frozen=True)
class Slabs:
    """Rank ``rank`` of ``len(planes) + 1`` owns a slab of the grids' first axis: the vertices from plane ``rank``
    to plane ``rank + 1`` (``planes``: the interior vertex planes, increasing; the grid's first and last vertex
    close the outer slabs), and the cells between them. Neighbours share their plane's vertices, not its cells."""

    planes: tuple[int, ...]
    rank: int

    def __post_init__(self):
        edges = (0, *self.planes)
        if not 0 <= self.rank <= len(self.planes) or not self.planes or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(
                f"Slabs: planes must be increasing and >= 1, rank in [0, {len(self.planes)}], got planes "
                f"{self.planes}, rank {self.rank}"
            )

    @staticmethod
    def even(vertices: int, ranks: int, rank: int) -> Slabs:
        """``ranks`` slabs of a first axis of ``vertices`` vertices, as even as whole cells allow."""
        return Slabs(tuple(k * vertices // ranks for k in range(1, ranks)), rank)

    @staticmethod
    def balanced(layers: torch.Tensor, ranks: int, rank: int) -> Slabs:
        """``ranks`` slabs cut where the (R0 - 1,) weights of the first axis's cell layers (the work each brings)
        reach k / ranks of their sum, each slab at least one cell layer wide; even slabs for weights summing to 0."""
        cells = layers.numel()
        cumulative = layers.double().cumsum(0)
        total = float(cumulative[-1]) if cells else 0.0
        if total <= 0:
            return Slabs.even(cells + 1, ranks, rank)
        planes: list[int] = []
        for k in range(1, ranks):
            plane = int(torch.searchsorted(cumulative, k * total / ranks)) + 1  # the cells before it hold k / ranks
            planes.append(min(max(plane, planes[-1] + 1 if planes else 1), cells - (ranks - k)))
        return Slabs(tuple(planes), rank)

    @property
    def ranks(self) -> int:
        return len(self.planes) + 1

    @property
    def cells(self) -> tuple[int, int | None]:
        """(first, end) cells of this slab on the first axis (end None: to the grid's last cell)."""
        first = self.planes[self.rank - 1] if self.rank > 0 else 0
        return first, self.planes[self.rank] if self.rank < len(self.planes) else None

    def owns(self, points: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
        """(N,) bool: the (N, 3) grid points whose trilinear cell is in this rank's slab."""
        cell, (first, end) = cell_index(points[:, 0], shape[0]), self.cells
        return (cell >= first) & (cell < end) if end is not None else cell >= first

    def march_cells(self, count: int) -> tuple[int, int]:
        """[first, end) of this slab's cells along a first axis of ``count`` cells: ``march_rays``' slab, with which
        it emits exactly the samples :meth:`owns` (its cells are the lookups' trilinear cells), with no filter pass
        and no count of its own."""
        first, end = self.cells
        return first, count if end is None else end


def regrid_layers(counts: torch.Tensor, span: tuple[float, float], new_span: tuple[float, float], cells: int):
    """(C,) counts over the C equal cell layers of ``span`` (the first axis's world interval) -> (cells,) float64
    over ``cells`` equal layers of ``new_span``: each new layer gets the counts its interval overlaps, a count
    spread evenly over its layer (the grids grow and their box may move between the count and the cut)."""
    old = torch.linspace(span[0], span[1], counts.numel() + 1, dtype=torch.float64)
    cumulative = torch.nn.functional.pad(counts.double().cpu().cumsum(0), (1, 0))  # (C + 1,) at the old edges
    new = torch.linspace(new_span[0], new_span[1], cells + 1, dtype=torch.float64).clamp(span[0], span[1])
    index = torch.searchsorted(old, new, right=True).clamp(1, counts.numel())  # the old layer each new edge is in
    lower, upper = old[index - 1], old[index]
    fraction = ((new - lower) / (upper - lower).clamp(min=1e-300)).clamp(0, 1)
    at = cumulative[index - 1] + fraction * (cumulative[index] - cumulative[index - 1])
    return at.diff()


def work_layers(shaded: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(C,) shaded samples a step per first-axis cell layer and the (C, R1-1, R2-1) occupancy mask -> (C,) float64
    CPU, a rank's work per layer: the samples, plus :data:`ROW_WORK` for each grid row Adam steps there (the corners
    of occupied cells; a vertex plane's rows count in the cell layer after it, the last plane's in the last layer)."""
    if mask.dim() != 3 or mask.shape[0] != shaded.numel():
        cells, shape = shaded.numel(), tuple(mask.shape)
        raise ValueError(f"work_layers: mask must have {cells} first-axis cells, got shape {shape}")
    rows = cell_corners(mask).sum((1, 2)).double().cpu()  # (C + 1,) by vertex plane
    rows[-2] += rows[-1]
    return shaded.double().cpu() + ROW_WORK * rows[:-1]


def gather_ranks(values: torch.Tensor, ranks: int, group) -> torch.Tensor:
    """(S, *values.shape): every rank's ``values``, by rank, in one buffer (one collective, no copies out)."""
    parts = values.new_empty((ranks * values.shape[0], *values.shape[1:]))  # gloo takes the parts end to end only
    ALL_GATHER(parts, values.contiguous(), group=group)
    return parts.view(ranks, *values.shape)


def _composite(slabs: list[torch.Tensor]) -> torch.Tensor | None:
    """(B, C) per-ray values of slabs in ray order (the opacity in column C - 2), each composited from a
    transmittance of 1 -> the whole run's (None for no slabs)."""
    out = None
    for values in reversed(slabs):
        out = values if out is None else torch.addcmul(values, 1.0 - values[:, -2:-1], out)
    return out


def _transmittance(slabs: list[torch.Tensor]) -> torch.Tensor | None:
    """(B, 1) the transmittance through ``slabs`` (None for no slabs: 1)."""
    out = None
    for values in slabs:
        clear = 1.0 - values[:, -2:-1]
        out = clear if out is None else out * clear
    return out


def _per_ray(plus: torch.Tensor, on_plus: torch.Tensor | None, on_minus: torch.Tensor | None, empty: float):
    """(B, C) ``on_plus`` on the rays towards +x, ``on_minus`` on the others; None stands for ``empty`` everywhere
    (a slab with none in front or behind on those rays: no op spent on it)."""
    if on_plus is None and on_minus is None:
        return None
    first = on_plus if on_plus is not None else empty
    second = on_minus if on_minus is not None else empty
    return torch.where(plus[:, None], first, second)


class _CompositeSlabs(torch.autograd.Function):
    """This rank's (B, C) per-ray values (colour, features, opacity, depth: the opacity in column C - 2), composited
    with the other ranks', exchanged: -> the rays' (B, C) values, split as (diffuse, features, opacity, depth).
    Along a ray the slabs come in rank order (towards +x) or the reverse; this slab adds T v (T: the transmittance
    through the slabs in front; every channel, opacity and depth included), so d/dv = T, and through its opacity
    -T R, R being the slabs behind it composited from 1.

    Every rank computes the same loss L from the composite and backpropagates L / S (S ranks): what comes after the
    exchange (a per-pixel decoder, an appearance transform) then gets 1/S of its gradient on each rank, which the sum
    over the ranks makes whole, and this rank's own values get their whole gradient (S times the share). One node
    with its backward written out, where the gather, the selects, the composite and the column slices were ~20
    autograd nodes: ~40 host calls a step on the rank's critical path."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, plus: torch.Tensor, slabs: Slabs, group) -> tuple[torch.Tensor, ...]:
        gathered = gather_ranks(values, slabs.ranks, group)  # (S, B, C) by rank
        parts = gathered.unbind(0)
        seen = torch.where(plus[:, None], _composite(parts), _composite(parts[::-1]))
        ctx.save_for_backward(plus, gathered)
        ctx.slabs = slabs
        ctx.features = values.shape[1] - DIFFUSE_CHANNELS - 2
        diffuse, features, opacity, depth = seen.split([DIFFUSE_CHANNELS, ctx.features, 1, 1], 1)
        return diffuse, features, opacity.squeeze(1), depth.squeeze(1)

    @staticmethod
    def backward(ctx, diffuse, features, opacity, depth):
        plus, gathered = ctx.saved_tensors
        parts = gathered.unbind(0)
        rank, ranks = ctx.slabs.rank, ctx.slabs.ranks
        grad = torch.cat([diffuse, features, opacity[:, None], depth[:, None]], 1)
        below, above = parts[:rank], parts[rank + 1 :]  # by rank: in front on the +x rays, behind on the others
        trans = _per_ray(plus, _transmittance(below), _transmittance(above), 1.0)  # (B, 1) or None
        behind = _per_ray(plus, _composite(above), _composite(below[::-1]), 0.0)  # (B, C) or None
        through = grad if trans is None else grad * trans  # grad is the cat's own: written in place below
        if behind is not None:
            pull = (grad * behind).sum(1)
            through[:, -2] -= pull if trans is None else trans[:, 0] * pull
        return through * float(ranks), None, None, None


@dataclass(frozen=True)
class SlabPass:
    """What :func:`models.render_views.march` needs to march one rank's slab: its cells (:meth:`Slabs.march_cells`)
    and, before the no-grad pass, the optical depth of the slabs in front on each ray."""

    plus: torch.Tensor  # (B,) bool: the rays towards +x (the slabs in rank order)
    slabs: Slabs
    group: Any = None
    # (R0,) float64: this slab's shaded samples per first-axis cell layer, then the count of the steps counted
    layers: torch.Tensor | None = None

    def count_shaded(self, points: torch.Tensor) -> None:
        """Add one step's (N, 3) shaded points (in [-1, 1]; no padding) to :attr:`layers`, if kept (the slabs' cut,
        training.space_parallel.SpaceParallel.balance); no sync."""
        if self.layers is not None:
            counts = self.layers[:-1]
            layer = cell_index(points[:, 0].detach(), counts.numel() + 1)
            counts.index_add_(0, layer, torch.ones_like(layer, dtype=counts.dtype))
            self.layers[-1:] += 1

    def start_depth(self, depth: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """(B,) the optical depth in front of this slab's samples on each ray: the clamped sums of the slabs in front,
        exchanged (this rank sends its own: the (N,) optical depths of its samples, packed by ray along the (B + 1,)
        ``offsets``, the rows past ``offsets[-1]`` padding)."""
        totals = gather_ranks(ray_sums(depth.clamp(max=OPAQUE_DEPTH), offsets), self.slabs.ranks, self.group).unbind(0)
        rank = self.slabs.rank
        below, above = totals[:rank], totals[rank + 1 :]  # in front on the +x rays, on the others
        front_plus = sum(below[1:], below[0]) if below else 0.0
        front_minus = sum(above[1:], above[0]) if above else 0.0
        return torch.where(self.plus, front_plus, front_minus)


def ray_sums(values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(N,) values of samples packed by ray, (B + 1,) offsets ending at most at N -> (B,) each ray's sum, the rows
    past ``offsets[-1]`` (padding) left out. A difference of float64 prefix sums, not an ``index_add``: padding rows
    all name the last ray, and millions of atomics on one address serialise."""
    prefix = torch.nn.functional.pad(values.double().cumsum(0), (1, 0))  # (N + 1,): the sums before each row
    return prefix[offsets].diff().to(values.dtype)


def split_march(
    model: VoxelNeRF,
    slabs: Slabs,
    origins: torch.Tensor,
    directions: torch.Tensor,
    jitter: torch.Tensor,
    group=None,
    views: torch.Tensor | None = None,
    layers: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Training's march of B rays ((B, 3) origins and unit directions, (B,) sample offsets, optional (B,) training
    images) by this rank's slab, composited with the other ranks' over ``group`` -> dict(diffuse (B, 3),
    features (B, F-3), depth (B,), opacity (B,), samples: this rank's count, packed: this rank's samples'
    RenderedSamples), what ``model.march`` returns up to float rounding (bounded space, no pose refinement, no
    touched-row marks). Every rank passes the same rays. The slab's own march is :func:`models.render_views.march`
    (with ``model.capped_samples``, in fixed sample capacities). ``layers``: the (R0,) float64 counts to add the slab's
    shaded samples to, per first-axis cell layer, and the step, in the steps that march without padding
    (:meth:`SlabPass.count_shaded`)."""
    slab = SlabPass(directions[:, 0] >= 0, slabs, group, layers)
    out = render_views.march(model, origins, directions, jitter, views, slab=slab)
    local = torch.cat([out["colour"], out["opacity"][:, None], out["depth"][:, None]], 1)
    diffuse, features, opacity, depth = _CompositeSlabs.apply(local, slab.plus, slabs, group)
    return {
        "diffuse": diffuse,
        "features": features,
        "opacity": opacity,
        "depth": depth,
        "samples": out["samples"],
        # this rank's samples only: a regulariser summed over a ray's samples gets this slab's part of the sum
        "packed": out["packed"],
    }


__all__ = ["ROW_WORK", "Slabs", "SlabPass", "gather_ranks", "ray_sums", "regrid_layers", "split_march", "work_layers"]
