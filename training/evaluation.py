"""Evaluation and the run's outputs: held-out PSNR / SSIM (mean and worst 10% of views), the renders, the
turntable, the training curve and metrics.json."""

from __future__ import annotations

import datetime
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import imageio.v3 as iio
import numpy as np
import torch
from tqdm import tqdm

from data.cameras import look_at, orbit_positions
from training.metrics import psnr, ssim
from training.run_dir import RunError, write_error, write_json
from training.scenes import describe_device
from training.visualize import (
    colorize_depth,
    comparison_image,
    depth_with_legend,
    plot_curve,
    to_uint8,
    write_turntable,
)

if TYPE_CHECKING:
    from training.trainer import Trainer


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (timings and evaluations start and end on a settled device)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def orbit_cameras(c2w: torch.Tensor, count: int) -> torch.Tensor:
    """(count, 4, 4) cameras on a circle around the origin (z up) at the mean radius and elevation of ``c2w``."""
    positions = c2w[:, :3, 3].double().cpu().numpy()
    radius = float(np.linalg.norm(positions, axis=-1).mean())
    elevation = float(np.mean(np.arcsin(np.clip(positions[:, 2] / np.linalg.norm(positions, axis=-1), -1, 1))))
    elevation = float(np.clip(elevation, -math.radians(80), math.radians(80)))  # look_at needs up != view axis
    return torch.from_numpy(look_at(orbit_positions(count, radius, elevation)).astype(np.float32))


@torch.no_grad()
def render(trainer: Trainer, view: int) -> dict[str, torch.Tensor]:
    """Render view ``view`` of the eval split with its own camera and intrinsics."""
    scene = trainer.eval_scene
    c2w, intrinsics = scene.c2w[view], scene.intrinsics[view]
    return trainer.model.render_image(c2w, scene.height, scene.width, intrinsics, chunk=trainer.train_cfg.render_chunk)


@torch.no_grad()
def evaluate(trainer: Trainer, views: list[int], write_images: bool, writer: ThreadPoolExecutor | None = None) -> dict:
    """Render ``views`` of the eval split -> dict(psnr, ssim (means), per_view, seconds, first_rgb: the first
    view's (H, W, 3) float image as numpy); PNGs when asked."""
    was_training = trainer.model.training
    trainer.model.eval()
    scene = trainer.eval_scene
    per_view = []
    first_rgb = None
    start = time.perf_counter()
    for view in views:
        out = render(trainer, view)
        target = scene.images[view].float() / 255.0
        if first_rgb is None:
            first_rgb = out["rgb"].cpu().numpy()
        per_view.append(
            {
                "view": view,
                "name": scene.names[view],
                "psnr": psnr(out["rgb"], target),
                "ssim": ssim(out["rgb"], target),
            }
        )
        if write_images:
            if writer is None:
                raise ValueError("evaluate: write_images=True needs a writer (a ThreadPoolExecutor)")
            pred, gt = out["rgb"].cpu().numpy(), target.cpu().numpy()
            depth = (
                torch.where(
                    out["opacity"] > 0.5,
                    out["depth"] / out["opacity"].clamp_min(1e-6),
                    torch.full_like(out["depth"], float("nan")),
                )
                .cpu()
                .numpy()
            )
            stem = trainer.paths.renders / f"{view:03d}"
            for name, image in (
                ("pred", to_uint8(pred)),
                ("compare", comparison_image(gt, pred)),
                ("depth", depth_with_legend(depth, scene.near, scene.far)),
            ):
                path = f"{stem}_{name}.png"
                trainer.pending_writes.append((path, writer.submit(iio.imwrite, path, image)))
            # the raw maps beside the pictures: depth (H, W) float32, NaN where opacity < 0.5; opacity (H, W)
            opacity = out["opacity"].float().cpu().numpy()
            for name, array in (("depth", depth.astype(np.float32)), ("opacity", opacity)):
                path = f"{stem}_{name}.npy"
                trainer.pending_writes.append((path, writer.submit(np.save, path, array)))
    sync(trainer.device)
    trainer.model.train(was_training)
    ranked = sorted(per_view, key=lambda v: v["psnr"])
    worst = ranked[: max(1, math.ceil(len(ranked) / 10))]  # the held-out bar is about the worst views too
    return {
        "psnr": float(np.mean([v["psnr"] for v in per_view])),
        "ssim": float(np.mean([v["ssim"] for v in per_view])),
        "psnr_worst10": float(np.mean([v["psnr"] for v in worst])),
        "worst_views": [v["view"] for v in worst],
        "per_view": per_view,
        "seconds": time.perf_counter() - start,
        "first_rgb": first_rgb,
    }


