// m3h dump: oracle, baseline, subject and difference arrays of chosen tensors to an HDF5 file
// (HARNESS.md §5; the layout is harness/dump.hpp).
#include <iostream>

#include "cli.hpp"
#include "commands.hpp"
#include "dump.hpp"
#include "gpu_lineup.hpp"
#include "report.hpp"

namespace m3::tools {

namespace {

const char* kSummary =
    "Runs the oracle and the subject(s) like m3h compare and writes, for every key matching\n"
    "--stage, the arrays to an HDF5 file (atomically; an existing file only with --force):\n"
    "  /meta                                    attributes as a golden file's /meta (config,\n"
    "                                           B, T, seed, scan_modes, git_revision, ...) plus\n"
    "                                           kind=dump, source, stage_pattern, precisions\n"
    "  /dump/<mode>/<precision>/<key>/oracle    f64, the registry shape\n"
    "  /dump/<mode>/<precision>/<key>/subject   f64 (exact values of the subject's storage)\n"
    "  /dump/<mode>/<precision>/<key>/baseline  f64, the baseline (on the CPU: the perturbed\n"
    "                                           oracle's first draw; on the GPU: the emulation)\n"
    "  /dump/<mode>/<precision>/<key>/diff      subject - oracle (angles: circular distance)\n"
    "  /dump/<mode>/<precision>/<key>/by_position/max_abs, rel_l2\n"
    "                                           [T]: the error at each position t, over b and\n"
    "                                           the other axes ([B*T, ...] tensors only; plot\n"
    "                                           with scripts/plot-positions.sh)\n"
    "  --profiles-only: by_position and the attributes only, [B*T, ...] tensors only.\n"
    "  e.g. /dump/seq/bf16/L0/F5/angle_cumsum/diff, /dump/chunked/f32/grad/L1/dt_bias/oracle;\n"
    "  each key group has attributes axes (\"BT,NH,NA\"), circular, status, rel_l2, max_abs,\n"
    "  p95_rel, cosine, pct (of budget), worst_coords.\n"
    "Read with h5dump/h5ls or h5py (f = h5py.File(p); f['/dump/seq/f32/L0/F3/dt/diff'][:]).\n"
    "Exit status: 0 written (whatever the tensors' verdicts), 2 bad usage or bad input.";

}  // namespace

int cmd_dump(const std::vector<std::string>& args) {
  po::options_description run("Dump");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("stage", po::value<std::string>(), "keys to dump (required): substring, or glob with * ? [..]; comma = or; '*' = all")
    ("out", po::value<std::string>(), "the HDF5 file to write (required)")
    ("force", po::bool_switch(), "replace an existing file")
    ("profiles-only", po::bool_switch(), "write only the error-against-position profiles (by_position) of the matching [B*T, ...] tensors, not their arrays: O(T) per key")
    ("dtype", po::value<std::string>()->default_value("f32"), "subject storage precisions (comma list of f32, bf16, f16)")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list); with --golden: the file's modes")
    ("device", po::value<std::string>()->default_value("auto"), "where the subject runs: gpu (baseline = the reference at the same precision), cpu, or auto (gpu when present)");
  // clang-format on
  po::options_description all;
  all.add(run).add(problem_options(true));
  const po::variables_map vm = parse_args(args, all, "dump");
  if (vm.count("help")) {
    print_command_help("dump", kSummary, all);
    return 0;
  }
  if (!vm.count("stage"))
    throw UsageError("dump: say which tensors: --stage PATTERN ('*' for all)");
  const std::string pattern = stage_pattern(vm);
  if (!vm.count("out")) throw UsageError("dump: say where: --out FILE.h5");
  check_output_path(vm, "out", vm["force"].as<bool>());  // before any work
  const std::vector<Precision> precisions = parse_dtype_list(vm["dtype"].as<std::string>());
  const std::string device =
      resolve_device(vm["device"].as<std::string>(), "dumping the CPU subject only");

  ProblemSource src = load_problem(vm);
  src.spec.filter = pattern;
  const std::string out = vm["out"].as<std::string>();
  harness::DumpOptions dopt;
  dopt.profiles_only = vm["profiles-only"].as<bool>();
  // The lineups of m3h compare (the same baselines, so the same verdicts).
  const harness::DumpResult r =
      harness::write_dump(out, vm["force"].as<bool>(), src.spec, src.problem, src.oracle,
                          harness::judged_lineups(device, precisions), dopt);
  std::cout << "m3h dump: wrote " << r.n_keys << " key group(s) (" << r.n_datasets
            << " datasets) to " << echo(out, 400) << " under /dump/<mode>/<precision>/<key>/\n";
  for (const auto& c : r.cells)
    std::cout << "  " << harness::cell_name(c) << ": " << c.rows.size() << " keys, " << c.n_fail()
              << " over budget\n";
  return 0;
}

}  // namespace m3::tools
