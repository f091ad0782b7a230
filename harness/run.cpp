// Comparison runs (see run.hpp).
#include "run.hpp"

#include <memory>

#include "error.hpp"
#include "isolated.hpp"
#include "presets.hpp"

namespace m3::harness {

Problem build_problem(const RunSpec& spec) {
  return preset_problem(find_preset(spec.preset), spec.cfg, spec.B, spec.T, spec.seed,
                        spec.random_states);
}

Implementation reference_oracle() {
  return {"reference<double>",
          [](const Problem& pb, ScanMode mode) { return run_reference<double>(pb, mode); }};
}

Implementation reference_emulation(Precision storage) {
  M3_REQUIRE(storage != Precision::F64, "reference_emulation", "no float subject stores f64",
             "f64 is the oracle's precision");
  std::string name = "reference<float>";
  if (storage != Precision::F32) name += "+" + std::string(precision_name(storage)) + "-storage";
  return {name,
          [storage](const Problem& pb, ScanMode mode) {
            return run_reference<float>(pb, mode, storage);
          },
          [storage](const Problem& pb, ScanMode mode, const Capture& oracle) {
            return run_reference_isolated(pb, mode, oracle, storage);
          }};
}

Implementation reference_float() { return reference_emulation(Precision::F32); }

Implementation stored_captures(std::string name, std::map<ScanMode, Capture> captures) {
  auto held = std::make_shared<const std::map<ScanMode, Capture>>(std::move(captures));
  const std::string label = name;
  return {std::move(name), [held, label](const Problem&, ScanMode mode) {
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
    const Capture o = oracle.run(pb, mode);
    for (size_t p = 0; p < np; ++p) {
      const Lineup& l = lineups[p];
      for (size_t k = 0; k < nc; ++k) {
        CompareOptions opt;
        opt.precision = l.precision;
        opt.filter = spec.filter;
        opt.by_position = spec.by_position;
        opt.compare_mode = spec.compare_modes[k];
        opt.baseline_kind = l.baseline_kind;
        CompareResult r;
        if (opt.compare_mode == CompareMode::Isolated) {
          const Capture s = l.subject.isolated(pb, mode, o);
          std::vector<Capture> iso;
          for (const IsolatedRun& ib : l.isolated_baselines) iso.push_back(ib(pb, mode, o));
          for (const Capture& c2 : iso) opt.isolated_baselines.push_back(&c2);
          Capture ref;
          if (!iso.empty() && l.isolated_baseline_reference) {
            ref = l.isolated_baseline_reference(pb, mode, o);
            opt.baseline_reference = &ref;
          }
          r = compare_captures(o, s, nullptr, spec.cfg, spec.B, spec.T, mode, opt);
          if (observe) observe(r, o, s, iso.empty() ? nullptr : &iso.front());
        } else {
          const Capture s = l.subject.run(pb, mode);
          Capture b;
          if (l.baseline) b = l.baseline->run(pb, mode);
          std::vector<Capture> more;
          if (l.baseline)
            for (const Implementation& mb : l.more_baselines) more.push_back(mb.run(pb, mode));
          for (const Capture& m2 : more) opt.more_baselines.push_back(&m2);
          Capture ref;
          if (l.baseline && l.baseline_reference) {
            ref = l.baseline_reference(pb, mode);
            opt.baseline_reference = &ref;
          }
          std::vector<Capture> cond;
          for (const Implementation& ci : l.conditioning) cond.push_back(ci.run(pb, mode));
          for (const Capture& c2 : cond) opt.conditioning.push_back(&c2);
          Capture cref;
          if (!cond.empty() && l.conditioning_reference) {
            cref = l.conditioning_reference(pb, mode);
            opt.conditioning_reference = &cref;
          }
          r = compare_captures(o, s, l.baseline ? &b : nullptr, spec.cfg, spec.B, spec.T, mode,
                               opt);
          if (observe) observe(r, o, s, l.baseline ? &b : nullptr);
        }
        cells[(p * nm + m) * nc + k] = std::move(r);
      }
    }
  }
  c.cells = std::move(cells);
  return c;
}

}  // namespace m3::harness
