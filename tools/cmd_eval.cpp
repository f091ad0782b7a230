// m3h eval: the validation loss and accuracy of a checkpoint of m3h train on a text file, a
// task, or the task it was trained on (train/evaluate.hpp has the rules); option parsing and
// the report only.
//
//   m3h eval --checkpoint FILE|RUN [--data FILE ... | --task NAME [--task-opt k=v ...]]
//            [--B B] [--T T] [--batches N] [--val-fraction f] [--device auto] [--json FILE|-]
//
// Prints one line: what was evaluated and the loss, the token accuracy and (parity, modular)
// the sequence accuracy. --json writes the same as a JSON object (atomically; "-": stdout, the
// line then on stderr). Exit status: 0 done, 2 bad usage or bad input.
#include <cstdio>
#include <iostream>

#include "cli.hpp"
#include "commands.hpp"
#include "evaluate.hpp"
#include "json.hpp"
#include "run_dir.hpp"

namespace m3::tools {

namespace {

const char* kSummary =
    "Evaluates a checkpoint of m3h train: the loss and accuracy of its weights (in its\n"
    "precision and scan mode, forward only) on the validation batches of some data: --data\n"
    "FILE (text; several are concatenated; the held-out end as training holds it out, the\n"
    "checkpoint's --val-fraction unless given), --task NAME (with --task-opt), or neither: the\n"
    "task the checkpoint was trained on. --B, --T: the checkpoint's unless given; --batches\n"
    "validation batches (default 8, as m3h train's --val-batches). With the checkpoint's own\n"
    "data, B, T and batch count this is the run's \"val loss\".\n"
    "Exit status: 0 done, 2 bad usage or bad input.";

std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

}  // namespace

int cmd_eval(const std::vector<std::string>& args) {
  po::options_description d("Evaluation");
  // clang-format off
  d.add_options()
    ("help,h", "this help")
    ("checkpoint", po::value<std::string>(), "a checkpoint of m3h train, or a run folder (its latest checkpoint)")
    ("data", po::value<std::vector<std::string>>()->composing(), "text file(s), concatenated in the order given")
    ("val-fraction", po::value<double>(), "with --data: the held-out end's fraction (default: the checkpoint's, else 0.05)")
    ("task", po::value<std::string>(), "a synthetic task: parity, modular, selective-copy")
    ("task-opt", po::value<std::vector<std::string>>()->composing(), "a task option key=value (repeatable)")
    ("B", po::value<Idx>(), "rows per batch (default: the checkpoint's)")
    ("T", po::value<Idx>(), "sequence length (default: the checkpoint's)")
    ("batches", po::value<Idx>()->default_value(8), "validation batches")
    ("device", po::value<std::string>()->default_value("auto"), "gpu, cpu, or auto (gpu when present, else cpu with a note on stderr)")
    ("json", po::value<std::string>(), "also write the result as JSON to FILE (atomic; an existing file only with --force), or to stdout with '-'")
    ("force", po::bool_switch(), "replace an existing --json file");
  // clang-format on
  const po::variables_map vm = parse_args(args, d, "eval");
  if (vm.count("help")) {
    print_command_help("eval", kSummary, d);
    return 0;
  }
  if (!vm.count("checkpoint"))
    throw UsageError("eval: --checkpoint FILE (or a run folder) is required");
  if (vm.count("data") && vm.count("task"))
    throw UsageError("eval: give --data FILE or --task NAME, not both");
  if (vm.count("task-opt") && !vm.count("task"))
    throw UsageError("eval: --task-opt is for --task");
  if (vm.count("val-fraction") && !vm.count("data"))
    throw UsageError("eval: --val-fraction is for --data");
  const bool json_out = vm.count("json") != 0;
  const bool json_stdout = json_out && vm["json"].as<std::string>() == "-";
  if (json_out) check_output_path(vm, "json", vm["force"].as<bool>());
  train::EvalOptions o;
  o.checkpoint = train::resolve_checkpoint(vm["checkpoint"].as<std::string>(), "--checkpoint");
  if (vm.count("data")) o.data = vm["data"].as<std::vector<std::string>>();
  if (vm.count("val-fraction")) o.val_fraction = vm["val-fraction"].as<double>();
  if (vm.count("task")) o.task = vm["task"].as<std::string>();
  if (vm.count("task-opt"))
    for (const std::string& kv : vm["task-opt"].as<std::vector<std::string>>()) {
      const auto eq = kv.find('=');
      if (eq == std::string::npos || eq == 0)
        throw UsageError("--task-opt '" + echo(kv) + "': expected key=value");
      o.task_options.push_back({kv.substr(0, eq), kv.substr(eq + 1)});
    }
  for (const char* k : {"B", "T"})
    if (vm.count(k) && vm[k].as<Idx>() < 1)
      throw UsageError(std::string("--") + k + " must be >= 1");
  if (vm.count("B")) o.B = vm["B"].as<Idx>();
  if (vm.count("T")) o.T = vm["T"].as<Idx>();
  o.batches = vm["batches"].as<Idx>();
  if (o.batches < 1) throw UsageError("--batches must be >= 1");
  o.device = resolve_device(vm["device"].as<std::string>(), "evaluating on the CPU reference");

  const train::EvalReport r = train::evaluate_checkpoint(o);
  std::string line = "m3h eval: " + echo(o.checkpoint, 200) + " (step " + std::to_string(r.meta.step) +
                     ") on " + r.data + ", " + std::to_string(r.batches) + " batches of " +
                     std::to_string(r.B) + "x" + std::to_string(r.T) + " (" + o.device + ", " +
                     precision_name(r.storage) + ", " + scan_mode_name(r.mode) + "): loss " +
                     fixed(r.result.loss, 4) + ", accuracy " +
                     fixed(100 * r.result.acc.token(), 2) + " %";
  if (r.sequences) line += " (sequences " + fixed(100 * r.result.acc.sequence(), 2) + " %)";
  (json_stdout ? std::cerr : std::cout) << line << "\n";
  if (json_out) {
    harness::Json j;
    j.begin_object();
    j.key("schema").str("m3h-eval/1");
    j.key("checkpoint").str(o.checkpoint);
    j.key("step").num(static_cast<std::int64_t>(r.meta.step));
    j.key("data").str(r.data);
    j.key("device").str(o.device);
    j.key("precision").str(precision_name(r.storage));
    j.key("scan").str(scan_mode_name(r.mode));
    j.key("B").num(static_cast<std::int64_t>(r.B));
    j.key("T").num(static_cast<std::int64_t>(r.T));
    j.key("batches").num(static_cast<std::int64_t>(r.batches));
    j.key("scored_positions").num(static_cast<std::int64_t>(r.result.acc.tokens));
    j.key("loss").num(r.result.loss);
    j.key("accuracy").num(r.result.acc.token());
    j.key("sequence_accuracy");
    if (r.sequences) j.num(r.result.acc.sequence());
    else j.null();
    j.end_object();
    if (json_stdout) std::cout << j.text() << "\n";
    else harness::write_file_atomic(vm["json"].as<std::string>(), j.text());
  }
  return 0;
}

}  // namespace m3::tools
