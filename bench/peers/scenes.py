"""Our scenes and splits for the peers, through the project's own config and loaders (training.scenes).

The data config is composed from configs/ with Hydra exactly as ``train.py +experiment=blender data.root=ROOT``
composes it (captures: ``... data=nerfstudio``), plus any ``data.*`` overrides, and handed to
:func:`training.scenes.load_scenes`: the same images, splits (a capture's every ``data.eval_interval``-th frame
sorted by file name is held out), background compositing and intrinsics as our runs.

A capture with OpenCV distortion is loaded from a shadow folder (the transforms file with its distortion set to
zero, every other entry a symbolic link to the scene's own), so the loader reads the photos as they are; both
splits are then undistorted to pinhole with the real coefficients (bench.peers.undistort). A peer with a pinhole
rasteriser (3DGS) trains and is evaluated on those undistorted frames.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from bench.peers.undistort import COEFFICIENTS, undistort_image
from data import Scene
from training.config import register_configs
from training.scenes import load_scenes

REPO = Path(__file__).resolve().parents[2]
FISHEYE_MODELS = ("OPENCV_FISHEYE", "FISHEYE", "EQUIRECTANGULAR")


@dataclass
class PeerScene:
    """One scene as the peers see it: train and eval splits (CPU, uint8 images), what kind it is, its data
    config (as a plain dict) and the distortion its frames were undistorted from (per frame name; None: none)."""

    name: str
    kind: str  # "blender" or "nerfstudio"
    train: Scene
    eval: Scene
    data: dict
    distortion: dict[str, dict[str, float]] | None


def scene_kind(root: str | Path) -> str:
    """``"blender"`` (transforms_<split>.json) or ``"nerfstudio"`` (transforms.json, or the JSON file itself)."""
    root = Path(root).expanduser()
    if not root.exists():
        raise ValueError(f"--data-root: {root} does not exist")
    if root.is_file() or (root / "transforms.json").is_file():
        return "nerfstudio"
    if any(root.glob("transforms_*.json")):
        return "blender"
    raise ValueError(f"--data-root: {root} holds neither transforms_<split>.json (blender) nor transforms.json")


def data_overrides(root: str | Path, kind: str, extra: Sequence[str] = ()) -> list[str]:
    """The Hydra overrides of our run on this scene (``extra``: more ``data.*`` overrides, e.g. data.downscale=2)."""
    for override in extra:
        if not override.startswith("data."):
            raise ValueError(f"--data-override: {override!r} must set a data.* key (e.g. data.downscale=2)")
    base = ["+experiment=blender"] + (["data=nerfstudio"] if kind == "nerfstudio" else [])
    return base + [f"data.root='{Path(root).expanduser()}'", *extra]  # quoted: paths with spaces or '='


def data_config(overrides: Sequence[str]):
    """The ``data`` node of configs/config.yaml composed with ``overrides`` (as train.py composes it)."""
    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return compose(config_name="config", overrides=list(overrides)).data


def _transforms(root: Path) -> Path:
    return root if root.is_file() else root / "transforms.json"


def read_distortion(root: str | Path) -> dict[str, dict[str, float]] | None:
    """Per frame file_path, its nonzero-somewhere OpenCV coefficients (a top-level key wins over a frame's own, as
    in the loader); None when every coefficient is zero. Fisheye models are refused."""
    path = _transforms(Path(root).expanduser())
    meta = json.loads(path.read_text(encoding="utf-8"))
    model = meta.get("camera_model", "OPENCV")
    if model in FISHEYE_MODELS or meta.get("is_fisheye") is True:
        raise ValueError(f"{path}: camera_model {model} (fisheye) cannot be undistorted by bench.peers (OpenCV only)")
    coefficients = {}
    for frame in meta.get("frames", []):
        values = {key: float(meta.get(key, frame.get(key, 0.0)) or 0.0) for key in COEFFICIENTS}
        coefficients[frame.get("file_path")] = values
    if not any(value != 0.0 for values in coefficients.values() for value in values.values()):
        return None
    return coefficients


def shadow_folder(root: str | Path) -> Path:
    """A temporary folder that reads as the capture ``root`` with zero distortion (links to its files; the caller
    removes it). Returns the shadow transforms file."""
    path = _transforms(Path(root).expanduser().resolve())
    meta = json.loads(path.read_text(encoding="utf-8"))
    for holder in [meta, *meta.get("frames", [])]:
        for key in COEFFICIENTS:
            if key in holder:
                holder[key] = 0.0
    shadow = Path(tempfile.mkdtemp(prefix="peers-scene-"))
    for entry in path.parent.iterdir():
        if entry.name != path.name:
            (shadow / entry.name).symlink_to(entry)
    (shadow / path.name).write_text(json.dumps(meta), encoding="utf-8")
    return shadow / path.name


def undistort_scene(scene: Scene, distortion: dict[str, dict[str, float]]) -> Scene:
    """The split with every view undistorted to pinhole (same size and intrinsics)."""
    images, alphas = [], []
    for view, name in enumerate(scene.names):
        intrinsics = scene.intrinsics[view]
        images.append(undistort_image(scene.images[view], intrinsics, distortion[name]))
        if scene.alpha is not None:
            alphas.append(undistort_image(scene.alpha[view][..., None], intrinsics, distortion[name])[..., 0])
    alpha = torch.stack(alphas) if alphas else None
    return dataclasses.replace(scene, images=torch.stack(images), alpha=alpha)


def load_peer_scene(root: str | Path, extra_overrides: Sequence[str] = (), name: str | None = None) -> PeerScene:
    """Our train and eval splits of the scene at ``root`` (on the CPU), undistorted when the capture is distorted."""
    root = Path(root).expanduser()
    kind = scene_kind(root)
    overrides = data_overrides(root, kind, extra_overrides)
    distortion = read_distortion(root) if kind == "nerfstudio" else None
    shadow = None
    if distortion is not None:
        shadow = shadow_folder(root)
        overrides = data_overrides(shadow, kind, extra_overrides)
    try:
        cfg = data_config(overrides)
        train, evaluation = load_scenes(cfg, "cpu")
    finally:
        if shadow is not None:
            shutil.rmtree(shadow.parent)
    data = OmegaConf.to_container(cfg, resolve=True)
    data["root"] = str(root)
    if distortion is not None:
        train, evaluation = undistort_scene(train, distortion), undistort_scene(evaluation, distortion)
    return PeerScene(name or root.name, kind, train, evaluation, data, distortion)
