// The backbone (MODEL.md §3) chaining the stage functions of stages.hpp in the order of the
// registry's stage table — one layer's forward F1 → F2 → F3 → F4 → F5 → F4ef → F5b → F6 → F7 →
// F8 and backward B8 → B7 → B6 → B5a → B5b → B4 → B3 → B2 → B1 (+ residual) — with the capture
// of every registry tensor after the stage that writes it (act_fields / grad_fields name the
// buffers).
//
//   forward : H⁰ = X·W_in + b_in (or X) ; Hˡ⁺¹ = Hˡ + out_proj(gate(SSM(…RMSNorm(Hˡ)))) ;
//             Out = RMSNorm(H^L; norm_f_weight)
//   backward: δ^L = RMSNorm_bwd(dOut); per layer δˡ = δˡ⁺¹ + B1(…B8(δˡ⁺¹));
//             dX = δ⁰·W_inᵀ (or δ⁰)
// Buffers are allocated once per (config, B, T, mode) in the constructor.
#include "backbone.hpp"
#include "lm.hpp"

#include <algorithm>

#include "error.hpp"
#include "registry.hpp"
#include "stages.hpp"

namespace m3 {

namespace ref {

Dims Dims::of(const Config& cfg, Idx B, Idx T, Precision storage) {
  Dims d;
  d.storage = storage;
  d.B = B;
  d.T = T;
  d.BT = B * T;
  d.dm = cfg.d_model;
  d.di = cfg.d_inner();
  d.hd = cfg.headdim;
  d.nh = cfg.nheads();
  d.ds = cfg.d_state;
  d.ng = cfg.ngroups;
  d.na = cfg.num_rope_angles();
  d.ip = cfg.in_proj_dim();
  d.cs = cfg.chunk_size;
  d.nc = cfg.n_chunks(T);
  d.hpg = cfg.heads_per_group();
  d.in = cfg.input_dim;
  d.a_floor = cfg.a_floor;
  d.outproj_norm = cfg.is_outproj_norm;
  return d;
}

template <class S>
void store_typed(const Dims& d, S* v, Idx n) {
  if (d.storage == Precision::BF16) {
    for (Idx i = 0; i < n; ++i) v[i] = static_cast<S>(round_bf16(static_cast<float>(v[i])));
  } else if (d.storage == Precision::F16) {
    for (Idx i = 0; i < n; ++i) v[i] = static_cast<S>(round_f16(static_cast<float>(v[i])));
  }
}

template <class S>
void store_typed(const Dims& d, std::vector<S>& v) {
  store_typed(d, v.data(), static_cast<Idx>(v.size()));
}

template void store_typed<double>(const Dims&, std::vector<double>&);
template void store_typed<float>(const Dims&, std::vector<float>&);
template void store_typed<double>(const Dims&, double*, Idx);
template void store_typed<float>(const Dims&, float*, Idx);

namespace {
template <class S>
void sized(std::vector<S>& v, Idx n) {
  v.assign(static_cast<size_t>(n), S(0));
}
}  // namespace

template <class S>
void LayerActs<S>::allocate(const Dims& d, ScanMode mode) {
  const Idx BT = d.BT, nh = d.nh;
  for (auto* v : {&ssm_in, &ssm_out}) sized(*v, d.B * nh * d.hd * d.ds);
  for (auto* v : {&k_in, &k_out}) sized(*v, d.B * nh * d.ds);
  for (auto* v : {&v_in, &v_out}) sized(*v, d.B * nh * d.hd);
  for (auto* v : {&angle_in, &angle_out}) sized(*v, d.B * nh * d.na);
  for (auto* v : {&residual, &post_norm, &out_flat, &layer_output}) sized(*v, BT * d.dm);
  sized(rms_vals, BT);
  sized(proj, BT * d.ip);
  for (auto* v : {&z, &x, &y, &gated}) sized(*v, BT * d.di);
  for (auto* v : {&b_raw, &c_raw, &b_normed, &c_normed}) sized(*v, BT * d.ng * d.ds);
  for (auto* v : {&b_rms, &c_rms}) sized(*v, BT * d.ng);
  for (auto* v : {&dd_dt_raw, &dd_a_raw, &trap_raw, &dt, &a_val, &trap, &alpha, &beta, &gamma})
    sized(*v, BT * nh);
  sized(angles_raw, BT * d.na);
  sized(angle_cumsum, BT * nh * d.na);
  for (auto* v : {&b_biased, &c_biased, &k, &q}) sized(*v, BT * nh * d.ds);
  sized(gated_rms_vals, d.outproj_norm ? BT * nh : 0);
  if (mode == ScanMode::Sequential) {
    sized(h_saved, d.B * (d.T + 1) * d.ds * d.di);
    sized(k_prev_saved, BT * nh * d.ds);
    sized(v_prev_saved, BT * nh * d.hd);
  } else {
    for (auto* v : {&adt, &qk_dot_saved, &scale_saved, &gamma_saved}) sized(*v, BT * nh);
    sized(k_scaled_saved, BT * nh * d.ds);
    sized(da_cumsum_saved, d.B * d.nc * nh * d.cs);
    for (auto* v : {&chunk_states, &chunk_states_saved}) sized(*v, d.B * d.nc * nh * d.hd * d.ds);
    sized(final_states, d.B * nh * d.hd * d.ds);
  }
}

template <class S>
void LayerGrads<S>::allocate(const Dims& d, ScanMode mode) {
  const Idx BT = d.BT, nh = d.nh;
  for (auto* v : {&d_ssm_out, &d_ssm_in}) sized(*v, d.B * nh * d.hd * d.ds);
  for (auto* v : {&d_k_out, &d_k_in}) sized(*v, d.B * nh * d.ds);
  for (auto* v : {&d_v_out, &d_v_in}) sized(*v, d.B * nh * d.hd);
  for (auto* v : {&d_angle_out, &d_angle_in}) sized(*v, d.B * nh * d.na);
  for (auto* v : {&d_gated, &d_y, &d_z, &d_x}) sized(*v, BT * d.di);
  for (auto* v : {&d_b_pre_rope, &d_c_pre_rope}) sized(*v, BT * nh * d.ds);
  sized(d_angle_cumsum, BT * nh * d.na);
  for (auto* v : {&d_adt_total, &d_dt_direct, &d_trap_sig, &d_dt_angle, &d_dd_dt, &d_dd_a,
                  &d_trap_raw})
    sized(*v, BT * nh);
  sized(d_angles_raw, BT * d.na);
  for (auto* v : {&d_b_normed, &d_c_normed, &d_b_raw, &d_c_raw}) sized(*v, BT * d.ng * d.ds);
  sized(d_proj, BT * d.ip);
  for (auto* v : {&d_norm, &d_pre_norm, &d_temporal}) sized(*v, BT * d.dm);
  if (mode == ScanMode::Sequential) {
    for (auto* v : {&d_q, &d_k}) sized(*v, BT * nh * d.ds);
    for (auto* v : {&d_alpha, &d_beta, &d_gamma}) sized(*v, BT * nh);
    sized(d_d_local, d.B * d.di);
  } else {
    sized(da_cs_sum, d.B * d.nc * nh);
    for (auto* v : {&dQ_mid, &dK_mid}) sized(*v, BT * nh * d.ds);
    for (auto* v : {&dADT, &dQK_dot, &dScale, &dGamma, &dDT}) sized(*v, BT * nh);
    sized(dD_partials, d.B * nh);
  }
}

// Every per-layer registry tensor of the forward, and the buffer holding it.
template <class S>
std::vector<TensorField<S>> act_fields(LayerActs<S>& a) {
  return {{"F1", "residual", &a.residual},       {"F1", "rms_vals", &a.rms_vals},
          {"F1", "post_norm", &a.post_norm},     {"F2", "proj", &a.proj},
          {"F3", "z", &a.z},                     {"F3", "x", &a.x},
          {"F3", "b_raw", &a.b_raw},             {"F3", "c_raw", &a.c_raw},
          {"F3", "dd_dt_raw", &a.dd_dt_raw},     {"F3", "dd_a_raw", &a.dd_a_raw},
          {"F3", "trap_raw", &a.trap_raw},       {"F3", "angles_raw", &a.angles_raw},
          {"F3", "dt", &a.dt},                   {"F3", "a_val", &a.a_val},
          {"F3", "trap", &a.trap},               {"F4", "b_normed", &a.b_normed},
          {"F4", "c_normed", &a.c_normed},       {"F4", "b_rms", &a.b_rms},
          {"F4", "c_rms", &a.c_rms},             {"F4", "b_biased", &a.b_biased},
          {"F4", "c_biased", &a.c_biased},       {"F5", "angle_cumsum", &a.angle_cumsum},
          {"F4ef", "k", &a.k},                   {"F4ef", "q", &a.q},
          {"F5b", "alpha", &a.alpha},            {"F5b", "beta", &a.beta},
          {"F5b", "gamma", &a.gamma},            {"F6", "h_saved", &a.h_saved},
          {"F6", "k_prev_saved", &a.k_prev_saved}, {"F6", "v_prev_saved", &a.v_prev_saved},
          {"F6", "adt", &a.adt},                 {"F6", "k_scaled_saved", &a.k_scaled_saved},
          {"F6", "qk_dot_saved", &a.qk_dot_saved}, {"F6", "scale_saved", &a.scale_saved},
          {"F6", "gamma_saved", &a.gamma_saved}, {"F6", "da_cumsum_saved", &a.da_cumsum_saved},
          {"F6", "chunk_states", &a.chunk_states},
          {"F6", "chunk_states_saved", &a.chunk_states_saved},
          {"F6", "final_states", &a.final_states}, {"F6", "y", &a.y},
          {"F7", "gated_rms_vals", &a.gated_rms_vals}, {"F7", "gated", &a.gated},
          {"F8", "out_flat", &a.out_flat},       {"F8", "layer_output", &a.layer_output},
          {"states", "ssm_state", &a.ssm_out},   {"states", "k_state", &a.k_out},
          {"states", "v_state", &a.v_out},       {"states", "angle_state", &a.angle_out}};
}

// Every per-layer registry tensor of the backward.
template <class S>
std::vector<TensorField<S>> grad_fields(LayerGrads<S>& g) {
  return {{"B8", "d_gated", &g.d_gated},          {"B7", "d_y", &g.d_y},
          {"B7", "d_z", &g.d_z},                  {"B6", "d_q", &g.d_q},
          {"B6", "d_k", &g.d_k},                  {"B6", "d_alpha", &g.d_alpha},
          {"B6", "d_beta", &g.d_beta},            {"B6", "d_gamma", &g.d_gamma},
          {"B6", "d_d_local", &g.d_d_local},      {"B6", "da_cs_sum", &g.da_cs_sum},
          {"B6", "dQ_mid", &g.dQ_mid},            {"B6", "dK_mid", &g.dK_mid},
          {"B6", "dADT", &g.dADT},                {"B6", "dQK_dot", &g.dQK_dot},
          {"B6", "dD_partials", &g.dD_partials},  {"B6", "dScale", &g.dScale},
          {"B6", "dGamma", &g.dGamma},            {"B6", "dDT", &g.dDT},
          {"B6", "d_x", &g.d_x},                  {"B6", "d_b_pre_rope", &g.d_b_pre_rope},
          {"B6", "d_c_pre_rope", &g.d_c_pre_rope}, {"B6", "d_angle_cumsum", &g.d_angle_cumsum},
          {"B6", "d_adt_total", &g.d_adt_total},  {"B6", "d_dt_direct", &g.d_dt_direct},
          {"B6", "d_trap_sig", &g.d_trap_sig},    {"B5a", "d_angles_raw", &g.d_angles_raw},
          {"B5a", "d_dt_angle", &g.d_dt_angle},   {"B5b", "d_dd_dt", &g.d_dd_dt},
          {"B5b", "d_dd_a", &g.d_dd_a},           {"B5b", "d_trap_raw", &g.d_trap_raw},
          {"B4b", "d_b_normed", &g.d_b_normed},   {"B4b", "d_c_normed", &g.d_c_normed},
          {"B4c", "d_b_raw", &g.d_b_raw},         {"B4c", "d_c_raw", &g.d_c_raw},
          {"B3", "d_proj", &g.d_proj},            {"B2", "d_norm", &g.d_norm},
          {"B1", "d_pre_norm", &g.d_pre_norm},    {"B1", "d_temporal", &g.d_temporal},
          {"d_states", "d_ssm_state", &g.d_ssm_in}, {"d_states", "d_k_state", &g.d_k_in},
          {"d_states", "d_v_state", &g.d_v_in},   {"d_states", "d_angle_state", &g.d_angle_in}};
}

template <class S>
void layer_forward_step(const Dims& d, ScanMode mode, const std::string& st,
                        const LayerParams<S>& p, const S* w_in, const S* w_out, LayerActs<S>& a) {
  if (st == "F1") {
    ref::rmsnorm_forward(d.BT, d.dm, a.residual.data(), p.norm_weight.data(), a.post_norm.data(),
                         a.rms_vals.data());
    ref::store_typed(d, a.post_norm);
  } else if (st == "F2") {
    ref::linear_forward(d.BT, d.dm, d.ip, a.post_norm.data(), w_in,
                        static_cast<const S*>(nullptr), a.proj.data());
    ref::store_typed(d, a.proj);
  } else if (st == "F3") {
    ref::split_forward(d, p, a);
  } else if (st == "F4") {
    ref::bcnorm_forward(d, p, a);
  } else if (st == "F5") {  // and the leaving angle state
    ref::angle_forward(d, a);
  } else if (st == "F4ef") {
    ref::rope_forward(d, a);
    ref::store_typed(d, a.k);
    ref::store_typed(d, a.q);
  } else if (st == "F5b") {
    ref::abg_forward(d, a);
  } else if (st == "F6") {  // and the leaving ssm, k, v states
    if (mode == ScanMode::Sequential) {
      ref::ssm_seq_forward(d, p, a);
    } else {
      ref::ssm_chunked_forward(d, p, a);
    }
    ref::store_typed(d, a.y);
  } else if (st == "F7") {
    ref::gating_forward(d, p, a);
    ref::store_typed(d, a.gated);
  } else if (st == "F8") {
    ref::linear_forward(d.BT, d.di, d.dm, a.gated.data(), w_out,
                        static_cast<const S*>(nullptr), a.out_flat.data());
    ref::store_typed(d, a.out_flat);
    for (Idx i = 0; i < d.BT * d.dm; ++i) a.layer_output[i] = a.residual[i] + a.out_flat[i];
  } else if (st != "states") {  // "states": written by F5 and F6
    throw Error("Backbone", "stage '" + st + "' of the stage table has no step",
                "reference/backbone.cpp layer_forward_step lists every layer forward stage");
  }
}


template <class S>
void layer_backward_step(const Dims& d, ScanMode mode, const std::string& st,
                         const LayerParams<S>& p, const S* w_in, const S* w_out,
                         const LayerActs<S>& a, const std::vector<S>& dlt, const S* delta_typed,
                         LayerGrads<S>& g, LayerParams<S>& pg) {
  if (st == "B8") {
    ref::linear_backward(d.BT, d.di, d.dm, a.gated.data(), w_out, delta_typed,
                         g.d_gated.data(), pg.out_proj_w.data(), static_cast<S*>(nullptr));
    ref::store_typed(d, g.d_gated);
  } else if (st == "B7") {
    ref::gating_backward(d, p, a, g, pg);
    ref::store_typed(d, g.d_y);
    ref::store_typed(d, g.d_z);
  } else if (st == "B6") {  // and the entering ssm, k, v state gradients
    if (mode == ScanMode::Sequential) {
      ref::ssm_seq_backward(d, p, a, g, pg);
      ref::rope_backward(d, a, g);
      ref::abg_backward(d, a, g);
    } else {
      ref::ssm_chunked_backward(d, p, a, g, pg);
    }
    ref::store_typed(d, g.d_x);
  } else if (st == "B5a") {  // and the entering angle state gradient
    ref::angle_backward(d, a, g);
  } else if (st == "B5b") {
    ref::activations_backward(d, p, a, g, pg);
  } else if (st == "B4b") {  // B4b and B4c in one step
    ref::bcnorm_backward(d, p, a, g, pg);
  } else if (st == "B3") {
    ref::split_backward(d, g);
    ref::store_typed(d, g.d_proj);
  } else if (st == "B2") {
    ref::linear_backward(d.BT, d.dm, d.ip, a.post_norm.data(), w_in, g.d_proj.data(),
                         g.d_norm.data(), pg.in_proj_w.data(), static_cast<S*>(nullptr));
    ref::store_typed(d, g.d_norm);
  } else if (st == "B1") {
    ref::rmsnorm_backward(d.BT, d.dm, a.residual.data(), p.norm_weight.data(),
                          a.rms_vals.data(), g.d_norm.data(), g.d_pre_norm.data(),
                          pg.norm_weight.data());
    for (Idx i = 0; i < d.BT * d.dm; ++i) g.d_temporal[i] = dlt[i] + g.d_pre_norm[i];
  } else if (st != "B4c" && st != "d_states") {  // written by B4b, and by B6 and B5a
    throw Error("Backbone", "stage '" + st + "' of the stage table has no step",
                "reference/backbone.cpp layer_backward_step lists every layer backward stage");
  }
}

template void layer_forward_step<double>(const Dims&, ScanMode, const std::string&,
                                         const LayerParams<double>&, const double*,
                                         const double*, LayerActs<double>&);
template void layer_forward_step<float>(const Dims&, ScanMode, const std::string&,
                                        const LayerParams<float>&, const float*, const float*,
                                        LayerActs<float>&);
template void layer_backward_step<double>(const Dims&, ScanMode, const std::string&,
                                          const LayerParams<double>&, const double*,
                                          const double*, const LayerActs<double>&,
                                          const std::vector<double>&, const double*,
                                          LayerGrads<double>&, LayerParams<double>&);
template void layer_backward_step<float>(const Dims&, ScanMode, const std::string&,
                                         const LayerParams<float>&, const float*, const float*,
                                         const LayerActs<float>&, const std::vector<float>&,
                                         const float*, LayerGrads<float>&,
                                         LayerParams<float>&);

template std::vector<TensorField<double>> act_fields(LayerActs<double>&);
template std::vector<TensorField<float>> act_fields(LayerActs<float>&);
template std::vector<TensorField<double>> grad_fields(LayerGrads<double>&);
template std::vector<TensorField<float>> grad_fields(LayerGrads<float>&);

template struct LayerActs<double>;
template struct LayerActs<float>;
template struct LayerGrads<double>;
template struct LayerGrads<float>;

}  // namespace ref

using ref::Dims;
using ref::LayerActs;
using ref::LayerGrads;

template <class S>
struct Backbone<S>::Impl {
  Config cfg;
  Dims d;
  ScanMode mode;
  std::vector<LayerActs<S>> acts;
  LayerGrads<S> lg;
  std::vector<S> x_in, h0, norm_f_input, norm_f_rms, out, d_norm_f, delta, delta_typed;
  // Compute copies of the GEMM weights in the storage precision (MODEL.md §8), refreshed from
  // the master weights at every forward; with exact storage they alias the masters.
  std::vector<std::vector<S>> w_in_typed, w_out_typed;
  std::vector<S> w_input_typed;
  bool have_forward = false;
  std::vector<std::int32_t> tokens;  // the last forward_tokens' input (empty after forward())
  std::vector<StageEntry> table;                    // the registry's stage table of the run
  std::vector<const StageEntry*> layer_fwd, layer_bwd;  // its per-layer stages, in order

