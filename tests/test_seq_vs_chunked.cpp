// Sequential ≡ chunked (MODEL.md §5, §12.4–§12.5), in double.
//
// For each config × T × chunk size × {zero, random entering states}:
//   * every stage tensor that both modes produce (registry modes == Both) and every parameter
//     gradient of run_reference<double> (dOut, zero leaving-state gradients);
//   * Out, the leaving states, every parameter gradient, d_x and the entering-state gradients
//     of Backbone<double> with NON-zero leaving-state gradients (chained-window backward).
// Metric per tensor: rel_l2 and max|Δ| / max|sequential|, both ≤ kTol; angle tensors
// (registry `circular`) by circular distance; d_angle_state against the scale of its summands
// d_angle_cumsum (it vanishes by cancellation with fresh states, test_util.hpp scale_key_for —
// pinned by AngleStateGradient.VanishesWithFreshStates below). Chunk sizes 1, 3, 8, 64 with T = 13 and 20
// (partial last chunk; chunk > T).
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "backbone.hpp"
#include "problem.hpp"
#include "registry.hpp"
#include "test_compare.hpp"
#include "test_util.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::ScanMode;
using m3::test::small_cfg;

constexpr double kTol = 1e-12;

struct SvcCase {
  std::string cfg_name;
  Config cfg;
  Idx B, T;
  bool random_states;
};

std::vector<SvcCase> svc_cases() {
  struct Named {
    const char* name;
    Config cfg;
  };
  //                                   d_model hd ds ng  rf  outnorm L cs identity in
  const std::vector<Named> cfgs = {
      {"base", small_cfg(4, 2, 4, 1, 0.5, false, 1, 4, false, 3)},
      {"ng2", small_cfg(8, 2, 4, 2, 0.5, false, 1, 4, false, 3)},
      {"rope1", small_cfg(4, 2, 6, 1, 1.0, false, 1, 4, false, 3)},
      {"outnorm", small_cfg(8, 4, 4, 1, 0.5, true, 1, 4, false, 3)},
      {"na0", small_cfg(4, 2, 3, 1, 0.5, false, 1, 4, false, 3)},
      {"all_L2", small_cfg(8, 4, 8, 2, 1.0, true, 2, 4, true)},
  };
  std::vector<SvcCase> out;
  for (const auto& n : cfgs)
    for (Idx T : {Idx(13), Idx(20)})
      for (Idx cs : {Idx(1), Idx(3), Idx(8), Idx(64)})
        for (bool rs : {false, true}) {
          Config c = n.cfg;
          c.chunk_size = cs;
          out.push_back({n.name, c, 2, T, rs});
        }
  return out;
}

std::string case_name(const SvcCase& c) {
  return c.cfg_name + "_T" + std::to_string(c.T) + "_cs" + std::to_string(c.cfg.chunk_size) +
         (c.random_states ? "_states" : "_fresh");
}

struct Cmp {
  double rel_l2, max_rel;
};

// chunked vs seq; the scale is max(norm of seq, norm of `scale`) (scale: see scale_key_for).
Cmp compare(const std::vector<double>& chunked, const std::vector<double>& seq, bool circular,
            const std::vector<double>* scale = nullptr) {
  const double ref_l2 = scale ? m3::test::l2_norm(scale->data(), scale->size()) : 0.0;
  const double ref_inf = scale ? m3::test::inf_norm(scale->data(), scale->size()) : 0.0;
  return {m3::test::rel_l2_vs(chunked.data(), seq.data(), seq.size(), ref_l2, circular),
          m3::test::max_rel_err_vs(chunked.data(), seq.data(), seq.size(), ref_inf, circular)};
}

class SeqVsChunked : public ::testing::TestWithParam<SvcCase> {};

TEST_P(SeqVsChunked, CommonStageTensorsAndGradientsAgree) {
  const SvcCase& c = GetParam();
  const m3::Problem pb = m3::make_problem(c.cfg, c.B, c.T, 31, c.random_states);
  const m3::Capture seq = m3::run_reference<double>(pb, ScanMode::Sequential);
  const m3::Capture chk = m3::run_reference<double>(pb, ScanMode::Chunked);

  double worst = 0;
  std::string worst_key;
  size_t compared = 0;
  auto one = [&](const std::string& key, bool circular) {
    const m3::Tensor* a = seq.find(key);
    const m3::Tensor* b = chk.find(key);
    ASSERT_NE(a, nullptr) << "sequential run lacks " << key;
    ASSERT_NE(b, nullptr) << "chunked run lacks " << key;
    ASSERT_EQ(a->shape, b->shape) << key;
    const m3::Tensor* ref = seq.find(m3::test::scale_key_for(key));
    ASSERT_NE(ref, nullptr) << "no scale tensor for " << key;
    const Cmp m = compare(b->data, a->data, circular, &ref->data);
    EXPECT_LE(m.rel_l2, kTol) << key << " rel_l2 (max_rel " << m.max_rel << ")";
    EXPECT_LE(m.max_rel, kTol) << key << " max|Δ|/max|seq| (rel_l2 " << m.rel_l2 << ")";
    const double w = std::max(m.rel_l2, m.max_rel);
    if (w >= worst) {
      worst = w;
      worst_key = key;
    }
    ++compared;
  };
  for (const auto& k : m3::expected_stage_keys(c.cfg, c.B, c.T, ScanMode::Sequential))
    if (k.spec->modes == m3::Modes::Both) one(k.key, k.spec->circular);
  for (const auto& k : m3::expected_param_keys(c.cfg)) one(k.key, false);
  EXPECT_GT(compared, 40u);
  std::printf("[seq-vs-chunked] %-28s captures: %zu tensors, worst %.2e (%s)\n",
              case_name(c).c_str(), compared, worst, worst_key.c_str());
}

