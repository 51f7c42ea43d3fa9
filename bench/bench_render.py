"""Rendering benchmark: rays per second of the shared inference path (training.inference) against a floor.

    python bench/bench_render.py --run RUN_DIR              # a trained run (its model.pt or last.pt), e.g. lego 400
    python bench/bench_render.py                            # a built-in lego-sized shell scene (no training needed)
    python bench/bench_render.py --sizes 400 800 --frames 20 --floor 10e6 --out bench/results/X.json
    python bench/bench_render.py --compare                  # also training's march (model.render_image), same views
    python bench/bench_render.py --run RUN_DIR --profile 10 # torch.profiler tables over 10 views of the first size

Per size: ``--frames`` orbit views (after one warm-up view), timed end to end with a device sync, as evaluation
renders them (``render_view``: march, early termination, decode, composite, per chunk), then the same orbit through
``render_path``'s frame pipeline (RGB | depth frames assembled on the host while the next renders): frames per
second; and evaluation's PSNR + SSIM per view (``metrics_ms_per_view``; ``eval_rays_per_second`` for render +
metrics, without the PNG writes). A row passes when its rays/s reach ``--floor`` (default 10 M rays/s on CUDA,
issue 32's bar; on the CPU the floor is only reported). Exit status 1 when a CUDA row misses its floor with
``--check``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: data, models, training
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_timing beside this file

from bench_timing import device_name, write_report  # noqa: E402

from data.cameras import look_at, orbit_positions  # noqa: E402
from models.model import VoxelNeRF  # noqa: E402
from training.finished_run import fast_ops, load_run  # noqa: E402
from training.inference import inference_chunk, render_view  # noqa: E402
from training.metrics import psnr_tensor, ssim_tensor  # noqa: E402
from training.render_path import render_frames  # noqa: E402

FLOOR_RAYS_PER_SECOND = 10e6  # issue 32: evaluation and render_path at >= 10 M rays/s on an H100

# the lego preset's model (configs/experiment/blender.yaml) on a shell of density: ~5% of the cells occupied
SHELL_MODEL = {
    "resolution_start": 320,
    "resolution_end": 320,
    "grow_at": [],
    "feature_dim": 12,
    "upsample": 1,
    "shading": "per_sample",
    "decoder_hidden": 128,
    "decoder_layers": 2,
    "dir_encoding": "pe3",
    "decoder_precision": "bfloat16",
    "step_ratio": 0.5,
    "max_samples": 1024,
    "weight_threshold": 1e-3,
}


@torch.no_grad()
def shell_model(device: torch.device, resolution: int) -> VoxelNeRF:
    """A lego-sized stand-in: the preset's model with a hollow sphere of density (radius 0.6-0.7 of the box's
    half side) and random features, its occupancy grid built as training builds it."""
    config = dict(SHELL_MODEL, resolution_start=resolution, resolution_end=resolution)
    box = torch.tensor([[-1.5] * 3, [1.5] * 3])
    model = VoxelNeRF(box, 2.0, 6.0, config, fast_ops()).to(device).eval()
    axes = [torch.linspace(-1.0, 1.0, n, device=device) for n in model.grid_shape]
    radius = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).norm(dim=-1)
    model.density.grid.copy_(torch.where((radius > 0.6) & (radius < 0.7), 10.0, -20.0)[..., None])
    model.features.grid.normal_(0.0, 1.0)
    model.refresh_occupancy()
    return model


def orbit(model: VoxelNeRF, frames: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(frames, 4, 4) cameras at radius 4, 30 degrees up, looking at the box centre; (frames, 4) intrinsics at a
    40 degree field of view."""
    centre = model.bbox.mean(0).cpu().double().numpy()
    cameras = look_at(orbit_positions(frames, 4.0, math.radians(30.0)) + centre, target=tuple(centre.tolist()))
    focal = 0.5 * size / math.tan(math.radians(20.0))
    return cameras.astype(np.float32), np.tile([focal, focal, size / 2, size / 2], (frames, 1))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_views(render, cameras: np.ndarray, intrinsics: np.ndarray, size: int, device: torch.device) -> tuple:
    """(seconds, last output) of ``render(camera, size, size, intrinsics)`` over cameras[1:] after a warm-up on
    cameras[0], synchronised."""
    render(cameras[0], size, size, torch.as_tensor(intrinsics[0]))
    sync(device)
    start = time.perf_counter()
    for camera, k in zip(cameras[1:], intrinsics[1:]):
        out = render(camera, size, size, torch.as_tensor(k))
    sync(device)
    return time.perf_counter() - start, out


def time_metrics(rgb: torch.Tensor, frames: int, device: torch.device) -> float:
    """Seconds of ``frames`` evaluations' PSNR + SSIM (as training.evaluation computes them, on the device) of an
    (H, W, 3) render against a perturbed copy, synchronised."""
    target = (rgb + 0.01 * torch.rand_like(rgb)).clamp(0.0, 1.0)
    psnr_tensor(rgb, target), ssim_tensor(rgb, target)  # warm-up (cached filter matrices)
    sync(device)
    start = time.perf_counter()
    scores = [torch.stack([psnr_tensor(rgb, target), ssim_tensor(rgb, target)]) for _ in range(frames)]
    torch.stack(scores).tolist()  # evaluation's one sync
    return time.perf_counter() - start


