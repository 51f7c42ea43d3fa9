"""Argument checks of ``gelu_rows`` (GELU of x plus a gathered row: the decoder's first activation), shared by its
wrapper, fake kernels and reference; same rules and messages as :mod:`cuda_ext._checks` (metadata only: the
values of ``index`` are checked by the CPU kernel, and on CUDA an out-of-range index makes its row NaN)."""

from __future__ import annotations

from typing import Any

import torch

from cuda_ext._checks import (
    _shape,
    check_device,
    check_same_device_and_dtype,
    check_tensor,
    checked_gelu_inputs,
    require,
)

__all__ = ["check_gelu_rows_inputs", "check_gelu_rows_backward_inputs"]


def check_gelu_rows_inputs(x: Any, rows: Any, index: Any, approximate: Any, op: str = "gelu_rows") -> None:
    """x (N, H) floating, rows (B, H) of x's dtype and device, index (N,) int64 on that device."""
    checked_gelu_inputs(x, approximate, op)
    check_tensor(op, "rows", rows)
    check_same_device_and_dtype(op, "rows", rows, "x", x)
    require(x.dim() == 2, ValueError, lambda: f"{op}: x must have shape (N, H), got {_shape(x)}")
    require(
        rows.dim() == 2 and rows.shape[1] == x.shape[1],
        ValueError,
        lambda: f"{op}: rows must have shape (B, {x.shape[1]}), got {_shape(rows)}",
    )
    check_tensor(op, "index", index)
    check_device(op, "index", index)
    require(index.device == x.device, ValueError, lambda: f"{op}: index must be on x's device {x.device}")
    require(index.dtype == torch.int64, TypeError, lambda: f"{op}: index must be int64, got {index.dtype}")
    require(
        index.dim() == 1 and index.shape[0] == x.shape[0],
        ValueError,
        lambda: f"{op}: index must have shape ({x.shape[0]},), got {_shape(index)}",
    )


def check_gelu_rows_backward_inputs(grad_out: Any, x: Any, rows: Any, index: Any, approximate: Any) -> None:
    """gelu_rows' inputs, and grad_out with the shape, dtype and device of x."""
    op = "gelu_rows_backward"
    check_gelu_rows_inputs(x, rows, index, approximate, op)
    check_tensor(op, "grad_out", grad_out)
    check_same_device_and_dtype(op, "grad_out", grad_out, "x", x)
    require(
        grad_out.shape == x.shape,
        ValueError,
        lambda: f"{op}: grad_out must have the shape of x {_shape(x)}, got {_shape(grad_out)}",
    )
