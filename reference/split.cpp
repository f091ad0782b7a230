// The 8-way split of in_proj's output with its fused activations (F3), the SSM coefficients
// (F5b), and their backward (B5b, B3). MODEL.md §2.1, §4 F3/F5b, §6.2 B5b/B3, §12.1–2.
//
// F3, per row r (columns of proj in this order):
//   [ z (di) | x (di) | b_raw (ng·ds) | c_raw (ng·ds) | dd_dt_raw (nh) | dd_a_raw (nh) |
//     trap_raw (nh) | angles_raw (na) ]
//   dt    = softplus(dd_dt_raw + dt_bias)        softplus(v) = v if v > 20 else log(1+eᵛ)
//   a_val = min(−φ(dd_a_raw), −a_floor)          φ(v) = 1+v (v ≥ 0), 1/(1−v) (v < 0)
//   trap  = σ(trap_raw)
// F5b:  alpha = exp(a_val·dt),  beta = alpha·dt·(1 − trap),  gamma = trap·dt
//
// B5b takes ∂L/∂adt (adt = a_val·dt), the direct ∂L/∂dt and ∂L/∂trap from whichever B6 ran
// (sequential: from dα, dβ, dγ via abg_backward; chunked: dADT, dDT, dScale/dGamma), plus
// d_dt_angle from B5a:
//   d_dt_tot   = d_adt·a_val + d_dt_direct + d_dt_angle
//   d_dd_dt    = d_dt_tot · softplus'(dd_dt_raw + dt_bias),  softplus' = 1 if v > 20 else σ(v)
//   d dt_bias += Σ_r d_dd_dt
//   d_trap_raw = d_trap · trap·(1 − trap)
//   d_dd_a     = 0 if −φ(dd_a_raw) > −a_floor (clamp active) else d_adt·dt·(−φ'(dd_a_raw)),
//                φ'(v) = 1 (v ≥ 0), 1/(1−v)² (v < 0); φ'(0) = 1; equality passes the gradient.
// B3 assembles d_proj in the column order above.
#include <algorithm>
#include <cstring>

#include "stages.hpp"

namespace m3::ref {

namespace {
// Column offsets of the split, §2.1.
struct SplitCols {
  Idx z, x, b, c, ddt, dda, trap, ang;
  explicit SplitCols(const Dims& d)
      : z(0),
        x(d.di),
        b(2 * d.di),
        c(2 * d.di + d.ng * d.ds),
        ddt(2 * d.di + 2 * d.ng * d.ds),
        dda(ddt + d.nh),
        trap(ddt + 2 * d.nh),
        ang(ddt + 3 * d.nh) {}
};

template <class S>
void copy_cols(const S* src, Idx src_stride, Idx col, Idx width, S* dst, Idx rows) {
  for (Idx r = 0; r < rows; ++r)
    std::copy_n(src + r * src_stride + col, width, dst + r * width);
}

template <class S>
void place_cols(const S* src, Idx width, S* dst, Idx dst_stride, Idx col, Idx rows) {
  for (Idx r = 0; r < rows; ++r)
    std::copy_n(src + r * width, width, dst + r * dst_stride + col);
}
}  // namespace

template <class S>
void split_forward(const Dims& d, const LayerParams<S>& p, LayerActs<S>& a) {
  const SplitCols c(d);
  const S* P = a.proj.data();
  copy_cols(P, d.ip, c.z, d.di, a.z.data(), d.BT);
  copy_cols(P, d.ip, c.x, d.di, a.x.data(), d.BT);
  copy_cols(P, d.ip, c.b, d.ng * d.ds, a.b_raw.data(), d.BT);
  copy_cols(P, d.ip, c.c, d.ng * d.ds, a.c_raw.data(), d.BT);
  copy_cols(P, d.ip, c.ddt, d.nh, a.dd_dt_raw.data(), d.BT);
  copy_cols(P, d.ip, c.dda, d.nh, a.dd_a_raw.data(), d.BT);
  copy_cols(P, d.ip, c.trap, d.nh, a.trap_raw.data(), d.BT);
  copy_cols(P, d.ip, c.ang, d.na, a.angles_raw.data(), d.BT);
  const S floor_ = static_cast<S>(d.a_floor);
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx i = r * d.nh + h;
      a.dt[i] = softplus(a.dd_dt_raw[i] + p.dt_bias[h]);
      a.a_val[i] = std::min(-heavy_tail(a.dd_a_raw[i]), -floor_);
      a.trap[i] = sigmoid(a.trap_raw[i]);
    }
}

