"""nerfstudio-format scenes (data/nerfstudio.py) and per-view intrinsics: parsing, splits, bad inputs, rays through
off-centre principal points, and a short training run of the procedural scene written in nerfstudio form
(non-square images, off-centre principal points, per-frame intrinsics) against the same scene in blender form.
The box a capture derives: test_capture_bounds.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data import Scene, SceneError, camera_rays, pixel_rays, project_to_pixels, write_blender_split
from data.nerfstudio import load_nerfstudio, read_capture, write_nerfstudio
from data.samplers import PatchSampler, RaySampler
from data.synthetic import CAMERA_ANGLE_X, render_views, split_cameras

REPO = Path(__file__).resolve().parents[1]


def focal_for(side: int) -> float:
    return 0.5 * side / math.tan(0.5 * CAMERA_ANGLE_X)


def odd_intrinsics(count: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Per-frame fx, fy (fy != fx), principal points off the centre by up to 3 px."""
    rng = np.random.default_rng(seed)
    fx = focal_for(min(height, width) + 4) * rng.uniform(0.95, 1.05, count)
    return np.stack([fx, fx * 1.03, width / 2 + rng.uniform(-3, 3, count), height / 2 + rng.uniform(-3, 3, count)], -1)


def write_capture(root: Path, count: int = 9, size=(12, 16), per_frame=True, extra=None, seed=0) -> np.ndarray:
    """A small procedural capture in nerfstudio form; returns its (count, 4) intrinsics (frame order)."""
    c2w = split_cameras(seed, count, 1, 0)["train"]
    intrinsics = odd_intrinsics(count, *size, seed)
    if not per_frame:
        intrinsics[:] = intrinsics[0]
    write_nerfstudio(root, list(render_views(c2w, 0, seed, intrinsics, size)), c2w, intrinsics, per_frame, extra)
    return intrinsics


def edit(root: Path, change) -> None:
    path = root / "transforms.json"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def capture(tmp_path_factory) -> tuple[Path, np.ndarray]:
    root = tmp_path_factory.mktemp("capture")
    return root, write_capture(root)


# ---- rays with per-view intrinsics --------------------------------------------------------------------------


def test_the_principal_point_gives_the_optical_axis_and_projection_inverts_rays(gen):
    c2w = torch.from_numpy(split_cameras(1, 5, 1, 0)["train"]).double()
    k = torch.tensor(odd_intrinsics(5, 20, 30), dtype=torch.float64)
    _, axis = pixel_rays(c2w, k[:, 2], k[:, 3], k)
    assert torch.allclose(axis, -c2w[:, :3, 2], atol=1e-12)  # the camera looks down -z
    u, v = torch.rand(5, 7, generator=gen, dtype=torch.float64) * 30, torch.rand(5, 7, generator=gen) * 20
    _, directions = pixel_rays(c2w[:, None], u, v.double(), k[:, None])
    uv = project_to_pixels(c2w[:, None], directions, k[:, None])
    assert torch.allclose(uv, torch.stack([u, v.double()], -1), atol=1e-9)
    # a whole image: ray (row i, column j) passes through pixel centre (j + 0.5, i + 0.5) of a non-square view
    _, grid = camera_rays(c2w[2], 20, 30, k[2])
    uv = project_to_pixels(c2w[2], grid, k[2])
    assert torch.allclose(uv[3, 11], torch.tensor([11.5, 3.5], dtype=torch.float64), atol=1e-9)


def test_a_focal_length_means_a_centred_principal_point():
    c2w = torch.from_numpy(split_cameras(2, 2, 1, 0)["train"]).float()
    f = focal_for(24)
    centred = torch.tensor([f, f, 12.0, 8.0], dtype=torch.float64)
    for a, b in zip(camera_rays(c2w, 16, 24, f, 2), camera_rays(c2w, 16, 24, centred, 2)):
        assert torch.equal(a, b)
    scene = Scene(
        torch.zeros(2, 16, 24, 3, dtype=torch.uint8),
        c2w,
        16,
        24,
        f,
        2.0,
        6.0,
        torch.ones(2, 3),
        (1,) * 3,
        "x",
        ["a", "b"],
    )
    assert scene.intrinsics.tolist() == [[f, f, 12.0, 8.0]] * 2


