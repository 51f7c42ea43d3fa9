"""A finished run, read back: its model (``model.pt``, or ``checkpoints/last.pt`` when newer) rebuilt from its own
config, and its scene's splits in the frame the run trained in, for the tools after training (training.eval,
training.export, training.render_path, training.view). Every problem is a :class:`RunReadError` (or the loaders'
SceneError) whose message is one line naming the file or the option."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from data import SceneError, eval_split, load_blender
from data.blender import list_splits
from data.nerfstudio import Capture, load_nerfstudio_split, nerfstudio_bounds, read_capture, read_colmap_capture
from data.orientation import Similarity
from data.scene import Scene
from models.model import VoxelNeRF
from models.ops import OP_NAMES, OpSet, build_ops
from training.checkpoint import CheckpointError, load_checkpoint
from training.compact_model import MODEL_NAME, read_model
from training.run_dir import model_source
from training.scenes import scene_root

CAPTURES = ("nerfstudio", "colmap")  # the data sources whose box and near/far are derived from the capture
GRID_KEYS = ("density.grid", "features.grid")  # the grids' parameters (training.export --half stores them as fp16)


class RunReadError(RuntimeError):
    """A finished run, or its scene, cannot be read; the message is one line naming the file or the option."""


def reference_ops() -> OpSet:
    """Every op through cuda_ext.reference (pure PyTorch): exporting needs no compiled extension."""
    return build_ops({name: "torch" for name in OP_NAMES})


def checkpoint_path(run_dir: str | os.PathLike) -> Path:
    """The file of a run folder's newest model: ``RUN_DIR/model.pt`` or ``RUN_DIR/checkpoints/last.pt``
    (training.run_dir.model_source), or RunReadError when the folder or both files are missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunReadError(f"{run_dir}: no such run folder")
    path = model_source(run_dir)
    if path is None:
        raise RunReadError(
            f"{run_dir / 'checkpoints' / 'last.pt'}: checkpoint not found, nor {run_dir / MODEL_NAME} (train the run "
            "first, or check the folder)"
        )
    return path


def scene_of(data_cfg: dict, foreground: bool = False) -> dict:
    """near, far and the scene box ((2, 3) nested list) from a run's data config (both loaders' keys). A nerfstudio
    capture's derived ones (null in the config) are derived again from its transforms file (data.nerfstudio); the
    box only starts the model, whose state dict brings its own."""
    if data_cfg.get("near") is None or data_cfg.get("far") is None or not isinstance(data_cfg.get("scene_box"), float):
        if data_cfg.get("name") in CAPTURES:
            return _capture_scene(data_cfg, foreground)
    half = float(data_cfg.get("scene_box", 1.5))
    return {"near": float(data_cfg["near"]), "far": float(data_cfg["far"]), "bbox": [[-half] * 3, [half] * 3]}


def _capture_scene(data_cfg: dict, foreground: bool) -> dict:
    box = data_cfg.get("scene_box")
    box = list(box) if isinstance(box, (list, tuple)) or hasattr(box, "__iter__") else box
    try:
        capture = _capture(OmegaConf.create({"orient": "none", "eval_interval": 8, **data_cfg}))
        bounds = nerfstudio_bounds(capture, box, data_cfg.get("near"), data_cfg.get("far"), foreground)
    except (SceneError, OSError, ValueError, KeyError) as error:
        raise RunReadError(
            f"cannot derive the run's near/far from its capture {data_cfg.get('root')} ({' '.join(str(error).split())})"
        ) from None
    return {"near": float(bounds.near), "far": float(bounds.far), "bbox": np.asarray(bounds.box, float).tolist()}


def build_model(model_cfg: dict, scene: dict, state_dict: dict, ops: OpSet | None = None) -> VoxelNeRF:
    """A :class:`VoxelNeRF` built from its config and scene, with ``state_dict`` loaded (grids as float32), in eval
    mode on the CPU. The grids take the state dict's shape and box (grown, shrunk or tight)."""
    bbox = torch.tensor(scene["bbox"], dtype=torch.float32)
    model = VoxelNeRF(bbox, scene["near"], scene["far"], dict(model_cfg), ops or reference_ops())
    state_dict = {k: v.float() if k in GRID_KEYS else v for k, v in state_dict.items()}
    model.load_state_dict(state_dict)
    return model.eval()


