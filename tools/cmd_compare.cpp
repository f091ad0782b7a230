// m3h compare: the subject against the double oracle, stage by stage (HARNESS.md §2–§5), for
// every storage precision of --dtype, every scan mode of --scan and every comparison mode of
// --mode (end to end and/or isolated). On the CPU the subject of precision p is the float
// reference with p's storage (f32 exact; bf16/f16 the mixed-precision storage emulation of
// MODEL.md §8), with the perturbed oracle as the baseline (harness/sweep.hpp: the budget
// follows each tensor's conditioning); its isolated run is the same reference teacher-forced
// (harness/isolated.hpp). On the GPU the subject is the CUDA path at p, with the emulation at p
// as the baseline, and gpu::run_gpu_isolated as its isolated run; isolated cells (CPU and GPU)
// have the perturbed oracle's teacher-forced run as their baseline; --fault injects a negative
// control (a self-test of the harness). --sweep N runs N random problems (harness/sweep.hpp).
#include <filesystem>
#include <iostream>

#include <thread>

#include "cli.hpp"
#include "commands.hpp"
#include "gpu_lineup.hpp"
#include "json.hpp"
#include "precision.hpp"
#include "presets.hpp"
#include "report.hpp"
#include "position.hpp"
#include "report_json.hpp"
#include "error.hpp"
#include "resources.hpp"
#include "device_compare.hpp"
#include "sweep.hpp"
#include "terminal.hpp"

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
      "every typed tensor where the GPU stores it, MODEL.md sec. 8); its baseline is the\n"
      "perturbed oracle (harness/sweep.hpp): reference<double> with one random rounding of p on\n"
      "every stored value, 4 draws, so that the budget follows each tensor's conditioning\n"
      "(k = 5 f32, 3 bf16/f16; harness/budget.hpp). Isolated cells, on the CPU and the GPU,\n"
      "have its teacher-forced counterpart as their baseline. The draws run only when some\n"
      "tensor is over its floor (more draws only widen a limit: the same verdicts; --every-draw\n"
      "runs them all and shows every tensor's baseline). A tensor whose verdict rests on values\n"
      "that are cancellations the precision does not resolve is ILLC, ill-conditioned: not\n"
      "judged (counted in the summary; harness/cell_judge.hpp, HARNESS.md sec. 4).\n"
      "GPU subject (--device gpu, or auto with a device): the CUDA path storing p, with the\n"
      "reference at the same precision as the baseline (pass: err <= k*baseline + floor, k = 2\n"
      "f32, 3 bf16/f16, HARNESS.md sec. 4).\n"
      "--mode (HARNESS.md sec. 2): e2e = every implementation runs the whole backbone (error as it\n"
      "propagates); isolated = each subject stage is fed the ORACLE's inputs (rounded to its\n"
      "storage) and only its own outputs are compared, against the isolated floors of the table\n"
      "(+ k x the perturbed oracle's, teacher-forced): the error a stage adds by itself; both =\n"
      "the two side by side per\n"
      "precision x scan mode, with a diagnosis line (fails isolated: the stage is broken; fails\n"
      "e2e only: upstream error amplified). On the CPU, isolated runs the float reference\n"
      "teacher-forced the same way.\n"
      "--fault (GPU only): a self-test of the harness, not of the kernels: the GPU subject is\n"
      "deliberately broken in one stage of layer 0 (drop-beta: F5b beta = 0; flip-angle: F5\n"
      "theta -> 2pi - theta; chunk-boundary: F6 y off by one step at every chunk start;\n"
      "round-twice: F6 y rounded once more to a coarser format). The run must FAIL and name\n"
      "L0/<that stage>/... as the first failing stage in isolated mode (and in e2e, except a\n"
      "round-twice in bf16/f16, whose extra rounding can hide within the e2e budget).\n"
      "--json FILE writes every metric of every cell (key x precision x mode), the budgets, the\n"
      "config, seed, build and device (atomically; non-finite numbers as \"inf\"/\"-inf\"/\"nan\").\n"
      "--sweep N --seed S: N random valid problems over the supported space (harness/sweep.hpp),\n"
      "each compared as above (--mode defaults to both); one line per failing problem with a\n"
      "reproducer, then the smallest problem that still fails and its reproducer; a summary\n"
      "'N problems, F failed'; --jobs J runs J problems at a time (CPU); --sweep-from K runs\n"
      "problems K … N-1 only (the rest of a sweep cut short, or one split over several runs).\n"
      "Exit status: 0 all within budget, 1 some budget exceeded, 2 bad usage or bad input.\n\n"
      "Presets:\n";
  for (const auto& p : harness::presets()) s += "  " + p.name + ": " + p.about + "\n";
  s += "\nExamples:\n"
       "  m3h compare                                  # default preset, f32,bf16,f16 x seq,chunked\n"
       "  m3h compare --preset long_t --dtype bf16 --stage 'L0/F5/*,L0/F4ef/*'\n"
       "  m3h compare --config my.cfg --json out.json\n"
       "  m3h compare --mode both --dtype bf16 --failures-only  # isolated next to end-to-end\n"
       "  m3h compare --device gpu --mode both --fault round-twice --T 40 --layers 2  # self-test\n"
       "  m3h compare --golden golden/cases/default.h5 --dtype f32\n"
       "  m3h compare --device cpu --sweep 1000 --seed 3 --jobs 2   # random problems";
  return s;
}

