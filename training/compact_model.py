"""The run's deliverable: ``<run>/model.pt``, the finished model holding only what rendering reads.

What a stored vertex costs (format 3): the density row in float16 (2 bytes), every other vertex-grid tensor (the
features) as one uint8 code per channel into that channel's 256 float32 levels (1 byte a channel: 12 on lego), so 14
bytes per vertex before both are deflated losslessly (per channel, as differences between consecutive rows, byte
plane by byte plane: :func:`pack_rows`), plus two bits per vertex of the whole grid (which vertices are stored,
which cells are occupied). Which vertices: the corners of the cells a render can still sample, the training
occupancy grid intersected with the strict one recomputed from the final density at save time (no dilation margin: a
cell training kept only for its margin has all 8 corner alphas below the occupancy threshold, so each sample there
had an alpha below it, 1e-3, too faint to decode under the blender preset's weight threshold; skipping such cells is
the one change besides the rounding). Levels: per channel a Lloyd-Max quantiser (256 levels started at the
Panter-Dite density of levels, a few rounds of centroid updates; each value coded to its nearest level), whose error
is much smaller than 256 even steps over the channel's range where a few values stray far out.

A render reads the grids only at the 8 corner vertices of the occupancy cells it samples, and it samples only
occupied cells (``march_rays`` keeps a sample only where the occupancy grid is set). So the file stores, of every
tensor laid out on the vertex grid (shape ``(R0, R1, R2, ...)``: the density and feature grids, and any other
per-vertex state a model adds), only the rows of the *kept vertices*, the corners of occupied cells (as below),
plus one bit per vertex saying which rows those are (``np.packbits``; the rows follow in row-major order, so no
index is stored). Boolean tensors (the occupancy grid itself) are stored as bits; every other tensor (the
decoder's weights, the box, the schedule state) as it is. The file is written generically over the model's
``state_dict``: it knows the vertex grid only through ``model.grid_shape``, the occupied cells through
``model.occupancy.mask`` and ``model.vertex_alpha``.

Loading (format 1, every grid in float16 rows, or 2) fills the vertices that were left out: zero, except the density
grid, which gets its own smallest value. Neither can change a render. Every vertex left out touches only unoccupied
cells, and a cell is unoccupied when all 8 corner alphas are below the occupancy threshold, so the grid's smallest
density (at or below every such vertex's, hence as empty) keeps each of those cells empty if the occupancy grid is
rebuilt, and a mesh's surface (alpha 0.5) never reaches them. A render never reads them: its samples lie in occupied
cells, whose corners are all stored. (A sample that ``march_rays`` places in an occupied cell and the lookup rounds
into its neighbour lies on their shared face to within a rounding error, where the neighbour's far corners weigh
~1e-7: a bounded fill, the grid's own minimum rather than -inf, keeps that harmless.) The rounding of the stored
rows and the strict occupancy are the only changes: tests/test_compact_model.py renders both and compares PSNR.

The fine grid's pool (``fine.density``, ``fine.features``: rows of the bricks it allocated, models/brick_grid.py)
holds only seen surfaces, so every row is stored, the density as float16 and the features as uint8 codes like the
vertex grid's (``pools``; its table travels as it is).

Besides the weights the file keeps the run's config, step and small history (what ``render_only``, ``view``,
``render_path`` and ``export`` read), never the optimiser state: resuming needs ``checkpoints/last.pt``.
"""

from __future__ import annotations

import os
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.field import cell_corners as kept_vertices  # the corners of the occupied cells: what a render reads
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

MODEL_FORMAT = "voxel-field-model"
MODEL_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)  # 1: every vertex-grid tensor in float16 rows, the training occupancy; 2: the density
# rows stored raw (3 deflates them too), the feature codes deflated at zlib level 1 (the same layout)
LEVELS = 256  # uint8 codes
LLOYD_ROUNDS = 6
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


def _pack_bits(mask: torch.Tensor) -> dict:
    return {"bits": torch.from_numpy(np.packbits(mask.reshape(-1).cpu().numpy())), "shape": list(mask.shape)}


def _unpack_bits(packed: dict) -> torch.Tensor:
    shape = [int(s) for s in packed["shape"]]
    count = int(np.prod(shape))
    return torch.from_numpy(np.unpackbits(packed["bits"].numpy(), count=count).astype(bool)).reshape(shape)


