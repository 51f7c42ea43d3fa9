"""Benchmark of the training-step ops: volume_render (vs its reference and the compositing code it replaced)
and sparse_adam_step (vs dense fused Adam), in ms, GB/s on the bytes each must move, and % of the device's copy
bandwidth (same run, same device).

    python3 bench/bench_training_ops.py [--size full|small] [--json OUT.json]

Inputs rotate over enough sets that the L2 cache cannot hold them (as bench_ops.py does), so the figures are
DRAM figures. Compositing: 8192 rays with 0-80 samples each (about 40 on average), float32, C = 3 (per-sample
colour) and C = 12 (deferred features). Adam: a 256^3 x 13 float32 grid, 1% and 10% of its voxels touched.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ops import Timer, cache_bytes, measure_copy  # noqa: E402

import cuda_ext  # noqa: E402
from cuda_ext import reference  # noqa: E402
from models.render import accumulate, compositing_weights  # noqa: E402


def former_compositing(sd, values, t, offsets):
    """The model's compositing before the fused op: weights, then two index_add accumulations."""
    rays = offsets.shape[0] - 1
    ray = torch.searchsorted(offsets, torch.arange(sd.shape[0], device=sd.device), right=True) - 1
    weights = compositing_weights(sd, ray, rays)
    geometry = accumulate(torch.stack([t, torch.ones_like(t)], 1), weights, ray, rays)
    return accumulate(values, weights, ray, rays), geometry[:, 1], geometry[:, 0]


def render_inputs(rays: int, channels: int, device, generator):
    counts = torch.randint(0, 81, (rays,), generator=generator)
    n = int(counts.sum())
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(device)
    sd = (torch.rand(n, generator=generator) * 0.2).to(device)
    values = torch.rand(n, channels, generator=generator).to(device)
    t = (torch.rand(n, generator=generator) * 4 + 2).to(device)
    return sd, values, t, offsets


def render_bytes(sd, values, offsets, backward: bool) -> int:
    n, c, rays = sd.shape[0], values.shape[1], offsets.shape[0] - 1
    forward = 4 * n * (2 + c) + 8 * (rays + 1) + 4 * rays * (c + 2)  # read s, t, values, offsets; write outputs
    if not backward:
        return forward
    # the backward reads the inputs, the outputs and their gradients, and writes d/ds and d/dvalues
    return 4 * n * (2 + c) + 8 * (rays + 1) + 2 * 4 * rays * (c + 2) + 4 * n * (1 + c)


def bench_render(timer: Timer, device, sets: int, rays: int) -> list[dict]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for channels in (3, 12):
        inputs = [render_inputs(rays, channels, device, generator) for _ in range(sets)]
        outputs = [cuda_ext.volume_render(*x) for x in inputs]
        grads = [[torch.rand_like(o) for o in out] for out in outputs]
        backward_op = timer(
            lambda i: torch.ops.cuda_ext.volume_render_backward(
                *grads[i % sets], *inputs[i % sets], *outputs[i % sets], 0.0
            ),
            lambda i: None,
            sets,
        )
        for name, fn in (
            ("custom", cuda_ext.volume_render),
            ("reference", reference.volume_render),
            ("former compositing", former_compositing),
        ):
            forward = timer(lambda i, fn=fn: fn(*inputs[i % sets][:4]), lambda i: None, sets)

            def step(i, fn=fn):
                sd, values, t, offsets = inputs[i % sets]
                sd, values = sd.detach().requires_grad_(), values.detach().requires_grad_()
                out, opacity, depth = fn(sd, values, t, offsets)
                (out.sum() + opacity.sum() + depth.sum()).backward()

            both = timer(step, lambda i: None, sets)
            sd, values, _, offsets = inputs[0]
            fw_bytes, bw_bytes = render_bytes(sd, values, offsets, False), render_bytes(sd, values, offsets, True)
            # custom's bw: the backward kernel alone; the others' bw: fwbw - fw (autograd graphs)
            bw_ms = backward_op["ms"] if name == "custom" else both["ms"] - forward["ms"]
            rows.append(
                {
                    "op": "volume_render",
                    "case": f"{rays} rays, C={channels}",
                    "variant": name,
                    "samples": sd.shape[0],
                    "fw_ms": forward["ms"],
                    "fwbw_ms": both["ms"],
                    "bw_ms": bw_ms,
                    "fw_bytes": fw_bytes,
                    "bw_bytes": bw_bytes,
                }
            )
    return rows


