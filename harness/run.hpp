// One comparison run: build the seeded Problem once, run the oracle, the subject (and the
// baseline, when there is one) for every requested scan mode, and compare their Captures
// (compare.hpp). An Implementation is anything that turns (Problem, scan mode) into a Capture
// of every registry tensor and parameter gradient; today the subject is the float reference,
// later the CUDA path (f32/bf16/f16) with the float or mixed-storage emulation as baseline,
// and golden files as oracle, all through the same entry point.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "capture.hpp"
#include "compare.hpp"
#include "config.hpp"
#include "ulps.hpp"
#include "problem.hpp"

namespace m3::harness {

struct RunSpec {
  std::string preset = "default";
  Config cfg;
  Idx B = 2, T = 256;
  std::uint64_t seed = 1234;
  bool random_states = true;
  std::vector<ScanMode> modes = {ScanMode::Sequential, ScanMode::Chunked};
  Precision precision = Precision::F32;
  std::string filter;          // key_matches() pattern
  std::string device = "cpu";  // where the subject runs
};

struct Implementation {
  std::string name;  // e.g. "reference<double>"
  std::function<Capture(const Problem&, ScanMode)> run;
};

Implementation reference_oracle();  // run_reference<double>
Implementation reference_float();   // run_reference<float>

struct Comparison {
  RunSpec spec;
  std::string oracle_name, subject_name, baseline_name;  // baseline_name empty: none
  std::vector<CompareResult> modes;                      // one per spec.modes, same order

  bool pass() const;
  int n_checks() const;  // rows over all modes
  int n_fail() const;
};

// `baseline` may be null. Throws m3::Error on an invalid config or run shape.
Comparison run_comparison(const RunSpec& spec, const Implementation& oracle,
                          const Implementation& subject, const Implementation* baseline);

}  // namespace m3::harness
