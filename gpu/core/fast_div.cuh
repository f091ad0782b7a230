// Internal to gpu/ (.cu files only): integer division by a divisor fixed at launch, with one
// high multiply and a shift instead of a division sequence (Granlund–Montgomery).
//
// For 2 ≤ d < 2^31, with l = ⌈log2 d⌉, p = 31 + l and m = ⌈2^p / d⌉ (< 2^32):
//   ⌊n / d⌋ = ⌊n·m / 2^p⌋ = umulhi(n, m) >> (p − 32)   for every 0 ≤ n < 2^31.
// Why: m·d = 2^p + e with 0 ≤ e < d ≤ 2^l, so n·m / 2^p = n/d + n·e/(d·2^p) and, for n < 2^31,
// n·e < 2^p: the excess is below 1/d, which cannot carry n/d = q + r/d (r ≤ d − 1) past q + 1.
// d = 1 is exact without the multiply. Dividends of 2^31 or more (shapes past 2^31 elements)
// take the ordinary 64-bit division, so every Idx ≥ 0 works; the branch is uniform in practice.
#pragma once

#include <cuda_runtime.h>

#include "config.hpp"
#include "error.hpp"

namespace m3::gpu {

class FastDiv {
 public:
  FastDiv() = default;
  explicit FastDiv(Idx divisor) : d_(divisor) {
    M3_REQUIRE(divisor >= 1 && divisor < (Idx(1) << 31), "gpu::FastDiv", "divisor out of range",
               "d=", divisor, " (needs 1 ≤ d < 2^31)");
    if (divisor == 1) return;
    int l = 0;
    while ((Idx(1) << l) < divisor) ++l;
    const int p = 31 + l;
    m_ = static_cast<unsigned>(((1ull << p) + static_cast<unsigned long long>(divisor) - 1) /
                               static_cast<unsigned long long>(divisor));
    shift_ = p - 32;
  }
  // Host and device (the host form is what tests/gpu/test_tc_split.cu checks in CI).
  __host__ __device__ __forceinline__ Idx div(Idx n) const {
    if (d_ == 1) return n;
    if (n < (Idx(1) << 31)) return Idx(umulhi(static_cast<unsigned>(n), m_) >> shift_);
    return n / d_;
  }
  // The same for a 32-bit dividend n < 2^31 (no 64-bit fallback).
  __host__ __device__ __forceinline__ unsigned div(unsigned n) const {
    return d_ == 1 ? n : umulhi(n, m_) >> shift_;
  }
  // q = ⌊n / d⌋, returns n − q·d.
  __host__ __device__ __forceinline__ Idx divmod(Idx n, Idx& q) const {
    q = div(n);
    return n - q * d_;
  }
  __host__ __device__ Idx divisor() const { return d_; }

 private:
  __host__ __device__ static unsigned umulhi(unsigned a, unsigned b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
#endif
  }
  Idx d_ = 1;
  unsigned m_ = 0;
  int shift_ = 0;
};

}  // namespace m3::gpu
