"""Where the space split cuts its slabs (issue 33; training.space_parallel.SpaceParallel.balance): planes where layer
weights split evenly, the shaded samples counted per layer (and their steps), the rows Adam steps added for
the cut's work, the counts carried onto grown grids."""

from __future__ import annotations

import pytest
import torch
from test_space_split import scene, space_split_of

from models.space_split import ROW_WORK, SlabPass, Slabs, regrid_layers, work_layers


def test_balanced_slabs_cut_where_the_layer_weights_split_evenly():
    weights = torch.tensor([1.0, 1, 1, 1, 10, 10, 10, 10])  # 8 cell layers: 44 in all, 22 reached in layer 5
    assert Slabs.balanced(weights, 2, 0).planes == (6,)
    assert Slabs.balanced(torch.ones(8), 2, 1).planes == Slabs.even(9, 2, 1).planes == (4,)
    assert Slabs.balanced(torch.ones(9), 3, 2).planes == (3, 6)
    # each slab keeps a cell layer at least, however the weights lie
    assert Slabs.balanced(torch.tensor([100.0, 0, 0, 0, 0]), 3, 0).planes == (1, 2)
    assert Slabs.balanced(torch.tensor([0.0, 0, 0, 0, 100]), 3, 0).planes == (3, 4)
    assert Slabs.balanced(torch.zeros(8), 2, 0).planes == (4,)  # nothing to weigh: even


def test_work_layers_add_the_rows_adam_steps_to_the_samples():
    mask = torch.zeros(4, 3, 3, dtype=torch.bool)  # 4 cell layers, 5 vertex planes of 4 x 4 vertices
    mask[1, 1, 1] = True  # one occupied cell: its 8 corners, 4 on vertex plane 1, 4 on plane 2
    mask[3, 0, 0] = True  # and one in the last layer: planes 3 and 4 (the last plane's rows go to the last layer)
    shaded = torch.tensor([5.0, 0.0, 1.0, 2.0])
    want = shaded.double() + ROW_WORK * torch.tensor([0.0, 4.0, 4.0, 8.0]).double()
    torch.testing.assert_close(work_layers(shaded, mask), want, rtol=0, atol=0)
    # a slab heavy in rows but light in samples gives up layers to the other
    rows_heavy = torch.zeros(8, 6, 6, dtype=torch.bool)
    rows_heavy[4:] = True
    samples = torch.ones(8) * 10
    assert Slabs.balanced(samples, 2, 0).planes == (4,)
    assert Slabs.balanced(work_layers(samples, rows_heavy), 2, 0).planes[0] > 4
    with pytest.raises(ValueError, match="work_layers: mask must have 8 first-axis cells"):
        work_layers(samples, rows_heavy[:7])


def test_the_work_cut_weighs_the_rows_of_a_mask_of_the_grids_shape(monkeypatch):
    import training.space_parallel as space_parallel

    model = scene("deferred")[0]
    r0 = model.grid_shape[0]
    monkeypatch.setattr(space_parallel.dist, "all_reduce", lambda t: t)  # one rank's counts: the sum
    heavy = torch.zeros_like(model.occupancy.mask)
    heavy[(r0 - 1) // 2 :] = True  # every row of the upper half stepped
    planes = {}
    for name, mask in (("fitting", heavy), ("other shape", heavy[1:])):  # other: a growth before the first refresh
        model.occupancy.mask = mask  # a fresh model of this test's own
        split = space_split_of(model, 0)
        counts = torch.ones(r0, dtype=torch.float64)  # one shaded sample a layer, in one step
        split._layers = (counts, split._span())
        split.balance()
        planes[name] = split.slabs.planes
    even = Slabs.even(r0, 2, 0).planes
    assert planes["fitting"][0] > even[0] and planes["other shape"] == even  # the samples alone: even here


def test_counts_move_onto_other_layers_of_another_box():
    counts = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(regrid_layers(counts, (0.0, 1.0), (0.0, 1.0), 4), counts.double())
    torch.testing.assert_close(regrid_layers(counts, (0.0, 1.0), (0.0, 1.0), 2), torch.tensor([3.0, 7.0]).double())
    torch.testing.assert_close(
        regrid_layers(counts, (0.0, 1.0), (0.0, 1.0), 8), counts.double().repeat_interleave(2) / 2
    )
    # a box that moved: half of it past the old one (nothing counted there), the rest over the old second half
    torch.testing.assert_close(regrid_layers(counts, (0.0, 1.0), (0.5, 1.5), 2), torch.tensor([7.0, 0.0]).double())


def test_a_split_cuts_its_planes_where_the_shaded_samples_split_evenly(monkeypatch):
    import training.space_parallel as space_parallel

    model = scene("deferred")[0]
    model.occupancy.mask = torch.zeros_like(model.occupancy.mask)  # no rows for Adam: the work is the samples alone
    r0 = model.grid_shape[0]
    splits = [space_split_of(model, rank) for rank in range(2)]
    assert splits[0].slabs.planes == Slabs.even(r0, 2, 0).planes  # before a cut: even
    generator = torch.Generator().manual_seed(5)
    for split, low in zip(splits, (0.0, 0.5)):  # each rank shades samples in the far half of the box (x in [0, 1])
        points = torch.rand(4000, 3, generator=generator, dtype=torch.float64) * 2 - 1
        points[:, 0] = low + torch.rand(4000, generator=generator, dtype=torch.float64) * 0.5
        slab = SlabPass(torch.ones(1, dtype=torch.bool), split.slabs, None, split._counting())
        slab.count_shaded(points[:1000])  # two steps' samples
        slab.count_shaded(points[1000:])
    counted = [split._layers[0].clone() for split in splits]
    assert counted[0][:-1].sum() == counted[1][:-1].sum() == 4000 and counted[0][: (r0 - 1) // 2].sum() == 0
    assert counted[0][-1] == counted[1][-1] == 2  # the steps counted
    for rank, split in enumerate(splits):  # the all-reduce: the other rank's counts added
        monkeypatch.setattr(space_parallel.dist, "all_reduce", lambda t, other=counted[1 - rank]: t.add_(other))
        split.balance()
    planes = splits[0].slabs.planes
    assert planes == splits[1].slabs.planes  # the same on every rank
    cut = {"step": model.config.occupancy.warmup, "vertices": r0, "planes": list(planes)}
    assert splits[0].cuts == [cut]  # for metrics.json
    assert abs(planes[0] - (3 * (r0 - 1)) // 4) <= 2  # the samples' median: three quarters along the axis
    assert splits[0]._layers is None  # counted afresh
    splits[0].balance()  # nothing counted since: even again (and no cut listed)
    assert splits[0].slabs.planes == Slabs.even(r0, 2, 0).planes and len(splits[0].cuts) == 1
