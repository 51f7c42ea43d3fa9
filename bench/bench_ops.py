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
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
# custom-in-order: the grid lookup with CUDA_EXT_GRID_REORDER=off (points always visited as given), to show
# what the bucket order gains on grids larger than L2
VARIANTS = ("custom", "custom-in-order", "reference", "builtin")
OPS = ("trilinear", "grid_interpolate", "upsample", "gelu")
OP_ALIASES = {"grid": "grid_interpolate"}  # --ops grid still works
DTYPE = torch.float32
CPU_CACHE_BYTES = 32 << 20  # assumed last-level cache of a CPU host; CUDA reads the L2 size from the device
MAX_REL_ERR = 1e-4  # fp32 forward vs the reference; above this a row's timing is of a wrong answer


@dataclass(frozen=True)
class Sizes:
    trilinear: tuple[int, int]  # N points, F features
    grid_interpolate: tuple[int, int, int]  # R (cube side), C channels, N points
    samples_per_ray: int  # "rays" distribution: N / samples_per_ray rays
    upsample: tuple[int, int, int, int]  # B, C, H, W (scale 2)
    gelu: int  # elements
    copy_bytes: int  # size of the bandwidth-reference copy


SIZES = {
    "full": Sizes((262144, 256), (160, 12, 4096 * 1024), 1024, (8, 64, 256, 256), 1 << 28, 1 << 30),
    "small": Sizes((32768, 64), (64, 12, 192 * 1024), 1024, (2, 16, 128, 128), 1 << 22, 1 << 28),
    "tiny": Sizes((512, 16), (12, 4, 64 * 64), 64, (1, 2, 16, 16), 1 << 14, 1 << 22),
}

COUNTING_RULES = {
    "general": "bytes floor: each input read once, each output written once (fp32 = 4 B); fwbw counts both passes; "
    "GB/s = bytes / time; % copy = GB/s over the copy bandwidth of this run (a device-to-device copy, read + write)",
    "trilinear": "fw: feats + points + out; bw with grad=feats: grad_out + points + grad_feats; "
    "grad=feats+points adds feats + grad_points",
    "grid_interpolate": "compulsory bytes only: fw: grid once + points + out; "
    "bw (grad=grid): grad_out + points + grad_grid once; random gathers and scattered atomics move more than this",
    "upsample": "fw: in + out; bw: grad_out + grad_in",
    "gelu": "fw: in + out; bw: grad_out + x + grad_x",
    "bw_ms": "the backward op timed alone where the custom op has one (marked * in the table), else fwbw - fw",
    "builtin": "F.grid_sample gets its (1,C,R0,R1,R2) grid and flipped (1,N,1,1,3) points made once outside the timing",
}


# ----------------------------------------------------------------------------------------------- ops


class Ops:
    """The three implementations; attributes are looked up at call time, so patched or rebuilt ops are seen."""

    def __init__(self) -> None:
        if str(REPO) not in sys.path:
            sys.path.append(str(REPO))
        try:
            import cuda_ext

            self.ext: Any = cuda_ext
            self.reference: Any = cuda_ext.reference
            self.import_error: Optional[str] = None
        except Exception as exc:  # extension not built: the references still load, from their file
            spec = importlib.util.spec_from_file_location("cuda_ext_reference", REPO / "cuda_ext" / "reference.py")
            self.reference = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(self.reference)
            self.ext, self.import_error = None, f"{type(exc).__name__}: {exc}"

    def custom(self, name: str, *extra: Any) -> Callable[..., torch.Tensor]:
        def call(*args: torch.Tensor) -> torch.Tensor:
            if self.ext is None:
                raise RuntimeError(f"cuda_ext did not import: {self.import_error}")
            return getattr(self.ext, name)(*args, *extra)

        return call

    def custom_with_env(self, name: str, **env: str) -> Callable[..., torch.Tensor]:
        """The custom op called with environment variables set for the call (read by the C++ side)."""
        call = self.custom(name)

        def with_env(*args: torch.Tensor) -> torch.Tensor:
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            try:
                return call(*args)
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value

        return with_env

    def ref(self, name: str, *extra: Any) -> Callable[..., torch.Tensor]:
        return lambda *args: getattr(self.reference, name)(*args, *extra)

    def backward_op(self, name: str) -> Callable[..., Any]:
        return lambda *args: getattr(torch.ops.cuda_ext, f"{name}_backward")(*args)


# ----------------------------------------------------------------------------------------------- inputs


