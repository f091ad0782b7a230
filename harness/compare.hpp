// Compares a subject Capture with an oracle Capture (and, optionally, a baseline Capture) over
// every key the registry expects for (config, B, T, scan mode): the stage tensors of
// expected_stage_keys() in execution order (forward, then backward), then the parameter
// gradients of expected_param_keys() ("grad/…", flat order of MODEL.md §2).
//
// Per key: metrics (metrics.hpp) of subject vs oracle (and baseline vs oracle), the budget of
// the tolerance table (budget.hpp) and a status. A key missing from the subject, a shape that
// differs from the oracle's, or a subject value that is NaN/Inf where the oracle is finite is
// a failure with its own status, never a crash. The first failing key in execution order is
// recorded, and so is the first key whose subject holds a NaN/Inf where the oracle is finite
// (whatever that key's status: a non-finite value is never hidden behind another failure).
// Keys can be filtered by name (key_matches).
//
// Comparison mode (budget.hpp, HARNESS.md §2): end to end (the default; the table's end-to-end
// floors × the depth factor, plus k · the baseline's error when there is a baseline) or
// isolated (the subject Capture holds each stage's outputs when fed the oracle's inputs; the
// table's isolated floors, no depth factor — a teacher-forced stage does not accumulate error
// over layers — plus k · the error of CompareOptions::isolated_baselines when given).
#pragma once

#include <string>
#include <vector>

#include "budget.hpp"
#include "capture.hpp"
#include "config.hpp"
#include "metrics.hpp"
#include "position.hpp"
#include "ulps.hpp"
#include "registry.hpp"

namespace m3::harness {

enum class Status {
  Pass,           // within budget
  OverBudget,     // rel_l2 or max_abs above its budget
  NonFinite,      // subject NaN/Inf where the oracle is finite
  Missing,        // the subject did not capture the key
  ShapeMismatch,  // subject shape differs from the oracle's
  OracleMissing,  // the oracle did not capture the key (a reference bug)
  OracleBad,      // the oracle's shape differs from the registry, or the oracle is not finite
  // Not judged: over budget only on values too ill-conditioned to judge (cell_judge.hpp),
  // within it on every other value. Not a failure; counted apart (CompareResult::n_ill).
  IllConditioned,
};
const char* status_name(Status s);  // "ok", "FAIL", "NONFINITE", "MISSING", "SHAPE", …,
                                    // "ILL-CONDITIONED"

struct TensorResult {
  std::string key;     // "L2/B6/d_x", "grad/L0/in_proj_w"
  int layer = -1;      // -1: backbone tensor or parameter
  std::string stage;   // registry stage, or "grad" for parameter gradients
  std::string tensor;  // tensor or parameter name
  bool is_param = false;
  bool circular = false;
  const std::vector<Sym>* syms = nullptr;  // registry shape (for decode_index)
  std::vector<Idx> shape;                  // expected (registry) shape
  Status status = Status::Pass;
  Metrics subject;                          // subject vs oracle
  bool has_baseline = false;
  // Baseline vs its reference, when has_baseline: rel_l2 and max_abs are the draws' max + range
  // (budget.hpp), the other fields those of the first draw (error_norms: no p95, cosine, ulps).
  Metrics baseline;
  int draws = 0;                            // baseline draws that entered the limit (0: the
                                            // floor alone decided, cell_judge.hpp)
  int conditioning_draws = 0;               // the same for the conditioning term
  Budget budget;
  Verdict verdict;
  std::string worst_coords;                 // decoded worst_index of subject vs oracle
  std::string note;                         // why it failed, when it did
  PositionProfile by_position;              // subject vs oracle per t (CompareOptions::by_position)
  // Values found ill-conditioned (cell_judge.hpp; only for a tensor over its limit after every
  // draw) and the largest condition number κ among them (+inf for a zero reference value).
  Idx ill_conditioned = 0;
  double condition = 0;

