// The comparison metrics of the test suite, defined once: by harness/metrics (HARNESS.md §3),
// the same functions that judge a real comparison run. A test that compares a subject `a`
// with an oracle `b` reads the numbers of m3::harness::compute_metrics(b, a) through these:
//
//   metrics(a, b)       the whole harness::Metrics of a against b (flat, n elements)
//   rel_l2(a, b)        Metrics::rel_l2 = ‖a − b‖₂ / ‖b‖₂; for a zero oracle (max|b| ≤
//                       harness::kZeroOracle) rms(a − b), the harness's fallback
//   max_abs_err(a, b)   Metrics::max_abs = max |a − b|
//   max_rel_err(a, b)   max |a − b| / max|b|, or max |a − b| for a zero oracle: the scale the
//                       harness budget puts under its max_abs floor (oracle_scale, or 1)
//   rel_l2_vs, max_rel_err_vs   the same with the scale max(own norm, a reference norm), for
//                       tensors whose exact value can vanish by cancellation (test_util.hpp
//                       scale_key_for): the harness metrics' Δ norms over a wider scale
//   l2_norm, inf_norm   the norms of one tensor (the reference norms of the _vs variants)
//
// circular = true takes Δ as the signed circular distance remainder(a − b, 2π) (angles), as the
// harness does for spec.circular tensors. A NaN or ±Inf anywhere (in a, or in the oracle b, whose
// non-finite elements the harness counts apart) reads as +Inf, so that no bound passes it.
// Each metric takes (pointer, pointer, n) or two containers of values convertible to double.
// Tests that link this header link m3_harness.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "capture.hpp"
#include "metrics.hpp"

namespace m3::test {

inline harness::Metrics metrics(const double* a, const double* b, size_t n,
                                bool circular = false) {
  Tensor oracle, subject;
  oracle.shape = subject.shape = {static_cast<Idx>(n)};
  oracle.data.assign(b, b + n);
  subject.data.assign(a, a + n);
  return harness::compute_metrics(oracle, subject, circular);
}

constexpr double kInfinity = std::numeric_limits<double>::infinity();

// The three numbers of one Metrics, +Inf when anything was not finite.
inline double rel_l2(const harness::Metrics& m) { return m.finite() ? m.rel_l2 : kInfinity; }
inline double max_abs_err(const harness::Metrics& m) {
  return m.finite() ? m.max_abs : kInfinity;
}
// max|Δ| over the oracle's scale (max|b|, or 1 for a zero oracle, as the harness budget).
inline double max_rel_err(const harness::Metrics& m) {
  return m.finite() ? m.max_abs / (m.zero_oracle() ? 1.0 : m.oracle_scale) : kInfinity;
}

inline double rel_l2(const double* a, const double* b, size_t n, bool circular = false) {
  return rel_l2(metrics(a, b, n, circular));
}
inline double max_abs_err(const double* a, const double* b, size_t n, bool circular = false) {
  return max_abs_err(metrics(a, b, n, circular));
}
inline double max_rel_err(const double* a, const double* b, size_t n, bool circular = false) {
  return max_rel_err(metrics(a, b, n, circular));
}

inline double l2_norm(const double* a, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += a[i] * a[i];
  return std::sqrt(s);
}
inline double inf_norm(const double* a, size_t n) {
  double m = 0;
  for (size_t i = 0; i < n; ++i) m = std::max(m, std::abs(a[i]));
  return m;
}

// The harness's ‖Δ‖₂ over max(‖b‖₂, ref_l2) where the reference norm is the larger; otherwise
// exactly rel_l2 (the harness's own, zero-oracle fallback included). This differs from rel_l2
// on purpose: a tensor that cancels to near zero in one computation is judged at the scale of
// the tensor it cancels from, not at its own.
inline double rel_l2_vs(const double* a, const double* b, size_t n, double ref_l2,
                        bool circular = false) {
  const harness::Metrics m = metrics(a, b, n, circular);
  if (!m.finite() || !(ref_l2 > m.oracle_l2)) return rel_l2(m);
  return m.diff_l2 / ref_l2;
}
// max|Δ| over max(max|b|, ref_inf) where the reference is the larger; otherwise max_rel_err.
inline double max_rel_err_vs(const double* a, const double* b, size_t n, double ref_inf,
                             bool circular = false) {
  const harness::Metrics m = metrics(a, b, n, circular);
  if (!m.finite() || !(ref_inf > m.oracle_scale)) return max_rel_err(m);
  return m.max_abs / ref_inf;
}

// Container forms: both widened to double, compared over the shorter length.
template <class A, class B>
harness::Metrics metrics(const A& a, const B& b, bool circular = false) {
  const std::vector<double> da(a.begin(), a.end()), db(b.begin(), b.end());
  return metrics(da.data(), db.data(), std::min(da.size(), db.size()), circular);
}
template <class A, class B>
double max_abs_err(const A& a, const B& b, bool circular = false) {
  return max_abs_err(metrics(a, b, circular));
}
template <class A, class B>
double max_rel_err(const A& a, const B& b, bool circular = false) {
  return max_rel_err(metrics(a, b, circular));
}
template <class A, class B>
double rel_l2(const A& a, const B& b, bool circular = false) {
  return rel_l2(metrics(a, b, circular));
}

}  // namespace m3::test
