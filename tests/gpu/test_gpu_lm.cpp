// The GPU path of a token model (TRAINING.md §1–§4) against the reference: the whole training
// step — tokens in, the embedding, the backbone, head, loss, every gradient out — compared by
// the harness (compare_captures: every registry tensor and every parameter gradient within
// budget of the double oracle, with the float reference and its storage emulation as the
// baseline) in f32/bf16/f16 × seq/chunked; the production pass equal to the verification pass
// bit for bit; the GPU training step bit-identical run to run; a K-step trajectory within twice
// the float CPU path's drift from the double oracle; bit-exact resume of m3h train's loop on the
// GPU; the GPU sampler's stepping equal to one forward. Every test skips without a device.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "backbone.hpp"
#include "backbone_gpu.hpp"
#include "backend.hpp"
#include "checkpoint.hpp"
#include "compare.hpp"
#include "context.hpp"
#include "gpu_test_util.hpp"
#include "../lm_test_util.hpp"
#include "../test_compare.hpp"
#include "lm.hpp"
#include "optimizer.hpp"
#include "run_dir.hpp"
#include "trainer.hpp"

namespace fs = std::filesystem;

namespace {

using m3::Config;
using m3::Idx;
using m3::Precision;
using m3::ScanMode;

Config lm_cfg(Idx V, Idx ds = 16, double rope = 0.5) {
  Config c;
  c.d_model = 64;
  c.d_state = ds;
  c.headdim = 16;
  c.expand = 2;
  c.ngroups = 1;
  c.n_layers = 2;
  c.rope_fraction = rope;
  c.chunk_size = 32;
  return m3::test::token_model(c, V);
}

using Tokens = m3::test::TokenBatch;

Tokens random_tokens(Idx BT, Idx V, std::uint64_t seed) {
  return m3::test::random_token_batch(BT, V, seed);
}

template <class S>
m3::Capture reference_step(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision st,
                           const m3::Params<double>& pd, const Tokens& t) {
  m3::LmModel<S> m(cfg, B, T, mode, st);
  const m3::Params<S> p = m3::cast_params<S>(pd);
  m3::Capture cap(cfg, B, T);
  m.forward(p, t.tok, t.tgt, t.w, t.n, nullptr, &cap);
  m3::Params<S> g = m3::zero_params<S>(cfg);
  m.backward(p, 1.0, g, &cap);
  m3::capture_grads(g, cfg, cap);
  return cap;
}

m3::Capture gpu_step(m3::gpu::GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode,
                     Precision st, const m3::Params<double>& pd, const Tokens& t, bool capture,
                     double* loss = nullptr) {
  m3::gpu::GpuBackbone net(ctx, cfg, B, T, mode, st);
  net.set_params(m3::cast_params<float>(pd));
  net.zero_states();
  net.zero_grads();
  net.set_tokens(t.tok);
  net.set_targets(t.tgt, t.w, t.n);
  m3::Capture cap(cfg, B, T);
  const double l = net.forward_loss(capture ? &cap : nullptr);
  net.backward_loss(1.0, capture ? &cap : nullptr);
  if (loss) *loss = l;
  m3::capture_grads(net.grads(), cfg, cap);
  if (!capture) {
    const std::vector<float> lg = net.logits();
    cap.put_stage(-1, "head", "logits", lg.data(), static_cast<Idx>(lg.size()));
  }
  return cap;
}

class GpuLmStep : public ::testing::TestWithParam<std::tuple<Precision, ScanMode>> {};

TEST_P(GpuLmStep, EveryTensorAndGradientOfATrainingStepIsWithinBudgetOfTheOracle) {
  M3_SKIP_WITHOUT_GPU();
  const auto [st, mode] = GetParam();
  const Idx B = 2, T = 80, V = 37;
  const Config cfg = lm_cfg(V);
  const m3::Params<double> pd = m3::make_params<double>(cfg, 7);
  const Tokens t = random_tokens(B * T, V, 8);
  const m3::Capture oracle = reference_step<double>(cfg, B, T, mode, Precision::F64, pd, t);
  const m3::Capture base = reference_step<float>(cfg, B, T, mode, st, pd, t);
  m3::gpu::GpuContext ctx;
  const m3::Capture subject = gpu_step(ctx, cfg, B, T, mode, st, pd, t, true);
  m3::harness::CompareOptions opt;
  opt.precision = st;
  const m3::harness::CompareResult r =
      m3::harness::compare_captures(oracle, subject, &base, cfg, B, T, mode, opt);
  for (const char* k : {"head/logits", "loss/value", "head/d_logits", "grad/head_w",
                        "grad/input_proj_w", "grad/input_proj_b"}) {
    bool found = false;
    for (const auto& row : r.rows) found |= row.key == k;
    EXPECT_TRUE(found) << k << " was not compared";
  }
  ASSERT_TRUE(r.pass()) << "first failing: " << r.rows[r.first_fail].key << " ("
                        << r.rows[r.first_fail].note << ")";
}

INSTANTIATE_TEST_SUITE_P(
    AllPrecisionsAndModes, GpuLmStep,
    ::testing::Combine(::testing::Values(Precision::F32, Precision::BF16, Precision::F16),
                       ::testing::Values(ScanMode::Sequential, ScanMode::Chunked)),
    [](const auto& info) {
      return std::string(m3::precision_name(std::get<0>(info.param))) + "_" +
             m3::scan_mode_name(std::get<1>(info.param));
    });

// The isolated (teacher-forced) mode of a token model: every stage, the embedding, head and
// loss included, fed the oracle's inputs, within the isolated budgets.
TEST_P(GpuLmStep, EveryStageIsolatedIsWithinBudgetOfTheOracle) {
  M3_SKIP_WITHOUT_GPU();
  const auto [st, mode] = GetParam();
  m3::Config cfg = lm_cfg(41);
  const m3::Problem pb = m3::make_problem(cfg, 2, 72, 5, true);
  const m3::Capture oracle = m3::run_reference<double>(pb, mode);
  m3::gpu::GpuContext ctx;
  const m3::Capture iso = m3::gpu::run_gpu_isolated(ctx, pb, mode, oracle, st);
  m3::harness::CompareOptions opt;
  opt.precision = st;
  opt.compare_mode = m3::harness::CompareMode::Isolated;
  const m3::harness::CompareResult r =
      m3::harness::compare_captures(oracle, iso, nullptr, cfg, pb.B, pb.T, mode, opt);
  ASSERT_TRUE(r.pass()) << "first failing: " << r.rows[r.first_fail].key << " ("
                        << r.rows[r.first_fail].note << ")";
  // And the end-to-end run of the same Problem through run_gpu (the harness's subject).
  const m3::Capture e2e = m3::gpu::run_gpu(ctx, pb, mode, st);
  const m3::Capture base = m3::run_reference<float>(pb, mode, st);
  opt.compare_mode = m3::harness::CompareMode::EndToEnd;
  const m3::harness::CompareResult r2 =
      m3::harness::compare_captures(oracle, e2e, &base, cfg, pb.B, pb.T, mode, opt);
  ASSERT_TRUE(r2.pass()) << "first failing: " << r2.rows[r2.first_fail].key;
}

// The negative controls on a token model: every injected fault fails the isolated comparison
// of the training step, and the first failing tensor is the faulted stage's (layer 0).
TEST(GpuLm, EveryFaultInATrainingStepFailsAndNamesItsStageFirst) {
  M3_SKIP_WITHOUT_GPU();
  const m3::Config cfg = lm_cfg(23);
  const m3::Problem pb = m3::make_problem(cfg, 1, 96, 9, true);
  m3::gpu::GpuContext ctx;
  for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
    const m3::Capture oracle = m3::run_reference<double>(pb, mode);
    m3::harness::CompareOptions opt;
    opt.precision = Precision::BF16;
    opt.compare_mode = m3::harness::CompareMode::Isolated;
    for (m3::gpu::Fault f : {m3::gpu::Fault::DropBeta, m3::gpu::Fault::FlipAngleSign,
                             m3::gpu::Fault::ChunkBoundaryOff, m3::gpu::Fault::RoundTwice}) {
      const m3::Capture iso = m3::gpu::run_gpu_isolated(ctx, pb, mode, oracle, Precision::BF16, f);
      const m3::harness::CompareResult r =
          m3::harness::compare_captures(oracle, iso, nullptr, cfg, pb.B, pb.T, mode, opt);
      const std::string where = std::string(m3::gpu::fault_name(f)) + " " + m3::scan_mode_name(mode);
      ASSERT_FALSE(r.pass()) << where;
      const std::string want = std::string("L0/") + m3::gpu::fault_stage(f) + "/";
      EXPECT_EQ(r.rows[r.first_fail].key.rfind(want, 0), 0u)
          << where << ": first failing " << r.rows[r.first_fail].key << ", expected " << want;
    }
  }
}

