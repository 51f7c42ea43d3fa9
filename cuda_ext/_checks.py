"""Argument checks shared by the typed wrappers, the fake (meta) kernels and :mod:`cuda_ext.reference`.

One set of checks, so the three reject the same calls with the same exception and message:

- ``TypeError``: an argument of the wrong Python type (not a tensor, a float ``scale_factor``, ...) or a
  tensor of a dtype the kernels do not take, or two tensors whose dtypes differ;
- ``ValueError``: a wrong shape, size, device or value.

Every message starts with the op's name and names the argument, e.g.
``grid_interpolate: points must have shape (N, 3), got (5, 4)``. The checks read metadata only (Python
types, dims, sizes, dtypes, devices): no data access, no device sync. The C++ entry points
(``csrc/trilinear.h``, ``grid_interpolate.h``, ``upsample.h``, ``gelu.h``, ``render.h``, ``adam.h``) check the
same things with ``TORCH_CHECK``, as the backstop for direct ``torch.ops.cuda_ext`` calls; they raise ``RuntimeError``.

Under ``torch.compile`` sizes can be symbolic: a condition that is a ``SymBool`` goes through
``torch._check_with``, which guards on it (backed sizes) or defers it to a runtime assert (unbacked,
data-dependent sizes) instead of failing the trace. The public ``check_*_inputs`` functions first test
the whole call in one cheap expression and only on a failure walk the checks in order to raise the first
one that fails (the wrappers stay within about a microsecond or two of the bare op); the fake kernels call
the ``checked_*`` walks directly.
"""

from __future__ import annotations

import operator
import os
from typing import Any, Callable, Optional

import torch

__all__ = [
    "check_trilinear_inputs",
    "check_trilinear_backward_inputs",
    "check_grid_inputs",
    "check_grid_backward_inputs",
    "check_grid_reorder_setting",
    "check_upsample_inputs",
    "check_upsample_backward_inputs",
    "check_gelu_inputs",
    "check_gelu_backward_inputs",
]

# float32/float64 everywhere; float16/bfloat16 only on CUDA, whose kernels compute them in float32.
_FULL_DTYPES = (torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)
# Devices with kernels, and "meta" (shape propagation only; it takes every dtype any backend takes).
_DEVICE_TYPES = ("cpu", "cuda", "meta")
# Upsampled sizes are bounded like the C++ check (upsampled_size in csrc/upsample.h).
_MAX_UPSAMPLED_SIZE = 2**31 - 1
GELU_APPROXIMATIONS = ("none", "tanh")
GRID_REORDER_ENV = "CUDA_EXT_GRID_REORDER"
GRID_REORDER_MODES = ("auto", "off", "always")

_check_with: Optional[Callable[..., None]] = getattr(torch, "_check_with", None)


def require(cond: Any, error: type, message: Callable[[], str]) -> None:
    """Raise ``error(message())`` unless cond holds. cond: a bool, or a SymBool while tracing."""
    if cond is True:
        return
    if cond is False or _check_with is None:
        if not cond:
            raise error(message())
        return
    _check_with(error, cond, message)


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _kernel_dtype_and_device(t: torch.Tensor) -> bool:
    """Fast path of check_device + check_floating: True when both would pass."""
    dtype = t.dtype
    if dtype is torch.float32 or dtype is torch.float64:
        return t.is_cpu or t.is_cuda or t.is_meta
    return (dtype is torch.float16 or dtype is torch.bfloat16) and (t.is_cuda or t.is_meta)


# ------------------------------------------------------------------------------------------ generic


def check_tensor(op: str, name: str, value: Any) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")


def check_device(op: str, name: str, t: torch.Tensor) -> None:
    """t lives where the op has a kernel (or on "meta")."""
    require(
        t.device.type in _DEVICE_TYPES,
        ValueError,
        lambda: f"{op}: {name} must be a CPU or CUDA tensor, got one on {t.device}",
    )


