"""bench/peers' NeRF peer (nerfacc's occupancy grid with an Instant-NGP field in PyTorch): the hash and SH
encodings, the schedules, marching bounded and unbounded scenes, the trainer on stand-ins for nerfacc's CUDA
parts. The tests that need nerfacc and a GPU skip without them."""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch
from test_peers import write_capture

from bench.peers import run as peers_run
from bench.peers.scenes import load_peer_scene
from data.cameras import look_at, random_zone_positions

# ------------------------------------------------------------------------------------------------ the NeRF peer
HAS_NERFACC = importlib.util.find_spec("nerfacc") is not None
needs_nerfacc_gpu = pytest.mark.skipif(
    not (HAS_NERFACC and torch.cuda.is_available()), reason="needs nerfacc and a CUDA GPU (its CUDA kernels)"
)


def _brute_force_hash_encoding(encoding, points: torch.Tensor) -> torch.Tensor:
    """Point by point, level by level, corner by corner in float64 with Python integers (the module doc's rule)."""
    table = encoding.table.detach().double()
    out = torch.zeros(points.shape[0], encoding.levels, encoding.features, dtype=torch.float64)
    for n, point in enumerate(points.double().tolist()):
        for level, res in enumerate(encoding.resolutions):
            scaled = [min(max(c, 0.0), 1.0) * res for c in point]
            cell = [min(int(math.floor(s)), res - 1) for s in scaled]
            for bits in range(8):
                vertex = [cell[a] + ((bits >> a) & 1) for a in range(3)]
                weight = 1.0
                for a in range(3):
                    frac = scaled[a] - cell[a]
                    weight *= frac if (bits >> a) & 1 else 1.0 - frac
                if (res + 1) ** 3 <= encoding.table_size:
                    slot = vertex[0] + vertex[1] * (res + 1) + vertex[2] * (res + 1) ** 2
                else:
                    slot = (vertex[0] ^ vertex[1] * 2654435761 ^ vertex[2] * 805459861) % encoding.table_size
                out[n, level] += weight * table[level, slot]
    return out.reshape(points.shape[0], -1)


def test_hash_encoding_is_trilinear_over_dense_and_hashed_levels():
    from bench.peers.hash_encoding import HashEncoding

    torch.manual_seed(0)
    encoding = HashEncoding(levels=3, log2_size=6, features=2, base=2, finest=8).double()
    assert encoding.resolutions == [2, 4, 8]  # 27 vertices fit in 64 slots (dense); 125 and 729 do not (hashed)
    with torch.no_grad():
        encoding.table.normal_()  # O(1) entries, not the 1e-4 initialisation: a wrong weight shows
    points = torch.cat([torch.rand(40, 3, dtype=torch.float64), torch.tensor([[0.0, 1.0, 0.5], [1.0, 1.0, 1.0]])])
    points = torch.cat([points, torch.tensor([[-0.2, 0.3, 1.4]], dtype=torch.float64)])  # outside: clamped
    torch.testing.assert_close(encoding(points), _brute_force_hash_encoding(encoding, points), rtol=1e-12, atol=1e-12)


def test_hash_encoding_gradients():
    from bench.peers.hash_encoding import HashEncoding

    torch.manual_seed(1)
    encoding = HashEncoding(levels=2, log2_size=5, features=2, base=2, finest=5).double()
    with torch.no_grad():
        encoding.table.normal_()
    points = (0.05 + 0.9 * torch.rand(6, 3, dtype=torch.float64)).requires_grad_()
    table = encoding.table.detach().clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: torch.func.functional_call(encoding, {"table": t}, (points,)), (table,))
    assert torch.autograd.gradcheck(encoding, (points,))


def test_hash_grid_levels_are_instant_ngps():
    from bench.peers.hash_encoding import HashEncoding, level_resolutions

    resolutions = level_resolutions(16, 16, 4096)
    assert resolutions[0] == 16 and resolutions[-1] == 4096 and resolutions == sorted(resolutions)
    growth = math.exp(math.log(256) / 15)
    assert resolutions == [math.floor(16 * growth**level + 1e-9) for level in range(16)]
    encoding = HashEncoding()
    assert tuple(encoding.table.shape) == (16, 1 << 19, 2) and encoding.output_dim == 32
    assert float(encoding.table.detach().abs().max()) <= 1e-4
    with pytest.raises(ValueError, match="points"):
        encoding(torch.rand(4, 2))
    with pytest.raises(ValueError, match="log2_size"):
        HashEncoding(log2_size=0)


