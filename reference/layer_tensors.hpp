// Every per-layer tensor of the stage registry (docs/MODEL.md §10.2, §10.3), and every parameter
// (at the end, M3_PARAMS), once: one X-macro
// row per tensor, in execution order. The rows are the registry (reference/registry.cpp expands
// them into TensorSpec rows) and the binding of each tensor to the buffer of the reference that
// holds it (reference/backbone.cpp expands them into act_fields / grad_fields), so a tensor is
// named, shaped and bound in one place.
//
// Columns: X(modes, when, stage, tensor, member, (shape), circular, storage, (lifetime))
//   modes      BOTH | SEQ | CHK            the scan modes that have the tensor
//   when       ALW | ONRM | ANG            always, with is_outproj_norm, with RoPE angles
//   stage      the StageId (stage_ids.hpp) whose rows these are (a pseudo-stage for the states)
//   tensor     its name in the registry, the HDF5 paths and the reports
//   member     the ref::LayerActs (forward rows) or ref::LayerGrads (backward rows) member
//   shape      Sym symbols (registry.hpp), outermost first
//   circular   an angle in [0, 2π), compared by circular distance (MODEL.md §12.3)
//   storage    TYP: stored typed (bf16/f16 in those runs) by MODEL.md §8; F32: f32 always
//   lifetime   the production lifetime {sequential, chunked[, recomputed with Recompute::Scan]}
//              with SV saved, WS workspace, VF verification only, CL columns of proj/d_proj,
//              VW a view; () workspace in both modes
// The abbreviations are registry.cpp's; an expansion that ignores a column never sees them.
//
// Storage (MODEL.md §8): TYP for the activations at kernel boundaries and the activation
// gradients that cross typed kernels; the raw logits dd_dt_raw … are f32 copies of typed proj
// columns.
//
// Why each kept layer tensor is kept (the lifetime column, for the GPU's fused path):
//   F1  residual      B1 reads u (the layer input); the previous layer's layer_output
//       rms_vals      B1;  post_norm  workspace: B1 reads u and rms for its own sake and
//                     rewrites post_norm from them (F1's operations, so its bits), and B2's
//                     weight gradient runs after B1 on that copy
//   F2  proj          its typed columns: F3's z, x, b_raw, c_raw are Life::Columns of it, read
//                     in place (z: F7, B7; x: F6, B6; b/c_raw: F4, B4c), so the split copies
//                     only the f32 parts
//   F3  dd_dt_raw, dd_a_raw  B5b;  angles_raw  B5a;
//       dt, a_val, trap   B5b, B6, B5a  (trap_raw: nothing reads it after F3 → workspace)
//   F4  b/c_normed    chunked B6's tail recomputes the biased and rotated B, C from them
//                     (sequential: F4ef's input only → workspace); b/c_rms  B4c;
//       b/c_biased    never stored in production (F4ef and B6 add the bias themselves)
//   F5  angle_cumsum  B6 (RoPE backward)
//   F4ef k, q         sequential B6 reads both; chunked: q by B6's state/chunk kernels, k only
//                     at t = T − 1 by F6's state pass (→ workspace)
//   F5b α, β, γ       sequential F6/B6; chunked: the prep forms γ itself (→ never stored)
//   F6  seq: h/k_prev/v_prev_saved (B6).  chunked: Ks, qk·γ, scale, γ, the cumsums and the
//       entering chunk states (B6) — recomputed instead with Recompute::Scan;
//       adt, the chunk contributions and final_states are the forward's own workspace;  y  B7
//   F7  gated_rms_vals B7;  gated  workspace: B7 reads y and z for its own sake and rewrites
//                     gated from them (the forward's operations, so its bits), and B8's weight
//                     gradient runs after B7 on that copy (one write instead of a saved tensor)
//   F8  layer_output  the next layer's residual (B1 there) and norm_f's input
//   B7  d_z, B6 d_x, B4c d_b/c_raw   written in place into d_proj's columns (Life::Columns; B3
//                     writes only the f32 parts, and in fused runs B5b and B5a write those too,
//                     so that no B3 kernel runs: gpu/stages/proj_cols.cuh)
//   B6  d_adt_total, d_dt_direct, d_trap_sig: what B5b consumes from either B6 variant
//                     (∂L/∂adt, the direct ∂L/∂dt, ∂L/∂trap at the sigmoid's output)
//   B1  d_pre_norm    summed into d_temporal in B1's kernel; stored for a Capture only
// Everything else (out_flat, the leaving states, every other backward tensor) is workspace.
#pragma once

