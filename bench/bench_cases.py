"""The op benchmark's cases: sizes, inputs, and for each op the variants it times (bench_ops.py runs them)."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

DTYPE = torch.float32
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Sizes:
    trilinear: tuple[int, int]  # N points, F features
    grid_interpolate: tuple[int, int, int]  # R (cube side), C channels, N points
    samples_per_ray: int  # "rays" distribution: N / samples_per_ray rays
    upsample: tuple[int, int, int, int]  # B, C, H, W (scale 2)
    gelu: int  # elements
    copy_bytes: int  # size of the bandwidth-reference copy
    volume_render: tuple[int, ...] = (8192,)  # B rays per case (30-60 samples each; bench_render_cases.py)
    # V0, V1, V2 vertices, brick B, N points (bench_brick_cases.py); full: the model's fine grid
    brick_grid: tuple[int, int, int, int, int] = (64, 112, 80, 8, 65536)


SIZES = {
    # full: a training step's 8192 rays (launch- and Python-bound), 16x that, and a 1024x1024 render's 1M rays,
    # where the kernels' time outweighs the call's host overhead (~0.1 ms) and the bandwidth targets apply
    "full": Sizes(
        (262144, 256),
        (160, 12, 4096 * 1024),
        1024,
        (8, 64, 256, 256),
        1 << 28,
        1 << 30,
        (8192, 131072, 1 << 20),
        (500, 870, 600, 8, 1 << 20),
    ),
    "small": Sizes((32768, 64), (64, 12, 192 * 1024), 1024, (2, 16, 128, 128), 1 << 22, 1 << 28, (2048,)),
    "tiny": Sizes((512, 16), (12, 4, 64 * 64), 64, (1, 2, 16, 16), 1 << 14, 1 << 22, (64,), (20, 28, 24, 4, 2048)),
}

COUNTING_RULES = {
    "general": "bytes floor: each input read once, each output written once (fp32 = 4 B); fwbw counts both passes; "
    "GB/s = bytes / time; % copy = GB/s over the copy bandwidth of this run (a device-to-device copy, read + write)",
    "trilinear": "fw: feats + points + out; bw with grad=feats: grad_out + points + grad_feats; "
    "grad=feats+points adds feats + grad_points",
    "grid_interpolate": "compulsory bytes only: fw: grid once + points + out; "
    "bw (grad=grid): grad_out + points + grad_grid once; random gathers and scattered atomics move more than this",
    "upsample": "fw: in + out; bw: grad_out + grad_in",
    "gelu": "fw: in + out; bw: grad_out + x + grad_x",
    "gelu_rows": "fw: x + out + rows once + index; "
    "bw (the op alone): grad_out + x + grad_x + index + rows and their summed gradient once",
    "bw_ms": "the backward op timed alone where the custom op has one (marked * in the table), else fwbw - fw",
    "builtin": "F.grid_sample gets its (1,C,R0,R1,R2) grid and flipped (1,N,1,1,3) points made once outside the timing",
}


# ----------------------------------------------------------------------------------------------- ops


class Ops:
    """The three implementations; attributes are looked up at call time, so patched or rebuilt ops are seen."""

    def __init__(self) -> None:
        if str(REPO) not in sys.path:
            sys.path.append(str(REPO))
        try:
            import cuda_ext

            self.ext: Any = cuda_ext
            self.reference: Any = cuda_ext.reference
            self.import_error: Optional[str] = None
        except Exception as exc:  # extension not built: the references still load, from their file
            spec = importlib.util.spec_from_file_location("cuda_ext_reference", REPO / "cuda_ext" / "reference.py")
            self.reference = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(self.reference)
            self.ext, self.import_error = None, f"{type(exc).__name__}: {exc}"

    def custom(self, name: str, *extra: Any) -> Callable[..., torch.Tensor]:
        def call(*args: torch.Tensor) -> torch.Tensor:
            if self.ext is None:
                raise RuntimeError(f"cuda_ext did not import: {self.import_error}")
            return getattr(self.ext, name)(*args, *extra)

        return call

    def custom_with_env(self, name: str, **env: str) -> Callable[..., torch.Tensor]:
        """The custom op called with environment variables set for the call (read by the C++ side)."""
        call = self.custom(name)

        def with_env(*args: torch.Tensor) -> torch.Tensor:
            saved = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            try:
                return call(*args)
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value

        return with_env

    def ref(self, name: str, *extra: Any) -> Callable[..., torch.Tensor]:
        return lambda *args: getattr(self.reference, name)(*args, *extra)

    def backward_op(self, name: str) -> Callable[..., Any]:
        return lambda *args: getattr(torch.ops.cuda_ext, f"{name}_backward")(*args)


# ----------------------------------------------------------------------------------------------- inputs


def uniform_points(n: int, gen: torch.Generator) -> torch.Tensor:
    """(n, 3) points uniform in [-1, 1]^3: the worst case for a grid lookup's caches."""
    return torch.rand(n, 3, generator=gen, device=gen.device, dtype=DTYPE) * 2 - 1


