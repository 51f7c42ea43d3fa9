"""The ``model`` config: :class:`ModelConfig` is both the Hydra schema of the ``model`` group (registered by
``training.config``; configs/model/default.yaml is its preset) and the typed settings :class:`VoxelNeRF` reads.

Types are enforced by OmegaConf (a wrong type or an unknown key fails naming the key); :func:`check_model_config`
adds the value rules and raises ValueError naming ``model.<key>``. No ``from __future__ import annotations``
here: OmegaConf reads the field types at runtime.
"""

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.appearance import APPEARANCE_MODES

DIR_ENCODING = re.compile(r"^(none|sh[0-3]|pe[0-9]+)$")
GELU_MODES = ("none", "tanh")
SHADING_MODES = ("deferred", "per_sample")
DECODER_PRECISIONS = ("float32", "bfloat16")
CONTRACTIONS = ("none", "inf")  # models.contraction
POSE_MODES = ("none", "so3xr3")  # models.pose_refinement


@dataclass
class OccupancyConfig:
    """Empty-space skipping: cells whose 8 corner alphas are all below ``threshold`` are skipped."""

    threshold: float = 1.0e-3  # alpha (per sample) below which a cell counts as empty
    refresh_every: int = 50  # steps between rebuilds from the density grid
    warmup: int = 100  # no skipping before this step
    dilate: int = 1  # grow the occupied region by this many cells (lets surfaces move)


@dataclass
class FineConfig:
    """The sparse fine grid (models/brick_grid.py): ``factor`` times finer than the coarse grids, in bricks of
    ``brick``^3 vertices around the occupied cells, allocated after step (int) or fraction (float) ``at``."""

    factor: int = 0  # 0: no fine grid
    brick: int = 4
    at: Any = 0.5
    max_bricks: int = 262144  # the pool's cap (the fullest bricks first)
    collect: int = 200  # steps before ``at`` in which training marks the cells its visible samples lie in
    min_weight: float = 0.01  # a sample's compositing weight from which it counts as visible
    tv: float = 1.0  # the fine grid's TV weight, as a multiple of tv_density / tv_features
    lr: float = 1.0  # its learning rate, as a multiple of the grids' (train.lr)
    min_pixels: float = 0.0  # allocate only if a coarse voxel spans at least this many pixels of the training views
    reach: float = 1.0  # contracted models: bricks out to this L-inf radius of the contracted cube (1: the box, 2: all)
    grow_at: Any = None  # the coarse grids' growth when the fine grid will be used (null: model.grow_at)
    resolution_end: Any = None  # the coarse grids' final resolution then (null: model.resolution_end)


@dataclass
class ModelConfig:
    """VoxelNeRF's settings; configs/model/default.yaml says what each one means."""

    resolution_start: int = 32
    resolution_end: int = 80
    grow_at: list[Any] = field(default_factory=lambda: [0.1, 0.2, 0.3])  # steps (int) or fractions (float)
    feature_dim: int = 12
    feature_init_std: float = 0.1
    density_shift: float = -7.0
    decoder_hidden: int = 64
    decoder_layers: int = 2
    dir_encoding: str = "sh2"
    gelu_approximate: str = "none"
    decoder_precision: str = "float32"  # bfloat16: the MLP under CUDA autocast (CPU stays float32)
    decoder_graphs: bool = False  # training's per-sample decoder replayed from CUDA graphs (models/decoder_graphs.py)
    capped_samples: bool = False  # the training march in fixed sample capacities (models/capacities.py)
    capped_refresh: str = "observe"  # observe | measure: how the capacities follow an occupancy refresh
    upsample: int = 2
    step_ratio: float = 1.0
    max_samples: int = 512
    background: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    occupancy: OccupancyConfig = field(default_factory=OccupancyConfig)
    fine: FineConfig = field(default_factory=FineConfig)
    early_termination: float = 1.0e-3
    weight_threshold: float = 1.0e-4
    tv_density: float = 1.0e-3
    tv_features: float = 1.0e-4
    tv_until: float = 1.0
    tv_samples: int = 65536
    tv_background: float = 1.0  # TV multiplier outside the foreground box (contraction=inf: the shell)
    tv_sparse_grad: bool = True  # the sampled TV's gradient as the rows it read (models/grid_tv.py, sparse_rows.py)
    shading: str = "deferred"
    shrink_at: Any = None  # null, a step (int) or a fraction of training (float)
    shrink_threshold: float = 1.0e-3
    contraction: str = "none"  # none: the grids span the box; inf: the L-inf scene contraction around it
    appearance: str = "none"  # none | embedding | affine: per-training-image appearance (models/appearance.py)
    appearance_dim: int = 16  # width of the per-image embedding (appearance=embedding)
    pose_refinement: str = "none"  # none | so3xr3: a learnt camera correction per training image


