"""cuda_ext.upsample_bilinear2d against F.interpolate: forward, gather backward, edge cases, bad input."""

import itertools

import pytest
import torch

import cuda_ext
from cuda_ext import reference

requires_cuda = pytest.mark.requires_cuda  # conftest: skipped without a GPU or without the CUDA kernels

# (B, C, H, W): odd sizes, H != W, single rows/columns (the clamped edges), one plane.
SHAPES = [(2, 3, 5, 7), (1, 2, 1, 1), (1, 1, 1, 9), (3, 2, 8, 3), (1, 4, 13, 6), (2, 1, 2, 2)]
SCALES = [1, 2, 3, 4]
ALIGN = [False, True]


def ours(x, s, align):
    return cuda_ext.upsample_bilinear2d(x, s, align)


def ref(x, s, align):
    return reference.upsample_bilinear2d(x, s, align)


def random_input(shape, dtype=torch.float64, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=dtype).to(device)


def poison_allocator(numel, dtype, device):
    """Leave a freed block full of NaN where the next allocation of this size will land (deterministic
    with the CUDA caching allocator, best effort on the CPU), so elements a kernel forgets stay NaN."""
    block = torch.full((numel,), float("nan"), dtype=dtype, device=device)
    del block


# ------------------------------------------------------------------------------------------- forward


@pytest.mark.parametrize("shape,s,align", list(itertools.product(SHAPES, SCALES, ALIGN)))
def test_forward_matches_interpolate_float64(shape, s, align):
    x = random_input(shape, seed=s)
    poison_allocator(x.numel() * s * s, x.dtype, x.device)
    y = ours(x, s, align)
    expected = ref(x, s, align)
    assert y.shape == expected.shape and y.dtype == x.dtype and y.is_contiguous()
    # PyTorch's CPU kernel may fuse multiply-adds; the weights and taps are the same, so only the last bits differ.
    torch.testing.assert_close(y, expected, rtol=1e-14, atol=1e-14)


# Cases where every weight is a dyadic rational (s a power of two without align_corners; (in-1)/(out-1)
# a power of two with it) and inputs are multiples of 1/8: every product and sum is exact in float64,
# whatever the order or fusing of the arithmetic, so the result must equal F.interpolate bit for bit.
EXACT_CASES = [
    ((2, 3, 5, 7), 2, False),
    ((1, 2, 6, 1), 4, False),
    ((2, 2, 3, 11), 3, True),
    ((1, 1, 3, 3), 3, True),
    ((1, 2, 1, 3), 3, True),
    ((2, 1, 1, 1), 4, True),
    ((2, 3, 4, 5), 1, False),
    ((2, 3, 4, 5), 1, True),
]


@pytest.mark.parametrize("shape,s,align", EXACT_CASES)
def test_forward_bit_exact_on_dyadic_inputs(shape, s, align):
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-64, 64, shape, generator=gen).double() / 8
    poison_allocator(x.numel() * s * s, x.dtype, x.device)
    assert torch.equal(ours(x, s, align), ref(x, s, align))


def test_scale_one_is_a_copy():
    x = random_input((2, 3, 4, 5))
    y = ours(x, 1, False)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("align", ALIGN)
def test_forward_float32(align):
    x = random_input((2, 3, 9, 6), dtype=torch.float32)
    torch.testing.assert_close(ours(x, 3, align), ref(x, 3, align), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "make_view",
    [
        lambda t: t.permute(0, 1, 3, 2),
        lambda t: t[:, :, ::2, 1:],
        lambda t: t.contiguous(memory_format=torch.channels_last),
        lambda t: t.transpose(0, 1),
    ],
    ids=["permuted", "sliced", "channels_last", "batch_channel_swapped"],
)
@pytest.mark.parametrize("align", ALIGN)
def test_non_contiguous_input(make_view, align):
    x = make_view(random_input((2, 3, 7, 6)))
    assert not x.is_contiguous()
    torch.testing.assert_close(ours(x, 2, align), ref(x, 2, align), rtol=1e-14, atol=1e-14)
    x.requires_grad_(True)
    grad = random_input(ours(x, 2, align).shape, seed=3)
    (got,) = torch.autograd.grad(ours(x, 2, align), x, grad)
    (want,) = torch.autograd.grad(ref(x, 2, align), x, grad)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("shape", [(0, 3, 4, 5), (2, 0, 4, 5), (2, 3, 0, 5), (2, 3, 4, 0)])
@pytest.mark.parametrize("s", [1, 2])
def test_empty_input(shape, s):
    x = torch.empty(shape, dtype=torch.float64, requires_grad=True)
    y = ours(x, s, False)
    assert y.shape == (shape[0], shape[1], shape[2] * s, shape[3] * s)
    y.sum().backward()
    assert x.grad.shape == x.shape


