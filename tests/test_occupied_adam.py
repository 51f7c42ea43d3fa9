"""``train.sparse_adam=occupied``: dense Adam on the grid rows at the corners of occupied cells only.

The rows (OccupancyGrid.vertex_rows) must hold every row a marched sample reads, the optimiser must step exactly
those as torch.optim.Adam does and leave every other row (value and moments) alone, and the rows are recomputed
only when the occupancy mask changes.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from models.field import OccupancyGrid
from training.optim import OccupiedRows, SparseGridAdam

BETAS = (0.9, 0.99)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


@torch.no_grad()
def ball_density(model, radius: float = 0.4) -> None:
    """Random densities (not zeros) inside a ball at the box centre, far below the occupancy threshold outside it:
    occupied cells around the ball, empty space elsewhere."""
    grid = model.density.grid
    axes = [torch.linspace(-1, 1, n) for n in grid.shape[:3]]
    inside = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).norm(dim=-1) < radius
    noise = torch.randn(grid.shape[:3], generator=torch.Generator().manual_seed(1))
    grid[..., 0] = torch.where(inside, 2.0 + noise, -30.0 + noise)


def random_occupancy(cells: tuple[int, int, int], fraction: float, seed: int = 0) -> OccupancyGrid:
    occupancy = OccupancyGrid(tuple(c + 1 for c in cells))
    generator = torch.Generator().manual_seed(seed)
    occupancy.mask = torch.rand(cells, generator=generator) < fraction
    return occupancy


def corners_by_loops(mask: torch.Tensor) -> set[int]:
    """Every vertex row (R0 * R1 * R2 with R = cells + 1) that is a corner of an occupied cell, one cell at a time."""
    r1, r2 = mask.shape[1] + 1, mask.shape[2] + 1
    rows = set()
    for i, j, k in mask.nonzero().tolist():
        for a, b, c in itertools.product((0, 1), repeat=3):
            rows.add(((i + a) * r1 + (j + b)) * r2 + (k + c))
    return rows


@pytest.mark.parametrize("fraction", [0.0, 0.05, 0.3, 1.0])
def test_vertex_rows_are_the_corners_of_the_occupied_cells(fraction):
    occupancy = random_occupancy((5, 6, 7), fraction)
    rows = occupancy.vertex_rows()
    assert rows.dtype == torch.int64 and bool((rows[1:] > rows[:-1]).all())
    assert set(rows.tolist()) == corners_by_loops(occupancy.mask)
    if fraction == 1.0:
        assert rows.numel() == 6 * 7 * 8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("step_fn", [cuda_ext.sparse_adam_step, reference.sparse_adam_step], ids=["op", "reference"])
def test_occupied_adam_on_random_gradients_steps_the_corner_rows_only(device, step_fn):
    """Gradients on every row (never zeros): the corner rows of occupied cells follow torch.optim.Adam, the others
    keep their values and (zero) moments; the rows on the device match the CPU's."""
    occupancy = random_occupancy((6, 5, 7), 0.1, seed=3).to(device)
    inside = torch.zeros(7 * 6 * 8, dtype=torch.bool, device=device)
    rows = occupancy.vertex_rows()
    assert rows.device.type == device and set(rows.tolist()) == corners_by_loops(occupancy.mask.cpu())
    inside[rows] = True
    assert 0 < int(inside.sum()) < inside.numel()
    generator = torch.Generator().manual_seed(2)
    start = [torch.randn(inside.numel(), c, generator=generator, dtype=torch.float64).to(device) for c in (1, 12)]
    grids = [torch.nn.Parameter(t.clone()) for t in start]
    copies = [torch.nn.Parameter(t.clone()) for t in start]
    groups = [{"params": grids, "lr": 0.05, "name": "grids"}]
    occupied = SparseGridAdam(groups, step_fn, betas=BETAS, eps=1e-15, rows_fn=OccupiedRows(occupancy))
    dense = torch.optim.Adam(copies, lr=0.05, betas=BETAS, eps=1e-15)
    for _ in range(3):
        for grid, copy in zip(grids, copies):
            grid.grad = torch.randn(grid.shape, generator=generator, dtype=torch.float64).to(device)
            copy.grad = grid.grad.clone()
        occupied.step()
        dense.step()
    for grid, copy, first in zip(grids, copies, start):
        torch.testing.assert_close(grid.detach()[inside], copy.detach()[inside], rtol=1e-12, atol=1e-12)
        assert torch.equal(grid.detach()[~inside], first[~inside])
        assert bool(occupied.state[grid]["exp_avg_sq"][~inside].eq(0).all())


