"""What the training loop reports at its log steps: the progress bar, TensorBoard's scalars, the run's loss and PSNR
history, and the throughput since the last log step (rays per second, samples per ray)."""

from __future__ import annotations

import math
import sys
import time
from typing import TYPE_CHECKING

from tqdm import tqdm

from training.scenes import device_memory
from training.tensorboard import TensorBoardLogger

if TYPE_CHECKING:  # training.trainer imports this module
    from training.trainer import Trainer


LOGGED_MEMORY = ("allocated_bytes", "device_mallocs", "device_frees")  # training.scenes.device_memory's, in TensorBoard


class ProgressLog:
    """The bar (rank 0 only), the TensorBoard writer (``trainer.tensorboard``, which the evaluations also write) and
    the throughput window of one :meth:`Trainer.fit`."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        main = trainer.group.is_main
        self.tensorboard = TensorBoardLogger(trainer.paths.root / "tensorboard", main and trainer.train_cfg.tensorboard)
        self.bar = tqdm(
            total=trainer.iters,
            initial=trainer.step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            mininterval=0.5,
            file=sys.stdout,
            disable=not main,
        )
        self.restart()

    def restart(self) -> None:
        """Start the throughput window now: at the loop's start and after a pause (evaluation, checkpoint)."""
        self.start = time.perf_counter()
        self.rays, self.samples = self.trainer.rays_done, self.trainer.samples_done

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` spent outside training (the viewer) out of the window."""
        self.start += seconds

    def log(self, step: int, loss: float, mse: float) -> None:
        """A log step's report of the step's (rank-averaged) ``loss`` and ``mse``."""
        trainer = self.trainer
        now = time.perf_counter()
        rays_per_second = (trainer.rays_done - self.rays) / max(now - self.start, 1e-9)
        samples_per_ray = (trainer.samples_done - self.samples) / max(trainer.rays_done - self.rays, 1)
        self.start, self.rays, self.samples = now, trainer.rays_done, trainer.samples_done
        batch_psnr = -10.0 * math.log10(max(mse, 1e-12))
        for key, value in (("step", float(step)), ("loss", loss), ("psnr", batch_psnr)):
            trainer.history[key].append(value)
        rates = {f"lr_{g.get('name', i)}": g["lr"] for i, g in enumerate(trainer.optimizer.param_groups)}
        model = trainer.model
        occupied = model.occupancy.mask.float().mean().item()
        # CUDA: the bytes held and the allocator's driver calls so far: a window with new cudaMalloc / cudaFree
        # calls (each free synchronises the device) shows where a slow window's time went
        account = device_memory(trainer.device) or {}  # None off CUDA: scalars() leaves Nones out
        memory = {name: account.get(name) for name in LOGGED_MEMORY}
        self.tensorboard.scalars(
            step,
            loss=loss,
            psnr=batch_psnr,
            rays_per_second=rays_per_second,
            resolution=model.resolution,
            occupancy=occupied,
            **rates,
            **memory,
        )
        self.bar.set_postfix(
            loss=f"{loss:.4f}",
            psnr=f"{batch_psnr:.2f}",
            rays_s=f"{rays_per_second:,.0f}",
            grid=model.resolution,
            spr=f"{samples_per_ray:.0f}",
            refresh=False,
        )
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.tensorboard.close()
        self.bar.close()
