// Shared by the token-model tests (test_lm.cpp, test_train.cpp, gpu/test_gpu_lm.cpp):
//   random_token_batch(BT, V, seed, p)  uniform tokens and targets, each position scored with
//                                       probability p (the first always), N = Σ w
//   stepped_vs_full(...)                a sampler run's per-position logits (the prompt's from
//                                       one forward, then one per stepped token) against one
//                                       double forward over the prompt and the generated tokens
//                                       (all but the last) in the sequential mode
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "backend.hpp"  // from_flat
#include "config.hpp"
#include "lm.hpp"
#include "params.hpp"
#include "registry.hpp"

namespace m3::test {

struct TokenBatch {
  std::vector<std::int32_t> tok, tgt;
  std::vector<float> w;
  double n = 0;
};

inline TokenBatch random_token_batch(Idx BT, Idx V, std::uint64_t seed, double p_scored = 0.8) {
  Rng rng(seed);
  TokenBatch b;
  for (Idx r = 0; r < BT; ++r) {
    b.tok.push_back(static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(V)));
    b.tgt.push_back(static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(V)));
    b.w.push_back(rng.uniform() < p_scored ? 1.0f : 0.0f);
  }
  b.w[0] = 1.0f;
  for (float x : b.w) b.n += x;
  return b;
}

struct SteppedVsFull {
  Idx rows = 0;        // positions compared (must equal steps.size())
  double worst = 0;    // max |stepped − full|
  double scale = 0;    // max |full|
};

inline SteppedVsFull stepped_vs_full(const Config& cfg, const std::vector<float>& params,
                                     const std::vector<std::int32_t>& prompt,
                                     const std::vector<std::int32_t>& gen,
                                     const std::vector<std::vector<float>>& steps) {
  std::vector<std::int32_t> all = prompt;
  all.insert(all.end(), gen.begin(), gen.end() - 1);
  const Idx n = static_cast<Idx>(all.size()), V = cfg.vocab_size;
  LmModel<double> full(cfg, 1, n, ScanMode::Sequential);
  const Params<double> pd =
      cast_params<double>(train::from_flat(params, cfg, param_layout(cfg)));
  full.forward(pd, all, std::vector<std::int32_t>(n, 0), std::vector<float>(n, 1.0f), 1.0);
  SteppedVsFull r;
  r.rows = n;
  for (Idx i = 0; i < n && i < static_cast<Idx>(steps.size()); ++i)
    for (Idx v = 0; v < V; ++v) {
      r.worst = std::max(r.worst, std::abs(steps[i][v] - full.logits()[i * V + v]));
      r.scale = std::max(r.scale, std::abs(full.logits()[i * V + v]));
    }
  return r;
}

}  // namespace m3::test
