"""Row gathers from a big parameter whose gradient stays sparse (``model.tv_sparse_grad``).

The total-variation estimate reads ~4 x 65536 rows of grids with tens of millions of rows. Plain indexing
(``grid.reshape(-1, C)[index]``) has a dense backward: a zero-filled gradient the size of the whole grid, the rows
scattered into it, then a whole-grid add onto the gradient the lookups produced: three passes over ~1.7 GB a step
on the blender preset's feature grid, for a quarter of a million rows. :func:`gather_rows` returns the same rows,
but its backward hands autograd a sparse COO gradient (the rows and their indices, as ``nn.Embedding(sparse=True)``
does), which autograd adds in place onto the dense gradient already there. When it is a parameter's only gradient
the parameter's ``.grad`` is left sparse: :func:`densify_grads` makes it dense for the optimisers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        rows = table.reshape(-1, table.shape[-1])  # a view: the parameter's rows, channels last
        ctx.save_for_backward(index)
        ctx.shape = table.shape
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        shape = ctx.shape
        coordinates = torch.stack(torch.unravel_index(index, shape[:-1])) if len(shape) > 2 else index[None]
        # uncoalesced: repeated rows are summed when the gradient is added, as index_put_(accumulate=True) does
        return torch.sparse_coo_tensor(coordinates, grad, shape, check_invariants=False), None


def gather_rows(table: torch.Tensor, index: torch.Tensor, sparse_grad: bool = True) -> torch.Tensor:
    """Rows ``index`` (K,) int64 of ``table`` (*S, C) seen as (prod(S), C) -> (K, C).

    With ``sparse_grad`` the backward gives ``table`` a sparse (*S, C) gradient of K rows instead of a dense one
    (same values; see the module doc); without it, plain indexing.
    """
    if not sparse_grad or not table.requires_grad or not torch.is_grad_enabled():
        return table.reshape(-1, table.shape[-1])[index]
    return _GatherRows.apply(table, index)


def densify_grads(parameters: Iterable[torch.Tensor]) -> None:
    """Make every sparse ``.grad`` (a parameter that only :func:`gather_rows` reached this step) dense, in place
    of the attribute: the optimisers (fused Adam, the row-sparse steps) read dense gradients."""
    for parameter in parameters:
        if parameter.grad is not None and parameter.grad.is_sparse:
            parameter.grad = parameter.grad.to_dense()
