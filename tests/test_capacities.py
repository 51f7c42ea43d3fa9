"""models.capacities and ``model.capped_samples``: the training march and its shading compaction into fixed sample
capacities (no device sync for their counts) train what the plain march trains, the capacities follow the counts
(grow after an overflow, shrink as the samples per ray fall), and the padding rows stay out of the regularisers."""

from __future__ import annotations

import json

import pytest
import torch
from test_train import run_train, tiny_overrides

from models.capacities import GROWTH, HEADROOM, KEEP, KINDS, LAG, SPREAD, WARM_KEEP, WINDOW, SampleCapacities, headroom
from models.decoder import padded_rows
from models.regularizers import RenderedSamples


@pytest.fixture(scope="module")
def scene_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("scene_cache")


def test_headroom_is_a_decoder_size_just_above_the_count():
    for count in (0, 1, 7, 1000, 123_457):
        size = headroom(count)
        assert size >= HEADROOM * count and size >= 1 and padded_rows(size) == size
        assert size <= max(HEADROOM * count * (1 + 1 / 64) + 1, 1)
    # a small batch's count varies more: room in proportion to 1 / sqrt(rays)
    assert headroom(10_000, rays=64) >= (HEADROOM + SPREAD / 8) * 10_000 > headroom(10_000, rays=98_304)
    assert headroom(10_000, rays=98_304) >= (HEADROOM + SPREAD / 98_304**0.5) * 10_000


def test_sizes_are_measured_then_follow_the_counts():
    capacities = SampleCapacities()
    assert capacities.measuring and not capacities.review()
    capacities.measured(1000, 600, 300)
    measured = {"march": headroom(1000), "alive": headroom(600), "shown": headroom(300)}
    assert not capacities.measuring and capacities.sizes == measured
    capacities.observe(torch.tensor([1040]), torch.tensor([500, 315]))
    capacities.observe(torch.tensor([900]), torch.tensor([630, 200]))
    assert not capacities.review()  # 1040, 630, 315: within the sizes
    assert capacities.sizes == measured
    capacities.observe(torch.tensor([1400]), torch.tensor([600, 100]))  # the march overflowed: grown at once
    assert capacities.overflows == 1 and capacities.sizes["march"] == headroom(GROWTH * 1400)
    assert capacities.sizes["alive"] == measured["alive"] and capacities.sizes["shown"] == measured["shown"]
    assert capacities.review() and not capacities.review()  # found once
    for _ in range(WINDOW - 3):  # the window's peak (1400, 630, 315): only the grown march is far above it
        capacities.observe(torch.tensor([300]), torch.tensor([100, 40]))
    assert capacities.sizes == {"march": headroom(1400), "alive": measured["alive"], "shown": measured["shown"]}
    for _ in range(WINDOW):  # far fewer samples a ray: every size shrinks to the new peak's
        capacities.observe(torch.tensor([300]), torch.tensor([100, 40]))
    assert capacities.sizes == {"march": headroom(300), "alive": headroom(100), "shown": headroom(40)}
    capacities.invalidate()
    assert capacities.measuring
    report = capacities.report()
    assert {key: report[key] for key in ("sizes", "overflows", "shrinks", "reviews")} == {
        "sizes": capacities.sizes, "overflows": 1, "shrinks": 4, "reviews": 3
    }  # fmt: skip
    # the mean share of each size that held samples over the 40 checked steps (shown: never grown nor shrunk)
    shown = (315 + 200 + 100 + 37 * 40) / 40 / measured["shown"]
    assert report["fill"]["shown"] == pytest.approx(shown, abs=1e-4)