def test_samplers_use_each_views_intrinsics(capture):
    root, _ = capture
    train, _, _ = load_nerfstudio(root)
    batch = RaySampler(train, 64, torch.Generator().manual_seed(0)).sample()
    k = train.intrinsics[batch.views]
    uv = project_to_pixels(train.c2w[batch.views].double(), batch.directions.double(), k)
    expected = batch.pixels.flip(-1).double() + 0.5  # (row, column) -> (u, v) of the pixel centre
    assert torch.allclose(uv, expected, atol=1e-3)
    patches = PatchSampler(train, 2, 2, 3, torch.Generator().manual_seed(0)).sample()
    k = train.intrinsics[patches.views][:, None, None]
    uv = project_to_pixels(train.c2w[patches.views][:, None, None].double(), patches.hr_directions.double(), k)
    y0, x0 = patches.top_left[:, 0, None, None].double(), patches.top_left[:, 1, None, None].double()
    assert torch.allclose(uv[..., 0], x0 + torch.arange(4).double()[None, None, :] + 0.5, atol=1e-3)
    assert torch.allclose(uv[..., 1], y0 + torch.arange(4).double()[None, :, None] + 0.5, atol=1e-3)


# ---- the loader ---------------------------------------------------------------------------------------------


def test_per_frame_intrinsics_images_and_default_split(capture):
    root, intrinsics = capture
    train, evaluation, bounds = load_nerfstudio(root)
    assert (train.height, train.width) == (12, 16) and train.images.shape == (7, 12, 16, 3)
    assert evaluation.split == "val" and evaluation.names == ["images/frame_00000.png", "images/frame_00008.png"]
    assert torch.allclose(evaluation.intrinsics, torch.tensor(intrinsics[[0, 8]]))
    assert torch.allclose(train.intrinsics, torch.tensor(intrinsics[1:8]))
    assert train.alpha is not None and train.near == bounds.near and torch.equal(train.bbox, evaluation.bbox)
    half = load_nerfstudio(root, downscale=2)[0]
    assert half.images.shape == (7, 6, 8, 3) and torch.allclose(half.intrinsics, train.intrinsics / 2)


def test_global_intrinsics_and_split_lists(tmp_path):
    intrinsics = write_capture(tmp_path, count=4, per_frame=False)
    names = [f"images/frame_{i:05d}.png" for i in range(4)]
    edit(tmp_path, lambda m: m.update(train_filenames=names[1:], val_filenames=["./" + names[0]]))
    train, evaluation, _ = load_nerfstudio(tmp_path)
    assert train.names == names[1:] and evaluation.names == names[:1] and evaluation.split == "val"
    assert torch.allclose(train.intrinsics, torch.tensor(intrinsics[1:]))
    edit(tmp_path, lambda m: m.update(test_filenames=names[2:3]))
    assert load_nerfstudio(tmp_path)[1].names == names[2:3]  # test wins over val, as for blender scenes
    edit(tmp_path, lambda m: m["frames"][0].update(fl_x=1.0))  # the top-level key wins, as in nerfstudio
    assert torch.allclose(load_nerfstudio(tmp_path)[0].intrinsics, torch.tensor(intrinsics[1:]))


def _drop_fl_x(meta):
    del meta["frames"][2]["fl_x"], meta["frames"][2]["fl_y"]  # one of them alone would give both


