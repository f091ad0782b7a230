// Units in the last place of each storage type, for the ulps metric (HARNESS.md §3); header
// only, inline (per element of every compared tensor). The
// precision enum itself is m3::Precision (reference/precision.hpp), shared with the reference.
//
//   mantissa bits (explicit):  f64 52, f32 23, bf16 7, f16 10
//   ulp(x) = 2^(e − m), e = floor(log2 max(|x|, min_normal)), m = mantissa bits
//   (subnormal subjects are measured in ulps of the smallest normal: one value, no 0/0).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "precision.hpp"  // reference/: m3::Precision, precision_name, parse_precision

namespace m3::harness {

inline int mantissa_bits(Precision p) {
  switch (p) {
    case Precision::F64: return 52;
    case Precision::F32: return 23;
    case Precision::BF16: return 7;
    case Precision::F16: return 10;
  }
  return 23;
}

inline double min_normal(Precision p) {
  switch (p) {
    case Precision::F64: return 0x1p-1022;
    case Precision::F32: return 0x1p-126;
    case Precision::BF16: return 0x1p-126;  // bf16 has f32's exponent range
    case Precision::F16: return 0x1p-14;
  }
  return 0x1p-126;
}

// The spacing of storage type p at |x|. Per element of every compared tensor, so inline and
// without libm.
inline double ulp_of(double x, Precision p) {
  const double mn = min_normal(p);
  const double ax = std::fabs(x);
  const double a = ax > mn ? ax : mn;  // fmax: a NaN x gives the smallest normal
  if (!std::isfinite(a)) return std::numeric_limits<double>::infinity();
  // a ≥ min_normal(p) ≥ 2^-1022 is a normal double: its biased exponent − 1023 is
  // floor(log2 a), and 2^(e − mantissa bits) is built from its bits unless it falls below the
  // normal range (f64 near 2^-1022 only), which ldexp handles.
  std::uint64_t bits = 0;
  std::memcpy(&bits, &a, sizeof bits);
  const int k = static_cast<int>((bits >> 52) & 0x7ff) - 1023 - mantissa_bits(p);
  if (k < -1022) return std::ldexp(1.0, k);
  const std::uint64_t r = static_cast<std::uint64_t>(k + 1023) << 52;
  double out = 0;
  std::memcpy(&out, &r, sizeof out);
  return out;
}

}  // namespace m3::harness
