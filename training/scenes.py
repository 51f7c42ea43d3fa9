"""Run set-up that depends on the machine and the scene: the device, the seeds, and the scene splits."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from data import Scene, ensure_synthetic_scene, eval_split, load_blender, load_nerfstudio
from data.bounds import mask_hull_box

# generated scenes live in the user's cache, not inside the installed package (site-packages for a normal install)
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "voxel-field" / "scenes"


def resolve_device(name: str, index: int | None = None) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cpu`` / ``cuda`` as given (validated earlier). ``index``: the
    GPU of this rank (torchrun's LOCAL_RANK) when several processes share a machine."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name, index) if name == "cuda" and index is not None else torch.device(name)


def describe_device(device: torch.device) -> str:
    """e.g. ``"cpu"`` or ``"cuda:0 (NVIDIA H100 80GB HBM3)"``."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


# the CUDA caching allocator's counters that device_memory reports, by its names (torch.cuda.memory_stats)
ALLOCATOR_STATS = {
    "allocated_bytes": "allocated_bytes.all.current",
    "peak_memory_bytes": "allocated_bytes.all.peak",
    "peak_reserved_bytes": "reserved_bytes.all.peak",
    "device_mallocs": "segment.all.allocated",  # the segments it took from cudaMalloc, over the process
    "device_frees": "segment.all.freed",  # ... and gave back with cudaFree
    "alloc_retries": "num_alloc_retries",
}


def device_memory(device: torch.device) -> dict[str, int | None] | None:
    """The CUDA caching allocator's account of this process so far (None off CUDA): the bytes its tensors hold now
    and at their peak, the bytes it reserved at the peak, and its calls to the driver: ``device_mallocs`` and
    ``device_frees`` (cudaMalloc / cudaFree, which synchronises the device: a step that makes one is slow),
    ``alloc_retries`` (an allocation that failed, emptied the cache and tried again). A counter this torch's
    allocator does not keep is None."""
    if device.type != "cuda":
        return None
    stats = torch.cuda.memory_stats(device)
    return {name: None if key not in stats else int(stats[key]) for name, key in ALLOCATOR_STATS.items()}


def seed_everything(seed: int | None) -> int:
    """Seed python, numpy and torch (every device); ``None`` draws a seed. Returns the seed used."""
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def scene_root(data_cfg: DictConfig) -> Path:
    """The blender-format folder of the configured scene, generating the synthetic one on first use."""
    if data_cfg.name == "blender":
        return Path(data_cfg.root).expanduser()
    cache = Path(data_cfg.cache_dir).expanduser() if data_cfg.get("cache_dir") else DEFAULT_CACHE
    return ensure_synthetic_scene(
        cache,
        resolution=data_cfg.resolution,
        n_train=data_cfg.n_train,
        n_val=data_cfg.n_val,
        n_test=data_cfg.n_test,
        seed=data_cfg.scene_seed,
    )


def load_scenes(
    data_cfg: DictConfig, device: torch.device, multiple: int = 1, foreground: bool = False
) -> tuple[Scene, Scene]:
    """(train, eval) splits on ``device``; eval is the test split when present, else val (nerfstudio: its split
    lists, else every data.eval_interval-th frame; box and near/far derived unless set, and printed, the box as a
    contracted scene's foreground with ``foreground``; images cropped to a multiple of ``multiple`` pixels, the
    model's upsample factor)."""
    if data_cfg.name in ("nerfstudio", "colmap"):
        box = data_cfg.scene_box
        box = OmegaConf.to_container(box) if OmegaConf.is_list(box) else box
        train, evaluation, bounds = load_nerfstudio(
            Path(data_cfg.root).expanduser(),
            downscale=data_cfg.downscale,
            background=tuple(data_cfg.background),
            near=data_cfg.near,
            far=data_cfg.far,
            scene_box=box,
            eval_interval=data_cfg.eval_interval,
            orient=data_cfg.get("orient", "up"),
            multiple=multiple,
            foreground=foreground,
            colmap=data_cfg.name == "colmap",
        )
        print(f"{data_cfg.name} {bounds.describe()}; override with data.scene_box, data.near, data.far")
        return train.to(device), evaluation.to(device)
    root = scene_root(data_cfg)
    options = dict(
        downscale=data_cfg.downscale,
        background=tuple(data_cfg.background),
        near=data_cfg.near,
        far=data_cfg.far,
        scene_box=data_cfg.scene_box,
    )
    train = load_blender(root, "train", **options)
    evaluation = load_blender(root, eval_split(root), **options)
    return train.to(device), evaluation.to(device)


def grid_box(data_cfg: DictConfig, train_scene: Scene) -> torch.Tensor | None:
    """(2, 3) box the grids start on with ``data.tight_box`` (the training masks' visual hull), else None."""
    if not data_cfg.get("tight_box", False):
        return None
    if train_scene.alpha is None:
        print("note: data.tight_box: the training images have no alpha; the grids use the whole scene box")
        return None
    box = mask_hull_box(train_scene).cpu()
    print(
        f"grid box from the training masks (data.tight_box): {[round(v, 3) for v in box[0].tolist()]} .. "
        f"{[round(v, 3) for v in box[1].tolist()]}"
    )
    return box
