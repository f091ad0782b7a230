// m3h export, m3h import and m3h logits (docs/INTEROP.md): option parsing only; the format is
// train/safetensors.hpp, the names, layouts and logits train/interop.hpp.
//
//   export --checkpoint C --out M.safetensors [--force]
//       C's f32 master weights under the official state-spaces/mamba names and layouts, and
//       C's settings (the model config first) in __metadata__.
//   import M.safetensors --out C.h5 [--force]
//       the other way: a checkpoint with M's weights (exact f32 from F32, BF16 or F16), M's
//       settings, step 0 and zero AdamW moments — no optimizer state travels; `m3h train
//       --init C.h5` trains on from it, `m3h compare --checkpoint C.h5` verifies it.
//   logits --checkpoint C --tokens FILE --out L.safetensors [--scan MODE] [--dtype LIST]
//       the double reference's logits of C on the token rows of FILE ([B, T, V], f32), the
//       tokens ([B, T], I32) and, per precision of --dtype, the head/logits budget a subject
//       of that precision is held to (HARNESS.md §4) in __metadata__ — what
//       scripts/official/interop_official.py compares the official module against.
// Errors: one line "m3h: error: <command>: …", exit status 2; nothing is written then, and an
// existing output is replaced only with --force (atomically: temporary file + rename).
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "checkpoint.hpp"
#include "cli.hpp"
#include "commands.hpp"
#include "error.hpp"
#include "golden.hpp"
#include "interop.hpp"
#include "safetensors.hpp"

