// Internal to gpu/: the typed compute copies of the GEMM weights refreshed from the f32 master
// arena in one launch (MODEL.md §8: "typed, re-cast from f32 master after every optimizer
// step"). The masters live in one flat buffer (reference/registry.hpp ParamLayout), the typed
// copies in another; each GEMM weight is a segment: typed[dst + i] = RNE(master[src + i]),
// i < n, the bits of convert<float, T> (reduce.cu) element for element.
#pragma once

#include <cuda_runtime.h>

#include "config.hpp"

namespace m3::gpu {

struct CopySegment {
  Idx src, dst, n;  // offsets (elements) into the master and typed arenas, and the length
};

// segments: a DEVICE array of n_segments entries (uploaded once); max_n the longest segment.
// One launch: grid (blocks over max_n, n_segments), each block striding over its segment.
template <class T>
void refresh_typed_copies(cudaStream_t s, const CopySegment* segments, int n_segments, Idx max_n,
                          const float* master, T* typed);

}  // namespace m3::gpu
