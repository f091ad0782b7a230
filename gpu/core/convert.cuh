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
// A load is exact; an f16 NaN keeps its sign and payload (mantissa << 13), as in the reference,
// except in a vector load of values that only feed arithmetic (Use::kArith below), where any NaN
// gives the same results.
// M3_FOR_EACH_STORAGE(X) lists the storage types once, for the explicit instantiations.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <type_traits>

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

// round_trip of two values in one paired conversion, for values that only feed arithmetic: the
// same as round_trip for every value but NaN, which comes back as a NaN with the hardware's
// canonical payload (the one any GPU arithmetic on it gives) instead of its own. A value that is
// stored unchanged must go through from_float.
template <class T>
__device__ __forceinline__ void round_trip2(float& a, float& b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 w = __floats2bfloat162_rn(a, b);
    const unsigned int u = *reinterpret_cast<const unsigned int*>(&w);  // a low, b high
    a = __uint_as_float(u << 16), b = __uint_as_float(u & 0xFFFF0000u);
  } else if constexpr (std::is_same_v<T, __half>) {
    const __half2 w = __floats2half2_rn(a, b);
    a = __low2float(w), b = __high2float(w);
  }
}

// What a loaded value is for, in the loads below. kStored (the default): it may be stored
// unchanged, so an f16 NaN keeps its sign and payload (to_float's value). kArith: it only feeds
// float arithmetic, whose NaN results carry the hardware's canonical payload whatever the
// operands' payloads, so the hardware conversion alone gives the same results for every input.
// kArith's f16 load has no NaN test, and above all no branch on the loaded value: kStored's
// branch waits for its load, so the loads after it are issued only then and a kernel's loads no
// longer overlap (ncu, f16 prep: 9.4 cycles per instruction waiting on L1TEX against bf16's 5.4).
enum class Use { kStored, kArith };

// Vector access: N consecutive values of storage T as floats, in one load / store of
// N·sizeof(T) bytes (4, 8 or 16; the caller guarantees that alignment — see is_aligned). The
// values are the same as N scalar to_float / from_float calls.
template <class T, int N>
struct alignas(sizeof(T) * N) VecOf {
  T e[N];
};
// f16: the pairs converted by the hardware (exact for every value but a NaN, whose payload it
// drops), then one test of the whole vector for a NaN half — (bits & 0x7FFF) + 0x03FF reaches
// 0x8000 exactly when the exponent is all ones and the mantissa is not zero, two halves per word
// without a carry between them — and to_float's exact values only then: the NaN handling costs
// ≈ 1 instruction per value instead of a test and a select per value. Use::kArith: the hardware
// conversion alone.
template <int N, Use U = Use::kStored, class T>
__device__ __forceinline__ void load_n(const T* p, float (&v)[N]) {
  static_assert(sizeof(T) * N == 4 || sizeof(T) * N == 8 || sizeof(T) * N == 16, "vector width");
  if constexpr (std::is_same_v<T, __half>) {
    const VecOf<unsigned int, N / 2> u = *reinterpret_cast<const VecOf<unsigned int, N / 2>*>(p);
    unsigned int nan = 0u;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&u.e[i]));
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
      if constexpr (U == Use::kStored) nan |= (u.e[i] & 0x7FFF7FFFu) + 0x03FF03FFu;
    }
    if (U == Use::kStored && (nan & 0x80008000u)) {  // rare: the values again, exactly
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = to_float(p[i]);
    }
  } else {
    const VecOf<T, N> w = *reinterpret_cast<const VecOf<T, N>*>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = to_float(w.e[i]);
  }
}
// Two values as T in one 32-bit word (a at the lower address), the bits of from_float<T> for
// each: one paired conversion (cvt.rn.{bf16,f16}x2.f32), the NaN encoding made only when a or
// b is a NaN.
template <class T>
__device__ __forceinline__ unsigned int pack2(float a, float b) {
  static_assert(sizeof(T) == 2, "16-bit storage types");
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 w = a == a && b == b ? __floats2bfloat162_rn(a, b)
                                              : __halves2bfloat162(from_float<T>(a),
                                                                   from_float<T>(b));
    return *reinterpret_cast<const unsigned int*>(&w);
  } else {
    const __half2 w = a == a && b == b ? __floats2half2_rn(a, b)
                                       : __halves2half2(from_float<T>(a), from_float<T>(b));
    return *reinterpret_cast<const unsigned int*>(&w);
  }
}
template <int N, class T>
__device__ __forceinline__ void store_n(T* p, const float (&v)[N]) {
  static_assert(sizeof(T) * N == 4 || sizeof(T) * N == 8 || sizeof(T) * N == 16, "vector width");
  if constexpr (sizeof(T) == 2) {  // pairs: one conversion each
    VecOf<unsigned int, N / 2> w;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) w.e[i] = pack2<T>(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<VecOf<unsigned int, N / 2>*>(p) = w;
  } else {
    VecOf<T, N> w;
#pragma unroll
    for (int i = 0; i < N; ++i) w.e[i] = from_float<T>(v[i]);
    *reinterpret_cast<VecOf<T, N>*>(p) = w;
  }
}
// N consecutive values at p as floats (and back): accesses of min(16, N·sizeof(T)) bytes (p
// aligned to that) when that is at least 4 bytes, else element by element.
template <int N, Use U = Use::kStored, class T>
__device__ __forceinline__ void load_vec(const T* p, float (&v)[N]) {
  constexpr int P = N * sizeof(T) > 16 ? 16 / sizeof(T) : N;  // values per access
#pragma unroll
  for (int h = 0; h < N; h += P) {
    float w[P];
    if constexpr (P * sizeof(T) >= 4) {
      load_n<P, U>(p + h, w);
    } else {
#pragma unroll
      for (int e = 0; e < P; ++e) w[e] = to_float(p[h + e]);
    }
#pragma unroll
    for (int e = 0; e < P; ++e) v[h + e] = w[e];
  }
}
template <int N, class T>
__device__ __forceinline__ void store_vec(T* p, const float (&v)[N]) {
  constexpr int P = N * sizeof(T) > 16 ? 16 / sizeof(T) : N;
#pragma unroll
  for (int h = 0; h < N; h += P) {
    float w[P];
#pragma unroll
    for (int e = 0; e < P; ++e) w[e] = v[h + e];
    if constexpr (P * sizeof(T) >= 4) {
      store_n<P>(p + h, w);
    } else {
#pragma unroll
      for (int e = 0; e < P; ++e) p[h + e] = from_float<T>(w[e]);
    }
  }
}

