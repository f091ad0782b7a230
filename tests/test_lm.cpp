// The language-model ends of the reference (reference/lm.hpp, TRAINING.md §1) proven like
// every stage: the whole training step's gradients (every parameter, head_w and the
// embedding included) against central finite differences of the loss in double, in both scan
// modes; the gather path equal to input_proj on a one-hot; the embedding backward's fixed
// order; softmax cross-entropy's value and gradient against direct formulas; the emulated
// bf16 step close to the double oracle.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "error.hpp"
#include "fd.hpp"
#include "lm_test_util.hpp"
#include "lm.hpp"
#include "test_compare.hpp"
#include "test_util.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::LmModel;
using m3::Params;
using m3::ScanMode;

Config lm_cfg(Idx V, Idx layers = 2, double rope = 0.5) {
  return m3::test::token_model(m3::test::small_cfg(4, 2, 4, 1, rope, false, layers, 3, false, V),
                               V);
}

using Batch = m3::test::TokenBatch;

Batch random_batch(Idx BT, Idx V, std::uint64_t seed) {
  return m3::test::random_token_batch(BT, V, seed, 0.7);
}

class LmFd : public ::testing::TestWithParam<ScanMode> {};

TEST_P(LmFd, EveryParameterGradientMatchesFiniteDifferencesOfTheLoss) {
  const ScanMode mode = GetParam();
  const Idx B = 2, T = 5, V = 6;
  const Config cfg = lm_cfg(V);
  Params<double> p = m3::make_params<double>(cfg, 17);
  const Batch b = random_batch(B * T, V, 99);
  LmModel<double> lm(cfg, B, T, mode);
  auto loss = [&] { return lm.forward(p, b.tok, b.tgt, b.w, b.n); };
  loss();
  Params<double> g = m3::zero_params<double>(cfg);
  lm.backward(p, 1.0, g);
  const auto grads = m3::test::param_refs(g);
  const auto params = m3::test::param_refs(p);
  ASSERT_EQ(grads.size(), params.size());
  bool saw_head = false, saw_embed = false;
  for (size_t k = 0; k < params.size(); ++k) {
    std::vector<double>& x = *params[k].v;
    const std::vector<double>& gx = *grads[k].v;
    saw_head |= params[k].key == "grad/head_w";
    saw_embed |= params[k].key == "grad/input_proj_w";
    for (Idx i : m3::test::sample_indices(static_cast<Idx>(x.size()), 6, 7 + k)) {
      const double fd = m3::test::central_diff(x[i], loss);
      EXPECT_NEAR(gx[i], fd, 1e-7 * std::max(1.0, std::abs(fd)))
          << params[k].key << "[" << i << "] (" << m3::scan_mode_name(mode) << ")";
    }
  }
  EXPECT_TRUE(saw_head);
  EXPECT_TRUE(saw_embed);
}

INSTANTIATE_TEST_SUITE_P(BothScanModes, LmFd,
                         ::testing::Values(ScanMode::Sequential, ScanMode::Chunked),
                         [](const auto& info) { return m3::scan_mode_name(info.param); });

TEST(LmEmbed, TheGatherIsInputProjOnAOneHotForwardAndBackward) {
  const Idx B = 2, T = 7, V = 5;
  const Config cfg = lm_cfg(V, 1);
  const Params<double> p = m3::make_params<double>(cfg, 3);
  const Batch b = random_batch(B * T, V, 4);
  std::vector<double> onehot(static_cast<size_t>(B * T * V), 0.0);
  for (Idx r = 0; r < B * T; ++r) onehot[r * V + b.tok[r]] = 1.0;
  const auto dout = m3::make_dout<double>(cfg, B, T, 5);
  m3::Backbone<double> a(cfg, B, T, ScanMode::Chunked), c(cfg, B, T, ScanMode::Chunked);
  auto sa = m3::zero_states<double>(cfg, B), sc = sa;
  const std::vector<double> out_a = a.forward_tokens(p, b.tok, sa);
  const std::vector<double> out_c = c.forward(p, onehot, sc);
  ASSERT_EQ(out_a.size(), out_c.size());
  for (size_t i = 0; i < out_a.size(); ++i) ASSERT_EQ(out_a[i], out_c[i]) << i;
  Params<double> ga = m3::zero_params<double>(cfg), gc = ga;
  std::vector<double> dxa, dxc;
  m3::States<double> dea, dec;
  a.backward(p, dout, nullptr, ga, dxa, dea);
  c.backward(p, dout, nullptr, gc, dxc, dec);
  EXPECT_TRUE(dxa.empty()) << "d_x of a token input is made only for a Capture";
  const auto ra = m3::test::param_refs(ga), rc = m3::test::param_refs(gc);
  for (size_t k = 0; k < ra.size(); ++k)
    EXPECT_LE(m3::test::max_rel_err(*ra[k].v, *rc[k].v), 1e-14) << ra[k].key;
}

