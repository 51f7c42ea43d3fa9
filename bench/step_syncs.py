"""Where a training step waits for the GPU: the device syncs of some steps of a train.py run, by site.

    python bench/step_syncs.py [--first 300] [--steps 20] [--json OUT.json] -- +experiment=blender data.root=PATH

A step whose cost is mostly fixed (bench/README "What a fixed-cost step means for two GPUs") loses time at each
device sync: the host waits for the queue to drain, then the GPU waits for the host's next launches. CUDA's sync
debug mode (``torch.cuda.set_sync_debug_mode("warn")``) warns at every operation that makes the host wait (an
``.item()``, a ``.tolist()`` or ``int()`` of a CUDA tensor, ``nonzero()``, a copy to the host). This runs
``train.py`` in this process with that mode on for ``--steps`` training steps from step ``--first`` (the
``Trainer.train_step`` calls only: log steps, evaluation and checkpoints are outside) and records each warning's
site, the innermost frames of this repository. A step of the presets means to have two: ``march_rays``' sample
count and the shading pass's counts (models/render_views.py); any other is a finding. The mode is CUDA's: on the
CPU it runs and finds none.
"""

from __future__ import annotations

import argparse
import json
import runpy
import sys
import traceback
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncRecorder:
    """Counts the sync warnings raised inside a window of ``Trainer.train_step`` calls, by site."""

    def __init__(self, first: int, steps: int, frames: int = 3):
        self.first, self.stop, self.frames = first, first + steps, frames
        self.calls = 0
        self.recorded_steps = 0
        self.sites: Counter[str] = Counter()

    def in_window(self) -> bool:
        return self.first <= self.calls < self.stop

    def site(self) -> str:
        """The innermost ``frames`` frames of this repository's code on the stack, innermost first."""
        ours = [f for f in traceback.extract_stack() if f.filename.startswith(str(REPO)) and f.filename != __file__]
        return " <- ".join(f"{Path(f.filename).relative_to(REPO)}:{f.lineno}" for f in reversed(ours[-self.frames :]))

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if SYNC_WARNING in str(message):
            self.sites[self.site()] += 1

    def step(self, train_step, trainer):
        """Run one ``train_step(trainer)``, recording its syncs when it is in the window."""
        if not self.in_window():
            self.calls += 1
            return train_step(trainer)
        cuda = torch.cuda.is_available()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = self.showwarning
            if cuda:
                torch.cuda.synchronize()  # the previous step's work is not this step's wait
                torch.cuda.set_sync_debug_mode("warn")
            try:
                return train_step(trainer)
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
                self.calls += 1
                self.recorded_steps += 1

    def report(self) -> dict:
        steps = max(self.recorded_steps, 1)
        return {
            "first_step": self.first,
            "steps": self.recorded_steps,
            "syncs_per_step": sum(self.sites.values()) / steps,
            "sites": [{"site": s, "per_step": c / steps} for s, c in self.sites.most_common()],
        }


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--first", type=int, default=300, help="the first recorded training step (0-based call count)")
    p.add_argument("--steps", type=int, default=20, help="steps recorded")
    p.add_argument("--json", type=Path, default=None, help="also write the report here")
    p.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = p.parse_args(argv)
    if args.first < 0 or args.steps < 1:
        p.error("--first must be >= 0 and --steps >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> dict:
    """Runs train.py with the overrides, records, prints a table; returns the report (also written to --json)."""
    args = parse_args(argv)
    sys.path.insert(0, str(REPO))
    from training import trainer

    recorder = SyncRecorder(args.first, args.steps)
    train_step = trainer.Trainer.train_step
    trainer.Trainer.train_step = lambda self: recorder.step(train_step, self)
    argv_before = sys.argv
    sys.argv = [str(REPO / "train.py"), *args.overrides]
    code = 0
    try:
        runpy.run_path(str(REPO / "train.py"), run_name="__main__")
    except SystemExit as stop:  # Hydra's main ends the run with sys.exit
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    finally:
        trainer.Trainer.train_step = train_step
        sys.argv = argv_before
    report = {"train_exit_code": code, "overrides": list(args.overrides), **recorder.report()}
    if recorder.recorded_steps < args.steps:
        print(f"note: the run made {recorder.calls} steps; {recorder.recorded_steps} of {args.steps} were recorded")
    print(f"device syncs per training step (steps {args.first}..{args.first + recorder.recorded_steps - 1}): "
          f"{report['syncs_per_step']:.2f}")  # fmt: skip
    for site in report["sites"]:
        print(f"{site['per_step']:6.2f}  {site['site']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"JSON: {args.json}")
    return report


if __name__ == "__main__":
    sys.exit(main()["train_exit_code"])
