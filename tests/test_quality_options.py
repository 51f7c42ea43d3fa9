"""The held-out quality options (CPU, small grids): per-sample shading, shrinking the box to the visible
density, the scene's alpha and training on random backgrounds, and the worst-views figure of the evaluation."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_model import (
    BBOX,
    NEAR,
    TORCH_OPS,
    backends,
    make_model,
    randomize_density,
    rays_towards_centre,
)

from data.images import composite, load_composited, write_png
from data.samplers import RaySampler
from data.scene import Scene
from models import build_ops
from models.field import optical_depth, resample_box, to_unit
from models.render import accumulate, compositing_weights

CUSTOM_OPS = backends("custom")


# ------------------------------------------------------------------------------------- per-sample shading


def test_per_sample_shading_starts_as_composited_sigmoid_colour():
    model = make_model(
        shading="per_sample",
        upsample=1,
        grow_at=[],
        occupancy={"threshold": 1e-3, "refresh_every": 50, "warmup": 10**6, "dilate": 1},
        early_termination=0.0,
        weight_threshold=0.0,
    )
    randomize_density(model)
    with torch.no_grad():
        model.features.grid.normal_(0.0, 1.0)
    model.eval()
    origins, directions = rays_towards_centre(64)
    out = model.render_rays(origins, directions)
    # brute force: the same samples, sigmoid of the first three feature channels (the residual starts at zero)
    from cuda_ext.reference import march_rays
    from models.render import num_samples_per_ray, ray_box_intersect

    step = model.step_size
    count = num_samples_per_ray(model.extent, NEAR, model.far, step, model.config.max_samples)
    t_start, t_end = ray_box_intersect(origins, directions, model.bbox, NEAR, model.far)
    everywhere = torch.ones(1, 1, 1, dtype=torch.bool)  # every sample between t_start and t_end
    ray, t, points, _ = march_rays(
        origins, directions, t_start, t_end, torch.full((64,), 0.5), everywhere, model.bbox, step, count
    )
    samples = SimpleNamespace(ray=ray, t=t, points=points)
    sigma = optical_depth(
        model.density(samples.points, model.ops)[:, 0], model.config.density_shift, step / model.base_voxel
    )
    weights = compositing_weights(sigma, samples.ray, 64)
    colour = torch.sigmoid(model.features(samples.points, model.ops)[:, :3])
    expected = (
        accumulate(colour, weights, samples.ray, 64)
        + (1 - weights.new_zeros(64).index_add(0, samples.ray, weights))[:, None] * model.background
    )
    torch.testing.assert_close(out["rgb"], expected, rtol=1e-5, atol=1e-5)


def test_per_sample_shading_gradients_reach_the_decoder_and_the_grids():
    model = make_model(shading="per_sample", upsample=1, decoder_hidden=16)
    randomize_density(model)
    origins, directions = rays_towards_centre(128)
    out = model.render_rays(origins, directions)
    out["rgb"].square().sum().backward()
    assert model.decoder.out.weight.grad.abs().sum() > 0  # zero-initialised, but it gets a gradient
    assert model.features.grid.grad.abs().sum() > 0 and model.density.grid.grad.abs().sum() > 0


def test_per_sample_shading_custom_ops_match_references():
    torch_model = make_model(seed=3, shading="per_sample", upsample=1, decoder_hidden=16)
    custom_model = make_model(seed=3, ops=build_ops(CUSTOM_OPS), shading="per_sample", upsample=1, decoder_hidden=16)
    for model in (torch_model, custom_model):
        randomize_density(model)
        with torch.no_grad():
            torch.manual_seed(5)
            model.decoder.out.weight.normal_(0, 0.5)
    torch_model.eval(), custom_model.eval()
    origins, directions = rays_towards_centre(96)
    torch.testing.assert_close(
        custom_model.render_rays(origins, directions)["rgb"],
        torch_model.render_rays(origins, directions)["rgb"],
        rtol=1e-4,
        atol=1e-5,
    )


def test_per_sample_shading_needs_upsample_one():
    with pytest.raises(ValueError, match="model.upsample"):
        make_model(shading="per_sample", upsample=2)
    with pytest.raises(ValueError, match="model.shading"):
        make_model(shading="per_pixel")


# ------------------------------------------------------------------------------------------- box shrink


def blob_model(**overrides):
    """Density only inside a small off-centre blob: the visible region is known."""
    model = make_model(grow_at=[], resolution_start=24, resolution_end=24, shrink_at=5, **overrides)
    with torch.no_grad():
        axes = [torch.linspace(-1.5, 1.5, r) for r in model.grid_shape]
        x, y, z = torch.meshgrid(*axes, indexing="ij")
        inside = ((x - 0.5) ** 2 + (y + 0.3) ** 2 + (z - 0.1) ** 2) < 0.4**2
        model.density.grid.copy_(torch.where(inside, 12.0, -20.0)[..., None])
        model.features.grid.normal_(0.0, 1.0)
    return model


def test_shrink_moves_the_box_to_the_visible_density_and_keeps_the_field():
    model = blob_model()
    old_bbox = model.bbox.clone()
    probe = torch.tensor([[0.5, -0.3, 0.1], [0.7, -0.2, 0.2], [0.3, -0.5, 0.0]])
    before = [g(to_unit(probe, old_bbox), model.ops) for g in (model.density, model.features)]
    assert model.on_step(5, 100)  # parameters replaced: the trainer rebuilds its optimiser
    assert model.shrunk
    low, high = model.bbox
    assert bool((low > -1.0).all()) and bool(
        (high < 1.2).all()
    )  # blob + 2-voxel margin: much smaller than [-1.5, 1.5]^3
    assert bool((low <= probe.min(0).values).all()) and bool((high >= probe.max(0).values).all())
    # about the same voxel budget over the smaller box: finer voxels
    assert np.prod(model.grid_shape) == pytest.approx(24**3, rel=0.25)
    after = [g(to_unit(probe, model.bbox), model.ops) for g in (model.density, model.features)]
    for b, a in zip(before, after):  # resampled, not reset: the field is kept up to interpolation
        torch.testing.assert_close(a, b, rtol=0.0, atol=1.5)
    assert not model.on_step(6, 100)  # once only


def test_shrink_survives_a_checkpoint_round_trip():
    model = blob_model()
    model.on_step(5, 100)
    state = model.state_dict()
    restored = make_model(grow_at=[], resolution_start=24, resolution_end=24, shrink_at=5)
    restored.load_state_dict(state)
    assert restored.shrunk and restored.grid_shape == model.grid_shape and restored.extent == model.extent
    torch.testing.assert_close(restored.bbox, model.bbox)
    model.eval(), restored.eval()
    origins, directions = rays_towards_centre(32)
    torch.testing.assert_close(
        restored.render_rays(origins, directions)["rgb"], model.render_rays(origins, directions)["rgb"]
    )
    assert not restored.on_step(6, 100)


def test_checkpoints_from_before_the_schedule_state_still_load():
    model = make_model(grow_at=[], resolution_start=16, resolution_end=16)
    state = {k: v for k, v in model.state_dict().items() if k != "_extra_state"}
    restored = make_model(grow_at=[], resolution_start=16, resolution_end=16)
    restored.load_state_dict(state)
    assert restored.resolution == 16 and not restored.shrunk


def test_shrink_with_nothing_visible_keeps_the_box():
    model = make_model(grow_at=[], resolution_start=16, resolution_end=16, shrink_at=2)
    with torch.no_grad():
        model.density.grid.fill_(-30.0)
    assert not model.on_step(2, 10)
    torch.testing.assert_close(model.bbox, BBOX)


def test_resample_box_matches_the_lookup_at_the_new_vertices():
    generator = torch.Generator().manual_seed(0)
    grid = torch.randn(5, 6, 7, 3, generator=generator, dtype=torch.float64)
    old = torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    new = torch.tensor([[-0.5, -1.0, 0.0], [1.0, 0.5, 1.0]], dtype=torch.float64)
    out = resample_box(grid, old, new, (4, 3, 5))
    import cuda_ext

    axes = [torch.linspace(float(new[0, a]), float(new[1, a]), s, dtype=torch.float64) for a, s in enumerate((4, 3, 5))]
    points = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    expected = cuda_ext.reference.grid_interpolate(grid, to_unit(points, old)).reshape(4, 3, 5, 3)
    torch.testing.assert_close(out, expected)


# ------------------------------------------------------------------------------ alpha, random backgrounds


def test_load_composited_keeps_alpha_and_recomposites_exactly(tmp_path):
    generator = np.random.default_rng(0)
    rgba = generator.integers(0, 256, size=(8, 6, 4), dtype=np.uint8)
    write_png(tmp_path / "a.png", rgba)
    for downscale in (1, 2):
        rgb, alpha = load_composited(tmp_path / "a.png", (1.0, 1.0, 1.0), downscale)
        assert alpha is not None and alpha.shape == rgb.shape[:2] and alpha.dtype == np.uint8
        # rgb + (B' - B) * (1 - alpha) is the image composited on B' (up to the uint8 roundings)
        other = (0.2, 0.5, 0.9)
        expected = composite(rgba, other)
        if downscale == 2:
            expected = expected.reshape(4, 2, 3, 2, 3).mean(axis=(1, 3))
        recomposited = rgb + (np.array(other) - 1.0) * 255.0 * (1.0 - alpha[..., None] / 255.0)
        np.testing.assert_allclose(recomposited, expected, atol=1.01)
    write_png(tmp_path / "b.png", rgba[..., :3].copy())
    assert load_composited(tmp_path / "b.png", (1.0, 1.0, 1.0), 1)[1] is None


def small_scene(with_alpha: bool) -> Scene:
    generator = torch.Generator().manual_seed(0)
    views, size = 3, 8
    c2w = torch.eye(4).repeat(views, 1, 1)
    c2w[:, 2, 3] = 4.0
    return Scene(
        images=torch.randint(0, 256, (views, size, size, 3), generator=generator, dtype=torch.uint8),
        c2w=c2w,
        height=size,
        width=size,
        focal=10.0,
        near=NEAR,
        far=6.0,
        bbox=BBOX,
        background=(1.0, 1.0, 1.0),
        split="train",
        names=[f"v{i}" for i in range(views)],
        alpha=torch.randint(0, 256, (views, size, size), generator=generator, dtype=torch.uint8)
        if with_alpha
        else None,
    )


def test_scene_checks_alpha_and_samplers_return_it():
    scene = small_scene(True)
    batch = RaySampler(scene, 16, torch.Generator().manual_seed(1)).sample()
    rows, cols = batch.pixels.unbind(-1)
    torch.testing.assert_close(batch.alpha, scene.alpha[batch.views, rows, cols].float() / 255.0)
    assert RaySampler(small_scene(False), 16).sample().alpha is None
    with pytest.raises(ValueError, match="Scene.alpha"):
        Scene(**{**small_scene(True).__dict__, "alpha": torch.zeros(3, 8, 7, dtype=torch.uint8)})


def test_model_background_per_ray_replaces_its_own():
    model = make_model()
    randomize_density(model, mean=-10.0, std=1.0)  # nearly empty: the background shows through
    model.eval()
    origins, directions = rays_towards_centre(16)
    background = torch.rand(16, 3)
    out = model.render_rays(origins, directions, background)
    expected = model.render_rays(origins, directions)["rgb"] + (1 - out["opacity"])[:, None] * (
        background - model.background
    )
    torch.testing.assert_close(out["rgb"], expected, rtol=1e-5, atol=1e-5)


def test_opacity_loss_pulls_opacity_to_alpha_at_the_rays_resolution():
    from training.losses import opacity_loss

    generator = torch.Generator().manual_seed(3)
    opacity = torch.rand(2, 4, 4, generator=generator, dtype=torch.float64, requires_grad=True)
    alpha = torch.rand(2, 8, 8, generator=generator, dtype=torch.float64)
    pooled = alpha.reshape(2, 4, 2, 4, 2).mean(dim=(2, 4))  # 2x2 area average, written out
    loss = opacity_loss(opacity, alpha)
    torch.testing.assert_close(loss, ((opacity - pooled) ** 2).mean())
    loss.backward()
    torch.testing.assert_close(opacity.grad, 2 * (opacity - pooled).detach() / opacity.numel())
    per_ray = torch.rand(16, generator=generator, dtype=torch.float64)
    assert opacity_loss(per_ray, per_ray.clone()) == 0
    with pytest.raises(ValueError, match="does not fit"):
        opacity_loss(opacity, torch.rand(2, 7, 7, dtype=torch.float64))


# ------------------------------------------------------------------------------------------ the app


def test_app_trains_with_the_quality_options_and_reports_worst_views(tmp_path):
    from test_train import read_metrics, run_train, tiny_overrides

    overrides = tiny_overrides(tmp_path / "cache", 8) + [
        f"hydra.run.dir={tmp_path / 'run'}",
        "model.shading=per_sample",
        "model.upsample=1",
        "train.batch_rays=128",
        "model.shrink_at=4",
        "train.random_background=true",
        "train.adam_eps=1e-15",
        "data.tight_box=true",
        "train.opacity_loss=0.01",
    ]
    result = run_train(overrides)
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = read_metrics(tmp_path / "run")
    worst = sorted(v["psnr"] for v in metrics["per_view"])[: max(1, -(-len(metrics["per_view"]) // 10))]
    assert metrics["psnr_worst10"] == pytest.approx(float(np.mean(worst)))
    assert metrics["psnr_worst10"] <= metrics["psnr"]
    assert len(metrics["worst_views"]) == len(worst) and "grid_box" in metrics
    assert "worst 10% of views" in result.stdout


# ------------------------------------------------------------------------------------- the masks' hull


def sphere_scene(centre=(0.4, -0.2, 0.1), radius=0.3, size=48) -> Scene:
    """Cameras around the origin and alpha masks of a sphere, drawn by projecting dense points of it."""
    from data.cameras import look_at, orbit_positions
    from data.rays import camera_rays

    positions = np.concatenate(
        [
            orbit_positions(8, 4.0, 0.3),
            orbit_positions(8, 4.0, 1.0, phase=0.4),
            orbit_positions(4, 4.0, -0.4, phase=0.2),
        ]
    )
    c2w = torch.from_numpy(look_at(positions).astype(np.float32))
    focal = 0.5 * size / math.tan(0.5 * 0.7)
    origins, directions = camera_rays(c2w, size, size, focal)
    # a ray hits the sphere when its distance to the centre is below the radius (camera outside the sphere)
    to_centre = torch.tensor(centre) - origins
    along = (to_centre * directions).sum(-1, keepdim=True)
    miss = (to_centre - along * directions).norm(dim=-1)
    alpha = ((miss < radius) & (along[..., 0] > 0)).to(torch.uint8) * 255
    return Scene(
        images=torch.full((len(positions), size, size, 3), 255, dtype=torch.uint8),
        c2w=c2w,
        height=size,
        width=size,
        focal=focal,
        near=NEAR,
        far=6.0,
        bbox=BBOX,
        background=(1.0, 1.0, 1.0),
        split="train",
        names=[str(i) for i in range(len(positions))],
        alpha=alpha,
    )


def test_mask_hull_box_holds_the_object_and_little_else():
    from data.bounds import mask_hull_box

    centre, radius = torch.tensor([0.4, -0.2, 0.1]), 0.3
    box = mask_hull_box(sphere_scene(tuple(centre.tolist()), radius))
    assert bool((box[0] <= centre - radius).all()) and bool((box[1] >= centre + radius).all())
    assert bool(((box[1] - box[0]) < 2 * radius + 0.6).all())  # the hull of 20 views plus a 2-cell margin
    no_alpha = dataclasses.replace(sphere_scene(), alpha=None)
    torch.testing.assert_close(mask_hull_box(no_alpha), BBOX)


def test_model_starts_on_a_grid_box_with_the_scene_voxel_budget():
    from test_model import make_cfg

    from models import VoxelNeRF

    cfg, ops = make_cfg(grow_at=[], resolution_start=24, resolution_end=24), build_ops(TORCH_OPS)
    grid_box = torch.tensor([[-0.5, -1.0, -0.4], [0.5, 1.0, 0.6]])
    model = VoxelNeRF(BBOX, NEAR, 6.0, cfg, ops, grid_box=grid_box)
    torch.testing.assert_close(model.bbox, grid_box)
    assert np.prod(model.grid_shape) == pytest.approx(24**3, rel=0.25)  # the scene box's budget, finer voxels
    assert model.base_voxel == pytest.approx(VoxelNeRF(BBOX, NEAR, 6.0, cfg, ops).base_voxel)
    with pytest.raises(ValueError, match="grid_box"):
        VoxelNeRF(BBOX, NEAR, 6.0, cfg, ops, grid_box=torch.zeros(2, 3))
