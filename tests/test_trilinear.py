"""cuda_ext.trilinear_interpolate (pairwise (N, 8, F) form) against cuda_ext.reference.

CPU tests always run; tests marked ``requires_cuda`` run the CUDA kernels (skipped without a GPU).
"""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference

OPS = torch.ops.cuda_ext
SHAPES = [(1, 1), (5, 3), (17, 4), (64, 13), (33, 64), (9, 257)]  # (N, F): F % 4 != 0 included


def make_inputs(n: int, f: int, gen: torch.Generator, dtype=torch.float64, device="cpu", boundary: bool = True):
    """Random feats (N, 8, F) and points (N, 3) in [-1, 1]; with `boundary`, some coordinates exactly +-1."""
    feats = torch.randn(n, 8, f, generator=gen, dtype=torch.float64)
    points = torch.rand(n, 3, generator=gen, dtype=torch.float64) * 2 - 1
    if boundary and n >= 3:
        points[0::3, 0] = 1.0
        points[1::3, 1] = -1.0
        points[2::3, 2] = 1.0
    return feats.to(device, dtype), points.to(device, dtype)


def grads_of(fn, feats: torch.Tensor, points: torch.Tensor, grad_out: torch.Tensor):
    """(output, grad_feats, grad_points) of fn(feats, points) for the upstream gradient grad_out."""
    feats = feats.detach().requires_grad_()
    points = points.detach().requires_grad_()
    out = fn(feats, points)
    grad_feats, grad_points = torch.autograd.grad(out, (feats, points), grad_out)
    return out.detach(), grad_feats, grad_points


# ----------------------------------------------------------------------------------------------- CPU


def tutorial_trilinear_interpolation_py(feats: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """The tutorial formula the op promises, literally (a, b, c, d, then the (1-u)/u blend): corner 1 carries
    ``(1-u) v (1-w)`` and corner 2 ``(1-u)(1-v) w``, so corner ``k = 4*iu + 2*iw + iv``."""
    u = (points[:, 0:1] + 1) / 2
    v = (points[:, 1:2] + 1) / 2
    w = (points[:, 2:3] + 1) / 2
    a = (1 - v) * (1 - w)
    b = v * (1 - w)
    c = (1 - v) * w
    d = v * w
    return (1 - u) * (a * feats[:, 0] + b * feats[:, 1] + c * feats[:, 2] + d * feats[:, 3]) + u * (
        a * feats[:, 4] + b * feats[:, 5] + c * feats[:, 6] + d * feats[:, 7]
    )


def _swap_corners_1_2_and_5_6(feats: torch.Tensor) -> torch.Tensor:
    return feats[:, [0, 2, 1, 3, 4, 6, 5, 7]]


def check_corner_order_is_the_tutorials(gen: torch.Generator, dtype: torch.dtype, device: str) -> None:
    """Value, grad to feats and grad to points of the public op against the tutorial's formula in float64."""
    n, f = 200, 7
    feats = (torch.randn(n, 8, f, generator=gen, dtype=torch.float64) + 0.5).to(device, dtype)  # never all zero
    points = (torch.rand(n, 3, generator=gen, dtype=torch.float64) * 2 - 1).to(device, dtype)  # in [-1, 1]
    weights = torch.randn(n, f, generator=gen, dtype=torch.float64).to(device, dtype)  # random-weighted sum

    def value_and_grads(fn, feats, points, weights):
        feats = feats.detach().requires_grad_()
        points = points.detach().requires_grad_()
        out = fn(feats, points)
        grad_feats, grad_points = torch.autograd.grad((out * weights).sum(), (feats, points))
        return out.detach(), grad_feats, grad_points

    got = value_and_grads(cuda_ext.trilinear_interpolate, feats, points, weights)
    want = value_and_grads(tutorial_trilinear_interpolation_py, feats.double(), points.double(), weights.double())
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for name, a, b in zip(["value", "grad_feats", "grad_points"], got, want):
        assert a.dtype == dtype and a.device == feats.device, name
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}")

    # These inputs tell the two orders apart: with corners 1<->2 and 5<->6 swapped (k = 4*iu + 2*iv + iw), the
    # value and the point gradient are far outside the tolerance (the feats gradient is the same swap of weights).
    swapped = value_and_grads(
        tutorial_trilinear_interpolation_py,
        _swap_corners_1_2_and_5_6(feats.double()),
        points.double(),
        weights.double(),
    )
    for a, b in [(swapped[0], want[0]), (swapped[2], want[2])]:
        assert (a - b).abs().max() > 1e3 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_corner_order_is_the_tutorials(gen, dtype):
    check_corner_order_is_the_tutorials(gen, dtype, "cpu")


