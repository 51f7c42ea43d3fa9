"""Adam for data-parallel training with the grids' optimiser state and update sharded over the ranks (ZeRO
stage 2; dense Adam under data parallel), in checkpoints the state of ``torch.optim.Adam`` over whole parameters."""

from __future__ import annotations

import torch

from training.distributed import Group, RowShard


class ShardedGridAdam:
    """Adam for data-parallel training whose ``grids`` group is sharded over the ranks (ZeRO stage 2): each rank
    owns a contiguous slice of the grid rows (voxels), holds Adam's moments for that slice only, and updates only
    it; the other groups (the decoder) are stepped whole on every rank, as ``torch.optim.Adam``.

    ``step`` (call it on every rank after the other groups' gradients were averaged: Group.average_model_gradients
    with mode="sharded") averages each grid's gradient into the rank's slice with one reduce-scatter, steps
    ``torch.optim.Adam`` (fused on CUDA) on views of the slice's rows, and all-gathers the updated rows, so every
    rank holds the whole grid again and forwards the next batch as one process would: the result is one
    process's dense Adam, to float tolerance. The dense optimiser work and the moments' memory per rank fall by N.

    Checkpoints: :meth:`state_dict` is a collective (every rank calls it): it gathers the moments into whole-grid
    tensors, the format of ``torch.optim.Adam.state_dict`` over the full parameters, so a checkpoint loads into
    one process, another world size, or this optimiser (:meth:`load_state_dict` slices this rank's rows).

    Args:
        params: parameter groups (VoxelNeRF.param_groups); the one named ``grids`` holds channels-last grids, seen
            as rows of their last dimension.
        group: the job (training.distributed.Group); world 1 works (one slice: plain Adam).
        betas, eps, fused: torch.optim.Adam's.
    """

    def __init__(self, params, group: Group, betas: tuple[float, float], eps: float, fused: bool):
        self.group, self.fused = group, fused
        self.full_groups = [dict(g, params=list(g["params"])) for g in params]
        self.grids: list[tuple[torch.nn.Parameter, RowShard, list[torch.nn.Parameter]]] = []  # (grid, shard, views)
        inner_groups = []
        for full in self.full_groups:
            if full.get("name") != "grids":
                inner_groups.append(dict(full))
                continue
            views = []
            for grid in full["params"]:
                rows = grid.detach().view(-1, grid.shape[-1])
                shard = group.shard_of(rows.shape[0])
                # Parameters over views of the grid's storage: Adam's in-place update writes the grid itself
                # (the tail: rows % world rows past the equal slices, stepped by every rank; usually none)
                parts = [torch.nn.Parameter(rows[shard.start : shard.stop])]
                parts += [torch.nn.Parameter(rows[shard.body :])] if shard.body < shard.rows else []
                self.grids.append((grid, shard, parts))
                views += parts
            inner_groups.append(dict(full, params=views))
        self.inner = torch.optim.Adam(inner_groups, betas=betas, eps=eps, fused=fused)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups  # the trainer's schedule sets their lr

    @property
    def state(self):
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)
        for grid, _, _ in self.grids:
            grid.grad = None if set_to_none else (grid.grad.zero_() if grid.grad is not None else None)

    @torch.no_grad()
    def step(self) -> None:
        for grid, shard, parts in self.grids:
            grad = grid.grad if grid.grad is not None else torch.zeros_like(grid)  # no rows read on this rank
            for part, averaged in zip(parts, self.group.reduce_scatter_rows(grad.reshape(-1, grid.shape[-1]), shard)):
                part.grad = averaged
        self.inner.step()
        for grid, shard, _ in self.grids:
            self.group.all_gather_rows(grid.detach().view(-1, grid.shape[-1]), shard)

    # ------------------------------------------------------------------ checkpoints: whole-grid Adam state
    def gather(self) -> None:
        """A collective, on every rank before a checkpoint: gathers the whole-grid state that rank 0's next
        :meth:`state_dict` returns (the other ranks drop their copy at once)."""
        gathered = self._whole_state()
        self._gathered = (self._steps(), gathered) if self.group.is_main else None

    def state_dict(self) -> dict:
        """``torch.optim.Adam``'s state dict over the full parameters. Several ranks: rank 0, after every rank
        called :meth:`gather` at this step (a checkpoint's state is gathered once, then handed over)."""
        if not self.group.active:
            return self._whole_state()
        gathered = getattr(self, "_gathered", None)
        if gathered is None or gathered[0] != self._steps():
            raise RuntimeError("ShardedGridAdam.state_dict: call gather() on every rank at this step first")
        self._gathered = None
        return gathered[1]

    def _steps(self) -> int:
        states = [self.inner.state.get(parts[0]) for _, _, parts in self.grids]
        return max((int(state["step"]) for state in states if state), default=0)

    def _whole_state(self) -> dict:
        views = {id(grid): (shard, parts) for grid, shard, parts in self.grids}
        state, groups, index = {}, [], 0
        for full, inner in zip(self.full_groups, self.inner.param_groups):
            groups.append({**{k: v for k, v in inner.items() if k != "params"}, "params": []})
            for parameter in full["params"]:
                if id(parameter) in views:
                    entry = self._whole_entry(parameter, *views[id(parameter)])
                else:
                    entry = self.inner.state.get(parameter)
                if entry:
                    state[index] = entry
                groups[-1]["params"].append(index)
                index += 1
        return {"state": state, "param_groups": groups}

    def _whole_entry(self, grid: torch.nn.Parameter, shard, parts: list[torch.nn.Parameter]) -> dict | None:
        part_state = self.inner.state.get(parts[0])
        tail_state = self.inner.state.get(parts[1]) if len(parts) > 1 else None
        if not part_state:
            return None  # not stepped yet
        entry = {"step": part_state["step"].clone()}
        for key in ("exp_avg", "exp_avg_sq"):
            whole = torch.empty_like(grid).view(-1, grid.shape[-1])
            whole[shard.start : shard.stop] = part_state[key]
            if tail_state:
                whole[shard.body :] = tail_state[key]
            self.group.all_gather_rows(whole, shard)
            entry[key] = whole.view_as(grid)
        return entry

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a whole-parameter Adam state dict (this optimiser's, or ``torch.optim.Adam``'s): each rank keeps its
        rows of the grids' moments."""
        views = {id(grid): (shard, parts) for grid, shard, parts in self.grids}
        inner_state, inner_groups, inner_index = {}, [], 0
        for full, saved in zip(self.full_groups, state_dict["param_groups"]):
            inner_groups.append({**saved, "params": []})
            for position, parameter in enumerate(full["params"]):
                entry = state_dict["state"].get(saved["params"][position])
                pieces = [{k: v.clone() for k, v in entry.items()} if entry else None]  # never step the caller's
                if id(parameter) in views:
                    shard, parts = views[id(parameter)]
                    pieces = [_rows_of(entry, parameter, shard.start, shard.stop)]
                    pieces += [_rows_of(entry, parameter, shard.body)] if len(parts) > 1 else []
                for piece in pieces:
                    if piece:
                        inner_state[inner_index] = piece
                    inner_groups[-1]["params"].append(inner_index)
                    inner_index += 1
        self.inner.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        for group in self.inner.param_groups:  # the checkpoint may come from another device type
            group["fused"] = self.fused


def _rows_of(entry: dict | None, grid: torch.Tensor, start: int, stop: int | None = None) -> dict | None:
    """Rows [start, stop) of a whole grid's Adam state entry, as (rows, C) (copies: the whole moments are not kept)."""
    if not entry:
        return None
    columns = grid.shape[-1]
    return {
        key: value.clone() if key == "step" else value.reshape(-1, columns)[start:stop].clone()
        for key, value in entry.items()
    }
