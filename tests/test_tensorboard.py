"""train.tensorboard: the run's scalars and evaluations read back from the event files; the optional package."""

from __future__ import annotations

import io
import json

import imageio.v3 as iio
import numpy as np
import pytest
from PIL import Image

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
    # metrics.json keeps each periodic evaluation's own time (the command's periodic_eval is their sum)
    metrics = json.loads((run / "metrics.json").read_text())
    (entry,) = metrics["eval_history"]
    assert entry["step"] == 4 and 0 < entry["seconds"] <= metrics["seconds"]["periodic_eval"]
    # the held-out curve beside the batch one: a real plot (axes and a line), not an empty canvas
    curve = iio.imread(run / "renders" / "heldout_curve.png")
    assert curve.ndim == 3 and (curve[..., :3] < 128).any() and (curve[..., :3] == 255).mean() > 0.5


def test_the_logger_writes_scalars_and_images_that_tensorboard_reads_back(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install -e '.[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = tb.TensorBoardLogger(tmp_path / "tb", None)  # None = auto: on, since the package is here
    assert logger.enabled
    logger.scalars(10, loss=0.25, psnr=21.5, lr_grids=0.1, rays_per_second=1234.0, resolution=32, occupancy=0.4)
    logger.scalars(20, loss=0.125, psnr=24.0, skipped=None)  # None values are left out
    image = np.zeros((6, 8, 3), np.uint8)
    image[:, :4, 0] = 255  # left half red
    logger.evaluation(20, 23.5, 0.875, {"view_000": image})
    logger.close()
    logger.close()  # twice is fine

    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    tags = events.Tags()
    assert set(tags["scalars"]) == {
        "train/loss",
        "train/psnr",
        "train/lr_grids",
        "train/rays_per_second",
        "train/resolution",
        "train/occupancy",
        "eval/psnr",
        "eval/ssim",
    }
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(10, 0.25), (20, 0.125)]
    assert [(e.step, e.value) for e in events.Scalars("train/psnr")] == [(10, 21.5), (20, 24.0)]
    assert [(e.step, e.value) for e in events.Scalars("eval/ssim")] == [(20, 0.875)]
    assert events.Scalars("train/resolution")[0].value == 32
    assert tags["images"] == ["eval/view_000"]
    (written,) = events.Images("eval/view_000")
    assert (written.step, written.width, written.height) == (20, 8, 6)
    decoded = np.asarray(Image.open(io.BytesIO(written.encoded_image_string)).convert("RGB"))
    np.testing.assert_array_equal(decoded, image)  # PNG: lossless


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
