"""nerfstudio's data format (``transforms.json``, as ``ns-process-data`` writes it): reading it into Scenes.

Layout: ``<root>/transforms.json`` (``root`` may also name the JSON file itself) with ``frames``, each with
``file_path`` (relative to the JSON file's folder) and ``transform_matrix`` (4x4 camera-to-world, OpenGL
convention like the blender scenes: the camera looks down -z, y up). Intrinsics, image size, camera model and
distortion (nerfstudio's and instant-ngp's variants: data/capture_cameras.py) sit at the top level (for every
frame; as in nerfstudio, a top-level key wins over a frame's own) or in each frame. Distorted cameras
(radial-tangential or fisheye) are trained as captured: their rays are undistorted (data/camera_models.py).

What we do with the rest:
- nerfstudio's ``applied_transform`` (3x4 or 4x4) is the transform ns-process-data already applied to the poses
  from COLMAP's world, and to the sparse points it wrote to ``ply_file_path`` (``sparse_pc.ply``): both are in the
  file's world, so it is applied to neither (kept, checked, on the Capture: it leads back to COLMAP's world).
- ``orient`` (data.orient, data/orientation.py): ``up`` rotates the poses' world so the cameras' mean up is +z,
  centres it on their focus point and scales the cameras into [-1, 1]^3 (points and boxes follow); ``none`` keeps
  the poses as given.
- instant-ngp's ``aabb_scale``, ``scale`` and ``offset`` place its box, [0.5 - aabb_scale/2, 0.5 + aabb_scale/2]^3
  in its coordinates ``position * scale + offset`` (defaults 1, 0.33, 0.5): kept as the bounds' ``extent`` (in our
  frame: how far the capture's author says the scene reaches), while the poses stay in the file's units.
- Splits: ``train_filenames`` and ``test_filenames`` (else ``val_filenames``) when present; else frames sorted
  by file_path, every ``eval_interval``-th (0, 8, 16, ...) is evaluation, the rest training.
- The scene box (the grids' extent) and near/far come from the cameras (data.bounds), or from the sparse
  points when there are any (plyfile installed); ``scene_box``, ``near``, ``far`` override them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from data.blender import _check_rotation, _frame_matrix, _read_json, _worker_count
from data.bounds import Bounds, capture_bounds
from data.camera_models import Lens
from data.capture_cameras import check_lenses, frame_camera, is_fisheye, number
from data.colmap import find_model, image_folder, read_model, transforms_from_model, turned_points
from data.errors import SceneError
from data.images import image_size, load_composited, write_png
from data.orientation import Similarity, orientation
from data.scene import Scene

NGP_SCALE, NGP_OFFSET = 0.33, 0.5  # instant-ngp's defaults
SPLIT_KEYS = ("train_filenames", "val_filenames", "test_filenames")


@dataclass
class Frame:
    """One frame: its file_path as written, image file, (4, 4) camera-to-world (oriented), (fx, fy, cx, cy) and
    the distortion coefficients k1 k2 k3 k4 p1 p2."""

    name: str
    image: Path
    c2w: np.ndarray
    intrinsics: tuple[float, float, float, float]
    size: tuple[int, int] | None  # (h, w) from the JSON, or None when it gives none
    distortion: tuple[float, ...] = (0.0,) * 6


@dataclass
class Capture:
    """A parsed transforms.json (no pixels read): frames sorted by file_path and the splits' frame indices."""

    path: Path
    frames: list[Frame]
    splits: dict[str, list[int]]  # "train" and the eval split ("test" or "val")
    eval_split: str
    applied: np.ndarray  # (4, 4) applied_transform (identity when absent)
    applied_scale: float
    ply: Path | None
    fisheye: bool = False
    transform: Similarity = Similarity.identity()  # file's world -> ours (data.orient), applied to frames' c2w
    ngp_box: np.ndarray | None = None  # (2, 3) instant-ngp's box in the file's world, or None
    points: np.ndarray | None = None  # (N, 3) sparse points in the file's world (a COLMAP model's), in place of ``ply``


def transforms_file(root: str | os.PathLike) -> Path:
    """The transforms JSON of ``root`` (a folder holding transforms.json, or the JSON file itself)."""
    root = Path(root).expanduser()
    if not root.exists():
        raise SceneError(f"nerfstudio scene {root} does not exist")
    path = root if root.is_file() else root / "transforms.json"
    if not path.is_file():
        raise SceneError(f"{path} not found (a nerfstudio scene folder holds transforms.json)")
    return path


