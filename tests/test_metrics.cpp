// Tests of the harness (harness/): the metrics of HARNESS.md §3 on hand-computed tensors,
// coordinate decoding, circular distance, the budget rule of §4 and the comparison of whole
// captures — including negative controls: a deliberately perturbed, missing or NaN subject
// tensor must fail and be named as the first failing stage in execution order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "budget.hpp"
#include "capture.hpp"
#include "compare.hpp"
#include "determinism.hpp"
#include "error.hpp"
#include "metrics.hpp"
#include "presets.hpp"
#include "problem.hpp"
#include "registry.hpp"
#include "test_util.hpp"

namespace m3::harness {
namespace {

constexpr double kTwoPi = 6.283185307179586476925286766559;

Tensor tensor(std::vector<Idx> shape, std::vector<double> data) {
  Tensor t;
  t.shape = std::move(shape);
  t.data = std::move(data);
  return t;
}

// ---- metrics on hand-computed tensors -----------------------------------------------------

TEST(Metrics, MaxAbsRelL2AndRelSetOnAHandComputedTensor) {
  // Δ = {0.1, 0, 0.001, −0.2, 0}; |o| ≥ 1e-2 keeps indices 0, 1, 3 → rel {0.1, 0, 0.05}.
  const Tensor o = tensor({5}, {1.0, -2.0, 0.005, 4.0, 0.0});
  const Tensor s = tensor({5}, {1.1, -2.0, 0.006, 3.8, 0.0});
  const Metrics m = compute_metrics(o, s, false);
  EXPECT_EQ(m.numel, 5);
  EXPECT_NEAR(m.max_abs, 0.2, 1e-15);
  EXPECT_EQ(m.worst_index, 3);
  EXPECT_DOUBLE_EQ(m.worst_oracle, 4.0);
  EXPECT_DOUBLE_EQ(m.worst_subject, 3.8);
  EXPECT_DOUBLE_EQ(m.oracle_scale, 4.0);
  const double d2 = 0.1 * 0.1 + 0.001 * 0.001 + 0.2 * 0.2;
  const double o2 = 1.0 + 4.0 + 0.005 * 0.005 + 16.0;
  EXPECT_NEAR(m.rel_l2, std::sqrt(d2) / std::sqrt(o2), 1e-14);
  EXPECT_FALSE(m.rel_l2_absolute);
  EXPECT_EQ(m.rel_count, 3);
  EXPECT_NEAR(m.p95_rel, 0.1, 1e-14);  // nearest rank ⌈0.95·3⌉ = 3rd of {0, 0.05, 0.1}
  EXPECT_NEAR(m.max_rel, 0.1, 1e-14);
  const double so = 1.1 * 1.0 + 4.0 + 0.006 * 0.005 + 3.8 * 4.0;
  const double s2 = 1.21 + 4.0 + 0.006 * 0.006 + 3.8 * 3.8;
  EXPECT_NEAR(m.cosine, so / std::sqrt(s2 * o2), 1e-14);
  EXPECT_EQ(m.nan_count, 0);
  EXPECT_EQ(m.inf_count, 0);
}

TEST(Metrics, P95IsTheNearestRankNotTheMaximum) {
  // o = 1, Δᵢ = i/100 for i = 0..19: the 95th percentile (rank 19 of 20) is 0.18, max 0.19.
  std::vector<double> o(20, 1.0), s(20);
  for (int i = 0; i < 20; ++i) s[i] = 1.0 + i / 100.0;
  const Metrics m = compute_metrics(tensor({4, 5}, o), tensor({4, 5}, s), false);
  EXPECT_EQ(m.rel_count, 20);
  EXPECT_NEAR(m.p95_rel, 0.18, 1e-14);
  EXPECT_NEAR(m.max_rel, 0.19, 1e-14);
  EXPECT_EQ(m.worst_index, 19);
}

TEST(Metrics, IdenticalTensorsHaveZeroErrorAndUnitCosine) {
  const Tensor o = tensor({3}, {0.5, -1.5, 2.5});
  const Metrics m = compute_metrics(o, o, false);
  EXPECT_EQ(m.max_abs, 0.0);
  EXPECT_EQ(m.rel_l2, 0.0);
  EXPECT_EQ(m.p95_rel, 0.0);
  EXPECT_NEAR(m.cosine, 1.0, 1e-15);
  EXPECT_EQ(m.max_ulps, 0.0);
}

TEST(Metrics, ZeroOracleFallsBackToAbsoluteL2) {
  const Tensor o = tensor({2}, {0.0, 0.0});
  const Metrics exact = compute_metrics(o, o, false);
  EXPECT_TRUE(exact.rel_l2_absolute);
  EXPECT_EQ(exact.rel_l2, 0.0);
  EXPECT_EQ(exact.cosine, 1.0);
  const Metrics off = compute_metrics(o, tensor({2}, {3e-3, 4e-3}), false);
  EXPECT_TRUE(off.rel_l2_absolute);
  EXPECT_NEAR(off.rel_l2, 5e-3 / std::sqrt(2.0), 1e-15);  // rms(Δ)
  EXPECT_EQ(off.rel_count, 0);
  EXPECT_EQ(off.p95_rel, 0.0);
}

TEST(Metrics, OracleAtRoundOffLevelCountsAsZeroAndGetsAnAbsoluteBudget) {
  // A cancelling sum: 0 exactly, the oracle leaves 3e-15, the subject 1e-6.
  const Tensor o = tensor({4}, {3e-15, -1e-15, 0.0, 2e-15});
  const Tensor s = tensor({4}, {1e-6, 0.0, -1e-6, 0.0});
  const Metrics m = compute_metrics(o, s, false);
  EXPECT_TRUE(m.zero_oracle());
  EXPECT_TRUE(m.rel_l2_absolute);
  EXPECT_NEAR(m.rel_l2, std::sqrt(2e-12 / 4.0), 1e-12);
  const Budget b = make_budget(tolerance_table().front(), Precision::F32, m, nullptr);
  EXPECT_DOUBLE_EQ(b.max_abs, tolerance_table().front().f32.rel_max);  // · unit scale
  EXPECT_TRUE(judge(m, b).pass);
  // ... but an O(1) deviation of a zero tensor fails.
  const Metrics big = compute_metrics(o, tensor({4}, {0.5, 0.0, 0.0, 0.0}), false);
  EXPECT_FALSE(judge(big, make_budget(tolerance_table().front(), Precision::F32, big, nullptr)).pass);
}

TEST(Metrics, UlpsAreCountedInTheSubjectStoragePrecision) {
  // At o = 1 one f32 ulp is 2^-23, one bf16 ulp 2^-7.
  const Tensor o = tensor({1}, {1.0});
  const Tensor s = tensor({1}, {1.0 + 3 * std::ldexp(1.0, -23)});
  EXPECT_NEAR(compute_metrics(o, s, false, Precision::F32).max_ulps, 3.0, 1e-9);
  EXPECT_NEAR(compute_metrics(o, s, false, Precision::BF16).max_ulps, 3.0 / 65536.0, 1e-12);
}

// ulp_of builds 2^(exponent − mantissa bits) from the bits of max(|x|, min_normal(p)); it must
// equal the libm form ldexp(1, ilogb(·) − mantissa bits) for every precision and every kind of
// value: zero, below and at each format's smallest normal, ordinary, huge, ±inf, NaN (fmax
// takes min_normal), and f64's bottom, where 2^(e − 52) is subnormal.
TEST(Metrics, UlpOfEqualsTheLibmForm) {
  std::vector<double> xs = {0.0,     -0.0,    1.0,     -1.0,    0.75,   3.0e-39, 0x1p-126,
                            0x1p-14, 6.0e-5,  1e-300,  0x1p-1022, 0x1p-1000, 1e300, 65504.0,
                            -3.3e38, std::numeric_limits<double>::denorm_min(),
                            std::numeric_limits<double>::max(),
                            std::numeric_limits<double>::infinity(),
                            -std::numeric_limits<double>::infinity(),
                            std::numeric_limits<double>::quiet_NaN()};
  m3::Rng rng(99);
  for (int i = 0; i < 2000; ++i)
    xs.push_back(std::ldexp(rng.uniform(-1.0, 1.0), static_cast<int>(rng.uniform(-1100.0, 1100.0))));
  for (const Precision p : {Precision::F64, Precision::F32, Precision::BF16, Precision::F16})
    for (const double x : xs) {
      const double a = std::fmax(std::fabs(x), m3::harness::min_normal(p));
      const double want = std::isfinite(a)
                              ? std::ldexp(1.0, std::ilogb(a) - m3::harness::mantissa_bits(p))
                              : std::numeric_limits<double>::infinity();
      EXPECT_EQ(m3::harness::ulp_of(x, p), want) << "x = " << x << ", " << precision_name(p);
    }
}

TEST(Metrics, ShapeMismatchThrowsNamingBothShapes) {
  try {
    compute_metrics(tensor({2, 2}, {1, 2, 3, 4}), tensor({4}, {1, 2, 3, 4}), false);
    FAIL() << "expected m3::Error";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("[4]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[2, 2]"), std::string::npos) << e.what();
  }
}

// ---- NaN / Inf ------------------------------------------------------------------------------

TEST(Metrics, NanAndInfInTheSubjectAreCountedAndMakeErrorsInfinite) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor o = tensor({4}, {1.0, 2.0, 3.0, 4.0});
  const Metrics m = compute_metrics(o, tensor({4}, {1.0, nan, 3.0, -inf}), false);
  EXPECT_EQ(m.nan_count, 1);
  EXPECT_EQ(m.inf_count, 1);
  EXPECT_FALSE(m.finite());
  EXPECT_TRUE(std::isinf(m.max_abs));
  EXPECT_TRUE(std::isinf(m.rel_l2));
  EXPECT_EQ(m.worst_index, 1);  // the first non-finite element
  const Budget b = make_budget(tolerance_table().front(), Precision::F32, m, nullptr);
  EXPECT_FALSE(judge(m, b).pass);
}

