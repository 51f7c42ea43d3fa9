#!/usr/bin/env python3
"""Experiment: the grid lookup's forward in slab passes, so each pass gathers from an L2-sized part of the grid.

Random points over a 160^3 x 12 float32 grid (197 MB, four times the H100's L2) read 2.17 GB from DRAM
for 0.6 GB of voxel data they touch: most gathers miss L2. Here a first kernel tags each point with the
axis-0 slab of S slices its cell starts in (one byte per point); pass k then visits only the points
of slab k, which gather from S + 1 slices (S * 1.2 MB): if that fits in L2, the grid is read from DRAM
about once. A warp walks chunks of 256 points, compacts the chunk's points of slab k in shared memory
and blends them with the product's channel-split layout (3 lanes per point, one float4 each).

Timed against cuda_ext.grid_interpolate (in each CUDA_EXT_GRID_REORDER mode) and F.grid_sample, with L2
flushed before each call (as the op benchmark's cycled inputs do): the lookup on random points, on random
points confined to 1/k of axis 0 (the gather phase's best case) and on points sorted along rays. The slab
passes lost (random 0.79 ms at best against 0.91, rays 0.96 against 0.22: see bench/README.md); the
bucket order the product now uses (cuda/point_buckets.cu) came out of this experiment, its prototype
kernels are in git history (commit af76c91). Needs a GPU and the built extension.
Usage: python3 bench/experiments/grid_slab_passes.py [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grid_forward_variants import AXIS_CUDA, report, time_ms as time_call  # noqa: E402

CUDA_SRC = r"""
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>

namespace {
constexpr int kThreads = 256, kWarps = kThreads / 32, kChunk = 256;  // points a warp compacts at once
constexpr int kC = 12, kG = 3;  // channels; lanes per point, each one float4

""" + AXIS_CUDA + r"""
// Point n's channel vector g, blended as cuda_ext's blend_corners does (same order of operations).
__device__ __forceinline__ void blend(const float* __restrict__ grid, const float* __restrict__ points,
                                      float* __restrict__ out, int64_t n, int g, int64_t r0, int64_t r1, int64_t r2) {
  const Axis a0 = axis(points[3 * n], r0), a1 = axis(points[3 * n + 1], r1), a2 = axis(points[3 * n + 2], r2);
  const int64_t row = r2 * kC, slice = r1 * row;
  const int64_t base = a0.lo * slice + a1.lo * row + a2.lo * kC;
  const int64_t s0 = (a0.hi - a0.lo) * slice, s1 = (a1.hi - a1.lo) * row, s2 = (a2.hi - a2.lo) * kC;
  const float* c0 = grid + base + 4 * g;
  float4 v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k)
    v[k] = __ldg(reinterpret_cast<const float4*>(c0 + ((k & 4) ? s0 : 0) + ((k & 2) ? s1 : 0) + ((k & 1) ? s2 : 0)));
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const float w = ((k & 4) ? a0.t : 1.f - a0.t) * ((k & 2) ? a1.t : 1.f - a1.t) * ((k & 1) ? a2.t : 1.f - a2.t);
    acc.x += w * v[k].x; acc.y += w * v[k].y; acc.z += w * v[k].z; acc.w += w * v[k].w;
  }
  __stcs(reinterpret_cast<float4*>(out + n * kC + 4 * g), acc);
}

// ids[n] = the slab (of S axis-0 slices) point n's cell starts in; 255 past n_points (chunk padding).
__global__ void slab_ids_kernel(const float* __restrict__ points, uint8_t* __restrict__ ids, int64_t n_points,
                                int64_t padded, int64_t r0, int64_t slices) {
  const int64_t i = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= padded) return;
  ids[i] = i < n_points ? uint8_t(axis(__ldcs(points + 3 * i), r0).lo / slices) : uint8_t(255);
}

