"""Adam for voxel grids that reads and writes only the voxels this step's rays touched.

Dense Adam over a 256^3 x 13 grid moves about 6 GB per step (param, grad and two moments read, three written)
although a batch touches a few percent of the voxels. :class:`SparseGridAdam` finds the rows (voxels) whose
gradient can be non-zero (the model's list of rows its lookups read, or a scan of the gradient) and hands only
those to a fused step (``ops.sparse_adam_step``: our kernel, or its PyTorch
reference). Semantics, as DirectVoxGO's and Plenoxels' masked Adam: a voxel no ray touched this step keeps its
value *and* its moments (momentum does not drift it, its moments do not decay); on a voxel touched at every step
the result is dense Adam's. Other groups (the decoder) step through torch's own functional Adam.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch.optim.adam import adam
from torch.utils.weak import WeakIdKeyDictionary

from cuda_ext.kept_grad import keep_grad
from training.config_rules import sparse_adam_mode
from training.sharded_adam import ShardedGridAdam

if TYPE_CHECKING:  # training.trainer imports this module
    from training.trainer import Trainer


def _state_of(state: dict, param: torch.Tensor) -> dict:
    """The ``torch.optim.Adam``-keyed ``state`` of ``param`` (step, exp_avg, exp_avg_sq), created on first use."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)  # on the CPU, as torch.optim.Adam's (not fused)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return state


def _advance(state: dict, param: torch.Tensor) -> int:
    """``state`` (see :func:`_state_of`) one step further: its count."""
    _state_of(state, param)["step"] += 1
    return int(state["step"].item())  # a CPU tensor: no device sync


