"""Tests of the model package (CPU, small grids): API shapes, compositing against brute force, the packed /
occupancy / early-termination paths against the dense path, growth, checkpoints across resolutions, a tiny
overfit, and the custom ops against the torch references."""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from data import (
    PatchSampler,
    RaySampler,
    camera_rays,
    ensure_synthetic_scene,
    load_blender,
)
from models import OpSet, VoxelNeRF, build_ops
from models.decoder import spherical_harmonics
from models.field import VoxelGrid, grid_shape, optical_depth, to_unit
from models.render import (
    accumulate,
    compositing_weights,
    exclusive_segment_cumsum,
    ray_box_intersect,
    transmittance_above,
)

DEFAULT_CFG = Path(__file__).resolve().parents[1] / "configs" / "model" / "default.yaml"
BBOX = torch.tensor([[-1.5, -1.5, -1.5], [1.5, 1.5, 1.5]])
NEAR, FAR = 2.0, 6.0
TORCH_OPS = {
    "grid_interpolate": "torch",
    "upsample_bilinear2d": "torch",
    "gelu": "torch",
    "volume_render": "torch",
    "march_rays": "torch",
    "brick_grid_interpolate": "torch",
    "sparse_adam_step": "torch",
    "sampled_tv": "torch",
}


def make_cfg(**overrides) -> dict:
    """The shipped defaults, shrunk to small grids so tests are fast; ``overrides`` use dotted keys."""
    cfg = OmegaConf.load(DEFAULT_CFG)
    small = {"resolution_start": 12, "resolution_end": 20, "grow_at": [2, 4], "max_samples": 256, "tv_samples": 512}
    for key, value in {**small, **overrides}.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return OmegaConf.to_container(cfg)


def make_model(seed: int = 0, ops: OpSet | None = None, bbox: torch.Tensor = BBOX, **overrides) -> VoxelNeRF:
    torch.manual_seed(seed)
    model = VoxelNeRF(bbox, NEAR, FAR, make_cfg(**overrides), ops or build_ops(TORCH_OPS))
    return model


@torch.no_grad()
def randomize_density(model: VoxelNeRF, seed: int = 1, mean: float = 8.0, std: float = 4.0) -> None:
    """Random densities (not zeros) so rays are partly opaque; mean/std on the raw grid before the shift."""
    generator = torch.Generator().manual_seed(seed)
    grid = model.density.grid
    grid.copy_(mean + std * torch.randn(grid.shape, generator=generator))


