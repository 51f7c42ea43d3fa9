"""Gradients kept between training steps (cuda_ext.kept_grad): the lookups' backward adding onto a given tensor
(``grad_into``), ``masked_adam_step(clear_grad=True)`` leaving the gradient zero, and SparseGridAdam's nonzero mode
reusing one gradient tensor per grid across steps with the same result as fresh zero-filled gradients.

Buffers start random (never zero), so an add that overwrites instead of adding, or a gradient that is not cleared,
cannot pass as a zero."""

from __future__ import annotations

import pytest
import torch
from test_brick_grid import make_bricks
from test_grid_interpolate import random_points

import cuda_ext
from cuda_ext import reference
from cuda_ext.kept_grad import grad_target, keep_grad
from training.optim import SparseGridAdam

OPS = torch.ops.cuda_ext
F64 = torch.float64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]
HYPER = (0.01, 0.9, 0.99, 1e-8)  # lr, beta1, beta2, eps
BRICK_CASE = ((10, 3, 17), 8, 12)  # (V0, V1, V2), brick, C


def grid_case(gen, device, dtype=F64, n=777):
    """(grid (6, 5, 7, 12), points (n, 3), grad_out (n, 12)), random and never zero."""
    grid = torch.randn(6, 5, 7, 12, generator=gen, dtype=F64)
    grad_out = torch.randn(n, 12, generator=gen, dtype=F64)
    return grid.to(device, dtype), random_points(n, gen, device=device, dtype=dtype), grad_out.to(device, dtype)


def brick_case(gen, device, dtype=F64, n=777):
    """(values (M, C), table, points (n, 3), grad_out (n, C), shape, brick)."""
    shape, brick, channels = BRICK_CASE
    values, table = make_bricks(shape, brick, channels, gen, dtype=F64)
    grad_out = torch.randn(n, channels, generator=gen, dtype=F64)
    points = random_points(n, gen, device=device, dtype=dtype)
    return values.to(device, dtype), table.to(device), points, grad_out.to(device, dtype), list(shape), brick


def backward_calls(gen, device, dtype=F64):
    """(name, values, fn(grad_into, points_requires_grad) -> the op's two outputs) for both lookups."""
    grid, points, grad_out = grid_case(gen, device, dtype)
    values, table, b_points, b_grad_out, shape, brick = brick_case(gen, device, dtype)
    return [
        ("grid", grid, lambda into, pg: OPS.grid_interpolate_backward(grad_out, grid, points, True, pg, into)),
        (
            "brick",
            values,
            lambda into, pg: OPS.brick_grid_interpolate_backward(
                b_grad_out, values, table, b_points, shape, brick, True, pg, into
            ),
        ),
    ]


# -------------------------------------------------------------------------------- the backward's grad_into


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(F64, 1e-12), (torch.float32, 1e-5)])
def test_backward_adds_onto_grad_into(gen, device, dtype, tol):
    for name, values, call in backward_calls(gen, device, dtype):
        fresh, fresh_points = call(None, True)
        start = torch.randn(values.shape, generator=gen, dtype=F64).to(device, dtype)
        into = start.clone()
        got, got_points = call(into, True)
        assert got.shape == (0,), name  # the values' gradient went into grad_into
        torch.testing.assert_close(into, start + fresh, rtol=tol, atol=tol, msg=name)
        torch.testing.assert_close(got_points, fresh_points, rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_into_misaligned_buffer_agrees(gen, device):
    """A grad_into one element past an aligned boundary takes the narrow (element-wise atomic) path."""
    for name, values, call in backward_calls(gen, device, torch.float32):
        fresh = call(None, False)[0]
        buffer = torch.zeros(values.numel() + 1, device=device)
        into = buffer[1:].view(values.shape)
        call(into, False)
        torch.testing.assert_close(into, fresh, rtol=1e-5, atol=1e-5, msg=name)
        assert buffer[0] == 0, name


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_grad_into(gen, device):
    grid, points, grad_out = grid_case(gen, device, n=50)
    args = (grad_out, grid, points, True, True, torch.randn_like(grid))
    torch.library.opcheck(OPS.grid_interpolate_backward.default, args)
    values, table, b_points, b_grad_out, shape, brick = brick_case(gen, device, n=50)
    args = (b_grad_out, values, table, b_points, shape, brick, True, False, torch.randn_like(values))
    torch.library.opcheck(OPS.brick_grid_interpolate_backward.default, args)


BAD_INTO = [
    ("shape", lambda v: torch.zeros(v.shape[0] + 1, *v.shape[1:], dtype=v.dtype), "grad_into must have the shape"),
    ("dtype", lambda v: torch.zeros(v.shape, dtype=torch.float32), "must have the same dtype"),
    ("strided", lambda v: torch.zeros(*v.shape[:-1], 2 * v.shape[-1], dtype=v.dtype)[..., ::2], "contiguous"),
]


@pytest.mark.parametrize("what,make,message", BAD_INTO, ids=[b[0] for b in BAD_INTO])
def test_bad_grad_into_names_the_argument(gen, what, make, message):
    """The fake kernels (what opcheck and torch.compile trace) and the C++ backstop say the same."""
    for _, values, call in backward_calls(gen, "cpu"):
        with pytest.raises(RuntimeError, match=message):  # the C++ backstop (a direct torch.ops call)
            call(make(values), True)
    grid, points, grad_out = grid_case(gen, "cpu", n=20)
    with pytest.raises((ValueError, TypeError), match=message), torch._subclasses.FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (grad_out, grid, points, make(grid))]
        OPS.grid_interpolate_backward(fake[0], fake[1], fake[2], True, True, fake[3])


