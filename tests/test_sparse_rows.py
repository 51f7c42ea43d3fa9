"""models/sparse_rows.py and ``model.tv_sparse_grad``: rows gathered through ``RowGradients`` and scattered back
after the backward give the gradients plain indexing gives (float64, repeated rows, on their own and added onto a
dense gradient), the TV estimates of the coarse and fine grids give the same losses and gradients either way, and a
training run is the same run."""

from __future__ import annotations

import pytest
import torch
from test_model import make_model, randomize_density

import cuda_ext
from models.sparse_rows import RowGradients, gather_rows

F64 = torch.float64
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


def _table(shape, seed=0, device="cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, dtype=F64, generator=generator).to(device).requires_grad_(True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(5, 4, 3, 6), (40, 2)], ids=["grid", "rows"])
def test_gathered_rows_match_indexing_and_its_gradient(shape, device):
    rows = int(torch.tensor(shape[:-1]).prod())
    generator = torch.Generator().manual_seed(1)
    index = torch.randint(rows, (64,), generator=generator).to(device)  # 64 draws from <= 60 rows: repeats
    assert index.unique().numel() < index.numel()
    weights = torch.randn(64, shape[-1], dtype=F64, generator=generator).to(device)
    table, reference = _table(shape, device=device), _table(shape, device=device)
    row_grads = RowGradients()
    picked = row_grads.gather(table, index)
    assert torch.equal(picked, reference.reshape(-1, shape[-1])[index]) and len(row_grads) == 1
    (picked**2 * weights).sum().backward()
    (reference.reshape(-1, shape[-1])[index] ** 2 * weights).sum().backward()
    assert table.grad is None  # autograd stopped at the gathered rows
    row_grads.scatter()
    assert len(row_grads) == 0 and table.grad.shape == table.shape and not table.grad.is_sparse
    torch.testing.assert_close(table.grad, reference.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_scattered_rows_add_onto_a_dense_gradient(device):
    table, reference = _table((6, 5, 4, 3), device=device), _table((6, 5, 4, 3), device=device)
    index = torch.randint(120, (50,), generator=torch.Generator().manual_seed(2)).to(device)
    row_grads = RowGradients()
    for t, rows in ((table, row_grads), (reference, None)):
        dense_term = (t * t.detach().cos()).sum()  # a lookup-like term: a dense gradient
        (dense_term + (gather_rows(t, index, rows) ** 3).sum()).backward()
    before = table.grad.clone()
    torch.testing.assert_close(before, table.detach().cos())  # the gathered rows' share is not in yet
    row_grads.scatter()
    torch.testing.assert_close(table.grad, reference.grad, rtol=1e-12, atol=1e-12)


def test_without_grad_it_is_plain_indexing_and_unscattered_gathers_are_forgotten():
    table = _table((10, 3))
    index = torch.tensor([3, 3, 7])
    row_grads = RowGradients()
    with torch.no_grad():
        assert row_grads.gather(table, index).grad_fn is None and len(row_grads) == 0
    plain = gather_rows(table, index)
    assert "Index" in type(plain.grad_fn).__name__
    row_grads.gather(table, index)
    row_grads.clear()
    row_grads.scatter()  # nothing left to add
    assert table.grad is None
    unused = row_grads.gather(table, index)
    (plain.sum() + 0 * unused.detach().sum()).backward()  # the gathered rows are not in the loss
    row_grads.scatter()
    want = torch.zeros_like(table).index_put((index,), torch.ones(3, 3, dtype=F64), accumulate=True)
    torch.testing.assert_close(table.grad, want)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"contraction": "inf", "tv_background": 10.0}, {"fine.factor": 2, "fine.brick": 4}],
    ids=["grids", "shell-weighted", "fine-grid"],
)
@pytest.mark.parametrize("device", DEVICES)
def test_the_tv_estimate_is_the_same_with_a_sparse_gradient(overrides, device):
    def randomize(values: torch.Tensor, seed: int) -> None:
        values.copy_(torch.randn(values.shape, dtype=values.dtype, generator=torch.Generator().manual_seed(seed)))

    grads = []
    for sparse in (False, True):
        model = make_model(0, **overrides, tv_sparse_grad=sparse, tv_samples=300).double().to(device)
        with torch.no_grad():
            randomize_density(model)
            randomize(model.features.grid, 3)
        if "fine.factor" in overrides:  # allocate the bricks on every occupied cell, with random values
            model.fine.allocate(torch.ones(model.occupancy.mask.shape, dtype=torch.bool, device=device), 2, 10**6)
            with torch.no_grad():
                randomize(model.fine.density, 4)
                randomize(model.fine.features, 5)
        torch.manual_seed(6)  # the same TV sample
        loss = model.regularization()
        loss.backward()
        model.row_grads.scatter()
        grads.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (dense_loss, dense), (sparse_loss, sparse) = grads
    torch.testing.assert_close(sparse_loss, dense_loss, rtol=1e-12, atol=0)
    assert dense.keys() == sparse.keys() and {"density.grid", "features.grid"} <= dense.keys()
    if "fine.factor" in overrides:
        assert {"fine.density", "fine.features"} <= dense.keys()
    for name in dense:
        assert dense[name].abs().sum() > 0 or name.startswith("decoder"), name  # the estimate reached it
        torch.testing.assert_close(sparse[name], dense[name], rtol=1e-10, atol=1e-14, msg=name)


def test_a_training_run_is_the_same_run_with_the_sparse_tv_gradient(tmp_path):
    """The TV estimate's gradient as rows (ops.sampled_tv after the backward: tests/test_grid_tv.py) or dense
    (autograd's, model.tv_sparse_grad=false): the same training run."""
    from test_distributed import assert_same_model, single, tiny

    from training.checkpoint import load_checkpoint

    cache = tmp_path / "cache"
    for name, sparse in (("dense", "false"), ("sparse", "true")):
        result = single(tiny(cache, tmp_path / name, 12) + [f"model.tv_sparse_grad={sparse}"])
        assert result.returncode == 0, result.stderr[-2000:]
    runs = [
        load_checkpoint(tmp_path / name / "checkpoints" / "last.pt", map_location="cpu") for name in ("dense", "sparse")
    ]
    assert_same_model(*runs)


def test_bench_tv_grad_smoke_cpu(tmp_path, load_bench):
    out = tmp_path / "tv.json"
    report = load_bench("bench_tv_grad").main(
        [
            "--device",
            "cpu",
            "--size",
            "12",
            "--samples",
            "200",
            "--repeats",
            "2",
            "--budget-s",
            "0.1",
            "--json",
            str(out),
        ]
    )
    assert out.exists() and report["grid"] == {"size": 12, "rows": 1728, "channels": 12, "dtype": "float32"}
    dense, sparse, *op = report["results"]
    assert dense["variant"].startswith("dense") and sparse["variant"].startswith("rows")
    assert [r["variant"] for r in op] == (["op (sampled_tv)"] if cuda_ext.has_extension() else [])
    assert dense["bytes"] == 4 * 1728 * 12 * 4 and sparse["bytes"] == 3 * 4 * 200 * 12 * 4
    assert all(r["ms"] > 0 and r["GBps"] > 0 and r["pct_copy"] > 0 for r in (dense, sparse, *op))
    for r in (sparse, *op):
        assert r["speedup_vs_dense"] == pytest.approx(dense["ms"] / r["ms"])
    with pytest.raises(SystemExit):  # more samples than cells: the whole-grid TV, not this benchmark
        load_bench("bench_tv_grad").main(["--device", "cpu", "--size", "4", "--samples", "27"])