  Impl(const Config& c, Idx B, Idx T, ScanMode m, Precision storage)
      : cfg(c), d(Dims::of(c, B, T, storage)), mode(m), table(stage_table(c, m)) {
    for (const StageEntry& e : table)
      if (e.scope == Scope::Layer) (e.dir == Dir::Forward ? layer_fwd : layer_bwd).push_back(&e);
    acts.resize(static_cast<size_t>(c.n_layers));
    for (auto& a : acts) a.allocate(d, m);
    lg.allocate(d, m);
    const size_t BTdm = static_cast<size_t>(d.BT * d.dm);
    h0.assign(BTdm, S(0));
    norm_f_input.assign(BTdm, S(0));
    norm_f_rms.assign(static_cast<size_t>(d.BT), S(0));
    out.assign(BTdm, S(0));
    d_norm_f.assign(BTdm, S(0));
    delta.assign(BTdm, S(0));
    delta_typed.assign(BTdm, S(0));
    w_in_typed.resize(acts.size());
    w_out_typed.resize(acts.size());
  }

  bool typed() const { return d.storage == Precision::BF16 || d.storage == Precision::F16; }
  // The layers and norm_f from H⁰ (set by forward or forward_tokens).
  const std::vector<S>& forward_layers(const Params<S>& p, States<S>& states, Capture* cap);

