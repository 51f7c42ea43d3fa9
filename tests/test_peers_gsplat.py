"""bench/peers' 3DGS trainer (gsplat): camera conversion, SH colour, initial Gaussians, schedules, the loss, the
training loop on a stand-in rasteriser. The tests that need gsplat (its pure-PyTorch reference projection) or
gsplat and a GPU (training) skip without them."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from bench.peers.cameras import intrinsics_matrices, project, scene_scale, viewmats_from_c2w
from bench.peers.gaussians import (
    SH_C0,
    Recipe,
    initial_gaussians,
    learning_rates,
    make_optimizers,
    means_lr_at,
    neighbour_distance,
    opacity_reset_due,
    rgb_to_sh,
    sh_degree_at,
    sh_to_rgb,
)
from bench.peers.losses import photometric_loss, separable_filter_conv, ssim_differentiable
from bench.peers.scenes import load_peer_scene
from data import project_to_pixels
from data.cameras import look_at, random_zone_positions
from training.losses import separable_filter
from training.metrics import ssim

HAS_GSPLAT = importlib.util.find_spec("gsplat") is not None
needs_gsplat = pytest.mark.skipif(not HAS_GSPLAT, reason="gsplat is not installed (pip install gsplat==1.5.3)")
needs_gsplat_gpu = pytest.mark.skipif(
    not (HAS_GSPLAT and torch.cuda.is_available()), reason="needs gsplat and a CUDA GPU (gsplat's kernels)"
)


def random_cameras(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, 4, 4) float64 OpenGL cameras around the origin and (count, 4) random intrinsics."""
    rng = np.random.default_rng(seed)
    c2w = torch.from_numpy(look_at(random_zone_positions(count, 4.0, 0.1, 1.2, rng), target=rng.normal(0, 0.2, 3)))
    intrinsics = torch.from_numpy(
        np.stack(
            [
                rng.uniform(300, 500, count),
                rng.uniform(300, 500, count),
                rng.uniform(150, 250, count),
                rng.uniform(100, 200, count),
            ],
            -1,
        )
    )
    return c2w, intrinsics


# ------------------------------------------------------------------------------------------------ cameras
def test_viewmat_and_k_project_where_our_rays_come_from():
    """THE convention test: a world point projected with gsplat's viewmat + K lands on our pixel."""
    c2w, intrinsics = random_cameras(6, seed=4)
    rng = torch.Generator().manual_seed(5)
    points = torch.randn(6, 20, 3, generator=rng, dtype=torch.float64) * 0.5  # around the origin: in front
    ours = project_to_pixels(c2w[:, None], points - c2w[:, None, :3, 3], intrinsics[:, None])
    viewmats = viewmats_from_c2w(c2w)
    got = project(viewmats[:, None], intrinsics_matrices(intrinsics).double()[:, None], points)
    torch.testing.assert_close(got, ours, rtol=0, atol=1e-4)  # K is float32 (gsplat's dtype)
    depth = (viewmats[:, None, :3, :3] @ points[..., None])[..., 2, 0] + viewmats[:, None, 2, 3]
    assert bool((depth > 0).all())  # OpenCV: +z forward, so points in front have positive depth


