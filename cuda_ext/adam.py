"""Sparse ("masked") Adam: the typed wrapper of ``torch.ops.cuda_ext.sparse_adam_step`` and its fake kernel.

The kernels (csrc/cpu/adam.cpp, csrc/cuda/adam.cu) apply torch.optim.Adam's update to the listed rows only;
rows not listed are neither read nor written, so their values and moments stay as they were. The optimiser
that uses it is training.optim.SparseGridAdam.
"""

from __future__ import annotations

import torch

from cuda_ext import _step_checks

__all__ = ["sparse_adam_step"]


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
) -> None:
    """One Adam step (no weight decay, no amsgrad) on ``rows`` of ``param``, in place.

    Args:
        param, grad, exp_avg, exp_avg_sq: (M, C) contiguous, float32 or float64, one device; param and the
            moments are updated in place.
        rows: (K,) int64 distinct row indices in [0, M) (repeats would be stepped twice).
        step: the step number, >= 1 (bias correction); lr >= 0; beta1, beta2 in [0, 1); eps > 0.
    """
    _step_checks.check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps)
    if rows.numel() and not bool(((rows >= 0) & (rows < param.shape[0])).all()):  # a data check: one sync
        raise ValueError(f"sparse_adam_step: rows must lie in [0, {param.shape[0]})")
    torch.ops.cuda_ext.sparse_adam_step(
        param, grad, exp_avg, exp_avg_sq, rows, int(step), float(lr), float(beta1), float(beta2), float(eps)
    )


@torch.library.register_fake("cuda_ext::sparse_adam_step")
def _sparse_adam_step_fake(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps) -> None:
    _step_checks.check_adam_inputs(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps)
