"""Adam for voxel grids that touches only the rows a step reads, and still follows dense Adam (``sparse_adam=exact``).

Dense Adam moves every voxel at every step: a row with a zero gradient has its moments decay (m <- b1 m,
v <- b2 v) and its value drift by the momentum it still carries. A masked Adam (``sparse_adam=true``) skips such
rows, which changes what is trained (lego lost 0.14-0.26 dB). This one skips them too, but replays what dense Adam
would have done to a row, in closed form, just before the row is next read:

    over the k steps s = t0+1 .. t0+k with zero gradient, from moments (m, v) at step t0:
        m <- b1^k m,   v <- b2^k v,
        p <- p - (m / sqrt(v)) * sum_s lr_s sqrt(1 - b2^s) / (1 - b1^s) * (b1 / sqrt(b2))^(s - t0)

which is dense Adam's trajectory up to Adam's ``eps`` against sqrt(v_hat) (the presets' 1e-15 against grid
gradients of 1e-8 and more: a relative 1e-7; with the CPU default's 1e-8 the replay moves rarely-read voxels a
little further than dense Adam). The sum depends only on t0 and the present step, so one float64 table indexed by
a row's last step serves every row: ``_replay[t0]`` is kept up to date as steps are taken, over a window of
``WINDOW`` steps back (beyond it (b1 / sqrt(b2))^s < 1e-16 and nothing is added).

Who calls what:
- the model calls :meth:`catch_up` with a mask of the rows a lookup is about to read (models.field.TouchedRows:
  every marched sample's corners before the no-grad density pass, the TV estimate's rows), so every read sees
  dense Adam's values; ``replay_fn`` (cuda_ext.adam_replay_rows) replays them in one pass over the mask, with no
  list of rows and no device sync;
- :meth:`step` runs Adam on the rows that can have a gradient (the model's marks) and stamps them with the step;
- :meth:`flush` brings every row up to date: before a whole-grid reader (occupancy refresh, growth, evaluation,
  checkpoints), so a checkpoint holds exactly ``torch.optim.Adam``'s state and moves between optimisers.
Other groups (the decoder, the fine grid's pool, poses) step densely through torch's own functional Adam.
The live viewer renders between flushes: voxels no recent step read show their last stepped values there.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch.optim.adam import adam
from torch.utils.weak import WeakIdKeyDictionary

WINDOW = 350  # steps a replay sums back: (0.9 / sqrt(0.999))^350 < 1e-16


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


class LazyGridAdam(torch.optim.Optimizer):
    """Adam whose ``grids`` group (parameters seen as rows of their last dimension, all with the same rows) is
    stepped only on the rows ``rows_fn`` returns and replayed on the others when they are read; state keys as
    ``torch.optim.Adam`` (step, exp_avg, exp_avg_sq) once :meth:`flush` has run.

    Args:
        params: parameter groups; the one named ``grids`` is lazy, every other steps densely.
        step_fn: ``sparse_adam_step(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps)``.
        replay_fn: ``adam_replay_rows(param, exp_avg, exp_avg_sq, mask, last, replay, done, beta1, beta2)``.
        rows_fn: ``() -> (K,) int64`` unique rows of the ``grids`` group that may have a gradient this step.
        catch_up_stepped: also replay the stepped rows first (under torchrun: the union holds rows that only
            another rank read, so this rank never caught them up).
    """

    def __init__(
        self,
        params,
        step_fn: Callable,
        replay_fn: Callable,
        rows_fn: Callable[[], torch.Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        catch_up_stepped: bool = False,
    ):
        if not (0.0 <= betas[0] < 1.0 and 0.0 < betas[1] < 1.0 and betas[0] ** 2 < betas[1]):
            raise ValueError(f"betas: need 0 <= beta1 < 1, 0 < beta2 < 1 and beta1^2 < beta2, got {betas}")
        if not eps > 0.0:
            raise ValueError(f"eps: must be > 0, got {eps}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        grids = [group for group in self.param_groups if group.get("name") == "grids"]
        if len(grids) != 1:
            raise ValueError("params: LazyGridAdam needs exactly one group named 'grids'")
        self.grids = grids[0]
        rows = {p.reshape(-1, p.shape[-1]).shape[0] for p in self.grids["params"]}
        if len(rows) != 1:
            raise ValueError(f"params: the grids must share their rows, got row counts {sorted(rows)}")
        self.step_fn, self.replay_fn, self.rows_fn = step_fn, replay_fn, rows_fn
        self.catch_up_stepped = catch_up_stepped
        device = self.grids["params"][0].device
        self._last = torch.zeros(rows.pop(), dtype=torch.int64, device=device)  # the step each row is current at
        self._replay = torch.zeros(1, dtype=torch.float64, device=device)  # [t0]: the replay sum from t0 to now
        self._done = 0  # grid steps taken (Adam's bias-correction count for the grids)

    # ---------------------------------------------------------------- the grids' rows
    def _views(self):
        """(param, exp_avg, exp_avg_sq) row views of each grid (their state exists once a step was taken)."""
        for param in self.grids["params"]:
            state, columns = self.state[param], param.shape[-1]
            yield param.view(-1, columns), state["exp_avg"].view(-1, columns), state["exp_avg_sq"].view(-1, columns)

    @torch.no_grad()
    def catch_up(self, mask: torch.Tensor) -> None:
        """Bring the rows set in ``mask`` ((R,) bool or uint8) to dense Adam's values after the last step taken.
        Idempotent; a row already current is left as it is."""
        if self._done == 0:
            return
        beta1, beta2 = self.grids["betas"]
        for param, exp_avg, exp_avg_sq in self._views():
            self.replay_fn(param, exp_avg, exp_avg_sq, mask, self._last, self._replay, self._done, beta1, beta2)
        self._last.masked_fill_(mask.bool(), self._done)

    @torch.no_grad()
    def catch_up_rows(self, rows: torch.Tensor) -> None:
        """:meth:`catch_up` of the (K,) int64 ``rows`` (repeats allowed)."""
        mask = torch.zeros(self._last.numel(), dtype=torch.bool, device=self._last.device)
        mask[rows] = True
        self.catch_up(mask)

    @torch.no_grad()
    def flush(self) -> None:
        """Every row up to date (a whole-grid read, a checkpoint): the state is then dense Adam's."""
        if self._done and bool((self._last != self._done).any()):
            self.catch_up(torch.ones(self._last.numel(), dtype=torch.bool, device=self._last.device))

    @torch.no_grad()
    def _advance(self, lr: float) -> None:
        """Step ``self._done`` was just taken at rate ``lr``: add its term to the replay sums of the rows last
        stepped within the window (one small host-to-device copy)."""
        beta1, beta2 = self.grids["betas"]
        s = self._done
        rate = lr * (1 - beta2**s) ** 0.5 / (1 - beta1**s)
        if self._replay.numel() <= s:  # room for [s]: grown by doubling, so a run reallocates ~log2(steps) times
            grown = torch.zeros(2 * (s + 1), dtype=torch.float64, device=self._replay.device)
            grown[: self._replay.numel()] = self._replay
            self._replay = grown
        start = max(0, s - WINDOW)
        powers = (beta1 / beta2**0.5) ** np.arange(s - start, 0, -1, dtype=np.float64)  # t0 = start .. s-1
        self._replay[start:s] += torch.from_numpy(rate * powers).to(self._replay.device)

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure: LazyGridAdam does not re-evaluate the loss")
        for group in self.param_groups:
            if group is not self.grids:
                adam_step_dense(self.state, group["params"], group)
                continue
            rows = self.rows_fn()
            if self.catch_up_stepped:
                self.catch_up_rows(rows)
            for param in group["params"]:  # the grids share one step count: each is stepped, gradient or not
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                adam_step_rows(self.state[param], param, group, self.step_fn, rows)
            self._done += 1
            self._last[rows] = self._done
            self._advance(float(group["lr"]))
        return None

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self):
        self.flush()  # torch.optim.Adam's state: every row current
        return super().state_dict()

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self.adopt_state()

    def adopt_state(self) -> None:
        """After the grids' state was loaded or handed over (a checkpoint, an optimiser rebuilt around the same
        grids), all of it current: continue from its step count."""
        steps = [float(self.state[p]["step"]) for p in self.grids["params"] if "step" in self.state[p]]
        self._done = int(steps[0]) if steps else 0
        self._last.fill_(self._done)
        self._replay = torch.zeros(self._done + 1, dtype=torch.float64, device=self._replay.device)


__all__ = ["LazyGridAdam", "WINDOW", "adam_step_dense", "adam_step_nonzero", "adam_step_rows"]
