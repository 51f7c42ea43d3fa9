"""Per-image appearance (models/appearance.py): the table, the held-out rule (the mean code), the affine transform
through both shadings (equal to transforming the composited pixel), the embedding as a decoder input, and the
table through state dicts and export (a model built without a size takes the checkpoint's)."""

from __future__ import annotations

import pytest
import torch
from test_model import BBOX, FAR, NEAR, TORCH_OPS, make_cfg, make_model

from data import PatchBatch
from models import VoxelNeRF, build_ops
from models.appearance import Appearance
from models.config import parse_model_config
from training.finished_run import build_model


def test_none_is_a_no_op(gen):
    app = Appearance("none", 16, 5)
    colour = torch.rand(7, 3, generator=gen)
    assert app.transform(colour, torch.zeros(7, dtype=torch.int64)) is colour
    assert app.codes(None, 7) is None and app.embedding_dim == 0 and list(app.parameters()) == []


def test_embedding_rows_and_mean_rule(gen):
    app = Appearance("embedding", 4, 6)
    assert app.embedding_dim == 4 and app.num_images == 6 and app.table.abs().sum() == 0  # starts at zero
    with torch.no_grad():
        app.table.normal_(generator=gen)
    index = torch.tensor([5, 0, 0, 3])
    torch.testing.assert_close(app.codes(index, 4), app.table[index])
    torch.testing.assert_close(app.codes(None, 3), app.table.mean(0).expand(3, 4))  # held out: the mean
    colour = torch.rand(4, 3, generator=gen)
    assert app.transform(colour, index) is colour  # an embedding changes nothing after the MLP


def test_affine_transform_matches_matrix_product(gen):
    app = Appearance("affine", num_images=3)
    colour = torch.rand(5, 3, generator=gen)
    index = torch.tensor([2, 0, 1, 2, 0])
    torch.testing.assert_close(app.transform(colour, index), colour)  # identity at start
    with torch.no_grad():
        app.table.add_(0.3 * torch.randn(app.table.shape, generator=gen))
    m = app.table.reshape(3, 3, 4)
    coverage = torch.rand(5, generator=gen)
    want = torch.stack([m[i, :, :3] @ c + a * m[i, :, 3] for i, c, a in zip(index.tolist(), colour, coverage)])
    torch.testing.assert_close(app.transform(colour, index, coverage), want)
    mean = m.mean(0)
    torch.testing.assert_close(app.transform(colour, None), colour @ mean[:, :3].T + mean[:, 3])


