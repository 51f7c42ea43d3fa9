"""Dense voxel grids over the scene box: the learnable value grids and the boolean occupancy grid.

Conventions: a grid of shape (R0, R1, R2, C) is channels-last with its vertices spanning the box corner to
corner (align_corners=True), so voxel i along axis a sits at ``bbox_min[a] + i * voxel_size``. Points are
handed to the grids already mapped from the box to [-1, 1] (:func:`to_unit`), which is what
``grid_interpolate`` expects; outside the box the lookup clamps to the border.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.ops import OpSet
from models.sparse_rows import RowGradients, gather_rows


def grid_shape(extent: tuple[float, float, float], resolution: int) -> tuple[int, int, int]:
    """Vertices per axis for ``resolution`` vertices along the box's longest side (cubic voxels)."""
    voxel = max(extent) / (resolution - 1)
    return tuple(max(2, round(e / voxel) + 1) for e in extent)


def voxel_size(extent: tuple[float, float, float], shape: tuple[int, ...]) -> float:
    """Edge length of the (cubic) voxels of a grid of ``shape`` vertices over a box of ``extent``."""
    return max(e / (r - 1) for e, r in zip(extent, shape[:3]))


def to_unit(points: torch.Tensor, bbox: torch.Tensor) -> torch.Tensor:
    """(..., 3) world points -> (..., 3) box coordinates in [-1, 1] (bbox (2, 3): min and max corners)."""
    return (points - bbox[0]) * (2.0 / (bbox[1] - bbox[0])) - 1.0


def cell_index(coords: torch.Tensor, size: int) -> torch.Tensor:
    """(N,) coordinates in [-1, 1] along an axis of ``size`` vertices -> the (N,) int64 index of the cell each lies in
    (coordinates outside clamp to the border cell, as the lookup does)."""
    return ((coords + 1.0) * (0.5 * (size - 1))).floor().clamp(0, size - 2).long()


def cell_coords(unit_points: torch.Tensor, shape: tuple[int, int, int]) -> list[torch.Tensor]:
    """(N, 3) points in [-1, 1] -> per axis the (N,) int64 index of the cell of a grid of ``shape`` vertices each lies
    in (:func:`cell_index`)."""
    return [cell_index(unit_points[:, a], size) for a, size in enumerate(shape)]


def cell_corners(cells: torch.Tensor) -> torch.Tensor:
    """(R0, R1, R2) bool: the vertices that are a corner of at least one set cell of the (R0-1, R1-1, R2-1) mask."""
    padded = F.pad(cells.float()[None, None], (1, 1, 1, 1, 1, 1))
    return F.max_pool3d(padded, kernel_size=2, stride=1)[0, 0] > 0


