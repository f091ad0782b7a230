// The negative controls' corruption kernels (fault_kernels.cuh).
#include "fault_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "common.cuh"
#include "convert.cuh"

namespace m3::gpu {

namespace {

constexpr int kFaultThreads = 256;

__global__ void flip_angle_kernel(Idx n, float* theta) {
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n && theta[i] > 0.0f) theta[i] = 6.2831853071795864769f - theta[i];
}

// y[b, t] ← y[b, t−1] for every chunk start t = c·cs, c ≥ 1 (rows of width di).
template <class T>
__global__ void chunk_boundary_kernel(Idx B, Idx T_, Idx cs, Idx di, T* y) {
  const Idx nc = (T_ + cs - 1) / cs;
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * (nc - 1) * di) return;
  const Idx col = i % di, c = 1 + (i / di) % (nc - 1), b = i / (di * (nc - 1));
  const Idx t = c * cs;
  y[(b * T_ + t) * di + col] = y[(b * T_ + t - 1) * di + col];
}

// One more rounding to a coarser format: bf16 (f32/f16 storage), or 5 mantissa bits (bf16).
template <class T>
__global__ void round_twice_kernel(Idx n, T* y) {
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = to_float(y[i]);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    unsigned int u = __float_as_uint(v);
    u = (u + 0x3FFFFu + ((u >> 18) & 1u)) & 0xFFFC0000u;  // RNE to 5 explicit mantissa bits
    v = __uint_as_float(u);
  } else {
    v = __bfloat162float(__float2bfloat16_rn(v));
  }
  y[i] = from_float<T>(v);
}

}  // namespace

void fault_flip_angle(cudaStream_t s, Idx n, float* theta) {
  if (n == 0) return;
  flip_angle_kernel<<<blocks_for(n, kFaultThreads), kFaultThreads, 0, s>>>(n, theta);
  M3_LAUNCH_CHECK();
}

template <class T>
void fault_chunk_boundary(cudaStream_t s, Idx B, Idx T_, Idx cs, Idx di, T* y) {
  const Idx nc = (T_ + cs - 1) / cs;
  if (nc <= 1) return;
  chunk_boundary_kernel<T>
      <<<blocks_for(B * (nc - 1) * di, kFaultThreads), kFaultThreads, 0, s>>>(B, T_, cs, di, y);
  M3_LAUNCH_CHECK();
}

template <class T>
void fault_round_twice(cudaStream_t s, Idx n, T* y) {
  if (n == 0) return;
  round_twice_kernel<T><<<blocks_for(n, kFaultThreads), kFaultThreads, 0, s>>>(n, y);
  M3_LAUNCH_CHECK();
}

#define M3_INSTANTIATE(T)                                                       \
  template void fault_chunk_boundary<T>(cudaStream_t, Idx, Idx, Idx, Idx, T*); \
  template void fault_round_twice<T>(cudaStream_t, Idx, T*);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