def test_a_measurement_keeps_the_sizes_that_still_fit():
    """After a refresh the counts move a little: a size that holds the new count's capacity, and is at most KEEP
    times above it, stays (so a step graph captured for the sizes is kept); the others take the new count's."""
    capacities = SampleCapacities()
    capacities.measured(10_000, 6_000, 3_000, rays=4096)
    before = dict(capacities.sizes)
    capacities.invalidate()
    capacities.measured(9_900, 6_000 * 2, int(3_000 / (KEEP * 1.1)), rays=4096)  # a little less, twice, far less
    assert capacities.sizes["march"] == before["march"]
    assert capacities.sizes["alive"] == headroom(12_000, 4096) > before["alive"]
    assert capacities.sizes["shown"] == headroom(int(3_000 / (KEEP * 1.1)), 4096) < before["shown"]
    assert not capacities.measuring


def test_a_count_rising_fast_grows_its_size_within_the_step():
    """Early in a run the shown samples multiply as the density forms: each overflow makes room for twice the
    count, so a hundredfold rise costs a handful of overflowing steps, not the steps to the next log."""
    capacities = SampleCapacities()
    capacities.measured(1000, 1000, 10)
    overflowing = 0
    for step in range(40):
        shown = min(10 * 1.2**step, 1000)
        overflowing += shown > capacities.sizes["shown"]
        capacities.observe(torch.tensor([1000]), torch.tensor([1000, int(shown)]))
    assert capacities.overflows == overflowing and 0 < overflowing <= 8
    assert capacities.sizes["shown"] >= 1000


def test_ranks_that_share_their_counts_hold_the_same_sizes_set_by_the_largest():
    """The space split (``share``): every rank sizes from the largest rank's counts at the same steps, so their sizes
    (and step graphs) change together; each keeps its own fill."""
    generator = torch.Generator().manual_seed(3)
    ranks = [SampleCapacities(), SampleCapacities()]
    now: list[torch.Tensor] = []  # this step's (2, 3) counts, rank 0's then rank 1's

    def share(rank: int, counts: torch.Tensor) -> torch.Tensor:
        assert torch.equal(counts, now[0][rank])  # a rank sends its own
        return now[0].clone()

    for rank, capacities in enumerate(ranks):
        capacities.share, capacities.rank = (lambda counts, rank=rank: share(rank, counts)), rank
    now[:] = [torch.tensor([[1000, 600, 300], [700, 300, 200]])]
    for capacities in ranks:
        capacities.measured(*now[0][capacities.rank].tolist())
    assert ranks[0].sizes == ranks[1].sizes == {"march": headroom(1000), "alive": headroom(600), "shown": headroom(300)}
    for step in range(3 * WINDOW):  # the larger rank's counts fall, then one step overflows the lighter rank's
        big = torch.tensor([1000, 600, 300]) * (1.0 - step / (4 * WINDOW)) + torch.rand(3, generator=generator) * 10
        small = torch.tensor([700, 300, 200]) * (2.5 if step == WINDOW else 0.9)
        now[:] = [torch.stack([big, small]).long()]
        for capacities in ranks:
            own = now[0][capacities.rank]
            capacities.observe(own[:1], own[1:])
        assert ranks[0].sizes == ranks[1].sizes, step
    assert ranks[0].overflows == ranks[1].overflows == 1 and ranks[0].shrinks == ranks[1].shrinks >= 1
    assert ranks[0].report()["fill"] != ranks[1].report()["fill"]  # each its own rows' share of the sizes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the counts' copy to the host without a sync")
def test_counts_on_the_device_are_checked_within_the_lag():
    capacities = SampleCapacities()
    capacities.measured(1000, 600, 300)
    device = torch.device("cuda")
    capacities.observe(torch.tensor([5000], device=device), torch.tensor([500, 200], device=device))
    for _ in range(LAG):  # steps within the counts
        capacities.observe(torch.tensor([900], device=device), torch.tensor([500, 200], device=device))
    torch.cuda.synchronize()
    capacities.observe(torch.tensor([900], device=device), torch.tensor([500, 200], device=device))
    assert capacities.overflows == 1 and capacities.sizes["march"] == headroom(GROWTH * 5000)
    assert len(capacities.in_flight) <= LAG
    capacities.observe(torch.tensor([20000], device=device), torch.tensor([500, 200], device=device))
    assert capacities.review() and capacities.overflows == 2 and not capacities.in_flight


