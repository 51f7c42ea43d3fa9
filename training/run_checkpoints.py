"""What a run writes to disk while and after it trains: the resumable checkpoint (``checkpoints/last.pt``: weights,
optimiser state, RNG states, counters), written behind training (training.checkpoint_writer), and at the end the
finished model (``model.pt``, training.compact_model).

A periodic save blocks training only for the snapshot (device-side clones: milliseconds) and for the previous
write if it is still running; the bytes are written by a background thread, atomically. A failed write surfaces at
the next save or at the end as a one-line RunError that says which earlier checkpoint is kept. A stop (Ctrl-C,
SIGTERM) saves and joins before the process exits.

At a successful end the run writes ``model.pt`` and, unless ``train.keep_resumable`` is set, deletes
``checkpoints/last.pt``: a finished run keeps what a user renders, not 5 GB of optimiser state. A run stopped,
diverged or killed before its end keeps last.pt, so ``train.resume=true`` continues it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from training.checkpoint import StepCheckpoints, save_checkpoint
from training.checkpoint_writer import BackgroundWriter, snapshot
from training.compact_model import RUN_KEYS, save_model
from training.resume import trainer_counters, trainer_state
from training.run_dir import RunError, write_error

if TYPE_CHECKING:
    from training.trainer import Trainer


class RunCheckpoints:
    """The checkpoints of ``trainer``'s run (rank 0 writes; other ranks only count). Updates the trainer's
    ``checkpoint_seconds`` (time training was blocked), ``last_saved_step`` (the newest step on disk) and
    ``step_checkpoints``."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.writer = BackgroundWriter()
        self.model_bytes: int | None = None

    @property
    def write_seconds(self) -> float:
        """Background seconds spent copying and writing checkpoints (not blocking training)."""
        return self.writer.write_seconds

    def save_if_finite(self, loss: torch.Tensor, periodic: bool = False, background: bool = True) -> bool:
        """Save unless the loss or the parameters went NaN / inf (then keep the previous checkpoint)."""
        parameters = self.trainer.model.parameters()
        if not (bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p).all()) for p in parameters)):
            return False
        self.save(periodic, background)
        return True

    def save(self, periodic: bool = False, background: bool = True) -> None:
        """Snapshot the trainer and write ``last.pt`` (and with ``train.keep_checkpoints`` > 1 and ``periodic``, a
        kept ``step_<step>.pt``), in the background unless ``background`` is False."""
        trainer = self.trainer
        if not trainer.group.is_main:
            trainer.last_saved_step = trainer.step
            return
        start = time.perf_counter()
        self.wait()  # one write at a time; a failed previous write stops here
        state = snapshot(trainer_state(trainer))
        keep = int(trainer.train_cfg.get("keep_checkpoints", 1))
        if periodic and keep > 1 and trainer.step_checkpoints is None:  # on resume: the earlier step files are ours
            folder, adopted = trainer.paths.checkpoints, trainer.last_saved_step
            trainer.step_checkpoints = StepCheckpoints(folder, keep, adopt_upto=adopted)
        kept = trainer.step_checkpoints if periodic and keep > 1 else None
        path, step = trainer.paths.checkpoint, trainer.step

        def write(host_state: dict) -> None:
            if kept is None:
                save_checkpoint(path, host_state)
            else:
                kept.save(path, host_state, step)

        self.writer.submit(state, write, label=step)
        if not background:
            self.wait()
        trainer.checkpoint_seconds += time.perf_counter() - start

    def wait(self) -> None:
        """Join the write in flight: on success its step becomes ``last_saved_step``; a failure is a RunError."""
        trainer = self.trainer
        try:
            self.writer.wait()
        except (OSError, RuntimeError) as error:
            kept = (
                f"the previous checkpoint (step {trainer.last_saved_step}) is kept"
                if trainer.last_saved_step is not None
                else "no earlier checkpoint exists"
            )
            raise RunError(
                f"cannot write the checkpoint {trainer.paths.checkpoint}: {write_error(error)}; {kept}"
            ) from None
        if self.writer.label is not None:
            trainer.last_saved_step = self.writer.label

    def finish(self) -> None:
        """The successful end of training: the finished model ``model.pt``, then (``train.keep_resumable``) the
        resumable checkpoint of the same step, or else the one on disk deleted (once model.pt is whole on disk)."""
        trainer = self.trainer
        if not trainer.group.is_main:
            return
        start = time.perf_counter()
        self.wait()  # a failed periodic write is reported before anything is deleted
        run = {key: value for key, value in trainer_counters(trainer).items() if key in RUN_KEYS}
        try:
            self.model_bytes = save_model(trainer.paths.model, trainer.model, run)
        except (OSError, RuntimeError) as error:
            raise RunError(f"cannot write the model {trainer.paths.model}: {write_error(error)}") from None
        trainer.checkpoint_seconds += time.perf_counter() - start
        if trainer.train_cfg.get("keep_resumable", False):
            self.save(background=False)  # after model.pt: the newer file, so tools read the full-precision one
            return
        trainer.paths.checkpoint.unlink(missing_ok=True)
        try:
            trainer.paths.checkpoints.rmdir()  # only when empty: kept step files (train.keep_checkpoints) stay
        except OSError:
            pass
