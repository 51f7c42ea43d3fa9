"""Per-step time breakdown for ``train.profile``: wall-clock timers around a step's parts.

``true``: each timed region is bracketed by ``torch.cuda.synchronize`` (on CUDA), so asynchronous kernels are
charged to the region that launched them. That slows training down, which is why the trainer only builds an enabled
profiler when asked: a disabled one hands out a shared no-op context and leaves ops and modules untouched.
``host``: the same regions without the syncs: the host's own time in each (Python, launches, and any wait it meets),
at the run's own pace. Where the host's parts add up to the step, the host sets the pace (a rank of the space split
has about half one GPU's kernels and all of its host work); where they add up to less, the device does.
Regions may nest; each records its inclusive time, and :meth:`StepProfiler.report` derives exclusive parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Callable

import torch
import torch.nn as nn

from models.ops import OpSet
from training.floors import device_limits, floors_ms, linear_flops

_NO_OP = contextlib.nullcontext()

# how the report is laid out: (name, description); the forward pass is split into its parts
REPORT_PARTS = (
    ("sampling", "draw the batch of rays / patches"),
    ("grid_interpolate", "ops.grid_interpolate forward (density and feature grids)"),
    ("march_rays", "ops.march_rays: packed samples along the rays, empty space skipped"),
    ("rendering", "sample selection and compositing (forward minus marching, lookup, upsample, decoder)"),
    ("upsample_bilinear2d", "ops.upsample_bilinear2d forward"),
    ("decoder", "decoder MLP forward (its GELUs included)"),
    ("regularization", "total-variation forward (through ops.sampled_tv: drawing its cells)"),
    ("loss_backward", "loss and the whole backward pass (every op's backward)"),
    ("tv_gradient", "ops.sampled_tv after the backward: the total variation and its gradient"),
    ("grad_sync", "under torchrun: averaging the ranks' gradients (the sharded Adam's reduce-scatter is in its step)"),
    ("step_graph", "train.step_graph: the replays (forward, loss, backward, exchanges); eager steps in the rows above"),
    ("optimizer", "Adam step"),
    ("schedule", "grid growth and occupancy refresh (model.on_step)"),
)


NOTES = {
    True: "device-synchronised timers around each part (slower than a normal run); every op's backward is inside "
    "loss_backward",
    False: "train.profile=host: the host's time in each part, no syncs (a part that waits for the device holds the "
    "wait); every op's backward is inside loss_backward",
}

WINDOW = 100  # steps a row of the report's ``windows`` covers: where in a run the time goes (its first steps, growths)


class StepProfiler:
    """Accumulates synchronised times of named regions while :attr:`recording` is True."""

    def __init__(self, device: torch.device, enabled: bool, synchronised: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled
        self.synchronised = synchronised  # False: train.profile=host, the host's time alone
        self.recording = False
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.rays = 0
        self.work: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))  # bytes / flops a part must do
        self.matmul_dtype = torch.float32  # what the decoder's matmuls run in (its floor's rate is measured so)
        self.marks: list[tuple[int, dict[str, float]]] = []  # (steps, totals) at the end of every WINDOW steps

    def _sync(self) -> None:
        if self.synchronised and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start

    def section(self, name: str) -> contextlib.AbstractContextManager:
        """Context manager timing ``name`` (a shared no-op when profiling is off or not recording, and while a CUDA
        graph is being captured: a synchronize would break the capture, and a capture is not a step's work)."""
        if not (self.enabled and self.recording) or self._capturing():
            return _NO_OP
        return self._timed(name)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def wrap(self, name: str, function: Callable) -> Callable:
        """``function`` with its calls timed as ``name``."""

        def timed(*args, **kwargs):
            with self.section(name):
                return function(*args, **kwargs)

        return timed

    def count(self, part: str, bytes: float = 0.0, flops: float = 0.0) -> None:
        """Add to what ``part`` must move (``bytes``) or compute (``flops``) this step (training.floors); nothing while
        a CUDA graph is captured (its replays run no Python: a part's time and work both come from eager steps)."""
        if self.enabled and self.recording and not self._capturing():
            self.work[part]["bytes"] += bytes
            self.work[part]["flops"] += flops

    def _counted_lookup(self, lookup: Callable) -> Callable:
        def counted(grid: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
            values = lookup(grid, points)
            self.count("grid_interpolate", bytes=points.numel() * points.element_size() + values.numel() * 4)
            return values

        return counted

    def _counted_march(self, march: Callable) -> Callable:
        def counted(origins: torch.Tensor, *args) -> tuple:
            out = march(origins, *args)
            samples, size = out[0].numel(), origins.element_size()
            rays_in = origins.shape[0] * 9 * size  # origins, directions (3 each), t_start, t_end, offset
            # out: ray index (int64), t and 3 box coordinates per sample, then the (B + 1,) int64 offsets
            self.count("march_rays", bytes=rays_in + samples * (8 + 4 * size) + out[3].numel() * 8)
            return out

        return counted

    def instrument_ops(self, ops: OpSet) -> OpSet:
        """An OpSet whose forward calls are timed (grid_interpolate, upsample_bilinear2d, gelu, march_rays) and
        the lookup's and the marching's traffic counted; as is when off."""
        if not self.enabled:
            return ops
        return dataclasses.replace(
            ops,
            grid_interpolate=self.wrap("grid_interpolate", self._counted_lookup(ops.grid_interpolate)),
            upsample_bilinear2d=self.wrap("upsample_bilinear2d", ops.upsample_bilinear2d),
            gelu=self.wrap("gelu", ops.gelu),
            march_rays=self.wrap("march_rays", self._counted_march(ops.march_rays)),
        )

    def instrument_decoding(self, model: nn.Module) -> None:
        """Time the model's decoder as "decoder" (nothing when disabled): through the decoder's forward hooks, or,
        with ``model.decoder_graphs`` (whose replays run no hooks), around ``model.decode_samples``."""
        if not self.enabled:
            return
        if getattr(model, "decoder_graphs", None) is None:
            self.instrument_module(model.decoder, "decoder")
            return
        decode = model.decode_samples

        def timed_decode(features: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            self.count("decoder", flops=linear_flops(model.decoder, features.shape[0]))
            with self.section("decoder"):
                return decode(features, *args, **kwargs)

        model.decode_samples = timed_decode  # the instance's attribute: the class's method is left alone

    def instrument_module(self, module: nn.Module, name: str) -> None:
        """Time ``module``'s forward calls as ``name`` through forward hooks (nothing when disabled)."""
        if not self.enabled:
            return
        open_regions: list[contextlib.AbstractContextManager] = []

        def before(_module, inputs):
            if not self._capturing():  # a capture's forward is not a step's work
                self.count(name, flops=linear_flops(module, inputs[0].shape[0]))
            region = self.section(name)
            region.__enter__()
            open_regions.append(region)

        def after(_module, _inputs, _output):
            open_regions.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def end_step(self, rays: int) -> None:
        """Count one profiled training step that marched ``rays`` rays."""
        if self.enabled and self.recording:
            self.steps += 1
            self.rays += rays
            if self.steps % WINDOW == 0:
                self.marks.append((self.steps, dict(self.totals)))

    def windows(self) -> list[dict]:
        """Each WINDOW profiled steps' (the last window: the rest's) step and parts in mean ms a step, in order."""
        marks = [(0, {}), *self.marks]
        if self.steps > marks[-1][0]:
            marks.append((self.steps, dict(self.totals)))
        rows = []
        for (first, before), (last, after) in zip(marks, marks[1:]):
            spent = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
            ms = {name: round(1000.0 * value / (last - first), 4) for name, value in _parts(spent).items()}
            rows.append(
                {
                    "steps": [first + 1, last],
                    "step_ms": round(1000.0 * spent.get("step", 0.0) / (last - first), 4),
                    "per_step_ms": ms,
                }
            )
        return rows

    def report(self) -> dict:
        """Mean milliseconds per step of each part, their shares of the step, and rays per second."""
        steps = max(self.steps, 1)
        t = self.totals
        parts = _parts(t)
        total = t["step"]
        limits = device_limits(self.device, self.matmul_dtype)
        floors = floors_ms(self.work, steps, limits) if self.synchronised else {}  # a host time has no device floor
        return {
            "steps": self.steps,
            "step_ms": 1000.0 * total / steps,
            "per_step_ms": {name: 1000.0 * value / steps for name, value in parts.items()},
            "share": {name: (value / total if total > 0 else 0.0) for name, value in parts.items()},
            "gelu_forward_ms": 1000.0 * t["gelu"] / steps,
            "floor_ms": floors,  # training.floors: bytes / copy bandwidth or FLOPs / matmul rate, measured here
            "floor_share": {k: v / (1000.0 * parts[k] / steps) for k, v in floors.items() if parts.get(k, 0) > 0},
            "device_limits": limits,
            "work_per_step": {k: {u: v / steps for u, v in amounts.items()} for k, amounts in self.work.items()},
            "rays_per_second": self.rays / total if total > 0 else 0.0,
            "windows": self.windows(),
            "parts": dict(REPORT_PARTS),
            "synchronised": self.synchronised,
            "note": NOTES[self.synchronised],
        }

    @staticmethod
    def format(report: dict) -> str:
        """A small text table of :meth:`report`."""
        host = "" if report.get("synchronised", True) else " (the host's time in each part)"
        lines = [
            f"profile over {report['steps']} steps{host}: {report['step_ms']:.2f} ms/step, "
            f"{report['rays_per_second']:,.0f} rays/s"
        ]
        floors = report.get("floor_ms", {})
        for name, ms in report["per_step_ms"].items():
            floor = (
                f"  floor {floors[name]:8.3f} ms ({100.0 * floors[name] / ms:5.1f} % of it)" if name in floors else ""
            )
            lines.append(f"  {name:<15} {ms:9.3f} ms  {100.0 * report['share'][name]:5.1f} %{floor}")
        if "device_limits" in report:
            limits = report["device_limits"]
            lines.append(
                f"  floors at {limits['copy_gbps']:.0f} GB/s copy and {limits['matmul_tflops']:.1f} TFLOP/s "
                f"{limits['matmul_dtype']} matmul, measured on this device"
            )
        return "\n".join(lines)


def _parts(totals: dict[str, float]) -> dict[str, float]:
    """The report's exclusive parts (seconds) from inclusive region ``totals``; ``other``: the step's rest (timer
    overhead, learning-rate updates, bookkeeping)."""
    t = defaultdict(float, totals)
    parts = {name: t[name] for name, _ in REPORT_PARTS}
    parts["rendering"] = (
        t["forward"] - t["march_rays"] - t["grid_interpolate"] - t["upsample_bilinear2d"] - t["decoder"]
    )
    parts["other"] = t["step"] - sum(parts.values())
    return parts