# ------------------------------------------------------------------------------------------ backward


@pytest.mark.parametrize(
    "shape,s,align", [(shape, s, align) for shape in SHAPES[:4] for s in SCALES for align in ALIGN]
)
def test_backward_matches_interpolate(shape, s, align):
    x = random_input(shape).requires_grad_(True)
    grad = random_input((shape[0], shape[1], shape[2] * s, shape[3] * s), seed=7)
    (got,) = torch.autograd.grad(ours(x, s, align), x, grad)
    (want,) = torch.autograd.grad(ref(x, s, align), x, grad)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("s,align", list(itertools.product([1, 2, 3, 5], ALIGN)))
def test_gradcheck(s, align):
    x = random_input((2, 2, 4, 3)).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: ours(t, s, align), (x,))


@pytest.mark.parametrize("align", ALIGN)
def test_gradgradcheck(align):
    x = random_input((1, 2, 3, 4)).requires_grad_(True)
    assert torch.autograd.gradgradcheck(lambda t: ours(t, 2, align), (x,))


def test_backward_of_ones_for_many_sizes():
    """Each input's total weight (the backward of an all-ones gradient) for many sizes and factors:
    every edge case of the gather windows (first/last inputs, H=1, windows longer than the CUDA cache)."""
    for h, s, align in itertools.product(range(1, 12), range(2, 7), ALIGN):
        x = torch.ones(1, 1, h, h + 1, dtype=torch.float64, requires_grad=True)
        grad = torch.ones(1, 1, h * s, (h + 1) * s, dtype=torch.float64)
        (got,) = torch.autograd.grad(ours(x, s, align), x, grad)
        (want,) = torch.autograd.grad(ref(x, s, align), x, grad)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-13, msg=f"H={h} s={s} align={align}")


# ----------------------------------------------------------------------------------------- opcheck


@pytest.mark.parametrize("s,align", [(1, False), (2, False), (3, True)])
def test_opcheck(s, align):
    x = random_input((2, 3, 4, 5)).requires_grad_(True)
    torch.library.opcheck(torch.ops.cuda_ext.upsample_bilinear2d.default, (x, s, align))
    grad = random_input((2, 3, 4 * s, 5 * s), seed=2)
    torch.library.opcheck(torch.ops.cuda_ext.upsample_bilinear2d_backward.default, (grad, 4, 5, s, align))


# --------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("shape", [(3, 4, 5), (1, 2, 3, 4, 5), ()])
def test_wrong_ndim(shape):
    with pytest.raises(ValueError, match=r"x must be 4-D \(B, C, H, W\)"):
        ours(torch.randn(shape), 2, False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16])
def test_bad_dtype_on_cpu(dtype):
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        ours(torch.zeros(1, 1, 2, 2, dtype=dtype), 2, False)


@pytest.mark.parametrize("scale_factor", [0, -1])
def test_bad_scale_factor(scale_factor):
    with pytest.raises(ValueError, match="scale_factor must be an integer >= 1"):
        ours(torch.randn(1, 1, 2, 2), scale_factor, False)


@pytest.mark.parametrize("scale_factor", [1.5, 2.0, True, "2", None])
def test_scale_factor_not_an_int(scale_factor):
    with pytest.raises(TypeError, match="scale_factor must be an integer >= 1"):
        ours(torch.randn(1, 1, 2, 2), scale_factor, False)


def test_bad_scale_factor_reaches_cpp_check():
    with pytest.raises(RuntimeError, match="scale_factor must be an integer >= 1, got 0"):
        torch.ops.cuda_ext.upsample_bilinear2d(torch.randn(1, 1, 2, 2), 0, False)


def test_bad_align_corners():
    with pytest.raises(TypeError, match="align_corners must be a bool"):
        ours(torch.randn(1, 1, 2, 2), 2, "yes")


def test_not_a_tensor():
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        ours([[1.0]], 2, False)


def test_huge_size_raises():
    x = torch.zeros(1, dtype=torch.float32).expand(1, 1, 1, 2**30)  # no memory behind it
    with pytest.raises(ValueError, match="x width times scale_factor must be at most"):
        ours(x, 4, False)
    with pytest.raises(RuntimeError, match="x width times scale_factor must be at most"):
        torch.ops.cuda_ext.upsample_bilinear2d(x, 4, False)  # the C++ check, for direct calls


