// A Problem is everything one comparison run needs, held in double: config, run shape, seed,
// parameters, input X, output gradient dOut and entering states. Every implementation (oracle,
// baseline, GPU subject) starts from the same Problem, cast to its own precision.
//
// run_reference<S>() runs the reference in scalar S end to end — forward, then backward of
// dOut with zero gradients wrt the leaving states — and returns a Capture holding every stage
// tensor of the registry for that scan mode plus every parameter gradient ("grad/…"). A token
// model runs one training step instead (LmModel: embed → backbone → head → loss, then the
// backward of the loss), with the problem's entering states.
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
  // A token model (cfg.vocab_size > 0, TRAINING.md §1): tokens, targets and weights [B*T]
  // instead of x and d_out (both empty): the run is one training step, tokens in, loss and
  // every gradient out (d_out = the head's gradient of the loss).
  std::vector<std::int32_t> tok, tgt;
  std::vector<float> w;
  bool token_model() const { return cfg.vocab_size > 0; }
  double scored() const;  // N = Σ w
  // The loss scale of a token model's comparison run: S = 2^⌈log2 N⌉, so that the output
  // gradient d_logits = S·w/N·(softmax − one-hot) is O(1) per row, the scale of the backbone
  // problems' dOut ~ U(−1, 1) that the budgets were calibrated on (and far from f16's
  // subnormals, as f16 training's loss scaling keeps it). A power of two: exact in every
  // precision, so the gradients are S times the loss's, bit for bit in the oracle. 1 otherwise.
  double loss_scale() const;
};

// Seeded problem: params (Init::Perturbed), x, dOut from `seed` (a token model: uniform random
// tokens and targets, weights 1 except every 7th position 0, the first always 1); entering
// states random when `random_entering_states`, else zero. Validates the config and the run
// shape.
Problem make_problem(const Config& cfg, Idx B, Idx T, std::uint64_t seed,
                     bool random_entering_states);

// `storage` as for Backbone: BF16/F16 with S = float gives the mixed-precision baseline.
// With a `sink` the Capture streams (capture.hpp): each tensor goes to it as it is produced.
template <class S>
Capture run_reference(const Problem& pb, ScanMode mode, Precision storage = Precision::F64,
                      const TensorSink& sink = {});

}  // namespace m3