// The group of V values at p of a row with m values left: load_vec / store_vec when kVec (the
// caller checked width and alignment), else element by element, values at or past m neither
// read (set to 0) nor written. Both give the same values.
template <bool kVec, Use U = Use::kStored, int V, class T>
__device__ __forceinline__ void load_group(const T* p, long long m, float (&v)[V]) {
  if constexpr (kVec) {
    load_vec<V, U>(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = j < m ? to_float(p[j]) : 0.0f;
  }
}
template <bool kVec, int V, class T>
__device__ __forceinline__ void store_group(T* p, long long m, const float (&v)[V]) {
  if constexpr (kVec) {
    store_vec<V>(p, v);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j)
      if (j < m) p[j] = from_float<T>(v[j]);
  }
}
// The group of V values from element n of a row of len values, which may start past the row:
// load_group / store_group of the part inside it; a group starting at or past len is all 0 and
// writes nothing. kVec as for load_group: every group starting inside the row is whole and
// aligned.
template <bool kVec, Use U = Use::kStored, int V, class T>
__device__ __forceinline__ void load_row_group(const T* row, long long n, long long len,
                                               float (&v)[V]) {
  if (n < len) {
    load_group<kVec, U>(row + n, len - n, v);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) v[j] = 0.0f;
  }
}
template <bool kVec, int V, class T>
__device__ __forceinline__ void store_row_group(T* row, long long n, long long len,
                                                const float (&v)[V]) {
  if (n < len) store_group<kVec>(row + n, len - n, v);
}

// Whether p is aligned to `bytes` (a power of two).
__host__ __device__ __forceinline__ bool is_aligned(const void* p, unsigned bytes) {
  return (reinterpret_cast<unsigned long long>(p) & (bytes - 1)) == 0;
}
// Whether every pointer is aligned to `bytes` (null counts as aligned).
template <class... P>
__host__ __device__ __forceinline__ bool all_aligned(unsigned bytes, const P*... ps) {
  return (is_aligned(ps, bytes) && ...);
}

}  // namespace m3::gpu
