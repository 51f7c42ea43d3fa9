"""bench/peers, the harness: the CLI, our scenes and splits (undistorted for the peers that need a pinhole), our
metrics, the results file and the plot. The 3DGS trainer: tests/test_peers_gsplat.py; the NeRF peer:
tests/test_peers_nerfacc.py."""

from __future__ import annotations

import json
import tempfile

import numpy as np
import pytest
import torch

from bench.peers import run as peers_run
from bench.peers.metrics import curve_views, evaluate_views
from bench.peers.plot import COLOURS, method_curves, plot_results
from bench.peers.results import merge_method, our_entry, read_results, table_rows
from bench.peers.scenes import data_config, data_overrides, load_peer_scene, scene_kind
from bench.peers.undistort import opencv_distort, undistort_image
from data.cameras import look_at, random_zone_positions
from data.nerfstudio import write_nerfstudio
from training.metrics import psnr, ssim
from training.scenes import load_scenes

DISTORTION = {"k1": -0.05, "k2": 0.02, "k3": -0.004, "k4": 0.0, "p1": 0.011, "p2": -0.0096}


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
def write_capture(root, distortion: dict | None, count: int = 17, seed: int = 1):
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
    root = write_capture(tmp_path / "cap", None)
    peer = load_peer_scene(root, name="cap")
    names = sorted(f"images/frame_{i:05d}.png" for i in range(17))
    assert peer.kind == "nerfstudio" and peer.name == "cap"
    assert peer.eval.names == names[::8] and peer.train.names == [n for i, n in enumerate(names) if i % 8]


def test_distorted_capture_is_undistorted_from_the_same_split(tmp_path, monkeypatch):
    (tmp_path / "temp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))  # where the shadow folder goes
    plain = load_peer_scene(write_capture(tmp_path / "plain", None))
    distorted = load_peer_scene(write_capture(tmp_path / "distorted", DISTORTION))
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


# ------------------------------------------------------------------------------------------------ results, plot
def _fake_run(folder, psnr_value=30.0):
    folder.mkdir(parents=True)
    history = [{"step": s, "train_seconds": s / 50, "psnr": 20 + s / 100, "ssim": 0.9, "psnr_worst10": 19.0}
               for s in (500, 1000)]  # fmt: skip
    metrics = {"psnr": psnr_value, "ssim": 0.95, "psnr_worst10": 27.0, "worst_views": [3], "per_view": [{}] * 10,
               "iters": 1500, "train_seconds": 30.0, "eval_views": 10, "eval_history": history,
               "device": "cuda:0 (NVIDIA H100 80GB HBM3)", "peak_memory_bytes": 123456789}  # fmt: skip
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "model.pt").write_bytes(b"x" * 1000)
    return folder


def test_our_entry_reads_the_run(tmp_path):
    entry = our_entry(_fake_run(tmp_path / "run"))
    assert entry["evaluations"][0]["model_bytes"] == 1000 and entry["evaluations"][0]["psnr"] == 30.0
    assert entry["peak_memory_bytes"] == 123456789  # metrics.json's, as the peers' own
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
