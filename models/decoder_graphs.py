"""The per-sample decoder's forward and backward replayed from CUDA graphs (``model.decoder_graphs``).

Why: a training step is bound by the host on the H100 machines (a lego step launches ~190 kernels at ~35-40 us an
ATen call: bench/README "The host's floor"), and the decoder is ~35 of the forward's calls and ~40 of the
backward's. Replayed from a graph, its kernels cost the host a few calls.

How: a graph's shapes are fixed, the step's sample count is not. The rows are padded to one of 8 sizes per power
of two (:func:`graph_rows`: at most 12.5% more rows, their output dropped), and each size gets its own pair of
graphs (``torch.cuda.make_graphed_callables`` over the decoder's forward; the parameters are static inputs that
Adam updates in place between replays). The ``MAX_GRAPHS`` latest sizes are kept.

Memory: every size's graphs capture into one memory pool, so that the activations a forward keeps for its
backward are held once, not once a size (apart, the sizes of the early steps at 98304 rays a step held 124 GiB
and ran an H200 out of memory). Sharing is safe because a step replays one size's forward and then its backward,
and nothing a replay returns (colours, gradients) is read after the next size's replay. Above ``MAX_ROWS`` rows
the decoder runs as is: its kernels are long enough there that launches cost nothing, and the pool stays bounded.

Only where it applies: CUDA, training with gradients, per-sample shading without a per-image embedding, ray
directions without a gradient (no pose refinement), ``MIN_ROWS`` to ``MAX_ROWS`` rows, not while a whole step is
captured (``train.step_graph``); elsewhere the decoder runs as is.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict

import torch
import torch.nn as nn

from data.graph_capture import collection_paused
from models.decoder import SampleDecoder

MIN_ROWS = 1 << 12  # fewer rows: launches are not what a step waits for
MAX_ROWS = 1 << 22  # more rows: the kernels are what a step waits for (a lego step late in training shades ~1 M)
MAX_GRAPHS = 4
SIZES_PER_OCTAVE = 8


def graph_rows(count: int) -> int:
    """``count`` (>= 1) rounded up to one of 8 sizes per power of two (a multiple of 2^(bits - 4)); also a size
    ``models.decoder.padded_rows`` keeps, so the graphed decoder pads no further."""
    unit = 1 << max(count.bit_length() - 4, 0)
    return -(-count // unit) * unit


class _Shading(nn.Module):
    """The decoder's forward as a module of its own: one per padded size, all over the decoder's parameters."""

    def __init__(self, decoder: SampleDecoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, features: torch.Tensor, directions: torch.Tensor, ray: torch.Tensor) -> torch.Tensor:
        return self.decoder(features, directions, ray)


class DecoderGraphs:
    """``decoder(features (N, F), directions (B, 3), ray (N,) int64, views)`` -> (N, 3), from graphs where they apply
    (module doc) and from the decoder itself elsewhere: the same values up to float rounding."""

    def __init__(self, decoder: SampleDecoder):
        self.decoder = decoder
        self.graphs: OrderedDict[tuple, nn.Module] = OrderedDict()
        self.captures = 0  # graphs made so far (tests, profiles)
        self.replays = 0  # calls served from a graph
        self.pool = None  # the memory pool every size's graphs share (made at the first capture)

    def report(self) -> dict:
        """For metrics.json: graphs captured (each new size: three warm-up passes and a capture) and calls replayed."""
        return {"captures": self.captures, "replays": self.replays}

    def applies(self, features: torch.Tensor, directions: torch.Tensor, views: torch.Tensor | None) -> bool:
        """Whether this call can replay a graph (see the module doc)."""
        return (
            features.is_cuda
            and torch.is_grad_enabled()
            and self.decoder.training
            and (views is None or self.decoder.appearance.embedding_dim == 0)
            and not directions.requires_grad
            and MIN_ROWS <= features.shape[0] <= MAX_ROWS
            and not torch.cuda.is_current_stream_capturing()  # inside a captured step (training.step_graph): as is
        )

    def __call__(
        self, features: torch.Tensor, directions: torch.Tensor, ray: torch.Tensor, views: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.applies(features, directions, views):
            return self.decoder(features, directions, ray, views)
        count, rows = features.shape[0], graph_rows(features.shape[0])
        padded = nn.functional.pad(features, (0, 0, 0, rows - count))
        index = nn.functional.pad(ray, (0, rows - count))  # ray 0: a valid row; the padding's output is dropped
        self.replays += 1
        return self._graph(padded, directions, index)(padded, directions, index)[:count]

    def _graph(self, features: torch.Tensor, directions: torch.Tensor, ray: torch.Tensor) -> nn.Module:
        """The graphed shading for these shapes (and the decoder's current parameter storage), made if new."""
        parameters = tuple(p.data_ptr() for p in self.decoder.parameters())
        key = (tuple(features.shape), features.dtype, tuple(directions.shape), parameters)
        graphed = self.graphs.pop(key, None)
        if graphed is None:
            graphed = _Shading(self.decoder).train(self.decoder.training)
            # the graphs' static inputs: their own buffers, into which each call copies its arguments
            sample = (features.detach().clone().requires_grad_(features.requires_grad), directions.clone(), ray.clone())
            # allow_unused_input: an affine appearance's parameters live in the decoder but act after it
            with collection_paused():
                graphed = torch.cuda.make_graphed_callables(graphed, sample, allow_unused_input=True, **self._pool())
            self.captures += 1
        self.graphs[key] = graphed  # the most recent last
        while len(self.graphs) > MAX_GRAPHS:
            self.graphs.popitem(last=False)
        return graphed

    def _pool(self) -> dict:
        """``pool=`` for the next capture: the pool every size shares (torch versions whose
        ``make_graphed_callables`` take no pool give each size its own)."""
        if "pool" not in inspect.signature(torch.cuda.make_graphed_callables).parameters:
            return {}
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return {"pool": self.pool}
