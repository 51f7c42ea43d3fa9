"""GELU, exact or tanh-approximated: the typed wrapper of ``torch.ops.cuda_ext.gelu``, the fake (meta)
kernels for ``torch.compile``, and the autograd formulas of ``gelu`` and of ``gelu_backward`` (so the op
has derivatives of every order: double backward, gradient penalties).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from cuda_ext import _checks
from cuda_ext._gelu_rows_checks import check_gelu_rows_backward_inputs, check_gelu_rows_inputs

__all__ = ["gelu", "gelu_rows"]

APPROXIMATIONS = _checks.GELU_APPROXIMATIONS

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Elementwise GELU, equal to ``F.gelu(x, approximate=approximate)``.

    Args:
        x: tensor of any shape, float32/float64 (float16/bfloat16 on CUDA, computed in float32).
        approximate: ``"none"`` (exact, with erf) or ``"tanh"``.
    Returns:
        A contiguous tensor with the shape, dtype and device of ``x``. Differentiable in ``x`` to any order
        (the first derivative is the kernel ``gelu_backward``, the second is written with torch ops).
    Raises:
        TypeError: ``x`` not a tensor, of another dtype, or ``approximate`` not a str.
        ValueError: ``approximate`` another string, or ``x`` on a device without kernels.
    """
    _checks.check_gelu_inputs(x, approximate)
    return torch.ops.cuda_ext.gelu(x, approximate)


def gelu_rows(x: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x + rows[index])`` in one pass, without the (N, H) gathered tensor: the decoder's first activation,
    where ``rows`` holds what depends only on a ray (its direction's encoding through the first layer) and x the
    per-sample part.

    Args:
        x: (N, H) float32/float64 (float16/bfloat16 on CUDA, computed in float32 after the sum is rounded).
        rows: (B, H), x's dtype and device. index: (N,) int64 in [0, B) (checked on the CPU; on CUDA an
            out-of-range index makes its output row NaN instead of costing a host sync to check).
        approximate: ``"none"`` or ``"tanh"``.
    Returns:
        (N, H), x's dtype. Differentiable in x and rows (first order): the backward op
        (``gelu_rows_backward`` -> (grad_x (N, H), grad_rows (B, H))) sums each row's samples' grad_x in float32
        (float64 for float64) in the same pass, as models.decoder.gather_rows sums its gathered rows.
    """
    check_gelu_rows_inputs(x, rows, index, approximate)
    return torch.ops.cuda_ext.gelu_rows(x, rows, index, approximate)


# ----------------------------------------------------------------------------------------- fake kernels


@torch.library.register_fake("cuda_ext::gelu")
def _gelu_fake(x: torch.Tensor, approximate: str) -> torch.Tensor:
    _checks.checked_gelu_inputs(x, approximate)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("cuda_ext::gelu_backward")
def _gelu_backward_fake(grad_out: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    _checks.check_gelu_backward_inputs(grad_out, x, approximate)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------------------------- autograd


def gelu_second_derivative(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """d^2 gelu / dx^2 in closed form, with torch ops (so it is differentiable itself).

    - ``"none"``: gelu = x Phi(x), gelu' = Phi(x) + x phi(x), gelu'' = phi(x) (2 - x^2).
    - ``"tanh"``: gelu = x (1 + tanh(u)) / 2 with u = k (x + a x^3), k = sqrt(2/pi), a = 0.044715;
      gelu'' = (1 - t^2) (u' - x t u'^2 + 3 k a x^2) with t = tanh(u), u' = k (1 + 3 a x^2).

    float16/bfloat16 are computed in float32, like the kernels.
    """
    xc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    x_sq = xc * xc
    if approximate == "tanh":
        t = torch.tanh(_SQRT_2_OVER_PI * (xc + _KAPPA * x_sq * xc))
        d_inner = _SQRT_2_OVER_PI * (1 + 3 * _KAPPA * x_sq)
        second = (1 - t * t) * (d_inner - xc * t * d_inner * d_inner + (3 * _SQRT_2_OVER_PI * _KAPPA) * x_sq)
    else:
        second = (_INV_SQRT_2PI * torch.exp(-0.5 * x_sq)) * (2 - x_sq)
    return second


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, approximate = inputs
    ctx.save_for_backward(x)
    ctx.approximate = approximate


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (x,) = ctx.saved_tensors
    return torch.ops.cuda_ext.gelu_backward(grad, x, ctx.approximate), None


def _setup_backward_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    grad_out, x, approximate = inputs
    ctx.save_for_backward(grad_out, x)
    ctx.approximate = approximate


def _backward_of_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    # gelu_backward(grad_out, x) = grad_out * gelu'(x): linear in grad_out, whose gradient is therefore
    # gelu_backward itself applied to the incoming gradient; the gradient wrt x is grad_out * gelu''(x) * grad.
    grad_out, x = ctx.saved_tensors
    grad_grad_out = grad_x = None
    if ctx.needs_input_grad[0]:
        grad_grad_out = torch.ops.cuda_ext.gelu_backward(grad, x, ctx.approximate)
    if ctx.needs_input_grad[1]:
        second = gelu_second_derivative(x, ctx.approximate)
        grad_x = (grad.to(second.dtype) * grad_out.to(second.dtype) * second).to(x.dtype)
    return grad_grad_out, grad_x, None


torch.library.register_autograd("cuda_ext::gelu", _backward, setup_context=_setup_context)
torch.library.register_autograd("cuda_ext::gelu_backward", _backward_of_backward, setup_context=_setup_backward_context)


@torch.library.register_fake("cuda_ext::gelu_rows")
def _gelu_rows_fake(x: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, approximate: str) -> torch.Tensor:
    check_gelu_rows_inputs(x, rows, index, approximate)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("cuda_ext::gelu_rows_backward")
def _gelu_rows_backward_fake(grad_out, x, rows, index, approximate: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_gelu_rows_backward_inputs(grad_out, x, rows, index, approximate)
    grad_x = torch.empty_like(x, memory_format=torch.contiguous_format)
    return grad_x, rows.new_empty(rows.shape, dtype=_summed_dtype(rows.dtype))


def _summed_dtype(dtype: torch.dtype) -> torch.dtype:
    """gelu_rows_backward's rows gradient: float32 sums for float16/bfloat16/float32, float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def _setup_rows_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, rows, index, approximate = inputs
    ctx.save_for_backward(x, rows, index)
    ctx.approximate = approximate


def _rows_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, rows, index = ctx.saved_tensors
    if torch.is_grad_enabled() and any(t.requires_grad for t in (grad, x, rows)):  # fail loudly, not a silent zero
        raise RuntimeError("gelu_rows: double backward (create_graph=True through this op) is not supported")
    # the rows' gradient comes summed from the same pass: each row's samples in float32 (float64 stays), rounded once
    grad_x, summed = torch.ops.cuda_ext.gelu_rows_backward(grad.contiguous(), x, rows, index, ctx.approximate)
    grad_rows = summed.to(rows.dtype) if ctx.needs_input_grad[1] else None
    return grad_x if ctx.needs_input_grad[0] else None, grad_rows, None, None


torch.library.register_autograd("cuda_ext::gelu_rows", _rows_backward, setup_context=_setup_rows_context)
