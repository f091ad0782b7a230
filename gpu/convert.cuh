// Internal to gpu/ (.cu files only): loads and stores of the storage type T of the "typed"
// tensors (MODEL.md §8). Kernels never touch a T value directly: they load it with
// to_float(T) and store with from_float<T>(float); all arithmetic is in float registers.
//
// Storage types: float (identity), __nv_bfloat16 and __half. A store rounds to nearest, ties to
// even, giving the same bits as m3::float_to_bf16_bits / float_to_f16_bits of
// reference/precision.cpp for every float:
//   finite values: the hardware conversion (cvt.rn.bf16.f32 / cvt.rn.f16.f32, no flush to
//     zero): RNE, overflow to ±inf (f16: |x| ≥ 65520), f16 subnormals exact, −0 kept;
//   NaN: the reference's encoding, made explicitly (the hardware returns a canonical NaN):
//     bf16 = upper half of the float with the quiet bit set, f16 = sign | 0x7E00 | the top 10
//     payload bits.
// A load is exact; an f16 NaN keeps its sign and payload (mantissa << 13), as in the reference.
// M3_FOR_EACH_STORAGE(X) lists the storage types once, for the explicit instantiations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>

#define M3_FOR_EACH_STORAGE(X) X(float) X(__nv_bfloat16) X(__half)
#define M3_FOR_EACH_TYPED_STORAGE(X) X(__nv_bfloat16) X(__half)

namespace m3::gpu {

namespace detail {
__host__ __device__ __forceinline__ unsigned int float_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(v);
#else
  unsigned int u;
  std::memcpy(&u, &v, sizeof u);
  return u;
#endif
}
__host__ __device__ __forceinline__ float bits_float(unsigned int u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}
}  // namespace detail

__host__ __device__ __forceinline__ float to_float(float v) { return v; }
__host__ __device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return __bfloat162float(v);  // exact: the bits shifted into the upper half
}
__host__ __device__ __forceinline__ float to_float(__half v) {
  const float f = __half2float(v);
  if (f == f) return f;  // exact for every finite value and ±inf
  const unsigned int h = __half_as_ushort(v);
  return detail::bits_float(((h & 0x8000u) << 16) | 0x7F800000u | ((h & 0x03FFu) << 13));
}

template <class T>
__host__ __device__ __forceinline__ T from_float(float v);

template <>
__host__ __device__ __forceinline__ float from_float<float>(float v) { return v; }

template <>
__host__ __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  if (v == v) return __float2bfloat16_rn(v);
  const unsigned int u = detail::float_bits(v);
  return __ushort_as_bfloat16(static_cast<unsigned short>((u >> 16) | 0x0040u));
}

template <>
__host__ __device__ __forceinline__ __half from_float<__half>(float v) {
  if (v == v) return __float2half_rn(v);
  const unsigned int u = detail::float_bits(v);
  return __ushort_as_half(static_cast<unsigned short>(((u >> 16) & 0x8000u) | 0x7E00u |
                                                      ((u >> 13) & 0x03FFu)));
}

// The value a float has after a store to T and a load back (what a later stage reads).
template <class T>
__host__ __device__ __forceinline__ float round_trip(float v) {
  return to_float(from_float<T>(v));
}

}  // namespace m3::gpu
