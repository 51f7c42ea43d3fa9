"""``python3 -m training.process`` (photos or a video -> a posed capture, through pycolmap) on a scene rendered here
with known cameras: a textured room around a textured cube, rendered by a small ray caster below (the procedural
scene's smooth shading gives SIFT ~100 features an image; this gives thousands). The posed cameras are compared with
the true ones up to a similarity transform; the written capture loads the same through data=nerfstudio and
data=colmap; bad inputs fail clearly and leave nothing behind."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.cameras import look_at, spherical_positions
from data.images import write_png
from data.nerfstudio import load_nerfstudio, read_capture
from training.process import ProcessError, process, sharpness

pytest.importorskip("pycolmap")
REPO = Path(__file__).resolve().parents[1]
SIZE = (180, 240)  # (h, w)
FOCAL = 0.8 * SIZE[1]


def noise_texture(rng, size: int = 256) -> np.ndarray:
    """(size, size) value noise summed over four octaves, contrast stretched: blobs and corners at many scales."""
    texture = np.zeros((size, size))
    for cells in (8, 16, 32, 64):
        grid = rng.uniform(0, 1, (cells + 1, cells + 1))
        position = np.linspace(0, cells, size, endpoint=False)
        i, f = position.astype(int), position - position.astype(int)
        fy, fx = f[:, None], f[None, :]
        corners = grid[i][:, i], grid[i + 1][:, i], grid[i][:, i + 1], grid[i + 1][:, i + 1]
        texture += (
            corners[0] * (1 - fy) * (1 - fx) + corners[1] * fy * (1 - fx) + corners[2] * (1 - fy) * fx
        ) / 4 + corners[3] * fy * fx / 4
    return np.clip((texture - 0.5) * 4 + 0.5, 0, 1)


def render_room(c2w: np.ndarray, size: tuple[int, int], seed: int = 0) -> np.ndarray:
    """(V, 4, 4) OpenGL cameras (focal FOCAL, centred) -> (V, H, W, 3) uint8: the inside of the box [-4, 4]^3 and the
    outside of the cube [-0.5, 0.5]^3, each face its own tinted noise texture (nearest texel)."""
    rng = np.random.default_rng(seed)
    textures = [noise_texture(rng)[..., None] * rng.uniform(0.5, 1.0, 3) for _ in range(12)]
    height, width = size
    v, u = np.meshgrid(np.arange(height) + 0.5, np.arange(width) + 0.5, indexing="ij")
    local = np.stack([(u - width / 2) / FOCAL, -(v - height / 2) / FOCAL, -np.ones_like(u)], -1)
    views = []
    for camera in c2w:
        d, o = local @ camera[:3, :3].T, camera[:3, 3]
        nearest, colour = np.full(u.shape, np.inf), np.zeros((*u.shape, 3))
        for box, half in enumerate((4.0, 0.5)):
            for axis in range(3):
                for side, sign in enumerate((-1.0, 1.0)):
                    with np.errstate(divide="ignore", invalid="ignore"):
                        t = (sign * half - o[axis]) / d[..., axis]
                    p = o + t[..., None] * d
                    a, b = (k for k in range(3) if k != axis)
                    hit = (t > 1e-6) & (t < nearest) & (np.abs(p[..., a]) <= half) & (np.abs(p[..., b]) <= half)
                    texture = textures[box * 6 + axis * 2 + side]
                    cells = texture.shape[0]
                    iu, iv = (np.clip(((p[..., k] / half + 1) / 2 * cells).astype(int), 0, cells - 1) for k in (a, b))
                    colour = np.where(hit[..., None], texture[iu, iv], colour)
                    nearest = np.where(hit, t, nearest)
        views.append(np.clip(colour * 255, 0, 255).astype(np.uint8))
    return np.stack(views)


def room_cameras(count: int) -> np.ndarray:
    """(count, 4, 4) cameras on a 270-degree arc of radius 2.5 around the cube, the elevation waving 5-25 degrees."""
    azimuths = np.linspace(0, 1.5 * math.pi, count)
    return look_at(spherical_positions(2.5, np.radians(15 + 10 * np.sin(3 * azimuths)), azimuths))


def similarity_error(posed: np.ndarray, true: np.ndarray) -> tuple[float, float]:
    """Align ``posed`` (V, 4, 4) camera centres to ``true``'s by a similarity (Umeyama) -> (the largest centre error
    as a fraction of the true rig's size, the largest rotation error in degrees after the alignment's rotation)."""
    x, y = posed[:, :3, 3], true[:, :3, 3]
    mx, my = x.mean(0), y.mean(0)
    u, s, vt = np.linalg.svd((y - my).T @ (x - mx) / len(x))
    flip = np.diag([1.0, 1.0, np.sign(np.linalg.det(u @ vt))])
    rotation = u @ flip @ vt
    scale = np.trace(np.diag(s) @ flip) / ((x - mx) ** 2).sum(1).mean()
    aligned = scale * (x - mx) @ rotation.T + my
    centre = np.linalg.norm(aligned - y, axis=1).max() / np.linalg.norm(y - my, axis=1).max()
    relative = np.einsum("ij,vjk,vlk->vil", rotation, posed[:, :3, :3], true[:, :3, :3])
    angles = np.degrees(np.arccos(np.clip((np.trace(relative, axis1=1, axis2=2) - 1) / 2, -1, 1)))
    return float(centre), float(angles.max())


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> tuple[Path, np.ndarray]:
    folder = tmp_path_factory.mktemp("photos")
    cameras = room_cameras(20)
    for index, image in enumerate(render_room(cameras, SIZE)):
        write_png(folder / f"view_{index:03d}.png", image)
    return folder, cameras


@pytest.fixture(scope="module")
def posed(tmp_path_factory, photos) -> tuple[Path, dict]:
    output = tmp_path_factory.mktemp("posed") / "capture"
    return output, process(photos[0], output, downscales=(2,), log=lambda line: None)


def test_photos_are_posed_up_to_a_similarity(posed, photos):
    output, summary = posed
    assert summary["registered"] == summary["total"] == 20 and summary["unregistered"] == []
    assert summary["reprojection_error_px"] < 1.0 and summary["matcher"] == "exhaustive"
    meta = json.loads((output / "transforms.json").read_text())
    assert meta["camera_model"] == "OPENCV" and (meta["w"], meta["h"]) == (240, 180)
    assert meta["fl_x"] == pytest.approx(FOCAL, rel=0.02) and meta["fl_y"] == pytest.approx(FOCAL, rel=0.02)
    assert len(meta["applied_transform"]) == 3 and meta["ply_file_path"] == "sparse_pc.ply"
    frames = sorted(meta["frames"], key=lambda frame: frame["file_path"])
    assert [f["file_path"] for f in frames] == [f"images/view_{i:03d}.png" for i in range(20)]
    centre, angle = similarity_error(np.array([f["transform_matrix"] for f in frames]), photos[1])
    print(f"posed cameras against the true ones: centres within {centre:.2%} of the rig, rotations {angle:.2f} deg")
    assert centre < 0.02 and angle < 1.0  # a wrong axis convention is off by tens of degrees
    assert sorted(p.name for p in (output / "images_2").iterdir())[0] == "view_000.png"
    assert (output / "colmap" / "sparse" / "0" / "cameras.bin").is_file() and (output / "process.json").is_file()
    assert not any(p.name.startswith(".capture.partial") for p in output.parent.iterdir())


def test_the_capture_loads_alike_as_nerfstudio_and_colmap(posed):
    output, _ = posed
    as_nerfstudio = load_nerfstudio(output)
    as_colmap = load_nerfstudio(output, colmap=True)
    for a, b in zip(as_nerfstudio[:2], as_colmap[:2]):
        assert a.names == b.names
        torch.testing.assert_close(a.c2w, b.c2w)
        torch.testing.assert_close(a.intrinsics, b.intrinsics)
    np.testing.assert_allclose(as_nerfstudio[2].box, as_colmap[2].box, rtol=1e-6)
    assert read_capture(output).ply is not None


def test_a_video_is_sampled_and_posed(tmp_path):
    imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")
    cameras = room_cameras(60)
    writer = imageio_ffmpeg.write_frames(str(tmp_path / "walk.mp4"), (SIZE[1], SIZE[0]), fps=10, quality=8)
    writer.send(None)
    for image in render_room(cameras, SIZE):
        writer.send(np.ascontiguousarray(image))
    writer.close()
    lines = []
    summary = process(tmp_path / "walk.mp4", tmp_path / "capture", frames=20, log=lines.append)
    assert summary["total"] == 20 and summary["registered"] >= 18 and summary["matcher"] == "sequential"
    assert "[frames]" in lines and any("mapping" in line for line in lines)
    names = sorted(p.name for p in (tmp_path / "capture" / "images").iterdir())
    assert names[0] == "frame_00001.jpg" and len(names) == 20


def test_sharpness_prefers_the_sharper_frame():
    rng = np.random.default_rng(0)
    sharp = (rng.uniform(0, 1, (64, 64, 3)) * 255).astype(np.uint8)
    blurred = ((sharp[:-1, :-1].astype(float) + sharp[1:, 1:] + sharp[:-1, 1:] + sharp[1:, :-1]) / 4).astype(np.uint8)
    assert sharpness(sharp) > 2 * sharpness(blurred)


def test_bad_inputs_fail_clearly_and_leave_nothing(tmp_path, photos, posed):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ProcessError, match="INPUT: no images"):
        process(empty, tmp_path / "out", log=lambda line: None)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ProcessError, match="neither a folder of images nor a video"):
        process(tmp_path / "notes.txt", tmp_path / "out", log=lambda line: None)
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    with pytest.raises(ProcessError, match="cannot read video"):
        process(tmp_path / "broken.mp4", tmp_path / "out", log=lambda line: None)
    with pytest.raises(ProcessError, match="already holds a capture; pass --overwrite"):
        process(photos[0], posed[0], log=lambda line: None)
    # three frames that share nothing: too few posed, with what helps; no OUTPUT and no partial folder left
    noise = tmp_path / "noise"
    noise.mkdir()
    rng = np.random.default_rng(1)
    for index in range(3):
        write_png(noise / f"n{index}.png", (rng.uniform(0, 1, (64, 64, 3)) * 255).astype(np.uint8))
    with pytest.raises(ProcessError, match="only 0 of 3 frames could be posed .* more overlap"):
        process(noise, tmp_path / "out", log=lambda line: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.mp4", "empty", "noise", "notes.txt"]
    with pytest.raises(ProcessError, match="--frames must be an integer >= 3"):
        process(photos[0], tmp_path / "out", frames=1, log=lambda line: None)
    with pytest.raises(ProcessError, match="--camera-model must be one of"):
        process(photos[0], tmp_path / "out", camera_model="FULL_OPENCV", log=lambda line: None)


def test_the_command_line(tmp_path, photos):
    help_text = subprocess.run(
        [sys.executable, "-m", "training.process", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert help_text.returncode == 0 and "INPUT" in help_text.stdout and "--frames" in help_text.stdout
    failed = subprocess.run(
        [sys.executable, "-m", "training.process", str(tmp_path / "missing"), str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        failed.returncode == 2
        and failed.stderr.strip().startswith("error: INPUT:")
        and "Traceback" not in failed.stderr
    )
