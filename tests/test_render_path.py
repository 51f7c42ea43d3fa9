"""python -m training.render_path: a finished run rendered along an orbit, its evaluation cameras, and camera-path
JSON files (ours and nerfstudio's), into a folder of its own; errors are one line and exit code 2."""

from __future__ import annotations

import json
import math

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from test_train import finished_run, scene_cache  # noqa: F401  (fixtures: a 12-step CPU run of the built-in scene)

from training.checkpoint import save_checkpoint
from training.finished_run import load_run, reference_ops
from training.render_path import main, orbit_path, render_frames
from training.visualize import to_uint8


@pytest.fixture(scope="module")
def textured_run(finished_run, tmp_path_factory):  # noqa: F811
    """The finished run with random density and colour grids: renders with structure in every view."""
    run = tmp_path_factory.mktemp("textured")
    model, state = load_run(finished_run)  # a finished run keeps model.pt (training.compact_model)
    state = {"config": state["config"], "step": state["step"], "model": model.state_dict()}
    generator = torch.Generator().manual_seed(0)
    for key in ("density.grid", "features.grid"):
        grid = state["model"][key]
        state["model"][key] = torch.randn(grid.shape, generator=generator) * 4.0 + (2.0 if key == "density.grid" else 0)
    save_checkpoint(run / "checkpoints" / "last.pt", state)
    return run


def video_frames(folder) -> np.ndarray:
    video = next(folder.glob("video.*"))
    return np.stack(list(iio.imiter(video)))[..., :3]


def test_orbit_renders_rgb_and_depth_side_by_side_and_its_cameras_render_again(textured_run, tmp_path, capsys):
    out = tmp_path / "orbit"
    assert main([str(textured_run), "--frames", "4", "--size", "24", "--out", str(out), "--device", "cpu"]) == 0
    frames = video_frames(out)
    assert frames.shape[1:] == (24, 48, 3)
    if next(out.glob("video.*")).suffix == ".mp4":
        assert frames.shape[0] == 4  # GIF writers may merge identical frames
    cameras = json.loads((out / "cameras.json").read_text())
    assert len(cameras["frames"]) == 4 and (cameras["w"], cameras["h"]) == (24, 24)
    assert math.isclose(cameras["camera_angle_x"], math.radians(40.0), rel_tol=1e-6)
    positions = np.array([f["transform_matrix"] for f in cameras["frames"]])[:, :3, 3]
    assert np.allclose(np.linalg.norm(positions, axis=1), 4.0, atol=0.3)  # (near + far) / 2 around the box centre
    assert not np.array_equal(frames[0], frames[1])  # the camera moved
    # the RGB half is the model's own render from that camera (up to the video codec)
    model, _ = load_run(textured_run, reference_ops())
    focal = 12.0 / math.tan(math.radians(20.0))
    renders = [
        to_uint8(model.eval().render_image(torch.tensor(f["transform_matrix"]), 24, 24, focal)["rgb"].numpy())
        for f in cameras["frames"][:2]
    ]
    own, other = (np.abs(r.astype(float) - frames[0, :, :24]).mean() for r in renders)
    assert own < 0.4 * other, (own, other)  # a lossy codec on a noisy texture, but clearly the same view
    # before encoding, exactly the model's render (RGB half) and its depth (other half)
    c2w, intrinsics, shape = orbit_path(np.zeros(3), 4.0, 30.0, 4, 40.0, 24)
    exact = render_frames(model, c2w[:1], intrinsics[:1], shape, 4096)[0]
    assert np.array_equal(
        exact[:, :24], to_uint8(model.render_image(torch.tensor(c2w[0]), 24, 24, focal)["rgb"].numpy())
    )
    again = tmp_path / "again"
    args = [str(textured_run), "--path", str(out / "cameras.json"), "--out", str(again), "--device", "cpu"]
    assert main(args) == 0
    assert np.abs(video_frames(again).astype(int) - frames.astype(int)).max() <= 8  # same cameras (video codec)
    assert "RGB | depth" in capsys.readouterr().out


def test_nerfstudio_camera_path_and_eval_cameras(finished_run, tmp_path):  # noqa: F811
    orbit = tmp_path / "orbit"
    assert main([str(finished_run), "--frames", "2", "--size", "16", "--out", str(orbit), "--device", "cpu"]) == 0
    c2w = [f["transform_matrix"] for f in json.loads((orbit / "cameras.json").read_text())["frames"]]
    path = {
        "render_height": 12,
        "render_width": 20,
        "camera_path": [{"camera_to_world": np.ravel(c).tolist(), "fov": 30.0} for c in c2w],
    }
    (tmp_path / "ns.json").write_text(json.dumps(path))
    out = tmp_path / "ns"
    assert main([str(finished_run), "--path", str(tmp_path / "ns.json"), "--out", str(out), "--device", "cpu"]) == 0
    assert video_frames(out).shape[1:] == (12, 40, 3)
    cameras = json.loads((out / "cameras.json").read_text())
    assert math.isclose(2 * math.atan(10 / (6 / math.tan(math.radians(15)))), cameras["camera_angle_x"])
    evaluation = tmp_path / "eval"
    assert main([str(finished_run), "--path", "eval", "--size", "16", "--out", str(evaluation), "--device", "cpu"]) == 0
    assert len(json.loads((evaluation / "cameras.json").read_text())["frames"]) == 3  # the run's test split


@pytest.mark.parametrize(
    "args, message",
    [
        (["--frames", "0"], "--frames must be >= 1"),
        (["--fov", "190"], "--fov: must be in (0, 180)"),
        (["--elevation", "90"], "--elevation: must be in [-89, 89]"),
        (["--path", "/nonexistent/path.json"], "--path: cannot read"),
    ],
)
def test_bad_options_are_one_line_errors(finished_run, tmp_path, capsys, args, message):  # noqa: F811
    assert main([str(finished_run), "--out", str(tmp_path / "x"), "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_missing_run_and_a_used_folder_are_refused(finished_run, tmp_path, capsys):  # noqa: F811
    assert main([str(tmp_path / "nothing"), "--device", "cpu"]) == 2
    assert "no such run folder" in capsys.readouterr().err
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine")
    assert main([str(finished_run), "--frames", "1", "--size", "16", "--out", str(used), "--device", "cpu"]) == 2
    assert "is not empty" in capsys.readouterr().err and (used / "keep.txt").read_text() == "mine"