def spread_views(num_views: int, count: int) -> list[int]:
    """``count`` view indices spread evenly over ``0 .. num_views - 1``: ``linspace(0, num_views - 1, count)``
    rounded, so the first and the last view are always in (one view: the first). ``count >= num_views``: all."""
    if count >= num_views:
        return list(range(num_views))
    return sorted(set(np.linspace(0, num_views - 1, count).round().astype(int).tolist()))


def final_views(trainer: Trainer) -> list[int]:
    """The eval views the final evaluation renders: ``train.eval_final_views`` of them spread evenly over the
    eval split (:func:`spread_views`), or every one when it is 0 or at least the split's size (with a note)."""
    total, count = trainer.eval_scene.num_views, int(trainer.train_cfg.get("eval_final_views", 0))
    if count > total:
        print(
            f"note: train.eval_final_views={count} but the {trainer.eval_scene.split} split has {total} views: "
            "evaluating all of them"
        )
    return spread_views(total, count) if count > 0 else list(range(total))


def periodic_eval(trainer: Trainer) -> None:
    """Held-out PSNR / SSIM on ``train.eval_views`` views spread over the eval split, during training: appended to
    the trainer's eval history, logged to TensorBoard with the first view's image, and printed."""
    count = min(trainer.train_cfg.eval_views, trainer.eval_scene.num_views)
    if count == 0:
        return
    views = spread_views(trainer.eval_scene.num_views, count)
    result = evaluate(trainer, views, write_images=False)
    entry = {
        "step": trainer.step,
        "train_seconds": trainer.train_seconds,
        "psnr": result["psnr"],
        "ssim": result["ssim"],
        "psnr_worst10": result["psnr_worst10"],
    }
    trainer.eval_history.append(entry)
    image = {f"view_{views[0]:03d}": to_uint8(result["first_rgb"])}  # the image evaluate just rendered
    trainer.tensorboard.evaluation(trainer.step, entry["psnr"], entry["ssim"], image)
    tqdm.write(
        f"eval @ step {trainer.step}: PSNR {entry['psnr']:.2f} dB, SSIM {entry['ssim']:.4f} "
        f"({len(views)} views, {trainer.train_seconds:.1f} s of training)",
        file=sys.stdout,
    )


def write_outputs(trainer: Trainer, render_only: bool, data_seconds: float) -> dict:
    """Final evaluation (every eval view, or ``train.eval_final_views`` of them: :func:`final_views`), renders,
    turntable, curve and metrics.json; returns the metrics.

    Every file write is checked: a failed one (disk full, a folder in the way) stops the run with a
    RunError naming the file, instead of leaving unreadable images behind an exit code of 0."""
    trainer.pending_writes = []
    try:
        trainer.paths.renders.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=4) as writer:
            result = evaluate(trainer, final_views(trainer), write_images=True, writer=writer)
            files_start = time.perf_counter()
            render_turntable(trainer)
            if len(trainer.history["step"]) >= 1:
                plot_curve(
                    trainer.history["step"],
                    trainer.history["psnr"],
                    trainer.paths.renders / "training_curve.png",
                    title="training PSNR (batch)",
                    ylabel="PSNR (dB)",
                    xlabel="step",
                )
            if trainer.eval_history:  # the periodic held-out evaluations against training time
                plot_curve(
                    [entry["train_seconds"] for entry in trainer.eval_history],
                    [entry["psnr"] for entry in trainer.eval_history],
                    trainer.paths.renders / "heldout_curve.png",
                    title=f"held-out PSNR ({trainer.train_cfg.eval_views} views) against training time",
                    ylabel="PSNR (dB)",
                    xlabel="training seconds",
                )
        for path, future in trainer.pending_writes:
            if future.exception() is not None:
                raise RunError(f"cannot write the render {path}: {write_error(future.exception())}")
        files_seconds = time.perf_counter() - files_start
        metrics = run_metrics(trainer, result, render_only, data_seconds, files_seconds)
        write_json(trainer.paths.metrics, metrics)
    except OSError as error:
        raise RunError(f"cannot write the run's outputs in {trainer.paths.root}: {write_error(error)}") from None
    return metrics