def rays_towards_centre(count: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, 3) origins on a radius-4 sphere and unit directions aimed near the origin (most hit the box)."""
    generator = torch.Generator().manual_seed(seed)
    origins = torch.nn.functional.normalize(torch.randn(count, 3, generator=generator), dim=-1) * 4.0
    targets = 0.8 * (torch.rand(count, 3, generator=generator) * 2 - 1)
    return origins, torch.nn.functional.normalize(targets - origins, dim=-1)


def look_at_c2w(position: tuple[float, float, float]) -> torch.Tensor:
    """OpenGL camera-to-world at ``position`` looking at the origin, z up."""
    eye = torch.tensor(position)
    back = torch.nn.functional.normalize(eye, dim=0)
    right = torch.nn.functional.normalize(torch.linalg.cross(torch.tensor([0.0, 0.0, 1.0]), back), dim=0)
    up = torch.linalg.cross(back, right)
    c2w = torch.eye(4)
    c2w[:3, 0], c2w[:3, 1], c2w[:3, 2], c2w[:3, 3] = right, up, back, eye
    return c2w


# ---------------------------------------------------------------------------------------------- ops and config
def test_build_ops_maps_each_key_to_its_backend():
    import cuda_ext

    ops = build_ops(
        {
            "grid_interpolate": "custom",
            "upsample_bilinear2d": "torch",
            "gelu": "custom",
            "volume_render": "custom",
            "march_rays": "custom",
            "brick_grid_interpolate": "custom",
            "sparse_adam_step": "custom",
            "sampled_tv": "custom",
        }
    )
    assert ops.grid_interpolate is cuda_ext.grid_interpolate
    assert ops.upsample_bilinear2d is cuda_ext.reference.upsample_bilinear2d
    assert ops.gelu is cuda_ext.gelu
    assert ops.backends == {
        "grid_interpolate": "custom",
        "upsample_bilinear2d": "torch",
        "gelu": "custom",
        "volume_render": "custom",
        "march_rays": "custom",
        "brick_grid_interpolate": "custom",
        "sparse_adam_step": "custom",
        "sampled_tv": "custom",
    }


@pytest.mark.parametrize(
    "ops_cfg, key",
    [
        ({"grid_interpolate": "torch", "upsample_bilinear2d": "torch", "gelu": "cuda"}, "ops.gelu"),
        ({"grid_interpolate": "torch", "upsample_bilinear2d": "torch"}, "ops.gelu"),
        ({"grid_interpolate": "torch", "upsample_bilinear2d": "torch", "gelu": "torch", "relu": "torch"}, "ops.relu"),
    ],
)
def test_build_ops_rejects_bad_config(ops_cfg, key):
    with pytest.raises(ValueError, match=key):
        build_ops(ops_cfg)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("feature_dim", 2, "model.feature_dim"),
        ("upsample", 0, "model.upsample"),
        ("dir_encoding", "sh7", "model.dir_encoding"),
        ("grow_at", [1.5], "model.grow_at"),
        ("occupancy.threshold", -1.0, "model.occupancy.threshold"),
        ("resolution_start", 64, "model.resolution_start"),
        ("background", [1.0, 1.0], "model.background"),
        ("step_ratio", "big", "model.step_ratio"),
        ("early_termination", 1.0, r"model.early_termination: must be in \[0, 1\)"),
        ("weight_threshold", 1.0, r"model.weight_threshold: must be in \[0, 1\)"),
    ],
)
def test_bad_model_config_names_the_key(key, value, message):
    with pytest.raises(ValueError, match=message):
        make_model(**{key: value})


def test_model_config_fills_defaults_and_names_unknown_keys_and_wrong_types():
    from models.config import ModelConfig

    cfg = make_cfg()
    del cfg["density_shift"]  # a missing key takes the schema's default
    assert VoxelNeRF(BBOX, NEAR, FAR, cfg, build_ops(TORCH_OPS)).config.density_shift == ModelConfig().density_shift
    with pytest.raises(ValueError, match="model.density_shfit"):
        VoxelNeRF(BBOX, NEAR, FAR, {**make_cfg(), "density_shfit": -7.0}, build_ops(TORCH_OPS))
    with pytest.raises(ValueError, match="model.feature_dim"):
        VoxelNeRF(BBOX, NEAR, FAR, {**make_cfg(), "feature_dim": "twelve"}, build_ops(TORCH_OPS))
    with pytest.raises(ValueError, match="model.occupancy.warmup"):
        VoxelNeRF(BBOX, NEAR, FAR, {**make_cfg(), "occupancy": {"warmup": -1}}, build_ops(TORCH_OPS))


def test_bad_rays_raise():
    model = make_model()
    with pytest.raises(ValueError, match="render_rays"):
        model.render_rays(torch.zeros(4, 3), torch.zeros(5, 3))
    with pytest.raises(ValueError, match="bbox"):
        VoxelNeRF(torch.zeros(2, 3), NEAR, FAR, make_cfg(), build_ops(TORCH_OPS))


# ---------------------------------------------------------------------------------------------- API shapes
def test_render_rays_shapes_and_ranges():
    model = make_model()
    randomize_density(model)
    origins, directions = rays_towards_centre(37)
    out = model.render_rays(origins, directions)
    assert out["rgb"].shape == (37, 3) and out["depth"].shape == (37,) and out["opacity"].shape == (37,)
    assert all(v.dtype == torch.float32 for k, v in out.items() if k not in ("samples", "packed"))
    assert torch.isfinite(out["rgb"]).all()
    assert (out["opacity"] >= 0).all() and (out["opacity"] <= 1 + 1e-6).all()
    assert out["opacity"].max() > 0.5  # the random densities are visible
    hit = out["opacity"] > 1e-3
    mean_depth = out["depth"][hit] / out["opacity"][hit]
    assert (mean_depth > NEAR - 1e-4).all() and (mean_depth < FAR + 1e-4).all()


def test_render_patches_and_image_shapes():
    model = make_model(upsample=2)
    assert model.upsample == 2
    randomize_density(model)
    n, p = 3, 4
    origins, directions = rays_towards_centre(n * p * p)
    _, hr_directions = rays_towards_centre(n * 8 * 8, seed=1)
    from data import PatchBatch

    batch = PatchBatch(
        origins.reshape(n, p, p, 3),
        directions.reshape(n, p, p, 3),
        hr_directions.reshape(n, 8, 8, 3),
        torch.rand(n, 8, 8, 3),
    )
    out = model.render_patches(batch)
    assert out["rgb"].shape == (n, 8, 8, 3) and out["depth"].shape == (n, p, p) and out["opacity"].shape == (n, p, p)
    with pytest.raises(ValueError, match="hr_directions"):
        model.render_patches(PatchBatch(batch.origins, batch.directions, batch.directions, batch.rgb))

    image = model.render_image(look_at_c2w((3.0, 2.0, 2.5)), 12, 16, 20.0, chunk=50)
    assert image["rgb"].shape == (12, 16, 3) and image["depth"].shape == (12, 16) and image["opacity"].shape == (12, 16)
    assert image["rgb"].min() >= 0 and image["rgb"].max() <= 1
    assert not image["rgb"].requires_grad


def test_render_image_per_pixel_matches_render_rays():
    """upsample=1: render_image is render_rays over camera_rays (no jitter), chunking does not matter."""
    model = make_model(upsample=1)
    randomize_density(model)
    model.eval()
    c2w = look_at_c2w((2.5, -3.0, 1.5))
    image = model.render_image(c2w, 10, 12, 14.0, chunk=17)
    origins, directions = camera_rays(c2w, 10, 12, 14.0)
    with torch.no_grad():
        rays = model.render_rays(origins.reshape(-1, 3), directions.reshape(-1, 3))
    torch.testing.assert_close(image["rgb"].reshape(-1, 3), rays["rgb"].clamp(0, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(image["depth"].reshape(-1), rays["depth"], rtol=1e-5, atol=1e-5)


def test_param_groups_cover_every_parameter_once():
    model = make_model()
    groups = model.param_groups(0.1, 1e-3)
    assert [g["lr"] for g in groups] == [0.1, 1e-3]
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters() if p.numel()}  # the fine grid's rows: none yet


def test_gradients_reach_grids_and_decoder():
    model = make_model(upsample=1)
    randomize_density(model, mean=6.0, std=2.0)
    origins, directions = rays_towards_centre(64)
    out = model.render_rays(origins, directions)
    loss = ((out["rgb"] - 0.3) ** 2).mean() + model.regularization()
    loss.backward()
    model.row_grads.scatter()  # the TV rows' gradients (model.tv_sparse_grad)
    assert model.density.grid.grad.abs().sum() > 0
    assert model.features.grid.grad.abs().sum() > 0
    assert model.decoder.out.weight.grad.abs().sum() > 0  # zero-initialised, but it gets a gradient


def test_regularization_is_differentiable_and_switches_off():
    model = make_model(tv_density=1.0, tv_features=1.0, tv_until=0.5)
    reg = model.regularization()
    assert reg.dim() == 0 and reg > 0 and reg.requires_grad
    model.on_step(6, 10)
    reg = model.regularization()
    assert reg.item() == 0.0 and reg.requires_grad


def test_total_variation_sampled_estimate_matches_whole_grid():
    torch.manual_seed(0)
    grid = VoxelGrid((9, 7, 8), 3, init_std=1.0)
    full = grid.total_variation(0).item()
    estimates = torch.tensor([grid.total_variation(200).item() for _ in range(200)])
    # the whole-grid TV averages each axis's differences over slightly more voxels: compare loosely
    assert abs(estimates.mean().item() - full) < 0.05 * full
    exact = sum((torch.diff(grid.grid.detach().double(), dim=a) ** 2).mean() for a in range(3)).item()
    assert math.isclose(full, exact, rel_tol=1e-5)


def test_spherical_harmonics_are_orthonormal():
    generator = torch.Generator().manual_seed(0)
    directions = torch.nn.functional.normalize(
        torch.randn(400_000, 3, generator=generator, dtype=torch.float64), dim=-1
    )
    basis = spherical_harmonics(directions, 3)
    gram = basis.T @ basis * (4 * math.pi / directions.shape[0])
    torch.testing.assert_close(gram, torch.eye(16, dtype=torch.float64), atol=0.03, rtol=0)


# ---------------------------------------------------------------------------------------------- compositing
def random_packed(num_rays: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random packed optical depths (float64) for rays with 0..9 samples each, in ray order."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 10, (num_rays,), generator=generator)
    counts[0] = 0  # an empty ray first, where offsets are easiest to get wrong
    ray = torch.repeat_interleave(torch.arange(num_rays), counts)
    depth = torch.rand(ray.shape[0], generator=generator, dtype=torch.float64) * 1.5
    return depth, ray, counts.tolist()


def test_compositing_matches_per_ray_loop():
    depth, ray, counts = random_packed(40, seed=3)
    values = torch.randn(depth.shape[0], 5, dtype=torch.float64)
    weights = compositing_weights(depth, ray, 40)
    sums = accumulate(values, weights, ray, 40)
    start = 0
    for r, count in enumerate(counts):
        transmittance, expected_w = 1.0, []
        for i in range(start, start + count):
            alpha = 1.0 - math.exp(-depth[i].item())
            expected_w.append(transmittance * alpha)
            transmittance *= 1.0 - alpha
        got = weights[start : start + count]
        torch.testing.assert_close(got, torch.tensor(expected_w, dtype=torch.float64), rtol=1e-12, atol=1e-12)
        expected_sum = (
            sum(w * values[start + k] for k, w in enumerate(expected_w))
            if count
            else torch.zeros(5, dtype=torch.float64)
        )
        torch.testing.assert_close(sums[r], expected_sum, rtol=1e-12, atol=1e-12)
        if count:  # opacity = 1 - final transmittance
            assert math.isclose(got.sum().item(), 1.0 - transmittance, rel_tol=1e-12, abs_tol=1e-12)
        start += count


def test_compositing_gradcheck():
    depth, ray, _ = random_packed(6, seed=4)
    values = torch.randn(depth.shape[0], 2, dtype=torch.float64, requires_grad=True)
    depth.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda d, v: accumulate(v, compositing_weights(d, ray, 6), ray, 6), (depth, values))


def test_exclusive_segment_cumsum_large_batch_float32():
    """Many rays: the per-ray sums must not pick up the rounding of the global running sum."""
    generator = torch.Generator().manual_seed(5)
    counts = torch.randint(1, 200, (3000,), generator=generator)
    ray = torch.repeat_interleave(torch.arange(3000), counts)
    values = torch.rand(ray.shape[0], generator=generator) * 20
    got = exclusive_segment_cumsum(values, ray, 3000)
    expected = torch.cat([torch.cumsum(v.double(), 0) - v.double() for v in values.split(counts.tolist())])
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-4)


def test_transmittance_above_keeps_a_prefix():
    depth, ray, counts = random_packed(30, seed=6)
    keep = transmittance_above(depth, ray, 30, 0.05)
    excl = exclusive_segment_cumsum(depth, ray, 30)
    torch.testing.assert_close(keep, torch.exp(-excl) > 0.05)
    for part in keep.split(counts):  # once dropped, every later sample of the ray is dropped
        assert not any(later and not earlier for earlier, later in zip(part[:-1].tolist(), part[1:].tolist()))


def test_ray_box_intersect_against_point_tests():
    origins, directions = rays_towards_centre(200, seed=7)
    directions[:5] = torch.tensor([0.0, 0.0, 1.0])  # axis-aligned rays: zero direction components
    t_start, t_end = ray_box_intersect(origins, directions, BBOX, NEAR, FAR)
    for i in range(200):
        ts = torch.linspace(0, 8, 4001, dtype=torch.float64)
        points = origins[i].double() + ts[:, None] * directions[i].double()
        inside = ((points >= BBOX[0].double()) & (points <= BBOX[1].double())).all(-1) & (ts >= NEAR) & (ts <= FAR)
        if inside.any():
            assert abs(ts[inside].min().item() - t_start[i].item()) < 3e-3
            assert abs(ts[inside].max().item() - t_end[i].item()) < 3e-3
        else:
            assert t_end[i] <= t_start[i] + 3e-3


# ---------------------------------------------------------------------------------------------- packed vs dense
def dense_reference(model: VoxelNeRF, origins: torch.Tensor, directions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every sample of every ray, no packing, skipping or termination; float64 compositing by cumprod."""
    import cuda_ext.reference as ref

    c = model.config
    step = model.step_size
    t_start, t_end = ray_box_intersect(origins, directions, model.bbox, NEAR, FAR)
    count = math.ceil(math.sqrt(sum(e * e for e in model.extent)) / step)
    t = t_start[:, None] + (torch.arange(count)[None, :] + 0.5) * step
    valid = t < t_end[:, None]
    points = to_unit(origins[:, None] + t[..., None] * directions[:, None], model.bbox).reshape(-1, 3)
    with torch.no_grad():
        raw = ref.grid_interpolate(model.density.grid, points).reshape(t.shape).double()
        feats = ref.grid_interpolate(model.features.grid, points).reshape(*t.shape, -1).double()
    sigma_delta = optical_depth(raw, c.density_shift, step / model.base_voxel) * valid
    alpha = 1 - torch.exp(-sigma_delta)
    transmittance = torch.cumprod(torch.cat([torch.ones_like(alpha[:, :1]), 1 - alpha[:, :-1]], 1), 1)
    w = transmittance * alpha
    return {
        "diffuse": (w[..., None] * torch.sigmoid(feats[..., :3])).sum(1),
        "features": (w[..., None] * feats[..., 3:]).sum(1),
        "depth": (w * t).sum(1),
        "opacity": w.sum(1),
    }


