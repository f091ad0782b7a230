// F6, the SSM as a sequential recurrence (the ground truth, MODEL.md §4 F6), and its BPTT
// backward (§6.3), with entering states and gradients wrt them (§12.4).
//
// Per (b, h), state h_t ∈ ℝ^{hd×ds}, x_t = x[r,h,:], K_t = k[r,h,:], Q_t = q[r,h,:]:
//   (h_{−1}, k_{−1}, v_{−1}) = (ssm_in, k_in, v_in)[b,h]
//   h_t = α_t·h_{t−1} + β_t·v_{t−1} k_{t−1}ᵀ + γ_t·x_t K_tᵀ
//   y_t = h_t Q_t + D[h]·x_t;     k_t := K_t,  v_t := x_t
//   ssm_out, k_out, v_out = h_{T−1}, K_{T−1}, x_{T−1}
// Saved: h_saved [B, T+1, ds, di] (slot t = h_{t−1}, slot T = h_{T−1}; element (b,t,n,h·hd+p),
// i.e. transposed per head), k_prev_saved [BT, nh, ds], v_prev_saved [BT, nh, hd].
// Backward, G = ∂L/∂h_t (starts at ∂L/∂ssm_out), for t = T−1 … 0:
//   G += d_y_t Q_tᵀ;  d_q_t = h_tᵀ d_y_t
//   dα_t = ⟨G, h_{t−1}⟩,  dβ_t = v_{t−1}ᵀ G k_{t−1},  dγ_t = x_tᵀ G K_t
//   d_x_t += D·d_y_t + γ_t G K_t;      d_k_t += γ_t Gᵀ x_t
//   d_x_{t−1} += β_t G k_{t−1};        d_k_{t−1} += β_t Gᵀ v_{t−1}   (t = 0: d_v_in, d_k_in)
//   G ← α_t G                                                      (after t = 0: d_ssm_in)
// plus ∂L/∂k_out, ∂L/∂v_out added to d_k, d_x at t = T−1; d_d_local[b, h·hd+p] = Σ_t d_y·x,
// d D[h] += Σ_b Σ_p d_d_local (fixed order).
#include "eigen.hpp"
#include "stages.hpp"

namespace m3::ref {

template <class S>
void ssm_seq_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a) {
  const Idx hd = d.hd, ds = d.ds, di = d.di, nh = d.nh;
  Mat<S> H(hd, ds);
  Vec<S> kprev(ds), vprev(hd);
  for (Idx b = 0; b < d.B; ++b)
    for (Idx h = 0; h < nh; ++h) {
      const Idx sb = b * nh + h;
      H = CMapM<S>(a.ssm_in.data() + sb * hd * ds, hd, ds);
      kprev = Eigen::Map<const Vec<S>>(a.k_in.data() + sb * ds, ds);
      vprev = Eigen::Map<const Vec<S>>(a.v_in.data() + sb * hd, hd);
      const S D = p.d_param[h];
      auto slot = [&](Idx t) {
        return SMapM<S>(a.h_saved.data() + (b * (d.T + 1) + t) * ds * di + h * hd, ds, hd,
                        Eigen::OuterStride<>(di));
      };
      for (Idx t = 0; t < d.T; ++t) {
        const Idx r = b * d.T + t, i = r * nh + h;
        slot(t) = H.transpose();
        Eigen::Map<Vec<S>>(a.k_prev_saved.data() + i * ds, ds) = kprev;
        Eigen::Map<Vec<S>>(a.v_prev_saved.data() + i * hd, hd) = vprev;
        Eigen::Map<const Vec<S>> x(a.x.data() + r * di + h * hd, hd);
        Eigen::Map<const Vec<S>> K(a.k.data() + i * ds, ds), Q(a.q.data() + i * ds, ds);
        H = a.alpha[i] * H + a.beta[i] * (vprev * kprev.transpose()) +
            a.gamma[i] * (x * K.transpose());
        Eigen::Map<Vec<S>>(a.y.data() + r * di + h * hd, hd).noalias() = H * Q + D * x;
        kprev = K;
        vprev = x;
      }
      slot(d.T) = H.transpose();
      MapM<S>(a.ssm_out.data() + sb * hd * ds, hd, ds) = H;
      Eigen::Map<Vec<S>>(a.k_out.data() + sb * ds, ds) = kprev;
      Eigen::Map<Vec<S>>(a.v_out.data() + sb * hd, hd) = vprev;
    }
}

