"""The model's march (CPU, small grids): compositing against brute force, the packed / occupancy / early-termination
/ weight-threshold paths against the dense path, and the visibility pass's kernel against its reference."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
from test_model import BBOX, FAR, NEAR, TORCH_OPS, make_model, randomize_density, rays_towards_centre

from models import VoxelNeRF, build_ops
from models.field import optical_depth, to_unit
from models.render import (
    accumulate,
    compositing_weights,
    exclusive_segment_cumsum,
    ray_box_intersect,
    transmittance_above,
)


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
