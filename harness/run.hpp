// One comparison run: a Problem (seeded from a preset, or read from a golden file), an oracle,
// and per storage precision a subject (and a baseline, when there is one). For every requested
// scan mode the oracle runs ONCE and its Capture is kept; then, per precision, the subject runs
// streamed into the cell's judge (cell_judge.hpp: each tensor measured against the oracle's as
// it is produced, then dropped), and the baseline draws follow, one at a time and streamed too,
// only when some tensor is over its floor — the verdicts of every draw, for the draws the
// verdicts need (RunSpec::every_draw runs them all). The unperturbed runs the draws deviate
// from are the oracle itself when it is the exact reference (Implementation::exact_reference).
// The result is one CompareResult per
// (precision, scan mode, comparison mode) cell, precision-major: [p0·m0·e2e, p0·m0·iso,
// p0·m1·e2e, …] (with one comparison mode: [p0·m0, p0·m1, p1·m0, …]).
//
// Comparison modes (HARNESS.md §2, spec.compare_modes): end to end — the subject runs the whole
// backbone — and/or isolated — the subject's teacher-forced runner is handed the ORACLE's
// Capture of the same scan mode (computed first, once) and returns each stage's outputs when
// fed the oracle's inputs; isolated cells have no baseline (the floors of the table's isolated
// section decide) unless the lineup has isolated_baselines. Cells are precision-major, then
// scan mode, then comparison mode (e2e before isolated), so that a report shows the two side
// by side.
//
// An Implementation is anything that turns (Problem, scan mode) into a Capture of every registry
// tensor and parameter gradient; it may also have a teacher-forced (isolated) runner. Today on
// the CPU:
//   oracle    reference<double> (or the Captures stored in a golden file)
//   subject   reference<float> with the precision's storage: F32 exact float, BF16 / F16 the
//             mixed-precision storage emulation of MODEL.md §8 (float compute, typed tensors
//             rounded where the GPU stores them)
//   baseline  none in cpu_lineups (the subject IS the precision's yardstick, so the floors of
//             the tolerance table alone decide); m3h compare uses cpu_lineups_perturbed
//             (sweep.hpp): the perturbed oracle, the error each tensor's conditioning forces at
//             the precision, end to end and isolated. With the CUDA subject (gpu_lineup.hpp)
//             the baseline of each precision is the emulation above (HARNESS.md §1).
//   isolated  reference_emulation's teacher-forced runner is run_reference_isolated
//             (isolated.hpp): every reference stage alone on the oracle's inputs.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "capture.hpp"
#include "compare.hpp"
#include "config.hpp"
#include "precision.hpp"
#include "problem.hpp"