TEST(Metrics, NonFiniteOracleIsCountedSeparately) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const Metrics m = compute_metrics(tensor({2}, {nan, 1.0}), tensor({2}, {nan, 1.0}), false);
  EXPECT_EQ(m.oracle_nonfinite, 1);
  EXPECT_EQ(m.nan_count, 0);
  EXPECT_FALSE(m.finite());
}

// ---- circular distance ----------------------------------------------------------------------

TEST(Circular, DistanceAcrossTheZeroTwoPiWrapIsSmall) {
  EXPECT_NEAR(circular_diff(kTwoPi - 0.01, 0.01), -0.02, 1e-12);
  EXPECT_NEAR(circular_diff(0.01, kTwoPi - 0.01), 0.02, 1e-12);
  EXPECT_NEAR(circular_diff(1.0, 0.5), 0.5, 1e-15);
  EXPECT_NEAR(circular_diff(0.5, 1.0), -0.5, 1e-15);
  EXPECT_LE(std::fabs(circular_diff(kTwoPi / 2 + 0.3, 0.3)), kTwoPi / 2 + 1e-15);

  const Tensor o = tensor({2}, {0.01, 3.0});
  const Tensor s = tensor({2}, {kTwoPi - 0.01, 3.0});
  const Metrics circ = compute_metrics(o, s, true);
  EXPECT_NEAR(circ.max_abs, 0.02, 1e-12);
  EXPECT_EQ(circ.worst_index, 0);
  EXPECT_GT(circ.cosine, 0.9999);
  const Metrics flat = compute_metrics(o, s, false);
  EXPECT_NEAR(flat.max_abs, kTwoPi - 0.02, 1e-12);
}