def check_floating(op: str, name: str, t: torch.Tensor) -> None:
    """float32/float64 on the CPU; float16/bfloat16 too on CUDA (and on "meta")."""
    dtype = t.dtype
    if dtype in _FULL_DTYPES:
        return
    if t.device.type == "cpu":
        raise TypeError(
            f"{op}: {name} must be float32 or float64 on the CPU (float16/bfloat16 are CUDA only), got {dtype}"
        )
    if dtype not in _HALF_DTYPES:
        raise TypeError(f"{op}: {name} must be float32 or float64 (or float16/bfloat16 on CUDA), got {dtype}")


def check_same_device_and_dtype(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """t (called name) has the device and dtype of ref (called ref_name)."""
    require(
        t.device == ref.device,
        ValueError,
        lambda: f"{op}: {name} and {ref_name} must be on the same device, got {t.device} and {ref.device}",
    )
    require(
        t.dtype == ref.dtype,
        TypeError,
        lambda: f"{op}: {name} and {ref_name} must have the same dtype, got {t.dtype} and {ref.dtype}",
    )


def check_int(op: str, name: str, value: Any) -> int:
    """value as a Python int (ints, NumPy ints, 0-d integer tensors; not bools, not floats)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{op}: {name} must be an integer, got {value!r} of type {type(value).__name__}") from None


def check_bool(op: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{op}: {name} must be a bool, got {value!r} of type {type(value).__name__}")


# ------------------------------------------------------------------------------------------ trilinear


def check_points(op: str, points: torch.Tensor) -> None:
    require(
        points.dim() == 2 and points.shape[1] == 3,
        ValueError,
        lambda: f"{op}: points must have shape (N, 3), got {_shape(points)}",
    )


def _check_grad_out(op: str, grad_out: torch.Tensor, n: Any, f: Any, ref: torch.Tensor, ref_name: str) -> None:
    """grad_out is (N, F) like the forward's output, with ref's device and dtype."""
    check_tensor(op, "grad_out", grad_out)

    def message() -> str:
        return f"{op}: grad_out must have shape ({n}, {f}) like the forward output, got {_shape(grad_out)}"

    require(grad_out.dim() == 2, ValueError, message)
    # One condition per size: under tracing each may be a SymBool (``and`` would force it to a bool).
    require(grad_out.shape[0] == n, ValueError, message)
    require(grad_out.shape[1] == f, ValueError, message)
    check_same_device_and_dtype(op, "grad_out", grad_out, ref_name, ref)


def check_trilinear_inputs(feats: Any, points: Any, op: str = "trilinear_interpolate") -> None:
    """feats (N, 8, F) and points (N, 3) of one floating dtype on one device."""
    if isinstance(feats, torch.Tensor) and isinstance(points, torch.Tensor) and feats.dim() == 3 and points.dim() == 2:
        fs, ps = feats.shape, points.shape
        if (
            fs[1] == 8
            and ps[1] == 3
            and ps[0] == fs[0]
            and feats.dtype is points.dtype
            and feats.device == points.device
            and _kernel_dtype_and_device(feats)
        ):
            return
    checked_trilinear_inputs(feats, points, op)


def checked_trilinear_inputs(feats: Any, points: Any, op: str = "trilinear_interpolate") -> None:
    """check_trilinear_inputs, one check after the other (symbolic sizes welcome)."""
    check_tensor(op, "feats", feats)
    check_tensor(op, "points", points)
    require(feats.dim() == 3, ValueError, lambda: f"{op}: feats must have shape (N, 8, F), got {_shape(feats)}")
    require(
        feats.shape[1] == 8,
        ValueError,
        lambda: f"{op}: feats must hold 8 corners in dim 1 (shape (N, 8, F)), got {_shape(feats)}",
    )
    check_points(op, points)
    require(
        points.shape[0] == feats.shape[0],
        ValueError,
        lambda: f"{op}: points has N={points.shape[0]} rows but feats has N={feats.shape[0]}",
    )
    check_device(op, "feats", feats)
    check_same_device_and_dtype(op, "points", points, "feats", feats)
    check_floating(op, "feats", feats)


def check_trilinear_backward_inputs(grad_out: Any, feats: Any, points: Any) -> None:
    op = "trilinear_interpolate_backward"
    checked_trilinear_inputs(feats, points, op)
    _check_grad_out(op, grad_out, feats.shape[0], feats.shape[2], feats, "feats")


def check_grid_inputs(grid: Any, points: Any, op: str = "grid_interpolate") -> None:
    """grid (R0, R1, R2, C) with every R >= 1 (C may be 0) and points (N, 3), one floating dtype, one device."""
    if isinstance(grid, torch.Tensor) and isinstance(points, torch.Tensor) and grid.dim() == 4 and points.dim() == 2:
        gs = grid.shape
        if (
            gs[0] > 0
            and gs[1] > 0
            and gs[2] > 0
            and points.shape[1] == 3
            and grid.dtype is points.dtype
            and grid.device == points.device
            and _kernel_dtype_and_device(grid)
        ):
            return
    checked_grid_inputs(grid, points, op)


def checked_grid_inputs(grid: Any, points: Any, op: str = "grid_interpolate") -> None:
    """check_grid_inputs, one check after the other (symbolic sizes welcome)."""
    check_tensor(op, "grid", grid)
    check_tensor(op, "points", points)
    require(grid.dim() == 4, ValueError, lambda: f"{op}: grid must have shape (R0, R1, R2, C), got {_shape(grid)}")
    for axis in range(3):
        require(
            grid.shape[axis] > 0,
            ValueError,
            lambda axis=axis: (
                f"{op}: grid has an empty axis {axis} (shape {_shape(grid)}); every grid axis needs at least one voxel"
            ),
        )
    check_points(op, points)
    check_device(op, "grid", grid)
    check_same_device_and_dtype(op, "points", points, "grid", grid)
    check_floating(op, "grid", grid)


def check_grid_backward_inputs(grad_out: Any, grid: Any, points: Any) -> None:
    op = "grid_interpolate_backward"
    checked_grid_inputs(grid, points, op)
    _check_grad_out(op, grad_out, points.shape[0], grid.shape[3], grid, "grid")


def check_grid_reorder_setting(op: str = "grid_interpolate") -> None:
    """The environment variable CUDA_EXT_GRID_REORDER, which the custom grid kernels read, is valid."""
    value = os.environ.get(GRID_REORDER_ENV)
    if value and value not in GRID_REORDER_MODES:
        raise ValueError(
            f"{op}: the environment variable {GRID_REORDER_ENV} must be auto, off or always, got '{value}'"
        )


# ------------------------------------------------------------------------------------------- upsample


def check_scale_factor(op: str, scale_factor: Any) -> int:
    """scale_factor as an int in [1, 2**31 - 1]."""
    try:
        value = check_int(op, "scale_factor", scale_factor)
    except TypeError:
        raise TypeError(
            f"{op}: scale_factor must be an integer >= 1, got {scale_factor!r} of type {type(scale_factor).__name__}"
        ) from None
    if value < 1:
        raise ValueError(f"{op}: scale_factor must be an integer >= 1, got {value}")
    if value > _MAX_UPSAMPLED_SIZE:
        raise ValueError(f"{op}: scale_factor must be at most {_MAX_UPSAMPLED_SIZE}, got {value}")
    return value


def _check_upsampled_size(op: str, name: str, size: Any, scale_factor: int) -> None:
    require(
        size * scale_factor <= _MAX_UPSAMPLED_SIZE,
        ValueError,
        lambda: f"{op}: {name} times scale_factor must be at most {_MAX_UPSAMPLED_SIZE}, got {size} * {scale_factor}",
    )


def check_upsample_inputs(x: Any, scale_factor: Any, align_corners: Any, op: str = "upsample_bilinear2d") -> int:
    """x (B, C, H, W) floating, scale_factor an int >= 1, align_corners a bool; returns scale_factor as an int."""
    if (
        type(scale_factor) is int
        and isinstance(x, torch.Tensor)
        and x.dim() == 4
        and (align_corners is True or align_corners is False)
        and 1 <= scale_factor
    ):
        shape = x.shape
        if (
            shape[2] * scale_factor <= _MAX_UPSAMPLED_SIZE
            and shape[3] * scale_factor <= _MAX_UPSAMPLED_SIZE
            and _kernel_dtype_and_device(x)
        ):
            return scale_factor
    return checked_upsample_inputs(x, scale_factor, align_corners, op)


def checked_upsample_inputs(x: Any, scale_factor: Any, align_corners: Any, op: str = "upsample_bilinear2d") -> int:
    """check_upsample_inputs, one check after the other (symbolic sizes welcome)."""
    check_tensor(op, "x", x)
    require(
        x.dim() == 4, ValueError, lambda: f"{op}: x must be 4-D (B, C, H, W), got {x.dim()}-D with shape {_shape(x)}"
    )
    check_device(op, "x", x)
    check_floating(op, "x", x)
    scale = check_scale_factor(op, scale_factor)
    check_bool(op, "align_corners", align_corners)
    _check_upsampled_size(op, "x height", x.shape[2], scale)
    _check_upsampled_size(op, "x width", x.shape[3], scale)
    return scale


def check_upsample_backward_inputs(
    grad_out: Any, input_height: Any, input_width: Any, scale_factor: Any, align_corners: Any
) -> int:
    """grad_out (B, C, H*s, W*s) for an (H, W) input; returns scale_factor as an int."""
    op = "upsample_bilinear2d_backward"
    scale = check_scale_factor(op, scale_factor)
    height = check_int(op, "input_height", input_height)
    width = check_int(op, "input_width", input_width)
    for size in (height, width):
        require(
            size >= 0, ValueError, lambda: f"{op}: input_height and input_width must be >= 0, got {height} and {width}"
        )
    check_bool(op, "align_corners", align_corners)
    check_tensor(op, "grad_out", grad_out)
    require(
        grad_out.dim() == 4,
        ValueError,
        lambda: f"{op}: grad_out must be 4-D (B, C, H*s, W*s), got {grad_out.dim()}-D with shape {_shape(grad_out)}",
    )
    check_device(op, "grad_out", grad_out)
    check_floating(op, "grad_out", grad_out)
    _check_upsampled_size(op, "input_height", height, scale)
    _check_upsampled_size(op, "input_width", width, scale)
    out_h, out_w = height * scale, width * scale

    def message() -> str:
        return (
            f"{op}: grad_out must be (B, C, {out_h}, {out_w}) for input {height}x{width} and scale_factor "
            f"{scale}, got {_shape(grad_out)}"
        )

    require(grad_out.shape[2] == out_h, ValueError, message)
    require(grad_out.shape[3] == out_w, ValueError, message)
    return scale


# ----------------------------------------------------------------------------------------------- gelu


def check_approximate(op: str, approximate: Any) -> str:
    if not isinstance(approximate, str):
        raise TypeError(
            f'{op}: approximate must be "none" or "tanh", got {approximate!r} of type {type(approximate).__name__}'
        )
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f'{op}: approximate must be "none" or "tanh", got {approximate!r}')
    return approximate


def check_gelu_inputs(x: Any, approximate: Any, op: str = "gelu") -> None:
    """x a floating tensor of any shape, approximate "none" or "tanh"."""
    if type(approximate) is str and approximate in GELU_APPROXIMATIONS and isinstance(x, torch.Tensor):
        if _kernel_dtype_and_device(x):
            return
    checked_gelu_inputs(x, approximate, op)


def checked_gelu_inputs(x: Any, approximate: Any, op: str = "gelu") -> None:
    """check_gelu_inputs, one check after the other."""
    check_tensor(op, "x", x)
    check_approximate(op, approximate)
    check_device(op, "x", x)
    check_floating(op, "x", x)


def check_gelu_backward_inputs(grad_out: Any, x: Any, approximate: Any) -> None:
    """grad_out with the shape, dtype and device of x."""
    op = "gelu_backward"
    checked_gelu_inputs(x, approximate, op)
    check_tensor(op, "grad_out", grad_out)
    check_same_device_and_dtype(op, "grad_out", grad_out, "x", x)

    def message() -> str:
        return f"{op}: grad_out must have the shape of x {_shape(x)}, got {_shape(grad_out)}"

    require(grad_out.dim() == x.dim(), ValueError, message)
    for grad_size, size in zip(grad_out.shape, x.shape):  # one SymBool at a time under tracing
        require(grad_size == size, ValueError, message)
