// The device comparer (gpu/compare_gpu.hpp) against the host definitions it mirrors:
//
//   DeviceMetrics      metrics(full) = harness::compute_metrics, metrics(norms) =
//                      harness::error_norms, for every subject ValueType (bf16/f16 rounded on
//                      the host to nearest-even, then widened: both sides see the stored values),
//                      n ∈ {0, 1, 7, 1000, 2²⁰ + 3}, plain and circular; then the edge cases:
//                      zero oracle, R partial and empty, NaN/Inf in the subject, NaN/Inf in the
//                      oracle, ties for the worst value across blocks, an angle difference that
//                      overflows (NaN |Δ|), both tensors zero for the cosine, an f32 oracle
//   DevicePosition     position_profile = harness::position_profile
//   DeviceCondition    abs_dev and condition = CellJudge::condition's rule written out here
//   DeviceDeterminism  two calls give the same bits
//   DevicePlacement    a Place::Host buffer (page-locked, mapped) takes copies, abs_dev's
//                      output and metrics' reads as a device buffer does, the same bits
//   DeviceArguments    wrong sizes and shapes are one-line m3::Errors
//   CompareAvailability (every build, no device needed) compare_unavailable() is "" exactly
//                      when a comparer can start
// Exact figures (max_abs, worst index and values, oracle_scale, p95_rel, max_rel, max_ulps,
// the counts) must equal the host's bit for bit; the sums (oracle_l2, diff_l2, rel_l2, cosine,
// mean_ulps, the rest sums, rel_l2 per position) are added in another order and must agree
// within kSumRel relative. Every device test skips, saying why, without a usable device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "compare_gpu.hpp"
#include "error.hpp"
#include "metrics.hpp"
#include "position.hpp"
#include "precision.hpp"

