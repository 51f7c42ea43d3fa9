"""Kernel-level profile of a training run: ``torch.profiler`` over steps [first, first + steps) of ``train.py``.

    python bench/kernel_profile.py --out prof.txt --first 2800 --steps 30 -- +experiment=capture data.root=PATH
    (under torchrun every rank profiles itself: rank r > 0 writes prof.txt.rank<r>)
    (--python: then as many steps under cProfile)

Runs train.py in this process with every override after ``--``. The ``steps`` steps just before ``first`` are timed
plain (device-synchronised wall clock: what a step costs without the profiler), then the next ``steps`` under
the profiler. ``--out`` gets both timings, the device time per step (the sum of the kernels' own time, without
the profiler's annotation rows, which repeat their kernels' time), and the tables by device and by host time.
A host time per step well above the device time means the step is bound by the Python side (op launches); the
third table says which part of the step issues them: per section of the trainer's step (sampling, forward,
loss_backward, ...), the top-level ATen calls and, on a GPU, the kernel launches. The fourth (GPU only) says where
the device waited for the host: every idle stretch between two kernels, charged to the section and top-level call
that launched the kernel after it (the profiler slows the host, so the stretches are longer than in a plain step;
their places are what to read).
``--syncs``: then as many steps again with ``torch.cuda.set_sync_debug_mode("warn")``: every host sync the step
makes (a count read back, an ``.item()``, a ``nonzero``), by the innermost line of this repository's code that led
to it, per step: what a captured step (one CUDA graph) must not contain, and where the host waits for the device.
Syncs inside this repository's C++ ops warn in C++ only (stderr), uncounted there: the profiled steps' last table
counts every synchronising runtime call, those included, by the section and top-level call that made it.
Pick ``first`` away from the periodic evaluations (``train.eval_every``) and the grids' growth. Without a GPU it
profiles the host alone (the tests run it so on the CPU).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import cProfile
import io
import os
import pstats
import runpy
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from training import profiler as step_profiler  # noqa: E402
from training import trainer  # noqa: E402

SECTION = "section:"  # the record_function ranges around the trainer's step sections


def device_rows(averages) -> list:
    """The profiler's ``key_averages()`` rows of device work: device-side rows only, without user annotations (a
    ``record_function`` range such as ``Optimizer.step#...`` shows up on the device too, repeating its kernels'
    time)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in averages if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]


def kernel_time(averages) -> float:
    """Microseconds of device time in the profiler's ``key_averages()``, counted as its table's "Self CUDA time
    total" is (:func:`device_rows`)."""
    return sum(e.self_device_time_total for e in device_rows(averages))


def mark_sections() -> None:
    """Every ``StepProfiler.section`` (timed or not) also opens a ``record_function`` range named after it."""
    plain_section = step_profiler.StepProfiler.section

    @contextlib.contextmanager
    def section(self, name: str):
        with torch.profiler.record_function(SECTION + name), plain_section(self, name):
            yield

    step_profiler.StepProfiler.section = section


def calls_by_section(events, steps: int) -> str:
    """Per section of the step: top-level ATen calls (not those an op makes inside itself) and CUDA kernel launches
    per step, with the commonest calls."""
    calls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for event in events:
        name, parent = event.name, event.cpu_parent
        launch = name == "cudaLaunchKernel"
        if not launch and not (
            name.startswith("aten::") and not (parent and parent.name.startswith(("aten::", "cuda_ext::")))
        ):
            continue
        while parent is not None and not parent.name.startswith(SECTION):
            parent = parent.cpu_parent
        # on CUDA the backward runs in autograd's own thread, outside loss_backward's range
        section = parent.name[len(SECTION) :] if parent is not None else "(no section)"
        calls[section]["(kernel launches)" if launch else name] += 1
    lines = []
    for section, counter in sorted(calls.items(), key=lambda item: -sum(item[1].values())):
        launches = counter.pop("(kernel launches)", 0)
        common = ", ".join(f"{name[6:]} {count / steps:g}" for name, count in counter.most_common(10))
        per_step = f"{sum(counter.values()) / steps:7.1f} ATen calls, {launches / steps:6.1f} launches a step"
        lines.append(f"{section:16s} {per_step}: {common}")
    return "\n".join(lines)


