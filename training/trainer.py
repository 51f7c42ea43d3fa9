"""The training loop of one run: :class:`Trainer` owns the model, the optimiser, the batch sampler and the
run's counters; it steps, logs, evaluates periodically, and saves and restores checkpoints."""

from __future__ import annotations

import math
import sys
import time

import torch
from omegaconf import DictConfig, OmegaConf

from data import PatchSampler, RaySampler, Scene
from data.batch_graph import GraphedSampler
from data.samplers import PatchBatch
from models.model import VoxelNeRF
from models.ops import OpSet
from training import evaluation
from training.checkpoint import InterruptGuard, StepCheckpoints
from training.config import ConfigError, Settings
from training.distributed import Group
from training.evaluation import sync
from training.floors import adam_bytes
from training.losses import step_loss
from training.optim import SparseGridAdam, new_optimizer, prepare_for_whole_reads, rebuilt_optimizer
from training.profiler import StepProfiler
from training.progress import ProgressLog
from training.resume import restore_trainer
from training.run_checkpoints import RunCheckpoints
from training.run_dir import RunPaths, write_json
from training.sharded_adam import ShardedGridAdam
from training.space_parallel import split_for
from training.step_graph import StepGraph
from training.timing import process_seconds

EXIT_OK = 0
EXIT_DIVERGED = 3  # NaN / inf loss
LOSS_LIMIT = 1e3  # colours live in [0, 1]: a loss this large (PSNR -30 dB) is an exploding run, not a slow one
ADAM_BETAS = (0.9, 0.99)  # DirectVoxGO's: a shorter second-moment memory suits grids whose voxels see rays rarely


