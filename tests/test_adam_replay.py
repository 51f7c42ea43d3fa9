"""cuda_ext.adam_replay_rows: dense Adam's zero-gradient steps replayed on the masked rows (the exact lazy Adam's
catch-up). Kernels vs the reference in float64, against k real zero-gradient steps of torch.optim.Adam, rows not
masked never read or written (poisoned), CUDA layouts, opcheck, bad input. The optimiser that uses it:
tests/test_lazy_adam.py."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference

requires_cuda = pytest.mark.requires_cuda
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
FNS = [cuda_ext.adam_replay_rows, reference.adam_replay_rows]
BETAS = (0.9, 0.99)


def case(m: int, c: int, done: int = 40, dtype=torch.float64, device="cpu", seed=0, mask_dtype=torch.bool):
    """Random (param, exp_avg, exp_avg_sq, mask, last, replay): stamps in [0, done] (some current), half the
    rows masked, a few rows with v = 0 (never stepped), replay sums > 0."""
    generator = torch.Generator().manual_seed(seed)
    param = torch.randn(m, c, generator=generator, dtype=torch.float64)
    exp_avg = torch.randn(m, c, generator=generator, dtype=torch.float64) * 1e-3
    exp_avg_sq = torch.rand(m, c, generator=generator, dtype=torch.float64) * 1e-6 + 1e-9
    exp_avg_sq[:: max(1, m // 7)] = 0.0
    exp_avg[:: max(1, m // 7)] = 0.0
    mask = torch.rand(m, generator=generator) < 0.5
    last = torch.randint(0, done + 1, (m,), generator=generator)
    last[1::5] = done  # current: left alone
    replay = torch.rand(done + 3, generator=generator, dtype=torch.float64) * 0.05
    tensors = [x.to(dtype=dtype, device=device) for x in (param, exp_avg, exp_avg_sq)]
    return [*tensors, mask.to(mask_dtype).to(device), last.to(device), replay.to(device)], done


# ------------------------------------------------------------------------------------------- what it computes


@pytest.mark.parametrize("fn", FNS, ids=["op", "reference"])
@pytest.mark.parametrize("device", DEVICES)
def test_replaying_k_steps_is_dense_adams_k_zero_gradient_steps(fn, device):
    """torch.optim.Adam run for real: t0 steps with gradients, then k with zero gradients (lr changing every
    step); the op from the state at t0 with the replay sum of those k steps lands on the same state."""
    t0, k, lr, eps = 5, 7, lambda s: 0.05 / s, 1e-30
    beta1, beta2 = BETAS
    generator = torch.Generator().manual_seed(3)
    grid = torch.nn.Parameter(torch.randn(9, 4, generator=generator, dtype=torch.float64))
    adam = torch.optim.Adam([grid], lr=lr(1), betas=BETAS, eps=eps)
    for s in range(1, t0 + 1):
        adam.param_groups[0]["lr"] = lr(s)
        grid.grad = torch.randn(9, 4, generator=generator, dtype=torch.float64) * 1e-3
        adam.step()
    state = adam.state[grid]
    at_t0 = [x.detach().clone().to(device) for x in (grid, state["exp_avg"], state["exp_avg_sq"])]
    for s in range(t0 + 1, t0 + k + 1):
        adam.param_groups[0]["lr"] = lr(s)
        grid.grad = torch.zeros_like(grid)
        adam.step()
    replay = torch.zeros(t0 + k + 1, dtype=torch.float64)
    replay[t0] = sum(
        lr(s) * (1 - beta2**s) ** 0.5 / (1 - beta1**s) * (beta1 / beta2**0.5) ** (s - t0)
        for s in range(t0 + 1, t0 + k + 1)
    )
    mask = torch.ones(9, dtype=torch.bool, device=device)
    last = torch.full((9,), t0, dtype=torch.int64, device=device)
    fn(*at_t0, mask, last, replay.to(device), t0 + k, *BETAS)
    for got, want in zip(at_t0, (grid.detach(), state["exp_avg"], state["exp_avg_sq"])):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.uint8])
@pytest.mark.parametrize("channels", [1, 3, 4, 12, 13])
def test_op_matches_the_reference_and_leaves_other_rows_bit_identical(device, mask_dtype, channels):
    args, done = case(300, channels, device=device, seed=channels, mask_dtype=mask_dtype)
    want = [x.clone() for x in args[:3]]
    reference.adam_replay_rows(*want, *args[3:], done, *BETAS)
    got = [x.clone() for x in args[:3]]
    cuda_ext.adam_replay_rows(*got, *args[3:], done, *BETAS)
    mask, last = args[3].bool(), args[4]
    moved = mask & (last != done)
    for g, w, before in zip(got, want, args[:3]):
        torch.testing.assert_close(g, w, rtol=1e-14, atol=1e-16)
        assert torch.equal(g[~moved], before[~moved])  # not masked, or current: never written
    assert not torch.equal(got[0][moved], args[0][moved]) and bool(moved.any())


@pytest.mark.parametrize("device", DEVICES)
def test_poisoned_rows_outside_the_mask_are_never_read_or_written(device):
    """NaN in every row not to replay (unmasked, or current) of all three arrays: a kernel that reads one spreads
    it, one that writes one changes its bits; the replayed rows come out finite and as the reference's."""
    args, done = case(257, 12, device=device, seed=7)
    moved = args[3] & (args[4] != done)
    want = [x.clone() for x in args[:3]]
    reference.adam_replay_rows(*want, *args[3:], done, *BETAS)
    got = [x.clone() for x in args[:3]]
    for x in got:
        x[~moved] = float("nan")
    poisoned = [x.clone() for x in got]
    cuda_ext.adam_replay_rows(*got, *args[3:], done, *BETAS)
    for g, w, p in zip(got, want, poisoned):
        torch.testing.assert_close(g[moved], w[moved], rtol=1e-14, atol=1e-16)
        assert torch.equal(g.view(torch.int64)[~moved], p.view(torch.int64)[~moved])


