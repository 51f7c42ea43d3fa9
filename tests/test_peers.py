"""bench/peers: the CLI, our scenes and splits, our metrics, the plot, and the 3DGS trainer's pure-PyTorch parts
(camera conversion, SH colour, initial Gaussians, schedules, the loss, undistortion). The tests that need gsplat
(its pure-PyTorch reference projection) or gsplat and a GPU (training) skip without them."""

from __future__ import annotations

import importlib.util
import json
import math
import tempfile

import numpy as np
import pytest
import torch

from bench.peers import run as peers_run
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
from bench.peers.metrics import curve_views, evaluate_views
from bench.peers.plot import COLOURS, method_curves, plot_results
from bench.peers.results import merge_method, our_entry, read_results, table_rows
from bench.peers.scenes import data_config, data_overrides, load_peer_scene, scene_kind
from bench.peers.undistort import opencv_distort, undistort_image
from data import project_to_pixels, write_blender_split
from data.cameras import look_at, random_zone_positions
from data.nerfstudio import write_nerfstudio
from training.losses import separable_filter
from training.metrics import psnr, ssim
from training.scenes import load_scenes

HAS_GSPLAT = importlib.util.find_spec("gsplat") is not None
needs_gsplat = pytest.mark.skipif(not HAS_GSPLAT, reason="gsplat is not installed (pip install gsplat==1.5.3)")
needs_gsplat_gpu = pytest.mark.skipif(
    not (HAS_GSPLAT and torch.cuda.is_available()), reason="needs gsplat and a CUDA GPU (gsplat's kernels)"
)
DISTORTION = {"k1": -0.05, "k2": 0.02, "k3": -0.004, "k4": 0.0, "p1": 0.011, "p2": -0.0096}


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


# ------------------------------------------------------------------------------------------------ the CLI
def test_arguments_parse_and_defaults():
    args = peers_run.parse_args(
        ["--scene", "lego_400", "--data-root", "x", "--method", "gsplat", "--steps", "7000,30000"]
    )
    assert args.steps == [7000, 30000] and args.curve_every == 1000 and args.curve_views == 4
    assert peers_run.parse_args(["--scene", "s", "--data-root", "x", "--method", "gsplat"]).steps == [7000]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--method", "gsplat", "--steps", "7000,abc"], "--steps"),
        (["--method", "gsplat", "--steps", "30000,7000"], "--steps"),
        (["--method", "gsplat", "--steps", "0"], "--steps"),
        (["--method", "ours"], "--ours-run"),
        (["--method", "gsplat", "--ours-run", "r"], "--ours-run"),
        (["--method", "nerf"], "--method"),
        (["--method", "gsplat", "--curve-views", "0"], "--curve-views"),
    ],
)
def test_bad_arguments_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit):
        peers_run.parse_args(["--scene", "s", "--data-root", "x", *argv])
    assert message in capsys.readouterr().err


def test_bad_scene_name_is_refused(capsys):
    with pytest.raises(SystemExit):
        peers_run.parse_args(["--scene", "../x", "--data-root", "x", "--method", "gsplat"])
    assert "--scene" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ scenes
