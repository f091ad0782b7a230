// Stage functions of the reference (MODEL.md §4–§6), forward and backward of each stage in one
// source file: rmsnorm.cpp (F1, norm_f, B1, BCNorm core), linear.cpp (F2, F8, input_proj,
// B8, B2), split.cpp (F3, F5b, B5b, B3), bcnorm.cpp (F4, B4b, B4c), rope.cpp (F5, F4ef, B6
// RoPE tail, B5a), ssm_sequential.cpp (F6 §4, B6 §6.3), ssm_chunked.cpp (F6 K0–K6 §5.2, B6
// steps 1–3 §6.4), gating.cpp (F7, B7). backbone.cpp chains them.
//
// All buffers are row-major std::vector<S>; r = b·T + t. A LayerActs holds every forward
// tensor of one layer under its MODEL.md §10 name (what backward reads is saved there);
// a LayerGrads holds every backward intermediate. Weight gradients accumulate (+=) into a
// LayerParams<S> of gradients; activation gradients are overwritten.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "config.hpp"
#include "params.hpp"
#include "precision.hpp"
#include "stage_ids.hpp"

namespace m3::ref {

constexpr double kEps = 1e-5;  // every RMS (MODEL.md §0)
constexpr double kTwoPi = 6.283185307179586476925286766559;
constexpr double kPi = 3.141592653589793238462643383280;
// π·p rounded once to S, for F5's increment (MODEL.md §4 F5, §12.3): π enters as the sum of
// two S values, its nearest kPiHi and the rest kPiLo, in one fused multiply-add, so the
// product carries no error of π's own rounding. With π rounded to f32 first (3.14159274, 2.8e-8
// above π) every increment is 2.8e-8 too large, and θ drifts by that fraction of the angle
// turned: 2e-4 rad after 4096 steps of about 1.8 rad. For float only: the double reference
// keeps its form (rope.cpp).
template <class S>
constexpr S kPiHi = static_cast<S>(kPi);
template <class S>
constexpr S kPiLo = static_cast<S>(kPi - static_cast<double>(kPiHi<S>));
template <class S>
S times_pi(S p) {
  return std::fma(p, kPiHi<S>, p * kPiLo<S>);
}

struct Dims {
  Idx B, T, BT, dm, di, hd, nh, ds, ng, na, ip, cs, nc, hpg, in;
  double a_floor;
  bool outproj_norm;
  // Storage of the "typed" tensors of MODEL.md §8: F64/F32 = exact (no rounding); BF16/F16 =
  // round to nearest even at every point where the GPU stores that tensor typed.
  Precision storage = Precision::F64;
  static Dims of(const Config& cfg, Idx B, Idx T, Precision storage = Precision::F64);
  Idx group_of(Idx h) const { return h / hpg; }
  Idx chunk_begin(Idx c) const { return c * cs; }
  Idx chunk_end(Idx c) const { return std::min(T, (c + 1) * cs); }
};

template <class S>
struct LayerActs {
  // entering states of this layer ([B, …] slices of §9) and leaving states
  std::vector<S> ssm_in, k_in, v_in, angle_in, ssm_out, k_out, v_out, angle_out;
  // F1, F2, F3
  std::vector<S> residual, rms_vals, post_norm, proj;
  std::vector<S> z, x, b_raw, c_raw, dd_dt_raw, dd_a_raw, trap_raw, angles_raw, dt, a_val, trap;
  // F4, F5, F4ef, F5b
  std::vector<S> b_normed, c_normed, b_rms, c_rms, b_biased, c_biased;
  std::vector<S> angle_cumsum, k, q, alpha, beta, gamma;
  // F6 sequential
  std::vector<S> h_saved, k_prev_saved, v_prev_saved;
  // F6 chunked
  std::vector<S> adt, k_scaled_saved, qk_dot_saved, scale_saved, gamma_saved, da_cumsum_saved,
      chunk_states, chunk_states_saved, final_states;
  // F6, F7, F8
  std::vector<S> y, gated_rms_vals, gated, out_flat, layer_output;

