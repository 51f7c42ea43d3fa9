"""Fixed sample capacities for the training march (``model.capped_samples``): the march and the shading compaction
write into outputs of given sizes (``march_rays_capped``, ``visible_samples_capped``), so a step has no device sync
for their counts.

The sizes come from one synchronising step (the plain ops) after every event that changes how many samples a ray
gets (every step before the occupancy's warmup, an occupancy refresh, the grids' growth, the fine grid's arrival;
before the warmup the density forms and the samples shaded multiply from step to step: on one H200, lego runs whose
first two or three capped steps overflowed ended 0.2-0.4 dB from the plain march's, 2026-11-29): ``HEADROOM``
plus ``SPREAD`` over the root of the batch's rays times what it counted, rounded up to a size the decoder keeps
(``models.decoder.padded_rows``). Each capped step's true counts are copied to the host without a sync and checked
``LAG`` steps later (the host never runs further ahead than that): a count above its capacity (an
overflow: the last rays of that batch lost samples, and the shown samples past the capacity went unshaded) grows
that size at once to the capacity for ``GROWTH`` times the count, so an overflow spoils at most the few steps in
flight (early in a run the shown samples multiply as the density forms: checked only at log steps, lego lost 0.8
dB). Every ``WINDOW`` checked steps, a size above ``SHRINK`` times the capacity for the peak over them shrinks to
it, so the padding shaded and differentiated stays small as the samples per ray fall (lego: ~95 early, ~24 late;
the survivors of early termination fall fastest as the density forms). The padding is the capped step's cost:
every padding row is looked up, shaded and differentiated (lego, one H200, session 40: at HEADROOM 1.25 and SHRINK
1.5 the capped step was 24% slower than the plain one, at 1.06 and 1.15 6%); :meth:`SampleCapacities.report` gives
the run's mean fill (count / size) of each kind. Split by space (training.space_parallel) the ranks share their counts
(``share``) and size from the largest rank's, at the same steps: the same sizes everywhere, so that a rank's step
graph is captured again when the others' are (a capture holds every rank up), and the lighter ranks' extra padding
stays off the critical path (they wait for the largest at every exchange). With ``model.capped_refresh=observe`` (the
default; two H200s split by space, lego: 18.6 / 17.9 s against ``measure``'s 19.7 s in one call, same PSNR) an
occupancy refresh after the warmup has no measuring step (an eager step with its syncs, ~3x a replayed one in the
split): the capped steps go on at their sizes, and the first step checked after the refresh resizes them as a
measurement would, from its true counts (:meth:`SampleCapacities.refreshed`); only the ``LAG`` + 1 steps in flight
can overflow meanwhile, where a refresh moves the counts by more than the headroom. Before the warmup it measures
only while the shown samples rise; then the steps follow their own counts, each size kept until it is ``WARM_KEEP``
times what they need, so that one step graph (training.step_graph) serves several steps
(:meth:`SampleCapacities.schedule`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

import torch

from models.decoder import padded_rows

HEADROOM = 1.06  # every padding row is shaded: the least room over the counts a step is likely to reach
SPREAD = 3.0  # plus SPREAD / sqrt(rays): a batch's count varies with its rays' (CLT; a ray's count varies ~1x)
GROWTH = 2.0  # after an overflow: room for counts still rising
SHRINK = 1.15  # a size above SHRINK x the capacity for its window's peak shrinks to that
KEEP = 1.05  # a measurement keeps a size at most KEEP x its count's capacity (and the step graph for the sizes)
# before the occupancy's warmup (capped_refresh=observe) the counts fall at almost every step as the density forms: a
# size then stays until it is WARM_KEEP x its count's capacity, so that a step graph serves several steps (the split's
# eager warmup steps were its host's: two H200s, 12.5 ms a step against ~6 ms of kernels; replayed, lego's first 100
# steps take 13.6-15.6 ms against 17.7-20.6: bench/README "The warmup's steps replayed")
WARM_KEEP = 1.3
LAG = 2  # steps whose counts may still be on their way to the host
WINDOW = 20  # checked steps between two shrinks
KINDS = ("march", "alive", "shown")  # march_rays' samples, visible_samples' alive ones and shown ones


def headroom(count: float, rays: int | None = None) -> int:
    """The capacity for ``count`` samples of a batch of ``rays`` (None: many): (HEADROOM + SPREAD / sqrt(rays)) x,
    at least 1, rounded up to a size the decoder keeps (at most 1/64 more: models.decoder.padded_rows; the graphed
    decoder pads its rows further, to graph_rows'). Lego's 98304 rays: 1.07x; 64 rays: 1.44x."""
    spread = 0.0 if rays is None else SPREAD / math.sqrt(max(rays, 1))
    return padded_rows(max(math.ceil((HEADROOM + spread) * count), 1))


class SampleCapacities:
    """The three sizes (:data:`KINDS`), None until measured; :attr:`measuring` while the next march must count."""

    def __init__(self):
        self.sizes: dict[str, int] | None = None
        self.stale = True
        self.peak = [0, 0, 0]  # the largest counts of the steps checked since the last shrink
        self.checked = 0  # how many
        self.in_flight: collections.deque = collections.deque()  # (event, pinned (3,) counts, the sizes they had)
        self.overflows = 0  # steps whose counts were above a capacity
        self.overflowed_at: list[int] = []  # which: their place among the checked steps (1-based; the report: 50)
        self.overflows_reviewed = 0  # of them, those found by the last review
        self.shrinks = 0
        self.reviews = 0
        self.fill = [0.0, 0.0, 0.0]  # the checked steps' sums of count / size: the share of the rows not padding
        self.fills = 0  # how many (every checked step)
        self.rays: int | None = None  # the measured batch's rays
        self._captured: torch.Tensor | None = None  # a captured march's (S, 3) counts, observed after each replay
        # the space split (training.space_parallel): a (3,) count tensor -> (S, 3) every rank's, by rank; the sizes
        # then follow the largest, so that every rank holds the same sizes at the same steps (and its step graph is
        # captured again when the others' are: a capture holds them all up)
        self.share: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rank = 0  # this rank's row of the shared counts (its own fill)
        self.generation = 0  # occupancy refreshes that resize from the counts observed after them (refreshed)
        self.resized = 0  # the last generation resized so
        self.measurements = 0  # measuring steps (the report)
        self.shown: int | None = None  # the last measurement's shown samples (every rank's largest)
        self.falling = False  # whether it was below the one before: the density formed (the warmup's first steps)
        self.warming = False  # following counts that move every step before the occupancy's warmup (sizes kept longer)
        self.resizes = 0  # resizes from observed counts (the report)

    @property
    def measuring(self) -> bool:
        return self.stale or self.sizes is None

    def invalidate(self) -> None:
        """The samples a ray gets changed (a refresh, growth): the next march measures."""
        self.stale = True

    def schedule(self, step: int, warmup: int, grown: bool, refreshed: bool, observe: bool) -> None:
        """After training step ``step``: ``grown`` grids or a ``refreshed`` occupancy (the first at ``warmup``, when
        the skipping starts) moved the samples a ray gets, and before the warmup the density forms and they move at
        every step. ``observe`` False (``model.capped_refresh=measure``): the next step then measures. ``observe``:
        growths, the warmup's refresh and the first steps measure, until a measurement finds fewer shown samples
        than the one before (lego: from step 5 on, as the density forms); past that the steps' own counts resize
        the sizes (:meth:`refreshed`), and while warming up a size stays until it is ``WARM_KEEP`` times what the counts
        need (:attr:`warming`: counts that fall every step would otherwise capture a step graph every step)."""
        follow = observe and not grown and (step > warmup or (step < warmup and self.falling))
        self.warming = follow and step < warmup
        if follow and (refreshed or step < warmup):
            self.refreshed()
        elif grown or refreshed or step < warmup:
            self.invalidate()

    def refreshed(self) -> None:
        """An occupancy refresh that moves the counts a little (``model.capped_refresh=observe``): no measuring step;
        the first step checked that ran after it resizes as :meth:`measured` would, from its true counts."""
        self.generation += 1

    def measured(self, march: int, alive: int, shown: int, rays: int | None = None) -> None:
        """Sizes from a synchronising march's counts over ``rays`` rays (None: many). A size that holds its count's
        capacity and is at most ``KEEP`` times above it stays: the sizes, and the step graph captured for them
        (training.step_graph: a capture costs about as much as 5% more rows for a refresh's 50 steps on one H200),
        then outlive an occupancy refresh that moved the counts a little."""
        self.rays = rays
        if self.share is not None:  # the largest rank's (a sync: a measuring step has them anyway)
            every = self.share(torch.tensor([march, alive, shown], dtype=torch.int64)).tolist()
            march, alive, shown = (max(column) for column in zip(*every))
        self._resize([march, alive, shown])
        self.stale = False
        self.measurements += 1
        self.falling, self.shown = self.shown is not None and shown < self.shown, shown

    def _resize(self, counts: list[int]) -> None:
        """Sizes for these counts (march, alive, shown), keeping each that fits within ``KEEP``; a new window."""
        fresh = {kind: headroom(count, self.rays) for kind, count in zip(KINDS, counts)}
        old = self.sizes or {}
        keep = WARM_KEEP if self.warming else KEEP
        kept = {kind for kind, size in fresh.items() if size <= old.get(kind, 0) <= keep * size}
        self.sizes = {kind: old[kind] if kind in kept else size for kind, size in fresh.items()}
        self.peak, self.checked = [0, 0, 0], 0

    def observe(self, march_total: torch.Tensor, visible_totals: torch.Tensor | None) -> None:
        """A capped step's (1,) true march count and the compaction's (2,) counts (None: no compaction), shared with
        the other ranks where :attr:`share` is set: :meth:`observed`."""
        if visible_totals is None:  # no compaction: nothing alive or shown past the march
            totals = torch.nn.functional.pad(march_total, (0, 2))
        else:
            totals = torch.cat([march_total, visible_totals])
        self.observed(totals[None] if self.share is None else self.share(totals))

    def observed(self, counts: torch.Tensor) -> None:
        """A capped step's (S, 3) counts, every rank's (one process: its own): on the CPU checked now, on a GPU
        copied to the host without a sync and checked ``LAG`` steps later. While a CUDA graph is captured
        (training.step_graph) they are kept for :meth:`take_captured`, and observed after each replay."""
        if counts.is_cuda and torch.cuda.is_current_stream_capturing():
            self._captured = counts
            return
        sizes = dict(self.sizes)
        if counts.device.type != "cuda":
            self._check(counts.tolist(), sizes, self.generation)
            return
        host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
        host.copy_(counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.in_flight.append((event, host, sizes, self.generation))
        self._arrived(wait=False)

    def take_captured(self) -> torch.Tensor:
        """The (S, 3) counts :meth:`observe` kept during a capture (the graph writes them at every replay)."""
        if self._captured is None:
            raise RuntimeError("take_captured: no capped march was captured")
        captured, self._captured = self._captured, None
        return captured

    def _arrived(self, wait: bool) -> None:
        """Check the counts of the steps more than ``LAG`` back (waiting for them), with ``wait`` every step's: at
        fixed steps, so that ranks sharing their counts change their sizes at the same steps."""
        while self.in_flight and (wait or len(self.in_flight) > LAG):
            event, host, sizes, generation = self.in_flight.popleft()
            event.synchronize()
            self._check(host.tolist(), sizes, generation)

    def _check(self, every: list[list[int]], sizes: dict[str, int], generation: int) -> None:
        """One step's counts, every rank's (by rank), against the sizes it ran with: the largest rank's set them (the
        first step after a :meth:`refreshed` resizes them; else an overflow grows the current sizes at once, and
        every ``WINDOW`` steps the window's peak shrinks the sizes it fell well below); this rank's own give its
        fill. ``generation``: the refreshes before the step."""
        counts = [max(column) for column in zip(*every)]
        self.peak = [max(p, c) for p, c in zip(self.peak, counts)]
        self.checked += 1
        own = every[self.rank]
        self.fill = [f + min(c / sizes[kind], 1.0) for f, c, kind in zip(self.fill, own, KINDS)]
        self.fills += 1
        over = [(kind, count) for kind, count in zip(KINDS, counts) if count > sizes[kind]]
        self.overflows += bool(over)
        if over:
            self.overflowed_at.append(self.fills)
        if generation > self.resized:  # the first step checked that ran after a refresh not yet resized from
            self.resized = generation
            self.resizes += 1
            self._resize(counts)
            return
        for kind, count in over:
            self.sizes[kind] = max(self.sizes[kind], headroom(GROWTH * count, self.rays))
        if self.checked < WINDOW:
            return
        for kind, count in zip(KINDS, self.peak):
            if SHRINK * headroom(count, self.rays) < self.sizes[kind]:
                self.sizes[kind] = headroom(count, self.rays)
                self.shrinks += 1
        self.peak, self.checked = [0, 0, 0], 0

    def review(self) -> bool:
        """At a log step (one sync): every count in flight checked; returns whether a step overflowed since the
        last review."""
        if self.sizes is None:
            return False
        self._arrived(wait=True)
        self.reviews += 1
        found, self.overflows_reviewed = self.overflows > self.overflows_reviewed, self.overflows
        return found

    def report(self) -> dict:
        """For metrics.json."""
        fill = {kind: round(f / max(self.fills, 1), 4) for kind, f in zip(KINDS, self.fill)}  # mean over the run
        return {
            "sizes": self.sizes,
            "overflows": self.overflows,
            "overflowed_at": self.overflowed_at[:50],
            "shrinks": self.shrinks,
            "reviews": self.reviews,
            "measurements": self.measurements,  # measuring steps (eager, synchronising)
            "resizes": self.resizes,  # model.capped_refresh=observe: resized from a refresh's first counts
            "fill": fill,
        }
