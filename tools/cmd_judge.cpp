// m3h judge: verifies ANOTHER implementation of Mamba-3 against a golden case, stage by stage
// (harness/judge.hpp, HARNESS.md §10). --export-problem writes the case's weights and inputs as
// NumPy files for that implementation; --subject / --subject-dir read back what it computed
// (any subset of the registry's tensors and gradients, with its precision, scan mode and layout
// declared) and judge each tensor with compare's rule; the report and the JSON are compare's,
// plus the tensors not provided. Exit status: 0 all judged tensors pass, 1 some fail, 2 bad
// usage or bad input (one line "m3h judge: error: …" on stderr).
#include <filesystem>
#include <iostream>
#include <new>
#include <stdexcept>

#include "cli.hpp"
#include "commands.hpp"
#include "device.hpp"
#include "error.hpp"
#include "golden.hpp"
#include "json.hpp"
#include "judge.hpp"
#include "report_json.hpp"

namespace m3::tools {

namespace {

const char* kSummary =
    "Judges the tensors that ANOTHER implementation computed on a golden case's problem (its\n"
    "weights, input, output gradient and entering states): each one it provides, named as in\n"
    "MODEL.md sec. 10 (norm_f/Out, L0/F6/y, grad/L0/in_proj_w, L0/states/ssm_state, ...), is\n"
    "compared with the golden file's stored double oracle by m3h compare's rule for a subject\n"
    "with a same-precision baseline: err <= max(k*emulation, kp*perturbed) + floor, rel_l2 and\n"
    "max_abs, where emulation = our float reference at the subject's precision and perturbed =\n"
    "the perturbed oracle (the error the tensor's conditioning forces). One table in chain order,\n"
    "the tensors not provided, and a summary naming the first failing stage.\n\n"
    "Subject file (HARNESS.md sec. 10): HDF5 with /meta attributes format=m3h-subject,\n"
    "format_version=1, precision (f32|bf16|f16), scan_mode (seq|chunked), optional implementation\n"
    "and linear_layout (in_out | out_in: PyTorch [out, in] Linear weight gradients), and\n"
    "/tensors/<key> datasets; or a folder (--subject-dir) with meta.json and <key>.npy files.\n"
    "Layouts are declared, never guessed: a transposed weight gradient without the declaration\n"
    "is an error (or, when square, a failure).\n\n"
    "--export-problem DIR writes the golden case's problem for the other implementation:\n"
    "problem.json (config, B, T, scan modes, conventions, array shapes) and weights/..., inputs/...\n"
    ".npy files (float64, our layouts; numpy.load reads them).\n\n"
    "Exit status: 0 every provided tensor within budget, 1 some budget exceeded, 2 bad usage or\n"
    "bad input.\n\n"
    "Examples:\n"
    "  m3h judge --golden golden/cases/official_small.h5 --export-problem /tmp/p\n"
    "  m3h judge --golden golden/cases/official_small.h5 --subject-dir out/bf16 --json out/bf16.json\n"
    "  m3h judge --golden G.h5 --subject S.h5 --failures-only";

int run(const std::vector<std::string>& args) {
  po::options_description desc("Judge");
  // clang-format off
  desc.add_options()
    ("help,h", "this help")
    ("golden", po::value<std::string>(), "the golden case FILE.h5 whose problem the subject ran (its oracle is the yardstick)")
    ("subject", po::value<std::string>(), "the subject: an HDF5 file of the other implementation's tensors")
    ("subject-dir", po::value<std::string>(), "the subject as a folder: meta.json and <key>.npy files")
    ("export-problem", po::value<std::string>(), "write the golden case's problem to folder DIR (problem.json, .npy files) and stop")
    ("json", po::value<std::string>(), "also write the report as JSON to FILE (compare's schema plus \"judge\"; atomic; an existing file only with --force)")
    ("force", po::bool_switch(), "replace an existing --json file or --export-problem folder")
    ("failures-only", po::bool_switch(), "table rows only for failing tensors")
    ("details", po::bool_switch(), "a worst-element line for every tensor")
    ("wide", po::bool_switch(), "cells with max_abs, rel_l2, p95_rel and %budget");
  // clang-format on
  const po::variables_map vm = parse_args(args, desc, "judge");
  if (vm.count("help")) {
    print_command_help("judge", kSummary, desc);
    return 0;
  }
  if (!vm.count("golden")) throw UsageError("--golden FILE is required (the case the subject ran)");
  const int n_actions = static_cast<int>(vm.count("subject") + vm.count("subject-dir") +
                                         vm.count("export-problem"));
  if (n_actions != 1)
    throw UsageError("give exactly one of --subject FILE, --subject-dir DIR and --export-problem DIR");
  for (const char* o : {"subject", "subject-dir", "export-problem"})
    if (vm.count(o) && vm[o].as<std::string>().empty())
      throw UsageError(std::string("--") + o + ": an empty name");
  const bool force = vm["force"].as<bool>();
  const std::string golden_path = vm["golden"].as<std::string>();

  if (vm.count("export-problem")) {
    for (const char* o : {"json", "failures-only", "details", "wide"})
      if (option_given(vm, o)) throw UsageError(std::string("--") + o + ": not with --export-problem");
    const golden::GoldenCase g = golden::read_golden(golden_path);
    const std::string dir = vm["export-problem"].as<std::string>();
    harness::export_problem(g, golden_path, dir, force);
    std::cout << "m3h judge: wrote the problem of golden case " << g.name << " to "
              << echo(dir, 400) << " (problem.json, weights/, inputs/)\n";
    return 0;
  }

  const bool h5 = vm.count("subject") > 0;
  const std::string subject_path = vm[h5 ? "subject" : "subject-dir"].as<std::string>();
  if (vm.count("json")) {  // before the run, not after it
    check_output_path(vm, "json", force);
    std::error_code ec;
    if (std::filesystem::equivalent(vm["json"].as<std::string>(), subject_path, ec))
      throw UsageError("--json " + vm["json"].as<std::string>() + ": is the run's subject; choose another name");
  }
  const golden::GoldenCase g = golden::read_golden(golden_path);
  harness::Subject s = h5 ? harness::read_subject_h5(subject_path) : harness::read_subject_dir(subject_path);
  const harness::Judgement j = harness::judge_subject(g, golden_path, std::move(s));

  harness::ReportOptions ropt;
  ropt.failures_only = vm["failures-only"].as<bool>();
  ropt.details = vm["details"].as<bool>();
  ropt.wide = vm["wide"].as<bool>();
  harness::print_judgement(std::cout, j, ropt);
  if (vm.count("json")) {
    harness::RunInfo info;
    info.command_line = command_line("judge", args);
    info.cpu = harness::cpu_model();
    info.gpu = "";
    info.cuda = gpu::cuda_compiled();
    const std::string path = vm["json"].as<std::string>();
    harness::write_file_atomic(path, harness::judgement_json(j, info));
    std::cout << json_written_line(path, j.comparison.cells.size(), j.comparison.n_checks()) << "\n";
  }
  return j.pass() ? 0 : 1;
}

}  // namespace

int cmd_judge(const std::vector<std::string>& args) {
  // Bad input is one line with the command's prefix; a failing run is exit 1, not an error.
  try {
    return run(args);
  } catch (const std::bad_alloc&) {
    throw;
  } catch (const std::length_error&) {
    throw;
  } catch (const std::exception& e) {
    std::cerr << "m3h judge: error: " << echo(e.what(), 400) << "\n";
    return 2;
  }
}

}  // namespace m3::tools
