"""Contracts every cuda_ext op keeps, whichever backend runs it (issue 14, parts 3 and 4).

- Bad arguments: the public wrappers and the pure-PyTorch references reject each bad call with the same
  exception type (ValueError / TypeError, never a C++ RuntimeError) and a message that names the argument;
  the raw op (torch.ops.cuda_ext.X on CPU tensors, the C++ TORCH_CHECK backstop) rejects it too, and so
  does its fake (meta) kernel, with the wrapper's exception, under FakeTensorMode and on the "meta" device.
- Double backward: gradgradcheck for every op that has one (gelu, upsample_bilinear2d), a clear error for
  the others (trilinear_interpolate, grid_interpolate); a gradient penalty through a GELU MLP.
- Non-finite points: grid_interpolate's custom op and reference agree on NaN / +inf / -inf coordinates.
- torch.library.opcheck for every op, where this torch has it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F

import cuda_ext
from cuda_ext import reference
from cuda_ext.gelu import gelu_second_derivative

OPS = torch.ops.cuda_ext
F64 = torch.float64
MODES = ["none", "tanh"]

try:
    from torch._subclasses.fake_tensor import FakeTensorMode
except ImportError:  # pragma: no cover - every torch >= 2.4 has it
    FakeTensorMode = None

requires_fake_mode = pytest.mark.skipif(FakeTensorMode is None, reason="this torch has no FakeTensorMode")
requires_opcheck = pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="this torch has no opcheck")


def randn(*shape, dtype=F64, seed=0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def rand_points(n, dtype=F64, seed=1, spread=1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return ((torch.rand(n, 3, generator=gen, dtype=torch.float64) * 2 - 1) * spread).to(dtype)


def randint(*shape, dtype=torch.int64, seed=2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-5, 6, shape, generator=gen).to(dtype)


# ------------------------------------------------------------------------------------------ bad calls


@dataclasses.dataclass
class Bad:
    """One bad call of a public op.

    error/match: what the wrapper and the reference raise (match names the argument).
    raw: how torch.ops.cuda_ext.<op> itself rejects it: "kernel" (the C++ check: RuntimeError; its fake
    kernel raises error/match), "schema" (the dispatcher's argument parsing, before any kernel: RuntimeError
    naming the argument, for the fake too), or None (the raw op accepts it: the schema coerces it, e.g. 1 for
    a bool; only the typed wrapper is stricter).
    meta: the fake kernel rejects it on the "meta" device too (not so for CPU-only dtype rules).
    """

    id: str
    op: str
    args: tuple
    error: type
    match: str
    arg: str
    raw: Optional[str] = "kernel"
    meta: bool = True


def _trilinear_cases() -> list[Bad]:
    op = "trilinear_interpolate"
    feats, points = randn(4, 8, 3), rand_points(4)

    def bad(id, args, error, match, arg, **kw):
        return Bad(f"{op}-{id}", op, args, error, match, arg, **kw)

    return [
        bad(
            "feats-list",
            (feats.tolist(), points),
            TypeError,
            "trilinear_interpolate: feats must be a torch.Tensor",
            "feats",
            raw="schema",
        ),
        bad("points-float", (feats, 0.5), TypeError, "points must be a torch.Tensor", "points", raw="schema"),
        bad(
            "feats-2d", (randn(4, 24), points), ValueError, r"feats must have shape \(N, 8, F\), got \(4, 24\)", "feats"
        ),
        bad("feats-4d", (randn(4, 8, 3, 1), points), ValueError, r"feats must have shape \(N, 8, F\)", "feats"),
        bad("feats-7-corners", (randn(4, 7, 3), points), ValueError, "feats must hold 8 corners", "feats"),
        bad("feats-no-corners", (randn(4, 0, 3), points), ValueError, "feats must hold 8 corners", "feats"),
        bad(
            "points-2-columns",
            (feats, rand_points(4)[:, :2]),
            ValueError,
            r"trilinear_interpolate: points must have shape \(N, 3\), got \(4, 2\)",
            "points",
        ),
        bad(
            "points-1d",
            (feats, rand_points(4).flatten()),
            ValueError,
            r"points must have shape \(N, 3\), got \(12,\)",
            "points",
        ),
        bad("points-3d", (feats, rand_points(4)[:, :, None]), ValueError, r"points must have shape \(N, 3\)", "points"),
        bad("N-mismatch", (feats, rand_points(5)), ValueError, "points has N=5 rows but feats has N=4", "points"),
        bad(
            "N-mismatch-empty", (randn(0, 8, 3), points), ValueError, "points has N=4 rows but feats has N=0", "points"
        ),
        bad("int64", (randint(4, 8, 3), randint(4, 3)), TypeError, "feats must be float32 or float64", "feats"),
        bad("bool", (randint(4, 8, 3) > 0, randint(4, 3) > 0), TypeError, "feats must be float32 or float64", "feats"),
        bad(
            "complex",
            (feats.to(torch.complex128), points.to(torch.complex128)),
            TypeError,
            "feats must be float32 or float64",
            "feats",
        ),
        bad("mixed-dtypes", (feats, points.float()), TypeError, "points and feats must have the same dtype", "points"),
        bad("int-points", (feats, randint(4, 3)), TypeError, "points and feats must have the same dtype", "points"),
        bad(
            "half-on-cpu",
            (feats.half(), points.half()),
            TypeError,
            "feats must be float32 or float64 on the CPU",
            "feats",
            meta=False,
        ),
        bad(
            "bfloat16-on-cpu",
            (feats.bfloat16(), points.bfloat16()),
            TypeError,
            "feats must be float32 or float64 on the CPU",
            "feats",
            meta=False,
        ),
    ]


def _grid_cases() -> list[Bad]:
    op = "grid_interpolate"
    grid, points = randn(3, 4, 2, 5), rand_points(6)

    def bad(id, args, error, match, arg, **kw):
        return Bad(f"{op}-{id}", op, args, error, match, arg, **kw)

    return [
        bad(
            "grid-None",
            (None, points),
            TypeError,
            "grid_interpolate: grid must be a torch.Tensor",
            "grid",
            raw="schema",
        ),
        bad("points-list", (grid, points.tolist()), TypeError, "points must be a torch.Tensor", "points", raw="schema"),
        bad(
            "grid-3d",
            (randn(3, 4, 10), points),
            ValueError,
            r"grid must have shape \(R0, R1, R2, C\), got \(3, 4, 10\)",
            "grid",
        ),
        bad("grid-5d", (randn(3, 4, 2, 5, 1), points), ValueError, r"grid must have shape \(R0, R1, R2, C\)", "grid"),
        bad("empty-axis-0", (randn(0, 4, 2, 5), points), ValueError, "grid has an empty axis 0", "grid"),
        bad("empty-axis-1", (randn(3, 0, 2, 5), points), ValueError, "grid has an empty axis 1", "grid"),
        bad("empty-axis-2", (randn(3, 4, 0, 5), points), ValueError, "grid has an empty axis 2", "grid"),
        bad(
            "points-4-columns",
            (grid, randn(5, 4)),
            ValueError,
            r"grid_interpolate: points must have shape \(N, 3\), got \(5, 4\)",
            "points",
        ),
        bad(
            "points-2-columns",
            (grid, randn(5, 2)),
            ValueError,
            r"points must have shape \(N, 3\), got \(5, 2\)",
            "points",
        ),
        bad("points-1d", (grid, randn(3)), ValueError, r"points must have shape \(N, 3\)", "points"),
        bad("points-3d", (grid, randn(5, 3, 1)), ValueError, r"points must have shape \(N, 3\)", "points"),
        bad(
            "int32",
            (randint(3, 4, 2, 5, dtype=torch.int32), randint(6, 3, dtype=torch.int32)),
            TypeError,
            "grid must be float32 or float64",
            "grid",
        ),
        bad("mixed-dtypes", (grid.float(), points), TypeError, "points and grid must have the same dtype", "points"),
        bad(
            "half-on-cpu",
            (grid.half(), points.half()),
            TypeError,
            "grid must be float32 or float64 on the CPU",
            "grid",
            meta=False,
        ),
        bad(
            "bfloat16-on-cpu",
            (grid.bfloat16(), points.bfloat16()),
            TypeError,
            "grid must be float32 or float64 on the CPU",
            "grid",
            meta=False,
        ),
    ]


def _upsample_cases() -> list[Bad]:
    op = "upsample_bilinear2d"
    x = randn(2, 3, 4, 5)

    def bad(id, args, error, match, arg, **kw):
        return Bad(f"{op}-{id}", op, args, error, match, arg, **kw)

    huge_width = torch.ones(1, dtype=F64).expand(1, 1, 1, 2**30)  # no memory behind it
    huge_height = torch.ones(1, dtype=F64).expand(1, 1, 2**29, 1)
    return [
        bad(
            "x-list",
            (x.tolist(), 2, False),
            TypeError,
            "upsample_bilinear2d: x must be a torch.Tensor",
            "x",
            raw="schema",
        ),
        bad("x-3d", (randn(3, 4, 5), 2, False), ValueError, r"x must be 4-D \(B, C, H, W\), got 3-D", "x"),
        bad("x-5d", (randn(1, 2, 3, 4, 5), 2, False), ValueError, r"x must be 4-D \(B, C, H, W\), got 5-D", "x"),
        bad("x-0d", (randn(), 2, False), ValueError, r"x must be 4-D \(B, C, H, W\), got 0-D", "x"),
        bad("int64", (randint(2, 3, 4, 5), 2, False), TypeError, "x must be float32 or float64", "x"),
        bad("bool", (randint(2, 3, 4, 5) > 0, 2, False), TypeError, "x must be float32 or float64", "x"),
        bad("half-on-cpu", (x.half(), 2, False), TypeError, "x must be float32 or float64 on the CPU", "x", meta=False),
        bad(
            "bfloat16-on-cpu",
            (x.bfloat16(), 2, True),
            TypeError,
            "x must be float32 or float64 on the CPU",
            "x",
            meta=False,
        ),
        bad("scale-0", (x, 0, False), ValueError, "scale_factor must be an integer >= 1, got 0", "scale_factor"),
        bad(
            "scale-negative", (x, -3, True), ValueError, "scale_factor must be an integer >= 1, got -3", "scale_factor"
        ),
        bad(
            "scale-too-large", (x, 2**31, False), ValueError, "scale_factor must be at most 2147483647", "scale_factor"
        ),
        bad(
            "scale-float",
            (x, 1.5, False),
            TypeError,
            "scale_factor must be an integer >= 1, got 1.5",
            "scale_factor",
            raw="schema",
        ),
        bad(
            "scale-integral-float",
            (x, 2.0, False),
            TypeError,
            "scale_factor must be an integer",
            "scale_factor",
            raw="schema",
        ),
        bad("scale-str", (x, "2", False), TypeError, "scale_factor must be an integer", "scale_factor", raw="schema"),
        bad("scale-None", (x, None, False), TypeError, "scale_factor must be an integer", "scale_factor", raw="schema"),
        bad("scale-bool", (x, True, False), TypeError, "scale_factor must be an integer", "scale_factor", raw=None),
        bad("align-str", (x, 2, "yes"), TypeError, "align_corners must be a bool", "align_corners", raw="schema"),
        bad("align-None", (x, 2, None), TypeError, "align_corners must be a bool", "align_corners", raw=None),
        bad("align-int", (x, 2, 1), TypeError, "align_corners must be a bool", "align_corners", raw=None),
        bad(
            "huge-width",
            (huge_width, 4, False),
            ValueError,
            "x width times scale_factor must be at most 2147483647",
            "x width",
        ),
        bad(
            "huge-height", (huge_height, 8, True), ValueError, "x height times scale_factor must be at most", "x height"
        ),
    ]


def _gelu_cases() -> list[Bad]:
    op = "gelu"
    x = randn(3, 4)

    def bad(id, args, error, match, arg, **kw):
        return Bad(f"{op}-{id}", op, args, error, match, arg, **kw)

    return [
        bad("x-list", (x.tolist(), "none"), TypeError, "gelu: x must be a torch.Tensor", "x", raw="schema"),
        bad("x-float", (0.5, "tanh"), TypeError, "gelu: x must be a torch.Tensor", "x", raw="schema"),
        bad(
            "approximate-exact",
            (x, "exact"),
            ValueError,
            'gelu: approximate must be "none" or "tanh", got \'exact\'',
            "approximate",
        ),
        bad("approximate-Tanh", (x, "Tanh"), ValueError, 'approximate must be "none" or "tanh"', "approximate"),
        bad("approximate-empty", (x, ""), ValueError, 'approximate must be "none" or "tanh"', "approximate"),
        bad(
            "approximate-None",
            (x, None),
            TypeError,
            'approximate must be "none" or "tanh", got None',
            "approximate",
            raw="schema",
        ),
        bad("approximate-int", (x, 1), TypeError, 'approximate must be "none" or "tanh"', "approximate", raw="schema"),
        bad("int64", (randint(3, 4), "none"), TypeError, "gelu: x must be float32 or float64", "x"),
        bad("int32", (randint(3, 4, dtype=torch.int32), "tanh"), TypeError, "x must be float32 or float64", "x"),
        bad("bool", (randint(7) > 0, "none"), TypeError, "x must be float32 or float64", "x"),
        bad("complex", (x.to(torch.complex64), "none"), TypeError, "x must be float32 or float64", "x"),
        bad("half-on-cpu", (x.half(), "none"), TypeError, "x must be float32 or float64 on the CPU", "x", meta=False),
        bad(
            "bfloat16-on-cpu",
            (x.bfloat16(), "tanh"),
            TypeError,
            "x must be float32 or float64 on the CPU",
            "x",
            meta=False,
        ),
    ]


BAD_CALLS = _trilinear_cases() + _grid_cases() + _upsample_cases() + _gelu_cases()
KERNEL_REJECTED = [case for case in BAD_CALLS if case.raw == "kernel"]


def _ids(cases):
    return [case.id for case in cases]


def test_every_op_and_argument_has_bad_calls():
    covered = {(case.op, case.arg.split()[0]) for case in BAD_CALLS}
    expected = {
        ("trilinear_interpolate", "feats"),
        ("trilinear_interpolate", "points"),
        ("grid_interpolate", "grid"),
        ("grid_interpolate", "points"),
        ("upsample_bilinear2d", "x"),
        ("upsample_bilinear2d", "scale_factor"),
        ("upsample_bilinear2d", "align_corners"),
        ("gelu", "x"),
        ("gelu", "approximate"),
    }
    assert covered == expected


@pytest.mark.parametrize("case", BAD_CALLS, ids=_ids(BAD_CALLS))
def test_wrapper_rejects_naming_the_argument(case: Bad):
    with pytest.raises(case.error, match=case.match) as info:
        getattr(cuda_ext, case.op)(*case.args)
    assert type(info.value) is case.error  # not a subclass, not the C++ RuntimeError
    assert str(info.value).startswith(case.op + ": ") and case.arg in str(info.value)


@pytest.mark.parametrize("case", BAD_CALLS, ids=_ids(BAD_CALLS))
def test_reference_rejects_like_the_wrapper(case: Bad):
    """The app swaps between cuda_ext and cuda_ext.reference by config: the same call fails the same way."""
    with pytest.raises(case.error, match=case.match) as info:
        getattr(reference, case.op)(*case.args)
    assert type(info.value) is case.error


@pytest.mark.parametrize(
    "case", [c for c in BAD_CALLS if c.raw is not None], ids=_ids([c for c in BAD_CALLS if c.raw is not None])
)
def test_raw_op_rejects_too(case: Bad):
    """The C++ backstop (or the dispatcher's argument parsing) rejects what the wrapper rejects."""
    with pytest.raises((RuntimeError, TypeError, ValueError), match=case.arg.split()[0]):
        getattr(OPS, case.op)(*case.args)


# -------------------------------------------------------------------- fake kernels reject like the real


def _fake_call(op_name: str, args: tuple) -> Any:
    mode = FakeTensorMode()
    fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode:
        return getattr(OPS, op_name)(*fake_args)


def _meta_call(op_name: str, args: tuple) -> Any:
    meta_args = tuple(a.to("meta") if isinstance(a, torch.Tensor) else a for a in args)
    return getattr(OPS, op_name)(*meta_args)


@requires_fake_mode
@pytest.mark.parametrize(
    "case", [c for c in BAD_CALLS if c.raw is not None], ids=_ids([c for c in BAD_CALLS if c.raw is not None])
)
def test_fake_kernel_rejects_what_the_real_kernel_rejects(case: Bad):
    # Real kernel (C++ on CPU tensors): rejects.
    with pytest.raises((RuntimeError, TypeError, ValueError)):
        getattr(OPS, case.op)(*case.args)
    # Fake kernel: rejects at once, with the wrapper's exception (argument parsing errors are the same in both).
    if case.raw == "kernel":
        with pytest.raises(case.error, match=case.match):
            _fake_call(case.op, case.args)
        if case.meta:
            with pytest.raises(case.error, match=case.match):
                _meta_call(case.op, case.args)
    else:
        with pytest.raises((RuntimeError, TypeError), match=case.arg):
            _fake_call(case.op, case.args)


@dataclasses.dataclass
class BadBackward:
    id: str
    op: str
    args: tuple
    error: type
    match: str
    meta: bool = True


@pytest.mark.requires_cuda
def test_cuda_device_mismatch_and_half_dtypes():
    feats, points, grid = randn(4, 8, 3), rand_points(4), randn(3, 2, 5, 2)
    for op, args in [("trilinear_interpolate", (feats.cuda(), points)), ("grid_interpolate", (grid, points.cuda()))]:
        for fn in (getattr(cuda_ext, op), getattr(reference, op)):
            with pytest.raises(ValueError, match="points and .* must be on the same device"):
                fn(*args)
        with pytest.raises(ValueError, match="must be on the same device"):
            _fake_call(op, args)
    with pytest.raises(ValueError, match="grad_out and x must be on the same device"):
        _fake_call("gelu_backward", (randn(3), randn(3).cuda(), "none"))
    # float16/bfloat16 are accepted on CUDA, by the wrappers and the fake kernels alike.
    for dtype in (torch.float16, torch.bfloat16):
        args = (grid.to("cuda", dtype), points.to("cuda", dtype))
        assert cuda_ext.grid_interpolate(*args).shape == _fake_call("grid_interpolate", args).shape == (4, 2)
        x = randn(1, 2, 3, 4).to("cuda", dtype)
        assert cuda_ext.upsample_bilinear2d(x, 2).dtype == dtype and cuda_ext.gelu(x, "tanh").dtype == dtype


def _backward_cases() -> list[BadBackward]:
    feats, points, grid = randn(4, 8, 3), rand_points(4), randn(3, 2, 5, 2)
    x = randn(3, 4)
    tri, grd, ups, gel = (
        "trilinear_interpolate_backward",
        "grid_interpolate_backward",
        "upsample_bilinear2d_backward",
        "gelu_backward",
    )
    return [
        BadBackward(
            "tri-grad-shape",
            tri,
            (randn(4, 4), feats, points, True, True),
            ValueError,
            r"grad_out must have shape \(4, 3\)",
        ),
        BadBackward(
            "tri-grad-1d",
            tri,
            (randn(12), feats, points, True, False),
            ValueError,
            r"grad_out must have shape \(4, 3\)",
        ),
        BadBackward(
            "tri-grad-dtype",
            tri,
            (randn(4, 3).float(), feats, points, False, True),
            TypeError,
            "grad_out and feats must have the same dtype",
        ),
        BadBackward(
            "tri-points",
            tri,
            (randn(4, 3), feats, randn(4, 2), True, True),
            ValueError,
            r"trilinear_interpolate_backward: points must have shape \(N, 3\)",
        ),
        BadBackward(
            "tri-int",
            tri,
            (randint(4, 3), randint(4, 8, 3), randint(4, 3), True, True),
            TypeError,
            "feats must be float32 or float64",
        ),
        BadBackward(
            "grid-grad-shape",
            grd,
            (randn(4, 3), grid, points, True, True),
            ValueError,
            r"grad_out must have shape \(4, 2\)",
        ),
        BadBackward(
            "grid-grad-rows",
            grd,
            (randn(5, 2), grid, points, True, True),
            ValueError,
            r"grad_out must have shape \(4, 2\)",
        ),
        BadBackward(
            "grid-grad-dtype",
            grd,
            (randn(4, 2).float(), grid, points, True, True),
            TypeError,
            "grad_out and grid must have the same dtype",
        ),
        BadBackward(
            "grid-empty-axis",
            grd,
            (randn(4, 2), randn(3, 0, 5, 2), points, True, True),
            ValueError,
            "grid has an empty axis 1",
        ),
        BadBackward(
            "grid-half-cpu",
            grd,
            (randn(4, 2).half(), grid.half(), points.half(), True, True),
            TypeError,
            "grid must be float32 or float64 on the CPU",
            meta=False,
        ),
        BadBackward(
            "ups-grad-size", ups, (randn(1, 2, 8, 9), 4, 5, 2, False), ValueError, r"grad_out must be \(B, C, 8, 10\)"
        ),
        BadBackward("ups-grad-3d", ups, (randn(2, 8, 10), 4, 5, 2, False), ValueError, "grad_out must be 4-D"),
        BadBackward(
            "ups-negative-size",
            ups,
            (randn(1, 1, 2, 2), -1, 1, 2, False),
            ValueError,
            "input_height and input_width must be >= 0",
        ),
        BadBackward(
            "ups-scale-0", ups, (randn(1, 1, 2, 2), 2, 2, 0, False), ValueError, "scale_factor must be an integer >= 1"
        ),
        BadBackward(
            "ups-int", ups, (randint(1, 1, 4, 4), 2, 2, 2, False), TypeError, "grad_out must be float32 or float64"
        ),
        BadBackward("gelu-grad-shape", gel, (randn(4), x, "none"), ValueError, "grad_out must have the shape of x"),
        BadBackward(
            "gelu-grad-dtype",
            gel,
            (randn(3, 4).float(), x, "tanh"),
            TypeError,
            "grad_out and x must have the same dtype",
        ),
        BadBackward(
            "gelu-approximate", gel, (randn(3, 4), x, "erf"), ValueError, 'approximate must be "none" or "tanh"'
        ),
        BadBackward("gelu-int", gel, (randint(3, 4), randint(3, 4), "none"), TypeError, "x must be float32 or float64"),
        BadBackward(
            "gelu-half-cpu",
            gel,
            (randn(3, 4).half(), x.half(), "none"),
            TypeError,
            "x must be float32 or float64 on the CPU",
            meta=False,
        ),
    ]


BAD_BACKWARD_CALLS = _backward_cases()


@requires_fake_mode
@pytest.mark.parametrize("case", BAD_BACKWARD_CALLS, ids=[c.id for c in BAD_BACKWARD_CALLS])
def test_backward_fake_kernel_rejects_what_the_real_kernel_rejects(case: BadBackward):
    with pytest.raises(RuntimeError):
        getattr(OPS, case.op)(*case.args)
    with pytest.raises(case.error, match=case.match):
        _fake_call(case.op, case.args)
    if case.meta:
        with pytest.raises(case.error, match=case.match):
            _meta_call(case.op, case.args)


def _good_calls():
    grid, points = randn(3, 4, 2, 5), rand_points(6, spread=1.2)
    return [
        ("trilinear_interpolate", (randn(6, 8, 3), points)),
        ("trilinear_interpolate_backward", (randn(6, 3), randn(6, 8, 3), points, True, True)),
        ("grid_interpolate", (grid, points)),
        ("grid_interpolate", (randn(1, 1, 1, 0), rand_points(0))),
        ("grid_interpolate_backward", (randn(6, 5), grid, points, True, False)),
        ("upsample_bilinear2d", (randn(2, 3, 4, 5), 3, True)),
        ("upsample_bilinear2d", (randn(0, 3, 4, 0), 2, False)),
        ("upsample_bilinear2d_backward", (randn(2, 3, 8, 10), 4, 5, 2, False)),
        ("gelu", (randn(3, 4), "tanh")),
        ("gelu", (randn(), "none")),
        ("gelu_backward", (randn(3, 4, seed=5), randn(3, 4), "none")),
    ]


@requires_fake_mode
@pytest.mark.parametrize("op_name,args", _good_calls(), ids=[c[0] for c in _good_calls()])
def test_fake_kernel_accepts_good_calls_with_the_real_shapes(op_name, args):
    real = getattr(OPS, op_name)(*args)
    for fake in (_fake_call(op_name, args), _meta_call(op_name, args)):
        real_t = real if isinstance(real, (tuple, list)) else (real,)
        fake_t = fake if isinstance(fake, (tuple, list)) else (fake,)
        assert [(t.shape, t.dtype) for t in fake_t] == [(t.shape, t.dtype) for t in real_t]


def test_bad_reorder_setting_rejected_by_the_fake_kernel(monkeypatch):
    monkeypatch.setenv("CUDA_EXT_GRID_REORDER", "sometimes")
    args = (randn(3, 3, 3, 2), rand_points(4))
    with pytest.raises(RuntimeError, match="CUDA_EXT_GRID_REORDER"):
        OPS.grid_interpolate(*args)
    with pytest.raises(ValueError, match="CUDA_EXT_GRID_REORDER must be auto, off or always, got 'sometimes'"):
        _meta_call("grid_interpolate", args)


def test_compiled_bad_call_fails_while_tracing_with_the_checks_message():
    """Under torch.compile the fake kernel meets the bad call first: its message reaches the user."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(lambda g, p: OPS.grid_interpolate(g, p), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"points must have shape \(N, 3\), got \(5, 2\)"):
        compiled(randn(3, 4, 2, 5), randn(5, 2))
    torch._dynamo.reset()


def test_compiled_good_calls_with_dynamic_and_data_dependent_sizes():
    """The checks on symbolic sizes: guards for dynamic N, deferred asserts for data-dependent N."""
    import torch._dynamo

    feats, points = randn(9, 8, 3), rand_points(9)
    mask = torch.tensor([True, False, True, True, False, True, True, False, True])

    def pairwise(f, p, m):
        return cuda_ext.trilinear_interpolate(f[m], p[m]) + OPS.trilinear_interpolate(f[m], p[m])

    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
            compiled = torch.compile(pairwise, backend="eager", fullgraph=True, dynamic=True)
            torch.testing.assert_close(compiled(feats, points, mask), pairwise(feats, points, mask))
    finally:
        torch._dynamo.reset()


# -------------------------------------------------------------------------------------- double backward


def _gelu_fn(mode):
    return lambda t: cuda_ext.gelu(t, mode)


@pytest.mark.parametrize("mode", MODES)
def test_gelu_gradcheck_and_gradgradcheck(mode):
    x = randn(4, 5, seed=11).mul(2.5).requires_grad_()
    assert torch.autograd.gradcheck(_gelu_fn(mode), (x,))
    assert torch.autograd.gradgradcheck(_gelu_fn(mode), (x,))


@pytest.mark.parametrize("mode", MODES)
def test_gelu_backward_op_gradcheck_and_gradgradcheck(mode):
    """gelu_backward is differentiable in both inputs, to second order too (third order of gelu)."""
    grad_out = randn(3, 4, seed=12).requires_grad_()
    x = randn(3, 4, seed=13).mul(2).requires_grad_()

    def fn(g, t):
        return OPS.gelu_backward(g, t, mode)

    assert torch.autograd.gradcheck(fn, (grad_out, x))
    assert torch.autograd.gradgradcheck(fn, (grad_out, x))


@pytest.mark.parametrize("mode", MODES)
def test_gelu_second_derivative_matches_f_gelu(mode):
    x = torch.cat([randn(200, seed=14) * 4, torch.tensor([-40.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 40.0], dtype=F64)])
    x.requires_grad_()
    (first,) = torch.autograd.grad(F.gelu(x, approximate=mode).sum(), x, create_graph=True)
    (want,) = torch.autograd.grad(first.sum(), x)
    torch.testing.assert_close(gelu_second_derivative(x.detach(), mode), want, rtol=1e-12, atol=1e-13)
    (first,) = torch.autograd.grad(cuda_ext.gelu(x, mode).sum(), x, create_graph=True)
    (got,) = torch.autograd.grad(first.sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    assert want.abs().max() > 0.1  # not a silent zero


@pytest.mark.parametrize("mode", MODES)
def test_gelu_second_derivative_is_not_silently_zero(mode):
    x = randn(50, seed=15).requires_grad_()
    (first,) = torch.autograd.grad(cuda_ext.gelu(x, mode).sum(), x, create_graph=True)
    assert first.requires_grad
    (second,) = torch.autograd.grad(first.sum(), x)
    assert (second != 0).all()


@pytest.mark.parametrize("s,align", [(2, False), (3, True)])
def test_upsample_gradcheck_and_gradgradcheck(s, align):
    x = randn(1, 2, 3, 4, seed=16).requires_grad_()

    def fn(t):
        return cuda_ext.upsample_bilinear2d(t, s, align)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


def test_upsample_double_backward_matches_reference():
    """The second-order term of the linear op, through a nonlinearity: the same as F.interpolate's."""
    x = randn(2, 2, 3, 4, seed=17).requires_grad_()

    def penalty_grad(fn):
        y = torch.tanh(fn(x, 2, True)).pow(3).sum()
        (g,) = torch.autograd.grad(y, x, create_graph=True)
        (gg,) = torch.autograd.grad(g.pow(2).sum(), x)
        return gg

    want = penalty_grad(reference.upsample_bilinear2d)
    torch.testing.assert_close(penalty_grad(cuda_ext.upsample_bilinear2d), want, rtol=1e-12, atol=1e-12)
    assert want.abs().max() > 1e-3


def _no_double_backward_calls():
    grid, points = randn(3, 4, 2, 5, seed=18), rand_points(6, seed=19)
    feats = randn(6, 8, 5, seed=20)
    return [
        ("trilinear_interpolate", cuda_ext.trilinear_interpolate, (feats, points)),
        ("grid_interpolate", cuda_ext.grid_interpolate, (grid, points)),
        ("gelu_rows", cuda_ext.gelu_rows, (randn(6, 5, seed=21), randn(3, 5, seed=22), torch.arange(6) // 2)),
    ]


@pytest.mark.parametrize("which", [0, 1], ids=["wrt-values", "wrt-points"])
@pytest.mark.parametrize("name,fn,args", _no_double_backward_calls(), ids=[c[0] for c in _no_double_backward_calls()])
def test_ops_without_double_backward_refuse_create_graph(name, fn, args, which):
    inputs = [a.detach().clone() for a in args]
    inputs[which].requires_grad_()
    out = fn(*inputs)
    with pytest.raises(RuntimeError, match=f"{name}: double backward"):
        torch.autograd.grad(out.sum(), inputs[which], create_graph=True)
    # Without create_graph the same first derivative works.
    out = fn(*inputs)
    (grad,) = torch.autograd.grad(out.sum(), inputs[which])
    assert grad.shape == inputs[which].shape and grad.abs().sum() > 0


def _mlp_params(seed=21):
    gen = torch.Generator().manual_seed(seed)
    sizes = [(4, 16), (16, 16), (16, 1)]
    params = []
    for a, b in sizes:
        params += [torch.randn(b, a, generator=gen, dtype=F64) / math.sqrt(a), torch.randn(b, generator=gen, dtype=F64)]
    return [p.requires_grad_() for p in params]


def _gradient_penalty_grads(act, x, params):
    """d/d(params, x) of ||d/dx MLP(x)||^2, MLP = Linear-act-Linear-act-Linear (not the last bias: no effect)."""
    x = x.detach().requires_grad_()
    h = x
    for i in range(0, len(params), 2):
        h = F.linear(h, params[i], params[i + 1])
        if i + 2 < len(params):
            h = act(h)
    (dx,) = torch.autograd.grad(h.sum(), x, create_graph=True)
    penalty = dx.pow(2).sum()
    return torch.autograd.grad(penalty, [*params[:-1], x])


@pytest.mark.parametrize("mode", MODES)
def test_gradient_penalty_through_gelu_mlp_matches_f_gelu(mode):
    x = randn(10, 4, seed=22) * 1.5
    params = _mlp_params()
    got = _gradient_penalty_grads(lambda t: cuda_ext.gelu(t, mode), x, params)
    want = _gradient_penalty_grads(lambda t: F.gelu(t, approximate=mode), x, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert all(b.abs().max() > 1e-4 for b in want)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_gelu_gradcheck_gradgradcheck_and_penalty(mode):
    x = randn(4, 5, seed=23).mul(2.5).cuda().requires_grad_()
    assert torch.autograd.gradcheck(_gelu_fn(mode), (x,))
    assert torch.autograd.gradgradcheck(_gelu_fn(mode), (x,))
    params = [p.detach().cuda().requires_grad_() for p in _mlp_params()]
    xc = (randn(10, 4, seed=22) * 1.5).cuda()
    got = _gradient_penalty_grads(lambda t: cuda_ext.gelu(t, mode), xc, params)
    want = _gradient_penalty_grads(lambda t: F.gelu(t, approximate=mode), xc, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.requires_cuda
def test_cuda_upsample_gradgradcheck():
    x = randn(1, 2, 3, 4, seed=24).cuda().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda t: cuda_ext.upsample_bilinear2d(t, 2, True), (x,))


# ------------------------------------------------------------------------------------- non-finite points

NAN, INF = float("nan"), float("inf")
NON_FINITE_GRIDS = [(3, 4, 5, 2), (1, 4, 5, 3), (2, 1, 1, 3), (1, 1, 1, 1), (4, 3, 2, 0)]


def _non_finite_points(dtype, seed=25):
    """12 points: for each of NaN, +inf, -inf one point per axis with that coordinate; 3 finite points."""
    points = rand_points(12, dtype=dtype, seed=seed, spread=1.2)
    for i, value in enumerate([NAN, INF, -INF]):
        for axis in range(3):
            points[3 * i + axis, axis] = value
    return points


def _value_and_grads(fn, grid, points, grad_out):
    grid = grid.detach().requires_grad_()
    points = points.detach().requires_grad_()
    out = fn(grid, points)
    grad_grid, grad_points = torch.autograd.grad(out, (grid, points), grad_out)
    return out.detach(), grad_grid, grad_points


@pytest.mark.parametrize("sizes", NON_FINITE_GRIDS, ids=str)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_non_finite_points_agree_between_backends(sizes, dtype, tol):
    grid = randn(*sizes, dtype=dtype, seed=26)
    points = _non_finite_points(dtype)
    grad_out = randn(12, sizes[3], dtype=dtype, seed=27)
    got = _value_and_grads(cuda_ext.grid_interpolate, grid, points, grad_out)
    want = _value_and_grads(reference.grid_interpolate, grid, points, grad_out)  # used to raise IndexError
    out = got[0]
    assert out.shape == (12, sizes[3])
    assert torch.equal(out.isnan(), want[0].isnan())
    torch.testing.assert_close(out, want[0], rtol=tol, atol=tol, equal_nan=True)
    # NaN coordinate: a NaN row. +-inf: the border, i.e. the row of the coordinate +-1, except along an
    # axis with one voxel, where (point + 1) / 2 * 0 is NaN.
    if sizes[3] > 0:
        assert out[0:3].isnan().all()
        for i, (_value, border) in enumerate([(INF, 1.0), (-INF, -1.0)]):
            for axis in range(3):
                row = 3 + 3 * i + axis
                if sizes[axis] == 1:
                    assert out[row].isnan().all()
                else:
                    clamped = points[row : row + 1].clone()
                    clamped[0, axis] = border
                    for fn in (cuda_ext.grid_interpolate, reference.grid_interpolate):
                        assert torch.equal(fn(grid, clamped)[0], fn(grid, points[row : row + 1])[0])
                    assert torch.isfinite(out[row]).all()
        assert torch.isfinite(out[9:]).all()
    # The backward runs on both (no crash, no out-of-range index). The grid gradients agree (NaN at the
    # voxels a NaN row reads); the points gradients agree on finite rows and are NaN on NaN rows (the kernel
    # multiplies the NaN by the clamp's zero slope too, the reference's clamp drops it: not compared there).
    for got_grad, want_grad, like in zip(got[1:], want[1:], (grid, points)):
        assert got_grad.shape == like.shape and want_grad.shape == like.shape
    assert torch.isfinite(got[2][9:]).all() and torch.isfinite(want[2][9:]).all()
    if sizes[3] > 0:
        torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol, equal_nan=True)
        assert got[1].isnan().any()
        finite_rows = torch.isfinite(out).all(dim=1)
        torch.testing.assert_close(got[2][finite_rows], want[2][finite_rows], rtol=tol, atol=tol)
        # the kernel's points gradient is NaN on every non-finite row; the reference's depends on the torch version
        # (torch 2.14's autograd gives a finite one on some rows where 2.13 gave NaN), so only ours is held to it
        assert got[2][~finite_rows].isnan().any(dim=1).all()


@pytest.mark.requires_cuda
@pytest.mark.parametrize("sizes", NON_FINITE_GRIDS, ids=str)
def test_cuda_non_finite_points_agree_with_cpu(sizes):
    grid = randn(*sizes, dtype=torch.float32, seed=28)
    points = _non_finite_points(torch.float32)
    want = cuda_ext.grid_interpolate(grid, points)
    for fn in (cuda_ext.grid_interpolate, reference.grid_interpolate):
        got = fn(grid.cuda(), points.cuda()).cpu()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.equal(got.isnan(), want.isnan())


# ------------------------------------------------------------------------------------------------ opcheck


def _opcheck_calls():
    grid = randn(3, 4, 2, 5, seed=29)
    points = rand_points(6, seed=30, spread=0.9)
    feats = randn(6, 8, 3, seed=31)
    x4 = randn(2, 3, 4, 5, seed=32)
    x = randn(3, 4, seed=33)
    return [
        ("trilinear_interpolate", lambda: (feats.clone().requires_grad_(), points.clone().requires_grad_())),
        ("trilinear_interpolate_backward", lambda: (randn(6, 3, seed=34), feats, points, True, True)),
        ("grid_interpolate", lambda: (grid.clone().requires_grad_(), points.clone().requires_grad_())),
        ("grid_interpolate_backward", lambda: (randn(6, 5, seed=35), grid, points, True, True)),
        ("upsample_bilinear2d", lambda: (x4.clone().requires_grad_(), 2, True)),
        ("upsample_bilinear2d_backward", lambda: (randn(2, 3, 12, 15, seed=36).requires_grad_(), 4, 5, 3, False)),
        ("gelu", lambda: (x.clone().requires_grad_(), "tanh")),
        ("gelu", lambda: (x.clone().requires_grad_(), "none")),
        ("gelu_backward", lambda: (randn(3, 4, seed=37).requires_grad_(), x.clone().requires_grad_(), "tanh")),
        ("gelu_backward", lambda: (randn(3, 4, seed=37).requires_grad_(), x.clone().requires_grad_(), "none")),
    ]


@requires_opcheck
@pytest.mark.parametrize("op_name,make_args", _opcheck_calls(), ids=[c[0] for c in _opcheck_calls()])
def test_opcheck(op_name, make_args):
    torch.library.opcheck(getattr(OPS, op_name).default, make_args())
