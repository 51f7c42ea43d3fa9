"""cuda_ext.gelu against F.gelu: both approximations, forward and backward, edge cases, bad input."""

import pytest
import torch

import cuda_ext
from cuda_ext import reference

requires_cuda = pytest.mark.requires_cuda  # conftest: skipped without a GPU or without the CUDA kernels

MODES = ["none", "tanh"]
SHAPES = [(), (1,), (7,), (1023,), (33, 17), (2, 3, 4, 5)]
# Far tails (where erf/tanh saturate and the pdf underflows) and the region around 0.
LARGE = [-1e4, -300.0, -40.0, -10.0, -5.5, -1e-3, 0.0, 1e-3, 5.5, 10.0, 40.0, 300.0, 1e4]


def random_input(shape, dtype=torch.float64, device="cpu", seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype=dtype, device=device)


def poison_allocator(numel, dtype, device):
    """Leave a freed block full of NaN where the next allocation of this size will land (deterministic
    with the CUDA caching allocator, best effort on the CPU), so elements a kernel forgets stay NaN."""
    block = torch.full((numel,), float("nan"), dtype=dtype, device=device)
    del block


def grad_of(fn, x, grad):
    x = x.detach().requires_grad_(True)
    (g,) = torch.autograd.grad(fn(x), x, grad)
    return g


# ------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_f_gelu_float64(shape, mode):
    x = random_input(shape)
    poison_allocator(x.numel(), x.dtype, x.device)
    y = cuda_ext.gelu(x, mode)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, reference.gelu(x, mode), rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 1e-6)])
def test_large_magnitudes(mode, dtype, tol):
    x = torch.tensor(LARGE, dtype=dtype)
    torch.testing.assert_close(cuda_ext.gelu(x, mode), reference.gelu(x, mode), rtol=tol, atol=tol)
    grad = torch.linspace(-2, 2, len(LARGE), dtype=dtype)
    torch.testing.assert_close(
        grad_of(lambda t: cuda_ext.gelu(t, mode), x, grad),
        grad_of(lambda t: reference.gelu(t, mode), x, grad),
        rtol=tol,
        atol=tol,
    )


@pytest.mark.parametrize("mode", MODES)
def test_forward_float32(mode):
    x = random_input((4099,), dtype=torch.float32)
    torch.testing.assert_close(cuda_ext.gelu(x, mode), reference.gelu(x, mode), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_float32_cpu_accuracy_dense(mode):
    """The CPU's float path computes exp/erf/tanh inline (cpu/fast_float.h): check it against the exact
    float64 GELU on a dense sweep, every float32 spacing regime from the tails to subnormals around 0."""
    dense = torch.linspace(-16, 16, 200_001, dtype=torch.float64)
    tiny = torch.logspace(-44, 0, 2_000, dtype=torch.float64)
    x32 = torch.cat([dense, tiny, -tiny, torch.tensor([-90.0, -87.0, -60.0, 60.0, 87.0, 90.0])]).float()
    x = x32.double()  # the exact float32 inputs, in float64
    grad = torch.ones_like(x32)
    want_y = reference.gelu(x, mode)
    want_g = grad_of(lambda t: reference.gelu(t, mode), x, grad.double())
    got_y = cuda_ext.gelu(x32, mode).double()
    got_g = grad_of(lambda t: cuda_ext.gelu(t, mode), x32, grad).double()
    # float32 rounding plus 1.5e-7 of erf (1e-7 of tanh) times |x| / 2.
    # (|x| ~ 1e30 is left to the next test: tanh mode's x**3 overflows float32 in F.gelu as here.)
    bound = 4e-7 * x.abs().clamp(min=1)
    assert ((got_y - want_y).abs() <= bound).all(), (got_y - want_y).abs().max()
    assert ((got_g - want_g).abs() <= bound).all(), (got_g - want_g).abs().max()


# F.gelu's formulas evaluated in IEEE float32: x * Phi(x) is inf * 1 at +inf and -inf * 0 = NaN at -inf;
# the derivative Phi(x) + x * phi(x) has inf * 0 at both infinities, and tanh mode's x**3 overflows at
# |x| = 1e38 (its derivative then has inf * 0 too). Written out rather than taken from F.gelu, whose
# float32 kernels differ between CPUs here (torch 2.11's AVX-512 erf returned NaN at +inf on the GPU
# machine's host, the AVX2 one here returns inf).
_NAN, _INF = float("nan"), float("inf")
_NON_FINITE_X = [_INF, -_INF, _NAN, 1e38, -1e38, 88.5, -88.5]
_NON_FINITE_Y = [_INF, _NAN, _NAN, 1e38, 0.0, 88.5, 0.0]
_NON_FINITE_GRAD = {"none": [_NAN, _NAN, _NAN, 1.0, 0.0, 1.0, 0.0], "tanh": [_NAN, _NAN, _NAN, _NAN, _NAN, 1.0, 0.0]}


@pytest.mark.parametrize("mode", MODES)
def test_float32_cpu_non_finite_inputs(mode):
    x = torch.tensor(_NON_FINITE_X)
    torch.testing.assert_close(cuda_ext.gelu(x, mode), torch.tensor(_NON_FINITE_Y), equal_nan=True)
    torch.testing.assert_close(
        grad_of(lambda t: cuda_ext.gelu(t, mode), x, torch.ones_like(x)),
        torch.tensor(_NON_FINITE_GRAD[mode]),
        equal_nan=True,
    )


def test_default_is_exact():
    x = random_input((100,))
    assert torch.equal(cuda_ext.gelu(x), cuda_ext.gelu(x, "none"))
    assert not torch.equal(cuda_ext.gelu(x, "none"), cuda_ext.gelu(x, "tanh"))


@pytest.mark.parametrize(
    "make_view",
    [
        lambda t: t.t(),
        lambda t: t[:, ::3],
        lambda t: t[1:, 2:],
        lambda t: t[:1].expand(40, -1),
    ],
    ids=["transposed", "strided", "offset", "expanded"],
)
@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_input(make_view, mode):
    x = make_view(random_input((40, 30)))
    assert not x.is_contiguous()
    torch.testing.assert_close(cuda_ext.gelu(x, mode), reference.gelu(x, mode), rtol=1e-14, atol=1e-15)
    grad = random_input(x.shape, seed=4).t().contiguous().t()  # a non-contiguous gradient too
    torch.testing.assert_close(
        grad_of(lambda t: cuda_ext.gelu(t, mode), x, grad),
        grad_of(lambda t: reference.gelu(t, mode), x, grad),
        rtol=1e-13,
        atol=1e-14,
    )


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 2, 5)])
def test_empty_input(shape):
    x = torch.empty(shape, dtype=torch.float64, requires_grad=True)
    y = cuda_ext.gelu(x)
    assert y.shape == shape
    y.sum().backward()
    assert x.grad.shape == shape


