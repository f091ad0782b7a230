// Internal to gpu/: the isolated mode's restore from a teacher on the device
// (GpuBackbone::run_isolated with a DeviceTeacher). A teacher's f64 values go into a buffer of
// the backbone the way run_isolated's host path puts a Capture's doubles there — each value
// rounded to f32 (round to nearest even), then, for a typed buffer, to bf16 or f16 with the bit
// rules of reference/precision.cpp (float_to_bf16_bits, float_to_f16_bits: round to nearest
// even, a quiet NaN keeping the sign) — so both paths store the same bits.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "config.hpp"
#include "precision.hpp"

namespace m3::gpu {

// dst[i] = src[i] rounded to f32 (elem 4) or, through f32, to `storage` (elem 2: BF16 or F16),
// for i < n.
void teacher_to_storage(cudaStream_t s, Idx n, const double* src, void* dst, std::size_t elem,
                        Precision storage);

}  // namespace m3::gpu
