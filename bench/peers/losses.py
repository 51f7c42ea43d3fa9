"""The 3DGS training loss: (1 - lambda) L1 + lambda (1 - SSIM), with SSIM differentiable in the image's dtype.

The evaluation's SSIM (training.metrics.ssim_map) computes in float64 and clips variances, whose square root has
no gradient at 0 (flat white backgrounds). The loss uses the same window (11 x 11 Gaussian, sigma 1.5, 'valid'
filtering, as gsplat's fused_ssim with padding="valid") without the clipping, so it equals the metric wherever
the clipping does not act.

The separable filter is two matrix products with banded matrices (``band @ maps @ band'``), not cuDNN
convolutions: a 1-channel 11-tap convolution over a batch of 15 maps is at the mercy of cuDNN's algorithm choice
(and runs in TF32 by default, which loses the 1e-4 variances ``E[x^2] - E[x]^2`` leaves), while cuBLAS matrix
products in float32 are exact sums and cost ~0.2 ms forward and backward at 400 x 400 on an H100.
The filter and the SSIM are training.losses' (``train.dssim`` uses them too); ``separable_filter_conv`` (the
convolution form) stays here as the reference and for ``bench.peers.step_profile``'s A/B.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from training.losses import ssim_unclipped
from training.metrics import SSIM_WINDOW, gaussian_window


def separable_filter_conv(maps: torch.Tensor) -> torch.Tensor:
    """The same filter as two 1-channel convolutions over the batch (the reference; cuDNN picks the algorithm)."""
    window = gaussian_window(dtype=maps.dtype, device=maps.device)
    stack = maps.unsqueeze(1)
    return F.conv2d(F.conv2d(stack, window.view(1, 1, -1, 1)), window.view(1, 1, 1, -1)).squeeze(1)


def ssim_differentiable(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean SSIM of two (H, W, C) images in [0, 1] (H, W >= 11), a 0-d tensor with gradients."""
    if pred.shape != target.shape or pred.dim() != 3:
        shapes = f"{tuple(pred.shape)} and {tuple(target.shape)}"
        raise ValueError(f"pred and target must be (H, W, C) images of one shape, got {shapes}")
    if min(pred.shape[:2]) < SSIM_WINDOW:
        raise ValueError(
            f"pred and target must be at least {SSIM_WINDOW} pixels high and wide, got {tuple(pred.shape)}"
        )
    return ssim_unclipped(pred, target)


def photometric_loss(pred: torch.Tensor, target: torch.Tensor, ssim_lambda: float = 0.2) -> torch.Tensor:
    """(1 - ssim_lambda) * L1 + ssim_lambda * (1 - SSIM) of two (H, W, 3) images."""
    l1 = (pred - target).abs().mean()
    return (1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - ssim_differentiable(pred, target))
