"""COLMAP's sparse models (``cameras``, ``images``, ``points3D``, binary ``.bin`` or text ``.txt``), read without
COLMAP, and turned into the nerfstudio transforms dict that data/nerfstudio.py parses, so a COLMAP folder trains with
the same splits, orientation and scaling as the transforms.json that ``training.process`` writes from it.

Layout (as COLMAP, hloc and GLOMAP write it, or nerfstudio's ``ns-process-data``): ``<root>/images/`` and
``<root>/sparse/0/`` (also ``<root>/sparse/`` itself, or ``<root>/colmap/sparse/0``). The formats are COLMAP's
documented ones (colmap.github.io/format.html); the reader is checked against pycolmap's own in tests/test_colmap.py.

Poses: COLMAP stores world-to-camera (a unit quaternion qw qx qy qz and a translation) with the camera looking down +z,
y down. As nerfstudio's ``colmap_to_json`` does, each becomes camera-to-world in the OpenGL convention (y and z
flipped), and the world is turned by ``APPLIED_TRANSFORM`` (rows x, z, -y: COLMAP's -y up becomes +z), written to
transforms.json as ``applied_transform``; the sparse points are turned the same way (sparse_pc.ply, as ns-process-data
writes it).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data.errors import SceneError

# COLMAP's camera models: id -> (name, number of parameters)
CAMERA_MODELS = {
    0: ("SIMPLE_PINHOLE", 3),
    1: ("PINHOLE", 4),
    2: ("SIMPLE_RADIAL", 4),
    3: ("RADIAL", 5),
    4: ("OPENCV", 8),
    5: ("OPENCV_FISHEYE", 8),
    6: ("FULL_OPENCV", 12),
    7: ("FOV", 5),
    8: ("SIMPLE_RADIAL_FISHEYE", 4),
    9: ("RADIAL_FISHEYE", 5),
    10: ("THIN_PRISM_FISHEYE", 12),
    11: ("RAD_TAN_THIN_PRISM_FISHEYE", 16),
}
MODEL_IDS = {name: model_id for model_id, (name, _) in CAMERA_MODELS.items()}
# the models whose rays data/camera_models.py generates: parameter order -> nerfstudio's keys
NERFSTUDIO_KEYS = {
    "SIMPLE_PINHOLE": ("f", "cx", "cy"),
    "PINHOLE": ("fl_x", "fl_y", "cx", "cy"),
    "SIMPLE_RADIAL": ("f", "cx", "cy", "k1"),
    "RADIAL": ("f", "cx", "cy", "k1", "k2"),
    "OPENCV": ("fl_x", "fl_y", "cx", "cy", "k1", "k2", "p1", "p2"),
    "OPENCV_FISHEYE": ("fl_x", "fl_y", "cx", "cy", "k1", "k2", "k3", "k4"),
}
# nerfstudio's world turn for COLMAP poses and points (its colmap_to_json): rows (x, z, -y) of COLMAP's world
APPLIED_TRANSFORM = np.array([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, -1.0, 0.0, 0.0]])
MODEL_FOLDERS = ("sparse/0", "sparse", "colmap/sparse/0")


@dataclass
class Camera:
    """One COLMAP camera: model name, (width, height) in pixels and its parameters (COLMAP's order)."""

    model: str
    width: int
    height: int
    params: np.ndarray


@dataclass
class Image:
    """One registered image: world-to-camera rotation as a quaternion (w, x, y, z), translation, camera, file name."""

    qvec: np.ndarray
    tvec: np.ndarray
    camera_id: int
    name: str


@dataclass
class SparseModel:
    """A COLMAP reconstruction: cameras and images by id, points (N, 3) float64 and their colours (N, 3) uint8."""

    cameras: dict[int, Camera]
    images: dict[int, Image]
    points: np.ndarray
    colors: np.ndarray
    folder: Path


class _Reader:
    """Little-endian values from a bytes buffer, with a clear error when the file ends early."""

    def __init__(self, path: Path):
        self.path, self.data, self.at = path, path.read_bytes(), 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.at + size > len(self.data):
            raise SceneError(f"{self.path}: the file ends early (truncated or not a COLMAP model)")
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += size
        return values

    def skip(self, size: int) -> None:
        if self.at + size > len(self.data):
            raise SceneError(f"{self.path}: the file ends early (truncated or not a COLMAP model)")
        self.at += size

    def string(self) -> str:
        end = self.data.find(b"\0", self.at)
        if end < 0:
            raise SceneError(f"{self.path}: an image name is not terminated (truncated or not a COLMAP model)")
        text = self.data[self.at : end].decode("utf-8", errors="replace")
        self.at = end + 1
        return text


def _camera(path: Path, camera_id: int, model: str, width: int, height: int, params) -> Camera:
    if model not in MODEL_IDS:
        raise SceneError(f"{path}: camera {camera_id}: unknown camera model {model!r}")
    expected = CAMERA_MODELS[MODEL_IDS[model]][1]
    params = np.asarray(params, np.float64)
    if len(params) != expected:
        raise SceneError(f"{path}: camera {camera_id} ({model}) has {len(params)} parameters, expected {expected}")
    if width < 1 or height < 1 or not np.isfinite(params).all():
        raise SceneError(f"{path}: camera {camera_id}: bad size {width}x{height} or non-finite parameters")
    return Camera(model, int(width), int(height), params)


def _read_cameras_bin(path: Path) -> dict[int, Camera]:
    reader, cameras = _Reader(path), {}
    (count,) = reader.take("Q")
    for _ in range(count):
        camera_id, model_id, width, height = reader.take("iiQQ")
        if model_id not in CAMERA_MODELS:
            raise SceneError(f"{path}: camera {camera_id}: unknown camera model id {model_id}")
        name, size = CAMERA_MODELS[model_id]
        cameras[camera_id] = _camera(path, camera_id, name, width, height, reader.take(f"{size}d"))
    return cameras


def _read_images_bin(path: Path) -> dict[int, Image]:
    reader, images = _Reader(path), {}
    (count,) = reader.take("Q")
    for _ in range(count):
        image_id, *pose, camera_id = reader.take("i7di")
        name = reader.string()
        (observations,) = reader.take("Q")
        reader.skip(24 * observations)  # x, y (double) and point3D id (int64) per keypoint: not needed here
        images[image_id] = Image(np.array(pose[:4]), np.array(pose[4:]), camera_id, name)
    return images


def _read_points_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    reader = _Reader(path)
    (count,) = reader.take("Q")
    points, colors = np.empty((count, 3)), np.empty((count, 3), np.uint8)
    for index in range(count):
        _, x, y, z, r, g, b, _, track = reader.take("Q3d3BdQ")
        points[index], colors[index] = (x, y, z), (r, g, b)
        reader.skip(8 * track)  # (image id, point2D index) int32 pairs
    return points, colors


def _lines(path: Path) -> list[list[str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SceneError(f"{path}: not UTF-8 text (a COLMAP text model was expected)") from None
    return [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _numbers(path: Path, fields: list[str], kind=float) -> list:
    try:
        return [kind(value) for value in fields]
    except ValueError:
        raise SceneError(f"{path}: malformed line {' '.join(fields)!r}") from None


def _read_cameras_txt(path: Path) -> dict[int, Camera]:
    cameras = {}
    for fields in _lines(path):
        if len(fields) < 4:
            raise SceneError(f"{path}: malformed camera line {' '.join(fields)!r}")
        camera_id, width, height = _numbers(path, [fields[0], fields[2], fields[3]], int)
        cameras[camera_id] = _camera(path, camera_id, fields[1], width, height, _numbers(path, fields[4:]))
    return cameras


def _read_images_txt(path: Path) -> dict[int, Image]:
    # two lines an image: the pose line, then its keypoints (possibly empty, so blank lines count here)
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.lstrip().startswith("#")]
    images = {}
    for index in range(0, len(lines), 2):
        fields = lines[index].split(maxsplit=9)
        if not fields:
            continue
        if len(fields) != 10:
            raise SceneError(f"{path}: malformed image line {lines[index]!r}")
        pose = _numbers(path, fields[1:8])
        image_id, camera_id = _numbers(path, [fields[0], fields[8]], int)
        images[image_id] = Image(np.array(pose[:4]), np.array(pose[4:]), camera_id, fields[9].strip())
    return images


def _read_points_txt(path: Path) -> tuple[np.ndarray, np.ndarray]:
    rows = [_numbers(path, fields[1:7]) for fields in _lines(path)]
    table = np.array(rows, np.float64).reshape(-1, 6)
    return table[:, :3], table[:, 3:].astype(np.uint8)


def find_model(root: str | os.PathLike) -> Path:
    """The folder holding ``root``'s sparse model: ``root`` itself or one of ``MODEL_FOLDERS`` under it."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise SceneError(f"COLMAP folder {root} does not exist or is not a folder")
    for folder in (root, *(root / sub for sub in MODEL_FOLDERS)):
        if any((folder / f"cameras{ext}").is_file() for ext in (".bin", ".txt")):
            return folder
    raise SceneError(
        f"{root}: no COLMAP model (cameras.bin or cameras.txt) in {root} or {', '.join(MODEL_FOLDERS)} under it"
    )


def read_model(folder: str | os.PathLike) -> SparseModel:
    """Read the sparse model in ``folder`` (binary when cameras.bin is there, else text); points are optional."""
    folder = Path(folder)
    ext = ".bin" if (folder / "cameras.bin").is_file() else ".txt"
    readers = {".bin": (_read_cameras_bin, _read_images_bin), ".txt": (_read_cameras_txt, _read_images_txt)}[ext]
    for name in ("cameras", "images"):
        if not (folder / f"{name}{ext}").is_file():
            raise SceneError(f"{folder}: {name}{ext} not found (a COLMAP model has cameras, images and points3D)")
    cameras, images = readers[0](folder / f"cameras{ext}"), readers[1](folder / f"images{ext}")
    for image_id, image in images.items():
        if image.camera_id not in cameras:
            raise SceneError(f"{folder}: image {image_id} ({image.name}) uses camera {image.camera_id}, not in cameras")
        norm = np.linalg.norm(image.qvec)
        if not np.isfinite(image.tvec).all() or not abs(norm - 1.0) < 1e-3:
            raise SceneError(f"{folder}: image {image_id} ({image.name}) has a non-unit quaternion or bad translation")
    points_file = folder / f"points3D{ext}"
    points, colors = np.zeros((0, 3)), np.zeros((0, 3), np.uint8)
    if points_file.is_file():
        points, colors = (_read_points_bin if ext == ".bin" else _read_points_txt)(points_file)
    return SparseModel(cameras, images, points, colors, folder)


def rotation_matrix(qvec: np.ndarray) -> np.ndarray:
    """(3, 3) rotation of a unit quaternion (w, x, y, z)."""
    w, x, y, z = np.asarray(qvec, np.float64) / np.linalg.norm(qvec)
    return np.array(
        [
            [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
            [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
            [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
        ]
    )


def turned_points(points: np.ndarray) -> np.ndarray:
    """(N, 3) points of COLMAP's world in the poses' (nerfstudio's turned) world, as sparse_pc.ply holds them."""
    return points @ APPLIED_TRANSFORM[:, :3].T + APPLIED_TRANSFORM[:, 3]


def camera_to_world(image: Image) -> np.ndarray:
    """(4, 4) camera-to-world in the OpenGL convention, in nerfstudio's turned world (``APPLIED_TRANSFORM``)."""
    w2c = np.eye(4)
    w2c[:3, :3], w2c[:3, 3] = rotation_matrix(image.qvec), image.tvec
    c2w = np.linalg.inv(w2c)
    c2w[:3, 1:3] *= -1  # OpenCV (y down, looking down +z) -> OpenGL (y up, looking down -z)
    turned = np.eye(4)
    turned[:3] = APPLIED_TRANSFORM @ c2w
    return turned


def camera_keys(camera: Camera) -> dict:
    """nerfstudio's per-camera keys (fl_x fl_y cx cy w h and distortion) of a COLMAP camera."""
    if camera.model not in NERFSTUDIO_KEYS:
        raise SceneError(
            f"COLMAP camera model {camera.model} is not supported (supported: {', '.join(NERFSTUDIO_KEYS)}); "
            "undistort the images first (colmap image_undistorter) or re-run with one of those models"
        )
    values = dict(zip(NERFSTUDIO_KEYS[camera.model], camera.params.tolist()))
    if "f" in values:
        values["fl_x"] = values["fl_y"] = values.pop("f")
    keys = {"fl_x": values["fl_x"], "fl_y": values["fl_y"], "cx": values["cx"], "cy": values["cy"]}
    keys.update(w=camera.width, h=camera.height)
    keys.update({k: values.get(k, 0.0) for k in ("k1", "k2", "p1", "p2")})
    if camera.model == "OPENCV_FISHEYE":
        keys.update(k3=values["k3"], k4=values["k4"])
        del keys["p1"], keys["p2"]
    return keys


def transforms_from_model(model: SparseModel, image_folder: str = "images") -> dict:
    """nerfstudio's transforms dict of a COLMAP model: the camera's keys at the top level when every image shares
    one camera, else in each frame; frames sorted by name, ``file_path`` under ``image_folder``."""
    models = {"OPENCV_FISHEYE" if camera.model == "OPENCV_FISHEYE" else "OPENCV" for camera in model.cameras.values()}
    used = sorted({image.camera_id for image in model.images.values()})
    if not model.images:
        raise SceneError(f"{model.folder}: the model has no registered images")
    if len(models) > 1:
        raise SceneError(f"{model.folder}: mixes fisheye and perspective cameras; give every image one camera model")
    meta: dict = {"camera_model": models.pop()}
    shared = len(used) == 1
    if shared:
        meta.update(camera_keys(model.cameras[used[0]]))
    frames = []
    for image_id, image in sorted(model.images.items(), key=lambda item: item[1].name):
        frame = {"file_path": f"{image_folder}/{image.name}", "transform_matrix": camera_to_world(image).tolist()}
        if not shared:
            frame.update(camera_keys(model.cameras[image.camera_id]))
        frames.append({**frame, "colmap_im_id": image_id})
    meta["frames"] = frames
    meta["applied_transform"] = APPLIED_TRANSFORM.tolist()
    return meta


def write_points_ply(path: Path, points: np.ndarray, colors: np.ndarray) -> None:
    """A binary little-endian PLY of (N, 3) points (float32 x y z) and (N, 3) uint8 colours (red green blue)."""
    vertex = np.empty(len(points), [("x", "<f4"), ("y", "<f4"), ("z", "<f4"), ("r", "u1"), ("g", "u1"), ("b", "u1")])
    for index, name in enumerate("xyz"):
        vertex[name] = points[:, index]
    for index, name in enumerate("rgb"):
        vertex[name] = colors[:, index]
    header = (
        f"ply\nformat binary_little_endian 1.0\nelement vertex {len(points)}\n"
        + "".join(f"property float {axis}\n" for axis in "xyz")
        + "".join(f"property uchar {channel}\n" for channel in ("red", "green", "blue"))
        + "end_header\n"
    )
    with open(path, "wb") as file:
        file.write(header.encode("ascii"))
        file.write(vertex.tobytes())


def image_folder(root: Path, model_folder: Path) -> Path:
    """The images of a COLMAP folder: ``root/images`` (for ``root/colmap/sparse/0`` too, as nerfstudio lays it)."""
    folder = root / "images"
    if not folder.is_dir():
        raise SceneError(f"{root}: no images/ folder beside the COLMAP model {model_folder}")
    return folder
