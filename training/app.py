"""The program ``train.py`` runs: validate the config, set up the run folder, load the scene, train (with
checkpoints, interruption handling and a progress bar) or restore a checkpoint, then evaluate and write the
outputs. :func:`run` returns the process exit code; every expected failure (bad config, bad scene, missing
checkpoint, a full disk) is one line on stderr and exit code 2.

Run directory layout::

    checkpoints/last.pt   model, optimiser, step, RNG states, config, loss history (atomic writes)
    metrics.json          final evaluation (training.evaluation.run_metrics)
    renders/              <view>_pred.png, <view>_compare.png (gt | pred | error), <view>_depth.png,
                          turntable.gif (or .mp4), training_curve.png
    train.log             the run's messages; profile.json with train.profile=true
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from data import SceneError
from models.ops import build_ops
from training import distributed
from training.checkpoint import CheckpointError, remove_stale_temporaries
from training.config import ConfigError, typed, validate_config
from training.distributed import DistributedError, Group
from training.evaluation import write_outputs
from training.preflight import PreflightError, fine_pool_rows, run_preflight
from training.run_dir import (
    RunError,
    RunPaths,
    config_from_checkpoint,
    load_run_checkpoint,
    model_source,
    refuse_to_overwrite,
)
from training.scenes import (
    describe_device,
    grid_box,
    load_scenes,
    resolve_device,
    seed_everything,
)
from training.trainer import EXIT_OK, Trainer
from training.viewer import check_viewer, start_viewer

EXIT_USAGE = 2  # bad config, bad scene, missing checkpoint


def _main(cfg: DictConfig, paths: RunPaths, group: Group) -> int:
    validate_config(cfg)
    check_split(cfg, group)
    if cfg.train.viewer and group.is_main and not cfg.render_only:  # before any work: viser installed, port free
        check_viewer(cfg.train)
    refuse_to_overwrite(cfg, paths)
    device = resolve_device(cfg.device, group.local_rank if group.active else None)
    distributed.start(group, device.type, float(cfg.train.dist_timeout))
    group.same_everywhere("hydra.run.dir", str(paths.root.resolve()))
    removed = remove_stale_temporaries(paths.checkpoint) if group.is_main else 0
    if removed:
        print(
            f"removed {removed} unfinished checkpoint file(s) left by an interrupted save in {paths.checkpoint.parent}"
        )
    state = load_run_checkpoint(cfg, paths)
    if state is not None:  # the checkpoint's data and model config, typed again (it may predate a key)
        cfg = typed(config_from_checkpoint(cfg, state["config"]))
        validate_config(cfg)
    cfg = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # plain from here: nothing resolves late
    try:
        ops = build_ops(cfg.ops)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    seed = seed_everything(state["seed"] if state is not None else cfg.seed)

    data_start = time.perf_counter()
    try:
        # captures crop to the upsample factor; a contracted model's derived box is its full-resolution foreground
        foreground = cfg.model.contraction != "none"
        train_scene, eval_scene = load_scenes(cfg.data, device, multiple=cfg.model.upsample, foreground=foreground)
    except ValueError as error:  # option checks of the loader / generator (SceneError is about the files)
        raise ConfigError(f"data: {error}") from None
    data_seconds = time.perf_counter() - data_start
    print(
        f"data: {cfg.data.name} {train_scene.describe_sizes()}, {train_scene.num_views} train / "
        f"{eval_scene.num_views} {eval_scene.split} views ({data_seconds:.1f} s); device {describe_device(device)}; "
        f"ops {ops.backends}"
    )

    extent = tuple(float(e) for e in (train_scene.bbox[1] - train_scene.bbox[0]).tolist())
    pool = fine_pool_rows(cfg.model)  # the fine grid's largest brick pool (rows)
    try:
        fine_rows = run_preflight(
            paths.root,
            device,
            extent,
            int(cfg.model.resolution_end),
            int(cfg.model.feature_dim),
            eval_scene.num_views,
            eval_scene.height,
            eval_scene.width,
            training=not cfg.render_only,
            contracted=cfg.model.get("contraction", "none") == "inf",
            fine_rows=pool,
        )
    except PreflightError as error:
        raise RunError(str(error)) from None
    box = grid_box(cfg.data, train_scene)
    trainer = Trainer(cfg, paths, device, ops, train_scene, eval_scene, seed, box, group)
    fine_rows = group.minimum(fine_rows)  # every rank allocates the same bricks
    if fine_rows < pool:  # the fine grid gets the bricks that fit beside the grids
        bricks = fine_rows // int(cfg.model.fine.brick) ** 3
        print(f"fine grid: memory for {bricks} bricks on {device} (model.fine.max_bricks lower)")
        trainer.model.fine.cap_memory(bricks)
    if state is not None:
        trainer.restore(state, with_training_state=not cfg.render_only)
        # render_only reads the newer of model.pt and last.pt (run_dir.load_run_checkpoint); resume reads last.pt
        source = model_source(paths.root) if cfg.render_only else paths.checkpoint
        print(f"loaded {source} (step {trainer.step})")
    if not cfg.render_only:
        trainer.viewer = start_viewer(cfg.train, trainer, group) if cfg.train.viewer and group.is_main else None
        try:
            code = trainer.fit()
        finally:
            if trainer.viewer is not None:
                trainer.viewer.close()
            if trainer.step_graph is not None:  # before the process group goes (StepGraph.release)
                trainer.step_graph.release()
        if code != EXIT_OK or not group.is_main:  # rank 0 alone evaluates and writes the outputs
            return code
    metrics = write_outputs(trainer, bool(cfg.render_only), data_seconds)
    print(
        f"eval on {metrics['eval_views']} {metrics['eval_split']} views: PSNR {metrics['psnr']:.2f} dB "
        f"(worst 10% of views {metrics['psnr_worst10']:.2f} dB), SSIM {metrics['ssim']:.4f}; "
        f"{metrics['iters']} steps in {metrics['train_seconds']:.1f} s of training; "
        f"wrote {paths.metrics}"
    )
    run = paths.root
    print(  # what to do next (console scripts: voxel-field-view, voxel-field-render, voxel-field-export)
        f"next: view it:   python3 -m training.view {run}\n"
        f"      render it: python3 -m training.render_path {run} --path interpolate\n"
        f"      export it: python3 -m training.export pointcloud {run}"
    )
    return EXIT_OK


class _LogTee:
    """A text stream that passes everything to ``stream`` and copies whole lines to ``log`` (train.log),
    leaving out progress-bar redraws (lines holding a carriage return)."""

    def __init__(self, stream, log):
        self.stream, self.log, self.pending = stream, log, ""

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if "\r" not in line:
                self.log.write(line + "\n")
        self.log.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding...: the real stream's
        return getattr(self.stream, name)


def run(cfg: DictConfig, run_dir: str | os.PathLike) -> int:
    """Train and/or evaluate as ``cfg`` says, in ``run_dir``; returns the process exit code. The run's
    messages also go to ``run_dir/train.log`` (when the folder is writable). Under torchrun, ranks other than 0
    keep quiet except for errors (training.distributed)."""
    group = distributed.from_environment()
    if not group.is_main:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            return _run(cfg, run_dir, group)
    log_path = Path(run_dir) / "train.log"
    try:
        log = open(log_path, "a", encoding="utf-8")
    except OSError:
        return _run(cfg, run_dir, group)  # a read-only folder: the preflight check says so in one line
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _LogTee(stdout, log), _LogTee(stderr, log)
    try:
        return _run(cfg, run_dir, group)
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        log.close()


def _run(cfg: DictConfig, run_dir: str | os.PathLike, group: Group) -> int:
    """Train and/or evaluate as ``cfg`` says, in ``run_dir``; returns the process exit code.

    0 success; 2 a bad config, scene or checkpoint (one line on stderr); 3 the loss diverged (the last good
    checkpoint is kept); 128 + signal number when SIGINT / SIGTERM stopped training (after a checkpoint).
    """
    try:
        return _main(cfg, RunPaths(Path(run_dir)), group)
    except (ConfigError, SceneError, CheckpointError, RunError, DistributedError) as error:
        message = " ".join(str(error).split())  # one line, whatever the source
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted (outside training: nothing to save)", file=sys.stderr)
        return 128 + 2
    finally:
        distributed.stop(group)


def check_split(cfg: DictConfig, group: Group) -> None:
    """Data parallel asked for: the global batch must split into one shard a rank, checked before any work
    (``auto`` is checked where it chooses: training.space_parallel.split_for)."""
    if group.active and OmegaConf.select(cfg, "train.parallel", default="auto") == "data":
        distributed.check_shards(cfg, group.world)