def bench_adam(timer: Timer, device, side: int, channels: int) -> list[dict]:
    rows = []
    m = side**3
    param = torch.randn(m, channels, device=device)
    grad = torch.randn_like(param)
    moments = [torch.zeros_like(param), torch.zeros_like(param)]
    generator = torch.Generator().manual_seed(1)
    for fraction in (0.01, 0.10):
        k = int(m * fraction)
        picks = [torch.randperm(m, generator=generator)[:k].sort().values.to(device) for _ in range(4)]
        timing = timer(
            lambda i: cuda_ext.sparse_adam_step(param, grad, *moments, picks[i % 4], 1, 0.1, 0.9, 0.99, 1e-15),
            lambda i: None,
            4,
        )
        rows.append(
            {
                "op": "sparse_adam_step",
                "case": f"{side}^3 x {channels}, {fraction:.0%} touched",
                "variant": "custom",
                "fw_ms": timing["ms"],
                "fw_bytes": k * channels * 4 * 7 + k * 8,
            }
        )
    dense = torch.nn.Parameter(param.clone())
    dense.grad = grad.clone()
    optimizer = torch.optim.Adam([dense], lr=0.1, betas=(0.9, 0.99), eps=1e-15, fused=device.type == "cuda")
    timing = timer(lambda i: optimizer.step(), lambda i: None, 1)
    rows.append(
        {
            "op": "sparse_adam_step",
            "case": f"{side}^3 x {channels}, dense",
            "variant": "torch Adam",
            "fw_ms": timing["ms"],
            "fw_bytes": m * channels * 4 * 7,
        }
    )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("full", "small"), default="full")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    full = args.size == "full"
    timer = Timer(device, warmup=3, repeats=30 if full else 3, budget_s=2.0 if full else 0.2)
    copy = measure_copy(timer, (1 << 31) if full and device.type == "cuda" else (1 << 26))
    sets = max(2, min(16, 2 * cache_bytes(device) // (8192 * 40 * 14 * 4) + 1)) if device.type == "cuda" else 2
    rows = bench_render(timer, device, sets, 8192 if full else 512)  # a training step's batch
    if full:  # 16x the batch: the kernels' own bandwidth, above launch and Python overheads
        rows += bench_render(timer, device, max(2, sets // 16 + 1), 131072)
    rows += bench_adam(timer, device, 256 if full else 24, 13)
    for row in rows:
        for phase in ("fw", "bw"):
            if row.get(f"{phase}_bytes") and row.get(f"{phase}_ms"):
                row[f"{phase}_GBps"] = row[f"{phase}_bytes"] / row[f"{phase}_ms"] / 1e6
                row[f"{phase}_pct_copy"] = 100 * row[f"{phase}_GBps"] / copy["GBps"]
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    report = {
        "date": datetime.date.today().isoformat(),
        "device": name,
        "torch": torch.__version__,
        "copy_GBps": copy["GBps"],
        "rows": rows,
    }
    print(f"{report['date']}  {name}  torch {torch.__version__}  copy {copy['GBps']:.0f} GB/s")
    for row in rows:
        extra = "".join(
            f"  {p} {row[p + '_ms']:.3f} ms {row.get(p + '_pct_copy', 0):5.1f}% copy"
            for p in ("fw", "bw")
            if row.get(p + "_ms") is not None
        )
        print(
            f"{row['op']:17s} {row['case']:24s} {row['variant']:19s}{extra}"
            + (f"  fwbw {row['fwbw_ms']:.3f} ms" if "fwbw_ms" in row else "")
        )
    for case in {(r["op"], r["case"]) for r in rows if r["op"] == "volume_render"}:
        by = {r["variant"]: r for r in rows if (r["op"], r["case"]) == case}
        print(
            f"volume_render {case[1]}: custom fwbw {by['former compositing']['fwbw_ms'] / by['custom']['fwbw_ms']:.2f}x"
            f" the former compositing, {by['reference']['fwbw_ms'] / by['custom']['fwbw_ms']:.2f}x the reference"
        )
    dense = next(r for r in rows if r["variant"] == "torch Adam")
    for r in rows:
        if r["op"] == "sparse_adam_step" and r["variant"] == "custom":
            print(f"sparse_adam_step {r['case']}: {dense['fw_ms'] / r['fw_ms']:.1f}x dense fused Adam")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