def test_single_corner_weights(gen):
    # A single non-zero corner isolates its weight: corner k = 4*iu + 2*iw + iv, so corner 1 = (iu, iv, iw) = (0, 1, 0).
    points = torch.rand(6, 3, generator=gen, dtype=torch.float64) * 2 - 1
    u, v, w = ((points + 1) / 2).unbind(1)
    for k in range(8):
        iu, iw, iv = (k >> 2) & 1, (k >> 1) & 1, k & 1
        feats = torch.zeros(6, 8, 1, dtype=torch.float64)
        feats[:, k] = 1
        expected = (u if iu else 1 - u) * (v if iv else 1 - v) * (w if iw else 1 - w)
        torch.testing.assert_close(cuda_ext.trilinear_interpolate(feats, points)[:, 0], expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("n,f", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_forward_matches_reference(gen, n, f, dtype, tol):
    feats, points = make_inputs(n, f, gen, dtype)
    expected = reference.trilinear_interpolate(feats.double(), points.double())
    out = cuda_ext.trilinear_interpolate(feats, points)
    assert out.dtype == dtype and out.shape == (n, f)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("n,f", SHAPES)
def test_backward_matches_reference(gen, n, f):
    feats, points = make_inputs(n, f, gen)
    grad_out = torch.randn(n, f, generator=gen, dtype=torch.float64)
    got = grads_of(cuda_ext.trilinear_interpolate, feats, points, grad_out)
    want = grads_of(reference.trilinear_interpolate, feats, points, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("feats_grad,points_grad", [(True, True), (True, False), (False, True)])
def test_gradcheck(gen, feats_grad, points_grad):
    feats, points = make_inputs(4, 5, gen)
    feats.requires_grad_(feats_grad)
    points.requires_grad_(points_grad)
    assert torch.autograd.gradcheck(cuda_ext.trilinear_interpolate, (feats, points))


def test_backward_op_returns_empty_for_unrequested_gradients(gen):
    feats, points = make_inputs(7, 6, gen)
    grad_out = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    grad_feats, grad_points = OPS.trilinear_interpolate_backward(grad_out, feats, points, True, False)
    assert grad_feats.shape == (7, 8, 6) and grad_points.shape == (0,)
    grad_feats, grad_points = OPS.trilinear_interpolate_backward(grad_out, feats, points, False, True)
    assert grad_feats.shape == (0,) and grad_points.shape == (7, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(gen, dtype):
    feats, points = make_inputs(6, 5, gen, dtype)
    torch.library.opcheck(OPS.trilinear_interpolate.default, (feats.requires_grad_(), points.requires_grad_()))
    feats, points = make_inputs(6, 8, gen, dtype)
    torch.library.opcheck(OPS.trilinear_interpolate.default, (feats.requires_grad_(), points))


def test_opcheck_backward_op(gen):
    feats, points = make_inputs(5, 3, gen)
    grad_out = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    for flags in [(True, True), (True, False), (False, True), (False, False)]:
        torch.library.opcheck(OPS.trilinear_interpolate_backward.default, (grad_out, feats, points, *flags))


def _non_contiguous(feats: torch.Tensor, points: torch.Tensor):
    """The same values, laid out with strides no kernel expects."""
    feats_nc = feats.transpose(1, 2).contiguous().transpose(1, 2)
    points_nc = torch.stack([points, -points], dim=2)[..., 0]
    assert not feats_nc.is_contiguous() and not points_nc.is_contiguous()
    return feats_nc, points_nc


def test_non_contiguous_inputs_give_identical_results(gen):
    feats, points = make_inputs(23, 12, gen, torch.float32)
    grad_out = torch.randn(12, 23, generator=gen).t()  # non-contiguous upstream gradient too
    want = grads_of(cuda_ext.trilinear_interpolate, feats, points, grad_out.contiguous())
    got = grads_of(cuda_ext.trilinear_interpolate, *_non_contiguous(feats, points), grad_out)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_expanded_upstream_gradient(gen):
    # out.sum().backward() hands the backward a stride-0 gradient.
    feats, points = make_inputs(9, 7, gen)
    got = grads_of(cuda_ext.trilinear_interpolate, feats, points, torch.ones(1, 1, dtype=torch.float64).expand(9, 7))
    want = grads_of(reference.trilinear_interpolate, feats, points, torch.ones(9, 7, dtype=torch.float64))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,f", [(0, 5), (0, 0), (4, 0)])
def test_empty_inputs(gen, n, f):
    feats, points = make_inputs(n, f, gen)
    out, grad_feats, grad_points = grads_of(cuda_ext.trilinear_interpolate, feats, points, torch.ones(n, f).double())
    assert out.shape == (n, f) and grad_feats.shape == (n, 8, f) and grad_points.shape == (n, 3)
    assert torch.equal(grad_points, torch.zeros(n, 3, dtype=torch.float64))  # no features: exactly 0


def test_double_backward_raises(gen):
    feats, points = make_inputs(3, 4, gen)
    points.requires_grad_()
    out = cuda_ext.trilinear_interpolate(feats, points)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), points, create_graph=True)


def _bad_pair_inputs():
    f64 = torch.float64
    good_feats, good_points = torch.randn(4, 8, 3, dtype=f64), torch.rand(4, 3, dtype=f64)
    return [
        ("feats ndim", torch.randn(4, 24, dtype=f64), good_points, "feats must have shape"),
        ("feats corners", torch.randn(4, 7, 3, dtype=f64), good_points, "feats must hold 8 corners"),
        ("points columns", good_feats, torch.rand(4, 2, dtype=f64), "points must have shape"),
        ("points ndim", good_feats, torch.rand(12, dtype=f64), "points must have shape"),
        ("N mismatch", good_feats, torch.rand(5, 3, dtype=f64), "points has N=5 rows but feats has N=4"),
        (
            "integer feats",
            torch.ones(4, 8, 3, dtype=torch.int64),
            torch.ones(4, 3, dtype=torch.int64),
            "feats must be float32 or float64",
        ),
        ("mixed dtypes", good_feats, good_points.float(), "points and feats must have the same dtype"),
        ("half on CPU", good_feats.half(), good_points.half(), "feats must be float32 or float64 on the CPU"),
    ]


@pytest.mark.parametrize("case", _bad_pair_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_naming_the_argument(case):
    _, feats, points, message = case
    with pytest.raises((ValueError, TypeError), match=message):  # the wrapper's checks, before dispatch
        cuda_ext.trilinear_interpolate(feats, points)
    grad_out = torch.ones(feats.shape[0], feats.shape[-1], dtype=feats.dtype)
    with pytest.raises(RuntimeError, match=message):
        OPS.trilinear_interpolate_backward(grad_out, feats, points, True, True)


@pytest.mark.parametrize(
    "grad_out,message",
    [
        (torch.ones(4, 4, dtype=torch.float64), r"grad_out must have shape \(4, 3\)"),
        (torch.ones(12, dtype=torch.float64), r"grad_out must have shape \(4, 3\)"),
        (torch.ones(4, 3, dtype=torch.float32), "grad_out and feats must have the same dtype"),
    ],
)
def test_bad_grad_out_raises(grad_out, message):
    feats, points = torch.randn(4, 8, 3, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=message):
        OPS.trilinear_interpolate_backward(grad_out, feats, points, True, True)


# ----------------------------------------------------------------------------------------------- CUDA

CUDA_SHAPES = [(1, 1), (7, 3), (50, 4), (33, 13), (129, 64), (40, 256), (11, 1000)]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_corner_order_is_the_tutorials(gen, dtype):
    check_corner_order_is_the_tutorials(gen, dtype, "cuda")


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is one element past a 16-byte boundary."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buffer[1:].view(t.shape)
    out.copy_(t)
    return out


@pytest.mark.requires_cuda
@pytest.mark.parametrize("n,f", CUDA_SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_cuda_forward_and_backward_match_reference(gen, poison_cuda_cache, n, f, dtype, tol):
    feats, points = make_inputs(n, f, gen, dtype, "cuda")
    grad_out = torch.randn(n, f, generator=gen, dtype=torch.float64).to("cuda", dtype)
    want = grads_of(reference.trilinear_interpolate, feats.double(), points.double(), grad_out.double())
    poison_cuda_cache()
    got = grads_of(cuda_ext.trilinear_interpolate, feats, points, grad_out)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol * max(1, f) ** 0.5)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("flags", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("f", [3, 64])
def test_cuda_backward_op_each_gradient_alone(gen, poison_cuda_cache, flags, f):
    feats, points = make_inputs(45, f, gen, torch.float32, "cuda")
    grad_out = torch.randn(45, f, generator=gen).cuda()
    _, want_feats, want_points = grads_of(
        reference.trilinear_interpolate, feats.double(), points.double(), grad_out.double()
    )
    poison_cuda_cache()
    grad_feats, grad_points = OPS.trilinear_interpolate_backward(grad_out, feats, points, *flags)
    for requested, got, want in [(flags[0], grad_feats, want_feats), (flags[1], grad_points, want_points)]:
        if requested:
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
        else:
            assert got.shape == (0,)


@pytest.mark.requires_cuda
def test_cuda_misaligned_and_non_contiguous_inputs(gen):
    # F % 4 == 0 but the data starts off a 16-byte boundary: the kernels must fall back to scalar access.
    feats, points = make_inputs(31, 16, gen, torch.float32, "cuda")
    grad_out = torch.randn(31, 16, generator=gen).cuda()
    want = grads_of(cuda_ext.trilinear_interpolate, feats, points, grad_out)
    for variant in [
        (_misaligned(feats), _misaligned(points), _misaligned(grad_out)),
        (*_non_contiguous(feats, points), grad_out.t().contiguous().t()),
    ]:
        got = grads_of(cuda_ext.trilinear_interpolate, *variant)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 1e-1)])
@pytest.mark.parametrize("n,f", [(37, 5), (64, 64), (20, 256)])
def test_cuda_reduced_precision_vs_float32(gen, poison_cuda_cache, dtype, tol, n, f):
    feats, points = make_inputs(n, f, gen, dtype, "cuda")
    grad_out = torch.randn(n, f, generator=gen).to("cuda", dtype)
    want = grads_of(reference.trilinear_interpolate, feats.float(), points.float(), grad_out.float())
    poison_cuda_cache()
    got = grads_of(cuda_ext.trilinear_interpolate, feats, points, grad_out)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        # grad_points sums F products: its error grows with sqrt(F).
        torch.testing.assert_close(a.float(), b, rtol=tol, atol=tol * max(1, f) ** 0.5)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_agrees_with_cpu(gen, dtype):
    feats, points = make_inputs(300, 37, gen, dtype)
    grad_out = torch.randn(300, 37, generator=gen, dtype=dtype)
    cpu = grads_of(cuda_ext.trilinear_interpolate, feats, points, grad_out)
    gpu = grads_of(cuda_ext.trilinear_interpolate, feats.cuda(), points.cuda(), grad_out.cuda())
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol)


