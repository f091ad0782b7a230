// The training step and loop on the CPU reference path (train/trainer.hpp): one step equals
// the reference step written out by hand bit for bit; gradient accumulation normalises over
// the whole step; the f16 norm is the unscaled gradient's; the validation loss is the mean over
// every scored position; a skipped f16 step changes nothing but the loss scale; the float path's
// drift from the double oracle over K steps (the rule the GPU trajectory test uses);
// bit-exact resume (k steps + save + resume + N − k = N straight: weights, moments, losses);
// f16 steps skipped inside a run leave the schedule's step alone, and a resume after skips
// keeps the loss scale and skip count (equal to the same steps driven by hand);
// stepping the sampler equals one forward; and `m3h train` / `m3h sample` on bad input: one
// line, exit 2, nothing overwritten.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "backend.hpp"
#include "test_io.hpp"
#include "checkpoint.hpp"
#include "data.hpp"
#include "error.hpp"
#include "gpu_lineup.hpp"
#include "lm_test_util.hpp"
#include "lm.hpp"
#include "optimizer.hpp"
#include "problem.hpp"
#include "run.hpp"
#include "test_compare.hpp"
#include "test_util.hpp"
#include "trainer.hpp"

namespace fs = std::filesystem;

namespace {

using m3::Config;
using m3::Idx;
using m3::Precision;
using m3::ScanMode;
using namespace m3::train;

Config tiny_lm(Idx V) {
  return m3::test::token_model(m3::test::small_cfg(8, 4, 4, 1, 0.5, false, 2, 8, false, V), V);
}

using m3::test::chunked_spec;

m3::OptimConfig optim() {
  m3::OptimConfig o;
  o.lr = 1e-2;
  o.warmup = 2;
  o.steps = 10;
  o.clip = 0.5;  // active: the gradient norms here are larger
  return o;
}

TEST(TrainStep, OneCpuStepEqualsTheReferenceStepWrittenOutBitForBit) {
  const Idx B = 2, T = 9, V = 7;
  const Config cfg = tiny_lm(V);
  auto be = make_cpu_backend(chunked_spec(cfg, B, T));
  const TrainState s0 = initial_state(cfg, 5);
  be->set_state(s0);
  const Batch b = m3::test::token_batch(B, T, V, 6);
  m3::LossScaler sc = m3::LossScaler::for_precision(Precision::F32);
  const StepResult r = train_step(*be, {b}, 1, optim(), sc);
  // By hand: the reference model, the flat gradient, the norm, the clip, AdamW.
  const m3::ParamLayout layout = m3::param_layout(cfg);
  m3::LmModel<float> model(cfg, B, T, ScanMode::Chunked, Precision::F32);
  const m3::Params<float> p = from_flat(s0.params, cfg, layout);
  const double loss = model.forward(p, b.tok, b.tgt, b.w, static_cast<double>(b.scored()));
  m3::Params<float> g = m3::zero_params<float>(cfg);
  model.backward(p, 1.0, g);
  const std::vector<float> gf = to_flat(g, layout);
  const double gn = m3::grad_norm(gf.data(), layout.total);
  const m3::AdamWScalars a =
      m3::adamw_scalars(optim(), 1, m3::clip_coefficient(gn, optim().clip), 1.0);
  std::vector<float> pf = s0.params, mf = s0.m, vf = s0.v;
  m3::adamw_step(layout, m3::decay_flags(layout), a, pf.data(), mf.data(), vf.data(), gf.data());
  EXPECT_EQ(r.loss, loss);
  EXPECT_EQ(r.grad_norm, gn);
  EXPECT_GT(gn, optim().clip) << "the clip must be active for this test to check it";
  const TrainState s1 = be->state();
  EXPECT_EQ(s1.params, pf);
  EXPECT_EQ(s1.m, mf);
  EXPECT_EQ(s1.v, vf);
  EXPECT_NE(s1.params, s0.params);
}

// With f16 the backward runs on S·loss; the norm reported and clipped is the unscaled
// gradient's, ‖g‖ = grad_norm() / S: within f16 storage's rounding of the f32 path's norm, and
// the same whichever S produced it.
TEST(TrainStep, TheF16GradientNormIsThatOfTheUnscaledGradient) {
  const Idx B = 2, T = 9, V = 7;
  const Config cfg = tiny_lm(V);
  const TrainState s0 = initial_state(cfg, 5);
  const Batch b = m3::test::token_batch(B, T, V, 6);
  auto norm = [&](Precision st, double scale) {
    auto be = make_cpu_backend(chunked_spec(cfg, B, T, st));
    be->set_state(s0);
    m3::LossScaler sc = m3::LossScaler::for_precision(st);
    sc.scale = scale;
    const StepResult r = train_step(*be, {b}, 1, optim(), sc);
    EXPECT_FALSE(r.skipped);
    return r.grad_norm;
  };
  const double f32 = norm(Precision::F32, 1.0);
  const double at16 = norm(Precision::F16, m3::LossScaler::kInitialScale);
  const double at10 = norm(Precision::F16, std::ldexp(1.0, 10));
  EXPECT_NEAR(at16, f32, 1e-2 * f32);
  EXPECT_NEAR(at10, f32, 1e-2 * f32);
}

// Verification while training judges a slice of the live batch as m3h compare judges a problem
// (the judged lineups: subject, its emulation, the perturbed oracle's conditioning term): on the
// CPU (the float reference as the subject), the verdict, its worst % and its tensor count are
// run_comparison's over the same Problem, and a correct model passes.
TEST(TrainVerify, TheSliceGetsTheVerdictOfTheJudgedLineups) {
  const Idx T = 12, V = 7;
  const Config cfg = tiny_lm(V);
  const TrainState s = initial_state(cfg, 8);
  const Batch live = m3::test::token_batch(2, T, V, 4);
  const VerifyResult v =
      verify_live_batch(cfg, "cpu", ScanMode::Chunked, Precision::F32, s.params, live);
  const m3::Problem pb = verification_problem(cfg, s.params, live, false);
  ASSERT_EQ(pb.B, 1);
  ASSERT_EQ(pb.T, T);
  const m3::Problem whole = verification_problem(cfg, s.params, live, true);
  ASSERT_EQ(whole.B, 2);
  ASSERT_EQ(whole.T, T);
  EXPECT_EQ(whole.tok, live.tok);
  EXPECT_TRUE(std::equal(pb.tok.begin(), pb.tok.end(), live.tok.begin()));
  EXPECT_THROW(verify_live_batch(cfg, "cpu", ScanMode::Chunked, Precision::F32, s.params, live, "gpu"),
               m3::Error);
  m3::harness::RunSpec spec;
  spec.cfg = cfg;
  spec.B = 1;
  spec.T = T;
  spec.modes = {ScanMode::Chunked};
  const m3::harness::Comparison c =
      m3::harness::run_comparison(spec, pb, m3::harness::reference_oracle(),
                                  m3::harness::judged_lineups("cpu", {Precision::F32}));
  ASSERT_EQ(c.cells.size(), 1u);
  const m3::harness::CompareResult& r = c.cells.front();
  double worst = 0;
  std::string worst_key;
  for (const auto& row : r.rows)
    if (row.verdict.pct() > worst || worst_key.empty()) {
      worst = row.verdict.pct();
      worst_key = row.key;
    }
  EXPECT_TRUE(v.pass);
  EXPECT_EQ(v.pass, r.pass());
  EXPECT_EQ(v.tensors, static_cast<Idx>(r.rows.size()));
  EXPECT_GT(v.tensors, 0);
  EXPECT_EQ(v.worst_pct, worst);
  EXPECT_EQ(v.worst, worst_key);
  EXPECT_FALSE(v.worst.empty());
  EXPECT_LT(v.worst_pct, 100.0);
  EXPECT_EQ(v.first_fail, "");
}

TEST(TrainStep, GradientAccumulationNormalisesOverTheWholeStep) {
  const Idx T = 8, V = 5;
  const Config cfg = tiny_lm(V);
  const Batch b0 = m3::test::token_batch(1, T, V, 11), b1 = m3::test::token_batch(1, T, V, 12, 0.3);
  Batch both = b0;
  both.B = 2;
  both.tok.insert(both.tok.end(), b1.tok.begin(), b1.tok.end());
  both.tgt.insert(both.tgt.end(), b1.tgt.begin(), b1.tgt.end());
  both.w.insert(both.w.end(), b1.w.begin(), b1.w.end());
  auto one = make_cpu_backend(chunked_spec(cfg, 2, T));
  auto acc = make_cpu_backend(chunked_spec(cfg, 1, T));
  one->set_state(initial_state(cfg, 3));
  acc->set_state(initial_state(cfg, 3));
  m3::LossScaler s1 = m3::LossScaler::for_precision(Precision::F32), s2 = s1;
  const StepResult r1 = train_step(*one, {both}, 1, optim(), s1);
  const StepResult r2 = train_step(*acc, {b0, b1}, 1, optim(), s2);
  // The same math, summed in another order: equal to float round-off.
  EXPECT_NEAR(r2.loss, r1.loss, 1e-6 * r1.loss);
  EXPECT_NEAR(r2.grad_norm, r1.grad_norm, 1e-5 * r1.grad_norm);
  const std::vector<float> p1 = one->state().params, p2 = acc->state().params;
  EXPECT_LE(m3::test::rel_l2(std::vector<double>(p2.begin(), p2.end()),
                             std::vector<double>(p1.begin(), p1.end())),
            1e-6);
}

// run_training stages each step's first batch while the step before runs (Backend::stage,
// forward_staged): the default backend's copy gives the plain protocol's bits, with one and
// with two micro-batches per step, and forward_staged without a staged batch is an error.
TEST(TrainStep, StagingTheNextBatchChangesNoBit) {
  const Idx B = 2, T = 8, V = 6;
  const Config cfg = tiny_lm(V);
  for (Precision st : {Precision::F32, Precision::BF16}) {
    SCOPED_TRACE(m3::precision_name(st));
    auto plain = make_cpu_backend(chunked_spec(cfg, B, T, st));
    auto staged = make_cpu_backend(chunked_spec(cfg, B, T, st));
    const m3::test::Trajectory a = m3::test::train_trajectory(*plain, cfg, st, B, T, 3);
    const m3::test::Trajectory b = m3::test::train_trajectory(*staged, cfg, st, B, T, 3, true);
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.norm, b.norm);
    EXPECT_EQ(a.end.params, b.end.params);
    EXPECT_EQ(a.end.m, b.end.m);
    EXPECT_EQ(a.end.v, b.end.v);
    EXPECT_NE(a.end.params, initial_state(cfg, 3).params);
  }
  auto be = make_cpu_backend(chunked_spec(cfg, B, T));
  m3::test::expect_one_line_error([&] { be->forward_staged(); }, "no staged batch");
  const Batch b = m3::test::token_batch(B, T, V, 4);
  be->stage(b, static_cast<double>(b.scored()));
  be->forward_staged();
  m3::test::expect_one_line_error([&] { be->forward_staged(); }, "no staged batch");
}