// ---- coordinate decoding --------------------------------------------------------------------

TEST(DecodeIndex, BtNhHdTensorNamesBatchTimeHeadAndChannel) {
  const Config cfg;  // nheads 16, headdim 16
  const Idx B = 2, T = 256;
  const std::vector<Sym> syms = {Sym::BT, Sym::NH, Sym::HD};
  const std::vector<Idx> shape = resolve_shape(syms, cfg, B, T);
  ASSERT_EQ(shape, (std::vector<Idx>{512, 16, 16}));
  const Idx r = 1 * T + 37;
  const Idx flat = (r * 16 + 3) * 16 + 5;
  EXPECT_EQ(decode_index(syms, shape, flat, cfg, B, T), "b=1 t=37 h=3 p=5");
  EXPECT_EQ(decode_index(syms, shape, flat, cfg, B, T, 2), "layer=2 b=1 t=37 h=3 p=5");
  EXPECT_EQ(unravel(flat, shape), (std::vector<Idx>{r, 3, 5}));
}

TEST(DecodeIndex, ChunkedAndChannelAxesNameTheirParts) {
  Config cfg;
  cfg.chunk_size = 64;
  const Idx B = 2, T = 200;  // 4 chunks, the last one padded
  const std::vector<Sym> chunked = {Sym::B, Sym::NC, Sym::NH, Sym::CS};
  const std::vector<Idx> cshape = resolve_shape(chunked, cfg, B, T);
  ASSERT_EQ(cshape, (std::vector<Idx>{2, 4, 16, 64}));
  const Idx flat = ((1 * 4 + 2) * 16 + 3) * 64 + 5;
  EXPECT_EQ(decode_index(chunked, cshape, flat, cfg, B, T), "b=1 c=2 h=3 tau=5 t=133");
  const Idx pad = ((0 * 4 + 3) * 16 + 0) * 64 + 60;  // t = 252 ≥ T
  EXPECT_EQ(decode_index(chunked, cshape, pad, cfg, B, T), "b=0 c=3 h=0 tau=60 (padding)");

  const std::vector<Sym> di = {Sym::BT, Sym::DI};
  const std::vector<Idx> dshape = resolve_shape(di, cfg, B, T);
  EXPECT_EQ(decode_index(di, dshape, 3 * 256 + 37, cfg, B, T), "b=0 t=3 d=37 h=2 p=5");

  const std::vector<Sym> h = {Sym::B, Sym::Tp1, Sym::DS, Sym::DI};
  const std::vector<Idx> hshape = resolve_shape(h, cfg, B, T);
  const Idx hflat = ((1 * (T + 1) + 200) * 16 + 7) * 256 + 37;
  EXPECT_EQ(decode_index(h, hshape, hflat, cfg, B, T), "b=1 t=200 n=7 d=37 h=2 p=5");

  // in_proj columns: z [0,256), x [256,512), b_raw [512,528), c_raw, dd_dt, dd_a, trap, angles
  const std::vector<Sym> ip = {Sym::BT, Sym::IP};
  const std::vector<Idx> ipshape = resolve_shape(ip, cfg, B, T);
  EXPECT_EQ(decode_index(ip, ipshape, 300, cfg, B, T), "b=0 t=0 j=300 (x h=2 p=12)");
  EXPECT_EQ(decode_index(ip, ipshape, 515, cfg, B, T), "b=0 t=0 j=515 (b_raw g=0 n=3)");

  // rank disagreement: a plain index list
  EXPECT_EQ(decode_index({Sym::BT}, {4, 5}, 7, cfg, B, T), "[1, 2]");
}

// ---- key filter -----------------------------------------------------------------------------

TEST(KeyFilter, SubstringGlobAndAlternatives) {
  EXPECT_TRUE(key_matches("L3/B6/d_x", ""));
  EXPECT_TRUE(key_matches("L3/B6/d_x", "B6"));
  EXPECT_FALSE(key_matches("L3/B6/d_x", "B5"));
  EXPECT_TRUE(key_matches("L3/B6/d_x", "L?/B6/*"));
  EXPECT_FALSE(key_matches("L3/B6/d_x", "B6/*"));  // a glob matches the whole key
  EXPECT_TRUE(key_matches("L3/B6/d_x", "L[0-3]/*"));
  EXPECT_FALSE(key_matches("L4/B6/d_x", "L[0-3]/*"));
  EXPECT_TRUE(key_matches("grad/L0/in_proj_w", "F6,grad/*"));
}

