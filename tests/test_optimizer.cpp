// The host optimizer step of TRAINING.md §2 (reference/optimizer.hpp): the learning-rate
// schedule's warmup ramp, peak (exactly lr at t = warmup < steps), cosine midpoint and floor; the decay rule on a real token-model
// layout; the fixed-order gradient norm (against a direct double sum, its own blocked order bit
// for bit, and non-finite input); the clip coefficient; AdamW against a hand-written
// PyTorch-style AdamW in double (a decayed and an undecayed slot, t = 1 and t = 3); the gaps of
// the flat layout untouched; the float step within a few float ulps of the double step;
// OptimConfig::validate naming the field; the f16 loss scaler's state machine.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "optimizer.hpp"
#include "precision.hpp"
#include "registry.hpp"

namespace {

using m3::AdamWScalars;
using m3::Idx;
using m3::LossScaler;
using m3::OptimConfig;
using m3::ParamLayout;
using m3::Precision;

// A token model small enough to check element by element: head_w exists (vocab 5), the
// norm weights (8 floats) leave gaps of 56 floats in the 64-float-aligned layout.
m3::Config small_token_config() {
  m3::Config cfg;
  cfg.d_model = 8;
  cfg.d_state = 4;
  cfg.expand = 2;
  cfg.headdim = 4;
  cfg.ngroups = 1;
  cfg.n_layers = 2;
  cfg.vocab_size = 5;
  cfg.input_dim = 5;
  cfg.validate();
  return cfg;
}

std::vector<float> random_floats(Idx n, std::uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (float& e : x) e = d(rng);
  return x;
}

std::vector<double> widen(const std::vector<float>& x) { return {x.begin(), x.end()}; }

// Whether flat index i lies in a slot (not in a gap).
std::vector<bool> in_slot_mask(const ParamLayout& layout) {
  std::vector<bool> in(static_cast<std::size_t>(layout.total), false);
  for (const auto& s : layout.slots)
    for (Idx i = s.offset; i < s.offset + s.size; ++i) in[static_cast<std::size_t>(i)] = true;
  return in;
}

// ---- the schedule ---------------------------------------------------------------------------

OptimConfig schedule_config() {
  OptimConfig o;
  o.lr = 1e-3;
  o.warmup = 10;
  o.steps = 110;
  o.min_lr_ratio = 0.1;
  return o;
}

TEST(Schedule, WarmupRampsLinearlyFromLrOverWarmupToThePeak) {
  const OptimConfig o = schedule_config();
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 1), 1e-4);
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 5), 5e-4);
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 9), 9e-4);
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 10), 1e-3);  // the peak, at t = warmup
  for (Idx t = 1; t < o.warmup; ++t)
    EXPECT_LT(m3::learning_rate(o, t), m3::learning_rate(o, t + 1)) << "t=" << t;
}

TEST(Schedule, CosineMidpointIsTheMeanOfPeakAndFloor) {
  const OptimConfig o = schedule_config();
  // u = (t − warmup)/(steps − warmup) = 1/2 at t = 60.
  EXPECT_NEAR(m3::learning_rate(o, 60), 0.5 * (1e-3 + 1e-4), 1e-18);
  // A quarter of the way: floor + (lr − floor)·½(1 + cos(π/4)).
  const double pi = std::acos(-1.0);
  EXPECT_NEAR(m3::learning_rate(o, 35), 1e-4 + 9e-4 * 0.5 * (1 + std::cos(pi / 4)), 1e-18);
}

TEST(Schedule, ReachesTheFloorAtTheLastStepAndStaysThere) {
  const OptimConfig o = schedule_config();
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 110), 1e-4);
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 111), 1e-4);
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 100000), 1e-4);
  for (Idx t = o.warmup; t < o.steps; ++t)
    EXPECT_GT(m3::learning_rate(o, t), m3::learning_rate(o, t + 1)) << "t=" << t;
}

TEST(Schedule, WithoutWarmupTheCosineStartsFromThePeakAtStepZero) {
  OptimConfig o = schedule_config();
  o.warmup = 0;
  o.steps = 100;
  const double pi = std::acos(-1.0);
  EXPECT_NEAR(m3::learning_rate(o, 1), 1e-4 + 9e-4 * 0.5 * (1 + std::cos(pi / 100)), 1e-18);
  EXPECT_LT(m3::learning_rate(o, 1), o.lr);
  EXPECT_NEAR(m3::learning_rate(o, 50), 0.5 * (1e-3 + 1e-4), 1e-18);
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 100), 1e-4);
}

