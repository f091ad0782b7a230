// Internal to gpu/ (.cu files only): the scalar activations of MODEL.md §4 F3/F7 and their
// derivatives, in float, written exactly as reference/stages.hpp writes them (same branch
// rules, §12.1–2) with the precise CUDA functions (expf, log1pf; no fast-math intrinsics).
#pragma once

#include <cuda_runtime.h>

namespace m3::gpu {

__device__ __forceinline__ float sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }
// softplus(v) = v if v > 20 else log(1 + eᵛ); its derivative 1 if v > 20 else σ(v).
__device__ __forceinline__ float softplus(float v) { return v > 20.0f ? v : log1pf(expf(v)); }
__device__ __forceinline__ float softplus_grad(float v) { return v > 20.0f ? 1.0f : sigmoid(v); }
// Heavy-tail φ(v) = 1 + v (v ≥ 0), 1/(1 − v) (v < 0); φ'(v) = 1 (v ≥ 0), 1/(1 − v)² (v < 0).
__device__ __forceinline__ float heavy_tail(float v) {
  return v >= 0.0f ? 1.0f + v : 1.0f / (1.0f - v);
}
__device__ __forceinline__ float heavy_tail_grad(float v) {
  return v >= 0.0f ? 1.0f : 1.0f / ((1.0f - v) * (1.0f - v));
}
// silu(v) = v·σ(v); silu'(v) = σ(v)·(1 + v·(1 − σ(v))).
__device__ __forceinline__ float silu(float v) { return v * sigmoid(v); }
__device__ __forceinline__ float silu_grad(float v) {
  const float s = sigmoid(v);
  return s * (1.0f + v * (1.0f - s));
}

}  // namespace m3::gpu
