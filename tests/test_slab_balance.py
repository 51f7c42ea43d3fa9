"""bench/slab_balance.py on the CPU: a tiny run counts its samples per cell layer and gives each cut's largest slab
share, so the script cannot rot; and the share of a known histogram."""

import json
import subprocess
import sys

import pytest
import torch
from test_train import REPO, scene_cache, tiny_overrides  # noqa: F401 (scene_cache: the fixture)


def test_a_tiny_run_reports_the_slab_shares(tmp_path, scene_cache):  # noqa: F811
    out = tmp_path / "balance.json"
    args = ["--out", str(out), "--at", "4,7", "--batches", "2", "--"]
    args += tiny_overrides(scene_cache, 9) + [f"hydra.run.dir={tmp_path / 'run'}", "train.turntable_frames=0"]
    args += ["model.weight_threshold=1e-3", "model.occupancy.warmup=3"]
    result = subprocess.run(
        [sys.executable, "bench/slab_balance.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["steps"]) == {"4", "7"} and report["batches"] == 2
    for entry in report["steps"].values():
        per_batch = entry["per_batch"]
        assert per_batch["march"] >= per_batch["alive"] >= per_batch["shown"] > 0
        for ranks in (2, 4):
            for cut in ("even", "surface", "shown"):
                share = entry[f"{ranks}_ranks"][cut]
                assert len(share["planes"]) == ranks - 1
                assert all(1 / ranks - 1e-9 <= share[kind] <= 1.0 for kind in ("march", "alive", "shown"))
    assert (tmp_path / "run" / "metrics.json").exists()  # the run went on to its end


def test_the_largest_share_of_a_histogram():
    sys.path.insert(0, str(REPO / "bench"))
    from slab_balance import largest_share

    layers = torch.tensor([1.0, 1.0, 2.0, 4.0])
    assert largest_share(layers, (2,)) == pytest.approx(6 / 8)
    assert largest_share(layers, (3,)) == pytest.approx(4 / 8)
    assert largest_share(layers, (1, 3)) == pytest.approx(4 / 8)
