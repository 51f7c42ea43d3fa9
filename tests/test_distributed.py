"""Data-parallel training under torchrun on the CPU (gloo): two ranks train exactly what one process trains with
the same global batch, exchange gradients as the dense average does, share the evaluations, and only rank 0 writes
(what goes wrong across ranks: tests/test_distributed_failures.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data.samplers import RayBatch
from training.checkpoint import load_checkpoint
from training.distributed import Group

REPO = Path(__file__).resolve().parents[1]


def tiny(cache: Path, run_dir: Path, iters: int) -> list[str]:
    from test_train import tiny_overrides

    return tiny_overrides(cache, iters) + [
        f"hydra.run.dir={run_dir}",
        "model.upsample=1",
        "train.batch_rays=64",
        "train.turntable_frames=0",
        "train.dist_timeout=30",
        "train.keep_resumable=true",  # the finished run keeps checkpoints/last.pt, compared below
    ]


def torchrun(
    ranks: int, args: list[str], timeout: float = 240, script: str = "train.py", **popen
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*command, script, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env, **popen
    )


def ranks_output(result: subprocess.CompletedProcess) -> str:
    """What the ranks printed, for a failed job's message: torchrun's own traceback (which says only that a child
    failed) left out, so a rank's last words (an error, an abort message) are not cut off by it."""
    launcher = ("torch/distributed/elastic", "torch/distributed/run.py", "torch/distributed/launcher")
    lines = [line for line in (result.stdout + result.stderr).splitlines() if not any(p in line for p in launcher)]
    return "\n".join(lines)[-4000:]


def test_shards_of_a_batch_make_up_the_batch():
    batch = RayBatch(torch.rand(8, 3), torch.rand(8, 3), torch.rand(8, 3), alpha=torch.rand(8), jitter=torch.rand(8))
    shards = [batch.shard(rank, 2) for rank in range(2)]
    torch.testing.assert_close(torch.cat([s.origins for s in shards]), batch.origins)
    torch.testing.assert_close(torch.cat([s.jitter for s in shards]), batch.jitter)
    assert shards[0].views is None and shards[1].alpha.shape == (4,)
    with pytest.raises(ValueError, match="does not split into 3"):
        batch.shard(0, 3)


def test_one_process_group_is_inert():
    group = Group()
    parameter = torch.nn.Parameter(torch.ones(3))
    parameter.grad = torch.full((3,), 2.0)
    group.average_gradients([parameter])
    assert group.is_main and not group.active and parameter.grad.tolist() == [2.0, 2.0, 2.0]
    assert group.mean(1.5, 2.5) == (1.5, 2.5)


def single(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=240)


