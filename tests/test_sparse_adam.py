"""cuda_ext.sparse_adam_step and training.optim.SparseGridAdam: dense Adam on the rows touched, nothing on the
rest; kernel vs reference; bad input."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from training.optim import SparseGridAdam

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]
HYPER = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8}


def state(m: int, c: int, dtype=torch.float64, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(m, c, generator=generator, dtype=torch.float64) * s).to(dtype).to(device)
        for s in (1.0, 0.1, 0.01, 0.001)
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step_fn", [cuda_ext.sparse_adam_step, reference.sparse_adam_step])
def test_all_rows_touched_equals_torch_adam(device, step_fn):
    start = state(50, 13, device=device)[0]
    dense, sparse = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    dense_opt = torch.optim.Adam([dense], **HYPER)
    sparse_opt = SparseGridAdam([{"params": [sparse], "name": "decoder"}], step_fn, **HYPER)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        grad = torch.randn(50, 13, generator=generator, dtype=torch.float64).to(device)
        dense.grad, sparse.grad = grad.clone(), grad.clone()
        dense_opt.step()
        sparse_opt.step()
    torch.testing.assert_close(sparse, dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sparse_opt.state[sparse]["exp_avg_sq"], dense_opt.state[dense]["exp_avg_sq"])


@pytest.mark.parametrize("device", DEVICES)
def test_untouched_rows_keep_value_and_moments_and_touched_rows_match_the_reference(device):
    param, grad, m, v = state(40, 5, device=device, seed=2)
    m, v = m.abs() * 0 + m, v.abs()  # any first moment, a non-negative second
    rows = torch.tensor([3, 17, 0, 39, 22], device=device)
    want = [x.clone() for x in (param, m, v)]
    reference.sparse_adam_step(want[0], grad, want[1], want[2], rows, 4, 0.01, 0.9, 0.99, 1e-8)
    got = [x.clone() for x in (param, m, v)]
    before = [x.clone() for x in got]
    cuda_ext.sparse_adam_step(got[0], grad, got[1], got[2], rows, 4, 0.01, 0.9, 0.99, 1e-8)
    untouched = torch.ones(40, dtype=torch.bool, device=device)
    untouched[rows] = False
    for g, w, b in zip(got, want, before):
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-15)
        assert torch.equal(g[untouched], b[untouched])  # bit-identical: never read or written
        assert not torch.equal(g[rows], b[rows])


@pytest.mark.parametrize("device", DEVICES)
def test_float32_kernel_close_to_float64(device):
    param, grad, m, v = state(300, 12, device=device, seed=3)
    v = v.abs()
    rows = torch.arange(0, 300, 7, device=device)
    want = [x.clone() for x in (param, m, v)]
    cuda_ext.sparse_adam_step(want[0], grad, want[1], want[2], rows, 2, 0.1, 0.9, 0.99, 1e-15)
    got = [x.float() for x in (param, m, v)]
    cuda_ext.sparse_adam_step(got[0], grad.float(), got[1], got[2], rows, 2, 0.1, 0.9, 0.99, 1e-15)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-6)


def test_optimizer_skips_zero_gradient_voxels_of_the_grids():
    grid = torch.nn.Parameter(torch.randn(4, 4, 4, 3, dtype=torch.float64))
    optimizer = SparseGridAdam([{"params": [grid], "name": "grids"}], cuda_ext.sparse_adam_step, **HYPER)
    grad = torch.zeros_like(grid)
    grad[1, 2, 3] = torch.tensor([0.5, 0.0, -0.2])
    grad[0, 0, 0, 1] = 1.0
    grid.grad = grad
    before = grid.detach().clone()
    optimizer.step()
    changed = (grid.detach() != before).any(dim=-1)
    assert changed.nonzero().tolist() == [[0, 0, 0], [1, 2, 3]]
    assert optimizer.state[grid]["exp_avg"][2, 2, 2].abs().sum() == 0


def test_opcheck():
    param, grad, m, v = state(10, 4, seed=4)
    torch.library.opcheck(
        torch.ops.cuda_ext.sparse_adam_step.default,
        (param, grad, m, v.abs(), torch.tensor([1, 5]), 3, 0.1, 0.9, 0.99, 1e-8),
    )


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {**a, "grad": a["grad"][:, :2].contiguous()}, ValueError, "grad must have the shape of param"),
        (lambda a: {**a, "exp_avg": a["exp_avg"].float()}, TypeError, "exp_avg and param must have the same dtype"),
        (lambda a: {**a, "rows": a["rows"].int()}, TypeError, "rows must be int64"),
        (lambda a: {**a, "rows": torch.tensor([0, 10])}, ValueError, r"rows must lie in \[0, 10\)"),
        (lambda a: {**a, "step": 0}, ValueError, "step must be >= 1"),
        (lambda a: {**a, "beta2": 1.0}, ValueError, "beta2 must be in"),
        (lambda a: {**a, "eps": 0.0}, ValueError, "eps must be a number > 0"),
        (lambda a: {**a, "param": a["param"].t()}, ValueError, "param must be contiguous"),
    ],
)
@pytest.mark.parametrize("fn", [cuda_ext.sparse_adam_step, reference.sparse_adam_step])
def test_bad_input_names_the_argument(fn, change, error, match):
    param, grad, m, v = state(10, 10, seed=5)
    args = {
        "param": param,
        "grad": grad,
        "exp_avg": m,
        "exp_avg_sq": v.abs(),
        "rows": torch.tensor([1, 2]),
        "step": 1,
        "lr": 0.1,
        "beta1": 0.9,
        "beta2": 0.99,
        "eps": 1e-8,
    }
    with pytest.raises(error, match=match):
        fn(**change(args))