// The validation loss is the mean over every scored position of the batches: each batch's mean
// weighted by its count of scored positions, not the mean of the batches' means.
TEST(TrainEval, TheLossIsTheMeanOverEveryScoredPositionOfTheBatches) {
  const Idx B = 1, T = 16, V = 6;
  const Config cfg = tiny_lm(V);
  auto be = make_cpu_backend(chunked_spec(cfg, B, T));
  be->set_state(initial_state(cfg, 5));
  const Batch all = m3::test::token_batch(B, T, V, 31, 1.0);
  const Batch some = m3::test::token_batch(B, T, V, 32, 0.3);
  const double n1 = static_cast<double>(all.scored()), n2 = static_cast<double>(some.scored());
  ASSERT_EQ(n1, static_cast<double>(T));
  ASSERT_LT(n2, n1 / 2);
  // Each batch's mean loss from the backend's own forward (N = its scored positions).
  auto mean_loss = [&](const Batch& b) {
    be->forward(b, static_cast<double>(b.scored()));
    return be->loss();
  };
  const double l1 = mean_loss(all), l2 = mean_loss(some);
  ASSERT_GT(std::abs(l1 - l2), 1e-3 * l1) << "the two batches' losses must differ";
  EXPECT_NEAR(evaluate(*be, {all}).loss, l1, 1e-14 * l1);
  EXPECT_NEAR(evaluate(*be, {some}).loss, l2, 1e-14 * l2);
  const EvalResult both = evaluate(*be, {all, some});
  EXPECT_NEAR(both.loss, (l1 * n1 + l2 * n2) / (n1 + n2), 1e-12 * l1);
  // A batch with no scored position adds nothing.
  Batch none = some;
  std::fill(none.w.begin(), none.w.end(), 0.0f);
  EXPECT_NEAR(evaluate(*be, {all, none}).loss, l1, 1e-14 * l1);
}

