"""Tests of the data package on tiny generated scenes (no dependence on ../shared/data); camera rays:
tests/test_camera_rays.py."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data import (
    PatchSampler,
    RaySampler,
    Scene,
    SceneError,
    camera_rays,
    ensure_synthetic_scene,
    eval_split,
    list_splits,
    load_blender,
    pixel_rays,
    project_to_pixels,
    synthetic,
)
from data.cameras import look_at
from data.synthetic import CAMERA_ANGLE_X, intersect, scene_sdf

SIZE = 24
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


@pytest.fixture(scope="session")
def tiny_scene(tmp_path_factory) -> Path:
    return ensure_synthetic_scene(
        tmp_path_factory.mktemp("cache"), resolution=SIZE, n_train=4, n_val=2, n_test=2, seed=3
    )


@pytest.fixture
def scene_copy(tiny_scene, tmp_path) -> Path:
    """A private copy to damage."""
    return Path(shutil.copytree(tiny_scene, tmp_path / "scene"))


def png(root: Path, split: str, index: int) -> np.ndarray:
    return np.asarray(Image.open(root / split / f"r_{index}.png"))


def some_camera(position=(1.0, -3.0, 2.0)) -> torch.Tensor:
    return torch.from_numpy(look_at(np.array([position]))[0])


# ---- loading ---------------------------------------------------------------------------------------------------


def test_generated_scene_loads_with_expected_shapes(tiny_scene):
    assert list_splits(tiny_scene) == ["train", "val", "test"]
    assert eval_split(tiny_scene) == "test"
    scene = load_blender(tiny_scene, "train")
    assert scene.images.shape == (4, SIZE, SIZE, 3) and scene.images.dtype == torch.uint8
    assert scene.c2w.shape == (4, 4, 4) and scene.c2w.dtype == torch.float32
    assert (scene.height, scene.width, scene.num_views, scene.split) == (SIZE, SIZE, 4, "train")
    assert scene.focal == pytest.approx(0.5 * SIZE / math.tan(0.5 * CAMERA_ANGLE_X))
    assert (scene.near, scene.far, scene.background) == (2.0, 6.0, (1.0, 1.0, 1.0))
    assert torch.equal(scene.bbox, torch.tensor([[-1.5] * 3, [1.5] * 3]))
    assert scene.names == [f"./train/r_{i}" for i in range(4)]
    positions = scene.c2w[:, :3, 3]
    assert torch.allclose(positions.norm(dim=-1), torch.full((4,), 4.0)) and (positions[:, 2] > 0).all()
    single = load_blender(tiny_scene, "train", num_workers=1)
    assert torch.equal(single.images, scene.images) and torch.equal(single.c2w, scene.c2w)
    assert load_blender(tiny_scene, "val", near=1.0, far=7.0, scene_box=2.0).bbox[1].tolist() == [2.0] * 3


@pytest.mark.parametrize("background", [(1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (0.2, 0.5, 0.9)])
def test_compositing_on_background(tiny_scene, background):
    scene = load_blender(tiny_scene, "train", background=background)
    rgba = np.stack([png(tiny_scene, "train", i) for i in range(4)])
    alpha = rgba[..., 3]
    transparent, opaque, partial = alpha == 0, alpha == 255, (alpha > 0) & (alpha < 255)
    assert transparent.sum() > 100 and opaque.sum() > 100 and partial.sum() > 10  # all three cases occur
    images = scene.images.numpy().astype(np.float64)
    assert np.abs(images[transparent] - np.array(background) * 255).max() <= 0.5
    assert np.array_equal(images[opaque], rgba[opaque][:, :3])
    a = alpha[partial][:, None] / 255.0
    expected = rgba[partial][:, :3] * a + np.array(background) * 255 * (1 - a)
    assert np.abs(images[partial] - expected).max() <= 0.5 + 1e-6


def test_downscale_averages_composited_colour(tiny_scene):
    full = load_blender(tiny_scene, "val")
    half = load_blender(tiny_scene, "val", downscale=2)
    assert half.images.shape == (2, SIZE // 2, SIZE // 2, 3) and half.focal == pytest.approx(full.focal / 2)
    rgba = np.stack([png(tiny_scene, "val", i) for i in range(2)]).astype(np.float64)
    a = rgba[..., 3:] / 255.0
    composited = rgba[..., :3] * a + 255.0 * (1 - a)  # premultiplied colour + background, averaged below
    expected = composited.reshape(2, SIZE // 2, 2, SIZE // 2, 2, 3).mean(axis=(2, 4))
    difference = np.abs(half.images.numpy() - expected)
    assert difference.max() <= 0.5 + 1e-4
    with pytest.raises(SceneError, match=r"r_0\.png.*not divisible by downscale=5"):
        load_blender(tiny_scene, "val", downscale=5)


def test_rays_through_opaque_pixels_hit_the_known_geometry(tiny_scene):
    scene = load_blender(tiny_scene, "train")
    alpha = torch.from_numpy(np.stack([png(tiny_scene, "train", i)[..., 3] for i in range(4)]))
    origins, directions = camera_rays(scene.c2w.double(), scene.height, scene.width, scene.focal)
    hit = intersect(origins.reshape(-1, 3), directions.reshape(-1, 3))
    hits = hit.hit.reshape(alpha.shape)
    assert hits[alpha == 255].all() and not hits[alpha == 0].any()
    assert not hits.flip(1)[alpha == 255].all()  # the check sees an upside-down camera
    points = origins.reshape(-1, 3) + directions.reshape(-1, 3) * hit.t.unsqueeze(-1)
    on_surface = points[hit.hit]
    assert scene_sdf(on_surface).abs().max() < 1e-6
    assert ((on_surface >= scene.bbox[0]) & (on_surface <= scene.bbox[1])).all()


def test_intersections_agree_with_the_signed_distance():
    generator = torch.Generator().manual_seed(0)
    origins = (
        torch.nn.functional.normalize(torch.randn(4000, 3, generator=generator, dtype=torch.float64), dim=-1) * 3.5
    )
    targets = (torch.rand(4000, 3, generator=generator, dtype=torch.float64) - 0.5) * 2.0
    directions = torch.nn.functional.normalize(targets - origins, dim=-1)
    hit = intersect(origins, directions)
    assert 0.3 < hit.hit.double().mean() < 0.95
    fractions = torch.linspace(0.0, 0.999, 50, dtype=torch.float64)
    t_end = torch.where(hit.hit, hit.t, torch.full_like(hit.t, 8.0))
    along = origins[:, None] + directions[:, None] * (t_end[:, None, None] * fractions[None, :, None])
    assert (scene_sdf(along) > -1e-9).all()  # free space up to the hit (or the whole way on a miss)
    points = origins + directions * hit.t.nan_to_num(posinf=0.0)[:, None]
    assert scene_sdf(points[hit.hit]).abs().max() < 1e-9
    eps = 1e-5  # the normal is the sdf's gradient
    grad = torch.stack(
        [
            (scene_sdf(points + eps * e) - scene_sdf(points - eps * e)) / (2 * eps)
            for e in torch.eye(3, dtype=torch.float64)
        ],
        -1,
    )
    away_from_edges = hit.hit & (grad.norm(dim=-1) - 1).abs().lt(1e-3)
    assert away_from_edges.sum() > 1000
    cosine = (torch.nn.functional.normalize(grad, dim=-1) * hit.normal).sum(-1)
    assert cosine[away_from_edges & (hit.shape != 4)].min() > 1 - 1e-4  # shape 4, the ellipsoid, has an inexact sdf
    assert cosine[hit.shape == 4].min() > 0.5


# ---- samplers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_ray_sampler_batches_match_pixels_and_cameras(tiny_scene, device):
    scene = load_blender(tiny_scene, "train").to(device)
    sampler = RaySampler(scene, 512, generator=torch.Generator(device).manual_seed(1))
    batch = sampler.sample()
    for tensor in (batch.origins, batch.directions, batch.rgb):
        assert tensor.shape == (512, 3) and tensor.dtype == torch.float32 and tensor.device.type == device
    views, rows, cols = batch.views, batch.pixels[:, 0], batch.pixels[:, 1]
    assert torch.equal(batch.rgb, scene.images[views, rows, cols].float() / 255)
    origins, directions = camera_rays(scene.c2w, scene.height, scene.width, scene.focal)
    assert torch.allclose(batch.directions, directions[views, rows, cols], atol=1e-6)
    assert torch.equal(batch.origins, origins[views, rows, cols])
    assert set(views.tolist()) == {0, 1, 2, 3} and rows.min() == 0 and rows.max() == SIZE - 1
    again = RaySampler(scene, 512, generator=torch.Generator(device).manual_seed(1)).sample()
    assert torch.equal(again.rgb, batch.rgb) and not torch.equal(sampler.sample().rgb, batch.rgb)
    # the cameras from one gather of the (V, 16) table: bit for bit the rays of the (V, 4, 4) and (V, 4) gathers
    u, v = cols + 0.5, rows + 0.5
    whole = pixel_rays(sampler.c2w[views], u, v, sampler.intrinsics[views])
    assert torch.equal(batch.origins, whole[0]) and torch.equal(batch.directions, whole[1])


@pytest.mark.parametrize("device", DEVICES)
def test_patch_sampler_aligns_patches_rays_and_pixels(tiny_scene, device):
    scene = load_blender(tiny_scene, "train").to(device)
    patch, scale, count = 4, 3, 64
    batch = PatchSampler(scene, patch, scale, count, generator=torch.Generator(device).manual_seed(2)).sample()
    side = patch * scale
    assert batch.origins.shape == batch.directions.shape == (count, patch, patch, 3)
    assert batch.hr_directions.shape == batch.rgb.shape == (count, side, side, 3) and batch.rgb.dtype == torch.float32
    assert batch.top_left.min() == 0 and batch.top_left.max() == SIZE - side  # every corner can be drawn
    assert (batch.top_left % scale != 0).any()  # corners are not tied to the block grid
    _, full = camera_rays(scene.c2w, scene.height, scene.width, scene.focal)
    offsets = (torch.arange(patch, device=device) + 0.5) * scale
    for view, (y0, x0), rgb, lr, hr, o in zip(
        batch.views, batch.top_left, batch.rgb, batch.directions, batch.hr_directions, batch.origins
    ):
        window = (slice(y0, y0 + side), slice(x0, x0 + side))
        assert torch.equal(rgb, scene.images[view][window].float() / 255)
        assert torch.allclose(hr, full[view][window], atol=1e-6)
        assert torch.equal(o, scene.c2w[view, :3, 3].expand_as(o))
        uv = project_to_pixels(scene.c2w[view].double(), lr.double(), scene.focal, scene.width, scene.height)
        assert torch.allclose(uv[..., 0], (x0 + offsets)[None, :].double().expand(patch, patch), atol=1e-3)
        assert torch.allclose(uv[..., 1], (y0 + offsets)[:, None].double().expand(patch, patch), atol=1e-3)
    with pytest.raises(ValueError, match="exceeds"):
        PatchSampler(scene, 9, 3, 1)


def test_patch_sampler_at_scale_one_draws_pixel_patches(tiny_scene):
    # train.dssim with model.upsample=1: patches of patch_size pixels, one ray through each pixel centre
    scene = load_blender(tiny_scene, "train")
    batch = PatchSampler(scene, 11, 1, 8, generator=torch.Generator().manual_seed(3)).sample()
    assert batch.origins.shape == batch.rgb.shape == (8, 11, 11, 3)
    torch.testing.assert_close(batch.directions, batch.hr_directions)
    _, full = camera_rays(scene.c2w, scene.height, scene.width, scene.focal)
    for view, (y0, x0), directions in zip(batch.views, batch.top_left, batch.directions):
        torch.testing.assert_close(directions, full[view][y0 : y0 + 11, x0 : x0 + 11], atol=1e-6, rtol=0)


def test_scene_moves_between_devices(tiny_scene):
    scene = load_blender(tiny_scene, "val")
    moved = scene.to("cpu")
    assert moved.num_views == 2 and moved.images.dtype == torch.uint8 and moved.device.type == "cpu"
    with pytest.raises(ValueError, match="images"):
        Scene(
            scene.images.float(), scene.c2w, SIZE, SIZE, 1.0, 2.0, 6.0, scene.bbox, (1.0, 1.0, 1.0), "val", scene.names
        )


# ---- file variants and errors ----------------------------------------------------------------------------------


def edit_json(root: Path, split: str, change) -> None:
    path = root / f"transforms_{split}.json"
    content = json.loads(path.read_text())
    change(content)
    path.write_text(json.dumps(content))


def test_rgb_images_and_file_paths_with_extensions(scene_copy):
    original = load_blender(scene_copy, "train")
    rgb = png(scene_copy, "train", 0)[..., :3]
    Image.fromarray(rgb).save(scene_copy / "train" / "r_0.png")

    def rename(content):
        content["frames"][0]["file_path"] = "train/r_0.png"

    edit_json(scene_copy, "train", rename)
    scene = load_blender(scene_copy, "train")
    assert np.array_equal(scene.images[0].numpy(), rgb)  # no alpha: opaque
    assert torch.equal(scene.images[1:], original.images[1:]) and scene.names[0] == "train/r_0.png"


def test_missing_folder(tmp_path):
    with pytest.raises(SceneError, match=r"nowhere.*does not exist"):
        load_blender(tmp_path / "nowhere", "train")
    with pytest.raises(SceneError, match="nowhere"):
        list_splits(tmp_path / "nowhere")


def test_missing_split_file(scene_copy):
    (scene_copy / "transforms_val.json").unlink()
    with pytest.raises(SceneError, match=r"transforms_val\.json not found.*splits present.*train, test"):
        load_blender(scene_copy, "val")
    (scene_copy / "transforms_test.json").unlink()
    with pytest.raises(SceneError, match="neither transforms_test.json nor transforms_val.json"):
        eval_split(scene_copy)


def test_unknown_split_name(tiny_scene):
    with pytest.raises(SceneError, match=r"unknown split 'bogus'.*transforms_bogus\.json.*train, val, test"):
        load_blender(tiny_scene, "bogus")
    with pytest.raises(SceneError, match="invalid split name"):
        load_blender(tiny_scene, "../train")


def test_missing_image(scene_copy):
    (scene_copy / "train" / "r_2.png").unlink()
    with pytest.raises(SceneError, match=r"transforms_train\.json: frame 2: image .*r_2\.png not found"):
        load_blender(scene_copy, "train")


def test_images_of_different_sizes(scene_copy):
    Image.fromarray(np.zeros((12, 12, 4), np.uint8)).save(scene_copy / "train" / "r_1.png")
    with pytest.raises(SceneError, match=r"r_1\.png: image size 12x12 differs from 24x24"):
        load_blender(scene_copy, "train")


def test_malformed_json(scene_copy):
    path = scene_copy / "transforms_train.json"
    path.write_text(path.read_text()[:-20])
    with pytest.raises(SceneError, match=r"transforms_train\.json: malformed JSON"):
        load_blender(scene_copy, "train")


def test_transform_not_4x4(scene_copy):
    def truncate(content):
        content["frames"][1]["transform_matrix"] = content["frames"][1]["transform_matrix"][:3]

    edit_json(scene_copy, "val", truncate)
    with pytest.raises(SceneError, match=r"transforms_val\.json: frame 1 .*r_1.*must be 4x4, got shape \(3, 4\)"):
        load_blender(scene_copy, "val")


def test_other_bad_inputs(scene_copy):
    edit_json(scene_copy, "val", lambda content: content.pop("camera_angle_x"))
    with pytest.raises(SceneError, match=r"transforms_val\.json: camera_angle_x"):
        load_blender(scene_copy, "val")
    edit_json(scene_copy, "test", lambda content: content.update(frames=[]))
    with pytest.raises(SceneError, match=r"transforms_test\.json: 'frames' must be a non-empty list"):
        load_blender(scene_copy, "test")
    (scene_copy / "train" / "r_3.png").write_bytes(b"not a png")
    with pytest.raises(SceneError, match=r"r_3\.png: cannot read image"):
        load_blender(scene_copy, "train")
    with pytest.raises(ValueError, match="downscale"):
        load_blender(scene_copy, "train", downscale=0)


# ---- the procedural scene --------------------------------------------------------------------------------------


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_generation_is_deterministic_and_cached(tmp_path, monkeypatch):
    params = dict(resolution=16, n_train=3, n_val=1, n_test=1, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        first = ensure_synthetic_scene(tmp_path / "a", **params)
    finally:
        torch.set_num_threads(threads)
    second = ensure_synthetic_scene(tmp_path / "b", **params)
    assert first.name == second.name and tree_bytes(first) == tree_bytes(second)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [first.name]  # no staging folder left behind

    other_seed = ensure_synthetic_scene(tmp_path / "a", **{**params, "seed": 6})
    assert other_seed != first
    assert not torch.equal(load_blender(other_seed, "train").c2w, load_blender(first, "train").c2w)

    monkeypatch.setattr(synthetic, "render_views", lambda *args: pytest.fail("re-rendered a cached scene"))
    assert ensure_synthetic_scene(tmp_path / "a", **params) == first
    with pytest.raises(ValueError, match="resolution"):
        ensure_synthetic_scene(tmp_path / "a", resolution=0)


def test_splits_use_different_cameras(tiny_scene):
    cameras = {split: load_blender(tiny_scene, split).c2w[:, :3, 3] for split in ("train", "val", "test")}
    for a, b in [("train", "val"), ("train", "test"), ("val", "test")]:
        assert torch.cdist(cameras[a], cameras[b]).min() > 1e-3