def uniform_points(n: int, gen: torch.Generator) -> torch.Tensor:
    """(n, 3) points uniform in [-1, 1]^3: the worst case for a grid lookup's caches."""
    return torch.rand(n, 3, generator=gen, device=gen.device, dtype=DTYPE) * 2 - 1


def ray_points(n_rays: int, samples: int, gen: torch.Generator) -> torch.Tensor:
    """(n_rays * samples, 3) points sorted along rays, ray-major, as a NeRF sampler makes them.

    Origins are uniform on the sphere of radius 1.5; each ray aims at a random point of [-0.5, 0.5]^3
    (a camera looking at the centre); samples are evenly spaced over the ray's segment inside [-1, 1]^3.
    """
    kw = dict(generator=gen, device=gen.device, dtype=DTYPE)
    origin = torch.randn(n_rays, 3, **kw)
    origin = 1.5 * origin / origin.norm(dim=1, keepdim=True)
    direction = F.normalize(torch.rand(n_rays, 3, **kw) - 0.5 - origin, dim=1)
    t_a, t_b = (-1 - origin) / direction, (1 - origin) / direction  # slab test against the box
    t_near = torch.minimum(t_a, t_b).amax(dim=1).clamp(min=0)  # origins inside the box start at t=0
    t_far = torch.maximum(t_a, t_b).amin(dim=1)
    frac = (torch.arange(samples, device=gen.device, dtype=DTYPE) + 0.5) / samples
    t = t_near[:, None] + (t_far - t_near)[:, None] * frac
    points = origin[:, None, :] + t[..., None] * direction[:, None, :]
    return points.reshape(-1, 3).clamp(-1, 1).contiguous()


# ----------------------------------------------------------------------------------------------- cases


def _identity(x: Any) -> Any:
    return x


@dataclass
class Variant:
    """One implementation of a case, with its layout glue (done once, outside the timing)."""

    call: Callable[..., torch.Tensor]  # call(*args) -> output
    adapt: Callable[[tuple], tuple] = _identity  # canonical inputs -> this variant's args, same order
    out_to_canonical: Callable[[torch.Tensor], torch.Tensor] = _identity  # for the check against the reference
    grad_from_canonical: Callable[[torch.Tensor], torch.Tensor] = _identity


@dataclass
class Case:
    op: str
    name: str  # short key, e.g. "random" or "grad=feats"
    shape: str  # the sizes, for people
    make_inputs: Callable[[torch.Generator], tuple]  # one random input set, canonical layout
    out_shape: tuple[int, ...]
    grad_inputs: tuple[bool, ...]  # which inputs get gradients in forward+backward
    variants: dict[str, Variant]
    custom_backward: Optional[Callable[[torch.Tensor, tuple], Any]]  # the custom backward op alone: (grad_out, inputs)
    bytes_fw: int
    bytes_bw: int


def trilinear_cases(s: Sizes, ops: Ops) -> list[Case]:
    n, f = s.trilinear
    e = DTYPE.itemsize
    variants = {"custom": Variant(ops.custom("trilinear_interpolate")),
                "reference": Variant(ops.ref("trilinear_interpolate"))}

    def make(gen: torch.Generator) -> tuple:
        return torch.randn(n, 8, f, generator=gen, device=gen.device, dtype=DTYPE), uniform_points(n, gen)

    def case(grad_points: bool) -> Case:
        backward = ops.backward_op("trilinear_interpolate")
        extra = (8 * n * f + 3 * n) * e if grad_points else 0
        return Case(
            "trilinear", "grad=feats+points" if grad_points else "grad=feats", f"N={n} F={f}", make, (n, f),
            (True, grad_points), variants, lambda g, x: backward(g, x[0], x[1], True, grad_points),
            bytes_fw=(8 * n * f + 3 * n + n * f) * e, bytes_bw=(n * f + 3 * n + 8 * n * f) * e + extra,
        )

    return [case(False), case(True)]