@pytest.fixture
def blender_scene(tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "tiny blender"  # a space: the override must be quoted
    for split, count in (("train", 5), ("val", 3)):
        c2w = look_at(random_zone_positions(count, 4.0, 0.1, 1.0, rng))
        images = [rng.integers(0, 256, (16, 16, 4), dtype=np.uint8) for _ in range(count)]
        write_blender_split(root, split, images, c2w, 0.7)
    return root


def _capture(root, distortion: dict | None, count: int = 17, seed: int = 1):
    rng = np.random.default_rng(seed)
    c2w = look_at(random_zone_positions(count, 4.0, 0.2, 1.0, rng))
    images = [rng.integers(0, 256, (24, 20, 3), dtype=np.uint8) for _ in range(count)]
    intrinsics = np.tile([[30.0, 31.0, 10.5, 11.5]], (count, 1))
    write_nerfstudio(root, images, c2w, intrinsics, per_frame=False, extra=distortion)
    return root


def test_blender_scene_is_ours(blender_scene):
    peer = load_peer_scene(blender_scene)
    train, evaluation = load_scenes(data_config(data_overrides(blender_scene, "blender")), "cpu")
    assert peer.kind == "blender" and peer.distortion is None and peer.eval.split == "val"
    for mine, ours in ((peer.train, train), (peer.eval, evaluation)):
        assert torch.equal(mine.images, ours.images) and torch.equal(mine.c2w, ours.c2w) and mine.names == ours.names
    assert peer.train.background == (1.0, 1.0, 1.0) and peer.data["name"] == "blender"


def test_capture_split_is_every_eighth_frame_by_name(tmp_path):
    root = _capture(tmp_path / "cap", None)
    peer = load_peer_scene(root, name="cap")
    names = sorted(f"images/frame_{i:05d}.png" for i in range(17))
    assert peer.kind == "nerfstudio" and peer.name == "cap"
    assert peer.eval.names == names[::8] and peer.train.names == [n for i, n in enumerate(names) if i % 8]


def test_distorted_capture_is_undistorted_from_the_same_split(tmp_path, monkeypatch):
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))  # where the shadow folder goes
    plain = load_peer_scene(_capture(tmp_path / "plain", None))
    distorted = load_peer_scene(_capture(tmp_path / "distorted", DISTORTION))
    assert distorted.distortion is not None and distorted.eval.names == plain.eval.names
    for mine, raw in ((distorted.train, plain.train), (distorted.eval, plain.eval)):
        expected = torch.stack([undistort_image(image, k, DISTORTION) for image, k in zip(raw.images, raw.intrinsics)])
        assert torch.equal(mine.images, expected) and torch.equal(mine.c2w, raw.c2w)
        assert not torch.equal(mine.images, raw.images)
    assert not list((tmp_path / "temp").iterdir())  # the shadow folder is gone
    assert len(list((tmp_path / "distorted" / "images").iterdir())) == 17  # and the scene's files are not


def test_scene_kind_and_overrides_errors(tmp_path):
    with pytest.raises(ValueError, match="--data-root"):
        scene_kind(tmp_path / "missing")
    with pytest.raises(ValueError, match="--data-root"):
        scene_kind(tmp_path)
    with pytest.raises(ValueError, match="--data-override"):
        data_overrides(tmp_path, "blender", ["train.iters=5"])


# ------------------------------------------------------------------------------------------------ undistortion
def test_opencv_distortion_formula():
    rng = np.random.default_rng(2)
    x, y = rng.uniform(-0.6, 0.6, 50), rng.uniform(-0.6, 0.6, 50)
    k1, k2, k3, k4, p1, p2 = (DISTORTION[k] for k in ("k1", "k2", "k3", "k4", "p1", "p2"))
    r2 = x**2 + y**2
    radial = 1 + k1 * r2 + k2 * r2**2 + k3 * r2**3 + k4 * r2**4
    expected = np.stack([x * radial + 2 * p1 * x * y + p2 * (r2 + 2 * x**2),
                         y * radial + p1 * (r2 + 2 * y**2) + 2 * p2 * x * y], -1)  # fmt: skip
    got = opencv_distort(torch.from_numpy(x), torch.from_numpy(y), DISTORTION).numpy()
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="k5"):
        opencv_distort(torch.zeros(1), torch.zeros(1), {"k5": 1.0})


