// BackboneT's backward launchers (backbone_t.cuh): each backward stage of MODEL.md §6 as the
// launches of gpu/stages and gpu/scan, the sequential and chunked B6 (with Recompute::Scan's
// rerun of the scan's prep and states), the LM head's backward, norm_f's and input_proj's.
#include "backbone_t.cuh"

namespace m3::gpu::detail {

template <class T>
void BackboneT<T>::head_backward() {
  const Idx V = cfg_.vocab_size;
  T* d_logits = bb_.get<T>(BBuf::d_logits);
  loss_backward<T>(s_, d_.BT, V, bb_.get<T>(BBuf::logits), bb_.f(BBuf::lse), tgt_.data(),
                   tw_.data(), loss_scale_ / n_norm_, d_logits);
  if (!full_) bb_.view(BBuf::d_Out, bb_.at(BBuf::d_out));
  float* d_head = bb_.f(BBuf::d_Out);
  // The isolated mode: the GEMMs read the teacher's d_logits, as the reference's isolated runner
  // (harness/isolated.cpp) and the GPU oracle's teacher-forced pass feed them; the stage's own
  // d_logits goes back into its buffer for the capture.
  DeviceArray<T> own;
  if (iso_) {
    own.resize(d_.BT * V);
    copy_d2d(s_, own.data(), d_logits, d_.BT * V);
    restore_key(stage_key(-1, "head", "d_logits"));
  }
  gemm_backward_dx_f32<T>(ctx_, d_.BT, d_.dm, V, d_logits, w_head(), d_head);
  gemm_backward_dw<T>(ctx_, d_.BT, d_.dm, V, bb_.get<T>(BBuf::Out), d_logits,
                      G(-1, Prm::head_w));
  if (d_head != bb_.f(BBuf::d_out)) copy_d2d(s_, bb_.f(BBuf::d_out), d_head, d_.BT * d_.dm);
  if (iso_) {
    copy_d2d(s_, d_logits, own.data(), d_.BT * V);
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));  // before `own` is freed
  }
}

template <class T>
void BackboneT<T>::norm_f_backward() {
  rmsnorm_backward<float>(s_, d_.BT, d_.dm, bb_.f(BBuf::norm_f_input),
                          P(-1, Prm::norm_f_weight), bb_.f(BBuf::norm_f_rms), bb_.f(BBuf::d_out),
                          bb_.f(BBuf::d_norm), G(-1, Prm::norm_f_weight), scr());
}

template <class T>
void BackboneT<T>::input_proj_backward() {
  T* dx = bb_.get<T>(BBuf::d_input_proj_dx);
  if (tokens_) {  // the GEMM's dW of a one-hot X: δ⁰'s typed rows summed per token
    const T* dt = delta_typed();
    embed_backward<T>(s_, cfg_.vocab_size, d_.dm, dt, perm_.data(),
                      reinterpret_cast<const EmbedChunk*>(chunks_.data()), n_chunks_,
                      token_chunks_.data(), embed_partial_.data(), G(-1, Prm::input_proj_w));
    colsum(s_, d_.BT, d_.dm, bb_.f(BBuf::delta), G(-1, Prm::input_proj_b), true, scr());
    // ∂L/∂(one-hot): nothing reads it; made for a capture only.
    if (full_) gemm_backward_dx<T>(ctx_, d_.BT, d_.in, d_.dm, dt, w_input(), dx);
    return;
  }
  if (cfg_.input_proj_identity) {
    convert<float, T>(s_, d_.BT * d_.dm, bb_.f(BBuf::delta), dx);
  } else {
    const T* dt = delta_typed();
    gemm_backward_dx<T>(ctx_, d_.BT, d_.in, d_.dm, dt, w_input(), dx);
    gemm_backward_dw<T>(ctx_, d_.BT, d_.in, d_.dm, bb_.get<T>(BBuf::input_proj_inputs),
                        dt, G(-1, Prm::input_proj_w));
    colsum(s_, d_.BT, d_.dm, bb_.f(BBuf::delta), G(-1, Prm::input_proj_b), true, scr());
  }
}

