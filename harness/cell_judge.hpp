// The judge of one comparison cell (precision × scan mode × comparison mode), fed tensor by
// tensor as the runs produce them, so that no run's Capture has to be held: only the oracle's
// is (the yardstick of every other run). compare_captures (compare.hpp) feeds it stored
// Captures; run_comparison (run.hpp) streams the runs into it.
//
// The rule is budget.hpp's: a tensor passes when e ≤ limit for e = rel_l2 and max_abs, with
//
//     limit = f(B, C) + floor,   f = k·B (or max(k·B, k_p·C), or max(floor, kTightK·B) − floor
//                                  for a tight row), B and C each "max + range" over the draws
//
// where B is the baseline term (the same-precision baseline, or the perturbed oracle's draws;
// with a second kind of draws, the coherent ones of a token model's cell, the larger of the two
// kinds' max + range, the tight row the first kind's alone: second_kind_from) and C the conditioning term (the perturbed oracle
// beside a same-precision baseline). Every
// limit is non-decreasing in each draw: the largest of more draws is no smaller, their range
// no narrower, and f ≥ 0. So a tensor within its floor passes whatever the draws say, and the
// draws are needed only by the tensors over their floor. Those keep their values and take
// every draw (their verdict, and the condition of their values below, need them all); the
// judge says whether there is any (open()), and run_comparison runs the draws, one at a time,
// only then, each measured only on those tensors. The verdicts are those of every draw
// measured on every tensor (RunSpec::every_draw), at the cost of none where every floor holds,
// as it does at the default problem.
//
// Ill-conditioned values (HARNESS.md §4). A value that is a cancellation of much larger terms
// cannot be judged at a precision that does not resolve it. Its condition number is estimated
// from the draws of the rows over the floor (they take every draw and keep their values):
//
//     κ_i = s_i / (u · |r_i|),   s_i = max over the draws of |draw_i − r_i|
//
// (r the draws' unperturbed reference, u the cell's unit roundoff): the relative change of the
// value per relative rounding of what it is computed from, ≈ ‖terms‖/|value| for a sum.
//  * Over its limit after every draw: values with κ ≥ ill_conditioned_from(p) are left out; if
//    the subject is within the SAME limits on the others (their rel_l2 and max_abs, normalised
//    as the whole tensor's), the tensor is "ill-conditioned: not judged"; otherwise it fails.
//    Leaving values out never widens a limit, so an error of the other values fails as before.
//  * Within its limit: if values have κ ≥ 1/u (no correct digit at p) and the others are not
//    within the limit their own draws give (or there are none), the pass rests on noise: "not
//    judged" too. Otherwise it passes, judged on the others.
// End to end, a model with a norm over at most kNarrowNorm values (narrow_norm below) whose
// runs parted — its first failure, in execution order, off by at least its own value where it
// is worst, as a flipped norm output makes it — is not judged on that failure and the later
// ones; an error of its own (smaller than the value) fails, and the isolated cells are judged
// as any.
// A verdict "not judged" is Status::IllConditioned: not a failure, counted apart, with the
// count of such values and the largest κ (TensorResult::ill_conditioned, condition).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "compare.hpp"
#include "compare_gpu.hpp"  // RestSums (plain C++)

namespace m3::harness {

// The condition at and above which a value is ill-conditioned at precision p:
// min(1/u, kCancellation). κ ≥ 1/u: one rounding per stored value moves the value by as much as
// itself, it has no correct digit at p (its sign is a coin flip; bf16 256, f16 2048). κ ≥
// kCancellation: a cancellation of terms 2^12 times larger than the value, whose float
// reduction error (up to √n times one rounding per term, by summation order) the draws do not
// predict within k (f32, whose 1/u is 2^24, comes to this first). Measured over the CPU
// sweep: docs/HARNESS.md §4.
constexpr double kCancellation = 4096;
double ill_conditioned_from(Precision p);

// A norm over at most kNarrowNorm values (d_model for RMSNorm and norm_f, d_state for BCNorm,
// headdim for the gated norm): x/‖x‖ over one value is sign(x), over two the direction of a
// 2-vector, so a rounding that moves a small input flips or turns the output by O(1), and the
// runs part there at random places. End to end, once they have parted, such a model's failures
// are not judged (the isolated cells judge every stage). narrow_norm: which norms are narrow
// ("d_state 1 (BCNorm)", …), "" when none.
constexpr Idx kNarrowNorm = 2;
std::string narrow_norm(const Config& cfg);

// The per-value figures of the ill-conditioning rule (above) for one row, computed where its
// values live (CellJudge's own for the host front end; harness/device_compare.cpp's on the
// GPU): the count n_ill of values with κ ≥ `from` and the largest such κ; and over the other
// values (finite ones only), Σ|Δ|², max|Δ| and their count, for the subject against the oracle
// and for each draw of each term against its reference.
using RestSums = gpu::RestSums;  // Σ|Δ|², max|Δ|, count (compare_gpu.hpp)
struct ConditionSums {
  Idx n_ill = 0;
  double kmax = 0;
  RestSums subject;
  std::vector<RestSums> draws[2];  // per term, in draw order
};

class CellJudge {
 public:
  // What the draws of a cell are for: the baseline term B or the conditioning term C.
  enum class Term { Baseline = 0, Conditioning = 1 };
  // `planned_baseline`: the cell has baseline draws (an isolated cell's then take the perturbed
  // k whether or not they are run). `eager`: every draw is measured on every tensor (the
  // report shows each tensor's baseline; compare_captures and --every-draw).
  CellJudge(const Capture& oracle, const Config& cfg, Idx B, Idx T, ScanMode mode,
            const CompareOptions& opt, bool planned_baseline, bool eager);
  // The measured form, for a front end that computes the figures where the values live (the
  // device comparison): the oracle's shape of a key instead of its Capture (null: the oracle
  // lacks the key). `only_provided`: the rows the oracle lacks are not judged at all (an oracle
  // that computes a subset by design, the GPU oracle's common rows), instead of OracleMissing.
  using OracleShape = std::function<const std::vector<Idx>*(const std::string& key)>;
  CellJudge(const OracleShape& oracle, const Config& cfg, Idx B, Idx T, ScanMode mode,
            const CompareOptions& opt, bool planned_baseline, bool eager,
            bool only_provided = false);
  ~CellJudge();
  CellJudge(const CellJudge&) = delete;
  CellJudge& operator=(const CellJudge&) = delete;

