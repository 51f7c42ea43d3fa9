"""The ``model`` config group, read once into a typed, validated :class:`ModelConfig`.

Every problem raises ValueError naming the key (``model.<key>``) and what was expected, before any tensor is built.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

DIR_ENCODING = re.compile(r"^(none|sh[0-3]|pe[0-9]+)$")
GELU_MODES = ("none", "tanh")
SHADING_MODES = ("deferred", "per_sample")


@dataclass(frozen=True)
class ModelConfig:
    """See configs/model/default.yaml for what each field means."""

    resolution_start: int
    resolution_end: int
    grow_at: tuple[float, ...]
    feature_dim: int
    feature_init_std: float
    decoder_hidden: int
    decoder_layers: int
    dir_encoding: str
    gelu_approximate: str
    upsample: int
    step_ratio: float
    max_samples: int
    density_shift: float
    background: tuple[float, float, float]
    occupancy_threshold: float
    occupancy_refresh_every: int
    occupancy_warmup: int
    occupancy_dilate: int
    early_termination: float
    weight_threshold: float
    tv_density: float
    tv_features: float
    tv_until: float
    tv_samples: int
    shading: str
    shrink_at: float | int | None
    shrink_threshold: float


def _get(cfg: Mapping, key: str, prefix: str = "model") -> Any:
    if key not in cfg:
        raise ValueError(f"{prefix}.{key}: missing from the model config")
    return cfg[key]


def _int(cfg: Mapping, key: str, minimum: int, prefix: str = "model") -> int:
    value = _get(cfg, key, prefix)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{prefix}.{key}: must be an integer >= {minimum}, got {value!r}")
    return value


def _float(cfg: Mapping, key: str, low: float = -math.inf, high: float = math.inf, prefix: str = "model") -> float:
    value = _get(cfg, key, prefix)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{prefix}.{key}: must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{prefix}.{key}: must be in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _grow_at(cfg: Mapping) -> tuple[float, ...]:
    value = _get(cfg, "grow_at")
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"model.grow_at: must be a list of steps (ints) or fractions of training in (0, 1), got {value!r}")
    steps = []
    for item in value:
        is_step = isinstance(item, int) and not isinstance(item, bool) and item >= 1
        is_fraction = isinstance(item, float) and 0.0 < item < 1.0
        if not (is_step or is_fraction):
            raise ValueError(f"model.grow_at: entries must be steps >= 1 (ints) or fractions in (0, 1), got {item!r}")
        steps.append(item)
    return tuple(steps)


def parse_model_config(cfg: Mapping) -> ModelConfig:
    """Validate the ``model`` group (a dict or an OmegaConf DictConfig) into a :class:`ModelConfig`."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"model: expected a mapping of model settings, got {type(cfg).__name__}")
    occupancy = _get(cfg, "occupancy")
    if not isinstance(occupancy, Mapping):
        raise ValueError(f"model.occupancy: expected a mapping (threshold, refresh_every, warmup, dilate), got {occupancy!r}")
    background = _get(cfg, "background")
    if isinstance(background, (int, float)) and not isinstance(background, bool):
        background = [background] * 3
    if (
        isinstance(background, (str, bytes))
        or not isinstance(background, Sequence)
        or len(background) != 3
        or not all(isinstance(c, (int, float)) and 0.0 <= c <= 1.0 for c in background)
    ):
        raise ValueError(f"model.background: must be 3 numbers in [0, 1] (or one), got {background!r}")
    dir_encoding = _get(cfg, "dir_encoding")
    if not isinstance(dir_encoding, str) or not DIR_ENCODING.match(dir_encoding):
        raise ValueError(f"model.dir_encoding: expected 'none', 'sh0'..'sh3' or 'pe<frequencies>', got {dir_encoding!r}")
    gelu_approximate = _get(cfg, "gelu_approximate")
    if gelu_approximate not in GELU_MODES:
        raise ValueError(f"model.gelu_approximate: expected 'none' or 'tanh', got {gelu_approximate!r}")
    shading = cfg.get("shading", "deferred")
    if shading not in SHADING_MODES:
        raise ValueError(f"model.shading: expected 'deferred' or 'per_sample', got {shading!r}")
    shrink_at = cfg.get("shrink_at")
    if shrink_at is not None:
        is_step = isinstance(shrink_at, int) and not isinstance(shrink_at, bool) and shrink_at >= 1
        if not (is_step or (isinstance(shrink_at, float) and 0.0 < shrink_at < 1.0)):
            raise ValueError(f"model.shrink_at: must be null, a step >= 1 (int) or a fraction in (0, 1), got {shrink_at!r}")
    parsed = ModelConfig(
        resolution_start=_int(cfg, "resolution_start", 2),
        resolution_end=_int(cfg, "resolution_end", 2),
        grow_at=_grow_at(cfg),
        feature_dim=_int(cfg, "feature_dim", 3),
        feature_init_std=_float(cfg, "feature_init_std", 0.0),
        decoder_hidden=_int(cfg, "decoder_hidden", 1),
        decoder_layers=_int(cfg, "decoder_layers", 0),
        dir_encoding=dir_encoding,
        gelu_approximate=gelu_approximate,
        upsample=_int(cfg, "upsample", 1),
        step_ratio=_float(cfg, "step_ratio", 1e-3, 10.0),
        max_samples=_int(cfg, "max_samples", 1),
        density_shift=_float(cfg, "density_shift"),
        background=tuple(float(c) for c in background),
        occupancy_threshold=_float(occupancy, "threshold", 0.0, 1.0, "model.occupancy"),
        occupancy_refresh_every=_int(occupancy, "refresh_every", 1, "model.occupancy"),
        occupancy_warmup=_int(occupancy, "warmup", 0, "model.occupancy"),
        occupancy_dilate=_int(occupancy, "dilate", 0, "model.occupancy"),
        early_termination=_float(cfg, "early_termination", 0.0, 1.0),
        weight_threshold=_float(cfg, "weight_threshold", 0.0, 1.0),
        tv_density=_float(cfg, "tv_density", 0.0),
        tv_features=_float(cfg, "tv_features", 0.0),
        tv_until=_float(cfg, "tv_until", 0.0, 1.0),
        tv_samples=_int(cfg, "tv_samples", 0),
        shading=shading,
        shrink_at=shrink_at,
        shrink_threshold=_float(cfg, "shrink_threshold", 0.0, 1.0) if "shrink_threshold" in cfg else 1e-3,
    )
    if parsed.shading == "per_sample" and parsed.upsample != 1:
        raise ValueError(f"model.upsample: per-sample shading decodes every sample, so it needs upsample=1, got {parsed.upsample}")
    if parsed.resolution_start > parsed.resolution_end:
        raise ValueError(
            f"model.resolution_start: must be <= model.resolution_end ({parsed.resolution_end}), got {parsed.resolution_start}"
        )
    return parsed