  void allocate(const Dims& d, ScanMode mode);
};

template <class S>
struct LayerGrads {
  // gradients wrt the leaving states (inputs of the backward; zero unless chaining windows)
  std::vector<S> d_ssm_out, d_k_out, d_v_out, d_angle_out;
  // gradients wrt the entering states (outputs)
  std::vector<S> d_ssm_in, d_k_in, d_v_in, d_angle_in;
  std::vector<S> d_gated, d_y, d_z;
  // B6 sequential
  std::vector<S> d_q, d_k, d_alpha, d_beta, d_gamma, d_d_local;
  // B6 chunked
  std::vector<S> da_cs_sum, dQ_mid, dK_mid, dADT, dQK_dot, dD_partials, dScale, dGamma, dDT;
  // B6 common outputs
  std::vector<S> d_x, d_b_pre_rope, d_c_pre_rope, d_angle_cumsum;
  // What B5b consumes from either B6 variant (a re-grouping of dα/dβ/dγ resp.
  // dADT/dDT/dScale): ∂L/∂adt, the direct ∂L/∂dt, ∂L/∂trap (post-sigmoid).
  std::vector<S> d_adt_total, d_dt_direct, d_trap_sig;
  // B5a, B5b, B4, B3, B2, B1
  std::vector<S> d_angles_raw, d_dt_angle, d_dd_dt, d_dd_a, d_trap_raw;
  std::vector<S> d_b_normed, d_c_normed, d_b_raw, d_c_raw, d_proj, d_norm, d_pre_norm, d_temporal;

