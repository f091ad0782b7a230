// m3h dump: oracle, baseline, subject and difference arrays of chosen tensors to an HDF5 file
// (HARNESS.md §5; the layout is harness/dump.hpp). With --oracle gpu the GPU subject is judged on
// the device against the GPU oracle, as m3h compare --oracle gpu does (HARNESS.md §11), and
// only the matching keys' arrays come to the host (harness::write_device_dump).
#include <cstdio>
#include <iostream>
#include <map>

#include "cli.hpp"
#include "commands.hpp"
#include "device_compare.hpp"
#include "dump.hpp"
#include "gpu_lineup.hpp"
#include "position.hpp"
#include "registry.hpp"
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
    "                                           oracle's first draw; on the GPU: the emulation;\n"
    "                                           --oracle gpu: the perturbed GPU oracle's exact\n"
    "                                           draw, every stored value rounded to its format)\n"
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
    "Before any work it says how large the file will be; past 256 MiB it writes only with\n"
    "--force (narrow --stage, or --profiles-only). --list-keys lists the keys of the problem\n"
    "(those matching --stage when given) with their axes, shapes and scan modes, and writes\n"
    "nothing; a --stage that matches nothing names the nearest keys.\n"
    "--oracle gpu (with --device gpu): the verdicts, metrics and profiles of m3h compare\n"
    "--device gpu --oracle gpu, computed on the device, and /meta oracle = gpu-oracle<double>;\n"
    "only the matching keys' arrays come to the host, so host memory grows with the dump, not\n"
    "with B*T or the layers. The GPU oracle's scan is the recurrence itself: the keys one scan\n"
    "algorithm has inside (h_saved, chunk_states, ...) are not dumped (a line after the size\n"
    "names those that match).\n"
    "Exit status: 0 written (whatever the tensors' verdicts), 2 bad usage or bad input.";

// A file larger than this is written only with --force: '*' on the default problem is
// about 0.8 GB, which a user asking for "every tensor" rarely means to write.
constexpr double kLargeDumpBytes = 256.0 * 1024 * 1024;

// One key of the run: its axes and shape, and the scan modes that produce it.
struct KeyInfo {
  std::string key, axes;
  std::vector<Idx> shape;
  bool positional = false;
  std::string modes;
};

// The keys of every scan mode of the spec, in execution order (a key of one mode only where
// that mode has it), stage tensors then parameter gradients per mode.
std::vector<KeyInfo> run_keys(const harness::RunSpec& spec) {
  std::vector<KeyInfo> keys;
  std::map<std::string, size_t> at;
  auto add = [&](const std::string& key, const std::string& axes, const std::vector<Idx>& shape,
                 bool positional, ScanMode mode) {
    auto it = at.find(key);
    if (it == at.end()) {
      at[key] = keys.size();
      keys.push_back({key, axes, shape, positional, scan_mode_name(mode)});
    } else {
      keys[it->second].modes += std::string(",") + scan_mode_name(mode);
    }
  };
  for (ScanMode mode : spec.modes) {
    for (const KeyedSpec& ks : expected_stage_keys(spec.cfg, spec.B, spec.T, mode))
      add(ks.key, harness::axes_name(ks.spec->shape), ks.shape,
          harness::has_position_axis(ks.spec->shape), mode);
    for (const KeyedParam& kp : expected_param_keys(spec.cfg)) add(kp.key, "", kp.shape, false, mode);
  }
  return keys;
}

// Bytes the dump writes for `keys` (those matching the pattern): per precision and mode, four
// f64 arrays (oracle, subject, baseline, diff) per key, or with profiles_only the two [T]
// profiles of a [B*T, ...] key (which also come with the arrays).
double dump_bytes(const std::vector<KeyInfo>& keys, const harness::RunSpec& spec,
                  size_t precisions, bool profiles_only) {
  double bytes = 0;
  for (const KeyInfo& k : keys) {
    double n = 1;
    for (Idx d : k.shape) n *= static_cast<double>(d);
    const double modes = static_cast<double>(std::count(k.modes.begin(), k.modes.end(), ',') + 1);
    const double profile = k.positional ? 2.0 * 8.0 * static_cast<double>(spec.T) : 0.0;
    bytes += modes * static_cast<double>(precisions) * (profiles_only ? profile : 4 * 8 * n + profile);
  }
  return bytes;
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, bytes < 1024.0 * 1024 ? "%.1f KiB" : "%.1f MiB",
                bytes < 1024.0 * 1024 ? bytes / 1024 : bytes / (1024.0 * 1024));
  return buf;
}

}  // namespace

