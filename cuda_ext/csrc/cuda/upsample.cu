// Bilinear upsampling on CUDA. Grid: x = columns (coalesced), y = rows, z = planes (B*C); a thread
// computes its column's and its row's taps once, then streams through a few planes.
// - forward: one thread per output element, reading its 2x2 source taps (cached: neighbours share them);
// - backward: a gather, one thread per input element, summing the output gradients of its window
//   (no atomics). When every window is short (e.g. x2: at most 5), the window weights live in
//   registers; otherwise they are recomputed from the taps.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ops.h"
#include "upsample.h"

namespace cuda_ext {
namespace {

constexpr int kThreads = 256;
constexpr int kCachedWindow = 8;         // longest window whose weights are kept in registers
constexpr int64_t kPlanesPerThread = 8;  // planes (B*C) each thread walks through

// Threads per block along x: whole warps, up to kThreads, not much wider than the row.
dim3 block_for(int64_t width) {
  const int64_t warps = std::min<int64_t>(kThreads / 32, std::max<int64_t>(1, (width + 31) / 32));
  const int x = static_cast<int>(warps * 32);
  return dim3(x, kThreads / x, 1);
}

// Grid over (columns, rows, planes): every thread owns one column and one row, and about
// kPlanesPerThread planes, which amortises its tap computations; many small blocks keep the SMs
// evenly loaded. y and z are capped by CUDA's limits; the kernels' loops cover the rest.
dim3 grid_for(dim3 block, int64_t width, int64_t height, int64_t planes) {
  constexpr int64_t kMaxYZ = 65535;
  const int64_t gx = (width + block.x - 1) / block.x;
  const int64_t gy = std::min<int64_t>((height + block.y - 1) / block.y, kMaxYZ);
  const int64_t gz = std::min<int64_t>((planes + kPlanesPerThread - 1) / kPlanesPerThread, kMaxYZ);
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy), static_cast<unsigned>(std::max<int64_t>(gz, 1)));
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    upsample_forward_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ y, int64_t planes,
                            UpsampleAxis<at::opmath_type<scalar_t>> rows,
                            UpsampleAxis<at::opmath_type<scalar_t>> cols) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t ow = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (ow >= cols.out_size) return;
  const LinearTaps<acc_t> tw = cols.taps(ow);
  const int64_t in_plane = rows.in_size * cols.in_size, out_plane = rows.out_size * cols.out_size;
  for (int64_t oh = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; oh < rows.out_size;
       oh += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    const LinearTaps<acc_t> th = rows.taps(oh);
    for (int64_t p = blockIdx.z; p < planes; p += gridDim.z) {
      const scalar_t* top = x + p * in_plane + th.i0 * cols.in_size;
      const scalar_t* bottom = x + p * in_plane + th.i1 * cols.in_size;
      const acc_t t = tw.l0 * static_cast<acc_t>(top[tw.i0]) + tw.l1 * static_cast<acc_t>(top[tw.i1]);
      const acc_t b = tw.l0 * static_cast<acc_t>(bottom[tw.i0]) + tw.l1 * static_cast<acc_t>(bottom[tw.i1]);
      y[p * out_plane + oh * cols.out_size + ow] = static_cast<scalar_t>(th.l0 * t + th.l1 * b);
    }
  }
}

// The outputs that input `input` feeds along one axis, with their weights. kCache > 0: weights
// computed once into registers (requires the window to fit); kCache == 0: recomputed on each use.
template <typename acc_t, int kCache>
struct OutputWindow {
  int64_t input, begin, end;
  acc_t cached[kCache > 0 ? kCache : 1];

  __device__ OutputWindow(const UpsampleAxis<acc_t>& axis, int64_t i) : input(i) {
    const OutputRange range = axis.window(i);
    begin = range.begin;
    end = range.end;
    if constexpr (kCache > 0) {
#pragma unroll
      for (int j = 0; j < kCache; ++j) cached[j] = begin + j < end ? axis.weight(i, begin + j) : acc_t(0);
    }
  }

  __device__ __forceinline__ acc_t weight(const UpsampleAxis<acc_t>& axis, int j) const {
    if constexpr (kCache > 0) {
      return cached[j];
    } else {
      return axis.weight(input, begin + j);
    }
  }
};