def _frame(root: Path, path: Path, meta: dict, index: int, frame: dict) -> Frame:
    if not isinstance(frame, dict):
        raise SceneError(f"{path}: frame {index} must be an object, got {type(frame).__name__}")
    name = frame.get("file_path")
    if not isinstance(name, str) or not name:
        raise SceneError(f"{path}: frame {index}: file_path must be a non-empty string, got {name!r}")
    where = f"{path}: frame {index} ({name!r})"
    image = root / name
    if not image.is_file():
        raise SceneError(f"{where}: image {image} not found")
    intrinsics, size, distortion = frame_camera(path, meta, frame, where, image)
    return Frame(name, image, _frame_matrix(path, index, frame), intrinsics, size, distortion)


def _normalised(name: str) -> str:
    return os.path.normpath(name)


def _splits(path: Path, meta: dict, frames: list[Frame], eval_interval: int) -> tuple[dict[str, list[int]], str]:
    lists = {key: meta[key] for key in SPLIT_KEYS if key in meta}
    if not lists:
        if len(frames) < 2:
            raise SceneError(f"{path}: needs at least 2 frames (one to train on, one to evaluate on)")
        evaluation = [i for i in range(len(frames)) if i % eval_interval == 0]
        return {"train": [i for i in range(len(frames)) if i % eval_interval], "val": evaluation}, "val"
    eval_key = "test_filenames" if "test_filenames" in lists else "val_filenames"
    if "train_filenames" not in lists or eval_key not in lists:
        raise SceneError(
            f"{path}: has {', '.join(lists)} but needs train_filenames and test_filenames or val_filenames"
        )
    index = {_normalised(frame.name): i for i, frame in enumerate(frames)}
    splits = {}
    for key in ("train_filenames", eval_key):
        names = lists[key]
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise SceneError(f"{path}: {key} must be a non-empty list of file paths")
        unknown = [n for n in names if _normalised(n) not in index]
        if unknown:
            raise SceneError(f"{path}: {key} names {len(unknown)} file(s) with no frame, e.g. {unknown[:3]}")
        splits[key.split("_")[0]] = sorted({index[_normalised(n)] for n in names})
    return splits, eval_key.split("_")[0]


def _applied(path: Path, meta: dict) -> tuple[np.ndarray, float]:
    matrix = np.eye(4)
    if "applied_transform" in meta:
        try:
            given = np.asarray(meta["applied_transform"], dtype=np.float64)
        except (TypeError, ValueError):
            raise SceneError(f"{path}: applied_transform is not a 3x4 or 4x4 array of numbers") from None
        if given.shape not in ((3, 4), (4, 4)) or not np.isfinite(given).all():
            raise SceneError(f"{path}: applied_transform must be 3x4 or 4x4 finite numbers, got shape {given.shape}")
        if given.shape == (4, 4) and not np.allclose(given[3], [0.0, 0.0, 0.0, 1.0], atol=1e-6):
            raise SceneError(f"{path}: applied_transform's last row must be [0, 0, 0, 1], got {given[3].tolist()}")
        _check_rotation(f"{path}: applied_transform", given[:3, :3])
        matrix[:3] = given[:3]
    scale = number(path, "applied_scale", meta.get("applied_scale", 1.0), positive=True)
    return matrix, scale


def _ngp_box(path: Path, meta: dict) -> np.ndarray | None:
    """instant-ngp's box (2, 3) in the file's world from aabb_scale, scale, offset; None when none is given."""
    if not any(key in meta for key in ("aabb_scale", "scale", "offset")):
        return None
    aabb_scale = number(path, "aabb_scale", meta.get("aabb_scale", 1), positive=True)
    scale = number(path, "scale", meta.get("scale", NGP_SCALE), positive=True)
    offset = meta.get("offset", NGP_OFFSET)
    offsets = offset if isinstance(offset, list) else [offset]
    if len(offsets) not in (1, 3):
        raise SceneError(f"{path}: offset must be a number or 3 numbers, got {offset!r}")
    offsets = np.array([number(path, "offset", value) for value in offsets]) * np.ones(3)
    centre = (0.5 - offsets) / scale  # where instant-ngp's unit cube centre (0.5, 0.5, 0.5) sits in the file's world
    half = 0.5 * aabb_scale / scale
    return np.stack([centre - half, centre + half])


