"""Benchmark of cuda_ext.sparse_adam_step (masked Adam on the touched rows) and masked_adam_step (on the elements
whose gradient is non-zero) vs dense torch.optim.Adam.

    python3 bench/bench_sparse_adam.py [--device cuda|cpu] [--size 256] [--channels 13] [--fractions 0.01,0.1]
                                       [--json OUT.json]

A (size^3, C) float32 grid (default 256^3 x 13 on CUDA, 32^3 x 13 on the CPU), K = fraction * M random distinct
rows, sorted (as SparseGridAdam's nonzero() hands them over). Reported per variant: median ms, GB/s on the bytes
it must move, % of the device's copy bandwidth (a large tensor copy, bench_timing.measure_copy), and the speed-up
over dense Adam (fused=True on CUDA, foreach=True on the CPU). Bytes: sparse K*C*4 * 7 (read param, grad, m, v;
write param, m, v) + 8*K (rows); dense M*C*4 * 7; masked (train.sparse_adam=nonzero: the gradient zero outside
the K rows, no list) M*C*4 + K*C*4 * 6 (the whole gradient read; param, m, v read and written on the K rows). Two sparse
timings: the raw op (the kernel and its launch) and the wrapper, which also checks rows' range (one reduction and
one host sync per call); a third, the op with ``clear_grad`` (+ K*C*4: the rows' gradient left zero, as
``train.sparse_adam=occupied`` keeps it). Two more masked timings leave the gradient zero for the next step, as
training must: a fill of the whole gradient after the step (+ M*C*4: a fresh zero gradient each step) against
``clear_grad`` (+ K*C*4: zeros written where the step read a non-zero pack; the kept gradient, cuda_ext.kept_grad).
Row sets rotate so that the touched rows of one call are not still in the cache at the next (as bench_ops does).
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

from bench_timing import (  # noqa: E402
    Timer,
    bench_timer,
    cache_bytes,
    measure_copy,
    print_header,
    report_header,
    rotation_sets,
    write_report,
)

import cuda_ext  # noqa: E402

HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.99, "eps": 1e-15}


def sparse_bytes(k: int, channels: int, itemsize: int = 4, clear: bool = False) -> int:
    """Read param, grad, m, v and write param, m, v on the K rows, and the rows; ``clear``: the rows' zeros too."""
    return (8 if clear else 7) * k * channels * itemsize + 8 * k


def dense_bytes(m: int, channels: int, itemsize: int = 4) -> int:
    return 7 * m * channels * itemsize


def _row(variant: str, fraction: float, k: int, nbytes: int, timing: dict, copy_gbps: float) -> dict:
    gbps = nbytes / timing["ms"] / 1e6
    return {
        "variant": variant,
        "fraction": fraction,
        "rows": k,
        "bytes": nbytes,
        **timing,
        "GBps": gbps,
        "pct_copy": 100 * gbps / copy_gbps,
    }


def time_dense(param: torch.Tensor, grad: torch.Tensor, timer: Timer) -> tuple[dict, str]:
    """torch.optim.Adam on the whole grid (a copy of the same values): fused on CUDA, foreach on the CPU."""
    dense = torch.nn.Parameter(param.clone())
    dense.grad = grad.clone()
    kind = "fused" if param.is_cuda else "foreach"
    betas = (HYPER["beta1"], HYPER["beta2"])
    optimizer = torch.optim.Adam([dense], lr=HYPER["lr"], betas=betas, eps=HYPER["eps"], **{kind: True})
    return timer(lambda i: optimizer.step(), lambda i: None, 1), f"dense Adam ({kind})"


def bench(device: torch.device, side: int, channels: int, fractions: Sequence[float], timer: Timer) -> dict:
    copy = measure_copy(timer, (1 << 30) if device.type == "cuda" else (1 << 26))
    m = side**3
    generator = torch.Generator(device=device).manual_seed(0)
    param = torch.randn(m, channels, device=device, generator=generator)
    grad = torch.randn(m, channels, device=device, generator=generator)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step = {"n": 0}

    dense_timing, dense_name = time_dense(param, grad, timer)
    rows = [_row(dense_name, 1.0, m, dense_bytes(m, channels), dense_timing, copy["GBps"])]
    if device.type == "cuda":
        torch.cuda.empty_cache()

    cleared = grad.clone()  # the clearing step's gradient: its rows written back from grad, untimed

    def run_op(picks, wrapper: bool, clear: bool):
        fn = cuda_ext.sparse_adam_step if wrapper else torch.ops.cuda_ext.sparse_adam_step
        g = cleared if clear else grad

        def run(i: int) -> None:
            step["n"] += 1
            fn(param, g, exp_avg, exp_avg_sq, picks[i % len(picks)], step["n"], *HYPER.values(), clear_grad=clear)

        return run

    def restore(picks, clear: bool):
        def reset(i: int) -> None:
            if clear:
                rows = picks[i % len(picks)]
                cleared[rows] = grad[rows]

        return reset

    for fraction in fractions:
        k = max(1, int(m * fraction))
        sets = rotation_sets(4 * k * channels * 4, cache_bytes(device))
        picks = [torch.randperm(m, device=device, generator=generator)[:k].sort().values for _ in range(sets)]
        for variant, wrapper, clear in (
            ("sparse op", False, False),
            ("sparse wrapper", True, False),
            ("sparse op, clear_grad", False, True),
        ):
            timing = timer(run_op(picks, wrapper, clear), restore(picks, clear), sets)
            row = _row(variant, fraction, k, sparse_bytes(k, channels, clear=clear), timing, copy["GBps"])
            row["speedup_vs_dense"] = dense_timing["ms"] / timing["ms"]
            row["row_sets"] = sets
            rows.append(row)
        timing = time_masked(param, grad, picks, timer)
        row = _row("masked by gradient", fraction, k, masked_bytes(m, k, channels), timing, copy["GBps"])
        row["speedup_vs_dense"] = dense_timing["ms"] / timing["ms"]
        rows.append(row)
        for variant, clear in (("masked + zero fill", False), ("masked, clear_grad", True)):
            timing = time_masked(param, grad, picks, timer, clear=clear)
            row = _row(variant, fraction, k, masked_bytes(m, k, channels, clear=clear), timing, copy["GBps"])
            row["speedup_vs_dense"] = dense_timing["ms"] / timing["ms"]
            rows.append(row)
    return {"copy": copy, "results": rows}


