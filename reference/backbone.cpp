// The backbone (MODEL.md §3): the Eigen executor of the stage chain (chain.hpp), running the
// stage functions of stages.hpp — one layer's forward F1 → F2 → F3 → F4 → F5 → F4ef → F5b → F6
// → F7 → F8 and backward B8 → B7 → B6 → B5a → B5b → B4 → B3 → B2 → B1 (+ residual) — with the
// capture of every registry tensor after the stage that writes it (act_fields / grad_fields
// name the buffers).
//
//   forward : H⁰ = X·W_in + b_in (or X) ; Hˡ⁺¹ = Hˡ + out_proj(gate(SSM(…RMSNorm(Hˡ)))) ;
//             Out = RMSNorm(H^L; norm_f_weight)
//   backward: δ^L = RMSNorm_bwd(dOut); per layer δˡ = δˡ⁺¹ + B1(…B8(δˡ⁺¹));
//             dX = δ⁰·W_inᵀ (or δ⁰)
// Buffers are allocated once per (config, B, T, mode) in the constructor.
#include "backbone.hpp"
#include "lm.hpp"

#include <algorithm>
#include <cstring>

#include "chain.hpp"
#include "error.hpp"
#include "layer_tensors.hpp"
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

// Every per-layer registry tensor of the forward (the backward), and the buffer holding it: the
// rows of layer_tensors.hpp with their member column.
#define M3_ACT_FIELD(modes, when, stage, tensor, member, ...) {StageId::stage, #tensor, &a.member},
#define M3_GRAD_FIELD(modes, when, stage, tensor, member, ...) {StageId::stage, #tensor, &g.member},
template <class S>
std::vector<TensorField<S>> act_fields(LayerActs<S>& a) {
  return {M3_LAYER_FWD_TENSORS(M3_ACT_FIELD)};
}
template <class S>
std::vector<TensorField<S>> grad_fields(LayerGrads<S>& g) {
  return {M3_LAYER_BWD_TENSORS(M3_GRAD_FIELD)};
}
#undef M3_GRAD_FIELD
#undef M3_ACT_FIELD

template <class S>
void layer_forward_step(const Dims& d, ScanMode mode, StageId st, const LayerParams<S>& p,
                        const S* w_in, const S* w_out, LayerActs<S>& a) {
  switch (st) {
    case StageId::F1:
      ref::rmsnorm_forward(d.BT, d.dm, a.residual.data(), p.norm_weight.data(),
                           a.post_norm.data(), a.rms_vals.data());
      ref::store_typed(d, a.post_norm);
      return;
    case StageId::F2:
      ref::linear_forward(d.BT, d.dm, d.ip, a.post_norm.data(), w_in,
                          static_cast<const S*>(nullptr), a.proj.data());
      ref::store_typed(d, a.proj);
      return;
    case StageId::F3:
      ref::split_forward(d, p, a);
      return;
    case StageId::F4:
      ref::bcnorm_forward(d, p, a);
      return;
    case StageId::F5:  // and the leaving angle state
      ref::angle_forward(d, a);
      return;
    case StageId::F4ef:
      ref::rope_forward(d, a);
      ref::store_typed(d, a.k);
      ref::store_typed(d, a.q);
      return;
    case StageId::F5b:
      ref::abg_forward(d, a);
      return;
    case StageId::F6:  // and the leaving ssm, k, v states
      if (mode == ScanMode::Sequential) {
        ref::ssm_seq_forward(d, p, a);
      } else {
        ref::ssm_chunked_forward(d, p, a);
      }
      ref::store_typed(d, a.y);
      return;
    case StageId::F7:
      ref::gating_forward(d, p, a);
      ref::store_typed(d, a.gated);
      return;
    case StageId::F8:
      ref::linear_forward(d.BT, d.di, d.dm, a.gated.data(), w_out,
                          static_cast<const S*>(nullptr), a.out_flat.data());
      ref::store_typed(d, a.out_flat);
      for (Idx i = 0; i < d.BT * d.dm; ++i) a.layer_output[i] = a.residual[i] + a.out_flat[i];
      return;
    case StageId::input_proj: case StageId::states: case StageId::norm_f: case StageId::head:
    case StageId::loss: case StageId::B8: case StageId::B7: case StageId::B6: case StageId::B5a:
    case StageId::B5b: case StageId::B4b: case StageId::B4c: case StageId::B3: case StageId::B2:
    case StageId::B1: case StageId::d_states:
      break;
  }
  throw Error("layer_forward_step", "not a layer forward stage that runs", stage_name(st));
}

