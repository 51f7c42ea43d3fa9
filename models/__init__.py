"""The voxel-grid radiance field (:class:`VoxelNeRF`), its settings (:class:`ModelConfig`) and its op backends
(:func:`build_ops`). The compiled extension is loaded only when a custom op is called."""

from models.config import ModelConfig, parse_model_config
from models.model import VoxelNeRF
from models.ops import OpSet, build_ops

__all__ = ["OpSet", "build_ops", "VoxelNeRF", "ModelConfig", "parse_model_config"]
