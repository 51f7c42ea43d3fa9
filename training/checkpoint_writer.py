"""Checkpoints written behind training: a snapshot taken in a few milliseconds, written by a background thread.

:func:`snapshot` copies every tensor of a checkpoint's state (weights, optimiser moments, RNG states) where it
lies: on the GPU a device-side clone (a few ms for the ~5 GB of lego's grids and Adam moments, at copy
bandwidth), on the CPU a memory copy. Training then goes on changing its own tensors while
:class:`BackgroundWriter` copies the snapshot to host memory (on a CUDA stream of its own, ordered after the
clones by an event, so it never waits for later training kernels nor they for it) and writes it with
``training.checkpoint.save_checkpoint``: a temporary file, fsync, rename, so a kill -9 mid-write leaves the
previous checkpoint whole exactly as a synchronous save does.

One write is in flight at a time: a new :meth:`BackgroundWriter.submit` first joins the previous one. A failed
write is raised at the next :meth:`~BackgroundWriter.submit` or :meth:`~BackgroundWriter.wait` (the trainer
turns it into a one-line RunError); the thread is not a daemon, so an interpreter that exits while a write is
in flight still finishes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` (nested dicts / lists / tuples of tensors and plain values) with ``fn`` applied to every tensor;
    plain values (numbers, strings) are immutable and kept as they are."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: map_tensors(fn, item) for key, item in value.items()}
    if isinstance(value, list):
        return [map_tensors(fn, item) for item in value]
    if isinstance(value, tuple):
        return tuple(map_tensors(fn, item) for item in value)
    return value


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    try:
        return tensor.detach().clone(memory_format=torch.contiguous_format)
    except torch.cuda.OutOfMemoryError:  # no room for a device copy: a (blocking) host copy instead
        return tensor.detach().to("cpu", copy=True)


def snapshot(value: Any) -> Any:
    """A copy of ``value`` that later in-place updates of its tensors cannot reach: each tensor cloned on its own
    device (CUDA tensors fall back to a host copy when the device is out of memory)."""
    return map_tensors(_clone, value)


def to_host(value: Any) -> Any:
    """``value`` with every tensor on the CPU (those already there are passed through)."""
    return map_tensors(lambda tensor: tensor if tensor.device.type == "cpu" else tensor.to("cpu"), value)


def _devices(value: Any, found: set[torch.device]) -> set[torch.device]:
    map_tensors(lambda tensor: found.add(tensor.device) if tensor.device.type == "cuda" else None, value)
    return found


class BackgroundWriter:
    """Runs one write at a time on a background thread: ``submit(state, write)`` snapshots nothing itself (pass
    :func:`snapshot`'s result), copies ``state`` to the host and calls ``write(host_state)`` there.

    ``write_seconds`` sums the background time of the finished writes; ``wait`` returns how long the caller
    blocked. Not thread-safe itself: one owner (the training loop) calls it.
    """

    def __init__(self, name: str = "checkpoint-writer"):
        self.name = name
        self.write_seconds = 0.0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._label: Any = None

    @property
    def pending(self) -> bool:
        """True while a write is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, state: Any, write: Callable[[Any], None], label: Any = None) -> float:
        """Join the previous write (raising its error), then start writing ``state`` (a :func:`snapshot`) in the
        background. ``label`` (e.g. the step) is handed back by :meth:`wait` through ``finished``. Returns the
        seconds spent waiting for the previous write."""
        waited = self.wait()
        events = {}
        for device in _devices(state, set()):  # the copies start once the clones are done, on their own stream
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events[device] = event
        self._label = label
        self._thread = threading.Thread(target=self._run, args=(state, write, events), name=self.name, daemon=False)
        self._thread.start()
        return waited

    def _run(self, state: Any, write: Callable[[Any], None], events: dict) -> None:
        start = time.perf_counter()
        try:
            if events:
                device = next(iter(events))
                stream = torch.cuda.Stream(device)
                for event in events.values():
                    stream.wait_event(event)
                with torch.cuda.stream(stream):
                    host = to_host(state)  # each copy waits for its bytes on this stream, not the training one
            else:
                host = state
            del state  # the device copies go back to the allocator as soon as they are on the host
            write(host)
        except BaseException as error:  # re-raised in the owner's thread by wait()
            self._error = error
        finally:
            self.write_seconds += time.perf_counter() - start

    def wait(self) -> float:
        """Block until the write in flight (if any) is on disk; re-raise its error. Returns the seconds waited."""
        start = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        waited = time.perf_counter() - start
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return waited

    @property
    def label(self) -> Any:
        """The ``label`` of the last submitted write."""
        return self._label
