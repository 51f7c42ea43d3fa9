"""Typed wrappers, fake (meta) kernels and autograd for the trilinear op family.

The kernels live in ``csrc/{cpu,cuda}/trilinear.*`` (the pairwise op) and ``csrc/cpu/grid_interpolate.cpp``,
``csrc/cuda/grid_interpolate{,_backward,_buckets}.cu`` (the grid lookup); the schemas in
``csrc/registration.cpp``. The wrappers and the fake kernels check their arguments with
``cuda_ext._checks`` (metadata only; ``ValueError``/``TypeError`` naming the argument), the same checks as
the C++ entry points, which stay as the backstop for direct ``torch.ops`` calls (``RuntimeError``) and make
the inputs contiguous.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from cuda_ext import _checks
from cuda_ext.kept_grad import check_grad_into, grad_target, is_kept

__all__ = ["trilinear_interpolate", "grid_interpolate"]

_OPS = torch.ops.cuda_ext


def trilinear_interpolate(feats: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Blend each point's 8 cell-corner features.

    Args:
        feats: (N, 8, F) corner features; corner ``k = 4*iu + 2*iw + iv``: with ``a, b, c, d = (1-v)(1-w),
            v(1-w), (1-v)w, vw`` the output is ``(1-u)(a f0 + b f1 + c f2 + d f3) + u(a f4 + b f5 + c f6 + d f7)``,
            so corner 1 has weight ``(1-u) v (1-w)`` and corner 2 ``(1-u)(1-v) w``. (The code published in
            kwea123/pytorch-cppcuda-tutorial puts b and c the other way round: swap corners 1<->2 and 5<->6.)
        points: (N, 3) local coordinates in [-1, 1]; (u, v, w) = (points + 1) / 2.
    Returns:
        (N, F): ``sum_k weight_k * feats[:, k]`` with weight
        ``(u if iu else 1-u) * (v if iv else 1-v) * (w if iw else 1-w)``.

    Differentiable with respect to ``feats`` and ``points``; float32/float64 on CPU and CUDA,
    float16/bfloat16 on CUDA (float32 accumulation).
    """
    _checks.check_trilinear_inputs(feats, points)
    return _OPS.trilinear_interpolate(feats, points)


def grid_interpolate(grid: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Trilinear lookup of a dense channels-last voxel grid, without materialising (N, 8, C).

    Args:
        grid: (R0, R1, R2, C) voxel values, every R >= 1.
        points: (N, 3) coordinates in [-1, 1] along grid axes 0, 1, 2.
    Returns:
        (N, C). Per axis ``p = (point + 1) / 2 * (R - 1)`` clamped to [0, R - 1] (align_corners=True,
        border padding), then the blend of the 8 voxels around p (``cuda_ext.reference.grid_interpolate``).
        Non-finite coordinates (``cuda_ext.reference.grid_interpolate`` gives the same rows): NaN makes the
        point's row NaN; -inf clamps to voxel 0 and +inf to voxel R-1 like any outside point, except along
        an axis with R == 1, where (point + 1) / 2 * 0 is NaN and so is the row. The backward runs on them
        too: a NaN row adds NaN to the grid gradient at the 8 voxels it reads (0 and 1 along the NaN axis;
        the reference's gradient is the same) and its points gradient is 0 along the NaN axis and NaN along
        the others (the reference gives 0 instead where the clamp holds).

    Differentiable with respect to ``grid`` (scatter-add) and ``points`` (zero where the clamp holds).
    On CUDA, a large batch of incoherent points on a grid larger than L2 is visited in axis-0 bucket order
    (same rows, bit for bit); the environment variable ``CUDA_EXT_GRID_REORDER`` (``auto``, ``off``,
    ``always``) controls that.
    """
    _checks.check_grid_inputs(grid, points)
    return _OPS.grid_interpolate(grid, points)


# ----------------------------------------------------------------------------------------- fake kernels


def _backward_outputs(
    values: torch.Tensor,
    points: torch.Tensor,
    values_requires_grad: bool,
    points_requires_grad: bool,
    grad_into: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward ops return a gradient shaped like each requested input, and (0,) for the other; a lookup given
    ``grad_into`` adds the values' gradient onto it and returns (0,) in its place."""
    values_out = values_requires_grad and grad_into is None
    grad_values = values.new_empty(values.shape if values_out else (0,))
    grad_points = points.new_empty(points.shape if points_requires_grad else (0,))
    return grad_values, grad_points


@torch.library.register_fake("cuda_ext::trilinear_interpolate")
def _trilinear_fake(feats: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    _checks.checked_trilinear_inputs(feats, points)
    return feats.new_empty((feats.shape[0], feats.shape[2]))


@torch.library.register_fake("cuda_ext::trilinear_interpolate_backward")
def _trilinear_backward_fake(
    grad_out: torch.Tensor,
    feats: torch.Tensor,
    points: torch.Tensor,
    feats_requires_grad: bool,
    points_requires_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    _checks.check_trilinear_backward_inputs(grad_out, feats, points)
    return _backward_outputs(feats, points, feats_requires_grad, points_requires_grad)


@torch.library.register_fake("cuda_ext::grid_interpolate")
def _grid_fake(grid: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    _checks.checked_grid_inputs(grid, points)
    _checks.check_grid_reorder_setting()
    return grid.new_empty((points.shape[0], grid.shape[3]))


@torch.library.register_fake("cuda_ext::grid_interpolate_backward")
def _grid_backward_fake(
    grad_out: torch.Tensor,
    grid: torch.Tensor,
    points: torch.Tensor,
    grid_requires_grad: bool,
    points_requires_grad: bool,
    grad_into: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _checks.check_grid_backward_inputs(grad_out, grid, points)
    check_grad_into("grid_interpolate_backward", grad_into, grid, "grid", grid_requires_grad)
    return _backward_outputs(grid, points, grid_requires_grad, points_requires_grad, grad_into)


# ----------------------------------------------------------------------------------------------- autograd


def _save_inputs(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)
    ctx.kept = inputs[0] if is_kept(inputs[0]) else None  # its .grad is added onto in place (cuda_ext.kept_grad)


def into_kept_grad(ctx: Any, needs_values: bool) -> Optional[torch.Tensor]:
    """A lookup backward's ``grad_into``: the kept ``.grad`` of the looked-up table (cuda_ext.kept_grad), added onto
    in place, or None (a fresh gradient, returned to autograd)."""
    return grad_target(ctx.kept) if needs_values else None


def _refuse_double_backward(name: str, *tensors: torch.Tensor) -> None:
    """The backward ops have no derivative of their own: fail loudly instead of a silent zero."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError(f"{name}: double backward (create_graph=True through this op) is not supported")


def _make_backward(name: str, backward_op: Any, adds_into_kept: bool):
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        values, points = ctx.saved_tensors
        _refuse_double_backward(name, grad_out, values, points)
        needs_values, needs_points = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        into = into_kept_grad(ctx, needs_values) if adds_into_kept else None
        extra = () if into is None else (into,)
        grad_values, grad_points = backward_op(grad_out, values, points, needs_values, needs_points, *extra)
        return (grad_values if needs_values and into is None else None), (grad_points if needs_points else None)

    return backward


torch.library.register_autograd(
    "cuda_ext::trilinear_interpolate",
    _make_backward("trilinear_interpolate", _OPS.trilinear_interpolate_backward, adds_into_kept=False),
    setup_context=_save_inputs,
)
torch.library.register_autograd(
    "cuda_ext::grid_interpolate",
    _make_backward("grid_interpolate", _OPS.grid_interpolate_backward, adds_into_kept=True),
    setup_context=_save_inputs,
)