  void allocate(const Dims& d, ScanMode mode);
};

// Every per-layer registry tensor (stage, tensor) and the LayerActs / LayerGrads member holding
// it (backbone.cpp): the reference's buffers named as the registry names them, for the
// backbone's capture and the isolated runner's loads. The leaving states are states/*, the
// entering-state gradients d_states/*.
template <class S>
struct TensorField {
  StageId stage;
  const char* tensor;
  std::vector<S>* v;
  // Whether this is the buffer of registry row `spec`.
  template <class Spec>
  bool is(const Spec& spec) const {
    return std::string_view(stage_name(stage)) == spec.stage &&
           std::string_view(tensor) == spec.tensor;
  }
};
// Calls f(spec, buffer) for each of `specs` (registry rows, in their order) that `fields`
// holds: the capture of a stage's tensors from the buffers that hold them.
template <class S, class Spec, class F>
void for_each_buffer(const std::vector<const Spec*>& specs,
                     const std::vector<TensorField<S>>& fields, F&& f) {
  for (const Spec* spec : specs)
    for (const TensorField<S>& field : fields)
      if (field.is(*spec)) f(*spec, *field.v);
}
template <class S>
std::vector<TensorField<S>> act_fields(LayerActs<S>& a);
template <class S>
std::vector<TensorField<S>> grad_fields(LayerGrads<S>& g);

// One stage of one layer on its buffers (the Eigen executors of chain.hpp: the backbone, the
// isolated runner and the perturbed oracle run their layer stages through these). Forward
// steps read the layer input from a.residual; F5 and F6 also write the leaving states, B6 and
// B5a the entering-state gradients, B4b also B4c's tensors. w_in, w_out: the GEMM weights in
// the storage precision; delta: ∂L/∂(layer output), delta_typed its staged typed copy (the
// GEMMs' operand). A stage that is no layer stage of that direction throws m3::Error.
template <class S>
void layer_forward_step(const Dims& d, ScanMode mode, StageId stage, const LayerParams<S>& p,
                        const S* w_in, const S* w_out, LayerActs<S>& a);
template <class S>
void layer_backward_step(const Dims& d, ScanMode mode, StageId stage, const LayerParams<S>& p,
                         const S* w_in, const S* w_out, const LayerActs<S>& a,
                         const std::vector<S>& delta, const S* delta_typed, LayerGrads<S>& g,
                         LayerParams<S>& pg);

// input_proj (MODEL.md §3), or a token model's embedding (TRAINING.md §1) when tok != nullptr:
//   h0 = x·w + b  [BT, dm] (x [BT, in], w [in, dm]), h0 = x when identity, or
//   h0[r, :] = w[tok[r], :] + b  (the one-hot product as a row gather; x is not read).
// h0 before its typed store (the executor rounds or perturbs it).
template <class S>
void input_proj_forward(Idx BT, Idx in, Idx dm, bool identity, const std::int32_t* tok,
                        const S* x, const S* w, const S* b, S* h0);
// Its backward from δ⁰ [BT, dm] (f32) and δ⁰'s staged typed copy (the GEMMs' operand):
//   dw += xᵀ·δ⁰_typed, or a token model's per-token sum of δ⁰_typed rows (embed_backward);
//   db += Σ_r δ⁰ (from the f32 δ⁰: a reduction save, MODEL.md §8);
//   d_x = δ⁰_typed·wᵀ [BT, in], or δ⁰ when identity (no dw, db); not formed when nullptr.
// A token model's x is the one-hot of tok (read only for d_x). d_x before its typed store.
template <class S>
void input_proj_backward(Idx BT, Idx in, Idx dm, bool identity, const std::int32_t* tok,
                         const S* x, const S* w, const S* delta, const S* delta_typed, S* dw,
                         S* db, S* d_x);
// The one-hot rows of tok [BT] over V classes: [BT, V].
template <class S>
std::vector<S> one_hot(const std::int32_t* tok, Idx BT, Idx V);

// db += Σ_r delta[r, :] over the rows in order (the bias gradient of a linear map whose output
// gradient is delta [rows, dim]; summed into a zeroed row first, then added, as every
// implementation of input_proj's backward does).
template <class S>
void add_bias_grad(Idx rows, Idx dim, const S* delta, S* db);

// ---- rmsnorm.cpp: y[r,i] = u[r,i]/rms[r]·w[i], rms[r] = sqrt(mean_i u[r,i]² + ε)
template <class S>
void rmsnorm_forward(Idx rows, Idx dim, const S* u, const S* w, S* y, S* rms);
// dx = (w⊙g − x̂·c)/rms with x̂ = u/rms, c = mean_i(g⊙w⊙x̂)  (overwrite); dw += Σ_r g⊙x̂
template <class S>
void rmsnorm_backward(Idx rows, Idx dim, const S* u, const S* w, const S* rms, const S* g, S* dx,
                      S* dw);

// ---- linear.cpp: Y[rows,out] = X[rows,in]·W[in,out] (+ b[out] when b != nullptr)
template <class S>
void linear_forward(Idx rows, Idx in, Idx out, const S* X, const S* W, const S* b, S* Y);
// dX = dY·Wᵀ (overwrite; skipped when dX == nullptr); dW += Xᵀ·dY; db += Σ_r dY (if db)
template <class S>
void linear_backward(Idx rows, Idx in, Idx out, const S* X, const S* W, const S* dY, S* dX,
                     S* dW, S* db);

// ---- split.cpp
// F3: proj → z, x, b_raw, c_raw, dd_dt_raw, dd_a_raw, trap_raw, angles_raw; dt, a_val, trap.
template <class S>
void split_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a);
// F5b: alpha = exp(a_val·dt), beta = alpha·dt·(1−trap), gamma = trap·dt.
template <class S>
void abg_forward(const Dims& d, LayerActs<S>& a);
// B6→B5b glue for the sequential path: (dα, dβ, dγ) → d_adt_total, d_dt_direct, d_trap_sig.
template <class S>
void abg_backward(const Dims& d, const LayerActs<S>& a, LayerGrads<S>& g);
// B5b: (d_adt_total, d_dt_direct, d_dt_angle, d_trap_sig) → d_dd_dt, d_dd_a, d_trap_raw;
// d dt_bias += Σ_r d_dd_dt.
template <class S>
void activations_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                          LayerGrads<S>& g, LayerParams<S>& pg);
// B3: d_proj = [d_z | d_x | d_b_raw | d_c_raw | d_dd_dt | d_dd_a | d_trap_raw | d_angles_raw].
template <class S>
void split_backward(const Dims& d, LayerGrads<S>& g);