def _undistort_point(xd: np.ndarray, yd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Invert the distortion by fixed-point iteration (float64), the test's reference."""
    x, y = xd.copy(), yd.copy()
    for _ in range(50):
        d = opencv_distort(torch.from_numpy(x), torch.from_numpy(y), DISTORTION).numpy()
        x, y = x + (xd - d[..., 0]), y + (yd - d[..., 1])
    return x, y


def test_undistort_image_recovers_the_pinhole_image():
    """A photo made through the distortion from a smooth pinhole image comes back as that image."""
    height, width, (fx, fy, cx, cy) = 60, 80, (70.0, 72.0, 41.0, 29.5)

    def pinhole(u, v):  # a smooth image of continuous pixel positions, 3 channels
        return np.stack(
            [0.5 + 0.4 * np.sin(u / 9.0), 0.5 + 0.4 * np.cos(v / 7.0), 0.5 + 0.3 * np.sin((u + v) / 11)], -1
        )

    v, u = np.meshgrid(np.arange(height) + 0.5, np.arange(width) + 0.5, indexing="ij")
    x, y = _undistort_point((u - cx) / fx, (v - cy) / fy)  # the photo's pixel centres seen from the pinhole
    photo = torch.from_numpy(pinhole(fx * x + cx, fy * y + cy))
    got = undistort_image(photo, (fx, fy, cx, cy), DISTORTION).numpy()
    inner = (slice(6, -6), slice(6, -6))  # the border band samples outside the photo (edge repeated)
    np.testing.assert_allclose(got[inner], pinhole(u, v)[inner], atol=3e-3)
    plain = undistort_image(photo, (fx, fy, cx, cy), {})
    np.testing.assert_allclose(plain.numpy(), photo.numpy(), atol=1e-6)  # no distortion: the photo itself
    bytes_ = (photo * 255).round().to(torch.uint8)
    assert torch.equal(undistort_image(bytes_, (fx, fy, cx, cy), {}), bytes_)


# ------------------------------------------------------------------------------------------------ metrics
def test_evaluate_views_is_our_evaluation(blender_scene):
    scene = load_peer_scene(blender_scene).eval
    rng = torch.Generator().manual_seed(3)
    noise = [torch.rand(scene.height, scene.width, 3, generator=rng, dtype=torch.float64) * 0.2 for _ in range(3)]
    targets = [scene.images[v].double() / 255 for v in range(3)]
    lookup = {tuple(scene.c2w[v].flatten().tolist()): v for v in range(3)}

    def render(c2w, height, width, intrinsics):
        view = lookup[tuple(c2w.flatten().tolist())]
        return (targets[view] + noise[view]).clamp(0, 1)

    result = evaluate_views(render, scene)
    expected = [psnr((targets[v] + noise[v]).clamp(0, 1).float(), targets[v].float()) for v in range(3)]
    assert [v["psnr"] for v in result["per_view"]] == pytest.approx(expected, abs=1e-9)
    assert result["psnr"] == pytest.approx(np.mean(expected)) and result["views"] == 3
    assert result["psnr_worst10"] == pytest.approx(min(expected))  # ceil(3 / 10) = 1 view
    assert result["ssim"] == pytest.approx(
        np.mean([ssim((targets[v] + noise[v]).clamp(0, 1).float(), targets[v].float()) for v in range(3)])
    )
    assert curve_views(scene, 2) == [0, 2]
    with pytest.raises(ValueError, match="expected an"):
        evaluate_views(lambda c2w, h, w, k: torch.zeros(h, w), scene)


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


# ------------------------------------------------------------------------------------------------ results, plot
def _fake_run(folder, psnr_value=30.0):
    folder.mkdir(parents=True)
    history = [{"step": s, "train_seconds": s / 50, "psnr": 20 + s / 100, "ssim": 0.9, "psnr_worst10": 19.0}
               for s in (500, 1000)]  # fmt: skip
    metrics = {"psnr": psnr_value, "ssim": 0.95, "psnr_worst10": 27.0, "worst_views": [3], "per_view": [{}] * 10,
               "iters": 1500, "train_seconds": 30.0, "eval_views": 10, "eval_history": history,
               "device": "cuda:0 (NVIDIA H100 80GB HBM3)"}  # fmt: skip
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "model.pt").write_bytes(b"x" * 1000)
    return folder


def test_our_entry_reads_the_run(tmp_path):
    entry = our_entry(_fake_run(tmp_path / "run"))
    assert entry["evaluations"][0]["model_bytes"] == 1000 and entry["evaluations"][0]["psnr"] == 30.0
    assert [p["step"] for p in entry["curve"]] == [500, 1000, 1500]
    with pytest.raises(ValueError, match="--ours-run"):
        our_entry(tmp_path / "nothing")


