"""Pure-PyTorch references of the per-ray ops (cuda_ext.march_rays, volume_render, distortion_loss,
visible_samples) and the scene contraction they share; :mod:`cuda_ext.reference` exports them with the others
(import them from there)."""

from __future__ import annotations

import math

import torch

from cuda_ext import _step_checks

__all__ = ["OPAQUE_DEPTH", "march_rays", "contract_points", "volume_render", "distortion_loss", "visible_samples"]

# An optical depth past which light is gone (exp(-100) < 4e-44: what follows has T = 0 to any tolerance). Global
# prefix sums clamp to it: a contracted march's last sample can have s ~ 1e11 (its step grows with the distance
# squared), and 1e11 per ray over a million rays is past float64's 2^53, where a global sum's per-ray differences
# are noise.
OPAQUE_DEPTH = 100.0


def march_rays(
    origins: torch.Tensor,
    directions: torch.Tensor,
    t_start: torch.Tensor,
    t_end: torch.Tensor,
    offset: torch.Tensor,
    occupancy: torch.Tensor,
    box: torch.Tensor,
    step: float,
    max_samples: int,
    t_split: torch.Tensor | None = None,
    slab: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed samples along rays where the occupancy grid is set (cuda_ext.march_rays' contract, bounded or
    contracted, within the first-axis cells of ``slab`` when given), with torch ops: the dense (B, S) distances,
    (B, S, 3) grid coordinates and keep-mask, compacted with nonzero() (one sync). Each formula is evaluated in the
    kernels' order, one rounding per operation."""
    step, max_samples = _step_checks.check_march_inputs(
        origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split
    )
    slab = _step_checks.check_march_slab(slab, occupancy)
    k = torch.arange(max_samples, device=origins.device, dtype=origins.dtype)
    t = t_start[:, None] + (k[None, :] + offset[:, None]) * step
    alive = t < t_end[:, None]
    if t_split is not None:
        t, alive = _disparity_samples(t, alive, t_start, t_end, offset, box, step, t_split)
    alive = torch.cummin(alive.to(torch.uint8), 1).values.bool()  # a ray ends at its first sample past its end
    world = origins[:, None, :] + t[..., None] * directions[:, None, :]
    unit = (world - box[0]) * (2.0 / (box[1] - box[0])) - 1.0
    if t_split is not None:
        unit = contract_points(unit)
    s0, s1, s2 = occupancy.shape
    c0, c1, c2 = (((unit[..., a] + 1) * (0.5 * s)).long().clamp(0, s - 1) for a, s in enumerate((s0, s1, s2)))
    kept = alive & occupancy.reshape(-1)[(c0 * s1 + c1) * s2 + c2]
    if slab is not None:
        kept &= (c0 >= slab[0]) & (c0 < slab[1])
    flat = kept.reshape(-1).nonzero().squeeze(1)
    ray = torch.div(flat, max_samples, rounding_mode="floor")
    ray_offsets = torch.searchsorted(ray, torch.arange(origins.shape[0] + 1, device=ray.device))
    return ray, t.reshape(-1)[flat], unit.reshape(-1, 3)[flat], ray_offsets


def march_rays_capped(
    origins: torch.Tensor,
    directions: torch.Tensor,
    t_start: torch.Tensor,
    t_end: torch.Tensor,
    offset: torch.Tensor,
    occupancy: torch.Tensor,
    box: torch.Tensor,
    step: float,
    max_samples: int,
    capacity: int,
    t_split: torch.Tensor | None = None,
    slab: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """march_rays' samples in outputs of ``capacity`` rows (cuda_ext.march_rays_capped's contract): its first
    ``capacity`` samples, the ray offsets clamped to ``capacity``, the other rows padding (ray max(B - 1, 0), t 0,
    point 0), and the (1,) int64 true total."""
    size = _step_checks.check_capacity(capacity)
    args = (origins, directions, t_start, t_end, offset, occupancy, box, step, max_samples, t_split)
    _step_checks.check_march_inputs(*args, op="march_rays_capped")
    slab = _step_checks.check_march_slab(slab, occupancy, op="march_rays_capped")
    ray, t, points, ray_offsets = march_rays(*args, slab)
    kept = min(size, ray.shape[0])
    padding = size - kept
    last_ray = max(origins.shape[0] - 1, 0)
    return (
        torch.cat([ray[:kept], ray.new_full((padding,), last_ray)]),
        torch.cat([t[:kept], t.new_zeros(padding)]),
        torch.cat([points[:kept], points.new_zeros(padding, 3)]),
        ray_offsets.clamp(max=size),
        ray_offsets[-1:].clone(),
    )


def _disparity_samples(t, alive, t_start, t_end, offset, box, step, t_split):
    """(B, S) linear distances and their t < t_end -> those of the contracted march: samples past each ray's linear
    count K uniform in disparity about t_split - P (march_rays' docstring), alive while den > 0 and t < t_end."""
    k = torch.arange(t.shape[1], device=t.device)
    radius = ((box[1] - box[0]) * 0.5).min()
    step_t = torch.tensor(step, dtype=t.dtype, device=t.device)  # the kernels' T(step)
    count = torch.ceil((t_split - t_start) / step_t - offset)
    cap = float(t.shape[1])
    count = torch.where(count > 0, torch.where(count < cap, count, cap), 0.0).long()  # NaN -> 0, as the kernels
    linear = k[None, :] < count[:, None]
    j = (k[None, :] - count[:, None]).to(t.dtype)
    den = 1.0 - (j + offset[:, None]) * (step_t / radius)
    far = ((t_split - radius)[:, None] + radius / den).to(t.dtype)
    return torch.where(linear, t, far), torch.where(linear, alive, (den > 0) & (far < t_end[:, None]))


def contract_points(unit: torch.Tensor) -> torch.Tensor:
    """(..., 3) box coordinates -> grid coordinates of the L-inf scene contraction (march_rays' contracted points):
    u / 2 inside the box (m = max |u_a| <= 1), else u * ((2 - 1 / m) / m) / 2: the contracted cube [-2, 2]^3
    (infinity on its surface) halved to the grid's [-1, 1]^3. Any dtype; differentiable."""
    norm = unit.abs().amax(-1, keepdim=True)
    shrink = torch.where(norm > 1, (2.0 - 1.0 / norm) / norm, torch.ones_like(norm))
    return unit * shrink * 0.5


def volume_render(
    optical_depth: torch.Tensor,
    values: torch.Tensor,
    t: torch.Tensor,
    ray_offsets: torch.Tensor,
    early_stop: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alpha compositing of packed samples (cuda_ext.volume_render's contract), with torch ops: the weights of
    :func:`_packed_weights`, summed per ray."""
    early_stop = _step_checks.check_render_inputs(optical_depth, values, t, ray_offsets, early_stop)
    _step_checks.check_render_offsets(optical_depth, ray_offsets)
    ray, weights = _packed_weights(optical_depth, ray_offsets, early_stop)
    rays = ray_offsets.shape[0] - 1
    out = values.new_zeros(rays, values.shape[1]).index_add(0, ray, values * weights[:, None])
    geometry = values.new_zeros(rays, 2).index_add(0, ray, torch.stack([weights, weights * t], 1))
    return out, geometry[:, 0], geometry[:, 1]


def distortion_loss(
    optical_depth: torch.Tensor, t_start: torch.Tensor, t_end: torch.Tensor, ray_offsets: torch.Tensor
) -> torch.Tensor:
    """cuda_ext.distortion_loss with torch ops: the weights of :func:`_packed_weights`, then per ray
    ``sum_i [2 w_i (m_i W_i - M_i) + w_i^2 (t_end_i - t_start_i) / 3]`` with W_i, M_i the sums of w_j and w_j m_j
    over the ray's earlier samples (the pair sum written in one pass: the midpoints m increase along a ray)."""
    _step_checks.check_distortion_inputs(optical_depth, t_start, t_end, ray_offsets)
    ray, weights = _packed_weights(optical_depth, ray_offsets, 0.0)
    first = ray_offsets[ray].clamp(max=max(t_start.shape[0] - 1, 0))  # from the ray's first: no rounding far out
    mid = 0.5 * ((t_start - t_start[first]) + (t_end - t_end[first]))
    weight_before, moment_before = (_ray_exclusive(x, ray_offsets, ray) for x in (weights, weights * mid))
    terms = 2.0 * weights * (mid * weight_before - moment_before) + weights.square() * (t_end - t_start) / 3.0
    return terms.new_zeros(ray_offsets.shape[0] - 1).index_add(0, ray, terms)


def visible_samples(
    optical_depth: torch.Tensor,
    ray_offsets: torch.Tensor,
    early_termination: float = 0.0,
    weight_threshold: float = 0.0,
    start_depth: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """cuda_ext.visible_samples with torch ops: each sample's exclusive per-ray sum S_i of clamped optical depths
    (:func:`_ray_exclusive`, from the ray's ``start_depth`` when given), alive where S_i < -log(early_termination),
    shown where also exp(-S_i) (1 - exp(-s_i)) > weight_threshold; the alive samples and the shown ones' positions
    among them by nonzero(). A sample in no ray (offsets not covering [0, N): CUDA does not check them) is never
    alive."""
    early_termination, weight_threshold = _step_checks.check_visibility_inputs(
        optical_depth, ray_offsets, early_termination, weight_threshold, start_depth=start_depth
    )
    _step_checks.check_render_offsets(optical_depth, ray_offsets, "visible_samples")
    ray, inside = _sample_rays(optical_depth, ray_offsets)
    above = _ray_exclusive(optical_depth.clamp(max=OPAQUE_DEPTH), ray_offsets, ray, start_depth)
    alive = inside & (above < -math.log(early_termination)) if early_termination > 0 else inside
    shown = alive & (torch.exp(-above) * -torch.expm1(-optical_depth) > weight_threshold)
    index = alive.nonzero()[:, 0]
    per_ray = torch.bincount(ray[index], minlength=ray_offsets.shape[0] - 1)
    return index, shown[index].nonzero()[:, 0], torch.nn.functional.pad(per_ray.cumsum(0), (1, 0))


def visible_samples_capped(
    optical_depth: torch.Tensor,
    ray_offsets: torch.Tensor,
    early_termination: float,
    weight_threshold: float,
    alive_capacity: int,
    shown_capacity: int,
    start_depth: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """visible_samples' outputs in fixed sizes (cuda_ext.visible_samples_capped's contract): the first
    ``alive_capacity`` alive samples (padding: N - 1, or 0 without samples), the offsets clamped to it, the first
    ``shown_capacity`` shown positions below it (padding: ``alive_capacity``), and the (2,) int64 totals."""
    alive_size = _step_checks.check_capacity(alive_capacity, "visible_samples_capped", "alive_capacity")
    shown_size = _step_checks.check_capacity(shown_capacity, "visible_samples_capped", "shown_capacity")
    index, keep, offsets = visible_samples(optical_depth, ray_offsets, early_termination, weight_threshold, start_depth)
    alive = index[:alive_size]
    shown = keep[keep < alive_size][:shown_size]
    return (
        torch.cat([alive, index.new_full((alive_size - alive.shape[0],), max(optical_depth.shape[0] - 1, 0))]),
        torch.cat([shown, keep.new_full((shown_size - shown.shape[0],), alive_size)]),
        offsets.clamp(max=alive_size),
        torch.stack([offsets.new_tensor(index.shape[0]), offsets.new_tensor(keep.shape[0])]),
    )


def _sample_rays(optical_depth: torch.Tensor, ray_offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) ray of each packed sample, clamped to [0, B), and (N,) bool: the sample is in a ray at all."""
    n, rays = optical_depth.shape[0], ray_offsets.shape[0] - 1
    ray = torch.searchsorted(ray_offsets, torch.arange(n, device=optical_depth.device), right=True) - 1
    return ray.clamp(0, max(rays - 1, 0)), (ray >= 0) & (ray < rays)


def _packed_weights(
    optical_depth: torch.Tensor, ray_offsets: torch.Tensor, early_stop: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) ray of each sample (clamped to [0, B)) and (N,) compositing weights w_i = T_i (1 - exp(-s_i)), with
    T_i = exp(-sum of the ray's s_j before i) (each s_j clamped to :data:`OPAQUE_DEPTH`, where T is 0 already); zero
    where T_i < early_stop or the sample is in no ray."""
    ray, inside = _sample_rays(optical_depth, ray_offsets)
    s = torch.where(inside, optical_depth, torch.zeros_like(optical_depth))
    transmittance = torch.exp(-_ray_exclusive(s.clamp(max=OPAQUE_DEPTH), ray_offsets, ray))
    keep = inside & (transmittance >= early_stop) if early_stop > 0 else inside
    return ray, torch.where(keep, transmittance * -torch.expm1(-s), torch.zeros_like(s))


def _ray_exclusive(
    values: torch.Tensor, ray_offsets: torch.Tensor, ray: torch.Tensor, start: torch.Tensor | None = None
) -> torch.Tensor:
    """(N,) per-ray exclusive prefix sums of (N,) values, from each ray's (B,) ``start`` when given: one global
    cumulative sum in float64 (per-ray differences stay accurate) minus its value at the ray's first sample; in
    ``values``' dtype. One-dimensional: CUDA's cumsum down the rows of an (N, 2) tensor runs a scan per column,
    ~1000x slower (6.5 s at 47 M rows)."""
    if values.shape[0] == 0:
        return values
    wide = values.double()
    exclusive = torch.cumsum(wide, 0) - wide
    first = ray_offsets[ray].clamp(0, values.shape[0] - 1)
    within = exclusive - exclusive[first]
    return (within if start is None else start.double()[ray] + within).to(values.dtype)
