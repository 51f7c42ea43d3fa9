"""The 3DGS training loss: (1 - lambda) L1 + lambda (1 - SSIM), with SSIM differentiable in the image's dtype.

The evaluation's SSIM (training.metrics.ssim_map) computes in float64 and clips variances, whose square root has
no gradient at 0 (flat white backgrounds). The loss uses the same window (11 x 11 Gaussian, sigma 1.5, 'valid'
filtering, as gsplat's fused_ssim with padding="valid") without the clipping, so it equals the metric wherever
the clipping does not act.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.metrics import SSIM_K1, SSIM_K2, gaussian_window


def ssim_differentiable(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean SSIM of two (H, W, C) images in [0, 1] (H, W >= 11), a 0-d tensor with gradients."""
    if pred.shape != target.shape or pred.dim() != 3:
        shapes = f"{tuple(pred.shape)} and {tuple(target.shape)}"
        raise ValueError(f"pred and target must be (H, W, C) images of one shape, got {shapes}")
    channels = pred.shape[-1]
    x, y = pred.permute(2, 0, 1), target.permute(2, 0, 1)
    stack = torch.cat([x, y, x * x, y * y, x * y]).unsqueeze(1)
    window = gaussian_window(dtype=pred.dtype, device=pred.device)
    stack = F.conv2d(F.conv2d(stack, window.view(1, 1, -1, 1)), window.view(1, 1, 1, -1))
    mu_x, mu_y, xx, yy, xy = stack.squeeze(1).split(channels)
    var_x, var_y, cov = xx - mu_x * mu_x, yy - mu_y * mu_y, xy - mu_x * mu_y
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    denominator = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    return (numerator / denominator).mean()


def photometric_loss(pred: torch.Tensor, target: torch.Tensor, ssim_lambda: float = 0.2) -> torch.Tensor:
    """(1 - ssim_lambda) * L1 + ssim_lambda * (1 - SSIM) of two (H, W, 3) images."""
    l1 = (pred - target).abs().mean()
    return (1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - ssim_differentiable(pred, target))
