"""The op benchmark's per-ray scan cases on packed samples of B rays (30-60 samples each):

- volume_render with C = 3 (per-sample colour) and C = 12 (deferred features), custom vs reference vs the model's
  former PyTorch compositing (models/render.py: compositing_weights + accumulate), which the op replaced; the three
  outputs are compared and differentiated as one (B, C + 2) tensor: [values | opacity | depth];
- distortion_loss, custom vs reference vs the training step's former PyTorch form (the weights, two per-ray
  exclusive prefix sums and a per-ray sum through models/render.py's segmented scans).
"""

from __future__ import annotations

from typing import Any

import torch
from bench_cases import DTYPE, Case, Ops, Sizes, Variant

CHANNELS = (3, 12)
SAMPLES_PER_RAY = (30, 60)  # each ray's count is uniform in this range (inclusive)

DISTORTION_RULE = "fw: s + t_start + t_end + offsets + the (B,) loss; bw: the same + grad + grad_s"
RULE = (
    "fw: s + t + values + offsets + the (B, C + 2) outputs; bw (grad=s+values): s + t + values + offsets + outputs "
    "+ their gradients + grad_s + grad_values (the backward recomputes the transmittance: no saved intermediates)"
)


def _joined(out: torch.Tensor, opacity: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    return torch.cat([out, opacity[:, None], depth[:, None]], 1)


def _former(rays: int):
    """The model's compositing before the fused op; takes each sample's ray index instead of ray offsets."""
    from models.render import accumulate, compositing_weights

    def call(sd: torch.Tensor, values: torch.Tensor, t: torch.Tensor, ray: torch.Tensor) -> torch.Tensor:
        weights = compositing_weights(sd, ray, rays)
        geometry = accumulate(torch.stack([torch.ones_like(t), t], 1), weights, ray, rays)
        return torch.cat([accumulate(values, weights, ray, rays), geometry], 1)

    return call


def _ray_index(x: tuple) -> tuple:
    sd, values, t, offsets = x
    counts = offsets.diff()
    return sd, values, t, torch.repeat_interleave(torch.arange(counts.shape[0], device=sd.device), counts)


def render_cases(s: Sizes, ops: Ops) -> list[Case]:
    cases = []
    for rays in s.volume_render:
        counts = torch.randint(SAMPLES_PER_RAY[0], SAMPLES_PER_RAY[1] + 1, (rays,), generator=torch.Generator())
        offsets_cpu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        n = int(offsets_cpu[-1])
        for c in CHANNELS:
            cases.append(_case(ops, rays, n, c, offsets_cpu))
    return cases


def _case(ops: Ops, rays: int, n: int, c: int, offsets_cpu: torch.Tensor) -> Case:
    e = DTYPE.itemsize

    def make(gen: torch.Generator) -> tuple:
        kw = dict(generator=gen, device=gen.device, dtype=DTYPE)
        sd = torch.rand(n, **kw) * 0.2
        values = torch.rand(n, c, **kw)
        t = torch.rand(n, **kw) * 4 + 2
        return sd, values, t, offsets_cpu.to(gen.device)

    custom, reference = ops.custom("volume_render"), ops.ref("volume_render")
    variants = {
        "custom": Variant(lambda *x: _joined(*custom(*x))),
        "reference": Variant(lambda *x: _joined(*reference(*x))),
        "former": Variant(_former(rays), adapt=_ray_index),
    }
    backward = ops.backward_op("volume_render")
    cache: dict[tuple[int, int], tuple] = {}  # the backward op's other arguments, made once per input set

    def custom_backward(g: torch.Tensor, x: tuple) -> Any:
        key = (id(g), id(x[0]))
        if key not in cache:
            with torch.no_grad():
                outputs = custom(*x)
            grads = (g[:, :c].contiguous(), g[:, c].contiguous(), g[:, c + 1].contiguous())
            cache[key] = (*grads, *x, *outputs, 0.0)
        return backward(*cache[key])

    fw_bytes = n * (2 + c) * e + (rays + 1) * 8 + rays * (c + 2) * e
    return Case(
        "volume_render",
        f"C={c} B={rays}",
        f"N={n} ({SAMPLES_PER_RAY[0]}-{SAMPLES_PER_RAY[1]} per ray)",
        make,
        (rays, c + 2),
        (True, True, False, False),
        variants,
        custom_backward,
        bytes_fw=fw_bytes,
        bytes_bw=fw_bytes + rays * (c + 2) * e + n * (1 + c) * e,
    )


def _former_distortion(rays: int):
    """The training step's distortion loss before the op: weights from the optical depths, then the O(N) pair sum
    through two per-ray exclusive prefix sums and a per-ray sum (models/render.py); takes each sample's ray."""
    from models.render import compositing_weights, exclusive_segment_cumsum, segment_sum

    def call(sd: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor, ray: torch.Tensor) -> torch.Tensor:
        weights, mid = compositing_weights(sd, ray, rays), 0.5 * (t0 + t1)
        before = exclusive_segment_cumsum(weights, ray, rays)
        moment = exclusive_segment_cumsum(weights * mid, ray, rays)
        terms = 2.0 * weights * (mid * before - moment) + weights.square() * (t1 - t0) / 3.0
        return segment_sum(terms, ray, rays)

    return call


def distortion_cases(s: Sizes, ops: Ops) -> list[Case]:
    cases, e = [], DTYPE.itemsize
    for rays in s.volume_render:
        counts = torch.randint(SAMPLES_PER_RAY[0], SAMPLES_PER_RAY[1] + 1, (rays,), generator=torch.Generator())
        offsets_cpu = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
        n = int(offsets_cpu[-1])

        def make(gen: torch.Generator, n: int = n, offsets_cpu: torch.Tensor = offsets_cpu) -> tuple:
            kw = dict(generator=gen, device=gen.device, dtype=DTYPE)
            sd, lengths = torch.rand(n, **kw) * 0.2, torch.rand(n, **kw) * 0.01 + 1e-3
            ends = torch.cumsum(lengths + torch.rand(n, **kw) * 0.01, 0)  # in order along each ray, with gaps
            offsets = offsets_cpu.to(gen.device)
            first = torch.repeat_interleave(ends[offsets[:-1]] - lengths[offsets[:-1]], offsets.diff())
            t1 = ends - first + 2.0  # each ray from t = 2
            return sd, t1 - lengths, t1, offsets

        backward = ops.backward_op("distortion_loss")
        variants = {
            "custom": Variant(ops.custom("distortion_loss")),
            "reference": Variant(ops.ref("distortion_loss")),
            "former": Variant(_former_distortion(rays), adapt=_ray_index),
        }
        fw_bytes = n * 3 * e + (rays + 1) * 8 + rays * e
        cases.append(
            Case(
                "distortion_loss",
                f"B={rays}",
                f"N={n} ({SAMPLES_PER_RAY[0]}-{SAMPLES_PER_RAY[1]} per ray)",
                make,
                (rays,),
                (True, False, False, False),
                variants,
                lambda g, x: backward(g, *x),
                bytes_fw=fw_bytes,
                bytes_bw=fw_bytes + rays * e + n * e,
            )
        )
    return cases
