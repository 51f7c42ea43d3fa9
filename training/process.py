"""Pose your own photos or video: ``python3 -m training.process INPUT OUTPUT`` (``pip install -e ".[process]"``).

INPUT is a folder of photos or a video file. OUTPUT becomes a capture folder that trains as it is
(``python3 train.py +experiment=capture data.root=OUTPUT``), laid out as nerfstudio's ``ns-process-data`` lays it:

- ``images/``: the photos (turned upright by their EXIF orientation, else copied as they are), or the video's frames:
  ``--frames`` of them spread evenly over the video, each the sharpest of its stretch (variance of the Laplacian);
- ``transforms.json``: nerfstudio's format (camera_model, fl_x fl_y cx cy w h, k1 k2 p1 p2, frames,
  ``applied_transform``), written from the model by data/colmap.py, the same reader ``data=colmap`` uses;
- ``sparse_pc.ply``: the sparse points (the loader places the scene box on them); ``colmap/sparse/0``: the model;
- ``images_2``, ``images_4``, ...: reduced copies with ``--downscales 2 4``.

Structure from motion is COLMAP's, through pycolmap: SIFT features, exhaustive matching for photo sets of up to
``EXHAUSTIVE_LIMIT`` images, else (and for videos) sequential matching of each frame with its neighbours; then
incremental mapping (``--mapper global``: COLMAP's global mapper, GLOMAP). One OPENCV camera is shared by the images
of each size (a phone's portrait and landscape shots get one each); ``--camera per-image`` gives every image its own.
The largest reconstruction is kept; frames it could not register are named. Everything is built in a folder beside
OUTPUT and moved into place at the end, so a failed or interrupted run leaves no half-written capture.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from data.colmap import NERFSTUDIO_KEYS, read_model, transforms_from_model, turned_points, write_points_ply

INSTALL = 'python3 -m pip install --no-build-isolation -e ".[process]"'
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png"}
VIDEO_SUFFIXES = {".mp4", ".mov", ".m4v", ".avi", ".mkv", ".webm"}
EXHAUSTIVE_LIMIT = 120  # exhaustive matching of n images costs n^2 / 2 pairs: 120 images, 7140 pairs
CANDIDATES_PER_FRAME = 4  # video frames scored for sharpness in each kept frame's stretch
HELP_FEW_REGISTERED = (
    "what usually helps: more overlap between neighbouring shots (move less between them), less motion blur "
    "(slower moves, more light), a fixed focus and exposure, and a textured, static scene"
)


class ProcessError(RuntimeError):
    """The capture cannot be posed; the message says why and what to change."""


def _pycolmap():
    try:
        import pycolmap
    except ImportError:
        raise ProcessError(f"pycolmap is not installed: {INSTALL}") from None
    return pycolmap


@contextmanager
def _progress(database: Path, table: str, label: str, total: int | None, log, every: float = 5.0) -> Iterator[None]:
    """Print how many rows of ``table`` COLMAP has written to ``database`` so far, every ``every`` seconds, while
    the block runs (COLMAP's own log is per image and per pair; this is one line for the stage)."""
    stop = threading.Event()

    def watch() -> None:
        last = -1
        while not stop.wait(every):
            try:
                with closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=1.0)) as connection:
                    (count,) = connection.execute(f"SELECT COUNT(*) FROM {table}").fetchone()
            except sqlite3.Error:  # not created yet, or busy: try again at the next tick
                continue
            if count != last:
                log(f"  {label}: {count}" + (f" of {total}" if total else ""))
                last = count

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


# ---------------------------------------------------------------- inputs


def list_images(folder: Path) -> list[Path]:
    """The photos in ``folder`` (not its subfolders), sorted by name."""
    images = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not images:
        raise ProcessError(f"INPUT: no images ({', '.join(sorted(IMAGE_SUFFIXES))}) in {folder}")
    return images


def copy_images(images: list[Path], destination: Path) -> list[str]:
    """Copy ``images`` into ``destination``: byte for byte, or turned upright (and saved again) where their EXIF
    orientation says they are stored turned, since COLMAP and the loader both read the stored pixels."""
    names = []
    for path in images:
        try:
            with Image.open(path) as image:
                orientation = image.getexif().get(0x0112, 1)
                if orientation in (None, 1):
                    shutil.copyfile(path, destination / path.name)
                else:
                    upright = ImageOps.exif_transpose(image)
                    upright.save(destination / path.name, quality=95)
        except OSError as error:
            raise ProcessError(f"INPUT: cannot read image {path} ({error})") from None
        names.append(path.name)
    return names


