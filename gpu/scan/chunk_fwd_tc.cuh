// Internal to gpu/ (.cu files only): K5 of the chunked scan (chunk_scan_kernel of
// gpu/scan/chunked_fwd.cu) for typed runs on the tensor cores over bf16 planes (gpu/scan/chunk_fwd_tc.cu).
#pragma once

#include "ssm_chunk_geom.cuh"

namespace m3::gpu {

// K5 of a typed run whose chunks fit one row tile (g.nt == 1): y (typed) from q, k_scaled_saved,
// x, chunk_states_saved, da_cumsum_saved, qk_dot_saved, d_param.
template <class T>
void chunk_scan_tc(cudaStream_t s, const ChunkGeom& g, const SsmChunkFwd<T>& p);

}  // namespace m3::gpu
