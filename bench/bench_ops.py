#!/usr/bin/env python3
"""Op benchmark: every cuda_ext op, forward and forward+backward, custom vs reference vs PyTorch built-in.

Prints ms, GB/s and % of the device-to-device copy bandwidth measured in the same run, checks the
issue's targets (ratios from this run only), writes JSON and optionally a Markdown table.
One op failing (unwritten kernel, crash, out of memory) is recorded as an error and the run goes on.
See bench/README.md for how to run it and how bytes are counted.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_cases, bench_timing beside this file

from bench_brick_cases import RULE as BRICK_RULE  # noqa: E402
from bench_brick_cases import brick_cases  # noqa: E402
from bench_cases import (  # noqa: E402
    CASE_BUILDERS,
    COUNTING_RULES,
    DTYPE,
    SIZES,
    Case,
    Ops,
    grid_cases,
    ray_points,  # noqa: F401  (tests reach it through this module)
)
from bench_render_cases import DISTORTION_RULE, distortion_cases, render_cases  # noqa: E402
from bench_render_cases import RULE as RENDER_RULE  # noqa: E402
from bench_report import derive, evaluate_targets, render  # noqa: E402
from bench_timing import Timer, _no_reset, cache_bytes, measure_copy, rotation_sets  # noqa: E402

# custom-in-order: the grid lookup with CUDA_EXT_GRID_REORDER=off (points always visited as given), to show
# what the bucket order gains on grids larger than L2
# former: the model's PyTorch compositing that volume_render replaced, and the training step's distortion loss
# that distortion_loss replaced (models/render.py's segmented scans)
VARIANTS = ("custom", "custom-in-order", "reference", "builtin", "former")
OPS = (
    "trilinear",
    "grid_interpolate",
    "brick_grid_interpolate",
    "upsample",
    "gelu",
    "gelu_rows",
    "volume_render",
    "distortion_loss",
)
CASE_BUILDERS = {
    **CASE_BUILDERS,
    "brick_grid_interpolate": brick_cases,
    "volume_render": render_cases,
    "distortion_loss": distortion_cases,
}
COUNTING_RULES = {
    **COUNTING_RULES,
    "brick_grid_interpolate": BRICK_RULE,
    "volume_render": RENDER_RULE,
    "distortion_loss": DISTORTION_RULE,
}
OP_ALIASES = {"grid": "grid_interpolate", "brick": "brick_grid_interpolate"}  # --ops grid still works


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.double() - ref.double()).norm()
    return float(diff / ref.double().norm().clamp(min=1e-30))


def run_case(case: Case, variants: Sequence[str], timer: Timer, device: torch.device, errors: list) -> list[dict]:
    gen = torch.Generator(device=device)
    gen.manual_seed(0)
    first = case.make_inputs(gen)
    grad0 = torch.randn(case.out_shape, generator=gen, device=device, dtype=DTYPE)
    set_bytes = sum(t.nbytes for t in first) + grad0.nbytes
    n_sets = rotation_sets(set_bytes, cache_bytes(device))
    sets = [(first, grad0)] + [
        (case.make_inputs(gen), torch.randn(case.out_shape, generator=gen, device=device, dtype=DTYPE))
        for _ in range(n_sets - 1)
    ]
    try:
        with torch.no_grad():
            expected: Optional[torch.Tensor] = case.variants["reference"].call(*first)
    except Exception:  # its own row records the failure when the reference is benchmarked
        expected = None

    def record(variant: str, phase: str, exc: BaseException) -> None:
        errors.append(
            {
                "op": case.op,
                "case": case.name,
                "variant": variant,
                "phase": phase,
                "error": _error_text(exc),
                "traceback": traceback.format_exc(limit=4),
            }
        )

    rows = []
    for name in variants:
        if name not in case.variants:
            continue
        v = case.variants[name]
        row: dict[str, Any] = {
            "op": case.op,
            "case": case.name,
            "shape": case.shape,
            "variant": name,
            "bytes_fw": case.bytes_fw,
            "bytes_bw": case.bytes_bw,
            "input_sets": n_sets,
            "fw": None,
            "fwbw": None,
            "bw_op": None,
            "rel_err_vs_reference": None,
        }
        rows.append(row)
        try:
            args = [tuple(t.detach().requires_grad_(g) for t, g in zip(v.adapt(x), case.grad_inputs)) for x, _ in sets]
            grads = [v.grad_from_canonical(g) for _, g in sets]
        except Exception as exc:
            record(name, "setup", exc)
            continue

        # this variant's v, args and grads bound now (the closures run inside this iteration only)
        def forward(i: int, v=v, args=args) -> None:
            with torch.no_grad():
                v.call(*args[i % n_sets])

        def forward_backward(i: int, v=v, args=args, grads=grads) -> None:
            v.call(*args[i % n_sets]).backward(grads[i % n_sets])

        def clear_grads(i: int, args=args) -> None:
            for t in args[i % n_sets]:
                t.grad = None

        def backward_only(i: int) -> None:
            case.custom_backward(sets[i % n_sets][1], sets[i % n_sets][0])

        phases = [("fw", forward, _no_reset), ("fwbw", forward_backward, clear_grads)]
        if name == "custom" and case.custom_backward is not None:
            phases.append(("bw_op", backward_only, _no_reset))
        for phase, run, reset in phases:
            try:
                if phase == "fw" and expected is not None and name != "reference":
                    with torch.no_grad():
                        row["rel_err_vs_reference"] = _relative_error(v.out_to_canonical(v.call(*args[0])), expected)
                row[phase] = timer(run, reset, n_sets)
            except Exception as exc:
                record(name, phase, exc)
                if phase == "fw":
                    break  # forward+backward cannot work either
            finally:
                for i in range(n_sets):
                    clear_grads(i)
        del args, grads
        _release(device)
    return rows


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception:
            pass  # a failed kernel reports its error here too; its phase already recorded it
        torch.cuda.empty_cache()


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {
            "type": "cuda",
            "name": p.name,
            "sms": p.multi_processor_count,
            "memory_bytes": p.total_memory,
            "l2_bytes": getattr(p, "L2_cache_size", None),
            "cuda": torch.version.cuda,
        }
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}


def default_json_path(info: dict, date: str) -> Path:
    kind = "cpu" if info["type"] == "cpu" else re.sub(r"[^a-z0-9]+", "-", info["name"].lower()).strip("-")
    return REPO / "bench" / "results" / f"{kind}-{date}.json"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--ops",
        default=",".join(OPS),
        help=f"comma-separated subset of {','.join(OPS)} (grid: grid_interpolate, brick: brick_grid_interpolate)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help="default: full on cuda, small on cpu")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 50 cuda, 10 cpu)")
    p.add_argument("--budget-s", type=float, default=2.0, help="stop repeating a measurement after this long")
    p.add_argument(
        "--grid-channels",
        default=None,
        help="comma-separated channel counts for grid_interpolate (default: the size's own, 12 at full size)",
    )
    p.add_argument("--json", type=Path, default=None, help="default bench/results/<device-kind>-<date>.json")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    args = p.parse_args(argv)
    for option, allowed in (("ops", OPS), ("variants", VARIANTS)):
        chosen = [
            OP_ALIASES.get(x.strip(), x.strip()) if option == "ops" else x.strip()
            for x in getattr(args, option).split(",")
            if x.strip()
        ]
        unknown = sorted(set(chosen) - set(allowed))
        if unknown or not chosen:
            p.error(f"--{option}: unknown or empty {unknown}; choose from {','.join(allowed)}")
        setattr(args, option, chosen)
    if args.grid_channels is not None:
        try:
            args.grid_channels = [int(x) for x in args.grid_channels.split(",") if x.strip()]
        except ValueError:
            p.error(f"--grid-channels: expected comma-separated integers, got {args.grid_channels!r}")
        if not args.grid_channels or min(args.grid_channels) < 1:
            p.error("--grid-channels: expected one or more channel counts >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    args.size = args.size or ("full" if args.device == "cuda" else "small")
    args.repeats = args.repeats or (50 if args.device == "cuda" else 10)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Runs the benchmark; returns the report that it also writes as JSON."""
    args = parse_args(argv)
    device = torch.device(args.device)
    sizes = SIZES[args.size]
    ops = Ops()
    timer = Timer(device, warmup=3 if device.type == "cuda" else 2, repeats=args.repeats, budget_s=args.budget_s)
    info = device_info(device)
    date = datetime.date.today().isoformat()
    errors: list[dict] = []
    if ops.import_error:
        errors.append({"op": "*", "case": "*", "variant": "custom", "phase": "import", "error": ops.import_error})

    copy = measure_copy(timer, sizes.copy_bytes)
    _release(device)
    print(f"copy: {copy['GBps']:.0f} GB/s ({copy['ms']:.3f} ms for {copy['bytes'] >> 20} MiB read+write)", flush=True)
    rows: list[dict] = []
    for op in args.ops:
        try:
            if op == "grid_interpolate" and args.grid_channels:
                cases = [case for c in args.grid_channels for case in grid_cases(sizes, ops, c)]
            else:
                cases = CASE_BUILDERS[op](sizes, ops)
        except Exception as exc:
            errors.append({"op": op, "case": "*", "variant": "*", "phase": "setup", "error": _error_text(exc)})
            continue
        for case in cases:
            try:
                new = run_case(case, args.variants, timer, device, errors)
            except Exception as exc:  # input generation failed (e.g. out of memory): skip the case
                errors.append(
                    {"op": op, "case": case.name, "variant": "*", "phase": "inputs", "error": _error_text(exc)}
                )
                _release(device)
                continue
            for r in new:
                timed = [f"{k} {r[k]['ms']:.3f} ms" for k in ("fw", "fwbw", "bw_op") if r[k]]
                print(f"{op} {case.name} {r['variant']}: {', '.join(timed) or 'error'}", flush=True)
            rows += new
    derive(rows, copy["GBps"])
    report = {
        "date": date,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": info,
        "size": args.size,
        "sizes": vars(sizes),
        "grid_channels": args.grid_channels,
        "variants": args.variants,
        "extension": {
            "imported": ops.ext is not None,
            "has_cuda_kernels": bool(ops.ext and ops.ext.has_cuda_kernels()),
        },
        "copy": copy,
        "counting_rules": COUNTING_RULES,
        "results": rows,
        "targets": evaluate_targets(rows, device.type, args.size),
        "errors": errors,
    }
    path = args.json or default_json_path(info, date)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render(report, markdown=True) + "\n")
    print("\n" + render(report, markdown=False) + f"\n\nJSON: {path}", flush=True)
    return report


if __name__ == "__main__":
    main()
