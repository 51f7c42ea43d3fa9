"""Loss terms of the training step beyond the photometric one."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
