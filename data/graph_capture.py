"""CUDA graph captures that Python's garbage collector cannot break.

Why: ``torch.cuda.graph`` no longer collects garbage before a capture (only with
``torch.compiler.config.force_cudagraph_gc``), and the collector runs whenever allocations cross its threshold. If it
runs inside a capture and frees an unreachable CUDA graph (the decoder's graphs for an evicted size sit in reference
cycles: models/decoder_graphs.py), destroying that graph is an operation a capturing stream does not permit, and the
capture fails: "operation not permitted when stream is capturing (function reset)", then
``cudaErrorStreamCaptureInvalidated`` (lego with ``train.step_graph``, one H200, 2026-11-29: the first capture after
a growth, in every run). Collection waits until the capture is over. (In data/, the lowest layer, as the batch's
graph, data/batch_graph.py, captures too.)

:func:`capturing` also leaves out what ``torch.cuda.graph`` does before each capture: a device synchronisation (the
host then captures while the device idles, where it could still run the steps queued before) and the release of the
allocator's cached blocks (which later steps then allocate again). A graph captured again every few hundred steps
(training.step_graph) pays neither; each can capture into the last one's memory pool, as they never run at once.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

__all__ = ["collection_paused", "capturing"]


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside: wrap a CUDA graph's capture in it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, pool: tuple | None = None) -> Iterator[None]:
    """Capture what the block launches into ``graph`` on ``stream`` (which must wait for the work the graph reads),
    its memory from ``pool`` (a living graph's ``pool()``; None: its own); no collection, no synchronisation."""
    with collection_paused(), torch.cuda.stream(stream):
        graph.capture_begin(pool=pool)
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # the block's error, not the invalidated capture's
                graph.capture_end()
            raise
        graph.capture_end()
