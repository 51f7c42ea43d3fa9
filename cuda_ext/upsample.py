"""Bilinear upsampling by an integer factor: the typed wrapper of ``torch.ops.cuda_ext.upsample_bilinear2d``,
its fake (meta) kernel for ``torch.compile``, and its autograd formula (a gather kernel, no atomics).
"""

from __future__ import annotations

from typing import Any

import torch

from cuda_ext import _checks

__all__ = ["upsample_bilinear2d"]


def upsample_bilinear2d(x: torch.Tensor, scale_factor: int, align_corners: bool = False) -> torch.Tensor:
    """Bilinear upsampling, equal to ``F.interpolate(x, scale_factor=s, mode="bilinear", align_corners=...)``.

    Args:
        x: (B, C, H, W) float32/float64 tensor (float16/bfloat16 on CUDA, computed in float32).
        scale_factor: integer s >= 1, the same along H and W (H*s and W*s at most 2**31 - 1).
        align_corners: as in ``F.interpolate``.
    Returns:
        (B, C, H*s, W*s), contiguous, same dtype and device as ``x``. Differentiable in ``x`` to any order
        (the op is linear: its backward is the adjoint gather, whose own backward is the forward).
    Raises:
        TypeError: ``x`` not a tensor or of another dtype, ``scale_factor`` not an int, ``align_corners``
            not a bool.
        ValueError: ``x`` not 4-D or on a device without kernels, ``scale_factor`` < 1, sizes too large.
    """
    scale = _checks.check_upsample_inputs(x, scale_factor, align_corners)
    return torch.ops.cuda_ext.upsample_bilinear2d(x, scale, align_corners)


# ----------------------------------------------------------------------------------------- fake kernels


@torch.library.register_fake("cuda_ext::upsample_bilinear2d")
def _upsample_fake(x: torch.Tensor, scale_factor: int, align_corners: bool) -> torch.Tensor:
    _checks.checked_upsample_inputs(x, scale_factor, align_corners)
    b, c, h, w = x.shape
    return x.new_empty((b, c, h * scale_factor, w * scale_factor))


@torch.library.register_fake("cuda_ext::upsample_bilinear2d_backward")
def _upsample_backward_fake(
    grad_out: torch.Tensor, input_height: int, input_width: int, scale_factor: int, align_corners: bool
) -> torch.Tensor:
    _checks.check_upsample_backward_inputs(grad_out, input_height, input_width, scale_factor, align_corners)
    return grad_out.new_empty((grad_out.shape[0], grad_out.shape[1], input_height, input_width))


# ----------------------------------------------------------------------------------------------- autograd


def _setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, scale_factor, align_corners = inputs
    ctx.input_size = (x.shape[2], x.shape[3])
    ctx.scale_factor = scale_factor
    ctx.align_corners = align_corners


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    height, width = ctx.input_size
    grad_x = torch.ops.cuda_ext.upsample_bilinear2d_backward(grad, height, width, ctx.scale_factor, ctx.align_corners)
    return grad_x, None, None


def _setup_backward_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _, _, _, scale_factor, align_corners = inputs
    ctx.scale_factor = scale_factor
    ctx.align_corners = align_corners


def _backward_of_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    # The backward is linear in grad_out and is the adjoint of the forward, so its own gradient is
    # the forward applied to the incoming gradient (this is what makes double backward work).
    grad_grad_out = torch.ops.cuda_ext.upsample_bilinear2d(grad, ctx.scale_factor, ctx.align_corners)
    return grad_grad_out, None, None, None, None


torch.library.register_autograd("cuda_ext::upsample_bilinear2d", _backward, setup_context=_setup_context)
torch.library.register_autograd(
    "cuda_ext::upsample_bilinear2d_backward", _backward_of_backward, setup_context=_setup_backward_context
)