// ---- the budget rule ------------------------------------------------------------------------

TEST(Budget, LimitIsKTimesBaselinePlusFloor) {
  EXPECT_EQ(k_factor(Precision::F32), 2.0);
  EXPECT_EQ(k_factor(Precision::BF16), 3.0);
  EXPECT_EQ(k_factor(Precision::F16), 3.0);
  const ToleranceRow& row = find_tolerance("no-such-stage", "t", ScanMode::Sequential);
  EXPECT_EQ(std::string(row.stage), "*");
  Metrics subject, baseline;
  subject.oracle_scale = 4.0;
  baseline.rel_l2 = 1e-3;
  baseline.max_abs = 2e-3;
  const Budget b = make_budget(row, Precision::BF16, subject, &baseline);
  EXPECT_DOUBLE_EQ(b.rel_l2, 3 * 1e-3 + row.bf16.rel_l2);
  EXPECT_DOUBLE_EQ(b.max_abs, 3 * 2e-3 + row.bf16.rel_max * 4.0);

  // Deeper than the calibration depth: floors scale with n_layers / 4, never below 1.
  Config deep;
  deep.n_layers = 8;
  EXPECT_DOUBLE_EQ(depth_factor(deep), 2.0);
  deep.n_layers = 1;
  EXPECT_DOUBLE_EQ(depth_factor(deep), 1.0);
  const Budget b2 = make_budget(row, Precision::BF16, subject, &baseline, 2.0);
  EXPECT_DOUBLE_EQ(b2.rel_l2, 3 * 1e-3 + 2 * row.bf16.rel_l2);
  EXPECT_DOUBLE_EQ(b2.max_abs, 3 * 2e-3 + 2 * row.bf16.rel_max * 4.0);

  subject.rel_l2 = b.rel_l2;  // at the limit: passes, 100 %
  subject.max_abs = 0.5 * b.max_abs;
  Verdict v = judge(subject, b);
  EXPECT_TRUE(v.pass);
  EXPECT_NEAR(v.pct(), 100.0, 1e-9);
  EXPECT_NEAR(v.pct_max_abs, 50.0, 1e-9);
  subject.rel_l2 = 1.01 * b.rel_l2;
  v = judge(subject, b);
  EXPECT_FALSE(v.pass);
  EXPECT_GT(v.pct(), 100.0);
}

// Beside a same-precision baseline, the perturbed oracle's conditioning term: the limit is
// max(k · baseline, k_p · conditioning) + floor; a NaN term fails whatever the other says.
TEST(Budget, ConditioningTermIsTheLargerOfTheTwoBaselineTerms) {
  const ToleranceRow& row = tolerance_table().front();
  Metrics subject, baseline, cond;
  subject.oracle_scale = 2.0;
  baseline.rel_l2 = 1e-6;
  baseline.max_abs = 4e-6;
  cond.rel_l2 = 1e-7;  // below the emulation's term: the emulation decides rel_l2
  cond.max_abs = 1e-4;  // above it: the conditioning decides max_abs
  const Budget b = make_budget(row, Precision::F32, subject, &baseline, 1.0,
                               BaselineKind::SamePrecision, &cond);
  EXPECT_EQ(b.k, k_factor(Precision::F32));
  EXPECT_EQ(b.k_conditioning, kPerturbedKf32);
  EXPECT_DOUBLE_EQ(b.rel_l2, 2 * 1e-6 + row.f32.rel_l2);
  EXPECT_DOUBLE_EQ(b.max_abs, kPerturbedKf32 * 1e-4 + row.f32.rel_max * 2.0);
  const Budget plain = make_budget(row, Precision::F32, subject, &baseline);
  EXPECT_EQ(plain.k_conditioning, 0);
  EXPECT_DOUBLE_EQ(plain.max_abs, 2 * 4e-6 + row.f32.rel_max * 2.0);
  // bf16: k 3 on both sides.
  const Budget t = make_budget(row, Precision::BF16, subject, &baseline, 1.0,
                               BaselineKind::SamePrecision, &cond);
  EXPECT_EQ(t.k_conditioning, kPerturbedKTyped);
  EXPECT_DOUBLE_EQ(t.max_abs, kPerturbedKTyped * 1e-4 + row.bf16.rel_max * 2.0);
  cond.max_abs = std::numeric_limits<double>::quiet_NaN();
  const Budget bad = make_budget(row, Precision::F32, subject, &baseline, 1.0,
                                 BaselineKind::SamePrecision, &cond);
  EXPECT_FALSE(judge(subject, bad).pass);
}

// The tight rule (max(floor, kTightK · baseline)) holds on tensors of kTightMinElements values
// or more; a smaller one takes k · baseline + floor.
TEST(Budget, TightRowsAreTightOnLargeTensorsOnly) {
  const ToleranceRow* tight = nullptr;
  for (const ToleranceRow& r : tolerance_table())
    if (r.tight) tight = &r;
  ASSERT_NE(tight, nullptr) << "the isolated F6/y row is tight";
  Metrics subject, baseline;
  subject.oracle_scale = 1.0;
  baseline.rel_l2 = 1e-3;
  baseline.max_abs = 1e-3;
  subject.numel = kTightMinElements;
  const Budget big = make_budget(*tight, Precision::BF16, subject, &baseline, 1.0,
                                 BaselineKind::Perturbed);
  EXPECT_TRUE(big.tight);
  EXPECT_DOUBLE_EQ(big.rel_l2, std::max(kTightK * 1e-3, tight->bf16.rel_l2));
  subject.numel = kTightMinElements - 1;
  const Budget small = make_budget(*tight, Precision::BF16, subject, &baseline, 1.0,
                                   BaselineKind::Perturbed);
  EXPECT_FALSE(small.tight);
  EXPECT_DOUBLE_EQ(small.rel_l2, kPerturbedKTyped * 1e-3 + tight->bf16.rel_l2);
  // Without a perturbed baseline the row is an ordinary one whatever the size.
  subject.numel = 1 << 20;
  EXPECT_FALSE(make_budget(*tight, Precision::BF16, subject, &baseline).tight);
}