template <class S>
void ssm_seq_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                      LayerGrads<S>& g, LayerParams<S>& pg) {
  const Idx hd = d.hd, ds = d.ds, di = d.di, nh = d.nh;
  Mat<S> G(hd, ds);
  Vec<S> carry_dx(hd), carry_dk(ds);
  for (Idx b = 0; b < d.B; ++b)
    for (Idx h = 0; h < nh; ++h) {
      const Idx sb = b * nh + h;
      G = CMapM<S>(g.d_ssm_out.data() + sb * hd * ds, hd, ds);
      carry_dx = Eigen::Map<const Vec<S>>(g.d_v_out.data() + sb * hd, hd);
      carry_dk = Eigen::Map<const Vec<S>>(g.d_k_out.data() + sb * ds, ds);
      const S D = p.d_param[h];
      Eigen::Map<Vec<S>> dD_local(g.d_d_local.data() + b * di + h * hd, hd);
      dD_local.setZero();
      auto slot = [&](Idx t) {
        return CSMapM<S>(a.h_saved.data() + (b * (d.T + 1) + t) * ds * di + h * hd, ds, hd,
                         Eigen::OuterStride<>(di));
      };
      for (Idx t = d.T - 1; t >= 0; --t) {
        const Idx r = b * d.T + t, i = r * nh + h;
        Eigen::Map<const Vec<S>> dy(g.d_y.data() + r * di + h * hd, hd);
        Eigen::Map<const Vec<S>> x(a.x.data() + r * di + h * hd, hd);
        Eigen::Map<const Vec<S>> K(a.k.data() + i * ds, ds), Q(a.q.data() + i * ds, ds);
        Eigen::Map<const Vec<S>> kp(a.k_prev_saved.data() + i * ds, ds);
        Eigen::Map<const Vec<S>> vp(a.v_prev_saved.data() + i * hd, hd);
        const auto h_cur = slot(t + 1);   // h_tᵀ  [ds, hd]
        const auto h_prev = slot(t);      // h_{t−1}ᵀ
        G.noalias() += dy * Q.transpose();
        Eigen::Map<Vec<S>>(g.d_q.data() + i * ds, ds).noalias() = h_cur * dy;
        g.d_alpha[i] = (G.array() * h_prev.transpose().array()).sum();
        g.d_beta[i] = vp.dot(G * kp);
        g.d_gamma[i] = x.dot(G * K);
        const S gam = a.gamma[i], bet = a.beta[i];
        Eigen::Map<Vec<S>>(g.d_x.data() + r * di + h * hd, hd) = carry_dx + D * dy + gam * (G * K);
        Eigen::Map<Vec<S>>(g.d_k.data() + i * ds, ds) =
            carry_dk + gam * (G.transpose() * x);
        carry_dx.noalias() = bet * (G * kp);
        carry_dk.noalias() = bet * (G.transpose() * vp);
        dD_local += dy.cwiseProduct(x);
        G *= a.alpha[i];
      }
      MapM<S>(g.d_ssm_in.data() + sb * hd * ds, hd, ds) = G;
      Eigen::Map<Vec<S>>(g.d_v_in.data() + sb * hd, hd) = carry_dx;
      Eigen::Map<Vec<S>>(g.d_k_in.data() + sb * ds, ds) = carry_dk;
    }
  for (Idx h = 0; h < nh; ++h) {
    S acc = S(0);
    for (Idx b = 0; b < d.B; ++b)
      for (Idx q = 0; q < hd; ++q) acc += g.d_d_local[b * di + h * hd + q];
    pg.d_param[h] += acc;
  }
}

#define M3_INSTANTIATE(S)                                                                    \
  template void ssm_seq_forward<S>(const Dims&, const LayerParams<S>&, LayerActs<S>&);      \
  template void ssm_seq_backward<S>(const Dims&, const LayerParams<S>&, const LayerActs<S>&, \
                                    LayerGrads<S>&, LayerParams<S>&);
M3_INSTANTIATE(double)
M3_INSTANTIATE(float)
#undef M3_INSTANTIATE

}  // namespace m3::ref