// m3h compare --sweep N: the problems come from the sweep's generator, one after another.
int run_sweep(const po::variables_map& vm, const std::vector<Precision>& precisions,
              const std::string& device, gpu::Fault fault) {
  for (const char* f : {"preset", "B", "T", "zero-states", "d-model", "d-state", "headdim",
                        "expand", "ngroups", "layers", "rope-fraction", "a-floor", "outproj-norm",
                        "chunk-size", "input-dim", "input-proj-identity", "vocab-size", "config",
                        "golden", "checkpoint", "stage", "by-position", "json"})
    if (option_given(vm, f))
      throw UsageError(std::string("--sweep draws every problem: --") + f +
                       " cannot be combined with it (reproduce one problem without --sweep)");
  for (const char* f : {"failures-only", "details", "wide", "every-draw"})
    if (vm[f].as<bool>()) throw UsageError(std::string("--") + f + ": not with --sweep");
  const std::int64_t given_n = vm["sweep"].as<std::int64_t>();
  if (given_n < 0) throw UsageError("--sweep " + std::to_string(given_n) + ": a count of problems cannot be negative");
  if (given_n == 0) throw UsageError("--sweep 0: draw at least one problem");
  const std::uint64_t n = static_cast<std::uint64_t>(given_n);
  harness::SweepOptions opt;
  opt.precisions = precisions;
  opt.modes = parse_scan_list(vm["scan"].as<std::string>());
  opt.compare_modes = option_given(vm, "mode")
                          ? parse_compare_modes(vm["mode"].as<std::string>())
                          : std::vector<harness::CompareMode>{harness::CompareMode::EndToEnd,
                                                              harness::CompareMode::Isolated};
  opt.device = device;
  if (fault != gpu::Fault::None) opt.fault = gpu::fault_name(fault);
  opt.lineups = [device, fault](const std::vector<Precision>& ps) {
    return harness::judged_lineups(device, ps, fault);
  };
  opt.shrink = !vm["no-shrink"].as<bool>();
  opt.jobs = vm["jobs"].as<int>();
  if (opt.jobs < 1) throw UsageError("--jobs " + std::to_string(opt.jobs) + ": at least 1");
  // Threads beyond the machine's only wait (and each holds a problem's memory): a bound of a
  // few per hardware thread keeps an absurd count from exhausting the machine.
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (opt.jobs > 4 * hw)
    throw UsageError("--jobs " + std::to_string(opt.jobs) + ": this machine has " + std::to_string(hw) +
                     " hardware threads (at most " + std::to_string(4 * hw) + " jobs)");
  if (opt.jobs > 1 && device == "gpu")
    throw UsageError("--jobs: the GPU runs one problem at a time (one device context)");
  const std::uint64_t seed = vm.count("seed") ? parse_seed(vm["seed"].as<std::string>()) : 1;
  const std::int64_t given_first = vm.count("sweep-from") ? vm["sweep-from"].as<std::int64_t>() : 0;
  if (given_first < 0)
    throw UsageError("--sweep-from " + std::to_string(given_first) + ": a problem index cannot be negative");
  const std::uint64_t first = static_cast<std::uint64_t>(given_first);
  if (first >= n)
    throw UsageError("--sweep-from " + std::to_string(first) + ": the sweep's problems are 0 … " +
                     std::to_string(n - 1));
  // The sweep keeps a result slot per problem of its range.
  try {
    harness::check_host_bytes(256.0 * static_cast<double>(n - first), "--sweep " + std::to_string(n),
                              "sweep fewer problems at a time, with --sweep-from");
  } catch (const m3::Error& e) {
    throw UsageError(e.what());
  }
  const harness::SweepResult r = harness::run_sweep(seed, n, opt, std::cout, first);
  return r.pass() ? 0 : 1;
}

// m3h compare --oracle gpu: the device comparison, one progress line per cell on stderr.
harness::Comparison device_comparison(const harness::RunSpec& spec, const Problem& pb,
                                      const std::vector<Precision>& precisions, gpu::Fault fault,
                                      harness::DeviceCompareCost& cost) {
  return harness::run_device_comparison(spec, pb, precisions, fault, &cost,
                                        cell_progress(precisions.size() * spec.modes.size() *
                                                      spec.compare_modes.size()));
}

}  // namespace

