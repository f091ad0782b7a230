// Internal to gpu/ (.cu files only): loads and stores of the storage type T of the "typed"
// tensors (MODEL.md §8). Kernels never touch a T value directly: they load it with
// to_float(T) and store with from_float<T>(float); all arithmetic is in float registers.
// Only float storage exists now (both are the identity); bf16/f16 add an overload of
// to_float and a specialisation of from_float here (round to nearest even on store).
#pragma once

#include <cuda_runtime.h>

namespace m3::gpu {

__host__ __device__ __forceinline__ float to_float(float v) { return v; }

template <class T>
__host__ __device__ __forceinline__ T from_float(float v);

template <>
__host__ __device__ __forceinline__ float from_float<float>(float v) { return v; }

// The value a float has after a store to T and a load back (what a later stage reads).
template <class T>
__host__ __device__ __forceinline__ float round_trip(float v) {
  return to_float(from_float<T>(v));
}

}  // namespace m3::gpu