def test_packed_path_matches_dense_path_when_all_occupied():
    model = make_model(early_termination=0.0, weight_threshold=0.0)
    randomize_density(model, mean=2.0, std=6.0)
    assert bool(model.occupancy.mask.all())
    origins, directions = rays_towards_centre(50, seed=8)
    with torch.no_grad():
        got = model.march(origins, directions, jitter=False)
    expected = dense_reference(model, origins, directions)
    assert expected["opacity"].max() > 0.9 and expected["opacity"].min() < 0.5  # a mix of opaque and clear rays
    for key in ("diffuse", "features", "depth", "opacity"):
        torch.testing.assert_close(got[key].double(), expected[key], rtol=1e-4, atol=1e-4)


def test_occupancy_skipping_changes_little_and_skips_samples():
    model = make_model(
        early_termination=0.0, weight_threshold=0.0, **{"occupancy.threshold": 1e-3, "occupancy.dilate": 0}
    )
    with torch.no_grad():  # a blob of density in a mostly empty box (raw -20: alpha ~ 1e-9)
        coords = torch.stack(torch.meshgrid(*[torch.linspace(-1, 1, r) for r in model.grid_shape], indexing="ij"), -1)
        blob = 12.0 - 40.0 * (coords - torch.tensor([0.2, -0.1, 0.0])).norm(dim=-1)
        model.density.grid.copy_(blob.clamp(min=-20.0)[..., None])
    origins, directions = rays_towards_centre(80, seed=9)
    with torch.no_grad():
        dense = model.march(origins, directions, jitter=False)
        model.refresh_occupancy()
        assert 0.0 < model.occupancy.occupied_fraction() < 0.2
        skipped = model.march(origins, directions, jitter=False)
    assert skipped["samples"] < 0.5 * dense["samples"]
    # every dropped sample had alpha < threshold: at most (samples per ray) * threshold per ray
    bound = 260 * 1e-3
    assert (dense["opacity"] - skipped["opacity"]).abs().max() < bound
    assert (dense["diffuse"] - skipped["diffuse"]).abs().max() < bound


