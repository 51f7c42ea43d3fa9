"""Sweeps (``train.py -m``) with any Hydra launcher: every job listed with its exit code, failures reported.

With Hydra's basic launcher the jobs run one after another in the launching process; with
hydra-submitit-launcher (``hydra/launcher=submitit_local`` or ``submitit_slurm``, ``pip install -e ".[cluster]"``)
each job runs in a process of its own, possibly on another machine, so the launching process never sees the
job's exit code. :class:`SweepJobs` (a Hydra callback, ``hydra.callbacks.sweep_jobs`` in configs/config.yaml) is
one mechanism for both: each job writes one record (job number, run folder, exit code) into
``<hydra.sweep.dir>/.jobs/<sweep id>/``, and the launching process lists them all at the end of the sweep,
naming the failed ones and the jobs that left no record (killed: out of memory, a cluster time limit).

It also places each job: with ``submitit_local`` and ``gpus_per_node: 1`` job k runs on the launching machine's
GPU k mod N (submitit alone would give every job GPU 0); a submitit job of several tasks (``tasks_per_node: N``,
one task per GPU through srun) becomes a torch.distributed job (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT),
so each sweep point trains on N GPUs exactly as ``torchrun --nproc_per_node=N`` would (``train.parallel``).

Imports nothing heavy at module level: Hydra instantiates the callback before every run.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf


def quiet_preset_notice() -> None:
    """configs/hydra/launcher/submitit_{local,slurm}.yaml replace the plugin's presets of the same names on purpose
    (one GPU per job), and Hydra checks them against the plugin's schema (typed keys, typos named): its deprecation
    notice about that check asks nothing of us, so it is silenced (in the launching process and in every job)."""
    warnings.filterwarnings("ignore", message=r"\s*'hydra/launcher/submitit_", category=UserWarning)


quiet_preset_notice()

FAILED: list[dict] = []  # the failed jobs of the sweep that just ended in this process (train.py reads it)


class SweepJobs(Callback):
    """Records each job's exit code and lists the sweep's jobs at its end (see the module docstring)."""

    def __init__(self) -> None:
        self.records: str | None = None  # set in the launching process; travels to the jobs with the launcher
        self.expected: int | None = None
        self.gpus: list[str] = []

    # ------------------------------------------------------------------ the launching process
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.records = str(Path(str(config.hydra.sweep.dir)) / ".jobs" / uuid.uuid4().hex[:12])
        self.expected = _job_count(config)
        self.gpus = _visible_gpus() if _spreads_over_gpus(config) else []
        FAILED.clear()

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.records is None:
            return
        jobs: dict[int, dict] = {}
        for path in sorted(Path(self.records).glob("*.json")):
            record = json.loads(path.read_text())
            known = jobs.get(record["num"])
            if known is None or record["code"] != 0:  # a job of several tasks: any failing task fails it
                jobs[record["num"]] = record
        count = max(self.expected or 0, max(jobs, default=-1) + 1)
        print(f"sweep: {count} job(s) in {config.hydra.sweep.dir}", file=sys.stderr)
        for num in range(count):
            record = jobs.get(num)
            if record is None:
                record = {"num": num, "dir": "?", "code": None, "error": "no record: the job was killed or never ran"}
            state = "ok" if record["code"] == 0 else f"FAILED (exit {record['code']}) {record.get('error', '')}"
            print(f"  #{num} {record['dir']}: {state.strip()}", file=sys.stderr)
            if record["code"] != 0:
                FAILED.append(record)

    # ------------------------------------------------------------------ each job's process
    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if os.environ.get("SUBMITIT_EXECUTOR") is None:
            return  # the basic launcher: this process, this machine, nothing to place
        if os.environ["SUBMITIT_EXECUTOR"] == "local" and self.gpus:
            os.environ["CUDA_VISIBLE_DEVICES"] = self.gpus[int(config.hydra.job.num) % len(self.gpus)]
        _export_torch_distributed()

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if self.records is None:
            return
        from hydra.core.utils import JobStatus

        record = {"num": int(config.hydra.job.num), "dir": str(config.hydra.runtime.output_dir)}
        if job_return.status == JobStatus.COMPLETED:
            value = job_return.return_value
            record["code"] = int(value) if isinstance(value, int) else 0
        else:
            record["code"], record["error"] = 1, f"raised {job_return._return_value!r}"
        rank = os.environ.get("RANK", "0")
        folder = Path(self.records)
        folder.mkdir(parents=True, exist_ok=True)
        temporary = folder / f".{record['num']}-{rank}.tmp"
        temporary.write_text(json.dumps(record))
        temporary.replace(folder / f"{record['num']}-{rank}.json")  # atomic: never half a record


def _job_count(config: DictConfig) -> int | None:
    """The number of jobs the basic sweeper makes of the overrides (None with another sweeper)."""
    if not str(OmegaConf.select(config, "hydra.sweeper._target_", default="")).endswith("BasicSweeper"):
        return None
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    overrides = OmegaConf.to_container(config.hydra.overrides.task, resolve=False)
    return sum(len(batch) for batch in BasicSweeper.split_arguments(overrides, None))


def _spreads_over_gpus(config: DictConfig) -> bool:
    """submitit_local with one GPU per job: the jobs go round the machine's GPUs."""
    launcher = OmegaConf.select(config, "hydra.launcher", default={})
    local = str(launcher.get("_target_", "")).endswith("submitit_launcher.LocalLauncher")
    return local and launcher.get("gpus_per_node") == 1 and launcher.get("tasks_per_node", 1) == 1


def _visible_gpus() -> list[str]:
    """The GPUs this (launching) process may use, as CUDA_VISIBLE_DEVICES entries."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [entry for entry in visible.split(",") if entry.strip()]
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


def _export_torch_distributed() -> None:
    """In a submitit job of several tasks (srun), set what torch.distributed's env:// start reads."""
    import submitit

    environment = submitit.JobEnvironment()
    if environment.num_tasks > 1:
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