TEST(TrainStep, ABatchWithNoScoredPositionIsAnError) {
  const Config cfg = tiny_lm(4);
  auto be = make_cpu_backend(chunked_spec(cfg, 1, 4));
  Batch b = m3::test::token_batch(1, 4, 4, 1);
  std::fill(b.w.begin(), b.w.end(), 0.0f);
  m3::LossScaler sc;
  EXPECT_THROW(train_step(*be, {b}, 1, optim(), sc), m3::Error);
}

TEST(TrainStep, ASkippedF16StepChangesNothingButTheLossScale) {
  const Idx B = 1, T = 8, V = 6;
  const Config cfg = tiny_lm(V);
  auto be = make_cpu_backend(chunked_spec(cfg, B, T, Precision::F16));
  const TrainState s0 = initial_state(cfg, 9);
  be->set_state(s0);
  m3::LossScaler sc = m3::LossScaler::for_precision(Precision::F16);
  ASSERT_TRUE(sc.dynamic);
  sc.scale = std::ldexp(1.0, 60);  // d_logits overflow f16: the gradient is not finite
  const StepResult r = train_step(*be, {m3::test::token_batch(B, T, V, 10)}, 1, optim(), sc);
  EXPECT_TRUE(r.skipped);
  EXPECT_FALSE(r.finite);
  EXPECT_EQ(sc.skipped, 1);
  EXPECT_EQ(sc.scale, std::ldexp(1.0, 59));
  const TrainState s1 = be->state();
  EXPECT_EQ(s1.params, s0.params);
  EXPECT_EQ(s1.m, s0.m);
  EXPECT_EQ(s1.v, s0.v);
  // With the default scale the same step is applied.
  m3::LossScaler ok = m3::LossScaler::for_precision(Precision::F16);
  const StepResult r2 = train_step(*be, {m3::test::token_batch(B, T, V, 10)}, 1, optim(), ok);
  EXPECT_FALSE(r2.skipped);
  EXPECT_NE(be->state().params, s0.params);
}

// K steps of the float path against the same K steps in double (LmModel<double> and
// adamw_step<double> from the same start on the same batches): the drift a float run
// accumulates. Measured: loss ≤ 1e-5 relative per step, weights ≤ 3e-6 relative (rel_l2)
// after 6 steps. The GPU trajectory test (tests/gpu/test_gpu_lm.cpp) allows k = 2 times this
// float baseline's error plus a floor.
TEST(TrainTrajectory, TheFloatPathDriftsFromTheDoubleOracleByFloatRoundOffOnly) {
  const Idx B = 2, T = 16, V = 9, K = 6;
  const Config cfg = tiny_lm(V);
  const m3::ParamLayout layout = m3::param_layout(cfg);
  auto be = make_cpu_backend(chunked_spec(cfg, B, T));
  const TrainState s0 = initial_state(cfg, 21);
  be->set_state(s0);
  m3::LossScaler sc;
  std::vector<double> p(s0.params.begin(), s0.params.end()), m(p.size(), 0.0), v(p.size(), 0.0);
  m3::LmModel<double> oracle(cfg, B, T, ScanMode::Chunked);
  const auto decay = m3::decay_flags(layout);
  for (Idx t = 1; t <= K; ++t) {
    const Batch b = m3::test::token_batch(B, T, V, 100 + t);
    const StepResult r = train_step(*be, {b}, t, optim(), sc);
    // The oracle's step.
    m3::Params<double> pd = m3::zero_params<double>(cfg);
    m3::for_each_param(pd, [&](int l, const char* name, std::vector<double>& vec) {
      if (vec.empty()) return;
      const auto& slot = layout.at(l, name);
      std::copy(p.begin() + slot.offset, p.begin() + slot.offset + slot.size, vec.begin());
    });
    const double loss = oracle.forward(pd, b.tok, b.tgt, b.w, static_cast<double>(b.scored()));
    m3::Params<double> gd = m3::zero_params<double>(cfg);
    oracle.backward(pd, 1.0, gd);
    std::vector<double> g(p.size(), 0.0);
    m3::for_each_param(gd, [&](int l, const char* name, const std::vector<double>& vec) {
      if (vec.empty()) return;
      std::copy(vec.begin(), vec.end(), g.begin() + layout.at(l, name).offset);
    });
    const double gn = m3::grad_norm(g.data(), layout.total);
    m3::adamw_step(layout, decay,
                   m3::adamw_scalars(optim(), t, m3::clip_coefficient(gn, optim().clip), 1.0),
                   p.data(), m.data(), v.data(), g.data());
    EXPECT_NEAR(r.loss, loss, 1e-5 * loss) << "step " << t;
  }
  const std::vector<float> pf = be->state().params;
  const double drift = m3::test::rel_l2(std::vector<double>(pf.begin(), pf.end()), p);
  EXPECT_LE(drift, 3e-6);
  EXPECT_GT(drift, 0.0) << "float and double cannot agree exactly";
}

// ---- the whole loop: bit-exact resume -------------------------------------------------------

