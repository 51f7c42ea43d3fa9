"""The model's sparse fine grid (models/brick_grid.py, ``model.fine``) on the CPU: where its bricks go, that it starts
as a no-op, that its values add to the coarse lookups, the occupancy bound, its optimiser group and TV, checkpoints
and model files with it, the config rules; the op itself is tests/test_brick_grid.py's."""

from __future__ import annotations

import json

import pytest
import torch
from test_model import TORCH_OPS, look_at_c2w, make_model, randomize_density

from models import build_ops
from models.brick_grid import BrickGrids, fine_shape, table_shape, wanted_bricks
from models.config import parse_model_config
from models.contraction import SceneSpace
from models.field import cell_corners

FINE = {"fine.factor": 2, "fine.brick": 4, "fine.at": 6, "grow_at": [2, 4]}


def make_scene_stub():
    """A two-view Scene 4 units from the origin, focal 50 px."""
    from data.scene import Scene

    c2w = torch.eye(4).repeat(2, 1, 1)
    c2w[0, :3, 3] = torch.tensor([0.0, 0.0, 4.0])
    c2w[1, :3, 3] = torch.tensor([4.0, 0.0, 0.0])
    images = torch.zeros(2, 4, 4, 3, dtype=torch.uint8)
    bbox = torch.tensor([[-1.0] * 3, [1.0] * 3])
    return Scene(images, c2w, 4, 4, 50.0, 2.0, 6.0, bbox, (1.0, 1.0, 1.0), "train", ["a", "b"])


def fine_model(seed: int = 0, **overrides):
    model = make_model(seed, **(FINE | overrides))
    with torch.no_grad():
        randomize_density(model)
    for step in range(1, 6):
        model.on_step(step, 10)
    model.refresh_occupancy()
    return model


def allocated(std: float | None = None):
    """:func:`fine_model` with its bricks allocated (step 6 of 10): values N(0, std) when given, else zero."""
    model = fine_model()
    model.on_step(6, 10)
    if std is not None:
        with torch.no_grad():
            model.fine.density.normal_(std=std)
            model.fine.features.normal_(std=std)
    return model


def saved_and_read(model, tmp_path) -> dict:
    """The state dict of ``model`` written as a model file and read back."""
    from training.compact_model import read_model, save_model

    save_model(tmp_path / "model.pt", model, {"config": {}, "step": 6})
    return read_model(tmp_path / "model.pt")[0]