template <typename scalar_t, int kCache>
__global__ void __launch_bounds__(kThreads)
    upsample_backward_kernel(const scalar_t* __restrict__ grad_out, scalar_t* __restrict__ grad_x, int64_t planes,
                             UpsampleAxis<at::opmath_type<scalar_t>> rows,
                             UpsampleAxis<at::opmath_type<scalar_t>> cols) {
  using acc_t = at::opmath_type<scalar_t>;
  // With a cache the loops have a fixed bound (unrolled, registers); without one, the window length.
  constexpr int kBound = kCache > 0 ? kCache : std::numeric_limits<int>::max();
  const int64_t iw = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (iw >= cols.in_size) return;
  const OutputWindow<acc_t, kCache> wcol(cols, iw);
  const int ncol = static_cast<int>(wcol.end - wcol.begin);
  const int64_t in_plane = rows.in_size * cols.in_size, out_plane = rows.out_size * cols.out_size;
  for (int64_t ih = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; ih < rows.in_size;
       ih += static_cast<int64_t>(gridDim.y) * blockDim.y) {
    const OutputWindow<acc_t, kCache> wrow(rows, ih);
    const int nrow = static_cast<int>(wrow.end - wrow.begin);
    for (int64_t p = blockIdx.z; p < planes; p += gridDim.z) {
      const scalar_t* g = grad_out + p * out_plane + wrow.begin * cols.out_size + wcol.begin;
      acc_t acc = 0;
#pragma unroll
      for (int j = 0; j < kBound; ++j) {
        if (j >= nrow) break;
        acc_t row_sum = 0;
#pragma unroll
        for (int k = 0; k < kBound; ++k) {
          if (k >= ncol) break;
          row_sum += wcol.weight(cols, k) * static_cast<acc_t>(g[j * cols.out_size + k]);
        }
        acc += wrow.weight(rows, j) * row_sum;
      }
      grad_x[p * in_plane + ih * cols.in_size + iw] = static_cast<scalar_t>(acc);
    }
  }
}

}  // namespace

at::Tensor upsample_bilinear2d_cuda(const at::Tensor& x_in, int64_t scale_factor, bool align_corners) {
  check_upsample_input(x_in, scale_factor);
  const at::Tensor x = contiguous_on(x_in, "x", at::kCUDA, "upsample_bilinear2d");
  const c10::cuda::CUDAGuard device_guard(x.device());
  if (scale_factor == 1) return x.clone();  // as F.interpolate: an exact copy
  at::Tensor y = at::empty({x.size(0), x.size(1), x.size(2) * scale_factor, x.size(3) * scale_factor}, x.options());
  if (y.numel() == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "upsample_bilinear2d_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto rows = UpsampleAxis<acc_t>::make(x.size(2), scale_factor, align_corners);
    const auto cols = UpsampleAxis<acc_t>::make(x.size(3), scale_factor, align_corners);
    const int64_t planes = x.size(0) * x.size(1);
    const auto kernel = upsample_forward_kernel<scalar_t>;
    const dim3 block = block_for(cols.out_size);
    const dim3 grid = grid_for(block, cols.out_size, rows.out_size, planes);
    kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(x.const_data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                                                                  planes, rows, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return y;
}

at::Tensor upsample_bilinear2d_backward_cuda(const at::Tensor& grad_out_in, int64_t input_height, int64_t input_width,
                                             int64_t scale_factor, bool align_corners) {
  check_upsample_backward_input(grad_out_in, input_height, input_width, scale_factor);
  const at::Tensor grad_out = contiguous_on(grad_out_in, "grad_out", at::kCUDA, "upsample_bilinear2d_backward");
  const c10::cuda::CUDAGuard device_guard(grad_out.device());
  if (scale_factor == 1) return grad_out.clone();
  at::Tensor grad_x = at::empty({grad_out.size(0), grad_out.size(1), input_height, input_width}, grad_out.options());
  if (grad_x.numel() == 0) return grad_x;
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad_out.scalar_type(), "upsample_bilinear2d_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const auto rows = UpsampleAxis<acc_t>::make(input_height, scale_factor, align_corners);
        const auto cols = UpsampleAxis<acc_t>::make(input_width, scale_factor, align_corners);
        const int64_t planes = grad_out.size(0) * grad_out.size(1);
        const bool windows_fit = std::max(rows.max_window(), cols.max_window()) <= kCachedWindow;
        const auto kernel =
            windows_fit ? upsample_backward_kernel<scalar_t, kCachedWindow> : upsample_backward_kernel<scalar_t, 0>;
        const dim3 block = block_for(input_width);
        const dim3 grid = grid_for(block, input_width, input_height, planes);
        kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(grad_out.const_data_ptr<scalar_t>(),
                                                                      grad_x.data_ptr<scalar_t>(), planes, rows, cols);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  return grad_x;
}

}  // namespace cuda_ext
