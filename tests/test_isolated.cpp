// The isolated (teacher-forced) comparison without a device (HARNESS.md §2, §4, §5):
//   - the CPU reference run teacher-forced passes the isolated floors in every precision and
//     scan mode, next to its end-to-end run;
//   - every negative-control fault of backbone_gpu.hpp, injected in the CPU teacher-forced run,
//     FAILS the isolated comparison with the faulted stage of layer 0 as the first failing key
//     (the floors are tight enough to catch a broken stage), in f32, bf16 and f16, both modes;
//   - the plumbing: the oracle runs once per scan mode and its Capture is what the subject's
//     isolated runner receives; isolated cells have no baseline, no depth factor and take the
//     isolated section of the tolerance table; a subject without an isolated runner is an error;
//   - the report: isolated and end-to-end side by side, a summary per comparison mode and a
//     diagnosis; the first non-finite value is named on its own line, by execution order, even
//     when an earlier key already fails; the JSON carries the comparison mode of every cell;
//   - the fault names, and the m3h options --mode, --fault (GPU only) and determinism --dtype.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backbone.hpp"
#include "test_io.hpp"
#include "backbone_gpu.hpp"
#include "compare.hpp"
#include "error.hpp"
#include "isolated.hpp"
#include "negative_control.hpp"
#include "planted_bugs.hpp"
#include "report.hpp"
#include "report_json.hpp"
#include "run.hpp"

