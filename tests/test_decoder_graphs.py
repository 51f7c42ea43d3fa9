"""models.decoder_graphs: the per-sample decoder replayed from CUDA graphs gives the decoder's values and
gradients, follows its parameters as Adam updates them, and stays out of the way where it does not apply."""

from __future__ import annotations

import json

import pytest
import torch
from test_model import make_model

from models.decoder import padded_rows
from models.decoder_graphs import MAX_GRAPHS, MAX_ROWS, MIN_ROWS, DecoderGraphs, graph_rows

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_graph_rows_are_few_sizes_that_the_decoder_keeps():
    sizes = set()
    for count in range(1, 1 << 15, 7):
        rows = graph_rows(count)
        assert count <= rows <= max(count * 9 / 8, 8), count  # at most 12.5% more (small counts: a few rows)
        assert padded_rows(rows) == rows and graph_rows(rows) == rows
        sizes.add(rows)
    assert len({rows for rows in sizes if rows >= 1 << 10}) <= 8 * 5 + 1  # 8 an octave from 2^10, and 2^15
    assert graph_rows(4096) == 4096 and graph_rows(4097) == 4608


def inputs(count: int, rays: int, device: str, features: int = 12, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(count, features, generator=generator).to(device).requires_grad_()
    directions = torch.nn.functional.normalize(torch.randn(rays, 3, generator=generator), dim=-1).to(device)
    ray = torch.randint(rays, (count,), generator=generator).sort().values.to(device)
    return values, directions, ray


def test_off_the_gpu_it_is_the_decoder():
    model = make_model(shading="per_sample", upsample=1, decoder_graphs=True).train()
    assert isinstance(model.decoder_graphs, DecoderGraphs)
    features, directions, ray = inputs(MIN_ROWS + 5, 64, "cpu")
    assert not model.decoder_graphs.applies(features, directions, None)
    assert torch.equal(model.decode_samples(features, directions, ray), model.decoder(features, directions, ray))
    assert model.decoder_graphs.report() == {"captures": 0, "replays": 0}  # metrics.json's decoder_graphs
    assert make_model(shading="per_sample", upsample=1).decoder_graphs is None  # off by default
    assert make_model(shading="deferred", decoder_graphs=True).decoder_graphs is None  # per-sample shading only


def cuda_model(**overrides):
    model = make_model(shading="per_sample", upsample=1, decoder_graphs=True, decoder_hidden=64, **overrides)
    model = model.cuda().train()
    with torch.no_grad():  # a residual that is not zero, so that every layer shapes the output and its gradient
        for parameter in model.decoder.parameters():
            parameter.normal_(0.0, 0.2)
    return model


def decoder_and_gradients(model, features, directions, ray, graphed: bool):
    model.zero_grad(set_to_none=True)
    features = features.detach().requires_grad_()
    shade = model.decode_samples if graphed else model.decoder
    out = shade(features, directions, ray)
    (out * torch.linspace(-1, 1, out.numel(), device=out.device).reshape(out.shape)).sum().backward()
    grads = [p.grad.clone() for p in model.decoder.parameters()]
    return out.detach(), features.grad, grads


@cuda
@pytest.mark.requires_cuda
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_graphs_give_the_decoders_values_and_gradients(precision):
    model = cuda_model(decoder_precision=precision)
    graphs = model.decoder_graphs
    for step, count in enumerate((MIN_ROWS + 100, MIN_ROWS + 300, 3 * MIN_ROWS)):
        features, directions, ray = inputs(count, 512, "cuda", seed=step)
        out, grad, params = decoder_and_gradients(model, features, directions, ray, graphed=True)
        assert out.shape == (count, 3) and grad.shape == features.shape
        want_out, want_grad, want_params = decoder_and_gradients(model, features, directions, ray, graphed=False)
        tolerance = {"atol": 2e-3, "rtol": 2e-2} if precision == "bfloat16" else {"atol": 1e-5, "rtol": 1e-4}
        torch.testing.assert_close(out, want_out, **tolerance)
        torch.testing.assert_close(grad, want_grad, **tolerance)
        # parameter gradients are sums over thousands of rows, tiled differently for the padded count (and in
        # TF32 where an earlier test left it on): the graphs must be as close to a float64 decoder as eager is
        exact = make_model(shading="per_sample", upsample=1, decoder_hidden=64).cuda().double().train()
        exact.decoder.load_state_dict(model.decoder.state_dict())  # the same weights, no autocast, float64
        exact_params = decoder_and_gradients(exact, features.double(), directions.double(), ray, graphed=False)[2]
        for got, want, truth in zip(params, want_params, exact_params):
            assert want.abs().sum() > 0
            scale = truth.norm().item()
            assert (got - truth).norm() <= 3 * (want - truth).norm() + 1e-3 * scale
    assert graphs.captures == 2  # the first two counts share a padded size


@cuda
@pytest.mark.requires_cuda
def test_the_graphs_read_the_parameters_as_they_are_now():
    model = cuda_model()
    features, directions, ray = inputs(MIN_ROWS + 1, 256, "cuda")
    decoder_and_gradients(model, features, directions, ray, graphed=True)  # captured on these weights
    with torch.no_grad():  # what Adam does between steps: in place
        for parameter in model.decoder.parameters():
            parameter.mul_(-1.5).add_(0.01)
    got = decoder_and_gradients(model, features, directions, ray, graphed=True)
    want = decoder_and_gradients(model, features, directions, ray, graphed=False)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4)
    assert model.decoder_graphs.captures == 1


