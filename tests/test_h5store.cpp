// Tests of the golden-file store (golden/h5store.hpp) and of the bf16 / f16 conversions it
// stores with (reference/precision.hpp).
//
//   Bf16Conversion, F16Conversion  known bit patterns (ties to even, overflow, NaN, −0,
//       subnormals), every one of the 65536 patterns decoded and encoded again, and the encoder
//       against a brute-force nearest-value search at every midpoint and at random floats
//   H5RoundTrip   every stored dtype bit-exact; ranks 0, 1, 3, 5 and a zero-sized dimension
//   H5Attributes  string / int64 / double / vector attributes; children, has, dtype
//   H5Writer      the overwrite rule and atomic commit: no final or temporary file after an
//                 exception, an existing file byte-identical after a failed write
//   H5Reader      one clear one-line error per kind of bad file or bad dataset
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "capture.hpp"
#include "error.hpp"
#include "h5store.hpp"
#include "precision.hpp"
#include "error_of.hpp"

namespace fs = std::filesystem;
using m3::Idx;
using m3::Tensor;
using m3::h5::DType;
using m3::h5::NonFinite;

namespace {

// bits_of: one name for the bits of a float or a double (the double pair stays local).
std::uint32_t bits_of(float f) { return m3::float_bits(f); }
std::uint64_t bits_of(double d) {
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}
double double_of(std::uint64_t u) {
  double d;
  std::memcpy(&d, &u, sizeof d);
  return d;
}

bool bf16_is_nan(std::uint16_t h) { return (h & 0x7F80u) == 0x7F80u && (h & 0x007Fu) != 0; }
bool f16_is_nan(std::uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x03FFu) != 0; }

// The message of the m3::Error that f throws ("" and a test failure when it throws none).
using m3::test::error_of;

// The message is one line and contains every part.
void expect_message(const std::string& msg, std::initializer_list<std::string> parts) {
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  for (const auto& p : parts)
    EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
}

// --- brute-force references: the nearest representable value, ties to the even pattern -------

// table[k] = value of the non-negative pattern k; the last entry is the overflow threshold
// pattern (0x7C00 / 0x7F80) given the value it would have with an unbounded exponent.
std::vector<double> positive_table(bool bf16) {
  std::vector<double> t;
  const std::uint16_t inf = bf16 ? 0x7F80 : 0x7C00;
  for (std::uint32_t k = 0; k < inf; ++k)
    t.push_back(bf16 ? m3::bf16_bits_to_float(static_cast<std::uint16_t>(k))
                     : m3::f16_bits_to_float(static_cast<std::uint16_t>(k)));
  t.push_back(bf16 ? std::ldexp(1.0, 128) : 65536.0);
  return t;
}

std::uint16_t nearest_bits(const std::vector<double>& table, float x) {
  const std::uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  const auto last = static_cast<std::uint16_t>(table.size() - 1);
  if (a >= table.back()) return sign | last;
  const auto it = std::upper_bound(table.begin(), table.end(), a);
  const auto hi = static_cast<std::uint16_t>(it - table.begin());
  const auto lo = static_cast<std::uint16_t>(hi - 1);
  const double dlo = a - table[lo], dhi = table[hi] - a;
  if (dlo < dhi) return sign | lo;
  if (dhi < dlo) return sign | hi;
  return sign | ((lo & 1u) ? hi : lo);
}

// Every midpoint between neighbours (and one float either side of it), both signs, plus
// random finite floats: the encoder must agree with the brute-force search on all of them.
void check_against_reference(bool bf16) {
  const std::vector<double> table = positive_table(bool(bf16));
  const auto encode = bf16 ? m3::float_to_bf16_bits : m3::float_to_f16_bits;
  std::vector<float> xs;
  for (std::size_t k = 0; k + 1 < table.size(); ++k) {
    const double mid = 0.5 * (table[k] + table[k + 1]);
    const float m = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(m), mid) << "midpoint not a float at k=" << k;
    xs.push_back(m);
    xs.push_back(std::nextafter(m, 0.0f));
    xs.push_back(std::nextafter(m, std::numeric_limits<float>::infinity()));
  }
  std::mt19937 rng(12345);
  for (int i = 0; i < 1000000; ++i) {
    const float f = m3::bits_float(static_cast<std::uint32_t>(rng()));
    if (std::isfinite(f)) xs.push_back(f);
  }
  int mismatches = 0;
  for (float x : xs) {
    for (float s : {x, -x}) {
      const std::uint16_t want = nearest_bits(table, s), got = encode(s);
      if (want != got && ++mismatches <= 10)
        ADD_FAILURE() << (bf16 ? "bf16" : "f16") << " of float bits 0x" << std::hex << bits_of(s)
                      << ": got 0x" << got << ", nearest-even is 0x" << want;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

// --- a fresh folder per test ---------------------------------------------------------------------

class H5Fixture : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::path(::testing::TempDir()) / ("m3_h5store_" + std::to_string(::getpid()) + "_" +
                                             info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string file(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_))
      names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }
  static std::string bytes_of(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  static void write_text(const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::binary) << text;
  }
  // A committed file holding /a = [1, 2, 3] (f64).
  void make_small_file(const std::string& path) const {
    m3::h5::Writer w(path, true);
    w.write("/a", Tensor{{3}, {1, 2, 3}}, DType::F64);
    w.commit();
  }

  fs::path dir_;
};

