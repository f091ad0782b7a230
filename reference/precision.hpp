// Storage precisions and exact round-to-nearest-even conversions to bf16 and f16
// (MODEL.md §8: "typed" tensors are rounded to bf16/f16 where the GPU stores them).
//
//   bf16: 1 sign, 8 exponent, 7 mantissa bits — the upper half of an IEEE float
//   f16 : 1 sign, 5 exponent, 10 mantissa bits; max 65504, min normal 2⁻¹⁴, min subnormal 2⁻²⁴
// float → typed rounds to nearest, ties to even; overflow gives ±inf (f16: |x| ≥ 65520);
// NaN stays NaN (quiet, sign kept); f16 subnormals are produced exactly; −0 keeps its sign.
#pragma once

#include <cstdint>
#include <string>

namespace m3 {

enum class Precision { F64, F32, BF16, F16 };

const char* precision_name(Precision p);          // "f64" | "f32" | "bf16" | "f16"
Precision parse_precision(const std::string& s);  // throws m3::Error on anything else

// The IEEE-754 bits of a float, and the float of given bits (a memcpy: no aliasing).
std::uint32_t float_bits(float f);
float bits_float(std::uint32_t u);

std::uint16_t float_to_bf16_bits(float f);
float bf16_bits_to_float(std::uint16_t h);
std::uint16_t float_to_f16_bits(float f);
float f16_bits_to_float(std::uint16_t h);

// The value after a store to (and load from) the typed format.
inline float round_bf16(float f) { return bf16_bits_to_float(float_to_bf16_bits(f)); }
inline float round_f16(float f) { return f16_bits_to_float(float_to_f16_bits(f)); }

}  // namespace m3
