"""A training step's gradients replayed from one CUDA graph (``train.step_graph``; issue 33).

Why: a lego step launches ~200 kernels through ~300 ATen calls; on one GPU the kernels cover the host's time, but a
rank of the space split (``train.parallel=space``) has about half the kernels and the whole host cost, so its host
sets the pace (bench/README "Four GPUs, the S-rank split timed"). Replayed from a graph, the forward, the loss, the
backward and the ranks' exchanges cost the host one launch.

How: with ``model.capped_samples`` every tensor of a step keeps its size while the sample capacities hold. The graph
is keyed by those sizes and by what else it reads as fixed: the parameters' and buffers' addresses (the occupancy
mask is rebuilt in place), the optimiser (its gradients), the batch's tensors, whether the TV is still on, and the
split's planes. An occupancy refresh makes one eager, synchronising step (the capacities' measurement); when it
keeps the sizes (models/capacities.py), the graph is kept too. On a new key the step is captured and replayed; the
run's first capture follows one eager step on the capture stream (lazy initialisation, as torch's docs advise).
What a step changes on the host stays eager around the replay: the batch (its own graph, ``train.batch_graph``),
the learning rates and Adam (numbers a step), the schedule, and the capacities' check of the step's true counts.

Gradients: the step's ``zero_grad`` runs once before the capture. The decoder's gradients are then the graph's own
tensors, which every replay writes (autograd assigned them at the capture); the grids' are kept tensors that the
lookups add onto and Adam leaves zero (cuda_ext.kept_grad), so a replay must not be preceded by another zero_grad,
and an eager step between replays zeroes them in place rather than dropping them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace

import torch

from cuda_ext.kept_grad import is_kept
from data.graph_capture import capturing
from training.profiler import StepProfiler

Gradients = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (batch, background, target, zero_grad)


def _inputs(batch, background: torch.Tensor | None, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's input tensors by name: the batch's tensor fields, the background, the target."""
    named = {f.name: getattr(batch, f.name) for f in fields(batch)} if is_dataclass(batch) else {}
    named |= {"_background": background, "_target": target}
    return {name: tensor for name, tensor in named.items() if isinstance(tensor, torch.Tensor)}


