"""The config's value and cross-field rules, checked in one place (:func:`validate_config`).

The schema (training/config.py) fixes keys and types; these rules check what types cannot state: ranges,
choices, files, and keys that depend on each other. Every failure is a :class:`ConfigError` whose one-line
message starts with the offending key.
"""

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.colmap import find_model
from data.errors import SceneError
from data.orientation import ORIENT_METHODS
from models.config import parse_model_config
from models.ops import OP_NAMES
from training.losses import PHOTOMETRIC_LOSSES
from training.metrics import SSIM_WINDOW

DEVICES = ("auto", "cpu", "cuda")
OP_BACKENDS = ("custom", "torch")
DATASETS = ("synthetic", "blender", "nerfstudio", "colmap")


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


def sparse_adam_mode(setting) -> str:
    """``train.sparse_adam`` -> "off" (dense Adam) | "occupied" (dense Adam on the voxels of occupied cells, empty
    space keeps value and moments: training.optim.OccupiedRows; the fine pool as nonzero's) | "nonzero" (the coarse
    and fine grids' elements with a non-zero gradient, found by the kernel: ``masked_adam_step``). ValueError naming
    the key otherwise."""
    modes = {"false": "off", "occupied": "occupied", "nonzero": "nonzero"}
    if str(setting).lower() not in modes:
        raise ValueError(f"train.sparse_adam: expected false, occupied or nonzero, got {setting!r}")
    return modes[str(setting).lower()]


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
    for name in OP_NAMES:
        if _get(cfg, f"ops.{name}") is not None:
            _check_choice(cfg, f"ops.{name}", OP_BACKENDS, "backend")


def _check_data(cfg: DictConfig) -> None:
    name = _check_choice(cfg, "data.name", DATASETS, "dataset")
    _check_int(cfg, "data.downscale", minimum=1)
    _check_bool(cfg, "data.tight_box")
    for key in ("data.resolution", "data.n_train", "data.n_val"):  # the synthetic scene's size
        _check_int(cfg, key, minimum=1, rule="> 0")
    _check_int(cfg, "data.n_test", minimum=0)
    if name in ("nerfstudio", "colmap"):
        return _check_nerfstudio(cfg, name)
    for key in ("data.near", "data.far", "data.scene_box"):  # null or a list only make sense for nerfstudio
        if _get(cfg, key) is None or OmegaConf.is_list(_get(cfg, key)):
            raise ConfigError(f"{key}: must be a number for data.name={name} (got {_get(cfg, key)!r})")
        _check_nonnegative_number(cfg, key)
    if name != "blender":
        return  # the synthetic scene is generated, whatever data.root says
    root, folder = _existing_root(cfg, "blender", "the folder holding transforms_*.json")
    if not folder.is_dir():
        raise ConfigError(f"data.root: {root} is not a directory")
    if not any(folder.glob("transforms_*.json")):
        raise ConfigError(f"data.root: {root} contains no transforms_*.json (not a blender-format scene)")


def _existing_root(cfg: DictConfig, name: str, holding: str) -> tuple[Any, Path]:
    """data.root as given and as an existing path; a ConfigError naming the key when it is unset, not a path or
    missing (``holding`` says what it should be, for data.name=``name``)."""
    root = _get(cfg, "data.root")
    if root is _ABSENT or root is None or root == "":
        raise ConfigError(f"data.root: required for data.name={name} ({holding})")
    if not isinstance(root, (str, os.PathLike)):
        raise ConfigError(f"data.root: must be a path (got {root!r})")
    path = Path(root).expanduser()
    if not path.exists():
        raise ConfigError(f"data.root: {root} does not exist")
    return root, path


