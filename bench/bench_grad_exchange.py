"""Benchmark of the ranks' exchange of the voxel grids' gradients under torchrun (issue 33).

    torchrun --standalone --nproc_per_node=2 bench/bench_grad_exchange.py [--size 320] [--touched 0.06]
                                   [--occupied 0.26] [--run-length 16] [--repeats 20] [--json OUT.json]

Two float32 gradients shaped as the blender preset's grids, seen as R = size^3 rows: density (R, 1) and features
(R, 12). Each rank's gradient is non-zero only on its own ``--touched`` share of the rows (what its rays and TV
estimate read), in runs of ``--run-length`` consecutive rows (a ray reads neighbouring voxels), drawn per rank.
The variants, each through training.distributed.Group as training calls it:

  dense     an in-place all-reduce of each whole gradient (``train.dist_grad_sync=dense``)
  touched   the union of the ranks' marks (a one-byte-a-row MAX all-reduce), ``nonzero`` (a host sync), the union's
            rows packed, all-reduced and copied back (``train.dist_grad_sync=touched``, the default)
  occupied  a fixed row list, the same on every rank (the occupied voxels' rows that ``train.sparse_adam=occupied``
            steps: ``--occupied`` of the rows), packed, all-reduced and copied back (Group.average_rows)

and the occupied variant's parts alone: packing (index_select + cat; index_select alone; advanced indexing
+ cat, checked to pack the same), the all-reduce of the packed rows, and
the copy back (index_copy_, and index_put_ beside it: checked to write the same). Every whole exchange is first
checked against the mean of all ranks' gradients (each rank regenerates every rank's gradient from its seed) on the
rows it promises. Reported, from rank 0 with the slowest
rank's median beside it: median ms, the bytes each rank sends, NCCL's bus bandwidth (2 (N-1)/N x bytes / time),
and each variant's ratio to dense. The lego preset's figures: occupied rows 26%, mic's 5% (metrics.json
``occupancy.corner_rows``). On the CPU (gloo) it runs at a small size: a correctness check, not a measurement.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_timing import Timer, measure_copy, print_header, report_header, write_report  # noqa: E402

from training import distributed  # noqa: E402

CHANNELS = (1, 12)  # density, features: the preset's grids


def row_runs(rows: int, share: float, run_length: int, seed: int, device: torch.device) -> torch.Tensor:
    """(R,) bool: about ``share`` of the rows, in runs of ``run_length`` consecutive rows at random places."""
    runs = max(1, math.ceil(rows / run_length))
    generator = torch.Generator().manual_seed(seed)
    starts = torch.rand(runs, generator=generator) < share
    return starts.repeat_interleave(run_length)[:rows].to(device)


def rank_gradients(rows: int, marks: torch.Tensor, seed: int, device: torch.device) -> list[torch.Tensor]:
    """Rank ``seed``'s (R, C) gradients: random on its marked rows, zero elsewhere."""
    generator = torch.Generator().manual_seed(10_000 + seed)
    return [(torch.randn(rows, c, generator=generator).to(device) * marks[:, None]) for c in CHANNELS]


