// Parameter initialisation, states and seeded inputs (see params.hpp).
#include "params.hpp"

#include <cmath>

#include "error.hpp"
#include "registry.hpp"

namespace m3 {

std::uint64_t Rng::next() {
  std::uint64_t z = (s_ += kStep);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

double Rng::uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

double Rng::normalish() {
  // Sum of 4 U(0,1) has mean 2 and variance 1/3.
  double s = uniform() + uniform() + uniform() + uniform();
  return (s - 2.0) * std::sqrt(3.0);
}

namespace {

Idx param_numel(const Config& cfg, const char* name) {
  for (const auto& p : param_registry())
    if (std::string(p.name) == name) {
      if (!param_exists(p, cfg)) return 0;
      Idx n = 1;
      for (Idx d : resolve_shape(p.shape, cfg, 1, 1)) n *= d;
      return n;
    }
  throw Error("params", std::string("unknown parameter '") + name + "'", "");
}

template <class S>
Params<S> shaped_params(const Config& cfg) {
  Params<S> p;
  p.layers.resize(static_cast<size_t>(cfg.n_layers));
  for_each_param(p, [&](int, const char* name, std::vector<S>& v) {
    v.assign(static_cast<size_t>(param_numel(cfg, name)), S(0));
  });
  return p;
}

template <class S>
void fill_uniform(std::vector<S>& v, Rng& rng, double lo, double hi) {
  for (auto& e : v) e = static_cast<S>(rng.uniform(lo, hi));
}

template <class S>
void fill_const(std::vector<S>& v, double c) {
  for (auto& e : v) e = static_cast<S>(c);
}

}  // namespace

template <class S>
Params<S> zero_params(const Config& cfg) {
  cfg.validate();
  return shaped_params<S>(cfg);
}

template <class S>
Params<S> make_params(const Config& cfg, std::uint64_t seed, Init init) {
  cfg.validate();
  Params<S> p = shaped_params<S>(cfg);
  Rng rng(seed);
  const bool perturb = init == Init::Perturbed;
  // Multiplicative noise around 1 for the all-ones parameters when perturbing.
  auto ones = [&](std::vector<S>& v, double spread) {
    if (!perturb) return fill_const(v, 1.0);
    for (auto& e : v) e = static_cast<S>(1.0 + rng.uniform(-spread, spread));
  };
  if (!cfg.input_proj_identity) {
    const double bound = std::sqrt(3.0 / static_cast<double>(cfg.input_dim));
    fill_uniform(p.input_proj_w, rng, -bound, bound);
    if (perturb) fill_uniform(p.input_proj_b, rng, -0.1, 0.1);
  }
  const double in_bound = std::sqrt(3.0 / static_cast<double>(cfg.d_model));
  const double out_bound = std::sqrt(3.0 / static_cast<double>(cfg.d_inner()));
  const double ln_min = std::log(1e-3), ln_max = std::log(1e-1);
  for (auto& L : p.layers) {
    ones(L.norm_weight, 0.2);
    fill_uniform(L.in_proj_w, rng, -in_bound, in_bound);
    for (auto& e : L.dt_bias) {
      const double dt0 = std::max(1e-4, std::exp(rng.uniform() * (ln_max - ln_min) + ln_min));
      e = static_cast<S>(dt0 + std::log(-std::expm1(-dt0)));  // softplus⁻¹(dt0)
    }
    ones(L.b_norm_weight, 0.2);
    ones(L.c_norm_weight, 0.2);
    ones(L.b_bias, 0.3);
    ones(L.c_bias, 0.3);
    ones(L.d_param, 0.2);
    ones(L.norm_gate_weight, 0.2);
    fill_uniform(L.out_proj_w, rng, -out_bound, out_bound);
  }
  ones(p.norm_f_weight, 0.2);
  if (cfg.vocab_size > 0) fill_uniform(p.head_w, rng, -in_bound, in_bound);
  return p;
}

template <class To, class From>
Params<To> cast_params(const Params<From>& p) {
  Params<To> out;
  out.layers.resize(p.layers.size());
  // Walk both in the same order; the visitor order is fixed by for_each_param.
  std::vector<const std::vector<From>*> src;
  for_each_param(p, [&](int, const char*, const std::vector<From>& v) { src.push_back(&v); });
  size_t i = 0;
  for_each_param(out, [&](int, const char*, std::vector<To>& v) {
    v.assign(src[i]->begin(), src[i]->end());
    ++i;
  });
  return out;
}

StateSizes state_sizes(const Config& cfg) {
  return {cfg.nheads() * cfg.headdim * cfg.d_state, cfg.nheads() * cfg.d_state,
          cfg.nheads() * cfg.headdim, cfg.nheads() * cfg.num_rope_angles()};
}

template <class S>
States<S> zero_states(const Config& cfg, Idx B) {
  const StateSizes z = state_sizes(cfg);
  const Idx LB = cfg.n_layers * B;
  States<S> s;
  s.ssm.assign(static_cast<size_t>(LB * z.ssm), S(0));
  s.k.assign(static_cast<size_t>(LB * z.k), S(0));
  s.v.assign(static_cast<size_t>(LB * z.v), S(0));
  s.angle.assign(static_cast<size_t>(LB * z.angle), S(0));
  return s;
}

template <class S>
States<S> random_states(const Config& cfg, Idx B, std::uint64_t seed) {
  States<S> s = zero_states<S>(cfg, B);
  Rng rng(seed);
  fill_uniform(s.ssm, rng, -0.5, 0.5);
  fill_uniform(s.k, rng, -0.5, 0.5);
  fill_uniform(s.v, rng, -0.5, 0.5);
  fill_uniform(s.angle, rng, 0.0, 2.0 * M_PI);
  return s;
}

template <class To, class From>
States<To> cast_states(const States<From>& s) {
  States<To> o;
  o.ssm.assign(s.ssm.begin(), s.ssm.end());
  o.k.assign(s.k.begin(), s.k.end());
  o.v.assign(s.v.begin(), s.v.end());
  o.angle.assign(s.angle.begin(), s.angle.end());
  return o;
}

template <class S>
std::vector<S> make_input(const Config& cfg, Idx B, Idx T, std::uint64_t seed) {
  std::vector<S> x(static_cast<size_t>(B * T * cfg.input_dim));
  Rng rng(seed);
  for (auto& e : x) e = static_cast<S>(rng.normalish());
  return x;
}

template <class S>
std::vector<S> make_dout(const Config& cfg, Idx B, Idx T, std::uint64_t seed) {
  std::vector<S> d(static_cast<size_t>(B * T * cfg.d_model));
  Rng rng(seed);
  fill_uniform(d, rng, -1.0, 1.0);
  return d;
}

template <class S>
void check_params(const Params<S>& p, const Config& cfg, const char* where) {
  M3_REQUIRE(static_cast<Idx>(p.layers.size()) == cfg.n_layers, where,
             "parameter set has the wrong number of layers", "got ", p.layers.size(),
             ", config n_layers=", cfg.n_layers);
  for_each_param(p, [&](int layer, const char* name, const std::vector<S>& v) {
    const Idx want = param_numel(cfg, name);
    M3_REQUIRE(static_cast<Idx>(v.size()) == want, where,
               "parameter '" + param_key(layer, name).substr(5) + "' has the wrong size",
               "got ", v.size(), ", expected ", want);
  });
}

#define M3_INSTANTIATE(S)                                                      \
  template Params<S> make_params<S>(const Config&, std::uint64_t, Init);       \
  template Params<S> zero_params<S>(const Config&);                            \
  template States<S> zero_states<S>(const Config&, Idx);                       \
  template States<S> random_states<S>(const Config&, Idx, std::uint64_t);      \
  template std::vector<S> make_input<S>(const Config&, Idx, Idx, std::uint64_t); \
  template std::vector<S> make_dout<S>(const Config&, Idx, Idx, std::uint64_t);  \
  template void check_params<S>(const Params<S>&, const Config&, const char*);
M3_INSTANTIATE(double)
M3_INSTANTIATE(float)
#undef M3_INSTANTIATE
template Params<float> cast_params<float, double>(const Params<double>&);
template Params<double> cast_params<double, float>(const Params<float>&);
template Params<double> cast_params<double, double>(const Params<double>&);
template States<float> cast_states<float, double>(const States<double>&);
template States<double> cast_states<double, float>(const States<float>&);
template States<double> cast_states<double, double>(const States<double>&);

}  // namespace m3
