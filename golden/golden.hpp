// Golden files (HARNESS.md §8): one HDF5 file per case holding a whole double-oracle run —
// config, run shape, seed, weights, input X, output gradient dOut, entering states, and every
// stage tensor and parameter gradient the stage registry says the run produces, per scan mode.
// A token model (cfg.vocab_size > 0, TRAINING.md §1) holds tokens, targets and weights instead
// of X and dOut, and its run is one training step (embed → backbone → head → loss, backward).
// The layout is golden/SCHEMA.md (schema version kSchemaVersion); the HDF5 layer is h5store.hpp.
//
//   compute_case  runs run_reference<double> on a Problem for each requested scan mode
//   write_golden  writes a GoldenCase atomically (temp file + rename); refuses to replace an
//                 existing file unless force
//   read_golden   reads a file back and validates EVERYTHING (schema version, config, presence
//                 and shape of every dataset the registry expects and nothing else, finiteness
//                 of weights, inputs and oracle tensors; a token model's tokens and targets
//                 integers in [0, vocab_size), its weights ≥ 0 and not all 0); any problem is
//                 one m3::Error line naming the dataset.
//                 The Problem is reconstructed bit-exactly (all values are stored as f64).
//   diff_cases    tensor-by-tensor comparison of two cases (check: stored vs recomputed;
//                 regen: old file vs new computation), in execution order per mode
//   check_file    read_golden + compute_case on the stored Problem + diff_cases
//
// The built-in cases (golden/cases.cpp) are a table name → (Config, B, T, seed, entering
// states, scan modes); their files live in default_dir() as "<name>.h5".
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "h5store.hpp"
#include "problem.hpp"