TEST(LmEmbed, TheFloatGatherEqualsTheOneHotGemmBitForBitInBf16Storage) {
  // The product of a one-hot row and a typed weight is exact, so the gather and the GEMM give
  // the same H⁰, rounded once: the whole forward is the same bits.
  const Idx B = 1, T = 9, V = 7;
  const Config cfg = lm_cfg(V, 1);
  const Params<float> p = m3::cast_params<float>(m3::make_params<double>(cfg, 8));
  const Batch b = random_batch(B * T, V, 9);
  std::vector<float> onehot(static_cast<size_t>(B * T * V), 0.0f);
  for (Idx r = 0; r < B * T; ++r) onehot[r * V + b.tok[r]] = 1.0f;
  m3::Backbone<float> a(cfg, B, T, ScanMode::Sequential, m3::Precision::BF16);
  m3::Backbone<float> c(cfg, B, T, ScanMode::Sequential, m3::Precision::BF16);
  auto sa = m3::zero_states<float>(cfg, B), sc = sa;
  const std::vector<float> out_a = a.forward_tokens(p, b.tok, sa);
  const std::vector<float> out_c = c.forward(p, onehot, sc);
  for (size_t i = 0; i < out_a.size(); ++i) ASSERT_EQ(out_a[i], out_c[i]) << i;
}

TEST(LmEmbed, TheBackwardSumsEachTokensRowsInRowOrder) {
  const std::vector<std::int32_t> tok = {2, 0, 2, 1, 2, 0};
  std::vector<Idx> order, starts;
  m3::ref::embed_order(tok.data(), 6, 4, order, starts);
  EXPECT_EQ(order, (std::vector<Idx>{1, 5, 3, 0, 2, 4}));
  EXPECT_EQ(starts, (std::vector<Idx>{0, 2, 3, 6, 6}));
  // Values whose float sum depends on the order: 1e8 + 1 − 1e8 is 0 in float left to right.
  const std::vector<float> dH = {1e8f, 5.0f, 1.0f, 7.0f, -1e8f, 3.0f};
  std::vector<float> dW(4, 0.0f);
  m3::ref::embed_backward<float>(6, 4, 1, tok.data(), dH.data(), dW.data(), nullptr);
  EXPECT_EQ(dW[0], 5.0f + 3.0f);
  EXPECT_EQ(dW[1], 7.0f);
  EXPECT_EQ(dW[2], (1e8f + 1.0f) + -1e8f);
  EXPECT_EQ(dW[3], 0.0f);
}

TEST(LmEmbed, ATokenOutsideTheVocabularyIsAnErrorNamingTheRow) {
  const std::vector<std::int32_t> tok = {0, 4};
  std::vector<Idx> order, starts;
  try {
    m3::ref::embed_order(tok.data(), 2, 4, order, starts);
    FAIL() << "no error";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("row 1"), std::string::npos) << e.what();
  }
}

TEST(LmLoss, ValueAndGradientMatchTheDirectFormulas) {
  const Idx BT = 3, V = 4;
  const std::vector<double> logits = {0.5, -1.0, 2.0, 0.0, 100.0, 99.0, -3.0, 0.0,
                                      -0.2, 0.1, 0.3, -0.4};
  const std::vector<std::int32_t> tgt = {2, 1, 0};
  const std::vector<float> w = {1, 1, 0};
  std::vector<double> lse(BT);
  const double loss = m3::ref::loss_forward(BT, V, logits.data(), tgt.data(), w.data(), 2.0,
                                            lse.data());
  double want = 0;
  for (Idx r = 0; r < 2; ++r) {
    double s = 0;
    for (Idx v = 0; v < V; ++v) s += std::exp(logits[r * V + v] - 100.0);
    const double l = 100.0 + std::log(s);
    EXPECT_NEAR(lse[r], l, 1e-12);
    want += l - logits[r * V + tgt[r]];
  }
  EXPECT_NEAR(loss, want / 2.0, 1e-12);
  EXPECT_TRUE(std::isfinite(lse[1])) << "max-shifted: logits of 100 do not overflow";
  std::vector<double> d(BT * V);
  m3::ref::loss_backward(BT, V, logits.data(), lse.data(), tgt.data(), w.data(), 2.0, 8.0,
                         d.data());
  for (Idx r = 0; r < BT; ++r) {
    double row = 0;
    for (Idx v = 0; v < V; ++v) {
      const double p = std::exp(logits[r * V + v] - lse[r]);
      const double e = 8.0 * w[r] / 2.0 * (p - (v == tgt[r] ? 1.0 : 0.0));
      EXPECT_NEAR(d[r * V + v], e, 1e-12);
      row += d[r * V + v];
    }
    EXPECT_NEAR(row, 0.0, 1e-12) << "softmax − one-hot sums to zero per row";
  }
}