namespace m3::gpu {
namespace {

using harness::Metrics;

constexpr double kSumRel = 1e-12;
constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

#define M3_SKIP_WITHOUT_DEVICE()                                     \
  do {                                                               \
    const std::string why_ = compare_unavailable();                  \
    if (!why_.empty()) GTEST_SKIP() << why_;                         \
  } while (0)

// ---- host data and its device copy -------------------------------------------------------

Precision precision_of(ValueType t) {
  switch (t) {
    case ValueType::F64: return Precision::F64;
    case ValueType::F32: return Precision::F32;
    case ValueType::BF16: return Precision::BF16;
    case ValueType::F16: return Precision::F16;
  }
  return Precision::F32;
}

// Values stored as type t on the device; `stored` are the same values widened back to double
// (what the host metrics see).
struct DeviceTensor {
  DeviceBuffer buffer;
  DeviceValues values;
  std::vector<double> stored;
};

DeviceTensor to_device(DeviceComparer& cmp, const std::vector<double>& x, ValueType t) {
  DeviceTensor d;
  const std::size_t n = x.size();
  d.stored.resize(n);
  std::vector<unsigned char> raw;
  auto put = [&raw](const void* p, std::size_t bytes) {
    const auto* b = static_cast<const unsigned char*>(p);
    raw.insert(raw.end(), b, b + bytes);
  };
  for (std::size_t i = 0; i < n; ++i) {
    switch (t) {
      case ValueType::F64:
        d.stored[i] = x[i];
        put(&x[i], sizeof(double));
        break;
      case ValueType::F32: {
        const float f = static_cast<float>(x[i]);
        d.stored[i] = f;
        put(&f, sizeof f);
        break;
      }
      case ValueType::BF16: {
        const std::uint16_t h = float_to_bf16_bits(static_cast<float>(x[i]));
        d.stored[i] = bf16_bits_to_float(h);
        put(&h, sizeof h);
        break;
      }
      case ValueType::F16: {
        const std::uint16_t h = float_to_f16_bits(static_cast<float>(x[i]));
        d.stored[i] = f16_bits_to_float(h);
        put(&h, sizeof h);
        break;
      }
    }
  }
  d.buffer = DeviceBuffer(raw.size());
  cmp.upload(d.buffer.data(), raw.data(), raw.size());
  d.values = {d.buffer.data(), t, static_cast<Idx>(n)};
  return d;
}

Tensor host_tensor(const std::vector<double>& x) {
  Tensor t;
  t.shape = {static_cast<Idx>(x.size())};
  t.data = x;
  return t;
}

// An oracle with a fifth of its values below the relative threshold (R partial), and a subject
// off by a relative 1e-3 (then rounded to its storage type). Angles: the oracle in [0, 2π), the
// subject moved by up to ±0.05 and wrapped, so some pairs straddle 0 and 2π.
struct Pair {
  std::vector<double> oracle, subject;
};

Pair random_pair(std::size_t n, bool circular, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  Pair p;
  p.oracle.resize(n);
  p.subject.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    if (circular) {
      const double o = kTwoPi * unit(rng);
      double s = o + 0.05 * (2 * unit(rng) - 1);
      if (s < 0) s += kTwoPi;
      if (s >= kTwoPi) s -= kTwoPi;
      p.oracle[i] = o;
      p.subject[i] = s;
    } else {
      const double scale = unit(rng) < 0.2 ? 1e-4 : 1.0;
      const double o = scale * normal(rng);
      p.oracle[i] = o;
      p.subject[i] = o * (1 + 1e-3 * normal(rng)) + 1e-7 * normal(rng);
    }
  }
  return p;
}

// ---- comparisons -------------------------------------------------------------------------

bool same(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

bool near(double a, double b) {
  if (same(a, b)) return true;
  return std::fabs(a - b) <= kSumRel * std::max(std::fabs(a), std::fabs(b));
}

#define EXPECT_SAME(dev, host, field) \
  EXPECT_PRED2(same, (dev).field, (host).field) << #field << " of " << label
#define EXPECT_NEAR_SUM(dev, host, field) \
  EXPECT_PRED2(near, (dev).field, (host).field) << #field << " of " << label

void expect_metrics(const DeviceMetrics& d, const Metrics& h, const std::string& label) {
  EXPECT_EQ(d.numel, h.numel) << label;
  EXPECT_SAME(d, h, max_abs);
  EXPECT_EQ(d.worst_index, h.worst_index) << label;
  EXPECT_SAME(d, h, worst_oracle);
  EXPECT_SAME(d, h, worst_subject);
  EXPECT_SAME(d, h, oracle_scale);
  EXPECT_NEAR_SUM(d, h, oracle_l2);
  EXPECT_NEAR_SUM(d, h, diff_l2);
  EXPECT_NEAR_SUM(d, h, rel_l2);
  EXPECT_EQ(d.rel_l2_absolute, h.rel_l2_absolute) << label;
  EXPECT_SAME(d, h, p95_rel);
  EXPECT_SAME(d, h, max_rel);
  EXPECT_EQ(d.rel_count, h.rel_count) << label;
  EXPECT_NEAR_SUM(d, h, cosine);
  EXPECT_SAME(d, h, max_ulps);
  EXPECT_NEAR_SUM(d, h, mean_ulps);
  EXPECT_EQ(d.nan_count, h.nan_count) << label;
  EXPECT_EQ(d.inf_count, h.inf_count) << label;
  EXPECT_EQ(d.oracle_nonfinite, h.oracle_nonfinite) << label;
}

// Both figures sets (full and norms) of the device against the host, for stored values.
void expect_both(DeviceComparer& cmp, const DeviceTensor& o, const DeviceTensor& s, bool circular,
                 const std::string& label) {
  const Precision storage = precision_of(s.values.type);
  const Tensor ho = host_tensor(o.stored), hs = host_tensor(s.stored);
  expect_metrics(cmp.metrics(o.values, s.values, circular, storage, true),
                 harness::compute_metrics(ho, hs, circular, storage), label + " (full)");
  expect_metrics(cmp.metrics(o.values, s.values, circular, storage, false),
                 harness::error_norms(ho, hs, circular), label + " (norms)");
}

void expect_case(DeviceComparer& cmp, const std::vector<double>& oracle,
                 const std::vector<double>& subject, ValueType subject_type, bool circular,
                 const std::string& label) {
  const DeviceTensor o = to_device(cmp, oracle, ValueType::F64);
  const DeviceTensor s = to_device(cmp, subject, subject_type);
  expect_both(cmp, o, s, circular, label);
}

// ---- metrics over types × sizes × circular -----------------------------------------------

struct MetricsCase {
  ValueType type;
  std::size_t n;
  bool circular;
};

std::string case_name(const MetricsCase& c) {
  return std::string(value_type_name(c.type)) + "_n" + std::to_string(c.n) +
         (c.circular ? "_circular" : "");
}

void PrintTo(const MetricsCase& c, std::ostream* os) { *os << case_name(c); }

class DeviceMetricsSweep : public ::testing::TestWithParam<MetricsCase> {};

TEST_P(DeviceMetricsSweep, EqualsTheHostMetrics) {
  M3_SKIP_WITHOUT_DEVICE();
  const MetricsCase c = GetParam();
  DeviceComparer cmp;
  const Pair p = random_pair(c.n, c.circular, 1234 + c.n);
  expect_case(cmp, p.oracle, p.subject, c.type, c.circular, "random");
}

std::vector<MetricsCase> sweep_cases() {
  std::vector<MetricsCase> out;
  for (ValueType t : {ValueType::F64, ValueType::F32, ValueType::BF16, ValueType::F16})
    for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000},
                          (std::size_t{1} << 20) + 3})
      for (bool circular : {false, true}) out.push_back({t, n, circular});
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    TypesSizes, DeviceMetricsSweep, ::testing::ValuesIn(sweep_cases()),
    [](const ::testing::TestParamInfo<MetricsCase>& info) { return case_name(info.param); });

