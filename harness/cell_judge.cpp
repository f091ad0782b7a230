// The streamed judge of one comparison cell (see cell_judge.hpp).
#include "cell_judge.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "error.hpp"

namespace m3::harness {

struct CellJudge::State {
  const Tensor* oracle = nullptr;  // the host front end's oracle tensor
  bool judged = false;     // an oracle of the right shape: not decided before the subject
  const ToleranceRow* tol = nullptr;
  bool profile = false;    // keep subject vs oracle per position
  bool measured = false;   // the subject's metrics are in (oracle and subject, same shape)
  bool bad_draw = false;   // a draw or its reference made the yardstick unusable (OracleBad)
  int delivered = -1;      // the draw (counted over both terms) that last delivered this key
  // Over the floor's limit: the row takes every draw and keeps its values (condition()).
  bool keep = false;
  // Per term: (rel_l2, max_abs) of each draw, and the first draw's error_norms.
  std::vector<std::pair<double, double>> draws[2];
  Metrics first[2];
  double ref_l2 = 0;  // ‖reference‖₂ of the draws (the first draw's)
  // The host front end's values of a kept row: the subject's; per term and draw,
  // |draw − reference| per value; and |reference|.
  std::vector<double> kept;
  std::vector<std::vector<double>> devs[2];
  std::vector<double> ref_abs;
};

namespace {

const char* term_name(CellJudge::Term t) {
  return t == CellJudge::Term::Baseline ? "baseline" : "conditioning baseline";
}

// The error of a set of draws (budget.hpp): the largest draw plus the draws' range, max − min,
// rel_l2 and max_abs each; a NaN anywhere stays NaN. `first`: the first draw's other figures.
Metrics combine(const std::vector<std::pair<double, double>>& draws, const Metrics& first) {
  Metrics out = first;
  double lo_rel = 0, hi_rel = 0, lo_max = 0, hi_max = 0;
  for (size_t d = 0; d < draws.size(); ++d) {
    const double rel = draws[d].first, mx = draws[d].second;
    if (d == 0) {
      out.rel_l2 = rel;
      out.max_abs = mx;
      lo_rel = hi_rel = rel;
      lo_max = hi_max = mx;
      continue;
    }
    lo_rel = std::min(lo_rel, rel);
    hi_rel = std::isnan(rel) ? rel : std::max(hi_rel, rel);
    lo_max = std::min(lo_max, mx);
    hi_max = std::isnan(mx) ? mx : std::max(hi_max, mx);
  }
  if (draws.size() > 1) {
    out.rel_l2 = hi_rel + (hi_rel - lo_rel);
    out.max_abs = hi_max + (hi_max - lo_max);
  }
  return out;
}

// The baseline term's error when its draws from `split` on are of another kind (the coherent
// draws, Lineup::coherent_baselines): each kind's max + range, and of the two the larger,
// rel_l2 and max_abs each, so that a second kind widens a limit only as far as its own draws
// reach and never by the spread between the kinds.
Metrics combine_kinds(const std::vector<std::pair<double, double>>& draws, const Metrics& first,
                      size_t split) {
  if (draws.size() <= split) return combine(draws, first);
  const auto mid = draws.begin() + static_cast<std::ptrdiff_t>(split);
  Metrics out = combine({draws.begin(), mid}, first);
  const Metrics other = combine({mid, draws.end()}, first);
  auto larger = [](double a, double b) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    return std::isnan(a) || std::isnan(b) ? nan : std::max(a, b);
  };
  out.rel_l2 = larger(out.rel_l2, other.rel_l2);
  out.max_abs = larger(out.max_abs, other.max_abs);
  return out;
}

}  // namespace

CellJudge::CellJudge(const Capture& oracle, const Config& cfg, Idx B, Idx T, ScanMode mode,
                     const CompareOptions& opt, bool planned_baseline, bool eager)
    : oracle_(&oracle), cfg_(cfg), B_(B), T_(T), mode_(mode), opt_(opt),
      planned_baseline_(planned_baseline), eager_(eager) {
  init([&oracle](const std::string& key) -> const std::vector<Idx>* {
    const Tensor* t = oracle.find(key);
    return t ? &t->shape : nullptr;
  }, opt, false);
}

