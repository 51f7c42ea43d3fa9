"""models.space_split (issue 33): gloo ranks (two and three), each marching, shading and differentiating only the
samples of its slab, composite across the slabs what one process's ``model.march`` renders, and their gradients
are one process's: each rank's on its own vertices, the two owners' sum on a shared plane, their sum for the
decoder."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_model import make_model, randomize_density, rays_towards_centre

from models.capacities import SampleCapacities
from models.grid_tv import DeferredTV
from models.render_views import march
from models.space_split import Slabs, ray_sums, split_march
from training.space_parallel import SpaceParallel

OUTPUTS = ("diffuse", "features", "depth", "opacity")


def scene(shading: str):
    overrides = {"shading": shading, "upsample": 1} if shading == "per_sample" else {}
    model = make_model(seed=2, **overrides).double()
    randomize_density(model, mean=-1.0, std=3.0)  # partly opaque rays: early termination and the threshold act
    with torch.no_grad():
        model.features.grid.normal_(generator=torch.Generator().manual_seed(4))
        for parameter in model.decoder.parameters():
            parameter.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(5))
    model.refresh_occupancy()
    origins, directions = rays_towards_centre(160, seed=6)
    jitter = torch.rand(160, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return model.train(), origins.double(), directions.double(), jitter


def loss_of(out: dict) -> torch.Tensor:
    weights = torch.linspace(-1.0, 2.0, out["diffuse"].numel(), dtype=torch.float64).reshape(out["diffuse"].shape)
    return (out["diffuse"] * weights).sum() + out["features"].square().sum() + out["depth"].sum() + out["opacity"].sum()


def gradients(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _rank(rank: int, ranks: int, init_file: str, out: str, shading: str, capped: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
    try:
        model, origins, directions, jitter = scene(shading)
        if capped:  # fixed sample capacities with room to spare: padding rows past every slab's samples
            model.capacities = SampleCapacities()
            model.capacities.measured(40_000, 30_000, 20_000)
        slabs = Slabs.even(model.grid_shape[0], ranks, rank)
        result = split_march(model, slabs, origins, directions, jitter)
        (loss_of(result) / ranks).backward()  # each rank 1/S of the loss (models.space_split._CompositeSlabs)
        detached = {key: result[key].detach() for key in OUTPUTS}
        torch.save({"out": detached, "grads": gradients(model), "samples": int(result["samples"])}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def vertex_rows(slabs: Slabs, vertices: int) -> tuple[int, int]:
    """(first, last) vertex rows of ``slabs``' rank on the first axis, its planes included."""
    first, end = slabs.cells
    return first, vertices - 1 if end is None else end


@pytest.mark.parametrize(
    "shading, capped, count",
    [("deferred", False, 2), ("per_sample", False, 2), ("per_sample", True, 2), ("per_sample", False, 3),
     ("deferred", True, 3)],
)  # fmt: skip
def test_slabs_render_and_differentiate_what_one_march_does(tmp_path, shading, capped, count):
    mp.spawn(_rank, args=(count, str(tmp_path / "init"), str(tmp_path / "out"), shading, capped), nprocs=count)
    ranks = [torch.load(tmp_path / f"out.{rank}") for rank in range(count)]
    model, origins, directions, jitter = scene(shading)
    want = march(model, origins, directions, jitter)
    loss_of(want).backward()
    for rank in ranks:
        for key in OUTPUTS:
            torch.testing.assert_close(rank["out"][key], want[key].detach(), atol=1e-10, rtol=1e-9)
    assert all(rank["samples"] > 0 for rank in ranks)
    assert sum(rank["samples"] for rank in ranks) == int(want["samples"])
    r0 = model.grid_shape[0]
    slabs = [Slabs.even(r0, count, rank) for rank in range(count)]
    close = {"atol": 1e-10, "rtol": 1e-9}
    for name, grad in gradients(model).items():
        got = [rank["grads"].get(name, torch.zeros_like(grad)) for rank in ranks]
        if not name.endswith(".grid"):  # the decoder: each rank's samples' share
            torch.testing.assert_close(sum(got), grad, **close)
            continue
        for rank, slab in enumerate(slabs):  # each rank's own vertices; a plane's from its two owners
            first, last = vertex_rows(slab, r0)
            assert not got[rank][:first].any() and not got[rank][last + 1 :].any()
            torch.testing.assert_close(got[rank][first + 1 : last], grad[first + 1 : last], **close)
            assert grad[first + 1 : last].abs().sum() > 0
        for plane in slabs[0].planes:
            torch.testing.assert_close(sum(g[plane] for g in got), grad[plane], **close)
        torch.testing.assert_close(got[0][0], grad[0], **close)
        torch.testing.assert_close(got[-1][-1], grad[-1], **close)


