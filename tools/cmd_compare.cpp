// m3h compare: the subject against the double oracle, stage by stage (HARNESS.md §3–§5), for
// every storage precision of --dtype and every scan mode of --scan. On the CPU the subject of
// precision p is the float reference with p's storage (f32 exact; bf16/f16 the mixed-precision
// storage emulation of MODEL.md §8) and there is no baseline: the floors of the tolerance table
// decide. The CUDA subject (with the emulation as baseline) plugs into the same lineups.
#include <filesystem>
#include <iostream>

#include "cli.hpp"
#include "commands.hpp"
#include "gpu_lineup.hpp"
#include "json.hpp"
#include "precision.hpp"
#include "presets.hpp"
#include "report.hpp"
#include "report_json.hpp"

#include "device.hpp"

namespace m3::tools {

namespace {

std::string summary_text() {
  std::string s =
      "Runs the oracle (reference<double>, or the tensors stored in a --golden file) and, per\n"
      "precision of --dtype, the subject on the same problem for each scan mode; compares every\n"
      "registry tensor and parameter gradient and prints ONE table: rows = stage/tensor in\n"
      "execution order, columns = precision x scan mode (rel_l2 and %budget; --wide adds max_abs\n"
      "and p95_rel), then the failures and a summary naming the first failing stage.\n"
      "CPU subject of precision p: reference<float> with p's storage (f32 exact; bf16/f16 round\n"
      "every typed tensor where the GPU stores it, MODEL.md sec. 8); no baseline yet, so the floors\n"
      "of the tolerance table (harness/budget.cpp) alone decide.\n"
      "GPU subject (--device gpu, or auto with a device): the CUDA path, with the reference at\n"
      "the same precision as the baseline (pass: err <= k*baseline + floor, HARNESS.md sec. 4).\n"
      "--json FILE writes every metric of every cell (key x precision x mode), the budgets, the\n"
      "config, seed, build and device (atomically; non-finite numbers as \"inf\"/\"-inf\"/\"nan\").\n"
      "Exit status: 0 all within budget, 1 some budget exceeded, 2 bad usage or bad input.\n\n"
      "Presets:\n";
  for (const auto& p : harness::presets()) s += "  " + p.name + ": " + p.about + "\n";
  s += "\nExamples:\n"
       "  m3h compare                                  # default preset, f32,bf16,f16 x seq,chunked\n"
       "  m3h compare --preset long_t --dtype bf16 --stage 'L0/F5/*,L0/F4ef/*'\n"
       "  m3h compare --config my.cfg --json out.json\n"
       "  m3h compare --golden golden/cases/default.h5 --dtype f32";
  return s;
}

}  // namespace

int cmd_compare(const std::vector<std::string>& args) {
  po::options_description run("Comparison");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list); with --golden: the file's modes")
    ("stage", po::value<std::string>()->default_value(""), "only keys matching PATTERN: substring, or glob with * ? [..]; comma = or (e.g. 'L3/B6/*,grad/*')")
    ("dtype", po::value<std::string>()->default_value("f32,bf16,f16"), "subject storage precisions (comma list of f32, bf16, f16)")
    ("device", po::value<std::string>()->default_value("auto"), "where the subject runs: gpu (CUDA path; baseline = the reference at the same precision), cpu (the float reference / storage emulation), auto (gpu when one is present, else cpu with a one-line note)")
    ("json", po::value<std::string>(), "also write the full report as JSON to FILE (atomic)")
    ("failures-only", po::bool_switch(), "table rows only for failing keys")
    ("details", po::bool_switch(), "a worst-element line (coordinates, values, budget, ulps) for every key")
    ("wide", po::bool_switch(), "cells with max_abs, rel_l2, p95_rel and %budget");
  // clang-format on
  po::options_description all;
  all.add(run).add(problem_options(true));
  const po::variables_map vm = parse_args(args, all, "compare");
  if (vm.count("help")) {
    print_command_help("compare", summary_text().c_str(), all);
    return 0;
  }

  std::vector<Precision> precisions = parse_dtype_list(vm["dtype"].as<std::string>());
  const std::string device = resolve_device(vm["device"].as<std::string>(),
                                            "running the CPU rows only");
  // The GPU path stores f32 only so far: the default precision list narrows to f32 there (an
  // explicit --dtype bf16/f16 with the GPU is an error that says so).
  if (device == "gpu" && vm["dtype"].defaulted()) precisions = {Precision::F32};
  if (vm.count("json")) {  // fail before the run, not after it
    const std::filesystem::path dir =
        std::filesystem::path(vm["json"].as<std::string>()).parent_path();
    if (!dir.empty() && !std::filesystem::is_directory(dir))
      throw UsageError("--json " + vm["json"].as<std::string>() + ": folder " + dir.string() +
                       " does not exist");
  }
  ProblemSource src = load_problem(vm);
  harness::RunSpec& spec = src.spec;
  spec.filter = vm["stage"].as<std::string>();
  spec.device = device;

  bool any = false;
  for (ScanMode m : spec.modes)
    for (const auto& k : harness::expected_keys(spec.cfg, spec.B, spec.T, m))
      any = any || harness::key_matches(k, spec.filter);
  if (!any) throw UsageError("--stage '" + spec.filter + "' matches no tensor of this run");

  const harness::Comparison c =
      harness::run_comparison(spec, src.problem, src.oracle,
                              device == "gpu" ? harness::gpu_lineups(precisions)
                                              : harness::cpu_lineups(precisions));

  harness::ReportOptions ropt;
  ropt.failures_only = vm["failures-only"].as<bool>();
  ropt.details = vm["details"].as<bool>();
  ropt.wide = vm["wide"].as<bool>();
  harness::print_compare(std::cout, c, ropt);

  if (vm.count("json")) {
    harness::RunInfo info;
    info.command_line = command_line("compare", args);
    info.cpu = harness::cpu_model();
    info.gpu = gpu::describe(gpu::query_device());
    info.cuda = gpu::cuda_compiled();
    const std::string path = vm["json"].as<std::string>();
    harness::write_file_atomic(path, harness::comparison_json(c, info));
    std::cout << "json: " << path << " (" << c.n_checks() << " cells)\n";
  }
  return c.pass() ? 0 : 1;
}

}  // namespace m3::tools
