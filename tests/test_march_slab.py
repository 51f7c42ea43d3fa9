"""march_rays / march_rays_capped with a ``slab`` (a split rank's first-axis cells, models.space_split): the kernels
against the reference bit for bit, against the march through the occupancy cut to the slab (what the slab means,
without the reference's slab code), slabs partitioning one march, hard rays for the walk's span (along the planes,
nearly so, far away, from inside), opcheck and bad input."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from tests.test_march import assert_identical, call, scene

requires_cuda = pytest.mark.requires_cuda
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
DTYPES = [torch.float32, torch.float64]
SPACES = ["bounded", "contracted"]
SLABS = [(0, 6), (6, 11), (11, 17), (0, 17), (8, 9)]  # the scene's 17 first-axis cells: first, middle, last, all, one


def march(fn, args: dict, slab):
    return call(lambda *a: fn(*a, *(() if len(a) > 9 else (None,)), slab), args)


def cut(occupancy: torch.Tensor, slab) -> torch.Tensor:
    """The occupancy with every cell outside the slab's first-axis cells cleared."""
    out = torch.zeros_like(occupancy)
    out[slab[0] : slab[1]] = occupancy[slab[0] : slab[1]]
    return out


@pytest.mark.parametrize("slab", SLABS, ids=str)
@pytest.mark.parametrize("space", SPACES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_slab_keeps_what_the_cut_occupancy_keeps(device, dtype, space, slab):
    args = scene(3000, dtype=dtype, device=device, space=space, seed=11)
    got = march(cuda_ext.march_rays, args, slab)
    assert got[0].numel() > 500  # the slab holds samples
    assert_identical(got, call(cuda_ext.march_rays, args | {"occupancy": cut(args["occupancy"], slab)}))
    assert_identical(got, march(reference.march_rays, args, slab))


@pytest.mark.parametrize("device", DEVICES)
def test_slabs_partition_one_march(device):
    args = scene(2000, device=device, seed=12)
    whole = call(cuda_ext.march_rays, args)
    parts = [march(cuda_ext.march_rays, args, slab) for slab in SLABS[:3]]
    counts = sum(part[3].diff() for part in parts)
    assert torch.equal(counts, whole[3].diff())
    merged = torch.cat([part[1] for part in parts]).sort().values
    assert torch.equal(merged, whole[1].sort().values)


def hard_rays(dtype, device) -> dict:
    """Rays the walk's span must not cut short: along the slabs' planes (no x motion), nearly so, from inside the
    box, backwards along x, starting far away with the box's samples at large t, and non-finite ones."""
    generator = torch.Generator().manual_seed(13)
    rays = 512
    origins = (torch.rand(rays, 3, generator=generator, dtype=torch.float64) * 2 - 1) * 0.9
    directions = torch.nn.functional.normalize(torch.randn(rays, 3, generator=generator, dtype=torch.float64), dim=1)
    directions[0:64, 0] = 0.0  # parallel to the planes
    directions[64:128, 0] = 1e-9 * torch.randn(64, generator=generator, dtype=torch.float64)  # nearly so
    directions[128:192, 0] = -directions[128:192, 0].abs()  # towards -x
    far = torch.zeros(rays, dtype=torch.float64)
    far[192:256] = 2.0e4  # the origins stepped back 2e4 along the ray: its box samples at t ~ 2e4
    origins = origins - far[:, None] * directions
    directions = torch.nn.functional.normalize(directions, dim=1)
    offset = torch.rand(rays, generator=generator, dtype=torch.float64)
    t_start, t_end = far.clone(), far + 3.0
    origins[256:260] = float("nan")
    args = dict(origins=origins, directions=directions, t_start=t_start, t_end=t_end, offset=offset)
    args |= {"box": torch.tensor([[-1.0, -1.0, -1.0], [1.0, 1.0, 1.0]], dtype=torch.float64)}
    args = {k: v.to(dtype=dtype, device=device) for k, v in args.items()}
    occupancy = torch.rand(17, 9, 11, generator=generator) < 0.5
    return args | {"occupancy": occupancy.to(device), "step": 0.007, "max_samples": 1000}


@pytest.mark.parametrize("slab", SLABS, ids=str)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hard_rays_keep_every_sample_of_the_slab(device, dtype, slab):
    args = hard_rays(dtype, device)
    got = march(cuda_ext.march_rays, args, slab)
    want = call(cuda_ext.march_rays, args | {"occupancy": cut(args["occupancy"], slab)})
    for g, w in zip(got, want):  # bit for bit, NaN where the NaN rays have their points
        torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)
    if slab != (0, 17):  # the parallel rays inside the slab keep their samples, those outside none
        parallel = (got[0] < 64).sum().item()
        assert 0 < parallel < (call(cuda_ext.march_rays, args)[0] < 64).sum().item()


@pytest.mark.parametrize("device", DEVICES)
def test_capped_march_with_a_slab_equals_the_reference(device):
    args = scene(1000, device=device, seed=14)
    for capacity in (0, 1000, 100_000):
        got = march(lambda *a, c=capacity: cuda_ext.march_rays_capped(*a[:9], c, *a[9:]), args, (6, 11))
        want = march(lambda *a, c=capacity: reference.march_rays_capped(*a[:9], c, *a[9:]), args, (6, 11))
        assert_identical(got[:4], want[:4])
        assert torch.equal(got[4], want[4])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_a_slab(device):
    args = scene(50, device=device, seed=15)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    sample = tuple(call(lambda *a: a, args)) + (None, [6, 11])
    torch.library.opcheck(torch.ops.cuda_ext.march_rays.default, sample, test_utils=tests)
    capped = sample[:9] + (4000, None, [0, 6])
    torch.library.opcheck(torch.ops.cuda_ext.march_rays_capped.default, capped, test_utils=tests)


BAD_SLABS = [
    ("negative", [-1, 3], ValueError, r"slab must be cells \[first, end\) with 0 <= first < end <= 17"),
    ("empty", [3, 3], ValueError, r"slab must be cells \[first, end\)"),
    ("past-the-grid", [3, 18], ValueError, r"slab must be cells \[first, end\)"),
    ("three", [1, 2, 3], TypeError, "slab must be None or two ints"),
    ("one-int", 3, TypeError, "slab must be None or two ints"),
    ("tensor", torch.tensor([1, 3]), TypeError, "slab must be None or two ints"),
    ("float", [1.5, 3], TypeError, "slab must be an integer"),
]


@pytest.mark.parametrize("fn", [cuda_ext.march_rays, reference.march_rays], ids=["op", "reference"])
@pytest.mark.parametrize("slab,error,match", [b[1:] for b in BAD_SLABS], ids=[b[0] for b in BAD_SLABS])
def test_bad_slab_names_the_argument(fn, slab, error, match):
    with pytest.raises(error, match=match) as info:
        march(fn, scene(16, seed=16), slab)
    assert type(info.value) is error and str(info.value).startswith("march_rays: ")


@pytest.mark.parametrize("slab", [[-1, 3], [3, 3], [3, 18], [1, 2, 3]], ids=str)
def test_cpp_backstop_rejects_a_bad_slab(slab):
    with pytest.raises(RuntimeError, match="march_rays: slab must"):
        march(torch.ops.cuda_ext.march_rays, scene(16, seed=16), slab)
