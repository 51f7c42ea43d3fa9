"""Custom PyTorch ops with hand-written CPU (C++) and CUDA kernels, forward and backward.

Public ops (each differentiable, dispatching on the input's device):

- :func:`trilinear_interpolate` (N,8,F) x (N,3) -> (N,F): the tutorial's pairwise form.
- :func:`grid_interpolate` (R0,R1,R2,C) x (N,3) -> (N,C): fused dense-grid lookup.
- :func:`upsample_bilinear2d` (B,C,H,W) -> (B,C,sH,sW).
- :func:`gelu`, exact or tanh.

:mod:`cuda_ext.reference` holds pure-PyTorch versions with the same signatures.
"""
import torch  # noqa: F401  (loads libtorch, which _C links against)
from cuda_ext import _C  # noqa: F401  (loads the library: registers torch.ops.cuda_ext.*)
from cuda_ext import reference
from cuda_ext.gelu import gelu
from cuda_ext.trilinear import grid_interpolate, trilinear_interpolate
from cuda_ext.upsample import upsample_bilinear2d


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels."""
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key("cuda_ext::gelu", "CUDA")


__all__ = [
    "trilinear_interpolate",
    "grid_interpolate",
    "upsample_bilinear2d",
    "gelu",
    "reference",
    "has_cuda_kernels",
]
