// BCNorm with the per-head bias broadcast (F4a–d) and its backward (B4b, B4c).
// MODEL.md §4 F4, §6.2 B4b/B4c. For X ∈ {B, C}, per (r, g) and n < ds:
//   X_rms[r,g]      = sqrt( (1/ds) Σ_n X_raw[r,g,n]² + ε )
//   X_normed[r,g,n] = X_raw[r,g,n] / X_rms[r,g] · w_X[n]          (w_X shared by all groups)
//   X_biased[r,h,n] = X_normed[r, g(h), n] + X_bias[h,n]           g(h) = ⌊h / (nh/ng)⌋
// Backward from d_X_pre_rope [BT, nh, ds] (B6):
//   d X_bias[h,n]      += Σ_r d_X_pre_rope[r,h,n]
//   d_X_normed[r,g,n]   = Σ_{h: g(h)=g} d_X_pre_rope[r,h,n]        (ascending h)
//   d_X_raw, d w_X      = RMSNorm backward over rows (r,g) of width ds (rmsnorm.cpp)
// With bf16/f16 storage (MODEL.md §8) X_normed, X_biased, d_X_normed and d_X_raw are rounded
// where they are stored: the bias add reads the stored X_normed, B4c the stored d_X_normed.
// Shapes: X_raw, X_normed, d_X_normed, d_X_raw [BT, ng, ds]; X_rms [BT, ng];
// X_biased, d_X_pre_rope [BT, nh, ds].
#include "stages.hpp"

namespace m3::ref {

namespace {
template <class S>
void bias_broadcast(const Dims& d, const S* normed, const S* bias, S* biased) {
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const S* src = normed + (r * d.ng + d.group_of(h)) * d.ds;
      S* dst = biased + (r * d.nh + h) * d.ds;
      for (Idx n = 0; n < d.ds; ++n) dst[n] = src[n] + bias[h * d.ds + n];
    }
}

template <class S>
void bias_backward(const Dims& d, const S* d_pre, S* d_normed, S* d_bias) {
  for (Idx r = 0; r < d.BT; ++r) {
    S* dn = d_normed + r * d.ng * d.ds;
    std::fill(dn, dn + d.ng * d.ds, S(0));
    for (Idx h = 0; h < d.nh; ++h) {
      const S* src = d_pre + (r * d.nh + h) * d.ds;
      S* dst = dn + d.group_of(h) * d.ds;
      for (Idx n = 0; n < d.ds; ++n) dst[n] += src[n];
    }
  }
  std::vector<S> sum(static_cast<size_t>(d.nh * d.ds), S(0));
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx i = 0; i < d.nh * d.ds; ++i) sum[i] += d_pre[r * d.nh * d.ds + i];
  for (Idx i = 0; i < d.nh * d.ds; ++i) d_bias[i] += sum[i];
}
}  // namespace

template <class S>
void bcnorm_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a) {
  const Idx rows = d.BT * d.ng;
  rmsnorm_forward(rows, d.ds, a.b_raw.data(), p.b_norm_weight.data(), a.b_normed.data(),
                  a.b_rms.data());
  rmsnorm_forward(rows, d.ds, a.c_raw.data(), p.c_norm_weight.data(), a.c_normed.data(),
                  a.c_rms.data());
  store_typed(d, a.b_normed);  // normed is stored, then read back by the bias add
  store_typed(d, a.c_normed);
  bias_broadcast(d, a.b_normed.data(), p.b_bias.data(), a.b_biased.data());
  bias_broadcast(d, a.c_normed.data(), p.c_bias.data(), a.c_biased.data());
  store_typed(d, a.b_biased);
  store_typed(d, a.c_biased);
}

template <class S>
void bcnorm_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                     LayerGrads<S>& g, LayerParams<S>& pg) {
  bias_backward(d, g.d_b_pre_rope.data(), g.d_b_normed.data(), pg.b_bias.data());
  bias_backward(d, g.d_c_pre_rope.data(), g.d_c_normed.data(), pg.c_bias.data());
  store_typed(d, g.d_b_normed);
  store_typed(d, g.d_c_normed);
  const Idx rows = d.BT * d.ng;
  rmsnorm_backward(rows, d.ds, a.b_raw.data(), p.b_norm_weight.data(), a.b_rms.data(),
                   g.d_b_normed.data(), g.d_b_raw.data(), pg.b_norm_weight.data());
  rmsnorm_backward(rows, d.ds, a.c_raw.data(), p.c_norm_weight.data(), a.c_rms.data(),
                   g.d_c_normed.data(), g.d_c_raw.data(), pg.c_norm_weight.data());
  store_typed(d, g.d_b_raw);
  store_typed(d, g.d_c_raw);
}

#define M3_INSTANTIATE(S)                                                                  \
  template void bcnorm_forward<S>(const Dims&, const LayerParams<S>&, LayerActs<S>&);     \
  template void bcnorm_backward<S>(const Dims&, const LayerParams<S>&, const LayerActs<S>&, \
                                   LayerGrads<S>&, LayerParams<S>&);
M3_INSTANTIATE(double)
M3_INSTANTIATE(float)
#undef M3_INSTANTIATE

}  // namespace m3::ref