def read_capture(root: str | os.PathLike, eval_interval: int = 8, orient: str = "up") -> Capture:
    """Parse and check a nerfstudio transforms file (every problem: :class:`SceneError` naming file and key), its
    poses oriented by ``orient`` (data/orientation.py)."""
    path = transforms_file(root)
    meta = _read_json(path)
    ply = None
    if "ply_file_path" in meta:
        if not isinstance(meta["ply_file_path"], str) or not (path.parent / meta["ply_file_path"]).is_file():
            raise SceneError(f"{path}: ply_file_path {meta['ply_file_path']!r} is not a file")
        ply = path.parent / meta["ply_file_path"]
    elif (path.parent / "sparse_pc.ply").is_file():
        ply = path.parent / "sparse_pc.ply"
    return parse_capture(path, path.parent, meta, eval_interval, orient, ply=ply)


def parse_capture(
    path: Path,
    base: Path,
    meta: dict,
    eval_interval: int = 8,
    orient: str = "up",
    ply: Path | None = None,
    points: np.ndarray | None = None,
) -> Capture:
    """A :class:`Capture` of a transforms dict ``meta`` (read from ``path``, named in errors; file paths relative
    to ``base``), its sparse points in ``ply`` or ``points`` (N, 3), in the poses' world."""
    if isinstance(eval_interval, bool) or not isinstance(eval_interval, int) or eval_interval < 2:
        raise ValueError(f"read_capture: eval_interval must be an int >= 2, got {eval_interval!r}")
    frames = meta.get("frames")
    if not isinstance(frames, list) or not frames:
        raise SceneError(f"{path}: 'frames' must be a non-empty list")
    fisheye = is_fisheye(path, meta, frames)
    parsed = [_frame(base, path, meta, i, frame) for i, frame in enumerate(frames)]
    check_lenses(path, parsed, fisheye)
    order = sorted(range(len(parsed)), key=lambda i: parsed[i].name)  # nerfstudio sorts frames by file name
    parsed = [parsed[i] for i in order]
    splits, eval_split = _splits(path, meta, parsed, eval_interval)
    applied, applied_scale = _applied(path, meta)
    try:
        transform = orientation(np.stack([frame.c2w for frame in parsed]), orient)
    except ValueError as error:
        raise SceneError(f"{path}: {error}") from None
    for frame in parsed:
        frame.c2w = transform.poses(frame.c2w[None])[0]
    return Capture(
        path, parsed, splits, eval_split, applied, applied_scale, ply, fisheye, transform, _ngp_box(path, meta), points
    )


def read_points(capture: Capture) -> np.ndarray | None:
    """(N, 3) sparse points in the (oriented) poses' world, or None (no points, or plyfile not installed)."""
    points = capture.points if capture.points is not None else _ply_points(capture.ply)
    if points is None or not len(points):
        return None
    return capture.transform.points(points[np.isfinite(points).all(-1)])


def _ply_points(ply: Path | None) -> np.ndarray | None:
    if ply is None:
        return None
    try:
        from plyfile import PlyData
    except ImportError:
        print(f"note: {ply} ignored (pip install plyfile to use it); the scene box comes from the cameras")
        return None
    try:
        vertex = PlyData.read(str(ply))["vertex"]
        return np.stack([np.asarray(vertex[axis], np.float64) for axis in "xyz"], -1)
    except Exception as error:  # plyfile raises several types for a broken file
        raise SceneError(f"{ply}: cannot read the sparse points ({type(error).__name__}: {error})") from None


def nerfstudio_bounds(
    capture: Capture, scene_box: float | Sequence[float] | None = None, near=None, far=None, foreground: bool = False
) -> Bounds:
    """The capture's scene box and near/far (from every frame's camera, so both splits share them), in the
    oriented frame (``foreground``: a contracted scene's, :func:`data.bounds.capture_bounds`); ``extent``:
    instant-ngp's box there, when the file has one."""
    c2w = np.stack([frame.c2w for frame in capture.frames])
    intrinsics = np.array([frame.intrinsics for frame in capture.frames])
    sizes = [frame.size or image_size(frame.image) for frame in capture.frames]
    try:
        bounds = capture_bounds(
            c2w, intrinsics, np.array(sizes), read_points(capture), scene_box, near, far, foreground
        )
    except ValueError as error:
        raise SceneError(f"{capture.path}: {error}") from None
    if capture.ngp_box is not None:
        bounds.extent = capture.transform.box(capture.ngp_box)
    return bounds


