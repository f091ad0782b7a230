// Shared m3h option parsing (see cli.hpp).
#include "cli.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>

#include "backend.hpp"  // from_flat
#include "checkpoint.hpp"
#include "golden.hpp"
#include "gpu_lineup.hpp"
#include "presets.hpp"
#include "resources.hpp"
#include "run_dir.hpp"  // resolve_checkpoint
#include "trainer.hpp"  // training_batch_problem

namespace m3::tools {

namespace {

// The options that define a problem: on the command line and in a --config file.
void add_problem_fields(po::options_description& d) {
  std::string names;
  for (const auto& p : harness::presets()) names += (names.empty() ? "" : ", ") + p.name;
  // clang-format off
  d.add_options()
    ("preset", po::value<std::string>()->default_value("default"), ("named preset: " + names + " (see m3h compare --help)").c_str())
    ("B", po::value<Idx>(), "batch size")
    ("T", po::value<Idx>(), "sequence length")
    ("seed", po::value<std::string>(), "seed of weights, inputs, output gradient and entering states (0 … 2^64-1, decimal or 0x hex)")
    ("zero-states", po::bool_switch(), "zero entering states instead of random ones")
    ("d-model", po::value<Idx>(), "d_model")
    ("d-state", po::value<Idx>(), "d_state")
    ("headdim", po::value<Idx>(), "headdim")
    ("expand", po::value<Idx>(), "expand (d_inner = expand*d_model)")
    ("ngroups", po::value<Idx>(), "ngroups (B/C groups; must divide nheads)")
    ("layers", po::value<Idx>(), "n_layers")
    ("rope-fraction", po::value<double>(), "rope_fraction (0.5 or 1.0)")
    ("a-floor", po::value<double>(), "a_floor: A is clamped to A <= -a_floor (default 1e-4)")
    ("outproj-norm", po::value<bool>()->implicit_value(true), "gated RMSNorm before out_proj (is_outproj_norm)")
    ("chunk-size", po::value<Idx>(), "chunk size of the chunked scan")
    ("input-dim", po::value<Idx>(), "width of the backbone input X")
    ("input-proj-identity", po::value<bool>()->implicit_value(true), "input_proj is the identity (H0 = X; input_dim = d_model)")
    ("vocab-size", po::value<Idx>(), "a token model (TRAINING.md §1) with this vocabulary: tokens in, the loss and every gradient out (input_dim = vocab_size; 0 = none)");
  // clang-format on
}

const char* const kProblemFields[] = {"preset",   "B",      "T",          "seed",
                                      "zero-states", "d-model", "d-state", "headdim",
                                      "expand",   "ngroups", "layers",     "rope-fraction",
                                      "a-floor",  "outproj-norm", "chunk-size", "input-dim",
                                      "vocab-size", "input-proj-identity"};

// The values a config derives rather than sets, as reports, JSON and /meta print them: a
// config file may hold them (a report's keys pasted back), and problem_from requires each to
// be what the config gives.
const char* const kDerivedFields[] = {"d-inner", "nheads", "num-rope-angles", "in-proj-dim",
                                      "n-chunks"};

void add_derived_fields(po::options_description& d) {
  for (const char* name : kDerivedFields) d.add_options()(name, po::value<Idx>(), "derived");
}

// Other names of fields, as reports, JSON, golden /meta and checkpoints print them
// (underscores already read as '-'): a file may use either.
const std::pair<const char*, const char*> kFieldAliases[] = {
    {"n-layers", "layers"}, {"is-outproj-norm", "outproj-norm"}, {"precision", "dtype"}};

// Every option, of any command, whose value names a file the command reads. An output may
// never be one of them (check_output_path), --force or not: replacing it would destroy the
// input the output was made from.
const char* const kInputOptions[] = {"config", "golden", "checkpoint", "resume",
                                     "data",   "expect", "file",       "against"};

// Every option of any command whose value is a path: the inputs above, the outputs, the run
// folder of plot and the id file of a multi-process job. An empty value is refused naming the
// option (parse_args), before it can reach a reader or a writer as a nameless file.
const char* const kPathOptions[] = {"config", "golden", "checkpoint", "resume", "data",
                                    "expect", "file",   "against",    "json",   "out",
                                    "dir",    "record", "run",        "nccl-id-file"};

std::string trim(const std::string& s) {
  const auto a = s.find_first_not_of(" \t\r");
  if (a == std::string::npos) return "";
  const auto b = s.find_last_not_of(" \t\r");
  return s.substr(a, b - a + 1);
}


}  // namespace

bool option_given(const po::variables_map& vm, const char* name) {
  return vm.count(name) && !vm[name].defaulted();
}

std::string echo(const std::string& text, std::size_t max) {
  return escape_for_message(text, max);
}

std::string json_written_line(const std::string& path, std::size_t cells, std::size_t checks) {
  return "json: " + echo(path, 400) + " (" + std::to_string(cells) + (cells == 1 ? " cell, " : " cells, ") +
         std::to_string(checks) + (checks == 1 ? " tensor check)" : " tensor checks)");
}

std::uint64_t parse_seed(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos || text[first] == '-' || text[first] == '+')
    throw UsageError("--seed '" + echo(text) + "': expected an unsigned 64-bit integer");
  // Decimal, or hexadecimal after 0x: a leading zero is a decimal digit (010 is ten), never
  // an octal prefix.
  const bool hex = text.compare(first, 2, "0x") == 0 || text.compare(first, 2, "0X") == 0;
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, hex ? 16 : 10);
  if (errno == ERANGE || end == text.c_str() || *end != '\0')
    throw UsageError("--seed '" + echo(text) + "': expected an unsigned 64-bit integer");
  return static_cast<std::uint64_t>(v);
}

