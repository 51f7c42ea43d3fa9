"""cuda_ext.sparse_adam_step (masked Adam) and training.optim.SparseGridAdam: dense torch.optim.Adam on the rows
touched, nothing at all on the rest; kernels vs the reference; CUDA layouts; opcheck; bad input; the bench."""

from __future__ import annotations

import pytest
import torch

import cuda_ext
from cuda_ext import reference
from training.optim import SparseGridAdam

requires_cuda = pytest.mark.requires_cuda
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
HYPER = {"lr": 0.05, "betas": (0.9, 0.99), "eps": 1e-8}


def state(m: int, c: int, dtype=torch.float64, device="cpu", seed=0):
    """param, grad, exp_avg, exp_avg_sq of shape (m, c); the second moment non-negative."""
    generator = torch.Generator().manual_seed(seed)
    p, g, m1, m2 = (torch.randn(m, c, generator=generator, dtype=torch.float64) * s for s in (1.0, 0.1, 0.01, 0.001))
    return [x.to(dtype=dtype, device=device) for x in (p, g, m1, m2.abs())]


def some_rows(m: int, k: int, device="cpu", seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(m, generator=generator)[:k].to(device)


def dense_adam_and_op(device, dtype, m, c, steps, betas=(0.9, 0.99), eps=1e-8, step_fn=cuda_ext.sparse_adam_step):
    """torch.optim.Adam over the whole (m, c) tensor vs the op with every row listed, same gradients."""
    start = state(m, c, dtype=dtype, device=device)[0]
    dense = torch.nn.Parameter(start.clone())
    optimizer = torch.optim.Adam([dense], lr=0.05, betas=betas, eps=eps)
    param, exp_avg, exp_avg_sq = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    rows = torch.randperm(m, generator=torch.Generator().manual_seed(9)).to(device)  # every row, any order
    generator = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        grad = torch.randn(m, c, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)
        dense.grad = grad.clone()
        optimizer.step()
        step_fn(param, grad, exp_avg, exp_avg_sq, rows, step, 0.05, *betas, eps)
    moments = optimizer.state[dense]
    return (param, exp_avg, exp_avg_sq), (dense.detach(), moments["exp_avg"], moments["exp_avg_sq"])


# --------------------------------------------------------------------------------- against torch.optim.Adam


@pytest.mark.parametrize("step_fn", [cuda_ext.sparse_adam_step, reference.sparse_adam_step], ids=["op", "reference"])
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.4, 0.999)], ids=["small-lerp-weight", "large-lerp-weight"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 2e-6)])
def test_every_row_touched_equals_torch_adam_cpu(dtype, tol, betas, step_fn):
    got, want = dense_adam_and_op("cpu", dtype, 301, 13, steps=6, betas=betas, step_fn=step_fn)
    # The moments follow torch's op order exactly (lerp, mul + addcmul, with the fma of ATen's CPU vector code).
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    # The parameter to rounding: torch's vectorised CPU sqrt is not correctly rounded, the kernel's is.
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    if step_fn is reference.sparse_adam_step:  # the reference runs torch's own ops: bit for bit
        assert torch.equal(got[0], want[0])


@requires_cuda
@pytest.mark.parametrize("channels", [1, 3, 12, 13, 32])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
def test_every_row_touched_equals_torch_adam_cuda(dtype, tol, channels):
    got, want = dense_adam_and_op("cuda", dtype, 1000, channels, steps=5)
    for g, w in zip(got, want):  # torch's CUDA Adam (foreach) orders its ops slightly differently
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_the_other_groups_step_as_torch_adam_bit_for_bit(device):
    """The decoder's group (several tensors, a 0-d one, one without a gradient at some steps, the rate changing
    between steps) goes through torch's own functional Adam: exactly torch.optim.Adam's values and state."""
    generator = torch.Generator().manual_seed(1)
    shapes = [(50, 13), (13,), (), (7, 3)]
    starts = [torch.randn(shape, generator=generator, dtype=torch.float64).to(device) for shape in shapes]
    dense = [torch.nn.Parameter(x.clone()) for x in starts]
    ours = [torch.nn.Parameter(x.clone()) for x in starts]
    # on CUDA the dense groups take torch's fused Adam (training.optim.adam_step_dense): that is the reference there
    dense_opt = torch.optim.Adam([{"params": dense, "name": "decoder"}], fused=device == "cuda", **HYPER)
    our_opt = SparseGridAdam([{"params": ours, "name": "decoder"}], cuda_ext.sparse_adam_step, **HYPER)
    for step in range(5):
        for group in (*dense_opt.param_groups, *our_opt.param_groups):
            group["lr"] = HYPER["lr"] * 0.8**step
        for index, (a, b) in enumerate(zip(dense, ours)):
            skip = index == 3 and step in (1, 2)  # no gradient: neither steps it, its step count stays
            grad = None if skip else torch.randn(a.shape, generator=generator, dtype=torch.float64).to(device)
            a.grad, b.grad = (None, None) if skip else (grad.clone(), grad.clone())
        dense_opt.step()
        our_opt.step()
    for a, b in zip(dense, ours):
        assert torch.equal(a, b)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            # fused Adam keeps its step counts on the device, ours on the CPU (as the default Adam's, for checkpoints)
            assert torch.equal(dense_opt.state[a][key].cpu(), our_opt.state[b][key].cpu()), key
    assert float(our_opt.state[ours[3]]["step"]) == 3 and float(our_opt.state[ours[0]]["step"]) == 5


