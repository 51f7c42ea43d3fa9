"""training.profiler.StepProfiler's windows: each WINDOW profiled steps' parts, so that a run's profile says where in
the run the time went (the first steps before the occupancy skips anything, the growths), not only its mean; and
``train.profile=host``: the same parts without a device sync."""

from __future__ import annotations

import pytest
import torch

from training.profiler import WINDOW, StepProfiler


def _profiled(step_seconds: list[float], decoder_share: float) -> StepProfiler:
    """A recording CPU profiler that went through ``len(step_seconds)`` steps of those lengths (region totals added
    as the timers would), ``decoder_share`` of each in the decoder, inside the forward."""
    profiler = StepProfiler(torch.device("cpu"), True)
    profiler.recording = True
    for seconds in step_seconds:
        profiler.totals["step"] += seconds
        profiler.totals["forward"] += 0.5 * seconds
        profiler.totals["decoder"] += decoder_share * seconds
        profiler.end_step(rays=64)
    return profiler


def test_windows_split_the_run_where_its_steps_cost_differently():
    first, rest = 0.030, 0.008  # a slow start, then steady steps
    steps = [first] * WINDOW + [rest] * (WINDOW + WINDOW // 2)
    report = _profiled(steps, decoder_share=0.25).report()
    windows = report["windows"]
    assert [w["steps"] for w in windows] == [[1, WINDOW], [WINDOW + 1, 2 * WINDOW], [2 * WINDOW + 1, len(steps)]]
    assert [w["step_ms"] for w in windows] == pytest.approx([30.0, 8.0, 8.0])
    assert windows[0]["per_step_ms"]["decoder"] == pytest.approx(7.5)
    assert windows[0]["per_step_ms"]["rendering"] == pytest.approx(7.5)  # the forward less the decoder
    assert windows[2]["per_step_ms"]["other"] == pytest.approx(4.0)  # the step less its forward
    # the windows make up the whole: their steps weigh in the run's mean
    mean = sum(w["step_ms"] * (w["steps"][1] - w["steps"][0] + 1) for w in windows) / len(steps)
    assert mean == pytest.approx(report["step_ms"])
    parts = windows[1]["per_step_ms"]
    assert list(parts) == list(report["per_step_ms"])  # the same parts, in the same order


def test_a_run_shorter_than_a_window_is_one_window_and_no_steps_none():
    assert _profiled([0.01] * 7, 0.1).report()["windows"] == [
        {
            "steps": [1, 7],
            "step_ms": pytest.approx(10.0),
            "per_step_ms": pytest.approx(_profiled([0.01], 0.1).report()["per_step_ms"]),
        }
    ]
    assert _profiled([], 0.1).report()["windows"] == []


@pytest.mark.parametrize("synchronised", [True, False], ids=["synchronised", "host"])
def test_host_mode_times_the_parts_without_syncing_the_device(monkeypatch, synchronised):
    """On CUDA a synchronised part syncs the device before and after it; ``host`` never does (the host's own time)."""
    syncs = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.append(device))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    profiler = StepProfiler(torch.device("cuda"), True, synchronised=synchronised)
    profiler.recording = True
    with profiler.section("step"), profiler.section("optimizer"):
        pass
    assert len(syncs) == (4 if synchronised else 0)
    assert profiler.totals["optimizer"] > 0 and profiler.totals["step"] >= profiler.totals["optimizer"]


def test_a_host_report_says_so_and_claims_no_device_floors():
    profiler = StepProfiler(torch.device("cpu"), True, synchronised=False)
    profiler.recording = True
    profiler.totals["step"] += 0.01
    profiler.count("decoder", flops=1e9)  # counted work, but a host time has no floor to compare it with
    profiler.end_step(rays=64)
    report = profiler.report()
    assert report["synchronised"] is False and report["floor_ms"] == {} and report["floor_share"] == {}
    assert report["note"].startswith("train.profile=host")
    assert "(the host's time in each part)" in StepProfiler.format(report)
    synchronised = _profiled([0.01], 0.1).report()
    assert synchronised["synchronised"] is True and "host" not in StepProfiler.format(synchronised)