CellJudge::CellJudge(const OracleShape& oracle, const Config& cfg, Idx B, Idx T, ScanMode mode,
                     const CompareOptions& opt, bool planned_baseline, bool eager,
                     bool only_provided)
    : cfg_(cfg), B_(B), T_(T), mode_(mode), opt_(opt), planned_baseline_(planned_baseline),
      eager_(eager) {
  init(oracle, opt, only_provided);
}

void CellJudge::init(const OracleShape& oracle, const CompareOptions& opt, bool only_provided) {
  // Draw captures belong to compare_captures' caller; the judge never keeps their pointers.
  opt_.more_baselines.clear();
  opt_.isolated_baselines.clear();
  opt_.conditioning.clear();
  opt_.baseline_reference = opt_.conditioning_reference = nullptr;
  res_.mode = mode_;
  res_.cfg = cfg_;
  res_.B = B_;
  res_.T = T_;
  res_.precision = opt.precision;
  res_.compare_mode = opt.compare_mode;
  for (const KeyedSpec& ks : expected_stage_keys(cfg_, B_, T_, mode_)) {
    expected_.push_back(ks.key);
    if (!key_matches(ks.key, opt.filter)) continue;
    if (only_provided && !oracle(ks.key)) continue;
    TensorResult row;
    row.key = ks.key;
    row.layer = ks.layer;
    row.stage = ks.spec->stage;
    row.tensor = ks.spec->tensor;
    row.circular = ks.spec->circular;
    row.syms = &ks.spec->shape;
    row.shape = ks.shape;
    res_.rows.push_back(std::move(row));
  }
  for (const KeyedParam& kp : expected_param_keys(cfg_)) {
    expected_.push_back(kp.key);
    if (!opt.include_params || !key_matches(kp.key, opt.filter)) continue;
    TensorResult row;
    row.key = kp.key;
    row.layer = kp.layer;
    row.stage = "grad";
    row.tensor = kp.spec->name;
    row.is_param = true;
    row.syms = &kp.spec->shape;
    row.shape = kp.shape;
    res_.rows.push_back(std::move(row));
  }
  std::sort(expected_.begin(), expected_.end());
  st_.resize(res_.rows.size());
  for (size_t i = 0; i < res_.rows.size(); ++i) {
    TensorResult& r = res_.rows[i];
    State& st = st_[i];
    row_of_[r.key] = i;
    st.tol = &find_tolerance(r.stage, r.tensor, mode_, opt.compare_mode);
    st.profile = !opt.by_position.empty() && !r.is_param && r.syms &&
                 has_position_axis(*r.syms) && key_matches(r.key, opt.by_position);
    const std::vector<Idx>* shape = oracle(r.key);
    if (!shape) {
      r.status = Status::OracleMissing;
      r.note = "the oracle did not capture this key";
    } else if (*shape != r.shape) {
      r.status = Status::OracleBad;
      r.note = "oracle shape " + shape_str(*shape) + " differs from the registry's " +
               shape_str(r.shape);
    } else {
      st.judged = true;
      if (oracle_) st.oracle = oracle_->find(r.key);
      r.status = Status::Missing;  // until the subject delivers it
      r.note = "missing from the subject";
    }
  }
}

CellJudge::~CellJudge() = default;

int CellJudge::row(const std::string& key) {
  auto it = row_of_.find(key);
  if (it == row_of_.end()) {
    if (!std::binary_search(expected_.begin(), expected_.end(), key) &&
        std::find(res_.extra_keys.begin(), res_.extra_keys.end(), key) == res_.extra_keys.end())
      res_.extra_keys.push_back(key);
    return -1;
  }
  return st_[it->second].judged ? static_cast<int>(it->second) : -1;  // else decided: no oracle
}

const TensorResult& CellJudge::result(int row) const { return res_.rows.at(static_cast<size_t>(row)); }

bool CellJudge::wants_profile(int row) const { return st_.at(static_cast<size_t>(row)).profile; }

void CellJudge::subject_mismatch(int row, const std::vector<Idx>& shape) {
  TensorResult& r = res_.rows[static_cast<size_t>(row)];
  State& st = st_[static_cast<size_t>(row)];
  st.measured = false;
  st.keep = false;
  st.kept.clear();
  r.status = Status::ShapeMismatch;
  r.note = "subject shape " + shape_str(shape) + " differs from the oracle's " + shape_str(r.shape);
}