  void refresh_typed_weights(const Params<S>& p) {
    if (!typed()) return;
    w_input_typed = p.input_proj_w;
    ref::store_typed(d, w_input_typed);
    for (size_t l = 0; l < acts.size(); ++l) {
      w_in_typed[l] = p.layers[l].in_proj_w;
      ref::store_typed(d, w_in_typed[l]);
      w_out_typed[l] = p.layers[l].out_proj_w;
      ref::store_typed(d, w_out_typed[l]);
    }
  }
  const S* w_in(int l, const LayerParams<S>& p) const {
    return typed() ? w_in_typed[l].data() : p.in_proj_w.data();
  }
  const S* w_out(int l, const LayerParams<S>& p) const {
    return typed() ? w_out_typed[l].data() : p.out_proj_w.data();
  }
  const S* w_input(const Params<S>& p) const {
    return typed() ? w_input_typed.data() : p.input_proj_w.data();
  }
  // The typed copy of a residual-stream gradient that feeds a GEMM (§8 "staged typed copy").
  const S* typed_copy(const std::vector<S>& v) {
    if (!typed()) return v.data();
    delta_typed = v;
    ref::store_typed(d, delta_typed);
    return delta_typed.data();
  }

  // Captures `v` under (layer, stage, tensor) when the registry says the run produces it.
  void put(Capture* cap, int layer, const char* stage, const char* tensor, const std::vector<S>& v) {
    if (!cap || !exists_in(find_spec(stage, tensor), cfg, mode)) return;
    cap->put_stage(layer, stage, tensor, v.data(), static_cast<Idx>(v.size()));
  }