def test_viewmat_of_a_known_camera():
    """A camera at (0, 0, 4) looking at the origin with world +y up in the image: +y is up (OpenCV: row decreases)."""
    c2w = torch.eye(4, dtype=torch.float64)
    c2w[2, 3] = 4.0  # OpenGL: looks down -z, towards the origin
    k = intrinsics_matrices(torch.tensor([100.0, 100.0, 50.0, 40.0])).double()
    pixels = project(
        viewmats_from_c2w(c2w), k, torch.tensor([[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]).double()
    )
    torch.testing.assert_close(pixels, torch.tensor([[50.0, 40.0], [50.0, 15.0], [75.0, 40.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match="c2w"):
        viewmats_from_c2w(torch.eye(3))


@needs_gsplat
def test_gsplat_reference_projection_agrees():
    from gsplat.cuda._torch_impl import _persp_proj, _world_to_cam

    c2w, intrinsics = random_cameras(3, seed=6)
    points = torch.randn(10, 3, generator=torch.Generator().manual_seed(7)) * 0.5
    covars = torch.eye(3).expand(10, 3, 3) * 1e-4
    means_c, covars_c = _world_to_cam(points, covars, viewmats_from_c2w(c2w.float()))
    means2d, _ = _persp_proj(means_c, covars_c, intrinsics_matrices(intrinsics), 400, 300)
    ours = project_to_pixels(c2w[:, None], points.double() - c2w[:, None, :3, 3], intrinsics[:, None])
    torch.testing.assert_close(means2d.double(), ours, rtol=0, atol=2e-3)


def test_scene_scale_is_the_camera_extent():
    c2w = torch.eye(4).repeat(3, 1, 1)
    c2w[:, :3, 3] = torch.tensor([[1.0, 0, 0], [-1.0, 0, 0], [0, 3.0, 0]])
    assert scene_scale(c2w) == pytest.approx(1.1 * math.dist((0, 3, 0), (0, 1, 0)))


# ------------------------------------------------------------------------------------------------ recipe
def test_sh_colour_round_trip_and_initial_gaussians():
    gen = torch.Generator().manual_seed(8)
    colours = torch.rand(64, 3, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(sh_to_rgb(rgb_to_sh(colours)), colours)
    points = torch.rand(64, 3, generator=gen) * 2 - 1
    params = initial_gaussians(points, colours, Recipe(), gen)
    shapes = {name: tuple(p.shape) for name, p in params.items()}
    assert shapes == {"means": (64, 3), "scales": (64, 3), "quats": (64, 4), "opacities": (64,), "sh0": (64, 1, 3),
                      "shN": (64, 15, 3)}  # fmt: skip
    torch.testing.assert_close((params["sh0"][:, 0] * SH_C0 + 0.5).double(), colours, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.sigmoid(params["opacities"]), torch.full((64,), 0.1))
    assert bool((params["shN"] == 0).all()) and all(p.requires_grad for p in params.values())
    distance = torch.cdist(points.double(), points.double()).square().sort(1).values[:, 1:4].mean(1).sqrt()
    torch.testing.assert_close(params["scales"].exp(), distance.float()[:, None].expand(64, 3), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(neighbour_distance(points, chunk=7), neighbour_distance(points, chunk=4096))


@needs_gsplat
def test_degree_zero_sh_renders_the_initial_colour():
    from gsplat.cuda._torch_impl import _spherical_harmonics

    colours = torch.rand(32, 3, generator=torch.Generator().manual_seed(9))
    coefficients = torch.zeros(32, 16, 3)
    coefficients[:, 0] = rgb_to_sh(colours)
    dirs = torch.randn(32, 3)
    torch.testing.assert_close(_spherical_harmonics(0, dirs, coefficients) + 0.5, colours)


def test_learning_rate_schedule_matches_exponential_decay():
    total, base = 50, 1.6e-4 * 4.0
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([param], lr=base)
    scheduler = torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.01 ** (1 / total))
    for step in range(total):
        assert means_lr_at(step, total, base) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9)
        optimizer.step()
        scheduler.step()
    assert means_lr_at(total, total, base) == pytest.approx(0.01 * base)
    rates = learning_rates(Recipe(), 4.0)
    assert rates == pytest.approx({"means": 6.4e-4, "scales": 5e-3, "quats": 1e-3, "opacities": 5e-2,
                                   "sh0": 2.5e-3, "shN": 1.25e-4})  # fmt: skip


def test_sh_degree_and_opacity_reset_schedules():
    recipe = Recipe()
    assert [sh_degree_at(s, recipe) for s in (0, 999, 1000, 1999, 2000, 3000, 29999)] == [0, 0, 1, 1, 2, 3, 3]
    due = [s for s in range(30000) if opacity_reset_due(s, recipe)]
    assert due == [3000, 6000, 9000, 12000]  # while densifying (steps < 15000), never at step 0


def test_training_ssim_equals_the_metric_and_has_gradients():
    gen = torch.Generator().manual_seed(10)
    pred, target = (torch.rand(20, 24, 3, generator=gen, dtype=torch.float64) for _ in range(2))
    assert float(ssim_differentiable(pred, target)) == pytest.approx(ssim(pred, target), abs=1e-12)
    small = (torch.rand(12, 13, 3, generator=gen, dtype=torch.float64).requires_grad_(), target[:12, :13])
    assert torch.autograd.gradcheck(lambda p: photometric_loss(p, small[1]), (small[0],), fast_mode=True)
    with pytest.raises(ValueError, match="pred and target"):
        ssim_differentiable(pred, target[:, :10])


def test_ssim_filter_is_the_convolution():
    """The banded matrix products equal the 'valid' separable convolution (float64, odd non-square sizes) and so
    does their gradient; a band first built under inference mode still takes part in a backward."""
    gen = torch.Generator().manual_seed(12)
    maps = torch.rand(15, 23, 31, generator=gen, dtype=torch.float64, requires_grad=True)
    out = separable_filter(maps)
    assert out.shape == (15, 13, 21)
    torch.testing.assert_close(out, separable_filter_conv(maps), rtol=0, atol=1e-15)
    weights = torch.rand(out.shape, generator=gen, dtype=torch.float64)
    (mine,) = torch.autograd.grad((out * weights).sum(), maps)
    (reference,) = torch.autograd.grad((separable_filter_conv(maps) * weights).sum(), maps)
    torch.testing.assert_close(mine, reference, rtol=0, atol=1e-15)
    with torch.inference_mode():
        separable_filter(torch.rand(2, 17, 19, dtype=torch.float64))
    fresh = torch.rand(2, 17, 19, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(separable_filter, (fresh,), fast_mode=True)
    with pytest.raises(ValueError, match="at least 11 pixels"):
        ssim_differentiable(torch.rand(10, 20, 3), torch.rand(10, 20, 3))


def test_adam_is_fused_only_on_cuda():
    params = {"means": torch.nn.Parameter(torch.rand(5, 3))}
    optimizer = make_optimizers(params, {"means": 0.1})["means"]
    assert optimizer.defaults["fused"] is None and optimizer.defaults["eps"] == 1e-15


def toy_rasterization(means, quats, scales, opacities, colors, viewmats, Ks, width, height, sh_degree, **_):
    """A pure-PyTorch stand-in for gsplat.rasterization (isotropic screen-space blobs, order-free compositing, SH
    degree 0) with the outputs DefaultStrategy reads: the trainer's plumbing runs on the CPU with it."""
    camera = (viewmats[0, :3, :3] @ means.T).T + viewmats[0, :3, 3]
    depth = camera[:, 2].clamp_min(1e-3)
    means2d = (camera[:, :2] / depth[:, None] * Ks[0, [0, 1], [0, 1]] + Ks[0, :2, 2])[None]
    sigma = scales.max(-1).values * Ks[0, 0, 0] / depth + 0.3
    rows, cols = torch.meshgrid(torch.arange(height) + 0.5, torch.arange(width) + 0.5, indexing="ij")
    pixels = torch.stack([cols, rows], -1).to(means)
    d2 = ((pixels[None] - means2d[0][:, None, None]) ** 2).sum(-1) / sigma[:, None, None] ** 2
    a = (opacities[:, None, None] * torch.exp(-0.5 * d2) * (camera[:, 2] > 0)[:, None, None]).clamp(max=0.99)
    alpha = 1 - torch.prod(1 - a, 0)
    rgb = (a[..., None] * (0.5 + SH_C0 * colors[:, 0])[:, None, None]).sum(0) / a.sum(0).clamp_min(1e-6)[..., None]
    radii = ((3 * sigma).ceil() * (camera[:, 2] > 0)).int()[None, :, None].expand(1, -1, 2)
    info = {"means2d": means2d, "radii": radii, "gaussian_ids": None, "width": width, "height": height, "n_cameras": 1}
    return (rgb * alpha[..., None])[None], alpha[None, ..., None], info


@needs_gsplat
def test_trainer_runs_on_the_cpu_with_a_stand_in_rasteriser(blender_scene):
    """The whole loop (DefaultStrategy's densification and pruning, the opacity reset, evaluations, the clock)
    with toy_rasterization: the entry's bookkeeping is right and densification changed the Gaussians."""
    from bench.peers.gsplat_trainer import train_gsplat

    scene = load_peer_scene(blender_scene)
    recipe = Recipe(init_points=300, refine_start=5, refine_every=5, reset_every=20, refine_stop=30, sh_interval=10)
    result = train_gsplat(scene, [20, 40], recipe, curve_every=10, curve_count=2, log=lambda line: None,
                          device="cpu", rasterization=toy_rasterization)  # fmt: skip
    assert [e["step"] for e in result["evaluations"]] == [20, 40] and [c["step"] for c in result["curve"]] == [
        10, 20, 30, 40]  # fmt: skip
    assert [c["views"] for c in result["curve"]] == [2, 3, 2, 3]  # the listed steps evaluate every view
    seconds = [c["train_seconds"] for c in result["curve"]]
    assert seconds == sorted(seconds) and seconds[0] > 0 and result["peak_memory_bytes"] is None
    assert result["evaluations"][0]["model_bytes"] > 300 * 59 * 4  # every Gaussian's 59 floats, saved
    assert result["evaluations"][-1]["num_gaussians"] != 300  # densified or pruned
    assert all(math.isfinite(c["psnr"]) for c in result["curve"])


def _recording(rasterization, infos: list):
    """``rasterization`` that culls every third Gaussian (radii 0, as gsplat marks one off screen) and keeps its
    info dicts in ``infos``."""

    def rasterize(*args, **kwargs):
        out = rasterization(*args, **kwargs)
        out[2]["radii"] = out[2]["radii"].clone()
        out[2]["radii"][:, ::3] = 0
        infos.append(out[2])
        return out

    return rasterize


@needs_gsplat
def test_densification_statistics_are_gsplats(blender_scene):
    """After one step the strategy's running statistic is, per visible Gaussian, the norm of means2d's gradient
    scaled to NDC (x width/2, y height/2, x n_cameras), and its count 1: the trainer retains means2d's gradient
    before backward and hands gsplat's info (width, height, n_cameras, radii, gaussian_ids) to the strategy."""
    from bench.peers.gsplat_trainer import GsplatTraining

    scene, infos = load_peer_scene(blender_scene), []
    training = GsplatTraining(
        scene, 50, Recipe(init_points=200), 0, torch.device("cpu"), _recording(toy_rasterization, infos)
    )
    assert training.scene_scale == scene_scale(scene.train.c2w) == training.state["scene_scale"]
    training.step(0)
    info = infos[0]
    grad = info["means2d"].grad[0].double() * torch.tensor([info["width"] / 2, info["height"] / 2]).double()
    visible = (info["radii"][0] > 0).all(-1)
    assert int(visible.sum()) == 200 - 67
    expected = torch.where(visible, grad.norm(dim=-1), torch.zeros(()).double())
    torch.testing.assert_close(training.state["grad2d"].double(), expected, rtol=1e-5, atol=1e-12)
    torch.testing.assert_close(training.state["count"], visible.float())
    assert float(expected.max()) > 0


@needs_gsplat
def test_step_profile_runs_the_training_loop(blender_scene):
    """bench.peers.step_profile on the CPU with the stand-in rasteriser: the plain timing, the phases of a step
    under the profiler, the tables, and the SSIM and Adam A/B timings."""
    from bench.peers.gsplat_trainer import GsplatTraining
    from bench.peers.step_profile import adam_ab, profile_steps, ssim_ab

    training = GsplatTraining(load_peer_scene(blender_scene), 50, Recipe(init_points=200, refine_start=2,
                              refine_every=3), 0, torch.device("cpu"), toy_rasterization)  # fmt: skip
    lines = []
    result = profile_steps(training, 0, 4, 5, lines.append)
    assert result["step_ms"] > 0 and set(result["phases_ms"]) == {
        "3dgs/render", "3dgs/loss", "3dgs/backward", "3dgs/adam", "3dgs/densify"}  # fmt: skip
    assert all(v["cpu_ms"] > 0 for v in result["phases_ms"].values())
    assert "top 5 ops by self CPU time" in "\n".join(lines)
    assert set(ssim_ab(16, 20, torch.device("cpu"), repeats=1)) == {"matmul", "conv"}
    assert set(adam_ab(training.splats.params, repeats=1)) == {"foreach"}


# ------------------------------------------------------------------------------------------------ on the GPU
@needs_gsplat_gpu
def test_one_gaussian_lands_on_our_pixel():
    """gsplat renders a small Gaussian at a world point where data.rays projects that point."""
    import gsplat

    from bench.peers.gsplat_trainer import Splats

    c2w, intrinsics = random_cameras(1, seed=11)
    point = torch.tensor([[0.1, -0.2, 0.15]])
    params = {"means": point, "quats": torch.tensor([[1.0, 0, 0, 0]]), "scales": torch.full((1, 3), math.log(0.01)),
              "opacities": torch.tensor([3.0]), "sh0": torch.ones(1, 1, 3), "shN": torch.zeros(1, 0, 3)}  # fmt: skip
    splats = Splats({k: v.cuda() for k, v in params.items()}, gsplat.rasterization)
    _, alpha, _ = splats.render(viewmats_from_c2w(c2w.float())[0].cuda(), intrinsics_matrices(intrinsics)[0].cuda(),
                                400, 300, 0, torch.zeros(3, device="cuda"))  # fmt: skip
    weights = alpha[..., 0].double().cpu()
    rows, cols = torch.meshgrid(torch.arange(300) + 0.5, torch.arange(400) + 0.5, indexing="ij")
    centre = torch.stack([(weights * cols).sum(), (weights * rows).sum()]) / weights.sum()
    expected = project_to_pixels(c2w[0], point[0].double() - c2w[0, :3, 3], intrinsics[0])
    torch.testing.assert_close(centre, expected, rtol=0, atol=0.05)


@needs_gsplat_gpu
def test_short_training_run_reports(blender_scene):
    from bench.peers.gsplat_trainer import train_gsplat

    scene = load_peer_scene(blender_scene)
    recipe = Recipe(init_points=2000, refine_start=50, refine_every=50, reset_every=150, sh_interval=50)
    result = train_gsplat(scene, [100, 300], recipe, curve_every=100, curve_count=2, log=lambda line: None)
    first, last = result["evaluations"]
    assert [e["step"] for e in result["evaluations"]] == [100, 300] and len(result["curve"]) == 3
    assert last["train_seconds"] > first["train_seconds"] > 0 and last["model_bytes"] > 0
    assert result["peak_memory_bytes"] > 0 and math.isfinite(last["psnr"])
