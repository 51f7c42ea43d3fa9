"""Export a finished run: a coloured point cloud, a coloured triangle mesh (PLY, GLB, OBJ), its cameras, or a
weights-only file.

    python -m training.export pointcloud RUN_DIR [--num-points 1000000] [--min-opacity 0.5] [--out PATH]
    python -m training.export mesh RUN_DIR [--level 0.5] [--resolution R] [--format ply|glb|obj] [--out PATH]
    python -m training.export cameras RUN_DIR [--out PATH]
    python -m training.export weights RUN_DIR [--half] [--out PATH]

**Frames.** Points, meshes and cameras are written in the scene's own frame (``--frame original``, the default):
that of its transforms file, so they line up with the capture's poses and sparse points. A nerfstudio capture
trained with ``data.orient=up`` was rotated, centred and scaled (data/orientation.py); the export undoes that
similarity, recomputed from the capture's transforms file (it must still be where the run found it). ``--frame
model`` keeps the run's own frame (that of ``render_path`` and the viewer). Other scenes are in their own frame.

**Point cloud.** Every training camera renders its view (``--downscale`` smaller a side); each pixel whose opacity
exceeds ``--min-opacity`` (default 0.5: the ray stops on a surface) gives a point at the ray's expected depth
(sum w t / opacity, the depth of the renders) with the rendered colour. Points outside the grids' box (a
contracted model: twice the box) are dropped, then statistical outliers (the mean distance to their 16 nearest
points above the mean by 2 standard deviations: open3d's and nerfstudio's rule; needs scipy, else skipped with a
note), then the cloud is subsampled at random (seeded) to ``--num-points``. A binary PLY of x, y, z (float) and
red, green, blue (uchar), as CloudCompare, MeshLab, Blender and plyfile read it (default ``RUN_DIR/pointcloud.ply``).

**Cameras.** The training and evaluation cameras as a nerfstudio transforms file (``RUN_DIR/cameras.json``): per
frame ``file_path``, ``transform_matrix`` (OpenGL camera-to-world), ``fl_x fl_y cx cy w h`` at the images' own size
and the distortion ``k1 k2 k3 k4 p1 p2``, with ``train_filenames`` and ``test_filenames``/``val_filenames``.
``render_path --path cameras.json`` renders it (it reads the file's ``frame`` key).

Both read the run's finished model ``RUN_DIR/model.pt`` (training.compact_model) or its resumable checkpoint
``RUN_DIR/checkpoints/last.pt``, the newer when both exist, and rebuild the model from the file's own config with
the PyTorch reference ops (no compiled extension needed), on the CPU.

**Mesh.** The density is turned into a per-voxel opacity, the alpha of one step of one final-grid voxel,
``alpha = 1 - exp(-softplus(density + shift))`` (the model's optical depth at ``step_scale = 1``: what a ray
loses crossing one voxel's length of that density, whatever the sampling step), evaluated on the density grid's
vertices (or, with ``--resolution R``, trilinearly resampled to R vertices along the box's longest side). Marching
cubes (PyMCubes) extracts the ``alpha = level`` surface; vertices go to world coordinates through ``model.bbox``
and take the view-independent colour, the sigmoid of the feature grid's first 3 channels (the diffuse colour
logit of both shading modes) trilinearly sampled there. Only the box of vertices reaching the level (plus one
vertex) is meshed, padded with empty space, so surfaces touching the grid's border are closed there.

Why ``level = 0.5`` by default: a voxel of alpha 0.5 stops half the light that enters it, so the 0.5 surface is
where a ray crossing the object's shell has lost about half its transmittance within one voxel: the depth a
render composites to, to within a voxel. Lower levels wrap the faint haze and floaters the training leaves in
empty space into the mesh (the occupancy grid skips below 1e-3); higher ones open holes where a surface is
spread over two or three voxels of moderate alpha (each below 0.9, say) that together are opaque.

**Weights.** A file apart from the resumable checkpoint, without the optimiser, RNG states or history: the model
state dict, the model config, the scene's near/far and box (what :class:`VoxelNeRF` is built from), the step;
``--half`` stores the two grids (almost all of the bytes) as float16. :func:`load_weights` rebuilds the model.
Both files are written atomically (temporary file, fsync, ``os.replace``).

Errors (missing run folder or checkpoint, a level no vertex reaches, a missing optional package) are one line on
stderr and exit code 2. The mesh needs the ``mesh`` extra: ``pip install -e ".[mesh]"`` (PyMCubes, plyfile; GLB and
OBJ: trimesh); the point cloud plyfile.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.field import grid_shape, optical_depth, to_unit
from models.model import VoxelNeRF
from models.ops import OpSet
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.finished_run import (
    GRID_KEYS,
    RunReadError,
    build_model,
    checkpoint_path,
    inverse_points,
    load_run,
    load_split,
    run_transform,
    scene_of,
)

EXIT_OK = 0
EXIT_USAGE = 2
DEFAULT_LEVEL = 0.5  # per-voxel alpha of the surface (module docstring: why)
MESH_HINT = 'pip install -e ".[mesh]"'
MESH_FORMATS = ("ply", "glb", "obj")
FRAMES = ("original", "model")
DEFAULT_POINTS = 1_000_000
OUTLIER_NEIGHBOURS, OUTLIER_STD = 16, 2.0
WEIGHTS_FORMAT = "voxel-field-weights"
WEIGHTS_VERSION = 1
CHUNK = 1 << 18  # points per grid lookup when resampling


class ExportError(RunReadError):
    """An export cannot be made; the message is one line naming the file or the option."""


# ---------------------------------------------------------------------------------------------- mesh
@torch.no_grad()
def vertex_alpha(model: VoxelNeRF, resolution: int | None = None) -> torch.Tensor:
    """(R0, R1, R2) per-voxel alpha (one final-grid voxel step) at the density grid's vertices over
    ``model.bbox``, or at the vertices of a grid of ``resolution`` vertices along the box's longest side (the
    model's whole density: the fine grid's added where it has bricks)."""
    density = model.density.grid.detach()
    if resolution is None and not model.fine.active:
        raw = density[..., 0]
    else:
        if resolution is not None and resolution < 2:
            raise ExportError(f"--resolution: need at least 2 vertices, got {resolution}")
        box = model.bbox.detach().cpu()
        extent = tuple(float(e) for e in (box[1] - box[0]).tolist())
        shape = model.grid_shape if resolution is None else grid_shape(extent, resolution)
        axis0, axis1, axis2 = (torch.linspace(-1.0, 1.0, n) for n in shape)
        plane = torch.stack(torch.meshgrid(axis1, axis2, indexing="ij"), dim=-1).reshape(-1, 2)
        raw = torch.empty(shape)
        for i, u in enumerate(axis0.tolist()):  # one slab of vertices at a time: bounded memory at any resolution
            points = torch.cat([torch.full((len(plane), 1), u), plane], dim=1)
            raw[i] = model.query_density(points.to(density.device)).cpu().reshape(shape[1], shape[2])
    return -torch.expm1(-optical_depth(raw.float(), model.config.density_shift, 1.0))


@torch.no_grad()
def extract_mesh(
    model: VoxelNeRF, level: float = DEFAULT_LEVEL, resolution: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(vertices (V, 3) float32 world, faces (F, 3) int32 outward-facing, colours (V, 3) uint8) of the
    ``alpha = level`` surface. Raises ExportError (naming the largest alpha) when no vertex reaches ``level``."""
    if not 0.0 < level < 1.0:
        raise ExportError(f"--level: the surface's alpha must lie in (0, 1), got {level}")
    mcubes = _require("mcubes", "PyMCubes")
    alpha = vertex_alpha(model, resolution).cpu().numpy().astype(np.float64)
    occupied = np.argwhere(alpha >= level)
    if len(occupied) == 0:
        raise ExportError(
            f"empty mesh: no vertex reaches alpha {level:g} (the largest is {alpha.max():.3g}); lower --level"
        )
    shape = np.array(alpha.shape)
    low = np.maximum(occupied.min(0) - 1, 0)
    high = np.minimum(occupied.max(0) + 1, shape - 1)
    crop = alpha[low[0] : high[0] + 1, low[1] : high[1] + 1, low[2] : high[2] + 1]
    crop = np.pad(crop, 1, constant_values=0.0)  # empty space around: surfaces at the border close
    vertices, faces = mcubes.marching_cubes(crop, level)  # index space; faces counter-clockwise seen from outside
    index = np.clip(vertices + (low - 1), 0, shape - 1)  # a closing cap at the border lands on the box's face
    index, faces = _drop_degenerate(index, faces.astype(np.int64))
    if len(faces) == 0:
        raise ExportError(f"empty mesh: the alpha {level:g} surface has no area (one vertex reaches it); lower --level")
    box = model.bbox.detach().cpu().double().numpy()
    world = box[0] + index * ((box[1] - box[0]) / (shape - 1))
    unit = to_unit(torch.from_numpy(world).float(), model.bbox.detach().cpu().float()).clamp(-1.0, 1.0)
    if model.fine.active:  # the coarse grid's diffuse plus the fine grid's
        parts = [
            model.query_features(unit[i : i + CHUNK].to(model.bbox.device))[:, :3].float().cpu()
            for i in range(0, len(unit), CHUNK)
        ]
        logits = torch.cat(parts)
    else:
        diffuse = model.features.grid.detach()[..., :3].float().contiguous()
        logits = torch.cat(
            [model.ops.grid_interpolate(diffuse, unit[i : i + CHUNK]) for i in range(0, len(unit), CHUNK)]
        )
    colours = (torch.sigmoid(logits) * 255.0).round().to(torch.uint8).numpy()
    return world.astype(np.float32), faces.astype(np.int32), colours


