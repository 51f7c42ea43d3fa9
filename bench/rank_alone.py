"""What one rank of the space split costs alone (issue 33), measured on one GPU.

    python bench/rank_alone.py --json rank_alone.json --at 2800 --steps 200 -- +experiment=blender data.root=PATH

Runs train.py in this process up to step ``--at`` (add ``model.capped_samples=true train.step_graph=true``: the
path ``train.parallel=auto`` gives every rank). Then the model as it stands is frozen (learning rates 0: Adam's
kernels run, nothing moves) and one training batch is fixed, and ``--steps`` steps are timed:
- one GPU's step, as the run took it;
- for each S of ``--ranks`` and each cut (even planes; the planes a cut by the samples alone makes from the
  shaded samples of ``--batches`` training batches, and ``work``, the split's, from those and the rows Adam
  steps), each rank r as the split runs it: the march of its slab, its lookups, shading, backward, Adam on its
  slab's occupied rows, its step graph.
The split's collectives are emulated in this process (:class:`Exchanges`): a rank's own part is copied into place, the
other ranks' optical depth in front comes from their slabs' own march of the same rays (so each rank keeps and shades
exactly the samples it would), their composited values are zeros (which moves the gradients' values, not the work),
and the gradient all-reduce and the slabs' broadcasts are skipped.

A rank's time here is its device work and launches with free, instantaneous exchanges: the floor of a split step on S
GPUs. One GPU's step over the largest rank's (``one_over_slowest``; on a GPU also by the median steps) is then the
most S GPUs can gain at these slabs; a measured split step above that floor is the exchanges, the waits for the
slower rank and the host. On a GPU, ``--phases`` further steps of each rank are profiled with a marker at each
exchange (bench/exchange_phases.py): its phases between them, and ``barrier_ms``, the split step when every exchange
waits for the slowest rank's phase before it (``one_over_barrier``: one GPU's step, profiled alike, over it): what the
cut's balance per phase costs beyond the floor. Each configuration's
``--profile`` further steps run under torch.profiler: its kernels' time a step and the largest kernels, then as many
eager steps by ATen call and input shapes (what each kernel computes on). Without a GPU it runs eagerly (no step
graph; the tests run it so) and the times are the CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from exchange_phases import EXCHANGES, barrier_ms, kernel_timeline, mark, phase_times  # noqa: E402
from kernel_profile import device_rows  # noqa: E402
from slab_balance import LayerCounts  # noqa: E402

from models import space_split  # noqa: E402
from models.capacities import SampleCapacities  # noqa: E402
from models.space_split import Slabs, split_march, work_layers  # noqa: E402
from training import trainer as trainer_module  # noqa: E402
from training.distributed import Group  # noqa: E402
from training.space_parallel import SpaceParallel  # noqa: E402
from training.step_graph import StepGraph  # noqa: E402


class _Recorded(Exception):
    """A slab's march reached its first exchange: what it sends was recorded."""


class Exchanges:
    """The split's all-gathers in one process, as rank ``rank`` of ``ranks`` receives them: its own part, and for
    the others: (B,) optical depths from ``fronts`` (their true values for the fixed batch), int64 counts as its own,
    the composite's (B, C) values as zeros."""

    def __init__(self, rank: int, ranks: int, fronts: dict[int, torch.Tensor]):
        self.rank, self.ranks, self.fronts = rank, ranks, fronts

    def all_gather(self, parts: torch.Tensor, values: torch.Tensor, group=None) -> None:
        mark()  # where the exchange is (bench/exchange_phases.py)
        view = parts.view(self.ranks, *values.shape)
        for k in range(self.ranks):
            if k == self.rank or values.dtype == torch.int64:
                view[k].copy_(values)
            elif values.dim() == 1:
                view[k].copy_(self.fronts[k])
            else:
                view[k].zero_()


def slab_fronts(model, batch, planes: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Every slab's (B,) clamped optical depth along the fixed ``batch``'s rays: what its rank sends at the first
    exchange (its slab's march of the same rays, stopped there)."""
    fronts: dict[int, torch.Tensor] = {}
    for k in range(len(planes) + 1):

        def record(parts, values, group=None, k=k):
            fronts[k] = values.detach().clone()
            raise _Recorded

        space_split.ALL_GATHER = record
        try:
            with torch.no_grad():  # the plain march: no capacities
                split_march(model, Slabs(planes, k), batch.origins, batch.directions, batch.jitter, views=batch.views)
        except _Recorded:
            continue
        raise RuntimeError("slab_fronts: the slab's march made no exchange (model.weight_threshold 0?)")
    return fronts


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(trainer, at: int, steps: int, warm: int) -> dict:
    """``warm`` steps, then ``steps`` timed: wall time a step (device-synchronised at both ends) and, on a GPU, the
    median and 90th percentile of the single steps (CUDA events: a refresh's measuring step stands out)."""
    trainer.step = at  # the schedule (refreshes, the TV's end) where the run stood
    for _ in range(warm):
        trainer.train_step()
    device = trainer.device
    sync(device)
    cuda = device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)] if cuda else []
    started = time.perf_counter()
    if cuda:
        events[0].record()
    for k in range(steps):
        trainer.train_step()
        if cuda:
            events[k + 1].record()
    sync(device)
    wall = (time.perf_counter() - started) / steps * 1e3
    result = {"ms_per_step": round(wall, 4)}
    if cuda:
        single = sorted(a.elapsed_time(b) for a, b in zip(events, events[1:]))
        result |= {"median_ms": round(statistics.median(single), 4), "p90_ms": round(single[int(0.9 * steps)], 4)}
    capacities, graph = trainer.model.capacities, trainer.step_graph
    result["sizes"] = None if capacities is None else dict(capacities.sizes or {})
    if graph is not None:
        result["graph"] = {key: value for key, value in graph.report().items() if key != "captured_at"}
    return result