def test_results_merge_and_plot(tmp_path):
    path = tmp_path / "r" / "2026-11-25-lego_400.json"
    merge_method(path, {"scene": "lego_400", "date": "2026-11-25"}, "ours", our_entry(_fake_run(tmp_path / "run")))
    curve = [{"train_seconds": t, "psnr": p} for t, p in ((40.0, 31.0), (10.0, 25.0), (60.0, 33.1))]
    peer = {"device": "H100", "evaluations": [{"step": 7000, "train_seconds": 60.0, "psnr": 33.1, "ssim": 0.97,
            "psnr_worst10": 29.0, "model_bytes": 2**21}], "curve": curve}  # fmt: skip
    content = merge_method(path, {"scene": "lego_400", "date": "2026-11-25", "device": "H100"}, "gsplat", peer)
    assert set(read_results(path)["methods"]) == {"ours", "gsplat"} and content["device"] == "H100"
    curves = method_curves(content)
    assert curves["gsplat"][0].tolist() == [10.0, 40.0, 60.0]  # sorted by time
    rows = table_rows(content)
    assert (
        rows[1] == "| 2026-11-25 | H100 | lego_400 | gsplat (7000 steps) | 33.10 (29.00) | 0.9700 | 60.0 s | 2.0 MiB |"
    )
    png = tmp_path / "plot.png"
    plot_results(content, png)
    import imageio.v3 as iio

    image = iio.imread(png)
    assert image.shape == (440, 720, 3)
    for colour in COLOURS[:2]:  # both curves are drawn
        assert bool((np.abs(image.astype(float) - colour).sum(-1) < 1).any())
    path.write_text("{")
    with pytest.raises(ValueError, match="malformed"):
        read_results(path)


def test_curve_keeps_one_view_set():
    """The final evaluation (every view) joins the curve as its PSNR on the periodic views' subset, from its
    per-view PSNRs, so a line never drops or jumps only because the view set changed."""
    per_view = [{"view": v, "psnr": 20.0 + v} for v in range(11)]  # spread_views(11, 4) = [0, 3, 7, 10]
    entry = {
        "curve": [
            {"step": 1000, "train_seconds": 10.0, "psnr": 27.0, "views": 4},
            {"step": 2000, "train_seconds": 20.0, "psnr": 25.0, "views": 11},
        ],
        "evaluations": [{"step": 2000, "psnr": 25.0, "per_view": per_view}],
    }
    curves = method_curves({"eval_views": 11, "methods": {"peer": entry}})
    assert curves["peer"][1].tolist() == [27.0, 20.0 + (0 + 3 + 7 + 10) / 4]
    # no per-view figures, or a file without the split's size: the recorded PSNR
    assert method_curves({"methods": {"peer": entry}})["peer"][1].tolist() == [27.0, 25.0]
    entry["evaluations"][0]["per_view"] = None
    assert method_curves({"eval_views": 11, "methods": {"peer": entry}})["peer"][1].tolist() == [27.0, 25.0]


def test_cli_records_our_run(tmp_path, capsys):
    run_dir = _fake_run(tmp_path / "run")
    argv = ["--scene", "lego_400", "--data-root", str(tmp_path), "--method", "ours", "--ours-run", str(run_dir),
            "--out", str(tmp_path / "out"), "--date", "2026-11-25"]  # fmt: skip
    assert peers_run.main(argv) == 0
    assert (tmp_path / "out" / "2026-11-25-lego_400.png").is_file()
    assert "| ours (1500 steps) | 30.00 (27.00) |" in capsys.readouterr().out
    assert peers_run.main([*argv[:7], str(tmp_path / "none"), *argv[8:]]) == 1
    assert "--ours-run" in capsys.readouterr().err


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


# ------------------------------------------------------------------------------------------------ the NeRF peer
HAS_NERFACC = importlib.util.find_spec("nerfacc") is not None
needs_nerfacc_gpu = pytest.mark.skipif(
    not (HAS_NERFACC and torch.cuda.is_available()), reason="needs nerfacc and a CUDA GPU (its CUDA kernels)"
)