def _drop_degenerate(vertices: np.ndarray, faces: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weld vertices that coincide (marching cubes emits one per cube edge, so a grid value equal to the level
    makes several at one point, and the border clamp moves some onto others), then remove the faces that
    collapse (a repeated vertex, or zero area) and the vertices no face uses any more. Welding first keeps the
    surface closed: dropping a collapsed face between unwelded twins would leave a hole."""
    _, weld = np.unique(np.round(vertices, 9), axis=0, return_inverse=True)
    faces = weld.reshape(-1)[faces]
    distinct = (faces[:, 0] != faces[:, 1]) & (faces[:, 1] != faces[:, 2]) & (faces[:, 0] != faces[:, 2])
    first = np.zeros(weld.max() + 1, dtype=np.int64)
    first[weld.reshape(-1)] = np.arange(len(vertices))  # one original vertex per welded point
    vertices = vertices[first]
    faces = faces[distinct]
    a, b, c = (vertices[faces[:, k]] for k in range(3))
    faces = faces[np.linalg.norm(np.cross(b - a, c - a), axis=1) > 1e-12]
    used, faces = np.unique(faces, return_inverse=True)
    return vertices[used], faces.reshape(-1, 3)


def write_ply(path: str | os.PathLike, vertices: np.ndarray, faces: np.ndarray | None, colours: np.ndarray) -> None:
    """Binary little-endian PLY: vertex x, y, z (float) and red, green, blue (uchar); face vertex_indices (int),
    none for a point cloud (``faces`` None)."""
    plyfile = _require("plyfile", "plyfile")
    fields = [("x", "f4"), ("y", "f4"), ("z", "f4"), ("red", "u1"), ("green", "u1"), ("blue", "u1")]
    vertex = np.empty(len(vertices), dtype=fields)
    for column, (name, _) in enumerate(fields):
        vertex[name] = vertices[:, column] if column < 3 else colours[:, column - 3]
    elements = [plyfile.PlyElement.describe(vertex, "vertex")]
    if faces is not None:
        face = np.empty(len(faces), dtype=[("vertex_indices", "i4", (3,))])
        face["vertex_indices"] = faces
        elements.append(plyfile.PlyElement.describe(face, "face"))
    data = plyfile.PlyData(elements, text=False, byte_order="<")
    _atomic_write(Path(path), data.write)


def write_trimesh(path: Path, vertices: np.ndarray, faces: np.ndarray, colours: np.ndarray, fmt: str) -> None:
    """A GLB (binary glTF) or OBJ of the mesh with its vertex colours, through trimesh."""
    trimesh = _require("trimesh", "trimesh")
    alpha = np.full((len(colours), 1), 255, np.uint8)
    mesh = trimesh.Trimesh(
        vertices=vertices, faces=faces, vertex_colors=np.concatenate([colours, alpha], 1), process=False
    )
    content = mesh.export(file_type=fmt)
    _atomic_write(path, lambda file: file.write(content.encode() if isinstance(content, str) else content))


def mesh_format(out: Path | None, fmt: str | None) -> str:
    """The mesh's file format: ``--format``, else the suffix of ``--out``, else ply."""
    if fmt is None:
        suffix = out.suffix.lower().lstrip(".") if out is not None else "ply"
        if suffix not in MESH_FORMATS:
            raise ExportError(f"--out: {out} has no mesh suffix ({', '.join(MESH_FORMATS)}); or give --format")
        return suffix
    if fmt not in MESH_FORMATS:
        raise ExportError(f"--format: must be one of {', '.join(MESH_FORMATS)}, got {fmt!r}")
    return fmt


def to_frame(points: np.ndarray, state: dict, frame: str) -> np.ndarray:
    """(N, 3) points of the run's frame in ``frame`` (module doc, Frames)."""
    if frame not in FRAMES:
        raise ExportError(f"--frame: must be one of {', '.join(FRAMES)}, got {frame!r}")
    if frame == "model":
        return np.asarray(points, np.float64)
    return inverse_points(original_frame(state), points)


def original_frame(state: dict):
    """The run's data.orient similarity, to undo it (training.finished_run.run_transform)."""
    return run_transform(
        state,
        "--frame original: cannot read the capture to undo data.orient; use --frame model, or put the capture "
        "back where the run found it",
    )


def export_mesh(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    level: float = DEFAULT_LEVEL,
    resolution: int | None = None,
    fmt: str | None = None,
    frame: str = "original",
) -> dict[str, Any]:
    """Mesh a run's density at ``level`` into ``out`` (default ``RUN_DIR/mesh.<fmt>``; ``fmt``: ply, glb or obj,
    default from ``out``'s suffix, else ply) in ``frame``; returns what was written."""
    fmt = mesh_format(Path(out) if out is not None else None, fmt)
    _require("mcubes", "PyMCubes")  # before the (possibly slow) model load
    _require("plyfile", "plyfile") if fmt == "ply" else _require("trimesh", "trimesh")
    model, state = load_run(run_dir)
    vertices, faces, colours = extract_mesh(model, level, resolution)
    if frame != "model":
        vertices = to_frame(vertices, state, frame).astype(np.float32)  # a similarity: faces keep their winding
    out = Path(out) if out is not None else Path(run_dir) / f"mesh.{fmt}"
    if fmt == "ply":
        write_ply(out, vertices, faces, colours)
    else:
        write_trimesh(out, vertices, faces, colours, fmt)
    return {
        "path": out,
        "vertices": len(vertices),
        "faces": len(faces),
        "level": level,
        "step": int(state.get("step", 0)),
        "bounds": (vertices.min(0).tolist(), vertices.max(0).tolist()),
    }


# ---------------------------------------------------------------------------------------------- point cloud
def _run_scene(state: dict, split: str | None, model: VoxelNeRF):
    """One split of the run's scene (training.finished_run.load_split), as an ExportError when it cannot be read."""
    from data import SceneError

    config = state["config"]
    try:
        foreground = str(config["model"].get("contraction", "none")) != "none"
        return load_split(dict(config["data"]), split, multiple=model.upsample, foreground=foreground)
    except SceneError as error:
        raise ExportError(f"cannot load the run's scene ({' '.join(str(error).split())})") from None


def drop_outliers(points: np.ndarray, neighbours: int = OUTLIER_NEIGHBOURS, ratio: float = OUTLIER_STD) -> np.ndarray:
    """(N,) bool: the points whose mean distance to their ``neighbours`` nearest is within ``ratio`` standard
    deviations above the mean of that distance (statistical outlier removal); all True without scipy (noted)."""
    if len(points) <= neighbours:
        return np.ones(len(points), bool)
    try:
        from scipy.spatial import cKDTree
    except ImportError:
        print("note: scipy is not installed: statistical outliers are kept (pip install scipy)", file=sys.stderr)
        return np.ones(len(points), bool)
    distances, _ = cKDTree(points).query(points, k=neighbours + 1, workers=-1)
    mean = distances[:, 1:].mean(1)
    return mean <= mean.mean() + ratio * mean.std()


@torch.no_grad()
def extract_pointcloud(
    model: VoxelNeRF,
    scene,
    num_points: int = DEFAULT_POINTS,
    min_opacity: float = 0.5,
    downscale: int = 1,
    chunk: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """(points (N, 3) float64 in the run's frame, colours (N, 3) uint8) from ``scene``'s cameras' rendered depth
    (module doc); N <= ``num_points``."""
    from tqdm import tqdm

    from data.rays import camera_rays
    from training.inference import render_view

    if num_points < 1:
        raise ExportError(f"--num-points: must be >= 1, got {num_points}")
    if not 0.0 <= min_opacity < 1.0:
        raise ExportError(f"--min-opacity: must lie in [0, 1), got {min_opacity}")
    if downscale < 1:
        raise ExportError(f"--downscale: must be >= 1, got {downscale}")
    block = downscale * model.upsample
    smallest = min(min(scene.view_size(view)) for view in range(scene.num_views))
    if smallest // block < 1:
        raise ExportError(f"--downscale: {downscale} leaves no pixel of the {scene.describe_sizes()} views")
    generator = np.random.default_rng(seed)
    per_view = max(1, math.ceil(2 * num_points / scene.num_views))  # candidates kept a view (the cloud's 2x)
    device = model.bbox.device
    box = model.bbox.detach().cpu().double().numpy()
    if model.config.contraction != "none":
        centre, half = box.mean(0), box[1] - box.mean(0)
        box = np.stack([centre - 2 * half, centre + 2 * half])
    points, colours = [], []
    for view in tqdm(range(scene.num_views), desc="point cloud", unit="view", disable=not progress):
        full_height, full_width = scene.view_size(view)  # its own size (frames may mix portrait and landscape)
        height, width = full_height // block * model.upsample, full_width // block * model.upsample
        c2w = scene.c2w[view].to(device)
        intrinsics = (scene.intrinsics[view].double() * (width / full_width)).to(device)
        lens = None if scene.lens is None else scene.lens.take(torch.tensor(view)).to(device)
        out = render_view(model, c2w, height, width, intrinsics, chunk, lens)
        opacity = out["opacity"].reshape(-1)
        keep = torch.nonzero(opacity > min_opacity).reshape(-1)
        if len(keep) == 0:
            continue
        if len(keep) > per_view:
            keep = keep[torch.from_numpy(generator.choice(len(keep), per_view, replace=False)).to(keep.device)]
        origins, directions = camera_rays(c2w.double(), height, width, intrinsics, 1, lens)
        depth = (out["depth"].reshape(-1)[keep] / opacity[keep]).double()
        seen = origins.reshape(-1, 3)[keep] + directions.reshape(-1, 3)[keep] * depth[:, None]
        points.append(seen.cpu().numpy())
        colours.append((out["rgb"].reshape(-1, 3)[keep].float().cpu().numpy() * 255.0).round().astype(np.uint8))
    if not points:
        raise ExportError(f"empty point cloud: no pixel of the training views is above opacity {min_opacity:g}")
    points, colours = np.concatenate(points), np.concatenate(colours)
    inside = np.isfinite(points).all(1) & (points >= box[0]).all(1) & (points <= box[1]).all(1)
    points, colours = points[inside], colours[inside]
    kept = drop_outliers(points)
    points, colours = points[kept], colours[kept]
    if len(points) > num_points:
        chosen = np.sort(generator.choice(len(points), num_points, replace=False))
        points, colours = points[chosen], colours[chosen]
    if len(points) == 0:
        raise ExportError("empty point cloud: every point fell outside the grids' box")
    return points, colours


def export_pointcloud(
    run_dir: str | os.PathLike,
    out: str | os.PathLike | None = None,
    num_points: int = DEFAULT_POINTS,
    min_opacity: float = 0.5,
    frame: str = "original",
    downscale: int = 1,
    device: str = "auto",
    chunk: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """The run's coloured point cloud (module doc) into ``out`` (default ``RUN_DIR/pointcloud.ply``)."""
    from training.finished_run import fast_ops
    from training.scenes import resolve_device

    _require("plyfile", "plyfile", "point cloud")
    if frame not in FRAMES:
        raise ExportError(f"--frame: must be one of {', '.join(FRAMES)}, got {frame!r}")
    model, state = load_run(run_dir, fast_ops())
    model = model.to(resolve_device(device)).eval()
    transform = original_frame(state) if frame == "original" else None  # before rendering: fail early
    scene = _run_scene(state, "train", model)
    points, colours = extract_pointcloud(model, scene, num_points, min_opacity, downscale, chunk, progress=progress)
    if transform is not None:
        points = inverse_points(transform, points)
    out = Path(out) if out is not None else Path(run_dir) / "pointcloud.ply"
    write_ply(out, points.astype(np.float32), None, colours)
    return {
        "path": out,
        "points": len(points),
        "views": scene.num_views,
        "frame": frame,
        "step": int(state.get("step", 0)),
        "bounds": (points.min(0).tolist(), points.max(0).tolist()),
    }


# ---------------------------------------------------------------------------------------------- cameras
def camera_frames(scene, transform, downscale: int) -> list[dict]:
    """nerfstudio transforms-file frames of a split: its poses in the frame of ``transform`` (None: the run's), the
    intrinsics and size at the images' own scale (the run's times ``downscale``)."""
    from training.finished_run import inverse_poses

    c2w = scene.c2w.double().cpu().numpy()
    if transform is not None:
        c2w = inverse_poses(transform, c2w)
    frames = []
    for view in range(scene.num_views):
        fx, fy, cx, cy = (float(v) * downscale for v in scene.intrinsics[view].tolist())
        name = scene.names[view]
        name = name if Path(name).suffix else f"{name}.png"  # the blender scenes name their PNGs without suffix
        frame = {"file_path": name, "transform_matrix": c2w[view].tolist()}
        width, height = scene.width * downscale, scene.height * downscale
        frame |= {"fl_x": fx, "fl_y": fy, "cx": cx, "cy": cy, "w": width, "h": height}
        coefficients = [0.0] * 6 if scene.lens is None else scene.lens.coefficients[view].tolist()
        frame |= dict(zip(("k1", "k2", "k3", "k4", "p1", "p2"), coefficients))
        frames.append(frame)
    return frames


def export_cameras(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, frame: str = "original") -> dict:
    """The run's training and evaluation cameras as a nerfstudio transforms file (module doc, Cameras)."""
    if frame not in FRAMES:
        raise ExportError(f"--frame: must be one of {', '.join(FRAMES)}, got {frame!r}")
    model, state = load_run(run_dir)
    transform = original_frame(state) if frame == "original" else None
    train = _run_scene(state, "train", model)
    evaluation = _run_scene(state, None, model)
    downscale = int(state["config"]["data"].get("downscale", 1) or 1)
    fisheye = any(scene.lens is not None and scene.lens.fisheye for scene in (train, evaluation))
    content = {
        "camera_model": "OPENCV_FISHEYE" if fisheye else "OPENCV",
        "frame": frame,  # original: the scene's own frame; model: the run's (training.render_path reads it)
        "frames": camera_frames(train, transform, downscale) + camera_frames(evaluation, transform, downscale),
        "train_filenames": [f["file_path"] for f in camera_frames(train, None, 1)],
        f"{evaluation.split}_filenames": [f["file_path"] for f in camera_frames(evaluation, None, 1)],
    }
    out = Path(out) if out is not None else Path(run_dir) / "cameras.json"
    text = json.dumps(content, indent=2) + "\n"
    _atomic_write(out, lambda file: file.write(text.encode()))
    return {"path": out, "frames": len(content["frames"]), "train": train.num_views, "eval": evaluation.num_views}


# ---------------------------------------------------------------------------------------------- weights
def export_weights(run_dir: str | os.PathLike, out: str | os.PathLike | None = None, half: bool = False) -> dict:
    """Write a run's weights-only file (default ``RUN_DIR/weights.pt``, ``weights_fp16.pt`` with ``half``)."""
    path = checkpoint_path(run_dir)
    model, state = load_run(run_dir)
    weights = {
        k: (v.half() if half and k in GRID_KEYS else v).detach().cpu().clone() for k, v in model.state_dict().items()
    }
    content = {
        "format": WEIGHTS_FORMAT,
        "version": WEIGHTS_VERSION,
        "model": weights,
        "model_config": dict(state["config"]["model"]),
        "scene": scene_of(state["config"]["data"]),
        "step": int(state.get("step", 0)),
        "grids_dtype": "float16" if half else "float32",
        "source": str(path),
    }
    out = Path(out) if out is not None else Path(run_dir) / ("weights_fp16.pt" if half else "weights.pt")
    try:
        save_checkpoint(out, content)  # atomic: temporary file, fsync, os.replace
    except OSError as error:
        raise ExportError(f"{out}: cannot write ({error.strerror or error})") from None
    return {"path": out, "bytes": out.stat().st_size, "step": content["step"], "grids_dtype": content["grids_dtype"]}


def load_weights(path: str | os.PathLike, ops: OpSet | None = None) -> VoxelNeRF:
    """The :class:`VoxelNeRF` of a weights file (eval mode, CPU, float32 grids); ``ops`` default: the references."""
    try:
        content = load_checkpoint(path, map_location="cpu")
    except CheckpointError as error:
        raise ExportError(str(error)) from None
    if content.get("format") != WEIGHTS_FORMAT or content.get("version") != WEIGHTS_VERSION:
        raise ExportError(f"{path}: not a voxel-field weights file (format {content.get('format')!r})")
    return build_model(content["model_config"], content["scene"], content["model"], ops)


# ---------------------------------------------------------------------------------------------- helpers
def _require(module: str, package: str, what: str = "mesh"):
    try:
        return __import__(module)
    except ImportError:
        raise ExportError(f"{what} export needs the {package} package: {MESH_HINT}") from None


def _atomic_write(path: Path, write) -> None:
    """Call ``write(file)`` on a temporary file beside ``path``, fsync it and rename it over ``path``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise ExportError(f"{path}: cannot write ({error.strerror or error})") from None
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp, 0o644)  # mkstemp made it 0600
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="voxel-field-export", description="Export a finished run: point cloud, mesh, cameras or weights."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{pointcloud,mesh,cameras,weights}")
    run_help = "the run folder (holds model.pt)"
    frame_help = "original: the scene's own frame (default; undoes data.orient); model: the run's"

    cloud = commands.add_parser("pointcloud", help="coloured points from the training views' rendered depth (PLY)")
    cloud.add_argument("run_dir", type=Path, help=run_help)
    cloud.add_argument("--num-points", type=int, default=DEFAULT_POINTS, help="at most this many points (1000000)")
    cloud.add_argument("--min-opacity", type=float, default=0.5, help="keep pixels above this opacity (0.5)")
    cloud.add_argument("--downscale", type=int, default=1, help="render the views this many times smaller a side")
    cloud.add_argument("--frame", default="original", choices=FRAMES, help=frame_help)
    cloud.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    cloud.add_argument("--out", type=Path, default=None, help="output file (default RUN_DIR/pointcloud.ply)")

    mesh = commands.add_parser("mesh", help="mesh of the density, vertex colours the diffuse colour (PLY, GLB, OBJ)")
    mesh.add_argument("run_dir", type=Path, help=run_help)
    mesh.add_argument(
        "--level", type=float, default=DEFAULT_LEVEL, help="per-voxel alpha of the surface, in (0, 1) (default 0.5)"
    )
    mesh.add_argument(
        "--resolution", type=int, default=None, help="vertices along the longest side (default: the grid's own)"
    )
    mesh.add_argument("--format", default=None, choices=MESH_FORMATS, help="default: --out's suffix, else ply")
    mesh.add_argument("--frame", default="original", choices=FRAMES, help=frame_help)
    mesh.add_argument("--out", type=Path, default=None, help="output file (default RUN_DIR/mesh.<format>)")

    cameras = commands.add_parser("cameras", help="the training and evaluation cameras (nerfstudio transforms JSON)")
    cameras.add_argument("run_dir", type=Path, help=run_help)
    cameras.add_argument("--frame", default="original", choices=FRAMES, help=frame_help)
    cameras.add_argument("--out", type=Path, default=None, help="output file (default RUN_DIR/cameras.json)")

    weights = commands.add_parser("weights", help="weights-only file: model state, model config, scene")
    weights.add_argument("run_dir", type=Path, help=run_help)
    weights.add_argument("--half", action="store_true", help="store the grids as float16")
    weights.add_argument("--out", type=Path, default=None, help="output file (default RUN_DIR/weights[_fp16].pt)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "mesh":
            result = export_mesh(args.run_dir, args.out, args.level, args.resolution, args.format, args.frame)
            low, high = ([round(v, 3) for v in corner] for corner in result["bounds"])
            print(
                f"wrote {result['path']}: {result['vertices']} vertices, {result['faces']} faces "
                f"(alpha {result['level']:g} surface of step {result['step']}; bounds {low} .. {high})"
            )
        elif args.command == "pointcloud":
            result = export_pointcloud(
                args.run_dir, args.out, args.num_points, args.min_opacity, args.frame, args.downscale, args.device
            )
            low, high = ([round(v, 3) for v in corner] for corner in result["bounds"])
            print(
                f"wrote {result['path']}: {result['points']} points from {result['views']} training views "
                f"(step {result['step']}, {result['frame']} frame; bounds {low} .. {high})"
            )
        elif args.command == "cameras":
            result = export_cameras(args.run_dir, args.out, args.frame)
            print(
                f"wrote {result['path']}: {result['frames']} cameras ({result['train']} train, {result['eval']} eval)"
            )
        else:
            result = export_weights(args.run_dir, args.out, args.half)
            print(
                f"wrote {result['path']}: {result['bytes'] / 2**20:.1f} MiB, step {result['step']} "
                f"({result['grids_dtype']} grids)"
            )
    except RunReadError as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