BAD_INPUTS = [
    (lambda m: m.update(camera_model="FULL_OPENCV"), "camera_model 'FULL_OPENCV' is not supported"),
    (lambda m: m.update(k1="a"), "transforms.json: k1 must be a finite number, got 'a'"),
    (lambda m: (m.pop("k2"), m["frames"][1].update(k2=[0.1])), r"frame 1 .*: k2 must be a finite number, got \[0.1\]"),
    (lambda m: m.update(k1=-2.0), r"frame 'images/frame_00000.png': distortion \(k1=-2 .*cannot be inverted"),
    (lambda m: (m.pop("camera_model"), m.update(is_fisheye=True, p1=0.01)), "fisheye model has no tangential terms"),
    (lambda m: m.update(is_fisheye="yes"), "is_fisheye must be true or false"),
    (lambda m: m.update(is_fisheye=True, camera_model="OPENCV"), "is_fisheye is true but camera_model is OPENCV"),
    (lambda m: ([f.pop("fl_x") for f in m["frames"]], m.update(camera_angle_x=4.0)), "camera_angle_x must be below"),
    (lambda m: m.update(aabb_scale=0), "aabb_scale must be positive"),
    (lambda m: m.update(offset=[0.5, 0.5]), "offset must be a number or 3 numbers"),
    (_drop_fl_x, "frame 2 .'images/frame_00002.png'.: missing fl_x"),
    (lambda m: m["frames"][0].update(fl_y=-3), "fl_y must be positive"),
    (lambda m: m["frames"][0].update(cx="a"), "cx must be a finite number"),
    (
        lambda m: m["frames"][3].update(w=17),
        "frame 'images/frame_00003.png'.*16x12 .w x h. but the transforms give w=17",
    ),
    (lambda m: m["frames"][0].update(transform_matrix=[[1, 0], [0, 1]]), "transform_matrix must be 4x4"),
    (lambda m: m["frames"][0].update(file_path="images/none.png"), "image .*none.png not found"),
    (lambda m: m.update(frames=[]), "'frames' must be a non-empty list"),
    (lambda m: m.update(applied_transform=[[1, 0, 0]]), "applied_transform must be 3x4 or 4x4"),
    (lambda m: m.update(applied_scale=0), "applied_scale must be positive"),
    (lambda m: m.update(train_filenames=["images/frame_00001.png"]), "needs train_filenames and test_filenames"),
    (
        lambda m: m.update(train_filenames=["images/x.png"], val_filenames=["images/frame_00000.png"]),
        r"train_filenames names 1 file\(s\) with no frame, e.g. \['images/x.png'\]",
    ),
    (lambda m: m.update(ply_file_path="missing.ply"), "ply_file_path 'missing.ply' is not a file"),
]


@pytest.mark.parametrize("change, message", BAD_INPUTS, ids=[m[:30] for _, m in BAD_INPUTS])
def test_bad_input_names_the_file_and_key(tmp_path, change, message):
    write_capture(tmp_path, count=5)
    edit(tmp_path, change)
    with pytest.raises(SceneError, match=message) as error:
        load_nerfstudio(tmp_path)
    assert str(tmp_path) in str(error.value)


def test_a_missing_or_malformed_transforms_file_is_named(tmp_path):
    write_capture(tmp_path, count=3)
    with pytest.raises(SceneError, match="transforms.json not found"):
        load_nerfstudio(tmp_path / "images")
    (tmp_path / "transforms.json").write_text("{")
    with pytest.raises(SceneError, match="malformed JSON"):
        load_nerfstudio(tmp_path)


# ---- training: the same scene in blender and in nerfstudio form -----------------------------------------------

TRAIN_ARGS = [
    "device=cpu",
    "train.iters=400",
    "model.resolution_start=24",
    "model.resolution_end=40",
    "model.grow_at=[0.2]",
    "model.feature_dim=8",
    "model.decoder_hidden=16",
    "model.max_samples=96",
    "model.tv_samples=4096",
    "train.patch_size=6",
    "train.patches_per_batch=12",
    "train.log_every=100",
    "train.turntable_frames=0",
    "train.checkpoint_every=0",
    "data.scene_box=1.5",
    "data.near=2.0",
    "data.far=6.0",
]


