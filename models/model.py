"""VoxelNeRF: a DirectVoxGO/Plenoxels-style voxel-grid radiance field with neural shading.

One training step renders rays as follows (shapes for B rays, S samples per ray, N kept samples):
1. ray/box intersection, S uniform samples per ray at ``step_ratio`` voxels apart (jittered per ray when
   training); empty-space skipping drops those in cells the occupancy grid marks empty -> N packed samples;
2. early ray termination: a no-grad pass drops samples whose transmittance is below ``early_termination``;
3. with gradients on the survivors: density -> optical depth ``softplus(d + shift) * step / base_voxel``
   (per voxel of the final grid, so growing the grid keeps the field); samples whose compositing weight is
   below ``weight_threshold`` skip the feature lookup; ``ops.volume_render`` composites colour, depth, opacity;
4. shading (models/decoder.py): per sample before compositing, or per pixel after it (deferred; features
   upsampled with ``ops.upsample_bilinear2d``); the background shows through ``1 - opacity``.

Grids grow coarse to fine (``on_step``); the occupancy grid follows the density every ``occupancy.refresh_every``.
With ``model.fine``, a sparse grid finer still (models/brick_grid.py) adds its values to both lookups after ``fine.at``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn as nn

from data.samplers import PatchBatch
from models import render_views
from models.brick_grid import BrickGrids
from models.capacities import SampleCapacities
from models.config import ModelConfig, parse_model_config, step_of
from models.contraction import SceneSpace
from models.decoder import Decoder, SampleDecoder
from models.decoder_graphs import DecoderGraphs
from models.field import (
    OccupancyGrid,
    TouchedRows,
    VoxelGrid,
    optical_depth,
    resample_box,
    visible_box,
)
from models.grid_tv import DeferredTV, draw_cells
from models.ops import OpSet
from models.pose_refinement import PoseRefinement
from models.render import (
    check_rays,
    checked_box,
)
from models.sparse_rows import RowGradients


class VoxelNeRF(nn.Module):
    """Density grid (R0,R1,R2,1) + feature grid (R0,R1,R2,F) over ``bbox``, rendered between near and far.

    Args:
        bbox: (2, 3) min and max corners of the scene box (sets the voxel budget and the density unit).
        grid_box: optional (2, 3) smaller box the grids start on (same voxel budget: finer voxels).
        near, far: ray distance range (unit directions: Euclidean distances).
        cfg: a :class:`ModelConfig`, or a mapping of its fields (missing ones take the defaults).
        ops: the op backends (models.ops.build_ops).
    """

    def __init__(
        self, bbox: torch.Tensor, near: float, far: float, cfg: Any, ops: OpSet, grid_box: torch.Tensor | None = None
    ):
        super().__init__()
        bbox = checked_box("bbox", bbox)
        grid_box = None if grid_box is None else checked_box("grid_box", grid_box)
        if not 0.0 <= near < far:
            raise ValueError(f"near, far: need 0 <= near < far, got near={near}, far={far}")
        self.config: ModelConfig = parse_model_config(cfg)
        self.grow_at = list(self.config.grow_at)  # the coarse growth schedule (plan_fine may choose fine.grow_at)
        self.resolution_end = self.config.resolution_end  # and its end (plan_fine may choose fine.resolution_end)
        self.space = SceneSpace(self.config.contraction)  # the box, or the contracted cube around it (unbounded)
        self.ops = ops
        self.near, self.far = float(near), float(far)
        # the scene's box: sets the voxel budget (resolution counts vertices along its longest side) and the
        # density unit; ``bbox`` is where the grids are now (smaller after shrink_to_occupied)
        self.initial_extent = tuple(float(e) for e in (bbox[1] - bbox[0]).tolist())
        start_box = bbox if grid_box is None else grid_box  # e.g. the masks' visual hull (data.bounds)
        self.extent = tuple(float(e) for e in (start_box[1] - start_box[0]).tolist())
        self.register_buffer("bbox", start_box.clone())
        self.register_buffer("background", torch.tensor(self.config.background, dtype=torch.float32))

        c = self.config
        self._resolution = self.resolution_at(0, 1)
        self.shrunk = False
        shape = self.shape_at(self._resolution)
        # density in units of the final grid's voxel (scene box): its meaning survives growth and shrinking
        self.base_voxel = self.space.voxel(self.initial_extent, self.space.shape(self.initial_extent, c.resolution_end))
        self.density = VoxelGrid(shape, 1)
        self.features = VoxelGrid(shape, c.feature_dim, init_std=c.feature_init_std)
        self.occupancy = OccupancyGrid(shape)
        self.fine = BrickGrids(c.feature_dim, c.fine.brick)  # sparse, finer detail near surfaces (model.fine)
        mlp = (c.decoder_hidden, c.decoder_layers, c.dir_encoding, c.gelu_approximate, ops, c.decoder_precision)
        mlp += (c.appearance, c.appearance_dim)  # per-image appearance lives in the decoder (models/appearance.py)
        # both see every feature channel: per sample the raw features, deferred the composited diffuse + the rest
        self.decoder = (SampleDecoder if c.shading == "per_sample" else Decoder)(c.feature_dim, *mlp)
        graphed = c.decoder_graphs and c.shading == "per_sample"  # training's shading from CUDA graphs
        self.decoder_graphs = DecoderGraphs(self.decoder) if graphed else None
        self.capacities = SampleCapacities() if c.capped_samples else None  # training's march (models/capacities.py)
        self.poses = PoseRefinement(c.pose_refinement)  # per-training-image camera corrections (sized by the trainer)
        self.progress = 0.0  # fraction of training done, from on_step (switches the TV regulariser off)
        self.touched = TouchedRows()  # the grid rows a step reads, when enabled (the touched-rows sync)
        self.row_grads = RowGradients()  # model.tv_sparse_grad: the TV rows' gradients, added after the backward
        self.deferred_tv = DeferredTV()  # the trainer's TV: cells drawn before the forward, applied after the backward
        self.space_split = None  # train.parallel=space: this rank's slab of the voxels (training.space_parallel)

    # the schedule's state travels with the weights: state_dict "_extra_state" = (resolution, shrunk) int64
    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor([self._resolution, int(self.shrunk)], dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a checkpoint from before the schedule state was saved: its box never shrank, its grid shows the resolution
        key, grid = prefix + "_extra_state", state_dict.get(prefix + "density.grid")
        if key not in state_dict and isinstance(grid, torch.Tensor) and grid.dim() == 4:
            state_dict[key] = torch.tensor([max(grid.shape[:3]), 0], dtype=torch.int64)
        if prefix + "fine.table" not in state_dict:  # from before the fine grid: none allocated
            for name, value in BrickGrids(self.config.feature_dim, self.config.fine.brick).state_dict().items():
                state_dict[prefix + "fine." + name] = value
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def set_extra_state(self, state: torch.Tensor) -> None:
        self._resolution, self.shrunk = int(state[0]), bool(state[1])
        self.extent = tuple(float(e) for e in (self.bbox[1] - self.bbox[0]).tolist())  # bbox is loaded first

    # ------------------------------------------------------------------ geometry and schedule
    @property
    def upsample(self) -> int:
        """``model.upsample``: the deferred decoder's upsample factor, the op's ``scale_factor`` (1: per pixel)."""
        return self.config.upsample

    @property
    def grid_shape(self) -> tuple[int, int, int]:
        return self.density.shape

    @property
    def resolution(self) -> int:
        """The schedule's resolution: vertices along the scene box's longest side at this voxel size (the grid
        holds about as many voxels after the box shrinks, over a smaller box: finer voxels)."""
        return self._resolution

    def shape_at(self, resolution: int) -> tuple[int, int, int]:
        """Grid shape over the current box for ``resolution``: the scene box's voxel count at that resolution."""
        if self.extent == self.initial_extent:
            return self.space.shape(self.extent, resolution)
        voxel = max(self.initial_extent) / (resolution - 1)
        voxel *= (math.prod(self.extent) / math.prod(self.initial_extent)) ** (1.0 / 3.0)
        return tuple(max(2, round(e / voxel) + 1) for e in self.extent)

    @property
    def step_size(self) -> float:
        """Distance between samples along a ray: ``step_ratio`` voxels of the current grid."""
        return self.config.step_ratio * self.space.voxel(self.extent, self.grid_shape)

    def plan_fine(self, pixel_size: float | None) -> None:
        """Given the training views' pixel footprint at the box centre, decide before training whether the fine grid
        will come (``fine.min_pixels`` against ``resolution_end``'s coarse voxel); if it will, the coarse grids grow
        on ``fine.grow_at`` (a shorter coarse stage, a longer fine one) up to ``fine.resolution_end`` where set."""
        self.fine.pixel_size = pixel_size
        fine = self.config.fine
        if fine.factor > 0:
            final_voxel = self.space.voxel(self.extent, self.shape_at(self.config.resolution_end))
            if not self.fine.decline_if_resolved(final_voxel, fine.min_pixels):
                self.grow_at = list(fine.grow_at) if fine.grow_at is not None else self.grow_at
                self.resolution_end = fine.resolution_end or self.resolution_end

    def resolution_at(self, step: int, total_steps: int) -> int:
        """Grid resolution scheduled after ``step`` optimiser steps: geometric from start to end over grow_at."""
        c, grow_at, end = self.config, self.grow_at, self.resolution_end
        if not grow_at:
            return end  # no schedule: the final grid from the start
        level = sum(step >= step_of(g, total_steps) for g in grow_at)
        ratio = end / c.resolution_start
        return round(c.resolution_start * ratio ** (level / len(grow_at)))

    def set_resolution(self, resolution: int) -> None:
        """Resample both grids to ``resolution`` vertices along the longest side (replaces the parameters).

        The occupancy grid is reset to all-occupied at the new shape (on_step rebuilds it after warm-up).
        """
        self.fine.check_unallocated("grow")
        self._resolution = resolution
        shape = self.shape_at(resolution)
        self.density.resize(shape)
        self.features.resize(shape)
        self.occupancy.fill(shape)

    def shrink_step(self, total_steps: int) -> int | None:
        """The step after which the box shrinks to the occupied region (None: never)."""
        at = self.config.shrink_at
        return None if at is None else step_of(at, total_steps)

    @torch.no_grad()
    def shrink_to_occupied(self, resolution: int) -> bool:
        """Move the grids' box to the region whose density is visible, and resample both grids into it at
        ``resolution`` (DirectVoxGO's coarse-geometry box, TensoRF's shrink): the same voxel budget then buys
        finer voxels on the object. Occupied = per-vertex alpha at the current sampling step >= shrink_threshold,
        plus a margin of two voxels. Returns False (nothing changed) when no vertex is occupied.
        """
        c = self.config
        scale = self.step_size / self.base_voxel
        new_bbox = visible_box(self.density.grid[..., 0], self.bbox, c.density_shift, scale, c.shrink_threshold)
        if new_bbox is None:
            return False
        self.fine.check_unallocated("shrink")
        old_bbox = self.bbox.clone()
        self.bbox.copy_(new_bbox)
        self.extent = tuple(float(e) for e in (self.bbox[1] - self.bbox[0]).tolist())  # as stored (float32)
        self._resolution = resolution
        shape = self.shape_at(resolution)
        for grid in (self.density, self.features):
            grid.grid = nn.Parameter(resample_box(grid.grid.detach(), old_bbox, new_bbox, shape))
        self.occupancy.fill(shape)
        self.shrunk = True
        return True

    @torch.no_grad()
    def vertex_alpha(self) -> torch.Tensor:
        """(R0, R1, R2) alpha of a sample at each vertex at the current sampling step: the occupancy grid's input (a
        sample inside a cell has at most its corners' largest alpha: the density is interpolated, softplus rises)."""
        steps = self.space.vertex_steps(self.grid_shape, self.bbox.device)  # contracted: grows outwards
        density = self.density.grid[..., 0]
        if self.fine.active:  # the summed density's bound: the occupancy grid never skips what the fine grid fills
            density = density + self.fine.density_bound(self.grid_shape)
        sigma_delta = optical_depth(density, self.config.density_shift, self.step_size / self.base_voxel * steps)
        return -torch.expm1(-sigma_delta)

    @torch.no_grad()
    def refresh_occupancy(self) -> None:
        """Rebuild the occupancy grid from the density grid at the current sampling step."""
        self.occupancy.update(self.vertex_alpha(), self.config.occupancy.threshold, self.config.occupancy.dilate)

    def on_step(self, step: int, total_steps: int) -> bool:
        """Call after optimiser step number ``step`` (1-based) of ``total_steps``. Grows the grids when the schedule
        says so and refreshes the occupancy grid; True when the grid parameters were replaced (rebuild the
        optimiser with :meth:`param_groups`)."""
        c = self.config
        self.progress = step / max(total_steps, 1)
        target = self.resolution_at(step, total_steps)
        shrink = self.shrink_step(total_steps)
        grown = False
        shrinking = not self.shrunk and shrink is not None and step >= shrink
        due = step == c.occupancy.warmup or step % c.occupancy.refresh_every == 0
        if shrinking or target != self.resolution:  # whole-grid reads: a replaying optimiser catches up first
            self.touched.before_whole_read()
        if shrinking:
            grown = self.shrink_to_occupied(target)
        if target != self.resolution:
            self.set_resolution(target)
            grown = True
        voxel = self.space.voxel(self.extent, self.grid_shape)
        # at fine.at; contracted: bricks in the box and out to fine.reach (farther out, the shell's voxels grow with
        # the distance squared, its pixels' footprint only with the distance)
        foreground = partial(self.space.foreground_cells, self.grid_shape, self.bbox.device, c.fine.reach)
        grown = self.fine.schedule(step, total_steps, c.fine, self.occupancy.mask, voxel, foreground) or grown
        if step >= c.occupancy.warmup and (grown or due):
            self.touched.before_whole_read(density_only=True)  # the refresh reads the density grid alone
            self.refresh_occupancy()
        if self.capacities is not None:  # the samples a ray gets moved: measured or followed (models/capacities.py)
            observe = c.capped_refresh == "observe"
            self.capacities.schedule(step, c.occupancy.warmup, grown, due and step >= c.occupancy.warmup, observe)
        return grown

    def query_density(self, unit_points: torch.Tensor) -> torch.Tensor:
        """(N, 3) grid coordinates -> (N,) raw density: the coarse grid's plus the fine grid's where it has bricks."""
        density = self.density(unit_points, self.ops)
        if self.fine.active:
            density = density + self.fine.lookup(self.fine.density, unit_points, self.ops)
        return density[:, 0]

    def query_features(self, unit_points: torch.Tensor) -> torch.Tensor:
        """(N, 3) grid coordinates -> (N, F) features: the coarse grid's plus the fine grid's."""
        features = self.features(unit_points, self.ops)
        if self.fine.active:
            features = features + self.fine.lookup(self.fine.features, unit_points, self.ops)
        return features

    # ------------------------------------------------------------------ optimisation
    def param_groups(self, lr_grid: float, lr_decoder: float, lr_pose: float = 0.0) -> list[dict]:
        """Adam parameter groups: the grids at ``lr_grid``, the decoder at ``lr_decoder``, and with
        ``model.pose_refinement`` the pose corrections at ``lr_pose`` (group ``poses``)."""
        groups = [
            {"params": [self.density.grid, self.features.grid], "lr": lr_grid, "name": "grids"},
            {"params": list(self.decoder.parameters()), "lr": lr_decoder, "name": "decoder"},
        ]
        if self.fine.active:  # the pool holds only the bricks near surfaces
            fine = [self.fine.density, self.fine.features]
            groups.append({"params": fine, "lr": lr_grid * self.config.fine.lr, "name": "fine"})
        if self.poses.enabled:
            groups.append({"params": [self.poses.table], "lr": lr_pose, "name": "poses"})
        return groups

    def regularization(self, defer: bool = False) -> torch.Tensor | None:
        """Weighted total variation of the density and feature grids (scalar; zero after ``tv_until``). With
        ``model.tv_sparse_grad`` its gradient reaches the grids only at ``self.row_grads.scatter()``, which the
        caller runs after ``backward()``.

        ``defer`` (the trainer's step): where ``ops.sampled_tv`` can take the estimate (``model.tv_sparse_grad``,
        a sampled estimate, no touched-rows marks), this only draws its cells and returns None (no term);
        :meth:`deferred_regularization` computes it after the backward, gradient included."""
        c = self.config
        terms = []
        self.row_grads.clear()  # gathers of an estimate that was never backpropagated
        self.deferred_tv.cells = None
        if defer and (self.progress > c.tv_until or self.deferred_tv.applies(self)):
            if self.progress <= c.tv_until:
                self.deferred_tv.draw(self)
            return None
        if self.progress <= c.tv_until:
            touched = self.touched.mask(self.grid_shape, self.bbox.device) if self.touched.enabled else None
            # model.tv_background: the contracted shell's pairs weigh that much more (None / 1: unweighted)
            weighted = c.tv_background != 1.0
            shell = (self.space.foreground(self.grid_shape, self.bbox.device) if weighted else None, c.tv_background)
            rows = self.row_grads if c.tv_sparse_grad else None  # the rows read, not a whole-grid gradient
            coarse, fine = draw_cells(self)  # the draws the deferred estimate makes
            for weight, grid in ((c.tv_density, self.density), (c.tv_features, self.features)):
                if weight > 0:
                    tv = grid.total_variation(c.tv_samples, touched, *shell, rows=rows, cells=coarse)
                    terms.append(weight * tv)
            if self.fine.active:  # the fine grid's own, at its spacing
                weights = (c.tv_density * c.fine.tv, c.tv_features * c.fine.tv)
                terms.append(self.fine.regularization(*weights, c.tv_samples, rows, fine))
        # no term: a zero that stays in the graph, so backward() always works
        return sum(terms) if terms else self.density.grid.reshape(-1)[:1].sum() * 0.0

    def deferred_regularization(self) -> torch.Tensor | None:
        """After ``loss.backward()``: the TV estimate :meth:`regularization` (``defer``) left out, its gradient added
        onto the grids' ``.grad`` (:class:`models.grid_tv.DeferredTV`); its () float64 value, or None."""
        return self.deferred_tv.apply(self)

    # ------------------------------------------------------------------ rendering
    def march(self, origins: torch.Tensor, directions: torch.Tensor, jitter: bool | torch.Tensor, views=None) -> dict:
        """Composite B rays with gradients, as training does: :func:`models.render_views.march`."""
        if self.space_split is not None and self.training and torch.is_grad_enabled():
            return self.space_split.march(origins, directions, jitter, views)  # this slab, composited with the others'
        return render_views.march(self, origins, directions, jitter, views)

    def decode_samples(
        self, features: torch.Tensor, directions: torch.Tensor, ray: torch.Tensor, views: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Training's per-sample shading: (N, F) features, the (B, 3) rays' directions, (N,) int64 ray of each sample,
        optional (B,) training images -> (N, 3) colour; through CUDA graphs with ``model.decoder_graphs``."""
        if self.decoder_graphs is None:
            return self.decoder(features, directions, ray, views)
        return self.decoder_graphs(features, directions, ray, views)

    @property
    def per_sample(self) -> bool:
        """True when colour is decoded per sample before compositing (``model.shading=per_sample``)."""
        return self.config.shading == "per_sample"

    def shade(
        self,
        diffuse: torch.Tensor,
        features: torch.Tensor,
        opacity: torch.Tensor,
        directions: torch.Tensor,
        background: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(M,3), (M,F-3), (M,), (M,3) unit directions -> (M,3) pixel colour over the background.

        ``background``: (M, 3) colours per pixel (training on random backgrounds), or None for the model's own.
        """
        if self.per_sample:  # the composited colour; the image's affine transform per pixel (models/decoder.py)
            foreground = self.decoder.appearance.transform(diffuse, image_index, opacity)
        else:
            foreground = self.decoder(diffuse, features, opacity, directions, image_index)
        return foreground + (1.0 - opacity)[:, None] * (self.background if background is None else background)

    def render_rays(self, origins: torch.Tensor, directions: torch.Tensor, background=None, jitter=None, views=None):
        """(B,3) origins and unit directions -> dict(rgb (B,3), depth (B,), opacity (B,)). In training mode samples
        are jittered by ``jitter`` (B,) in [0, 1) (the batch's) or a fresh draw. ``background``: optional (B, 3).
        ``views``: optional (B,) training-image index of each ray (model.appearance; None: the mean appearance)."""
        check_rays("render_rays", origins, directions)
        origins, directions = self.poses(views, origins, directions)  # training images' refined cameras (or as given)
        out = self.march(origins, directions, self.training if jitter is None or not self.training else jitter, views)
        rgb = self.shade(out["diffuse"], out["features"], out["opacity"], directions, background, views)
        return {"rgb": rgb} | {key: out[key] for key in ("depth", "opacity", "samples", "packed")}

    # whole pictures live in models/render_views.py (training's patches, full views, the inference path)
    def render_patches(self, batch: PatchBatch, background: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Patch path: low-res rays (n,P,P,3) -> dict(rgb (n,sP,sP,3), depth (n,P,P), opacity (n,P,P), ...):
        :func:`models.render_views.render_patches`."""
        return render_views.render_patches(self, batch, background)

    def render_image(
        self, c2w: torch.Tensor, height: int, width: int, focal: float | torch.Tensor, chunk: int = 8192, lens=None
    ) -> dict[str, torch.Tensor]:
        """A full view through training's march: dict(rgb (H,W,3), depth (H,W), opacity (H,W)):
        :func:`models.render_views.render_image` (``lens``: None or the view's data.camera_models.Lens)."""
        return render_views.render_image(self, c2w, height, width, focal, chunk, lens)
