"""The op benchmark's brick_grid_interpolate cases: the model's fine grid, a virtual grid of V0 x V1 x V2 vertices
in bricks of B^3, with FILL of the bricks allocated in a shell around a surface (a sphere of radius 0.6 in box
coordinates; slots in row-major table order, as the model allocates them), at C = 12 (features) and C = 1
(density). The points lie where the bricks are, as the model's marched samples do: "random" uniform in the
allocated bricks in random order, "rays" the samples of rays through the box that fall in allocated bricks,
sorted along each ray. Custom vs reference (the ops=torch path); the gradient is taken for the values.

The table and the points are made once per case on the CPU (a fixed seed); each input set draws new values.
"""

from __future__ import annotations

import math

import torch
from bench_cases import DTYPE, Case, Ops, Sizes, Variant, ray_points

CHANNELS = (12, 1)
FILL = 0.08
SHELL_RADIUS = 0.6

RULE = (
    "compulsory bytes only: fw: table + the distinct rows the points read (with a nonzero weight) + points + out; "
    "bw (grad=values): grad_out + points + table + grad_values (all M rows: the op returns a dense (M, C) gradient); "
    "each corner's own gather and scattered atomic moves more than this"
)


def _geometry(shape: tuple[int, int, int], brick: int) -> torch.Tensor:
    """(T0, T1, T2) int32 table: the FILL of the bricks nearest the shell get slots in row-major order, -1 else."""
    bricks = [math.ceil(v / brick) for v in shape]
    axes = [((torch.arange(t) + 0.5) * brick / max(v - 1, 1) * 2 - 1).clamp(-1, 1) for t, v in zip(bricks, shape)]
    centres = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1).reshape(-1, 3)
    score = -(centres.norm(dim=1) - SHELL_RADIUS).abs()
    chosen = torch.topk(score, max(1, round(FILL * score.numel()))).indices.sort().values
    table = torch.full((score.numel(),), -1, dtype=torch.int32)
    table[chosen] = torch.arange(chosen.numel(), dtype=torch.int32)
    return table.reshape(bricks)


def _in_bricks(points: torch.Tensor, table: torch.Tensor, shape: tuple[int, int, int], brick: int) -> torch.Tensor:
    """(N,) whether each point's low corner lies in an allocated brick."""
    index = [((points[:, a] + 1) / 2 * (v - 1)).floor().long().clamp(0, v - 1) // brick for a, v in enumerate(shape)]
    return table[index[0], index[1], index[2]] >= 0


def _random_points(n: int, table: torch.Tensor, shape, brick: int, gen: torch.Generator) -> torch.Tensor:
    """(n, 3) points uniform in the allocated bricks, in random order."""
    allocated = (table >= 0).nonzero()
    pick = allocated[torch.randint(allocated.shape[0], (n,), generator=gen)]
    vertex = (pick + torch.rand(n, 3, generator=gen)) * brick
    scale = torch.tensor([max(v - 1, 1) for v in shape], dtype=torch.float32)
    return (vertex / scale * 2 - 1).clamp(-1, 1).to(DTYPE)


def _ray_points(n: int, table: torch.Tensor, shape, brick: int, gen: torch.Generator) -> torch.Tensor:
    """(n, 3) samples of rays (about one per fine cell along each ray) that fall in allocated bricks, ray by ray."""
    samples = max(shape)
    kept, total = [], 0
    for _ in range(1000):
        points = ray_points(max(1, n // 128), samples, gen)
        points = points[_in_bricks(points, table, shape, brick)]
        kept.append(points)
        total += points.shape[0]
        if total >= n:
            return torch.cat(kept)[:n].contiguous()
    raise RuntimeError("bench_brick_cases: the rays found too few samples in the allocated bricks")


def _touched_rows(ops: Ops, table: torch.Tensor, points: torch.Tensor, shape, brick: int, rows: int) -> int:
    """Distinct rows the points read with a nonzero weight (through the reference's gradient)."""
    values = torch.zeros(rows, 1, requires_grad=True)
    ops.reference.brick_grid_interpolate(values, table, points, list(shape), brick).sum().backward()
    return int((values.grad != 0).sum())


def brick_cases(s: Sizes, ops: Ops) -> list[Case]:
    *shape, brick, n = s.brick_grid
    shape = tuple(shape)
    gen = torch.Generator().manual_seed(0)
    table = _geometry(shape, brick)
    slots = int((table >= 0).sum())
    rows = slots * brick**3
    distributions = {
        "random": _random_points(n, table, shape, brick, gen),
        "rays": _ray_points(n, table, shape, brick, gen),
    }
    touched = {name: _touched_rows(ops, table, p, shape, brick, rows) for name, p in distributions.items()}
    return [
        _case(ops, shape, brick, table, slots, name, points, touched[name], c)
        for c in CHANNELS
        for name, points in distributions.items()
    ]


def _case(ops, shape, brick, table, slots, name, points, touched, c) -> Case:
    e, n, rows = DTYPE.itemsize, points.shape[0], slots * brick**3

    def make(gen: torch.Generator) -> tuple:
        values = torch.randn(rows, c, generator=gen, device=gen.device, dtype=DTYPE)
        return values, table.to(gen.device), points.to(gen.device)

    variants = {
        "custom": Variant(ops.custom("brick_grid_interpolate", list(shape), brick)),
        "reference": Variant(ops.ref("brick_grid_interpolate", list(shape), brick)),
    }
    backward = ops.backward_op("brick_grid_interpolate")
    fixed = table.numel() * 4 + 3 * n * e  # table + points
    return Case(
        "brick_grid_interpolate",
        f"{name} C={c}",
        f"{'x'.join(map(str, shape))} B={brick} {slots} bricks ({FILL:.0%}) N={n}",
        make,
        (n, c),
        (True, False, False),
        variants,
        lambda g, x: backward(g, x[0], x[1], x[2], list(shape), brick, True, False),
        bytes_fw=fixed + (touched + n) * c * e,
        bytes_bw=fixed + (n + rows) * c * e,
    )
