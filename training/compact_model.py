"""The run's deliverable: ``<run>/model.pt``, the finished model holding only what rendering reads.

A render reads the grids only at the 8 corner vertices of the occupancy cells it samples, and it samples only
occupied cells (``march_rays`` keeps a sample only where the occupancy grid is set). So the file stores, of every
tensor laid out on the vertex grid (shape ``(R0, R1, R2, ...)``: the density and feature grids, and any other
per-vertex state a model adds), only the rows of the *kept vertices*, the corners of occupied cells, as float16,
plus one bit per vertex saying which rows those are (``np.packbits``; the rows follow in row-major order, so no
index is stored). Boolean tensors (the occupancy grid itself) are stored as bits; every other tensor (the
decoder's weights, the box, the schedule state) as it is. The file is written generically over the model's
``state_dict``: it knows the vertex grid only through ``model.grid_shape`` and the occupied cells through
``model.occupancy.mask``.

Loading fills the vertices that were left out: zero, except the density grid, which gets its own smallest value.
Neither can change a render. Every vertex left out touches only unoccupied cells, and a cell is unoccupied when
all 8 corner alphas are below the occupancy threshold, so the grid's smallest density (at or below every such
vertex's, hence as empty) keeps each of those cells empty if the occupancy grid is rebuilt, and a mesh's surface
(alpha 0.5) never reaches them. A render never reads them: its samples lie in occupied cells, whose corners are
all stored. (A sample that ``march_rays`` places in an occupied cell and the lookup rounds into its neighbour
lies on their shared face to within a rounding error, where the neighbour's far corners weigh ~1e-7: a bounded
fill, the grid's own minimum rather than -inf, keeps that harmless.) The float16 rounding of the stored rows is
the only change: tests/test_compact_model.py renders both and compares PSNR.

Besides the weights the file keeps the run's config, step and small history (what ``render_only``, ``view``,
``render_path`` and ``export`` read), never the optimiser state: resuming needs ``checkpoints/last.pt``.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

MODEL_FORMAT = "voxel-field-model"
MODEL_VERSION = 1
MODEL_NAME = "model.pt"
RUN_KEYS = (  # the trainer counters restore_trainer reads besides the weights (all small)
    "step",
    "iters",
    "history",
    "eval_history",
    "train_seconds",
    "rays",
    "pixels",
    "samples",
    "checkpoint_seconds",
    "seed",
    "config",
)


def kept_vertices(occupied_cells: torch.Tensor) -> torch.Tensor:
    """(R0, R1, R2) bool: the vertices that are a corner of at least one set cell of the (R0-1, R1-1, R2-1) mask."""
    cells = occupied_cells.float()[None, None]
    return F.max_pool3d(F.pad(cells, (1, 1, 1, 1, 1, 1)), kernel_size=2, stride=1)[0, 0] > 0


def _pack_bits(mask: torch.Tensor) -> dict:
    return {"bits": torch.from_numpy(np.packbits(mask.reshape(-1).cpu().numpy())), "shape": list(mask.shape)}


def _unpack_bits(packed: dict) -> torch.Tensor:
    shape = [int(s) for s in packed["shape"]]
    count = int(np.prod(shape))
    return torch.from_numpy(np.unpackbits(packed["bits"].numpy(), count=count).astype(bool)).reshape(shape)


@torch.no_grad()
def compact_content(model: torch.nn.Module, run: dict, grid_dtype: torch.dtype = torch.float16) -> dict:
    """The dict :func:`save_model` writes: ``model``'s state dict with its vertex-grid tensors reduced to the kept
    vertices' rows in ``grid_dtype`` (float16; float32 stores them exactly), boolean tensors as bits, the rest as
    they are; ``run``: the trainer counters of :data:`RUN_KEYS` (``config`` required)."""
    if "config" not in run:
        raise ValueError("compact_content: run must hold the run's config")
    shape = tuple(int(s) for s in model.grid_shape)
    keep = kept_vertices(model.occupancy.mask).reshape(-1)
    density = model.density.grid
    sparse, bits, dense = {}, {}, {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            dense[key] = value
        elif value.dtype == torch.bool:
            bits[key] = _pack_bits(value)
        elif value.is_floating_point() and value.dim() >= 3 and tuple(value.shape[:3]) == shape:
            rows = value.detach().reshape(keep.numel(), -1)
            fill = rows.amin(0) if value.data_ptr() == density.data_ptr() else torch.zeros_like(rows[0])
            sparse[key] = {
                "rows": rows[keep.to(rows.device)].to(grid_dtype).cpu(),
                "shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch."),
                "fill": fill.float().cpu(),
            }
        else:
            dense[key] = value.detach().cpu().clone()
    return {
        "format": MODEL_FORMAT,
        "version": MODEL_VERSION,
        "vertices": _pack_bits(keep.reshape(shape)),
        "sparse": sparse,
        "bits": bits,
        "dense": dense,
        "run": {key: run[key] for key in RUN_KEYS if key in run},
    }


def expand_state_dict(content: dict) -> dict[str, torch.Tensor]:
    """The full state dict of a :func:`compact_content` dict: kept rows in place (float32 or the original dtype),
    the left-out vertices filled (module docstring: why that cannot change a render)."""
    keep = _unpack_bits(content["vertices"]).reshape(-1)
    state = dict(content["dense"])
    for key, entry in content["sparse"].items():
        shape, dtype = [int(s) for s in entry["shape"]], getattr(torch, entry["dtype"])
        rows = entry["fill"].to(dtype).repeat(keep.numel(), 1)
        stored = entry["rows"].to(dtype)
        if stored.shape[0] != int(keep.sum()):
            raise ValueError(f"{key}: {stored.shape[0]} rows stored for {int(keep.sum())} kept vertices")
        rows[keep] = stored
        state[key] = rows.reshape(shape)
    for key, packed in content["bits"].items():
        state[key] = _unpack_bits(packed)
    return state


def save_model(path: str | os.PathLike, model: torch.nn.Module, run: dict) -> int:
    """Write the compact model file atomically (training.checkpoint.save_checkpoint); returns its size in bytes."""
    save_checkpoint(path, compact_content(model, run))
    return Path(path).stat().st_size


def read_model(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(full state dict, run dict with config, step, history...) of a model file; CheckpointError naming the file
    when it is missing, unreadable or not a model file."""
    content = load_checkpoint(path, map_location="cpu")
    if content.get("format") != MODEL_FORMAT or content.get("version") != MODEL_VERSION:
        raise CheckpointError(f"{path}: not a voxel-field model file (format {content.get('format')!r})")
    try:
        state = expand_state_dict(content)
    except (KeyError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: damaged model file ({' '.join(str(error).split())})") from None
    run = dict(content["run"])
    if "config" not in run:
        raise CheckpointError(f"{path}: model file without its run's config")
    return state, run
