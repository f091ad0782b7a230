// The one-launch refresh of the typed GEMM weight copies (arena.cuh): per segment
// typed[dst + i] = from_float<T>(master[src + i]) — round to nearest even, as convert<float, T>.
#include "arena.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "common.cuh"
#include "convert.cuh"

namespace m3::gpu {

namespace {

constexpr int kArenaThreads = 256;

template <class T>
__global__ void __launch_bounds__(kArenaThreads)
refresh_kernel(const CopySegment* segments, const float* master, T* typed) {
  const CopySegment seg = segments[blockIdx.y];
  const Idx stride = static_cast<Idx>(gridDim.x) * kArenaThreads;
  for (Idx i = static_cast<Idx>(blockIdx.x) * kArenaThreads + threadIdx.x; i < seg.n; i += stride)
    typed[seg.dst + i] = from_float<T>(master[seg.src + i]);
}

}  // namespace

template <class T>
void refresh_typed_copies(cudaStream_t s, const CopySegment* segments, int n_segments, Idx max_n,
                          const float* master, T* typed) {
  if (n_segments == 0 || max_n == 0) return;
  M3_REQUIRE(n_segments <= 65535, "gpu::refresh_typed_copies", "too many weight segments",
             n_segments, " segments (at most 65535: the grid's y dimension)");
  // Enough blocks per segment to fill the device, at most one per 256 elements.
  const unsigned bx = std::min<unsigned>(blocks_for(max_n, kArenaThreads), 1024u);
  refresh_kernel<T><<<dim3(bx, static_cast<unsigned>(n_segments)), kArenaThreads, 0, s>>>(
      segments, master, typed);
  M3_LAUNCH_CHECK();
}

#define M3_INSTANTIATE(T)                                                                  \
  template void refresh_typed_copies<T>(cudaStream_t, const CopySegment*, int, Idx,        \
                                        const float*, T*);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
