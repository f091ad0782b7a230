// Parameters (MODEL.md §2), persistent states (§9, §12.4) and seeded realistic inputs
// (HARNESS.md §9).
//
// Parameters, per layer: norm_weight [dm], in_proj_w [dm, ip], dt_bias [nh],
// b_norm_weight [ds], c_norm_weight [ds], b_bias [nh, ds], c_bias [nh, ds], d_param [nh],
// norm_gate_weight [di], out_proj_w [di, dm]; backbone: input_proj_w [input_dim, dm],
// input_proj_b [dm] (empty when input_proj is the identity), norm_f_weight [dm], head_w
// [dm, V] (token models only, vocab_size = V > 0; empty otherwise).
// Linear weights are [in, out] and used as Y = X·W.
//
// Initialisation (§2): norms, b/c biases and D = 1; in_proj_w, out_proj_w, input_proj_w
// Kaiming-uniform with bound sqrt(3/fan_in); input_proj_b = 0;
// dt_bias = softplus⁻¹(dt₀), dt₀ = max(1e-4, exp(U·(ln 0.1 − ln 0.001) + ln 0.001));
// head_w Kaiming-uniform sqrt(3/dm), drawn last (so a model without a head draws the same).
// Randomness comes from SplitMix64 with our own integer→double mapping, so the same seed
// gives the same bytes on every machine (no std::*_distribution).
//
// States, layout [L][B][…] (§12.6): ssm [L, B, nh, hd, ds], k [L, B, nh, ds],
// v [L, B, nh, hd], angle [L, B, nh, na].
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config.hpp"

namespace m3 {

// SplitMix64; uniform() is exactly (next() >> 11) · 2⁻⁵³ ∈ [0, 1).
class Rng {
 public:
  explicit Rng(std::uint64_t seed) : s_(seed) {}
  std::uint64_t next();
  double uniform();                         // [0, 1)
  double uniform(double lo, double hi);     // [lo, hi)
  double normalish();                       // Irwin–Hall(4), mean 0, variance 1
  // Skips n draws of next() in O(1): SplitMix64's state steps by a constant, so the stream from
  // any position can be taken up (perturbed.cpp draws one stream in parallel pieces).
  void discard(std::uint64_t n) { s_ += n * kStep; }

 private:
  static constexpr std::uint64_t kStep = 0x9E3779B97F4A7C15ull;
  std::uint64_t s_;
};

template <class S>
struct LayerParams {
  std::vector<S> norm_weight, in_proj_w, dt_bias, b_norm_weight, c_norm_weight, b_bias, c_bias,
      d_param, norm_gate_weight, out_proj_w;
};

template <class S>
struct Params {
  std::vector<S> input_proj_w, input_proj_b;
  std::vector<LayerParams<S>> layers;
  std::vector<S> norm_f_weight;
  std::vector<S> head_w;  // [d_model, V]; empty unless vocab_size > 0 (TRAINING.md §1)
};

// Calls f(layer, name, vec) for every parameter vector in the flat order of MODEL.md §2
// (layer = -1 for backbone parameters). Works for const and non-const Params.
template <class P, class F>
void for_each_param(P& p, F&& f) {
  f(-1, "input_proj_w", p.input_proj_w);
  f(-1, "input_proj_b", p.input_proj_b);
  for (size_t l = 0; l < p.layers.size(); ++l) {
    auto& L = p.layers[l];
    const int li = static_cast<int>(l);
    f(li, "norm_weight", L.norm_weight);
    f(li, "in_proj_w", L.in_proj_w);
    f(li, "dt_bias", L.dt_bias);
    f(li, "b_norm_weight", L.b_norm_weight);
    f(li, "c_norm_weight", L.c_norm_weight);
    f(li, "b_bias", L.b_bias);
    f(li, "c_bias", L.c_bias);
    f(li, "d_param", L.d_param);
    f(li, "norm_gate_weight", L.norm_gate_weight);
    f(li, "out_proj_w", L.out_proj_w);
  }
  f(-1, "norm_f_weight", p.norm_f_weight);
  f(-1, "head_w", p.head_w);
}

enum class Init {
  Spec,       // exactly MODEL.md §2
  Perturbed,  // §2, then every all-ones/zero vector gets seeded noise so that no symmetry
              // hides a wrong index (norm weights, biases, D: 1 ± 0.2/0.3; input_proj_b ±0.1)
};

template <class S>
Params<S> make_params(const Config& cfg, std::uint64_t seed, Init init = Init::Perturbed);

// Zero-filled parameters of the right shapes (a gradient buffer).
template <class S>
Params<S> zero_params(const Config& cfg);

template <class To, class From>
Params<To> cast_params(const Params<From>& p);

template <class S>
struct States {
  std::vector<S> ssm, k, v, angle;
};

template <class S>
States<S> zero_states(const Config& cfg, Idx B);

// Random entering states: ssm, k, v ~ U(−0.5, 0.5), angle ~ U(0, 2π).
template <class S>
States<S> random_states(const Config& cfg, Idx B, std::uint64_t seed);

template <class To, class From>
States<To> cast_states(const States<From>& s);

// Per-(layer, b) element counts of each state.
struct StateSizes {
  Idx ssm, k, v, angle;
};
StateSizes state_sizes(const Config& cfg);

// Seeded backbone input X [B*T, input_dim] (Irwin–Hall noise, unit variance).
template <class S>
std::vector<S> make_input(const Config& cfg, Idx B, Idx T, std::uint64_t seed);
// Seeded output gradient dOut [B*T, d_model], uniform in (−1, 1).
template <class S>
std::vector<S> make_dout(const Config& cfg, Idx B, Idx T, std::uint64_t seed);

// Checks every parameter's size against the registry shape (throws naming the parameter).
template <class S>
void check_params(const Params<S>& p, const Config& cfg, const char* where);

}  // namespace m3