void check_output_path(const po::variables_map& vm, const std::string& option, bool force) {
  namespace fs = std::filesystem;
  const std::string path = vm[option].as<std::string>();
  if (option == "json" && path == "-") return;  // stdout
  const std::string what = "--" + option + " " + path;
  if (path.empty()) throw UsageError("--" + option + ": an empty file name");
  const fs::path p(path);
  const fs::path dir = p.parent_path();
  std::error_code ec;
  if (!dir.empty() && !fs::is_directory(dir, ec))
    throw UsageError(what + ": folder " + dir.string() + " does not exist");
  const fs::file_status link = fs::symlink_status(p, ec);
  if (fs::exists(link)) {
    const fs::file_status target = fs::status(p, ec);
    if (fs::is_symlink(link) && !fs::exists(target))
      throw UsageError(what + ": a dangling symbolic link (writing would create its target)");
    if (!fs::is_regular_file(target))
      throw UsageError(what + ": exists and is not a regular file; nothing is written there");
    for (const char* input : kInputOptions) {
      if (!vm.count(input)) continue;
      std::vector<std::string> paths;
      if (const auto* one = boost::any_cast<std::string>(&vm[input].value())) paths.push_back(*one);
      if (const auto* many = boost::any_cast<std::vector<std::string>>(&vm[input].value()))
        paths = *many;
      for (const std::string& in : paths)
        if (fs::equivalent(p, in, ec))
          throw UsageError(what + ": is the run's --" + input + " file; choose another name");
    }
    if (!force) throw UsageError(what + ": exists (pass --force to replace it)");
  }
}

std::string stage_pattern(const po::variables_map& vm) {
  if (!option_given(vm, "stage")) return "";
  const std::string pattern = vm["stage"].as<std::string>();
  std::stringstream items(pattern);
  std::string item;
  bool any = false;
  while (std::getline(items, item, ',')) {
    if (trim(item).empty())
      throw UsageError("--stage '" + echo(pattern) +
                       "': an empty pattern (give one, or '*' for every tensor)");
    any = true;
  }
  if (!any || pattern.back() == ',')
    throw UsageError("--stage '" + echo(pattern) + "': an empty pattern (give one, or '*' for every tensor)");
  return pattern;
}

namespace {

// The Levenshtein distance of a and b: insertions, deletions and substitutions of one
// character each cost 1.
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

}  // namespace