// clang-format off
#define M3_LAYER_FWD_TENSORS(X) \
  X(BOTH, ALW,  F1,     residual,       residual,      (BT, DM),      false, F32, (VW, VW)) \
  X(BOTH, ALW,  F1,     rms_vals,       rms_vals,      (BT),          false, F32, (SV, SV)) \
  X(BOTH, ALW,  F1,     post_norm,      post_norm,     (BT, DM),      false, TYP, ()) \
  X(BOTH, ALW,  F2,     proj,           proj,          (BT, IP),      false, TYP, (SV, SV)) \
  X(BOTH, ALW,  F3,     z,              z,             (BT, NH, HD),  false, TYP, (CL, CL)) \
  X(BOTH, ALW,  F3,     x,              x,             (BT, NH, HD),  false, TYP, (CL, CL)) \
  X(BOTH, ALW,  F3,     b_raw,          b_raw,         (BT, NG, DS),  false, TYP, (CL, CL)) \
  X(BOTH, ALW,  F3,     c_raw,          c_raw,         (BT, NG, DS),  false, TYP, (CL, CL)) \
  X(BOTH, ALW,  F3,     dd_dt_raw,      dd_dt_raw,     (BT, NH),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F3,     dd_a_raw,       dd_a_raw,      (BT, NH),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F3,     trap_raw,       trap_raw,      (BT, NH),      false, F32, ()) \
  X(BOTH, ANG,  F3,     angles_raw,     angles_raw,    (BT, NA),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F3,     dt,             dt,            (BT, NH),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F3,     a_val,          a_val,         (BT, NH),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F3,     trap,           trap,          (BT, NH),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F4,     b_normed,       b_normed,      (BT, NG, DS),  false, TYP, (WS, SV)) \
  X(BOTH, ALW,  F4,     c_normed,       c_normed,      (BT, NG, DS),  false, TYP, (WS, SV)) \
  X(BOTH, ALW,  F4,     b_rms,          b_rms,         (BT, NG),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F4,     c_rms,          c_rms,         (BT, NG),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F4,     b_biased,       b_biased,      (BT, NH, DS),  false, TYP, (VF, VF)) \
  X(BOTH, ALW,  F4,     c_biased,       c_biased,      (BT, NH, DS),  false, TYP, (VF, VF)) \
  X(BOTH, ANG,  F5,     angle_cumsum,   angle_cumsum,  (BT, NH, NA),  true,  F32, (SV, SV)) \
  X(BOTH, ALW,  F4ef,   k,              k,             (BT, NH, DS),  false, TYP, (SV, WS)) \
  X(BOTH, ALW,  F4ef,   q,              q,             (BT, NH, DS),  false, TYP, (SV, SV, true)) \
  X(BOTH, ALW,  F5b,    alpha,          alpha,         (BT, NH),      false, F32, (SV, VF)) \
  X(BOTH, ALW,  F5b,    beta,           beta,          (BT, NH),      false, F32, (SV, VF)) \
  X(BOTH, ALW,  F5b,    gamma,          gamma,         (BT, NH),      false, F32, (SV, VF)) \
  X(SEQ,  ALW,  F6,     h_saved,        h_saved,       (B, Tp1, DS, DI), false, F32, (SV, SV)) \
  X(SEQ,  ALW,  F6,     k_prev_saved,   k_prev_saved,  (BT, NH, DS),  false, F32, (SV, SV)) \
  X(SEQ,  ALW,  F6,     v_prev_saved,   v_prev_saved,  (BT, NH, HD),  false, F32, (SV, SV)) \
  X(CHK,  ALW,  F6,     adt,            adt,           (BT, NH),      false, F32, ()) \
  X(CHK,  ALW,  F6,     k_scaled_saved, k_scaled_saved, \
    (BT, NH, DS), false, TYP, (SV, SV, true)) \
  X(CHK,  ALW,  F6,     qk_dot_saved,   qk_dot_saved,  (BT, NH),      false, F32, (SV, SV, true)) \
  X(CHK,  ALW,  F6,     scale_saved,    scale_saved,   (BT, NH),      false, F32, (SV, SV, true)) \
  X(CHK,  ALW,  F6,     gamma_saved,    gamma_saved,   (BT, NH),      false, F32, (SV, SV, true)) \
  X(CHK,  ALW,  F6,     da_cumsum_saved, da_cumsum_saved, \
    (B, NC, NH, CS), false, F32, (SV, SV, true)) \
  X(CHK,  ALW,  F6,     chunk_states,   chunk_states,  (B, NC, NH, HD, DS), false, F32, ()) \
  X(CHK,  ALW,  F6,     chunk_states_saved, chunk_states_saved, \
    (B, NC, NH, HD, DS), false, F32, (SV, SV, true)) \
  X(CHK,  ALW,  F6,     final_states,   final_states,  (B, NH, HD, DS), false, F32, ()) \
  X(BOTH, ALW,  F6,     y,              y,             (BT, NH, HD),  false, TYP, (SV, SV)) \
  X(BOTH, ONRM, F7,     gated_rms_vals, gated_rms_vals, (BT, NH),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  F7,     gated,          gated,         (BT, DI),      false, TYP, ()) \
  X(BOTH, ALW,  F8,     out_flat,       out_flat,      (BT, DM),      false, TYP, ()) \
  X(BOTH, ALW,  F8,     layer_output,   layer_output,  (BT, DM),      false, F32, (SV, SV)) \
  X(BOTH, ALW,  states, ssm_state,      ssm_out,       (B, NH, HD, DS), false, F32, ()) \
  X(BOTH, ALW,  states, k_state,        k_out,         (B, NH, DS),   false, F32, ()) \
  X(BOTH, ALW,  states, v_state,        v_out,         (B, NH, HD),   false, F32, ()) \
  X(BOTH, ANG,  states, angle_state,    angle_out,     (B, NH, NA),   true,  F32, ())

