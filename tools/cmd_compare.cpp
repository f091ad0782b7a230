// m3h compare: the subject against the double oracle, stage by stage (HARNESS.md §3–§5).
// Today the subject is the f32 Eigen reference on the CPU (no baseline: the floors of the
// tolerance table decide); the CUDA subject and the bf16/f16 emulation baseline plug into the
// same run_comparison() call.
#include <iostream>

#include "cli.hpp"
#include "commands.hpp"
#include "precision.hpp"
#include "report.hpp"

namespace m3::tools {

namespace {

const char* kSummary =
    "Runs the reference in double (oracle) and the subject on the same seeded problem for each\n"
    "scan mode, compares every registry tensor and parameter gradient, and prints one table\n"
    "(max_abs, rel_l2, p95_rel, %budget per scan mode) with the first failing stage.\n"
    "Exit status: 0 all within budget, 1 some budget exceeded, 2 bad usage or bad input.";

}  // namespace

int cmd_compare(const std::vector<std::string>& args) {
  po::options_description run("Comparison");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list)")
    ("stage", po::value<std::string>()->default_value(""), "only keys matching PATTERN: substring, or glob with * ? [..]; comma = or (e.g. 'L3/B6,grad/*')")
    ("dtype", po::value<std::string>()->default_value("f32"), "subject precision (f32; bf16/f16 come with the mixed-precision emulation)")
    ("device", po::value<std::string>()->default_value("cpu"), "where the subject runs (cpu: the f32 reference)")
    ("failures-only", po::bool_switch(), "table rows only for failing keys")
    ("details", po::bool_switch(), "a worst-element line (coordinates, values, budget) for every key");
  // clang-format on
  po::options_description all;
  all.add(run).add(problem_options());
  const po::variables_map vm = parse_args(args, all, "compare");
  if (vm.count("help")) {
    print_command_help("compare", kSummary, all);
    return 0;
  }

  harness::RunSpec spec = problem_from(vm);
  spec.modes = parse_scan_list(vm["scan"].as<std::string>());
  spec.filter = vm["stage"].as<std::string>();
  spec.precision = m3::parse_precision(vm["dtype"].as<std::string>());
  if (spec.precision != m3::Precision::F32)
    throw UsageError(std::string("--dtype ") + m3::precision_name(spec.precision) +
                     ": bf16/f16 comparisons need the mixed-precision emulation baseline, which "
                     "is not implemented yet; only f32 is available");
  spec.device = vm["device"].as<std::string>();
  if (spec.device != "cpu")
    throw UsageError("--device " + spec.device +
                     ": only cpu is available (the CUDA subject is not implemented yet)");

  bool any = false;
  for (ScanMode m : spec.modes)
    for (const auto& k : harness::expected_keys(spec.cfg, spec.B, spec.T, m))
      any = any || harness::key_matches(k, spec.filter);
  if (!any) throw UsageError("--stage '" + spec.filter + "' matches no tensor of this run");

  const harness::Implementation oracle = harness::reference_oracle();
  const harness::Implementation subject = harness::reference_float();
  const harness::Comparison c = harness::run_comparison(spec, oracle, subject, nullptr);

  harness::ReportOptions ropt;
  ropt.failures_only = vm["failures-only"].as<bool>();
  ropt.details = vm["details"].as<bool>();
  harness::print_compare(std::cout, c, ropt);
  return c.pass() ? 0 : 1;
}

}  // namespace m3::tools