class TrainRun : public ::testing::Test {
 protected:
  m3::test::TempDir tmp_{"m3_train_"};
  const fs::path& dir_ = tmp_.dir;
  TrainOptions options(const std::string& out, Precision st) const {
    TrainOptions o;
    o.cfg = m3::test::small_cfg(8, 4, 4, 1, 1.0, false, 2, 8, false, 3);
    o.device = "cpu";
    o.storage = st;
    o.mode = ScanMode::Chunked;
    o.B = 3;
    o.T = 12;
    o.optim = optim();
    o.optim.steps = 9;
    o.seed = 77;
    o.task = "parity";
    o.task_options = {{"n_min", "2"}, {"n_max", "12"}};
    o.out = (dir_ / out).string();
    o.val_batches = 2;
    o.val_every = 3;
    o.log_every = 100;
    o.config_text = "# test\n";
    return o;
  }
};

TEST_F(TrainRun, KStepsSaveResumeAndTheRestEqualTheRunStraightBitForBit) {
  for (Precision st : {Precision::F32, Precision::BF16, Precision::F16}) {
    SCOPED_TRACE(m3::precision_name(st));
    m3::test::expect_bit_exact_resume(dir_, options("unused", st), 4);
  }
}

// One row of a run's metrics.csv (step,loss,val_loss,accuracy,lr,grad_norm,tokens_per_s,
// loss_scale,skipped,verify_pct), the numbers exactly as written.
struct MetricsRow {
  Idx step = 0;
  double lr = 0, loss_scale = 0;
  Idx skipped = 0;
};
std::vector<MetricsRow> read_metrics(const fs::path& run) {
  std::ifstream in(run / "metrics.csv");
  std::string line;
  std::getline(in, line);
  std::vector<MetricsRow> rows;
  while (std::getline(in, line)) {
    std::vector<std::string> cells;
    std::stringstream ss(line);
    for (std::string c; std::getline(ss, c, ',');) cells.push_back(c);
    if (cells.size() < 9) {
      ADD_FAILURE() << "short metrics row: " << line;
      continue;
    }
    MetricsRow r;
    r.step = std::stoll(cells[0]);
    r.lr = std::strtod(cells[4].c_str(), nullptr);
    r.loss_scale = std::strtod(cells[7].c_str(), nullptr);
    r.skipped = std::stoll(cells[8]);
    rows.push_back(r);
  }
  return rows;
}

// TRAINING.md §2: a skipped f16 step leaves the optimizer step t alone, so each row's lr is the
// schedule at t = step − (steps skipped before it), and Adam's bias correction uses the same t.
// TRAINING.md §4: a resume continues with the checkpoint's loss scale and skip count. A fresh
// run never skips at 2^16 here, so the skips come from a checkpoint rewritten with a scale too
// large for f16's range; the run resumed from it must equal the same steps driven by hand
// through train_step (one loop, no resume), and resuming again from a checkpoint taken after
// the skips must change nothing either.
TEST_F(TrainRun, SkippedF16StepsLeaveTheScheduleAndAResumeKeepsTheLossScale) {
  std::ostringstream sink;
  TrainOptions o = options("skips", Precision::F16);
  o.ckpt_every = 3;
  ASSERT_EQ(run_training(o, sink), 0) << sink.str();
  const fs::path run = o.out;
  auto ckpt = [&](Idx s) {
    char name[32];
    std::snprintf(name, sizeof name, "ckpt-%08lld.h5", static_cast<long long>(s));
    return (run / name).string();
  };
  for (const MetricsRow& r : read_metrics(run)) ASSERT_EQ(r.skipped, 0) << "step " << r.step;

  // The checkpoint of step 3 with the scale 2^22: steps 4, 5, 6 and 8 overflow f16 (halving
  // it each time), 7 and 9 are applied.
  const double huge = std::ldexp(1.0, 22);
  Config cfg;
  TrainState s3;
  CheckpointMeta meta = read_checkpoint(ckpt(3), &cfg, &s3);
  ASSERT_EQ(meta.skipped, 0);
  meta.loss_scale = huge;
  write_checkpoint(ckpt(3), cfg, meta, s3, true);

  // The same steps by hand: t = applied steps so far + 1.
  auto data = make_dataset(o, o.T);
  auto be = make_cpu_backend(BackendSpec{cfg, o.B, o.T, o.mode, o.storage, o.recompute});
  be->set_state(s3);
  m3::LossScaler sc = m3::LossScaler::for_precision(Precision::F16);
  sc.scale = huge;
  sc.good_steps = meta.good_steps;
  std::vector<double> want_lr, want_scale;
  std::vector<bool> skipped_at;
  double scale_at_6 = 0;
  for (Idx s = 4; s <= o.optim.steps; ++s) {
    const Idx t = s - sc.skipped;
    const StepResult r =
        train_step(*be, {data->train_batch(o.seed, s, 0, o.B, o.T)}, t, o.optim, sc);
    EXPECT_EQ(r.lr, m3::learning_rate(o.optim, t)) << "step " << s;
    want_lr.push_back(r.lr);
    want_scale.push_back(sc.scale);
    skipped_at.push_back(r.skipped);
    if (s == 6) scale_at_6 = sc.scale;
  }
  const TrainState want = be->state();
  ASSERT_EQ(skipped_at, (std::vector<bool>{true, true, true, false, true, false}))
      << "steps 4 … 9 skipped or applied";
  ASSERT_NE(scale_at_6, m3::LossScaler::kInitialScale)
      << "the checkpoint of step 6 must hold a scale a fresh run would not start with";

  // Each metrics row of steps 4 … 9: lr and scale as by hand, lr = schedule(step − skipped
  // before it).
  auto expect_rows = [&](const fs::path& dir) {
    const std::vector<MetricsRow> rows = read_metrics(dir);
    ASSERT_EQ(rows.size(), static_cast<std::size_t>(o.optim.steps));
    Idx before = 0;
    for (const MetricsRow& r : rows) {
      SCOPED_TRACE("step " + std::to_string(r.step));
      EXPECT_EQ(r.lr, m3::learning_rate(o.optim, r.step - before));
      if (r.step >= 4) {
        const auto k = static_cast<std::size_t>(r.step - 4);
        EXPECT_EQ(r.lr, want_lr[k]);
        EXPECT_EQ(r.loss_scale, want_scale[k]);
        EXPECT_EQ(r.skipped, before + (skipped_at[k] ? 1 : 0));
      }
      before = r.skipped;
    }
    EXPECT_EQ(before, sc.skipped);
  };
  auto expect_final = [&](const char* what) {
    SCOPED_TRACE(what);
    TrainState got;
    const CheckpointMeta m = read_checkpoint(ckpt(o.optim.steps), nullptr, &got);
    EXPECT_EQ(m.loss_scale, sc.scale);
    EXPECT_EQ(m.skipped, sc.skipped);
    EXPECT_EQ(m.good_steps, sc.good_steps);
    EXPECT_TRUE(got.params == want.params) << "weights";
    EXPECT_TRUE(got.m == want.m) << "first moments";
    EXPECT_TRUE(got.v == want.v) << "second moments";
  };

  // Resumed from the rewritten checkpoint: the skips happen in the run.
  TrainOptions r1 = o;
  r1.resume = ckpt(3);
  ASSERT_EQ(run_training(r1, sink), 0) << sink.str();
  expect_rows(run);
  expect_final("resumed at step 3");

  // Resumed again after the skips (the checkpoint of step 6): the same end.
  fs::remove(ckpt(9));
  TrainOptions r2 = o;
  r2.resume = ckpt(6);
  ASSERT_EQ(run_training(r2, sink), 0) << sink.str();
  expect_rows(run);
  expect_final("resumed again at step 6");
}

