// The preset table (see presets.hpp).
#include "presets.hpp"

#include "error.hpp"

namespace m3::harness {

namespace {

std::vector<Preset> build_presets() {
  std::vector<Preset> p;
  {
    Preset d;
    d.name = "default";
    d.about = "Config{} defaults (d_model 128, d_state 16, headdim 16, expand 2, 4 layers), "
              "B=2, T=256, seed 1234, random entering states";
    d.cfg = Config{};
    d.B = 2;
    d.T = 256;
    d.seed = 1234;
    d.random_states = true;
    p.push_back(d);
  }
  return p;
}

}  // namespace

const std::vector<Preset>& presets() {
  static const std::vector<Preset> table = build_presets();
  return table;
}

const Preset& find_preset(const std::string& name) {
  std::string known;
  for (const auto& p : presets()) {
    if (p.name == name) return p;
    known += (known.empty() ? "" : ", ") + p.name;
  }
  throw Error("preset", "unknown preset '" + name + "'", "known presets: " + known);
}

}  // namespace m3::harness
