"""``train.parallel=space`` under torchrun: the voxels split by space instead of the rays, one slab a rank (issue 33;
two H200s: 0.95-1.18x one GPU on lego at the same PSNR, by host; with each rank's step from a CUDA graph
(``train.step_graph``) and sizes that follow the refreshes' counts 1.61-1.69x, four H200s 2.02-2.05x: bench/README
"The warmup's steps replayed", "Two H200s at 1.51-1.61x, four at 2.02-2.05x").

Every rank draws the whole batch and marches, shades and differentiates only the samples of its slab of the grids
(models.space_split: S ranks cut the first axis at S - 1 vertex planes; neighbours share their plane); the
composited per-ray values are exchanged, so every rank computes the same loss. Then:
- gradients: every rank backpropagates 1/S of the loss (models.space_split), so the decoder's are summed over the
  ranks (its samples' part from each, and 1/S of what acts after the exchange from each); the grids' only on the
  shared planes (their two owners read them); nothing else moves; one all-reduce for all of it;
- Adam: the occupied voxels of this rank's slab (``train.sparse_adam=occupied``) or dense Adam (the other slabs'
  rows then move on their moments alone, unread, and are overwritten at the next gather);
- the TV estimate: stratified by slab (each rank's draws over its own cells, in proportion to them), each rank's
  stratum scaled by its slab's share, so that the parts sum to the estimate;
- before a whole-grid read (an occupancy refresh, a growth, an evaluation) the ranks exchange their slabs of the
  grids (S broadcasts a grid), and before a checkpoint their slabs of Adam's moments too, so that every rank then
  holds what one process would.
Not supported (refused): a fine grid, pose refinement, the distortion loss (pairs of samples across the slabs), the
near-density loss (a term of one slab's samples outside the exchange), a whole-grid TV (a term of each rank's loss,
where the other slabs are stale).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from models.capacities import SampleCapacities
from models.grid_tv import DeferredTV
from models.space_split import Slabs, gather_ranks, regrid_layers, split_march, work_layers
from training.config import ConfigError
from training.config_rules import sparse_adam_mode
from training.distributed import check_shards


class SpaceParallel:
    """The split of one torchrun job, a slab a rank; set on the model (``model.space_split``) and the trainer."""

    def __init__(self, trainer, graphed: bool = False):
        refusal = SpaceParallel.refusal(trainer)
        if refusal is not None:
            raise ConfigError(f"train.parallel: space {refusal}")
        group, model = trainer.group, trainer.model
        self.trainer, self.model, self.group = trainer, model, group
        self._planes: tuple | None = None  # (grid shape, planes) set by balance() for grids of that shape
        self._layers: tuple | None = None  # (counts, their first-axis span): the shaded samples since the last cut,
        # per cell layer, then the steps counted
        self.graphed = graphed  # a rank's step from a CUDA graph (training.step_graph)
        self.cuts: list[dict] = []  # each cut by the counts: step, first-axis vertices, planes (metrics.json parallel)
        model.space_split = self  # the model's march, TV and the optimiser's rows consult it
        if model.capacities is not None:  # the largest rank's counts size every rank's capacities
            model.capacities.share, model.capacities.rank = self.share_counts, group.rank

    @staticmethod
    def refusal(trainer) -> str | None:
        """Why the split cannot take this run (a phrase after "space"), or None where it can."""
        group, model, cfg = trainer.group, trainer.model, trainer.train_cfg
        if group.world < 2 or model.grid_shape[0] < 2 * group.world:
            return (
                f"splits the grids over 2 or more ranks, at least 2 vertices of the first axis each: {group.world} "
                f"ranks for {model.grid_shape[0]} (model.resolution_start)"
            )
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
                return f"does not support {reason} yet"
        mode = sparse_adam_mode(cfg.get("sparse_adam", False))
        if mode not in ("off", "occupied"):
            return f"steps dense Adam or train.sparse_adam=occupied, not {mode}"
        return None

    @property
    def slabs(self) -> Slabs:
        """This rank's slab of the grids as they are now (they grow): as :meth:`balance` cut them for this shape,
        else even."""
        shape = self.model.grid_shape
        if self._planes is not None and self._planes[0] == shape:
            return Slabs(self._planes[1], self.group.rank)
        return Slabs.even(shape[0], self.group.world, self.group.rank)

    @torch.no_grad()
    def balance(self) -> None:
        """The planes cut where the work since the last cut splits evenly: the shaded samples a step counted (every
        rank its slab's, summed over the ranks; mapped onto the grids as they are now), each grid row that Adam steps
        added as :data:`models.space_split.ROW_WORK` of a sample (:func:`models.space_split.work_layers`): the
        decoder's work, ~2/3 of a step's kernels, and Adam's then fall evenly on the ranks. Even planes where nothing
        was counted (the start, a resume). Only when every rank holds the same whole grids with no Adam history that
        the new owner of a row would lack: right after a growth
        (new parameters, new moments) or a resume (the moments were gathered for the checkpoint). A collective: every
        rank calls it at the same step. Lego 400, one H200 (bench/slab_balance.py, 2026-11-29): at even planes the
        larger slab shaded 56% of the samples over the run, at the samples' own cut 50.5%; the occupancy's surface
        cells (session 40's rule) gave 57-58%; the work's cut trained two ranks 1.705x one GPU against 1.678x for the
        samples alone (docs/decisions.md)."""
        shape, counted = self.model.grid_shape, self._layers
        span = self._span()
        self._layers = None  # counted afresh on the grids as they are now
        if counted is None:
            self._planes = None
            return
        counts, counted_span = counted
        dist.all_reduce(counts)  # the samples over the ranks; the steps, which every rank counted alike, times S
        steps = max(float(counts[-1]) / self.group.world, 1.0)  # a host sync, at a cut only
        layers = regrid_layers(counts[:-1] / steps, counted_span, span, shape[0] - 1)
        mask = self.model.occupancy.mask
        if mask.shape[0] == layers.numel():  # else a growth before the first refresh
            layers = work_layers(layers, mask)
        planes = Slabs.balanced(layers, self.group.world, self.group.rank).planes
        self._planes = (shape, planes)
        self.cuts.append({"step": self.trainer.step, "vertices": shape[0], "planes": list(planes)})
        if self.group.rank == 0:
            even = Slabs.even(shape[0], self.group.world, 0).planes
            print(f"space split: slabs cut at vertex planes {planes} of {shape[0]} (even: {even})")

    def _span(self) -> tuple[float, float]:
        """The grids' first axis in the world, (first vertex, last vertex): a host sync (at a cut only)."""
        low, high = self.model.bbox[:, 0].tolist()
        return low, high

    def _counting(self) -> torch.Tensor | None:
        """The (R0,) counts the march adds this slab's shaded samples to, per cell layer, and its steps (from the
        occupancy's warmup on), None before it and inside a captured step (training.step_graph: its
        samples have padding rows, so it counts none; the counts must not be made there either, or every replay would
        zero them)."""
        capturing = self.model.bbox.is_cuda and torch.cuda.is_current_stream_capturing()
        # before the occupancy's warmup every ray is marched through the whole box: those steps' samples say little
        # of where a later step's fall, and there are many of them (every step measures there)
        warming = self.trainer.step < self.model.config.occupancy.warmup
        if capturing or warming:
            return None
        cells = self.model.grid_shape[0] - 1
        if self._layers is None or self._layers[0].numel() != cells + 1:
            zeros = torch.zeros(cells + 1, dtype=torch.float64, device=self.model.bbox.device)
            self._layers = (zeros, self._span())
        return self._layers[0]

    def share_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """This rank's (3,) int64 sample counts -> (S, 3) every rank's, by rank: one all-gather (captured with the
        step where a graph is: models.capacities.SampleCapacities.share)."""
        return gather_ranks(counts.to(self.model.bbox.device), self.group.world, None)

    def march(self, origins: torch.Tensor, directions: torch.Tensor, jitter: torch.Tensor, views=None) -> dict:
        """Training's march of the whole batch, this rank's slab composited with the other's."""
        return split_march(self.model, self.slabs, origins, directions, jitter, None, views, self._counting())

    def graph_key(self) -> tuple:
        """What a captured step (training.step_graph) reads from the split as fixed: the planes (the march's cells)."""
        return self.slabs.planes

    def owned_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The (K,) flat vertex rows of the grids that this rank steps: those of its slab, its planes included."""
        r0, r1, r2 = self.model.grid_shape
        first, end = self.slabs.cells
        x = torch.div(rows, r1 * r2, rounding_mode="floor")
        return rows[(x >= first) & (x <= (r0 - 1 if end is None else end))]

    def _strata(self, samples: int) -> list[tuple[int, int, int]]:
        """(first cell, end cell, draws) a slab of the TV estimate's ``samples`` draws over the flat cells (x-major:
        a slab's cells are one range): draws in proportion to the cells, at least one each when there are enough."""
        r0, r1, r2 = self.model.grid_shape
        layer, count = (r1 - 1) * (r2 - 1), (r0 - 1) * (r1 - 1) * (r2 - 1)
        edges = [0, *(plane * layer for plane in self.slabs.planes), count]
        floor = 1 if samples >= len(edges) - 1 else 0
        spare = samples - floor * (len(edges) - 1)
        bounds = [floor * k + spare * edge // count for k, edge in enumerate(edges)]
        return [(a, b, d1 - d0) for a, b, d0, d1 in zip(edges, edges[1:], bounds, bounds[1:])]

    def draw_cells(self, samples: int, device: torch.device) -> torch.Tensor:
        """The TV estimate's (samples,) flat cells, stratified by slab: rank 0's draws uniform over its cells, then
        rank 1's over its own, and so on. Every rank draws every stratum (the ranks' random streams stay in step) and
        :meth:`owned_cells` keeps its own by position: no count of a filter to wait for."""
        strata = self._strata(samples)
        return torch.cat([torch.randint(first, end, (draws,), device=device) for first, end, draws in strata])

    def owned_cells(self, cells: torch.Tensor) -> tuple[torch.Tensor, float]:
        """This rank's stratum of the (S,) cells :meth:`draw_cells` drew, and the factor on the estimate's scale
        (its slab's fraction of the cells) that makes the strata's means sum to the estimate of the whole mean."""
        strata = self._strata(cells.numel())
        start = sum(draws for _, _, draws in strata[: self.group.rank])
        first, end, draws = strata[self.group.rank]
        return cells[start : start + draws], (end - first) / strata[-1][1]

    @torch.no_grad()
    def sync_gradients(self) -> None:
        """The decoder's gradients and the grids' shared planes summed over the ranks, in one all-reduce (a collective
        costs the host ~0.1 ms to issue, more than these few MB cost to copy into one buffer and back). A plane's
        two owners send their part of its gradient, the other ranks zeros; each owner takes the sum back."""
        ids = {id(self.model.density.grid), id(self.model.features.grid)}
        grids = [grid for grid in (self.model.density.grid, self.model.features.grid) if grid.grad is not None]
        parts = [p.grad for p in self.model.parameters() if id(p) not in ids and p.grad is not None]
        kept = [True] * len(parts)
        slabs = self.slabs
        first, end = slabs.cells
        for plane in slabs.planes:
            owned = plane in (first, end)
            for grid in grids:
                parts.append(grid.grad[plane] if owned else grid.grad.new_zeros(grid.grad.shape[1:]))
                kept.append(owned)
        if not parts:
            return
        flat = torch.cat([part.reshape(-1) for part in parts])
        dist.all_reduce(flat)
        chunks = flat.split([part.numel() for part in parts])
        targets = [part for part, keep in zip(parts, kept) if keep]
        torch._foreach_copy_(targets, [chunk.view_as(part) for part, chunk, keep in zip(parts, chunks, kept) if keep])

    @torch.no_grad()
    def clear_upper_planes(self) -> None:
        """After Adam: the gradient of the plane this rank shares with the rank below, zeroed here (the plane's upper
        owner). Adam (``train.sparse_adam=occupied``) leaves only the rows it stepped zero; the plane's other rows (the
        TV estimate's gradient in empty space) keep theirs between steps, as one process's do, and both owners hold
        it after :meth:`sync_gradients`, whose next sum would double it: every step, to inf and then NaN (two H200s,
        ``model.capped_refresh=observe``, which has no eager step to zero it at a refresh: NaN by step 600). Kept by
        the lower owner alone, it accumulates as one process's does."""
        if self.group.rank == 0:  # the first plane's lower owner
            return
        first, _ = self.slabs.cells
        for grid in (self.model.density.grid, self.model.features.grid):
            if grid.grad is not None:
                grid.grad[first].zero_()

    @torch.no_grad()
    def gather(self, moments: bool = False, features: bool = True) -> None:
        """Every rank's slab of the grids (and with ``moments`` of their Adam moments) onto the other ranks: rank r
        broadcasts its rows past its lower plane up to its upper plane (the last rank: to the end). ``features``
        false: the density grid alone."""
        tensors = [self.model.density.grid, *([self.model.features.grid] if features else [])]
        if moments:
            state = self.trainer.optimizer.state
            tensors += [state[g][key] for g in tensors if g in state for key in ("exp_avg", "exp_avg_sq")]
        planes = self.slabs.planes
        for tensor in tensors:
            for source in range(len(planes) + 1):
                first = planes[source - 1] + 1 if source > 0 else 0
                part = tensor[first : planes[source] + 1] if source < len(planes) else tensor[first:]
                buffer = part.contiguous()
                dist.broadcast(buffer, src=source)
                if self.group.rank != source:
                    part.copy_(buffer)

    def gather_density(self) -> None:
        """:meth:`gather` of the density grid alone, before an occupancy refresh (its only read): the feature grid,
        12 of the 13 channels, stays stale outside this rank's slab until the next whole read (an evaluation, a
        growth, a checkpoint), where it is read nowhere in between."""
        self.gather(features=False)


def split_for(trainer) -> SpaceParallel | None:
    """This rank's slab under torchrun, or None (data parallel; one process), as ``train.parallel`` asks. ``auto``
    (the default): by space on CUDA where the split takes the run, with ``model.capped_samples`` and
    ``train.step_graph`` on (lego: two H200s 1.61-1.69x one GPU at the same PSNR, four 2.02-2.05x, where data parallel
    is 0.71-0.80x; bench/README "The warmup's steps replayed"); else data parallel, which every run takes."""
    asked, group = str(trainer.train_cfg.get("parallel", "auto")), trainer.group
    if not group.active:
        if asked == "space":
            print("train.parallel=space splits a torchrun job of 2 or more ranks; one process trains the whole grids")
        return None
    if asked == "space":
        return SpaceParallel(trainer, graphed=bool(trainer.train_cfg.get("step_graph", False)))
    if asked == "auto":
        refusal = "runs on CUDA only" if trainer.device.type != "cuda" else SpaceParallel.refusal(trainer)
        if refusal is None:
            if trainer.model.capacities is None:  # the sizes a captured step needs (models/capacities.py)
                trainer.model.capacities = SampleCapacities()
            split = SpaceParallel(trainer, graphed=True)
            if group.is_main:
                print(f"train.parallel=auto: split by space over {group.world} ranks (capped samples, step graph)")
            return split
        if group.is_main:  # on GPUs data parallel is slower than one GPU: say what uses them better
            slower = "; it trained lego at 0.71-0.80x one GPU: a sweep, one GPU a job, uses GPUs better (README)"
            hint = slower if trainer.device.type == "cuda" else ""
            print(f"train.parallel=auto: data parallel over {group.world} ranks (the space split {refusal}){hint}")
    check_shards(trainer.cfg, group.world)
    return None


__all__ = ["SpaceParallel", "split_for"]
