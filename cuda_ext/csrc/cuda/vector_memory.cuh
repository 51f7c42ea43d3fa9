// 16-byte vector loads, stores and atomic adds shared by the CUDA kernels. A Vec<T, N> is N elements
// moved as whole machine words (16 bytes, or fewer when the vector is smaller), so a warp's accesses
// become few wide transactions; the caller guarantees alignment (see aligned_to).
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace cuda_ext {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <int Bytes>
struct RawWord;
template <>
struct RawWord<16> {
  using type = uint4;
};
template <>
struct RawWord<8> {
  using type = uint2;
};
template <>
struct RawWord<4> {
  using type = unsigned int;
};
template <>
struct RawWord<2> {
  using type = unsigned short;
};

// Loads N elements at p. kStreaming marks data read exactly once (evict-first), so it does not
// push reused data out of L2; otherwise the read-only path (ld.global.nc).
template <typename T, int N, bool kStreaming>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  constexpr int kBytes = sizeof(Vec<T, N>);
  constexpr int kWordBytes = kBytes < 16 ? kBytes : 16;
  using Word = typename RawWord<kWordBytes>::type;
  const Word* src = reinterpret_cast<const Word*>(p);
  Word words[kBytes / kWordBytes];
#pragma unroll
  for (int i = 0; i < kBytes / kWordBytes; ++i) words[i] = kStreaming ? __ldcs(src + i) : __ldg(src + i);
  Vec<T, N> out;
  memcpy(&out, words, kBytes);
  return out;
}

// Streaming store: outputs are not read again by the kernel that writes them.
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& value) {
  constexpr int kBytes = sizeof(Vec<T, N>);
  constexpr int kWordBytes = kBytes < 16 ? kBytes : 16;
  using Word = typename RawWord<kWordBytes>::type;
  Word words[kBytes / kWordBytes];
  memcpy(words, &value, kBytes);
  Word* dst = reinterpret_cast<Word*>(p);
#pragma unroll
  for (int i = 0; i < kBytes / kWordBytes; ++i) __stcs(dst + i, words[i]);
}

// Element-wise conversion between a stored vector and the accumulation type.
template <typename acc_t, typename T, int N>
__device__ __forceinline__ void widen(const Vec<T, N>& v, acc_t (&out)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) out[e] = static_cast<acc_t>(v.v[e]);
}

template <typename T, typename acc_t, int N>
__device__ __forceinline__ Vec<T, N> narrow(const acc_t (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int e = 0; e < N; ++e) v.v[e] = static_cast<T>(in[e]);
  return v;
}

// dst[0..N) += value[0..N) atomically (dst aligned to N elements; for float, N a multiple of 4: to 16 bytes).
// Hopper (sm_90) has a 16-byte float4 atomic: one L2 transaction instead of four.
template <typename acc_t, int N>
__device__ __forceinline__ void atomic_add_vec(acc_t* dst, const acc_t (&value)[N]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if constexpr (std::is_same<acc_t, float>::value && N % 4 == 0) {
#pragma unroll
    for (int e = 0; e < N; e += 4) {
      atomicAdd(reinterpret_cast<float4*>(dst + e), make_float4(value[e], value[e + 1], value[e + 2], value[e + 3]));
    }
  } else
#endif
  {
#pragma unroll
    for (int e = 0; e < N; ++e) atomicAdd(dst + e, value[e]);
  }
}

// Host side: whether p may be accessed with vectors of `bytes` bytes (nullptr counts as aligned).
inline bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(p) % static_cast<std::uintptr_t>(bytes) == 0;
}

}  // namespace cuda_ext