def _brute_force_hash_encoding(encoding, points: torch.Tensor) -> torch.Tensor:
    """Point by point, level by level, corner by corner in float64 with Python integers (the module doc's rule)."""
    table = encoding.table.detach().double()
    out = torch.zeros(points.shape[0], encoding.levels, encoding.features, dtype=torch.float64)
    for n, point in enumerate(points.double().tolist()):
        for level, res in enumerate(encoding.resolutions):
            scaled = [min(max(c, 0.0), 1.0) * res for c in point]
            cell = [min(int(math.floor(s)), res - 1) for s in scaled]
            for bits in range(8):
                vertex = [cell[a] + ((bits >> a) & 1) for a in range(3)]
                weight = 1.0
                for a in range(3):
                    frac = scaled[a] - cell[a]
                    weight *= frac if (bits >> a) & 1 else 1.0 - frac
                if (res + 1) ** 3 <= encoding.table_size:
                    slot = vertex[0] + vertex[1] * (res + 1) + vertex[2] * (res + 1) ** 2
                else:
                    slot = (vertex[0] ^ vertex[1] * 2654435761 ^ vertex[2] * 805459861) % encoding.table_size
                out[n, level] += weight * table[level, slot]
    return out.reshape(points.shape[0], -1)


def test_hash_encoding_is_trilinear_over_dense_and_hashed_levels():
    from bench.peers.hash_encoding import HashEncoding

    torch.manual_seed(0)
    encoding = HashEncoding(levels=3, log2_size=6, features=2, base=2, finest=8).double()
    assert encoding.resolutions == [2, 4, 8]  # 27 vertices fit in 64 slots (dense); 125 and 729 do not (hashed)
    with torch.no_grad():
        encoding.table.normal_()  # O(1) entries, not the 1e-4 initialisation: a wrong weight shows
    points = torch.cat([torch.rand(40, 3, dtype=torch.float64), torch.tensor([[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]])])
    points = torch.cat([points, torch.tensor([[-0.2, 0.3, 1.4]], dtype=torch.float64)])  # outside: clamped
    torch.testing.assert_close(encoding(points), _brute_force_hash_encoding(encoding, points), rtol=1e-12, atol=1e-12)


def test_hash_encoding_gradients():
    from bench.peers.hash_encoding import HashEncoding

    torch.manual_seed(1)
    encoding = HashEncoding(levels=2, log2_size=5, features=2, base=2, finest=5).double()
    with torch.no_grad():
        encoding.table.normal_()
    points = (0.05 + 0.9 * torch.rand(6, 3, dtype=torch.float64)).requires_grad_()
    table = encoding.table.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: torch.func.functional_call(encoding, {"table": t}, (points,)), (table,))
    assert torch.autograd.gradcheck(encoding, (points,))


def test_hash_grid_levels_are_instant_ngps():
    from bench.peers.hash_encoding import HashEncoding, level_resolutions

    resolutions = level_resolutions(16, 16, 4096)
    assert resolutions[0] == 16 and resolutions[-1] == 4096 and resolutions == sorted(resolutions)
    growth = math.exp(math.log(256) / 15)
    assert resolutions == [math.floor(16 * growth**level + 1e-9) for level in range(16)]
    encoding = HashEncoding()
    assert tuple(encoding.table.shape) == (16, 1 << 19, 2) and encoding.output_dim == 32
    assert float(encoding.table.detach().abs().max()) <= 1e-4
    with pytest.raises(ValueError, match="points"):
        encoding(torch.rand(4, 2))
    with pytest.raises(ValueError, match="log2_size"):
        HashEncoding(log2_size=0)


