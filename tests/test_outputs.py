"""What a run keeps and evaluates: train.keep_checkpoints (last.pt plus the newest periodic step_<step>.pt files),
train.eval_final_views (the final evaluation on views spread evenly over the eval split) and the device memory that
metrics.json reports. CPU, tiny scenes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_train import read_metrics, run_train, tiny_overrides

from training.checkpoint import StepCheckpoints, load_checkpoint, step_checkpoints
from training.config import ConfigError, validate_config
from training.evaluation import spread_views
from training.run_dir import RunError, RunPaths, refuse_to_overwrite


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scene_cache")


def quick(cache: Path, iters: int, *extra: str) -> list[str]:
    return tiny_overrides(cache, iters) + ["train.turntable_frames=0", *extra]


def with_test_views(overrides: list[str], count: int) -> list[str]:
    return [o for o in overrides if not o.startswith("data.n_test=")] + [f"data.n_test={count}"]


def steps_kept(run_dir: Path) -> list[int]:
    return sorted(step_checkpoints(run_dir / "checkpoints"))


def test_keep_checkpoints_keeps_the_newest_step_files_and_last_pt_resumes(tmp_path, cache):
    run_dir = tmp_path / "run"
    keep = ["train.keep_checkpoints=3", "train.checkpoint_every=2", "train.keep_resumable=true"]
    keep.append(f"hydra.run.dir={run_dir}")
    result = run_train(quick(cache, 9, *keep))
    assert result.returncode == 0, result.stdout + result.stderr
    # periodic saves at steps 2, 4, 6, 8 (the end's save at 9 is last.pt only): the newest 2 step files stay
    assert steps_kept(run_dir) == [6, 8]
    folder = run_dir / "checkpoints"
    assert (folder / "step_000008.pt").is_file() and not (folder / "step_000002.pt").exists()
    assert load_checkpoint(folder / "step_000008.pt")["step"] == 8
    assert load_checkpoint(folder / "step_000006.pt")["step"] == 6
    assert load_checkpoint(folder / "last.pt")["step"] == 9
    assert not list(folder.glob(".*.tmp"))

    # resume reads last.pt (step 9); the earlier run's step files are this run's history and rotate with it
    result = run_train(quick(cache, 11, *keep, "train.resume=true"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(step 9)" in result.stdout
    assert steps_kept(run_dir) == [8, 10]
    assert load_checkpoint(folder / "last.pt")["step"] == 11 and read_metrics(run_dir)["iters"] == 11
    assert load_checkpoint(folder / "step_000010.pt")["step"] == 10
    assert not list(folder.glob(".*.tmp"))


def test_default_keeps_only_the_model(tmp_path, cache):
    """A finished run keeps model.pt; its periodic last.pt (steps 2 and 4 here) is deleted with its folder."""
    run_dir = tmp_path / "run"
    result = run_train(quick(cache, 5, "train.checkpoint_every=2", f"hydra.run.dir={run_dir}"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (run_dir / "model.pt").is_file() and not (run_dir / "checkpoints").exists()


def test_eval_final_views_evaluates_an_even_subset(tmp_path, cache):
    run_dir = tmp_path / "run"
    overrides = with_test_views(quick(cache, 4, f"hydra.run.dir={run_dir}"), 7)
    result = run_train(overrides + ["train.eval_final_views=3"])
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = read_metrics(run_dir)
    assert [v["view"] for v in metrics["per_view"]] == metrics["evaluated_views"] == [0, 3, 6]
    assert metrics["eval_views"] == 3 and metrics["eval_split_views"] == 7
    assert metrics["psnr"] == pytest.approx(sum(v["psnr"] for v in metrics["per_view"]) / 3)
    assert "eval on 3 test views" in result.stdout
    written = sorted(p.name.split("_")[0] for p in (run_dir / "renders").glob("*_pred.png"))
    assert written == ["000", "003", "006"]

    # render_only takes it from the command line; more views than the split has: all of them, with a note
    result = run_train(overrides + ["render_only=true", "train.eval_final_views=50"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "note: train.eval_final_views=50 but the test split has 7 views" in result.stdout
    metrics = read_metrics(run_dir)
    assert metrics["evaluated_views"] == list(range(7)) and len(metrics["per_view"]) == 7
    assert metrics["render_only"] is True


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.keep_checkpoints=0", "train.keep_checkpoints: must be > 0 (got 0)"),
        ("train.keep_checkpoints=-2", "train.keep_checkpoints: must be > 0 (got -2)"),
        ("train.eval_final_views=-1", "train.eval_final_views: must be >= 0 (got -1)"),
    ],
)
def test_bad_values_stop_naming_the_key(tmp_path, cache, override, message):
    result = run_train(quick(cache, 3, f"hydra.run.dir={tmp_path}", override))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "checkpoints").exists()
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=f"^{key}: "):
        validate_config(OmegaConf.from_dotlist([f"{key}={value}"]))


def test_spread_views_are_evenly_spaced_and_include_both_ends():
    assert spread_views(7, 3) == [0, 3, 6]
    assert spread_views(10, 4) == [0, 3, 6, 9]
    assert spread_views(200, 8) == [0, 28, 57, 85, 114, 142, 171, 199]
    assert spread_views(5, 1) == [0]
    assert spread_views(3, 3) == spread_views(3, 9) == [0, 1, 2]
    for total in range(1, 40):
        for count in range(1, total + 1):
            assert len(spread_views(total, count)) == count


def test_step_checkpoints_rotate_adopt_and_replace(tmp_path, monkeypatch):
    folder, last = tmp_path / "checkpoints", tmp_path / "checkpoints" / "last.pt"
    earlier = StepCheckpoints(folder, keep=3)
    for step in (1, 2, 3, 4):
        earlier.save(last, {"step": step}, step)
    assert sorted(step_checkpoints(folder)) == [3, 4] and load_checkpoint(last)["step"] == 4
    # a resumed run adopts the step files up to its checkpoint's step
    resumed = StepCheckpoints(folder, keep=3, adopt_upto=4)
    resumed.save(last, {"step": 6}, 6)
    assert sorted(step_checkpoints(folder)) == [4, 6]
    # where hard links fail, last.pt is a second atomic write
    monkeypatch.setattr(os, "link", lambda *a: (_ for _ in ()).throw(PermissionError(1, "no links here")))
    resumed.save(last, {"step": 7, "t": torch.ones(2)}, 7)
    assert sorted(step_checkpoints(folder)) == [6, 7] and load_checkpoint(last)["step"] == 7
    assert not (folder / "last.pt").samefile(folder / "step_000007.pt")
    # a new run in the same folder (train.overwrite=true) deletes the replaced run's step files once it saved
    fresh = StepCheckpoints(folder, keep=2)
    fresh.save(last, {"step": 2}, 2)
    assert sorted(step_checkpoints(folder)) == [2] and not list(folder.glob(".*.tmp"))


def test_kept_step_files_alone_make_a_folder_a_run(tmp_path):
    paths = RunPaths(tmp_path)
    StepCheckpoints(paths.checkpoints, keep=2).save(paths.checkpoints / "other.pt", {"step": 5}, 5)
    (paths.checkpoints / "other.pt").unlink()
    cfg = OmegaConf.create({"render_only": False, "train": {"resume": False, "overwrite": False}})
    with pytest.raises(RunError, match="step_000005.pt"):
        refuse_to_overwrite(cfg, paths)


def test_device_memory_reports_the_cuda_allocators_counters(monkeypatch):
    """training.scenes.device_memory: None off CUDA; on CUDA the allocator's counters by our names, and None for a
    counter this torch's allocator does not keep (never a made-up 0)."""
    from training.scenes import ALLOCATOR_STATS, device_memory

    assert device_memory(torch.device("cpu")) is None
    stats = {key: 1000 + i for i, key in enumerate(ALLOCATOR_STATS.values())}
    del stats["segment.all.freed"]
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: asked.append(device) or stats)
    report = device_memory(torch.device("cuda", 1))
    assert asked == [torch.device("cuda", 1)]
    assert report == {
        "allocated_bytes": 1000,
        "peak_memory_bytes": 1001,
        "peak_reserved_bytes": 1002,
        "device_mallocs": 1003,
        "device_frees": None,
        "alloc_retries": 1005,
    }
