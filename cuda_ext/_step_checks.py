"""Argument checks of the per-ray training-step ops (march_rays, volume_render, distortion_loss, visible_samples and
their capped forms), shared by their wrappers, fake kernels and references (the Adam steps' are in
:mod:`cuda_ext._adam_checks`); same rules and messages as :mod:`cuda_ext._checks` (metadata only, except where a
docstring says otherwise)."""

from __future__ import annotations

from typing import Any

import torch

from cuda_ext._checks import (
    _FULL_DTYPES,
    _shape,
    check_device,
    check_int,
    check_same_device_and_dtype,
    check_tensor,
    require,
)

__all__ = [
    "check_render_inputs",
    "check_render_offsets",
    "check_render_grads",
    "check_packed_samples",
    "check_distortion_inputs",
    "check_visibility_inputs",
    "check_march_inputs",
    "check_capacity",
]


# ------------------------------------------------------------------------------------------ volume_render


def check_render_inputs(
    optical_depth: Any, values: Any, t: Any, ray_offsets: Any, early_stop: Any, op: str = "volume_render"
) -> float:
    """Packed samples: optical_depth (N,) float32/float64, values (N, C), t (N,) of its dtype and device,
    ray_offsets (B + 1,) int64 on its device, early_stop a number in [0, 1). Returns early_stop as a float."""
    check_packed_samples(op, optical_depth, ray_offsets, values=values, t=t)
    if isinstance(early_stop, bool) or not isinstance(early_stop, (int, float)):
        raise TypeError(f"{op}: early_stop must be a number, got {early_stop!r} of type {type(early_stop).__name__}")
    if not 0.0 <= early_stop < 1.0:
        raise ValueError(f"{op}: early_stop must be in [0, 1), got {early_stop}")
    return float(early_stop)


def check_packed_samples(op: str, optical_depth: Any, ray_offsets: Any, values: Any = None, **per_sample: Any) -> None:
    """optical_depth (N,) float32/float64; ``values`` (N, C) when given and each of ``per_sample`` (N,), of its dtype
    and device; ray_offsets (B + 1,) int64 on its device (volume_render's and distortion_loss's packed samples)."""
    rows = [("values", values, 2)] if values is not None else []  # (name, tensor, dims) of the per-sample inputs
    rows += [(name, value, 1) for name, value in per_sample.items()]
    for name, value in (("optical_depth", optical_depth), *(row[:2] for row in rows), ("ray_offsets", ray_offsets)):
        check_tensor(op, name, value)
    check_device(op, "optical_depth", optical_depth)
    require(
        optical_depth.dtype in _FULL_DTYPES,
        TypeError,
        lambda: f"{op}: optical_depth must be float32 or float64, got {optical_depth.dtype}",
    )
    require(
        optical_depth.dim() == 1,
        ValueError,
        lambda: f"{op}: optical_depth must have shape (N,), got {_shape(optical_depth)}",
    )
    n = optical_depth.shape[0]
    for name, value, dims in rows:
        require(
            value.dim() == dims and value.shape[0] == n,
            ValueError,
            lambda name=name, value=value, dims=dims: (
                f"{op}: {name} must have shape {'(N, C)' if dims == 2 else '(N,)'} with N = {n}, got {_shape(value)}"
            ),
        )
    for name, value, _ in rows:
        check_same_device_and_dtype(op, name, value, "optical_depth", optical_depth)
    require(
        ray_offsets.dim() == 1 and ray_offsets.shape[0] >= 1,
        ValueError,
        lambda: f"{op}: ray_offsets must have shape (B + 1,), got {_shape(ray_offsets)}",
    )
    require(
        ray_offsets.dtype == torch.int64, TypeError, lambda: f"{op}: ray_offsets must be int64, got {ray_offsets.dtype}"
    )
    require(
        ray_offsets.device == optical_depth.device,
        ValueError,
        lambda: (
            f"{op}: ray_offsets and optical_depth must be on the same device, got {ray_offsets.device} and "
            f"{optical_depth.device}"
        ),
    )


