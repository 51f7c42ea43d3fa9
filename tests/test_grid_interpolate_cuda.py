"""cuda_ext.grid_interpolate's CUDA kernels (skipped without a GPU) against cuda_ext.reference and the CPU
kernels: every lane layout and channel path, the backward's runs of points in one cell, reduced precision,
misaligned and non-contiguous inputs, and the forward's bucket order (grid_interpolate_buckets.cuh)."""

from __future__ import annotations

import pytest
import torch
from test_grid_interpolate import (
    GRIDS,
    _misaligned,
    _non_contiguous,
    cell_run_points,
    grads_of,
    random_points,
    smooth_points,
)

import cuda_ext
from cuda_ext import reference

OPS = torch.ops.cuda_ext


# ----------------------------------------------------------------------------------------------- CUDA

# 24 and 32 channels: more 4-channel vectors than a forward lane group has lanes (the channel loop)
CUDA_GRIDS = GRIDS + [(16, 12, 10, 12), (5, 7, 9, 7), (3, 5, 4, 24), (4, 3, 5, 32)]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("sizes", CUDA_GRIDS, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 1e-4)])
def test_cuda_matches_reference(gen, poison_cuda_cache, sizes, dtype, tol):
    grid = torch.randn(*sizes, generator=gen, dtype=torch.float64).to("cuda", dtype)
    n = 2003  # not a multiple of any lane group's points per warp (32, 16, 10, 8): a partial last warp
    for points in [
        random_points(n, gen, device="cuda", dtype=dtype),
        smooth_points(n, sizes[:3], gen).to("cuda", dtype),
    ]:
        grad_out = torch.randn(n, sizes[3], generator=gen, dtype=torch.float64).to("cuda", dtype)
        want = grads_of(reference.grid_interpolate, grid.double(), points.double(), grad_out.double())
        poison_cuda_cache()
        got = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
        assert all(t.dtype == dtype for t in got)
        torch.testing.assert_close(got[0].double(), want[0], rtol=tol, atol=tol)
        torch.testing.assert_close(got[1].double(), want[1], rtol=tol, atol=tol * 10)  # atomics: order varies
    # points gradient only where smooth (the last `points` drawn)
    torch.testing.assert_close(got[2].double(), want[2], rtol=tol, atol=tol * max(sizes))


# The CUDA backward sums the atomics of consecutive points in one cell inside the warp (CellRuns):
# runs of every length, across warps, at the clamped border, a partial last warp, every channel path.
@pytest.mark.requires_cuda
@pytest.mark.parametrize("sizes", [(6, 5, 7, 12), (1, 4, 5, 12), (5, 4, 3, 3), (4, 3, 5, 24)], ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-11), (torch.float32, 1e-4), (torch.float16, 3e-2)])
def test_cuda_backward_merges_runs_of_points_in_one_cell(gen, poison_cuda_cache, sizes, dtype, tol):
    n = 2003
    grid = torch.randn(*sizes, generator=gen, dtype=torch.float64).to("cuda", dtype)
    points = cell_run_points(n, sizes[:3], gen).to("cuda", dtype)
    grad_out = torch.randn(n, sizes[3], generator=gen, dtype=torch.float64).to("cuda", dtype)
    _, want_grid, want_points = grads_of(reference.grid_interpolate, grid.double(), points.double(), grad_out.double())
    assert want_grid.abs().amax() > 1  # runs pile many points onto the same voxels
    for flags in [(True, True), (True, False)]:
        poison_cuda_cache()
        grad_grid, grad_points = OPS.grid_interpolate_backward(grad_out, grid, points, *flags)
        torch.testing.assert_close(grad_grid.double(), want_grid, rtol=tol, atol=tol * 20)
        if flags[1]:
            torch.testing.assert_close(grad_points.double(), want_points, rtol=tol, atol=tol * 10 * max(sizes))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("flags", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_backward_op_each_gradient_alone(gen, poison_cuda_cache, flags, dtype):
    sizes = (6, 7, 8, 12)
    grid = torch.randn(*sizes, generator=gen).to("cuda", dtype)
    points = smooth_points(500, sizes[:3], gen).to("cuda", dtype)
    grad_out = torch.randn(500, 12, generator=gen).to("cuda", dtype)
    _, want_grid, want_points = grads_of(reference.grid_interpolate, grid.double(), points.double(), grad_out.double())
    poison_cuda_cache()
    grad_grid, grad_points = OPS.grid_interpolate_backward(grad_out, grid, points, *flags)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for requested, got, want in [(flags[0], grad_grid, want_grid), (flags[1], grad_points, want_points)]:
        if requested:
            assert got.dtype == dtype
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 20)
        else:
            assert got.shape == (0,)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-2), (torch.bfloat16, 1e-1)])