bool CellJudge::subject_measured(int row, const Metrics& m, PositionProfile profile) {
  const size_t i = static_cast<size_t>(row);
  TensorResult& r = res_.rows[i];
  State& st = st_[i];
  r.subject = m;
  if (st.profile) r.by_position = std::move(profile);
  if (r.subject.worst_index >= 0 && r.syms)
    r.worst_coords = decode_index(*r.syms, r.shape, r.subject.worst_index, cfg_, B_, T_);
  st.measured = true;
  rejudge(i);
  // Only a row over the floor's limit can fail: it keeps its values for condition().
  st.keep = r.status == Status::OverBudget;
  return st.keep;
}

void CellJudge::subject(const std::string& key, const Tensor& t) {
  const int i = row(key);
  if (i < 0) return;
  State& st = st_[static_cast<size_t>(i)];
  if (t.shape != st.oracle->shape) return subject_mismatch(i, t.shape);
  const bool circular = res_.rows[static_cast<size_t>(i)].circular;
  PositionProfile prof;
  if (st.profile) prof = position_profile(t, *st.oracle, B_, T_, circular);
  if (subject_measured(i, compute_metrics(*st.oracle, t, circular, opt_.precision), std::move(prof)))
    st.kept = t.data;
  else
    st.kept.clear();
}

void CellJudge::subject_done() {
  for (size_t i = 0; i < st_.size(); ++i)
    if (st_[i].measured) rejudge(i);
}

bool CellJudge::wants(const State& st) const {
  if (!st.measured || st.bad_draw) return false;
  return eager_ || st.keep;
}

bool CellJudge::wants(int row) const { return wants(st_.at(static_cast<size_t>(row))); }

bool CellJudge::kept(int row) const {
  const State& st = st_.at(static_cast<size_t>(row));
  return st.keep && st.measured && !st.bad_draw;
}

bool CellJudge::open() const {
  for (const State& st : st_)
    if (wants(st)) return true;
  return false;
}

bool CellJudge::over_limit() const {
  for (const TensorResult& r : res_.rows)
    if (r.status == Status::OverBudget) return true;
  return false;
}

void CellJudge::draw_begin(Term term) { draw_begin(term, nullptr); }

void CellJudge::draw_begin(Term term, const Capture* reference) {
  M3_REQUIRE(!in_draw_, "CellJudge", "a draw begins before the previous one ended", "");
  in_draw_ = true;
  term_ = term;
  ref_ = reference;
  ++n_draws_[static_cast<int>(term)];
}

void CellJudge::draw_unusable(int row, const std::string& why) {
  State& st = st_[static_cast<size_t>(row)];
  TensorResult& r = res_.rows[static_cast<size_t>(row)];
  st.bad_draw = true;
  r.status = Status::OracleBad;
  r.note = why;
}

void CellJudge::draw_measured(int row, const Metrics& m) {
  State& st = st_[static_cast<size_t>(row)];
  const int ti = static_cast<int>(term_);
  const int id = n_draws_[0] + n_draws_[1];
  if (st.delivered == id) {
    st.draws[ti].back() = {m.rel_l2, m.max_abs};  // the key again: the last one counts
  } else {
    st.draws[ti].push_back({m.rel_l2, m.max_abs});
    st.delivered = id;
  }
  if (st.draws[ti].size() == 1) st.first[ti] = m;
  if (st.draws[0].size() + st.draws[1].size() == 1) st.ref_l2 = m.oracle_l2;
}

void CellJudge::draw(const std::string& key, const Tensor& t) {
  auto it = row_of_.find(key);
  if (it == row_of_.end()) return;
  const int i = static_cast<int>(it->second);
  State& st = st_[it->second];
  if (!wants(st)) return;
  const TensorResult& r = res_.rows[it->second];
  const Tensor& o = *st.oracle;
  const char* what = term_name(term_);
  const Tensor* ref = ref_ ? ref_->find(key) : &o;
  if (!ref || ref->shape != o.shape)
    return draw_unusable(i, std::string("the ") + what + "'s reference run lacks this key or its shape");
  if (t.shape != o.shape)
    return draw_unusable(i, std::string(what) + " shape " + shape_str(t.shape) + " differs from the oracle's");
  const int ti = static_cast<int>(term_);
  const int id = n_draws_[0] + n_draws_[1];
  const bool again = st.delivered == id;
  draw_measured(i, error_norms(*ref, t, r.circular));
  if (!st.kept.empty()) {
    const size_t n = t.data.size();
    if (st.ref_abs.empty()) {
      st.ref_abs.resize(n);
      for (size_t k = 0; k < n; ++k) st.ref_abs[k] = std::fabs(ref->data[k]);
    }
    std::vector<double> dev(n);
    for (size_t k = 0; k < n; ++k) {
      const double a = t.data[k], b = ref->data[k];
      dev[k] = std::fabs(r.circular ? circular_diff(a, b) : a - b);
    }
    if (again && !st.devs[ti].empty()) st.devs[ti].back() = std::move(dev);
    else st.devs[ti].push_back(std::move(dev));
  }
}

