"""Random training batches drawn from a :class:`Scene`, built on the scene's device every step.

The hot path has no host synchronisation: indices come from ``torch.randint`` on the images' device, pixels are
gathered from the uint8 images and converted to float on the fly, and rays are computed from the gathered
cameras (nothing per-pixel is precomputed, so memory stays at the images' size). Distorted cameras are the
exception: undistorting is iterative, so the ray sampler looks each pixel centre's camera-space direction up in a
table computed once per distinct camera (float64, then stored in float32: 12 bytes a pixel per camera, one table
for a capture with shared intrinsics), and the patch sampler undistorts its positions per batch.

With ``pixel_jitter`` the ray sampler places each ray at a uniformly random point of its pixel instead of the centre
(Instant-NGP's training rays): a pixel's colour is the average over its area, so rays spread over the area see the
function a centred test ray is scored against, and neighbouring views no longer disagree about what lies between
their pixel centres. Distorted cameras then undistort per batch (the table holds centres only).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from data.camera_models import Lens
from data.rays import block_centres, camera_rays, pixel_rays
from data.scene import Scene


@dataclass
class RayBatch:
    """origins, directions (B, 3) float32 (unit directions); rgb (B, 3) float32 in [0, 1].

    views (B,) and pixels (B, 2) (row, column) int64 say where each ray came from; alpha (B,) float32 in [0, 1]
    is the pixels' coverage when the scene has it (rgb is composited on the scene's background). jitter (B,) in
    [0, 1) places each ray's samples along it (drawn with the batch, so a batch fixes all of a step's randomness).
    """

    origins: torch.Tensor
    directions: torch.Tensor
    rgb: torch.Tensor
    views: torch.Tensor | None = None
    pixels: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    jitter: torch.Tensor | None = None

    def shard(self, rank: int, world: int) -> RayBatch:
        return _shard(self, rank, world)


@dataclass
class PatchBatch:
    """n square patches for the image-space decoder, with P the low-res patch size and s the scale.

    origins, directions: (n, P, P, 3) low-res rays through the centres of s x s pixel blocks.
    hr_directions:       (n, sP, sP, 3) one ray per target pixel centre (same origins).
    rgb:                 (n, sP, sP, 3) float32 target pixels in [0, 1].
    views (n,) and top_left (n, 2) (row y0, column x0) int64 say where each patch came from.
    alpha:               (n, sP, sP) float32 coverage of the target pixels when the scene has it.
    jitter:              (n, P, P) in [0, 1): where each low-res ray's samples sit along it.
    """

    origins: torch.Tensor
    directions: torch.Tensor
    hr_directions: torch.Tensor
    rgb: torch.Tensor
    views: torch.Tensor | None = None
    top_left: torch.Tensor | None = None
    alpha: torch.Tensor | None = None
    jitter: torch.Tensor | None = None

    def shard(self, rank: int, world: int) -> PatchBatch:
        return _shard(self, rank, world)


def _shard(batch, rank: int, world: int):
    """Rank ``rank``'s contiguous 1/world of a batch (every tensor field sliced along its first dimension): ranks
    that draw the same global batch and take their shards see together exactly what one process would."""
    size = batch.origins.shape[0]
    if world < 1 or not 0 <= rank < world or size % world:
        raise ValueError(f"shard: a batch of {size} does not split into {world} equal shards (rank {rank})")
    share = size // world
    sliced = {
        f.name: getattr(batch, f.name)[rank * share : (rank + 1) * share]
        for f in fields(batch)
        if getattr(batch, f.name) is not None
    }
    return replace(batch, **sliced)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


class _Cells:
    """Every view's (rows, columns) of cells (pixels, or patch corners), numbered view by view: ``locate`` maps a
    flat number in [0, total) to its (view, row, column), so one uniform draw picks a uniform cell of all views.
    One shape for every view is plain arithmetic; views of their own sizes find theirs by a sorted search."""

    def __init__(self, rows, cols, views: int, device: torch.device):
        if isinstance(rows, int):
            self.rows, self.cols, self.offsets = rows, cols, None
            self.total = views * rows * cols
            return
        counts = (rows * cols).to(device)
        self.rows, self.cols = rows.to(device), cols.to(device)
        self.offsets = torch.cumsum(counts, 0) - counts  # (V,) each view's first cell
        self.total = int(counts.sum())

    def locate(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.offsets is None:
            views = torch.div(flat, self.rows * self.cols, rounding_mode="floor")
            within = flat - views * (self.rows * self.cols)
            cols = self.cols
        else:
            views = torch.searchsorted(self.offsets, flat, right=True) - 1
            within = flat - self.offsets[views]
            cols = self.cols[views]
        rows = torch.div(within, cols, rounding_mode="floor")
        return views, rows, within - rows * cols


def _check_generator(scene: Scene, generator: torch.Generator | None) -> None:
    if generator is not None and torch.device(generator.device).type != scene.images.device.type:
        raise ValueError(
            f"generator is on {generator.device} but the scene's images are on {scene.images.device}: "
            "create the generator on the scene's device"
        )


class _SceneSampler:
    """Shared state: the scene's images, cameras and intrinsics, and the random generator."""

    def __init__(self, scene: Scene, generator: torch.Generator | None):
        _check_generator(scene, generator)
        self.scene = scene
        self.generator = generator
        self.device = scene.images.device
        self.c2w = scene.c2w.to(self.device)
        self.intrinsics = scene.intrinsics.to(self.device, self.c2w.dtype)  # (V, 4) fx, fy, cx, cy per view
        self.lens = None if scene.lens is None else scene.lens.to(self.device, self.c2w.dtype)  # (V, 6) or None
        # (V, 16): each view's camera-to-world rows (3, 4) and intrinsics side by side, so that a batch gathers its
        # rays' cameras at once, one gather instead of two (lego's late steps on two H200s: within the runs' spread
        # either way, bench/README "The warmup's steps replayed")
        self.cameras = torch.cat([self.c2w[:, :3].reshape(-1, 12), self.intrinsics], 1)

    def _cameras(self, views: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The (*S, 3, 4) camera-to-world rows and (*S, 4) intrinsics of (*S,) views, from one gather."""
        cameras = self.cameras[views]
        return cameras[..., :12].unflatten(-1, (3, 4)), cameras[..., 12:]

    def _lens(self, views: torch.Tensor, extra_dims: int = 0):
        return None if self.lens is None else self.lens.take(views, extra_dims)

    def _randint(self, high: int, size: int) -> torch.Tensor:
        return torch.randint(high, (size,), device=self.device, generator=self.generator)

    def _pixels(self, views: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Float rgb in [0, 1] of the uint8 images at broadcast index tensors -> (*shape, 3)."""
        return self.scene.images[views, rows, cols].float().div_(255.0)

    def _alpha(self, views: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor | None:
        """Float coverage in [0, 1] at broadcast index tensors -> (*shape,), or None for opaque scenes."""
        alpha = self.scene.alpha
        return None if alpha is None else alpha[views, rows, cols].float().div_(255.0)


class RaySampler(_SceneSampler):
    """Uniformly random pixels over all views: ``sample()`` -> :class:`RayBatch` of ``batch_size`` rays, through
    the pixels' centres or, with ``pixel_jitter``, through a uniformly random point of each pixel."""

    def __init__(
        self,
        scene: Scene,
        batch_size: int,
        generator: torch.Generator | None = None,
        pixel_jitter: bool = False,
    ):
        super().__init__(scene, generator)
        self.batch_size = _positive_int("RaySampler batch_size", batch_size)
        if not isinstance(pixel_jitter, bool):
            raise ValueError(f"RaySampler pixel_jitter must be a bool, got {pixel_jitter!r}")
        self.pixel_jitter = pixel_jitter
        self.table = None if scene.lens is None or pixel_jitter else _direction_table(scene, self.device)
        sizes = scene.sizes
        shape = (scene.height, scene.width) if sizes is None else (sizes[:, 0], sizes[:, 1])
        self.cells = _Cells(*shape, scene.num_views, self.device)

    def sample(self) -> RayBatch:
        return self.build(*self.draw())

    def draw(self) -> tuple[torch.Tensor, ...]:
        """The batch's random numbers: (B,) flat pixel indices, (B,) sample offsets and, with ``pixel_jitter``, (2, B)
        positions within the pixels (:meth:`build` makes the batch of them, with no randomness of its own)."""
        flat = self._randint(self.cells.total, self.batch_size)  # one draw: view, row, column
        jitter = torch.rand(self.batch_size, device=self.device, generator=self.generator)
        if not self.pixel_jitter:
            return flat, jitter
        # drawn after the samples' jitter: without it the stream is what it always was
        return flat, jitter, torch.rand(2, self.batch_size, device=self.device, generator=self.generator)

    def build(self, flat: torch.Tensor, jitter: torch.Tensor, within_pixel: torch.Tensor | None = None) -> RayBatch:
        """The batch of :meth:`draw`'s numbers."""
        views, rows, cols = self.cells.locate(flat)
        if self.table is not None:
            origins, directions = _table_rays(self._cameras(views)[0], self.table, views, rows, cols)
        else:
            u, v = cols + 0.5, rows + 0.5
            if within_pixel is not None:
                u, v = cols + within_pixel[0], rows + within_pixel[1]
            c2w, intrinsics = self._cameras(views)
            origins, directions = pixel_rays(c2w, u, v, intrinsics, lens=self._lens(views))
        return RayBatch(
            origins,
            directions,
            self._pixels(views, rows, cols),
            views,
            torch.stack([rows, cols], -1),
            self._alpha(views, rows, cols),
            jitter,
        )


class PatchSampler(_SceneSampler):
    """Random square patches: ``sample()`` -> :class:`PatchBatch` of ``patches_per_batch`` patches.

    A patch covers patch_size*scale target pixels per side from any integer corner (y0, x0), together with the
    patch_size x patch_size low-res rays through the centres of its scale x scale blocks (alignment: data.rays).
    """

    def __init__(
        self,
        scene: Scene,
        patch_size: int,
        scale: int,
        patches_per_batch: int,
        generator: torch.Generator | None = None,
    ):
        super().__init__(scene, generator)
        self.patch_size = _positive_int("PatchSampler patch_size", patch_size)
        self.scale = _positive_int("PatchSampler scale", scale)
        self.patches_per_batch = _positive_int("PatchSampler patches_per_batch", patches_per_batch)
        side = patch_size * scale
        sizes = torch.tensor([[scene.height, scene.width]]) if scene.sizes is None else scene.sizes
        smallest = sizes.min(0).values.tolist()
        if side > min(smallest):
            raise ValueError(
                f"PatchSampler: patch_size*scale = {side} exceeds the {smallest[0]}x{smallest[1]} (smallest) images"
            )
        if scene.sizes is None:
            self.cells = _Cells(scene.height - side + 1, scene.width - side + 1, scene.num_views, self.device)
        else:
            self.cells = _Cells(sizes[:, 0] - side + 1, sizes[:, 1] - side + 1, scene.num_views, self.device)
        self.lr_offsets = block_centres(patch_size, scale, device=self.device)  # (P,)
        self.hr_offsets = torch.arange(side, device=self.device)  # (sP,)

    def sample(self) -> PatchBatch:
        return self.build(*self.draw())

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch's random numbers: (n,) flat patch corners and (n, P, P) sample offsets (see RaySampler.draw)."""
        flat = self._randint(self.cells.total, self.patches_per_batch)
        shape = (self.patches_per_batch, self.patch_size, self.patch_size)
        return flat, torch.rand(shape, device=self.device, generator=self.generator)

    def build(self, flat: torch.Tensor, jitter: torch.Tensor) -> PatchBatch:
        """The batch of :meth:`draw`'s numbers."""
        views, y0, x0 = self.cells.locate(flat)

        c2w, k = (camera[:, None, None] for camera in self._cameras(views))  # (n, 1, 1, 3, 4), (n, 1, 1, 4)
        y0f, x0f = y0.float()[:, None, None], x0.float()[:, None, None]
        lr = self.lr_offsets
        lens = self._lens(views, 2)
        origins, directions = pixel_rays(c2w, x0f + lr[None, None, :], y0f + lr[None, :, None], k, lens=lens)

        rows = y0[:, None, None] + self.hr_offsets[None, :, None]  # (n, sP, 1)
        cols = x0[:, None, None] + self.hr_offsets[None, None, :]  # (n, 1, sP)
        _, hr_directions = pixel_rays(c2w, cols + 0.5, rows + 0.5, k, lens=lens)
        rgb = self._pixels(views[:, None, None], rows, cols)
        return PatchBatch(
            origins,
            directions,
            hr_directions,
            rgb,
            views,
            torch.stack([y0, x0], -1),
            self._alpha(views[:, None, None], rows, cols),
            jitter,
        )


def _direction_table(scene: Scene, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(camera of each view (V,) int64, (C, H, W, 3) float32 unit camera-space (OpenGL) directions through every
    pixel centre of each of the C distinct cameras (intrinsics + distortion) of a scene with a lens)."""
    cameras = torch.cat([scene.intrinsics.cpu(), scene.lens.coefficients.cpu()], 1)
    distinct, camera_of_view = torch.unique(cameras, dim=0, return_inverse=True)
    identity = torch.eye(4, dtype=torch.float64)
    lens = Lens(distinct[:, 4:], scene.lens.fisheye)
    tables = [
        camera_rays(identity, scene.height, scene.width, distinct[c, :4], lens=lens.take(torch.tensor(c)))[1]
        for c in range(len(distinct))
    ]
    return camera_of_view.to(device), torch.stack(tables).to(device, torch.float32)


def _table_rays(
    c2w: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor], views: torch.Tensor, rows, cols
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rays (B, 3) of pixels (views, rows, cols) (B,) through their cameras' direction table."""
    camera_of_view, directions = table
    local = directions[camera_of_view[views], rows, cols]  # (B, 3)
    rot = c2w[:, :3, :3]
    world = rot[:, :, 0] * local[:, 0:1] + rot[:, :, 1] * local[:, 1:2] + rot[:, :, 2] * local[:, 2:3]
    world = world / torch.linalg.vector_norm(world, dim=-1, keepdim=True)
    return c2w[:, :3, 3].expand_as(world).contiguous(), world