TEST(GpuLm, TheProductionPassEqualsTheVerificationPassAndRunsAreBitIdentical) {
  M3_SKIP_WITHOUT_GPU();
  const Idx B = 3, T = 70, V = 256;
  for (Precision st : {Precision::F32, Precision::BF16}) {
    const Config cfg = lm_cfg(V);
    const m3::Params<double> pd = m3::make_params<double>(cfg, 17);
    const Tokens t = random_tokens(B * T, V, 18);
    m3::gpu::GpuContext ctx;
    double l1 = 0, l2 = 0, l3 = 0;
    const m3::Capture a = gpu_step(ctx, cfg, B, T, ScanMode::Chunked, st, pd, t, false, &l1);
    const m3::Capture b = gpu_step(ctx, cfg, B, T, ScanMode::Chunked, st, pd, t, false, &l2);
    const m3::Capture full = gpu_step(ctx, cfg, B, T, ScanMode::Chunked, st, pd, t, true, &l3);
    EXPECT_EQ(l1, l2) << m3::precision_name(st);
    EXPECT_EQ(l1, l3) << m3::precision_name(st);
    EXPECT_EQ(first_bit_difference(a, b), "") << "two production runs differ";
    EXPECT_EQ(first_bit_difference(a, full), "") << "production differs from verification";
  }
}