#define M3_LAYER_BWD_TENSORS(X) \
  X(BOTH, ALW, B8,       d_gated,        d_gated,       (BT, DI),      false, TYP, ()) \
  X(BOTH, ALW, B7,       d_y,            d_y,           (BT, DI),      false, TYP, ()) \
  X(BOTH, ALW, B7,       d_z,            d_z,           (BT, DI),      false, TYP, (CL, CL)) \
  X(SEQ,  ALW, B6,       d_q,            d_q,           (BT, NH, DS),  false, F32, ()) \
  X(SEQ,  ALW, B6,       d_k,            d_k,           (BT, NH, DS),  false, F32, ()) \
  X(SEQ,  ALW, B6,       d_alpha,        d_alpha,       (BT, NH),      false, F32, ()) \
  X(SEQ,  ALW, B6,       d_beta,         d_beta,        (BT, NH),      false, F32, ()) \
  X(SEQ,  ALW, B6,       d_gamma,        d_gamma,       (BT, NH),      false, F32, ()) \
  X(SEQ,  ALW, B6,       d_d_local,      d_d_local,     (B, DI),       false, F32, ()) \
  X(CHK,  ALW, B6,       da_cs_sum,      da_cs_sum,     (B, NC, NH),   false, F32, ()) \
  X(CHK,  ALW, B6,       dQ_mid,         dQ_mid,        (BT, NH, DS),  false, F32, ()) \
  X(CHK,  ALW, B6,       dK_mid,         dK_mid,        (BT, NH, DS),  false, F32, ()) \
  X(CHK,  ALW, B6,       dADT,           dADT,          (BT, NH),      false, F32, ()) \
  X(CHK,  ALW, B6,       dQK_dot,        dQK_dot,       (BT, NH),      false, F32, ()) \
  X(CHK,  ALW, B6,       dD_partials,    dD_partials,   (B, NH),       false, F32, ()) \
  X(CHK,  ALW, B6,       dScale,         dScale,        (BT, NH),      false, F32, ()) \
  X(CHK,  ALW, B6,       dGamma,         dGamma,        (BT, NH),      false, F32, ()) \
  X(CHK,  ALW, B6,       dDT,            dDT,           (BT, NH),      false, F32, ()) \
  X(BOTH, ALW, B6,       d_x,            d_x,           (BT, DI),      false, TYP, (CL, CL)) \
  X(BOTH, ALW, B6,       d_b_pre_rope,   d_b_pre_rope,  (BT, NH, DS),  false, F32, ()) \
  X(BOTH, ALW, B6,       d_c_pre_rope,   d_c_pre_rope,  (BT, NH, DS),  false, F32, ()) \
  X(BOTH, ANG, B6,       d_angle_cumsum, d_angle_cumsum, (BT, NH, NA),  false, F32, ()) \
  X(BOTH, ALW, B6,       d_adt_total,    d_adt_total,   (BT, NH),      false, F32, ()) \
  X(BOTH, ALW, B6,       d_dt_direct,    d_dt_direct,   (BT, NH),      false, F32, ()) \
  X(BOTH, ALW, B6,       d_trap_sig,     d_trap_sig,    (BT, NH),      false, F32, ()) \
  X(BOTH, ANG, B5a,      d_angles_raw,   d_angles_raw,  (BT, NA),      false, F32, ()) \
  X(BOTH, ALW, B5a,      d_dt_angle,     d_dt_angle,    (BT, NH),      false, F32, ()) \
  X(BOTH, ALW, B5b,      d_dd_dt,        d_dd_dt,       (BT, NH),      false, F32, ()) \
  X(BOTH, ALW, B5b,      d_dd_a,         d_dd_a,        (BT, NH),      false, F32, ()) \
  X(BOTH, ALW, B5b,      d_trap_raw,     d_trap_raw,    (BT, NH),      false, F32, ()) \
  X(BOTH, ALW, B4b,      d_b_normed,     d_b_normed,    (BT, NG, DS),  false, TYP, ()) \
  X(BOTH, ALW, B4b,      d_c_normed,     d_c_normed,    (BT, NG, DS),  false, TYP, ()) \
  X(BOTH, ALW, B4c,      d_b_raw,        d_b_raw,       (BT, NG, DS),  false, TYP, (CL, CL)) \
  X(BOTH, ALW, B4c,      d_c_raw,        d_c_raw,       (BT, NG, DS),  false, TYP, (CL, CL)) \
  X(BOTH, ALW, B3,       d_proj,         d_proj,        (BT, IP),      false, TYP, ()) \
  X(BOTH, ALW, B2,       d_norm,         d_norm,        (BT, DM),      false, TYP, ()) \
  X(BOTH, ALW, B1,       d_pre_norm,     d_pre_norm,    (BT, DM),      false, F32, (VF, VF)) \
  X(BOTH, ALW, B1,       d_temporal,     d_temporal,    (BT, DM),      false, F32, ()) \
  X(BOTH, ALW, d_states, d_ssm_state,    d_ssm_in,      (B, NH, HD, DS), false, F32, ()) \
  X(BOTH, ALW, d_states, d_k_state,      d_k_in,        (B, NH, DS),   false, F32, ()) \
  X(BOTH, ALW, d_states, d_v_state,      d_v_in,        (B, NH, HD),   false, F32, ()) \
  X(BOTH, ANG, d_states, d_angle_state,  d_angle_in,    (B, NH, NA),   false, F32, ())
// Every parameter of MODEL.md §2, in the flat gradient order: X(scope, name, (shape)), scope BB
// (once per model) or LY (per layer). The param registry (registry.cpp) and the GPU path's
// parameter ids (gpu/backbone/backbone_t.cuh, Prm) are expansions of it. head_w: token models
// only (TRAINING.md §1).
#define M3_PARAMS(X)                   \
  X(BB, input_proj_w,     (IN, DM))    \
  X(BB, input_proj_b,     (DM))        \
  X(LY, norm_weight,      (DM))        \
  X(LY, in_proj_w,        (DM, IP))    \
  X(LY, dt_bias,          (NH))        \
  X(LY, b_norm_weight,    (DS))        \
  X(LY, c_norm_weight,    (DS))        \
  X(LY, b_bias,           (NH, DS))    \
  X(LY, c_bias,           (NH, DS))    \
  X(LY, d_param,          (NH))        \
  X(LY, norm_gate_weight, (DI))        \
  X(LY, out_proj_w,       (DI, DM))    \
  X(BB, norm_f_weight,    (DM))        \
  X(BB, head_w,           (DM, V))
// clang-format on
