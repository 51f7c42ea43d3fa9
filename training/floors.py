"""Hardware floors for the step profile (``train.profile=true``): how fast each part could be on this device.

A part's floor is the larger of its bytes over the device's copy bandwidth and its FLOPs over the device's
matmul rate, both measured here, on the device, when the report is made (not datasheet numbers):

- copy bandwidth: a large tensor copy, read + write bytes per second (on an H100 about 3 TB/s);
- matmul rate: a large square matmul in the dtype the decoder runs in (float32 under the current TF32
  setting, or bfloat16), FLOPs per second.

What each part must move or compute, per step (counted while profiling):

- ``grid_interpolate`` forward: the points in and the interpolated values out (12 + 4C bytes a point). The
  8 corners it reads are left out: neighbouring points share them and they often come from L2, so any count
  of them would be a guess; the floor is therefore a lower bound, and a loose one for scattered points.
- ``decoder`` forward: 2 * N * sum(in * out) FLOPs of its linear layers for N inputs (the GELUs and the
  encoding are elementwise, cheaper).
- ``march_rays``: the rays in (origins, directions, t_start, t_end, offset) and the packed samples out (ray
  index, t, box coordinates) with the ray offsets. The occupancy cells it reads are left out, as the corners
  above; the reference's dense (B, S) tensors are what the op avoids, so they are not counted either.
- ``optimizer``: dense Adam reads the parameters, gradients and both moments and writes the parameters and
  both moments: 7 * 4 bytes per float32 value (sparse Adam: no floor, its row count is data).

Parts without a floor (the no-grad pass that picks the shaded samples, compositing, the backward as a whole)
report none.
"""

from __future__ import annotations

import time

import torch

COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}  # big enough to leave the caches (H100 L2: 50 MB)
MATMUL_SIDE = {"cuda": 8192, "cpu": 1024}


def _timed(device: torch.device, work, repeats: int) -> float:
    """Median seconds of ``work()`` over ``repeats`` runs after one warm-up."""
    work()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def device_limits(device: torch.device, matmul_dtype: torch.dtype = torch.float32) -> dict:
    """Measured ``copy_gbps`` (read + write, GB/s) and ``matmul_tflops`` (``matmul_dtype``) of ``device``."""
    device = torch.device(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    source = torch.empty(COPY_BYTES[kind] // 4, dtype=torch.float32, device=device).uniform_()
    target = torch.empty_like(source)
    copy_seconds = _timed(device, lambda: target.copy_(source), 5)
    side = MATMUL_SIDE[kind]
    a = torch.randn(side, side, device=device).to(matmul_dtype)
    b = torch.randn(side, side, device=device).to(matmul_dtype)
    matmul_seconds = _timed(device, lambda: a @ b, 5)
    return {
        "copy_gbps": 2 * source.numel() * 4 / copy_seconds / 1e9,
        "matmul_tflops": 2 * side**3 / matmul_seconds / 1e12,
        "matmul_dtype": str(matmul_dtype).replace("torch.", ""),
        "tf32": bool(torch.backends.cuda.matmul.allow_tf32) if kind == "cuda" else False,
    }


def floors_ms(work: dict[str, dict[str, float]], steps: int, limits: dict) -> dict[str, float]:
    """Per-step floor in ms of each part in ``work`` (part -> accumulated ``bytes`` and ``flops``)."""
    floors = {}
    for part, amounts in work.items():
        seconds = max(
            amounts.get("bytes", 0.0) / (limits["copy_gbps"] * 1e9),
            amounts.get("flops", 0.0) / (limits["matmul_tflops"] * 1e12),
        )
        floors[part] = 1000.0 * seconds / max(steps, 1)
    return floors


def linear_flops(module: torch.nn.Module, rows: int) -> float:
    """2 * rows * sum(in * out) over ``module``'s linear layers: their forward FLOPs for ``rows`` inputs."""
    return 2.0 * rows * sum(m.in_features * m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear))


def adam_bytes(parameters) -> float:
    """Bytes a dense Adam step must move: 7 accesses (4 reads, 3 writes) of every value."""
    return 7.0 * sum(p.numel() * p.element_size() for p in parameters)