@pytest.mark.parametrize("channels", [3, 7, 12, 32])  # 7: the scalar path's channel loop; 32: 8 vectors
def test_cuda_reduced_precision_vs_float32(gen, poison_cuda_cache, dtype, tol, channels):
    sizes = (10, 9, 11, channels)
    grid = torch.randn(*sizes, generator=gen).to("cuda", dtype)
    points = smooth_points(3000, sizes[:3], gen).to("cuda", dtype)
    grad_out = torch.randn(3000, channels, generator=gen).to("cuda", dtype)
    want = grads_of(reference.grid_interpolate, grid.float(), points.float(), grad_out.float())
    poison_cuda_cache()
    got = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
    torch.testing.assert_close(got[0].float(), want[0], rtol=tol, atol=tol)
    # grad_grid sums many contributions; accumulated in float32, rounded once at the end.
    torch.testing.assert_close(got[1].float(), want[1], rtol=tol, atol=tol * 4)
    # points-gradient error scales with (R-1)/2 and the channel count.
    torch.testing.assert_close(got[2].float(), want[2], rtol=tol, atol=tol * 10 * channels**0.5)


@pytest.mark.requires_cuda
def test_cuda_misaligned_and_non_contiguous_inputs(gen):
    grid = torch.randn(5, 6, 7, 8, generator=gen).cuda()
    points = random_points(700, gen, dtype=torch.float32, device="cuda")
    grad_out = torch.randn(700, 8, generator=gen).cuda()
    want = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
    for variant in [
        (_misaligned(grid), _misaligned(points), _misaligned(grad_out)),
        (*_non_contiguous(grid, points), grad_out.t().contiguous().t()),
    ]:
        got = grads_of(cuda_ext.grid_interpolate, *variant)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_agrees_with_cpu(gen, dtype):
    sizes = (12, 10, 9, 12)
    grid = torch.randn(*sizes, generator=gen).to(dtype)
    points = smooth_points(5000, sizes[:3], gen).to(dtype)
    grad_out = torch.randn(5000, 12, generator=gen).to(dtype)
    cpu = grads_of(cuda_ext.grid_interpolate, grid, points, grad_out)
    gpu = grads_of(cuda_ext.grid_interpolate, grid.cuda(), points.cuda(), grad_out.cuda())
    tol = 1e-11 if dtype == torch.float64 else 1e-4
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol)


@pytest.mark.requires_cuda
def test_cuda_gradcheck_and_opcheck(gen):
    sizes = (3, 4, 2, 4)
    grid = torch.randn(*sizes, generator=gen, dtype=torch.float64).cuda().requires_grad_()
    points = smooth_points(9, sizes[:3], gen).cuda().requires_grad_()
    assert torch.autograd.gradcheck(cuda_ext.grid_interpolate, (grid, points))
    torch.library.opcheck(OPS.grid_interpolate.default, (grid, points))


@pytest.mark.requires_cuda
def test_cuda_empty_inputs_and_nan_point(gen):
    grid = torch.randn(3, 4, 5, 4, generator=gen).cuda()
    out, grad_grid, grad_points = grads_of(
        cuda_ext.grid_interpolate, grid, torch.empty(0, 3, device="cuda"), torch.empty(0, 4, device="cuda")
    )
    assert out.shape == (0, 4) and torch.equal(grad_grid, torch.zeros_like(grid)) and grad_points.shape == (0, 3)
    points = random_points(10, gen, spread=0.9, dtype=torch.float32, device="cuda")
    points[2, 0] = float("nan")
    out = cuda_ext.grid_interpolate(grid, points)
    torch.cuda.synchronize()  # an out-of-bounds read would surface here
    assert torch.isnan(out[2]).all() and torch.isfinite(out[torch.arange(10) != 2]).all()


@pytest.mark.requires_cuda
def test_cuda_inputs_on_different_devices_raise(gen):
    grid, points = torch.randn(3, 3, 3, 2), torch.rand(4, 3)
    with pytest.raises(ValueError, match="points and grid must be on the same device"):
        cuda_ext.grid_interpolate(grid.cuda(), points)
    with pytest.raises(ValueError, match="points and grid must be on the same device"):
        cuda_ext.grid_interpolate(grid, points.cuda())
    with pytest.raises(RuntimeError, match="grid must be a CUDA tensor"):
        OPS.grid_interpolate(grid, points.cuda())
    with pytest.raises(RuntimeError, match="grad_out and grid must be on the same device"):
        OPS.grid_interpolate_backward(torch.ones(4, 2), grid.cuda(), points.cuda(), True, True)


