// Launchers of every GPU stage (internal to gpu/, .cu files only). Each stage computes exactly
// what the reference stage of the same name computes (reference/stages.hpp and the MODEL.md
// section named in the comment); backbone_gpu.cu chains them like reference/backbone.cpp.
//
// Conventions
//  * Row-major device buffers, r = b·T + t, names as in MODEL.md §10 / reference LayerActs.
//  * T is the storage type of the "typed" tensors of MODEL.md §8: float, __nv_bfloat16 or
//    __half (every launcher is instantiated for the three; gpu/convert.cuh rounds to nearest
//    even on store, as reference/precision.cpp). Coefficients, states, reductions and
//    f32-policy tensors are float.
//  * Determinism (MODEL.md §7, §12.9): no floating-point atomics, one writer per output
//    element, every reduction in a fixed order (gpu/common.cuh block_sum / warp_sum, or the
//    two-stage column sums of reduce.cu). The same inputs give the same bits on every run.
//  * Weight/bias gradients ACCUMULATE (+=) into their f32 buffers; activation gradients are
//    overwritten.
//  * Each launcher checks its launch (M3_LAUNCH_CHECK) and throws m3::Error on a bad launch.
//  * Scratch: a float workspace owned by the caller, sized by scratch_floats(); launchers use
//    it for reduction partials and may overwrite all of it.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common.cuh"
#include "proj_cols.cuh"
#include "stages.hpp"  // reference: m3::ref::Dims

