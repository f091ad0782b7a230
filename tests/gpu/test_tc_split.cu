// Host checks of the operand split behind the tensor-core products of gpu/tc/tc_mma.cuh (the
// chunked scan of bf16/f16 runs); no device needed, so they run in CI too.
//   hi = bf16(v), lo = bf16(v − hi):
//     |v − hi − lo| ≤ 2⁻¹⁶·|v|                for |v| ∈ [2⁻¹¹⁰, 2¹²⁰]    (random f32 values)
//     hi + lo = v exactly                     for every finite f16 value
//     lo = 0                                   for every bf16 value (the skipped pass)
//   |a·b − (ah·bh + ah·bl + al·bh)| ≤ 3.1·2⁻¹⁶·|a·b|   (the three passes; al·bl dropped)
//   f16 runs' planes of an f32 tile (tc_frag.cuh), e = tile_exponent(max|tile|):
//     max·2^e ∈ [2¹⁴, 2¹⁵) (e in [−64, 64]; 0 for a zero or non-finite max)
//     hi = f16(v·2^e), lo = f16(v·2^e − hi):  |v − (hi + lo)·2^−e| ≤ max(2⁻²²·|v|, 2⁻³⁹·max)
//     a typed f16 a times such a b in two passes (a·hi + a·lo): within |a| times that bound
// Each check also asserts that the bound is not slack by orders of magnitude (the worst case
// seen comes within 4x of it), so a split that silently degraded to one bf16 part would fail.
// Also the host form of gpu/core/fast_div.cuh's division by a launch-time constant: ⌊n/d⌋ and the
// remainder exact for divisors 1 … 2^31 − 1 (every small one, powers of two and their
// neighbours, random ones) and dividends at the ends of the 32-bit fast range and past it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "fast_div.cuh"
#include "precision.hpp"
#include "tc_mma.cuh"

namespace {

// The float of the bf16 in the low half of a packed pair.
float bf16_bits_value(std::uint32_t bits16) {
  return m3::bf16_bits_to_float(static_cast<std::uint16_t>(bits16 & 0xFFFFu));
}

// (hi, lo) of v as floats, through the packed split (v in the low half, a dummy in the high).
void split(float v, float& hi, float& lo) {
  std::uint32_t h = 0, l = 0;
  m3::gpu::tc::split2(v, 1.0f, h, l);
  hi = bf16_bits_value(h);
  lo = bf16_bits_value(l);
}

float random_float(std::mt19937_64& rng, int emin, int emax) {
  std::uniform_int_distribution<int> e(emin, emax);
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  std::bernoulli_distribution neg(0.5);
  const float v = std::ldexp(m(rng), e(rng));
  return neg(rng) ? -v : v;
}

constexpr double kTwoM16 = 1.0 / 65536.0;

TEST(TcSplit, HiPlusLoCarriesSixteenBits) {
  std::mt19937_64 rng(7);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const float v = random_float(rng, -110, 120);
    float hi, lo;
    split(v, hi, lo);
    const double err = std::abs(static_cast<double>(v) - hi - lo) / std::abs(v);
    ASSERT_LE(err, kTwoM16) << "v=" << v << " hi=" << hi << " lo=" << lo;
    worst = std::max(worst, err);
  }
  EXPECT_GT(worst, kTwoM16 / 4) << "bound far from the worst case: the test lost its teeth";
}

TEST(TcSplit, EveryF16ValueSplitsExactly) {
  for (std::uint32_t bits = 0; bits < 0x10000u; ++bits) {
    if ((bits & 0x7C00u) == 0x7C00u) continue;  // inf / NaN
    const float v = __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    float hi, lo;
    split(v, hi, lo);
    ASSERT_EQ(static_cast<double>(v), static_cast<double>(hi) + lo) << "f16 bits " << bits;
  }
}

TEST(TcSplit, Bf16ValuesHaveNoLowPart) {
  std::mt19937_64 rng(11);
  for (int i = 0; i < 100000; ++i) {
    const float v = bf16_bits_value(m3::gpu::tc::pack2(random_float(rng, -120, 120), 0.0f));
    std::uint32_t h = 0, l = 0;
    m3::gpu::tc::operand_pair<false>(make_float2(v, v), h, l);
    ASSERT_EQ(l, 0u) << "v=" << v;
    ASSERT_EQ(bf16_bits_value(h), v);
    std::uint32_t he = 0, le = 1;
    m3::gpu::tc::operand_pair<true>(make_float2(v, v), he, le);  // the exact path
    ASSERT_EQ(he, h);
    ASSERT_EQ(le, 0u);
  }
}

