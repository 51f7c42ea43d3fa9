"""Deferred shading: composited per-pixel features + view direction -> RGB.

Design (why): the first 3 feature channels are a diffuse colour, squashed per sample with a sigmoid and
composited volumetrically like DirectVoxGO's direct-RGB grid, so most of the appearance is learnt by the grid
at grid learning rates and is exact under alpha compositing. The small MLP (``ops.gelu`` activations) only
adds a view-dependent residual from the remaining composited features, the composited diffuse colour and a
low-frequency direction encoding (spherical harmonics or a few sine frequencies: high frequencies in the
direction over-fit the training views). Running the MLP once per pixel after compositing (as SNeRG does)
rather than once per sample makes it cheap, and allows decoding at a higher resolution than the rays were
marched at (features are upsampled bilinearly in between). The residual's last layer starts at zero, so the
decoder starts as the identity on the diffuse colour.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from models.appearance import Appearance
from models.ops import OpSet

DIFFUSE_CHANNELS = 3

_SH_C0 = 0.28209479177387814
_SH_C1 = 0.4886025119029199
_SH_C2 = (1.0925484305920792, -1.0925484305920792, 0.31539156525252005, -1.0925484305920792, 0.5462742152960396)
_SH_C3 = (
    -0.5900435899266435,
    2.890611442640554,
    -0.4570457994644658,
    0.3731763325901154,
    -0.4570457994644658,
    1.445305721320277,
    -0.5900435899266435,
)


def spherical_harmonics(directions: torch.Tensor, degree: int) -> torch.Tensor:
    """Real SH basis of degree 0..3 at (N, 3) unit directions -> (N, (degree + 1)**2)."""
    x, y, z = directions.unbind(-1)
    terms = [torch.full_like(x, _SH_C0)]
    if degree >= 1:
        terms += [-_SH_C1 * y, _SH_C1 * z, -_SH_C1 * x]
    if degree >= 2:
        xx, yy, zz = x * x, y * y, z * z
        terms += [
            _SH_C2[0] * x * y,
            _SH_C2[1] * y * z,
            _SH_C2[2] * (2 * zz - xx - yy),
            _SH_C2[3] * x * z,
            _SH_C2[4] * (xx - yy),
        ]
    if degree >= 3:
        terms += [
            _SH_C3[0] * y * (3 * xx - yy),
            _SH_C3[1] * x * y * z,
            _SH_C3[2] * y * (4 * zz - xx - yy),
            _SH_C3[3] * z * (2 * zz - 3 * xx - 3 * yy),
            _SH_C3[4] * x * (4 * zz - xx - yy),
            _SH_C3[5] * z * (xx - yy),
            _SH_C3[6] * x * (xx - 3 * yy),
        ]
    return torch.stack(terms, dim=-1)


def positional_encoding(directions: torch.Tensor, frequencies: int) -> torch.Tensor:
    """(N, 3) -> (N, 3 + 6 * frequencies): the input, then sin and cos of 2^k * pi * input for k < frequencies."""
    parts = [directions]
    for k in range(frequencies):
        scaled = directions * (math.pi * 2.0**k)
        parts += [torch.sin(scaled), torch.cos(scaled)]
    return torch.cat(parts, dim=-1)


class DirectionEncoding(nn.Module):
    """'none' (no direction input), 'sh<d>' (SH of degree d <= 3) or 'pe<n>' (n sine frequencies)."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        if name == "none":
            self.dim = 0
        elif name.startswith("sh"):
            self.dim = (int(name[2:]) + 1) ** 2
        elif name.startswith("pe"):
            self.dim = 3 + 6 * int(name[2:])
        else:
            raise ValueError(f"model.dir_encoding: unknown encoding {name!r} (expected none, sh<0-3> or pe<n>)")

    def forward(self, directions: torch.Tensor) -> torch.Tensor:
        if self.name == "none":
            return directions.new_zeros(directions.shape[0], 0)
        if self.name.startswith("sh"):
            return spherical_harmonics(directions, int(self.name[2:]))
        return positional_encoding(directions, int(self.name[2:]))


