"""cuda_ext.masked_adam_step and ``train.sparse_adam=nonzero``: torch.optim.Adam's update on the elements whose
gradient is non-zero, nothing at all (value, moments) where it is exactly zero; kernels vs the reference and
torch.optim.Adam; CUDA layouts; poisoned elements; opcheck; bad input; the optimiser and a training run."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from training.optim import SparseGridAdam

requires_cuda = pytest.mark.requires_cuda
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
STEP_FNS = [cuda_ext.masked_adam_step, reference.masked_adam_step]
HYPER = (0.01, 0.9, 0.99, 1e-8)  # lr, beta1, beta2, eps


def state(m: int, c: int, dtype=torch.float64, device="cpu", seed=0, zero_rows=0.6, zero_elements=0.1):
    """param, grad, exp_avg, exp_avg_sq of shape (m, c), random (the second moment non-negative); the gradient is
    exactly zero on a ``zero_rows`` share of the rows (voxels no ray reached) and on a ``zero_elements`` share of
    the other elements (a channel that got nothing)."""
    generator = torch.Generator().manual_seed(seed)
    p, g, m1, m2 = (torch.randn(m, c, generator=generator, dtype=torch.float64) * s for s in (1.0, 0.1, 0.01, 0.001))
    g[torch.rand(m, generator=generator) < zero_rows] = 0
    g[torch.rand(m, c, generator=generator) < zero_elements] = 0
    return [x.to(dtype=dtype, device=device) for x in (p, g, m1, m2.abs())]


# --------------------------------------------------------------------------------- against torch.optim.Adam


@pytest.mark.parametrize("step_fn", STEP_FNS, ids=["op", "reference"])
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.4, 0.999)], ids=["small-lerp-weight", "large-lerp-weight"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 2e-6)])
def test_every_gradient_nonzero_equals_torch_adam(dtype, tol, betas, step_fn):
    start = state(301, 13, dtype=dtype, seed=1)[0]
    dense = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.Adam([dense], lr=0.05, betas=betas, eps=1e-8)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    generator = torch.Generator().manual_seed(2)
    for step in range(1, 7):
        grad = (torch.rand(301, 13, generator=generator, dtype=torch.float64) + 0.5).to(dtype)  # never zero
        dense.grad = grad.clone()
        optimizer.step()
        step_fn(param, grad, exp_avg, exp_avg_sq, step, 0.05, *betas, 1e-8)
    moments = optimizer.state[dense]
    # the moments in torch's op order exactly; the parameter to rounding (torch's vectorised CPU sqrt)
    assert torch.equal(exp_avg, moments["exp_avg"]) and torch.equal(exp_avg_sq, moments["exp_avg_sq"])
    torch.testing.assert_close(param, dense.detach(), rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------- zero gradients


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 2e-6)])
def test_zero_gradient_elements_keep_value_and_moments(device, dtype, tol):
    param, grad, m, v = state(400, 13, dtype=dtype, device=device, seed=3)
    on = grad != 0
    assert 0.2 < on.double().mean() < 0.5 and bool((~on).any(1).logical_and(on.any(1)).any())  # mixed rows too
    want = [x.clone() for x in (param, m, v)]
    got = [x.clone() for x in (param, m, v)]
    for step in (1, 2, 7):
        reference.masked_adam_step(want[0], grad, want[1], want[2], step, *HYPER)
        cuda_ext.masked_adam_step(got[0], grad, got[1], got[2], step, *HYPER)
    for g, w, before in zip(got, want, (param, m, v)):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
        assert torch.equal(g[~on], before[~on])  # bit-identical: never written
        assert bool((g[on] != before[on]).all())  # and every stepped element moved


@pytest.mark.parametrize("device", DEVICES)
def test_the_same_as_sparse_adam_step_on_the_rows_with_a_gradient(device):
    """With whole rows zero or non-zero, the masked step is the row-listed step on the non-zero rows."""
    param, grad, m, v = state(300, 12, device=device, seed=4, zero_elements=0.0)
    rows = grad.ne(0).any(1).nonzero().squeeze(1)
    listed = [x.clone() for x in (param, m, v)]
    cuda_ext.sparse_adam_step(listed[0], grad, listed[1], listed[2], rows, 3, *HYPER)
    cuda_ext.masked_adam_step(param, grad, m, v, 3, *HYPER)
    for got, want in zip((param, m, v), listed):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels", [1, 3, 4, 13, 32])
def test_poisoned_zero_gradient_elements_are_never_changed(device, channels):
    """NaN in param and both moments wherever the gradient is zero: a kernel that uses one spreads it into its
    pack's stepped elements, one that writes one changes its bits; the stepped elements must come out finite and
    as the reference makes them."""
    param, grad, m, v = state(257, channels, device=device, seed=5)
    on = grad != 0
    want = [x.clone() for x in (param, m, v)]
    reference.masked_adam_step(want[0], grad, want[1], want[2], 3, 0.1, 0.9, 0.999, 1e-8)
    got = [x.clone() for x in (param, m, v)]
    for x in got:
        x[~on] = float("nan")
    poisoned = [x.clone() for x in got]
    cuda_ext.masked_adam_step(got[0], grad, got[1], got[2], 3, 0.1, 0.9, 0.999, 1e-8)
    for g, w, p in zip(got, want, poisoned):
        torch.testing.assert_close(g[on], w[on], rtol=1e-14, atol=1e-15)
        assert torch.equal(g.view(torch.int64)[~on], p.view(torch.int64)[~on])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step_fn", STEP_FNS, ids=["op", "reference"])
def test_a_nan_gradient_is_stepped_as_dense_adam_would(device, step_fn):
    param, grad, m, v = state(20, 4, device=device, seed=6, zero_rows=0.0, zero_elements=0.0)
    grad[3, 1] = float("nan")
    step_fn(param, grad, m, v, 1, *HYPER)
    assert bool(param[3, 1].isnan()) and int(param.isnan().sum()) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_gradient_and_empty_tensors_are_no_ops(device):
    param, grad, m, v = state(30, 12, device=device, seed=7)
    before = [x.clone() for x in (param, m, v)]
    cuda_ext.masked_adam_step(param, torch.zeros_like(grad), m, v, 1, *HYPER)
    assert all(torch.equal(a, b) for a, b in zip((param, m, v), before))
    empty = torch.empty(0, 12, dtype=torch.float64, device=device)
    cuda_ext.masked_adam_step(empty, empty, empty.clone(), empty.clone(), 1, *HYPER)


# ------------------------------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("channels", [1, 2, 3, 4, 8, 12, 13, 16, 27, 33, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu_for_every_layout(channels, dtype):
    """Every pack width (16/8/4 bytes, single elements) and lane count (1 to 32, and rows wider than a warp)."""
    cpu = state(3000, channels, dtype=dtype, seed=8)
    gpu = [x.cuda() for x in cpu]
    for step in (1, 2):
        cuda_ext.masked_adam_step(*cpu, step, *HYPER)
        cuda_ext.masked_adam_step(*gpu, step, *HYPER)
    tol = 1e-14 if dtype == torch.float64 else 1e-6
    for c, g in zip(cpu, gpu):
        torch.testing.assert_close(g.cpu(), c, rtol=tol, atol=tol)


@requires_cuda
@pytest.mark.parametrize("offset", [1, 2])
def test_cuda_misaligned_tensors_take_the_narrow_path(offset):
    """Contiguous views that start 4 or 8 bytes past a 16-byte boundary, C = 12 (which would take float4)."""
    cpu = state(500, 12, dtype=torch.float32, seed=9)
    gpu = []
    for x in cpu:
        storage = torch.empty(x.numel() + offset, dtype=x.dtype, device="cuda")
        gpu.append(storage[offset:].view(500, 12).copy_(x))
    assert gpu[0].data_ptr() % 16 != 0
    cuda_ext.masked_adam_step(*cpu, 4, *HYPER)
    cuda_ext.masked_adam_step(*gpu, 4, *HYPER)
    for c, g in zip(cpu, gpu):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-6, atol=1e-6)


@requires_cuda
def test_cuda_many_rows_cover_every_grid_stride_pass():
    param, grad, m, v = state(600_000, 13, dtype=torch.float32, device="cuda", seed=10)
    want = [x.clone() for x in (param, m, v)]
    reference.masked_adam_step(want[0], grad, want[1], want[2], 5, *HYPER)
    cuda_ext.masked_adam_step(param, grad, m, v, 5, *HYPER)
    for g, w in zip((param, m, v), want):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6)


@requires_cuda
def test_cuda_device_mismatch_names_the_argument():
    args = state(10, 4, device="cuda")
    args[1] = args[1].cpu()
    with pytest.raises(ValueError, match="grad and param must be on the same device"):
        cuda_ext.masked_adam_step(*args, 1, *HYPER)
    with pytest.raises(RuntimeError, match="grad"):
        torch.ops.cuda_ext.masked_adam_step(*args, 1, *HYPER)


# ------------------------------------------------------------------------------------------------ opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(device, dtype):
    args = (*state(10, 4, dtype=dtype, device=device, seed=11), 3, *HYPER)
    torch.library.opcheck(torch.ops.cuda_ext.masked_adam_step.default, args)


# -------------------------------------------------------------------------------------------- bad input

BAD = [
    ("grad-columns", 1, lambda t: t[:, :2].contiguous(), ValueError, "grad must have the shape of param"),
    ("exp_avg-rows", 2, lambda t: t[:9].contiguous(), ValueError, "exp_avg must have the shape of param"),
    ("exp_avg_sq-dtype", 3, lambda t: t.float(), TypeError, "exp_avg_sq and param must have the same"),
    ("param-3d", 0, lambda t: t[None], ValueError, r"param must have shape \(M, C\)"),
    ("param-half", 0, lambda t: t.half(), TypeError, "param must be float32 or float64"),
    ("param-strided", 0, lambda t: t.t(), ValueError, "param must be contiguous"),
    ("grad-list", 1, lambda t: t.tolist(), TypeError, "grad must be a torch.Tensor"),
    ("step-zero", 4, 0, ValueError, "step must be >= 1"),
    ("step-float", 4, 1.5, TypeError, "step must be an int"),
    ("lr-negative", 5, -0.1, ValueError, "lr must be"),
    ("beta1-one", 6, 1.0, ValueError, "beta1 must be"),
    ("beta2-nan", 7, float("nan"), ValueError, "beta2 must be"),
    ("eps-zero", 8, 0.0, ValueError, "eps must be a number > 0"),
]


@pytest.mark.parametrize("name,position,change,error,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(name, position, change, error, message):
    args = [*state(10, 10, seed=12), 1, *HYPER]
    args[position] = change(args[position]) if callable(change) else change
    with pytest.raises(error, match=message):
        cuda_ext.masked_adam_step(*args)
    with pytest.raises(error, match=message):
        reference.masked_adam_step(*args)
    if position < 4 and name != "grad-list":  # the C++ backstop says the same, without the Python wrapper
        with pytest.raises(RuntimeError, match=message.split(" ")[0]):
            torch.ops.cuda_ext.masked_adam_step(*args)


# ------------------------------------------------------------------------------------------- the optimiser


@pytest.mark.parametrize("step_fn", STEP_FNS, ids=["op", "reference"])
def test_optimizer_masks_the_grid_groups_by_gradient_and_steps_the_decoder_densely(step_fn):
    """``grids`` and ``fine`` step only their elements with a gradient (as the op alone would); the decoder is
    torch.optim.Adam's whole update."""
    torch.manual_seed(13)
    grid = torch.nn.Parameter(torch.randn(6, 5, 4, 3, dtype=torch.float64))
    fine = torch.nn.Parameter(torch.randn(40, 2, dtype=torch.float64))
    decoder = torch.nn.Parameter(torch.randn(7, 5, dtype=torch.float64))
    groups = [
        {"params": [grid], "lr": 0.1, "name": "grids"},
        {"params": [fine], "lr": 0.05, "name": "fine"},
        {"params": [decoder], "lr": 0.01, "name": "decoder"},
    ]
    optimizer = SparseGridAdam(groups, cuda_ext.sparse_adam_step, betas=(0.9, 0.99), eps=1e-8, masked_fn=step_fn)
    dense_decoder = torch.nn.Parameter(decoder.detach().clone())
    dense = torch.optim.Adam([dense_decoder], lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    shadows = {id(p): [p.detach().clone().view(-1, p.shape[-1]), None, None] for p in (grid, fine)}
    for step in range(1, 4):
        for param in (grid, fine):
            param.grad = state(param.numel() // param.shape[-1], param.shape[-1], seed=20 + step)[1].view_as(param)
            values, m, v = shadows[id(param)]
            if m is None:
                m, v = torch.zeros_like(values), torch.zeros_like(values)
            lr = 0.1 if param is grid else 0.05
            reference.masked_adam_step(values, param.grad.reshape(values.shape), m, v, step, lr, 0.9, 0.99, 1e-8)
            shadows[id(param)] = [values, m, v]
        decoder.grad = torch.randn(7, 5, dtype=torch.float64)
        dense_decoder.grad = decoder.grad.clone()
        optimizer.step()
        dense.step()
    for param in (grid, fine):
        values, m, v = shadows[id(param)]
        torch.testing.assert_close(param.detach().view(values.shape), values, rtol=1e-14, atol=1e-14)
        torch.testing.assert_close(optimizer.state[param]["exp_avg_sq"].view(v.shape), v, rtol=1e-14, atol=0)
        assert float(optimizer.state[param]["step"]) == 3
    torch.testing.assert_close(decoder, dense_decoder, rtol=1e-13, atol=1e-13)


def test_training_with_nonzero_adam_runs_and_learns(tmp_path):
    from test_train import read_metrics, run_train, tiny_overrides

    cache = tmp_path / "cache"
    runs = {}
    for mode in ("false", "nonzero"):
        args = tiny_overrides(cache, 16) + [f"hydra.run.dir={tmp_path / mode}", f"train.sparse_adam={mode}"]
        args += ["ops.sparse_adam_step=custom"]  # the kernel, not the reference (tiny_overrides: ops=torch)
        result = run_train(args, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        runs[mode] = read_metrics(tmp_path / mode)
    assert runs["nonzero"]["psnr"] == pytest.approx(runs["false"]["psnr"], abs=0.5)
    assert runs["nonzero"]["psnr"] != runs["false"]["psnr"]  # a different optimiser did run


def test_the_capture_preset_trains_on_the_cpu_through_its_ops(tmp_path):
    """``+experiment=capture`` as shipped (contraction, fine grid, distortion loss, ``sparse_adam=nonzero``), made
    small, trains a distorted nerfstudio capture end to end on the CPU through the custom ops."""
    import json

    from test_nerfstudio import write_capture
    from test_train import run_train

    write_capture(tmp_path / "capture", count=9, size=(24, 32))
    small = ["model.resolution_start=16", "model.resolution_end=24", "model.grow_at=[0.25]", "model.decoder_hidden=16"]
    small += ["model.fine.at=0.5", "model.fine.min_pixels=0.01", "model.fine.max_bricks=64", "model.fine.brick=4"]
    small += ["model.max_samples=64", "model.tv_samples=256", "model.occupancy.warmup=4"]
    run = ["device=cpu", "train.iters=12", "train.batch_rays=256", "train.eval_final_views=1", "train.log_every=4"]
    args = [
        "+experiment=capture",
        f"data.root={tmp_path / 'capture'}",
        *small,
        *run,
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    result = run_train(args, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "fine grid: 64 bricks" in result.stdout and "'sparse_adam_step': 'custom'" in result.stdout
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["iters"] == 12 and 0 < metrics["psnr"] < 60
