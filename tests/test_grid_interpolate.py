"""cuda_ext.grid_interpolate (fused dense-grid lookup) against cuda_ext.reference.

The CPU kernels and the op's contract (the CUDA kernels: tests/test_grid_interpolate_cuda.py; the helpers here
serve both). Gradients with respect to points are compared only where the lookup is smooth: away from voxel
boundaries and from the clamp edges (p = 0 or R-1), where the derivative has a jump.
"""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference

OPS = torch.ops.cuda_ext
# (R0, R1, R2, C): axes of size 1 and 2, C % 4 != 0 included.
GRIDS = [(1, 1, 1, 1), (2, 3, 4, 3), (1, 5, 3, 4), (4, 1, 6, 2), (6, 5, 1, 12), (7, 6, 5, 5), (9, 4, 5, 16)]


def random_points(n: int, gen: torch.Generator, spread: float = 1.3, dtype=torch.float64, device="cpu"):
    """(n, 3) points in [-spread, spread]^3 (outside [-1, 1] too), some coordinates exactly -1, 0 or 1."""
    points = (torch.rand(n, 3, generator=gen, dtype=torch.float64) * 2 - 1) * spread
    if n >= 6:
        points[0::6, 0], points[1::6, 1], points[2::6, 2] = 1.0, -1.0, 1.0
        points[3::6, 0], points[4::6, 1], points[5::6, 2] = -1.0, 0.0, 1.0
    return points.to(device, dtype)


def smooth_points(n: int, sizes, gen: torch.Generator) -> torch.Tensor:
    """(n, 3) float64 points whose coordinates all sit in the middle of a voxel cell (fraction in [0.2, 0.8])
    or well outside the grid, so the lookup is differentiable there."""
    columns = []
    for size in sizes:
        if size == 1:  # constant along this axis: any coordinate is smooth
            columns.append(torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1)
            continue
        cell = torch.randint(0, size - 1, (n,), generator=gen).double()
        frac = 0.2 + 0.6 * torch.rand(n, generator=gen, dtype=torch.float64)
        x = (cell + frac) / (size - 1) * 2 - 1
        outside = torch.rand(n, generator=gen) < 0.15
        x[outside] = torch.sign(x[outside]) * (1.2 + 0.3 * torch.rand(int(outside.sum()), generator=gen).double())
        columns.append(x)
    return torch.stack(columns, dim=1)