int cmd_compare(const std::vector<std::string>& args) {
  po::options_description run("Comparison");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("scan", po::value<std::string>()->default_value("seq,chunked"), "scan modes: seq, chunked, or both (comma list); with --golden: the file's modes")
    ("stage", po::value<std::string>()->default_value(""), "only keys matching PATTERN: substring, or glob with * ? [..]; comma = or (e.g. 'L3/B6/*,grad/*')")
    ("dtype", po::value<std::string>()->default_value("all"), "subject storage precisions: a comma list of f32, bf16, f16, or all (= f32,bf16,f16)")
    ("device", po::value<std::string>()->default_value("auto"), "where the subject runs: gpu (CUDA path; baseline = the reference at the same precision), cpu (the float reference / storage emulation), auto (gpu when one is present, else cpu with a one-line note)")
    ("oracle", po::value<std::string>()->default_value("cpu"), "the oracle: cpu (reference<double>, Eigen, on the host: the root of trust) or gpu (the GPU oracle in f64, with --device gpu: every figure computed on the device and the perturbed oracle on the GPU as the baseline, end to end and teacher-forced (--mode isolated); for shapes the host cannot hold, e.g. B 8, T 4096 at the official widths)")
    ("mode", po::value<std::string>()->default_value("e2e"), "comparison: e2e (whole backbone), isolated (each stage fed the oracle's inputs; isolated floors + k x the perturbed oracle's teacher-forced error), or both (side by side)")
    ("fault", po::value<std::string>()->default_value("none"), "GPU only, a self-test of the harness: break one stage of layer 0 on purpose (drop-beta, flip-angle, chunk-boundary, round-twice); the run must fail there")
    ("by-position", po::value<std::string>(), "print the error against position t (per chunk, chunk boundaries marked) of the [B*T, ...] tensors matching PATTERN, e.g. 'L0/F6/y'")
    ("json", po::value<std::string>(), "also write the full report as JSON to FILE (atomic; an existing file only with --force); '-': the JSON to stdout and the report to stderr")
    ("force", po::bool_switch(), "replace an existing --json file")
    ("failures-only", po::bool_switch(), "table rows only for failing keys")
    ("details", po::bool_switch(), "a worst-element line (coordinates, values, budget, ulps) for every key")
    ("wide", po::bool_switch(), "cells with max_abs, rel_l2, p95_rel and %budget, and the table unbroken: one line per key however wide (by default the report fits the terminal's width, COLUMNS, or 100 columns in a log: the table in blocks of columns)")
    ("every-draw", po::bool_switch(), "run every baseline draw and measure it on every tensor, also where the floor alone decides (the same verdicts; every tensor's baseline in the report and --json)")
    ("sweep", po::value<std::int64_t>(), "draw N random valid problems (harness/sweep.hpp; --seed S seeds the sweep, default 1) and compare each (--dtype, --scan, --mode: default both, --device); one reproducer line per failing problem, then its shrunk reproducer; exit 1 if any fails")
    ("no-shrink", po::bool_switch(), "with --sweep: report failures without shrinking them")
    ("sweep-from", po::value<std::int64_t>(), "with --sweep N: run problems K … N-1 only (problem i is the same whatever N and K, so runs over consecutive ranges make up the whole sweep)")
    ("jobs", po::value<int>()->default_value(1), "with --sweep on the CPU: problems run on N threads (the output is the same)");
  // clang-format on
  po::options_description all;
  all.add(run).add(problem_options(true));
  const po::variables_map vm = parse_args(args, all, "compare");
  if (vm.count("help")) {
    print_command_help("compare", summary_text().c_str(), all);
    return 0;
  }

  const std::vector<Precision> precisions = parse_dtype_list(vm["dtype"].as<std::string>());
  const std::vector<harness::CompareMode> compare_modes =
      parse_compare_modes(vm["mode"].as<std::string>());
  gpu::Fault fault = gpu::Fault::None;
  try {
    fault = gpu::parse_fault(vm["fault"].as<std::string>());
  } catch (const std::exception&) {
    throw UsageError("--fault '" + vm["fault"].as<std::string>() +
                     "': expected none, drop-beta, flip-angle, chunk-boundary or round-twice");
  }
  const std::string oracle = oracle_option(vm);
  const std::string device = resolve_device(vm["device"].as<std::string>(),
                                            "running the CPU rows only");
  if (fault != gpu::Fault::None && device != "gpu")
    throw UsageError(std::string("--fault ") + gpu::fault_name(fault) +
                     ": faults are injected in the GPU subject only (--device gpu)");
  if (vm.count("sweep")) return run_sweep(vm, precisions, device, fault);
  if (vm["no-shrink"].as<bool>()) throw UsageError("--no-shrink: only with --sweep");
  if (vm.count("sweep-from")) throw UsageError("--sweep-from: only with --sweep");
  if (option_given(vm, "jobs")) throw UsageError("--jobs: only with --sweep");
  if (vm.count("json"))  // fail before the run, not after it
    check_output_path(vm, "json", vm["force"].as<bool>());
  ProblemSource src = load_problem(vm);
  harness::RunSpec& spec = src.spec;
  spec.filter = stage_pattern(vm);
  spec.device = device;
  spec.compare_modes = compare_modes;
  spec.every_draw = vm["every-draw"].as<bool>();

  bool any = false;
  std::vector<std::string> keys;
  for (ScanMode m : spec.modes)
    for (const auto& k : harness::expected_keys(spec.cfg, spec.B, spec.T, m)) {
      any = any || harness::key_matches(k, spec.filter);
      if (std::find(keys.begin(), keys.end(), k) == keys.end()) keys.push_back(k);
    }
  if (!any)
    throw UsageError("--stage '" + echo(spec.filter) + "' matches no tensor of this run" +
                     near_keys_note(spec.filter, keys) + " (m3h dump --list-keys lists them)");
  if (vm.count("by-position")) {
    spec.by_position = vm["by-position"].as<std::string>();
    bool has = false;
    for (ScanMode m : spec.modes)
      for (const KeyedSpec& ks : expected_stage_keys(spec.cfg, spec.B, spec.T, m))
        has = has || (harness::has_position_axis(ks.spec->shape) &&
                      harness::key_matches(ks.key, spec.by_position) &&
                      harness::key_matches(ks.key, spec.filter));
    if (spec.by_position.empty() || !has)
      throw UsageError("--by-position '" + echo(spec.by_position) +
                       "': matches no [B*T, ...] tensor of this run (and of --stage)");
  }

  // The cells without a same-precision baseline get the perturbed oracle (harness/sweep.hpp):
  // the CPU's e2e and isolated cells, the GPU's isolated cells; the GPU's e2e cells get it as
  // their conditioning term beside the emulation (budget.hpp). With the GPU oracle, every cell
  // is judged on the device against the perturbed GPU oracle (harness/device_compare.hpp).
  harness::DeviceCompareCost cost;
  const harness::Comparison c =
      oracle == "gpu"
          ? device_comparison(spec, src.problem, precisions, fault, cost)
          : harness::run_comparison(spec, src.problem, src.oracle,
                                    harness::judged_lineups(device, precisions, fault));

  harness::ReportOptions ropt;
  ropt.failures_only = vm["failures-only"].as<bool>();
  ropt.details = vm["details"].as<bool>();
  ropt.wide = vm["wide"].as<bool>();
  // The report fits the terminal (or 100 columns in a log); --wide asks for the unbroken table.
  ropt.width = ropt.wide ? 0 : harness::terminal_columns(1);
  // --json -: stdout is the JSON document alone, the report goes to stderr.
  const bool json_stdout = vm.count("json") && vm["json"].as<std::string>() == "-";
  std::ostream& report = json_stdout ? std::cerr : std::cout;
  harness::print_compare(report, c, ropt);
  for (const harness::CompareResult& cell : c.cells)
    for (const harness::TensorResult& row : cell.rows)
      if (!row.by_position.empty()) {
        report << "\n";
        harness::print_position_profile(report, harness::cell_name(cell) + " " + row.key,
                                        row.by_position, spec.cfg.chunk_size);
      }

  if (oracle == "gpu")
    report << "\n"
           << harness::device_cost_line(cost) << "\n"
           << harness::device_time_line(cost) << "\n"
           << harness::trained_weights_note(c.pass(), vm.count("checkpoint") > 0,
                                            harness::TrainedNote::GpuOracle);
  else if (device == "cpu")
    report << harness::trained_weights_note(c.pass(), vm.count("checkpoint") > 0,
                                            harness::TrainedNote::Emulation);

  if (vm.count("json")) {
    harness::RunInfo info;
    info.command_line = command_line("compare", args);
    info.cpu = harness::cpu_model();
    info.gpu = gpu::describe(gpu::query_device());
    info.cuda = gpu::cuda_compiled();
    const std::string path = vm["json"].as<std::string>();
    if (json_stdout) {
      std::cout << harness::comparison_json(c, info) << "\n";
    } else {
      harness::write_file_atomic(path, harness::comparison_json(c, info));
      std::cout << json_written_line(path, c.cells.size(), c.n_checks()) << "\n";
    }
  }
  return c.pass() ? 0 : 1;
}

}  // namespace m3::tools