namespace m3::harness {
namespace {

using gpu::Fault;

constexpr Precision kPrecisions[] = {Precision::F32, Precision::BF16, Precision::F16};
constexpr ScanMode kModes[] = {ScanMode::Sequential, ScanMode::Chunked};
using negative::kFaults;

// The negative-control shape (negative_control.hpp).
RunSpec small_spec(bool outproj_norm = false) {
  RunSpec s = negative::spec(outproj_norm);
  s.source = "test";
  return s;
}

std::string first_fail_key(const CompareResult& r) {
  return r.pass() ? "(none)" : r.rows[static_cast<size_t>(r.first_fail)].key;
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.rfind(prefix, 0) == 0;
}

// ---- the CPU reference, teacher-forced --------------------------------------------------------

TEST(IsolatedCpu, ReferencePassesIsolatedAndEndToEndInEveryPrecisionAndScanMode) {
  for (bool outnorm : {false, true}) {
    RunSpec spec = small_spec(outnorm);
    spec.compare_modes = {CompareMode::EndToEnd, CompareMode::Isolated};
    const Problem pb = build_problem(spec);
    const Comparison c = run_comparison(spec, pb, reference_oracle(),
                                        cpu_lineups({Precision::F32, Precision::BF16, Precision::F16}));
    ASSERT_EQ(c.cells.size(), 3u * 2u * 2u);
    for (const CompareResult& cell : c.cells) {
      EXPECT_TRUE(cell.pass()) << cell_name(cell) << (outnorm ? " outproj_norm" : "")
                               << ": first failing " << first_fail_key(cell);
      EXPECT_EQ(cell.first_nonfinite, -1) << cell_name(cell);
      EXPECT_GT(cell.rows.size(), 100u);
    }
  }
}

// The leaving states and the entering-state gradients are written by F5/F6 and B5a/B6 and
// captured under the pseudo-stages states/ and d_states/: the isolated capture must hold the
// stage's own (float) values there, not the oracle's that every later stage is fed again.
TEST(IsolatedCpu, StatesAreTheScanStagesOwnOutputsNotTheOracles) {
  const RunSpec spec = small_spec(true);
  const Problem pb = build_problem(spec);
  for (ScanMode mode : kModes) {
    const Capture oracle = run_reference<double>(pb, mode);
    const Capture iso = run_reference_isolated(pb, mode, oracle, Precision::F32, Fault::None);
    int checked = 0;
    for (const auto& key : iso.keys()) {
      // k_state and v_state are K and x at t = T − 1: copies of the stage's (oracle) inputs.
      const bool computed = key.find("/states/ssm_state") != std::string::npos ||
                            key.find("/states/angle_state") != std::string::npos ||
                            key.find("/d_states/") != std::string::npos;
      if (!computed) continue;
      const auto& a = iso.at(key).data;
      const auto& o = oracle.at(key).data;
      ASSERT_EQ(a.size(), o.size()) << key;
      bool differs = false;
      for (size_t i = 0; i < a.size(); ++i)
        differs = differs || a[i] != static_cast<double>(static_cast<float>(o[i]));
      EXPECT_TRUE(differs) << scan_mode_name(mode) << ": " << key
                           << " holds the oracle's values, not the stage's";
      ++checked;
    }
    EXPECT_GE(checked, 12) << scan_mode_name(mode);
  }
}

TEST(IsolatedCpu, EveryFaultFailsIsolatedFirstInItsOwnStage) {
  const RunSpec spec = small_spec();
  const Problem pb = build_problem(spec);
  for (ScanMode mode : kModes) {
    const Capture oracle = run_reference<double>(pb, mode);
    for (Precision p : kPrecisions)
      for (Fault f : kFaults) {
        const Capture s = run_reference_isolated(pb, mode, oracle, p, f);
        CompareOptions opt;
        opt.precision = p;
        opt.compare_mode = CompareMode::Isolated;
        const CompareResult r =
            compare_captures(oracle, s, nullptr, spec.cfg, spec.B, spec.T, mode, opt);
        const std::string want = std::string("L0/") + gpu::fault_stage(f) + "/";
        ASSERT_FALSE(r.pass()) << gpu::fault_name(f) << " " << precision_name(p) << " "
                               << scan_mode_name(mode) << " was not caught";
        EXPECT_TRUE(starts_with(first_fail_key(r), want))
            << gpu::fault_name(f) << " " << precision_name(p) << " " << scan_mode_name(mode)
            << ": first failing " << first_fail_key(r) << ", expected " << want << "…";
        // Teacher forcing confines the fault: only the faulted stage's tensors fail.
        for (const TensorResult& row : r.rows) {
          if (row.pass()) continue;
          EXPECT_TRUE(starts_with(row.key, want))
              << gpu::fault_name(f) << " " << precision_name(p) << ": " << row.key
              << " fails too (" << row.note << ")";
        }
      }
  }
}

TEST(IsolatedCpu, RoundMantissaIsRoundToNearestEven) {
  // 7 mantissa bits is bf16.
  for (float v : {1.0f, 1.00390625f, 1.01171875f, -3.14159265f, 6.5e-5f, 1e30f, 3.3895314e38f})
    EXPECT_EQ(round_mantissa(v, 7), round_bf16(v)) << v;
  // 1 + 2^-6 lies halfway between 1 and 1 + 2^-5 with 5 bits: ties to even → 1.
  EXPECT_EQ(round_mantissa(1.0f + 1.0f / 64, 5), 1.0f);
  EXPECT_EQ(round_mantissa(1.0f + 3.0f / 64, 5), 1.0f + 4.0f / 64);
  EXPECT_TRUE(std::isinf(round_mantissa(std::numeric_limits<float>::infinity(), 5)));
  EXPECT_TRUE(std::isnan(round_mantissa(std::nanf(""), 5)));
  EXPECT_THROW(round_mantissa(1.0f, 0), Error);
}

// ---- the plumbing -----------------------------------------------------------------------------

TEST(IsolatedPlumbing, OracleRunsOncePerScanModeAndIsHandedToTheIsolatedRunner) {
  RunSpec spec = small_spec();
  spec.compare_modes = {CompareMode::EndToEnd, CompareMode::Isolated};
  spec.every_draw = true;  // the baseline measured on every tensor, needed or not
  const Problem pb = build_problem(spec);
  auto oracle_runs = std::make_shared<int>(0);
  auto iso_runs = std::make_shared<int>(0);
  auto e2e_runs = std::make_shared<int>(0);
  auto seen = std::make_shared<std::vector<double>>();
  Implementation oracle{"counting oracle", [oracle_runs](const Problem& p, ScanMode m,
                                                         const TensorSink&) {
                          ++*oracle_runs;
                          return run_reference<double>(p, m);
                        }};
  // A fake subject: end to end the float reference; isolated it records a value of the oracle
  // Capture it was handed and answers with the CPU teacher-forced run on that very Capture.
  Implementation subject{
      "fake",
      [e2e_runs](const Problem& p, ScanMode m, const TensorSink&) {
        ++*e2e_runs;
        return run_reference<float>(p, m);
      },
      [iso_runs, seen](const Problem& p, ScanMode m, const Capture& o, const TensorSink&) {
        ++*iso_runs;
        seen->push_back(o.at("L1/F6/y").data[7]);
        return run_reference_isolated(p, m, o, Precision::F32);
      }};
  const Comparison c = run_comparison(
      spec, pb, oracle,
      {{Precision::F32, subject, reference_float()}, {Precision::BF16, subject, std::nullopt}});
  EXPECT_EQ(*oracle_runs, 2);  // seq, chunked
  EXPECT_EQ(*e2e_runs, 4);     // 2 precisions × 2 scan modes
  EXPECT_EQ(*iso_runs, 4);
  ASSERT_EQ(seen->size(), 4u);
  const double y_seq = run_reference<double>(pb, ScanMode::Sequential).at("L1/F6/y").data[7];
  EXPECT_EQ((*seen)[0], y_seq);  // the oracle's own value reached the runner

  // Precision-major, then scan mode, then comparison mode (the report's column order).
  ASSERT_EQ(c.cells.size(), 8u);
  const CompareMode order[] = {CompareMode::EndToEnd, CompareMode::Isolated};
  for (size_t i = 0; i < c.cells.size(); ++i) {
    EXPECT_EQ(c.cells[i].precision, i < 4 ? Precision::F32 : Precision::BF16) << i;
    EXPECT_EQ(c.cells[i].mode, (i / 2) % 2 == 0 ? ScanMode::Sequential : ScanMode::Chunked) << i;
    EXPECT_EQ(c.cells[i].compare_mode, order[i % 2]) << i;
  }
  const CompareResult* e2e = c.cell(Precision::F32, ScanMode::Chunked, CompareMode::EndToEnd);
  const CompareResult* iso = c.cell(Precision::F32, ScanMode::Chunked, CompareMode::Isolated);
  ASSERT_TRUE(e2e && iso);
  EXPECT_EQ(c.cell(Precision::F32, ScanMode::Chunked), e2e);
  // End to end with the baseline; isolated without, on the isolated floors, depth 1.
  for (const TensorResult& r : e2e->rows) {
    EXPECT_TRUE(r.has_baseline) << r.key;
    EXPECT_EQ(r.budget.row->cmp, CompareMode::EndToEnd) << r.key;
  }
  for (const TensorResult& r : iso->rows) {
    EXPECT_FALSE(r.has_baseline) << r.key;
    ASSERT_NE(r.budget.row, nullptr) << r.key;
    EXPECT_EQ(r.budget.row->cmp, CompareMode::Isolated) << r.key;
    EXPECT_EQ(r.budget.depth, 1.0) << r.key;
  }
  EXPECT_TRUE(c.pass());
}

TEST(IsolatedPlumbing, SubjectWithoutIsolatedRunnerIsAnErrorBeforeAnyRun) {
  RunSpec spec = small_spec();
  spec.modes = {ScanMode::Sequential};
  spec.compare_modes = {CompareMode::EndToEnd, CompareMode::Isolated};
  const Problem pb = build_problem(spec);
  auto runs = std::make_shared<int>(0);
  Implementation e2e_only{"e2e only", [runs](const Problem& p, ScanMode m, const TensorSink&) {
                            ++*runs;
                            return run_reference<float>(p, m);
                          }};
  try {
    run_comparison(spec, pb, reference_oracle(), {{Precision::F32, e2e_only, std::nullopt}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("isolated"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("e2e only"), std::string::npos) << e.what();
  }
  EXPECT_EQ(*runs, 0);
  // A baseline handed to an isolated comparison is refused too.
  const Capture o = run_reference<double>(pb, ScanMode::Sequential);
  CompareOptions opt;
  opt.compare_mode = CompareMode::Isolated;
  EXPECT_THROW(compare_captures(o, o, &o, spec.cfg, spec.B, spec.T, ScanMode::Sequential, opt),
               Error);
}

TEST(IsolatedPlumbing, IsolatedSectionOfTheTableIsSeparateAndTighter) {
  const ToleranceRow& e2e = find_tolerance("F6", "y", ScanMode::Sequential, CompareMode::EndToEnd);
  const ToleranceRow& iso = find_tolerance("F6", "y", ScanMode::Sequential, CompareMode::Isolated);
  EXPECT_EQ(e2e.cmp, CompareMode::EndToEnd);
  EXPECT_EQ(iso.cmp, CompareMode::Isolated);
  EXPECT_EQ(std::string(iso.stage), "F6");
  for (Precision p : kPrecisions) {
    EXPECT_LT(floors_of(iso, p).rel_l2, floors_of(e2e, p).rel_l2) << precision_name(p);
    EXPECT_LE(floors_of(iso, p).rel_max, floors_of(e2e, p).rel_max) << precision_name(p);
  }
  // Each section has its own default; a stage without a row falls back to its section's.
  const ToleranceRow& d = find_tolerance("no-such", "t", ScanMode::Chunked, CompareMode::Isolated);
  EXPECT_EQ(std::string(d.stage), "*");
  EXPECT_EQ(d.cmp, CompareMode::Isolated);
  // Every isolated row: positive floors, a reason unless it is the default.
  for (const ToleranceRow& r : tolerance_table()) {
    if (r.cmp != CompareMode::Isolated) continue;
    for (Precision p : kPrecisions) {
      EXPECT_GT(floors_of(r, p).rel_l2, 0.0) << r.stage << "/" << r.tensor;
      EXPECT_GT(floors_of(r, p).rel_max, 0.0) << r.stage << "/" << r.tensor;
    }
    if (std::string(r.stage) != "*") {
      EXPECT_GT(std::string(r.reason).size(), 10u) << r.stage;
    }
  }
}

// ---- the report -------------------------------------------------------------------------------

// A subject whose isolated run has the round-twice fault in F6 (so F6 fails isolated) while its
// end-to-end run is the plain float reference (so everything passes end to end).
Implementation iso_faulty_subject(Precision p, Fault f) {
  return {"fake<" + std::string(precision_name(p)) + ">",
          [p](const Problem& pb, ScanMode m, const TensorSink&) {
            return run_reference<float>(pb, m, p);
          },
          [p, f](const Problem& pb, ScanMode m, const Capture& o, const TensorSink&) {
            return run_reference_isolated(pb, m, o, p, f);
          }};
}

std::vector<std::string> lines_of(const std::string& s) {
  std::vector<std::string> out;
  std::istringstream in(s);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t i = s.find(what); i != std::string::npos; i = s.find(what, i + 1)) ++n;
  return n;
}

TEST(IsolatedReport, SideBySideColumnsSummaryPerModeAndDiagnosis) {
  RunSpec spec = small_spec();
  spec.compare_modes = {CompareMode::EndToEnd, CompareMode::Isolated};
  spec.filter = "L0/F5b/*,L0/F6/y,L0/F7/gated,grad/L0/d_param";
  const Problem pb = build_problem(spec);
  const Comparison c = run_comparison(
      spec, pb, reference_oracle(),
      {{Precision::F32, iso_faulty_subject(Precision::F32, Fault::RoundTwice), std::nullopt},
       {Precision::BF16, iso_faulty_subject(Precision::BF16, Fault::None), std::nullopt}});
  std::ostringstream os;
  print_compare(os, c);
  const std::string text = os.str();
  std::cout << text;  // the layout, for the log
  const std::vector<std::string> lines = lines_of(text);

  // The table: a group line (each (precision, scan mode) once), a sub-column line (e2e, iso
  // per group), a metric line, a rule; ':' between the sub-columns of a group.
  size_t t = 0;
  while (t < lines.size() && lines[t].find("f32 seq") == std::string::npos) ++t;
  ASSERT_LT(t + 3, lines.size()) << text;
  const std::string& groups = lines[t];
  EXPECT_EQ(count(groups, "f32 seq"), 1u) << groups;
  EXPECT_EQ(count(groups, "f32 chunked"), 1u) << groups;
  EXPECT_EQ(count(groups, "bf16 seq"), 1u) << groups;
  EXPECT_EQ(count(groups, "bf16 chunked"), 1u) << groups;
  EXPECT_EQ(count(lines[t + 1], "e2e"), 4u) << lines[t + 1];
  EXPECT_EQ(count(lines[t + 1], "iso"), 4u) << lines[t + 1];
  EXPECT_EQ(count(lines[t + 2], "rel_l2"), 8u) << lines[t + 2];
  EXPECT_EQ(count(lines[t + 3], "-:-"), 4u) << lines[t + 3];
  // Every row has its 8 cells; the y row shows FAIL only in the f32 iso sub-columns.
  bool saw_y = false;
  for (const std::string& l : lines)
    if (starts_with(l, "L0/F6/y ")) {
      saw_y = true;
      EXPECT_EQ(count(l, " : "), 4u) << l;
      EXPECT_EQ(count(l, " | "), 4u) << l;
      EXPECT_EQ(count(l, "FAIL"), 2u) << l;
      // group 1 = "f32 seq": e2e ok, iso FAIL
      const size_t g1 = l.find(" | "), sub = l.find(" : ", g1), g2 = l.find(" | ", sub);
      EXPECT_EQ(l.substr(g1, sub - g1).find("FAIL"), std::string::npos) << l;
      EXPECT_NE(l.substr(sub, g2 - sub).find("FAIL"), std::string::npos) << l;
    }
  EXPECT_TRUE(saw_y) << text;

  EXPECT_NE(text.find("compare=e2e,isolated"), std::string::npos);
  EXPECT_NE(text.find("[f32 seq iso] L0/F6/y"), std::string::npos) << text;
  EXPECT_NE(text.find("cell f32 seq iso"), std::string::npos) << text;
  EXPECT_NE(text.find("summary e2e: PASS"), std::string::npos) << text;
  EXPECT_NE(text.find("summary isolated: FAIL first failing stage: L0/F6/y [f32 seq iso, f32 "
                      "chunked iso]"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("diagnosis: L0/F6/y fails isolated"), std::string::npos) << text;
  ASSERT_FALSE(lines.empty());
  EXPECT_TRUE(starts_with(lines.back(), "summary: FAIL (e2e PASS, isolated FAIL)")) << lines.back();
}

TEST(IsolatedReport, EndToEndOnlyFailureIsDiagnosedAsAmplifiedUpstreamError) {
  RunSpec spec = small_spec();
  spec.modes = {ScanMode::Sequential};
  spec.compare_modes = {CompareMode::EndToEnd, CompareMode::Isolated};
  const Problem pb = build_problem(spec);
  // End to end the subject's layer-1 gated output is 1 % off (as if amplified from upstream);
  // isolated every stage is right.
  Implementation subject{
      "fake",
      [](const Problem& p, ScanMode m, const TensorSink&) {
        Capture c = run_reference<float>(p, m);
        m3::test::edit_tensor(c, "L1/F7/gated", [](Tensor& t) {
          for (double& v : t.data) v *= 1.01;
        });
        return c;
      },
      [](const Problem& p, ScanMode m, const Capture& o, const TensorSink&) {
        return run_reference_isolated(p, m, o, Precision::F32);
      }};
  const Comparison c = run_comparison(spec, pb, reference_oracle(),
                                      {{Precision::F32, subject, std::nullopt}});
  std::ostringstream os;
  print_compare_summary(os, c);
  EXPECT_NE(os.str().find("summary e2e: FAIL first failing stage: L1/F7/gated [f32 seq]"),
            std::string::npos)
      << os.str();
  EXPECT_NE(os.str().find("summary isolated: PASS"), std::string::npos) << os.str();
  EXPECT_NE(os.str().find("diagnosis: every stage passes isolated; L1/F7/gated fails end to end "
                          "only"),
            std::string::npos)
      << os.str();
}

TEST(IsolatedReport, SingleModeKeepsTheOneTableLayout) {
  RunSpec spec = small_spec();
  spec.modes = {ScanMode::Sequential};
  spec.filter = "L0/F6/y";
  const Problem pb = build_problem(spec);
  for (CompareMode cm : {CompareMode::EndToEnd, CompareMode::Isolated}) {
    spec.compare_modes = {cm};
    const Comparison c = run_comparison(spec, pb, reference_oracle(), cpu_lineups({Precision::F16}));
    std::ostringstream os;
    print_compare(os, c);
    const std::string text = os.str();
    EXPECT_EQ(text.find("   e2e   "), std::string::npos) << text;  // no sub-column line
    EXPECT_EQ(text.find("-:-"), std::string::npos) << text;
    EXPECT_NE(text.find("-+-"), std::string::npos) << text;
    EXPECT_NE(text.find(cm == CompareMode::Isolated ? "f16 seq iso" : "f16 seq"),
              std::string::npos);
    EXPECT_NE(text.find("summary: PASS all 1 tensor checks"), std::string::npos) << text;
  }
}

// Subject captures with an Inf injected at L1/F7/gated (f16 seq) — and, later in execution
// order, a NaN at L1/B7/d_y; plus an earlier, finite failure (L0/F3/dt 10 % off) that must not
// hide them.
Capture with_injected_nonfinite(const Problem& pb, ScanMode m, const TensorSink&) {
  Capture c = run_reference<float>(pb, m, Precision::F16);
  auto edit = [&](const std::string& key, auto&& f) {
    Tensor t = c.at(key);
    f(t.data);
    c.put(key, t.shape, t.data.data());
  };
  edit("L0/F3/dt", [](std::vector<double>& v) {
    for (double& x : v) x *= 1.1;
  });
  if (m == ScanMode::Sequential)
    edit("L1/F7/gated", [](std::vector<double>& v) { v[5] = std::numeric_limits<double>::infinity(); });
  edit("L1/B7/d_y", [](std::vector<double>& v) { v[3] = std::nan(""); });
  return c;
}

TEST(IsolatedReport, FirstNonFiniteStageIsNamedOnItsOwnLineNeverHidden) {
  RunSpec spec = small_spec();
  const Problem pb = build_problem(spec);
  const Implementation subject{"f16 with an inf", with_injected_nonfinite};
  const Comparison c = run_comparison(spec, pb, reference_oracle(),
                                      {{Precision::F16, subject, std::nullopt}});
  const CompareResult* seq = c.cell(Precision::F16, ScanMode::Sequential);
  const CompareResult* chk = c.cell(Precision::F16, ScanMode::Chunked);
  ASSERT_TRUE(seq && chk);
  ASSERT_GE(seq->first_nonfinite, 0);
  EXPECT_EQ(seq->rows[static_cast<size_t>(seq->first_nonfinite)].key, "L1/F7/gated");
  EXPECT_EQ(seq->rows[static_cast<size_t>(seq->first_nonfinite)].status, Status::NonFinite);
  EXPECT_EQ(chk->rows[static_cast<size_t>(chk->first_nonfinite)].key, "L1/B7/d_y");
  EXPECT_EQ(first_fail_key(*seq), "L0/F3/dt");

  std::ostringstream os;
  print_compare_summary(os, c);
  const std::string text = os.str();
  EXPECT_NE(text.find("first non-finite: L1/F7/gated (f16 seq): 0 NaN, 1 Inf in the subject "
                      "where the oracle is finite\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("summary: FAIL first failing stage: L0/F3/dt"), std::string::npos) << text;

  RunInfo info;
  const std::string json = comparison_json(c, info);
  EXPECT_NE(json.find("\"first_nonfinite_by_mode\": {\n    \"e2e\": {\n      \"key\": "
                      "\"L1/F7/gated\""),
            std::string::npos)
      << json.substr(json.find("first_nonfinite_by_mode"), 300);
  EXPECT_NE(json.find("\"first_nonfinite\": \"L1/B7/d_y\""), std::string::npos);  // chunked group
}

TEST(IsolatedReport, JsonCarriesTheComparisonModeOfEveryCell) {
  RunSpec spec = small_spec();
  spec.modes = {ScanMode::Chunked};
  spec.filter = "L0/F6/*";
  spec.compare_modes = {CompareMode::EndToEnd, CompareMode::Isolated};
  const Problem pb = build_problem(spec);
  const Comparison c = run_comparison(spec, pb, reference_oracle(), cpu_lineups({Precision::BF16}));
  const std::string json = comparison_json(c, RunInfo{});
  const size_t per_cell = c.cells[0].rows.size();
  ASSERT_EQ(c.cells[1].rows.size(), per_cell);
  // cells + groups (+ the budget rows' section)
  EXPECT_EQ(count(json, "\"compare_mode\": \"isolated\""), per_cell + 1) << json.substr(0, 2000);
  EXPECT_EQ(count(json, "\"compare_mode\": \"e2e\""), per_cell + 1);
  EXPECT_EQ(count(json, "\"section\": \"isolated\""), per_cell);
  const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(json);
  EXPECT_EQ(doc["compare_modes"], nlohmann::ordered_json::array({"e2e", "isolated"}));
  EXPECT_TRUE(doc["first_fail_by_mode"]["e2e"].is_null());
  EXPECT_TRUE(doc["first_fail_by_mode"]["isolated"].is_null());
}

// ---- fault names ------------------------------------------------------------------------------

TEST(FaultNames, RoundTripAndStages) {
  for (Fault f : {Fault::None, Fault::DropBeta, Fault::FlipAngleSign, Fault::ChunkBoundaryOff,
                  Fault::RoundTwice})
    EXPECT_EQ(gpu::parse_fault(gpu::fault_name(f)), f) << gpu::fault_name(f);
  EXPECT_EQ(std::string(gpu::fault_name(Fault::DropBeta)), "drop-beta");
  EXPECT_EQ(std::string(gpu::fault_name(Fault::FlipAngleSign)), "flip-angle");
  EXPECT_EQ(std::string(gpu::fault_name(Fault::ChunkBoundaryOff)), "chunk-boundary");
  EXPECT_EQ(std::string(gpu::fault_name(Fault::RoundTwice)), "round-twice");
  EXPECT_EQ(std::string(gpu::fault_stage(Fault::DropBeta)), "F5b");
  EXPECT_EQ(std::string(gpu::fault_stage(Fault::FlipAngleSign)), "F5");
  EXPECT_EQ(std::string(gpu::fault_stage(Fault::ChunkBoundaryOff)), "F6");
  EXPECT_EQ(std::string(gpu::fault_stage(Fault::RoundTwice)), "F6");
  EXPECT_EQ(std::string(gpu::fault_stage(Fault::None)), "");
  try {
    gpu::parse_fault("flip");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("drop-beta"), std::string::npos) << e.what();
  }
#if !M3_HAVE_CUDA
  // The CPU-only build: every GPU entry says why in one line.
  try {
    gpu::GpuContext ctx(0);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("built without CUDA"), std::string::npos) << e.what();
  }
#endif
}

// ---- m3h ---------------------------------------------------------------------------------------

#ifdef M3H_PATH
using Ran = m3::test::CliRun;

Ran m3h(const std::string& args) { return m3::test::run_m3h(args); }

const char* const kSmallArgs =
    " --d-model 32 --headdim 16 --d-state 16 --layers 2 --B 2 --T 40 --chunk-size 16";

TEST(IsolatedCli, ModeBothOnTheCpuShowsBothAndPasses) {
  const Ran r = m3h(std::string("compare --device cpu --mode both") + kSmallArgs);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("summary e2e: PASS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("summary isolated: PASS"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("summary: PASS (e2e PASS, isolated PASS)"), std::string::npos) << r.out;
  const Ran iso = m3h(std::string("compare --device cpu --mode isolated --dtype bf16 --scan seq") + kSmallArgs);
  EXPECT_EQ(iso.status, 0) << iso.out << iso.err;
  EXPECT_NE(iso.out.find("cell bf16 seq iso"), std::string::npos) << iso.out;
}

TEST(IsolatedCli, BadModeAndCpuFaultAreBadUsage) {
  Ran r = m3h(std::string("compare --device cpu --mode sideways") + kSmallArgs);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--mode"), std::string::npos) << r.err;
  r = m3h(std::string("compare --device cpu --fault drop-beta") + kSmallArgs);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("GPU"), std::string::npos) << r.err;
  r = m3h(std::string("compare --device cpu --fault nonsense") + kSmallArgs);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("round-twice"), std::string::npos) << r.err;
}

TEST(IsolatedCli, DeterminismRunsEachRequestedPrecision) {
  const Ran r = m3h("determinism --device cpu --runs 2 --dtype bf16,f16 --scan seq --d-model 32 "
                    "--headdim 16 --layers 1 --T 8");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("bf16 seq (reference<float>+bf16-storage): IDENTICAL"), std::string::npos)
      << r.out;
  EXPECT_NE(r.out.find("f16 seq (reference<float>+f16-storage): IDENTICAL"), std::string::npos);
  EXPECT_EQ(r.out.find("f32 seq"), std::string::npos);
  const Ran d = m3h("determinism --device cpu --runs 2 --scan seq --d-model 32 --headdim 16 "
                    "--layers 1 --T 8");
  EXPECT_EQ(d.status, 0);
  EXPECT_NE(d.out.find("f32 seq (reference<float>): IDENTICAL"), std::string::npos) << d.out;
  EXPECT_EQ(d.out.find("bf16"), std::string::npos) << d.out;  // CPU default: f32 only
}
#endif

}  // namespace
}  // namespace m3::harness