template <class T>
void BackboneT<T>::recompute_scan(int l) {
  ssm_chunked_rope_prep<T>(s_, d_, rope_prep_args(l, false), chunked_fwd_args(l, false));
  ssm_chunked_states<T>(s_, d_, chunked_fwd_args(l, true));
}

template <class T>
void BackboneT<T>::seq_b6(int l) {
  LayerBufs& L = layers_[l];
  auto t = [&](LBuf n) { return L.get<T>(n); };
  auto f = [&](LBuf n) { return L.f(n); };
  SsmSeqBwd<T> a{};
  a.x = t(LBuf::x);
  a.k = t(LBuf::k);
  a.q = t(LBuf::q);
  a.d_y = t(LBuf::d_y);
  a.alpha = f(LBuf::alpha);
  a.beta = f(LBuf::beta);
  a.gamma = f(LBuf::gamma);
  a.d_param = P(l, Prm::d_param);
  a.h_saved = f(LBuf::h_saved);
  a.k_prev_saved = f(LBuf::k_prev_saved);
  a.v_prev_saved = f(LBuf::v_prev_saved);
  a.d_ssm_out = f(LBuf::d_ssm_out);
  a.d_k_out = f(LBuf::d_k_out);
  a.d_v_out = f(LBuf::d_v_out);
  a.d_x = t(LBuf::d_x);
  a.d_k = f(LBuf::d_k);
  a.d_q = f(LBuf::d_q);
  a.d_alpha = f(LBuf::d_alpha);
  a.d_beta = f(LBuf::d_beta);
  a.d_gamma = f(LBuf::d_gamma);
  a.d_d_local = f(LBuf::d_d_local);
  a.d_ssm_in = f(LBuf::d_ssm_state);
  a.d_k_in = f(LBuf::d_k_state);
  a.d_v_in = f(LBuf::d_v_state);
  a.d_d_param = G(l, Prm::d_param);
  a.ldx = shared_ld(l, LBuf::x, LBuf::d_x);
  ssm_seq_backward<T>(s_, d_, a, scr());
  RopeBwd<T> r{};
  r.theta = f(LBuf::angle_cumsum);
  r.dv1 = f(LBuf::d_k);
  r.dv2 = f(LBuf::d_q);
  r.rot1 = t(LBuf::k);
  r.rot2 = t(LBuf::q);
  r.dpre1 = f(LBuf::d_b_pre_rope);
  r.dpre2 = f(LBuf::d_c_pre_rope);
  r.dtheta = f(LBuf::d_angle_cumsum);
  rope_backward<T>(s_, d_, r);
  AbgBwd g{};
  g.alpha = f(LBuf::alpha);
  g.beta = f(LBuf::beta);
  g.dt = f(LBuf::dt);
  g.trap = f(LBuf::trap);
  g.d_alpha = f(LBuf::d_alpha);
  g.d_beta = f(LBuf::d_beta);
  g.d_gamma = f(LBuf::d_gamma);
  g.d_adt_total = f(LBuf::d_adt_total);
  g.d_dt_direct = f(LBuf::d_dt_direct);
  g.d_trap_sig = f(LBuf::d_trap_sig);
  abg_backward(s_, d_, g);
}

