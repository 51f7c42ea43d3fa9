"""GELU, exact or tanh-approximated: the typed wrapper of ``torch.ops.cuda_ext.gelu``, its fake (meta)
kernel for ``torch.compile``, and its autograd formula.
"""
from __future__ import annotations

from typing import Any

import torch

__all__ = ["gelu"]

APPROXIMATIONS = ("none", "tanh")


def _check_approximate(approximate: Any) -> str:
    if not isinstance(approximate, str) or approximate not in APPROXIMATIONS:
        raise ValueError(f'approximate must be "none" or "tanh", got {approximate!r}')
    return approximate


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Elementwise GELU, equal to ``F.gelu(x, approximate=approximate)``.

    Args:
        x: tensor of any shape, float32/float64 (float16/bfloat16 on CUDA, computed in float32).
        approximate: ``"none"`` (exact, with erf) or ``"tanh"``.
    Returns:
        A contiguous tensor with the shape, dtype and device of ``x``. Differentiable in ``x``.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    return torch.ops.cuda_ext.gelu(x, _check_approximate(approximate))


@torch.library.register_fake("cuda_ext::gelu")
def _gelu_fake(x: torch.Tensor, approximate: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("cuda_ext::gelu_backward")
def _gelu_backward_fake(grad_out: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    torch._check(grad_out.shape == x.shape, lambda: "gelu_backward: grad_out must have the shape of x")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, approximate = inputs
    ctx.save_for_backward(x)
    ctx.approximate = approximate


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (x,) = ctx.saved_tensors
    return torch.ops.cuda_ext.gelu_backward(grad, x, ctx.approximate), None


torch.library.register_autograd("cuda_ext::gelu", _backward, setup_context=_setup_context)