def grid_cases(s: Sizes, ops: Ops, channels: Optional[int] = None) -> list[Case]:
    """The random and rays cases at the size's channel count, or at `channels` (case names then say C=...)."""
    r, c, n = s.grid_interpolate
    suffix = "" if channels is None or channels == c else f" C={channels}"
    c = c if channels is None else channels
    e = DTYPE.itemsize
    builtin = Variant(
        lambda grid5, points5: F.grid_sample(grid5, points5, mode="bilinear", padding_mode="border",
                                             align_corners=True),
        adapt=lambda x: (x[0].permute(3, 0, 1, 2)[None].contiguous(), x[1].flip(-1).reshape(1, -1, 1, 1, 3)),
        out_to_canonical=lambda out: out.reshape(c, -1).t(),
        grad_from_canonical=lambda g: g.t().reshape(1, c, -1, 1, 1).contiguous(),
    )
    variants = {"custom": Variant(ops.custom("grid_interpolate")),
                "custom-in-order": Variant(ops.custom_with_env("grid_interpolate", CUDA_EXT_GRID_REORDER="off")),
                "reference": Variant(ops.ref("grid_interpolate")), "builtin": builtin}
    backward = ops.backward_op("grid_interpolate")
    distributions = {
        "random": lambda gen: uniform_points(n, gen),
        "rays": lambda gen: ray_points(n // s.samples_per_ray, s.samples_per_ray, gen),
    }

    def case(name: str, points: Callable[[torch.Generator], torch.Tensor]) -> Case:
        def make(gen: torch.Generator) -> tuple:
            return torch.randn(r, r, r, c, generator=gen, device=gen.device, dtype=DTYPE), points(gen)

        rays = f" ({n // s.samples_per_ray} rays x {s.samples_per_ray})" if name == "rays" else ""
        shape = f"{r}^3x{c} N={n}{rays}"
        return Case(
            "grid_interpolate", name, shape, make, (n, c), (True, False), variants,
            lambda g, x: backward(g, x[0], x[1], True, False),
            bytes_fw=(r**3 * c + 3 * n + n * c) * e, bytes_bw=(n * c + 3 * n + r**3 * c) * e,
        )

    return [case(name + suffix, points) for name, points in distributions.items()]


def upsample_cases(s: Sizes, ops: Ops) -> list[Case]:
    b, c, h, w = s.upsample
    scale, elems = 2, b * c * h * w
    backward = ops.backward_op("upsample_bilinear2d")
    variants = {
        "custom": Variant(ops.custom("upsample_bilinear2d", scale, False)),
        "reference": Variant(ops.ref("upsample_bilinear2d", scale, False)),
        "builtin": Variant(lambda x: F.interpolate(x, scale_factor=scale, mode="bilinear", align_corners=False)),
    }
    total = (elems + scale * scale * elems) * DTYPE.itemsize
    return [Case(
        "upsample", f"x{scale}", f"({b},{c},{h},{w})",
        lambda gen: (torch.randn(b, c, h, w, generator=gen, device=gen.device, dtype=DTYPE),),
        (b, c, h * scale, w * scale), (True,), variants, lambda g, x: backward(g, h, w, scale, False),
        bytes_fw=total, bytes_bw=total,
    )]


def gelu_cases(s: Sizes, ops: Ops) -> list[Case]:
    n = s.gelu
    backward = ops.backward_op("gelu")
    variants = {
        "custom": Variant(ops.custom("gelu", "none")),
        "reference": Variant(ops.ref("gelu", "none")),
        "builtin": Variant(lambda x: F.gelu(x, approximate="none")),
    }
    return [Case(
        "gelu", "exact", f"2^{int(math.log2(n))}" if n & (n - 1) == 0 else f"N={n}",
        lambda gen: (torch.randn(n, generator=gen, device=gen.device, dtype=DTYPE),),
        (n,), (True,), variants, lambda g, x: backward(g, x[0], "none"),
        bytes_fw=2 * n * DTYPE.itemsize, bytes_bw=3 * n * DTYPE.itemsize,
    )]


CASE_BUILDERS = {"trilinear": trilinear_cases, "grid_interpolate": grid_cases, "upsample": upsample_cases,
                 "gelu": gelu_cases}


# ----------------------------------------------------------------------------------------------- timing


@dataclass
class Timer:
    device: torch.device
    warmup: int
    repeats: int
    budget_s: float  # stop repeating after this long (at least MIN_RUNS runs)

    MIN_RUNS = 3

    def __call__(self, run: Callable[[int], Any], reset: Callable[[int], None], n_sets: int) -> dict:
        """Median ms of repeated ``run(i)`` (i picks the input set); ``reset(i)`` runs untimed before each."""
        for i in range(max(self.warmup, n_sets if self.device.type == "cuda" else 1)):
            reset(i)
            run(i)
        self._sync()
        times: list[float] = []
        start = time.perf_counter()
        i = 0
        while len(times) < self.repeats:
            chunk = min(10, self.repeats - len(times))
            timed_chunk = self._cuda_chunk if self.device.type == "cuda" else self._cpu_chunk
            times += timed_chunk(run, reset, i, chunk)
            i += chunk
            if len(times) >= self.MIN_RUNS and time.perf_counter() - start > self.budget_s:
                break
        q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
        median = statistics.median(times)
        return {"ms": median, "min_ms": min(times), "iqr_pct": 100 * (q[2] - q[0]) / median, "runs": len(times)}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @staticmethod
    def _cuda_chunk(run: Callable[[int], Any], reset: Callable[[int], None], first: int, count: int) -> list[float]:
        events = []
        for i in range(first, first + count):
            reset(i)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run(i)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in events]

    @staticmethod
    def _cpu_chunk(run: Callable[[int], Any], reset: Callable[[int], None], first: int, count: int) -> list[float]:
        times = []
        for i in range(first, first + count):
            reset(i)
            start = time.perf_counter()
            run(i)
            times.append(1e3 * (time.perf_counter() - start))
        return times


