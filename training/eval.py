"""Evaluate a finished run on any split of its scene, or of another copy of it, apart from the run's own outputs:

    python -m training.eval RUN_DIR [--split test|val|train|NAME] [--data-root PATH] [--out FILE]
        [--device auto|cpu|cuda] [--chunk RAYS] [--no-renders]

Reads the run's finished model (``RUN_DIR/model.pt``, or ``checkpoints/last.pt`` when that is newer: as
``training.export`` does), loads the split from the run's own data config (``--data-root``: the same scene at another
path, e.g. a copy with more held-out views), renders every view with its own camera and scores it with the code the
end of training uses (training.evaluation: PSNR, SSIM, the mean PSNR of the worst 10% of the views).

Writes (``--out``, default ``RUN_DIR/eval_<split>.json``) the scores, per view and summarised, and the renders
(prediction, ground truth | prediction | error, depth) into a folder named after the file (``RUN_DIR/eval_<split>/``).
Both are written to temporary names and renamed into place when complete, replacing an earlier evaluation of the
same name; the run's ``metrics.json`` and ``renders/`` are never touched. Errors are one line on stderr and exit
code 2.

``--split``: ``train``, ``test`` or ``val`` (or any split a blender-format scene has a ``transforms_<NAME>.json``
for); default: the split the run evaluated on (test, else val). A nerfstudio capture has ``train`` and its
evaluation split (``test`` or ``val``: its split lists, else every ``data.eval_interval``-th frame).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch
from tqdm import tqdm

from data import SceneError
from training.finished_run import RunReadError, checkpoint_path, load_run, load_split
from training.scenes import resolve_device

EXIT_OK = 0
EXIT_USAGE = 2


class EvalError(RunReadError):
    """An evaluation cannot be made; the message is one line naming the option or the file."""


# ---------------------------------------------------------------------------------------------- evaluation
def _replace(temp: Path, final: Path) -> None:
    """Move ``temp`` (a file or folder) to ``final``, replacing what was there (a folder: moved aside first)."""
    if final.is_dir() and not final.is_symlink():
        aside = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.old."))
        os.replace(final, aside / final.name)
        os.replace(temp, final)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(temp, final)


def _write_json(path: Path, content: dict) -> None:
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(content, file, indent=2)
            file.write("\n")
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temp, 0o644)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def evaluate_run(
    run_dir: str | os.PathLike,
    split: str | None = None,
    data_root: str | os.PathLike | None = None,
    out: str | os.PathLike | None = None,
    device: str = "auto",
    chunk: int | None = None,
    renders: bool = True,
    progress: bool = True,
) -> dict:
    """Render and score every view of a split (module doc); returns what was written to the JSON file, plus
    ``path`` (the JSON file) and ``renders`` (the renders' folder, or None)."""
    from training.evaluation import evaluate, summarize  # the end of training's own code
    from training.finished_run import fast_ops

    run_dir = Path(run_dir)
    source = checkpoint_path(run_dir)
    model, state = load_run(run_dir, fast_ops())
    model = model.to(resolve_device(device)).eval()
    config = state["config"]
    foreground = str(config["model"].get("contraction", "none")) != "none"
    scene = load_split(dict(config["data"]), split, data_root, multiple=model.upsample, foreground=foreground)
    scale = model.upsample
    if scene.height % scale or scene.width % scale:
        raise EvalError(
            f"--split {scene.split}: its {scene.width}x{scene.height} images are not divisible by the model's "
            f"upsample factor {scale}"
        )
    scene = scene.to(model.bbox.device)
    out = Path(out) if out is not None else run_dir / f"eval_{scene.split}.json"
    if out.suffix != ".json":
        raise EvalError(f"--out: {out} must be a .json file (the renders go into the folder of the same stem)")
    if out.resolve() == (run_dir / "metrics.json").resolve():
        raise EvalError("--out: metrics.json is the run's own evaluation, which training.eval never replaces")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        folder = out.with_suffix("")
        temp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{folder.name}.", suffix=".tmp")) if renders else None
    except OSError as error:
        raise EvalError(f"--out: cannot write in {out.parent} ({error.strerror or error})") from None
    run = SimpleNamespace(  # what training.evaluation.evaluate reads of a trainer
        model=model,
        eval_scene=scene,
        train_cfg=SimpleNamespace(render_chunk=chunk or int(config["train"].get("render_chunk", 65536) or 65536)),
        paths=SimpleNamespace(renders=temp),
        pending_writes=[],
    )
    start = time.perf_counter()
    try:
        per_view = []
        with ThreadPoolExecutor(max_workers=4) as writer:
            views = tqdm(range(scene.num_views), desc=f"eval {scene.split}", unit="view", disable=not progress)
            for view in views:  # one view a call: a progress bar, the same renders and scores
                per_view += evaluate(run, [view], write_images=renders, writer=writer if renders else None)["per_view"]
        for path, future in run.pending_writes:
            error = future.exception()
            if error is not None:
                raise EvalError(f"cannot write the render {getattr(error, 'path', path)}: {error}")
        result = {
            **summarize(per_view),
            "per_view": per_view,
            "split": scene.split,
            "views": scene.num_views,
            "resolution": [scene.height, scene.width],
            "run_dir": str(run_dir),
            "model": str(source),
            "step": int(state.get("step", 0)),
            "data": config["data"].get("name"),
            "data_root": str(data_root) if data_root is not None else None,
            "renders": folder.name if renders else None,
            "device": str(model.bbox.device),
            "seconds": time.perf_counter() - start,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        if renders:
            _replace(temp, folder)
            temp = None
        _write_json(out, result)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return {**result, "path": out, "renders": folder if renders else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="voxel-field-eval",
        description="Evaluate a finished run (PSNR, SSIM, worst 10%% of views) on any split of its scene.",
    )
    parser.add_argument("run_dir", help="the run folder (holds model.pt)")
    parser.add_argument("--split", default=None, help="train | test | val | NAME (default: the run's eval split)")
    parser.add_argument("--data-root", default=None, help="the scene at another path (default: the run's data.root)")
    parser.add_argument("--out", default=None, help="the JSON file (default RUN_DIR/eval_<split>.json)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--chunk", type=int, default=None, help="rays per chunk (default: the run's)")
    parser.add_argument("--no-renders", action="store_true", help="scores only: no render files")
    args = parser.parse_args(argv)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise EvalError("--device: cuda requested but CUDA is not available")
        if args.chunk is not None and args.chunk < 1:
            raise EvalError(f"--chunk: must be >= 1 rays, got {args.chunk}")
        result = evaluate_run(
            args.run_dir, args.split, args.data_root, args.out, args.device, args.chunk, not args.no_renders
        )
    except (RunReadError, SceneError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return EXIT_USAGE
    where = f" and {result['renders']}/" if result["renders"] is not None else ""
    print(
        f"eval on {result['views']} {result['split']} views: PSNR {result['psnr']:.2f} dB (worst 10% of views "
        f"{result['psnr_worst10']:.2f} dB), SSIM {result['ssim']:.4f}; wrote {result['path']}{where}"
    )
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["EvalError", "evaluate_run", "main"]
