// Named run presets: a config, a run shape, a seed, the kind of entering states and, for the
// adversarial inputs of HARNESS.md §9, an adjustment applied to the seeded Problem after
// make_problem(). `m3h` starts from a preset and applies its overrides (command line, then a
// --config file); preset_problem() builds the Problem of a preset for any overridden shape.
//
//   default       Config{} (d_model 128, d_state 16, headdim 16, expand 2, 4 layers), B 2, T 256
//   official      the official Mamba-3 SISO width (d_model 1024, d_state 128, headdim 64,
//                 expand 2, ngroups 1, rope_fraction 0.5 → 32 angles, chunk 64) but B 1, T 64
//                 and ONE layer, so that the double oracle runs in seconds on a CPU
//   strong_decay  default widths, 2 layers; dt_bias += 4 (dt from ~1e-3…1e-1 to ~0.05…5) and the
//                 dd_a columns of in_proj_w ×2 (|A| up to ~8): A·dt down to ~−21, α = exp(A·dt)
//                 down to ~1e-9, every fast head forgets within a step; the angle columns ×0.1
//                 keep θ's step ω·dt near the default's (decay isolated from rotation)
//   near_zero     default widths, 2 layers; X and input_proj_b ×1e-4 (H⁰'s mean square below
//                 the RMSNorm ε: layer 0's post_norm ~3e-2 instead of ~1, and all that follows
//                 in layer 0 as small) and dOut ×1e-2 (every gradient ~100× smaller)
//   large_angles  default widths, 2 layers; the angle columns of in_proj_w ×4: ω = π·tanh(·)
//                 saturates near ±π, θ sweeps many turns per window and wraps constantly
//   long_t        default widths, ONE layer, B 1, T 1024 (16 chunks): error accumulation of θ
//                 and of the state over a long window
// Every adversarial adjustment is deterministic and scales fields of the seeded Problem; the
// seed still reproduces it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"
#include "problem.hpp"

namespace m3::harness {

struct Preset {
  std::string name;
  std::string about;  // one line for --help
  Config cfg;
  Idx B = 2, T = 256;
  std::uint64_t seed = 1234;
  bool random_states = true;
  // Applied to the seeded Problem after make_problem() (nullptr: none). Must keep the shapes.
  void (*adjust)(Problem&) = nullptr;
};

const std::vector<Preset>& presets();
// Throws m3::Error listing the known names.
const Preset& find_preset(const std::string& name);

// The official Mamba-3 widths (MODEL.md §1.1): d_model 1024, d_state 128, headdim 64,
// expand 2, ngroups 1, chunk 64; one layer, linear input_proj of width d_model.
Config official_config();

// make_problem(cfg, B, T, seed, random_states), then the preset's adjustment.
Problem preset_problem(const Preset& p, const Config& cfg, Idx B, Idx T, std::uint64_t seed,
                       bool random_states);

}  // namespace m3::harness
