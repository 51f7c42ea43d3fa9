"""PSNR and SSIM against independent float64 references (numpy always, scipy.ndimage when installed)."""

import math

import numpy as np
import pytest
import torch

from training.metrics import psnr, ssim, window_filter

K1, K2, SIGMA, SIZE = 0.01, 0.03, 1.5, 11


def _window_2d() -> np.ndarray:
    """Explicit 11x11 Gaussian window (sigma 1.5), normalised to sum 1."""
    i = np.arange(SIZE, dtype=np.float64) - SIZE // 2
    rows, cols = np.meshgrid(i, i, indexing="ij")
    w = np.exp(-(rows**2 + cols**2) / (2 * SIGMA**2))
    return w / w.sum()


def _valid_filter_numpy(channel: np.ndarray) -> np.ndarray:
    """'valid' 2-D correlation of one (H, W) channel with the window, by explicit sliding windows."""
    patches = np.lib.stride_tricks.sliding_window_view(channel, (SIZE, SIZE))
    return np.einsum("ijkl,kl->ij", patches, _window_2d())


def _valid_filter_scipy(channel: np.ndarray) -> np.ndarray:
    ndimage = pytest.importorskip("scipy.ndimage")
    half = SIZE // 2
    full = ndimage.correlate(channel, _window_2d(), mode="constant", cval=0.0)
    return full[half:-half, half:-half]  # the window lies fully inside the image only there


def _reference_ssim(a: np.ndarray, b: np.ndarray, valid_filter) -> float:
    """SSIM as in DirectVoxGO's rgb_ssim: Gaussian local statistics, variances clipped, mean of the map."""
    values = []
    for c in range(a.shape[-1]):
        x, y = a[..., c].astype(np.float64), b[..., c].astype(np.float64)
        mx, my = valid_filter(x), valid_filter(y)
        vx = np.maximum(valid_filter(x * x) - mx * mx, 0.0)
        vy = np.maximum(valid_filter(y * y) - my * my, 0.0)
        cxy = valid_filter(x * y) - mx * my
        cxy = np.sign(cxy) * np.minimum(np.sqrt(vx * vy), np.abs(cxy))
        c1, c2 = K1**2, K2**2
        values.append(((2 * mx * my + c1) * (2 * cxy + c2)) / ((mx * mx + my * my + c1) * (vx + vy + c2)))
    return float(np.mean(np.stack(values, -1)))


def _box_blur(image: np.ndarray, radius: int) -> np.ndarray:
    padded = np.pad(image, ((radius, radius), (radius, radius), (0, 0)), mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, (2 * radius + 1, 2 * radius + 1), axis=(0, 1))
    return windows.mean(axis=(-1, -2))


def _image_pairs():
    rng = np.random.default_rng(7)
    a = rng.random((37, 45, 3))
    b = rng.random((37, 45, 3))
    yield "independent random", a, b
    smooth = _box_blur(rng.random((48, 40, 3)), 3)
    noisy = np.clip(smooth + rng.normal(0, 0.05, smooth.shape), 0, 1)
    yield "blurred vs noisy", smooth, noisy
    sharp = rng.random((30, 33, 3))
    yield "sharp vs blurred", sharp, _box_blur(sharp, 2)


@pytest.mark.parametrize("name, a, b", list(_image_pairs()), ids=lambda v: v if isinstance(v, str) else "")
def test_ssim_matches_numpy_reference(name, a, b):
    expected = _reference_ssim(a, b, _valid_filter_numpy)
    got = ssim(torch.from_numpy(a), torch.from_numpy(b))
    assert isinstance(got, float)
    assert got == pytest.approx(expected, abs=1e-6, rel=0), name
    assert -1.0 < got < 1.0


@pytest.mark.parametrize("name, a, b", list(_image_pairs()), ids=lambda v: v if isinstance(v, str) else "")
def test_ssim_matches_scipy_ndimage_reference(name, a, b):
    expected = _reference_ssim(a, b, _valid_filter_scipy)  # skips only if scipy is missing
    assert ssim(torch.from_numpy(a), torch.from_numpy(b)) == pytest.approx(expected, abs=1e-6, rel=0), name


def test_ssim_reference_is_not_trivially_equal():
    # Guards the references above: different filters or constants must change the value well beyond 1e-6.
    _, a, b = next(_image_pairs())
    value = _reference_ssim(a, b, _valid_filter_numpy)
    box = lambda ch: np.lib.stride_tricks.sliding_window_view(ch, (SIZE, SIZE)).mean(axis=(-1, -2))  # noqa: E731
    assert abs(_reference_ssim(a, b, box) - value) > 1e-4


