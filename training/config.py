"""The app's config: one typed schema (dataclasses registered in Hydra's ConfigStore; the YAML files under
configs/ are presets of it) and the value and cross-field rules the types cannot state, checked in one place.

Hydra enforces the schema while composing: an unknown key (``train.itres=5``) or a wrong type
(``train.iters=abc``) stops before any of our code runs, with Hydra's error naming the key.
:func:`validate_config` then checks values (ranges, choices, files) and raises :class:`ConfigError` whose one-line
message starts with the key. No ``from __future__ import annotations``: OmegaConf reads field types at runtime.
"""

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.config import ModelConfig, parse_model_config
from models.ops import EARLIER_KEYS, OP_NAMES

DEVICES = ("auto", "cpu", "cuda")
OP_BACKENDS = ("custom", "torch")
DATASETS = ("synthetic", "blender")


@dataclass
class OpsConfig:
    """Backend per op family: ``custom`` (cuda_ext kernels) or ``torch`` (cuda_ext.reference)."""

    grid_interpolate: str = "custom"  # the trilinear lookup in the voxel grids
    upsample_bilinear2d: str = "custom"  # the deferred decoder's feature upsampling
    gelu: str = "custom"  # the decoder's activation
    volume_render: str = "custom"  # compositing of packed samples into colour, opacity, depth
    sparse_adam_step: str = "custom"  # train.sparse_adam's update of the touched voxels
    trilinear: Optional[str] = None  # earlier name of grid_interpolate (set: overrides it)
    upsample: Optional[str] = None  # earlier name of upsample_bilinear2d (set: overrides it)


@dataclass
class DataConfig:
    """What every scene source has; configs/data/*.yaml are the presets."""

    name: str = MISSING
    root: Optional[str] = None
    downscale: int = 1
    background: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    near: float = 2.0
    far: float = 6.0
    scene_box: float = 1.5
    tight_box: bool = False


@dataclass
class BlenderDataConfig(DataConfig):
    name: str = "blender"


@dataclass
class SyntheticDataConfig(DataConfig):
    """The built-in procedural scene (data/synthetic.py)."""

    name: str = "synthetic"
    resolution: int = 96
    n_train: int = 48
    n_val: int = 8
    n_test: int = 16
    scene_seed: int = 0
    cache_dir: Optional[str] = None


@dataclass
class TrainConfig:
    """configs/train/default.yaml says what each one means."""

    iters: int = 1500
    lr: float = 0.1
    lr_decoder: float = 0.001
    lr_final_factor: float = 0.1
    batch_rays: int = 8192
    patch_size: int = 8
    patches_per_batch: int = 16
    log_every: int = 25
    checkpoint_every: int = 500
    eval_every: int = 0
    eval_views: int = 4
    resume: bool = False
    profile: bool = False
    render_chunk: int = 8192
    turntable_frames: int = 40
    turntable_max_side: int = 400
    adam_eps: float = 1.0e-8
    opacity_loss: float = 0.0
    sparse_adam: bool = False
    tensorboard: Any = "auto"  # auto (on when the package is installed) | true | false
    dist_timeout: float = 300.0
    dist_grad_sync: str = "touched"  # touched | dense (training.distributed)
    random_background: bool = False
    overwrite: bool = False


@dataclass
class Config:
    """The whole config of ``train.py`` (configs/config.yaml)."""

    data: DataConfig = MISSING
    model: ModelConfig = field(default_factory=ModelConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    device: str = "auto"
    seed: Optional[int] = 0
    render_only: bool = False


DATA_SCHEMAS = {"synthetic": SyntheticDataConfig, "blender": BlenderDataConfig}


def register_configs() -> None:
    """Put the schema in Hydra's ConfigStore: ``schema`` (the whole config, first in configs/config.yaml's
    defaults) and ``data/<name>_schema`` (extended by configs/data/<name>.yaml)."""
    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for name, schema in DATA_SCHEMAS.items():
        store.store(group="data", name=f"{name}_schema", node=schema)


def typed(cfg: DictConfig | Mapping) -> DictConfig:
    """``cfg`` merged onto the schema (data's by ``data.name``): missing keys get their defaults, unknown keys
    and wrong types raise :class:`ConfigError` naming the key. For configs that did not come through Hydra
    (a checkpoint's, a test's dict)."""
    plain = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else dict(cfg)
    data_name = (plain.get("data") or {}).get("name", "synthetic")
    if data_name not in DATA_SCHEMAS:
        raise ConfigError(f"data.name: unknown dataset {data_name!r} (expected {_one_of(DATASETS)})")
    schema = OmegaConf.structured(Config(data=DATA_SCHEMAS[data_name]()))
    try:
        return OmegaConf.merge(schema, plain)
    except OmegaConfBaseException as error:
        key = getattr(error, "full_key", None) or "config"
        raise ConfigError(f"{key}: {str(error).strip().splitlines()[0]}") from None


_ABSENT = object()


class ConfigError(ValueError):
    """The config cannot be used; the one-line message starts with the offending key."""


def _one_of(choices: tuple[str, ...]) -> str:
    return ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]


