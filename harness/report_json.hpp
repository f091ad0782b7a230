// The machine-readable compare report (`m3h compare --json FILE`, HARNESS.md §5): every metric
// of every cell, the budget and the verdict, plus config, seed, run shape, build and device.
//
// Layout (schema "m3h-compare/2"; non-finite numbers are the strings "inf", "-inf", "nan",
// see json.hpp):
//   { "schema", "pass", "exit_status" (0 pass / 1 some budget exceeded),
//     "oracle": name, "device": {"subject", "cpu", "gpu"},
//     "build": {"compiler", "build_type", "git_revision", "cuda"},
//     "command_line",
//     "source", "preset", "seed", "B", "T", "entering_states", "stage_filter",
//     "modes": [..], "compare_modes": [..] ("e2e", "isolated"), "precisions": [..],
//     "config": {every Config field, then the derived d_inner, nheads, num_rope_angles,
//                in_proj_dim, n_chunks},
//     "rule": {"k": {"f32", "bf16", "f16"}, "depth"},
//     "lineups": [{"precision", "subject", "baseline" (null: none)}],
//     "groups": [{"precision", "mode", "compare_mode", "n", "n_fail", "n_ill_conditioned",
//                 "first_fail" (key or null), "tightest_pct", "tightest_key", "first_nonfinite"
//                 (key or null)}],
//     "first_fail": {"key", "precision", "mode", "compare_mode", "status", "note", "nan_count",
//                   "inf_count"} or null — the first failing key in execution order over all
//                   cells (as the terminal summary),
//     "first_fail_by_mode": {"e2e": as first_fail, over that mode's cells, "isolated": …} (the
//                   comparison modes run),
//     "first_nonfinite_by_mode": {"e2e": as first_fail, the first key whose subject has NaN/Inf
//                   where the oracle is finite, or null, …},
//     "n_checks", "n_fail", "n_ill_conditioned" (checks with status "ILL-CONDITIONED": not
//                   judged, not failed; cell_judge.hpp),
//     "cells": [ one per key × precision × mode, execution order within each group:
//       {"key", "precision", "mode", "compare_mode", "layer", "stage", "tensor", "is_param",
//        "circular",
//        "shape": [..], "status", "pass", "note",
//        "metrics": {"numel", "max_abs", "worst_index", "worst_coords", "worst_oracle",
//                    "worst_subject", "oracle_scale", "oracle_l2", "diff_l2", "rel_l2",
//                    "rel_l2_absolute", "p95_rel", "max_rel", "rel_count", "cosine",
//                    "max_ulps", "mean_ulps", "nan_count", "inf_count", "oracle_nonfinite"},
//        "baseline_metrics": {"rel_l2", "max_abs" (the draws' max + range), "oracle_scale"}
//                   or null (no draw entered the limit: the floor alone decided),
//        "draws", "conditioning_draws" (the draws of each term that entered the limit),
//        "ill_conditioned_values", "condition" (values found ill-conditioned and their largest
//                   κ, cell_judge.hpp; 0 when none),
//        "budget": {"k", "depth", "floor_rel_l2", "floor_max_abs", "baseline_rel_l2",
//                   "baseline_max_abs", "rel_l2", "max_abs",
//                   "row": {"stage", "tensor", "reason", "section" (the table section:
//                   "e2e" or "isolated")}} or null when not measured,
//        "pct_rel_l2", "pct_max_abs", "pct"} ] }
#pragma once

#include <string>

#include "run.hpp"

namespace m3::harness {

struct RunInfo {
  std::string command_line;  // as typed (for reproduction)
  std::string cpu;           // CPU model, from /proc/cpuinfo ("unknown" elsewhere)
  std::string gpu;           // gpu::describe(), or "" when the tool has no GPU library
  bool cuda = false;         // built with CUDA
};

// Build facts baked in at compile time.
std::string build_compiler();      // e.g. "g++ 13.2.0"
std::string build_type();          // CMAKE_BUILD_TYPE, e.g. "Release"
std::string build_git_revision();  // m3::golden::git_revision(): configure-time short hash
std::string cpu_model();           // /proc/cpuinfo "model name", or "unknown"

std::string comparison_json(const Comparison& c, const RunInfo& info);

}  // namespace m3::harness
