// m3h train and m3h sample (TRAINING.md §4–§7): option parsing only; the loop, the data, the
// checkpoints and the sampler live in train/ (trainer.hpp).
//
// train: the model config (MODEL.md names), the data (--data FILE or --task NAME with
// --task-opt key=value), the optimizer, the run directory (--out) and its schedule of
// validations, checkpoints and logs. Every option can come from a --config file (the run's
// config.txt is one: `m3h train --config RUN/config.txt` starts the same run again).
// sample: --checkpoint FILE --prompt TEXT --tokens N [--temperature τ] [--top-k k] [--seed s].
// Exit status: 0 done, 1 stopped by a failure (non-finite loss or gradient), 2 bad usage or bad
// input, 130 interrupted (a checkpoint was written).
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "checkpoint.hpp"
#include "cli.hpp"
#include "commands.hpp"
#include "data.hpp"
#include "parallel.hpp"
#include "run_dir.hpp"
#include "error.hpp"
#include "terminal.hpp"
#include "trainer.hpp"

namespace m3::tools {

using train::Settings;

namespace {

const char* kTrainSummary =
    "Trains a Mamba-3 language model (token embedding, the backbone, a head, softmax\n"
    "cross-entropy) with AdamW on byte-level text (--data FILE; scripts/fetch-jargon.sh fetches\n"
    "the Jargon File) or a synthetic task (--task parity|modular|selective-copy). Writes\n"
    "config.txt, metrics.csv, checkpoints ckpt-<step>.h5 and loss.png into --out.\n"
    "--resume RUN (a run folder: its latest checkpoint; or a checkpoint file) continues\n"
    "bit-exactly with the run's own options (its config.txt) in its own folder; a larger\n"
    "--steps extends it (the learning rate follows the longer schedule from there); a finished\n"
    "run is refused (exit 1). On a terminal one updating line shows the progress, fitted to\n"
    "the terminal's width; otherwise a plain line every --log-every steps. Ctrl-C writes a\n"
    "checkpoint and exits 130. Several GPUs: --gpus G in one process, or one process per GPU\n"
    "with --nccl-id-file (TRAINING.md §8); --B is the global batch either way.\n"
    "Exit status: 0 done, 1 stopped (non-finite loss or gradient) or nothing to resume, 2 bad\n"
    "usage or bad input, 130 interrupted.";

// The options a config file may set (all but config, resume and force); train's config.txt.
void add_train_fields(po::options_description& d) {
  // clang-format off
  d.add_options()
    ("d-model", po::value<Idx>()->default_value(128), "d_model")
    ("d-state", po::value<Idx>()->default_value(32), "d_state")
    ("headdim", po::value<Idx>()->default_value(32), "headdim")
    ("expand", po::value<Idx>()->default_value(2), "expand (d_inner = expand*d_model)")
    ("ngroups", po::value<Idx>()->default_value(1), "ngroups")
    ("layers", po::value<Idx>()->default_value(2), "n_layers")
    ("rope-fraction", po::value<double>()->default_value(0.5, "0.5"), "rope_fraction (0.5 or 1.0); num_rope_angles = floor(floor(d_state*rope_fraction)/2), so e.g. d_state 3 gives 1 angle with 1.0 and none (a real-valued state) with 0.5")
    ("outproj-norm", po::value<bool>()->default_value(false)->implicit_value(true), "gated RMSNorm before out_proj")
    ("chunk-size", po::value<Idx>()->default_value(64), "chunk size of the chunked scan")
    ("data", po::value<std::vector<std::string>>()->composing(), "byte-level text file (V = 256); repeatable: the files are concatenated in the order given, nothing between them (the validation part is the end of the last)")
    ("val-fraction", po::value<double>()->default_value(0.05, "0.05"), "the last fraction of --data held out for validation")
    ("task", po::value<std::string>(), "synthetic task: parity, modular, selective-copy")
    ("task-opt", po::value<std::vector<std::string>>()->composing(), "a task option key=value (parity: n_min, n_max; modular: m, n_min, n_max; selective-copy: K, alphabet); repeatable")
    ("eval-len", po::value<Idx>()->default_value(0), "tasks: also report accuracy at this longer length at the end")
    ("B", po::value<Idx>()->default_value(8), "micro-batch rows (the global batch: data-parallel ranks take B/G rows each)")
    ("T", po::value<Idx>()->default_value(256), "sequence length")
    ("steps", po::value<Idx>()->default_value(1000), "optimizer steps")
    ("grad-accum", po::value<Idx>()->default_value(1), "micro-batches per step (gradients summed in order)")
    ("lr", po::value<double>()->default_value(3e-3, "3e-3"), "peak learning rate")
    ("warmup", po::value<Idx>(), "linear warmup steps (default 100, or a tenth of --steps when the run is shorter than 100 steps, with a note; a --warmup longer than --steps is refused)")
    ("min-lr-ratio", po::value<double>()->default_value(0.1, "0.1"), "the cosine ends at lr * this")
    ("wd", po::value<double>()->default_value(0.1, "0.1"), "AdamW decoupled weight decay (in_proj_w, out_proj_w, head_w)")
    ("beta1", po::value<double>()->default_value(0.9, "0.9"), "AdamW beta1")
    ("beta2", po::value<double>()->default_value(0.95, "0.95"), "AdamW beta2")
    ("eps", po::value<double>()->default_value(1e-8, "1e-8"), "AdamW epsilon")
    ("clip", po::value<double>()->default_value(1.0, "1.0"), "global gradient-norm clip (0 = off)")
    ("dtype", po::value<std::string>()->default_value("bf16"), "storage precision, one of f32, bf16, f16 (f16: dynamic loss scaling)")
    ("scan", po::value<std::string>()->default_value("chunked"), "scan mode: seq or chunked")
    ("recompute", po::value<std::string>()->default_value("none"), "GPU memory policy: none or scan")
    ("device", po::value<std::string>()->default_value("auto"), "gpu, cpu (the float reference: small models, CI), or auto (gpu when present, else cpu with a note on stderr)")
    ("seed", po::value<std::string>()->default_value("0"), "seed of the weights and the batches")
    ("out", po::value<std::string>(), "run directory")
    ("ckpt-every", po::value<Idx>()->default_value(0), "checkpoint every N steps (0: only the final one)")
    ("keep", po::value<Idx>()->default_value(3), "checkpoints kept (plus the final one)")
    ("val-every", po::value<Idx>(), "validation every N steps and at the end (default: a twentieth of --steps, at least 1, so that loss.png has a validation curve; 0: at the end only)")
    ("val-batches", po::value<Idx>()->default_value(8), "validation batches (fixed for the run)")
    ("log-every", po::value<Idx>()->default_value(10), "a plain log line every N steps (not on a terminal)")
    ("verify-every", po::value<Idx>()->default_value(0), "every N steps, judge the GPU path with the live weights against the double oracle (--verify-oracle); a failure stops the run (exit 1) naming the failing tensors; the summary says what the checks cost (0: never)")
    ("verify-oracle", po::value<std::string>()->default_value("cpu"), "what --verify-every judges: cpu (a slice of the live batch, row 0 and T <= 256, against the Eigen oracle with the same-precision emulation as baseline) or gpu (the whole live batch at the run's shape against the GPU oracle, m3h compare --oracle gpu; its rule underestimates rounding that is correlated across repeated values: docs/TRAINING.md section 6)")
    ("step-times", po::bool_switch(), "GPU, one process: time each step's forward (its uploads apart), backward and optimizer on the device (CUDA events, no added synchronisation); print their medians at the end, with the step's period and the device time outside them, and write every step's to step_times.csv and step_times.png")
    ("stage-times", po::bool_switch(), "GPU, one process: the backbone's stage profile over the steps after the first three (an event after every stage, a wait at the end of every pass) and a table of ms per step and stage at the end, to set beside m3h bench --profile's; not with --step-times");
  // clang-format on
}

}  // namespace

po::options_description train_fields() {
  po::options_description d("Training (also in a --config file)");
  add_train_fields(d);
  return d;
}

namespace {

Idx positive(const po::variables_map& vm, const char* name, Idx min) {
  const Idx v = vm[name].as<Idx>();
  if (v < min)
    throw UsageError("--" + std::string(name) + " must be >= " + std::to_string(min) + " (got " +
                     std::to_string(v) + ")");
  return v;
}

// The resolved options as a config file (every field, defaults included), loadable with
// --config. `resolved`: the values of fields whose default follows other options (warmup,
// val-every), as the run uses them.
std::string config_text(const po::variables_map& vm, const po::options_description& fields,
                        const std::vector<std::pair<std::string, Idx>>& resolved) {
  std::ostringstream os;
  os << "# m3h train: the resolved options of this run (load with --config)\n";
  for (const auto& opt : fields.options()) {
    const std::string name = opt->long_name();
    bool done = false;
    for (const auto& [key, value] : resolved)
      if (key == name) {
        os << name << " = " << value << "\n";
        done = true;
      }
    if (done || !vm.count(name)) continue;
    if (name == "val-fraction" && vm.count("task")) continue;  // text data only
    const boost::any& v = vm[name].value();
    if (const auto* s = boost::any_cast<std::string>(&v)) {
      os << name << " = " << *s << "\n";
    } else if (const auto* i = boost::any_cast<Idx>(&v)) {
      os << name << " = " << *i << "\n";
    } else if (const auto* d = boost::any_cast<double>(&v)) {
      os << name << " = " << train::exact_double(*d) << "\n";
    } else if (const auto* b = boost::any_cast<bool>(&v)) {
      os << name << " = " << (*b ? "true" : "false") << "\n";
    } else if (const auto* l = boost::any_cast<std::vector<std::string>>(&v)) {
      for (const auto& e : *l) os << name << " = " << e << "\n";
    }
  }
  return os.str();
}

// --init: the model options not given take the checkpoint's values; one given must agree.
void init_model_options(const po::variables_map& vm, const std::string& path, Config& c) {
  Config ck;
  train::read_checkpoint(path, &ck, nullptr);
  const Settings mine = train::config_settings(c), theirs = train::config_settings(ck);
  const std::pair<const char*, const char*> options[] = {
      {"d-model", "d_model"}, {"d-state", "d_state"},     {"headdim", "headdim"},
      {"expand", "expand"},   {"ngroups", "ngroups"},     {"layers", "n_layers"},
      {"rope-fraction", "rope_fraction"}, {"outproj-norm", "is_outproj_norm"},
      {"chunk-size", "chunk_size"}};
  for (const auto& [option, field] : options) {
    if (!option_given(vm, option)) continue;
    for (std::size_t i = 0; i < mine.size(); ++i)
      if (mine[i].first == field && mine[i].second != theirs[i].second)
        throw UsageError("train: --" + std::string(option) + " " + mine[i].second +
                         " differs from the --init checkpoint's " + theirs[i].second);
  }
  auto keep = [&](const char* option, auto& member, const auto& value) {
    if (!option_given(vm, option)) member = value;
  };
  keep("d-model", c.d_model, ck.d_model);
  keep("d-state", c.d_state, ck.d_state);
  keep("headdim", c.headdim, ck.headdim);
  keep("expand", c.expand, ck.expand);
  keep("ngroups", c.ngroups, ck.ngroups);
  keep("layers", c.n_layers, ck.n_layers);
  keep("rope-fraction", c.rope_fraction, ck.rope_fraction);
  keep("outproj-norm", c.is_outproj_norm, ck.is_outproj_norm);
  keep("chunk-size", c.chunk_size, ck.chunk_size);
}

Settings task_options(const po::variables_map& vm) {
  Settings out;
  if (!vm.count("task-opt")) return out;
  for (const std::string& kv : vm["task-opt"].as<std::vector<std::string>>()) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0)
      throw UsageError("--task-opt '" + echo(kv) + "': expected key=value");
    out.push_back({kv.substr(0, eq), kv.substr(eq + 1)});
  }
  return out;
}

