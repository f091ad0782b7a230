// Units in the last place of each storage type, for the ulps metric (HARNESS.md §3). The
// precision enum itself is m3::Precision (reference/precision.hpp), shared with the reference.
//
//   mantissa bits (explicit):  f64 52, f32 23, bf16 7, f16 10
//   ulp(x) = 2^(e − m), e = floor(log2 max(|x|, min_normal)), m = mantissa bits
//   (subnormal subjects are measured in ulps of the smallest normal: one value, no 0/0).
#pragma once

#include "precision.hpp"  // reference/: m3::Precision, precision_name, parse_precision

namespace m3::harness {

int mantissa_bits(Precision p);
double min_normal(Precision p);
double ulp_of(double x, Precision p);  // the spacing of storage type p at |x|

}  // namespace m3::harness
