"""bench/step_syncs.py: its recorder counts the sync warnings of the steps in its window by site, and the tool runs
a train.py run through to its report (on the CPU, where CUDA's sync debug mode finds none)."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from step_syncs import SYNC_WARNING, SyncRecorder  # noqa: E402


def a_step_that_syncs(trainer, count: int):
    for _ in range(count):
        warnings.warn(f"an op {SYNC_WARNING}", UserWarning, stacklevel=1)  # what CUDA's sync debug mode raises
    warnings.warn("something else", UserWarning, stacklevel=1)
    return trainer


def test_the_recorder_counts_the_window_only_by_site():
    recorder = SyncRecorder(first=2, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # outside the window nothing is recorded, even when warnings show
        for call in range(8):
            assert recorder.step(lambda t: a_step_that_syncs(t, 2), call) == call
    report = recorder.report()
    assert report["steps"] == 3 and recorder.calls == 8
    assert report["syncs_per_step"] == 2.0
    (site,) = report["sites"]
    assert site["site"].startswith("tests/test_step_syncs.py:") and site["per_step"] == 2.0


def test_a_failing_step_is_counted_and_the_error_kept():
    recorder = SyncRecorder(first=0, steps=2)

    def fails(trainer):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        recorder.step(fails, None)
    assert recorder.calls == 1 and recorder.recorded_steps == 1


def test_the_tool_runs_a_cpu_training_run(tmp_path):
    from test_train import tiny_overrides

    out = tmp_path / "syncs.json"
    overrides = tiny_overrides(tmp_path / "cache", 8) + [
        f"hydra.run.dir={tmp_path / 'run'}",
        "train.turntable_frames=0",
    ]
    result = subprocess.run(
        [sys.executable, "bench/step_syncs.py", "--first", "3", "--steps", "4", "--json", str(out), "--", *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["train_exit_code"] == 0 and report["steps"] == 4 and report["first_step"] == 3
    assert report["syncs_per_step"] == 0 and report["sites"] == []  # the CPU: CUDA's debug mode has nothing to flag
    assert (tmp_path / "run" / "metrics.json").exists()
