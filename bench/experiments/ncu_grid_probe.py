"""One forward and one backward of cuda_ext.grid_interpolate on the benchmark's random case, for ncu."""

import torch

import cuda_ext

torch.manual_seed(0)
r, c, n = 160, 12, 4096 * 1024
grid = torch.rand(r, r, r, c, device="cuda", requires_grad=True)
pts = (torch.rand(n, 3, device="cuda") * 2 - 1).requires_grad_()
for _ in range(2):
    out = cuda_ext.grid_interpolate(grid, pts)
    out.backward(torch.rand_like(out))
torch.cuda.synchronize()