// What `--resume PATH` names: the checkpoint (a run folder's latest) and the run folder that
// holds it, whose config.txt gives the run's options.
struct ResumeTarget {
  std::string checkpoint, run;
};
ResumeTarget resume_target(const std::string& given) {
  ResumeTarget t;
  t.checkpoint = train::resolve_checkpoint(given, "--resume");
  t.run = std::filesystem::path(t.checkpoint).parent_path().string();
  if (t.run.empty()) t.run = ".";
  return t;
}

}  // namespace

int cmd_train(const std::vector<std::string>& given_args) {
  const po::options_description fields = train_fields();
  po::options_description run("Run");
  // clang-format off
  run.add_options()
    ("help,h", "this help")
    ("config", po::value<std::string>(), "a config file of the options above (a run's config.txt)")
    ("resume", po::value<std::string>(), "continue a run: RUN (a run folder: its latest checkpoint) or a checkpoint file; the run's config.txt gives every option not on the command line, its folder is --out; every setting must match, but a larger --steps extends the run")
    ("init", po::value<std::string>(), "start a new run from this checkpoint's weights (e.g. one of m3h import): fresh AdamW moments, step 0, the schedule from its start; the model options default to the checkpoint's")
    ("force", po::bool_switch(), "start over in an --out that holds another run");
  po::options_description par("Data parallelism (TRAINING.md §8; not part of a run's settings: a checkpoint resumes with any rank count)");
  par.add_options()
    ("gpus", po::value<int>()->default_value(1), "ranks of this process: GPUs 0..G-1, a thread each, gradients summed in rank order through NCCL copies, AdamW sharded (ZeRO-1); --B splits evenly. With --device cpu: G reference ranks exchanging through host memory (the same arithmetic, for tests)")
    ("nccl-id-file", po::value<std::string>(), "one process per GPU (the path past one host): rank 0 writes NCCL's id to this file (it must not exist), the others read it; needs the rank and world size")
    ("rank", po::value<int>(), "with --nccl-id-file: this process's rank (default: the launcher's M3_RANK, RANK, OMPI_COMM_WORLD_RANK or SLURM_PROCID)")
    ("world-size", po::value<int>(), "with --nccl-id-file: the job's ranks (default: M3_WORLD_SIZE, WORLD_SIZE, OMPI_COMM_WORLD_SIZE or SLURM_NTASKS)")
    ("local-device", po::value<int>(), "with --nccl-id-file: this process's GPU (default: the launcher's local rank, else rank % GPUs)")
    ("id-timeout", po::value<double>()->default_value(300, "300"), "with --nccl-id-file: seconds a rank > 0 waits for the id file");
  // clang-format on
  po::options_description all;
  all.add(fields).add(run).add(par);
  // --resume RUN_OR_CHECKPOINT alone is enough: the run's config.txt supplies every option the
  // command line does not give (as --config would), and the checkpoint's folder is the --out.
  std::vector<std::string> args = given_args;
  ResumeTarget resume;
  {
    po::variables_map line;
    po::store(po::command_line_parser(given_args)
                  .options(all)
                  .style(po::command_line_style::default_style &
                         ~po::command_line_style::allow_guessing)
                  .run(),
              line);
    const std::string given = line.count("resume") ? line["resume"].as<std::string>() : "";
    const bool wanted = !given.empty() && !line.count("help");
    std::error_code ec;
    const bool exists = std::filesystem::exists(given, ec);
    // A path that does not exist: with --out the run folder's own checks come first (a live
    // run's lock, then the missing file); without --out nothing names the run.
    if (wanted && !exists && !line.count("out"))
      throw UsageError("--resume " + echo(given, 200) + ": no such checkpoint or run folder");
    if (wanted && !exists) resume.checkpoint = given;
    if (wanted && exists) {
      resume = resume_target(given);
      const std::string config = (std::filesystem::path(resume.run) / "config.txt").string();
      if (!line.count("config") && std::filesystem::is_regular_file(config, ec))
        args.insert(args.end(), {"--config", config});
      else if (!line.count("config") && !line.count("data") && !line.count("task"))
        throw UsageError("--resume " + echo(given, 200) + ": the run's options are unknown (no " +
                         "config.txt in " + echo(resume.run, 200) + "); give them, or --config FILE");
      if (!line.count("out")) args.insert(args.end(), {"--out", resume.run});
    }
  }
  const po::variables_map vm = parse_args(args, all, "train", &fields);
  if (vm.count("help")) {
    print_command_help("train", kTrainSummary, all);
    return 0;
  }
  if (!vm.count("out")) throw UsageError("train: --out DIR is required (the run directory)");
  if (vm.count("data") == vm.count("task"))
    throw UsageError("train: give exactly one of --data FILE and --task NAME");
  if (vm.count("task") && option_given(vm, "val-fraction"))
    throw UsageError("train: --val-fraction is for --data (a task's validation batches are drawn)");
  if (vm.count("data") && vm.count("task-opt"))
    throw UsageError("train: --task-opt is for --task (not --data)");
  {
    // One rule for every output of m3h: the folder that holds it must exist (train creates the
    // run folder itself, not its parents).
    std::string out = vm["out"].as<std::string>();
    while (out.size() > 1 && out.back() == '/') out.pop_back();
    const std::filesystem::path parent = std::filesystem::path(out).parent_path();
    std::error_code ec;
    if (!parent.empty() && !std::filesystem::is_directory(parent, ec))
      throw UsageError("--out " + vm["out"].as<std::string>() + ": folder " + parent.string() +
                       " does not exist");
  }
  if (vm.count("resume") && vm["force"].as<bool>())
    throw UsageError("train: --resume and --force contradict each other");
  if (vm.count("resume") && vm.count("init"))
    throw UsageError("train: --resume continues a run, --init starts one from a checkpoint's "
                     "weights: give one of them");
  train::TrainOptions o;
  Config& c = o.cfg;
  c.d_model = positive(vm, "d-model", 1);
  c.d_state = positive(vm, "d-state", 1);
  c.headdim = positive(vm, "headdim", 1);
  c.expand = positive(vm, "expand", 1);
  c.ngroups = positive(vm, "ngroups", 1);
  c.n_layers = positive(vm, "layers", 1);
  c.rope_fraction = vm["rope-fraction"].as<double>();
  c.is_outproj_norm = vm["outproj-norm"].as<bool>();
  c.chunk_size = positive(vm, "chunk-size", 1);
  if (vm.count("init")) init_model_options(vm, vm["init"].as<std::string>(), c);
  if (vm.count("data")) o.data = vm["data"].as<std::vector<std::string>>();
  o.val_fraction = vm["val-fraction"].as<double>();
  if (vm.count("task")) o.task = vm["task"].as<std::string>();
  o.task_options = task_options(vm);
  o.eval_len = positive(vm, "eval-len", 0);
  o.B = positive(vm, "B", 1);
  o.T = positive(vm, "T", 1);
  o.optim.steps = positive(vm, "steps", 1);
  o.grad_accum = positive(vm, "grad-accum", 1);
  o.optim.lr = vm["lr"].as<double>();
  // The warmup: a given one must fit the run; the default (100) is cut to a tenth of a shorter
  // run, saying so (a warmup as long as the run would peak the learning rate at its end).
  std::string warmup_note;
  if (vm.count("warmup")) {
    o.optim.warmup = positive(vm, "warmup", 0);
    if (o.optim.warmup > o.optim.steps)
      throw UsageError("train: --warmup " + std::to_string(o.optim.warmup) +
                       " is longer than the run (--steps " + std::to_string(o.optim.steps) +
                       "); give --warmup <= " + std::to_string(o.optim.steps));
  } else {
    o.optim.warmup = 100;
    if (o.optim.warmup > o.optim.steps) {
      o.optim.warmup = std::max<Idx>(1, o.optim.steps / 10);
      warmup_note = "train: warmup " + std::to_string(o.optim.warmup) +
                    " step(s), a tenth of the run: the default --warmup 100 is longer than --steps " +
                    std::to_string(o.optim.steps);
    }
  }
  o.optim.min_lr_ratio = vm["min-lr-ratio"].as<double>();
  o.optim.wd = vm["wd"].as<double>();
  o.optim.beta1 = vm["beta1"].as<double>();
  o.optim.beta2 = vm["beta2"].as<double>();
  o.optim.eps = vm["eps"].as<double>();
  o.optim.clip = vm["clip"].as<double>();
  const std::vector<Precision> dt = parse_dtype_list(vm["dtype"].as<std::string>());
  if (dt.size() != 1) throw UsageError("train: --dtype takes one precision (f32, bf16 or f16)");
  o.storage = dt[0];
  const std::vector<ScanMode> sm = parse_scan_list(vm["scan"].as<std::string>());
  if (sm.size() != 1) throw UsageError("train: --scan takes one mode (seq or chunked)");
  o.mode = sm[0];
  o.recompute = parse_recompute(vm["recompute"].as<std::string>());
  o.device = resolve_device(vm["device"].as<std::string>(),
                            "training on the CPU reference (float; small models)");
  o.seed = parse_seed(vm["seed"].as<std::string>());
  o.out = vm["out"].as<std::string>();
  o.force = vm["force"].as<bool>();
  if (vm.count("resume")) o.resume = resume.checkpoint;
  if (vm.count("init")) o.init = vm["init"].as<std::string>();
  o.ckpt_every = positive(vm, "ckpt-every", 0);
  o.keep = positive(vm, "keep", 1);
  o.val_every = vm.count("val-every") ? positive(vm, "val-every", 0)
                                      : std::max<Idx>(1, o.optim.steps / 20);
  o.val_batches = positive(vm, "val-batches", 0);
  o.log_every = positive(vm, "log-every", 1);
  o.verify_every = positive(vm, "verify-every", 0);
  o.verify_oracle = vm["verify-oracle"].as<std::string>();
  if (o.verify_oracle != "cpu" && o.verify_oracle != "gpu")
    throw UsageError("--verify-oracle '" + o.verify_oracle + "': expected cpu or gpu");
  o.step_times = vm["step-times"].as<bool>();
  o.stage_times = vm["stage-times"].as<bool>();
  o.config_text = config_text(vm, fields, {{"warmup", o.optim.warmup}, {"val-every", o.val_every}});
  if (vm.count("init"))  // not an option of the file: the run's record of where it started
    o.config_text += "# started from the weights of --init " + o.init + "\n";
  o.tty = isatty(1) != 0;
  o.width = harness::terminal_columns(1);
  o.par.gpus = vm["gpus"].as<int>();
  if (o.par.gpus < 1)
    throw UsageError("train: --gpus must be >= 1 (got " + std::to_string(o.par.gpus) + ")");
  const bool job = vm.count("nccl-id-file") != 0;
  for (const char* k : {"rank", "world-size", "local-device"})
    if (vm.count(k) && !job)
      throw UsageError(std::string("train: --") + k +
                       " is for a job of one process per GPU (give --nccl-id-file)");
  if (job) {
    o.par.nccl_id_file = vm["nccl-id-file"].as<std::string>();
    o.par.rank = vm.count("rank") ? vm["rank"].as<int>() : -1;
    if (vm.count("world-size")) o.par.world = vm["world-size"].as<int>();
    if (vm.count("local-device")) o.par.device = vm["local-device"].as<int>();
    o.par.id_timeout_s = vm["id-timeout"].as<double>();
    train::fill_from_launcher_env(o.par, vm.count("rank") != 0);
    if (o.par.world < 1)
      throw UsageError(
          "train: --nccl-id-file needs the job's size: --world-size, or a launcher's "
          "WORLD_SIZE / OMPI_COMM_WORLD_SIZE / SLURM_NTASKS");
    if (o.par.rank < 0 || o.par.rank >= o.par.world)
      throw UsageError("train: --nccl-id-file needs this process's rank in 0.." +
                       std::to_string(o.par.world - 1) +
                       ": --rank, or a launcher's RANK / OMPI_COMM_WORLD_RANK / SLURM_PROCID");
  }
  if (!warmup_note.empty())
    std::cout << (o.tty ? harness::wrap_words(warmup_note, o.width, 2) : warmup_note) << "\n";
  try {
    return train::run_training(o, std::cout);
  } catch (const train::RunFinished& e) {
    std::cerr << "m3h train: " << echo(o.resume, 200) << ": " << e.failed() << " (" << e.why()
              << ")\n";
    return 1;
  }
}