template <class T>
void BackboneT<T>::chunked_b6(int l, bool capturing) {
  LayerBufs& L = layers_[l];
  auto t = [&](LBuf n) { return L.get<T>(n); };
  auto f = [&](LBuf n) { return L.f(n); };
  if (lean() && rc_ == Recompute::Scan) recompute_scan(l);
  const bool tail = fused();
  const bool store_pre = !tail || capturing;
  SsmChunkBwd<T> a{};
  a.fuse_states = fused();  // B1 + B2 as one chunk walk (their bits)
  a.ldx = shared_ld(l, LBuf::x, LBuf::d_x);
  a.x = t(LBuf::x);
  a.k = t(LBuf::k);
  a.q = t(LBuf::q);
  a.k_scaled_saved = t(LBuf::k_scaled_saved);
  a.d_y = t(LBuf::d_y);
  a.theta = f(LBuf::angle_cumsum);
  a.dt = f(LBuf::dt);
  a.trap = f(LBuf::trap);
  a.a_val = f(LBuf::a_val);
  a.d_param = P(l, Prm::d_param);
  a.qk_dot_saved = f(LBuf::qk_dot_saved);
  a.scale_saved = f(LBuf::scale_saved);
  a.gamma_saved = f(LBuf::gamma_saved);
  a.da_cumsum_saved = f(LBuf::da_cumsum_saved);
  a.chunk_states_saved = f(LBuf::chunk_states_saved);
  a.k_in = f(LBuf::k_in);
  a.v_in = f(LBuf::v_in);
  a.d_ssm_out = f(LBuf::d_ssm_out);
  a.d_k_out = f(LBuf::d_k_out);
  a.d_v_out = f(LBuf::d_v_out);
  a.da_cs_sum = f(LBuf::da_cs_sum);
  // The cluster tail writes dQ_mid and dK_mid only for a capture (they are verification-only
  // in the production layout then).
  a.cluster_tail = fused() && cluster_tail();
  const bool mid = capturing || !a.cluster_tail;
  a.dQ_mid = mid ? f(LBuf::dQ_mid) : nullptr;
  a.dK_mid = mid ? f(LBuf::dK_mid) : nullptr;
  a.dADT = f(LBuf::dADT);
  a.dQK_dot = f(LBuf::dQK_dot);
  a.dD_partials = f(LBuf::dD_partials);
  a.dScale = f(LBuf::dScale);
  a.dGamma = f(LBuf::dGamma);
  a.dDT = f(LBuf::dDT);
  a.d_x = t(LBuf::d_x);
  a.d_b_pre_rope = store_pre ? f(LBuf::d_b_pre_rope) : nullptr;
  a.d_c_pre_rope = store_pre ? f(LBuf::d_c_pre_rope) : nullptr;
  a.d_angle_cumsum = f(LBuf::d_angle_cumsum);
  a.d_adt_total = f(LBuf::d_adt_total);
  a.d_dt_direct = f(LBuf::d_dt_direct);
  a.d_trap_sig = f(LBuf::d_trap_sig);
  a.d_ssm_in = f(LBuf::d_ssm_state);
  a.d_k_in = f(LBuf::d_k_state);
  a.d_v_in = f(LBuf::d_v_state);
  a.d_d_param = G(l, Prm::d_param);
  if (fused()) {  // the tail recomputes the biased and rotated B, C from b/c_normed
    a.b_normed = t(LBuf::b_normed);
    a.c_normed = t(LBuf::c_normed);
    a.b_bias = P(l, Prm::b_bias);
    a.c_bias = P(l, Prm::c_bias);
  } else {
    a.b_biased = t(LBuf::b_biased);
    a.c_biased = t(LBuf::c_biased);
  }
  if (tail) {
    a.d_b_normed = t(LBuf::d_b_normed);
    a.d_c_normed = t(LBuf::d_c_normed);
    a.d_b_bias = G(l, Prm::b_bias);
    a.d_c_bias = G(l, Prm::c_bias);
  }
  ssm_chunked_backward<T>(s_, d_, a, scr());
}

