"""A sampler's batches built by a CUDA graph (``train.batch_graph``).

Why: building a batch from its random numbers (pixel indices to views, rows and columns; the rays through them;
the colours and coverage gathered) is ~45 ATen calls a step, on a host that spends ~35-40 us on each (bench/README
"The host's floor"). Its shapes never change, so it is captured once and replayed.

How: the random numbers are drawn as before (the sampler's ``draw``: the same stream, so the same batches), copied
into the graph's static inputs, and the graph replays the sampler's ``build``. Every call returns the same static
tensors, overwritten by the next call: a step must be done with its batch before the next ``sample()`` is queued
(the trainer's loop is; a batch kept across steps must be cloned).
"""

from __future__ import annotations

import torch

from data.graph_capture import collection_paused


class GraphedSampler:
    """``sample()`` of a RaySampler or PatchSampler (anything with ``draw()`` and ``build(*draws)``) on CUDA, built
    by a graph captured at the first call; elsewhere the sampler's own ``sample()``."""

    WARMUP = 2  # eager builds on a side stream before the capture (lazy initialisation, as torch's docs advise)

    def __init__(self, sampler):
        self.sampler = sampler
        self.graph: torch.cuda.CUDAGraph | None = None
        self._inputs: tuple[torch.Tensor, ...] = ()
        self._batch = None

    def __getattr__(self, name: str):  # batch_size, scene, ...: the sampler's
        return getattr(self.sampler, name)

    def sample(self):
        draws = self.sampler.draw()
        if draws[0].device.type != "cuda":
            return self.sampler.build(*draws)
        if self.graph is None:
            self._capture(draws)
        for static, draw in zip(self._inputs, draws):
            static.copy_(draw)
        self.graph.replay()
        return self._batch

    def _capture(self, draws: tuple[torch.Tensor, ...]) -> None:
        self._inputs = tuple(draw.clone() for draw in draws)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.WARMUP):
                self.sampler.build(*self._inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with collection_paused(), torch.cuda.graph(self.graph):
            self._batch = self.sampler.build(*self._inputs)
