// Comparison runs (see run.hpp).
#include "run.hpp"

namespace m3::harness {

Implementation reference_oracle() {
  return {"reference<double>",
          [](const Problem& pb, ScanMode mode) { return run_reference<double>(pb, mode); }};
}

Implementation reference_float() {
  return {"reference<float>",
          [](const Problem& pb, ScanMode mode) { return run_reference<float>(pb, mode); }};
}

bool Comparison::pass() const {
  for (const auto& m : modes)
    if (!m.pass()) return false;
  return true;
}

int Comparison::n_checks() const {
  int n = 0;
  for (const auto& m : modes) n += static_cast<int>(m.rows.size());
  return n;
}

int Comparison::n_fail() const {
  int n = 0;
  for (const auto& m : modes) n += m.n_fail();
  return n;
}

Comparison run_comparison(const RunSpec& spec, const Implementation& oracle,
                          const Implementation& subject, const Implementation* baseline) {
  validate_run(spec.cfg, spec.B, spec.T);
  Comparison c;
  c.spec = spec;
  c.oracle_name = oracle.name;
  c.subject_name = subject.name;
  if (baseline) c.baseline_name = baseline->name;
  const Problem pb = make_problem(spec.cfg, spec.B, spec.T, spec.seed, spec.random_states);
  CompareOptions opt;
  opt.precision = spec.precision;
  opt.filter = spec.filter;
  for (ScanMode mode : spec.modes) {
    const Capture o = oracle.run(pb, mode);
    const Capture s = subject.run(pb, mode);
    Capture b;
    if (baseline) b = baseline->run(pb, mode);
    c.modes.push_back(compare_captures(o, s, baseline ? &b : nullptr, spec.cfg, spec.B, spec.T,
                                       mode, opt));
  }
  return c;
}

}  // namespace m3::harness