TEST(Schedule, WarmupOverEveryStepEndsAtThePeakThenTheFloor) {
  OptimConfig o = schedule_config();
  o.warmup = o.steps = 4;
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 4), 1e-3);
  EXPECT_DOUBLE_EQ(m3::learning_rate(o, 5), 1e-4);
}

// warmup < steps: t = warmup is still the ramp, lr·t/warmup = lr exactly (t/warmup = 1), and
// the cosine starts at t = warmup + 1. (The cosine at u = 0 gives floor + (lr − floor), which
// rounds above lr = 1e-2: taking t = warmup into the cosine shows.)
TEST(Schedule, TheWarmupsLastStepIsThePeakAndTheCosineStartsAfterIt) {
  OptimConfig o = schedule_config();
  o.lr = 1e-2;
  o.warmup = 4;
  o.steps = 10;
  const double floor = o.lr * o.min_lr_ratio;
  EXPECT_EQ(m3::learning_rate(o, 4), o.lr);
  EXPECT_EQ(m3::learning_rate(o, 3), o.lr * 3 / 4);
  const double pi = std::acos(-1.0);
  EXPECT_NEAR(m3::learning_rate(o, 5), floor + (o.lr - floor) * 0.5 * (1 + std::cos(pi / 6)),
              1e-17);
  EXPECT_LT(m3::learning_rate(o, 5), o.lr);
  EXPECT_EQ(m3::learning_rate(o, 10), floor);
}

TEST(Schedule, IsAPureFunctionOfTheStepAndRejectsStepZero) {
  const OptimConfig o = schedule_config();
  const double a = m3::learning_rate(o, 77);
  for (Idx t = 1; t <= 110; ++t) (void)m3::learning_rate(o, t);
  EXPECT_EQ(m3::learning_rate(o, 77), a);
  EXPECT_THROW(m3::learning_rate(o, 0), m3::Error);
}

// ---- the configuration ------------------------------------------------------------------------

TEST(OptimConfig, DefaultsAreValid) { EXPECT_NO_THROW(OptimConfig().validate()); }

TEST(OptimConfig, ValidateNamesTheBrokenField) {
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::vector<std::pair<std::string, std::function<void(OptimConfig&)>>> cases = {
      {"lr", [](OptimConfig& o) { o.lr = 0; }},
      {"lr", [&](OptimConfig& o) { o.lr = inf; }},
      {"beta1", [](OptimConfig& o) { o.beta1 = 1.0; }},
      {"beta1", [&](OptimConfig& o) { o.beta1 = nan; }},
      {"beta2", [](OptimConfig& o) { o.beta2 = -0.1; }},
      {"eps", [](OptimConfig& o) { o.eps = 0; }},
      {"wd", [](OptimConfig& o) { o.wd = -1e-3; }},
      {"clip", [](OptimConfig& o) { o.clip = -1; }},
      {"steps", [](OptimConfig& o) { o.steps = 0; }},
      {"warmup", [](OptimConfig& o) { o.warmup = -1; }},
      {"warmup", [](OptimConfig& o) { o.warmup = o.steps + 1; }},
      {"min_lr_ratio", [](OptimConfig& o) { o.min_lr_ratio = 1.5; }},
  };
  for (const auto& [field, mutate] : cases) {
    OptimConfig o;
    mutate(o);
    try {
      o.validate();
      ADD_FAILURE() << "validate() accepted a bad " << field;
    } catch (const m3::Error& e) {
      EXPECT_EQ(e.where(), "OptimConfig");
      EXPECT_EQ(e.failed().rfind(field + " must", 0), 0u) << e.what();
      EXPECT_NE(e.why().find(field + "="), std::string::npos) << e.what();
    }
  }
}

TEST(OptimConfig, AdamWScalarsCarryTheRateTheGradientFactorAndTheBiasCorrections) {
  OptimConfig o = schedule_config();
  const AdamWScalars a = m3::adamw_scalars(o, 3, 0.25, 8.0);
  EXPECT_DOUBLE_EQ(a.lr, m3::learning_rate(o, 3));
  EXPECT_DOUBLE_EQ(a.gscale, 0.25 / 8.0);
  EXPECT_DOUBLE_EQ(a.bc1, 1 - 0.9 * 0.9 * 0.9);
  EXPECT_DOUBLE_EQ(a.bc2, 1 - 0.95 * 0.95 * 0.95);
  EXPECT_EQ(a.beta1, o.beta1);
  EXPECT_EQ(a.beta2, o.beta2);
  EXPECT_EQ(a.eps, o.eps);
  EXPECT_EQ(a.wd, o.wd);
  EXPECT_THROW(m3::adamw_scalars(o, 0, 1.0, 1.0), m3::Error);
  EXPECT_THROW(m3::adamw_scalars(o, 1, std::nan(""), 1.0), m3::Error);
  EXPECT_THROW(m3::adamw_scalars(o, 1, 1.0, 0.0), m3::Error);
}