def ray_points(n_rays: int, samples: int, gen: torch.Generator) -> torch.Tensor:
    """(n_rays * samples, 3) points sorted along rays, ray-major, as a NeRF sampler makes them.

    Origins are uniform on the sphere of radius 1.5; each ray aims at a random point of [-0.5, 0.5]^3
    (a camera looking at the centre); samples are evenly spaced over the ray's segment inside [-1, 1]^3.
    """
    kw = dict(generator=gen, device=gen.device, dtype=DTYPE)
    origin = torch.randn(n_rays, 3, **kw)
    origin = 1.5 * origin / origin.norm(dim=1, keepdim=True)
    direction = F.normalize(torch.rand(n_rays, 3, **kw) - 0.5 - origin, dim=1)
    t_a, t_b = (-1 - origin) / direction, (1 - origin) / direction  # slab test against the box
    t_near = torch.minimum(t_a, t_b).amax(dim=1).clamp(min=0)  # origins inside the box start at t=0
    t_far = torch.maximum(t_a, t_b).amin(dim=1)
    frac = (torch.arange(samples, device=gen.device, dtype=DTYPE) + 0.5) / samples
    t = t_near[:, None] + (t_far - t_near)[:, None] * frac
    points = origin[:, None, :] + t[..., None] * direction[:, None, :]
    return points.reshape(-1, 3).clamp(-1, 1).contiguous()


# ----------------------------------------------------------------------------------------------- cases


def _identity(x: Any) -> Any:
    return x


@dataclass
class Variant:
    """One implementation of a case, with its layout glue (done once, outside the timing)."""

    call: Callable[..., torch.Tensor]  # call(*args) -> output
    adapt: Callable[[tuple], tuple] = _identity  # canonical inputs -> this variant's args, same order
    out_to_canonical: Callable[[torch.Tensor], torch.Tensor] = _identity  # for the check against the reference
    grad_from_canonical: Callable[[torch.Tensor], torch.Tensor] = _identity


@dataclass
class Case:
    op: str
    name: str  # short key, e.g. "random" or "grad=feats"
    shape: str  # the sizes, for people
    make_inputs: Callable[[torch.Generator], tuple]  # one random input set, canonical layout
    out_shape: tuple[int, ...]
    grad_inputs: tuple[bool, ...]  # which inputs get gradients in forward+backward
    variants: dict[str, Variant]
    custom_backward: Optional[Callable[[torch.Tensor, tuple], Any]]  # the custom backward op alone: (grad_out, inputs)
    bytes_fw: int
    bytes_bw: int


def trilinear_cases(s: Sizes, ops: Ops) -> list[Case]:
    n, f = s.trilinear
    e = DTYPE.itemsize
    variants = {
        "custom": Variant(ops.custom("trilinear_interpolate")),
        "reference": Variant(ops.ref("trilinear_interpolate")),
    }

    def make(gen: torch.Generator) -> tuple:
        return torch.randn(n, 8, f, generator=gen, device=gen.device, dtype=DTYPE), uniform_points(n, gen)

    def case(grad_points: bool) -> Case:
        backward = ops.backward_op("trilinear_interpolate")
        extra = (8 * n * f + 3 * n) * e if grad_points else 0
        return Case(
            "trilinear",
            "grad=feats+points" if grad_points else "grad=feats",
            f"N={n} F={f}",
            make,
            (n, f),
            (True, grad_points),
            variants,
            lambda g, x: backward(g, x[0], x[1], True, grad_points),
            bytes_fw=(8 * n * f + 3 * n + n * f) * e,
            bytes_bw=(n * f + 3 * n + 8 * n * f) * e + extra,
        )

    return [case(False), case(True)]