# ------------------------------------------------------------------------------------------ backward


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(1,), (1023,), (33, 17)])
def test_backward_matches_f_gelu(shape, mode):
    x = random_input(shape)
    grad = random_input(shape, seed=1)
    poison_allocator(x.numel(), x.dtype, x.device)
    torch.testing.assert_close(
        grad_of(lambda t: cuda_ext.gelu(t, mode), x, grad),
        grad_of(lambda t: reference.gelu(t, mode), x, grad),
        rtol=1e-13,
        atol=1e-14,
    )


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck(mode):
    x = random_input((5, 7), scale=2.0).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: cuda_ext.gelu(t, mode), (x,))


@pytest.mark.parametrize("mode", MODES)
def test_gradgradcheck(mode):
    x = random_input((5, 7), scale=2.0).requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda t: cuda_ext.gelu(t, mode), (x,))


@pytest.mark.parametrize("mode", MODES)
def test_double_backward_matches_f_gelu(mode):
    x = random_input((1023,)).requires_grad_(True)
    grad, grad_grad = random_input((1023,), seed=1), random_input((1023,), seed=2)

    def second(fn):
        (g,) = torch.autograd.grad(fn(x), x, grad, create_graph=True)
        return torch.autograd.grad(g, x, grad_grad)[0]

    torch.testing.assert_close(
        second(lambda t: cuda_ext.gelu(t, mode)), second(lambda t: reference.gelu(t, mode)), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("mode", MODES)
def test_opcheck(mode):
    x = random_input((6, 5)).requires_grad_(True)
    torch.library.opcheck(torch.ops.cuda_ext.gelu.default, (x, mode))
    torch.library.opcheck(torch.ops.cuda_ext.gelu_backward.default, (random_input((6, 5), seed=2), x.detach(), mode))


# --------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("approximate", ["exact", "Tanh", ""])
def test_unknown_approximate(approximate):
    with pytest.raises(ValueError, match='gelu: approximate must be "none" or "tanh"'):
        cuda_ext.gelu(torch.randn(3), approximate)


@pytest.mark.parametrize("approximate", [None, 1, b"none"])
def test_approximate_not_a_string(approximate):
    with pytest.raises(TypeError, match='gelu: approximate must be "none" or "tanh"'):
        cuda_ext.gelu(torch.randn(3), approximate)


def test_unknown_approximate_reaches_cpp_check():
    with pytest.raises(RuntimeError, match='approximate must be "none" or "tanh", got "erf"'):
        torch.ops.cuda_ext.gelu(torch.randn(3), "erf")
    with pytest.raises(RuntimeError, match='approximate must be "none" or "tanh", got "erf"'):
        torch.ops.cuda_ext.gelu_backward(torch.randn(3), torch.randn(3), "erf")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16])
