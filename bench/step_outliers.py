"""Which steps of a training run are slow, and what happened in them: each step's host time, the Python garbage
collections inside it, and the CUDA caching allocator's driver calls (cudaMalloc / cudaFree segments) it made.

    python bench/step_outliers.py --json steps.json [--top 40] -- +experiment=blender data.root=PATH

Runs train.py (``--root``'s, default this tree's) in this process with every override after ``--``. No device sync
is added: a step's host time is the time until its last launch returned, so a device-bound run's steady steps read
short and their cost shows at the next sync (the log steps); a one-off pause of the host (a collection, a driver
allocation, a graph capture, a growth of the grids) shows in the step that made it. The JSON holds every step's row
and the ``--top`` slowest, and per 100 steps: the host's milliseconds, the collections' and the segments allocated
and freed, which is where a slow TensorBoard window (``train/rays_per_second``) is read against what its steps did.
Under torchrun each rank writes its own (``--json`` with ``.rank<r>`` for r > 0). The allocator's counters are read
twice a step (tens of microseconds of host time): the run's times are for finding the slow steps, not for comparing
runs with and without this script.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
WINDOW = 100  # steps a window: the presets' log_every, so that a window lines up with a TensorBoard point


def segments() -> tuple[int, int]:
    """(segments allocated, segments freed) by the caching allocator so far; (0, 0) without CUDA. The keys are
    training.scenes.ALLOCATOR_STATS' ``device_mallocs`` / ``device_frees``, read here because ``--root`` may be a tree
    from before that table."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0, 0
    stats = torch.cuda.memory_stats()
    return int(stats.get("segment.all.allocated", 0)), int(stats.get("segment.all.freed", 0))


def _rounded(value: float) -> float:
    return round(value, 3) if isinstance(value, float) else value


class StepRecorder:
    """Rows ``[step, host_ms, gc_ms, collections, segments_allocated, segments_freed]`` for each training step."""

    def __init__(self):
        self.rows: list[list] = []
        self.gc_ms = 0.0
        self.collections = 0
        self._gc_start = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_ms += (time.perf_counter() - self._gc_start) * 1e3
            self.collections += 1

    def wrap(self, plain_step):
        recorder = self

        def train_step(self):
            recorder.gc_ms, recorder.collections = 0.0, 0
            allocated, freed = segments()
            start = time.perf_counter()
            result = plain_step(self)
            host_ms = (time.perf_counter() - start) * 1e3
            now_allocated, now_freed = segments()
            row = [self.step, round(host_ms, 3), round(recorder.gc_ms, 3), recorder.collections]
            recorder.rows.append(row + [now_allocated - allocated, now_freed - freed])
            return result

        return train_step

    def report(self, top: int) -> dict:
        """Every row, the ``top`` slowest, and per window of :data:`WINDOW` steps the sums."""
        windows: dict[int, list[float]] = {}
        for step, host_ms, gc_ms, collections, allocated, freed in self.rows:
            window = windows.setdefault((step - 1) // WINDOW * WINDOW + WINDOW, [0.0, 0.0, 0, 0, 0])
            for i, value in enumerate((host_ms, gc_ms, collections, allocated, freed)):
                window[i] += value
        columns = ["step", "host_ms", "gc_ms", "collections", "segments_allocated", "segments_freed"]
        return {
            "columns": columns,
            "slowest": sorted(self.rows, key=lambda row: -row[1])[:top],
            "windows": {
                str(end): dict(zip(columns[1:], map(_rounded, sums), strict=True)) for end, sums in windows.items()
            },
            "rows": self.rows,
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="where the steps' rows and windows go")
    parser.add_argument("--top", type=int, default=40, help="how many of the slowest steps to list")
    parser.add_argument("--root", type=Path, default=REPO, help="the tree whose train.py runs (default: this one)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out = args.json if rank == 0 else args.json.with_name(f"{args.json.name}.rank{rank}")
    sys.path.insert(0, str(args.root.resolve()))
    from training import trainer  # the root's

    recorder = StepRecorder()
    plain_fit = trainer.Trainer.fit

    def save() -> None:
        out.write_text(json.dumps(recorder.report(args.top)) + "\n")

    def fit(self) -> int:  # written when training ends: a torchrun rank > 0 leaves by os._exit (train.py), no finally
        try:
            return plain_fit(self)
        finally:
            save()

    gc.callbacks.append(recorder.on_gc)
    trainer.Trainer.train_step = recorder.wrap(trainer.Trainer.train_step)
    trainer.Trainer.fit = fit
    sys.argv = [str(args.root / "train.py"), *args.overrides]
    try:
        runpy.run_path(str(args.root / "train.py"), run_name="__main__")
    except SystemExit as exit_:  # train.py ends with sys.exit(code): the steps so far are still written
        if exit_.code not in (0, None):
            raise
    finally:
        gc.callbacks.remove(recorder.on_gc)
        save()  # also where training never began (a config error)
        slowest = ", ".join(f"{row[0]}: {row[1]:.1f} ms" for row in recorder.report(5)["slowest"])
        print(f"step_outliers: {len(recorder.rows)} steps -> {out}; slowest {slowest}", flush=True)


if __name__ == "__main__":
    main()
