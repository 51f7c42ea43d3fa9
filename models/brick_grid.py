"""The fine grid: a sparse voxel grid stored as bricks, only where the coarse grids found something.

A dense grid pays for every voxel of the box on every step (its Adam update, its memory), while the surface a
render sees fills a few percent of it. After the coarse stage (``model.fine.at``) the model adds a grid
``model.fine.factor`` times finer over the same box whose values are stored only in the bricks (``brick``^3
vertices) around the coarse cells where training rays put weight (>= ``fine.min_weight``) over the last
``fine.collect`` steps before it; not the occupancy grid's cells, which also hold the inside of solid objects
that no ray sees (on lego ~20% of the grid). An indirection table (T0, T1, T2) int32 gives
each brick's slot in a pool of rows, -1 for an empty brick, whose vertices read as zero
(``ops.brick_grid_interpolate``). The fine values start at zero and are *added* to the coarse lookups (density
and features alike), so the field is unchanged when the fine grid appears and learns only the detail the coarse
grid cannot hold; where no brick is allocated the field is the coarse one.

Vertex convention: the fine grid's (V0, V1, V2) vertices span the box corner to corner like the coarse grid's,
with ``V = (R - 1) * factor + 1``, so every coarse vertex is also a fine vertex.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.config import FineConfig, step_of
from models.field import cell_coords, cell_corners, tv_pair_rows
from models.ops import OpSet
from models.sparse_rows import RowGradients, gather_rows


def fine_shape(coarse_shape: tuple[int, int, int], factor: int) -> tuple[int, int, int]:
    """Fine vertices per axis over the box of a coarse grid of ``coarse_shape`` vertices."""
    return tuple((r - 1) * factor + 1 for r in coarse_shape)


def table_shape(shape: tuple[int, int, int], brick: int) -> tuple[int, int, int]:
    """Bricks per axis of a grid of ``shape`` vertices: ceil(V / brick)."""
    return tuple(math.ceil(v / brick) for v in shape)


@torch.no_grad()
def wanted_bricks(cells: torch.Tensor, factor: int, brick: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """(T0, T1, T2) float: how many fine vertices of the wanted coarse ``cells`` (R0-1, R1-1, R2-1) bool each brick
    of the fine grid holds (0: not needed). Coarse cell c spans fine vertices [c f, (c + 1) f] per axis: every one a
    lookup inside it reads, the far face's too (which may lie in the next brick). Counted one layer of bricks along
    axis 0 at a time: the fine grid itself is never built (320^3 coarse at factor 4: 2.1 G fine vertices)."""
    bricks = table_shape(shape, brick)
    score = torch.zeros(bricks, device=cells.device)
    pad = (0, bricks[2] * brick - shape[2], 0, bricks[1] * brick - shape[1])  # F.pad lists the last axis first
    for layer in range(bricks[0]):
        first, last = layer * brick, min((layer + 1) * brick, shape[0]) - 1  # the layer's fine vertices on axis 0
        fine_cells = torch.arange(max(first - 1, 0), min(last, shape[0] - 2) + 1, device=cells.device)  # touching them
        slab = cells[fine_cells // factor].repeat_interleave(factor, 1).repeat_interleave(factor, 2)
        vertices = cell_corners(slab)[first - int(fine_cells[0]) : last - int(fine_cells[0]) + 1]
        counts = F.pad(vertices.float().sum(0)[None, None], pad)
        score[layer] = (F.avg_pool2d(counts, brick, brick) * brick**2)[0, 0]
    return score


def cell_index(unit_points: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """(N, 3) points in [-1, 1] -> (N,) flat index of the cell of a grid of ``shape`` vertices each lies in."""
    cells = cell_coords(unit_points, shape)
    return (cells[0] * (shape[1] - 1) + cells[1]) * (shape[2] - 1) + cells[2]


class BrickGrids(nn.Module):
    """Sparse fine density (M, 1) and feature (M, F) rows sharing one brick table; inactive (no rows) until
    :meth:`allocate`. ``shape``: the fine grid's vertex shape; ``table``: (T0, T1, T2) int32 slots (-1: empty)."""

    def __init__(self, feature_dim: int, brick: int):
        super().__init__()
        self.brick = int(brick)
        self.shape: tuple[int, int, int] = (1, 1, 1)
        self.register_buffer("table", torch.full((1, 1, 1), -1, dtype=torch.int32))
        self.density = nn.Parameter(torch.zeros(0, 1))
        self.features = nn.Parameter(torch.zeros(0, feature_dim))
        self.seen: torch.Tensor | None = None  # (R0-1, R1-1, R2-1) bool: coarse cells with visible samples lately
        self.collecting = False  # training marks them now (:meth:`schedule`: the last ``fine.collect`` steps)
        self.pixel_size: float | None = None  # the training views' pixel footprint at the box (set by the trainer)
        self.declined = False  # the coarse voxels were already as fine as the pixels (``fine.min_pixels``)
        self.wanted: int | None = None  # bricks the seen cells asked for at allocation (above max_bricks: capped)
        self.memory_cap: int | None = None  # bricks the device's memory holds beside the grids (:meth:`cap_memory`)

    def decline_if_resolved(self, voxel: float, min_pixels: float) -> bool:
        """Decline the fine grid, once and for all, when a coarse voxel of size ``voxel`` spans fewer than
        ``min_pixels`` pixels of :attr:`pixel_size` (finer detail would not show); True when declined."""
        if self.declined:
            return True
        if self.pixels_spanned(voxel) < min_pixels:
            spans = self.pixels_spanned(voxel)
            self.decline(f"not needed, a coarse voxel spans {spans:.2f} pixels (model.fine.min_pixels {min_pixels:g})")
        return self.declined

    def decline(self, reason: str) -> None:
        """Give up the fine grid once and for all (no marks, no allocation), saying why."""
        self.declined, self.collecting, self.seen = True, False, None
        print(f"fine grid: {reason}")

    def cap_memory(self, bricks: int) -> None:
        """Hold the pool to ``bricks``, what the device's memory holds beside the grids (the run's preflight);
        none: the fine grid is declined before training."""
        self.memory_cap = bricks
        if bricks < 1 and not self.declined:
            self.decline("not allocated, no memory left beside the coarse grids")

    def pixels_spanned(self, voxel: float) -> float:
        """How many pixels of :attr:`pixel_size` a coarse voxel of size ``voxel`` spans (inf when not set)."""
        return voxel / self.pixel_size if self.pixel_size else float("inf")

    def schedule(
        self,
        step: int,
        total_steps: int,
        cfg: FineConfig,
        occupied: torch.Tensor,
        voxel: float,
        region: Callable[[], torch.Tensor | None] | None = None,
    ) -> bool:
        """Call after optimiser step ``step``: sets :attr:`collecting`, and at ``cfg.at`` allocates the bricks of the
        cells training saw (none seen: the (R0-1, R1-1, R2-1) ``occupied`` cells), grown by one cell and kept to the
        cells ``region()`` marks (same shape, bool; called then only; None: anywhere); returns True then (new
        parameters: rebuild the optimiser). Declines, once and for all, when a coarse voxel of size ``voxel`` spans
        fewer than ``cfg.min_pixels`` pixels of :attr:`pixel_size` (finer detail would not show)."""
        at = None if cfg.factor == 0 or self.declined else step_of(cfg.at, total_steps)
        self.collecting = at is not None and at - cfg.collect <= step < at
        if at is None or step < at or self.active or self.decline_if_resolved(voxel, cfg.min_pixels):
            return False
        limit = cfg.max_bricks if self.memory_cap is None else min(cfg.max_bricks, self.memory_cap)
        seen = self.seen
        cells = seen if seen is not None and seen.shape == occupied.shape else occupied
        source = "seen" if cells is seen else "occupied"
        cells = F.max_pool3d(cells.float()[None, None], 3, 1, 1)[0, 0] > 0
        allowed = region() if region is not None else None
        if allowed is not None:
            cells, source = cells & allowed, source + " foreground"
        count = self.allocate(cells, cfg.factor, limit)
        cap = "model.fine.max_bricks" if limit == cfg.max_bricks else "the device's memory"
        capped = f" (capped by {cap}: {self.wanted} wanted)" if count < self.wanted else ""
        print(
            f"fine grid: {count} bricks of {self.brick}^3 around the {source} cells{capped}, {self.shape} vertices "
            f"(a coarse voxel spans {self.pixels_spanned(voxel):.2f} pixels)"
        )
        return True

    def collect(self, unit_points: torch.Tensor, coarse_shape: tuple[int, int, int]) -> None:
        """Mark the coarse cells (of a grid of ``coarse_shape`` vertices) the (N, 3) visible samples lie in; the
        marks start over when the shape changes (the grids grew)."""
        cells = tuple(r - 1 for r in coarse_shape)
        if self.seen is None or tuple(self.seen.shape) != cells or self.seen.device != unit_points.device:
            self.seen = torch.zeros(cells, dtype=torch.bool, device=unit_points.device)
        self.seen.view(-1)[cell_index(unit_points, coarse_shape)] = True

    @property
    def active(self) -> bool:
        return self.density.shape[0] > 0

    @property
    def bricks(self) -> int:
        """Allocated bricks (slots of the pool)."""
        return self.density.shape[0] // self.brick**3

    @torch.no_grad()
    def allocate(self, cells: torch.Tensor, factor: int, max_bricks: int) -> int:
        """Allocate zero-valued bricks holding the fine vertices of the (R0-1, R1-1, R2-1) bool coarse ``cells``, at
        most ``max_bricks`` (the fullest first); returns the count. Replaces the parameters, forgets the marks."""
        coarse_shape = tuple(r + 1 for r in cells.shape)
        self.shape = fine_shape(coarse_shape, factor)
        self.seen = None
        score = wanted_bricks(cells, factor, self.brick, self.shape).reshape(-1)
        wanted = self.wanted = int((score > 0).sum())
        chosen = torch.topk(score, min(wanted, max_bricks)).indices.sort().values  # row-major slots: coherent memory
        table = torch.full((score.numel(),), -1, dtype=torch.int32, device=score.device)
        table[chosen] = torch.arange(chosen.numel(), dtype=torch.int32, device=score.device)
        self.table = table.reshape(table_shape(self.shape, self.brick))
        rows = chosen.numel() * self.brick**3
        device, dtype = self.density.device, self.density.dtype
        self.density = nn.Parameter(torch.zeros(rows, 1, device=device, dtype=dtype))
        self.features = nn.Parameter(torch.zeros(rows, self.features.shape[1], device=device, dtype=dtype))
        return chosen.numel()

    def summary(self) -> dict:
        """For metrics.json: ``{"bricks", "wanted", "brick", "shape", "rows", "declined", "pixel_size"}`` (wanted:
        the bricks the seen cells asked for, more than ``bricks`` when ``fine.max_bricks`` cut them; None when the
        grid came from a checkpoint)."""
        rows = self.density.shape[0]
        shape = list(self.shape) if rows else None
        counts = {"bricks": self.bricks, "wanted": self.wanted, "brick": self.brick, "shape": shape, "rows": rows}
        return counts | {"declined": self.declined, "pixel_size": self.pixel_size}

    def lookup(self, values: torch.Tensor, unit_points: torch.Tensor, ops: OpSet) -> torch.Tensor:
        """(N, 3) points in [-1, 1] -> (N, C) fine values (zero outside the allocated bricks)."""
        return ops.brick_grid_interpolate(values, self.table, unit_points, list(self.shape), self.brick)

    @torch.no_grad()
    def density_bound(self, coarse_shape: tuple[int, int, int]) -> torch.Tensor:
        """(R0, R1, R2) upper bound of the fine density near each coarse vertex: the largest fine value in the
        bricks within one brick of it (empty bricks count 0). Coarse density + this bounds the summed density in
        every cell around the vertex, so the occupancy grid built from it never skips a cell the fine grid fills
        (for factor <= brick: a coarse cell's fine vertices lie within one brick of its corners)."""
        factor = (self.shape[0] - 1) // max(coarse_shape[0] - 1, 1)
        pool = self.density.detach().reshape(-1, self.brick**3).amax(dim=1)
        per_brick = torch.zeros(self.table.numel(), device=pool.device, dtype=pool.dtype)
        filled = self.table.reshape(-1) >= 0
        per_brick[filled] = pool[self.table.reshape(-1)[filled].long()]
        near = F.max_pool3d(per_brick.reshape(self.table.shape)[None, None], 3, 1, 1)[0, 0]
        index = [torch.arange(r, device=pool.device) * factor // self.brick for r in coarse_shape]
        return near[index[0][:, None, None], index[1][None, :, None], index[2][None, None, :]]

    def check_unallocated(self, change: str) -> None:
        """ValueError when the coarse grids would ``change`` (grow, shrink) under an allocated fine grid."""
        if self.active:
            raise ValueError(
                f"model.fine.at: the fine grid must start after the coarse grids' last change, but they {change} "
                f"after it (set model.fine.at after model.grow_at and model.shrink_at)"
            )

    def regularization(
        self,
        tv_density: float,
        tv_features: float,
        num_samples: int,
        rows: RowGradients | None = None,
        cells: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``tv_density`` x the density rows' :meth:`total_variation` + ``tv_features`` x the features' (scalar),
        both on the same ``cells`` (drawn here when None)."""
        terms = [
            weight * self.total_variation(values, num_samples, rows, cells)
            for weight, values in ((tv_density, self.density), (tv_features, self.features))
            if weight > 0
        ]
        return sum(terms) if terms else self.density[:1].sum() * 0.0  # the zero reads one row, not the pool

    def tv_cells(self) -> int:
        """The cells a fine TV sample is drawn from: (brick - 1)^3 in each allocated brick."""
        return self.bricks * (self.brick - 1) ** 3

    def total_variation(
        self,
        values: torch.Tensor,
        num_samples: int,
        rows: RowGradients | None = None,
        cells: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean squared difference between neighbouring fine vertices inside bricks, summed over the 3 axes,
        estimated on ``num_samples`` random vertices (scalar; pairs across brick faces are left out): the lower
        corners of ``cells`` ((num_samples,) int64 in [0, :meth:`tv_cells`), brick by brick; drawn here when None).
        Through ``rows`` its gradient reaches ``values`` as the rows read, at ``rows.scatter()``
        (models.sparse_rows)."""
        b = self.brick
        if b < 2 or not self.active:
            return values[:1].sum() * 0.0
        if cells is None:
            cells = torch.randint(self.tv_cells(), (num_samples,), device=values.device)
        _, index = tv_pair_rows(cells, (b, b, b))  # the pool as a stack of (b, b, b) grids
        picked = gather_rows(values, index.reshape(-1), rows).reshape(4, len(cells), -1)
        return ((picked[1:] - picked[:1]) ** 2).mean(dim=(1, 2)).sum()

    # the fine grid's shape travels with its rows: "_extra_state" = (V0, V1, V2, brick) int64
    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([*self.shape, self.brick], dtype=torch.int64)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self.shape = tuple(int(v) for v in state[:3])
        self.brick = int(state[3])

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a checkpoint with another pool or table size: take its shapes first, then load as usual
        for name in ("density", "features"):
            incoming = state_dict.get(prefix + name)
            current = getattr(self, name)
            if isinstance(incoming, torch.Tensor) and incoming.dim() == 2 and incoming.shape != current.shape:
                setattr(self, name, nn.Parameter(current.new_empty(incoming.shape)))
        incoming = state_dict.get(prefix + "table")
        if isinstance(incoming, torch.Tensor) and incoming.dim() == 3 and incoming.shape != self.table.shape:
            self.table = self.table.new_empty(incoming.shape)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
