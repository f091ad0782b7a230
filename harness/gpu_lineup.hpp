// The CUDA subject in the harness (HARNESS.md §1): per precision p, subject = the GPU backbone,
// baseline = the reference with p's storage (float for f32; the bf16/f16 emulation for the
// typed precisions), oracle = reference<double>. One GpuContext per process, made on first use.
// Today the GPU path stores f32 only; asking for bf16/f16 on the GPU is an m3::Error that says
// so (they come with the mixed-precision GPU path).
#pragma once

#include <string>
#include <vector>

#include "run.hpp"

namespace m3::harness {

// "" when a usable GPU is present, else why not (one line, e.g. "built without CUDA").
std::string gpu_absent_reason();

Implementation gpu_subject(Precision storage);
std::vector<Lineup> gpu_lineups(const std::vector<Precision>& precisions);

}  // namespace m3::harness
