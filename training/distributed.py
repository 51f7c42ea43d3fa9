"""Data-parallel training across processes with torch.distributed (launched by ``torchrun``; NCCL between GPUs,
gloo on CPUs).

How a step is split: every rank draws the same global batch (the batch generator is seeded alike on every
rank) and trains on its contiguous shard of it; gradients are averaged with one all-reduce per parameter, so
every rank applies the same update and holds the same model after each step. N ranks with a global batch of B
rays therefore compute exactly what one process does with B rays (up to the order of float additions), and
the learning rate and schedule need no change when N changes.

How gradients move (``train.dist_grad_sync``): ``dense`` all-reduces every gradient whole; ``touched`` (the
default) all-reduces the decoder whole but, for the voxel grids, only the rows (voxels) whose gradient is
non-zero on some rank: a batch touches a few percent of a 320^3 grid, so a step moves tens of MB instead of
1.7 GB. Both give the same averaged gradient (rows no rank touched are zero everywhere). The rows come from the
model's own marks where it keeps them (``models.field.TouchedRows``: every row the step's lookups and TV estimate
read), OR-reduced over the ranks as one byte a voxel; without marks, from a scan of every gradient for non-zero
rows (which reads all 1.7 GB of them).

Rank 0 alone logs, evaluates, writes checkpoints and renders; the others wait for it at the next all-reduce. The
ranks agree on stopping (a signal) and on divergence at log steps only, so a step has no collective of its own
beyond the gradients'. A rank that dies makes the others fail at their next collective (gloo: at once; NCCL:
after ``train.dist_timeout`` seconds) instead of hanging.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from models.space_split import ALL_GATHER
from training.config import ConfigError


def check_shards(cfg, world: int) -> None:
    """Data parallel: the global batch (train.batch_rays, or train.patches_per_batch with model.upsample > 1) must
    split into equal shards, one a rank."""
    key = "train.batch_rays" if int(cfg.model.upsample) == 1 else "train.patches_per_batch"
    size = int(OmegaConf.select(cfg, key))
    if size % world:
        raise ConfigError(f"{key}: {size} does not split over {world} ranks (the global batch; make it a multiple)")


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

    def average_gradients(
        self,
        parameters: Iterable[torch.nn.Parameter],
        row_sparse: Iterable[torch.nn.Parameter] = (),
        marks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Replace each gradient by its mean over the ranks (a parameter without one contributes zeros).

        ``parameters`` are reduced whole. ``row_sparse`` parameters (seen as rows of their last dimension, e.g. a
        (R0, R1, R2, C) grid as R0*R1*R2 voxels of C channels) are reduced on the union over ranks of their
        touched rows only; parameters with the same number of rows share one union and one all-reduce.
        ``marks``: optional (R,) bool rows this rank's step read, a superset of its non-zero gradient rows (the
        model's ``TouchedRows``): the union of the parameters with R rows is taken from them instead of a scan of
        the gradients, and they are cleared. Returns that union's (K,) int64 sorted rows (None without marks).
        """
        if not self.active:
            return None
        grads = []
        for parameter in parameters:
            grad = _grad(parameter)
            if grad.numel() >= _FLATTEN_BELOW:  # a grid: reduced in place (a copy into a flat buffer would cost more)
                _collective("all_reduce", dist.all_reduce, grad)
                grad.div_(self.world)
            else:
                grads.append(grad)
        if grads:  # the small ones in one all-reduce (the decoder's dozen tensors: one launch, not a dozen)
            flat = torch.cat([grad.reshape(-1) for grad in grads])
            _collective("all_reduce", dist.all_reduce, flat)
            flat.div_(self.world)
            for grad, part in zip(grads, flat.split([grad.numel() for grad in grads])):
                grad.copy_(part.view_as(grad))
        by_rows: dict[int, list[torch.Tensor]] = {}
        for parameter in row_sparse:
            grad = _grad(parameter)
            rows = grad.reshape(-1, grad.shape[-1] if grad.dim() else 1)
            by_rows.setdefault(rows.shape[0], []).append(rows)
        union = None
        for count, grads in by_rows.items():
            own = marks if marks is not None and marks.numel() == count else None  # the marks of grids this size
            rows = self._average_touched_rows(grads, own)
            union = rows if own is not None else union
        return union

    def average_model_gradients(
        self,
        module: torch.nn.Module,
        row_sparse: list[torch.nn.Parameter],
        mode: str,
        marks: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Average all of ``module``'s gradients: ``row_sparse`` (its voxel grids) on their touched rows with
        ``mode="touched"`` (``marks``: see :meth:`average_gradients`; returns the union's rows), everything whole
        with ``mode="dense"`` (``train.dist_grad_sync``); with ``mode="sharded"`` everything but ``row_sparse``,
        whose gradients training.sharded_adam.ShardedGridAdam reduce-scatters itself."""
        if not self.active:
            return None
        if mode == "dense":
            self.average_gradients(module.parameters())
            return None
        sparse_ids = {id(parameter) for parameter in row_sparse}
        others = [parameter for parameter in module.parameters() if id(parameter) not in sparse_ids]
        if mode == "sharded":
            return self.average_gradients(others)
        return self.average_gradients(others, row_sparse=row_sparse, marks=marks)

    def _average_touched_rows(self, grads: list[torch.Tensor], marks: torch.Tensor | None = None) -> torch.Tensor:
        """Average (R, C_i) row views of gradients over the ranks, moving only the rows touched somewhere: marked in
        ``marks`` ((R,) bool, cleared here) or, without them, non-zero. Returns the union's (K,) sorted rows."""
        if marks is not None:
            touched = marks.to(torch.uint8)  # a copy: the marks start the next step empty
            marks.zero_()
        else:
            touched = grads[0].ne(0).any(dim=1)
            for grad in grads[1:]:
                touched |= grad.ne(0).any(dim=1)
            touched = touched.to(torch.uint8)
        _collective("all_reduce", dist.all_reduce, touched, dist.ReduceOp.MAX)  # the union over the ranks
        rows = touched.nonzero().squeeze(1)  # one host sync: the count
        self.average_rows(grads, rows)  # rows outside the union are zero on every rank already
        return rows

    def average_rows(self, grads: list[torch.Tensor], rows: torch.Tensor) -> None:
        """Average the (K,) int64 ``rows`` (the same on every rank) of (R, C_i) row views of gradients over the
        ranks, in place: the rows packed side by side (K, sum C_i), one all-reduce, copied back. The other rows
        keep this rank's values."""
        packed = pack_rows(grads, rows)
        _collective("all_reduce", dist.all_reduce, packed)
        packed.div_(self.world)
        unpack_rows(grads, rows, packed)

    def shard_of(self, rows: int) -> RowShard:
        """This rank's part of a (rows, C) tensor split by rows (training.sharded_adam.ShardedGridAdam)."""
        return RowShard(rows, self.world, self.rank)

    def reduce_scatter_rows(self, rows: torch.Tensor, shard: RowShard) -> tuple[torch.Tensor, torch.Tensor]:
        """Average a (R, C) gradient over the ranks, keeping this rank's rows only: the body's shard, (S, C),
        through one reduce-scatter (each rank receives 1/N of it: no rank ever holds the whole averaged gradient),
        and the (T, C) tail rows, T < N, all-reduced (every rank steps them)."""
        if not self.active:
            return rows[: shard.body], rows[shard.body :]
        part = rows.new_empty(shard.size, rows.shape[1])
        _collective("reduce_scatter", _REDUCE_SCATTER, part, rows[: shard.body].contiguous())
        tail = rows[shard.body :].clone()
        if tail.numel():
            _collective("all_reduce", dist.all_reduce, tail)
        return part.div_(self.world), tail.div_(self.world)

    def all_gather_rows(self, rows: torch.Tensor, shard: RowShard) -> None:
        """Every rank's updated shard into every rank's (R, C) ``rows`` (in place: one all-gather)."""
        if not self.active:
            return
        mine = rows[shard.start : shard.stop]
        if dist.get_backend() != "nccl":  # NCCL documents in-place all-gather (input inside output); gloo does not
            mine = mine.clone()
        _collective("all_gather", ALL_GATHER, rows[: shard.body], mine)

    def mean(self, *values: float) -> tuple[float, ...]:
        """The means of scalars over the ranks, in one all-reduce (every rank then takes the same decision)."""
        if not self.active:
            return values
        summed = self.total(torch.tensor(values, dtype=torch.float64))
        return tuple(float(v) / self.world for v in summed.tolist())

    def total(self, values: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of a float64 CPU tensor over the ranks (one all-reduce), as a CPU tensor; itself
        in one process."""
        if not self.active:
            return values
        tensor = values.to(_collective_device())
        _collective("all_reduce", dist.all_reduce, tensor)
        return tensor.cpu()

    def minimum(self, value: int) -> int:
        """The smallest of an integer over the ranks (e.g. the fine-grid bricks every rank's memory holds)."""
        if not self.active:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=_collective_device())
        _collective("all_reduce", dist.all_reduce, tensor, dist.ReduceOp.MIN)
        return int(tensor.item())

    def objects(self, value: Any) -> list:
        """Every rank's ``value`` (picklable), by rank (one process: ``[value]``)."""
        if not self.active:
            return [value]
        values: list = [None] * self.world
        _collective("all_gather_object", dist.all_gather_object, values, value)
        return values

    def same_everywhere(self, name: str, value: str) -> None:
        """Raise DistributedError unless every rank passes the same ``value`` (e.g. the run directory)."""
        values = self.objects(value)
        if len(set(values)) > 1:
            raise DistributedError(f"{name}: the ranks disagree ({', '.join(sorted(set(map(str, values))))})")

    def barrier(self) -> None:
        """Wait here until every rank gets here: an all-reduce of one number, read back (on NCCL ``dist.barrier`` would
        guess its device and warn about it on every run)."""
        if self.active:
            self.minimum(0)


@dataclass(frozen=True)
class RowShard:
    """Rank ``rank``'s contiguous rows of a tensor of ``rows`` rows split ``world`` ways: rows [start, stop) of the
    first ``body`` = world * size rows; the last rows % world rows (the tail) belong to every rank."""

    rows: int
    world: int
    rank: int

    @property
    def size(self) -> int:
        return self.rows // self.world

    @property
    def start(self) -> int:
        return self.rank * self.size

    @property
    def stop(self) -> int:
        return self.start + self.size

    @property
    def body(self) -> int:
        return self.size * self.world


_FLATTEN_BELOW = 1 << 22  # elements: gradients smaller than this share one all-reduce

# torch >= 2.14 names it reduce_scatter_single; torch 2.4 - 2.13 have reduce_scatter_tensor alone (same arguments)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def pack_rows(grads: list[torch.Tensor], rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """(K, sum C_i): the (K,) ``rows`` of the (R, C_i) ``grads`` side by side (into ``out`` when given)."""
    return torch.cat([grad.index_select(0, rows) for grad in grads], dim=1, out=out)


def unpack_rows(grads: list[torch.Tensor], rows: torch.Tensor, packed: torch.Tensor) -> None:
    """Write :func:`pack_rows`' (K, sum C_i) ``packed`` back into the (K,) ``rows`` of the (R, C_i) ``grads``."""
    for grad, part in zip(grads, packed.split([grad.shape[1] for grad in grads], dim=1)):
        grad.index_copy_(0, rows, part)


def _grad(parameter: torch.nn.Parameter) -> torch.Tensor:
    if parameter.grad is None:  # this rank's shard never reached the parameter: it contributes zeros
        parameter.grad = torch.zeros_like(parameter)
    elif not parameter.grad.is_contiguous():  # row views below must alias the gradient itself
        parameter.grad = parameter.grad.contiguous()
    return parameter.grad


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