// compare --checkpoint --train-batch (training_batch_problem) rebuilds the batch the run trained
// on at that step: the run's task from the checkpoint, train_batch(seed, step, micro, B, T), the
// checkpoint's weights, zero states, as verification_problem makes it; a cut keeps the first
// rows and positions; what the run did not have is refused in one line.
TEST_F(TrainRun, ATrainingBatchOfACheckpointIsTheRunsOwnBatch) {
  std::ostringstream sink;
  TrainOptions o = options("batch", Precision::F32);
  o.optim.steps = 3;
  o.grad_accum = 2;
  ASSERT_EQ(run_training(o, sink), 0) << sink.str();
  Config cfg;
  TrainState st;
  const CheckpointMeta meta = read_checkpoint((dir_ / "batch" / "ckpt-00000003.h5").string(), &cfg, &st);
  const std::unique_ptr<m3::train::Dataset> data = make_dataset(o, o.T);
  for (Idx micro : {0, 1}) {
    const m3::Problem pb = training_batch_problem(meta, cfg, st.params, {}, 2, micro, 0, 0, "t");
    const m3::Problem want =
        verification_problem(cfg, st.params, data->train_batch(o.seed, 2, micro, o.B, o.T), true);
    EXPECT_EQ(pb.B, o.B);
    EXPECT_EQ(pb.T, o.T);
    EXPECT_EQ(pb.tok, want.tok);
    EXPECT_EQ(pb.tgt, want.tgt);
    EXPECT_EQ(pb.w, want.w);
    EXPECT_EQ(pb.params.layers[0].in_proj_w, want.params.layers[0].in_proj_w);
    EXPECT_EQ(pb.states.ssm, m3::zero_states<double>(cfg, o.B).ssm);
  }
  const m3::Problem cut = training_batch_problem(meta, cfg, st.params, {}, 2, 0, 2, 5, "t");
  const m3::train::Batch full = data->train_batch(o.seed, 2, 0, o.B, o.T);
  ASSERT_EQ(cut.tok.size(), 10u);
  for (Idx b = 0; b < 2; ++b)
    for (Idx t = 0; t < 5; ++t) EXPECT_EQ(cut.tok[b * 5 + t], full.tok[b * o.T + t]);
  m3::test::expect_one_line_error(
      [&] { training_batch_problem(meta, cfg, st.params, {}, 2, 2, 0, 0, "t"); }, "no such training batch");
  m3::test::expect_one_line_error(
      [&] { training_batch_problem(meta, cfg, st.params, {}, 0, 0, 0, 0, "t"); }, "no such training batch");
  m3::test::expect_one_line_error(
      [&] { training_batch_problem(meta, cfg, st.params, {}, 2, 0, o.B + 1, 0, "t"); }, "a cut of the batch");
}

// A larger --steps extends the run (not a mismatch); any other changed setting is refused
// naming its option; a shorter run, or the finished run again, is refused too.
TEST_F(TrainRun, AResumeWithAChangedSettingIsRefusedNamingIt) {
  std::ostringstream sink;
  TrainOptions o = options("run", Precision::F32);
  o.optim.steps = 3;
  ASSERT_EQ(run_training(o, sink), 0);
  TrainOptions r = o;
  r.optim.steps = 6;
  r.resume = (dir_ / "run" / "ckpt-00000003.h5").string();
  r.optim.wd = 0.2;
  m3::test::expect_one_line_error([&] { run_training(r, sink); }, "--wd differs");
  r.optim.wd = o.optim.wd;
  r.optim.steps = 2;
  m3::test::expect_one_line_error([&] { run_training(r, sink); }, "--steps 2 is shorter");
  r.optim.steps = 3;
  EXPECT_THROW(run_training(r, sink), RunFinished);
}

