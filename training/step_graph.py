"""A training step's gradients replayed from one CUDA graph (``train.step_graph``; issue 33).

Why: a lego step launches ~200 kernels through ~300 ATen calls; on one GPU the kernels cover the host's time, but a
rank of the space split (``train.parallel=space``) has about half the kernels and the whole host cost, so its host
sets the pace (bench/README "Four GPUs, the S-rank split timed"). Replayed from a graph, the forward, the loss, the
backward and the ranks' exchanges cost the host one launch.

How: with ``model.capped_samples`` every tensor of a step keeps its size between two events that change how many
samples a ray gets (the capacities' measuring march after an occupancy refresh or a growth; an overflow or a shrink
of a capacity). The graph is keyed by those sizes and by what else it reads as fixed (the optimiser's gradients, the
batch's tensors, whether the TV is still on); when the key changes the step runs eagerly once on the capture stream
(lazy initialisation, as torch's docs advise) and the next step with the same key is captured, then replayed.
What a step changes on the host stays eager around the replay: the batch (its own graph, ``train.batch_graph``),
the learning rates and Adam (numbers a step), the schedule, and the capacities' check of the step's true counts.

Gradients: the step's ``zero_grad`` runs once before the capture. The decoder's gradients are then the graph's own
tensors, which every replay writes (autograd assigned them at the capture); the grids' are kept tensors that the
lookups add onto and Adam leaves zero (cuda_ext.kept_grad), so a replay must not be preceded by another zero_grad.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields, is_dataclass, replace

import torch

Gradients = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (batch, background, target, zero_grad)


def _inputs(batch, background: torch.Tensor | None, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """The step's input tensors by name: the batch's tensor fields, the background, the target."""
    named = {f.name: getattr(batch, f.name) for f in fields(batch)} if is_dataclass(batch) else {}
    named |= {"_background": background, "_target": target}
    return {name: tensor for name, tensor in named.items() if isinstance(tensor, torch.Tensor)}


class StepGraph:
    """``gradients(batch, background, target, zero_grad)`` -> (loss, mse, samples), replayed from a graph where
    :meth:`applies`; the capacities (models/capacities.py) told of every replay's counts."""

    def __init__(self, model, optimizer_fn: Callable[[], torch.optim.Optimizer], gradients: Gradients):
        self.model, self.optimizer_fn, self.gradients = model, optimizer_fn, gradients
        self.graph: torch.cuda.CUDAGraph | None = None
        self.key: tuple | None = None  # what the graph was captured for
        self.warm: tuple | None = None  # the key and the inputs' addresses of the last eager step on the stream
        self.stream: torch.cuda.Stream | None = None
        self.inputs: dict[str, torch.Tensor] = {}  # the graph's inputs (the batch's own when it stays in place)
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.counts: tuple = ()  # the capacities' true counts of a replay (the graph's tensors)
        self.captures = 0
        self.replays = 0

    @staticmethod
    def for_trainer(trainer) -> StepGraph | None:
        """The trainer's, with ``train.step_graph`` where it applies: CUDA, capped samples, one process or the space
        split (data-parallel ranks exchange the rows they touched, a count a step), no profiler (its sections time
        the step's parts); else None."""
        if not trainer.train_cfg.get("step_graph", False) or trainer.device.type != "cuda":
            return None
        one_or_split = trainer.space is not None or not trainer.group.active
        if trainer.model.capacities is None or not one_or_split or trainer.profiler.enabled:
            return None
        return StepGraph(trainer.model, lambda: trainer.optimizer, trainer._gradients)

    def applies(self, device: torch.device) -> bool:
        """A step can be captured: CUDA, capped samples measured, no fine-grid collection or touched-row marks (host
        bookkeeping a step)."""
        capacities = self.model.capacities
        return (
            device.type == "cuda"
            and capacities is not None
            and not capacities.measuring
            and not (self.model.fine.collecting and self.model.training)
            and not self.model.touched.enabled
        )

    def _key(self, inputs: dict[str, torch.Tensor]) -> tuple:
        capacities, model = self.model.capacities, self.model
        return (
            capacities.generation,
            tuple(capacities.sizes.values()),
            id(self.optimizer_fn()),
            model.progress > model.config.tv_until,
            tuple((name, t.shape, t.dtype) for name, t in inputs.items()),
            tuple((p.data_ptr(), p.shape) for p in model.parameters()),
        )

    def __call__(self, batch, background: torch.Tensor | None, target: torch.Tensor):
        given = _inputs(batch, background, target)
        key = self._key(given)
        if key == self.key:  # the inputs into the graph's, unless they are the graph's (a batch built in place)
            for name, tensor in given.items():
                if tensor is not self.inputs[name]:
                    self.inputs[name].copy_(tensor)
            return self._replay()
        self.graph, self.key, self.outputs, self.counts = None, None, (), ()  # its memory goes with it
        self.stream = self.stream or torch.cuda.Stream()
        addresses = [t.data_ptr() for t in given.values()]
        if self.warm is None or self.warm[0] != key:
            self.warm = (key, addresses)  # this step eagerly, on the capture stream; the next one is captured
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                out = self.gradients(batch, background, target, True)
            torch.cuda.current_stream().wait_stream(self.stream)
            return out
        if addresses != self.warm[1]:  # inputs made anew each step: the graph reads copies of them
            given = {name: tensor.clone() for name, tensor in given.items()}
            batch = replace(batch, **{n: t for n, t in given.items() if not n.startswith("_")})
            background, target = given.get("_background"), given["_target"]
        return self._capture(key, given, batch, background, target)

    def _capture(self, key: tuple, given: dict[str, torch.Tensor], batch, background, target):
        self.inputs = given
        self.optimizer_fn().zero_grad(set_to_none=True)  # once: every replay writes the same gradients (module doc)
        self.graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(self.graph, stream=self.stream):
            self.outputs = self.gradients(batch, background, target, False)
        torch.cuda.current_stream().wait_stream(self.stream)
        self.counts = self.model.capacities.take_captured()
        self.key = key
        self.captures += 1
        return self._replay()

    def report(self) -> dict:
        """For metrics.json: graphs captured, steps replayed."""
        return {"captures": self.captures, "replays": self.replays}

    def _replay(self):
        self.graph.replay()
        self.replays += 1
        self.model.capacities.observe(*self.counts)
        loss, mse, samples = self.outputs
        return loss, mse, samples.clone()  # the trainer keeps a step's count until its log step


__all__ = ["StepGraph"]
