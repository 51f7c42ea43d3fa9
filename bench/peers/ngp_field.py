"""The radiance field of the NeRF-family peer: nerfacc's ``examples/radiance_fields/ngp.py`` architecture on our
pure-PyTorch encodings (bench.peers.hash_encoding).

Density: the hash grid (16 levels x 2 features over the field's box) into an MLP of one hidden layer of 64 ReLU
units giving 1 + 15 outputs; density = exp(first - 1) (the exponential's gradient clamped at exp(15), instant-ngp's
"truncated exp"), zero outside the box. Colour: the 15 other outputs and the degree-4 SH encoding of the view
direction into an MLP of two hidden layers of 64 ReLU units, then a sigmoid.
"""

from __future__ import annotations

import torch
from torch import nn

from bench.peers.hash_encoding import HashEncoding, sh_encoding

GEOMETRY_FEATURES = 15
SH_FEATURES = 16


class _TruncatedExp(torch.autograd.Function):
    """exp(x) whose backward clamps x at 15: one huge pre-activation cannot blow the gradients up."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.exp(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.exp(x.clamp(max=15.0))


def truncated_exp(x: torch.Tensor) -> torch.Tensor:
    return _TruncatedExp.apply(x)


def mlp(inputs: int, hidden: int, layers: int, outputs: int) -> nn.Sequential:
    """``layers`` hidden ReLU layers of ``hidden`` units, linear output."""
    sizes = [inputs] + [hidden] * layers
    modules: list[nn.Module] = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        modules += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*modules, nn.Linear(sizes[-1], outputs))


class NgpField(nn.Module):
    """``aabb`` (6,) min and max corners of the box the hash grid covers (in the trainer's normalised frame).
    ``density(points (N, 3))`` -> (N,); ``forward(points (N, 3), directions (N, 3) unit)`` -> rgb (N, 3), density
    (N,)."""

    def __init__(
        self,
        aabb: torch.Tensor,
        levels: int = 16,
        log2_size: int = 19,
        features: int = 2,
        base: int = 16,
        finest: int = 4096,
        width: int = 64,
    ):
        super().__init__()
        aabb = torch.as_tensor(aabb, dtype=torch.float32).reshape(-1)
        if aabb.shape != (6,) or not bool((aabb[3:] > aabb[:3]).all()):
            raise ValueError(f"NgpField: aabb must be (6,) min then max corners, max > min, got {aabb.tolist()}")
        self.register_buffer("aabb", aabb)
        self.encoding = HashEncoding(levels, log2_size, features, base, finest)
        self.density_mlp = mlp(self.encoding.output_dim, width, 1, 1 + GEOMETRY_FEATURES)
        self.colour_mlp = mlp(SH_FEATURES + GEOMETRY_FEATURES, width, 2, 3)

    def _geometry(self, points: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        unit = (points - self.aabb[:3]) / (self.aabb[3:] - self.aabb[:3])
        inside = ((unit > 0.0) & (unit < 1.0)).all(-1)
        out = self.density_mlp(self.encoding(unit))
        density = truncated_exp(out[:, 0] - 1.0) * inside
        return density, out[:, 1:]

    def density(self, points: torch.Tensor) -> torch.Tensor:
        return self._geometry(points)[0]

    def forward(self, points: torch.Tensor, directions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        density, geometry = self._geometry(points)
        rgb = torch.sigmoid(self.colour_mlp(torch.cat([sh_encoding(directions), geometry], -1)))
        return rgb, density
