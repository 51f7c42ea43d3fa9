"""A compact 3D Gaussian Splatting trainer of our own on gsplat's public API (``gsplat.rasterization``,
``gsplat.strategy.DefaultStrategy``), with the standard recipe (bench.peers.gaussians.Recipe).

One image per step (a random permutation of the training views per epoch), L1 + 0.2 D-SSIM against the image
composited on the scene's background (white for NeRF-synthetic; the render is composited on the same colour),
DefaultStrategy's densification, and the opacity reset every 3000 steps called here: gsplat 1.5.3's
DefaultStrategy never resets (``step % self.reset_every == 0 & step > 0`` parses as a chained comparison that is
always false), and a reset is idempotent, so a fixed gsplat resetting too changes nothing.

Training time excludes evaluation: the clock stops (after a device synchronise) around every evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict

import torch
from torch.profiler import record_function

from bench.peers.cameras import intrinsics_matrices, scene_scale, viewmats_from_c2w
from bench.peers.gaussians import (
    Recipe,
    initial_gaussians,
    learning_rates,
    make_optimizers,
    means_lr_at,
    model_tensors,
    opacity_reset_due,
    random_points,
    sh_degree_at,
)
from bench.peers.loop import saved_bytes, train_and_evaluate
from bench.peers.losses import photometric_loss
from bench.peers.scenes import PeerScene
from data import Scene


def import_gsplat():
    """gsplat's module, or a one-line error saying how to get it."""
    try:
        import gsplat
        from gsplat.strategy import DefaultStrategy  # noqa: F401  (checks the public API is there)
        from gsplat.strategy.ops import reset_opa  # noqa: F401
    except ImportError as error:
        raise RuntimeError(
            f"--method gsplat needs gsplat ({error}): pip install gsplat==1.5.3 packaging (on the GPU machine: the "
            "wheels in .whl); it JIT-compiles its CUDA code on first use (CUDA_HOME, MAX_JOBS)"
        ) from None
    return gsplat


def init_box(scene: PeerScene, recipe: Recipe) -> tuple[torch.Tensor, str]:
    """Where the random initial points go: a synthetic (blender) scene's box, as 3DGS does for NeRF-synthetic;
    for a capture (no SfM points in transforms.json) gsplat's random init: a cube of half size init_extent x the
    cameras' extent around the cameras' centroid (our derived scene box holds only the object, not the room)."""
    if scene.kind == "blender":
        return scene.train.bbox.float(), "the scene box (data.scene_box)"
    centres = scene.train.c2w[:, :3, 3].double()
    half = recipe.init_extent * scene_scale(scene.train.c2w)
    centre = centres.mean(0)
    box = torch.stack([centre - half, centre + half]).float()
    return box, f"a cube of half size {recipe.init_extent:g} x the cameras' extent around their centroid"


class Splats:
    """The Gaussians and a renderer of them: ``render(viewmat (4, 4), K (3, 3), width, height, sh_degree,
    background (3,))`` -> (rgb (H, W, 3) composited on background, alpha (H, W, 1), gsplat's info)."""

    def __init__(self, params: dict[str, torch.nn.Parameter], rasterization: Callable):
        self.params = params
        self._rasterization = rasterization

    def render(self, viewmat, k, width: int, height: int, sh_degree: int, background: torch.Tensor):
        p = self.params
        rgb, alpha, info = self._rasterization(
            means=p["means"],
            quats=p["quats"],  # normalised inside gsplat
            scales=torch.exp(p["scales"]),
            opacities=torch.sigmoid(p["opacities"]),
            colors=torch.cat([p["sh0"], p["shN"]], 1),
            viewmats=viewmat[None],
            Ks=k[None],
            width=width,
            height=height,
            sh_degree=sh_degree,
            packed=False,
            near_plane=0.01,
            far_plane=1e10,
        )
        return rgb[0] + background * (1.0 - alpha[0]), alpha[0], info

    def renderer(self, sh_degree: int, background: torch.Tensor):
        """An evaluation render function (bench.peers.metrics.RenderFn) at ``sh_degree``."""

        def render(c2w: torch.Tensor, height: int, width: int, intrinsics: torch.Tensor) -> torch.Tensor:
            device = background.device
            viewmat, k = viewmats_from_c2w(c2w.to(device)), intrinsics_matrices(intrinsics).to(device)
            return self.render(viewmat, k, width, height, sh_degree, background)[0]

        return render

    def model_bytes(self, keep: str | None = None) -> int:
        """Bytes of the Gaussians saved with torch.save (no optimiser state); ``keep``: a path to keep the file at."""
        return saved_bytes(model_tensors(self.params), keep)


def _targets(scene: Scene, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "images": scene.images.to(device),
        "alpha": None if scene.alpha is None else scene.alpha.to(device),
        "viewmats": viewmats_from_c2w(scene.c2w).to(device),
        "ks": intrinsics_matrices(scene.intrinsics).to(device),
    }