  // Not a failure: within budget, or not judged for ill-conditioning.
  bool pass() const { return status == Status::Pass || status == Status::IllConditioned; }
  bool judged() const { return status != Status::IllConditioned; }
  // The subject's metrics are in (a verdict on the budget, or one blocked by a non-finite value).
  bool measured() const {
    return status == Status::Pass || status == Status::OverBudget ||
           status == Status::NonFinite || status == Status::IllConditioned ||
           (status == Status::OracleBad && subject.numel > 0);
  }
};

struct CompareOptions {
  Precision precision = Precision::F32;  // the subject's storage precision (budget, ulps)
  CompareMode compare_mode = CompareMode::EndToEnd;
  std::string filter;                    // key_matches() pattern; empty = every key
  bool include_params = true;            // also compare "grad/…"
  // key_matches() pattern of the [B·T, …] tensors whose error against position is kept
  // (TensorResult::by_position, position.hpp); empty = none.
  std::string by_position;
  // What the baseline is (budget.hpp: the k of the rule).
  BaselineKind baseline_kind = BaselineKind::SamePrecision;
  // Further draws of a random baseline (Lineup::more_baselines): each tensor's baseline error is
  // the largest over `baseline` and these plus their range, max + (max − min) (rel_l2 and
  // max_abs each; budget.hpp). Ignored without a baseline.
  std::vector<const Capture*> more_baselines = {};
  // Isolated mode only: the draws of a teacher-forced baseline (the perturbed oracle's isolated
  // run, sweep.hpp), combined the same way. (The end-to-end `baseline` argument stays refused
  // in isolated mode.)
  std::vector<const Capture*> isolated_baselines = {};
  // What the baseline draws' error is measured against (Lineup::baseline_reference, and its
  // isolated counterpart); null: the oracle. The subject's error is always against the oracle.
  const Capture* baseline_reference = nullptr;
  // End to end, beside a same-precision baseline (the GPU's cells): the perturbed oracle's
  // draws (Lineup::conditioning) and what they deviate from (null: the oracle). A tensor's
  // limit is then max(k · baseline, k_p · conditioning) + floor (budget.hpp): the emulation
  // is one float implementation, and another one (other summation orders) may err by as much
  // as the tensor's conditioning forces.
  std::vector<const Capture*> conditioning = {};
  const Capture* conditioning_reference = nullptr;
};

struct CompareResult {
  ScanMode mode = ScanMode::Sequential;
  Config cfg;
  Idx B = 0, T = 0;
  Precision precision = Precision::F32;
  CompareMode compare_mode = CompareMode::EndToEnd;
  std::vector<TensorResult> rows;         // execution order
  int first_fail = -1;                    // index into rows, -1 when all pass
  int first_nonfinite = -1;               // first row with subject NaN/Inf where the oracle is
                                          // finite (any status), -1 when none
  std::vector<std::string> extra_keys;    // captured by the subject but not expected

  bool pass() const { return first_fail < 0; }
  int n_fail() const;
  int n_ill() const;  // rows with Status::IllConditioned
  // The judged row (not ill-conditioned) with the largest share of its budget used
  // (verdict.pct(), the first of equals), or null when there is none: verification's "worst"
  // while training.
  const TensorResult* largest_share() const;
  // The same among the passing judged rows, or null when none: the summaries' "tightest passing".
  const TensorResult* tightest_passing() const;
};

// `pattern` is one or more comma-separated alternatives; an alternative with * ? or [...] is
// a glob over the whole key, otherwise a substring. An empty pattern matches every key.
bool key_matches(const std::string& key, const std::string& pattern);

// Every key compare_captures() checks for (cfg, B, T, mode), unfiltered, in its order.
std::vector<std::string> expected_keys(const Config& cfg, Idx B, Idx T, ScanMode mode,
                                       bool include_params = true);

// `baseline` may be null (and must be, in isolated mode). Throws m3::Error only on an invalid
// (cfg, B, T) or a baseline given to an isolated comparison.
CompareResult compare_captures(const Capture& oracle, const Capture& subject,
                               const Capture* baseline, const Config& cfg, Idx B, Idx T,
                               ScanMode mode, const CompareOptions& opt = {});

}  // namespace m3::harness
