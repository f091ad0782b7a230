// The whole backbone backward (MODEL.md §6, §12.4) against finite differences, in double, for
// both scan modes.
//
// Scalar loss of one window:
//   L = Σ dOut ⊙ Out + Σ_{s ∈ ssm, k, v, angle} W_s ⊙ leaving_s
// with dOut from the Problem and W_s seeded weights. backward(dOut, d_leaving = W) must return
// ∂L/∂θ for every parameter θ (accumulated from zero), ∂L/∂X (d_x) and ∂L/∂entering_s.
// Checked elements:
//   * every element of parameters with ≤ 64 elements; one seeded row per column of in_proj_w
//     (so every column slice z, x, B, C, dd_dt, dd_A, trap, angles is hit); a seeded subset of
//     30 elements of any other larger parameter;
//   * a seeded subset (≤ 40) of X and of each entering state.
// Pass rule per tensor: max|analytic − fd| ≤ kAtol + kRtol·max|fd|.
//
// Step and stencil (calibrated, see fd.hpp central_diff5): the five-point stencil with
// h = 1e-5·max(1, |θ|). The two-point formula fails both ways here: at h = 1e-6 its round-off
// (ε·|L|/h with |L| ≈ 50 summed terms) reaches 3e-8 on O(0.1) gradients, and at h = 1e-5 its
// O(h²·f‴) truncation reaches 1e-6 relative, because some directions have length scales of
// ~3e-3 (per-row RMSNorms of nearly-zero rows, the gated norm over a head of 2 channels).
// With the five-point stencil the measured error is ≤ 4e-9 absolute and ≤ 8e-8 relative on
// every tensor of every case (worst budget use ~16%), i.e. pure FD noise.
//
// Angle wrap: the leaving angle state is wrapped to [0, 2π) (MODEL.md §4 F5), so L jumps by
// 2π·W_angle where an FD step moves θ_{T−1} across 0/2π; backward treats the wrap as the
// identity (§6.0), which is the correct derivative everywhere except on that measure-zero set.
// |W_angle| ∈ [0.5, 1] makes every such jump ≥ π, far above any genuine spread of the four
// stencil values (≈ 4h·|∂L/∂θ| ≲ 1e-2 here); a sample whose values spread by more than 1 is
// therefore skipped and counted. The count must stay ≤ kMaxWrapSkips per case (measured 0;
// a straddle has probability ~1e-4 per sample at this step).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "backbone.hpp"
#include "fd.hpp"
#include "problem.hpp"
#include "registry.hpp"
#include "test_compare.hpp"
#include "test_util.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::ScanMode;
using m3::test::small_cfg;

constexpr double kRtol = 1e-7;
constexpr double kAtol = 1e-8;
constexpr double kFdStep = 1e-5;
constexpr int kMaxWrapSkips = 2;
constexpr size_t kAllBelow = 64;     // parameters this small are checked element by element
constexpr size_t kSubset = 30;       // seeded subset size for larger parameters
constexpr size_t kInputSubset = 40;  // seeded subset size for X and the entering states

struct FdCase {
  std::string name;
  Config cfg;
  Idx B, T;
  bool random_states;
  bool big_dt;  // dt_bias spread over [−1, 1] (dt ≈ 0.3 … 1.3): strong decay, rotation, β/γ
};

struct FdParam {
  FdCase c;
  ScanMode mode;
};