template <class S>
void layer_backward_step(const Dims& d, ScanMode mode, StageId st, const LayerParams<S>& p,
                         const S* w_in, const S* w_out, const LayerActs<S>& a,
                         const std::vector<S>& dlt, const S* delta_typed, LayerGrads<S>& g,
                         LayerParams<S>& pg) {
  switch (st) {
    case StageId::B8:
      ref::linear_backward(d.BT, d.di, d.dm, a.gated.data(), w_out, delta_typed,
                           g.d_gated.data(), pg.out_proj_w.data(), static_cast<S*>(nullptr));
      ref::store_typed(d, g.d_gated);
      return;
    case StageId::B7:
      ref::gating_backward(d, p, a, g, pg);
      ref::store_typed(d, g.d_y);
      ref::store_typed(d, g.d_z);
      return;
    case StageId::B6:  // and the entering ssm, k, v state gradients
      if (mode == ScanMode::Sequential) {
        ref::ssm_seq_backward(d, p, a, g, pg);
        ref::rope_backward(d, a, g);
        ref::abg_backward(d, a, g);
      } else {
        ref::ssm_chunked_backward(d, p, a, g, pg);
      }
      ref::store_typed(d, g.d_x);
      return;
    case StageId::B5a:  // and the entering angle state gradient
      ref::angle_backward(d, a, g);
      return;
    case StageId::B5b:
      ref::activations_backward(d, p, a, g, pg);
      return;
    case StageId::B4b:  // B4b and B4c in one step
      ref::bcnorm_backward(d, p, a, g, pg);
      return;
    case StageId::B3:
      ref::split_backward(d, g);
      ref::store_typed(d, g.d_proj);
      return;
    case StageId::B2:
      ref::linear_backward(d.BT, d.dm, d.ip, a.post_norm.data(), w_in, g.d_proj.data(),
                           g.d_norm.data(), pg.in_proj_w.data(), static_cast<S*>(nullptr));
      ref::store_typed(d, g.d_norm);
      return;
    case StageId::B1:
      ref::rmsnorm_backward(d.BT, d.dm, a.residual.data(), p.norm_weight.data(),
                            a.rms_vals.data(), g.d_norm.data(), g.d_pre_norm.data(),
                            pg.norm_weight.data());
      for (Idx i = 0; i < d.BT * d.dm; ++i) g.d_temporal[i] = dlt[i] + g.d_pre_norm[i];
      return;
    case StageId::input_proj: case StageId::F1: case StageId::F2: case StageId::F3:
    case StageId::F4: case StageId::F5: case StageId::F4ef: case StageId::F5b: case StageId::F6:
    case StageId::F7: case StageId::F8: case StageId::states: case StageId::norm_f:
    case StageId::head: case StageId::loss: case StageId::B4c: case StageId::d_states:
      break;
  }
  throw Error("layer_backward_step", "not a layer backward stage that runs", stage_name(st));
}

template <class S>
void add_bias_grad(Idx rows, Idx dim, const S* delta, S* db_acc) {
  std::vector<S> db(static_cast<size_t>(dim), S(0));
  for (Idx r = 0; r < rows; ++r)
    for (Idx j = 0; j < dim; ++j) db[j] += delta[r * dim + j];
  for (Idx j = 0; j < dim; ++j) db_acc[j] += db[j];
}

template <class S>
void input_proj_forward(Idx BT, Idx in, Idx dm, bool identity, const std::int32_t* tok,
                        const S* x, const S* w, const S* b, S* h0) {
  if (tok) {
    embed_forward(BT, in, dm, tok, w, b, h0);
  } else if (identity) {
    std::copy_n(x, static_cast<size_t>(BT * dm), h0);
  } else {
    linear_forward(BT, in, dm, x, w, b, h0);
  }
}

template <class S>
void input_proj_backward(Idx BT, Idx in, Idx dm, bool identity, const std::int32_t* tok,
                         const S* x, const S* w, const S* delta, const S* delta_typed, S* dw,
                         S* db, S* d_x) {
  if (identity && !tok) {
    if (d_x) std::copy_n(delta, static_cast<size_t>(BT * dm), d_x);
    return;
  }
  if (tok) {
    embed_backward(BT, in, dm, tok, delta_typed, dw, static_cast<S*>(nullptr));
    if (d_x) {  // dX alone: linear_backward's dW goes to a scratch
      std::vector<S> unused_dw(static_cast<size_t>(in * dm), S(0));
      linear_backward(BT, in, dm, x, w, delta_typed, d_x, unused_dw.data(),
                      static_cast<S*>(nullptr));
    }
  } else {
    linear_backward(BT, in, dm, x, w, delta_typed, d_x, dw, static_cast<S*>(nullptr));
  }
  add_bias_grad(BT, dm, delta, db);
}

