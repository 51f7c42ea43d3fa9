"""Row gathers from big parameters whose gradient is added back row by row (``model.tv_sparse_grad``).

The total-variation estimate reads ~4 x 65536 rows of grids with tens of millions of rows. Plain indexing
(``grid.reshape(-1, C)[index]``) has a dense backward: a zero-filled gradient the size of the whole grid, the rows
scattered into it, then a whole-grid add onto the gradient the lookups produced: three passes over ~1.7 GB a step
on the blender preset's feature grid, for a quarter of a million rows. :class:`RowGradients` gathers the same rows
as a detached leaf, so autograd stops there and never builds a grid-sized tensor for them; after ``backward()``,
:meth:`RowGradients.scatter` adds each leaf's (K, C) gradient onto its parameter's ``.grad`` with one
``index_add_`` (repeated rows summed, as indexing's backward sums them): K rows written, nothing else.
"""

from __future__ import annotations

import torch


class RowGradients:
    """Gathers rows of parameters and, after the backward, adds the rows' gradients onto the parameters' ``.grad``.

    Usage: ``rows = row_grads.gather(table, index)`` inside the loss, ``loss.backward()``, then
    ``row_grads.scatter()`` before the optimiser (or anything else) reads the gradients."""

    def __init__(self) -> None:
        self._reads: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def gather(self, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (K,) int64 of ``table`` (*S, C) seen as (prod(S), C) -> (K, C).

        When ``table`` needs a gradient (and grad mode is on), the rows are a leaf of their own whose gradient
        :meth:`scatter` adds onto ``table.grad``; otherwise plain indexing."""
        if not table.requires_grad or not torch.is_grad_enabled():
            return table.reshape(-1, table.shape[-1])[index]
        rows = table.detach().reshape(-1, table.shape[-1]).index_select(0, index).requires_grad_(True)
        self._reads.append((table, index, rows))
        return rows

    @torch.no_grad()
    def scatter(self) -> None:
        """Add every gathered leaf's gradient onto its table's ``.grad`` (a zero one when the table has none yet),
        then forget the gathers. Rows whose leaf received no gradient (not in the loss) add nothing."""
        for table, index, rows in self._reads:
            if rows.grad is None:
                continue
            if table.grad is None:
                table.grad = torch.zeros_like(table)
            elif not table.grad.is_contiguous():
                table.grad = table.grad.contiguous()
            table.grad.view(-1, table.shape[-1]).index_add_(0, index, rows.grad.to(table.grad.dtype))
        self._reads.clear()

    def clear(self) -> None:
        """Forget gathers whose gradients will not be scattered (a loss built but never backpropagated)."""
        self._reads.clear()

    def __len__(self) -> int:
        return len(self._reads)


def gather_rows(table: torch.Tensor, index: torch.Tensor, rows: RowGradients | None = None) -> torch.Tensor:
    """Rows ``index`` (K,) of ``table`` (*S, C) -> (K, C): through ``rows`` (:meth:`RowGradients.gather`) when
    given, else plain indexing (a dense backward)."""
    if rows is not None:
        return rows.gather(table, index)
    return table.reshape(-1, table.shape[-1])[index]