def with_config(model: VoxelNeRF, **changes) -> VoxelNeRF:
    """A copy of ``model`` (same weights) with config fields changed."""
    other = copy.deepcopy(model)
    other.config = dataclasses.replace(model.config, **changes)
    return other


def test_early_termination_changes_results_less_than_threshold():
    threshold = 1e-2
    model = make_model(early_termination=0.0, weight_threshold=0.0)
    randomize_density(model, mean=4.0, std=6.0)
    terminating = with_config(model, early_termination=threshold)
    origins, directions = rays_towards_centre(60, seed=10)
    with torch.no_grad():
        full = model.march(origins, directions, jitter=False)
        cut = terminating.march(origins, directions, jitter=False)
    assert cut["samples"] < full["samples"]
    assert (full["opacity"] - cut["opacity"]).abs().max() <= threshold
    assert (full["diffuse"] - cut["diffuse"]).abs().max() <= threshold  # sigmoid colours are in [0, 1]
    assert (full["depth"] - cut["depth"]).abs().max() <= threshold * FAR


def test_weight_threshold_skips_only_faint_colours():
    threshold = 1e-3
    model = make_model(early_termination=0.0, weight_threshold=0.0)
    randomize_density(model, mean=-2.0, std=6.0)
    skipping = with_config(model, weight_threshold=threshold)
    origins, directions = rays_towards_centre(60, seed=11)
    with torch.no_grad():
        full = model.march(origins, directions, jitter=False)
        cut = skipping.march(origins, directions, jitter=False)
    torch.testing.assert_close(cut["opacity"], full["opacity"])  # geometry uses every sample
    torch.testing.assert_close(cut["depth"], full["depth"])
    changed = (full["diffuse"] - cut["diffuse"]).abs().max()
    assert 0 < changed <= threshold * model.config.max_samples  # each skipped sample adds < threshold * colour


