"""training.export: the mesh of a briefly trained run against the procedural scene's known solids, the mesh of a
hand-made density (exact geometry and colour), the weights-only file's round trip, and the one-line errors.
Runs use ops=torch, so nothing here needs the compiled kernels."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_train import REPO, run_train, tiny_overrides

from data.cameras import look_at
from data.geometry import Box, Cylinder, Ellipsoid, Sphere
from data.synthetic import SHAPES
from models.model import VoxelNeRF
from training import export, finished_run

plyfile = pytest.importorskip("plyfile", reason='plyfile is not installed (pip install -e ".[mesh]")')
pytest.importorskip("mcubes", reason='PyMCubes is not installed (pip install -e ".[mesh]")')

# The least training whose default (alpha 0.5) surface has the scene's box within two of its voxels: a 20^3 grid
# (voxel 0.158 over the 3.0 box) from 24 views of 32 px, per-ray batches, the opacity loss on the masks so that
# empty space clears. Measured: after 200 steps no vertex reaches alpha 0.5 yet (the largest is 0.38: the
# surfaces are still a few voxels thick), after 300 the box is within 1.0 voxel, after 400 (used) within 0.6.
MESH_STEPS = 400
MESH_OVERRIDES = [
    "data.resolution=32",
    "data.n_train=24",
    "model.resolution_start=12",
    "model.resolution_end=20",
    "model.grow_at=[0.2]",
    "model.upsample=1",
    "train.batch_rays=256",
    "train.opacity_loss=0.1",
    "model.occupancy.warmup=40",
    "model.occupancy.refresh_every=20",
    "train.log_every=50",
    "train.turntable_frames=0",
    "train.tensorboard=false",
]


def shape_box(solid) -> tuple[np.ndarray, np.ndarray]:
    """Axis-aligned (min, max) corners of one of data.geometry's solids."""
    centre = np.asarray(solid.center, np.float64)
    if isinstance(solid, Sphere):
        half = np.full(3, solid.radius)
    elif isinstance(solid, Ellipsoid):
        half = np.asarray(solid.radii, np.float64)
    elif isinstance(solid, Cylinder):
        half = np.array([solid.radius, solid.radius, solid.half_height])
    elif isinstance(solid, Box):  # turned about z by yaw
        c, s = abs(math.cos(solid.yaw)), abs(math.sin(solid.yaw))
        hx, hy, hz = solid.half
        half = np.array([c * hx + s * hy, s * hx + c * hy, hz])
    else:
        raise TypeError(f"unknown solid {solid!r}")
    return centre - half, centre + half


def scene_box() -> tuple[np.ndarray, np.ndarray]:
    """The box around every solid of the procedural scene (data/synthetic.py SHAPES)."""
    boxes = [shape_box(solid) for solid in SHAPES]
    return np.min([low for low, _ in boxes], axis=0), np.max([high for _, high in boxes], axis=0)


def run_export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "training.export", *map(str, args)], cwd=REPO, capture_output=True, text=True
    )


