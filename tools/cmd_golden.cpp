// m3h golden: write and check the golden HDF5 files (HARNESS.md §8, golden/SCHEMA.md).
//
//   m3h golden regen [--case NAME ... | --all] [--force] [--dir DIR]
//       computes each built-in case with the double oracle and writes DIR/NAME.h5 (atomic).
//       An existing file is replaced only with --force, which first prints what changed
//       versus the old file, tensor by tensor. Without --force nothing is written when any
//       selected file exists (exit 2, one line).
//   m3h golden check [--case NAME ... | --all] [--dir DIR] [--golden PATH ...] [--device D]
//       reads each file, recomputes every stored scan mode with run_reference<double> on the
//       stored problem and compares every stored tensor (tolerance: SCHEMA.md). One line per
//       file: PASS, or FAIL with the first mismatching tensor in execution order. Without a
//       selection: --all. --all = every built-in case plus any other *.h5 in DIR.
//       --device gpu-oracle recomputes with the GPU oracle in f64 instead (gpu/oracle_gpu.hpp):
//       one run per file, compared with every stored scan mode on the tensors it provides
//       (those both scan modes share, and every gradient) with the same tolerance; the line
//       counts the stored tensors it does not provide.
//   m3h golden regen --out FILE.h5 [--config FILE] [--B … --T … --seed … --d-model …] [--scan …]
//       [--name NAME] [--force]
//       a golden file for your own problem: the same schema, the same atomic write, the
//       config in /meta; `m3h golden check --golden FILE.h5` checks it like a built-in one
//       (--golden names a golden file in every command; --file is its other name here).
//   m3h golden list [--dir DIR]
//       the built-in cases, what each covers, and its file's size.
// DIR defaults to $M3_GOLDEN_DIR, else the source tree's golden/cases.
// Exit status: 0 success / all pass, 1 some mismatch, 2 bad usage or bad input (a missing or
// unreadable file: "m3h: error: <one line>" on stderr per file).
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <set>

#include "cli.hpp"
#include "commands.hpp"
#include "error.hpp"
#include "golden.hpp"
#include "oracle_gpu.hpp"
#include "run.hpp"

