"""The voxel-grid radiance field (:class:`VoxelNeRF`), its op backends (:func:`build_ops`), metrics and training helpers.

``models.metrics`` and ``models.training`` import without the compiled extension; the model's ops load it only
when :func:`build_ops` is called.
"""
from models.config import ModelConfig, parse_model_config
from models.model import VoxelNeRF
from models.ops import OpSet, build_ops

__all__ = ["OpSet", "build_ops", "VoxelNeRF", "ModelConfig", "parse_model_config"]