using H5RoundTrip = H5Fixture;
using H5Attributes = H5Fixture;
using H5Writer = H5Fixture;
using H5Reader = H5Fixture;

Tensor random_tensor(std::vector<Idx> shape, unsigned seed) {
  Tensor t;
  t.shape = std::move(shape);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> dist(-3.0, 3.0);
  t.data.resize(static_cast<std::size_t>(t.numel()));
  for (double& v : t.data) v = dist(rng);
  return t;
}

// The value a double becomes once stored as d and read back.
double stored_value(double v, DType d) {
  const float f = static_cast<float>(v);
  switch (d) {
    case DType::F64:
      return v;
    case DType::F32:
      return f;
    case DType::BF16:
      return m3::round_bf16(f);
    case DType::F16:
      return m3::round_f16(f);
  }
  return v;
}

void expect_same_bits(const std::vector<double>& got, const std::vector<double>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(want[i])) {
      EXPECT_TRUE(std::isnan(got[i])) << "index " << i;
      EXPECT_EQ(std::signbit(got[i]), std::signbit(want[i])) << "index " << i;
    } else {
      EXPECT_EQ(bits_of(got[i]), bits_of(want[i]))
          << "index " << i << ": " << got[i] << " vs " << want[i];
    }
  }
}

}  // namespace

// ================================ precision.hpp conversions =====================================

TEST(Bf16Conversion, KnownPatterns) {
  EXPECT_EQ(m3::float_to_bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(m3::float_to_bf16_bits(-2.0f), 0xC000);
  EXPECT_EQ(m3::float_to_bf16_bits(0.0f), 0x0000);
  EXPECT_EQ(m3::float_to_bf16_bits(-0.0f), 0x8000);
  EXPECT_EQ(m3::float_to_bf16_bits(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(m3::float_to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xFF80);
  // bf16 subnormals are the upper halves of float subnormals.
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x00010000u)), 0x0001);
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x00000001u)), 0x0000);  // rounds to zero
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x80000001u)), 0x8000);  // to −0
  EXPECT_EQ(m3::bf16_bits_to_float(0x3F80), 1.0f);
  EXPECT_EQ(bits_of(m3::bf16_bits_to_float(0x8000)), 0x80000000u);
  EXPECT_EQ(bits_of(m3::bf16_bits_to_float(0x0001)), 0x00010000u);
}

TEST(Bf16Conversion, TiesRoundToEvenBothWays) {
  EXPECT_EQ(m3::float_to_bf16_bits(1.00390625f), 0x3F80);  // 1 + 2⁻⁸: tie, down to even
  EXPECT_EQ(m3::float_to_bf16_bits(1.01171875f), 0x3F82);  // 1 + 3·2⁻⁸: tie, up to even
  EXPECT_EQ(m3::float_to_bf16_bits(-1.00390625f), 0xBF80);
  EXPECT_EQ(m3::float_to_bf16_bits(-1.01171875f), 0xBF82);
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x3F808001u)), 0x3F81);  // just above the tie
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x3F817FFFu)), 0x3F81);  // just below the tie
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x00008000u)), 0x0000);  // subnormal tie, even
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x00018000u)), 0x0002);
}

TEST(Bf16Conversion, OverflowRoundsToInfinity) {
  EXPECT_EQ(m3::float_to_bf16_bits(3.4028235e38f), 0x7F80);  // FLT_MAX rounds up past 0x7F7F
  EXPECT_EQ(m3::float_to_bf16_bits(-3.4028235e38f), 0xFF80);
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x7F7F8000u)), 0x7F80);  // tie at the top: odd → up
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x7F7F7FFFu)), 0x7F7F);
}

TEST(Bf16Conversion, NanStaysNanWithItsSign) {
  for (std::uint32_t u : {0x7FC00000u, 0x7F800001u, 0x7FBFFFFFu, 0x7F810000u}) {
    const std::uint16_t pos = m3::float_to_bf16_bits(m3::bits_float(u));
    const std::uint16_t neg = m3::float_to_bf16_bits(m3::bits_float(u | 0x80000000u));
    EXPECT_TRUE(bf16_is_nan(pos)) << std::hex << u << " → " << pos;
    EXPECT_TRUE(bf16_is_nan(neg)) << std::hex << u << " → " << neg;
    EXPECT_EQ(pos & 0x8000, 0);
    EXPECT_EQ(neg & 0x8000, 0x8000);
  }
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0x7FC00000u)), 0x7FC0);
  EXPECT_EQ(m3::float_to_bf16_bits(m3::bits_float(0xFFC00000u)), 0xFFC0);
}

TEST(Bf16Conversion, EveryPatternDecodesAndEncodesBackExactly) {
  for (std::uint32_t k = 0; k <= 0xFFFF; ++k) {
    const auto h = static_cast<std::uint16_t>(k);
    const float f = m3::bf16_bits_to_float(h);
    EXPECT_EQ(bits_of(f), k << 16);
    const std::uint16_t back = m3::float_to_bf16_bits(f);
    if (bf16_is_nan(h)) {
      EXPECT_TRUE(bf16_is_nan(back)) << std::hex << k;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << k;
    } else {
      EXPECT_EQ(back, h) << std::hex << k;
    }
  }
}