  // ---- the host front end: tensors on the host, measured here ------------------------------
  // The subject's tensors (a TensorSink); a key the registry does not expect is recorded.
  void subject(const std::string& key, const Tensor& t);
  // After the subject: every row judged on its floor; rows it never delivered are missing.
  void subject_done();

  // Whether the draws are needed: some tensor is over its floor (or, when eager, any tensor is
  // judged at all).
  bool open() const;
  // Whether some tensor is over its limit with the draws so far (the gate of the coherent
  // draws, Lineup::coherent_baselines).
  bool over_limit() const;
  // The baseline term's draws from index k on are of a second kind (the coherent draws): the
  // term's error is the larger of the two kinds' max + range, not one max + range over both.
  void second_kind_from(size_t k) { second_kind_from_ = k; }
  // One draw of `term`, measured against `reference` (null: the oracle): begin, its tensors,
  // end (which re-judges the tensors it was measured on).
  void draw_begin(Term term, const Capture* reference);
  void draw(const std::string& key, const Tensor& t);
  void draw_end();

  // The cell's result (ill-conditioned verdicts decided here).
  CompareResult finish();

  // ---- the measured form: the front end measures, the judge decides --------------------------
  // The row of a key (−1: not judged here — filtered out, decided already, or not expected, which
  // is then recorded as an extra key).
  int row(const std::string& key);
  const TensorResult& result(int row) const;
  // Whether the row's error against position is wanted (CompareOptions::by_position).
  bool wants_profile(int row) const;
  // The subject's figures of a row (and its profile, when asked for); returns whether the row
  // is over its floor's limit, so that its values are to be kept for the ill-conditioning rule.
  bool subject_measured(int row, const Metrics& m, PositionProfile profile);
  void subject_mismatch(int row, const std::vector<Idx>& shape);
  // Whether the draw in progress is to be measured on a row, and its figures (error_norms of
  // the draw against the reference); or why it could not be.
  bool wants(int row) const;
  void draw_measured(int row, const Metrics& m);
  void draw_unusable(int row, const std::string& why);
  // Whether a row's values are still wanted by the ill-conditioning rule (over its floor).
  bool kept(int row) const;
  // draw_begin without a reference Capture (the front end knows what it measures against).
  void draw_begin(Term term);
  // The cell's result; `analyse` gives the ConditionSums of a kept row for (u, from).
  using Analyse = std::function<ConditionSums(int row, double u, double from)>;
  CompareResult finish(const Analyse& analyse);

 private:
  struct State;
  void init(const OracleShape& oracle, const CompareOptions& opt, bool only_provided);
  bool wants(const State& st) const;
  void rejudge(size_t i);
  void condition(size_t i, const Analyse& analyse);
  ConditionSums analyse_host(size_t i, double u, double from) const;

  const Capture* oracle_ = nullptr;  // the host front end's oracle
  Config cfg_;
  Idx B_, T_;
  ScanMode mode_;
  CompareOptions opt_;
  bool planned_baseline_, eager_;
  CompareResult res_;
  std::vector<State> st_;
  std::unordered_map<std::string, size_t> row_of_;  // key → row
  std::vector<std::string> expected_;                // every expected key, filtered or not
  // The draw in progress.
  Term term_ = Term::Baseline;
  const Capture* ref_ = nullptr;
  int n_draws_[2] = {0, 0};
  size_t second_kind_from_ = SIZE_MAX;
  Metrics baseline_of(const std::vector<std::pair<double, double>>& draws, const State& st) const;
  bool in_draw_ = false;
};

}  // namespace m3::harness
