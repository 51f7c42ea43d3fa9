"""Loss terms of the training step: the photometric one (``train.loss``), the opacity loss, the per-ray floater
regularisers (``train.distortion_loss``, ``train.near_density_loss``), and :func:`step_loss`, their weighted sum."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.ops import OpSet
from training.metrics import SSIM_K1, SSIM_K2, SSIM_WINDOW, separable_filter


def opacity_loss(opacity: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Mean squared difference between the rays' opacity and the training images' alpha: density where the
    masks say empty is haze, even where its colour matches the background (``train.opacity_loss`` weighs it).

    ``opacity`` (B,) or (n, P, P); ``alpha`` the same shape, or (n, sP, sP) for patch batches (area-averaged
    down to the rays' resolution P).
    """
    if alpha.shape != opacity.shape:
        if alpha.dim() != 3 or opacity.dim() != 3 or alpha.shape[1] % opacity.shape[1]:
            raise ValueError(f"opacity_loss: alpha {tuple(alpha.shape)} does not fit opacity {tuple(opacity.shape)}")
        alpha = F.avg_pool2d(alpha[:, None], alpha.shape[1] // opacity.shape[1])[:, 0]
    return F.mse_loss(opacity, alpha)


PHOTOMETRIC_LOSSES = ("mse", "l1", "charbonnier")
CHARBONNIER_EPS = 1e-3  # sqrt(d^2 + eps^2): L1 away from zero, smooth at it (as in Mip-NeRF / RawNeRF)


def ssim_unclipped(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean SSIM of (..., H, W, C) images (H, W >= 11) with gradients: the evaluation's window
    (training.metrics.ssim_map) without its clipping of the variances, whose square root has no gradient at 0."""
    x, y = pred.movedim(-1, -3), target.movedim(-1, -3)  # (..., C, H, W)
    mu_x, mu_y, xx, yy, xy = separable_filter(torch.stack([x, y, x * x, y * y, x * y])).unbind(0)
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    numerator = (2 * mu_x * mu_y + c1) * (2 * (xy - mu_x * mu_y) + c2)
    denominator = (mu_x.square() + mu_y.square() + c1) * (xx - mu_x.square() + yy - mu_y.square() + c2)
    return (numerator / denominator).mean()


def dssim(rgb: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean structural dissimilarity ``1 - SSIM`` of (n, S, S, 3) patches (S >= 11), :func:`ssim_unclipped`."""
    if rgb.dim() != 4 or rgb.shape != target.shape or min(rgb.shape[1:3]) < SSIM_WINDOW:
        raise ValueError(
            f"train.dssim: needs (n, S, S, 3) patches with S >= {SSIM_WINDOW}, got {tuple(rgb.shape)} "
            "(raise train.patch_size * model.upsample)"
        )
    return 1.0 - ssim_unclipped(rgb, target)


def photometric_loss(rgb: torch.Tensor, target: torch.Tensor, kind: str) -> torch.Tensor:
    """Mean per-channel error of predicted colours against the targets (same shape), ``train.loss``: ``mse``,
    ``l1`` (robust to the pixels no model explains: moving objects, specular flicker) or ``charbonnier``."""
    if kind == "mse":
        return F.mse_loss(rgb, target)
    if kind == "l1":
        return F.l1_loss(rgb, target)
    if kind == "charbonnier":
        return torch.sqrt((rgb - target).square() + CHARBONNIER_EPS**2).mean()
    raise ValueError(f"train.loss: unknown loss {kind!r} (expected one of {', '.join(PHOTOMETRIC_LOSSES)})")


def floater_losses(out: dict, origins: torch.Tensor, train_cfg, centre: torch.Tensor, unit: float, ops: OpSet | None):
    """The weighted per-ray regularisers of a render (models/regularizers.py), averaged over its rays; 0.0 when
    both weights are 0 (nothing is computed then).

    ``out``: a render's dict with ``packed`` (its models.regularizers.RenderedSamples); ``origins``: its (..., 3) ray
    origins (unit directions); ``centre``: (3,) the scene box's centre; ``unit``: the scene box's diagonal; ``ops``:
    the model's OpSet (its ``distortion_loss``; unused, may be None, when ``train.distortion_loss`` is 0).
    - ``train.distortion_loss``: mip-NeRF 360's distortion, distances in units of the box diagonal (the weight
      then does not depend on the scene's scale; nerfacto uses 0.002 in its normalised ray coordinates).
    - ``train.near_density_loss``: the optical depth ``-ln T`` a ray accumulates in the first
      ``train.near_density_fraction`` of its camera's distance to the box centre (floaters hug the cameras).
    """
    distortion = float(train_cfg.get("distortion_loss", 0.0))
    near = float(train_cfg.get("near_density_loss", 0.0))
    if distortion == 0.0 and near == 0.0:
        return 0.0
    packed, origins = out["packed"], origins.reshape(-1, 3)
    total = 0.0
    if distortion > 0.0:
        total = total + distortion * packed.distortion(ops.distortion_loss, origins.shape[0], unit).mean()
    if near > 0.0:
        limit = float(train_cfg.get("near_density_fraction", 0.2)) * (origins - centre).norm(dim=-1)
        total = total + near * packed.near_density(limit).mean()
    return total


def step_loss(out: dict, batch, target: torch.Tensor, regularization: torch.Tensor | None, train_cfg, model, centre):
    """(loss, mse) of one training step: the photometric loss of ``out["rgb"]`` against ``target`` (same shape),
    D-SSIM, the model's ``regularization`` (its TV, already computed), the opacity loss on ``batch.alpha``, the
    floater losses and the pose corrections' penalty, each with its ``train.*`` weight. ``centre``: (3,) the scene
    box's centre (``train.near_density_loss``). The MSE (for PSNR) is returned beside the loss."""
    mse = F.mse_loss(out["rgb"], target)
    kind = train_cfg.get("loss", "mse")
    loss = mse if kind == "mse" else photometric_loss(out["rgb"], target, kind)
    if train_cfg.get("dssim", 0.0) > 0:  # patch batches only (training.config_rules)
        loss = loss + train_cfg.dssim * dssim(out["rgb"], target)
    if regularization is not None:  # None: the TV is added after the backward (models/grid_tv.py)
        loss = loss + regularization
    weight = float(train_cfg.get("opacity_loss", 0.0))
    if weight != 0.0 and batch.alpha is not None:
        loss = loss + weight * opacity_loss(out["opacity"], batch.alpha)
    unit = math.hypot(*model.initial_extent)  # the scene box's diagonal
    loss = loss + floater_losses(out, batch.origins, train_cfg, centre, unit, model.ops)
    if model.poses.enabled:  # the L2 pull of the pose corrections towards the poses as given
        loss = loss + float(train_cfg.get("pose_penalty", 0.01)) * model.poses.penalty()
    return loss, mse