// Pass `slab`: each warp takes chunks of 256 points, gathers the indices of the chunk's points in this
// slab into shared memory (ranks from a warp scan), then blends them 10 at a time.
template <int kMinBlocks>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    slab_pass_kernel(const float* __restrict__ grid, const float* __restrict__ points, const uint8_t* __restrict__ ids,
                     float* __restrict__ out, int n_chunks, int slab, int r0, int r1, int r2) {
  __shared__ int chunk_points[kWarps][kChunk];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warps = gridDim.x * kWarps;
  for (int chunk = blockIdx.x * kWarps + warp; chunk < n_chunks; chunk += warps) {
    const uint2 word = __ldcs(reinterpret_cast<const uint2*>(ids + chunk * kChunk) + lane);  // ids 8*lane..8*lane+7
    unsigned mine = 0;  // bit i: point 8 * lane + i is in the slab
#pragma unroll
    for (int i = 0; i < 8; ++i) mine |= unsigned(((i < 4 ? word.x >> (8 * i) : word.y >> (8 * (i - 4))) & 0xff) == unsigned(slab)) << i;
    int count = __popc(mine), rank = count;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int other = __shfl_up_sync(0xffffffffu, rank, d);
      if (lane >= d) rank += other;
    }
    const int total = __shfl_sync(0xffffffffu, rank, 31);
    rank -= count;
    while (mine) {
      const int i = __ffs(mine) - 1;
      mine &= mine - 1;
      chunk_points[warp][rank++] = 8 * lane + i;
    }
    __syncwarp();
    const int g = lane % kG, slot = lane / kG;
    for (int first = 0; first < total; first += 32 / kG) {
      if (lane < 30 && first + slot < total) {
        blend(grid, points, out, int64_t(chunk) * kChunk + chunk_points[warp][first + slot], g, r0, r1, r2);
      }
    }
    __syncwarp();
  }
}

// The lookup as cuda_ext does it (one pass), for a same-code comparison.
__global__ void __launch_bounds__(kThreads, 8)
    one_pass_kernel(const float* __restrict__ grid, const float* __restrict__ points, float* __restrict__ out,
                    int64_t n_points, int64_t r0, int64_t r1, int64_t r2) {
  const int lane = threadIdx.x % 32;
  const int64_t n = (int64_t(blockIdx.x) * kThreads + threadIdx.x) / 32 * 10 + lane / kG;
  if (lane >= 30 || n >= n_points) return;
  blend(grid, points, out, n, lane % kG, r0, r1, r2);
}

}  // namespace

torch::Tensor slab_lookup(torch::Tensor grid, torch::Tensor points, int64_t slices, int64_t blocks_per_sm) {
  TORCH_CHECK(grid.is_cuda() && grid.dim() == 4 && grid.size(3) == kC && grid.is_contiguous(), "grid: (R0,R1,R2,12) cuda");
  TORCH_CHECK(points.is_cuda() && points.is_contiguous() && points.dim() == 2 && points.size(1) == 3, "points: (N,3)");
  const int64_t n = points.size(0), r0 = grid.size(0), r1 = grid.size(1), r2 = grid.size(2);
  auto out = torch::empty({n, kC}, grid.options());
  if (n == 0) return out;
  const int64_t n_chunks = (n + kChunk - 1) / kChunk, padded = n_chunks * kChunk;
  const int64_t slabs = (r0 - 2) / slices + 1;  // a.lo <= r0 - 2
  TORCH_CHECK(slabs < 255, "too many slabs");
  auto ids = torch::empty({padded}, grid.options().dtype(torch::kUInt8));
  auto stream = c10::cuda::getCurrentCUDAStream();
  slab_ids_kernel<<<(padded + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      points.data_ptr<float>(), ids.data_ptr<uint8_t>(), n, padded, r0, slices);
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, points.get_device());
  const int64_t blocks = std::min<int64_t>((n_chunks + kWarps - 1) / kWarps, sms * blocks_per_sm);
  TORCH_CHECK(n_chunks < (1LL << 31) && r0 * r1 * r2 < (1LL << 31), "sizes past int32");
  const auto kernel = blocks_per_sm >= 6 ? slab_pass_kernel<6> : slab_pass_kernel<4>;
  for (int slab = 0; slab < slabs; ++slab) {
    kernel<<<blocks, kThreads, 0, stream>>>(grid.data_ptr<float>(), points.data_ptr<float>(), ids.data_ptr<uint8_t>(),
                                            out.data_ptr<float>(), int(n_chunks), slab, int(r0), int(r1), int(r2));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}


