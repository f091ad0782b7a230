// Output gating (F7) and its backward (B7). MODEL.md §4 F7, §6.2 B7.
//
// (a) is_outproj_norm = false:   gated[r,d] = y[r,d]·silu(z[r,d])
//     d_y = d_gated·silu(z),   d_z = d_gated·y·s·(1 + z·(1 − s)),  s = σ(z)
// (b) is_outproj_norm = true: RMSNormGated, group = one head, norm before gate:
//     rstd[r,h]  = 1/sqrt( (1/hd) Σ_p y[r,h·hd+p]² + ε )      (saved as gated_rms_vals)
//     gated[r,d] = y[r,d]·rstd[r,h]·w[d]·silu(z[r,d]),          d = h·hd + p, w = norm_gate_weight
//     with ŷ = y·rstd, g = d_gated·silu(z):
//     d_z = d_gated·ŷ·w·s(1 + z(1 − s));   d w[d] += Σ_r g·ŷ
//     c1  = (1/hd) Σ_p ŷ·w·g;               d_y = (w·g − ŷ·c1)·rstd
// Shapes: y, z, gated, d_gated, d_y, d_z [BT, di]; gated_rms_vals [BT, nh].
#include "stages.hpp"

namespace m3::ref {

namespace {
template <class S>
S silu(S v) { return v * sigmoid(v); }
template <class S>
S silu_grad(S v) {
  const S s = sigmoid(v);
  return s * (S(1) + v * (S(1) - s));
}
}  // namespace

template <class S>
void gating_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a) {
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx base = r * d.di + h * d.hd;
      S scale = S(1);
      if (d.outproj_norm) {
        S ss = S(0);
        for (Idx p_ = 0; p_ < d.hd; ++p_) ss += a.y[base + p_] * a.y[base + p_];
        scale = S(1) / std::sqrt(ss / S(d.hd) + S(kEps));
        a.gated_rms_vals[r * d.nh + h] = scale;
      }
      for (Idx p_ = 0; p_ < d.hd; ++p_) {
        const Idx i = base + p_;
        const S w = d.outproj_norm ? scale * p.norm_gate_weight[h * d.hd + p_] : S(1);
        a.gated[i] = a.y[i] * w * silu(a.z[i]);
      }
    }
}

template <class S>
void gating_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                     LayerGrads<S>& g, LayerParams<S>& pg) {
  if (!d.outproj_norm) {
    for (Idx i = 0; i < d.BT * d.di; ++i) {
      g.d_y[i] = g.d_gated[i] * silu(a.z[i]);
      g.d_z[i] = g.d_gated[i] * a.y[i] * silu_grad(a.z[i]);
    }
    return;
  }
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx base = r * d.di + h * d.hd;
      const S rstd = a.gated_rms_vals[r * d.nh + h];
      S c1 = S(0);
      for (Idx p_ = 0; p_ < d.hd; ++p_) {
        const Idx i = base + p_;
        const S w = p.norm_gate_weight[h * d.hd + p_];
        const S yh = a.y[i] * rstd;
        const S gg = g.d_gated[i] * silu(a.z[i]);
        g.d_z[i] = g.d_gated[i] * yh * w * silu_grad(a.z[i]);
        c1 += yh * w * gg;
      }
      c1 /= S(d.hd);
      for (Idx p_ = 0; p_ < d.hd; ++p_) {
        const Idx i = base + p_;
        const S w = p.norm_gate_weight[h * d.hd + p_];
        const S yh = a.y[i] * rstd;
        const S gg = g.d_gated[i] * silu(a.z[i]);
        g.d_y[i] = (w * gg - yh * c1) * rstd;
      }
    }
  // d norm_gate_weight: rows summed in ascending order, then added once.
  std::vector<S> sum(static_cast<size_t>(d.di), S(0));
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx dd = 0; dd < d.di; ++dd) {
      const Idx i = r * d.di + dd;
      sum[dd] += g.d_gated[i] * silu(a.z[i]) * a.y[i] * a.gated_rms_vals[r * d.nh + dd / d.hd];
    }
  for (Idx dd = 0; dd < d.di; ++dd) pg.norm_gate_weight[dd] += sum[dd];
}

#define M3_INSTANTIATE(S)                                                                  \
  template void gating_forward<S>(const Dims&, const LayerParams<S>&, LayerActs<S>&);     \
  template void gating_backward<S>(const Dims&, const LayerParams<S>&, const LayerActs<S>&, \
                                   LayerGrads<S>&, LayerParams<S>&);
M3_INSTANTIATE(double)
M3_INSTANTIATE(float)
#undef M3_INSTANTIATE

}  // namespace m3::ref
