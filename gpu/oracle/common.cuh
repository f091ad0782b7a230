// Internal to gpu/oracle (.cu files): the oracle's own small helpers, independent of the
// production path's headers — an elementwise launch over 64-bit indices, and the scalar
// functions of MODEL.md §4 F3/F7 and §12.1–2 in double. (Errors: M3_CUDA_CHECK and
// M3_CUBLAS_CHECK of gpu/core/cuda_check.hpp, which only turn a status into m3::Error.)
//
// each(s, n, f) runs f(i) for every i in [0, n) on stream s: one thread per index, a grid-stride
// loop, so n may exceed 2³¹ and no grid limit applies. Every index the kernels form is an Idx
// (int64).
//
// column_sum(s, rows, dim, term, out) adds out[j] += Σ_r term(r, j) for every column j < dim:
// the sum of a column over all rows, as a bias's or a norm weight's gradient needs. Its order is
// fixed: kSumLanes interleaved partial sums, lane ℓ over r ≡ ℓ (mod kSumLanes) ascending, then
// the lanes' sums in lane order. One block per 32 columns, a thread per (column, lane), so that
// a sum over B·T rows is not one thread's latency-bound loop.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>

#include "config.hpp"
#include "../core/cuda_check.hpp"

namespace m3::gpu::oracle {

constexpr double kEps = 1e-5;  // every RMS (MODEL.md §0)
constexpr double kPi = 3.141592653589793238462643383280;
constexpr double kTwoPi = 6.283185307179586476925286766559;

template <class F>
__global__ void each_kernel(Idx n, F f) {
  const Idx stride = static_cast<Idx>(gridDim.x) * blockDim.x;
  for (Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) f(i);
}

template <class F>
void each(cudaStream_t s, Idx n, F f) {
  if (n <= 0) return;
  constexpr int kThreads = 128;
  const Idx blocks = std::min<Idx>((n + kThreads - 1) / kThreads, Idx(1) << 16);
  each_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, s>>>(n, f);
  M3_CUDA_CHECK(cudaGetLastError());
}

constexpr int kSumLanes = 32;

template <class F>
__global__ void column_sum_kernel(Idx rows, Idx dim, F term, double* out) {
  __shared__ double part[kSumLanes][32];
  const Idx j = static_cast<Idx>(blockIdx.x) * 32 + threadIdx.x;
  const int lane = static_cast<int>(threadIdx.y);
  double acc = 0.0;
  if (j < dim)
    for (Idx r = lane; r < rows; r += kSumLanes) acc += term(r, j);
  part[lane][threadIdx.x] = acc;
  __syncthreads();
  if (lane == 0 && j < dim) {
    double sum = 0.0;
    for (int k = 0; k < kSumLanes; ++k) sum += part[k][threadIdx.x];
    out[j] += sum;
  }
}

template <class F>
void column_sum(cudaStream_t s, Idx rows, Idx dim, F term, double* out) {
  if (dim <= 0) return;
  const Idx blocks = (dim + 31) / 32;
  column_sum_kernel<<<static_cast<unsigned>(blocks), dim3(32, kSumLanes), 0, s>>>(rows, dim, term,
                                                                                   out);
  M3_CUDA_CHECK(cudaGetLastError());
}

__device__ inline double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }
// softplus(v) = v for v > 20, else log(1 + eᵛ); its derivative 1 for v > 20, else σ(v) (§12.2).
__device__ inline double softplus(double v) { return v > 20.0 ? v : log1p(exp(v)); }
__device__ inline double softplus_grad(double v) { return v > 20.0 ? 1.0 : sigmoid(v); }
// φ(v) = 1 + v (v ≥ 0), 1/(1 − v) (v < 0); φ'(v) = 1 (v ≥ 0), 1/(1 − v)² (v < 0) (§12.1).
__device__ inline double heavy_tail(double v) { return v >= 0.0 ? 1.0 + v : 1.0 / (1.0 - v); }
__device__ inline double heavy_tail_grad(double v) {
  return v >= 0.0 ? 1.0 : 1.0 / ((1.0 - v) * (1.0 - v));
}
__device__ inline double silu(double v) { return v * sigmoid(v); }
__device__ inline double silu_grad(double v) {
  const double s = sigmoid(v);
  return s * (1.0 + v * (1.0 - s));
}
// v − 2π·⌊v/2π⌋ ∈ [0, 2π); a result that rounds to 2π becomes 0 (MODEL.md §4 F5).
__device__ inline double wrap_two_pi(double v) {
  const double w = v - kTwoPi * floor(v / kTwoPi);
  return w >= kTwoPi ? 0.0 : w;
}

}  // namespace m3::gpu::oracle
