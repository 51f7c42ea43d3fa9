"""A transforms.json frame's camera, in every variant nerfstudio and instant-ngp write: intrinsics, image size,
camera model and distortion. Each problem is a :class:`SceneError` naming the file, the frame and the key.

- Focal lengths: ``fl_x`` / ``fl_y`` in pixels, else ``x_fov`` / ``y_fov`` (degrees) or ``camera_angle_x`` /
  ``camera_angle_y`` (radians, the full field of view across w or h); one axis alone gives both (square pixels,
  as instant-ngp reads it).
- ``cx``, ``cy``: the principal point in pixels, default the image centre (w/2, h/2). ``w``, ``h``: whole numbers,
  as ints or floats (``605.0``); when absent the image file's size (read from its header when needed).
- Camera model: ``camera_model`` PINHOLE, SIMPLE_PINHOLE, OPENCV, SIMPLE_RADIAL, RADIAL (radial-tangential; the
  default when absent) or OPENCV_FISHEYE; instant-ngp's ``is_fisheye: true`` means OPENCV_FISHEYE. Coefficients
  ``k1 k2 k3 k4 p1 p2`` (absent: 0) are applied whatever the model's name says, as nerfstudio does (its layout:
  data/camera_models.py). Other models (FULL_OPENCV, FOV, THIN_PRISM_FISHEYE, equirectangular, ...) are refused.
- As in nerfstudio, a top-level key applies to every frame and wins over a frame's own.
"""

from __future__ import annotations

import math
from pathlib import Path

from data.camera_models import COEFFICIENTS, check_invertible
from data.errors import SceneError
from data.images import image_size

RADIAL_MODELS = ("PINHOLE", "SIMPLE_PINHOLE", "OPENCV", "SIMPLE_RADIAL", "RADIAL")
FISHEYE_MODELS = ("OPENCV_FISHEYE",)
FOCAL_KEYS = {"x": ("fl_x", "x_fov", "camera_angle_x"), "y": ("fl_y", "y_fov", "camera_angle_y")}


def number(where, key: str, value, positive: bool = False) -> float:
    """``value`` as a float, or SceneError naming ``where`` and ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SceneError(f"{where}: {key} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise SceneError(f"{where}: {key} must be positive, got {value!r}")
    return float(value)


def pixels(where, key: str, value) -> int:
    """A whole number of pixels (an int or a float such as 605.0)."""
    value = number(where, key, value, positive=True)
    if value != int(value):
        raise SceneError(f"{where}: {key} must be a whole number of pixels, got {value!r}")
    return int(value)


def lookup(meta: dict, frame: dict, key: str):
    """A camera key: the top level's when present (it applies to every frame, as in nerfstudio), else the frame's."""
    return meta[key] if key in meta else frame.get(key)


def _where(path: Path, meta: dict, key: str, frame_where: str):
    return path if key in meta else frame_where


def is_fisheye(path: Path, meta: dict, frames: list[dict]) -> bool:
    """Whether the capture's cameras are OPENCV_FISHEYE (one model for every frame)."""
    model = meta.get("camera_model", "OPENCV")
    if model not in RADIAL_MODELS + FISHEYE_MODELS:
        raise SceneError(
            f"{path}: camera_model {model!r} is not supported (expected one of "
            f"{', '.join(RADIAL_MODELS + FISHEYE_MODELS)})"
        )
    flags = set()
    for index, frame in enumerate(frames):
        flag = lookup(meta, frame, "is_fisheye") if isinstance(frame, dict) else None
        if flag is not None and not isinstance(flag, bool):
            where = _where(path, meta, "is_fisheye", f"{path}: frame {index}")
            raise SceneError(f"{where}: is_fisheye must be true or false, got {flag!r}")
        flags.add(bool(flag) or model in FISHEYE_MODELS)
    if len(flags) > 1:
        raise SceneError(f"{path}: is_fisheye differs between frames: give every frame one camera model")
    fisheye = flags.pop()
    if fisheye and "camera_model" in meta and model not in FISHEYE_MODELS:
        raise SceneError(f"{path}: is_fisheye is true but camera_model is {model} (expected OPENCV_FISHEYE)")
    return fisheye


def _focal(path: Path, meta: dict, frame: dict, where: str, axis: str, side: int | None) -> float | None:
    """The focal length along ``axis`` from the first of its keys present, or None when none is."""
    for key in FOCAL_KEYS[axis]:
        value = lookup(meta, frame, key)
        if value is None:
            continue
        value = number(_where(path, meta, key, where), key, value, positive=True)
        if key == "fl_" + axis:
            return value
        angle = math.radians(value) if key.endswith("_fov") else value
        if not angle < math.pi:
            raise SceneError(f"{_where(path, meta, key, where)}: {key} must be below 180 degrees, got {value!r}")
        return 0.5 * side / math.tan(0.5 * angle)
    return None


def frame_camera(
    path: Path, meta: dict, frame: dict, where: str, image: Path
) -> tuple[tuple[float, float, float, float], tuple[int, int] | None, tuple[float, ...]]:
    """((fx, fy, cx, cy), (h, w) from the JSON or None, the 6 coefficients k1 k2 k3 k4 p1 p2) of one frame."""
    sizes = [lookup(meta, frame, key) for key in ("h", "w")]
    size = None
    if any(s is not None for s in sizes):
        if None in sizes:
            raise SceneError(f"{where}: give both w and h or neither")
        size = tuple(pixels(_where(path, meta, key, where), key, s) for key, s in zip(("h", "w"), sizes))
    needs_size = any(lookup(meta, frame, key) is None for key in ("fl_x", "fl_y", "cx", "cy"))
    height, width = size if size is not None or not needs_size else image_size(image)
    fx, fy = (_focal(path, meta, frame, where, axis, side) for axis, side in (("x", width), ("y", height)))
    if fx is None and fy is None:
        raise SceneError(f"{where}: missing fl_x (or camera_angle_x / x_fov; give it at the top level or per frame)")
    fx, fy = fx or fy, fy or fx
    centre = []
    for key, default in (("cx", 0.5 * width), ("cy", 0.5 * height)):
        value = lookup(meta, frame, key)
        centre.append(default if value is None else number(_where(path, meta, key, where), key, value))
    coefficients = []
    for key in COEFFICIENTS:
        value = lookup(meta, frame, key)
        coefficients.append(0.0 if value is None else number(_where(path, meta, key, where), key, value))
    return (fx, fy, centre[0], centre[1]), size, tuple(coefficients)


def check_lenses(path: Path, frames: list, fisheye: bool) -> None:
    """Check once per distinct camera (intrinsics, size, coefficients) that its distortion can be inverted over
    its image (data.camera_models.check_invertible); SceneError naming the first frame that uses it."""
    seen = set()
    for frame in frames:
        if not fisheye and not any(frame.distortion):
            continue
        size = frame.size or image_size(frame.image)
        camera = (frame.intrinsics, size, frame.distortion)
        if camera in seen:
            continue
        seen.add(camera)
        try:
            check_invertible(frame.distortion, fisheye, frame.intrinsics, size)
        except ValueError as error:
            values = " ".join(f"{k}={v:g}" for k, v in zip(COEFFICIENTS, frame.distortion))
            raise SceneError(f"{path}: frame {frame.name!r}: distortion ({values}): {error}") from None