def check_distortion_inputs(
    optical_depth: Any, t_start: Any, t_end: Any, ray_offsets: Any, op: str = "distortion_loss"
) -> None:
    """distortion_loss's packed samples: optical_depth, t_start, t_end (N,), ray_offsets (B + 1,) int64; the
    offsets' values where that costs no device sync (:func:`check_render_offsets`); t_start and t_end are data (a
    ValueError if either requires grad: the op gives them no gradient)."""
    check_packed_samples(op, optical_depth, ray_offsets, t_start=t_start, t_end=t_end)
    check_render_offsets(optical_depth, ray_offsets, op)
    if t_start.requires_grad or t_end.requires_grad:
        raise ValueError(f"{op}: t_start and t_end are not differentiated; pass them detached")


def check_visibility_inputs(
    optical_depth: Any,
    ray_offsets: Any,
    early_termination: Any,
    weight_threshold: Any,
    op: str = "visible_samples",
    start_depth: Any = None,
) -> tuple[float, float]:
    """visible_samples' packed samples (optical_depth (N,), ray_offsets (B + 1,) int64), its two thresholds, numbers
    in [0, 1), and the optional (B,) start_depth of optical_depth's dtype and device; returns the thresholds as
    floats."""
    check_packed_samples(op, optical_depth, ray_offsets)
    _check_numbers(
        op, (("early_termination", early_termination, 0.0, 1.0), ("weight_threshold", weight_threshold, 0.0, 1.0))
    )
    if start_depth is not None:
        check_tensor(op, "start_depth", start_depth)
        rays = ray_offsets.shape[0] - 1
        require(
            start_depth.shape == (rays,),
            ValueError,
            lambda: f"{op}: start_depth must have shape (B,) = ({rays},), got {_shape(start_depth)}",
        )
        check_same_device_and_dtype(op, "start_depth", start_depth, "optical_depth", optical_depth)
    return float(early_termination), float(weight_threshold)


def check_render_offsets(optical_depth: torch.Tensor, ray_offsets: torch.Tensor, op: str = "volume_render") -> None:
    """ray_offsets' values (0 first, non-decreasing, at most N last: the rows past the last offset are padding, as
    march_rays_capped leaves them, with no weight and zero gradient), read only where that costs no device sync: CPU
    tensors outside tracing. On CUDA the kernels clamp every ray's range to [0, N] instead."""
    if ray_offsets.device.type != "cpu" or torch.compiler.is_compiling():
        return
    n, first, last = optical_depth.shape[0], int(ray_offsets[0]), int(ray_offsets[-1])
    if first != 0:
        raise ValueError(f"{op}: ray_offsets must start at 0, got {first}")
    if last > n:
        raise ValueError(
            f"{op}: ray_offsets must end at most at N = {n} (the number of samples; rows past the end are padding), "
            f"got {last}"
        )
    if ray_offsets.shape[0] > 1 and not bool((ray_offsets[1:] >= ray_offsets[:-1]).all()):
        raise ValueError(f"{op}: ray_offsets must be non-decreasing")


def check_render_grads(
    grad_values: Any,
    grad_opacity: Any,
    grad_depth: Any,
    values: torch.Tensor,
    rays: Any,
    op: str = "volume_render_backward",
) -> None:
    for name, value in (("grad_values", grad_values), ("grad_opacity", grad_opacity), ("grad_depth", grad_depth)):
        check_tensor(op, name, value)
        check_same_device_and_dtype(op, name, value, "values", values)
    require(
        grad_values.dim() == 2 and grad_values.shape[0] == rays and grad_values.shape[1] == values.shape[1],
        ValueError,
        lambda: f"{op}: grad_values must have shape (B, C) = ({rays}, {values.shape[1]}), got {_shape(grad_values)}",
    )
    for name, value in (("grad_opacity", grad_opacity), ("grad_depth", grad_depth)):
        require(
            value.dim() == 1 and value.shape[0] == rays,
            ValueError,
            lambda name=name, value=value: f"{op}: {name} must have shape ({rays},), got {_shape(value)}",
        )


def _check_numbers(op: str, entries) -> None:
    """(name, value, low, high): a number in [low, high)."""
    for name, value, low, high in entries:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{op}: {name} must be a number, got {value!r}")
        if not low <= value < high:
            raise ValueError(f"{op}: {name} must be in [{low:g}, {high:g}), got {value}")


# ------------------------------------------------------------------------------------------ march_rays

MAX_MARCH_SAMPLES = 1 << 24  # sample indices stay exact in float32