@pytest.mark.requires_cuda
def test_cuda_gradcheck_and_opcheck(gen):
    feats, points = make_inputs(6, 9, gen, torch.float64, "cuda")
    feats.requires_grad_()
    points.requires_grad_()
    assert torch.autograd.gradcheck(cuda_ext.trilinear_interpolate, (feats, points))
    torch.library.opcheck(OPS.trilinear_interpolate.default, (feats, points))


@pytest.mark.requires_cuda
def test_cuda_empty_inputs(gen):
    for n, f in [(0, 8), (5, 0)]:
        feats, points = make_inputs(n, f, gen, torch.float32, "cuda")
        out, grad_feats, grad_points = grads_of(
            cuda_ext.trilinear_interpolate, feats, points, torch.ones(n, f, device="cuda")
        )
        assert out.shape == (n, f) and grad_feats.shape == (n, 8, f)
        assert torch.equal(grad_points, torch.zeros(n, 3, device="cuda"))


@pytest.mark.requires_cuda
def test_cuda_inputs_on_different_devices_raise(gen):
    feats, points = make_inputs(4, 3, gen, torch.float32)
    with pytest.raises(ValueError, match="points and feats must be on the same device"):
        cuda_ext.trilinear_interpolate(feats.cuda(), points)
    with pytest.raises(RuntimeError, match="grad_out and feats must be on the same device"):
        OPS.trilinear_interpolate_backward(torch.ones(4, 3), feats.cuda(), points.cuda(), True, True)