def pack_by_indexing(grads: list[torch.Tensor], rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """pack_rows through advanced indexing (the index kernel index_put_ shares) instead of index_select."""
    return torch.cat([grad[rows] for grad in grads], dim=1, out=out)


def bench(group: distributed.Group, device: torch.device, args: argparse.Namespace) -> dict:
    rows = args.size**3
    marks_of = [row_runs(rows, args.touched, args.run_length, 1 + r, device) for r in range(group.world)]
    grads_of = [rank_gradients(rows, marks_of[r], r, device) for r in range(group.world)]
    mean = [sum(grads_of[r][i] for r in range(group.world)) / group.world for i in range(len(CHANNELS))]
    own_marks, own = marks_of[group.rank], grads_of[group.rank]
    union_rows = int(torch.stack(marks_of).any(0).sum())
    del grads_of, marks_of
    occupied = row_runs(rows, args.occupied, args.run_length, 0, device).nonzero().squeeze(1)
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in own]
    for param, g in zip(params, own):
        param.grad = g.clone()
    grads = [param.grad for param in params]  # the (R, C) row views Group averages in place
    marks = torch.zeros_like(own_marks)
    packed = distributed.pack_rows(grads, occupied)

    def reset(i: int) -> None:
        for g, o in zip(grads, own):
            g.copy_(o)
        marks.copy_(own_marks)

    def copy_back(i: int, index_put: bool = False) -> None:
        if index_put:  # the alternative kernel: advanced-index assignment
            for g, part in zip(grads, packed.split(list(CHANNELS), dim=1)):
                g.index_put_((occupied,), part)
        else:
            distributed.unpack_rows(grads, occupied, packed)  # what Group.average_rows does

    row_bytes = 4 * sum(CHANNELS)
    occupied_bytes = occupied.numel() * row_bytes
    everything = torch.arange(rows, device=device)
    # name, run, bytes a rank sends, bytes it reads + writes in memory, the rows its result is checked on
    variants = [
        ("dense", lambda i: group.average_gradients(params), rows * row_bytes, 0, everything),
        (
            "touched",
            lambda i: group.average_gradients([], row_sparse=params, marks=marks),
            union_rows * row_bytes + rows,
            0,
            everything,
        ),
        ("occupied", lambda i: group.average_rows(grads, occupied), occupied_bytes, 0, occupied),
        ("occupied: pack", lambda i: distributed.pack_rows(grads, occupied, out=packed), 0, 2 * occupied_bytes, None),
        # the pack cost 6.4 ms where the copy back took 0.6 ms (2 H100s, 2026-11-27): its kernels apart
        (
            "occupied: pack, index_select alone",
            lambda i: [g.index_select(0, occupied) for g in grads],
            0,
            2 * occupied_bytes,
            None,
        ),
        ("occupied: pack (indexing)", lambda i: pack_by_indexing(grads, occupied, packed), 0, 2 * occupied_bytes, None),
        ("occupied: all-reduce", lambda i: dist.all_reduce(packed), occupied_bytes, 0, None),
        ("occupied: copy back", copy_back, 0, 2 * occupied_bytes, None),
        ("occupied: copy back (index_put_)", lambda i: copy_back(i, index_put=True), 0, 2 * occupied_bytes, None),
    ]
    torch.testing.assert_close(pack_by_indexing(grads, occupied, packed.clone()), packed, rtol=0, atol=0)
    reset(0)
    copy_back(0)
    by_index_copy = [g.clone() for g in grads]
    reset(0)
    copy_back(0, index_put=True)
    for g, expected in zip(grads, by_index_copy):
        torch.testing.assert_close(g, expected, rtol=0, atol=0)
    del by_index_copy
    timer = Timer(device, warmup=3 if device.type == "cuda" else 1, repeats=args.repeats, budget_s=math.inf)
    copy = measure_copy(timer, (1 << 30) if device.type == "cuda" else (1 << 24))
    results = []
    for name, run, sent, moved, checked in variants:
        if checked is not None:  # the whole exchange: checked once against the ranks' mean
            reset(0)
            run(0)
            for g, m in zip(grads, mean):
                torch.testing.assert_close(g.index_select(0, checked), m.index_select(0, checked), rtol=1e-5, atol=1e-6)
        timing = timer(run, reset, 1)
        slowest = torch.tensor([timing["ms"]], dtype=torch.float64, device=device)
        dist.all_reduce(slowest, dist.ReduceOp.MAX)
        result = {"variant": name, **timing, "slowest_rank_ms": float(slowest), "bytes_sent": sent}
        if sent:
            result["bus_GBps"] = 2 * (group.world - 1) / group.world * sent / timing["ms"] / 1e6
        if moved:
            result["bytes_moved"] = moved
            result["pct_copy"] = 100 * moved / timing["ms"] / 1e6 / copy["GBps"]
        results.append(result)
    for result in results:
        result["vs_dense"] = results[0]["ms"] / result["ms"]
    return {"copy": copy, "results": results, "occupied_rows": occupied.numel(), "union_rows": union_rows}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", type=int, default=None, help="grid side (default 320 cuda, 24 cpu)")
    p.add_argument("--touched", type=float, default=0.06, help="share of the rows each rank's step touches")
    p.add_argument("--occupied", type=float, default=0.26, help="share of the rows in occupied cells (lego 0.26)")
    p.add_argument("--run-length", type=int, default=16, help="consecutive rows per touched/occupied run")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per variant (default 20 cuda, 3 cpu)")
    p.add_argument("--json", type=Path, default=None, help="also write the report here (rank 0)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    args.size = args.size or (320 if args.device == "cuda" else 24)
    args.repeats = args.repeats or (20 if args.device == "cuda" else 3)
    if args.size < 2 or args.run_length < 1 or args.repeats < 1:
        p.error("--size must be >= 2, --run-length and --repeats >= 1")
    for name in ("touched", "occupied"):
        if not 0.0 < getattr(args, name) <= 1.0:
            p.error(f"--{name} must be in (0, 1], got {getattr(args, name)}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict | None:
    """Runs the benchmark on every rank; rank 0 prints the table and returns the report (also written to --json)."""
    args = parse_args(argv)
    group = distributed.from_environment()
    if not group.active:
        raise SystemExit("run it under torchrun with 2 or more ranks: torchrun --nproc_per_node=2 " + __file__)
    distributed.start(group, args.device, timeout_seconds=300)
    device = torch.device("cuda", group.local_rank) if args.device == "cuda" else torch.device("cpu")
    try:
        measured = bench(group, device, args)
    finally:
        distributed.stop(group)
    if not group.is_main:
        return None
    report = {
        **report_header(device),
        "ranks": group.world,
        "grid": {"size": args.size, "rows": args.size**3, "channels": list(CHANNELS), "dtype": "float32"},
        "touched": args.touched,
        "occupied": args.occupied,
        "run_length": args.run_length,
        "bytes_rule": "bytes a rank sends: whole grids (dense), the union's rows + 1 byte a row (touched), the "
        "occupied rows (occupied); bus bandwidth = 2 (N-1)/N x bytes / time",
        **measured,
    }
    print_header(report, measured["copy"]["GBps"])
    print(f"{group.world} ranks, grids {args.size}^3 x {list(CHANNELS)} float32, touched {args.touched:.0%} a rank,")
    print(f"occupied {args.occupied:.0%} ({measured['occupied_rows']} rows), runs of {args.run_length} rows")
    for r in report["results"]:
        rate = f"{r['bus_GBps']:8.1f} GB/s bus" if "bus_GBps" in r else f"{r.get('pct_copy', 0):8.1f}% copy  "
        print(
            f"{r['variant']:34s} {r['ms']:9.3f} ms (slowest rank {r['slowest_rank_ms']:9.3f})  {rate}  "
            f"{r['vs_dense']:5.2f}x dense"
        )
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