@pytest.mark.parametrize("device", DEVICES)
def test_float32_is_close_to_float64_and_an_empty_mask_is_a_no_op(device):
    args, done = case(200, 12, device=device, seed=2)
    want = [x.clone() for x in args[:3]]
    reference.adam_replay_rows(*want, *args[3:], done, *BETAS)
    single = [x.float() for x in args[:3]]
    cuda_ext.adam_replay_rows(*single, *args[3:], done, *BETAS)
    for s, w in zip(single, want):  # float32 rounding, relative to each array's scale (p: ~1, v: ~1e-6)
        torch.testing.assert_close(s.double(), w, rtol=2e-6, atol=1e-6 * float(w.abs().max()))
    before = [x.clone() for x in args[:3]]
    cuda_ext.adam_replay_rows(*args[:3], torch.zeros_like(args[3]), *args[4:], done, *BETAS)
    assert all(torch.equal(a, b) for a, b in zip(args[:3], before))


# ------------------------------------------------------------------------------------------------------ CUDA


@requires_cuda
@pytest.mark.parametrize("channels,offset", [(12, 0), (12, 1), (13, 0), (1, 0), (64, 0)])
def test_cuda_matches_cpu_for_every_layout(channels, offset):
    """float4 packs (C = 12, aligned), the narrow path (C = 12 four bytes off a 16-byte boundary, C = 13), C = 1,
    and enough rows (200k) for several grid-stride passes."""
    args, done = case(200_000, channels, dtype=torch.float32, seed=channels)
    gpu = []
    for x in args[:3]:
        storage = torch.empty(x.numel() + offset, dtype=x.dtype, device="cuda")
        view = storage[offset:].view(x.shape)
        view.copy_(x)
        gpu.append(view)
    cuda_ext.adam_replay_rows(*args[:3], *args[3:], done, *BETAS)
    cuda_ext.adam_replay_rows(*gpu, *(x.cuda() for x in args[3:]), done, *BETAS)
    for g, c in zip(gpu, args[:3]):  # float32 rounding (nvcc fuses p - shift * ratio), relative to each array's scale
        torch.testing.assert_close(g.cpu(), c, rtol=2e-6, atol=1e-6 * float(c.abs().max()))


@requires_cuda
def test_cuda_stamp_out_of_range_gives_a_nan_row_not_a_crash():
    args, done = [x.cuda() for x in case(50, 12, dtype=torch.float32)[0]], 40
    args[3][:] = True
    args[4][7] = done + 5
    cuda_ext.adam_replay_rows(*args, done, *BETAS)
    assert torch.isnan(args[0][7]).all() and torch.isfinite(args[0][torch.arange(50, device="cuda") != 7]).all()


@requires_cuda
@pytest.mark.parametrize("moved", ["exp_avg", "mask", "last", "replay"])
def test_cuda_device_mismatch_names_the_argument(moved):
    args, done = case(10, 4, device="cuda")
    names = ("param", "exp_avg", "exp_avg_sq", "mask", "last", "replay")
    kwargs = dict(zip(names, args))
    kwargs[moved] = kwargs[moved].cpu()
    with pytest.raises(ValueError, match=f"{moved} and param must be on the same device"):
        cuda_ext.adam_replay_rows(**kwargs, done=done, beta1=0.9, beta2=0.99)
    with pytest.raises(RuntimeError, match=moved):
        torch.ops.cuda_ext.adam_replay_rows(*kwargs.values(), done, 0.9, 0.99)


