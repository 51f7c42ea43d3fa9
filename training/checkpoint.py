"""Checkpoints that survive crashes, RNG state capture, and graceful Ctrl-C / SIGTERM handling.

A checkpoint is a dict saved with ``torch.save``. Writes are atomic: the bytes go to a temporary file in
the destination folder, are flushed to disk, and only then renamed over the destination, so ``path``
always holds either the previous checkpoint or the new one, whole, even if the process is killed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import torch


def _umask() -> int:
    """The process umask, read without changing it where Linux tells (/proc), else by a set-and-restore."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


class CheckpointError(RuntimeError):
    """A checkpoint file is missing or unreadable; the message names the file."""


def save_checkpoint(path: str | os.PathLike, state: dict) -> None:
    """Atomically write ``state`` (a dict of tensors, state dicts and plain values) to ``path``.

    The parent folder is created if needed. On any error (including KeyboardInterrupt) the temporary file
    is removed and ``path`` is left as it was. A SIGKILL mid-write can leave a ``.<name>.*.tmp`` file
    behind, but never a partial file at ``path``.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as file:
            torch.save(state, file)
            file.flush()
            if hasattr(os, "fchmod"):
                os.fchmod(file.fileno(), 0o666 & ~_umask())  # mkstemp made it 0600
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        try:
            os.unlink(temp_name)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(path.parent)  # makes the rename itself durable


STEP_NAME = re.compile(r"step_(\d+)\.pt")


def step_checkpoint_name(step: int) -> str:
    """The file name of a kept periodic checkpoint: ``step_002000.pt`` (zero-padded, so names sort by step)."""
    return f"step_{step:06d}.pt"


def step_checkpoints(folder: str | os.PathLike) -> dict[int, Path]:
    """The kept periodic checkpoints in ``folder``: {step: path} of its ``step_<step>.pt`` files."""
    folder = Path(folder)
    if not folder.is_dir():
        return {}
    found = {}
    for path in folder.iterdir():
        match = STEP_NAME.fullmatch(path.name)
        if match and path.is_file():
            found[int(match.group(1))] = path
    return found


class StepCheckpoints:
    """``train.keep_checkpoints`` > 1: each periodic checkpoint is also kept as ``step_<step>.pt`` beside
    ``last.pt``, and only the newest ``keep - 1`` of them stay.

    :meth:`save` writes the step file atomically (:func:`save_checkpoint`), then points ``last.pt`` at the same
    bytes (a hard link renamed over it, atomic; where links are not supported, a second atomic write), and only
    then deletes the step files beyond the newest ``keep - 1``: a finished checkpoint is never deleted or
    replaced before the new one is whole, and a failed write leaves ``last.pt`` as it was. Step files are the
    run's own when this process wrote them or, on resume, when their step is at most the restored one
    (``adopt_upto``); others (a run that ``train.overwrite=true`` replaced) are deleted after the first save.
    """

    def __init__(self, folder: str | os.PathLike, keep: int, adopt_upto: int | None = None):
        if keep < 2:
            raise ValueError(f"keep must be >= 2 (last.pt and at least one step file), got {keep}")
        self.folder, self.keep, self.adopt_upto = Path(folder), keep, adopt_upto
        self.written: set[int] = set()
        for stale in self.folder.glob(".step_*.pt.*.tmp") if self.folder.is_dir() else ():  # a killed save's
            stale.unlink(missing_ok=True)

    def save(self, last: str | os.PathLike, state: dict, step: int) -> Path:
        """Write ``state`` as step ``step``'s file and as ``last``; prune the older step files. Returns the path."""
        path = self.folder / step_checkpoint_name(step)
        save_checkpoint(path, state)
        self.written.add(step)
        _link_or_write(path, Path(last), state)
        self.prune()
        return path

    def prune(self) -> list[Path]:
        """Delete the step files beyond the run's newest ``keep - 1`` (and other runs'); returns those deleted."""
        found = step_checkpoints(self.folder)
        own = sorted(s for s in found if s in self.written or (self.adopt_upto is not None and s <= self.adopt_upto))
        kept = set(own[-(self.keep - 1) :])
        removed = []
        for step, path in sorted(found.items()):
            if step in kept:
                continue
            try:
                path.unlink()
                removed.append(path)
            except FileNotFoundError:
                pass
            except OSError as error:  # the new checkpoint is safe: a file that stays is not worth stopping for
                print(f"warning: cannot delete the old checkpoint {path}: {error}", file=sys.stderr)
        return removed


