"""Render a finished run along a camera path, into its own folder:

    python -m training.render_path RUN_DIR [--path orbit|interpolate|spiral|eval|FILE.json] [--frames 120]
        [--loop] [--rotations 2] [--elevation 30] [--radius R] [--fov 40] [--size 400] [--fps 30] [--out DIR]
        [--device auto|cpu|cuda]

Paths:
- ``interpolate``: a smooth path through the training cameras in the scene's order (file-name order for a nerfstudio
  capture, the transforms file's for a blender scene), as nerfstudio's ``interpolate``: positions along a
  Catmull-Rom spline through the camera centres, rotations by quaternion squad (slerp with smooth tangents),
  intrinsics linearly, ``--frames`` in all, evenly spaced in the spline's parameter: camera i is at parameter i,
  so with ``--frames (V - 1) * m + 1`` every m-th frame is a training camera exactly. ``--loop`` closes the path
  (back to the first camera; V * m frames). Frames at the training views' size unless ``--size``.
- ``spiral``: LLFF's and nerfstudio's spiral: around the mean training camera, ``--rotations`` turns (default 2)
  over ``--frames``, radii the 90th percentile of the cameras' offsets from their mean along its axes (``--radius``:
  one radius instead), the depth axis at half the rate, every frame looking at the cameras' focus point (the grids'
  box centre when their axes do not meet in front of them).
- ``orbit`` (default): ``--frames`` cameras on a circle around the grids' box centre (z up) at ``--elevation``
  degrees and ``--radius`` (default: halfway between the scene's near and far, 4 on NeRF-synthetic scenes),
  ``--fov`` degrees of horizontal field of view, square ``--size`` x ``--size`` frames.
- ``eval``: the run's evaluation cameras with their own intrinsics (the scene must still be where the run found
  it), scaled so the longer side is ``--size``.
- a JSON file: nerfstudio's camera path (``camera_path: [{camera_to_world: 16 numbers, row-major, fov: vertical
  degrees}]``, ``render_width``, ``render_height``; the viewer's record panel writes one), or transforms-style
  ``frames: [{transform_matrix: 4x4}]`` with ``camera_angle_x`` and optional ``w``, ``h`` (default 400 square; a
  blender ``transforms_*.json`` works) or nerfstudio's ``fl_x fl_y cx cy w h`` (top level or per frame: ``export
  cameras`` writes one); ``--size`` rescales either. Cameras are OpenGL (looking down -z, y up), in the run's frame,
  unless the file says ``"frame": "original"`` (``export cameras``): the capture's own, mapped by data.orient.

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
from tqdm import tqdm

from data.bounds import focus_point
from data.cameras import look_at, orbit_positions
from training import inference
from training.evaluation import rgb_depth_frame
from training.finished_run import RunReadError, fast_ops, load_run, load_split, run_transform
from training.scenes import load_scenes, resolve_device
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


def file_path(path: Path, size: int | None, to_run=None):
    """Cameras, intrinsics and (height, width) from a nerfstudio camera path or a transforms-style JSON;
    ``to_run()``: the similarity into the run's frame, for a file whose ``frame`` is ``original``."""
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise PathError(f"--path: cannot read {path} ({' '.join(str(error).split())})") from None
    try:
        if "camera_path" in content:  # nerfstudio: vertical fov per camera, row-major 4x4
            height, width = int(content["render_height"]), int(content["render_width"])
            c2w = np.array([np.reshape(c["camera_to_world"], (4, 4)) for c in content["camera_path"]], np.float64)
            focal = np.array([0.5 * height / math.tan(0.5 * math.radians(c["fov"])) for c in content["camera_path"]])
            intrinsics = np.stack([focal, focal, np.full_like(focal, width / 2), np.full_like(focal, height / 2)], -1)
        elif "fl_x" in content or (content["frames"] and "fl_x" in content["frames"][0]):  # nerfstudio transforms
            frames = content["frames"]
            value = lambda frame, key: float(content[key] if key in content else frame[key])  # noqa: E731
            width, height = int(value(frames[0], "w")), int(value(frames[0], "h"))
            c2w = np.array([f["transform_matrix"] for f in frames], np.float64)
            keys = ("fl_x", "fl_y", "cx", "cy")
            intrinsics = np.array(
                [
                    [value(f, k) if k != "fl_y" or "fl_y" in f or "fl_y" in content else value(f, "fl_x") for k in keys]
                    for f in frames
                ]
            )
        else:  # transforms style: horizontal fov; our cameras.json adds the frame size as w, h
            width, height = int(content.get("w", 400)), int(content.get("h", content.get("w", 400)))
            c2w = np.array([f["transform_matrix"] for f in content["frames"]], np.float64)
            focal = np.full(len(c2w), 0.5 * width / math.tan(0.5 * float(content["camera_angle_x"])))
            intrinsics = np.stack([focal, focal, np.full_like(focal, width / 2), np.full_like(focal, height / 2)], -1)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise PathError(
            f"--path: {path} is neither a nerfstudio camera path nor transforms-style ({error!r})"
        ) from None
    if c2w.ndim != 3 or c2w.shape[1:] != (4, 4) or len(c2w) == 0:
        raise PathError(f"--path: {path} holds no 4x4 cameras")
    if content.get("frame", "model") == "original" and to_run is not None:
        c2w = to_run().poses(c2w)
    if size is not None:
        scale = size / max(height, width)
        height, width, intrinsics = round(height * scale), round(width * scale), intrinsics * scale
    return c2w.astype(np.float32), intrinsics, (height, width)