std::vector<FdCase> fd_cases() {
  std::vector<FdCase> v;
  auto add = [&](std::string name, Config cfg, Idx B, Idx T, bool rs, bool big_dt) {
    v.push_back({std::move(name), cfg, B, T, rs, big_dt});
  };
  //                          d_model hd ds ng  rf  outnorm L  cs identity in
  add("T1_cs1", small_cfg(4, 2, 4, 1, 0.5, false, 1, 1, false, 3), 2, 1, true, true);
  add("T1_cs4", small_cfg(4, 2, 4, 1, 0.5, false, 1, 4, false, 3), 2, 1, true, false);
  add("T2_cs1", small_cfg(4, 2, 4, 1, 0.5, false, 1, 1, false, 3), 2, 2, true, true);
  add("T2_cs3", small_cfg(4, 2, 4, 1, 0.5, false, 1, 3, false, 3), 2, 2, true, false);
  add("T7_cs3", small_cfg(4, 2, 4, 1, 0.5, false, 1, 3, false, 3), 2, 7, true, true);
  add("T8_cs4", small_cfg(4, 2, 4, 1, 0.5, false, 1, 4, false, 3), 2, 8, true, false);
  add("T10_cs8", small_cfg(4, 2, 4, 1, 0.5, false, 1, 8, false, 3), 1, 10, true, true);
  add("T9_cs1", small_cfg(4, 2, 4, 1, 0.5, false, 1, 1, false, 3), 1, 9, true, true);
  add("fresh_states_T7_cs3", small_cfg(4, 2, 4, 1, 0.5, false, 1, 3, false, 3), 2, 7, false,
      true);
  add("ng2_T7_cs3", small_cfg(4, 2, 4, 2, 0.5, false, 1, 3, false, 3), 2, 7, true, true);
  add("rope1_T6_cs4", small_cfg(4, 2, 4, 1, 1.0, false, 1, 4, false, 3), 2, 6, true, true);
  add("rope1_ds5_T6_cs4", small_cfg(4, 2, 5, 1, 1.0, false, 1, 4, false, 3), 2, 6, true, true);
  add("rope05_ds6_T6_cs4", small_cfg(4, 2, 6, 1, 0.5, false, 1, 4, false, 3), 2, 6, true, true);
  add("na0_T7_cs3", small_cfg(4, 2, 3, 1, 0.5, false, 1, 3, false, 3), 2, 7, true, true);
  add("outnorm_hd4_T7_cs3", small_cfg(4, 4, 4, 1, 0.5, true, 1, 3, false, 3), 2, 7, true, true);
  add("outnorm_hd2_T5_cs2", small_cfg(4, 2, 4, 1, 0.5, true, 1, 2, false, 3), 2, 5, true, false);
  add("layers2_T6_cs4", small_cfg(4, 2, 4, 1, 0.5, false, 2, 4, false, 3), 2, 6, true, true);
  add("identity_T7_cs3", small_cfg(4, 2, 4, 1, 0.5, false, 1, 3, true), 2, 7, true, true);
  {
    Config c = small_cfg(4, 2, 4, 1, 0.5, false, 1, 3, false, 3);
    c.a_floor = 0.8;  // the A clamp is active for dd_A < −0.25: both clamp branches occur
    add("aclamp_T7_cs3", c, 2, 7, true, true);
  }
  add("all_L2_ng2_rope1_outnorm_T9_cs4", small_cfg(8, 2, 6, 2, 1.0, true, 2, 4, false, 5), 2, 9,
      true, true);
  add("ds8_hd4_ng2_T5_cs2", small_cfg(8, 4, 8, 2, 0.5, false, 1, 2, false, 4), 1, 5, true, true);
  return v;
}

std::vector<FdParam> fd_params() {
  std::vector<FdParam> out;
  for (const auto& c : fd_cases())
    for (auto m : {ScanMode::Sequential, ScanMode::Chunked}) out.push_back({c, m});
  return out;
}

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

m3::Problem build_problem(const FdCase& c) {
  m3::Problem pb = m3::make_problem(c.cfg, c.B, c.T, 20240601 + fnv1a(c.name) % 1000,
                                    c.random_states);
  if (c.big_dt)
    for (auto& L : pb.params.layers) {
      const double nh = static_cast<double>(L.dt_bias.size());
      for (size_t h = 0; h < L.dt_bias.size(); ++h)
        L.dt_bias[h] = -1.0 + 2.0 * (static_cast<double>(h) + 0.5) / nh;
    }
  return pb;
}

// Leaving-state weights W: seeded, |W| ∈ [0.5, 1] for the angle (see the file comment).
m3::States<double> leaving_weights(const m3::Problem& pb) {
  m3::States<double> w = m3::test::random_like_states(pb.cfg, pb.B, 99 + pb.seed);
  for (auto& a : w.angle) a = (a < 0 ? -0.5 : 0.5) + 0.5 * a;
  return w;
}

struct TensorReport {
  std::string key;
  size_t checked = 0;
  double max_err = 0, scale = 0;
  size_t worst_index = 0;
  double worst_analytic = 0, worst_fd = 0;
  bool pass() const { return max_err <= kAtol + kRtol * scale; }
  double rel() const { return max_err / std::max(scale, 1e-300); }
};

class BackboneFd : public ::testing::TestWithParam<FdParam> {};