def _link_or_write(source: Path, path: Path, state: dict) -> None:
    """Make ``path`` hold ``source``'s checkpoint atomically: a hard link under a temporary name renamed over
    ``path``, or (a file system without hard links) :func:`save_checkpoint` of ``state`` again."""
    temporary = path.parent / f".{path.name}.{os.getpid()}.link.tmp"  # remove_stale_temporaries' pattern
    try:
        temporary.unlink(missing_ok=True)
        os.link(source, temporary)
    except OSError:
        save_checkpoint(path, state)
        return
    try:
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def remove_stale_temporaries(path: str | os.PathLike) -> int:
    """Delete the ``.<name>.*.tmp`` files that a save killed mid-write (SIGKILL, power loss) left beside
    ``path``; returns how many. Call it before a run starts saving (they can be as large as a checkpoint)."""
    path = Path(path)
    if not path.parent.is_dir():
        return 0
    removed = 0
    for stale in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            stale.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _fsync_directory(folder: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):  # e.g. Windows: directories cannot be opened for fsync
        return
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: str | os.PathLike, map_location: Any = None, weights_only: bool = True) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint`.

    ``weights_only=True`` (the default) unpickles only tensors and plain containers, which is all that
    :func:`save_checkpoint` callers should store (state dicts, numbers, strings, :func:`capture_rng_state`).
    Raises :class:`CheckpointError` naming ``path`` if the file is missing, unreadable or not a dict.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint not found")
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint is not a file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as error:  # torch.load raises many types for damaged files (pickle, zip, EOF, Runtime)
        detail = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(error).__name__}: {detail})") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: checkpoint holds a {type(state).__name__}, expected a dict")
    return state


def capture_rng_state() -> dict:
    """Snapshot of every random generator training uses: Python, NumPy, torch CPU and each CUDA device.

    Stored as tensors and plain Python values so it round-trips through ``torch.load(weights_only=True)``.
    """
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_state(state: dict) -> None:
    """Restore generators from :func:`capture_rng_state` output (tensors may be on any device).

    CUDA states are restored for the devices present in both the snapshot and this machine; a mismatch
    in device count is warned about rather than fatal, so a run can resume on different hardware.
    """
    missing = {"python", "numpy", "torch"} - set(state)
    if missing:
        raise ValueError(f"state is missing RNG entries: {', '.join(sorted(missing))}")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # a loader may have turned the tuple into a list
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": numpy_state["bit_generator"],
            "state": {"key": numpy_state["key"].cpu().numpy().astype(np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"].cpu())
    cuda_states = list(state.get("cuda") or [])
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(cuda_states) != available and (cuda_states or available):
        warnings.warn(
            f"RNG snapshot has {len(cuda_states)} CUDA generator(s) but {available} device(s) are available; "
            "restoring the ones both have",
            RuntimeWarning,
            stacklevel=2,
        )
    for device, cuda_state in enumerate(cuda_states[:available]):
        torch.cuda.set_rng_state(cuda_state.cpu(), device)


class InterruptGuard:
    """Turn SIGINT / SIGTERM into a polite stop request while the ``with`` block runs.

    Inside the block the first SIGINT or SIGTERM only sets :attr:`requested` (and :attr:`signum`), so the
    training loop can finish its step, save a checkpoint and exit. A second Ctrl-C changes nothing (people
    press twice; a save in progress finishes and the run still stops with a checkpoint); a third raises
    KeyboardInterrupt (abort now, nothing saved). The previous handlers are restored on exit. Signal
    handlers can only be installed from the main thread.
    """

    ABORT_AFTER = 3  # SIGINTs

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.requested = False
        self.signum: signal.Signals | None = None
        self._interrupts = 0
        self._previous: dict[int, Any] | None = None

    def __enter__(self) -> InterruptGuard:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("InterruptGuard must be entered from the main thread (signal handlers live there)")
        if self._previous is not None:
            raise RuntimeError("InterruptGuard is already active")
        self.requested = False
        self.signum = None
        self._interrupts = 0
        self._previous = {sig: signal.getsignal(sig) for sig in self._SIGNALS}
        for sig in self._SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc_info) -> bool:
        previous, self._previous = self._previous, None
        for sig, handler in previous.items():
            # None means the handler was installed outside Python; the default is the closest we can restore
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        return False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts >= self.ABORT_AFTER:
                raise KeyboardInterrupt
        if not self.requested:
            self.requested = True
            self.signum = signal.Signals(signum)

    @property
    def exit_code(self) -> int:
        """Conventional shell exit status for the received signal (128 + number); 0 if none arrived."""
        return 128 + int(self.signum) if self.signum is not None else 0