TEST(TcSplit, ThreePassProductWithinBound) {
  std::mt19937_64 rng(13);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    const float a = random_float(rng, -50, 50), b = random_float(rng, -50, 50);
    float ah, al, bh, bl;
    split(a, ah, al);
    split(b, bh, bl);
    const double exact = static_cast<double>(a) * b;
    const double three = static_cast<double>(ah) * bh + static_cast<double>(ah) * bl +
                         static_cast<double>(al) * bh;  // each product exact in double
    const double err = std::abs(three - exact) / std::abs(exact);
    ASSERT_LE(err, 3.1 * kTwoM16) << "a=" << a << " b=" << b;
    worst = std::max(worst, err);
  }
  EXPECT_GT(worst, 3.1 * kTwoM16 / 4) << "bound far from the worst case: the test lost its teeth";
}

// (hi, lo) of v·2^e as floats through the f16 split, scaled back by 2^−e.
void split_f16_scaled(float v, int e, double& hi, double& lo) {
  std::uint32_t h = 0, l = 0;
  m3::gpu::tc::split2_f16(v * m3::gpu::tc::pow2f(e), 1.0f, h, l);
  const double down = std::ldexp(1.0, -e);
  hi = __half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu))) * down;
  lo = __half2float(__ushort_as_half(static_cast<unsigned short>(l & 0xFFFFu))) * down;
}

TEST(TcSplitF16, TileExponentPutsTheMaxUnderTwoToTheFifteen) {
  using m3::gpu::tc::tile_exponent;
  std::mt19937_64 rng(17);
  for (int i = 0; i < 100000; ++i) {
    const float mx = std::abs(random_float(rng, -50, 64));
    const int e = tile_exponent(mx);
    const double scaled = std::ldexp(static_cast<double>(mx), e);
    ASSERT_GE(scaled, 16384.0) << "max=" << mx << " e=" << e;
    ASSERT_LT(scaled, 32768.0) << "max=" << mx << " e=" << e;
    ASSERT_EQ(static_cast<double>(m3::gpu::tc::pow2f(e)), std::ldexp(1.0, e));
  }
  EXPECT_EQ(tile_exponent(0.0f), 0);
  EXPECT_EQ(tile_exponent(1.0f), 14);
  EXPECT_EQ(tile_exponent(16384.0f), 0);
  EXPECT_EQ(tile_exponent(std::ldexp(1.0f, 100)), -64);  // clamped
  EXPECT_EQ(tile_exponent(std::ldexp(1.0f, -100)), 64);  // clamped
  EXPECT_EQ(tile_exponent(std::ldexp(1.0f, -140)), 64);  // subnormal
  EXPECT_EQ(tile_exponent(INFINITY), 0);
  EXPECT_EQ(tile_exponent(NAN), 0);
}

TEST(TcSplitF16, ScaledHiPlusLoCarriesTwentyTwoBitsOfTheTile) {
  std::mt19937_64 rng(19);
  std::uniform_int_distribution<int> top(-40, 40);
  double worst_rel = 0, worst_abs = 0;
  for (int tile = 0; tile < 2000; ++tile) {
    const int emax = top(rng);
    std::vector<float> v(256);
    float mx = 0.0f;
    for (float& x : v) {
      x = random_float(rng, emax - 40, emax);
      mx = std::max(mx, std::abs(x));
    }
    const int e = m3::gpu::tc::tile_exponent(mx);
    const double floor_abs = std::ldexp(static_cast<double>(mx), -39);
    for (float x : v) {
      double hi, lo;
      split_f16_scaled(x, e, hi, lo);
      const double err = std::abs(static_cast<double>(x) - hi - lo);
      const double bound = std::max(std::ldexp(std::abs(static_cast<double>(x)), -22), floor_abs);
      ASSERT_LE(err, bound) << "v=" << x << " max=" << mx << " e=" << e;
      if (std::abs(x) >= std::ldexp(mx, -17))  // lo normal: the relative bound is the one
        worst_rel = std::max(worst_rel, err / std::ldexp(std::abs(static_cast<double>(x)), -22));
      else
        worst_abs = std::max(worst_abs, err / floor_abs);
    }
  }
  EXPECT_GT(worst_rel, 0.25) << "relative bound far from the worst case: the test lost its teeth";
  EXPECT_GT(worst_abs, 0.25) << "absolute floor far from the worst case: the test lost its teeth";
}

