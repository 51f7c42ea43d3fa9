"""``model.tv_background``: the grids' total variation with the pairs outside the foreground box (the contracted
shell) weighted by a multiplier, against a brute-force per-pair sum in float64, whole grid and sampled; 1 gives the
unweighted value bit for bit; the box's vertices in the contracted cube; bad values name the key."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from test_model import make_model

from models.config import parse_model_config
from models.contraction import SceneSpace
from models.field import VoxelGrid

SHAPE = (9, 7, 8)  # a non-cube, so every axis has its own mask


def float64_grid(gen: torch.Generator, shape=SHAPE, channels: int = 3) -> VoxelGrid:
    grid = VoxelGrid(shape, channels)
    grid.grid = torch.nn.Parameter(torch.randn(*shape, channels, generator=gen, dtype=torch.float64))
    return grid


def brute_force(values: torch.Tensor, inside: torch.Tensor, outside: float, lower=None) -> torch.Tensor:
    """Per pair (v, v + e_a): weight 1 if both vertices are inside, else ``outside``; the mean over each axis'
    pairs (and channels), summed over the axes. ``lower``: the (S, 3) lower vertices to use (the sampled
    estimate: every axis has the same S pairs), else every pair of the grid."""
    total = values.new_zeros(())
    for a in range(3):
        step = [int(b == a) for b in range(3)]
        if lower is None:
            vertices = [v for v in itertools.product(*map(range, values.shape[:3])) if v[a] + 1 < values.shape[a]]
        else:
            vertices = [tuple(v) for v in lower.tolist()]
        terms = []
        for v in vertices:
            u = tuple(x + s for x, s in zip(v, step))
            weight = 1.0 if bool(inside[v]) and bool(inside[u]) else outside
            terms.append(weight * (values[u] - values[v]).square().mean())
        total = total + torch.stack(terms).mean()
    return total


def foreground(shape=SHAPE) -> tuple[torch.Tensor, ...]:
    return SceneSpace("inf").foreground(shape, torch.device("cpu"))


def inside_vertices(masks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return masks[0][:, None, None] & masks[1][None, :, None] & masks[2][None, None, :]


def test_foreground_is_the_middle_half_of_the_contracted_cube():
    masks = foreground((9, 320, 5))
    assert masks[0].nonzero().squeeze(1).tolist() == [2, 3, 4, 5, 6]  # -2..2 by 0.5: |x| <= 1, the box's edge kept
    assert masks[1].sum() == 160 and masks[1].nonzero().min() == 80  # the capture preset's 320: 160 in the box
    assert masks[2].tolist() == [False, True, True, True, False]
    assert SceneSpace("none").foreground(SHAPE, torch.device("cpu")) is None  # bounded: all of it is the box


@pytest.mark.parametrize("outside", [10.0, 0.3, 0.0])
def test_whole_grid_tv_equals_the_per_pair_sum(gen, outside):
    grid, masks = float64_grid(gen), foreground()
    got = grid.total_variation(0, None, masks, outside)
    want = brute_force(grid.grid.detach(), inside_vertices(masks), outside)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    assert torch.autograd.gradcheck(lambda g: _whole(g, masks, outside), (grid.grid.detach().clone().requires_grad_(),))


def _whole(values: torch.Tensor, masks, outside: float) -> torch.Tensor:
    # the method on a plain tensor, so gradcheck differentiates through it
    return VoxelGrid.total_variation(SimpleNamespace(grid=values, shape=SHAPE), 0, None, masks, outside)


def test_sampled_tv_equals_the_per_pair_sum_on_its_samples(gen):
    grid, masks = float64_grid(gen), foreground()
    r0, r1, r2 = SHAPE
    cells = torch.randint((r0 - 1) * (r1 - 1) * (r2 - 1), (50,), generator=gen)
    got = grid.total_variation(50, None, masks, 10.0, cells=cells)
    lower = torch.stack([cells // ((r1 - 1) * (r2 - 1)), cells // (r2 - 1) % (r1 - 1), cells % (r2 - 1)], 1)
    want = brute_force(grid.grid.detach(), inside_vertices(masks), 10.0, lower)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    # some samples lie in the box, some outside: the weight mattered
    inside = inside_vertices(masks)[lower[:, 0], lower[:, 1], lower[:, 2]]
    assert 0 < int(inside.sum()) < 50


@pytest.mark.parametrize("samples", [0, 50])
def test_multiplier_one_gives_the_old_value_bit_for_bit(gen, samples):
    grid, masks = float64_grid(gen), foreground()
    torch.manual_seed(3)
    old = grid.total_variation(samples)
    torch.manual_seed(3)
    assert torch.equal(grid.total_variation(samples, None, masks, 1.0), old)
    if samples == 0:
        torch.testing.assert_close(
            old, brute_force(grid.grid.detach(), inside_vertices(masks), 1.0), rtol=1e-13, atol=0
        )


def test_model_regularization_weighs_the_shell(gen):
    overrides = {"contraction": "inf", "tv_samples": 0, "resolution_start": 9, "resolution_end": 9, "grow_at": []}
    model = make_model(seed=1, tv_background=10.0, **overrides)
    plain = make_model(seed=1, **overrides)
    with torch.no_grad():
        for m in (model, plain):
            m.density.grid.copy_(torch.randn(m.density.grid.shape, generator=torch.Generator().manual_seed(2)))
    c, inside = model.config, inside_vertices(foreground((9, 9, 9)))
    want = sum(
        weight * brute_force(grid.grid.detach().double(), inside, 10.0)
        for weight, grid in ((c.tv_density, model.density), (c.tv_features, model.features))
    )
    torch.testing.assert_close(model.regularization().double(), want, rtol=1e-5, atol=0)
    assert model.regularization() > plain.regularization()


def test_bad_values_name_the_key():
    with pytest.raises(ValueError, match="model.tv_background"):
        parse_model_config({"contraction": "inf", "tv_background": -1.0})
    with pytest.raises(ValueError, match="model.tv_background"):
        parse_model_config({"contraction": "inf", "tv_background": float("inf")})
    with pytest.raises(ValueError, match="model.tv_background: .*contraction=inf"):
        parse_model_config({"tv_background": 10.0})  # bounded: there is no shell
    assert parse_model_config({"tv_background": 1.0}).tv_background == 1.0
