"""cuda_ext.sampled_tv: the total variation on sampled cells, its gradient added in place. Kernels vs the reference
and vs a loop over the definition in float64, the gradient against finite differences (gradcheck), rows no cell
reads never written (poisoned gradients), CUDA, opcheck, bad input. Its use in training: tests/test_grid_tv.py."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference

requires_cuda = pytest.mark.requires_cuda
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
FNS = [cuda_ext.sampled_tv, reference.sampled_tv]
SHAPE = (6, 7, 5)
INSIDE = ((1, 4), (2, 5), (0, 3))


def case(grids=2, channels=3, samples=200, dtype=torch.float64, device="cpu", seed=0):
    """(grad, values, cells): random values and a random (never zero) gradient to add to; cells with repeats."""
    generator = torch.Generator().manual_seed(seed)
    rows = grids * SHAPE[0] * SHAPE[1] * SHAPE[2]
    values = torch.randn(rows, channels, generator=generator, dtype=torch.float64)
    grad = torch.randn(rows, channels, generator=generator, dtype=torch.float64)
    count = grids * (SHAPE[0] - 1) * (SHAPE[1] - 1) * (SHAPE[2] - 1)
    cells = torch.randint(count, (samples,), generator=generator)
    cells[-3:] = cells[:3]  # the same cell twice: its gradient counts twice
    return grad.to(dtype=dtype, device=device), values.to(dtype=dtype, device=device), cells.to(device)


def by_definition(values, cells, inside, outside, scale):
    """The estimate and its gradient, one cell and one pair at a time (float64, Python loops)."""
    r0, r1, r2 = SHAPE
    grad = torch.zeros(values.shape, dtype=torch.float64)  # on the CPU, as the loops run
    x = values.double().cpu()
    total = 0.0
    per = (r0 - 1) * (r1 - 1) * (r2 - 1)
    k = scale / (len(cells) * values.shape[1])
    for cell in cells.tolist():
        g, rest = divmod(cell, per)
        v = (rest // ((r1 - 1) * (r2 - 1)), rest // (r2 - 1) % (r1 - 1), rest % (r2 - 1))
        row = lambda p, g=g: ((g * r0 + p[0]) * r1 + p[1]) * r2 + p[2]  # noqa: E731
        inside_box = lambda p: inside is None or all(lo <= q <= hi for q, (lo, hi) in zip(p, inside))  # noqa: E731
        for a in range(3):
            far = tuple(q + (b == a) for b, q in enumerate(v))
            weight = 1.0 if inside_box(v) and inside_box(far) else outside
            d = x[row(far)] - x[row(v)]
            total += k * weight * float((d * d).sum())
            grad[row(far)] += 2 * k * weight * d
            grad[row(v)] -= 2 * k * weight * d
    return total, grad


# ------------------------------------------------------------------------------------------- what it computes


@pytest.mark.parametrize("fn", FNS, ids=["op", "reference"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inside", [None, INSIDE], ids=["plain", "box"])
def test_value_and_gradient_follow_the_definition(fn, device, inside):
    grad, values, cells = case(device=device)
    before = grad.clone()
    value = fn(grad, values, cells, SHAPE, inside, 4.0, 0.3)
    want_value, want_grad = by_definition(values, cells, inside, 4.0, 0.3)
    assert value.dtype == torch.float64 and value.shape == () and value.device == values.device
    torch.testing.assert_close(value.item(), want_value, rtol=1e-12, atol=0)
    torch.testing.assert_close((grad - before).cpu(), want_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inside", [None, INSIDE], ids=["plain", "box"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_op_matches_the_reference(device, inside, dtype):
    grad, values, cells = case(grids=3, channels=12, samples=5000, dtype=dtype, device=device, seed=1)
    mine, theirs = grad.clone(), grad.clone()
    got = cuda_ext.sampled_tv(mine, values, cells, SHAPE, inside, 10.0, 1e-3)
    want = reference.sampled_tv(theirs, values, cells, SHAPE, inside, 10.0, 1e-3)
    tol = dict(rtol=1e-12, atol=1e-15) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(mine, theirs, **tol)


@pytest.mark.parametrize("fn", FNS, ids=["op", "reference"])
@pytest.mark.parametrize("device", DEVICES)
def test_rows_no_cell_reads_are_never_written(fn, device):
    """Only the sampled cells' corner rows and their +1 neighbours change; every other row stays bit for bit."""
    grad, values, cells = case(device=device, samples=20)
    before = grad.clone()
    r0, r1, r2 = SHAPE
    per = (r0 - 1) * (r1 - 1) * (r2 - 1)
    g, rest = cells // per, cells % per
    corner = ((g * r0 + rest // ((r1 - 1) * (r2 - 1))) * r1 + rest // (r2 - 1) % (r1 - 1)) * r2 + rest % (r2 - 1)
    read = torch.zeros(values.shape[0], dtype=torch.bool, device=device)
    for offset in (0, r1 * r2, r2, 1):
        read[corner + offset] = True
    fn(grad, values, cells, SHAPE, INSIDE, 2.0, 1.0)
    assert torch.equal(grad[~read], before[~read])
    assert (grad[read] != before[read]).all()  # random values: every read element gets a non-zero gradient


@pytest.mark.parametrize("fn", FNS, ids=["op", "reference"])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inside", [None, INSIDE], ids=["plain", "box"])
def test_gradient_passes_gradcheck(fn, device, inside):
    """The added gradient is the estimate's derivative: finite differences of the value agree with it."""
    _, values, cells = case(grids=1, channels=2, samples=30, device=device, seed=2)

    class TV(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return fn(torch.zeros_like(x), x.contiguous(), cells, SHAPE, inside, 3.0, 0.5)

        @staticmethod
        def backward(ctx, grad_out):
            (x,) = ctx.saved_tensors
            gradient = torch.zeros_like(x)
            fn(gradient, x.detach().contiguous(), cells, SHAPE, inside, 3.0, 0.5)
            return gradient * grad_out

    nondet_tol = 1e-12 if device == "cuda" else 0.0  # CUDA adds shared rows with atomics: in any order
    assert torch.autograd.gradcheck(TV.apply, (values.clone().requires_grad_(True),), nondet_tol=nondet_tol)


@pytest.mark.parametrize("fn", FNS, ids=["op", "reference"])
def test_no_cells_is_zero_and_writes_nothing(fn):
    grad, values, _ = case()
    before = grad.clone()
    value = fn(grad, values, torch.zeros(0, dtype=torch.int64), SHAPE)
    assert value.item() == 0.0 and torch.equal(grad, before)


# ------------------------------------------------------------------------------------------------ opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_opcheck(device, dtype):
    grad, values, cells = case(dtype=dtype, device=device)
    for inside in ([], [1, 4, 2, 5, 0, 3]):
        args = (grad, values, cells, list(SHAPE), inside, 2.0, 0.5)
        torch.library.opcheck(torch.ops.cuda_ext.sampled_tv.default, args)


# ------------------------------------------------------------------------------------------------ bad input


def bad_calls():
    grad, values, cells = case()
    f32 = values.float()
    return [
        ((grad, values[:, :1].expand(-1, 3), cells, SHAPE), ValueError, "values must be contiguous"),
        ((grad, values.reshape(-1), cells, SHAPE), ValueError, "values must have shape"),
        ((grad.int(), values.int(), cells, SHAPE), TypeError, "values must be float32 or float64"),
        ((grad[:-1], values, cells, SHAPE), ValueError, "grad must have the shape of values"),
        ((grad, f32, cells, SHAPE), TypeError, "grad and values must have the same dtype"),
        ((grad.t().contiguous().t(), values, cells, SHAPE), ValueError, "grad must be contiguous"),
        ((grad, values, cells.int(), SHAPE), TypeError, "cells must be int64"),
        ((grad, values, cells[None], SHAPE), ValueError, "cells must have shape"),
        ((grad, values, cells, (6, 7)), ValueError, "shape must be"),
        ((grad, values, cells, (6, 7, 1)), ValueError, "at least 2 per axis"),
        ((grad, values, cells, (5, 7, 5)), ValueError, "whole number of grids"),
        ((grad, values, cells, SHAPE, ((1, 2),)), ValueError, "inside must be"),
        ((grad, values, cells, SHAPE, None, -1.0), ValueError, "outside must be a number >= 0"),
        ((grad, values, cells, SHAPE, None, 1.0, float("nan")), ValueError, "scale must be a finite number"),
        ((grad, values, cells, SHAPE, None, "1"), TypeError, "outside must be a number"),
        ((grad, values, cells + 10**6, SHAPE), ValueError, "cells must lie in"),
        ((grad, values, cells - 10**6, SHAPE), ValueError, "cells must lie in"),
    ]


@pytest.mark.parametrize("fn", FNS, ids=["op", "reference"])
def test_bad_input_names_the_argument(fn):
    for args, error, message in bad_calls():
        before = args[0].clone()
        with pytest.raises(error, match=message):
            fn(*args)
        assert torch.equal(args[0], before)  # nothing added before the error


def test_kernel_backstop_checks_the_range_before_writing():
    """A direct torch.ops call (no wrapper) with a cell out of range raises and adds nothing."""
    grad, values, cells = case()
    before = grad.clone()
    cells[5] = 10**6
    with pytest.raises(RuntimeError, match="cells must lie in"):
        torch.ops.cuda_ext.sampled_tv(grad, values, cells, list(SHAPE), [], 1.0, 1.0)
    assert torch.equal(grad, before)


@requires_cuda
def test_cuda_rejects_a_cpu_argument():
    grad, values, cells = case(device="cuda")
    with pytest.raises(ValueError, match="cells and values must be on the same device"):
        cuda_ext.sampled_tv(grad, values, cells.cpu(), SHAPE)
    with pytest.raises(ValueError, match="grad and values must be on the same device"):
        cuda_ext.sampled_tv(grad.cpu(), values, cells, SHAPE)
