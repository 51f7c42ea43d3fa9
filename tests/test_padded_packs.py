"""Packed samples with padding rows past the last ray offset, as cuda_ext.march_rays_capped leaves them: volume_render,
distortion_loss and visible_samples give what they give on the pack without its padding, and the padding rows get
exactly zero gradient (the CUDA backwards write only the rows a ray covers, then zero the rest from the offset on
the device). CPU, CUDA and the references; gradcheck in float64 through the padding."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]
COUNTS = [5, 0, 1, 40, 3, 0, 77, 12]  # empty, single-sample and long (several warps' chunks) rays
PADDING = 45


def past_the_end(offsets: torch.Tensor) -> torch.Tensor:
    """(B + 1,) offsets whose last one is past N: not a padded pack, an error."""
    return torch.cat([offsets[:-1], offsets[-1:] + 1])


def padded_pack(device: str, dtype=torch.float64, seed: int = 0):
    """(sd, values, t_start, t_end, offsets) of the samples of COUNTS, each with PADDING random rows after them,
    and N (the samples' count)."""
    generator = torch.Generator().manual_seed(seed)
    n = sum(COUNTS)
    rows = n + PADDING
    rand = lambda *shape: torch.rand(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    sd = rand(rows) * 0.6 + 1e-3
    values = rand(rows, 4) * 2 - 0.5
    lengths = rand(rows) * 0.05 + 1e-3
    t_end = torch.cumsum(lengths + rand(rows) * 0.2, 0) + 2.0  # increasing along every ray (and past them)
    offsets = torch.tensor([0, *torch.tensor(COUNTS).cumsum(0).tolist()], dtype=torch.int64)
    tensors = [x.to(dtype) for x in (sd, values, t_end - lengths, t_end)]
    return [x.to(device) for x in (*tensors, offsets)], n


def assert_same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """Bit for bit for the ops; to float64 rounding for the references, whose ATen scans and scatters on CUDA tile a
    longer tensor differently (so round differently) when padding rows are appended."""
    if exact:
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def _grads(fn, inputs, weights):
    inputs = [x.detach().clone().requires_grad_() for x in inputs]
    outputs = fn(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    sum(((o * w).sum() for o, w in zip(outputs, weights)), torch.zeros((), dtype=inputs[0].dtype)).backward()
    return [o.detach() for o in outputs], [x.grad for x in inputs]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [cuda_ext.volume_render, reference.volume_render], ids=["op", "reference"])
@pytest.mark.parametrize("early_stop", [0.0, 0.2])
def test_volume_render_ignores_the_padding(device, fn, early_stop):
    (sd, values, _, t, offsets), n = padded_pack(device)
    rays = len(COUNTS)
    generator = torch.Generator().manual_seed(1)
    weights = [
        torch.randn(shape, generator=generator, dtype=torch.float64).to(device) for shape in ((rays, 4), rays, rays)
    ]

    def render(sd, values, t):
        return fn(sd, values, t, offsets, early_stop)

    got, grads = _grads(render, (sd, values, t), weights)
    want, want_grads = _grads(render, (sd[:n], values[:n], t[:n]), weights)
    exact = fn is cuda_ext.volume_render
    for g, w in zip(got, want):
        assert_same(g, w, exact)
    for grad, want_grad in zip(grads[:2], want_grads[:2]):  # t has no gradient path (depth's weights do)
        assert_same(grad[:n], want_grad, exact)
        assert bool((grad[n:] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [cuda_ext.distortion_loss, reference.distortion_loss], ids=["op", "reference"])
def test_distortion_loss_ignores_the_padding(device, fn):
    (sd, _, t_start, t_end, offsets), n = padded_pack(device, seed=2)
    weight = torch.randn(len(COUNTS), generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(device)
    got, grads = _grads(lambda s: fn(s, t_start, t_end, offsets), (sd,), [weight])
    want, want_grads = _grads(lambda s: fn(s, t_start[:n], t_end[:n], offsets), (sd[:n],), [weight])
    exact = fn is cuda_ext.distortion_loss
    assert_same(got[0], want[0], exact)
    assert_same(grads[0][:n], want_grads[0], exact)
    assert bool((grads[0][n:] == 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", [cuda_ext.visible_samples, reference.visible_samples], ids=["op", "reference"])
def test_visible_samples_ignore_the_padding(device, fn):
    (sd, _, _, _, offsets), n = padded_pack(device, seed=4)
    for got, want in zip(fn(sd, offsets, 1e-2, 1e-3), fn(sd[:n], offsets, 1e-2, 1e-3)):
        assert_same(got, want, fn is cuda_ext.visible_samples)


@pytest.mark.requires_cuda
def test_cuda_padding_gradients_are_zero_on_reused_memory():
    """The CUDA backwards allocate their gradients uninitialised: NaN poison in the allocator's blocks must not show
    through in the padding rows."""
    (sd, values, _, t, offsets), n = padded_pack("cuda")
    for _ in range(3):
        poison = torch.full((4 * (n + PADDING) * 8,), float("nan"), dtype=torch.float64, device="cuda")
        del poison
        out = cuda_ext.volume_render(sd.requires_grad_(), values.requires_grad_(), t, offsets, 0.0)
        (out[0].sum() + out[1].sum()).backward()
        loss = cuda_ext.distortion_loss(sd, t - 0.01, t, offsets)
        sd.grad = None
        loss.sum().backward()
        assert bool((sd.grad[n:] == 0).all()) and bool(torch.isfinite(sd.grad).all())
        assert bool((values.grad[n:] == 0).all()) and bool(torch.isfinite(values.grad).all())
        sd.grad = values.grad = None


@pytest.mark.parametrize("device", DEVICES)
def test_gradcheck_through_a_padded_pack(device):
    (sd, values, t_start, t_end, offsets), _ = padded_pack(device, seed=5)
    sd, values = sd[::1].detach().requires_grad_(), values.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda s, v: cuda_ext.volume_render(s, v, t_end, offsets, 0.0), (sd, values))
    assert torch.autograd.gradcheck(lambda s: cuda_ext.distortion_loss(s, t_start, t_end, offsets), (sd,))


@pytest.mark.parametrize("render", [True, False], ids=["volume_render", "distortion_loss"])
@pytest.mark.parametrize("backend", [cuda_ext, reference], ids=["op", "reference"])
def test_offsets_past_the_end_are_an_error(backend, render):
    (sd, values, t_start, t_end, offsets), _ = padded_pack("cpu")
    n = sd.shape[0]
    bad = torch.cat([offsets[:-1], torch.tensor([n + 1])])
    with pytest.raises(ValueError, match=f"ray_offsets must end at most at N = {n}"):
        if render:
            backend.volume_render(sd, values, t_end, bad)
        else:
            backend.distortion_loss(sd, t_start, t_end, bad)