def _frame_sizes(capture: Capture, frames: list[Frame], num_workers: int) -> list[tuple[int, int]]:
    """Each frame's (h, w) from its image file's header, checked against the size the transforms give."""
    with ThreadPoolExecutor(num_workers) as pool:
        actual = list(pool.map(lambda frame: image_size(frame.image), frames))
    for frame, size in zip(frames, actual):
        if frame.size is not None and frame.size != size:
            raise SceneError(
                f"{capture.path}: frame {frame.name!r}: image {frame.image} is {size[1]}x{size[0]} (w x h) but "
                f"the transforms give w={frame.size[1]}, h={frame.size[0]}"
            )
    return actual


def _padded(arrays: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """(V, H, W, ...) of arrays (h, w, ...) each at the top left of zeros (the padding is never read)."""
    stacked = np.zeros((len(arrays), *shape, *arrays[0].shape[2:]), arrays[0].dtype)
    for out, array in zip(stacked, arrays):
        out[: array.shape[0], : array.shape[1]] = array
    return stacked


def load_nerfstudio_split(
    capture: Capture,
    split: str,
    bounds: Bounds,
    downscale: int = 1,
    background: Sequence[float] = (1.0, 1.0, 1.0),
    num_workers: int | None = None,
    multiple: int = 1,
) -> Scene:
    """Split ``"train"`` or ``capture.eval_split`` as a :class:`Scene` with per-view intrinsics (scaled by
    1/downscale: pixel positions scale, so fx, fy, cx, cy all divide), composited on ``background``. Each reduced
    size is rounded down to a multiple of ``multiple`` (e.g. the model's upsample factor) and of 1 / ``downscale``
    of the original: the last rows and columns are dropped, as ns-process-data's reduced copies do. Frames of
    different sizes (portrait and landscape, two cameras) keep their own (``Scene.sizes``)."""
    if isinstance(downscale, bool) or not isinstance(downscale, int) or downscale < 1:
        raise ValueError(f"load_nerfstudio_split: downscale must be a positive int, got {downscale!r}")
    background = tuple(float(c) for c in ((background,) * 3 if isinstance(background, (int, float)) else background))
    if len(background) != 3 or not all(0.0 <= c <= 1.0 for c in background):
        raise ValueError(f"load_nerfstudio_split: background must be 3 values in [0, 1], got {background!r}")
    if split not in capture.splits:
        raise SceneError(f"{capture.path}: no split {split!r} (splits: {', '.join(capture.splits)})")
    frames = [capture.frames[i] for i in capture.splits[split]]
    workers = _worker_count(num_workers, len(frames))
    sizes = _frame_sizes(capture, frames, workers)
    block = downscale * multiple
    small = [(frame, size) for frame, size in zip(frames, sizes) if min(size) < block]
    if small:
        (height, width) = small[0][1]
        raise SceneError(
            f"{capture.path}: frame {small[0][0].name!r}: image size {width}x{height} is smaller than {block} "
            "(downscale x multiple)"
        )
    kept = [(height - height % block, width - width % block) for height, width in sizes]
    cropped = [(size, crop) for size, crop in zip(sizes, kept) if crop != size]
    if cropped:
        (height, width), (kept_h, kept_w) = cropped[0]
        print(
            f"note: {width}x{height} images lose their last {width - kept_w} column(s) and {height - kept_h} "
            f"row(s) to downscale={downscale} x {multiple}"
        )
    with ThreadPoolExecutor(workers) as pool:
        jobs = [(frame.image, background, downscale, crop) for frame, crop in zip(frames, kept)]
        decoded = list(pool.map(lambda job: load_composited(*job), jobs))
    reduced = [(height // downscale, width // downscale) for height, width in kept]
    shape = (max(h for h, _ in reduced), max(w for _, w in reduced))
    alpha = None
    if any(a is not None for _, a in decoded):  # images without alpha are opaque
        opaque = [np.full(size, 255, np.uint8) if a is None else a for (_, a), size in zip(decoded, reduced)]
        alpha = torch.from_numpy(_padded(opaque, shape))
    intrinsics = torch.tensor([frame.intrinsics for frame in frames], dtype=torch.float64) / downscale
    distortion = torch.tensor([frame.distortion for frame in frames], dtype=torch.float64)
    # no lens for undistorted pinhole cameras: their rays take the pinhole path, bit for bit the blender scenes'
    lens = Lens(distortion, capture.fisheye) if capture.fisheye or bool(distortion.any()) else None
    return Scene(
        images=torch.from_numpy(_padded([rgb for rgb, _ in decoded], shape)),
        c2w=torch.from_numpy(np.stack([frame.c2w for frame in frames]).astype(np.float32)),
        height=shape[0],
        width=shape[1],
        focal=float(intrinsics[0, 0]),
        near=bounds.near,
        far=bounds.far,
        bbox=torch.from_numpy(bounds.box.astype(np.float32)),
        background=background,
        split=split,
        names=[frame.name for frame in frames],
        alpha=alpha,
        intrinsics=intrinsics,
        lens=lens,
        sizes=torch.tensor(reduced) if len(set(reduced)) > 1 else None,
    )


def load_nerfstudio(
    root: str | os.PathLike,
    downscale: int = 1,
    background: Sequence[float] = (1.0, 1.0, 1.0),
    near: float | None = None,
    far: float | None = None,
    scene_box: float | Sequence[float] | None = None,
    eval_interval: int = 8,
    num_workers: int | None = None,
    orient: str = "up",
    multiple: int = 1,
    foreground: bool = False,
    colmap: bool = False,
) -> tuple[Scene, Scene, Bounds]:
    """(train, eval, bounds) of a nerfstudio scene (``colmap``: of a COLMAP folder, :func:`read_colmap_capture`);
    ``near``, ``far``, ``scene_box`` None: derived (data.bounds;
    ``foreground``: the box of a contracted scene's full-resolution middle), all in the frame ``orient`` gives
    (data/orientation.py)."""
    capture = (read_colmap_capture if colmap else read_capture)(root, eval_interval, orient)
    bounds = nerfstudio_bounds(capture, scene_box, near, far, foreground)
    options = dict(bounds=bounds, downscale=downscale, background=background, num_workers=num_workers)
    options["multiple"] = multiple
    train = load_nerfstudio_split(capture, "train", **options)
    return train, load_nerfstudio_split(capture, capture.eval_split, **options), bounds


def read_colmap_capture(root: str | os.PathLike, eval_interval: int = 8, orient: str = "up") -> Capture:
    """A COLMAP folder (``images/`` and ``sparse/0``, data/colmap.py) as the :class:`Capture` of the transforms.json
    that nerfstudio's ``colmap_to_json`` (and ``training.process``) would write of it."""
    root = Path(root).expanduser()
    folder = find_model(root)
    model = read_model(folder)
    images = image_folder(root, folder)
    meta = transforms_from_model(model, images.relative_to(root).as_posix())
    return parse_capture(folder, root, meta, eval_interval, orient, points=turned_points(model.points))


def write_nerfstudio(
    root: str | os.PathLike,
    images: Sequence[np.ndarray],
    c2w: np.ndarray,
    intrinsics: np.ndarray,
    per_frame: bool = True,
    extra: dict | None = None,
) -> Path:
    """Write a capture in nerfstudio layout: ``<root>/images/frame_<i>.png`` and ``<root>/transforms.json``.

    images: V arrays (H, W, 3|4) uint8; c2w: (V, 4, 4); intrinsics: (V, 4) fx, fy, cx, cy. ``per_frame``: the
    intrinsics and size in every frame, else once at the top level (the first view's). ``extra``: more top-level
    keys (split lists, applied_transform, ...). Returns the transforms file.
    """
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    meta: dict = {"camera_model": "OPENCV", "k1": 0.0, "k2": 0.0, "p1": 0.0, "p2": 0.0}
    frames = []
    for index, (image, matrix, (fx, fy, cx, cy)) in enumerate(zip(images, c2w, np.asarray(intrinsics, np.float64))):
        name = f"images/frame_{index:05d}.png"
        write_png(root / name, image)
        camera = {"fl_x": fx, "fl_y": fy, "cx": cx, "cy": cy, "w": image.shape[1], "h": image.shape[0]}
        frame = {"file_path": name, "transform_matrix": np.asarray(matrix, np.float64).tolist()}
        frames.append({**frame, **camera} if per_frame else frame)
        if not per_frame and index == 0:
            meta.update(camera)
    meta.update(extra or {})
    meta["frames"] = frames
    path = root / "transforms.json"
    path.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return path
