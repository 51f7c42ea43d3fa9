"""The floater regularisers (models/regularizers.py, training/losses.py): the near-density penalty against a loop,
both regularisers on a model's render (the distortion loss through the model's op; the op itself:
tests/test_distortion_loss.py), and the photometric losses and their config keys."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf
from test_model import make_model

from cuda_ext import reference
from models.regularizers import RenderedSamples, near_optical_depth
from models.render import compositing_weights
from training.config import ConfigError, typed, validate_config
from training.losses import dssim, floater_losses, photometric_loss
from training.metrics import ssim_map


def random_packed(gen: torch.Generator, counts: list[int], dtype=torch.float64):
    """Packed samples of len(counts) rays: ray (N,), sorted non-overlapping intervals with gaps, weights in (0, 1)."""
    ray = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    n = ray.shape[0]
    # per ray: increasing starts with random gaps (empty-space skipping) and lengths shorter than the next gap
    gaps = torch.rand(n, generator=gen, dtype=dtype) * 0.5 + 0.05
    starts = torch.cat([torch.cumsum(gaps[ray == r], 0) for r in range(len(counts))]) + 2.0
    lengths = torch.rand(n, generator=gen, dtype=dtype) * 0.04 + 0.001
    weights = torch.rand(n, generator=gen, dtype=dtype) * 0.9 + 0.01
    return ray, starts, starts + lengths, weights


COUNTS = [5, 0, 1, 17, 3, 0, 40]  # rays with no sample, one sample, many


def test_near_optical_depth_matches_loop(gen):
    ray, t0, _, _ = random_packed(gen, COUNTS)
    s = torch.rand(ray.shape[0], generator=gen, dtype=torch.float64).requires_grad_()
    limit = torch.rand(len(COUNTS), generator=gen, dtype=torch.float64) * 6 + 2
    got = near_optical_depth(ray, t0, s, limit)
    want = torch.stack([s[(ray == r) & (t0 < limit[r])].sum() for r in range(len(COUNTS))])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-14)
    assert torch.autograd.gradcheck(lambda x: near_optical_depth(ray, t0, x, limit), (s,))
    with pytest.raises(ValueError, match="near_optical_depth: t"):
        near_optical_depth(ray, t0[:-1], s, limit)


def dense_model():
    """A small model whose density is random and visible (the default init is nearly transparent)."""
    model = make_model(seed=3, resolution_start=20, early_termination=0.0)
    with torch.no_grad():
        model.density.grid.normal_(0.0, 3.0).add_(4.0)
    return model


def camera_batch(count: int = 64):
    torch.manual_seed(1)
    origins = torch.tensor([0.0, 0.0, 4.0]).expand(count, 3) + 0.1 * torch.randn(count, 3)
    directions = torch.nn.functional.normalize(-origins + 0.3 * torch.randn(count, 3), dim=-1)
    return origins, directions


def test_render_exposes_packed_samples():
    model = dense_model().train()
    origins, directions = camera_batch()
    out = model.render_rays(origins, directions, jitter=torch.rand(origins.shape[0]))
    packed = out["packed"]
    assert isinstance(packed, RenderedSamples) and packed.step == pytest.approx(model.step_size)
    weights = packed.weights(origins.shape[0])
    # the regularisers see the rendered rays: their weights add up to each ray's opacity
    per_ray = torch.zeros(origins.shape[0]).index_add(0, packed.ray, weights)
    torch.testing.assert_close(per_ray, out["opacity"], rtol=1e-5, atol=1e-6)
    assert out["opacity"].min() < 0.99 and out["opacity"].max() > 0.5  # neither empty nor saturated
    # intervals centred on the samples, distances in the given unit, through the model's op
    unit, op = 2.5, model.ops.distortion_loss
    t0, t1 = ((packed.t + sign * packed.step / 2).detach() / unit for sign in (-1, 1))
    want = reference.distortion_loss(packed.optical_depth, t0, t1, packed.offsets)
    torch.testing.assert_close(packed.distortion(op, origins.shape[0], unit), want)
    packed.distortion(op, origins.shape[0]).mean().backward()
    assert model.density.grid.grad.abs().sum() > 0


def test_near_density_loss_only_touches_voxels_near_the_cameras():
    model = dense_model().train()
    origins, directions = camera_batch()
    out = model.render_rays(origins, directions, jitter=torch.full((origins.shape[0],), 0.5))
    centre = torch.zeros(3)
    cfg = OmegaConf.create({"near_density_loss": 1.0, "near_density_fraction": 0.8})  # cameras ~4 from the centre
    loss = floater_losses(out, origins, cfg, centre, 1.0, model.ops)
    loss.backward()
    grad = model.density.grid.grad[..., 0]
    assert grad.abs().sum() > 0
    # vertices farther than the limit (about 0.8 * 4 = 3.2) from every camera, plus a voxel, get no gradient
    limit = 0.8 * (origins - centre).norm(dim=-1)
    shape = grad.shape
    axes = [torch.linspace(float(model.bbox[0, k]), float(model.bbox[1, k]), shape[k]) for k in range(3)]
    vertices = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1)
    distance = (vertices[..., None, :] - origins).norm(dim=-1).amin(-1)
    voxel = float(model.step_size / model.config.step_ratio)
    far = distance > float(limit.max()) + 2 * voxel
    assert far.float().mean() > 0.5 and grad[far].abs().max() == 0
    assert grad[distance < 3.0].abs().sum() > 0
    # and it is the mean near optical depth
    torch.testing.assert_close(loss.detach(), out["packed"].near_density(limit).mean().detach())


def test_floater_losses_off_by_default():
    cfg = OmegaConf.create({})
    assert floater_losses({}, torch.zeros(2, 3), cfg, torch.zeros(3), 1.0, None) == 0.0  # nothing is computed


def test_floater_losses_weights():
    model = dense_model().train()
    origins, directions = camera_batch(32)
    out = model.render_rays(origins, directions, jitter=torch.full((32,), 0.5))
    packed = out["packed"]
    cfg = OmegaConf.create({"distortion_loss": 0.01, "near_density_loss": 0.1, "near_density_fraction": 0.3})
    got = floater_losses(out, origins, cfg, torch.zeros(3), 5.0, model.ops)
    want = 0.01 * packed.distortion(model.ops.distortion_loss, 32, 5.0).mean()
    want = want + 0.1 * packed.near_density(0.3 * origins.norm(dim=-1)).mean()
    torch.testing.assert_close(got, want)


def test_photometric_losses(gen):
    rgb, target = torch.rand(50, 3, generator=gen), torch.rand(50, 3, generator=gen)
    d = rgb - target
    torch.testing.assert_close(photometric_loss(rgb, target, "mse"), d.square().mean())
    torch.testing.assert_close(photometric_loss(rgb, target, "l1"), d.abs().mean())
    torch.testing.assert_close(photometric_loss(rgb, target, "charbonnier"), torch.sqrt(d.square() + 1e-6).mean())
    with pytest.raises(ValueError, match="train.loss"):
        photometric_loss(rgb, target, "l2")


def test_dssim_matches_the_metric_and_has_gradients(gen):
    pred, target = (
        torch.rand(3, 13, 12, 3, generator=gen, dtype=torch.float64),
        torch.rand(3, 13, 12, 3, generator=gen, dtype=torch.float64),
    )
    target[1] = 0.7 * pred[1] + 0.3 * target[1]  # one patch close to its target
    want = 1.0 - torch.stack([ssim_map(p, t).mean() for p, t in zip(pred, target)]).mean()
    torch.testing.assert_close(dssim(pred, target), want)
    assert dssim(target, target).abs() < 1e-12
    small = pred[:1, :11, :11].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda x: dssim(x, target[:1, :11, :11]), (small,))
    with pytest.raises(ValueError, match="train.dssim"):
        dssim(pred[:, :8, :8], target[:, :8, :8])


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.loss", "huber", "train.loss: unknown photometric loss"),
        ("train.distortion_loss", -0.1, "train.distortion_loss: must be >= 0"),
        ("train.near_density_loss", math.inf, "train.near_density_loss: must be finite"),
        ("train.near_density_fraction", -1.0, "train.near_density_fraction: must be >= 0"),
        ("train.dssim", -0.5, "train.dssim: must be >= 0"),
        ("train.dssim", 0.2, "train.dssim: needs patch batches"),  # upsample 1: patches of 8 < 11 pixels
        ("train.patch_size", 5, "train.dssim: needs patch batches"),  # 5 * 2 < 11
    ],
)
def test_bad_config(key, value, message):
    cfg = typed({"data": {"name": "synthetic"}})
    if key == "train.patch_size":
        OmegaConf.update(cfg, "train.dssim", 0.2)
    else:
        OmegaConf.update(cfg, "model.upsample", 1)
    OmegaConf.update(cfg, key, value)
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


def test_compositing_weights_used_are_the_renderers(gen):
    # RenderedSamples.weights is models.render.compositing_weights: no second formula to drift
    s = torch.rand(30, generator=gen)
    ray = torch.repeat_interleave(torch.arange(3), torch.tensor([10, 15, 5]))
    packed = RenderedSamples(ray, torch.linspace(2, 5, 30), s, 0.1)
    torch.testing.assert_close(packed.weights(3), compositing_weights(s, ray, 3))


@pytest.mark.parametrize(
    "levers",
    [
        # deferred shading on patches: the affine transform per pixel, the regularisers on the low-res rays
        [
            "model.appearance=affine",
            "train.loss=l1",
            "train.dssim=0.25",
            "train.patch_size=6",
            "train.distortion_loss=0.01",
            "train.near_density_loss=0.1",
        ],
        # per-sample shading on rays: the embedding per sample
        [
            "model.appearance=embedding",
            "model.appearance_dim=3",
            "model.upsample=1",
            "model.shading=per_sample",
            "train.batch_rays=64",
            "train.loss=charbonnier",
            "train.distortion_loss=0.01",
        ],
        # per-sample shading, D-SSIM on per-pixel patches (upsample 1): each patch's image code per sample
        [
            "model.appearance=embedding",
            "model.appearance_dim=3",
            "model.upsample=1",
            "model.shading=per_sample",
            "train.loss=l1",
            "train.dssim=0.25",
            "train.patch_size=12",
            "train.patches_per_batch=2",
        ],
    ],
)
def test_training_with_the_levers(tmp_path, levers):
    from test_train import read_metrics, run_train, tiny_overrides

    run_dir = tmp_path / "run"
    result = run_train(tiny_overrides(tmp_path / "cache", 8) + levers + [f"hydra.run.dir={run_dir}"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert math.isfinite(read_metrics(run_dir)["psnr"])
    # the per-image table travels in the saved weights: one row per training image (data.n_train=6)
    tables = [
        value
        for path in run_dir.rglob("*.pt")
        for key, value in _flat(torch.load(path, map_location="cpu", weights_only=False))
        if key.endswith("decoder.appearance.table")
    ]
    assert tables and all(t.shape[0] == 6 for t in tables)
    if "model.appearance=embedding" in levers:  # each image's rays reached its own code (None: the mean, alike)
        assert all(not torch.allclose(t, t[:1].expand_as(t)) for t in tables)


def _flat(state, prefix: str = ""):
    """(dotted key, value) of every tensor in nested dicts."""
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _flat(value, f"{prefix}{key}.")
    elif isinstance(state, torch.Tensor):
        yield prefix[:-1], state


@pytest.mark.parametrize("kind", ["mse", "l1"])
@pytest.mark.parametrize("with_alpha", [True, False], ids=["alpha", "opaque"])
def test_step_loss_sums_the_weighted_terms(gen, kind, with_alpha):
    from types import SimpleNamespace

    from training.losses import opacity_loss, step_loss

    rgb, target = torch.rand(64, 3, generator=gen), torch.rand(64, 3, generator=gen)
    opacity, alpha = torch.rand(64, generator=gen), torch.rand(64, generator=gen)
    batch = SimpleNamespace(alpha=alpha if with_alpha else None, origins=torch.zeros(64, 3))
    model = SimpleNamespace(initial_extent=(2.0, 2.0, 2.0), poses=SimpleNamespace(enabled=False), ops=None)
    cfg = OmegaConf.create({"loss": kind, "opacity_loss": 0.3, "distortion_loss": 0.0, "near_density_loss": 0.0})
    regularization = torch.tensor(0.125)
    loss, mse = step_loss({"rgb": rgb, "opacity": opacity}, batch, target, regularization, cfg, model, torch.zeros(3))
    torch.testing.assert_close(mse, (rgb - target).square().mean())  # the PSNR's MSE whatever the loss
    want = photometric_loss(rgb, target, kind) + regularization
    if with_alpha:  # the opacity term needs the images' alpha
        want = want + 0.3 * opacity_loss(opacity, alpha)
    torch.testing.assert_close(loss, want)