TEST_P(BackboneFd, GradientsMatchCentralDifferences) {
  const FdCase& c = GetParam().c;
  const ScanMode mode = GetParam().mode;
  const Config& cfg = c.cfg;
  const m3::Problem pb = build_problem(c);
  const m3::States<double> w = leaving_weights(pb);

  // Analytic gradients.
  const auto an = m3::test::run_backbone<double>(pb, mode, &w);

  // Loss as a function of the (mutable) copies P, X, S0.
  m3::Params<double> P = pb.params;
  std::vector<double> X = pb.x;
  m3::States<double> S0 = pb.states;
  auto loss = [&]() {
    m3::Backbone<double> bb(cfg, pb.B, pb.T, mode);
    m3::States<double> st = S0;
    const std::vector<double>& out = bb.forward(P, X, st);
    return m3::test::dot(pb.d_out, out) + m3::test::dot(w.ssm, st.ssm) +
           m3::test::dot(w.k, st.k) + m3::test::dot(w.v, st.v) +
           m3::test::dot(w.angle, st.angle);
  };
  const double L0 = loss();
  ASSERT_TRUE(std::isfinite(L0));

  int wrap_skips = 0;
  std::vector<TensorReport> reports;
  auto check = [&](const std::string& key, std::vector<double>& var,
                   const std::vector<double>& grad, const std::vector<size_t>& idx) {
    ASSERT_EQ(var.size(), grad.size()) << key << ": gradient has the wrong size";
    TensorReport r;
    r.key = key;
    for (size_t i : idx) {
      const m3::test::Fd5Sample s =
          m3::test::central_diff5(var[i], loss, kFdStep * std::max(1.0, std::abs(var[i])));
      if (s.spread > 1.0) {  // straddled the angle wrap
        ++wrap_skips;
        continue;
      }
      const double e = std::abs(grad[i] - s.deriv);
      ASSERT_TRUE(std::isfinite(grad[i])) << key << "[" << i << "] is not finite";
      if (r.checked == 0 || e > r.max_err) {
        r.max_err = e;
        r.worst_index = i;
        r.worst_analytic = grad[i];
        r.worst_fd = s.deriv;
      }
      r.scale = std::max(r.scale, std::abs(s.deriv));
      ++r.checked;
    }
    reports.push_back(r);
  };

  // Parameters.
  m3::Params<double> G = an.grads;
  const auto prefs = m3::test::param_refs(P);
  const auto grefs = m3::test::param_refs(G);
  ASSERT_EQ(prefs.size(), grefs.size());
  for (size_t k = 0; k < prefs.size(); ++k) {
    const std::string& key = prefs[k].key;
    std::vector<double>& v = *prefs[k].v;
    std::vector<size_t> idx;
    const bool is_in_proj = key.size() >= 9 && key.compare(key.size() - 9, 9, "in_proj_w") == 0 &&
                            key.find("input_proj") == std::string::npos;
    if (v.size() <= kAllBelow) {
      idx = m3::test::sample_indices(v.size(), v.size(), 0);
    } else if (is_in_proj) {
      const Idx ip = cfg.in_proj_dim(), dm = cfg.d_model;
      m3::Rng rng(fnv1a(key) ^ pb.seed);
      for (Idx j = 0; j < ip; ++j)
        idx.push_back(static_cast<size_t>(static_cast<Idx>(rng.next() % dm) * ip + j));
    } else {
      idx = m3::test::sample_indices(v.size(), kSubset, fnv1a(key) ^ pb.seed);
    }
    check(key, v, *grefs[k].v, idx);
  }
  // Input X.
  check("d_x", X, an.d_x, m3::test::sample_indices(X.size(), kInputSubset, 11 + pb.seed));
  // Entering states.
  {
    auto srefs = m3::test::state_refs(S0);
    m3::States<double> dE = an.d_entering;
    auto drefs = m3::test::state_refs(dE);
    for (size_t k = 0; k < srefs.size(); ++k)
      check(std::string("d_entering/") + srefs[k].key, *srefs[k].v, *drefs[k].v,
            m3::test::sample_indices(srefs[k].v->size(), kInputSubset, 17 + k + pb.seed));
  }
  // Nothing was left modified by the FD loop.
  EXPECT_EQ(loss(), L0);

  // Report and assert.
  const TensorReport* worst = nullptr;
  double worst_budget = 0;
  for (const auto& r : reports) {
    const double budget = r.max_err / (kAtol + kRtol * r.scale);
    if (!worst || budget > worst_budget) {
      worst = &r;
      worst_budget = budget;
    }
    EXPECT_TRUE(r.pass()) << c.name << " " << m3::scan_mode_name(mode) << " " << r.key
                          << ": max |analytic − fd| = " << r.max_err << " at [" << r.worst_index
                          << "] (analytic " << r.worst_analytic << ", fd " << r.worst_fd
                          << "), max |fd| = " << r.scale << ", " << r.checked << " checked\n  "
                          << cfg.describe();
    EXPECT_TRUE(r.checked > 0 || r.key.find("angle") != std::string::npos)
        << r.key << ": no element checked";
  }
  EXPECT_LE(wrap_skips, kMaxWrapSkips) << "too many FD samples straddled the angle wrap";
  ASSERT_NE(worst, nullptr);
  double worst_rel = 0;
  std::string worst_rel_key;
  for (const auto& r : reports)
    if (r.scale > 1e-6 && r.rel() > worst_rel) {
      worst_rel = r.rel();
      worst_rel_key = r.key;
    }
  std::printf("[fd] %-34s %-7s worst budget %5.1f%% (%s: err %.2e, scale %.2e); "
              "worst rel %.2e (%s); wrap skips %d\n",
              c.name.c_str(), m3::scan_mode_name(mode), 100 * worst_budget, worst->key.c_str(),
              worst->max_err, worst->scale, worst_rel, worst_rel_key.c_str(), wrap_skips);
}

