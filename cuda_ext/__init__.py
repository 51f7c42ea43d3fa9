"""Custom PyTorch ops with hand-written CPU (C++) and CUDA kernels, forward and backward.

Public ops (each differentiable, dispatching on the input's device):

- :func:`trilinear_interpolate` (N,8,F) x (N,3) -> (N,F): the tutorial's pairwise form.
- :func:`grid_interpolate` (R0,R1,R2,C) x (N,3) -> (N,C): fused dense-grid lookup.
- :func:`upsample_bilinear2d` (B,C,H,W) -> (B,C,sH,sW).
- :func:`gelu`, exact or tanh.
- :func:`sparse_adam_step` Adam on the listed rows of a (M, C) parameter, in place (masked Adam).
- :func:`march_rays` (B,3) rays + an occupancy grid -> packed samples (N,) ray, (N,) t, (N,3) points, offsets.
- :func:`volume_render` packed samples (N,), (N,C) + (B+1,) ray offsets -> (B,C) colour, (B,) opacity, depth.

:mod:`cuda_ext.reference` holds pure-PyTorch versions with the same signatures; they need no compiled
extension, so ``import cuda_ext.reference`` and ``ops=torch`` work without a build. The custom ops need
``cuda_ext._C``: without it, using one raises an ImportError that says how to build it.
"""

import torch  # noqa: F401  (loads libtorch, which _C links against)

from cuda_ext import reference

try:
    from cuda_ext import _C  # noqa: F401  (loads the library: registers torch.ops.cuda_ext.*)
except ImportError as _error:  # not built (or built for another torch): the references still work
    _C = None
    _MISSING = (
        f"cuda_ext: the compiled extension cuda_ext._C cannot be loaded ({_error}); build it with "
        "`python3 -m pip install --no-build-isolation -e .` (cuda_ext.reference and ops=torch need no build)"
    )
else:
    from cuda_ext.adam import sparse_adam_step
    from cuda_ext.gelu import gelu
    from cuda_ext.march import march_rays
    from cuda_ext.render import volume_render
    from cuda_ext.trilinear import grid_interpolate, trilinear_interpolate
    from cuda_ext.upsample import upsample_bilinear2d

_CUSTOM_OPS = (
    "trilinear_interpolate",
    "grid_interpolate",
    "upsample_bilinear2d",
    "gelu",
    "volume_render",
    "march_rays",
    "sparse_adam_step",
)


def __getattr__(name: str):
    # only reached when the import above failed: the custom ops were never defined
    if name in _CUSTOM_OPS:
        raise ImportError(_MISSING)
    raise AttributeError(f"module 'cuda_ext' has no attribute {name!r}")


def has_extension() -> bool:
    """True when the compiled extension (the custom ops' kernels) is loaded."""
    return _C is not None


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key("cuda_ext::gelu", "CUDA")


__all__ = [
    "trilinear_interpolate",
    "grid_interpolate",
    "upsample_bilinear2d",
    "gelu",
    "volume_render",
    "march_rays",
    "sparse_adam_step",
    "reference",
    "has_extension",
    "has_cuda_kernels",
]
