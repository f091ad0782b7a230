// m3h: the command line of the differential harness.
//
//   m3h <command> [options]     m3h --help     m3h <command> --help
//
// Exit status (HARNESS.md §5): 0 success / all within budget, 1 some budget exceeded,
// 2 bad usage or bad input — any m3::Error, option error or other exception ends here as ONE
// line "m3h: error: ..." on stderr.
#include <algorithm>
#include <cstddef>
#include <exception>
#include <new>
#include <stdexcept>
#include <iostream>
#include <string>
#include <vector>

#include "cli.hpp"
#include "commands.hpp"
#include "device.hpp"
#include "golden.hpp"       // kGeneratorVersion: the version of the files and the tool
#include "report_json.hpp"  // build_type, build_compiler

#ifndef M3_GIT_DESCRIBE
#define M3_GIT_DESCRIBE "unknown"
#endif

namespace {

using m3::tools::Command;

// New subcommands (golden, dump, determinism) are one row here and one cmd_*.cpp.
const std::vector<Command>& commands() {
  static const std::vector<Command> table = {
      {"compare", "compare the subject with the double oracle, stage by stage",
       m3::tools::cmd_compare},
      {"bench", "time the reference (--reference)", m3::tools::cmd_bench},
      {"dump", "write oracle/subject/diff arrays of chosen tensors to HDF5", m3::tools::cmd_dump},
      {"golden", "regen / check / list the golden HDF5 files", m3::tools::cmd_golden},
      {"determinism", "run N times, require bit-identical tensors (names the first divergence)",
       m3::tools::cmd_determinism},
      {"train", "train a language model on the GPU path (or the CPU reference), with checkpoints",
       m3::tools::cmd_train},
      {"sample", "generate tokens from a checkpoint of m3h train", m3::tools::cmd_sample},
      {"eval", "validation loss and accuracy of a checkpoint on a text file or a task",
       m3::tools::cmd_eval},
      {"plot", "draw a training run's loss.png from its metrics.csv", m3::tools::cmd_plot},
      {"judge", "judge another implementation's tensors on a golden case, stage by stage",
       m3::tools::cmd_judge},
      {"export", "write a checkpoint's weights as safetensors (official Mamba-3 names)",
       m3::tools::cmd_export},
      {"import", "write a checkpoint from a safetensors file of export's naming",
       m3::tools::cmd_import},
      {"logits", "a checkpoint's reference logits on given tokens, with their budgets",
       m3::tools::cmd_logits},
  };
  return table;
}

void print_usage(std::ostream& os) {
  os << "Usage: m3h <command> [options]\n\n"
        "The differential harness of the Mamba-3 SISO backbone: an Eigen reference in double\n"
        "(the oracle) against the implementation under test, stage by stage.\n\n"
        "Commands:\n";
  std::size_t width = 0;  // the longest name and two spaces: no name is cut
  for (const auto& c : commands()) width = std::max(width, std::string(c.name).size() + 2);
  for (const auto& c : commands()) {
    std::string name = c.name;
    name.resize(width, ' ');
    os << "  " << name << c.summary << "\n";
  }
  os << "\n'm3h <command> --help' lists the options of a command; 'm3h --version' says which\n"
        "build this is.\n"
        "Exit status: 0 success (all within budget), 1 some budget exceeded, 2 bad usage or "
        "bad input.\n";
}

int dispatch(int argc, char** argv) {
  if (argc < 2) {
    std::string names;
    for (const auto& c : commands()) names += (names.empty() ? "" : ", ") + std::string(c.name);
    throw m3::tools::UsageError("no command given (one of " + names + "; see m3h --help)");
  }
  const std::string cmd = argv[1];
  if (cmd == "--version") {
    if (argc > 2) throw m3::tools::UsageError("--version takes no argument");
    // The version, the source revision (configure time), the build and whether it has CUDA.
    std::cout << "m3h " << m3::golden::kGeneratorVersion << " (git " << M3_GIT_DESCRIBE << "), "
              << m3::harness::build_type() << " build, " << m3::harness::build_compiler()
              << ", CUDA " << (m3::gpu::cuda_compiled() ? "yes" : "no") << "\n";
    return 0;
  }
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    if (cmd == "help" && argc > 2) {
      for (const auto& c : commands())
        if (argv[2] == std::string(c.name)) return c.run({"--help"});
      throw m3::tools::UsageError(std::string("unknown command '") + argv[2] +
                                  "' (see m3h --help)");
    }
    print_usage(std::cout);
    return 0;
  }
  for (const auto& c : commands())
    if (cmd == c.name) return c.run(std::vector<std::string>(argv + 2, argv + argc));
  throw m3::tools::UsageError("unknown command '" + cmd + "' (see m3h --help)");
}

}  // namespace

int main(int argc, char** argv) {
  // One line, whatever the message holds (control characters escaped, long text cut), and no
  // C++ internals: the two library exceptions a too-large run can raise are said in words.
  auto fail = [](const std::string& what) {
    std::cerr << "m3h: error: " << m3::tools::echo(what, 400) << "\n";
    return 2;
  };
  try {
    return dispatch(argc, argv);
  } catch (const std::bad_alloc&) {
    return fail("out of host memory: the run needs more memory than this machine can give "
                "(reduce B, T, the widths or the layers)");
  } catch (const std::length_error&) {
    return fail("a size is too large for this machine (reduce B, T, the widths or the layers)");
  } catch (const std::exception& e) {  // UsageError, m3::Error, program_options errors, …
    return fail(e.what());
  }
}
