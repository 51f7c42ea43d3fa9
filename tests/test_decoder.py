"""The shading MLPs (models/decoder.py): the first layer split by input columns, the per-ray terms (direction
encoding, image code) computed once per ray and gathered per sample, is the layer on the concatenated per-sample
inputs; the gather's float32 backward; gradients of every input."""

from __future__ import annotations

import pytest
import torch
from test_model import TORCH_OPS, make_model

from models import build_ops
from models.decoder import Decoder, SampleDecoder, gather_rows, linear_aligned, padded_rows

GELU = "tanh"


def _decoder(kind, inputs, layers, encoding, appearance, gen):
    ops = build_ops(TORCH_OPS)
    decoder = kind(inputs, 16, layers, encoding, GELU, ops, "float32", appearance, 5).double()
    decoder.appearance.resize(4)
    with torch.no_grad():
        for parameter in decoder.parameters():  # random everywhere, the zero-initialised last layer included
            parameter.copy_(torch.randn(parameter.shape, generator=gen, dtype=torch.float64) * 0.5)
    return decoder


def _concatenated(decoder, rows: torch.Tensor, directions: torch.Tensor, image_index) -> torch.Tensor:
    """The residual as one MLP on each row's concatenated inputs (what the split first layer must equal)."""
    parts = [rows, decoder.encoding(directions)]
    codes = decoder.appearance.codes(image_index, rows.shape[0])
    x = torch.cat(parts if codes is None else parts + [codes], dim=-1)
    for layer in decoder.hidden:
        x = torch.nn.functional.gelu(layer(x), approximate=GELU)
    return decoder.out(x)


