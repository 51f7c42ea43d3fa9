// Small pieces every op family needs on both sides: the CUDA_EXT_HOST_DEVICE marker for math shared by
// the C++ and CUDA kernels, the dtype and device checks with their user-facing messages (worded as the
// Python wrappers' checks in cuda_ext/_checks.py), compile-time dispatch helpers, and (in .cu files)
// device attributes and launch sizes.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

// Math shared by the C++ and CUDA kernels: a host and device function under nvcc, forced inline on the
// device (each call sits in a kernel's inner loop); a plain inline function in C++.
#if defined(__CUDACC__) || defined(__HIPCC__)
#define CUDA_EXT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CUDA_EXT_HOST_DEVICE inline
#endif

namespace cuda_ext {

// float32/float64 everywhere; float16/bfloat16 only on CUDA, where kernels compute in float.
inline void check_floating_dtype(const at::Tensor& t, const char* op, const char* arg) {
  const auto dtype = t.scalar_type();
  if (dtype == at::kFloat || dtype == at::kDouble) return;
  TORCH_CHECK(!t.is_cpu(), op, ": ", arg,
              " must be float32 or float64 on the CPU (float16/bfloat16 are CUDA only), got ", dtype);
  const bool half = dtype == at::kHalf || dtype == at::kBFloat16;
  TORCH_CHECK(half && t.is_cuda(), op, ": ", arg, " must be float32 or float64 (or float16/bfloat16 on CUDA), got ",
              dtype);
}

// t must live on the backend whose kernel is running. The dispatcher picks the kernel from all tensor
// arguments (CUDA wins over CPU), so a CPU tensor can reach a CUDA kernel beside a CUDA one: this stops
// it before its pointer is used.
inline void check_device_type(const at::Tensor& t, const char* name, at::DeviceType expected, const char* op) {
  TORCH_CHECK(t.device().type() == expected, op, ": ", name, " must be a ", c10::DeviceTypeName(expected),
              " tensor here, got one on ", t.device());
}

// t after check_device_type, made contiguous: what the elementwise and upsample kernels index.
inline at::Tensor contiguous_on(const at::Tensor& t, const char* name, at::DeviceType expected, const char* op) {
  check_device_type(t, name, expected, op);
  return t.contiguous();
}

// t (called arg) must have the device and dtype of like (called like_arg).
inline void check_same_device_and_dtype(const at::Tensor& t, const at::Tensor& like, const char* op, const char* arg,
                                        const char* like_arg) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", arg, " and ", like_arg, " must be on the same device, got ",
              t.device(), " and ", like.device());
  TORCH_CHECK(t.scalar_type() == like.scalar_type(), op, ": ", arg, " and ", like_arg,
              " must have the same dtype, got ", t.scalar_type(), " and ", like.scalar_type());
}

// Calls fn(std::integral_constant<int, VEC>) with VEC = kWide if `wide`, else 1.
template <int kWide, typename Fn>
void with_vector_width(bool wide, Fn&& fn) {
  if (wide) {
    fn(std::integral_constant<int, kWide>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

// Calls fn(integral_constant<int, G>) for a lane group of G in 1..4 (G > 4 runs as 4): how many lanes of a
// warp share one point in the CUDA lookups that split a point's channels over lanes.
template <typename Fn>
void with_lane_group(int64_t group, Fn&& fn) {
  switch (group) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}

// Calls fn(bool_constant<A>, bool_constant<B>) for the runtime pair (a, b), not both false: which
// gradients a backward kernel computes, as template arguments.
template <typename Fn>
void with_gradient_flags(bool a, bool b, Fn&& fn) {
  if (a && b) {
    fn(std::true_type{}, std::true_type{});
  } else if (a) {
    fn(std::true_type{}, std::false_type{});
  } else {
    fn(std::false_type{}, std::true_type{});
  }
}

}  // namespace cuda_ext

#if defined(__CUDACC__)
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>

namespace cuda_ext {

// An attribute of the current device (SM count, L2 size, ...).
inline int current_device_attribute(cudaDeviceAttr attribute) {
  int value = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&value, attribute, c10::cuda::current_device()));
  return value;
}

// Blocks of `threads` threads of `kernel` that are resident on the whole device at once: the grid
// size for grid-stride loops (more blocks only queue; fewer leave SMs idle).
template <typename Kernel>
int resident_blocks(Kernel kernel, int threads) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  return std::max(per_sm, 1) * current_device_attribute(cudaDevAttrMultiProcessorCount);
}

// Blocks of block_threads threads that cover `threads` threads of a point op's one launch.
inline unsigned int block_count(int64_t threads, int block_threads, const char* op) {
  const int64_t blocks = (threads + block_threads - 1) / block_threads;
  TORCH_CHECK(blocks <= std::numeric_limits<int>::max(), op, ": too many points for one launch (", threads,
              " threads)");
  return static_cast<unsigned int>(blocks);
}

}  // namespace cuda_ext
#endif