def _check_nerfstudio(cfg: DictConfig, name: str) -> None:
    """data.root: a folder with transforms.json (or the JSON file), or for colmap a COLMAP folder; scene_box, near,
    far: null or usable."""
    _check_int(cfg, "data.eval_interval", minimum=2)
    if _get(cfg, "data.orient") not in (*ORIENT_METHODS, _ABSENT):
        raise ConfigError(f"data.orient: must be one of {', '.join(ORIENT_METHODS)}, got {_get(cfg, 'data.orient')!r}")
    if name == "colmap":
        root, path = _existing_root(cfg, name, "the folder holding images/ and sparse/0")
        try:
            find_model(path)
        except SceneError as error:
            raise ConfigError(f"data.root: {error}") from None
    else:
        root, path = _existing_root(cfg, name, "the folder holding transforms.json")
        if not (path.is_file() or (path / "transforms.json").is_file()):
            raise ConfigError(f"data.root: {root} contains no transforms.json (not a nerfstudio-format scene)")
    bounds = {key: _get(cfg, f"data.{key}") for key in ("near", "far")}
    for key, value in bounds.items():
        if value not in (None, _ABSENT):
            _check_nonnegative_number(cfg, f"data.{key}")
    if all(isinstance(v, (int, float)) for v in bounds.values()) and not bounds["near"] < bounds["far"]:
        raise ConfigError(f"data.far: must be > data.near (got near={bounds['near']}, far={bounds['far']})")
    box = _get(cfg, "data.scene_box")
    if box in (None, _ABSENT):
        return
    values = list(box) if isinstance(box, (list, tuple)) or OmegaConf.is_list(box) else [box]
    numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)
    if not numeric or len(values) not in (1, 6):
        raise ConfigError(f"data.scene_box: must be null, a half size or 6 numbers (min x y z, max x y z), got {box!r}")
    if (len(values) == 1 and not values[0] > 0) or (
        len(values) == 6 and not all(values[i + 3] > values[i] for i in range(3))
    ):
        raise ConfigError(f"data.scene_box: must be a positive half size or min < max on every axis, got {box!r}")


def _check_seed(cfg: DictConfig) -> None:
    if _get(cfg, "seed") is not None:  # null: let the run pick a random seed
        _check_int(cfg, "seed", minimum=0, maximum=2**32 - 1)  # numpy's seeding range


def _check_train(cfg: DictConfig) -> None:
    _check_int(cfg, "train.iters", minimum=1, rule="> 0")
    _check_nonnegative_number(cfg, "train.lr")
    _check_nonnegative_number(cfg, "train.lr_decoder")
    _check_nonnegative_number(cfg, "train.lr_final_factor")
    _check_nonnegative_number(cfg, "train.opacity_loss")
    for key in ("train.distortion_loss", "train.near_density_loss", "train.near_density_fraction"):
        _check_nonnegative_number(cfg, key)  # the floater regularisers (training/losses.py)
    for key in ("train.lr_pose", "train.pose_penalty"):
        _check_nonnegative_number(cfg, key)  # model.pose_refinement (models/pose_refinement.py)
    _check_choice(cfg, "train.loss", PHOTOMETRIC_LOSSES, "photometric loss")
    _check_batch_form(cfg)
    _check_nonnegative_number(cfg, "train.dist_timeout")
    _check_choice(cfg, "train.dist_grad_sync", ("touched", "dense"), "gradient sync")
    _check_choice(cfg, "train.parallel", ("auto", "data", "space"), "parallel split")
    sparse = _get(cfg, "train.sparse_adam")
    if sparse is not _ABSENT:
        try:
            sparse_adam_mode(sparse)
        except ValueError as error:
            raise ConfigError(str(error)) from None
    for key in (
        "train.batch_rays",
        "train.patch_size",
        "train.patches_per_batch",
        "train.log_every",
        "train.render_chunk",
        "train.turntable_max_side",
        "train.keep_checkpoints",
    ):
        _check_int(cfg, key, minimum=1, rule="> 0")
    for key in (
        "train.checkpoint_every",
        "train.eval_every",
        "train.eval_views",
        "train.eval_final_views",
        "train.turntable_frames",
    ):
        _check_int(cfg, key, minimum=0)
    for key in (
        "train.resume",
        "train.overwrite",
        "train.random_background",
        "train.pixel_jitter",
        "train.tf32",
        "train.batch_graph",
        "train.step_graph",
    ):
        _check_bool(cfg, key)
    if _get(cfg, "train.step_graph") is True and _get(cfg, "model.capped_samples") is not True:
        raise ConfigError("train.step_graph: needs model.capped_samples=true (a graph's sample counts are fixed)")
    profile = _get(cfg, "train.profile")
    if profile is not _ABSENT and not isinstance(profile, bool) and profile != "host":
        raise ConfigError(f"train.profile: must be true, false or host (got {profile!r})")
    _check_viewer(cfg)
    eps = _get(cfg, "train.adam_eps")
    if eps is not _ABSENT and (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1):
        raise ConfigError(f"train.adam_eps: must be a number in (0, 1) (got {eps!r})")


