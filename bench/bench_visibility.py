"""Benchmark of cuda_ext.visible_samples (the training march's no-grad pass in one op) vs its PyTorch reference and
the model's former form of the pass (models/render.py's float64 segmented scan, two sums read on the host, and two
cumsum-and-scatter compactions: ~35 launches where the op makes 7).

    python3 bench/bench_visibility.py [--device cuda|cpu] [--repeats 50] [--json OUT.json]

Two scenes shaped like training steps: "object" (the blender preset on lego: 49152 rays of 20-60 samples) and
"capture" (the capture preset: 16384 rays of 100-400 samples). Each ray sees near-empty space (s ~ 1e-3) up to a
random surface, where a few samples with s in (1, 4) end it: early termination drops the rest, the weight threshold
most of the samples before it. Reported per variant: median ms of a whole call (each ends on its host sync, so the
host's launch time is in it), GB/s on the bytes the op must move (the optical depths read twice, the offsets, the
outputs), % of the device's copy bandwidth, and the op's speed-up over the others.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_timing import bench_timer, measure_copy, print_header, report_header, write_report  # noqa: E402

import cuda_ext  # noqa: E402
from cuda_ext import reference  # noqa: E402
from models.render import ray_offsets, survivors_and_weights  # noqa: E402

SCENES = {"object": (49152, 20, 60), "capture": (16384, 100, 400)}  # rays, fewest and most samples a ray
THRESHOLDS = (1e-3, 1e-3)  # both presets' early_termination and weight_threshold


def make_scene(rays: int, fewest: int, most: int, device: torch.device, seed: int = 0) -> tuple:
    """(N,) float32 optical depths and (B + 1,) offsets of rays that meet a surface (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(fewest, most + 1, (rays,), generator=generator)
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    n = int(offsets[-1])
    ray = torch.repeat_interleave(torch.arange(rays), counts)
    position = torch.arange(n) - offsets[ray]  # each sample's place along its ray
    surface = (torch.rand(rays, generator=generator) * counts).long()  # where each ray meets it
    near = (position - surface[ray]).abs() < 3
    sd = torch.where(near, torch.rand(n, generator=generator) * 3 + 1, torch.rand(n, generator=generator) * 2e-3)
    return sd.to(device), offsets.to(device)


def _compact(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The former models.render.compact: the True entries' indices by a cumsum and a scatter (count known)."""
    slot = torch.where(mask, torch.cumsum(mask, 0) - 1, count)
    index = torch.empty(count + 1, dtype=torch.int64, device=mask.device)
    return index.scatter_(0, slot, torch.arange(mask.shape[0], device=mask.device))[:count]


def former(sd: torch.Tensor, offsets: torch.Tensor, ray: torch.Tensor, early: float, threshold: float) -> tuple:
    """The march's no-grad pass before the op (models/render_views.py at 731d1df), minus the sample gathers both
    forms share: (alive indices, the shown ones' positions among them, the alive samples' ray offsets)."""
    rays = offsets.shape[0] - 1
    alive, weights = survivors_and_weights(sd, ray, rays, early)
    shows = (weights > threshold) & alive
    alive_count, shown_count = torch.stack([alive.sum(), shows.sum()]).tolist()
    index = _compact(alive, alive_count)
    shows = shows[index]
    return index, _compact(shows, shown_count), ray_offsets(ray[index], rays)


def moved_bytes(n: int, rays: int, alive: int, shown: int, itemsize: int = 4) -> int:
    return 2 * n * itemsize + 3 * (rays + 1) * 8 + (alive + shown) * 8


def bench(device: torch.device, scene: str, timer, copy: dict) -> list[dict]:
    sd, offsets = make_scene(*SCENES[scene], device)
    ray = torch.repeat_interleave(torch.arange(offsets.shape[0] - 1, device=device), offsets.diff())
    want = cuda_ext.visible_samples(sd, offsets, *THRESHOLDS)
    variants = {
        "former (models/render.py scans)": lambda: former(sd, offsets, ray, *THRESHOLDS),
        "reference": lambda: reference.visible_samples(sd, offsets, *THRESHOLDS),
        "visible_samples op": lambda: cuda_ext.visible_samples(sd, offsets, *THRESHOLDS),
    }
    results = []
    for name, call in variants.items():
        same = all(torch.equal(a, b) for a, b in zip(call(), want))
        timing = timer(lambda i, call=call: call(), lambda i: None, 1)
        nbytes = moved_bytes(sd.shape[0], offsets.shape[0] - 1, want[0].shape[0], want[1].shape[0])
        gbps = nbytes / timing["ms"] / 1e6
        row = {"scene": scene, "variant": name, "samples": sd.shape[0], "alive": want[0].shape[0]}
        results.append(row | {"shown": want[1].shape[0], "equal_to_op": same, "bytes": nbytes, **timing})
        results[-1] |= {"GBps": gbps, "pct_copy": 100 * gbps / copy["GBps"]}
    for row in results[:-1]:
        results[-1][f"speedup_vs_{row['variant'].split()[0]}"] = row["ms"] / results[-1]["ms"]
    return results


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 50 cuda, 3 cpu)")
    p.add_argument("--budget-s", type=float, default=2.0, help="stop repeating a measurement after this long")
    p.add_argument("--scenes", default=",".join(SCENES), help=f"comma-separated, of {', '.join(SCENES)}")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    args.repeats = args.repeats or (50 if args.device == "cuda" else 3)
    args.scenes = args.scenes.split(",")
    unknown = sorted(set(args.scenes) - set(SCENES))
    if unknown or args.repeats < 1:
        p.error(f"--scenes: unknown {unknown}" if unknown else "--repeats must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Runs the benchmark, prints a table; returns the report (also written to --json)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    timer = bench_timer(device, args.repeats, args.budget_s)
    report = {
        **report_header(device),
        "thresholds": THRESHOLDS,
        "bytes_rule": "2*N*4 (optical depths, two passes) + 3*(B+1)*8 (offsets in, counts, offsets out) + (A+K)*8",
        "copy": measure_copy(timer, (1 << 30) if device.type == "cuda" else (1 << 26)),
        "results": [],
    }
    print_header(report, report["copy"]["GBps"])
    for scene in args.scenes:
        rows = bench(device, scene, timer, report["copy"])
        report["results"] += rows
        rays, fewest, most = SCENES[scene]
        print(f"{scene}: {rays} rays of {fewest}-{most} samples, N = {rows[0]['samples']}, alive {rows[0]['alive']}")
        for r in rows:
            ratios = "  ".join(f"{v:5.1f}x {k[11:]}" for k, v in r.items() if k.startswith("speedup_vs_"))
            print(
                f"  {r['variant']:32s} {r['ms']:8.3f} ms  {r['GBps']:7.1f} GB/s  {r['pct_copy']:5.1f}% copy  "
                f"{'equal' if r['equal_to_op'] else 'DIFFERENT'}  {ratios}"
            )
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