def test_grad_into_without_the_values_gradient_is_refused(gen):
    grid, points, grad_out = grid_case(gen, "cpu", n=20)
    with pytest.raises(RuntimeError, match="grid_requires_grad must be true"):
        OPS.grid_interpolate_backward(grad_out, grid, points, False, True, torch.zeros_like(grid))


# ------------------------------------------------------------------------------ autograd through a kept .grad


@pytest.mark.parametrize("device", DEVICES)
def test_a_kept_grad_is_added_onto_in_place(gen, device):
    grid, points, grad_out = grid_case(gen, device)
    values, table, b_points, b_grad_out, shape, brick = brick_case(gen, device)
    kept = [torch.nn.Parameter(grid.clone()), torch.nn.Parameter(values.clone())]
    plain = [torch.nn.Parameter(grid.clone()), torch.nn.Parameter(values.clone())]

    def backward(params):
        grid_part = (cuda_ext.grid_interpolate(params[0], points) * grad_out).sum()
        brick_part = (cuda_ext.brick_grid_interpolate(params[1], table, b_points, shape, brick) * b_grad_out).sum()
        (grid_part + brick_part).backward()

    for param in kept:
        keep_grad(param)
    backward(kept)  # no .grad yet: fresh gradients, as without the mark
    backward(plain)
    buffers = [param.grad for param in kept]
    for _ in range(2):
        backward(kept)
        backward(plain)
        for param, other, buffer in zip(kept, plain, buffers):
            assert param.grad is buffer  # the same tensor, added onto: no new gradient
            torch.testing.assert_close(param.grad, other.grad, rtol=1e-12, atol=1e-12)


def test_grad_target_only_for_a_usable_kept_grad():
    param = torch.nn.Parameter(torch.randn(4, 3, dtype=F64))
    assert grad_target(param) is None  # not kept
    keep_grad(param)
    assert grad_target(param) is None  # kept, no .grad yet
    param.grad = torch.zeros(4, 3, dtype=F64)
    assert grad_target(param) is param.grad
    param.grad = torch.zeros(3, 4, dtype=F64).t()
    assert grad_target(param) is None  # not contiguous
    half = torch.nn.Parameter(torch.randn(4, 3).half())
    keep_grad(half)
    half.grad = torch.zeros(4, 3).half()
    assert grad_target(half) is None  # the atomics add in float32/float64 only
    with pytest.raises(ValueError, match="leaf"):
        keep_grad(param * 2)