def _top_level(event):
    """(section, top-level call) of a host event: its outermost aten:: / cuda_ext:: ancestor below a section."""
    call, parent = event, event.cpu_parent
    while parent is not None and not parent.name.startswith(SECTION):
        if parent.name.startswith(("aten::", "cuda_ext::", "autograd::", "Optimizer.")):
            call = parent
        parent = parent.cpu_parent
    section = parent.name[len(SECTION) :] if parent is not None else "(no section)"
    return section, call.name


def _is_launch(name: str) -> bool:
    """A CUDA runtime or driver call that puts work on the device (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync,
    cudaMemsetAsync, ...)."""
    return name.startswith("cu") and ("Launch" in name or name.startswith(("cudaMemcpy", "cudaMemset")))


def idle_by_launcher(events, steps: int, rows: int = 25) -> str:
    """Device idle time between consecutive kernels (ms a step), by the section and top-level call that launched the
    kernel ending each idle stretch: the places where the device waits for the host (after a sync, or behind slow
    launches). On an idle device a kernel starts as soon as it is launched, so the launch charged is the last CUDA
    runtime call (cudaLaunchKernel, cudaMemcpyAsync, ...) the host began before the kernel started."""
    cuda = torch.autograd.DeviceType.CUDA
    launches = [e for e in events if e.device_type != cuda and _is_launch(e.name)]
    launches.sort(key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in launches]
    kernels = sorted(
        (e for e in events if e.device_type == cuda and not getattr(e, "is_user_annotation", False)),
        key=lambda e: e.time_range.start,
    )
    idle: collections.Counter = collections.Counter()
    by_section: collections.Counter = collections.Counter()
    busy_until = None
    for kernel in kernels:
        start, end = kernel.time_range.start, kernel.time_range.end
        if busy_until is not None and start > busy_until:
            index = bisect.bisect_right(starts, start) - 1
            section, call = _top_level(launches[index]) if index >= 0 else ("?", "?")
            idle[(section, call)] += start - busy_until
            by_section[section] += start - busy_until
        busy_until = end if busy_until is None else max(busy_until, end)
    if not kernels:
        return "(no kernels)"
    span = (busy_until - kernels[0].time_range.start) / 1e3 / steps
    total = sum(idle.values()) / 1e3 / steps
    lines = [f"device span {span:.2f} ms a step, idle {total:.2f} ms a step between kernels"]
    lines += [f"  {name:16s} {value / 1e3 / steps:6.3f} ms" for name, value in by_section.most_common()]
    top = idle.most_common(rows)
    lines += [f"{value / 1e3 / steps:7.3f} ms  {section:14s} {call}" for (section, call), value in top]
    return "\n".join(lines)


HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


def waits_by_call(events, steps: int, rows: int = 15) -> str:
    """The host's waits on the device in the profiled steps (the runtime's synchronising calls: a stream sync, a
    blocking copy), a step, by the section and top-level call that made them. It sees the syncs inside this
    repository's C++ ops (a count read back), which reach ``--syncs``' Python warnings only as C++ warnings on
    stderr."""
    waits = collections.Counter(_top_level(e) for e in events if e.name in HOST_WAITS)
    lines = [f"{sum(waits.values()) / steps:.2f} waits a step"]
    lines += [f"  {count / steps:6.2f}  {section:14s} {call}" for (section, call), count in waits.most_common(rows)]
    return "\n".join(lines)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def python_tables(profile: cProfile.Profile, steps: int, rows: int = 35) -> str:
    """cProfile's functions by own time and by cumulative time (seconds over ``steps`` steps)."""
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    text.write(f"(seconds over {steps} steps)\n")
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumtime").print_stats(rows)
    return text.getvalue()


def repo_site(stack: list[traceback.FrameSummary]) -> str:
    """``path:line function`` of the innermost frame of ``stack`` in this repository's code, this script's aside."""
    for frame in reversed(stack):
        path = Path(frame.filename).resolve()
        if path.is_relative_to(REPO) and path != Path(__file__).resolve():
            return f"{path.relative_to(REPO)}:{frame.lineno} {frame.name}"
    return "(outside the repository)"