// Staging (GpuBackbone::stage_batch / upload_staged, the training backend's stage /
// forward_staged): a run whose steps' first batches are staged during the step before gives
// the plain run's losses, norms, weights and moments bit for bit (three steps: both pinned slots,
// then the first again); a bad batch is refused by stage_batch with set_tokens' or
// set_targets' message, and leaves nothing staged.
TEST(GpuLm, StagingTheNextBatchChangesNoBitAndItsErrorsAreThePlainOnes) {
  M3_SKIP_WITHOUT_GPU();
  using namespace m3::train;
  const Idx B = 2, T = 64, V = 29;
  const Config cfg = lm_cfg(V);
  for (Precision st : {Precision::F32, Precision::BF16, Precision::F16}) {
    SCOPED_TRACE(m3::precision_name(st));
    const BackendSpec spec = m3::test::chunked_spec(cfg, B, T, st);
    m3::test::Trajectory a, b;
    {
      auto plain = make_gpu_backend(spec);
      a = m3::test::train_trajectory(*plain, cfg, st, B, T, 3);
    }
    {
      auto staged = make_gpu_backend(spec);
      b = m3::test::train_trajectory(*staged, cfg, st, B, T, 3, true);
    }
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.norm, b.norm);
    EXPECT_EQ(a.end.params, b.end.params);
    EXPECT_EQ(a.end.m, b.end.m);
    EXPECT_EQ(a.end.v, b.end.v);
  }

  m3::gpu::GpuContext ctx;
  m3::gpu::GpuBackbone net(ctx, cfg, B, T, ScanMode::Chunked, Precision::BF16);
  const Tokens good = random_tokens(B * T, V, 5);
  auto message = [](auto&& f) {
    try {
      f();
    } catch (const m3::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  struct Bad {
    const char* what;
    std::vector<std::int32_t> tok, tgt;
    std::vector<float> w;
    double n;
  };
  std::vector<Bad> bad;
  auto with = [&](const char* what) {
    bad.push_back({what, good.tok, good.tgt, good.w, good.n});
    return &bad.back();
  };
  with("a token outside the vocabulary")->tok[7] = static_cast<std::int32_t>(V);
  with("a negative token")->tok[0] = -1;
  with("too few tokens")->tok.pop_back();
  with("a target outside the vocabulary")->tgt[9] = static_cast<std::int32_t>(V + 3);
  with("a NaN weight")->w[3] = std::nanf("");
  with("a negative weight")->w[5] = -1.0f;
  with("too many weights")->w.push_back(1.0f);
  with("N = 0")->n = 0;
  for (const Bad& x : bad) {
    SCOPED_TRACE(x.what);
    const std::string plain = message([&] {
      net.set_tokens(x.tok);
      net.set_targets(x.tgt, x.w, x.n);
    });
    EXPECT_NE(plain, "no error");
    EXPECT_EQ(plain.find('\n'), std::string::npos) << plain;
    EXPECT_EQ(message([&] { net.stage_batch(x.tok, x.tgt, x.w, x.n); }), plain);
    EXPECT_NE(message([&] { net.upload_staged(); }).find("no staged batch"), std::string::npos);
  }
  // A good batch uploads once; a second upload_staged has nothing staged.
  net.stage_batch(good.tok, good.tgt, good.w, good.n);
  net.upload_staged();
  EXPECT_NE(message([&] { net.upload_staged(); }).find("no staged batch"), std::string::npos);
  // Without a vocabulary there is nothing to stage.
  Config plain_cfg = cfg;
  plain_cfg.vocab_size = 0;
  m3::gpu::GpuBackbone no_vocab(ctx, plain_cfg, B, T, ScanMode::Chunked, Precision::BF16);
  EXPECT_NE(message([&] { no_vocab.stage_batch(good.tok, good.tgt, good.w, good.n); })
                .find("no token model"),
            std::string::npos);
}

// K optimizer steps on the GPU (f32) and on the float CPU path, both against the same K
// steps in double: the GPU's drift is held to k = 2 times the float path's plus a floor of
// 1e-6 relative (TRAINING.md §2: the tolerance a run of K steps can justify is the float
// baseline's own drift, which tests/test_train.cpp measures at ≤ 3e-6 after 6 steps).
TEST(GpuLm, AKStepTrajectoryStaysWithinTwiceTheFloatPathsDrift) {
  M3_SKIP_WITHOUT_GPU();
  using namespace m3::train;
  const Idx B = 2, T = 64, V = 29, K = 8;
  const Config cfg = lm_cfg(V);
  const m3::ParamLayout layout = m3::param_layout(cfg);
  m3::OptimConfig o;
  o.lr = 1e-2;
  o.warmup = 2;
  o.steps = K;
  BackendSpec spec{cfg, B, T, ScanMode::Chunked, Precision::F32, m3::Recompute::None};
  auto gpu = make_gpu_backend(spec);
  auto cpu = make_cpu_backend(spec);
  const TrainState s0 = initial_state(cfg, 3);
  gpu->set_state(s0);
  cpu->set_state(s0);
  std::vector<double> p(s0.params.begin(), s0.params.end()), m(p.size()), v(p.size());
  m3::LmModel<double> oracle(cfg, B, T, ScanMode::Chunked);
  const auto decay = m3::decay_flags(layout);
  m3::LossScaler sg, sc;
  double worst_loss_gpu = 0, worst_loss_cpu = 0;
  for (Idx t = 1; t <= K; ++t) {
    const Tokens tk = random_tokens(B * T, V, 50 + t);
    Batch b;
    b.B = B;
    b.T = T;
    b.tok = tk.tok;
    b.tgt = tk.tgt;
    b.w = tk.w;
    const StepResult rg = train_step(*gpu, {b}, t, o, sg);
    const StepResult rc = train_step(*cpu, {b}, t, o, sc);
    m3::Params<double> pd = m3::cast_params<double>(
        from_flat(std::vector<float>(p.begin(), p.end()), cfg, layout));
    // (the oracle keeps its double weights: pd is only the shape donor)
    m3::for_each_param(pd, [&](int l, const char* name, std::vector<double>& vec) {
      if (vec.empty()) return;
      const auto& sl = layout.at(l, name);
      std::copy(p.begin() + sl.offset, p.begin() + sl.offset + sl.size, vec.begin());
    });
    const double loss = oracle.forward(pd, b.tok, b.tgt, b.w, tk.n);
    m3::Params<double> gd = m3::zero_params<double>(cfg);
    oracle.backward(pd, 1.0, gd);
    std::vector<double> g(p.size(), 0.0);
    m3::for_each_param(gd, [&](int l, const char* name, const std::vector<double>& vec) {
      if (vec.empty()) return;
      std::copy(vec.begin(), vec.end(), g.begin() + layout.at(l, name).offset);
    });
    const double gn = m3::grad_norm(g.data(), layout.total);
    m3::adamw_step(layout, decay, m3::adamw_scalars(o, t, m3::clip_coefficient(gn, o.clip), 1.0),
                   p.data(), m.data(), v.data(), g.data());
    worst_loss_gpu = std::max(worst_loss_gpu, std::abs(rg.loss - loss) / loss);
    worst_loss_cpu = std::max(worst_loss_cpu, std::abs(rc.loss - loss) / loss);
  }
  auto drift = [&](const std::vector<float>& f) { return m3::test::rel_l2(f, p); };
  const double dg = drift(gpu->state().params), dc = drift(cpu->state().params);
  std::cout << "[ measured ] K=" << K << " steps: weights rel_l2 vs the double oracle: gpu "
            << dg << ", float cpu " << dc << "; worst loss rel error: gpu " << worst_loss_gpu
            << ", float cpu " << worst_loss_cpu << "\n";
  EXPECT_LE(dg, 2 * dc + 1e-6);
  EXPECT_LE(worst_loss_gpu, 2 * worst_loss_cpu + 1e-6);
}

class GpuTrainRun : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("m3_gpu_train_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  m3::train::TrainOptions options(const std::string& out, Precision st) const {
    m3::train::TrainOptions o;
    o.cfg = lm_cfg(3, 4, 1.0);
    o.device = "gpu";
    o.storage = st;
    o.B = 4;
    o.T = 64;
    o.optim.lr = 1e-2;
    o.optim.warmup = 2;
    o.optim.steps = 10;
    o.seed = 5;
    o.task = "parity";
    o.out = (dir_ / out).string();
    o.val_batches = 2;
    o.val_every = 5;
    o.log_every = 100;
    o.config_text = "# test\n";
    return o;
  }
  fs::path dir_;
};