# ------------------------------------------------------------------------------- masked_adam_step(clear_grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step_fn", [cuda_ext.masked_adam_step, reference.masked_adam_step], ids=["op", "reference"])
def test_clear_grad_leaves_zero_and_steps_the_same(gen, device, step_fn):
    m, c = 300, 13
    param = torch.randn(m, c, generator=gen, dtype=F64).to(device)
    grad = torch.randn(m, c, generator=gen, dtype=F64).to(device)
    grad[torch.rand(m, generator=gen) < 0.6] = 0  # rows no ray reached
    moments = [torch.rand(m, c, generator=gen, dtype=F64).to(device) * s for s in (0.01, 0.001)]
    want = [param.clone(), *(x.clone() for x in moments)]
    step_fn(want[0], grad.clone(), want[1], want[2], 3, *HYPER)
    got = [param.clone(), *(x.clone() for x in moments)]
    cleared = grad.clone()
    step_fn(got[0], cleared, got[1], got[2], 3, *HYPER, clear_grad=True)
    assert bool((cleared == 0).all())
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_clear_grad(gen, device):
    param, grad, m, v = (torch.randn(64, 12, generator=gen, dtype=F64).to(device) for _ in range(4))
    args = (param, grad, m, v.abs(), 2, *HYPER, True)
    torch.library.opcheck(OPS.masked_adam_step.default, args)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("channels", [1, 13])