# ---------------------------------------------------------------------------------------------- smooth paths
def matrix_to_quaternion(rotation: np.ndarray) -> np.ndarray:
    """(..., 3, 3) rotations -> (..., 4) unit quaternions (w, x, y, z), w >= 0."""
    m = np.asarray(rotation, np.float64)
    w = np.sqrt(np.maximum(0.0, 1.0 + m[..., 0, 0] + m[..., 1, 1] + m[..., 2, 2])) / 2
    x = np.sqrt(np.maximum(0.0, 1.0 + m[..., 0, 0] - m[..., 1, 1] - m[..., 2, 2])) / 2
    y = np.sqrt(np.maximum(0.0, 1.0 - m[..., 0, 0] + m[..., 1, 1] - m[..., 2, 2])) / 2
    z = np.sqrt(np.maximum(0.0, 1.0 - m[..., 0, 0] - m[..., 1, 1] + m[..., 2, 2])) / 2
    x = np.copysign(x, m[..., 2, 1] - m[..., 1, 2])
    y = np.copysign(y, m[..., 0, 2] - m[..., 2, 0])
    z = np.copysign(z, m[..., 1, 0] - m[..., 0, 1])
    q = np.stack([w, x, y, z], -1)
    return q / np.linalg.norm(q, axis=-1, keepdims=True)


def quaternion_to_matrix(q: np.ndarray) -> np.ndarray:
    """(..., 4) quaternions (w, x, y, z) -> (..., 3, 3) rotations (normalised first)."""
    w, x, y, z = np.moveaxis(q / np.linalg.norm(q, axis=-1, keepdims=True), -1, 0)
    rows = [
        [1 - 2 * (y * y + z * z), 2 * (x * y - w * z), 2 * (x * z + w * y)],
        [2 * (x * y + w * z), 1 - 2 * (x * x + z * z), 2 * (y * z - w * x)],
        [2 * (x * z - w * y), 2 * (y * z + w * x), 1 - 2 * (x * x + y * y)],
    ]
    return np.stack([np.stack(row, -1) for row in rows], -2)


