"""Pure-PyTorch references for every op in :mod:`cuda_ext`, with the same signatures.

They define what the custom kernels compute, serve as the ``ops=torch`` backend of the model,
and are what the tests compare against. Autograd differentiates them. They check their arguments with
the wrappers' checks (``cuda_ext._checks``), so both backends reject a bad call with the same exception.
The per-ray ops (march_rays and march_rays_capped, volume_render, distortion_loss, visible_samples and
visible_samples_capped) live in
``cuda_ext._reference_rays``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from cuda_ext import _adam_checks, _brick_checks, _checks
from cuda_ext._gelu_rows_checks import check_gelu_rows_inputs
from cuda_ext._reference_rays import (
    OPAQUE_DEPTH,
    contract_points,
    distortion_loss,
    march_rays,
    march_rays_capped,
    visible_samples,
    visible_samples_capped,
    volume_render,
)
from cuda_ext._tv_checks import check_cell_range, check_sampled_tv_inputs

__all__ = [
    "OPAQUE_DEPTH",
    "trilinear_interpolate",
    "grid_interpolate",
    "brick_grid_interpolate",
    "upsample_bilinear2d",
    "gelu",
    "gelu_rows",
    "volume_render",
    "distortion_loss",
    "visible_samples",
    "visible_samples_capped",
    "march_rays",
    "march_rays_capped",
    "contract_points",
    "sparse_adam_step",
    "masked_adam_step",
    "sampled_tv",
]


def trilinear_interpolate(feats: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Blend each point's 8 cell-corner features (the tutorial's formula).

    Args:
        feats: (N, 8, F) corner features; corner ``k = 4*iu + 2*iw + iv``.
        points: (N, 3) local coordinates (x, y, z) in [-1, 1].
    Returns:
        (N, F) with (u, v, w) = (points + 1) / 2 and corner k weighted by
        ``(u if iu else 1-u) * (v if iv else 1-v) * (w if iw else 1-w)``.
    """
    _checks.check_trilinear_inputs(feats, points)
    u = (points[:, 0:1] + 1) / 2
    v = (points[:, 1:2] + 1) / 2
    w = (points[:, 2:3] + 1) / 2
    a = (1 - v) * (1 - w)
    b = v * (1 - w)
    c = (1 - v) * w
    d = v * w
    return (1 - u) * (a * feats[:, 0] + b * feats[:, 1] + c * feats[:, 2] + d * feats[:, 3]) + u * (
        a * feats[:, 4] + b * feats[:, 5] + c * feats[:, 6] + d * feats[:, 7]
    )


