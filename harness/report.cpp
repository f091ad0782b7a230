// Terminal reports (see report.hpp).
#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

namespace m3::harness {

namespace {

std::string printf_str(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::string pad_right(const std::string& s, size_t w) {
  return s.size() >= w ? s : s + std::string(w - s.size(), ' ');
}

std::string center(const std::string& s, size_t w) {
  if (s.size() >= w) return s;
  const size_t left = (w - s.size()) / 2;
  return std::string(left, ' ') + s + std::string(w - s.size() - left, ' ');
}

std::string rstrip(std::string s) {
  while (!s.empty() && s.back() == ' ') s.pop_back();
  return s;
}

// Four characters, for the compact cells (the legend is in report.hpp and the header).
const char* flag_of(Status s) {
  switch (s) {
    case Status::Pass: return "";
    case Status::OverBudget: return "FAIL";
    case Status::NonFinite: return "NAN";
    case Status::Missing: return "MISS";
    case Status::ShapeMismatch: return "SHPE";
    case Status::OracleMissing:
    case Status::OracleBad: return "ORCL";
  }
  return "?";
}

bool measured(const TensorResult& r) {
  return r.status == Status::Pass || r.status == Status::OverBudget ||
         r.status == Status::NonFinite || (r.status == Status::OracleBad && r.subject.numel > 0);
}

// Compact: rel_l2 (8) %budget (7) flag (4).   Wide: max_abs rel_l2 p95_rel %budget flag.
constexpr int kCompactWidth = 21;
constexpr int kWideWidth = 43;

std::string cell_text(const TensorResult* r, bool wide) {
  char buf[128];
  const char* flag = r ? flag_of(r->status) : "";
  if (!r || !measured(*r)) {
    if (wide)
      std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-4s", "-", "-", "-", "-", flag);
    else
      std::snprintf(buf, sizeof buf, "%8s %7s %-4s", "-", "-", flag);
    return buf;
  }
  const std::string pct = fmt_pct(r->verdict.pct());
  if (wide) {
    const std::string p95 = r->subject.rel_count > 0 ? fmt_sci(r->subject.p95_rel) : "-";
    std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-4s", fmt_sci(r->subject.max_abs).c_str(),
                  fmt_sci(r->subject.rel_l2).c_str(), p95.c_str(), pct.c_str(), flag);
  } else {
    std::snprintf(buf, sizeof buf, "%8s %7s %-4s", fmt_sci(r->subject.rel_l2).c_str(),
                  pct.c_str(), flag);
  }
  return buf;
}

using RowIndex = std::vector<std::map<std::string, const TensorResult*>>;  // per cell

RowIndex index_rows(const Comparison& c) {
  RowIndex idx(c.cells.size());
  for (size_t m = 0; m < c.cells.size(); ++m)
    for (const auto& r : c.cells[m].rows) idx[m][r.key] = &r;
  return idx;
}

template <class T, class F>
std::string join(const std::vector<T>& v, const char* sep, F&& f) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : sep) + std::string(f(x));
  return s;
}

void print_detail(std::ostream& os, const CompareResult& m, const TensorResult& r) {
  os << pad_right(r.pass() ? "ok" : status_name(r.status), 10) << "[" << cell_name(m) << "] "
     << r.key << ": ";
  if (!r.note.empty()) os << r.note << "; ";
  if (r.subject.worst_index >= 0) {
    os << "worst |d|=" << fmt_sci(r.subject.max_abs) << " at " << r.worst_coords << " (oracle "
       << printf_str("%.9e", r.subject.worst_oracle) << ", subject "
       << printf_str("%.9e", r.subject.worst_subject) << "); budget rel_l2 "
       << fmt_sci(r.budget.rel_l2) << " max_abs " << fmt_sci(r.budget.max_abs) << "; cosine "
       << printf_str("%.12f", r.subject.cosine) << "; p95_rel " << fmt_sci(r.subject.p95_rel)
       << "; max_rel " << fmt_sci(r.subject.max_rel) << "; ulps max "
       << printf_str("%.0f", r.subject.max_ulps) << " mean "
       << printf_str("%.1f", r.subject.mean_ulps);
    if (r.circular) os << "; circular";
    if (r.subject.rel_l2_absolute) os << "; zero oracle: rel_l2 is absolute";
  }
  os << "\n";
}

}  // namespace