def _no_reset(i: int) -> None:
    pass


def measure_copy(timer: Timer, nbytes: int) -> dict:
    src = torch.randn(nbytes // 4, device=timer.device)
    dst = torch.empty_like(src)
    timing = timer(lambda i: dst.copy_(src), _no_reset, 1)
    return {"bytes": 2 * src.nbytes, "rule": "read + write", **timing, "GBps": 2 * src.nbytes / timing["ms"] / 1e6}


def cache_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    return CPU_CACHE_BYTES


def rotation_sets(set_bytes: int, cache: int) -> int:
    """Input sets to cycle through so a run never finds its inputs still in the cache."""
    return 1 if set_bytes >= 2 * cache else min(8, math.ceil(2 * cache / set_bytes) + 1)


# ----------------------------------------------------------------------------------------------- running


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
        errors.append({"op": case.op, "case": case.name, "variant": variant, "phase": phase,
                       "error": _error_text(exc), "traceback": traceback.format_exc(limit=4)})

    rows = []
    for name in variants:
        if name not in case.variants:
            continue
        v = case.variants[name]
        row: dict[str, Any] = {"op": case.op, "case": case.name, "shape": case.shape, "variant": name,
                               "bytes_fw": case.bytes_fw, "bytes_bw": case.bytes_bw, "input_sets": n_sets,
                               "fw": None, "fwbw": None, "bw_op": None, "rel_err_vs_reference": None}
        rows.append(row)
        try:
            args = [tuple(t.detach().requires_grad_(g) for t, g in zip(v.adapt(x), case.grad_inputs)) for x, _ in sets]
            grads = [v.grad_from_canonical(g) for _, g in sets]
        except Exception as exc:
            record(name, "setup", exc)
            continue

        def forward(i: int) -> None:
            with torch.no_grad():
                v.call(*args[i % n_sets])

        def forward_backward(i: int) -> None:
            v.call(*args[i % n_sets]).backward(grads[i % n_sets])

        def clear_grads(i: int) -> None:
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


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def derive(rows: list[dict], copy_gbps: float) -> None:
    """Adds bw ms, GB/s, % of copy bandwidth and the custom op's speed-up over every other variant."""
    for row in rows:
        fw, fwbw, bw_op = (row[k]["ms"] if row[k] else None for k in ("fw", "fwbw", "bw_op"))
        row["fw_ms"], row["fwbw_ms"] = fw, fwbw
        if bw_op is not None:
            row["bw_ms"], row["bw_source"] = bw_op, "op"
        elif fw is not None and fwbw is not None and fwbw > fw:
            row["bw_ms"], row["bw_source"] = fwbw - fw, "fwbw-fw"
        else:
            row["bw_ms"], row["bw_source"] = None, None
        for key, ms, nbytes in (("fw", fw, row["bytes_fw"]), ("bw", row["bw_ms"], row["bytes_bw"]),
                                ("fwbw", fwbw, row["bytes_fw"] + row["bytes_bw"])):
            gbps = nbytes / ms / 1e6 if ms else None
            row[f"{key}_GBps"] = gbps
            row[f"{key}_pct_copy"] = 100 * gbps / copy_gbps if gbps else None
    by_case: dict[tuple, dict[str, dict]] = {}
    for row in rows:
        by_case.setdefault((row["op"], row["case"]), {})[row["variant"]] = row
    for group in by_case.values():
        custom = group.get("custom")
        for name, row in group.items():
            row["custom_speedup"] = None if name == "custom" else {
                key: _ratio(row[f"{key}_ms"], custom[f"{key}_ms"]) if custom else None for key in ("fw", "fwbw", "bw")
            }


# ----------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    """A goal from the issue, evaluated on this run's numbers only."""

    name: str
    device: str  # "cuda" or "cpu"
    op: str
    case: str
    value: Callable[[Callable[[str, str], Optional[float]]], Optional[float]]  # (variant, field) lookup -> number
    threshold: float
    at_least: bool = True
    unit: str = "x"
    sizes: tuple[str, ...] = ("full",)  # where the goal applies; elsewhere the result is indicative


TARGETS = (
    Target("trilinear fw >= 85% of copy BW", "cuda", "trilinear", "grad=feats",
           lambda g: g("custom", "fw_pct_copy"), 85, unit="%"),
    Target("trilinear bw >= 80% of copy BW (backward op alone)", "cuda", "trilinear", "grad=feats",
           lambda g: g("custom", "bw_pct_copy"), 80, unit="%"),
    Target("grid_interpolate random fw >= 6x F.grid_sample", "cuda", "grid_interpolate", "random",
           lambda g: _ratio(g("builtin", "fw_ms"), g("custom", "fw_ms")), 6),
    Target("grid_interpolate random fwbw >= 6x F.grid_sample", "cuda", "grid_interpolate", "random",
           lambda g: _ratio(g("builtin", "fwbw_ms"), g("custom", "fwbw_ms")), 6),
    Target("upsample fwbw >= 1.5x F.interpolate", "cuda", "upsample", "x2",
           lambda g: _ratio(g("builtin", "fwbw_ms"), g("custom", "fwbw_ms")), 1.5),
    Target("gelu fw within 5% of F.gelu (time ratio)", "cuda", "gelu", "exact",
           lambda g: _ratio(g("custom", "fw_ms"), g("builtin", "fw_ms")), 1.05, at_least=False),
    Target("gelu fwbw within 5% of F.gelu (time ratio)", "cuda", "gelu", "exact",
           lambda g: _ratio(g("custom", "fwbw_ms"), g("builtin", "fwbw_ms")), 1.05, at_least=False),
    Target("CPU grid_interpolate random fwbw >= 2x reference", "cpu", "grid_interpolate", "random",
           lambda g: _ratio(g("reference", "fwbw_ms"), g("custom", "fwbw_ms")), 2, sizes=("small", "full")),
)


def evaluate_targets(rows: list[dict], device_type: str, size: str) -> list[dict]:
    index = {(r["op"], r["case"], r["variant"]): r for r in rows}
    out = []
    for t in TARGETS:
        if t.device != device_type or not any(r["op"] == t.op and r["case"] == t.case for r in rows):
            continue
        value = t.value(lambda variant, key: (index.get((t.op, t.case, variant)) or {}).get(key))
        met = value is not None and (value >= t.threshold if t.at_least else value <= t.threshold)
        status = "n/a" if value is None else "PASS" if met else "MISS"
        out.append({"name": t.name, "value": value, "goal": f"{'>=' if t.at_least else '<='} {t.threshold}{t.unit}",
                    "threshold": t.threshold, "unit": t.unit, "status": status,
                    "note": "" if size in t.sizes else f"indicative only: the goal is for size {'/'.join(t.sizes)}"})
    return out


# ----------------------------------------------------------------------------------------------- output


def _fmt(x: Optional[float], kind: str) -> str:
    if x is None:
        return "-"
    if kind == "ms":
        return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.3f}"
    if kind == "x":
        return f"{x:.2f}x"
    if kind == "err":
        return f"{x:.1e}"
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


