// m3h judge (HARNESS.md §10): the harness as the verifier of ANOTHER implementation of Mamba-3.
// That implementation runs a golden case (its weights, input, output gradient and entering
// states, handed to it by export_problem) and writes what it computed — any subset of the
// registry's stage tensors (MODEL.md §10: "norm_f/Out", "L0/F6/y", "L0/states/ssm_state", …)
// and parameter gradients ("grad/L0/in_proj_w", …) — into a subject file with its storage
// precision, its scan mode and its layout conventions declared. Each tensor it provides is then
// judged exactly as `m3h compare` judges the GPU path (compare.hpp, budget.hpp):
//
//     e(subject, oracle) ≤ max(k · e(emulation, oracle), k_p · e(perturbed, oracle)) + floor
//
// oracle = the golden file's stored double run of that scan mode; emulation = our float
// reference with the subject's storage precision (reference_emulation, MODEL.md §8); perturbed
// = the perturbed oracle's draws (perturbed.hpp: the error the tensor's conditioning forces at
// that precision); floor = the tolerance table's, times the depth factor — for e = rel_l2 and
// e = max_abs. Rows are in chain order (forward, then backward, then the parameter gradients),
// so the first failing row is the first failing stage. Tensors of the run that the subject
// does not provide are listed as not provided, never failed.
//
// Subject files (two forms, one content):
//   HDF5     /meta attributes format = "m3h-subject", format_version = 1, precision (f32 | bf16 |
//            f16), scan_mode (seq | chunked), implementation (optional text), linear_layout
//            (optional: in_out | out_in); /tensors/<key> datasets (f64, f32, or h5store's
//            bf16/f16), each with an optional linear_layout attribute.
//   folder   meta.json {"format": "m3h-subject", "format_version": 1, "precision", "scan_mode",
//            "implementation", "linear_layout", "tensors": {"<key>": {"linear_layout": …}}} and
//            one NumPy file per tensor, <folder>/<key>.npy ('<f8', '<f4' or '<f2', C order).
// Layout conventions are declared, never guessed: linear_layout = out_in says that the
// gradients of the Linear weights (in_proj_w, out_proj_w, head_w, and input_proj_w unless it is a
// token model's embedding) are stored [out, in] as PyTorch's nn.Linear.weight, the transpose of
// our [in, out]; declared per tensor it applies to that tensor (one of those four parameters'
// gradients, the embedding included). Everything else must be at the registry's shape. What a
// subject file declares beyond these keys, a tensor that is not a key of this run, a shape that
// differs from the expected one, and an unknown value are m3::Error lines (exit 2 in m3h).
//
// The problem for the other implementation (export_problem): a folder with problem.json
// (config, run shape, seed, scan modes, the list of arrays with their shapes) and one .npy
// ('<f8', exact) per weight and input, at the golden file's own paths:
// weights/<param>.npy, weights/L<ℓ>/<param>.npy, inputs/x.npy, inputs/d_out.npy,
// inputs/states/{ssm,k,v,angle}.npy (a token model: inputs/tok.npy, tgt.npy, w.npy).
#pragma once

#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "capture.hpp"
#include "golden.hpp"
#include "report.hpp"
#include "report_json.hpp"
#include "run.hpp"

namespace m3::harness {

enum class LinearLayout { InOut, OutIn };
const char* linear_layout_name(LinearLayout l);  // "in_out" | "out_in"

// What a subject file holds: its declarations and its tensors as stored (before any transpose).
struct Subject {
  std::string source;          // the file or folder, for reports and errors
  std::string implementation;  // as declared; "" when not declared
  Precision precision = Precision::F32;
  ScanMode mode = ScanMode::Chunked;
  LinearLayout linear_layout = LinearLayout::InOut;    // the file-wide declaration
  std::map<std::string, LinearLayout> tensor_layouts;  // per-tensor declarations
  std::vector<std::string> keys;                       // in the file's order
  std::map<std::string, Tensor> tensors;
};

// Reads and checks the declarations (not the keys: those need the run, see subject_capture).
// Any problem is an m3::Error of one line naming the file and the item.
Subject read_subject_h5(const std::string& path);
Subject read_subject_dir(const std::string& dir);
// Writers of the same two forms (atomic; an existing file or folder only with force, and a
// folder only when it is a subject folder, i.e. holds meta.json). Every tensor at f64.
void write_subject_h5(const std::string& path, const Subject& s, bool force);
void write_subject_dir(const std::string& dir, const Subject& s, bool force);

// The subject's tensors in our layout, checked against the registry for (cfg, B, T, s.mode):
// every key must be a stage key of that scan mode or a parameter gradient of cfg, every
// per-tensor layout must name a Linear weight's gradient, and every shape must be the
// registry's (or its transpose, declared). `transposed` lists the keys read as [out, in].
struct SubjectCapture {
  Capture capture;
  std::vector<std::string> transposed;
};
SubjectCapture subject_capture(const Subject& s, const Config& cfg, Idx B, Idx T);

struct Judgement {
  Comparison comparison;                  // one cell (subject precision, scan mode, e2e)
  std::string golden_path;
  Subject subject;                        // declarations (tensors cleared)
  std::vector<std::string> transposed;    // keys read as [out, in]
  std::vector<std::string> not_provided;  // keys of the run the subject lacks, chain order
  int n_expected = 0;                     // keys of the run (stages of the mode + gradients)
  bool pass() const { return comparison.pass(); }
};

// Judges `s` against the golden case `g` (read from golden_path). The golden file must store
// s.mode. Throws m3::Error for a subject that does not fit the run (subject_capture) or that
// provides no tensor.
Judgement judge_subject(const golden::GoldenCase& g, const std::string& golden_path, Subject s);

// The terminal report: a header (oracle, subject, declarations, config, run, rule), compare's
// table and detail lines over the provided tensors, the tensors not provided (grouped by
// stage), then compare's summary, naming the first failing stage.
void print_judgement(std::ostream& os, const Judgement& j, const ReportOptions& opt = {});

// compare's JSON (report_json.hpp, schema "m3h-compare/2") with one more top-level object,
// "judge": {"golden", "subject", "format", "implementation", "precision", "scan_mode",
// "linear_layout", "tensor_layouts": {key: layout}, "transposed": [..], "n_expected",
// "n_provided", "not_provided": [..]}.
std::string judgement_json(const Judgement& j, const RunInfo& info);

// Writes the problem of `g` as a folder `dir` (see the file comment), atomically: built beside
// it and renamed into place. An existing `dir` is replaced only with force, and only when it is
// an exported problem (holds problem.json).
void export_problem(const golden::GoldenCase& g, const std::string& golden_path,
                    const std::string& dir, bool force);

}  // namespace m3::harness