std::string fmt_sci(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return printf_str("%.2e", v);
}

std::string fmt_pct(double p) {
  if (std::isnan(p)) return "nan%";
  if (std::isinf(p)) return "inf%";
  if (p >= 99999.5) return ">99999%";
  return printf_str("%.1f%%", p);
}

std::string cell_name(const CompareResult& r) {
  return std::string(precision_name(r.precision)) + " " + scan_mode_name(r.mode);
}

std::vector<std::string> merged_keys(const Comparison& c) {
  std::vector<std::string> merged;
  for (const auto& m : c.cells) {
    ptrdiff_t last = -1;
    for (const auto& r : m.rows) {
      auto it = std::find(merged.begin(), merged.end(), r.key);
      if (it != merged.end()) {
        last = it - merged.begin();
      } else {
        merged.insert(merged.begin() + (last + 1), r.key);
        ++last;
      }
    }
  }
  return merged;
}

void print_compare_header(std::ostream& os, const Comparison& c) {
  const RunSpec& s = c.spec;
  os << "m3h compare: oracle=" << c.oracle_name << " device=" << s.device << "\n";
  for (const Lineup& l : c.lineups)
    os << "  " << pad_right(precision_name(l.precision), 5) << "subject=" << l.subject.name
       << " baseline=" << (l.baseline ? l.baseline->name : "none") << "\n";
  os << "config: " << s.cfg.describe() << "\n";
  os << "run: source=" << s.source << " B=" << s.B << " T=" << s.T << " seed=" << s.seed
     << " entering_states=" << (s.random_states ? "random" : "zero")
     << " modes=" << join(s.modes, ",", scan_mode_name)
     << " precisions=" << join(c.lineups, ",", [](const Lineup& l) {
          return precision_name(l.precision);
        })
     << " stage=" << (s.filter.empty() ? "*" : s.filter) << "\n";
  bool any_baseline = false;
  for (const Lineup& l : c.lineups) any_baseline = any_baseline || l.baseline.has_value();
  os << "rule: pass when rel_l2 and max_abs <= k*baseline + floor (k=2 f32, 3 bf16/f16"
     << (any_baseline ? "" : "; no baseline: the floors alone decide") << "; floors x"
     << depth_factor(s.cfg) << " for depth); %budget = err/limit, the larger of the two\n";
  os << "flags: FAIL over budget, NAN non-finite subject, MISS not captured, SHPE shape "
        "differs, ORCL oracle/baseline unusable\n";
}

void print_compare_table(std::ostream& os, const Comparison& c, const ReportOptions& opt) {
  const std::vector<std::string> keys = merged_keys(c);
  const RowIndex idx = index_rows(c);
  const size_t cw = opt.wide ? kWideWidth : kCompactWidth;
  size_t kw = 3;
  for (const auto& k : keys) kw = std::max(kw, k.size());

  std::string line = pad_right("", kw);
  for (const auto& m : c.cells) line += " | " + center(cell_name(m), cw);
  os << rstrip(line) << "\n";
  char buf[128];
  if (opt.wide)
    std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-4s", "max_abs", "rel_l2", "p95_rel",
                  "%budget", "");
  else
    std::snprintf(buf, sizeof buf, "%8s %7s %-4s", "rel_l2", "%budget", "");
  line = pad_right("key", kw);
  for (size_t m = 0; m < c.cells.size(); ++m) line += std::string(" | ") + buf;
  os << rstrip(line) << "\n" << std::string(kw, '-');
  for (size_t m = 0; m < c.cells.size(); ++m) os << "-+-" << std::string(cw, '-');
  os << "\n";

  for (const auto& k : keys) {
    bool any_fail = false;
    for (size_t m = 0; m < c.cells.size(); ++m) {
      auto it = idx[m].find(k);
      if (it != idx[m].end() && !it->second->pass()) any_fail = true;
    }
    if (opt.failures_only && !any_fail) continue;
    line = pad_right(k, kw);
    for (size_t m = 0; m < c.cells.size(); ++m) {
      auto it = idx[m].find(k);
      line += " | " + cell_text(it == idx[m].end() ? nullptr : it->second, opt.wide);
    }
    os << rstrip(line) << "\n";
  }

  bool header = false;
  for (const auto& m : c.cells)
    for (const auto& r : m.rows) {
      if (r.pass() && !opt.details) continue;
      if (!header) {
        os << "\n";
        header = true;
      }
      print_detail(os, m, r);
    }
  for (const auto& m : c.cells)
    if (!m.extra_keys.empty()) {
      os << "warning: [" << cell_name(m) << "] the subject captured " << m.extra_keys.size()
         << " key(s) the registry does not expect for this run:";
      for (const auto& k : m.extra_keys) os << " " << k;
      os << "\n";
    }
}

