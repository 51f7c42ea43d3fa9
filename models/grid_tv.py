"""The grids' total variation through ``ops.sampled_tv``, outside autograd (the trainer's step).

The sampled TV written in PyTorch (:meth:`models.field.VoxelGrid.total_variation`, :meth:`BrickGrids.total_variation`)
is ~40 small ops per grid forward and as many in the backward: at the capture preset's four TV terms about a
quarter of a training step's kernel launches. Its gradient is simple enough to write down, so the trainer's step
draws the cells before the forward (where the draws always were: every rank of a torchrun job draws the same) and,
after ``loss.backward()``, one ``ops.sampled_tv`` call per grid adds the estimate's gradient onto the grid's
``.grad``. Density and features of one grid share the cells; the estimate is the same as the PyTorch form's, term
for term (tests/test_grid_tv.py).
"""

from __future__ import annotations

import math

import torch


class DeferredTV:
    """The cells drawn for this step's TV estimate (one (S,) int64 tensor per grid pair), and applying it."""

    def __init__(self) -> None:
        self.cells: list[torch.Tensor] | None = None

    @staticmethod
    def applies(model) -> bool:
        """The model's TV can go this way: sampled (fewer samples than cells), its gradient as rows
        (``model.tv_sparse_grad``), and no optimiser that reads the touched-rows marks or replays reads."""
        c, cells = model.config, math.prod(r - 1 for r in model.grid_shape)
        touched = model.touched
        return bool(c.tv_sparse_grad) and 0 < c.tv_samples < cells and not touched.enabled and touched.reader is None

    @staticmethod
    def groups(model) -> list[tuple[int, tuple[int, int, int], list, tuple | None, float]]:
        """The grid pairs: (cells to draw from, vertex shape, [(scale, parameter (..., C))], the foreground's vertex
        ranges or None, the outside weight): the coarse grids; the fine grid's bricks when allocated."""
        c = model.config
        shape = model.grid_shape
        inside = model.space.foreground_ranges(shape) if c.tv_background != 1.0 else None
        pairs = [(c.tv_density, model.density.grid), (c.tv_features, model.features.grid)]
        groups = [(math.prod(r - 1 for r in shape), shape, pairs, inside, c.tv_background)]
        fine, b = model.fine, model.fine.brick
        if fine.active and b >= 2:  # the bricks as a stack of (b, b, b) grids: no pairs across brick faces
            scaled = [(c.tv_density * c.fine.tv, fine.density), (c.tv_features * c.fine.tv, fine.features)]
            groups.append((fine.bricks * (b - 1) ** 3, (b, b, b), scaled, None, 1.0))
        return groups

    def draw(self, model) -> None:
        """Draw this step's cells: ``model.tv_samples`` per grid pair, uniform over its cells."""
        device, samples = model.bbox.device, model.config.tv_samples
        self.cells = [torch.randint(count, (samples,), device=device) for count, *_ in self.groups(model)]

    @torch.no_grad()
    def apply(self, model) -> torch.Tensor | None:
        """Add the estimate's gradient on the drawn cells onto the grids' ``.grad`` (a zero one for a grid without
        one) and forget the cells; returns the estimate, () float64 (None: nothing drawn)."""
        cells, self.cells = self.cells, None
        if cells is None:
            return None
        total = None
        for drawn, (_, shape, pairs, inside, outside) in zip(cells, self.groups(model)):
            for scale, param in pairs:
                if scale <= 0:
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                elif not param.grad.is_contiguous():
                    param.grad = param.grad.contiguous()
                channels = param.shape[-1]
                value = model.ops.sampled_tv(
                    param.grad.view(-1, channels),
                    param.detach().view(-1, channels),
                    drawn,
                    shape,
                    inside,
                    outside,
                    scale,
                    check_cells=False,
                )
                total = value if total is None else total + value
        return total
