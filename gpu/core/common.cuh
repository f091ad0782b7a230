// Internal to gpu/ (.cu files only): raw handles of a GpuContext, an RAII device array, launch
// checks, and the fixed-order reductions every kernel uses (MODEL.md §7: no floating-point
// atomics; warp reductions always in the same butterfly order; one writer per output).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <vector>

#include "context.hpp"
#include "cuda_check.hpp"
#include "config.hpp"

namespace m3::gpu {

struct GpuContext::Impl {
  int device = 0;
  cudaStream_t stream = nullptr;
  cublasHandle_t cublas = nullptr;
  void* workspace = nullptr;  // fixed cuBLAS workspace
  std::size_t workspace_bytes = 0;
};

inline cudaStream_t stream_of(const GpuContext& c) { return c.impl().stream; }
inline cublasHandle_t cublas_of(const GpuContext& c) { return c.impl().cublas; }

// Checks the launch that just happened (configuration errors surface here, not later).
#define M3_LAUNCH_CHECK() M3_CUDA_CHECK(cudaGetLastError())

inline unsigned int blocks_for(Idx n, int threads) {
  return static_cast<unsigned int>((n + threads - 1) / threads);
}

// ptr + off, null staying null (an optional tensor): a [BT, ...] tensor from a given row on, so
// that the row kernels work in 32-bit offsets (their launchers' slabs; the fused tail's chunks).
template <class P>
__host__ __device__ __forceinline__ P* shifted(P* ptr, Idx off) {
  return ptr ? ptr + off : ptr;
}

// Asks L2 to fetch [p, p + bytes) ahead of its loads: one bulk request (sm_90's
// cp.async.bulk.prefetch.L2; p 16-byte aligned, bytes a multiple of 16), issued by one thread.
// A hint: no value changes, nothing to wait for, and nothing on older architectures.
__device__ __forceinline__ void prefetch_l2(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)),
               "r"(bytes)
               : "memory");
#endif
}

// kBytes (4 or 8) global → shared by cp.async.ca (sm_80+), or kBytes zeros when !valid
// (src-size 0: src is not read, but must be a global address): in flight without a register;
// the caller waits (cp.async.wait_all, or groups below) and makes the copies visible (a barrier).
template <int kBytes>
__device__ __forceinline__ void cp_async_zfill(void* dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8, "cp.async.ca copies 4, 8 or 16 bytes");
  asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(dst))),
               "l"(__cvta_generic_to_global(src)), "n"(kBytes), "r"(valid ? kBytes : 0)
               : "memory");
}
// A 4-byte copy that always reads (cp_async_zfill<4> with valid).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  cp_async_zfill<4>(dst, src, true);
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}
// Groups: commit closes this thread's cp.async issued since the last commit into a group;
// wait_group<N> waits until at most N of its groups are pending (the older ones have landed).
// Then a barrier (or __syncwarp among a warp's lanes) makes the landed copies visible.
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Every DeviceArray's bytes, live and the peak since the last reset (device.hpp
// device_bytes_live / device_bytes_peak): what bench and the memory tests report.
void count_device_bytes(std::ptrdiff_t delta);

// An owned device allocation of n elements of T (cudaMalloc, never managed memory).
template <class T>
class DeviceArray {
 public:
  DeviceArray() = default;
  explicit DeviceArray(Idx n) { resize(n); }
  ~DeviceArray() { release(); }
  DeviceArray(DeviceArray&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    if (this != &o) { release(); p_ = o.p_; n_ = o.n_; o.p_ = nullptr; o.n_ = 0; }
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  void resize(Idx n) {
    release();
    if (n > 0) {
      M3_CUDA_CHECK(cudaMalloc(&p_, static_cast<std::size_t>(n) * sizeof(T)));
      n_ = n;
      count_device_bytes(static_cast<std::ptrdiff_t>(n) * static_cast<std::ptrdiff_t>(sizeof(T)));
    }
  }
  T* data() { return p_; }
  const T* data() const { return p_; }
  Idx size() const { return n_; }
  void zero(cudaStream_t s) {
    if (n_) M3_CUDA_CHECK(cudaMemsetAsync(p_, 0, static_cast<std::size_t>(n_) * sizeof(T), s));
  }
  void upload(const T* host, cudaStream_t s) {
    if (n_) M3_CUDA_CHECK(cudaMemcpyAsync(p_, host, static_cast<std::size_t>(n_) * sizeof(T),
                                          cudaMemcpyHostToDevice, s));
  }
  void download(T* host, cudaStream_t s) const {
    if (n_) M3_CUDA_CHECK(cudaMemcpyAsync(host, p_, static_cast<std::size_t>(n_) * sizeof(T),
                                          cudaMemcpyDeviceToHost, s));
  }

 private:
  void release() {
    if (p_) {
      cudaFree(p_);
      count_device_bytes(-static_cast<std::ptrdiff_t>(n_) * static_cast<std::ptrdiff_t>(sizeof(T)));
    }
    p_ = nullptr;
    n_ = 0;
  }
  T* p_ = nullptr;
  Idx n_ = 0;
};

// a·b − c·d with its one contraction written out: c·d rounded, a·b fused into the subtraction.
// Left to the compiler, nvcc leaves mul, mul, sub and ptxas fuses one of the two products, not
// the same one in every instantiation (in BCNorm's kernel f32 fuses one, f16 the other: SASS),
// so kernels that tests compare bit for bit spell it through here.
__device__ __forceinline__ float fma_diff(float a, float b, float c, float d) {
  return __fmaf_rn(a, b, -__fmul_rn(c, d));
}

// Sum over the 32 lanes of a warp, fixed butterfly order; every lane gets the same value.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over a block (blockDim.x a multiple of 32, ≤ 1024): warp sums, then warp 0 sums the
// per-warp values in ascending warp order. `shared` holds ≥ 32 floats. Every thread gets the
// result. Deterministic for a fixed blockDim.
__device__ __forceinline__ float block_sum(float v, float* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // shared may still be in use by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {  // only warp 0 reads the partials, so thread 0 may overwrite shared[0]
    float t = lane < nwarps ? shared[lane] : 0.0f;
    t = warp_sum(t);  // the shuffles order every lane's read before lane 0's write
    if (lane == 0) shared[0] = t;
  }
  __syncthreads();
  return shared[0];
}

}  // namespace m3::gpu
