"""The inference path (models.render_views.infer_image, what training.inference renders with) against training's own
march (model.render_image): the same pictures to float rounding, in both shadings, with and without early
termination and the weight threshold, bounded and contracted, with the custom ops; a whole view in one chunk or
many. Random densities and decoder weights (never zeros) so rays are partly opaque and samples are skipped."""

from __future__ import annotations

import pytest
import torch
from test_model import look_at_c2w, make_model, randomize_density

from models import build_ops
from models.field import optical_depth
from models.render_views import infer_image, infer_march
from training.inference import render_view

CUSTOM = {"grid_interpolate": "custom", "upsample_bilinear2d": "custom", "gelu": "custom"}
CUSTOM |= {"volume_render": "custom", "march_rays": "custom", "sparse_adam_step": "custom", "sampled_tv": "custom"}
CUSTOM |= {"brick_grid_interpolate": "custom"}


def random_model(**overrides):
    model = make_model(**overrides)
    randomize_density(model, mean=2.0, std=6.0)  # some rays opaque, some clear
    with torch.no_grad():
        model.features.grid.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
        model.decoder.out.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(4))
        alpha = -torch.expm1(-optical_depth(model.density.grid[..., 0], model.config.density_shift, 1.0))
        model.occupancy.update(alpha, float(alpha.quantile(0.9)), 0)  # ~40% of the cells skipped
    return model.eval()


CASES = [
    {"shading": "per_sample", "upsample": 1, "weight_threshold": 1e-3, "early_termination": 1e-4},
    {"shading": "per_sample", "upsample": 1, "weight_threshold": 0.0, "early_termination": 0.0},
    {"upsample": 2, "weight_threshold": 1e-3, "early_termination": 1e-3},
    {"upsample": 1, "weight_threshold": 0.0, "early_termination": 1e-2},
    {"shading": "per_sample", "upsample": 1, "contraction": "inf", "shrink_at": None},
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("ops", ["torch", "custom"])
def test_inference_renders_what_training_renders(overrides, ops):
    model = random_model(**overrides)
    if ops == "custom":
        model.ops = model.decoder.ops = build_ops(CUSTOM)
    assert 0.2 < model.occupancy.occupied_fraction() < 0.95  # cells are skipped and kept
    c2w = look_at_c2w((3.0, 2.0, 2.5))
    intrinsics = torch.tensor([22.0, 21.0, 11.5, 8.0])
    expected = model.render_image(c2w, 16, 24, intrinsics, chunk=37)
    assert 0.05 < expected["opacity"].mean() < 0.95 and expected["opacity"].max() > 0.999
    for chunk in (53, 16 * 24):
        got = infer_image(model, c2w, 16, 24, intrinsics, chunk)
        for key in ("rgb", "depth", "opacity"):
            torch.testing.assert_close(got[key], expected[key], rtol=0, atol=2e-6, msg=key)
    torch.testing.assert_close(render_view(model, c2w, 16, 24, intrinsics)["rgb"], expected["rgb"], rtol=0, atol=2e-6)


def test_inference_decodes_in_slices_without_changing_the_picture(monkeypatch):
    """Kept samples are decoded DECODE_SLICE at a time (bounded memory on unbounded scenes): same pixels."""
    import models.render_views as render_views

    model = random_model(shading="per_sample", upsample=1, weight_threshold=0.0, early_termination=0.0)
    c2w, intrinsics = look_at_c2w((3.0, 2.0, 2.5)), torch.tensor([22.0, 21.0, 11.5, 8.0])
    whole = infer_image(model, c2w, 16, 24, intrinsics, 16 * 24)
    monkeypatch.setattr(render_views, "DECODE_SLICE", 97)  # many slices, the last one partial
    sliced = infer_image(model, c2w, 16, 24, intrinsics, 16 * 24)
    for key in ("rgb", "depth", "opacity"):
        torch.testing.assert_close(sliced[key], whole[key], rtol=0, atol=1e-6, msg=key)


def test_inference_march_matches_march_channels_in_float64():
    """Per ray, in float64: the composited channels of infer_march equal march's (deferred shading: the features)."""
    model = random_model(upsample=1, weight_threshold=1e-3, early_termination=1e-3).double()
    generator = torch.Generator().manual_seed(5)
    origins = torch.nn.functional.normalize(torch.randn(300, 3, generator=generator, dtype=torch.float64), dim=-1) * 4
    directions = torch.nn.functional.normalize(0.8 * torch.rand(300, 3, generator=generator) - 0.4 - origins, dim=-1)
    with torch.no_grad():
        expected = model.march(origins, directions, jitter=False)
    got = infer_march(model, origins, directions)
    assert expected["samples"] > 300
    for key in ("diffuse", "features", "depth", "opacity"):
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=1e-10, msg=key)