void print_compare_summary(std::ostream& os, const Comparison& c) {
  // Per cell: counts and the tightest headroom.
  for (const auto& m : c.cells) {
    const TensorResult* worst = nullptr;
    for (const auto& r : m.rows)
      if (r.pass() && (!worst || r.verdict.pct() > worst->verdict.pct())) worst = &r;
    os << "cell " << pad_right(cell_name(m), 12) << ": " << m.rows.size() << " tensors, "
       << m.n_fail() << " failing";
    if (worst) os << ", tightest passing " << fmt_pct(worst->verdict.pct()) << " at " << worst->key;
    if (!m.pass()) os << ", first failing " << m.rows[static_cast<size_t>(m.first_fail)].key;
    os << "\n";
  }
  // The first failing key in execution order over all cells.
  const std::vector<std::string> keys = merged_keys(c);
  const RowIndex idx = index_rows(c);
  for (const auto& k : keys) {
    std::string where;
    const TensorResult* first = nullptr;
    for (size_t m = 0; m < c.cells.size(); ++m) {
      auto it = idx[m].find(k);
      if (it == idx[m].end() || it->second->pass()) continue;
      where += (where.empty() ? "" : ", ") + cell_name(c.cells[m]);
      if (!first) first = it->second;
    }
    if (!first) continue;
    os << "summary: FAIL first failing stage: " << k << " [" << where << "] ("
       << status_name(first->status) << ": " << first->note << "); " << c.n_fail() << " of "
       << c.n_checks() << " tensor checks failed\n";
    return;
  }
  std::string per;
  for (const Lineup& l : c.lineups) {
    std::string modes;
    for (const auto& m : c.cells)
      if (m.precision == l.precision)
        modes += (modes.empty() ? "" : ", ") + std::string(scan_mode_name(m.mode)) + " " +
                 std::to_string(m.rows.size());
    per += (per.empty() ? "" : "; ") + std::string(precision_name(l.precision)) + ": " + modes;
  }
  os << "summary: PASS all " << c.n_checks() << " tensor checks within budget (" << per << ")\n";
}

void print_compare(std::ostream& os, const Comparison& c, const ReportOptions& opt) {
  print_compare_header(os, c);
  os << "\n";
  print_compare_table(os, c, opt);
  os << "\n";
  print_compare_summary(os, c);
}

void print_bench(std::ostream& os, const BenchSpec& spec, const std::vector<BenchRow>& rows) {
  os << "m3h bench --reference: Eigen reference, single thread, median of " << spec.repeats
     << " after " << spec.warmup << " warm-up (steady_clock)\n";
  os << "config: " << spec.cfg.describe() << "\n";
  os << "run: B=" << spec.B << " T=" << spec.T << " seed=" << spec.seed
     << " tokens=" << spec.B * spec.T << "; tokens/s = B*T / (forward + backward)\n\n";
  char buf[160];
  std::snprintf(buf, sizeof buf, "%-9s %-8s %12s %12s %12s", "precision", "scan", "forward_ms",
                "backward_ms", "tokens/s");
  os << buf << "\n" << std::string(std::char_traits<char>::length(buf), '-') << "\n";
  for (const auto& r : rows) {
    std::snprintf(buf, sizeof buf, "%-9s %-8s %12.2f %12.2f %12.0f", r.precision.c_str(),
                  scan_mode_name(r.mode), r.forward_ms, r.backward_ms, r.tokens_per_s());
    os << buf << "\n";
  }
}

}  // namespace m3::harness
