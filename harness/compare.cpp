// Capture-against-capture comparison over the registry's keys (see compare.hpp).
#include "compare.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include "cell_judge.hpp"
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
    case Status::IllConditioned: return "ILL-CONDITIONED";
  }
  return "?";
}

int CompareResult::n_fail() const {
  int n = 0;
  for (const auto& r : rows) n += r.pass() ? 0 : 1;
  return n;
}

int CompareResult::n_ill() const {
  int n = 0;
  for (const auto& r : rows) n += r.status == Status::IllConditioned ? 1 : 0;
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
  return largest_share_of(rows, [](const TensorResult& r) { return r.judged(); });
}

const TensorResult* CompareResult::tightest_passing() const {
  return largest_share_of(rows, [](const TensorResult& r) { return r.pass() && r.judged(); });
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

CompareResult compare_captures(const Capture& oracle, const Capture& subject,
                               const Capture* baseline, const Config& cfg, Idx B, Idx T,
                               ScanMode mode, const CompareOptions& opt) {
  validate_run(cfg, B, T);
  M3_REQUIRE(!baseline || opt.compare_mode == CompareMode::EndToEnd, "compare_captures",
             "an isolated comparison has no baseline",
             "the end-to-end baseline measures propagated error, not one stage's");
  const bool iso = opt.compare_mode == CompareMode::Isolated;
  // Every draw is at hand already: each is measured on every tensor (eager).
  std::vector<const Capture*> draws;
  if (!iso && baseline) {
    draws.push_back(baseline);
    draws.insert(draws.end(), opt.more_baselines.begin(), opt.more_baselines.end());
  }
  if (iso) draws = opt.isolated_baselines;
  CellJudge judge(oracle, cfg, B, T, mode, opt, !draws.empty(), /*eager=*/true);
  for (const std::string& k : subject.keys())
    if (const Tensor* t = subject.find(k)) judge.subject(k, *t);
  judge.subject_done();
  auto feed = [&](CellJudge::Term term, const std::vector<const Capture*>& set,
                  const Capture* reference) {
    for (const Capture* d : set) {
      judge.draw_begin(term, reference);
      if (d)
        for (const std::string& k : d->keys())
          if (const Tensor* t = d->find(k)) judge.draw(k, *t);
      judge.draw_end();
    }
  };
  feed(CellJudge::Term::Baseline, draws, opt.baseline_reference);
  if (!iso) feed(CellJudge::Term::Conditioning, opt.conditioning, opt.conditioning_reference);
  return judge.finish();
}

}  // namespace m3::harness