namespace m3::tools {

namespace {

// Runs `body`, giving a library error the command's name: "import: M.safetensors: …".
template <class F>
int as_command(const char* command, F&& body) {
  try {
    return body();
  } catch (const Error& e) {
    throw UsageError(std::string(command) + ": " + e.what());
  }
}

// An output must not be the command's input (the input options m3h knows are checked by
// check_output_path; these commands' own inputs here).
void refuse_same_file(const std::string& out, const std::string& in, const char* what) {
  std::error_code ec;
  if (std::filesystem::exists(out, ec) && std::filesystem::equivalent(out, in, ec))
    throw UsageError("--out " + echo(out) + ": is the " + what + " file; choose another name");
}

std::string shape_list(const std::vector<Idx>& s) {
  std::string out;
  for (Idx d : s) out += (out.empty() ? "" : "x") + std::to_string(d);
  return out.empty() ? "scalar" : out;
}

}  // namespace

int cmd_export(const std::vector<std::string>& args) {
  po::options_description d("Export");
  // clang-format off
  d.add_options()
    ("help,h", "this help")
    ("checkpoint", po::value<std::string>(), "a checkpoint of m3h train (or of m3h import)")
    ("out", po::value<std::string>(), "the safetensors file to write")
    ("force", po::bool_switch(), "replace an existing --out");
  // clang-format on
  const po::variables_map vm = parse_args(args, d, "export");
  if (vm.count("help")) {
    print_command_help(
        "export",
        "Writes a checkpoint's f32 weights as safetensors under the official Mamba-3 names and\n"
        "layouts (backbone.layers.<l>.mixer.in_proj.weight [out, in], …; docs/INTEROP.md), with\n"
        "the checkpoint's settings in __metadata__, so that `m3h import` needs nothing else and\n"
        "PyTorch can load it (scripts/official/interop_official.py). Optimizer moments are not\n"
        "exported.\nExit status: 0 written, 2 bad usage or bad input.",
        d);
    return 0;
  }
  if (!vm.count("checkpoint")) throw UsageError("export: --checkpoint FILE is required");
  if (!vm.count("out")) throw UsageError("export: --out FILE is required (the .safetensors file)");
  check_output_path(vm, "out", vm["force"].as<bool>());
  return as_command("export", [&] {
    const std::string in = vm["checkpoint"].as<std::string>(), out = vm["out"].as<std::string>();
    Config cfg;
    train::TrainState ts;
    const train::CheckpointMeta meta = train::read_checkpoint(in, &cfg, &ts);
    const st::File f = train::export_model(cfg, meta.settings, ts.params);
    st::write_file(out, f);
    std::size_t bytes = 0;
    for (const auto& t : f.tensors) bytes += t.bytes.size();
    std::cout << "m3h export: wrote " << echo(out, 200) << ": " << f.tensors.size()
              << " f32 tensors (" << bytes << " bytes of weights) of step " << meta.step
              << "; " << cfg.describe() << "\n";
    return 0;
  });
}

int cmd_import(const std::vector<std::string>& args) {
  // `m3h import M.safetensors --out C.h5`: the one positional argument is the file.
  std::vector<std::string> a;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& s = args[i];
    if (!s.empty() && s[0] == '-') {
      a.push_back(s);
      if ((s == "--out" || s == "--safetensors") && i + 1 < args.size()) a.push_back(args[++i]);
    } else {
      a.push_back("--safetensors");
      a.push_back(s);
    }
  }
  po::options_description d("Import");
  // clang-format off
  d.add_options()
    ("help,h", "this help")
    ("safetensors", po::value<std::string>(), "the file to import (also the first argument without an option name)")
    ("out", po::value<std::string>(), "the checkpoint to write (.h5)")
    ("force", po::bool_switch(), "replace an existing --out");
  // clang-format on
  const po::variables_map vm = parse_args(a, d, "import");
  if (vm.count("help")) {
    std::cout << "Usage: m3h import FILE.safetensors --out C.h5 [--force]\n\n"
                 "Writes a checkpoint from a safetensors file of `m3h export`'s naming (the\n"
                 "official Mamba-3 names and layouts; F32, BF16 or F16 tensors, converted to f32\n"
                 "exactly; the model config in __metadata__; docs/INTEROP.md). The checkpoint has\n"
                 "step 0 and no optimizer state (zero AdamW moments): `m3h train --init C.h5`\n"
                 "trains on from its weights, `m3h compare --checkpoint C.h5` verifies them.\n"
                 "Exit status: 0 written, 2 bad usage or bad input.\n\n"
              << d << "\n";
    return 0;
  }
  if (!vm.count("safetensors"))
    throw UsageError("import: give the safetensors file (m3h import FILE --out C.h5)");
  if (!vm.count("out")) throw UsageError("import: --out FILE is required (the checkpoint)");
  const std::string in = vm["safetensors"].as<std::string>(), out = vm["out"].as<std::string>();
  if (in.empty()) throw UsageError("import: an empty file name");
  refuse_same_file(out, in, "input");
  check_output_path(vm, "out", vm["force"].as<bool>());
  return as_command("import", [&] {
    const train::ImportedModel m = train::import_model(st::read_file(in), in);
    train::CheckpointMeta meta;
    meta.settings = m.settings;
    meta.git_revision = golden::git_revision();
    const ParamLayout layout = param_layout(m.cfg);
    train::TrainState ts;
    ts.params = m.params;
    ts.m.assign(static_cast<std::size_t>(layout.total), 0.0f);
    ts.v.assign(static_cast<std::size_t>(layout.total), 0.0f);
    train::write_checkpoint(out, m.cfg, meta, ts, vm["force"].as<bool>());
    std::cout << "m3h import: wrote " << echo(out, 200) << ": " << m.cfg.describe()
              << "; step 0, zero AdamW moments (m3h train --init starts from it)";
    for (const std::string& n : m.defaulted) std::cout << "; " << n << " absent, set to its default";
    std::cout << "\n";
    return 0;
  });
}

