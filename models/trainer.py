"""Training and evaluation of a :class:`VoxelNeRF` from a resolved config: what ``train.py`` runs.

:func:`run` is the whole program: validate the config, load the scene, train (with checkpoints, interruption
handling and a progress bar) or restore a checkpoint, then evaluate on the held-out views and write
``metrics.json`` and the renders into the run directory. It returns the process exit code; every expected
failure (bad config, bad scene, missing checkpoint) is one line on stderr and exit code 2.

Run directory layout::

    checkpoints/last.pt   model, optimiser, step, RNG states, config, loss history (atomic writes)
    metrics.json          final evaluation (see Trainer.metrics)
    renders/              <view>_pred.png, <view>_compare.png (gt | pred | error), <view>_depth.png,
                          turntable.gif (or .mp4), training_curve.png
    profile.json          with train.profile=true
"""
from __future__ import annotations

import datetime
import json
import math
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import imageio.v3 as iio
import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from data import PatchSampler, RaySampler, Scene, SceneError, ensure_synthetic_scene, eval_split, load_blender
from data.bounds import mask_hull_box
from data.cameras import look_at, orbit_positions
from models.config import parse_model_config
from models.metrics import psnr, ssim
from models.model import VoxelNeRF
from models.ops import OpSet, build_ops
from models.training import (
    CheckpointError,
    ConfigError,
    InterruptGuard,
    capture_rng_state,
    colorize_depth,
    comparison_image,
    load_checkpoint,
    plot_curve,
    remove_stale_temporaries,
    restore_rng_state,
    save_checkpoint,
    to_uint8,
    validate_config,
    write_turntable,
)
from models.training.preflight import PreflightError, run_preflight
from models.training.profiler import StepProfiler

CHECKPOINT_FORMAT = 1
EXIT_OK = 0
EXIT_USAGE = 2  # bad config, bad scene, missing checkpoint
EXIT_DIVERGED = 3  # NaN / inf loss
LOSS_LIMIT = 1e3  # colours live in [0, 1]: a loss this large (PSNR -30 dB) is an exploding run, not a slow one
# generated scenes live in the user's cache, not inside the installed package (site-packages for a normal install)
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "voxel-field" / "scenes"
ADAM_BETAS = (0.9, 0.99)  # DirectVoxGO's: a shorter second-moment memory suits grids whose voxels see rays rarely


class RunError(RuntimeError):
    """An expected failure whose one-line message is shown to the user as is."""