TEST(Budget, EveryTableRowHasPositiveFloorsAndEveryLooseningAReason) {
  const auto& table = tolerance_table();
  ASSERT_FALSE(table.empty());
  EXPECT_EQ(std::string(table.front().stage), "*");
  EXPECT_EQ(std::string(table.front().tensor), "*");
  for (const auto& r : table) {
    for (Precision p : {Precision::F32, Precision::BF16, Precision::F16}) {
      EXPECT_GT(floors_of(r, p).rel_l2, 0.0) << r.stage << "/" << r.tensor;
      EXPECT_GT(floors_of(r, p).rel_max, 0.0) << r.stage << "/" << r.tensor;
    }
    if (&r != &table.front()) {
      EXPECT_GT(std::string(r.reason).size(), 10u) << r.stage;
    }
  }
}

// ---- whole captures: negative controls on synthetic data ----------------------------------

Config tiny_cfg() {
  Config c;
  c.d_model = 8;
  c.expand = 2;
  c.headdim = 4;
  c.d_state = 4;
  c.n_layers = 2;
  c.input_dim = 8;
  c.chunk_size = 4;
  return c;
}

// Oracle capture with smooth deterministic values under every key of (cfg, B, T, mode).
Capture synthetic_oracle(const Config& cfg, Idx B, Idx T, ScanMode mode) {
  Capture cap(cfg, B, T);
  int salt = 0;
  auto fill = [&](const std::string& key, const std::vector<Idx>& shape) {
    Tensor t;
    t.shape = shape;
    std::vector<double> v(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < v.size(); ++i) v[i] = 0.5 + std::sin(0.37 * double(i) + salt);
    ++salt;
    cap.put(key, shape, v.data());
  };
  for (const auto& k : expected_stage_keys(cfg, B, T, mode)) fill(k.key, k.shape);
  for (const auto& k : expected_param_keys(cfg)) fill(k.key, k.shape);
  return cap;
}

// The oracle rounded to float: what a correct f32 subject looks like.
Capture rounded_to_float(const Capture& oracle, const Config& cfg, Idx B, Idx T) {
  Capture cap(cfg, B, T);
  for (const auto& k : oracle.keys()) {
    const Tensor& t = oracle.at(k);
    std::vector<float> f(t.data.begin(), t.data.end());
    cap.put(k, t.shape, f.data());
  }
  return cap;
}

void perturb(Capture& cap, const std::string& key, Idx index, double delta) {
  Tensor t = cap.at(key);
  t.data.at(static_cast<size_t>(index)) += delta;
  cap.put(key, t.shape, t.data.data());
}

// The summaries' "tightest passing" (report.cpp and report_json.cpp): the passing row with the
// largest share of its budget used, by the larger of its two shares, the first of equals;
// failing rows never count, and a cell with no passing row has none. largest_share (training's
// verification "worst") is the same over every row.
TEST(CompareResultRows, TightestPassingIsTheLargestShareAmongPassingRows) {
  auto row = [](const char* key, Status status, double pct_l2, double pct_max) {
    TensorResult t;
    t.key = key;
    t.status = status;
    t.verdict.pct_rel_l2 = pct_l2;
    t.verdict.pct_max_abs = pct_max;
    return t;
  };
  CompareResult r;
  EXPECT_EQ(r.tightest_passing(), nullptr) << "no rows";
  EXPECT_EQ(r.largest_share(), nullptr) << "no rows";
  r.rows = {row("a", Status::Pass, 10, 5), row("b", Status::OverBudget, 300, 0),
            row("c", Status::Pass, 2, 40), row("d", Status::Pass, 40, 1)};
  ASSERT_NE(r.tightest_passing(), nullptr);
  EXPECT_EQ(r.tightest_passing()->key, "c") << "40 % by max_abs, before d's equal 40 % by rel_l2";
  ASSERT_NE(r.largest_share(), nullptr);
  EXPECT_EQ(r.largest_share()->key, "b") << "a failing row counts there";
  r.rows[2].status = Status::OverBudget;
  ASSERT_NE(r.tightest_passing(), nullptr);
  EXPECT_EQ(r.tightest_passing()->key, "d");
  r.rows[0].status = r.rows[3].status = Status::NonFinite;
  EXPECT_EQ(r.tightest_passing(), nullptr) << "every row fails";
  r.rows[1].verdict.pct_rel_l2 = 40;
  ASSERT_NE(r.largest_share(), nullptr);
  EXPECT_EQ(r.largest_share()->key, "b") << "the first of b, c, d at 40 %";
}

class SyntheticCompare : public ::testing::TestWithParam<ScanMode> {
 protected:
  const Config cfg = tiny_cfg();
  const Idx B = 2, T = 6;
};