std::string near_keys_note(const std::string& pattern, const std::vector<std::string>& keys) {
  if (keys.empty()) return "";
  std::vector<std::string> items;
  std::stringstream ss(pattern);
  for (std::string item; std::getline(ss, item, ',');)
    if (!trim(item).empty()) items.push_back(trim(item));
  std::vector<std::pair<size_t, size_t>> ranked;  // (distance, index)
  for (size_t k = 0; k < keys.size(); ++k) {
    size_t best = std::string::npos;
    for (const std::string& item : items) best = std::min(best, edit_distance(item, keys[k]));
    ranked.emplace_back(best, k);
  }
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string note = "; nearest: ";
  for (size_t i = 0; i < std::min<size_t>(3, ranked.size()); ++i)
    note += (i ? ", " : "") + keys[ranked[i].second];
  return note;
}

po::options_description problem_options(bool golden) {
  po::options_description d("Problem (a preset, then a --config file, then overrides)");
  add_problem_fields(d);
  // clang-format off
  d.add_options()
    ("config", po::value<std::string>(), "read problem options from FILE: 'name = value' lines ('d_model = 64', 'preset = long_t', '# comment'); the command line wins")
    ("allow-large", po::bool_switch(), "run a problem even when its tensors look larger than the machine's memory");
  if (golden)
    d.add_options()
      ("golden", po::value<std::string>(), "take weights, inputs and the ORACLE tensors from a golden HDF5 file (not recomputed); excludes every other problem option")
      ("checkpoint", po::value<std::string>(), "take the model config and the TRAINED weights from a checkpoint of m3h train, or a run folder's latest (realistic activations); seeded tokens, --B (default 2), --T (default min(256, the run's T)) and --seed apply, no other problem option")
      ("train-batch", po::value<std::string>(), "with --checkpoint: the problem is the run's training batch of step S (S:K for micro-batch K), as train --verify-every judges it (zero entering states), its first --B rows and --T positions (default: all); the run's task, or its text given with --data; --seed S keys only the perturbed baseline's draws (default 0, as --verify-every's)")
      ("data", po::value<std::vector<std::string>>(), "with --train-batch: the text file(s) the run trained on, in its order (their size and hash must be the checkpoint's)");
  // clang-format on
  return d;
}

