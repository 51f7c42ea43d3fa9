"""Non-finite points (issue 14, part 4): grid_interpolate's custom op and reference agree on NaN / +inf / -inf
coordinates, values and gradients, on the CPU and on CUDA."""

from __future__ import annotations

import pytest
import torch
from test_op_contracts import rand_points, randn

import cuda_ext
from cuda_ext import reference

# ------------------------------------------------------------------------------------- non-finite points

NAN, INF = float("nan"), float("inf")
NON_FINITE_GRIDS = [(3, 4, 5, 2), (1, 4, 5, 3), (2, 1, 1, 3), (1, 1, 1, 1), (4, 3, 2, 0)]


def _non_finite_points(dtype, seed=25):
    """12 points: for each of NaN, +inf, -inf one point per axis with that coordinate; 3 finite points."""
    points = rand_points(12, dtype=dtype, seed=seed, spread=1.2)
    for i, value in enumerate([NAN, INF, -INF]):
        for axis in range(3):
            points[3 * i + axis, axis] = value
    return points


def _value_and_grads(fn, grid, points, grad_out):
    grid = grid.detach().requires_grad_()
    points = points.detach().requires_grad_()
    out = fn(grid, points)
    grad_grid, grad_points = torch.autograd.grad(out, (grid, points), grad_out)
    return out.detach(), grad_grid, grad_points


@pytest.mark.parametrize("sizes", NON_FINITE_GRIDS, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_non_finite_points_agree_between_backends(sizes, dtype, tol):
    grid = randn(*sizes, dtype=dtype, seed=26)
    points = _non_finite_points(dtype)
    grad_out = randn(12, sizes[3], dtype=dtype, seed=27)
    got = _value_and_grads(cuda_ext.grid_interpolate, grid, points, grad_out)
    want = _value_and_grads(reference.grid_interpolate, grid, points, grad_out)  # used to raise IndexError
    out = got[0]
    assert out.shape == (12, sizes[3])
    assert torch.equal(out.isnan(), want[0].isnan())
    torch.testing.assert_close(out, want[0], rtol=tol, atol=tol, equal_nan=True)
    # NaN coordinate: a NaN row. +-inf: the border, i.e. the row of the coordinate +-1, except along an
    # axis with one voxel, where (point + 1) / 2 * 0 is NaN.
    if sizes[3] > 0:
        assert out[0:3].isnan().all()
        for i, (_value, border) in enumerate([(INF, 1.0), (-INF, -1.0)]):
            for axis in range(3):
                row = 3 + 3 * i + axis
                if sizes[axis] == 1:
                    assert out[row].isnan().all()
                else:
                    clamped = points[row : row + 1].clone()
                    clamped[0, axis] = border
                    for fn in (cuda_ext.grid_interpolate, reference.grid_interpolate):
                        assert torch.equal(fn(grid, clamped)[0], fn(grid, points[row : row + 1])[0])
                    assert torch.isfinite(out[row]).all()
        assert torch.isfinite(out[9:]).all()
    # The backward runs on both (no crash, no out-of-range index). The grid gradients agree (NaN at the
    # voxels a NaN row reads); the points gradients agree on finite rows and are NaN on NaN rows (the kernel
    # multiplies the NaN by the clamp's zero slope too, the reference's clamp drops it: not compared there).
    for got_grad, want_grad, like in zip(got[1:], want[1:], (grid, points)):
        assert got_grad.shape == like.shape and want_grad.shape == like.shape
    assert torch.isfinite(got[2][9:]).all() and torch.isfinite(want[2][9:]).all()
    if sizes[3] > 0:
        torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol, equal_nan=True)
        assert got[1].isnan().any()
        finite_rows = torch.isfinite(out).all(dim=1)
        torch.testing.assert_close(got[2][finite_rows], want[2][finite_rows], rtol=tol, atol=tol)
        # the kernel's points gradient is NaN on every non-finite row; the reference's depends on the torch version
        # (torch 2.14's autograd gives a finite one on some rows where 2.13 gave NaN), so only ours is held to it
        assert got[2][~finite_rows].isnan().any(dim=1).all()


@pytest.mark.requires_cuda
@pytest.mark.parametrize("sizes", NON_FINITE_GRIDS, ids=str)
def test_cuda_non_finite_points_agree_with_cpu(sizes):
    grid = randn(*sizes, dtype=torch.float32, seed=28)
    points = _non_finite_points(torch.float32)
    want = cuda_ext.grid_interpolate(grid, points)
    for fn in (cuda_ext.grid_interpolate, reference.grid_interpolate):
        got = fn(grid.cuda(), points.cuda()).cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.equal(got.isnan(), want.isnan())
