// The JSON compare report (see report_json.hpp for the layout).
#include "report_json.hpp"

#include <fstream>

#include "golden.hpp"
#include "json.hpp"
#include "report.hpp"

#ifndef M3_BUILD_TYPE
#define M3_BUILD_TYPE "unknown"
#endif

namespace m3::harness {

std::string build_compiler() {
#if defined(__clang__)
  return std::string("clang++ ") + __clang_version__;
#elif defined(__GNUC__)
  return std::string("g++ ") + __VERSION__;
#else
  return "unknown";
#endif
}

std::string build_type() { return M3_BUILD_TYPE; }

std::string build_git_revision() { return golden::git_revision(); }

std::string cpu_model() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) break;
    const auto first = line.find_first_not_of(" \t", colon + 1);
    return first == std::string::npos ? "unknown" : line.substr(first);
  }
  return "unknown";
}

namespace {

void write_metrics(Json& j, const Metrics& m, const std::string& coords) {
  j.begin_object();
  j.key("numel").num(static_cast<std::int64_t>(m.numel));
  j.key("max_abs").num(m.max_abs);
  j.key("worst_index").num(static_cast<std::int64_t>(m.worst_index));
  j.key("worst_coords").str(coords);
  j.key("worst_oracle").num(m.worst_oracle);
  j.key("worst_subject").num(m.worst_subject);
  j.key("oracle_scale").num(m.oracle_scale);
  j.key("oracle_l2").num(m.oracle_l2);
  j.key("diff_l2").num(m.diff_l2);
  j.key("rel_l2").num(m.rel_l2);
  j.key("rel_l2_absolute").boolean(m.rel_l2_absolute);
  j.key("p95_rel").num(m.p95_rel);
  j.key("max_rel").num(m.max_rel);
  j.key("rel_count").num(static_cast<std::int64_t>(m.rel_count));
  j.key("cosine").num(m.cosine);
  j.key("max_ulps").num(m.max_ulps);
  j.key("mean_ulps").num(m.mean_ulps);
  j.key("nan_count").num(static_cast<std::int64_t>(m.nan_count));
  j.key("inf_count").num(static_cast<std::int64_t>(m.inf_count));
  j.key("oracle_nonfinite").num(static_cast<std::int64_t>(m.oracle_nonfinite));
  j.end_object();
}

void write_cell(Json& j, const CompareResult& cell, const TensorResult& r) {
  j.begin_object();
  j.key("key").str(r.key);
  j.key("precision").str(precision_name(cell.precision));
  j.key("mode").str(scan_mode_name(cell.mode));
  j.key("compare_mode").str(compare_mode_name(cell.compare_mode));
  j.key("layer").num(r.layer);
  j.key("stage").str(r.stage);
  j.key("tensor").str(r.tensor);
  j.key("is_param").boolean(r.is_param);
  j.key("circular").boolean(r.circular);
  j.key("shape").begin_array();
  for (Idx d : r.shape) j.num(static_cast<std::int64_t>(d));
  j.end_array();
  j.key("status").str(status_name(r.status));
  j.key("pass").boolean(r.pass());
  j.key("note").str(r.note);
  const bool m = r.measured();
  j.key("metrics");
  if (m) write_metrics(j, r.subject, r.worst_coords);
  else j.null();
  // The draws are measured by the pass rule's figures only (error_norms).
  j.key("baseline_metrics");
  if (m && r.has_baseline) {
    j.begin_object();
    j.key("rel_l2").num(r.baseline.rel_l2);
    j.key("max_abs").num(r.baseline.max_abs);
    j.key("oracle_scale").num(r.baseline.oracle_scale);
    j.end_object();
  } else {
    j.null();
  }
  j.key("draws").num(r.draws);
  j.key("conditioning_draws").num(r.conditioning_draws);
  j.key("ill_conditioned_values").num(static_cast<std::int64_t>(r.ill_conditioned));
  j.key("condition").num(r.condition);
  j.key("budget");
  if (m && r.budget.row) {
    const Budget& b = r.budget;
    j.begin_object();
    j.key("k").num(b.k);
    j.key("depth").num(b.depth);
    j.key("floor_rel_l2").num(b.floor_rel_l2);
    j.key("floor_max_abs").num(b.floor_max_abs);
    j.key("baseline_rel_l2").num(b.baseline_rel_l2);
    j.key("baseline_max_abs").num(b.baseline_max_abs);
    j.key("baseline_kind").str(b.kind == BaselineKind::Perturbed ? "perturbed" : "same-precision");
    j.key("tight").boolean(b.tight);
    j.key("conditioning");
    if (b.k_conditioning > 0) {
      j.begin_object();
      j.key("k").num(b.k_conditioning);
      j.key("rel_l2").num(b.conditioning_rel_l2);
      j.key("max_abs").num(b.conditioning_max_abs);
      j.end_object();
    } else {
      j.null();
    }
    j.key("rel_l2").num(b.rel_l2);
    j.key("max_abs").num(b.max_abs);
    j.key("row").begin_object();
    j.key("stage").str(b.row->stage);
    j.key("tensor").str(b.row->tensor);
    j.key("reason").str(b.row->reason);
    j.key("section").str(compare_mode_name(b.row->cmp));
    j.end_object();
    j.end_object();
  } else {
    j.null();
  }
  j.key("pct_rel_l2").num(r.verdict.pct_rel_l2);
  j.key("pct_max_abs").num(r.verdict.pct_max_abs);
  j.key("pct").num(r.verdict.pct());
  j.end_object();
}

void write_config(Json& j, const Config& c, Idx T) {
  j.begin_object();
  j.key("d_model").num(static_cast<std::int64_t>(c.d_model));
  j.key("d_state").num(static_cast<std::int64_t>(c.d_state));
  j.key("expand").num(static_cast<std::int64_t>(c.expand));
  j.key("headdim").num(static_cast<std::int64_t>(c.headdim));
  j.key("ngroups").num(static_cast<std::int64_t>(c.ngroups));
  j.key("n_layers").num(static_cast<std::int64_t>(c.n_layers));
  j.key("rope_fraction").num(c.rope_fraction);
  j.key("a_floor").num(c.a_floor);
  j.key("is_outproj_norm").boolean(c.is_outproj_norm);
  j.key("input_dim").num(static_cast<std::int64_t>(c.input_dim));
  j.key("input_proj_identity").boolean(c.input_proj_identity);
  j.key("chunk_size").num(static_cast<std::int64_t>(c.chunk_size));
  j.key("d_inner").num(static_cast<std::int64_t>(c.d_inner()));
  j.key("nheads").num(static_cast<std::int64_t>(c.nheads()));
  j.key("num_rope_angles").num(static_cast<std::int64_t>(c.num_rope_angles()));
  j.key("in_proj_dim").num(static_cast<std::int64_t>(c.in_proj_dim()));
  j.key("n_chunks").num(static_cast<std::int64_t>(c.n_chunks(T)));
  j.end_object();
}

}  // namespace