def train_psnr(run_dir: Path, data: list[str]) -> float:
    result = subprocess.run(
        [sys.executable, "train.py", *data, *TRAIN_ARGS, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((run_dir / "metrics.json").read_text())["psnr"]


def test_nerfstudio_form_trains_like_the_blender_form(tmp_path):
    """Same procedural scene and cameras at 20x28 pixels: the blender form has one centred pinhole (fx = fy from
    camera_angle_x), the nerfstudio form per-frame fx != fy and principal points up to 3 px off centre (the same
    field of view on average, so both show the same content). Wrong intrinsics anywhere (rays, evaluation) would
    cost dB."""
    size = (20, 28)
    cameras = split_cameras(3, 24, 1, 6)
    train_c2w, test_c2w = cameras["train"], cameras["test"]
    all_c2w = np.concatenate([train_c2w, test_c2w])
    focal = focal_for(24)
    centred = np.tile([focal, focal, size[1] / 2, size[0] / 2], (len(all_c2w), 1))
    blender = tmp_path / "blender"
    angle = 2.0 * math.atan(0.5 * size[1] / focal)
    views = list(render_views(all_c2w, 0, 3, centred, size))
    write_blender_split(blender, "train", views[: len(train_c2w)], train_c2w, angle)
    write_blender_split(blender, "test", views[len(train_c2w) :], test_c2w, angle)
    intrinsics = odd_intrinsics(len(all_c2w), *size, seed=3)
    intrinsics[:, :2] = focal * intrinsics[:, :2] / intrinsics[:, :2].mean()  # the blender focal on average
    names = [f"images/frame_{i:05d}.png" for i in range(len(all_c2w))]
    split = {"train_filenames": names[: len(train_c2w)], "test_filenames": names[len(train_c2w) :]}
    images = list(render_views(all_c2w, 0, 3, intrinsics, size))
    write_nerfstudio(tmp_path / "ns", images, all_c2w, intrinsics, extra=split)
    psnr_blender = train_psnr(tmp_path / "run_blender", ["data=blender", f"data.root={blender}"])
    psnr_ns = train_psnr(tmp_path / "run_ns", ["data=nerfstudio", f"data.root={tmp_path / 'ns'}", "data.orient=none"])
    print(f"PSNR blender form {psnr_blender:.2f} dB, nerfstudio form {psnr_ns:.2f} dB")
    assert psnr_blender > 17.0
    assert abs(psnr_ns - psnr_blender) < 0.3, (psnr_blender, psnr_ns)


def test_nerfstudio_config_composes_and_validates(tmp_path, capture):
    from hydra import compose, initialize_config_dir

    from training.config import ConfigError, validate_config

    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=["data=nerfstudio", f"data.root={capture[0]}", "device=cpu"])
    assert cfg.data.near is None and cfg.data.scene_box is None and cfg.data.eval_interval == 8
    validate_config(cfg)
    for key, value, message in [
        ("root", str(tmp_path), "contains no transforms.json"),
        ("root", None, "required for data.name=nerfstudio"),
        ("scene_box", [1, 2], "must be null, a half size or 6 numbers"),
        ("scene_box", -1.0, "positive half size"),
        ("far", 0.5, "data.far: must be > data.near"),
        ("eval_interval", 1, "data.eval_interval: must be >= 2"),
        ("orient", "down", "data.orient: must be one of up, none"),
    ]:
        bad = cfg.copy()
        bad.data[key] = value
        if key == "far":
            bad.data.near = 1.0
        with pytest.raises(ConfigError, match=message):
            validate_config(bad)


# ---- instant-ngp / nerfstudio variants and orientation --------------------------------------------------------


def test_camera_angles_float_sizes_and_the_default_principal_point(tmp_path):
    """instant-ngp's file: camera_angle_x (and _y) instead of fl_x / fl_y, w and h as floats, no cx / cy."""
    intrinsics = write_capture(tmp_path, count=4, per_frame=False)
    fx, fy = intrinsics[0, :2]

    def angles(meta, with_y):
        for key in ("fl_x", "fl_y", "cx", "cy"):
            meta.pop(key)
        meta.update(w=16.0, h=12.0, camera_angle_x=2 * math.atan(8.0 / fx))
        if with_y:
            meta.update(camera_angle_y=2 * math.atan(6.0 / fy))

    edit(tmp_path, lambda m: angles(m, True))
    train, _, _ = load_nerfstudio(tmp_path, orient="none")
    assert torch.allclose(train.intrinsics, torch.tensor([[fx, fy, 8.0, 6.0]] * 3, dtype=torch.float64))
    edit(tmp_path, lambda m: m.pop("camera_angle_y"))  # one angle gives both focal lengths (square pixels)
    assert torch.allclose(load_nerfstudio(tmp_path)[0].intrinsics[0], torch.tensor([fx, fx, 8.0, 6.0]).double())
    edit(tmp_path, lambda m: m.update(w=16.5))
    with pytest.raises(SceneError, match="w must be a whole number of pixels, got 16.5"):
        load_nerfstudio(tmp_path)


def test_aabb_scale_scale_and_offset_give_the_extent(tmp_path):
    write_capture(tmp_path, count=4)
    assert load_nerfstudio(tmp_path, orient="none")[2].extent is None
    edit(tmp_path, lambda m: m.update(aabb_scale=16))  # instant-ngp's defaults: scale 0.33, offset 0.5
    bounds = load_nerfstudio(tmp_path, orient="none")[2]
    assert np.allclose(bounds.extent, [[-8 / 0.33] * 3, [8 / 0.33] * 3]) and "aabb_scale box" in bounds.describe()
    edit(tmp_path, lambda m: m.update(scale=0.5, offset=[0.5, 0.0, 1.0]))
    assert np.allclose(load_nerfstudio(tmp_path, orient="none")[2].extent, [[-16, -15, -17], [16, 17, 15]])
    oriented = load_nerfstudio(tmp_path)[2]  # the same box in the oriented frame holds the moved cameras' box
    assert (oriented.extent[0] < oriented.box[0]).all() and (oriented.extent[1] > oriented.box[1]).all()


def tilted_capture(tmp_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The procedural capture with its world rotated (z up -> a tilted axis), moved and scaled; returns the
    rotation and the original cameras."""
    write_capture(tmp_path, count=9)
    angle = 0.9
    rotation = np.array(
        [[1.0, 0.0, 0.0], [0.0, math.cos(angle), -math.sin(angle)], [0.0, math.sin(angle), math.cos(angle)]]
    )
    original = np.array(
        [f["transform_matrix"] for f in json.loads((tmp_path / "transforms.json").read_text())["frames"]]
    )

    def tilt(meta):
        for frame in meta["frames"]:
            c2w = np.array(frame["transform_matrix"])
            c2w[:3, :3] = rotation @ c2w[:3, :3]
            c2w[:3, 3] = 3.0 * (rotation @ c2w[:3, 3]) + [5.0, -2.0, 1.0]
            frame["transform_matrix"] = c2w.tolist()

    edit(tmp_path, tilt)
    return rotation, original


def test_orient_up_makes_the_scene_upright_centred_and_unit_sized(tmp_path):
    rotation, original = tilted_capture(tmp_path)
    as_given = read_capture(tmp_path, orient="none")
    up = np.stack([f.c2w[:3, 1] for f in as_given.frames]).mean(0)
    assert abs(up[2]) < 0.9 * np.linalg.norm(up)  # tilted: the file's z is not the cameras' up
    capture = read_capture(tmp_path, orient="up")
    c2w = np.stack([f.c2w for f in capture.frames])
    up = c2w[:, :3, 1].mean(0)
    assert np.allclose(up[:2], 0.0, atol=1e-12) and up[2] > 0  # the mean camera up is +z
    assert np.allclose(np.abs(c2w[:, :3, 3]).max(), 1.0)  # cameras in [-1, 1]^3, the farthest on a face
    assert np.allclose(np.einsum("vij,vik->vjk", c2w[:, :3, :3], c2w[:, :3, :3]), np.eye(3), atol=1e-12)
    # the procedural cameras look at the origin: after centring on their focus, the origin is where they look
    from data.bounds import focus_point

    assert np.allclose(focus_point(c2w), 0.0, atol=1e-9)
    # a similarity: the distances between cameras keep their ratios, so the images still fit the poses
    first = np.linalg.norm(original[:, :3, 3] - original[0, :3, 3], axis=-1)
    now = np.linalg.norm(c2w[:, :3, 3] - c2w[0, :3, 3], axis=-1)
    assert np.allclose(now / now.max(), first / first.max(), atol=1e-9)
    _, _, bounds = load_nerfstudio(tmp_path)
    assert (bounds.box[0] < 0).all() and (bounds.box[1] > 0).all() and bounds.far < 3.5  # derived in that frame


def test_a_bad_orient_is_refused_and_the_lens_survives_downscale(tmp_path):
    write_capture(tmp_path, count=4)
    with pytest.raises(SceneError, match="data.orient must be one of up, none, got 'sideways'"):
        load_nerfstudio(tmp_path, orient="sideways")
    train = load_nerfstudio(tmp_path)[0]
    assert train.lens is None  # zero distortion: the pinhole path
    edit(tmp_path, lambda m: m.update(k1=0.05, p2=-0.002))
    moved = load_nerfstudio(tmp_path, downscale=2)[0].to("cpu")
    assert moved.lens.coefficients.shape == (3, 6) and moved.lens.coefficients[0, 0] == 0.05
    assert moved.lens.coefficients[0, 5] == -0.002  # distortion is scale-free: the same at any downscale


def test_sizes_that_do_not_divide_lose_their_last_rows_and_columns(capture):
    root, intrinsics = capture
    full = load_nerfstudio(root, orient="none")[0]
    cropped = load_nerfstudio(root, downscale=1, multiple=5, orient="none")[0]  # 12x16 -> 10x15
    assert (cropped.height, cropped.width) == (10, 15) and torch.equal(cropped.images, full.images[:, :10, :15])
    assert torch.equal(cropped.intrinsics, full.intrinsics)  # top-left crop: every pixel keeps its position
    reduced = load_nerfstudio(root, downscale=5, orient="none")[0]  # 12x16 -> 10x15 -> 2x3
    assert (reduced.height, reduced.width) == (2, 3) and torch.allclose(reduced.intrinsics, full.intrinsics / 5)