def sharpness(rgb: np.ndarray) -> float:
    """Variance of the 4-neighbour Laplacian of the grey image (H, W, 3) uint8 (higher: sharper)."""
    grey = rgb[::2, ::2].astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
    laplacian = grey[1:-1, :-2] + grey[1:-1, 2:] + grey[:-2, 1:-1] + grey[2:, 1:-1] - 4.0 * grey[1:-1, 1:-1]
    return float(laplacian.var())


def video_frames(video: Path, destination: Path, count: int, log=print) -> list[str]:
    """Write ``count`` frames of ``video`` as JPEGs: the video cut into ``count`` equal stretches, from each the
    sharpest of up to ``CANDIDATES_PER_FRAME`` evenly spaced frames. Returns the file names in video order."""
    try:
        import imageio_ffmpeg
    except ImportError:
        raise ProcessError(
            'imageio-ffmpeg is not installed: pip install --no-build-isolation -e ".[process]"'
        ) from None
    try:
        total, _ = imageio_ffmpeg.count_frames_and_secs(str(video))
        reader = imageio_ffmpeg.read_frames(str(video))
        meta = next(reader)
    except (OSError, RuntimeError, StopIteration) as error:
        raise ProcessError(f"INPUT: cannot read video {video} ({' '.join(str(error).split())[:300]})") from None
    if total < 1:
        raise ProcessError(f"INPUT: video {video} has no frames")
    count = min(count, total)
    width, height = meta["size"]
    # frame index -> the stretch it belongs to, for the candidates only
    candidates = {}
    for stretch in range(count):
        start, end = stretch * total // count, max(stretch * total // count + 1, (stretch + 1) * total // count)
        for index in np.linspace(start, end - 1, min(CANDIDATES_PER_FRAME, end - start)).round().astype(int):
            candidates[int(index)] = stretch
    best: dict[int, tuple[float, int, np.ndarray]] = {}
    for index, raw in enumerate(reader):
        if index not in candidates:
            continue
        rgb = np.frombuffer(raw, np.uint8).reshape(height, width, 3)
        score, stretch = sharpness(rgb), candidates[index]
        if stretch not in best or score > best[stretch][0]:
            best[stretch] = (score, index, rgb.copy())
    names = []
    for stretch in sorted(best):
        _, index, rgb = best[stretch]
        name = f"frame_{len(names) + 1:05d}.jpg"
        Image.fromarray(rgb).save(destination / name, quality=95)
        names.append(name)
    if not names:
        raise ProcessError(f"INPUT: no frame of {video} could be decoded")
    return names


# ---------------------------------------------------------------- structure from motion


def _sizes(folder: Path, names: list[str]) -> dict[tuple[int, int], list[str]]:
    groups: dict[tuple[int, int], list[str]] = {}
    for name in names:
        with Image.open(folder / name) as image:
            groups.setdefault(image.size, []).append(name)
    return groups


def extract(database: Path, images: Path, names: list[str], per_image: bool, max_size: int, model: str) -> None:
    """SIFT features of ``names`` into ``database``: one camera per image size (COLMAP's SINGLE mode per size
    group), or one per image."""
    pycolmap = _pycolmap()
    reader = pycolmap.ImageReaderOptions()
    reader.camera_model = model
    extraction = pycolmap.FeatureExtractionOptions()
    extraction.max_image_size = max_size
    mode = pycolmap.CameraMode.PER_IMAGE if per_image else pycolmap.CameraMode.SINGLE
    groups = [names] if per_image else list(_sizes(images, names).values())
    for group in groups:
        pycolmap.extract_features(
            database,
            images,
            image_names=group,
            camera_mode=mode,
            reader_options=reader,
            extraction_options=extraction,
            device=pycolmap.Device.cpu,
        )


def match(database: Path, matcher: str) -> None:
    """Exhaustive or sequential matching (each frame with its 10 neighbours and 2^k-th ones; without loop detection,
    which needs a vocabulary tree file COLMAP downloads)."""
    pycolmap = _pycolmap()
    if matcher == "exhaustive":
        pycolmap.match_exhaustive(database, device=pycolmap.Device.cpu)
    else:
        pairing = pycolmap.SequentialPairingOptions()
        pairing.overlap, pairing.quadratic_overlap = 10, True
        pycolmap.match_sequential(database, pairing_options=pairing, device=pycolmap.Device.cpu)


def reconstruct(database: Path, images: Path, output: Path, mapper: str, log=print):
    """The largest reconstruction of the matched images (incremental or global mapping), or None."""
    pycolmap = _pycolmap()
    output.mkdir(parents=True, exist_ok=True)
    if mapper == "global":
        models = pycolmap.global_mapping(database, images, output)
    else:
        registered = [0]

        def next_image() -> None:
            registered[0] += 1
            if registered[0] % 10 == 0:
                log(f"  mapping: {registered[0]} images registered")

        models = pycolmap.incremental_mapping(database, images, output, next_image_callback=next_image)
    if not models:
        return None
    return max(models.values(), key=lambda model: model.num_reg_images())