// ---- metrics: edge cases -----------------------------------------------------------------

TEST(DeviceMetrics, ZeroOracleFallsBackToRmsLikeTheHost) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const std::size_t n = 5000;
  std::vector<double> zero(n, 0.0), tiny(n), subject(n);
  std::mt19937_64 rng(7);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (std::size_t i = 0; i < n; ++i) {
    tiny[i] = 1e-12 * normal(rng);
    subject[i] = 1e-3 * normal(rng);
  }
  for (ValueType t : {ValueType::F32, ValueType::BF16}) {
    expect_case(cmp, zero, subject, t, false, "zero oracle");
    expect_case(cmp, tiny, subject, t, false, "oracle below 1e-10");
    expect_case(cmp, zero, zero, t, false, "both zero (cosine 1)");
    expect_case(cmp, subject, zero, t, false, "zero subject (cosine 0)");
  }
}

TEST(DeviceMetrics, RelativeSetPartialAndEmpty) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const std::size_t n = 70001;
  Pair p = random_pair(n, false, 99);
  expect_case(cmp, p.oracle, p.subject, ValueType::F32, false, "R partial");
  for (std::size_t i = 0; i < n; ++i) {  // every |o| below 1e-2: R empty
    p.oracle[i] *= 1e-3;
    p.subject[i] *= 1e-3;
  }
  for (double& o : p.oracle) o = std::clamp(o, -0.0099, 0.0099);
  expect_case(cmp, p.oracle, p.subject, ValueType::F32, false, "R empty");
  // Exactly at the threshold (in R) and just below it.
  std::vector<double> o = {1e-2, -1e-2, std::nextafter(1e-2, 0.0), 0.5};
  std::vector<double> s = {1.1e-2, -0.9e-2, 2e-2, 0.5};
  expect_case(cmp, o, s, ValueType::F64, false, "threshold");
}

