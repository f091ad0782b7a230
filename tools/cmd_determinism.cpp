// m3h determinism: HARNESS.md §7. Runs forward + backward --runs times on the same problem and
// compares a content hash of every captured tensor (harness/determinism.hpp); bit-identical
// output is required for every precision and scan mode. On a difference it names the first
// divergent stage/tensor in execution order and the run. Exit 0 identical, 1 divergent.
//
// --dtype: the GPU subject runs at each storage precision given (default all: f32,bf16,f16).
// On the CPU the subject is the float reference (reference_emulation): an explicit --dtype runs
// each precision's storage emulation; the default is f32 only there (the CPU reference is
// single-threaded and deterministic by construction; the requirement is the GPU's). The
// header line names the precisions that run.
//
// --record FILE / --expect FILE (harness/digest_record.hpp): run 0's per-tensor hashes of every
// cell written out, or held against a record made on the same machine (GPU model, CUDA runtime,
// cuBLAS; on the CPU the compiler) and problem. A cell whose bits moved names its first moved
// tensor in execution order and how many moved, and the exit status is 1: a change meant to
// keep the bits is checked by the record instead of by a person comparing digests.
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <string>

#include "cli.hpp"
#include "commands.hpp"
#include "determinism.hpp"
#include "device.hpp"
#include "digest_record.hpp"
#include "gpu_lineup.hpp"  // gpu_subject
#include "json.hpp"        // write_file_atomic
#include "terminal.hpp"

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
    "--dtype: on the GPU every precision given (default all: f32,bf16,f16); on the CPU the\n"
    "float reference with that storage emulation, f32 only unless --dtype is given.\n"
    "--record FILE writes every cell's per-tensor hashes (run 0) with the machine and the\n"
    "problem; --expect FILE holds every cell to such a record and names, per cell whose bits\n"
    "moved, the first tensor in execution order that moved.\n"
    "Exit status: 0 bit-identical (and as recorded), 1 divergent or not as recorded, 2 bad\n"
    "usage or bad input (a record of another machine or problem, a malformed record).";

// What the bits depend on besides the source: the GPU and its libraries, or on the CPU the
// compiler that built the reference.
std::string environment_of(const std::string& device) {
  if (device == "gpu") return m3::gpu::bits_environment(m3::gpu::query_device());
  return std::string("CPU float reference, compiler ") + __VERSION__;
}
}  // namespace

