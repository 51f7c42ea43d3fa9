"""Per-ray regularisers on packed samples (models/render.py's layout: N samples grouped by ray, in order along it).

Both fight floaters, the semi-transparent blobs a radiance field puts in front of the cameras when few views
constrain a region:

- the distortion loss of mip-NeRF 360 (as nerfacto and DirectVoxGO v2 use it): per ray
  ``sum_ij w_i w_j |m_i - m_j| + 1/3 sum_i w_i^2 (t1_i - t0_i)`` with m_i the midpoint of sample i's interval
  [t0_i, t1_i]: small when a ray's weight sits in one short stretch (a surface), large when it is spread out
  (haze, or a floater in front of the surface). The op ``distortion_loss`` (cuda_ext, or its reference with
  ``ops.volume_render=torch``) computes it from the optical depths in one pass per ray;
- the near-density penalty: the optical depth ``-ln T`` a ray accumulates before a given distance from its
  camera (a soft near plane: unlike raising ``data.near``, density stays possible there when the photometric loss
  of other views wants it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.render import compositing_weights, ray_offsets, rows_in_rays, segment_sum


def _check_packed(name: str, ray: torch.Tensor, num_rays: int, **per_sample: torch.Tensor) -> None:
    """ValueError naming ``name`` unless ``ray`` is (N,) int64 and every other tensor is (N,)."""
    if ray.dim() != 1 or ray.dtype != torch.int64:
        raise ValueError(f"{name}: ray must be a (N,) int64 tensor, got {tuple(ray.shape)} {ray.dtype}")
    if num_rays < 0:
        raise ValueError(f"{name}: num_rays must be >= 0, got {num_rays}")
    for key, value in per_sample.items():
        if value.shape != ray.shape:
            raise ValueError(f"{name}: {key} must have the shape of ray {tuple(ray.shape)}, got {tuple(value.shape)}")


def near_optical_depth(
    ray: torch.Tensor, t: torch.Tensor, optical_depth: torch.Tensor, limit: torch.Tensor
) -> torch.Tensor:
    """(B,) optical depth each ray accumulates before distance ``limit`` (B,): ``sum_{i: t_i < limit} s_i``, i.e.
    ``-ln`` of its transmittance there. ``ray``, ``t`` (sample distances), ``optical_depth`` s_i: (N,) packed.
    Differentiable in ``optical_depth`` (linear: an opaque floater keeps its gradient, unlike an opacity penalty)."""
    _check_packed("near_optical_depth", ray, limit.shape[0], t=t, optical_depth=optical_depth)
    if limit.dim() != 1:
        raise ValueError(f"near_optical_depth: limit must be (B,), got {tuple(limit.shape)}")
    near = t < limit[ray]
    return segment_sum(torch.where(near, optical_depth, torch.zeros_like(optical_depth)), ray, limit.shape[0])


@dataclass
class RenderedSamples:
    """What a render's packed samples leave for the regularisers (VoxelNeRF.march's ``packed`` output):
    ray (N,) int64, t (N,) sample distances (unit directions), optical_depth (N,) s_i = sigma_i * delta_i with
    gradients, ``step``, the march's step, ``march``, a function giving each sample's (N,) march coordinate, in
    which every sample stands for [march_i - step/2, march_i + step/2] (bounded: t itself; contracted: linear then
    disparity, see models.contraction.SceneSpace.march_coordinate), called only when a regulariser needs it (None:
    t), and ``offsets`` (B + 1,) int64, each ray's first sample (None: found from ``ray``). ``padded``: rows past
    ``offsets[-1]`` are padding (model.capped_samples), which the per-sample sums leave out."""

    ray: torch.Tensor
    t: torch.Tensor
    optical_depth: torch.Tensor
    step: float
    march: Callable[[], torch.Tensor] | None = None
    offsets: torch.Tensor | None = None
    padded: bool = False

    def _in_rays(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (N,) with the padding rows zeroed (as is without padding)."""
        if not self.padded:
            return values
        return torch.where(rows_in_rays(values.shape[0], self.offsets), values, torch.zeros_like(values))

    def weights(self, num_rays: int) -> torch.Tensor:
        """(N,) compositing weights w_i = T_i alpha_i, differentiable in the optical depths."""
        return compositing_weights(self._in_rays(self.optical_depth), self.ray, num_rays)

    def distortion(self, op: Callable[..., torch.Tensor], num_rays: int, unit: float = 1.0) -> torch.Tensor:
        """(B,) distortion loss in the march coordinate (where the samples' intervals are all ``step`` long, as
        nerfacto measures it in its normalised spacing: the far background, whose world intervals grow with the
        distance squared, does not dominate), in units of ``unit`` (e.g. the scene box's diagonal), through ``op``
        (``distortion_loss`` of cuda_ext or cuda_ext.reference: the model's ``ops``)."""
        half, march = 0.5 * self.step, self.t if self.march is None else self.march()
        offsets = self.offsets if self.offsets is not None else ray_offsets(self.ray, num_rays)
        march = march.detach()  # data: the samples' places
        return op(self.optical_depth, (march - half) / unit, (march + half) / unit, offsets)

    def near_density(self, limit: torch.Tensor) -> torch.Tensor:
        """(B,) optical depth before ``limit`` (B,) along each ray (:func:`near_optical_depth`)."""
        return near_optical_depth(self.ray, self.t, self._in_rays(self.optical_depth), limit)


__all__ = ["near_optical_depth", "RenderedSamples"]
