// The streamed judge of a comparison cell (harness/cell_judge.hpp) and what it rests on:
//   - a streaming Capture hands every tensor to its sink and keeps only the keys; a stored one
//     drains into a sink in order;
//   - error_norms gives compute_metrics' pass-rule figures bit for bit, and p95_rel is the
//     nearest rank of the relative errors (the radix select agrees with a sort);
//   - the draws run only while some tensor is over the floor's limit, and the verdicts are
//     those of every draw (lazy = --every-draw, row by row);
//   - ill-conditioned values: the issue's false failure (bf16 seq L1/B4c/d_b_raw, T = 1, zero
//     states, gated norm) is "not judged" and counted, while f32 judges it; a planted bug in a
//     tensor that is ill-conditioned on some values still fails; a model with a norm over ≤ 2
//     values is not judged end to end on its failures once its runs parted (an overflow
//     downstream included) but still judged isolated, where a broken stage fails.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cell_judge.hpp"
#include "device_compare.hpp"
#include "compare.hpp"
#include "error.hpp"
#include "isolated.hpp"
#include "metrics.hpp"
#include "negative_control.hpp"
#include "params.hpp"
#include "perturbed.hpp"
#include "planted_bugs.hpp"
#include "report.hpp"
#include "report_json.hpp"
#include "run.hpp"
#include "sweep.hpp"

