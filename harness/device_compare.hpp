// The comparison on the device (docs/HARNESS.md §11): the GPU subject judged against the GPU
// oracle in f64 (gpu/oracle_gpu.hpp), with the GPU perturbed oracle as the baseline, every
// figure computed where the tensors live (gpu/compare_gpu.hpp), so that host memory does not
// grow with B·T or the layer count. It is what `m3h compare --device gpu --oracle gpu` runs, at
// shapes the Eigen oracle cannot reach (B 8, T 4096, the official widths).
//
// One cell (precision p, scan mode, end to end):
//   1. the subject (GpuBackbone at p) runs forward and backward once, every registry tensor
//      stored in its own buffer (GpuBackbone::repeat_digests), and stays on the device;
//   2. the oracle runs (OracleKeep::Backward: only what its backward reads stays per layer);
//      after each of its stages, each tensor it provides is measured against the subject's
//      buffer of that key (every metric of harness/metrics.hpp, the position profile when
//      asked), and judged on its floor by the cell's CellJudge (cell_judge.hpp, the measured
//      form); a row over its floor's limit keeps a device copy of the oracle's values;
//   3. while some row is over its floor (CellJudge::open), the perturbed oracle's draws run:
//      the problem perturbed as harness::perturbed_problem does, every stage's output perturbed
//      on the device (OraclePerturbation), each kept row measured against its kept oracle values
//      (error_norms, and |draw − oracle| per value in f32 for the ill-conditioning rule); for a
//      token model where a row is still over its limit, then the coherent draws too
//      (OraclePerturbation::coherent, budget.hpp kCoherentDraws), all of them;
//   4. CellJudge::finish decides, with the per-value analysis (ConditionSums) on the device.
// The limit is the CPU cells' (budget.hpp, BaselineKind::Perturbed): k·perturbed + floor.
//
// One isolated (teacher-forced) cell, HARNESS.md §2 on the device:
//   1. the teacher: the oracle's unperturbed pass with every tensor kept (OracleKeep::All), once
//      per comparison (it depends on neither the precision nor the scan mode);
//   2. the subject runs stage by stage fed the teacher's values (GpuBackbone::run_isolated with
//      a DeviceTeacher: f64 device buffers restored with the host path's rounding; F6 rebuilds
//      the internals B6 reads, which the GPU oracle does not form); after each stage its
//      provided outputs are measured against the teacher's buffers, and a row over its floor
//      keeps the subject's |Δ| (the teacher's values replace the outputs right after);
//   3. the draws: the oracle teacher-forced (GpuOracle::set_teacher) on perturbed_problem with
//      random roundings of the loads and the stages' outputs, stream role 2 as the CPU's
//      run_perturbed_isolated, measured against the teacher (the unperturbed teacher-forced
//      pass is the teacher bit for bit); then a token model's coherent ones;
//   4. the judge decides with the isolated rule (CompareMode::Isolated: the isolated floors, the
//      tight row's positional draws alone).
//
// What the GPU oracle provides decides what is judged: every registry row both scan modes have
// (outputs, states, the gradients they share) and every parameter gradient. The rows one scan
// algorithm has inside (h_saved, chunk_states, dQ_mid, …) are not compared here; the report's
// header counts them.
//
// Device memory, in two phases. The end-to-end cells run first: the oracle (oracle_memory,
// OracleKeep::Backward) beside one subject at a time (BackboneMemory) and the kept rows' oracle
// copies (8 bytes a value). Then the isolated cells: the teacher (OracleKeep::All) beside one
// subject, which keeps the subject's |Δ| of a row over its floor (4 bytes a value) and is freed
// before the oracle of that cell's draws is built (only where a draw is needed). Draw deviations
// take 4 bytes a value a draw. Before anything is allocated, each phase's bytes are held against
// the free memory (one line naming each); a kept copy that does not fit is the same kind of
// error.
//
// Host copies (HostCopy, for m3h dump --oracle gpu): the same run hands the judged rows' values
// to the host as they come — the oracle's as each of its stages ends, the subject's buffer of
// that key beside it, and the values of the perturbed oracle's exact draw (step 3's first draw,
// OraclePerturbation::exact: the problem rounded by harness::rounded_problem, every stored value
// rounded to its format), which then runs in every cell, also where no verdict needs it (its
// figures enter a verdict only where one does, so the verdicts stay compare's). Host memory holds the rows of
// spec.filter only; nothing more is kept on the device.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backbone_gpu.hpp"  // gpu::Fault (plain C++)
#include "run.hpp"