int cmd_dump(const std::vector<std::string>& args) {
  po::options_description run("Dump");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("stage", po::value<std::string>(), "keys to dump (required): substring, or glob with * ? [..]; comma = or; '*' = all")
    ("out", po::value<std::string>(), "the HDF5 file to write (required)")
    ("force", po::bool_switch(), "replace an existing file; write a file larger than 256 MiB")
    ("list-keys", po::bool_switch(), "list the problem's keys (matching --stage when given) with axes, shape and scan modes; write nothing")
    ("profiles-only", po::bool_switch(), "write only the error-against-position profiles (by_position) of the matching [B*T, ...] tensors, not their arrays: O(T) per key")
    ("dtype", po::value<std::string>()->default_value("f32"), "subject storage precisions: a comma list of f32, bf16, f16, or all (default f32: each precision adds a file's worth)")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list); with --golden: the file's modes")
    ("device", po::value<std::string>()->default_value("auto"), "where the subject runs: gpu (baseline = the reference at the same precision), cpu, or auto (gpu when present)")
    ("oracle", po::value<std::string>()->default_value("cpu"), "the oracle: cpu (reference<double>, Eigen, on the host: the root of trust) or gpu (the GPU oracle in f64, with --device gpu: compare --oracle gpu's verdicts, computed on the device, the perturbed GPU oracle's exact draw as the baseline, and only the matching keys copied to the host; for shapes the host cannot hold)");
  // clang-format on
  po::options_description all;
  all.add(run).add(problem_options(true));
  const po::variables_map vm = parse_args(args, all, "dump");
  if (vm.count("help")) {
    print_command_help("dump", kSummary, all);
    return 0;
  }
  const bool list = vm["list-keys"].as<bool>();
  if (!vm.count("stage") && !list)
    throw UsageError("dump: say which tensors: --stage PATTERN ('*' for all; --list-keys lists them)");
  const std::string pattern = list && !vm.count("stage") ? "*" : stage_pattern(vm);
  if (list) {
    for (const char* o : {"out", "profiles-only"})
      if (option_given(vm, o)) throw UsageError(std::string("dump --list-keys: --") + o + " writes a dump; not with --list-keys");
  } else {
    if (!vm.count("out")) throw UsageError("dump: say where: --out FILE.h5");
    check_output_path(vm, "out", vm["force"].as<bool>());  // before any work
  }
  const std::vector<Precision> precisions = parse_dtype_list(vm["dtype"].as<std::string>());
  // Where the subject runs and which oracle judges it, before any work (not for --list-keys,
  // which runs nothing).
  std::string oracle = "cpu", device;
  if (!list) {
    oracle = oracle_option(vm);
    device = resolve_device(vm["device"].as<std::string>(), "dumping the CPU subject only");
  }

  // --list-keys --oracle gpu lists what the GPU oracle provides (nothing runs, so no device check).
  if (list && vm["oracle"].as<std::string>() != "cpu" && vm["oracle"].as<std::string>() != "gpu")
    throw UsageError("dump: --oracle is cpu or gpu, not '" + echo(vm["oracle"].as<std::string>()) +
                     "'");
  const bool gpu_oracle = list ? vm["oracle"].as<std::string>() == "gpu" : oracle == "gpu";
  ProblemSource src = load_problem(vm);
  src.spec.filter = pattern;
  std::vector<KeyInfo> matching;
  std::vector<std::string> all_keys;
  for (const KeyInfo& k : run_keys(src.spec)) {
    all_keys.push_back(k.key);
    if (harness::key_matches(k.key, pattern)) matching.push_back(k);
  }
  if (matching.empty())
    throw UsageError("--stage '" + echo(pattern) + "' matches no tensor of this run" +
                     near_keys_note(pattern, all_keys) + " (--list-keys lists them)");
  // With the GPU oracle, only the keys it provides: the others are named, and a pattern of
  // those only is refused, naming the nearest keys it does provide.
  std::vector<std::string> not_provided;
  if (gpu_oracle) {
    const auto provided = harness::device_compared_shapes(src.spec.cfg, src.spec.B, src.spec.T);
    std::vector<KeyInfo> kept;
    std::vector<std::string> provided_keys;
    for (const KeyInfo& k : run_keys(src.spec))
      if (provided.count(k.key)) provided_keys.push_back(k.key);
    for (const KeyInfo& k : matching) {
      if (provided.count(k.key)) kept.push_back(k);
      else not_provided.push_back(k.key);
    }
    if (kept.empty())
      throw UsageError("--oracle gpu: --stage '" + echo(pattern) + "' matches only keys of one scan "
                       "algorithm's inside, which the GPU oracle does not compute (" +
                       not_provided.front() + ", ...)" + near_keys_note(pattern, provided_keys));
    matching = std::move(kept);
  }
  if (list) {
    size_t kw = 3;
    for (const KeyInfo& k : matching) kw = std::max(kw, k.key.size());
    for (const KeyInfo& k : matching) {
      std::string key = k.key, axes = k.axes.empty() ? "param" : k.axes;
      key.resize(kw + 2, ' ');
      axes.resize(std::max<size_t>(axes.size() + 2, 14), ' ');
      std::cout << key << axes << shape_str(k.shape) << "  " << k.modes << "\n";
    }
    std::cout << matching.size() << " key(s)";
    if (!not_provided.empty())
      std::cout << "; " << not_provided.size()
                << " more that the GPU oracle does not compute (one scan algorithm's inside), e.g. "
                << not_provided.front();
    std::cout << "\n";
    return 0;
  }
  const bool profiles_only = vm["profiles-only"].as<bool>();
  const double bytes = dump_bytes(matching, src.spec, precisions.size(), profiles_only);
  const std::string out = vm["out"].as<std::string>();
  if (bytes > kLargeDumpBytes && !vm["force"].as<bool>())
    throw UsageError("dump: about " + mib(bytes) + " to write (" + std::to_string(matching.size()) +
                     " keys x " + std::to_string(precisions.size()) + " precision(s), every scan mode); "
                     "past 256 MiB only with --force (or narrow --stage, or --profiles-only)");
  harness::DumpOptions dopt;
  dopt.profiles_only = profiles_only;
  if (oracle == "gpu") {
    // The device's refusals (no device, a shape the GPU path cannot run, the oracle and a
    // subject not fitting its memory) before the size line, as every refusal.
    harness::check_device_comparison(src.spec, precisions, "dump --oracle gpu");
  }
  std::cout << "m3h dump: about " << mib(bytes) << " (" << matching.size()
            << " keys per precision and scan mode) to " << echo(out, 400) << "\n";
  if (!not_provided.empty()) {
    std::cout << "m3h dump: " << not_provided.size()
              << " matching key(s) of one scan algorithm's inside not dumped (the GPU oracle's "
                 "scan is the recurrence itself):";
    for (size_t i = 0; i < not_provided.size() && i < 4; ++i) std::cout << " " << not_provided[i];
    std::cout << (not_provided.size() > 4 ? " ...\n" : "\n");
  }
  std::cout << std::flush;
  const harness::DumpResult r =
      oracle == "gpu"
          ? harness::write_device_dump(out, vm["force"].as<bool>(), src.spec, src.problem,
                                       precisions, dopt,
                                       cell_progress(precisions.size() * src.spec.modes.size()))
          // The lineups of m3h compare (the same baselines, so the same verdicts).
          : harness::write_dump(out, vm["force"].as<bool>(), src.spec, src.problem, src.oracle,
                                harness::judged_lineups(device, precisions), dopt);
  std::cout << "m3h dump: wrote " << r.n_keys << " key group(s) (" << r.n_datasets
            << " datasets) to " << echo(out, 400) << " under /dump/<mode>/<precision>/<key>/\n";
  for (const auto& c : r.cells)
    std::cout << "  " << harness::cell_name(c) << ": " << c.rows.size() << " keys, " << c.n_fail()
              << " over budget\n";
  if (!r.device_cost.empty()) std::cout << r.device_cost << "\n";
  return 0;
}

}  // namespace m3::tools
