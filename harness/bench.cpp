// Reference timing (see bench.hpp).
#include "bench.hpp"

#include <algorithm>
#include <chrono>

#include "backbone.hpp"
#include "error.hpp"
#include "problem.hpp"

namespace m3::harness {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

template <class S>
BenchRow bench_one(const Problem& pb, ScanMode mode, int repeats, int warmup, const char* name) {
  const Params<S> params = cast_params<S>(pb.params);
  const States<S> entering = cast_states<S>(pb.states);
  const std::vector<S> x(pb.x.begin(), pb.x.end());
  const std::vector<S> d_out(pb.d_out.begin(), pb.d_out.end());
  Params<S> grads = zero_params<S>(pb.cfg);
  std::vector<S> d_x;
  States<S> d_entering;
  Backbone<S> bb(pb.cfg, pb.B, pb.T, mode);

  std::vector<double> fwd, bwd;
  for (int i = 0; i < warmup + repeats; ++i) {
    States<S> states = entering;  // forward() overwrites them with the leaving states
    const auto t0 = Clock::now();
    bb.forward(params, x, states);
    const double f = ms_since(t0);
    const auto t1 = Clock::now();
    bb.backward(params, d_out, nullptr, grads, d_x, d_entering);
    const double b = ms_since(t1);
    if (i >= warmup) {
      fwd.push_back(f);
      bwd.push_back(b);
    }
  }
  BenchRow row;
  row.precision = name;
  row.mode = mode;
  row.forward_ms = median(fwd);
  row.backward_ms = median(bwd);
  row.forward_min_ms = *std::min_element(fwd.begin(), fwd.end());
  row.backward_min_ms = *std::min_element(bwd.begin(), bwd.end());
  row.tokens = pb.B * pb.T;
  return row;
}

}  // namespace

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double BenchRow::tokens_per_s() const {
  const double s = (forward_ms + backward_ms) * 1e-3;
  return s > 0 ? static_cast<double>(tokens) / s : 0.0;
}

namespace {
void check_spec(const BenchSpec& spec) {
  M3_REQUIRE(spec.repeats >= 1, "bench", "repeats must be >= 1", "repeats=", spec.repeats);
  M3_REQUIRE(spec.warmup >= 0, "bench", "warm-up count must be >= 0", "warmup=", spec.warmup);
  M3_REQUIRE(!spec.modes.empty(), "bench", "no scan mode to time", "");
}
}  // namespace

std::vector<BenchRow> bench_reference(const BenchSpec& spec) {
  check_spec(spec);
  const Problem pb = make_problem(spec.cfg, spec.B, spec.T, spec.seed, true);
  std::vector<BenchRow> rows;
  for (ScanMode m : spec.modes) rows.push_back(bench_one<double>(pb, m, spec.repeats, spec.warmup, "f64"));
  for (ScanMode m : spec.modes) rows.push_back(bench_one<float>(pb, m, spec.repeats, spec.warmup, "f32"));
  return rows;
}

std::vector<BenchRow> bench_reference_float(const BenchSpec& spec) {
  check_spec(spec);
  const Problem pb = make_problem(spec.cfg, spec.B, spec.T, spec.seed, true);
  std::vector<BenchRow> rows;
  for (ScanMode m : spec.modes) rows.push_back(bench_one<float>(pb, m, spec.repeats, spec.warmup, "f32"));
  return rows;
}

}  // namespace m3::harness