class StepGraph:
    """``gradients(batch, background, target, zero_grad)`` -> (loss, mse, samples), replayed from a graph where
    :meth:`applies`; the capacities (models/capacities.py) told of every replay's counts."""

    def __init__(
        self,
        model,
        optimizer_fn: Callable[[], torch.optim.Optimizer],
        gradients: Gradients,
        graph_key: Callable[[], tuple] = tuple,
        profiler: StepProfiler | None = None,
    ):
        self.model, self.optimizer_fn, self.gradients, self.graph_key = model, optimizer_fn, gradients, graph_key
        self.profiler = profiler or StepProfiler(torch.device("cpu"), False)  # train.profile: the replays timed
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None  # what the graph was captured for
        self.warm: tuple | None = None  # the key of the last warm-up (the run's first capture follows one)
        self.addresses: list[int] = []  # the last step's inputs' (the same at the next: a batch built in place)
        self.stream: torch.cuda.Stream | None = None
        self.inputs: dict[str, torch.Tensor] = {}  # the graph's inputs (the batch's own when it stays in place)
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.counts: torch.Tensor | None = None  # the capacities' true (S, 3) counts of a replay (the graph's)
        self.captures = 0
        self.calls = 0  # steps asked for in this run
        self.captured_at: list[int] = []  # the steps (1-based in this run) that captured: the split's ranks stall there
        self.replays = 0
        self.eager_steps = 0  # measuring steps and the warm-up
        self.capture_seconds = 0.0  # the host's time in captures (the device idles meanwhile)

    @staticmethod
    def for_trainer(trainer) -> StepGraph | None:
        """The trainer's, with ``train.step_graph`` (or the split ``train.parallel=auto`` chose) where it applies:
        CUDA, capped samples, one process or the space split (data-parallel ranks exchange the rows they touched, a
        count a step); else None. Under ``train.profile`` the replays are timed as one part, ``step_graph``."""
        wanted = trainer.train_cfg.get("step_graph", False) if trainer.space is None else trainer.space.graphed
        if not wanted or trainer.device.type != "cuda":
            return None
        one_or_split = trainer.space is not None or not trainer.group.active
        if trainer.model.capacities is None or not one_or_split:
            return None
        graph_key = tuple if trainer.space is None else trainer.space.graph_key
        # the replays run the decoder inside the step's graph; what is left eager (the measuring steps, the warmup's
        # first ones) shades 0.7-6 M samples a step, whose kernels outlast their launches: there the decoder's own
        # graphs (model.decoder_graphs: three warm-up passes and a capture for each new size) cost more than they save
        trainer.model.decoder_graphs = None
        return StepGraph(trainer.model, lambda: trainer.optimizer, trainer._gradients, graph_key, trainer.profiler)

    def applies(self) -> bool:
        """A step can be captured: capped samples measured, no fine-grid collection or touched-row marks (host
        bookkeeping a step)."""
        capacities = self.model.capacities
        return (
            capacities is not None
            and not capacities.measuring
            and not (self.model.fine.collecting and self.model.training)
            and not self.model.touched.enabled
        )

    def _key(self, inputs: dict[str, torch.Tensor]) -> tuple:
        model = self.model
        return (
            tuple(model.capacities.sizes.values()),
            id(self.optimizer_fn()),
            model.progress > model.config.tv_until,
            tuple((name, t.shape, t.dtype) for name, t in inputs.items()),
            tuple((t.data_ptr(), t.shape) for t in (*model.parameters(), *model.buffers())),
            self.graph_key(),
        )

    def __call__(self, batch, background: torch.Tensor | None, target: torch.Tensor):
        self.calls += 1
        given = _inputs(batch, background, target)
        addresses = [t.data_ptr() for t in given.values()]
        in_place, self.addresses = addresses == self.addresses, addresses
        if not self.applies():
            return self._eager(batch, background, target)
        key = self._key(given)
        if key == self.key:  # the inputs into the graph's, unless they are the graph's (a batch built in place)
            for name, tensor in given.items():
                if tensor is not self.inputs[name]:
                    self.inputs[name].copy_(tensor)
            return self._replay()
        self.key, self.outputs, self.counts = None, (), None  # the graph stays until the next is captured in its pool
        self.stream = self.stream or torch.cuda.Stream()
        kept_without_grad = any(is_kept(p) and p.grad is None for p in self.model.parameters())
        if (self.captures == 0 or kept_without_grad) and self.warm != key:  # eagerly on the stream; the next captures
            self.warm = key
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                out = self._eager(batch, background, target)
            torch.cuda.current_stream().wait_stream(self.stream)
            return out
        if not in_place:  # inputs made anew each step: the graph reads copies of them
            given = {name: tensor.clone() for name, tensor in given.items()}
            batch = replace(batch, **{n: t for n, t in given.items() if not n.startswith("_")})
            background, target = given.get("_background"), given["_target"]
        return self._capture(key, given, batch, background, target)

    def _eager(self, batch, background, target):
        """A step off the graph. While a graph lives its gradient tensors stay the parameters' (zeroed in place)."""
        self.eager_steps += 1
        if self.graph is None:
            return self.gradients(batch, background, target, True)
        self.optimizer_fn().zero_grad(set_to_none=False)
        return self.gradients(batch, background, target, False)

    def _capture(self, key: tuple, given: dict[str, torch.Tensor], batch, background, target):
        started = time.perf_counter()
        self.inputs = given
        self.optimizer_fn().zero_grad(set_to_none=True)  # once: every replay writes the same gradients (module doc)
        # into the last graph's memory pool (it is never replayed again): its blocks serve again, no new allocations;
        # the pool must have a living graph (a pool whose graphs all went cannot take another capture)
        previous, self.graph = self.graph, torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with capturing(self.graph, self.stream, None if previous is None else previous.pool()):
            outputs = self.gradients(batch, background, target, False)
        del previous
        # detached: the capture's autograd graph (its AccumulateGrad nodes, made on the capture stream) goes now
        self.outputs = tuple(None if t is None else t.detach() for t in outputs)
        torch.cuda.current_stream().wait_stream(self.stream)
        self.counts = self.model.capacities.take_captured()
        self.key = key
        self.captures += 1
        self.captured_at.append(self.calls)
        self.capture_seconds += time.perf_counter() - started
        return self._replay()

    def report(self) -> dict:
        """For metrics.json: graphs captured, steps replayed, steps run eagerly, the host's seconds in captures, and
        the steps that captured (in the split a capture on one rank holds up the others: where they differ, each
        rank's cost them all)."""
        seconds = round(self.capture_seconds, 3)
        counts = {"captures": self.captures, "replays": self.replays, "eager": self.eager_steps}
        return {**counts, "capture_s": seconds, "captured_at": list(self.captured_at)}

    def release(self) -> None:
        """Destroy the graph once training is over. Under torchrun this must come before the process group goes: a
        graph that captured NCCL collectives holds its communicator, and ``ncclCommDestroy`` waits for every such
        graph to be destroyed (pytorch/pytorch#115388: the split's runs hung at exit while the trainer lived)."""
        if self.graph is not None:
            try:
                torch.cuda.synchronize()  # no replay still running when the graph's memory pool goes back
            except RuntimeError:  # a failed device or collective: the run is stopping with its own error
                pass
            self.graph.reset()
        self.graph, self.key, self.warm, self.outputs, self.counts, self.inputs = None, None, None, (), None, {}

    def _replay(self):
        with self.profiler.section("step_graph"):
            self.graph.replay()
        self.replays += 1
        self.model.capacities.observed(self.counts)
        loss, mse, samples = self.outputs
        return loss, mse, samples.clone()  # the trainer keeps a step's count until its log step


__all__ = ["StepGraph"]