TEST_P(SeqVsChunked, ChainedBackwardWithLeavingGradientsAgrees) {
  const SvcCase& c = GetParam();
  const m3::Problem pb = m3::make_problem(c.cfg, c.B, c.T, 37, c.random_states);
  const m3::States<double> w = m3::test::random_like_states(c.cfg, c.B, 41);
  auto seq = m3::test::run_backbone<double>(pb, ScanMode::Sequential, &w);
  auto chk = m3::test::run_backbone<double>(pb, ScanMode::Chunked, &w);

  double worst = 0;
  std::string worst_key;
  auto one = [&](const std::string& key, const std::vector<double>& b,
                 const std::vector<double>& a, bool circular) {
    ASSERT_EQ(a.size(), b.size()) << key;
    const Cmp m = compare(b, a, circular);
    EXPECT_LE(m.rel_l2, kTol) << key << " rel_l2 (max_rel " << m.max_rel << ")";
    EXPECT_LE(m.max_rel, kTol) << key << " max|Δ|/max|seq| (rel_l2 " << m.rel_l2 << ")";
    const double wv = std::max(m.rel_l2, m.max_rel);
    if (wv >= worst) {
      worst = wv;
      worst_key = key;
    }
  };
  one("Out", chk.out, seq.out, false);
  one("d_x", chk.d_x, seq.d_x, false);
  {
    auto sa = m3::test::state_refs(seq.leaving), ca = m3::test::state_refs(chk.leaving);
    auto sd = m3::test::state_refs(seq.d_entering), cd = m3::test::state_refs(chk.d_entering);
    for (size_t k = 0; k < sa.size(); ++k) {
      const bool angle = std::string(sa[k].key) == "angle";
      one(std::string("leaving/") + sa[k].key, *ca[k].v, *sa[k].v, angle);
      one(std::string("d_entering/") + sa[k].key, *cd[k].v, *sd[k].v, false);
    }
  }
  {
    auto sg = m3::test::param_refs(seq.grads), cg = m3::test::param_refs(chk.grads);
    ASSERT_EQ(sg.size(), cg.size());
    for (size_t k = 0; k < sg.size(); ++k) one(sg[k].key, *cg[k].v, *sg[k].v, false);
  }
  std::printf("[seq-vs-chunked] %-28s chained:  worst %.2e (%s)\n", case_name(c).c_str(), worst,
              worst_key.c_str());
}

// With zero entering states and zero leaving gradients the loss depends on the angles only
// through θ_t − θ_s, so ∂L/∂θ_{−1} = Σ_t dθ_t = 0 exactly; numerically it must vanish to
// round-off relative to the per-step gradients (a wrong sign or missing term would not).
class AngleStateGradient : public ::testing::TestWithParam<ScanMode> {};

TEST_P(AngleStateGradient, VanishesWithFreshStates) {
  const Config cfg = small_cfg(8, 2, 6, 2, 1.0, true, 2, 4, false, 3);
  const m3::Problem pb = m3::make_problem(cfg, 2, 11, 43, false);
  const m3::Capture cap = m3::run_reference<double>(pb, GetParam());
  for (int l = 0; l < 2; ++l) {
    const std::string p = "L" + std::to_string(l) + "/";
    const auto& ds = cap.at(p + "d_states/d_angle_state").data;
    const auto& dc = cap.at(p + "B6/d_angle_cumsum").data;
    const double scale = m3::test::inf_norm(dc.data(), dc.size());
    EXPECT_GT(scale, 1e-3) << p;
    EXPECT_LE(m3::test::inf_norm(ds.data(), ds.size()), 1e-13 * scale * pb.T) << p;
  }
  // With random entering states the invariance is broken and the gradient is not small.
  const m3::Problem pr = m3::make_problem(cfg, 2, 11, 43, true);
  const m3::Capture cr = m3::run_reference<double>(pr, GetParam());
  const auto& ds = cr.at("L0/d_states/d_angle_state").data;
  const auto& dc = cr.at("L0/B6/d_angle_cumsum").data;
  EXPECT_GT(m3::test::inf_norm(ds.data(), ds.size()), 1e-6 * m3::test::inf_norm(dc.data(), dc.size()));
}

INSTANTIATE_TEST_SUITE_P(Modes, AngleStateGradient,
                         ::testing::Values(ScanMode::Sequential, ScanMode::Chunked),
                         [](const auto& info) { return std::string(m3::scan_mode_name(info.param)); });

INSTANTIATE_TEST_SUITE_P(Cases, SeqVsChunked, ::testing::ValuesIn(svc_cases()),
                         [](const auto& info) { return case_name(info.param); });

}  // namespace