# ------------------------------------------------------ CUDA: the forward's bucket order (grid_interpolate_buckets.cuh)


def _launched_kernels(fn) -> str:
    """Names of the CUDA kernels fn() launches, space-separated."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return " ".join(event.name for event in prof.events())


def _forward_in_mode(monkeypatch, mode: str, grid: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    monkeypatch.setenv("CUDA_EXT_GRID_REORDER", mode)
    out = cuda_ext.grid_interpolate(grid, points)
    torch.cuda.synchronize()  # a bad index in the bucket order would surface here
    return out


# "always" puts every float32/16/bf16 lookup in bucket order (buckets of ~1/16 of axis 0, probe ignored):
# the rows must be bit-identical to the lookup in the points' own order, for every lane layout, grids
# with one or two axis-0 slices, more points than one 2048-point scatter tile and a partial last tile.
@pytest.mark.requires_cuda
@pytest.mark.parametrize("sizes", CUDA_GRIDS + [(40, 6, 7, 12), (300, 3, 2, 4)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cuda_bucket_order_gives_identical_rows(gen, poison_cuda_cache, monkeypatch, sizes, dtype):
    grid = torch.randn(*sizes, generator=gen).to("cuda", dtype)
    points = random_points(5003, gen, device="cuda", dtype=dtype)
    points[17, 0] = float("nan")
    want = _forward_in_mode(monkeypatch, "off", grid, points)
    poison_cuda_cache()
    got = _forward_in_mode(monkeypatch, "always", grid, points)
    assert torch.isnan(got[17]).all() and not torch.isnan(got[:17]).any() and not torch.isnan(got[18:]).any()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.requires_cuda
def test_cuda_bucket_order_with_points_sorted_along_rays(gen, poison_cuda_cache, monkeypatch):
    sizes = (33, 20, 21, 12)
    grid = torch.randn(*sizes, generator=gen).cuda()
    points = cell_run_points(9000, sizes[:3], gen).float().cuda()  # runs of neighbours: one warp, one bucket
    want = _forward_in_mode(monkeypatch, "off", grid, points)
    poison_cuda_cache()
    torch.testing.assert_close(_forward_in_mode(monkeypatch, "always", grid, points), want, rtol=0, atol=0)


# When the reordering kernels are queued ("auto"): a grid well past the L2 budget and >= 2^20 points of a
# float type. Whether the probe then reorders is decided on the device; both answers give the same rows.
@pytest.mark.requires_cuda
def test_cuda_reorder_decision(gen, monkeypatch):
    if torch.cuda.get_device_properties(0).L2_cache_size > (100 << 20):
        pytest.skip("this test's 134 MB grid is within this device's L2 budget")
    grid = torch.randn(256, 128, 128, 8, device="cuda")  # 134 MB; a slice is 512 KB
    n = 1 << 20
    random = torch.rand(n, 3, device="cuda") * 2 - 1
    sorted_by_axis0 = random[random[:, 0].argsort()]  # neighbours share a bucket: the probe keeps this order
    for points in (random, sorted_by_axis0):
        want = _forward_in_mode(monkeypatch, "off", grid, points)
        monkeypatch.setenv("CUDA_EXT_GRID_REORDER", "auto")
        launched = _launched_kernels(lambda points=points: cuda_ext.grid_interpolate(grid, points))
        assert all(
            k in launched
            for k in ("order_probe_kernel", "bucket_count_kernel", "bucket_scatter_kernel", "grid_forward_kernel")
        )
        torch.testing.assert_close(_forward_in_mode(monkeypatch, "auto", grid, points), want, rtol=0, atol=0)
    monkeypatch.setenv("CUDA_EXT_GRID_REORDER", "auto")
    for g, p in [
        (grid, random[: n - 1]),  # too few points
        (grid[:, :40, :40].contiguous(), random),  # fits in L2
        (grid.double(), random.double()),
    ]:  # float64: no reordering
        launched = _launched_kernels(lambda g=g, p=p: cuda_ext.grid_interpolate(g, p))
        assert "grid_forward_kernel" in launched and "order_probe" not in launched and "bucket" not in launched
    monkeypatch.setenv("CUDA_EXT_GRID_REORDER", "off")
    launched = _launched_kernels(lambda: cuda_ext.grid_interpolate(grid, random))
    assert "grid_forward_kernel" in launched and "order_probe" not in launched and "bucket" not in launched
