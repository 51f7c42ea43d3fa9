"""Rendering whole pictures of a :class:`models.model.VoxelNeRF`: training's patches, full views through training's
own march (the reference), and the inference-only march that evaluation and every app render through.

- :func:`march`: training's march of a batch of rays, with gradients (``model.march``).
- :func:`render_patches`: low-res patches marched with gradients, the composited channels upsampled and decoded
  per full-res pixel (training's deferred path).
- :func:`render_image`: a full view through ``model.march`` (no jitter), in chunks: exactly what training renders.
- :func:`infer_image`: the same picture without the training-only work: one density lookup per marched sample
  (``march`` looks twice: its no-grad pass, then with gradients), no gradient or TV/touched-row bookkeeping, the
  samples past the early-termination transmittance or below the weight threshold never decoded, compositing in one
  ``volume_render`` over the march's own ray offsets, and a whole view per launch where the caller asks for it.
  Two host syncs per chunk: the packed sample count (``march_rays``) and the decoded sample count.

Both full-view paths share :func:`_view` (camera rays, chunks, upsampling, per-pixel shading), so they differ only
in how a chunk of rays is composited.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import torch

from data.camera_models import Lens
from data.rays import camera_rays
from data.samplers import PatchBatch
from models.decoder import DIFFUSE_CHANNELS
from models.field import optical_depth
from models.pose_refinement import points_with_ray_gradients
from models.regularizers import RenderedSamples
from models.render import PackedSamples, rows_in_rays, survivors_and_weights

if TYPE_CHECKING:  # models.model imports this module, models.space_split imports it
    from models.model import VoxelNeRF
    from models.space_split import SlabPass

Composite = Callable[[torch.Tensor, torch.Tensor], dict]  # (B, 3) origins, directions -> march()'s channels


def upsample_channels(model: VoxelNeRF, channels: torch.Tensor) -> torch.Tensor:
    """(n, P, P, C) low-res composited channels -> (n, sP, sP, C) through ``ops.upsample_bilinear2d``."""
    if model.upsample == 1:
        return channels
    upsampled = model.ops.upsample_bilinear2d(channels.permute(0, 3, 1, 2).contiguous(), model.upsample, False)
    return upsampled.permute(0, 2, 3, 1)


def render_patches(model: VoxelNeRF, batch: PatchBatch, background: torch.Tensor | None = None) -> dict:
    """Patch path: low-res rays (n,P,P,3) -> dict(rgb (n,sP,sP,3), depth (n,P,P), opacity (n,P,P), samples, packed).

    The composited diffuse colour, features and opacity are upsampled by s and decoded per full-res pixel
    with ``batch.hr_directions`` (n,sP,sP,3). ``background``: optional (n,sP,sP,3) colours.
    """
    n, p = batch.origins.shape[:2]
    side = p * model.upsample
    for name, got, want in (
        ("origins", batch.origins.shape, (n, p, p, 3)),
        ("directions", batch.directions.shape, (n, p, p, 3)),
        ("hr_directions", batch.hr_directions.shape, (n, side, side, 3)),
    ):
        if tuple(got) != want:
            raise ValueError(f"render_patches: {name} must be {want} (upsample={model.upsample}), got {tuple(got)}")
    jitter = batch.jitter if model.training and batch.jitter is not None else model.training
    # training images' refined cameras (model.pose_refinement; held out or off: as given)
    origins, directions, hr_directions = model.poses(batch.views, batch.origins, batch.directions, batch.hr_directions)
    per_ray_views = None if batch.views is None else batch.views.repeat_interleave(p * p)  # per-sample codes
    out = model.march(origins.reshape(-1, 3), directions.reshape(-1, 3), jitter=jitter, views=per_ray_views)
    low = torch.cat([out["diffuse"], out["features"], out["opacity"][:, None]], dim=1).reshape(n, p, p, -1)
    high = upsample_channels(model, low).reshape(n * side * side, -1)
    rgb = model.shade(
        high[:, :DIFFUSE_CHANNELS],
        high[:, DIFFUSE_CHANNELS:-1],
        high[:, -1],
        hr_directions.reshape(-1, 3),
        None if background is None else background.reshape(-1, 3),
        None if batch.views is None else batch.views.repeat_interleave(side * side),  # per-image appearance
    )
    return {
        "rgb": rgb.reshape(n, side, side, 3),
        "depth": out["depth"].reshape(n, p, p),
        "opacity": out["opacity"].reshape(n, p, p),
        "samples": out["samples"],
        "packed": out["packed"],
    }


def march(
    model: VoxelNeRF,
    origins: torch.Tensor,
    directions: torch.Tensor,
    jitter: bool | torch.Tensor,
    views=None,
    slab: SlabPass | None = None,
) -> dict:
    """Training's march of B rays: (B, 3) origins and unit directions, ``jitter`` (True: random offsets, False:
    midpoints, or (B,) offsets), ``views``: (B,) training images or None, ``slab``: one rank's part of the voxels
    (``train.parallel=space``: its occupancy, and the optical depth of the slabs in front) ->

    dict(diffuse (B,3), features (B,F-3), colour: the two side by side, (B,F), depth (B,) = sum w t, opacity
    (B,) = sum w, samples: () count, packed: the samples' models.regularizers.RenderedSamples, with gradients,
    for the regularisers).
    With per-sample shading, ``diffuse`` is the composited view-dependent colour and ``features`` is (B, 0).
    """
    c = model.config
    num_rays = origins.shape[0]
    step = model.step_size
    space = model.space
    rays = (origins.detach(), directions.detach())  # the samples are data (refined poses: the points move below)
    t_start, t_end, t_split, num_samples = space.march_range(
        *rays, model.bbox, model.extent, model.near, model.far, step, c.max_samples
    )
    if not isinstance(jitter, torch.Tensor):  # the batch's (B,) sample offsets, else drawn here or mid-step
        jitter = torch.rand(num_rays, device=origins.device) if jitter else torch.full((num_rays,), 0.5)
    jitter = jitter.reshape(num_rays).to(origins.device, origins.dtype)
    occupancy = model.occupancy.mask
    march_args = (*rays, t_start, t_end, jitter, occupancy, model.bbox, step, num_samples)
    cells = None if slab is None else slab.slabs.march_cells(occupancy.shape[0])  # a rank's slab: its samples alone
    # model.capped_samples: fixed sizes, no sync for the counts (models/capacities.py); None when off or measuring
    capacities = model.capacities if model.capacities is not None and torch.is_grad_enabled() else None
    sizes = None if capacities is None or capacities.measuring else capacities.sizes
    if sizes is None:
        ray, t, points, offsets = model.ops.march_rays(*march_args, t_split, cells)
    else:
        ray, t, points, offsets, march_total = model.ops.march_rays_capped(*march_args, sizes["march"], t_split, cells)
    samples = PackedSamples(ray, t, points)  # points: grid coordinates (contracted when space.contract)
    counts = [len(samples), len(samples), 0]  # what a measuring march counts: marched, alive, shown
    # (N,) world step of each sample over the density unit (a number when bounded); kept with the samples below
    step_scale = space.sample_steps(samples.t, samples.ray, t_split, step / model.base_voxel, model.extent)
    keep = None  # (N,) which samples are shaded (None: all)
    visible_totals = None
    if (c.early_termination > 0 or c.weight_threshold > 0) and (len(samples) > 0 or slab is not None):
        # one no-grad pass: drop samples behind an opaque prefix (early termination; the survivors keep their
        # transmittance) and skip the colour of samples that barely show (DVGO's fast_color_thres)
        with torch.no_grad():
            depth = optical_depth(model.query_density(samples.points), c.density_shift, step_scale)
            if model.fine.collecting and model.training:  # where the fine grid's bricks will go
                alive, weights = survivors_and_weights(depth, samples.ray, num_rays, c.early_termination)
                chosen = (weights >= c.fine.min_weight) & alive
                if sizes is not None:  # not the padding rows (the grid's centre, filed under the last ray)
                    chosen &= rows_in_rays(len(samples), offsets)
                model.fine.collect(samples.points[chosen], model.grid_shape)
            thresholds = (depth, offsets, c.early_termination, c.weight_threshold)
            start = None if slab is None else slab.start_depth(depth, offsets)  # (B,): the slabs in front
            if sizes is None:  # the pass's one sync: the survivors (a prefix of each ray) and the shown ones
                index, shown, alive_offsets = model.ops.visible_samples(*thresholds, start_depth=start)
                counts[1:] = [len(index), len(shown)]
            else:  # positions are rows when nothing is dropped: then the alive capacity is the march's
                alive_size = sizes["alive"] if c.early_termination > 0 else sizes["march"]
                index, shown, alive_offsets, visible_totals = model.ops.visible_samples_capped(
                    *thresholds, alive_size, sizes["shown"], start_depth=start
                )
            if c.early_termination > 0:
                samples, offsets = samples.take(index), alive_offsets
                step_scale = step_scale[index] if isinstance(step_scale, torch.Tensor) else step_scale
            keep = shown if c.weight_threshold > 0 else None
    if sizes is not None:  # one spare row past the samples: where the compaction's padding points (keep)
        samples = samples.with_spare_row()
        if isinstance(step_scale, torch.Tensor):
            step_scale = torch.cat([step_scale, step_scale.new_ones(1)])
        capacities.observe(march_total, visible_totals)
    elif capacities is not None and model.training:
        capacities.measured(*counts, rays=num_rays)
    if model.touched.enabled and torch.is_grad_enabled():  # the features read a subset of these rows
        model.touched.mark_points(samples.points, model.grid_shape)
    # refined poses: the points move with their rays (same values; the gradient of o + t d)
    moved = (samples.points, samples.ray, samples.t, origins, directions, model.bbox, space.contract)
    samples.points = points_with_ray_gradients(*moved)
    sigma_delta = optical_depth(model.query_density(samples.points), c.density_shift, step_scale)
    shaded = samples if keep is None else samples.take(keep)
    if slab is not None and sizes is None:  # the split's balance counts the shaded samples (no padding rows here)
        slab.count_shaded(shaded.points)
    feats = model.query_features(shaded.points)
    if model.per_sample:
        values = model.decode_samples(feats, directions, shaded.ray, views)  # the direction per ray, gathered
    else:
        values = torch.cat([torch.sigmoid(feats[:, :DIFFUSE_CHANNELS]), feats[:, DIFFUSE_CHANNELS:]], dim=1)
    if keep is not None:  # skipped samples still attenuate the ray; their colour is zero
        values = values.new_zeros(len(samples), values.shape[1]).index_copy(0, keep, values)
    colour, opacity, depth = model.ops.volume_render(sigma_delta, values, samples.t, offsets, 0.0)
    march = partial(space.march_coordinate, samples.t, samples.ray, t_split, model.extent)  # only if asked for
    return {
        "diffuse": colour[:, :DIFFUSE_CHANNELS],
        "features": colour[:, DIFFUSE_CHANNELS:],
        "colour": colour,  # unsliced: a caller that needs both (the space split) adds no slice nodes to autograd
        "depth": depth,
        "opacity": opacity,
        # the samples composited: a host count, or with fixed capacities the true one on the device (read at log steps)
        "samples": torch.tensor(len(samples)) if sizes is None else composited_count(march_total, visible_totals, c),
        "packed": RenderedSamples(samples.ray, samples.t, sigma_delta, step, march, offsets, padded=sizes is not None),
    }


@torch.no_grad()
def infer_march(model: VoxelNeRF, origins: torch.Tensor, directions: torch.Tensor) -> dict[str, torch.Tensor]:
    """``model.march(origins, directions, jitter=False)``'s channels without the training-only work: (B, 3) rays ->
    dict(diffuse (B, 3), features (B, F-3) (B, 0) per sample, depth (B,) = sum w t, opacity (B,) = sum w).

    Samples at interval midpoints in occupied cells (``march_rays``), each sample's density looked up once, the
    survivors of early termination and the weight threshold found in one scan (``ops.visible_samples``), only those
    decoded (the decoder in the config's precision); the rest keep attenuating their ray with zero colour, as in
    ``march``. Equal to ``march`` up to float rounding (the same compositing op over the same optical depths)."""
    c, space = model.config, model.space
    num_rays, step = origins.shape[0], model.step_size
    t_start, t_end, t_split, num_samples = space.march_range(
        origins, directions, model.bbox, model.extent, model.near, model.far, step, c.max_samples
    )
    offset = torch.full((num_rays,), 0.5, device=origins.device, dtype=origins.dtype)
    ray, t, points, offsets = model.ops.march_rays(
        origins, directions, t_start, t_end, offset, model.occupancy.mask, model.bbox, step, num_samples, t_split
    )
    step_scale = space.sample_steps(t, ray, t_split, step / model.base_voxel, model.extent)
    sigma_delta = optical_depth(model.query_density(points), c.density_shift, step_scale)
    # the pass's one sync: the samples worth a colour (alive and above the weight threshold), how many
    alive, among, _ = model.ops.visible_samples(sigma_delta, offsets, c.early_termination, c.weight_threshold)
    keep = alive[among]
    shown = [_shade(model, points[part], directions, ray[part]) for part in keep.split(DECODE_SLICE)]
    shown = shown[0] if len(shown) == 1 else torch.cat(shown)  # one slice: no copy
    values = shown.new_zeros(len(t), shown.shape[1]).index_copy(0, keep, shown)
    # dead samples (transmittance at or below early_termination) get no weight: the op's early stop
    colour, opacity, depth = model.ops.volume_render(sigma_delta, values, t, offsets, c.early_termination)
    return {"diffuse": colour[:, :DIFFUSE_CHANNELS], "features": colour[:, DIFFUSE_CHANNELS:], "depth": depth} | {
        "opacity": opacity
    }


DECODE_SLICE = 1 << 22  # samples decoded at once: bounds the MLP's activations (~2 GB at 128 wide) on any scene


def _shade(model: VoxelNeRF, points: torch.Tensor, directions: torch.Tensor, ray: torch.Tensor) -> torch.Tensor:
    """(n, 3) sample points, the chunk's (B, 3) ray directions and the (n,) samples' rays -> (n, C) what is
    composited (colour + deferred features)."""
    feats = model.query_features(points)
    if model.per_sample:
        return model.decoder(feats, directions, ray)  # held-out views: the mean appearance
    return torch.cat([torch.sigmoid(feats[:, :DIFFUSE_CHANNELS]), feats[:, DIFFUSE_CHANNELS:]], dim=1)


def _view(
    model: VoxelNeRF, composite: Composite, c2w, height: int, width: int, focal, chunk: int, lens: Lens | None
) -> dict[str, torch.Tensor]:
    """A full view composited by ``composite`` in chunks of rays, upsampled and shaded per pixel (module doc)."""
    if chunk < 1:
        raise ValueError(f"render_image: chunk must be >= 1, got {chunk}")
    device = model.bbox.device
    c2w = torch.as_tensor(c2w, dtype=torch.float32, device=device)
    origins, directions = camera_rays(c2w, height, width, focal, model.upsample, lens)
    low_h, low_w = origins.shape[:2]
    origins, directions = origins.reshape(-1, 3), directions.reshape(-1, 3)
    parts = []
    for start in range(0, origins.shape[0], chunk):
        out = composite(origins[start : start + chunk], directions[start : start + chunk])
        parts.append(torch.cat([out["diffuse"], out["features"], out["depth"][:, None], out["opacity"][:, None]], 1))
    low = torch.cat(parts).reshape(1, low_h, low_w, -1)
    channels = upsample_channels(model, low).reshape(height * width, -1)
    if model.upsample > 1:
        directions = camera_rays(c2w, height, width, focal, 1, lens)[1].reshape(-1, 3)
    pieces = [(channels[s : s + chunk], directions[s : s + chunk]) for s in range(0, channels.shape[0], chunk)]
    rgb = torch.cat([model.shade(c[:, :DIFFUSE_CHANNELS], c[:, DIFFUSE_CHANNELS:-2], c[:, -1], d) for c, d in pieces])
    return {
        "rgb": rgb.clamp(0.0, 1.0).reshape(height, width, 3),
        "depth": channels[:, -2].reshape(height, width),
        "opacity": channels[:, -1].reshape(height, width),
    }


@torch.no_grad()
def render_image(
    model: VoxelNeRF, c2w, height: int, width: int, focal, chunk: int = 8192, lens: Lens | None = None
) -> dict[str, torch.Tensor]:
    """Render a full view (no jitter) through ``model.march``: dict(rgb (H,W,3) in [0,1], depth (H,W), opacity
    (H,W)). ``focal``: a focal length in pixels (principal point at the centre) or the view's (4,) intrinsics fx,
    fy, cx, cy (data.rays); ``lens``: None (pinhole) or the view's distortion, coefficients (6,) (data.camera_models).

    With upsample s > 1, rays are marched at (H/s, W/s) (H and W must be divisible by s), the composited
    channels (depth included) upsampled to (H, W) and decoded per pixel.
    """
    march = lambda o, d: model.march(o, d, jitter=False)  # noqa: E731
    return _view(model, march, c2w, height, width, focal, chunk, lens)


@torch.no_grad()
def infer_image(
    model: VoxelNeRF, c2w, height: int, width: int, focal, chunk: int = 1 << 20, lens: Lens | None = None
) -> dict[str, torch.Tensor]:
    """:func:`render_image`'s picture through :func:`infer_march` (the inference path; same arguments, same
    result up to float rounding); ``chunk``: rays per launch (default: an 800x800 view in one)."""
    return _view(model, lambda o, d: infer_march(model, o, d), c2w, height, width, focal, chunk, lens)


def composited_count(march_total: torch.Tensor, visible_totals: torch.Tensor | None, config) -> torch.Tensor:
    """() int64 on the device: the samples a capped march composites, as ``len(samples)`` counts them uncapped (the
    survivors of early termination, or every marched sample)."""
    if visible_totals is None or not config.early_termination > 0:
        return march_total[0]
    return visible_totals[0]


__all__ = ["upsample_channels", "render_patches", "march", "infer_march", "render_image", "infer_image"]
