"""The Hydra app's configuration: bad or mistyped settings stop in one line naming the key, before any work; the
op switches choose each backend; the schema's defaults are the presets'; the step's settings snapshot."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_model import backends
from test_train import run_train

from training.config import ConfigError, validate_config

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["ops.grid_interpolate=bogus"], "ops.grid_interpolate"),
        (["data=blender"], "data.root"),
        (["data=blender", "data.root=/nonexistent/scene"], "data.root"),
        (["train.iters=0"], "train.iters"),
        (["train.lr=-1"], "train.lr"),
        (["device=tpu"], "device"),
        (["model.upsample=0"], "model.upsample"),
    ],
)
def test_bad_config_fails_fast_in_one_line(tmp_path, overrides, key):
    start = time.monotonic()
    result = run_train(overrides + [f"hydra.run.dir={tmp_path}"], timeout=60)
    elapsed = time.monotonic() - start
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}:"), result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert elapsed < 30


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.batch_rays=0", "train.batch_rays"),
        ("train.checkpoint_every=-1", "train.checkpoint_every"),
        ("train.resume=maybe", "train.resume"),
        ("data.n_train=0", "data.n_train"),
        ("seed=-3", "seed"),
        ("train.opacity_loss=-0.1", "train.opacity_loss"),
        ("train.profile=sync", "train.profile"),
        ("train.profile=1", "train.profile"),
    ],
)
def test_validate_config_names_the_key(override, key):
    cfg = OmegaConf.merge(
        OmegaConf.create({"device": "cpu", "train": {"iters": 5, "lr": 0.1}, "data": {"name": "synthetic"}}),
        OmegaConf.from_dotlist([override]),
    )
    with pytest.raises(ConfigError, match=f"^{key}:"):
        validate_config(cfg)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            [],
            backends("custom"),
        ),
        (
            ["ops=torch"],
            backends("torch"),
        ),
        (
            ["ops.upsample_bilinear2d=torch"],
            backends("custom", upsample_bilinear2d="torch"),
        ),
        (
            ["ops=torch", "ops.gelu=custom"],
            backends("torch", gelu="custom"),
        ),
    ],
)
def test_op_overrides_choose_each_backend(overrides, expected):
    from hydra import compose, initialize_config_dir

    from models import build_ops

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    validate_config(cfg)
    assert build_ops(cfg.ops).backends == expected


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.itres=5", "train.itres"),
        ("train.iters=abc", "train.iters"),
        ("model.occupancy.warmpu=3", "model.occupancy.warmpu"),
        ("data.n_train=many", "data.n_train"),
    ],
)
def test_typo_or_wrong_type_stops_in_hydra_naming_the_key(override, key):
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        with pytest.raises(ConfigCompositionException) as raised:
            compose(config_name="config", overrides=[override])
    assert key in str(raised.value) + str(raised.value.__cause__)


def test_typo_on_the_command_line_stops_before_any_work(tmp_path):
    result = run_train(["train.itres=5", f"hydra.run.dir={tmp_path / 'run'}"], timeout=60)
    assert result.returncode != 0 and "train.itres" in result.stderr
    assert not (tmp_path / "run" / "train.log").exists()


def test_schema_defaults_match_the_presets():
    """configs/*/default.yaml and the dataclasses in training/config.py say the same (no drift)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from training.config import Config, SyntheticDataConfig

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = OmegaConf.to_container(compose(config_name="config"), resolve=True)
    schema = OmegaConf.to_container(OmegaConf.structured(Config(data=SyntheticDataConfig())), resolve=True)
    assert cfg == schema


def test_blender_experiment_config_composes():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=["+experiment=blender", "data.root=/some/scene"])
    assert cfg.data.name == "blender" and cfg.data.root == "/some/scene"
    assert cfg.model.background == list(cfg.data.background)


def test_settings_read_as_the_config_node_does():
    """training.config.Settings (the step's plain snapshot of cfg.train) answers every read the node answers."""
    from omegaconf import OmegaConf

    from training.config import Settings

    node = OmegaConf.create({"lr": 0.1, "loss": "mse", "nested": {"a": 1, "deeper": {"b": [1, 2]}}, "x": "${lr}"})
    settings = Settings.of(node)
    assert settings.lr == node.lr and settings.get("loss") == "mse" and settings.get("missing", 3) == 3
    assert settings.nested.a == 1 and settings.nested.deeper.b == [1, 2] and settings.x == 0.1  # resolved
    assert isinstance(settings.nested, Settings) and Settings.of(settings) == settings
    with pytest.raises(AttributeError, match="config has no key 'lrr'"):
        _ = settings.lrr
    with pytest.raises(AttributeError, match="Settings is read-only"):
        settings.lr = 0.2