@pytest.mark.parametrize("early, threshold", [(1e-2, 1e-3), (0.0, 1e-3), (1e-2, 0.0)])
def test_the_march_keeps_the_samples_the_reference_pass_keeps(early, threshold):
    """Training's march through ``ops.visible_samples``' kernel keeps, shades and composites what it does through the
    reference (the former Python pass), in float64: same sample count, same channels, same gradients."""
    model = make_model(early_termination=early, weight_threshold=threshold).double()
    randomize_density(model, mean=2.0, std=6.0)
    kernel = copy.deepcopy(model)
    kernel.ops = build_ops(TORCH_OPS | {"volume_render": "custom"})  # the family: visible_samples too
    origins, directions = (x.double() for x in rays_towards_centre(200, seed=12))
    outs, grads = [], []
    for each in (model, kernel):
        out = each.march(origins, directions, jitter=False)
        (out["diffuse"].sum() + out["opacity"].sum()).backward()
        outs.append(out)
        grads.append(each.density.grid.grad)
    assert int(outs[0]["samples"]) == int(outs[1]["samples"]) > 0
    for key in ("diffuse", "features", "depth", "opacity"):
        torch.testing.assert_close(outs[1][key], outs[0][key], rtol=1e-12, atol=1e-12, msg=key)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-12, atol=1e-12)
    assert grads[0].abs().sum() > 0