def test_bad_dtype_on_cpu(dtype):
    with pytest.raises(TypeError, match="gelu: x must be float32 or float64"):
        cuda_ext.gelu(torch.zeros(4, dtype=dtype))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        cuda_ext.gelu([1.0, 2.0])


@pytest.mark.parametrize(
    "grad_out,match",
    [
        (torch.randn(4, dtype=torch.float64), "grad_out must have the shape of x"),
        (torch.randn(3, 4, dtype=torch.float32), "grad_out and x must have the same dtype"),
    ],
)
def test_backward_bad_grad_out(grad_out, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.cuda_ext.gelu_backward(grad_out, torch.randn(3, 4, dtype=torch.float64), "none")


# -------------------------------------------------------------------------------------------- CUDA

# Lengths around the 16-byte packs: tails of every size, and a size spread over many blocks.
CUDA_LENGTHS = [1, 3, 8, 1000, 4097, (1 << 20) + 5]


@requires_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", CUDA_LENGTHS)
# float32: tanhf/erff differ from PyTorch's formula order by a few ulp near the tanh form's steep part
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 1e-5)])
def test_cuda_vs_reference(n, mode, dtype, tol):
    x = random_input((n,), dtype=dtype, device="cuda")
    grad = random_input((n,), dtype=dtype, device="cuda", seed=3)
    poison_allocator(n, dtype, "cuda")
    torch.testing.assert_close(cuda_ext.gelu(x, mode), reference.gelu(x, mode), rtol=tol, atol=tol)
    poison_allocator(n, dtype, "cuda")
    torch.testing.assert_close(
        grad_of(lambda t: cuda_ext.gelu(t, mode), x, grad),
        grad_of(lambda t: reference.gelu(t, mode), x, grad),
        rtol=tol,
        atol=tol,
    )


@requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_misaligned_input(mode):
    base = random_input((4099,), dtype=torch.float32, device="cuda")
    x = base[1:]  # contiguous but 4 bytes past a 16-byte boundary: the scalar path
    assert x.data_ptr() % 16 != 0
    grad = random_input((4101,), dtype=torch.float32, device="cuda", seed=8)[3:]  # same length as x, also misaligned
    torch.testing.assert_close(cuda_ext.gelu(x, mode), reference.gelu(x, mode), rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(
        grad_of(lambda t: cuda_ext.gelu(t, mode), x, grad),
        grad_of(lambda t: reference.gelu(t, mode), x, grad),
        rtol=2e-6,
        atol=2e-6,
    )


@requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_matches_cpu_float64(mode):
    x = random_input((3, 1001))
    grad = random_input((3, 1001), seed=6)
    torch.testing.assert_close(cuda_ext.gelu(x.cuda(), mode).cpu(), cuda_ext.gelu(x, mode), rtol=1e-14, atol=1e-15)
    torch.testing.assert_close(
        grad_of(lambda t: cuda_ext.gelu(t, mode), x.cuda(), grad.cuda()).cpu(),
        grad_of(lambda t: cuda_ext.gelu(t, mode), x, grad),
        rtol=1e-13,
        atol=1e-14,
    )


@requires_cuda
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_cuda_half_types(mode, dtype, tol):
    x = random_input((5000,), dtype=dtype, device="cuda")
    grad = random_input((5000,), dtype=dtype, device="cuda", seed=2)
    y = cuda_ext.gelu(x, mode)
    assert y.dtype == dtype
    # F.gelu on the same low-precision input, computed in float32 and rounded once, as ours is.
    torch.testing.assert_close(y.float(), reference.gelu(x.float(), mode).to(dtype).float(), rtol=tol, atol=tol)
    want = grad_of(lambda t: reference.gelu(t, mode), x.float(), grad.float())
    torch.testing.assert_close(grad_of(lambda t: cuda_ext.gelu(t, mode), x, grad).float(), want, rtol=tol, atol=tol)


@requires_cuda
def test_cuda_large_magnitudes_and_empty():
    x = torch.tensor(LARGE, dtype=torch.float32, device="cuda")
    for mode in MODES:
        torch.testing.assert_close(cuda_ext.gelu(x, mode), reference.gelu(x, mode), rtol=1e-6, atol=1e-6)
    assert cuda_ext.gelu(torch.empty(0, 3, device="cuda")).shape == (0, 3)


@requires_cuda
def test_cuda_device_mismatch_raises():
    with pytest.raises(RuntimeError, match="grad_out and x must be on the same device"):
        torch.ops.cuda_ext.gelu_backward(torch.randn(3), torch.randn(3, device="cuda"), "none")


@requires_cuda
def test_cuda_integer_dtype_raises():
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        cuda_ext.gelu(torch.zeros(3, dtype=torch.int32, device="cuda"))


@requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_opcheck(mode):
    x = random_input((6, 5), device="cuda").requires_grad_(True)
    torch.library.opcheck(torch.ops.cuda_ext.gelu.default, (x, mode))