def test_ssim_identity_symmetry_and_precision():
    rng = np.random.default_rng(3)
    a = torch.from_numpy(rng.random((24, 20, 3)))
    b = torch.from_numpy(np.clip(a.numpy() + rng.normal(0, 0.1, a.shape), 0, 1))
    assert ssim(a, a) == pytest.approx(1.0, abs=1e-12)
    assert ssim(a, b) == pytest.approx(ssim(b, a), abs=1e-12)
    assert ssim(a, b) < 0.99
    # float32 inputs are promoted to float64 internally: same value as float64 inputs holding the same numbers
    a32, b32 = a.float(), b.float()
    assert ssim(a32, b32) == pytest.approx(ssim(a32.double(), b32.double()), abs=1e-12)
    # numpy arrays are accepted too
    assert ssim(a.numpy(), b.numpy()) == pytest.approx(ssim(a, b), abs=1e-15)


def test_ssim_falls_as_noise_grows():
    rng = np.random.default_rng(11)
    clean = _box_blur(rng.random((40, 40, 3)), 2)
    noise = rng.normal(0, 1, clean.shape)
    scores = [ssim(clean, np.clip(clean + s * noise, 0, 1)) for s in (0.01, 0.05, 0.2)]
    assert scores[0] > scores[1] > scores[2]


@pytest.mark.requires_cuda
def test_ssim_and_psnr_on_cuda_match_cpu():
    rng = np.random.default_rng(5)
    a, b = torch.from_numpy(rng.random((32, 36, 3))), torch.from_numpy(rng.random((32, 36, 3)))
    assert ssim(a.cuda().float(), b.cuda().float()) == pytest.approx(ssim(a.float(), b.float()), abs=1e-10)
    assert psnr(a.cuda(), b.cuda()) == pytest.approx(psnr(a, b), abs=1e-10)


def test_psnr_of_known_mse():
    rng = np.random.default_rng(1)
    target = torch.from_numpy(rng.uniform(0.2, 0.8, (16, 12, 3)))
    signs = torch.from_numpy(rng.choice([-1.0, 1.0], size=target.shape))
    pred = target + 0.1 * signs  # every squared error is exactly 0.01 up to round-off -> 20 dB
    assert psnr(pred, target) == pytest.approx(20.0, abs=1e-9)
    pred = target + 0.01 * signs  # mse 1e-4 -> 40 dB; float32 input still evaluated in float64
    assert psnr(pred.float(), target.float()) == pytest.approx(40.0, abs=1e-3)
    assert psnr(target, target) == math.inf
    rays = torch.rand(100, 3, dtype=torch.float64)  # any matching shape, e.g. a batch of ray colours
    assert psnr(rays, rays * 0.5) == pytest.approx(-10 * math.log10(torch.mean((rays * 0.5) ** 2).item()))


@pytest.mark.parametrize("metric", [psnr, ssim])
def test_bad_inputs_raise_clear_errors(metric):
    good = torch.rand(16, 16, 3)
    with pytest.raises(ValueError, match="same shape"):
        metric(good, torch.rand(16, 15, 3))
    with pytest.raises(TypeError, match="pred"):
        metric((good * 255).to(torch.uint8), good)
    with pytest.raises(ValueError, match="target.*NaN"):
        metric(good, torch.full_like(good, float("nan")))
    with pytest.raises(TypeError, match="pred"):
        metric([[0.0]], good)


def test_ssim_rejects_images_smaller_than_the_window():
    with pytest.raises(ValueError, match="11x11"):
        ssim(torch.rand(10, 30, 3), torch.rand(10, 30, 3))
    with pytest.raises(ValueError, match=r"\(H, W, C\)"):
        ssim(torch.rand(30, 30), torch.rand(30, 30))


@pytest.mark.parametrize("name, a, b", list(_image_pairs()), ids=lambda v: v if isinstance(v, str) else "")
def test_window_filter_paths_agree(name, a, b):
    # the GPU's banded matrix products and the CPU's 1-D convolutions are the same 'valid' Gaussian filter
    maps = torch.from_numpy(np.stack([a, b, a * b])).permute(0, 3, 1, 2)  # (3, C, H, W), random, never zeros
    banded, convolved = window_filter(maps, banded=True), window_filter(maps, banded=False)
    assert banded.shape == (*maps.shape[:2], maps.shape[2] - 10, maps.shape[3] - 10)
    torch.testing.assert_close(banded, convolved, rtol=0, atol=1e-13)
    box = torch.ones(11, dtype=torch.float64) / 11  # and not any window: a box filter differs
    assert (banded[..., 0, 0] - (maps[..., :11, :11] * box[:, None] * box).sum((-1, -2))).abs().max() > 1e-4


@pytest.mark.requires_cuda
def test_ssim_on_cuda_equals_cpu():
    a, b = (torch.from_numpy(image) for image in list(_image_pairs())[1][1:])
    assert ssim(a.cuda(), b.cuda()) == pytest.approx(ssim(a, b), abs=1e-12)
