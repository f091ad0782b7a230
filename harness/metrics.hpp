// Error metrics of one subject tensor against its oracle (HARNESS.md §3).
//
// With o = oracle, s = subject (same shape, n elements, both widened to double):
//
//   Δᵢ        = sᵢ − oᵢ; for circular tensors (angles in [0, 2π), spec.circular) the signed
//               circular distance Δᵢ = remainder(sᵢ − oᵢ, 2π) ∈ [−π, π] (C/IEEE remainder:
//               nearest multiple of 2π removed). This is HARNESS.md's "remainder(Δ+π, 2π) − π"
//               read with a floor modulo (Python's %); with the C remainder() that literal
//               formula would be off by −2π for every Δ > 0.
//   ŝᵢ        = oᵢ + Δᵢ, the subject moved onto the oracle's branch (ŝ = s unless circular)
//   max_abs   = maxᵢ |Δᵢ|, with the flat index of the (first) worst element
//   rel_l2    = ‖Δ‖₂ / ‖o‖₂. A "zero oracle" (max|o| ≤ kZeroOracle = 1e-10: zero up to the
//               double round-off of a cancelling sum, e.g. the gradient wrt the entering angle
//               state with zero entering states, which is 0 by rotation symmetry) has no scale
//               to divide by: rel_l2 then falls back to rms(Δ) = ‖Δ‖₂/√n, the error relative to
//               a unit per-element scale — the natural scale of this model's normalised
//               activations and gradients — and rel_l2_absolute is set. A correct subject of a
//               zero tensor still reads 0, and any deviation reads as its own size.
//   rel set   R = { i : |oᵢ| ≥ 1e-2 }  (the threshold of the official Mamba-3 tests)
//   p95_rel   = the 95th percentile of |Δᵢ|/|oᵢ| over R, nearest rank:
//               sort ascending, take element ⌈0.95·|R|⌉ − 1; 0 when R is empty
//   max_rel   = max over R of |Δᵢ|/|oᵢ|; 0 when R is empty
//   cosine    = Σ ŝᵢoᵢ / (‖ŝ‖₂‖o‖₂); 1 when both are zero, 0 when exactly one is
//   ulps      = |Δᵢ| / ulp_p(oᵢ) in the subject's storage precision p (ulps.hpp), over R
//               (near zero one ulp is ~1e-45 and any round-off reads as 1e30 ulps):
//               max_ulps and mean_ulps; 0 when R is empty
//   nan/inf   = elements where the subject is NaN (resp. ±Inf) and the oracle is finite
//   oracle_nonfinite = elements where the oracle itself is not finite (a reference bug)
//
// Only elements where both values are finite enter the sums; when the subject has any
// non-finite element where the oracle is finite, max_abs, rel_l2, p95_rel and max_rel are
// +Inf so that no budget can pass it. oracle_scale = maxᵢ |oᵢ| is returned for the budget
// (budget.hpp: floor_max_abs = floor_rel_max · oracle_scale, or · 1 for a zero oracle).
//
// decode_index() names the coordinates of a flat row-major index from the registry's
// symbolic shape (registry.hpp), e.g. [BT, NH, HD] and index 1234 → "b=0 t=77 h=2 p=2".
#pragma once

#include <string>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "ulps.hpp"
#include "registry.hpp"

namespace m3::harness {

constexpr double kRelThreshold = 1e-2;  // |oracle| ≥ this enters p95_rel / max_rel
constexpr double kZeroOracle = 1e-10;   // max|oracle| ≤ this: a zero oracle (see above)

struct Metrics {
  Idx numel = 0;
  double max_abs = 0;        // max |Δ|
  Idx worst_index = -1;      // flat index of max |Δ| (-1 when numel = 0)
  double worst_oracle = 0;   // oracle and subject values at worst_index
  double worst_subject = 0;
  double oracle_scale = 0;   // max |o|
  double oracle_l2 = 0;      // ‖o‖₂
  double diff_l2 = 0;        // ‖Δ‖₂
  double rel_l2 = 0;         // ‖Δ‖₂/‖o‖₂, or ‖Δ‖₂/√n when rel_l2_absolute
  bool rel_l2_absolute = false;
  double p95_rel = 0;
  double max_rel = 0;
  Idx rel_count = 0;         // |R|
  double cosine = 1;
  double max_ulps = 0;
  double mean_ulps = 0;
  Idx nan_count = 0;         // subject NaN where oracle finite
  Idx inf_count = 0;         // subject ±Inf where oracle finite
  Idx oracle_nonfinite = 0;

  bool zero_oracle() const { return !(oracle_scale > kZeroOracle); }
  bool finite() const { return nan_count == 0 && inf_count == 0 && oracle_nonfinite == 0; }
};

// The signed circular difference of two angles, in [−π, π].
double circular_diff(double subject, double oracle);

// Throws m3::Error when the shapes differ (the caller reports a mismatch before calling).
Metrics compute_metrics(const Tensor& oracle, const Tensor& subject, bool circular,
                        Precision storage = Precision::F32);

// The pass rule's two figures alone: numel, max_abs (with worst_index, worst_oracle and
// worst_subject), oracle_scale, oracle_l2, diff_l2, rel_l2 (rel_l2_absolute) and the non-finite
// counts, equal bit for bit to compute_metrics' (the same sums in the same order); p95_rel,
// max_rel, cosine and the ulps are left at their defaults. What a baseline draw is measured by:
// one pass without the relative-error set, several times cheaper.
Metrics error_norms(const Tensor& oracle, const Tensor& subject, bool circular);

// Row-major multi-index of `flat` in `shape`.
std::vector<Idx> unravel(Idx flat, const std::vector<Idx>& shape);

// Named coordinates of `flat` in a tensor of symbolic shape `syms` resolved to `shape` for
// (cfg, B, T): BT → b, t; B → b; T and Tp1 → t; NC → c; CS → tau (and t = c·cs + tau when the
// shape also has NC); NH → h; HD → p; DS → n; NG → g; NA → a; DI → d (and h, p); DM, IN → i;
// IP → j with its slice of the in_proj split (MODEL.md §2.1), e.g. "j=300 (x h=2 p=12)".
// `layer` ≥ 0 is prepended as "layer=ℓ". When syms and shape disagree in rank the result is
// the plain index list "[i0, i1, …]".
std::string decode_index(const std::vector<Sym>& syms, const std::vector<Idx>& shape, Idx flat,
                         const Config& cfg, Idx B, Idx T, int layer = -1);

}  // namespace m3::harness
