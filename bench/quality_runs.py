"""Train several variants of a config side by side and tabulate held-out quality: the ablation tool.

    python bench/quality_runs.py --data lego_400 --parallel 4 --json OUT.json \
        --variant base= --variant rb=train.random_background=true ...

Each ``--variant NAME=OVERRIDES`` (space-separated Hydra overrides, appended to ``--common``) is one ``train.py
+experiment=EXPERIMENT`` run (``--experiment``: blender, or capture for a nerfstudio capture) in its own folder
under ``--runs``; ``--variant NAME@N=OVERRIDES`` runs it on N GPUs (``torchrun --standalone
--nproc_per_node=N``, split as ``train.parallel`` says). ``--parallel`` runs share the device, so their PSNR is what
the config gives but their times are not: time a variant alone (``--parallel 1``) before quoting its speed. The
JSON has, per variant, mean PSNR / SSIM, the mean of the worst 10% of views, the worst views, training seconds,
rays/s, the final grid shape and box, the split and step graph's reports, and with ``train.profile`` (``host``
keeps the run's pace) among the overrides each rank's 100-step windows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_variant(name: str, overrides: list[str], args: argparse.Namespace, ranks: int = 1) -> dict:
    run_dir = Path(args.runs) / name
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"] if ranks > 1 else []
    command = [
        sys.executable,
        *launcher,
        "train.py",
        f"+experiment={args.experiment}",
        f"data.root={args.data}",
        f"hydra.run.dir={run_dir}",
        "train.turntable_frames=0",
        *shlex.split(args.common),
        *overrides,
    ]
    start = time.perf_counter()
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - start
    result = {
        "variant": name,
        "ranks": ranks,
        "overrides": overrides,
        "returncode": completed.returncode,
        "wall_seconds": wall,
    }
    metrics_path = run_dir / "metrics.json"
    if completed.returncode != 0 or not metrics_path.is_file():
        result["error"] = (completed.stdout[-1500:] + completed.stderr[-1500:]).strip()
        return result
    metrics = json.loads(metrics_path.read_text())
    for key in (
        "psnr",
        "ssim",
        "psnr_worst10",
        "worst_views",
        "train_seconds",
        "rays_per_second",
        "grid_shape",
        "grid_box",
        "iters",
        "eval_split",
        "eval_views",
        "device",
    ):
        result[key] = metrics.get(key)
    result["eval_history"] = metrics.get("eval_history")
    result["parallel"] = metrics.get("parallel")
    result["step_graph"] = metrics.get("step_graph_ranks") or metrics.get("step_graph")
    result["profile_windows"] = profile_windows(run_dir)
    return result


def profile_windows(run_dir: Path) -> dict | None:
    """With ``train.profile`` among the overrides: each rank's 100-step windows (training.profiler's profile.json,
    profile_rank<r>.json) as [first step, last step, mean ms a step]; None without them."""
    found = {}
    for path in sorted(run_dir.glob("profile*.json")):
        windows = json.loads(path.read_text()).get("windows") or []
        found[path.stem] = [[*window["steps"], window["step_ms"]] for window in windows]
    return found or None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the scene folder (blender scene or nerfstudio capture)")
    parser.add_argument("--experiment", default="blender", choices=["blender", "capture"], help="the preset")
    parser.add_argument("--variant", action="append", required=True, help="NAME=space-separated overrides")
    parser.add_argument("--common", default="", help="overrides every variant gets first")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--runs", default="/tmp/quality_runs")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    variants = []
    for item in args.variant:
        label, _, overrides = item.partition("=")
        name, _, ranks = label.partition("@")
        if not name or not (ranks == "" or ranks.isdigit() and int(ranks) >= 1):
            parser.error(f"--variant {item!r}: expected NAME=OVERRIDES or NAME@RANKS=OVERRIDES")
        variants.append((name, shlex.split(overrides), int(ranks or 1)))
    results: list[dict] = []

    def record(result: dict) -> None:
        results.append(result)
        if "psnr" in result:
            print(
                f"{result['variant']:28s} PSNR {result['psnr']:.3f}  worst10% {result['psnr_worst10']:.3f}  "
                f"SSIM {result['ssim']:.4f}  train {result['train_seconds']:.1f} s  "
                f"{result['rays_per_second'] / 1e6:.2f} M rays/s  grid {result['grid_shape']}",
                flush=True,
            )
        else:
            print(
                f"{result['variant']:28s} FAILED rc={result['returncode']}: {result.get('error', '')[-600:]}",
                flush=True,
            )
        report = {
            "date": datetime.date.today().isoformat(),
            "common": args.common,
            "parallel": args.parallel,
            "data": args.data,
            "experiment": args.experiment,
            "results": results,
        }
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        futures = [pool.submit(run_variant, name, overrides, args, ranks) for name, overrides, ranks in variants]
        for future in futures:
            record(future.result())
    return 0 if all("psnr" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