TABLE_HEADERS = ["op", "case", "variant", "fw ms", "fwbw ms", "bw ms", "fw GB/s", "fw %copy", "bw GB/s", "bw %copy",
                 "err vs ref", "custom speed-up fw", "fwbw"]


def table_rows(rows: list[dict], errors: list[dict]) -> list[list[str]]:
    failed = {(e["op"], e["case"], e["variant"], e["phase"]) for e in errors}
    out = []
    for r in rows:
        key = (r["op"], r["case"], r["variant"])

        def ms(phase: str, value: Optional[float]) -> str:
            return "error" if key + (phase,) in failed else _fmt(value, "ms")

        bw = _fmt(r["bw_ms"], "ms") + ("*" if r["bw_source"] == "op" else "") if r["bw_ms"] else ms("bw_op", None)
        speed = r["custom_speedup"] or {}
        err = r["rel_err_vs_reference"]
        err_text = _fmt(err, "err") + (" WRONG" if err is not None and not err <= MAX_REL_ERR else "")
        out.append([r["op"], f"{r['case']} {r['shape']}", r["variant"], ms("fw", r["fw_ms"]), ms("fwbw", r["fwbw_ms"]),
                    bw, _fmt(r["fw_GBps"], "n"), _fmt(r["fw_pct_copy"], "n"), _fmt(r["bw_GBps"], "n"),
                    _fmt(r["bw_pct_copy"], "n"), err_text,
                    _fmt(speed.get("fw"), "x"), _fmt(speed.get("fwbw"), "x")])
    return out