TEST_P(SyntheticCompare, FloatRoundedSubjectPassesEveryKey) {
  const Capture o = synthetic_oracle(cfg, B, T, GetParam());
  const Capture s = rounded_to_float(o, cfg, B, T);
  const CompareResult r = compare_captures(o, s, nullptr, cfg, B, T, GetParam());
  EXPECT_TRUE(r.pass()) << (r.pass() ? "" : r.rows[r.first_fail].key + ": " + r.rows[r.first_fail].note);
  EXPECT_EQ(r.rows.size(), expected_keys(cfg, B, T, GetParam()).size());
  EXPECT_TRUE(r.extra_keys.empty());
}

TEST_P(SyntheticCompare, PerturbedStageFailsAndIsNamedFirstInExecutionOrder) {
  const Capture o = synthetic_oracle(cfg, B, T, GetParam());
  Capture s = rounded_to_float(o, cfg, B, T);
  // Two wrong tensors: a backward one of layer 0 (late) and a forward one of layer 1 (early).
  perturb(s, "L0/B1/d_pre_norm", 3, 1e-3);
  perturb(s, "L1/F4/b_normed", 5, 1e-3);
  const CompareResult r = compare_captures(o, s, nullptr, cfg, B, T, GetParam());
  ASSERT_FALSE(r.pass());
  EXPECT_EQ(r.n_fail(), 2);
  EXPECT_EQ(r.rows[r.first_fail].key, "L1/F4/b_normed");
  EXPECT_EQ(r.rows[r.first_fail].status, Status::OverBudget);
  EXPECT_EQ(r.rows[r.first_fail].subject.worst_index, 5);
  EXPECT_EQ(r.rows[r.first_fail].worst_coords, "b=0 t=1 g=0 n=1");  // [BT, NG, DS]: 5 = (1·1+0)·4+1
  EXPECT_GT(r.rows[r.first_fail].verdict.pct(), 100.0);
}

TEST_P(SyntheticCompare, MissingSubjectKeyIsAFailureNotACrash) {
  const Capture o = synthetic_oracle(cfg, B, T, GetParam());
  const Capture full = rounded_to_float(o, cfg, B, T);
  Capture s(cfg, B, T);
  for (const auto& k : full.keys())
    if (k != "L1/F6/y") s.put(k, full.at(k).shape, full.at(k).data.data());
  const CompareResult r = compare_captures(o, s, nullptr, cfg, B, T, GetParam());
  ASSERT_FALSE(r.pass());
  EXPECT_EQ(r.n_fail(), 1);
  EXPECT_EQ(r.rows[r.first_fail].key, "L1/F6/y");
  EXPECT_EQ(r.rows[r.first_fail].status, Status::Missing);
}

TEST_P(SyntheticCompare, NanInASubjectTensorIsCountedAndFails) {
  const Capture o = synthetic_oracle(cfg, B, T, GetParam());
  Capture s = rounded_to_float(o, cfg, B, T);
  Tensor t = s.at("L0/B7/d_y");
  t.data[2] = std::numeric_limits<double>::quiet_NaN();
  s.put("L0/B7/d_y", t.shape, t.data.data());
  const CompareResult r = compare_captures(o, s, nullptr, cfg, B, T, GetParam());
  ASSERT_FALSE(r.pass());
  const TensorResult& bad = r.rows[r.first_fail];
  EXPECT_EQ(bad.key, "L0/B7/d_y");
  EXPECT_EQ(bad.status, Status::NonFinite);
  EXPECT_EQ(bad.subject.nan_count, 1);
}

TEST_P(SyntheticCompare, ShapeMismatchIsAFailureNamedAsSuch) {
  const Capture o = synthetic_oracle(cfg, B, T, GetParam());
  Capture s = rounded_to_float(o, cfg, B, T);
  const Tensor& t = s.at("grad/L1/d_param");
  std::vector<double> wider(t.data.begin(), t.data.end());
  wider.push_back(0.0);
  s.put("grad/L1/d_param", {static_cast<Idx>(wider.size())}, wider.data());
  const CompareResult r = compare_captures(o, s, nullptr, cfg, B, T, GetParam());
  ASSERT_FALSE(r.pass());
  EXPECT_EQ(r.rows[r.first_fail].key, "grad/L1/d_param");
  EXPECT_EQ(r.rows[r.first_fail].status, Status::ShapeMismatch);
}

TEST_P(SyntheticCompare, StageFilterKeepsOnlyMatchingKeys) {
  const Capture o = synthetic_oracle(cfg, B, T, GetParam());
  const Capture s = rounded_to_float(o, cfg, B, T);
  CompareOptions opt;
  opt.filter = "L1/F4/*";
  const CompareResult r = compare_captures(o, s, nullptr, cfg, B, T, GetParam(), opt);
  ASSERT_FALSE(r.rows.empty());
  for (const auto& row : r.rows) EXPECT_EQ(row.key.rfind("L1/F4/", 0), 0u) << row.key;
}

INSTANTIATE_TEST_SUITE_P(Modes, SyntheticCompare,
                         ::testing::Values(ScanMode::Sequential, ScanMode::Chunked),
                         [](const auto& info) { return std::string(scan_mode_name(info.param)); });

// ---- the real reference: float passes the double oracle; a wrong stage does not -----------

class ReferenceCompare : public ::testing::TestWithParam<ScanMode> {};