  // The [B, …] slice of layer l in a [L][B][…] state buffer.
  static void take(const std::vector<S>& all, int l, std::vector<S>& slice) {
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(l * slice.size()), slice.size(),
                slice.begin());
  }
  static void give(const std::vector<S>& slice, int l, std::vector<S>& all) {
    std::copy(slice.begin(), slice.end(), all.begin() + static_cast<std::ptrdiff_t>(l * slice.size()));
  }

  // Captures every tensor of (layer l, stage) that the run produces, in the registry's order,
  // from the buffers `fields` names.
  void put_stage(Capture* cap, int l, const std::string& stage,
                 const std::vector<ref::TensorField<S>>& fields) {
    if (!cap) return;
    for (const TensorSpec& spec : stage_registry()) {
      if (spec.scope != Scope::Layer || stage != spec.stage) continue;
      for (const auto& f : fields)
        if (stage == f.stage && std::string(spec.tensor) == f.tensor)
          put(cap, l, spec.stage, spec.tensor, *f.v);
    }
  }

  // One layer, its stages in the order of the registry's stage table.
  void layer_forward(int l, const LayerParams<S>& p, const std::vector<S>& u, Capture* cap) {
    LayerActs<S>& a = acts[l];
    const auto fields = ref::act_fields(a);
    a.residual = u;
    for (const StageEntry* e : layer_fwd) {
      ref::layer_forward_step(d, mode, e->stage, p, w_in(l, p), w_out(l, p), a);
      put_stage(cap, l, e->stage, fields);
    }
  }
  // delta: ∂L/∂(layer output) on entry, ∂L/∂(layer input) on return.
  void layer_backward(int l, const LayerParams<S>& p, LayerParams<S>& pg, std::vector<S>& dlt,
                      Capture* cap) {
    const auto fields = ref::grad_fields(lg);
    const S* dlt_typed = typed_copy(dlt);  // the GEMMs' operand (B8)
    for (const StageEntry* e : layer_bwd) {
      ref::layer_backward_step(d, mode, e->stage, p, w_in(l, p), w_out(l, p), acts[l], dlt,
                               dlt_typed, lg, pg);
      put_stage(cap, l, e->stage, fields);
    }
    dlt = lg.d_temporal;
  }
};

