"""The next step's march planned while this step's gradient pass runs (``train.lookahead``).

Why: a training step has two host syncs, the sample counts of ``march_rays`` and ``visible_samples`` (they size
their outputs). On the one stream, each waits for everything queued before it, the previous step's backward and
Adam included, and the device then idles while the host launches the rest of the step. On an H100 whose host
launches a lego step in ~9 ms, the step took 12.8 ms against 8.2 ms of kernels (bench/README, "The next step's
march planned ahead").

How: step k draws batch k + 1 before its own forward. Once the forward is queued, the plan of batch k + 1 (the
march and the no-grad density pass that picks which samples are composited and shaded:
``models.render_views.plan_march``) is issued on a side stream that waits only for that draw, so its syncs wait
for step k - 1's Adam, not for step k's forward: the device keeps the forward to run while the host waits. Step
k's optimiser waits for the plan before it writes the grids the plan read. So step k + 1's samples are picked
on the grids one Adam step older than those they are rendered with (early termination and the weight threshold
decided a step late); what is rendered, and every gradient, uses the current grids. A plan whose march state
changed before its step (a growth, an occupancy refresh) is made again at that step.

Without a GPU the same order runs on the one stream (the same samples, no overlap). Not used with a replaying or
touched-rows optimiser (the marks must describe the step that reads them) or with pose refinement (the rays
move each step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.model import VoxelNeRF
from models.render_views import MarchPlan, plan_batch


def usable(model: VoxelNeRF) -> bool:
    """Whether ``model``'s training can plan its marches ahead (see the module doc)."""
    return not model.touched.enabled and not model.poses.enabled


class MarchLookahead:
    """Draws each batch a step early and plans its march behind the current step's forward.

    Per step: ``batch, plan = next(draw)`` (this step's batch and its plan, or None), queue the forward,
    ``plan_next(model)``, backward, ``before_update()``, the optimiser."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._batch = None  # the next step's batch, drawn
        self._drawn: torch.cuda.Event | None = None  # recorded on the main stream after that draw
        self._plan: MarchPlan | None = None
        self._planned: torch.cuda.Event | None = None  # recorded on the side stream after the plan

    def next(self, draw: Callable[[], object]) -> tuple[object, MarchPlan | None]:
        """This step's batch (drawn a step ago, or now) and its plan (None if none was made); draws the next one."""
        batch = self._batch if self._batch is not None else draw()
        plan, self._plan = self._plan, None
        self._batch = draw()
        if self.stream is not None:
            self._drawn = torch.cuda.Event()
            self._drawn.record()
        return batch, plan

    def plan_next(self, model: VoxelNeRF) -> None:
        """Plan the next step's batch; call with this step's forward queued and before its optimiser step."""
        if self.stream is None:
            self._plan = plan_batch(model, self._batch)
            return
        main = torch.cuda.current_stream()
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(self._drawn)
            self._plan = plan_batch(model, self._batch)
            self._planned = torch.cuda.Event()
            self._planned.record()
        self._plan.record_stream(main)  # made on the side stream, read on the main one next step

    def before_update(self) -> None:
        """The optimiser is about to write the grids: the plan's reads of them come first."""
        if self._planned is not None:
            torch.cuda.current_stream().wait_event(self._planned)
            self._planned = None

    def drop(self) -> None:
        """Forget the batch and plan drawn ahead (the sampler or the model was replaced: a resume)."""
        self._batch = self._plan = self._drawn = None
        self.before_update()
