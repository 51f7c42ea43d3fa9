"""The scene box and near/far a capture derives (data/bounds.py): from sparse points, from the cameras' focus (the
view a camera sees across for a bounded grid, the one every camera sees whole for a contracted scene's foreground,
as the app chooses from model.contraction), and the training masks' visual hull with per-view intrinsics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_nerfstudio import edit, write_capture
from test_train import run_train

from data.bounds import capture_bounds, mask_hull_box
from data.nerfstudio import load_nerfstudio, nerfstudio_bounds, read_capture


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    return root, write_capture(root)


def test_applied_transform_moves_neither_the_sparse_points_nor_the_poses(tmp_path):
    """ns-process-data writes sparse_pc.ply in the poses' world (its create_ply_from_colmap applies the same
    applied_transform to the points), so the transform is already in both and applied to neither."""
    pytest.importorskip("plyfile")
    from plyfile import PlyData, PlyElement

    write_capture(tmp_path, count=4)
    points = np.random.default_rng(0).uniform(-0.5, 0.5, (200, 3))
    applied = np.array([[1.0, 0.0, 0.0, 0.5], [0.0, 0.0, 1.0, 0.0], [0.0, -1.0, 0.0, 0.0]])  # ns-process-data's
    vertices = np.array([tuple(p) for p in points], dtype=[("x", "f8"), ("y", "f8"), ("z", "f8")])
    PlyData([PlyElement.describe(vertices, "vertex")]).write(str(tmp_path / "sparse_pc.ply"))
    before = read_capture(tmp_path).frames[0].c2w
    edit(tmp_path, lambda m: m.update(applied_transform=applied.tolist()))
    capture = read_capture(tmp_path)
    assert np.array_equal(capture.frames[0].c2w, before)  # poses already carry it
    train, _, bounds = load_nerfstudio(tmp_path, orient="none")  # the poses' world, as given
    assert "200 sparse points" in bounds.source
    low, high = np.percentile(points, [1, 99], axis=0)
    assert np.allclose(bounds.box, [low - 0.1 * (high - low), high + 0.1 * (high - low)])
    box = load_nerfstudio(tmp_path, scene_box=[-1, -2, -3, 1, 2, 3], near=0.5, far=9.0, orient="none")[2]
    assert box.source == "data.scene_box" and box.box.tolist() == [[-1, -2, -3], [1, 2, 3]] and box.far == 9.0


def test_the_box_from_the_cameras_holds_the_object(capture):
    _, _, bounds = load_nerfstudio(capture[0], orient="none")
    # the procedural scene: x, y within the pedestal's +-1.2, z from -0.5 to the sphere's top 0.6
    assert (bounds.box[0] <= [-1.2, -1.2, -0.5]).all() and (bounds.box[1] >= [1.2, 1.2, 0.6]).all()
    assert (bounds.box[1] - bounds.box[0] < 4.0).all() and 0.5 < bounds.near < 3.5 and 4.0 < bounds.far < 8.0
    parallel = np.tile(np.eye(4), (3, 1, 1))
    parallel[:, 0, 3] = [0.0, 1.0, 2.0]
    with pytest.raises(ValueError, match=r"forward-facing capture\): set data.scene_box"):
        capture_bounds(parallel, np.array([[10.0, 10.0, 8.0, 8.0]] * 3), np.array([[16, 16]] * 3))


def test_the_box_from_the_cameras_is_what_they_see_across_or_whole_for_a_foreground():
    # six cameras on a ring of radius 2 looking at (0.3, 0, 0): portrait frames, 8 wide and 16 high at f = 8 / 10
    angles = np.linspace(0.0, 2 * np.pi, 6, endpoint=False)
    c2w = np.tile(np.eye(4), (6, 1, 1))
    for view, angle in enumerate(angles):
        back = np.array([np.cos(angle), np.sin(angle), 0.0])  # the camera's +z points away from what it sees
        up = np.array([0.0, 0.0, 1.0])
        c2w[view, :3, :3] = np.stack([np.cross(up, back), up, back], axis=1)
        c2w[view, :3, 3] = [0.3, 0.0, 0.0] + 2.0 * back
    intrinsics = np.array([[8.0, 10.0, 4.0, 8.0]] * 6)  # tan of the half views: x 4/8, y 8/10
    sizes = np.array([[16, 8]] * 6)
    # a contracted scene's foreground: the narrower half view (x: 0.5) at the distance 2, half size 1 about the focus
    bounds = capture_bounds(c2w, intrinsics, sizes, foreground=True)
    assert np.allclose(bounds.box, [[-0.7, -1.0, -1.0], [1.3, 1.0, 1.0]], atol=1e-9)
    assert "focus" in bounds.source
    # a bounded grid's whole scene: what a camera sees across, the wider half view (y: 0.8), half size 1.6
    bounds = capture_bounds(c2w, intrinsics, sizes)
    assert np.allclose(bounds.box, [[-1.3, -1.6, -1.6], [1.9, 1.6, 1.6]], atol=1e-9)


def test_mask_hull_uses_the_views_intrinsics(capture):
    train, _, _ = load_nerfstudio(capture[0], orient="none")
    box = mask_hull_box(train, resolution=48)
    assert (box[0] <= torch.tensor([-1.2, -1.2, -0.5]) + 0.1).all()
    assert (box[1] >= torch.tensor([1.2, 1.2, 0.6]) - 0.1).all()


@pytest.mark.parametrize("contraction", ["none", "inf"])
def test_the_app_derives_a_foreground_box_for_a_contracted_model_only(tmp_path, capture, contraction):
    # a bounded grid holds the whole scene (the wider view); a contracted one keeps its box for the foreground
    args = ["data=nerfstudio", f"data.root={capture[0]}", "data.orient=none", f"model.contraction={contraction}"]
    small = ["model.resolution_start=16", "model.resolution_end=16", "model.grow_at=[]", "model.shrink_at=null"]
    run = [
        "device=cpu",
        "train.iters=2",
        "train.patch_size=6",
        "train.eval_final_views=1",
        "train.turntable_frames=0",
        *small,
    ]
    result = run_train([*args, *run, f"hydra.run.dir={tmp_path / 'run'}"], timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    as_given = read_capture(capture[0], orient="none")
    want = nerfstudio_bounds(as_given, foreground=contraction == "inf")
    assert f"nerfstudio {want.describe()}" in result.stdout
    wider = nerfstudio_bounds(as_given)
    assert (want.box[1] - want.box[0] < wider.box[1] - wider.box[0]).all() == (contraction == "inf")
