"""Where the per-sample decoder's time goes, kernel by kernel, and what its bias gradients could cost instead.

    python bench/decoder_profile.py --json decoder_profile.json [--rows 524288,1179648] [--rays 98304]

The lego preset's decoder (``+experiment=blender``: 12 features, two GELU layers of 256, pe3 directions, bfloat16)
runs eagerly (no CUDA graph, so each kernel comes with the ATen call and input shapes that launched it) on random
inputs: N samples packed by ray over B rays, forward and backward. Then each ATen call's device time a step, and the
column sums a bias gradient needs timed alone on the same shapes, several ways (the step graph makes no choice of its
own: what autograd runs is what it captures).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from models.decoder import SampleDecoder  # noqa: E402
from models.ops import OP_NAMES, build_ops  # noqa: E402


def decoder_inputs(rows: int, rays: int, device: str):
    """(N, 12) features, (B, 3) unit directions, (N,) int64 rays in non-decreasing order (N / B samples a ray)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    features = torch.randn(rows, 12, generator=generator).to(device).requires_grad_()
    directions = torch.nn.functional.normalize(torch.randn(rays, 3, generator=generator), dim=1).to(device)
    ray = torch.sort(torch.randint(0, rays, (rows,), generator=generator)).values.to(device)
    return features, directions, ray


def elapsed_ms(fn, repeats: int) -> float:
    """Median device time of ``fn()`` in ms, over ``repeats`` calls after two warm-up calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def column_sums(rows: int, width: int, device: str, repeats: int) -> dict[str, float]:
    """ms of the (width,) column sums of a (rows, width) bfloat16 gradient, by method."""
    grad = torch.randn(rows, width, device=device).to(torch.bfloat16)
    ones = torch.ones(rows, device=device, dtype=torch.bfloat16)
    methods = {
        "sum bf16": lambda: grad.sum(0),
        "sum to float32": lambda: grad.sum(0, dtype=torch.float32),
        "mv ones": lambda: torch.mv(grad.t(), ones),
        "ones @ grad": lambda: ones[None] @ grad,
    }
    return {name: round(elapsed_ms(fn, repeats), 4) for name, fn in methods.items()}


def profile(rows: int, rays: int, device: str, steps: int) -> list[dict]:
    """The decoder's forward and backward, ``steps`` times under the profiler -> rows of (ATen call, shapes, device
    ms a step), largest first."""
    ops = build_ops(dict.fromkeys(OP_NAMES, "custom"))
    decoder = SampleDecoder(12, 256, 2, "pe3", "none", ops, precision="bfloat16").to(device).train()
    torch.nn.init.normal_(decoder.out.weight, std=0.05)  # the zero start would make the gradients trivial
    features, directions, ray = decoder_inputs(rows, rays, device)
    weights = torch.rand(rows, 3, device=device)

    def step():
        (decoder(features, directions, ray) * weights).sum().backward()

    for _ in range(3):
        step()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        sync()
    table = []
    for event in prof.key_averages(group_by_input_shape=True):
        own = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))
        if event.device_type == torch.autograd.DeviceType.CPU and own > 0:
            table.append({"call": event.key, "shapes": str(event.input_shapes), "ms": round(own / 1e3 / steps, 4)})
    return sorted(table, key=lambda row: -row["ms"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rows", default="524288,1179648", help="sample counts N, comma-separated")
    parser.add_argument("--rays", type=int, default=98304)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "runs": []}
    for rows in (int(r) for r in args.rows.split(",")):
        run: dict = {"rows": rows, "rays": args.rays, "calls": profile(rows, args.rays, device, args.steps)}
        run["ms_per_step"] = round(sum(row["ms"] for row in run["calls"]), 4)
        if device == "cuda":
            shapes = {"(N, 256)": (rows, 256), "(N, 8)": (rows, 8), "(B, 256)": (args.rays, 256)}
            run["column_sums_ms"] = {name: column_sums(*shape, device, args.repeats) for name, shape in shapes.items()}
        report["runs"].append(run)
        print(f"N={rows}: {run['ms_per_step']} ms of device time a step")
        for row in run["calls"][:40]:
            print(f"  {row['ms']:8.4f}  {row['call']}  {row['shapes'][:150]}")
        print("  column sums:", json.dumps(run.get("column_sums_ms", {})))
    Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