// ---- bcnorm.cpp
// F4a–d: b_normed/c_normed = BCNorm per (r, g), b_rms/c_rms; b_biased/c_biased per head.
template <class S>
void bcnorm_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a);
// B4b (heads → groups, ascending h; bias grads) and B4c (BCNorm backward, norm weight grads).
template <class S>
void bcnorm_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                     LayerGrads<S>& g, LayerParams<S>& pg);

// ---- rope.cpp
// F5: θ_t = wrap(θ_{t−1} + π·tanh(angles_raw)·dt) carried in double, θ_{−1} = angle_in;
// writes angle_cumsum and angle_out.
template <class S>
void angle_forward(const Dims& d, LayerActs<S>& a);
// F4e/f: k = R(θ) b_biased, q = R(θ) c_biased on adjacent pairs (2a, 2a+1), a < na.
template <class S>
void rope_forward(const Dims& d, LayerActs<S>& a);
// Rᵀ applied to gradients wrt rotated vectors, and the per-step angle gradient:
// dpre[2a] = c·dv[2a] + s·dv[2a+1], dpre[2a+1] = −s·dv[2a] + c·dv[2a+1];
// dθ += −dv[2a]·rot[2a+1] + dv[2a+1]·rot[2a] (rot = the rotated vector).
// Shapes: dv, rot, dpre [BT, nh, ds]; theta, dtheta [BT, nh, na].
template <class S>
void rope_backward_into(const Dims& d, const S* theta, const S* dv, const S* rot, S* dpre,
                        S* dtheta);
// B6 tail (sequential): d_k, d_q → d_b_pre_rope, d_c_pre_rope, d_angle_cumsum.
template <class S>
void rope_backward(const Dims& d, const LayerActs<S>& a, LayerGrads<S>& g);
// B5a: Θ̄ = reverse cumsum of d_angle_cumsum (+ d_angle_out at t = T−1) → d_angles_raw,
// d_dt_angle, and d_angle_in = Θ̄ at t = 0.
template <class S>
void angle_backward(const Dims& d, const LayerActs<S>& a, LayerGrads<S>& g);

// ---- ssm_sequential.cpp: F6 recurrence (§4) and its BPTT (§6.3), with entering states and
// gradients wrt them; d D += Σ d_y·x.
template <class S>
void ssm_seq_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a);
template <class S>
void ssm_seq_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                      LayerGrads<S>& g, LayerParams<S>& pg);

// ---- ssm_chunked.cpp: K0–K6 (§5.2, entering states §5.3) and backward steps 1–3 (§6.4),
// writing d_x, d_b_pre_rope, d_c_pre_rope, d_angle_cumsum, d_adt_total, d_dt_direct,
// d_trap_sig and the entering-state gradients.
template <class S>
void ssm_chunked_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a);
template <class S>
void ssm_chunked_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                          LayerGrads<S>& g, LayerParams<S>& pg);

// ---- gating.cpp: F7 (a) gated = y·silu(z); (b) gated = y·rstd·w·silu(z) per head.
template <class S>
void gating_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a);
template <class S>
void gating_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                     LayerGrads<S>& g, LayerParams<S>& pg);

// Rounds a typed tensor to the storage precision in place (no-op for F64/F32 storage).
template <class S>
void store_typed(const Dims& d, std::vector<S>& v);
template <class S>
void store_typed(const Dims& d, S* v, Idx n);

// Scalar activations shared by forward and backward (MODEL.md §4 F3, §12.1–2).
template <class S>
inline S sigmoid(S v) { return S(1) / (S(1) + std::exp(-v)); }
template <class S>
inline S softplus(S v) { return v > S(20) ? v : std::log1p(std::exp(v)); }
template <class S>
inline S softplus_grad(S v) { return v > S(20) ? S(1) : sigmoid(v); }
template <class S>
inline S heavy_tail(S v) { return v >= S(0) ? S(1) + v : S(1) / (S(1) - v); }
template <class S>
inline S heavy_tail_grad(S v) { return v >= S(0) ? S(1) : S(1) / ((S(1) - v) * (S(1) - v)); }

}  // namespace m3::ref