# ---------------------------------------------------------------------------------------------- growth and state
def smooth_field(model: VoxelNeRF) -> None:
    """Smooth (low-frequency) values in both grids, so resampling them is nearly exact."""
    with torch.no_grad():
        for grid in (model.density.grid, model.features.grid):
            axes = [torch.linspace(-1, 1, r) for r in grid.shape[:3]]
            x, y, z = torch.meshgrid(*axes, indexing="ij")
            channels = [
                torch.sin(1.3 * x + 0.4 * c) * torch.cos(0.9 * y - 0.2 * c) + 0.5 * z * c for c in range(grid.shape[3])
            ]
            grid.copy_(torch.stack(channels, -1) * 3.0)


def test_growth_schedule_and_field_is_kept():
    model = make_model(resolution_start=10, resolution_end=40, grow_at=[3, 0.5])
    assert model.resolution == 10
    smooth_field(model)
    points = torch.rand(500, 3) * 2 - 1
    ops = model.ops
    before_density = model.density(points, ops).detach()
    before_features = model.features(points, ops).detach()
    grown = [model.on_step(step, 10) for step in range(1, 11)]
    assert grown == [False, False, True, False, True, False, False, False, False, False]
    assert model.resolution == 40 and model.grid_shape == (40, 40, 40)
    assert model.features.grid.shape == (40, 40, 40, model.config.feature_dim)
    assert isinstance(model.density.grid, torch.nn.Parameter)
    torch.testing.assert_close(model.density(points, ops), before_density, atol=0.05, rtol=0)
    torch.testing.assert_close(model.features(points, ops), before_features, atol=0.05, rtol=0)
    assert model.occupancy.mask.shape == (39, 39, 39)