namespace m3::harness {

// Why the device comparison cannot run here ("" when it can). Never throws.
std::string device_compare_unavailable();

// What a device comparison cost.
struct DeviceCompareCost {
  double seconds = 0;                  // wall time of the whole comparison
  std::size_t oracle_bytes = 0;        // the GPU oracle's allocation
  std::size_t subject_bytes = 0;       // the largest subject's, in the verification layout
  std::size_t kept_bytes = 0;          // the most kept-row bytes held at once
  std::size_t kept_host_bytes = 0;     // the most of them in page-locked host memory at once
  std::size_t device_peak = 0;         // peak device bytes in use (cudaMemGetInfo, sampled)
  int oracle_passes = 0;               // unperturbed and perturbed oracle passes run
  int rows_not_provided = 0;           // per cell: registry rows the GPU oracle does not provide
  // Where the wall time went (each measured between device synchronisations, so the sums are
  // the device's work plus the host's waiting on it):
  double setup_seconds = 0;      // making and freeing the subjects, the oracle and the teacher
  double subject_seconds = 0;    // the subjects' runs (end to end, or stage by stage isolated)
  double inputs_seconds = 0;     // the draws' problems on the host (rounded or perturbed)
  double measure_seconds = 0;    // measuring rows: metrics, profiles, kept copies, draws' |Δ|
  double analysis_seconds = 0;   // the kept rows' per-value analysis at a cell's end
  // The oracle's passes by stage ("F6", "B6", "norm_f'" for a backbone stage's backward, "tail"
  // for what a pass runs after its last observed stage), summed over layers and passes.
  std::map<std::string, double> oracle_stage_seconds;
  double oracle_seconds() const;
};

// "device compare: 41.2 s, 6 oracle passes; device: oracle 29.9 GB, subject 12.1 GB, kept
// 1.1 GB, peak 44.0 GB; host: peak 1.2 GB" — the report's cost line, before the time lines.
// Kept copies that went to page-locked host memory are named after the kept figure: "kept
// 16.2 GB (4.1 GB of it in host memory)".
std::string device_cost_line(const DeviceCompareCost& c);
// Where the seconds went, two lines (each within 100 columns):
//   "time (s): setup 2.4, subjects 1.1, draws' inputs 5.0, oracle 15.0, measuring 1.6, other 0.3"
//   "  oracle by stage (s): B6 6.7, input_proj 2.7, B4b 1.3, F6 0.9, F5 0.4, rest 3.0"
// the oracle's five slowest stages named (the teacher's pass is one "stage").
std::string device_time_line(const DeviceCompareCost& c);

// What a failed comparison of trained weights (m3h compare --checkpoint) says after its report
// where the perturbed draws are the only baseline: they can fail correct code there (docs/
// HARNESS.md §11, "Where the rule falls short"). With the GPU oracle (TrainedNote::GpuOracle)
// the Eigen oracle on a cut of the batch decides; with the emulation as the subject
// (TrainedNote::Emulation, --device cpu) the failure is the rule's unless the emulation itself
// is wrong. Two lines, each within 100 columns; "" when the comparison passed, the weights are
// not a checkpoint's, or the cell had a same-precision baseline (TrainedNote::None).
enum class TrainedNote { None, GpuOracle, Emulation };
std::string trained_weights_note(bool passed, bool from_checkpoint, TrainedNote kind);

// Progress: one line per finished cell ("bf16 chunked e2e: 212 checks, 0 failed, 4.1 s").
using CellProgress = std::function<void(const std::string&)>;

// A judged row's values on the host, in f64 and the registry shape (the file comment's host
// copies): the oracle's, the subject's (exact: every stored f32/bf16/f16 value is a double; only
// where the subject has the key at the oracle's size) and the exact draw's, with the cell's
// precision and scan mode.
enum class CopyOf { Oracle, Subject, Baseline };
using HostCopy = std::function<void(Precision p, ScanMode mode, CopyOf what,
                                    const std::string& key, Tensor&& values)>;

// The keys a device comparison can judge, with their shapes: what the GPU oracle provides for
// (cfg, B, T) — its stage rows (gpu::oracle_stage_keys: the rows both scan modes share) and
// every parameter gradient. Works in every build (no device needed).
std::map<std::string, std::vector<Idx>> device_compared_shapes(const Config& cfg, Idx B, Idx T);

// What run_device_comparison refuses before any work, each in one m3::Error line headed by
// `command` ("compare --oracle gpu"): an invalid run shape, no precision, scan mode or
// comparison mode, f64 as a subject precision, no usable device, a shape the GPU path refuses,
// and a phase that does not fit the free device memory: the oracle with a scan mode's subject
// (end to end), the teacher with that subject or with the oracle (isolated).
// A command that says something before its run (m3h dump: its file's size) checks first.
void check_device_comparison(const RunSpec& spec, const std::vector<Precision>& precisions,
                             const std::string& command);

// Runs every (precision, scan mode, comparison mode) cell of spec on pb with the GPU oracle,
// the end-to-end cells first, and returns them in run_comparison's order. Throws
// m3::Error (one line) for what check_device_comparison refuses. `fault` goes into layer 0 of
// the subject (negative controls). `copy` (may be empty): the host copies of every judged row.
// The Comparison's cells and reports are those of run_comparison.
Comparison run_device_comparison(const RunSpec& spec, const Problem& pb,
                                 const std::vector<Precision>& precisions, gpu::Fault fault,
                                 DeviceCompareCost* cost = nullptr,
                                 const CellProgress& progress = {}, const HostCopy& copy = {});

}  // namespace m3::harness