def grid_interpolate(grid: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Trilinear lookup of a dense channels-last grid at continuous points (8-corner gather).

    Args:
        grid: (R0, R1, R2, C) voxel values.
        points: (N, 3) coordinates in [-1, 1] along grid axes 0, 1, 2.
    Returns:
        (N, C). Per axis, ``p = (point + 1) / 2 * (R - 1)`` clamped to [0, R - 1]
        (align_corners=True, border padding), then the trilinear blend of the 8 voxels around p.
        Non-finite coordinates give the custom op's rows: NaN gives a NaN row (its fraction stays NaN;
        the voxels read are 0 and 1 along that axis, as in the kernel); -inf clamps to voxel 0 and +inf
        to voxel R-1, except along an axis with R == 1, where (point + 1) / 2 * 0 is NaN and so is the row.
        The backward runs on them too: the grid gradient is the custom op's (NaN at the voxels a NaN row
        reads); a NaN row's points gradient is 0 along the NaN axis and NaN along the others, except 0
        where the clamp holds (the custom op gives NaN there).
    """
    _checks.check_grid_inputs(grid, points)
    lo, hi, t = _axis_samples(points, grid.shape[:3])
    out = torch.zeros(points.shape[0], grid.shape[3], dtype=grid.dtype, device=grid.device)
    for corner in range(8):
        idx = [hi[:, a] if bit else lo[:, a] for a, bit in enumerate(_corner_bits(corner))]
        out = out + _corner_weight(t, corner)[:, None].to(grid.dtype) * grid[idx[0], idx[1], idx[2]]
    return out


def brick_grid_interpolate(
    values: torch.Tensor, table: torch.Tensor, points: torch.Tensor, shape: Sequence[int], brick: int
) -> torch.Tensor:
    """Trilinear lookup of a sparse grid of bricks (cuda_ext.brick_grid_interpolate's contract), without
    materialising the dense grid: per corner, its vertex's brick and row from integer tensor ops, a masked
    gather, the blend.

    Args:
        values: (M, C) brick pool (M a multiple of brick**3); table: (T0, T1, T2) int32 brick slots (an entry
            outside [0, M / brick**3) is an empty brick, whose vertices read as zeros); points: (N, 3) in
            [-1, 1]; shape: the virtual grid's (V0, V1, V2) vertices; brick: B.
    Returns:
        (N, C): grid_interpolate of the virtual dense grid, whose vertex (i0, i1, i2) is
        ``values[table[i0 // B, i1 // B, i2 // B] * B**3 + ((i0 % B) * B + i1 % B) * B + i2 % B]``.
    """
    shape, b = _brick_checks.check_brick_grid_inputs(values, table, points, shape, brick)
    lo, hi, t = _axis_samples(points, shape)
    slots = values.shape[0] // b**3
    table_stride = (table.shape[1] * table.shape[2], table.shape[2], 1)
    brick_lo, brick_hi, local_lo, local_hi = lo // b, hi // b, lo % b, hi % b
    flat_table = table.reshape(-1)
    out = values.new_zeros(points.shape[0], values.shape[1])
    for corner in range(8):
        bits = _corner_bits(corner)
        entry = sum((brick_hi if bit else brick_lo)[:, a] * table_stride[a] for a, bit in enumerate(bits))
        local = sum((local_hi if bit else local_lo)[:, a] * b ** (2 - a) for a, bit in enumerate(bits))
        slot = flat_table[entry].long()
        filled = (slot >= 0) & (slot < slots)
        if slots:
            gathered = values[torch.where(filled, slot * b**3 + local, 0)]
        else:  # no bricks: zeros (an empty sum), with values still in the graph
            gathered = values.sum(0, keepdim=True).expand(points.shape[0], -1)
        # zeros for an empty brick's corner, still weighted: a NaN point's row is NaN, as in the dense lookup
        corner_values = torch.where(filled[:, None], gathered, 0)
        out = out + _corner_weight(t, corner)[:, None].to(values.dtype) * corner_values
    return out


def _axis_samples(points: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where (N, 3) points fall in a grid of ``sizes`` vertices (csrc/grid_interpolate.h's sample_axis): the low
    and high vertex (N, 3) int64 and the fraction t (N, 3) towards the high one, differentiable in the points."""
    sizes = torch.tensor(list(sizes), device=points.device)
    p = ((points + 1) / 2 * (sizes - 1).to(points.dtype)).clamp(min=0)
    p = torch.minimum(p, (sizes - 1).to(points.dtype))  # +-inf: the border; NaN stays NaN (clamp and minimum keep it)
    # The indices come from a NaN-free copy (a NaN's integer cast is undefined: an out-of-range index); t keeps the NaN.
    p_index = torch.where(torch.isnan(p), torch.zeros_like(p), p).detach()
    # keep lo+1 inside the grid; t then reaches 1 at the end
    lo = torch.minimum(p_index.floor().long(), (sizes - 2).clamp(min=0))
    t = p - lo.to(p.dtype)
    hi = torch.minimum(lo + 1, sizes - 1)
    return lo, hi, t


def _corner_bits(corner: int) -> tuple[int, int, int]:
    """Corner k = 4*i0 + 2*i1 + i2: whether it takes the high vertex along axes 0, 1, 2."""
    return (corner >> 2) & 1, (corner >> 1) & 1, corner & 1


def _corner_weight(t: torch.Tensor, corner: int) -> torch.Tensor:
    """(N,) trilinear weight of ``corner`` at fractions t (N, 3)."""
    weight = torch.ones_like(t[:, 0])
    for a, bit in enumerate(_corner_bits(corner)):
        weight = weight * (t[:, a] if bit else 1 - t[:, a])
    return weight


def upsample_bilinear2d(x: torch.Tensor, scale_factor: int, align_corners: bool = False) -> torch.Tensor:
    """(B, C, H, W) -> (B, C, H*s, W*s) bilinear upsampling (``F.interpolate``)."""
    scale_factor = _checks.check_upsample_inputs(x, scale_factor, align_corners)
    return F.interpolate(x, scale_factor=scale_factor, mode="bilinear", align_corners=align_corners)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """Elementwise GELU, exact (``"none"``, erf) or ``"tanh"`` (``F.gelu``)."""
    _checks.check_gelu_inputs(x, approximate)
    return F.gelu(x, approximate=approximate)


def gelu_rows(x: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x + rows[index])``: (N, H), (B, H), (N,) int64 -> (N, H)."""
    check_gelu_rows_inputs(x, rows, index, approximate)
    return F.gelu(x + rows.index_select(0, index), approximate=approximate)


def sparse_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    rows: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    check_rows: bool = True,
    clear_grad: bool = False,
) -> None:
    """torch.optim.Adam's update on ``rows`` of (M, C) ``param`` (and its moments), in place; the rest untouched.

    The rows are gathered, stepped with the tensor ops of torch.optim.Adam's single-tensor path (lerp_, mul_ +
    addcmul_, sqrt / bias_correction2 ** 0.5 + eps, addcdiv_), and scattered back: on the CPU, with every row
    listed, bit for bit torch.optim.Adam. Rows not listed are neither read nor written (masked Adam).
    ``clear_grad``: then ``grad``'s listed rows zeroed.
    """
    _adam_checks.check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps, clear_grad)
    if check_rows and rows.numel():
        low, high = torch.stack(torch.aminmax(rows)).tolist()
        if low < 0 or high >= param.shape[0]:
            raise ValueError(f"sparse_adam_step: rows must lie in [0, {param.shape[0]}), got values in [{low}, {high}]")
    _adam_at(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps)
    if clear_grad:
        grad[rows] = 0


def masked_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    clear_grad: bool = False,
) -> None:
    """torch.optim.Adam's update on the elements of (M, C) ``param`` whose gradient is non-zero, in place; the
    elements with a zero gradient untouched (value and moments): :func:`sparse_adam_step`'s ops on the gathered
    elements, scattered back. ``clear_grad``: then ``grad`` zeroed."""
    _adam_checks.check_masked_adam_inputs(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, clear_grad)
    _adam_at(param, grad, exp_avg, exp_avg_sq, grad != 0, step, lr, beta1, beta2, eps)  # NaN != 0: stepped
    if clear_grad:
        grad.zero_()


@torch.no_grad()
def _adam_at(param, grad, exp_avg, exp_avg_sq, where: torch.Tensor, step, lr, beta1, beta2, eps) -> None:
    """torch.optim.Adam's single-tensor ops on ``param[where]`` and its moments (``where``: rows or a mask),
    gathered, stepped and scattered back."""
    g, m, v, p = grad[where], exp_avg[where], exp_avg_sq[where], param[where]
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1, bias_correction2 = 1 - beta1 ** float(step), 1 - beta2 ** float(step)
    denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=-(lr / bias_correction1))
    param[where], exp_avg[where], exp_avg_sq[where] = p, m, v


def sampled_tv(
    grad: torch.Tensor,
    values: torch.Tensor,
    cells: torch.Tensor,
    shape: Sequence[int],
    inside: Sequence[Sequence[int]] | None = None,
    outside: float = 1.0,
    scale: float = 1.0,
    check_cells: bool = True,
) -> torch.Tensor:
    """cuda_ext.sampled_tv from its definition: the cells' corner rows and pair weights from integer arithmetic,
    the four rows gathered, the loss as the model's TV writes it, autograd's gradient of the gathered rows added
    into ``grad`` with ``index_add_``. Returns () float64."""
    shape, flat, outside, scale = check_sampled_tv_inputs(grad, values, cells, shape, inside, outside, scale)
    if check_cells:
        check_cell_range(values, cells, shape)
    if cells.numel() == 0 or values.shape[1] == 0:
        return torch.zeros((), dtype=torch.float64, device=values.device)
    r0, r1, r2 = shape
    per_grid = (r0 - 1) * (r1 - 1) * (r2 - 1)
    g, rest = cells // per_grid, cells % per_grid
    v = torch.stack([rest // ((r1 - 1) * (r2 - 1)), rest // (r2 - 1) % (r1 - 1), rest % (r2 - 1)])  # (3, S)
    corner = ((g * r0 + v[0]) * r1 + v[1]) * r2 + v[2]
    rows = torch.stack([corner, corner + r1 * r2, corner + r2, corner + 1])  # (4, S)
    picked = values.detach()[rows.reshape(-1)].reshape(4, cells.shape[0], -1).requires_grad_(True)
    with torch.enable_grad():
        squares = (picked[1:] - picked[:1]) ** 2  # (3, S, C)
        if flat:
            lo = torch.tensor(flat[0::2], device=cells.device)[:, None]
            hi = torch.tensor(flat[1::2], device=cells.device)[:, None]
            inside_v, inside_next = (lo <= v) & (v <= hi), (lo <= v + 1) & (v + 1 <= hi)  # (3, S) per axis
            both = torch.stack([inside_next[a] & inside_v.all(0) for a in range(3)])  # v and v + e_a in the box
            one = torch.ones((), dtype=values.dtype, device=values.device)
            squares = squares * torch.where(both, one, one * outside)[..., None]  # outside in dtype, not float32
        loss = scale * squares.mean(dim=(1, 2)).sum()
        (gradient,) = torch.autograd.grad(loss, picked)
    grad.view(-1, values.shape[1]).index_add_(0, rows.reshape(-1), gradient.reshape(-1, values.shape[1]))
    return loss.detach().to(torch.float64)
