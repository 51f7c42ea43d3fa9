"""Train and evaluate a peer on one of our scenes, or record our own finished run, into the scene's results file
and plot (bench/README.md "Peers harness").

    python -m bench.peers.run --scene lego_400 --data-root PATH --method gsplat --steps 7000,30000 --out DIR
    python -m bench.peers.run --scene lego_400 --data-root PATH --method ours --ours-run RUN_DIR --out DIR

Writes DIR/<date>-<scene>.json (every method's entry, merged run after run) and DIR/<date>-<scene>.png (held-out
PSNR against training seconds, every method in the file), and prints the rows of the README table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

METHODS = ("gsplat", "nerfacc", "ours")
PEERS = ("gsplat", "nerfacc")  # methods this CLI trains
DEFAULT_STEPS = {"gsplat": [7000], "nerfacc": [20000]}  # 3DGS's 7k evaluation; nerfacc's example runs 20k


def step_list(text: str) -> list[int]:
    """``"7000,30000"`` -> [7000, 30000]: positive, increasing step counts."""
    try:
        steps = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps: expected comma-separated step counts, got {text!r}") from None
    if not steps or any(s < 1 for s in steps) or steps != sorted(set(steps)):
        raise argparse.ArgumentTypeError(f"--steps: expected positive increasing step counts, got {text!r}")
    return steps


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.peers.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--scene", required=True, help="the scene's name in the results (e.g. lego_400, fruit)")
    p.add_argument("--data-root", required=True, type=Path, help="the scene folder (blender or nerfstudio)")
    p.add_argument(
        "--method", required=True, choices=METHODS, help="gsplat: 3DGS; nerfacc: the NeRF peer; ours: record --ours-run"
    )
    p.add_argument(
        "--steps",
        type=step_list,
        default=None,
        help="a peer's step counts to evaluate at, all views (default: "
        + ", ".join(f"{m} {s}" for m, s in DEFAULT_STEPS.items())
        + ")",
    )
    p.add_argument("--out", type=Path, default=Path("bench/peers/results"), help="results folder")
    p.add_argument("--date", default=None, help="the results' date (default: today), names the files")
    p.add_argument("--ours-run", type=Path, default=None, help="ours: the finished train.py run folder")
    p.add_argument("--data-override", action="append", default=[], help="more data.* overrides, as for train.py")
    p.add_argument("--curve-every", type=int, default=1000, help="a peer: steps between curve evaluations (0: none)")
    p.add_argument("--curve-views", type=int, default=4, help="a peer: views of a curve evaluation (ours: 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-background", action="store_true", help="gsplat: train on a random background")
    p.add_argument("--keep-model", default=None, help="a peer: keep its model at this path ({step} filled in)")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The CLI's arguments, with the cross-argument rules checked (a usage error naming the argument)."""
    p = parser()
    args = p.parse_args(argv)
    if args.method == "ours" and args.ours_run is None:
        p.error("--method ours needs --ours-run RUN_DIR (the folder of a finished train.py run)")
    if args.method in PEERS and args.ours_run is not None:
        p.error("--ours-run is for --method ours (record our run separately, alone on the GPU)")
    if args.steps is None:
        args.steps = DEFAULT_STEPS.get(args.method, [])
    if args.curve_every < 0 or args.curve_views < 1:
        p.error("--curve-every must be >= 0 and --curve-views >= 1")
    if not args.scene.replace("_", "").replace("-", "").isalnum():
        p.error(f"--scene: use letters, digits, '_' and '-' (it names the files), got {args.scene!r}")
    return args


def device_description() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(torch.cuda.current_device())


def peer_trainer(args: argparse.Namespace):
    """``scene -> results entry`` for the peer ``args.method``, its package imported (a one-line error if absent)."""
    later = dict(seed=args.seed, curve_every=args.curve_every, curve_count=args.curve_views, keep_model=args.keep_model)
    if args.method == "gsplat":
        from bench.peers.gaussians import Recipe
        from bench.peers.gsplat_trainer import import_gsplat, train_gsplat

        import_gsplat()
        recipe = dataclasses.replace(Recipe(), random_background=args.random_background)
        return lambda scene: train_gsplat(scene, args.steps, recipe, **later)
    from bench.peers.nerfacc_trainer import nerfacc_backend, train_nerfacc

    backend = nerfacc_backend()
    return lambda scene: train_nerfacc(scene, args.steps, backend=backend, **later)


def run(args: argparse.Namespace) -> dict:
    from bench.peers.plot import plot_results
    from bench.peers.results import merge_method, our_entry, results_path, table_rows, today

    date = args.date or today()
    header = {"scene": args.scene, "date": date}
    if args.method == "ours":
        entry = our_entry(args.ours_run)
        header["device"] = entry.get("device") or device_description()
    else:
        from bench.peers.scenes import load_peer_scene

        train = peer_trainer(args)  # fails before loading the scene when the peer's package is missing
        if not torch.cuda.is_available():
            raise RuntimeError(f"--method {args.method} needs a CUDA GPU (its kernels are CUDA only)")
        start = time.perf_counter()
        scene = load_peer_scene(args.data_root, args.data_override, args.scene)
        data_seconds = time.perf_counter() - start
        print(
            f"{args.scene}: {scene.train.num_views} train / {scene.eval.num_views} {scene.eval.split} views "
            f"{scene.train.width}x{scene.train.height} ({data_seconds:.1f} s to load)",
            flush=True,
        )
        entry = train(scene)
        entry.update(device=device_description(), torch=torch.__version__, data_seconds=data_seconds)
        entry["data"] = scene.data
        entry["undistorted"] = scene.distortion is not None  # evaluated on frames undistorted to pinhole
        header.update(device=entry["device"], eval_split=scene.eval.split, eval_views=scene.eval.num_views)
    path = results_path(args.out, args.scene, date)
    content = merge_method(path, header, args.method, entry)
    plot_results(content, path.with_suffix(".png"))
    print(f"results: {path} and {path.with_suffix('.png')}")
    print("\n".join(table_rows(content)))
    return content


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except (ValueError, RuntimeError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
