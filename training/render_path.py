"""Render a finished run along a camera path, into its own folder:

    python -m training.render_path RUN_DIR [--path orbit|eval|FILE.json] [--frames 120] [--elevation 30]
        [--radius R] [--fov 40] [--size 400] [--fps 30] [--out DIR] [--device auto|cpu|cuda]

Paths:
- ``orbit`` (default): ``--frames`` cameras on a circle around the grids' box centre (z up) at ``--elevation``
  degrees and ``--radius`` (default: halfway between the scene's near and far, 4 on NeRF-synthetic scenes),
  ``--fov`` degrees of horizontal field of view, square ``--size`` x ``--size`` frames.
- ``eval``: the run's evaluation cameras with their own intrinsics (the scene must still be where the run found
  it), scaled so the longer side is ``--size``.
- a JSON file: nerfstudio's camera path (``camera_path: [{camera_to_world: 16 numbers, row-major, fov: vertical
  degrees}]``, ``render_width``, ``render_height``), or transforms-style ``frames: [{transform_matrix: 4x4}]``
  with ``camera_angle_x`` and optional ``w``, ``h`` (default 400 square; a blender ``transforms_*.json``
  works); ``--size`` rescales either. Cameras are OpenGL (looking down -z, y up).

Output (``--out``, default ``RUN_DIR/renders/path_<name>``; an existing non-empty folder is refused): ``video.mp4``,
RGB and depth side by side (a GIF when imageio-ffmpeg is absent: ``pip install -e ".[video]"``), and
``cameras.json``, the path in the transforms style, so a path can be edited and rendered again with ``--path``.
Depth is coloured over the scene's [near, far]. Errors are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from data.cameras import look_at, orbit_positions
from training import inference
from training.evaluation import rgb_depth_frame
from training.export import ExportError, load_run
from training.scenes import load_scenes, resolve_device
from training.view import fast_ops
from training.visualize import write_turntable

EXIT_OK = 0
EXIT_USAGE = 2


class PathError(ValueError):
    """A camera path cannot be made or read; the message names the option or the file."""


def orbit_path(centre: np.ndarray, radius: float, elevation_deg: float, frames: int, fov_deg: float, size: int):
    """(frames, 4, 4) float32 cameras circling ``centre`` and their (frames, 4) intrinsics at size x size."""
    if not 0 < fov_deg < 180:
        raise PathError(f"--fov: must be in (0, 180) degrees, got {fov_deg}")
    if not -89 <= elevation_deg <= 89:
        raise PathError(f"--elevation: must be in [-89, 89] degrees (the camera's up is +z), got {elevation_deg}")
    positions = orbit_positions(frames, radius, math.radians(elevation_deg)) + centre
    c2w = look_at(positions, target=tuple(centre.tolist()))
    focal = 0.5 * size / math.tan(0.5 * math.radians(fov_deg))
    return c2w.astype(np.float32), np.tile([focal, focal, size / 2, size / 2], (frames, 1)), (size, size)


def file_path(path: Path, size: int | None):
    """Cameras, intrinsics and (height, width) from a nerfstudio camera path or a transforms-style JSON."""
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PathError(f"--path: cannot read {path} ({' '.join(str(error).split())})") from None
    try:
        if "camera_path" in content:  # nerfstudio: vertical fov per camera, row-major 4x4
            height, width = int(content["render_height"]), int(content["render_width"])
            c2w = np.array([np.reshape(c["camera_to_world"], (4, 4)) for c in content["camera_path"]], np.float64)
            focal = np.array([0.5 * height / math.tan(0.5 * math.radians(c["fov"])) for c in content["camera_path"]])
        else:  # transforms style: horizontal fov; our cameras.json adds the frame size as w, h
            width, height = int(content.get("w", 400)), int(content.get("h", content.get("w", 400)))
            c2w = np.array([f["transform_matrix"] for f in content["frames"]], np.float64)
            focal = np.full(len(c2w), 0.5 * width / math.tan(0.5 * float(content["camera_angle_x"])))
        intrinsics = np.stack([focal, focal, np.full_like(focal, width / 2), np.full_like(focal, height / 2)], -1)
    except (KeyError, TypeError, ValueError) as error:
        raise PathError(
            f"--path: {path} is neither a nerfstudio camera path nor transforms-style ({error!r})"
        ) from None
    if c2w.ndim != 3 or c2w.shape[1:] != (4, 4) or len(c2w) == 0:
        raise PathError(f"--path: {path} holds no 4x4 cameras")
    if size is not None:
        scale = size / max(height, width)
        height, width, intrinsics = round(height * scale), round(width * scale), intrinsics * scale
    return c2w.astype(np.float32), intrinsics, (height, width)


def eval_path(data_cfg: dict, size: int):
    """The run's evaluation cameras, intrinsics (scaled so the longer side is ``size``) and lens (distortion is
    scale-free), as the run saw them."""
    if data_cfg.get("name") == "nerfstudio":
        data_cfg.setdefault("orient", "none")  # a run from before data.orient used the poses as given
    try:
        _, scene = load_scenes(OmegaConf.create(data_cfg), torch.device("cpu"))
    except Exception as error:  # a moved or deleted scene: say so in one line
        raise PathError(f"--path eval: cannot load the run's scene ({' '.join(str(error).split())})") from None
    scale = size / max(scene.height, scene.width)
    shape = (round(scene.height * scale), round(scene.width * scale))
    return scene.c2w.numpy(), scene.intrinsics.double().numpy() * scale, shape, scene.lens


def render_frames(
    model, c2w: np.ndarray, intrinsics: np.ndarray, shape: tuple[int, int], chunk: int | None = None, lens=None
) -> list:
    """(H, 2W, 3) uint8 frames: RGB | depth over [near, far] (training.inference: the shared inference path, the
    frames assembled by worker threads while the next renders); ``lens``: None or the cameras' (V, 6) distortion."""
    lens_of = None if lens is None else (lambda index: lens.take(torch.tensor(index)))
    frame = partial(rgb_depth_frame, near=model.near, far=model.far)
    return inference.render_frames(model, c2w, intrinsics, shape, frame, chunk, lens_of)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.render_path", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--path", default="orbit", help="orbit | eval | a camera-path JSON file")
    parser.add_argument("--frames", type=int, default=120, help="orbit frames")
    parser.add_argument("--elevation", type=float, default=30.0, help="orbit elevation, degrees")
    parser.add_argument("--radius", type=float, default=None, help="orbit radius (default (near + far) / 2)")
    parser.add_argument("--fov", type=float, default=40.0, help="orbit horizontal field of view, degrees")
    parser.add_argument("--size", type=int, default=None, help="longer side in pixels (orbit default 400)")
    parser.add_argument("--fps", type=float, default=30.0)
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/renders/path_<name>)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--chunk", type=int, default=None, help="rays per chunk (default 65536; CUDA: >= 262144)")
    args = parser.parse_args(argv)
    try:
        if args.frames < 1 or (args.size is not None and args.size < 8):
            raise PathError(f"--frames must be >= 1 and --size >= 8, got {args.frames} and {args.size}")
        model, state = load_run(args.run_dir, fast_ops())
        model = model.to(resolve_device(args.device)).eval()
        name = args.path if args.path in ("orbit", "eval") else Path(args.path).stem
        if args.path == "orbit":
            centre = model.bbox.mean(0).cpu().double().numpy()
            radius = args.radius if args.radius is not None else 0.5 * (model.near + model.far)
            path = (*orbit_path(centre, radius, args.elevation, args.frames, args.fov, args.size or 400), None)
        elif args.path == "eval":
            path = eval_path(dict(state["config"]["data"]), args.size or 400)
        else:
            path = (*file_path(Path(args.path), args.size), None)
        out = Path(args.out) if args.out else Path(args.run_dir) / "renders" / f"path_{name}"
        if out.exists() and any(out.iterdir()):
            raise PathError(f"--out: {out} is not empty (choose another folder; nothing is overwritten)")
        c2w, intrinsics, shape, lens = path  # lens: the eval cameras' distortion, else None (pinhole)
        if model.upsample > 1 and (shape[0] % model.upsample or shape[1] % model.upsample):
            raise PathError(
                f"--size: {shape[0]}x{shape[1]} is not divisible by the model's upsample ({model.upsample})"
            )
        frames = render_frames(model, c2w, intrinsics, shape, args.chunk, lens)
        video = write_turntable(frames, out / "video.mp4", fps=args.fps)
        fov_x = 2 * math.atan(0.5 * shape[1] / float(intrinsics[0][0]))
        cameras = {"camera_angle_x": fov_x, "w": shape[1], "h": shape[0]}
        cameras["frames"] = [{"transform_matrix": c.tolist()} for c in c2w.astype(float)]
        (out / "cameras.json").write_text(json.dumps(cameras, indent=1))
    except (ExportError, PathError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {video} ({len(frames)} frames, {shape[1]}x{shape[0]} RGB | depth) and {out / 'cameras.json'}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
