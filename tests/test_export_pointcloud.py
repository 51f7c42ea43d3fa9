"""python -m training.export pointcloud / cameras / mesh --format: a run whose density is a known ball (so the points
must lie on its sphere), exported from the procedural scene's cameras and from a nerfstudio capture posed in a
rotated, moved and scaled world (data.orient=up): the points and cameras come back in the capture's own frame."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import REPO, run_train, tiny_overrides

from data.cameras import look_at
from data.nerfstudio import read_capture, write_nerfstudio
from data.orientation import rotation_between
from models.model import VoxelNeRF
from training import export, finished_run
from training.checkpoint import save_checkpoint

plyfile = pytest.importorskip("plyfile", reason='plyfile is not installed (pip install -e ".[mesh]")')

RESOLUTION = 41  # grid vertices a side
COLOUR = np.array([0.8, 0.3, 0.1])


def ball_run(folder: Path, config: dict, centre, radius: float) -> Path:
    """A run folder whose model (config["model"] over config["data"]'s box) is an opaque ball of ``COLOUR``."""
    model_cfg = {**config["model"], "resolution_end": RESOLUTION, "resolution_start": RESOLUTION, "grow_at": []}
    model_cfg |= {"upsample": 1, "contraction": "none"}
    config = {**config, "model": model_cfg}
    scene = export.scene_of(config["data"])
    bbox = torch.tensor(scene["bbox"], dtype=torch.float32)
    model = VoxelNeRF(bbox, scene["near"], scene["far"], model_cfg, finished_run.reference_ops()).eval()
    box = model.bbox
    axes = [torch.linspace(float(box[0, a]), float(box[1, a]), n) for a, n in enumerate(model.density.shape)]
    points = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)
    inside = torch.linalg.vector_norm(points - torch.tensor(centre, dtype=torch.float32), dim=-1) < radius
    with torch.no_grad():
        model.density.grid.copy_(torch.where(inside, 30.0, -30.0)[..., None])
        model.features.grid.zero_()
        model.features.grid[..., :3] = torch.logit(torch.tensor(COLOUR, dtype=torch.float32))
    model.refresh_occupancy()
    save_checkpoint(folder / "checkpoints" / "last.pt", {"config": config, "step": 1, "model": model.state_dict()})
    return folder


def read_points(path: Path) -> tuple[np.ndarray, np.ndarray]:
    vertex = plyfile.PlyData.read(str(path))["vertex"].data
    assert vertex["x"].dtype == np.float32 and vertex["red"].dtype == np.uint8
    colours = np.stack([vertex[c] for c in ("red", "green", "blue")], 1)
    return np.stack([vertex[a] for a in "xyz"], 1).astype(np.float64), colours


@pytest.fixture(scope="module")
def scene_run(tmp_path_factory) -> dict:
    """A 2-step run of the procedural scene at 40 px, 10 views: its config and scene; the model is replaced."""
    run = tmp_path_factory.mktemp("cloud_run")
    cache = tmp_path_factory.mktemp("cloud_scene")
    overrides = tiny_overrides(cache, 2) + ["data.resolution=40", "data.n_train=10", "train.turntable_frames=0"]
    result = run_train(overrides + [f"hydra.run.dir={run}"])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return export.load_run(run)[1]["config"]