void store_config_file(const std::string& path, po::variables_map& vm,
                       const po::options_description* file_fields) {
  // A FIFO, a device or a folder would block or read garbage: only regular files (a symbolic
  // link to one is followed).
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st))
    throw UsageError("--config " + path + ": no such file");
  if (!std::filesystem::is_regular_file(st))
    throw UsageError("--config " + path + ": not a regular file");
  std::ifstream in(path);
  if (!in) throw UsageError("--config " + path + ": cannot open (" + std::strerror(errno) + ")");
  po::options_description problem_fields;
  add_problem_fields(problem_fields);
  add_derived_fields(problem_fields);
  const po::options_description& fields = file_fields ? *file_fields : problem_fields;
  // A run's config.txt read for a problem (compare --config RUN/config.txt): m3h train's keys
  // that are no problem option are skipped, named in one note.
  const po::options_description training = file_fields ? po::options_description() : train_fields();
  std::vector<std::string> skipped;
  // The options the command line gave: they win, a repeatable one too (its values are not
  // added to the file's).
  std::set<std::string> on_command_line;
  for (const auto& kv : vm)
    if (!kv.second.defaulted()) on_command_line.insert(kv.first);
  std::set<std::string> seen;
  std::string raw;
  int lineno = 0;
  while (std::getline(in, raw)) {
    ++lineno;
    // A UTF-8 byte-order mark (what some editors put first) is no part of the first key.
    if (lineno == 1 && raw.compare(0, 3, "\xEF\xBB\xBF") == 0) raw.erase(0, 3);
    const std::string where = path + ":" + std::to_string(lineno);
    const std::string line = trim(raw.substr(0, raw.find('#')));
    if (line.empty()) continue;
    if (line.front() == '[')
      throw UsageError("config " + where + ": sections ('" + echo(line) + "') are not used; write 'name = value'");
    const auto eq = line.find('=');
    if (eq == std::string::npos)
      throw UsageError("config " + where + ": expected 'name = value', got '" + echo(line) + "'");
    const std::string written = trim(line.substr(0, eq));
    const std::string raw_value = trim(line.substr(eq + 1));
    if (written.empty())
      throw UsageError("config " + where + ": a value without a key ('" + echo(line) +
                       "'); write 'name = value'");
    std::string name = written;
    std::string value = raw_value;
    for (char& c : name)
      if (c == '_') c = '-';
    if (name == "config" || name == "golden")
      throw UsageError("config " + where + ": '" + echo(written) + "' is not allowed in a config file");
    for (const auto& [alias, field] : kFieldAliases)
      if (name == alias && fields.find_nothrow(field, false)) name = field;
    // The report's "entering_states=random|zero" is the zero-states switch.
    if (name == "entering-states" && fields.find_nothrow("zero-states", false)) {
      if (value != "random" && value != "zero")
        throw UsageError("config " + where + ": bad value '" + echo(value) + "' for '" +
                         echo(written) + "' (expected random or zero)");
      name = "zero-states";
      value = value == "zero" ? "true" : "false";
    }
    if (!fields.find_nothrow(name, false)) {
      std::string as_trained = name;
      for (const auto& [alias, field] : kFieldAliases)
        if (name == alias) as_trained = field;
      if (training.find_nothrow(as_trained, false)) {
        if (std::find(skipped.begin(), skipped.end(), written) == skipped.end())
          skipped.push_back(written);
        continue;
      }
      throw UsageError("config " + where + ": unknown key '" + echo(written) + "'");
    }
    // A repeatable option (--task-opt) is written once per value, as a run's config.txt does.
    const po::option_description* field = fields.find_nothrow(name, false);
    const bool repeatable = field && field->semantic()->is_composing();
    if (!seen.insert(name).second && !repeatable)
      throw UsageError("config " + where + ": key '" + echo(written) + "' given twice");
    if (value.empty())
      throw UsageError("config " + where + ": key '" + echo(written) + "' has no value");
    try {  // the seed and the preset are resolved later; check them here, naming the line
      if (name == "seed") parse_seed(value);
      if (name == "preset") harness::find_preset(value);
    } catch (const std::exception& e) {
      throw UsageError("config " + where + ": bad value '" + echo(value) + "' for '" + echo(written) + "' (" +
                       (name == "seed" ? "expected an unsigned 64-bit integer" : e.what()) + ")");
    }
    // Parse the one line on its own, first into a scratch map so that a bad value is reported
    // even when the command line already set the option (and then wins).
    std::istringstream one(name + "=" + value + "\n");
    try {
      const po::parsed_options parsed = po::parse_config_file(one, fields);
      po::variables_map scratch;
      po::store(parsed, scratch);
      po::notify(scratch);
      if (!(repeatable && on_command_line.count(name))) po::store(parsed, vm);
    } catch (const po::error&) {
      const char* expected = !file_fields && name == "rope-fraction"       ? "a number"
                             : name == "outproj-norm" || name == "zero-states" ||
                                       name == "input-proj-identity"             ? "true or false"
                             : file_fields                                    ? "a value of its type"
                                                                              : "an integer";
      throw UsageError("config " + where + ": bad value '" + echo(value) + "' for '" + echo(written) +
                       "' (expected " + expected + ")");
    }
  }
  if (in.bad()) throw UsageError("--config " + path + ": read error");
  if (!skipped.empty()) {
    std::string names;
    for (const std::string& k : skipped) names += (names.empty() ? "" : ", ") + k;
    std::cerr << "m3h: config " << echo(path, 200) << ": m3h train's keys ignored here: "
              << echo(names, 400) << "\n";
  }
}

