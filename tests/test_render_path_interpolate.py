"""render_path --path interpolate|spiral: a smooth path through the training cameras (Catmull-Rom positions, squad
rotations) that passes through each camera at its parameter, LLFF's spiral, and the exported cameras rendered again."""

from __future__ import annotations

import json

import imageio.v3 as iio
import numpy as np
import pytest
from test_train import finished_run, scene_cache  # noqa: F401  (fixtures: a 12-step CPU run of the built-in scene)

from data.cameras import look_at
from training import export
from training.finished_run import load_split
from training.render_path import (
    interpolate_path,
    main,
    matrix_to_quaternion,
    quaternion_to_matrix,
    spiral_path,
)


def cameras(count: int = 6) -> tuple[np.ndarray, np.ndarray]:
    angles = np.linspace(0.0, 1.5 * np.pi, count)
    positions = np.stack([4 * np.cos(angles), 3 * np.sin(angles), 1.0 + 0.5 * np.sin(2 * angles)], 1)
    intrinsics = np.stack([np.linspace(40, 50, count), np.linspace(41, 51, count), np.full(count, 16.0)], 1)
    return look_at(positions), np.concatenate([intrinsics, np.full((count, 1), 12.0)], 1)


def test_quaternions_round_trip(gen):
    rotations = np.linalg.qr(np.random.default_rng(0).normal(size=(50, 3, 3)))[0]
    rotations *= np.sign(np.linalg.det(rotations))[:, None, None]  # proper rotations
    np.testing.assert_allclose(quaternion_to_matrix(matrix_to_quaternion(rotations)), rotations, atol=1e-12)


@pytest.mark.parametrize("loop", [False, True])
def test_the_path_passes_through_every_camera_at_its_parameter(loop):
    c2w, intrinsics = cameras()
    steps = 4
    frames = 6 * steps if loop else 5 * steps + 1
    path, k = interpolate_path(c2w, intrinsics, frames, loop=loop)
    assert path.shape == (frames, 4, 4) and k.shape == (frames, 4)
    np.testing.assert_allclose(path[::steps], c2w, atol=1e-9)
    np.testing.assert_allclose(k[::steps], intrinsics, atol=1e-9)
    rotations = path[:, :3, :3]
    np.testing.assert_allclose(
        rotations @ rotations.transpose(0, 2, 1), np.broadcast_to(np.eye(3), rotations.shape), atol=1e-9
    )
    np.testing.assert_allclose(np.linalg.det(rotations), 1.0, atol=1e-9)


def test_the_path_is_smooth_through_the_cameras():
    """C1 at the cameras: the step just before a camera and the step just after agree (positions and rotations)."""
    c2w, intrinsics = cameras()
    steps = 200
    path, _ = interpolate_path(c2w, intrinsics, 5 * steps + 1)
    moves = np.diff(path[:, :3, 3], axis=0)
    quaternions = matrix_to_quaternion(path[:, :3, :3])
    turns = 2 * np.arccos(np.clip(np.abs((quaternions[1:] * quaternions[:-1]).sum(-1)), 0, 1))
    for key in range(1, 5):
        before, after = moves[key * steps - 1], moves[key * steps]
        assert np.linalg.norm(after - before) < 0.05 * np.linalg.norm(before)
        assert abs(turns[key * steps] - turns[key * steps - 1]) < 0.05 * turns[key * steps - 1] + 1e-6


def test_the_spiral_circles_the_mean_camera_looking_at_the_focus():
    c2w = look_at(np.stack([np.linspace(-1, 1, 8), np.full(8, -4.0), np.linspace(0.5, 1.0, 8)], 1))
    path = spiral_path(c2w, 30, rotations=2, centre=np.zeros(3))
    assert path.shape == (30, 4, 4)
    mean = c2w[:, :3, 3].mean(0)
    assert np.linalg.norm(path[:, :3, 3].mean(0) - mean) < 0.5
    forward = -path[:, :3, 2]
    to_origin = -path[:, :3, 3] / np.linalg.norm(path[:, :3, 3], axis=1, keepdims=True)
    assert (np.einsum("ij,ij->i", forward, to_origin) > 0.99).all()  # the cameras' axes meet at the origin


def test_cli_interpolate_writes_its_frames_through_the_training_cameras(finished_run, tmp_path):  # noqa: F811
    out = tmp_path / "interpolate"
    assert (
        main([str(finished_run), "--path", "interpolate", "--frames", "10", "--out", str(out), "--device", "cpu"]) == 0
    )
    written = json.loads((out / "cameras.json").read_text())
    assert len(written["frames"]) == 10 and (written["w"], written["h"]) == (16, 16)
    video = next(out.glob("video.*"))
    if video.suffix == ".mp4":
        assert len(list(iio.imiter(video))) == 10
    _, state = export.load_run(finished_run)
    train = load_split(dict(state["config"]["data"]), "train")
    path = np.array([f["transform_matrix"] for f in written["frames"]])
    np.testing.assert_allclose(path[0], train.c2w[0].numpy(), atol=1e-5)
    np.testing.assert_allclose(path[-1], train.c2w[-1].numpy(), atol=1e-5)

    spiral = tmp_path / "spiral"
    assert main([str(finished_run), "--path", "spiral", "--frames", "6", "--out", str(spiral), "--device", "cpu"]) == 0
    assert len(json.loads((spiral / "cameras.json").read_text())["frames"]) == 6

    # the exported cameras (nerfstudio transforms: per-frame intrinsics, the scene's own frame) render again
    assert export.main(["cameras", str(finished_run), "--out", str(tmp_path / "cameras.json")]) == 0
    again = tmp_path / "again"
    args = [str(finished_run), "--path", str(tmp_path / "cameras.json"), "--out", str(again), "--device", "cpu"]
    assert main(args) == 0
    assert len(json.loads((again / "cameras.json").read_text())["frames"]) == 6 + 3
