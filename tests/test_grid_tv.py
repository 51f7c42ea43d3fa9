"""The trainer's total variation through ``ops.sampled_tv`` (models/grid_tv.py): its cells drawn before the forward,
the estimate and its gradient applied after the backward. On the cells it drew, its value and the gradients it adds
equal autograd's of the PyTorch estimate (the coarse grids with the shell's pair weights from the foreground masks,
the fine grid's bricks); it is taken only where it can be; the foreground's vertex ranges are the masks' runs."""

from __future__ import annotations

import pytest
import torch
from test_fine_grid import allocated
from test_model import TORCH_OPS, make_model, randomize_density

import cuda_ext
from models.contraction import SceneSpace
from models.field import _pair_weights
from models.ops import build_ops

BACKENDS = ["torch", pytest.param("custom", marks=pytest.mark.skipif(not cuda_ext.has_extension(), reason="no build"))]


def pytorch_estimate(param, cells, shape, scale, masks=None, outside=1.0):
    """(value, gradient) of the sampled TV as models.field / models.brick_grid write it, on ``cells`` of a stack of
    grids of ``shape`` vertices: gathered rows, the pairs' squared differences (weighted by ``_pair_weights`` of
    the foreground ``masks``), the mean per axis, summed; the gradient by autograd."""
    r0, r1, r2 = shape
    per = (r0 - 1) * (r1 - 1) * (r2 - 1)
    g, rest = cells // per, cells % per
    i, j, k = rest // ((r1 - 1) * (r2 - 1)), rest // (r2 - 1) % (r1 - 1), rest % (r2 - 1)
    centre = ((g * r0 + i) * r1 + j) * r2 + k
    index = torch.stack([centre, centre + r1 * r2, centre + r2, centre + 1]).reshape(-1)
    table = param.detach().reshape(-1, param.shape[-1]).double().requires_grad_(True)
    values = table[index].reshape(4, len(cells), -1)
    squares = (values[1:] - values[:1]) ** 2
    if masks is not None:
        vertex = [f[c] for f, c in zip(masks, (i, j, k))]
        pair = [f[c] & f[c + 1] for f, c in zip(masks, (i, j, k))]
        squares = squares * torch.stack(_pair_weights(pair, vertex, outside, torch.float64))[..., None]
    loss = scale * squares.mean(dim=(1, 2)).sum()
    (gradient,) = torch.autograd.grad(loss, table)
    return loss.detach(), gradient.reshape(param.shape)


def with_random_grads(model) -> dict:
    """Give every grid a random .grad (what the backward left) and return copies of them."""
    before = {}
    for name, param in model.named_parameters():
        if param.dim() >= 2 and param.numel():
            param.grad = torch.randn_like(param)
            before[name] = param.grad.clone()
    return before


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("contraction", ["none", "inf"])
def test_coarse_estimate_is_the_pytorch_one_on_its_cells(backend, contraction):
    shell = {"contraction": "inf", "tv_background": 10.0} if contraction == "inf" else {}
    model = make_model(3, ops=build_ops(TORCH_OPS | {"sampled_tv": backend}), tv_density=0.3, tv_features=0.02, **shell)
    randomize_density(model)
    model.double()  # float64 grids and gradients: the comparison is to rounding, not to float32's
    assert model.regularization(defer=True) is None  # no term in the loss: only the cells are drawn
    cells, fine = model.deferred_tv.cells
    assert fine is None  # no fine grid allocated
    before = with_random_grads(model)
    value = model.deferred_regularization()
    shape, c = model.grid_shape, model.config
    masks = model.space.foreground(shape, torch.device("cpu"))
    want = 0.0
    for name, scale in (("density.grid", c.tv_density), ("features.grid", c.tv_features)):
        param = dict(model.named_parameters())[name]
        part, gradient = pytorch_estimate(param, cells, shape, scale, masks, c.tv_background)
        want += part
        torch.testing.assert_close(param.grad.double() - before[name].double(), gradient, rtol=1e-10, atol=1e-15)
    torch.testing.assert_close(value, want, rtol=1e-12, atol=0)
    assert model.deferred_tv.cells is None and model.deferred_regularization() is None  # applied once