def test_bad_input():
    with pytest.raises(ValueError, match="model.appearance"):
        Appearance("exposure")
    with pytest.raises(ValueError, match="model.appearance"):
        parse_model_config({"appearance": "exposure"})
    with pytest.raises(ValueError, match="model.appearance_dim"):
        parse_model_config({"appearance": "embedding", "appearance_dim": 0})
    app = Appearance("affine", num_images=2)
    with pytest.raises(ValueError, match="image_index"):
        app.transform(torch.rand(3, 3), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="image_index"):
        app.transform(torch.rand(3, 3), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(IndexError):
        app.transform(torch.rand(3, 3), torch.tensor([0, 1, 2]))


def visible_model(appearance: str, num_images: int = 4, **overrides) -> VoxelNeRF:
    model = make_model(seed=2, resolution_start=20, appearance=appearance, appearance_dim=5, **overrides)
    model.decoder.appearance.resize(num_images)
    with torch.no_grad():
        model.density.grid.normal_(0.0, 2.0).add_(3.0)
        model.decoder.out.weight.normal_(0.0, 0.3)  # a live residual, so MLP inputs matter
    return model.eval()


def rays(count: int = 48):
    torch.manual_seed(4)
    origins = torch.tensor([0.3, -0.2, 4.0]) + 0.2 * torch.randn(count, 3)
    directions = torch.nn.functional.normalize(-origins + 0.4 * torch.randn(count, 3), dim=-1)
    return origins, directions


def random_affine(model: VoxelNeRF) -> torch.Tensor:
    with torch.no_grad():
        model.decoder.appearance.table.add_(0.2 * torch.randn(model.decoder.appearance.table.shape))
    return model.decoder.appearance.table.detach().reshape(-1, 3, 4).clone()


@pytest.mark.parametrize("shading", ["per_sample", "deferred"])
def test_affine_equals_transforming_the_pixel(shading):
    # per sample (before compositing) or per pixel (premultiplied), the transform is A fg + opacity b: the
    # background stays untouched wherever the ray is empty
    model = visible_model("affine", shading=shading, upsample=1)
    origins, directions = rays()
    plain = model.render_rays(origins, directions)
    views = torch.randint(0, 4, (origins.shape[0],))
    m = random_affine(model)[views]
    got = model.render_rays(origins, directions, views=views)
    opacity = plain["opacity"][:, None]
    background = model.background
    foreground = plain["rgb"] - (1 - opacity) * background
    want = (m[:, :, :3] @ foreground[:, :, None])[..., 0] + opacity * m[:, :, 3] + (1 - opacity) * background
    assert 0.05 < float(opacity.detach().min()) and float(opacity.detach().max()) > 0.5
    torch.testing.assert_close(got["rgb"], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got["opacity"], plain["opacity"])


@pytest.mark.parametrize("shading", ["per_sample", "deferred"])
def test_embedding_conditions_colour_and_held_out_uses_the_mean(shading):
    model = visible_model("embedding", shading=shading, upsample=1)
    with torch.no_grad():
        model.decoder.appearance.table.normal_(0.0, 1.0)
    origins, directions = rays()
    count = origins.shape[0]
    first = model.render_rays(origins, directions, views=torch.zeros(count, dtype=torch.int64))["rgb"]
    second = model.render_rays(origins, directions, views=torch.full((count,), 3))["rgb"]
    assert (first - second).abs().max() > 1e-3  # the code changes the colour
    held_out = model.render_rays(origins, directions)["rgb"]
    with torch.no_grad():
        model.decoder.appearance.table.copy_(model.decoder.appearance.table.mean(0).expand(4, 5))
    torch.testing.assert_close(
        held_out, model.render_rays(origins, directions, views=second.new_zeros(count).long())["rgb"]
    )


def test_embedding_gradient_reaches_only_the_batch_images():
    model = visible_model("embedding", shading="per_sample", upsample=1).train()
    origins, directions = rays()
    views = torch.tensor([1, 3]).repeat(origins.shape[0] // 2)
    model.render_rays(origins, directions, jitter=torch.rand(origins.shape[0]), views=views)["rgb"].sum().backward()
    grad = model.decoder.appearance.table.grad
    assert grad[[1, 3]].abs().sum(1).min() > 0 and grad[[0, 2]].abs().max() == 0


def test_patches_pass_each_pixel_its_image():
    model = visible_model("affine", shading="deferred", upsample=2)
    m = random_affine(model)
    torch.manual_seed(5)
    n, p = 3, 4
    origins = (torch.tensor([0.0, 0.0, 4.0]) + 0.1 * torch.randn(n, 1, 1, 3)).expand(n, p, p, 3)
    directions = torch.nn.functional.normalize(-origins + 0.3 * torch.randn(n, p, p, 3), dim=-1)
    hr = torch.nn.functional.normalize(directions.repeat_interleave(2, 1).repeat_interleave(2, 2), dim=-1)
    views = torch.tensor([2, 0, 3])
    batch = PatchBatch(origins, directions, hr, torch.zeros(n, 2 * p, 2 * p, 3), views=views)
    got = model.render_patches(batch)["rgb"].reshape(-1, 3)
    plain = model.render_patches(PatchBatch(origins, directions, hr, batch.rgb))  # no views: the mean transform
    mean = m.mean(0)
    pixel_views = views.repeat_interleave(4 * p * p)
    # undo the mean transform, apply each patch's own
    with torch.no_grad():
        model.decoder.appearance.table.copy_(torch.eye(3, 4).reshape(1, 12).expand(4, 12))
    identity = model.render_patches(PatchBatch(origins, directions, hr, batch.rgb))
    opacity = torch.nn.functional.interpolate(
        identity["opacity"][:, None], scale_factor=2, mode="bilinear", align_corners=False
    ).reshape(-1, 1)
    fg = identity["rgb"].reshape(-1, 3) - (1 - opacity) * model.background
    mm = m[pixel_views]
    want = (mm[:, :, :3] @ fg[:, :, None])[..., 0] + opacity * mm[:, :, 3] + (1 - opacity) * model.background
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    want_mean = fg @ mean[:, :3].T + opacity * mean[:, 3] + (1 - opacity) * model.background
    torch.testing.assert_close(plain["rgb"].reshape(-1, 3), want_mean, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("appearance", ["embedding", "affine"])
def test_table_survives_state_dict_and_export(appearance):
    model = visible_model(appearance, num_images=7, shading="per_sample", upsample=1)
    random_affine(model) if appearance == "affine" else torch.nn.init.normal_(model.decoder.appearance.table)
    state = model.state_dict()
    assert state["decoder.appearance.table"].shape[0] == 7
    cfg = make_cfg(appearance=appearance, appearance_dim=5, resolution_start=20, shading="per_sample", upsample=1)
    fresh = VoxelNeRF(BBOX, NEAR, FAR, cfg, build_ops(TORCH_OPS))  # built without a size: takes the checkpoint's
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh.decoder.appearance.table, model.decoder.appearance.table)
    exported = build_model(cfg, {"near": NEAR, "far": FAR, "bbox": BBOX.tolist()}, state)
    origins, directions = rays(16)
    torch.testing.assert_close(
        exported.render_rays(origins, directions)["rgb"], model.render_rays(origins, directions)["rgb"]
    )
    assert "decoder.appearance.table" in dict(fresh.named_parameters())  # trained with the decoder's rate
