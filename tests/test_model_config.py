"""The model's configuration and op set: models.build_ops maps each ops key to its backend and names a bad one; a bad
model setting, an unknown key or a wrong type stops naming the key; defaults are filled."""

from __future__ import annotations

import pytest
from test_model import BBOX, FAR, NEAR, TORCH_OPS, backends, make_cfg, make_model

from models import VoxelNeRF, build_ops


def test_build_ops_maps_each_key_to_its_backend():
    import cuda_ext

    ops = build_ops(backends("custom", upsample_bilinear2d="torch"))
    assert ops.grid_interpolate is cuda_ext.grid_interpolate
    assert ops.upsample_bilinear2d is cuda_ext.reference.upsample_bilinear2d
    assert ops.gelu is cuda_ext.gelu
    assert ops.backends == backends("custom", upsample_bilinear2d="torch")


@pytest.mark.parametrize(
    "ops_cfg, key",
    [
        ({"grid_interpolate": "torch", "upsample_bilinear2d": "torch", "gelu": "cuda"}, "ops.gelu"),
        ({"grid_interpolate": "torch", "upsample_bilinear2d": "torch"}, "ops.gelu"),
        ({"grid_interpolate": "torch", "upsample_bilinear2d": "torch", "gelu": "torch", "relu": "torch"}, "ops.relu"),
    ],
)
def test_build_ops_rejects_bad_config(ops_cfg, key):
    with pytest.raises(ValueError, match=key):
        build_ops(ops_cfg)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("feature_dim", 2, "model.feature_dim"),
        ("upsample", 0, "model.upsample"),
        ("dir_encoding", "sh7", "model.dir_encoding"),
        ("grow_at", [1.5], "model.grow_at"),
        ("occupancy.threshold", -1.0, "model.occupancy.threshold"),
        ("resolution_start", 64, "model.resolution_start"),
        ("background", [1.0, 1.0], "model.background"),
        ("step_ratio", "big", "model.step_ratio"),
        ("early_termination", 1.0, r"model.early_termination: must be in \[0, 1\)"),
        ("weight_threshold", 1.0, r"model.weight_threshold: must be in \[0, 1\)"),
    ],
)
def test_bad_model_config_names_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        make_model(**{key: value})


def test_model_config_fills_defaults_and_names_unknown_keys_and_wrong_types():
    from models.config import ModelConfig

    cfg = make_cfg()
    del cfg["density_shift"]  # a missing key takes the schema's default
    assert VoxelNeRF(BBOX, NEAR, FAR, cfg, build_ops(TORCH_OPS)).config.density_shift == ModelConfig().density_shift
    with pytest.raises(ValueError, match="model.density_shfit"):
        VoxelNeRF(BBOX, NEAR, FAR, {**make_cfg(), "density_shfit": -7.0}, build_ops(TORCH_OPS))
    with pytest.raises(ValueError, match="model.feature_dim"):
        VoxelNeRF(BBOX, NEAR, FAR, {**make_cfg(), "feature_dim": "twelve"}, build_ops(TORCH_OPS))
    with pytest.raises(ValueError, match="model.occupancy.warmup"):
        VoxelNeRF(BBOX, NEAR, FAR, {**make_cfg(), "occupancy": {"warmup": -1}}, build_ops(TORCH_OPS))
