// Terminal reports (HARNESS.md §5).
//
// compare: a header (oracle, subject and baseline per precision, device, config, run shape,
// seed, entering states, scan modes, filter, comparison modes, the pass rule), then ONE table —
// a row per stage/tensor key in execution order (the union of the cells' keys; a key a cell
// lacks shows "-" there), a column group per (precision, scan mode), precision-major, each
// holding rel_l2 and %budget (with --wide: max_abs, rel_l2, p95_rel, %budget) and a flag on
// failure. With both comparison modes (e2e and isolated, HARNESS.md §2) each group has two
// sub-columns side by side, "e2e" and "iso", separated by ":" (groups by "|"), so that the
// stage that ADDS the error (failing iso) stands out from those that only amplify it (failing
// e2e alone):
//
//                   |                  f32 seq                  | …
//                   |         e2e          :         iso          | …
//   key             |   rel_l2 %budget      :   rel_l2 %budget      | …
//
// Flags:
//
//   FAIL over budget   NAN subject NaN/Inf where the oracle is finite   MISS not captured
//   SHPE shape differs   ORCL oracle (or baseline) missing or unusable
//
// then one detail line per failure (worst element's decoded coordinates, oracle and subject
// values, budget, cosine, max_rel, ulps), one line per cell (counts and the tightest passing
// %budget), a line naming the first key in execution order whose subject holds NaN/Inf where
// the oracle is finite (only when there is one; never hidden behind an earlier failure), and a
// summary line naming the FIRST FAILING STAGE in execution order (forward, then backward) and
// the cells it fails in:
//
//   first non-finite: <key> (<cells>): <n> NaN, <m> Inf in the subject where the oracle is finite
//   summary: PASS all <n> tensor checks within budget (f32: seq …, chunked …; bf16: …)
//   summary: FAIL first failing stage: <key> [<precision> <mode>, …] (<status>: <why>); …
//
// With both comparison modes: a "first non-finite e2e|isolated" line per mode that has one, a
// "summary e2e: …" and a "summary isolated: …" line (each naming its first failing stage), a
// "diagnosis: …" line (the isolated failure = the broken stage; or, when every stage passes
// isolated, the end-to-end failure = amplified upstream error), and a last line
// "summary: PASS|FAIL (e2e PASS|FAIL, isolated PASS|FAIL); <n> of <m> tensor checks failed".
// Isolated cells are named "<precision> <mode> iso" ("bf16 chunked iso").
//
// Fitting a terminal: ReportOptions::width (m3h compare: the terminal's width, or 100 for a
// log; none with --wide).
//
// bench: a header and a table of precision, scan, forward ms, backward ms, tokens/s.
// Every line is plain ASCII with fixed-width columns so that grep/awk can read it.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "bench.hpp"
#include "run.hpp"

namespace m3::harness {

struct ReportOptions {
  bool failures_only = false;  // table rows only for keys that fail in some cell
  bool details = false;        // a worst-element line for every row, not only failures
  bool wide = false;           // max_abs, rel_l2, p95_rel, %budget per cell
  // Columns the report must fit (0: no limit). The table is then cut into blocks of whole
  // (precision, scan mode) groups, each block repeating the key column and headed like the
  // whole table, one after another with a blank line between; the other lines are broken at
  // spaces, the continuation indented by two. A single group wider than the limit keeps its
  // width.
  int width = 0;
};

// The pass rule a comparison applied (budget.hpp), derived from its lineups: the limit in
// words for the end-to-end and the isolated cells, and what their baselines are.
struct RuleSummary {
  std::string e2e, iso;               // e.g. "2*baseline + floor (k=2 f32, 3 bf16/f16)"
  BaselineKind e2e_kind = BaselineKind::SamePrecision;
  bool e2e_baseline = false;          // some lineup has an end-to-end baseline
  bool e2e_conditioning = false;      // … and the perturbed oracle's conditioning term
  bool iso_baseline = false;          // the isolated cells have the perturbed oracle
  int coherent_draws = 0;             // a token model's second kind of draws (budget.hpp)
};
RuleSummary rule_summary(const Comparison& c);

void print_compare_header(std::ostream& os, const Comparison& c, const ReportOptions& opt = {});
void print_compare_table(std::ostream& os, const Comparison& c, const ReportOptions& opt = {});
void print_compare_summary(std::ostream& os, const Comparison& c, const ReportOptions& opt = {});
// Header, table, summary.
void print_compare(std::ostream& os, const Comparison& c, const ReportOptions& opt = {});

// The cell label "f32 seq", "bf16 chunked", "f16 seq iso" (isolated).
std::string cell_name(const CompareResult& r);
// The (precision, scan mode) group label: "f32 seq".
std::string group_name(const CompareResult& r);

// Keys of all cells merged in execution order (each cell's keys keep their relative order).
std::vector<std::string> merged_keys(const Comparison& c);

void print_bench(std::ostream& os, const BenchSpec& spec, const std::vector<BenchRow>& rows);

// "1.23e-05", "inf", "nan".
std::string fmt_sci(double v);
// "45.1%", "inf%", ">99999%".
std::string fmt_pct(double p);

}  // namespace m3::harness
