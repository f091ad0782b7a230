// Ulps per storage precision (see ulps.hpp).
#include "ulps.hpp"

#include <cmath>
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
    case Precision::F64: return std::ldexp(1.0, -1022);
    case Precision::F32: return std::ldexp(1.0, -126);
    case Precision::BF16: return std::ldexp(1.0, -126);  // bf16 has f32's exponent range
    case Precision::F16: return std::ldexp(1.0, -14);
  }
  return std::ldexp(1.0, -126);
}

double ulp_of(double x, Precision p) {
  const double a = std::fmax(std::fabs(x), min_normal(p));
  if (!std::isfinite(a)) return std::numeric_limits<double>::infinity();
  const int e = std::ilogb(a);
  return std::ldexp(1.0, e - mantissa_bits(p));
}

}  // namespace m3::harness