harness::RunSpec problem_from(const po::variables_map& vm) {
  const harness::Preset& p = harness::find_preset(vm["preset"].as<std::string>());
  harness::RunSpec s = harness::preset_spec(p);
  if (vm.count("config")) s.source += " + config " + vm["config"].as<std::string>();
  auto idx = [&](const char* name, Idx& field) {
    if (vm.count(name)) field = vm[name].as<Idx>();
  };
  idx("B", s.B);
  idx("T", s.T);
  if (vm.count("seed")) s.seed = parse_seed(vm["seed"].as<std::string>());
  if (vm.count("zero-states") && vm["zero-states"].as<bool>()) s.random_states = false;
  idx("d-model", s.cfg.d_model);
  idx("d-state", s.cfg.d_state);
  idx("headdim", s.cfg.headdim);
  idx("expand", s.cfg.expand);
  idx("ngroups", s.cfg.ngroups);
  idx("layers", s.cfg.n_layers);
  idx("chunk-size", s.cfg.chunk_size);
  if (vm.count("rope-fraction")) s.cfg.rope_fraction = vm["rope-fraction"].as<double>();
  if (vm.count("a-floor")) s.cfg.a_floor = vm["a-floor"].as<double>();
  if (vm.count("outproj-norm")) s.cfg.is_outproj_norm = vm["outproj-norm"].as<bool>();
  // X keeps the model width unless told otherwise (every preset has input_dim = d_model).
  if (vm.count("input-dim")) s.cfg.input_dim = vm["input-dim"].as<Idx>();
  else if (vm.count("d-model") && p.cfg.input_dim == p.cfg.d_model) s.cfg.input_dim = s.cfg.d_model;
  if (vm.count("input-proj-identity")) {
    s.cfg.input_proj_identity = vm["input-proj-identity"].as<bool>();
    if (s.cfg.input_proj_identity && !vm.count("input-dim")) s.cfg.input_dim = s.cfg.d_model;
  }
  // A token model embeds one-hot tokens: input_dim is the vocabulary.
  idx("vocab-size", s.cfg.vocab_size);
  if (s.cfg.vocab_size > 0) {
    if (vm.count("input-dim") && s.cfg.input_dim != s.cfg.vocab_size)
      throw UsageError("--input-dim must equal --vocab-size in a token model (or be left out)");
    s.cfg.input_dim = s.cfg.vocab_size;
  }
  validate_run(s.cfg, s.B, s.T);
  // Derived values a config file may carry must be the config's.
  const std::pair<const char*, Idx> derived[] = {{"d-inner", s.cfg.d_inner()},
                                                 {"nheads", s.cfg.nheads()},
                                                 {"num-rope-angles", s.cfg.num_rope_angles()},
                                                 {"in-proj-dim", s.cfg.in_proj_dim()},
                                                 {"n-chunks", s.cfg.n_chunks(s.T)}};
  for (const auto& [name, value] : derived)
    if (vm.count(name) && vm[name].as<Idx>() != value) {
      std::string key = name;
      for (char& c : key)
        if (c == '-') c = '_';
      throw UsageError("config: " + key + " = " + std::to_string(vm[name].as<Idx>()) +
                       " disagrees with the config, which gives " + std::to_string(value) +
                       " (" + key + " is derived, not set)");
    }
  return s;
}

namespace {

// Host bytes a comparison run needs, roughly: every registry tensor of the larger scan mode as
// a double about five times over (the oracle's buffers and capture, the subject's and the
// baseline's captures, the comparison's copies).
// With the GPU oracle (compare --oracle gpu) the tensors stay on the device: the host holds the
// problem in double, a perturbed copy of it, and the float copies uploaded from them.
double host_bytes_estimate(const po::variables_map& vm, const harness::RunSpec& spec) {
  if (vm.count("oracle") && vm["oracle"].as<std::string>() == "gpu")
    return 3.0 * harness::problem_host_bytes(spec.cfg, spec.B, spec.T);
  double most = 0;
  for (ScanMode m : spec.modes) most = std::max(most, harness::stage_elements(spec.cfg, spec.B, spec.T, m));
  return 5.0 * 8.0 * most;
}

}  // namespace

bool problem_options_given(const po::variables_map& vm) {
  if (option_given(vm, "config")) return true;
  for (const char* f : kProblemFields)
    if (option_given(vm, f)) return true;
  return false;
}

void check_host_memory(const po::variables_map& vm, const harness::RunSpec& spec) {
  if (vm.count("allow-large") && vm["allow-large"].as<bool>()) return;
  try {
    harness::check_host_bytes(host_bytes_estimate(vm, spec), "the problem is too large",
                              "reduce B, T, the widths or the layers; --allow-large to try anyway");
  } catch (const Error& e) {
    throw UsageError(std::string("the problem is too large: ") + e.failed() + " (" + e.why() + ")");
  }
}

