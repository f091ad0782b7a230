// Internal to gpu/compare (.cu files): what every comparison kernel shares — the launch
// geometry, reading a value of any ValueType as a double, the signed difference of
// harness/metrics.hpp, the fixed-order block reduction, and the comparer's state.
//
// Reductions (deterministic, no floating-point atomics): a kernel over n values runs
// grid_for(n) blocks of kThreads threads — a function of n alone, not of the device — each
// thread folding its grid-stride indices in increasing order into an accumulator `Acc`, the
// block's accumulators combined by block_reduce's fixed binary tree (thread j takes j + h for
// h = kThreads/2, …, 1), one partial per block; fold_partials then combines the partials in
// one block, thread j folding partials j, j + kThreads, … in order, then the same tree. An Acc
// is a plain struct whose default value is the identity and whose merge(other) adds `other`
// into it (sums add, maxima take the larger, counts add).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "../compare_gpu.hpp"
#include "../core/cuda_check.hpp"

namespace m3::gpu::compare {

constexpr int kThreads = 256;     // every comparison kernel's block (a multiple of 32)
constexpr Idx kMaxBlocks = 1024;  // the most blocks of a reduction over n values
constexpr Idx kNoIndex = 0x7fffffffffffffffLL;  // "no index yet": larger than every index
constexpr double kTwoPi = 6.283185307179586476925286766559;
// harness/metrics.hpp's thresholds (kRelThreshold, kZeroOracle).
constexpr double kRelThreshold = 1e-2;
constexpr double kZeroOracle = 1e-10;

// Blocks of a grid-stride kernel over n values: one per kThreads values, at least 1 (so that
// an empty input still writes its identity partial), at most kMaxBlocks.
inline unsigned grid_for(Idx n) {
  return static_cast<unsigned>(std::clamp<Idx>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

// A device buffer as the kernels read it.
struct Values {
  const void* data;
  ValueType type;
};

inline Values values_of(const DeviceValues& v) { return {v.data, v.type}; }

// Value i widened to double (exact for every type). The switch is uniform over the grid.
__device__ inline double load(const Values& v, Idx i) {
  switch (v.type) {
    case ValueType::F64: return static_cast<const double*>(v.data)[i];
    case ValueType::F32: return static_cast<const float*>(v.data)[i];
    case ValueType::BF16: {
      const unsigned bits = static_cast<const std::uint16_t*>(v.data)[i];
      return __uint_as_float(bits << 16);
    }
    case ValueType::F16:
      return __half2float(__ushort_as_half(static_cast<const unsigned short*>(v.data)[i]));
  }
  return 0.0;
}

// std::max(a, b) as the host writes it: (a < b) ? b : a, so a NaN b leaves a.
__device__ inline double host_max(double a, double b) { return a < b ? b : a; }

// Δ = s − o, or for angles the signed circular distance remainder(s − o, 2π) ∈ [−π, π]
// (harness::circular_diff; CUDA's remainder is exact, as C's).
__device__ inline double signed_diff(double s, double o, bool circular) {
  return circular ? remainder(s - o, kTwoPi) : s - o;
}

// The block's accumulators combined by a fixed tree; every thread gets the block's total.
// Called by all kThreads threads of the block (blockDim.x must be kThreads).
template <class Acc>
__device__ Acc block_reduce(const Acc& mine) {
  __shared__ alignas(Acc) unsigned char raw[kThreads * sizeof(Acc)];
  Acc* sh = reinterpret_cast<Acc*>(raw);
  sh[threadIdx.x] = mine;
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (static_cast<int>(threadIdx.x) < half) sh[threadIdx.x].merge(sh[threadIdx.x + half]);
    __syncthreads();
  }
  const Acc total = sh[0];
  __syncthreads();  // the next call may overwrite sh
  return total;
}

// The second level: *out = the partials combined, in one block of kThreads threads.
template <class Acc>
__global__ void fold_partials(const Acc* partials, Idx count, Acc* out) {
  Acc mine;
  for (Idx j = threadIdx.x; j < count; j += kThreads) mine.merge(partials[j]);
  const Acc total = block_reduce(mine);
  if (threadIdx.x == 0) *out = total;
}

}  // namespace m3::gpu::compare

namespace m3::gpu {

// The comparer's stream and scratch memory. Scratch buffers only grow; each public call ends by
// waiting for the stream, so a buffer replaced by a larger one is no longer in use.
struct DeviceComparer::Impl {
  cudaStream_t stream = nullptr;
  bool owns_stream = false;
  DeviceBuffer partials;  // one Acc per block of the current reduction
  DeviceBuffer results;   // the folded accumulators and the p95 select state
  DeviceBuffer ill_mask;  // condition(): one bit per value
  DeviceBuffer table;     // condition(): the device table of `devs` pointers

  static void* reserve(DeviceBuffer& b, std::size_t bytes) {
    if (b.bytes() < bytes) {
      b = DeviceBuffer();  // free first: the old and the new need not fit together
      b = DeviceBuffer(bytes);
    }
    return b.data();
  }

  // bytes from the device to the host, then the stream drained (every call's last step).
  void download(void* host, const void* device, std::size_t bytes) const {
    M3_CUDA_CHECK(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream));
    M3_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
};

namespace compare {

// Throws m3::Error naming `what` of `where` when v cannot be read (negative n, null data, an
// unknown type).
void check_values(const char* where, const char* what, const DeviceValues& v);

}  // namespace compare

}  // namespace m3::gpu
