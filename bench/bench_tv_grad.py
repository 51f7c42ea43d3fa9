"""Benchmark of the sampled TV estimate's forward + backward: a dense gradient, ``model.tv_sparse_grad``, the op.

    python3 bench/bench_tv_grad.py [--device cuda|cpu] [--size 320] [--channels 12] [--samples 65536]
                                   [--json OUT.json]

A (size^3, C) float32 grid (default 320^3 x 12 on CUDA, the blender preset's feature grid; 32^3 x 12 on the CPU)
whose ``.grad`` already holds a dense gradient, as the lookups leave it before the TV estimate's backward runs
(models/model.py computes the TV before the forward). Each timed run is ``VoxelGrid.total_variation(samples)``
and its backward onto that gradient: plain indexing (a zero-filled grid-sized gradient, the rows scattered into
it, a whole-grid add: 4 M C 4 bytes at least) against ``models.sparse_rows.RowGradients`` (the 4 K rows read,
and their gradient added onto the grid's with one ``index_add_`` after the backward: 3 x 4 K C 4 bytes).
The third variant is ``cuda_ext.sampled_tv`` (what training runs): the cells drawn, the estimate and its gradient
added onto the grid's in one kernel (the same 3 x 4 K C 4 bytes as the rows). Reported: median ms, GB/s and % of
the copy bandwidth on each variant's bytes, and each variant's speed-up over the dense one.
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
from models.field import VoxelGrid  # noqa: E402
from models.sparse_rows import RowGradients  # noqa: E402


def dense_bytes(rows: int, channels: int) -> int:
    """Zero-fill (write), then the whole-grid add (read both, write): 4 passes over M x C float32."""
    return 4 * rows * channels * 4


def sparse_bytes(samples: int, channels: int) -> int:
    """The 4 K rows read in the forward, then read and written again when their gradient is added."""
    return 3 * 4 * samples * channels * 4


def bench(device: torch.device, side: int, channels: int, samples: int, timer: Timer) -> dict:
    copy = measure_copy(timer, (1 << 30) if device.type == "cuda" else (1 << 26))
    torch.manual_seed(0)
    grid = VoxelGrid((side, side, side), channels, init_std=0.1).to(device)
    grid.grid.grad = torch.randn_like(grid.grid)  # the lookups' dense gradient, already there
    rows = side**3
    results = []
    cells = (side - 1) ** 3

    def indexed(row_grads: RowGradients | None):
        def run(i: int) -> None:
            grid.total_variation(samples, rows=row_grads).backward()
            if row_grads is not None:
                row_grads.scatter()

        return run

    def fused(i: int) -> None:
        drawn = torch.randint(cells, (samples,), device=device)
        flat = grid.grid.detach().view(-1, channels)
        cuda_ext.sampled_tv(grid.grid.grad.view(-1, channels), flat, drawn, (side,) * 3, None, 1.0, 1.0, False)

    variants = [
        ("dense (indexing)", indexed(None), dense_bytes(rows, channels)),
        ("rows (RowGradients)", indexed(RowGradients()), sparse_bytes(samples, channels)),
    ]
    if cuda_ext.has_extension():
        variants.append(("op (sampled_tv)", fused, sparse_bytes(samples, channels)))
    results = []
    for variant, run, nbytes in variants:
        timing = timer(run, lambda i: None, 1)
        gbps = nbytes / timing["ms"] / 1e6
        results.append(
            {"variant": variant, "bytes": nbytes, **timing, "GBps": gbps, "pct_copy": 100 * gbps / copy["GBps"]}
        )
        assert not grid.grid.grad.is_sparse  # added onto the dense gradient, as in training
    for result in results[1:]:
        result["speedup_vs_dense"] = results[0]["ms"] / result["ms"]
    return {"copy": copy, "results": results}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", type=int, default=None, help="grid side (default 320 cuda, 32 cpu)")
    p.add_argument("--channels", type=int, default=12)
    p.add_argument("--samples", type=int, default=65536, help="voxels per TV estimate (model.tv_samples)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 30 cuda, 3 cpu)")
    p.add_argument("--budget-s", type=float, default=2.0, help="stop repeating a measurement after this long")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    args.size = args.size or (320 if args.device == "cuda" else 32)
    args.repeats = args.repeats or (30 if args.device == "cuda" else 3)
    if args.size < 2 or args.channels < 1 or args.samples < 1 or args.repeats < 1:
        p.error("--size must be >= 2; --channels, --samples and --repeats >= 1")
    if args.samples >= (args.size - 1) ** 3:
        p.error(f"--samples must be below the grid's {(args.size - 1) ** 3} cells (more: the whole-grid TV)")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Runs the benchmark, prints a table; returns the report (also written to --json)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    timer = bench_timer(device, args.repeats, args.budget_s)
    measured = bench(device, args.size, args.channels, args.samples, timer)
    report = {
        **report_header(device),
        "grid": {"size": args.size, "rows": args.size**3, "channels": args.channels, "dtype": "float32"},
        "samples": args.samples,
        "bytes_rule": "dense: 4*M*C*4 (zero-fill, whole-grid add); sparse: 3*4*K*C*4 (rows read, then added)",
        **measured,
    }
    print_header(report, report["copy"]["GBps"])
    print(f"grid {args.size}^3 x {args.channels} float32, TV on {args.samples} voxels")
    for r in report["results"]:
        speedup = f"  {r['speedup_vs_dense']:6.1f}x dense" if "speedup_vs_dense" in r else ""
        print(f"{r['variant']:22s} {r['ms']:9.3f} ms  {r['GBps']:8.1f} GB/s  {r['pct_copy']:5.1f}% copy{speedup}")
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
