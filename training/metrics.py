"""Image-quality metrics for evaluation: PSNR and SSIM, matching the NeRF / DirectVoxGO evaluation code.

Both take float images in [0, 1] (tensors or arrays, any device) and compute in float64, so the numbers
do not depend on the precision the model rendered in.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

# SSIM constants of Wang et al. (2004), as used by mip-NeRF / DirectVoxGO's rgb_ssim
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1 = 0.01
SSIM_K2 = 0.03


def _as_float64(name: str, image: torch.Tensor | np.ndarray, device: torch.device | None = None) -> torch.Tensor:
    """Validate a float image and return it as a float64 tensor (on ``device`` when given)."""
    if isinstance(image, np.ndarray):
        image = torch.from_numpy(image)
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or numpy array, got {type(image).__name__}")
    if not image.is_floating_point():
        raise TypeError(f"{name} must be a floating-point image in [0, 1], got dtype {image.dtype}")
    if image.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(image.shape)})")
    image = image.to(device=device if device is not None else image.device, dtype=torch.float64)
    if not torch.isfinite(image).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    return image


def _pair(pred, target) -> tuple[torch.Tensor, torch.Tensor]:
    pred = _as_float64("pred", pred)
    target = _as_float64("target", target, device=pred.device)
    if pred.shape != target.shape:
        raise ValueError(f"pred and target must have the same shape, got {tuple(pred.shape)} and {tuple(target.shape)}")
    return pred, target


def psnr(pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB for data range 1: ``-10 * log10(mean((pred - target)^2))``.

    pred, target: float images of the same shape, usually (H, W, 3) in [0, 1] (any shape works, e.g. a
    (N, 3) batch of ray colours). Identical inputs give ``inf``.
    """
    return float(psnr_tensor(*_pair(pred, target)))


def psnr_tensor(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """:func:`psnr` as a 0-dim float64 tensor on ``pred``'s device, computed without a host sync and without the
    input checks (for renders an evaluation loop collects and reads once at the end); ``inf`` when identical."""
    mse = torch.mean((pred.double() - target.to(pred.device).double()) ** 2)
    return -10.0 * torch.log10(mse)


def gaussian_window(
    size: int = SSIM_WINDOW, sigma: float = SSIM_SIGMA, dtype=torch.float64, device=None
) -> torch.Tensor:
    """(size,) normalised 1-D Gaussian, centred on the middle tap (``size`` odd)."""
    offsets = torch.arange(size, dtype=dtype, device=device) - (size - 1) / 2
    weights = torch.exp(-0.5 * (offsets / sigma) ** 2)
    return weights / weights.sum()


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
    """(..., H, W) -> (..., H - 10, W - 10): each map filtered by the 11 x 11 Gaussian window, 'valid'; two matrix
    products with banded matrices (exact sums in the maps' dtype, no cuDNN algorithm choice)."""
    height, width = maps.shape[-2:]
    return _band(height, maps.dtype, maps.device) @ maps @ _band(width, maps.dtype, maps.device).T


def window_filter(maps: torch.Tensor, banded: bool) -> torch.Tensor:
    """(..., H, W) -> (..., H - 10, W - 10), the 11 x 11 Gaussian window, 'valid': :func:`separable_filter`'s two
    matrix products when ``banded`` (on a GPU: cuDNN's float64 1-channel convolutions took ~6 ms a 400x400 view on
    an H100), else two 1-D convolutions (on a CPU: 11 taps a pixel instead of a band row, ~40x fewer flops)."""
    if banded:
        return separable_filter(maps)
    window = gaussian_window(dtype=maps.dtype, device=maps.device)
    flat = maps.reshape(-1, 1, *maps.shape[-2:])
    # the window is symmetric, so conv2d's correlation equals the convolution of the reference code
    flat = F.conv2d(F.conv2d(flat, window.view(1, 1, -1, 1)), window.view(1, 1, 1, -1))
    return flat.reshape(*maps.shape[:-2], *flat.shape[-2:])


def ssim_map(
    pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray, data_range: float = 1.0
) -> torch.Tensor:
    """Per-pixel SSIM, (H-10, W-10, C) float64: 11x11 Gaussian window (sigma 1.5), 'valid' filtering, no padding.

    pred, target: (H, W, C) float images, H and W at least 11. Local variances are clipped at 0 and the
    covariance to ``sqrt(var_pred * var_target)``, as in the DirectVoxGO / mip-NeRF evaluation code, so
    round-off in flat regions cannot push a value outside [-1, 1].
    """
    pred, target = _pair(pred, target)
    return _ssim_map(pred, target, data_range)


def _ssim_map(pred: torch.Tensor, target: torch.Tensor, data_range: float) -> torch.Tensor:
    """:func:`ssim_map` of two float64 tensors on one device, without the finiteness check (no host sync)."""
    if pred.dim() != 3 or pred.shape != target.shape:
        raise ValueError(f"pred and target must be (H, W, C) images, got shape {tuple(pred.shape)}")
    height, width, channels = pred.shape
    if height < SSIM_WINDOW or width < SSIM_WINDOW:
        raise ValueError(f"SSIM needs images of at least {SSIM_WINDOW}x{SSIM_WINDOW} pixels, got {height}x{width}")
    if not data_range > 0:
        raise ValueError(f"data_range must be > 0, got {data_range}")

    # Filter the five local statistics of every channel in one batch: (5*C, 1, H, W)
    x = pred.permute(2, 0, 1)
    y = target.permute(2, 0, 1)
    stack = torch.cat([x, y, x * x, y * y, x * y]).unsqueeze(1)
    stack = window_filter(stack, banded=pred.is_cuda)
    mu_x, mu_y, xx, yy, xy = stack.squeeze(1).split(channels)

    var_x = (xx - mu_x * mu_x).clamp_min(0.0)
    var_y = (yy - mu_y * mu_y).clamp_min(0.0)
    cov = xy - mu_x * mu_y
    cov = torch.sign(cov) * torch.minimum(torch.sqrt(var_x * var_y), cov.abs())
    c1 = (SSIM_K1 * data_range) ** 2
    c2 = (SSIM_K2 * data_range) ** 2
    numerator = (2 * mu_x * mu_y + c1) * (2 * cov + c2)
    denominator = (mu_x * mu_x + mu_y * mu_y + c1) * (var_x + var_y + c2)
    return (numerator / denominator).permute(1, 2, 0)


def ssim(pred: torch.Tensor | np.ndarray, target: torch.Tensor | np.ndarray, data_range: float = 1.0) -> float:
    """Mean SSIM over pixels and channels of two (H, W, C) float images in [0, 1]; see :func:`ssim_map`."""
    return ssim_map(pred, target, data_range).mean().item()


def ssim_tensor(pred: torch.Tensor, target: torch.Tensor, data_range: float = 1.0) -> torch.Tensor:
    """:func:`ssim` as a 0-dim float64 tensor on ``pred``'s device, without a host sync or the finiteness check."""
    return _ssim_map(pred.double(), target.to(pred.device).double(), data_range).mean()