# ------------------------------------------------------------------------------------- some rows touched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-14), (torch.float32, 2e-6)])
def test_untouched_rows_are_bit_identical_and_touched_rows_match_the_reference(device, dtype, tol):
    param, grad, m, v = state(400, 13, dtype=dtype, device=device, seed=2)
    rows = some_rows(400, 37, device)
    want = [x.clone() for x in (param, m, v)]
    got = [x.clone() for x in (param, m, v)]
    for step in (1, 2, 7):
        reference.sparse_adam_step(want[0], grad, want[1], want[2], rows, step, 0.01, 0.9, 0.99, 1e-8)
        cuda_ext.sparse_adam_step(got[0], grad, got[1], got[2], rows, step, 0.01, 0.9, 0.99, 1e-8)
    untouched = torch.ones(400, dtype=torch.bool, device=device)
    untouched[rows] = False
    for g, w, before in zip(got, want, (param, m, v)):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
        assert torch.equal(g[untouched], before[untouched])  # bit-identical: never written
        assert not torch.equal(g[rows], before[rows])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("channels", [1, 2, 4, 13, 27, 64, 100])
def test_poisoned_untouched_rows_are_never_read_or_written(device, channels):
    """NaN in every untouched row of all four arrays: a kernel that reads one spreads it, one that writes
    one changes its bits; the touched rows must come out finite and as the reference makes them."""
    param, grad, m, v = state(257, channels, device=device, seed=3)
    rows = some_rows(257, 100, device, seed=4)
    untouched = torch.ones(257, dtype=torch.bool, device=device)
    untouched[rows] = False
    want = [x.clone() for x in (param, m, v)]
    reference.sparse_adam_step(want[0], grad, want[1], want[2], rows, 3, 0.1, 0.9, 0.999, 1e-8)
    got = [x.clone() for x in (param, grad, m, v)]
    for x in got:
        x[untouched] = float("nan")
    poisoned = [x.clone() for x in got]
    cuda_ext.sparse_adam_step(*got, rows, 3, 0.1, 0.9, 0.999, 1e-8)
    for g, w in zip((got[0], got[2], got[3]), want):
        torch.testing.assert_close(g[rows], w[rows], rtol=1e-14, atol=1e-15)
    for g, p in zip(got, poisoned):
        assert torch.equal(g.view(torch.int64)[untouched], p.view(torch.int64)[untouched])


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows_is_a_no_op_and_float32_is_close_to_float64(device):
    param, grad, m, v = state(30, 12, device=device, seed=5)
    before = [x.clone() for x in (param, m, v)]
    cuda_ext.sparse_adam_step(
        param, grad, m, v, torch.empty(0, dtype=torch.int64, device=device), 1, 0.1, 0.9, 0.99, 1e-8
    )
    assert all(torch.equal(a, b) for a, b in zip((param, m, v), before))
    rows = torch.arange(0, 30, 3, device=device)
    single = [x.float() for x in (param, m, v)]
    cuda_ext.sparse_adam_step(param, grad, m, v, rows, 2, 0.1, 0.9, 0.99, 1e-15)
    cuda_ext.sparse_adam_step(single[0], grad.float(), single[1], single[2], rows, 2, 0.1, 0.9, 0.99, 1e-15)
    for s, d in zip(single, (param, m, v)):
        torch.testing.assert_close(s.double(), d, rtol=1e-5, atol=1e-6)


