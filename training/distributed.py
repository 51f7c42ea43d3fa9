"""Data-parallel training across processes with torch.distributed (launched by ``torchrun``; NCCL between GPUs,
gloo on CPUs).

How a step is split: every rank draws the same global batch (the batch generator is seeded alike on every
rank) and trains on its contiguous shard of it; gradients are averaged with one all-reduce per parameter, so
every rank applies the same update and holds the same model after each step. N ranks with a global batch of B
rays therefore compute exactly what one process does with B rays (up to the order of float additions), and
the learning rate and schedule need no change when N changes. Rank 0 alone logs, evaluates, writes
checkpoints and renders; the others wait for it at the next all-reduce. A rank that dies makes the others fail
at their next collective (gloo: at once; NCCL: after ``train.dist_timeout`` seconds) instead of hanging.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class DistributedError(RuntimeError):
    """A collective failed (a rank died or timed out); the message says what to check."""


@dataclass(frozen=True)
class Group:
    """This process's place in the job: rank r of world, and its device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        return self.world > 1

    def average_gradients(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Replace each gradient by its mean over the ranks (a parameter without one contributes zeros)."""
        if not self.active:
            return
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            _collective("all_reduce", dist.all_reduce, parameter.grad)
            parameter.grad.div_(self.world)

    def mean(self, *values: float) -> tuple[float, ...]:
        """The means of scalars over the ranks, in one all-reduce (every rank then takes the same decision)."""
        if not self.active:
            return values
        tensor = torch.tensor(values, dtype=torch.float64, device=_collective_device())
        _collective("all_reduce", dist.all_reduce, tensor)
        return tuple(float(v) / self.world for v in tensor.tolist())

    def same_everywhere(self, name: str, value: str) -> None:
        """Raise DistributedError unless every rank passes the same ``value`` (e.g. the run directory)."""
        if not self.active:
            return
        values: list[str | None] = [None] * self.world
        _collective("all_gather_object", dist.all_gather_object, values, value)
        if len(set(values)) > 1:
            raise DistributedError(f"{name}: the ranks disagree ({', '.join(sorted(set(map(str, values))))})")

    def barrier(self) -> None:
        if self.active:
            _collective("barrier", dist.barrier)


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _collective(name: str, function, *args) -> None:
    try:
        function(*args)
    except RuntimeError as error:  # DistBackendError, timeouts and closed connections are RuntimeErrors
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DistributedError(
            f"{name} across ranks failed ({first}): another rank probably stopped or was killed; see its output"
        ) from None


def from_environment() -> Group:
    """The group torchrun describes in WORLD_SIZE / RANK / LOCAL_RANK; one process when they are absent."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (
        Group(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0"))) if world > 1 else Group()
    )


def start(group: Group, device_type: str, timeout_seconds: float) -> None:
    """Join the process group (NCCL for CUDA, gloo for the CPU) with a timeout on every collective."""
    if not group.active or dist.is_initialized():
        return
    if device_type == "cuda":
        torch.cuda.set_device(group.local_rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_seconds))


def stop(group: Group) -> None:
    if group.active and dist.is_initialized():
        dist.destroy_process_group()
