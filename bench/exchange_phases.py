"""A split step's phases between its exchanges, from a profiled kernel timeline (issue 33; bench/rank_alone.py).

Split by space, a rank's step is cut by four collectives: the optical depth in front (after the march and its
no-grad lookups), the sample counts (after the visible pass), the composite (after the forward), the gradients' sum
(after the backward); Adam and the next step's march run before the next one. Each is a barrier: every rank waits
for the slowest rank's phase before it. So S ranks step in the sum over the phases of the slowest rank's phase,
not in the slowest rank's whole step, and a cut that balances the step's total (the split's work cut) can
still leave each phase unbalanced, one rank slower before one exchange and another before the next.

How: bench/rank_alone.py launches a marker kernel (``torch.cuda._sleep``'s ``spin_kernel``, which nothing else in a
step launches) at every emulated exchange, and a longer one before each step; inside a CUDA graph the markers are
graph nodes like the rest. :func:`phase_times` reads the profiled kernels in time order and returns each step's
phases: the device time from one marker's end to the next one's start (its kernels and the gaps between them).
"""

from __future__ import annotations

import torch

MARKER = "spin_kernel"  # torch.cuda._sleep's kernel
STEP_CYCLES = 20_000  # the step's marker: ~10 us of spinning on an H100/H200, an exchange's spins 0 cycles (~2 us)
STEP_MARK_US = 5.0  # a marker at least this long starts a step
EXCHANGES = 4  # a replayed split step's collectives (module doc)
# the barrier phases, by the step's phases (0: from the step's start to the first exchange, ..., 4: from the last
# exchange to the next step's start): Adam and the batch before the next step's march join it, no exchange between
BARRIERS = ((4, 0), (1,), (2,), (3,))


def mark(step: bool = False) -> None:
    """A marker kernel on the current stream (CUDA only; captured with a graph where one is captured)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda._sleep(STEP_CYCLES if step else 0)


def phase_times(kernels: list[tuple[str, float, float]], exchanges: int = EXCHANGES) -> list[list[float]]:
    """Kernels as (name, start us, end us), in any order -> for each whole step (one step marker, then exactly
    ``exchanges`` exchange markers, then the next step's marker) its ``exchanges + 1`` phases in ms (module doc; one
    process: ``exchanges`` 0, its steps whole). Steps with another number of exchanges (an eager measuring step
    shares its counts once more) are left out."""
    steps, current = [], None  # current: (the step marker's end, [exchange markers' (start, end)])
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if MARKER not in name:
            continue
        if end - start < STEP_MARK_US:
            if current is not None:
                current[1].append((start, end))
            continue
        if current is not None and len(current[1]) == exchanges:
            bounds = [current[0], *(t for marker in current[1] for t in marker), start]
            steps.append([round((bounds[2 * k + 1] - bounds[2 * k]) / 1e3, 5) for k in range(exchanges + 1)])
        current = (end, [])
    return steps


def barrier_ms(ranks: list[list[float]]) -> float:
    """The split step that S ranks with these mean phases (ms, each rank's :func:`phase_times` averaged) take when
    every exchange waits for the slowest rank: the sum over :data:`BARRIERS` of the slowest rank's phase."""
    return sum(max(sum(rank[k] for k in barrier) for rank in ranks) for barrier in BARRIERS)


def kernel_timeline(profile) -> list[tuple[str, float, float]]:
    """A torch.profiler run's device kernels as (name, start us, end us)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.time_range.start, e.time_range.end) for e in profile.events() if e.device_type == cuda]


__all__ = ["BARRIERS", "EXCHANGES", "MARKER", "barrier_ms", "kernel_timeline", "mark", "phase_times"]