def padded_rows(count: int) -> int:
    """``count`` rounded up to one of 64 sizes per power of two (at most 1.6% more; 64 and less unchanged). The
    per-sample decoder's row count changes every step; cuBLAS picks a GEMM's kernel per shape, which cost ~0.15-0.35
    ms of host time a GEMM for a new shape on an H100 host against ~25 us for a repeated one (2026-11-27), about
    a dozen GEMMs a step: padded, the shapes repeat."""
    if count <= 64:
        return count
    unit = 1 << (count.bit_length() - 7)
    return -(-count // unit) * unit


def linear_aligned(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``nn.functional.linear(x (N, K), weight (M, K), bias (M,)) -> (N, M)`` whose GEMMs have 16-byte rows on CUDA:
    K and M padded with zeros to multiples of 8, the padded outputs cut off (the same values). cuBLAS runs a
    bf16 GEMM with a row of 3 or 21 elements on its slow unaligned kernels: the decoder's last layer (M = 3)
    and the per-ray direction encoding (K = 21) took ~1.2 ms of an 11 ms lego step on an H100 (2026-11-27), and
    12 (the per-sample features) on kernels for 4-byte alignment."""
    if not x.is_cuda:
        return nn.functional.linear(x, weight, bias)
    k_pad, m_pad = -x.shape[1] % 8, -weight.shape[0] % 8
    if k_pad:
        x, weight = nn.functional.pad(x, (0, k_pad)), nn.functional.pad(weight, (0, k_pad))
    if m_pad:
        weight = nn.functional.pad(weight, (0, 0, 0, m_pad))
        bias = None if bias is None else nn.functional.pad(bias, (0, m_pad))
    out = nn.functional.linear(x, weight, bias)
    return out[:, : out.shape[1] - m_pad] if m_pad else out


class _ShadingMLP(nn.Module):
    """The MLP both decoders share: GELU layers (``ops.gelu``) and a last layer that starts at zero, so a
    decoder starts as the identity on the diffuse colour. Subclasses say what goes in and how it is used."""

    def __init__(
        self,
        inputs: int,
        hidden: int,
        layers: int,
        dir_encoding: str,
        gelu_approximate: str,
        ops: OpSet,
        precision: str = "float32",
        appearance: str = "none",
        appearance_dim: int = 16,
    ):
        super().__init__()
        self.ops = ops
        # per-image appearance (models/appearance.py): its parameters are the decoder's; an embedding is one more
        # MLP input, an affine transform acts on the decoded colour
        self.appearance = Appearance(appearance, appearance_dim)
        # "bfloat16": the layers run under CUDA autocast (bf16 tensor cores, half the activation traffic; the
        # weights, their gradients and the output stay float32); on the CPU the MLP stays float32
        self.precision = precision
        self.gelu_approximate = gelu_approximate
        self.encoding = DirectionEncoding(dir_encoding)
        widths = [inputs + self.encoding.dim + self.appearance.embedding_dim] + [hidden] * layers
        self.hidden = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.out = nn.Linear(widths[-1], 3)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def residual(
        self,
        inputs: list[torch.Tensor],
        directions: torch.Tensor,
        image_index: torch.Tensor | None = None,
        ray: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-row inputs [(N, C_i)] (their widths sum to ``inputs``), (B, 3) unit directions, optional (B,) int64
        training-image indices, and ``ray``: (N,) int64 row -> direction row, or None when N == B -> (N, 3) (float32
        under bfloat16 autocast, else the inputs' dtype).

        The first layer is split by its input columns: what depends only on the ray (the direction encoding and
        the image's code) goes through its columns once per ray, each per-row input through its own columns
        (:func:`linear_aligned`), and the two meet inside the first GELU (``ops.gelu_rows``: gelu(per_row +
        per_ray[ray]), no (N, H) gathered tensor; without a hidden layer the rows are gathered, :func:`gather_rows`).
        The same function as the layer on the concatenated inputs, without building that (N, C) concatenation
        (the profile's largest cost of a render) or encoding each sample's direction again."""
        if ray is not None:  # samples: a varying count, padded to few sizes (padded_rows), the pad's output dropped
            count, rows = ray.shape[0], padded_rows(ray.shape[0])
            if rows > count:
                padded = [nn.functional.pad(part, (0, 0, 0, rows - count)) for part in inputs]
                ray = nn.functional.pad(ray, (0, rows - count))  # ray 0: any valid row, its samples' output is cut
                return self.residual(padded, directions, image_index, ray)[:count]
        codes = self.appearance.codes(image_index, directions.shape[0])
        per_ray = self.encoding(directions)
        per_ray = per_ray if codes is None else torch.cat([per_ray, codes], dim=-1)
        first, *rest = [*self.hidden, self.out]
        width = sum(part.shape[1] for part in inputs)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.precision == "bfloat16" and per_ray.is_cuda):
            # the first bias as the weight of a column of ones: its gradient comes out of the weight's GEMM, where a
            # column sum over the (B, H) gradient cost ~0.08 ms a step on an H200 (bench/decoder_profile.py)
            with_ones = nn.functional.pad(per_ray, (0, 1), value=1.0)
            x = linear_aligned(with_ones, torch.cat([first.weight[:, width:], first.bias[:, None]], 1))  # (B, H)
            fused = ray is not None and len(rest) > 0 and len(inputs) > 0  # gathered in the first GELU
            x = x if ray is None or fused else gather_rows(x, ray)
            per_row, start = None, 0
            for part in inputs:  # (N, C_i) through its columns: a 12-channel part's bf16 rows are 24 bytes (padded)
                term = linear_aligned(part, first.weight[:, start : start + part.shape[1]])
                if fused:
                    per_row = term if per_row is None else per_row + term
                else:
                    x = x + term
                start += part.shape[1]
            if fused:  # gelu(per_row + x[ray]) with no (N, H) gathered tensor in between
                x = self.ops.gelu_rows(per_row, x.to(per_row.dtype), ray, self.gelu_approximate)
            else:
                x = self.ops.gelu(x, self.gelu_approximate) if rest else x
            for i, layer in enumerate(rest):
                x = linear_aligned(self.ops.gelu(x, self.gelu_approximate) if i else x, layer.weight, layer.bias)
            return x.float() if x.dtype == torch.bfloat16 else x  # autocast's bf16 back to float32


class _GatherRows(torch.autograd.Function):
    """``values[index]`` whose backward sums each output row's gradient into its source row in float32 (bfloat16
    atomics would round every one of a ray's ~10-50 samples' additions)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = values.shape[0]
        return values.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        summed = grad.new_zeros(ctx.rows, grad.shape[1], dtype=torch.float32)
        return summed.index_add_(0, index, grad.float()).to(grad.dtype), None


def gather_rows(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, H) values, (N,) int64 rows -> (N, H) ``values[index]``; the gradient accumulates in float32."""
    return _GatherRows.apply(values, index)


class SampleDecoder(_ShadingMLP):
    """Per-sample shading (DirectVoxGO / TensoRF style), applied before compositing.

    forward(features (N,F), directions (B,3) unit per ray, ray (N,) int64 sample -> ray (None: N == B),
    image_index (B,) per ray or None) -> (N,3) colour:
    ``sigmoid(features[:, :3] + mlp(features, encoding(direction[ray])))`` (in (0,1); the image's code is an MLP
    input with ``model.appearance=embedding``; an ``affine`` transform is applied by the model to the composited
    pixel, ``A c + opacity * b``, which equals transforming every sample since compositing is linear, without a
    per-sample gather of the table and its contended scatter-add in the backward). The direction and the code
    enter once per ray (``_ShadingMLP.residual``). The first 3 channels stay a diffuse colour logit (the residual
    starts at zero), so the grid learns most of the colour at grid learning rates while the MLP adds what depends
    on the view at that point: highlights and reflections that a per-pixel decoder only sees averaged along the
    ray.
    """

    def forward(
        self,
        features: torch.Tensor,
        directions: torch.Tensor,
        ray: torch.Tensor | None = None,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual = self.residual([features], directions, image_index, ray)
        return torch.sigmoid(features[:, :DIFFUSE_CHANNELS] + residual)


class Decoder(_ShadingMLP):
    """Per-pixel MLP: the view-dependent residual added to the composited diffuse colour.

    forward(diffuse (N,3), features (N,F'), opacity (N,), directions (N,3) unit, image_index (N,) or None) ->
    (N, 3) foreground colour ``diffuse + opacity * residual``: premultiplied by opacity, so empty pixels get
    exactly the background (an affine appearance transform keeps it so: ``A c + opacity * b``).
    Built with ``inputs`` = 3 + F' (the diffuse colour and the features go in together).
    """

    def forward(
        self,
        diffuse: torch.Tensor,
        features: torch.Tensor,
        opacity: torch.Tensor,
        directions: torch.Tensor,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        residual = self.residual([diffuse, features], directions, image_index)
        return self.appearance.transform(diffuse + opacity[:, None] * residual, image_index, opacity)