TEST(TcSplitF16, TwoPassProductWithATypedValueWithinBound) {
  std::mt19937_64 rng(23);
  double worst = 0;
  for (int i = 0; i < 200000; ++i) {
    // a: an f16 storage value (exact in the planes); b: an f32 tile value, the tile's max mx.
    const float a = __half2float(__float2half(random_float(rng, -14, 14)));
    const float mx = std::abs(random_float(rng, -30, 30));
    const float b = std::min(std::abs(random_float(rng, -30, 30)), mx);
    const int e = m3::gpu::tc::tile_exponent(mx);
    double hi, lo;
    split_f16_scaled(b, e, hi, lo);
    const double exact = static_cast<double>(a) * b;
    const double two = static_cast<double>(a) * hi + static_cast<double>(a) * lo;
    const double bound =
        std::abs(static_cast<double>(a)) * std::max(std::ldexp(static_cast<double>(b), -22),
                                                    std::ldexp(static_cast<double>(mx), -39));
    ASSERT_LE(std::abs(two - exact), bound) << "a=" << a << " b=" << b << " max=" << mx;
    worst = std::max(worst, std::abs(two - exact) / bound);
  }
  EXPECT_GT(worst, 0.25) << "bound far from the worst case: the test lost its teeth";
}

TEST(TcSplitF16, NonFiniteValuesStayNonFinite) {
  double hi, lo;
  split_f16_scaled(INFINITY, 0, hi, lo);
  EXPECT_FALSE(std::isfinite(hi + lo));
  split_f16_scaled(NAN, 14, hi, lo);
  EXPECT_TRUE(std::isnan(hi + lo));
}

// ⌊n/d⌋ and n mod d of FastDiv against the plain division.
void expect_fast_div(m3::Idx d, m3::Idx n) {
  const m3::gpu::FastDiv f(d);
  m3::Idx q = -1;
  const m3::Idx r = f.divmod(n, q);
  ASSERT_EQ(q, n / d) << "n=" << n << " d=" << d;
  ASSERT_EQ(r, n % d) << "n=" << n << " d=" << d;
  if (n < (m3::Idx(1) << 31))  // the 32-bit form, for dividends below 2^31
    ASSERT_EQ(f.div(static_cast<unsigned>(n)), static_cast<unsigned>(n / d))
        << "n=" << n << " d=" << d << " (32-bit)";
}

TEST(FastDiv, ExactForEveryDivisorAndTheEndsOfTheFastRange) {
  std::vector<m3::Idx> ds;
  for (m3::Idx d = 1; d <= 4096; ++d) ds.push_back(d);
  for (int k = 12; k <= 31; ++k)
    for (m3::Idx delta : {-1, 0, 1})
      if ((m3::Idx(1) << k) + delta < (m3::Idx(1) << 31)) ds.push_back((m3::Idx(1) << k) + delta);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<m3::Idx> big(2, (m3::Idx(1) << 31) - 1);
  for (int i = 0; i < 2000; ++i) ds.push_back(big(rng));
  const m3::Idx top = (m3::Idx(1) << 31) - 1;
  std::uniform_int_distribution<m3::Idx> any(0, top);
  for (m3::Idx d : ds) {
    for (m3::Idx n : {m3::Idx(0), m3::Idx(1), d - 1, d, d + 1, 2 * d - 1, top, top - 1,
                      top - (top % d), top + 1, top + 2, m3::Idx(1) << 40, (m3::Idx(1) << 40) + 3})
      if (n >= 0) expect_fast_div(d, n);
    for (int i = 0; i < 64; ++i) expect_fast_div(d, any(rng));
    // The multiples of d and their neighbours near the top of the fast range.
    for (m3::Idx n = top - (top % d) - 2 * d; n <= top; n += d)
      if (n >= 1) {
        expect_fast_div(d, n - 1);
        expect_fast_div(d, n);
      }
  }
}

TEST(FastDiv, RejectsADivisorOutOfRange) {
  EXPECT_THROW(m3::gpu::FastDiv(0), m3::Error);
  EXPECT_THROW(m3::gpu::FastDiv(m3::Idx(1) << 31), m3::Error);
}

}  // namespace