void CellJudge::draw_end() {
  M3_REQUIRE(in_draw_, "CellJudge", "a draw ends that did not begin", "");
  in_draw_ = false;
  const int id = n_draws_[0] + n_draws_[1];
  const int d = n_draws_[static_cast<int>(term_)] - 1;  // within its term
  for (size_t i = 0; i < st_.size(); ++i) {
    State& st = st_[i];
    if (!wants(st) || st.delivered == id) continue;
    // A tensor this draw was to be measured on, and did not deliver.
    draw_unusable(static_cast<int>(i), std::string("the ") + term_name(term_) +
                                           (d ? " (draw " + std::to_string(d) + ")" : "") +
                                           " did not capture this key");
  }
  for (size_t i = 0; i < st_.size(); ++i)
    if (st_[i].delivered == id && !st_[i].bad_draw) rejudge(i);
}

// The baseline term's error of a row from its draws' (rel_l2, max_abs): combine_kinds; but the
// tight row (the F6 y row, set between one rounding of y and two of its own) takes the first
// kind's draws only, so that a second rounding of y still fails beside the coherent draws.
Metrics CellJudge::baseline_of(const std::vector<std::pair<double, double>>& draws,
                               const State& st) const {
  if (st.tol && st.tol->tight && draws.size() > second_kind_from_)
    return combine({draws.begin(), draws.begin() + static_cast<std::ptrdiff_t>(second_kind_from_)},
                   st.first[0]);
  return combine_kinds(draws, st.first[0], second_kind_from_);
}

void CellJudge::rejudge(size_t i) {
  TensorResult& r = res_.rows[i];
  State& st = st_[i];
  if (!st.measured || st.bad_draw) return;
  const CompareMode cmp = opt_.compare_mode;
  Metrics base, cond;
  r.draws = static_cast<int>(st.draws[0].size());
  r.conditioning_draws = static_cast<int>(st.draws[1].size());
  r.has_baseline = r.draws > 0;
  if (r.has_baseline) {
    base = baseline_of(st.draws[0], st);
    r.baseline = base;
  }
  const bool has_cond = cmp == CompareMode::EndToEnd && r.conditioning_draws > 0;
  if (has_cond) cond = combine(st.draws[1], st.first[1]);
  const BaselineKind kind =
      cmp == CompareMode::Isolated && planned_baseline_ ? BaselineKind::Perturbed : opt_.baseline_kind;
  r.budget = make_budget(*st.tol, opt_.precision, r.subject, r.has_baseline ? &base : nullptr,
                         cmp == CompareMode::EndToEnd ? depth_factor(cfg_) : 1.0, kind,
                         has_cond ? &cond : nullptr);
  r.verdict = judge(r.subject, r.budget);
  std::ostringstream why;
  if (r.subject.oracle_nonfinite > 0) {
    r.status = Status::OracleBad;
    why << r.subject.oracle_nonfinite << " non-finite oracle value(s)";
  } else if (r.subject.nan_count + r.subject.inf_count > 0) {
    r.status = Status::NonFinite;
    why << r.subject.nan_count << " NaN and " << r.subject.inf_count
        << " Inf in the subject where the oracle is finite";
  } else if (!r.verdict.pass) {
    r.status = Status::OverBudget;
    if (r.subject.rel_l2 > r.budget.rel_l2)
      why << "rel_l2 " << r.subject.rel_l2 << " > budget " << r.budget.rel_l2;
    if (r.subject.max_abs > r.budget.max_abs)
      why << (why.tellp() > 0 ? "; " : "") << "max_abs " << r.subject.max_abs << " > budget "
          << r.budget.max_abs;
  } else {
    r.status = Status::Pass;
  }
  r.note = why.str();
  if (r.status != Status::OverBudget && r.status != Status::Pass) {
    st.keep = false;  // decided for good, not by the budget
    st.kept.clear();
    st.kept.shrink_to_fit();
  }
}

