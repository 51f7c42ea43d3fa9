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

from models.field import tv_pair_rows


class DeferredTV:
    """The cells drawn for this step's TV estimate ([coarse, fine]: :func:`draw_cells`), and applying it."""

    def __init__(self) -> None:
        self.cells: list[torch.Tensor | None] | None = None

    @staticmethod
    def applies(model) -> bool:
        """The model's TV can go this way: sampled (fewer samples than cells), its gradient as rows
        (``model.tv_sparse_grad``)."""
        c, cells = model.config, math.prod(r - 1 for r in model.grid_shape)
        return bool(c.tv_sparse_grad) and 0 < c.tv_samples < cells

    @staticmethod
    def groups(model) -> list[tuple[tuple[int, int, int], list, tuple | None, float]]:
        """The grid pairs, in :func:`draw_cells`' order: (vertex shape, [(scale, parameter (..., C))], the
        foreground's vertex ranges or None, the outside weight): the coarse grids; the fine grid's bricks (a stack
        of (b, b, b) grids: no pairs across brick faces) when allocated."""
        c = model.config
        shape = model.grid_shape
        inside = model.space.foreground_ranges(shape) if c.tv_background != 1.0 else None
        pairs = [(c.tv_density, model.density.grid), (c.tv_features, model.features.grid)]
        fine, b = model.fine, model.fine.brick
        scaled = [(c.tv_density * c.fine.tv, fine.density), (c.tv_features * c.fine.tv, fine.features)]
        return [(shape, pairs, inside, c.tv_background), ((b, b, b), scaled, None, 1.0)]

    def draw(self, model) -> None:
        """Draw this step's cells (:func:`draw_cells`)."""
        self.cells = list(draw_cells(model))

    @torch.no_grad()
    def apply(self, model) -> torch.Tensor | None:
        """Add the estimate's gradient on the drawn cells onto the grids' ``.grad`` (a zero one for a grid without
        one) and forget the cells; returns the estimate, () float64 (None: nothing drawn)."""
        cells, self.cells = self.cells, None
        if cells is None:
            return None
        touched, shape = model.touched, model.grid_shape
        if cells[0] is not None and touched.enabled:  # the touched-rows sync moves the coarse rows the estimate reads
            _, rows = tv_pair_rows(cells[0], shape)
            touched.mask(shape, rows.device)[rows] = True
        share = 1.0
        if model.space_split is not None and cells[0] is not None:  # this rank's slab's cells (training.space_parallel)
            cells[0], share = model.space_split.owned_cells(cells[0])
        total = None
        for drawn, (shape, pairs, inside, outside) in zip(cells, self.groups(model)):
            for scale, param in pairs:
                if drawn is None or scale <= 0:
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
                    scale * share if drawn is cells[0] else scale,
                    check_cells=False,
                )
                total = value if total is None else total + value
        return total


def draw_cells(model) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """This step's TV cells, the same draws whichever way the estimate then runs (this op, or the PyTorch estimate
    of models.field / models.brick_grid): (coarse, fine), ``model.tv_samples`` int64 each, uniform over the
    coarse grids' (R0-1)(R1-1)(R2-1) cells (None for the whole-grid TV: tv_samples <= 0 or >= the cells) and over
    the fine bricks' (None without allocated bricks). Density and features of one grid share them."""
    device, samples = model.bbox.device, model.config.tv_samples
    count = math.prod(r - 1 for r in model.grid_shape)
    coarse, split = None, getattr(model, "space_split", None)
    if 0 < samples < count:  # under a space split stratified by slab (training.space_parallel)
        coarse = torch.randint(count, (samples,), device=device) if split is None else split.draw_cells(samples, device)
    fine = model.fine
    sampled = fine.active and fine.brick >= 2 and samples > 0
    return coarse, torch.randint(fine.tv_cells(), (samples,), device=device) if sampled else None
