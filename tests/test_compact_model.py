"""The finished model file (training.compact_model): only the kept vertices' rows, float16, bits for the masks;
it renders what the full model renders, and every tool opens it. CPU, a short run of the built-in scene."""

from __future__ import annotations

import itertools

import pytest
import torch
from omegaconf import OmegaConf
from test_train import run_train, tiny_overrides

from models.field import optical_depth
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.compact_model import compact_content, expand_state_dict, kept_vertices, read_model
from training.export import build_model, load_run, scene_of
from training.inference import render_view
from training.metrics import psnr
from training.scenes import load_scenes

STEPS = 40


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 40-step run that kept both files: model.pt and checkpoints/last.pt of the same step."""
    folder, cache = tmp_path_factory.mktemp("compact_run"), tmp_path_factory.mktemp("compact_scene")
    extra = ["train.keep_resumable=true", "train.turntable_frames=0"]
    result = run_train(tiny_overrides(cache, STEPS) + extra + [f"hydra.run.dir={folder}"], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return folder


def models(folder, grid_dtype=torch.float16):
    """(full model from last.pt with its occupancy carved to the densest 40% of cells, that model through the compact
    format in ``grid_dtype``, config). A 40-step tiny run learns too little density to skip cells by itself."""
    state = load_checkpoint(folder / "checkpoints" / "last.pt")
    config = state["config"]
    full = build_model(config["model"], scene_of(config["data"]), state["model"])
    with torch.no_grad():
        alpha = -torch.expm1(-optical_depth(full.density.grid[..., 0], full.config.density_shift, 1.0))
        full.occupancy.update(alpha, float(alpha.quantile(0.6)), 0)
    weights = expand_state_dict(compact_content(full, {"config": config}, grid_dtype))
    return full, build_model(config["model"], scene_of(config["data"]), weights), config


def render_all(model, scene):
    return [render_view(model, scene.c2w[v], scene.height, scene.width, scene.intrinsics[v])["rgb"] for v in range(3)]


def test_kept_vertices_are_the_corners_of_occupied_cells():
    cells = torch.rand(5, 4, 6, generator=torch.Generator().manual_seed(0)) < 0.1
    expected = torch.zeros(6, 5, 7, dtype=torch.bool)
    for i, j, k in cells.nonzero().tolist():
        for a, b, c in itertools.product((0, 1), repeat=3):
            expected[i + a, j + b, k + c] = True
    assert torch.equal(kept_vertices(cells), expected)


def test_the_file_keeps_only_occupied_corners_and_the_same_step_and_config(run):
    full, compact, config = models(run)
    content = compact_content(full, {"config": config})
    keep = kept_vertices(full.occupancy.mask)
    assert 0 < keep.float().mean() < 0.9  # the test means something: cells were skipped
    rows = content["sparse"]["features.grid"]["rows"]
    assert rows.dtype == torch.float16 and rows.shape == (int(keep.sum()), full.features.grid.shape[-1])
    assert content["bits"]["occupancy.mask"]["bits"].dtype == torch.uint8  # one bit per cell, not a byte
    on_disk, run_state = read_model(run / "model.pt")  # the run's own file: its step, config and weights
    assert run_state["step"] == STEPS and run_state["config"] == config
    for key, value in load_checkpoint(run / "checkpoints" / "last.pt")["model"].items():
        assert torch.equal(on_disk[key], value.half().float() if key.endswith(".grid") else value), key
    assert torch.equal(compact.occupancy.mask, full.occupancy.mask)
    for key, value in full.state_dict().items():  # kept vertices hold the fp16 of the full model's values
        other = compact.state_dict()[key]
        if value.dim() >= 3 and value.is_floating_point():
            mask = keep if value.shape[:3] == keep.shape else torch.ones(value.shape[:3], dtype=torch.bool)
            torch.testing.assert_close(other[mask], value[mask].half().float(), rtol=0, atol=0)
        else:
            assert torch.equal(other, value), key
    # a left-out vertex of the density grid holds the grid's own minimum: at least as empty as any vertex
    assert torch.equal(compact.density.grid[~keep], full.density.grid.min().expand_as(compact.density.grid[~keep]))


def test_the_compact_model_renders_the_same_images(run):
    full, compact, config = models(run)
    _, scene = load_scenes(OmegaConf.create(config["data"]), torch.device("cpu"))
    targets = [scene.images[v].float() / 255.0 for v in range(3)]
    full_images, compact_images = render_all(full, scene), render_all(compact, scene)
    for a, b, target in zip(full_images, compact_images, targets):
        assert abs(psnr(a, target) - psnr(b, target)) < 0.05
        assert psnr(a, b) > 50  # the fp16 rounding of the grids, nothing else
    # stored in float32 the left-out vertices are the only difference: the renders are the same to the bit
    exact_full, exact = models(run, grid_dtype=torch.float32)[:2]
    for a, b in zip(render_all(exact_full, scene), render_all(exact, scene)):
        assert torch.equal(a, b)


def test_a_render_never_reads_a_left_out_vertex(run):
    full, _, config = models(run, torch.float32)
    _, scene = load_scenes(OmegaConf.create(config["data"]), torch.device("cpu"))
    content = compact_content(full, {"config": config}, torch.float32)
    for entry in content["sparse"].values():  # poison every left-out vertex
        entry["fill"] = torch.full_like(entry["fill"], float("nan"))
    poisoned = build_model(config["model"], scene_of(config["data"]), expand_state_dict(content))
    assert torch.isnan(poisoned.density.grid).any()
    for a, b in zip(render_all(full, scene), render_all(poisoned, scene)):
        assert torch.equal(a, b)


def test_every_tool_opens_a_run_that_kept_only_its_model(run, tmp_path):
    only = tmp_path / "only_model"
    only.mkdir()
    (only / "model.pt").write_bytes((run / "model.pt").read_bytes())
    model, state = load_run(only)
    assert state["step"] == STEPS and "optimizer" not in state
    assert torch.equal(model.density.grid, read_model(run / "model.pt")[0]["density.grid"])
    result = run_train(["render_only=true", f"hydra.run.dir={only}"], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (only / "metrics.json").is_file() and (only / "renders" / "000_pred.png").is_file()


def test_a_damaged_or_foreign_model_file_is_named(tmp_path):
    path = tmp_path / "model.pt"
    save_checkpoint(path, {"format": "something else"})
    with pytest.raises(CheckpointError, match="not a voxel-field model file"):
        read_model(path)
    path.write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="model.pt: cannot read checkpoint"):
        read_model(path)
