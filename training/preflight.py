"""Checks made before a run does any work: the run folder is writable, its disk can hold two checkpoints and
the renders, and the final grids fit the device's memory. Each failure is one line naming the setting or path."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from training.config import ConfigError

FLOAT_BYTES = 4
# a grid voxel during training: value, gradient and Adam's two moments; in a checkpoint: value and moments
TRAINING_COPIES, CHECKPOINT_COPIES = 4, 3
GIB = 1024**3


class PreflightError(RuntimeError):
    """The run cannot start here; the one-line message names the path."""


def grid_voxels(extent: tuple[float, float, float], resolution: int, contracted: bool = False) -> int:
    """Vertices of a grid with ``resolution`` vertices along the longest side of a box of ``extent`` (contracted:
    the cube R^3 around the box, models/contraction.py)."""
    if contracted:
        return resolution**3
    voxel = max(extent) / (resolution - 1)
    return math.prod(max(2, round(e / voxel) + 1) for e in extent)


def fine_pool_rows(model_cfg: Mapping[str, Any]) -> int:
    """The most rows the fine grid's brick pool can take (``model.fine``: max_bricks x brick^3; 0 when off): an upper
    bound, as the grid may be declined (``fine.min_pixels``) or want fewer bricks."""
    fine = model_cfg.get("fine") or {}
    if int(fine.get("factor", 0) or 0) <= 0:
        return 0
    return int(fine.get("max_bricks", 0)) * int(fine.get("brick", 1)) ** 3


def training_bytes(voxels: int, feature_dim: int) -> int:
    """Device memory the density and feature grids take while training (parameters, gradients, Adam)."""
    return voxels * (1 + feature_dim) * FLOAT_BYTES * TRAINING_COPIES


def checkpoint_bytes(voxels: int, feature_dim: int) -> int:
    return voxels * (1 + feature_dim) * FLOAT_BYTES * CHECKPOINT_COPIES


def device_memory_bytes(device: torch.device) -> int:
    """Memory available to the run on ``device``: free GPU memory, or the host's available RAM."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_memory(device: torch.device, voxels: int, feature_dim: int, resolution: int, fine_rows: int = 0) -> int:
    """ConfigError naming the keys when the grids (``voxels`` rows) would not fit ``device`` while training; returns
    how many of the fine grid's ``fine_rows`` pool rows fit beside them (all, or fewer: the pool is capped there, as
    the fine grid is optional detail)."""
    need = training_bytes(voxels, feature_dim)
    have = device_memory_bytes(device)
    if need > 0.9 * have:
        raise ConfigError(
            f"model.resolution_end: {resolution} means grids of {voxels / 1e6:.0f}M voxels "
            f"x {1 + feature_dim} channels, "
            f"about {need / GIB:.1f} GiB while training (values, gradients, Adam state), but {device} has "
            f"{have / GIB:.1f} GiB available; lower model.resolution_end or model.feature_dim"
        )
    return min(fine_rows, int((0.9 * have - need) // training_bytes(1, feature_dim)))


def check_writable(folder: Path) -> None:
    """The run folder (created if missing) accepts a new file."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as error:
        raise PreflightError(
            f"hydra.run.dir: {folder} is not writable ({error.strerror or error}); choose another hydra.run.dir"
        ) from None


def check_disk(folder: Path, need: int) -> None:
    free = shutil.disk_usage(folder).free
    if need > free:
        raise PreflightError(
            f"hydra.run.dir: {folder} has {free / GIB:.2f} GiB free but the run needs about {need / GIB:.2f} GiB "
            "(two checkpoints during an atomic save, and the renders); free some space or choose another hydra.run.dir"
        )


def render_bytes(views: int, height: int, width: int) -> int:
    """Upper bound of the evaluation PNGs: per view a prediction, a 3-wide comparison and a depth image."""
    return views * height * width * 3 * 5


def run_preflight(
    folder: Path,
    device: torch.device,
    extent: tuple[float, float, float],
    resolution: int,
    feature_dim: int,
    eval_views: int,
    height: int,
    width: int,
    training: bool,
    contracted: bool = False,
    fine_rows: int = 0,
) -> int:
    """Every check, cheapest first. ``training``: False for render_only (no checkpoint is written); ``contracted``:
    the grids span the contracted cube; ``fine_rows``: the fine grid's largest brick pool (0: none). Returns the
    pool rows that fit the device's memory beside the grids (:func:`check_memory`)."""
    check_writable(folder)
    voxels = grid_voxels(extent, resolution, contracted)
    need = render_bytes(eval_views, height, width)
    if training:
        fine_rows = check_memory(device, voxels, feature_dim, resolution, fine_rows)
        need += 2 * checkpoint_bytes(voxels + fine_rows, feature_dim)
    check_disk(folder, need)
    return fine_rows


__all__ = [
    "PreflightError",
    "run_preflight",
    "grid_voxels",
    "fine_pool_rows",
    "training_bytes",
    "checkpoint_bytes",
    "check_memory",
    "check_writable",
    "check_disk",
]
