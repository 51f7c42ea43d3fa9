"""The three hot ops the model calls, chosen per op between our kernels (``custom``) and the PyTorch references.

The model never imports :mod:`cuda_ext` itself: it receives an :class:`OpSet`, so ``ops=torch`` swaps every op
(and ``ops.grid_interpolate=torch`` etc. swap one) without touching model code. Each config key is the op's
name in :mod:`cuda_ext`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

import torch

BACKENDS = ("custom", "torch")
OP_NAMES = (
    "grid_interpolate",
    "upsample_bilinear2d",
    "gelu",
    "volume_render",
    "march_rays",
    "sparse_adam_step",
    "brick_grid_interpolate",
    "sampled_tv",
)  # the config keys: functions of cuda_ext
FAMILIES = {  # swapped by the family's key
    "gelu": ("gelu_rows",),
    "sparse_adam_step": ("masked_adam_step",),
    "volume_render": ("distortion_loss", "visible_samples", "visible_samples_capped"),
    "march_rays": ("march_rays_capped",),
}


@dataclass(frozen=True)
class OpSet:
    """Callables with the signatures of :mod:`cuda_ext`:

    - ``grid_interpolate(grid (R0,R1,R2,C), points (N,3) in [-1,1]) -> (N,C)``
    - ``brick_grid_interpolate(values (M,C), table (T0,T1,T2) int32, points (N,3), shape [V0,V1,V2], brick) -> (N,C)``
    - ``upsample_bilinear2d(x (B,C,H,W), scale_factor: int, align_corners=False) -> (B,C,sH,sW)``
    - ``gelu(x, approximate="none") -> x.shape``; ``gelu_rows(x (N,H), rows (B,H), index (N,), approximate) ->
      gelu(x + rows[index])`` (the same backend: ``ops.gelu``)
    - ``volume_render(optical_depth (N,), values (N,C), t (N,), ray_offsets (B+1,), early_stop) ->
      (values (B,C), opacity (B,), depth (B,))``; ``distortion_loss(optical_depth (N,), t_start (N,), t_end (N,),
      ray_offsets (B+1,)) -> (B,)`` (the regulariser on the same weights); ``visible_samples(optical_depth (N,),
      ray_offsets (B+1,), early_termination, weight_threshold) -> (index (A,), keep (K,), offsets (B+1,))`` (the
      samples a ray still sees, and those worth a colour); the same backend: ``ops.volume_render``
    - ``march_rays(origins, directions (B,3), t_start, t_end, offset (B,), occupancy (R0,R1,R2) bool, box (2,3),
      step, max_samples) -> (ray (N,), t (N,), points (N,3) in [-1,1], ray_offsets (B+1,))``;
      ``march_rays_capped(..., max_samples, capacity)`` and ``visible_samples_capped(..., alive_capacity,
      shown_capacity)``: the same into outputs of given sizes, the true counts on the device (model.capped_samples)
    - ``sparse_adam_step(param, grad, exp_avg, exp_avg_sq (M,C), rows (K,), step, lr, beta1, beta2, eps)``,
      ``masked_adam_step(param, grad, exp_avg, exp_avg_sq (M,C), step, lr, beta1, beta2, eps)`` (the elements whose
      gradient is non-zero) (the optimisers', training.optim; the same backend: ``ops.sparse_adam_step``)
    - ``sampled_tv(grad (M,C), values (M,C), cells (S,), shape [R0,R1,R2], inside, outside, scale) -> ()``: the TV
      estimate, its gradient added into ``grad`` (the model's TV terms, after the backward)

    ``backends`` maps each op's name to "custom" or "torch" (for logs and metrics.json).
    """

    grid_interpolate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    brick_grid_interpolate: Callable[..., torch.Tensor]
    upsample_bilinear2d: Callable[..., torch.Tensor]
    gelu: Callable[..., torch.Tensor]
    gelu_rows: Callable[..., torch.Tensor]
    volume_render: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    distortion_loss: Callable[..., torch.Tensor]
    visible_samples: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    march_rays: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
    march_rays_capped: Callable[..., tuple[torch.Tensor, ...]]
    visible_samples_capped: Callable[..., tuple[torch.Tensor, ...]]
    sparse_adam_step: Callable[..., None]
    masked_adam_step: Callable[..., None]
    sampled_tv: Callable[..., torch.Tensor]
    backends: dict[str, str] = field(default_factory=dict)


def build_ops(ops_cfg: Mapping[str, str | None]) -> OpSet:
    """OpSet from ``{"grid_interpolate": b, "upsample_bilinear2d": b, "gelu": b}``, each b "custom" or "torch".

    Raises ValueError naming the key for a missing key, an unknown key or an unknown backend.
    """
    if not isinstance(ops_cfg, Mapping):
        raise ValueError(f"ops: expected a mapping with keys {', '.join(OP_NAMES)}, got {type(ops_cfg).__name__}")
    unknown = sorted(set(ops_cfg) - set(OP_NAMES))
    if unknown:
        raise ValueError(f"ops.{unknown[0]}: unknown op (expected one of {', '.join(OP_NAMES)})")
    wanted = {name: ops_cfg.get(name) for name in OP_NAMES}
    import cuda_ext  # deferred: the compiled extension loads only when a custom op is called

    chosen: dict[str, Callable] = {}
    for name, backend in wanted.items():
        if backend is None:
            raise ValueError(f"ops.{name}: missing (expected 'custom' or 'torch')")
        if backend not in BACKENDS:
            raise ValueError(f"ops.{name}: unknown backend {backend!r} (expected 'custom' or 'torch')")
        module = cuda_ext if backend == "custom" else cuda_ext.reference
        try:
            chosen[name] = getattr(module, name)
            for member in FAMILIES.get(name, ()):  # ops that share the key's backend (gelu: gelu_rows)
                chosen[member] = getattr(module, member)
        except ImportError as error:  # the custom op without a compiled extension
            raise ValueError(f"ops.{name}: {error}") from None
    return OpSet(**chosen, backends={name: str(backend) for name, backend in wanted.items()})