// --checkpoint F --train-batch S[:K]: the run's training batch as --verify-every judges it.
ProblemSource training_batch_source(const po::variables_map& vm, const std::string& file,
                                    const train::CheckpointMeta& meta, const Config& cfg,
                                    const train::TrainState& st) {
  const std::string arg = vm["train-batch"].as<std::string>();
  if (option_given(vm, "zero-states"))
    throw UsageError("--train-batch: not with --zero-states (the batch is the run's, its entering "
                     "states zero)");
  auto count = [&](const std::string& t, Idx* out) {
    if (t.empty() || t.size() > 15 || t.find_first_not_of("0123456789") != std::string::npos)
      return false;
    *out = static_cast<Idx>(std::stoll(t));
    return true;
  };
  Idx step = 0, micro = 0;
  const auto colon = arg.find(':');
  if (!count(arg.substr(0, colon), &step) ||
      (colon != std::string::npos && !count(arg.substr(colon + 1), &micro)))
    throw UsageError("--train-batch '" + echo(arg) + "': expected STEP or STEP:MICRO (integers)");
  std::vector<std::string> data;
  if (vm.count("data")) data = vm["data"].as<std::vector<std::string>>();
  harness::RunSpec spec;
  spec.preset = "";
  spec.cfg = cfg;
  Problem pb;
  try {
    pb = train::training_batch_problem(meta, cfg, st.params, data, step, micro,
                                       vm.count("B") ? vm["B"].as<Idx>() : 0,
                                       vm.count("T") ? vm["T"].as<Idx>() : 0, "--train-batch");
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  // The batch, the weights and the states are the run's; the seed keys only the perturbed
  // baseline's draws (harness::perturbation_seed), so --seed redraws them.
  if (vm.count("seed")) pb.seed = parse_seed(vm["seed"].as<std::string>());
  spec.seed = pb.seed;
  spec.B = pb.B;
  spec.T = pb.T;
  spec.random_states = false;
  spec.source = "checkpoint " + file + " (step " + std::to_string(meta.step) +
                "), training batch of step " + std::to_string(step) + ":" +
                std::to_string(micro) + ", rows 0-" + std::to_string(pb.B - 1) +
                ", positions 0-" + std::to_string(pb.T - 1);
  spec.modes = parse_scan_list(vm["scan"].as<std::string>());
  check_host_memory(vm, spec);
  return {spec, std::move(pb), harness::reference_oracle()};
}

ProblemSource load_problem(const po::variables_map& vm) {
  const bool scan_given = option_given(vm, "scan");
  if (vm.count("checkpoint")) {
    const std::string path = vm["checkpoint"].as<std::string>();
    if (vm.count("golden")) throw UsageError("--checkpoint and --golden exclude each other");
    if (option_given(vm, "config"))
      throw UsageError("--checkpoint " + path + ": cannot be combined with --config");
    for (const char* f : kProblemFields) {
      const std::string name = f;
      if (name != "B" && name != "T" && name != "seed" && name != "zero-states" &&
          option_given(vm, f))
        throw UsageError("--checkpoint " + path + ": cannot be combined with --" + name +
                         " (the model comes from the checkpoint)");
    }
    Config cfg;
    train::TrainState st;
    const std::string file = train::resolve_checkpoint(path, "--checkpoint");
    const train::CheckpointMeta meta = train::read_checkpoint(file, &cfg, &st);
    if (vm.count("train-batch")) return training_batch_source(vm, file, meta, cfg, st);
    if (vm.count("data")) throw UsageError("--data: only with --checkpoint and --train-batch");
    const Idx run_T = train::int_setting(meta, "T", 256);
    harness::RunSpec spec;
    spec.preset = "";
    spec.source = "checkpoint " + file + " (step " + std::to_string(meta.step) + ")";
    spec.cfg = cfg;
    spec.B = vm.count("B") ? vm["B"].as<Idx>() : 2;
    spec.T = vm.count("T") ? vm["T"].as<Idx>() : std::min<Idx>(256, run_T);
    if (vm.count("seed")) spec.seed = parse_seed(vm["seed"].as<std::string>());
    if (vm.count("zero-states") && vm["zero-states"].as<bool>()) spec.random_states = false;
    validate_run(spec.cfg, spec.B, spec.T);
    spec.modes = parse_scan_list(vm["scan"].as<std::string>());
    check_host_memory(vm, spec);
    Problem pb = make_problem(spec.cfg, spec.B, spec.T, spec.seed, spec.random_states);
    pb.params = cast_params<double>(train::from_flat(st.params, cfg, param_layout(cfg)));
    return {spec, std::move(pb), harness::reference_oracle()};
  }
  if (!vm.count("golden")) {
    harness::RunSpec spec = problem_from(vm);
    spec.modes = parse_scan_list(vm["scan"].as<std::string>());
    check_host_memory(vm, spec);
    Problem pb = harness::build_problem(spec);
    return {spec, std::move(pb), harness::reference_oracle()};
  }
  const std::string path = vm["golden"].as<std::string>();
  if (option_given(vm, "config"))
    throw UsageError("--golden " + path + ": cannot be combined with --config (the problem comes from the file)");
  for (const char* f : kProblemFields)
    if (option_given(vm, f))
      throw UsageError("--golden " + path + ": cannot be combined with --" + f +
                       " (the problem comes from the file)");
  golden::GoldenCase gc = golden::read_golden(path);
  harness::RunSpec spec;
  spec.preset = "";
  spec.source = "golden " + path + " (case " + gc.name + ")";
  spec.cfg = gc.problem.cfg;
  spec.B = gc.problem.B;
  spec.T = gc.problem.T;
  spec.seed = gc.problem.seed;
  bool nonzero = false;
  for (const auto* v : {&gc.problem.states.ssm, &gc.problem.states.k, &gc.problem.states.v,
                        &gc.problem.states.angle})
    for (double x : *v) nonzero = nonzero || x != 0.0;
  spec.random_states = nonzero;
  if (scan_given) {
    spec.modes = parse_scan_list(vm["scan"].as<std::string>());
    for (ScanMode m : spec.modes)
      if (!gc.oracle.count(m))
        throw UsageError("--golden " + path + ": scan mode '" + scan_mode_name(m) +
                         "' is not stored in the file");
  } else {
    spec.modes = gc.modes;
  }
  harness::Implementation oracle =
      harness::stored_captures("golden:" + gc.name + " (reference<double>, stored)", std::move(gc.oracle));
  return {spec, std::move(gc.problem), std::move(oracle)};
}

std::vector<ScanMode> parse_scan_list(const std::string& s) {
  if (s == "both" || s == "all") return {ScanMode::Sequential, ScanMode::Chunked};
  std::vector<ScanMode> modes;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    const ScanMode m = parse_scan_mode(item);
    bool dup = false;
    for (ScanMode x : modes) dup = dup || x == m;
    if (!dup) modes.push_back(m);
  }
  if (modes.empty()) throw UsageError("--scan '" + s + "' names no scan mode (seq, chunked)");
  return modes;
}