TEST(DeviceMetrics, NonFiniteSubjectReadsInfiniteAndNamesTheFirst) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const std::size_t n = (std::size_t{1} << 18) + 11;
  Pair p = random_pair(n, false, 5);
  p.subject[200000] = kNaN;
  p.subject[70000] = kInf;
  p.subject[250000] = -kInf;
  p.subject[3] = kNaN;
  for (ValueType t : {ValueType::F32, ValueType::F16, ValueType::BF16})
    for (bool circular : {false, true})
      expect_case(cmp, p.oracle, p.subject, t, circular, "NaN and Inf in the subject");
  // A subject that overflows f16 (65504) reads Inf where the oracle is finite.
  std::vector<double> o = {1.0, 7e4, 2.0}, s = {1.0, 7e4, 2.5};
  expect_case(cmp, o, s, ValueType::F16, false, "f16 overflow");
}

TEST(DeviceMetrics, NonFiniteOracleIsCountedAndLeftOut) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const std::size_t n = 100003;
  Pair p = random_pair(n, false, 11);
  p.oracle[0] = kNaN;
  p.oracle[50000] = kInf;
  p.oracle[n - 1] = kNaN;
  p.subject[50000] = kNaN;  // not counted: its oracle is not finite
  expect_case(cmp, p.oracle, p.subject, ValueType::F32, false, "NaN and Inf in the oracle");
  std::vector<double> all_nan(9, kNaN), some(9, 1.0);
  expect_case(cmp, all_nan, some, ValueType::F32, false, "every oracle value NaN");
}

TEST(DeviceMetrics, TiesForTheWorstValueGoToTheLowestIndex) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const std::size_t n = (std::size_t{1} << 20) + 3;
  Pair p = random_pair(n, false, 21);
  // |Δ| = 10 exactly at indices in different blocks and threads, the lowest not first in any
  // thread's stride; the host keeps the first.
  for (std::size_t i : {std::size_t{900001}, std::size_t{263}, std::size_t{600000},
                        std::size_t{262401}, n - 1}) {
    p.oracle[i] = 1.0;
    p.subject[i] = 11.0;
  }
  expect_case(cmp, p.oracle, p.subject, ValueType::F32, false, "ties");
  // Two Inf subjects and an overflowing difference: all +Inf, the first wins.
  std::vector<double> o = {1.0, 1e308, 2.0, 3.0}, s = {1.0, -1e308, kInf, kNaN};
  expect_case(cmp, o, s, ValueType::F64, false, "Inf ties");
}

TEST(DeviceMetrics, AnAngleDifferenceThatOverflowsIsNaNOnlyWhenFirst) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  // remainder(−Inf, 2π) is NaN: the host keeps a NaN |Δ| only as its first value.
  std::vector<double> o = {1e308, 1.0, 2.0, 1e308}, s = {-1e308, 1.5, 2.0, -1e308};
  expect_case(cmp, o, s, ValueType::F64, true, "NaN |Δ| first");
  o[0] = 0.5;
  s[0] = 0.25;
  expect_case(cmp, o, s, ValueType::F64, true, "NaN |Δ| later");
  o = {kNaN, 1e308, 1.0}, s = {1.0, -1e308, kNaN};
  expect_case(cmp, o, s, ValueType::F64, true, "NaN |Δ| first with a finite oracle");
}

TEST(DeviceMetrics, AnF32OracleAndAnF64Subject) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const Pair p = random_pair(4099, false, 31);
  const DeviceTensor o = to_device(cmp, p.oracle, ValueType::F32);
  const DeviceTensor s = to_device(cmp, p.subject, ValueType::F64);
  expect_both(cmp, o, s, false, "f32 oracle");
}

// ---- position profile --------------------------------------------------------------------

