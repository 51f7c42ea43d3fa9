"""data.batch_graph: a sampler's batches built by a CUDA graph are the sampler's own, batch for batch (the same
random stream, the same build), for rays (centred, jittered in the pixel, through a lens) and patches; off CUDA
the sampler's own ``sample()`` runs. The draw/build split keeps the sampler's random stream."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data import ensure_synthetic_scene, load_blender
from data.batch_graph import GraphedSampler
from data.camera_models import Lens
from data.samplers import PatchSampler, RaySampler

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


@pytest.fixture(scope="module")
def tiny_scene(tmp_path_factory):
    return ensure_synthetic_scene(tmp_path_factory.mktemp("graph"), resolution=24, n_train=4, n_val=1, n_test=1)


def samplers(tiny_scene, device: str, kind: str, seed: int = 5):
    """Two samplers of one kind on the same seed: (plain, graphed)."""
    scene = load_blender(tiny_scene, "train").to(device)
    if kind == "lens":
        coefficients = torch.tensor([0.05, -0.02, 0.001, -0.002, 0.0, 0.0]).expand(scene.num_views, 6)
        scene = dataclasses.replace(scene, lens=Lens(coefficients.clone().to(device), False))

    def make():
        generator = torch.Generator(device).manual_seed(seed)
        if kind == "patch":
            return PatchSampler(scene, 4, 2, 6, generator)
        return RaySampler(scene, 300, generator, pixel_jitter=kind == "pixel_jitter")

    return make(), GraphedSampler(make())


def fields(batch) -> dict:
    return {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if getattr(batch, f.name) is not None}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["rays", "pixel_jitter", "lens", "patch"])
def test_graphed_batches_are_the_samplers_own(tiny_scene, device, kind):
    plain, graphed = samplers(tiny_scene, device, kind)
    previous = None
    for _ in range(4):
        want, got = fields(plain.sample()), fields(graphed.sample())
        assert want.keys() == got.keys() and {"origins", "directions", "rgb", "jitter"} <= set(got)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        if previous is not None:  # a new batch each call
            assert not torch.equal(got["rgb"], previous)
        previous = got["rgb"].clone()
    assert (graphed.graph is not None) == (device == "cuda")
    assert graphed.batch_size == plain.batch_size if kind != "patch" else graphed.patch_size == plain.patch_size


def test_the_split_keeps_the_random_stream(tiny_scene):
    plain, _ = samplers(tiny_scene, "cpu", "pixel_jitter")
    batch = plain.sample()
    generator = torch.Generator().manual_seed(5)
    scene = plain.scene
    flat = torch.randint(scene.num_views * scene.height * scene.width, (300,), generator=generator)
    jitter = torch.rand(300, generator=generator)
    within = torch.rand(2, 300, generator=generator)
    assert torch.equal(batch.jitter, jitter)
    assert torch.equal(batch.views, torch.div(flat, scene.height * scene.width, rounding_mode="floor"))
    assert torch.equal(fields(batch)["origins"], fields(plain.build(flat, jitter, within))["origins"])


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_each_call_returns_the_same_static_tensors(tiny_scene):
    _, graphed = samplers(tiny_scene, "cuda", "rays")
    first = graphed.sample()
    rgb = first.rgb.clone()
    second = graphed.sample()
    assert second.rgb is first.rgb and not torch.equal(second.rgb, rgb)  # overwritten: the module doc's contract


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("upsample", [1, 2])  # rays, patches
def test_training_on_graphed_batches_is_training_on_the_samplers(tmp_path, upsample):
    from hydra import compose, initialize_config_dir
    from test_train import REPO, tiny_overrides

    from training import app as app_module
    from training.compact_model import read_model

    histories = {}
    for graph in (False, True):
        overrides = tiny_overrides(tmp_path / "cache", 20) + [
            "device=cuda",
            "train.turntable_frames=0",
            f"model.upsample={upsample}",
            "train.batch_rays=256",
            f"train.batch_graph={str(graph).lower()}",
        ]
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        assert app_module.run(cfg, tmp_path / str(graph)) == 0
        histories[graph] = read_model(tmp_path / str(graph) / "model.pt")[1]["history"]
    assert histories[True]["step"] == histories[False]["step"]
    assert histories[True]["loss"] == pytest.approx(histories[False]["loss"], rel=1e-4)