@torch.no_grad()
def strict_cells(model: torch.nn.Module) -> torch.Tensor:
    """(R0-1, R1-1, R2-1) bool: the cells of ``model``'s occupancy grid that stay occupied without its dilation
    margin, recomputed from the density now (``model.vertex_alpha``, the occupancy threshold)."""
    alpha = model.vertex_alpha()[None, None]
    strict = F.max_pool3d(alpha, kernel_size=2, stride=1)[0, 0] >= model.config.occupancy.threshold
    return model.occupancy.mask & strict


def _initial_levels(values: torch.Tensor) -> torch.Tensor:
    """(256,) increasing float64 levels for (n,) float64 values, spaced as the MSE-optimal density of levels for
    many levels prescribes (Panter-Dite: levels per unit length ~ p(x)^(1/3)), from a histogram over their range:
    dense where values are, still some over sparse tails and outliers, none wasted on empty stretches."""
    low, high = float(values.min()), float(values.max())
    bins = min(4096, max(LEVELS, values.numel() // 32))  # ~32 values a bin at least: a smooth density estimate
    if not high > low:
        return values.new_full((LEVELS,), low)
    density = torch.histc(values, bins, low, high).pow(1.0 / 3.0)
    cdf = torch.cat([density.new_zeros(1), torch.cumsum(density, 0)]) / density.sum()
    targets = (torch.arange(LEVELS, device=values.device, dtype=values.dtype) + 0.5) / LEVELS
    bin_ = (torch.searchsorted(cdf, targets) - 1).clamp(0, bins - 1)
    inside = (targets - cdf[bin_]) / (cdf[bin_ + 1] - cdf[bin_]).clamp_min(1e-300)  # linear within the bin
    return low + (bin_ + inside.clamp(0, 1)) * ((high - low) / bins)


@torch.no_grad()
def quantise(rows: torch.Tensor, rounds: int = LLOYD_ROUNDS) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, C) float rows -> (codes (n, C) uint8, levels (C, 256) float32): per channel a Lloyd-Max quantiser (module
    doc: levels started as :func:`_initial_levels`, then centroid rounds, which never raise the squared error);
    ``levels[c, codes[i, c]]`` is the level nearest to ``rows[i, c]``, the levels increasing."""
    codes = torch.empty(rows.shape, dtype=torch.uint8, device=rows.device)
    levels = torch.zeros(rows.shape[1], LEVELS, dtype=torch.float32, device=rows.device)
    for channel in range(rows.shape[1] if rows.shape[0] else 0):
        values = rows[:, channel].double()
        level = _initial_levels(values)
        for round_ in range(rounds + 1):
            index = torch.bucketize(values, (level[1:] + level[:-1]) / 2)  # the nearest level (levels increase)
            if round_ == rounds:
                break
            sums = values.new_zeros(LEVELS).index_add_(0, index, values)
            counts = torch.bincount(index, minlength=LEVELS)
            level = torch.where(counts > 0, sums / counts.clamp_min(1), level)  # centroids stay in order
        codes[:, channel], levels[channel] = index.to(torch.uint8), level.float()
    return codes, levels


def pack_rows(rows: torch.Tensor) -> list[torch.Tensor]:
    """(n, C) uint8 or float16 rows -> C x (bytes per value) uint8 byte tensors, losslessly: per channel the
    differences between consecutive rows (neighbouring vertices, so mostly small; float16 as its int16 bit pattern,
    integer arithmetic wrapping), split into byte planes (the high plane of small differences is nearly constant),
    each deflated (zlib level 6; a thread per plane, zlib releases the GIL). :func:`unpack_rows` undoes it."""
    if rows.dtype not in (torch.uint8, torch.float16):
        raise ValueError(f"pack_rows: rows must be uint8 or float16, got {rows.dtype}")
    integers = rows.cpu().numpy().view(np.uint8 if rows.dtype == torch.uint8 else np.int16).T
    planes = []
    for channel in integers:
        delta = np.diff(channel, prepend=channel.dtype.type(0))  # wraps: a running sum in the same type undoes it
        planes += list(delta.view(np.uint8).reshape(-1, delta.itemsize).T)

    def deflate(plane: np.ndarray) -> torch.Tensor:
        return torch.frombuffer(bytearray(zlib.compress(np.ascontiguousarray(plane).tobytes(), 6)), dtype=torch.uint8)

    with ThreadPoolExecutor(max_workers=min(8, max(1, len(planes)))) as pool:
        return list(pool.map(deflate, planes))


def unpack_rows(packed: list[torch.Tensor], count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """:func:`pack_rows`' byte tensors -> (count, C) rows of ``dtype`` (uint8 or float16), bit for bit;
    ValueError naming the channel when one is damaged."""
    width = 1 if dtype == torch.uint8 else 2
    integer = np.uint8 if width == 1 else np.int16
    if len(packed) % width:
        raise ValueError(f"packed rows: {len(packed)} byte planes, not a multiple of {width}")
    channels = []
    for index in range(0, len(packed), width):
        planes = []
        for data in packed[index : index + width]:
            try:
                planes.append(np.frombuffer(zlib.decompress(data.numpy().tobytes()), dtype=np.uint8))
            except zlib.error as error:
                raise ValueError(f"packed rows, channel {index // width}: {error}") from None
            if planes[-1].size != count:
                raise ValueError(f"packed rows, channel {index // width}: {planes[-1].size} values for {count} rows")
        delta = np.ascontiguousarray(np.stack(planes, 1)).view(integer).reshape(count)
        channels.append(np.cumsum(delta, dtype=integer))
    if not channels:
        return torch.zeros(count, 0, dtype=dtype)
    stacked = np.stack(channels, 1)
    return torch.from_numpy(stacked if width == 1 else stacked.view(np.float16))


def dequantise(codes: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """(n, C) uint8 codes, (C, 256) levels -> (n, C) float32 values."""
    return torch.gather(levels, 1, codes.long().T.contiguous()).T if codes.numel() else codes.float()


@torch.no_grad()
def compact_content(
    model: torch.nn.Module,
    run: dict,
    grid_dtype: torch.dtype = torch.float16,
    quantised: bool = True,
    strict: bool = True,
) -> dict:
    """The dict :func:`save_model` writes: ``model``'s state dict with its vertex-grid tensors reduced to the kept
    vertices' rows (the density in ``grid_dtype``, float16; every other one as uint8 codes with ``quantised``,
    else in ``grid_dtype`` too: float32 stores them exactly), the occupancy grid strict (``strict``: module doc) or
    as trained, boolean tensors as bits, the rest as they are; ``run``: the trainer counters of :data:`RUN_KEYS`
    (``config`` required)."""
    if "config" not in run:
        raise ValueError("compact_content: run must hold the run's config")
    shape = tuple(int(s) for s in model.grid_shape)
    cells = strict_cells(model) if strict else model.occupancy.mask
    keep = kept_vertices(cells).reshape(-1)
    density = model.density.grid
    sparse, bits, dense, pools = {}, {}, {}, {}
    pooled = {model.fine.density.data_ptr(): True, model.fine.features.data_ptr(): False} if model.fine.active else {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor):
            dense[key] = value
        elif value.numel() and value.data_ptr() in pooled:  # the fine grid's rows: stored as the vertex rows are
            pools[key] = _rows_entry(value.detach(), quantised and not pooled[value.data_ptr()], grid_dtype)
        elif value.dtype == torch.bool:
            bits[key] = _pack_bits(cells if value.data_ptr() == model.occupancy.mask.data_ptr() else value)
        elif value.is_floating_point() and value.dim() >= 3 and tuple(value.shape[:3]) == shape:
            rows = value.detach().reshape(keep.numel(), -1)
            is_density = value.data_ptr() == density.data_ptr()
            fill = rows.amin(0) if is_density else torch.zeros_like(rows[0])
            entry = _rows_entry(rows[keep.to(rows.device)], quantised and not is_density, grid_dtype)
            sparse[key] = entry | {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
            sparse[key]["fill"] = fill.float().cpu()
        else:
            dense[key] = value.detach().cpu().clone()
    return {
        "format": MODEL_FORMAT,
        "version": MODEL_VERSION,
        "vertices": _pack_bits(keep.reshape(shape)),
        "sparse": sparse,
        "bits": bits,
        "dense": dense,
        "pools": pools,
        "run": {key: run[key] for key in RUN_KEYS if key in run},
    }


def _rows_entry(rows: torch.Tensor, quantised: bool, grid_dtype: torch.dtype) -> dict:
    """(n, C) float rows as stored: uint8 codes and their levels (``quantised``), else ``grid_dtype`` rows (float16:
    deflated); plus the original shape and dtype."""
    entry = {"shape": list(rows.shape), "dtype": str(rows.dtype).removeprefix("torch."), "count": rows.shape[0]}
    if quantised:
        codes, entry["levels"] = quantise(rows)
        entry["packed_codes"] = pack_rows(codes)
    elif grid_dtype == torch.float16:
        entry["packed_rows"] = pack_rows(rows.to(grid_dtype))
    else:
        entry["rows"] = rows.to(grid_dtype)
    return {name: item.cpu() if isinstance(item, torch.Tensor) else item for name, item in entry.items()}


def stored_rows(entry: dict) -> torch.Tensor:
    """The (n, C) float rows of a sparse entry: float16/32 rows as they are (or deflated, format 3), uint8 codes
    through their levels."""
    if "packed_codes" in entry:
        return dequantise(unpack_rows(entry["packed_codes"], int(entry["count"])), entry["levels"])
    if "packed_rows" in entry:
        return unpack_rows(entry["packed_rows"], int(entry["count"]), torch.float16)
    return entry["rows"]


def expand_state_dict(content: dict) -> dict[str, torch.Tensor]:
    """The full state dict of a :func:`compact_content` dict: kept rows in place (float32 or the original dtype),
    the left-out vertices filled (module docstring: why that cannot change a render)."""
    keep = _unpack_bits(content["vertices"]).reshape(-1)
    state = dict(content["dense"])
    for key, entry in content["sparse"].items():
        shape, dtype = [int(s) for s in entry["shape"]], getattr(torch, entry["dtype"])
        rows = entry["fill"].to(dtype).repeat(keep.numel(), 1)
        stored = stored_rows(entry).to(dtype)
        if stored.shape[0] != int(keep.sum()):
            raise ValueError(f"{key}: {stored.shape[0]} rows stored for {int(keep.sum())} kept vertices")
        rows[keep] = stored
        state[key] = rows.reshape(shape)
    for key, packed in content["bits"].items():
        state[key] = _unpack_bits(packed)
    for key, entry in content.get("pools", {}).items():  # the fine grid's rows, all stored
        state[key] = stored_rows(entry).to(getattr(torch, entry["dtype"])).reshape(entry["shape"])
    return state


def content_stats(content: dict) -> dict:
    """What a model file spends on its vertex grid: vertices (the whole grid), stored (kept vertices),
    stored_fraction, bytes_per_stored_vertex (the stored rows and codes over the stored vertices) and table_bytes
    (the per-channel levels and fills, whatever the vertex count)."""
    stored = int(_unpack_bits(content["vertices"]).sum())
    per_row = [entry["rows"] for entry in content["sparse"].values() if "rows" in entry]
    packed = [entry.get("packed_codes", []) + entry.get("packed_rows", []) for entry in content["sparse"].values()]
    per_row += [data for planes in packed for data in planes]
    tables = [entry[name] for entry in content["sparse"].values() for name in ("levels", "fill") if name in entry]
    size = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)  # noqa: E731
    total = int(np.prod(content["vertices"]["shape"]))
    return {
        "vertices": total,
        "stored": stored,
        "stored_fraction": stored / max(total, 1),
        "bytes_per_stored_vertex": size(per_row) / max(stored, 1),
        "table_bytes": size(tables),
    }


def save_model(path: str | os.PathLike, model: torch.nn.Module, run: dict) -> int:
    """Write the compact model file atomically (training.checkpoint.save_checkpoint); returns its size in bytes."""
    save_checkpoint(path, compact_content(model, run))
    return Path(path).stat().st_size


def read_model(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """(full state dict, run dict with config, step, history...) of a model file; CheckpointError naming the file
    when it is missing, unreadable or not a model file."""
    content = load_checkpoint(path, map_location="cpu")
    if content.get("format") != MODEL_FORMAT or content.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: not a voxel-field model file (format {content.get('format')!r})")
    try:
        state = expand_state_dict(content)
    except (KeyError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: damaged model file ({' '.join(str(error).split())})") from None
    run = dict(content["run"])
    if "config" not in run:
        raise CheckpointError(f"{path}: model file without its run's config")
    return state, run
