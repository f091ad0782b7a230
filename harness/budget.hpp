// The pass rule (HARNESS.md §4) and the ONE tolerance table of the project (stage × precision).
//
// A tensor passes when, for both e = rel_l2 and e = max_abs,
//
//     e(subject, oracle) ≤ k · e(baseline, oracle) + floor_e
//
//   k              = 2 for f32, 3 for bf16 / f16
//   floor_rel_l2   = depth · the table's floor for (stage, tensor, scan mode, precision)
//   floor_max_abs  = floor_rel_max · max|oracle|   (a zero oracle, max|oracle| ≤ 1e-10, gives
//                    floor_rel_max · 1: an absolute floor on the unit scale, matching rel_l2's
//                    zero-oracle fallback in metrics.hpp), times depth as well
//   depth          = max(1, n_layers / 4): the floors are calibrated on the 4-layer default,
//                    and float error in the residual stack grows about linearly with depth
//                    (measured: layer 3 ≈ 3× layer 0, forward and backward alike)
//
// Without a baseline (the f32 reference compared with the double oracle, where the subject IS
// the baseline; and every isolated comparison, where the end-to-end baseline would measure
// something else) e(baseline, oracle) is taken as 0 and the floor alone decides. Isolated
// comparisons take their floors from the isolated section of the table: a stage fed the
// oracle's inputs errs by its own rounding only, far less than the end-to-end floors allow
// (those hold error propagated through layers and time), so a broken stage must fail there. Headroom is
// reported as e / budget in percent (100 % = at the limit); a cell's %budget is the larger of
// its two percentages. Non-finite subject values make e = +Inf, which no budget passes.
//
// Table lookup: the most specific row wins — (stage, tensor) over (stage, "*") over the
// default ("*", "*"); a row for one scan mode over a row for both. Parameter gradients use the
// stage name "grad" and their parameter name as the tensor.
#pragma once

#include <string>
#include <vector>

#include "config.hpp"
#include "metrics.hpp"
#include "ulps.hpp"
#include "registry.hpp"

namespace m3::harness {

// The two ways of running a comparison (HARNESS.md §2): end to end (every implementation runs
// the whole backbone) or isolated (teacher-forced: each subject stage is fed the oracle's
// inputs, rounded to its storage, and only its own outputs are compared).
enum class CompareMode { EndToEnd, Isolated };
const char* compare_mode_name(CompareMode m);  // "e2e" | "isolated"

struct Floors {
  double rel_l2;   // floor on rel_l2
  double rel_max;  // floor on max_abs, as a fraction of max|oracle|
};

struct ToleranceRow {
  const char* stage;   // registry stage ("F6", "B6", "norm_f", …), "grad", or "*"
  const char* tensor;  // tensor or parameter name, or "*"
  Modes modes;         // scan modes the row applies to
  Floors f32, bf16, f16;
  const char* reason;  // why this row differs from its section's default (empty only for the
                       // end-to-end default, the table's first row)
  CompareMode cmp = CompareMode::EndToEnd;  // the section: end-to-end or isolated floors
};

// Every row: the end-to-end section (its default first), then the isolated section (its
// default first). Each section is searched on its own.
const std::vector<ToleranceRow>& tolerance_table();

// The row that applies to (stage, tensor) in `mode` for comparison mode `cmp` (never fails:
// each section's default row matches all).
const ToleranceRow& find_tolerance(const std::string& stage, const std::string& tensor,
                                   ScanMode mode, CompareMode cmp = CompareMode::EndToEnd);

double k_factor(Precision p);
const Floors& floors_of(const ToleranceRow& row, Precision p);

struct Budget {
  Precision precision = Precision::F32;
  double k = 0;
  double depth = 1;
  double floor_rel_l2 = 0, floor_max_abs = 0;
  double baseline_rel_l2 = 0, baseline_max_abs = 0;  // 0 without a baseline
  double rel_l2 = 0, max_abs = 0;                    // the limits
  const ToleranceRow* row = nullptr;
};

constexpr double kCalibratedLayers = 4;
double depth_factor(const Config& cfg);  // max(1, n_layers / kCalibratedLayers)

// `baseline` may be null (no baseline run: its error counts as 0). `depth` = depth_factor(cfg).
Budget make_budget(const ToleranceRow& row, Precision p, const Metrics& subject,
                   const Metrics* baseline, double depth = 1.0);

struct Verdict {
  bool pass = false;
  double pct_rel_l2 = 0, pct_max_abs = 0;  // error / limit · 100
  double pct() const { return pct_rel_l2 > pct_max_abs ? pct_rel_l2 : pct_max_abs; }
};

Verdict judge(const Metrics& subject, const Budget& budget);

}  // namespace m3::harness
