// Capture-against-capture comparison over the registry's keys (see compare.hpp).
#include "compare.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "error.hpp"

namespace m3::harness {

namespace {

// Glob over the whole string: * any run, ? any one character, [abc] / [a-z] / [!a] a class.
bool glob_match(const char* p, const char* s) {
  for (; *p; ++p, ++s) {
    if (*p == '*') {
      while (p[1] == '*') ++p;
      if (!p[1]) return true;
      for (; *s; ++s)
        if (glob_match(p + 1, s)) return true;
      return false;
    }
    if (!*s) return false;
    if (*p == '?') continue;
    if (*p == '[') {
      const char* q = p + 1;
      const bool negate = *q == '!' || *q == '^';
      if (negate) ++q;
      bool hit = false;
      const char* start = q;
      for (; *q && (*q != ']' || q == start); ++q) {
        if (q[1] == '-' && q[2] && q[2] != ']') {
          if (*s >= *q && *s <= q[2]) hit = true;
          q += 2;
        } else if (*q == *s) {
          hit = true;
        }
      }
      if (!*q) return *s == '[' && glob_match(p + 1, s + 1);  // unclosed: literal '['
      if (hit == negate) return false;
      p = q;
      continue;
    }
    if (*p != *s) return false;
  }
  return *s == '\0';
}

}  // namespace

const char* status_name(Status s) {
  switch (s) {
    case Status::Pass: return "ok";
    case Status::OverBudget: return "FAIL";
    case Status::NonFinite: return "NONFINITE";
    case Status::Missing: return "MISSING";
    case Status::ShapeMismatch: return "SHAPE";
    case Status::OracleMissing: return "NO-ORACLE";
    case Status::OracleBad: return "BAD-ORACLE";
  }
  return "?";
}

int CompareResult::n_fail() const {
  int n = 0;
  for (const auto& r : rows) n += r.pass() ? 0 : 1;
  return n;
}

namespace {
// The row of `rows` that `take` admits with the largest verdict.pct(), the first of equals.
template <class Take>
const TensorResult* largest_share_of(const std::vector<TensorResult>& rows, Take take) {
  const TensorResult* top = nullptr;
  for (const auto& r : rows)
    if (take(r) && (!top || r.verdict.pct() > top->verdict.pct())) top = &r;
  return top;
}
}  // namespace

const TensorResult* CompareResult::largest_share() const {
  return largest_share_of(rows, [](const TensorResult&) { return true; });
}

const TensorResult* CompareResult::tightest_passing() const {
  return largest_share_of(rows, [](const TensorResult& r) { return r.pass(); });
}

bool key_matches(const std::string& key, const std::string& pattern) {
  if (pattern.empty()) return true;
  std::stringstream ss(pattern);
  std::string alt;
  while (std::getline(ss, alt, ',')) {
    if (alt.empty()) continue;
    if (alt.find_first_of("*?[") != std::string::npos) {
      if (glob_match(alt.c_str(), key.c_str())) return true;
    } else if (key.find(alt) != std::string::npos) {
      return true;
    }
  }
  return false;
}

std::vector<std::string> expected_keys(const Config& cfg, Idx B, Idx T, ScanMode mode,
                                       bool include_params) {
  std::vector<std::string> keys;
  for (const KeyedSpec& ks : expected_stage_keys(cfg, B, T, mode)) keys.push_back(ks.key);
  if (include_params)
    for (const KeyedParam& kp : expected_param_keys(cfg)) keys.push_back(kp.key);
  return keys;
}

namespace {

// The error of a set of baseline draws against `ref` (budget.hpp): the largest draw plus the
// draws' range (max − min), rel_l2 and max_abs each; a NaN anywhere stays NaN. False, with
// row.status/note set, when a draw or the reference lacks the key or its shape.
bool draw_error(TensorResult& row, const Tensor& o, const Tensor* ref,
                const std::vector<const Capture*>& draws, Precision precision, const char* what,
                Metrics& out) {
  if (!ref || ref->shape != o.shape) {
    row.status = Status::OracleBad;
    row.note = std::string("the ") + what + "'s reference run lacks this key or its shape";
    return false;
  }
  double lo_rel = 0, hi_rel = 0, lo_max = 0, hi_max = 0;
  for (size_t d = 0; d < draws.size(); ++d) {
    const Tensor* t = draws[d] ? draws[d]->find(row.key) : nullptr;
    if (!t || t->shape != o.shape) {
      row.status = Status::OracleBad;  // the yardstick itself is unusable
      row.note = t ? std::string(what) + " shape " + shape_str(t->shape) + " differs from the oracle's"
                   : std::string("the ") + what + (d ? " (draw " + std::to_string(d) + ")" : "") +
                         " did not capture this key";
      return false;
    }
    const Metrics m = compute_metrics(*ref, *t, row.circular, precision);
    if (d == 0) {
      out = m;
      lo_rel = hi_rel = m.rel_l2;
      lo_max = hi_max = m.max_abs;
      continue;
    }
    lo_rel = std::min(lo_rel, m.rel_l2);
    hi_rel = std::isnan(m.rel_l2) ? m.rel_l2 : std::max(hi_rel, m.rel_l2);
    lo_max = std::min(lo_max, m.max_abs);
    hi_max = std::isnan(m.max_abs) ? m.max_abs : std::max(hi_max, m.max_abs);
  }
  if (draws.size() > 1) {
    out.rel_l2 = hi_rel + (hi_rel - lo_rel);
    out.max_abs = hi_max + (hi_max - lo_max);
  }
  return true;
}

void judge_row(TensorResult& row, const Capture& oracle, const Capture& subject,
               const Capture* baseline, const Config& cfg, Idx B, Idx T, ScanMode mode,
               bool profile, const CompareOptions& opt) {
  const Precision precision = opt.precision;
  const CompareMode cmp = opt.compare_mode;
  const ToleranceRow& tol = find_tolerance(row.stage, row.tensor, mode, cmp);
  const Tensor* o = oracle.find(row.key);
  const Tensor* s = subject.find(row.key);
  if (!o) {
    row.status = Status::OracleMissing;
    row.note = "the oracle did not capture this key";
    return;
  }
  if (o->shape != row.shape) {
    row.status = Status::OracleBad;
    row.note = "oracle shape " + shape_str(o->shape) + " differs from the registry's " +
               shape_str(row.shape);
    return;
  }
  if (!s) {
    row.status = Status::Missing;
    row.note = "missing from the subject";
    return;
  }
  if (s->shape != o->shape) {
    row.status = Status::ShapeMismatch;
    row.note = "subject shape " + shape_str(s->shape) + " differs from the oracle's " +
               shape_str(o->shape);
    return;
  }
  row.subject = compute_metrics(*o, *s, row.circular, precision);
  if (profile) row.by_position = position_profile(*s, *o, B, T, row.circular);
  // The baseline draws: the e2e baseline and its further draws, or the isolated baselines.
  std::vector<const Capture*> draws;
  if (cmp == CompareMode::EndToEnd) {
    if (baseline) {
      draws.push_back(baseline);
      draws.insert(draws.end(), opt.more_baselines.begin(), opt.more_baselines.end());
    }
  } else {
    draws = opt.isolated_baselines;
  }
  // What the draws deviate from: the oracle, or the baseline's own unperturbed run.
  if (!draws.empty()) {
    const Tensor* ref = opt.baseline_reference ? opt.baseline_reference->find(row.key) : o;
    if (!draw_error(row, *o, ref, draws, precision, "baseline", row.baseline)) return;
    row.has_baseline = true;
  }
  // The conditioning term of a cell with a same-precision baseline (CompareOptions).
  Metrics cond;
  const bool has_cond = cmp == CompareMode::EndToEnd && !opt.conditioning.empty();
  if (has_cond) {
    const Tensor* ref =
        opt.conditioning_reference ? opt.conditioning_reference->find(row.key) : o;
    if (!draw_error(row, *o, ref, opt.conditioning, precision, "conditioning baseline", cond))
      return;
  }
  row.budget = make_budget(tol, precision, row.subject, row.has_baseline ? &row.baseline : nullptr,
                           cmp == CompareMode::EndToEnd ? depth_factor(cfg) : 1.0,
                           cmp == CompareMode::Isolated && !draws.empty() ? BaselineKind::Perturbed
                                                                          : opt.baseline_kind,
                           has_cond ? &cond : nullptr);
  row.verdict = judge(row.subject, row.budget);
  if (row.subject.worst_index >= 0 && row.syms)
    row.worst_coords = decode_index(*row.syms, row.shape, row.subject.worst_index, cfg, B, T);

  std::ostringstream why;
  if (row.subject.oracle_nonfinite > 0) {
    row.status = Status::OracleBad;
    why << row.subject.oracle_nonfinite << " non-finite oracle value(s)";
  } else if (row.subject.nan_count + row.subject.inf_count > 0) {
    row.status = Status::NonFinite;
    why << row.subject.nan_count << " NaN and " << row.subject.inf_count
        << " Inf in the subject where the oracle is finite";
  } else if (!row.verdict.pass) {
    row.status = Status::OverBudget;
    if (row.subject.rel_l2 > row.budget.rel_l2)
      why << "rel_l2 " << row.subject.rel_l2 << " > budget " << row.budget.rel_l2;
    if (row.subject.max_abs > row.budget.max_abs)
      why << (why.tellp() > 0 ? "; " : "") << "max_abs " << row.subject.max_abs << " > budget "
          << row.budget.max_abs;
  } else {
    row.status = Status::Pass;
  }
  row.note = why.str();
}

}  // namespace

CompareResult compare_captures(const Capture& oracle, const Capture& subject,
                               const Capture* baseline, const Config& cfg, Idx B, Idx T,
                               ScanMode mode, const CompareOptions& opt) {
  validate_run(cfg, B, T);
  M3_REQUIRE(!baseline || opt.compare_mode == CompareMode::EndToEnd, "compare_captures",
             "an isolated comparison has no baseline",
             "the end-to-end baseline measures propagated error, not one stage's");
  CompareResult res;
  res.mode = mode;
  res.cfg = cfg;
  res.B = B;
  res.T = T;
  res.precision = opt.precision;
  res.compare_mode = opt.compare_mode;
  std::set<std::string> expected;

  for (const KeyedSpec& ks : expected_stage_keys(cfg, B, T, mode)) {
    expected.insert(ks.key);
    if (!key_matches(ks.key, opt.filter)) continue;
    TensorResult row;
    row.key = ks.key;
    row.layer = ks.layer;
    row.stage = ks.spec->stage;
    row.tensor = ks.spec->tensor;
    row.circular = ks.spec->circular;
    row.syms = &ks.spec->shape;
    row.shape = ks.shape;
    res.rows.push_back(std::move(row));
  }
  for (const KeyedParam& kp : expected_param_keys(cfg)) {
    expected.insert(kp.key);
    if (!opt.include_params || !key_matches(kp.key, opt.filter)) continue;
    TensorResult row;
    row.key = kp.key;
    row.layer = kp.layer;
    row.stage = "grad";
    row.tensor = kp.spec->name;
    row.is_param = true;
    row.syms = &kp.spec->shape;
    row.shape = kp.shape;
    res.rows.push_back(std::move(row));
  }
  for (size_t i = 0; i < res.rows.size(); ++i) {
    TensorResult& r = res.rows[i];
    const bool profile = !opt.by_position.empty() && !r.is_param && r.syms &&
                         has_position_axis(*r.syms) && key_matches(r.key, opt.by_position);
    judge_row(r, oracle, subject, baseline, cfg, B, T, mode, profile, opt);
    if (!r.pass() && res.first_fail < 0) res.first_fail = static_cast<int>(i);
    if (r.subject.nan_count + r.subject.inf_count > 0 && res.first_nonfinite < 0)
      res.first_nonfinite = static_cast<int>(i);
  }
  for (const std::string& k : subject.keys())
    if (!expected.count(k)) res.extra_keys.push_back(k);
  return res;
}

}  // namespace m3::harness