TEST_F(GpuTrainRun, KStepsSaveResumeAndTheRestEqualTheRunStraightBitForBit) {
  M3_SKIP_WITHOUT_GPU();
  for (Precision st : {Precision::BF16, Precision::F16, Precision::F32}) {
    SCOPED_TRACE(m3::precision_name(st));
    m3::test::expect_bit_exact_resume(dir_, options("unused", st), 4);
  }
}

// --step-times (train/backend.cpp): timing changes no bit; every step's forward, backward and
// optimizer are positive and lie within its period; a step is given once its next has begun on
// the device, the last after waiting; the run prints their medians; the CPU cannot time.
TEST_F(GpuTrainRun, StepTimesChangeNoBitAndEachStepsPartsLieWithinItsPeriod) {
  M3_SKIP_WITHOUT_GPU();
  using namespace m3::train;
  const Idx B = 2, T = 64, V = 29;
  const Config cfg = lm_cfg(V);
  const BackendSpec spec = m3::test::chunked_spec(cfg, B, T, Precision::BF16);
  auto plain = make_gpu_backend(spec), timed = make_gpu_backend(spec);
  ASSERT_TRUE(timed->time_steps());
  // Five steps of two micro-batches each, then the state (which waits for the device).
  const auto a = m3::test::train_trajectory(*plain, cfg, Precision::BF16, B, T, 5);
  const auto b = m3::test::train_trajectory(*timed, cfg, Precision::BF16, B, T, 5);
  EXPECT_EQ(a.loss, b.loss);
  EXPECT_EQ(a.norm, b.norm);
  EXPECT_TRUE(a.end.params == b.end.params && a.end.m == b.end.m && a.end.v == b.end.v);
  std::vector<StepTimes> t = timed->step_times(false);
  EXPECT_EQ(t.size(), 4u) << "steps 1-4 (the fifth has no next step yet)";
  for (const StepTimes& s : timed->step_times(true)) t.push_back(s);
  ASSERT_EQ(t.size(), 5u);
  for (size_t k = 0; k < t.size(); ++k) {
    SCOPED_TRACE("step " + std::to_string(k + 1));
    EXPECT_GT(t[k].forward_ms, 0.0);
    EXPECT_GT(t[k].uploads_ms, 0.0);
    EXPECT_LT(t[k].uploads_ms, t[k].forward_ms);
    EXPECT_GT(t[k].backward_ms, 0.0);
    EXPECT_GT(t[k].optimizer_ms, 0.0);
    EXPECT_GE(t[k].period_ms + 1e-3, t[k].forward_ms + t[k].backward_ms + t[k].optimizer_ms);
    EXPECT_EQ(t[k].to_next, k + 1 < t.size());
  }
  EXPECT_TRUE(timed->step_times(true).empty());
  EXPECT_FALSE(make_cpu_backend(spec)->time_steps());

  TrainOptions o = options("step_times", Precision::BF16);
  o.step_times = true;
  std::ostringstream log;
  ASSERT_EQ(run_training(o, log), 0) << log.str();
  EXPECT_NE(log.str().find("step times on the device (CUDA events), medians of steps 4–10"),
            std::string::npos)
      << log.str();
  // Every step's row in step_times.csv, the last one's period to its own end.
  std::ifstream in(fs::path(o.out) / "step_times.csv");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 11u);
  EXPECT_EQ(lines[0], kStepTimesHeader);
  EXPECT_EQ(lines[1].rfind("1,", 0), 0u) << lines[1];
  EXPECT_EQ(lines[10].rfind("10,", 0), 0u) << lines[10];
  EXPECT_EQ(lines[9].substr(lines[9].size() - 2), ",1");
  EXPECT_EQ(lines[10].substr(lines[10].size() - 2), ",0");
}

