"""Benchmark of cuda_ext.march_rays (packed samples, empty space skipped) vs its PyTorch reference (the dense
(B, S) distances, points and mask, compacted with nonzero(): what the model ran before the op).

    python3 bench/bench_march.py [--device cuda|cpu] [--rays 32768] [--cells 319] [--space bounded|contracted|both]
                                 [--json OUT.json]

``march_rays_capped`` (no sync; outputs of a fixed size) is timed with a capacity of 1.25x the samples: its GB/s
count the samples, not the padding it also writes.

The scene is shaped like a training step on a NeRF-synthetic object at the final grid: B rays from a sphere of
radius 4 towards the unit box, jittered offsets, two samples per voxel of a (cells+1)^3 grid (S = 1024 at the
default size, as the shipped config's cap), and an occupancy grid set on a thick spherical shell plus a solid
core (about 12% of the cells). Reported per variant: median ms, the samples kept, GB/s on the bytes the op must
move (rays in: 9 values a ray; samples out: an int64 ray index, t and 3 box coordinates; the ray offsets), % of
the device's copy bandwidth, and the op's speed-up over the reference. The occupancy cells read are not counted
(neighbouring samples share them), so the % is a lower bound on the traffic.

``--space contracted`` (model.contraction=inf, a capture): the rays start at radius 1.5 around the unit box (cameras
near the foreground, as in a phone capture), run linearly to their box exit and then in disparity to infinity over
a (cells)^3 occupancy grid of the contracted cube: the same solid core and shell inside the box, plus a far "room"
shell at contracted radius 0.85-0.95 (distance ~3-10 box sizes) that every ray reaches.
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

from bench_timing import Timer, bench_timer, measure_copy, print_header, report_header, write_report  # noqa: E402

import cuda_ext  # noqa: E402
from cuda_ext import reference  # noqa: E402


def make_scene(rays: int, cells: int, device: torch.device, seed: int = 0, space: str = "bounded") -> tuple:
    """The op's arguments for ``rays`` rays through a box with a (cells, cells, cells) occupancy grid (contracted:
    the grid spans the contracted cube, the rays run to infinity; see the module docstring)."""
    if space == "contracted":
        return make_contracted_scene(rays, cells, device, seed)
    generator = torch.Generator().manual_seed(seed)
    origins = torch.nn.functional.normalize(torch.randn(rays, 3, generator=generator), dim=1) * 4.0
    targets = (torch.rand(rays, 3, generator=generator) * 2 - 1) * 0.6
    directions = torch.nn.functional.normalize(targets - origins, dim=1)
    box = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    low, high = (box[0] - origins) / directions, (box[1] - origins) / directions
    t_start = torch.minimum(low, high).amax(1).clamp(min=0.0)
    t_end = torch.maximum(low, high).amin(1)
    offset = torch.rand(rays, generator=generator)
    centres = (torch.arange(cells) + 0.5) / cells * 2 - 1
    radius = (centres[:, None, None] ** 2 + centres[None, :, None] ** 2 + centres[None, None, :] ** 2).sqrt()
    occupancy = ((radius > 0.55) & (radius < 0.7)) | (radius < 0.25)
    step = 2.0 / cells / 2  # two samples per voxel
    max_samples = min(1024, int(3**0.5 * 2 / step) + 1)
    tensors = [x.to(device) for x in (origins, directions, t_start, t_end, offset, occupancy, box)]
    return (*tensors, step, max_samples)


def make_contracted_scene(rays: int, cells: int, device: torch.device, seed: int = 0) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    origins = torch.nn.functional.normalize(torch.randn(rays, 3, generator=generator), dim=1) * 1.5
    targets = (torch.rand(rays, 3, generator=generator) * 2 - 1) * 0.6
    directions = torch.nn.functional.normalize(targets - origins, dim=1)
    box = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]])
    exits = torch.maximum((box[0] - origins) / directions, (box[1] - origins) / directions).amin(1)
    offset = torch.rand(rays, generator=generator)
    centres = (torch.arange(cells) + 0.5) / cells * 2 - 1  # grid coordinates: the box is [-0.5, 0.5]
    axes = torch.meshgrid(centres, centres, centres, indexing="ij")
    radius = 2 * (axes[0] ** 2 + axes[1] ** 2 + axes[2] ** 2).sqrt()  # in box units inside the box
    room = torch.stack(axes).abs().amax(0)
    occupancy = ((radius > 0.55) & (radius < 0.7)) | (radius < 0.25) | ((room > 0.85) & (room < 0.95))
    step = 2.0 / (cells / 2) / 2  # two samples per foreground voxel (the box spans half the cells)
    max_samples = min(1024, int((1.5 + 3**0.5) / step) + int(1 / step) + 2)
    t_start, t_end = torch.zeros(rays), torch.full((rays,), float("inf"))
    tensors = [x.to(device) for x in (origins, directions, t_start, t_end, offset, occupancy, box)]
    return (*tensors, step, max_samples, exits.clamp(min=0.0).to(device))


def moved_bytes(rays: int, samples: int, itemsize: int = 4) -> int:
    return rays * 9 * itemsize + samples * (8 + 4 * itemsize) + (rays + 1) * 8


def bench(device: torch.device, rays: int, cells: int, timer: Timer, copy: dict, space: str) -> dict:
    """Both variants on one space's scene: its S, occupied fraction and per-variant results."""
    args = make_scene(rays, cells, device, space=space)
    samples = cuda_ext.march_rays(*args)[0].numel()
    results = []
    capacity = samples + samples // 4  # the room a captured step would give: the running maximum x 1.25
    variants = (
        ("reference (dense + nonzero)", reference.march_rays),
        ("march_rays op", cuda_ext.march_rays),
        ("march_rays_capped op, capacity x1.25", lambda *a: cuda_ext.march_rays_capped(*a[:9], capacity, *a[9:])),
    )
    for variant, fn in variants:
        timing = timer(lambda i, fn=fn: fn(*args), lambda i: None, 1)
        nbytes = moved_bytes(rays, samples)
        gbps = nbytes / timing["ms"] / 1e6
        results.append(
            {
                "space": space,
                "variant": variant,
                "samples": samples,
                "bytes": nbytes,
                **timing,
                "GBps": gbps,
                "pct_copy": 100 * gbps / copy["GBps"],
            }
        )
    results[1]["speedup_vs_reference"] = results[0]["ms"] / results[1]["ms"]
    results[2]["speedup_vs_reference"] = results[0]["ms"] / results[2]["ms"]
    results[2]["speedup_vs_march_rays"] = results[1]["ms"] / results[2]["ms"]  # no sync, but the padding written
    occupied = float(args[5].float().mean())
    return {"max_samples": args[8], "occupied_fraction": occupied, "results": results}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rays", type=int, default=None, help="rays per call (default 32768 cuda, 1024 cpu)")
    p.add_argument("--cells", type=int, default=None, help="occupancy cells per side (default 319 cuda, 63 cpu)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 50 cuda, 5 cpu)")
    p.add_argument("--budget-s", type=float, default=2.0, help="stop repeating a measurement after this long")
    p.add_argument("--space", choices=("bounded", "contracted", "both"), default="both", help="which march to time")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    cuda = args.device == "cuda"
    args.rays = args.rays or (32768 if cuda else 1024)
    args.cells = args.cells or (319 if cuda else 63)
    args.repeats = args.repeats or (50 if cuda else 5)
    if args.rays < 1 or args.cells < 1 or args.repeats < 1:
        p.error("--rays, --cells and --repeats must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Runs the benchmark, prints a table; returns the report (also written to --json)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    timer = bench_timer(device, args.repeats, args.budget_s)
    report = {
        **report_header(device),
        "rays": args.rays,
        "cells": args.cells,
        "bytes_rule": "rays*9*4 (in) + samples*(8 + 4*4) (ray, t, points out) + (rays+1)*8 (offsets)",
        "copy": measure_copy(timer, (1 << 30) if device.type == "cuda" else (1 << 26)),
        "spaces": {},
        "results": [],
    }
    copy = report["copy"]
    print_header(report, copy["GBps"])
    for space in ("bounded", "contracted") if args.space == "both" else (args.space,):
        part = bench(device, args.rays, args.cells, timer, copy, space)
        report["spaces"][space] = {"max_samples": part["max_samples"], "occupied_fraction": part["occupied_fraction"]}
        report["results"] += part["results"]
        print(
            f"{space}: {args.rays} rays, {args.cells}^3 occupancy cells ({part['occupied_fraction']:.1%} set), "
            f"S = {part['max_samples']}"
        )
        for r in part["results"]:
            speedup = f"  {r['speedup_vs_reference']:6.1f}x reference" if "speedup_vs_reference" in r else ""
            print(
                f"  {r['variant']:38s} {r['samples']:>10d} samples  {r['ms']:9.3f} ms  {r['GBps']:8.1f} GB/s  "
                f"{r['pct_copy']:5.1f}% copy{speedup}"
            )
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