template <class S>
std::vector<S> one_hot(const std::int32_t* tok, Idx BT, Idx V) {
  std::vector<S> x(static_cast<size_t>(BT * V), S(0));
  for (Idx r = 0; r < BT; ++r) x[static_cast<size_t>(r * V + tok[r])] = S(1);
  return x;
}

template void layer_forward_step<double>(const Dims&, ScanMode, StageId,
                                         const LayerParams<double>&, const double*,
                                         const double*, LayerActs<double>&);
template void layer_forward_step<float>(const Dims&, ScanMode, StageId,
                                        const LayerParams<float>&, const float*, const float*,
                                        LayerActs<float>&);
template void layer_backward_step<double>(const Dims&, ScanMode, StageId,
                                          const LayerParams<double>&, const double*,
                                          const double*, const LayerActs<double>&,
                                          const std::vector<double>&, const double*,
                                          LayerGrads<double>&, LayerParams<double>&);
template void layer_backward_step<float>(const Dims&, ScanMode, StageId,
                                         const LayerParams<float>&, const float*, const float*,
                                         const LayerActs<float>&, const std::vector<float>&,
                                         const float*, LayerGrads<float>&,
                                         LayerParams<float>&);

template void add_bias_grad<double>(Idx, Idx, const double*, double*);
template void add_bias_grad<float>(Idx, Idx, const float*, float*);
#define M3_INPUT_PROJ(S)                                                                        \
  template void input_proj_forward<S>(Idx, Idx, Idx, bool, const std::int32_t*, const S*,       \
                                      const S*, const S*, S*);                                  \
  template void input_proj_backward<S>(Idx, Idx, Idx, bool, const std::int32_t*, const S*,      \
                                       const S*, const S*, const S*, S*, S*, S*);               \
  template std::vector<S> one_hot<S>(const std::int32_t*, Idx, Idx);
