// sampled_tv on CUDA (tv.h). One thread per (cell, channel) in a grid-stride loop: a warp's threads read
// neighbouring channels of the same rows, so each of a cell's four rows is one coalesced run of C elements. The
// gradients go in with atomicAdd (samples may share rows, ~4 x 65536 rows of a grid of millions: collisions are
// rare); each block sums its threads' squared differences in double and adds the scaled sum to the 0-d output
// once. Cells out of range are skipped (the wrapper rejects them before the launch). Two launches: the output's
// zero fill and the kernel; no host sync.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "kernel_common.h"
#include "ops.h"
#include "tv.h"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    sampled_tv_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ g, const int64_t* __restrict__ cells,
                      int64_t s_cells, int64_t channels, TvLayout layout, double k, double* __restrict__ total) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto two_k = static_cast<acc_t>(2 * k);
  double local = 0;
  const int64_t elements = s_cells * channels;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < elements; e += gridDim.x * int64_t(blockDim.x)) {
    const int64_t s = e / channels, c = e - s * channels;
    const int64_t cell = cells[s];
    if (cell < 0 || cell >= layout.cells) continue;
    double weight[3];
    const int64_t at_corner = layout.corner(cell, weight) * channels + c;
    acc_t next[3], g_next[3];
    for (int a = 0; a < 3; ++a) next[a] = static_cast<acc_t>(x[at_corner + layout.stride(a) * channels]);
    local += static_cast<double>(tv_channel<acc_t>(static_cast<acc_t>(x[at_corner]), next, weight, two_k, g_next));
    for (int a = 0; a < 3; ++a)
      atomicAdd(g + at_corner + layout.stride(a) * channels, static_cast<scalar_t>(g_next[a]));
    atomicAdd(g + at_corner, static_cast<scalar_t>(-(g_next[0] + g_next[1] + g_next[2])));
  }
  // the block's sum: warps by shuffles, then the warps' sums through shared memory
  for (int offset = 16; offset > 0; offset /= 2) local += __shfl_down_sync(0xffffffffu, local, offset);
  __shared__ double warp_sums[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = local;
  __syncthreads();
  if (warp == 0) {
    local = lane < kThreads / 32 ? warp_sums[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) local += __shfl_down_sync(0xffffffffu, local, offset);
    if (lane == 0 && local != 0.0) atomicAdd(total, local * k);
  }
}

}  // namespace

at::Tensor sampled_tv_cuda(const at::Tensor& grad, const at::Tensor& values, const at::Tensor& cells,
                           at::IntArrayRef shape, at::IntArrayRef inside, double outside, double scale) {
  const TvLayout layout = check_sampled_tv_inputs(grad, values, cells, shape, inside, outside, scale, at::kCUDA);
  const c10::cuda::CUDAGuard guard(values.device());
  at::Tensor total = at::zeros({}, values.options().dtype(at::kDouble));
  const int64_t s_cells = cells.size(0), channels = values.size(1);
  if (s_cells == 0 || channels == 0) return total;
  const double k = scale / (static_cast<double>(s_cells) * static_cast<double>(channels));
  AT_DISPATCH_FLOATING_TYPES(values.scalar_type(), "sampled_tv_cuda", [&] {
    const auto kernel = sampled_tv_kernel<scalar_t>;
    const unsigned int blocks = std::min<unsigned int>(block_count(s_cells * channels, kThreads, "sampled_tv"),
                                                       resident_blocks(kernel, kThreads));
    kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        values.const_data_ptr<scalar_t>(), grad.data_ptr<scalar_t>(), cells.const_data_ptr<int64_t>(), s_cells,
        channels, layout, k, total.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return total;
}

}  // namespace cuda_ext
