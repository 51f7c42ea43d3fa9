"""Held-out metrics of a peer, computed by our own evaluation code (training.evaluation.evaluate).

A peer's renderer only has to answer ``render_image(c2w, height, width, intrinsics, chunk) -> {"rgb": (H, W, 3)}``
like our model; :func:`evaluate_views` hands it to :func:`training.evaluation.evaluate` inside the few attributes of
a trainer that function reads. So a peer's PSNR (mean over views of per-view PSNR on [0, 1] images), SSIM, worst
10% of views and the views chosen for a periodic evaluation are ours by construction, not a re-implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch

from data import Scene
from training.evaluation import evaluate, spread_views

RenderFn = Callable[[torch.Tensor, int, int, torch.Tensor], torch.Tensor]


class PeerModel:
    """A renderer in our model's evaluation interface: ``render(c2w (4, 4), height, width, intrinsics (4,))`` ->
    (H, W, 3) float image in [0, 1] (clamped here, as our model's colours are). ``bbox`` is only read for the
    device (training.inference.render_view); pinhole only: a view with a lens is refused."""

    def __init__(self, render: RenderFn, device: torch.device):
        self._render = render
        self.training = False
        self.bbox = torch.zeros(2, 3, device=device)

    def eval(self) -> PeerModel:
        self.training = False
        return self

    def train(self, mode: bool = True) -> PeerModel:
        self.training = mode
        return self

    @torch.no_grad()
    def render_image(
        self, c2w: torch.Tensor, height: int, width: int, intrinsics: torch.Tensor, chunk=None, lens=None
    ) -> dict:
        if lens is not None:
            raise ValueError("peer render: pinhole cameras only (bench.peers.scenes undistorts the capture's frames)")
        rgb = self._render(c2w, height, width, intrinsics)
        if tuple(rgb.shape) != (height, width, 3):
            raise ValueError(f"peer render: expected an ({height}, {width}, 3) image, got {tuple(rgb.shape)}")
        return {"rgb": rgb.float().clamp(0.0, 1.0)}

    infer_image = render_image  # training.inference.render_view's hook: the peer renders itself


def evaluate_views(render: RenderFn, scene: Scene, views: list[int] | None = None) -> dict:
    """PSNR / SSIM of ``render`` on ``views`` of ``scene`` (every view when None) as our evaluation computes them:
    dict(psnr, ssim, psnr_worst10, worst_views, per_view, seconds, views)."""
    views = list(range(scene.num_views)) if views is None else views
    model, settings = PeerModel(render, scene.device), SimpleNamespace(render_chunk=None)
    trainer = SimpleNamespace(model=model, eval_scene=scene, device=scene.device, train_cfg=settings)
    result = evaluate(trainer, views, write_images=False)
    result.pop("first_rgb")
    result["views"] = len(views)
    return result


def curve_views(scene: Scene, count: int) -> list[int]:
    """The views of a periodic (curve) evaluation: ``count`` spread over the split, as our train.eval_views."""
    return spread_views(scene.num_views, count)