def assert_same_model(one: dict, two: dict) -> None:
    assert one["step"] == two["step"] == 12
    for name, value in one["model"].items():
        if value.is_floating_point():
            torch.testing.assert_close(two["model"][name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_two_gloo_ranks_train_what_one_process_trains(tmp_path):
    cache = tmp_path / "cache"
    mid_run = ["train.checkpoint_every=6", "train.keep_checkpoints=2"]  # keeps step 6's, resumed below
    result = single(tiny(cache, tmp_path / "one", 12) + mid_run)
    assert result.returncode == 0, result.stderr[-2000:]
    # dense Adam under data parallel: the grids' Adam sharded over the ranks (training.sharded_adam)
    pair = torchrun(2, tiny(cache, tmp_path / "two", 12) + mid_run)
    assert pair.returncode == 0, ranks_output(pair)
    # rank 0 alone wrote the outputs and the log; train.parallel=auto took data parallel on CPUs
    assert (tmp_path / "two" / "metrics.json").is_file() and pair.stdout.count("eval on") == 1
    assert pair.stdout.count("train.parallel=auto: data parallel over 2 ranks (the space split runs on CUDA") == 1
    metrics = json.loads((tmp_path / "two" / "metrics.json").read_text())
    assert metrics["parallel"] == {"ranks": 2, "split": "data"}
    one = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.pt", map_location="cpu")
    assert_same_model(one, load_checkpoint(tmp_path / "two" / "checkpoints" / "last.pt", map_location="cpu"))
    # checkpoints cross over: the sharded job's step-6 checkpoint (moments gathered to rank 0) continues in one
    # process, one process's continues in the sharded job, both to one process's step 12
    for source, target, launch in (("two", "resume_one", single), ("one", "resume_two", lambda a: torchrun(2, a))):
        folder = tmp_path / target / "checkpoints"
        folder.mkdir(parents=True)
        (kept,) = (tmp_path / source / "checkpoints").glob("step_*.pt")  # the step-6 one
        shutil.copy(kept, folder / "last.pt")
        result = launch(tiny(cache, tmp_path / target, 12) + ["train.resume=true"])
        assert result.returncode == 0, ranks_output(result)
        assert_same_model(one, load_checkpoint(folder / "last.pt", map_location="cpu"))


def test_profiled_gloo_ranks_each_write_their_profile(tmp_path):
    # the touched-rows sync (the sparse Adams under torchrun) is covered below; here the profiled steps, which must
    # train the same model as one process does unprofiled
    cache = tmp_path / "cache"
    result = single(tiny(cache, tmp_path / "one", 12))
    assert result.returncode == 0, result.stderr[-2000:]
    pair = torchrun(2, tiny(cache, tmp_path / "two", 12) + ["train.profile=true"])  # the same math, timed
    assert pair.returncode == 0, ranks_output(pair)
    # each rank writes its own step profile, with the time the gradients' average took
    for name in ("profile.json", "profile_rank1.json"):
        report = json.loads((tmp_path / "two" / name).read_text())
        assert report["steps"] == 12 and report["per_step_ms"]["grad_sync"] > 0, name
    assert pair.stdout.count("profile over 12 steps") == 1  # printed by rank 0 alone
    one, two = (
        load_checkpoint(tmp_path / name / "checkpoints" / "last.pt", map_location="cpu") for name in ("one", "two")
    )
    assert_same_model(one, two)


@pytest.mark.parametrize("mode", ["occupied", "nonzero"])
def test_row_sparse_adam_on_two_gloo_ranks_trains_what_one_process_trains(tmp_path, mode):
    # train.sparse_adam=occupied under torchrun: every rank holds the same occupancy grid, so every rank steps the
    # same rows (no exchange of rows), with the gradients the touched-rows sync averaged; nonzero: every rank holds
    # the same averaged gradients, so steps the same elements
    cache, occupied = tmp_path / "cache", [f"train.sparse_adam={mode}"]
    result = single(tiny(cache, tmp_path / "one", 12) + occupied)
    assert result.returncode == 0, result.stderr[-2000:]
    pair = torchrun(2, tiny(cache, tmp_path / "two", 12) + occupied)
    assert pair.returncode == 0, ranks_output(pair)
    one, two = (
        load_checkpoint(tmp_path / name / "checkpoints" / "last.pt", map_location="cpu") for name in ("one", "two")
    )
    assert_same_model(one, two)


def _average_both_ways(rank: int, world: int, init_file: str, results: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        generator = torch.Generator().manual_seed(rank)
        grids = []
        for channels in (1, 5):  # two grids of one voxel count share the union of touched voxels
            grad = torch.zeros(6, 7, 8, channels)
            touched = torch.randperm(6 * 7 * 8, generator=generator)[:20]  # each rank touches its own voxels
            grad.view(-1, channels)[touched] = torch.randn(20, channels, generator=generator)
            grids.append(torch.nn.Parameter(torch.randn(6, 7, 8, channels)))
            grids[-1].grad = grad
        other = torch.nn.Parameter(torch.zeros(3))
        other.grad = torch.randn(3, generator=generator)
        lonely = torch.nn.Parameter(torch.zeros(4, 2))  # no gradient on this rank: counts as zeros
        if rank == 0:
            lonely.grad = torch.randn(4, 2, generator=generator)
        dense = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in (*grids, other, lonely)]
        for tensor in dense:
            dist.all_reduce(tensor)
            tensor.div_(world)
        saved = [p.grad.clone() if p.grad is not None else None for p in (*grids, lonely)]
        Group(rank, world, rank).average_gradients([other], row_sparse=[*grids, lonely])
        touched = [p.grad.clone() for p in (*grids, other, lonely)]
        # the same from the model's marks: a superset of the rows with a gradient (a few read with zero gradient)
        for parameter, grad in zip((*grids, lonely), saved):
            parameter.grad = grad
        marks = torch.stack([p.grad.reshape(6 * 7 * 8, -1).ne(0).any(1) for p in grids]).any(0)  # both grids' rows
        marks[torch.randperm(6 * 7 * 8, generator=generator)[:5]] = True
        mine = marks.nonzero().squeeze(1)
        union = Group(rank, world, rank).average_gradients([], row_sparse=[*grids, lonely], marks=marks)
        marked = [p.grad for p in grids]
        smallest = Group(rank, world, rank).minimum(10 + rank)
        torch.save(
            {"dense": dense, "touched": touched, "marked": marked, "union": union, "mine": mine, "left": marks.any()}
            | {"smallest": smallest},
            f"{results}.{rank}",
        )
        dist.barrier()  # both ranks are done before either tears gloo down (one leaving first aborted the other once)
    finally:
        dist.destroy_process_group()


def test_touched_rows_average_equals_the_dense_average(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_average_both_ways, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2)
    results = [torch.load(tmp_path / f"out.{rank}") for rank in range(2)]
    union = torch.unique(torch.cat([result["mine"] for result in results]))
    for result in results:
        for index, (dense, touched) in enumerate(zip(result["dense"], result["touched"])):
            assert touched.abs().sum() > 0, f"parameter {index}: no gradient arrived"
            torch.testing.assert_close(touched, dense, rtol=1e-6, atol=1e-7, msg=f"parameter {index}")
        # from the marks: the same averages for the grids of the marks' row count, the union of both ranks' marks
        for index, (dense, marked) in enumerate(zip(result["dense"], result["marked"])):
            torch.testing.assert_close(marked, dense, rtol=1e-6, atol=1e-7, msg=f"marked parameter {index}")
        assert torch.equal(result["union"], union) and not result["left"]  # the marks start the next step empty
        assert result["smallest"] == 10  # Group.minimum: rank 0's 10 against rank 1's 11


def test_gradient_exchange_bench_checks_every_exchange_against_the_ranks_mean(tmp_path):
    # bench/bench_grad_exchange.py asserts each whole exchange (dense, touched rows, occupied rows) equals the mean
    # of the ranks' gradients before timing it: on gloo this is that check, at a size where the rows differ
    out = tmp_path / "exchange.json"
    args = [
        "--device",
        "cpu",
        "--size",
        "12",
        "--repeats",
        "1",
        "--touched",
        "0.2",
        "--run-length",
        "4",
        "--json",
        str(out),
    ]
    result = torchrun(2, args, timeout=120, script="bench/bench_grad_exchange.py")
    assert result.returncode == 0, ranks_output(result)
    report = json.loads(out.read_text())
    assert [r["variant"] for r in report["results"]] == [
        "dense",
        "touched",
        "occupied",
        "occupied: pack",
        "occupied: pack, index_select alone",
        "occupied: pack (indexing)",
        "occupied: all-reduce",
        "occupied: copy back",
        "occupied: copy back (index_put_)",
    ]
    assert all(r["ms"] > 0 and r["slowest_rank_ms"] >= r["ms"] for r in report["results"])
    assert 0 < report["occupied_rows"] < 12**3 and 0 < report["union_rows"] < 12**3


def test_gradient_exchange_bench_refuses_a_single_process():
    result = subprocess.run(
        [sys.executable, "bench/bench_grad_exchange.py", "--device", "cpu"], cwd=REPO, capture_output=True, text=True
    )
    assert result.returncode != 0 and "torchrun" in result.stderr


# ------------------------------------------------------------------------ the periodic evaluation, shared


def test_rank_views_share_the_views_out():
    from training.evaluation import rank_views

    views = [0, 3, 7, 12, 20]
    shares = [rank_views(views, rank, 2) for rank in range(2)]
    assert shares == [[0, 7, 20], [3, 12]]  # disjoint, all of them, rank 0 the first (its image is logged)
    assert rank_views(views, 0, 1) == views and rank_views([4], 1, 2) == []
    assert Group().total(torch.tensor([1.5, -2.0], dtype=torch.float64)).tolist() == [1.5, -2.0]


@pytest.mark.parametrize("rank", [0, 1])
def test_periodic_eval_renders_this_ranks_share_and_rank_0_reports_all(monkeypatch, rank):
    """Each rank renders only its views; the all-reduce of the score rows (the other rank's added here) gives rank
    0 every view's score, so its entry is the one-process evaluation's."""
    from types import SimpleNamespace

    import numpy as np

    from training import evaluation

    def fake_evaluate(trainer, views, write_images):
        rendered.append(list(views))
        per_view = [{"view": v, "psnr": 20.0 + v, "ssim": 0.5 + v / 100} for v in views]
        return {"per_view": per_view, "seconds": 0.25, "first_rgb": np.zeros((2, 2, 3), np.float32)}

    views = evaluation.spread_views(9, 5)  # [0, 2, 4, 6, 8]
    other = [v for v in views if v not in views[rank::2]]

    def total(scores):  # the other rank's rows, as the all-reduce adds them
        for v in other:
            scores[views.index(v)] = torch.tensor([20.0 + v, 0.5 + v / 100], dtype=torch.float64)
        return scores

    rendered, logged = [], []
    monkeypatch.setattr(evaluation, "evaluate", fake_evaluate)
    group = SimpleNamespace(rank=rank, world=2, is_main=rank == 0, total=total)
    trainer = SimpleNamespace(
        group=group, step=40, train_seconds=3.0, eval_history=[],
        train_cfg=SimpleNamespace(eval_views=5), eval_scene=SimpleNamespace(num_views=9),
        tensorboard=SimpleNamespace(evaluation=lambda *args: logged.append(args)),
    )  # fmt: skip
    evaluation.periodic_eval(trainer)
    assert rendered == [views[rank::2]]
    if rank == 1:
        assert trainer.eval_history == [] and logged == []  # rank 0 reports
        return
    (entry,) = trainer.eval_history
    assert entry["psnr"] == pytest.approx(20.0 + np.mean(views)) and entry["views"] == 5
    assert entry["psnr_worst10"] == pytest.approx(20.0) and entry["ssim"] == pytest.approx(0.5 + np.mean(views) / 100)
    assert len(logged) == 1


def test_two_gloo_ranks_evaluate_what_one_process_evaluates(tmp_path):
    """The periodic evaluations of a torchrun job (3 views: an uneven share) score what one process scores."""
    cache, every = tmp_path / "cache", ["train.eval_every=4", "train.eval_views=3"]
    result = single(tiny(cache, tmp_path / "one", 12) + every)
    assert result.returncode == 0, result.stderr[-2000:]
    pair = torchrun(2, tiny(cache, tmp_path / "two", 12) + every)
    assert pair.returncode == 0, ranks_output(pair)
    histories = [json.loads((tmp_path / name / "metrics.json").read_text())["eval_history"] for name in ("one", "two")]
    assert [e["step"] for e in histories[0]] == [e["step"] for e in histories[1]] == [4, 8]
    for one, two in zip(*histories):
        assert two["views"] == one["views"] == 3
        for key in ("psnr", "ssim", "psnr_worst10"):
            assert two[key] == pytest.approx(one[key], abs=1e-3), key