def cell_run_points(n: int, sizes, gen: torch.Generator) -> torch.Tensor:
    """(n, 3) float64 points in runs of consecutive points inside one cell, as a ray sampler makes them
    (several samples per voxel). Run lengths 1..40: shorter than, equal to and longer than a warp's 8
    points, crossing warp boundaries; one run in 8 lies outside the grid along an axis (all its points
    clamp to the same border cell). Fractions stay in [0.05, 0.95], so the lookup is smooth there."""
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(torch.randint(1, 41, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - n
    runs = len(lengths)
    columns = []
    for size in sizes:
        cell = torch.randint(0, max(size - 1, 1), (runs,), generator=gen).double()
        frac = 0.05 + 0.9 * torch.rand(n, generator=gen, dtype=torch.float64)
        x = (cell.repeat_interleave(torch.tensor(lengths)) + frac) / max(size - 1, 1) * 2 - 1
        outside = (torch.rand(runs, generator=gen) < 0.125).repeat_interleave(torch.tensor(lengths))
        x[outside] = 1.2 + 0.3 * frac[outside]
        columns.append(x)
    return torch.stack(columns, dim=1)


def grads_of(fn, grid: torch.Tensor, points: torch.Tensor, grad_out: torch.Tensor):
    """(output, grad_grid, grad_points) of fn(grid, points) for the upstream gradient grad_out."""
    grid = grid.detach().requires_grad_()
    points = points.detach().requires_grad_()
    out = fn(grid, points)
    grad_grid, grad_points = torch.autograd.grad(out, (grid, points), grad_out)
    return out.detach(), grad_grid, grad_points


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is one element past an aligned boundary."""
    buffer = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buffer[1:].view(t.shape)
    out.copy_(t)
    return out


# ----------------------------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("sizes", GRIDS, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_forward_matches_reference(gen, sizes, dtype, tol):
    grid = torch.randn(*sizes, generator=gen, dtype=torch.float64).to(dtype)
    points = random_points(200, gen, dtype=dtype)
    out = cuda_ext.grid_interpolate(grid, points)
    assert out.dtype == dtype and out.shape == (200, sizes[3])
    torch.testing.assert_close(
        out.double(), reference.grid_interpolate(grid.double(), points.double()), rtol=tol, atol=tol
    )


def test_grid_corners_are_reproduced_exactly(gen):
    # align_corners=True: a point on a voxel centre returns that voxel; the far corner is reachable.
    grid = torch.randn(3, 4, 5, 2, generator=gen, dtype=torch.float64)
    idx = torch.cartesian_prod(torch.arange(3), torch.arange(4), torch.arange(5))
    points = idx.double() / torch.tensor([2.0, 3.0, 4.0]) * 2 - 1
    torch.testing.assert_close(
        cuda_ext.grid_interpolate(grid, points), grid[idx[:, 0], idx[:, 1], idx[:, 2]], rtol=0, atol=1e-15
    )


@pytest.mark.parametrize("sizes", GRIDS, ids=str)
def test_grid_gradient_matches_reference(gen, sizes):
    # The grid gradient (the weights) is continuous in the points: boundary and outside points included.
    grid = torch.randn(*sizes, generator=gen, dtype=torch.float64)
    points = random_points(300, gen)
    grad_out = torch.randn(300, sizes[3], generator=gen, dtype=torch.float64)
    _, got, _ = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
    _, want, _ = grads_of(reference.grid_interpolate, grid, points, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("sizes", GRIDS, ids=str)
def test_points_gradient_matches_reference(gen, sizes):
    grid = torch.randn(*sizes, generator=gen, dtype=torch.float64)
    points = smooth_points(300, sizes[:3], gen)
    grad_out = torch.randn(300, sizes[3], generator=gen, dtype=torch.float64)
    got = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
    want = grads_of(reference.grid_interpolate, grid, points, grad_out)
    torch.testing.assert_close(got[2], want[2], rtol=1e-11, atol=1e-11)


def test_single_voxel_axis_has_zero_points_gradient(gen):
    grid = torch.randn(1, 4, 1, 3, generator=gen, dtype=torch.float64)
    points = smooth_points(50, (1, 4, 1), gen)
    grad_out = torch.randn(50, 3, generator=gen, dtype=torch.float64)
    _, _, grad_points = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
    assert torch.equal(grad_points[:, [0, 2]], torch.zeros(50, 2, dtype=torch.float64))
    _, _, want = grads_of(reference.grid_interpolate, grid, points, grad_out)
    assert want[:, 1].abs().max() > 0  # the one real axis does carry a gradient
    torch.testing.assert_close(grad_points, want, rtol=1e-12, atol=1e-12)


def test_scatter_with_many_points_per_voxel(gen):
    # Dense collisions exercise the CPU scatter's bucketing across threads (every bucket busy).
    grid = torch.randn(9, 3, 4, 6, generator=gen, dtype=torch.float64)
    points = random_points(20000, gen, spread=1.1)
    grad_out = torch.randn(20000, 6, generator=gen, dtype=torch.float64)
    _, got, _ = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
    _, want, _ = grads_of(reference.grid_interpolate, grid, points, grad_out)
    torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-11)


def test_gradients_for_points_in_runs_per_cell(gen):
    sizes = (6, 5, 7, 12)
    grid = torch.randn(*sizes, generator=gen, dtype=torch.float64)
    points = cell_run_points(1003, sizes[:3], gen)
    grad_out = torch.randn(1003, 12, generator=gen, dtype=torch.float64)
    got = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
    want = grads_of(reference.grid_interpolate, grid, points, grad_out)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("sizes", [(3, 4, 2, 2), (1, 3, 3, 3), (4, 2, 1, 1)], ids=str)
def test_gradcheck(gen, sizes):
    grid = torch.randn(*sizes, generator=gen, dtype=torch.float64).requires_grad_()
    points = smooth_points(7, sizes[:3], gen).requires_grad_()
    assert torch.autograd.gradcheck(cuda_ext.grid_interpolate, (grid, points))
    assert torch.autograd.gradcheck(cuda_ext.grid_interpolate, (grid, points.detach()))
    assert torch.autograd.gradcheck(cuda_ext.grid_interpolate, (grid.detach(), points))


def test_backward_op_returns_empty_for_unrequested_gradients(gen):
    grid = torch.randn(3, 3, 3, 2, generator=gen, dtype=torch.float64)
    points, grad_out = random_points(8, gen), torch.randn(8, 2, generator=gen, dtype=torch.float64)
    grad_grid, grad_points = OPS.grid_interpolate_backward(grad_out, grid, points, True, False)
    assert grad_grid.shape == (3, 3, 3, 2) and grad_points.shape == (0,)
    grad_grid, grad_points = OPS.grid_interpolate_backward(grad_out, grid, points, False, True)
    assert grad_grid.shape == (0,) and grad_points.shape == (8, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(gen, dtype):
    grid = torch.randn(3, 4, 2, 5, generator=gen, dtype=dtype)
    points = smooth_points(6, (3, 4, 2), gen).to(dtype)
    torch.library.opcheck(OPS.grid_interpolate.default, (grid.requires_grad_(), points.requires_grad_()))
    torch.library.opcheck(OPS.grid_interpolate.default, (grid, points.detach()))


def test_opcheck_backward_op(gen):
    grid = torch.randn(3, 2, 4, 3, generator=gen, dtype=torch.float64)
    points, grad_out = random_points(6, gen), torch.randn(6, 3, generator=gen, dtype=torch.float64)
    for flags in [(True, True), (True, False), (False, True), (False, False)]:
        torch.library.opcheck(OPS.grid_interpolate_backward.default, (grad_out, grid, points, *flags))


def _non_contiguous(grid: torch.Tensor, points: torch.Tensor):
    grid_nc = grid.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    points_nc = torch.stack([points, -points], dim=2)[..., 0]
    assert not grid_nc.is_contiguous() and not points_nc.is_contiguous()
    return grid_nc, points_nc


def test_non_contiguous_inputs_give_identical_results(gen):
    grid = torch.randn(4, 5, 3, 6, generator=gen)
    points = random_points(40, gen, dtype=torch.float32)
    grad_out = torch.randn(6, 40, generator=gen).t()
    want = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out.contiguous())
    got = grads_of(cuda_ext.grid_interpolate, *_non_contiguous(grid, points), grad_out)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("n,channels", [(0, 3), (0, 0), (5, 0)])
def test_empty_inputs(gen, n, channels):
    grid = torch.randn(2, 3, 4, channels, generator=gen, dtype=torch.float64)
    points = random_points(n, gen)
    out, grad_grid, grad_points = grads_of(
        cuda_ext.grid_interpolate, grid, points, torch.ones(n, channels, dtype=torch.float64)
    )
    assert out.shape == (n, channels)
    assert torch.equal(grad_grid, torch.zeros_like(grid))
    assert torch.equal(grad_points, torch.zeros(n, 3, dtype=torch.float64))


def test_nan_point_gives_nan_row_not_a_crash(gen):
    grid = torch.randn(4, 4, 4, 3, generator=gen, dtype=torch.float64)
    points = random_points(10, gen, spread=0.9)
    points[3, 1] = float("nan")
    out = cuda_ext.grid_interpolate(grid, points)
    assert torch.isnan(out[3]).all()
    keep = torch.arange(10) != 3
    torch.testing.assert_close(out[keep], reference.grid_interpolate(grid, points[keep]), rtol=1e-12, atol=1e-12)


def test_double_backward_raises(gen):
    grid = torch.randn(3, 3, 3, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    points = smooth_points(4, (3, 3, 3), gen).requires_grad_()
    out = cuda_ext.grid_interpolate(grid, points)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(out.sum(), points, create_graph=True)


def _bad_grid_inputs():
    f64 = torch.float64
    good_grid, good_points = torch.randn(3, 3, 3, 2, dtype=f64), torch.rand(4, 3, dtype=f64)
    return [
        ("grid ndim", torch.randn(3, 3, 6, dtype=f64), good_points, "grid must have shape"),
        ("empty axis 0", torch.randn(0, 3, 3, 2, dtype=f64), good_points, "grid has an empty axis 0"),
        ("empty axis 1", torch.randn(3, 0, 3, 2, dtype=f64), good_points, "grid has an empty axis 1"),
        ("empty axis 2", torch.randn(3, 3, 0, 2, dtype=f64), good_points, "grid has an empty axis 2"),
        ("points columns", good_grid, torch.rand(4, 4, dtype=f64), "points must have shape"),
        ("points ndim", good_grid, torch.rand(4, 3, 1, dtype=f64), "points must have shape"),
        (
            "integer grid",
            torch.ones(3, 3, 3, 2, dtype=torch.int32),
            torch.ones(4, 3, dtype=torch.int32),
            "grid must be float32 or float64",
        ),
        ("mixed dtypes", good_grid.float(), good_points, "points and grid must have the same dtype"),
        ("bfloat16 on CPU", good_grid.bfloat16(), good_points.bfloat16(), "grid must be float32 or float64 on the CPU"),
    ]


@pytest.mark.parametrize("case", _bad_grid_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_naming_the_argument(case):
    _, grid, points, message = case
    with pytest.raises((ValueError, TypeError), match=message):  # the wrapper's checks (cuda_ext/_checks.py)
        cuda_ext.grid_interpolate(grid, points)
    grad_out = torch.ones(points.shape[0], grid.shape[-1], dtype=grid.dtype)
    with pytest.raises(RuntimeError, match=message):
        OPS.grid_interpolate_backward(grad_out, grid, points, True, True)


def test_bad_reorder_setting_raises_naming_the_variable(monkeypatch):
    grid, points = torch.randn(3, 3, 3, 2, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64)
    for mode in ("auto", "off", "always", ""):  # the valid values (empty: unset) are accepted on the CPU too
        monkeypatch.setenv("CUDA_EXT_GRID_REORDER", mode)
        torch.testing.assert_close(cuda_ext.grid_interpolate(grid, points), reference.grid_interpolate(grid, points))
    monkeypatch.setenv("CUDA_EXT_GRID_REORDER", "sometimes")
    with pytest.raises(RuntimeError, match="CUDA_EXT_GRID_REORDER must be auto, off or always, got 'sometimes'"):
        cuda_ext.grid_interpolate(grid, points)


@pytest.mark.parametrize(
    "grad_out,message",
    [
        (torch.ones(4, 3, dtype=torch.float64), r"grad_out must have shape \(4, 2\)"),
        (torch.ones(5, 2, dtype=torch.float64), r"grad_out must have shape \(4, 2\)"),
        (torch.ones(4, 2, dtype=torch.float32), "grad_out and grid must have the same dtype"),
    ],
)
def test_bad_grad_out_raises(grad_out, message):
    grid, points = torch.randn(3, 3, 3, 2, dtype=torch.float64), torch.rand(4, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=message):
        OPS.grid_interpolate_backward(grad_out, grid, points, True, True)