@pytest.mark.parametrize(
    "grad_shape,match",
    [
        ((1, 2, 8, 9), "grad_out must be \\(B, C, 8, 10\\)"),
        ((2, 8, 10), "grad_out must be 4-D"),
    ],
)
def test_backward_bad_grad_out(grad_shape, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.cuda_ext.upsample_bilinear2d_backward(torch.randn(grad_shape), 4, 5, 2, False)


def test_backward_bad_sizes():
    with pytest.raises(RuntimeError, match="input_height and input_width must be >= 0"):
        torch.ops.cuda_ext.upsample_bilinear2d_backward(torch.randn(1, 1, 2, 2), -1, 1, 2, False)


# -------------------------------------------------------------------------------------------- CUDA

CUDA_SHAPES = [(2, 3, 5, 7), (1, 2, 1, 1), (3, 2, 8, 3), (2, 4, 33, 70)]


@requires_cuda
@pytest.mark.parametrize("shape,s,align", list(itertools.product(CUDA_SHAPES, [1, 2, 3, 4, 5], ALIGN)))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_cuda_forward_backward_vs_reference(shape, s, align, dtype, tol):
    x = random_input(shape, dtype=dtype, device="cuda").requires_grad_(True)
    grad = random_input((shape[0], shape[1], shape[2] * s, shape[3] * s), dtype=dtype, device="cuda", seed=5)
    poison_allocator(grad.numel(), dtype, "cuda")
    y = ours(x, s, align)
    expected = ref(x, s, align)
    torch.testing.assert_close(y, expected, rtol=tol, atol=tol)
    poison_allocator(x.numel(), dtype, "cuda")
    (got,) = torch.autograd.grad(y, x, grad)
    (want,) = torch.autograd.grad(expected, x, grad)
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * s * s)


@requires_cuda
@pytest.mark.parametrize("s,align", list(itertools.product([2, 3, 4], ALIGN)))
def test_cuda_matches_cpu_float64(s, align):
    x = random_input((2, 3, 17, 12)).requires_grad_(True)
    xc = x.detach().cuda().requires_grad_(True)
    grad = random_input((2, 3, 17 * s, 12 * s), seed=9)
    torch.testing.assert_close(ours(xc, s, align).cpu(), ours(x, s, align), rtol=1e-13, atol=1e-13)
    (g_cpu,) = torch.autograd.grad(ours(x, s, align), x, grad)
    (g_cuda,) = torch.autograd.grad(ours(xc, s, align), xc, grad.cuda())
    torch.testing.assert_close(g_cuda.cpu(), g_cpu, rtol=1e-13, atol=1e-13)


@requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("align", ALIGN)
def test_cuda_half_types(dtype, tol, align):
    x32 = random_input((2, 3, 9, 14), dtype=torch.float32, device="cuda")
    x = x32.to(dtype).requires_grad_(True)
    y = ours(x, 2, align)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref(x.detach().float(), 2, align), rtol=tol, atol=tol)
    grad = random_input(y.shape, dtype=torch.float32, device="cuda", seed=4)
    (got,) = torch.autograd.grad(y, x, grad.to(dtype))
    xf = x.detach().float().requires_grad_(True)
    (want,) = torch.autograd.grad(ref(xf, 2, align), xf, grad.to(dtype).float())
    torch.testing.assert_close(got.float(), want, rtol=4 * tol, atol=4 * tol)


@requires_cuda
def test_cuda_benchmark_shape():
    x = random_input((8, 64, 64, 96), dtype=torch.float32, device="cuda").requires_grad_(True)
    grad = torch.randn(8, 64, 128, 192, device="cuda")
    y = ours(x, 2, False)
    torch.testing.assert_close(y, ref(x, 2, False), rtol=1e-5, atol=1e-5)
    (got,) = torch.autograd.grad(y, x, grad)
    (want,) = torch.autograd.grad(ref(x, 2, False), x, grad)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@requires_cuda
def test_cuda_non_contiguous_and_empty():
    x = random_input((2, 3, 7, 6), device="cuda").permute(0, 1, 3, 2)
    torch.testing.assert_close(ours(x, 3, True), ref(x, 3, True), rtol=1e-12, atol=1e-12)
    e = torch.empty(0, 3, 4, 5, device="cuda", dtype=torch.float64)
    assert ours(e, 2, False).shape == (0, 3, 8, 10)


@requires_cuda
def test_cuda_integer_dtype_raises():
    with pytest.raises(TypeError, match="x must be float32 or float64"):
        ours(torch.zeros(1, 1, 2, 2, dtype=torch.int32, device="cuda"), 2, False)


@requires_cuda
def test_cuda_opcheck():
    x = random_input((2, 3, 4, 5), device="cuda").requires_grad_(True)
    torch.library.opcheck(torch.ops.cuda_ext.upsample_bilinear2d.default, (x, 2, False))
