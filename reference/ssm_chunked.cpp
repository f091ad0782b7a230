// F6 as chunked (parallel) scan, K0–K6 (MODEL.md §5.2, entering states §5.3/§12.4), and its
// backward, steps 1–3 of §6.4 (step 4 is B5b, split.cpp). Equal to ssm_sequential.cpp in
// exact arithmetic (§5.1).
//
// Per (b, h); chunk c covers t ∈ [c·CS, min(T, (c+1)·CS)), local index τ, length L_c:
//   K0  adt_t   = a_val_t·dt_t
//   K1  γ_t = dt_t·trap_t;  sg_t = dt_{t+1}(1 − trap_{t+1}) (t < T−1), sg_{T−1} = 0
//       scale_t = γ_t + sg_t;  Ks_t = K_t·scale_t;  qk_t = γ_t·(Q_t·K_t)
//   K2  cum_t = Σ_{τ' ≤ τ} adt inside the chunk (restarted per chunk), Λ_c = cum at its end
//   K3  contrib_c = Σ_{s∈c} e^{Λ_c − cum_s} x_s Ks_sᵀ                         [hd, ds]
//   K4  S_0 = ssm_in + sg_{−1}·v_in k_inᵀ with sg_{−1} = dt_0(1 − trap_0);
//       S_{c+1} = e^{Λ_c} S_c + contrib_c;  final = S_{nc} = h_{T−1}
//   K5  y_t = e^{cum_t} S_c Q_t + Σ_{s∈c, s<t} e^{cum_t − cum_s}(Q_t·Ks_s) x_s + (D + qk_t) x_t
//   K6  ssm_out = final, k_out = K_{T−1}, v_out = x_{T−1}
// In matrix form per chunk (rows = steps): A = Q Ksᵀ, M[t,s] = e^{cum_t − cum_s} for s < t
// (0 otherwise): Y = (M⊙A) X + diag(e^{cum}) Q Sᵀ + diag(D + qk) X.
//
// Backward, dS = ∂L/∂(state leaving the chunk), starting at ∂L/∂ssm_out; chunks in reverse.
// With dO = d_y, P = dO Xᵀ, W = M⊙P⊙A (W[j,i] = w_ij of §6.4):
//   step 1 (dqkv):
//   dV     = (M⊙A)ᵀ dO + diag(e^{Λ−cum}) Ks dSᵀ + diag(D + qk) dO            (= d_x)
//   dQK_t  = dO_t·x_t;   dD_partials[b,h] = Σ_t dQK_t
//   dK_mid = (M⊙P)ᵀ Q + diag(e^{Λ−cum}) X dS                                 (∂L/∂Ks)
//   dQ_mid = (M⊙P) Ks + diag(e^{cum}) dO S                                   (∂L/∂Q w/o qk)
//   R_t = Σ_i W[t,i] − Σ_j W[j,t] + e^{cum_t} (dO S)_t·Q_t
//   M_t = e^{Λ−cum_t} (X dS)_t·Ks_t,  M_sc = e^{Λ} ⟨S, dS⟩
//   dADT_τ = Σ_{t ≥ τ} (R_t − M_t) + M_sc + Σ_t M_t
//   dS ← e^{Λ} dS + dOᵀ diag(e^{cum}) Q
//   after chunk 0: d_ssm_in = dS, d_v_in = sg_{−1} dS k_in, d_k_in = sg_{−1} dSᵀ v_in,
//   dScale_{−1} = v_inᵀ dS k_in (the sg_{−1} path).
//   step 2 (dqktheta), per (r, h), Kb/Qb = b_biased/c_biased (pre-RoPE):
//   dScale = dK_mid·K;  dGamma = dQK·(Qb·Kb)
//   d_b_pre_rope = Rᵀ(scale·dK_mid + ∂L/∂k_out[t=T−1]) + dQK·γ·Qb
//   d_c_pre_rope = Rᵀ dQ_mid + dQK·γ·Kb
//   d_angle_cumsum = rope angle gradient of (scale·dK_mid + ∂L/∂k_out, k) and (dQ_mid, q)
//   step 3 (ddt_dtrap): dDT_t = (dGamma_t + dScale_t)·trap_t + dScale_{t−1}·(1 − trap_t)
//   ∂L/∂trap_t = ((dGamma_t + dScale_t) − dScale_{t−1})·dt_t
// B5b then takes d_adt_total = dADT, d_dt_direct = dDT, d_trap_sig = ∂L/∂trap.
// Saved: adt, k_scaled_saved, qk_dot_saved, scale_saved, gamma_saved, da_cumsum_saved
// [B, nc, nh, CS] (padding slots 0), chunk_states (contributions) and chunk_states_saved
// (entering S_c) [B, nc, nh, hd, ds], final_states [B, nh, hd, ds].
#include "eigen.hpp"
#include "stages.hpp"