template <class S>
void abg_forward(const Dims& d, LayerActs<S>& a) {
  for (Idx i = 0; i < d.BT * d.nh; ++i) {
    const S dt = a.dt[i], tr = a.trap[i];
    a.alpha[i] = std::exp(a.a_val[i] * dt);
    a.beta[i] = a.alpha[i] * dt * (S(1) - tr);
    a.gamma[i] = tr * dt;
  }
}

template <class S>
void abg_backward(const Dims& d, const LayerActs<S>& a, LayerGrads<S>& g) {
  // alpha = e^{adt}; beta = alpha·dt·(1−trap) → ∂beta/∂adt = beta; gamma = trap·dt.
  for (Idx i = 0; i < d.BT * d.nh; ++i) {
    const S al = a.alpha[i], dt = a.dt[i], tr = a.trap[i];
    const S da = g.d_alpha[i], db = g.d_beta[i], dg = g.d_gamma[i];
    g.d_adt_total[i] = da * al + db * a.beta[i];
    g.d_dt_direct[i] = db * al * (S(1) - tr) + dg * tr;
    g.d_trap_sig[i] = -db * al * dt + dg * dt;
  }
}

template <class S>
void activations_backward(const Dims& d, const LayerParams<S>& p, const LayerActs<S>& a,
                          LayerGrads<S>& g, LayerParams<S>& pg) {
  const S floor_ = static_cast<S>(d.a_floor);
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx i = r * d.nh + h;
      const S d_adt = g.d_adt_total[i];
      const S d_dt_tot = d_adt * a.a_val[i] + g.d_dt_direct[i] + g.d_dt_angle[i];
      // dt = softplus(pre), pre = dd_dt_raw + dt_bias, recomputed exactly as F3 formed it.
      g.d_dd_dt[i] = d_dt_tot * softplus_grad(a.dd_dt_raw[i] + p.dt_bias[h]);
      const S tr = a.trap[i];
      g.d_trap_raw[i] = g.d_trap_sig[i] * tr * (S(1) - tr);
      const S v = a.dd_a_raw[i];
      const bool clamped = -heavy_tail(v) > -floor_;
      g.d_dd_a[i] = clamped ? S(0) : d_adt * a.dt[i] * (-heavy_tail_grad(v));
    }
  for (Idx h = 0; h < d.nh; ++h) {
    S sum = S(0);
    for (Idx r = 0; r < d.BT; ++r) sum += g.d_dd_dt[r * d.nh + h];
    pg.dt_bias[h] += sum;
  }
}

template <class S>
void split_backward(const Dims& d, LayerGrads<S>& g) {
  const SplitCols c(d);
  S* P = g.d_proj.data();
  place_cols(g.d_z.data(), d.di, P, d.ip, c.z, d.BT);
  place_cols(g.d_x.data(), d.di, P, d.ip, c.x, d.BT);
  place_cols(g.d_b_raw.data(), d.ng * d.ds, P, d.ip, c.b, d.BT);
  place_cols(g.d_c_raw.data(), d.ng * d.ds, P, d.ip, c.c, d.BT);
  place_cols(g.d_dd_dt.data(), d.nh, P, d.ip, c.ddt, d.BT);
  place_cols(g.d_dd_a.data(), d.nh, P, d.ip, c.dda, d.BT);
  place_cols(g.d_trap_raw.data(), d.nh, P, d.ip, c.trap, d.BT);
  place_cols(g.d_angles_raw.data(), d.na, P, d.ip, c.ang, d.BT);
}

#define M3_INSTANTIATE(S)                                                                    \
  template void split_forward<S>(const Dims&, const LayerParams<S>&, LayerActs<S>&);         \
  template void abg_forward<S>(const Dims&, LayerActs<S>&);                                  \
  template void abg_backward<S>(const Dims&, const LayerActs<S>&, LayerGrads<S>&);           \
  template void activations_backward<S>(const Dims&, const LayerParams<S>&,                  \
                                        const LayerActs<S>&, LayerGrads<S>&, LayerParams<S>&); \
  template void split_backward<S>(const Dims&, LayerGrads<S>&);
M3_INSTANTIATE(double)
M3_INSTANTIATE(float)
#undef M3_INSTANTIATE

}  // namespace m3::ref
