// Terminal reports (see report.hpp).
#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>

namespace m3::harness {

namespace {

constexpr int kCellWidth = 48;  // "%9s %9s %9s %8s %-9s"

std::string printf_str(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

std::string fmt_pct(double p) {
  if (std::isnan(p)) return "nan%";
  if (std::isinf(p)) return "inf%";
  if (p >= 99999.5) return ">99999%";
  return printf_str("%.1f%%", p);
}

std::string pad_right(const std::string& s, size_t w) {
  return s.size() >= w ? s : s + std::string(w - s.size(), ' ');
}

std::string center(const std::string& s, size_t w) {
  if (s.size() >= w) return s;
  const size_t left = (w - s.size()) / 2;
  return std::string(left, ' ') + s + std::string(w - s.size() - left, ' ');
}

std::string cell(const TensorResult* r) {
  char buf[128];
  if (!r) {
    std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-9s", "-", "-", "-", "-", "");
    return buf;
  }
  const bool measured = r->status == Status::Pass || r->status == Status::OverBudget ||
                        r->status == Status::NonFinite ||
                        (r->status == Status::OracleBad && r->subject.numel > 0);
  const std::string flag = r->pass() ? "" : status_name(r->status);
  if (!measured) {
    std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-9s", "-", "-", "-", "-", flag.c_str());
    return buf;
  }
  const std::string p95 = r->subject.rel_count > 0 ? fmt_sci(r->subject.p95_rel) : "-";
  std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-9s", fmt_sci(r->subject.max_abs).c_str(),
                fmt_sci(r->subject.rel_l2).c_str(), p95.c_str(),
                fmt_pct(r->verdict.pct()).c_str(), flag.c_str());
  return buf;
}

// Union of the modes' keys in execution order: each mode's keys keep their relative order; a
// key only one mode has is placed right after that mode's previous key.
std::vector<std::string> merged_keys(const Comparison& c) {
  std::vector<std::string> merged;
  for (const auto& m : c.modes) {
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

using RowIndex = std::vector<std::map<std::string, const TensorResult*>>;  // per mode

RowIndex index_rows(const Comparison& c) {
  RowIndex idx(c.modes.size());
  for (size_t m = 0; m < c.modes.size(); ++m)
    for (const auto& r : c.modes[m].rows) idx[m][r.key] = &r;
  return idx;
}

std::string modes_str(const Comparison& c) {
  std::string s;
  for (const auto& m : c.spec.modes) s += (s.empty() ? "" : ",") + std::string(scan_mode_name(m));
  return s;
}

void print_detail(std::ostream& os, const CompareResult& m, const TensorResult& r) {
  os << pad_right(r.pass() ? "ok" : status_name(r.status), 10) << "[" << scan_mode_name(m.mode)
     << "] " << r.key << ": ";
  if (!r.note.empty()) os << r.note << "; ";
  if (r.subject.worst_index >= 0) {
    os << "worst |d|=" << fmt_sci(r.subject.max_abs) << " at " << r.worst_coords << " (oracle "
       << printf_str("%.9e", r.subject.worst_oracle) << ", subject "
       << printf_str("%.9e", r.subject.worst_subject) << "); budget rel_l2 "
       << fmt_sci(r.budget.rel_l2) << " max_abs " << fmt_sci(r.budget.max_abs) << "; cosine "
       << printf_str("%.12f", r.subject.cosine)
       << "; max_rel " << fmt_sci(r.subject.max_rel) << "; max_ulps "
       << printf_str("%.0f", r.subject.max_ulps);
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

void print_compare_header(std::ostream& os, const Comparison& c) {
  const RunSpec& s = c.spec;
  os << "m3h compare: subject=" << c.subject_name << " oracle=" << c.oracle_name
     << " baseline=" << (c.baseline_name.empty() ? "none" : c.baseline_name)
     << " precision=" << precision_name(s.precision) << " device=" << s.device << "\n";
  os << "config: " << s.cfg.describe() << "\n";
  os << "run: preset=" << s.preset << " B=" << s.B << " T=" << s.T << " seed=" << s.seed
     << " entering_states=" << (s.random_states ? "random" : "zero") << " modes=" << modes_str(c)
     << " stage=" << (s.filter.empty() ? "*" : s.filter) << "\n";
  os << "rule: pass when rel_l2 and max_abs <= k*baseline + floor (k="
     << k_factor(s.precision) << (c.baseline_name.empty() ? ", no baseline: floor only" : "")
     << ", floors x" << depth_factor(s.cfg) << " for depth"
     << "); %budget = err/limit, the larger of the two\n";
}

void print_compare_table(std::ostream& os, const Comparison& c, const ReportOptions& opt) {
  const std::vector<std::string> keys = merged_keys(c);
  const RowIndex idx = index_rows(c);
  size_t kw = 3;
  for (const auto& k : keys) kw = std::max(kw, k.size());

  auto rstrip = [](std::string s) {
    while (!s.empty() && s.back() == ' ') s.pop_back();
    return s;
  };
  std::string line = pad_right("", kw);
  for (const auto& m : c.modes) line += " | " + center(scan_mode_name(m.mode), kCellWidth);
  os << rstrip(line) << "\n";
  char buf[128];
  std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-9s", "max_abs", "rel_l2", "p95_rel",
                "%budget", "");
  line = pad_right("key", kw);
  for (size_t m = 0; m < c.modes.size(); ++m) line += std::string(" | ") + buf;
  os << rstrip(line) << "\n" << std::string(kw, '-');
  for (size_t m = 0; m < c.modes.size(); ++m) os << "-+-" << std::string(kCellWidth, '-');
  os << "\n";

  for (const auto& k : keys) {
    bool any_fail = false;
    for (size_t m = 0; m < c.modes.size(); ++m) {
      auto it = idx[m].find(k);
      if (it != idx[m].end() && !it->second->pass()) any_fail = true;
    }
    if (opt.failures_only && !any_fail) continue;
    line = pad_right(k, kw);
    for (size_t m = 0; m < c.modes.size(); ++m) {
      auto it = idx[m].find(k);
      line += " | " + cell(it == idx[m].end() ? nullptr : it->second);
    }
    os << rstrip(line) << "\n";
  }

  bool header = false;
  for (const auto& m : c.modes)
    for (const auto& r : m.rows) {
      if (r.pass() && !opt.details) continue;
      if (!header) {
        os << "\n";
        header = true;
      }
      print_detail(os, m, r);
    }
  for (const auto& m : c.modes)
    if (!m.extra_keys.empty()) {
      os << "warning: [" << scan_mode_name(m.mode) << "] the subject captured "
         << m.extra_keys.size() << " key(s) the registry does not expect for this run:";
      for (const auto& k : m.extra_keys) os << " " << k;
      os << "\n";
    }
}

void print_compare_summary(std::ostream& os, const Comparison& c) {
  // Per mode: counts and the tightest headroom.
  for (const auto& m : c.modes) {
    const TensorResult* worst = nullptr;
    for (const auto& r : m.rows)
      if (r.pass() && (!worst || r.verdict.pct() > worst->verdict.pct())) worst = &r;
    os << "mode " << pad_right(scan_mode_name(m.mode), 7) << ": " << m.rows.size()
       << " tensors, " << m.n_fail() << " failing";
    if (worst) os << ", tightest passing " << fmt_pct(worst->verdict.pct()) << " at " << worst->key;
    if (!m.pass()) os << ", first failing " << m.rows[m.first_fail].key;
    os << "\n";
  }
  // The first failing key in execution order over all modes.
  const std::vector<std::string> keys = merged_keys(c);
  const RowIndex idx = index_rows(c);
  for (const auto& k : keys) {
    std::string modes;
    const TensorResult* first = nullptr;
    for (size_t m = 0; m < c.modes.size(); ++m) {
      auto it = idx[m].find(k);
      if (it == idx[m].end() || it->second->pass()) continue;
      modes += (modes.empty() ? "" : ",") + std::string(scan_mode_name(c.modes[m].mode));
      if (!first) first = it->second;
    }
    if (!first) continue;
    os << "summary: FAIL first failing stage: " << k << " [" << modes << "] ("
       << status_name(first->status) << ": " << first->note << "); " << c.n_fail() << " of "
       << c.n_checks() << " tensor checks failed\n";
    return;
  }
  std::string per_mode;
  for (const auto& m : c.modes)
    per_mode += (per_mode.empty() ? "" : ", ") + std::string(scan_mode_name(m.mode)) + " " +
                std::to_string(m.rows.size());
  os << "summary: PASS all " << c.n_checks() << " tensors within budget (" << per_mode << ")\n";
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
