// Window chaining with gradient flow (MODEL.md §9, §12.4): two windows [0, T1) and [T1, T)
// that carry the states equal one window of T.
//
//   forward : window 1 from the entering states S0 → S1; window 2 from S1 → S2.
//             Out rows and S2 must equal the single window's Out and leaving states.
//   backward: window 2 first, with d_leaving = W (seeded), giving dS1 = its d_entering;
//             then window 1 with d_leaving = dS1, ACCUMULATING into the same gradient buffer.
//             Param grads (sum of both windows), d_x (both windows' rows) and dS0 must equal
//             the single window's backward with d_leaving = W.
// Both scan modes, random entering states, tolerance 1e-12 relative (rel_l2 and max|Δ|/max).
// Also checked here: backward accumulates parameter gradients (+=) and overwrites d_x and
// d_entering (MODEL.md §6.0), and repeated forward/backward calls are reproducible.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "backbone.hpp"
#include "problem.hpp"
#include "test_compare.hpp"
#include "test_util.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::ScanMode;
using m3::test::small_cfg;

constexpr double kTol = 1e-12;

struct ChainCase {
  std::string name;
  Config cfg;
  Idx B, T, T1;  // window 1 = [0, T1), window 2 = [T1, T)
};

struct ChainParam {
  ChainCase c;
  ScanMode mode;
};

std::vector<ChainParam> chain_params() {
  //                                       d_model hd ds ng rf outnorm L cs identity in
  const std::vector<ChainCase> cases = {
      {"base_T12_half_cs4", small_cfg(4, 2, 4, 1, 0.5, false, 1, 4, false, 3), 2, 12, 6},
      {"base_T12_half_cs5", small_cfg(4, 2, 4, 1, 0.5, false, 1, 5, false, 3), 2, 12, 6},
      {"ng2_rope1_T10_split3_cs2", small_cfg(8, 2, 6, 2, 1.0, false, 1, 2, false, 3), 2, 10, 3},
      {"outnorm_L2_T14_half_cs3", small_cfg(8, 4, 4, 1, 0.5, true, 2, 3, false, 5), 2, 14, 7},
      {"na0_T8_half_cs64", small_cfg(4, 2, 3, 1, 0.5, false, 1, 64, false, 3), 2, 8, 4},
      {"identity_L2_T2_split1_cs1", small_cfg(4, 2, 4, 1, 1.0, true, 2, 1, true), 1, 2, 1},
  };
  std::vector<ChainParam> out;
  for (const auto& c : cases)
    for (auto m : {ScanMode::Sequential, ScanMode::Chunked}) out.push_back({c, m});
  return out;
}

class Chaining : public ::testing::TestWithParam<ChainParam> {};

