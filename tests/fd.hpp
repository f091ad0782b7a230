// Shared helpers of the test suite: central finite differences in double.
//
//   fd_step(x)          h = 1e-6 · max(1, |x|)
//   central_diff(x, f)  (f(x+h) − f(x−h)) / (2h), x restored afterwards; f re-reads x
//   central_diff5(x, f) five-point stencil, O(h⁴) truncation (for short length scales)
//   circ_diff(a, b)     remainder(a − b, 2π) ∈ [−π, π], the FD difference of an angle output
//   sample_indices      all of [0, n) when n ≤ k, else k distinct seeded indices (sorted)
//
// The error metrics (rel_l2, max_abs_err, max_rel_err and their _vs forms) are test_compare.hpp's,
// computed by harness/metrics.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

namespace m3::test {

constexpr double kFdRelStep = 1e-6;
constexpr double kTestTwoPi = 6.283185307179586476925286766559;
constexpr double kTestPi = 3.141592653589793238462643383280;

inline double fd_step(double x) { return kFdRelStep * std::max(1.0, std::abs(x)); }

// Central finite difference of f() with respect to the scalar x (which f reads by reference),
// also reporting the two function values (to detect discontinuities such as the angle wrap: a
// jump of |fp − fm| far above |df·2h| means the FD straddled a discontinuity). x is restored
// bit-exactly afterwards. Uses the actually representable step (x+h) − (x−h).
struct FdSample {
  double deriv, f_plus, f_minus, h;
};
template <class F>
FdSample central_diff_sample(double& x, F&& f, double h = -1.0) {
  const double x0 = x;
  if (h <= 0) h = fd_step(x0);
  const double xp = x0 + h, xm = x0 - h;
  x = xp;
  const double fp = f();
  x = xm;
  const double fm = f();
  x = x0;
  return {(fp - fm) / (xp - xm), fp, fm, xp - xm};
}

// The derivative alone.
template <class F>
double central_diff(double& x, F&& f, double h = -1.0) {
  return central_diff_sample(x, std::forward<F>(f), h).deriv;
}

// Fourth-order central difference (five-point stencil):
//   f'(x) ≈ (−f(x+2h) + 8 f(x+h) − 8 f(x−h) + f(x−2h)) / 12h,   truncation O(h⁴·f⁽⁵⁾)
// Use it where the function has a short length scale ℓ (e.g. an RMSNorm of a nearly-zero row),
// so that the O(h²·f‴) error of the two-point formula is not negligible at a step large
// enough to keep the round-off error ε·|f|/h small. Reports the spread of the four values
// (max − min) so that a caller can detect a step across a discontinuity.
struct Fd5Sample {
  double deriv, spread, h;
};
template <class F>
Fd5Sample central_diff5(double& x, F&& f, double h = -1.0) {
  const double x0 = x;
  if (h <= 0) h = fd_step(x0);
  x = x0 + 2 * h;
  const double f2p = f();
  x = x0 + h;
  const double f1p = f();
  x = x0 - h;
  const double f1m = f();
  x = x0 - 2 * h;
  const double f2m = f();
  x = x0;
  const double lo = std::min(std::min(f2p, f1p), std::min(f1m, f2m));
  const double hi = std::max(std::max(f2p, f1p), std::max(f1m, f2m));
  return {(-f2p + 8 * f1p - 8 * f1m + f2m) / (12 * h), hi - lo, h};
}

// Signed circular difference in [−π, π]: the nearest multiple of 2π removed (IEEE remainder).
// (MODEL.md/HARNESS.md write "remainder(Δ+π, 2π) − π", which is this with a floor modulo.)
inline double circ_diff(double a, double b) { return std::remainder(a - b, kTestTwoPi); }

// Seeded subset of [0, n): everything when n ≤ k, else k distinct indices (sorted).
// SplitMix64 so the subset is the same on every platform.
inline std::vector<size_t> sample_indices(size_t n, size_t k, std::uint64_t seed) {
  std::vector<size_t> all(n);
  std::iota(all.begin(), all.end(), size_t{0});
  if (n <= k) return all;
  std::uint64_t s = seed;
  auto next = [&s]() {
    std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (size_t i = 0; i < k; ++i) {  // partial Fisher–Yates
    const size_t j = i + static_cast<size_t>(next() % (n - i));
    std::swap(all[i], all[j]);
  }
  all.resize(k);
  std::sort(all.begin(), all.end());
  return all;
}

}  // namespace m3::test