class SyncSites:
    """The host syncs of the steps between :meth:`start` and :meth:`report` (CUDA's sync debug mode, "warn": each
    synchronising call warns), counted by :func:`repo_site`. Without CUDA it records nothing."""

    def __init__(self):
        self.sites: collections.Counter = collections.Counter()
        self._warnings: contextlib.AbstractContextManager | None = None

    def record(self, message) -> bool:
        """Count ``message`` if it is a sync's warning, from where it was raised; False for any other warning."""
        if "synchroniz" not in str(message):
            return False
        self.sites[repo_site(traceback.extract_stack()[:-1])] += 1
        return True

    def start(self) -> SyncSites:
        if not torch.cuda.is_available():
            return self
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.simplefilter("always")  # every sync, not the first from each line
        show = warnings.showwarning

        def show_or_count(message, category, filename, lineno, file=None, line=None):
            if not self.record(message):
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = show_or_count
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def report(self, steps: int) -> str:
        """Stop recording; :meth:`table`."""
        if self._warnings is None:
            return "(no CUDA device)\n"
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(None, None, None)
        self._warnings = None
        return self.table(steps)

    def table(self, steps: int) -> str:
        """The sites by syncs a step, most first."""
        lines = [f"{sum(self.sites.values()) / steps:.2f} syncs a step"]
        lines += [f"  {count / steps:6.2f}  {site}" for site, count in self.sites.most_common()]
        return "\n".join(lines) + "\n"


def install(out: Path, first: int, steps: int, python: bool = False, syncs: bool = False) -> None:
    """Wrap Trainer.train_step: time steps [first - steps, first), profile [first, first + steps), write ``out``;
    ``python``: then the next ``steps`` steps under cProfile (the host's Python functions), appended to ``out``;
    ``syncs``: then the next ``steps`` steps' host syncs (:class:`SyncSites`), appended to ``out``."""
    plain_step = trainer.Trainer.train_step
    state: dict = {}
    sync_first = first + steps * (2 if python else 1)

    def train_step(self):
        step = self.step
        if syncs and step == sync_first:
            state["syncs"] = SyncSites().start()
        if python and step == first + steps:
            state["python"] = cProfile.Profile()
            state["python"].enable()
        if python and step == first + 2 * steps:
            state["python"].disable()
            with out.open("a") as text:
                text.write(f"\nPython functions, steps {first + steps}..{first + 2 * steps} under cProfile\n")
                text.write(python_tables(state.pop("python"), steps))
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
            sections = calls_by_section(profiler.events(), steps)
            idle = idle_by_launcher(profiler.events(), steps) if torch.cuda.is_available() else "(no CUDA device)"
            waits = waits_by_call(profiler.events(), steps) if torch.cuda.is_available() else "(no CUDA device)"
            out.write_text(
                head
                + "\nby device time\n"
                + tables[0]
                + "\n\nby host time\n"
                + tables[1]
                + "\n\nby section of the step\n"
                + sections
                + "\n\nwhere the device waited for the host\n"
                + idle
                + "\n\nwhere the host waited for the device (the runtime's synchronising calls)\n"
                + waits
                + "\n"
            )
            print(head, end="", flush=True)
        if syncs and step == sync_first + steps - 1:
            with out.open("a") as text:
                text.write(f"\nhost syncs, steps {sync_first}..{sync_first + steps}\n")
                text.write(state.pop("syncs").report(steps))
        return result

    trainer.Trainer.train_step = train_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the timings and tables go (text)")
    parser.add_argument("--first", type=int, default=2800, help="first profiled step (0-based)")
    parser.add_argument("--steps", type=int, default=30, help="steps timed plain, then profiled")
    parser.add_argument(
        "--python", action="store_true", help="then as many steps again under cProfile (train.iters > first + 2 steps)"
    )
    parser.add_argument(
        "--syncs", action="store_true", help="then as many steps again counting the host syncs by where they happen"
    )
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.first < args.steps:
        raise SystemExit(f"--first ({args.first}) must be >= --steps ({args.steps}) >= 1")
    mark_sections()
    rank = int(os.environ.get("RANK", "0"))  # under torchrun: rank r > 0 writes OUT.rank<r>
    out = args.out if rank == 0 else args.out.with_name(f"{args.out.name}.rank{rank}")
    install(out, args.first, args.steps, args.python, args.syncs)
    sys.argv = [str(REPO / "train.py"), *args.overrides]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