def load_run(run_dir: str | os.PathLike, ops: OpSet | None = None) -> tuple[VoxelNeRF, dict]:
    """(model, state) of a run folder's newest model file (:func:`checkpoint_path`): the state holds ``config``,
    ``step`` and ``history`` (and, from a checkpoint, the optimiser and RNG states)."""
    path = checkpoint_path(run_dir)
    try:
        if path.name == MODEL_NAME:
            weights, run = read_model(path)
            state = {**run, "model": weights}
        else:
            state = load_checkpoint(path, map_location="cpu")
    except CheckpointError as error:
        raise RunReadError(str(error)) from None
    config = state.get("config") or {}
    if "model" not in state or "model" not in config or "data" not in config:
        raise RunReadError(f"{path}: not a training checkpoint of this project (no model weights or config)")
    try:
        foreground = str(config["model"].get("contraction", "none")) != "none"
        model = build_model(config["model"], scene_of(config["data"], foreground), state["model"], ops)
    except (RuntimeError, KeyError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RunReadError(f"{path}: cannot rebuild the model ({first})") from None
    return model, state


def fast_ops():
    """Our compiled ops when the extension loads, else the PyTorch references (same results, slower)."""
    try:
        import cuda_ext  # noqa: F401  (the compiled extension: an ImportError when it was never built)

        return build_ops({name: "custom" for name in OP_NAMES})
    except (ImportError, OSError, ValueError):
        return reference_ops()


# ---------------------------------------------------------------------------------------------- the run's scene
def _data_config(data_cfg: dict, data_root: str | os.PathLike | None) -> dict:
    data_cfg = dict(data_cfg)
    if data_cfg.get("name") in CAPTURES:
        data_cfg.setdefault("orient", "none")  # a run from before data.orient used the poses as given
        data_cfg.setdefault("eval_interval", 8)
    if data_root is not None:
        root = Path(data_root).expanduser()
        if not root.exists():
            raise RunReadError(f"--data-root: {root} does not exist")
        if data_cfg.get("name") == "synthetic":  # the generated scene is a blender-format folder
            data_cfg["name"] = "blender"
        data_cfg["root"] = str(root)
    return data_cfg


def _box(value):
    return OmegaConf.to_container(value) if OmegaConf.is_list(value) else value


def _capture(cfg) -> Capture:
    """The capture (a transforms file, or a COLMAP folder) of a capture run's data config."""
    read = read_colmap_capture if cfg.name == "colmap" else read_capture
    return read(Path(cfg.root).expanduser(), int(cfg.eval_interval), str(cfg.get("orient", "up")))


def load_split(
    data_cfg: dict,
    split: str | None = None,
    data_root: str | os.PathLike | None = None,
    multiple: int = 1,
    foreground: bool = False,
) -> Scene:
    """One split of a run's scene (``data_cfg``: the run's data config; ``split`` None: the split the run
    evaluated on; ``data_root``: the same scene elsewhere), on the CPU, in the frame the run trained in. SceneError
    (names the file) or RunReadError (names the option) when it cannot be read."""
    cfg = OmegaConf.create(_data_config(data_cfg, data_root))
    try:
        if cfg.name in CAPTURES:
            capture = _capture(cfg)
            split = split or capture.eval_split
            if split not in capture.splits:
                raise RunReadError(
                    f"--split: the capture {capture.path} has no split {split!r} (it has {', '.join(capture.splits)})"
                )
            bounds = nerfstudio_bounds(capture, _box(cfg.scene_box), cfg.near, cfg.far, foreground)
            return load_nerfstudio_split(
                capture, split, bounds, cfg.downscale, tuple(cfg.background), multiple=multiple
            )
        root = scene_root(cfg)
        split = split or eval_split(root)
        if split not in list_splits(root):
            splits = ", ".join(list_splits(root))
            raise RunReadError(f"--split: the scene {root} has no split {split!r} (it has {splits})")
        return load_blender(
            root,
            split,
            downscale=cfg.downscale,
            background=tuple(cfg.background),
            near=cfg.near,
            far=cfg.far,
            scene_box=cfg.scene_box,
        )
    except (SceneError, RunReadError):
        raise
    except (OSError, ValueError, KeyError) as error:
        raise SceneError(f"cannot load the run's scene ({type(error).__name__}: {error})") from None


def scene_transform(data_cfg: dict, data_root: str | os.PathLike | None = None) -> Similarity:
    """The similarity that took the scene's own world (its transforms file's) to the run's (``data.orient``):
    identity except for an oriented nerfstudio capture, whose transforms file is read again (the orientation is
    computed from its cameras, so it is the run's as long as the file is the one the run trained on)."""
    cfg = OmegaConf.create(_data_config(data_cfg, data_root))
    if cfg.name not in CAPTURES or cfg.get("orient", "up") == "none":
        return Similarity.identity()
    return _capture(cfg).transform


def run_transform(state: dict, purpose: str) -> Similarity:
    """:func:`scene_transform` of a loaded run's ``state``, or RunReadError starting with ``purpose`` (what needed it
    and what to do instead) when its capture cannot be read."""
    try:
        return scene_transform(dict(state["config"]["data"]))
    except (SceneError, OSError, ValueError) as error:
        raise RunReadError(f"{purpose} ({' '.join(str(error).split())})") from None


def inverse_points(transform: Similarity, points: np.ndarray) -> np.ndarray:
    """(..., 3) points of the run's frame -> the scene's own frame (the inverse of ``transform.points``)."""
    return (np.asarray(points, np.float64) / transform.scale - transform.translation) @ transform.rotation


def inverse_poses(transform: Similarity, c2w: np.ndarray) -> np.ndarray:
    """(V, 4, 4) cameras of the run's frame -> the scene's own frame (the inverse of ``transform.poses``)."""
    out = np.array(c2w, dtype=np.float64, copy=True)
    out[:, :3, :3] = transform.rotation.T @ out[:, :3, :3]
    out[:, :3, 3] = inverse_points(transform, out[:, :3, 3])
    return out