def test_every_step_before_the_occupancy_warmup_measures():
    """``model.capped_refresh=measure``: before the warmup the density forms and the samples shaded multiply from
    step to step: a capped step there overflows (lego, one H200: runs with two or three such steps ended 0.2-0.4 dB
    from the plain march's). So every step until then measures; after it, only refreshes (the first at the warmup)
    and growth do."""
    from test_model import make_model

    settings = {"capped_samples": True, "capped_refresh": "measure", "occupancy.warmup": 5, "grow_at": []}
    model = make_model(**settings, **{"occupancy.refresh_every": 4})
    measured = []
    for step in range(1, 13):
        model.capacities.measured(1000, 600, 300)
        model.on_step(step, 100)
        measured.append(model.capacities.measuring)
    assert [step for step, measures in zip(range(1, 13), measured) if measures] == [1, 2, 3, 4, 5, 8, 12]
    # model.capped_refresh=observe: the refreshes past the warmup go without a measuring step
    model = make_model(**{**settings, "capped_refresh": "observe", "occupancy.refresh_every": 4})
    measured, generations = [], []
    for step in range(1, 13):
        model.capacities.measured(1000, 600, 300)
        model.on_step(step, 100)
        measured.append(model.capacities.measuring)
        generations.append(model.capacities.generation)
    assert [step for step, measures in zip(range(1, 13), measured) if measures] == [1, 2, 3, 4, 5]
    assert generations == [0] * 7 + [1] * 4 + [2]  # refreshed at steps 8 and 12


def test_after_an_observed_refresh_the_first_counts_checked_resize():
    """``model.capped_refresh=observe``: no measuring step; the steps run before the refresh are checked as before,
    the first run after it resizes from its counts as a measurement would (a rise past a size: that count's
    capacity, not GROWTH times it), and the checks after that are the usual ones."""
    capacities = SampleCapacities()
    capacities.measured(10_000, 6_000, 3_000, rays=4096)
    before = dict(capacities.sizes)
    capacities.observe(torch.tensor([9_000]), torch.tensor([5_000, 2_000]))  # before the refresh: within the sizes
    capacities.refreshed()
    assert not capacities.measuring  # the capped steps go on
    capacities.observe(torch.tensor([9_950]), torch.tensor([7_000, 1_000]))  # the first after it
    assert capacities.sizes == {
        "march": before["march"],  # still fits within KEEP: kept
        "alive": headroom(7_000, 4096),  # rose past its size (an overflow): the new count's capacity
        "shown": headroom(1_000, 4096),  # fell far: the new count's
    }
    assert capacities.overflows == 1 and capacities.resizes == 1 and capacities.measurements == 1
    resized = dict(capacities.sizes)
    capacities.observe(torch.tensor([30_000]), torch.tensor([5_000, 900]))  # then an overflow grows as before
    assert capacities.sizes["march"] == headroom(GROWTH * 30_000, 4096) and capacities.resizes == 1
    assert capacities.sizes["alive"] == resized["alive"]
    report = capacities.report()
    assert report["measurements"] == 1 and report["resizes"] == 1 and report["overflows"] == 2


def test_an_observed_refresh_resizes_from_the_steps_after_it_not_those_in_flight():
    """Counts still on their way when the refresh comes (on a GPU: checked ``LAG`` steps late) ran with the old mask
    and carry its generation: they are checked as before; the first of a step run after it resizes."""
    capacities = SampleCapacities()
    capacities.measured(10_000, 6_000, 3_000)
    sizes = dict(capacities.sizes)
    capacities.refreshed()
    capacities._check([[5_000, 3_000, 1_000]], sizes, generation=0)  # a step in flight, from before the refresh
    assert capacities.sizes == sizes and capacities.resizes == 0
    capacities._check([[5_000, 3_000, 1_000]], sizes, generation=1)  # the first run after it
    assert capacities.sizes == {"march": headroom(5_000), "alive": headroom(3_000), "shown": headroom(1_000)}
    capacities._check([[4_000, 2_000, 500]], dict(capacities.sizes), generation=1)  # then as before: no resize
    assert capacities.resizes == 1 and capacities.sizes["march"] == headroom(5_000)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the counts' copy to the host without a sync")