namespace m3::ref {

namespace {
template <class S>
CSMapM<S> rows_of(const std::vector<S>& buf, const Dims& d, Idx b, Idx h, Idx t0, Idx L,
                  Idx width) {
  // buf is [BT, nh, width]; the block of head h for rows t0 … t0+L−1 of sample b.
  return CSMapM<S>(buf.data() + ((b * d.T + t0) * d.nh + h) * width, L, width,
                   Eigen::OuterStride<>(d.nh * width));
}
template <class S>
SMapM<S> rows_of(std::vector<S>& buf, const Dims& d, Idx b, Idx h, Idx t0, Idx L, Idx width) {
  return SMapM<S>(buf.data() + ((b * d.T + t0) * d.nh + h) * width, L, width,
                  Eigen::OuterStride<>(d.nh * width));
}
template <class S>
CSVec<S> col_of(const std::vector<S>& buf, const Dims& d, Idx b, Idx h, Idx t0, Idx L) {
  return CSVec<S>(buf.data() + (b * d.T + t0) * d.nh + h, L, Eigen::InnerStride<>(d.nh));
}
template <class S>
SVec<S> col_of(std::vector<S>& buf, const Dims& d, Idx b, Idx h, Idx t0, Idx L) {
  return SVec<S>(buf.data() + (b * d.T + t0) * d.nh + h, L, Eigen::InnerStride<>(d.nh));
}

// M[t,s] = e^{cum_t − cum_s} for s < t, else 0.
template <class S>
Mat<S> decay_matrix(const Vec<S>& cum) {
  const Idx L = cum.size();
  Mat<S> M = Mat<S>::Zero(L, L);
  for (Idx t = 0; t < L; ++t)
    for (Idx s = 0; s < t; ++s) M(t, s) = std::exp(cum[t] - cum[s]);
  return M;
}

inline Idx state_offset(const Dims& d, Idx b, Idx c, Idx h) {
  return ((b * d.nc + c) * d.nh + h) * d.hd * d.ds;
}
}  // namespace

template <class S>
void ssm_chunked_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a) {
  const Idx hd = d.hd, ds = d.ds, nh = d.nh;
  // K0, K1 (per row).
  for (Idx b = 0; b < d.B; ++b)
    for (Idx t = 0; t < d.T; ++t)
      for (Idx h = 0; h < nh; ++h) {
        const Idx r = b * d.T + t, i = r * nh + h;
        a.adt[i] = a.a_val[i] * a.dt[i];
        const S gam = a.dt[i] * a.trap[i];
        const S sg = t + 1 < d.T ? a.dt[i + nh] * (S(1) - a.trap[i + nh]) : S(0);
        a.gamma_saved[i] = gam;
        a.scale_saved[i] = gam + sg;
        Eigen::Map<const Vec<S>> K(a.k.data() + i * ds, ds), Q(a.q.data() + i * ds, ds);
        Eigen::Map<Vec<S>>(a.k_scaled_saved.data() + i * ds, ds) = K * (gam + sg);
        a.qk_dot_saved[i] = gam * Q.dot(K);
      }
  store_typed(d, a.k_scaled_saved);  // K_scaled is a typed activation (MODEL.md §8)
  std::fill(a.da_cumsum_saved.begin(), a.da_cumsum_saved.end(), S(0));
  Mat<S> Sst(hd, ds);
  for (Idx b = 0; b < d.B; ++b)
    for (Idx h = 0; h < nh; ++h) {
      const Idx sb = b * nh + h;
      // K4 entry: S_0 = h_init + sg_{−1} v_init k_initᵀ.
      const Idx i0 = (b * d.T) * nh + h;
      const S sgm1 = a.dt[i0] * (S(1) - a.trap[i0]);
      Eigen::Map<const Vec<S>> k_in(a.k_in.data() + sb * ds, ds), v_in(a.v_in.data() + sb * hd, hd);
      Sst = CMapM<S>(a.ssm_in.data() + sb * hd * ds, hd, ds);
      Sst.noalias() += sgm1 * (v_in * k_in.transpose());
      const S D = p.d_param[h];
      for (Idx c = 0; c < d.nc; ++c) {
        const Idx t0 = d.chunk_begin(c), L = d.chunk_end(c) - t0;
        // K2
        Vec<S> cum(L);
        const auto adt = col_of(a.adt, d, b, h, t0, L);
        S acc = S(0);
        for (Idx tau = 0; tau < L; ++tau) cum[tau] = (acc += adt[tau]);
        const S Lam = cum[L - 1];
        S* cs = a.da_cumsum_saved.data() + ((b * d.nc + c) * nh + h) * d.cs;
        for (Idx tau = 0; tau < L; ++tau) cs[tau] = cum[tau];
        const auto X = rows_of(a.x, d, b, h, t0, L, hd);
        const auto Q = rows_of(a.q, d, b, h, t0, L, ds);
        const auto Ks = rows_of(a.k_scaled_saved, d, b, h, t0, L, ds);
        const auto qk = col_of(a.qk_dot_saved, d, b, h, t0, L);
        // K3
        const Vec<S> w_end = (Lam - cum.array()).exp().matrix();
        MapM<S> contrib(a.chunk_states.data() + state_offset(d, b, c, h), hd, ds);
        contrib.noalias() = X.transpose() * w_end.asDiagonal() * Ks;
        // K4
        MapM<S>(a.chunk_states_saved.data() + state_offset(d, b, c, h), hd, ds) = Sst;
        // K5
        const Mat<S> MA = decay_matrix(cum).cwiseProduct(Q * Ks.transpose());
        const Vec<S> e_cum = cum.array().exp().matrix();
        auto Y = rows_of(a.y, d, b, h, t0, L, hd);
        Y.noalias() = MA * X;
        Y.noalias() += e_cum.asDiagonal() * (Q * Sst.transpose());
        Y.noalias() += (qk.array() + D).matrix().asDiagonal() * X;
        Sst = std::exp(Lam) * Sst + contrib;
      }
      // K6
      MapM<S>(a.final_states.data() + sb * hd * ds, hd, ds) = Sst;
      MapM<S>(a.ssm_out.data() + sb * hd * ds, hd, ds) = Sst;
      const Idx iL = (b * d.T + d.T - 1) * nh + h;
      std::copy_n(a.k.data() + iL * ds, ds, a.k_out.data() + sb * ds);
      std::copy_n(a.x.data() + (b * d.T + d.T - 1) * d.di + h * hd, hd, a.v_out.data() + sb * hd);
    }
}