def profile_views(model: VoxelNeRF, size: int, views: int, chunk: int | None) -> str:
    """torch.profiler's tables (by host time, by device time) over ``views`` renders of ``size`` x ``size``."""
    from torch.profiler import ProfilerActivity, profile

    cameras, intrinsics = orbit(model, views + 1, size)
    render_view(model, cameras[0], size, size, torch.as_tensor(intrinsics[0]), chunk=chunk)  # warm-up
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.bbox.is_cuda else [])
    with profile(activities=activities) as prof:
        for camera, k in zip(cameras[1:], intrinsics[1:]):
            render_view(model, camera, size, size, torch.as_tensor(k), chunk=chunk)
        sync(model.bbox.device)
    table = prof.key_averages()
    by_device = "self_cuda_time_total" if model.bbox.is_cuda else "self_cpu_time_total"
    return "\n".join(
        table.table(sort_by=key, row_limit=15, max_name_column_width=50) for key in ("self_cpu_time_total", by_device)
    )


def bench_size(model: VoxelNeRF, size: int, frames: int, chunk: int | None, floor: float, compare: bool) -> dict:
    device = model.bbox.device
    cameras, intrinsics = orbit(model, frames + 1, size)
    seconds, out = time_views(partial(render_view, model, chunk=chunk), cameras, intrinsics, size, device)
    extra = {}
    if compare:  # training's march over the same views, in the same chunks (what render_view used before)
        chunk_used = inference_chunk(device, chunk)
        march = partial(model.render_image, chunk=chunk_used)
        march_seconds, reference = time_views(march, cameras, intrinsics, size, device)
        extra["march_rays_per_second"] = frames * size * size / march_seconds
        extra["max_rgb_difference"] = float((reference["rgb"] - out["rgb"]).abs().max())
    start = time.perf_counter()
    render_frames(model, cameras[1:], intrinsics[1:], (size, size), chunk)
    pipeline_seconds = time.perf_counter() - start
    metrics_seconds = time_metrics(out["rgb"], frames, device)
    rays_per_second = frames * size * size / seconds
    return {
        "size": size,
        "frames": frames,
        "seconds": seconds,
        "rays_per_second": rays_per_second,
        "fps": frames / seconds,
        "render_path_fps": frames / pipeline_seconds,
        # evaluation's per-view PSNR + SSIM (training.evaluation), and the rate of render + metrics it allows
        "metrics_ms_per_view": 1e3 * metrics_seconds / frames,
        "eval_rays_per_second": frames * size * size / (seconds + metrics_seconds),
        "last_view_opacity": float(out["opacity"].mean()),  # > 0: the views see the scene
        "floor_rays_per_second": floor,
        "passes": rays_per_second >= floor,
    } | extra


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, default=None, help="a run folder (default: the built-in shell scene)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="square sizes (CUDA 400 800, CPU 32)")
    parser.add_argument("--frames", type=int, default=None, help="timed views per size (CUDA 20, CPU 2)")
    parser.add_argument("--resolution", type=int, default=None, help="shell scene's grid (CUDA 320, CPU 32)")
    parser.add_argument("--chunk", type=int, default=None, help="rays per chunk (default: training.inference's)")
    parser.add_argument("--floor", type=float, default=FLOOR_RAYS_PER_SECOND, help="rays/s a row must reach")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--check", action="store_true", help="exit 1 when a CUDA row is below the floor")
    parser.add_argument("--compare", action="store_true", help="also time model.render_image (training's march)")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    parser.add_argument("--profile", type=int, default=0, help="print torch.profiler tables over this many views")
    args = parser.parse_args(argv)
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device == "auto" else args.device)
    cuda = device.type == "cuda"
    sizes = args.sizes or ([400, 800] if cuda else [32])
    frames = args.frames or (20 if cuda else 2)
    if args.run is not None:
        model = load_run(args.run, fast_ops())[0].to(device).eval()
        scene = str(args.run)
    else:
        model = shell_model(device, args.resolution or (320 if cuda else 32))
        scene = "shell"
    occupied = model.occupancy.occupied_fraction()
    print(f"render benchmark on {device_name(device)}: {scene}, grid {list(model.grid_shape)}, {occupied:.1%} occupied")
    rows = [bench_size(model, size, frames, args.chunk, args.floor, args.compare) for size in sizes]
    if args.profile > 0:
        print(profile_views(model, sizes[0], args.profile, args.chunk))
    print(f"{'size':>6} {'rays/s':>12} {'floor':>10} {'fps':>7} {'render_path fps':>16} {'metrics ms':>11}  verdict")
    for row in rows:
        verdict = "PASS" if row["passes"] else ("FAIL" if cuda else "(CPU: not judged)")
        print(
            f"{row['size']:>6} {row['rays_per_second'] / 1e6:>10.2f} M {row['floor_rays_per_second'] / 1e6:>8.1f} M "
            f"{row['fps']:>7.1f} {row['render_path_fps']:>16.1f} {row['metrics_ms_per_view']:>11.2f}  {verdict}"
        )
        if "march_rays_per_second" in row:
            print(
                f"{'':>6} training's march: {row['march_rays_per_second'] / 1e6:.2f} M rays/s, "
                f"max |rgb difference| {row['max_rgb_difference']:.2e}"
            )
    report = {"device": device_name(device), "scene": scene, "grid": list(model.grid_shape), "rows": rows}
    write_report(report, args.out)
    return 1 if args.check and cuda and not all(row["passes"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
