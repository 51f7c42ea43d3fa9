"""Sweeps through hydra-submitit-launcher (``hydra/launcher=submitit_local``): every job runs in a process of its
own and writes its own outputs; the launching process lists every job and reports the failed ones
(training/sweep.py). CPU, tiny scenes."""

from __future__ import annotations

import importlib.util
import json

import pytest
from test_train import read_metrics, run_train, tiny_overrides


def _launcher_installed() -> bool:
    """Whether hydra-submitit-launcher is importable (without hydra_plugins at all, find_spec raises)."""
    try:
        return importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None
    except ModuleNotFoundError:
        return False


pytestmark = pytest.mark.skipif(
    not _launcher_installed(), reason="hydra_submitit_launcher is not importable (pip install -e '.[cluster]')"
)


def sweep_args(cache, sweep_dir, iters: str) -> list[str]:
    tiny = [o for o in tiny_overrides(cache, 0) if not o.startswith("train.iters=")]
    return ["-m", "hydra/launcher=submitit_local", *tiny, f"train.iters={iters}", "train.turntable_frames=0"] + [
        f"hydra.sweep.dir={sweep_dir}"
    ]


def test_submitit_local_runs_every_job_of_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    result = run_train(sweep_args(tmp_path / "cache", sweep, "20,30"), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert read_metrics(sweep / "0")["iters"] == 20 and read_metrics(sweep / "1")["iters"] == 30
    assert (sweep / ".submitit").is_dir()  # the jobs went through submitit, not the basic launcher
    assert "#0 " in result.stderr and "#1 " in result.stderr and "FAILED" not in result.stderr
    # each job left one record of its exit code, read by the launching process
    records = [json.loads(p.read_text()) for p in sweep.glob(".jobs/*/*.json")]
    assert sorted((r["num"], r["code"]) for r in records) == [(0, 0), (1, 0)]


def test_submitit_local_reports_a_failed_job_and_keeps_the_others(tmp_path):
    sweep = tmp_path / "sweep"
    args = sweep_args(tmp_path / "cache", sweep, "6") + ["train.lr=-1,0.1"]  # job 0 is refused (a bad lr)
    result = run_train(args, timeout=300)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "1 job(s) of the sweep failed: #0" in result.stderr
    assert (sweep / "1" / "metrics.json").is_file() and not (sweep / "0" / "metrics.json").exists()
    # the same sweep again: every job refuses to overwrite the finished run folders, and both are reported
    again = run_train(args, timeout=300)
    assert again.returncode == 2 and "2 job(s) of the sweep failed" in again.stderr