// Extending a run (TRAINING.md §4): N steps, then a resume with --steps M > N, continues from
// step N + 1 with the M-step schedule: the same rows as an M-step run resumed at N from a
// checkpoint whose steps said M (the schedule is a function of t, warmup and steps alone); the
// console and config.txt say so.
TEST_F(TrainRun, ALargerStepsExtendsTheRunWithTheLongerSchedule) {
  std::ostringstream sink;
  TrainOptions o = options("ext", Precision::F32);
  o.optim.steps = 4;
  o.val_every = 0;
  ASSERT_EQ(run_training(o, sink), 0);
  TrainOptions e = o;
  e.optim.steps = 7;
  e.resume = (dir_ / "ext" / "ckpt-00000004.h5").string();
  std::ostringstream log;
  ASSERT_EQ(run_training(e, log), 0) << log.str();
  EXPECT_NE(log.str().find("extending the run from 4 to 7 steps"), std::string::npos) << log.str();
  EXPECT_NE(m3::test::slurp(dir_ / "ext" / "config.txt").find("# extended from 4 to 7 steps at step 4"),
            std::string::npos);
  const std::vector<MetricsRow> rows = read_metrics(dir_ / "ext");
  ASSERT_EQ(rows.size(), 7u);
  for (Idx k = 0; k < 7; ++k) {
    EXPECT_EQ(rows[k].step, k + 1);
    m3::OptimConfig sched = o.optim;
    sched.steps = k < 4 ? 4 : 7;  // steps 1–4 ran under the 4-step schedule, 5–7 under 7's
    EXPECT_EQ(rows[k].lr, m3::learning_rate(sched, k + 1)) << "step " << k + 1;
  }
  Config cfg;
  TrainState st;
  const CheckpointMeta m = read_checkpoint((dir_ / "ext" / "ckpt-00000007.h5").string(), &cfg, &st);
  EXPECT_EQ(int_setting(m, "steps", 0), 7);
}

TEST_F(TrainRun, TrainingAParityModelLowersItsLoss) {
  std::ostringstream sink;
  TrainOptions o = options("learn", Precision::F32);
  o.optim.steps = 40;
  o.optim.lr = 3e-2;
  o.optim.warmup = 4;
  ASSERT_EQ(run_training(o, sink), 0);
  std::ifstream in(dir_ / "learn" / "metrics.csv");
  std::string line;
  std::getline(in, line);
  std::vector<double> loss;
  while (std::getline(in, line)) loss.push_back(std::stod(line.substr(line.find(',') + 1)));
  ASSERT_EQ(loss.size(), 40u);
  double first = 0, last = 0;
  for (int i = 0; i < 5; ++i) first += loss[i], last += loss[loss.size() - 1 - i];
  EXPECT_LT(last, 0.95 * first) << sink.str();
}

// ---- sampling -------------------------------------------------------------------------------

// --step-times' line: medians over the steps after the first three, the period's and the
// remainder's over the steps measured to the next one.
TEST(StepTimes, TheSummaryTakesMediansAfterTheFirstThreeSteps) {
  EXPECT_EQ(step_times_summary({}, 1), "train: step times: none measured");
  auto st = [](double f, double b, double o, double p, bool next = true) {
    return StepTimes{f, f / 8, b, o, p, next};  // forward, uploads, backward, optimizer, period
  };
  // Steps 11-17: the first three (slow, warming up) are left out; the last is measured to its
  // own end only, so its period (and remainder) is left out too.
  const std::vector<StepTimes> t = {st(9, 9, 9, 90),    st(9, 9, 9, 90),   st(9, 9, 9, 90),
                                    st(1, 2, 0.5, 4.0), st(3, 6, 0.5, 10.5), st(2, 4, 0.25, 7),
                                    st(2, 4, 0.5, 20, false)};
  EXPECT_EQ(step_times_summary(t, 11),
            "train: step times on the device (CUDA events), medians of steps 14–17: period "
            "7.000 ms = forward 2.000 (its uploads 0.250) + backward 4.000 + optimizer 0.500 + outside them 0.750 ms; "
            "forward + backward 3.000 to 9.000 ms");
  // Three steps or fewer: all of them; a single step measured to its own end says so.
  EXPECT_EQ(step_times_summary({st(1, 2, 0.5, 4.0, false)}, 1),
            "train: step times on the device (CUDA events), medians of step 1: period 4.000 ms "
            "= forward 1.000 (its uploads 0.125) + backward 2.000 + optimizer 0.500 + outside them 0.500 ms (the "
            "period to the step's own end)");
}

// --stage-times' table: the profile's sums divided by the profiled steps, in its order, total.
TEST(StageTimes, TheTableGivesEachStagesMeanPerStepAndTheirTotal) {
  EXPECT_EQ(stage_times_table({}, 4, 4, 7), "train: stage times: none measured");
  EXPECT_EQ(stage_times_table({{"F1", 1.0}}, 0, 4, 3), "train: stage times: none measured");
  EXPECT_EQ(stage_times_table({{"F1", 2.0}, {"head (bwd)", 6.0}, {"B6", 12.5}}, 4, 4, 7),
            "train: stage times per step on the device (ms, means of steps 4–7; events between "
            "stages, layers summed; compare m3h bench --profile):\n"
            "  F1          0.500\n"
            "  head (bwd)  1.500\n"
            "  B6          3.125\n"
            "  total       5.125");
  EXPECT_NE(stage_times_table({{"F1", 2.0}}, 1, 1, 1).find("means of step 1;"),
            std::string::npos);
}

TEST(Sample, SteppingTheStatesGivesTheLogitsOfOneForwardOverTheWholeSequence) {
  const Idx V = 11;
  const Config cfg = tiny_lm(V);
  const TrainState st = initial_state(cfg, 13);
  SampleOptions o;
  o.device = "cpu";
  o.prompt = {1, 4, 2, 9, 0, 3, 3, 7, 10, 5, 1};  // 11 tokens: more than one chunk (cs 8)
  o.tokens = 9;
  o.temperature = 0.9;
  o.seed = 5;
  std::vector<std::vector<float>> step_logits;
  const std::vector<std::int32_t> gen =
      sample(o, cfg, st.params, ScanMode::Chunked, Precision::F32, &step_logits);
  ASSERT_EQ(gen.size(), 9u);
  // One forward over prompt + generated tokens (but the last one) in the sequential mode.
  const m3::test::SteppedVsFull d = m3::test::stepped_vs_full(cfg, st.params, o.prompt, gen, step_logits);
  ASSERT_EQ(static_cast<Idx>(step_logits.size()), d.rows);
  EXPECT_LE(d.worst, 1e-5 * std::max(1.0, d.scale)) << "stepping drifted from the full forward";
  // Same seed, same tokens.
  EXPECT_EQ(sample(o, cfg, st.params, ScanMode::Chunked, Precision::F32), gen);
}