def test_sh_encoding_is_orthonormal_on_the_sphere():
    from bench.peers.hash_encoding import sh_encoding

    count = 40000  # a Fibonacci lattice: equal-area points, the integral as a mean
    index = torch.arange(count, dtype=torch.float64) + 0.5
    z = 1.0 - 2.0 * index / count
    phi = math.pi * (1.0 + math.sqrt(5.0)) * index
    radius = torch.sqrt(1.0 - z * z)
    directions = torch.stack([radius * torch.cos(phi), radius * torch.sin(phi), z], -1)
    basis = sh_encoding(directions)
    gram = 4.0 * math.pi * basis.T @ basis / count
    torch.testing.assert_close(gram, torch.eye(16, dtype=torch.float64), rtol=0, atol=2e-3)
    # the functions without lower-degree terms are homogeneous: x -> 2x scales degree l by 2^l
    homogeneous = {1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 7: 2, 8: 2, 9: 3, 10: 3, 14: 3, 15: 3}
    scaled = sh_encoding(directions[:5] * 2.0)
    for column, degree in homogeneous.items():
        torch.testing.assert_close(scaled[:, column], basis[:5, column] * 2.0**degree)


def test_ngp_schedule_is_torchs_chained_schedulers():
    from bench.peers.nerfacc_trainer import NgpRecipe, lr_factor

    total, recipe = 2000, NgpRecipe()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    milestones = [total // 2, total * 3 // 4, total * 9 // 10]
    schedulers = [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=100),
                  torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.33)]  # fmt: skip
    for step in range(total):
        assert lr_factor(step, total, recipe) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9), step
        optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
    assert lr_factor(total - 1, total, recipe) == pytest.approx(0.33**3)


def test_dynamic_ray_count_aims_at_the_sample_budget():
    from bench.peers.nerfacc_trainer import next_ray_count

    assert next_ray_count(1024, 1 << 16, 1 << 18) == 4096  # 64 samples a ray: 4096 rays march 2^18
    assert next_ray_count(4096, 1 << 20, 1 << 18) == 1024
    assert next_ray_count(1024, 0, 1 << 18) == 1024  # nothing marched: keep
    assert next_ray_count(1024, 1, 1 << 18) == 1 << 18  # at most one ray per budgeted sample
    assert next_ray_count(3, 1 << 30, 1 << 18) == 1


def test_marching_bounded_and_unbounded(blender_scene, tmp_path):
    from bench.peers.nerfacc_trainer import NgpRecipe, marching_for
    from data.bounds import focus_point

    bounded = marching_for(load_peer_scene(blender_scene), NgpRecipe())
    assert bounded.levels == 1 and bounded.cone_angle == 0.0 and bounded.scale == 1.0
    box = load_peer_scene(blender_scene).train.bbox
    assert bounded.step_size == pytest.approx(math.sqrt(3) * float((box[1] - box[0]).max()) / 1024)
    target = np.array([0.3, -0.2, 0.5])
    cameras = torch.from_numpy(look_at(random_zone_positions(9, 4.0, 0.1, 1.0, np.random.default_rng(3)) + target,
                                       target=target))  # fmt: skip
    found = torch.from_numpy(focus_point(cameras.numpy()))
    torch.testing.assert_close(found, torch.from_numpy(target), rtol=0, atol=1e-9)
    capture = load_peer_scene(_capture(tmp_path / "cap", None))
    unbounded = marching_for(capture, NgpRecipe())
    assert unbounded.levels == 4 and unbounded.roi == (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0) and unbounded.cone_angle > 0
    centres = (capture.train.c2w[:, :3, 3].double() - torch.tensor(unbounded.centre)) * unbounded.scale
    assert float(centres.norm(dim=-1).median()) == pytest.approx(1.0)


def test_nerfacc_arguments():
    args = peers_run.parse_args(["--scene", "s", "--data-root", "x", "--method", "nerfacc"])
    assert args.steps == [20000]
    assert peers_run.parse_args(["--scene", "s", "--data-root", "x", "--method", "gsplat"]).steps == [7000]
    with pytest.raises(SystemExit):
        peers_run.parse_args(["--scene", "s", "--data-root", "x", "--method", "nerfacc", "--ours-run", "r"])


