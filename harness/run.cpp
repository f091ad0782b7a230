// Comparison runs (see run.hpp).
#include "run.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "cell_judge.hpp"
#include "error.hpp"
#include "isolated.hpp"
#include "presets.hpp"

namespace m3::harness {

RunSpec preset_spec(const Preset& p) {
  RunSpec s;
  s.preset = p.name;
  s.source = "preset " + p.name;
  s.cfg = p.cfg;
  s.B = p.B;
  s.T = p.T;
  s.seed = p.seed;
  s.random_states = p.random_states;
  return s;
}

Problem build_problem(const RunSpec& spec) {
  return preset_problem(find_preset(spec.preset), spec.cfg, spec.B, spec.T, spec.seed,
                        spec.random_states);
}

namespace {

// `impl`'s run of (pb, mode), every tensor handed to `sink` as it comes (or, from a run that
// kept them, right after it).
void stream_run(const Implementation& impl, const Problem& pb, ScanMode mode,
                const TensorSink& sink) {
  impl.run(pb, mode, sink).drain(sink);
}

// `impl`'s isolated (teacher-forced) run on the oracle's Capture `o`, streamed the same way.
void stream_isolated(const Implementation& impl, const Problem& pb, ScanMode mode,
                     const Capture& o, const TensorSink& sink) {
  impl.isolated(pb, mode, o, sink).drain(sink);
}

}  // namespace

Implementation reference_oracle() {
  Implementation o{"reference<double>",
                   [](const Problem& pb, ScanMode mode, const TensorSink& sink) {
                     return run_reference<double>(pb, mode, Precision::F64, sink);
                   }};
  o.exact_reference = true;
  return o;
}

Implementation reference_emulation(Precision storage) {
  M3_REQUIRE(storage != Precision::F64, "reference_emulation", "no float subject stores f64",
             "f64 is the oracle's precision");
  std::string name = "reference<float>";
  if (storage != Precision::F32) name += "+" + std::string(precision_name(storage)) + "-storage";
  return {name,
          [storage](const Problem& pb, ScanMode mode, const TensorSink& sink) {
            return run_reference<float>(pb, mode, storage, sink);
          },
          [storage](const Problem& pb, ScanMode mode, const Capture& oracle,
                    const TensorSink& sink) {
            return run_reference_isolated(pb, mode, oracle, storage, gpu::Fault::None, sink);
          }};
}

Implementation reference_float() { return reference_emulation(Precision::F32); }

Implementation stored_captures(std::string name, std::map<ScanMode, Capture> captures) {
  auto held = std::make_shared<const std::map<ScanMode, Capture>>(std::move(captures));
  const std::string label = name;
  return {std::move(name), [held, label](const Problem&, ScanMode mode, const TensorSink&) {
            auto it = held->find(mode);
            if (it == held->end())
              throw Error(label, "no stored capture for this scan mode", scan_mode_name(mode));
            return it->second;
          }, nullptr};
}

std::vector<Lineup> cpu_lineups(const std::vector<Precision>& precisions) {
  std::vector<Lineup> out;
  for (Precision p : precisions) out.push_back({p, reference_emulation(p), std::nullopt});
  return out;
}

const CompareResult* Comparison::cell(Precision p, ScanMode m, CompareMode cm) const {
  for (const auto& c : cells)
    if (c.precision == p && c.mode == m && c.compare_mode == cm) return &c;
  return nullptr;
}

bool Comparison::pass() const {
  for (const auto& c : cells)
    if (!c.pass()) return false;
  return true;
}

int Comparison::n_checks() const {
  int n = 0;
  for (const auto& c : cells) n += static_cast<int>(c.rows.size());
  return n;
}

int Comparison::n_fail() const {
  int n = 0;
  for (const auto& c : cells) n += c.n_fail();
  return n;
}

namespace {

// One cell: the subject streamed into its judge, then the draws of each term while a verdict
// can still change (cell_judge.hpp), each streamed and measured against its unperturbed
// reference run (the oracle itself when the oracle is the exact reference).
CompareResult judge_cell(const RunSpec& spec, const Problem& pb, const Implementation& oracle,
                         const Lineup& l, ScanMode mode, CompareMode cm, const Capture& o,
                         const CellObserver& observe) {
  CompareOptions opt;
  opt.precision = l.precision;
  opt.filter = spec.filter;
  opt.by_position = spec.by_position;
  opt.compare_mode = cm;
  opt.baseline_kind = l.baseline_kind;
  const bool iso = cm == CompareMode::Isolated;
  const bool keep = static_cast<bool>(observe);
  // The draws of each term, as runs of (pb, mode) streamed into `sink`.
  using Run = std::function<void(const TensorSink&)>;
  using Keep = std::function<Capture()>;
  struct Draw {
    Run run;
    Keep stored;
  };
  std::vector<Draw> base, cond;
  // base[coherent_from …] run only while a tensor is over its limit (Lineup::coherent_baselines).
  size_t coherent_from = SIZE_MAX;
  std::function<Capture()> base_ref, cond_ref;  // empty: the oracle
  if (iso) {
    auto add = [&](const Implementation& ib) {
      base.push_back({[&ib, &pb, mode, &o](const TensorSink& k) { stream_isolated(ib, pb, mode, o, k); },
                      [&ib, &pb, mode, &o] { return ib.isolated(pb, mode, o, {}); }});
    };
    for (const Implementation& ib : l.isolated_baselines) add(ib);
    coherent_from = base.size();  // as end to end, below
    if (pb.token_model())
      for (const Implementation& cb : l.coherent_isolated_baselines) add(cb);
    if (l.isolated_baseline_reference && !oracle.exact_reference)
      base_ref = [&l, &pb, mode, &o] { return l.isolated_baseline_reference(pb, mode, o, {}); };
  } else {
    if (l.baseline) {
      auto add = [&](const Implementation& b) {
        base.push_back({[&b, &pb, mode](const TensorSink& k) { stream_run(b, pb, mode, k); },
                        [&b, &pb, mode] { return b.run(pb, mode, {}); }});
      };
      add(*l.baseline);
      for (const Implementation& mb : l.more_baselines) add(mb);
      // Equal values recur where the input is tokens (layer 0's rows up to F5 are functions of
      // the token); with a real-valued X a coherent draw is a positional one again.
      coherent_from = base.size();
      if (pb.token_model())
        for (const Implementation& cb : l.coherent_baselines) add(cb);
      if (l.baseline_reference && !oracle.exact_reference)
        base_ref = [&l, &pb, mode] { return l.baseline_reference(pb, mode); };
    }
    for (const Implementation& ci : l.conditioning)
      cond.push_back({[&ci, &pb, mode](const TensorSink& k) { stream_run(ci, pb, mode, k); },
                      [&ci, &pb, mode] { return ci.run(pb, mode, {}); }});
    if (!l.conditioning.empty() && l.conditioning_reference && !oracle.exact_reference)
      cond_ref = [&l, &pb, mode] { return l.conditioning_reference(pb, mode); };
  }
  CellJudge judge(o, spec.cfg, spec.B, spec.T, mode, opt, !base.empty(),
                  spec.every_draw || keep);
  judge.second_kind_from(coherent_from);
  Capture subject, first_draw;
  const TensorSink to_subject = [&judge](const std::string& k, Tensor&& t) { judge.subject(k, t); };
  if (keep) {
    subject = iso ? l.subject.isolated(pb, mode, o, {}) : l.subject.run(pb, mode, {});
    for (const std::string& k : subject.keys())
      if (const Tensor* t = subject.find(k)) judge.subject(k, *t);
  } else if (iso) {
    stream_isolated(l.subject, pb, mode, o, to_subject);
  } else {
    stream_run(l.subject, pb, mode, to_subject);
  }
  judge.subject_done();
  const TensorSink to_draw = [&judge](const std::string& k, Tensor&& t) { judge.draw(k, t); };
  auto run_term = [&](CellJudge::Term term, const std::vector<Draw>& draws,
                      const std::function<Capture()>& reference, bool keep_first,
                      size_t gated_from) {
    std::optional<Capture> ref;  // run on first need
    for (size_t d = 0; d < draws.size() && judge.open(); ++d) {
      if (d == gated_from && !judge.over_limit()) break;  // all of them or none
      if (reference && !ref) ref = reference();
      judge.draw_begin(term, ref ? &*ref : nullptr);
      if (keep_first && d == 0) {
        first_draw = draws[d].stored();
        for (const std::string& k : first_draw.keys())
          if (const Tensor* t = first_draw.find(k)) judge.draw(k, *t);
      } else {
        draws[d].run(to_draw);
      }
      judge.draw_end();
    }
  };
  run_term(CellJudge::Term::Baseline, base, base_ref, keep, coherent_from);
  run_term(CellJudge::Term::Conditioning, cond, cond_ref, false, SIZE_MAX);
  CompareResult r = judge.finish();
  if (observe) observe(r, o, subject, base.empty() ? nullptr : &first_draw);
  return r;
}

}  // namespace

Comparison run_comparison(const RunSpec& spec, const Problem& pb, const Implementation& oracle,
                          const std::vector<Lineup>& lineups, const CellObserver& observe) {
  validate_run(spec.cfg, spec.B, spec.T);
  M3_REQUIRE(!lineups.empty(), "run_comparison", "no precision to compare", "");
  M3_REQUIRE(!spec.modes.empty(), "run_comparison", "no scan mode to compare", "");
  M3_REQUIRE(!spec.compare_modes.empty(), "run_comparison", "no comparison mode (e2e, isolated)",
             "");
  M3_REQUIRE(pb.B == spec.B && pb.T == spec.T && pb.cfg.describe() == spec.cfg.describe(),
             "run_comparison", "the problem does not match the run spec",
             "problem B=", pb.B, " T=", pb.T, ", spec B=", spec.B, " T=", spec.T);
  bool isolated = false;
  for (CompareMode cm : spec.compare_modes) isolated = isolated || cm == CompareMode::Isolated;
  if (isolated)  // before any run: say so now, not after the end-to-end cells
    for (const Lineup& l : lineups)
      M3_REQUIRE(static_cast<bool>(l.subject.isolated), "run_comparison",
                 "the subject has no isolated (teacher-forced) mode", l.subject.name, " at ",
                 precision_name(l.precision));
  Comparison c;
  c.spec = spec;
  c.oracle_name = oracle.name;
  c.lineups = lineups;
  // Scan mode outermost (the oracle runs once per mode), then stored precision-major.
  const size_t np = lineups.size(), nm = spec.modes.size(), nc = spec.compare_modes.size();
  std::vector<CompareResult> cells(np * nm * nc);
  for (size_t m = 0; m < nm; ++m) {
    const ScanMode mode = spec.modes[m];
    const Capture o = oracle.run(pb, mode, {});
    for (size_t p = 0; p < np; ++p)
      for (size_t k = 0; k < nc; ++k)
        cells[(p * nm + m) * nc + k] =
            judge_cell(spec, pb, oracle, lineups[p], mode, spec.compare_modes[k], o, observe);
  }
  c.cells = std::move(cells);
  return c;
}

}  // namespace m3::harness