template <class T>
void BackboneT<T>::layer_backward_stage(int l, StageId st, bool capturing) {
  LayerBufs& L = layers_[l];
  auto t = [&](LBuf n) { return L.get<T>(n); };
  auto f = [&](LBuf n) { return L.f(n); };
  switch (st) {
  case StageId::B8: {
    const T* dt = delta_typed();
    gemm_backward_dx<T>(ctx_, d_.BT, d_.di, d_.dm, dt, w_out(l), t(LBuf::d_gated));
    if (!rewritten(l, LBuf::gated))
      gemm_backward_dw<T>(ctx_, d_.BT, d_.di, d_.dm, t(LBuf::gated), dt, G(l, Prm::out_proj_w));
    break;
  }
  case StageId::B7: {
    GatingBwd<T> a{};
    if (rewritten(l, LBuf::gated)) a.gated = t(LBuf::gated);
    a.y = t(LBuf::y);
    a.z = t(LBuf::z);
    a.d_gated = t(LBuf::d_gated);
    a.norm_gate_weight = P(l, Prm::norm_gate_weight);
    a.gated_rms_vals = f(LBuf::gated_rms_vals);
    a.d_y = t(LBuf::d_y);
    a.d_z = t(LBuf::d_z);
    a.d_norm_gate_weight = G(l, Prm::norm_gate_weight);
    a.ldz = shared_ld(l, LBuf::z, LBuf::d_z);
    gating_backward<T>(s_, d_, a, scr());
    // B8's weight gradient, on the gated that B7 has just written again.
    if (a.gated)
      gemm_backward_dw<T>(ctx_, d_.BT, d_.di, d_.dm, a.gated, delta_typed_made(),
                          G(l, Prm::out_proj_w));
    break;
  }
  case StageId::B6: {
    mode_ == ScanMode::Sequential ? seq_b6(l) : chunked_b6(l, capturing);
    break;
  }
  case StageId::B5a: {
    AngleBwd a{};
    a.angles_raw = f(LBuf::angles_raw);
    a.dt = f(LBuf::dt);
    a.d_angle_cumsum = f(LBuf::d_angle_cumsum);
    a.d_angle_out = f(LBuf::d_angle_out);
    a.d_angles_raw = f(LBuf::d_angles_raw);
    a.d_dt_angle = f(LBuf::d_dt_angle);
    a.d_angle_in = f(LBuf::d_angle_state);
    if (proj_grads_direct(l)) a.d_angles_raw_cols = split_f32_cols(d_, t(LBuf::d_proj)).d_angles_raw;
    angle_backward(s_, d_, a, scr());
    break;
  }
  case StageId::B5b: {
    ActBwd a{};
    a.dd_dt_raw = f(LBuf::dd_dt_raw);
    a.dd_a_raw = f(LBuf::dd_a_raw);
    a.dt_bias = P(l, Prm::dt_bias);
    a.dt = f(LBuf::dt);
    a.a_val = f(LBuf::a_val);
    a.trap = f(LBuf::trap);
    a.d_adt_total = f(LBuf::d_adt_total);
    a.d_dt_direct = f(LBuf::d_dt_direct);
    a.d_dt_angle = f(LBuf::d_dt_angle);
    a.d_trap_sig = f(LBuf::d_trap_sig);
    a.d_dd_dt = f(LBuf::d_dd_dt);
    a.d_dd_a = f(LBuf::d_dd_a);
    a.d_trap_raw = f(LBuf::d_trap_raw);
    a.d_dt_bias = G(l, Prm::dt_bias);
    a.a_floor = cfg_.a_floor;
    if (proj_grads_direct(l)) a.into_proj(split_f32_cols(d_, t(LBuf::d_proj)));
    activations_backward(s_, d_, a, scr());
    break;
  }
  case StageId::B4b: {  // B4b and B4c are one launcher (bias/heads→groups + BCNorm)
    const bool done = fuse_.tail_in_b6;  // B4b ran in B6's tail: B4c alone
    BcnormBwd<T> a{};
    a.b_raw = t(LBuf::b_raw);
    a.c_raw = t(LBuf::c_raw);
    a.ldr = raw_ld(l);
    a.b_norm_weight = P(l, Prm::b_norm_weight);
    a.c_norm_weight = P(l, Prm::c_norm_weight);
    a.b_rms = f(LBuf::b_rms);
    a.c_rms = f(LBuf::c_rms);
    a.d_b_pre_rope = done ? nullptr : f(LBuf::d_b_pre_rope);
    a.d_c_pre_rope = done ? nullptr : f(LBuf::d_c_pre_rope);
    a.d_b_normed = t(LBuf::d_b_normed);
    a.d_c_normed = t(LBuf::d_c_normed);
    a.d_b_raw = t(LBuf::d_b_raw);
    a.d_c_raw = t(LBuf::d_c_raw);
    a.d_b_norm_weight = G(l, Prm::b_norm_weight);
    a.d_c_norm_weight = G(l, Prm::c_norm_weight);
    a.d_b_bias = G(l, Prm::b_bias);
    a.d_c_bias = G(l, Prm::c_bias);
    bcnorm_backward<T>(s_, d_, a, scr());
    break;
  }
  case StageId::B3: {
    if (proj_grads_direct(l)) return;  // B7, B6, B4c, B5b and B5a wrote all of d_proj
    SplitBwd<T> a{};
    // Column views (production): B7, B6 and B4c wrote the typed parts into d_proj already.
    const bool views = column_views(l);
    a.d_z = views ? nullptr : t(LBuf::d_z);
    a.d_x = views ? nullptr : t(LBuf::d_x);
    a.d_b_raw = views ? nullptr : t(LBuf::d_b_raw);
    a.d_c_raw = views ? nullptr : t(LBuf::d_c_raw);
    a.d_dd_dt = f(LBuf::d_dd_dt);
    a.d_dd_a = f(LBuf::d_dd_a);
    a.d_trap_raw = f(LBuf::d_trap_raw);
    a.d_angles_raw = f(LBuf::d_angles_raw);
    a.d_proj = t(LBuf::d_proj);
    split_backward<T>(s_, d_, a);
    break;
  }
  case StageId::B2: {
    gemm_backward_dx<T>(ctx_, d_.BT, d_.dm, d_.ip, t(LBuf::d_proj), w_in(l), t(LBuf::d_norm));
    if (!rewritten(l, LBuf::post_norm))
      gemm_backward_dw<T>(ctx_, d_.BT, d_.dm, d_.ip, t(LBuf::post_norm), t(LBuf::d_proj),
                          G(l, Prm::in_proj_w));
    break;
  }
  case StageId::B1: {
    // d_temporal = δ + d_pre_norm in the same kernel; d_pre_norm stored for a capture only
    // (both are B1's own outputs, so this holds in the isolated mode too).
    // Fused runs: δ's typed copy for the next layer's B8 too (delta_typed then converts
    // nothing; the isolated mode restores δ from the oracle between stages, so it converts).
    T* typed = nullptr;
    if constexpr (!std::is_same_v<T, float>)
      if (fused()) typed = bb_.get<T>(BBuf::delta_typed);
    T* post = rewritten(l, LBuf::post_norm) ? t(LBuf::post_norm) : nullptr;
    rmsnorm_backward<T>(s_, d_.BT, d_.dm, f(LBuf::residual), P(l, Prm::norm_weight), f(LBuf::rms_vals),
                        t(LBuf::d_norm), capturing ? f(LBuf::d_pre_norm) : nullptr,
                        G(l, Prm::norm_weight), scr(), bb_.f(BBuf::delta), f(LBuf::d_temporal), typed,
                        post);
    delta_typed_of_ = typed ? f(LBuf::d_temporal) : nullptr;
    // B2's weight gradient, on the post_norm that B1 has just written again (d_proj is
    // untouched since B2).
    if (post)
      gemm_backward_dw<T>(ctx_, d_.BT, d_.dm, d_.ip, post, t(LBuf::d_proj), G(l, Prm::in_proj_w));
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
