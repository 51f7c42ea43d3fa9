"""The NeRF-family peer: an occupancy-grid NeRF on nerfacc 0.5.3's ``OccGridEstimator`` and ``rendering``, with the
recipe of nerfacc's ``examples/train_ngp_nerf_occ.py`` on our pure-PyTorch instant-ngp field (bench.peers.ngp_field).

Recipe (NgpRecipe): 20k steps; rays drawn uniformly over every training pixel (random image per ray), their count
adapted every step so a step marches ~2^18 samples (start 1024 rays); Adam lr 1e-2, eps 1e-15, weight decay 1e-6,
a linear warm-up from 1% over 100 steps and x0.33 at 1/2, 3/4 and 9/10 of the run; smooth-L1 loss; the occupancy
grid (128^3) refreshed every 16 steps (occupancy = density x step size, threshold 0.01). Training composites on a
random background colour per step (NeRF-synthetic: the target recomposited from its alpha), evaluation on the
scene's (white for NeRF-synthetic).
- Bounded (NeRF-synthetic): the scene box as the grid's box (lego [-1.5, 1.5]^3), 1 level, step sqrt(3) x box
  size / 1024 (nerfacc: 5e-3 for lego), no cone, near 0.
- Unbounded (a capture): nerfacc's 360 setup: the scene moved and scaled so the cameras' focus point is the origin
  and their median distance from it is 1, the grid's box [-1, 1]^3 with 4 levels (each twice the last, to
  [-8, 8]^3), the field over the largest, step 1e-3 growing with distance (cone angle 0.004), alpha threshold
  0.01, near 0.2.

``NerfaccBackend`` carries the two nerfacc callables, so the loop runs on the CPU with stand-ins (tests).
Training time excludes evaluation (the clock stops after a device synchronise around every evaluation).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.peers.loop import saved_bytes, train_and_evaluate
from bench.peers.ngp_field import NgpField
from bench.peers.scenes import PeerScene
from data import camera_rays, pixel_rays
from data.bounds import focus_point


@dataclass(frozen=True)
class NgpRecipe:
    init_rays: int = 1024
    target_samples: int = 1 << 18
    lr: float = 1e-2
    eps: float = 1e-15
    weight_decay: float = 1e-6
    warmup_steps: int = 100
    decay: float = 0.33
    grid_resolution: int = 128
    occ_every: int = 16
    occ_threshold: float = 1e-2
    random_background: bool = True
    hash_levels: int = 16
    hash_log2_size: int = 19
    hash_finest: int = 4096
    eval_chunk_rays: int = 16384  # rays per evaluation chunk; the field runs 2^20 samples at a time


@dataclass(frozen=True)
class Marching:
    """How rays are marched in the trainer's normalised frame (bounded or unbounded, see the module doc)."""

    roi: tuple[float, ...]  # (6,) the occupancy grid's first-level box
    levels: int
    step_size: float
    cone_angle: float
    alpha_threshold: float
    near: float
    centre: tuple[float, float, float]  # world -> normalised: (x - centre) * scale
    scale: float


@dataclass
class NerfaccBackend:
    """``estimator(roi_aabb=(6,), resolution=int, levels=int)`` -> an OccGridEstimator-like module;
    ``rendering``: nerfacc.rendering's signature."""

    estimator: Callable
    rendering: Callable
    version: str


def nerfacc_backend() -> NerfaccBackend:
    """nerfacc's estimator and renderer, or a one-line error saying how to get them."""
    try:
        import nerfacc
        from nerfacc import OccGridEstimator, rendering
    except ImportError as error:
        raise RuntimeError(
            f"--method nerfacc needs nerfacc ({error}): pip install nerfacc==0.5.3 (on the GPU machine: the wheel "
            "in .whl); it JIT-compiles its CUDA code on first use (CUDA_HOME, nvcc on PATH)"
        ) from None
    return NerfaccBackend(OccGridEstimator, rendering, nerfacc.__version__)


