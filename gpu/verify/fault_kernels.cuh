// Internal to gpu/: the negative controls' corruptions (backbone_gpu.hpp Fault), verification
// machinery beside the production path. Each launcher corrupts one stage's output in place:
//   fault_flip_angle     θ → 2π − θ for θ > 0                       (FlipAngleSign, F5)
//   fault_chunk_boundary y[b, c·cs] ← y[b, c·cs − 1] for c ≥ 1      (ChunkBoundaryOff, F6)
//   fault_round_twice    y rounded once more, to bf16 (f32/f16 storage) or to 5 mantissa bits
//                        (bf16 storage)                            (RoundTwice, F6)
// (DropBeta, F5b, is a memset of beta.)
#pragma once

#include <cuda_runtime.h>

#include "config.hpp"

namespace m3::gpu {

void fault_flip_angle(cudaStream_t s, Idx n, float* theta);
template <class T>
void fault_chunk_boundary(cudaStream_t s, Idx B, Idx T_, Idx cs, Idx di, T* y);
template <class T>
void fault_round_twice(cudaStream_t s, Idx n, T* y);

}  // namespace m3::gpu
