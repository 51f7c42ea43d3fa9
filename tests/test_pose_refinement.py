"""Per-frame pose refinement (models/pose_refinement.py): the so(3) exponential map against the matrix exponential
(float64, gradcheck), corrected rays against the rays of the corrected camera, zero corrections bit for bit, the
gradient's path (through the march's points, to the batch's images only), the optimiser group, the state dict,
export and compact model, metrics.json's report, and bad values naming their key."""

from __future__ import annotations

import json
import math

import pytest
import torch
from omegaconf import OmegaConf
from test_model import BBOX, FAR, NEAR, TORCH_OPS, make_cfg, make_model
from test_train import read_metrics, run_train, tiny_overrides

from cuda_ext.reference import contract_points
from data import PatchBatch, camera_rays
from models import VoxelNeRF, build_ops
from models.config import parse_model_config
from models.field import to_unit
from models.pose_refinement import PoseRefinement, points_with_ray_gradients, rotation_angle, skew, so3_exp
from training.compact_model import read_model
from training.config_rules import ConfigError, validate_config
from training.finished_run import build_model


def random_axis_angles(gen: torch.Generator, count: int) -> torch.Tensor:
    """(count, 3) float64 axis-angle vectors with angles from 1e-7 rad (the series) to 3 rad (near pi)."""
    axes = torch.nn.functional.normalize(torch.randn(count, 3, generator=gen, dtype=torch.float64), dim=-1)
    angles = torch.logspace(-7, math.log10(3.0), count, dtype=torch.float64)
    return axes * angles[:, None]


def test_skew_is_the_cross_product(gen):
    w, d = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64)
    torch.testing.assert_close((skew(w) @ d[..., None])[..., 0], torch.linalg.cross(w, d), rtol=0, atol=1e-15)


def test_exp_map_matches_the_matrix_exponential(gen):
    w = random_axis_angles(gen, 40)
    got = so3_exp(w)
    torch.testing.assert_close(got, torch.linalg.matrix_exp(skew(w)), rtol=0, atol=1e-14)
    eye = torch.eye(3, dtype=torch.float64).expand(40, 3, 3)
    torch.testing.assert_close(got @ got.transpose(1, 2), eye, rtol=0, atol=1e-14)  # a rotation
    torch.testing.assert_close(torch.linalg.det(got), torch.ones(40, dtype=torch.float64), rtol=0, atol=1e-14)
    torch.testing.assert_close(rotation_angle(w), w.norm(dim=-1) * 180 / math.pi)
    assert torch.equal(so3_exp(torch.zeros(2, 3)), torch.eye(3).expand(2, 3, 3))  # exactly the identity at 0
    # float32 keeps the same accuracy as float32 allows on both sides of the series' switch
    torch.testing.assert_close(so3_exp(w.float()), got.float(), rtol=0, atol=2e-6)


