"""The 3DGS training loss: (1 - lambda) L1 + lambda (1 - SSIM), with SSIM differentiable in the image's dtype.

The evaluation's SSIM (training.metrics.ssim_map) computes in float64 and clips variances, whose square root has
no gradient at 0 (flat white backgrounds). The loss uses the same window (11 x 11 Gaussian, sigma 1.5, 'valid'
filtering, as gsplat's fused_ssim with padding="valid") without the clipping, so it equals the metric wherever
the clipping does not act.

The separable filter is two matrix products with banded matrices (``band @ maps @ band'``), not cuDNN
convolutions: a 1-channel 11-tap convolution over a batch of 15 maps is at the mercy of cuDNN's algorithm choice
(and runs in TF32 by default, which loses the 1e-4 variances ``E[x^2] - E[x]^2`` leaves), while cuBLAS matrix
products in float32 are exact sums and cost ~0.2 ms forward and backward at 400 x 400 on an H100.
``separable_filter_conv`` (the convolution form) stays as the reference and for ``bench.peers.profile``'s A/B.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from training.metrics import SSIM_K1, SSIM_K2, SSIM_WINDOW, gaussian_window


@functools.lru_cache(maxsize=8)
def _band(size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(size - 10, size) matrix whose row i holds the window at columns i .. i + 10 ('valid' filtering). Built
    outside inference mode: a cached inference tensor could not be saved for a later backward."""
    with torch.inference_mode(False), torch.no_grad():
        window = gaussian_window(dtype=dtype, device=device)
        rows, columns = torch.arange(size - SSIM_WINDOW + 1, device=device), torch.arange(size, device=device)
        offset = columns[None, :] - rows[:, None]
        inside = (offset >= 0) & (offset < SSIM_WINDOW)
        return torch.where(
            inside, window[offset.clamp(0, SSIM_WINDOW - 1)], torch.zeros((), dtype=dtype, device=device)
        )


def separable_filter(maps: torch.Tensor) -> torch.Tensor:
    """(B, H, W) -> (B, H - 10, W - 10): each map filtered by the 11 x 11 Gaussian window, 'valid'."""
    height, width = maps.shape[-2:]
    return _band(height, maps.dtype, maps.device) @ maps @ _band(width, maps.dtype, maps.device).T


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
    channels = pred.shape[-1]
    x, y = pred.permute(2, 0, 1), target.permute(2, 0, 1)
    moments = separable_filter(torch.cat([x, y, x * x, y * y, x * y]))
    mu_x, mu_y, xx, yy, xy = moments.split(channels)
    var_x, var_y, cov = xx - mu_x * mu_x, yy - mu_y * mu_y, xy - mu_x * mu_y
    c1, c2 = SSIM_K1**2, SSIM_K2**2
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    denominator = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    return (numerator / denominator).mean()


def photometric_loss(pred: torch.Tensor, target: torch.Tensor, ssim_lambda: float = 0.2) -> torch.Tensor:
    """(1 - ssim_lambda) * L1 + ssim_lambda * (1 - SSIM) of two (H, W, 3) images."""
    l1 = (pred - target).abs().mean()
    return (1.0 - ssim_lambda) * l1 + ssim_lambda * (1.0 - ssim_differentiable(pred, target))
