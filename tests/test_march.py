"""cuda_ext.march_rays (packed samples along rays, empty space skipped), bounded and contracted (``t_split``): the
kernels against the reference bit for bit, against a per-sample loop, CPU against CUDA, poisoned outputs, edge
cases, opcheck, bad input, the bench. tests/test_contraction.py checks the contracted samples' definition."""

from __future__ import annotations

import math

import pytest
import torch

import cuda_ext
from cuda_ext import reference

requires_cuda = pytest.mark.requires_cuda
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
DTYPES = [torch.float32, torch.float64]
SPACES = ["bounded", "contracted"]


def scene(
    rays: int,
    dtype=torch.float64,
    device="cpu",
    seed=0,
    cells=(17, 23, 19),
    occupied=0.4,
    step=0.013,
    space="bounded",
):
    """Rays from outside a box towards points near it (some miss), their box entries and exits clipped to
    near = 0.1, random offsets, a random occupancy grid: the op's arguments, as a dict. ``space="contracted"``:
    rays from near = 0.1, linear up to the box exit (or near), then in disparity to infinity on most rays and to a
    finite t_end on every fourth (both ways of ending), the occupancy grid over the contracted cube."""
    generator = torch.Generator().manual_seed(seed)
    origins = (torch.rand(rays, 3, generator=generator, dtype=torch.float64) * 2 - 1) * 4
    targets = (torch.rand(rays, 3, generator=generator, dtype=torch.float64) - 0.5) * 3
    directions = torch.nn.functional.normalize(targets - origins, dim=1)
    box = torch.tensor([[-1.2, -0.7, -1.0], [1.1, 0.9, 1.3]], dtype=torch.float64)
    low, high = (box[0] - origins) / directions, (box[1] - origins) / directions
    t_start = torch.minimum(low, high).amax(1).clamp(min=0.1)
    t_end = torch.maximum(low, high).amin(1)
    offset = torch.rand(rays, generator=generator, dtype=torch.float64)
    occupancy = torch.rand(*cells, generator=generator) < occupied
    args = dict(origins=origins, directions=directions, t_start=t_start, t_end=t_end, offset=offset, box=box)
    if space == "contracted":
        ends = torch.where(torch.arange(rays) % 4 == 0, 30.0, math.inf).double()
        args |= {"t_start": torch.full_like(t_start, 0.1), "t_end": ends, "t_split": t_start.maximum(t_end)}
    args = {k: v.to(dtype=dtype, device=device) for k, v in args.items()}
    samples = 300 if space == "bounded" else 900  # the contracted rays: up to ~350 linear + ~540 in disparity
    return args | {"occupancy": occupancy.to(device), "step": step, "max_samples": samples}


def call(fn, args: dict):
    order = ("origins", "directions", "t_start", "t_end", "offset", "occupancy", "box", "step", "max_samples")
    return fn(*(args[k] for k in order), *(() if args.get("t_split") is None else (args["t_split"],)))


def assert_identical(got, want):
    for name, g, w in zip(("ray", "t", "points", "ray_offsets"), got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, name
        assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} of {g.numel()} differ"


