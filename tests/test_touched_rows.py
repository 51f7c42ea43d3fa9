"""The rows a training step's gradient reaches, which a sparse Adam must list: a lookup's gradient stays within the
corner rows of its points (models.field.corner_rows), the model's touched-rows marks cover every row a step
changes (the TV estimate's included), and the listed step equals the scan of the gradients."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from training.optim import SparseGridAdam


@pytest.mark.parametrize("op", [reference.grid_interpolate, cuda_ext.grid_interpolate])
def test_corner_rows_are_the_rows_the_lookup_gradient_reaches(op):
    from models.field import corner_rows

    generator = torch.Generator().manual_seed(3)
    shape = (5, 7, 6)
    grid = torch.randn(*shape, 3, dtype=torch.float64, generator=generator, requires_grad=True)
    inside = torch.rand(40, 3, dtype=torch.float64, generator=generator) * 1.8 - 0.9
    outside = torch.rand(20, 3, dtype=torch.float64, generator=generator) * 4.0 - 2.0  # clamped to the border
    for points, exact in ((inside, True), (torch.cat([inside, outside]), False)):
        grid.grad = None
        upstream = torch.rand(points.shape[0], 3, dtype=torch.float64, generator=generator) + 0.5  # never zero
        (op(grid, points) * upstream).sum().backward()
        reached = set(grid.grad.reshape(-1, 3).ne(0).any(1).nonzero().squeeze(1).tolist())
        listed = set(corner_rows(points, shape).tolist())
        assert reached <= listed
        if exact:  # interior points weigh all 8 corners
            assert reached == listed


def test_model_lists_every_row_a_training_step_changes():
    from test_model import make_model, randomize_density, rays_towards_centre

    model = make_model(grow_at=[], shading="per_sample", upsample=1)
    randomize_density(model, mean=-2.0, std=3.0)
    model.touched.enabled = True
    model.train()
    origins, directions = rays_towards_centre(64)
    out = model.render_rays(origins, directions)
    (out["rgb"].square().mean() + model.regularization()).backward()
    model.row_grads.scatter()  # the TV rows' gradients (model.tv_sparse_grad)
    rows = model.touched.take(model.grid_shape)
    assert rows.numel() > 0 and bool((rows[1:] > rows[:-1]).all())
    listed = torch.zeros(model.density.grid.shape[:3]).reshape(-1).bool()
    listed[rows] = True
    for grid in (model.density.grid, model.features.grid):
        changed = grid.grad.reshape(-1, grid.shape[-1]).ne(0).any(1)
        assert changed.any() and not bool((changed & ~listed).any())  # no gradient outside the listed rows
    assert model.touched.take(model.grid_shape).numel() == 0  # taken: the next step starts empty


def test_sparse_adam_first_step_on_listed_rows_equals_the_scan_of_the_gradients():
    from test_model import make_model, randomize_density, rays_towards_centre

    results = []
    for listed in (True, False):
        model = make_model(grow_at=[], shading="per_sample", upsample=1)
        randomize_density(model, mean=-2.0, std=3.0)
        model.touched.enabled = listed
        groups = model.param_groups(0.1, 1e-3)
        rows_fn = (lambda m=model: m.touched.take(m.grid_shape)) if listed else None
        optimizer = SparseGridAdam(groups, reference.sparse_adam_step, betas=(0.9, 0.99), eps=1e-15, rows_fn=rows_fn)
        model.train()
        origins, directions = rays_towards_centre(48)
        out = model.render_rays(origins, directions, jitter=torch.rand(48, generator=torch.Generator().manual_seed(1)))
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.zero_grad(set_to_none=True)
        (out["rgb"].square().mean() + model.regularization()).backward()
        model.row_grads.scatter()  # the TV rows' gradients (model.tv_sparse_grad)
        optimizer.step()
        after = [p.detach().clone() for p in model.parameters()]
        assert any(not torch.equal(a, b) for a, b in zip(after, before))
        results.append(after)
    # the listed rows are a superset of the non-zero-gradient rows; on a first step a zero-gradient row has zero
    # moments, so it does not move: a missing row would differ here
    for listed, scanned in zip(*results):
        assert torch.equal(listed, scanned)
