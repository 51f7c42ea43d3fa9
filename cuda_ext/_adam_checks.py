"""Argument checks of the optimiser ops (sparse_adam_step, masked_adam_step), shared by their
wrappers, fake kernels and references; same rules and messages as :mod:`cuda_ext._checks` (metadata only)."""

from __future__ import annotations

from typing import Any

import torch

from cuda_ext._checks import (
    _FULL_DTYPES,
    _shape,
    check_bool,
    check_device,
    check_int,
    check_same_device_and_dtype,
    check_tensor,
    require,
)
from cuda_ext._step_checks import _check_numbers

__all__ = ["check_adam_inputs", "check_masked_adam_inputs"]


def check_adam_inputs(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    rows: Any,
    step: Any,
    lr: Any,
    beta1: Any,
    beta2: Any,
    eps: Any,
    clear_grad: Any = False,
    op: str = "sparse_adam_step",
) -> None:
    """param, grad, exp_avg, exp_avg_sq (M, C) of one dtype and device; rows (K,) int64 there; step an int >= 1,
    lr >= 0, beta1 and beta2 in [0, 1), eps > 0; clear_grad a bool."""
    check_tensor(op, "rows", rows)
    _check_row_state(op, param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    require(rows.dim() == 1, ValueError, lambda: f"{op}: rows must have shape (K,), got {_shape(rows)}")
    require(rows.dtype == torch.int64, TypeError, lambda: f"{op}: rows must be int64, got {rows.dtype}")
    require(
        rows.device == param.device,
        ValueError,
        lambda: f"{op}: rows and param must be on the same device, got {rows.device} and {param.device}",
    )
    _check_adam_numbers(op, step, lr, beta1, beta2, eps)
    check_bool(op, "clear_grad", clear_grad)


def check_masked_adam_inputs(
    param: Any,
    grad: Any,
    exp_avg: Any,
    exp_avg_sq: Any,
    step: Any,
    lr: Any,
    beta1: Any,
    beta2: Any,
    eps: Any,
    clear_grad: Any = False,
    op: str = "masked_adam_step",
) -> None:
    """param, grad, exp_avg, exp_avg_sq (M, C) as sparse_adam_step's; the numbers as its; clear_grad a bool."""
    _check_row_state(op, param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    _check_adam_numbers(op, step, lr, beta1, beta2, eps)
    check_bool(op, "clear_grad", clear_grad)


def _check_adam_numbers(op: str, step: Any, lr: Any, beta1: Any, beta2: Any, eps: Any) -> None:
    """step an int >= 1, lr a number >= 0, beta1 and beta2 in [0, 1), eps a number > 0."""
    if check_int(op, "step", step) < 1:
        raise ValueError(f"{op}: step must be >= 1, got {step}")
    _check_numbers(op, (("lr", lr, 0.0, float("inf")), ("beta1", beta1, 0.0, 1.0), ("beta2", beta2, 0.0, 1.0)))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{op}: eps must be a number > 0, got {eps!r} of type {type(eps).__name__}")
    if not 0 < eps < float("inf"):
        raise ValueError(f"{op}: eps must be a number > 0, got {eps!r}")


def _check_row_state(op: str, param: Any, **others: Any) -> None:
    """param (M, C) float32/float64, contiguous (updated in place); each of ``others`` its shape, device, dtype."""
    check_tensor(op, "param", param)
    for name, value in others.items():
        check_tensor(op, name, value)
    check_device(op, "param", param)
    require(
        param.dtype in _FULL_DTYPES, TypeError, lambda: f"{op}: param must be float32 or float64, got {param.dtype}"
    )
    require(param.dim() == 2, ValueError, lambda: f"{op}: param must have shape (M, C), got {_shape(param)}")
    require(param.is_contiguous(), ValueError, lambda: f"{op}: param must be contiguous (it is updated in place)")
    for name, value in others.items():
        require(
            value.shape == param.shape,
            ValueError,
            lambda name=name, value=value: (
                f"{op}: {name} must have the shape of param {_shape(param)}, got {_shape(value)}"
            ),
        )
        check_same_device_and_dtype(op, name, value, "param", param)
        require(value.is_contiguous(), ValueError, lambda name=name: f"{op}: {name} must be contiguous")