TEST(DevicePosition, EqualsTheHostProfile) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  struct Shape {
    Idx B, T, row;
  };
  for (const Shape sh : {Shape{3, 37, 5}, Shape{1, 1, 1000}, Shape{2, 5000, 1},
                         Shape{8, 64, 300}, Shape{2, 3, 0}})
    for (bool circular : {false, true})
      for (ValueType t : {ValueType::F32, ValueType::BF16}) {
        const std::size_t n = static_cast<std::size_t>(sh.B * sh.T * sh.row);
        Pair p = random_pair(n, circular, 41 + n);
        if (n > 10) {
          p.subject[n / 2] = kNaN;  // the host's max leaves a NaN, its sums take it
          p.subject[n / 3] = kInf;
          p.oracle[1] = 0;
        }
        const DeviceTensor o = to_device(cmp, p.oracle, ValueType::F64);
        const DeviceTensor s = to_device(cmp, p.subject, t);
        Tensor ho, hs;
        ho.shape = hs.shape = {sh.B * sh.T, sh.row};
        ho.data = o.stored;
        hs.data = s.stored;
        const harness::PositionProfile host =
            harness::position_profile(hs, ho, sh.B, sh.T, circular);
        std::vector<double> max_abs, rel_l2;
        cmp.position_profile(o.values, s.values, sh.B, sh.T, circular, &max_abs, &rel_l2);
        const std::string label = "B " + std::to_string(sh.B) + " T " + std::to_string(sh.T) +
                                  " row " + std::to_string(sh.row) + " " +
                                  value_type_name(t) + (circular ? " circular" : "");
        ASSERT_EQ(max_abs.size(), host.max_abs.size()) << label;
        ASSERT_EQ(rel_l2.size(), host.rel_l2.size()) << label;
        for (std::size_t k = 0; k < max_abs.size(); ++k) {
          EXPECT_PRED2(same, max_abs[k], host.max_abs[k]) << label << " t " << k;
          EXPECT_PRED2(near, rel_l2[k], host.rel_l2[k]) << label << " t " << k;
        }
      }
}

// ---- abs_dev and condition ---------------------------------------------------------------

std::vector<float> download_floats(DeviceComparer& cmp, const DeviceBuffer& b, std::size_t n) {
  std::vector<float> out(n);
  cmp.download(out.data(), b.data(), n * sizeof(float));
  return out;
}

TEST(DeviceCondition, AbsDevIsTheRoundedDistance) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const std::size_t n = 100007;
  for (bool circular : {false, true})
    for (ValueType t : {ValueType::F64, ValueType::F32, ValueType::BF16, ValueType::F16}) {
      Pair p = random_pair(n, circular, 51);
      p.subject[17] = kNaN;
      p.subject[18] = kInf;
      const DeviceTensor ref = to_device(cmp, p.oracle, ValueType::F64);
      const DeviceTensor x = to_device(cmp, p.subject, t);
      DeviceBuffer dst(n * sizeof(float));
      cmp.abs_dev(ref.values, x.values, circular, static_cast<float*>(dst.data()));
      const std::vector<float> got = download_floats(cmp, dst, n);
      std::size_t wrong = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const double d = circular ? harness::circular_diff(x.stored[i], ref.stored[i])
                                  : x.stored[i] - ref.stored[i];
        const float want = static_cast<float>(std::fabs(d));
        if (!((std::isnan(want) && std::isnan(got[i])) || want == got[i])) ++wrong;
      }
      EXPECT_EQ(wrong, 0u) << value_type_name(t) << (circular ? " circular" : "");
    }
}

// CellJudge::condition's rule, on the host.
ConditionSums host_condition(const std::vector<double>& ref,
                             const std::vector<std::vector<float>>& devs,
                             const std::vector<std::vector<float>>& rest, double u, double from) {
  const std::size_t n = ref.size();
  ConditionSums out;
  std::vector<char> ill(n, 0);
  for (std::size_t k = 0; k < n; ++k) {
    double s = 0;
    for (const auto& d : devs) s = std::max(s, static_cast<double>(d[k]));
    if (!(s > 0)) continue;
    const double a = std::fabs(ref[k]);
    const double kappa = a > 0 ? s / (u * a) : kInf;
    if (kappa >= from) {
      ill[k] = 1;
      ++out.n_ill;
      out.kmax = std::max(out.kmax, kappa);
    }
  }
  for (const auto& a : rest) {
    RestSums r;
    for (std::size_t k = 0; k < n; ++k) {
      const double v = a[k];
      if (ill[k] || !std::isfinite(v)) continue;
      r.d2 += v * v;
      r.max = std::max(r.max, v);
      ++r.pairs;
    }
    out.rest.push_back(r);
  }
  return out;
}

