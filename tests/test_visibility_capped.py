"""cuda_ext.visible_samples_capped: visible_samples' outputs in fixed sizes with no device sync (what a CUDA graph can
replay). Against visible_samples cut and padded by hand, bit for bit, with room to spare, exactly full, with too
little room for the alive or for the shown samples, and none; the reference alike; CPU against CUDA, no sync on
CUDA, poisoned memory, opcheck with static shapes, bad input. tests/test_visibility.py checks the decisions."""

from __future__ import annotations

import pytest
import torch
from test_visibility import COUNTS, DEVICES, packed

import cuda_ext
from cuda_ext import reference

THRESHOLDS = (1e-3, 1e-3)


def expected(full, alive_capacity: int, shown_capacity: int, samples: int):
    """What visible_samples_capped must give, from visible_samples' (index, keep, offsets) by hand."""
    index, keep, offsets = full
    alive = index[:alive_capacity]
    shown = keep[keep < alive_capacity][:shown_capacity]
    return (
        torch.cat([alive, index.new_full((alive_capacity - len(alive),), max(samples - 1, 0))]),
        torch.cat([shown, keep.new_full((shown_capacity - len(shown),), alive_capacity)]),
        offsets.clamp(max=alive_capacity),
        torch.tensor([len(index), len(keep)], dtype=torch.int64, device=index.device),
    )


def assert_identical(got, want):
    for name, g, w in zip(("index", "keep", "offsets", "totals"), got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device, name
        assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} of {g.numel()} differ"


def capacities(full, room: str) -> tuple[int, int]:
    alive, shown = len(full[0]), len(full[1])
    return {
        "spare": (alive + 37, shown + 11),
        "exact": (alive, shown),
        "alive-overflow": (alive // 2 + 3, shown),  # a ray cut short, the rays after it empty, their shown ones gone
        "shown-overflow": (alive, shown // 3 + 1),
        "none": (0, 0),
    }[room]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("room", ["spare", "exact", "alive-overflow", "shown-overflow", "none"])
def test_the_first_samples_of_visible_samples(device, dtype, room):
    sd, offsets = packed(COUNTS * 3, dtype=dtype, device=device, seed=2)
    full = cuda_ext.visible_samples(sd, offsets, *THRESHOLDS)
    assert len(full[1]) > 40 and len(full[0]) > len(full[1])  # not trivially small; some samples not shown
    alive_capacity, shown_capacity = capacities(full, room)
    want = expected(full, alive_capacity, shown_capacity, len(sd))
    got = cuda_ext.visible_samples_capped(sd, offsets, *THRESHOLDS, alive_capacity, shown_capacity)
    assert_identical(got, want)
    ref = reference.visible_samples(sd, offsets, *THRESHOLDS)
    assert_identical(
        reference.visible_samples_capped(sd, offsets, *THRESHOLDS, alive_capacity, shown_capacity),
        expected(ref, alive_capacity, shown_capacity, len(sd)),
    )
    if room == "alive-overflow":  # every ray before the cut whole, the cut one short, the later ones empty
        cut = int(torch.searchsorted(full[2], torch.tensor(alive_capacity, device=full[2].device), right=True)) - 1
        assert torch.equal(got[2][: cut + 1], full[2][: cut + 1]) and bool((got[2][cut + 1 :] == alive_capacity).all())


@pytest.mark.parametrize("device", DEVICES)
def test_a_padded_pack_and_no_rays(device):
    sd, offsets = packed(COUNTS, device=device, seed=4)
    padded = torch.cat([sd, torch.rand(19, dtype=sd.dtype, device=device)])  # rows past the last offset: no ray's
    full = cuda_ext.visible_samples(padded, offsets, *THRESHOLDS)
    got = cuda_ext.visible_samples_capped(padded, offsets, *THRESHOLDS, len(full[0]) + 5, len(full[1]) + 5)
    assert_identical(got, expected(full, len(full[0]) + 5, len(full[1]) + 5, len(padded)))
    none = offsets[:1]
    got = cuda_ext.visible_samples_capped(padded[:0], none, *THRESHOLDS, 4, 3)
    assert got[0].tolist() == [0] * 4 and got[1].tolist() == [4] * 3 and got[2].tolist() == [0]
    assert got[3].tolist() == [0, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_every_slot_is_written_on_reused_memory(device):
    sd, offsets = packed(COUNTS * 4, device=device, seed=5)
    full = cuda_ext.visible_samples(sd, offsets, *THRESHOLDS)
    sizes = (len(full[0]) + 100, len(full[1]) + 100)
    for _ in range(3):  # the caching allocator hands back the poisoned blocks
        poison = torch.full((sizes[0] * 4,), -7, dtype=torch.int64, device=device)
        del poison
        got = cuda_ext.visible_samples_capped(sd, offsets, *THRESHOLDS, *sizes)
        assert_identical(got, expected(full, *sizes, len(sd)))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_equals_cpu_and_makes_no_sync(dtype):
    sd, offsets = packed(COUNTS * 50, dtype=dtype, seed=7)
    sizes = (5000, 2000)
    cpu = cuda_ext.visible_samples_capped(sd, offsets, *THRESHOLDS, *sizes)
    sd_gpu, offsets_gpu = sd.cuda(), offsets.cuda()
    cuda_ext.visible_samples_capped(sd_gpu, offsets_gpu, *THRESHOLDS, *sizes)  # warm-up: lazy initialisation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = cuda_ext.visible_samples_capped(sd_gpu, offsets_gpu, *THRESHOLDS, *sizes)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_identical(tuple(g.cpu() for g in got), cpu)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    sd, offsets = packed(COUNTS, device=device, seed=8)
    torch.library.opcheck(torch.ops.cuda_ext.visible_samples_capped.default, (sd, offsets, 1e-3, 1e-3, 300, 100))


@pytest.mark.parametrize("fn", [cuda_ext.visible_samples_capped, reference.visible_samples_capped], ids=["op", "ref"])
@pytest.mark.parametrize(
    "sizes,error,match",
    [
        ((-1, 4), ValueError, "alive_capacity must be >= 0"),
        ((4, -2), ValueError, "shown_capacity must be >= 0"),
        ((2.5, 4), TypeError, "alive_capacity must be an integer"),
        ((4, True), TypeError, "shown_capacity must be an integer"),
    ],
    ids=["negative-alive", "negative-shown", "float", "bool"],
)
def test_bad_capacity_names_the_argument(fn, sizes, error, match):
    sd, offsets = packed(COUNTS)
    with pytest.raises(error, match=match) as info:
        fn(sd, offsets, *THRESHOLDS, *sizes)
    assert str(info.value).startswith("visible_samples_capped: ")


def test_bad_input_names_the_op_and_the_argument():
    sd, offsets = packed(COUNTS)
    with pytest.raises(ValueError, match=r"visible_samples_capped: .*early_termination"):
        cuda_ext.visible_samples_capped(sd, offsets, 1.5, 1e-3, 10, 10)
    with pytest.raises(ValueError, match=r"visible_samples_capped: ray_offsets must start at 0"):
        cuda_ext.visible_samples_capped(sd, offsets + 1, *THRESHOLDS, 10, 10)


def test_cpp_backstop_rejects_a_negative_capacity():
    sd, offsets = packed(COUNTS)
    with pytest.raises(RuntimeError, match="shown_capacity must be >= 0"):
        torch.ops.cuda_ext.visible_samples_capped(sd, offsets, 1e-3, 1e-3, 10, -1)
