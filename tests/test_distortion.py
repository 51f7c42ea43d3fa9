"""Lens distortion (data/camera_models.py) and distorted cameras in rays, samplers and captures: the inverse
against the forward model and a brute-force inverse, the fisheye, zero distortion bit for bit the pinhole path,
rays that project back onto their pixels, bad coefficients, and a distorted instant-ngp capture that trains."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data import camera_rays, pixel_rays, project_to_pixels
from data.camera_models import (
    Lens,
    check_invertible,
    distort,
    distortion_jacobian,
    fisheye_project,
    fisheye_unproject,
    undistort,
)
from data.nerfstudio import load_nerfstudio, write_nerfstudio
from data.samplers import PatchSampler, RaySampler
from data.synthetic import render_views, split_cameras

REPO = Path(__file__).resolve().parents[1]
PHONE = [-0.0024, -0.0213, 0.0, 0.0, 0.0110, 0.0096]  # the fruit capture's k1 k2 k3 k4 p1 p2
STRONG = [-0.28, 0.09, -0.012, 0.0005, 0.0012, -0.0009]  # a wide-angle action camera's barrel
FISHEYE = [0.031, -0.012, 0.0021, -0.0003, 0.0, 0.0]
CAMERA = (620.0, 610.0, 318.8, 395.3)  # fx fy cx cy of a 605 x 806 image (w x h)
SIZE = (806, 605)


def image_positions(count: int = 81) -> tuple[torch.Tensor, torch.Tensor]:
    """Distorted normalised coordinates over the whole image, edges and corners included (float64)."""
    fx, fy, cx, cy = CAMERA
    u = torch.linspace(0, SIZE[1], count, dtype=torch.float64)
    v = torch.linspace(0, SIZE[0], count, dtype=torch.float64)
    vv, uu = torch.meshgrid(v, u, indexing="ij")
    return (uu - cx) / fx, (vv - cy) / fy


@pytest.mark.parametrize("coefficients", [PHONE, STRONG], ids=["phone", "strong"])
def test_undistort_inverts_distort_over_the_image(coefficients):
    c = torch.tensor(coefficients, dtype=torch.float64)
    xd, yd = image_positions()
    x, y = undistort(xd, yd, c)
    back = distort(x, y, c)
    assert max(float((back[0] - xd).abs().max()), float((back[1] - yd).abs().max())) < 1e-12
    # and the other way round: undistort(distort(x)) == x for undistorted points covering the image
    rng = torch.Generator().manual_seed(0)
    ux, uy = x.min() + (x.max() - x.min()) * torch.rand(4000, generator=rng, dtype=torch.float64), None
    uy = y.min() + (y.max() - y.min()) * torch.rand(4000, generator=rng, dtype=torch.float64)
    again = undistort(*distort(ux, uy, c), c)
    assert max(float((again[0] - ux).abs().max()), float((again[1] - uy).abs().max())) < 1e-9
    check_invertible(coefficients, False, CAMERA, SIZE)


def test_undistort_matches_a_brute_force_inverse():
    """Nearest point of a dense grid of distorted positions, then compared within the grid's spacing."""
    c = torch.tensor(STRONG, dtype=torch.float64)
    xd, yd = (t[::8, ::8].reshape(-1) for t in image_positions())
    x, y = undistort(xd, yd, c)
    axis = torch.linspace(-1.0, 1.0, 1601, dtype=torch.float64)  # covers the undistorted image (|x|, |y| < 0.9)
    gy, gx = torch.meshgrid(axis, axis, indexing="ij")
    gx, gy = gx.reshape(-1), gy.reshape(-1)
    dx, dy = distort(gx, gy, c)
    nearest = torch.cdist(torch.stack([xd, yd], -1), torch.stack([dx, dy], -1)).argmin(-1)
    spacing = float(axis[1] - axis[0])
    assert float((gx[nearest] - x).abs().max()) <= spacing and float((gy[nearest] - y).abs().max()) <= spacing
    assert float(x.abs().max()) < 0.95 and float(y.abs().max()) < 0.95  # the grid held every answer


def test_the_jacobian_is_the_derivative():
    c = torch.tensor(STRONG, dtype=torch.float64)
    x = (torch.rand(64, dtype=torch.float64) - 0.5).requires_grad_()
    y = (torch.rand(64, dtype=torch.float64) - 0.5).requires_grad_()
    a, b, cc, d = distortion_jacobian(x.detach(), y.detach(), c)
    xd, yd = distort(x, y, c)
    gx = torch.autograd.grad(xd.sum(), (x, y), retain_graph=True)
    gy = torch.autograd.grad(yd.sum(), (x, y))
    for got, want in ((a, gx[0]), (b, gx[1]), (cc, gy[0]), (d, gy[1])):
        assert torch.allclose(got, want, atol=1e-13)


