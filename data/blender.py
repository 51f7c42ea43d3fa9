"""The NeRF-synthetic ("blender") scene format: reading splits into a :class:`Scene`, and writing them.

Layout: ``<root>/transforms_<split>.json`` holds ``camera_angle_x`` (horizontal field of view, radians) and
``frames``, each with ``file_path`` (relative to root, usually without extension, maybe starting with "./") and
``transform_matrix`` (4x4 camera-to-world, OpenGL convention). Images are RGBA PNGs composited on a background.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from data.errors import SceneError
from data.images import image_size, load_composited, write_png
from data.scene import Scene

STANDARD_SPLITS = ("train", "val", "test")
_SPLIT_FILE = re.compile(r"^transforms_(.+)\.json$")
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def split_file(root: str | os.PathLike, split: str) -> Path:
    return Path(root) / f"transforms_{split}.json"


def _scene_folder(root: str | os.PathLike) -> Path:
    root = Path(root)
    if not root.exists():
        raise SceneError(f"scene folder {root} does not exist")
    if not root.is_dir():
        raise SceneError(f"scene folder {root} is not a folder")
    return root


def list_splits(root: str | os.PathLike) -> list[str]:
    """Splits present in ``root`` (one per transforms_<split>.json): train, val, test first, then by name."""
    names = [m.group(1) for f in _scene_folder(root).iterdir() if f.is_file() and (m := _SPLIT_FILE.match(f.name))]
    order = {name: i for i, name in enumerate(STANDARD_SPLITS)}
    return sorted(names, key=lambda name: (order.get(name, len(order)), name))


def eval_split(root: str | os.PathLike) -> str:
    """The split to evaluate on: "test" where the scene has it, else "val"."""
    splits = list_splits(root)
    for name in ("test", "val"):
        if name in splits:
            return name
    raise SceneError(
        f"scene folder {root} has neither transforms_test.json nor transforms_val.json "
        f"(splits present: {', '.join(splits) or 'none'})"
    )


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            content = json.load(f)
    except json.JSONDecodeError as error:
        raise SceneError(f"{path}: malformed JSON: {error.msg} at line {error.lineno} column {error.colno}") from None
    except UnicodeDecodeError as error:
        raise SceneError(f"{path}: malformed JSON: not UTF-8 text ({error.reason})") from None
    if not isinstance(content, dict):
        raise SceneError(f"{path}: expected a JSON object at the top level, got {type(content).__name__}")
    return content


def _camera_angle(path: Path, content: dict) -> float:
    angle = content.get("camera_angle_x")
    if isinstance(angle, bool) or not isinstance(angle, (int, float)) or not 0.0 < angle < math.pi:
        raise SceneError(f"{path}: camera_angle_x must be a number in (0, pi) radians, got {angle!r}")
    return float(angle)


def _frame_matrix(path: Path, index: int, frame: dict) -> np.ndarray:
    where = f"{path}: frame {index} ({frame.get('file_path')!r})"
    if "transform_matrix" not in frame:
        raise SceneError(f"{where}: missing transform_matrix")
    try:
        matrix = np.asarray(frame["transform_matrix"], dtype=np.float64)
    except (TypeError, ValueError):
        raise SceneError(f"{where}: transform_matrix is not a 4x4 array of numbers") from None
    if matrix.shape != (4, 4):
        raise SceneError(f"{where}: transform_matrix must be 4x4, got shape {matrix.shape}")
    if not np.isfinite(matrix).all():
        raise SceneError(f"{where}: transform_matrix has non-finite entries")
    if not np.allclose(matrix[3], [0.0, 0.0, 0.0, 1.0], atol=1e-4):
        raise SceneError(f"{where}: transform_matrix last row must be [0, 0, 0, 1], got {matrix[3].tolist()}")
    _check_rotation(where, matrix[:3, :3])
    return matrix


def _check_rotation(where: str, rotation: np.ndarray) -> None:
    """A camera's 3x3 block must be a rotation up to one uniform scale: anything else (a zero or collapsed
    block) gives rays with NaN or wrong directions, which only shows up much later as a NaN loss or render."""
    gram = rotation.T @ rotation
    scale = float(np.trace(gram)) / 3.0
    if not scale > 1e-12:
        raise SceneError(f"{where}: transform_matrix has a zero rotation block (degenerate camera)")
    if not np.allclose(gram / scale, np.eye(3), atol=1e-3):
        raise SceneError(
            f"{where}: transform_matrix's rotation block is not orthonormal (up to scale): columns must "
            "be perpendicular unit vectors (degenerate or sheared camera)"
        )


def _frame_image(root: Path, path: Path, index: int, frame: dict) -> Path:
    """The image file of a frame: file_path as given if it is a file, else with ".png" appended."""
    file_path = frame.get("file_path")
    if not isinstance(file_path, str) or not file_path:
        raise SceneError(f"{path}: frame {index}: file_path must be a non-empty string, got {file_path!r}")
    image = root / file_path
    if image.is_file():
        return image
    with_png = image.with_name(image.name + ".png")
    if with_png.is_file():
        return with_png
    raise SceneError(f"{path}: frame {index}: image {with_png if not image.suffix else image} not found")


def _worker_count(num_workers: int | None, jobs: int) -> int:
    if num_workers is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        num_workers = min(cores, 16)
    return max(1, min(num_workers, jobs))


def _check_options(downscale, background, near, far, scene_box) -> tuple[float, float, float]:
    if isinstance(downscale, bool) or not isinstance(downscale, int) or downscale < 1:
        raise ValueError(f"load_blender: downscale must be a positive int, got {downscale!r}")
    if isinstance(background, (int, float)):
        background = (background,) * 3
    background = tuple(float(c) for c in background)
    if len(background) != 3 or not all(0.0 <= c <= 1.0 for c in background):
        raise ValueError(f"load_blender: background must be 3 values in [0, 1], got {background!r}")
    if not 0.0 <= near < far:
        raise ValueError(f"load_blender: need 0 <= near < far, got near={near}, far={far}")
    if not scene_box > 0:
        raise ValueError(f"load_blender: scene_box must be positive, got {scene_box}")
    return background


def load_blender(
    root: str | os.PathLike,
    split: str,
    downscale: int = 1,
    background: Sequence[float] = (1.0, 1.0, 1.0),
    near: float = 2.0,
    far: float = 6.0,
    scene_box: float = 1.5,
    num_workers: int | None = None,
) -> Scene:
    """Load one split of a blender-format scene.

    Images are decoded in parallel threads, composited on ``background`` (RGB in [0, 1]; images without alpha are
    opaque), area-averaged by ``downscale`` and kept as (V, H/d, W/d, 3) uint8 on the CPU, with their alpha
    (V, H/d, W/d) uint8 when any image has one (``Scene.alpha``); move the scene with
    ``Scene.to``. The scene box is [-scene_box, scene_box]^3. Every problem with the files raises
    :class:`SceneError` naming the file, before any image is decoded where possible.
    """
    background = _check_options(downscale, background, near, far, scene_box)
    root = _scene_folder(root)
    if not isinstance(split, str) or not _SPLIT_NAME.match(split):
        raise SceneError(
            f"invalid split name {split!r} for scene {root} (splits present: {', '.join(list_splits(root))})"
        )
    path = split_file(root, split)
    if not path.is_file():
        present = ", ".join(list_splits(root)) or "none"
        kind = "split file" if split in STANDARD_SPLITS else f"unknown split {split!r}:"
        raise SceneError(f"{kind} {path} not found (splits present in {root}: {present})")

    content = _read_json(path)
    angle = _camera_angle(path, content)
    frames = content.get("frames")
    if not isinstance(frames, list) or not frames:
        raise SceneError(f"{path}: 'frames' must be a non-empty list")
    for index, frame in enumerate(frames):
        if not isinstance(frame, dict):
            raise SceneError(f"{path}: frame {index} must be an object, got {type(frame).__name__}")
    matrices = np.stack([_frame_matrix(path, i, frame) for i, frame in enumerate(frames)])
    images = [_frame_image(root, path, i, frame) for i, frame in enumerate(frames)]

    with ThreadPoolExecutor(_worker_count(num_workers, len(images))) as pool:
        sizes = list(pool.map(image_size, images))  # headers only: size mismatches fail before decoding
        for image, size in zip(images, sizes):
            if size != sizes[0]:
                raise SceneError(
                    f"{image}: image size {size[0]}x{size[1]} differs from {sizes[0][0]}x{sizes[0][1]} "
                    f"of {images[0]} (all images of a scene must have the same size)"
                )
        decoded = list(pool.map(lambda image: load_composited(image, background, downscale), images))

    height, width = decoded[0][0].shape[:2]
    alphas = [alpha for _, alpha in decoded]
    alpha = None
    if any(a is not None for a in alphas):  # images without alpha are opaque
        alpha = torch.from_numpy(
            np.stack([np.full((height, width), 255, np.uint8) if a is None else a for a in alphas])
        )
    return Scene(
        images=torch.from_numpy(np.stack([rgb for rgb, _ in decoded])),
        c2w=torch.from_numpy(matrices.astype(np.float32)),
        height=height,
        width=width,
        focal=0.5 * width / math.tan(0.5 * angle),
        near=float(near),
        far=float(far),
        bbox=torch.tensor([[-scene_box] * 3, [scene_box] * 3], dtype=torch.float32),
        background=background,
        split=split,
        names=[frame["file_path"] for frame in frames],
        alpha=alpha,
    )


def write_blender_split(
    root: str | os.PathLike,
    split: str,
    images: Sequence[np.ndarray],
    c2w: np.ndarray,
    camera_angle_x: float,
    num_workers: int | None = None,
) -> None:
    """Write one split in blender layout: ``<root>/<split>/r_<i>.png`` and ``<root>/transforms_<split>.json``.

    images: V arrays (H, W, 4) uint8 RGBA (straight, not premultiplied, alpha); c2w: (V, 4, 4) camera-to-world.
    The output bytes depend only on the inputs.
    """
    root = Path(root)
    (root / split).mkdir(parents=True, exist_ok=True)
    names = [f"./{split}/r_{i}" for i in range(len(images))]
    with ThreadPoolExecutor(_worker_count(num_workers, len(images))) as pool:
        list(pool.map(lambda item: write_png(root / f"{item[0]}.png", item[1]), zip(names, images)))
    frames = [
        {"file_path": name, "rotation": 0.0, "transform_matrix": np.asarray(matrix, np.float64).tolist()}
        for name, matrix in zip(names, c2w)
    ]
    content = {"camera_angle_x": float(camera_angle_x), "frames": frames}
    split_file(root, split).write_text(json.dumps(content, indent=4) + "\n", encoding="utf-8")