namespace m3::gpu {

// The row stride a kernel uses for a [rows, width] tensor passed with `ld` (the ldx / ldz fields
// below): 0 means contiguous rows (width); a column view of a wider tensor (registry.hpp
// Life::Columns) passes that tensor's row width. A stride shorter than the row is an error.
inline Idx row_stride(Idx ld, Idx width, const char* where, const char* what) {
  M3_REQUIRE(ld == 0 || ld >= width, where,
             std::string(what) + "'s row stride is shorter than its row", "stride=", ld,
             " row=", width);
  return ld ? ld : width;
}

using ref::Dims;

struct Scratch {
  float* p = nullptr;
  Idx n = 0;  // floats available
};
// Floats of scratch the launchers below need at most for dims d.
Idx scratch_floats(const Dims& d);

// ---- reduce.cu: out[c] (+)= Σ_{r < rows} in[r, c], deterministic two-stage (fixed row blocks,
// then the block partials summed in ascending order). accumulate: += into out, else =.
void colsum(cudaStream_t s, Idx rows, Idx cols, const float* in, float* out, bool accumulate,
            Scratch scratch);

// ---- gemm.cu (cuBLAS, fixed configuration: f32 accumulation; f32 inputs in pedantic FP32, no
// TF32; typed inputs through cublasGemmEx with CUBLAS_COMPUTE_32F) -------------------------
// Y[rows,out] = X[rows,in]·W[in,out] (+ bias[out] broadcast when bias != nullptr), rounded once
// to T. A typed Y with a bias needs scratch ≥ rows·out floats (the f32 product before the bias
// add; scratch_floats(d) covers rows·out = BT·dm when d.storage is BF16 or F16); otherwise
// scratch is unused.
template <class T>
void gemm_forward(const GpuContext& c, Idx rows, Idx in, Idx out, const T* X, const T* W,
                  const float* bias, T* Y, Scratch scratch = {});
// dX[rows,in] = dY[rows,out]·Wᵀ   (overwrite)
template <class T>
void gemm_backward_dx(const GpuContext& c, Idx rows, Idx in, Idx out, const T* dY, const T* W,
                      T* dX);
// The same, the f32 accumulation stored as f32 (no rounding to T): the head's d_Out.
template <class T>
void gemm_backward_dx_f32(const GpuContext& c, Idx rows, Idx in, Idx out, const T* dY,
                          const T* W, float* dX);
// dW[in,out] += Xᵀ·dY   (f32 accumulate, β = 1)
template <class T>
void gemm_backward_dw(const GpuContext& c, Idx rows, Idx in, Idx out, const T* X, const T* dY,
                      float* dW);

// ---- norm.cu: RMSNorm (MODEL.md §4 F1, §6.1; norm_f; also BCNorm's core with rows = BT·ng)
// y[r,i] = u[r,i]/rms[r]·w[i], rms[r] = sqrt(mean_i u² + 1e-5)  (rms saved, not its inverse)
template <class T>
void rmsnorm_forward(cudaStream_t s, Idx rows, Idx dim, const float* u, const float* w, T* y,
                     float* rms);
// The residual add and the next norm in one pass: u = a + b (f32 + T, bit for bit add()) is
// stored, and y, rms are rmsnorm_forward's of that u. u must not alias a or b.
template <class T>
void rmsnorm_forward_add(cudaStream_t s, Idx rows, Idx dim, const float* a, const T* b, float* u,
                         const float* w, T* y, float* rms);
// dx = (w⊙g − x̂·c)/rms, c = mean(g⊙w⊙x̂), x̂ = u/rms  (overwrite);
// dw += Σ_r g⊙x̂ (deterministic, accumulate). g is T (typed d_post_norm) or float (dOut).
// With add_in/add_out (B1's residual pass-through): add_out = add_in + dx as well, from the dx
// in registers (bit for bit add()); dx may then be null (not stored). add_typed (with add_out):
// add_out's values rounded to T as well (convert<float, T>'s bits), for the GEMMs that read δ.
// y_again: the forward's y = x̂·w written again (its bits, from the same u, rms and w).
template <class T>
void rmsnorm_backward(cudaStream_t s, Idx rows, Idx dim, const float* u, const float* w,
                      const float* rms, const T* g, float* dx, float* dw, Scratch scratch,
                      const float* add_in = nullptr, float* add_out = nullptr,
                      T* add_typed = nullptr, T* y_again = nullptr);
// Scratch floats rmsnorm_backward needs for [rows, dim] (dw's partial sums).
Idx rmsnorm_backward_scratch_floats(Idx rows, Idx dim);
// Tests: whether rmsnorm_backward reads δ (add_in), u and g through shared memory where it can
// (on by default; norm.cu's kStage), so that both paths can be held to the same bits.
void set_rmsnorm_delta_staging_for_testing(bool on);

// ---- split.cu ------------------------------------------------------------------------------
// F3 (§4): proj [BT, ip] → z, x [BT, di]; b_raw, c_raw [BT, ng·ds]; dd_dt_raw, dd_a_raw,
// trap_raw [BT, nh]; angles_raw [BT, na]; dt = softplus(dd_dt_raw + dt_bias) (v > 20 → v),
// a_val = min(−φ(dd_a_raw), −a_floor), trap = σ(trap_raw).
template <class T>
struct SplitFwd {
  const T* proj;
  const float* dt_bias;
  // z, x, b_raw, c_raw: all null when the readers take them as column views of proj (row
  // stride ip; the production layout, registry.hpp Life::Columns): only the f32 parts are
  // written then.
  T *z, *x, *b_raw, *c_raw;
  float *dd_dt_raw, *dd_a_raw, *trap_raw, *angles_raw, *dt, *a_val, *trap;
};
template <class T>
void split_forward(cudaStream_t s, const Dims& d, const SplitFwd<T>& p);
// F5b: alpha = exp(a_val·dt), beta = alpha·dt·(1 − trap), gamma = trap·dt   [BT, nh]
void abg_forward(cudaStream_t s, const Dims& d, const float* a_val, const float* dt,
                 const float* trap, float* alpha, float* beta, float* gamma);
// Sequential-path glue (reference abg_backward): from d_alpha, d_beta, d_gamma:
// d_adt_total = dα·α + dβ·β; d_dt_direct = dβ·α(1−trap) + dγ·trap; d_trap_sig = (γ-path) …
struct AbgBwd {
  const float *alpha, *beta, *dt, *trap, *d_alpha, *d_beta, *d_gamma;
  float *d_adt_total, *d_dt_direct, *d_trap_sig;
};
void abg_backward(cudaStream_t s, const Dims& d, const AbgBwd& p);
// d_proj's f32 parts as ProjCols (their first columns, row stride ip): given to B5b
// (ActBwd::d_*_cols) and B5a (AngleBwd::d_angles_raw_cols), they leave B3 nothing to move.
struct SplitF32Cols {
  ProjCols d_dd_dt, d_dd_a, d_trap_raw, d_angles_raw;
};
template <class T>
SplitF32Cols split_f32_cols(const Dims& d, T* d_proj);
// B5b (§6.2, §12.1–2; reference activations_backward): d_dd_dt, d_dd_a, d_trap_raw [BT, nh]
// and d dt_bias += Σ_r d_dd_dt (deterministic).
struct ActBwd {
  const float *dd_dt_raw, *dd_a_raw, *dt_bias, *dt, *a_val, *trap;
  const float *d_adt_total, *d_dt_direct, *d_dt_angle, *d_trap_sig;
  float *d_dd_dt, *d_dd_a, *d_trap_raw;
  float* d_dt_bias;  // [nh], accumulate
  double a_floor;
  // Production: the three outputs also rounded into d_proj's columns (split_f32_cols).
  ProjCols d_dd_dt_cols, d_dd_a_cols, d_trap_raw_cols;
  void into_proj(const SplitF32Cols& c) {
    d_dd_dt_cols = c.d_dd_dt;
    d_dd_a_cols = c.d_dd_a;
    d_trap_raw_cols = c.d_trap_raw;
  }
};
void activations_backward(cudaStream_t s, const Dims& d, const ActBwd& p, Scratch scratch);
// B3: d_proj [BT, ip] = [d_z | d_x | d_b_raw | d_c_raw | d_dd_dt | d_dd_a | d_trap_raw |
// d_angles_raw] (column order of §2.1).
template <class T>
struct SplitBwd {
  // d_z, d_x, d_b_raw, d_c_raw: all null when their writers (B7, B6, B4c) stored them into
  // d_proj's columns already (the production layout): only the f32 parts are written then.
  const T *d_z, *d_x, *d_b_raw, *d_c_raw;
  const float *d_dd_dt, *d_dd_a, *d_trap_raw, *d_angles_raw;
  T* d_proj;
};
template <class T>
void split_backward(cudaStream_t s, const Dims& d, const SplitBwd<T>& p);

// ---- bcnorm.cu (§4 F4, §6.2 B4b/B4c; reference bcnorm.cpp) -------------------------------
// With typed storage, X_normed is stored (rounded) and the bias add reads the stored value.
template <class T>
struct BcnormFwd {
  const T *b_raw, *c_raw;  // row stride ldr
  const float *b_norm_weight, *c_norm_weight, *b_bias, *c_bias;
  T *b_normed, *c_normed, *b_biased, *c_biased;  // b/c_biased: both null → not stored
  float *b_rms, *c_rms;
  Idx ldr = 0;  // row stride of b/c_raw (0: ng·ds, contiguous; ip for proj's column views)
};
template <class T>
void bcnorm_forward(cudaStream_t s, const Dims& d, const BcnormFwd<T>& p);
// B4b: d_X_normed[r,g,n] = Σ_{h∈g} d_X_pre_rope[r,h,n] (ascending h); d X_bias += Σ_r;
// B4c: RMSNorm backward per (r,g) → d_X_raw, d w_X += (deterministic).
// With d_b_pre_rope = d_c_pre_rope = null, B4b was done by the chunked scan's step 2
// (SsmChunkBwd::d_b_normed): only B4c runs, from the stored d_X_normed; the bias gradients
// are not touched.
template <class T>
struct BcnormBwd {
  const T *b_raw, *c_raw;
  const float *b_norm_weight, *c_norm_weight, *b_rms, *c_rms;
  const float *d_b_pre_rope, *d_c_pre_rope;
  T *d_b_normed, *d_c_normed, *d_b_raw, *d_c_raw;  // B4c reads the stored d_X_normed
  float *d_b_norm_weight, *d_c_norm_weight, *d_b_bias, *d_c_bias;  // accumulate
  Idx ldr = 0;  // row stride of b/c_raw and d_b/c_raw (0: ng·ds; ip for the column views)
};
template <class T>
void bcnorm_backward(cudaStream_t s, const Dims& d, const BcnormBwd<T>& p, Scratch scratch);

// ---- rope.cu (§4 F5, F4e/f, §6.2 B6 tail, B5a; §12.3; reference rope.cpp) ----------------
// F5: θ_t = wrap(θ_{t−1} + π·tanh(angles_raw)·dt) carried in DOUBLE per (b,h,a), wrapped to
// [0, 2π) every step (the increment formed in float, as the reference does for float);
// θ_{−1} = angle_in [B, nh, na]; writes angle_cumsum [BT, nh, na] and angle_out. Scratch:
// tanh(angles_raw) [BT, na] (angle_forward_scratch_floats).
void angle_forward(cudaStream_t s, const Dims& d, const float* angles_raw, const float* dt,
                   const float* angle_in, float* angle_cumsum, float* angle_out,
                   Scratch scratch);
Idx angle_forward_scratch_floats(const Dims& d);
// F4e/f: k = R(θ)·b_biased, q = R(θ)·c_biased on pairs (2a, 2a+1); n ≥ 2na copied.
template <class T>
void rope_forward(cudaStream_t s, const Dims& d, const float* theta, const T* b_biased,
                  const T* c_biased, T* k, T* q);
// The same, fused with F4's bias add: X_biased = T(float(X_normed[r, g(h)]) + X_bias[h]), bit
// for bit what bcnorm_forward stores (which then need not store it). X_normed [BT, ng, ds],
// X_bias [nh, ds].
template <class T>
void rope_forward_normed(cudaStream_t s, const Dims& d, const float* theta, const T* b_normed,
                         const T* c_normed, const float* b_bias, const float* c_bias, T* k,
                         T* q);
// Rᵀ of gradients wrt rotated vectors + angle gradient (reference rope_backward_into):
// dpre = Rᵀ dv; dtheta (+)= Σ_a −dv[2a]·rot[2a+1] + dv[2a+1]·rot[2a].
// Two rotated inputs at once (k path and q path): dtheta = contribution(dv1) + contribution(dv2),
// OVERWRITTEN (not accumulated). Optional extra (all nullptr, or all set): after the rotation,
// dpre1 += extra_scale[r,h]·extra_vec1 and dpre2 += extra_scale[r,h]·extra_vec2 (the chunked
// qk path: extra_scale = dQK·γ, extra_vec1 = c_biased, extra_vec2 = b_biased).
template <class T>
struct RopeBwd {
  const float* theta;
  const float *dv1, *dv2;
  const T *rot1, *rot2;
  float *dpre1, *dpre2, *dtheta;
  const float* extra_scale;            // all three nullptr, or all set
  const T *extra_vec1, *extra_vec2;
};
template <class T>
void rope_backward(cudaStream_t s, const Dims& d, const RopeBwd<T>& p);
// B5a: Θ̄ = reverse cumsum over t of d_angle_cumsum (+ d_angle_out at t = T−1), then
// d_angles_raw[r,a] = Σ_h Θ̄·π·dt·(1 − tanh²) (ascending h), d_dt_angle[r,h] = Σ_a Θ̄·π·tanh
// (ascending a), d_angle_in = Θ̄ at t = 0. All overwritten. With na = 0: d_dt_angle = 0.
struct AngleBwd {
  const float *angles_raw, *dt, *d_angle_cumsum, *d_angle_out;
  float *d_angles_raw, *d_dt_angle, *d_angle_in;
  ProjCols d_angles_raw_cols;  // production: d_angles_raw also into d_proj (split_f32_cols)
};
// Scratch: Θ̄ [BT, nh, na], then tanh(angles_raw) [BT, na] (angle_backward_scratch_floats).
void angle_backward(cudaStream_t s, const Dims& d, const AngleBwd& p, Scratch scratch);
Idx angle_backward_scratch_floats(const Dims& d);
// Tests: whether angle_backward takes its instantiations for na = nh = 32 (on by default;
// rope.cu's angle_reverse_cumsum_kernel<32, 32> and angle_grads_kernel<32, 32>), so that they
// can be held to the generic ones' bits.
void set_angle_grads_full_for_testing(bool on);
// Tests: likewise for angle_forward and angle_forward_kernel<32, 32>.
void set_angle_forward_full_for_testing(bool on);

// ---- gating.cu (§4 F7, §6.2 B7; reference gating.cpp) ------------------------------------
// gated_rms_vals (rstd, [BT, nh]) only with is_outproj_norm (else nullptr). ldz: z's row
// stride (0: di, contiguous; ip when z is proj's column view).
template <class T>
void gating_forward(cudaStream_t s, const Dims& d, const T* y, const T* z,
                    const float* norm_gate_weight, T* gated, float* gated_rms_vals, Idx ldz = 0);
template <class T>
struct GatingBwd {
  const T *y, *z, *d_gated;
  const float *norm_gate_weight, *gated_rms_vals;
  T *d_y, *d_z;
  float* d_norm_gate_weight;  // accumulate (only with is_outproj_norm)
  Idx ldz = 0;  // row stride of z and d_z (0: di; ip when they are proj's / d_proj's columns)
  // When set: F7's output written again from the same y, z (and saved rstd) with F7's own
  // operations, so the forward's bits (the production layout keeps no gated per layer).
  T* gated = nullptr;
};
template <class T>
void gating_backward(cudaStream_t s, const Dims& d, const GatingBwd<T>& p, Scratch scratch);

// ---- ssm_seq.cu (§4 F6 recurrence, §6.3 BPTT; reference ssm_sequential.cpp) --------------
template <class T>
struct SsmSeqFwd {
  const T *x, *k, *q;  // x: row stride ldx
  const float *alpha, *beta, *gamma, *d_param;
  const float *ssm_in, *k_in, *v_in;                  // entering states [B, nh, …]
  T* y;
  float *h_saved, *k_prev_saved, *v_prev_saved;       // h_saved [B, T+1, ds, di] (transposed)
  float *ssm_out, *k_out, *v_out;
  Idx ldx = 0;  // row stride of x (0: di, contiguous; ip when x is proj's column view)
};
template <class T>
void ssm_seq_forward(cudaStream_t s, const Dims& d, const SsmSeqFwd<T>& p);
template <class T>
struct SsmSeqBwd {
  const T *x, *k, *q, *d_y;
  const float *alpha, *beta, *gamma, *d_param;
  const float *h_saved, *k_prev_saved, *v_prev_saved;
  const float *d_ssm_out, *d_k_out, *d_v_out;  // gradients wrt the leaving states
  T* d_x;
  float *d_k, *d_q, *d_alpha, *d_beta, *d_gamma, *d_d_local;
  float *d_ssm_in, *d_k_in, *d_v_in;
  float* d_d_param;  // [nh], accumulate: Σ_b Σ_p d_d_local (fixed order)
  Idx ldx = 0;       // row stride of x and d_x (0: di; ip when they are proj's / d_proj's columns)
};
template <class T>
void ssm_seq_backward(cudaStream_t s, const Dims& d, const SsmSeqBwd<T>& p, Scratch scratch);

// ---- scan/chunked_*.cu (§5.2 K0–K6 with §5.3 entering states, §6.4 steps 1–3; reference
// ssm_chunked.cpp, whose header comment states every formula; run-time chunk size) ----------
template <class T>
struct SsmChunkFwd {
  const T *x, *k, *q;
  const float *dt, *trap, *a_val, *d_param;
  const float *ssm_in, *k_in, *v_in;
  T *k_scaled_saved, *y;  // K_scaled is stored typed, and K3/K5 read the stored value
  float *adt, *qk_dot_saved, *scale_saved, *gamma_saved, *da_cumsum_saved;
  float *chunk_states, *chunk_states_saved, *final_states;
  float *ssm_out, *k_out, *v_out;
  bool prep_done;  // K0/K1 already ran (ssm_chunked_rope_prep): skip them
  // K2/K3 and K4/K6 as one chunk walk (chunk_walk_tc, typed runs with chunks ≤ 64; the bits of
  // the two kernels): the contributions stay in registers, and chunk_states is written only
  // when non-null (a capture). false: the two kernels, chunk_states required.
  bool fuse_states;
  Idx ldx = 0;  // row stride of x (0: di, contiguous; ip when x is proj's column view)
};
template <class T>
void ssm_chunked_forward(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p,
                         Scratch scratch);
// F4ef fused with K0/K1 (the production chunked forward; F4's bias add recomputed too): k and
// q exactly as rope_forward_normed stores them, and adt, Ks (k_scaled_saved), qk_dot_saved,
// scale_saved, gamma_saved exactly as ssm_chunked_forward's K0/K1 — bit for bit, the same
// kernel. q is stored; k only at t = T − 1 (F6 reads it there for k_out) unless k_all. Reads
// of p: dt, trap, a_val; writes: the K0/K1 outputs. ssm_chunked_forward then runs with
// prep_done = true.
template <class T>
struct RopePrep {
  const T *b_normed, *c_normed;    // [BT, ng, ds]
  const float *b_bias, *c_bias;    // [nh, ds]
  const float* theta;              // angle_cumsum [BT, nh, na]
  T *k, *q;                        // [BT, nh, ds]
  bool k_all;
};
template <class T>
void ssm_chunked_rope_prep(cudaStream_t s, const Dims& d, const RopePrep<T>& rp,
                           const SsmChunkFwd<T>& p);
// The forward's K2/K3 and K4/K6 alone (after the prep, p.prep_done must be true): the cumsums
// (da_cumsum_saved), the chunk contributions and the entering chunk states
// (chunk_states_saved), final_states and the leaving states — bit for bit what
// ssm_chunked_forward writes, without K5's y. The production backward's recompute
// (registry.hpp Recompute::Scan) runs it after ssm_chunked_rope_prep instead of keeping the
// states from the forward.
template <class T>
void ssm_chunked_states(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p);
// Whether this build forms the chunked scan's tensor-core products with wgmma where the widths
// allow (an sm_90a build: tc_wgmma.cuh, M3_WGMMA; chunk_bwd_tc at headdim 33–64 with d_state
// 33–128, K5's chunk_scan_tc at headdim and d_state 33–128, and in bf16 runs chunk_state_tc and
// the chunk walks at headdim 33–64 with d_state 33–128). Tests: set_chunked_wgmma_for_testing
// (false) makes those launches take their mma.sync instantiations (on by default), so that both
// paths can be held to the same bits.
bool chunked_wgmma_build();
void set_chunked_wgmma_for_testing(bool on);
// Tests: how many launches so far took a wgmma kernel (counted on the host as they are issued).
long chunked_wgmma_launches();
// Whether fuse_states takes the chunk walk (SsmChunkFwd/Bwd::fuse_states) for T-typed storage
// at d: typed runs whose chunks fit one row tile (min(chunk_size, T) ≤ 64). Otherwise the two
// kernels run, and the forward needs chunk_states.
template <class T>
bool ssm_chunked_walks(const Dims& d);
// Step 1 (dqkv, incl. dADT and the entering-state gradients), step 2 (dScale, dGamma,
// d_b_pre_rope, d_c_pre_rope, d_angle_cumsum: the formulas of rope_backward with the qk extra),
// step 3 (ddt_dtrap: dDT, d_trap_sig; d_adt_total = dADT, d_dt_direct = dDT). ∂L/∂v_out is
// added to d_x at t = T−1 and ∂L/∂k_out to the k-path gradient at t = T−1 (before Rᵀ).
template <class T>
struct SsmChunkBwd {
  const T *x, *k, *q, *b_biased, *c_biased, *k_scaled_saved, *d_y;
  const float *theta, *dt, *trap, *a_val, *d_param;
  const float *qk_dot_saved, *scale_saved, *gamma_saved, *da_cumsum_saved;
  const float *chunk_states_saved, *k_in, *v_in;
  const float *d_ssm_out, *d_k_out, *d_v_out;
  float *da_cs_sum, *dQ_mid, *dK_mid, *dADT, *dQK_dot, *dD_partials, *dScale, *dGamma, *dDT;
  T* d_x;
  float *d_b_pre_rope, *d_c_pre_rope, *d_angle_cumsum;  // d_X_pre_rope: may be null if fused
  float *d_adt_total, *d_dt_direct, *d_trap_sig;
  float *d_ssm_in, *d_k_in, *d_v_in;
  float* d_d_param;  // [nh], accumulate Σ_b dD_partials (ascending b)
  // Optional, null when unused:
  // b_normed, c_normed [BT, ng, ds] with b_bias, c_bias [nh, ds]: step 2 recomputes b_biased,
  // c_biased, k and q (bit for bit F4's and F4ef's stored values) instead of reading them.
  const T *b_normed, *c_normed;
  const float *b_bias, *c_bias;
  // B4b fused into step 2 (any supported shape): d_X_normed [BT, ng, ds] =
  // Σ_{h∈g} d_X_pre_rope (ascending h, as bcnorm_backward), d X_bias [nh, ds] += Σ_r
  // d_X_pre_rope. bcnorm_backward then runs with null d_X_pre_rope (B4c only).
  T *d_b_normed, *d_c_normed;
  float *d_b_bias, *d_c_bias;
  // B1 and B2 as one chunk walk (chunk_walk_tc, typed runs with chunks ≤ 64; the bits of the
  // two kernels): dcontrib stays in registers. false: the two kernels.
  bool fuse_states;
  Idx ldx = 0;  // row stride of x and d_x (0: di; ip when they are proj's / d_proj's columns)
  // Step 2 and B4b fused into B3 where ssm_chunked_cluster_tail<T>(d) holds and the run fuses
  // the head sums with the recompute (d_b_normed and b_normed set): one kernel in clusters of
  // heads (gpu/scan/chunk_tail.cuh), so dQ_mid and dK_mid never go through global memory — they
  // may then be null, and are written only where set (a capture). The head sums of d_X_normed
  // add the heads in clusters (ascending within and across them) and the bias gradients per
  // chunk of rows: another fixed order than the standalone tail's. false: the standalone tail.
  bool cluster_tail = false;
};
// Whether SsmChunkBwd::cluster_tail can take the fused path at d for T-typed storage: typed runs
// whose chunks fit one row tile, an even number of heads per group, d_state even.
template <class T>
bool ssm_chunked_cluster_tail(const Dims& d);
template <class T>
void ssm_chunked_backward(cudaStream_t s, const Dims& d, const SsmChunkBwd<T>& p,
                          Scratch scratch);
// Floats of scratch ssm_chunked_backward needs: dS per chunk boundary B·nc·nh·hd·ds and
// dScale_{−1} B·nh (each rounded up to 64). The largest user of the scratch (≈ 134 M floats at
// the official shape). With SsmChunkBwd::cluster_tail taken, ssm_chunked_cluster_scratch_floats
// more after them (the cluster tail's partials, chunked_detail.cuh; ≈ 38 M floats there).
Idx ssm_chunked_scratch_floats(const Dims& d);
Idx ssm_chunked_cluster_scratch_floats(const Dims& d);

// Elementwise helpers used by the backbone (reduce.cu): out[i] = a[i] + b[i] (residual adds:
// f32 residual + typed out_flat); convert/copy between storage types.
template <class T>
void add(cudaStream_t s, Idx n, const float* a, const T* b, float* out);
template <class Tin, class Tout>
void convert(cudaStream_t s, Idx n, const Tin* in, Tout* out);
// out[i] = in[i] rounded to T (to nearest even): the typed compute copy of an f32 master weight
// (MODEL.md §8, refreshed after every optimizer step). T = float copies.
template <class T>
void round_to(cudaStream_t s, Idx n, const float* in, T* out);

}  // namespace m3::gpu