def test_wanted_bricks_hold_exactly_the_fine_vertices_of_the_wanted_cells():
    cells = torch.rand(9, 7, 5) < 0.05
    cells[1, 2, 3] = True
    factor, brick, shape = 2, 4, fine_shape((10, 8, 6), 2)  # (19, 15, 11) fine vertices, bricks (5, 4, 3)
    vertices = torch.zeros(shape, dtype=torch.bool)  # brute force: every fine vertex of every wanted cell
    for c0, c1, c2 in cells.nonzero().tolist():
        vertices[
            c0 * factor : (c0 + 1) * factor + 1,
            c1 * factor : (c1 + 1) * factor + 1,
            c2 * factor : (c2 + 1) * factor + 1,
        ] = True
    expected = torch.zeros(table_shape(shape, brick))
    for v in vertices.nonzero().tolist():
        expected[v[0] // brick, v[1] // brick, v[2] // brick] += 1
    score = wanted_bricks(cells, factor, brick, shape)
    assert score.shape == (5, 4, 3)
    torch.testing.assert_close(score, expected)
    assert score[0, 1, 1] > 0 and score[1, 1, 2] > 0  # cell (1, 2, 3)'s far faces reach into the next bricks


def dense_wanted_bricks(cells: torch.Tensor, factor: int, brick: int, shape: tuple[int, int, int]) -> torch.Tensor:
    """wanted_bricks on the whole fine grid at once (memory ~ the fine grid): the reference for the layered one."""
    fine_cells = cells
    for axis in range(3):
        fine_cells = fine_cells.repeat_interleave(factor, axis)
    vertices = cell_corners(fine_cells).float()[None, None]
    bricks = table_shape(shape, brick)
    pad = [0, 0, 0, 0, 0, 0]
    for axis in range(3):
        pad[2 * (2 - axis) + 1] = bricks[axis] * brick - vertices.shape[2 + axis]
    return (torch.nn.functional.avg_pool3d(torch.nn.functional.pad(vertices, pad), brick, brick) * brick**3)[0, 0]


@pytest.mark.parametrize(
    "factor, brick, coarse", [(2, 4, (10, 8, 6)), (4, 8, (13, 9, 17)), (3, 3, (7, 12, 5)), (1, 2, (6, 6, 6))]
)
def test_wanted_bricks_layer_by_layer_equal_the_whole_grid_count(factor, brick, coarse):
    cells = torch.rand(tuple(r - 1 for r in coarse), generator=torch.Generator().manual_seed(factor)) < 0.1
    cells[0, -1, 0] = cells[-1, 0, -1] = True  # the grid's first and last layers
    shape = fine_shape(coarse, factor)
    torch.testing.assert_close(
        wanted_bricks(cells, factor, brick, shape), dense_wanted_bricks(cells, factor, brick, shape)
    )


def test_allocate_gives_unique_slots_zero_values_and_respects_the_cap():
    grids = BrickGrids(feature_dim=5, brick=4)
    cells = torch.rand(11, 9, 7) < 0.2
    count = grids.allocate(cells, factor=2, max_bricks=10_000)
    wanted = int((wanted_bricks(cells, 2, 4, grids.shape) > 0).sum())
    assert count == grids.bricks == wanted > 0
    slots = grids.table[grids.table >= 0]
    assert sorted(slots.tolist()) == list(range(count))
    assert grids.density.shape == (count * 64, 1) and grids.features.shape == (count * 64, 5)
    assert not grids.density.abs().any() and not grids.features.abs().any()
    assert grids.wanted == wanted and grids.summary()["wanted"] == wanted
    capped = BrickGrids(feature_dim=5, brick=4)
    assert capped.allocate(cells, factor=2, max_bricks=3) == 3 == int((capped.table >= 0).sum())
    assert capped.summary()["bricks"] == 3 and capped.summary()["wanted"] == wanted  # the cut shows


def test_the_fine_grid_appears_at_its_step_and_changes_nothing_then():
    model = fine_model()
    model.eval()
    c2w = look_at_c2w((0.0, -4.0, 1.0))
    before = model.render_image(c2w, 12, 12, 14.0, chunk=64)["rgb"]
    assert not model.fine.active
    assert model.on_step(6, 10) is True  # allocated: the trainer rebuilds its optimiser
    assert model.fine.active and model.fine.shape == fine_shape(model.grid_shape, 2)
    assert [g["name"] for g in model.param_groups(0.1, 0.01)] == ["grids", "decoder", "fine"]
    after = model.render_image(c2w, 12, 12, 14.0, chunk=64)["rgb"]
    torch.testing.assert_close(after, before)
    assert model.on_step(7, 10) is False  # allocated once


def test_training_marks_the_cells_it_sees_and_the_bricks_go_there():
    model = fine_model(**{"fine.collect": 2})
    model.train()
    model.on_step(5, 10)  # step 5 of 10, fine.at 6: collecting
    assert model.fine.collecting
    origins = torch.tensor([[0.0, -4.0, 0.1]]).repeat(64, 1)
    directions = torch.nn.functional.normalize(torch.randn(64, 3) * 0.05 + torch.tensor([0.0, 1.0, 0.0]), dim=1)
    model.render_rays(origins, directions)
    seen = model.fine.seen
    assert seen is not None and 0 < int(seen.sum()) < 0.05 * seen.numel()  # the surface the rays hit, not the box
    assert model.on_step(6, 10) and model.fine.active and not model.fine.collecting
    table = model.fine.table
    for cell in seen.nonzero().tolist():  # the brick of each seen cell's first fine vertex is allocated
        assert table[tuple(c * 2 // model.fine.brick for c in cell)] >= 0
    assert int((table >= 0).sum()) < table.numel()
    summary = model.fine.summary()
    assert summary["bricks"] == int((table >= 0).sum()) and summary["rows"] == summary["bricks"] * 64
    assert json.loads(json.dumps(summary)) == summary


@pytest.mark.parametrize("contraction, reach", [("none", 1.0), ("inf", 1.0), ("inf", 1.5)])
def test_contracted_bricks_stay_in_the_foreground_box(contraction, reach):
    settings = {"fine.factor": 2, "fine.brick": 2, "fine.collect": 1, "fine.reach": reach}
    model = fine_model(contraction=contraction, **settings)
    with torch.no_grad():
        model.density.grid.fill_(20.0)  # every cell occupied: the bricks would fill the whole cube
    model.refresh_occupancy()
    assert bool(model.occupancy.mask.all())
    assert model.on_step(6, 10) and model.fine.active
    used = model.fine.table >= 0
    if contraction == "none":
        assert bool(used.all())
        return
    assert 0 < int(used.sum()) < used.numel()
    b, factor = model.fine.brick, 2
    inside = SceneSpace("inf").foreground(model.grid_shape, torch.device("cpu"), reach)  # coarse vertices in reach
    wider = SceneSpace("inf").foreground(model.grid_shape, torch.device("cpu"), reach + 0.25)
    assert all(int(w.sum()) > int(i.sum()) for w, i in zip(wider, inside))  # the reach is a real bound here
    for axis in range(3):
        lo, hi = (int(i) * factor for i in inside[axis].nonzero()[[0, -1], 0])  # the box's fine vertices
        first = torch.arange(used.shape[axis]) * b  # each brick's first vertex along the axis
        reaches = (first + b - 1 >= lo) & (first <= hi)
        along = used.any(dim=tuple(a for a in range(3) if a != axis))
        assert torch.equal(along, reaches)  # a brick on every slab that holds box vertices, none beyond
    cells = SceneSpace("inf").foreground_cells(model.grid_shape, torch.device("cpu"), reach)
    assert cells.shape == model.occupancy.mask.shape and 0 < int(cells.sum()) < cells.numel()


def test_the_memory_cap_bounds_the_pool_and_a_zero_cap_declines_it(capsys):
    capped = fine_model()
    capped.fine.cap_memory(3)  # what the run's preflight found room for
    assert capped.on_step(6, 10) and capped.fine.bricks == 3 and capped.fine.wanted > 3
    assert "capped by the device's memory" in capsys.readouterr().out
    none = fine_model()
    none.fine.cap_memory(0)
    assert not none.on_step(6, 10) and not none.fine.active and none.fine.declined
    assert not none.on_step(7, 10) and "no memory left" in capsys.readouterr().out


def test_the_fine_grid_is_declined_where_the_voxels_are_finer_than_the_pixels():
    model = fine_model(**{"fine.min_pixels": 1.5})
    voxel = model.space.voxel(model.extent, model.grid_shape)
    model.fine.pixel_size = voxel / 1.4  # a coarse voxel spans 1.4 pixels
    assert model.on_step(6, 10) is False and not model.fine.active and model.fine.declined
    assert not model.on_step(7, 10) and not model.fine.collecting
    kept = fine_model(**{"fine.min_pixels": 1.5})
    kept.fine.pixel_size = voxel / 1.6
    assert kept.on_step(6, 10) is True and kept.fine.active


@pytest.mark.parametrize("spans, comes", [(1.6, True), (1.4, False)], ids=["fine-comes", "declined"])
def test_plan_fine_decides_before_training_and_picks_the_growth_schedule(spans, comes, capsys):
    # fine.at (step 3) comes before grow_at's last entry (4): allowed because fine.grow_at (1, 2) replaces it
    settings = FINE | {"fine.min_pixels": 1.5, "fine.at": 3, "fine.grow_at": [1, 2]}
    model = make_model(0, **settings)
    final = model.space.voxel(model.extent, model.shape_at(20))
    model.plan_fine(final / spans)  # a final coarse voxel spans `spans` pixels
    assert model.fine.declined is not comes
    assert model.grow_at == ([1, 2] if comes else [2, 4])
    assert ("not needed" in capsys.readouterr().out) is not comes  # declined: said at the start, not at fine.at
    start = model.config.resolution_start
    mid = round(start * (20 / start) ** 0.5)  # geometric: halfway after the first of two growths
    expected = [start, mid, 20, 20, 20, 20] if comes else [start, start, mid, mid, 20, 20]
    assert [model.resolution_at(step, 10) for step in range(6)] == expected and start < mid < 20
    for step in range(1, 6):
        model.on_step(step, 10)
    assert model.fine.active is comes and model.grid_shape == model.shape_at(20)


@pytest.mark.parametrize("spans, comes", [(1.6, True), (1.4, False)], ids=["fine-comes", "declined"])
def test_plan_fine_picks_the_coarse_grids_final_resolution(spans, comes):
    # declined or not is decided on model.resolution_end's voxel (20), the coarser end (16) only follows from it
    model = make_model(0, **(FINE | {"fine.min_pixels": 1.5, "fine.resolution_end": 16}))
    model.plan_fine(model.space.voxel(model.extent, model.shape_at(20)) / spans)
    end = 16 if comes else 20
    assert model.resolution_end == end and model.resolution_at(4, 10) == end
    start = model.config.resolution_start
    assert model.resolution_at(2, 10) == round(start * (end / start) ** 0.5)  # geometric towards the new end
    for step in range(1, 7):
        model.on_step(step, 10)
    assert model.grid_shape == model.shape_at(end) and model.fine.active is comes
    if comes:  # the fine grid lies over the coarser grid: factor x its cells
        assert model.fine.shape == fine_shape(model.shape_at(16), 2)


def test_fine_grow_at_is_checked_like_grow_at():
    with pytest.raises(ValueError, match="model.fine.grow_at"):
        parse_model_config({"fine": {"grow_at": [0.1, 1.5]}})
    with pytest.raises(ValueError, match="model.fine.grow_at"):
        parse_model_config({"fine": {"grow_at": 0.2}})
    for reach in (0.9, 2.5):
        with pytest.raises(ValueError, match=r"model.fine.reach: must be in \[1, 2\]"):
            parse_model_config({"fine": {"reach": reach}})
    with pytest.raises(ValueError, match=r"model.fine.at: must come after every model.fine.grow_at entry \(3\)"):
        parse_model_config({"fine": {"factor": 2, "brick": 4, "at": 3, "grow_at": [1, 3]}})
    from omegaconf import OmegaConf

    from training.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match="model.fine.grow_at: must be increasing"):
        validate_config(OmegaConf.from_dotlist(["train.iters=100", "model.fine.grow_at=[0.2,0.1]"]))
    with pytest.raises(ConfigError, match="model.fine.grow_at: step 100 is not before train.iters=100"):
        validate_config(OmegaConf.from_dotlist(["train.iters=100", "model.fine.grow_at=[10,100]"]))


def test_pixel_footprint_is_distance_over_focal():
    scene = make_scene_stub()
    assert abs(scene.pixel_footprint(torch.zeros(3)) - 4.0 / 50.0) < 1e-9


def test_fine_values_add_to_the_coarse_lookups():
    model = allocated()
    with torch.no_grad():
        model.fine.density.fill_(0.75)
        model.fine.features.fill_(-0.25)
    slot_brick = (model.fine.table >= 0).nonzero()[0]  # a vertex in an allocated brick, and its point in [-1, 1]
    vertex = slot_brick * model.fine.brick
    point = (vertex.float() / (torch.tensor(model.fine.shape) - 1).float() * 2 - 1)[None]
    coarse_density = model.density(point, model.ops)[:, 0]
    coarse_features = model.features(point, model.ops)
    torch.testing.assert_close(model.query_density(point), coarse_density + 0.75)
    torch.testing.assert_close(model.query_features(point), coarse_features - 0.25)


def test_occupancy_keeps_cells_that_only_the_fine_grid_fills():
    model = allocated()
    with torch.no_grad():
        model.density.grid.fill_(-30.0)  # the coarse grid empty everywhere
        model.fine.density.fill_(60.0)  # the fine grid opaque in its bricks
    model.refresh_occupancy()
    assert model.occupancy.mask.any()
    slot_brick = (model.fine.table >= 0).nonzero()[0]
    coarse_cell = torch.clamp(slot_brick * model.fine.brick // 2, max=torch.tensor(model.occupancy.mask.shape) - 1)
    assert model.occupancy.mask[tuple(coarse_cell.tolist())]


def test_fine_grid_trains_and_its_tv_has_a_gradient():
    model = allocated()
    with torch.no_grad():
        model.fine.features.normal_()
    loss = model.regularization()
    loss.backward()
    model.row_grads.scatter()  # the TV rows' gradients (model.tv_sparse_grad)
    assert model.fine.features.grad is not None and model.fine.features.grad.abs().sum() > 0


def test_state_dict_round_trip_and_an_older_state_without_the_fine_grid():
    model = allocated()
    with torch.no_grad():
        model.fine.features.normal_()
    state = model.state_dict()
    fresh = make_model(1, **FINE)
    fresh.load_state_dict(state)
    assert fresh.fine.shape == model.fine.shape and torch.equal(fresh.fine.table, model.fine.table)
    torch.testing.assert_close(fresh.fine.features, model.fine.features)
    older = {k: v for k, v in state.items() if not k.startswith("fine.")}
    plain = make_model(1, **FINE)
    plain.load_state_dict(older)
    assert not plain.fine.active


def test_model_file_round_trip_keeps_the_fine_grid(tmp_path):
    model = allocated(std=0.1)
    state = saved_and_read(model, tmp_path)
    assert torch.equal(state["fine.table"], model.fine.table)
    torch.testing.assert_close(state["fine.density"], model.fine.density.detach(), atol=1e-3, rtol=1e-3)
    error = state["fine.features"] - model.fine.features.detach()  # uint8 codes: 256 levels a channel
    assert error.pow(2).mean().sqrt() < 0.02 * model.fine.features.std()


def test_growing_after_the_fine_grid_is_refused():
    with pytest.raises(ValueError, match="model.fine.at"):  # steps against steps: checked with the config
        parse_model_config({"grow_at": [3], "fine": {"factor": 2, "brick": 4, "at": 3}})
    model = make_model(0, **(FINE | {"fine.at": 1, "grow_at": [0.3]}))  # a step against a fraction: at run time
    model.on_step(1, 10)
    assert model.fine.active
    with pytest.raises(ValueError, match="model.fine.at"):
        model.on_step(3, 10)


@pytest.mark.parametrize(
    "fine, match",
    [
        ({"factor": -1}, "model.fine.factor"),
        ({"factor": 4, "brick": 2}, "model.fine.factor"),
        ({"brick": 0}, "model.fine.brick"),
        ({"at": 1.5}, "model.fine.at"),
        ({"tv": -1.0}, "model.fine.tv"),
        ({"max_bricks": 0}, "model.fine.max_bricks"),
        ({"resolution_end": 1000}, r"model.fine.resolution_end: .*\(\[32, 80\]\), got 1000"),
        ({"resolution_end": 8}, "model.fine.resolution_end"),
        ({"resolution_end": 40.5}, "model.fine.resolution_end"),
    ],
)
def test_bad_fine_settings_name_the_key(fine, match):
    with pytest.raises(ValueError, match=match):
        parse_model_config({"fine": fine})


def test_ops_torch_and_custom_agree_with_a_fine_grid():
    pytest.importorskip("cuda_ext._C")
    model = allocated(std=1.0)
    model.eval()
    c2w = look_at_c2w((0.0, -4.0, 1.0))
    reference = model.render_image(c2w, 10, 10, 12.0, chunk=64)["rgb"]
    custom = dict(TORCH_OPS, grid_interpolate="custom", brick_grid_interpolate="custom")
    model.ops = build_ops(custom)
    torch.testing.assert_close(model.render_image(c2w, 10, 10, 12.0, chunk=64)["rgb"], reference)


def test_mesh_export_reads_the_fine_grid_too():
    from training.export import vertex_alpha

    model = allocated()
    coarse_only = vertex_alpha(model)  # fine values zero: the same field
    with torch.no_grad():
        before = -torch.expm1(-torch.nn.functional.softplus(model.density.grid[..., 0] + model.config.density_shift))
    torch.testing.assert_close(coarse_only, before, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        model.density.grid.fill_(-30.0)
        model.fine.density.fill_(60.0)
    assert vertex_alpha(model).max() > 0.99  # only the fine grid is dense now
    assert vertex_alpha(model, resolution=9).max() > 0.99


def test_a_model_file_with_a_fine_grid_renders_as_the_model_did(tmp_path):
    from test_model import make_cfg

    from training.finished_run import build_model

    model = allocated(std=0.5)
    model.eval()
    state = saved_and_read(model, tmp_path)
    scene = {"near": model.near, "far": model.far, "bbox": model.bbox.tolist()}
    loaded = build_model(make_cfg(**FINE), scene, state, build_ops(TORCH_OPS))
    assert loaded.fine.active and loaded.fine.shape == model.fine.shape
    c2w = look_at_c2w((0.0, -4.0, 1.0))
    original = model.render_image(c2w, 12, 12, 14.0, chunk=64)["rgb"]
    again = loaded.render_image(c2w, 12, 12, 14.0, chunk=64)["rgb"]
    mse = (original - again).pow(2).mean()
    assert -10 * torch.log10(mse) > 40  # float16 density and uint8 feature codes: far below a visible error
