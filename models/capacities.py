"""Fixed sample capacities for the training march (``model.capped_samples``): the march and the shading compaction
write into outputs of given sizes (``march_rays_capped``, ``visible_samples_capped``), so a step has no device sync
for their counts; the true counts stay on the device until the trainer reads them at a log step.

The sizes come from one synchronising step (the plain ops) after every event that changes how many samples a ray
gets (the start, an occupancy refresh, the grids' growth, the fine grid's arrival): ``HEADROOM`` times what it
counted, rounded up to a size the decoder's graphs keep (``models.decoder_graphs.graph_rows``). At each review
(the trainer's log steps) the peak since the last one decides: above a capacity, an overflow (the last rays of
those batches lost samples; counted in metrics.json) and the sizes grow; below ``1 / SHRINK`` of one, they
shrink, so the padding the decoder shades stays small as the samples per ray fall (lego: ~95 early, ~24 late).
"""

from __future__ import annotations

import math

import torch

from models.decoder_graphs import graph_rows

HEADROOM = 1.25
SHRINK = 1.5
KINDS = ("march", "alive", "shown")  # march_rays' samples, visible_samples' alive ones and shown ones


def headroom(count: int) -> int:
    """The capacity for ``count`` samples: HEADROOM x, at least 1, a size of graph_rows'."""
    return graph_rows(max(math.ceil(HEADROOM * count), 1))


class SampleCapacities:
    """The three sizes (:data:`KINDS`), None until measured; :attr:`measuring` while the next march must count."""

    def __init__(self):
        self.sizes: dict[str, int] | None = None
        self.stale = True
        self.peak: torch.Tensor | None = None  # (3,) int64 on the device: the largest counts since the last review
        self.overflows = 0  # reviews that found a count above its capacity
        self.reviews = 0

    @property
    def measuring(self) -> bool:
        return self.stale or self.sizes is None

    def invalidate(self) -> None:
        """The samples a ray gets changed (a refresh, growth): the next march measures."""
        self.stale = True

    def measured(self, march: int, alive: int, shown: int) -> None:
        """Sizes from a synchronising march's counts."""
        self.sizes = {kind: headroom(count) for kind, count in zip(KINDS, (march, alive, shown))}
        self.stale = False

    def observe(self, march_total: torch.Tensor, visible_totals: torch.Tensor | None) -> None:
        """Fold a capped march's (1,) true count and the compaction's (2,) counts (None: no compaction) into the
        peak, on the device (no sync)."""
        totals = march_total if visible_totals is None else torch.cat([march_total, visible_totals])
        totals = torch.nn.functional.pad(totals, (0, 3 - totals.shape[0]))
        self.peak = totals if self.peak is None else torch.maximum(self.peak, totals)

    def review(self) -> bool:
        """At a log step (one sync): grow the sizes after an overflow, shrink them when the peak fell below
        1 / SHRINK of them; returns whether an overflow happened since the last review."""
        if self.peak is None or self.sizes is None:
            return False
        peak = dict(zip(KINDS, self.peak.tolist()))
        self.peak = None
        self.reviews += 1
        overflow = any(peak[kind] > self.sizes[kind] for kind in KINDS)
        self.overflows += overflow
        for kind in KINDS:
            if overflow or peak[kind] * SHRINK * HEADROOM < self.sizes[kind]:
                self.sizes[kind] = headroom(peak[kind])
        return overflow

    def report(self) -> dict:
        """For metrics.json."""
        return {"sizes": self.sizes, "overflows": self.overflows, "reviews": self.reviews}
