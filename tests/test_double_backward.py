"""Double backward (issue 14, part 4): gradgradcheck for every op that has one (gelu, upsample_bilinear2d), a clear
error for the others (trilinear_interpolate, grid_interpolate); a gradient penalty through a GELU MLP."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from test_op_contracts import rand_points, randn

import cuda_ext
from cuda_ext import reference
from cuda_ext.gelu import gelu_second_derivative

OPS = torch.ops.cuda_ext
F64 = torch.float64
MODES = ["none", "tanh"]


# -------------------------------------------------------------------------------------- double backward


def _gelu_fn(mode):
    return lambda t: cuda_ext.gelu(t, mode)


@pytest.mark.parametrize("mode", MODES)
def test_gelu_gradcheck_and_gradgradcheck(mode):
    x = randn(4, 5, seed=11).mul(2.5).requires_grad_()
    assert torch.autograd.gradcheck(_gelu_fn(mode), (x,))
    assert torch.autograd.gradgradcheck(_gelu_fn(mode), (x,))


@pytest.mark.parametrize("mode", MODES)
def test_gelu_backward_op_gradcheck_and_gradgradcheck(mode):
    """gelu_backward is differentiable in both inputs, to second order too (third order of gelu)."""
    grad_out = randn(3, 4, seed=12).requires_grad_()
    x = randn(3, 4, seed=13).mul(2).requires_grad_()

    def fn(g, t):
        return OPS.gelu_backward(g, t, mode)

    assert torch.autograd.gradcheck(fn, (grad_out, x))
    assert torch.autograd.gradgradcheck(fn, (grad_out, x))


@pytest.mark.parametrize("mode", MODES)
def test_gelu_second_derivative_matches_f_gelu(mode):
    x = torch.cat([randn(200, seed=14) * 4, torch.tensor([-40.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 40.0], dtype=F64)])
    x.requires_grad_()
    (first,) = torch.autograd.grad(F.gelu(x, approximate=mode).sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(first.sum(), x)
    torch.testing.assert_close(gelu_second_derivative(x.detach(), mode), want, rtol=1e-12, atol=1e-13)
    (first,) = torch.autograd.grad(cuda_ext.gelu(x, mode).sum(), x, create_graph=True)
    (got,) = torch.autograd.grad(first.sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    assert want.abs().max() > 0.1  # not a silent zero


@pytest.mark.parametrize("mode", MODES)
def test_gelu_second_derivative_is_not_silently_zero(mode):
    x = randn(50, seed=15).requires_grad_()
    (first,) = torch.autograd.grad(cuda_ext.gelu(x, mode).sum(), x, create_graph=True)
    assert first.requires_grad
    (second,) = torch.autograd.grad(first.sum(), x)
    assert (second != 0).all()


@pytest.mark.parametrize("s,align", [(2, False), (3, True)])
def test_upsample_gradcheck_and_gradgradcheck(s, align):
    x = randn(1, 2, 3, 4, seed=16).requires_grad_()

    def fn(t):
        return cuda_ext.upsample_bilinear2d(t, s, align)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_upsample_double_backward_matches_reference():
    """The second-order term of the linear op, through a nonlinearity: the same as F.interpolate's."""
    x = randn(2, 2, 3, 4, seed=17).requires_grad_()

    def penalty_grad(fn):
        y = torch.tanh(fn(x, 2, True)).pow(3).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
        return gg

    want = penalty_grad(reference.upsample_bilinear2d)
    torch.testing.assert_close(penalty_grad(cuda_ext.upsample_bilinear2d), want, rtol=1e-12, atol=1e-12)
    assert want.abs().max() > 1e-3


def _no_double_backward_calls():
    grid, points = randn(3, 4, 2, 5, seed=18), rand_points(6, seed=19)
    feats = randn(6, 8, 5, seed=20)
    return [
        ("trilinear_interpolate", cuda_ext.trilinear_interpolate, (feats, points)),
        ("grid_interpolate", cuda_ext.grid_interpolate, (grid, points)),
        ("gelu_rows", cuda_ext.gelu_rows, (randn(6, 5, seed=21), randn(3, 5, seed=22), torch.arange(6) // 2)),
    ]


@pytest.mark.parametrize("which", [0, 1], ids=["wrt-values", "wrt-points"])
@pytest.mark.parametrize("name,fn,args", _no_double_backward_calls(), ids=[c[0] for c in _no_double_backward_calls()])
def test_ops_without_double_backward_refuse_create_graph(name, fn, args, which):
    inputs = [a.detach().clone() for a in args]
    inputs[which].requires_grad_()
    out = fn(*inputs)
    with pytest.raises(RuntimeError, match=f"{name}: double backward"):
        torch.autograd.grad(out.sum(), inputs[which], create_graph=True)
    # Without create_graph the same first derivative works.
    out = fn(*inputs)
    (grad,) = torch.autograd.grad(out.sum(), inputs[which])
    assert grad.shape == inputs[which].shape and grad.abs().sum() > 0


def _mlp_params(seed=21):
    gen = torch.Generator().manual_seed(seed)
    sizes = [(4, 16), (16, 16), (16, 1)]
    params = []
    for a, b in sizes:
        params += [torch.randn(b, a, generator=gen, dtype=F64) / math.sqrt(a), torch.randn(b, generator=gen, dtype=F64)]
    return [p.requires_grad_() for p in params]


def _gradient_penalty_grads(act, x, params):
    """d/d(params, x) of ||d/dx MLP(x)||^2, MLP = Linear-act-Linear-act-Linear (not the last bias: no effect)."""
    x = x.detach().requires_grad_()
    h = x
    for i in range(0, len(params), 2):
        h = F.linear(h, params[i], params[i + 1])
        if i + 2 < len(params):
            h = act(h)
    (dx,) = torch.autograd.grad(h.sum(), x, create_graph=True)
    penalty = dx.pow(2).sum()
    return torch.autograd.grad(penalty, [*params[:-1], x])


@pytest.mark.parametrize("mode", MODES)
def test_gradient_penalty_through_gelu_mlp_matches_f_gelu(mode):
    x = randn(10, 4, seed=22) * 1.5
    params = _mlp_params()
    got = _gradient_penalty_grads(lambda t: cuda_ext.gelu(t, mode), x, params)
    want = _gradient_penalty_grads(lambda t: F.gelu(t, approximate=mode), x, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert all(b.abs().max() > 1e-4 for b in want)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_gelu_gradcheck_gradgradcheck_and_penalty(mode):
    x = randn(4, 5, seed=23).mul(2.5).cuda().requires_grad_()
    assert torch.autograd.gradcheck(_gelu_fn(mode), (x,))
    assert torch.autograd.gradgradcheck(_gelu_fn(mode), (x,))
    params = [p.detach().cuda().requires_grad_() for p in _mlp_params()]
    xc = (randn(10, 4, seed=22) * 1.5).cuda()
    got = _gradient_penalty_grads(lambda t: cuda_ext.gelu(t, mode), xc, params)
    want = _gradient_penalty_grads(lambda t: F.gelu(t, approximate=mode), xc, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.requires_cuda
def test_cuda_upsample_gradgradcheck():
    x = randn(1, 2, 3, 4, seed=24).cuda().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: cuda_ext.upsample_bilinear2d(t, 2, True), (x,))