namespace m3::golden {

constexpr int kSchemaVersion = 1;
constexpr const char* kGenerator = "mamba3-harness";
constexpr const char* kGeneratorVersion = "0.1";

// The git revision baked in at configure time (`git rev-parse --short HEAD`), or "unknown".
const char* git_revision();

// The attributes that describe a run, written on `group` of both golden files and dumps:
// every Config field (vocab_size only when > 0: absent means 0, so the files of backbone-only
// runs are as before token models), the derived dimensions (d_inner, nheads, num_rope_angles,
// in_proj_dim), B, T and the seed (as a decimal string: HDF5's int64 cannot hold every uint64
// seed).
void write_run_attrs(h5::Writer& w, const std::string& group, const Config& c, Idx B, Idx T,
                     std::uint64_t seed);

struct GoldenCase {             // everything a golden file holds
  std::string name;             // case name
  Problem problem;              // config, B, T, seed, params, x, d_out (a token model: tok,
                                // tgt, w), entering states (double)
  std::vector<ScanMode> modes;  // modes stored, in file order
  std::map<ScanMode, Capture> oracle;  // per mode: every registry stage tensor + "grad/..." keys
};

// Runs run_reference<double>(pb, mode) for every mode. Throws m3::Error on an empty or
// duplicated mode list, or an invalid problem.
GoldenCase compute_case(const std::string& name, const Problem& pb,
                        const std::vector<ScanMode>& modes);

// Writes gc to `path` via h5::Writer (atomic). Without force an existing file is an error
// ("file exists (pass --force to replace it)") and stays byte-identical.
void write_golden(const std::string& path, const GoldenCase& gc, bool force);

// Reads and validates a golden file; throws m3::Error with one line naming the file and what
// is wrong (a schema mismatch names the version found, the version expected and how to write
// the file again: "m3h golden regen --case NAME --force" for a built-in case, otherwise the
// regen --out command, or — for an m3h dump — that it is no golden file).
GoldenCase read_golden(const std::string& path);

// ---- comparing two cases ------------------------------------------------------------------

// The check tolerance (SCHEMA.md "Tolerance"): a tensor matches when
//   max_abs ≤ rtol · max(scale, min_scale)   and   ‖Δ‖₂ ≤ rtol · max(‖o‖₂, min_scale·√n)
// with scale = max|o| over the stored (reference) tensor o; angle tensors (registry
// `circular`) use the circular distance. min_scale keeps tensors that are zero up to
// round-off (e.g. d_angle_state with zero entering states) from demanding relative agreement.
struct Tolerance {
  double rtol = 1e-10;
  double min_scale = 1e-3;
};

enum class DiffStatus { Unchanged, Changed, New, Removed, ShapeChanged };
const char* diff_status_name(DiffStatus s);  // "unchanged" "changed" "new" "removed" "shape"

struct TensorDiff {
  ScanMode mode = ScanMode::Sequential;
  std::string key;        // capture key: "L0/F3/dt", "norm_f/Out", "grad/L1/in_proj_w"
  DiffStatus status = DiffStatus::Unchanged;
  bool identical = true;  // bit-identical (Unchanged also covers within-tolerance)
  double max_abs = 0;     // max |new − old| (circular distance for angles)
  Idx worst_index = -1;   // flat index of max_abs
  double old_value = 0, new_value = 0;  // at worst_index
  double scale = 0;       // max |old|
  double rel_l2 = 0;      // ‖Δ‖₂ / max(‖old‖₂, min_scale·√n)
  std::vector<Idx> old_shape, new_shape;
  std::string path() const;  // "seq/L0/F3/dt"
};

struct CaseDiff {
  std::vector<TensorDiff> tensors;  // per mode (file order), execution order, then extras
  bool inputs_changed = false;      // config, B, T, weights, x, dOut or states differ
  std::string inputs_note;          // what differs first, when inputs_changed
  bool modes_changed = false;
  int not_compared = 0;             // reference tensors a subset candidate does not provide
  int count(DiffStatus s) const;
  const TensorDiff* first_mismatch() const;  // first non-Unchanged tensor, or null
};

// `reference` is the stored (old) case, `candidate` the new one. Tensors of a mode that only
// one side has are New/Removed. `candidate_subset`: the candidate computes only some of the
// tensors (the GPU oracle: the registry tensors of both scan modes); a reference tensor it lacks
// is left out and counted in not_compared instead of being Removed.
CaseDiff diff_cases(const GoldenCase& reference, const GoldenCase& candidate,
                    const Tolerance& tol = {}, bool candidate_subset = false);

// One line per tensor diff: "seq/L0/F3/dt max_abs 1.2e-12 (scale 3.4, rel_l2 5e-13) at
// [12, 3]: <old> → <new>".
std::string describe(const TensorDiff& d);

// What `m3h golden regen --force` prints for old file → new computation: a header line
// "unchanged: N tensors (M bit-identical); changed: C; new: n; removed: r; shape: s", a line
// when the inputs or the scan modes differ, then one describe() line per tensor that is not
// Unchanged (at most max_lines, then "... and K more").
std::vector<std::string> summarize(const CaseDiff& d, int max_lines = 20);

struct CheckResult {
  std::string name;       // case name stored in the file
  std::string path;
  std::string by;         // the recomputing implementation (Recomputer::name); "" = the oracle
  CaseDiff diff;          // stored (reference) vs recomputed (candidate)
  bool pass() const { return diff.first_mismatch() == nullptr && !diff.modes_changed; }
  // "PASS default (seq,chunked: 734 tensors) …" / "FAIL …"; with another implementation it
  // ends "; by <by>, N stored tensors it does not provide not compared".
  std::string line() const;
  std::string by_note() const;  // the ending of line() for another implementation ("" if none)
};

// read_golden(path), recompute every stored mode with run_reference<double> on the stored
// Problem, compare. Throws m3::Error (one line) for a bad file.
CheckResult check_file(const std::string& path, const Tolerance& tol = {});

// Another implementation in the double oracle's place (m3h golden check --device gpu-oracle):
// `run` computes a stored problem's tensors once, and that one Capture is compared with every
// stored scan mode (the implementation has no scan modes of its own); it may provide a subset
// of the keys (diff_cases' candidate_subset), and the line names the stored tensors left out.
struct Recomputer {
  std::string name;  // "the GPU oracle", for the line
  std::function<Capture(const Problem&)> run;
};
CheckResult check_file(const std::string& path, const Recomputer& how, const Tolerance& tol);

// ---- built-in cases (golden/cases.cpp) ----------------------------------------------------

struct CaseDef {
  std::string name;
  std::string about;  // which property it covers
  Config cfg;
  Idx B = 1, T = 16;
  std::uint64_t seed = 1;
  bool random_states = false;
  std::vector<ScanMode> modes = {ScanMode::Sequential, ScanMode::Chunked};
};

const std::vector<CaseDef>& builtin_cases();
const CaseDef& find_case(const std::string& name);  // throws listing the known names
GoldenCase make_case(const CaseDef& def);            // make_problem + compute_case

// The case folder: $M3_GOLDEN_DIR when set and non-empty, else the source tree's golden/cases
// (baked in at configure time).
std::string default_dir();
std::string case_path(const std::string& dir, const std::string& name);  // dir/name.h5

}  // namespace m3::golden