def test_on_the_device_an_observed_refresh_resizes_from_the_first_step_after_it():
    capacities = SampleCapacities()
    capacities.measured(10_000, 6_000, 3_000)
    device = torch.device("cuda")
    for _ in range(LAG):  # in flight at the refresh
        capacities.observe(torch.tensor([9_000], device=device), torch.tensor([5_000, 2_000], device=device))
    capacities.refreshed()
    capacities.observe(torch.tensor([5_000], device=device), torch.tensor([3_000, 1_000], device=device))
    assert capacities.review() is False and capacities.resizes == 1
    assert capacities.sizes == {"march": headroom(5_000), "alive": headroom(3_000), "shown": headroom(1_000)}


def test_observing_the_warmup_measures_while_the_shown_samples_rise_then_follows_them():
    """``model.capped_refresh=observe`` before the warmup: the first steps measure until a measurement finds fewer
    shown samples than the one before; the later steps follow their own counts (one resize a step, no step graph);
    the warmup's refresh and a growth measure, the later refreshes are followed."""
    capacities = SampleCapacities()
    warmup, measured, followed = 6, [], []
    shown = iter([100, 300, 500, 400, 350])  # rising, then falling at the fourth measurement
    for step in range(1, 10):
        if capacities.measuring:
            capacities.measured(1000, 800, next(shown))
            measured.append(step)
        else:
            capacities.observe(torch.tensor([900]), torch.tensor([700, 300]))
            followed.append((step, capacities.warming))
        capacities.schedule(step, warmup, grown=False, refreshed=step == warmup, observe=True)
    assert measured == [1, 2, 3, 4, 7] and capacities.measurements == 5
    assert followed == [(5, True), (6, True), (8, False), (9, False)]  # warming until the warmup's step
    assert capacities.resizes == 2  # steps 5 and 6 (the step after a refresh-free step past the warmup is not)
    capacities.schedule(10, warmup, grown=True, refreshed=False, observe=True)
    assert capacities.measuring and not capacities.warming  # a growth measures
    capacities.measured(1000, 800, 300)
    capacities.schedule(20, warmup, grown=False, refreshed=True, observe=True)
    assert not capacities.measuring and capacities.generation == 3  # a refresh past the warmup is followed
    measuring = SampleCapacities()  # capped_refresh=measure: every step before the warmup measures, then refreshes
    for step in range(1, 9):
        measuring.measured(1000, 800, 500 - step)
        measuring.schedule(step, warmup, grown=False, refreshed=step in (6, 8), observe=False)
        assert measuring.measuring == (step <= 6 or step == 8) and not measuring.warming, step


