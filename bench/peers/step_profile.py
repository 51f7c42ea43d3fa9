"""Where a 3DGS training step's time goes: the harness's own loop (bench.peers.gsplat_trainer.GsplatTraining)
after a warm-up, timed plain and then under torch.profiler, plus A/B timings of the two suspects outside the
rasteriser (the SSIM filter: banded matrix products vs cuDNN convolutions; Adam: fused vs foreach).

    python -m bench.peers.step_profile --data-root PATH [--warmup 600] [--steps 100] [--rows 20]

Prints the mean step time (device-synchronised, no profiler), the time per step in each phase of the step
(3dgs/render, loss, backward, adam, densify: the record_function ranges of GsplatTraining.step), and the top
``--rows`` operators by self CUDA time and by self CPU time. ~20 s on an H100 after gsplat's build.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from training.evaluation import sync

PHASE = "3dgs/"


def timed(fn: Callable[[], object], repeats: int, device: torch.device, warmup: int = 3) -> float:
    """Mean seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls, device-synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats


def _self_device_key() -> str:
    """The profiler's sort key for self device time (``self_cuda_time_total`` before torch 2.4 named it so)."""
    average = torch.autograd.profiler_util.FunctionEventAvg
    return "self_device_time_total" if hasattr(average, "self_device_time_total_str") else "self_cuda_time_total"


def _device_total(event) -> float:
    """An averaged event's device time in microseconds, under either torch's attribute name."""
    return float(getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)))


def profile_steps(training, first: int, steps: int, rows: int, print_fn: Callable[[str], None] = print) -> dict:
    """Run ``steps`` training steps from 0-based ``first``: once timed plain, once more under torch.profiler;
    print the phase times and the top ``rows`` ops. Returns {"step_ms", "gaussians", "phases_ms"}."""
    from torch.profiler import ProfilerActivity, profile

    device = training.device
    sync(device)
    start = time.perf_counter()
    for step in range(first, first + steps):
        training.step(step)
    sync(device)
    step_ms = 1000 * (time.perf_counter() - start) / steps
    gaussians = int(training.splats.params["means"].shape[0])
    print_fn(f"mean step {step_ms:.2f} ms over steps {first}..{first + steps - 1} ({gaussians} Gaussians at the end)")

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for step in range(first + steps, first + 2 * steps):
            training.step(step)
        sync(device)
    averages = prof.key_averages()
    phases = {}
    for event in averages:
        if event.key.startswith(PHASE):
            phases[event.key] = {
                "cpu_ms": event.cpu_time_total / 1000 / steps,
                "device_ms": _device_total(event) / 1000 / steps,
            }
    print_fn("per step, by phase (CPU: host time inside the range; device: kernels it launched):")
    for name, times in sorted(phases.items()):
        print_fn(f"  {name:16s} cpu {times['cpu_ms']:7.2f} ms   device {times['device_ms']:7.2f} ms")
    if device.type == "cuda":
        print_fn(f"top {rows} ops by self CUDA time ({steps} steps):")
        print_fn(averages.table(sort_by=_self_device_key(), row_limit=rows))
    print_fn(f"top {rows} ops by self CPU time ({steps} steps):")
    print_fn(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    return {"step_ms": step_ms, "gaussians": gaussians, "phases_ms": phases}


def ssim_ab(height: int, width: int, device: torch.device, repeats: int = 20) -> dict[str, float]:
    """Milliseconds of the SSIM filter forward + backward on the loss's 15 (H, W) float32 maps: the banded matrix
    products the loss uses, and the cuDNN convolutions it replaced (heuristic choice, then cudnn.benchmark)."""
    from bench.peers.losses import separable_filter_conv
    from training.losses import separable_filter

    maps = torch.rand(15, height, width, device=device, requires_grad=True)

    def run(filter_fn) -> Callable[[], None]:
        return lambda: filter_fn(maps).sum().backward()

    result = {"matmul": 1000 * timed(run(separable_filter), repeats, device)}
    result["conv"] = 1000 * timed(run(separable_filter_conv), repeats, device)
    if device.type == "cuda":
        previous = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = True
        try:
            result["conv_benchmark"] = 1000 * timed(run(separable_filter_conv), repeats, device)
        finally:
            torch.backends.cudnn.benchmark = previous
    return result


def adam_ab(params: dict[str, torch.Tensor], repeats: int = 20) -> dict[str, float]:
    """Milliseconds of one step of the six Adams on copies of ``params`` with random gradients: fused and foreach."""
    result = {}
    device = next(iter(params.values())).device
    for name, options in (("fused", {"fused": True}), ("foreach", {"foreach": True})):
        if name == "fused" and device.type != "cuda":
            continue
        copies = {k: torch.nn.Parameter(v.detach().clone()) for k, v in params.items()}
        for tensor in copies.values():
            tensor.grad = torch.randn_like(tensor)
        optimizers = [torch.optim.Adam([tensor], lr=1e-3, eps=1e-15, **options) for tensor in copies.values()]
        result[name] = 1000 * timed(lambda: [o.step() for o in optimizers], repeats, device)
    return result


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.peers.step_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", required=True, type=Path, help="the scene folder (blender or nerfstudio)")
    p.add_argument("--data-override", action="append", default=[], help="more data.* overrides, as for train.py")
    p.add_argument("--warmup", type=int, default=600, help="steps before timing (past the first densification)")
    p.add_argument("--steps", type=int, default=100, help="steps timed, then as many profiled")
    p.add_argument("--total", type=int, default=7000, help="the run length the means' rate decays over")
    p.add_argument("--rows", type=int, default=20, help="ops listed per table")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.rows < 1 or args.total < args.warmup + 2 * args.steps:
        p.error("need --warmup >= 0, --steps >= 1, --rows >= 1 and --total >= warmup + 2 x steps")
    from bench.peers.gaussians import Recipe
    from bench.peers.gsplat_trainer import GsplatTraining, import_gsplat
    from bench.peers.scenes import load_peer_scene

    try:
        import_gsplat()
        if not torch.cuda.is_available():
            raise RuntimeError("bench.peers.step_profile needs a CUDA GPU (gsplat's kernels are CUDA only)")
        scene = load_peer_scene(args.data_root, args.data_override)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    training = GsplatTraining(scene, args.total, Recipe(), 0, device)
    size = f"{scene.train.width}x{scene.train.height}"
    print(f"{scene.train.num_views} views {size}, scene scale {training.scene_scale:.3f}")
    start = time.perf_counter()
    for step in range(args.warmup):
        training.step(step)
    sync(device)
    print(f"warm-up: {args.warmup} steps in {time.perf_counter() - start:.1f} s")
    profile_steps(training, args.warmup, args.steps, args.rows)
    ssim = ssim_ab(scene.train.height, scene.train.width, device)
    print("SSIM filter forward + backward: " + ", ".join(f"{k} {v:.2f} ms" for k, v in ssim.items()))
    adam = adam_ab(training.splats.params)
    print("the six Adam steps: " + ", ".join(f"{k} {v:.2f} ms" for k, v in adam.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
