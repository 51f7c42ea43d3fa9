"""Argument checks of ``sampled_tv``, shared by its wrapper, fake kernel and reference; same rules and messages
as :mod:`cuda_ext._checks` (metadata only: the cells' values are data)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from cuda_ext._checks import (
    _FULL_DTYPES,
    _shape,
    check_device,
    check_int,
    check_same_device_and_dtype,
    check_tensor,
    require,
)

__all__ = ["check_sampled_tv_inputs", "check_cell_range"]

OP = "sampled_tv"


def check_cell_range(values: torch.Tensor, cells: torch.Tensor, shape: Sequence[int]) -> None:
    """cells in [0, G * (R0-1) * (R1-1) * (R2-1)), the cells of the G grids of ``shape`` in ``values``' rows: a data
    check (one small reduction and one device sync)."""
    if cells.numel():
        count = values.shape[0] // (shape[0] * shape[1] * shape[2]) * (shape[0] - 1) * (shape[1] - 1) * (shape[2] - 1)
        low, high = torch.stack(torch.aminmax(cells)).tolist()
        if low < 0 or high >= count:
            raise ValueError(f"{OP}: cells must lie in [0, {count}), got values in [{low}, {high}]")


def check_sampled_tv_inputs(
    grad: Any, values: Any, cells: Any, shape: Any, inside: Any, outside: Any, scale: Any
) -> tuple[list[int], list[int], float, float]:
    """Metadata checks (cells' values are data, not read). Returns (shape, inside flattened to 6 ints or [],
    outside, scale) as the schema takes them."""
    for name, value in (("grad", grad), ("values", values), ("cells", cells)):
        check_tensor(OP, name, value)
    check_device(OP, "values", values)
    require(
        values.dtype in _FULL_DTYPES, TypeError, lambda: f"{OP}: values must be float32 or float64, got {values.dtype}"
    )
    require(
        values.dim() == 2,
        ValueError,
        lambda: f"{OP}: values must have shape (G * R0 * R1 * R2, C), got {_shape(values)}",
    )
    require(values.is_contiguous(), ValueError, lambda: f"{OP}: values must be contiguous")
    require(
        grad.shape == values.shape,
        ValueError,
        lambda: f"{OP}: grad must have the shape of values {_shape(values)}, got {_shape(grad)}",
    )
    check_same_device_and_dtype(OP, "grad", grad, "values", values)
    require(grad.is_contiguous(), ValueError, lambda: f"{OP}: grad must be contiguous (it is added to in place)")
    require(cells.dim() == 1, ValueError, lambda: f"{OP}: cells must have shape (S,), got {_shape(cells)}")
    require(cells.dtype == torch.int64, TypeError, lambda: f"{OP}: cells must be int64, got {cells.dtype}")
    require(
        cells.device == values.device,
        ValueError,
        lambda: f"{OP}: cells and values must be on the same device, got {cells.device} and {values.device}",
    )
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or len(shape) != 3:
        raise ValueError(f"{OP}: shape must be (R0, R1, R2), got {shape!r}")
    shape = [check_int(OP, "shape", r) for r in shape]
    require(min(shape) >= 2, ValueError, lambda: f"{OP}: shape must be at least 2 per axis, got {shape}")
    per_grid = shape[0] * shape[1] * shape[2]
    require(
        values.shape[0] % per_grid == 0,
        ValueError,
        lambda: f"{OP}: values' rows ({values.shape[0]}) must be a whole number of grids of shape {shape}",
    )
    flat: list[int] = []
    if inside is not None:
        try:
            pairs = [tuple(pair) for pair in inside]
        except TypeError:
            pairs = []
        if len(pairs) != 3 or any(len(pair) != 2 for pair in pairs):
            raise ValueError(f"{OP}: inside must be None or ((lo0, hi0), (lo1, hi1), (lo2, hi2)), got {inside!r}")
        flat = [check_int(OP, "inside", v) for pair in pairs for v in pair]
    for name, value in (("outside", outside), ("scale", scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{OP}: {name} must be a number, got {value!r} of type {type(value).__name__}")
    require(0 <= outside < float("inf"), ValueError, lambda: f"{OP}: outside must be a number >= 0, got {outside}")
    require(abs(scale) < float("inf"), ValueError, lambda: f"{OP}: scale must be a finite number, got {scale}")
    return shape, flat, float(outside), float(scale)