def _get(cfg: DictConfig, key: str) -> Any:
    """Value at dotted ``key``, or ``_ABSENT`` when the key (or a parent) is missing."""
    try:
        return OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=True)
    except OmegaConfBaseException as error:  # '???' placeholders, broken interpolations
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(f"{key}: cannot read value ({message})") from None


def _check_choice(cfg: DictConfig, key: str, choices: tuple[str, ...], noun: str) -> Any:
    value = _get(cfg, key)
    if value is not _ABSENT and value not in choices:
        raise ConfigError(f"{key}: unknown {noun} {value!r} (expected {_one_of(choices)})")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(cfg: DictConfig, key: str, minimum: int, maximum: int | None = None, rule: str | None = None) -> None:
    """Integer in [minimum, maximum]; ``rule`` rewords the lower bound (e.g. "> 0" reads better for counts)."""
    value = _get(cfg, key)
    if value is _ABSENT:
        return
    if not _is_int(value):
        raise ConfigError(f"{key}: must be an integer (got {value!r})")
    if value < minimum:
        raise ConfigError(f"{key}: must be {rule or f'>= {minimum}'} (got {value})")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{key}: must be <= {maximum} (got {value})")


def _check_nonnegative_number(cfg: DictConfig, key: str) -> None:
    value = _get(cfg, key)
    if value is _ABSENT:
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{key}: must be a number (got {value!r})")
    if not math.isfinite(value):
        raise ConfigError(f"{key}: must be finite (got {value})")
    if value < 0:
        raise ConfigError(f"{key}: must be >= 0 (got {value:g})")


def _check_bool(cfg: DictConfig, key: str) -> None:
    value = _get(cfg, key)
    if value is not _ABSENT and not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false (got {value!r})")


def _check_device(cfg: DictConfig) -> None:
    if _check_choice(cfg, "device", DEVICES, "device") == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda requested but CUDA is not available (use device=auto or device=cpu)")


def _check_ops(cfg: DictConfig) -> None:
    for name in (*OP_NAMES, *EARLIER_KEYS):
        if _get(cfg, f"ops.{name}") is not None:
            _check_choice(cfg, f"ops.{name}", OP_BACKENDS, "backend")


def _check_data(cfg: DictConfig) -> None:
    name = _check_choice(cfg, "data.name", DATASETS, "dataset")
    _check_int(cfg, "data.downscale", minimum=1)
    _check_bool(cfg, "data.tight_box")
    for key in ("data.resolution", "data.n_train", "data.n_val"):  # the synthetic scene's size
        _check_int(cfg, key, minimum=1, rule="> 0")
    _check_int(cfg, "data.n_test", minimum=0)
    if name != "blender":
        return  # the synthetic scene is generated, whatever data.root says
    root = _get(cfg, "data.root")
    if root is _ABSENT or root is None or root == "":
        raise ConfigError("data.root: required for data.name=blender (the folder holding transforms_*.json)")
    if not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"data.root: must be a path (got {root!r})")
    folder = Path(root).expanduser()
    if not folder.exists():
        raise ConfigError(f"data.root: {root} does not exist")
    if not folder.is_dir():
        raise ConfigError(f"data.root: {root} is not a directory")
    if not any(folder.glob("transforms_*.json")):
        raise ConfigError(f"data.root: {root} contains no transforms_*.json (not a blender-format scene)")


def _check_seed(cfg: DictConfig) -> None:
    if _get(cfg, "seed") is not None:  # null: let the run pick a random seed
        _check_int(cfg, "seed", minimum=0, maximum=2**32 - 1)  # numpy's seeding range