template <class S>
Backbone<S>::Backbone(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage) {
  validate_run(cfg, B, T);
  if (storage == Precision::F64 && sizeof(S) == sizeof(float)) storage = Precision::F32;
  const bool exact = storage == (sizeof(S) == sizeof(double) ? Precision::F64 : Precision::F32);
  const bool emulated = sizeof(S) == sizeof(float) &&
                        (storage == Precision::BF16 || storage == Precision::F16);
  M3_REQUIRE(exact || emulated, "Backbone", "unsupported storage precision for this scalar",
             "storage ", precision_name(storage), " with ", sizeof(S) == 8 ? "double" : "float",
             " compute; bf16/f16 storage is emulated with float compute only");
  impl_ = std::make_unique<Impl>(cfg, B, T, mode, storage);
}
template <class S>
Backbone<S>::~Backbone() = default;
template <class S>
Backbone<S>::Backbone(Backbone&&) noexcept = default;
template <class S>
Backbone<S>& Backbone<S>::operator=(Backbone&&) noexcept = default;

template <class S>
const Config& Backbone<S>::config() const { return impl_->cfg; }
template <class S>
const std::vector<S>& Backbone<S>::output() const { return impl_->out; }
template <class S>
Idx Backbone<S>::batch() const { return impl_->d.B; }
template <class S>
Idx Backbone<S>::seq_len() const { return impl_->d.T; }
template <class S>
ScanMode Backbone<S>::mode() const { return impl_->mode; }
template <class S>
Precision Backbone<S>::storage() const { return impl_->d.storage; }