def test_sh_encoding_is_orthonormal_on_the_sphere():
    from bench.peers.hash_encoding import sh_encoding

    count = 40000  # a Fibonacci lattice: equal-area points, the integral as a mean
    index = torch.arange(count, dtype=torch.float64) + 0.5
    z = 1.0 - 2.0 * index / count
    phi = math.pi * (1.0 + math.sqrt(5.0)) * index
    radius = torch.sqrt(1.0 - z * z)
    directions = torch.stack([radius * torch.cos(phi), radius * torch.sin(phi), z], -1)
    basis = sh_encoding(directions)
    gram = 4.0 * math.pi * basis.T @ basis / count
    torch.testing.assert_close(gram, torch.eye(16, dtype=torch.float64), rtol=0, atol=2e-3)
    # the functions without lower-degree terms are homogeneous: x -> 2x scales degree l by 2^l
    homogeneous = {1: 1, 2: 1, 3: 1, 4: 2, 5: 2, 7: 2, 8: 2, 9: 3, 10: 3, 14: 3, 15: 3}
    scaled = sh_encoding(directions[:5] * 2.0)
    for column, degree in homogeneous.items():
        torch.testing.assert_close(scaled[:, column], basis[:5, column] * 2.0**degree)


def test_ngp_schedule_is_torchs_chained_schedulers():
    from bench.peers.nerfacc_trainer import NgpRecipe, lr_factor

    total, recipe = 2000, NgpRecipe()
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    milestones = [total // 2, total * 3 // 4, total * 9 // 10]
    schedulers = [torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.01, total_iters=100),
                  torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=milestones, gamma=0.33)]  # fmt: skip
    for step in range(total):
        assert lr_factor(step, total, recipe) == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-9), step
        optimizer.step()
        for scheduler in schedulers:
            scheduler.step()
    assert lr_factor(total - 1, total, recipe) == pytest.approx(0.33**3)


def test_dynamic_ray_count_aims_at_the_sample_budget():
    from bench.peers.nerfacc_trainer import next_ray_count

    assert next_ray_count(1024, 1 << 16, 1 << 18) == 4096  # 64 samples a ray: 4096 rays march 2^18
    assert next_ray_count(4096, 1 << 20, 1 << 18) == 1024
    assert next_ray_count(1024, 0, 1 << 18) == 1024  # nothing marched: keep
    assert next_ray_count(1024, 1, 1 << 18) == 1 << 18  # at most one ray per budgeted sample
    assert next_ray_count(3, 1 << 30, 1 << 18) == 1


def test_marching_bounded_and_unbounded(blender_scene, tmp_path):
    from bench.peers.nerfacc_trainer import NgpRecipe, marching_for
    from data.bounds import focus_point

    bounded = marching_for(load_peer_scene(blender_scene), NgpRecipe())
    assert bounded.levels == 1 and bounded.cone_angle == 0.0 and bounded.scale == 1.0
    box = load_peer_scene(blender_scene).train.bbox
    assert bounded.step_size == pytest.approx(math.sqrt(3) * float((box[1] - box[0]).max()) / 1024)
    target = np.array([0.3, -0.2, 0.5])
    cameras = torch.from_numpy(look_at(random_zone_positions(9, 4.0, 0.1, 1.0, np.random.default_rng(3)) + target,
                                       target=target))  # fmt: skip
    found = torch.from_numpy(focus_point(cameras.numpy()))
    torch.testing.assert_close(found, torch.from_numpy(target), rtol=0, atol=1e-9)
    capture = load_peer_scene(write_capture(tmp_path / "cap", None))
    unbounded = marching_for(capture, NgpRecipe())
    assert unbounded.levels == 4 and unbounded.roi == (-1.0, -1.0, -1.0, 1.0, 1.0, 1.0) and unbounded.cone_angle > 0
    centres = (capture.train.c2w[:, :3, 3].double() - torch.tensor(unbounded.centre)) * unbounded.scale
    assert float(centres.norm(dim=-1).median()) == pytest.approx(1.0)