def test_marched_samples_read_only_the_rows_of_occupied_cells():
    from test_model import make_model, rays_towards_centre

    model = make_model(grow_at=[], shading="per_sample", upsample=1)
    ball_density(model)
    model.refresh_occupancy()
    occupied = model.occupancy.mask.float().mean().item()
    assert 0.05 < occupied < 0.95  # some empty space to skip, some surfaces to read
    model.touched.enabled = True
    model.train()
    origins, directions = rays_towards_centre(256)
    out = model.render_rays(origins, directions)
    out["rgb"].square().mean().backward()  # the lookups only: the TV estimate samples the whole grid
    read = model.touched.take(model.grid_shape)
    allowed = torch.zeros(model.density.grid.shape[:3]).reshape(-1).bool()
    allowed[model.occupancy.vertex_rows()] = True
    assert read.numel() > 0 and bool(allowed[read].all())
    assert not bool(allowed.all())


def test_occupied_rows_are_computed_again_only_when_the_mask_changes(monkeypatch):
    occupancy = random_occupancy((4, 4, 4), 0.3)
    calls = []
    original = OccupancyGrid.vertex_rows
    monkeypatch.setattr(OccupancyGrid, "vertex_rows", lambda self: calls.append(1) or original(self))
    rows_fn = OccupiedRows(occupancy)
    first = rows_fn()
    assert rows_fn() is first and len(calls) == 1
    occupancy.mask = torch.ones(4, 4, 4, dtype=torch.bool)  # a refresh replaces the mask
    assert rows_fn().numel() == 125 and len(calls) == 2
    occupancy.mask[0] = False  # a checkpoint loads into the buffer in place
    assert rows_fn().numel() < 125 and len(calls) == 3


def test_a_step_is_dense_adam_on_the_occupied_rows_and_leaves_the_rest():
    from test_model import make_model, rays_towards_centre

    model = make_model(grow_at=[], shading="per_sample", upsample=1)
    ball_density(model)
    model.refresh_occupancy()
    grids = [model.density.grid, model.features.grid]
    copies = [torch.nn.Parameter(g.detach().clone()) for g in grids]
    occupied = SparseGridAdam(
        [{"params": grids, "lr": 0.1, "name": "grids"}],
        reference.sparse_adam_step,
        betas=BETAS,
        eps=1e-15,
        rows_fn=OccupiedRows(model.occupancy),
    )
    dense = torch.optim.Adam(copies, lr=0.1, betas=BETAS, eps=1e-15)
    inside = torch.zeros(model.density.grid.shape[:3]).reshape(-1).bool()
    inside[model.occupancy.vertex_rows()] = True
    model.train()
    for step in range(3):
        before = [g.detach().clone() for g in grids]
        origins, directions = rays_towards_centre(128, seed=step)
        out = model.render_rays(origins, directions)
        occupied.zero_grad(set_to_none=True)
        (out["rgb"].square().mean() + model.regularization()).backward()
        model.row_grads.scatter()  # the TV rows' gradients (model.tv_sparse_grad)
        for grid, copy in zip(grids, copies):
            copy.grad = grid.grad.clone()
        assert bool(grids[0].grad.reshape(-1)[~inside].ne(0).any())  # the TV estimate reached empty space
        occupied.step()
        dense.step()
        for grid, copy, old in zip(grids, copies, before):
            rows, wanted, old = (t.detach().reshape(-1, grid.shape[-1]) for t in (grid, copy, old))
            torch.testing.assert_close(rows[inside], wanted[inside], rtol=1e-6, atol=1e-7)
            assert torch.equal(rows[~inside], old[~inside])  # empty space keeps its values
            with torch.no_grad():
                copy.reshape(-1, grid.shape[-1])[~inside] = old[~inside]  # and so does the reference, for the next step
                for key in ("exp_avg", "exp_avg_sq"):
                    kept = occupied.state[grid][key].reshape(-1, grid.shape[-1])[~inside]
                    dense.state[copy][key].reshape(-1, grid.shape[-1])[~inside] = kept
    assert bool(occupied.state[grids[0]]["exp_avg"].reshape(-1)[~inside].eq(0).all())  # never stepped there


