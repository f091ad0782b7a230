// bf16 / f16 conversions (see precision.hpp). Bit manipulation on the IEEE float encoding.
#include "precision.hpp"

#include <cmath>
#include <cstring>

#include "error.hpp"

namespace m3 {

std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::F64: return "f64";
    case Precision::F32: return "f32";
    case Precision::BF16: return "bf16";
    case Precision::F16: return "f16";
  }
  return "?";
}

Precision parse_precision(const std::string& s) {
  if (s == "f64") return Precision::F64;
  if (s == "f32") return Precision::F32;
  if (s == "bf16") return Precision::BF16;
  if (s == "f16") return Precision::F16;
  throw Error("precision", "unknown precision '" + s + "'", "expected f64, f32, bf16 or f16");
}

std::uint16_t float_to_bf16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)  // NaN: keep sign, force quiet
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  // Adding 0x7FFF plus the lowest kept bit rounds to nearest, ties to even; a carry out of the
  // mantissa increments the exponent, and from the largest finite value reaches inf.
  const std::uint32_t rounded = u + 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(rounded >> 16);
}

float bf16_bits_to_float(std::uint16_t h) { return bits_float(static_cast<std::uint32_t>(h) << 16); }

std::uint16_t float_to_f16_bits(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u)  // NaN: quiet, top mantissa bits kept
    return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x03FFu));
  if (a >= 0x477FF000u)  // ≥ 65520 (halfway 65504 ↔ 65536, ties to even = up) or inf
    return static_cast<std::uint16_t>(sign | 0x7C00u);
  if (a < 0x38800000u) {  // below 2⁻¹⁴: f16 subnormal m·2⁻²⁴ (or zero)
    // Scaling by 2²⁴ is exact; nearbyint rounds half to even in the default rounding mode.
    const float scaled = bits_float(a) * 16777216.0f;
    const auto m = static_cast<std::uint16_t>(std::nearbyint(scaled));
    return static_cast<std::uint16_t>(sign | m);  // m = 1024 encodes the smallest normal
  }
  const std::uint32_t exp = (a >> 23) - 127 + 15;
  const std::uint32_t mant = a & 0x007FFFFFu;
  std::uint32_t h = (exp << 10) | (mant >> 13);
  const std::uint32_t rem = mant & 0x1FFFu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // carry may bump the exponent
  return static_cast<std::uint16_t>(sign | h);
}

float f16_bits_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  const std::uint32_t mant = h & 0x03FFu;
  if (exp == 0) {  // zero or subnormal: mant·2⁻²⁴, exact in float
    const float v = static_cast<float>(mant) * 0x1.0p-24f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_float(sign | 0x7F800000u | (mant << 13));
  return bits_float(sign | ((exp - 15 + 127) << 23) | (mant << 13));
}

}  // namespace m3
