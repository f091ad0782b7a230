// A Problem is everything one comparison run needs, held in double: config, run shape, seed,
// parameters, input X, output gradient dOut and entering states. Every implementation (oracle,
// baseline, GPU subject) starts from the same Problem, cast to its own precision.
//
// run_reference<S>() runs the reference in scalar S end to end — forward, then backward of
// dOut with zero gradients wrt the leaving states — and returns a Capture holding every stage
// tensor of the registry for that scan mode plus every parameter gradient ("grad/…").
#pragma once

#include <cstdint>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "params.hpp"
#include "precision.hpp"

namespace m3 {

struct Problem {
  Config cfg;
  Idx B = 2, T = 256;
  std::uint64_t seed = 0;
  Params<double> params;
  std::vector<double> x;       // [B*T, input_dim]
  std::vector<double> d_out;   // [B*T, d_model]
  States<double> states;       // entering states [L][B][…]
};

// Seeded problem: params (Init::Perturbed), x, dOut from `seed`; entering states random when
// `random_entering_states`, else zero. Validates the config and the run shape.
Problem make_problem(const Config& cfg, Idx B, Idx T, std::uint64_t seed,
                     bool random_entering_states);

// `storage` as for Backbone: BF16/F16 with S = float gives the mixed-precision baseline.
template <class S>
Capture run_reference(const Problem& pb, ScanMode mode, Precision storage = Precision::F64);

}  // namespace m3