torch::Tensor one_pass_lookup(torch::Tensor grid, torch::Tensor points) {
  const int64_t n = points.size(0);
  auto out = torch::empty({n, kC}, grid.options());
  const int64_t warps = (n + 9) / 10;
  one_pass_kernel<<<(warps * 32 + kThreads - 1) / kThreads, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      grid.data_ptr<float>(), points.data_ptr<float>(), out.data_ptr<float>(), n, grid.size(0), grid.size(1), grid.size(2));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}
"""

CPP_SRC = """
torch::Tensor slab_lookup(torch::Tensor grid, torch::Tensor points, int64_t slices, int64_t blocks_per_sm);
torch::Tensor one_pass_lookup(torch::Tensor grid, torch::Tensor points);
"""


SLAB_PASSES = (10,)  # slices per slab of the slab passes (first run: 10, 20, 27, 40, 80)
MODES = ("off", "auto", "always")  # CUDA_EXT_GRID_REORDER for cuda_ext.grid_interpolate


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    mod = load_inline("grid_slab_passes", CPP_SRC, cuda_sources=CUDA_SRC, functions=["slab_lookup", "one_pass_lookup"],
                      extra_cuda_cflags=["-O3", "-Xptxas=-v"], verbose=False)
    import cuda_ext

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench_ops import ray_points

    torch.manual_seed(0)
    r, c, n = 160, 12, 4096 * 1024
    grid = torch.randn(r, r, r, c, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    inputs = {"random": torch.rand(n, 3, device="cuda") * 2 - 1, "rays": ray_points(4096, 1024, gen)}
    for k in (2, 4, 8, 16):  # random points whose cells all lie in the first 1/k of axis 0
        p = torch.rand(n, 3, device="cuda") * 2 - 1
        p[:, 0] = (p[:, 0] + 1) / k - 1
        inputs[f"random in 1/{k} of axis 0"] = p
    scratch = torch.empty(64 << 20, device="cuda")

    def time_ms(fn) -> float:  # L2 flushed (a 256 MB write) before each timed call, as cycled inputs would
        return time_call(fn, reps=30, before=scratch.zero_)

    grid_cf = grid.permute(3, 0, 1, 2)[None].contiguous()
    results: dict[str, float] = {}
    results["grid_sample random"] = time_ms(lambda: F.grid_sample(
        grid_cf, inputs["random"].flip(-1).reshape(1, n, 1, 1, 3), align_corners=True, padding_mode="border"))
    print(f"grid_sample random: {results['grid_sample random']:.3f} ms", flush=True)
    for name, pts in inputs.items():
        ref = cuda_ext.grid_interpolate(grid, pts)
        results[f"cuda_ext {name}"] = time_ms(lambda: cuda_ext.grid_interpolate(grid, pts))
        err = (mod.one_pass_lookup(grid, pts) - ref).abs().max().item()
        results[f"one_pass {name}"] = time_ms(lambda: mod.one_pass_lookup(grid, pts))
        print(f"{name}: cuda_ext {results[f'cuda_ext {name}']:.3f} ms, one_pass {results[f'one_pass {name}']:.3f} ms "
              f"(err {err:.1e})", flush=True)
        if name not in ("random", "rays"):
            continue
        for slices in SLAB_PASSES:
            for bps in (4, 6):
                out = mod.slab_lookup(grid, pts, slices, bps)
                err = (out - ref).abs().max().item()
                key = f"slabs S={slices} bps={bps} {name}"
                results[key] = time_ms(lambda: mod.slab_lookup(grid, pts, slices, bps))
                print(f"{key}: {results[key]:.3f} ms (err {err:.1e})", flush=True)
        for mode in MODES:
            os.environ["CUDA_EXT_GRID_REORDER"] = mode
            err = (cuda_ext.grid_interpolate(grid, pts) - ref).abs().max().item()
            results[f"cuda_ext reorder={mode} {name}"] = time_ms(lambda: cuda_ext.grid_interpolate(grid, pts))
            print(f"cuda_ext reorder={mode} {name}: {results[f'cuda_ext reorder={mode} {name}']:.3f} ms (err {err:.1e})",
                  flush=True)
        os.environ.pop("CUDA_EXT_GRID_REORDER")
    report(results, "grid_sample random", args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
