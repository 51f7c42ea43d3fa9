"""bench/profile_windows.py: profiles' windows side by side (the first over the others) and the parts where the
second gains least; a profile without windows is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _write(path: Path, steps_ms: list[float], decoder_ms: list[float]) -> Path:
    windows = [
        {"steps": [100 * i + 1, 100 * (i + 1)], "step_ms": s, "per_step_ms": {"decoder": d, "other": s - d}}
        for i, (s, d) in enumerate(zip(steps_ms, decoder_ms))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"windows": windows}))
    return path


def _run(*paths: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "bench/profile_windows.py", *map(str, paths)]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_windows_side_by_side_and_where_the_split_gains_least(tmp_path):
    one = _write(tmp_path / "one" / "profile.json", [26.0, 9.0, 8.8], [10.0, 5.0, 5.0])
    split = _write(tmp_path / "split" / "profile.json", [28.0, 5.0, 5.5], [5.0, 2.5, 2.5])
    result = _run(one, split)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[2] == "| 1-100 | 26.00 | 28.00 | 0.93x |"
    assert lines[3] == "| 101-200 | 9.00 | 5.00 | 1.80x |"
    assert lines[4] == "| 201-300 | 8.80 | 5.50 | 1.60x |"
    assert "steps 1-100, where split/profile gains least" in result.stdout
    assert "| decoder | 10.000 | 5.000 |" in result.stdout


def test_a_profile_without_windows_is_named(tmp_path):
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"steps": 10, "step_ms": 5.0}))
    result = _run(old)
    assert result.returncode != 0 and f"{old}: no 'windows'" in result.stderr


def test_quality_runs_records_each_ranks_windows_of_a_profiled_run(tmp_path, load_bench):
    """bench/quality_runs.py: a variant run under train.profile keeps every rank's 100-step windows in its JSON."""
    quality_runs = load_bench("quality_runs")
    run = tmp_path / "two"
    _write(run / "profile.json", [16.0, 5.0], [6.0, 2.0])
    _write(run / "profile_rank1.json", [15.0, 5.5], [6.0, 2.0])
    assert quality_runs.profile_windows(run) == {
        "profile": [[1, 100, 16.0], [101, 200, 5.0]],
        "profile_rank1": [[1, 100, 15.0], [101, 200, 5.5]],
    }
    assert quality_runs.profile_windows(tmp_path / "unprofiled") is None
