"""Per-ray scans of packed samples: the typed wrappers of ``torch.ops.cuda_ext.volume_render`` (compositing),
``torch.ops.cuda_ext.distortion_loss`` (mip-NeRF 360's regulariser on the same weights) and
``torch.ops.cuda_ext.visible_samples`` (which samples a ray still sees: the no-grad pass before compositing), their
fake (meta) kernels, and the first two's autograd through the hand-written backward kernels (csrc/render.h,
csrc/distortion.h and csrc/visibility.h have the formulas; the kernels are csrc/cpu/{render,distortion,visibility}.cpp
and csrc/cuda/{render,distortion,visibility}.cu).
"""

from __future__ import annotations

from typing import Any

import torch

from cuda_ext import _step_checks

__all__ = ["volume_render", "distortion_loss", "visible_samples", "visible_samples_capped"]


def volume_render(
    optical_depth: torch.Tensor,
    values: torch.Tensor,
    t: torch.Tensor,
    ray_offsets: torch.Tensor,
    early_stop: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alpha-composite packed samples along their rays.

    Args:
        optical_depth: (N,) s_i = sigma_i * delta_i >= 0 of each sample, float32 or float64.
        values: (N, C) what each sample contributes (colour, features), same dtype and device.
        t: (N,) each sample's distance along its ray (for the depth).
        ray_offsets: (B + 1,) int64, non-decreasing, 0 first and at most N last: ray b owns samples
            [ray_offsets[b], ray_offsets[b + 1]), in order along the ray; rows past the last offset are padding
            (march_rays_capped's), with no weight and zero gradient. Checked on the CPU (ValueError); on CUDA that
            would cost a device sync per call, so the kernels clamp each ray's range to [0, N] instead.
        early_stop: samples whose transmittance T_i = exp(-sum_{j<i} s_j) is below this contribute nothing
            (early ray termination; 0 = off).
    Returns:
        (values (B, C), opacity (B,), depth (B,)) = sum_i w_i (v_i, 1, t_i) with w_i = T_i (1 - exp(-s_i)).
        Differentiable in optical_depth and values (twice is not supported); t and ray_offsets are not.
    """
    early_stop = _step_checks.check_render_inputs(optical_depth, values, t, ray_offsets, early_stop)
    _step_checks.check_render_offsets(optical_depth, ray_offsets)
    return torch.ops.cuda_ext.volume_render(optical_depth, values, t, ray_offsets, early_stop)


@torch.library.register_fake("cuda_ext::volume_render")
def _volume_render_fake(optical_depth, values, t, ray_offsets, early_stop):
    _step_checks.check_render_inputs(optical_depth, values, t, ray_offsets, early_stop)
    rays = ray_offsets.shape[0] - 1
    return values.new_empty((rays, values.shape[1])), values.new_empty((rays,)), values.new_empty((rays,))


@torch.library.register_fake("cuda_ext::volume_render_backward")
def _volume_render_backward_fake(
    grad_values, grad_opacity, grad_depth, optical_depth, values, t, ray_offsets, out, opacity, depth, early_stop
):
    _step_checks.check_render_inputs(optical_depth, values, t, ray_offsets, early_stop, op="volume_render_backward")
    _step_checks.check_render_grads(grad_values, grad_opacity, grad_depth, values, ray_offsets.shape[0] - 1)
    return torch.empty_like(optical_depth), torch.empty_like(values)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    optical_depth, values, t, ray_offsets, early_stop = inputs
    out, opacity, depth = output
    ctx.save_for_backward(optical_depth, values, t, ray_offsets, out, opacity, depth)
    ctx.early_stop = early_stop


def _backward(ctx: Any, grad_values: torch.Tensor, grad_opacity: torch.Tensor, grad_depth: torch.Tensor) -> tuple:
    if torch.is_grad_enabled():
        raise RuntimeError("volume_render: double backward is not supported (create_graph=True)")
    optical_depth, values, t, ray_offsets, out, opacity, depth = ctx.saved_tensors
    grads = [
        g if g is not None else torch.zeros_like(ref)
        for g, ref in ((grad_values, out), (grad_opacity, opacity), (grad_depth, depth))
    ]
    grad_sd, grad_v = torch.ops.cuda_ext.volume_render_backward(
        *grads, optical_depth, values, t, ray_offsets, out, opacity, depth, ctx.early_stop
    )
    return (grad_sd if ctx.needs_input_grad[0] else None, grad_v if ctx.needs_input_grad[1] else None, None, None, None)


torch.library.register_autograd("cuda_ext::volume_render", _backward, setup_context=_setup_context)


def distortion_loss(
    optical_depth: torch.Tensor, t_start: torch.Tensor, t_end: torch.Tensor, ray_offsets: torch.Tensor
) -> torch.Tensor:
    """mip-NeRF 360's distortion loss of each ray, on the weights :func:`volume_render` composites.

    Args:
        optical_depth: (N,) s_i >= 0 of each sample, float32 or float64; w_i = T_i (1 - exp(-s_i)).
        t_start, t_end: (N,) the ends of each sample's interval along its ray (same dtype and device): a ray's
            intervals in order and not overlapping.
        ray_offsets: (B + 1,) int64, as for :func:`volume_render` (checked on the CPU; clamped on CUDA).
    Returns:
        (B,) ``sum_ij w_i w_j |m_i - m_j| + 1/3 sum_i w_i^2 (t_end_i - t_start_i)`` with m_i the intervals'
        midpoints; 0 for a ray without samples. Differentiable in optical_depth (once); t_start and t_end are data:
        a ValueError if either requires grad.
    """
    _step_checks.check_distortion_inputs(optical_depth, t_start, t_end, ray_offsets)
    return torch.ops.cuda_ext.distortion_loss(optical_depth, t_start, t_end, ray_offsets)


@torch.library.register_fake("cuda_ext::distortion_loss")
def _distortion_loss_fake(optical_depth, t_start, t_end, ray_offsets):
    _step_checks.check_packed_samples("distortion_loss", optical_depth, ray_offsets, t_start=t_start, t_end=t_end)
    return optical_depth.new_empty((ray_offsets.shape[0] - 1,))


@torch.library.register_fake("cuda_ext::distortion_loss_backward")
def _distortion_loss_backward_fake(grad, optical_depth, t_start, t_end, ray_offsets):
    op = "distortion_loss_backward"
    _step_checks.check_packed_samples(op, optical_depth, ray_offsets, t_start=t_start, t_end=t_end)
    _step_checks.check_tensor(op, "grad", grad)
    return torch.empty_like(optical_depth)


def _distortion_setup_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _distortion_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    if torch.is_grad_enabled():
        raise RuntimeError("distortion_loss: double backward is not supported (create_graph=True)")
    grad_sd = torch.ops.cuda_ext.distortion_loss_backward(grad.contiguous(), *ctx.saved_tensors)
    return grad_sd if ctx.needs_input_grad[0] else None, None, None, None


torch.library.register_autograd(
    "cuda_ext::distortion_loss", _distortion_backward, setup_context=_distortion_setup_context
)


def visible_samples(
    optical_depth: torch.Tensor,
    ray_offsets: torch.Tensor,
    early_termination: float = 0.0,
    weight_threshold: float = 0.0,
    start_depth: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed samples a ray still sees, and those worth a colour: early ray termination and the weight threshold
    in one pass (the training march's no-grad pass; the survivors keep their transmittance and weight).

    With S_i the ray's start depth plus the sum of ``min(s_j, OPAQUE_DEPTH)`` over the samples j before i on its
    ray (in float64, rounded to the input's dtype), sample i is alive when ``S_i < -log(early_termination)``
    (always when it is 0) and shown when it is alive and ``exp(-S_i) * (1 - exp(-s_i)) > weight_threshold``. A
    ray's alive samples are a prefix of it.

    Args:
        optical_depth: (N,) s_i >= 0 of each sample, float32 or float64.
        ray_offsets: (B + 1,) int64, as for :func:`volume_render` (checked on the CPU; clamped on CUDA).
        early_termination, weight_threshold: numbers in [0, 1).
        start_depth: optional (B,) >= 0 of optical_depth's dtype: the optical depth in front of each ray's first
            sample (what a part of the ray rendered elsewhere leaves: the space split's back slab), else 0.
    Returns:
        index (A,) int64: the alive samples, increasing; keep (K,) int64: the positions in ``index`` of the shown
        samples, increasing; offsets (B + 1,) int64: ray b's alive samples are ``index[offsets[b]:offsets[b + 1]]``.
        Not differentiable (indices). One device sync on CUDA (the outputs' sizes). Sums in another order than the
        reference's: a sample within float rounding of a threshold may be decided the other way.
    """
    early_termination, weight_threshold = _step_checks.check_visibility_inputs(
        optical_depth, ray_offsets, early_termination, weight_threshold, start_depth=start_depth
    )
    _step_checks.check_render_offsets(optical_depth, ray_offsets, "visible_samples")
    return torch.ops.cuda_ext.visible_samples(
        optical_depth, ray_offsets, early_termination, weight_threshold, start_depth
    )


@torch.library.register_fake("cuda_ext::visible_samples")
def _visible_samples_fake(optical_depth, ray_offsets, early_termination, weight_threshold, start_depth=None):
    _step_checks.check_visibility_inputs(
        optical_depth, ray_offsets, early_termination, weight_threshold, start_depth=start_depth
    )
    ctx = torch.library.get_ctx()  # data-dependent: how many samples stay alive, how many are shown
    alive, shown = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return ray_offsets.new_empty((alive,)), ray_offsets.new_empty((shown,)), torch.empty_like(ray_offsets)


def visible_samples_capped(
    optical_depth: torch.Tensor,
    ray_offsets: torch.Tensor,
    early_termination: float,
    weight_threshold: float,
    alive_capacity: int,
    shown_capacity: int,
    start_depth: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`visible_samples`' outputs in fixed sizes, with no device sync: what a CUDA graph can replay.

    ``index`` holds the first ``alive_capacity`` alive samples and ``offsets`` are clamped to it (a ray that crosses
    it is cut short, the rays after it get none); ``keep`` holds the first ``shown_capacity`` shown positions below
    ``alive_capacity`` (a prefix of visible_samples' keep). Padding: ``index`` N - 1 (0 without samples: a valid
    row, the index stays sorted); ``keep`` ``alive_capacity``, the row past ``index``: a caller that scatters
    colours back by position gives its values one spare row there, so that padding never lands on a real sample.

    Args:
        as :func:`visible_samples`; alive_capacity, shown_capacity: the outputs' sizes, ints >= 0.
    Returns:
        index (Ca,) int64, keep (Cs,) int64, offsets (B + 1,) int64 clamped to Ca, and totals (2,) int64: the A and K
        that visible_samples would return (above the capacities: an overflow, the caller's to act on when it next
        syncs).
    """
    op = "visible_samples_capped"
    alive_capacity = _step_checks.check_capacity(alive_capacity, op, "alive_capacity")
    shown_capacity = _step_checks.check_capacity(shown_capacity, op, "shown_capacity")
    early_termination, weight_threshold = _step_checks.check_visibility_inputs(
        optical_depth, ray_offsets, early_termination, weight_threshold, op=op, start_depth=start_depth
    )
    _step_checks.check_render_offsets(optical_depth, ray_offsets, op)
    return torch.ops.cuda_ext.visible_samples_capped(
        optical_depth, ray_offsets, early_termination, weight_threshold, alive_capacity, shown_capacity, start_depth
    )


@torch.library.register_fake("cuda_ext::visible_samples_capped")
def _visible_samples_capped_fake(
    optical_depth, ray_offsets, early_termination, weight_threshold, alive_capacity, shown_capacity, start_depth=None
):
    op = "visible_samples_capped"
    _step_checks.check_visibility_inputs(
        optical_depth, ray_offsets, early_termination, weight_threshold, op=op, start_depth=start_depth
    )
    return (
        ray_offsets.new_empty((_step_checks.check_capacity(alive_capacity, op, "alive_capacity"),)),
        ray_offsets.new_empty((_step_checks.check_capacity(shown_capacity, op, "shown_capacity"),)),
        torch.empty_like(ray_offsets),
        ray_offsets.new_empty((2,)),
    )
