// `m3h dump` (HARNESS.md §5): for the keys matching a pattern, writes oracle, baseline (when
// there is one), subject and difference arrays to an HDF5 file via h5::Writer (atomic: temp file
// + rename; an existing file is replaced only with force). Layout (dump schema version 1):
//
//   /meta                                  attributes, named as in a golden file's /meta
//                                          (golden/SCHEMA.md): generator, generator_version,
//                                          git_revision, every Config field and the derived
//                                          d_inner, nheads, num_rope_angles, in_proj_dim, B, T,
//                                          seed (decimal string), scan_modes ("seq,chunked"),
//                                          precision = "f64" (the stored values); plus
//                                          kind = "dump", dump_schema_version = 1, source,
//                                          stage_pattern, oracle, precisions ("f32,bf16"),
//                                          entering_states ("random" | "zero")
//   /dump/<mode>/<precision>/<key>/        one group per compared key, e.g.
//                                          /dump/seq/bf16/L0/F3/dt/, /dump/chunked/f32/grad/L1/dt_bias/
//       oracle     f64  the oracle's tensor (registry shape)
//       subject    f64  the subject's values (exact: every f32/bf16/f16 value is a double)
//       baseline   f64  only when the precision has a baseline
//       diff       f64  subject − oracle; for angles (registry `circular`) the signed circular
//                       distance remainder(subject − oracle, 2π) ∈ [−π, π]
//     attributes: axes ("BT,NH,HD": the registry's symbolic shape), circular (0/1), status
//                 ("ok", "FAIL", …), rel_l2, max_abs, p95_rel, cosine, pct (of budget),
//                 worst_coords
// With DumpOptions::profiles_only a key group holds by_position/ and the attributes only, and
// /meta has profiles_only = 1 (else 0); only [B·T, …] tensors are written.
// NaN/Inf are stored as they are (a dump is for looking at failures). A subject that lacks a
// key or has another shape gets no subject/diff datasets; its status attribute says why.
//
// Two ways to the same file:
//   write_dump         the oracle of `oracle` (reference<double> or a golden file's, on the host)
//                      and run_comparison's lineups: the verdicts are m3h compare's; baseline =
//                      the lineup's first baseline draw (the CPU subject: the perturbed oracle's
//                      first draw; the GPU subject: the emulation at the same precision);
//                      /meta oracle = that oracle's name.
//   write_device_dump  the GPU subject judged on the device against the GPU oracle
//                      (device_compare.hpp): the verdicts, metrics and profiles are m3h compare
//                      --device gpu --oracle gpu's, computed on the device; only the keys the
//                      GPU oracle provides are written (the rows one scan algorithm has inside,
//                      h_saved, chunk_states, …, are not), and only their arrays come to the
//                      host (HostCopy); baseline = the perturbed GPU oracle's exact draw (the
//                      problem rounded to the production's storage, every stored value rounded
//                      to its format: HARNESS.md §11), run for the dump whether or not a verdict
//                      needs it; /meta oracle = "gpu-oracle<double>". With profiles_only nothing
//                      but the profiles (computed on the device) comes to the host.
#pragma once

#include <string>
#include <vector>

#include "compare.hpp"
#include "device_compare.hpp"
#include "problem.hpp"
#include "run.hpp"

namespace m3::harness {

constexpr int kDumpSchemaVersion = 1;

struct DumpResult {
  std::vector<CompareResult> cells;  // as run_comparison's, precision-major
  int n_keys = 0;                    // key groups written (over all cells)
  int n_datasets = 0;
  std::string device_cost;           // write_device_dump: device_cost_line and device_time_line
                                     // of its run (two lines); else ""
};

struct DumpOptions {
  // Only the error-against-position profiles (by_position/max_abs, rel_l2 and the key's
  // attributes) of the [B·T, …] tensors: a file of O(T) per key instead of the arrays, for
  // long sequences (the full arrays of the long_t preset are tens of MB).
  bool profiles_only = false;
};

// The verdicts are run_comparison's on `lineups` (end to end; spec.compare_modes is ignored).
// Requires a non-empty spec.filter matching at least one key (with profiles_only: one
// [B·T, …] tensor); m3::Error otherwise.
DumpResult write_dump(const std::string& path, bool force, const RunSpec& spec, const Problem& pb,
                      const Implementation& oracle, const std::vector<Lineup>& lineups,
                      const DumpOptions& opt = {});

// The verdicts are run_device_comparison's on `precisions` (compare --oracle gpu's). Requires
// a non-empty spec.filter matching at least one key the GPU oracle provides (with
// profiles_only: one [B·T, …] tensor); m3::Error otherwise, and for what
// check_device_comparison refuses ("dump --oracle gpu"). `progress`: one line per cell.
DumpResult write_device_dump(const std::string& path, bool force, const RunSpec& spec,
                             const Problem& pb, const std::vector<Precision>& precisions,
                             const DumpOptions& opt = {}, const CellProgress& progress = {});

// "BT,NH,HD".
std::string axes_name(const std::vector<Sym>& syms);

}  // namespace m3::harness