def _multiply(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    aw, ax, ay, az = np.moveaxis(a, -1, 0)
    bw, bx, by, bz = np.moveaxis(b, -1, 0)
    return np.stack(
        [
            aw * bw - ax * bx - ay * by - az * bz,
            aw * bx + ax * bw + ay * bz - az * by,
            aw * by - ax * bz + ay * bw + az * bx,
            aw * bz + ax * by - ay * bx + az * bw,
        ],
        -1,
    )


def _conjugate(q: np.ndarray) -> np.ndarray:
    return q * np.array([1.0, -1.0, -1.0, -1.0])


def _log(q: np.ndarray) -> np.ndarray:
    """Unit quaternion -> (..., 3) half-angle axis vector."""
    vector = q[..., 1:]
    norm = np.linalg.norm(vector, axis=-1, keepdims=True)
    angle = np.arctan2(norm, q[..., :1])
    return np.where(norm > 1e-12, vector / np.maximum(norm, 1e-300) * angle, vector)


def _exp(v: np.ndarray) -> np.ndarray:
    angle = np.linalg.norm(v, axis=-1, keepdims=True)
    scale = np.where(angle > 1e-12, np.sin(angle) / np.maximum(angle, 1e-300), 1.0)
    return np.concatenate([np.cos(angle), v * scale], -1)


def slerp(a: np.ndarray, b: np.ndarray, t) -> np.ndarray:
    """Spherical linear interpolation of unit quaternions (the shorter arc), ``t`` broadcasting."""
    b = np.where((a * b).sum(-1, keepdims=True) < 0, -b, b)
    t = np.asarray(t, np.float64)[..., None]
    return _multiply(a, _exp(_log(_multiply(_conjugate(a), b)) * t))


def _continuous(q: np.ndarray) -> np.ndarray:
    """Quaternions with signs flipped so consecutive ones lie on the same hemisphere."""
    q = q.copy()
    for i in range(1, len(q)):
        if np.dot(q[i - 1], q[i]) < 0:
            q[i] = -q[i]
    return q


def interpolate_path(c2w: np.ndarray, intrinsics: np.ndarray, frames: int, loop: bool = False):
    """(frames, 4, 4) cameras and (frames, 4) intrinsics through the (V, 4, 4) ``c2w`` in order: position on a
    uniform Catmull-Rom spline, rotation by squad, intrinsics linearly; frame k at spline parameter k (V - 1) /
    (frames - 1) (``loop``: k V / frames, the path closed), so camera i sits at parameter i."""
    c2w, intrinsics = np.asarray(c2w, np.float64), np.asarray(intrinsics, np.float64)
    count = len(c2w)
    if count < 2:
        raise PathError(f"--path interpolate: needs at least 2 training cameras, the run's scene has {count}")
    positions, quaternions = c2w[:, :3, 3], _continuous(matrix_to_quaternion(c2w[:, :3, :3]))
    if loop:
        u = np.arange(frames) * count / frames
        pick = lambda i: i % count  # noqa: E731  (the closing segment: the sign checks below take the short arc)
    else:
        u = np.linspace(0.0, count - 1, frames) if frames > 1 else np.zeros(1)
        pick = lambda i: np.clip(i, 0, count - 1)  # noqa: E731

    def point(i):  # the spline's control points; past the ends, reflections of the neighbours (natural ends)
        if loop or 0 <= i < count:
            return positions[pick(i)]
        return 2 * positions[pick(i + (1 if i < 0 else -1))] - positions[pick(i + (2 if i < 0 else -2))]

    def quaternion(i):
        return quaternions[pick(i)]

    def tangent(i):  # squad's inner control quaternion at key i
        if not loop and (i <= 0 or i >= count - 1):
            return quaternion(i)
        q, before, after = quaternion(i), quaternion(i - 1), quaternion(i + 1)
        before = np.where(np.dot(q, before) < 0, -before, before)
        after = np.where(np.dot(q, after) < 0, -after, after)
        inverse = _conjugate(q)
        return _multiply(q, _exp(-(_log(_multiply(inverse, after)) + _log(_multiply(inverse, before))) / 4))

    out_c2w = np.tile(np.eye(4), (frames, 1, 1))
    out_k = np.empty((frames, 4))
    for k, value in enumerate(u):
        i = min(int(np.floor(value)), count - 1 if loop else count - 2)
        t = value - i
        p0, p1, p2, p3 = point(i - 1), point(i), point(i + 1), point(i + 2)
        out_c2w[k, :3, 3] = 0.5 * (
            2 * p1 + (p2 - p0) * t + (2 * p0 - 5 * p1 + 4 * p2 - p3) * t**2 + (3 * p1 - p0 - 3 * p2 + p3) * t**3
        )
        q1, q2 = quaternion(i), quaternion(i + 1)
        q2 = np.where(np.dot(q1, q2) < 0, -q2, q2)
        s1, s2 = tangent(i), tangent(i + 1)
        s2 = np.where(np.dot(q2, s2) < 0, -s2, s2)
        q = slerp(slerp(q1, q2, t), slerp(s1, s2, t), 2 * t * (1 - t))
        out_c2w[k, :3, :3] = quaternion_to_matrix(q)
        out_k[k] = (1 - t) * intrinsics[pick(i)] + t * intrinsics[pick(i + 1)]
    return out_c2w, out_k


def spiral_path(
    c2w: np.ndarray, frames: int, rotations: float = 2.0, radius: float | None = None, centre=None, zrate: float = 0.5
) -> np.ndarray:
    """(frames, 4, 4) cameras on LLFF's spiral around the mean of the (V, 4, 4) ``c2w`` (module doc), looking at
    their focus point (``centre`` when they have none)."""
    c2w = np.asarray(c2w, np.float64)
    mean = c2w[:, :3, 3].mean(0)
    backward = c2w[:, :3, 2].mean(0)
    up = c2w[:, :3, 1].mean(0)
    if np.linalg.norm(backward) < 1e-6 or np.linalg.norm(up) < 1e-6:
        raise PathError("--path spiral: the training cameras face every way (use --path orbit or interpolate)")
    backward /= np.linalg.norm(backward)
    right = np.cross(up, backward)
    right /= np.linalg.norm(right)
    up = np.cross(backward, right)
    axes = np.stack([right, up, backward], 1)
    offsets = np.abs((c2w[:, :3, 3] - mean) @ axes)
    radii = np.full(3, float(radius)) if radius is not None else np.percentile(offsets, 90, axis=0)
    target = focus_point(c2w)
    if target is None:
        target = np.asarray(centre, np.float64) if centre is not None else mean - backward
    angles = np.linspace(0.0, 2 * np.pi * rotations, frames, endpoint=False)
    local = np.stack([np.cos(angles) * radii[0], -np.sin(angles) * radii[1], -np.sin(angles * zrate) * radii[2]], -1)
    positions = mean + local @ axes.T
    return look_at(positions, target=tuple(target.tolist()), up=tuple(up.tolist()))


def training_path(state: dict, model, kind: str, frames: int, size: int | None, args) -> tuple:
    """``interpolate`` or ``spiral`` through the run's training cameras: (c2w, intrinsics, (H, W))."""
    from data import SceneError

    try:
        scene = load_split(dict(state["config"]["data"]), "train", multiple=model.upsample)
    except (SceneError, RunReadError) as error:
        raise PathError(
            f"--path {kind}: cannot load the run's training cameras ({' '.join(str(error).split())})"
        ) from None
    c2w, intrinsics = scene.c2w.double().numpy(), scene.intrinsics.double().numpy()
    shape = (scene.height, scene.width)
    if kind == "interpolate":
        c2w, intrinsics = interpolate_path(c2w, intrinsics, frames, args.loop)
    else:
        centre = model.bbox.mean(0).cpu().double().numpy()
        c2w = spiral_path(c2w, frames, args.rotations, args.radius, centre)
        intrinsics = np.repeat(intrinsics.mean(0, keepdims=True), frames, 0)
    if size is not None:
        scale = size / max(shape)
        shape, intrinsics = (round(shape[0] * scale), round(shape[1] * scale)), intrinsics * scale
    return c2w.astype(np.float32), intrinsics, shape


def eval_path(data_cfg: dict, size: int):
    """The run's evaluation cameras, intrinsics (scaled so the longer side is ``size``) and lens (distortion is
    scale-free), as the run saw them."""
    if data_cfg.get("name") == "nerfstudio":  # colmap runs are newer than data.orient
        data_cfg.setdefault("orient", "none")  # a run from before data.orient used the poses as given
    try:
        _, scene = load_scenes(OmegaConf.create(data_cfg), torch.device("cpu"))
    except Exception as error:  # a moved or deleted scene: say so in one line
        raise PathError(f"--path eval: cannot load the run's scene ({' '.join(str(error).split())})") from None
    scale = size / max(scene.height, scene.width)
    shape = (round(scene.height * scale), round(scene.width * scale))
    return scene.c2w.numpy(), scene.intrinsics.double().numpy() * scale, shape, scene.lens


def render_frames(
    model,
    c2w: np.ndarray,
    intrinsics: np.ndarray,
    shape: tuple[int, int],
    chunk: int | None = None,
    lens=None,
    progress: bool = False,
) -> list:
    """(H, 2W, 3) uint8 frames: RGB | depth over [near, far] (training.inference: the shared inference path, the
    frames assembled by worker threads while the next renders); ``lens``: None or the cameras' (V, 6) distortion."""
    lens_of = None if lens is None else (lambda index: lens.take(torch.tensor(index)))
    frame = partial(rgb_depth_frame, near=model.near, far=model.far)
    cameras = tqdm(c2w, desc="render", unit="frame", disable=not progress)
    return inference.render_frames(model, cameras, intrinsics, shape, frame, chunk, lens_of)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="voxel-field-render", description="Render a finished run along a camera path (RGB | depth video)."
    )
    parser.add_argument("run_dir", help="the run folder (holds model.pt)")
    parser.add_argument(
        "--path", default="orbit", help="orbit | interpolate | spiral | eval | a camera-path JSON file (default orbit)"
    )
    parser.add_argument("--frames", type=int, default=120, help="frames of an orbit, interpolate or spiral (120)")
    parser.add_argument("--loop", action="store_true", help="interpolate: close the path back to the first camera")
    parser.add_argument("--rotations", type=float, default=2.0, help="spiral: turns over the path (2)")
    parser.add_argument("--elevation", type=float, default=30.0, help="orbit elevation, degrees")
    parser.add_argument(
        "--radius", type=float, default=None, help="orbit radius (default (near + far) / 2); spiral: one radius"
    )
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
        name = args.path if args.path in ("orbit", "eval", "interpolate", "spiral") else Path(args.path).stem
        if args.path in ("interpolate", "spiral"):
            path = (*training_path(state, model, args.path, args.frames, args.size, args), None)
        elif args.path == "orbit":
            centre = model.bbox.mean(0).cpu().double().numpy()
            radius = args.radius if args.radius is not None else 0.5 * (model.near + model.far)
            path = (*orbit_path(centre, radius, args.elevation, args.frames, args.fov, args.size or 400), None)
        elif args.path == "eval":
            path = eval_path(dict(state["config"]["data"]), args.size or 400)
        else:
            why = "--path: the file's cameras are in the capture's own frame, but the capture cannot be read"
            path = (*file_path(Path(args.path), args.size, partial(run_transform, state, why)), None)
        out = Path(args.out) if args.out else Path(args.run_dir) / "renders" / f"path_{name}"
        if out.exists() and any(out.iterdir()):
            raise PathError(f"--out: {out} is not empty (choose another folder; nothing is overwritten)")
        c2w, intrinsics, shape, lens = path  # lens: the eval cameras' distortion, else None (pinhole)
        if model.upsample > 1 and (shape[0] % model.upsample or shape[1] % model.upsample):
            raise PathError(
                f"--size: {shape[0]}x{shape[1]} is not divisible by the model's upsample ({model.upsample})"
            )
        frames = render_frames(model, c2w, intrinsics, shape, args.chunk, lens, progress=True)
        video = write_turntable(frames, out / "video.mp4", fps=args.fps)
        fov_x = 2 * math.atan(0.5 * shape[1] / float(intrinsics[0][0]))
        cameras = {"camera_angle_x": fov_x, "w": shape[1], "h": shape[0]}
        cameras["frames"] = [{"transform_matrix": c.tolist()} for c in c2w.astype(float)]
        (out / "cameras.json").write_text(json.dumps(cameras, indent=1))
    except (RunReadError, PathError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    print(f"wrote {video} ({len(frames)} frames, {shape[1]}x{shape[0]} RGB | depth) and {out / 'cameras.json'}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