def test_growth_with_non_cubic_box():
    bbox = torch.tensor([[-1.0, -0.5, -0.25], [1.0, 0.5, 0.25]])
    model = make_model(bbox=bbox, resolution_start=9, resolution_end=17)
    assert model.grid_shape == grid_shape((2.0, 1.0, 0.5), 9) == (9, 5, 3)
    model.on_step(4, 10)
    assert model.grid_shape == (17, 9, 5)
    origins, directions = rays_towards_centre(10)
    assert model.render_rays(origins, directions)["rgb"].shape == (10, 3)


def test_load_state_dict_across_resolutions():
    grown = make_model(seed=0)
    randomize_density(grown, mean=0.0)
    for step in range(1, 8):
        grown.on_step(step, 10)  # grows to the end resolution (warm-up not reached: all occupied)
    grown.refresh_occupancy()
    assert grown.resolution == 20 and not bool(grown.occupancy.mask.all())
    fresh = make_model(seed=1)
    assert fresh.resolution == 12
    fresh.load_state_dict(grown.state_dict())
    assert fresh.grid_shape == grown.grid_shape
    assert fresh.occupancy.mask.shape == grown.occupancy.mask.shape
    assert isinstance(fresh.features.grid, torch.nn.Parameter)
    origins, directions = rays_towards_centre(30)
    fresh.eval(), grown.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            fresh.render_rays(origins, directions)["rgb"], grown.render_rays(origins, directions)["rgb"]
        )
    # and back down to a smaller grid
    small = make_model(seed=2)
    grown.load_state_dict(small.state_dict())
    assert grown.grid_shape == small.grid_shape


# ---------------------------------------------------------------------------------------------- training
@pytest.fixture(scope="module")
def tiny_scene(tmp_path_factory) -> Path:
    return ensure_synthetic_scene(tmp_path_factory.mktemp("scene"), resolution=24, n_train=6, n_val=1, n_test=1, seed=2)


