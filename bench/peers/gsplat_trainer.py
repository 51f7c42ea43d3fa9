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

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

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
from bench.peers.losses import photometric_loss
from bench.peers.metrics import curve_views, evaluate_views
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
        handle, path = tempfile.mkstemp(suffix=".pt")
        os.close(handle)
        try:
            torch.save(model_tensors(self.params), path)
            size = os.path.getsize(path)
            if keep:
                os.replace(path, keep)
            return size
        finally:
            if os.path.exists(path):
                os.remove(path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _targets(scene: Scene, device: torch.device) -> dict[str, torch.Tensor]:
    return {
        "images": scene.images.to(device),
        "alpha": None if scene.alpha is None else scene.alpha.to(device),
        "viewmats": viewmats_from_c2w(scene.c2w).to(device),
        "ks": intrinsics_matrices(scene.intrinsics).to(device),
    }


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
    from gsplat.strategy import DefaultStrategy
    from gsplat.strategy.ops import reset_opa

    device = torch.device(device)
    total = max(steps)
    generator = torch.Generator(device=device).manual_seed(seed)
    order_generator = torch.Generator().manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    train, evaluation = _targets(scene.train, device), scene.eval.to(device)
    background = torch.tensor(scene.train.background, dtype=torch.float32, device=device)
    extent = scene_scale(scene.train.c2w)

    start = time.perf_counter()
    box, box_source = init_box(scene, recipe)
    points = random_points(box.to(device), recipe.init_points, generator)
    colours = torch.rand(points.shape[0], 3, generator=generator, device=device)
    splats = Splats(initial_gaussians(points, colours, recipe, generator), rasterization or gsplat.rasterization)
    optimizers = make_optimizers(splats.params, learning_rates(recipe, extent))
    strategy = DefaultStrategy(
        refine_start_iter=recipe.refine_start,
        refine_stop_iter=recipe.refine_stop,
        refine_every=recipe.refine_every,
        reset_every=recipe.reset_every,
        grow_grad2d=recipe.grow_grad2d,
    )
    strategy.check_sanity(splats.params, optimizers)
    state = strategy.initialize_state(scene_scale=extent)
    _sync(device)
    init_seconds = time.perf_counter() - start

    evaluations, curve, train_seconds, order = [], [], 0.0, []
    base_means_lr = optimizers["means"].param_groups[0]["lr"]
    clock = time.perf_counter()
    for step in range(total):
        if not order:
            order = torch.randperm(scene.train.num_views, generator=order_generator).tolist()
        view = order.pop()
        means_lr = means_lr_at(step, total, base_means_lr, recipe.final_means_lr_fraction)
        optimizers["means"].param_groups[0]["lr"] = means_lr
        target = train["images"][view].float() / 255.0
        colour = background
        if recipe.random_background and train["alpha"] is not None:
            colour = torch.rand(3, generator=generator, device=device)
            target = target + (colour - background) * (1.0 - train["alpha"][view, ..., None].float() / 255.0)
        height, width = target.shape[:2]
        rgb, _, info = splats.render(
            train["viewmats"][view], train["ks"][view], width, height, sh_degree_at(step, recipe), colour
        )
        strategy.step_pre_backward(splats.params, optimizers, state, step, info)
        loss = photometric_loss(rgb, target, recipe.ssim_lambda)
        loss.backward()
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        strategy.step_post_backward(splats.params, optimizers, state, step, info, packed=False)
        if opacity_reset_due(step, recipe):
            reset_opa(params=splats.params, optimizers=optimizers, state=state, value=strategy.prune_opa * 2.0)

        done = step + 1
        is_final, is_curve = done in steps, curve_every > 0 and done % curve_every == 0
        if not (is_final or is_curve):
            continue
        _sync(device)
        train_seconds += time.perf_counter() - clock
        render = splats.renderer(sh_degree_at(step, recipe), background)
        views = None if is_final else curve_views(evaluation, curve_count)
        result = evaluate_views(render, evaluation, views)
        entry = {
            "step": done,
            "train_seconds": train_seconds,
            "psnr": result["psnr"],
            "ssim": result["ssim"],
            "psnr_worst10": result["psnr_worst10"],
            "views": result["views"],
            "num_gaussians": int(splats.params["means"].shape[0]),
        }
        curve.append(entry)
        if is_final:
            keep = keep_model.format(step=done) if keep_model else None
            evaluations.append(
                {
                    **entry,
                    "worst_views": result["worst_views"],
                    "per_view": result["per_view"],
                    "eval_seconds": result["seconds"],
                    "model_bytes": splats.model_bytes(keep),
                }
            )
        log(
            f"3dgs step {done}/{total}: loss {loss.item():.4f}, {entry['num_gaussians']} Gaussians, "
            f"{train_seconds:.1f} s training, held-out PSNR {entry['psnr']:.2f} dB ({entry['views']} views)"
        )
        _sync(device)
        clock = time.perf_counter()

    return {
        "method": "3dgs",
        "implementation": f"bench/peers/gsplat_trainer.py on gsplat {gsplat.__version__}",
        "recipe": asdict(recipe),
        "seed": seed,
        "steps": total,
        "init": f"{recipe.init_points} random points in {box_source}: {box.tolist()}",
        "scene_scale": extent,
        "init_seconds": init_seconds,
        "train_seconds": train_seconds,
        "peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None,
        "evaluations": evaluations,
        "curve": curve,
    }
