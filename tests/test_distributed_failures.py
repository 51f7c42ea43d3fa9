"""What goes wrong across torchrun ranks on the CPU (gloo): a batch that does not split is refused before any work,
a killed rank stops the job with an error instead of a hang, and a run that diverged on one rank at its end stops
on every rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_distributed import REPO, tiny, torchrun


@pytest.mark.parametrize("parallel", ["data", "auto"])  # data: before any work; auto: where it chose data
def test_a_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path, parallel):
    args = tiny(tmp_path / "cache", tmp_path / "run", 4) + ["train.batch_rays=63", f"train.parallel={parallel}"]
    result = torchrun(2, args, timeout=120)
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


def _rank_poisoned_at_the_end(rank: int, world: int, port: int, cache: str, run_dir: str) -> None:
    """A gloo rank of app.run whose rank 1 alone holds a parameter that is not finite after the last step."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from hydra import compose, initialize_config_dir
    from test_train import tiny_overrides

    from training import app, trainer
    from training.config import register_configs

    register_configs()  # a spawned process: the schema configs/ starts from, as conftest registers it
    original = trainer.Trainer.train_step

    def poisoned(self):
        out = original(self)
        if self.step == self.iters and rank == 1:
            with torch.no_grad():
                self.model.features.grid.view(-1)[0] = float("nan")
        return out

    trainer.Trainer.train_step = poisoned
    overrides = tiny_overrides(Path(cache), 4) + ["model.upsample=1", "train.batch_rays=64", "train.dist_timeout=30"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    code = app.run(cfg, run_dir)
    Path(run_dir, f"code.{rank}").write_text(str(code))
    # past what this test checks: a spawned gloo process's interpreter teardown aborted (SIGABRT, "terminate called
    # without an active exception") in ~10% of runs on torch 2.14 CPU, after its run had returned and destroyed the
    # group, at 65428e8 as after it (2026-11-29: 5 of 40 and 7 of 60 runs); the exit code is in the file above
    os._exit(0)


def test_ranks_agree_that_a_run_diverged_at_its_end(tmp_path):
    """The end-of-run check of the parameters is agreed on: a rank that stopped alone would leave the others waiting
    in the next collective (NCCL: for train.dist_timeout; split by space a rank holds its own slab's values only)."""
    import socket

    import torch.multiprocessing as mp

    from training.trainer import EXIT_DIVERGED

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    mp.spawn(_rank_poisoned_at_the_end, args=(2, port, str(tmp_path / "cache"), str(run_dir)), nprocs=2)
    assert [int((run_dir / f"code.{rank}").read_text()) for rank in range(2)] == [EXIT_DIVERGED] * 2
    assert not (run_dir / "metrics.json").exists()
