// m3h determinism: HARNESS.md §7. Runs forward + backward --runs times on the same problem and
// compares a content hash of every captured tensor (harness/determinism.hpp); bit-identical
// output is required for every precision and scan mode. On a difference it names the first
// divergent stage/tensor in execution order and the run. Exit 0 identical, 1 divergent.
#include <cstdio>
#include <iostream>

#include "cli.hpp"
#include "commands.hpp"
#include "determinism.hpp"
#include "gpu_lineup.hpp"  // gpu_subject

namespace m3::tools {

namespace {
const char* kSummary =
    "Runs the subject (--device gpu: the CUDA path; cpu: the float reference) forward and\n"
    "backward --runs times on one seeded problem per scan mode, hashes every captured tensor\n"
    "(FNV-1a 64 over shape and values) and requires every run to equal the first. Prints one\n"
    "line per scan mode; a divergence names the first tensor in execution order and the run.\n"
    "Exit status: 0 bit-identical, 1 divergent, 2 bad usage or bad input.";
}  // namespace

int cmd_determinism(const std::vector<std::string>& args) {
  po::options_description run("Determinism");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("runs", po::value<int>()->default_value(20), "number of runs (>= 2)")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list)")
    ("device", po::value<std::string>()->default_value("auto"), "gpu, cpu, or auto (gpu when present, else cpu with a one-line note)");
  // clang-format on
  po::options_description all;
  all.add(run).add(problem_options());
  const po::variables_map vm = parse_args(args, all, "determinism");
  if (vm.count("help")) {
    print_command_help("determinism", kSummary, all);
    return 0;
  }
  const int runs = vm["runs"].as<int>();
  if (runs < 2) throw UsageError("--runs must be >= 2");
  const std::string device = resolve_device(vm["device"].as<std::string>(),
                                            "checking the CPU reference only");
  const ProblemSource src = load_problem(vm);
  const harness::Implementation impl = device == "gpu" ? harness::gpu_subject(Precision::F32)
                                                       : harness::reference_float();
  std::cout << "m3h determinism: subject=" << impl.name << " runs=" << runs
            << " seed=" << src.spec.seed << " B=" << src.spec.B << " T=" << src.spec.T << "\n"
            << "config: " << src.spec.cfg.describe() << "\n";
  bool all_identical = true;
  for (ScanMode mode : src.spec.modes) {
    const harness::DeterminismReport r =
        harness::check_determinism(impl.run, src.problem, mode, runs);
    char digest[32];
    std::snprintf(digest, sizeof digest, "%016llx", static_cast<unsigned long long>(r.digest));
    if (r.identical) {
      std::cout << scan_mode_name(mode) << ": IDENTICAL over " << runs << " runs (" << r.tensors
                << " tensors, digest " << digest << ")\n";
    } else {
      all_identical = false;
      std::cout << scan_mode_name(mode) << ": DIVERGED at run " << r.first_run
                << ": first divergent tensor " << r.first_key << "\n";
    }
  }
  return all_identical ? 0 : 1;
}

}  // namespace m3::tools
