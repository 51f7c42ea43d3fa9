"""Custom PyTorch ops with hand-written CPU (C++) and CUDA kernels, forward and backward.

Public ops (each differentiable, dispatching on the input's device):

- :func:`trilinear_interpolate` (N,8,F) x (N,3) -> (N,F): the tutorial's pairwise form.
- :func:`grid_interpolate` (R0,R1,R2,C) x (N,3) -> (N,C): fused dense-grid lookup.
- :func:`brick_grid_interpolate` (M,C) bricks + (T0,T1,T2) int32 table x (N,3) -> (N,C): sparse-grid lookup.
- :func:`upsample_bilinear2d` (B,C,H,W) -> (B,C,sH,sW).
- :func:`gelu`, exact or tanh; :func:`gelu_rows`, GELU of x plus a gathered row (the decoder's first layer).
- :func:`sparse_adam_step` Adam on the listed rows of a (M, C) parameter, in place (masked Adam);
  :func:`masked_adam_step` the same on the elements whose gradient is non-zero (no list of rows).
- :func:`march_rays` (B,3) rays + an occupancy grid -> packed samples (N,) ray, (N,) t, (N,3) points, offsets;
  :func:`march_rays_capped` the same into outputs of a given size, with no device sync (CUDA graphs).
- :func:`volume_render` packed samples (N,), (N,C) + (B+1,) ray offsets -> (B,C) colour, (B,) opacity, depth.
- :func:`visible_samples` packed optical depths (N,) + (B+1,) offsets -> the samples a ray still sees and those
  worth a colour (early termination, the weight threshold), as indices (no gradient); :func:`visible_samples_capped`
  the same into outputs of given sizes, with no device sync (CUDA graphs).
- :func:`distortion_loss` packed optical depths (N,), intervals (N,), (N,) + (B+1,) offsets -> (B,) mip-NeRF 360's
  distortion loss on the compositing weights.
- :func:`sampled_tv` a grid's total variation on (S,) sampled cells -> () float64, its gradient added in place.

:mod:`cuda_ext.kept_grad` marks a grid whose existing ``.grad`` the lookups' backward adds onto in place (their
``grad_into``) instead of filling a fresh zero gradient each step; ``masked_adam_step(clear_grad=True)`` leaves it
zero for the next step.

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
    from cuda_ext.adam import masked_adam_step, sparse_adam_step
    from cuda_ext.brick_grid import brick_grid_interpolate
    from cuda_ext.gelu import gelu, gelu_rows
    from cuda_ext.march import march_rays, march_rays_capped
    from cuda_ext.render import distortion_loss, visible_samples, visible_samples_capped, volume_render
    from cuda_ext.trilinear import grid_interpolate, trilinear_interpolate
    from cuda_ext.tv import sampled_tv
    from cuda_ext.upsample import upsample_bilinear2d

_CUSTOM_OPS = (
    "trilinear_interpolate",
    "grid_interpolate",
    "brick_grid_interpolate",
    "upsample_bilinear2d",
    "gelu",
    "gelu_rows",
    "volume_render",
    "distortion_loss",
    "visible_samples",
    "visible_samples_capped",
    "march_rays",
    "march_rays_capped",
    "sparse_adam_step",
    "masked_adam_step",
    "sampled_tv",
)


def __getattr__(name: str):
    # only reached when the import above failed: the custom ops were never defined
    if name in _CUSTOM_OPS:
        raise ImportError(_MISSING)
    raise AttributeError(f"module 'cuda_ext' has no attribute {name!r}")


def has_extension() -> bool:
    """True when the compiled extension (the custom ops' kernels) is loaded."""
    return _C is not None


# Read before _refuse_cuda_without_kernels registers its stand-ins under the CUDA key.
_BUILT_WITH_CUDA = _C is not None and torch._C._dispatch_has_kernel_for_dispatch_key("cuda_ext::gelu", "CUDA")
REBUILD_WITH_CUDA = "FORCE_CUDA=1 python3 -m pip install --no-build-isolation -e ."


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return _BUILT_WITH_CUDA


def build_info() -> dict:
    """What the installed extension holds: ``{"extension": bool, "cpu": bool, "cuda": bool, "cuda_arch_list": str,
    "torch": str, "torch_cuda": str | None, "built_with_torch": str | None}``."""
    try:
        from cuda_ext import _build_config as built
    except ImportError:  # built by an older setup.py, or not built
        built = None
    return {
        "extension": _C is not None,
        "cpu": _C is not None,
        "cuda": _BUILT_WITH_CUDA,
        "cuda_arch_list": getattr(built, "CUDA_ARCH_LIST", "") if _BUILT_WITH_CUDA else "",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "built_with_torch": getattr(built, "TORCH_VERSION", None),
    }


def _refuse_cuda_without_kernels() -> None:
    """Give every op a CUDA kernel that raises a clear error, when the build has none.

    Without it a CUDA tensor reaches the dispatcher, whose "could not run ... with arguments from the 'CUDA'
    backend" lists every registered key but not the fix.
    """
    global _NO_CUDA_LIBRARY

    def refuse(name: str):
        def kernel(*args, **kwargs):
            raise RuntimeError(
                f"cuda_ext.{name}: got CUDA tensors, but cuda_ext was built without its CUDA kernels (no GPU or "
                f"CUDA toolkit at build time). Rebuild with the CUDA toolkit on PATH: `{REBUILD_WITH_CUDA}`; "
                "or use the PyTorch references (ops=torch, cuda_ext.reference)"
            )

        return kernel

    _NO_CUDA_LIBRARY = torch.library.Library("cuda_ext", "IMPL")  # kept alive: dropping it unregisters
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("cuda_ext::"):
            name = qualified.split("::", 1)[1].split(".")[0]
            _NO_CUDA_LIBRARY.impl(name, refuse(name), "CUDA")


if _C is not None and not _BUILT_WITH_CUDA:
    _refuse_cuda_without_kernels()


__all__ = [
    "trilinear_interpolate",
    "grid_interpolate",
    "brick_grid_interpolate",
    "upsample_bilinear2d",
    "gelu",
    "gelu_rows",
    "volume_render",
    "distortion_loss",
    "visible_samples",
    "visible_samples_capped",
    "march_rays",
    "march_rays_capped",
    "sparse_adam_step",
    "masked_adam_step",
    "sampled_tv",
    "reference",
    "has_extension",
    "has_cuda_kernels",
    "build_info",
]