namespace {
const char* kSampleSummary =
    "Generates text from a checkpoint: the prompt runs through one forward (the checkpoint's scan\n"
    "mode), then each new token runs as a T = 1 step carrying the recurrent states. Prints the\n"
    "prompt and the continuation (for a task, in its spelling); on a terminal control characters\n"
    "are shown as \\xNN (--raw: the bytes as generated; a pipe or a file always gets them raw).\n"
    "Exit status: 0 done, 2 bad usage or bad input.";
}

int cmd_sample(const std::vector<std::string>& args) {
  po::options_description d("Sampling");
  // clang-format off
  d.add_options()
    ("help,h", "this help")
    ("checkpoint", po::value<std::string>(), "a checkpoint of m3h train, or a run folder (its latest checkpoint)")
    ("prompt", po::value<std::string>(), "the prompt (text: bytes, default a newline; a task: its spelling, default the first token of the task's first validation sequence)")
    ("tokens", po::value<Idx>()->default_value(200), "tokens to generate")
    ("temperature", po::value<double>()->default_value(0.8, "0.8"), "softmax temperature (0 = greedy)")
    ("top-k", po::value<Idx>()->default_value(0), "sample among the k most likely tokens (0 = all)")
    ("seed", po::value<std::string>()->default_value("0"), "seed of the sampling")
    ("device", po::value<std::string>()->default_value("auto"), "gpu, cpu, or auto")
    ("raw", po::bool_switch(), "write the generated bytes as they are even to a terminal (by default a terminal gets control characters as \\xNN)");
  // clang-format on
  const po::variables_map vm = parse_args(args, d, "sample");
  if (vm.count("help")) {
    print_command_help("sample", kSampleSummary, d);
    return 0;
  }
  if (!vm.count("checkpoint"))
    throw UsageError("sample: --checkpoint FILE (or a run folder) is required");
  train::SampleOptions o;
  o.checkpoint = train::resolve_checkpoint(vm["checkpoint"].as<std::string>(), "--checkpoint");
  o.tokens = vm["tokens"].as<Idx>();
  if (o.tokens < 0) throw UsageError("--tokens must be >= 0");
  o.temperature = vm["temperature"].as<double>();
  if (!(o.temperature >= 0)) throw UsageError("--temperature must be >= 0");
  o.top_k = vm["top-k"].as<Idx>();
  if (o.top_k < 0) throw UsageError("--top-k must be >= 0");
  o.seed = parse_seed(vm["seed"].as<std::string>());
  o.device = resolve_device(vm["device"].as<std::string>(), "sampling with the float reference");
  Config cfg;
  train::TrainState st;
  const train::CheckpointMeta meta = train::read_checkpoint(o.checkpoint, &cfg, &st);
  auto setting = [&](const std::string& k) -> std::string {
    for (const auto& kv : meta.settings)
      if (kv.first == k) return kv.second;
    throw Error("sample", o.checkpoint + ": the checkpoint has no setting '" + k + "'", "");
  };
  // The data's spelling: text is bytes; a task is rebuilt from its settings.
  const std::unique_ptr<train::Dataset> spell = train::checkpoint_task(meta);
  // The default prompt is one the data can spell: a newline for text; for a task, the start of
  // a sequence as the task draws it (its first validation row's first token).
  std::string prompt = "\n";
  if (vm.count("prompt")) prompt = vm["prompt"].as<std::string>();
  else if (spell) prompt = spell->decode({spell->val_batch(0, 1, spell->min_T()).tok.front()});
  if (spell) {
    o.prompt = spell->encode(prompt);
  } else {
    for (unsigned char ch : prompt) o.prompt.push_back(ch);
  }
  const Precision storage = parse_dtype_list(setting("precision")).at(0);
  const ScanMode mode = parse_scan_list(setting("scan")).at(0);
  const std::vector<std::int32_t> gen = train::sample(o, cfg, st.params, mode, storage);
  std::string text = prompt;
  if (spell) {
    text += spell->decode(gen);
  } else {
    for (std::int32_t t : gen) text.push_back(static_cast<char>(t));
  }
  // A model's bytes can hold escape sequences: a terminal gets them escaped; a pipe or a file
  // (or --raw) gets the bytes as generated.
  const bool raw = vm["raw"].as<bool>() || isatty(1) == 0;
  std::cout << (raw ? text : escape_for_terminal(text)) << "\n";
  return 0;
}

