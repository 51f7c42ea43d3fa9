// Zeroing a packed tensor's padding rows on the device: the rows from ray_offsets[rays] (read on the device, so no
// host sync) to N. march_rays_capped's packs end below N; the backward kernels write only the rows some ray covers.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

namespace cuda_ext {

template <typename scalar_t>
__global__ void zero_rows_from_kernel(scalar_t* __restrict__ rows, int64_t words, int64_t row_words,
                                      const int64_t* __restrict__ first_row) {
  const int64_t first = max(__ldg(first_row), int64_t(0)) * row_words;  // one word for every thread: a broadcast
  // from the first padding word on: an unpadded pack (first = N) costs the launch alone, no pass over its rows
  for (int64_t i = first + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words;
       i += int64_t(gridDim.x) * blockDim.x) {
    rows[i] = scalar_t(0);
  }
}

// rows (N, ...) contiguous: every row from *first_row (a device int64; clamped to [0, N] by the loop) is set to 0.
template <typename scalar_t>
inline void zero_rows_from(const at::Tensor& rows, const int64_t* first_row) {
  const int64_t words = rows.numel();
  if (words == 0) return;
  const int64_t row_words = rows.dim() > 1 ? words / rows.size(0) : 1;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((words + kThreads - 1) / kThreads, 4096);  // grid-stride beyond
  zero_rows_from_kernel<scalar_t>
      <<<static_cast<unsigned int>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
          rows.data_ptr<scalar_t>(), words, row_words, first_row);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda_ext
