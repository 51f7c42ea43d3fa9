"""cuda_ext.march_rays_capped: march_rays' samples into outputs of a fixed size with no device sync (what a CUDA
graph can replay). Against march_rays and the reference bit for bit with room to spare, exactly at the count and
cut short (an overflow), poisoned outputs, CPU against CUDA, no sync on CUDA, opcheck with static shapes, bad
input. tests/test_march.py checks the samples themselves."""

from __future__ import annotations

import pytest
import torch
from test_march import DEVICES, DTYPES, SPACES, call, scene

import cuda_ext
from cuda_ext import reference

requires_cuda = pytest.mark.requires_cuda


def capped(fn, args: dict, capacity: int):
    order = ("origins", "directions", "t_start", "t_end", "offset", "occupancy", "box", "step", "max_samples")
    split = () if args.get("t_split") is None else (args["t_split"],)
    return fn(*(args[k] for k in order), capacity, *split)


def expected(full, capacity: int, rays: int):
    """What march_rays_capped must give, built from march_rays' outputs by hand."""
    ray, t, points, offsets = full
    kept = min(capacity, ray.numel())
    pad = capacity - kept
    return (
        torch.cat([ray[:kept], ray.new_full((pad,), max(rays - 1, 0))]),
        torch.cat([t[:kept], t.new_zeros(pad)]),
        torch.cat([points[:kept], points.new_zeros(pad, 3)]),
        offsets.clamp(max=capacity),
        offsets[-1:],
    )


def assert_identical(got, want):
    for name, g, w in zip(("ray", "t", "points", "ray_offsets", "total"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device, name
        assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} of {g.numel()} differ"


@pytest.mark.parametrize("space", SPACES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("room", ["spare", "exact", "overflow", "none"])
def test_the_first_capacity_samples_of_march_rays(device, dtype, space, room):
    args = scene(700, dtype=dtype, device=device, space=space, seed=3)
    full = call(cuda_ext.march_rays, args)
    count = full[0].numel()
    assert count > 5000  # not trivially small
    capacity = {"spare": count + 777, "exact": count, "overflow": count // 3 + 5, "none": 0}[room]
    got = capped(cuda_ext.march_rays_capped, args, capacity)
    want = expected(full, capacity, 700)
    assert_identical(got, want)
    assert_identical(capped(reference.march_rays_capped, args, capacity), want)
    assert int(got[4]) == count  # the true total, past the capacity too
    if room == "overflow":  # one ray cut short, the ones after it empty, the ones before it whole
        offsets = got[3]
        cut = int(torch.searchsorted(full[3], torch.tensor(capacity, device=full[3].device), right=True)) - 1
        assert torch.equal(offsets[: cut + 1], full[3][: cut + 1]) and bool((offsets[cut + 1 :] == capacity).all())


@pytest.mark.parametrize("device", DEVICES)
def test_every_row_is_written_on_reused_memory(device):
    """The outputs are the op's own allocations: on memory the caching allocator hands back after NaN poison, every
    row (samples and padding) must still be exactly what it should be."""
    args = scene(300, device=device, seed=5)
    full = call(cuda_ext.march_rays, args)
    capacity = full[0].numel() + 1000
    for _ in range(3):  # the caching allocator hands back the same blocks: fill them with poison in between
        poison = torch.full((capacity * 8,), float("nan"), dtype=torch.float64, device=device)
        del poison
        got = capped(cuda_ext.march_rays_capped, args, capacity)
        assert_identical(got, expected(full, capacity, 300))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["no-rays", "empty-occupancy"])
def test_edge_cases(device, case):
    args = scene(40, device=device, seed=9)
    if case == "no-rays":
        args |= {k: args[k][:0] for k in ("origins", "directions", "t_start", "t_end", "offset")}
    else:
        args["occupancy"] = torch.zeros_like(args["occupancy"])
    got = capped(cuda_ext.march_rays_capped, args, 16)
    rays = args["origins"].shape[0]
    assert_identical(got, expected(call(cuda_ext.march_rays, args), 16, rays))
    assert int(got[4]) == 0 and bool((got[3] == 0).all())


@requires_cuda
@pytest.mark.parametrize("space", SPACES)
def test_cuda_equals_cpu_and_makes_no_sync(space):
    args = scene(2000, dtype=torch.float32, space=space, seed=11)
    cpu = capped(cuda_ext.march_rays_capped, args, 20_000)
    on_gpu = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    capped(cuda_ext.march_rays_capped, on_gpu, 20_000)  # warm-up: lazy initialisation may sync once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = capped(cuda_ext.march_rays_capped, on_gpu, 20_000)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_identical(tuple(g.cpu() for g in got), cpu)


@pytest.mark.parametrize("space", SPACES)
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device, space):
    args = scene(50, device=device, seed=6, space=space)
    order = ("origins", "directions", "t_start", "t_end", "offset", "occupancy", "box", "step", "max_samples")
    inputs = (*(args[k] for k in order), 500, args.get("t_split"))
    torch.library.opcheck(torch.ops.cuda_ext.march_rays_capped.default, inputs)  # static shapes: every test


@pytest.mark.parametrize("fn", [cuda_ext.march_rays_capped, reference.march_rays_capped], ids=["op", "reference"])
@pytest.mark.parametrize(
    "capacity,error,match",
    [
        (-1, ValueError, "capacity must be >= 0"),
        (2.5, TypeError, "capacity must be an integer"),
        (True, TypeError, "capacity must be an integer"),
    ],
    ids=["negative", "float", "bool"],
)
def test_bad_capacity_names_the_argument(fn, capacity, error, match):
    with pytest.raises(error, match=match) as info:
        capped(fn, scene(8), capacity)
    assert str(info.value).startswith("march_rays_capped: ")


def test_bad_rays_name_the_op_and_the_argument():
    args = scene(8) | {"origins": scene(8)["origins"][:, :2]}
    with pytest.raises(ValueError, match=r"march_rays_capped: origins must have shape \(B, 3\)"):
        capped(cuda_ext.march_rays_capped, args, 10)


def test_cpp_backstop_rejects_a_negative_capacity():
    with pytest.raises(RuntimeError, match="capacity must be >= 0"):
        capped(torch.ops.cuda_ext.march_rays_capped, scene(8), -3)