namespace m3::harness {

struct RunSpec {
  std::string preset = "default";  // the preset the problem started from (its adjustment applies)
  std::string source = "preset default";  // where the problem comes from, for the reports
  Config cfg;
  Idx B = 2, T = 256;
  std::uint64_t seed = 1234;
  bool random_states = true;
  std::vector<ScanMode> modes = {ScanMode::Sequential, ScanMode::Chunked};
  std::vector<CompareMode> compare_modes = {CompareMode::EndToEnd};  // e2e and/or isolated
  std::string filter;          // key_matches() pattern
  std::string by_position;     // key_matches() pattern of the error-against-position profiles
  std::string device = "cpu";  // where the subject runs
  // Run every baseline draw and measure it on every tensor (the same verdicts; each tensor's
  // report then shows its baseline even where the floor alone decided). A dump does so too.
  bool every_draw = false;
  // The device comparison's kept copies (rows over their floor, HARNESS.md §11) take at most
  // this many bytes of device memory; the rest go to page-locked host memory the device maps.
  // The verdicts and figures do not depend on it; the tests lower it to exercise the host side.
  std::size_t kept_device_limit = SIZE_MAX;
};

struct Preset;
// The RunSpec of preset p as it stands: its name, cfg, B, T, seed and entering states, source
// "preset NAME" (presets.hpp).
RunSpec preset_spec(const Preset& p);

// The seeded Problem of spec: make_problem + the preset's adjustment (presets.hpp).
Problem build_problem(const RunSpec& spec);

// A run of (problem, scan mode) → every registry tensor and parameter gradient. With a `sink`
// (non-empty) the run may stream (capture.hpp: each tensor handed to the sink as it is
// produced, the returned Capture holding the keys only); a run that keeps its tensors instead
// has them streamed to the sink by the harness afterwards (Capture::drain), so either is right.
using Run = std::function<Capture(const Problem&, ScanMode, const TensorSink& sink)>;
// The teacher-forced runner of a subject: (problem, scan mode, the oracle's Capture of that
// scan mode) → every stage's outputs when the stage is fed the oracle's inputs; `sink` as Run's.
using IsolatedRun =
    std::function<Capture(const Problem&, ScanMode, const Capture& oracle, const TensorSink& sink)>;

// A subject that reruns itself and digests its own tensors where they live (the GPU): the
// keys of the digests in order, and a run that returns them (with `cap`, optional, capturing
// every tensor too). m3h determinism at CI scale uses it (determinism.hpp).
struct RepeatRunner {
  std::vector<std::string> keys;
  std::function<std::vector<std::uint64_t>(Capture* cap)> run;
};

struct Implementation {
  std::string name;  // e.g. "reference<double>"
  Run run;
  IsolatedRun isolated = nullptr;  // empty: no isolated mode
  std::function<RepeatRunner(const Problem&, ScanMode)> repeat = nullptr;  // empty: none
  // Its Capture is run_reference<double>'s, bit for bit (reference_oracle): the unperturbed runs
  // the perturbed draws deviate from (Lineup::baseline_reference, …) are then the oracle itself
  // and are not run again.
  bool exact_reference = false;
};

Implementation reference_oracle();                    // run_reference<double>
// run_reference<float>(…, storage); isolated: run_reference_isolated(…, storage).
Implementation reference_emulation(Precision storage);
Implementation reference_float();                     // = reference_emulation(F32)
// Captures computed elsewhere (a golden file's oracle); a mode it lacks is an m3::Error.
Implementation stored_captures(std::string name, std::map<ScanMode, Capture> captures);

// What runs at one precision.
struct Lineup {
  Precision precision = Precision::F32;
  Implementation subject;
  std::optional<Implementation> baseline;
  // The conditioning baseline (sweep.hpp, the perturbed oracle) instead of a same-precision one:
  // the kind sets the rule's k (budget.hpp). more_baselines: further draws of `baseline`, a
  // tensor's baseline error the largest over all draws plus their range (rel_l2 and max_abs
  // each; budget.hpp).
  // isolated_baselines: the draws of the isolated cells' baseline, their `isolated` runners
  // (teacher-forced, handed the oracle's Capture like the subject's isolated run; always
  // BaselineKind::Perturbed, whatever baseline_kind says of the end-to-end baseline); empty:
  // isolated cells have none.
  BaselineKind baseline_kind = BaselineKind::SamePrecision;
  std::vector<Implementation> more_baselines = {};
  // End to end and for a token model, a second kind of draws of the baseline term, run (all of
  // them) only where a tensor is still over its limit after baseline and more_baselines
  // (CellJudge::over_limit): the perturbed oracle's coherent draws (budget.hpp kCoherentDraws);
  // the term's error is then the larger of the two kinds' (CellJudge::second_kind_from).
  // Empty: none.
  std::vector<Implementation> coherent_baselines = {};
  std::vector<Implementation> isolated_baselines = {};
  // The isolated cells' coherent draws (their `isolated` runners: teacher-forced, the teacher's
  // values keyed by value too), as coherent_baselines end to end: a token model's, run only
  // where a tensor is still over its limit after isolated_baselines.
  std::vector<Implementation> coherent_isolated_baselines = {};
  // The unperturbed runs the draws deviate from: a draw's error is measured against these, not
  // against the oracle, so that an oracle which is not the reference's own value (a stored,
  // possibly tampered golden file) never counts as error the precision forces. Empty: the
  // oracle (right when the oracle is reference<double> itself).
  std::function<Capture(const Problem&, ScanMode)> baseline_reference = nullptr;
  IsolatedRun isolated_baseline_reference = nullptr;
  // End to end, beside a same-precision baseline: the perturbed oracle's draws, the tensor's
  // conditioning (CompareOptions::conditioning, budget.hpp), measured against
  // conditioning_reference (null: the oracle). Empty: no such term.
  std::vector<Implementation> conditioning = {};
  std::function<Capture(const Problem&, ScanMode)> conditioning_reference = nullptr;
};

// The CPU lineup of spec.precisions: subject = reference_emulation(p), no baseline.
std::vector<Lineup> cpu_lineups(const std::vector<Precision>& precisions);

struct Comparison {
  RunSpec spec;
  std::string oracle_name;
  std::vector<Lineup> lineups;       // one per precision (names only are used after the run)
  // precision-major: lineups × spec.modes × spec.compare_modes
  std::vector<CompareResult> cells;

  // null when not run
  const CompareResult* cell(Precision p, ScanMode m,
                            CompareMode cm = CompareMode::EndToEnd) const;
  bool pass() const;
  int n_checks() const;  // rows over all cells
  int n_fail() const;
};

// Runs and compares every (precision, scan mode, comparison mode) cell on `pb` (which must
// match spec's cfg, B, T). Throws m3::Error on an invalid config or run shape, an empty
// lineup/mode list, or an isolated comparison of a subject without a teacher-forced runner.
// `observe` (may be empty) is called once per cell right after it is judged, in run order
// (scan mode outermost, then lineup, then comparison mode), with the captures it was judged
// on: the oracle's, the subject's and the baseline's (its first draw; null without one) —
// m3h dump writes its arrays from these, so that its verdicts are compare's. With an observer
// the subject's and the first draw's Captures are kept whole and every draw runs.
using CellObserver = std::function<void(const CompareResult& cell, const Capture& oracle,
                                        const Capture& subject, const Capture* baseline)>;
Comparison run_comparison(const RunSpec& spec, const Problem& pb, const Implementation& oracle,
                          const std::vector<Lineup>& lineups, const CellObserver& observe = {});

}  // namespace m3::harness