def test_while_warming_a_size_stays_until_its_counts_fall_below_the_warm_band():
    """Before the warmup (``observe``) the counts fall at almost every step: each step's resize keeps a size until it
    exceeds ``WARM_KEEP`` times the capacity its counts need (the step graph then serves several steps); past the
    warmup ``KEEP`` holds again."""
    capacities = SampleCapacities()
    capacities.measured(100_000, 60_000, 30_000)
    capacities.measured(100_000, 60_000, 20_000)  # falling: the steps now follow their counts
    sizes = dict(capacities.sizes)
    warmup = 50
    counts = {10: [95_000, 55_000, 19_000], 11: [90_000, 50_000, 16_000], 12: [70_000, 40_000, 16_500]}
    for step, now in counts.items():
        capacities.schedule(step, warmup, grown=False, refreshed=False, observe=True)
        assert capacities.warming
        capacities._check([now], dict(capacities.sizes), capacities.generation)
        if step < 12:  # within the band: every size kept (no new graph)
            assert capacities.sizes == sizes, step
    fresh = [headroom(count) for count in counts[12]]
    for kind, size, old in zip(KINDS, fresh, sizes.values()):
        assert capacities.sizes[kind] == (old if old <= WARM_KEEP * size else size), kind
    assert capacities.sizes["march"] == headroom(70_000) and capacities.sizes["shown"] == sizes["shown"]
    assert sizes["march"] > WARM_KEEP * headroom(70_000) and sizes["shown"] <= WARM_KEEP * headroom(16_500)
    capacities.schedule(warmup, warmup, grown=False, refreshed=True, observe=True)  # the warmup's refresh: measured
    capacities.measured(60_000, 30_000, 10_000)
    capacities.schedule(warmup + 1, warmup, grown=False, refreshed=False, observe=True)
    assert not capacities.warming
    capacities.schedule(warmup + 2, warmup, grown=False, refreshed=True, observe=True)
    capacities._check([[50_000, 25_000, 9_000]], dict(capacities.sizes), capacities.generation)
    assert capacities.sizes["march"] == headroom(50_000)  # 60k's size is more than KEEP above 50k's: resized


def test_ranks_resize_together_after_an_observed_refresh():
    """Split by space, every rank refreshes at the same step and resizes from the same shared counts."""
    ranks = [SampleCapacities(), SampleCapacities()]
    now = torch.tensor([[1000, 600, 300], [700, 300, 200]])
    for rank, capacities in enumerate(ranks):
        capacities.share, capacities.rank = (lambda counts: now.clone()), rank
        capacities.measured(*now[rank].tolist())
    for capacities in ranks:
        capacities.refreshed()
    now = torch.tensor([[800, 500, 250], [990, 700, 260]])  # the lighter rank now carries more
    for capacities in ranks:
        own = now[capacities.rank]
        capacities.observe(own[:1], own[1:])
    largest = [max(column) for column in zip(*now.tolist())]  # (990, 700, 260)
    assert headroom(largest[0]) <= headroom(1000) <= KEEP * headroom(largest[0])  # the march's size still fits
    want = {"march": headroom(1000), "alive": headroom(largest[1]), "shown": headroom(largest[2])}
    assert ranks[0].sizes == ranks[1].sizes == want
    assert ranks[0].resizes == ranks[1].resizes == 1


def test_overflows_are_reported_with_their_steps():
    capacities = SampleCapacities()
    capacities.measured(1000, 600, 300)
    for march in (900, 2000, 900, 900, 5000):
        capacities.observe(torch.tensor([march]), torch.tensor([500, 200]))
    report = capacities.report()
    assert report["overflows"] == 2 and report["overflowed_at"] == [2, 5]


def test_the_regularisers_leave_out_the_padding_rows():
    ray, t = torch.tensor([0, 0, 1, 1, 1, 1]), torch.tensor([0.1, 0.2, 0.1, 0.3, 0.0, 0.0])
    depth = torch.tensor([0.5, 0.25, 1.0, 0.5, 9.0, 9.0])  # the last two rows: padding (no ray's range)
    offsets = torch.tensor([0, 2, 4])
    padded = RenderedSamples(ray, t, depth, 0.1, offsets=offsets, padded=True)
    plain = RenderedSamples(ray[:4], t[:4], depth[:4], 0.1, offsets=offsets)
    limit = torch.tensor([1.0, 1.0])
    torch.testing.assert_close(padded.near_density(limit), plain.near_density(limit))
    torch.testing.assert_close(padded.weights(2)[:4], plain.weights(2))


def _metrics(path) -> dict:
    return json.loads((path / "metrics.json").read_text())


