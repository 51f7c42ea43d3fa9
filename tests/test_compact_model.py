"""The finished model file (training.compact_model): only the kept vertices' rows (density float16, features uint8
codes into per-channel levels), the strict occupancy, bits for the masks; it renders what the full model renders,
and every tool opens it. CPU, a short run of the built-in scene."""

from __future__ import annotations

import itertools

import pytest
import torch
from omegaconf import OmegaConf
from test_train import run_train, tiny_overrides

from models.field import optical_depth
from training.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from training.compact_model import (
    compact_content,
    content_stats,
    dequantise,
    expand_state_dict,
    kept_vertices,
    pack_rows,
    quantise,
    read_model,
    stored_rows,
    strict_cells,
    unpack_rows,
)
from training.finished_run import build_model, load_run, scene_of
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


def models(folder, grid_dtype=torch.float16, **options):
    """(full model from last.pt with its occupancy carved to the densest 40% of cells, that model through the compact
    format in ``grid_dtype`` with ``options`` (quantised, strict), config). A 40-step tiny run learns too little
    density to skip cells by itself."""
    state = load_checkpoint(folder / "checkpoints" / "last.pt")
    config = state["config"]
    full = build_model(config["model"], scene_of(config["data"]), state["model"])
    with torch.no_grad():
        alpha = -torch.expm1(-optical_depth(full.density.grid[..., 0], full.config.density_shift, 1.0))
        full.occupancy.update(alpha, float(alpha.quantile(0.6)), 0)
    weights = expand_state_dict(compact_content(full, {"config": config}, grid_dtype, **options))
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
    full, compact, config = models(run, quantised=False, strict=False)
    content = compact_content(full, {"config": config}, quantised=False, strict=False)
    keep = kept_vertices(full.occupancy.mask)
    assert 0 < keep.float().mean() < 0.9  # the test means something: cells were skipped
    rows = stored_rows(content["sparse"]["features.grid"])  # float16, deflated
    assert rows.dtype == torch.float16 and rows.shape == (int(keep.sum()), full.features.grid.shape[-1])
    assert content["bits"]["occupancy.mask"]["bits"].dtype == torch.uint8  # one bit per cell, not a byte
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


def test_the_run_writes_the_strict_quantised_file_with_its_step_and_config(run):
    on_disk, run_state = read_model(run / "model.pt")  # the run's own file: its step, config and weights
    assert run_state["step"] == STEPS and run_state["config"] == config_of(run)
    content = load_checkpoint(run / "model.pt")
    assert content["version"] == 3
    features = content["sparse"]["features.grid"]
    channels = len(features["packed_codes"])
    assert features["levels"].shape == (channels, 256) and features["count"] == content_stats(content)["stored"]
    density = content["sparse"]["density.grid"]
    assert len(density["packed_rows"]) == 2 and density["count"] == features["count"]  # two byte planes, deflated
    stats = content_stats(content)
    assert stats["bytes_per_stored_vertex"] < 2 + channels  # fp16 density + under a byte a channel (deflated)
    assert stats["table_bytes"] == 4 * (256 + 1) * channels + 4  # levels, fills: float32
    assert 0 < stats["stored_fraction"] <= 1
    full = load_checkpoint(run / "checkpoints" / "last.pt")["model"]
    keep = kept_vertices(on_disk["occupancy.mask"])  # the corners of the file's cells
    for key, value in full.items():  # stored vertices: the fp16 density, the features through their levels
        if key == "density.grid":
            assert torch.equal(on_disk[key][keep], value[keep].half().float()), key
        elif key == "features.grid":
            assert (on_disk[key][keep] - value[keep]).abs().max() < 0.1, key
        elif key != "occupancy.mask":
            assert torch.equal(on_disk[key], value), key
    assert not (on_disk["occupancy.mask"] & ~full["occupancy.mask"]).any()  # strict: never a cell training skipped


def config_of(folder):
    return load_checkpoint(folder / "checkpoints" / "last.pt")["config"]


def test_quantise_codes_each_value_to_its_nearest_level():
    """Per channel, against brute force in float64: every code names the level nearest its value; levels increase;
    the error is below an even 256-step quantiser's over the channel's range (a few far outliers in the data)."""
    generator = torch.Generator().manual_seed(7)
    rows = torch.randn(100_000, 3, generator=generator) * torch.tensor([0.5, 2.0, 1.0])
    rows[:5, 1] = 40.0  # outliers stretch the range
    codes, levels = quantise(rows)
    assert codes.dtype == torch.uint8 and levels.shape == (3, 256)
    assert (levels[:, 1:] >= levels[:, :-1]).all()
    distance = (rows[:3000].double()[:, :, None] - levels.double()[None]).abs()  # (n, C, 256), the outliers in
    best = distance.min(-1).values
    chosen = distance.gather(2, codes[:3000].long()[..., None])[..., 0]
    torch.testing.assert_close(chosen, best, rtol=0, atol=1e-6)
    error = (dequantise(codes, levels) - rows).square().mean(0)
    even_steps = ((rows.amax(0) - rows.amin(0)) / 255) ** 2 / 12
    assert (error < even_steps).all(), (error, even_steps)