namespace {
template <class S>
void check_states(const States<S>& s, const Config& cfg, Idx B, const char* where,
                  const char* which) {
  const StateSizes z = state_sizes(cfg);
  const Idx LB = cfg.n_layers * B;
  auto chk = [&](const std::vector<S>& v, Idx per, const char* name) {
    M3_REQUIRE(static_cast<Idx>(v.size()) == LB * per, where,
               std::string(which) + " " + name + " state has the wrong size", "got ", v.size(),
               ", expected L*B*", per, " = ", LB * per);
  };
  chk(s.ssm, z.ssm, "ssm");
  chk(s.k, z.k, "k");
  chk(s.v, z.v, "v");
  chk(s.angle, z.angle, "angle");
}
}  // namespace

template <class S>
const std::vector<S>& Backbone<S>::forward(const Params<S>& p, const std::vector<S>& X,
                                           States<S>& states, Capture* cap) {
  Impl& m = *impl_;
  const Dims& d = m.d;
  const char* where = "Backbone::forward";
  check_params(p, m.cfg, where);
  check_states(states, m.cfg, d.B, where, "entering");
  M3_REQUIRE(static_cast<Idx>(X.size()) == d.BT * d.in, where, "input X has the wrong size",
             "got ", X.size(), ", expected B*T*input_dim = ", d.BT * d.in);
  m.refresh_typed_weights(p);
  m.tokens.clear();
  m.x_in = X;
  ref::store_typed(d, m.x_in);
  if (m.cfg.input_proj_identity) {
    m.h0 = m.x_in;
  } else {
    ref::linear_forward(d.BT, d.in, d.dm, m.x_in.data(), m.w_input(p), p.input_proj_b.data(),
                        m.h0.data());
    ref::store_typed(d, m.h0);
  }
  m.put(cap, -1, "input_proj", "input_proj_inputs", m.x_in);
  m.put(cap, -1, "input_proj", "input_proj_outputs", m.h0);
  return m.forward_layers(p, states, cap);
}

