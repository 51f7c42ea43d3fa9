"""Lookups that add their table's gradient onto a kept ``.grad`` instead of a fresh zero-filled one.

A training step's grid gradients are mostly zeros: the step's samples reach a few percent of the rows, yet
autograd's usual path has each lookup's backward fill a whole new tensor (the capture preset's grids and fine pool:
~3.4 GB of zeros a step, ~1.1 ms on an H100) and hands it to ``.grad``. :func:`keep_grad` marks a parameter whose
``.grad``, when it exists, the custom lookups' backward (``grid_interpolate``, ``brick_grid_interpolate``) adds
onto in place through their ``grad_into`` argument; they then return no gradient for it, so autograd leaves ``.grad``
as it is. The accumulated gradient is the same as autograd's either way; only the fill and the extra add go. An
optimiser that keeps ``.grad`` between steps must leave it zero (``masked_adam_step(clear_grad=True)`` writes zeros
only where it stepped, training.optim.SparseGridAdam); with ``.grad`` None the lookups return a fresh gradient.

Only for ``loss.backward()`` into leaves: under ``torch.autograd.grad`` a marked parameter's gradient would go to
``.grad`` instead of the returned tuple, so only the trainer marks parameters.
"""

from __future__ import annotations

from typing import Optional

import torch

from cuda_ext._checks import _shape, check_same_device_and_dtype, check_tensor, require

__all__ = ["keep_grad", "is_kept", "grad_target", "check_grad_into"]

_ATTRIBUTE = "_cuda_ext_keep_grad"


def keep_grad(parameter: torch.Tensor, keep: bool = True) -> None:
    """Mark (or unmark) a leaf so that the custom lookups' backward adds onto its ``.grad`` in place."""
    if not parameter.is_leaf:
        raise ValueError("keep_grad: parameter must be a leaf tensor (its gradient goes to .grad)")
    setattr(parameter, _ATTRIBUTE, bool(keep))


def is_kept(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, _ATTRIBUTE, False))


def grad_target(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The ``.grad`` a lookup's backward should add onto (``grad_into``), or None for a fresh gradient: the tensor
    is marked and its ``.grad`` exists, shaped, typed and placed like it, contiguous, float32 or float64."""
    if tensor is None or not is_kept(tensor):
        return None
    grad = tensor.grad
    usable = (
        grad is not None
        and grad.shape == tensor.shape
        and grad.dtype == tensor.dtype
        and grad.dtype in (torch.float32, torch.float64)
        and grad.device == tensor.device
        and grad.is_contiguous()
    )
    return grad if usable else None


def check_grad_into(
    op: str, grad_into: Optional[torch.Tensor], values: torch.Tensor, values_name: str, requires_grad: bool
) -> None:
    """A lookup backward's optional ``grad_into``: shaped, typed and placed like ``values``, contiguous, float32 or
    float64 (the atomics' dtype), and only with ``<values>_requires_grad`` (the C++ backstop says the same)."""
    if grad_into is None:
        return
    check_tensor(op, "grad_into", grad_into)
    if not requires_grad:
        raise ValueError(f"{op}: grad_into is given, so {values_name}_requires_grad must be true")
    require(
        grad_into.shape == values.shape,
        ValueError,
        lambda: f"{op}: grad_into must have the shape of {values_name} {_shape(values)}, got {_shape(grad_into)}",
    )
    check_same_device_and_dtype(op, "grad_into", grad_into, values_name, values)
    if grad_into.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: grad_into must be float32 or float64 (the atomics' dtype), got {grad_into.dtype}")
    if not grad_into.is_contiguous():
        raise ValueError(f"{op}: grad_into must be contiguous")
