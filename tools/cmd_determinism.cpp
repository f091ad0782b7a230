// m3h determinism: HARNESS.md §7. Runs forward + backward --runs times on the same problem and
// compares a content hash of every captured tensor (harness/determinism.hpp); bit-identical
// output is required for every precision and scan mode. On a difference it names the first
// divergent stage/tensor in execution order and the run. Exit 0 identical, 1 divergent.
//
// --dtype: the GPU subject runs at each storage precision given (default f32,bf16,f16). On the
// CPU the subject is the float reference (reference_emulation): an explicit --dtype runs each
// precision's storage emulation; the default is f32 only there (the CPU reference is
// single-threaded and deterministic by construction; the requirement is the GPU's).
#include <chrono>
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
    "backward --runs times on one seeded problem per precision of --dtype and scan mode, hashes\n"
    "every captured tensor (FNV-1a 64 over shape and values) and requires every run to equal\n"
    "the first. On the GPU only run 0 is captured: the others digest every tensor on the device\n"
    "(no host copies), and a digest that differs names its tensor. Prints one line per\n"
    "precision and scan mode with its time; a divergence names the first tensor in execution\n"
    "order and the run.\n"
    "--dtype: on the GPU every precision given (default f32,bf16,f16); on the CPU the float\n"
    "reference with that storage emulation, f32 only unless --dtype is given.\n"
    "Exit status: 0 bit-identical, 1 divergent, 2 bad usage or bad input.";
}  // namespace

int cmd_determinism(const std::vector<std::string>& args) {
  po::options_description run("Determinism");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("runs", po::value<int>()->default_value(20), "number of runs (>= 2)")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list)")
    ("dtype", po::value<std::string>()->default_value("f32,bf16,f16"), "storage precisions (comma list of f32, bf16, f16); on the CPU the default is f32 only")
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
  std::vector<Precision> precisions = parse_dtype_list(vm["dtype"].as<std::string>());
  if (device != "gpu" && vm["dtype"].defaulted()) precisions = {Precision::F32};
  const ProblemSource src = load_problem(vm);
  std::cout << "m3h determinism: device=" << device << " runs=" << runs << " seed=" << src.spec.seed
            << " B=" << src.spec.B << " T=" << src.spec.T << "\n"
            << "config: " << src.spec.cfg.describe() << "\n";
  bool all_identical = true;
  for (Precision p : precisions) {
    const harness::Implementation impl =
        device == "gpu" ? harness::gpu_subject(p) : harness::reference_emulation(p);
    for (ScanMode mode : src.spec.modes) {
      // On the GPU only run 0 leaves the device: the others are digested where they ran.
      const auto t0 = std::chrono::steady_clock::now();
      const harness::DeterminismReport r =
          impl.repeat ? harness::check_determinism_repeat(impl.repeat(src.problem, mode),
                                                          src.problem, mode, runs)
                      : harness::check_determinism(impl.run, src.problem, mode, runs);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      char digest[32];
      std::snprintf(digest, sizeof digest, "%016llx", static_cast<unsigned long long>(r.digest));
      char took[48];
      std::snprintf(took, sizeof took, ", %.2f s", secs);
      std::cout << precision_name(p) << " " << scan_mode_name(mode) << " (" << impl.name << "): ";
      if (r.identical) {
        std::cout << "IDENTICAL over " << runs << " runs (" << r.tensors << " tensors, digest "
                  << digest << took << ")\n";
      } else {
        all_identical = false;
        std::cout << "DIVERGED at run " << r.first_run << ": first divergent tensor "
                  << r.first_key << " (" << took + 2 << ")\n";
      }
    }
  }
  return all_identical ? 0 : 1;
}

}  // namespace m3::tools
