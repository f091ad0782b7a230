// Terminal reports (HARNESS.md §5).
//
// compare: a header (oracle, subject and baseline per precision, device, config, run shape,
// seed, entering states, scan modes, filter, the pass rule), then ONE table — a row per
// stage/tensor key in execution order (the union of the cells' keys; a key a cell lacks shows
// "-" there), a column group per (precision, scan mode) cell, precision-major, each holding
// rel_l2 and %budget (with --wide: max_abs, rel_l2, p95_rel, %budget) and a flag on failure:
//
//   FAIL over budget   NAN subject NaN/Inf where the oracle is finite   MISS not captured
//   SHPE shape differs   ORCL oracle (or baseline) missing or unusable
//
// then one detail line per failure (worst element's decoded coordinates, oracle and subject
// values, budget, cosine, max_rel, ulps), one line per cell (counts and the tightest passing
// %budget), and a summary line naming the FIRST FAILING STAGE in execution order (forward,
// then backward) and the cells it fails in:
//
//   summary: PASS all <n> tensor checks within budget (f32: seq …, chunked …; bf16: …)
//   summary: FAIL first failing stage: <key> [<precision> <mode>, …] (<status>: <why>); …
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
};

void print_compare_header(std::ostream& os, const Comparison& c);
void print_compare_table(std::ostream& os, const Comparison& c, const ReportOptions& opt = {});
void print_compare_summary(std::ostream& os, const Comparison& c);
// Header, table, summary.
void print_compare(std::ostream& os, const Comparison& c, const ReportOptions& opt = {});

// The cell label "f32 seq", "bf16 chunked".
std::string cell_name(const CompareResult& r);

// Keys of all cells merged in execution order (each cell's keys keep their relative order).
std::vector<std::string> merged_keys(const Comparison& c);

void print_bench(std::ostream& os, const BenchSpec& spec, const std::vector<BenchRow>& rows);

// "1.23e-05", "inf", "nan".
std::string fmt_sci(double v);
// "45.1%", "inf%", ">99999%".
std::string fmt_pct(double p);

}  // namespace m3::harness
