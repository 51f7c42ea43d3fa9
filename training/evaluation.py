"""Evaluation and the run's outputs: held-out PSNR / SSIM (mean and worst 10% of views), the renders, the
turntable, the training curve and metrics.json."""

from __future__ import annotations

import datetime
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import imageio.v3 as iio
import numpy as np
import torch
from tqdm import tqdm

from data.cameras import look_at, orbit_positions
from training.inference import HostPipeline, expected_depth, render_frames, render_view
from training.metrics import psnr_tensor, ssim_tensor
from training.plots import plot_curve
from training.run_dir import RunError, write_error, write_json
from training.scenes import describe_device, device_memory
from training.timing import process_seconds
from training.visualize import (
    colorize_depth,
    comparison_image,
    depth_with_legend,
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
    lens = None if scene.lens is None else scene.lens.take(torch.tensor(view))  # as captured: distorted like the image
    height, width = scene.view_size(view)  # its own size (a scene may mix portrait and landscape frames)
    return render_view(trainer.model, c2w, height, width, intrinsics, trainer.train_cfg.render_chunk, lens)


class RenderWriteError(OSError):
    """A render file could not be written: ``path`` names it, ``cause`` is the error."""

    def __init__(self, path: str, cause: BaseException):
        super().__init__(str(cause))
        self.path, self.cause = path, cause


def _write_view(stem: Path, near: float, far: float, maps: dict[str, np.ndarray]) -> None:
    """A view's files from its host maps (worker thread): prediction, gt | pred | error, depth PNGs; the raw depth
    (H, W) float32, NaN where opacity < 0.5, and opacity (H, W) as .npy."""
    pred, gt, depth = maps["rgb"], maps["gt"].astype(np.float32) / 255.0, maps["depth"].astype(np.float32)
    files = [
        ("pred.png", iio.imwrite, lambda: to_uint8(pred)),
        ("compare.png", iio.imwrite, lambda: comparison_image(gt, pred)),
        ("depth.png", iio.imwrite, lambda: depth_with_legend(depth, near, far)),
        ("depth.npy", np.save, lambda: depth),
        ("opacity.npy", np.save, lambda: maps["opacity"].astype(np.float32)),
    ]
    for suffix, write, content in files:
        path = f"{stem}_{suffix}"
        try:
            write(path, content())
        except Exception as error:  # named and raised in write_outputs
            raise RenderWriteError(path, error) from error


@torch.no_grad()
def evaluate(trainer: Trainer, views: list[int], write_images: bool, writer: ThreadPoolExecutor | None = None) -> dict:
    """Render ``views`` of the eval split -> dict(psnr, ssim (means), per_view, seconds, first_rgb: the first
    view's (H, W, 3) float image as numpy); PNGs when asked, written by ``writer``'s threads while the next view
    renders. PSNR and SSIM stay on the device until the last view (one host sync for all of them)."""
    if write_images and writer is None:
        raise ValueError("evaluate: write_images=True needs a writer (a ThreadPoolExecutor)")
    was_training = trainer.model.training
    trainer.model.eval()
    scene = trainer.eval_scene
    pipeline = HostPipeline(writer) if write_images else None
    scores, first_rgb = [], None
    start = time.perf_counter()
    for view in views:
        out = render(trainer, view)
        target = scene.view_image(view).float() / 255.0
        scores.append(torch.stack([psnr_tensor(out["rgb"], target), ssim_tensor(out["rgb"], target)]))
        if first_rgb is None:
            first_rgb = out["rgb"].cpu().numpy()
        if pipeline is not None:
            stem = trainer.paths.renders / f"{view:03d}"
            maps = {"rgb": out["rgb"], "gt": scene.view_image(view), "depth": expected_depth(out)}
            maps["opacity"] = out["opacity"]
            future = pipeline.submit(maps, partial(_write_view, stem, scene.near, scene.far))
            trainer.pending_writes.append((f"{stem}_pred.png", future))
    values = torch.stack(scores).tolist() if scores else []  # the loop's one sync
    trainer.model.train(was_training)
    per_view = [
        {"view": view, "name": scene.names[view], "psnr": value[0], "ssim": value[1]}
        for view, value in zip(views, values)
    ]
    return {
        **summarize(per_view),
        "per_view": per_view,
        "seconds": time.perf_counter() - start,
        "rays": sum(math.prod(scene.view_size(view)) for view in views),
        "first_rgb": first_rgb,
    }


def summarize(per_view: list[dict]) -> dict:
    """Mean PSNR and SSIM of per-view scores (dicts with view, psnr, ssim), the mean PSNR of the worst 10% of
    the views (at least one) and which views those are."""
    ranked = sorted(per_view, key=lambda v: v["psnr"])
    worst = ranked[: max(1, math.ceil(len(ranked) / 10))]  # the held-out bar is about the worst views too
    return {
        "psnr": float(np.mean([v["psnr"] for v in per_view])),
        "ssim": float(np.mean([v["ssim"] for v in per_view])),
        "psnr_worst10": float(np.mean([v["psnr"] for v in worst])),
        "worst_views": [v["view"] for v in worst],
    }


def spread_views(num_views: int, count: int) -> list[int]:
    """``count`` view indices spread evenly over ``0 .. num_views - 1``: ``linspace(0, num_views - 1, count)``
    rounded, so the first and the last view are always in (one view: the first). ``count >= num_views``: all."""
    if count >= num_views:
        return list(range(num_views))
    return sorted(set(np.linspace(0, num_views - 1, count).round().astype(int).tolist()))


def rank_views(views: list[int], rank: int, world: int) -> list[int]:
    """The views rank ``rank`` of ``world`` renders in a shared evaluation: every world-th, from its own rank's
    (rank 0 gets the first, whose image is logged; ranks past the views get none)."""
    return views[rank::world]


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
    the trainer's eval history, logged to TensorBoard with the first view's image, and printed. Every rank of a
    torchrun job calls it and renders its share of the views (:func:`rank_views`; rank 0 the first), so the others
    do not wait idle for rank 0 at the next step; one all-reduce brings the scores to rank 0, which reports."""
    count = min(trainer.train_cfg.eval_views, trainer.eval_scene.num_views)
    if count == 0:
        return
    group = trainer.group
    views = spread_views(trainer.eval_scene.num_views, count)
    mine = rank_views(views, group.rank, group.world)
    result = evaluate(trainer, mine, write_images=False) if mine else {"per_view": [], "seconds": 0.0}
    scores = torch.zeros(len(views), 2, dtype=torch.float64)  # (psnr, ssim) per view, this rank's rows filled
    for score in result["per_view"]:
        scores[views.index(score["view"])] = torch.tensor([score["psnr"], score["ssim"]], dtype=torch.float64)
    scores = group.total(scores).tolist()
    if not group.is_main:
        return
    result.update(summarize([{"view": v, "psnr": s[0], "ssim": s[1]} for v, s in zip(views, scores)]))
    entry = {
        "step": trainer.step,
        "train_seconds": trainer.train_seconds,
        "psnr": result["psnr"],
        "ssim": result["ssim"],
        "psnr_worst10": result["psnr_worst10"],
        "views": len(views),
        "seconds": result["seconds"],  # its own time: one beside a checkpoint's host copy took 75x longer
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
        # 4 writers at the default PNG level: 8 at zlib level 1 made lego's final evaluation 1.8x slower on an H100
        # (the writers' numpy work holds the GIL the render loop needs; bench/README "What the user waits for")
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
            error = future.exception()
            if error is not None:
                path, cause = (error.path, error.cause) if isinstance(error, RenderWriteError) else (path, error)
                raise RunError(f"cannot write the render {path}: {write_error(cause)}")
        files_seconds = time.perf_counter() - files_start
        metrics = run_metrics(trainer, result, render_only, data_seconds, files_seconds)
        write_json(trainer.paths.metrics, metrics)
    except OSError as error:
        raise RunError(f"cannot write the run's outputs in {trainer.paths.root}: {write_error(error)}") from None
    return metrics


def rgb_depth_frame(maps: dict[str, np.ndarray], near: float, far: float) -> np.ndarray:
    """A view's host maps (training.inference.render_frames: rgb, depth NaN where the opacity is below 0.5) -> one
    (H, 2W, 3) uint8 video frame: RGB | depth coloured over [near, far] (black where NaN)."""
    return np.concatenate([to_uint8(maps["rgb"]), colorize_depth(maps["depth"], near, far)], axis=1)


@torch.no_grad()
def render_turntable(trainer: Trainer) -> Path | None:
    """The turntable video (RGB | depth) around the evaluation cameras' mean radius and elevation."""
    count = trainer.train_cfg.turntable_frames
    if count == 0:
        return None
    trainer.model.eval()
    scene, scale = trainer.eval_scene, trainer.model.upsample
    first = scene.view_size(0)
    # at most turntable_max_side pixels a side (same field of view), a multiple of the upsample factor
    shrink = max(1, math.ceil(max(first) / trainer.train_cfg.turntable_max_side))
    height, width = (max(scale, side // shrink // scale * scale) for side in first)
    # the first view's intrinsics, scaled to the turntable's size (principal point kept where it was); a virtual
    # camera, so pinhole even for a distorted capture
    fx, fy, cx, cy = scene.intrinsics[0].tolist()
    sx, sy = (width, first[1]), (height, first[0])
    scaled = [fx * sx[0] / sx[1], fy * sy[0] / sy[1], cx * sx[0] / sx[1], cy * sy[0] / sy[1]]
    intrinsics = torch.tensor(scaled, dtype=torch.float64)
    cameras = orbit_cameras(scene.c2w, count)
    frame = partial(rgb_depth_frame, near=scene.near, far=scene.far)
    chunk = trainer.train_cfg.render_chunk
    frames = render_frames(trainer.model, cameras, [intrinsics] * count, (height, width), frame, chunk)
    return write_turntable(frames, trainer.paths.renders / "turntable.mp4", fps=20.0)


def command_seconds(trainer: Trainer, result: dict, files_seconds: float) -> dict:
    """Where the whole command's time went: ``startup_seconds`` (process start to the first training step, or to the
    evaluation with render_only: imports, config, data loading, model build, CUDA context), ``wall_seconds`` (process
    start to now, metrics.json's write) and ``seconds``: the breakdown, the rest as ``other``."""
    wall = process_seconds()
    trained = trainer.startup_seconds is not None  # else render_only: everything before the evaluation is start-up
    startup = trainer.startup_seconds if trained else wall - result["seconds"] - files_seconds
    parts = {
        "startup": startup,
        "train": trainer.train_seconds if trained else 0.0,
        "eval": result["seconds"],
        "checkpoint": trainer.checkpoint_seconds,
        "output": files_seconds,
        "periodic_eval": trainer.periodic_eval_seconds,
    }
    parts["other"] = wall - sum(parts.values())
    return {"startup_seconds": startup, "wall_seconds": wall, "seconds": parts}


def rank_report(trainer: Trainer) -> dict:
    """This rank's sample capacities and step graph (None where off), gathered from every rank at the end."""
    capacities, graph = trainer.model.capacities, trainer.step_graph
    return {
        "sample_capacity": None if capacities is None else capacities.report(),
        "step_graph": None if graph is None else graph.report(),
    }


def rank_reports(trainer: Trainer) -> dict:
    """``sample_capacity_ranks`` and ``step_graph_ranks``: the ranks' reports, by rank (None: one process, or off)."""
    reports = trainer.rank_reports or []
    return {
        f"{key}_ranks": [r[key] for r in reports] if reports and reports[0][key] is not None else None
        for key in ("sample_capacity", "step_graph")
    }


def parallel_summary(trainer: Trainer) -> dict | None:
    """Under torchrun, ``{"ranks", "split"}``: data (the rays) or space (the voxels, with its ``cuts``: each growth's
    planes cut by the counted work, training.space_parallel); None for one process."""
    if not trainer.group.active:
        return None
    if trainer.space is None:
        return {"ranks": trainer.group.world, "split": "data"}
    return {"ranks": trainer.group.world, "split": "space", "cuts": list(trainer.space.cuts)}


def memory_report(device: torch.device) -> dict:
    """``peak_memory_bytes`` (the allocator's peak, None off CUDA) and ``cuda_allocator``, the rest of
    training.scenes.device_memory's account (None off CUDA)."""
    memory = device_memory(device)
    if memory is None:
        return {"peak_memory_bytes": None, "cuda_allocator": None}
    return {"peak_memory_bytes": memory.pop("peak_memory_bytes"), "cuda_allocator": memory}


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
        "eval_rays_per_second": result["rays"] / max(result["seconds"], 1e-9),
        "checkpoint_seconds": trainer.checkpoint_seconds,  # training blocked by checkpoints (writes run behind it)
        "checkpoint_write_seconds": trainer.checkpoints.write_seconds,  # the background writes themselves
        "model_bytes": trainer.paths.model.stat().st_size if trainer.paths.model.is_file() else None,
        "output_seconds": files_seconds,
        "data_seconds": data_seconds,
        **command_seconds(trainer, result, files_seconds),
        "rays_per_second": trainer.rays_done / seconds if trainer.train_seconds > 0 else None,
        "pixels_per_second": trainer.pixels_done / seconds if trainer.train_seconds > 0 else None,
        "ops": dict(trainer.ops.backends),
        "device": describe_device(trainer.device),
        # CUDA: this rank's allocator over the whole command (the peers harness's peak_memory_bytes, so its tables
        # compare ours on the same footing), and its calls to the driver
        **memory_report(trainer.device),
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
        "occupancy": trainer.model.occupancy.summary(),  # shares of occupied cells and of the rows at their corners
        "fine_grid": trainer.model.fine.summary(),  # model.fine: its bricks and shape, or why there is none
        # model.capped_samples: the sample capacities at the end, and the reviews that found an overflow
        "sample_capacity": None if trainer.model.capacities is None else trainer.model.capacities.report(),
        "step_graph": None if trainer.step_graph is None else trainer.step_graph.report(),  # train.step_graph
        "decoder_graphs": None if trainer.model.decoder_graphs is None else trainer.model.decoder_graphs.report(),
        **rank_reports(trainer),  # under torchrun: every rank's sample capacities and step graph, by rank
        "parallel": parallel_summary(trainer),  # under torchrun: the ranks and how they split (train.parallel)
        "pose_refinement": trainer.model.poses.summary(),  # how far the training cameras moved (None: off)
        "eval_history": trainer.eval_history,
        "render_only": render_only,
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
