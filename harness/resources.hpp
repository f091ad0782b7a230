// The size guard of every command that allocates by the user's counts: one estimate of a run's
// host memory, counted from every dimension that grows it, held against the machine's memory
// before anything is allocated.
//
// stage_elements counts the registry tensors of one pass (expected_stage_keys) in double, so
// that no count overflows; its cost does not grow with the layer count: the tensors of one
// layer are counted once (from a one- and a two-layer model) and multiplied.
#pragma once

#include <string>

#include "config.hpp"

namespace m3::harness {

// Elements of every registry tensor of a (cfg, B, T, mode) pass, in double.
double stage_elements(const Config& cfg, Idx B, Idx T, ScanMode mode);

// Parameter floats of cfg (param_layout(cfg).total), in double, at the same cost for any
// layer count.
double parameter_elements(const Config& cfg);

// The machine's physical memory in bytes (0 when unknown).
double host_memory_bytes();

// This process's peak resident memory in bytes so far (getrusage; 0 when unknown).
double host_peak_rss_bytes();

// Host bytes of a Problem of (cfg, B, T) in double: X (or the one-hot tokens), dOut, the
// parameters and the entering states.
double problem_host_bytes(const Config& cfg, Idx B, Idx T);

// Throws m3::Error (one line) when need_bytes exceeds the machine's memory: "<what> needs
// about X GiB of host memory, the machine has Y GiB (<advice>)". Nothing when the machine's
// memory is unknown.
void check_host_bytes(double need_bytes, const std::string& what, const std::string& advice);

}  // namespace m3::harness
