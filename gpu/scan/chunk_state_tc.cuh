// Internal to gpu/ (.cu files only): K2/K3 and B1 of the chunked scan (chunk_state_kernel of
// gpu/scan/chunked_fwd.cu) for typed runs on the tensor cores over bf16 planes (gpu/scan/chunk_state_tc.cu).
#pragma once

#include "ssm_chunk_geom.cuh"

namespace m3::gpu {

// K2/K3 (kFwd: da_cumsum_saved and the chunk contributions) or B1 (!kFwd: dcontrib and
// da_cs_sum) of a typed run whose chunks fit one row tile (g.nt == 1).
template <class T, bool kFwd>
void chunk_state_tc(cudaStream_t s, const ChunkGeom& g, const ChunkStateArgs& a);

// The same with the state passing (forward: K4/K6 of state_pass_fwd_kernel; backward: B2 of
// state_pass_bwd_kernel) in one walk per (b, h) over the chunks: bit for bit what the two
// kernels write (states, da_cumsum_saved / da_cs_sum, the leaving states; the contributions
// when a.s.out is set), without the contributions' round trip through global memory. The
// forward launches chunk_cumsum_kernel first (da_cumsum_saved), then the walk, which reads it.
template <class T, bool kFwd>
void chunk_walk_tc(cudaStream_t s, const ChunkGeom& g, const ChunkWalkArgs& a);

}  // namespace m3::gpu
