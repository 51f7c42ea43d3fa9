"""The sampled total variation: the typed wrapper of ``torch.ops.cuda_ext.sampled_tv`` and its fake kernel (the
argument checks, shared with the reference, are in :mod:`cuda_ext._tv_checks`).

The kernels (csrc/cpu/tv.cpp, csrc/cuda/tv.cu) estimate a grid's total variation on sampled cells and add its
gradient straight into the grid's gradient, after the backward: no autograd graph, no gathered rows, no
grid-sized temporary, two launches on a GPU (the sampled TV of a voxel grid in PyTorch is ~40 small ops forward
and as many backward). The model's TV terms go through it (models.model.VoxelNeRF.deferred_regularization).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from cuda_ext._tv_checks import check_cell_range, check_sampled_tv_inputs

__all__ = ["sampled_tv"]


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
    """``scale`` x the total variation of ``values`` estimated on ``cells``; its gradient is added into ``grad``.

    ``values`` holds G grids of ``shape`` = (R0, R1, R2) vertices, C channels each, as rows in C order:
    (G * R0 * R1 * R2, C) (a (R0, R1, R2, C) grid reshaped, G = 1; or a pool of G bricks of b^3 vertices). A cell
    is an index into the G * (R0-1) * (R1-1) * (R2-1) cells, in the same order; its lower corner v and the three
    pairs (v, v + e_a). The estimate is the mean over the S cells and C channels of each axis' squared
    difference, summed over the axes (what ``((x[v + e_a] - x[v]) ** 2).mean()`` summed over a gives)::

        loss = scale / (S * C) * sum_{s, a, c} w_sa * (x[v_s + e_a, c] - x[v_s, c]) ** 2

    with w_sa = 1, or ``outside`` where an end of the pair lies outside the ``inside`` box. ``grad`` gets
    d loss / d values added in place (repeated cells add up, as autograd's would). Nothing else is written.

    Args:
        grad: ``values``' shape, dtype and device, contiguous: added to in place.
        values: (G * R0 * R1 * R2, C) float32 or float64, contiguous.
        cells: (S,) int64 on ``values``' device, in [0, G * (R0-1) * (R1-1) * (R2-1)) (S = 0: zero, nothing added).
            The range is checked (one device sync) unless ``check_cells`` is False (cells drawn in range).
        shape: (R0, R1, R2), each >= 2; the rows of ``values`` a whole number of such grids.
        inside: None (every pair weighs 1) or ((lo0, hi0), (lo1, hi1), (lo2, hi2)): the foreground box's vertex
            range per axis, inclusive; a pair weighs ``outside`` unless both its ends lie in the box.
        outside: a number >= 0; scale: a finite number.
    Returns:
        () float64 on ``values``' device: the estimate, scale included.
    Raises:
        TypeError: an argument of the wrong type or dtype. ValueError: a shape, device or layout mismatch, a value
        out of its range.
    """
    shape, flat_inside, outside, scale = check_sampled_tv_inputs(grad, values, cells, shape, inside, outside, scale)
    if check_cells:
        check_cell_range(values, cells, shape)
    return torch.ops.cuda_ext.sampled_tv(grad, values, cells, shape, flat_inside, outside, scale)


@torch.library.register_fake("cuda_ext::sampled_tv")
def _sampled_tv_fake(grad, values, cells, shape, inside, outside, scale) -> torch.Tensor:
    pairs = None if not inside else list(zip(inside[0::2], inside[1::2]))
    check_sampled_tv_inputs(grad, values, cells, shape, pairs, outside, scale)
    return values.new_empty((), dtype=torch.float64)