@pytest.mark.parametrize("encoding", ["pe3", "sh2", "none"])
@pytest.mark.parametrize("layers", [0, 2])
@pytest.mark.parametrize("appearance", ["none", "embedding"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)])
def test_per_sample_decoder_equals_the_mlp_on_concatenated_inputs(gen, encoding, layers, appearance, device):
    """On CUDA the GEMMs' rows are padded to 16 bytes (linear_aligned): the same function."""
    decoder = _decoder(SampleDecoder, 13, layers, encoding, appearance, gen).to(device)
    rays, samples = 7, 40
    features = torch.randn(samples, 13, generator=gen, dtype=torch.float64).to(device)
    directions = torch.nn.functional.normalize(torch.randn(rays, 3, generator=gen, dtype=torch.float64), dim=-1)
    directions = directions.to(device)
    ray = torch.randint(0, rays, (samples,), generator=gen).to(device)
    views = torch.randint(0, 4, (rays,), generator=gen).to(device) if appearance == "embedding" else None
    out = decoder(features, directions, ray, views)
    per_sample_views = None if views is None else views[ray]
    want = torch.sigmoid(features[:, :3] + _concatenated(decoder, features, directions[ray], per_sample_views))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    # without ``ray`` every row is its own ray
    rows = torch.sigmoid(features[:rays, :3] + _concatenated(decoder, features[:rays], directions, views))
    torch.testing.assert_close(decoder(features[:rays], directions, None, views), rows, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("encoding", ["sh2", "pe3"])
def test_per_pixel_decoder_equals_the_mlp_on_concatenated_inputs(gen, encoding):
    decoder = _decoder(Decoder, 3 + 9, 2, encoding, "embedding", gen)
    n = 11
    diffuse = torch.rand(n, 3, generator=gen, dtype=torch.float64)
    features = torch.randn(n, 9, generator=gen, dtype=torch.float64)
    opacity = torch.rand(n, generator=gen, dtype=torch.float64)
    directions = torch.nn.functional.normalize(torch.randn(n, 3, generator=gen, dtype=torch.float64), dim=-1)
    views = torch.randint(0, 4, (n,), generator=gen)
    residual = _concatenated(decoder, torch.cat([diffuse, features], dim=1), directions, views)
    want = diffuse + opacity[:, None] * residual
    torch.testing.assert_close(decoder(diffuse, features, opacity, directions, views), want, rtol=1e-12, atol=1e-12)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("k, m", [(21, 256), (256, 3), (12, 5), (16, 8)])
def test_linear_aligned_is_linear_on_cuda(gen, k, m):
    """Zero-padded K and M (to multiples of 8) change no value and no gradient; the output has M columns."""
    inputs = [torch.randn(*shape, generator=gen, dtype=torch.float64).cuda() for shape in ((37, k), (m, k), (m,))]
    got_grads, want_grads = [], []
    for fn, grads in ((linear_aligned, got_grads), (torch.nn.functional.linear, want_grads)):
        leaves = [x.clone().requires_grad_() for x in inputs]
        out = fn(*leaves)
        out.backward(torch.linspace(-1, 1, out.numel(), dtype=torch.float64, device="cuda").reshape(out.shape))
        grads += [out.detach(), *(leaf.grad for leaf in leaves)]
    assert got_grads[0].shape == (37, m)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gather_rows_is_indexing_with_a_float32_sum_backward(gen):
    values = torch.randn(5, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([4, 0, 0, 2, 4, 4, 1])
    torch.testing.assert_close(gather_rows(values, index), values[index])
    assert torch.autograd.gradcheck(lambda v: gather_rows(v, index), (values,))
    # bfloat16 values: the rows' gradient sums in float32 and is rounded once
    grad = torch.full((3000, 2), 1.0 / 3.0).bfloat16()
    half = torch.zeros(2, 2, dtype=torch.bfloat16, requires_grad=True)
    gather_rows(half, torch.zeros(3000, dtype=torch.int64)).backward(grad)
    exact = grad.float().sum(0)
    assert half.grad.dtype == torch.bfloat16 and torch.equal(half.grad[0], exact.bfloat16())
    assert half.grad[1].abs().sum() == 0  # a row no sample read


def test_padded_rows_takes_few_sizes_and_little_more():
    sizes = [padded_rows(n) for n in range(1, 300_000)]
    assert all(n <= m <= n * 1.016 for n, m in zip(range(1, 300_000), sizes)) and sizes[:64] == list(range(1, 65))
    assert len(set(sizes[100_000:200_000])) <= 100  # one octave and a half: ~100 shapes for cuBLAS, not 100000


def test_per_sample_decoder_pads_its_rows_and_drops_the_pad(gen):
    """1001 samples run as 1008 rows (padded_rows); the output and every gradient are the unpadded MLP's."""
    decoder = _decoder(SampleDecoder, 13, 2, "pe3", "none", gen)
    rays, samples = 37, 1001
    assert padded_rows(samples) == 1008
    features = torch.randn(samples, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    directions = torch.nn.functional.normalize(torch.randn(rays, 3, generator=gen, dtype=torch.float64), dim=-1)
    ray = torch.randint(0, rays, (samples,), generator=gen).sort().values
    upstream = torch.randn(samples, 3, generator=gen, dtype=torch.float64)
    grads = []
    for run in (lambda: decoder(features, directions, ray), lambda: torch.sigmoid(
            features[:, :3] + _concatenated(decoder, features, directions[ray], None))):  # fmt: skip
        out = run()
        assert out.shape == (samples, 3)
        grads.append((out, *torch.autograd.grad(out, [features, *decoder.parameters()], upstream)))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


def test_per_sample_decoder_gradients(gen):
    decoder = _decoder(SampleDecoder, 13, 2, "pe3", "embedding", gen)
    rays, samples = 4, 9
    features = torch.randn(samples, 13, generator=gen, dtype=torch.float64, requires_grad=True)
    directions = torch.nn.functional.normalize(torch.randn(rays, 3, generator=gen, dtype=torch.float64), dim=-1)
    directions.requires_grad_()  # refined camera poses move the directions (models/pose_refinement.py)
    ray = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3, 3])
    views = torch.tensor([3, 1, 0, 2])
    assert torch.autograd.gradcheck(lambda f, d: decoder(f, d, ray, views), (features, directions))
    out = decoder(features, directions, ray, views)
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in decoder.parameters())


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


@pytest.mark.requires_cuda
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