def test_the_point_cloud_lies_on_the_balls_sphere_in_its_colour(scene_run, tmp_path):
    centre, radius = (0.2, -0.1, 0.1), 0.7
    run = ball_run(tmp_path / "ball", scene_run, centre, radius)
    out = tmp_path / "cloud.ply"
    result = subprocess.run(
        [sys.executable, "-m", "training.export", "pointcloud", str(run), "--out", str(out), "--device", "cpu"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    points, colours = read_points(out)
    assert len(points) >= 1000 and f"wrote {out}: {len(points)} points from 10 training views" in result.stdout
    voxel = 3.0 / (RESOLUTION - 1)
    error = np.abs(np.linalg.norm(points - centre, axis=1) - radius)
    assert np.median(error) < 0.5 * voxel and np.quantile(error, 0.99) < 1.5 * voxel, np.quantile(error, [0.5, 0.99])
    assert np.abs(colours.mean(0) - COLOUR * 255).max() < 8
    assert not list(tmp_path.glob(".*.tmp"))

    # --num-points subsamples; a cloud whose opacity never passes --min-opacity is refused in one line
    few = export.export_pointcloud(run, tmp_path / "few.ply", num_points=200, device="cpu", progress=False)
    assert few["points"] == 200 and len(read_points(tmp_path / "few.ply")[0]) == 200
    assert export.main(["pointcloud", str(run), "--num-points", "0", "--out", str(tmp_path / "x.ply")]) == 2
    assert export.main(["pointcloud", str(run), "--min-opacity", "1.5", "--out", str(tmp_path / "x.ply")]) == 2
    assert not (tmp_path / "x.ply").exists()


def test_mesh_as_glb_and_obj(scene_run, tmp_path):
    trimesh = pytest.importorskip("trimesh", reason="trimesh is not installed")
    pytest.importorskip("mcubes", reason="PyMCubes is not installed")
    run = ball_run(tmp_path / "ball", scene_run, (0.0, 0.0, 0.0), 0.6)
    for fmt in ("glb", "obj"):
        out = tmp_path / f"ball.{fmt}"
        assert export.main(["mesh", str(run), "--out", str(out)]) == 0
        mesh = trimesh.load(str(out), force="mesh")
        assert len(mesh.faces) > 100
        assert np.abs(np.linalg.norm(mesh.vertices, axis=1) - 0.6).max() < 3.0 / (RESOLUTION - 1)
        colours = np.asarray(mesh.visual.vertex_colors)[:, :3]
        assert np.abs(colours.mean(0) - COLOUR * 255).max() < 3
    assert export.main(["mesh", str(run), "--out", str(tmp_path / "ball.stl")]) == 2


def oriented_capture(root: Path) -> tuple[np.ndarray, float, np.ndarray]:
    """A nerfstudio capture of 12 32-px views around ``centre`` in a world whose up is tilted, 10x larger than
    ours; returns (centre, scale of that world over the run's, the cameras as written)."""
    up = np.array([0.3, -0.5, 0.8])
    rotation = rotation_between(np.array([0.0, 0.0, 1.0]), up)
    centre, scale = np.array([5.0, -3.0, 2.0]), 10.0
    azimuths = np.linspace(0, 2 * np.pi, 12, endpoint=False)
    local = np.stack([np.cos(azimuths), np.sin(azimuths), 0.5 + 0.2 * np.sin(3 * azimuths)], 1) * 4.0
    c2w = look_at(local)  # around the origin, z up
    c2w[:, :3, :] = rotation @ c2w[:, :3, :]
    c2w[:, :3, 3] = c2w[:, :3, 3] * scale + centre
    images = [np.full((32, 32, 3), 128, np.uint8)] * 12
    write_nerfstudio(root, images, c2w, np.tile([40.0, 40.0, 16.0, 16.0], (12, 1)))
    return centre, scale, c2w


def test_points_and_cameras_come_back_in_the_captures_own_frame(scene_run, tmp_path):
    centre, _, written = oriented_capture(tmp_path / "capture")
    transform = read_capture(tmp_path / "capture", 8, "up").transform
    data = {"name": "nerfstudio", "root": str(tmp_path / "capture"), "orient": "up", "eval_interval": 8}
    data |= {"downscale": 1, "background": [1.0, 1.0, 1.0], "near": 0.05, "far": 3.0, "scene_box": 1.0}
    model_centre = transform.points(centre)
    assert np.abs(model_centre).max() < 0.05  # data.orient centred the world on the cameras' focus
    radius = 0.25  # in the run's frame
    run = ball_run(tmp_path / "run", {**scene_run, "data": data}, tuple(model_centre), radius)

    original = export.export_pointcloud(run, tmp_path / "original.ply", device="cpu", progress=False)
    model = export.export_pointcloud(run, tmp_path / "model.ply", frame="model", device="cpu", progress=False)
    points, _ = read_points(tmp_path / "original.ply")
    in_model, _ = read_points(tmp_path / "model.ply")
    assert original["points"] == model["points"] >= 1000
    voxel = 2.0 / (RESOLUTION - 1)
    assert np.median(np.abs(np.linalg.norm(in_model - model_centre, axis=1) - radius)) < 0.5 * voxel
    # the same points, in the capture's frame: around its centre, scaled back (the similarity's inverse)
    original_radius = radius / transform.scale
    assert original_radius > 1.0  # the capture's world is ~10x ours
    distance = np.linalg.norm(points - centre, axis=1)
    assert np.median(np.abs(distance - original_radius)) < 0.5 * voxel / transform.scale
    np.testing.assert_allclose(transform.points(points), in_model, atol=1e-4)  # float32 files

    # the cameras: exactly those of the capture's transforms.json, in its frame, with their intrinsics
    assert export.main(["cameras", str(run), "--out", str(tmp_path / "cameras.json")]) == 0
    cameras = json.loads((tmp_path / "cameras.json").read_text())
    assert cameras["frame"] == "original" and len(cameras["frames"]) == 12
    by_name = {f["file_path"]: f for f in cameras["frames"]}
    for index, c2w in enumerate(written):
        frame = by_name[f"images/frame_{index:05d}.png"]
        np.testing.assert_allclose(np.array(frame["transform_matrix"]), c2w, atol=1e-4)
        assert (frame["fl_x"], frame["cx"], frame["w"], frame["h"]) == (40.0, 16.0, 32, 32)
    assert len(cameras["train_filenames"]) + len(cameras["val_filenames"]) == 12

    # a capture that moved away: --frame original says so in one line, --frame model still works
    (tmp_path / "capture").rename(tmp_path / "moved")
    assert export.main(["cameras", str(run), "--out", str(tmp_path / "c2.json")]) == 2


def test_help_names_every_export():
    command = [sys.executable, "-m", "training.export", "--help"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("pointcloud", "mesh", "cameras", "weights"):
        assert command in result.stdout
