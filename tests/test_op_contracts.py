"""Bad calls of every cuda_ext op, whichever backend runs it (issue 14, part 3): the public wrappers and the
pure-PyTorch references reject each bad call with the same exception type (ValueError / TypeError, never a C++
RuntimeError) and a message that names the argument; the raw op (torch.ops.cuda_ext.X on CPU tensors, the C++
TORCH_CHECK backstop) rejects it too. Their fake (meta) kernels: tests/test_fake_kernels.py; double backward:
tests/test_double_backward.py; non-finite points: tests/test_non_finite_points.py.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

import cuda_ext
from cuda_ext import reference

OPS = torch.ops.cuda_ext
F64 = torch.float64


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
