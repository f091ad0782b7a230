// Backbone<float> vs Backbone<double> on the same Problem (the f32 baseline against the oracle):
// a sanity bound on rel_l2 for every captured tensor (every stage tensor of the mode and every
// parameter gradient), both scan modes, with and without entering states. Angles (registry
// `circular`) are compared by circular distance. This is not the harness budget (HARNESS.md §4)
// — only a guard that the float instantiation computes the same function.
//
// d_angle_state is measured against its summands d_angle_cumsum (test_util.hpp scale_key_for).
// Bound: kBound on rel_l2 (f32 has ε ≈ 6e-8; the measured worst over these cases is printed).
// A tensor whose double values are all zero must be all zero in float too.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "problem.hpp"
#include "registry.hpp"
#include "stages.hpp"
#include "test_compare.hpp"
#include "test_util.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::ScanMode;
using m3::test::small_cfg;

constexpr double kBound = 1e-4;

struct FvdCase {
  const char* name;
  Config cfg;
  Idx B, T;
  bool random_states;
};

struct FvdParam {
  FvdCase c;
  ScanMode mode;
};

std::vector<FvdParam> fvd_params() {
  //                                         d_model hd ds ng rf outnorm L cs identity in
  const std::vector<FvdCase> cases = {
      {"mid_L2_ng2_T40_cs16", small_cfg(32, 8, 16, 2, 0.5, false, 2, 16, false, 24), 2, 40, true},
      {"mid_outnorm_rope1_T37_cs8", small_cfg(32, 8, 16, 1, 1.0, true, 2, 8, false, 24), 2, 37,
       true},
      {"small_fresh_T13_cs4", small_cfg(8, 4, 8, 2, 0.5, false, 1, 4, false, 5), 2, 13, false},
      {"identity_na0_T20_cs64", small_cfg(16, 4, 3, 1, 0.5, true, 1, 64, true), 1, 20, true},
      {"default_shape_T64", Config{}, 1, 64, true},
  };
  std::vector<FvdParam> out;
  for (const auto& c : cases)
    for (auto m : {ScanMode::Sequential, ScanMode::Chunked}) out.push_back({c, m});
  return out;
}

class FloatVsDouble : public ::testing::TestWithParam<FvdParam> {};

TEST_P(FloatVsDouble, EveryCapturedTensorIsClose) {
  const auto& [c, mode] = GetParam();
  const m3::Problem pb = m3::make_problem(c.cfg, c.B, c.T, 83, c.random_states);
  const m3::Capture d = m3::run_reference<double>(pb, mode);
  const m3::Capture f = m3::run_reference<float>(pb, mode);
  ASSERT_EQ(d.keys(), f.keys());

  std::vector<std::string> circular;
  for (const auto& k : m3::expected_stage_keys(c.cfg, c.B, c.T, mode))
    if (k.spec->circular) circular.push_back(k.key);
  auto is_circular = [&](const std::string& key) {
    return std::find(circular.begin(), circular.end(), key) != circular.end();
  };

  double worst = 0;
  std::string worst_key;
  for (const auto& key : d.keys()) {
    const auto& a = f.at(key).data;
    const auto& b = d.at(key).data;
    ASSERT_EQ(a.size(), b.size()) << key;
    const bool circ = is_circular(key);
    if (m3::test::inf_norm(b.data(), b.size()) == 0 && !circ && m3::test::scale_key_for(key) == key) {
      EXPECT_EQ(m3::test::inf_norm(a.data(), a.size()), 0.0) << key << " is zero in double only";
      continue;
    }
    const auto& ref = d.at(m3::test::scale_key_for(key)).data;
    const double r = m3::test::rel_l2_vs(a.data(), b.data(), b.size(),
                                         m3::test::l2_norm(ref.data(), ref.size()), circ);
    EXPECT_LE(r, kBound) << key << " (max_rel "
                         << m3::test::max_rel_err(a.data(), b.data(), b.size(), circ) << ")";
    if (r >= worst) {
      worst = r;
      worst_key = key;
    }
  }
  std::printf("[float-vs-double] %-28s %-7s worst rel_l2 %.2e (%s)\n", c.name,
              m3::scan_mode_name(mode), worst, worst_key.c_str());
}