// ---- the clip ----------------------------------------------------------------------------------

TEST(OptimClip, CoefficientIsOneWhenOffOrUnderTheLimit) {
  EXPECT_EQ(m3::clip_coefficient(1e9, 0.0), 1.0);
  EXPECT_EQ(m3::clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_EQ(m3::clip_coefficient(0.0, 1.0), 1.0);
}

TEST(OptimClip, CoefficientScalesTheNormDownToTheClip) {
  EXPECT_DOUBLE_EQ(m3::clip_coefficient(10.0, 1.0), 1.0 / (10.0 + 1e-6));
  EXPECT_DOUBLE_EQ(m3::clip_coefficient(4.0, 2.0), 2.0 / (4.0 + 1e-6));
  EXPECT_EQ(m3::clip_coefficient(std::numeric_limits<double>::infinity(), 1.0), 0.0);
  EXPECT_TRUE(std::isnan(m3::clip_coefficient(std::nan(""), 1.0)));
  EXPECT_THROW(m3::clip_coefficient(1.0, -1.0), m3::Error);
}

// ---- the gradient norm -------------------------------------------------------------------------

TEST(GradNorm, MatchesADirectDoubleSumOverSeveralBlocks) {
  const Idx n = 3 * m3::kNormBlock + 123;
  const std::vector<float> g = random_floats(n, 11, -2.0f, 2.0f);
  double direct = 0;
  for (float x : g) direct += static_cast<double>(x) * static_cast<double>(x);
  direct = std::sqrt(direct);
  EXPECT_NEAR(m3::grad_norm(g.data(), n), direct, 1e-14 * direct);
  const std::vector<double> gd = widen(g);
  EXPECT_NEAR(m3::grad_norm(gd.data(), n), direct, 1e-14 * direct);
}

TEST(GradNorm, SumsBlocksInIndexOrderThenThePartialsInBlockOrder) {
  const Idx n = 2 * m3::kNormBlock + 7;
  const std::vector<float> g = random_floats(n, 12, -1e3f, 1e3f);
  double total = 0;
  for (Idx b = 0; b < n; b += m3::kNormBlock) {
    double partial = 0;
    for (Idx i = b; i < std::min(n, b + m3::kNormBlock); ++i) {
      const double x = g[static_cast<std::size_t>(i)];
      partial += x * x;
    }
    total += partial;
  }
  const double expect = std::sqrt(total), got = m3::grad_norm(g.data(), n);
  EXPECT_EQ(std::memcmp(&expect, &got, sizeof(double)), 0) << got << " vs " << expect;
}

TEST(GradNorm, DependsOnNothingButTheData) {
  const Idx n = 5 * m3::kNormBlock + 1;
  const std::vector<float> g = random_floats(n, 13, -1.0f, 1.0f);
  const std::vector<float> copy = g;
  const double a = m3::grad_norm(g.data(), n);
  const double b = m3::grad_norm(g.data(), n);
  const double c = m3::grad_norm(copy.data(), n);
  EXPECT_EQ(std::memcmp(&a, &b, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(&a, &c, sizeof(double)), 0);
  EXPECT_EQ(m3::grad_norm(g.data(), 0), 0.0);
}

TEST(GradNorm, ANonFiniteElementGivesANonFiniteNorm) {
  const Idx n = 2 * m3::kNormBlock;
  std::vector<float> g = random_floats(n, 14, -1.0f, 1.0f);
  g[5000] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_FALSE(std::isfinite(m3::grad_norm(g.data(), n)));
  g[5000] = std::numeric_limits<float>::infinity();
  EXPECT_FALSE(std::isfinite(m3::grad_norm(g.data(), n)));
  g[5000] = 3.0e38f;  // finite: its square overflows float but not the double accumulator
  EXPECT_TRUE(std::isfinite(m3::grad_norm(g.data(), n)));
}

// ---- AdamW -------------------------------------------------------------------------------------

TEST(AdamW, DecaysOnlyTheNamedMatrices) {
  const m3::Config cfg = small_token_config();
  const ParamLayout layout = m3::param_layout(cfg);
  const std::vector<std::uint8_t> flags = m3::decay_flags(layout);
  ASSERT_EQ(flags.size(), layout.slots.size());
  int decayed = 0;
  bool saw_head = false;
  for (std::size_t s = 0; s < flags.size(); ++s) {
    const std::string name = layout.slots[s].spec->name;
    const bool expect = name == "in_proj_w" || name == "out_proj_w" || name == "head_w";
    EXPECT_EQ(flags[s], expect ? 1 : 0) << layout.slots[s].name;
    decayed += flags[s];
    saw_head = saw_head || name == "head_w";
  }
  EXPECT_TRUE(saw_head);
  EXPECT_EQ(decayed, 2 * cfg.n_layers + 1);
  EXPECT_EQ(flags[layout.slots.size() - 1], 1);  // head_w is the last slot
  EXPECT_TRUE(m3::param_decays("L1/out_proj_w"));
  EXPECT_FALSE(m3::param_decays("input_proj_w"));  // the embedding
  for (const char* n : {"input_proj_b", "norm_weight", "dt_bias", "b_norm_weight", "c_norm_weight",
                        "b_bias", "c_bias", "d_param", "norm_gate_weight", "norm_f_weight"})
    EXPECT_FALSE(m3::param_decays(n)) << n;
}

// PyTorch's torch.optim.AdamW (decoupled decay first, then the Adam update with the bias
// corrections folded into the step size and the denominator), written out in double.
void pytorch_adamw(const ParamLayout& layout, const std::vector<std::uint8_t>& decay,
                   const OptimConfig& o, Idx t, double gscale, std::vector<double>& p,
                   std::vector<double>& m, std::vector<double>& v, const std::vector<double>& g) {
  const double lr = m3::learning_rate(o, t);
  const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
  for (std::size_t s = 0; s < layout.slots.size(); ++s)
    for (Idx i = layout.slots[s].offset; i < layout.slots[s].offset + layout.slots[s].size; ++i) {
      const auto k = static_cast<std::size_t>(i);
      const double grad = g[k] * gscale;
      if (decay[s]) p[k] *= 1 - lr * o.wd;
      m[k] = o.beta1 * m[k] + (1 - o.beta1) * grad;
      v[k] = o.beta2 * v[k] + (1 - o.beta2) * grad * grad;
      const double denom = std::sqrt(v[k]) / std::sqrt(bc2) + o.eps;
      p[k] -= lr / bc1 * m[k] / denom;
    }
}

TEST(AdamW, MatchesAPyTorchStyleAdamWOnDecayedAndUndecayedSlots) {
  const ParamLayout layout = m3::param_layout(small_token_config());
  const std::vector<std::uint8_t> decay = m3::decay_flags(layout);
  OptimConfig o;
  o.lr = 1e-2;
  o.warmup = 2;
  o.steps = 10;
  o.wd = 0.3;  // large enough that the decay term is far above the comparison's tolerance
  const double clip_coef = 0.7, loss_scale = 8.0;
  const Idx n = layout.total;
  const std::vector<bool> in = in_slot_mask(layout);
  std::vector<double> p = widen(random_floats(n, 21, -1.0f, 1.0f)), m(n, 0.0), v(n, 0.0);
  std::vector<double> pp = p, pm = m, pv = v;
  // The same steps with no decay anywhere: the decayed slot must end elsewhere, the other not.
  const std::vector<std::uint8_t> none(decay.size(), 0);
  std::vector<double> zp = p, zm = m, zv = v;
  const m3::ParamSlot& dec = layout.at(0, "in_proj_w");
  const m3::ParamSlot& undec = layout.at(1, "dt_bias");
  ASSERT_EQ(decay[static_cast<std::size_t>(&dec - layout.slots.data())], 1);
  ASSERT_EQ(decay[static_cast<std::size_t>(&undec - layout.slots.data())], 0);
  for (Idx t = 1; t <= 3; ++t) {
    const std::vector<double> g =
        widen(random_floats(n, 30 + static_cast<std::uint32_t>(t), -4.0f, 4.0f));
    m3::adamw_step(layout, decay, m3::adamw_scalars(o, t, clip_coef, loss_scale), p.data(),
                   m.data(), v.data(), g.data());
    pytorch_adamw(layout, decay, o, t, clip_coef / loss_scale, pp, pm, pv, g);
    pytorch_adamw(layout, none, o, t, clip_coef / loss_scale, zp, zm, zv, g);
    if (t == 2) continue;
    for (Idx i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (!in[k]) continue;
      EXPECT_NEAR(p[k], pp[k], 1e-14 * (1 + std::abs(pp[k]))) << "t=" << t << " i=" << i;
      EXPECT_NEAR(m[k], pm[k], 1e-15 * (1 + std::abs(pm[k]))) << "t=" << t << " i=" << i;
      EXPECT_NEAR(v[k], pv[k], 1e-15 * (1 + std::abs(pv[k]))) << "t=" << t << " i=" << i;
    }
    for (Idx i = dec.offset; i < dec.offset + dec.size; ++i)
      EXPECT_GT(std::abs(p[i] - zp[i]), 1e-6) << "in_proj_w without its decay, t=" << t;
    for (Idx i = undec.offset; i < undec.offset + undec.size; ++i)
      EXPECT_NEAR(p[i], zp[i], 1e-14) << "dt_bias is not decayed, t=" << t;
  }
}

TEST(AdamW, LeavesTheGapsBetweenSlotsUntouched) {
  const ParamLayout layout = m3::param_layout(small_token_config());
  const std::vector<std::uint8_t> decay = m3::decay_flags(layout);
  const Idx n = layout.total;
  const std::vector<bool> in = in_slot_mask(layout);
  Idx gaps = 0;
  for (bool b : in) gaps += b ? 0 : 1;
  ASSERT_GT(gaps, 0) << "the layout has no gaps to test";
  std::vector<float> p = random_floats(n, 41, -1.0f, 1.0f), m = random_floats(n, 42, -0.1f, 0.1f);
  std::vector<float> v = random_floats(n, 43, 0.0f, 0.01f), g = random_floats(n, 44, -1.0f, 1.0f);
  for (Idx i = 0; i < n; ++i)
    if (!in[static_cast<std::size_t>(i)]) {
      p[i] = 3.25f;
      m[i] = -1.5f;
      v[i] = 0.75f;
      g[i] = 100.0f;  // a gradient in a gap must be ignored too
    }
  const std::vector<float> p0 = p;
  m3::adamw_step(layout, decay, m3::adamw_scalars(OptimConfig(), 1, 1.0, 1.0), p.data(), m.data(),
                 v.data(), g.data());
  Idx moved = 0;
  for (Idx i = 0; i < n; ++i) {
    const auto k = static_cast<std::size_t>(i);
    if (in[k]) {
      moved += p[k] != p0[k] ? 1 : 0;
    } else {
      EXPECT_EQ(p[k], 3.25f) << "gap element " << i;
      EXPECT_EQ(m[k], -1.5f) << "gap element " << i;
      EXPECT_EQ(v[k], 0.75f) << "gap element " << i;
    }
  }
  EXPECT_EQ(moved, n - gaps);
}

// The float step against the double step from the same (float) state, per element, within
// k float epsilons of the magnitudes that enter each result (so a cancellation in m or p is
// measured against the terms, not the small difference).
void expect_float_near_double(Idx t, std::uint32_t seed, bool zero_moments) {
  const ParamLayout layout = m3::param_layout(small_token_config());
  const std::vector<std::uint8_t> decay = m3::decay_flags(layout);
  OptimConfig o;
  o.lr = 1e-2;
  o.wd = 0.1;
  const AdamWScalars a = m3::adamw_scalars(o, t, 0.6, 4.0);
  const Idx n = layout.total;
  std::vector<float> pf = random_floats(n, seed, -1.0f, 1.0f);
  std::vector<float> mf = random_floats(n, seed + 1, -0.05f, 0.05f);
  std::vector<float> vf = random_floats(n, seed + 2, 0.0f, 1e-3f);
  const std::vector<float> gf = random_floats(n, seed + 3, -0.5f, 0.5f);
  if (zero_moments) {
    std::fill(mf.begin(), mf.end(), 0.0f);
    std::fill(vf.begin(), vf.end(), 0.0f);
  }
  std::vector<double> pd = widen(pf), md = widen(mf), vd = widen(vf);
  const std::vector<double> gd = widen(gf), p0 = pd, m0 = md, v0 = vd;
  m3::adamw_step(layout, decay, a, pf.data(), mf.data(), vf.data(), gf.data());
  m3::adamw_step(layout, decay, a, pd.data(), md.data(), vd.data(), gd.data());
  const double k = 6 * FLT_EPSILON;
  for (std::size_t s = 0; s < layout.slots.size(); ++s)
    for (Idx i = layout.slots[s].offset; i < layout.slots[s].offset + layout.slots[s].size; ++i) {
      const auto e = static_cast<std::size_t>(i);
      const double g = gd[e] * a.gscale;
      const double m_mag = std::abs(a.beta1 * m0[e]) + std::abs((1 - a.beta1) * g);
      const double v_mag = a.beta2 * v0[e] + (1 - a.beta2) * g * g;
      const double upd_mag = m_mag / a.bc1 / (std::sqrt(vd[e] / a.bc2) + a.eps) +
                             (decay[s] ? a.wd : 0.0) * std::abs(p0[e]);
      const double p_mag = std::abs(p0[e]) + a.lr * upd_mag;
      EXPECT_NEAR(mf[e], md[e], k * m_mag) << "m at " << i;
      EXPECT_NEAR(vf[e], vd[e], k * v_mag) << "v at " << i;
      EXPECT_NEAR(pf[e], pd[e], k * p_mag) << "p at " << i;
    }
}

TEST(AdamW, FloatStepStaysWithinAFewUlpsOfTheDoubleStep) {
  expect_float_near_double(1, 51, true);
  expect_float_near_double(3, 61, false);
  expect_float_near_double(500, 71, false);
}

TEST(AdamW, RejectsAMismatchedDecayTable) {
  const ParamLayout layout = m3::param_layout(small_token_config());
  std::vector<std::uint8_t> decay = m3::decay_flags(layout);
  decay.pop_back();
  std::vector<float> x(static_cast<std::size_t>(layout.total), 0.0f);
  EXPECT_THROW(m3::adamw_step(layout, decay, m3::adamw_scalars(OptimConfig(), 1, 1.0, 1.0),
                              x.data(), x.data(), x.data(), x.data()),
               m3::Error);
}

// ---- loss scaling ------------------------------------------------------------------------------

TEST(LossScaler, F16StartsDynamicAt2To16) {
  const LossScaler s = LossScaler::for_precision(Precision::F16);
  EXPECT_TRUE(s.dynamic);
  EXPECT_EQ(s.scale, 65536.0);
  EXPECT_EQ(s.good_steps, 0);
  EXPECT_EQ(s.skipped, 0);
}

TEST(LossScaler, F16HalvesTheScaleAndSkipsOnANonFiniteGradient) {
  LossScaler s = LossScaler::for_precision(Precision::F16);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.good_steps, 10);
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale, 32768.0);
  EXPECT_EQ(s.skipped, 1);
  EXPECT_EQ(s.good_steps, 0);
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale, 16384.0);
  EXPECT_EQ(s.skipped, 2);
}