namespace m3::tools {

namespace {

namespace fs = std::filesystem;

const char* kSummary =
    "Golden HDF5 files: one per built-in case, written by the double oracle.\n"
    "  regen  compute and write; an existing file is replaced only with --force, which prints\n"
    "         what changed versus the old file\n"
    "  check  recompute every stored scan mode from the stored problem and compare every\n"
    "         stored tensor (max_abs and rel_l2 within 1e-10 of the tensor's scale);\n"
    "         --device gpu-oracle: recompute with the GPU oracle in f64 instead, on the\n"
    "         tensors both scan modes share and every gradient, with the same tolerance\n"
    "  list   the built-in cases\n"
    "Your own problem: regen --out FILE.h5 with the problem options (--config FILE, --B, --T,\n"
    "--seed, --d-model, ...; --scan, --name) writes the same schema, config in /meta; then\n"
    "check --golden FILE.h5 (as compare --golden FILE.h5 names it; --file is the same).\n"
    "Exit status: 0 success, 1 some tensor differs (check), 2 bad usage or bad input.";

void print_help(const po::options_description& desc) {
  std::cout << "Usage: m3h golden regen|check|list [options]\n\n" << kSummary << "\n\n"
            << desc << "\n";
}

std::vector<std::string> selected_cases(const po::variables_map& vm, bool all) {
  std::vector<std::string> names;
  if (all) {
    for (const auto& d : golden::builtin_cases()) names.push_back(d.name);
    return names;
  }
  if (vm.count("case"))
    for (const auto& n : vm["case"].as<std::vector<std::string>>()) {
      golden::find_case(n);  // an unknown name is an error before anything runs
      if (std::find(names.begin(), names.end(), n) != names.end())
        throw UsageError("golden: --case " + n + " is given twice");
      names.push_back(n);
    }
  return names;
}

std::string size_str(const std::string& path) {
  std::error_code ec;
  const auto n = fs::file_size(path, ec);
  if (ec) return "?";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(n) / 1024.0);
  return buf;
}

// regen --out: the problem of the problem options (a preset, --config, overrides), the modes
// of --scan, named --name (default: the file's stem).
int regen_user(const po::variables_map& vm) {
  if (vm.count("case") || vm["all"].as<bool>() || vm.count("dir"))
    throw UsageError("golden regen --out: --case, --all and --dir are for the built-in cases");
  const bool force = vm["force"].as<bool>();
  check_output_path(vm, "out", force);
  const std::string out = vm["out"].as<std::string>();
  harness::RunSpec spec = problem_from(vm);
  spec.modes = parse_scan_list(vm["scan"].as<std::string>());
  check_host_memory(vm, spec);
  const std::string name =
      vm.count("name") ? vm["name"].as<std::string>() : fs::path(out).stem().string();
  if (name.empty()) throw UsageError("golden regen --out: --name is empty");
  const Problem pb = harness::build_problem(spec);
  const golden::GoldenCase gc = golden::compute_case(name, pb, spec.modes);
  golden::write_golden(out, gc, force);
  size_t n_tensors = 0;
  for (const auto& [mode, cap] : gc.oracle) n_tensors += cap.keys().size();
  std::cout << "m3h golden: " << echo(name) << ": wrote " << echo(out, 400) << " (" << size_str(out) << ", " << n_tensors
            << " oracle tensors; " << spec.cfg.describe() << ", B=" << spec.B
            << " T=" << spec.T << " seed=" << spec.seed << ")\n";
  return 0;
}

int regen(const po::variables_map& vm, const std::string& dir) {
  if (vm.count("out")) return regen_user(vm);
  if (problem_options_given(vm))
    throw UsageError("golden regen: problem options need --out FILE.h5 (the built-in cases "
                     "define their own problems)");
  const bool all = vm["all"].as<bool>();
  if (all == (vm.count("case") != 0))
    throw UsageError("golden regen: give --case NAME (repeatable) or --all");
  const bool force = vm["force"].as<bool>();
  const std::vector<std::string> names = selected_cases(vm, all);
  if (!fs::is_directory(dir)) throw Error(dir, "golden folder does not exist", "see --dir");
  if (!force) {
    std::vector<std::string> existing;
    for (const auto& n : names)
      if (fs::exists(golden::case_path(dir, n))) existing.push_back(golden::case_path(dir, n));
    if (!existing.empty()) {
      std::string more =
          existing.size() > 1 ? " (and " + std::to_string(existing.size() - 1) + " more)" : "";
      throw Error(existing.front(), "file exists" + more,
                  "pass --force to replace it; nothing was written");
    }
  }
  for (const auto& n : names) {
    const std::string path = golden::case_path(dir, n);
    const golden::GoldenCase now = golden::make_case(golden::find_case(n));
    // Every line names the tool and the case: a log of several cases reads line by line.
    const std::string head = "m3h golden: " + n + ": ";
    if (fs::exists(path)) {
      std::cout << head << "replacing " << echo(path, 400) << "\n";
      try {
        const golden::GoldenCase old = golden::read_golden(path);
        for (const auto& line : golden::summarize(golden::diff_cases(old, now)))
          std::cout << head << line << "\n";
      } catch (const Error& e) {
        std::cout << head << "the old file is unreadable, nothing to compare: " << echo(e.what(), 400) << "\n";
      }
    }
    golden::write_golden(path, now, force);
    size_t n_tensors = 0;
    for (const auto& [mode, cap] : now.oracle) n_tensors += cap.keys().size();
    std::cout << head << "wrote " << echo(path, 400) << " (" << size_str(path) << ", " << n_tensors
              << " oracle tensors)\n";
  }
  return 0;
}

int check(const po::variables_map& vm, const std::string& dir) {
  bool all = vm["all"].as<bool>();
  if (all && vm.count("case")) throw UsageError("golden check: --case and --all exclude each other");
  std::vector<std::string> paths;
  for (const char* option : {"golden", "file"})
    if (vm.count(option))
      for (const auto& p : vm[option].as<std::vector<std::string>>()) paths.push_back(p);
  if (!all && !vm.count("case") && paths.empty()) all = true;
  std::set<std::string> seen(paths.begin(), paths.end());
  const std::vector<std::string> names = selected_cases(vm, all);
  // A missing case folder is one error, not one per case it should hold.
  if (!names.empty() && !fs::is_directory(dir)) throw Error(dir, "golden folder does not exist", "see --dir");
  for (const auto& n : names)
    if (seen.insert(golden::case_path(dir, n)).second) paths.push_back(golden::case_path(dir, n));
  if (all && fs::is_directory(dir)) {
    std::vector<std::string> extra;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".h5" && !seen.count(e.path().string()))
        extra.push_back(e.path().string());
    std::sort(extra.begin(), extra.end());
    paths.insert(paths.end(), extra.begin(), extra.end());
  }
  const std::string device = vm["device"].as<std::string>();
  if (device != "cpu" && device != "gpu-oracle")
    throw UsageError("golden check --device " + device + ": expected cpu or gpu-oracle");
  const bool on_gpu = device == "gpu-oracle";
  if (on_gpu && !gpu::oracle_unavailable().empty())
    throw UsageError("golden check --device gpu-oracle: no usable GPU (" +
                     gpu::oracle_unavailable() + ")");
  const golden::Recomputer gpu_oracle{
      "the GPU oracle", [](const Problem& pb) { return gpu::run_gpu_oracle(pb); }};
  int status = 0;
  for (const auto& p : paths) {
    try {
      const golden::CheckResult r =
          on_gpu ? golden::check_file(p, gpu_oracle, golden::Tolerance{}) : golden::check_file(p);
      std::cout << echo(r.line(), 400) << std::endl;
      if (!r.pass()) status = std::max(status, 1);
    } catch (const std::exception& e) {
      std::cerr << "m3h: error: " << echo(e.what(), 400) << std::endl;
      status = 2;
    }
  }
  return status;
}

