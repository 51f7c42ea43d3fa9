"""cuda_ext.brick_grid_interpolate (a sparse grid of bricks) and its reference against grid_interpolate on the
materialised dense grid, which pins the semantics by an independent path (the grid is built brick by brick).

CPU tests always run; tests marked ``requires_cuda`` run the CUDA kernels (skipped without a GPU). Values are
never zero, so a row the kernels forget to write (or a corner they skip) cannot pass as a zero.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_grid_interpolate import _misaligned, grads_of, random_points, smooth_points

import cuda_ext
from cuda_ext import reference

OPS = torch.ops.cuda_ext
F64 = torch.float64
# (shape (V0, V1, V2), brick, C): shapes not divisible by the brick, B = 1, 3, 8, C = 1, 3, 12, axes of 1 vertex.
CASES = [
    ((7, 5, 9), 3, 3),
    ((4, 4, 4), 1, 3),
    ((10, 3, 17), 8, 12),
    ((1, 6, 1), 2, 1),
    ((12, 9, 5), 3, 12),
    ((9, 17, 8), 8, 1),
    ((5, 1, 7), 3, 4),
]
IMPLEMENTATIONS = {"custom": cuda_ext.brick_grid_interpolate, "reference": reference.brick_grid_interpolate}


def make_bricks(shape, brick, channels, gen, dtype=F64, fill=0.6):
    """values (M, C) with |v| in [0.5, 1.5] (never zero) and a table where ~fill of the bricks hold a shuffled
    slot and the others an empty mark (any negative value)."""
    bricks = [math.ceil(v / brick) for v in shape]
    total = math.prod(bricks)
    slots = max(1, round(fill * total))
    table = torch.randint(-9, 0, (total,), generator=gen, dtype=torch.int32)
    table[torch.randperm(total, generator=gen)[:slots]] = torch.randperm(slots, generator=gen).int()
    magnitude = torch.rand(slots * brick**3, channels, generator=gen, dtype=F64) + 0.5
    sign = torch.randint(0, 2, magnitude.shape, generator=gen) * 2 - 1
    return (magnitude * sign).to(dtype), table.reshape(bricks)


def dense_grid(values, table, shape, brick):
    """The virtual (V0, V1, V2, C) grid, copied brick by brick (differentiable in values)."""
    t0, t1, t2 = table.shape
    slots, c = values.shape[0] // brick**3, values.shape[1]
    dense = values.new_zeros(t0 * brick, t1 * brick, t2 * brick, c)
    for (i, j, k), slot in zip(torch.cartesian_prod(*map(torch.arange, table.shape)).tolist(), table.flatten()):
        if 0 <= slot < slots:
            block = values[slot * brick**3 : (slot + 1) * brick**3].reshape(brick, brick, brick, c)
            dense[i * brick : (i + 1) * brick, j * brick : (j + 1) * brick, k * brick : (k + 1) * brick] = block
    return dense[: shape[0], : shape[1], : shape[2]]


def lookup(fn, table, shape, brick):
    """fn as a function of (values, points), for grads_of."""
    return lambda values, points: fn(values, table, points, list(shape), brick)


def dense_lookup(table, shape, brick):
    return lambda values, points: reference.grid_interpolate(dense_grid(values, table, shape, brick), points)


# ----------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("shape,brick,channels", CASES, ids=str)
def test_matches_the_dense_grid(gen, name, shape, brick, channels):
    values, table = make_bricks(shape, brick, channels, gen)
    fn, want_fn = lookup(IMPLEMENTATIONS[name], table, shape, brick), dense_lookup(table, shape, brick)
    points = random_points(300, gen)  # outside the box too (the clamp), and on cell and brick boundaries
    grad_out = torch.randn(300, channels, generator=gen, dtype=F64)
    got, want = grads_of(fn, values, points, grad_out), grads_of(want_fn, values, points, grad_out)
    assert got[0].shape == (300, channels)
    for a, b in zip(got[:2], want[:2]):  # output and values gradient: continuous in the points
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    points = smooth_points(300, shape, gen)  # the points gradient where it is defined
    got, want = grads_of(fn, values, points, grad_out), grads_of(want_fn, values, points, grad_out)
    torch.testing.assert_close(got[2], want[2], rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("shape,brick,channels", CASES[:3], ids=str)
def test_float32(gen, shape, brick, channels):
    values, table = make_bricks(shape, brick, channels, gen)
    points = random_points(200, gen)
    want = cuda_ext.brick_grid_interpolate(values, table, points, list(shape), brick)
    got = cuda_ext.brick_grid_interpolate(values.float(), table, points.float(), list(shape), brick)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_entries_outside_the_pool_read_as_empty(gen):
    shape, brick = (11, 7, 9), 3
    values, table = make_bricks(shape, brick, 5, gen, fill=0.5)
    slots = values.shape[0] // brick**3
    junk = table.clone().flatten()
    empty = (junk < 0).nonzero().flatten()
    marks = torch.tensor([slots, slots + 1, 2**31 - 1, -(2**31), -1], dtype=torch.int32)
    junk[empty] = marks[torch.arange(empty.numel()) % 5]
    junk = junk.reshape(table.shape)
    grad_out = torch.randn(400, 5, generator=gen, dtype=F64)
    # all three results at smooth points; output and values gradient at any point
    for points, compared in ((smooth_points(400, shape, gen), 3), (random_points(400, gen), 2)):
        want = grads_of(dense_lookup(table, shape, brick), values, points, grad_out)
        for fn in IMPLEMENTATIONS.values():
            got = grads_of(lookup(fn, junk, shape, brick), values, points, grad_out)
            for a, b in zip(got[:compared], want[:compared]):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_scatter_with_many_points_and_bricks_sharing_a_slot(gen):
    # Many points per row across the CPU scatter's buckets; a table that maps several bricks to one slot adds
    # their gradients into the same rows, as the dense grid built from it says.
    shape, brick = (13, 11, 12), 3
    values, table = make_bricks(shape, brick, 6, gen, fill=0.4)
    slots = values.shape[0] // brick**3
    table = torch.where(table >= 0, table, torch.randint(0, slots, table.shape, generator=gen, dtype=torch.int32))
    points, grad_out = random_points(20000, gen, spread=1.1), torch.randn(20000, 6, generator=gen, dtype=F64)
    want = grads_of(dense_lookup(table, shape, brick), values, points, grad_out)
    got = grads_of(lookup(cuda_ext.brick_grid_interpolate, table, shape, brick), values, points, grad_out)
    for a, b in zip(got[:2], want[:2]):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


def test_empty_bricks_give_zeros_and_no_gradient(gen):
    shape, brick = (6, 5, 4), 2
    values, table = make_bricks(shape, brick, 3, gen)
    table = torch.full_like(table, -1)
    points, grad_out = random_points(50, gen), torch.randn(50, 3, generator=gen, dtype=F64)
    for fn in IMPLEMENTATIONS.values():
        out, grad_values, grad_points = grads_of(lookup(fn, table, shape, brick), values, points, grad_out)
        for t in (out, grad_values, grad_points):
            assert torch.equal(t, torch.zeros_like(t))


def test_nan_point_gives_nan_row_even_among_empty_bricks(gen):
    shape, brick = (9, 9, 9), 3
    values, table = make_bricks(shape, brick, 4, gen)
    table[0] = -1  # bricks along axis 0 index 0: all empty
    points = random_points(10, gen, spread=0.9)
    points[3, 1] = float("nan")
    points[7] = torch.tensor([float("nan"), -1.0, -1.0], dtype=F64)  # reads only the empty bricks at i0 = 0, 1
    want = dense_lookup(table, shape, brick)(values, points)
    for fn in IMPLEMENTATIONS.values():
        out = fn(values, table, points, list(shape), brick)
        assert out[3].isnan().all() and out[7].isnan().all() and torch.equal(out.isnan(), want.isnan())
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("shape,brick", [((4, 5, 3), 2), ((3, 1, 4), 3), ((5, 4, 4), 1)], ids=str)
def test_gradcheck(gen, shape, brick):
    values, table = make_bricks(shape, brick, 2, gen, fill=0.7)
    values.requires_grad_()
    points = smooth_points(7, shape, gen).requires_grad_()
    fn = lookup(cuda_ext.brick_grid_interpolate, table, shape, brick)
    assert torch.autograd.gradcheck(fn, (values, points))
    assert torch.autograd.gradcheck(fn, (values, points.detach()))
    assert torch.autograd.gradcheck(fn, (values.detach(), points))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_opcheck(gen, dtype):
    shape, brick = (5, 4, 6), 2
    values, table = make_bricks(shape, brick, 5, gen, dtype=dtype)
    points = smooth_points(9, shape, gen).to(dtype)
    op = OPS.brick_grid_interpolate.default
    torch.library.opcheck(op, (values.requires_grad_(), table, points.requires_grad_(), list(shape), brick))
    torch.library.opcheck(op, (values.detach(), table, points.detach(), list(shape), brick))
    grad_out = torch.randn(9, 5, generator=gen).to(dtype)
    for flags in [(True, True), (True, False), (False, True), (False, False)]:
        args = (grad_out, values.detach(), table, points.detach(), list(shape), brick, *flags)
        torch.library.opcheck(OPS.brick_grid_interpolate_backward.default, args)


def test_backward_op_returns_empty_for_unrequested_gradients(gen):
    values, table = make_bricks((5, 5, 5), 2, 2, gen)
    points, grad_out = random_points(8, gen), torch.randn(8, 2, generator=gen, dtype=F64)
    for flags, shapes in [((True, False), [tuple(values.shape), (0,)]), ((False, True), [(0,), (8, 3)])]:
        grads = OPS.brick_grid_interpolate_backward(grad_out, values, table, points, [5, 5, 5], 2, *flags)
        assert [tuple(t.shape) for t in grads] == shapes


def test_double_backward_raises(gen):
    values, table = make_bricks((5, 5, 5), 2, 2, gen)
    points = smooth_points(4, (5, 5, 5), gen).requires_grad_()
    out = cuda_ext.brick_grid_interpolate(values.requires_grad_(), table, points, [5, 5, 5], 2)
    with pytest.raises(RuntimeError, match="brick_grid_interpolate: double backward"):
        torch.autograd.grad(out.sum(), points, create_graph=True)


def test_non_contiguous_inputs_give_identical_results(gen):
    shape, brick = (7, 6, 8), 3
    values, table = make_bricks(shape, brick, 6, gen, dtype=torch.float32)
    points = random_points(40, gen, dtype=torch.float32)
    grad_out = torch.randn(6, 40, generator=gen).t()
    want = grads_of(lookup(cuda_ext.brick_grid_interpolate, table, shape, brick), values, points, grad_out.contiguous())
    values_nc, points_nc = values.t().contiguous().t(), torch.stack([points, -points], 2)[..., 0]
    table_nc = table.permute(2, 1, 0).contiguous().permute(2, 1, 0)
    assert not (values_nc.is_contiguous() or points_nc.is_contiguous() or table_nc.is_contiguous())
    got = grads_of(lookup(cuda_ext.brick_grid_interpolate, table_nc, shape, brick), values_nc, points_nc, grad_out)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n,channels,fill", [(0, 3, 0.5), (0, 0, 0.5), (5, 0, 0.5), (6, 3, 0.0)])
@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_empty_inputs(gen, name, n, channels, fill):
    shape, brick = (5, 4, 3), 2
    values, table = make_bricks(shape, brick, channels, gen)
    if fill == 0:  # a pool without bricks: every corner is empty
        values, table = values[:0], torch.full_like(table, -1)
    points = random_points(n, gen)
    out, grad_values, grad_points = grads_of(
        lookup(IMPLEMENTATIONS[name], table, shape, brick), values, points, torch.ones(n, channels, dtype=F64)
    )
    assert out.shape == (n, channels) and torch.equal(out, torch.zeros_like(out))
    assert torch.equal(grad_values, torch.zeros_like(values)) and torch.equal(grad_points, torch.zeros(n, 3, dtype=F64))


def _bad_calls():
    values, points = torch.rand(16, 2, dtype=F64) + 0.5, torch.rand(4, 3, dtype=F64)
    table = torch.zeros(3, 2, 3, dtype=torch.int32)
    ok = (values, table, points, [5, 4, 6], 2)  # a good call: 2 bricks of 2^3 rows, ceil((5, 4, 6) / 2) = (3, 2, 3)

    def call(index, value):
        return tuple(value if i == index else a for i, a in enumerate(ok))

    def both(dtype):  # values and points of one dtype the kernels do not take
        return (values.to(dtype), table, points.to(dtype), *ok[3:])

    return [  # (id, args, error, match, the raw op rejects it in its C++ checks (not the dispatcher's parsing))
        ("table-int64", call(1, table.long()), TypeError, "table must be int32, got", True),
        ("table-float", call(1, table.double()), TypeError, "table must be int32", True),
        (
            "table-shape",
            call(1, table[:, :1]),
            ValueError,
            r"table must have shape ceil\(shape / brick\) = \(3, 2, 3\)",
            True,
        ),
        ("table-2d", call(1, table[0]), ValueError, r"table must have shape ceil\(shape / brick\)", True),
        ("M-not-whole-bricks", call(0, values[:12]), ValueError, "values must hold whole bricks: M = 12", True),
        ("values-1d", call(0, values[:, 0]), ValueError, r"values must have shape \(M, C\)", True),
        ("points-columns", call(2, points[:, :2]), ValueError, r"points must have shape \(N, 3\)", True),
        ("shape-length", call(3, [5, 4]), ValueError, r"shape must list 3 vertex counts \(V0, V1, V2\)", True),
        ("shape-zero", call(3, [5, 0, 6]), ValueError, r"shape\[1\] must be a vertex count", True),
        ("shape-float", call(3, [5.0, 4, 6]), TypeError, r"shape\[0\] must be an integer", False),
        ("shape-int", call(3, 5), TypeError, "shape must be a list of 3 ints", False),
        ("brick-zero", call(4, 0), ValueError, r"brick must be in \[1, 1024\], got 0", True),
        ("brick-huge", call(4, 2000), ValueError, r"brick must be in \[1, 1024\], got 2000", True),
        ("brick-float", call(4, 2.0), TypeError, "brick must be an integer", False),
        ("mixed-dtypes", call(2, points.float()), TypeError, "points and values must have the same dtype", True),
        ("int-values", both(torch.int32), TypeError, "values must be float32 or float64", True),
        ("half-on-cpu", both(torch.half), TypeError, "values must be float32 or float64 on the CPU", True),
        ("table-device", call(1, table.to("meta")), ValueError, "table and values must be on the same device", False),
    ]


@pytest.mark.parametrize("case", _bad_calls(), ids=lambda c: c[0])
def test_bad_inputs_raise_naming_the_argument(case):
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, args, error, match, checked_in_cpp = case
    for fn in IMPLEMENTATIONS.values():
        with pytest.raises(error, match="brick_grid_interpolate: " + match) as info:
            fn(*args)
        assert type(info.value) is error
    if not checked_in_cpp:
        return
    with pytest.raises(RuntimeError, match=match):
        OPS.brick_grid_interpolate(*args)
    mode = FakeTensorMode()
    fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode, pytest.raises(error, match=match):
        OPS.brick_grid_interpolate(*fake_args)
    grad_out = torch.ones(args[2].shape[0], args[0].shape[-1], dtype=args[0].dtype)
    with pytest.raises(RuntimeError, match=match):
        OPS.brick_grid_interpolate_backward(grad_out, *args, True, True)


@pytest.mark.parametrize(
    "grad_out,message",
    [
        (torch.ones(4, 3, dtype=F64), r"grad_out must have shape \(4, 2\)"),
        (torch.ones(4, 2, dtype=torch.float32), "grad_out and values must have the same dtype"),
    ],
)
def test_bad_grad_out_raises(gen, grad_out, message):
    values, table = make_bricks((5, 4, 6), 2, 2, gen)
    for backward in (OPS.brick_grid_interpolate_backward, cuda_ext.brick_grid._brick_grid_backward_fake):
        with pytest.raises((RuntimeError, ValueError, TypeError), match=message):
            backward(grad_out, values, table, random_points(4, gen), [5, 4, 6], 2, True, True)


# ----------------------------------------------------------------------------------------------- CUDA

# C = 4, 8, 12, 24: the 4-channel vector path (lane groups of 1, 2, 3 and 4 with a channel loop); 1, 3, 5 scalar.
CUDA_CASES = CASES + [((20, 13, 11), 8, 4), ((9, 10, 7), 3, 8), ((6, 7, 5), 2, 24), ((8, 6, 7), 3, 5)]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("shape,brick,channels", CUDA_CASES, ids=str)
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-11), (torch.float32, 1e-4)])
def test_cuda_matches_the_dense_grid(gen, poison_cuda_cache, shape, brick, channels, dtype, tol):
    values, table = make_bricks(shape, brick, channels, gen)
    n = 2003  # a partial last warp for every lane group
    for points in (random_points(n, gen), smooth_points(n, shape, gen)):
        grad_out = torch.randn(n, channels, generator=gen, dtype=F64)
        want = grads_of(dense_lookup(table, shape, brick), values, points, grad_out)
        poison_cuda_cache()
        cuda = [t.to("cuda", dtype) for t in (values, points, grad_out)]
        got = grads_of(lookup(cuda_ext.brick_grid_interpolate, table.cuda(), shape, brick), *cuda)
        assert all(t.dtype == dtype for t in got)
        torch.testing.assert_close(got[0].cpu().double(), want[0], rtol=tol, atol=tol)
        torch.testing.assert_close(got[1].cpu().double(), want[1], rtol=tol, atol=tol * 10)  # atomics: order varies
    torch.testing.assert_close(got[2].cpu().double(), want[2], rtol=tol, atol=tol * max(shape))  # smooth points
    ref = reference.brick_grid_interpolate(cuda[0], table.cuda(), cuda[1], list(shape), brick)
    torch.testing.assert_close(ref.cpu().double(), want[0], rtol=tol, atol=tol)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("flags", [(True, False), (False, True)])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-2), (torch.bfloat16, 1e-1)])
@pytest.mark.parametrize("channels", [3, 12])
def test_cuda_reduced_precision(gen, poison_cuda_cache, flags, dtype, tol, channels):
    shape, brick = (17, 12, 10), 4
    values, table = make_bricks(shape, brick, channels, gen)
    points, grad_out = smooth_points(3000, shape, gen), torch.randn(3000, channels, generator=gen, dtype=F64)
    want = grads_of(dense_lookup(table, shape, brick), values, points, grad_out)
    cuda = [t.to("cuda", dtype) for t in (grad_out, values)] + [table.cuda(), points.to("cuda", dtype)]
    poison_cuda_cache()
    out = cuda_ext.brick_grid_interpolate(cuda[1], cuda[2], cuda[3], list(shape), brick)
    torch.testing.assert_close(out.cpu().double(), want[0], rtol=tol, atol=tol)
    grads = OPS.brick_grid_interpolate_backward(*cuda[:3], cuda[3], list(shape), brick, *flags)
    for requested, got, expected, atol in zip(flags, grads, want[1:], (tol * 4, tol * 10 * channels**0.5)):
        assert got.shape == (expected.shape if requested else (0,))
        if requested:
            assert got.dtype == dtype
            torch.testing.assert_close(got.cpu().double(), expected, rtol=tol, atol=atol)


@pytest.mark.requires_cuda
def test_cuda_misaligned_inputs_agree_with_cpu(gen):
    shape, brick = (12, 10, 9), 4
    values, table = make_bricks(shape, brick, 8, gen, dtype=torch.float32)
    points, grad_out = random_points(700, gen, dtype=torch.float32), torch.randn(700, 8, generator=gen)
    want = grads_of(lookup(cuda_ext.brick_grid_interpolate, table, shape, brick), values, points, grad_out)
    cuda = (_misaligned(values.cuda()), _misaligned(points.cuda()), _misaligned(grad_out.cuda()))
    got = grads_of(lookup(cuda_ext.brick_grid_interpolate, table.cuda(), shape, brick), *cuda)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.requires_cuda
def test_cuda_gradcheck_opcheck_devices_and_nan(gen):
    shape, brick = (4, 5, 3), 2
    values, table = make_bricks(shape, brick, 3, gen)
    values, table = values.cuda().requires_grad_(), table.cuda()
    points = smooth_points(9, shape, gen).cuda().requires_grad_()
    assert torch.autograd.gradcheck(lookup(cuda_ext.brick_grid_interpolate, table, shape, brick), (values, points))
    torch.library.opcheck(OPS.brick_grid_interpolate.default, (values, table, points, list(shape), brick))
    values, points = values.detach(), points.detach()
    for args, message in [
        ((values, table.cpu(), points), "table and values must be on the same device"),
        ((values, table, points.cpu()), "points and values must be on the same device"),
    ]:
        for fn in IMPLEMENTATIONS.values():
            with pytest.raises(ValueError, match=message):
                fn(*args, list(shape), brick)
    with pytest.raises(RuntimeError, match="values must be a CUDA tensor"):
        OPS.brick_grid_interpolate(values.cpu(), table, points, list(shape), brick)
    points[5, 2] = float("nan")
    out = cuda_ext.brick_grid_interpolate(values, table, points, list(shape), brick)
    torch.cuda.synchronize()  # an out-of-bounds read would surface here
    assert out[5].isnan().all() and torch.isfinite(out[torch.arange(9) != 5]).all()