def format_table(headers: list[str], body: list[list[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *body)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip() for line in [headers, *body])


def render(report: dict, markdown: bool) -> str:
    dev, copy = report["device"], report["copy"]
    header = (f"{report['date']}  {dev['name']}  torch {report['torch']}  size={report['size']}  "
              f"copy bandwidth {copy['GBps']:.0f} GB/s (read+write, {copy['bytes'] >> 20} MiB)")
    parts = [header, "", format_table(TABLE_HEADERS, table_rows(report["results"], report["errors"]), markdown), "",
             "bw ms: * = backward op timed alone, else fwbw - fw. custom speed-up = this row's time / custom's time. "
             f"err vs ref = ||out - reference|| / ||reference||, forward (WRONG above {MAX_REL_ERR:g})."]
    if report["targets"]:
        body = [[t["name"], _fmt(t["value"], "n" if t["unit"] == "%" else "x"), t["goal"], t["status"], t["note"]]
                for t in report["targets"]]
        parts += ["", format_table(["target", "measured", "goal", "status", "note"], body, markdown)]
    if report["errors"]:
        parts += ["", "errors:"] + [f"- {e['op']}/{e['case']}/{e['variant']} {e['phase']}: {e['error'][:160]}"
                                    for e in report["errors"]]
    return "\n".join(parts)


def device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": p.name, "sms": p.multi_processor_count, "memory_bytes": p.total_memory,
                "l2_bytes": getattr(p, "L2_cache_size", None), "cuda": torch.version.cuda}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}


def default_json_path(info: dict, date: str) -> Path:
    kind = "cpu" if info["type"] == "cpu" else re.sub(r"[^a-z0-9]+", "-", info["name"].lower()).strip("-")
    return REPO / "bench" / "results" / f"{kind}-{date}.json"


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--ops", default=",".join(OPS),
                   help=f"comma-separated subset of {','.join(OPS)} (grid: grid_interpolate)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--size", choices=tuple(SIZES), default=None, help="default: full on cuda, small on cpu")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per measurement (default 50 cuda, 10 cpu)")
    p.add_argument("--budget-s", type=float, default=2.0, help="stop repeating a measurement after this long")
    p.add_argument("--grid-channels", default=None,
                   help="comma-separated channel counts for grid_interpolate (default: the size's own, 12 at full "
                   "size)")
    p.add_argument("--json", type=Path, default=None, help="default bench/results/<device-kind>-<date>.json")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table as Markdown here")
    args = p.parse_args(argv)
    for option, allowed in (("ops", OPS), ("variants", VARIANTS)):
        chosen = [OP_ALIASES.get(x.strip(), x.strip()) if option == "ops" else x.strip()
                  for x in getattr(args, option).split(",") if x.strip()]
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
                errors.append({"op": op, "case": case.name, "variant": "*", "phase": "inputs",
                               "error": _error_text(exc)})
                _release(device)
                continue
            for r in new:
                timed = [f"{k} {r[k]['ms']:.3f} ms" for k in ("fw", "fwbw", "bw_op") if r[k]]
                print(f"{op} {case.name} {r['variant']}: {', '.join(timed) or 'error'}", flush=True)
            rows += new
    derive(rows, copy["GBps"])
    report = {
        "date": date, "torch": torch.__version__, "python": platform.python_version(), "device": info,
        "size": args.size, "sizes": vars(sizes), "grid_channels": args.grid_channels,
        "variants": args.variants,
        "extension": {"imported": ops.ext is not None,
                      "has_cuda_kernels": bool(ops.ext and ops.ext.has_cuda_kernels())},
        "copy": copy, "counting_rules": COUNTING_RULES, "results": rows,
        "targets": evaluate_targets(rows, device.type, args.size), "errors": errors,
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
