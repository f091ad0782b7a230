// Shared command-line pieces of `m3h`: the usage-error type, the problem options every
// subcommand that builds a Problem accepts (a preset, a --config file, overrides, or a --golden
// file), and parsing helpers. Only parsing lives in tools/; what a command does lives in
// harness/ (run.hpp, dump.hpp, bench.hpp, report.hpp, report_json.hpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "config.hpp"
#include "precision.hpp"
#include "problem.hpp"
#include "run.hpp"

namespace m3::tools {

namespace po = boost::program_options;

// Bad usage: main prints "m3h: error: <what>" and returns 2 (as for m3::Error).
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A subcommand: its name, a one-line summary and its entry point (args after the name).
struct Command {
  const char* name;
  const char* summary;
  int (*run)(const std::vector<std::string>& args);
};

// --preset, --config, --B, --T, --seed, --zero-states and the Config overrides (--d-model,
// --d-state, --headdim, --expand, --ngroups, --layers, --rope-fraction, --a-floor,
// --outproj-norm, --chunk-size, --input-dim, --input-proj-identity, --vocab-size). With
// golden = true also --golden FILE.
po::options_description problem_options(bool golden = false);

// The options of m3h train a config file may set (its config.txt's keys; cmd_train.cpp).
po::options_description train_fields();

// The preset named by --preset (or by the config file) with every given override applied;
// validated (throws m3::Error). Precedence: command line, then --config file, then preset.
harness::RunSpec problem_from(const po::variables_map& vm);
// Whether the option was given on the command line or in the config file (not a default).
bool option_given(const po::variables_map& vm, const char* name);
// Whether any problem option (a field of problem_options, or --config) was given.
bool problem_options_given(const po::variables_map& vm);

// Where a command's problem and oracle come from:
//   --checkpoint F  the config and trained weights of an m3h train checkpoint, seeded tokens
//                   (--B, --T, --seed, --zero-states apply), oracle = reference<double>
//   --golden FILE   the stored Problem and the stored oracle Captures (not recomputed); the
//                   scan modes are the file's, or --scan's when given (each must be stored);
//                   no preset, config or override option may be combined with it
//   otherwise       problem_from(vm) + the preset's adjustment, oracle = reference<double>
// Reads --scan from vm (every command that uses this has it).
struct ProblemSource {
  harness::RunSpec spec;
  Problem problem;
  harness::Implementation oracle;
};
ProblemSource load_problem(const po::variables_map& vm);

// A config file (Boost.Program_options config-file syntax): one "name = value" per line, '#'
// starts a comment, names are the problem options' (d_model or d-model, B, T, seed, preset, …;
// '_' and '-' are the same); a UTF-8 byte-order mark before the first line is skipped.
// Every name reports, JSON, golden /meta and checkpoints print is read too: n_layers
// (layers), is_outproj_norm (outproj-norm), precision (m3h train's dtype), entering_states =
// random|zero (zero-states), and the derived d_inner, nheads, num_rope_angles, in_proj_dim,
// n_chunks, which must be what the config gives (problem_from checks them). Read for a problem,
// a run's config.txt works too: m3h train's keys that are no problem option (data, steps, lr,
// dtype, …) are skipped, named in one note on stderr. Unknown names, a name given twice, a
// line without '=' or without a name, and a bad value are UsageErrors of one line naming the
// file, the line and the name. Values already set on the command line win. Not allowed in a
// file: config, golden.
// `file_fields`: the names a file may set instead of the problem options (m3h train's).
void store_config_file(const std::string& path, po::variables_map& vm,
                       const po::options_description* file_fields = nullptr);

// A seed: decimal or 0x-hex, 0 … 2^64−1; anything else (a sign, garbage, overflow) is a UsageError.
std::uint64_t parse_seed(const std::string& text);

// User text for a message (m3::escape_for_message): control characters as \xNN; longer than
// `max` characters, its start and end with "…(N bytes)…" between — so a line read from a file
// never breaks or floods the one error line, and the reason after a long name stays on it.
std::string echo(const std::string& text, std::size_t max = 60);

// The line after a report's JSON is written: "json: PATH (N cells, M tensor checks)", a cell
// being one (precision, scan mode, comparison mode) of the run and a check one tensor in it.
std::string json_written_line(const std::string& path, std::size_t cells, std::size_t checks);

// The one rule for every file m3h writes (the value of `option`, e.g. "json" or "out"),
// checked before any work: its folder exists; an existing path is replaced only when it is a
// regular file (or a link to one) and `force` is set — a device, FIFO, folder or socket never,
// since the atomic rename would replace the node itself; a dangling symbolic link is refused
// (writing would create its target silently); and it is never the same file as any input option
// of the command (--config, --golden, --checkpoint, --resume, --data, --expect, --file,
// --against: one list, kInputOptions in cli.cpp), force or not. Each refusal is a UsageError of
// one line. "--json -" is stdout: nothing to check.
void check_output_path(const po::variables_map& vm, const std::string& option, bool force);

// The size guard of the CPU runs: a problem whose tensors cannot fit the machine's memory
// (about five doubles per registry tensor element of the larger scan mode) is refused before
// anything is allocated, naming both figures; --allow-large (problem_options) runs it anyway.
void check_host_memory(const po::variables_map& vm, const harness::RunSpec& spec);

// --stage as given: "" when it was not given (every key); a pattern that is empty or has an
// empty comma-separated item is a UsageError (it would match every key, or nothing named).
std::string stage_pattern(const po::variables_map& vm);

// For a --stage pattern that matches no key: "; nearest: K1, K2, K3" — the keys closest to
// the pattern's items by edit distance (Levenshtein, over the characters), at most three, in
// execution order among equals — or "" when there is no key.
std::string near_keys_note(const std::string& pattern, const std::vector<std::string>& keys);

// "seq,chunked" | "seq" | "chunked" | "both" → scan modes, in the given order, no duplicates.
std::vector<ScanMode> parse_scan_list(const std::string& s);

// "f32,bf16,f16" (any non-empty subset, in the given order, no duplicates; "all" = all three)
// → subject storage precisions. f64 is the oracle's precision and not a subject: a UsageError.
std::vector<Precision> parse_dtype_list(const std::string& s);

// --mode of compare: "e2e" | "isolated" | "both" (= e2e then isolated); anything else is a
// UsageError.
std::vector<harness::CompareMode> parse_compare_modes(const std::string& s);

// --device of every command that runs the model: "gpu", "cpu" or "auto" (the default: gpu
// when a usable GPU is present). Returns "gpu" or "cpu"; with auto and no GPU, prints ONE line
// on stderr saying so and what runs instead ("m3h: no GPU found: <fallback> (<why>)") and
// returns "cpu". An explicit gpu without a usable GPU, or anything else, is a UsageError.
std::string resolve_device(const std::string& device, const char* fallback);

// --oracle of compare and dump: "cpu" (reference<double> on the host, or a --golden file's
// stored oracle) or "gpu" (the GPU oracle in f64, every figure computed on the device:
// harness/device_compare.hpp). "gpu" needs a problem the command builds (not --golden, whose
// stored oracle is the oracle; not --sweep, whose problems are the CPU oracle's size), end to end
// only (--mode e2e, where the command has --mode), and the GPU subject (--device gpu, or auto
// with a usable GPU). Returns "cpu" or "gpu"; anything else, and every misuse, is a UsageError of
// one line. Called before resolve_device, so that auto without a GPU is that one line only.
std::string oracle_option(const po::variables_map& vm);

// The progress of a device comparison of `cells` cells (compare and dump --oracle gpu): each
// finished cell's line on stderr as "cell 2/6: <line>".
std::function<void(const std::string&)> cell_progress(std::size_t cells);

// Parses args against `desc`; any positional argument, and an empty value of any option that
// names a path, is a UsageError naming the command or the option.
// When desc has --config and it is given, the file's values are stored too (store_config_file).
// `config_fields`: what a --config file may set (default: the problem options).
po::variables_map parse_args(const std::vector<std::string>& args,
                             const po::options_description& desc, const char* command,
                             const po::options_description* config_fields = nullptr);

// "Usage: m3h <command> [options]" + the description, for --help.
void print_command_help(const char* command, const char* summary,
                        const po::options_description& desc);

// "m3h compare --dtype f32 …": the command line for reports.
std::string command_line(const char* command, const std::vector<std::string>& args);

}  // namespace m3::tools