def _common(cache, iters: int, shading: str) -> list[str]:
    per_sample = ["model.shading=per_sample", "model.upsample=1"] if shading == "per_sample" else []
    # the occupancy refreshed (the capacities measured again) and reviewed at log steps within the run
    return tiny_overrides(cache, iters) + per_sample + [
        "train.turntable_frames=0", "train.log_every=4", "model.occupancy.warmup=3", "model.occupancy.refresh_every=5",
        "train.near_density_loss=0.01", "train.distortion_loss=0.002",
    ]  # fmt: skip


@pytest.mark.parametrize("shading", ["deferred", "per_sample"])
def test_capped_samples_train_what_the_plain_march_trains(tmp_path, scene_cache, shading):
    from training.compact_model import read_model

    runs, histories = {}, {}
    for capped in (False, True):
        run = tmp_path / f"capped_{capped}"
        args = _common(scene_cache, 16, shading) + [
            f"hydra.run.dir={run}",
            f"model.capped_samples={str(capped).lower()}",
        ]
        result = run_train(args)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        runs[capped], histories[capped] = _metrics(run), read_model(run / "model.pt")[1]["history"]
    # the same training up to float rounding: the padding rows composite to nothing and get no gradient
    assert histories[True]["loss"] == pytest.approx(histories[False]["loss"], rel=1e-7)
    assert runs[True]["psnr"] == pytest.approx(runs[False]["psnr"], abs=1e-6)
    report = runs[True]["sample_capacity"]
    assert report["reviews"] >= 3 and report["overflows"] == 0 and runs[False]["sample_capacity"] is None


def test_an_overflow_is_counted_and_the_sizes_grow(tmp_path, scene_cache, monkeypatch):
    """Capacities below the counts (a headroom under 1): the last rays of a batch lose samples, training goes on,
    the review counts the overflow and grows the sizes past the peak."""
    from hydra import compose, initialize_config_dir
    from test_train import REPO

    from models import capacities
    from training import app as app_module

    monkeypatch.setattr(capacities, "HEADROOM", 0.5)
    overrides = _common(scene_cache, 12, "per_sample") + ["model.capped_samples=true"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    assert app_module.run(cfg, tmp_path / "run") == 0
    metrics = _metrics(tmp_path / "run")
    assert metrics["sample_capacity"]["overflows"] >= 1 and metrics["psnr"] > 0


def test_an_observed_refresh_trains_with_fewer_measuring_steps(tmp_path, scene_cache):
    """``model.capped_refresh=observe`` in a run: measuring steps only before the warmup (and at it), each later
    refresh resized from its first counts; training goes on to a PSNR near the measuring run's."""
    runs = {}
    for mode in ("measure", "observe"):
        run = tmp_path / mode
        args = _common(scene_cache, 16, "per_sample") + [
            f"hydra.run.dir={run}", "model.capped_samples=true", f"model.capped_refresh={mode}", "model.grow_at=[]"
        ]  # fmt: skip
        result = run_train(args)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        runs[mode] = _metrics(run)
    measure, observe = runs["measure"]["sample_capacity"], runs["observe"]["sample_capacity"]
    # warmup 3: steps 1-4 measure (the first, after on_step at 1 and 2, after the warmup's refresh at 3), and the
    # refreshes at 5, 10, 15 have steps 6, 11, 16 measure; observing, step 3 follows its counts if step 2's
    # measurement fell, and the first counts after each later refresh resize
    assert measure["measurements"] == 7 and measure["resizes"] == 0
    assert observe["measurements"] in (3, 4) and observe["resizes"] == 7 - observe["measurements"]
    assert runs["observe"]["psnr"] == pytest.approx(runs["measure"]["psnr"], abs=0.5)


def test_capped_refresh_is_checked(tmp_path, scene_cache):
    result = run_train(
        _common(scene_cache, 2, "deferred") + [f"hydra.run.dir={tmp_path}", "model.capped_refresh=sometimes"]
    )
    assert result.returncode != 0 and "model.capped_refresh: expected 'measure' or 'observe'" in result.stderr
