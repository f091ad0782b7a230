// The CUDA subject in the harness (HARNESS.md §1): per precision p, subject = the GPU backbone
// storing p (f32, bf16 or f16: MODEL.md §8), baseline = the reference with p's storage
// (reference_emulation(p): float for f32, the bf16/f16 storage emulation for the typed
// precisions), oracle = reference<double>. The subject's isolated (teacher-forced) runner is
// gpu::run_gpu_isolated. One GpuContext per process, made on first use.
//
// `fault` (a negative control of backbone_gpu.hpp, injected in layer 0) makes the subject
// deliberately wrong in one stage: a self-test of the harness, which must fail the budget and
// name that stage first (m3h compare --fault, tests/test_isolated_negative.cpp).
#pragma once

#include <string>
#include <vector>

#include "backbone_gpu.hpp"  // gpu::Fault (plain C++)
#include "run.hpp"

namespace m3::harness {

// "" when a usable GPU is present, else why not (one line, e.g. "built without CUDA").
std::string gpu_absent_reason();

// The process's one GpuContext (device 0), made on first use.
gpu::GpuContext& gpu_context();

// Named "gpu<f32>", "gpu<bf16>", … (+ " fault=<name>" with a fault).
Implementation gpu_subject(Precision storage, gpu::Fault fault = gpu::Fault::None);
std::vector<Lineup> gpu_lineups(const std::vector<Precision>& precisions,
                                gpu::Fault fault = gpu::Fault::None);

// The lineups every judging command uses (m3h compare, dump, the sweep), so that one problem
// gets one verdict whichever command runs it. device "gpu": gpu_lineups(…, fault) with
// add_perturbed_baselines (the isolated cells' baseline, the end-to-end cells' conditioning
// term); "cpu": cpu_lineups_perturbed (a fault there is an m3::Error: the CPU subject has none).
std::vector<Lineup> judged_lineups(const std::string& device,
                                   const std::vector<Precision>& precisions,
                                   gpu::Fault fault = gpu::Fault::None);

}  // namespace m3::harness