class GsplatTraining:
    """The 3DGS training state (Gaussians, Adam, DefaultStrategy) and one step of it: ``step(step)`` renders one
    training view, steps the optimisers and densifies, and returns the loss (a 0-d device tensor: no host sync).
    ``total``: the run's step count (the means' rate decays over it). Shared by train_gsplat and
    bench.peers.profile, so what the profile times is the training loop itself."""

    def __init__(
        self,
        scene: PeerScene,
        total: int,
        recipe: Recipe,
        seed: int,
        device: torch.device,
        rasterization: Callable | None = None,
    ):
        gsplat = import_gsplat()
        from gsplat.strategy import DefaultStrategy

        self.recipe, self.total, self.device = recipe, total, device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._order_generator, self._order = torch.Generator().manual_seed(seed), []
        self.num_views = scene.train.num_views
        self.train = _targets(scene.train, device)
        self.background = torch.tensor(scene.train.background, dtype=torch.float32, device=device)
        self.scene_scale = scene_scale(scene.train.c2w)
        self.box, self.box_source = init_box(scene, recipe)
        points = random_points(self.box.to(device), recipe.init_points, self.generator)
        colours = torch.rand(points.shape[0], 3, generator=self.generator, device=device)
        params = initial_gaussians(points, colours, recipe, self.generator)
        self.splats = Splats(params, rasterization or gsplat.rasterization)
        self.optimizers = make_optimizers(params, learning_rates(recipe, self.scene_scale))
        self.base_means_lr = self.optimizers["means"].param_groups[0]["lr"]
        self.strategy = DefaultStrategy(
            refine_start_iter=recipe.refine_start,
            refine_stop_iter=recipe.refine_stop,
            refine_every=recipe.refine_every,
            reset_every=recipe.reset_every,
            grow_grad2d=recipe.grow_grad2d,
        )
        self.strategy.check_sanity(params, self.optimizers)
        # scene_scale: 1.1 x the largest camera distance from the cameras' mean, as gsplat's parser and 3DGS's
        # getNerfppNorm measure it (lego: the mean sits 2.3 above the origin, so 5.2, not the radius 4.03)
        self.state = self.strategy.initialize_state(scene_scale=self.scene_scale)

    def _next_view(self) -> int:
        if not self._order:
            self._order = torch.randperm(self.num_views, generator=self._order_generator).tolist()
        return self._order.pop()

    def step(self, step: int) -> torch.Tensor:
        """One training step at 0-based ``step``; returns the loss (detached, on the device)."""
        from gsplat.strategy.ops import reset_opa

        recipe, train, params, optimizers = self.recipe, self.train, self.splats.params, self.optimizers
        view = self._next_view()
        optimizers["means"].param_groups[0]["lr"] = means_lr_at(
            step, self.total, self.base_means_lr, recipe.final_means_lr_fraction
        )
        with record_function("3dgs/render"):
            target = train["images"][view].float() / 255.0
            colour = self.background
            if recipe.random_background and train["alpha"] is not None:
                colour = torch.rand(3, generator=self.generator, device=self.device)
                target = target + (colour - self.background) * (1.0 - train["alpha"][view, ..., None].float() / 255.0)
            height, width = target.shape[:2]
            rgb, _, info = self.splats.render(
                train["viewmats"][view], train["ks"][view], width, height, sh_degree_at(step, recipe), colour
            )
            # retains info["means2d"]'s gradient: DefaultStrategy's statistic (packed=False: (1, N, 2))
            self.strategy.step_pre_backward(params, optimizers, self.state, step, info)
        with record_function("3dgs/loss"):
            loss = photometric_loss(rgb, target, recipe.ssim_lambda)
        with record_function("3dgs/backward"):
            loss.backward()
        with record_function("3dgs/adam"):
            for optimizer in optimizers.values():
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        with record_function("3dgs/densify"):
            # after the optimisers, as gsplat's simple_trainer: the gradient statistics, then grow / prune
            self.strategy.step_post_backward(params, optimizers, self.state, step, info, packed=False)
            if opacity_reset_due(step, recipe):
                reset_opa(params=params, optimizers=optimizers, state=self.state, value=self.strategy.prune_opa * 2.0)
        return loss.detach()

    # what bench.peers.loop.train_and_evaluate asks of a peer
    def renderer_at(self, step: int):
        return self.splats.renderer(sh_degree_at(step, self.recipe), self.background)

    def progress(self) -> dict:
        return {"num_gaussians": int(self.splats.params["means"].shape[0])}

    def describe(self, loss: torch.Tensor) -> str:
        return f"loss {loss.item():.4f}, {self.progress()['num_gaussians']} Gaussians"

    def model_bytes(self, keep: str | None = None) -> int:
        return self.splats.model_bytes(keep)


def train_gsplat(
    scene: PeerScene,
    steps: list[int],
    recipe: Recipe | None = None,
    seed: int = 0,
    curve_every: int = 1000,
    curve_count: int = 4,
    keep_model: str | None = None,
    log: Callable[[str], None] = print,
    device: str | torch.device = "cuda",
    rasterization: Callable | None = None,
) -> dict:
    """Train 3DGS on ``scene.train`` for max(steps) steps (the means' rate decays over that many) and evaluate on
    every view of ``scene.eval`` at each of ``steps``, and on ``curve_count`` spread views every ``curve_every``
    steps (the curve). Returns the method's results (see bench/README.md "Peers harness"). ``rasterization``:
    gsplat's unless given (a test's stand-in on the CPU, with ``device="cpu"``)."""
    gsplat = import_gsplat()
    recipe = recipe or Recipe()
    device = torch.device(device)
    training, run = train_and_evaluate(
        lambda: GsplatTraining(scene, max(steps), recipe, seed, device, rasterization),
        scene.eval.to(device),
        steps,
        device,
        "3dgs",
        curve_every,
        curve_count,
        keep_model,
        log,
    )
    return {
        "method": "3dgs",
        "implementation": f"bench/peers/gsplat_trainer.py on gsplat {gsplat.__version__}",
        "recipe": asdict(recipe),
        "seed": seed,
        "steps": max(steps),
        "init": f"{recipe.init_points} random points in {training.box_source}: {training.box.tolist()}",
        "scene_scale": training.scene_scale,
    } | run