// The host front end's per-value figures (ConditionSums) of a kept row.
ConditionSums CellJudge::analyse_host(size_t i, double u, double from) const {
  const State& st = st_[i];
  const TensorResult& r = res_.rows[i];
  ConditionSums out;
  const size_t n = st.kept.size();
  if (n == 0 || st.ref_abs.size() != n) return out;
  std::vector<char> ill(n, 0);
  for (size_t k = 0; k < n; ++k) {
    double dev = 0;
    for (const auto& term : st.devs)
      for (const std::vector<double>& d : term) dev = std::max(dev, d[k]);
    if (!(dev > 0)) continue;
    const double kappa = st.ref_abs[k] > 0 ? dev / (u * st.ref_abs[k])
                                            : std::numeric_limits<double>::infinity();
    if (kappa >= from) {
      ill[k] = 1;
      ++out.n_ill;
      out.kmax = std::max(out.kmax, kappa);
    }
  }
  auto rest = [&](auto&& absdev) {
    RestSums rs;
    for (size_t k = 0; k < n; ++k) {
      const double a = absdev(k);
      if (ill[k] || !std::isfinite(a)) continue;
      rs.d2 += a * a;
      rs.max = std::max(rs.max, a);
      ++rs.pairs;
    }
    return rs;
  };
  const std::vector<double>& o = st.oracle->data;
  out.subject = rest([&](size_t k) {
    return std::fabs(r.circular ? circular_diff(st.kept[k], o[k]) : st.kept[k] - o[k]);
  });
  for (int t = 0; t < 2; ++t)
    for (const std::vector<double>& d : st.devs[t]) out.draws[t].push_back(rest([&](size_t k) { return d[k]; }));
  return out;
}

void CellJudge::condition(size_t i, const Analyse& analyse) {
  TensorResult& r = res_.rows[i];
  State& st = st_[i];
  if (!st.keep || !st.measured || st.bad_draw) return;
  if (r.status != Status::Pass && r.status != Status::OverBudget) return;
  if (st.draws[0].empty() && st.draws[1].empty()) return;  // no draw: no condition to estimate
  // κ of each value over every draw of both terms (the largest deviation). Over its limit, a
  // tensor leaves out the values from ill_conditioned_from(p) on; within it, those without a
  // correct digit at p (κ ≥ 1/u): below that the draws' limit still tells right from wrong.
  const double u = unit_roundoff(opt_.precision);
  const double from =
      r.status == Status::OverBudget ? ill_conditioned_from(opt_.precision) : 1.0 / u;
  const ConditionSums cs = analyse(static_cast<int>(i), u, from);
  const Idx n = r.subject.numel;
  const Idx n_ill = cs.n_ill;
  const double kmax = cs.kmax;
  if (n_ill == 0) return;
  r.ill_conditioned = n_ill;
  r.condition = kmax;
  // rel_l2 and max_abs over the other values, normalised as over the whole tensor.
  auto over_rest = [](const RestSums& rs, const Metrics& whole, double l2) {
    Metrics m = whole;
    m.max_abs = rs.max;
    m.rel_l2 = whole.rel_l2_absolute
                   ? (rs.pairs ? std::sqrt(rs.d2) / std::sqrt(static_cast<double>(rs.pairs)) : 0.0)
                   : std::sqrt(rs.d2) / l2;
    return m;
  };
  const Metrics rest = over_rest(cs.subject, r.subject, r.subject.oracle_l2);
  std::ostringstream why;
  why.precision(3);
  std::ostringstream lim;
  lim << from;
  const std::string count = std::to_string(n_ill) + " of " + std::to_string(n) +
                            " values with condition >= " + lim.str();
  if (r.status == Status::OverBudget) {
    // Over the limit: not judged when the other values are within the SAME limits.
    if (rest.rel_l2 <= r.budget.rel_l2 && rest.max_abs <= r.budget.max_abs) {
      r.status = Status::IllConditioned;
      why << "ill-conditioned: not judged, over budget only on " << count << " (up to " << kmax
          << ")";
      if (n_ill < n)
        why << "; the others within it (rel_l2 " << rest.rel_l2 << ", max_abs " << rest.max_abs
            << ")";
    } else {
      why << r.note << " (without its " << count << ": still over, rel_l2 " << rest.rel_l2
          << ", max_abs " << rest.max_abs << ")";
    }
    r.note = why.str();
    return;
  }
  // Within the limit: judged only if the other values are within the limit their own draws give.
  Metrics base, cond;
  std::vector<std::pair<double, double>> rd[2];
  for (int t = 0; t < 2; ++t)
    for (const RestSums& d : cs.draws[t]) {
      const Metrics m = over_rest(d, st.first[t], st.ref_l2);
      rd[t].push_back({m.rel_l2, m.max_abs});
    }
  const bool has_b = !rd[0].empty(), has_c = opt_.compare_mode == CompareMode::EndToEnd && !rd[1].empty();
  if (has_b) base = baseline_of(rd[0], st);
  if (has_c) cond = combine(rd[1], st.first[1]);
  const Budget b = make_budget(*st.tol, opt_.precision, r.subject, has_b ? &base : nullptr,
                               r.budget.depth, r.budget.kind, has_c ? &cond : nullptr);
  if (n_ill < n && judge(rest, b).pass) return;  // judged on the others
  r.status = Status::IllConditioned;
  if (n_ill == n)
    why << "ill-conditioned: not judged, every value has condition >= " << lim.str()
        << " (up to " << kmax << ")";
  else
    why << "ill-conditioned: not judged, within budget only through " << count << " (up to "
        << kmax << "); the others exceed the limit their own draws give (rel_l2 " << rest.rel_l2
        << " > " << b.rel_l2 << " or max_abs " << rest.max_abs << " > " << b.max_abs << ")";
  r.note = why.str();
}

