"""The three hot ops the model calls, chosen per op between our kernels (``custom``) and the PyTorch references.

The model never imports :mod:`cuda_ext` itself: it receives an :class:`OpSet`, so ``ops=torch`` swaps every op
(and ``ops.trilinear=torch`` etc. swap one) without touching model code.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch

BACKENDS = ("custom", "torch")
# config key -> name of the function in cuda_ext / cuda_ext.reference
OP_FUNCTIONS = {"trilinear": "grid_interpolate", "upsample": "upsample_bilinear2d", "gelu": "gelu"}


@dataclass(frozen=True)
class OpSet:
    """Callables with the signatures of :mod:`cuda_ext`:

    - ``grid_interpolate(grid (R0,R1,R2,C), points (N,3) in [-1,1]) -> (N,C)``
    - ``upsample_bilinear2d(x (B,C,H,W), scale_factor: int, align_corners=False) -> (B,C,sH,sW)``
    - ``gelu(x, approximate="none") -> x.shape``

    ``backends`` maps "trilinear"/"upsample"/"gelu" to "custom" or "torch" (for logs and metrics.json).
    """

    grid_interpolate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    upsample_bilinear2d: Callable[..., torch.Tensor]
    gelu: Callable[..., torch.Tensor]
    backends: dict[str, str] = field(default_factory=dict)


def build_ops(ops_cfg: Mapping[str, str]) -> OpSet:
    """OpSet from ``{"trilinear": b, "upsample": b, "gelu": b}`` with each b in {"custom", "torch"}.

    Raises ValueError naming the key for a missing key, an unknown key or an unknown backend.
    """
    if not isinstance(ops_cfg, Mapping):
        raise ValueError(f"ops: expected a mapping with keys {sorted(OP_FUNCTIONS)}, got {type(ops_cfg).__name__}")
    unknown = sorted(set(ops_cfg) - set(OP_FUNCTIONS))
    if unknown:
        raise ValueError(f"ops.{unknown[0]}: unknown op (expected one of {', '.join(OP_FUNCTIONS)})")
    import cuda_ext  # deferred: importing loads the compiled extension

    chosen: dict[str, Callable] = {}
    backends: dict[str, str] = {}
    for key, function in OP_FUNCTIONS.items():
        if key not in ops_cfg:
            raise ValueError(f"ops.{key}: missing (expected 'custom' or 'torch')")
        backend = ops_cfg[key]
        if backend not in BACKENDS:
            raise ValueError(f"ops.{key}: unknown backend {backend!r} (expected 'custom' or 'torch')")
        module = cuda_ext if backend == "custom" else cuda_ext.reference
        try:
            chosen[function] = getattr(module, function)
        except ImportError as error:  # the custom op without a compiled extension
            raise ValueError(f"ops.{key}: {error}") from None
        backends[key] = str(backend)
    return OpSet(**chosen, backends=backends)
