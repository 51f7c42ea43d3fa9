"""The sparse brick-grid lookup: the typed wrapper of ``torch.ops.cuda_ext.brick_grid_interpolate``, its fake
(meta) kernels and its autograd.

The kernels live in ``csrc/cpu/brick_grid.cpp`` and ``csrc/cuda/brick_grid.cu`` (geometry and the C++ checks in
``csrc/brick_grid.h``); the schemas in ``csrc/registration.cpp``. The wrapper and the fake kernels check their
arguments with ``cuda_ext._brick_checks`` (metadata only; ``ValueError``/``TypeError`` naming the argument).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch

from cuda_ext import _brick_checks
from cuda_ext.kept_grad import check_grad_into, is_kept
from cuda_ext.trilinear import _backward_outputs, _refuse_double_backward, into_kept_grad

__all__ = ["brick_grid_interpolate"]

_OPS = torch.ops.cuda_ext


def brick_grid_interpolate(
    values: torch.Tensor, table: torch.Tensor, points: torch.Tensor, shape: Sequence[int], brick: int
) -> torch.Tensor:
    """Trilinear lookup of a sparse voxel grid stored as bricks of ``brick``^3 vertices.

    The grid is a virtual dense (V0, V1, V2, C) grid whose vertex (i0, i1, i2) holds
    ``values[table[i0 // B, i1 // B, i2 // B] * B**3 + ((i0 % B) * B + i1 % B) * B + i2 % B]`` when that table
    entry is a slot of the pool, and zeros otherwise (an empty brick). The result is exactly
    ``grid_interpolate(dense, points)`` on that grid, without materialising it: each of a point's 8 corners is
    looked up on its own, so a cell may straddle up to 8 bricks and bricks need no overlapping apron.

    Args:
        values: (M, C) the brick pool, float32/float64 (float16/bfloat16 on CUDA); M a multiple of B**3, slot s
            holding rows [s * B**3, (s + 1) * B**3).
        table: (T0, T1, T2) int32 with T_a = ceil(V_a / B), on values' device: each brick's slot. An entry < 0
            or >= M / B**3 is an empty brick (never read out of bounds, whatever the table holds).
        points: (N, 3) coordinates in [-1, 1] along axes 0, 1, 2, values' dtype and device; the conventions
            of :func:`cuda_ext.grid_interpolate` (align_corners=True, border clamp, the same NaN/inf rows).
        shape: the virtual grid's vertex counts (V0, V1, V2), each in [1, 2**31 - 1].
        brick: B, vertices per brick side, in [1, 1024] (the model uses 8).
    Returns:
        (N, C), values' dtype.

    Differentiable with respect to ``values`` (a scatter-add of w_k * grad_out into the rows of a point's
    non-empty corners) and ``points`` (from the per-corner dot products with grad_out, 0 for empty corners;
    zero where the clamp holds); ``table`` is not differentiable.
    """
    shape, brick = _brick_checks.check_brick_grid_inputs(values, table, points, shape, brick)
    return _OPS.brick_grid_interpolate(values, table, points, shape, brick)


# ----------------------------------------------------------------------------------------- fake kernels


@torch.library.register_fake("cuda_ext::brick_grid_interpolate")
def _brick_grid_fake(
    values: torch.Tensor, table: torch.Tensor, points: torch.Tensor, shape: Sequence[int], brick: int
) -> torch.Tensor:
    _brick_checks.checked_brick_grid_inputs(values, table, points, shape, brick)
    return values.new_empty((points.shape[0], values.shape[1]))


@torch.library.register_fake("cuda_ext::brick_grid_interpolate_backward")
def _brick_grid_backward_fake(
    grad_out: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    points: torch.Tensor,
    shape: Sequence[int],
    brick: int,
    values_requires_grad: bool,
    points_requires_grad: bool,
    grad_into: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _brick_checks.check_brick_grid_backward_inputs(grad_out, values, table, points, shape, brick)
    check_grad_into("brick_grid_interpolate_backward", grad_into, values, "values", values_requires_grad)
    return _backward_outputs(values, points, values_requires_grad, points_requires_grad, grad_into)


# ----------------------------------------------------------------------------------------------- autograd


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    values, table, points, shape, brick = inputs
    ctx.save_for_backward(values, table, points)
    ctx.shape, ctx.brick = shape, brick
    ctx.kept = values if is_kept(values) else None  # its .grad is added onto in place (cuda_ext.kept_grad)


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
    values, table, points = ctx.saved_tensors
    _refuse_double_backward("brick_grid_interpolate", grad_out, values, points)
    needs_values, needs_points = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    into = into_kept_grad(ctx, needs_values)
    grad_values, grad_points = _OPS.brick_grid_interpolate_backward(
        grad_out, values, table, points, ctx.shape, ctx.brick, needs_values, needs_points, into
    )
    values_grad = grad_values if needs_values and into is None else None
    return values_grad, None, (grad_points if needs_points else None), None, None


torch.library.register_autograd("cuda_ext::brick_grid_interpolate", _backward, setup_context=_setup_context)