template <class S>
void ssm_chunked_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                          LayerGrads<S>& g, LayerParams<S>& pg) {
  const Idx hd = d.hd, ds = d.ds, nh = d.nh;
  Mat<S> dS(hd, ds);
  std::vector<S> dscale_prev(static_cast<size_t>(d.B * nh), S(0));  // dScale_{−1} per (b,h)
  // ---- step 1: dqkv, per (b, h), chunks in reverse
  for (Idx b = 0; b < d.B; ++b)
    for (Idx h = 0; h < nh; ++h) {
      const Idx sb = b * nh + h;
      dS = CMapM<S>(g.d_ssm_out.data() + sb * hd * ds, hd, ds);
      const S D = p.d_param[h];
      S dD_acc = S(0);
      for (Idx c = d.nc - 1; c >= 0; --c) {
        const Idx t0 = d.chunk_begin(c), L = d.chunk_end(c) - t0;
        const S* csp = a.da_cumsum_saved.data() + ((b * d.nc + c) * nh + h) * d.cs;
        const Vec<S> cum = Eigen::Map<const Vec<S>>(csp, L);
        const S Lam = cum[L - 1];
        g.da_cs_sum[(b * d.nc + c) * nh + h] = Lam;
        const CMapM<S> Sin(a.chunk_states_saved.data() + state_offset(d, b, c, h), hd, ds);
        const auto X = rows_of(a.x, d, b, h, t0, L, hd);
        const auto Q = rows_of(a.q, d, b, h, t0, L, ds);
        const auto Ks = rows_of(a.k_scaled_saved, d, b, h, t0, L, ds);
        const auto qk = col_of(a.qk_dot_saved, d, b, h, t0, L);
        const auto dO = rows_of(g.d_y, d, b, h, t0, L, hd);
        const Mat<S> M = decay_matrix(cum);
        const Mat<S> A = Q * Ks.transpose();
        const Mat<S> P = dO * X.transpose();
        const Mat<S> MA = M.cwiseProduct(A), MP = M.cwiseProduct(P);
        const Vec<S> e_cum = cum.array().exp().matrix();
        const Vec<S> e_end = (Lam - cum.array()).exp().matrix();
        const Mat<S> dOS = dO * Sin;   // [L, ds]
        const Mat<S> XdS = X * dS;     // [L, ds]
        auto dV = rows_of(g.d_x, d, b, h, t0, L, hd);
        dV.noalias() = MA.transpose() * dO;
        dV.noalias() += e_end.asDiagonal() * (Ks * dS.transpose());
        dV.noalias() += (qk.array() + D).matrix().asDiagonal() * dO;
        auto dQK = col_of(g.dQK_dot, d, b, h, t0, L);
        for (Idx tau = 0; tau < L; ++tau) {
          dQK[tau] = dO.row(tau).dot(X.row(tau));
          dD_acc += dQK[tau];
        }
        auto dK_mid = rows_of(g.dK_mid, d, b, h, t0, L, ds);
        dK_mid.noalias() = MP.transpose() * Q;
        dK_mid.noalias() += e_end.asDiagonal() * XdS;
        auto dQ_mid = rows_of(g.dQ_mid, d, b, h, t0, L, ds);
        dQ_mid.noalias() = MP * Ks;
        dQ_mid.noalias() += e_cum.asDiagonal() * dOS;
        // dADT
        const Mat<S> W = MP.cwiseProduct(A);
        const Vec<S> row_sum = W.rowwise().sum(), col_sum = W.colwise().sum().transpose();
        S Msum = S(0);
        Vec<S> Mt(L), Rt(L);
        for (Idx tau = 0; tau < L; ++tau) {
          Rt[tau] = row_sum[tau] - col_sum[tau] + e_cum[tau] * dOS.row(tau).dot(Q.row(tau));
          Mt[tau] = e_end[tau] * XdS.row(tau).dot(Ks.row(tau));
          Msum += Mt[tau];
        }
        const S Msc = std::exp(Lam) * (Sin.array() * dS.array()).sum();
        auto dADT = col_of(g.dADT, d, b, h, t0, L);
        S run = Msc + Msum;
        for (Idx tau = L - 1; tau >= 0; --tau) {
          run += Rt[tau] - Mt[tau];
          dADT[tau] = run;
        }
        dS = std::exp(Lam) * dS;
        dS.noalias() += dO.transpose() * e_cum.asDiagonal() * Q;
      }
      g.dD_partials[sb] = dD_acc;
      // Entering-state gradients: S_0 = ssm_in + sg_{−1} v_in k_inᵀ.
      const Idx i0 = (b * d.T) * nh + h;
      const S sgm1 = a.dt[i0] * (S(1) - a.trap[i0]);
      Eigen::Map<const Vec<S>> k_in(a.k_in.data() + sb * ds, ds), v_in(a.v_in.data() + sb * hd, hd);
      MapM<S>(g.d_ssm_in.data() + sb * hd * ds, hd, ds) = dS;
      Eigen::Map<Vec<S>>(g.d_v_in.data() + sb * hd, hd).noalias() = sgm1 * (dS * k_in);
      Eigen::Map<Vec<S>>(g.d_k_in.data() + sb * ds, ds).noalias() = sgm1 * (dS.transpose() * v_in);
      dscale_prev[sb] = v_in.dot(dS * k_in);
      // ∂L/∂v_out: v_out = x_{T−1}.
      const Idx rL = b * d.T + d.T - 1;
      for (Idx q = 0; q < hd; ++q) g.d_x[rL * d.di + h * hd + q] += g.d_v_out[sb * hd + q];
    }
  for (Idx h = 0; h < nh; ++h) {
    S acc = S(0);
    for (Idx b = 0; b < d.B; ++b) acc += g.dD_partials[b * nh + h];
    pg.d_param[h] += acc;
  }
  // ---- step 2: dqktheta, per (r, h)
  std::vector<S> dk_angle(static_cast<size_t>(d.BT * nh * ds));
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < nh; ++h) {
      const Idx i = r * nh + h;
      const bool last = (r % d.T) == d.T - 1;
      Eigen::Map<const Vec<S>> dKm(g.dK_mid.data() + i * ds, ds), K(a.k.data() + i * ds, ds);
      Eigen::Map<const Vec<S>> Kb(a.b_biased.data() + i * ds, ds), Qb(a.c_biased.data() + i * ds, ds);
      g.dScale[i] = dKm.dot(K);
      g.dGamma[i] = g.dQK_dot[i] * Qb.dot(Kb);
      Eigen::Map<Vec<S>> dka(dk_angle.data() + i * ds, ds);
      dka = a.scale_saved[i] * dKm;
      if (last) dka += Eigen::Map<const Vec<S>>(g.d_k_out.data() + ((r / d.T) * nh + h) * ds, ds);
    }
  std::fill(g.d_angle_cumsum.begin(), g.d_angle_cumsum.end(), S(0));
  rope_backward_into(d, a.angle_cumsum.data(), dk_angle.data(), a.k.data(),
                     g.d_b_pre_rope.data(), g.d_angle_cumsum.data());
  rope_backward_into(d, a.angle_cumsum.data(), g.dQ_mid.data(), a.q.data(),
                     g.d_c_pre_rope.data(), g.d_angle_cumsum.data());
  for (Idx i = 0; i < d.BT * nh; ++i) {
    const S w = g.dQK_dot[i] * a.gamma_saved[i];
    for (Idx n = 0; n < ds; ++n) {
      g.d_b_pre_rope[i * ds + n] += w * a.c_biased[i * ds + n];
      g.d_c_pre_rope[i * ds + n] += w * a.b_biased[i * ds + n];
    }
  }
  // ---- step 3: ddt_dtrap, per (r, h), dScale_{t−1} from the previous step of the sample
  for (Idx b = 0; b < d.B; ++b)
    for (Idx t = 0; t < d.T; ++t)
      for (Idx h = 0; h < nh; ++h) {
        const Idx i = (b * d.T + t) * nh + h;
        const S prev = t > 0 ? g.dScale[i - nh] : dscale_prev[b * nh + h];
        const S own = g.dGamma[i] + g.dScale[i];
        g.dDT[i] = own * a.trap[i] + prev * (S(1) - a.trap[i]);
        g.d_trap_sig[i] = (own - prev) * a.dt[i];
        g.d_dt_direct[i] = g.dDT[i];
        g.d_adt_total[i] = g.dADT[i];
      }
}

#define M3_INSTANTIATE(S)                                                                     \
  template void ssm_chunked_forward<S>(const Dims&, const LayerParams<S>&, LayerActs<S>&);   \
  template void ssm_chunked_backward<S>(const Dims&, const LayerParams<S>&,                  \
                                        const LayerActs<S>&, LayerGrads<S>&, LayerParams<S>&);
M3_INSTANTIATE(double)
M3_INSTANTIATE(float)
#undef M3_INSTANTIATE

}  // namespace m3::ref