def test_packed_codes_come_back_bit_for_bit_and_damage_is_named():
    generator = torch.Generator().manual_seed(9)
    smooth = torch.cumsum(torch.randint(-2, 3, (5000, 4), generator=generator), 0) % 256  # neighbours alike
    codes = torch.cat([smooth, torch.randint(0, 256, (5000, 1), generator=generator)], 1).to(torch.uint8)
    packed = pack_rows(codes)
    assert torch.equal(unpack_rows(packed, 5000), codes)
    assert sum(p.numel() for p in packed[:4]) < 0.8 * 4 * 5000  # the differences deflate
    with pytest.raises(ValueError, match="channel 1"):
        unpack_rows([packed[0], packed[1][:-5]], 5000)
    with pytest.raises(ValueError, match="4999 rows"):
        unpack_rows(packed, 4999)


def test_packed_float16_rows_come_back_bit_for_bit():
    """float16 rows (the density): bit for bit through their int16 differences' byte planes, signs, infinities,
    NaN and subnormals included; a smooth field deflates well below 2 bytes a value; a bad plane count is named."""
    generator = torch.Generator().manual_seed(11)
    smooth = torch.cumsum(torch.randn(20000, 1, generator=generator) * 0.01, 0) - 3.0
    odd = torch.tensor([[float("inf")], [-float("inf")], [float("nan")], [6e-8], [-0.0], [65504.0]])
    rows = torch.cat([smooth, odd, torch.randn(20000, 1, generator=generator) * 100]).to(torch.float16)
    rows = torch.cat([rows, rows.flip(0)], 1)  # two channels
    packed = pack_rows(rows)
    assert len(packed) == 4
    back = unpack_rows(packed, rows.shape[0], torch.float16)
    assert back.dtype == torch.float16 and torch.equal(back.view(torch.int16), rows.view(torch.int16))
    assert packed[0].numel() + packed[1].numel() < 0.8 * 2 * rows.shape[0]  # channel 0: half smooth, deflated
    with pytest.raises(ValueError, match="multiple of 2"):
        unpack_rows(packed[:3], rows.shape[0], torch.float16)
    with pytest.raises(ValueError, match="uint8 or float16"):
        pack_rows(rows.float())


def test_format_2_files_still_load(run, tmp_path):
    """A model file of format 2 (density rows raw, codes deflated at zlib level 1) loads to the same weights."""
    content = load_checkpoint(run / "model.pt")
    density = content["sparse"]["density.grid"]
    density["rows"] = unpack_rows(density.pop("packed_rows"), int(density.pop("count")), torch.float16)
    content["version"] = 2
    save_checkpoint(tmp_path / "model.pt", content)
    old, _ = read_model(tmp_path / "model.pt")
    new, _ = read_model(run / "model.pt")
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in new)


def test_strict_cells_drop_only_cells_whose_corners_are_all_below_the_threshold(run):
    """Against a per-corner loop: a cell stays iff training kept it and one of its 8 corners has an alpha at or
    above the occupancy threshold."""
    full = models(run)[0]
    with torch.no_grad():
        noise = torch.randn(full.density.grid.shape, generator=torch.Generator().manual_seed(2))
        full.density.grid.copy_(noise * 4.0 - 8.0)  # mostly faint vertices, a few above the threshold
    alpha, (r0, r1, r2) = full.vertex_alpha(), full.occupancy.mask.shape
    corner = torch.zeros(r0, r1, r2, dtype=torch.bool)
    for a, b, c in itertools.product((0, 1), repeat=3):
        corner |= alpha[a : a + r0, b : b + r1, c : c + r2] >= full.config.occupancy.threshold
    strict = strict_cells(full)
    assert torch.equal(strict, full.occupancy.mask & corner)
    assert 0 < strict.sum() < full.occupancy.mask.sum()  # the test means something: cells dropped and kept


def test_the_compact_model_renders_the_same_images(run):
    full, compact, config = models(run)
    _, scene = load_scenes(OmegaConf.create(config["data"]), torch.device("cpu"))
    targets = [scene.images[v].float() / 255.0 for v in range(3)]
    full_images, compact_images = render_all(full, scene), render_all(compact, scene)
    for a, b, target in zip(full_images, compact_images, targets):
        assert abs(psnr(a, target) - psnr(b, target)) < 0.05
        assert psnr(a, b) > 45  # the rounding of the grids and the faint cells dropped, nothing else
    # stored in float32 the left-out vertices are the only difference: the renders are the same to the bit
    exact_full, exact = models(run, grid_dtype=torch.float32, quantised=False, strict=False)[:2]
    for a, b in zip(render_all(exact_full, scene), render_all(exact, scene)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("strict", [False, True])
def test_a_render_never_reads_a_left_out_vertex(run, strict):
    full, _, config = models(run, torch.float32)
    _, scene = load_scenes(OmegaConf.create(config["data"]), torch.device("cpu"))
    content = compact_content(full, {"config": config}, torch.float32, quantised=False, strict=strict)
    if strict:  # the reference: the full model with the file's occupancy
        full.occupancy.mask = strict_cells(full)
        assert full.occupancy.mask.sum() > 0
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