INSTANTIATE_TEST_SUITE_P(Cases, FloatVsDouble, ::testing::ValuesIn(fvd_params()),
                         [](const auto& info) {
                           return std::string(info.param.c.name) + "_" +
                                  m3::scan_mode_name(info.param.mode);
                         });

}  // namespace

namespace {

// F5 in float against F5 in double on the same float inputs, over a long window in which the
// angle turns fast (τ = ±1, as a trained model's saturated rates give, and dt ∈ [0.3, 1]): the
// increments π·(τ·dt) must carry no error of π's own rounding. With π rounded to float first
// (2.8e-8 above π) every increment is that much too large and θ drifts by 2.8e-8 of the angle
// turned, here about 4e-4 rad at the last step (measured so: 3.8e-4); the increment's own
// roundings, one per step and of either sign, add up like a random walk: 1e-7 … 1.8e-5 here.
TEST(FloatAngles, TheIncrementCarriesNoErrorOfPisRounding) {
  m3::ref::Dims d{};
  d.B = 1, d.T = 16384, d.BT = d.T, d.nh = 2, d.na = 2;
  m3::Rng rng(17);
  m3::ref::LayerActs<float> f;
  f.angles_raw.resize(static_cast<size_t>(d.BT * d.na));
  for (float& e : f.angles_raw) e = rng.uniform(0.0, 1.0) < 0.7 ? 20.0f : -20.0f;
  f.dt.resize(static_cast<size_t>(d.BT * d.nh));
  for (float& e : f.dt) e = static_cast<float>(rng.uniform(0.3, 1.0));
  f.angle_in.assign(static_cast<size_t>(d.B * d.nh * d.na), 0.0f);
  f.angle_cumsum.resize(static_cast<size_t>(d.BT * d.nh * d.na));
  f.angle_out.resize(f.angle_in.size());
  m3::ref::LayerActs<double> o;
  o.angles_raw.assign(f.angles_raw.begin(), f.angles_raw.end());
  o.dt.assign(f.dt.begin(), f.dt.end());
  o.angle_in.assign(f.angle_in.size(), 0.0);
  o.angle_cumsum.resize(f.angle_cumsum.size());
  o.angle_out.resize(f.angle_out.size());
  m3::ref::angle_forward(d, f);
  m3::ref::angle_forward(d, o);
  // f32's nearest π, the constant the increment used to take, is kPiHi<float>.
  const double pi_f32_excess =
      (static_cast<double>(m3::ref::kPiHi<float>) - m3::ref::kPi) / m3::ref::kPi;
  for (m3::Idx h = 0; h < d.nh; ++h)
    for (m3::Idx a = 0; a < d.na; ++a) {
      double turned = 0;  // Σ π·τ·dt up to the last step, unwrapped
      for (m3::Idx t = 0; t < d.T; ++t)
        turned += m3::ref::kPi * (f.angles_raw[static_cast<size_t>(t * d.na + a)] > 0 ? 1.0 : -1.0) *
                  static_cast<double>(f.dt[static_cast<size_t>(t * d.nh + h)]);
      const double drift = pi_f32_excess * std::abs(turned);
      const size_t last = static_cast<size_t>(((d.T - 1) * d.nh + h) * d.na + a);
      const double err = std::abs(std::remainder(static_cast<double>(f.angle_cumsum[last]) -
                                                     o.angle_cumsum[last],
                                                 m3::ref::kTwoPi));
      std::printf("[          ] h %lld a %lld: |θ_f32 − θ| %.3g rad at t = T−1, π's drift %.3g\n",
                  static_cast<long long>(h), static_cast<long long>(a), err, drift);
      EXPECT_GT(drift, 2e-4);
      EXPECT_LT(err, 0.1 * drift) << "h " << h << " a " << a;
    }
}

}  // namespace