TEST(LossScaler, F16DoublesTheScaleAfter2000FiniteStepsInARow) {
  LossScaler s = LossScaler::for_precision(Precision::F16);
  for (Idx i = 0; i < LossScaler::kGrowthInterval - 1; ++i) ASSERT_TRUE(s.update(true));
  EXPECT_EQ(s.scale, 65536.0);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale, 131072.0);
  EXPECT_EQ(s.good_steps, 0);
  // A skip restarts the count: 1999 good steps after it do not double the scale, the 2000th does.
  for (Idx i = 0; i < 1000; ++i) ASSERT_TRUE(s.update(true));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.scale, 65536.0);
  for (Idx i = 0; i < LossScaler::kGrowthInterval - 1; ++i) ASSERT_TRUE(s.update(true));
  EXPECT_EQ(s.scale, 65536.0);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.scale, 131072.0);
  EXPECT_EQ(s.skipped, 1);
}

TEST(LossScaler, Bf16AndF32UseScaleOneAndNeverSkip) {
  for (Precision p : {Precision::BF16, Precision::F32, Precision::F64}) {
    LossScaler s = LossScaler::for_precision(p);
    EXPECT_FALSE(s.dynamic) << m3::precision_name(p);
    EXPECT_EQ(s.scale, 1.0);
    EXPECT_TRUE(s.update(false)) << m3::precision_name(p);
    for (Idx i = 0; i < LossScaler::kGrowthInterval + 5; ++i) EXPECT_TRUE(s.update(true));
    EXPECT_EQ(s.scale, 1.0);
    EXPECT_EQ(s.skipped, 0);
  }
}

}  // namespace
