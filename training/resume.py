"""What a checkpoint holds of a training run, and how a run continues from one (same step, optimiser moments,
RNG streams and counters)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from training.checkpoint import CheckpointError, capture_rng_state, restore_rng_state
from training.optim import load_optimizer_state

if TYPE_CHECKING:
    from training.trainer import Trainer

CHECKPOINT_FORMAT = 1


def trainer_counters(trainer: Trainer) -> dict:
    """The run's small state: step, config, histories and counters (no tensors but the sampler's state)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "step": trainer.step,
        "iters": trainer.iters,
        "config": OmegaConf.to_container(trainer.cfg, resolve=True),
        "history": {key: list(values) for key, values in trainer.history.items()},
        "eval_history": [dict(entry) for entry in trainer.eval_history],
        "train_seconds": trainer.train_seconds,
        "rays": trainer.rays_done,
        "pixels": trainer.pixels_done,
        "samples": trainer.samples_done,
        "checkpoint_seconds": trainer.checkpoint_seconds,
        "seed": trainer.seed,
    }


def trainer_state(trainer: Trainer) -> dict:
    """Everything :func:`restore_trainer` needs, as a dict for training.checkpoint.save_checkpoint. Its tensors are
    the live ones (training.checkpoint_writer.snapshot copies them for a write behind training)."""
    return {
        **trainer_counters(trainer),
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "rng": capture_rng_state(),
        "sampler_generator": trainer.generator.get_state(),
    }


def restore_trainer(trainer: Trainer, state: dict, with_training_state: bool) -> None:
    """Load a checkpoint's model (any grid resolution); with ``with_training_state`` also the optimiser,
    RNG states and counters, so training continues exactly where it stopped."""
    if state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{trainer.paths.checkpoint}: unknown checkpoint format {state.get('format')!r}")
    try:
        trainer.model.load_state_dict(state["model"])
    except (RuntimeError, KeyError) as error:
        first = str(error).strip().splitlines()[0]
        raise CheckpointError(f"{trainer.paths.checkpoint}: does not fit this model ({first})") from None
    trainer.model.to(trainer.device)
    trainer.step = int(state["step"])
    trainer.history = state["history"]
    trainer.eval_history = list(state["eval_history"])
    trainer.train_seconds = float(state["train_seconds"])
    trainer.rays_done, trainer.pixels_done = int(state["rays"]), int(state["pixels"])
    trainer.samples_done = int(state.get("samples", 0))
    trainer.checkpoint_seconds = float(state.get("checkpoint_seconds", 0.0))
    trainer.last_saved_step = trainer.step
    if not with_training_state:
        return
    # re-apply the schedule at this step (idempotent: sets the TV switch; grows only if train.iters changed)
    grown = trainer.step > 0 and trainer.model.on_step(trainer.step, trainer.iters)
    trainer.optimizer = trainer._new_optimizer()
    if not grown:  # from any of the optimisers: their states share torch.optim.Adam's keys
        load_optimizer_state(trainer.optimizer, state["optimizer"], trainer.device.type)
    restore_rng_state(state["rng"])
    generator_state = state["sampler_generator"].cpu()
    if generator_state.numel() == trainer.generator.get_state().numel():
        trainer.generator.set_state(generator_state)
    else:  # written on another device type (CPU and CUDA generators keep different states): reseed
        trainer.generator.manual_seed(trainer.seed + trainer.step)
        print(
            f"note: the checkpoint's batch sampler state is from another device type; resampling from seed "
            f"{trainer.seed} + step {trainer.step}"
        )