@pytest.mark.parametrize("offset", [0, 1, 3])  # 16-byte packs, and the narrow ones of a misaligned view
def test_cuda_clear_whole_sectors_writes_nothing_past_the_tensor(gen, dtype, channels, offset):
    """Few, isolated non-zero elements, so most live packs have zero sector-mates, which the CUDA kernel clears too:
    the gradient must end zero, the step be exactly the one without the clear, and the random guard elements on
    both sides of the view (the same storage) be untouched. The row count leaves a tail of every pack and warp."""
    rows, guard = 40_009, 37
    size = rows * channels
    storage = torch.randn(offset + size + guard, generator=gen, dtype=dtype).cuda()
    grad = storage[offset : offset + size].view(rows, channels)
    grad.mul_((torch.rand(rows, channels, generator=gen) < 0.01).to(grad))
    assert 0 < int(grad.ne(0).sum()) < size // 50
    param, exp_avg, exp_avg_sq = (torch.randn(rows, channels, generator=gen, dtype=dtype).cuda() for _ in range(3))
    exp_avg_sq.abs_()
    want = [x.clone() for x in (param, exp_avg, exp_avg_sq)]
    cuda_ext.masked_adam_step(want[0], grad.clone(), want[1], want[2], 2, *HYPER)
    before = storage.clone()
    cuda_ext.masked_adam_step(param, grad, exp_avg, exp_avg_sq, 2, *HYPER, clear_grad=True)
    assert bool((grad == 0).all())
    assert torch.equal(storage[:offset], before[:offset]) and torch.equal(storage[-guard:], before[-guard:])
    for got, w in zip((param, exp_avg, exp_avg_sq), want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("channels", [1, 12, 13])  # a float per row, 16-byte packs, single elements
@pytest.mark.parametrize("step_fn", [cuda_ext.sparse_adam_step, reference.sparse_adam_step], ids=["op", "reference"])
def test_sparse_adam_clear_grad_zeroes_the_listed_rows_only(gen, device, dtype, channels, step_fn):
    """Random gradient on every row: the listed rows end zero, every other row keeps its gradient bit for bit, and
    param and moments are exactly the step without the clear."""
    m = 2000
    param, grad, exp_avg = (torch.randn(m, channels, generator=gen, dtype=dtype).to(device) for _ in range(3))
    exp_avg_sq = torch.rand(m, channels, generator=gen, dtype=dtype).to(device)
    rows = torch.randperm(m, generator=gen)[: m // 3].to(device)
    want = [x.clone() for x in (param, exp_avg, exp_avg_sq)]
    step_fn(want[0], grad.clone(), want[1], want[2], rows, 3, *HYPER)
    cleared = grad.clone()
    step_fn(param, cleared, exp_avg, exp_avg_sq, rows, 3, *HYPER, clear_grad=True)
    listed = torch.zeros(m, dtype=torch.bool, device=device)
    listed[rows] = True
    assert bool((cleared[listed] == 0).all()) and torch.equal(cleared[~listed], grad[~listed])
    for got, w in zip((param, exp_avg, exp_avg_sq), want):
        assert torch.equal(got, w)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_sparse_adam_clear_grad(gen, device):
    param, grad, m, v = (torch.randn(64, 12, generator=gen, dtype=F64).to(device) for _ in range(4))
    rows = torch.randperm(64, generator=gen)[:20].to(device)
    torch.library.opcheck(OPS.sparse_adam_step.default, (param, grad, m, v.abs(), rows, 2, *HYPER, True))


def test_clear_grad_must_be_a_bool(gen):
    param, grad, m, v = (torch.randn(8, 3, generator=gen, dtype=F64) for _ in range(4))
    with pytest.raises(TypeError, match="masked_adam_step: clear_grad"):
        cuda_ext.masked_adam_step(param, grad, m, v.abs(), 1, *HYPER, clear_grad=1)
    rows = torch.arange(3)
    with pytest.raises(TypeError, match="sparse_adam_step: clear_grad"):
        cuda_ext.sparse_adam_step(param, grad, m, v.abs(), rows, 1, *HYPER, clear_grad="yes")


# ----------------------------------------------------------------------------------------- the optimiser


def train_grids(gen, device, kept: bool, steps: int = 5):
    """A dense grid and a brick pool stepped by SparseGridAdam's nonzero mode on lookups at random points;
    ``kept=False`` unmarks them (fresh gradients each step). Returns (params, the grids' .grad ids per step)."""
    grid, _, _ = grid_case(gen, device)
    values, table, _, _, shape, brick = brick_case(gen, device)
    scale = torch.randn(5, generator=gen, dtype=F64).to(device)
    params = [torch.nn.Parameter(grid), torch.nn.Parameter(values), torch.nn.Parameter(scale)]
    groups = [
        {"params": [params[0]], "name": "grids"},
        {"params": [params[1]], "name": "fine"},
        {"params": [params[2]], "name": "decoder"},
    ]
    optimizer = SparseGridAdam(groups, cuda_ext.sparse_adam_step, lr=0.05, masked_fn=cuda_ext.masked_adam_step)
    if not kept:
        for param in params[:2]:
            keep_grad(param, False)
    draws = torch.Generator().manual_seed(7)
    ids = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        points = (torch.rand(300, 3, generator=draws, dtype=F64) * 1.2 - 0.6).to(device)  # a part of the grid
        target = torch.randn(300, 12, generator=draws, dtype=F64).to(device)
        looked = cuda_ext.grid_interpolate(params[0], points) + cuda_ext.brick_grid_interpolate(
            params[1], table, points, shape, brick
        )
        ((looked * params[2].sum() - target) ** 2).mean().backward()
        ids.append([param.grad.data_ptr() for param in params[:2]])
        optimizer.step()
    return params, ids


@pytest.mark.parametrize("device", DEVICES)
def test_nonzero_adam_keeps_one_gradient_and_trains_the_same(device):
    kept, kept_ids = train_grids(torch.Generator().manual_seed(0), device, kept=True)
    fresh, _ = train_grids(torch.Generator().manual_seed(0), device, kept=False)
    for a, b in zip(kept, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)  # float64: the same sums (atomics' order on CUDA)
    assert all(ids == kept_ids[0] for ids in kept_ids)  # one gradient tensor per grid, reused every step
    assert all(bool((param.grad == 0).all()) for param in kept[:2])  # left zero after the last step


def test_zero_grad_drops_a_gradient_no_step_cleared(gen):
    """A backward without the step that clears (e.g. a skipped step) must not leave its sum for the next one."""
    param = torch.nn.Parameter(torch.randn(4, 4, 4, 3, generator=gen, dtype=F64))
    optimizer = SparseGridAdam([{"params": [param], "name": "grids"}], cuda_ext.sparse_adam_step,
                               masked_fn=cuda_ext.masked_adam_step)  # fmt: skip
    points = random_points(40, gen)
    cuda_ext.grid_interpolate(param, points).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    kept = param.grad
    assert kept is not None and bool((kept == 0).all())  # kept, zero
    cuda_ext.grid_interpolate(param, points).sum().backward()  # no step after this one
    optimizer.zero_grad()
    assert param.grad is None
