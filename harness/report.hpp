// Terminal reports (HARNESS.md §5).
//
// compare: a header (implementations, precision, device, config, B, T, seed, entering states,
// scan modes, filter), then ONE table — a row per stage/tensor key in execution order (the
// union of the scan modes' keys; a key one mode lacks shows "-" there), per scan mode the
// columns max_abs, rel_l2, p95_rel and %budget, a failing cell marked with its status word
// (FAIL, NONFINITE, MISSING, SHAPE, …) — then one detail line per failure (worst element's
// coordinates, oracle and subject values, which limit was exceeded), and a summary line:
//
//   summary: PASS all <n> tensors within budget (...)
//   summary: FAIL first failing stage: <key> [<mode>] (...)
//
// bench: a header and a table of precision, scan, forward ms, backward ms, tokens/s.
// Every line is plain ASCII with fixed-width columns so that grep/awk can read it.
#pragma once

#include <ostream>
#include <vector>

#include "bench.hpp"
#include "run.hpp"

namespace m3::harness {

struct ReportOptions {
  bool failures_only = false;  // table rows only for keys that fail in some mode
  bool details = false;        // a worst-element line for every row, not only failures
};

void print_compare_header(std::ostream& os, const Comparison& c);
void print_compare_table(std::ostream& os, const Comparison& c, const ReportOptions& opt = {});
void print_compare_summary(std::ostream& os, const Comparison& c);
// Header, table, summary.
void print_compare(std::ostream& os, const Comparison& c, const ReportOptions& opt = {});

void print_bench(std::ostream& os, const BenchSpec& spec, const std::vector<BenchRow>& rows);

// "1.23e-05", "inf", "nan" (width 9).
std::string fmt_sci(double v);

}  // namespace m3::harness