def lr_factor(step: int, total: int, recipe: NgpRecipe) -> float:
    """The learning rate's factor at 0-based ``step`` of ``total``: LinearLR(0.01, warmup_steps) chained with
    MultiStepLR(milestones total // 2, total * 3 // 4, total * 9 // 10; gamma decay), as nerfacc's example."""
    warm = 0.01 + 0.99 * min(step, recipe.warmup_steps) / recipe.warmup_steps if recipe.warmup_steps else 1.0
    passed = sum(step >= m for m in (total // 2, total * 3 // 4, total * 9 // 10))
    return warm * recipe.decay**passed


def next_ray_count(rays: int, samples: int, target: int) -> int:
    """The next step's ray count: scaled so it marches ``target`` samples at this step's ``samples`` per ``rays``;
    kept in [1, target] (an empty grid marching no sample keeps the count)."""
    if samples <= 0:
        return rays
    return max(1, min(target, int(rays * (target / samples))))


def marching_for(scene: PeerScene, recipe: NgpRecipe) -> Marching:
    """The bounded setup for a NeRF-synthetic scene, the unbounded one for a capture (module doc)."""
    if scene.kind == "blender":
        box = scene.train.bbox.double()
        size = float((box[1] - box[0]).max())
        roi = tuple(box.reshape(-1).tolist())
        return Marching(roi, 1, math.sqrt(3.0) * size / 1024, 0.0, 0.0, 0.0, (0.0, 0.0, 0.0), 1.0)
    c2w = scene.train.c2w.double()
    focus = focus_point(c2w.numpy())  # None for a forward-facing capture: the cameras' mean then
    centre = c2w[:, :3, 3].mean(0) if focus is None else torch.from_numpy(focus)
    distances = (c2w[:, :3, 3] - centre).norm(dim=-1)
    scale = 1.0 / max(float(distances.median()), 1e-9)
    return Marching((-1.0, -1.0, -1.0, 1.0, 1.0, 1.0), 4, 1e-3, 0.004, 1e-2, 0.2, tuple(centre.tolist()), scale)


class NerfaccTraining:
    """The field, the occupancy grid, Adam and one step of training (``step(step)`` -> loss, a 0-d tensor)."""

    def __init__(self, scene: PeerScene, total: int, recipe: NgpRecipe, seed: int, device, backend: NerfaccBackend):
        self.recipe, self.total, self.device, self.backend = recipe, total, torch.device(device), backend
        torch.manual_seed(seed)  # the hash table's and MLPs' initialisation
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.marching = marching_for(scene, recipe)
        roi = torch.tensor(self.marching.roi, dtype=torch.float32)
        self.estimator = backend.estimator(
            roi_aabb=roi, resolution=recipe.grid_resolution, levels=self.marching.levels
        ).to(self.device)
        largest = self.estimator.aabbs[-1].detach().float().cpu()  # the field covers the grid's largest level
        self.field = NgpField(largest, recipe.hash_levels, recipe.hash_log2_size, finest=recipe.hash_finest).to(
            self.device
        )
        fused = {"fused": True} if self.device.type == "cuda" else {}
        self.optimizer = torch.optim.Adam(
            self.field.parameters(), lr=recipe.lr, eps=recipe.eps, weight_decay=recipe.weight_decay, **fused
        )
        train = scene.train
        self.images = train.images.to(self.device)
        self.alpha = None if train.alpha is None else train.alpha.to(self.device)
        self.c2w = train.c2w.to(self.device)
        self.intrinsics = train.intrinsics.to(self.device, torch.float32)
        self.background = torch.tensor(train.background, dtype=torch.float32, device=self.device)
        self.eval_background = torch.tensor(scene.eval.background, dtype=torch.float32, device=self.device)
        self.rays = recipe.init_rays
        self.last_rays, self.last_samples = self.rays, 0  # the last step's batch (for the log)

    def normalise(self, origins: torch.Tensor) -> torch.Tensor:
        """World ray origins -> the normalised frame (directions and colours are unchanged; distances scale)."""
        m = self.marching
        return (origins - torch.tensor(m.centre, dtype=origins.dtype, device=origins.device)) * m.scale

    def render_rays(self, origins, directions, background, training: bool) -> tuple[torch.Tensor, int]:
        """(n, 3) normalised origins and unit directions -> (n, 3) colours on ``background`` and the samples
        marched. Evaluation runs the field 2^20 samples at a time (no gradients)."""
        m, field = self.marching, self.field

        def points(t_starts, t_ends, ray_indices):
            return origins[ray_indices] + directions[ray_indices] * ((t_starts + t_ends) / 2.0)[:, None]

        def sigma_fn(t_starts, t_ends, ray_indices):
            return _chunked(lambda p: (field.density(p),), points(t_starts, t_ends, ray_indices), training)[0]

        def rgb_sigma_fn(t_starts, t_ends, ray_indices):
            where, towards = points(t_starts, t_ends, ray_indices), directions[ray_indices]
            return _chunked(field, where, training, towards)

        ray_indices, t_starts, t_ends = self.estimator.sampling(
            origins, directions, sigma_fn=sigma_fn, near_plane=m.near, render_step_size=m.step_size,
            stratified=training, cone_angle=m.cone_angle, alpha_thre=m.alpha_threshold,
        )  # fmt: skip
        rgb, _, _, _ = self.backend.rendering(
            t_starts, t_ends, ray_indices, n_rays=origins.shape[0], rgb_sigma_fn=rgb_sigma_fn, render_bkgd=background
        )
        return rgb, int(t_starts.shape[0])

    def _update_grid(self, step: int) -> None:
        step_size = self.marching.step_size
        self.estimator.update_every_n_steps(
            step=step,
            occ_eval_fn=lambda x: self.field.density(x) * step_size,
            occ_thre=self.recipe.occ_threshold,
            n=self.recipe.occ_every,
        )

    def step(self, step: int) -> torch.Tensor:
        """One training step at 0-based ``step``; returns the loss (detached, on the device)."""
        recipe, device = self.recipe, self.device
        self.field.train()
        self.estimator.train()
        for group in self.optimizer.param_groups:
            group["lr"] = recipe.lr * lr_factor(step, self.total, recipe)
        self._update_grid(step)
        views, height, width = self.images.shape[:3]
        view = torch.randint(views, (self.rays,), generator=self.generator, device=device)
        row = torch.randint(height, (self.rays,), generator=self.generator, device=device)
        col = torch.randint(width, (self.rays,), generator=self.generator, device=device)
        origins, directions = pixel_rays(self.c2w[view], col + 0.5, row + 0.5, self.intrinsics[view])
        target = self.images[view, row, col].float() / 255.0
        background = self.background
        if recipe.random_background:
            background = torch.rand(3, generator=self.generator, device=device)
            if self.alpha is not None:  # the target on the new colour (opaque captures: unchanged)
                coverage = self.alpha[view, row, col].float()[:, None] / 255.0
                target = target + (background - self.background) * (1.0 - coverage)
        rgb, samples = self.render_rays(self.normalise(origins), directions, background, training=True)
        self.last_rays, self.last_samples = self.rays, samples
        if samples == 0:  # nothing occupied on these rays: nothing to learn from them (nerfacc skips too)
            return torch.zeros((), device=device)
        loss = F.smooth_l1_loss(rgb, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.rays = next_ray_count(self.rays, samples, recipe.target_samples)
        return loss.detach()

    def renderer(self, background: torch.Tensor):
        """An evaluation render function (bench.peers.metrics.RenderFn) on ``background``."""

        def render(c2w: torch.Tensor, height: int, width: int, intrinsics: torch.Tensor) -> torch.Tensor:
            self.field.eval()
            self.estimator.eval()
            device, chunk = self.device, self.recipe.eval_chunk_rays
            origins, directions = camera_rays(c2w.to(device, torch.float32), height, width, intrinsics.to(device))
            origins, directions = self.normalise(origins.reshape(-1, 3)), directions.reshape(-1, 3)
            with torch.no_grad():
                parts = [
                    self.render_rays(origins[i : i + chunk], directions[i : i + chunk], background, False)[0]
                    for i in range(0, origins.shape[0], chunk)
                ]
            return torch.cat(parts).reshape(height, width, 3)

        return render

    def model_bytes(self, keep: str | None = None) -> int:
        """Bytes of what renders the model, saved with torch.save: the field's parameters and the occupancy
        grid's bits and boxes (no optimiser state); ``keep``: a path to keep the file at."""
        content = {"field": self.field.state_dict(), "occupancy": self.estimator.binaries}
        return saved_bytes(content | {"aabbs": self.estimator.aabbs, "marching": asdict(self.marching)}, keep)

    # what bench.peers.loop.train_and_evaluate asks of a peer
    def renderer_at(self, step: int):
        return self.renderer(self.eval_background)

    def progress(self) -> dict:
        return {"rays": self.rays, "occupied_fraction": float(self.estimator.binaries.float().mean())}

    def describe(self, loss: torch.Tensor) -> str:
        occupied = 100 * float(self.estimator.binaries.float().mean())
        per_ray = self.last_samples / self.last_rays
        return f"loss {loss.item():.5f}, {self.last_rays} rays x {per_ray:.1f} samples, {occupied:.1f}% occupied"


def _chunked(function, points, training: bool, *more, size: int = 1 << 20):
    """``function(points, *more)`` (a tuple of per-sample tensors) whole when training, else ``size`` samples at a
    time (evaluation: bounded memory for the hash grid's (samples, 16, 8) gathers)."""
    if training or points.shape[0] <= size:
        return function(points, *more)
    parts = [function(points[i : i + size], *(m[i : i + size] for m in more)) for i in range(0, points.shape[0], size)]
    return tuple(torch.cat(column) for column in zip(*parts))


def train_nerfacc(
    scene: PeerScene,
    steps: list[int],
    recipe: NgpRecipe | None = None,
    seed: int = 0,
    curve_every: int = 1000,
    curve_count: int = 4,
    keep_model: str | None = None,
    log: Callable[[str], None] = print,
    device: str | torch.device = "cuda",
    backend: NerfaccBackend | None = None,
) -> dict:
    """Train for max(steps) steps (the schedule spans that many), evaluate on every view of ``scene.eval`` at each
    of ``steps`` and on ``curve_count`` spread views every ``curve_every`` steps. Returns the method's results
    entry (as bench.peers.gsplat_trainer.train_gsplat's). ``backend``: nerfacc's unless given (CPU stand-ins)."""
    backend = backend or nerfacc_backend()
    recipe = recipe or NgpRecipe()
    device = torch.device(device)
    training, run = train_and_evaluate(
        lambda: NerfaccTraining(scene, max(steps), recipe, seed, device, backend),
        scene.eval.to(device),
        steps,
        device,
        "nerfacc",
        curve_every,
        curve_count,
        keep_model,
        log,
    )
    return {
        "method": "nerfacc",
        "implementation": f"bench/peers/nerfacc_trainer.py (instant-ngp field in PyTorch) on nerfacc {backend.version}",
        "recipe": asdict(recipe),
        "marching": asdict(training.marching),
        "seed": seed,
        "steps": max(steps),
    } | run
