"""``train.pixel_jitter``: training rays through a uniformly random point of their pixel (data/samplers.py).

Every jittered ray must still pass through its own pixel (pinhole and through a lens), the points must spread over
the pixel rather than sit at its centre, the pixels drawn and the rest of the batch must be those of the centred
sampler with the same seed, and the key must be refused where batches are patches. Through a lens:
tests/test_distortion.py."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from data import ensure_synthetic_scene, load_blender, project_to_pixels
from data.samplers import RaySampler
from training.config import ConfigError, validate_config

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


@pytest.fixture(scope="module")
def tiny_scene(tmp_path_factory):
    return ensure_synthetic_scene(tmp_path_factory.mktemp("jitter"), resolution=24, n_train=4, n_val=1, n_test=1)


def where_in_pixel(scene, batch, lens=None) -> torch.Tensor:
    """(B, 2) position of each ray inside its pixel, (u - column, v - row): in [0, 1)^2 when it lands there."""
    c2w = scene.c2w.to(batch.views.device)[batch.views].double()
    k = scene.intrinsics.to(batch.views.device)[batch.views]
    uv = project_to_pixels(c2w, batch.directions.double(), k, lens=lens)
    return uv - batch.pixels.flip(-1).double()


def assert_spread_over_the_pixel(offsets: torch.Tensor, tolerance: float) -> None:
    assert float(offsets.min()) > -tolerance and float(offsets.max()) < 1 + tolerance  # inside its own pixel
    # uniform on [0, 1): mean 1/2, standard deviation 1/sqrt(12) = 0.289; centred rays would give 0
    assert torch.allclose(offsets.mean(0), torch.full_like(offsets[0], 0.5), atol=0.05)
    assert torch.allclose(offsets.std(0), torch.full_like(offsets[0], 12**-0.5), atol=0.03)
    assert abs(float(torch.corrcoef(offsets.T)[0, 1])) < 0.1  # u and v drawn independently: the whole square


@pytest.mark.parametrize("device", DEVICES)
def test_jittered_rays_spread_over_their_own_pixels(tiny_scene, device):
    scene = load_blender(tiny_scene, "train").to(device)
    centred = RaySampler(scene, 2048, torch.Generator(device).manual_seed(4)).sample()
    jittered = RaySampler(scene, 2048, torch.Generator(device).manual_seed(4), pixel_jitter=True).sample()
    # the same pixels, colours, origins and sample offsets as the centred sampler draws: only the directions move
    for name in ("views", "pixels", "rgb", "alpha", "origins", "jitter"):
        assert torch.equal(getattr(jittered, name), getattr(centred, name)), name
    assert not torch.allclose(jittered.directions, centred.directions)
    assert torch.allclose(jittered.directions.norm(dim=-1), torch.ones(2048, device=device), atol=1e-6)
    assert_spread_over_the_pixel(where_in_pixel(scene, jittered), 1e-4)
    assert float((where_in_pixel(scene, centred) - 0.5).abs().max()) < 1e-4  # the check would see centred rays


@pytest.mark.parametrize("bad", [1, "yes", None])
def test_pixel_jitter_must_be_a_bool(tiny_scene, bad):
    with pytest.raises(ValueError, match="pixel_jitter must be a bool"):
        RaySampler(load_blender(tiny_scene, "train"), 16, pixel_jitter=bad)


@pytest.mark.parametrize(
    "overrides",
    [["model.upsample=2"], ["model.upsample=1", "train.dssim=0.2", "train.patch_size=12"]],
    ids=["upsample", "dssim"],
)
def test_pixel_jitter_is_refused_with_patch_batches(overrides):
    validate_config(OmegaConf.from_dotlist(["train.pixel_jitter=true", "model.upsample=1"]))
    with pytest.raises(ConfigError, match="train.pixel_jitter: jitters single rays"):
        validate_config(OmegaConf.from_dotlist(["train.pixel_jitter=true", *overrides]))
    with pytest.raises(ConfigError, match="train.pixel_jitter: must be true or false"):
        validate_config(OmegaConf.from_dotlist(["train.pixel_jitter=maybe"]))