def corner_rows(unit_points: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """(N, 3) points in [-1, 1] -> (8N,) flat vertex indices (rows of the (R0*R1*R2, C) view) of the 8 corners of
    each point's cell in a grid of ``shape``: the only rows a trilinear lookup of those points reads, so the only
    ones its gradient can reach (points outside clamp to the border cell, as the lookup does)."""
    r0, r1, r2 = shape
    cells = cell_coords(unit_points, shape)
    base = (cells[0] * r1 + cells[1]) * r2 + cells[2]
    offsets = torch.tensor(
        [di * r1 * r2 + dj * r2 + dk for di in (0, 1) for dj in (0, 1) for dk in (0, 1)], device=base.device
    )
    return (base[:, None] + offsets).reshape(-1)


def tv_pair_rows(cells: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(S,) sampled cells of a stack of grids of ``shape`` vertices (rows in order: grid, then R0, R1, R2; cells
    likewise, (R0-1)(R1-1)(R2-1) a grid) -> ((3, S) each cell's lower corner within its grid, (4, S) the rows of
    that corner and of its +1 neighbours along axes 0, 1, 2): what a TV estimate reads."""
    r0, r1, r2 = shape
    per_grid = (r0 - 1) * (r1 - 1) * (r2 - 1)
    g, rest = cells // per_grid, cells % per_grid
    v = torch.stack([rest // ((r1 - 1) * (r2 - 1)), rest // (r2 - 1) % (r1 - 1), rest % (r2 - 1)])
    corner = ((g * r0 + v[0]) * r1 + v[1]) * r2 + v[2]
    return v, torch.stack([corner, corner + r1 * r2, corner + r2, corner + 1])


def resample(grid: torch.Tensor, shape: tuple[int, int, int]) -> torch.Tensor:
    """Trilinear resample (align_corners=True) of a channels-last (R0, R1, R2, C) grid to ``shape`` + (C,)."""
    if tuple(grid.shape[:3]) == tuple(shape):
        return grid.clone()
    channels_first = grid.permute(3, 0, 1, 2).unsqueeze(0)
    resized = F.interpolate(channels_first, size=tuple(shape), mode="trilinear", align_corners=True)
    return resized[0].permute(1, 2, 3, 0).contiguous()


def resample_box(
    grid: torch.Tensor, old_bbox: torch.Tensor, new_bbox: torch.Tensor, shape: tuple[int, int, int]
) -> torch.Tensor:
    """The field of a channels-last (R0, R1, R2, C) grid spanning ``old_bbox``, sampled (trilinear, border
    clamp) at the vertices of a grid of ``shape`` spanning ``new_bbox`` -> ``shape`` + (C,). Boxes: (2, 3)."""
    axes = [
        torch.linspace(float(new_bbox[0, a]), float(new_bbox[1, a]), shape[a], device=grid.device, dtype=grid.dtype)
        for a in range(3)
    ]
    points = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)
    unit = to_unit(points, old_bbox.to(grid.device)).clamp(-1.0, 1.0)
    # grid_sample wants (x, y, z) = (axis 2, axis 1, axis 0) and channels first
    sampled = F.grid_sample(
        grid.permute(3, 0, 1, 2).unsqueeze(0),
        unit.flip(-1).unsqueeze(0).to(grid.dtype),
        mode="bilinear",
        padding_mode="border",
        align_corners=True,
    )
    return sampled[0].permute(1, 2, 3, 0).contiguous()


class VoxelGrid(nn.Module):
    """A learnable (R0, R1, R2, C) channels-last grid, queried only through ``ops.grid_interpolate``."""

    def __init__(self, shape: tuple[int, int, int], channels: int, init_std: float = 0.0, init_value: float = 0.0):
        super().__init__()
        values = torch.full((*shape, channels), float(init_value))
        if init_std > 0:
            values += init_std * torch.randn_like(values)
        self.grid = nn.Parameter(values)

    @property
    def shape(self) -> tuple[int, int, int]:
        return tuple(self.grid.shape[:3])

    def forward(self, unit_points: torch.Tensor, ops: OpSet) -> torch.Tensor:
        """(N, 3) points in [-1, 1] -> (N, C) trilinearly interpolated values."""
        return ops.grid_interpolate(self.grid, unit_points)

    @torch.no_grad()
    def resize(self, shape: tuple[int, int, int]) -> None:
        """Replace the parameter by its trilinear resample at ``shape`` (the field is kept, up to resampling)."""
        self.grid = nn.Parameter(resample(self.grid.detach(), shape))

    def total_variation(
        self,
        num_samples: int,
        touched: torch.Tensor | None = None,
        foreground: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        outside: float = 1.0,
        rows: RowGradients | None = None,
        cells: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Mean squared difference between neighbouring voxels, summed over the 3 axes (scalar).

        ``num_samples`` > 0 estimates it on that many random voxels (and their +1 neighbours), which keeps the
        cost and the gradient's footprint small on big grids; 0 (or more samples than voxels) uses the whole grid.
        ``touched``: optional (R0*R1*R2,) bool mask in which the rows the estimate reads are set (the touched-rows
        all-reduce under torchrun).
        ``foreground``: optional (R0,), (R1,), (R2,) bool masks of the vertices inside the foreground box per axis
        (a vertex is inside when all three are set); each squared difference with a vertex outside is multiplied
        by ``outside`` (``model.tv_background``; 1 or no masks: the unweighted sum, the same operations as ever).
        ``rows``: optional, the estimate gathers through it, so its gradient reaches the grid as the rows it read
        when ``rows.scatter()`` runs after the backward (models.sparse_rows; the whole-grid form's is dense).
        ``cells``: optional (num_samples,) int64 cell indices in [0, (R0-1)(R1-1)(R2-1)) to estimate on (the
        model draws them once for both grids, models.grid_tv.draw_cells); else drawn here, uniformly.
        """
        grid = self.grid
        r0, r1, r2 = self.shape
        weighted = foreground is not None and outside != 1.0
        if num_samples <= 0 or num_samples >= (r0 - 1) * (r1 - 1) * (r2 - 1):
            if touched is not None:
                touched.fill_(True)
            if weighted:  # per axis a (R_a - 1 along a) weights of the pairs (v, v + e_a)
                shapes = [[-1 if b == a else 1 for b in range(3)] for a in range(3)]
                vertex = [f.reshape(shape) for f, shape in zip(foreground, shapes)]
                pair = [(f[:-1] & f[1:]).reshape(shape) for f, shape in zip(foreground, shapes)]
                weights = _pair_weights(pair, vertex, outside, grid.dtype)
                return sum((torch.diff(grid, dim=a) ** 2 * weights[a][..., None]).mean() for a in range(3))
            return sum((torch.diff(grid, dim=axis) ** 2).mean() for axis in range(3))
        device = grid.device
        if cells is None:
            cells = torch.randint((r0 - 1) * (r1 - 1) * (r2 - 1), (num_samples,), device=device)
        # one gather of each voxel and its +1 neighbour along every axis: a single grid-sized gradient in backward
        (i, j, k), index = tv_pair_rows(cells, self.shape)
        if touched is not None:
            touched[index.reshape(-1)] = True
        values = gather_rows(grid, index.reshape(-1), rows).reshape(4, len(cells), -1)
        if weighted:  # the (3, S) weights of each sampled voxel's three pairs
            vertex = [f[c] for f, c in zip(foreground, (i, j, k))]
            pair = [f[c] & f[c + 1] for f, c in zip(foreground, (i, j, k))]
            weights = torch.stack(_pair_weights(pair, vertex, outside, grid.dtype))
            return ((values[1:] - values[:1]) ** 2 * weights[..., None]).mean(dim=(1, 2)).sum()
        return ((values[1:] - values[:1]) ** 2).mean(dim=(1, 2)).sum()

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        # a checkpoint saved at another resolution: take its shape first, then load as usual
        incoming = state_dict.get(prefix + "grid")
        if isinstance(incoming, torch.Tensor) and incoming.dim() == 4 and incoming.shape[3] == self.grid.shape[3]:
            if incoming.shape != self.grid.shape:
                self.grid = nn.Parameter(torch.empty(incoming.shape, dtype=self.grid.dtype, device=self.grid.device))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


def _pair_weights(
    pair: list[torch.Tensor], vertex: list[torch.Tensor], outside: float, dtype: torch.dtype
) -> list[torch.Tensor]:
    """TV weights of neighbour pairs along each axis a: 1 where both vertices are in the foreground, i.e. both
    ends inside along a (``pair[a]``) and the shared coordinates inside along the other axes (``vertex[b]``),
    else ``outside``. The masks broadcast together; returns 3 tensors of ``dtype``."""
    weights = []
    for a in range(3):
        both = pair[a] & vertex[(a + 1) % 3] & vertex[(a + 2) % 3]
        one = torch.ones((), dtype=dtype, device=both.device)
        weights.append(torch.where(both, one, one * outside))  # outside in dtype, not rounded through float32
    return weights


class OccupancyGrid(nn.Module):
    """Boolean (R0-1, R1-1, R2-1) mask over the cells between grid vertices: False = provably empty space.

    A cell is empty when all 8 of its corner densities give an alpha below the threshold: trilinear
    interpolation never exceeds the largest corner, so no point inside the cell can be more opaque than that.
    """

    def __init__(self, vertex_shape: tuple[int, int, int]):
        super().__init__()
        self.register_buffer("mask", torch.ones(tuple(r - 1 for r in vertex_shape), dtype=torch.bool))

    def fill(self, vertex_shape: tuple[int, int, int]) -> None:
        """Mark everything occupied (before the warm-up ends, or to disable skipping)."""
        self.mask = torch.ones(tuple(r - 1 for r in vertex_shape), dtype=torch.bool, device=self.mask.device)

    @torch.no_grad()
    def update(self, vertex_alpha: torch.Tensor, threshold: float, dilate: int) -> None:
        """Rebuild from (R0, R1, R2) per-vertex alpha: occupied where any corner's alpha >= threshold.

        ``dilate`` grows the occupied region by that many cells, so surfaces that are still moving can grow.
        """
        alpha = vertex_alpha[None, None]
        cells = F.max_pool3d(alpha, kernel_size=2, stride=1)
        if dilate > 0:
            cells = F.max_pool3d(cells, kernel_size=2 * dilate + 1, stride=1, padding=dilate)
        if cells.shape[2:] == self.mask.shape:  # in place: a captured training step (train.step_graph) reads it there
            torch.ge(cells[0, 0], threshold, out=self.mask)
        else:
            self.mask = cells[0, 0] >= threshold

    @torch.no_grad()
    def vertex_rows(self) -> torch.Tensor:
        """(K,) int64 increasing rows of the (R0*R1*R2,) grid vertices that are a corner of some occupied cell: every
        row a sample's trilinear lookup can read while this mask holds (one host sync, for K)."""
        return cell_corners(self.mask).reshape(-1).nonzero().squeeze(1)

    def summary(self) -> dict:
        """Shares of the occupied cells and of the grid rows at their corners (the rows ``train.sparse_adam=occupied``
        steps), for metrics.json (host syncs)."""
        vertices = math.prod(size + 1 for size in self.mask.shape)
        return {"cells": self.occupied_fraction(), "corner_rows": self.vertex_rows().numel() / vertices}

    def occupied_fraction(self) -> float:
        """Share of occupied cells (a host sync: for logs, not the hot path)."""
        return float(self.mask.float().mean())

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        incoming = state_dict.get(prefix + "mask")
        if isinstance(incoming, torch.Tensor) and incoming.dim() == 3 and incoming.shape != self.mask.shape:
            self.mask = torch.empty(incoming.shape, dtype=torch.bool, device=self.mask.device)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )


class TouchedRows:
    """The rows of the (R0*R1*R2, C) grid views that a training step's lookups and TV estimate read: the only
    rows whose gradient can be non-zero, so the only ones the touched-rows all-reduce under torchrun moves
    (training.distributed). Both grids share one shape, so one (R0*R1*R2,) bool mask serves both. Off (``enabled``
    False) unless the optimiser's setup asks for it (training.optim.new_optimizer)."""

    def __init__(self):
        self.enabled = False
        self._mask: torch.Tensor | None = None
        # called before a whole-grid read (train.parallel=space: the ranks' slabs exchanged first)
        self.flusher: Callable[[], None] | None = None
        self.density_flusher: Callable[[], None] | None = None  # the same for a read of the density grid alone

    def before_whole_read(self, density_only: bool = False) -> None:
        """Every row is about to be read (occupancy refresh, growth, evaluation, a checkpoint); ``density_only``: of
        the density grid alone (an occupancy refresh), which ``density_flusher`` serves where it is set."""
        flush = self.density_flusher if density_only and self.density_flusher is not None else self.flusher
        if flush is not None:
            flush()

    def mask(self, shape: tuple[int, int, int], device: torch.device | None = None) -> torch.Tensor:
        """The (R0*R1*R2,) mask for a grid of ``shape`` (a fresh, empty one after the grid changed shape)."""
        rows = shape[0] * shape[1] * shape[2]
        if self._mask is None or self._mask.numel() != rows or (device is not None and self._mask.device != device):
            self._mask = torch.zeros(rows, dtype=torch.bool, device=device)
        return self._mask

    def mark_points(self, unit_points: torch.Tensor, shape: tuple[int, int, int]) -> None:
        """Mark the 8 corner rows of each of the (N, 3) points in [-1, 1] (:func:`corner_rows`)."""
        self.mask(shape, unit_points.device)[corner_rows(unit_points, shape)] = True

    def take(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """(K,) int64 sorted rows marked since the last call, and forget them (one host sync, for K)."""
        mask = self.mask(shape)
        rows = mask.nonzero().squeeze(1)
        mask.zero_()
        return rows


def optical_depth(raw_density: torch.Tensor, shift: float, step_scale: float) -> torch.Tensor:
    """Optical depth of one sample, ``softplus(raw + shift) * step_scale`` (alpha = 1 - exp(-that))."""
    return F.softplus(raw_density + shift) * step_scale


__all__ = [
    "grid_shape",
    "voxel_size",
    "to_unit",
    "cell_coords",
    "cell_index",
    "cell_corners",
    "corner_rows",
    "tv_pair_rows",
    "resample",
    "resample_box",
    "VoxelGrid",
    "OccupancyGrid",
    "TouchedRows",
    "optical_depth",
]


@torch.no_grad()
def visible_box(
    density: torch.Tensor, bbox: torch.Tensor, shift: float, step_scale: float, threshold: float, margin: int = 2
) -> torch.Tensor | None:
    """(2, 3) box around the vertices of the (R0, R1, R2) density grid spanning ``bbox`` whose per-sample alpha
    ``1 - exp(-optical_depth)`` reaches ``threshold``, grown by ``margin`` voxels; None when none does."""
    occupied = (-torch.expm1(-optical_depth(density, shift, step_scale)) >= threshold).nonzero()
    if occupied.shape[0] == 0:
        return None
    last = torch.tensor(density.shape, device=occupied.device) - 1
    low = (occupied.min(0).values - margin).clamp(min=0)
    high = torch.minimum(occupied.max(0).values + margin, last)
    spacing = (bbox[1] - bbox[0]) / last
    box = torch.stack([bbox[0] + low * spacing, bbox[0] + high * spacing])
    return None if bool((box[1] <= box[0]).any()) else box