def rgb_depth_frame(out: dict[str, torch.Tensor], near: float, far: float) -> np.ndarray:
    """A render's (H, W) maps -> one (H, 2W, 3) uint8 video frame: RGB | depth coloured over [near, far] (black
    where the opacity is below 0.5, as the evaluation's depth maps)."""
    depth = out["depth"].float().cpu().numpy()
    depth[out["opacity"].float().cpu().numpy() < 0.5] = np.nan
    return np.concatenate([to_uint8(out["rgb"].cpu().numpy()), colorize_depth(depth, near, far)], axis=1)


@torch.no_grad()
def render_turntable(trainer: Trainer) -> Path | None:
    """The turntable video (RGB | depth) around the evaluation cameras' mean radius and elevation."""
    count = trainer.train_cfg.turntable_frames
    if count == 0:
        return None
    trainer.model.eval()
    scene, scale = trainer.eval_scene, trainer.model.upsample
    # at most turntable_max_side pixels a side (same field of view), a multiple of the upsample factor
    shrink = max(1, math.ceil(max(scene.height, scene.width) / trainer.train_cfg.turntable_max_side))
    height, width = (max(scale, side // shrink // scale * scale) for side in (scene.height, scene.width))
    # the first view's intrinsics, scaled to the turntable's size (principal point kept where it was)
    fx, fy, cx, cy = scene.intrinsics[0].tolist()
    sx, sy = (width, scene.width), (height, scene.height)
    scaled = [fx * sx[0] / sx[1], fy * sy[0] / sy[1], cx * sx[0] / sx[1], cy * sy[0] / sy[1]]
    intrinsics = torch.tensor(scaled, dtype=torch.float64)
    chunk = trainer.train_cfg.render_chunk
    model = trainer.model
    frames = [
        rgb_depth_frame(model.render_image(c2w, height, width, intrinsics, chunk), scene.near, scene.far)
        for c2w in orbit_cameras(scene.c2w, count)
    ]
    return write_turntable(frames, trainer.paths.renders / "turntable.mp4", fps=20.0)


def run_metrics(trainer: Trainer, result: dict, render_only: bool, data_seconds: float, files_seconds: float) -> dict:
    seconds = max(trainer.train_seconds, 1e-9)
    return {
        "psnr": result["psnr"],
        "ssim": result["ssim"],
        "psnr_worst10": result["psnr_worst10"],
        "worst_views": result["worst_views"],  # renders/<view>_compare.png shows their error images
        "per_view": result["per_view"],
        "iters": trainer.step,
        "train_seconds": trainer.train_seconds,
        "eval_seconds": result["seconds"],
        "checkpoint_seconds": trainer.checkpoint_seconds,
        "output_seconds": files_seconds,
        "data_seconds": data_seconds,
        "rays_per_second": trainer.rays_done / seconds if trainer.train_seconds > 0 else None,
        "pixels_per_second": trainer.pixels_done / seconds if trainer.train_seconds > 0 else None,
        "ops": dict(trainer.ops.backends),
        "device": describe_device(trainer.device),
        "seed": trainer.seed,
        "resolution": [trainer.eval_scene.height, trainer.eval_scene.width],
        "data": trainer.cfg.data.name,
        "eval_split": trainer.eval_scene.split,
        "eval_views": len(result["per_view"]),  # how many views the final evaluation used (train.eval_final_views)
        "evaluated_views": [v["view"] for v in result["per_view"]],  # which: indices into the eval split
        "eval_split_views": trainer.eval_scene.num_views,  # the eval split's size
        "train_views": trainer.train_scene.num_views,
        "grid_shape": list(trainer.model.grid_shape),
        "grid_box": trainer.model.bbox.tolist(),
        "eval_history": trainer.eval_history,
        "render_only": render_only,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