TEST(LmLoss, NoScoredPositionIsAnError) {
  const std::vector<double> logits = {0, 0};
  const std::vector<std::int32_t> tgt = {0};
  const std::vector<float> w = {0};
  std::vector<double> lse(1);
  EXPECT_THROW(m3::ref::loss_forward(1, 2, logits.data(), tgt.data(), w.data(), 0.0, lse.data()),
               m3::Error);
}

TEST(LmModel, Bf16EmulationIsCloseToTheDoubleOracle) {
  const Idx B = 2, T = 16, V = 11;
  const Config cfg = lm_cfg(V, 2);
  const Params<double> pd = m3::make_params<double>(cfg, 21);
  const Params<float> pf = m3::cast_params<float>(pd);
  const Batch b = random_batch(B * T, V, 22);
  LmModel<double> od(cfg, B, T, ScanMode::Chunked);
  LmModel<float> of(cfg, B, T, ScanMode::Chunked, m3::Precision::BF16);
  const double ld = od.forward(pd, b.tok, b.tgt, b.w, b.n);
  const double lf = of.forward(pf, b.tok, b.tgt, b.w, b.n);
  EXPECT_NEAR(lf, ld, 2e-2 * std::abs(ld));
  EXPECT_NE(lf, ld) << "bf16 storage rounds somewhere";
  Params<double> gd = m3::zero_params<double>(cfg);
  Params<float> gf = m3::zero_params<float>(cfg);
  od.backward(pd, 1.0, gd);
  of.backward(pf, 1.0, gf);
  const auto rd = m3::test::param_refs(gd);
  const auto rf = m3::test::param_refs(gf);
  for (size_t k = 0; k < rd.size(); ++k) {
    std::vector<double> f(rf[k].v->begin(), rf[k].v->end());
    if (rd[k].key.find("norm_gate_weight") != std::string::npos) continue;  // zero gradient
    EXPECT_LE(m3::test::rel_l2(f, *rd[k].v), 0.1) << rd[k].key;
  }
}

TEST(LmModel, TheLossScaleScalesEveryGradientExactlyByAPowerOfTwo) {
  const Idx B = 1, T = 6, V = 5;
  const Config cfg = lm_cfg(V, 1);
  const Params<float> p = m3::cast_params<float>(m3::make_params<double>(cfg, 31));
  const Batch b = random_batch(B * T, V, 32);
  LmModel<float> m(cfg, B, T, ScanMode::Chunked);
  m.forward(p, b.tok, b.tgt, b.w, b.n);
  Params<float> g1 = m3::zero_params<float>(cfg), g2 = g1;
  m.backward(p, 1.0, g1);
  m.backward(p, 1024.0, g2);
  const auto r1 = m3::test::param_refs(g1), r2 = m3::test::param_refs(g2);
  for (size_t k = 0; k < r1.size(); ++k)
    for (size_t i = 0; i < r1[k].v->size(); ++i)
      ASSERT_EQ((*r1[k].v)[i] * 1024.0f, (*r2[k].v)[i]) << r1[k].key << "[" << i << "]";
}

TEST(LmModel, TheCaptureHoldsTheHeadAndLossTensorsUnderTheirRegistryNames) {
  const Idx B = 1, T = 4, V = 3;
  const Config cfg = lm_cfg(V, 1);
  const Params<double> p = m3::make_params<double>(cfg, 41);
  const Batch b = random_batch(B * T, V, 42);
  LmModel<double> m(cfg, B, T, ScanMode::Sequential);
  m3::Capture cap(cfg, B, T);
  const double loss = m.forward(p, b.tok, b.tgt, b.w, b.n, nullptr, &cap);
  Params<double> g = m3::zero_params<double>(cfg);
  m.backward(p, 1.0, g, &cap);
  for (const char* k : {"head/logits", "loss/lse", "loss/value", "head/d_logits", "head/d_Out",
                        "input_proj/input_proj_inputs", "input_proj/d_input_proj_dx"})
    EXPECT_TRUE(cap.has(k)) << k;
  EXPECT_EQ(cap.at("loss/value").data.at(0), loss);
  EXPECT_EQ(cap.at("head/logits").shape, (std::vector<Idx>{B * T, V}));
}

}  // namespace
