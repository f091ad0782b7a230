// Internal to gpu/oracle: the GPU oracle's stage functions (host launchers over device
// pointers, all f64, all queued on the stream given). The math of each is MODEL.md's, cited
// per function; the kernels are in stages.cu (everything but the SSM), scan.cu (F6, B6) and
// gemm.cu (the DGEMMs). One LayerDev holds every device pointer one layer's stages use, under
// the registry's names (the oracle fills it per layer; a tensor the run lacks is nullptr).
// Shapes: rows r = b·T + t; [BT, dm] residual stream; [BT, nh, hd] = [BT, di] per-channel
// tensors (d = h·hd + p); [BT, nh, ds] per-head state vectors; [BT, ng, ds] group vectors;
// [BT, nh] per-head scalars; [BT, nh, na] angles; states [B, nh, hd, ds], [B, nh, ds],
// [B, nh, hd], [B, nh, na].
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "config.hpp"
#include "stages.hpp"  // reference: ref::Dims (the derived dimensions of MODEL.md §1.2)

namespace m3::gpu::oracle {

using ref::Dims;

// One layer's parameters (and their gradients: slots of the arenas), and the layer tensors that
// have a buffer of their own name (layout.hpp), forward then backward, as X-macro lists: the
// members of LayerDev below and the oracle's filling of it come from these rows.
#define M3_ORACLE_LAYER_PARAMS(X)                                                               \
  X(norm_weight) X(in_proj_w) X(dt_bias) X(b_norm_weight) X(c_norm_weight) X(b_bias) X(c_bias) \
  X(d_param) X(norm_gate_weight) X(out_proj_w)
#define M3_ORACLE_LAYER_TENSORS(X)                                                              \
  X(rms_vals) X(post_norm) X(proj) X(z) X(x) X(b_raw) X(c_raw) X(dd_dt_raw) X(dd_a_raw)          \
  X(trap_raw) X(angles_raw) X(dt) X(a_val) X(trap) X(b_normed) X(c_normed) X(b_rms) X(c_rms)     \
  X(b_biased) X(c_biased) X(angle_cumsum) X(k) X(q) X(alpha) X(beta) X(gamma) X(y)               \
  X(gated_rms_vals) X(gated) X(out_flat) X(layer_output) X(h_ckpt) X(d_gated) X(d_y) X(d_z)      \
  X(d_x) X(d_b_pre_rope) X(d_c_pre_rope) X(d_angle_cumsum) X(d_adt_total) X(d_dt_direct)          \
  X(d_trap_sig) X(d_angles_raw) X(d_dt_angle) X(d_dd_dt) X(d_dd_a) X(d_trap_raw) X(d_b_normed)    \
  X(d_c_normed) X(d_b_raw) X(d_c_raw) X(d_proj) X(d_norm) X(d_pre_norm) X(d_temporal)

struct LayerParamsDev {
#define M3_ORACLE_MEMBER(n) const double* n;
  M3_ORACLE_LAYER_PARAMS(M3_ORACLE_MEMBER)
#undef M3_ORACLE_MEMBER
};
struct LayerGradsDev {
#define M3_ORACLE_MEMBER(n) double* n;
  M3_ORACLE_LAYER_PARAMS(M3_ORACLE_MEMBER)
#undef M3_ORACLE_MEMBER
};

// Every device pointer one layer's stages use, under the registry's names (MODEL.md §10.2,
// §10.3); h_ckpt [S, B, nh, hd, ds] holds h_{s0−1} of each segment of the scan.
struct LayerDev {
  const double* residual;  // the layer input: H⁰ or the previous layer's layer_output
#define M3_ORACLE_MEMBER(n) double* n;
  M3_ORACLE_LAYER_TENSORS(M3_ORACLE_MEMBER)
#undef M3_ORACLE_MEMBER
  // entering states (a copy taken at the forward's start) and leaving states of this layer
  const double *ssm_in, *k_in, *v_in, *angle_in;
  double *ssm_out, *k_out, *v_out, *angle_out;
  // gradients wrt the leaving states (inputs) and the entering states (outputs)
  const double *d_ssm_out, *d_k_out, *d_v_out, *d_angle_out;
  double *d_ssm_in, *d_k_in, *d_v_in, *d_angle_in;
  LayerParamsDev p;
  LayerGradsDev g;
};

// Workspace the stages share (layout.hpp names the sizes).
struct Work {
  double *scan_h, *scan_g, *scan_colpart, *scan_scalpart, *scan_dd, *d_k, *d_q, *theta_bar, *row_scratch;
};

// ---- gemm.cu: row-major linear maps (MODEL.md §0: Y = X·W, W [in, out]) through DGEMM
// Y [rows, out] = X [rows, in] · W [in, out]
void gemm_xw(cublasHandle_t h, Idx rows, Idx in, Idx out, const double* X, const double* W,
             double* Y);
// dX [rows, in] = dY [rows, out] · Wᵀ
void gemm_dx(cublasHandle_t h, Idx rows, Idx in, Idx out, const double* dY, const double* W,
             double* dX);
// dW [in, out] += Xᵀ · dY
void gemm_dw(cublasHandle_t h, Idx rows, Idx in, Idx out, const double* X, const double* dY,
             double* dW);

// ---- stages.cu: elementwise pieces
void copy(cudaStream_t s, Idx n, const double* src, double* dst);
void add(cudaStream_t s, Idx n, const double* a, const double* b, double* out);      // out = a + b
void add_row_vector(cudaStream_t s, Idx rows, Idx dim, const double* b, double* Y);  // Y += b
// db[j] += Σ_r dY[r, j], rows in ascending order (summed from zero, then added)
void sum_rows_into(cudaStream_t s, Idx rows, Idx dim, const double* dY, double* db);

// RMSNorm (MODEL.md §4 F1, §6.1; norm_f; BCNorm's core): rms[r] = sqrt(Σ_i u²/dim + ε),
// y = u/rms·w. Backward with x̂ = u/rms: c[r] = Σ_i g·w·x̂ / dim, dx = (w·g − x̂·c)/rms
// (overwrite), dw += Σ_r g·x̂; c_scratch holds c [rows].
void rmsnorm_forward(cudaStream_t s, Idx rows, Idx dim, const double* u, const double* w, double* y,
                     double* rms);
void rmsnorm_backward(cudaStream_t s, Idx rows, Idx dim, const double* u, const double* w,
                      const double* rms, const double* g, double* dx, double* dw,
                      double* c_scratch);

// F3 (§4 F3, §2.1): the split of proj and dt, a_val, trap. B3 (§6.2): d_proj assembled.
void split_forward(cudaStream_t s, const Dims& d, const LayerDev& L);
void split_backward(cudaStream_t s, const Dims& d, const LayerDev& L);
// F5b (§4 F5b): α = e^{a_val·dt}, β = α·dt·(1 − trap), γ = trap·dt.
void abg_forward(cudaStream_t s, const Dims& d, const LayerDev& L);
// B5b (§6.2 B5b): d_dd_dt, d_dd_a, d_trap_raw; d dt_bias += Σ_r d_dd_dt.
void activations_backward(cudaStream_t s, const Dims& d, const LayerDev& L);
// F4 (§4 F4): BCNorm per (r, g) and the per-head bias. B4b/B4c (§6.2): heads to groups, the
// bias gradients, BCNorm's backward.
void bcnorm_forward(cudaStream_t s, const Dims& d, const LayerDev& L);
void bcnorm_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w);
// F5 (§4 F5): θ_t = wrap(θ_{t−1} + π·tanh(angles_raw)·dt) in double per (b, h, a); angle_out.
void angle_forward(cudaStream_t s, const Dims& d, const LayerDev& L);
// F4e/f (§4): k, q = the rotations of b_biased, c_biased by θ on the pairs (2a, 2a+1).
void rope_forward(cudaStream_t s, const Dims& d, const LayerDev& L);
// B6's RoPE tail (§6.2 B6): from d_k, d_q (w.d_k, w.d_q) → d_b_pre_rope, d_c_pre_rope,
// d_angle_cumsum.
void rope_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w);
// B5a (§6.2 B5a): Θ̄ = the reverse sum of d_angle_cumsum (+ d_angle_out) → d_angles_raw,
// d_dt_angle, d_angle_in.
void angle_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w);
// F7 / B7 (§4 F7, §6.2 B7): the SiLU gate or the gated RMSNorm.
void gating_forward(cudaStream_t s, const Dims& d, const LayerDev& L);
void gating_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w);

