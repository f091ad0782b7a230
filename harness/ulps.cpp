// Ulps per storage precision (see ulps.hpp).
#include "ulps.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "error.hpp"

namespace m3::harness {

int mantissa_bits(Precision p) {
  switch (p) {
    case Precision::F64: return 52;
    case Precision::F32: return 23;
    case Precision::BF16: return 7;
    case Precision::F16: return 10;
  }
  return 23;
}

double min_normal(Precision p) {
  switch (p) {
    case Precision::F64: return 0x1p-1022;
    case Precision::F32: return 0x1p-126;
    case Precision::BF16: return 0x1p-126;  // bf16 has f32's exponent range
    case Precision::F16: return 0x1p-14;
  }
  return 0x1p-126;
}

double ulp_of(double x, Precision p) {
  const double a = std::fmax(std::fabs(x), min_normal(p));
  if (!std::isfinite(a)) return std::numeric_limits<double>::infinity();
  // a ≥ min_normal(p) ≥ 2^-1022 is a normal double: ilogb(a) is its biased exponent − 1023, and
  // 2^(e − mantissa bits) is built from its bits unless it falls below the normal range (f64 near
  // 2^-1022 only), which ldexp handles. Per element of every compared tensor, so without libm.
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
