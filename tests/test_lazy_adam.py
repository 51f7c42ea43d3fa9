"""training.lazy_adam.LazyGridAdam (``train.sparse_adam=exact``): stepping only the touched rows and replaying the
others' zero-gradient steps when they are read must follow dense ``torch.optim.Adam``."""

from __future__ import annotations

import math

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from training.lazy_adam import WINDOW, LazyGridAdam

BETAS = (0.9, 0.99)
# (step, replay) of each backend: our kernels and the references
STEP_FNS = [
    (cuda_ext.sparse_adam_step, cuda_ext.adam_replay_rows),
    (reference.sparse_adam_step, reference.adam_replay_rows),
]


def grids(rows: int, seed: int = 0, dtype=torch.float64) -> list[torch.nn.Parameter]:
    """A density-like (rows, 1) and a features-like (rows, 5) parameter: the same rows, as the model's grids."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(rows, c, generator=generator, dtype=dtype)) for c in (1, 5)]


def schedule(step: int, steps: int) -> float:
    return 0.05 * 0.1 ** (step / steps)  # the trainer's exponential decay


def run_both(steps, rows, read_fraction, eps, step_fn, dtype=torch.float64, seed=1, check_reads=True):
    """Dense Adam and the lazy one on the same random sparse gradients; each step reads a random subset of rows
    (the lazy optimiser catches them up first, and the values read must be dense Adam's) and has gradients on a
    subset of those. Returns the (dense, lazy) parameters and optimisers after the lazy one's flush."""
    dense_params, lazy_params = grids(rows, dtype=dtype), grids(rows, dtype=dtype)
    dense = torch.optim.Adam([{"params": dense_params, "lr": 0.05, "name": "grids"}], betas=BETAS, eps=eps)
    stepped = {}
    lazy = LazyGridAdam(
        [{"params": lazy_params, "lr": 0.05, "name": "grids"}], *step_fn, lambda: stepped["rows"], betas=BETAS, eps=eps
    )
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for optimizer in (dense, lazy):
            optimizer.param_groups[0]["lr"] = schedule(step, steps)
        read = torch.randperm(rows, generator=generator)[: max(1, int(rows * read_fraction))].sort().values
        lazy.catch_up_rows(torch.cat([read, read[: len(read) // 3]]))  # repeats allowed
        if check_reads:
            for d, z in zip(dense_params, lazy_params):
                torch.testing.assert_close(z.detach()[read], d.detach()[read], rtol=1e-9, atol=1e-12)
        hit = read[torch.rand(len(read), generator=generator) < 0.7]  # read rows with a gradient (others: zero)
        stepped["rows"] = read  # the model's marks: every row a lookup read
        for d, z in zip(dense_params, lazy_params):
            grad = torch.zeros_like(d)
            grad[hit] = (torch.randn(len(hit), d.shape[1], generator=generator, dtype=torch.float64) * 1e-3).to(dtype)
            d.grad, z.grad = grad.clone(), grad.clone()
        dense.step()
        lazy.step()
    lazy.flush()
    return dense_params, lazy_params, dense, lazy


@pytest.mark.parametrize("step_fn", STEP_FNS, ids=["op", "reference"])
def test_lazy_adam_follows_dense_adam_at_every_read_and_after_a_flush(step_fn):
    # eps 1e-30: the replay leaves out Adam's eps against sqrt(v_hat), so without it the two are equal up to
    # float64 rounding (the presets' 1e-15 below)
    dense_params, lazy_params, dense, lazy = run_both(60, 40, 0.2, 1e-30, step_fn)
    for d, z in zip(dense_params, lazy_params):
        torch.testing.assert_close(z.detach(), d.detach(), rtol=1e-9, atol=1e-12)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(lazy.state[z][key], dense.state[d][key], rtol=1e-9, atol=1e-15)
        assert float(lazy.state[z]["step"]) == float(dense.state[d]["step"]) == 60
    moved = dense_params[1].detach() - grids(40)[1].detach()
    assert bool((moved.abs() > 0).all())  # every row moved (momentum): a masked Adam would fail the comparison


def test_rows_left_longer_than_the_window_still_follow_dense_adam():
    dense_params, lazy_params, _, _ = run_both(WINDOW + 80, 12, 0.1, 1e-30, STEP_FNS[1])
    for d, z in zip(dense_params, lazy_params):
        torch.testing.assert_close(z.detach(), d.detach(), rtol=1e-9, atol=1e-12)


def test_the_presets_eps_moves_the_replay_by_a_relative_eps_over_sqrt_v():
    dense_params, lazy_params, _, _ = run_both(60, 40, 0.2, 1e-15, STEP_FNS[0], check_reads=False)
    for d, z in zip(dense_params, lazy_params):  # gradients of 1e-3 over steps of ~0.05: well under 1e-9
        torch.testing.assert_close(z.detach(), d.detach(), rtol=0, atol=1e-9)


def test_float32_grids_are_within_float_rounding():
    dense_params, lazy_params, _, _ = run_both(40, 30, 0.25, 1e-15, STEP_FNS[0], dtype=torch.float32, check_reads=False)
    for d, z in zip(dense_params, lazy_params):
        torch.testing.assert_close(z.detach(), d.detach(), rtol=1e-5, atol=2e-6)


def test_a_large_eps_is_what_the_replay_leaves_out():
    # Adam's eps 1e-8 against elements whose gradients reach 1e-6 and less: dense Adam's steps there are damped
    # by up to 1%, the replay's are not (hence train.sparse_adam=exact requires train.adam_eps <= 1e-12)
    dense_params, lazy_params, _, _ = run_both(40, 30, 0.25, 1e-8, STEP_FNS[1], check_reads=False)
    error = max(float((d - z).detach().abs().max()) for d, z in zip(dense_params, lazy_params))
    assert 1e-6 < error < 0.05


def test_checkpoint_state_is_torch_adams_and_loads_back():
    _, lazy_params, dense, lazy = run_both(20, 16, 0.3, 1e-30, STEP_FNS[1])
    saved = lazy.state_dict()
    fresh = LazyGridAdam(
        [{"params": lazy_params, "lr": 0.05, "name": "grids"}], *STEP_FNS[1], lambda: None, betas=BETAS
    )
    fresh.load_state_dict(saved)
    assert fresh._done == 20 and bool((fresh._last == 20).all())
    plain = torch.optim.Adam([{"params": lazy_params, "lr": 0.05, "name": "grids"}], betas=BETAS)
    plain.load_state_dict(saved)  # the same keys and shapes as torch.optim.Adam's
    assert set(plain.state[lazy_params[1]]) == {"step", "exp_avg", "exp_avg_sq"}


def test_replay_sum_is_the_closed_form_of_the_skipped_steps():
    params = grids(4)
    lazy = LazyGridAdam([{"params": params, "lr": 0.1, "name": "grids"}], *STEP_FNS[1], lambda: torch.arange(1))
    rates = []
    for step in range(1, 9):
        lr = 0.1 / step
        lazy.param_groups[0]["lr"] = lr
        for p in params:
            p.grad = torch.ones_like(p)
        lazy.step()
        rates.append(lr * math.sqrt(1 - 0.999**step) / (1 - 0.9**step))
    ratio = 0.9 / math.sqrt(0.999)
    for t0 in range(8):  # rows last stepped at t0 replay steps t0+1 .. 8
        expected = sum(rates[s - 1] * ratio ** (s - t0) for s in range(t0 + 1, 9))
        assert lazy._replay[t0].item() == pytest.approx(expected, rel=1e-12)
    assert lazy._replay[8].item() == 0.0


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"betas": (0.99, 0.9)}, "betas"),
        ({"eps": 0.0}, "eps"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LazyGridAdam([{"params": grids(3), "name": "grids"}], *STEP_FNS[1], lambda: None, **kwargs)


def test_grids_must_share_their_rows():
    params = [torch.nn.Parameter(torch.zeros(3, 1)), torch.nn.Parameter(torch.zeros(4, 2))]
    with pytest.raises(ValueError, match="share their rows"):
        LazyGridAdam([{"params": params, "name": "grids"}], *STEP_FNS[1], lambda: None)
    with pytest.raises(ValueError, match="'grids'"):
        LazyGridAdam([{"params": grids(3)}], *STEP_FNS[1], lambda: None)


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("lazy_scene")


def train_tiny(run_dir, cache, *extra: str, iters: int = 16) -> dict:
    from test_train import read_metrics, run_train, tiny_overrides

    from training.checkpoint import load_checkpoint

    custom = "ops=custom" in extra  # our kernels save the grids for their backward: in-place catch-ups must precede
    args = [a for a in tiny_overrides(cache, iters) if not (custom and a == "ops=torch")] + [
        "train.adam_eps=1e-30",  # the replay leaves out eps: without it the runs agree to float32 rounding
        "train.keep_resumable=true",
        "train.eval_every=8",
        "train.checkpoint_every=8",
        f"hydra.run.dir={run_dir}",
        *extra,
    ]
    result = run_train(args, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return {"metrics": read_metrics(run_dir), "state": load_checkpoint(run_dir / "checkpoints" / "last.pt")}


# the references (deferred shading), and our kernels with per-sample shading as the presets run them: their lookups
# save the grids for backward, so a catch-up after the forward would fail autograd's version check
SETUPS = {"torch": (), "custom": ("ops=custom", "model.shading=per_sample", "model.upsample=1")}


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_training_with_exact_sparse_adam_is_training_with_dense_adam(tmp_path, tiny_cache, setup):
    """The whole loop (growth, occupancy refreshes, TV, a periodic evaluation, a checkpoint): the same grids,
    moments and held-out PSNR as dense Adam, to float32 rounding. (With the presets' eps 1e-15, the few feature
    elements whose gradients are as small as eps step up to ~2x further than dense Adam's damped steps.)"""
    extra = SETUPS[setup]
    dense = train_tiny(tmp_path / "dense", tiny_cache, *extra)
    exact = train_tiny(tmp_path / "exact", tiny_cache, *extra, "train.sparse_adam=exact")
    masked = train_tiny(tmp_path / "masked", tiny_cache, *extra, "train.sparse_adam=true")
    assert exact["metrics"]["psnr"] == pytest.approx(dense["metrics"]["psnr"], abs=1e-3)
    for key in ("density.grid", "features.grid"):
        reference_grid = dense["state"]["model"][key]
        torch.testing.assert_close(exact["state"]["model"][key], reference_grid, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(masked["state"]["model"][key], reference_grid, rtol=1e-4, atol=1e-4)
    dense_moments, exact_moments = (run["state"]["optimizer"]["state"] for run in (dense, exact))
    for index, moments in dense_moments.items():
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(exact_moments[index][name], moments[name], rtol=1e-4, atol=1e-9)
    history = [(entry["step"], round(entry["psnr"], 3)) for entry in exact["metrics"]["eval_history"]]
    assert history == [(entry["step"], round(entry["psnr"], 3)) for entry in dense["metrics"]["eval_history"]]


def test_exact_needs_a_small_adam_eps_and_one_process(tmp_path, tiny_cache):
    from test_train import run_train, tiny_overrides

    args = tiny_overrides(tiny_cache, 4) + [f"hydra.run.dir={tmp_path}", "train.sparse_adam=exact"]
    result = run_train(args + ["train.adam_eps=1e-8"])
    assert result.returncode != 0 and "train.adam_eps <= 1e-12" in result.stderr
    result = run_train(args + ["train.adam_eps=1e-15", "train.sparse_adam=sometimes"])
    assert result.returncode != 0 and "expected false, true (masked), exact, occupied or nonzero" in result.stderr


def test_a_resumed_exact_run_follows_a_resumed_dense_one(tmp_path, tiny_cache):
    """10 steps, then resumed from that checkpoint to 16 (the schedule of a 10-step run, then of 16): the
    checkpoint's state is torch.optim.Adam's, so resuming it with the replaying Adam continues as dense Adam does."""
    # no density TV: the growth's resample leaves equal neighbours on the density grid's faces, where dense Adam
    # sees a TV gradient of exactly 0 and the replay (exact to float32 rounding: 7e-9 there) ~1e-9, which Adam at
    # eps 1e-30 turns into a whole step of lr: a test of rounding, not of the replay (found 2026-11-27 when the TV's
    # cells changed; the run from scratch above keeps both TV terms)
    runs = {}
    for mode in ("false", "exact"):
        extra = (f"train.sparse_adam={mode}", "model.tv_density=0")
        train_tiny(tmp_path / mode, tiny_cache, *extra, iters=10)
        runs[mode] = train_tiny(tmp_path / mode, tiny_cache, *extra, "train.resume=true")
        assert runs[mode]["state"]["step"] == 16
    for key in ("density.grid", "features.grid"):
        exact, dense = runs["exact"]["state"]["model"][key], runs["false"]["state"]["model"][key]
        torch.testing.assert_close(exact, dense, rtol=1e-4, atol=1e-4)


def test_new_optimizer_builds_the_replaying_adam_and_hooks_it_into_the_model():
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from test_model import make_model

    from training.config import ConfigError
    from training.optim import new_optimizer, sparse_adam_mode

    model = make_model(grow_at=[])
    cfg = OmegaConf.create({"lr": 0.1, "lr_decoder": 1e-3, "adam_eps": 1e-15, "sparse_adam": "exact"})
    one = SimpleNamespace(active=False, world=1)
    trainer = SimpleNamespace(train_cfg=cfg, model=model, group=one, ops=model.ops, device=torch.device("cpu"))
    optimizer = new_optimizer(trainer, BETAS)
    assert isinstance(optimizer, LazyGridAdam) and model.touched.enabled
    assert model.touched.reader == optimizer.catch_up and model.touched.flusher == optimizer.flush
    trainer.group = SimpleNamespace(active=True, world=2, union_=lambda mask: None)
    trainer.synced_rows = torch.arange(3)
    optimizer = new_optimizer(trainer, BETAS)  # under torchrun: the synced union, caught up before its step
    assert optimizer.catch_up_stepped and torch.equal(optimizer.rows_fn(), torch.arange(3))
    assert model.touched.union == trainer.group.union_
    trainer.train_cfg.dist_grad_sync = "dense"
    with pytest.raises(ConfigError, match="train.sparse_adam: exact under torchrun steps the touched rows"):
        new_optimizer(trainer, BETAS)
    assert [sparse_adam_mode(v) for v in (False, "false", True, "true", "exact")] == ["off"] * 2 + ["masked"] * 2 + [
        "exact"
    ]
    with pytest.raises(ValueError, match="train.sparse_adam"):
        sparse_adam_mode("sometimes")


@pytest.mark.parametrize(
    "device,fused", [("cpu", False), ("cpu", True), pytest.param("cuda", None, marks=pytest.mark.requires_cuda)]
)
def test_dense_groups_step_as_torch_adam_across_a_load(device, fused):
    """adam_step_dense (the decoder's group; fused by default on CUDA, its step counts mirrored on the device)
    follows torch.optim.Adam, and after a load moves the CPU counts, the mirrors follow them."""
    from training.lazy_adam import adam_step_dense

    generator = torch.Generator().manual_seed(4)
    ours = [torch.randn(shape, generator=generator).to(device).requires_grad_() for shape in ((7, 3), (5,))]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    torch_adam = torch.optim.Adam(theirs, lr=0.01, betas=BETAS, eps=1e-8)
    states, group = {p: {} for p in ours}, {"betas": BETAS, "lr": 0.01, "eps": 1e-8}
    for step in range(6):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=generator).to(device)
            b.grad = a.grad.clone()
        with torch.no_grad():  # as the optimisers' step
            adam_step_dense(states, ours, group, fused)
        torch_adam.step()
        if step == 2:  # a checkpoint's counts loaded: back to 1
            for state in (*states.values(), *torch_adam.state.values()):
                state["step"].fill_(1)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert [int(states[p]["step"]) for p in ours] == [4, 4] and states[ours[0]]["step"].device.type == "cpu"