def phases(trainer, steps: int, exchanges: int) -> dict | None:
    """``steps`` more steps under torch.profiler, a marker before each: the mean phases (ms) between this process's
    ``exchanges`` exchanges a step (bench/exchange_phases.py; one process: 0, its whole step) over the steps that had
    them; None without a GPU."""
    if steps <= 0 or trainer.device.type != "cuda":
        return None
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(steps):
            mark(step=True)
            trainer.train_step()
        mark(step=True)
        sync(trainer.device)
    found = phase_times(kernel_timeline(profile), exchanges)
    if not found:
        return None
    means = [round(statistics.fmean(step[k] for step in found), 4) for k in range(exchanges + 1)]
    return {"ms": means, "steps": len(found)}


def _profiled(trainer, steps: int, shapes: bool = False):
    """``steps`` training steps under torch.profiler (the device's activity too on a GPU)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    activities += [torch.profiler.ProfilerActivity.CUDA] if trainer.device.type == "cuda" else []
    with torch.profiler.profile(activities=activities, record_shapes=shapes) as profile:
        for _ in range(steps):
            trainer.train_step()
        sync(trainer.device)
    return profile


def kernels(trainer, steps: int, rows: int) -> dict | None:
    """``steps`` more steps under torch.profiler: the kernels' time a step, and the ``rows`` largest kernels by their
    time a step (ms) and launches a step (none without a GPU). Then as many steps eagerly, the step graph dropped
    (a replay runs no ATen call to charge its kernels to), by ATen call and input shapes: the ``rows`` calls whose own
    kernels take the most time (on a CPU, their own time), which says what a kernel of the first table computes on,
    e.g. the whole batch's rays or a slab's samples. The trainer keeps no step graph after this."""
    if steps <= 0:
        return None
    found = sorted(device_rows(_profiled(trainer, steps).key_averages()), key=lambda e: -e.self_device_time_total)
    top = [[e.key[:90], round(e.self_device_time_total / steps / 1e3, 4), round(e.count / steps, 2)] for e in found]
    result = {"ms_per_step": round(sum(e.self_device_time_total for e in found) / steps / 1e3, 4), "top": top[:rows]}
    trainer.step_graph = None  # eager steps drop the gradients a replay writes into: no replay after them
    averages = _profiled(trainer, steps, shapes=True).key_averages(group_by_input_shape=True)
    cuda = trainer.device.type == "cuda"
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)  # noqa: E731
    host = torch.autograd.DeviceType.CPU
    calls = [e for e in averages if e.device_type == host and not getattr(e, "is_user_annotation", False)]
    calls = sorted((e for e in calls if own(e) > 0), key=own)
    result["calls"] = [
        [e.key, str(e.input_shapes)[:160], round(own(e) / steps / 1e3, 4), round(e.count / steps, 2)]
        for e in reversed(calls[-rows:])
    ]
    return result


def become_rank(trainer, rank: int, ranks: int, planes: tuple[int, ...], exchanges: Exchanges) -> None:
    """The trainer as rank ``rank`` of ``ranks`` split at ``planes``, with fresh capacities and step graph."""
    model = trainer.model
    space_split.ALL_GATHER = exchanges.all_gather
    trainer.group = Group(rank, ranks, 0)
    model.capacities = SampleCapacities() if model.capacities is not None else None
    trainer.space = SpaceParallel(trainer, graphed=bool(trainer.train_cfg.get("step_graph", False)))
    trainer.space._planes = (model.grid_shape, planes)
    trainer._rebuild_optimizer()  # the slab's occupied rows (training.optim)
    trainer.step_graph = None  # its graphs go before the next are captured
    trainer.step_graph = StepGraph.for_trainer(trainer)


def measure(trainer, args) -> dict:
    model = trainer.model
    plain_gather = space_split.ALL_GATHER
    dist.broadcast = lambda *a, **k: None  # the slabs' gathers before a refresh: skipped
    dist.all_reduce = lambda *a, **k: mark()  # the gradients' sum: skipped, its place marked (exchange_phases)
    counter, capacities = LayerCounts(model), model.capacities
    model.capacities = None  # the shaded samples per first-axis layer, counted as the samples cut counts them: unpadded
    for _ in range(args.batches):
        batch = trainer.sampler.sample()
        counter.march(batch.origins, batch.directions, batch.jitter)
    model.capacities = capacities
    batch = trainer.sampler.sample()
    if batch.jitter is None:
        raise SystemExit("rank_alone: the batches must carry their jitter (the ray sampler's)")
    trainer.sampler.sample = lambda: batch  # one fixed batch: every configuration marches the same rays

    def frozen() -> None:
        for group in trainer.optimizer.param_groups:
            group["lr"] = 0.0

    trainer._set_learning_rates = frozen
    report = {"at": args.at, "steps": args.steps, "grid": list(model.grid_shape), "device": str(trainer.device)}
    report["one"] = timed(trainer, args.at, args.steps, args.warm)
    report["one"]["phases"] = phases(trainer, args.phases, 0)
    report["one"]["kernels"] = kernels(trainer, args.profile, args.rows)
    print(f"rank alone: one process {report['one']}", flush=True)
    report["splits"] = []
    for ranks in args.ranks:
        shaded = counter.counts["shown"] / args.batches  # a step's
        cuts = {
            "even": lambda: Slabs.even(model.grid_shape[0], ranks, 0).planes,
            "samples": lambda: Slabs.balanced(shaded, ranks, 0).planes,
            "work": lambda: Slabs.balanced(work_layers(shaded, model.occupancy.mask), ranks, 0).planes,
        }
        for cut in args.cuts:
            planes = cuts[cut]()
            space_split.ALL_GATHER = plain_gather
            fronts = slab_fronts(model, batch, planes)
            entry = {"ranks": ranks, "cut": cut, "planes": list(planes), "rank": []}
            for rank in range(ranks):
                become_rank(trainer, rank, ranks, planes, Exchanges(rank, ranks, fronts))
                entry["rank"].append(timed(trainer, args.at, args.steps, args.warm))
                entry["rank"][-1]["phases"] = phases(trainer, args.phases, EXCHANGES)
                entry["rank"][-1]["kernels"] = kernels(trainer, args.profile, args.rows)
            slowest = max(r["ms_per_step"] for r in entry["rank"])
            entry["one_over_slowest"] = round(report["one"]["ms_per_step"] / slowest, 3)
            if "median_ms" in report["one"]:  # the steadier figure (a call's means move by ~0.1 ms)
                slowest = max(r["median_ms"] for r in entry["rank"])
                entry["one_over_slowest_median"] = round(report["one"]["median_ms"] / slowest, 3)
            measured = [r["phases"] for r in entry["rank"]]
            if report["one"]["phases"] and all(measured):  # every exchange waiting for the slowest rank's phase
                entry["barrier_ms"] = round(barrier_ms([m["ms"] for m in measured]), 4)
                entry["one_over_barrier"] = round(sum(report["one"]["phases"]["ms"]) / entry["barrier_ms"], 3)
            report["splits"].append(entry)
            args.json.write_text(json.dumps(report, indent=1))  # so far: a run cut short keeps what it measured
            times = [r["ms_per_step"] for r in entry["rank"]]
            print(f"rank alone: {ranks} ranks, {cut} planes {planes}: {times} ms a step", flush=True)
    return report


def install(args) -> None:
    plain_step = trainer_module.Trainer.train_step

    def train_step(self):
        if self.step == args.at and not getattr(self, "_rank_alone", False):
            self._rank_alone = True
            report = measure(self, args)
            args.json.write_text(json.dumps(report, indent=1))
            print(f"rank alone: wrote {args.json}", flush=True)
            sys.stderr.flush()
            os._exit(0)  # the run ends here: no final evaluation or checkpoint of a model measured frozen
        return plain_step(self)

    trainer_module.Trainer.train_step = train_step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, required=True, help="the report")
    parser.add_argument("--at", type=int, default=2800, help="the step (0-based) at which to measure")
    parser.add_argument("--steps", type=int, default=200, help="steps timed a configuration")
    parser.add_argument("--warm", type=int, default=20, help="steps before the timed ones (captures, measurements)")
    parser.add_argument("--ranks", default="2,4", help="the split's rank counts")
    parser.add_argument("--profile", type=int, default=10, help="steps under torch.profiler a configuration (GPU)")
    parser.add_argument("--rows", type=int, default=30, help="kernels listed a configuration")
    parser.add_argument("--phases", type=int, default=50, help="steps profiled for the phases between exchanges (GPU)")
    parser.add_argument("--batches", type=int, default=8, help="training batches counted for the samples cut")
    parser.add_argument("--cuts", default="even,samples,work", help="the cuts timed, in this order")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = parser.parse_args(argv)
    args.ranks = [int(r) for r in args.ranks.split(",")]
    args.cuts = args.cuts.split(",")
    unknown = sorted(set(args.cuts) - {"even", "samples", "work"})
    if unknown:
        parser.error(f"--cuts: unknown cut {unknown[0]!r} (expected even, samples or work)")
    install(args)
    sys.argv = [str(REPO / "train.py"), *args.overrides]
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")


if __name__ == "__main__":
    main()
