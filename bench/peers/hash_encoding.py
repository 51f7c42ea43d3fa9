"""Instant-NGP's input encodings in plain PyTorch (tinycudann is not available): the multiresolution hash grid and
the real spherical-harmonics direction encoding, for the NeRF-family peer (bench.peers.nerfacc_trainer).

Hash grid (Mueller et al. 2022, eq. 2-4): level l has resolution N_l = floor(N_min * b^l) with
b = exp((ln N_max - ln N_min) / (L - 1)); a point x in [0, 1]^3 sits at x * N_l in that level's lattice, and its
feature is the trilinear interpolation of the 8 surrounding vertices' entries. A level whose (N_l + 1)^3 vertices
fit in the table is indexed densely (x + y (N_l + 1) + z (N_l + 1)^2); finer levels hash the vertex with
(x * 1) xor (y * 2654435761) xor (z * 805459861) mod T (T a power of two). The table starts uniform in
[-1e-4, 1e-4], as instant-ngp's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

PRIMES = (1, 2654435761, 805459861)
# the 8 corners of a cell as (8, 3) offsets, x fastest
CORNERS = torch.tensor([[(i >> 0) & 1, (i >> 1) & 1, (i >> 2) & 1] for i in range(8)], dtype=torch.long)


def level_resolutions(levels: int, base: int, finest: int) -> list[int]:
    """N_l = floor(base * b^l), b = (finest / base)^(1 / (levels - 1)): the lattice resolution of every level."""
    if levels < 1 or base < 1 or finest < base:
        raise ValueError(f"hash grid: need levels >= 1 and 1 <= base <= finest, got {levels}, {base}, {finest}")
    if levels == 1:
        return [base]
    growth = math.exp((math.log(finest) - math.log(base)) / (levels - 1))
    # a hair above: floor(16 * b^15) must give 4096, not 4095.9999
    return [int(math.floor(base * growth**level * (1 + 1e-12))) for level in range(levels)]


def vertex_index(vertex: torch.Tensor, resolution: int, table_size: int) -> torch.Tensor:
    """Table slots of integer lattice vertices (..., 3) in [0, resolution]^3 -> (...,) int64 in [0, table_size)."""
    side = resolution + 1
    if side**3 <= table_size:  # dense: one slot per vertex
        return vertex[..., 0] + vertex[..., 1] * side + vertex[..., 2] * side * side
    hashed = vertex[..., 0] * PRIMES[0] ^ vertex[..., 1] * PRIMES[1] ^ vertex[..., 2] * PRIMES[2]
    return hashed & (table_size - 1)


class HashEncoding(nn.Module):
    """(N, 3) points in [0, 1]^3 -> (N, levels * features) features (levels in order, each level's features
    together). ``table``: (levels, 2^log2_size, features) parameters. Differentiable in the table and the points.
    Points outside [0, 1] are clamped to it (the field zeroes their density)."""

    def __init__(self, levels: int = 16, log2_size: int = 19, features: int = 2, base: int = 16, finest: int = 4096):
        super().__init__()
        if not 1 <= log2_size <= 30 or features < 1:
            raise ValueError(f"hash grid: need 1 <= log2_size <= 30 and features >= 1, got {log2_size}, {features}")
        self.levels, self.features, self.table_size = levels, features, 1 << log2_size
        self.resolutions = level_resolutions(levels, base, finest)
        self.table = nn.Parameter(torch.empty(levels, self.table_size, features).uniform_(-1e-4, 1e-4))
        # per level: slot offset into the flattened table, and resolution (buffers follow .to(device))
        self.register_buffer("offsets", torch.arange(levels, dtype=torch.long) * self.table_size, persistent=False)
        self.register_buffer("scales", torch.tensor(self.resolutions, dtype=torch.float64), persistent=False)
        self.register_buffer("corners", CORNERS.clone(), persistent=False)

    @property
    def output_dim(self) -> int:
        return self.levels * self.features

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        if points.dim() != 2 or points.shape[-1] != 3:
            raise ValueError(f"HashEncoding: points must be (N, 3), got {tuple(points.shape)}")
        count = points.shape[0]
        scaled = points.clamp(0.0, 1.0)[:, None, :] * self.scales.to(points.dtype)[None, :, None]  # (N, L, 3)
        cell = scaled.detach().floor().long()
        # the point on the finest corner of the box belongs to the last cell, not one beyond it
        cell = torch.minimum(cell, self.scales.long()[None, :, None] - 1)
        frac = scaled - cell.to(points.dtype)  # (N, L, 3), differentiable in the points
        slots = torch.empty(count, self.levels, 8, dtype=torch.long, device=points.device)
        for level, resolution in enumerate(self.resolutions):  # dense or hashed: decided per level
            vertices = cell[:, level, None, :] + self.corners  # (N, 8, 3): one level at a time, less memory
            slots[:, level] = vertex_index(vertices, resolution, self.table_size)
        slots += self.offsets[None, :, None]
        # trilinear weights: prod over axes of frac (corner bit 1) or 1 - frac (bit 0)
        bits = self.corners.to(points.dtype)  # (8, 3)
        weights = (frac[:, :, None, :] * bits + (1 - frac[:, :, None, :]) * (1 - bits)).prod(-1)  # (N, L, 8)
        entries = self.table.reshape(-1, self.features)[slots]  # (N, L, 8, F)
        return (weights[..., None] * entries).sum(2).reshape(count, self.output_dim)


# real SH basis up to degree 4 (l = 0..3, 16 functions), orthonormal on the unit sphere, as tinycudann's
# "SphericalHarmonics" encoding of degree 4 (constants sqrt((2l+1)/(4 pi) (l-|m|)!/(l+|m|)!) with the Legendre
# factors folded in)
def sh_encoding(directions: torch.Tensor) -> torch.Tensor:
    """(..., 3) unit directions -> (..., 16) real spherical harmonics of degrees 0..3 at them."""
    if directions.shape[-1] != 3:
        raise ValueError(f"sh_encoding: directions must be (..., 3), got {tuple(directions.shape)}")
    x, y, z = directions.unbind(-1)
    xx, yy, zz, xy, yz, xz = x * x, y * y, z * z, x * y, y * z, x * z
    return torch.stack(
        [
            torch.full_like(x, 0.28209479177387814),
            -0.48860251190291987 * y,
            0.48860251190291987 * z,
            -0.48860251190291987 * x,
            1.0925484305920792 * xy,
            -1.0925484305920792 * yz,
            0.94617469575755997 * zz - 0.31539156525251999,
            -1.0925484305920792 * xz,
            0.54627421529603959 * (xx - yy),
            0.59004358992664352 * y * (-3.0 * xx + yy),
            2.8906114426405538 * xy * z,
            0.45704579946446572 * y * (1.0 - 5.0 * zz),
            0.3731763325901154 * z * (5.0 * zz - 3.0),
            0.45704579946446572 * x * (1.0 - 5.0 * zz),
            1.4453057213202769 * z * (xx - yy),
            0.59004358992664352 * x * (-xx + 3.0 * yy),
        ],
        -1,
    )
