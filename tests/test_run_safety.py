"""Runs that never lose work or mislead: sweeps, finished run folders, write errors, stale
temporary files, degenerate cameras, config gaps, exploding losses, memory and disk pre-flight checks,
cross-device resume, train.log and render_only's own config copy. CPU, tiny scenes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_train import REPO, read_metrics, run_train, tiny_overrides

import training.app as app_module
import training.trainer as trainer_module
from data import SceneError, load_blender
from data.blender import write_blender_split
from training import run_checkpoints
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import ConfigError, validate_config
from training.preflight import (
    PreflightError,
    check_disk,
    check_memory,
    check_writable,
    device_memory_bytes,
    fine_pool_rows,
    grid_voxels,
    training_bytes,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("scene_cache")


def run_in_process(overrides: list[str], run_dir: Path) -> int:
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    return app_module.run(cfg, run_dir)


def test_a_sweep_runs_every_job_and_reports_the_failed_one(tmp_path, cache):
    sweep = tmp_path / "sweep"
    args = (
        ["-m"]
        + tiny_overrides(cache, 4)[:2]
        + [o for o in tiny_overrides(cache, 4)[3:]]
        + ["train.iters=4,6", "model.grow_at=[0.3]", "train.turntable_frames=0", f"hydra.sweep.dir={sweep}"]
    )
    result = run_train(args, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_metrics(sweep / "0")["iters"] == 4 and read_metrics(sweep / "1")["iters"] == 6
    # a failing job (train.lr=-1 is refused) does not stop the next one; the exit code says something failed
    failing = run_train(
        args[:-3]
        + ["train.lr=-1,0.1", "train.iters=4", "train.turntable_frames=0", f"hydra.sweep.dir={tmp_path / 'sweep2'}"],
        timeout=300,
    )
    assert failing.returncode == 2
    assert "job #0 failed" in failing.stderr and "1 job(s) of the sweep failed" in failing.stderr
    assert (tmp_path / "sweep2" / "1" / "metrics.json").is_file()


def test_a_finished_run_is_never_overwritten_without_asking(tmp_path, cache, capsys):
    run_dir = tmp_path / "run"
    assert run_in_process(tiny_overrides(cache, 5) + ["train.turntable_frames=0"], run_dir) == 0
    before = (run_dir / "model.pt").read_bytes()  # a finished run keeps its model, not its resumable checkpoint
    assert not (run_dir / "checkpoints").exists()
    (run_dir / "metrics.json").unlink()  # model.pt alone makes the folder a run
    assert run_in_process(tiny_overrides(cache, 3) + ["train.turntable_frames=0"], run_dir) == 2
    assert "already holds a run (model.pt)" in capsys.readouterr().err
    assert (run_dir / "model.pt").read_bytes() == before
    assert run_in_process(tiny_overrides(cache, 5) + ["train.turntable_frames=0", "render_only=true"], run_dir) == 0
    assert read_metrics(run_dir)["iters"] == 5 and read_metrics(run_dir)["render_only"]
    stale = run_dir / "checkpoints" / ".last.pt.killed.tmp"
    stale.parent.mkdir()
    stale.write_bytes(b"half a checkpoint")
    assert run_in_process(tiny_overrides(cache, 3) + ["train.turntable_frames=0", "train.overwrite=true"], run_dir) == 0
    assert read_metrics(run_dir)["iters"] == 3 and not stale.exists()
    assert "eval on" in (run_dir / "train.log").read_text()  # the run's lines are in train.log


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(tmp_path, cache, monkeypatch, capsys):
    calls = []

    def full_disk(path, state):
        calls.append(state["step"])
        if len(calls) > 1:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")
        save_checkpoint(path, state)

    monkeypatch.setattr(run_checkpoints, "save_checkpoint", full_disk)  # the background writer's save
    run_dir = tmp_path / "run"
    code = run_in_process(tiny_overrides(cache, 12) + ["train.checkpoint_every=5", "train.turntable_frames=0"], run_dir)
    assert code == 2
    err = capsys.readouterr().err
    assert "the disk is full" in err and "previous checkpoint (step 5) is kept" in err and "Traceback" not in err
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 5


def test_a_failed_render_write_fails_the_run_naming_the_file(tmp_path, cache, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "renders" / "000_pred.png").mkdir(parents=True)  # a folder in the way of one PNG
    assert run_in_process(tiny_overrides(cache, 3) + ["train.turntable_frames=0"], run_dir) == 2
    err = capsys.readouterr().err
    assert "cannot write the render" in err and "000_pred.png" in err and "Traceback" not in err
    assert not (run_dir / "metrics.json").exists()


def test_a_finished_run_keeps_its_model_and_an_unfinished_one_its_checkpoint(tmp_path, cache, monkeypatch, capsys):
    run_dir, overrides = tmp_path / "run", tiny_overrides(cache, 8) + ["train.turntable_frames=0"]
    original = trainer_module.Trainer.train_step

    def stop_at_five(self):  # as a SIGTERM at step 5 would: the loop saves, joins the write and stops
        out = original(self)
        if self.step == 5:
            import signal

            signal.raise_signal(signal.SIGTERM)
        return out

    monkeypatch.setattr(trainer_module.Trainer, "train_step", stop_at_five)
    assert run_in_process(overrides + ["train.checkpoint_every=2"], run_dir) == 128 + 15
    monkeypatch.undo()
    assert load_checkpoint(run_dir / "checkpoints" / "last.pt")["step"] == 5 and not (run_dir / "model.pt").exists()
    # resume continues the unfinished run; at its successful end model.pt stays and last.pt goes
    assert run_in_process(overrides + ["train.resume=true"], run_dir) == 0
    metrics = read_metrics(run_dir)
    assert metrics["iters"] == 8 and not (run_dir / "checkpoints" / "last.pt").exists()
    assert metrics["model_bytes"] == (run_dir / "model.pt").stat().st_size
    assert metrics["startup_seconds"] > 0 and metrics["wall_seconds"] >= metrics["startup_seconds"]
    assert set(metrics["seconds"]) == {"startup", "train", "eval", "checkpoint", "output", "periodic_eval", "other"}
    assert metrics["eval_rays_per_second"] > 0
    # resuming a finished run that kept only its model says what to do
    assert run_in_process(overrides + ["train.resume=true", "train.iters=10"], run_dir) == 2
    assert "train.keep_resumable=true keeps it" in capsys.readouterr().err
    # train.keep_resumable keeps both, and the resumable one continues
    kept = tmp_path / "kept"
    assert run_in_process(overrides + ["train.keep_resumable=true"], kept) == 0
    assert load_checkpoint(kept / "checkpoints" / "last.pt")["step"] == 8 and (kept / "model.pt").is_file()
    assert run_in_process(overrides[:2] + ["train.iters=10", "train.resume=true"] + overrides[3:], kept) == 0
    assert read_metrics(kept)["iters"] == 10


def test_exploding_loss_stops_the_run_naming_the_cause(tmp_path, cache, monkeypatch, capsys):
    original = trainer_module.VoxelNeRF.regularization
    monkeypatch.setattr(trainer_module.VoxelNeRF, "regularization", lambda self, **_: original(self) + 2.5e20)
    code = run_in_process(tiny_overrides(cache, 6) + ["train.turntable_frames=0"], tmp_path / "run")
    assert code == trainer_module.EXIT_DIVERGED
    assert "exploding" in capsys.readouterr().err


def test_preflight_checks_name_the_setting_or_path(tmp_path):
    with pytest.raises(PreflightError, match="hydra.run.dir: /proc/.* is not writable"):
        check_writable(Path("/proc/voxel-field-test"))
    with pytest.raises(PreflightError, match="GiB free"):
        check_disk(tmp_path, 1 << 62)
    with pytest.raises(ConfigError, match="model.resolution_end: 2000"):
        check_memory(torch.device("cpu"), 2000**3, 12, 2000)
    have = device_memory_bytes(torch.device("cpu"))
    grid = int(0.5 * have / training_bytes(1, 12))  # half the memory: the grids fit
    assert check_memory(torch.device("cpu"), grid, 12, 320, fine_rows=1000) == 1000  # and a small pool beside them
    room = check_memory(torch.device("cpu"), grid, 12, 320, fine_rows=grid)  # a pool as large: capped to what fits
    assert 0.3 * grid < room < 0.9 * grid


def test_a_fine_pool_beyond_memory_is_capped_not_refused(tmp_path, cache, monkeypatch, capsys):
    import training.preflight as preflight

    grids = training_bytes(12**3, 6)  # the tiny run's grids; memory for them and 5 bricks of 4^3 rows beside them
    monkeypatch.setattr(
        preflight, "device_memory_bytes", lambda device: int((grids + 5.5 * 64 * training_bytes(1, 6)) / 0.9)
    )
    fine = ["model.fine.factor=2", "model.fine.brick=4", "model.fine.at=4", "model.fine.max_bricks=1000"]
    code = run_in_process(tiny_overrides(cache, 6) + fine + ["train.turntable_frames=0"], tmp_path / "run")
    out = capsys.readouterr().out
    assert code == trainer_module.EXIT_OK and "fine grid: memory for 5 bricks" in out
    assert "capped by the device's memory" in out
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["fine_grid"]["bricks"] == 5


def test_preflight_counts_the_contracted_cube_and_the_fine_pool():
    assert grid_voxels((1.0, 2.0, 4.0), 5) == 2 * 3 * 5 and grid_voxels((1.0, 2.0, 4.0), 5, contracted=True) == 125
    assert fine_pool_rows(OmegaConf.create({"fine": {"factor": 0, "max_bricks": 10, "brick": 8}})) == 0
    assert fine_pool_rows(OmegaConf.create({"fine": {"factor": 4, "max_bricks": 10, "brick": 8}})) == 5120
    assert fine_pool_rows(OmegaConf.create({})) == 0


def test_a_grid_too_big_for_memory_stops_before_any_work(tmp_path, cache):
    result = run_train(tiny_overrides(cache, 3) + [f"hydra.run.dir={tmp_path}", "model.resolution_end=4000"])
    assert result.returncode == 2 and "model.resolution_end: 4000" in result.stderr and "Traceback" not in result.stderr


def test_config_gaps_are_named_in_their_own_group():
    for override, message in [
        ({"model": {"grow_at": [0.5, 0.2]}, "train": {"iters": 100}}, "model.grow_at: must be increasing"),
        ({"model": {"grow_at": [50, 200]}, "train": {"iters": 100}}, "model.grow_at: step 200"),
        ({"data": {"background": [1, 1]}}, "data.background"),
        ({"train": {"overwrite": "yes"}}, "train.overwrite"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_config(OmegaConf.create(override))


@pytest.mark.parametrize(
    "rotation,message",
    [(np.zeros((3, 3)), "zero rotation block"), (np.array([[1.0, 1.0, 0], [0, 1, 0], [0, 0, 1]]), "not orthonormal")],
)
def test_degenerate_cameras_are_refused_naming_the_frame(tmp_path, rotation, message):
    c2w = np.tile(np.eye(4), (2, 1, 1))
    c2w[:, 2, 3] = 4.0
    c2w[1, :3, :3] = rotation
    images = [np.full((4, 4, 4), 200, np.uint8)] * 2
    write_blender_split(tmp_path, "train", images, c2w, 0.7)
    with pytest.raises(SceneError, match=f"frame 1 .*{message}"):
        load_blender(tmp_path, "train")
    c2w[1, :3, :3] = 2.5 * np.eye(3)  # a rotation up to scale is fine
    write_blender_split(tmp_path, "train", images, c2w, 0.7)
    load_blender(tmp_path, "train")


def test_resume_across_device_types_and_render_only_keep_their_configs_apart(tmp_path, cache, capsys):
    run_dir = tmp_path / "run"
    overrides = tiny_overrides(cache, 6) + ["train.turntable_frames=0", "train.checkpoint_every=3"]
    assert run_in_process(overrides[:2] + ["train.iters=3", "train.keep_resumable=true"] + overrides[3:], run_dir) == 0
    path = run_dir / "checkpoints" / "last.pt"
    state = load_checkpoint(path)
    state["sampler_generator"] = torch.zeros(16, dtype=torch.uint8)  # what a CUDA generator's state looks like
    save_checkpoint(path, state)
    assert run_in_process(overrides + ["train.resume=true"], run_dir) == 0
    assert "another device type" in capsys.readouterr().out
    assert read_metrics(run_dir)["iters"] == 6
    result = run_train(tiny_overrides(cache, 6) + [f"hydra.run.dir={run_dir}", "render_only=true"])
    assert result.returncode == 0, result.stderr
    assert (run_dir / ".hydra_render" / "config.yaml").is_file()


def _png_16bit(path: Path, channels: int) -> None:
    """A 16-bit PNG written by hand (PIL cannot write 16-bit colour): colour type 0 (grey), 2 (RGB), 6 (RGBA)."""
    import struct
    import zlib

    height, width = 3, 4
    colour_type = {1: 0, 3: 2, 4: 6}[channels]
    rows = b"".join(b"\x00" + np.arange(width * channels, dtype=">u2").tobytes() for _ in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 16, colour_type, 0, 0, 0)
    path.write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_16_bit_images_are_refused_the_same_way_for_every_layout(tmp_path, channels):
    from data.images import read_rgba

    path = tmp_path / "wide.png"
    _png_16bit(path, channels)
    with pytest.raises(SceneError, match="16-bit images are not supported"):
        read_rgba(path)


def test_a_read_only_run_folder_is_refused_in_one_line_before_hydra_writes(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_entry", REPO / "train.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    assert entry.read_only_run_dir([f"hydra.run.dir={tmp_path}", "render_only=true"]) is None
    real_access = entry.os.access
    monkeypatch.setattr(
        entry.os, "access", lambda path, mode: False if str(path) == str(tmp_path) else real_access(path, mode)
    )
    message = entry.read_only_run_dir([f"hydra.run.dir={tmp_path}", "render_only=true"])
    assert message.startswith(f"error: hydra.run.dir: {tmp_path} is read-only")