def test_nerfacc_arguments():
    args = peers_run.parse_args(["--scene", "s", "--data-root", "x", "--method", "nerfacc"])
    assert args.steps == [20000]
    assert peers_run.parse_args(["--scene", "s", "--data-root", "x", "--method", "gsplat"]).steps == [7000]
    with pytest.raises(SystemExit):
        peers_run.parse_args(["--scene", "s", "--data-root", "x", "--method", "nerfacc", "--ours-run", "r"])


class StandInEstimator(torch.nn.Module):
    """A pure-PyTorch stand-in for nerfacc's OccGridEstimator: its boxes (each level twice the last), a fixed
    number of evenly spaced samples per ray from the near plane across the largest box, and a record of the
    occupancy updates (every n-th step, the occupancy function called on points inside the boxes)."""

    def __init__(self, roi_aabb, resolution=128, levels=1, samples=6):
        super().__init__()
        centre, half = (roi_aabb[:3] + roi_aabb[3:]) / 2, (roi_aabb[3:] - roi_aabb[:3]) / 2
        self.register_buffer("aabbs", torch.stack([torch.cat([centre - half * 2**i, centre + half * 2**i])
                                                   for i in range(levels)]))  # fmt: skip
        self.register_buffer("binaries", torch.ones(levels, 2, 2, 2, dtype=torch.bool))
        self.samples, self.updates = samples, []

    def update_every_n_steps(self, step, occ_eval_fn, occ_thre=1e-2, n=16):
        if step % n == 0:
            box = self.aabbs[-1]
            occupancy = occ_eval_fn(box[:3] + torch.rand(32, 3) * (box[3:] - box[:3]))
            assert occupancy.shape == (32,) and bool((occupancy >= 0).all())
            self.updates.append(step)

    def sampling(self, rays_o, rays_d, sigma_fn, near_plane, render_step_size, stratified, cone_angle, alpha_thre):
        rays, span = rays_o.shape[0], float((self.aabbs[-1, 3:] - self.aabbs[-1, :3]).norm())
        edges = near_plane + rays_o.norm(dim=-1, keepdim=True) - span / 2 + torch.linspace(0, span, self.samples + 1)
        edges = edges.clamp_min(near_plane)
        indices = torch.arange(rays).repeat_interleave(self.samples)
        starts, ends = edges[:, :-1].reshape(-1), edges[:, 1:].reshape(-1)
        assert sigma_fn(starts, ends, indices).shape == starts.shape
        return indices, starts, ends


def stand_in_rendering(t_starts, t_ends, ray_indices, n_rays, rgb_sigma_fn, render_bkgd):
    """nerfacc.rendering's compositing in PyTorch, for samples grouped by ray in equal numbers (the stand-in's)."""
    rgbs, sigmas = rgb_sigma_fn(t_starts, t_ends, ray_indices)
    tau = (sigmas * (t_ends - t_starts)).reshape(n_rays, -1)
    alphas = 1 - torch.exp(-tau)
    trans = torch.exp(-torch.cumsum(torch.cat([torch.zeros_like(tau[:, :1]), tau[:, :-1]], 1), 1))
    weights = (alphas * trans)[..., None]
    opacity = weights.sum(1)
    rgb = (weights * rgbs.reshape(n_rays, -1, 3)).sum(1) + render_bkgd * (1 - opacity)
    return rgb, opacity, None, {"weights": weights}


def _stand_in_backend():
    from bench.peers.nerfacc_trainer import NerfaccBackend

    return NerfaccBackend(StandInEstimator, stand_in_rendering, "stand-in")


def _small_recipe():
    from bench.peers.nerfacc_trainer import NgpRecipe

    return NgpRecipe(init_rays=64, target_samples=384, hash_levels=4, hash_log2_size=10, hash_finest=32,
                     eval_chunk_rays=100, occ_every=4)  # fmt: skip


