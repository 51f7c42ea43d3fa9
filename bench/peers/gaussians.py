"""The 3DGS recipe's pure-PyTorch parts: initial Gaussians, SH colour, optimisers and schedules.

The recipe (Kerbl et al. 2023, as gsplat's examples/simple_trainer.py runs it with a random init):
- ``init_points`` points uniform in a box, random colours, each Gaussian isotropic with the root mean square
  distance to its 3 nearest neighbours as its scale, opacity 0.1, random (unnormalised) quaternions;
- colour as SH coefficients up to degree 3, the degree used rising by one every 1000 steps;
- Adam (eps 1e-15) per parameter group: means 1.6e-4 x scene scale decaying exponentially to 1% over the run,
  scales 5e-3, quats 1e-3, opacities 5e-2, sh0 2.5e-3, shN 2.5e-3 / 20.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SH_C0 = 0.28209479177387814  # the degree-0 real spherical harmonic, 1 / (2 sqrt(pi))
PARAMETERS = ("means", "scales", "quats", "opacities", "sh0", "shN")


@dataclass(frozen=True)
class Recipe:
    """The 3DGS training settings (defaults: the recipe above and DefaultStrategy's densification)."""

    init_points: int = 100_000
    init_opacity: float = 0.1
    init_scale: float = 1.0  # times the neighbour distance
    init_extent: float = 3.0  # captures: the init cube's half size in scene scales (gsplat's random init)
    sh_degree: int = 3
    sh_interval: int = 1000
    ssim_lambda: float = 0.2
    means_lr: float = 1.6e-4
    scales_lr: float = 5e-3
    quats_lr: float = 1e-3
    opacities_lr: float = 5e-2
    sh0_lr: float = 2.5e-3
    shN_lr: float = 2.5e-3 / 20
    final_means_lr_fraction: float = 0.01
    refine_start: int = 500
    refine_stop: int = 15_000
    refine_every: int = 100
    reset_every: int = 3000
    grow_grad2d: float = 2e-4
    random_background: bool = False


def rgb_to_sh(rgb: torch.Tensor) -> torch.Tensor:
    """Colour in [0, 1] -> the degree-0 SH coefficient that renders it (gsplat adds 0.5 after evaluating SH)."""
    return (rgb - 0.5) / SH_C0


def sh_to_rgb(sh0: torch.Tensor) -> torch.Tensor:
    return sh0 * SH_C0 + 0.5


def sh_degree_at(step: int, recipe: Recipe) -> int:
    """The SH degree used at 0-based ``step``: 0 for the first ``sh_interval`` steps, then one more per interval."""
    return min(step // recipe.sh_interval, recipe.sh_degree)


def means_lr_at(step: int, total: int, base: float, final_fraction: float = 0.01) -> float:
    """The means' rate at 0-based ``step`` of ``total``: ``base * final_fraction ** (step / total)`` (gsplat's
    ExponentialLR with gamma = final_fraction ** (1 / total), stepped once after every optimiser step)."""
    if total < 1:
        raise ValueError(f"means_lr_at: total must be >= 1, got {total}")
    return base * final_fraction ** (step / total)


def opacity_reset_due(step: int, recipe: Recipe) -> bool:
    """Whether the opacities are reset after 0-based ``step`` (every reset_every steps while densifying, as
    DefaultStrategy means to; gsplat 1.5.3's own test of it is always false, so the trainer calls the reset)."""
    return 0 < step < recipe.refine_stop and step % recipe.reset_every == 0


def random_points(box: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """(count, 3) points uniform in ``box`` ((2, 3) min and max corners), float32 on the box's device."""
    if count < 4:
        raise ValueError(f"random_points: need at least 4 points (3 neighbours each), got {count}")
    low, high = box[0].float(), box[1].float()
    unit = torch.rand(count, 3, generator=generator, device=generator.device).to(box.device)
    return low + unit * (high - low)


def neighbour_distance(points: torch.Tensor, k: int = 3, chunk: int = 4096) -> torch.Tensor:
    """(N,) root mean square distance of each point to its ``k`` nearest other points (N, 3). Exact, in chunks of
    ``chunk`` rows of the distance matrix (N = 100k: 25 chunks of 4096 x 100k on the GPU)."""
    if points.shape[0] <= k:
        raise ValueError(f"neighbour_distance: need more than k={k} points, got {points.shape[0]}")
    out = []
    for start in range(0, points.shape[0], chunk):
        block = points[start : start + chunk]
        d2 = torch.cdist(block, points).square()
        nearest = d2.topk(k + 1, dim=1, largest=False).values[:, 1:]  # the first is the point itself
        out.append(nearest.mean(1).sqrt())
    return torch.cat(out)


def initial_gaussians(
    points: torch.Tensor, colours: torch.Tensor, recipe: Recipe, generator: torch.Generator
) -> dict[str, torch.nn.Parameter]:
    """The recipe's initial Gaussians at ``points`` (N, 3) with ``colours`` (N, 3) in [0, 1].

    Returns parameters (on the points' device): means (N, 3), scales (N, 3) log, quats (N, 4), opacities (N,)
    logit, sh0 (N, 1, 3), shN (N, (degree+1)^2 - 1, 3) zeros.
    """
    count = points.shape[0]
    scale = (neighbour_distance(points) * recipe.init_scale).clamp_min(1e-7)
    quats = torch.rand(count, 4, generator=generator, device=generator.device).to(points.device)
    coefficients = (recipe.sh_degree + 1) ** 2
    values = {
        "means": points.float(),
        "scales": scale.log()[:, None].repeat(1, 3),
        "quats": quats,
        "opacities": torch.full((count,), math.log(recipe.init_opacity / (1 - recipe.init_opacity))),
        "sh0": rgb_to_sh(colours.float())[:, None, :],
        "shN": torch.zeros(count, coefficients - 1, 3),
    }
    return {name: torch.nn.Parameter(values[name].to(points.device).contiguous()) for name in PARAMETERS}


def learning_rates(recipe: Recipe, scene_scale: float) -> dict[str, float]:
    """Each parameter's initial Adam rate (the means' scales with the scene)."""
    rates = {name: getattr(recipe, f"{name}_lr") for name in PARAMETERS}
    rates["means"] *= scene_scale
    return rates


def make_optimizers(params: dict[str, torch.nn.Parameter], rates: dict[str, float]) -> dict[str, torch.optim.Adam]:
    """One Adam per parameter (gsplat's DefaultStrategy replaces parameters and their Adam state in place).

    On CUDA the fused implementation: the same update (gsplat's trainer uses the default, foreach), in one kernel
    per parameter instead of a dozen; DefaultStrategy's state surgery copies every state entry but "step" either way.
    """
    return {
        name: torch.optim.Adam(
            [{"params": [params[name]], "lr": rates[name], "name": name}],
            eps=1e-15,
            fused=True if params[name].is_cuda else None,
        )
        for name in params
    }


def model_tensors(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Gaussians as plain CPU tensors (what a saved model holds: no optimiser state)."""
    return {name: tensor.detach().cpu().contiguous() for name, tensor in params.items()}
