// Comparison runs (see run.hpp).
#include "run.hpp"

#include <functional>
#include <future>
#include <memory>
#include <utility>
#include <vector>

#include "error.hpp"
#include "isolated.hpp"
#include "presets.hpp"

namespace m3::harness {

Problem build_problem(const RunSpec& spec) {
  return preset_problem(find_preset(spec.preset), spec.cfg, spec.B, spec.T, spec.seed,
                        spec.random_states);
}

namespace {

// The runs of one cell besides the subject's, each on a thread of its own while the subject
// runs on the caller's: the baseline, its further draws, the perturbed oracle's draws and the
// unperturbed runs they deviate from. They are whole, independent runs of the CPU reference (or
// stored captures), which keeps no shared mutable state (sweep.cpp runs whole problems on
// threads; ReferenceRuns locks its cache), and each is deterministic, so the cell's verdict is
// the one a single thread gives. Four draws and their reference are most of a judged cell's
// time: verification while training (TRAINING.md §6) ran them one after another.
enum class Slot { Baseline, MoreBaselines, BaselineReference, Conditioning, ConditioningReference };
class Runs {
 public:
  void start(Slot slot, std::function<Capture()> run) {
    runs_.push_back({slot, std::async(std::launch::async, std::move(run))});
  }
  // The captures started in `slot`, in the order they were started (an exception of a run is
  // rethrown here; the destructor of a std::async future waits for its run, so no run outlives
  // the references it took).
  std::vector<Capture> take(Slot slot) {
    std::vector<Capture> out;
    for (auto& r : runs_)
      if (r.first == slot) out.push_back(r.second.get());
    return out;
  }

 private:
  std::vector<std::pair<Slot, std::future<Capture>>> runs_;
};

}  // namespace

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
          Runs runs;
          for (const IsolatedRun& ib : l.isolated_baselines)
            runs.start(Slot::Baseline, [&ib, &pb, mode, &o] { return ib(pb, mode, o); });
          if (!l.isolated_baselines.empty() && l.isolated_baseline_reference)
            runs.start(Slot::BaselineReference,
                       [&l, &pb, mode, &o] { return l.isolated_baseline_reference(pb, mode, o); });
          const Capture s = l.subject.isolated(pb, mode, o);
          const std::vector<Capture> iso = runs.take(Slot::Baseline);
          for (const Capture& c2 : iso) opt.isolated_baselines.push_back(&c2);
          const std::vector<Capture> ref = runs.take(Slot::BaselineReference);
          if (!ref.empty()) opt.baseline_reference = &ref.front();
          r = compare_captures(o, s, nullptr, spec.cfg, spec.B, spec.T, mode, opt);
          if (observe) observe(r, o, s, iso.empty() ? nullptr : &iso.front());
        } else {
          Runs runs;
          if (l.baseline) {
            const Implementation& b = *l.baseline;
            runs.start(Slot::Baseline, [&b, &pb, mode] { return b.run(pb, mode); });
            for (const Implementation& mb : l.more_baselines)
              runs.start(Slot::MoreBaselines, [&mb, &pb, mode] { return mb.run(pb, mode); });
            if (l.baseline_reference)
              runs.start(Slot::BaselineReference,
                         [&l, &pb, mode] { return l.baseline_reference(pb, mode); });
          }
          for (const Implementation& ci : l.conditioning)
            runs.start(Slot::Conditioning, [&ci, &pb, mode] { return ci.run(pb, mode); });
          if (!l.conditioning.empty() && l.conditioning_reference)
            runs.start(Slot::ConditioningReference,
                       [&l, &pb, mode] { return l.conditioning_reference(pb, mode); });
          const Capture s = l.subject.run(pb, mode);
          const std::vector<Capture> b = runs.take(Slot::Baseline);
          const std::vector<Capture> more = runs.take(Slot::MoreBaselines);
          for (const Capture& m2 : more) opt.more_baselines.push_back(&m2);
          const std::vector<Capture> ref = runs.take(Slot::BaselineReference);
          if (!ref.empty()) opt.baseline_reference = &ref.front();
          const std::vector<Capture> cond = runs.take(Slot::Conditioning);
          for (const Capture& c2 : cond) opt.conditioning.push_back(&c2);
          const std::vector<Capture> cref = runs.take(Slot::ConditioningReference);
          if (!cref.empty()) opt.conditioning_reference = &cref.front();
          const Capture* base = b.empty() ? nullptr : &b.front();
          r = compare_captures(o, s, base, spec.cfg, spec.B, spec.T, mode, opt);
          if (observe) observe(r, o, s, base);
        }
        cells[(p * nm + m) * nc + k] = std::move(r);
      }
    }
  }
  c.cells = std::move(cells);
  return c;
}

}  // namespace m3::harness
