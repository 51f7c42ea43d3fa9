"""cuda_ext.visible_samples (the training march's no-grad pass: early ray termination and the weight threshold):
the kernels and the reference against a per-ray loop over the definition in float64, against each other in float32,
opcheck, poisoned outputs on CUDA, and bad input."""

from __future__ import annotations

import math

import pytest
import torch
from test_padded_packs import past_the_end

import cuda_ext
from cuda_ext import reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]
FNS = [cuda_ext.visible_samples, reference.visible_samples]
# empty, single-sample and long rays (several warp chunks, early termination inside and past the first)
COUNTS = [5, 0, 1, 40, 3, 0, 77, 12, 200, 32, 33, 64]
THRESHOLDS = [(1e-3, 1e-3), (0.0, 1e-3), (1e-3, 0.0), (0.0, 0.0), (0.2, 0.05)]


def packed(counts: list[int], dtype=torch.float64, device="cpu", seed: int = 0, depth: float = 0.6):
    """(N,) optical depths in (0, depth), cubed towards 0 (most rays see through many samples), with a few
    contracted-march giants (1e11), and the (B + 1,) offsets of rays with ``counts`` samples."""
    generator = torch.Generator().manual_seed(seed)
    n = sum(counts)
    sd = torch.rand(n, generator=generator, dtype=torch.float64) ** 3 * depth + 1e-4
    sd[torch.randperm(n, generator=generator)[: max(n // 50, 1)]] = 1e11
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    return sd.to(dtype).to(device), offsets.to(device)


def definition(sd, offsets, early_termination, weight_threshold, start=None):
    """Per ray, as written, in float64: S_i the ray's start (0 without) plus the sum of min(s_j, 100) over the
    earlier samples, alive where
    S_i < -log(early_termination), shown where also exp(-S_i) (1 - exp(-s_i)) > weight_threshold. Returns the (N,)
    bool masks alive, shown and the (N,) margins by which each decision cleared its threshold (in log space)."""
    sd, offsets = sd.detach().cpu().double(), offsets.cpu()
    alive, shown = torch.zeros(len(sd), dtype=torch.bool), torch.zeros(len(sd), dtype=torch.bool)
    margin = torch.full((len(sd),), math.inf, dtype=torch.float64)
    limit = -math.log(early_termination) if early_termination > 0 else math.inf
    for b in range(offsets.shape[0] - 1):
        above = 0.0 if start is None else float(start[b])
        for i in range(int(offsets[b]), int(offsets[b + 1])):
            weight = math.exp(-above) * -math.expm1(-float(sd[i]))
            alive[i] = above < limit
            shown[i] = bool(alive[i]) and weight > weight_threshold
            margin[i] = abs(above - limit)
            if alive[i]:  # the weight decides only where the sample is alive; w > 0 is safe unless it underflows
                scale = weight_threshold if weight_threshold > 0 else 1e-290
                margin[i] = min(margin[i], abs(math.log(max(weight, 1e-300) / scale)))
            above += min(float(sd[i]), 100.0)
    return alive, shown, margin


def as_masks(out, n: int):
    """visible_samples' (index, keep, offsets) -> (N,) bool masks alive and shown (after checking they agree)."""
    index, keep, offsets = (x.cpu() for x in out)
    assert offsets[0] == 0 and offsets[-1] == index.shape[0]
    assert bool((index[1:] > index[:-1]).all()) and bool((keep[1:] > keep[:-1]).all())
    alive, shown = torch.zeros(n, dtype=torch.bool), torch.zeros(n, dtype=torch.bool)
    alive[index] = True
    shown[index[keep]] = True
    return alive, shown


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("thresholds", THRESHOLDS)
def test_matches_the_definition_in_float64(device, fn, thresholds):
    sd, offsets = packed(COUNTS * 3, device=device)
    alive, shown, margin = definition(sd, offsets, *thresholds)
    assert bool((margin > 1e-9).all())  # no decision within rounding of its threshold: the test is exact
    out = fn(sd, offsets, *thresholds)
    got_alive, got_shown = as_masks(out, len(sd))
    assert torch.equal(got_alive, alive) and torch.equal(got_shown, shown)
    # per ray, the alive samples are a prefix, and the offsets count them
    counts = torch.tensor([int(alive[a:b].sum()) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())])
    assert torch.equal(out[2].cpu(), torch.nn.functional.pad(counts.cumsum(0), (1, 0)))
    if min(thresholds) > 0:  # the data terminate rays and shade only part of the survivors
        assert 0 < int(alive.sum()) < len(sd) and 0 < int(shown.sum()) < int(alive.sum())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("thresholds", THRESHOLDS)
def test_kernels_decide_as_the_reference_in_float32(device, thresholds):
    """float32 depths: the kernels sum in another order than the reference's one running sum, so only a sample
    within float rounding of a threshold could go the other way; none does here (each margin is checked)."""
    sd, offsets = packed(COUNTS * 40, dtype=torch.float32, device=device, seed=1)
    want = reference.visible_samples(sd, offsets, *thresholds)
    got = cuda_ext.visible_samples(sd, offsets, *thresholds)
    _, _, margin = definition(sd, offsets, *thresholds)
    same = [torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want)]
    assert all(same) or bool((margin < 1e-5).any()), same


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_equals_cpu_and_writes_every_output(dtype, poison_cuda_cache):
    sd, offsets = packed(COUNTS * 500, dtype=dtype, seed=2)
    want = cuda_ext.visible_samples(sd, offsets, 1e-3, 1e-3)
    poison_cuda_cache()
    got = cuda_ext.visible_samples(sd.cuda(), offsets.cuda(), 1e-3, 1e-3)
    for g, w in zip(got, want):
        assert g.device.type == "cuda" and torch.equal(g.cpu(), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", FNS)
def test_no_samples_and_no_rays(device, fn):
    empty = torch.zeros(0, dtype=torch.float32, device=device)
    for offsets in ([0], [0, 0, 0]):
        index, keep, out = fn(empty, torch.tensor(offsets, device=device), 1e-3, 1e-3)
        assert index.shape == (0,) and keep.shape == (0,) and out.tolist() == offsets
        assert index.dtype == keep.dtype == out.dtype == torch.int64


def test_opcheck():
    sd, offsets = packed(COUNTS, seed=3)
    torch.library.opcheck(torch.ops.cuda_ext.visible_samples.default, (sd, offsets, 1e-3, 1e-3))
    start = starts(len(offsets) - 1, sd.dtype, "cpu")
    torch.library.opcheck(torch.ops.cuda_ext.visible_samples.default, (sd, offsets, 1e-3, 1e-3, start))


def starts(rays: int, dtype, device, seed: int = 9) -> torch.Tensor:
    """(B,) start depths: a third 0, the rest in (0, 8) (past -log(1e-3) = 6.9 a ray is dead from its start)."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.rand(rays, generator=generator, dtype=torch.float64) * 8.0
    start[torch.rand(rays, generator=generator) < 1 / 3] = 0.0
    return start.to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize("thresholds", THRESHOLDS)
def test_a_start_depth_matches_the_definition_in_float64(device, fn, thresholds):
    """start_depth: the optical depth in front of each ray's first sample (the space split's back slab)."""
    sd, offsets = packed(COUNTS * 3, device=device, seed=6)
    start = starts(len(offsets) - 1, sd.dtype, device)
    alive, shown, margin = definition(sd, offsets, *thresholds, start=start.cpu())
    assert bool((margin > 1e-9).all())
    got_alive, got_shown = as_masks(fn(sd, offsets, *thresholds, start_depth=start), len(sd))
    assert torch.equal(got_alive, alive) and torch.equal(got_shown, shown)
    without, _, _ = definition(sd, offsets, *thresholds)
    if thresholds[0] > 0:  # the start ends some rays early and others before their first sample
        assert int(alive.sum()) < int(without.sum())


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_start_depth_on_cuda_equals_cpu(dtype, poison_cuda_cache):
    sd, offsets = packed(COUNTS * 500, dtype=dtype, seed=7)
    start = starts(len(offsets) - 1, dtype, "cpu")
    want = cuda_ext.visible_samples(sd, offsets, 1e-3, 1e-3, start)
    want_capped = cuda_ext.visible_samples_capped(sd, offsets, 1e-3, 1e-3, 5000, 2000, start)
    poison_cuda_cache()
    got = cuda_ext.visible_samples(sd.cuda(), offsets.cuda(), 1e-3, 1e-3, start.cuda())
    got_capped = cuda_ext.visible_samples_capped(sd.cuda(), offsets.cuda(), 1e-3, 1e-3, 5000, 2000, start.cuda())
    for g, w in zip((*got, *got_capped), (*want, *want_capped)):
        assert g.device.type == "cuda" and torch.equal(g.cpu(), w)


@pytest.mark.parametrize("fn", [cuda_ext.visible_samples_capped, reference.visible_samples_capped])
def test_the_capped_op_takes_the_start_depth_too(fn):
    sd, offsets = packed(COUNTS * 3, seed=8)
    start = starts(len(offsets) - 1, sd.dtype, "cpu")
    index, keep, alive_offsets = reference.visible_samples(sd, offsets, 1e-3, 1e-3, start)
    got = fn(sd, offsets, 1e-3, 1e-3, len(index) + 5, len(keep) + 3, start_depth=start)
    assert torch.equal(got[0][: len(index)], index) and torch.equal(got[1][: len(keep)], keep)
    assert torch.equal(got[2], alive_offsets) and got[3].tolist() == [len(index), len(keep)]


@pytest.mark.parametrize("fn", FNS)
@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: {**a, "optical_depth": a["optical_depth"].half()}, TypeError, "optical_depth must be float32"),
        (lambda a: {**a, "optical_depth": a["optical_depth"][:, None]}, ValueError, r"optical_depth must have shape"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"].int()}, TypeError, "ray_offsets must be int64"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"] + 1}, ValueError, "ray_offsets must start at 0"),
        (lambda a: {**a, "ray_offsets": a["ray_offsets"].flip(0)}, ValueError, "ray_offsets must start at 0"),
        (lambda a: {**a, "early_termination": 1.0}, ValueError, r"early_termination must be in \[0, 1\)"),
        (lambda a: {**a, "weight_threshold": -0.1}, ValueError, r"weight_threshold must be in \[0, 1\)"),
        (lambda a: {**a, "weight_threshold": True}, TypeError, "weight_threshold must be a number"),
        (
            lambda a: {**a, "optical_depth": a["optical_depth"].tolist()},
            TypeError,
            "optical_depth must be a torch.Tensor",
        ),
        (
            lambda a: {**a, "start_depth": torch.zeros(3, dtype=torch.float64)},
            ValueError,
            r"start_depth must have shape",
        ),
        (
            lambda a: {**a, "start_depth": torch.zeros(len(COUNTS))},
            TypeError,
            "start_depth and optical_depth must have the same dtype",
        ),
        (lambda a: {**a, "start_depth": [0.0] * len(COUNTS)}, TypeError, "start_depth must be a torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(fn, change, error, match):
    sd, offsets = packed(COUNTS, seed=4)
    args = {"optical_depth": sd, "ray_offsets": offsets, "early_termination": 1e-3, "weight_threshold": 1e-3}
    with pytest.raises(error, match=match):
        fn(**change(args))


def test_the_cpu_kernel_checks_what_the_wrapper_checks():
    """Called straight through torch.ops (no Python wrapper), the C++ checks stop bad offsets and thresholds."""
    sd, offsets = packed(COUNTS, seed=5)
    with pytest.raises(RuntimeError, match="ray_offsets must end at most at N"):
        torch.ops.cuda_ext.visible_samples(sd, past_the_end(offsets), 1e-3, 1e-3)
    with pytest.raises(RuntimeError, match="early_termination must be in"):
        torch.ops.cuda_ext.visible_samples(sd, offsets, -1.0, 1e-3)
    with pytest.raises(RuntimeError, match="start_depth must have shape"):
        torch.ops.cuda_ext.visible_samples(sd, offsets, 1e-3, 1e-3, sd[:3])
    with pytest.raises(RuntimeError, match="start_depth must have optical_depth's dtype"):
        torch.ops.cuda_ext.visible_samples_capped(sd, offsets, 1e-3, 1e-3, 8, 8, sd.new_zeros(len(COUNTS)).float())
