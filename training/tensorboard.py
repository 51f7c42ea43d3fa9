"""TensorBoard logging of a run (``train.tensorboard``): scalars per logged step, held-out metrics and a few
images per evaluation, in ``<run dir>/tensorboard``. Optional: without the ``tensorboard`` package it is off
(``auto``), or the run stops with a one-line hint when it was asked for (``true``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from training.config import ConfigError

INSTALL_HINT = 'pip install -e ".[tensorboard]"'


def tensorboard_available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardLogger:
    """Writes TensorBoard event files; every method is a no-op when disabled.

    Args:
        log_dir: the event files' folder.
        setting: ``"auto"`` or ``None`` (on when the package is importable), ``true`` or ``false``.
    """

    def __init__(self, log_dir: Path, setting: str | bool | None = "auto"):
        if setting is None:
            setting = "auto"
        if setting not in ("auto", True, False):
            raise ConfigError(f"train.tensorboard: expected auto, true or false, got {setting!r}")
        available = tensorboard_available()
        if setting is True and not available:
            raise ConfigError(f"train.tensorboard: the tensorboard package is not installed ({INSTALL_HINT})")
        self.enabled = available and setting in ("auto", True)
        self.writer = None
        if self.enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))

    def scalars(self, step: int, **values: float) -> None:
        """One scalar per keyword, under ``train/<name>`` (loss, psnr, rays_per_second, learning rates, ...)."""
        if self.writer is None:
            return
        for name, value in values.items():
            if value is not None:
                self.writer.add_scalar(f"train/{name}", float(value), step)

    def evaluation(self, step: int, psnr: float, ssim: float, images: dict[str, np.ndarray] | None = None) -> None:
        """Held-out PSNR and SSIM (``eval/psnr``, ``eval/ssim``) and (H, W, 3) uint8 images under ``eval/<name>``."""
        if self.writer is None:
            return
        self.writer.add_scalar("eval/psnr", float(psnr), step)
        self.writer.add_scalar("eval/ssim", float(ssim), step)
        for name, image in (images or {}).items():
            self.writer.add_image(f"eval/{name}", np.asarray(image), step, dataformats="HWC")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
