"""training.step_graph (``train.step_graph``): a step's gradients replayed from one CUDA graph train what the eager
step trains; the graph is captured again when the sample capacities change, and kept across a refresh that keeps
them; no garbage collection inside a capture; the config refuses it without capped samples, and on the CPU the steps
run eagerly."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import run_train, tiny_overrides

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture(scope="module")
def scene_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("scene_cache")


def _overrides(cache, iters: int, device: str) -> list[str]:
    # per-sample shading, refreshes (capacities measured again) within the run, the regularisers on the samples
    base = [o for o in tiny_overrides(cache, iters) if not o.startswith(("device=", "ops="))]
    return base + [
        f"device={device}", f"ops={'custom' if device == 'cuda' else 'torch'}", "model.shading=per_sample",
        "model.upsample=1", "train.turntable_frames=0", "train.log_every=10", "model.occupancy.warmup=3",
        "model.occupancy.refresh_every=10", "model.capped_samples=true", "train.opacity_loss=0.01",
    ]  # fmt: skip


def _train(tmp_path, cache, name: str, extra: list[str], iters: int = 40, device: str = "cuda") -> tuple[dict, dict]:
    from training.compact_model import read_model

    run = tmp_path / name
    result = run_train(_overrides(cache, iters, device) + [f"hydra.run.dir={run}", *extra], timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads((run / "metrics.json").read_text()), read_model(run / "model.pt")[1]["history"]


@cuda
def test_a_graphed_step_trains_what_the_eager_step_trains(tmp_path, scene_cache):
    measure = "model.capped_refresh=measure"  # a measuring step at each refresh: the sizes never overflow here
    eager, eager_history = _train(tmp_path, scene_cache, "eager", [measure, "train.step_graph=false"])
    graphed, graphed_history = _train(tmp_path, scene_cache, "graphed", [measure, "train.step_graph=true"])
    report = graphed["step_graph"]
    # every step either eager (the first, the warm-up, a measuring step after each refresh) or replayed; a
    # measurement that keeps the sizes keeps the graph, whose gradient tensors the eager step between zeroed in place
    assert report["eager"] + report["replays"] == 40 and report["replays"] >= 20, report
    assert 1 <= report["captures"] < report["eager"] - 1, report
    assert len(report["captured_at"]) == report["captures"] and report["captured_at"] == sorted(report["captured_at"])
    assert graphed["step_graph_ranks"] is None  # one process
    assert eager["step_graph"] is None
    # the same steps up to the order of float atomics in the lookups' backward
    assert graphed_history["loss"] == pytest.approx(eager_history["loss"], rel=2e-3)
    assert graphed["psnr"] == pytest.approx(eager["psnr"], abs=0.05)
    assert graphed["sample_capacity"]["overflows"] == 0


@cuda
def test_observed_refreshes_replay_through_them(tmp_path, scene_cache):
    """``model.capped_refresh=observe``: a refresh past the warmup has no measuring step, so the graph replays
    through it (fewer eager steps than measuring at each refresh), and trains what the eager capped step trains."""
    observe = ["model.capped_refresh=observe"]
    eager, eager_history = _train(tmp_path, scene_cache, "eager", [*observe, "train.step_graph=false"])
    graphed, graphed_history = _train(tmp_path, scene_cache, "graphed", [*observe, "train.step_graph=true"])
    measured, _ = _train(tmp_path, scene_cache, "measured", ["model.capped_refresh=measure", "train.step_graph=true"])
    assert graphed["step_graph"]["eager"] < measured["step_graph"]["eager"], (
        graphed["step_graph"],
        measured["step_graph"],
    )
    assert graphed["sample_capacity"]["resizes"] >= 2
    assert graphed_history["loss"] == pytest.approx(eager_history["loss"], rel=2e-3)


@cuda
def test_a_graphed_step_with_the_batch_graph_and_decoder_graphs(tmp_path, scene_cache):
    """The batch built in place by its own graph is read in place; the decoder's graphs stay out of the capture, and
    with the step graph out of the eager steps too (StepGraph.for_trainer)."""
    extra = ["train.batch_graph=true", "model.decoder_graphs=true", "train.random_background=true"]
    eager, eager_history = _train(tmp_path, scene_cache, "eager", [*extra, "train.step_graph=false"])
    graphed, graphed_history = _train(tmp_path, scene_cache, "graphed", [*extra, "train.step_graph=true"])
    assert graphed["step_graph"]["replays"] >= 20
    assert graphed["decoder_graphs"] is None and eager["decoder_graphs"] is not None  # eager steps: as is
    assert graphed_history["loss"] == pytest.approx(eager_history["loss"], rel=5e-3)


@cuda
def test_a_profiled_graphed_step_times_its_replays_as_one_part(tmp_path, scene_cache):
    """``train.profile`` keeps the step graph: the replays are the part ``step_graph``; the eager steps' parts (the
    measuring steps) are timed as before, with the work they count."""
    graphed, _ = _train(tmp_path, scene_cache, "profiled", ["train.step_graph=true", "train.profile=true"])
    report = json.loads((tmp_path / "profiled" / "profile.json").read_text())
    assert graphed["step_graph"]["replays"] >= 20
    parts = report["per_step_ms"]
    assert parts["step_graph"] > 0 and parts["optimizer"] > 0 and parts["decoder"] > 0
    assert sum(report["share"].values()) == pytest.approx(1.0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL split needs two GPUs")
def test_a_graphed_split_over_two_gpus_finishes_and_exits(tmp_path, scene_cache):
    """Under torchrun on two GPUs (NCCL) the split's step graph holds captured collectives: the ranks must destroy it
    before the process group, or ``ncclCommDestroy`` waits for it forever (StepGraph.release). A hang here is the
    subprocess timeout."""
    from test_distributed import ranks_output, torchrun

    run = tmp_path / "split"
    args = [*_overrides(scene_cache, 40, "cuda"), f"hydra.run.dir={run}", "train.parallel=auto"]  # auto: graphed
    result = torchrun(2, args, timeout=300)
    assert result.returncode == 0, ranks_output(result)
    metrics = json.loads((run / "metrics.json").read_text())
    assert (metrics["parallel"]["ranks"], metrics["parallel"]["split"]) == (2, "space"), metrics["parallel"]
    assert [r["replays"] > 0 for r in metrics["step_graph_ranks"]] == [True, True], metrics["step_graph_ranks"]


@pytest.mark.parametrize("device_fails", [False, True])
def test_release_destroys_the_graph_even_when_the_device_failed(monkeypatch, device_fails):
    """What the split's ranks do before the process group goes (the NCCL one waits for graphs holding its
    collectives); a device that failed (the run stopping with its own error) must not keep the graph alive."""
    from training.step_graph import StepGraph

    class Graph:
        resets = 0

        def reset(self):
            Graph.resets += 1

    def synchronize():
        if device_fails:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    step_graph = StepGraph(None, lambda: None, lambda *args: None)
    step_graph.graph, step_graph.key, step_graph.outputs = Graph(), ("sizes",), (torch.zeros(1),)
    step_graph.release()
    assert Graph.resets == 1 and step_graph.graph is None and step_graph.key is None and step_graph.outputs == ()
    step_graph.release()  # nothing left: nothing to do
    assert Graph.resets == 1


def test_a_step_graph_serves_the_warmups_steps_too():
    """``model.capped_refresh=observe`` before the warmup: the sizes follow counts that fall every step, kept within
    ``WARM_KEEP`` (models/capacities.py), so a graph applies there as after it (the split's eager warmup steps are its
    host's); a measuring step or the fine grid's collection still runs eagerly."""
    from types import SimpleNamespace

    from models.capacities import SampleCapacities
    from training.step_graph import StepGraph

    capacities = SampleCapacities()
    capacities.measured(1000, 600, 300)
    off = SimpleNamespace(enabled=False, collecting=False)
    model = SimpleNamespace(capacities=capacities, fine=off, touched=off, training=True)
    step_graph = StepGraph(model, lambda: None, lambda *args: None)
    assert step_graph.applies()
    capacities.warming = True
    assert step_graph.applies()
    capacities.invalidate()
    assert not step_graph.applies()  # a measuring step
    capacities.stale = False
    model.fine = SimpleNamespace(enabled=False, collecting=True)
    assert not step_graph.applies()


def test_no_garbage_collection_inside_a_capture():
    import gc

    from data.graph_capture import collection_paused

    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        with collection_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
    gc.enable()


def test_step_graph_needs_capped_samples(tmp_path, scene_cache):
    result = run_train(tiny_overrides(scene_cache, 2) + [f"hydra.run.dir={tmp_path / 'run'}", "train.step_graph=true"])
    assert result.returncode != 0 and "train.step_graph: needs model.capped_samples=true" in result.stderr


def test_on_the_cpu_the_steps_run_eagerly(tmp_path, scene_cache):
    metrics, _ = _train(tmp_path, scene_cache, "cpu", ["train.step_graph=true"], iters=6, device="cpu")
    assert metrics["step_graph"] is None and metrics["psnr"] > 0


def test_the_step_graph_runs_the_eager_steps_decoder_as_is():
    """Where the step graph applies, the model's decoder graphs go: the replays hold the decoder, and the eager steps
    left shade too many samples for launches to matter."""
    from types import SimpleNamespace

    from models.capacities import SampleCapacities
    from training.step_graph import StepGraph

    def trainer(device: str, capped: bool = True):
        model = SimpleNamespace(capacities=SampleCapacities() if capped else None, decoder_graphs="graphs")
        return SimpleNamespace(train_cfg={"step_graph": True}, space=None, device=torch.device(device),
                               group=SimpleNamespace(active=False), model=model, optimizer=None,
                               _gradients=None, profiler=None)  # fmt: skip

    graphed = trainer("cuda")
    assert StepGraph.for_trainer(graphed) is not None and graphed.model.decoder_graphs is None
    for kept in (trainer("cpu"), trainer("cuda", capped=False)):  # no step graph: the decoder graphs stay
        assert StepGraph.for_trainer(kept) is None and kept.model.decoder_graphs == "graphs"
