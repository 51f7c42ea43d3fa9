"""Data-parallel training under torchrun on the CPU (gloo): two ranks train exactly what one process trains with
the same global batch, only rank 0 writes, and a killed rank stops the job with an error instead of a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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
    ]


def torchrun(ranks: int, args: list[str], timeout: float = 240, **popen) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [*command, "train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env, **popen
    )


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


def test_two_gloo_ranks_train_what_one_process_trains(tmp_path):
    cache = tmp_path / "cache"
    single = subprocess.run(
        [sys.executable, "train.py", *tiny(cache, tmp_path / "one", 12)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert single.returncode == 0, single.stderr[-2000:]
    pair = torchrun(2, tiny(cache, tmp_path / "two", 12))
    assert pair.returncode == 0, pair.stdout[-2000:] + pair.stderr[-2000:]
    one = load_checkpoint(tmp_path / "one" / "checkpoints" / "last.pt", map_location="cpu")
    two = load_checkpoint(tmp_path / "two" / "checkpoints" / "last.pt", map_location="cpu")
    assert one["step"] == two["step"] == 12
    for name, value in one["model"].items():
        if value.is_floating_point():
            torch.testing.assert_close(two["model"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    # rank 0 alone wrote the outputs and the log; the job's rays per second count both ranks' rays
    assert (tmp_path / "two" / "metrics.json").is_file()
    assert pair.stdout.count("eval on") == 1


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path):
    result = torchrun(2, tiny(tmp_path / "cache", tmp_path / "run", 4) + ["train.batch_rays=63"], timeout=120)
    assert result.returncode != 0
    assert "train.batch_rays: 63 does not split over 2 ranks" in result.stderr


def test_a_killed_rank_stops_the_job_with_an_error_not_a_hang(tmp_path):
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "train.py",
        *tiny(tmp_path / "cache", tmp_path / "run", 100000),
        "train.log_every=1",
        "train.checkpoint_every=0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        worker = None
        while time.monotonic() < deadline and worker is None:  # rank 1's process: a child of torchrun
            time.sleep(1)
            children = subprocess.run(["pgrep", "-P", str(job.pid)], capture_output=True, text=True).stdout.split()
            for pid in children:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if b"RANK=1" in environ and (tmp_path / "run" / "train.log").exists():
                    worker = int(pid)
        assert worker is not None, "rank 1 never started"
        time.sleep(3)  # let training run a few steps
        os.kill(worker, signal.SIGKILL)
        _, stderr = job.communicate(timeout=120)  # the survivors must give up, well before any hang
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode != 0
    assert "failed" in stderr.lower()


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
        Group(rank, world, rank).average_gradients([other], row_sparse=[*grids, lonely])
        torch.save({"dense": dense, "touched": [p.grad for p in (*grids, other, lonely)]}, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def test_touched_rows_average_equals_the_dense_average(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_average_both_ways, args=(2, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"out.{rank}")
        for index, (dense, touched) in enumerate(zip(result["dense"], result["touched"])):
            assert touched.abs().sum() > 0, f"parameter {index}: no gradient arrived"
            torch.testing.assert_close(touched, dense, rtol=1e-6, atol=1e-7, msg=f"parameter {index}")