class StandInEstimator(torch.nn.Module):
    """A pure-PyTorch stand-in for nerfacc's OccGridEstimator: its boxes (each level twice the last), a fixed
    number of evenly spaced samples per ray from the near plane across the largest box, and a record of the
    occupancy updates (every n-th step, the occupancy function called on points inside the boxes)."""

    def __init__(self, roi_aabb, resolution=128, levels=1, samples=6):
        super().__init__()
        centre, half = (roi_aabb[:3] + roi_aabb[3:]) / 2, (roi_aabb[3:] - roi_aabb[:3]) / 2
        self.register_buffer("aabbs", torch.stack([torch.cat([centre - half * 2**i, centre + half * 2**i])
                                                   for i in range(levels)]))  # fmt: skip
        self.register_buffer("binaries", torch.ones(levels, 2, 2, 2, dtype=torch.bool))
        self.samples, self.updates = samples, []

    def update_every_n_steps(self, step, occ_eval_fn, occ_thre=1e-2, n=16):
        if step % n == 0:
            box = self.aabbs[-1]
            occupancy = occ_eval_fn(box[:3] + torch.rand(32, 3) * (box[3:] - box[:3]))
            assert occupancy.shape == (32,) and bool((occupancy >= 0).all())
            self.updates.append(step)

    def sampling(self, rays_o, rays_d, sigma_fn, near_plane, render_step_size, stratified, cone_angle, alpha_thre):
        rays, span = rays_o.shape[0], float((self.aabbs[-1, 3:] - self.aabbs[-1, :3]).norm())
        edges = near_plane + rays_o.norm(dim=-1, keepdim=True) - span / 2 + torch.linspace(0, span, self.samples + 1)
        edges = edges.clamp_min(near_plane)
        indices = torch.arange(rays).repeat_interleave(self.samples)
        starts, ends = edges[:, :-1].reshape(-1), edges[:, 1:].reshape(-1)
        assert sigma_fn(starts, ends, indices).shape == starts.shape
        return indices, starts, ends


def stand_in_rendering(t_starts, t_ends, ray_indices, n_rays, rgb_sigma_fn, render_bkgd):
    """nerfacc.rendering's compositing in PyTorch, for samples grouped by ray in equal numbers (the stand-in's)."""
    rgbs, sigmas = rgb_sigma_fn(t_starts, t_ends, ray_indices)
    tau = (sigmas * (t_ends - t_starts)).reshape(n_rays, -1)
    alphas = 1 - torch.exp(-tau)
    trans = torch.exp(-torch.cumsum(torch.cat([torch.zeros_like(tau[:, :1]), tau[:, :-1]], 1), 1))
    weights = (alphas * trans)[..., None]
    opacity = weights.sum(1)
    rgb = (weights * rgbs.reshape(n_rays, -1, 3)).sum(1) + render_bkgd * (1 - opacity)
    return rgb, opacity, None, {"weights": weights}


def _stand_in_backend():
    from bench.peers.nerfacc_trainer import NerfaccBackend

    return NerfaccBackend(StandInEstimator, stand_in_rendering, "stand-in")


def _small_recipe():
    from bench.peers.nerfacc_trainer import NgpRecipe

    return NgpRecipe(init_rays=64, target_samples=384, hash_levels=4, hash_log2_size=10, hash_finest=32,
                     eval_chunk_rays=100, occ_every=4)  # fmt: skip