def test_optimizer_skips_zero_gradient_voxels_of_the_grids():
    grid = torch.nn.Parameter(torch.randn(4, 4, 4, 3, dtype=torch.float64))
    optimizer = SparseGridAdam([{"params": [grid], "name": "grids"}], cuda_ext.sparse_adam_step, **HYPER)
    grad = torch.zeros_like(grid)
    grad[1, 2, 3] = torch.tensor([0.5, 0.0, -0.2])
    grad[0, 0, 0, 1] = 1.0
    grid.grad = grad
    before = grid.detach().clone()
    optimizer.step()
    changed = (grid.detach() != before).any(dim=-1)
    assert changed.nonzero().tolist() == [[0, 0, 0], [1, 2, 3]]
    assert optimizer.state[grid]["exp_avg"][2, 2, 2].abs().sum() == 0


# ------------------------------------------------------------------------------------------------- CUDA


@requires_cuda
@pytest.mark.parametrize("channels", [1, 2, 3, 4, 8, 12, 13, 16, 27, 33, 64, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cuda_matches_cpu_for_every_layout(channels, dtype):
    """Every pack width (16/8/4 bytes, single elements) and lane count (1 to 32, and rows wider than a warp)."""
    cpu = state(3000, channels, dtype=dtype, seed=6)
    rows = some_rows(3000, 1700, seed=7)
    gpu = [x.cuda() for x in cpu]
    for step in (1, 2):
        cuda_ext.sparse_adam_step(*cpu, rows, step, 0.01, 0.9, 0.99, 1e-8)
        cuda_ext.sparse_adam_step(*gpu, rows.cuda(), step, 0.01, 0.9, 0.99, 1e-8)
    tol = 1e-14 if dtype == torch.float64 else 1e-6  # same formula; CPU and GPU round the fma's alike
    for c, g in zip(cpu, gpu):
        torch.testing.assert_close(g.cpu(), c, rtol=tol, atol=tol)


@requires_cuda
@pytest.mark.parametrize("offset", [1, 2])
def test_cuda_misaligned_tensors_take_the_narrow_path(offset):
    """Contiguous views that start 4 or 8 bytes past a 16-byte boundary, C = 12 (which would take float4)."""
    cpu = state(500, 12, dtype=torch.float32, seed=8)
    gpu = []
    for x in cpu:
        storage = torch.empty(x.numel() + offset, dtype=x.dtype, device="cuda")
        view = storage[offset:].view(500, 12)
        view.copy_(x)
        gpu.append(view)
    assert gpu[0].data_ptr() % 16 != 0
    rows = some_rows(500, 222, seed=9)
    cuda_ext.sparse_adam_step(*cpu, rows, 4, 0.01, 0.9, 0.99, 1e-8)
    cuda_ext.sparse_adam_step(*gpu, rows.cuda(), 4, 0.01, 0.9, 0.99, 1e-8)
    for c, g in zip(cpu, gpu):
        torch.testing.assert_close(g.cpu(), c, rtol=1e-6, atol=1e-6)


@requires_cuda
def test_cuda_many_rows_cover_every_grid_stride_pass():
    param, grad, m, v = state(600_000, 13, dtype=torch.float32, device="cuda", seed=10)
    rows = torch.randperm(600_000, device="cuda")[:450_000]
    want = [x.clone() for x in (param, m, v)]
    reference.sparse_adam_step(want[0], grad, want[1], want[2], rows, 5, 0.01, 0.9, 0.99, 1e-8)
    cuda_ext.sparse_adam_step(param, grad, m, v, rows, 5, 0.01, 0.9, 0.99, 1e-8)
    for g, w in zip((param, m, v), want):
        torch.testing.assert_close(g, w, rtol=2e-6, atol=2e-6)


@requires_cuda
@pytest.mark.parametrize("moved", ["grad", "rows"])
def test_cuda_device_mismatch_names_the_argument(moved):
    args = dict(zip(("param", "grad", "exp_avg", "exp_avg_sq"), state(10, 4, device="cuda")))
    args["rows"] = torch.tensor([1, 2], device="cuda")
    args[moved] = args[moved].cpu()
    with pytest.raises(ValueError, match=f"{moved} and param must be on the same device"):
        cuda_ext.sparse_adam_step(**args, step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
    with pytest.raises(RuntimeError, match=moved):
        torch.ops.cuda_ext.sparse_adam_step(*args.values(), 1, 0.1, 0.9, 0.99, 1e-8)


# ------------------------------------------------------------------------------------------------ opcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_opcheck(device, dtype):
    param, grad, m, v = state(10, 4, dtype=dtype, device=device, seed=4)
    args = (param, grad, m, v, torch.tensor([1, 5, 2], device=device), 3, 0.1, 0.9, 0.99, 1e-8)
    torch.library.opcheck(torch.ops.cuda_ext.sparse_adam_step.default, args)


# -------------------------------------------------------------------------------------------- bad input


def _args(**change):
    param, grad, m, v = state(10, 10, seed=5)
    args = {"param": param, "grad": grad, "exp_avg": m, "exp_avg_sq": v, "rows": torch.tensor([1, 2])}
    args.update(step=1, lr=0.1, beta1=0.9, beta2=0.99, eps=1e-8)
    for key, fn in change.items():
        args[key] = fn(args[key]) if callable(fn) else fn
    return args


BAD = [
    ("grad-columns", {"grad": lambda t: t[:, :2].contiguous()}, ValueError, r"grad must have the shape of param"),
    ("exp_avg-rows", {"exp_avg": lambda t: t[:9].contiguous()}, ValueError, "exp_avg must have the shape of param"),
    ("exp_avg_sq-dtype", {"exp_avg_sq": lambda t: t.float()}, TypeError, "exp_avg_sq and param must have the same"),
    ("grad-dtype", {"grad": lambda t: t.float()}, TypeError, "grad and param must have the same dtype"),
    ("param-3d", {"param": lambda t: t[None]}, ValueError, r"param must have shape \(M, C\)"),
    ("param-int", {"param": lambda t: t.long()}, TypeError, "param must be float32 or float64"),
    ("param-half", {"param": lambda t: t.half()}, TypeError, "param must be float32 or float64"),
    ("param-strided", {"param": lambda t: t.t()}, ValueError, "param must be contiguous"),
    ("param-list", {"param": lambda t: t.tolist()}, TypeError, "param must be a torch.Tensor"),
    ("rows-int32", {"rows": lambda t: t.int()}, TypeError, "rows must be int64"),
    ("rows-float", {"rows": lambda t: t.double()}, TypeError, "rows must be int64"),
    ("rows-2d", {"rows": lambda t: t[None]}, ValueError, r"rows must have shape \(K,\)"),
    ("rows-too-large", {"rows": torch.tensor([0, 10])}, ValueError, r"rows must lie in \[0, 10\)"),
    ("rows-negative", {"rows": torch.tensor([-1, 3])}, ValueError, r"rows must lie in \[0, 10\)"),
    ("step-0", {"step": 0}, ValueError, "step must be >= 1"),
    ("step-float", {"step": 1.5}, TypeError, "step must be an integer"),
    ("lr-negative", {"lr": -0.1}, ValueError, "lr must be in"),
    ("lr-str", {"lr": "0.1"}, TypeError, "lr must be a number"),
    ("beta1-1", {"beta1": 1.0}, ValueError, "beta1 must be in"),
    ("beta1-negative", {"beta1": -0.1}, ValueError, "beta1 must be in"),
    ("beta2-1", {"beta2": 1.0}, ValueError, "beta2 must be in"),
    ("beta2-nan", {"beta2": float("nan")}, ValueError, "beta2 must be in"),
    ("eps-0", {"eps": 0.0}, ValueError, "eps must be a number > 0"),
    ("eps-negative", {"eps": -1e-8}, ValueError, "eps must be a number > 0"),
    ("eps-None", {"eps": None}, TypeError, "eps must be a number > 0"),
]


@pytest.mark.parametrize("fn", [cuda_ext.sparse_adam_step, reference.sparse_adam_step], ids=["op", "reference"])
@pytest.mark.parametrize("change,error,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(fn, change, error, match):
    assert_refused_before_writing(fn, _args(**change), error, match, "sparse_adam_step")


def assert_refused_before_writing(fn, args: dict, error: type, match: str, op: str) -> None:
    """fn(**args) of a row-sparse Adam op raises exactly ``error`` (its message starting with the op's name)
    and leaves param and both moments as they were."""
    before = [x.clone() for x in (args["param"], args["exp_avg"], args["exp_avg_sq"]) if torch.is_tensor(x)]
    with pytest.raises(error, match=match) as info:
        fn(**args)
    assert type(info.value) is error and str(info.value).startswith(f"{op}: ")
    after = [x for x in (args["param"], args["exp_avg"], args["exp_avg_sq"]) if torch.is_tensor(x)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))  # rejected before any write


RAW_BAD = [b for b in BAD if b[0] not in ("param-list", "step-float", "lr-str", "eps-None", "rows-negative")]


@pytest.mark.parametrize("change,error,match", [b[1:] for b in RAW_BAD], ids=[b[0] for b in RAW_BAD])
def test_cpp_backstop_rejects_direct_calls(change, error, match):
    """torch.ops.cuda_ext.sparse_adam_step without the wrapper: TORCH_CHECK, the same words, RuntimeError."""
    with pytest.raises(RuntimeError, match=match.split(" must")[0]):
        torch.ops.cuda_ext.sparse_adam_step(*_args(**change).values())


def test_cpp_rejects_out_of_range_rows_before_writing():
    args = _args(rows=torch.tensor([3, 4, -2]))
    before = args["param"].clone()
    with pytest.raises(RuntimeError, match=r"rows must lie in \[0, 10\), got -2 at position 2"):
        torch.ops.cuda_ext.sparse_adam_step(*args.values())
    assert torch.equal(args["param"], before)


@pytest.mark.parametrize(
    "device,fused", [("cpu", False), ("cpu", True), pytest.param("cuda", None, marks=pytest.mark.requires_cuda)]
)
def test_dense_groups_step_as_torch_adam_across_a_load(device, fused):
    """adam_step_dense (the decoder's group; fused by default on CUDA, its step counts mirrored on the device)
    follows torch.optim.Adam, and after a load moves the CPU counts, the mirrors follow them."""
    from training.optim import adam_step_dense

    generator = torch.Generator().manual_seed(4)
    ours = [torch.randn(shape, generator=generator).to(device).requires_grad_() for shape in ((7, 3), (5,))]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    torch_adam = torch.optim.Adam(theirs, lr=0.01, betas=HYPER["betas"], eps=1e-8)
    states, group = {p: {} for p in ours}, {"betas": HYPER["betas"], "lr": 0.01, "eps": 1e-8}
    for step in range(6):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=generator).to(device)
            b.grad = a.grad.clone()
        with torch.no_grad():  # as the optimisers' step
            adam_step_dense(states, ours, group, fused)
        torch_adam.step()
        if step == 2:  # a checkpoint's counts loaded: back to 1
            for state in (*states.values(), *torch_adam.state.values()):
                state["step"].fill_(1)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert [int(states[p]["step"]) for p in ours] == [4, 4] and states[ours[0]]["step"].device.type == "cpu"


# --------------------------------------------------------------------------------------------------- bench


def test_bench_smoke_cpu(tmp_path, load_bench):
    out = tmp_path / "adam.json"
    report = load_bench("bench_sparse_adam").main(
        ["--device", "cpu", "--size", "8", "--repeats", "2", "--budget-s", "0.1", "--json", str(out)]
    )
    assert out.exists() and report["grid"] == {"size": 8, "rows": 512, "channels": 13, "dtype": "float32"}
    variants = [(r["variant"], r["fraction"]) for r in report["results"]]
    assert variants[0] == ("dense Adam (foreach)", 1.0)
    kinds = ("sparse op", "sparse wrapper", "sparse op, clear_grad", "masked by gradient", "masked + zero fill")
    kinds += ("masked, clear_grad",)
    assert {v for v in variants[1:]} == {(v, f) for v in kinds for f in (0.01, 0.1)}
    for r in report["results"]:
        assert r["ms"] > 0 and r["GBps"] > 0 and r["pct_copy"] > 0
    # the gradient left zero for the next step: by a fill of all of it, or zeros on the K rows (clear_grad)
    zeroing = {"masked + zero fill": lambda k: 512 * 13 * 4, "masked, clear_grad": lambda k: k * 13 * 4}
    for r in report["results"][1:]:
        k = r["rows"]
        if r["variant"].startswith("masked"):  # the whole gradient, then param, m, v on the K rows
            expected = 512 * 13 * 4 + 6 * k * 13 * 4 + zeroing.get(r["variant"], lambda k: 0)(k)
        else:  # the clear writes the K rows' gradient too
            expected = (8 if "clear_grad" in r["variant"] else 7) * k * 13 * 4 + 8 * k
        assert r["speedup_vs_dense"] > 0 and r["bytes"] == expected