M3_INPUT_PROJ(double)
M3_INPUT_PROJ(float)
#undef M3_INPUT_PROJ

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
  ChainPlan plan;
  std::vector<LayerActs<S>> acts;
  LayerGrads<S> lg;
  std::vector<S> x_in, h0, norm_f_input, norm_f_rms, out, d_norm_f, delta, delta_typed;
  // Compute copies of the GEMM weights in the storage precision (MODEL.md §8), refreshed from
  // the master weights at every forward; with exact storage they alias the masters.
  std::vector<std::vector<S>> w_in_typed, w_out_typed;
  std::vector<S> w_input_typed;
  bool have_forward = false;
  std::vector<std::int32_t> tokens;  // the last forward_tokens' input (empty after forward())

  // The pass in flight (set by forward / backward for the driver's calls).
  const Params<S>* p = nullptr;
  States<S>* states = nullptr;                 // forward: entering in, leaving out
  Params<S>* grads = nullptr;                  // backward: accumulated
  const std::vector<S>* d_out = nullptr;       // backward: dOut
  const States<S>* d_leaving = nullptr;        // backward: optional
  States<S>* d_entering = nullptr;             // backward: overwritten
  std::vector<S>* d_x = nullptr;               // backward: overwritten
  Capture* cap = nullptr;
  const S* dlt_typed = nullptr;                // the GEMMs' operand of the layer's B8
  LmEnds<S>* lm = nullptr;                     // a token model's step: its head and loss

  Impl(const Config& c, Idx B, Idx T, ScanMode m, Precision storage)
      : cfg(c), d(Dims::of(c, B, T, storage)), mode(m), plan(ChainPlan::of(c, m)) {
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

  void refresh_typed_weights(const Params<S>& prm) {
    if (!typed()) return;
    w_input_typed = prm.input_proj_w;
    ref::store_typed(d, w_input_typed);
    for (size_t l = 0; l < acts.size(); ++l) {
      w_in_typed[l] = prm.layers[l].in_proj_w;
      ref::store_typed(d, w_in_typed[l]);
      w_out_typed[l] = prm.layers[l].out_proj_w;
      ref::store_typed(d, w_out_typed[l]);
    }
  }
  const S* w_in(int l) const {
    return typed() ? w_in_typed[l].data() : p->layers[l].in_proj_w.data();
  }
  const S* w_out(int l) const {
    return typed() ? w_out_typed[l].data() : p->layers[l].out_proj_w.data();
  }
  const S* w_input() const { return typed() ? w_input_typed.data() : p->input_proj_w.data(); }
  // The typed copy of a residual-stream gradient that feeds a GEMM (§8 "staged typed copy").
  const S* typed_copy(const std::vector<S>& v) {
    if (!typed()) return v.data();
    delta_typed = v;
    ref::store_typed(d, delta_typed);
    return delta_typed.data();
  }

  // Captures `v` under (layer, stage, tensor) when the registry says the run produces it.
  void put(int layer, const char* stage, const char* tensor, const std::vector<S>& v) {
    if (!cap || !exists_in(find_spec(stage, tensor), cfg, mode)) return;
    cap->put_stage(layer, stage, tensor, v.data(), static_cast<Idx>(v.size()));
  }

  // The [B, …] slice of layer l in a [L][B][…] state buffer.
  static void take(const std::vector<S>& all, int l, std::vector<S>& slice) {
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(l * slice.size()), slice.size(),
                slice.begin());
  }
  static void give(const std::vector<S>& slice, int l, std::vector<S>& all) {
    std::copy(slice.begin(), slice.end(),
              all.begin() + static_cast<std::ptrdiff_t>(l * slice.size()));
  }

  // ---- the executor of chain.hpp ------------------------------------------------------------
  void before(StageId, int, Dir) {}
  // After a layer stage, and at a pseudo-stage's place: the registry rows under its name,
  // from the buffers act_fields / grad_fields name (captures in the registry's order;
  // backbone stages capture their own tensors).
  void after(StageId s, int l, Dir dir) {
    if (!cap || l < 0) return;
    const auto fields = dir == Dir::Forward ? ref::act_fields(acts[l]) : ref::grad_fields(lg);
    ref::for_each_buffer(plan.rows_of(s), fields,
                         [&](const TensorSpec& spec, const std::vector<S>& v) {
                           cap->put_stage(l, spec.stage, spec.tensor, v.data(),
                                          static_cast<Idx>(v.size()));
                         });
  }
  void pseudo(StageId s, int l, Dir dir) { after(s, l, dir); }

  // Layer l's input is H⁰ or layer l−1's output; its entering states are slices of `states`.
  void enter_layer(int l) {
    LayerActs<S>& a = acts[l];
    a.residual = l == 0 ? h0 : acts[l - 1].layer_output;
    take(states->ssm, l, a.ssm_in);
    take(states->k, l, a.k_in);
    take(states->v, l, a.v_in);
    take(states->angle, l, a.angle_in);
  }
  void leave_layer(int l) {
    const LayerActs<S>& a = acts[l];
    give(a.ssm_out, l, states->ssm);
    give(a.k_out, l, states->k);
    give(a.v_out, l, states->v);
    give(a.angle_out, l, states->angle);
  }
  template <StageId s>
  void forward(Stage<s>, int l) {
    ref::layer_forward_step(d, mode, s, p->layers[l], w_in(l), w_out(l), acts[l]);
  }

  // input_proj: H⁰ = X·W_in + b_in (or X), or a token model's embedding (a row gather; the
  // one-hot X only for a capture).
  void forward(Stage<StageId::input_proj>, int) {
    const std::int32_t* tok = tokens.empty() ? nullptr : tokens.data();
    if (!tok) {
      ref::store_typed(d, x_in);
    } else if (cap) {
      x_in = ref::one_hot<S>(tok, d.BT, d.in);
    }
    ref::input_proj_forward(d.BT, d.in, d.dm, cfg.input_proj_identity, tok, x_in.data(),
                            w_input(), p->input_proj_b.data(), h0.data());
    if (tok || !cfg.input_proj_identity) ref::store_typed(d, h0);
    put(-1, "input_proj", "input_proj_inputs", x_in);
    put(-1, "input_proj", "input_proj_outputs", h0);
  }
  void forward(Stage<StageId::norm_f>, int) {
    norm_f_input = acts.back().layer_output;
    ref::rmsnorm_forward(d.BT, d.dm, norm_f_input.data(), p->norm_f_weight.data(), out.data(),
                         norm_f_rms.data());
    ref::store_typed(d, out);
    put(-1, "norm_f", "norm_f_input", norm_f_input);
    put(-1, "norm_f", "norm_f_rms", norm_f_rms);
    put(-1, "norm_f", "Out", out);
  }

  // head: logits = Out · head_w (its typed copy), rounded to the storage type.
  void forward(Stage<StageId::head>, int) {
    const Idx V = cfg.vocab_size;
    lm->head_w_typed = p->head_w;
    ref::store_typed(d, lm->head_w_typed);
    lm->logits.assign(static_cast<size_t>(d.BT * V), S(0));
    ref::linear_forward(d.BT, d.dm, V, out.data(), lm->head_w_typed.data(),
                        static_cast<const S*>(nullptr), lm->logits.data());
    ref::store_typed(d, lm->logits);
    put(-1, "head", "logits", lm->logits);
  }
  void forward(Stage<StageId::loss>, int) {
    lm->lse.assign(static_cast<size_t>(d.BT), S(0));
    lm->loss = ref::loss_forward(d.BT, cfg.vocab_size, lm->logits.data(), lm->tgt.data(),
                                 lm->w.data(), lm->n_norm, lm->lse.data());
    put(-1, "loss", "lse", lm->lse);
    put(-1, "loss", "value", std::vector<S>{static_cast<S>(lm->loss)});
  }
  // The head's backward: d_logits of scale·loss (typed), d_Out = d_logits · head_wᵀ (f32:
  // norm_f's dOut), head_w's gradient += Outᵀ · d_logits.
  void backward(Stage<StageId::head>, int) {
    const Idx V = cfg.vocab_size;
    lm->d_logits.assign(lm->logits.size(), S(0));
    ref::loss_backward(d.BT, V, lm->logits.data(), lm->lse.data(), lm->tgt.data(), lm->w.data(),
                       lm->n_norm, lm->scale, lm->d_logits.data());
    ref::store_typed(d, lm->d_logits);
    lm->d_out.assign(static_cast<size_t>(d.BT * d.dm), S(0));
    ref::linear_backward(d.BT, d.dm, V, out.data(), lm->head_w_typed.data(),
                         lm->d_logits.data(), lm->d_out.data(), grads->head_w.data(),
                         static_cast<S*>(nullptr));
    put(-1, "head", "d_logits", lm->d_logits);
    put(-1, "head", "d_Out", lm->d_out);
    d_out = &lm->d_out;
  }

  void backward(Stage<StageId::norm_f>, int) {
    ref::rmsnorm_backward(d.BT, d.dm, norm_f_input.data(), p->norm_f_weight.data(),
                          norm_f_rms.data(), d_out->data(), d_norm_f.data(),
                          grads->norm_f_weight.data());
    put(-1, "norm_f", "d_norm", d_norm_f);
    delta = d_norm_f;
  }
  // δ = ∂L/∂(layer output) on entry; the gradients wrt the leaving states, or zero.
  void enter_layer_backward(int l) {
    LayerGrads<S>& g = lg;
    if (d_leaving) {
      take(d_leaving->ssm, l, g.d_ssm_out);
      take(d_leaving->k, l, g.d_k_out);
      take(d_leaving->v, l, g.d_v_out);
      take(d_leaving->angle, l, g.d_angle_out);
    } else {
      for (auto* v : {&g.d_ssm_out, &g.d_k_out, &g.d_v_out, &g.d_angle_out})
        std::fill(v->begin(), v->end(), S(0));
    }
    dlt_typed = typed_copy(delta);  // the GEMMs' operand (B8)
  }
  template <StageId s>
  void backward(Stage<s>, int l) {
    ref::layer_backward_step(d, mode, s, p->layers[l], w_in(l), w_out(l), acts[l], delta,
                             dlt_typed, lg, grads->layers[l]);
  }
  // δ becomes ∂L/∂(layer input); the entering-state gradients go to their slices.
  void leave_layer_backward(int l) {
    give(lg.d_ssm_in, l, d_entering->ssm);
    give(lg.d_k_in, l, d_entering->k);
    give(lg.d_v_in, l, d_entering->v);
    give(lg.d_angle_in, l, d_entering->angle);
    delta = lg.d_temporal;
  }
  // dX = δ⁰·W_inᵀ (or δ⁰) from the GEMMs' typed copy of δ⁰; the bias gradient is a reduction
  // of the f32 δ⁰ itself (a reduction save, MODEL.md §8). A token model's dW is the embedding's
  // per-token sum of the typed δ⁰ rows, and its dX (∂L/∂ one-hot) exists only for a capture.
  void backward(Stage<StageId::input_proj>, int) {
    const std::int32_t* tok = tokens.empty() ? nullptr : tokens.data();
    const S* dt = tok || !cfg.input_proj_identity ? typed_copy(delta) : nullptr;
    const bool want_dx = !tok || cap;
    if (want_dx) {
      d_x->assign(static_cast<size_t>(d.BT * d.in), S(0));
    } else {
      d_x->clear();
    }
    ref::input_proj_backward(d.BT, d.in, d.dm, cfg.input_proj_identity, tok, x_in.data(),
                             w_input(), delta.data(), dt, grads->input_proj_w.data(),
                             grads->input_proj_b.data(), want_dx ? d_x->data() : nullptr);
    if (!want_dx) return;
    ref::store_typed(d, *d_x);
    put(-1, "input_proj", "d_input_proj_dx", *d_x);
  }

  const std::vector<S>& run_forward(const Params<S>& prm, States<S>& st, Capture* c,
                                    LmEnds<S>* ends) {
    p = &prm;
    states = &st;
    cap = c;
    lm = ends;
    chain_forward(*this, plan);
    if (lm) chain_lm_forward(*this);
    have_forward = true;
    return out;
  }
  // The backward of the last forward (with a token model's ends: the head's backward first).
  void run_backward(const Params<S>& prm, Params<S>& g, const std::vector<S>* dout,
                    const States<S>* d_leave, std::vector<S>& dx, States<S>& d_enter,
                    Capture* c, LmEnds<S>* ends) {
    d_enter = zero_states<S>(cfg, d.B);
    p = &prm;
    grads = &g;
    d_out = dout;
    d_leaving = d_leave;
    d_entering = &d_enter;
    d_x = &dx;
    cap = c;
    lm = ends;
    if (lm) chain_lm_backward(*this);
    chain_backward(*this, plan);
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
  return m.run_forward(p, states, cap, nullptr);
}

