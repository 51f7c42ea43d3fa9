"""Row-sparse Adam: the typed wrappers of ``torch.ops.cuda_ext.sparse_adam_step`` and ``masked_adam_step`` and
their fake kernels.

The kernels (csrc/cpu/adam.cpp, csrc/cuda/adam.cu) apply torch.optim.Adam's update to the listed rows only
(rows not listed are neither read nor written: training.optim.SparseGridAdam), or to the elements whose gradient
is non-zero (no list: the gradient is the mask).
"""

from __future__ import annotations

import torch

from cuda_ext import _adam_checks

__all__ = ["sparse_adam_step", "masked_adam_step"]


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
    """One Adam step (no weight decay, no amsgrad) on ``rows`` of ``param``, in place ("masked Adam").

    For each listed row r, elementwise, exactly torch.optim.Adam's update in torch's own op order::

        m = lerp(m, g, 1 - beta1)                  # = beta1 m + (1 - beta1) g
        v = v * beta2 + (1 - beta2) g^2
        p = p - lr / (1 - beta1^step) * m / (sqrt(v) / sqrt(1 - beta2^step) + eps)

    Rows not listed are neither read nor written: their value *and* their moments stay as they were (the moments
    do not decay). This is DirectVoxGO's / Plenoxels' masked Adam: a voxel no ray touched this step keeps its
    value, so momentum from earlier steps does not drift it; a voxel touched at every step gets exactly dense
    Adam's result: the moments bit for bit, the parameter to an ulp or so (the kernels' sqrt is correctly rounded,
    torch's vectorised CPU sqrt is not). Time and memory traffic follow K (the rows listed), not M.

    Args:
        param, exp_avg, exp_avg_sq: (M, C) contiguous, float32 or float64, on one device; updated in place.
        grad: (M, C) contiguous, param's dtype and device; only its listed rows are read (and, with
            ``clear_grad``, then set to zero).
        rows: (K,) int64 on param's device: distinct row indices in [0, M) (K = 0 is a no-op). A repeated row
            is undefined (stepped twice on the CPU; a race on CUDA); the range is checked (one device sync)
            unless ``check_rows`` is False (rows the caller built in range, e.g. from ``nonzero()`` of a mask).
        step: the step number after this update, an int >= 1 (bias correction); lr: a number >= 0;
            beta1, beta2: numbers in [0, 1); eps: a number > 0.
        clear_grad: leave the listed rows of ``grad`` zero, so the next step's lookups can add onto it (their
            ``grad_into``) where no other row has a gradient (training.optim.SparseGridAdam on occupied rows).
    Raises:
        TypeError: an argument of the wrong type, a dtype other than float32/float64, mixed dtypes, rows not int64.
        ValueError: a shape, device or contiguity mismatch, a value out of its range, rows outside [0, M).
    """
    _adam_checks.check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps, clear_grad)
    if check_rows and rows.numel():  # a data check: one small reduction and one sync
        low, high = torch.stack(torch.aminmax(rows)).tolist()
        if low < 0 or high >= param.shape[0]:
            raise ValueError(f"sparse_adam_step: rows must lie in [0, {param.shape[0]}), got values in [{low}, {high}]")
    torch.ops.cuda_ext.sparse_adam_step(
        param, grad, exp_avg, exp_avg_sq, rows, int(step), float(lr), float(beta1), float(beta2), float(eps), clear_grad
    )


@torch.library.register_fake("cuda_ext::sparse_adam_step")
def _sparse_adam_step_fake(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps, clear_grad=False):
    # In place, no output: the fake kernel only checks the metadata (rows' values are data, not checked here).
    _adam_checks.check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps, clear_grad)


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
    """One Adam step on the elements of ``param`` whose gradient is non-zero, in place (DirectVoxGO's masked Adam).

    Where ``grad`` is non-zero (NaN included), exactly :func:`sparse_adam_step`'s update; where it is exactly zero,
    the value *and* both moments stay as they were (no decay, no drift), so a voxel no ray reached this step is left
    alone, as with the rows :func:`sparse_adam_step` is not given. No list of rows and no device sync: the kernel
    reads the whole gradient and reads and writes ``param``, ``exp_avg`` and ``exp_avg_sq`` only where the gradient
    has a non-zero element (on CUDA per 16-byte pack), so the time follows M for the gradient and the touched
    elements for the rest.

    Args:
        param, exp_avg, exp_avg_sq: (M, C) contiguous, float32 or float64, on one device; updated in place.
        grad: (M, C) contiguous, param's dtype and device.
        step: the step number after this update, an int >= 1 (bias correction); lr: a number >= 0;
            beta1, beta2: numbers in [0, 1); eps: a number > 0.
        clear_grad: leave ``grad`` zero everywhere (on CUDA written only on the 32-byte sectors of the touched
            packs), so the next step's lookups can add onto it (their ``grad_into``) instead of a freshly filled tensor.
    Raises:
        TypeError: an argument of the wrong type, a dtype other than float32/float64, mixed dtypes.
        ValueError: a shape, device or contiguity mismatch, a value out of its range.
    """
    _adam_checks.check_masked_adam_inputs(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, clear_grad)
    torch.ops.cuda_ext.masked_adam_step(
        param, grad, exp_avg, exp_avg_sq, int(step), float(lr), float(beta1), float(beta2), float(eps), clear_grad
    )


@torch.library.register_fake("cuda_ext::masked_adam_step")
def _masked_adam_step_fake(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, clear_grad=False) -> None:
    _adam_checks.check_masked_adam_inputs(param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, clear_grad)