TEST_P(ReferenceCompare, FloatReferencePassesAndAPerturbedStageFails) {
  Config cfg;
  cfg.d_model = 32;
  cfg.headdim = 8;
  cfg.d_state = 8;
  cfg.n_layers = 2;
  cfg.input_dim = 32;
  cfg.chunk_size = 16;
  const Idx B = 2, T = 45;  // 3 chunks, the last one partial
  const Problem pb = make_problem(cfg, B, T, 77, true);
  const ScanMode mode = GetParam();
  const Capture o = run_reference<double>(pb, mode);
  Capture s = run_reference<float>(pb, mode);

  const CompareResult good = compare_captures(o, s, nullptr, cfg, B, T, mode);
  EXPECT_TRUE(good.pass()) << (good.pass() ? ""
                                           : good.rows[good.first_fail].key + ": " +
                                                 good.rows[good.first_fail].note);
  EXPECT_EQ(good.rows.size(), expected_keys(cfg, B, T, mode).size());

  // A systematic error of 1e-4 relative on one whole tensor (far below what a real indexing bug
  // gives, above the float noise) must fail, and be the first failure.
  const std::string key = "L1/B6/d_x";
  Tensor t = s.at(key);
  for (double& v : t.data) v *= 1.0 + 1e-4;
  s.put(key, t.shape, t.data.data());
  const CompareResult bad = compare_captures(o, s, nullptr, cfg, B, T, mode);
  ASSERT_FALSE(bad.pass());
  EXPECT_EQ(bad.rows[bad.first_fail].key, key);
  EXPECT_EQ(bad.n_fail(), 1);
}

// The calibration case itself: the default preset must pass with headroom, and wrong tensors of
// realistic bug sizes must fail and be named first. An angle off by exactly 2π is not wrong.
TEST_P(ReferenceCompare, DefaultPresetPassesWithHeadroomAndWrongTensorsFail) {
  const Preset& p = find_preset("default");
  ASSERT_EQ(p.cfg.d_model, 128);
  ASSERT_EQ(p.cfg.n_layers, 4);
  const ScanMode mode = GetParam();
  const Problem pb = make_problem(p.cfg, p.B, p.T, p.seed, p.random_states);
  const Capture o = run_reference<double>(pb, mode);
  const Capture s = run_reference<float>(pb, mode);

  const CompareResult good = compare_captures(o, s, nullptr, p.cfg, p.B, p.T, mode);
  ASSERT_TRUE(good.pass()) << good.rows[good.first_fail].key << ": "
                           << good.rows[good.first_fail].note;
  double worst = 0;
  for (const auto& r : good.rows) worst = std::max(worst, r.verdict.pct());
  EXPECT_LT(worst, 75.0) << "the f32 floors leave too little headroom on the default preset";

  // Every other key is unchanged (and passes above), so each wrong tensor is compared alone.
  Capture bad = s;
  auto compare_with = [&](const std::string& key, auto&& edit) {
    const Tensor original = bad.at(key);
    Tensor t = original;
    edit(t.data);
    bad.put(key, t.shape, t.data.data());
    CompareOptions opt;
    opt.filter = key;
    CompareResult r = compare_captures(o, bad, nullptr, p.cfg, p.B, p.T, mode, opt);
    bad.put(key, original.shape, original.data.data());
    EXPECT_EQ(r.rows.size(), 1u) << key;
    return r;
  };
  // One element of y off by 1 % (an off-by-one at a chunk edge, a dropped term).
  const CompareResult one = compare_with("L2/F6/y", [](std::vector<double>& v) {
    v[v.size() / 3] *= 1.01;
  });
  ASSERT_FALSE(one.pass());
  EXPECT_EQ(one.rows[one.first_fail].key, "L2/F6/y");
  // A whole gradient off by 1e-4 relative (a wrong constant, a lost ε).
  const CompareResult scaled = compare_with("L1/B6/d_x", [](std::vector<double>& v) {
    for (double& x : v) x *= 1.0 + 1e-4;
  });
  ASSERT_FALSE(scaled.pass());
  EXPECT_EQ(scaled.rows[scaled.first_fail].key, "L1/B6/d_x");
  // A parameter gradient off by 1e-4 relative.
  const CompareResult grad = compare_with("grad/L0/dt_bias", [](std::vector<double>& v) {
    for (double& x : v) x *= 1.0 + 1e-4;
  });
  ASSERT_FALSE(grad.pass());
  EXPECT_EQ(grad.rows[grad.first_fail].key, "grad/L0/dt_bias");
  // θ one full turn off is the same angle; 1e-3 rad off is not.
  const CompareResult turn = compare_with("L0/F5/angle_cumsum", [](std::vector<double>& v) {
    v[7] += kTwoPi;
  });
  EXPECT_TRUE(turn.pass()) << turn.rows[turn.first_fail].note;
  const CompareResult off = compare_with("L0/F5/angle_cumsum", [](std::vector<double>& v) {
    v[7] += 1e-3;
  });
  ASSERT_FALSE(off.pass());
  EXPECT_EQ(off.rows[off.first_fail].key, "L0/F5/angle_cumsum");
}

INSTANTIATE_TEST_SUITE_P(Modes, ReferenceCompare,
                         ::testing::Values(ScanMode::Sequential, ScanMode::Chunked),
                         [](const auto& info) { return std::string(scan_mode_name(info.param)); });

}  // namespace
}  // namespace m3::harness

// ---- the error against position (position.hpp) --------------------------------------------------