@pytest.mark.parametrize("backend", BACKENDS)
def test_fine_bricks_estimate_is_the_pytorch_one_on_its_cells(backend):
    model = allocated(std=0.5).double()
    model.ops = build_ops(TORCH_OPS | {"sampled_tv": backend})
    assert model.fine.active and model.regularization(defer=True) is None
    coarse, fine = model.deferred_tv.cells
    b, c = model.fine.brick, model.config
    assert int(fine.max()) < model.fine.bricks * (b - 1) ** 3
    before = with_random_grads(model)
    model.deferred_regularization()
    for name, scale in (("fine.density", c.tv_density * c.fine.tv), ("fine.features", c.tv_features * c.fine.tv)):
        param = dict(model.named_parameters())[name]
        _, gradient = pytorch_estimate(param, fine, (b, b, b), scale)
        torch.testing.assert_close(param.grad.double() - before[name].double(), gradient, rtol=1e-10, atol=1e-15)


def test_taken_only_where_it_applies():
    assert make_model(0).regularization(defer=True) is None
    for overrides in ({"tv_sparse_grad": False}, {"tv_samples": 0}):  # autograd's form; the whole grid's TV
        model = make_model(0, **overrides)
        assert isinstance(model.regularization(defer=True), torch.Tensor) and model.deferred_tv.cells is None
    assert isinstance(make_model(0).regularization(), torch.Tensor)  # without defer: the PyTorch estimate
    model = make_model(0, tv_until=0.5)
    model.progress = 0.6  # the TV is over: no term, nothing drawn
    assert model.regularization(defer=True) is None and model.deferred_regularization() is None


def test_the_rows_it_reads_are_marked():
    """The touched-rows sync moves the rows a step reads (the estimate's among them): the deferred estimate marks
    exactly the PyTorch estimate's rows."""
    model = make_model(2, tv_density=0.3)
    model.touched.enabled = True
    model.regularization(defer=True)
    cells, _ = model.deferred_tv.cells
    model.deferred_regularization()
    marks = model.touched.mask(model.grid_shape).clone()
    model.touched.mask(model.grid_shape).zero_()
    model.density.total_variation(len(cells), model.touched.mask(model.grid_shape), cells=cells)  # PyTorch's marks
    assert torch.equal(marks, model.touched.mask(model.grid_shape)) and int(marks.sum()) > len(cells)


def test_a_grid_without_a_gradient_gets_one():
    model = make_model(1, tv_density=0.3)
    randomize_density(model)
    model.regularization(defer=True)
    assert model.density.grid.grad is None
    model.deferred_regularization()
    assert model.density.grid.grad is not None and model.density.grid.grad.abs().sum() > 0


@pytest.mark.parametrize("r", [3, 5, 9, 32, 33, 128, 174, 236, 320, 321])
def test_foreground_ranges_are_the_masks_runs(r):
    space = SceneSpace("inf")
    masks = space.foreground((r, r + 1, 7), torch.device("cpu"))
    ranges = space.foreground_ranges((r, r + 1, 7))
    for mask, (lo, hi) in zip(masks, ranges):
        want = torch.zeros_like(mask)
        want[lo : hi + 1] = True
        assert torch.equal(mask, want)
    assert SceneSpace("none").foreground_ranges((5, 5, 5)) is None


@pytest.mark.skipif(not cuda_ext.has_extension(), reason="no build")
def test_a_training_run_is_the_same_run_with_the_op_or_its_reference(tmp_path):
    """The trainer's step with the deferred TV: the kernel and the PyTorch reference train the same model."""
    from test_distributed import assert_same_model, single, tiny

    from training.checkpoint import load_checkpoint

    cache = tmp_path / "cache"
    for backend in ("custom", "torch"):
        result = single(tiny(cache, tmp_path / backend, 12) + [f"ops.sampled_tv={backend}", "model.tv_density=0.1"])
        assert result.returncode == 0, result.stderr[-2000:]
    runs = [load_checkpoint(tmp_path / b / "checkpoints" / "last.pt", map_location="cpu") for b in ("custom", "torch")]
    assert_same_model(*runs)
