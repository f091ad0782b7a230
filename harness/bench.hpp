// Timing of the Eigen reference (m3h bench --reference): one Backbone<S> per (scalar, scan
// mode), built once; `warmup` untimed forward+backward passes, then `repeats` timed ones.
// forward_ms / backward_ms are medians over the repeats (std::chrono::steady_clock), each pass
// starting from the same entering states; tokens/s = B·T / (forward + backward) seconds.
// Single-threaded like the reference itself; later the GPU benchmarks report the same rows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"

namespace m3::harness {

struct BenchSpec {
  Config cfg;
  Idx B = 2, T = 256;
  std::uint64_t seed = 1234;
  int repeats = 5;
  int warmup = 1;
  std::vector<ScanMode> modes = {ScanMode::Sequential, ScanMode::Chunked};
};

struct BenchRow {
  std::string precision;  // "f64" (the oracle) | "f32"
  ScanMode mode = ScanMode::Sequential;
  double forward_ms = 0, backward_ms = 0;  // medians
  double forward_min_ms = 0, backward_min_ms = 0;
  Idx tokens = 0;                          // B·T
  double tokens_per_s() const;             // forward + backward
};

// The median of v (the mean of the two middle values for an even count); v non-empty.
double median(std::vector<double> v);

// f64 rows first, then f32, each in spec.modes order. Throws m3::Error on a bad spec.
std::vector<BenchRow> bench_reference(const BenchSpec& spec);
// The float rows only (the reference time next to the GPU rows of m3h bench).
std::vector<BenchRow> bench_reference_float(const BenchSpec& spec);

}  // namespace m3::harness
