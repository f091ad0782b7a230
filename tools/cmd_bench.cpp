// m3h bench: timing. Today only --reference (the Eigen reference, double and float, both scan
// modes); the GPU benchmarks of the CUDA path will be further switches of this command.
#include <iostream>

#include "bench.hpp"
#include "cli.hpp"
#include "commands.hpp"
#include "report.hpp"

#if M3H_WITH_GPU
#include "device.hpp"
#endif

namespace m3::tools {

namespace {

const char* kSummary =
    "--reference: times the Eigen reference forward and backward (median of --repeats after\n"
    "--warmup untimed passes) in double and float, for each scan mode, and prints a table of\n"
    "precision, scan, forward ms, backward ms and tokens/s.";

}  // namespace

int cmd_bench(const std::vector<std::string>& args) {
  po::options_description run("Benchmark");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("reference", po::bool_switch(), "time the Eigen CPU reference")
    ("repeats", po::value<int>()->default_value(5), "timed repeats (the median is reported)")
    ("warmup", po::value<int>()->default_value(1), "untimed warm-up passes")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list)");
  // clang-format on
  po::options_description all;
  all.add(run).add(problem_options());
  const po::variables_map vm = parse_args(args, all, "bench");
  if (vm.count("help")) {
    print_command_help("bench", kSummary, all);
    return 0;
  }
  if (!vm["reference"].as<bool>())
    throw UsageError("bench: say what to time: --reference (the Eigen reference; GPU "
                     "benchmarks come with the CUDA path)");

  const harness::RunSpec p = problem_from(vm);
  harness::BenchSpec spec;
  spec.cfg = p.cfg;
  spec.B = p.B;
  spec.T = p.T;
  spec.seed = p.seed;
  spec.repeats = vm["repeats"].as<int>();
  spec.warmup = vm["warmup"].as<int>();
  spec.modes = parse_scan_list(vm["scan"].as<std::string>());
  if (spec.repeats < 1) throw UsageError("--repeats must be >= 1");
  if (spec.warmup < 0) throw UsageError("--warmup must be >= 0");

  const std::vector<harness::BenchRow> rows = harness::bench_reference(spec);
  harness::print_bench(std::cout, spec, rows);
#if M3H_WITH_GPU
  std::cout << "gpu: " << gpu::describe(gpu::query_device()) << " (not used by --reference)\n";
#endif
  return 0;
}

}  // namespace m3::tools