std::string comparison_json(const Comparison& c, const RunInfo& info) {
  const RunSpec& s = c.spec;
  Json j;
  j.begin_object();
  j.key("schema").str("m3h-compare/2");
  j.key("pass").boolean(c.pass());
  j.key("exit_status").num(c.pass() ? 0 : 1);
  j.key("oracle").str(c.oracle_name);
  j.key("device").begin_object();
  j.key("subject").str(s.device);
  j.key("cpu").str(info.cpu);
  j.key("gpu").str(info.gpu);
  j.end_object();
  j.key("build").begin_object();
  j.key("compiler").str(build_compiler());
  j.key("build_type").str(build_type());
  j.key("git_revision").str(build_git_revision());
  j.key("cuda").boolean(info.cuda);
  j.end_object();
  j.key("command_line").str(info.command_line);
  j.key("source").str(s.source);
  j.key("preset").str(s.preset);
  j.key("seed").num(static_cast<std::uint64_t>(s.seed));
  j.key("B").num(static_cast<std::int64_t>(s.B));
  j.key("T").num(static_cast<std::int64_t>(s.T));
  j.key("entering_states").str(s.random_states ? "random" : "zero");
  j.key("stage_filter").str(s.filter);
  j.key("modes").begin_array();
  for (ScanMode m : s.modes) j.str(scan_mode_name(m));
  j.end_array();
  j.key("compare_modes").begin_array();
  for (CompareMode m : s.compare_modes) j.str(compare_mode_name(m));
  j.end_array();
  j.key("precisions").begin_array();
  for (const Lineup& l : c.lineups) j.str(precision_name(l.precision));
  j.end_array();
  j.key("config");
  write_config(j, s.cfg, s.T);
  // The rule as applied (budget.hpp): per comparison mode, what the baseline is and its k.
  const RuleSummary rs = rule_summary(c);
  auto ks = [&](BaselineKind kind, CompareMode cmp) {
    j.begin_object();
    for (Precision p : {Precision::F32, Precision::BF16, Precision::F16})
      j.key(precision_name(p)).num(baseline_k(p, kind, cmp));
    j.end_object();
  };
  j.key("rule").begin_object();
  j.key("depth").num(depth_factor(s.cfg));
  j.key("e2e").begin_object();
  j.key("text").str(rs.e2e);
  j.key("baseline").str(!rs.e2e_baseline ? "none"
                        : rs.e2e_kind == BaselineKind::Perturbed ? "perturbed"
                                                                 : "same-precision");
  j.key("k");
  if (rs.e2e_baseline) ks(rs.e2e_kind, CompareMode::EndToEnd);
  else j.null();
  j.key("conditioning_k");
  if (rs.e2e_conditioning) ks(BaselineKind::Perturbed, CompareMode::EndToEnd);
  else j.null();
  j.end_object();
  j.key("isolated").begin_object();
  j.key("text").str(rs.iso);
  j.key("baseline").str(rs.iso_baseline ? "perturbed" : "none");
  j.key("k");
  if (rs.iso_baseline) ks(BaselineKind::Perturbed, CompareMode::Isolated);
  else j.null();
  j.key("tight_k").num(kTightK);
  j.key("tight_min_elements").num(static_cast<std::int64_t>(kTightMinElements));
  j.end_object();
  j.key("draws").num(kPerturbationDraws);
  j.key("coherent_draws").num(rs.coherent_draws);
  j.end_object();
  j.key("lineups").begin_array();
  for (const Lineup& l : c.lineups) {
    j.begin_object();
    j.key("precision").str(precision_name(l.precision));
    j.key("subject").str(l.subject.name);
    j.key("baseline");
    if (l.baseline) j.str(l.baseline->name);
    else j.null();
    j.end_object();
  }
  j.end_array();

  j.key("groups").begin_array();
  for (const CompareResult& cell : c.cells) {
    const TensorResult* tight = cell.tightest_passing();
    j.begin_object();
    j.key("precision").str(precision_name(cell.precision));
    j.key("mode").str(scan_mode_name(cell.mode));
    j.key("compare_mode").str(compare_mode_name(cell.compare_mode));
    j.key("n").num(static_cast<std::int64_t>(cell.rows.size()));
    j.key("n_fail").num(cell.n_fail());
    j.key("n_ill_conditioned").num(cell.n_ill());
    j.key("first_fail");
    if (cell.pass()) j.null();
    else j.str(cell.rows[static_cast<size_t>(cell.first_fail)].key);
    j.key("tightest_pct");
    if (tight) j.num(tight->verdict.pct());
    else j.null();
    j.key("tightest_key");
    if (tight) j.str(tight->key);
    else j.null();
    j.key("first_nonfinite");
    if (cell.first_nonfinite < 0) j.null();
    else j.str(cell.rows[static_cast<size_t>(cell.first_nonfinite)].key);
    j.end_object();
  }
  j.end_array();

  // The first failing key in execution order over all cells (as the terminal summary), and per
  // comparison mode; the first key with a non-finite subject value per comparison mode.
  const std::vector<std::string> keys = merged_keys(c);
  auto first_of = [&](const CompareMode* only, bool nonfinite, const CompareResult** where) {
    for (const std::string& k : keys)
      for (const CompareResult& cell : c.cells) {
        if (only && cell.compare_mode != *only) continue;
        for (const auto& r : cell.rows) {
          const bool hit = nonfinite ? r.subject.nan_count + r.subject.inf_count > 0 : !r.pass();
          if (r.key == k && hit) {
            *where = &cell;
            return &r;
          }
        }
      }
    return static_cast<const TensorResult*>(nullptr);
  };
  auto write_fail = [&](const TensorResult* first, const CompareResult* cell) {
    if (!first) {
      j.null();
      return;
    }
    j.begin_object();
    j.key("key").str(first->key);
    j.key("precision").str(precision_name(cell->precision));
    j.key("mode").str(scan_mode_name(cell->mode));
    j.key("compare_mode").str(compare_mode_name(cell->compare_mode));
    j.key("status").str(status_name(first->status));
    j.key("note").str(first->note);
    j.key("nan_count").num(static_cast<std::int64_t>(first->subject.nan_count));
    j.key("inf_count").num(static_cast<std::int64_t>(first->subject.inf_count));
    j.end_object();
  };
  const CompareResult* cell = nullptr;
  j.key("first_fail");
  const TensorResult* first = first_of(nullptr, false, &cell);
  write_fail(first, cell);
  j.key("first_fail_by_mode").begin_object();
  for (CompareMode m : s.compare_modes) {
    j.key(compare_mode_name(m));
    first = first_of(&m, false, &cell);
    write_fail(first, cell);
  }
  j.end_object();
  j.key("first_nonfinite_by_mode").begin_object();
  for (CompareMode m : s.compare_modes) {
    j.key(compare_mode_name(m));
    first = first_of(&m, true, &cell);
    write_fail(first, cell);
  }
  j.end_object();
  j.key("n_checks").num(c.n_checks());
  j.key("n_fail").num(c.n_fail());
  int n_ill = 0;
  for (const CompareResult& cell : c.cells) n_ill += cell.n_ill();
  j.key("n_ill_conditioned").num(n_ill);

  j.key("cells").begin_array();
  for (const CompareResult& cell : c.cells)
    for (const auto& r : cell.rows) write_cell(j, cell, r);
  j.end_array();
  j.end_object();
  return j.text();
}

}  // namespace m3::harness