TEST(Bf16Conversion, MatchesNearestEvenSearchAtMidpointsAndRandomFloats) {
  check_against_reference(true);
}

TEST(F16Conversion, KnownPatterns) {
  EXPECT_EQ(m3::float_to_f16_bits(1.0f), 0x3C00);
  EXPECT_EQ(m3::float_to_f16_bits(-1.0f), 0xBC00);
  EXPECT_EQ(m3::float_to_f16_bits(0.0f), 0x0000);
  EXPECT_EQ(m3::float_to_f16_bits(-0.0f), 0x8000);
  EXPECT_EQ(m3::float_to_f16_bits(65504.0f), 0x7BFF);
  EXPECT_EQ(m3::float_to_f16_bits(std::ldexp(1.0f, -14)), 0x0400);         // smallest normal
  EXPECT_EQ(m3::float_to_f16_bits(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(m3::float_to_f16_bits(1023 * std::ldexp(1.0f, -24)), 0x03FF);  // largest subnormal
  EXPECT_EQ(m3::float_to_f16_bits(m3::bits_float(0x00000001u)), 0x0000);         // float subnormal → 0
  EXPECT_EQ(m3::f16_bits_to_float(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(m3::f16_bits_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(m3::f16_bits_to_float(0x7C00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(bits_of(m3::f16_bits_to_float(0x8000)), 0x80000000u);
}

TEST(F16Conversion, OverflowAtHalfwayAboveMax) {
  EXPECT_EQ(m3::float_to_f16_bits(65519.99f), 0x7BFF);
  EXPECT_EQ(m3::float_to_f16_bits(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(m3::float_to_f16_bits(65520.0f), 0x7C00);  // the tie 65504 ↔ 65536 goes to even = inf
  EXPECT_EQ(m3::float_to_f16_bits(-65520.0f), 0xFC00);
  EXPECT_EQ(m3::float_to_f16_bits(1e10f), 0x7C00);
  EXPECT_EQ(m3::float_to_f16_bits(std::numeric_limits<float>::infinity()), 0x7C00);
  EXPECT_EQ(m3::float_to_f16_bits(-std::numeric_limits<float>::infinity()), 0xFC00);
}

TEST(F16Conversion, TiesRoundToEvenInSubnormalAndNormalRange) {
  EXPECT_EQ(m3::float_to_f16_bits(std::ldexp(1.0f, -25)), 0x0000);  // ½ of the smallest: even
  EXPECT_EQ(m3::float_to_f16_bits(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(m3::float_to_f16_bits(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 ulp: up to even
  EXPECT_EQ(m3::float_to_f16_bits(-std::ldexp(1.0f, -25)), 0x8000);
  EXPECT_EQ(m3::float_to_f16_bits(2047 * std::ldexp(1.0f, -25)), 0x0400);  // 1023.5 ulp → normal
  EXPECT_EQ(m3::float_to_f16_bits(1.0f + std::ldexp(1.0f, -11)), 0x3C00);
  EXPECT_EQ(m3::float_to_f16_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3C02);
  EXPECT_EQ(m3::float_to_f16_bits(1.0f + std::ldexp(1.0f, -11) + std::ldexp(1.0f, -20)), 0x3C01);
  EXPECT_EQ(m3::float_to_f16_bits(2.0f - std::ldexp(1.0f, -11)), 0x4000);  // carry into exponent
}

TEST(F16Conversion, NanStaysNanWithItsSign) {
  for (std::uint32_t u : {0x7FC00000u, 0x7F800001u, 0x7FBFFFFFu, 0x7F802000u}) {
    const std::uint16_t pos = m3::float_to_f16_bits(m3::bits_float(u));
    const std::uint16_t neg = m3::float_to_f16_bits(m3::bits_float(u | 0x80000000u));
    EXPECT_TRUE(f16_is_nan(pos)) << std::hex << u << " → " << pos;
    EXPECT_TRUE(f16_is_nan(neg)) << std::hex << u << " → " << neg;
    EXPECT_EQ(pos & 0x8000, 0);
    EXPECT_EQ(neg & 0x8000, 0x8000);
  }
  EXPECT_TRUE(std::isnan(m3::f16_bits_to_float(0x7E00)));
  EXPECT_TRUE(std::isnan(m3::f16_bits_to_float(0x7C01)));
}

TEST(F16Conversion, EveryPatternDecodesAndEncodesBackExactly) {
  for (std::uint32_t k = 0; k <= 0xFFFF; ++k) {
    const auto h = static_cast<std::uint16_t>(k);
    const float f = m3::f16_bits_to_float(h);
    const std::uint16_t back = m3::float_to_f16_bits(f);
    if (f16_is_nan(h)) {
      EXPECT_TRUE(std::isnan(f)) << std::hex << k;
      EXPECT_TRUE(f16_is_nan(back)) << std::hex << k;
      EXPECT_EQ(back & 0x8000, h & 0x8000) << std::hex << k;
    } else {
      EXPECT_EQ(back, h) << std::hex << k;
    }
  }
}

TEST(F16Conversion, MatchesNearestEvenSearchAtMidpointsAndRandomFloats) {
  check_against_reference(false);
}

// ======================================== round trips ===========================================

TEST_F(H5RoundTrip, F64IsBitExactForZerosDenormalsAndExtremes) {
  std::vector<double> v = {0.0,
                           -0.0,
                           std::numeric_limits<double>::denorm_min(),
                           -std::numeric_limits<double>::denorm_min(),
                           double_of(0x000FFFFFFFFFFFFFull),  // largest denormal
                           std::numeric_limits<double>::min(),
                           std::numeric_limits<double>::max(),
                           -std::numeric_limits<double>::max(),
                           1e300,
                           -1e-300,
                           3.141592653589793,
                           1.0 / 3.0};
  std::mt19937_64 rng(7);
  while (v.size() < 3 * 4 * 5) {
    const double d = double_of(rng());
    if (std::isfinite(d)) v.push_back(d);
  }
  const Tensor t{{3, 4, 5}, v};
  const std::string p = file("f64.h5");
  {
    m3::h5::Writer w(p, false);
    w.write("/x", t, DType::F64);
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(r.dtype("/x"), DType::F64);
  EXPECT_EQ(r.shape("/x"), (std::vector<Idx>{3, 4, 5}));
  const Tensor back = r.read("/x", {3, 4, 5});
  EXPECT_EQ(back.shape, t.shape);
  expect_same_bits(back.data, t.data);
}

TEST_F(H5RoundTrip, F32IsBitExactForRandomFloats) {
  std::vector<double> v = {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::max(), -std::numeric_limits<float>::min()};
  std::mt19937 rng(11);
  while (v.size() < 200) {
    const float f = m3::bits_float(static_cast<std::uint32_t>(rng()));
    if (std::isfinite(f)) v.push_back(f);
  }
  const Tensor t{{200}, v};
  const std::string p = file("f32.h5");
  {
    m3::h5::Writer w(p, false);
    w.write("/x", t, DType::F32);
    w.write("/rounded", Tensor{{2}, {0.1, -1.0 / 3.0}}, DType::F32);
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(r.dtype("/x"), DType::F32);
  expect_same_bits(r.read("/x").data, t.data);
  // A double that is not a float is stored rounded to nearest (even).
  expect_same_bits(r.read("/rounded").data,
                   {static_cast<double>(0.1f), static_cast<double>(-1.0f / 3.0f)});
}

TEST_F(H5RoundTrip, Bf16KnownPatternsIncludingTiesSubnormalsInfAndNan) {
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor t{{10},
                 {1.0, 1.00390625, 1.01171875, -0.0, std::ldexp(1.0, -133), 3.4028235e38, inf, -inf,
                  std::numeric_limits<double>::quiet_NaN(), -2.5}};
  const std::vector<std::uint16_t> want = {0x3F80, 0x3F80, 0x3F82, 0x8000, 0x0001,
                                           0x7F80, 0x7F80, 0xFF80, 0x7FC0, 0xC020};
  const std::string p = file("bf16.h5");
  {
    m3::h5::Writer w(p, false);
    w.write("/x", t, DType::BF16, NonFinite::Allow);
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(r.dtype("/x"), DType::BF16);
  EXPECT_EQ(r.attr_string("/x", "dtype"), "bf16");
  EXPECT_EQ(r.read_raw_u16("/x"), want);
  std::vector<double> decoded;
  for (std::uint16_t h : want) decoded.push_back(m3::bf16_bits_to_float(h));
  expect_same_bits(r.read("/x").data, decoded);
}

TEST_F(H5RoundTrip, F16KnownPatternsIncludingTiesSubnormalsInfAndNan) {
  const double inf = std::numeric_limits<double>::infinity();
  const Tensor t{{2, 6},
                 {1.0, 1.0 + std::ldexp(1.0, -11), 1.0 + 3 * std::ldexp(1.0, -11), 65504.0, 65520.0,
                  std::ldexp(1.0, -24), std::ldexp(1.0, -25), 3 * std::ldexp(1.0, -25), -0.0, -inf,
                  std::numeric_limits<double>::quiet_NaN(), 1023 * std::ldexp(1.0, -24)}};
  const std::vector<std::uint16_t> want = {0x3C00, 0x3C00, 0x3C02, 0x7BFF, 0x7C00, 0x0001,
                                           0x0000, 0x0002, 0x8000, 0xFC00, 0x7E00, 0x03FF};
  const std::string p = file("f16.h5");
  {
    m3::h5::Writer w(p, false);
    w.write("/x", t, DType::F16, NonFinite::Allow);
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(r.dtype("/x"), DType::F16);
  EXPECT_EQ(r.attr_string("/x", "dtype"), "f16");
  EXPECT_EQ(r.shape("/x"), (std::vector<Idx>{2, 6}));
  EXPECT_EQ(r.read_raw_u16("/x"), want);
  std::vector<double> decoded;
  for (std::uint16_t h : want) decoded.push_back(m3::f16_bits_to_float(h));
  expect_same_bits(r.read("/x").data, decoded);
}

// All 65536 patterns: stored raw, read raw and decoded, then the decoded doubles written again
// through the rounding path give the same bits (NaN stays NaN with its sign).
TEST_F(H5RoundTrip, EveryBf16AndF16PatternSurvivesRawAndRoundedWrites) {
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t k = 0; k <= 0xFFFF; ++k) all[k] = static_cast<std::uint16_t>(k);
  const std::string p = file("all.h5"), p2 = file("all2.h5");
  for (DType d : {DType::BF16, DType::F16}) {
    const std::string name = std::string("/") + m3::precision_name(d);
    {
      m3::h5::Writer w(p, true);
      w.write_raw_u16(name, {256, 256}, all.data(), d, NonFinite::Allow);
      w.commit();
    }
    Tensor values;
    {
      m3::h5::Reader r(p);
      ASSERT_EQ(r.read_raw_u16(name), all);
      values = r.read(name, {256, 256});
    }
    {
      m3::h5::Writer w(p2, true);
      w.write(name, values, d, NonFinite::Allow);
      w.commit();
    }
    m3::h5::Reader r2(p2);
    const std::vector<std::uint16_t> back = r2.read_raw_u16(name);
    ASSERT_EQ(back.size(), all.size());
    int mismatches = 0;
    for (std::uint32_t k = 0; k <= 0xFFFF; ++k) {
      const auto h = all[k];
      const bool nan = d == DType::BF16 ? bf16_is_nan(h) : f16_is_nan(h);
      const double dec = d == DType::BF16 ? m3::bf16_bits_to_float(h) : m3::f16_bits_to_float(h);
      if (nan) {
        EXPECT_TRUE(std::isnan(values.data[k]));
        const bool back_nan = d == DType::BF16 ? bf16_is_nan(back[k]) : f16_is_nan(back[k]);
        if (!back_nan || (back[k] & 0x8000) != (h & 0x8000)) ++mismatches;
      } else {
        EXPECT_EQ(bits_of(values.data[k]), bits_of(dec));
        if (back[k] != h) ++mismatches;
      }
    }
    EXPECT_EQ(mismatches, 0) << m3::precision_name(d);
  }
}

TEST_F(H5RoundTrip, Ranks0To5AndZeroSizedDimensionForEveryDtype) {
  const std::vector<std::vector<Idx>> shapes = {{}, {7}, {2, 3, 4}, {2, 1, 3, 1, 2}, {4, 0, 3}};
  const std::vector<DType> dtypes = {DType::F64, DType::F32, DType::BF16, DType::F16};
  const std::string p = file("shapes.h5");
  {
    m3::h5::Writer w(p, false);
    unsigned seed = 1;
    for (DType d : dtypes)
      for (std::size_t s = 0; s < shapes.size(); ++s)
        w.write(std::string("/") + m3::precision_name(d) + "/rank" +
                    std::to_string(shapes[s].size()) + "_" + std::to_string(s),
                random_tensor(shapes[s], seed++), d);
    w.commit();
  }
  m3::h5::Reader r(p);
  unsigned seed = 1;
  for (DType d : dtypes) {
    for (std::size_t s = 0; s < shapes.size(); ++s) {
      const std::string name = std::string("/") + m3::precision_name(d) + "/rank" +
                               std::to_string(shapes[s].size()) + "_" + std::to_string(s);
      SCOPED_TRACE(name);
      const Tensor src = random_tensor(shapes[s], seed++);
      EXPECT_EQ(r.dtype(name), d);
      EXPECT_EQ(r.shape(name), shapes[s]);
      const Tensor back = r.read(name, shapes[s]);
      EXPECT_EQ(back.shape, shapes[s]);
      EXPECT_EQ(back.numel(), src.numel());
      std::vector<double> want;
      for (double v : src.data) want.push_back(stored_value(v, d));
      expect_same_bits(back.data, want);
    }
  }
  EXPECT_EQ(r.read("/f64/rank0_0").data.size(), 1u);
  EXPECT_TRUE(r.read("/f16/rank3_4").data.empty());
}

// ======================================== attributes ============================================

TEST_F(H5Attributes, StringIntDoubleAndVectorRoundTripOnRootGroupAndDataset) {
  const std::string p = file("attrs.h5");
  const double denorm = std::numeric_limits<double>::denorm_min();
  {
    m3::h5::Writer w(p, false);
    w.group("/meta");
    w.write("/stages/L0/x", Tensor{{2}, {1, 2}}, DType::F32);
    w.attr("/", "schema", "m3-golden/1");
    w.attr("/", "empty", std::string());
    w.attr("/meta", "config", std::string("d_model=128 λ=0.5 ∂"));
    w.attr("/meta", "seed", std::int64_t{-1});
    w.attr("/meta", "min", std::numeric_limits<std::int64_t>::min());
    w.attr("/meta", "max", std::numeric_limits<std::int64_t>::max());
    w.attr("/meta", "small", 42);
    w.attr("/meta", "count", std::size_t{7});
    w.attr("/meta", "tenth", 0.1);
    w.attr("/meta", "negzero", -0.0);
    w.attr("/meta", "denorm", denorm);
    w.attr("/meta", "vec", std::vector<double>{1.5, -2.0, 1e-300});
    w.attr("/meta", "novec", std::vector<double>{});
    w.attr("/stages/L0/x", "note", "on a dataset");
    w.attr("/stages/L0/x", "scale", 2.5);
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(r.attr_string("/", "schema"), "m3-golden/1");
  EXPECT_EQ(r.attr_string("/", "empty"), "");
  EXPECT_EQ(r.attr_string("/meta", "config"), "d_model=128 λ=0.5 ∂");
  EXPECT_EQ(r.attr_int("/meta", "seed"), -1);
  EXPECT_EQ(r.attr_int("/meta", "min"), std::numeric_limits<std::int64_t>::min());
  EXPECT_EQ(r.attr_int("/meta", "max"), std::numeric_limits<std::int64_t>::max());
  EXPECT_EQ(r.attr_int("/meta", "small"), 42);
  EXPECT_EQ(r.attr_int("/meta", "count"), 7);
  EXPECT_EQ(bits_of(r.attr_double("/meta", "tenth")), bits_of(0.1));
  EXPECT_EQ(bits_of(r.attr_double("/meta", "negzero")), bits_of(-0.0));
  EXPECT_EQ(bits_of(r.attr_double("/meta", "denorm")), bits_of(denorm));
  EXPECT_EQ(r.attr_doubles("/meta", "vec"), (std::vector<double>{1.5, -2.0, 1e-300}));
  EXPECT_TRUE(r.attr_doubles("/meta", "novec").empty());
  EXPECT_EQ(r.attr_string("/stages/L0/x", "note"), "on a dataset");
  EXPECT_EQ(r.attr_double("/stages/L0/x", "scale"), 2.5);
  EXPECT_TRUE(r.has_attr("/meta", "seed"));
  EXPECT_FALSE(r.has_attr("/meta", "nope"));
  EXPECT_FALSE(r.has_attr("/missing", "seed"));
}

TEST_F(H5Attributes, MissingOrMistypedAttributeNamesObjectAndAttribute) {
  const std::string p = file("attrs.h5");
  {
    m3::h5::Writer w(p, false);
    w.group("/meta");
    w.attr("/meta", "name", "x");
    w.attr("/meta", "seed", 3);
    expect_message(error_of([&] { w.attr("/meta", "seed", 4); }),
                   {p, "attribute 'seed' of '/meta'", "written twice"});
    expect_message(error_of([&] { w.attr("/nothing", "seed", 4); }),
                   {p, "attribute 'seed' of '/nothing'", "does not exist"});
    w.commit();
  }
  m3::h5::Reader r(p);
  expect_message(error_of([&] { r.attr_int("/meta", "nope"); }),
                 {p, "attribute 'nope' of '/meta' does not exist"});
  expect_message(error_of([&] { r.attr_string("/nothing", "name"); }),
                 {p, "attribute 'name' of '/nothing'", "does not exist"});
  expect_message(error_of([&] { r.attr_int("/meta", "name"); }),
                 {"attribute 'name' of '/meta' is not an integer"});
  expect_message(error_of([&] { r.attr_string("/meta", "seed"); }),
                 {"attribute 'seed' of '/meta' is not a string"});
  expect_message(error_of([&] { r.attr_double("/meta", "seed"); }),
                 {"attribute 'seed' of '/meta' is not a float"});
}

TEST_F(H5Attributes, ChildrenAreSortedAndHasTellsGroupsFromDatasets) {
  const std::string p = file("tree.h5");
  {
    m3::h5::Writer w(p, false);
    w.write("/stages/b", Tensor{{1}, {1}}, DType::F64);
    w.write("/stages/a", Tensor{{1}, {2}}, DType::F64);
    w.write("/stages/L0/x", Tensor{{1}, {3}}, DType::F64);
    w.group("/empty");
    w.group("/empty");  // again: a no-op
    EXPECT_TRUE(w.has("/stages/L0"));
    EXPECT_FALSE(w.has("/stages/c"));
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(r.children("/"), (std::vector<std::string>{"empty", "stages"}));
  EXPECT_EQ(r.children("/stages"), (std::vector<std::string>{"L0", "a", "b"}));
  EXPECT_TRUE(r.children("/empty").empty());
  EXPECT_TRUE(r.has("/stages/L0/x"));
  EXPECT_TRUE(r.has("stages/L0/"));  // normalised to /stages/L0
  EXPECT_FALSE(r.has("/stages/L0/y"));
  EXPECT_FALSE(r.has("/stages/a/under_a_dataset"));
  EXPECT_TRUE(r.is_group("/stages/L0"));
  EXPECT_FALSE(r.is_group("/stages/a"));
  expect_message(error_of([&] { r.children("/stages/a"); }), {"'/stages/a': is a dataset"});
  expect_message(error_of([&] { r.children("/nope"); }), {"group '/nope' does not exist"});
}

// ========================================== writer ==============================================

TEST_F(H5Writer, RefusesToReplaceAnExistingFileWithoutOverwrite) {
  const std::string p = file("golden.h5");
  make_small_file(p);
  const std::string before = bytes_of(p);
  expect_message(error_of([&] { m3::h5::Writer w(p, false); }), {p, "file exists", "--force"});
  EXPECT_EQ(bytes_of(p), before);
  EXPECT_EQ(listing(), (std::vector<std::string>{"golden.h5"}));
}

TEST_F(H5Writer, OverwriteReplacesTheFileOnCommitOnly) {
  const std::string p = file("golden.h5");
  make_small_file(p);
  const std::string before = bytes_of(p);
  {
    m3::h5::Writer w(p, true);
    w.write("/b", Tensor{{2}, {4, 5}}, DType::F32);
    EXPECT_EQ(bytes_of(p), before);  // nothing reaches the final path before commit()
    EXPECT_EQ(fs::path(w.temp_path()).parent_path(), fs::path(p).parent_path());
    EXPECT_EQ(w.temp_path().rfind(p + ".tmp.", 0), 0u) << w.temp_path();
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_FALSE(r.has("/a"));
  EXPECT_EQ(r.read("/b").data, (std::vector<double>{4, 5}));
  EXPECT_EQ(listing(), (std::vector<std::string>{"golden.h5"}));
}

TEST_F(H5Writer, ExceptionBeforeCommitLeavesNoFinalAndNoTemporaryFile) {
  const std::string p = file("golden.h5");
  std::string temp;
  try {
    m3::h5::Writer w(p, false);
    temp = w.temp_path();
    w.write("/stages/x", random_tensor({16, 8}, 3), DType::F64);
    EXPECT_TRUE(fs::exists(temp));
    throw std::runtime_error("boom");
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom");
  }
  EXPECT_FALSE(temp.empty());
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_FALSE(fs::exists(p));
  EXPECT_TRUE(listing().empty());
}

TEST_F(H5Writer, FailedWriteLeavesTheExistingFileByteIdentical) {
  const std::string p = file("golden.h5");
  make_small_file(p);
  const std::string before = bytes_of(p);
  {
    m3::h5::Writer w(p, true);
    w.write("/x", Tensor{{2}, {1, 2}}, DType::F64);
    expect_message(error_of([&] {
                     w.write("/x", Tensor{{2}, {3, 4}}, DType::F64);
                   }),
                   {p, "dataset '/x'", "written twice"});
  }  // destroyed without commit()
  EXPECT_EQ(bytes_of(p), before);
  EXPECT_EQ(listing(), (std::vector<std::string>{"golden.h5"}));
}

TEST_F(H5Writer, RejectsNonFiniteAndOverflowingValuesNamingTheIndex) {
  const std::string p = file("golden.h5");
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  m3::h5::Writer w(p, false);
  expect_message(error_of([&] {
                   w.write("/a", Tensor{{2, 3}, {0, 0, 0, 0, 0, nan}}, DType::F64);
                 }),
                 {p, "dataset '/a': non-finite value nan at index [1, 2]", "NonFinite::Allow"});
  expect_message(error_of([&] {
                   w.write("/b", Tensor{{3}, {0, -inf, 0}}, DType::BF16);
                 }),
                 {"dataset '/b': non-finite value -inf at index [1]"});
  expect_message(error_of([&] {
                   w.write("/c", Tensor{{2}, {1, 1e39}}, DType::F32);
                 }),
                 {"dataset '/c': value 1e+39 at index [1] overflows f32"});
  expect_message(error_of([&] {
                   w.write("/d", Tensor{{1}, {65520.0}}, DType::F16);
                 }),
                 {"dataset '/d': value 65520 at index [0] overflows f16"});
  const std::uint16_t f16_inf[2] = {0x3C00, 0x7C00};
  expect_message(error_of([&] { w.write_raw_u16("/e", {2}, f16_inf, DType::F16); }),
                 {"dataset '/e': non-finite value inf at index [1]"});
  // Validation failures leave the writer usable; the rejected datasets were never created.
  EXPECT_FALSE(w.has("/a"));
  w.write("/a", Tensor{{1}, {nan}}, DType::F64, NonFinite::Allow);
  w.commit();
  EXPECT_TRUE(std::isnan(m3::h5::Reader(p).read("/a").data[0]));
}

TEST_F(H5Writer, RejectsBadShapesPathsAndUseAfterCommit) {
  const std::string p = file("golden.h5");
  m3::h5::Writer w(p, false);
  expect_message(error_of([&] {
                   w.write("/a", Tensor{{2, 3}, {1, 2, 3}}, DType::F64);
                 }),
                 {"dataset '/a': tensor has 3 values for shape [2, 3] (6)"});
  expect_message(error_of([&] {
                   w.write("/a", Tensor{{-1}, {}}, DType::F64);
                 }),
                 {"dataset '/a': negative dimension"});
  expect_message(error_of([&] {
                   w.write("", Tensor{{1}, {1}}, DType::F64);
                 }),
                 {"empty object path"});
  w.write("/a", Tensor{{1}, {1}}, DType::F64);
  expect_message(error_of([&] {
                   w.write("/a/b", Tensor{{1}, {1}}, DType::F64);
                 }),
                 {"dataset '/a/b': cannot be created", "'/a' is a dataset, not a group"});
  expect_message(error_of([&] { w.group("/a"); }), {"group '/a': a dataset exists"});
  expect_message(error_of([&] {
                   w.write("/", Tensor{{1}, {1}}, DType::F64);
                 }),
                 {"dataset '/': already exists as a group"});
  const std::uint16_t one = 0x3C00;
  expect_message(error_of([&] { w.write_raw_u16("/r", {1}, &one, DType::F32); }),
                 {"write_raw_u16 needs bf16 or f16, got f32"});
  w.commit();
  expect_message(error_of([&] { w.commit(); }), {"already committed"});
  expect_message(error_of([&] {
                   w.write("/z", Tensor{{1}, {1}}, DType::F64);
                 }),
                 {"already committed"});
  EXPECT_TRUE(fs::exists(p));
}

TEST_F(H5Writer, MissingFolderIsAnError) {
  const std::string p = file("no/such/folder/golden.h5");
  expect_message(error_of([&] { m3::h5::Writer w(p, false); }), {p, "folder", "does not exist"});
}

// ========================================== reader ==============================================

TEST_F(H5Reader, MissingFile) {
  const std::string p = file("missing.h5");
  EXPECT_EQ(error_of([&] { m3::h5::Reader r(p); }), p + ": file does not exist");
}

TEST_F(H5Reader, EmptyFile) {
  const std::string p = file("empty.h5");
  write_text(p, "");
  expect_message(error_of([&] { m3::h5::Reader r(p); }), {p, "file is empty"});
}

TEST_F(H5Reader, TextFileIsNotHdf5) {
  const std::string p = file("text.h5");
  write_text(p, "this is a text file, not HDF5\nsecond line\n");
  expect_message(error_of([&] { m3::h5::Reader r(p); }), {p, "file is not an HDF5 file"});
}

TEST_F(H5Reader, TruncatedFileIsReportedAsTruncatedOrCorrupt) {
  const std::string p = file("golden.h5");
  {
    m3::h5::Writer w(p, false);
    for (int i = 0; i < 4; ++i)
      w.write("/stages/x" + std::to_string(i), random_tensor({64, 64}, i), DType::F64);
    w.attr("/", "schema", 1);
    w.commit();
  }
  fs::resize_file(p, fs::file_size(p) / 2);
  const std::string msg = error_of([&] {
    m3::h5::Reader r(p);
    for (int i = 0; i < 4; ++i) r.read("/stages/x" + std::to_string(i));
  });
  expect_message(msg, {p, "truncated or corrupt"});
  // Cut inside the 8-byte signature itself.
  fs::resize_file(p, 3);
  expect_message(error_of([&] { m3::h5::Reader r(p); }), {p, "file is truncated or corrupt"});
}

TEST_F(H5Reader, MissingDatasetNamesItAndWhereThePathStops) {
  const std::string p = file("golden.h5");
  {
    m3::h5::Writer w(p, false);
    w.write("/stages/L0/x", Tensor{{1}, {1}}, DType::F64);
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(error_of([&] {
              r.read("/stages/L0/F3/dt", {512, 16});
            }),
            p + ": dataset '/stages/L0/F3/dt' does not exist (group '/stages/L0' has no 'F3')");
  expect_message(error_of([&] { r.shape("/stages/L1/x"); }),
                 {"dataset '/stages/L1/x' does not exist", "group '/stages' has no 'L1'"});
  expect_message(error_of([&] { r.read("/stages/L0"); }),
                 {"dataset '/stages/L0': is a group, not a dataset"});
}

TEST_F(H5Reader, WrongShapeNamesTheDatasetAndBothShapes) {
  const std::string p = file("golden.h5");
  {
    m3::h5::Writer w(p, false);
    w.write("/stages/L0/F3/dt", random_tensor({512, 16}, 5), DType::F32);
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(error_of([&] {
              r.read("/stages/L0/F3/dt", {512, 32});
            }),
            p + ": dataset '/stages/L0/F3/dt': shape [512, 16] does not match expected [512, 32]");
  expect_message(error_of([&] {
                   r.read_finite("/stages/L0/F3/dt", {16, 512});
                 }),
                 {"shape [512, 16] does not match expected [16, 512]"});
  EXPECT_EQ(r.read("/stages/L0/F3/dt", {512, 16}).data.size(), 512u * 16u);
}

TEST_F(H5Reader, NonFiniteValueNamesTheDatasetAndFirstBadIndex) {
  const std::string p = file("golden.h5");
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  {
    m3::h5::Writer w(p, false);
    w.write("/grads/W", Tensor{{3, 2}, {1, 2, inf, nan, 5, 6}}, DType::F16, NonFinite::Allow);
    w.write("/grads/ok", Tensor{{2}, {1, 2}}, DType::F64);
    w.commit();
  }
  m3::h5::Reader r(p);
  EXPECT_EQ(error_of([&] {
              r.read_finite("/grads/W", {3, 2});
            }),
            p + ": dataset '/grads/W': non-finite value inf at index [1, 0]");
  EXPECT_FALSE(m3::h5::all_finite(r.read("/grads/W")));
  EXPECT_TRUE(m3::h5::all_finite(r.read_finite("/grads/ok", {2})));
  expect_message(error_of([&] { r.read_raw_u16("/grads/ok"); }),
                 {"dataset '/grads/ok': is stored as f64, not as bf16 / f16 bits"});
}

TEST(H5Index, IndexStrIsRowMajor) {
  EXPECT_EQ(m3::h5::index_str({2, 3, 4}, 0), "[0, 0, 0]");
  EXPECT_EQ(m3::h5::index_str({2, 3, 4}, 23), "[1, 2, 3]");
  EXPECT_EQ(m3::h5::index_str({2, 3, 4}, 13), "[1, 0, 1]");
  EXPECT_EQ(m3::h5::index_str({}, 0), "[]");
}
