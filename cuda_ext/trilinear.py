"""STUB wrappers (no autograd yet): replaced by the trilinear-family implementation."""
import torch


def trilinear_interpolate(feats: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return torch.ops.cuda_ext.trilinear_interpolate(feats, points)


def grid_interpolate(grid: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    return torch.ops.cuda_ext.grid_interpolate(grid, points)