namespace m3::harness {
namespace {

// The problem of the false failure quoted in the issue: bf16 seq L1/B4c/d_b_raw max_abs 2.12e-5
// over a 1.99e-5 budget where the oracle value is -1.0e-9.
RunSpec issue_spec() {
  RunSpec s;
  s.cfg.d_model = 6;
  s.cfg.expand = 4;
  s.cfg.headdim = 4;
  s.cfg.d_state = 16;
  s.cfg.n_layers = 2;
  s.cfg.chunk_size = 128;
  s.cfg.input_dim = 3;
  s.cfg.is_outproj_norm = true;
  s.B = 2;
  s.T = 1;
  s.random_states = false;
  s.seed = 468225950;
  return s;
}

// A token model of vocabulary 6 with d_model 1 (every RMSNorm a step), 3 layers, the gated
// norm, T 58: problem 296 of `m3h compare --device cpu --sweep 300 --seed 1`.
RunSpec narrow_token_spec() {
  RunSpec spec;
  spec.cfg.d_model = 1;
  spec.cfg.d_state = 12;
  spec.cfg.headdim = 3;
  spec.cfg.expand = 3;
  spec.cfg.ngroups = 1;
  spec.cfg.n_layers = 3;
  spec.cfg.rope_fraction = 0.5;
  spec.cfg.chunk_size = 2;
  spec.cfg.vocab_size = 6;
  spec.cfg.input_dim = 6;
  spec.cfg.is_outproj_norm = true;
  spec.B = 1;
  spec.T = 58;
  spec.seed = 3781568117u;
  spec.modes = {ScanMode::Sequential};
  spec.compare_modes = {CompareMode::EndToEnd};
  return spec;
}

const TensorResult& row_of(const CompareResult& c, const std::string& key) {
  for (const TensorResult& r : c.rows)
    if (r.key == key) return r;
  throw Error("test", "no row", key);
}

// ---- streaming -----------------------------------------------------------------------------

TEST(StreamingCapture, HandsEveryTensorToItsSinkAndKeepsOnlyTheKeys) {
  const RunSpec spec = negative::spec();
  const Problem pb = build_problem(spec);
  const Capture stored = run_reference<float>(pb, ScanMode::Sequential);
  std::vector<std::string> seen;
  std::vector<std::vector<double>> data;
  const TensorSink sink = [&](const std::string& k, Tensor&& t) {
    seen.push_back(k);
    data.push_back(std::move(t.data));
  };
  const Capture streamed = run_reference<float>(pb, ScanMode::Sequential, Precision::F32, sink);
  EXPECT_TRUE(streamed.streaming());
  EXPECT_EQ(streamed.keys(), stored.keys());
  EXPECT_EQ(seen, stored.keys());
  EXPECT_EQ(streamed.find(seen.front()), nullptr);
  for (size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(data[i], stored.at(seen[i]).data) << seen[i];
  // A stored Capture drains into a sink in the order its tensors were put, and is left empty.
  Capture copy = stored;
  std::vector<std::string> drained;
  copy.drain([&](const std::string& k, Tensor&& t) {
    drained.push_back(k);
    EXPECT_EQ(t.data, stored.at(k).data) << k;
  });
  EXPECT_EQ(drained, stored.keys());
  EXPECT_TRUE(copy.keys().empty());
}

// ---- the figures ---------------------------------------------------------------------------

TEST(ErrorNorms, AreComputeMetricsPassRuleFiguresBitForBit) {
  Rng rng(5);
  for (int trial = 0; trial < 6; ++trial) {
    Tensor o, s;
    o.shape = s.shape = {37, 11};
    for (int i = 0; i < 37 * 11; ++i) {
      const double v = trial == 1 ? rng.uniform(-1e-12, 1e-12) : rng.uniform(-3, 3);  // zero oracle
      o.data.push_back(v);
      s.data.push_back(v * (1 + rng.uniform(-1e-3, 1e-3)) + rng.uniform(-1e-6, 1e-6));
    }
    if (trial == 2) s.data[17] = std::nan("");
    if (trial == 3) s.data[5] = std::numeric_limits<double>::infinity();
    if (trial == 4) o.data[9] = std::nan("");
    const bool circular = trial == 5;
    const Metrics full = compute_metrics(o, s, circular, Precision::BF16);
    const Metrics lean = error_norms(o, s, circular);
    SCOPED_TRACE(trial);
    EXPECT_EQ(lean.numel, full.numel);
    EXPECT_EQ(std::isnan(lean.rel_l2), std::isnan(full.rel_l2));
    if (!std::isnan(full.rel_l2)) {
      EXPECT_EQ(lean.rel_l2, full.rel_l2);
    }
    EXPECT_EQ(lean.max_abs, full.max_abs);
    EXPECT_EQ(lean.worst_index, full.worst_index);
    EXPECT_EQ(lean.oracle_scale, full.oracle_scale);
    EXPECT_EQ(lean.oracle_l2, full.oracle_l2);
    EXPECT_EQ(lean.rel_l2_absolute, full.rel_l2_absolute);
    EXPECT_EQ(lean.nan_count, full.nan_count);
    EXPECT_EQ(lean.inf_count, full.inf_count);
    EXPECT_EQ(lean.oracle_nonfinite, full.oracle_nonfinite);
  }
}

TEST(ErrorNorms, P95IsTheNearestRankOfTheRelativeErrorsOnALargeTensor) {
  Rng rng(9);
  Tensor o, s;
  o.shape = s.shape = {20000};
  for (int i = 0; i < 20000; ++i) {
    const double v = rng.uniform(-2, 2);
    o.data.push_back(v);
    // Many exact values (relative error 0, one radix bucket) and a spread of the others.
    s.data.push_back(i % 3 == 0 ? v : v * (1 + rng.uniform(-1, 1) * std::pow(10.0, -rng.uniform(1, 7))));
  }
  std::vector<double> rel;
  for (size_t i = 0; i < o.data.size(); ++i)
    if (std::fabs(o.data[i]) >= kRelThreshold)
      rel.push_back(std::fabs(s.data[i] - o.data[i]) / std::fabs(o.data[i]));
  std::sort(rel.begin(), rel.end());
  const size_t k = static_cast<size_t>(std::ceil(0.95 * static_cast<double>(rel.size()))) - 1;
  const Metrics m = compute_metrics(o, s, false, Precision::F32);
  EXPECT_EQ(m.rel_count, static_cast<Idx>(rel.size()));
  EXPECT_EQ(m.p95_rel, rel[k]);
  EXPECT_EQ(m.max_rel, rel.back());
}

// ---- the draws a verdict needs ---------------------------------------------------------------

// A CPU lineup whose draws count their runs.
std::vector<Lineup> counted_lineups(const std::vector<Precision>& ps, std::shared_ptr<std::atomic<int>> n) {
  std::vector<Lineup> ls = cpu_lineups_perturbed(ps);
  auto count = [n](Implementation& d) {
    Run run = d.run;
    d.run = [n, run](const Problem& pb, ScanMode m, const TensorSink& k) {
      ++*n;
      return run(pb, m, k);
    };
  };
  for (Lineup& l : ls) {
    count(*l.baseline);
    for (Implementation& d : l.more_baselines) count(d);
  }
  return ls;
}

TEST(LazyDraws, ADrawRunsOnlyWhileAVerdictCanStillChangeAndTheVerdictsAreEveryDraws) {
  const std::vector<Precision> ps = {Precision::F32, Precision::BF16};
  std::vector<RunSpec> specs = {negative::spec(), issue_spec()};
  for (RunSpec& spec : specs) {
    SCOPED_TRACE(spec.cfg.describe());
    spec.modes = {ScanMode::Sequential};
    const Problem pb = build_problem(spec);
    auto lazy_runs = std::make_shared<std::atomic<int>>(0);
    auto eager_runs = std::make_shared<std::atomic<int>>(0);
    const Comparison lazy = run_comparison(spec, pb, reference_oracle(), counted_lineups(ps, lazy_runs));
    RunSpec every = spec;
    every.every_draw = true;
    const Comparison eager = run_comparison(every, pb, reference_oracle(), counted_lineups(ps, eager_runs));
    EXPECT_EQ(eager_runs->load(), kPerturbationDraws * 2);
    bool floor_decides = true;
    ASSERT_EQ(lazy.cells.size(), eager.cells.size());
    for (size_t c = 0; c < lazy.cells.size(); ++c)
      for (size_t i = 0; i < lazy.cells[c].rows.size(); ++i) {
        const TensorResult& a = lazy.cells[c].rows[i];
        const TensorResult& b = eager.cells[c].rows[i];
        EXPECT_EQ(a.status, b.status) << a.key << ": " << a.note << " / " << b.note;
        // Every positional draw; the coherent ones, all or none, as the cell needs them.
        EXPECT_TRUE(b.draws == kPerturbationDraws || b.draws == kPerturbationDraws + kCoherentDraws)
            << b.key << ": " << b.draws;
        EXPECT_TRUE(a.draws == 0 || a.draws == b.draws) << a.key << ": " << a.draws;
        floor_decides = floor_decides && a.draws == 0;
      }
    if (spec.T == 1) {
      // Tensors over the floor: each of their cells ran every draw.
      EXPECT_FALSE(floor_decides);
      EXPECT_EQ(lazy_runs->load(), kPerturbationDraws * 2);
    } else {
      // Every floor holds: no draw ran at all.
      EXPECT_TRUE(floor_decides);
      EXPECT_EQ(lazy_runs->load(), 0);
      EXPECT_TRUE(lazy.pass());
    }
  }
}

// ---- coherent draws ----------------------------------------------------------------------------

// A token model's layer-0 rows up to F3 are functions of the token: a coherent draw moves equal
// values alike, so rows of equal tokens stay equal (as a deterministic float computation keeps
// them), while a positional draw parts them. The accumulation term of F2 is keyed the same way.
TEST(CoherentDraws, RowsOfEqualTokensStayEqualInACoherentDrawAndPartInAPositionalOne) {
  RunSpec spec;
  spec.cfg.d_model = 16;
  spec.cfg.d_state = 8;
  spec.cfg.headdim = 8;
  spec.cfg.expand = 2;
  spec.cfg.n_layers = 1;
  spec.cfg.chunk_size = 8;
  spec.cfg.vocab_size = 3;
  spec.cfg.input_dim = 3;
  spec.B = 1;
  spec.T = 24;
  spec.seed = 11;
  const Problem pb = build_problem(spec);
  ASSERT_TRUE(pb.token_model());
  const ScanMode mode = ScanMode::Sequential;
  const Capture o = run_reference<double>(pb, mode);
  Perturbation pt = perturbation_of(Precision::F32);
  const Capture positional = run_perturbed_reference(pb, mode, pt, 0);
  pt.coherent = true;
  const Capture coherent = run_perturbed_reference(pb, mode, pt, 0);
  // Two positions of the same token.
  Idx t0 = -1, t1 = -1;
  for (Idx t = 0; t < spec.T && t1 < 0; ++t)
    for (Idx u = t + 1; u < spec.T && t1 < 0; ++u)
      if (pb.tok[static_cast<size_t>(t)] == pb.tok[static_cast<size_t>(u)]) t0 = t, t1 = u;
  ASSERT_GE(t1, 0);
  for (const char* key : {"L0/F1/post_norm", "L0/F2/proj", "L0/F3/angles_raw", "L0/F3/dt"}) {
    SCOPED_TRACE(key);
    auto row = [&](const Capture& c, Idx t) {
      const Tensor& x = c.at(key);
      const size_t w = x.data.size() / static_cast<size_t>(spec.T);
      return std::vector<double>(x.data.begin() + static_cast<std::ptrdiff_t>(t * w),
                                 x.data.begin() + static_cast<std::ptrdiff_t>((t + 1) * w));
    };
    ASSERT_EQ(row(o, t0), row(o, t1));
    EXPECT_EQ(row(coherent, t0), row(coherent, t1));
    EXPECT_NE(row(positional, t0), row(positional, t1));
    EXPECT_NE(row(coherent, t0), row(o, t0));  // it is perturbed
  }
}

// The coherent draws of the CPU lineup run only for a token model (with a real-valued X no
// values recur, and a coherent draw is a positional one), and there only in a cell where a
// tensor is still over its limit after the positional draws: a cell that passes on those took
// none; a tensor over its limit, or not judged, took both kinds, all of each.
TEST(CoherentDraws, RunOnlyForTokensAndWhereATensorIsStillOverItsLimit) {
  auto draws_of = [](const RunSpec& spec, Precision p) {
    const Problem pb = build_problem(spec);
    const Comparison c = run_comparison(spec, pb, reference_oracle(), cpu_lineups_perturbed({p}));
    return *c.cell(p, spec.modes.front());
  };
  // Real-valued X: ill-conditioned rows, no coherent draw.
  RunSpec real = issue_spec();
  real.modes = {ScanMode::Sequential};
  const CompareResult r = draws_of(real, Precision::BF16);
  ASSERT_GT(r.n_ill(), 0);
  for (const TensorResult& t : r.rows) EXPECT_LE(t.draws, kPerturbationDraws) << t.key;
  // A token model whose f16 rows are over their limits (the narrow-norm problem above): those
  // took every draw of both kinds.
  RunSpec tok = narrow_token_spec();
  const CompareResult f = draws_of(tok, Precision::F16);
  int both = 0;
  for (const TensorResult& t : f.rows) {
    EXPECT_TRUE(t.draws == 0 || t.draws == kPerturbationDraws + kCoherentDraws)
        << t.key << ": " << t.draws;
    both += t.draws > 0 ? 1 : 0;
  }
  EXPECT_GT(both, 0);
  // A token model that passes on the positional draws: no coherent one.
  RunSpec small = tok;
  small.cfg.d_model = 16;
  small.cfg.n_layers = 1;
  small.cfg.is_outproj_norm = false;
  small.T = 24;
  const CompareResult s = draws_of(small, Precision::F32);
  ASSERT_TRUE(s.pass());
  ASSERT_EQ(s.n_ill(), 0);
  for (const TensorResult& t : s.rows) EXPECT_LE(t.draws, kPerturbationDraws) << t.key;
}

// The negative controls of the default preset's perturbed budgets (tests/test_sweep.cpp,
// PerturbedBudget), planted in a token model's emulation: each still fails, first, at the same
// sizes (f32 1e-4, bf16 30 % of dt_bias's gradient), although a failing cell of a token model
// runs the coherent draws as well (and every failing tensor took them).
TEST(CoherentDraws, PlantedBugsInATokenModelStillFailFirst) {
  RunSpec spec;
  spec.cfg.d_model = 32;
  spec.cfg.d_state = 16;
  spec.cfg.headdim = 8;
  spec.cfg.expand = 2;
  spec.cfg.n_layers = 3;
  spec.cfg.chunk_size = 16;
  spec.cfg.vocab_size = 5;
  spec.cfg.input_dim = 5;
  spec.B = 1;
  spec.T = 64;
  spec.seed = 7;
  spec.compare_modes = {CompareMode::EndToEnd};
  const Problem pb = build_problem(spec);
  ASSERT_TRUE(pb.token_model());
  for (Precision p : {Precision::F32, Precision::BF16}) {
    for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
      SCOPED_TRACE(std::string(precision_name(p)) + " " + scan_mode_name(mode));
      RunSpec one = spec;
      one.modes = {mode};
      const Comparison clean =
          run_comparison(one, pb, reference_oracle(), cpu_lineups_perturbed({p}));
      ASSERT_TRUE(clean.pass());
      const double delta = p == Precision::F32 ? 1e-4 : 0.30;
      for (const m3::test::PlantedBug& bug : m3::test::planted_bugs(spec.cfg, pb.B, pb.T, delta)) {
        SCOPED_TRACE(bug.what);
        std::vector<Lineup> ls = cpu_lineups_perturbed({p});
        const Implementation emulation = ls[0].subject;
        ls[0].subject.run = [emulation, bug](const Problem& q, ScanMode m, const TensorSink& k) {
          Capture c = emulation.run(q, m, {});
          bug.plant(c);
          if (k)
            for (const std::string& key : c.keys()) k(key, Tensor(c.at(key)));
          return c;
        };
        const Comparison c = run_comparison(one, pb, reference_oracle(), ls);
        const CompareResult& cell = c.cells.front();
        ASSERT_FALSE(cell.pass()) << bug.key << " went unnoticed";
        EXPECT_EQ(cell.rows[static_cast<size_t>(cell.first_fail)].key, bug.key);
        for (const TensorResult& r : cell.rows) {
          if (!r.pass()) {
            EXPECT_EQ(r.draws, kPerturbationDraws + kCoherentDraws) << r.key;
          }
        }
      }
    }
  }
}

// The isolated negative controls (negative_control.hpp's faults) in a token model, whose failing
// isolated cells run the coherent teacher-forced draws as well: each fault still fails, first in
// its own stage of layer 0, in every precision and scan mode, against both kinds of draws.
TEST(CoherentDraws, IsolatedFaultsInATokenModelStillFailFirstInTheirStage) {
  RunSpec spec = narrow_token_spec();
  spec.cfg.d_model = 32;  // no narrow norm: the token model of the test above
  spec.cfg.d_state = 16;
  spec.cfg.headdim = 8;
  spec.cfg.expand = 2;
  spec.cfg.n_layers = 2;
  spec.cfg.chunk_size = 16;
  spec.cfg.is_outproj_norm = false;
  spec.T = 80;  // F6's y of ≥ 4096 values: the tight row, where a second rounding fails
  spec.modes = {ScanMode::Sequential, ScanMode::Chunked};
  spec.compare_modes = {CompareMode::Isolated};
  const Problem pb = build_problem(spec);
  ASSERT_TRUE(pb.token_model());
  for (gpu::Fault f : negative::kFaults) {
    std::vector<Lineup> lineups;
    for (Precision p : {Precision::F32, Precision::BF16, Precision::F16}) {
      Implementation s = reference_emulation(p);
      s.isolated = [p, f](const Problem& q, ScanMode m, const Capture& o, const TensorSink&) {
        return run_reference_isolated(q, m, o, p, f);
      };
      lineups.push_back({p, s, std::nullopt});
    }
    add_perturbed_baselines(lineups);
    const Comparison c = run_comparison(spec, pb, reference_oracle(), lineups);
    const std::string want = std::string("L0/") + gpu::fault_stage(f) + "/";
    for (const CompareResult& cell : c.cells) {
      SCOPED_TRACE(std::string(gpu::fault_name(f)) + " " + precision_name(cell.precision) + " " +
                   scan_mode_name(cell.mode));
      ASSERT_FALSE(cell.pass()) << "not caught";
      const std::string first = cell.rows[static_cast<size_t>(cell.first_fail)].key;
      EXPECT_EQ(first.rfind(want, 0), 0u) << first;
      for (const TensorResult& r : cell.rows) {
        if (!r.pass()) {
          EXPECT_EQ(r.draws, kPerturbationDraws + kCoherentDraws) << r.key;
        }
      }
    }
  }
}

// ---- ill-conditioned values --------------------------------------------------------------------

TEST(IllConditioned, TheIssuesFalseFailureIsNotJudgedInBf16AndJudgedInF32) {
  RunSpec spec = issue_spec();
  spec.modes = {ScanMode::Sequential};
  const Problem pb = build_problem(spec);
  const Comparison c = run_comparison(spec, pb, reference_oracle(),
                                      cpu_lineups_perturbed({Precision::F32, Precision::BF16}));
  EXPECT_TRUE(c.pass());
  const TensorResult& bf = row_of(*c.cell(Precision::BF16, ScanMode::Sequential), "L1/B4c/d_b_raw");
  EXPECT_EQ(bf.status, Status::IllConditioned) << bf.note;
  EXPECT_TRUE(bf.pass());
  EXPECT_FALSE(bf.judged());
  EXPECT_EQ(bf.ill_conditioned, bf.subject.numel);  // every value: terms ≫ the value
  EXPECT_GE(bf.condition, 1 / unit_roundoff(Precision::BF16));
  EXPECT_NE(bf.note.find("ill-conditioned: not judged"), std::string::npos) << bf.note;
  // f32 resolves these values (κ·u ≪ 1): judged, and within budget.
  const TensorResult& f = row_of(*c.cell(Precision::F32, ScanMode::Sequential), "L1/B4c/d_b_raw");
  EXPECT_EQ(f.status, Status::Pass) << f.note;
  // Counted in the cell, the summary, the JSON report and the sweep's outcome.
  EXPECT_GT(c.cell(Precision::BF16, ScanMode::Sequential)->n_ill(), 0);
  std::ostringstream os;
  print_compare_summary(os, c);
  EXPECT_NE(os.str().find("ill-conditioned: not judged"), std::string::npos) << os.str();
  const std::string json = comparison_json(c, RunInfo{});
  EXPECT_NE(json.find("\"n_ill_conditioned\""), std::string::npos);
  EXPECT_NE(json.find("\"ILL-CONDITIONED\""), std::string::npos);
  SweepOptions opt;
  opt.lineups = [](const std::vector<Precision>& p) { return cpu_lineups_perturbed(p); };
  opt.modes = {ScanMode::Sequential};
  opt.compare_modes = {CompareMode::EndToEnd};
  const ProblemOutcome out = run_problem(issue_spec(), opt, {Precision::BF16});
  EXPECT_TRUE(out.pass) << out.first_fail;
  EXPECT_GT(out.n_ill, 0);
  EXPECT_NE(out.first_ill.find("ill-conditioned"), std::string::npos) << out.first_ill;
}

// A synthetic cell: one tensor whose values on a set S are cancellations (the draws move them
// by far more than themselves) and well-conditioned elsewhere. A subject whose only excess is
// on S is not judged; the same subject with a bug on the other values fails — judged on them
// with the limits the whole tensor has.
TEST(IllConditioned, APlantedBugInATensorIllConditionedOnSomeValuesStillFails) {
  RunSpec spec = negative::spec();
  spec.modes = {ScanMode::Sequential};
  const Problem pb = build_problem(spec);
  const ScanMode mode = ScanMode::Sequential;
  const std::string key = "L0/F6/y";
  Capture oracle = run_reference<double>(pb, mode);
  Tensor y = oracle.at(key);
  const size_t n = y.data.size();
  double scale = 0;
  for (double v : y.data) scale = std::max(scale, std::fabs(v));
  auto in_s = [](size_t i) { return i % 10 == 3; };  // 10 % of the values
  for (size_t i = 0; i < n; ++i)
    if (in_s(i)) y.data[i] = 1e-7 * scale * (i % 2 ? 1 : -1);
  oracle.put(key, y.shape, y.data.data());
  Rng rng(3);
  std::vector<Capture> draws;
  for (int d = 0; d < kPerturbationDraws; ++d) {
    Capture c = oracle;
    Tensor t = y;
    for (size_t i = 0; i < n; ++i)
      t.data[i] += in_s(i) ? rng.uniform(-1, 1) * 1e-3 * scale : rng.uniform(-1, 1) * 1e-3 * t.data[i];
    c.put(key, t.shape, t.data.data());
    draws.push_back(std::move(c));
  }
  auto judge = [&](const Capture& subject) {
    CompareOptions opt;
    opt.precision = Precision::BF16;
    opt.filter = key;
    opt.baseline_kind = BaselineKind::Perturbed;
    for (int d = 1; d < kPerturbationDraws; ++d) opt.more_baselines.push_back(&draws[static_cast<size_t>(d)]);
    const CompareResult r = compare_captures(oracle, subject, &draws[0], spec.cfg, pb.B, pb.T, mode, opt);
    return r.rows.at(0);
  };
  // The subject errs on S by 200 times the draws' spread there, elsewhere like a draw.
  Capture subject = oracle;
  Tensor s = y;
  for (size_t i = 0; i < n; ++i)
    s.data[i] += in_s(i) ? 0.2 * scale : 5e-4 * s.data[i];
  subject.put(key, s.shape, s.data.data());
  const TensorResult noisy = judge(subject);
  EXPECT_EQ(noisy.status, Status::IllConditioned) << noisy.note;
  EXPECT_EQ(noisy.ill_conditioned, static_cast<Idx>(n / 10));
  EXPECT_GT(noisy.subject.max_abs, noisy.budget.max_abs);  // over the whole tensor's limit
  // The planted bug: the well-conditioned values 30 % too large.
  Tensor b = s;
  for (size_t i = 0; i < n; ++i)
    if (!in_s(i)) b.data[i] *= 1.3;
  Capture buggy = oracle;
  buggy.put(key, b.shape, b.data.data());
  const TensorResult bug = judge(buggy);
  EXPECT_EQ(bug.status, Status::OverBudget) << bug.note;
  EXPECT_FALSE(bug.pass());
  EXPECT_EQ(bug.ill_conditioned, static_cast<Idx>(n / 10));
  EXPECT_NE(bug.note.find("still over"), std::string::npos) << bug.note;
}

// d_model 1: every RMSNorm is sign(x)·w, so end to end the runs part where a rounding flips a
// sign; those failures are not judged, the isolated cells judge every stage, and a broken stage
// still fails there.
TEST(IllConditioned, ANarrowNormIsNotJudgedEndToEndButABrokenStageFailsIsolated) {
  RunSpec spec;
  spec.cfg.d_model = 1;
  spec.cfg.input_dim = 1;
  spec.cfg.d_state = 24;
  spec.cfg.headdim = 2;
  spec.cfg.expand = 2;
  spec.cfg.n_layers = 2;
  spec.cfg.chunk_size = 32;
  spec.cfg.is_outproj_norm = true;
  spec.B = 1;
  spec.T = 77;
  spec.seed = 249477144;
  spec.random_states = false;
  spec.modes = {ScanMode::Sequential};
  spec.compare_modes = {CompareMode::EndToEnd, CompareMode::Isolated};
  EXPECT_EQ(narrow_norm(spec.cfg), "d_model 1 (RMSNorm), headdim 2 (the gated norm)");
  const Problem pb = build_problem(spec);
  const Comparison c = run_comparison(spec, pb, reference_oracle(), cpu_lineups_perturbed({Precision::BF16}));
  const CompareResult* e2e = c.cell(Precision::BF16, ScanMode::Sequential, CompareMode::EndToEnd);
  ASSERT_TRUE(e2e);
  EXPECT_TRUE(e2e->pass());
  bool narrow_note = false;
  for (const TensorResult& r : e2e->rows)
    narrow_note = narrow_note || r.note.find("d_model 1 (RMSNorm)") != std::string::npos;
  EXPECT_TRUE(narrow_note);
  EXPECT_TRUE(c.pass());
  // A fault in one stage, isolated: it fails there, first.
  std::vector<Lineup> faulty = cpu_lineups_perturbed({Precision::BF16});
  faulty[0].subject.isolated = [](const Problem& q, ScanMode m, const Capture& o, const TensorSink&) {
    return run_reference_isolated(q, m, o, Precision::BF16, gpu::Fault::DropBeta);
  };
  RunSpec iso = spec;
  iso.compare_modes = {CompareMode::Isolated};
  const Comparison f = run_comparison(iso, pb, reference_oracle(), faulty);
  ASSERT_FALSE(f.pass());
  const CompareResult& cell = f.cells.front();
  EXPECT_EQ(cell.rows[static_cast<size_t>(cell.first_fail)].key, "L0/F5b/beta");
}

// A token model with d_model 1 (every RMSNorm a step): end to end its f16 runs part at a flipped
// norm output, and the gradients the parted run hands down overflow f16 in layer 0 (Inf where
// the oracle's largest value is 0.28). Downstream of the parting that is not judged; a
// non-finite value that is the cell's first failure still fails, in the same model.
TEST(IllConditioned, ANarrowNormsOverflowAfterTheRunsPartedIsNotJudgedButAFirstOneFails) {
  const RunSpec spec = narrow_token_spec();
  ASSERT_EQ(narrow_norm(spec.cfg), "d_model 1 (RMSNorm)");
  const Problem pb = build_problem(spec);
  const Comparison c = run_comparison(spec, pb, reference_oracle(), cpu_lineups_perturbed({Precision::F16}));
  const CompareResult* cell = c.cell(Precision::F16, ScanMode::Sequential, CompareMode::EndToEnd);
  ASSERT_TRUE(cell);
  EXPECT_TRUE(cell->pass());
  const TensorResult& g = row_of(*cell, "L0/B8/d_gated");
  EXPECT_GT(g.subject.inf_count, 0);  // the overflow is there, and reported
  EXPECT_EQ(g.status, Status::IllConditioned) << g.note;
  EXPECT_NE(g.note.find("the runs parted (0 NaN and"), std::string::npos) << g.note;
  ASSERT_GE(cell->first_nonfinite, 0);
  EXPECT_EQ(cell->rows[static_cast<size_t>(cell->first_nonfinite)].key, "L0/B8/d_gated");
  // The same model, a subject that is the oracle but for one Inf in L0/F6/y: the cell's first
  // failure, and judged.
  const ScanMode mode = ScanMode::Sequential;
  const Capture oracle = run_reference<double>(pb, mode);
  Capture subject = oracle;
  Tensor y = oracle.at("L0/F6/y");
  y.data[y.data.size() / 2] = std::numeric_limits<double>::infinity();
  subject.put("L0/F6/y", y.shape, y.data.data());
  CompareOptions opt;
  opt.precision = Precision::F16;
  opt.baseline_kind = BaselineKind::Perturbed;
  const CompareResult planted = compare_captures(oracle, subject, &oracle, spec.cfg, pb.B, pb.T, mode, opt);
  EXPECT_FALSE(planted.pass());
  ASSERT_GE(planted.first_fail, 0);
  const TensorResult& f = planted.rows[static_cast<size_t>(planted.first_fail)];
  EXPECT_EQ(f.key, "L0/F6/y");
  EXPECT_EQ(f.status, Status::NonFinite) << f.note;
}

// A failed comparison of a checkpoint's trained weights judged by the perturbed draws alone
// says that they can fail correct code there (HARNESS.md §11): with the GPU oracle, naming the
// Eigen oracle's cut that decides; with the emulation as the subject, that it is the contract.
// A pass, weights that are not trained, or a cell with a same-precision baseline get no note.
// Each note is two lines within 100 columns.
TEST(TrainedWeightsNote, OnlyAFailureOnACheckpointJudgedByTheDrawsAloneGetsOne) {
  for (TrainedNote kind : {TrainedNote::None, TrainedNote::GpuOracle, TrainedNote::Emulation}) {
    EXPECT_EQ(trained_weights_note(true, true, kind), "");
    EXPECT_EQ(trained_weights_note(true, false, kind), "");
    EXPECT_EQ(trained_weights_note(false, false, kind), "");
  }
  EXPECT_EQ(trained_weights_note(false, true, TrainedNote::None), "");
  const std::string gpu = trained_weights_note(false, true, TrainedNote::GpuOracle);
  const std::string emu = trained_weights_note(false, true, TrainedNote::Emulation);
  EXPECT_NE(gpu.find("--B 1 and without --oracle gpu"), std::string::npos) << gpu;
  EXPECT_NE(emu.find("the emulation"), std::string::npos) << emu;
  EXPECT_EQ(emu.find("--oracle gpu"), std::string::npos) << emu;
  for (const std::string& note : {gpu, emu}) {
    EXPECT_EQ(note.rfind("note: ", 0), 0u) << note;
    EXPECT_NE(note.find("HARNESS.md §11"), std::string::npos) << note;
    ASSERT_FALSE(note.empty());
    EXPECT_EQ(note.back(), '\n');
    std::istringstream lines(note);
    int n = 0;
    for (std::string line; std::getline(lines, line); ++n) {
      // Columns, not bytes: '§' is two bytes of UTF-8.
      const auto cols = std::count_if(line.begin(), line.end(), [](char ch) {
        return (static_cast<unsigned char>(ch) & 0xC0) != 0x80;
      });
      EXPECT_LE(cols, 100) << line;
    }
    EXPECT_EQ(n, 2) << note;
  }
}

// The device comparison's time line: the parts of the wall time (the kept rows' analysis counted
// as measuring, what no part accounts for as "other"), then the oracle's five slowest stages by
// name, largest first, and the rest summed; two lines within 100 columns.
TEST(DeviceTimeLine, NamesThePartsAndTheSlowestOracleStages) {
  DeviceCompareCost c;
  c.seconds = 20.0;
  c.setup_seconds = 2.5;
  c.subject_seconds = 1.2;
  c.inputs_seconds = 4.0;
  c.measure_seconds = 2.0;
  c.analysis_seconds = 0.5;
  c.oracle_stage_seconds = {{"F6", 2.0},   {"B6", 3.0},      {"B4b", 0.75}, {"tail", 0.125},
                            {"F5", 0.375}, {"norm_f'", 0.25}, {"teacher", 1.0}};
  EXPECT_DOUBLE_EQ(c.oracle_seconds(), 7.5);
  const std::string text = device_time_line(c);
  EXPECT_EQ(text,
            "time (s): setup 2.5, subjects 1.2, draws' inputs 4.0, oracle 7.5, measuring 2.5, "
            "other 2.3\n"
            "  oracle by stage (s): B6 3.0, F6 2.0, teacher 1.0, B4b 0.8, F5 0.4, rest 0.4");
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) EXPECT_LE(line.size(), 100u) << line;
  c.oracle_stage_seconds = {{"F6", 2.0}};
  EXPECT_EQ(device_time_line(c).find("rest"), std::string::npos);
  c.oracle_stage_seconds.clear();
  EXPECT_NE(device_time_line(c).find("oracle by stage (s): none"), std::string::npos);
}

TEST(DeviceCostLine, SaysHowMuchOfTheKeptCopiesWasInHostMemory) {
  DeviceCompareCost c;
  c.seconds = 3;
  c.oracle_bytes = 2000000000;
  c.kept_bytes = 1500000000;
  EXPECT_NE(device_cost_line(c).find("kept 1.5 GB, peak in use"), std::string::npos)
      << device_cost_line(c);
  c.kept_host_bytes = 250000000;
  EXPECT_NE(device_cost_line(c).find("kept 1.5 GB (0.25 GB of it in host memory), peak in use"),
            std::string::npos)
      << device_cost_line(c);
}

}  // namespace
}  // namespace m3::harness
