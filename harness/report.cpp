// Terminal reports (see report.hpp).
#include "report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>

#include "cell_judge.hpp"
#include "error.hpp"
#include "terminal.hpp"

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

// Each line of `text` broken at spaces to fit `width` (0: as it is), continuations indented.
void emit_wrapped(std::ostream& os, const std::string& text, int width) {
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) os << wrap_words(line, width, 2) << "\n";
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
    case Status::IllConditioned: return "ILLC";
  }
  return "?";
}

// Compact: rel_l2 (8) %budget (8) flag (4).   Wide: max_abs rel_l2 p95_rel %budget flag.
constexpr int kCompactWidth = 22;
constexpr int kWideWidth = 43;

std::string cell_text(const TensorResult* r, bool wide) {
  char buf[128];
  const char* flag = r ? flag_of(r->status) : "";
  if (!r || !r->measured()) {
    if (wide)
      std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-4s", "-", "-", "-", "-", flag);
    else
      std::snprintf(buf, sizeof buf, "%8s %8s %-4s", "-", "-", flag);
    return buf;
  }
  const std::string pct = fmt_pct(r->verdict.pct());
  if (wide) {
    const std::string p95 = r->subject.rel_count > 0 ? fmt_sci(r->subject.p95_rel) : "-";
    std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-4s", fmt_sci(r->subject.max_abs).c_str(),
                  fmt_sci(r->subject.rel_l2).c_str(), p95.c_str(), pct.c_str(), flag);
  } else {
    std::snprintf(buf, sizeof buf, "%8s %8s %-4s", fmt_sci(r->subject.rel_l2).c_str(),
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
  const char* label = r.status == Status::IllConditioned ? "ILL-COND" : r.pass() ? "ok" : status_name(r.status);
  os << pad_right(label, 10) << "[" << cell_name(m) << "] "
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

std::string group_name(const CompareResult& r) {
  return std::string(precision_name(r.precision)) + " " + scan_mode_name(r.mode);
}

std::string cell_name(const CompareResult& r) {
  return group_name(r) + (r.compare_mode == CompareMode::Isolated ? " iso" : "");
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

RuleSummary rule_summary(const Comparison& c) {
  RuleSummary r;
  for (const Lineup& l : c.lineups) {
    if (l.baseline && !r.e2e_baseline) {
      r.e2e_baseline = true;
      r.e2e_kind = l.baseline_kind;
    }
    r.e2e_conditioning = r.e2e_conditioning || !l.conditioning.empty();
    r.iso_baseline = r.iso_baseline || !l.isolated_baselines.empty();
    if (c.spec.cfg.vocab_size > 0)
      r.coherent_draws = std::max(r.coherent_draws, static_cast<int>(l.coherent_baselines.size()));
  }
  auto ks = [](BaselineKind kind, CompareMode cmp) {
    return "k=" + printf_str("%g", baseline_k(Precision::F32, kind, cmp)) + " f32, " +
           printf_str("%g", baseline_k(Precision::BF16, kind, cmp)) + " bf16/f16";
  };
  const std::string draws = "max + range of " + std::to_string(kPerturbationDraws) + " draws";
  if (!r.e2e_baseline) {
    r.e2e = "floor (no baseline: the floors alone decide)";
  } else if (r.e2e_kind == BaselineKind::Perturbed) {
    const std::string coherent =
        r.coherent_draws == 0 ? ""
                              : ", where still over: the larger of that and " +
                                    std::to_string(r.coherent_draws) + " coherent draws'";
    r.e2e = "k*perturbed + floor (perturbed = the perturbed oracle's error, " + draws + coherent +
            "; " + ks(BaselineKind::Perturbed, CompareMode::EndToEnd) + ")";
  } else if (r.e2e_conditioning) {
    r.e2e = "max(k*baseline, kp*perturbed) + floor (baseline = the emulation, " +
            ks(BaselineKind::SamePrecision, CompareMode::EndToEnd) + "; perturbed = the "
            "perturbed oracle's error, " + draws + ", kp: " +
            ks(BaselineKind::Perturbed, CompareMode::EndToEnd).substr(2) + ")";
  } else {
    r.e2e = "k*baseline + floor (" + ks(BaselineKind::SamePrecision, CompareMode::EndToEnd) + ")";
  }
  if (r.iso_baseline)
    r.iso = "k*perturbed + the isolated floor (the perturbed oracle's teacher-forced error, " +
            draws + "; " + ks(BaselineKind::Perturbed, CompareMode::Isolated) +
            ", f32-only stages f32's; tight rows on >= " + std::to_string(kTightMinElements) +
            " values: max(floor, " + printf_str("%g", kTightK) + "*perturbed))";
  else
    r.iso = "the isolated floor (no baseline)";
  return r;
}

void print_compare_header(std::ostream& out, const Comparison& c, const ReportOptions& opt) {
  std::ostringstream os;
  const RunSpec& s = c.spec;
  os << "m3h compare: oracle=" << c.oracle_name << " device=" << s.device << "\n";
  for (const Lineup& l : c.lineups)
    os << "  " << pad_right(precision_name(l.precision), 5) << "subject=" << l.subject.name
       << " baseline=" << (l.baseline ? l.baseline->name : "none") << "\n";
  os << "config: " << s.cfg.describe() << "\n";
  // The source names a file (a checkpoint's or a golden file's path): escaped for the terminal.
  os << "run: source=" << escape_for_message(s.source, 1000) << " B=" << s.B << " T=" << s.T
     << " seed=" << s.seed
     << " entering_states=" << (s.random_states ? "random" : "zero")
     << " modes=" << join(s.modes, ",", scan_mode_name)
     << " precisions=" << join(c.lineups, ",", [](const Lineup& l) {
          return precision_name(l.precision);
        })
     << " stage=" << (s.filter.empty() ? "*" : s.filter)
     << " compare=" << join(s.compare_modes, ",", compare_mode_name) << "\n";
  bool e2e = false, iso = false;
  for (CompareMode m : s.compare_modes) (m == CompareMode::Isolated ? iso : e2e) = true;
  const RuleSummary rs = rule_summary(c);
  if (e2e)
    os << "rule" << (iso ? " e2e" : "") << ": pass when rel_l2 and max_abs <= " << rs.e2e
       << "; floors x" << depth_factor(s.cfg) << " for depth; %budget = err/limit, the larger "
       << "of the two\n";
  if (iso)
    os << "rule" << (e2e ? " iso" : "")
       << ": isolated (teacher-forced: each stage fed the oracle's inputs, rounded to its "
          "storage); pass when rel_l2 and max_abs <= "
       << rs.iso << " (no depth factor)\n";
  os << "flags: FAIL over budget, NAN non-finite subject, MISS not captured, SHPE shape "
        "differs, ORCL oracle/baseline unusable, ILLC ill-conditioned: not judged (its verdict "
        "rests on values that one rounding per stored value moves by as much as themselves)\n";
  emit_wrapped(out, os.str(), opt.width);
}

void print_compare_table(std::ostream& os, const Comparison& c, const ReportOptions& opt) {
  const std::vector<std::string> keys = merged_keys(c);
  const RowIndex idx = index_rows(c);
  const size_t cw = opt.wide ? kWideWidth : kCompactWidth;
  size_t kw = 3;
  for (const auto& k : keys) kw = std::max(kw, k.size());

  // Cells come in groups of nc (one per comparison mode) for each (precision, scan mode): with
  // more than one mode a group is headed by its name, its sub-columns by "e2e" / "iso", and
  // ":" separates the sub-columns of a group, "|" the groups.
  const size_t nc = std::max<size_t>(1, c.spec.compare_modes.size());
  auto sep = [&](size_t m) { return std::string(nc > 1 && m % nc != 0 ? " : " : " | "); };
  // Blocks of whole groups that fit opt.width beside the key column (at least one group each).
  const size_t group_width = nc * (cw + 3);
  const size_t n_groups = (c.cells.size() + nc - 1) / nc;
  size_t per_block = n_groups;
  if (opt.width > 0 && kw + n_groups * group_width > static_cast<size_t>(opt.width))
    per_block = std::max<size_t>(
        1, (static_cast<size_t>(opt.width) > kw ? static_cast<size_t>(opt.width) - kw : 0) /
               group_width);
  // As many blocks as needed, as even as they can be (6 groups by at most 4: 3 + 3).
  if (n_groups > 0) {
    const size_t blocks = (n_groups + per_block - 1) / per_block;
    per_block = (n_groups + blocks - 1) / blocks;
  }
  // The rows shown: every key, or (--failures-only) those that fail in some cell of any block.
  std::vector<std::string> shown;
  for (const auto& k : keys) {
    bool any_fail = false;
    for (size_t m = 0; m < c.cells.size(); ++m) {
      auto it = idx[m].find(k);
      if (it != idx[m].end() && (!it->second->pass() || !it->second->judged())) any_fail = true;
    }
    if (!opt.failures_only || any_fail) shown.push_back(k);
  }
  if (opt.failures_only && shown.empty()) os << "no failures (--failures-only: no row to show)\n";
  for (size_t g0 = 0; g0 < n_groups && !shown.empty(); g0 += per_block) {
    const size_t first = g0 * nc, last = std::min(c.cells.size(), (g0 + per_block) * nc);
    if (g0 > 0) os << "\n";
    std::string line = pad_right("", kw);
    if (nc > 1) {
      for (size_t m = first; m < last; m += nc)
        line += " | " + center(group_name(c.cells[m]), nc * cw + (nc - 1) * 3);
      os << rstrip(line) << "\n";
      line = pad_right("", kw);
      for (size_t m = first; m < last; ++m)
        line += sep(m) + center(c.cells[m].compare_mode == CompareMode::Isolated ? "iso" : "e2e", cw);
    } else {
      for (size_t m = first; m < last; ++m) line += " | " + center(cell_name(c.cells[m]), cw);
    }
    os << rstrip(line) << "\n";
    char buf[128];
    if (opt.wide)
      std::snprintf(buf, sizeof buf, "%9s %9s %9s %8s %-4s", "max_abs", "rel_l2", "p95_rel",
                    "%budget", "");
    else
      std::snprintf(buf, sizeof buf, "%8s %8s %-4s", "rel_l2", "%budget", "");
    line = pad_right("key", kw);
    for (size_t m = first; m < last; ++m) line += sep(m) + buf;
    os << rstrip(line) << "\n" << std::string(kw, '-');
    for (size_t m = first; m < last; ++m)
      os << (nc > 1 && m % nc != 0 ? "-:-" : "-+-") << std::string(cw, '-');
    os << "\n";
    for (const auto& k : shown) {
      line = pad_right(k, kw);
      for (size_t m = first; m < last; ++m) {
        auto it = idx[m].find(k);
        line += sep(m) + cell_text(it == idx[m].end() ? nullptr : it->second, opt.wide);
      }
      os << rstrip(line) << "\n";
    }
  }

  bool header = false;
  for (const auto& m : c.cells)
    for (const auto& r : m.rows) {
      if (r.pass() && r.judged() && !opt.details) continue;
      if (!header) {
        os << "\n";
        header = true;
      }
      std::ostringstream detail;
      print_detail(detail, m, r);
      emit_wrapped(os, detail.str(), opt.width);
    }
  for (const auto& m : c.cells)
    if (!m.extra_keys.empty()) {
      os << "warning: [" << cell_name(m) << "] the subject captured " << m.extra_keys.size()
         << " key(s) the registry does not expect for this run:";
      for (const auto& k : m.extra_keys) os << " " << k;
      os << "\n";
    }
}

namespace {

// The cells of one comparison mode (all cells when `only` is null).
std::vector<size_t> cells_of(const Comparison& c, const CompareMode* only) {
  std::vector<size_t> out;
  for (size_t m = 0; m < c.cells.size(); ++m)
    if (!only || c.cells[m].compare_mode == *only) out.push_back(m);
  return out;
}

// The first key, in execution order, that `pick` selects in any of `cells`, with the names of
// the cells it is selected in and the first such row.
template <class Pick>
const TensorResult* first_key(const Comparison& c, const std::vector<size_t>& cells, Pick pick,
                              std::string& where) {
  const RowIndex idx = index_rows(c);
  for (const auto& k : merged_keys(c)) {
    const TensorResult* first = nullptr;
    where.clear();
    for (size_t m : cells) {
      auto it = idx[m].find(k);
      if (it == idx[m].end() || !pick(*it->second)) continue;
      where += (where.empty() ? "" : ", ") + cell_name(c.cells[m]);
      if (!first) first = it->second;
    }
    if (first) return first;
  }
  where.clear();
  return nullptr;
}

bool has_nonfinite(const TensorResult& r) { return r.subject.nan_count + r.subject.inf_count > 0; }

// "summary<label>: PASS …" or "summary<label>: FAIL first failing stage: …" over `cells`.
void summary_line(std::ostream& os, const Comparison& c, const std::vector<size_t>& cells,
                  const std::string& label) {
  int n_checks = 0, n_fail = 0, n_ill = 0;
  for (size_t m : cells) {
    n_checks += static_cast<int>(c.cells[m].rows.size());
    n_fail += c.cells[m].n_fail();
    n_ill += c.cells[m].n_ill();
  }
  const std::string ill =
      n_ill > 0 ? "; " + std::to_string(n_ill) + " ill-conditioned: not judged" : "";
  std::string where;
  if (const TensorResult* first =
          first_key(c, cells, [](const TensorResult& r) { return !r.pass(); }, where)) {
    os << "summary" << label << ": FAIL first failing stage: " << first->key << " [" << where
       << "] (" << status_name(first->status) << ": " << first->note << "); " << n_fail
       << " of " << n_checks << " tensor checks failed" << ill << "\n";
    return;
  }
  std::string per;
  for (const Lineup& l : c.lineups) {
    std::string modes;
    for (size_t m : cells)
      if (c.cells[m].precision == l.precision)
        modes += (modes.empty() ? "" : ", ") + std::string(scan_mode_name(c.cells[m].mode)) +
                 (c.cells[m].compare_mode == CompareMode::Isolated ? " iso " : " ") +
                 std::to_string(c.cells[m].rows.size());
    per += (per.empty() ? "" : "; ") + std::string(precision_name(l.precision)) + ": " + modes;
  }
  if (n_ill == 0)
    os << "summary" << label << ": PASS all " << n_checks << " tensor checks within budget ("
       << per << ")\n";
  else
    os << "summary" << label << ": PASS all " << n_checks - n_ill
       << " judged tensor checks within budget (" << per << ")" << ill << "\n";
}

}  // namespace

namespace {

// The summary's lines, unwrapped (print_compare_summary fits them to the width).
void summary_lines(std::ostream& os, const Comparison& c) {
  // Per cell: counts and the tightest headroom.
  for (const auto& m : c.cells) {
    const TensorResult* worst = m.tightest_passing();
    os << "cell " << pad_right(cell_name(m), 16) << ": " << m.rows.size() << " tensors, "
       << m.n_fail() << " failing";
    if (m.n_ill() > 0) os << ", " << m.n_ill() << " ill-conditioned: not judged";
    if (worst) os << ", tightest passing " << fmt_pct(worst->verdict.pct()) << " at " << worst->key;
    if (!m.pass()) os << ", first failing " << m.rows[static_cast<size_t>(m.first_fail)].key;
    os << "\n";
  }
  const std::vector<CompareMode>& cms = c.spec.compare_modes;
  const bool several = cms.size() > 1;
  // Non-finite subject values, never hidden behind an earlier failure: the first stage in
  // execution order that produced one (per comparison mode).
  for (CompareMode cm : cms) {
    std::string where;
    const TensorResult* r = first_key(c, cells_of(c, &cm), has_nonfinite, where);
    if (!r) continue;
    os << "first non-finite" << (several ? std::string(" ") + compare_mode_name(cm) : "")
       << ": " << r->key << " (" << where << "): " << r->subject.nan_count << " NaN, "
       << r->subject.inf_count << " Inf in the subject where the oracle is finite\n";
  }
  if (!several) {
    summary_line(os, c, cells_of(c, nullptr), "");
    return;
  }
  for (CompareMode cm : cms)
    summary_line(os, c, cells_of(c, &cm), std::string(" ") + compare_mode_name(cm));
  // HARNESS.md §2: a stage that fails isolated is broken; one that passes isolated but fails
  // end to end amplifies error arriving from upstream.
  const CompareMode e2e = CompareMode::EndToEnd, iso = CompareMode::Isolated;
  std::string we, wi;
  const auto fails = [](const TensorResult& r) { return !r.pass(); };
  const TensorResult* fe = first_key(c, cells_of(c, &e2e), fails, we);
  const TensorResult* fi = first_key(c, cells_of(c, &iso), fails, wi);
  if (fi)
    os << "diagnosis: " << fi->key << " fails isolated [" << wi
       << "]: that stage itself is wrong (fed the oracle's inputs, it misses its budget)\n";
  else if (fe)
    os << "diagnosis: every stage passes isolated; " << fe->key << " fails end to end only ["
       << we << "]: error amplified from upstream, not a broken stage\n";
  os << "summary: " << (c.pass() ? "PASS" : "FAIL");
  for (CompareMode cm : cms) {
    bool ok = true;
    for (size_t m : cells_of(c, &cm)) ok = ok && c.cells[m].pass();
    os << (cm == cms.front() ? " (" : ", ") << compare_mode_name(cm) << " " << (ok ? "PASS" : "FAIL");
  }
  int n_ill = 0;
  for (const auto& m : c.cells) n_ill += m.n_ill();
  os << "); " << c.n_fail() << " of " << c.n_checks() << " tensor checks failed";
  if (n_ill > 0) os << "; " << n_ill << " ill-conditioned: not judged";
  os << "\n";
}

}  // namespace

void print_compare_summary(std::ostream& out, const Comparison& c, const ReportOptions& opt) {
  std::ostringstream os;
  summary_lines(os, c);
  emit_wrapped(out, os.str(), opt.width);
}

void print_compare(std::ostream& os, const Comparison& c, const ReportOptions& opt) {
  print_compare_header(os, c, opt);
  os << "\n";
  print_compare_table(os, c, opt);
  os << "\n";
  print_compare_summary(os, c, opt);
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