def _kept_plane_rank(rank: int, ranks: int, init_file: str, out: str, clear: bool) -> None:
    """Steps of the split's gradient handling on a plane row no Adam step clears (the TV's, in empty space): every
    step adds 0.25 on each owner, the sync sums the owners' copies, then (``clear``) the upper owner drops its copy,
    as the trainer does after Adam. Saves the row's value after each sync."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
    try:
        model = scene("deferred")[0]
        split = space_split_of(model, rank, ranks)
        for grid in (model.density.grid, model.features.grid):
            grid.grad = torch.zeros_like(grid)
        owned = [plane for plane in split.slabs.planes if plane in split.slabs.cells]
        seen = []
        for _ in range(6):
            for plane in owned:
                model.density.grid.grad[plane, 1, 2] += 0.25  # this step's own part on the plane
            split.sync_gradients()
            seen.append([float(model.density.grid.grad[plane, 1, 2]) for plane in split.slabs.planes])
            if clear:
                split.clear_upper_planes()
        torch.save(seen, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("count", [2, 3])
def test_a_plane_gradient_kept_between_steps_adds_up_as_in_one_process(tmp_path, count):
    """Both owners hold a plane's summed gradient after the sync; a row Adam does not clear keeps it, and without
    the upper owner's clear the next sum doubles it (two H200s: inf, then a NaN loss)."""
    for clear in (True, False):
        out = tmp_path / f"out_{clear}"
        mp.spawn(_kept_plane_rank, args=(count, str(tmp_path / f"init_{clear}"), str(out), clear), nprocs=count)
        seen = [torch.load(f"{out}.{rank}") for rank in range(count)]
        for rank in range(count):
            slabs = Slabs.even(scene("deferred")[0].grid_shape[0], count, rank)
            for p, plane in enumerate(slabs.planes):
                if plane not in slabs.cells:
                    continue
                values = [step[p] for step in seen[rank]]
                one_process = [0.5 * (k + 1) for k in range(6)]  # two owners' 0.25 a step, accumulated
                if clear:
                    assert values == pytest.approx(one_process)
                else:
                    assert values[-1] > 4 * one_process[-1]  # doubled a step


def test_the_cut_counts_the_shaded_samples_from_the_occupancy_warmup_on():
    """Before the warmup every ray crosses the whole box: those steps' samples would pull the planes towards where
    a dense march puts them, not where the later steps' fall."""
    model = scene("deferred")[0]
    split = space_split_of(model, 0)
    warmup = model.config.occupancy.warmup
    for step, counted in ((0, False), (warmup - 1, False), (warmup, True), (warmup + 7, True)):
        split.trainer = SimpleNamespace(step=step)  # steps done: the next one's forward counts or not
        layers = split._counting()
        assert (layers is not None) == counted, step
        assert layers is None or layers.numel() == model.grid_shape[0]  # the cell layers, then the steps counted


def test_slabs_split_the_cells_at_their_planes():
    shape = (9, 5, 5)
    x = torch.linspace(-1.0, 1.0, 41, dtype=torch.float64)
    points = torch.stack([x, torch.zeros_like(x), torch.zeros_like(x)], 1)
    zero, one = Slabs((4,), 0).owns(points, shape), Slabs((4,), 1).owns(points, shape)
    assert torch.equal(zero, ~one) and zero[:20].all() and one[20:].all()  # cell 4 starts at x = 0
    three = [Slabs.even(9, 3, rank) for rank in range(3)]
    assert three[0].planes == (3, 6) and [slab.cells for slab in three] == [(0, 3), (3, 6), (6, None)]
    owned = torch.stack([slab.owns(points, shape) for slab in three]).int()
    assert torch.equal(owned.sum(0), torch.ones(41, dtype=torch.int))  # every point in exactly one slab
    for bad in (((4,), 2), ((), 0), ((4, 4), 0), ((0,), 0)):
        with pytest.raises(ValueError, match="planes must be increasing"):
            Slabs(*bad)