@cuda
@pytest.mark.requires_cuda
def test_at_most_max_graphs_are_kept_and_small_or_eval_calls_run_the_decoder():
    model = cuda_model()
    graphs = model.decoder_graphs
    for size in range(MAX_GRAPHS + 2):
        features, directions, ray = inputs(MIN_ROWS * (2 + size), 128, "cuda", seed=size)
        decoder_and_gradients(model, features, directions, ray, graphed=True)
    assert graphs.captures == MAX_GRAPHS + 2 and len(graphs.graphs) == MAX_GRAPHS
    features, directions, ray = inputs(MIN_ROWS - 1, 128, "cuda")
    assert not graphs.applies(features, directions, None)
    model.eval()
    assert not graphs.applies(*inputs(2 * MIN_ROWS, 128, "cuda")[:2], None)
    with torch.no_grad():
        model.train()
        assert not graphs.applies(*inputs(2 * MIN_ROWS, 128, "cuda")[:2], None)


@cuda
@pytest.mark.requires_cuda
def test_sizes_share_one_pool_and_replay_in_any_order():
    model = cuda_model()
    graphs = model.decoder_graphs
    sizes = (1 << 20, 7 << 17, 6 << 17)  # the largest first: the others' activations fit in what it freed
    cases = [inputs(count, 4096, "cuda", seed=count) for count in sizes]
    torch.cuda.synchronize()
    start = torch.cuda.memory_reserved()
    decoder_and_gradients(model, *cases[0], graphed=True)
    first = torch.cuda.memory_reserved() - start
    for case in cases[1:]:
        decoder_and_gradients(model, *case, graphed=True)
    assert graphs.captures == 3
    # each size apart would hold its own activations: ~2.5x the first's memory
    assert torch.cuda.memory_reserved() - start < 1.5 * first
    for index in (2, 0, 1, 0):  # not the order of capture: each replay is whole before the next
        got = decoder_and_gradients(model, *cases[index], graphed=True)
        want = decoder_and_gradients(model, *cases[index], graphed=False)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-4)
    assert graphs.captures == 3
    features, directions, _ = inputs(8, 16, "cuda")
    assert not graphs.applies(features.new_empty(MAX_ROWS + 1, features.shape[1]), directions, None)  # too many rows
    assert graphs.applies(features.new_empty(MAX_ROWS, features.shape[1]), directions, None)


@cuda
@pytest.mark.requires_cuda
def test_training_with_the_graphs_learns_what_training_without_them_does(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir
    from test_train import REPO

    from training import app as app_module
    from training.compact_model import read_model

    made = []
    built = DecoderGraphs.__init__

    def recorded(self, decoder):
        built(self, decoder)
        made.append(self)

    monkeypatch.setattr(DecoderGraphs, "__init__", recorded)
    results = {}
    for graphs in (False, True):
        overrides = [
            "device=cuda",
            "train.iters=300",
            "train.batch_rays=8192",
            "train.eval_every=0",
            "train.turntable_frames=0",
            "model.shading=per_sample",
            "model.upsample=1",
            "model.decoder_precision=bfloat16",
            f"model.decoder_graphs={str(graphs).lower()}",
            f"data.cache_dir={tmp_path / 'cache'}",
        ]
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
            cfg = compose(config_name="config", overrides=overrides)
        run = tmp_path / f"graphs_{graphs}"
        assert app_module.run(cfg, run) == 0
        results[graphs] = read_model(run / "model.pt")[1]["history"]
    graphs = max(made, key=lambda made_graphs: made_graphs.replays)  # the trained model's (the run with them)
    assert graphs.replays >= 250 and 1 <= graphs.captures <= 40
    assert json.loads((tmp_path / "graphs_True" / "metrics.json").read_text())["decoder_graphs"] == graphs.report()
    off, on = results[False], results[True]
    assert off["step"] == on["step"]
    # the same run up to float rounding (bf16 GEMMs over differently padded rows): the loss curves agree
    assert on["loss"][-1] == pytest.approx(off["loss"][-1], rel=0.05)
    assert on["psnr"][-1] == pytest.approx(off["psnr"][-1], abs=0.3)


@cuda
@pytest.mark.requires_cuda
def test_a_profiled_run_times_the_graphed_decoder(tmp_path):
    """``train.profile=true`` synchronises around its regions: none may open while a graph is captured (that was a
    CUDA error), and the replays, which run no forward hooks, are timed as the decoder."""
    import json

    from hydra import compose, initialize_config_dir
    from test_train import REPO

    from training import app as app_module

    overrides = [
        "device=cuda",
        "train.iters=40",
        "train.batch_rays=8192",
        "train.eval_every=0",
        "train.turntable_frames=0",
        "train.profile=true",
        "model.shading=per_sample",
        "model.upsample=1",
        "model.decoder_graphs=true",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    assert app_module.run(cfg, tmp_path / "run") == 0
    report = json.loads((tmp_path / "run" / "profile.json").read_text())
    assert report["per_step_ms"]["decoder"] > 0 and report["work_per_step"]["decoder"]["flops"] > 0
