"""``train.parallel=space`` under torchrun with two ranks: the voxels split by space instead of the rays (issue 33;
two H200s: 1.07x one GPU on lego at the same PSNR, bench/README "The space split without its syncs").

Every rank draws the whole batch and marches, shades and differentiates only the samples of its slab of the grids
(models.space_split: rank 0 the vertices x <= p, rank 1 x >= p, p the middle vertex plane of the first axis);
the composited per-ray values are exchanged, so every rank computes the same loss. Then:
- gradients: every rank backpropagates half the loss (models.space_split), so the decoder's are summed over the
  ranks (its samples' part from each, and half of what acts after the exchange from each); the grids' only on the
  shared plane (both ranks read it); nothing else moves;
- Adam: the occupied voxels of this rank's slab (``train.sparse_adam=occupied``) or dense Adam (the other slab's
  rows then move on their moments alone, unread, and are overwritten at the next gather);
- the TV estimate: stratified by slab (each rank's draws over its own cells, in proportion to them), each rank's
  stratum scaled by its slab's share, so that the two parts sum to the estimate;
- before a whole-grid read (an occupancy refresh, a growth, an evaluation) the ranks exchange their slabs of the
  grids (two broadcasts a grid), and before a checkpoint their slabs of Adam's moments too, so that every rank
  then holds what one process would.
Not supported (refused): a fine grid, pose refinement, the distortion loss (pairs of samples across the slabs), the
near-density loss (a term of one slab's samples outside the exchange), a whole-grid TV (a term of each rank's loss,
where its other slab is stale).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.grid_tv import DeferredTV
from models.space_split import Slabs, split_march
from training.config import ConfigError
from training.config_rules import sparse_adam_mode


class SpaceParallel:
    """The split of one two-rank job; set on the model (``model.space_split``) and the trainer."""

    def __init__(self, trainer):
        group, model, cfg = trainer.group, trainer.model, trainer.train_cfg
        if group.world != 2:
            raise ConfigError(f"train.parallel: space splits the grids over exactly 2 ranks, got {group.world}")
        c = model.config
        whole_tv = max(c.tv_density, c.tv_features) > 0 and not DeferredTV.applies(model)  # in each rank's loss
        for bad, reason in (
            (c.fine.factor > 0 and not model.fine.declined, "model.fine (a fine grid that this scene would get)"),
            (model.poses.enabled, "model.pose_refinement"),
            (float(cfg.get("distortion_loss", 0.0)) > 0, "train.distortion_loss"),
            (float(cfg.get("near_density_loss", 0.0)) > 0, "train.near_density_loss"),
            (whole_tv, "a whole-grid TV (it needs model.tv_sparse_grad and 0 < model.tv_samples < the grid's cells)"),
        ):
            if bad:
                raise ConfigError(f"train.parallel: space does not support {reason} yet")
        mode = sparse_adam_mode(cfg.get("sparse_adam", False))
        if mode not in ("off", "occupied"):
            raise ConfigError(f"train.parallel: space steps dense Adam or train.sparse_adam=occupied, not {mode}")
        self.trainer, self.model, self.group = trainer, model, group
        self._slab_key: tuple | None = None  # what _slab_mask was cut from
        self._slab_mask: torch.Tensor | None = None
        model.space_split = self  # the model's march, TV and the optimiser's rows consult it

    @property
    def plane(self) -> int:
        return self.model.grid_shape[0] // 2

    @property
    def slabs(self) -> Slabs:
        return Slabs(self.plane, self.group.rank)

    def march(self, origins: torch.Tensor, directions: torch.Tensor, jitter: torch.Tensor, views=None) -> dict:
        """Training's march of the whole batch, this rank's slab composited with the other's."""
        occupancy = self._slab_occupancy()
        return split_march(self.model, self.slabs, origins, directions, jitter, occupancy=occupancy, views=views)

    def _slab_occupancy(self) -> torch.Tensor:
        """The occupancy mask cut to this rank's slab, cut again only when the mask changed (a refresh, growth or a
        load replace it or write into it)."""
        mask = self.model.occupancy.mask
        key = (id(mask), mask._version, self.plane)
        if self._slab_key != key:
            self._slab_mask, self._slab_key = self.slabs.occupancy(mask), key
        return self._slab_mask

    def owned_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The (K,) flat vertex rows of the grids that this rank steps."""
        r0, r1, r2 = self.model.grid_shape
        x = torch.div(rows, r1 * r2, rounding_mode="floor")
        return rows[x <= self.plane] if self.group.rank == 0 else rows[x >= self.plane]

    def _strata(self, samples: int) -> tuple[int, int, int]:
        """(cells, rank 0's cells, rank 0's draws) of the TV estimate's ``samples`` draws: rank 0 owns the flat cells
        below ``plane * (R1 - 1)(R2 - 1)`` (x-major), and gets draws in proportion, at least one each when it can."""
        r0, r1, r2 = self.model.grid_shape
        count, front = (r0 - 1) * (r1 - 1) * (r2 - 1), self.plane * (r1 - 1) * (r2 - 1)
        draws = round(samples * front / count)
        if samples >= 2:
            draws = min(max(draws, 1), samples - 1)
        return count, front, draws

    def draw_cells(self, samples: int, device: torch.device) -> torch.Tensor:
        """The TV estimate's (samples,) flat cells, stratified by slab: rank 0's draws uniform over its cells, then
        rank 1's over its own. Every rank draws both strata (the ranks' random streams stay in step) and
        :meth:`owned_cells` keeps its own by position: no count of a filter to wait for."""
        count, front, draws = self._strata(samples)
        return torch.cat(
            [
                torch.randint(0, front, (draws,), device=device),
                torch.randint(front, count, (samples - draws,), device=device),
            ]
        )

    def owned_cells(self, cells: torch.Tensor) -> tuple[torch.Tensor, float]:
        """This rank's stratum of the (S,) cells :meth:`draw_cells` drew, and the factor on the estimate's scale
        (its slab's fraction of the cells) that makes the two strata's means sum to the estimate of the whole mean."""
        count, front, draws = self._strata(cells.numel())
        if self.group.rank == 0:
            return cells[:draws], front / count
        return cells[draws:], (count - front) / count

    def sync_gradients(self) -> None:
        """The decoder's gradients summed over the ranks; the grids' shared plane summed."""
        grids = {id(self.model.density.grid), id(self.model.features.grid)}
        others = [p for p in self.model.parameters() if id(p) not in grids and p.grad is not None]
        if others:
            flat = torch.cat([p.grad.reshape(-1) for p in others])
            dist.all_reduce(flat)
            for p, part in zip(others, flat.split([p.grad.numel() for p in others])):
                p.grad.copy_(part.view_as(p.grad))
        for grid in (self.model.density.grid, self.model.features.grid):
            if grid.grad is not None:
                plane = grid.grad[self.plane].contiguous()
                dist.all_reduce(plane)
                grid.grad[self.plane] = plane

    @torch.no_grad()
    def gather(self, moments: bool = False) -> None:
        """Every rank's slab of the grids (and with ``moments`` of their Adam moments) onto the other rank."""
        tensors = [self.model.density.grid, self.model.features.grid]
        if moments:
            state = self.trainer.optimizer.state
            tensors += [state[g][key] for g in tensors if g in state for key in ("exp_avg", "exp_avg_sq")]
        for tensor in tensors:
            low, high = tensor[: self.plane], tensor[self.plane + 1 :]  # rank 0's, rank 1's (the plane: both)
            for part, source in ((low, 0), (high, 1)):
                buffer = part.contiguous()
                dist.broadcast(buffer, src=source)
                if self.group.rank != source:
                    part.copy_(buffer)


__all__ = ["SpaceParallel"]