def test_the_fisheye_is_equidistant_and_inverts():
    c = torch.tensor(FISHEYE, dtype=torch.float64)
    xd, yd = image_positions()
    directions = fisheye_unproject(xd, yd, c)
    assert torch.allclose(torch.linalg.vector_norm(directions, dim=-1), torch.ones(()).double(), atol=1e-14)
    back = fisheye_project(directions, c)
    assert float((back - torch.stack([xd, yd], -1)).abs().max()) < 1e-12
    # zero coefficients: the distance from the centre is f * theta (not f * tan theta)
    theta = torch.tensor([0.0, 0.3, 1.0, 1.4], dtype=torch.float64)
    pure = fisheye_unproject(theta, torch.zeros_like(theta), torch.zeros(6, dtype=torch.float64))
    assert torch.allclose(torch.atan2(pure[:, 0], pure[:, 2]), theta, atol=1e-14)
    check_invertible(FISHEYE, True, CAMERA, SIZE)


def test_zero_distortion_is_the_pinhole_path_bit_for_bit():
    c2w = torch.from_numpy(split_cameras(4, 3, 1, 0)["train"]).float()
    k = torch.tensor([[30.0, 31.0, 14.2, 9.7]] * 3)
    zero = Lens(torch.zeros(3, 6))
    rng = torch.Generator().manual_seed(1)
    u, v = torch.rand(3, 50, generator=rng) * 28, torch.rand(3, 50, generator=rng) * 20
    for got, want in zip(pixel_rays(c2w[:, None], u, v, k[:, None], lens=zero.take(torch.arange(3), 1)),
                         pixel_rays(c2w[:, None], u, v, k[:, None])):  # fmt: skip
        assert torch.equal(got, want)
    for got, want in zip(
        camera_rays(c2w[1], 20, 28, k[1], 2, Lens(torch.zeros(6))), camera_rays(c2w[1], 20, 28, k[1], 2)
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("coefficients, fisheye", [(STRONG, False), (FISHEYE, True)], ids=["opencv", "fisheye"])
def test_rays_of_a_distorted_camera_land_on_their_pixels(coefficients, fisheye):
    c2w = torch.from_numpy(split_cameras(5, 2, 1, 0)["train"])
    scale = 20 / SIZE[0]  # the camera at 20 x 15 pixels: distortion is scale-free
    k = torch.tensor(CAMERA, dtype=torch.float64) * scale
    lens = Lens(torch.tensor(coefficients, dtype=torch.float64), fisheye)
    _, directions = camera_rays(c2w[0], 20, 15, k, lens=lens)
    uv = project_to_pixels(c2w[0], directions, k, lens=lens)
    rows, cols = torch.meshgrid(torch.arange(20.0), torch.arange(15.0), indexing="ij")
    expected = torch.stack([cols + 0.5, rows + 0.5], -1).double()
    assert float((uv - expected).abs().max()) < 1e-9
    pinhole = project_to_pixels(c2w[0], directions, k)
    assert float((pinhole - expected).abs().max()) > 0.2  # the lens matters at this size (so the test can fail)


def test_samplers_rays_land_on_their_pixels_through_the_lens(tmp_path):
    write_distorted_capture(tmp_path, count=6, size=(20, 28), coefficients=STRONG)
    train, _, _ = load_nerfstudio(tmp_path)
    assert train.lens is not None and not train.lens.fisheye
    batch = RaySampler(train, 256, torch.Generator().manual_seed(0)).sample()
    lens = train.lens.take(batch.views)
    uv = project_to_pixels(
        train.c2w[batch.views].double(), batch.directions.double(), train.intrinsics[batch.views], lens=lens
    )
    assert torch.allclose(uv, batch.pixels.flip(-1).double() + 0.5, atol=2e-3)
    patches = PatchSampler(train, 3, 2, 4, torch.Generator().manual_seed(0)).sample()
    views = patches.views
    c2w, k = train.c2w[views][:, None, None].double(), train.intrinsics[views][:, None, None]
    uv = project_to_pixels(c2w, patches.hr_directions.double(), k, lens=train.lens.take(views, 2))
    y0, x0 = patches.top_left[:, 0, None, None].double(), patches.top_left[:, 1, None, None].double()
    assert torch.allclose(uv[..., 0], x0 + torch.arange(6).double()[None, None, :] + 0.5, atol=2e-3)
    assert torch.allclose(uv[..., 1], y0 + torch.arange(6).double()[None, :, None] + 0.5, atol=2e-3)
    low = project_to_pixels(c2w, patches.directions.double(), k, lens=train.lens.take(views, 2))
    assert torch.allclose(low[..., 0], x0 + 2.0 * (torch.arange(3).double()[None, None, :] + 0.5), atol=2e-3)


def test_jittered_rays_land_in_their_pixels_through_the_lens(tmp_path):
    from test_pixel_jitter import assert_spread_over_the_pixel, where_in_pixel

    write_distorted_capture(tmp_path, count=6, size=(20, 28), coefficients=STRONG)
    train, _, _ = load_nerfstudio(tmp_path)
    sampler = RaySampler(train, 2048, torch.Generator().manual_seed(0), pixel_jitter=True)
    assert sampler.table is None  # the centres' table cannot serve jittered positions: undistorted per batch
    batch = sampler.sample()
    offsets = where_in_pixel(train, batch, lens=train.lens.take(batch.views))
    assert_spread_over_the_pixel(offsets, 2e-3)
    pinhole = where_in_pixel(train, batch)
    assert float((pinhole - offsets).abs().max()) > 0.2  # the lens matters here, so the check can fail


def test_bad_coefficients_are_refused_in_one_line():
    with pytest.raises(ValueError, match="cannot be inverted over the image"):
        check_invertible([-0.6, 0, 0, 0, 0, 0], False, CAMERA, SIZE)  # barrel so strong the corners have no ray
    # Newton converges on the image (an outer branch) but the map folds between the axis and the image: a
    # principal point far left of the image and a radial S-curve with a fold at r ~ 0.2..0.3
    with pytest.raises(ValueError, match="folds over within the image"):
        check_invertible([-11.1, 49.4, 0, 0, 0, 0], False, (600.0, 600.0, -400.0, 403.0), SIZE)
    with pytest.raises(ValueError, match="must be finite"):
        check_invertible([math.nan, 0, 0, 0, 0, 0], False, CAMERA, SIZE)
    with pytest.raises(ValueError, match="no tangential terms"):
        check_invertible([0, 0, 0, 0, 0.01, 0], True, CAMERA, SIZE)
    with pytest.raises(ValueError, match=r"shape \(\.\.\., 6\)"):
        Lens(torch.zeros(3, 5))


# ---- a distorted capture in instant-ngp form ------------------------------------------------------------------


def write_distorted_capture(root: Path, count: int, size, coefficients, seed: int = 0, cameras=None) -> Path:
    """The procedural scene seen through a distorted camera, written as instant-ngp does: one camera at the top
    level (camera_angle_x/y, fl_x, fl_y, cx, cy, float w/h, k1 k2 k3 k4 p1 p2, is_fisheye, aabb_scale), no
    camera_model key."""
    c2w = split_cameras(seed, count, 1, 0)["train"] if cameras is None else cameras
    height, width = size
    fx = 0.5 * width / math.tan(0.5 * 0.75)
    intrinsics = np.tile([fx, fx * 1.02, width / 2 + 0.7, height / 2 - 0.4], (len(c2w), 1))
    lens = Lens(torch.tensor([coefficients] * len(c2w), dtype=torch.float64))
    images = list(render_views(c2w, 0, seed, intrinsics, size, lens))
    path = write_nerfstudio(root, images, c2w, intrinsics, per_frame=False)
    meta = json.loads(path.read_text())
    del meta["camera_model"]
    meta.update(dict(zip(("k1", "k2", "k3", "k4", "p1", "p2"), coefficients)), is_fisheye=False, aabb_scale=4)
    meta.update(w=float(width), h=float(height), camera_angle_x=2 * math.atan(0.5 * width / fx))
    path.write_text(json.dumps(meta))
    return path


TRAIN_ARGS = [
    "device=cpu",
    "train.iters=150",
    "model.resolution_start=24",
    "model.resolution_end=32",
    "model.grow_at=[0.3]",
    "model.feature_dim=8",
    "model.decoder_hidden=16",
    "model.max_samples=48",
    "model.tv_samples=4096",
    "train.patch_size=6",
    "train.patches_per_batch=12",
    "train.log_every=50",
    "train.turntable_frames=0",
    "train.checkpoint_every=0",
]


def test_a_distorted_instant_ngp_capture_trains_as_captured(tmp_path):
    """The whole app on a distorted instant-ngp capture (CPU, a few steps): it loads, orients, trains, evaluates
    through the lens and learns something (whether the lens is right is the projection tests' job)."""
    write_distorted_capture(tmp_path / "cap", count=12, size=(24, 32), coefficients=STRONG, seed=2)
    run = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "train.py", "data=nerfstudio", f"data.root={tmp_path / 'cap'}", *TRAIN_ARGS,
         f"hydra.run.dir={run}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "the capture's aabb_scale box" in result.stdout
    metrics = json.loads((run / "metrics.json").read_text())
    print(f"held-out PSNR {metrics['psnr']:.2f} dB after {metrics['iters']} steps")
    assert metrics["iters"] == 150 and metrics["psnr"] > 14.0
