"""Training-loop building blocks that need no compiled extension: checkpoints, RNG state, interrupt
handling, pictures and config validation."""
from models.training.checkpoint import (
    CheckpointError,
    InterruptGuard,
    capture_rng_state,
    load_checkpoint,
    remove_stale_temporaries,
    restore_rng_state,
    save_checkpoint,
)
from models.training.config_check import ConfigError, validate_config
from models.training.visualize import (
    colorize_depth,
    comparison_image,
    error_map,
    plot_curve,
    to_uint8,
    write_turntable,
)

__all__ = [
    "CheckpointError",
    "InterruptGuard",
    "capture_rng_state",
    "load_checkpoint",
    "remove_stale_temporaries",
    "restore_rng_state",
    "save_checkpoint",
    "ConfigError",
    "validate_config",
    "colorize_depth",
    "comparison_image",
    "error_map",
    "plot_curve",
    "to_uint8",
    "write_turntable",
]
