"""The app's config: one typed schema (dataclasses registered in Hydra's ConfigStore; the YAML files under
configs/ are presets of it). The value and cross-field rules the types cannot state live in
:mod:`training.config_rules` (re-exported here: ``ConfigError``, ``validate_config``).

Hydra enforces the schema while composing: an unknown key (``train.itres=5``) or a wrong type
(``train.iters=abc``) stops before any of our code runs, with Hydra's error naming the key.
:func:`validate_config` then checks values (ranges, choices, files) and raises :class:`ConfigError` whose one-line
message starts with the key. No ``from __future__ import annotations``: OmegaConf reads field types at runtime.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.config import ModelConfig
from training.config_rules import DATASETS, ConfigError, _one_of, validate_config

__all__ = ["Config", "ConfigError", "DATA_SCHEMAS", "Settings", "register_configs", "typed", "validate_config"]


@dataclass
class OpsConfig:
    """Backend per op family: ``custom`` (cuda_ext kernels) or ``torch`` (cuda_ext.reference)."""

    grid_interpolate: str = "custom"  # the trilinear lookup in the voxel grids
    brick_grid_interpolate: str = "custom"  # the trilinear lookup in the sparse fine grid (model.fine)
    upsample_bilinear2d: str = "custom"  # the deferred decoder's feature upsampling
    gelu: str = "custom"  # the decoder's activation
    volume_render: str = "custom"  # compositing of packed samples into colour, opacity, depth (and distortion_loss)
    march_rays: str = "custom"  # packed samples along the rays, empty space skipped
    sparse_adam_step: str = "custom"  # train.sparse_adam's update of the touched voxels
    sampled_tv: str = "custom"  # the grids' total variation on sampled cells, its gradient added after the backward


@dataclass
class DataConfig:
    """What every scene source has; configs/data/*.yaml are the presets."""

    name: str = MISSING
    root: Optional[str] = None
    downscale: int = 1
    background: list[float] = field(default_factory=lambda: [1.0, 1.0, 1.0])
    near: Optional[float] = 2.0  # null only for nerfstudio and colmap (derived there)
    far: Optional[float] = 6.0
    scene_box: Any = 1.5  # a half size; nerfstudio and colmap also take null or 6 numbers (checked in _check_data)
    tight_box: bool = False


@dataclass
class BlenderDataConfig(DataConfig):
    name: str = "blender"


@dataclass
class NerfstudioDataConfig(DataConfig):
    """A nerfstudio capture (data/nerfstudio.py); null scene_box / near / far: derived from the cameras."""

    name: str = "nerfstudio"
    near: Optional[float] = None
    far: Optional[float] = None
    scene_box: Any = None  # null | half size s ([-s, s]^3) | [min x, y, z, max x, y, z]
    eval_interval: int = 8
    orient: str = "up"  # up | none (data/orientation.py)


@dataclass
class ColmapDataConfig(NerfstudioDataConfig):
    """A COLMAP folder (images/ + sparse/0, data/colmap.py), read as the transforms.json nerfstudio makes of it."""

    name: str = "colmap"


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
    lr: float = 0.2
    lr_decoder: float = 0.002
    lr_final_factor: float = 0.1
    batch_rays: int = 8192
    patch_size: int = 8
    patches_per_batch: int = 16
    log_every: int = 25
    checkpoint_every: int = 500
    keep_checkpoints: int = 1  # last.pt plus the newest keep_checkpoints - 1 periodic step_<step>.pt files
    keep_resumable: bool = False  # keep checkpoints/last.pt after a successful end (else only model.pt stays)
    eval_every: int = 0
    eval_views: int = 4
    eval_final_views: int = 0  # 0: every eval view; K: K views spread evenly over the eval split
    resume: bool = False
    profile: Any = False  # false | true (device-synchronised parts) | host (the host's time in each part, no syncs)
    render_chunk: int = 8192
    turntable_frames: int = 40
    turntable_max_side: int = 400
    adam_eps: float = 1.0e-8
    opacity_loss: float = 0.0
    loss: str = "mse"  # photometric loss: mse | l1 | charbonnier (training/losses.py)
    distortion_loss: float = 0.0  # weight of mip-NeRF 360's distortion loss (models/regularizers.py)
    near_density_loss: float = 0.0  # weight of the optical depth near the cameras
    near_density_fraction: float = 0.2  # "near": this fraction of the camera's distance to the box centre
    dssim: float = 0.0  # weight of 1 - SSIM on patch batches (model.upsample > 1)
    lr_pose: float = 6.0e-4  # Adam rate of the pose corrections (model.pose_refinement; nerfacto's)
    pose_penalty: float = 1.0e-2  # weight of their mean squared norm (radians, scene units)
    sparse_adam: Any = False  # false | occupied | nonzero (config_rules.sparse_adam_mode)
    batch_graph: bool = False  # on CUDA, each batch built by a CUDA graph (data.batch_graph)
    step_graph: bool = False  # on CUDA with model.capped_samples, each step's gradients from a CUDA graph
    tf32: bool = True  # CUDA matmuls (the decoder) on TF32 tensor cores
    tensorboard: Any = "auto"  # auto (on when the package is installed) | true | false
    dist_timeout: float = 300.0
    parallel: str = "auto"  # under torchrun: auto | data | space (training.space_parallel.split_for)
    dist_grad_sync: str = "touched"  # touched | dense (training.distributed)
    random_background: bool = False
    pixel_jitter: bool = False  # training rays through a random point of their pixel, not its centre
    overwrite: bool = False
    viewer: bool = False  # live viewer in the browser (training/viewer.py; needs viser)
    viewer_host: str = "127.0.0.1"
    viewer_port: int = 8080
    viewer_budget: float = 0.05
    viewer_resolution: int = 256


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


DATA_SCHEMAS = {
    "synthetic": SyntheticDataConfig,
    "blender": BlenderDataConfig,
    "nerfstudio": NerfstudioDataConfig,
    "colmap": ColmapDataConfig,
}


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


class Settings(dict):
    """A plain snapshot of a config node (``Settings.of(cfg.train)``) with the node's reads: ``settings.key`` and
    ``settings.get(key, default)``, nested nodes as Settings. For the training step's hot path, which reads a
    dozen settings a step: an OmegaConf read took ~50 us under cProfile on an H100 host, a dict read takes ~0.1 us."""

    @classmethod
    def of(cls, node: DictConfig | Mapping) -> "Settings":
        plain = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
        return cls({key: cls.of(value) if isinstance(value, Mapping) else value for key, value in plain.items()})

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"config has no key {key!r}") from None

    def __setattr__(self, key: str, value: Any) -> None:  # a snapshot: a write would not reach the config
        raise AttributeError(f"config key {key!r}: Settings is read-only")
