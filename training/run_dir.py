"""A run's folder: where its files live, atomic writes, and the rules that protect a finished run
(no silent overwrite; resume and render_only need a checkpoint and take its data and model config)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from training.checkpoint import CheckpointError, load_checkpoint, step_checkpoints
from training.compact_model import MODEL_NAME, read_model
from training.resume import CHECKPOINT_FORMAT


class RunError(RuntimeError):
    """An expected failure whose one-line message is shown to the user as is."""


def write_error(error: BaseException) -> str:
    """A one-line reason for a failed write, saying "disk full" where that is what happened."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    errno_value = getattr(error, "errno", None)
    if errno_value == 28 or "No space left" in text or "unexpected pos" in text:
        return f"the disk is full ({text})"
    if errno_value == 30:
        return f"the file system is read-only ({text})"
    return text


def write_json(path: Path, content: dict) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


@dataclass(frozen=True)
class RunPaths:
    """Where a run keeps its files."""

    root: Path

    @property
    def checkpoint(self) -> Path:
        return self.checkpoints / "last.pt"

    @property
    def model(self) -> Path:
        """The finished model (training.compact_model): the run's deliverable, written when training ends."""
        return self.root / MODEL_NAME

    @property
    def checkpoints(self) -> Path:
        """The folder of last.pt and, with train.keep_checkpoints > 1, the kept step_<step>.pt files."""
        return self.root / "checkpoints"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def renders(self) -> Path:
        return self.root / "renders"

    @property
    def profile(self) -> Path:
        return self.root / "profile.json"


def config_from_checkpoint(cfg: DictConfig, saved: dict) -> DictConfig:
    """The run's config for resume / render_only: the checkpoint's ``data`` and ``model`` (what the weights were
    trained with) and everything else from the command line; a ``data.root`` given on the command line wins
    (the scene may have moved)."""
    current = OmegaConf.to_container(cfg, resolve=True)
    merged = dict(current, data=dict(saved["data"]), model=dict(saved["model"]))
    if current["data"].get("root") and merged["data"].get("name") == current["data"].get("name"):
        merged["data"]["root"] = current["data"]["root"]
    for group in ("data", "model"):
        changed = sorted(
            k for k in set(current[group]) | set(merged[group]) if current[group].get(k) != merged[group].get(k)
        )
        if changed:
            print(
                f"note: using the checkpoint's {group} config (differs from this command at "
                f"{', '.join(f'{group}.{k}' for k in changed)})"
            )
    return OmegaConf.create(merged)


def model_source(root: str | os.PathLike) -> Path | None:
    """Which file holds a run folder's newest model: ``model.pt`` (the finished model) or ``checkpoints/last.pt``
    (the resumable checkpoint), the newer of the two when both exist (a finished run resumed for more steps
    writes last.pt after model.pt); None when neither does."""
    paths = RunPaths(Path(root))
    found = [p for p in (paths.model, paths.checkpoint) if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None  # max keeps model.pt on a tie


def load_run_checkpoint(cfg: DictConfig, paths: RunPaths) -> dict | None:
    if cfg.render_only:
        key = "render_only"
    elif cfg.train.resume:
        key = "train.resume"
    else:
        return None
    if cfg.render_only and model_source(paths.root) == paths.model:
        return model_state(paths.model)
    if not paths.checkpoint.is_file():
        if paths.model.is_file():  # a finished run that kept only its model
            raise RunError(
                f"{key}: the run in {paths.root} finished and kept its model ({paths.model.name}) but not its "
                "resumable checkpoint (train.keep_resumable=true keeps it); render_only=true renders it"
            )
        raise RunError(f"{key}: no checkpoint at {paths.checkpoint} (pass the hydra.run.dir of a run that saved one)")
    state = load_checkpoint(paths.checkpoint, map_location="cpu")
    missing = {"format", "step", "model", "optimizer", "rng", "sampler_generator", "config"} - set(state)
    if missing:
        raise CheckpointError(f"{paths.checkpoint}: not a trainer checkpoint (missing {', '.join(sorted(missing))})")
    return state


def model_state(path: Path) -> dict:
    """A model file (training.compact_model) as the subset of a trainer checkpoint that render_only restores."""
    weights, run = read_model(path)
    return {"format": CHECKPOINT_FORMAT, "model": weights, "history": {"step": [], "loss": [], "psnr": []}} | {
        "eval_history": [],
        "train_seconds": 0.0,
        "rays": 0,
        "pixels": 0,
        "step": 0,
        "seed": run["config"].get("seed"),
        **run,
    }


def refuse_to_overwrite(cfg: DictConfig, paths: RunPaths) -> None:
    """A new run (no resume, no render_only) never replaces a run folder's checkpoint or metrics silently."""
    if cfg.render_only or cfg.train.resume or cfg.train.get("overwrite", False):
        return
    existing = [p for p in (paths.checkpoint, paths.model, paths.metrics) if p.exists()]
    existing += [path for _, path in sorted(step_checkpoints(paths.checkpoints).items())][-1:]  # kept ones too
    if existing:
        names = " and ".join(str(p.relative_to(paths.root)) for p in existing)
        raise RunError(
            f"hydra.run.dir: {paths.root} already holds a run ({names}); pass train.resume=true to continue "
            "it, train.overwrite=true to replace it, or choose another hydra.run.dir"
        )