int cmd_plot(const std::vector<std::string>& args) {
  po::options_description d("Plot");
  // clang-format off
  d.add_options()
    ("help,h", "this help")
    ("run", po::value<std::string>(), "a run directory of m3h train");
  // clang-format on
  const po::variables_map vm = parse_args(args, d, "plot");
  if (vm.count("help")) {
    print_command_help("plot",
                       "Draws (again) a run's loss.png from its metrics.csv: train and validation "
                       "loss against step\n(for a run trained where gnuplot was missing), and "
                       "its step_times.png from step_times.csv where\nthe run was timed "
                       "(--step-times). Replaces only the run's own pictures.\nExit status: 0 "
                       "drawn, 1 one not drawn (the note says why), 2 bad usage or bad input.",
                       d);
    return 0;
  }
  if (!vm.count("run")) throw UsageError("plot: --run DIR is required");
  const train::RunDir dir(vm["run"].as<std::string>(), true, false, false);
  // loss.png always; step_times.png where the run was timed (--step-times).
  std::vector<std::pair<std::string, std::string>> drawn = {{"loss.png", dir.plot_loss()}};
  std::error_code ec;
  if (std::filesystem::exists(dir.path("step_times.csv"), ec))
    drawn.emplace_back("step_times.png", dir.plot_step_times());
  int status = 0;
  for (const auto& [png, note] : drawn) {
    std::cout << "m3h plot: " << echo(note.empty() ? dir.path(png) : note, 400) << "\n";
    if (!note.empty()) status = 1;
  }
  return status;
}

}  // namespace m3::tools