std::string narrow_norm(const Config& cfg) {
  std::string what;
  auto add = [&](const std::string& s) { what += (what.empty() ? "" : ", ") + s; };
  if (cfg.d_model <= kNarrowNorm) add("d_model " + std::to_string(cfg.d_model) + " (RMSNorm)");
  if (cfg.d_state <= kNarrowNorm) add("d_state " + std::to_string(cfg.d_state) + " (BCNorm)");
  if (cfg.is_outproj_norm && cfg.headdim <= kNarrowNorm)
    add("headdim " + std::to_string(cfg.headdim) + " (the gated norm)");
  return what;
}

double ill_conditioned_from(Precision p) {
  return std::min(1.0 / unit_roundoff(p), kCancellation);
}

CompareResult CellJudge::finish() {
  return finish([this](int row, double u, double from) {
    return analyse_host(static_cast<size_t>(row), u, from);
  });
}

CompareResult CellJudge::finish(const Analyse& analyse) {
  M3_REQUIRE(!in_draw_, "CellJudge", "the cell finishes inside a draw", "");
  for (size_t i = 0; i < st_.size(); ++i) condition(i, analyse);
  // End to end, a model with a norm over at most kNarrowNorm values whose runs parted: the first
  // failure is off by as much as its value where it is worst (a flipped or turned norm output
  // downstream); from there on failures are not judged, non-finite values included: the
  // derivative of a norm over one value is a spike of about 1/sqrt(eps) at zero, so a parted
  // run's gradients can leave the precision's range (f16 overflows at 65504). A non-finite value
  // never shows the parting itself: as the first failure it is judged.
  const std::string narrow = narrow_norm(cfg_);
  if (opt_.compare_mode == CompareMode::EndToEnd && !narrow.empty()) {
    bool parted = false;
    for (TensorResult& r : res_.rows) {
      const bool nonfinite = r.status == Status::NonFinite;
      if (r.status != Status::OverBudget && !nonfinite) continue;
      const double off = std::fabs(r.subject.worst_subject - r.subject.worst_oracle);
      parted = parted || (!nonfinite && off >= std::fabs(r.subject.worst_oracle));
      if (!parted) break;  // the first failure is an error of its own: judged
      r.status = Status::IllConditioned;
      r.note = "ill-conditioned: not judged end to end, the model has " + narrow +
               ": an RMS over so few values is a step (one value) or a rotation (two), whose "
               "output a rounding of a small input flips, at places the draws sample too "
               "sparsely, and the runs parted (" + r.note + "; the isolated cell judges this "
               "stage)";
    }
  }
  for (size_t i = 0; i < res_.rows.size(); ++i) {
    const TensorResult& r = res_.rows[i];
    if (!r.pass() && res_.first_fail < 0) res_.first_fail = static_cast<int>(i);
    if (r.subject.nan_count + r.subject.inf_count > 0 && res_.first_nonfinite < 0)
      res_.first_nonfinite = static_cast<int>(i);
  }
  st_.clear();
  return std::move(res_);
}

}  // namespace m3::harness
