"""Kernel-level profile of a training run: ``torch.profiler`` over steps [first, first + steps) of ``train.py``.

    python bench/kernel_profile.py --out prof.txt --first 2800 --steps 30 -- +experiment=capture data.root=PATH

Runs train.py in this process with every override after ``--``. The ``steps`` steps just before ``first`` are timed
plain (device-synchronised wall clock: what a step costs without the profiler), then the next ``steps`` under
the profiler. ``--out`` gets both timings, the device time per step (the sum of the kernels' own time, without
the profiler's annotation rows, which repeat their kernels' time), and the tables by device and by host time.
A host time per step well above the device time means the step is bound by the Python side (op launches).
Pick ``first`` away from the periodic evaluations (``train.eval_every``) and the grids' growth. Without a GPU it
profiles the host alone (the tests run it so on the CPU).
"""

from __future__ import annotations

import argparse
import runpy
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training import trainer  # noqa: E402


def kernel_time(averages) -> float:
    """Microseconds of device time in the profiler's ``key_averages()``, counted as its table's "Self CUDA time
    total" is: device-side rows only, without user annotations (a ``record_function`` range such as
    ``Optimizer.step#...`` shows up on the device too, repeating its kernels' time)."""
    cuda = torch.autograd.DeviceType.CUDA
    return sum(
        e.self_device_time_total
        for e in averages
        if e.device_type == cuda and not getattr(e, "is_user_annotation", False)
    )


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def install(out: Path, first: int, steps: int) -> None:
    """Wrap Trainer.train_step: time steps [first - steps, first), profile [first, first + steps), write ``out``."""
    plain_step = trainer.Trainer.train_step
    state: dict = {}

    def train_step(self):
        step = self.step
        if step == first - steps:
            sync()
            state["start"] = time.perf_counter()
        if step == first:
            sync()
            state["plain_ms"] = (time.perf_counter() - state["start"]) * 1e3 / steps
            activities = [torch.profiler.ProfilerActivity.CPU]
            activities += [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            state["profiler"] = torch.profiler.profile(activities=activities)
            state["profiler"].__enter__()
            state["start"] = time.perf_counter()
        result = plain_step(self)
        if step == first + steps - 1:
            sync()
            profiled_ms = (time.perf_counter() - state["start"]) * 1e3 / steps
            profiler = state.pop("profiler")
            profiler.__exit__(None, None, None)
            averages = profiler.key_averages()
            device_ms = kernel_time(averages) / 1e3 / steps
            host_ms = sum(e.self_cpu_time_total for e in averages) / 1e3 / steps
            head = (
                f"steps {first}..{first + steps}: plain {state['plain_ms']:.2f} ms/step, under the profiler "
                f"{profiled_ms:.2f} ms/step; kernels {device_ms:.2f} ms/step, host (profiled) {host_ms:.2f} ms/step\n"
            )
            tables = [
                averages.table(sort_by="self_device_time_total", row_limit=45, max_name_column_width=90)
                if torch.cuda.is_available()
                else "(no CUDA device)",
                averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=90),
            ]
            out.write_text(head + "\nby device time\n" + tables[0] + "\n\nby host time\n" + tables[1])
            print(head, end="", flush=True)
        return result

    trainer.Trainer.train_step = train_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the timings and tables go (text)")
    parser.add_argument("--first", type=int, default=2800, help="first profiled step (0-based)")
    parser.add_argument("--steps", type=int, default=30, help="steps timed plain, then profiled")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.first < args.steps:
        raise SystemExit(f"--first ({args.first}) must be >= --steps ({args.steps}) >= 1")
    install(args.out, args.first, args.steps)
    sys.argv = [str(REPO / "train.py"), *args.overrides]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
