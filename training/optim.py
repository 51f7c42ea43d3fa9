"""Adam for voxel grids that reads and writes only the voxels this step's rays touched.

Dense Adam over a 256^3 x 13 grid moves about 6 GB per step (param, grad and two moments read, three written)
although a batch touches a few percent of the voxels. :class:`SparseGridAdam` finds the rows (voxels) whose
gradient can be non-zero (the model's list of rows its lookups read, or a scan of the gradient) and hands only
those to a fused step (``ops.sparse_adam_step``: our kernel, or its PyTorch
reference). Semantics, as DirectVoxGO's and Plenoxels' masked Adam: a voxel no ray touched this step keeps its
value *and* its moments (momentum does not drift it, its moments do not decay); on a voxel touched at every step
the result is dense Adam's. Other groups (the decoder) take every row: dense Adam.
"""

from __future__ import annotations

from typing import Callable

import torch


class SparseGridAdam(torch.optim.Optimizer):
    """Adam (no weight decay) whose state matches ``torch.optim.Adam``'s keys (step, exp_avg, exp_avg_sq), so
    checkpoints move between the two.

    Args:
        params: parameter groups; zero-gradient rows are skipped in the group named ``grids`` (VoxelNeRF's
            param_groups), every other group steps densely. A parameter is seen as rows of its last dimension: a
            channels-last grid (R0, R1, R2, C) as (R0*R1*R2, C) voxels.
        step_fn: ``sparse_adam_step(param, grad, exp_avg, exp_avg_sq, rows, step, lr, beta1, beta2, eps)``.
        rows_fn: optional ``() -> (K,) int64`` rows of the ``grids`` group to step this time, shared by its
            parameters (VoxelNeRF.take_touched_rows: the rows the step's lookups read); None: the rows whose
            gradient is non-zero, found by scanning each gradient (reads all of it).
    """

    def __init__(
        self,
        params,
        step_fn: Callable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        rows_fn: Callable[[], torch.Tensor] | None = None,
    ):
        if not 0.0 <= lr:
            raise ValueError(f"lr: must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas: each must be in [0, 1), got {betas}")
        if not eps > 0.0:
            raise ValueError(f"eps: must be > 0, got {eps}")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})
        self.step_fn = step_fn
        self.rows_fn = rows_fn

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closure: SparseGridAdam does not re-evaluate the loss")
        listed = None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            if group.get("name") == "grids" and self.rows_fn is not None:
                listed = self.rows_fn()
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                columns = param.shape[-1] if param.dim() > 0 else 1
                grad = param.grad.reshape(-1, columns)
                if group.get("name") == "grids" and listed is not None:
                    rows = listed
                elif group.get("name") == "grids":
                    rows = grad.ne(0).any(dim=1).nonzero().squeeze(1)  # one host sync: the count
                else:
                    rows = torch.arange(grad.shape[0], device=grad.device)
                self.step_fn(
                    param.view(-1, columns),
                    grad.contiguous(),
                    state["exp_avg"].view(-1, columns),
                    state["exp_avg_sq"].view(-1, columns),
                    rows,
                    int(state["step"].item()),
                    float(group["lr"]),
                    float(beta1),
                    float(beta2),
                    float(group["eps"]),
                )
        return None