// ---- m3h train / sample on bad input --------------------------------------------------------
#ifdef M3H_PATH
class TrainCli : public TrainRun {
 protected:
  using Result = m3::test::CliRun;
  Result m3h(const std::string& args) const { return m3::test::run_m3h(args, dir_, dir_); }
  static int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }
  void expect_usage_error(const std::string& args, const std::string& needle) const {
    const Result r = m3h(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out << r.err;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << ": " << r.err;
  }
};

const char* kSmallRun = "train --device cpu --d-model 8 --d-state 4 --headdim 4 --layers 1 --B 2 --T 16 --steps 3 --warmup 1 --val-batches 1";

TEST_F(TrainCli, BadDataIsOneLineAndExitTwo) {
  const std::string base = kSmallRun;
  expect_usage_error(base + " --out r --data nosuch.txt", "nosuch.txt");
  std::ofstream(dir_ / "empty.txt").close();
  expect_usage_error(base + " --out r --data empty.txt", "empty.txt");
  std::ofstream(dir_ / "short.txt") << "only a few bytes";
  expect_usage_error(base + " --out r --data short.txt", "short.txt");
  expect_usage_error(base + " --out r --task nosuch", "nosuch");
  expect_usage_error(base + " --out r", "--data");
  expect_usage_error(base + " --out r --task parity --steps 0", "steps");
  expect_usage_error(base + " --out r --task parity --d-model 0", "d-model");
  expect_usage_error(base + " --out r --task parity --B 4611686018427387904 --T 4", "B");
  EXPECT_FALSE(fs::exists(dir_ / "r" / "metrics.csv"));
}

// m3h compare --checkpoint RUN --train-batch S judges the run's batch of step S; a text run needs
// its own file (size and hash checked), and the options that do not apply are one-line errors.
TEST_F(TrainCli, CompareOnATrainingBatchRunsItOrSaysInOneLineWhyNot) {
  std::string text;
  for (int i = 0; i < 400; ++i) text += "the quick brown fox " + std::to_string(i) + "\n";
  std::ofstream(dir_ / "t.txt") << text;
  std::ofstream(dir_ / "u.txt") << text << "!";
  const Result run = m3h(std::string(kSmallRun) + " --out tr --data t.txt --dtype f32");
  ASSERT_EQ(run.status, 0) << run.err;
  const Result ok = m3h("compare --device cpu --checkpoint tr --train-batch 2 --data t.txt --dtype bf16 --scan chunked");
  EXPECT_EQ(ok.status, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("training batch of step 2:0"), std::string::npos)
      << ok.out;
  // The seed keys the perturbed draws only, and the header says which: 0 unless given. Every
  // draw run, two seeds give other baselines on the same batch.
  const std::string drawn = "compare --device cpu --checkpoint tr --train-batch 2 --data t.txt "
                            "--dtype bf16 --scan chunked --every-draw";
  const Result s0 = m3h(drawn), s4 = m3h(drawn + " --seed 4");
  ASSERT_EQ(s0.status, 0) << s0.out << s0.err;
  ASSERT_EQ(s4.status, 0) << s4.out << s4.err;
  const auto at = [](std::string out, const std::string& seed) {
    const std::size_t i = out.find(" seed=" + seed + " ");
    EXPECT_NE(i, std::string::npos) << out;
    return i == std::string::npos ? out : out.replace(i, seed.size() + 7, " seed=S ");
  };
  EXPECT_NE(at(s0.out, "0"), at(s4.out, "4")) << "the seed did not reach the draws";
  const std::string base = "compare --device cpu --checkpoint tr --train-batch 2";
  expect_usage_error(base, "give the file: --data FILE");
  expect_usage_error(base + " --data u.txt", "the text is not the run's");
  expect_usage_error(base + " --data t.txt --B 3", "a cut of the batch");
  expect_usage_error(base + " --data t.txt --zero-states", "--zero-states");
  expect_usage_error(base + " --data t.txt --seed x", "--seed");
  expect_usage_error(base.substr(0, base.size() - 1) + "two --data t.txt", "STEP or STEP:MICRO");
  expect_usage_error("compare --device cpu --checkpoint tr --data t.txt", "--data: only with");
}

// --gpus with the CPU ranks (parallel.hpp): a run that reports its exchange; a batch that does
// not split, job options without a job, and (without NCCL) several GPUs: one line, exit 2.
TEST_F(TrainCli, DataParallelOptionsRunOrSayInOneLineWhyNot) {
  const std::string base = std::string(kSmallRun) + " --task parity";
  const Result ok = m3h(base + " --gpus 2 --out two");
  EXPECT_EQ(ok.status, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("2 CPU ranks"), std::string::npos) << ok.out;
  EXPECT_NE(ok.out.find("ms/step"), std::string::npos) << "the exchange's time: " << ok.out;
  expect_usage_error(base + " --gpus 3 --out r", "split evenly");
  expect_usage_error(base + " --gpus 0 --out r", "--gpus");
  expect_usage_error(base + " --rank 1 --out r", "--nccl-id-file");
  expect_usage_error(base + " --nccl-id-file id --out r", "world");
  expect_usage_error(base + " --nccl-id-file id --world-size 2 --rank 0 --out r", "GPUs");
  EXPECT_FALSE(fs::exists(dir_ / "r" / "metrics.csv"));
}

TEST_F(TrainCli, VerifyEveryOnTheCpuIsRefusedItHasNoKernelToVerify) {
  expect_usage_error(std::string(kSmallRun) + " --task parity --out r --verify-every 2",
                     "--verify-every");
  EXPECT_FALSE(fs::exists(dir_ / "r" / "metrics.csv"));
}