@pytest.mark.parametrize("scale", [0.0, 1e-3, 0.02, 1.0])  # at zero, in the series, at its edge, far beyond
def test_exp_map_gradcheck(gen, scale):
    w = (scale * torch.randn(3, 3, generator=gen, dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(so3_exp, (w,), eps=1e-7, atol=1e-7)


def test_exp_map_derivative_at_zero_is_the_generators():
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    jacobian = torch.autograd.functional.jacobian(so3_exp, w)  # (3, 3, 3): d R / d w_i
    for i in range(3):
        torch.testing.assert_close(jacobian[..., i], skew(torch.eye(3, dtype=torch.float64)[i]))


def random_rays(gen: torch.Generator, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    origins = torch.randn(*shape, 3, generator=gen)
    return origins, torch.nn.functional.normalize(torch.randn(*shape, 3, generator=gen), dim=-1)


def test_zero_corrections_give_the_rays_bit_for_bit(gen):
    poses = PoseRefinement("so3xr3", 5)
    origins, directions = random_rays(gen, (64,))
    views = torch.randint(0, 5, (64,), generator=gen)
    got = poses(views, origins, directions)
    assert torch.equal(got[0], origins) and torch.equal(got[1], directions)
    # patches: (n,) views for (n, P, P, 3) rays and (n, sP, sP, 3) full-resolution directions
    origins, directions = random_rays(gen, (3, 4, 4))
    hr = torch.nn.functional.normalize(torch.randn(3, 8, 8, 3, generator=gen), dim=-1)
    got = poses(torch.tensor([4, 0, 2]), origins, directions, hr)
    assert all(torch.equal(a, b) for a, b in zip(got, (origins, directions, hr)))
    # held out (no views) or off: the inputs themselves
    with torch.no_grad():
        poses.table.normal_()
    assert poses(None, origins, directions)[1] is directions
    assert PoseRefinement("none", 5)(views, origins, directions)[0] is origins


def look_at(eye: list[float], target: list[float]) -> torch.Tensor:
    """(4, 4) float64 OpenGL camera-to-world at ``eye`` looking at ``target`` (z up)."""
    eye_t, target_t = torch.tensor(eye, dtype=torch.float64), torch.tensor(target, dtype=torch.float64)
    back = torch.nn.functional.normalize(eye_t - target_t, dim=0)
    right = torch.nn.functional.normalize(
        torch.linalg.cross(torch.tensor([0.0, 0, 1], dtype=torch.float64), back), dim=0
    )
    c2w = torch.eye(4, dtype=torch.float64)
    c2w[:3, :3] = torch.stack([right, torch.linalg.cross(back, right), back], 1)
    c2w[:3, 3] = eye_t
    return c2w


def test_corrected_rays_are_the_corrected_cameras_rays(gen):
    cameras = torch.stack([look_at([3.0, 1.0, 1.5], [0.1, 0, 0]), look_at([-1.0, 3.5, 0.5], [0, 0.2, 0.1])])
    intrinsics = torch.tensor([[40.0, 42.0, 15.5, 11.0], [38.0, 38.0, 16.0, 12.5]], dtype=torch.float64)
    poses = PoseRefinement("so3xr3", 2).double()
    with torch.no_grad():
        poses.table.copy_(0.05 * torch.randn(2, 6, generator=gen, dtype=torch.float64))
    w, v = poses.table.detach()[:, :3], poses.table.detach()[:, 3:]
    moved = cameras.clone()
    moved[:, :3, :3] = so3_exp(w) @ cameras[:, :3, :3]  # turned about the camera centre, about world axes
    moved[:, :3, 3] += v
    origins, directions = camera_rays(cameras, 24, 32, intrinsics)  # (2, 24, 32, 3)
    want = camera_rays(moved, 24, 32, intrinsics)
    views = torch.tensor([0, 1])
    got = poses(views, origins, directions)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-14)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-14)
    # the same per ray, as a ray batch
    flat = poses(views.repeat_interleave(24 * 32), origins.reshape(-1, 3), directions.reshape(-1, 3))
    torch.testing.assert_close(flat[1], want[1].reshape(-1, 3), rtol=0, atol=1e-14)


@pytest.mark.parametrize("contract", [False, True])
def test_points_keep_their_values_and_take_the_rays_gradient(gen, contract):
    bbox = torch.tensor([[-1.0, -0.5, -1.5], [1.5, 1.0, 0.5]], dtype=torch.float64)
    origins, directions = (x.double().requires_grad_() for x in random_rays(gen, (6,)))
    ray = torch.tensor([0, 0, 1, 3, 3, 3, 5])
    t = torch.rand(7, generator=gen, dtype=torch.float64) * 6.0

    def reference(o, d):
        unit = to_unit(o[ray] + t[:, None] * d[ray], bbox)
        return contract_points(unit) if contract else unit

    points = reference(origins, directions).detach()  # the march's points (data)
    got = points_with_ray_gradients(points, ray, t, origins, directions, bbox, contract)
    assert torch.equal(got, points)  # the values: the march's, bit for bit
    weights = torch.randn(7, 3, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (origins, directions))
    want = torch.autograd.grad((reference(origins, directions) * weights).sum(), (origins, directions))
    for a, b in zip(grads, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(reference, (origins, directions))  # the derivative used is the formula's
    with torch.no_grad():  # no rays needing a gradient: the points themselves
        assert points_with_ray_gradients(points, ray, t, origins, directions, bbox, contract) is points


def visible_model(num_images: int = 5, **overrides) -> VoxelNeRF:
    model = make_model(seed=2, resolution_start=20, pose_refinement="so3xr3", early_termination=0.0, **overrides)
    model.poses.resize(num_images)
    with torch.no_grad():
        model.density.grid.normal_(0.0, 2.0).add_(2.0)
    return model


def camera_batch(count: int = 48):
    torch.manual_seed(4)
    origins = torch.tensor([0.3, -0.2, 4.0]) + 0.2 * torch.randn(count, 3)
    directions = torch.nn.functional.normalize(-origins + 0.4 * torch.randn(count, 3), dim=-1)
    return origins, directions


@pytest.mark.parametrize("contraction", ["none", "inf"])
def test_zero_corrections_render_as_without_refinement(contraction):
    extra = {"contraction": contraction, "shading": "per_sample", "upsample": 1}
    refined = visible_model(**extra).train()
    plain = VoxelNeRF(
        BBOX, NEAR, FAR, make_cfg(resolution_start=20, early_termination=0.0, **extra), build_ops(TORCH_OPS)
    )
    plain.load_state_dict({k: v for k, v in refined.state_dict().items() if k != "poses.table"})
    origins, directions = camera_batch()
    jitter = torch.rand(origins.shape[0])
    views = torch.randint(0, 5, (origins.shape[0],))
    got = refined.render_rays(origins, directions, jitter=jitter, views=views)
    want = plain.render_rays(origins, directions, jitter=jitter, views=views)
    for key in ("rgb", "depth", "opacity"):
        assert torch.equal(got[key], want[key]), key


def pose_gradient(model: VoxelNeRF, views: torch.Tensor) -> torch.Tensor:
    origins, directions = camera_batch()
    model.zero_grad()
    out = model.render_rays(origins, directions, jitter=torch.linspace(0.05, 0.95, origins.shape[0]), views=views)
    (out["rgb"] - 0.5).square().sum().backward()
    return model.poses.table.grad.clone()


@pytest.mark.parametrize("contraction", ["none", "inf"])
def test_gradient_reaches_only_the_batch_images(contraction):
    model = visible_model(contraction=contraction, shading="per_sample", upsample=1).train()
    origins, directions = camera_batch()
    views = torch.tensor([1, 3]).repeat(origins.shape[0] // 2)
    grad = pose_gradient(model, views)
    assert grad[[1, 3], :3].abs().sum(1).min() > 0 and grad[[1, 3], 3:].abs().sum(1).min() > 0  # turn and shift
    assert grad[[0, 2, 4]].abs().max() == 0
    # the march's samples are data on every backend: our kernels (not differentiable) and the torch reference
    # (differentiable) give the same gradient, the one of the points o + t d at fixed t
    custom = VoxelNeRF(BBOX, NEAR, FAR, model.config, build_ops(dict.fromkeys(TORCH_OPS, "custom"))).train()
    custom.poses.resize(5)
    custom.load_state_dict(model.state_dict())
    torch.testing.assert_close(pose_gradient(custom, views), grad, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    model.eval().render_rays(origins, directions)["rgb"].sum().backward()  # held out: the poses as given
    assert model.poses.table.grad is None or model.poses.table.grad.abs().max() == 0


def test_patches_are_corrected_per_patch_image():
    model = visible_model(shading="deferred", upsample=2).train()
    torch.manual_seed(5)
    n, p = 3, 4
    origins = (torch.tensor([0.0, 0.0, 4.0]) + 0.1 * torch.randn(n, 1, 1, 3)).expand(n, p, p, 3)
    directions = torch.nn.functional.normalize(-origins + 0.3 * torch.randn(n, p, p, 3), dim=-1)
    hr = torch.nn.functional.normalize(directions.repeat_interleave(2, 1).repeat_interleave(2, 2), dim=-1)
    batch = PatchBatch(origins, directions, hr, torch.zeros(n, 2 * p, 2 * p, 3), views=torch.tensor([2, 0, 2]),
                       jitter=torch.rand(n, p, p))  # fmt: skip
    with torch.no_grad():
        model.poses.table.normal_(0.0, 0.02)
    got = model.render_patches(batch)
    moved = model.poses(batch.views, origins, directions, hr)
    want = model.render_patches(PatchBatch(*moved, batch.rgb, jitter=batch.jitter))  # the moved rays, no views
    torch.testing.assert_close(got["rgb"], want["rgb"], rtol=0, atol=0)
    got["rgb"].sum().backward()
    grad = model.poses.table.grad
    assert grad[[0, 2]].abs().sum(1).min() > 0 and grad[[1, 3, 4]].abs().max() == 0


def test_optimiser_group_only_when_on():
    assert [g["name"] for g in make_model().param_groups(0.1, 1e-3, 6e-4)] == ["grids", "decoder"]
    model = visible_model()
    groups = model.param_groups(0.1, 1e-3, 6e-4)
    assert [g["name"] for g in groups] == ["grids", "decoder", "poses"]
    assert groups[2]["params"] == [model.poses.table] and groups[2]["lr"] == 6e-4
    assert "poses.table" not in make_model().state_dict()  # off: nothing saved, old checkpoints load as ever


def test_state_dict_and_export_round_trip(gen):
    model = visible_model(num_images=7, shading="per_sample", upsample=1)
    with torch.no_grad():
        model.poses.table.normal_(0.0, 0.05, generator=gen)
    state = model.state_dict()
    cfg = make_cfg(resolution_start=20, early_termination=0.0, pose_refinement="so3xr3", shading="per_sample",
                   upsample=1)  # fmt: skip
    fresh = VoxelNeRF(BBOX, NEAR, FAR, cfg, build_ops(TORCH_OPS))  # built without a size: takes the checkpoint's
    fresh.load_state_dict(state)
    assert torch.equal(fresh.poses.table, model.poses.table)
    exported = build_model(cfg, {"near": NEAR, "far": FAR, "bbox": BBOX.tolist()}, state)
    origins, directions = camera_batch(16)
    torch.testing.assert_close(  # renders (no image index) use the poses as given
        exported.render_rays(origins, directions)["rgb"], model.eval().render_rays(origins, directions)["rgb"]
    )


def test_penalty_and_summary():
    poses = PoseRefinement("so3xr3", 2).double()
    with torch.no_grad():
        poses.table.copy_(torch.tensor([[0.01, 0, 0, 0, 0.03, 0.04], [0, 0, -0.02, 0, 0, 0]], dtype=torch.float64))
    torch.testing.assert_close(poses.penalty(), torch.tensor((1e-4 + 0.0025 + 4e-4) / 2, dtype=torch.float64))
    summary = poses.summary()
    assert summary["images"] == 2
    assert summary["rotation_deg_mean"] == pytest.approx(0.015 * 180 / math.pi)
    assert summary["rotation_deg_max"] == pytest.approx(0.02 * 180 / math.pi)
    assert summary["translation_mean"] == pytest.approx(0.025) and summary["translation_max"] == pytest.approx(0.05)
    assert PoseRefinement("none", 2).summary() is None


def test_bad_values_name_the_key():
    with pytest.raises(ValueError, match="model.pose_refinement"):
        parse_model_config({"pose_refinement": "se3"})
    with pytest.raises(ValueError, match="model.pose_refinement"):
        PoseRefinement("barf")
    for key in ("lr_pose", "pose_penalty"):
        with pytest.raises(ConfigError, match=f"train.{key}"):
            validate_config(OmegaConf.create({"train": {key: -1.0}}))
    poses = PoseRefinement("so3xr3", 3)
    origins, directions = torch.zeros(4, 3), torch.zeros(4, 3)
    with pytest.raises(ValueError, match="views"):
        poses(torch.zeros(4, dtype=torch.int32), origins, directions)
    with pytest.raises(ValueError, match="directions"):
        poses(torch.zeros(4, dtype=torch.int64), origins, torch.zeros(5, 3))
    with pytest.raises(IndexError):
        poses(torch.tensor([0, 1, 2, 3]), origins, directions)


def test_training_run_refines_saves_and_reports(tmp_path):
    run_dir = tmp_path / "run"
    args = tiny_overrides(tmp_path / "scenes", 10) + [f"hydra.run.dir={run_dir}", "model.pose_refinement=so3xr3"]
    result = run_train(args + ["train.lr_pose=0.01", "train.keep_resumable=true"])
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_metrics(run_dir)["pose_refinement"]
    assert report["images"] == 6 and 0 < report["rotation_deg_max"] < 10 and 0 < report["translation_max"] < 1
    resumable = torch.load(run_dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)
    table = resumable["model"]["poses.table"]
    weights, _ = read_model(run_dir / "model.pt")  # the compact model keeps the table as it is
    assert torch.equal(weights["poses.table"], table)
    assert torch.linalg.vector_norm(table[:, 3:].double(), dim=-1).max().item() == pytest.approx(
        report["translation_max"]
    )
    assert json.loads(json.dumps(report)) == report
    # resume: the table and its Adam moments come back (group "poses"), and training moves it on
    result = run_train(args + ["train.lr_pose=0.01", "train.resume=true", "train.iters=14"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_metrics(run_dir)["iters"] == 14
    resumed = read_model(run_dir / "model.pt")[0]["poses.table"]
    assert resumed.shape == table.shape and not torch.equal(resumed, table)
    assert (resumed - table).abs().max() < 0.5 * table.abs().max()  # moved on from the saved table, not from zero
    assert (
        len(resumable["optimizer"]["param_groups"]) == 3
        and resumable["optimizer"]["param_groups"][2]["name"] == "poses"
    )


def test_refinement_recovers_a_misregistered_camera():
    # a smooth random field, a 12x12 view of it through the true camera, and the same view's rays from a camera
    # turned by ~1.5 degrees and shifted by 0.04: optimising the pose alone brings the rays back onto the true ones
    model = make_model(seed=1, resolution_start=6, resolution_end=16, grow_at=[], shading="per_sample", upsample=1,
                       pose_refinement="so3xr3", early_termination=0.0, weight_threshold=0.0)  # fmt: skip
    with torch.no_grad():
        model.density.grid.normal_(0.0, 3.0).add_(1.0)
        model.features.grid.normal_(0.0, 2.0)
    model.set_resolution(16)  # trilinear upsampling of the 6^3 noise: smooth
    model.poses.resize(1)
    model.eval()
    true = look_at([3.0, 1.0, 1.5], [0, 0, 0]).float()
    origins, directions = (x.reshape(-1, 3) for x in camera_rays(true, 12, 12, 11.0))
    with torch.no_grad():
        target = model.render_rays(origins, directions)["rgb"]
    wrong = true.clone()
    wrong[:3, :3] = so3_exp(torch.tensor([0.02, -0.015, 0.01])) @ true[:3, :3]
    wrong[:3, 3] += torch.tensor([0.03, -0.02, 0.02])
    bad_origins, bad_directions = (x.reshape(-1, 3) for x in camera_rays(wrong, 12, 12, 11.0))
    views = torch.zeros(bad_origins.shape[0], dtype=torch.int64)
    optimiser = torch.optim.Adam([model.poses.table], lr=5e-3)
    losses = []
    for _ in range(40):
        optimiser.zero_grad()
        loss = (model.render_rays(bad_origins, bad_directions, views=views)["rgb"] - target).square().mean()
        loss.backward()
        optimiser.step()
        losses.append(loss.item())
    with torch.no_grad():
        fixed_origins, fixed_directions = model.poses(views, bad_origins, bad_directions)

    def misalignment(o: torch.Tensor, d: torch.Tensor) -> float:  # at the scene's depth, ~3 from the camera
        return (o + 3 * d - (origins + 3 * directions)).norm(dim=-1).mean().item()

    assert losses[-1] < 0.05 * losses[0]
    assert misalignment(fixed_origins, fixed_directions) < 0.25 * misalignment(bad_origins, bad_directions)
