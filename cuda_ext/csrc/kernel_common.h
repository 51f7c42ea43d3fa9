// Small pieces every op family needs on both sides: the HOST_DEVICE marker for math shared by the
// C++ and CUDA kernels, the dtype and device checks with their user-facing messages, and (in .cu
// files) device attributes and the number of blocks that fit on the device at once.
#pragma once

#include <ATen/ATen.h>

// Same spelling as ATen/native/Pow.h, so including both is harmless.
#ifndef HOST_DEVICE
#if defined(__CUDACC__) || defined(__HIPCC__)
#define HOST_DEVICE __host__ __device__
#else
#define HOST_DEVICE
#endif
#endif

namespace cuda_ext {

// float32/float64 everywhere; float16/bfloat16 only on CUDA, where kernels compute in float.
inline void check_floating_dtype(const at::Tensor& t, const char* op, const char* arg) {
  const auto dtype = t.scalar_type();
  const bool everywhere = dtype == at::kFloat || dtype == at::kDouble;
  const bool cuda_only = dtype == at::kHalf || dtype == at::kBFloat16;
  TORCH_CHECK(
      everywhere || (cuda_only && t.is_cuda()), op, ": ", arg,
      " must be float32 or float64 (float16/bfloat16 also on CUDA), got ", dtype, " on ", t.device());
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

inline void check_same_device_and_dtype(
    const at::Tensor& t, const at::Tensor& like, const char* op, const char* arg, const char* like_arg) {
  TORCH_CHECK(
      t.device() == like.device(), op, ": ", arg, " must be on the same device as ", like_arg, " (",
      like.device(), "), got ", t.device());
  TORCH_CHECK(
      t.scalar_type() == like.scalar_type(), op, ": ", arg, " must have the same dtype as ", like_arg, " (",
      like.scalar_type(), "), got ", t.scalar_type());
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

}  // namespace cuda_ext
#endif
