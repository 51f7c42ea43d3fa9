"""The scene contraction (models/contraction.py, march_rays with ``t_split``): the map in float64 (the box kept,
continuity at its surface, monotone outwards, infinity on the cube's surface), the contracted samples against a
per-sample loop of their definition, each sample's world step against the march's dt/dk, the occupancy steps, the
config rules, and a model on the unbounded procedural scene beating the same model without contraction."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from test_march import call, scene
from test_model import TORCH_OPS, make_cfg, make_model, one_thread, randomize_density, rays_towards_centre  # noqa: F401

import cuda_ext
from cuda_ext import reference
from data import RaySampler, ensure_synthetic_scene, load_blender
from models import VoxelNeRF, build_ops
from models.config import parse_model_config
from models.contraction import SceneSpace, box_radius, contract_points, split_distances

F64 = torch.float64


def random_directions(count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(count, 3, generator=generator, dtype=F64), dim=1)


# ------------------------------------------------------------------------------------------------- the map


def test_the_box_is_kept_and_halved():
    generator = torch.Generator().manual_seed(0)
    inside = torch.rand(1000, 3, generator=generator, dtype=F64) * 2 - 1
    torch.testing.assert_close(contract_points(inside), inside / 2, rtol=0, atol=0)


def test_continuous_at_the_box_surface():
    """Just inside and just outside the box surface the contracted points agree to first order in the gap."""
    directions = random_directions(500, 1)
    on_surface = directions / directions.abs().amax(1, keepdim=True)  # max |u_a| = 1
    for gap in (1e-3, 1e-6, 1e-9):
        inner, outer = contract_points(on_surface * (1 - gap)), contract_points(on_surface * (1 + gap))
        assert (outer - inner).abs().max() < 3 * gap


def test_monotone_outwards_and_infinity_on_the_cube_surface():
    directions = random_directions(300, 2)
    radii = torch.logspace(-2, 12, 200, dtype=F64)
    points = contract_points(directions[:, None, :] * radii[None, :, None])  # (rays, radii, 3)
    norm = points.abs().amax(-1)
    assert bool((norm[:, 1:] > norm[:, :-1]).all())  # strictly increasing with the distance
    assert bool((norm < 1).all())  # every finite point inside the grid's [-1, 1]^3
    torch.testing.assert_close(norm[:, -1], torch.ones(300, dtype=F64), rtol=0, atol=1e-11)
    # radial: a point keeps its direction (the contraction only shrinks the L-inf norm)
    cosine = torch.nn.functional.cosine_similarity(points, directions[:, None, :].expand_as(points), dim=-1)
    torch.testing.assert_close(cosine, torch.ones_like(cosine))
    # outside the box: norm = (2 - 1 / m) / 2 with m the L-inf norm of the box coordinate
    m = (directions[:, None, :] * radii[None, :, None]).abs().amax(-1)
    torch.testing.assert_close(norm[m > 1], ((2 - 1 / m) / 2)[m > 1], rtol=1e-14, atol=0)


# ------------------------------------------------------------------------------------------ the samples


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_contracted_samples_follow_the_definition(dtype):
    """A per-sample loop in float64 over march_rays' docstring: linear up to t_split, then uniform in disparity about
    t_split - P while 1 - (j + offset) step / P > 0, points contracted (cells compared away from borders only)."""
    args = scene(24, dtype=dtype, seed=3, step=0.05, space="contracted")
    ray, t, points, offsets = call(cuda_ext.march_rays, args)
    a = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in args.items()}
    box, cells, step = a["box"], torch.tensor(args["occupancy"].shape, dtype=F64), args["step"]
    radius = float(((box[1] - box[0]) / 2).min())
    expected_rays, expected_t, expected_points = [], [], []
    for b in range(24):
        linear = max(0, math.ceil((a["t_split"][b] - a["t_start"][b]).item() / step - a["offset"][b].item()))
        for k in range(args["max_samples"]):
            if k < linear:
                tk = a["t_start"][b] + (k + a["offset"][b]) * step
            else:
                den = 1 - (k - linear + a["offset"][b]) * step / radius
                if den <= 0:
                    break
                tk = a["t_split"][b] - radius + radius / den
            if not tk < a["t_end"][b]:
                break
            unit = (a["origins"][b] + tk * a["directions"][b] - box[0]) * 2 / (box[1] - box[0]) - 1
            point = contract_points(unit)
            cell = ((point + 1) * cells / 2).floor().clamp(torch.zeros(3), cells - 1).long()
            if args["occupancy"][tuple(cell.tolist())]:
                expected_rays.append(b), expected_t.append(tk.item()), expected_points.append(point)
    assert ray.tolist() == expected_rays  # no sample near a border in this case: the same cells
    tol = 1e-9 if dtype == torch.float64 else 2e-4  # far samples: t up to ~1e5 from a 1 - x near 0
    torch.testing.assert_close(t.double(), torch.tensor(expected_t, dtype=F64), rtol=tol, atol=tol)
    torch.testing.assert_close(points.double(), torch.stack(expected_points), rtol=tol, atol=tol)
    assert offsets.tolist() == [0] + torch.cumsum(torch.bincount(ray, minlength=24), 0).tolist()


def test_sample_steps_are_the_march_spacing():
    """SceneSpace.sample_steps (the optical depth's world step) is dt/dk of the march: the derivative of each
    sample's t with respect to the ray's offset, by central differences in float64, everywhere occupied."""
    args = scene(200, seed=4, step=0.02, space="contracted") | {"occupancy": torch.ones(1, 1, 1, dtype=torch.bool)}
    args["offset"] = args["offset"].clamp(0.1, 0.9)
    h = 1e-6
    low, high = (call(cuda_ext.march_rays, args | {"offset": args["offset"] + d}) for d in (-h, h))
    assert torch.equal(low[0], high[0])  # the same samples (no linear count or ending changed)
    ray, t, _, _ = call(cuda_ext.march_rays, args)
    steps = SceneSpace("inf").sample_steps(t, ray, args["t_split"], args["step"], args["box"])
    finite = high[1] < 1e4  # beyond, the difference quotient loses its digits
    derivative = (high[1] - low[1]) / (2 * h)
    torch.testing.assert_close(steps[finite], derivative[finite], rtol=1e-4, atol=0)
    assert float(steps.max()) > 100 * args["step"] and float(steps.min()) == args["step"]
    assert SceneSpace("none").sample_steps(t, ray, None, 0.5, args["box"]) == 0.5


def test_march_coordinate_spaces_samples_by_step():
    """SceneSpace.march_coordinate (the distortion loss's coordinate) puts consecutive samples of a ray exactly
    ``step`` apart, in the linear part and in the disparity part alike (float64, everything occupied), except across
    the split, where the disparity part restarts at t_split (a gap in (0, 2 step)); bounded: t."""
    args = scene(200, seed=5, step=0.02, space="contracted") | {"occupancy": torch.ones(1, 1, 1, dtype=torch.bool)}
    ray, t, _, _ = call(cuda_ext.march_rays, args)
    coordinate = SceneSpace("inf").march_coordinate(t, ray, args["t_split"], args["box"])
    same_ray = ray[1:] == ray[:-1]
    gaps = (coordinate[1:] - coordinate[:-1])[same_ray]
    across = (t[:-1] < args["t_split"][ray[:-1]]) & (t[1:] >= args["t_split"][ray[1:]])
    regular = gaps[~across[same_ray]]
    torch.testing.assert_close(regular, torch.full_like(regular, args["step"]), rtol=0, atol=1e-9)
    assert bool(((gaps > 0) & (gaps < 2 * args["step"])).all())
    assert float((t[1:] - t[:-1])[same_ray].max()) > 100 * args["step"]  # while world gaps grow far out
    assert SceneSpace("none").march_coordinate(t, ray, None, args["box"]) is t


def test_split_distances():
    """The box exit for rays that hit the box (from outside and from inside), the closest approach to the centre for
    rays that miss it, never before near."""
    box = torch.tensor([[-1.0, -2.0, -1.0], [1.0, 2.0, 3.0]], dtype=F64)
    origins = torch.tensor([[-5.0, 0, 1], [0, 0, 1], [-5.0, 10, 1], [0.5, 0, 1]], dtype=F64)
    directions = torch.tensor([[1.0, 0, 0], [0, 1, 0], [1, 0, 0], [-1, 0, 0]], dtype=F64)
    got = split_distances(origins, directions, box, near=0.2)
    torch.testing.assert_close(got, torch.tensor([6.0, 2.0, 5.0, 1.5], dtype=F64))
    assert float(split_distances(origins[3:], -directions[3:], box, near=0.7)[0]) == 0.7  # exit at 0.5 < near
    assert float(box_radius(box)) == 1.0


def test_box_radius_from_the_host_extent_is_the_stored_box_s():
    """The training march takes the disparity radius from the host's extent (no device op): bit for bit the float32
    box's own, whatever the box (odd float32 corners, the smallest side on each axis)."""
    generator = torch.Generator().manual_seed(9)
    for axis in range(3):
        low = torch.rand(3, generator=generator) * 3 - 2.7
        size = torch.rand(3, generator=generator) + 0.3
        size[axis] = 0.123456789  # the smallest side
        box = torch.stack([low, low + size]).float()
        extent = tuple(float(e) for e in (box[1] - box[0]).tolist())  # as models.model keeps it
        assert box_radius(extent) == float(box_radius(box)) and isinstance(box_radius(extent), float)


@pytest.mark.parametrize("contract", ["none", "inf"])
def test_march_range_uses_the_host_extent(contract):
    """The samples per ray come from the extent the host keeps, not from the box (on CUDA: no sync); the ranges
    are the box's either way."""
    space = SceneSpace(contract)
    box = torch.tensor([[-1.0, -2.0, -1.0], [1.0, 2.0, 3.0]])
    origins = torch.tensor([[-5.0, 0, 1], [0, 0, 1]])
    directions = torch.tensor([[1.0, 0, 0], [0, 1, 0]])
    extent = tuple(float(e) for e in (box[1] - box[0]).tolist())
    first = space.march_range(origins, directions, box, extent, 0.1, 12.0, 0.05, 4096)
    second = space.march_range(origins, directions, box, (4.0, 8.0, 8.0), 0.1, 12.0, 0.05, 4096)
    for a, b in zip(first[:3], second[:3]):
        torch.testing.assert_close(a, b)  # the ranges: from the box
    assert first[3] != second[3]  # the count: from the extent given


@pytest.mark.requires_cuda
@pytest.mark.parametrize("contract", ["none", "inf"])
def test_march_range_makes_no_device_sync(contract):
    space = SceneSpace(contract)
    box = torch.tensor([[-1.0, -2.0, -1.0], [1.0, 2.0, 3.0]], device="cuda")
    origins = torch.randn(64, 3, device="cuda") * 4
    directions = torch.nn.functional.normalize(torch.randn(64, 3, device="cuda"), dim=-1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        space.march_range(origins, directions, box, (2.0, 4.0, 4.0), 0.1, 12.0, 0.05, 4096)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_vertex_steps_grow_outwards_and_cover_their_cells():
    r = 21
    steps = SceneSpace("inf").vertex_steps((r, r, r), torch.device("cpu")).double()
    centre = r // 2
    assert bool((steps[centre - 4 : centre + 5, centre - 4 : centre + 5, centre - 4 : centre + 5] == 1).all())
    line = steps[centre, centre, centre:]
    assert bool((line[1:] >= line[:-1]).all()) and float(line[-1]) >= 1e29  # infinity at the border
    # every sample position in a cell has a world (distance / P)^2 below the cell's corners' steps
    g = (torch.rand(5000, 3, dtype=F64) * 2 - 1) * 0.999
    m = (2 * g).abs().amax(1)
    distance = torch.where(m > 1, 1 / (2 - m), torch.ones_like(m))
    corners = ((g + 1) * (r - 1) / 2).floor().long()
    cell_max = torch.stack(
        [steps[tuple((corners + torch.tensor([i, j, k])).T)] for i in (0, 1) for j in (0, 1) for k in (0, 1)]
    ).amax(0)
    assert bool((distance.square() <= cell_max * (1 + 1e-9)).all())
    assert SceneSpace("none").vertex_steps((r, r, r), torch.device("cpu")) == 1.0


# ------------------------------------------------------------------------------------------------ the model


@pytest.mark.parametrize(
    "overrides,message",
    [({"contraction": "sphere"}, "model.contraction: expected"), ({"contraction": "inf", "shrink_at": 0.5}, "shrink")],
)
def test_bad_contraction_config_names_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        parse_model_config(make_cfg(**overrides))


def test_contracted_model_grid_is_a_cube_with_the_box_in_its_middle_half():
    bbox = torch.tensor([[-1.0, -1.5, -0.5], [1.0, 1.5, 0.5]])
    model = make_model(bbox=bbox, contraction="inf", grow_at=[])
    assert model.grid_shape == (20, 20, 20)
    assert model.step_size == pytest.approx(model.config.step_ratio * 3.0 / 9.5)  # longest side over 19 / 2 voxels
    bounded = make_model(bbox=bbox, grow_at=[])
    assert bounded.grid_shape == (14, 20, 7) and bounded.step_size == pytest.approx(1.0 / 6.0)


def test_contracted_model_marches_the_same_samples_with_either_backend():
    outs = []
    for backend in ("custom", "torch"):
        model = make_model(ops=build_ops(TORCH_OPS | {"march_rays": backend}), contraction="inf", grow_at=[])
        randomize_density(model, mean=-4.0, std=6.0)  # partly transparent: light reaches the shell
        with torch.no_grad():  # empty slabs through the box and the shell: the occupancy grid skips them
            model.density.grid[:7].fill_(-30.0)
            model.density.grid[:, 12:16].fill_(-30.0)
        model.refresh_occupancy()
        model.eval()
        outs.append(model.render_rays(*rays_towards_centre(128)))
        skipped = 1.0 - model.occupancy.occupied_fraction()
    assert outs[0]["samples"].item() > 0 and 0.02 < skipped < 0.98
    for key in ("rgb", "depth", "opacity", "samples"):
        assert torch.equal(outs[0][key], outs[1][key]), key


def test_contracted_model_distortion_is_measured_in_the_march_coordinate():
    """A contracted render's distortion loss (train.distortion_loss) reads the samples in the march coordinate
    (SceneSpace.march_coordinate, each interval one step), not at world distances, which grow far out."""
    model = make_model(contraction="inf", grow_at=[])
    randomize_density(model, mean=-4.0, std=6.0)
    model.eval()
    out = model.render_rays(*rays_towards_centre(64))
    packed, num_rays = out["packed"], 64
    origins, directions = rays_towards_centre(64)
    t_split = split_distances(origins, directions, model.bbox, model.near)
    march = SceneSpace("inf").march_coordinate(packed.t, packed.ray, t_split, model.bbox)
    half = 0.5 * packed.step
    expected = reference.distortion_loss(packed.optical_depth, march - half, march + half, packed.offsets)
    torch.testing.assert_close(packed.distortion(model.ops.distortion_loss, num_rays), expected)
    assert float(packed.t.max()) > float(march.max()) + 1.0  # world distances would have differed


def test_capture_experiment_composes_with_the_contraction():
    from hydra import compose, initialize_config_dir

    configs = Path(__file__).resolve().parents[1] / "configs"
    with initialize_config_dir(config_dir=str(configs), version_base=None):
        cfg = compose(config_name="config", overrides=["+experiment=capture", "data.root=/some/capture"])
    assert cfg.data.name == "nerfstudio" and cfg.model.contraction == "inf" and cfg.model.shrink_at is None
    assert parse_model_config(OmegaConf.to_container(cfg, resolve=True)["model"]).contraction == "inf"


@pytest.fixture(scope="module")
def unbounded_scene(tmp_path_factory):
    root = ensure_synthetic_scene(
        tmp_path_factory.mktemp("unbounded"), resolution=32, n_train=16, n_val=3, n_test=0, seed=1, unbounded=True
    )
    return load_blender(root, "train"), load_blender(root, "val")


def train_and_evaluate(train, val, contraction: str, iters: int = 100, model_out: list | None = None, **overrides):
    """Held-out PSNR of a small model trained ``iters`` steps of 512 rays on ``train`` (custom ops, CPU); the model
    is appended to ``model_out`` when given."""
    torch.manual_seed(0)
    settings = {"resolution_start": 24, "resolution_end": 24, "grow_at": [], "upsample": 1, "tv_samples": 1024}
    cfg = make_cfg(**(settings | overrides), contraction=contraction)
    custom = {name: "custom" for name in TORCH_OPS}
    model = VoxelNeRF(train.bbox, train.near, train.far, cfg, build_ops(custom))
    sampler = RaySampler(train, 512, torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(model.param_groups(0.1, 3e-3))
    for step in range(1, iters + 1):
        batch = sampler.sample()
        mse = ((model.render_rays(batch.origins, batch.directions)["rgb"] - batch.rgb) ** 2).mean()
        optimizer.zero_grad()
        (mse + model.regularization()).backward()
        model.row_grads.scatter()  # the TV rows' gradients (model.tv_sparse_grad)
        optimizer.step()
        if model.on_step(step, iters):
            optimizer = torch.optim.Adam(model.param_groups(0.1, 3e-3))
    model.eval()
    if model_out is not None:
        model_out.append(model)
    errors = [
        ((model.render_image(val.c2w[v], val.height, val.width, val.intrinsics[v])["rgb"] - val.images[v] / 255) ** 2)
        .mean()
        .item()
        for v in range(val.num_views)
    ]
    return -10 * math.log10(sum(errors) / len(errors))


@pytest.mark.usefixtures("one_thread")
def test_contraction_beats_the_box_on_an_unbounded_scene(unbounded_scene):
    """Same grid size, steps and rays: the contracted model puts the far room where it is; the bounded one paints it
    on the box (and cuts rays at far), which held-out views see from elsewhere."""
    train, val = unbounded_scene
    assert bool((train.images.float().mean((1, 2, 3)) > 0).all()) and train.alpha.float().min() == 255  # all opaque
    contracted, bounded = train_and_evaluate(train, val, "inf"), train_and_evaluate(train, val, "none")
    assert contracted > bounded + 2.0, (contracted, bounded)


@pytest.mark.usefixtures("one_thread")
def test_a_fine_grid_trains_in_the_contracted_box(unbounded_scene):
    """The capture preset's combination: the fine grid (bricks in the foreground box only) over a contracted model
    trains, keeps its bricks off the shell, and does not cost held-out PSNR on the unbounded scene."""
    train, val = unbounded_scene
    fine = {"fine.factor": 4, "fine.brick": 8, "fine.at": 50, "fine.collect": 20}
    models: list = []
    with_fine = train_and_evaluate(train, val, "inf", model_out=models, **fine)
    model = models[0]
    assert model.fine.active and model.fine.bricks > 0
    inside = model.space.foreground(model.grid_shape, torch.device("cpu"))
    used = model.fine.table >= 0
    for axis in range(3):  # no brick beyond the slabs that hold the box's fine vertices
        lo, hi = (int(i) * 4 for i in inside[axis].nonzero()[[0, -1], 0])
        first = torch.arange(used.shape[axis]) * 8
        outside = (first + 7 < lo) | (first > hi)
        assert not bool(used.any(dim=tuple(a for a in range(3) if a != axis))[outside].any())
    assert with_fine > train_and_evaluate(train, val, "inf") - 0.3
