"""train.tensorboard: the run's scalars and evaluations read back from the event files; the optional package."""

from __future__ import annotations

import pytest

from training import tensorboard as tb
from training.config import ConfigError


def test_a_run_writes_scalars_and_evaluations_that_tensorboard_reads_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_train import run_train, tiny_overrides

    run = tmp_path / "run"
    overrides = tiny_overrides(tmp_path / "cache", 8) + [
        f"hydra.run.dir={run}",
        "train.tensorboard=true",
        "train.log_every=2",
        "train.eval_every=4",
        "train.turntable_frames=0",
    ]
    result = run_train(overrides)
    assert result.returncode == 0, result.stderr
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/psnr",
        "train/rays_per_second",
        "train/resolution",
        "train/occupancy",
        "train/lr_grids",
        "train/lr_decoder",
        "eval/psnr",
        "eval/ssim",
    }
    assert expected <= scalars, scalars
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6, 8]
    assert [e.step for e in events.Scalars("eval/psnr")] == [4]
    assert events.Tags()["images"], "the evaluation image is missing"


def test_off_writes_nothing(tmp_path):
    logger = tb.TensorBoardLogger(tmp_path / "tb", False)
    logger.scalars(1, loss=0.5)
    logger.close()
    assert not (tmp_path / "tb").exists() and not logger.enabled


def test_asked_for_without_the_package_stops_with_a_hint(tmp_path, monkeypatch):
    monkeypatch.setattr(tb, "tensorboard_available", lambda: False)
    with pytest.raises(ConfigError, match=r'train.tensorboard: .*pip install -e "\.\[tensorboard\]"'):
        tb.TensorBoardLogger(tmp_path / "tb", True)
    assert not tb.TensorBoardLogger(tmp_path / "tb", "auto").enabled  # auto: quietly off
    with pytest.raises(ConfigError, match="train.tensorboard: expected auto, true or false"):
        tb.TensorBoardLogger(tmp_path / "tb", "yes")