def test_training_with_occupied_adam_runs_and_learns(tmp_path):
    from test_train import read_metrics, run_train, tiny_overrides

    cache = tmp_path / "cache"
    runs = {}
    for mode in ("false", "occupied"):
        args = tiny_overrides(cache, 16) + [f"hydra.run.dir={tmp_path / mode}", f"train.sparse_adam={mode}"]
        result = run_train(args + ["train.eval_every=8"], timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        runs[mode] = read_metrics(tmp_path / mode)
    assert runs["occupied"]["psnr"] == pytest.approx(runs["false"]["psnr"], abs=0.5)
    shares = runs["occupied"]["occupancy"]  # the final occupancy grid: its cells and the rows the Adam stepped
    assert 0 < shares["cells"] <= 1 and 0 < shares["corner_rows"] <= 1
    result = run_train(tiny_overrides(cache, 4) + [f"hydra.run.dir={tmp_path / 'bad'}", "train.sparse_adam=maybe"])
    assert result.returncode != 0 and "expected false, occupied or nonzero" in result.stderr


def test_a_dense_adam_checkpoint_resumes_with_occupied_adam(tmp_path):
    """The optimiser's state has torch.optim.Adam's keys: a run checkpointed with dense Adam continues with the
    occupied Adam (and the other way round), its moments' step counts going on as dense Adam's do."""
    from test_train import run_train, tiny_overrides

    from training.checkpoint import load_checkpoint

    cache, counts = tmp_path / "cache", {}
    for first, then in (("false", "false"), ("false", "occupied"), ("occupied", "false")):
        run_dir = tmp_path / f"{first}_{then}"
        keep = [f"hydra.run.dir={run_dir}", "train.keep_resumable=true"]
        result = run_train(tiny_overrides(cache, 10) + keep + [f"train.sparse_adam={first}"], timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        resumed = tiny_overrides(cache, 16) + keep + [f"train.sparse_adam={then}", "train.resume=true"]
        result = run_train(resumed, timeout=300)
        assert result.returncode == 0, result.stdout + result.stderr
        state = load_checkpoint(run_dir / "checkpoints" / "last.pt")
        assert state["step"] == 16
        counts[first, then] = [float(entry["step"]) for entry in state["optimizer"]["state"].values()]
    assert counts["false", "occupied"] == counts["false", "false"] == counts["occupied", "false"]
    assert max(counts["false", "false"]) == 16


def test_the_trainers_occupied_adam_steps_the_fine_pool_by_gradient_and_keeps_its_gradient():
    """``train.sparse_adam=occupied`` (training.optim.new_optimizer): the grids by the occupied rows, as above; the
    fine pool only on its elements with a gradient (``masked_adam_step``), its gradient left zero and kept for
    the next backward; the decoder densely."""
    from types import SimpleNamespace

    from training.distributed import Group
    from training.optim import new_optimizer

    occupancy = random_occupancy((6, 5, 7), 0.2, seed=4)
    inside = torch.zeros(7 * 6 * 8, dtype=torch.bool)
    inside[occupancy.vertex_rows()] = True
    generator = torch.Generator().manual_seed(5)
    grid = torch.nn.Parameter(torch.randn(inside.numel(), 12, generator=generator, dtype=torch.float64))
    fine = torch.nn.Parameter(torch.randn(300, 13, generator=generator, dtype=torch.float64))
    decoder = torch.nn.Parameter(torch.randn(4, 3, generator=generator, dtype=torch.float64))
    groups = [
        {"params": [grid], "lr": 0.05, "name": "grids"},
        {"params": [decoder], "lr": 0.01, "name": "decoder"},
        {"params": [fine], "lr": 0.02, "name": "fine"},
    ]
    model = SimpleNamespace(param_groups=lambda *rates: groups, occupancy=occupancy, touched=SimpleNamespace())
    ops = SimpleNamespace(sparse_adam_step=cuda_ext.sparse_adam_step, masked_adam_step=cuda_ext.masked_adam_step)
    cfg = {"lr": 0.05, "lr_decoder": 0.01, "sparse_adam": "occupied", "adam_eps": 1e-15}
    trainer = SimpleNamespace(train_cfg=SimpleNamespace(get=cfg.get, **cfg), model=model, group=Group(), ops=ops)
    optimizer = new_optimizer(trainer, BETAS)
    grid_copy = torch.nn.Parameter(grid.detach().clone())
    dense = torch.optim.Adam([grid_copy], lr=0.05, betas=BETAS, eps=1e-15)
    values, exp_avg, exp_avg_sq = fine.detach().clone(), torch.zeros_like(fine), torch.zeros_like(fine)
    fine.grad = torch.randn(fine.shape, generator=generator, dtype=torch.float64)  # a backward never stepped
    kept = None
    for step in range(1, 4):
        optimizer.zero_grad(set_to_none=True)
        if kept is None:
            assert fine.grad is None  # no step left it zero: dropped
            fine.grad = kept = torch.zeros_like(fine)  # the first backward's
        assert fine.grad is kept and bool(kept.eq(0).all())  # left zero by the last step, not dropped
        assert decoder.grad is None and (grid.grad is None) == (step == 1)  # the grids' kept too (test below)
        live = torch.rand(fine.shape, generator=generator) < 0.3
        kept.add_(torch.randn(fine.shape, generator=generator, dtype=torch.float64) * live)  # what a backward adds
        reference.masked_adam_step(values, kept.clone(), exp_avg, exp_avg_sq, step, 0.02, *BETAS, 1e-15)
        grid.grad = torch.randn(grid.shape, generator=generator, dtype=torch.float64)
        grid_copy.grad = grid.grad.clone()
        decoder.grad = torch.randn(decoder.shape, generator=generator, dtype=torch.float64)
        optimizer.step()
        dense.step()
        assert bool(kept.eq(0).all())
    torch.testing.assert_close(fine.detach(), values, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(optimizer.state[fine]["exp_avg_sq"], exp_avg_sq, rtol=1e-13, atol=0)
    torch.testing.assert_close(grid.detach()[inside], grid_copy.detach()[inside], rtol=1e-12, atol=1e-12)
    assert bool(optimizer.state[grid]["exp_avg_sq"][~inside].eq(0).all())


@pytest.mark.parametrize("device", DEVICES)
def test_occupied_adam_keeps_the_grids_gradient_while_the_rows_hold(device):
    """``keep_listed``: one gradient tensor per grid while the occupied rows hold, its listed rows left zero by each
    step, the values exactly those of fresh gradients each step; lookups also reach rows outside the list (as the
    TV estimate does), whose sums stay unstepped, so after an occupancy refresh the kept gradient must be dropped."""
    from test_grid_interpolate import random_points

    def train(kept: bool):
        occupancy = random_occupancy((6, 5, 7), 0.3, seed=6).to(device)
        draws = torch.Generator().manual_seed(8)
        grid = torch.nn.Parameter(torch.randn(7, 6, 8, 12, generator=draws, dtype=torch.float64).to(device))
        rows_fn = OccupiedRows(occupancy)
        groups = [{"params": [grid], "lr": 0.05, "name": "grids"}]
        optimizer = SparseGridAdam(groups, cuda_ext.sparse_adam_step, betas=BETAS, eps=1e-15, rows_fn=rows_fn,
                                   keep_listed=kept)  # fmt: skip
        pointers = []
        for step in range(6):
            if step == 3:  # a refresh replaces the mask
                occupancy.mask = random_occupancy((6, 5, 7), 0.3, seed=9).mask.to(device)
            optimizer.zero_grad(set_to_none=True)
            assert (grid.grad is not None) == (kept and step not in (0, 3))
            points = random_points(400, draws, device=device, dtype=torch.float64)
            (cuda_ext.grid_interpolate(grid, points) ** 2).sum().backward()
            pointers.append(grid.grad.data_ptr())
            optimizer.step()
            listed = grid.grad.view(-1, 12)[rows_fn()]
            assert bool(listed.eq(0).all()) == kept
        return grid.detach(), pointers

    kept, pointers = train(True)
    fresh, _ = train(False)
    torch.testing.assert_close(kept, fresh, rtol=0, atol=1e-14)  # float64: the same sums (atomics' order on CUDA)
    assert pointers[0] == pointers[1] == pointers[2] and pointers[3] == pointers[4] == pointers[5]


def test_keep_listed_needs_rows():
    grid = torch.nn.Parameter(torch.randn(3, 3, 3, 2))
    with pytest.raises(ValueError, match="keep_listed: needs rows_fn"):
        SparseGridAdam([{"params": [grid], "name": "grids"}], cuda_ext.sparse_adam_step, keep_listed=True)