# ------------------------------------------------------------------------------------------------ opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(device, dtype):
    args, done = case(20, 4, dtype=dtype, device=device, seed=4)
    torch.library.opcheck(torch.ops.cuda_ext.adam_replay_rows.default, (*args, done, *BETAS))


# -------------------------------------------------------------------------------------------- bad input


def _args(**change):
    args, done = case(10, 4, seed=5)
    named = dict(zip(("param", "exp_avg", "exp_avg_sq", "mask", "last", "replay"), args))
    named.update(done=done, beta1=0.9, beta2=0.99)
    for key, fn in change.items():
        named[key] = fn(named[key]) if callable(fn) else fn
    return named


BAD = [
    ("exp_avg-rows", {"exp_avg": lambda t: t[:9].contiguous()}, ValueError, "exp_avg must have the shape of param"),
    ("exp_avg_sq-dtype", {"exp_avg_sq": lambda t: t.float()}, TypeError, "exp_avg_sq and param must have the same"),
    ("param-int", {"param": lambda t: t.long()}, TypeError, "param must be float32 or float64"),
    ("param-strided", {"param": lambda t: t.t()}, ValueError, "param must be contiguous"),
    ("param-list", {"param": lambda t: t.tolist()}, TypeError, "param must be a torch.Tensor"),
    ("mask-float", {"mask": lambda t: t.float()}, TypeError, "mask must be bool or uint8"),
    ("mask-short", {"mask": lambda t: t[:9]}, ValueError, r"mask must have shape \(M,\)"),
    ("last-int32", {"last": lambda t: t.int()}, TypeError, "last must be int64"),
    ("last-2d", {"last": lambda t: t[None]}, ValueError, r"last must have shape \(M,\)"),
    ("last-strided", {"last": lambda t: torch.stack([t, t], 1)[:, 0]}, ValueError, "last must be contiguous"),
    ("replay-float32", {"replay": lambda t: t.float()}, TypeError, "replay must be float64"),
    ("replay-2d", {"replay": lambda t: t[None]}, ValueError, r"replay must have shape \(T,\)"),
    ("done-past-replay", {"done": 43}, ValueError, r"done must be in \[0, T\)"),
    ("done-negative", {"done": -1}, ValueError, r"done must be in \[0, T\)"),
    ("done-float", {"done": 4.5}, TypeError, "done must be an integer"),
    ("beta1-1", {"beta1": 1.0}, ValueError, "beta1 must be in"),
    ("beta2-0", {"beta2": 0.0}, ValueError, "beta2 must be in"),
    ("beta2-str", {"beta2": "0.9"}, TypeError, "beta2 must be a number"),
]


@pytest.mark.parametrize("fn", FNS, ids=["op", "reference"])
@pytest.mark.parametrize("change,error,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(fn, change, error, match):
    from test_sparse_adam import assert_refused_before_writing

    assert_refused_before_writing(fn, _args(**change), error, match, "adam_replay_rows")


RAW_BAD = [b for b in BAD if b[0] not in ("param-list", "done-float", "beta2-str")]


@pytest.mark.parametrize("change,error,match", [b[1:] for b in RAW_BAD], ids=[b[0] for b in RAW_BAD])
def test_cpp_backstop_rejects_direct_calls(change, error, match):
    """torch.ops.cuda_ext.adam_replay_rows without the wrapper: TORCH_CHECK, the same words, RuntimeError."""
    with pytest.raises(RuntimeError, match=match.split(" must")[0]):
        torch.ops.cuda_ext.adam_replay_rows(*_args(**change).values())


@pytest.mark.parametrize("stamp", [-1, 41])
def test_stamps_outside_zero_to_done_are_refused_before_writing(stamp):
    args = _args()
    args["mask"][:] = True
    args["last"][6] = stamp
    before = args["param"].clone()
    with pytest.raises(RuntimeError, match=r"last must lie in \[0, done = 40\] on the masked rows, got .* at row 6"):
        cuda_ext.adam_replay_rows(**args)
    assert torch.equal(args["param"], before)
    with pytest.raises(ValueError, match=r"last must lie in \[0, done = 40\]"):
        reference.adam_replay_rows(**args)