// --stage-times: the backbone's stage profile over steps 4-10 changes no bit of the run (its
// final checkpoint equals the unprofiled run's), and the table names the scan's stages; with
// --step-times too it is refused.
TEST_F(GpuTrainRun, StageTimesChangeNoBitAndTableTheStages) {
  M3_SKIP_WITHOUT_GPU();
  using namespace m3::train;
  TrainOptions plain = options("stages_plain", Precision::BF16);
  TrainOptions prof = options("stages_prof", Precision::BF16);
  prof.stage_times = true;
  std::ostringstream a, b;
  ASSERT_EQ(run_training(plain, a), 0) << a.str();
  ASSERT_EQ(run_training(prof, b), 0) << b.str();
  const std::string log = b.str();
  EXPECT_NE(log.find("stage times per step on the device (ms, means of steps 4–10"),
            std::string::npos)
      << log;
  for (const char* stage : {"\n  F6 ", "\n  B6 ", "\n  head ", "\n  total "})
    EXPECT_NE(log.find(stage), std::string::npos) << stage << " missing:\n" << log;
  TrainState sa, sb;
  m3::Config ca, cb;
  read_checkpoint((fs::path(plain.out) / "ckpt-00000010.h5").string(), &ca, &sa);
  read_checkpoint((fs::path(prof.out) / "ckpt-00000010.h5").string(), &cb, &sb);
  EXPECT_TRUE(sa.params == sb.params && sa.m == sb.m && sa.v == sb.v);
  TrainOptions both = options("stages_both", Precision::BF16);
  both.stage_times = both.step_times = true;
  std::ostringstream c;
  EXPECT_THROW(run_training(both, c), m3::Error);
}