int list(const std::string& dir) {
  for (const auto& d : golden::builtin_cases()) {
    const std::string p = golden::case_path(dir, d.name);
    std::string name = d.name;
    name.resize(18, ' ');
    std::cout << name << (fs::exists(p) ? size_str(p) : std::string("(no file)")) << "  "
              << d.about << "\n";
  }
  return 0;
}

}  // namespace

int cmd_golden(const std::vector<std::string>& args) {
  po::options_description desc("Options");
  // clang-format off
  desc.add_options()
    ("help,h", "this help")
    ("case", po::value<std::vector<std::string>>()->composing(), "a built-in case by name (repeatable; see m3h golden list)")
    ("all", po::bool_switch(), "every built-in case (check: also every other *.h5 in DIR)")
    ("force", po::bool_switch(), "regen: replace existing files, printing what changed")
    ("dir", po::value<std::string>(), "case folder (default: $M3_GOLDEN_DIR, else the source tree's golden/cases)")
    ("golden", po::value<std::vector<std::string>>()->composing(), "check: a golden file by path (repeatable), the option's name in every command")
    ("file", po::value<std::vector<std::string>>()->composing(), "check: the same as --golden")
    ("device", po::value<std::string>()->default_value("cpu"), "check: recompute with cpu (the Eigen double oracle) or gpu-oracle (the GPU oracle in f64)")
    ("out", po::value<std::string>(), "regen: write a golden file of your own problem (the problem options below) to FILE.h5")
    ("name", po::value<std::string>(), "regen --out: the case name in /meta (default: the file's stem)")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "regen --out: the scan modes to store (seq, chunked, or both)");
  desc.add(problem_options(false));
  // clang-format on
  if (args.empty()) throw UsageError("golden: give an action: regen, check or list");
  if (args[0] == "--help" || args[0] == "-h") {
    print_help(desc);
    return 0;
  }
  const std::string action = args[0];
  if (action != "regen" && action != "check" && action != "list")
    throw UsageError("golden: unknown action '" + action + "' (regen, check or list)");
  const po::variables_map vm =
      parse_args(std::vector<std::string>(args.begin() + 1, args.end()), desc, "golden");
  if (vm.count("help")) {
    print_help(desc);
    return 0;
  }
  // An option the action does not use is bad usage, never silently ignored.
  const std::pair<const char*, const char*> used_by[] = {
      {"case", "regen and check"}, {"all", "regen and check"}, {"force", "regen"},
      {"golden", "check"}, {"file", "check"}, {"dir", "regen, check and list"},
      {"out", "regen"}, {"name", "regen"}, {"device", "check"}};
  // (A bool switch given on the command line is not defaulted; one not given is.)
  for (const auto& [opt, actions] : used_by)
    if (option_given(vm, opt) && std::string(actions).find(action) == std::string::npos)
      throw UsageError("golden " + action + ": --" + opt + " is for " + actions);
  if (action != "regen" && problem_options_given(vm))
    throw UsageError("golden " + action + ": the problem options are for regen --out");
  if (action != "regen" && option_given(vm, "scan"))
    throw UsageError("golden " + action + ": --scan is for regen --out");
  const std::string dir = vm.count("dir") ? vm["dir"].as<std::string>() : golden::default_dir();
  if (action == "regen") return regen(vm, dir);
  if (action == "check") return check(vm, dir);
  return list(dir);
}

}  // namespace m3::tools