TEST_P(Chaining, TwoWindowsEqualOneWindowForwardAndBackward) {
  const ChainCase& c = GetParam().c;
  const ScanMode mode = GetParam().mode;
  const Config& cfg = c.cfg;
  const Idx B = c.B, T = c.T, T1 = c.T1, T2 = T - T1, in = cfg.input_dim, dm = cfg.d_model;
  const m3::Problem pb = m3::make_problem(cfg, B, T, 53, true);
  const m3::States<double> W = m3::test::random_like_states(cfg, B, 59);

  // Single window.
  const auto one = m3::test::run_backbone<double>(pb, mode, &W);

  // Two windows.
  const auto x1 = m3::test::window_rows(pb.x, B, T, in, 0, T1);
  const auto x2 = m3::test::window_rows(pb.x, B, T, in, T1, T);
  const auto g1 = m3::test::window_rows(pb.d_out, B, T, dm, 0, T1);
  const auto g2 = m3::test::window_rows(pb.d_out, B, T, dm, T1, T);
  m3::Backbone<double> w1(cfg, B, T1, mode), w2(cfg, B, T2, mode);
  m3::States<double> st = pb.states;
  const std::vector<double> out1 = w1.forward(pb.params, x1, st);
  const std::vector<double> out2 = w2.forward(pb.params, x2, st);

  m3::Params<double> grads = m3::zero_params<double>(cfg);
  std::vector<double> dx1, dx2;
  m3::States<double> dS1, dS0;
  w2.backward(pb.params, g2, &W, grads, dx2, dS1);
  w1.backward(pb.params, g1, &dS1, grads, dx1, dS0);

  std::vector<double> out(static_cast<size_t>(B * T * dm)), dx(static_cast<size_t>(B * T * in));
  m3::test::put_window_rows(out, out1, B, T, dm, 0, T1);
  m3::test::put_window_rows(out, out2, B, T, dm, T1, T);
  m3::test::put_window_rows(dx, dx1, B, T, in, 0, T1);
  m3::test::put_window_rows(dx, dx2, B, T, in, T1, T);

  double worst = 0;
  std::string worst_key;
  auto cmp = [&](const std::string& key, const std::vector<double>& got,
                 const std::vector<double>& want, bool circular) {
    ASSERT_EQ(got.size(), want.size()) << key;
    const double r = m3::test::rel_l2(got.data(), want.data(), want.size(), circular);
    const double m = m3::test::max_rel_err(got.data(), want.data(), want.size(), circular);
    EXPECT_LE(r, kTol) << key << " rel_l2 (max_rel " << m << ")";
    EXPECT_LE(m, kTol) << key << " max|Δ|/max (rel_l2 " << r << ")";
    if (std::max(r, m) >= worst) {
      worst = std::max(r, m);
      worst_key = key;
    }
  };
  cmp("Out", out, one.out, false);
  cmp("d_x", dx, one.d_x, false);
  {
    auto got_l = m3::test::state_refs(st);
    auto got_d = m3::test::state_refs(dS0);
    auto want_l = m3::test::state_refs(one.leaving);
    auto want_d = m3::test::state_refs(one.d_entering);
    for (size_t k = 0; k < got_l.size(); ++k) {
      const bool angle = std::string(got_l[k].key) == "angle";
      cmp(std::string("leaving/") + got_l[k].key, *got_l[k].v, *want_l[k].v, angle);
      cmp(std::string("d_entering/") + got_d[k].key, *got_d[k].v, *want_d[k].v, false);
    }
  }
  {
    auto got = m3::test::param_refs(grads);
    auto want = m3::test::param_refs(one.grads);
    ASSERT_EQ(got.size(), want.size());
    for (size_t k = 0; k < got.size(); ++k) cmp(got[k].key, *got[k].v, *want[k].v, false);
  }
  std::printf("[chaining] %-28s %-7s worst %.2e (%s)\n", c.name.c_str(),
              m3::scan_mode_name(mode), worst, worst_key.c_str());
}

INSTANTIATE_TEST_SUITE_P(Cases, Chaining, ::testing::ValuesIn(chain_params()),
                         [](const auto& info) {
                           return info.param.c.name + "_" + m3::scan_mode_name(info.param.mode);
                         });

// ---- backward's output contract ------------------------------------------------------------

class BackwardContract : public ::testing::TestWithParam<ScanMode> {};

TEST_P(BackwardContract, AccumulatesParamGradsAndOverwritesActivationGrads) {
  const ScanMode mode = GetParam();
  const Config cfg = small_cfg(4, 2, 4, 2, 1.0, true, 2, 3, false, 3);
  const Idx B = 2, T = 7;
  const m3::Problem pb = m3::make_problem(cfg, B, T, 61, true);
  const m3::States<double> W = m3::test::random_like_states(cfg, B, 67);

  m3::Backbone<double> bb(cfg, B, T, mode);
  m3::States<double> st = pb.states;
  bb.forward(pb.params, pb.x, st);
  m3::Params<double> g1 = m3::zero_params<double>(cfg);
  std::vector<double> dx1;
  m3::States<double> de1;
  bb.backward(pb.params, pb.d_out, &W, g1, dx1, de1);

  // Second backward into pre-filled buffers: grads must become g1 + g1 (grads were g1) — to
  // round-off, since a reduction may add row by row into the running gradient —
  // d_x and d_entering must be overwritten (pre-filled with garbage of the wrong size/values).
  m3::Params<double> g2 = g1;
  std::vector<double> dx2(3, 123.0);
  m3::States<double> de2 = m3::test::random_like_states(cfg, B, 71);
  de2.ssm.push_back(5.0);
  bb.backward(pb.params, pb.d_out, &W, g2, dx2, de2);
  EXPECT_EQ(dx2, dx1);
  EXPECT_EQ(de2.ssm, de1.ssm);
  EXPECT_EQ(de2.k, de1.k);
  EXPECT_EQ(de2.v, de1.v);
  EXPECT_EQ(de2.angle, de1.angle);
  auto r1 = m3::test::param_refs(g1);
  auto r2 = m3::test::param_refs(g2);
  ASSERT_EQ(r1.size(), r2.size());
  for (size_t k = 0; k < r1.size(); ++k) {
    const std::vector<double>& a = *r1[k].v;
    std::vector<double> twice(a.size());
    for (size_t i = 0; i < a.size(); ++i) twice[i] = 2.0 * a[i];
    EXPECT_LE(m3::test::max_rel_err(*r2[k].v, twice), 1e-14) << r1[k].key;
  }

  // A second forward on the same object reproduces the first exactly.
  m3::States<double> st2 = pb.states;
  m3::Backbone<double> fresh(cfg, B, T, mode);
  m3::States<double> st3 = pb.states;
  const std::vector<double> o_fresh = fresh.forward(pb.params, pb.x, st3);
  const std::vector<double> o_again = bb.forward(pb.params, pb.x, st2);
  EXPECT_EQ(o_again, o_fresh);
  EXPECT_EQ(st2.ssm, st3.ssm);
  EXPECT_EQ(st2.angle, st3.angle);
}