def check_march_inputs(
    origins: Any,
    directions: Any,
    t_start: Any,
    t_end: Any,
    offset: Any,
    occupancy: Any,
    box: Any,
    step: Any,
    max_samples: Any,
    t_split: Any = None,
    op: str = "march_rays",
) -> tuple[float, int]:
    """Rays: origins, directions (B, 3) float32/float64; t_start, t_end, offset (B,), t_split (B,) when not None, and
    box (2, 3) of their dtype and device; occupancy (R0, R1, R2) bool on their device; step a finite number > 0;
    max_samples an int in [1, 2^24]. Returns (step, max_samples) as a float and an int."""
    if t_split is not None:
        check_tensor(op, "t_split", t_split)
    for name, value in (
        ("origins", origins),
        ("directions", directions),
        ("t_start", t_start),
        ("t_end", t_end),
        ("offset", offset),
        ("occupancy", occupancy),
        ("box", box),
    ):
        check_tensor(op, name, value)
    check_device(op, "origins", origins)
    require(
        origins.dtype in _FULL_DTYPES,
        TypeError,
        lambda: f"{op}: origins must be float32 or float64, got {origins.dtype}",
    )
    require(
        origins.dim() == 2 and origins.shape[-1] == 3,
        ValueError,
        lambda: f"{op}: origins must have shape (B, 3), got {_shape(origins)}",
    )
    rays = origins.shape[0]
    require(
        directions.shape == origins.shape,
        ValueError,
        lambda: f"{op}: directions must have shape ({rays}, 3), got {_shape(directions)}",
    )
    check_same_device_and_dtype(op, "directions", directions, "origins", origins)
    per_ray = (("t_start", t_start), ("t_end", t_end), ("offset", offset), ("t_split", t_split))
    for name, value in (item for item in per_ray if item[1] is not None):
        require(
            value.dim() == 1 and value.shape[0] == rays,
            ValueError,
            lambda name=name, value=value: f"{op}: {name} must have shape ({rays},), got {_shape(value)}",
        )
        check_same_device_and_dtype(op, name, value, "origins", origins)
    require(box.shape == (2, 3), ValueError, lambda: f"{op}: box must have shape (2, 3), got {_shape(box)}")
    check_same_device_and_dtype(op, "box", box, "origins", origins)
    require(
        occupancy.dim() == 3 and occupancy.numel() > 0,
        ValueError,
        lambda: f"{op}: occupancy must have shape (R0, R1, R2) with every R >= 1, got {_shape(occupancy)}",
    )
    require(occupancy.dtype == torch.bool, TypeError, lambda: f"{op}: occupancy must be bool, got {occupancy.dtype}")
    require(
        occupancy.device == origins.device,
        ValueError,
        lambda: f"{op}: occupancy and origins must be on the same device, got {occupancy.device} and {origins.device}",
    )
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        raise TypeError(f"{op}: step must be a number, got {step!r} of type {type(step).__name__}")
    if not 0.0 < step < float("inf"):
        raise ValueError(f"{op}: step must be a finite number > 0, got {step}")
    samples = check_int(op, "max_samples", max_samples)
    if not 1 <= samples <= MAX_MARCH_SAMPLES:
        raise ValueError(f"{op}: max_samples must be in [1, 2^24], got {samples}")
    return float(step), samples


def check_march_slab(slab: Any, occupancy: torch.Tensor, op: str = "march_rays") -> list[int] | None:
    """A march's slab: None, or [first, end) cells of the occupancy's first axis as two ints with
    0 <= first < end <= R0. Returns it as a list of two ints (what the op's ``int[]?`` takes), or None."""
    if slab is None:
        return None
    if isinstance(slab, (str, bytes, torch.Tensor)) or not hasattr(slab, "__len__") or len(slab) != 2:
        raise TypeError(f"{op}: slab must be None or two ints [first, end), got {slab!r}")
    first, end = (check_int(op, "slab", value) for value in slab)
    cells = occupancy.shape[0]
    if not 0 <= first < end <= cells:
        raise ValueError(f"{op}: slab must be cells [first, end) with 0 <= first < end <= {cells}, got {[first, end]}")
    return [first, end]


def check_capacity(capacity: Any, op: str = "march_rays_capped", name: str = "capacity") -> int:
    """A capped op's output size (march_rays_capped, visible_samples_capped): an int >= 0. Returns it as an int."""
    size = check_int(op, name, capacity)
    if size < 0:
        raise ValueError(f"{op}: {name} must be >= 0, got {size}")
    return size
