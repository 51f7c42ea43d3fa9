"""The ops' fake (meta) kernels and opcheck (issue 14, part 3): under FakeTensorMode and on the "meta" device a
fake kernel rejects every bad call the real kernel rejects (tests/test_op_contracts.py's cases, and the backward
ops' own), with the wrapper's exception; it accepts good calls with the real outputs' shapes, also under
torch.compile; and torch.library.opcheck passes for every op, where this torch has it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_op_contracts import BAD_CALLS, Bad, _ids, rand_points, randint, randn

import cuda_ext
from cuda_ext import reference

OPS = torch.ops.cuda_ext

try:
    from torch._subclasses.fake_tensor import FakeTensorMode
except ImportError:  # pragma: no cover - every torch >= 2.4 has it
    FakeTensorMode = None

requires_fake_mode = pytest.mark.skipif(FakeTensorMode is None, reason="this torch has no FakeTensorMode")
requires_opcheck = pytest.mark.skipif(not hasattr(torch.library, "opcheck"), reason="this torch has no opcheck")


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