template <class S>
const std::vector<S>& Backbone<S>::forward_tokens(const Params<S>& p,
                                                  const std::vector<std::int32_t>& tok,
                                                  States<S>& states, Capture* cap) {
  Impl& m = *impl_;
  const Dims& d = m.d;
  const char* where = "Backbone::forward_tokens";
  M3_REQUIRE(m.cfg.vocab_size > 0, where, "the config is no token model (vocab_size = 0)", "");
  check_params(p, m.cfg, where);
  check_states(states, m.cfg, d.B, where, "entering");
  M3_REQUIRE(static_cast<Idx>(tok.size()) == d.BT, where, "tokens have the wrong size", "got ",
             tok.size(), ", expected B*T = ", d.BT);
  m.refresh_typed_weights(p);
  m.tokens = tok;
  ref::embed_forward(d.BT, d.in, d.dm, tok.data(), m.w_input(p), p.input_proj_b.data(),
                     m.h0.data());
  ref::store_typed(d, m.h0);
  if (cap) {
    m.x_in.assign(static_cast<size_t>(d.BT * d.in), S(0));
    for (Idx r = 0; r < d.BT; ++r) m.x_in[r * d.in + tok[r]] = S(1);
    m.put(cap, -1, "input_proj", "input_proj_inputs", m.x_in);
  }
  m.put(cap, -1, "input_proj", "input_proj_outputs", m.h0);
  return m.forward_layers(p, states, cap);
}

template <class S>
const std::vector<S>& Backbone<S>::Impl::forward_layers(const Params<S>& p, States<S>& states,
                                                        Capture* cap) {
  Impl& m = *this;
  const Dims& d = m.d;
  const std::vector<S>* h = &m.h0;
  for (int l = 0; l < static_cast<int>(m.cfg.n_layers); ++l) {
    LayerActs<S>& a = m.acts[l];
    Impl::take(states.ssm, l, a.ssm_in);
    Impl::take(states.k, l, a.k_in);
    Impl::take(states.v, l, a.v_in);
    Impl::take(states.angle, l, a.angle_in);
    m.layer_forward(l, p.layers[l], *h, cap);
    Impl::give(a.ssm_out, l, states.ssm);
    Impl::give(a.k_out, l, states.k);
    Impl::give(a.v_out, l, states.v);
    Impl::give(a.angle_out, l, states.angle);
    h = &a.layer_output;
  }
  m.norm_f_input = *h;
  ref::rmsnorm_forward(d.BT, d.dm, m.norm_f_input.data(), p.norm_f_weight.data(), m.out.data(),
                       m.norm_f_rms.data());
  ref::store_typed(d, m.out);
  m.put(cap, -1, "norm_f", "norm_f_input", m.norm_f_input);
  m.put(cap, -1, "norm_f", "norm_f_rms", m.norm_f_rms);
  m.put(cap, -1, "norm_f", "Out", m.out);
  m.have_forward = true;
  return m.out;
}