// ---- scan.cu: F6 and B6 (§4 F6, §6.3), the recurrence in segments of K = ⌈√T⌉ steps
// F6: y, the checkpoints h_ckpt, the leaving ssm/k/v states.
void ssm_forward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w);
// B6: d_x, d_k and d_q (into w.d_k, w.d_q), d_adt_total, d_dt_direct, d_trap_sig, the
// entering ssm/k/v state gradients, d D += Σ d_y·x.
void ssm_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w);

// ---- stages.cu: the language-model ends (TRAINING.md §1)
// h0[r, :] = W[tok[r], :] + b; one_hot[r, v] = [v = tok[r]] (input_proj_inputs).
void embed_forward(cudaStream_t s, Idx BT, Idx V, Idx dm, const int* tok, const double* W,
                   const double* b, double* h0, double* one_hot);
// dW[v, :] += Σ_{i ∈ [starts[v], starts[v+1])} dH[order[i], :] (rows of token v in increasing
// r, reference lm.hpp embed_order), for tokens that occur.
void embed_backward(cudaStream_t s, Idx V, Idx dm, const Idx* order, const Idx* starts,
                    const double* dH, double* dW);
// lse[r] = m + log Σ_v exp(l − m), m = max_v l; *value = Σ_r w·(lse − l[tgt]) / N (rows in
// order, rows with w = 0 skipped).
void loss_forward(cudaStream_t s, Idx BT, Idx V, const double* logits, const int* tgt,
                  const float* w, double n_norm, double* lse, double* value);
// d_logits = scale·w/N·(softmax − one-hot(tgt)).
void loss_backward(cudaStream_t s, Idx BT, Idx V, const double* logits, const double* lse,
                   const int* tgt, const float* w, double n_norm, double scale, double* d_logits);

}  // namespace m3::gpu::oracle