TEST_F(GpuTrainRun, VerifyEveryPassesOnCorrectCodeAndAFaultStopsTheRunNamingItsStage) {
  M3_SKIP_WITHOUT_GPU();
  using namespace m3::train;
  for (const std::string oracle : {"cpu", "gpu"})
  for (Precision st : {Precision::BF16, Precision::F32}) {
    SCOPED_TRACE(oracle + " " + m3::precision_name(st));
    std::ostringstream ok_log;
    TrainOptions o = options("verify_" + oracle + m3::precision_name(st), st);
    o.verify_every = 3;
    o.verify_oracle = oracle;
    ASSERT_EQ(run_training(o, ok_log), 0) << ok_log.str();
    std::ifstream in(fs::path(o.out) / "metrics.csv");
    std::string line;
    int verified = 0;
    // The verify_pct column, found by its name in the header.
    auto cells = [](const std::string& row) {
      std::vector<std::string> c;
      std::stringstream ss(row);
      for (std::string cell; std::getline(ss, cell, ',');) c.push_back(cell);
      if (!row.empty() && row.back() == ',') c.push_back("");
      return c;
    };
    std::getline(in, line);
    const std::vector<std::string> header = cells(line);
    const auto col = std::find(header.begin(), header.end(), "verify_pct") - header.begin();
    ASSERT_LT(col, static_cast<std::ptrdiff_t>(header.size())) << line;
    while (std::getline(in, line)) {
      const std::vector<std::string> row = cells(line);
      ASSERT_EQ(row.size(), header.size()) << line;
      const std::string pct = row[static_cast<size_t>(col)];
      if (!pct.empty()) {
        ++verified;
        EXPECT_LT(std::stod(pct), 100.0) << line;
      }
    }
    EXPECT_EQ(verified, 3);  // steps 3, 6, 9
    std::ostringstream bad_log;
    TrainOptions f = options("fault_" + oracle + m3::precision_name(st), st);
    f.verify_every = 3;
    f.verify_oracle = oracle;
    f.verify_fault = m3::gpu::Fault::DropBeta;
    EXPECT_EQ(run_training(f, bad_log), 1);
    EXPECT_NE(bad_log.str().find("verification failed at step 3"), std::string::npos)
        << bad_log.str();
    EXPECT_NE(bad_log.str().find("/F5b/beta"), std::string::npos) << bad_log.str();
    EXPECT_NE(bad_log.str().find("largest shares of budget:"), std::string::npos) << bad_log.str();
    EXPECT_NE(bad_log.str().find("reproduce: m3h compare --checkpoint "), std::string::npos)
        << bad_log.str();
    // A GPU-oracle verdict also names the Eigen oracle's command on the first row; a CPU one
    // is that verdict already.
    const bool settle = bad_log.str().find("HARNESS.md §11): m3h compare --checkpoint ") !=
                        std::string::npos;
    EXPECT_EQ(settle, oracle == "gpu") << bad_log.str();
    EXPECT_TRUE(fs::exists(fs::path(f.out) / "ckpt-00000003.h5"));
  }
}

TEST(GpuLm, TheSamplersStepsEqualOneForwardOverTheWholeSequence) {
  M3_SKIP_WITHOUT_GPU();
  using namespace m3::train;
  const Idx V = 50;
  const Config cfg = lm_cfg(V);
  const TrainState st = initial_state(cfg, 23);
  SampleOptions o;
  o.device = "gpu";
  for (int i = 0; i < 70; ++i) o.prompt.push_back((i * 7) % V);  // > 2 chunks of 32
  o.tokens = 12;
  o.seed = 2;
  std::vector<std::vector<float>> steps;
  const auto gen = sample(o, cfg, st.params, ScanMode::Chunked, Precision::F32, &steps);
  const m3::test::SteppedVsFull d = m3::test::stepped_vs_full(cfg, st.params, o.prompt, gen, steps);
  ASSERT_EQ(static_cast<Idx>(steps.size()), d.rows);
  EXPECT_LE(d.worst, 1e-4 * std::max(1.0, d.scale));
}

}  // namespace