std::vector<harness::CompareMode> parse_compare_modes(const std::string& s) {
  if (s == "e2e") return {harness::CompareMode::EndToEnd};
  if (s == "isolated") return {harness::CompareMode::Isolated};
  if (s == "both") return {harness::CompareMode::EndToEnd, harness::CompareMode::Isolated};
  throw UsageError("--mode '" + s + "': expected e2e, isolated or both");
}

std::string resolve_device(const std::string& device, const char* fallback) {
  if (device != "cpu" && device != "gpu" && device != "auto")
    throw UsageError("--device " + device + ": expected cpu, gpu or auto");
  if (device == "cpu") return "cpu";
  const std::string absent = harness::gpu_absent_reason();
  if (absent.empty()) return "gpu";
  // Asked for by name, the GPU is never silently replaced by the CPU; auto says what it took,
  // on stderr (stdout may be the command's product: `m3h sample > out.txt`), headed by what it
  // means for the user; the driver's or the build's own words follow as the detail.
  if (device == "gpu") throw UsageError("--device gpu: no GPU found (" + absent + ")");
  std::cerr << "m3h: no GPU found: " << fallback << " (" << absent << ")\n";
  return "cpu";
}

std::string oracle_option(const po::variables_map& vm) {
  const std::string oracle = vm["oracle"].as<std::string>();
  if (oracle != "cpu" && oracle != "gpu")
    throw UsageError("--oracle '" + echo(oracle) + "': expected cpu or gpu");
  if (oracle == "cpu") return oracle;
  if (vm.count("golden"))
    throw UsageError("--oracle gpu: not with --golden (the file's stored oracle is the oracle)");
  if (vm.count("sweep"))
    throw UsageError("--oracle gpu: not with --sweep (a sweep's problems are the CPU oracle's size)");
  const std::string device = vm["device"].as<std::string>();
  if (device == "cpu")
    throw UsageError("--oracle gpu judges the GPU path on the device: use it with --device gpu");
  if (device == "auto") {  // said here in one line, not as auto's fallback note and then an error
    const std::string absent = harness::gpu_absent_reason();
    if (!absent.empty())
      throw UsageError("--oracle gpu judges the GPU path on the device: no GPU found (" + absent + ")");
  }
  return oracle;
}

