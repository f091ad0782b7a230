// Shared m3h option parsing (see cli.hpp).
#include "cli.hpp"

#include <cerrno>
#include <cstdlib>
#include <iostream>
#include <sstream>

#include "presets.hpp"

namespace m3::tools {

std::uint64_t parse_seed(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos || text[first] == '-' || text[first] == '+')
    throw UsageError("--seed '" + text + "': expected an unsigned 64-bit integer");
  errno = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text.c_str(), &end, 0);
  if (errno == ERANGE || end == text.c_str() || *end != '\0')
    throw UsageError("--seed '" + text + "': expected an unsigned 64-bit integer");
  return static_cast<std::uint64_t>(v);
}

po::options_description problem_options() {
  std::string names;
  for (const auto& p : harness::presets())
    names += (names.empty() ? "" : "; ") + p.name + ": " + p.about;
  po::options_description d("Problem (a preset, then overrides)");
  // clang-format off
  d.add_options()
    ("preset", po::value<std::string>()->default_value("default"), ("named preset (" + names + ")").c_str())
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
    ("outproj-norm", po::value<bool>()->implicit_value(true), "gated RMSNorm before out_proj (is_outproj_norm)")
    ("chunk-size", po::value<Idx>(), "chunk size of the chunked scan")
    ("input-dim", po::value<Idx>(), "width of the backbone input X");
  // clang-format on
  return d;
}

harness::RunSpec problem_from(const po::variables_map& vm) {
  const harness::Preset& p = harness::find_preset(vm["preset"].as<std::string>());
  harness::RunSpec s;
  s.preset = p.name;
  s.cfg = p.cfg;
  s.B = p.B;
  s.T = p.T;
  s.seed = p.seed;
  s.random_states = p.random_states;
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
  if (vm.count("outproj-norm")) s.cfg.is_outproj_norm = vm["outproj-norm"].as<bool>();
  // X keeps the model width unless told otherwise (the default preset has input_dim = d_model).
  if (vm.count("input-dim")) s.cfg.input_dim = vm["input-dim"].as<Idx>();
  else if (vm.count("d-model") && p.cfg.input_dim == p.cfg.d_model) s.cfg.input_dim = s.cfg.d_model;
  validate_run(s.cfg, s.B, s.T);
  return s;
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

po::variables_map parse_args(const std::vector<std::string>& args,
                             const po::options_description& desc, const char* command) {
  po::variables_map vm;
  po::parsed_options parsed = po::command_line_parser(args).options(desc).run();
  for (const auto& o : parsed.options)
    if (o.position_key >= 0)
      throw UsageError(std::string(command) + ": unexpected argument '" + o.value.front() +
                       "' (see m3h " + command + " --help)");
  po::store(parsed, vm);
  po::notify(vm);
  return vm;
}

void print_command_help(const char* command, const char* summary,
                        const po::options_description& desc) {
  std::cout << "Usage: m3h " << command << " [options]\n\n" << summary << "\n\n" << desc << "\n";
}

}  // namespace m3::tools