def test_ray_sums_sum_each_ray_and_leave_the_padding_out():
    counts = [3, 0, 5, 1, 0, 4]
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    values = torch.rand(int(offsets[-1]) + 7, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.5
    values[int(offsets[-1]) :] = float("nan")  # padding rows: never read
    want = torch.stack([values[a:b].sum() for a, b in zip(offsets[:-1], offsets[1:])])
    torch.testing.assert_close(ray_sums(values, offsets), want, atol=1e-12, rtol=0)
    got = ray_sums(values.float(), offsets)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()


def space_split_of(model, rank: int, ranks: int = 2) -> SpaceParallel:
    """A rank's SpaceParallel on ``model`` without a trainer (a step count stands in: the occupancy's warmup, the
    first step whose shaded samples a cut counts) or a process group (its TV draws need neither)."""
    split = SpaceParallel.__new__(SpaceParallel)
    split.model, split.group = model, SimpleNamespace(rank=rank, world=ranks)
    split._planes, split._layers = None, None
    split.trainer, split.cuts = SimpleNamespace(step=model.config.occupancy.warmup), []  # also the step a cut lists
    return split


@pytest.mark.parametrize("count", [2, 3])
def test_the_tv_cells_are_stratified_by_slab_and_each_rank_keeps_its_own(count):
    model = scene("deferred")[0]
    r0, r1, r2 = model.grid_shape
    samples, cells, layer = 4000, (r0 - 1) * (r1 - 1) * (r2 - 1), (r1 - 1) * (r2 - 1)
    draws, parts = [], []
    for rank in range(count):
        torch.manual_seed(11)
        split = space_split_of(model, rank, count)
        draws.append(split.draw_cells(samples, torch.device("cpu")))
        parts.append(split.owned_cells(draws[-1]))
    assert all(torch.equal(draw, draws[0]) for draw in draws)  # the ranks' random streams stay in step
    assert sum(len(mine) for mine, _ in parts) == samples and sum(share for _, share in parts) == pytest.approx(1.0)
    for rank, (mine, share) in enumerate(parts):
        first, end = Slabs.even(r0, count, rank).cells
        x = torch.div(mine, layer, rounding_mode="floor")
        assert x.min() == first and x.max() == (r0 - 2 if end is None else end - 1)  # its own cells, all of them
        assert share == pytest.approx(((r0 - 1 if end is None else end) - first) / (r0 - 1))
        assert abs(len(mine) / samples - share) < count / samples  # in proportion, to a draw or two
    # the stratified estimate of a cell function's mean is unbiased: here the mean flat cell index
    estimate = sum(share * mine.double().mean() for mine, share in parts)
    assert float(estimate) == pytest.approx((cells - 1) / 2, rel=0.02)
    few = space_split_of(model, 0, count).draw_cells(count, torch.device("cpu"))  # one draw a stratum at least
    assert len(few) == count and all(
        len(space_split_of(model, r, count).owned_cells(few)[0]) == 1 for r in range(count)
    )


@pytest.mark.parametrize("count", [2, 3])
def test_each_rank_steps_its_own_slab_by_its_stratum_of_the_tv(count):
    """DeferredTV under a split: each rank's gradient lies in its slab, and the ranks' values sum to the stratified
    estimate: each stratum's mean through the plain op, weighted by its slab's share of the cells."""
    model = make_model(seed=2, tv_samples=300).double()
    randomize_density(model, mean=-1.0, std=3.0)
    with torch.no_grad():
        model.features.grid.normal_(generator=torch.Generator().manual_seed(4))
    grids, r0 = (model.density.grid, model.features.grid), model.grid_shape[0]
    assert DeferredTV.applies(model)

    def apply(cells=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for grid in grids:
            grid.grad = None
        tv = DeferredTV()
        if cells is None:
            torch.manual_seed(11)
            tv.draw(model)
        else:
            tv.cells = [cells, None]
        return tv.apply(model), [grid.grad.clone() for grid in grids]

    parts = []
    for rank in range(count):
        model.space_split = space_split_of(model, rank, count)
        parts.append(apply())
    torch.manual_seed(11)
    cells = space_split_of(model, 0, count).draw_cells(300, torch.device("cpu"))
    model.space_split = None
    want = 0.0
    for rank in range(count):
        mine, share = space_split_of(model, rank, count).owned_cells(cells)
        want = want + share * apply(mine)[0]
    torch.testing.assert_close(sum(value for value, _ in parts), want, atol=1e-12, rtol=1e-10)
    for rank, (_, grads) in enumerate(parts):
        first, last = vertex_rows(Slabs.even(r0, count, rank), r0)
        for grad in grads:
            assert grad[first : last + 1].abs().sum() > 0 and not grad[:first].any() and not grad[last + 1 :].any()


def test_the_slab_cells_march_exactly_the_samples_a_slab_owns():
    model, origins, directions, jitter = scene("deferred")
    c, space, step = model.config, model.space, model.step_size
    t_start, t_end, t_split, count = space.march_range(
        origins, directions, model.bbox, model.extent, model.near, model.far, step, c.max_samples
    )
    args = (origins, directions, t_start, t_end, jitter)
    ray, t, points, _ = model.ops.march_rays(*args, model.occupancy.mask, model.bbox, step, count, t_split)
    for ranks, rank in ((2, 0), (2, 1), (3, 0), (3, 1), (3, 2)):
        slabs = Slabs.even(model.grid_shape[0], ranks, rank)
        cells = slabs.march_cells(model.occupancy.mask.shape[0])
        got = model.ops.march_rays(*args, model.occupancy.mask, model.bbox, step, count, t_split, cells)
        mine = slabs.owns(points, model.grid_shape)
        assert 0 < int(mine.sum()) < len(ray)
        for value, want in zip(got[:3], (ray[mine], t[mine], points[mine])):
            assert torch.equal(value, want)


def test_gloo_ranks_split_by_space_train_what_one_process_trains(tmp_path):
    """Up to float rounding, which Adam amplifies where a gradient is near zero: ~1e-5 after 12 steps here, where
    a missing exchange (the shared plane's gradient) moves the grids by ~0.1-0.3."""
    from test_distributed import ranks_output, single, tiny, torchrun

    from training.checkpoint import load_checkpoint

    cache = tmp_path / "cache"
    close = {"rtol": 1e-3, "atol": 1e-4}
    cases = (("dense", "false", "false", 2), ("occupied", "occupied", "false", 2), ("capped", "occupied", "true", 2))
    cases += (("three", "occupied", "false", 3),)  # three slabs: two planes, a middle rank that owns both
    cases += (("work", "occupied", "false", 2),)  # the planes cut again at the growth, by the samples and Adam's rows
    cases += (("observe", "occupied", "true", 2),)  # capped, the refreshes at 8 and 12 resized from their counts
    for name, adam, capped, count in cases:  # capped: every rank's march in fixed sample capacities
        extra = [f"train.sparse_adam={adam}", "train.checkpoint_every=6", f"model.capped_samples={capped}"]
        extra += [f"model.capped_refresh={'observe' if name == 'observe' else 'measure'}"]
        extra += ["model.tv_density=0", "model.tv_features=0"]  # the split's TV is stratified: a test of its own
        extra += ["model.grow_at=[0.5]"]  # the growth at step 6, after the warmup's (4): the cut counts from there
        result = single(tiny(cache, tmp_path / f"one_{name}", 12) + extra)
        assert result.returncode == 0, result.stderr[-2000:]
        pair = torchrun(count, tiny(cache, tmp_path / f"two_{name}", 12) + extra + ["train.parallel=space"])
        assert pair.returncode == 0, ranks_output(pair)
        assert pair.stdout.count("eval on") == 1, f"{name}: {ranks_output(pair)}"
        assert "space split: slabs cut at vertex planes" in pair.stdout  # at the growth, by the counted work
        metrics = json.loads((tmp_path / f"two_{name}" / "metrics.json").read_text())
        ranks = metrics["sample_capacity_ranks"]
        assert (ranks is None) == (capped == "false") and (ranks is None or len(ranks) == count)
        assert ranks is None or all(r["sizes"] == ranks[0]["sizes"] for r in ranks)  # the largest rank's, shared
        # capped steps were checked (they start at the occupancy warmup: tiny_overrides' step 4)
        assert ranks is None or all(r["fill"]["march"] > 0 for r in ranks)
        assert ranks is None or all((r["resizes"] > 0) == (name == "observe") for r in ranks)
        assert metrics["step_graph_ranks"] is None and metrics["parallel"]["split"] == "space"
        assert metrics["parallel"]["ranks"] == count
        cuts = metrics["parallel"]["cuts"]  # the planes each growth cut, by the counted samples (or work)
        assert cuts and all(len(cut["planes"]) == count - 1 for cut in cuts)
        one = load_checkpoint(tmp_path / f"one_{name}" / "checkpoints" / "last.pt", map_location="cpu")
        two = load_checkpoint(tmp_path / f"two_{name}" / "checkpoints" / "last.pt", map_location="cpu")
        assert one["step"] == two["step"] == 12
        for key, value in one["model"].items():
            if value.is_floating_point():
                torch.testing.assert_close(two["model"][key], value, **close, msg=f"{name}: {key}")
        for index, state in one["optimizer"]["state"].items():  # rank 0's checkpoint holds both slabs' moments
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(two["optimizer"]["state"][index][key], state[key], **close, msg=key)


def test_a_space_split_refuses_what_it_does_not_support(tmp_path):
    from test_distributed import ranks_output, tiny, torchrun

    for extra, message in (
        (["train.sparse_adam=nonzero"], "train.parallel: space steps dense Adam"),
        (["model.tv_samples=0"], "train.parallel: space does not support a whole-grid TV"),
    ):
        pair = torchrun(2, tiny(tmp_path / "cache", tmp_path / "run", 4) + ["train.parallel=space", *extra])
        assert pair.returncode != 0 and message in ranks_output(pair)


def test_one_process_asked_for_a_space_split_says_so_and_trains_the_whole_grids(tmp_path):
    from test_distributed import single, tiny

    result = single(tiny(tmp_path / "cache", tmp_path / "run", 4) + ["train.parallel=space"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "train.parallel=space splits a torchrun job of 2 or more ranks" in result.stdout
    assert (tmp_path / "run" / "metrics.json").exists()


def test_auto_splits_by_space_on_cuda_where_the_split_takes_the_run_else_data(capsys):
    """``train.parallel=auto`` (training.space_parallel.split_for): the choice alone, on a CPU model that a CUDA
    device's name stands beside (nothing is allocated there)."""
    from omegaconf import OmegaConf

    from training.config import ConfigError
    from training.distributed import Group
    from training.space_parallel import split_for

    def trainer(device: str, world: int = 2, rank: int = 0, batch: int = 64, **train):
        model = scene("deferred")[0]
        model.config.tv_density = model.config.tv_features = 0.0  # no whole-grid TV to refuse
        cfg = OmegaConf.create({"model": {"upsample": 1}, "train": {"batch_rays": batch}})
        settings = {"parallel": "auto", "sparse_adam": "occupied", **train}
        return SimpleNamespace(train_cfg=settings, group=Group(rank, world), device=torch.device(device), model=model,
                               cfg=cfg)  # fmt: skip

    on_cuda = trainer("cuda")
    split = split_for(on_cuda)
    assert isinstance(split, SpaceParallel) and split.graphed and on_cuda.model.capacities is not None
    assert on_cuda.model.space_split is split
    assert "train.parallel=auto: split by space over 2 ranks (capped samples, step graph)" in capsys.readouterr().out
    assert split_for(trainer("cuda", rank=1)) is not None and capsys.readouterr().out == ""  # rank 0 alone says it
    on_cpu = trainer("cpu")
    assert split_for(on_cpu) is None and on_cpu.model.capacities is None and on_cpu.model.space_split is None
    said = capsys.readouterr().out
    assert "data parallel over 2 ranks (the space split runs on CUDA only)" in said and "a sweep" not in said
    refused = trainer("cuda", distortion_loss=0.1)
    assert split_for(refused) is None and refused.model.capacities is None
    said = capsys.readouterr().out
    assert "data parallel over 2 ranks (the space split does not support train.distortion_loss yet)" in said
    assert "a sweep, one GPU a job, uses GPUs better" in said  # on GPUs data parallel is slower than one
    with pytest.raises(ConfigError, match="train.batch_rays: 63 does not split over 2 ranks"):
        split_for(trainer("cuda", batch=63, distortion_loss=0.1))  # data parallel, so the batch must split
    assert split_for(trainer("cuda", batch=63)) is not None  # by space every rank takes the whole batch
    # asked for: data stays data on CUDA; space takes step_graph as given; one process is neither
    assert split_for(trainer("cuda", parallel="data")) is None
    assert not split_for(trainer("cuda", parallel="space")).graphed
    assert split_for(trainer("cuda", parallel="space", step_graph=True)).graphed
    alone = trainer("cuda", world=1)
    assert split_for(alone) is None and alone.model.capacities is None


def _gather_rank(rank: int, ranks: int, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks)
    try:
        model = scene("deferred")[0]
        split = space_split_of(model, rank, ranks)
        with torch.no_grad():  # every rank's grids differ: its rank everywhere
            model.density.grid.fill_(rank)
            model.features.grid.fill_(rank)
        split.gather_density()
        density = model.density.grid.detach().clone()
        features = model.features.grid.detach().clone()
        split.gather()
        whole = model.features.grid.detach().clone()
        torch.save({"density": density, "features": features, "whole": whole}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_a_refresh_gathers_the_density_grid_alone_and_a_whole_read_both(tmp_path):
    """Before an occupancy refresh (its only read: the density grid) the ranks move the density grid alone; the
    feature grid, 12 of 13 channels, waits for the next whole read (training.optim: not with the viewer on)."""
    count = 2
    mp.spawn(_gather_rank, args=(count, str(tmp_path / "init"), str(tmp_path / "out")), nprocs=count)
    r0 = scene("deferred")[0].grid_shape[0]
    for rank in range(count):
        got = torch.load(tmp_path / f"out.{rank}")
        slabs = Slabs.even(r0, count, rank)
        owner = torch.zeros(r0, dtype=torch.float64)
        owner[slabs.planes[0] + 1 :] = 1  # the vertices past rank 0's upper plane are rank 1's
        torch.testing.assert_close(got["density"][..., 0], owner[:, None, None].expand_as(got["density"][..., 0]))
        assert (got["features"] == rank).all()  # untouched: every vertex still this rank's own
        torch.testing.assert_close(got["whole"][..., 0], owner[:, None, None].expand_as(got["whole"][..., 0]))


@pytest.mark.parametrize("viewer", [False, True])
def test_a_split_brings_every_grid_whole_before_a_whole_read_and_the_density_before_a_refresh(viewer):
    """training.optim wires the split's gathers into the model's reads: a refresh's moves the density grid alone,
    unless rank 0's viewer shows the model (then every slab's features too, so it is at most one refresh old)."""
    from training.config import Settings
    from training.distributed import Group
    from training.optim import new_optimizer

    model = scene("deferred")[0]
    split = space_split_of(model, 0)
    model.space_split = split
    settings = Settings.of({"lr": 0.1, "lr_decoder": 0.01, "sparse_adam": "occupied", "viewer": viewer})
    trainer = SimpleNamespace(
        train_cfg=settings, model=model, group=Group(0, 2), ops=model.ops, device=model.bbox.device
    )
    new_optimizer(trainer, (0.9, 0.99))
    assert model.touched.flusher == split.gather
    assert model.touched.density_flusher == (None if viewer else split.gather_density)
    calls = []
    model.touched.flusher = lambda: calls.append("whole")
    if not viewer:
        model.touched.density_flusher = lambda: calls.append("density")
    model.touched.before_whole_read(density_only=True)
    model.touched.before_whole_read()
    assert calls == (["whole", "whole"] if viewer else ["density", "whole"])