TEST(PositionProfile, MaxAndRelL2PerPositionOverBatchAndTrailingAxes) {
  // B = 2, T = 3, rows of 2: oracle 1 everywhere, the subject off by 0.5 at (b 1, t 2, i 1)
  // and by 0.25 at (b 0, t 0, i 0) (exact in binary).
  m3::Tensor o{{6, 2}, std::vector<double>(12, 1.0)};
  m3::Tensor s = o;
  s.data[(1 * 3 + 2) * 2 + 1] += 0.5;
  s.data[0] += 0.25;
  const m3::harness::PositionProfile p = m3::harness::position_profile(s, o, 2, 3, false);
  ASSERT_EQ(p.max_abs.size(), 3u);
  EXPECT_DOUBLE_EQ(p.max_abs[0], 0.25);
  EXPECT_DOUBLE_EQ(p.max_abs[1], 0.0);
  EXPECT_DOUBLE_EQ(p.max_abs[2], 0.5);
  EXPECT_DOUBLE_EQ(p.rel_l2[2], 0.5 / 2.0);  // ‖Δ_t‖ = 0.5 over 4 ones: ‖o_t‖ = 2
  EXPECT_DOUBLE_EQ(p.rel_l2[1], 0.0);
  // Angles by circular distance: 2π − 0.01 against 0.01 is 0.02 apart, not 6.26.
  m3::Tensor a{{2, 1}, {0.01, 1.0}}, b{{2, 1}, {6.283185307179586 - 0.01, 1.0}};
  const m3::harness::PositionProfile c = m3::harness::position_profile(b, a, 1, 2, true);
  EXPECT_NEAR(c.max_abs[0], 0.02, 1e-12);
  EXPECT_THROW(m3::harness::position_profile(s, m3::Tensor{{12}, std::vector<double>(12, 1.0)}, 2, 3,
                                             false),
               m3::Error);
  EXPECT_THROW(m3::harness::position_profile(o, o, 4, 3, false), m3::Error);
}

TEST(PositionProfile, PrintsOneLinePerChunkMarkingItsFirstPosition) {
  m3::harness::PositionProfile p;
  for (int t = 0; t < 10; ++t) {
    p.max_abs.push_back(t == 4 ? 9.0 : 1.0);
    p.rel_l2.push_back(0.1 * (t + 1));
  }
  std::ostringstream os;
  m3::harness::print_position_profile(os, "x", p, 4);
  const std::string out = os.str();
  EXPECT_NE(out.find("per chunk of 4"), std::string::npos) << out;
  EXPECT_NE(out.find("t      0-3 "), std::string::npos) << out;
  EXPECT_NE(out.find("t      8-9 "), std::string::npos) << out;
  EXPECT_NE(out.find("max_abs 9.000e+00 (t 4)"), std::string::npos) << out;
  EXPECT_NE(out.find("|t 4: max_abs 9.000e+00"), std::string::npos) << out;
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 4);  // the title and three chunks
}

// ---- determinism at CI scale: the repeat runner's loop (harness/determinism.hpp) -------------

namespace {
m3::harness::RepeatRunner fake_runner(const m3::Problem& pb, m3::ScanMode mode, int diverge_at,
                                      size_t diverge_key, int* calls) {
  m3::harness::RepeatRunner r;
  r.keys = m3::harness::expected_keys(pb.cfg, pb.B, pb.T, mode, true);
  r.run = [=, n = r.keys.size()](m3::Capture* cap) {
    const int call = (*calls)++;
    if (cap) *cap = m3::run_reference<float>(pb, mode);
    std::vector<std::uint64_t> d(n, 7);
    if (call == diverge_at) d[diverge_key] = 8;
    return d;
  };
  return r;
}
}  // namespace

TEST(DeterminismRepeat, IdenticalRunsGiveTheDigestOfTheCapturePath) {
  m3::Config cfg = m3::test::small_cfg();
  const m3::Problem pb = m3::make_problem(cfg, 1, 9, 3, true);
  int calls = 0;
  const auto fast = m3::harness::check_determinism_repeat(
      fake_runner(pb, m3::ScanMode::Chunked, -1, 0, &calls), pb, m3::ScanMode::Chunked, 5);
  const auto slow = m3::harness::check_determinism(
      [](const m3::Problem& p, m3::ScanMode m) { return m3::run_reference<float>(p, m); }, pb,
      m3::ScanMode::Chunked, 2);
  EXPECT_TRUE(fast.identical);
  EXPECT_EQ(calls, 5);
  EXPECT_EQ(fast.digest, slow.digest) << "the printed digest must not depend on the path";
  EXPECT_EQ(fast.tensors, slow.tensors);
}

TEST(DeterminismRepeat, ADigestThatDiffersNamesItsKeyAndTheRun) {
  m3::Config cfg = m3::test::small_cfg();
  const m3::Problem pb = m3::make_problem(cfg, 1, 9, 3, true);
  int calls = 0;
  const auto runner = fake_runner(pb, m3::ScanMode::Sequential, 3, 11, &calls);
  const auto r = m3::harness::check_determinism_repeat(runner, pb, m3::ScanMode::Sequential, 10);
  EXPECT_FALSE(r.identical);
  EXPECT_EQ(r.first_run, 3);
  EXPECT_EQ(r.first_key, runner.keys[11]);
  EXPECT_EQ(calls, 4) << "the loop stops at the first divergence";
}
