"""The per-scene results file: ``<out>/<date>-<scene>.json`` = {scene, date, device, data, methods: {name: entry}}.

Each method runs in its own process (alone on the GPU), so every run merges its entry into the scene's file. A
method's entry holds ``evaluations`` (every eval view, at the listed step counts: psnr, ssim, psnr_worst10,
train_seconds, model_bytes, ...) and ``curve`` (held-out PSNR against training seconds, for the plot).
Our own run's entry is read from its run folder (metrics.json, and the model file's size).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from training.run_dir import write_json

# our run's deliverable (training.compact_model, RunPaths.model), else `python -m training.export weights RUN_DIR`
OUR_MODEL_FILES = ("model.pt", "weights.pt")


def today() -> str:
    return datetime.date.today().isoformat()


def results_path(out: str | Path, scene: str, date: str) -> Path:
    return Path(out) / f"{date}-{scene}.json"


def read_results(path: Path) -> dict:
    """The results file's content ({} when it does not exist yet); a broken file is an error naming it."""
    if not path.exists():
        return {}
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a results file (malformed JSON: {error.msg})") from None
    if not isinstance(content, dict) or not isinstance(content.get("methods", {}), dict):
        raise ValueError(f"{path}: not a results file (expected an object with 'methods')")
    return content


def merge_method(path: Path, header: dict, name: str, entry: dict) -> dict:
    """Put ``entry`` under ``methods[name]`` of the file at ``path`` (created with ``header`` when new; the
    header's keys are refreshed), write it atomically and return the whole content."""
    content = read_results(path)
    content.update(header)
    content.setdefault("methods", {})[name] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, content)
    return content


def our_entry(run_dir: str | Path) -> dict:
    """Our run's entry from its folder: the final evaluation (every eval view unless train.eval_final_views was
    set), the periodic ``eval_history`` as the curve (plus the final point) and the model file's size."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.json"
    if not path.is_file():
        raise ValueError(f"--ours-run: {path} not found (the run folder of a finished train.py run)")
    metrics = json.loads(path.read_text(encoding="utf-8"))
    missing = [key for key in ("psnr", "ssim", "psnr_worst10", "train_seconds", "iters") if key not in metrics]
    if missing:
        raise ValueError(f"--ours-run: {path} lacks {missing}: not a finished run's metrics")
    model = next((run_dir / name for name in OUR_MODEL_FILES if (run_dir / name).is_file()), None)
    model_bytes = metrics.get("model_bytes") or (model.stat().st_size if model else None)
    final = {
        "step": metrics["iters"],
        "train_seconds": metrics["train_seconds"],
        "psnr": metrics["psnr"],
        "ssim": metrics["ssim"],
        "psnr_worst10": metrics["psnr_worst10"],
        "views": metrics.get("eval_views", len(metrics.get("per_view", []))),
        "worst_views": metrics.get("worst_views"),
        "per_view": metrics.get("per_view"),
        "eval_seconds": metrics.get("eval_seconds"),
        "model_bytes": model_bytes,
        "model_file": model.name if model else None,
    }
    history = [dict(entry) for entry in metrics.get("eval_history", [])]
    curve = history + [{key: final[key] for key in ("step", "train_seconds", "psnr", "ssim", "psnr_worst10", "views")}]
    return {
        "method": "ours",
        "implementation": "train.py (voxel-field)",
        "run_dir": str(run_dir),
        "device": metrics.get("device"),
        "steps": metrics["iters"],
        "train_seconds": metrics["train_seconds"],
        "peak_memory_bytes": metrics.get("peak_memory_bytes"),
        "evaluations": [final],
        "curve": curve,
    }


def table_rows(content: dict) -> list[str]:
    """Markdown rows of the README table "Against the peers": date, device, scene, method, PSNR (worst 10%),
    SSIM, training time, model size; one row per method and evaluated step count."""
    rows = []
    for name, entry in content.get("methods", {}).items():
        for evaluation in entry.get("evaluations", []):
            size = evaluation.get("model_bytes")
            rows.append(
                f"| {content.get('date', '?')} | {entry.get('device') or content.get('device', '?')} | "
                f"{content.get('scene', '?')} | {name} ({evaluation['step']} steps) | "
                f"{evaluation['psnr']:.2f} ({evaluation['psnr_worst10']:.2f}) | {evaluation['ssim']:.4f} | "
                f"{evaluation['train_seconds']:.1f} s | {'?' if size is None else f'{size / 2**20:.1f} MiB'} |"
            )
    return rows