std::function<void(const std::string&)> cell_progress(std::size_t cells) {
  return [cells, done = std::size_t{0}](const std::string& line) mutable {
    std::cerr << "cell " << ++done << "/" << cells << ": " << line << "\n";
  };
}

std::vector<Precision> parse_dtype_list(const std::string& s) {
  if (s == "all") return {Precision::F32, Precision::BF16, Precision::F16};
  std::vector<Precision> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item = trim(item);
    if (item.empty()) continue;
    Precision p;
    try {
      p = parse_precision(item);
    } catch (const std::exception&) {
      throw UsageError("--dtype '" + s + "': unknown precision '" + item + "' (f32, bf16, f16)");
    }
    if (p == Precision::F64)
      throw UsageError("--dtype '" + s + "': f64 is the oracle's precision, not a subject's");
    bool dup = false;
    for (Precision x : out) dup = dup || x == p;
    if (!dup) out.push_back(p);
  }
  if (out.empty()) throw UsageError("--dtype '" + s + "' names no precision (f32, bf16, f16)");
  return out;
}

po::variables_map parse_args(const std::vector<std::string>& args,
                             const po::options_description& desc, const char* command,
                             const po::options_description* config_fields) {
  po::variables_map vm;
  // No prefix guessing: a misspelt option (--dtyp) is an unknown option, never the one it
  // happens to begin.
  po::parsed_options parsed =
      po::command_line_parser(args)
          .options(desc)
          .style(po::command_line_style::default_style & ~po::command_line_style::allow_guessing)
          .run();
  for (const auto& o : parsed.options) {
    if (o.position_key >= 0)
      throw UsageError(std::string(command) + ": unexpected argument '" + echo(o.value.front()) +
                       "' (see m3h " + command + " --help)");
    // A path option given an empty value would surface later as a message that starts with
    // an empty name (": golden folder does not exist") or in the words of the file layer.
    for (const char* path_option : kPathOptions)
      if (o.string_key == path_option)
        for (const auto& v : o.value)
          if (v.empty()) throw UsageError("--" + o.string_key + ": an empty path");
  }
  po::store(parsed, vm);
  if (desc.find_nothrow("config", false) && vm.count("config"))
    store_config_file(vm["config"].as<std::string>(), vm, config_fields);
  po::notify(vm);
  return vm;
}

void print_command_help(const char* command, const char* summary,
                        const po::options_description& desc) {
  std::cout << "Usage: m3h " << command << " [options]\n\n" << summary << "\n\n" << desc << "\n";
}

std::string command_line(const char* command, const std::vector<std::string>& args) {
  std::string s = std::string("m3h ") + command;
  for (const auto& a : args) {
    const bool plain = !a.empty() && a.find_first_of(" \t\"'\\$*?[]{}();&|<>`") == std::string::npos;
    s += " " + (plain ? a : "'" + a + "'");
  }
  return s;
}

}  // namespace m3::tools
