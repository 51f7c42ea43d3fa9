"""Scenes for the trainer: the blender- and nerfstudio-format loaders, the built-in procedural scene, rays and
batch samplers."""

from data.blender import eval_split, list_splits, load_blender, write_blender_split
from data.errors import SceneError
from data.nerfstudio import load_nerfstudio, write_nerfstudio
from data.rays import camera_rays, pixel_rays, project_to_pixels
from data.samplers import PatchBatch, PatchSampler, RayBatch, RaySampler
from data.scene import Scene
from data.synthetic import ensure_synthetic_scene

__all__ = [
    "Scene",
    "SceneError",
    "load_blender",
    "list_splits",
    "eval_split",
    "write_blender_split",
    "load_nerfstudio",
    "write_nerfstudio",
    "ensure_synthetic_scene",
    "camera_rays",
    "pixel_rays",
    "project_to_pixels",
    "RaySampler",
    "RayBatch",
    "PatchSampler",
    "PatchBatch",
]