TEST_F(TrainCli, StepAndStageTimesOnTheCpuOrDataParallelAreRefused) {
  const std::string base = std::string(kSmallRun) + " --task parity --step-times";
  expect_usage_error(base + " --out r", "--step-times");
  expect_usage_error(base + " --gpus 2 --out r", "--step-times");
  const std::string stages = std::string(kSmallRun) + " --task parity --stage-times";
  expect_usage_error(stages + " --out r", "--stage-times");
  expect_usage_error(stages + " --gpus 2 --out r", "--stage-times");
  EXPECT_FALSE(fs::exists(dir_ / "r"));  // refused before the run directory is made
}

TEST_F(TrainCli, AnOutThatHoldsAnotherRunIsRefusedAndLeftAlone) {
  const std::string run = std::string(kSmallRun) + " --task parity --out r";
  ASSERT_EQ(m3h(run).status, 0);
  const auto before = fs::last_write_time(dir_ / "r" / "metrics.csv");
  std::ifstream in(dir_ / "r" / "metrics.csv");
  std::stringstream was;
  was << in.rdbuf();
  expect_usage_error(run, "holds another run");
  std::ifstream in2(dir_ / "r" / "metrics.csv");
  std::stringstream now;
  now << in2.rdbuf();
  EXPECT_EQ(was.str(), now.str());
  EXPECT_EQ(before, fs::last_write_time(dir_ / "r" / "metrics.csv"));
  EXPECT_EQ(m3h(run + " --force").status, 0);
}

TEST_F(TrainCli, ACorruptOrMismatchedCheckpointIsOneLine) {
  const std::string run = std::string(kSmallRun) + " --task parity --out r";
  ASSERT_EQ(m3h(run).status, 0);
  expect_usage_error(run + " --resume r/ckpt-00000003.h5 --lr 0.5", "--lr differs");
  std::ofstream(dir_ / "bad.h5") << "not an HDF5 file";
  expect_usage_error(run + " --resume bad.h5", "bad.h5");
  expect_usage_error("sample --device cpu --checkpoint bad.h5", "bad.h5");
  expect_usage_error("sample --device cpu --checkpoint nosuch.h5", "nosuch.h5");
}

// Ctrl-C (TRAINING.md §5): the step finishes, a checkpoint of that step is written, exit 130;
// the checkpoint resumes.
TEST_F(TrainCli, CtrlCFinishesTheStepWritesACheckpointAndExits130) {
  const std::string out = (dir_ / "r").string();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl(M3H_PATH, M3H_PATH, "train", "--device", "cpu", "--task", "parity", "--d-model", "16",
          "--d-state", "4", "--headdim", "8", "--layers", "2", "--B", "4", "--T", "64",
          "--steps", "20000", "--warmup", "2", "--val-batches", "0", "--log-every", "100000",
          "--out", out.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  // Wait for a few metrics rows, then interrupt.
  const fs::path csv = dir_ / "r" / "metrics.csv";
  int rows = 0;
  for (int i = 0; i < 3000 && rows < 4; ++i) {
    usleep(10000);
    std::ifstream in(csv);
    rows = static_cast<int>(std::count(std::istreambuf_iterator<char>(in), {}, '\n'));
  }
  ASSERT_GE(rows, 4) << "the run wrote no metrics";
  kill(pid, SIGINT);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  // The checkpoint is of the last step in metrics.csv.
  std::ifstream in(csv);
  std::string line, last;
  while (std::getline(in, line)) last = line;
  const long step = std::stol(last.substr(0, last.find(',')));
  ASSERT_GT(step, 2);
  ASSERT_LT(step, 20000) << "the run ended before the signal came";
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%08ld.h5", step);
  ASSERT_TRUE(fs::exists(dir_ / "r" / name)) << name;
  m3::Config cfg;
  TrainState st;
  EXPECT_EQ(read_checkpoint((dir_ / "r" / name).string(), &cfg, &st).step, step);
  for (const auto& e : fs::directory_iterator(dir_ / "r"))
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();
}

TEST_F(TrainCli, CompareOnACheckpointsTrainedWeights) {
  ASSERT_EQ(m3h(std::string(kSmallRun) + " --task parity --out r").status, 0);
  const Result r = m3h("compare --device cpu --checkpoint r/ckpt-00000003.h5 --T 24 --dtype f32");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("grad/head_w"), std::string::npos);
  EXPECT_NE(r.out.find("checkpoint r/ckpt-00000003.h5"), std::string::npos) << r.out;
  // A run folder means its latest checkpoint, as in sample, eval and train --resume.
  const Result run = m3h("compare --device cpu --checkpoint r --T 24 --dtype f32 --scan seq");
  EXPECT_EQ(run.status, 0) << run.out << run.err;
  EXPECT_NE(run.out.find("checkpoint r/ckpt-00000003.h5 (step 3)"), std::string::npos) << run.out;
  expect_usage_error("compare --device cpu --checkpoint r/ckpt-00000003.h5 --d-model 8", "--d-model");
}

TEST_F(TrainCli, TheLmPresetComparesATrainingStepEndToEndAndIsolatedAndDumpsIt) {
  const Result r = m3h("compare --device cpu --preset lm --T 24 --mode both --failures-only");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("PASS (e2e PASS, isolated PASS)"), std::string::npos) << r.out;
  const Result d = m3h("dump --device cpu --preset lm --T 24 --stage 'head/*,loss/*,grad/head_w' "
                       "--dtype bf16 --scan chunked --out lm.h5");
  EXPECT_EQ(d.status, 0) << d.out << d.err;
  EXPECT_NE(d.out.find("6 key group(s)"), std::string::npos) << d.out;
}

TEST_F(TrainCli, SampleWritesTheContinuationInTheTasksSpelling) {
  ASSERT_EQ(m3h(std::string(kSmallRun) + " --task parity --out r").status, 0);
  const Result r = m3h("sample --device cpu --checkpoint r/ckpt-00000003.h5 --prompt 0110 --tokens 5");
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_GE(r.out.size(), 10u);
  EXPECT_EQ(r.out.substr(0, 4), "0110");
  for (char c : r.out.substr(4, 5)) EXPECT_TRUE(c == '0' || c == '1' || c == '.') << r.out;
}
#endif

}  // namespace
