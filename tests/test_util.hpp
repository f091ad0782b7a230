// Helpers of the backbone-level tests (FD, sequential vs chunked, chaining, float vs double):
//
//   small_cfg(...)             a tiny valid Config (d_model 4, headdim 2, d_state 4, ...)
//   param_refs(p)              every parameter vector of a (const) Params<S> with its "grad/…"
//                              key, in the flat order of MODEL.md §2 (empty vectors skipped)
//   state_refs(s)              the four state vectors of a (const) States<S> with their names
//   random_like_states(...)    seeded U(−1, 1) weights shaped like the states (d_leaving)
//   dot(a, b)                  Σ a_i·b_i in double
//   window_rows(...)           rows t ∈ [t0, t1) of every sample of a [B*T, C] buffer
//   scale_key_for(key)         which captured tensor sets the error scale of `key`
//   RunResult / run_backbone   one forward + backward of Backbone<S>, everything returned
#pragma once

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "backbone.hpp"
#include "config.hpp"
#include "error.hpp"
#include "params.hpp"
#include "problem.hpp"
#include "registry.hpp"

namespace m3::test {

inline Config small_cfg(Idx d_model = 4, Idx headdim = 2, Idx d_state = 4, Idx ngroups = 1,
                        double rope_fraction = 0.5, bool outproj_norm = false, Idx n_layers = 1,
                        Idx chunk_size = 4, bool identity = false, Idx input_dim = 3) {
  Config c;
  c.d_model = d_model;
  c.expand = 2;
  c.headdim = headdim;
  c.d_state = d_state;
  c.ngroups = ngroups;
  c.n_layers = n_layers;
  c.rope_fraction = rope_fraction;
  c.a_floor = 1e-4;
  c.is_outproj_norm = outproj_norm;
  c.input_proj_identity = identity;
  c.input_dim = identity ? d_model : input_dim;
  c.chunk_size = chunk_size;
  return c;
}

// A named pointer to one parameter or state vector; V is std::vector<S> or const std::vector<S>.
template <class V>
struct NamedRef {
  std::string key;  // "grad/…" key of a parameter; "ssm", "k", "v", "angle" for a state
  V* v;
};

template <class P>
auto param_refs(P& p) {
  using V = std::remove_reference_t<decltype((p.norm_f_weight))>;
  std::vector<NamedRef<V>> out;
  for_each_param(p, [&](int layer, const char* name, V& v) {
    if (!v.empty()) out.push_back({param_key(layer, name), &v});
  });
  return out;
}

template <class St>
auto state_refs(St& s) {
  using V = std::remove_reference_t<decltype((s.ssm))>;
  std::vector<NamedRef<V>> out;
  out.push_back(NamedRef<V>{"ssm", &s.ssm});
  out.push_back(NamedRef<V>{"k", &s.k});
  out.push_back(NamedRef<V>{"v", &s.v});
  out.push_back(NamedRef<V>{"angle", &s.angle});
  return out;
}

inline States<double> random_like_states(const Config& cfg, Idx B, std::uint64_t seed) {
  States<double> w = zero_states<double>(cfg, B);
  Rng rng(seed);
  for (auto& r : state_refs(w))
    for (auto& e : *r.v) e = rng.uniform(-1.0, 1.0);
  return w;
}

template <class A, class B>
double dot(const A& a, const B& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
  return s;
}

// Rows t ∈ [t0, t1) of every sample of a [B*T, C] buffer → [B*(t1−t0), C].
template <class S>
std::vector<S> window_rows(const std::vector<S>& full, Idx B, Idx T, Idx C, Idx t0, Idx t1) {
  std::vector<S> out;
  out.reserve(static_cast<size_t>(B * (t1 - t0) * C));
  for (Idx b = 0; b < B; ++b)
    for (Idx t = t0; t < t1; ++t)
      for (Idx c = 0; c < C; ++c) out.push_back(full[static_cast<size_t>((b * T + t) * C + c)]);
  return out;
}

// Writes a window [B*(t1−t0), C] back into rows t ∈ [t0, t1) of a [B*T, C] buffer.
template <class S>
void put_window_rows(std::vector<S>& full, const std::vector<S>& win, Idx B, Idx T, Idx C, Idx t0,
                     Idx t1) {
  size_t i = 0;
  for (Idx b = 0; b < B; ++b)
    for (Idx t = t0; t < t1; ++t)
      for (Idx c = 0; c < C; ++c) full[static_cast<size_t>((b * T + t) * C + c)] = win[i++];
}

// The scale a captured tensor's error is measured against: the tensor itself, except for
// d_states/d_angle_state = Σ_t dθ_t (MODEL.md §6.2 B5a), a sum with cancellation that is exactly
// zero with zero entering states and zero leaving gradients (the loss is then invariant under
// a common shift of every θ_t: only relative angles θ_t − θ_s reach q·k). Its error is measured
// against its summands, B6/d_angle_cumsum of the same layer. Returns the key whose norm to use.
inline std::string scale_key_for(const std::string& key) {
  const std::string tail = "d_states/d_angle_state";
  if (key.size() >= tail.size() && key.compare(key.size() - tail.size(), tail.size(), tail) == 0)
    return key.substr(0, key.size() - tail.size()) + "B6/d_angle_cumsum";
  return key;
}

// One forward + backward of Backbone<S> on a double Problem cast to S.
template <class S>
struct RunResult {
  std::vector<S> out;       // [B*T, d_model]
  States<S> leaving;        // leaving states
  Params<S> grads;          // parameter gradients (from zero)
  std::vector<S> d_x;       // [B*T, input_dim]
  States<S> d_entering;     // gradients wrt the entering states
};

template <class S>
RunResult<S> run_backbone(const Problem& pb, ScanMode mode, const States<double>* d_leaving) {
  const Config& cfg = pb.cfg;
  const Params<S> p = cast_params<S>(pb.params);
  std::vector<S> x(pb.x.begin(), pb.x.end());
  std::vector<S> dout(pb.d_out.begin(), pb.d_out.end());
  RunResult<S> r;
  r.leaving = cast_states<S>(pb.states);
  Backbone<S> bb(cfg, pb.B, pb.T, mode);
  r.out = bb.forward(p, x, r.leaving);
  r.grads = zero_params<S>(cfg);
  r.d_x.assign(static_cast<size_t>(pb.B * pb.T * cfg.input_dim), S(0));
  r.d_entering = zero_states<S>(cfg, pb.B);
  States<S> dl;
  if (d_leaving) dl = cast_states<S>(*d_leaving);
  bb.backward(p, dout, d_leaving ? &dl : nullptr, r.grads, r.d_x, r.d_entering);
  return r;
}

}  // namespace m3::test
