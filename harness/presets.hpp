// Named run presets: a config, a run shape, a seed and the kind of entering states. `m3h`
// starts from a preset and applies its overrides; golden cases and the adversarial inputs of
// HARNESS.md §9 (very strong decay, near-zero values, large angles, long T) will be added here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"

namespace m3::harness {

struct Preset {
  std::string name;
  std::string about;  // one line for --help
  Config cfg;
  Idx B = 2, T = 256;
  std::uint64_t seed = 1234;
  bool random_states = true;
};

const std::vector<Preset>& presets();
// Throws m3::Error listing the known names.
const Preset& find_preset(const std::string& name);

}  // namespace m3::harness
