"""The march planned ahead (models.render_views.plan_march, training.lookahead): a plan decides which samples are
marched, composited and shaded; what is rendered, and its gradient, comes from the grids at the step that uses
it; a plan whose march state changed is made again; the trainer plans every step's march one step early."""

from __future__ import annotations

import pytest
import torch
from test_model import make_model, randomize_density, rays_towards_centre
from test_train import REPO, tiny_overrides

from models import render_views
from models.render_views import march, plan_march
from training.lookahead import MarchLookahead, usable


@pytest.fixture(scope="module")
def tiny_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("scene_cache")


OUTPUTS = ("diffuse", "features", "depth", "opacity")


def trained_model(**overrides):
    model = make_model(**overrides).double()
    randomize_density(model, mean=-1.0, std=3.0)  # partly transparent rays: every threshold has work
    with torch.no_grad():
        model.features.grid.normal_(generator=torch.Generator().manual_seed(3))
    model.refresh_occupancy()
    return model.train()


def rays(count=96, seed=0):
    origins, directions = rays_towards_centre(count, seed)
    jitter = torch.rand(count, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    return origins.double(), directions.double(), jitter


def assert_same(a: dict, b: dict) -> None:
    for key in OUTPUTS:
        assert torch.equal(a[key], b[key]), key
    assert int(a["samples"]) == int(b["samples"])


def test_a_plan_made_now_renders_what_the_march_renders():
    model = trained_model()
    origins, directions, jitter = rays()
    fresh = march(model, origins, directions, jitter)
    plan = plan_march(model, origins, directions, jitter)
    assert plan.fits(model, len(origins))
    planned = march(model, origins, directions, jitter, plan=plan)
    assert_same(fresh, planned)
    assert 0 < int(fresh["samples"])
    # the same gradients reach the grids
    grads = []
    for out in (fresh, march(model, origins, directions, jitter, plan=plan_march(model, origins, directions, jitter))):
        model.zero_grad(set_to_none=True)
        (out["diffuse"].square().sum() + out["depth"].sum()).backward()
        grads.append([model.density.grid.grad.clone(), model.features.grid.grad.clone()])
    for a, b in zip(*grads):
        assert a.abs().sum() > 0 and torch.equal(a, b)


def test_a_plan_picks_the_samples_and_the_current_grids_are_rendered():
    # no thresholds: a plan's samples do not depend on the densities, so after an update it renders exactly
    # what a fresh march does
    model = trained_model(early_termination=0.0, weight_threshold=0.0)
    origins, directions, jitter = rays(seed=1)
    plan = plan_march(model, origins, directions, jitter)
    with torch.no_grad():  # an optimiser step between the plan and its use
        model.density.grid.add_(torch.randn_like(model.density.grid))
        model.features.grid.mul_(0.5)
    before = march(model, origins, directions, jitter)
    assert_same(before, march(model, origins, directions, jitter, plan=plan))


def test_thresholds_are_decided_on_the_grids_the_plan_saw():
    model = trained_model()
    origins, directions, jitter = rays(seed=2)
    plan = plan_march(model, origins, directions, jitter)
    kept = len(plan.samples)
    with torch.no_grad():  # much denser: a fresh march would stop its rays far earlier
        model.density.grid.add_(6.0)
    assert int(march(model, origins, directions, jitter)["samples"]) < kept
    assert int(march(model, origins, directions, jitter, plan=plan)["samples"]) == kept


@pytest.mark.parametrize("change", ["occupancy", "growth"])
def test_a_plan_is_made_again_when_the_march_state_changed(change):
    model = trained_model()
    origins, directions, jitter = rays(seed=3)
    plan = plan_march(model, origins, directions, jitter)
    with torch.no_grad():
        model.density.grid.sub_(4.0)  # emptier: the refreshed occupancy grid skips more cells
    if change == "occupancy":
        model.refresh_occupancy()
    else:
        model.set_resolution(model.config.resolution_end)
    assert not plan.fits(model, len(origins))
    fresh = march(model, origins, directions, jitter)
    assert_same(fresh, march(model, origins, directions, jitter, plan=plan))


def test_a_plan_for_other_rays_is_not_used():
    model = trained_model()
    origins, directions, jitter = rays(seed=4)
    plan = plan_march(model, origins[:10], directions[:10], jitter[:10])
    assert not plan.fits(model, len(origins)) and plan.fits(model, 10)
    assert_same(march(model, origins, directions, jitter), march(model, origins, directions, jitter, plan=plan))


def test_lookahead_is_off_where_the_marks_or_the_rays_change_each_step():
    model = make_model()
    assert usable(model)
    model.touched.enabled = True
    assert not usable(model)


def lookahead_run(tmp_path, tiny_cache, monkeypatch, *extra: str) -> dict:
    from hydra import compose, initialize_config_dir

    from training import app as app_module

    calls = {"ahead": 0, "in_step": 0}
    original = render_views.plan_march

    def counted(model, *args, **kwargs):
        calls["ahead" if model.training and counted.ahead else "in_step"] += 1
        return original(model, *args, **kwargs)

    counted.ahead = False
    plan_next = MarchLookahead.plan_next

    def ahead(self, model):
        counted.ahead = True
        try:
            plan_next(self, model)
        finally:
            counted.ahead = False

    monkeypatch.setattr(render_views, "plan_march", counted)
    monkeypatch.setattr(MarchLookahead, "plan_next", ahead)
    overrides = tiny_overrides(tiny_cache, 12) + ["train.turntable_frames=0", "train.eval_every=0", *extra]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    assert app_module.run(cfg, tmp_path) == 0
    return calls


def test_the_trainer_plans_each_step_one_step_ahead(tmp_path, tiny_cache, monkeypatch):
    calls = lookahead_run(tmp_path / "on", tiny_cache, monkeypatch, "train.lookahead=true")
    assert calls["ahead"] == 12  # steps 2..12 and one spare after the last
    # planned again in their step: the first, and those after a growth or an occupancy refresh
    assert 1 <= calls["in_step"] < 12
    off = lookahead_run(tmp_path / "off", tiny_cache, monkeypatch, "train.lookahead=false")
    assert off == {"ahead": 0, "in_step": 12}


@pytest.mark.requires_cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_side_stream_computes_what_one_stream_does(tmp_path, tiny_cache, monkeypatch):
    """The plans on the side stream, ordered by events, against the same order on the main stream alone: a
    missing wait (a plan reading a grid Adam is writing, a plan's tensor reused too early) changes the run."""
    from training.compact_model import read_model

    histories = {}
    for name in ("side", "one"):
        if name == "one":
            built = MarchLookahead.__init__

            def one_stream(self, device, built=built):
                built(self, device)
                self.stream = None  # the same order, on the main stream

            monkeypatch.setattr(MarchLookahead, "__init__", one_stream)
        calls = lookahead_run(
            tmp_path / name, tiny_cache, monkeypatch, "device=cuda", "ops=custom", "train.lookahead=true"
        )
        assert calls["ahead"] == 12
        histories[name] = read_model(tmp_path / name / "model.pt")[1]["history"]
    assert histories["side"]["step"] == histories["one"]["step"]
    assert histories["side"]["loss"] == pytest.approx(histories["one"]["loss"], rel=1e-4)