// ---- the FD helpers themselves (fd.hpp) -----------------------------------------------------

TEST(FdHelpers, FivePointStencilIsExactForQuartics) {
  double x = 0.7;
  auto f = [&]() { return 3 * x * x * x * x - 2 * x * x * x + x - 5; };
  const auto s = m3::test::central_diff5(x, f, 1e-2);
  EXPECT_NEAR(s.deriv, 12 * 0.343 - 6 * 0.49 + 1, 1e-11);
  EXPECT_EQ(x, 0.7);  // restored
}

TEST(FdHelpers, SpreadFlagsAJumpInsideTheStencil) {
  double x = 1.0;
  auto step = [&]() { return x + (x > 1.0 + 1e-6 ? 2 * m3::test::kTestPi : 0.0); };
  EXPECT_GT(m3::test::central_diff5(x, step, 1e-5).spread, 1.0);
  auto smooth = [&]() { return std::sin(x); };
  EXPECT_LT(m3::test::central_diff5(x, smooth, 1e-5).spread, 1e-4);
}

TEST(FdHelpers, MetricsAndCircularDistance) {
  const std::vector<double> a = {1.0, 2.0, -4.0}, b = {1.0, 2.5, -4.0};
  EXPECT_DOUBLE_EQ(m3::test::max_abs_err(a, b), 0.5);
  EXPECT_DOUBLE_EQ(m3::test::max_rel_err(a, b), 0.5 / 4.0);
  EXPECT_DOUBLE_EQ(m3::test::rel_l2(a, b), 0.5 / std::sqrt(1 + 6.25 + 16));
  const double two_pi = m3::test::kTestTwoPi;
  EXPECT_NEAR(m3::test::circ_diff(0.01, two_pi - 0.01), 0.02, 1e-15);
  EXPECT_NEAR(m3::test::circ_diff(two_pi - 0.01, 0.01), -0.02, 1e-15);
  EXPECT_NEAR(m3::test::circ_diff(1e-9, 0.0), 1e-9, 1e-20);
  const auto idx = m3::test::sample_indices(100, 30, 5);
  EXPECT_EQ(idx.size(), 30u);
  EXPECT_TRUE(std::is_sorted(idx.begin(), idx.end()));
  EXPECT_EQ(std::adjacent_find(idx.begin(), idx.end()), idx.end());
  EXPECT_EQ(m3::test::sample_indices(10, 30, 5).size(), 10u);
}

// The clamp case really exercises both branches of A = min(−φ(dd_A), −a_floor).
TEST(BackboneFdSetup, ClampCaseHasClampedAndUnclampedA) {
  for (const auto& c : fd_cases()) {
    if (c.name != "aclamp_T7_cs3") continue;
    const m3::Problem pb = build_problem(c);
    const m3::Capture cap = m3::run_reference<double>(pb, ScanMode::Sequential);
    const auto& a = cap.at("L0/F3/a_val").data;
    const auto clamped = std::count(a.begin(), a.end(), -c.cfg.a_floor);
    EXPECT_GT(clamped, 0);
    EXPECT_LT(clamped, static_cast<long>(a.size()));
    return;
  }
  FAIL() << "aclamp case not found";
}

// big_dt really gives dt of order one (strong dynamics in the SSM and the angles).
TEST(BackboneFdSetup, BigDtCasesHaveLargeDt) {
  for (const auto& c : fd_cases()) {
    if (c.name != "T7_cs3") continue;
    const m3::Problem pb = build_problem(c);
    const m3::Capture cap = m3::run_reference<double>(pb, ScanMode::Sequential);
    const auto& dt = cap.at("L0/F3/dt").data;
    EXPECT_GT(*std::max_element(dt.begin(), dt.end()), 0.5);
    return;
  }
  FAIL() << "T7_cs3 case not found";
}

INSTANTIATE_TEST_SUITE_P(Cases, BackboneFd, ::testing::ValuesIn(fd_params()),
                         [](const auto& info) {
                           return info.param.c.name + "_" + m3::scan_mode_name(info.param.mode);
                         });

}  // namespace