template <class S>
void Backbone<S>::backward(const Params<S>& p, const std::vector<S>& d_out,
                           const States<S>* d_leaving, Params<S>& grads, std::vector<S>& d_x,
                           States<S>& d_entering, Capture* cap) {
  Impl& m = *impl_;
  const Dims& d = m.d;
  const char* where = "Backbone::backward";
  M3_REQUIRE(m.have_forward, where, "backward called before forward", "");
  check_params(p, m.cfg, where);
  check_params(grads, m.cfg, where);
  M3_REQUIRE(static_cast<Idx>(d_out.size()) == d.BT * d.dm, where, "dOut has the wrong size",
             "got ", d_out.size(), ", expected B*T*d_model = ", d.BT * d.dm);
  if (d_leaving) check_states(*d_leaving, m.cfg, d.B, where, "leaving-state gradient");
  d_entering = zero_states<S>(m.cfg, d.B);
  ref::rmsnorm_backward(d.BT, d.dm, m.norm_f_input.data(), p.norm_f_weight.data(),
                        m.norm_f_rms.data(), d_out.data(), m.d_norm_f.data(),
                        grads.norm_f_weight.data());
  m.put(cap, -1, "norm_f", "d_norm", m.d_norm_f);
  m.delta = m.d_norm_f;
  LayerGrads<S>& g = m.lg;
  for (int l = static_cast<int>(m.cfg.n_layers) - 1; l >= 0; --l) {
    if (d_leaving) {
      Impl::take(d_leaving->ssm, l, g.d_ssm_out);
      Impl::take(d_leaving->k, l, g.d_k_out);
      Impl::take(d_leaving->v, l, g.d_v_out);
      Impl::take(d_leaving->angle, l, g.d_angle_out);
    } else {
      for (auto* v : {&g.d_ssm_out, &g.d_k_out, &g.d_v_out, &g.d_angle_out})
        std::fill(v->begin(), v->end(), S(0));
    }
    m.layer_backward(l, p.layers[l], grads.layers[l], m.delta, cap);
    Impl::give(g.d_ssm_in, l, d_entering.ssm);
    Impl::give(g.d_k_in, l, d_entering.k);
    Impl::give(g.d_v_in, l, d_entering.v);
    Impl::give(g.d_angle_in, l, d_entering.angle);
  }
  if (!m.tokens.empty()) {
    // The embedding: the GEMM's dW of a one-hot X is a per-token sum of the typed δ⁰ rows.
    const S* dt = m.typed_copy(m.delta);
    ref::embed_backward(d.BT, d.in, d.dm, m.tokens.data(), dt, grads.input_proj_w.data(),
                        static_cast<S*>(nullptr));
    std::vector<S> db(static_cast<size_t>(d.dm), S(0));
    for (Idx r = 0; r < d.BT; ++r)
      for (Idx j = 0; j < d.dm; ++j) db[j] += m.delta[r * d.dm + j];
    for (Idx j = 0; j < d.dm; ++j) grads.input_proj_b[j] += db[j];
    d_x.clear();
    if (cap) {
      d_x.assign(static_cast<size_t>(d.BT * d.in), S(0));
      std::vector<S> unused_dw(static_cast<size_t>(d.in * d.dm), S(0));  // linear_backward's dW
      ref::linear_backward(d.BT, d.in, d.dm, m.x_in.data(), m.w_input(p), dt, d_x.data(),
                           unused_dw.data(), static_cast<S*>(nullptr));
      ref::store_typed(d, d_x);
      m.put(cap, -1, "input_proj", "d_input_proj_dx", d_x);
    }
    return;
  }
  d_x.assign(static_cast<size_t>(d.BT * d.in), S(0));
  if (m.cfg.input_proj_identity) {
    d_x = m.delta;
  } else {
    // The GEMMs take the staged typed copy of δ⁰; the bias gradient is a reduction of the f32
    // δ⁰ itself (a reduction save, MODEL.md §8).
    ref::linear_backward(d.BT, d.in, d.dm, m.x_in.data(), m.w_input(p), m.typed_copy(m.delta),
                         d_x.data(), grads.input_proj_w.data(), static_cast<S*>(nullptr));
    std::vector<S> db(static_cast<size_t>(d.dm), S(0));
    for (Idx r = 0; r < d.BT; ++r)
      for (Idx j = 0; j < d.dm; ++j) db[j] += m.delta[r * d.dm + j];
    for (Idx j = 0; j < d.dm; ++j) grads.input_proj_b[j] += db[j];
  }
  ref::store_typed(d, d_x);
  m.put(cap, -1, "input_proj", "d_input_proj_dx", d_x);
}

template <class S>
void capture_grads(const Params<S>& grads, const Config& cfg, Capture& cap) {
  for (const auto& kp : expected_param_keys(cfg)) {
    const std::vector<S>* v = nullptr;
    for_each_param(grads, [&](int layer, const char* name, const std::vector<S>& vec) {
      if (layer == kp.layer && std::string(name) == kp.spec->name) v = &vec;
    });
    M3_REQUIRE(v != nullptr, "capture_grads", "missing gradient '" + kp.key + "'", "");
    cap.put(kp.key, kp.shape, v->data());
  }
}

template class Backbone<double>;
template class Backbone<float>;
template void capture_grads<double>(const Params<double>&, const Config&, Capture&);
template void capture_grads<float>(const Params<float>&, const Config&, Capture&);

}  // namespace m3