@pytest.fixture
def one_thread():
    """Intra-op threads spin at barriers when the machine is oversubscribed (CI, parallel jobs): use one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("upsample", [1, 2])
def test_tiny_overfit(tiny_scene, upsample, one_thread):
    scene = load_blender(tiny_scene, "train")
    torch.manual_seed(0)
    cfg = make_cfg(
        resolution_start=12,
        resolution_end=20,
        grow_at=[30],
        upsample=upsample,
        tv_samples=1024,
        **{"occupancy.warmup": 40, "occupancy.refresh_every": 20},
    )
    model = VoxelNeRF(scene.bbox, scene.near, scene.far, cfg, build_ops(TORCH_OPS))
    generator = torch.Generator().manual_seed(0)
    sampler = PatchSampler(scene, 4, 2, 16, generator) if upsample == 2 else RaySampler(scene, 256, generator)
    optimizer = torch.optim.Adam(model.param_groups(0.1, 3e-3))
    losses = []
    iters = 100
    for step in range(1, iters + 1):
        batch = sampler.sample()
        out = model.render_patches(batch) if upsample == 2 else model.render_rays(batch.origins, batch.directions)
        mse = ((out["rgb"] - batch.rgb) ** 2).mean()
        optimizer.zero_grad()
        (mse + model.regularization()).backward()
        model.row_grads.scatter()  # the TV rows' gradients (model.tv_sparse_grad)
        optimizer.step()
        if model.on_step(step, iters):
            optimizer = torch.optim.Adam(model.param_groups(0.1, 3e-3))
        losses.append(mse.item())
    start, end = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert end < 0.1 * start, (start, end)
    assert not bool(model.occupancy.mask.all())  # skipping was active by the end


# ---------------------------------------------------------------------------------------------- backends
def test_custom_ops_match_torch_ops():
    custom = build_ops(
        {
            "grid_interpolate": "custom",
            "upsample_bilinear2d": "custom",
            "gelu": "custom",
            "volume_render": "custom",
            "march_rays": "custom",
            "brick_grid_interpolate": "custom",
            "sparse_adam_step": "custom",
            "sampled_tv": "custom",
        }
    )
    reference_model = make_model(upsample=2, decoder_layers=2)
    randomize_density(reference_model)
    custom_model = copy.deepcopy(reference_model)
    custom_model.ops = custom
    custom_model.decoder.ops = custom
    with torch.no_grad():  # a non-trivial decoder: its last layer starts at zero
        custom_model.decoder.out.weight.normal_(0, 0.5)
        reference_model.decoder.out.weight.copy_(custom_model.decoder.out.weight)
    c2w = look_at_c2w((3.0, 2.0, 2.5))
    try:
        got = custom_model.render_image(c2w, 12, 16, 20.0)
    except RuntimeError as error:
        if "not written yet" in str(error):
            pytest.skip(f"custom kernels not written yet: {error}")
        raise
    expected = reference_model.render_image(c2w, 12, 16, 20.0)
    for key in ("rgb", "depth", "opacity"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ decoder precision


def _decoders(device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    from models.decoder import SampleDecoder

    ops = build_ops(TORCH_OPS | {"gelu": "custom"})
    torch.manual_seed(0)
    full = SampleDecoder(12, 64, 2, "pe3", "none", ops, "float32").to(device)
    torch.nn.init.normal_(full.out.weight, std=0.1)  # the last layer starts at zero: make it show
    half = SampleDecoder(12, 64, 2, "pe3", "none", ops, "bfloat16").to(device)
    half.load_state_dict(full.state_dict())
    return full, half


def _decode(decoder: torch.nn.Module, device: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(500, 12, generator=generator).to(device).requires_grad_()
    directions = torch.nn.functional.normalize(torch.randn(500, 3, generator=generator), dim=-1).to(device)
    out = decoder(features, directions)
    out.square().sum().backward()
    return out, [features.grad, *(p.grad for p in decoder.parameters())]


def test_bfloat16_decoder_is_float32_on_the_cpu():
    full, half = _decoders("cpu")
    (out_full, grads_full), (out_half, grads_half) = _decode(full, "cpu"), _decode(half, "cpu")
    assert torch.equal(out_full, out_half)
    assert all(torch.equal(a, b) for a, b in zip(grads_full, grads_half))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bfloat16_decoder_is_close_to_float32_on_cuda_with_float32_outputs_and_gradients():
    full, half = _decoders("cuda")
    (out_full, grads_full), (out_half, grads_half) = _decode(full, "cuda"), _decode(half, "cuda")
    assert out_half.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads_half)
    assert (out_half - out_full).abs().max() < 2e-2
    for a, b in zip(grads_full, grads_half):
        assert (a - b).norm() <= 0.05 * a.norm() + 1e-6


def test_decoder_precision_is_checked():
    with pytest.raises(ValueError, match="model.decoder_precision"):
        make_model(decoder_precision="float16")