TEST(DeviceCondition, IllValuesAndTheRestEqualTheHostRule) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const double u = 0x1p-8;  // bf16
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{33}, std::size_t{70001},
                        (std::size_t{1} << 20) + 5})
    for (std::size_t n_devs : {std::size_t{0}, std::size_t{1}, std::size_t{4}}) {
      std::mt19937_64 rng(61 + n + n_devs);
      std::normal_distribution<double> normal(0.0, 1.0);
      std::uniform_real_distribution<double> unit(0.0, 1.0);
      std::vector<double> ref(n);
      for (double& r : ref) r = unit(rng) < 0.05 ? 1e-4 * normal(rng) : normal(rng);
      if (n > 20) {
        ref[3] = 0;      // κ = +Inf where s > 0
        ref[4] = kNaN;   // |ref| not > 0: +Inf
      }
      std::vector<std::vector<float>> devs(n_devs, std::vector<float>(n)),
          rest(2, std::vector<float>(n));
      for (auto& d : devs)
        for (std::size_t k = 0; k < n; ++k)
          d[k] = static_cast<float>(std::fabs(ref[k]) * 0x1p-8 * std::fabs(normal(rng)) +
                                    1e-6 * std::fabs(normal(rng)));
      for (auto& a : rest)
        for (float& v : a) v = static_cast<float>(std::fabs(1e-3 * normal(rng)));
      if (n > 20) {
        for (auto& d : devs) {
          d[5] = std::numeric_limits<float>::quiet_NaN();  // left by the max
          d[6] = 0;
        }
        rest[0][7] = std::numeric_limits<float>::infinity();  // not finite: left out
        rest[1][8] = std::numeric_limits<float>::quiet_NaN();
      }
      std::vector<DeviceBuffer> dev_bufs, rest_bufs;
      std::vector<const float*> dev_ptrs, rest_ptrs;
      for (const auto& d : devs) {
        dev_bufs.emplace_back(n * sizeof(float));
        cmp.upload(dev_bufs.back().data(), d.data(), n * sizeof(float));
        dev_ptrs.push_back(static_cast<const float*>(dev_bufs.back().data()));
      }
      for (const auto& a : rest) {
        rest_bufs.emplace_back(n * sizeof(float));
        cmp.upload(rest_bufs.back().data(), a.data(), n * sizeof(float));
        rest_ptrs.push_back(static_cast<const float*>(rest_bufs.back().data()));
      }
      const DeviceTensor dref = to_device(cmp, ref, ValueType::F64);
      for (double from : {256.0, 4096.0, 2.0}) {
        const std::string label = "n " + std::to_string(n) + " devs " +
                                  std::to_string(n_devs) + " from " + std::to_string(from);
        const ConditionSums host = host_condition(ref, devs, rest, u, from);
        const ConditionSums got =
            cmp.condition(static_cast<const double*>(dref.buffer.data()), dev_ptrs, rest_ptrs,
                          static_cast<Idx>(n), u, from);
        EXPECT_EQ(got.n_ill, host.n_ill) << label;
        EXPECT_PRED2(same, got.kmax, host.kmax) << label;
        ASSERT_EQ(got.rest.size(), host.rest.size()) << label;
        for (std::size_t r = 0; r < host.rest.size(); ++r) {
          EXPECT_EQ(got.rest[r].pairs, host.rest[r].pairs) << label << " rest " << r;
          EXPECT_PRED2(same, got.rest[r].max, host.rest[r].max) << label << " rest " << r;
          EXPECT_PRED2(near, got.rest[r].d2, host.rest[r].d2) << label << " rest " << r;
        }
        if (n > 20 && n_devs > 0) {
          EXPECT_GT(host.n_ill, 0) << label << ": the case is vacuous";
        }
      }
    }
}