@pytest.mark.parametrize("kind", ["blender", "capture"])
def test_nerfacc_trainer_runs_on_the_cpu_with_stand_ins(kind, blender_scene, tmp_path):
    """The whole loop (ray batches, schedule, occupancy updates, evaluations in chunks, the clock, the model file)
    with a stand-in estimator and renderer: the entry's bookkeeping is right, the batch adapted to the sample
    budget and the loss fell on the training pixels."""
    from bench.peers.nerfacc_trainer import train_nerfacc

    scene = load_peer_scene(blender_scene if kind == "blender" else _capture(tmp_path / "cap", None))
    backend, lines = _stand_in_backend(), []
    result = train_nerfacc(scene, [4, 12], _small_recipe(), curve_every=4, curve_count=2, log=lines.append,
                           device="cpu", backend=backend, keep_model=str(tmp_path / "m{step}.pt"))  # fmt: skip
    assert [e["step"] for e in result["evaluations"]] == [4, 12] and [c["step"] for c in result["curve"]] == [4, 8, 12]
    assert [c["views"] for c in result["curve"]] == [scene.eval.num_views, 2, scene.eval.num_views]
    seconds = [c["train_seconds"] for c in result["curve"]]
    assert seconds == sorted(seconds) and seconds[0] > 0 and result["peak_memory_bytes"] is None
    assert result["curve"][-1]["rays"] == 384 // 6  # 6 samples a ray: the batch fills the 384-sample budget
    final = result["evaluations"][-1]
    assert final["model_bytes"] == (tmp_path / "m12.pt").stat().st_size > 4 * 2**10 * 2 * 4  # the hash table
    saved = torch.load(tmp_path / "m12.pt", weights_only=False)
    assert set(saved) == {"field", "occupancy", "aabbs", "marching"}
    assert result["marching"]["levels"] == (1 if kind == "blender" else 4)
    assert all(math.isfinite(c["psnr"]) for c in result["curve"]) and len(lines) == 3


def test_nerfacc_training_fits_the_training_pixels(blender_scene):
    """With the stand-ins, 60 steps on images of one colour lower the loss (the gradients reach the hash table and
    the MLPs through the compositing) and the occupancy is updated every occ_every steps."""
    import dataclasses

    from bench.peers.nerfacc_trainer import NerfaccTraining

    scene = load_peer_scene(blender_scene)
    flat = torch.tensor([200, 60, 30], dtype=torch.uint8).expand_as(scene.train.images).contiguous()
    scene.train = dataclasses.replace(scene.train, images=flat, alpha=None)
    recipe = dataclasses.replace(_small_recipe(), random_background=False)
    training = NerfaccTraining(scene, 60, recipe, 0, "cpu", _stand_in_backend())
    losses = [float(training.step(step)) for step in range(60)]
    assert training.estimator.updates == list(range(0, 60, 4))
    assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:10])
    assert training.field.encoding.table.grad is not None and float(training.field.encoding.table.grad.abs().max()) > 0


@needs_nerfacc_gpu
def test_stand_in_compositing_is_nerfaccs():
    """The CPU tests' stand-in renderer equals nerfacc.rendering (so what they check holds for nerfacc)."""
    import nerfacc

    rays, samples = 5, 7
    starts = torch.sort(torch.rand(rays, samples) * 4, dim=1).values
    ends = starts + 0.1 * torch.rand(rays, samples)
    indices = torch.arange(rays).repeat_interleave(samples)
    rgbs, sigmas = torch.rand(rays * samples, 3), 5 * torch.rand(rays * samples)
    background = torch.rand(3)
    expected = stand_in_rendering(starts.reshape(-1), ends.reshape(-1), indices, rays, lambda *a: (rgbs, sigmas),
                                  background)[0]  # fmt: skip
    cuda = [t.cuda() for t in (starts.reshape(-1), ends.reshape(-1), indices, rgbs, sigmas, background)]
    got = nerfacc.rendering(*cuda[:3], n_rays=rays, rgb_sigma_fn=lambda *a: (cuda[3], cuda[4]), render_bkgd=cuda[5])
    torch.testing.assert_close(got[0].cpu(), expected, rtol=1e-5, atol=1e-6)


@needs_nerfacc_gpu
def test_nerfacc_short_training_run_reports(blender_scene):
    from bench.peers.nerfacc_trainer import train_nerfacc

    scene = load_peer_scene(blender_scene)
    result = train_nerfacc(load_peer_scene(blender_scene), [100, 300], curve_every=100, curve_count=2,
                           log=lambda line: None)  # fmt: skip
    first, last = result["evaluations"]
    assert [e["step"] for e in result["evaluations"]] == [100, 300] and len(result["curve"]) == 3
    assert last["train_seconds"] > first["train_seconds"] > 0 and last["model_bytes"] > 16 * 2**19 * 2 * 4 * 0.5
    assert result["peak_memory_bytes"] > 0 and math.isfinite(last["psnr"]) and scene.eval.num_views == last["views"]