def _check_train(cfg: DictConfig) -> None:
    _check_int(cfg, "train.iters", minimum=1, rule="> 0")
    _check_nonnegative_number(cfg, "train.lr")
    _check_nonnegative_number(cfg, "train.lr_decoder")
    _check_nonnegative_number(cfg, "train.lr_final_factor")
    _check_nonnegative_number(cfg, "train.opacity_loss")
    _check_nonnegative_number(cfg, "train.dist_timeout")
    _check_choice(cfg, "train.dist_grad_sync", ("touched", "dense"), "gradient sync")
    for key in (
        "train.batch_rays",
        "train.patch_size",
        "train.patches_per_batch",
        "train.log_every",
        "train.render_chunk",
        "train.turntable_max_side",
    ):
        _check_int(cfg, key, minimum=1, rule="> 0")
    for key in ("train.checkpoint_every", "train.eval_every", "train.eval_views", "train.turntable_frames"):
        _check_int(cfg, key, minimum=0)
    for key in ("train.resume", "train.profile", "train.overwrite", "train.random_background", "train.sparse_adam"):
        _check_bool(cfg, key)
    eps = _get(cfg, "train.adam_eps")
    if eps is not _ABSENT and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1):
        raise ConfigError(f"train.adam_eps: must be a number in (0, 1) (got {eps!r})")


def _check_schedule(cfg: DictConfig) -> None:
    """model.grow_at: increasing, and every step inside train.iters (a growth after the end never happens)."""
    grow_at, iters = _get(cfg, "model.grow_at"), _get(cfg, "train.iters")
    if grow_at is _ABSENT or grow_at is None or iters is _ABSENT or not _is_int(iters):
        return
    try:
        entries = list(grow_at)
    except TypeError:
        return  # the model config's own check names the type
    steps = [round(g * iters) if isinstance(g, float) else g for g in entries if isinstance(g, (int, float))]
    if any(b <= a for a, b in zip(steps, steps[1:])):
        raise ConfigError(f"model.grow_at: must be increasing (steps or fractions of train.iters), got {list(entries)}")
    late = [g for g, step in zip(entries, steps) if _is_int(g) and step >= iters]
    if late:
        raise ConfigError(
            f"model.grow_at: step {late[0]} is not before train.iters={iters} (the growth would never happen)"
        )


def _check_background(cfg: DictConfig) -> None:
    """data.background (the model's background refers to it: name the key the user wrote)."""
    value = _get(cfg, "data.background")
    if value is _ABSENT:
        return
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    try:
        values = list(value)
    except TypeError:
        values = []
    if len(values) != 3 or not all(
        isinstance(c, (int, float)) and not isinstance(c, bool) and 0 <= c <= 1 for c in values
    ):
        raise ConfigError(f"data.background: must be 3 numbers in [0, 1] (RGB), got {value!r}")


def _check_render_only(cfg: DictConfig) -> None:
    _check_bool(cfg, "render_only")


def _check_model(cfg: DictConfig) -> None:
    model = _get(cfg, "model")
    if model is _ABSENT:
        return
    try:
        parse_model_config(OmegaConf.to_container(model, resolve=True) if isinstance(model, DictConfig) else model)
    except ValueError as error:
        raise ConfigError(str(error)) from None


_CHECKS: tuple[Callable[[DictConfig], None], ...] = (
    _check_device,
    _check_seed,
    _check_ops,
    _check_train,
    _check_data,
    _check_background,
    _check_schedule,
    _check_render_only,
    _check_model,
)


def validate_config(cfg: DictConfig | Mapping) -> None:
    """Raise :class:`ConfigError` (one line, naming the key) for the first unusable setting in ``cfg``.

    Checked when present (a missing key is left to the caller's defaults): ``device`` in auto|cpu|cuda
    (cuda needs a visible GPU), ``seed`` an integer in [0, 2**32) or null,
    ``ops.{grid_interpolate,upsample_bilinear2d,gelu}``
    in custom|torch, ``train.iters`` > 0, ``train.lr`` and ``train.lr_decoder`` >= 0, ``data.name`` in
    synthetic|blender, ``data.root`` an existing folder with transforms_*.json when data.name=blender,
    ``data.downscale`` an integer >= 1 (and the synthetic scene's sizes), ``render_only`` a bool, and the
    trainer's counts (``train.batch_rays`` etc. > 0, ``train.checkpoint_every`` etc. >= 0) and flags.
    """
    if isinstance(cfg, Mapping) and not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"cfg must be an OmegaConf DictConfig or a mapping, got {type(cfg).__name__}")
    for check in _CHECKS:
        check(cfg)