def learning_rate_factor(step: int, total_steps: int, final_factor: float) -> float:
    """Exponential decay from 1 at step 0 to ``final_factor`` (>= 0) at ``total_steps``."""
    return final_factor ** (min(step, total_steps) / max(total_steps, 1))


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

    def __init__(
        self,
        cfg: DictConfig,
        paths: RunPaths,
        device: torch.device,
        ops: OpSet,
        train_scene: Scene,
        eval_scene: Scene,
        seed: int,
        grid_box: torch.Tensor | None = None,
        group: Group | None = None,
    ):
        self.group = group or Group()  # training.distributed: this process's rank among the job's
        # cfg.train as a plain read-only dict: the step reads a dozen settings, without OmegaConf's cost per read
        self.cfg, self.train_cfg = cfg, Settings.of(cfg.train)
        self.paths, self.device, self.seed = paths, device, seed
        self.train_scene, self.eval_scene = train_scene, eval_scene
        self.iters = int(cfg.train.iters)
        profile = cfg.train.profile  # false | true | host (training.profiler)
        self.profiler = StepProfiler(device, bool(profile), synchronised=profile != "host")
        if device.type == "cuda":  # the per-sample decoder's matmuls dominate a step in fp32 (bench/README.md)
            torch.backends.cuda.matmul.allow_tf32 = bool(cfg.train.get("tf32", True))
        self.ops = ops
        model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
        self.model = VoxelNeRF(
            train_scene.bbox.cpu(),
            train_scene.near,
            train_scene.far,
            model_cfg,
            self.profiler.instrument_ops(ops),
            grid_box=grid_box,
        ).to(device)
        self.model.decoder.appearance.resize(train_scene.num_views)  # a code per training image (model.appearance)
        self.model.poses.resize(train_scene.num_views)  # a camera correction per training image (pose_refinement)
        self.scene_centre = train_scene.bbox.to(device, torch.float32).mean(0)  # for train.near_density_loss
        self.model.plan_fine(train_scene.pixel_footprint(self.model.bbox.mean(0)))  # model.fine.min_pixels
        self.profiler.instrument_decoding(self.model)
        if device.type == "cuda" and self.model.config.decoder_precision == "bfloat16":
            self.profiler.matmul_dtype = torch.bfloat16
        self._check_image_sizes()
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.sampler: RaySampler | PatchSampler | None = None  # built by fit(): render_only needs none
        self.space = split_for(self)  # under torchrun, train.parallel: this rank's slab of the voxels, or None
        self.rank_reports: list[dict] | None = None  # under torchrun: every rank's sample capacities and step graph
        self.optimizer = self._new_optimizer()
        self.step_graph = StepGraph.for_trainer(self)  # train.step_graph: the gradients replayed from a CUDA graph
        self.step = 0
        self.history: dict[str, list[float]] = {"step": [], "loss": [], "psnr": []}
        self.eval_history: list[dict] = []
        self.train_seconds = 0.0
        self.rays_done = 0
        self.pixels_done = 0
        self.samples_done = 0
        self.pending_samples: list[torch.Tensor] = []  # model.capped_samples: () counts on the device, read at logs
        self.checkpoint_seconds = 0.0  # kept out of train_seconds, reported beside it
        self.last_saved_step: int | None = None
        self.step_checkpoints: StepCheckpoints | None = None  # train.keep_checkpoints > 1: built at the first save
        self.checkpoints = RunCheckpoints(self)  # last.pt written behind training; model.pt at the end
        self.periodic_eval_seconds = 0.0  # the held-out evaluations during training (train.eval_every)
        self.startup_seconds: float | None = None  # process start to the first step (imports, data, set-up)
        self.pending_writes: list = []  # (path, future) of the render writes in flight
        self.viewer = None  # training.viewer.Viewer with train.viewer=true (set by training.app)

    # ---------------------------------------------------------------- building blocks
    def _check_image_sizes(self) -> None:
        scale = self.model.upsample
        for scene in (self.train_scene, self.eval_scene):
            for height, width in {scene.view_size(view) for view in range(scene.num_views)}:
                if height % scale or width % scale:
                    raise ConfigError(
                        f"model.upsample: the {scene.split} images ({height}x{width}) are not divisible by "
                        f"{scale} (change model.upsample or data.downscale)"
                    )

    def _build_sampler(self) -> RaySampler | PatchSampler:
        # patches for the image-space decoder (upsample > 1) or for D-SSIM, whose window needs neighbouring pixels
        if self.model.upsample == 1 and not float(self.train_cfg.get("dssim", 0.0)) > 0:
            jitter = bool(self.train_cfg.get("pixel_jitter", False))
            return RaySampler(self.train_scene, self.train_cfg.batch_rays, self.generator, pixel_jitter=jitter)
        try:
            return PatchSampler(
                self.train_scene,
                self.train_cfg.patch_size,
                self.model.upsample,
                self.train_cfg.patches_per_batch,
                self.generator,
            )
        except ValueError as error:
            raise ConfigError(f"train.patch_size: {error}") from None

    def _new_optimizer(self) -> torch.optim.Optimizer:
        """Adam over the grids and the decoder as ``train.sparse_adam`` asks (training.optim)."""
        return new_optimizer(self, ADAM_BETAS)

    def _rebuild_optimizer(self) -> None:
        """New Adam over the model's current parameters, keeping the moments of parameters that survived."""
        self.optimizer = rebuilt_optimizer(self, ADAM_BETAS)

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
                batch = self.sampler.sample()  # the global batch: every rank draws the same one
                shard = self.group.active and self.space is None  # data-parallel: this rank's share of the rays
                batch = batch.shard(self.group.rank, self.group.world) if shard else batch
                background, target = self._training_background(batch)
            if self.step_graph is not None:  # replayed where it applies (training.step_graph)
                loss, mse, samples = self.step_graph(batch, background, target)
            else:
                loss, mse, samples = self._gradients(batch, background, target, True)
            with profiler.section("optimizer"):
                self.optimizer.step()
                if self.space is not None:  # the shared planes' gradient kept by one owner alone
                    self.space.clear_upper_planes()
            if profiler.enabled and not isinstance(self.optimizer, SparseGridAdam):  # dense only
                profiler.count("optimizer", bytes=adam_bytes(p for p in self.model.parameters() if p.grad is not None))
            self.step += 1
            with profiler.section("schedule"):
                if self.model.on_step(self.step, self.iters):
                    if self.space is not None:  # new grids: the slabs' planes cut again (training.space_parallel)
                        self.space.balance()
                    self._rebuild_optimizer()
        shards = self.group.world if self.space is None else 1  # data-parallel ranks each stepped a share
        rays = batch.origins.numel() // 3 * shards  # the job's rays
        self.rays_done += rays
        self._count_samples(samples)
        self.pixels_done += batch.rgb.numel() // 3 * shards
        profiler.end_step(rays)
        return loss.detach(), mse.detach()

    def _gradients(self, batch, background: torch.Tensor | None, target: torch.Tensor, zero_grad: bool):
        """A step's forward, loss, backward and gradient exchange -> (loss, mse, composited samples or None), without
        syncing the device; ``zero_grad``: clear the gradients first (training.step_graph's replays do not)."""
        profiler = self.profiler
        # the TV estimate before the forward: a replaying Adam catches up the rows it reads in place, which
        # must not happen to a grid the forward's lookups have already saved for their backward; through
        # ops.sampled_tv only its cells are drawn here, and it runs after the backward (models/grid_tv.py)
        with profiler.section("regularization"):
            regularization = self.model.regularization(defer=True)
        with profiler.section("forward"):
            if isinstance(batch, PatchBatch):
                out = self.model.render_patches(batch, background)
            else:
                out = self.model.render_rays(batch.origins, batch.directions, background, batch.jitter, batch.views)
        with profiler.section("loss_backward"):
            loss, mse = step_loss(out, batch, target, regularization, self.train_cfg, self.model, self.scene_centre)
            if zero_grad:
                self.optimizer.zero_grad(set_to_none=True)
            (loss if self.space is None else loss / self.group.world).backward()  # space: see models.space_split
            self.model.row_grads.scatter()  # model.tv_sparse_grad: the TV rows' gradients onto the grids'
        with profiler.section("tv_gradient"):
            deferred = self.model.deferred_regularization()  # the TV's value, its gradient added in place
            loss = loss if deferred is None else loss.detach() + deferred
        with profiler.section("grad_sync"):  # under torchrun: the ranks' gradients combined
            self._sync_gradients()
        return loss, mse, out.get("samples")

    def _count_samples(self, count: torch.Tensor | None) -> None:
        """Add a step's composited samples: a host count at once, a device one (model.capped_samples) on the device
        until :meth:`_settle_counts` (no sync)."""
        if count is None:
            return
        if count.device.type == "cpu":
            self.samples_done += int(count)
        else:  # kept as they are: no launch a step
            self.pending_samples.append(count)

    def _settle_counts(self) -> None:
        """At a log step (the device is synced there anyway): the device's sample counts, and the capacities'
        review (models/capacities.py)."""
        if self.pending_samples:
            self.samples_done += int(torch.stack(self.pending_samples).sum())
            self.pending_samples = []
        if self.model.capacities is not None:
            self.model.capacities.review()

    def _sync_gradients(self) -> None:
        """Under torchrun: the gradients averaged over the ranks' shares of the rays (data-parallel), or combined
        over their halves of the voxels (``train.parallel=space``)."""
        if self.space is not None:  # the decoder's summed, the grids' shared plane
            self.space.sync_gradients()
            return
        grids = [self.model.density.grid, self.model.features.grid]  # row-sparse: voxels touched
        sharded = isinstance(self.optimizer, ShardedGridAdam)  # it reduce-scatters the grids itself
        sync_mode = "sharded" if sharded else self.train_cfg.get("dist_grad_sync", "touched")
        touched = self.group.active and self.model.touched.enabled  # the touched-rows sync reads the marks
        marks = self.model.touched.mask(self.model.grid_shape) if touched else None
        self.group.average_model_gradients(self.model, grids, sync_mode, marks)

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
            if cfg.get("batch_graph", False) and self.device.type == "cuda":  # the batch built by a CUDA graph
                self.sampler = GraphedSampler(self.sampler)
        self.model.train()
        self.profiler.recording = True
        progress = ProgressLog(self)
        self.tensorboard = progress.tensorboard  # the periodic evaluations write theirs too
        code = EXIT_OK
        with InterruptGuard() as guard:
            self.group.barrier()  # the ranks start the clock together: a wait for another rank's set-up is not training
            sync(self.device)
            self.startup_seconds = process_seconds() if self.startup_seconds is None else self.startup_seconds
            segment_start = time.perf_counter()
            progress.restart()
            while self.step < self.iters:
                loss, mse = self.train_step()
                step = self.step
                pause = False
                stop = guard.requested and not self.group.active  # under torchrun: agreed on at log steps
                if step % cfg.log_every == 0 or step == self.iters:
                    # syncs the device; under torchrun one all-reduce, so that every rank takes the same decisions
                    loss_value, mse_value, requested = self.group.mean(loss.item(), mse.item(), float(guard.requested))
                    stop = requested > 0
                    if not (math.isfinite(loss_value) and math.isfinite(mse_value)) or loss_value > LOSS_LIMIT:
                        code = self._diverged(step, loss_value)
                        break
                    self._settle_counts()
                    progress.log(step, loss_value, mse_value)
                periodic_checkpoint = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < self.iters
                periodic_eval = cfg.eval_every and step % cfg.eval_every == 0 and step < self.iters
                if periodic_checkpoint or periodic_eval or stop:
                    sync(self.device)
                    self.train_seconds += time.perf_counter() - segment_start
                    pause = True
                if periodic_eval:  # a whole-grid read, on every rank alike (a replaying Adam catches up)
                    self.model.touched.before_whole_read()
                if periodic_eval and not stop:  # every rank renders its share of the views; rank 0 reports
                    # before a same-step checkpoint, whose host copy held it up (H100: 3.0 s, not 0.04 s)
                    eval_start = time.perf_counter()
                    evaluation.periodic_eval(self)  # ends on a host sync (its scores)
                    self.periodic_eval_seconds += time.perf_counter() - eval_start
                if periodic_checkpoint or stop:
                    self._gather_optimizer_state()
                    if not self.checkpoints.save_if_finite(loss, bool(periodic_checkpoint), background=not stop):
                        code = self._diverged(step, loss.item())
                        break
                if stop:
                    progress.close()
                    print(
                        f"interrupted by {guard.signum.name if guard.signum else 'a signal to another rank'} "
                        f"at step {step}/{self.iters}: checkpoint saved to "
                        f"{self.paths.checkpoint}; continue with train.resume=true and the same hydra.run.dir",
                        file=sys.stderr,
                    )
                    self.profiler.recording = False
                    return guard.exit_code or 128 + 15  # another rank's signal: as SIGTERM
                if pause:
                    segment_start = time.perf_counter()
                    progress.restart()
                if self.viewer is not None:  # bounded per-step work; the time paused there is not training time
                    paused = self.viewer.on_step(self, lambda: guard.requested)
                    segment_start += paused
                    progress.pause(paused)
            else:
                sync(self.device)
                self.train_seconds += time.perf_counter() - segment_start
        self.profiler.recording = False
        progress.close()
        if code != EXIT_OK:
            return code
        finite = bool(torch.isfinite(loss)) and all(bool(torch.isfinite(p).all()) for p in self.model.parameters())
        if not self.group.minimum(int(finite)):  # agreed (split by space a rank holds its own slab's values only)
            return self._diverged(self.step, loss.item())
        self._gather_optimizer_state()
        if self.group.active:  # every rank's sample capacities and step graph, for metrics
            self.rank_reports = self.group.objects(evaluation.rank_report(self))
        self.checkpoints.finish()  # model.pt; last.pt only with train.keep_resumable
        if self.profiler.enabled:  # every rank's own: profile.json on rank 0, profile_rank<r>.json on the others
            report = self.profiler.report()
            rank = self.group.rank if self.group.active else 0
            write_json(self.paths.profile.with_name(f"profile_rank{rank}.json") if rank else self.paths.profile, report)
            if rank == 0:
                print(StepProfiler.format(report))
        return EXIT_OK

    def _diverged(self, step: int, loss: float) -> int:
        self.checkpoints.wait()  # the write in flight decides which step is on disk
        kept = (
            f"the last good checkpoint (step {self.last_saved_step}) is kept at {self.paths.checkpoint}"
            if self.last_saved_step is not None
            else "no checkpoint was written"
        )
        kind = "exploding" if math.isfinite(loss) else "not finite"
        print(
            f"error: training diverged: loss is {loss} at step {step} ({kind}); stopped, {kept} "
            "(likely cause: a learning rate too high for this scene: try a lower train.lr / train.lr_decoder)",
            file=sys.stderr,
        )
        return EXIT_DIVERGED

    # ---------------------------------------------------------------- checkpoints
    def save(self, periodic: bool = False) -> None:
        """Write the resumable checkpoint now and wait for it (training.run_checkpoints: the loop's saves run
        behind training)."""
        self._gather_optimizer_state()
        self.checkpoints.save(periodic, background=False)

    def _gather_optimizer_state(self) -> None:
        """Before a save, on every rank: the optimiser's state whole and current (training.optim)."""
        prepare_for_whole_reads(self.optimizer)
        if self.space is not None:  # every rank's slab of the grids and their moments, for rank 0's checkpoint
            self.space.gather(moments=True)

    def restore(self, state: dict, with_training_state: bool) -> None:
        """Load a checkpoint (training.resume.restore_trainer)."""
        restore_trainer(self, state, with_training_state)
        if self.space is not None:  # every rank's grids and moments whole: the planes cut for them
            self.space.balance()

    # ---------------------------------------------------------------- evaluation