def read_ply(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    data = plyfile.PlyData.read(str(path))
    vertex = data["vertex"].data
    vertices = np.stack([vertex["x"], vertex["y"], vertex["z"]], axis=1)
    colours = np.stack([vertex["red"], vertex["green"], vertex["blue"]], axis=1)
    faces = np.stack(list(data["face"].data["vertex_indices"]))
    assert not data.text and vertex["red"].dtype == np.uint8
    return vertices, faces, colours


def open_edges(faces: np.ndarray) -> int:
    """Edges not shared by exactly two faces: 0 for a closed (watertight) triangle surface."""
    edges = np.sort(np.concatenate([faces[:, [0, 1]], faces[:, [1, 2]], faces[:, [2, 0]]]), axis=1)
    _, counts = np.unique(edges, axis=0, return_counts=True)
    return int((counts != 2).sum())


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("export_run")
    cache = tmp_path_factory.mktemp("export_scene")
    keep = ["train.keep_resumable=true"]  # model.pt and last.pt of the same step: the tools read the newer, last.pt
    result = run_train(
        tiny_overrides(cache, MESH_STEPS) + MESH_OVERRIDES + keep + [f"hydra.run.dir={run}"], timeout=600
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return run


# ---------------------------------------------------------------------------------------------- mesh
def test_the_mesh_of_a_trained_run_has_the_scenes_box(trained_run, tmp_path):
    out = tmp_path / "scene.ply"
    result = run_export("mesh", trained_run, "--out", out)  # the default level (alpha 0.5)
    assert result.returncode == 0, result.stderr
    vertices, faces, colours = read_ply(out)
    assert f"wrote {out}: {len(vertices)} vertices, {len(faces)} faces" in result.stdout
    assert len(faces) > 100 and faces.min() >= 0 and faces.max() < len(vertices)
    assert open_edges(faces) == 0, "the scene's mesh should be watertight"

    model, _ = export.load_run(trained_run)
    box = model.bbox.numpy()
    voxel = float(np.max((box[1] - box[0]) / (np.array(model.density.shape) - 1)))
    low, high = scene_box()  # x, y: the pedestal's +-1.2; z: its bottom -0.5 to the sphere's top 0.6
    error = np.concatenate([vertices.min(0) - low, vertices.max(0) - high]) / voxel
    assert np.abs(error).max() <= 2.0, f"mesh box off the scene's by {np.round(error, 2)} voxels of {voxel:.3f}"
    sphere = SHAPES[1]  # the red one: the vertices on its top (clear of the other solids) are red
    top = (np.linalg.norm(vertices - sphere.center, axis=1) < sphere.radius + voxel) & (vertices[:, 2] > 0.3)
    red, green, blue = colours[top].astype(float).mean(0)
    assert top.sum() >= 10 and red > 1.5 * max(green, blue), (top.sum(), red, green, blue)


def test_a_hand_made_density_meshes_to_its_sphere_in_world_coordinates_and_colour():
    """A known density: a ball of radius 0.5 off the centre of a box that is not a cube; the surface, its
    world position (model.bbox), the outward faces and the vertex colours are checked exactly."""
    bbox = torch.tensor([[-1.0, -0.8, -0.6], [1.0, 0.8, 0.6]])
    config = {"resolution_end": 41, "grow_at": [], "feature_dim": 4}
    model = VoxelNeRF(bbox, 0.5, 5.0, config, finished_run.reference_ops())
    centre, radius = torch.tensor([0.3, -0.2, 0.1]), 0.5
    axes = [torch.linspace(float(bbox[0, a]), float(bbox[1, a]), n) for a, n in enumerate(model.density.shape)]
    points = torch.stack(torch.meshgrid(*axes, indexing="ij"), dim=-1)
    voxel = 2.0 / 40
    # per-voxel alpha falling linearly from 1 to 0 over 4 voxels across the sphere (0.5 on it), so that marching
    # cubes' linear interpolation along the grid's edges finds the sphere itself; density = its inverse
    alpha = (0.5 + (radius - torch.linalg.vector_norm(points - centre, dim=-1)) / (4 * voxel)).clamp(1e-3, 1 - 1e-3)
    depth = -torch.log1p(-alpha)  # optical depth of one voxel: softplus(density + shift)
    raw = torch.log(torch.expm1(depth)) - model.config.density_shift
    colour = torch.tensor([0.8, 0.2, 0.4])
    with torch.no_grad():
        model.density.grid.copy_(raw[..., None])
        model.features.grid[..., :3] = torch.logit(colour)
    torch.testing.assert_close(export.vertex_alpha(model), alpha)
    vertices, faces, colours = export.extract_mesh(model, 0.5)
    radial = np.linalg.norm(vertices - centre.numpy(), axis=1)
    assert np.abs(radial - radius).max() < 0.05 * voxel
    a, b, c = (vertices[faces[:, k]] for k in range(3))
    outward = np.einsum("ij,ij->i", np.cross(b - a, c - a), (a + b + c) / 3 - centre.numpy())
    assert (outward > 0).all(), "faces should be counter-clockwise seen from outside"
    assert open_edges(faces) == 0, "the sphere should be watertight"
    assert np.abs(colours.astype(int) - np.round(colour.numpy() * 255)).max() <= 1

    # a solid running out of the grid: closed by caps on the box's faces, never beyond them
    with torch.no_grad():
        model.density.grid.fill_(10.0)
    vertices, faces, _ = export.extract_mesh(model, 0.5)
    assert np.allclose(vertices.min(0), bbox[0].numpy()) and np.allclose(vertices.max(0), bbox[1].numpy())
    assert open_edges(faces) == 0, "the capped solid should be watertight"

    # --resolution resamples the same field: the sphere again, at the finer grid's precision
    with torch.no_grad():
        model.density.grid.copy_(raw[..., None])
    vertices, _, _ = export.extract_mesh(model, 0.5, resolution=81)
    assert np.abs(np.linalg.norm(vertices - centre.numpy(), axis=1) - radius).max() < 0.1 * voxel


def test_mesh_errors_are_one_line(trained_run, tmp_path, capsys):
    assert export.main(["mesh", str(tmp_path / "nowhere")]) == export.EXIT_USAGE
    assert capsys.readouterr().err == f"error: {tmp_path / 'nowhere'}: no such run folder\n"

    (tmp_path / "empty_run").mkdir()
    assert export.main(["mesh", str(tmp_path / "empty_run")]) == export.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "last.pt: checkpoint not found" in err and err.count("\n") == 1

    out = tmp_path / "none.ply"
    assert export.main(["mesh", str(trained_run), "--level", "0.9999", "--out", str(out)]) == export.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("error: empty mesh: no vertex reaches alpha 0.9999") and "lower --level" in err
    assert not out.exists()

    assert export.main(["mesh", str(trained_run), "--level", "1.5"]) == export.EXIT_USAGE
    assert "--level: the surface's alpha must lie in (0, 1)" in capsys.readouterr().err

    damaged = tmp_path / "damaged_run" / "checkpoints" / "last.pt"
    damaged.parent.mkdir(parents=True)
    damaged.write_bytes(b"not a checkpoint")
    assert export.main(["weights", str(damaged.parents[1])]) == export.EXIT_USAGE
    assert "cannot read checkpoint" in capsys.readouterr().err


def test_mesh_without_the_optional_packages_names_the_extra(trained_run, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mcubes", None)  # import mcubes -> ImportError
    assert export.main(["mesh", str(trained_run)]) == export.EXIT_USAGE
    assert capsys.readouterr().err == 'error: mesh export needs the PyMCubes package: pip install -e ".[mesh]"\n'


def test_the_cli_reports_a_missing_run_on_stderr():
    result = run_export("mesh", "/nonexistent/run")
    assert result.returncode == export.EXIT_USAGE
    assert result.stderr == "error: /nonexistent/run: no such run folder\n" and result.stdout == ""


# ---------------------------------------------------------------------------------------------- weights
def render(model: VoxelNeRF) -> torch.Tensor:
    c2w = torch.from_numpy(look_at(np.array([[2.5, -2.5, 2.0]]))[0]).float()
    return model.render_image(c2w, 12, 12, focal=14.0)["rgb"]


def test_weights_round_trip(trained_run, tmp_path):
    model, state = export.load_run(trained_run)
    expected = render(model)
    assert expected.std() > 0.01  # the view shows something

    result = run_export("weights", trained_run, "--out", tmp_path / "weights.pt")
    assert result.returncode == 0, result.stderr
    assert f"wrote {tmp_path / 'weights.pt'}" in result.stdout and f"step {MESH_STEPS} (float32 grids)" in result.stdout
    content = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert set(content) >= {"model", "model_config", "scene", "step"} and "optimizer" not in content
    assert content["scene"] == {"near": 2.0, "far": 6.0, "bbox": [[-1.5] * 3, [1.5] * 3]}
    loaded = export.load_weights(tmp_path / "weights.pt")
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert torch.equal(render(loaded), expected)

    half = export.export_weights(trained_run, half=True)  # default name, beside the checkpoint
    assert half["path"] == trained_run / "weights_fp16.pt" and half["grids_dtype"] == "float16"
    content = torch.load(half["path"], weights_only=True)
    assert content["model"]["density.grid"].dtype == torch.float16
    for key, value in content["model"].items():  # the grids alone are halved
        if value.is_floating_point():
            assert value.dtype == (torch.float16 if key in export.GRID_KEYS else torch.float32), key
    full_size = (tmp_path / "weights.pt").stat().st_size
    assert half["bytes"] < 0.75 * full_size < (trained_run / "checkpoints" / "last.pt").stat().st_size
    loaded_half = export.load_weights(half["path"])
    assert loaded_half.density.grid.dtype == torch.float32
    assert (render(loaded_half) - expected).abs().max() < 2e-2
    assert not list(trained_run.glob(".*.tmp")) and not list(tmp_path.glob(".*.tmp"))


def test_a_run_that_kept_only_its_model_exports_the_same_mesh_and_weights(trained_run, tmp_path):
    assert export.checkpoint_path(trained_run) == trained_run / "checkpoints" / "last.pt"  # written after model.pt
    only = tmp_path / "only_model"
    only.mkdir()
    (only / "model.pt").write_bytes((trained_run / "model.pt").read_bytes())
    assert export.checkpoint_path(only) == only / "model.pt"
    full = export.extract_mesh(export.load_run(trained_run)[0])[0]
    compact = export.extract_mesh(export.load_run(only)[0])[0]
    model, _ = export.load_run(only)
    voxel = float(((model.bbox[1] - model.bbox[0]) / (torch.tensor(model.density.shape) - 1)).max())
    assert abs(len(compact) - len(full)) <= 0.01 * len(full)  # fp16 grids move the surface by a hair
    np.testing.assert_allclose(compact.min(0), full.min(0), atol=0.1 * voxel)
    np.testing.assert_allclose(compact.max(0), full.max(0), atol=0.1 * voxel)
    result = export.export_weights(only, tmp_path / "w.pt", half=True)
    assert result["step"] == MESH_STEPS and result["bytes"] > (only / "model.pt").stat().st_size * 0.5


def test_load_weights_refuses_other_files(trained_run):
    with pytest.raises(export.ExportError, match="not a voxel-field weights file"):
        export.load_weights(trained_run / "checkpoints" / "last.pt")