# ---------------------------------------------------------------------------------------------- set-up


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; ``cpu`` / ``cuda`` as given (validated earlier)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def describe_device(device: torch.device) -> str:
    """e.g. ``"cpu"`` or ``"cuda:0 (NVIDIA H100 80GB HBM3)"``."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def seed_everything(seed: int | None) -> int:
    """Seed python, numpy and torch (every device); ``None`` draws a seed. Returns the seed used."""
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return seed


def scene_root(data_cfg: DictConfig) -> Path:
    """The blender-format folder of the configured scene, generating the synthetic one on first use."""
    if data_cfg.name == "blender":
        return Path(data_cfg.root).expanduser()
    cache = Path(data_cfg.cache_dir).expanduser() if data_cfg.get("cache_dir") else DEFAULT_CACHE
    return ensure_synthetic_scene(
        cache, resolution=data_cfg.resolution, n_train=data_cfg.n_train, n_val=data_cfg.n_val,
        n_test=data_cfg.n_test, seed=data_cfg.scene_seed,
    )


def load_scenes(data_cfg: DictConfig, device: torch.device) -> tuple[Scene, Scene]:
    """(train, eval) splits on ``device``; eval is the test split when present, else val."""
    root = scene_root(data_cfg)
    options = dict(
        downscale=data_cfg.downscale, background=tuple(data_cfg.background), near=data_cfg.near,
        far=data_cfg.far, scene_box=data_cfg.scene_box,
    )
    train = load_blender(root, "train", **options)
    evaluation = load_blender(root, eval_split(root), **options)
    return train.to(device), evaluation.to(device)


def learning_rate_factor(step: int, total_steps: int, final_factor: float) -> float:
    """Exponential decay from 1 at step 0 to ``final_factor`` (>= 0) at ``total_steps``."""
    return final_factor ** (min(step, total_steps) / max(total_steps, 1))


def orbit_cameras(c2w: torch.Tensor, count: int) -> torch.Tensor:
    """(count, 4, 4) cameras on a circle around the origin (z up) at the mean radius and elevation of ``c2w``."""
    positions = c2w[:, :3, 3].double().cpu().numpy()
    radius = float(np.linalg.norm(positions, axis=-1).mean())
    elevation = float(np.mean(np.arcsin(np.clip(positions[:, 2] / np.linalg.norm(positions, axis=-1), -1, 1))))
    elevation = float(np.clip(elevation, -math.radians(80), math.radians(80)))  # look_at needs up != view axis
    return torch.from_numpy(look_at(orbit_positions(count, radius, elevation)).astype(np.float32))


def opacity_loss(opacity: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Mean squared difference between the rays' opacity and the training images' alpha: density where the
    masks say empty is haze, even where its colour matches the background (``train.opacity_loss`` weighs it).

    ``opacity`` (B,) or (n, P, P); ``alpha`` the same shape, or (n, sP, sP) for patch batches (area-averaged
    down to the rays' resolution P).
    """
    if alpha.shape != opacity.shape:
        if alpha.dim() != 3 or opacity.dim() != 3 or alpha.shape[1] % opacity.shape[1]:
            raise ValueError(f"opacity_loss: alpha {tuple(alpha.shape)} does not fit opacity {tuple(opacity.shape)}")
        alpha = F.avg_pool2d(alpha[:, None], alpha.shape[1] // opacity.shape[1])[:, 0]
    return F.mse_loss(opacity, alpha)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _write_error(error: BaseException) -> str:
    """A one-line reason for a failed write, saying "disk full" where that is what happened."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    errno_value = getattr(error, "errno", None)
    if errno_value == 28 or "No space left" in text or "unexpected pos" in text:
        return f"the disk is full ({text})"
    if errno_value == 30:
        return f"the file system is read-only ({text})"
    return text


def _write_json(path: Path, content: dict) -> None:
    """Write through a temporary file and rename, so a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


@dataclass(frozen=True)
class RunPaths:
    """Where a run keeps its files."""

    root: Path

    @property
    def checkpoint(self) -> Path:
        return self.root / "checkpoints" / "last.pt"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.json"

    @property
    def renders(self) -> Path:
        return self.root / "renders"

    @property
    def profile(self) -> Path:
        return self.root / "profile.json"


# ---------------------------------------------------------------------------------------------- trainer


class Trainer:
    """Owns the model, optimiser, sampler and bookkeeping of one run.

    Args:
        cfg: the resolved config (plain, not struct).
        paths: the run directory's files.
        device: where the model and images live.
        ops: the op backends.
        train_scene, eval_scene: splits already on ``device``.
        seed: the seed the run was started with (seeds the batch sampler's generator).
        grid_box: optional (2, 3) box the grids start on (``data.tight_box``: the masks' visual hull).
    """

    def __init__(self, cfg: DictConfig, paths: RunPaths, device: torch.device, ops: OpSet,
                 train_scene: Scene, eval_scene: Scene, seed: int, grid_box: torch.Tensor | None = None):
        self.cfg, self.train_cfg = cfg, cfg.train
        self.paths, self.device, self.seed = paths, device, seed
        self.train_scene, self.eval_scene = train_scene, eval_scene
        self.iters = int(cfg.train.iters)
        self.profiler = StepProfiler(device, bool(cfg.train.profile))
        self.ops = ops
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        self.model = VoxelNeRF(train_scene.bbox.cpu(), train_scene.near, train_scene.far, model_cfg,
                               self.profiler.instrument_ops(ops), grid_box=grid_box).to(device)
        self.profiler.instrument_module(self.model.decoder, "decoder")
        self._check_image_sizes()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.sampler: RaySampler | PatchSampler | None = None  # built by fit(): render_only needs none
        self.optimizer = self._new_optimizer()
        self.step = 0
        self.history: dict[str, list[float]] = {"step": [], "loss": [], "psnr": []}
        self.eval_history: list[dict] = []
        self.train_seconds = 0.0
        self.rays_done = 0
        self.pixels_done = 0
        self.samples_done = 0
        self.checkpoint_seconds = 0.0  # kept out of train_seconds, reported beside it
        self.last_saved_step: int | None = None
        self.pending_writes: list = []  # (path, future) of the render writes in flight

    # ---------------------------------------------------------------- building blocks
    def _check_image_sizes(self) -> None:
        scale = self.model.scale
        for scene in (self.train_scene, self.eval_scene):
            if scene.height % scale or scene.width % scale:
                raise ConfigError(
                    f"model.upsample: the {scene.split} images ({scene.height}x{scene.width}) are not divisible by "
                    f"{scale} (change model.upsample or data.downscale)"
                )

    def _build_sampler(self) -> RaySampler | PatchSampler:
        if self.model.scale == 1:
            return RaySampler(self.train_scene, self.train_cfg.batch_rays, self.generator)
        try:
            return PatchSampler(self.train_scene, self.train_cfg.patch_size, self.model.scale,
                                self.train_cfg.patches_per_batch, self.generator)
        except ValueError as error:
            raise ConfigError(f"train.patch_size: {error}") from None

    def _new_optimizer(self) -> torch.optim.Adam:
        groups = self.model.param_groups(float(self.train_cfg.lr), float(self.train_cfg.lr_decoder))
        for group in groups:
            group["initial_lr"] = group["lr"]
        return torch.optim.Adam(groups, betas=ADAM_BETAS, eps=float(self.train_cfg.get("adam_eps", 1e-8)),
                                fused=self.device.type == "cuda")

    def _rebuild_optimizer(self) -> None:
        """New Adam over the model's current parameters, keeping the moments of parameters that survived."""
        old = self.optimizer
        self.optimizer = self._new_optimizer()
        for group in self.optimizer.param_groups:
            for parameter in group["params"]:
                if parameter in old.state:
                    self.optimizer.state[parameter] = old.state[parameter]

    def _set_learning_rates(self) -> None:
        factor = learning_rate_factor(self.step, self.iters, float(self.train_cfg.lr_final_factor))
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * factor

    # ---------------------------------------------------------------- one step
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimiser step; returns the detached (loss, mse) without syncing the device."""
        profiler = self.profiler
        with profiler.section("step"):
            self._set_learning_rates()
            with profiler.section("sampling"):
                batch = self.sampler.sample()
                background, target = self._training_background(batch)
            with profiler.section("forward"):
                if self.model.scale == 1:
                    out = self.model.render_rays(batch.origins, batch.directions, background)
                else:
                    out = self.model.render_patches(batch, background)
            with profiler.section("regularization"):
                regularization = self.model.regularization()
            with profiler.section("loss_backward"):
                mse = F.mse_loss(out["rgb"], target)
                loss = mse + regularization + self._opacity_loss(out["opacity"], batch.alpha)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with profiler.section("optimizer"):
                self.optimizer.step()
            self.step += 1
            with profiler.section("schedule"):
                if self.model.on_step(self.step, self.iters):
                    self._rebuild_optimizer()
        rays = batch.origins.numel() // 3
        self.rays_done += rays
        self.samples_done += int(out["samples"]) if "samples" in out else 0  # a CPU count: no device sync
        self.pixels_done += batch.rgb.numel() // 3
        profiler.end_step(rays)
        return loss.detach(), mse.detach()

    def _opacity_loss(self, opacity: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor | float:
        weight = float(self.train_cfg.get("opacity_loss", 0.0))
        if weight == 0.0 or alpha is None:
            return 0.0
        return weight * opacity_loss(opacity, alpha)

    def _training_background(self, batch) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(background, target) for a batch: with ``train.random_background`` and a scene with alpha, a random
        colour per pixel and the ground truth composited on it (Instant-NGP's default: the model can no longer
        paint the background into the scene as haze); else (None, the images as loaded)."""
        if not self.train_cfg.get("random_background", False) or batch.alpha is None:
            return None, batch.rgb
        background = torch.rand(batch.rgb.shape, device=batch.rgb.device, generator=self.generator)
        scene_background = batch.rgb.new_tensor(self.train_scene.background)
        return background, batch.rgb + (background - scene_background) * (1.0 - batch.alpha)[..., None]

    # ---------------------------------------------------------------- the loop
    def fit(self) -> int:
        """Train from :attr:`step` to ``train.iters``; returns the exit code (0, 128+signal, or EXIT_DIVERGED)."""
        cfg = self.train_cfg
        if self.step >= self.iters:
            print(f"checkpoint is at step {self.step} >= train.iters={self.iters}: nothing to train")
            return EXIT_OK
        if self.sampler is None:
            self.sampler = self._build_sampler()
        self.model.train()
        self.profiler.recording = True
        bar = tqdm(total=self.iters, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   mininterval=0.5, file=sys.stdout)
        code = EXIT_OK
        with InterruptGuard() as guard:
            _sync(self.device)
            segment_start = window_start = time.perf_counter()
            window_rays, window_samples = self.rays_done, self.samples_done
            while self.step < self.iters:
                loss, mse = self.train_step()
                step = self.step
                pause = False
                if step % cfg.log_every == 0 or step == self.iters:
                    loss_value, mse_value = loss.item(), mse.item()  # syncs the device
                    if not (math.isfinite(loss_value) and math.isfinite(mse_value)) or loss_value > LOSS_LIMIT:
                        code = self._diverged(step, loss_value)
                        break
                    now = time.perf_counter()
                    rays_per_second = (self.rays_done - window_rays) / max(now - window_start, 1e-9)
                    samples_per_ray = (self.samples_done - window_samples) / max(self.rays_done - window_rays, 1)
                    window_start, window_rays, window_samples = now, self.rays_done, self.samples_done
                    batch_psnr = -10.0 * math.log10(max(mse_value, 1e-12))
                    self._record(step, loss_value, batch_psnr)
                    bar.set_postfix(loss=f"{loss_value:.4f}", psnr=f"{batch_psnr:.2f}",
                                    rays_s=f"{rays_per_second:,.0f}", grid=self.model.resolution,
                                    spr=f"{samples_per_ray:.0f}", refresh=False)
                    bar.update(step - bar.n)
                periodic_checkpoint = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < self.iters
                periodic_eval = cfg.eval_every and step % cfg.eval_every == 0 and step < self.iters
                if periodic_checkpoint or periodic_eval or guard.requested:
                    _sync(self.device)
                    self.train_seconds += time.perf_counter() - segment_start
                    pause = True
                if periodic_checkpoint or guard.requested:
                    if not self._save_if_finite(loss):
                        code = self._diverged(step, loss.item())
                        break
                if guard.requested:
                    bar.close()
                    print(f"interrupted by {guard.signum.name} at step {step}/{self.iters}: checkpoint saved to "
                          f"{self.paths.checkpoint}; continue with train.resume=true and the same hydra.run.dir",
                          file=sys.stderr)
                    self.profiler.recording = False
                    return guard.exit_code
                if periodic_eval:
                    self._periodic_eval()
                if pause:
                    segment_start = window_start = time.perf_counter()
                    window_rays, window_samples = self.rays_done, self.samples_done
            else:
                _sync(self.device)
                self.train_seconds += time.perf_counter() - segment_start
        self.profiler.recording = False
        bar.close()
        if code != EXIT_OK:
            return code
        if not self._save_if_finite(loss):
            return self._diverged(self.step, loss.item())
        if self.profiler.enabled:
            report = self.profiler.report()
            _write_json(self.paths.profile, report)
            print(StepProfiler.format(report))
        return EXIT_OK

    def _record(self, step: int, loss: float, batch_psnr: float) -> None:
        self.history["step"].append(float(step))
        self.history["loss"].append(loss)
        self.history["psnr"].append(batch_psnr)

    def _diverged(self, step: int, loss: float) -> int:
        kept = (f"the last good checkpoint (step {self.last_saved_step}) is kept at {self.paths.checkpoint}"
                if self.last_saved_step is not None else "no checkpoint was written")
        kind = "exploding" if math.isfinite(loss) else "not finite"
        print(f"error: training diverged: loss is {loss} at step {step} ({kind}); stopped, {kept} "
              "(likely cause: a learning rate too high for this scene: try a lower train.lr / train.lr_decoder)",
              file=sys.stderr)
        return EXIT_DIVERGED

    def _periodic_eval(self) -> None:
        count = min(self.train_cfg.eval_views, self.eval_scene.num_views)
        if count == 0:
            return
        views = np.linspace(0, self.eval_scene.num_views - 1, count).round().astype(int).tolist()
        result = self.evaluate(sorted(set(views)), write_images=False)
        entry = {"step": self.step, "train_seconds": self.train_seconds, "psnr": result["psnr"], "ssim": result["ssim"],
                 "psnr_worst10": result["psnr_worst10"]}
        self.eval_history.append(entry)
        tqdm.write(f"eval @ step {self.step}: PSNR {entry['psnr']:.2f} dB, SSIM {entry['ssim']:.4f} "
                   f"({len(views)} views, {self.train_seconds:.1f} s of training)", file=sys.stdout)

    # ---------------------------------------------------------------- checkpoints
    def _parameters_finite(self) -> bool:
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def _save_if_finite(self, loss: torch.Tensor) -> bool:
        """Save a checkpoint unless the loss or the parameters went NaN / inf (then keep the previous one)."""
        if not (bool(torch.isfinite(loss)) and self._parameters_finite()):
            return False
        self.save()
        return True

    def save(self) -> None:
        """Write the checkpoint atomically; a write error (disk full, read-only, I/O) becomes a RunError that
        says the previous checkpoint is kept (the atomic save never touches it)."""
        start = time.perf_counter()
        try:
            self._write_checkpoint()
        except (OSError, RuntimeError) as error:
            kept = (f"the previous checkpoint (step {self.last_saved_step}) is kept" if self.last_saved_step is not None
                    else "no earlier checkpoint exists")
            raise RunError(f"cannot write the checkpoint {self.paths.checkpoint}: {_write_error(error)}; {kept}") from None
        self.last_saved_step = self.step
        self.checkpoint_seconds += time.perf_counter() - start

    def _write_checkpoint(self) -> None:
        save_checkpoint(self.paths.checkpoint, {
            "format": CHECKPOINT_FORMAT,
            "step": self.step,
            "iters": self.iters,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": capture_rng_state(),
            "sampler_generator": self.generator.get_state(),
            "config": OmegaConf.to_container(self.cfg, resolve=True),
            "history": self.history,
            "eval_history": self.eval_history,
            "train_seconds": self.train_seconds,
            "rays": self.rays_done,
            "pixels": self.pixels_done,
            "samples": self.samples_done,
            "checkpoint_seconds": self.checkpoint_seconds,
            "seed": self.seed,
        })

    def restore(self, state: dict, with_training_state: bool) -> None:
        """Load a checkpoint's model (any grid resolution); with ``with_training_state`` also the optimiser,
        RNG states and counters, so training continues exactly where it stopped."""
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{self.paths.checkpoint}: unknown checkpoint format {state.get('format')!r}")
        try:
            self.model.load_state_dict(state["model"])
        except (RuntimeError, KeyError) as error:
            first = str(error).strip().splitlines()[0]
            raise CheckpointError(f"{self.paths.checkpoint}: does not fit this model ({first})") from None
        self.model.to(self.device)
        self.step = int(state["step"])
        self.history = state["history"]
        self.eval_history = list(state["eval_history"])
        self.train_seconds = float(state["train_seconds"])
        self.rays_done, self.pixels_done = int(state["rays"]), int(state["pixels"])
        self.samples_done = int(state.get("samples", 0))
        self.checkpoint_seconds = float(state.get("checkpoint_seconds", 0.0))
        self.last_saved_step = self.step
        if not with_training_state:
            return
        # re-apply the schedule at this step (idempotent: sets the TV switch; grows only if train.iters changed)
        grown = self.step > 0 and self.model.on_step(self.step, self.iters)
        self.optimizer = self._new_optimizer()
        if not grown:
            self.optimizer.load_state_dict(state["optimizer"])
            for group in self.optimizer.param_groups:  # the checkpoint may come from another device type
                group["fused"] = self.device.type == "cuda"
        restore_rng_state(state["rng"])
        generator_state = state["sampler_generator"].cpu()
        if generator_state.numel() == self.generator.get_state().numel():
            self.generator.set_state(generator_state)
        else:  # written on another device type (CPU and CUDA generators keep different states): reseed
            self.generator.manual_seed(self.seed + self.step)
            print(f"note: the checkpoint's batch sampler state is from another device type; resampling from seed "
                  f"{self.seed} + step {self.step}")

    # ---------------------------------------------------------------- evaluation
    @torch.no_grad()
    def render(self, c2w: torch.Tensor) -> dict[str, torch.Tensor]:
        scene = self.eval_scene
        return self.model.render_image(c2w, scene.height, scene.width, scene.focal, chunk=self.train_cfg.render_chunk)

    @torch.no_grad()
    def evaluate(self, views: list[int], write_images: bool, writer: ThreadPoolExecutor | None = None) -> dict:
        """Render ``views`` of the eval split -> dict(psnr, ssim (means), per_view, seconds); PNGs when asked."""
        was_training = self.model.training
        self.model.eval()
        scene = self.eval_scene
        per_view = []
        start = time.perf_counter()
        for view in views:
            out = self.render(scene.c2w[view])
            target = scene.images[view].float() / 255.0
            per_view.append({"view": view, "name": scene.names[view],
                             "psnr": psnr(out["rgb"], target), "ssim": ssim(out["rgb"], target)})
            if write_images:
                if writer is None:
                    raise ValueError("evaluate: write_images=True needs a writer (a ThreadPoolExecutor)")
                pred, gt = out["rgb"].cpu().numpy(), target.cpu().numpy()
                depth = torch.where(out["opacity"] > 0.5, out["depth"] / out["opacity"].clamp_min(1e-6),
                                    torch.full_like(out["depth"], float("nan"))).cpu().numpy()
                stem = self.paths.renders / f"{view:03d}"
                for name, image in (("pred", to_uint8(pred)), ("compare", comparison_image(gt, pred)),
                                    ("depth", colorize_depth(depth, scene.near, scene.far))):
                    path = f"{stem}_{name}.png"
                    self.pending_writes.append((path, writer.submit(iio.imwrite, path, image)))
        _sync(self.device)
        self.model.train(was_training)
        ranked = sorted(per_view, key=lambda v: v["psnr"])
        worst = ranked[: max(1, math.ceil(len(ranked) / 10))]  # the held-out bar is about the worst views too
        return {
            "psnr": float(np.mean([v["psnr"] for v in per_view])),
            "ssim": float(np.mean([v["ssim"] for v in per_view])),
            "psnr_worst10": float(np.mean([v["psnr"] for v in worst])),
            "worst_views": [v["view"] for v in worst],
            "per_view": per_view,
            "seconds": time.perf_counter() - start,
        }

    def write_outputs(self, render_only: bool, data_seconds: float) -> dict:
        """Final evaluation on every eval view, renders, turntable, curve and metrics.json; returns the metrics.

        Every file write is checked: a failed one (disk full, a folder in the way) stops the run with a
        RunError naming the file, instead of leaving unreadable images behind an exit code of 0."""
        self.pending_writes = []
        try:
            self.paths.renders.mkdir(parents=True, exist_ok=True)
            with ThreadPoolExecutor(max_workers=4) as writer:
                result = self.evaluate(list(range(self.eval_scene.num_views)), write_images=True, writer=writer)
                files_start = time.perf_counter()
                self.write_turntable()
                if len(self.history["step"]) >= 1:
                    plot_curve(self.history["step"], self.history["psnr"], self.paths.renders / "training_curve.png",
                               title="training PSNR (batch)", ylabel="PSNR (dB)", xlabel="step")
            for path, future in self.pending_writes:
                if future.exception() is not None:
                    raise RunError(f"cannot write the render {path}: {_write_error(future.exception())}")
            files_seconds = time.perf_counter() - files_start
            metrics = self.metrics(result, render_only, data_seconds, files_seconds)
            _write_json(self.paths.metrics, metrics)
        except OSError as error:
            raise RunError(f"cannot write the run's outputs in {self.paths.root}: {_write_error(error)}") from None
        return metrics

    @torch.no_grad()
    def write_turntable(self) -> Path | None:
        count = self.train_cfg.turntable_frames
        if count == 0:
            return None
        self.model.eval()
        scene, scale = self.eval_scene, self.model.scale
        # at most turntable_max_side pixels a side (same field of view), a multiple of the upsample factor
        shrink = max(1, math.ceil(max(scene.height, scene.width) / self.train_cfg.turntable_max_side))
        height, width = (max(scale, side // shrink // scale * scale) for side in (scene.height, scene.width))
        focal = scene.focal * width / scene.width
        frames = [
            to_uint8(self.model.render_image(c2w, height, width, focal, chunk=self.train_cfg.render_chunk)["rgb"].cpu().numpy())
            for c2w in orbit_cameras(scene.c2w, count)
        ]
        return write_turntable(frames, self.paths.renders / "turntable.mp4", fps=20.0)

    def metrics(self, result: dict, render_only: bool, data_seconds: float, files_seconds: float) -> dict:
        seconds = max(self.train_seconds, 1e-9)
        return {
            "psnr": result["psnr"],
            "ssim": result["ssim"],
            "psnr_worst10": result["psnr_worst10"],
            "worst_views": result["worst_views"],  # renders/<view>_compare.png shows their error images
            "per_view": result["per_view"],
            "iters": self.step,
            "train_seconds": self.train_seconds,
            "eval_seconds": result["seconds"],
            "checkpoint_seconds": self.checkpoint_seconds,
            "output_seconds": files_seconds,
            "data_seconds": data_seconds,
            "rays_per_second": self.rays_done / seconds if self.train_seconds > 0 else None,
            "pixels_per_second": self.pixels_done / seconds if self.train_seconds > 0 else None,
            "ops": dict(self.ops.backends),
            "device": describe_device(self.device),
            "seed": self.seed,
            "resolution": [self.eval_scene.height, self.eval_scene.width],
            "data": self.cfg.data.name,
            "eval_split": self.eval_scene.split,
            "eval_views": self.eval_scene.num_views,
            "train_views": self.train_scene.num_views,
            "grid_shape": list(self.model.grid_shape),
            "grid_box": self.model.bbox.tolist(),
            "eval_history": self.eval_history,
            "render_only": render_only,
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }


# ---------------------------------------------------------------------------------------------- the program


def _config_from_checkpoint(cfg: DictConfig, saved: dict) -> DictConfig:
    """The run's config for resume / render_only: the checkpoint's ``data`` and ``model`` (what the weights were
    trained with) and everything else from the command line; a ``data.root`` given on the command line wins
    (the scene may have moved)."""
    current = OmegaConf.to_container(cfg, resolve=True)
    merged = dict(current, data=dict(saved["data"]), model=dict(saved["model"]))
    if current["data"].get("root") and merged["data"].get("name") == current["data"].get("name"):
        merged["data"]["root"] = current["data"]["root"]
    for group in ("data", "model"):
        changed = sorted(k for k in set(current[group]) | set(merged[group])
                         if current[group].get(k) != merged[group].get(k))
        if changed:
            print(f"note: using the checkpoint's {group} config (differs from this command at "
                  f"{', '.join(f'{group}.{k}' for k in changed)})")
    return OmegaConf.create(merged)


def _load_run_checkpoint(cfg: DictConfig, paths: RunPaths) -> dict | None:
    if cfg.render_only:
        key = "render_only"
    elif cfg.train.resume:
        key = "train.resume"
    else:
        return None
    if not paths.checkpoint.is_file():
        raise RunError(f"{key}: no checkpoint at {paths.checkpoint} (pass the hydra.run.dir of a run that saved one)")
    state = load_checkpoint(paths.checkpoint, map_location="cpu")
    missing = {"format", "step", "model", "optimizer", "rng", "sampler_generator", "config"} - set(state)
    if missing:
        raise CheckpointError(f"{paths.checkpoint}: not a trainer checkpoint (missing {', '.join(sorted(missing))})")
    return state


def _refuse_to_overwrite(cfg: DictConfig, paths: RunPaths) -> None:
    """A new run (no resume, no render_only) never replaces a run folder's checkpoint or metrics silently."""
    if cfg.render_only or cfg.train.resume or cfg.train.get("overwrite", False):
        return
    existing = [p for p in (paths.checkpoint, paths.metrics) if p.exists()]
    if existing:
        names = " and ".join(str(p.relative_to(paths.root)) for p in existing)
        raise RunError(f"hydra.run.dir: {paths.root} already holds a run ({names}); pass train.resume=true to continue "
                       "it, train.overwrite=true to replace it, or choose another hydra.run.dir")


def _main(cfg: DictConfig, paths: RunPaths) -> int:
    validate_config(cfg)
    _refuse_to_overwrite(cfg, paths)
    removed = remove_stale_temporaries(paths.checkpoint)
    if removed:
        print(f"removed {removed} unfinished checkpoint file(s) left by an interrupted save in {paths.checkpoint.parent}")
    state = _load_run_checkpoint(cfg, paths)
    cfg = _config_from_checkpoint(cfg, state["config"]) if state is not None else \
        OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    if state is not None:
        validate_config(cfg)
    try:
        parse_model_config(cfg.model)
        ops = build_ops(cfg.ops)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    device = resolve_device(cfg.device)
    seed = seed_everything(state["seed"] if state is not None else cfg.seed)

    data_start = time.perf_counter()
    try:
        train_scene, eval_scene = load_scenes(cfg.data, device)
    except ValueError as error:  # option checks of the loader / generator (SceneError is about the files)
        raise ConfigError(f"data: {error}") from None
    data_seconds = time.perf_counter() - data_start
    print(f"data: {cfg.data.name} {train_scene.width}x{train_scene.height}, {train_scene.num_views} train / "
          f"{eval_scene.num_views} {eval_scene.split} views ({data_seconds:.1f} s); device {describe_device(device)}; "
          f"ops {ops.backends}")

    extent = tuple(float(e) for e in (train_scene.bbox[1] - train_scene.bbox[0]).tolist())
    try:
        run_preflight(paths.root, device, extent, int(cfg.model.resolution_end), int(cfg.model.feature_dim),
                      eval_scene.num_views, eval_scene.height, eval_scene.width, training=not cfg.render_only)
    except PreflightError as error:
        raise RunError(str(error)) from None
    grid_box = None
    if cfg.data.get("tight_box", False):
        if train_scene.alpha is None:
            print("note: data.tight_box: the training images have no alpha; the grids use the whole scene box")
        else:
            grid_box = mask_hull_box(train_scene).cpu()
            print(f"grid box from the training masks (data.tight_box): {[round(v, 3) for v in grid_box[0].tolist()]} .. "
                  f"{[round(v, 3) for v in grid_box[1].tolist()]}")
    trainer = Trainer(cfg, paths, device, ops, train_scene, eval_scene, seed, grid_box)
    if state is not None:
        trainer.restore(state, with_training_state=not cfg.render_only)
        print(f"loaded {paths.checkpoint} (step {trainer.step})")
    if not cfg.render_only:
        code = trainer.fit()
        if code != EXIT_OK:
            return code
    metrics = trainer.write_outputs(bool(cfg.render_only), data_seconds)
    print(f"eval on {metrics['eval_views']} {metrics['eval_split']} views: PSNR {metrics['psnr']:.2f} dB "
          f"(worst 10% of views {metrics['psnr_worst10']:.2f} dB), SSIM {metrics['ssim']:.4f}; {metrics['iters']} steps in {metrics['train_seconds']:.1f} s of training; "
          f"wrote {paths.metrics}")
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
    messages also go to ``run_dir/train.log`` (when the folder is writable)."""
    log_path = Path(run_dir) / "train.log"
    try:
        log = open(log_path, "a", encoding="utf-8")
    except OSError:
        return _run(cfg, run_dir)  # a read-only folder: the preflight check says so in one line
    stdout, stderr = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _LogTee(stdout, log), _LogTee(stderr, log)
    try:
        return _run(cfg, run_dir)
    finally:
        sys.stdout, sys.stderr = stdout, stderr
        log.close()


def _run(cfg: DictConfig, run_dir: str | os.PathLike) -> int:
    """Train and/or evaluate as ``cfg`` says, in ``run_dir``; returns the process exit code.

    0 success; 2 a bad config, scene or checkpoint (one line on stderr); 3 the loss diverged (the last good
    checkpoint is kept); 128 + signal number when SIGINT / SIGTERM stopped training (after a checkpoint).
    """
    try:
        return _main(cfg, RunPaths(Path(run_dir)))
    except (ConfigError, SceneError, CheckpointError, RunError) as error:
        message = " ".join(str(error).split())  # one line, whatever the source
        print(f"error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("error: interrupted (outside training: nothing to save)", file=sys.stderr)
        return 128 + 2