int cmd_determinism(const std::vector<std::string>& args) {
  po::options_description run("Determinism");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("runs", po::value<int>()->default_value(20), "number of runs (>= 2)")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list)")
    ("dtype", po::value<std::string>(), "storage precisions: a comma list of f32, bf16, f16, or all (default: all on the GPU; f32 on the CPU, whose reference is deterministic by construction)")
    ("device", po::value<std::string>()->default_value("auto"), "gpu, cpu, or auto (gpu when present, else cpu with a one-line note)")
    ("record", po::value<std::string>(), "write every cell's per-tensor digests, the machine and the problem to FILE")
    ("expect", po::value<std::string>(), "hold every cell's per-tensor digests to FILE's (a --record of the same machine and problem)")
    ("force", po::bool_switch(), "let --record replace an existing file");
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
  const std::vector<Precision> precisions =
      vm.count("dtype") ? parse_dtype_list(vm["dtype"].as<std::string>())
      : device == "gpu" ? parse_dtype_list("all")
                        : std::vector<Precision>{Precision::F32};
  const ProblemSource src = load_problem(vm);
  const bool record = vm.count("record") > 0, expect = vm.count("expect") > 0;
  if (record && expect) throw UsageError("--record and --expect: one at a time");
  if (record) check_output_path(vm, "record", vm["force"].as<bool>());
  const std::string environment = environment_of(device);
  const std::string problem = harness::digest_problem(src.spec);
  harness::DigestRecord expected, written{environment, problem, {}};
  if (expect) {  // read and matched before any work
    const std::string path = vm["expect"].as<std::string>();
    expected = harness::read_digest_record(path);
    if (expected.environment != environment)
      throw UsageError("--expect " + path + ": recorded on '" + expected.environment +
                       "', this is '" + environment + "': not comparable");
    if (expected.problem != problem)
      throw UsageError("--expect " + path + ": recorded for another problem ('" +
                       expected.problem + "')");
  }
  std::string names;
  for (Precision p : precisions) names += (names.empty() ? "" : ",") + std::string(precision_name(p));
  std::cout << "m3h determinism: device=" << device << " precisions=" << names << " runs=" << runs
            << " seed=" << src.spec.seed
            << " B=" << src.spec.B << " T=" << src.spec.T << "\n"
            << harness::wrap_words("config: " + src.spec.cfg.describe(),
                                   harness::terminal_columns(1), 2)
            << "\n";
  bool all_identical = true, as_recorded = true;
  for (Precision p : precisions) {
    const harness::Implementation impl =
        device == "gpu" ? harness::gpu_subject(p) : harness::reference_emulation(p);
    for (ScanMode mode : src.spec.modes) {
      // On the GPU only run 0 leaves the device: the others are digested where they ran.
      const auto t0 = std::chrono::steady_clock::now();
      const harness::DeterminismReport r =
          impl.repeat ? harness::check_determinism_repeat(impl.repeat(src.problem, mode),
                                                          src.problem, mode, runs)
                      : harness::check_determinism(
                            [&impl](const Problem& pb, ScanMode m) { return impl.run(pb, m, {}); },
                            src.problem, mode, runs);
      const double secs =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      char took[48];
      std::snprintf(took, sizeof took, ", %.2f s", secs);
      std::cout << precision_name(p) << " " << scan_mode_name(mode) << " (" << impl.name << "): ";
      if (r.identical) {
        std::cout << "IDENTICAL over " << runs << " runs (" << r.tensors << " tensors, digest "
                  << harness::hex16(r.digest) << took << ")\n";
      } else {
        all_identical = false;
        std::cout << "DIVERGED at run " << r.first_run << ": first divergent tensor "
                  << r.first_key << " (" << took + 2 << ")\n";
      }
      const harness::DigestCell cell{precision_name(p), scan_mode_name(mode), r.digest, r.keys,
                                     r.hashes};
      if (expect) {
        const harness::DigestCell* rec = expected.find(cell.precision, cell.scan);
        if (!rec) {
          as_recorded = false;
          std::cout << "  NOT RECORDED: " << echo(vm["expect"].as<std::string>()) << " has no "
                    << cell.precision << " " << cell.scan << " cell\n";
        } else if (const harness::DigestDiff d = harness::diff_digests(*rec, cell); d.same()) {
          std::cout << "  as recorded (" << cell.keys.size() << " tensors)\n";
        } else {
          as_recorded = false;
          auto hash = [](std::uint64_t v) {  // 0: the tensor is absent on that side
            return v ? harness::hex16(v) : std::string("absent");
          };
          std::cout << "  NOT AS RECORDED: " << d.differ << " of " << cell.keys.size()
                    << " tensors moved";
          if (d.missing) std::cout << ", " << d.missing << " on one side only";
          std::cout << "; first " << d.first_key << " (recorded " << hash(d.recorded) << ", now "
                    << hash(d.now) << ")\n";
        }
      }
      if (record) written.cells.push_back(cell);
    }
  }
  if (record && !all_identical) {
    std::cout << "not recorded: a cell diverged, so its run 0 is no record\n";
  } else if (record) {
    harness::write_file_atomic(vm["record"].as<std::string>(),
                               harness::format_digest_record(written));
    std::cout << "recorded " << written.cells.size() << " cell(s) in "
              << echo(vm["record"].as<std::string>(), 400) << "\n";
  }
  return all_identical && as_recorded ? 0 : 1;
}

}  // namespace m3::tools