def _check_batch_form(cfg: DictConfig) -> None:
    """D-SSIM needs patches wide enough for its window; pixel jitter needs single rays."""
    _check_nonnegative_number(cfg, "train.dssim")
    weight = _get(cfg, "train.dssim")
    if weight is not _ABSENT and weight > 0:
        upsample, side = _get(cfg, "model.upsample"), _get(cfg, "train.patch_size")
        if upsample * side < SSIM_WINDOW:  # with upsample 1, patches of patch_size pixels replace single rays
            raise ConfigError(
                f"train.dssim: needs patch batches of at least {SSIM_WINDOW} pixels a side "
                f"(train.patch_size * model.upsample >= {SSIM_WINDOW}), got upsample={upsample}, patch_size={side}"
            )
    if _get(cfg, "train.pixel_jitter") is True and (
        _get(cfg, "model.upsample") not in (_ABSENT, 1) or weight not in (_ABSENT, 0)
    ):
        raise ConfigError(
            "train.pixel_jitter: jitters single rays, so it needs per-pixel ray batches (model.upsample 1 and "
            "train.dssim 0), not patches"
        )


def _check_viewer(cfg: DictConfig) -> None:
    _check_bool(cfg, "train.viewer")
    _check_int(cfg, "train.viewer_port", minimum=1, maximum=65535)
    _check_int(cfg, "train.viewer_resolution", minimum=32, maximum=4096)
    budget = _get(cfg, "train.viewer_budget")
    if budget is not _ABSENT and (
        not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 < budget <= 1
    ):
        raise ConfigError(f"train.viewer_budget: must be a fraction in (0, 1] (got {budget!r})")


def _check_schedule(cfg: DictConfig) -> None:
    """model.grow_at and model.fine.grow_at: increasing, and every step inside train.iters (a growth after the end
    never happens)."""
    iters = _get(cfg, "train.iters")
    if iters is _ABSENT or not _is_int(iters):
        return
    for key in ("model.grow_at", "model.fine.grow_at"):
        grow_at = _get(cfg, key)
        if grow_at is _ABSENT or grow_at is None:
            continue
        try:
            entries = list(grow_at)
        except TypeError:
            continue  # the model config's own check names the type
        steps = [round(g * iters) if isinstance(g, float) else g for g in entries if isinstance(g, (int, float))]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ConfigError(f"{key}: must be increasing (steps or fractions of train.iters), got {list(entries)}")
        late = [g for g, step in zip(entries, steps) if _is_int(g) and step >= iters]
        if late:
            raise ConfigError(f"{key}: step {late[0]} is not before train.iters={iters} (that growth would never come)")


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
    synthetic|blender|nerfstudio, ``data.root`` an existing folder with transforms_*.json when data.name=blender
    (transforms.json for nerfstudio, with its data.scene_box / near / far null or usable),
    ``data.downscale`` an integer >= 1 (and the synthetic scene's sizes), ``render_only`` a bool, and the
    trainer's counts (``train.batch_rays``, ``train.keep_checkpoints`` etc. > 0, ``train.checkpoint_every``,
    ``train.eval_final_views`` etc. >= 0) and flags.
    """
    if isinstance(cfg, Mapping) and not isinstance(cfg, DictConfig):
        cfg = OmegaConf.create(dict(cfg))
    if not isinstance(cfg, DictConfig):
        raise TypeError(f"cfg must be an OmegaConf DictConfig or a mapping, got {type(cfg).__name__}")
    for check in _CHECKS:
        check(cfg)