@pytest.mark.parametrize("kind", ["blender", "capture"])
def test_nerfacc_trainer_runs_on_the_cpu_with_stand_ins(kind, blender_scene, tmp_path):
    """The whole loop (ray batches, schedule, occupancy updates, evaluations in chunks, the clock, the model file)
    with a stand-in estimator and renderer: the entry's bookkeeping is right, the batch adapted to the sample
    budget and the loss fell on the training pixels."""
    from bench.peers.nerfacc_trainer import train_nerfacc

    scene = load_peer_scene(blender_scene if kind == "blender" else write_capture(tmp_path / "cap", None))
    backend, lines = _stand_in_backend(), []
    result = train_nerfacc(scene, [4, 12], _small_recipe(), curve_every=4, curve_count=2, log=lines.append,
                           device="cpu", backend=backend, keep_model=str(tmp_path / "m{step}.pt"))  # fmt: skip
    assert [e["step"] for e in result["evaluations"]] == [4, 12] and [c["step"] for c in result["curve"]] == [4, 8, 12]
    assert [c["views"] for c in result["curve"]] == [scene.eval.num_views, 2, scene.eval.num_views]
    seconds = [c["train_seconds"] for c in result["curve"]]
    assert seconds == sorted(seconds) and seconds[0] > 0 and result["peak_memory_bytes"] is None
    assert result["curve"][-1]["rays"] == 384 // 6  # 6 samples a ray: the batch fills the 384-sample budget
    final = result["evaluations"][-1]
    assert final["model_bytes"] == (tmp_path / "m12.pt").stat().st_size > 4 * 2**10 * 2 * 4  # the hash table
    saved = torch.load(tmp_path / "m12.pt", weights_only=False)
    assert set(saved) == {"field", "occupancy", "aabbs", "marching"}
    assert result["marching"]["levels"] == (1 if kind == "blender" else 4)
    assert all(math.isfinite(c["psnr"]) for c in result["curve"]) and len(lines) == 3


def test_nerfacc_training_fits_the_training_pixels(blender_scene):
    """With the stand-ins, 60 steps on images of one colour lower the loss (the gradients reach the hash table and
    the MLPs through the compositing) and the occupancy is updated every occ_every steps."""
    import dataclasses

    from bench.peers.nerfacc_trainer import NerfaccTraining

    scene = load_peer_scene(blender_scene)
    flat = torch.tensor([200, 60, 30], dtype=torch.uint8).expand_as(scene.train.images).contiguous()
    scene.train = dataclasses.replace(scene.train, images=flat, alpha=None)
    recipe = dataclasses.replace(_small_recipe(), random_background=False)
    training = NerfaccTraining(scene, 60, recipe, 0, "cpu", _stand_in_backend())
    losses = [float(training.step(step)) for step in range(60)]
    assert training.estimator.updates == list(range(0, 60, 4))
    assert np.mean(losses[-10:]) < 0.3 * np.mean(losses[:10])
    assert training.field.encoding.table.grad is not None and float(training.field.encoding.table.grad.abs().max()) > 0


@needs_nerfacc_gpu
def test_stand_in_compositing_is_nerfaccs():
    """The CPU tests' stand-in renderer equals nerfacc.rendering (so what they check holds for nerfacc)."""
    import nerfacc

    rays, samples = 5, 7
    starts = torch.sort(torch.rand(rays, samples) * 4, dim=1).values
    ends = starts + 0.1 * torch.rand(rays, samples)
    indices = torch.arange(rays).repeat_interleave(samples)
    rgbs, sigmas = torch.rand(rays * samples, 3), 5 * torch.rand(rays * samples)
    background = torch.rand(3)
    expected = stand_in_rendering(starts.reshape(-1), ends.reshape(-1), indices, rays, lambda *a: (rgbs, sigmas),
                                  background)[0]  # fmt: skip
    cuda = [t.cuda() for t in (starts.reshape(-1), ends.reshape(-1), indices, rgbs, sigmas, background)]
    got = nerfacc.rendering(*cuda[:3], n_rays=rays, rgb_sigma_fn=lambda *a: (cuda[3], cuda[4]), render_bkgd=cuda[5])
    torch.testing.assert_close(got[0].cpu(), expected, rtol=1e-5, atol=1e-6)


@needs_nerfacc_gpu
def test_nerfacc_short_training_run_reports(blender_scene):
    from bench.peers.nerfacc_trainer import train_nerfacc

    scene = load_peer_scene(blender_scene)
    result = train_nerfacc(load_peer_scene(blender_scene), [100, 300], curve_every=100, curve_count=2,
                           log=lambda line: None)  # fmt: skip
    first, last = result["evaluations"]
    assert [e["step"] for e in result["evaluations"]] == [100, 300] and len(result["curve"]) == 3
    assert last["train_seconds"] > first["train_seconds"] > 0 and last["model_bytes"] > 16 * 2**19 * 2 * 4 * 0.5
    assert result["peak_memory_bytes"] > 0 and math.isfinite(last["psnr"]) and scene.eval.num_views == last["views"]
