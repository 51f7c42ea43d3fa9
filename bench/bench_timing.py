"""Timing for the benchmarks: medians of CUDA-event (or wall-clock) runs, the copy bandwidth they are measured
against, and how many input sets defeat the cache."""

from __future__ import annotations

import datetime
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

CPU_CACHE_BYTES = 32 << 20  # assumed last-level cache of a CPU host; CUDA reads the L2 size from the device


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


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def bench_timer(device: torch.device, repeats: int, budget_s: float) -> Timer:
    """The single-op benchmarks' timer: 3 warm-up runs on CUDA, 1 on the CPU."""
    return Timer(device, warmup=3 if device.type == "cuda" else 1, repeats=repeats, budget_s=budget_s)


def report_header(device: torch.device) -> dict:
    """The first fields of every benchmark report: ``{"date", "device", "torch"}``."""
    return {"date": datetime.date.today().isoformat(), "device": device_name(device), "torch": torch.__version__}


def print_header(report: dict, copy_gbps: float) -> None:
    """One line: the report's date, device and torch, and the copy bandwidth its figures are measured against."""
    print(f"{report['date']}  {report['device']}  torch {report['torch']}  copy {copy_gbps:.0f} GB/s")


def write_report(report: dict, path: Path | None) -> None:
    """Write the report as JSON to ``path`` (folders made as needed) and say where; nothing when None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"JSON: {path}")
