// Shared command-line pieces of `m3h`: the usage-error type, the config/run-shape options every
// subcommand that builds a Problem accepts, and parsing helpers. Only parsing lives in tools/;
// what a command does lives in harness/ (run.hpp, bench.hpp, report.hpp).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <boost/program_options.hpp>

#include "config.hpp"
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

// --preset, --B, --T, --seed, --zero-states and the Config overrides (--d-model, --d-state,
// --headdim, --expand, --ngroups, --layers, --rope-fraction, --outproj-norm, --chunk-size,
// --input-dim).
po::options_description problem_options();

// The preset named by --preset with every given override applied; validated (throws m3::Error).
harness::RunSpec problem_from(const po::variables_map& vm);

// A seed: decimal or 0x-hex, 0 … 2^64−1; anything else (a sign, garbage, overflow) is a UsageError.
std::uint64_t parse_seed(const std::string& text);

// "seq,chunked" | "seq" | "chunked" | "both" → scan modes, in the given order, no duplicates.
std::vector<ScanMode> parse_scan_list(const std::string& s);

// Parses args against `desc`; any positional argument is a UsageError naming the command.
po::variables_map parse_args(const std::vector<std::string>& args,
                             const po::options_description& desc, const char* command);

// "Usage: m3h <command> [options]" + the description, for --help.
void print_command_help(const char* command, const char* summary,
                        const po::options_description& desc);

}  // namespace m3::tools
