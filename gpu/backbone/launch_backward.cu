// BackboneT's backward launchers (backbone_t.cuh): each backward stage of MODEL.md §6 as the
// launches of gpu/stages and gpu/scan, the sequential and chunked B6 (with Recompute::Scan's
// rerun of the scan's prep and states), the LM head's backward, norm_f's and input_proj's.
#include "backbone_t.cuh"

namespace m3::gpu::detail {

template <class T>
void BackboneT<T>::head_backward() {
  const Idx V = cfg_.vocab_size;
  T* d_logits = bb_.get<T>("head/d_logits");
  loss_backward<T>(s_, d_.BT, V, bb_.get<T>("head/logits"), bb_.f("loss/lse"), tgt_.data(),
                   tw_.data(), loss_scale_ / n_norm_, d_logits);
  if (!full_) bb_.view("head/d_Out", bb_.at("d_out"));
  float* d_head = bb_.f("head/d_Out");
  gemm_backward_dx_f32<T>(ctx_, d_.BT, d_.dm, V, d_logits, w_head(), d_head);
  gemm_backward_dw<T>(ctx_, d_.BT, d_.dm, V, bb_.get<T>("norm_f/Out"), d_logits,
                      G(-1, "head_w"));
  if (d_head != bb_.f("d_out")) copy_d2d(s_, bb_.f("d_out"), d_head, d_.BT * d_.dm);
}

template <class T>
void BackboneT<T>::norm_f_backward() {
  rmsnorm_backward<float>(s_, d_.BT, d_.dm, bb_.f("norm_f/norm_f_input"),
                          P(-1, "norm_f_weight"), bb_.f("norm_f/norm_f_rms"), bb_.f("d_out"),
                          bb_.f("norm_f/d_norm"), G(-1, "norm_f_weight"), scr());
}

template <class T>
void BackboneT<T>::input_proj_backward() {
  T* dx = bb_.get<T>("input_proj/d_input_proj_dx");
  if (tokens_) {  // the GEMM's dW of a one-hot X: δ⁰'s typed rows summed per token
    const T* dt = delta_typed();
    embed_backward<T>(s_, cfg_.vocab_size, d_.dm, dt, perm_.data(),
                      reinterpret_cast<const EmbedChunk*>(chunks_.data()), n_chunks_,
                      token_chunks_.data(), embed_partial_.data(), G(-1, "input_proj_w"));
    colsum(s_, d_.BT, d_.dm, bb_.f("delta"), G(-1, "input_proj_b"), true, scr());
    // ∂L/∂(one-hot): nothing reads it; made for a capture only.
    if (full_) gemm_backward_dx<T>(ctx_, d_.BT, d_.in, d_.dm, dt, w_input(), dx);
    return;
  }
  if (cfg_.input_proj_identity) {
    convert<float, T>(s_, d_.BT * d_.dm, bb_.f("delta"), dx);
  } else {
    const T* dt = delta_typed();
    gemm_backward_dx<T>(ctx_, d_.BT, d_.in, d_.dm, dt, w_input(), dx);
    gemm_backward_dw<T>(ctx_, d_.BT, d_.in, d_.dm, bb_.get<T>("input_proj/input_proj_inputs"),
                        dt, G(-1, "input_proj_w"));
    colsum(s_, d_.BT, d_.dm, bb_.f("delta"), G(-1, "input_proj_b"), true, scr());
  }
}

template <class T>
void BackboneT<T>::recompute_scan(int l) {
  ssm_chunked_rope_prep<T>(s_, d_, rope_prep_args(l, false), chunked_fwd_args(l, false));
  ssm_chunked_states<T>(s_, d_, chunked_fwd_args(l, true));
}

template <class T>
void BackboneT<T>::seq_b6(int l) {
  Buffers& L = layers_[l];
  auto t = [&](const char* n) { return L.get<T>(n); };
  auto f = [&](const char* n) { return L.f(n); };
  SsmSeqBwd<T> a{};
  a.x = t("x");
  a.k = t("k");
  a.q = t("q");
  a.d_y = t("d_y");
  a.alpha = f("alpha");
  a.beta = f("beta");
  a.gamma = f("gamma");
  a.d_param = P(l, "d_param");
  a.h_saved = f("h_saved");
  a.k_prev_saved = f("k_prev_saved");
  a.v_prev_saved = f("v_prev_saved");
  a.d_ssm_out = f("d_ssm_out");
  a.d_k_out = f("d_k_out");
  a.d_v_out = f("d_v_out");
  a.d_x = t("d_x");
  a.d_k = f("d_k");
  a.d_q = f("d_q");
  a.d_alpha = f("d_alpha");
  a.d_beta = f("d_beta");
  a.d_gamma = f("d_gamma");
  a.d_d_local = f("d_d_local");
  a.d_ssm_in = f("d_ssm_state");
  a.d_k_in = f("d_k_state");
  a.d_v_in = f("d_v_state");
  a.d_d_param = G(l, "d_param");
  a.ldx = shared_ld(l, "x", "d_x");
  ssm_seq_backward<T>(s_, d_, a, scr());
  RopeBwd<T> r{};
  r.theta = f("angle_cumsum");
  r.dv1 = f("d_k");
  r.dv2 = f("d_q");
  r.rot1 = t("k");
  r.rot2 = t("q");
  r.dpre1 = f("d_b_pre_rope");
  r.dpre2 = f("d_c_pre_rope");
  r.dtheta = f("d_angle_cumsum");
  rope_backward<T>(s_, d_, r);
  AbgBwd g{};
  g.alpha = f("alpha");
  g.beta = f("beta");
  g.dt = f("dt");
  g.trap = f("trap");
  g.d_alpha = f("d_alpha");
  g.d_beta = f("d_beta");
  g.d_gamma = f("d_gamma");
  g.d_adt_total = f("d_adt_total");
  g.d_dt_direct = f("d_dt_direct");
  g.d_trap_sig = f("d_trap_sig");
  abg_backward(s_, d_, g);
}

template <class T>
void BackboneT<T>::chunked_b6(int l, bool capturing) {
  Buffers& L = layers_[l];
  auto t = [&](const char* n) { return L.get<T>(n); };
  auto f = [&](const char* n) { return L.f(n); };
  if (lean() && rc_ == Recompute::Scan) recompute_scan(l);
  const bool tail = fused();
  const bool store_pre = !tail || capturing;
  SsmChunkBwd<T> a{};
  a.fuse_states = fused();  // B1 + B2 as one chunk walk (their bits)
  a.ldx = shared_ld(l, "x", "d_x");
  a.x = t("x");
  a.k = t("k");
  a.q = t("q");
  a.k_scaled_saved = t("k_scaled_saved");
  a.d_y = t("d_y");
  a.theta = f("angle_cumsum");
  a.dt = f("dt");
  a.trap = f("trap");
  a.a_val = f("a_val");
  a.d_param = P(l, "d_param");
  a.qk_dot_saved = f("qk_dot_saved");
  a.scale_saved = f("scale_saved");
  a.gamma_saved = f("gamma_saved");
  a.da_cumsum_saved = f("da_cumsum_saved");
  a.chunk_states_saved = f("chunk_states_saved");
  a.k_in = f("k_in");
  a.v_in = f("v_in");
  a.d_ssm_out = f("d_ssm_out");
  a.d_k_out = f("d_k_out");
  a.d_v_out = f("d_v_out");
  a.da_cs_sum = f("da_cs_sum");
  // The cluster tail writes dQ_mid and dK_mid only for a capture (they are verification-only
  // in the production layout then).
  a.cluster_tail = fused() && cluster_tail();
  const bool mid = capturing || !a.cluster_tail;
  a.dQ_mid = mid ? f("dQ_mid") : nullptr;
  a.dK_mid = mid ? f("dK_mid") : nullptr;
  a.dADT = f("dADT");
  a.dQK_dot = f("dQK_dot");
  a.dD_partials = f("dD_partials");
  a.dScale = f("dScale");
  a.dGamma = f("dGamma");
  a.dDT = f("dDT");
  a.d_x = t("d_x");
  a.d_b_pre_rope = store_pre ? f("d_b_pre_rope") : nullptr;
  a.d_c_pre_rope = store_pre ? f("d_c_pre_rope") : nullptr;
  a.d_angle_cumsum = f("d_angle_cumsum");
  a.d_adt_total = f("d_adt_total");
  a.d_dt_direct = f("d_dt_direct");
  a.d_trap_sig = f("d_trap_sig");
  a.d_ssm_in = f("d_ssm_state");
  a.d_k_in = f("d_k_state");
  a.d_v_in = f("d_v_state");
  a.d_d_param = G(l, "d_param");
  if (fused()) {  // the tail recomputes the biased and rotated B, C from b/c_normed
    a.b_normed = t("b_normed");
    a.c_normed = t("c_normed");
    a.b_bias = P(l, "b_bias");
    a.c_bias = P(l, "c_bias");
  } else {
    a.b_biased = t("b_biased");
    a.c_biased = t("c_biased");
  }
  if (tail) {
    a.d_b_normed = t("d_b_normed");
    a.d_c_normed = t("d_c_normed");
    a.d_b_bias = G(l, "b_bias");
    a.d_c_bias = G(l, "c_bias");
  }
  ssm_chunked_backward<T>(s_, d_, a, scr());
}

template <class T>
void BackboneT<T>::layer_backward_stage(int l, StageId st, bool capturing) {
  Buffers& L = layers_[l];
  auto t = [&](const char* n) { return L.get<T>(n); };
  auto f = [&](const char* n) { return L.f(n); };
  switch (st) {
  case StageId::B8: {
    const T* dt = delta_typed();
    gemm_backward_dx<T>(ctx_, d_.BT, d_.di, d_.dm, dt, w_out(l), t("d_gated"));
    gemm_backward_dw<T>(ctx_, d_.BT, d_.di, d_.dm, t("gated"), dt, G(l, "out_proj_w"));
    break;
  }
  case StageId::B7: {
    GatingBwd<T> a{};
    a.y = t("y");
    a.z = t("z");
    a.d_gated = t("d_gated");
    a.norm_gate_weight = P(l, "norm_gate_weight");
    a.gated_rms_vals = f("gated_rms_vals");
    a.d_y = t("d_y");
    a.d_z = t("d_z");
    a.d_norm_gate_weight = G(l, "norm_gate_weight");
    a.ldz = shared_ld(l, "z", "d_z");
    gating_backward<T>(s_, d_, a, scr());
    break;
  }
  case StageId::B6: {
    mode_ == ScanMode::Sequential ? seq_b6(l) : chunked_b6(l, capturing);
    break;
  }
  case StageId::B5a: {
    AngleBwd a{};
    a.angles_raw = f("angles_raw");
    a.dt = f("dt");
    a.d_angle_cumsum = f("d_angle_cumsum");
    a.d_angle_out = f("d_angle_out");
    a.d_angles_raw = f("d_angles_raw");
    a.d_dt_angle = f("d_dt_angle");
    a.d_angle_in = f("d_angle_state");
    if (proj_grads_direct(l)) a.d_angles_raw_cols = split_f32_cols(d_, t("d_proj")).d_angles_raw;
    angle_backward(s_, d_, a, scr());
    break;
  }
  case StageId::B5b: {
    ActBwd a{};
    a.dd_dt_raw = f("dd_dt_raw");
    a.dd_a_raw = f("dd_a_raw");
    a.dt_bias = P(l, "dt_bias");
    a.dt = f("dt");
    a.a_val = f("a_val");
    a.trap = f("trap");
    a.d_adt_total = f("d_adt_total");
    a.d_dt_direct = f("d_dt_direct");
    a.d_dt_angle = f("d_dt_angle");
    a.d_trap_sig = f("d_trap_sig");
    a.d_dd_dt = f("d_dd_dt");
    a.d_dd_a = f("d_dd_a");
    a.d_trap_raw = f("d_trap_raw");
    a.d_dt_bias = G(l, "dt_bias");
    a.a_floor = cfg_.a_floor;
    if (proj_grads_direct(l)) a.into_proj(split_f32_cols(d_, t("d_proj")));
    activations_backward(s_, d_, a, scr());
    break;
  }
  case StageId::B4b: {  // B4b and B4c are one launcher (bias/heads→groups + BCNorm)
    const bool done = fuse_.tail_in_b6;  // B4b ran in B6's tail: B4c alone
    BcnormBwd<T> a{};
    a.b_raw = t("b_raw");
    a.c_raw = t("c_raw");
    a.ldr = raw_ld(l);
    a.b_norm_weight = P(l, "b_norm_weight");
    a.c_norm_weight = P(l, "c_norm_weight");
    a.b_rms = f("b_rms");
    a.c_rms = f("c_rms");
    a.d_b_pre_rope = done ? nullptr : f("d_b_pre_rope");
    a.d_c_pre_rope = done ? nullptr : f("d_c_pre_rope");
    a.d_b_normed = t("d_b_normed");
    a.d_c_normed = t("d_c_normed");
    a.d_b_raw = t("d_b_raw");
    a.d_c_raw = t("d_c_raw");
    a.d_b_norm_weight = G(l, "b_norm_weight");
    a.d_c_norm_weight = G(l, "c_norm_weight");
    a.d_b_bias = G(l, "b_bias");
    a.d_c_bias = G(l, "c_bias");
    bcnorm_backward<T>(s_, d_, a, scr());
    break;
  }
  case StageId::B3: {
    if (proj_grads_direct(l)) return;  // B7, B6, B4c, B5b and B5a wrote all of d_proj
    SplitBwd<T> a{};
    // Column views (production): B7, B6 and B4c wrote the typed parts into d_proj already.
    const bool views = column_views(l);
    a.d_z = views ? nullptr : t("d_z");
    a.d_x = views ? nullptr : t("d_x");
    a.d_b_raw = views ? nullptr : t("d_b_raw");
    a.d_c_raw = views ? nullptr : t("d_c_raw");
    a.d_dd_dt = f("d_dd_dt");
    a.d_dd_a = f("d_dd_a");
    a.d_trap_raw = f("d_trap_raw");
    a.d_angles_raw = f("d_angles_raw");
    a.d_proj = t("d_proj");
    split_backward<T>(s_, d_, a);
    break;
  }
  case StageId::B2: {
    gemm_backward_dx<T>(ctx_, d_.BT, d_.dm, d_.ip, t("d_proj"), w_in(l), t("d_norm"));
    gemm_backward_dw<T>(ctx_, d_.BT, d_.dm, d_.ip, t("post_norm"), t("d_proj"),
                        G(l, "in_proj_w"));
    break;
  }
  case StageId::B1: {
    // d_temporal = δ + d_pre_norm in the same kernel; d_pre_norm stored for a capture only
    // (both are B1's own outputs, so this holds in the isolated mode too).
    // Fused runs: δ's typed copy for the next layer's B8 too (delta_typed then converts
    // nothing; the isolated mode restores δ from the oracle between stages, so it converts).
    T* typed = nullptr;
    if constexpr (!std::is_same_v<T, float>)
      if (fused()) typed = bb_.get<T>("delta_typed");
    rmsnorm_backward<T>(s_, d_.BT, d_.dm, f("residual"), P(l, "norm_weight"), f("rms_vals"),
                        t("d_norm"), capturing ? f("d_pre_norm") : nullptr,
                        G(l, "norm_weight"), scr(), bb_.f("delta"), f("d_temporal"), typed);
    delta_typed_of_ = typed ? f("d_temporal") : nullptr;
    break;
  }
  case StageId::input_proj: case StageId::F1: case StageId::F2: case StageId::F3:
  case StageId::F4: case StageId::F5: case StageId::F4ef: case StageId::F5b: case StageId::F6:
  case StageId::F7: case StageId::F8: case StageId::states: case StageId::norm_f:
  case StageId::head: case StageId::loss: case StageId::B4c: case StageId::d_states:
    break;  // B4c runs with B4b; d_states is written by B6 and B5a
  }
}

#define M3_INSTANTIATE(T) \
  template void BackboneT<T>::head_backward(); \
  template void BackboneT<T>::norm_f_backward(); \
  template void BackboneT<T>::input_proj_backward(); \
  template void BackboneT<T>::recompute_scan(int l); \
  template void BackboneT<T>::seq_b6(int l); \
  template void BackboneT<T>::chunked_b6(int l, bool capturing); \
  template void BackboneT<T>::layer_backward_stage(int l, StageId st, bool capturing);
M3_INSTANTIATE(float)
M3_INSTANTIATE(__nv_bfloat16)
M3_INSTANTIATE(__half)
#undef M3_INSTANTIATE

}  // namespace m3::gpu::detail