# ------------------------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("space", SPACES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_equal_the_reference_bit_for_bit(device, dtype, space):
    args = scene(3000, dtype=dtype, device=device, space=space)
    got = call(cuda_ext.march_rays, args)
    assert got[0].numel() > 10_000  # the case is not trivially empty
    assert_identical(got, call(reference.march_rays, args))
    if space == "contracted":  # samples past the box, out to very far, and both ways of ending a ray are covered
        far = got[1] > 1e3 * args["step"]
        assert bool(far.any()) and bool((got[2].abs().amax(1) > 0.5).any()) and bool((got[2].abs() <= 1).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_samples_follow_the_definition(dtype):
    """A per-sample loop in float64 over the formulas of the docstring (the cell a sample falls in may differ at
    a border by rounding, so positions are compared to float tolerance and cells away from borders only)."""
    args = scene(40, dtype=dtype, seed=3, step=0.05)
    ray, t, points, offsets = call(cuda_ext.march_rays, args)
    a = {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in args.items()}
    box, cells = a["box"], torch.tensor(args["occupancy"].shape, dtype=torch.float64)
    expected_rays, expected_t, expected_points = [], [], []
    for b in range(40):
        for k in range(args["max_samples"]):
            tk = a["t_start"][b] + (k + a["offset"][b]) * args["step"]
            if not tk < a["t_end"][b]:
                break
            unit = (a["origins"][b] + tk * a["directions"][b] - box[0]) * 2 / (box[1] - box[0]) - 1
            cell = ((unit + 1) * cells / 2).floor().clamp(torch.zeros(3), cells - 1).long()
            if args["occupancy"][tuple(cell.tolist())]:
                expected_rays.append(b), expected_t.append(tk.item()), expected_points.append(unit)
    assert ray.tolist() == expected_rays  # no sample near a border in this case: the same cells
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(t.double(), torch.tensor(expected_t, dtype=torch.float64), rtol=tol, atol=tol)
    torch.testing.assert_close(points.double(), torch.stack(expected_points), rtol=tol, atol=tol)
    counts = torch.bincount(ray, minlength=40)
    assert offsets.tolist() == [0] + torch.cumsum(counts, 0).tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_everything_occupied_keeps_every_sample_before_t_end(device):
    everywhere = torch.ones(1, 1, 1, dtype=torch.bool, device=device)
    args = scene(500, device=device, seed=1) | {"occupancy": everywhere, "max_samples": 200}  # some rays hit the cap
    ray, t, points, offsets = call(cuda_ext.march_rays, args)
    span = (args["t_end"] - args["t_start"]) / args["step"] - args["offset"]
    expected = span.ceil().clamp(0, args["max_samples"]).long()  # k with (k + offset) * step < t_end - t_start
    counts = offsets[1:] - offsets[:-1]
    assert (counts - expected).abs().max() <= 1  # rounding at the last sample only
    assert torch.equal(counts, torch.bincount(ray, minlength=500))
    assert (expected == args["max_samples"]).any() and (expected == 0).any()  # the cap and misses are covered
    assert bool((t < args["t_end"][ray]).all()) and bool((t >= args["t_start"][ray]).all())


@requires_cuda
@pytest.mark.parametrize("space", SPACES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_equals_cpu_and_writes_every_output(dtype, space):
    """Bit for bit the CPU kernel; the caching allocator is first filled with NaN, so a slot the kernel never
    wrote would show (outputs come from freshly freed, poisoned blocks)."""
    args = scene(4000, dtype=dtype, seed=5, space=space)
    want = call(cuda_ext.march_rays, args)
    cuda_args = {k: v.cuda() if torch.is_tensor(v) else v for k, v in args.items()}
    for size in (want[0].numel(), 3 * want[0].numel()):
        poison = torch.full((size,), float("nan"), dtype=dtype, device="cuda")
        poison.view(torch.int64 if dtype == torch.float64 else torch.int32).fill_(-7)
        del poison
    got = call(cuda_ext.march_rays, cuda_args)
    assert_identical([g.cpu() for g in got], want)


@pytest.mark.parametrize("space", SPACES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["no-rays", "all-miss", "empty-occupancy", "one-sample"], ids=lambda c: c)
def test_edge_cases(device, case, space):
    args = scene(64, device=device, seed=2, space=space)
    if case == "no-rays":
        args = {k: v[:0] if torch.is_tensor(v) and k not in ("occupancy", "box") else v for k, v in args.items()}
    elif case == "all-miss":
        args["t_end"] = args["t_start"] - 1.0
    elif case == "empty-occupancy":
        args["occupancy"] = torch.zeros_like(args["occupancy"])
    else:
        args["max_samples"] = 1
    got = call(cuda_ext.march_rays, args)
    assert_identical(got, call(reference.march_rays, args))
    rays = args["origins"].shape[0]
    assert got[3].shape == (rays + 1,) and got[3][-1].item() == got[0].numel()
    if case != "one-sample":
        assert got[0].numel() == 0 and got[2].shape == (0, 3)
    else:
        assert got[0].numel() > 0 and bool((torch.bincount(got[0]) <= 1).all())


def test_the_model_marches_the_same_samples_with_either_backend():
    """What the model sees: ops.march_rays custom vs torch, over an occupancy grid with empty cells, gives the same
    render bit for bit."""
    from test_model import TORCH_OPS, make_model, randomize_density, rays_towards_centre

    from models import build_ops

    outs = []
    for backend in ("custom", "torch"):
        model = make_model(ops=build_ops(TORCH_OPS | {"march_rays": backend}))
        randomize_density(model)
        with torch.no_grad():  # empty outside a central block: the occupancy grid skips most cells
            r0, r1, r2 = model.density.grid.shape[:3]
            model.density.grid[: r0 // 3].fill_(-30.0)
            model.density.grid[:, : r1 // 4].fill_(-30.0)
        model.refresh_occupancy()
        model.eval()
        outs.append(model.render_rays(*rays_towards_centre(256)))
        skipped = 1.0 - model.occupancy.occupied_fraction()
    assert outs[0]["samples"].item() > 0 and 0.05 < skipped < 0.95
    for key in ("rgb", "depth", "opacity", "samples"):
        assert torch.equal(outs[0][key], outs[1][key]), key


@pytest.mark.parametrize("space", SPACES)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(device, dtype, space):
    args = scene(50, dtype=dtype, device=device, seed=6, space=space)
    # the output size is data: the fake kernel gives it as a dynamic size, which AOT dispatch tests cannot trace
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.cuda_ext.march_rays.default, tuple(call(lambda *a: a, args)), test_utils=tests)


# -------------------------------------------------------------------------------------------- bad input


BAD = [
    ("origins-list", {"origins": lambda t: t.tolist()}, TypeError, "origins must be a torch.Tensor"),
    ("origins-2-columns", {"origins": lambda t: t[:, :2]}, ValueError, r"origins must have shape \(B, 3\)"),
    ("origins-int", {"origins": lambda t: t.long()}, TypeError, "origins must be float32 or float64"),
    ("origins-half", {"origins": lambda t: t.half()}, TypeError, "origins must be float32 or float64"),
    ("directions-rows", {"directions": lambda t: t[:5]}, ValueError, r"directions must have shape \(64, 3\)"),
    ("directions-dtype", {"directions": lambda t: t.float()}, TypeError, "directions and origins must have the same"),
    ("t_start-2d", {"t_start": lambda t: t[:, None]}, ValueError, r"t_start must have shape \(64,\)"),
    ("t_end-rows", {"t_end": lambda t: t[:3]}, ValueError, r"t_end must have shape \(64,\)"),
    ("offset-dtype", {"offset": lambda t: t.float()}, TypeError, "offset and origins must have the same dtype"),
    ("occupancy-float", {"occupancy": lambda t: t.float()}, TypeError, "occupancy must be bool"),
    ("occupancy-2d", {"occupancy": lambda t: t[0]}, ValueError, r"occupancy must have shape \(R0, R1, R2\)"),
    ("occupancy-empty", {"occupancy": lambda t: t[:0]}, ValueError, r"occupancy must have shape \(R0, R1, R2\)"),
    ("box-shape", {"box": lambda t: t[:1]}, ValueError, r"box must have shape \(2, 3\)"),
    ("box-dtype", {"box": lambda t: t.float()}, TypeError, "box and origins must have the same dtype"),
    ("step-0", {"step": 0.0}, ValueError, "step must be a finite number > 0"),
    ("step-inf", {"step": math.inf}, ValueError, "step must be a finite number > 0"),
    ("step-nan", {"step": math.nan}, ValueError, "step must be a finite number > 0"),
    ("step-str", {"step": "0.1"}, TypeError, "step must be a number"),
    ("max_samples-0", {"max_samples": 0}, ValueError, r"max_samples must be in \[1, 2\^24\]"),
    ("max_samples-huge", {"max_samples": 1 << 25}, ValueError, r"max_samples must be in \[1, 2\^24\]"),
    ("max_samples-float", {"max_samples": 3.5}, TypeError, "max_samples must be an integer"),
    ("t_split-list", {"t_split": lambda t: t.tolist()}, TypeError, "t_split must be a torch.Tensor"),
    ("t_split-rows", {"t_split": lambda t: t[:3]}, ValueError, r"t_split must have shape \(64,\)"),
    ("t_split-dtype", {"t_split": lambda t: t.float()}, TypeError, "t_split and origins must have the same dtype"),
]


def _bad_args(change: dict) -> dict:
    args = scene(64, seed=7, space="contracted" if "t_split" in change else "bounded")
    for key, fn in change.items():
        args[key] = fn(args[key]) if callable(fn) else fn
    return args


@pytest.mark.parametrize("fn", [cuda_ext.march_rays, reference.march_rays], ids=["op", "reference"])
@pytest.mark.parametrize("change,error,match", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_the_argument(fn, change, error, match):
    with pytest.raises(error, match=match) as info:
        call(fn, _bad_args(change))
    assert type(info.value) is error and str(info.value).startswith("march_rays: ")


RAW_BAD = [
    b for b in BAD if b[0] not in ("origins-list", "step-str", "max_samples-float", "origins-half", "t_split-list")
]


@pytest.mark.parametrize("change,error,match", [b[1:] for b in RAW_BAD], ids=[b[0] for b in RAW_BAD])
def test_cpp_backstop_rejects_direct_calls(change, error, match):
    """torch.ops.cuda_ext.march_rays without the wrapper: TORCH_CHECK, the same words, RuntimeError."""
    with pytest.raises(RuntimeError, match=match.split(" must")[0]):
        call(torch.ops.cuda_ext.march_rays, _bad_args(change))


@requires_cuda
def test_cuda_rejects_a_cpu_occupancy_grid():
    args = scene(8, device="cuda") | {"occupancy": torch.ones(2, 2, 2, dtype=torch.bool)}
    with pytest.raises(ValueError, match="occupancy and origins must be on the same device"):
        call(cuda_ext.march_rays, args)


# --------------------------------------------------------------------------------------------------- bench


def test_bench_smoke_cpu(tmp_path, load_bench):
    out = tmp_path / "march.json"
    report = load_bench("bench_march").main(
        ["--device", "cpu", "--rays", "256", "--repeats", "2", "--budget-s", "0.1", "--json", str(out)]
    )
    assert out.exists()
    variants = ["reference (dense + nonzero)", "march_rays op", "march_rays_capped op, capacity x1.25"]
    assert [(r["space"], r["variant"]) for r in report["results"]] == [
        (space, variant) for space in SPACES for variant in variants
    ]
    for r in report["results"]:
        assert r["ms"] > 0 and r["GBps"] > 0 and r["samples"] > 0
    assert all(r["speedup_vs_reference"] > 0 for r in report["results"] if r["variant"] != variants[0])
    assert all(r["speedup_vs_march_rays"] > 0 for r in report["results"] if r["variant"] == variants[2])
    assert set(report["spaces"]) == set(SPACES)