def _as_rows(state: dict, param: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """param, its gradient and moments as (M, C) views over its last dimension (C = 1 for a 0-d parameter)."""
    columns = param.shape[-1] if param.dim() > 0 else 1
    return (param.view(-1, columns), param.grad.reshape(-1, columns).contiguous(),
            state["exp_avg"].view(-1, columns), state["exp_avg_sq"].view(-1, columns))  # fmt: skip


def adam_step_rows(
    state: dict, param: torch.Tensor, group: dict, step_fn: Callable, rows: torch.Tensor, clear: bool = False
) -> bool:
    """One Adam step of ``param`` (seen as rows of its last dimension) through ``step_fn`` (sparse_adam_step) on
    its (K,) int64 ``rows``, its ``torch.optim.Adam``-keyed ``state`` created on first use. ``clear``: the listed
    rows of a contiguous ``.grad`` left zero (``clear_grad``); returns whether they were."""
    step = _advance(state, param)
    values, grad, exp_avg, exp_avg_sq = _as_rows(state, param)
    beta1, beta2 = group["betas"]
    clear = clear and param.grad.is_contiguous()  # else _as_rows steps a copy, which clearing would not reach
    # the rows are built in range by the optimisers (nonzero() of a mask): no range check, no device sync
    step_fn(values, grad, exp_avg, exp_avg_sq, rows, step, float(group["lr"]), float(beta1), float(beta2),
            float(group["eps"]), check_rows=False, clear_grad=clear)  # fmt: skip
    return clear


# param -> (its step count on its device, the count that holds): torch's fused Adam reads and advances the counts on
# the device, the optimiser's state keeps them on the CPU (as torch.optim.Adam's, in checkpoints)
_DEVICE_STEPS = WeakIdKeyDictionary()


def _device_steps(params: list[torch.Tensor], state: list[dict]) -> list[torch.Tensor]:
    """The (0-d float32) device copies of ``state``'s CPU step counts, made again where a count moved (a load)."""
    steps = []
    for param, entry in zip(params, state):
        count = int(entry["step"])  # a CPU tensor: no device sync
        held = _DEVICE_STEPS.get(param)
        if held is None or held[1] != count:
            held = (torch.full((), float(count), dtype=torch.float32, device=param.device), count)
        _DEVICE_STEPS[param] = (held[0], count + 1)  # the fused step advances it
        steps.append(held[0])
    return steps


def adam_step_dense(states, params: list[torch.Tensor], group: dict, fused: bool | None = None) -> None:
    """One ``torch.optim.Adam`` step of those ``params`` that have a gradient, through torch's own functional Adam
    (``fused``, by default on CUDA: two launches for all the group's tensors, where the multi-tensor path took
    eight: the decoder's step ~0.10 -> 0.05 ms on an H200); ``states``: the optimiser's per-parameter state, keyed as
    :func:`adam_step_rows`'."""
    live = [param for param in params if param.grad is not None]
    if not live:
        return
    state = [_state_of(states[param], param) for param in live]
    beta1, beta2 = group["betas"]
    fused = live[0].is_cuda if fused is None else fused
    steps = _device_steps(live, state) if fused else [s["step"] for s in state]
    adam(live, [param.grad for param in live], [s["exp_avg"] for s in state], [s["exp_avg_sq"] for s in state], [],
         steps, fused=fused, amsgrad=False, beta1=float(beta1), beta2=float(beta2), lr=float(group["lr"]),
         weight_decay=0.0, eps=float(group["eps"]), maximize=False)  # fmt: skip
    if fused:
        for entry in state:
            entry["step"] += 1


def adam_step_nonzero(state: dict, param: torch.Tensor, group: dict, masked_fn: Callable) -> bool:
    """One Adam step of ``param``'s elements whose gradient is non-zero through ``masked_fn`` (masked_adam_step);
    ``state`` as :func:`adam_step_rows`'s (the step count advances for the whole parameter, as the group's).
    A contiguous ``.grad`` is left zero (``clear_grad``: the next step's lookups add onto it, cuda_ext.kept_grad);
    returns whether it was."""
    step = _advance(state, param)
    beta1, beta2 = group["betas"]
    clear = param.grad.is_contiguous()  # else _as_rows steps a copy, which clearing would not reach
    masked_fn(*_as_rows(state, param), step, float(group["lr"]), float(beta1), float(beta2), float(group["eps"]),
              clear_grad=clear)  # fmt: skip
    return clear


class SparseGridAdam(torch.optim.Optimizer):
    """Adam (no weight decay) whose state matches ``torch.optim.Adam``'s keys (step, exp_avg, exp_avg_sq), so
    checkpoints move between the two.

    Args:
        params: parameter groups; zero-gradient rows are skipped in the group named ``grids`` (VoxelNeRF's
            param_groups), every other group steps densely. A parameter is seen as rows of its last dimension: a
            channels-last grid (R0, R1, R2, C) as (R0*R1*R2, C) voxels.
        step_fn: ``sparse_adam_step(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps)``.
        rows_fn: optional ``() -> (K,) int64`` rows of the ``grids`` group to step this time, shared by its
            parameters (VoxelNeRF.take_touched_rows: the rows the step's lookups read); None: the rows whose
            gradient is non-zero, found by scanning each gradient (reads all of it).
        masked_fn: optional ``masked_adam_step(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps,
            clear_grad)``: then the groups named in ``by_gradient`` step only their elements with a non-zero
            gradient, found by the kernel itself (no rows, no scan, no sync) (``train.sparse_adam=nonzero``: the
            ``grids`` and the ``fine`` pool; ``occupied``: the fine pool, the grids by ``rows_fn``). Their gradients
            are kept between steps: the step leaves them zero, :meth:`zero_grad` keeps them, and the next step's
            lookups add onto them (cuda_ext.kept_grad: no zero fill of the grids' size a step).
        by_gradient: the names of the groups ``masked_fn`` steps.
        keep_listed: keep the ``grids`` group's gradients too, for a ``rows_fn`` that returns the same tensor while
            its rows hold (:class:`OccupiedRows`, whose rows cover every row a lookup reads): the step leaves the
            listed rows zero (``clear_grad``); outside them the gradient (the TV estimate's, in empty space) is never
            stepped, and :meth:`zero_grad` drops the whole gradient once ``rows_fn``'s rows change.
    """

    def __init__(
        self,
        params,
        step_fn: Callable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        rows_fn: Callable[[], torch.Tensor] | None = None,
        masked_fn: Callable | None = None,
        by_gradient: tuple[str, ...] = ("grids", "fine"),
        keep_listed: bool = False,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"lr: must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas: each must be in [0, 1), got {betas}")
        if not eps > 0.0:
            raise ValueError(f"eps: must be > 0, got {eps}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        self.step_fn = step_fn
        self.rows_fn = rows_fn
        self.masked_fn = masked_fn
        self.by_gradient = tuple(by_gradient)
        if keep_listed and rows_fn is None:
            raise ValueError("keep_listed: needs rows_fn (the rows that hold every gradient a lookup writes)")
        self.keep_listed = keep_listed
        self._cleared: set[int] = set()  # ids of the parameters whose .grad the last step left zero
        self._cleared_rows: set[int] = set()  # ... left zero on the rows of self._kept_rows
        self._kept_rows: torch.Tensor | None = None
        for group in self.param_groups:
            if self._by_gradient(group) or (keep_listed and group.get("name") == "grids"):
                for param in group["params"]:
                    keep_grad(param)

    def _by_gradient(self, group: dict) -> bool:
        """Whether ``group`` steps by its gradient's non-zero elements (masked_fn, a group named in by_gradient)."""
        return self.masked_fn is not None and group.get("name") in self.by_gradient

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch.optim's, except that a gradient the last step left zero is kept (the lookups add onto it), and one
        left zero on the listed rows while those rows hold (``keep_listed``)."""
        rows_hold = self._kept_rows is not None and self.rows_fn() is self._kept_rows
        for group in self.param_groups:
            for param in group["params"]:
                kept = id(param) in self._cleared or (rows_hold and id(param) in self._cleared_rows)
                if param.grad is None or kept:
                    continue
                param.grad = None if set_to_none else param.grad.zero_()
        self._cleared, self._cleared_rows, self._kept_rows = set(), set(), None

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure: SparseGridAdam does not re-evaluate the loss")
        listed = None
        for group in self.param_groups:
            by_gradient = self._by_gradient(group)
            if not by_gradient and group.get("name") != "grids":  # the decoder, ...: dense Adam
                adam_step_dense(self.state, group["params"], group)
                continue
            if group.get("name") == "grids" and self.rows_fn is not None and not by_gradient:
                listed = self.rows_fn()
            for param in group["params"]:
                if param.grad is None:
                    continue
                if by_gradient:
                    if adam_step_nonzero(self.state[param], param, group, self.masked_fn):
                        self._cleared.add(id(param))
                    continue
                grad = param.grad.reshape(-1, param.shape[-1])
                scanned = listed is None  # one host sync: the count
                rows = grad.ne(0).any(dim=1).nonzero().squeeze(1) if scanned else listed
                clear = self.keep_listed and not scanned
                if adam_step_rows(self.state[param], param, group, self.step_fn, rows, clear=clear):
                    self._cleared_rows.add(id(param))
                    self._kept_rows = listed
        return None


class OccupiedRows:
    """``rows_fn`` of ``train.sparse_adam=occupied``: the grid rows at the corners of the occupancy grid's occupied
    cells (OccupancyGrid.vertex_rows), the only rows a marched sample can read until the next refresh; computed
    again (one host sync) only when the occupancy mask changed, i.e. every ``model.occupancy.refresh_every`` steps.
    The total-variation estimate also reads empty space: its gradient there is dropped, as a ray never reads it."""

    def __init__(self, occupancy):
        self.occupancy = occupancy
        self._mask: torch.Tensor | None = None  # the mask the rows were computed from, and its version
        self._version = -1
        self._rows: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        mask = self.occupancy.mask
        if mask is not self._mask or mask._version != self._version:  # replaced on refresh, written in place on load
            self._rows = self.occupancy.vertex_rows()
            self._mask, self._version = mask, mask._version
        return self._rows


class OwnedRows:
    """``rows_fn`` of a rank of ``train.parallel=space``: the rows of ``rows_fn`` in its slab (``owned``), computed
    again only when ``rows_fn`` returns other rows."""

    def __init__(self, rows_fn, owned):
        self.rows_fn, self.owned = rows_fn, owned
        self._source: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        source = self.rows_fn()
        if source is not self._source:
            self._rows, self._source = self.owned(source), source
        return self._rows


def new_optimizer(trainer: Trainer, betas: tuple[float, float]) -> torch.optim.Optimizer:
    """The trainer's Adam over its model's param_groups: dense (``torch.optim.Adam``, fused on CUDA), sharded over
    torchrun's ranks (:class:`ShardedGridAdam`), or on the occupied voxels / the elements with a gradient
    (:class:`SparseGridAdam`)."""
    cfg, model, group = trainer.train_cfg, trainer.model, trainer.group
    rates = (cfg.lr, cfg.lr_decoder, cfg.get("lr_pose", 6e-4))
    groups = model.param_groups(*(float(rate) for rate in rates))
    for entry in groups:
        entry["initial_lr"] = entry["lr"]
    eps = float(cfg.get("adam_eps", 1e-8))
    mode = sparse_adam_mode(cfg.get("sparse_adam", False))
    space = getattr(model, "space_split", None)  # train.parallel=space: no gradient exchange but the plane's
    split = space is not None
    sharded = mode == "off" and not split and group.active  # dense Adam under data parallel: ZeRO-2
    # under torchrun the model marks the rows its lookups read for the touched-rows all-reduce (the union of the
    # ranks' marks, training.distributed)
    model.touched.enabled = (
        group.active and not sharded and not split and cfg.get("dist_grad_sync", "touched") != "dense"
    )
    model.touched.flusher = model.touched.density_flusher = None
    if split:  # the ranks' slabs exchanged before every whole-grid read (a refresh's: the density grid's alone,
        # unless rank 0's viewer shows the model: then every refresh brings it every slab's features too)
        model.touched.flusher = space.gather
        model.touched.density_flusher = None if cfg.get("viewer", False) else space.gather_density
    if mode == "nonzero":  # every rank holds the same averaged gradients, so steps the same elements
        ops = trainer.ops
        return SparseGridAdam(groups, ops.sparse_adam_step, betas=betas, eps=eps, masked_fn=ops.masked_adam_step)
    if mode == "occupied":  # the same rows on every rank: every rank holds the same occupancy grid
        # the fine pool (bricks on the surfaces seen) by gradient: stepped whole, it cost mic 800 more than its rays
        # and every grid's gradient kept between steps (no fill of the grids' size a step)
        ops, rows_fn = trainer.ops, OccupiedRows(model.occupancy)
        if split:  # train.parallel=space: this rank's slab of them
            occupied, owned = rows_fn, space.owned_rows
            rows_fn = OwnedRows(occupied, owned)
        return SparseGridAdam(
            groups, ops.sparse_adam_step, betas=betas, eps=eps, rows_fn=rows_fn,
            masked_fn=ops.masked_adam_step, by_gradient=("fine",), keep_listed=True,
        )  # fmt: skip
    if sharded:  # ZeRO-2 over the ranks
        return ShardedGridAdam(groups, group, betas, eps, fused=trainer.device.type == "cuda")
    return torch.optim.Adam(groups, betas=betas, eps=eps, fused=trainer.device.type == "cuda")


def rebuilt_optimizer(trainer: Trainer, betas: tuple[float, float]) -> torch.optim.Optimizer:
    """A new optimiser over the model's current parameters (after growth), keeping the moments of parameters that
    survived."""
    old = trainer.optimizer
    optimizer = new_optimizer(trainer, betas)
    for entry in optimizer.param_groups:
        for parameter in entry["params"]:
            if parameter in old.state:
                optimizer.state[parameter] = old.state[parameter]
    return optimizer


def load_optimizer_state(optimizer: torch.optim.Optimizer | ShardedGridAdam, state: dict, device_type: str) -> None:
    """Load a checkpoint's optimiser state into any of the optimisers above: the moments and step counts carry
    over between them (they share torch.optim.Adam's keys), and each group keeps the options its own optimiser
    needs that the checkpoint's (from another optimiser, another torch) lacks, e.g. torch.optim.Adam's
    ``weight_decay`` after a masked or occupied Adam wrote it."""
    own_options = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, options in zip(optimizer.param_groups, own_options):
        for key, value in options.items():
            group.setdefault(key, value)
        if isinstance(optimizer, torch.optim.Adam):  # the checkpoint may come from another device type
            group["fused"] = device_type == "cuda"


def prepare_for_whole_reads(optimizer: torch.optim.Optimizer | ShardedGridAdam) -> None:
    """Before a checkpoint or an evaluation, on every rank: a sharded optimiser gathers its moments for rank 0's
    checkpoint."""
    if isinstance(optimizer, ShardedGridAdam):
        optimizer.gather()
