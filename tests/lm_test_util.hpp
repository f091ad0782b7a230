// Shared by the token-model tests (test_lm.cpp, test_train.cpp, gpu/test_gpu_lm.cpp):
//   random_token_batch(BT, V, seed, p)  uniform tokens and targets, each position scored with
//                                       probability p (the first always), N = Σ w
//   stepped_vs_full(...)                a sampler run's per-position logits (the prompt's from
//                                       one forward, then one per stepped token) against one
//                                       double forward over the prompt and the generated tokens
//                                       (all but the last) in the sequential mode
//   expect_bit_exact_resume(...)        TRAINING.md §4: a run straight, and the same run with a
//                                       checkpoint every `every` steps, resumed from the first one
//                                       after the later ones are deleted: the final weights,
//                                       moments, loss scale and loss log must be equal bit for bit
//   token_batch(B, T, V, seed, p)       random_token_batch as a train::Batch of B rows of T
//   train_trajectory(be, cfg, st, B, T, steps, staged)  `steps` optimizer steps of two
//                                       micro-batches each from initial_state(cfg, 3), each step's
//                                       first batch staged during the step before when `staged`:
//                                       every loss and norm, the end state (the data-parallel and
//                                       staging tests compare backends and protocols with it)
//   expect_one_line_error(f, needle)    f() throws an m3::Error of one line that contains needle
//   token_model(c, V)                   c as a token model of V symbols (vocab_size = input_dim)
//   chunked_spec(cfg, B, T, st)         a training backend's spec: B rows of T, chunked, storage st
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "backend.hpp"  // from_flat
#include "error.hpp"
#include "checkpoint.hpp"
#include "trainer.hpp"
#include "config.hpp"
#include "lm.hpp"
#include "params.hpp"
#include "registry.hpp"

namespace m3::test {

inline Config token_model(Config c, Idx V) {
  c.vocab_size = V;
  c.input_dim = V;
  return c;
}

inline train::BackendSpec chunked_spec(const Config& cfg, Idx B, Idx T,
                                       Precision st = Precision::F32) {
  train::BackendSpec s;
  s.cfg = cfg;
  s.B = B;
  s.T = T;
  s.mode = ScanMode::Chunked;
  s.storage = st;
  return s;
}

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

// The step and loss columns of a metrics.csv, one string per line (the header included).
inline std::vector<std::string> loss_column(const std::filesystem::path& csv) {
  std::ifstream in(csv);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(in, line)) out.push_back(line.substr(0, line.find(',', line.find(',') + 1)));
  return out;
}

inline void expect_bit_exact_resume(const std::filesystem::path& root, train::TrainOptions base,
                                    Idx every) {
  namespace fs = std::filesystem;
  const Idx steps = base.optim.steps;
  ASSERT_GT(steps, 2 * every) << "the run must pass at least two checkpoints";
  const std::string tag = precision_name(base.storage);
  auto ckpt = [](const fs::path& dir, Idx step) {
    char name[32];
    std::snprintf(name, sizeof name, "ckpt-%08lld.h5", static_cast<long long>(step));
    return dir / name;
  };
  std::ostringstream sink;
  train::TrainOptions straight = base;
  straight.out = (root / ("straight_" + tag)).string();
  ASSERT_EQ(train::run_training(straight, sink), 0) << sink.str();
  train::TrainOptions part = base;
  part.ckpt_every = every;
  part.out = (root / ("parts_" + tag)).string();
  ASSERT_EQ(train::run_training(part, sink), 0) << sink.str();
  for (Idx s = 2 * every; s <= steps; s += every) fs::remove(ckpt(part.out, s));
  fs::remove(ckpt(part.out, steps));
  part.resume = ckpt(part.out, every).string();
  ASSERT_EQ(train::run_training(part, sink), 0) << sink.str();
  train::TrainState a, b;
  const train::CheckpointMeta ma = train::read_checkpoint(ckpt(straight.out, steps).string(), nullptr, &a);
  const train::CheckpointMeta mb = train::read_checkpoint(ckpt(part.out, steps).string(), nullptr, &b);
  EXPECT_EQ(a.params, b.params);
  EXPECT_EQ(a.m, b.m);
  EXPECT_EQ(a.v, b.v);
  EXPECT_EQ(ma.loss_scale, mb.loss_scale);
  EXPECT_EQ(ma.skipped, mb.skipped);
  const auto la = loss_column(fs::path(straight.out) / "metrics.csv");
  EXPECT_EQ(la, loss_column(fs::path(part.out) / "metrics.csv"));
  EXPECT_EQ(la.size(), static_cast<size_t>(steps + 1));  // the header + every step
}

inline train::Batch token_batch(Idx B, Idx T, Idx V, std::uint64_t seed, double p_scored = 0.8) {
  const TokenBatch t = random_token_batch(B * T, V, seed, p_scored);
  train::Batch b;
  b.B = B;
  b.T = T;
  b.tok = t.tok;
  b.tgt = t.tgt;
  b.w = t.w;
  return b;
}

struct Trajectory {
  std::vector<double> loss, norm;
  train::TrainState end;
};

inline Trajectory train_trajectory(train::Backend& be, const Config& cfg, Precision st, Idx B,
                                   Idx T, int steps, bool staged = false) {
  be.set_state(train::initial_state(cfg, 3));
  OptimConfig o;
  o.lr = 1e-2;
  o.warmup = 2;
  o.steps = 10;
  o.clip = 0.5;  // active at these gradient norms
  LossScaler sc = LossScaler::for_precision(st);
  Trajectory t;
  const Idx V = cfg.vocab_size;
  auto batches = [&](int k) -> std::vector<train::Batch> {
    return {token_batch(B, T, V, 100 + k), token_batch(B, T, V, 200 + k)};
  };
  // staged: as run_training, step k + 1's first batch is staged while step k's last backward
  // runs (and step 1's is staged before it).
  auto stage_first = [&](int step) {
    const std::vector<train::Batch> m = batches(step);
    be.stage(m[0], train::scored_positions(m));
  };
  for (int k = 1; k <= steps; ++k) {
    if (staged && k == 1) stage_first(1);
    auto stage_next = [&] {
      if (k < steps) stage_first(k + 1);
    };
    const std::vector<train::Batch> micro = batches(k);
    const train::StepResult r = staged ? train::train_step(be, micro, k, o, sc, true, stage_next)
                                       : train::train_step(be, micro, k, o, sc);
    t.loss.push_back(r.loss);
    t.norm.push_back(r.grad_norm);
  }
  t.end = be.state();
  return t;
}

template <class F>
void expect_one_line_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one about: " << needle;
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find(needle), std::string::npos) << w;
    EXPECT_EQ(w.find('\n'), std::string::npos) << w;
  }
}

}  // namespace m3::test