// ---- determinism and arguments -----------------------------------------------------------

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST(DeviceDeterminism, TwoCallsGiveTheSameBits) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const Idx B = 4, T = 1024, row = 257;  // n = B·T·row > 2²⁰
  const Pair p = random_pair(static_cast<std::size_t>(B * T * row), false, 71);
  const DeviceTensor o = to_device(cmp, p.oracle, ValueType::F64);
  const DeviceTensor s = to_device(cmp, p.subject, ValueType::BF16);
  const DeviceMetrics a = cmp.metrics(o.values, s.values, false, Precision::BF16, true);
  DeviceComparer other;  // its own stream and scratch
  const DeviceMetrics b = other.metrics(o.values, s.values, false, Precision::BF16, true);
  for (const auto& [x, y, name] :
       {std::tuple{a.max_abs, b.max_abs, "max_abs"}, {a.oracle_l2, b.oracle_l2, "oracle_l2"},
        {a.diff_l2, b.diff_l2, "diff_l2"}, {a.rel_l2, b.rel_l2, "rel_l2"},
        {a.p95_rel, b.p95_rel, "p95_rel"}, {a.max_rel, b.max_rel, "max_rel"},
        {a.cosine, b.cosine, "cosine"}, {a.max_ulps, b.max_ulps, "max_ulps"},
        {a.mean_ulps, b.mean_ulps, "mean_ulps"}, {a.oracle_scale, b.oracle_scale, "scale"}})
    EXPECT_TRUE(same_bits(x, y)) << name;
  EXPECT_EQ(a.worst_index, b.worst_index);
  EXPECT_EQ(a.rel_count, b.rel_count);
  std::vector<double> m1, r1, m2, r2;
  cmp.position_profile(o.values, s.values, B, T, false, &m1, &r1);
  other.position_profile(o.values, s.values, B, T, false, &m2, &r2);
  ASSERT_EQ(r1.size(), static_cast<std::size_t>(T));
  ASSERT_EQ(r2.size(), r1.size());
  EXPECT_EQ(std::memcmp(r1.data(), r2.data(), r1.size() * sizeof(double)), 0);
  const DeviceValues ref{o.values.data, ValueType::F64, o.values.n};
  DeviceBuffer dev(static_cast<std::size_t>(o.values.n) * sizeof(float));
  cmp.abs_dev(ref, s.values, false, static_cast<float*>(dev.data()));
  const std::vector<const float*> devs = {static_cast<const float*>(dev.data())};
  const ConditionSums c1 = cmp.condition(static_cast<const double*>(o.values.data), devs, devs,
                                         o.values.n, 0x1p-8, 256);
  const ConditionSums c2 = other.condition(static_cast<const double*>(o.values.data), devs,
                                           devs, o.values.n, 0x1p-8, 256);
  EXPECT_EQ(c1.n_ill, c2.n_ill);
  EXPECT_TRUE(same_bits(c1.kmax, c2.kmax));
  EXPECT_TRUE(same_bits(c1.rest[0].d2, c2.rest[0].d2));
}

