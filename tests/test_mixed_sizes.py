"""Frames of different sizes in one split (portrait and landscape photos, two cameras; data.scene.Scene.sizes):
the loader keeps each frame's own size, the samplers draw only each view's own pixels (never the padding, every
pixel as often), and training, evaluation and renders work on each view at its size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from test_nerfstudio import REPO, TRAIN_ARGS, odd_intrinsics

from data import Scene, SceneError
from data.nerfstudio import load_nerfstudio, write_nerfstudio
from data.samplers import PatchSampler, RaySampler
from data.synthetic import render_views, split_cameras

LANDSCAPE, PORTRAIT = (20, 28), (28, 20)  # (h, w)


def mixed_scene(sizes: list[tuple[int, int]]) -> Scene:
    """Views of the given sizes: their own pixels 1 + view index (never 0), the padding 0."""
    height, width = max(h for h, _ in sizes), max(w for _, w in sizes)
    images = torch.zeros(len(sizes), height, width, 3, dtype=torch.uint8)
    for view, (h, w) in enumerate(sizes):
        images[view, :h, :w] = 1 + view
    c2w = torch.eye(4).repeat(len(sizes), 1, 1)
    c2w[:, 2, 3] = 4.0
    intrinsics = torch.tensor([[20.0, 20.0, w / 2, h / 2] for h, w in sizes], dtype=torch.float64)
    return Scene(
        images, c2w, height, width, 20.0, 2.0, 6.0, torch.tensor([[-1.0] * 3, [1.0] * 3]), (1.0, 1.0, 1.0),
        "train", [f"v{i}" for i in range(len(sizes))], intrinsics=intrinsics, sizes=torch.tensor(sizes),
    )  # fmt: skip


def test_scene_checks_and_describes_its_sizes():
    scene = mixed_scene([(6, 10), (10, 6), (6, 10)])
    assert scene.view_size(1) == (10, 6) and tuple(scene.view_image(1).shape) == (10, 6, 3)
    assert scene.describe_sizes() == "10x6 (x2), 6x10 (x1)"
    assert mixed_scene([(6, 10), (6, 10)]).sizes is None  # one size after all: the plain layout
    with pytest.raises(ValueError, match="Scene.sizes"):
        Scene(**{**mixed_scene([(6, 10), (10, 6)]).__dict__, "sizes": torch.tensor([[6, 10], [9, 6]])})


def test_ray_sampler_draws_each_views_own_pixels_uniformly():
    sizes = [(6, 10), (10, 6), (4, 5)]
    scene = mixed_scene(sizes)
    sampler = RaySampler(scene, 60000, torch.Generator().manual_seed(0))
    batch = sampler.sample()
    views, rows, cols = batch.views, batch.pixels[:, 0], batch.pixels[:, 1]
    limits = torch.tensor(sizes)[views]
    assert bool((rows < limits[:, 0]).all()) and bool((cols < limits[:, 1]).all())
    assert torch.equal(batch.rgb[:, 0], (1 + views).float() / 255)  # the view's own pixels, never the padding
    # every pixel of every view equally likely: views in proportion to their pixel counts (60, 60, 20)
    share = torch.bincount(views, minlength=3).double() / len(views)
    torch.testing.assert_close(share, torch.tensor([60, 60, 20], dtype=torch.float64) / 140, atol=0.01, rtol=0)
    # the rays go through each view's own principal point: the centre pixel's ray is (nearly) the optical axis
    centre = (views == 1) & (rows == 5) & (cols == 3)
    assert bool(centre.any())
    direction = batch.directions[centre][0]
    assert float(direction[2]) < -0.99


def test_patch_sampler_keeps_patches_inside_each_view():
    sizes = [(6, 10), (10, 6)]
    scene = mixed_scene(sizes)
    sampler = PatchSampler(scene, patch_size=2, scale=2, patches_per_batch=4000, generator=torch.Generator())
    batch = sampler.sample()
    corner = batch.top_left
    limits = torch.tensor(sizes)[batch.views] - 4
    assert bool((corner >= 0).all()) and bool((corner <= limits).all())
    assert torch.equal(batch.rgb[:, :, :, 0], ((1 + batch.views).float() / 255)[:, None, None].expand(-1, 4, 4))
    assert set(batch.views.tolist()) == {0, 1}
    with pytest.raises(ValueError, match="smallest"):
        PatchSampler(mixed_scene([(6, 10), (10, 3)]), patch_size=2, scale=2, patches_per_batch=1)


def mixed_capture(root: Path) -> list[tuple[int, int]]:
    """The procedural scene in nerfstudio form, landscape and portrait frames alternating, per-frame intrinsics."""
    c2w = split_cameras(5, 30, 1, 0)["train"]
    sizes = [LANDSCAPE if i % 2 else PORTRAIT for i in range(len(c2w))]
    images, intrinsics = [], []
    for camera, size in zip(c2w, sizes):
        k = odd_intrinsics(1, *size, seed=len(images))
        images.append(render_views(camera[None], 0, 5, k, size)[0])
        intrinsics.append(k[0])
    write_nerfstudio(root, images, c2w, np.array(intrinsics))
    return sizes


def test_loader_keeps_each_frames_size(tmp_path):
    sizes = mixed_capture(tmp_path)
    train, evaluation, _ = load_nerfstudio(tmp_path, orient="none")
    assert (train.height, train.width) == (28, 28) and train.sizes is not None
    names = sorted(f"images/frame_{i:05d}.png" for i in range(len(sizes)))
    expected = {name: sizes[int(name[-9:-4])] for name in names}
    for scene in (train, evaluation):
        assert [scene.view_size(v) for v in range(scene.num_views)] == [expected[n] for n in scene.names]
    halved = load_nerfstudio(tmp_path, downscale=2, orient="none")[0]
    assert sorted({tuple(s) for s in halved.sizes.tolist()}) == [(10, 14), (14, 10)]
    with pytest.raises(SceneError, match="smaller than 32"):  # a frame smaller than downscale x multiple is named
        load_nerfstudio(tmp_path, multiple=32, orient="none")


def test_mixed_sizes_train_evaluate_and_render(tmp_path):
    """The deferred (patch) model trains on landscape and portrait frames together; the held-out views of both
    orientations score alike (wrong rays, intrinsics or padding in either would cost that orientation dB), and each
    render has its view's size."""
    mixed_capture(tmp_path / "capture")
    run = tmp_path / "run"
    args = [
        "data=nerfstudio",
        f"data.root={tmp_path / 'capture'}",
        "data.orient=none",
        "data.eval_interval=3",
        *TRAIN_ARGS,
        "train.patch_size=4",
        f"hydra.run.dir={run}",
    ]
    result = subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "28x20 (x" in result.stdout and "20x28 (x" in result.stdout
    metrics = json.loads((run / "metrics.json").read_text())
    by_size = {}
    for view in metrics["per_view"]:
        index = int(view["name"][-9:-4])
        by_size.setdefault(LANDSCAPE if index % 2 else PORTRAIT, []).append(view["psnr"])
        pred = iio.imread(run / "renders" / f"{view['view']:03d}_pred.png")
        assert pred.shape[:2] == (LANDSCAPE if index % 2 else PORTRAIT)
    landscape, portrait = (float(np.mean(by_size[size])) for size in (LANDSCAPE, PORTRAIT))
    print(f"held-out PSNR landscape {landscape:.2f} dB, portrait {portrait:.2f} dB")
    assert min(landscape, portrait) > 15.0
    assert abs(landscape - portrait) < 2.0


@pytest.mark.requires_cuda
def test_mixed_size_batches_replay_from_a_cuda_graph():
    """train.batch_graph: the views' sorted search is captured like the plain arithmetic, so a graph's batches are
    the eager sampler's, bit for bit."""
    from data.batch_graph import GraphedSampler

    scene = mixed_scene([(6, 10), (10, 6), (4, 5)]).to("cuda")
    eager = RaySampler(scene, 4096, torch.Generator("cuda").manual_seed(3))
    graphed = GraphedSampler(RaySampler(scene, 4096, torch.Generator("cuda").manual_seed(3)))
    for _ in range(3):
        expected, got = eager.sample(), graphed.sample()
        assert torch.equal(expected.pixels, got.pixels) and torch.equal(expected.views, got.views)
        torch.testing.assert_close(expected.directions, got.directions, rtol=0, atol=0)


def test_viewer_frusta_keep_each_views_shape():
    from training.viewer import TrainCameras

    cameras = TrainCameras.of_scene(mixed_scene([(6, 10), (10, 6)]))
    np.testing.assert_allclose(cameras.aspect, [10 / 6, 6 / 10])
    np.testing.assert_allclose(cameras.fov, [2 * np.arctan(3 / 20), 2 * np.arctan(5 / 20)])
