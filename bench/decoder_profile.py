"""Where the per-sample decoder's time goes, kernel by kernel, and what its bias gradients could cost instead.

    python bench/decoder_profile.py --json decoder_profile.json [--rows 524288,1179648] [--rays 98304]

The lego preset's decoder (``+experiment=blender``: 12 features, two GELU layers of 256, pe3 directions, bfloat16)
runs eagerly (no CUDA graph, so each kernel comes with the ATen call and input shapes that launched it) on random
inputs: N samples packed by ray over B rays, forward and backward. Then each ATen call's device time a step, and the
column sums a bias gradient needs timed alone on the same shapes, several ways (the step graph makes no choice of its
own: what autograd runs is what it captures). Without a GPU the calls' own CPU times (the tests run it so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_timing import bench_timer  # noqa: E402
from kernel_profile import device_rows  # noqa: E402

from models.decoder import SampleDecoder  # noqa: E402
from models.ops import OP_NAMES, build_ops  # noqa: E402


def decoder_inputs(rows: int, rays: int, device: str):
    """(N, 12) features, (B, 3) unit directions, (N,) int64 rays in non-decreasing order (N / B samples a ray)."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    features = torch.randn(rows, 12, generator=generator).to(device).requires_grad_()
    directions = torch.nn.functional.normalize(torch.randn(rays, 3, generator=generator), dim=1).to(device)
    ray = torch.sort(torch.randint(0, rays, (rows,), generator=generator)).values.to(device)
    return features, directions, ray


def column_sums(rows: int, width: int, device: str, repeats: int) -> dict[str, float]:
    """ms of the (width,) column sums of a (rows, width) bfloat16 gradient, by method (median, bench_timing)."""
    grad = torch.randn(rows, width, device=device).to(torch.bfloat16)
    ones = torch.ones(rows, device=device, dtype=torch.bfloat16)
    methods = {
        "sum bf16": lambda: grad.sum(0),
        "sum to float32": lambda: grad.sum(0, dtype=torch.float32),
        "mv ones": lambda: torch.mv(grad.t(), ones),
        "ones @ grad": lambda: ones[None] @ grad,
    }
    timer = bench_timer(torch.device(device), repeats, budget_s=2.0)
    return {name: round(timer(lambda i, fn=fn: fn(), lambda i: None, 1)["ms"], 4) for name, fn in methods.items()}


def profile(rows: int, rays: int, device: str, steps: int) -> tuple[float, list[dict]]:
    """The decoder's forward and backward, ``steps`` times under the profiler -> (its kernels' ms a step, rows of
    (ATen call, shapes, ms a step of the kernels it launched itself; on a CPU its own time)), largest first."""
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
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else []
    with torch.profiler.profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        sync()
    kernels_ms = sum(e.self_device_time_total for e in device_rows(prof.key_averages())) / 1e3 / steps
    table = []
    for event in prof.key_averages(group_by_input_shape=True):
        own = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if event.device_type == torch.autograd.DeviceType.CPU and own > 0:
            table.append({"call": event.key, "shapes": str(event.input_shapes), "ms": round(own / 1e3 / steps, 4)})
    return round(kernels_ms, 4), sorted(table, key=lambda row: -row["ms"])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rows", default="524288,1179648", help="sample counts N, comma-separated")
    parser.add_argument("--rays", type=int, default=98304)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "runs": []}
    for rows in (int(r) for r in args.rows.split(",")):
        kernels_ms, calls = profile(rows, args.rays, device, args.steps)
        run: dict = {"rows": rows, "rays": args.rays, "kernels_ms_per_step": kernels_ms, "calls": calls}
        shapes = {"(N, 256)": (rows, 256), "(N, 8)": (rows, 8), "(B, 256)": (args.rays, 256)}
        run["column_sums_ms"] = {name: column_sums(*shape, device, args.repeats) for name, shape in shapes.items()}
        report["runs"].append(run)
        print(f"N={rows}: {kernels_ms} ms of kernels a step")
        for row in run["calls"][:40]:
            print(f"  {row['ms']:8.4f}  {row['call']}  {row['shapes'][:150]}")
        print("  column sums:", json.dumps(run.get("column_sums_ms", {})))
    Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