int cmd_logits(const std::vector<std::string>& args) {
  po::options_description d("Logits");
  // clang-format off
  d.add_options()
    ("help,h", "this help")
    ("checkpoint", po::value<std::string>(), "a checkpoint of a token model")
    ("tokens", po::value<std::string>(), "token rows: one sequence of ids per line, all of one length")
    ("out", po::value<std::string>(), "the safetensors file to write (tokens, logits, budgets)")
    ("scan", po::value<std::string>(), "seq or chunked (default: the checkpoint's scan setting, else chunked)")
    ("dtype", po::value<std::string>()->default_value("f32,bf16"), "the precisions whose head/logits budgets are written")
    ("force", po::bool_switch(), "replace an existing --out");
  // clang-format on
  const po::variables_map vm = parse_args(args, d, "logits");
  if (vm.count("help")) {
    print_command_help(
        "logits",
        "The logits of a checkpoint on given tokens (zero entering states), computed by the\n"
        "double reference, with the budget of head/logits (HARNESS.md §4: k x the float\n"
        "reference's error at that precision + the table's floor) for each --dtype, for another\n"
        "implementation to be judged against (scripts/official/interop_official.py).\n"
        "Writes tokens [B, T] I32 and logits [B, T, V] F32 as safetensors; the budgets go to\n"
        "__metadata__ (m3h.budget.<dtype>.rel_l2 / .max_abs) and to stdout.\n"
        "Exit status: 0 written, 2 bad usage or bad input.",
        d);
    return 0;
  }
  for (const char* o : {"checkpoint", "tokens", "out"})
    if (!vm.count(o)) throw UsageError(std::string("logits: --") + o + " is required");
  const std::string ck = vm["checkpoint"].as<std::string>(), tok = vm["tokens"].as<std::string>(),
                    out = vm["out"].as<std::string>();
  refuse_same_file(out, tok, "--tokens");
  check_output_path(vm, "out", vm["force"].as<bool>());
  const std::vector<Precision> dts = parse_dtype_list(vm["dtype"].as<std::string>());
  return as_command("logits", [&] {
    Config cfg;
    train::TrainState ts;
    const train::CheckpointMeta meta = train::read_checkpoint(ck, &cfg, &ts);
    M3_REQUIRE(cfg.vocab_size > 0, ck, "not a token model (vocab_size 0)", "logits need a head");
    std::string scan = "chunked";
    for (const auto& kv : meta.settings)
      if (kv.first == "scan") scan = kv.second;
    if (vm.count("scan")) scan = vm["scan"].as<std::string>();
    const std::vector<ScanMode> modes = parse_scan_list(scan);
    if (modes.size() != 1) throw UsageError("logits: --scan takes one mode (seq or chunked)");
    std::ifstream f(tok, std::ios::binary);
    if (!f) throw Error(tok, "cannot open the token file", "");
    std::stringstream text;
    text << f.rdbuf();
    const train::TokenRows rows = train::parse_token_rows(text.str(), cfg.vocab_size, tok);
    validate_run(cfg, rows.B, rows.T);
    const train::ModelLogits lg = train::model_logits(cfg, ts.params, rows, modes[0], dts);
    st::File file;
    file.metadata = {{"m3h.logits.scan", scan_mode_name(modes[0])},
                     {"m3h.logits.oracle", "reference<double>, rounded to f32"}};
    for (const auto& b : lg.budgets) {
      const std::string p = std::string("m3h.budget.") + precision_name(b.precision);
      file.metadata.push_back({p + ".rel_l2", train::exact_double(b.rel_l2)});
      file.metadata.push_back({p + ".max_abs", train::exact_double(b.max_abs)});
      file.metadata.push_back({p + ".baseline_rel_l2", train::exact_double(b.baseline_rel_l2)});
      file.metadata.push_back({p + ".baseline_max_abs", train::exact_double(b.baseline_max_abs)});
    }
    file.tensors.push_back(st::i32_tensor("tokens", {rows.B, rows.T}, rows.tok));
    file.tensors.push_back(st::f32_tensor("logits", {rows.B, rows.T, cfg.vocab_size}, lg.logits));
    st::write_file(out, file);
    std::cout << "m3h logits: wrote " << echo(out, 200) << ": logits "
              << shape_list({rows.B, rows.T, cfg.vocab_size}) << " (" << scan_mode_name(modes[0])
              << ", double reference)\n";
    for (const auto& b : lg.budgets)
      std::cout << "m3h logits: budget " << precision_name(b.precision) << ": rel_l2 <= "
                << b.rel_l2 << ", max_abs <= " << b.max_abs << " (the float reference errs "
                << b.baseline_rel_l2 << ", " << b.baseline_max_abs << ")\n";
    return 0;
  });
}

}  // namespace m3::tools
