"""What every peer's run shares: the timed training loop with its evaluations, and the model file's size.

A peer's training state (``bench.peers.gsplat_trainer.GsplatTraining``, ``bench.peers.nerfacc_trainer.NerfaccTraining``)
offers ``step(step) -> loss`` (a 0-d device tensor), ``renderer_at(step) -> RenderFn`` (bench.peers.metrics),
``progress() -> dict`` (what the curve records besides the metrics), ``describe(loss) -> str`` (the log line's
method-specific part) and ``model_bytes(keep) -> int``. Training time excludes evaluation: the clock stops, after a
device synchronise, around every evaluation.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from bench.peers.metrics import curve_views, evaluate_views
from data import Scene
from training.evaluation import sync


def saved_bytes(content: Any, keep: str | None = None) -> int:
    """Bytes of ``content`` saved with torch.save; ``keep``: a path to keep the file at (else it is removed)."""
    handle, path = tempfile.mkstemp(suffix=".pt")
    os.close(handle)
    try:
        torch.save(content, path)
        size = os.path.getsize(path)
        if keep:
            os.replace(path, keep)
        return size
    finally:
        if os.path.exists(path):
            os.remove(path)


def train_and_evaluate(
    make_training: Callable[[], Any],
    evaluation: Scene,
    steps: list[int],
    device: torch.device,
    name: str,
    curve_every: int,
    curve_count: int,
    keep_model: str | None,
    log: Callable[[str], None],
) -> tuple[Any, dict]:
    """Build the training state (timed: ``init_seconds``), train max(steps) steps, evaluate on every view of
    ``evaluation`` at each of ``steps`` (``evaluations``, with the model file's size; ``keep_model``: a path
    format with ``{step}`` to keep it at) and on ``curve_count`` spread views every ``curve_every`` steps
    (``curve``). Returns the training state and {init_seconds, train_seconds, peak_memory_bytes, evaluations,
    curve}."""
    total = max(steps)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    training = make_training()
    sync(device)
    init_seconds = time.perf_counter() - start

    evaluations, curve, train_seconds = [], [], 0.0
    clock = time.perf_counter()
    for step in range(total):
        loss = training.step(step)
        done = step + 1
        is_final, is_curve = done in steps, curve_every > 0 and done % curve_every == 0
        if not (is_final or is_curve):
            continue
        sync(device)
        train_seconds += time.perf_counter() - clock
        views = None if is_final else curve_views(evaluation, curve_count)
        result = evaluate_views(training.renderer_at(step), evaluation, views)
        entry = {"step": done, "train_seconds": train_seconds}
        entry |= {key: result[key] for key in ("psnr", "ssim", "psnr_worst10", "views")} | training.progress()
        curve.append(entry)
        if is_final:
            keep = keep_model.format(step=done) if keep_model else None
            final = {"worst_views": result["worst_views"], "per_view": result["per_view"]}
            final |= {"eval_seconds": result["seconds"], "model_bytes": training.model_bytes(keep)}
            evaluations.append(entry | final)
        log(
            f"{name} step {done}/{total}: {training.describe(loss)}, {train_seconds:.1f} s training, "
            f"held-out PSNR {entry['psnr']:.2f} dB ({entry['views']} views)"
        )
        sync(device)
        clock = time.perf_counter()

    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None
    timings = {"init_seconds": init_seconds, "train_seconds": train_seconds, "peak_memory_bytes": peak}
    return training, timings | {"evaluations": evaluations, "curve": curve}
