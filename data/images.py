"""Image decoding, alpha compositing and area downscaling (numpy, per image; callers parallelise)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from data.errors import SceneError

# PIL modes we read, and the mode each is converted to: RGBA where the file can carry transparency, else RGB
_MODES = {"RGBA": "RGBA", "LA": "RGBA", "PA": "RGBA", "RGB": "RGB", "L": "RGB", "1": "RGB", "P": None}


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_WIDE_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")  # PIL's modes for 16- and 32-bit samples


def _png_bit_depth(path: Path) -> int | None:
    """Bits per sample from a PNG's IHDR chunk (PIL decodes 16-bit colour PNGs to 8 bits without a word)."""
    with open(path, "rb") as file:
        header = file.read(26)
    if len(header) == 26 and header[:8] == _PNG_SIGNATURE and header[12:16] == b"IHDR":
        return header[24]
    return None


def read_rgba(path: Path) -> np.ndarray:
    """Decode an image file into (H, W, 4) or (H, W, 3) uint8; images without alpha come back as RGB.

    Images with more than 8 bits per sample are refused, whatever their channels: the pipeline keeps uint8,
    and cutting them down silently would lose precision the user asked for.
    """
    try:
        with Image.open(path) as image:
            depth = _png_bit_depth(path) if image.format == "PNG" else None
            if image.mode in _WIDE_MODES or (depth is not None and depth > 8):
                bits = depth if depth and depth > 8 else (32 if image.mode in ("I", "F") else 16)
                raise SceneError(
                    f"{path}: {bits}-bit images are not supported (8 bits per channel expected); "
                    "convert it first, e.g. `magick IN -depth 8 OUT`"
                )
            if image.mode not in _MODES:
                raise SceneError(f"{path}: unsupported image mode {image.mode!r} (expected RGB, RGBA, L, LA or P)")
            target = _MODES[image.mode] or ("RGBA" if "transparency" in image.info else "RGB")
            return np.asarray(image if image.mode == target else image.convert(target))
    except FileNotFoundError:
        raise SceneError(f"{path}: image not found") from None
    except (OSError, ValueError) as error:
        if isinstance(error, SceneError):
            raise
        raise SceneError(f"{path}: cannot decode image ({error})") from None


def composite(pixels: np.ndarray, background: tuple[float, float, float]) -> np.ndarray:
    """(H, W, 3|4) uint8 -> (H, W, 3) float32 in [0, 255]: rgb * a + background * (1 - a); RGB is opaque."""
    rgb = pixels[..., :3].astype(np.float32)
    if pixels.shape[-1] == 3:
        return rgb
    alpha = pixels[..., 3:].astype(np.float32) * (1.0 / 255.0)
    return rgb * alpha + np.asarray(background, np.float32) * 255.0 * (1.0 - alpha)


def area_downscale(image: np.ndarray, factor: int) -> np.ndarray:
    """(H, W, C) -> (H/factor, W/factor, C): the mean of each factor x factor block (H, W divisible by factor).

    Averaging composited colour is averaging premultiplied colour, since compositing is linear in it.
    """
    if factor == 1:
        return image
    height, width, channels = image.shape
    blocks = image.reshape(height // factor, factor, width // factor, factor, channels)
    return blocks.mean(axis=(1, 3), dtype=np.float64 if image.dtype == np.float64 else np.float32)


def round_to_uint8(image: np.ndarray) -> np.ndarray:
    """Float image in [0, 255] (pixel values) -> uint8, rounded to nearest ([0, 1] images: visualize.to_uint8)."""
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def composite_uint8(pixels: np.ndarray, background: tuple[float, float, float]) -> np.ndarray:
    """(H, W, 3|4) uint8 -> (H, W, 3) uint8: :func:`composite` rounded to nearest.

    When the background is a whole number of 255ths (white, black, ...) this is done exactly in integers, which
    is about twice as fast: (rgb * a + B * (255 - a)) / 255 is never a tie, since 255 is odd.
    """
    scaled = np.asarray(background, np.float64) * 255.0
    if pixels.shape[-1] == 3 or not np.array_equal(scaled, np.round(scaled)):
        return round_to_uint8(composite(pixels, background))
    alpha = pixels[..., 3:].astype(np.uint16)
    mixed = pixels[..., :3] * alpha + scaled.astype(np.uint16) * (255 - alpha)  # <= 255 * 255: fits uint16
    mixed += 127
    mixed //= 255
    return mixed.astype(np.uint8)


def load_composited(
    path: Path, background: tuple[float, float, float], downscale: int, crop: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Read one image, composite it on ``background`` and area-downscale it. ``crop``: (H, W) to keep of the
    full-size image first, its top-left part (the pixels' positions, hence cx and cy, stay): for a size that is
    not divisible by ``downscale``.

    Returns (H/d, W/d, 3) uint8 colour and the (H/d, W/d) uint8 alpha it was composited with (area-averaged the
    same way), or None for an image without alpha. With both, the image on any other background B' is
    ``rgb + (B' - background) * (1 - alpha)``: training on random backgrounds needs no second copy.
    """
    pixels = read_rgba(path)
    height, width = pixels.shape[:2]
    if crop is not None:
        height, width = min(height, crop[0]), min(width, crop[1])
        pixels = pixels[:height, :width]
    if height % downscale or width % downscale:
        raise SceneError(f"{path}: image size {height}x{width} is not divisible by downscale={downscale}")
    alpha = pixels[..., 3] if pixels.shape[-1] == 4 else None
    if downscale == 1:
        return composite_uint8(pixels, background), alpha
    if alpha is not None:
        alpha = round_to_uint8(area_downscale(alpha[..., None].astype(np.float32), downscale))[..., 0]
    return round_to_uint8(area_downscale(composite(pixels, background), downscale)), alpha


def image_size(path: Path) -> tuple[int, int]:
    """(height, width) from the file header, without decoding the pixels."""
    try:
        with Image.open(path) as image:
            return image.height, image.width
    except FileNotFoundError:
        raise SceneError(f"{path}: image not found") from None
    except OSError as error:
        raise SceneError(f"{path}: cannot read image ({error})") from None


def write_png(path: Path, pixels: np.ndarray) -> None:
    """Write (H, W, 3|4) uint8 as PNG (deterministic bytes for the same pixels)."""
    Image.fromarray(pixels).save(path, format="PNG")