def grid_cases(s: Sizes, ops: Ops, channels: Optional[int] = None) -> list[Case]:
    """The random and rays cases at the size's channel count, or at `channels` (case names then say C=...)."""
    r, c, n = s.grid_interpolate
    suffix = "" if channels is None or channels == c else f" C={channels}"
    c = c if channels is None else channels
    e = DTYPE.itemsize
    builtin = Variant(
        lambda grid5, points5: F.grid_sample(
            grid5, points5, mode="bilinear", padding_mode="border", align_corners=True
        ),
        adapt=lambda x: (x[0].permute(3, 0, 1, 2)[None].contiguous(), x[1].flip(-1).reshape(1, -1, 1, 1, 3)),
        out_to_canonical=lambda out: out.reshape(c, -1).t(),
        grad_from_canonical=lambda g: g.t().reshape(1, c, -1, 1, 1).contiguous(),
    )
    variants = {
        "custom": Variant(ops.custom("grid_interpolate")),
        "custom-in-order": Variant(ops.custom_with_env("grid_interpolate", CUDA_EXT_GRID_REORDER="off")),
        "reference": Variant(ops.ref("grid_interpolate")),
        "builtin": builtin,
    }
    backward = ops.backward_op("grid_interpolate")
    distributions = {
        "random": lambda gen: uniform_points(n, gen),
        "rays": lambda gen: ray_points(n // s.samples_per_ray, s.samples_per_ray, gen),
    }

    def case(name: str, points: Callable[[torch.Generator], torch.Tensor]) -> Case:
        def make(gen: torch.Generator) -> tuple:
            return torch.randn(r, r, r, c, generator=gen, device=gen.device, dtype=DTYPE), points(gen)

        rays = f" ({n // s.samples_per_ray} rays x {s.samples_per_ray})" if name == "rays" else ""
        shape = f"{r}^3x{c} N={n}{rays}"
        return Case(
            "grid_interpolate",
            name,
            shape,
            make,
            (n, c),
            (True, False),
            variants,
            lambda g, x: backward(g, x[0], x[1], True, False),
            bytes_fw=(r**3 * c + 3 * n + n * c) * e,
            bytes_bw=(n * c + 3 * n + r**3 * c) * e,
        )

    return [case(name + suffix, points) for name, points in distributions.items()]


def upsample_cases(s: Sizes, ops: Ops) -> list[Case]:
    b, c, h, w = s.upsample
    scale, elems = 2, b * c * h * w
    backward = ops.backward_op("upsample_bilinear2d")
    variants = {
        "custom": Variant(ops.custom("upsample_bilinear2d", scale, False)),
        "reference": Variant(ops.ref("upsample_bilinear2d", scale, False)),
        "builtin": Variant(lambda x: F.interpolate(x, scale_factor=scale, mode="bilinear", align_corners=False)),
    }
    total = (elems + scale * scale * elems) * DTYPE.itemsize
    return [
        Case(
            "upsample",
            f"x{scale}",
            f"({b},{c},{h},{w})",
            lambda gen: (torch.randn(b, c, h, w, generator=gen, device=gen.device, dtype=DTYPE),),
            (b, c, h * scale, w * scale),
            (True,),
            variants,
            lambda g, x: backward(g, h, w, scale, False),
            bytes_fw=total,
            bytes_bw=total,
        )
    ]


def gelu_cases(s: Sizes, ops: Ops) -> list[Case]:
    n = s.gelu
    backward = ops.backward_op("gelu")
    variants = {
        "custom": Variant(ops.custom("gelu", "none")),
        "reference": Variant(ops.ref("gelu", "none")),
        "builtin": Variant(lambda x: F.gelu(x, approximate="none")),
    }
    return [
        Case(
            "gelu",
            "exact",
            f"2^{int(math.log2(n))}" if n & (n - 1) == 0 else f"N={n}",
            lambda gen: (torch.randn(n, generator=gen, device=gen.device, dtype=DTYPE),),
            (n,),
            (True,),
            variants,
            lambda g, x: backward(g, x[0], "none"),
            bytes_fw=2 * n * DTYPE.itemsize,
            bytes_bw=3 * n * DTYPE.itemsize,
        )
    ]


def gelu_rows_cases(s: Sizes, ops: Ops) -> list[Case]:
    """The decoder's first activation, gelu(x + rows[index]): (N, 256) samples, ~32 a ray, rows per ray."""
    width = 256
    n = max(1, s.gelu // width)
    count = max(1, n // 32)
    e = DTYPE.itemsize
    backward = ops.backward_op("gelu_rows")

    def make(gen: torch.Generator) -> tuple:
        x = torch.randn(n, width, generator=gen, device=gen.device, dtype=DTYPE)
        rows = torch.randn(count, width, generator=gen, device=gen.device, dtype=DTYPE)
        index = torch.randint(count, (n,), generator=gen, device=gen.device).sort().values
        return x, rows, index

    variants = {
        "custom": Variant(ops.custom("gelu_rows", "none")),
        "reference": Variant(ops.ref("gelu_rows", "none")),
        "builtin": Variant(lambda x, rows, index: F.gelu(x + rows[index], approximate="none")),
    }
    return [
        Case(
            "gelu_rows",
            "exact",
            f"N={n} x {width}, {count} rows",
            make,
            (n, width),
            (True, True, False),
            variants,
            lambda g, x: backward(g, x[0], x[1], x[2], "none"),
            bytes_fw=2 * n * width * e + count * width * e + 8 * n,
            bytes_bw=3 * n * width * e + 2 * count * width * e + 8 * n,
        )
    ]


CASE_BUILDERS = {
    "trilinear": trilinear_cases,
    "grid_interpolate": grid_cases,
    "upsample": upsample_cases,
    "gelu": gelu_cases,
    "gelu_rows": gelu_rows_cases,
}


# ----------------------------------------------------------------------------------------------- timing