def masked_bytes(m: int, k: int, channels: int, itemsize: int = 4, clear: Optional[bool] = None) -> int:
    """The step's bytes; ``clear``: with the gradient left zero for the next step, by a fill of all of it (False)
    or by zeros written on the K rows (True, ``clear_grad``)."""
    zeroing = 0 if clear is None else (k if clear else m) * channels * itemsize
    return m * channels * itemsize + 6 * k * channels * itemsize + zeroing


def time_masked(
    param: torch.Tensor, grad: torch.Tensor, picks: list, timer: Timer, clear: Optional[bool] = None
) -> dict:
    """masked_adam_step over the whole grid, its gradient non-zero on one of the row sets only (each set its own
    gradient tensor: the sets rotate through memory as the listed variants' do). ``clear``: also leave the gradient
    zero for the next step, as training does: a fill of the whole gradient after the step (False, a fresh zero
    gradient's cost) or ``clear_grad`` (True, the kept gradient's); its rows are written back untimed."""
    grads = []
    for rows in picks:
        sparse = torch.zeros_like(grad)
        sparse[rows] = grad[rows]
        grads.append(sparse)
    exp_avg, exp_avg_sq, step = torch.zeros_like(param), torch.zeros_like(param), {"n": 0}

    def run(i: int) -> None:
        step["n"] += 1
        g = grads[i % len(grads)]
        torch.ops.cuda_ext.masked_adam_step(
            param, g, exp_avg, exp_avg_sq, step["n"], *HYPER.values(), clear_grad=bool(clear)
        )
        if clear is False:
            g.zero_()

    def reset(i: int) -> None:
        if clear is not None:
            rows = picks[i % len(picks)]
            grads[i % len(grads)][rows] = grad[rows]

    return timer(run, reset, len(picks))


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--size", type=int, default=None, help="grid side: M = size^3 rows (default 256 cuda, 32 cpu)")
    p.add_argument("--channels", type=int, default=13)
    p.add_argument("--fractions", default="0.01,0.1", help="comma-separated fractions of the rows touched")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 50 cuda, 5 cpu)")
    p.add_argument("--budget-s", type=float, default=2.0, help="stop repeating a measurement after this long")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    args.size = args.size or (256 if args.device == "cuda" else 32)
    args.repeats = args.repeats or (50 if args.device == "cuda" else 5)
    try:
        args.fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    except ValueError:
        p.error(f"--fractions: expected comma-separated numbers, got {args.fractions!r}")
    if not args.fractions or not all(0 < f <= 1 for f in args.fractions):
        p.error("--fractions: each must be in (0, 1]")
    if args.size < 1 or args.channels < 1 or args.repeats < 1:
        p.error("--size, --channels and --repeats must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Runs the benchmark, prints a table; returns the report (also written to --json)."""
    args = parse_args(argv)
    device = torch.device(args.device)
    timer = bench_timer(device, args.repeats, args.budget_s)
    measured = bench(device, args.size, args.channels, args.fractions, timer)
    report = {
        **report_header(device),
        "grid": {"size": args.size, "rows": args.size**3, "channels": args.channels, "dtype": "float32"},
        "hyper": HYPER,
        "bytes_rule": "sparse: 7*K*C*4 + 8*K (read param, grad, m, v; write param, m, v; rows); dense: 7*M*C*4; "
        "masked: M*C*4 + 6*K*C*4 (the whole gradient; param, m, v on the K rows); + zero fill: + M*C*4; "
        "clear_grad (sparse and masked): + K*C*4",
        **measured,
    }
    print_header(report, report["copy"]["GBps"])
    print(f"grid {args.size}^3 x {args.channels} float32 ({args.size**3} rows)")
    for r in report["results"]:
        speedup = f"  {r['speedup_vs_dense']:6.1f}x dense" if "speedup_vs_dense" in r else ""
        print(
            f"{r['variant']:20s} {r['fraction']:6.1%} {r['rows']:>10d} rows  {r['ms']:9.3f} ms  "
            f"{r['GBps']:8.1f} GB/s  {r['pct_copy']:5.1f}% copy{speedup}"
        )
    write_report(report, args.json)
    return report


if __name__ == "__main__":
    main()
