"""bench/rank_alone.py on the CPU: a tiny run times one process and each rank of a two-slab split alone, so that the
script cannot rot; and the emulated all-gather hands each rank what the others would send."""

import json
import subprocess
import sys

import pytest
import torch
from test_train import REPO, scene_cache, tiny_overrides  # noqa: F401 (scene_cache: the fixture)


def test_a_tiny_run_times_one_process_and_each_rank(tmp_path, scene_cache):  # noqa: F811
    out = tmp_path / "alone.json"
    args = ["--json", str(out), "--at", "6", "--steps", "3", "--warm", "1", "--ranks", "2", "--batches", "1"]
    args += ["--cuts", "work,even"]  # these, in this order (samples: as work without the rows)
    args += ["--profile", "1", "--rows", "5", "--"]
    args += tiny_overrides(scene_cache, 12) + [f"hydra.run.dir={tmp_path / 'run'}", "train.turntable_frames=0"]
    args += ["model.upsample=1", "train.batch_rays=64", "model.weight_threshold=1e-3", "model.capped_samples=true"]
    result = subprocess.run(
        [sys.executable, "bench/rank_alone.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["at"] == 6 and report["one"]["ms_per_step"] > 0 and report["one"]["sizes"]
    assert [(s["ranks"], s["cut"]) for s in report["splits"]] == [(2, "work"), (2, "even")]
    for split in report["splits"]:
        assert len(split["planes"]) == 1 and len(split["rank"]) == 2 and split["one_over_slowest"] > 0
        one_march = report["one"]["sizes"]["march"]
        assert all(0 < rank["sizes"]["march"] <= one_march for rank in split["rank"])  # a slab's samples, fewer
    for timed in (report["one"], *(rank for split in report["splits"] for rank in split["rank"])):
        calls = timed["kernels"]["calls"]  # by ATen call and shapes (the CPU's own time here; no kernels)
        assert 0 < len(calls) <= 5 and any(name.startswith("aten::") for name, *_ in calls)
        assert all(not name.startswith("Optimizer.") for name, *_ in calls)  # no annotations: they repeat their calls
    assert not (tmp_path / "run" / "metrics.json").exists()  # the frozen model is not evaluated as the run's


def test_the_emulated_gather_hands_each_rank_the_others_parts():
    sys.path.insert(0, str(REPO / "bench"))
    from rank_alone import Exchanges

    fronts = {0: torch.tensor([1.0, 2.0]), 2: torch.tensor([5.0, 6.0])}
    exchanges = Exchanges(1, 3, fronts)
    parts = torch.full((6,), float("nan"))
    exchanges.all_gather(parts, torch.tensor([3.0, 4.0]))
    assert parts.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    composite = torch.full((3 * 2, 4), float("nan"))
    exchanges.all_gather(composite, torch.ones(2, 4))
    assert composite.view(3, 2, 4)[1].eq(1).all() and composite.view(3, 2, 4)[[0, 2]].eq(0).all()
    counts = torch.full((9,), -1, dtype=torch.int64)
    exchanges.all_gather(counts, torch.tensor([7, 5, 3]))
    assert counts.view(3, 3).eq(torch.tensor([7, 5, 3])).all()


def test_with_the_slabs_fronts_each_rank_keeps_its_share_of_one_march():
    """The emulation's claim: handed the other slabs' true optical depth in front, each rank keeps (after early
    termination) exactly its slab's share of one process's samples, so the ranks' counts sum to one march's; with
    nothing in front (zeros) a rank behind keeps more."""
    from types import SimpleNamespace

    from test_model import randomize_density
    from test_space_split import scene

    sys.path.insert(0, str(REPO / "bench"))
    from rank_alone import Exchanges, slab_fronts

    from models import space_split
    from models.render_views import march

    model, origins, directions, jitter = scene("per_sample")
    randomize_density(model, mean=5.0, std=3.0)  # opaque enough that early termination drops samples behind
    model.refresh_occupancy()
    batch = SimpleNamespace(origins=origins, directions=directions, jitter=jitter, views=None)
    want = int(march(model, origins, directions, jitter)["samples"])
    planes = space_split.Slabs.even(model.grid_shape[0], 3, 0).planes
    plain = space_split.ALL_GATHER
    try:
        fronts = slab_fronts(model, batch, planes)
        kept, kept_alone = [], []
        for rank in range(3):
            for counts, given in ((kept, fronts), (kept_alone, {k: torch.zeros_like(f) for k, f in fronts.items()})):
                space_split.ALL_GATHER = Exchanges(rank, 3, given).all_gather
                out = space_split.split_march(model, space_split.Slabs(planes, rank), origins, directions, jitter)
                counts.append(int(out["samples"]))
    finally:
        space_split.ALL_GATHER = plain
    assert sum(kept) == want and all(0 < count < want for count in kept)
    assert sum(kept_alone) > want


def test_the_phases_between_the_exchanges_and_the_barriers_they_make():
    """exchange_phases: a step's phases are the device time from marker to marker; S ranks take the sum over the
    barrier phases of the slowest rank's, Adam and the next march being one phase."""
    sys.path.insert(0, str(REPO / "bench"))
    from exchange_phases import MARKER, barrier_ms, phase_times

    def step(t0: float, gaps: list[float], exchanges: int = 4) -> list[tuple[str, float, float]]:
        """A step marker (10 us) at t0, then kernels and exchange markers (2 us) after the given phases (us)."""
        kernels, t = [(MARKER, t0, t0 + 10.0)], t0 + 10.0
        for k, gap in enumerate(gaps):
            kernels.append(("void march_kernel", t + 1.0, t + gap - 1.0))  # the phase's work, gaps included
            t += gap
            if k < exchanges:
                kernels.append((MARKER, t, t + 2.0))
                t += 2.0
        return kernels

    first = step(0.0, [100.0, 20.0, 300.0, 500.0, 80.0])  # 10 + the phases + 4 markers of 2 us: 1018 us
    second = step(1018.0, [110.0, 25.0, 290.0, 520.0, 60.0])
    extra = step(2041.0, [50.0, 20.0, 20.0, 300.0, 500.0, 70.0], exchanges=5)  # an eager step: left out
    closing = [(MARKER, 3021.0, 3031.0)]
    kernels = first + second + extra + closing
    assert phase_times(list(reversed(kernels))) == [
        [0.1, 0.02, 0.3, 0.5, 0.08],
        [0.11, 0.025, 0.29, 0.52, 0.06],
    ]
    # one process: no exchanges, each step whole (from its marker's end to the next marker)
    one = step(0.0, [900.0], exchanges=0) + step(910.0, [950.0], exchanges=0) + [(MARKER, 1870.0, 1880.0)]
    assert phase_times(one, 0) == [[0.9], [0.95]]
    ranks = [[0.1, 0.02, 0.3, 0.5, 0.08], [0.2, 0.03, 0.25, 0.45, 0.1]]
    # (Adam + march) max(0.18, 0.3) + max(0.02, 0.03) + max(0.3, 0.25) + max(0.5, 0.45), above the slowest sum 1.03
    assert barrier_ms(ranks) == pytest.approx(0.3 + 0.03 + 0.3 + 0.5)
    assert barrier_ms(ranks) > max(sum(rank) for rank in ranks)