def _int_at_least(cfg: ModelConfig, key: str, minimum: int) -> None:
    value = getattr(cfg, key)
    if value < minimum:
        raise ValueError(f"model.{key}: must be an integer >= {minimum}, got {value!r}")


def _number_in(key: str, value: float, low: float = -math.inf, high: float = math.inf) -> None:
    if not math.isfinite(value):
        raise ValueError(f"model.{key}: must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"model.{key}: must be in [{low:g}, {high:g}], got {value!r}")


def step_of(when: Any, total_steps: int) -> int:
    """A schedule entry (a step, int, or a fraction of training, float) as the step it names."""
    return when if isinstance(when, int) else max(1, round(when * total_steps))


def _is_step_or_fraction(value: Any) -> bool:
    is_step = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return is_step or (isinstance(value, float) and 0.0 < value < 1.0)


def check_model_config(c: ModelConfig) -> None:
    """The value rules the types cannot state; ValueError naming ``model.<key>``."""
    for key, minimum in (
        ("resolution_start", 2),
        ("resolution_end", 2),
        ("feature_dim", 3),
        ("decoder_hidden", 1),
        ("decoder_layers", 0),
        ("upsample", 1),
        ("max_samples", 1),
        ("tv_samples", 0),
        ("appearance_dim", 1),
    ):
        _int_at_least(c, key, minimum)
    for key, minimum in (("refresh_every", 1), ("warmup", 0), ("dilate", 0)):
        if getattr(c.occupancy, key) < minimum:
            raise ValueError(
                f"model.occupancy.{key}: must be an integer >= {minimum}, got {getattr(c.occupancy, key)!r}"
            )
    _check_fine(c)
    _number_in("feature_init_std", c.feature_init_std, 0.0)
    _number_in("density_shift", c.density_shift)
    _number_in("step_ratio", c.step_ratio, 1e-3, 10.0)
    _number_in("occupancy.threshold", c.occupancy.threshold, 0.0, 1.0)
    for key in ("early_termination", "weight_threshold", "tv_until", "shrink_threshold"):
        _number_in(key, getattr(c, key), 0.0, 1.0)
    for key in ("early_termination", "weight_threshold"):  # at 1 no sample would be kept or shaded
        if getattr(c, key) >= 1.0:
            raise ValueError(f"model.{key}: must be in [0, 1), got {getattr(c, key)!r}")
    for key in ("tv_density", "tv_features", "tv_background"):
        _number_in(key, getattr(c, key), 0.0)
    if len(c.background) != 3 or not all(0.0 <= v <= 1.0 for v in c.background):
        raise ValueError(f"model.background: must be 3 numbers in [0, 1], got {list(c.background)!r}")
    if not DIR_ENCODING.match(c.dir_encoding):
        raise ValueError(
            f"model.dir_encoding: expected 'none', 'sh0'..'sh3' or 'pe<frequencies>', got {c.dir_encoding!r}"
        )
    if c.gelu_approximate not in GELU_MODES:
        raise ValueError(f"model.gelu_approximate: expected 'none' or 'tanh', got {c.gelu_approximate!r}")
    if c.capped_refresh not in ("measure", "observe"):
        raise ValueError(f"model.capped_refresh: expected 'measure' or 'observe', got {c.capped_refresh!r}")
    if c.decoder_precision not in DECODER_PRECISIONS:
        raise ValueError(f"model.decoder_precision: expected 'float32' or 'bfloat16', got {c.decoder_precision!r}")
    if c.appearance not in APPEARANCE_MODES:
        raise ValueError(f"model.appearance: expected one of {', '.join(APPEARANCE_MODES)}, got {c.appearance!r}")
    if c.contraction not in CONTRACTIONS:
        raise ValueError(f"model.contraction: expected 'none' or 'inf', got {c.contraction!r}")
    if c.pose_refinement not in POSE_MODES:
        raise ValueError(f"model.pose_refinement: expected one of {', '.join(POSE_MODES)}, got {c.pose_refinement!r}")
    if c.contraction == "none" and c.tv_background != 1.0:
        raise ValueError(
            f"model.tv_background: weighs the contracted shell's TV, so it needs model.contraction=inf "
            f"(the grids span only the box otherwise), got {c.tv_background!r}"
        )
    if c.contraction != "none" and c.shrink_at is not None:
        raise ValueError(
            f"model.shrink_at: must be null with model.contraction={c.contraction} (the grids span all of space), "
            f"got {c.shrink_at!r}"
        )
    if c.shading not in SHADING_MODES:
        raise ValueError(f"model.shading: expected 'deferred' or 'per_sample', got {c.shading!r}")
    for item in c.grow_at:
        if not _is_step_or_fraction(item):
            raise ValueError(f"model.grow_at: entries must be steps >= 1 (ints) or fractions in (0, 1), got {item!r}")
    if c.shrink_at is not None and not _is_step_or_fraction(c.shrink_at):
        raise ValueError(
            f"model.shrink_at: must be null, a step >= 1 (int) or a fraction in (0, 1), got {c.shrink_at!r}"
        )
    if c.shading == "per_sample" and c.upsample != 1:
        raise ValueError(
            f"model.upsample: per-sample shading decodes every sample, so it needs upsample=1, got {c.upsample}"
        )
    if c.resolution_start > c.resolution_end:
        raise ValueError(
            f"model.resolution_start: must be <= model.resolution_end ({c.resolution_end}), got {c.resolution_start}"
        )


def _check_fine(c: ModelConfig) -> None:
    f = c.fine
    for key, minimum in (("factor", 0), ("brick", 1), ("max_bricks", 1), ("collect", 1)):
        if getattr(f, key) < minimum:
            raise ValueError(f"model.fine.{key}: must be an integer >= {minimum}, got {getattr(f, key)!r}")
    if f.factor > f.brick:  # the occupancy bound (BrickGrids.density_bound) looks one brick around a vertex
        raise ValueError(f"model.fine.factor: must be <= model.fine.brick ({f.brick}), got {f.factor}")
    _number_in("fine.tv", f.tv, 0.0)
    _number_in("fine.lr", f.lr, 0.0)
    _number_in("fine.min_pixels", f.min_pixels, 0.0)
    _number_in("fine.min_weight", f.min_weight, 0.0, 1.0)
    _number_in("fine.reach", f.reach, 1.0, 2.0)
    if not _is_step_or_fraction(f.at):
        raise ValueError(f"model.fine.at: must be a step >= 1 (int) or a fraction in (0, 1), got {f.at!r}")
    if f.grow_at is not None:
        if not isinstance(f.grow_at, list) or not all(_is_step_or_fraction(g) for g in f.grow_at):
            raise ValueError(
                "model.fine.grow_at: must be null or a list of steps >= 1 (ints) or fractions in (0, 1), "
                f"got {f.grow_at!r}"
            )
    if f.resolution_end is not None and not (
        isinstance(f.resolution_end, int) and c.resolution_start <= f.resolution_end <= c.resolution_end
    ):
        raise ValueError(
            f"model.fine.resolution_end: must be null or an integer in [model.resolution_start, model.resolution_end] "
            f"([{c.resolution_start}, {c.resolution_end}]), got {f.resolution_end!r}"
        )
    if f.factor > 0:  # the fine grid lives on the coarse grids' final box and shape (checked again at run time)
        growth = [("grow_at", g) for g in c.grow_at] if f.grow_at is None else [("fine.grow_at", g) for g in f.grow_at]
        for key, when in growth + [("shrink_at", c.shrink_at)]:
            if when is not None and type(when) is type(f.at) and when >= f.at:
                raise ValueError(f"model.fine.at: must come after every model.{key} entry ({when!r}), got {f.at!r}")


def parse_model_config(cfg: Any) -> ModelConfig:
    """A checked :class:`ModelConfig` from one, from a mapping (a dict or the ``model`` DictConfig; missing keys
    take the schema's defaults) or None (every default). Unknown keys and wrong types raise ValueError too."""
    if isinstance(cfg, ModelConfig):
        parsed = cfg
    elif cfg is None or isinstance(cfg, Mapping):
        try:
            merged = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg or {})
            parsed = OmegaConf.to_object(merged)
        except OmegaConfBaseException as error:
            key = getattr(error, "full_key", None) or "model"
            reason = str(error).strip().splitlines()[0]
            raise ValueError(f"model.{key}: {reason}" if key != "model" else f"model: {reason}") from None
    else:
        raise ValueError(f"model: expected a mapping of model settings, got {type(cfg).__name__}")
    check_model_config(parsed)
    return parsed