# ---------------------------------------------------------------- outputs


def write_downscaled(root: Path, names: list[str], factors: list[int]) -> None:
    """``images_<f>/`` copies reduced by each factor (area filter), as ns-process-data writes them."""
    for factor in factors:
        folder = root / f"images_{factor}"
        folder.mkdir()
        for name in names:
            with Image.open(root / "images" / name) as image:
                size = (max(1, image.width // factor), max(1, image.height // factor))
                image.convert("RGB").resize(size, Image.Resampling.BOX).save(folder / name, quality=95)


def write_capture(root: Path, reconstruction) -> dict:
    """The model under ``colmap/sparse/0``, its points as ``sparse_pc.ply`` and ``transforms.json``; returns the
    transforms dict."""
    sparse = root / "colmap" / "sparse" / "0"
    sparse.mkdir(parents=True)
    reconstruction.write(sparse)
    model = read_model(sparse)
    meta = transforms_from_model(model, "images")
    write_points_ply(root / "sparse_pc.ply", turned_points(model.points), model.colors)
    meta["ply_file_path"] = "sparse_pc.ply"
    (root / "transforms.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


@contextmanager
def _stage(name: str, times: dict, log) -> Iterator[None]:
    log(f"[{name}]")
    start = time.perf_counter()
    yield
    times[name] = time.perf_counter() - start
    log(f"  {name}: {times[name]:.1f} s")


def _check_output(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise ProcessError(f"OUTPUT: {output} exists and is not a folder")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        what = "a capture" if (output / "transforms.json").exists() else "files"
        raise ProcessError(f"OUTPUT: {output} already holds {what}; pass --overwrite to replace it")


def process(
    source: str | os.PathLike,
    output: str | os.PathLike,
    frames: int = 150,
    matcher: str = "auto",
    mapper: str = "incremental",
    per_image: bool = False,
    camera_model: str = "OPENCV",
    max_image_size: int = 1600,
    downscales: tuple[int, ...] = (),
    min_registered: float = 0.5,
    overwrite: bool = False,
    verbose: bool = False,
    log=print,
) -> dict:
    """Pose ``source`` (a folder of photos or a video) into the capture folder ``output`` (see the module's
    docstring). Returns a summary: registered, total, unregistered names, reprojection error, seconds per stage."""
    source, output = Path(source).expanduser(), Path(output).expanduser()
    if not source.exists():
        raise ProcessError(f"INPUT: {source} does not exist")
    if source.is_file() and source.suffix.lower() not in VIDEO_SUFFIXES:
        raise ProcessError(f"INPUT: {source} is neither a folder of images nor a video ({', '.join(VIDEO_SUFFIXES)})")
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 3:
        raise ProcessError(f"--frames must be an integer >= 3, got {frames!r}")
    if matcher not in ("auto", "exhaustive", "sequential"):
        raise ProcessError(f"--matcher must be auto, exhaustive or sequential, got {matcher!r}")
    if mapper not in ("incremental", "global"):
        raise ProcessError(f"--mapper must be incremental or global, got {mapper!r}")
    if camera_model not in NERFSTUDIO_KEYS:  # the models the loader turns into rays; checked before any work
        raise ProcessError(f"--camera-model must be one of {', '.join(NERFSTUDIO_KEYS)}, got {camera_model!r}")
    if not 0.0 <= min_registered <= 1.0:
        raise ProcessError(f"--min-registered must be a fraction in [0, 1], got {min_registered!r}")
    if any(isinstance(f, bool) or not isinstance(f, int) or f < 2 for f in downscales):
        raise ProcessError(f"--downscales must be integers >= 2, got {list(downscales)!r}")
    _check_output(output, overwrite)
    _pycolmap().logging.minloglevel = 0 if verbose else 1  # COLMAP's log: warnings and errors only, unless verbose
    output.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    times: dict[str, float] = {}
    try:
        images = work / "images"
        images.mkdir()
        video = source.is_file()
        with _stage("frames" if video else "images", times, log):
            if video:
                names = video_frames(source, images, frames, log)
            else:
                names = copy_images(list_images(source), images)
            log(f"  {len(names)} {'frames' if video else 'images'} in {images.name}/")
        if len(names) < 3:
            raise ProcessError(f"INPUT: {len(names)} image(s); posing needs at least 3 (better 30 or more)")
        database = work / "colmap" / "database.db"
        database.parent.mkdir()
        with _stage("features", times, log), _progress(database, "keypoints", "images", len(names), log):
            extract(database, images, names, per_image, max_image_size, camera_model)
        chosen = (
            matcher if matcher != "auto" else ("sequential" if video or len(names) > EXHAUSTIVE_LIMIT else "exhaustive")
        )
        pairs = len(names) * (len(names) - 1) // 2 if chosen == "exhaustive" else None
        with _stage(f"matches ({chosen})", times, log), _progress(database, "matches", "pairs", pairs, log):
            match(database, chosen)
        with _stage(f"mapping ({mapper})", times, log):
            reconstruction = reconstruct(database, images, work / "colmap" / "models", mapper, log)
        registered = 0 if reconstruction is None else reconstruction.num_reg_images()
        needed = max(3, math.ceil(min_registered * len(names)))
        if registered < needed:
            raise ProcessError(
                f"only {registered} of {len(names)} frames could be posed ({needed} needed, --min-registered "
                f"{min_registered}); {HELP_FEW_REGISTERED}"
            )
        with _stage("write", times, log):
            shutil.rmtree(work / "colmap" / "models")
            database.unlink()
            meta = write_capture(work, reconstruction)
            if downscales:
                write_downscaled(work, names, sorted(set(downscales)))
        posed = {Path(frame["file_path"]).name for frame in meta["frames"]}
        summary = {
            "registered": registered,
            "total": len(names),
            "unregistered": [name for name in names if name not in posed],
            "reprojection_error_px": float(reconstruction.compute_mean_reprojection_error()),
            "points": int(reconstruction.num_points3D()),
            "matcher": chosen,
            "mapper": mapper,
            "seconds": times,
        }
        (work / "process.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        if output.exists():
            shutil.rmtree(output)
        os.replace(work, output)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m training.process",
        description="Pose a folder of photos or a video with COLMAP (pycolmap) into a capture folder that trains "
        "as it is: python3 train.py +experiment=capture data.root=OUTPUT",
    )
    parser.add_argument("input", metavar="INPUT", help="a folder of photos (jpg, png) or a video file")
    parser.add_argument("output", metavar="OUTPUT", help="the capture folder to write (must be empty or absent)")
    parser.add_argument("--frames", type=int, default=150, help="video: how many frames to keep (default 150)")
    parser.add_argument(
        "--matcher",
        choices=("auto", "exhaustive", "sequential"),
        default="auto",
        help=f"auto: exhaustive up to {EXHAUSTIVE_LIMIT} photos, else and for videos sequential",
    )
    parser.add_argument("--mapper", choices=("incremental", "global"), default="incremental", help="COLMAP's mapper")
    parser.add_argument(
        "--camera",
        choices=("shared", "per-image"),
        default="shared",
        help="shared: one camera for the images of each size (one phone); per-image: one camera per image",
    )
    parser.add_argument(
        "--camera-model", default="OPENCV", choices=tuple(NERFSTUDIO_KEYS), help="COLMAP camera model (default OPENCV)"
    )
    parser.add_argument("--max-image-size", type=int, default=1600, help="SIFT on images reduced to this side")
    parser.add_argument("--downscales", type=int, nargs="*", default=[], help="also write images_F/ copies (e.g. 2 4)")
    parser.add_argument(
        "--min-registered", type=float, default=0.5, help="fail below this fraction of frames posed (default 0.5)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an OUTPUT that already holds files")
    parser.add_argument("--verbose", action="store_true", help="show COLMAP's own log (per image and pair)")
    args = parser.parse_args(argv)
    try:
        summary = process(
            args.input,
            args.output,
            frames=args.frames,
            matcher=args.matcher,
            mapper=args.mapper,
            per_image=args.camera == "per-image",
            camera_model=args.camera_model,
            max_image_size=args.max_image_size,
            downscales=tuple(args.downscales),
            min_registered=args.min_registered,
            overwrite=args.overwrite,
            verbose=args.verbose,
        )
    except ProcessError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    total = sum(summary["seconds"].values())
    print(
        f"posed {summary['registered']} of {summary['total']} frames, {summary['points']} points, mean reprojection "
        f"error {summary['reprojection_error_px']:.2f} px, {total:.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in summary['seconds'].items())})"
    )
    if summary["unregistered"]:
        listed = ", ".join(summary["unregistered"][:10]) + (" ..." if len(summary["unregistered"]) > 10 else "")
        print(f"not posed ({len(summary['unregistered'])}, left out of transforms.json): {listed}")
    print(f"next: python3 train.py +experiment=capture data.root={args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