TEST(DevicePlacement, AHostBufferHoldsWhatADeviceBufferHolds) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  const std::size_t n = 300007;
  const Pair p = random_pair(n, false, 83);
  const DeviceTensor o = to_device(cmp, p.oracle, ValueType::F64);
  const DeviceTensor s = to_device(cmp, p.subject, ValueType::BF16);
  DeviceBuffer on_device(n * sizeof(double)), on_host(n * sizeof(double), Place::Host);
  EXPECT_EQ(on_device.place(), Place::Device);
  ASSERT_EQ(on_host.place(), Place::Host);
  ASSERT_NE(on_host.data(), nullptr);
  cmp.copy(on_device.data(), o.values.data, n * sizeof(double));
  cmp.copy(on_host.data(), on_device.data(), n * sizeof(double));
  std::vector<double> back(n);
  cmp.download(back.data(), on_host.data(), n * sizeof(double));
  EXPECT_EQ(std::memcmp(back.data(), p.oracle.data(), n * sizeof(double)), 0);
  // The kernels read and write the mapped buffer as device memory.
  const DeviceValues from_host{on_host.data(), ValueType::F64, static_cast<Idx>(n)};
  DeviceBuffer dev_a(n * sizeof(float)), dev_b(n * sizeof(float), Place::Host);
  cmp.abs_dev(o.values, s.values, false, static_cast<float*>(dev_a.data()));
  cmp.abs_dev(from_host, s.values, false, static_cast<float*>(dev_b.data()));
  EXPECT_EQ(download_floats(cmp, dev_a, n), download_floats(cmp, dev_b, n));
  const DeviceMetrics a = cmp.metrics(o.values, s.values, false, Precision::BF16, true);
  const DeviceMetrics b = cmp.metrics(from_host, s.values, false, Precision::BF16, true);
  EXPECT_TRUE(same_bits(a.rel_l2, b.rel_l2));
  EXPECT_TRUE(same_bits(a.max_abs, b.max_abs));
  EXPECT_EQ(a.worst_index, b.worst_index);
  DeviceBuffer moved = std::move(on_host);
  EXPECT_EQ(moved.place(), Place::Host);
  EXPECT_EQ(on_host.data(), nullptr);
}

TEST(DeviceArguments, WrongSizesAreOneLineErrors) {
  M3_SKIP_WITHOUT_DEVICE();
  DeviceComparer cmp;
  DeviceBuffer a(64 * sizeof(double)), b(64 * sizeof(double));
  const DeviceValues o{a.data(), ValueType::F64, 64}, s{b.data(), ValueType::F64, 63};
  EXPECT_THROW(cmp.metrics(o, s, false, Precision::F32, true), Error);
  std::vector<double> m, r;
  EXPECT_THROW(cmp.position_profile(o, o, 3, 7, false, &m, &r), Error);  // 64 ≠ k·21
  EXPECT_THROW(cmp.position_profile(o, o, 0, 8, false, &m, &r), Error);
  EXPECT_THROW(cmp.abs_dev(o, s, false, static_cast<float*>(b.data())), Error);
  const DeviceValues no_data{nullptr, ValueType::F32, 5};
  EXPECT_THROW(cmp.metrics(no_data, no_data, false, Precision::F32, true), Error);
  EXPECT_THROW(cmp.condition(nullptr, {}, {}, 5, 0x1p-8, 256), Error);
}

// ---- every build -------------------------------------------------------------------------

TEST(CompareAvailability, UnavailableExactlyWhenAComparerCannotStart) {
  const std::string why = compare_unavailable();
  if (why.empty()) {
    EXPECT_NO_THROW(DeviceComparer());
    return;
  }
  try {
    DeviceComparer cmp;
    FAIL() << "a comparer started although compare_unavailable() says: " << why;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << e.what();
  }
}

TEST(CompareAvailability, ValueTypesHaveTheirNames) {
  EXPECT_STREQ(value_type_name(ValueType::F64), "f64");
  EXPECT_STREQ(value_type_name(ValueType::F32), "f32");
  EXPECT_STREQ(value_type_name(ValueType::BF16), "bf16");
  EXPECT_STREQ(value_type_name(ValueType::F16), "f16");
  const DeviceBuffer empty(0);  // allocates nothing, in every build
  EXPECT_EQ(empty.data(), nullptr);
  EXPECT_EQ(empty.bytes(), 0u);
}

}  // namespace
}  // namespace m3::gpu