template <class S>
void Backbone<S>::prepare_tokens(const Params<S>& p, const std::vector<std::int32_t>& tok,
                                 const States<S>& states, const char* where) {
  Impl& m = *impl_;
  const Dims& d = m.d;
  M3_REQUIRE(m.cfg.vocab_size > 0, where, "the config is no token model (vocab_size = 0)", "");
  check_params(p, m.cfg, where);
  check_states(states, m.cfg, d.B, where, "entering");
  M3_REQUIRE(static_cast<Idx>(tok.size()) == d.BT, where, "tokens have the wrong size", "got ",
             tok.size(), ", expected B*T = ", d.BT);
  m.refresh_typed_weights(p);
  m.tokens = tok;
}

template <class S>
const std::vector<S>& Backbone<S>::forward_tokens(const Params<S>& p,
                                                  const std::vector<std::int32_t>& tok,
                                                  States<S>& states, Capture* cap) {
  prepare_tokens(p, tok, states, "Backbone::forward_tokens");
  return impl_->run_forward(p, states, cap, nullptr);
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
  m.run_backward(p, grads, &d_out, d_leaving, d_x, d_entering, cap, nullptr);
}

template <class S>
double Backbone<S>::forward_lm(const Params<S>& p, const std::vector<std::int32_t>& tok,
                               States<S>& states, LmEnds<S>& ends, Capture* cap) {
  Impl& m = *impl_;
  const Idx BT = m.d.BT;
  const char* where = "Backbone::forward_lm";
  M3_REQUIRE(static_cast<Idx>(ends.tgt.size()) == BT && static_cast<Idx>(ends.w.size()) == BT,
             where, "targets and weights must have B*T entries", "got ", ends.tgt.size(),
             " and ", ends.w.size(), ", expected ", BT);
  prepare_tokens(p, tok, states, where);
  m.run_forward(p, states, cap, &ends);
  return ends.loss;
}

template <class S>
void Backbone<S>::backward_lm(const Params<S>& p, LmEnds<S>& ends, Params<S>& grads,
                              std::vector<S>& d_x, States<S>& d_entering, Capture* cap) {
  Impl& m = *impl_;
  const char* where = "Backbone::backward_lm";
  M3_REQUIRE(m.have_forward && m.lm == &ends, where,
             "backward_lm called without a preceding forward_lm on these ends", "");
  check_params(p, m.cfg, where);
  check_params(grads, m.cfg, where);
  m.run_backward(p, grads, nullptr, nullptr, d_x, d_entering, cap, &ends);
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