TEST_P(BackwardContract, NullLeavingGradientEqualsZeroLeavingGradient) {
  const ScanMode mode = GetParam();
  const Config cfg = small_cfg(4, 2, 4, 1, 0.5, false, 2, 4, false, 3);
  const Idx B = 2, T = 6;
  const m3::Problem pb = m3::make_problem(cfg, B, T, 73, true);
  const m3::States<double> Z = m3::zero_states<double>(cfg, B);
  const auto a = m3::test::run_backbone<double>(pb, mode, nullptr);
  const auto b = m3::test::run_backbone<double>(pb, mode, &Z);
  EXPECT_EQ(a.d_x, b.d_x);
  EXPECT_EQ(a.d_entering.ssm, b.d_entering.ssm);
  EXPECT_EQ(a.d_entering.angle, b.d_entering.angle);
  auto ra = m3::test::param_refs(a.grads);
  auto rb = m3::test::param_refs(b.grads);
  for (size_t k = 0; k < ra.size(); ++k) EXPECT_EQ(*ra[k].v, *rb[k].v) << ra[k].key;
}

TEST_P(BackwardContract, RejectsBackwardBeforeForwardAndBadSizes) {
  const ScanMode mode = GetParam();
  const Config cfg = small_cfg();
  const Idx B = 1, T = 3;
  const m3::Problem pb = m3::make_problem(cfg, B, T, 79, false);
  m3::Backbone<double> bb(cfg, B, T, mode);
  m3::Params<double> g = m3::zero_params<double>(cfg);
  std::vector<double> dx;
  m3::States<double> de;
  EXPECT_THROW(bb.backward(pb.params, pb.d_out, nullptr, g, dx, de), m3::Error);
  m3::States<double> st = pb.states;
  std::vector<double> bad_x(pb.x.size() + 1, 0.0);
  EXPECT_THROW(bb.forward(pb.params, bad_x, st), m3::Error);
  m3::States<double> bad_st = pb.states;
  bad_st.k.pop_back();
  EXPECT_THROW(bb.forward(pb.params, pb.x, bad_st), m3::Error);
  bb.forward(pb.params, pb.x, st);
  std::vector<double> bad_dout(pb.d_out.size() - 1, 0.0);
  EXPECT_THROW(bb.backward(pb.params, bad_dout, nullptr, g, dx, de), m3::Error);
  m3::States<double> bad_dl = m3::zero_states<double>(cfg, B);
  bad_dl.v.push_back(0.0);
  EXPECT_THROW(bb.backward(pb.params, pb.d_out, &bad_dl, g, dx, de), m3::Error);
  EXPECT_THROW(m3::Backbone<double>(cfg, 0, T, mode), m3::Error);
}

INSTANTIATE_TEST_SUITE_P(Modes, BackwardContract,
                         ::testing::Values(ScanMode::Sequential, ScanMode::Chunked),
                         [](const auto& info) { return std::string(m3::scan_mode_name(info.param)); });

}  // namespace
