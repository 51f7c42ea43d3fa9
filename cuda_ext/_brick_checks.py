"""Argument checks of brick_grid_interpolate, shared by its wrapper (:mod:`cuda_ext.brick_grid`), its fake
kernels and :mod:`cuda_ext.reference`; same rules and messages as :mod:`cuda_ext._checks` (metadata only, no
device sync) and the same order as the C++ checks (``csrc/brick_grid.h``), so every path names the same
argument first."""

from __future__ import annotations

from typing import Any

import torch

from cuda_ext._checks import (
    _check_grad_out,
    _kernel_dtype_and_device,
    _shape,
    check_device,
    check_floating,
    check_int,
    check_points,
    check_same_device_and_dtype,
    check_tensor,
    require,
)

__all__ = ["check_brick_grid_inputs", "check_brick_grid_backward_inputs", "MAX_BRICK", "MAX_VERTICES"]

# As csrc/brick_grid.h: B^3 fits a brick's rows in int32 and vertex indices fit int32.
MAX_BRICK = 1024
MAX_VERTICES = 2**31 - 1


def _ceil_div(a: Any, b: int) -> Any:
    return (a + b - 1) // b


def check_brick_grid_inputs(
    values: Any, table: Any, points: Any, shape: Any, brick: Any, op: str = "brick_grid_interpolate"
) -> tuple[list[int], int]:
    """values (M, C) floating with M a multiple of brick^3, table (ceil(V0/B), ceil(V1/B), ceil(V2/B)) int32,
    points (N, 3) of values' dtype, all on one device; shape 3 vertex counts in [1, 2^31 - 1], brick an int in
    [1, 1024]. Returns (shape as a list of ints, brick as an int)."""
    # Fast path: the usual call passes every check; only a failing call walks them one by one.
    if (
        type(brick) is int
        and isinstance(shape, (list, tuple))
        and len(shape) == 3
        and all(type(v) is int and 1 <= v <= MAX_VERTICES for v in shape)
        and 1 <= brick <= MAX_BRICK
        and isinstance(values, torch.Tensor)
        and isinstance(table, torch.Tensor)
        and isinstance(points, torch.Tensor)
        and values.dim() == 2
        and points.dim() == 2
        and table.dim() == 3
        and table.dtype is torch.int32
    ):
        ts = table.shape
        if (
            points.shape[1] == 3
            and ts[0] == _ceil_div(shape[0], brick)
            and ts[1] == _ceil_div(shape[1], brick)
            and ts[2] == _ceil_div(shape[2], brick)
            and values.shape[0] % (brick**3) == 0
            and values.dtype is points.dtype
            and values.device == points.device == table.device
            and _kernel_dtype_and_device(values)
        ):
            return list(shape), brick
    return checked_brick_grid_inputs(values, table, points, shape, brick, op)


def _check_shape_list(op: str, shape: Any) -> list[int]:
    if isinstance(shape, torch.Tensor) or not isinstance(shape, (list, tuple, torch.Size)):
        raise TypeError(
            f"{op}: shape must be a list of 3 ints (V0, V1, V2), got {shape!r} of type {type(shape).__name__}"
        )
    if len(shape) != 3:
        raise ValueError(f"{op}: shape must list 3 vertex counts (V0, V1, V2), got {list(shape)}")
    sizes = [check_int(op, f"shape[{axis}]", v) for axis, v in enumerate(shape)]
    for axis, v in enumerate(sizes):
        if not 1 <= v <= MAX_VERTICES:
            raise ValueError(f"{op}: shape[{axis}] must be a vertex count in [1, {MAX_VERTICES}], got shape {sizes}")
    return sizes


def checked_brick_grid_inputs(
    values: Any, table: Any, points: Any, shape: Any, brick: Any, op: str = "brick_grid_interpolate"
) -> tuple[list[int], int]:
    """check_brick_grid_inputs, one check after the other (symbolic sizes welcome)."""
    check_tensor(op, "values", values)
    check_tensor(op, "table", table)
    check_tensor(op, "points", points)
    require(values.dim() == 2, ValueError, lambda: f"{op}: values must have shape (M, C), got {_shape(values)}")
    check_points(op, points)
    sizes = _check_shape_list(op, shape)
    b = check_int(op, "brick", brick)
    if not 1 <= b <= MAX_BRICK:
        raise ValueError(f"{op}: brick must be in [1, {MAX_BRICK}], got {b}")
    require(table.dtype == torch.int32, TypeError, lambda: f"{op}: table must be int32, got {table.dtype}")
    want = tuple(_ceil_div(v, b) for v in sizes)

    def table_message() -> str:
        return f"{op}: table must have shape ceil(shape / brick) = {want}, got {_shape(table)}"

    require(table.dim() == 3, ValueError, table_message)
    for axis in range(3):  # one SymBool at a time under tracing
        require(table.shape[axis] == want[axis], ValueError, table_message)
    rows = b**3
    require(
        values.shape[0] % rows == 0,
        ValueError,
        lambda: f"{op}: values must hold whole bricks: M = {values.shape[0]} is not a multiple of brick^3 = {rows}",
    )
    check_device(op, "values", values)
    check_same_device_and_dtype(op, "points", points, "values", values)
    require(
        table.device == values.device,
        ValueError,
        lambda: f"{op}: table and values must be on the same device, got {table.device} and {values.device}",
    )
    check_floating(op, "values", values)
    return sizes, b


def check_brick_grid_backward_inputs(
    grad_out: Any, values: Any, table: Any, points: Any, shape: Any, brick: Any
) -> tuple[list[int], int]:
    op = "brick_grid_interpolate_backward"
    checked = checked_brick_grid_inputs(values, table, points, shape, brick, op)
    _check_grad_out(op, grad_out, points.shape[0], values.shape[1], values, "values")
    return checked
