"""The op benchmark's volume_render cases: packed samples of B rays (30-60 samples each), C = 3 (per-sample
colour) and C = 12 (deferred features), custom vs reference vs the model's former PyTorch compositing
(models/render.py: compositing_weights + accumulate), which the op replaced.

The three outputs are compared and differentiated as one (B, C + 2) tensor: [values | opacity | depth].
"""

from __future__ import annotations

from typing import Any

import torch
from bench_cases import DTYPE, Case, Ops, Sizes, Variant

CHANNELS = (3, 12)
SAMPLES_PER_RAY = (30, 60)  # each ray's count is uniform in this range (inclusive)

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
