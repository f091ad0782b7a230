// Angle accumulation (F5), RoPE on B → k and C → q (F4e/f), and their backward (B6 RoPE tail,
// B5a). MODEL.md §4 F5, F4e/f, §6.2 B6-tail/B5a, §12.3.
//
// F5, per (b, h, a), sequential in t, carried in DOUBLE and wrapped after every step:
//   incr     = π·(tanh(angles_raw[r,a])·dt[r,h])   in S: the product rounded, then π applied
//              unrounded (times_pi); in double as (π·tanh)·dt, whose π is exact to 3.9e-17 of
//              itself, so that the oracle keeps its bits (golden files, the GPU oracle's form)
//   θ_t      = wrap(θ_{t−1} + incr),  θ_{−1} = angle_in[b,h,a]
//   wrap(v)  = v − 2π·⌊v/2π⌋ ∈ [0, 2π)
//   angle_cumsum[r,h,a] = θ_t (stored as S);  angle_out[b,h,a] = θ_{T−1}
// F4e/f, adjacent pairs (2a, 2a+1), a < na, c = cos θ, s = sin θ; dims n ≥ 2na pass through:
//   k[2a] = c·b[2a] − s·b[2a+1],   k[2a+1] = s·b[2a] + c·b[2a+1]     (b = b_biased; q from c)
// Backward of a rotation, from dv = ∂L/∂(rotated) and the rotated vector rot:
//   dpre[2a] = c·dv[2a] + s·dv[2a+1],   dpre[2a+1] = −s·dv[2a] + c·dv[2a+1]
//   dθ      += −dv[2a]·rot[2a+1] + dv[2a+1]·rot[2a]
// B5a (wrap = identity for differentiation): Θ̄_t = Σ_{s ≥ t} dθ_s (+ ∂L/∂angle_out at t = T−1)
//   d_angles_raw[r,a] = Σ_h Θ̄[r,h,a]·π·dt[r,h]·(1 − tanh²(angles_raw[r,a]))   (overwrite)
//   d_dt_angle[r,h]   = Σ_a Θ̄[r,h,a]·π·tanh(angles_raw[r,a])                  (overwrite)
//   d_angle_in[b,h,a] = Θ̄ at t = 0
#include <cmath>
#include <type_traits>

#include "stages.hpp"

namespace m3::ref {

namespace {
double wrap_two_pi(double v) {
  double w = v - kTwoPi * std::floor(v / kTwoPi);
  return w >= kTwoPi ? 0.0 : w;  // v a hair below a multiple of 2π can round up to 2π
}

template <class S>
void rotate(const Dims& d, const S* theta, const S* in, S* out) {
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const S* v = in + (r * d.nh + h) * d.ds;
      S* o = out + (r * d.nh + h) * d.ds;
      const S* th = theta + (r * d.nh + h) * d.na;
      for (Idx n = 2 * d.na; n < d.ds; ++n) o[n] = v[n];
      for (Idx a = 0; a < d.na; ++a) {
        const S c = std::cos(th[a]), s = std::sin(th[a]);
        const S v0 = v[2 * a], v1 = v[2 * a + 1];
        o[2 * a] = c * v0 - s * v1;
        o[2 * a + 1] = s * v0 + c * v1;
      }
    }
}
}  // namespace

template <class S>
void angle_forward(const Dims& d, LayerActs<S>& a) {
  for (Idx b = 0; b < d.B; ++b)
    for (Idx h = 0; h < d.nh; ++h)
      for (Idx k = 0; k < d.na; ++k) {
        double theta = static_cast<double>(a.angle_in[(b * d.nh + h) * d.na + k]);
        for (Idx t = 0; t < d.T; ++t) {
          const Idx r = b * d.T + t;
          const S tau = std::tanh(a.angles_raw[r * d.na + k]), dt = a.dt[r * d.nh + h];
          const S incr = std::is_same_v<S, double> ? S(kPi) * tau * dt : times_pi(tau * dt);
          theta = wrap_two_pi(theta + static_cast<double>(incr));
          a.angle_cumsum[(r * d.nh + h) * d.na + k] = static_cast<S>(theta);
        }
        a.angle_out[(b * d.nh + h) * d.na + k] = static_cast<S>(theta);
      }
}

template <class S>
void rope_forward(const Dims& d, LayerActs<S>& a) {
  rotate(d, a.angle_cumsum.data(), a.b_biased.data(), a.k.data());
  rotate(d, a.angle_cumsum.data(), a.c_biased.data(), a.q.data());
}

template <class S>
void rope_backward_into(const Dims& d, const S* theta, const S* dv, const S* rot, S* dpre,
                        S* dtheta) {
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx base = (r * d.nh + h) * d.ds;
      const S* g = dv + base;
      const S* x = rot + base;
      S* o = dpre + base;
      for (Idx n = 2 * d.na; n < d.ds; ++n) o[n] = g[n];
      for (Idx a = 0; a < d.na; ++a) {
        const Idx i = (r * d.nh + h) * d.na + a;
        const S c = std::cos(theta[i]), s = std::sin(theta[i]);
        const S g0 = g[2 * a], g1 = g[2 * a + 1];
        o[2 * a] = c * g0 + s * g1;
        o[2 * a + 1] = -s * g0 + c * g1;
        dtheta[i] += -g0 * x[2 * a + 1] + g1 * x[2 * a];
      }
    }
}

template <class S>
void rope_backward(const Dims& d, const LayerActs<S>& a, LayerGrads<S>& g) {
  std::fill(g.d_angle_cumsum.begin(), g.d_angle_cumsum.end(), S(0));
  rope_backward_into(d, a.angle_cumsum.data(), g.d_k.data(), a.k.data(), g.d_b_pre_rope.data(),
                     g.d_angle_cumsum.data());
  rope_backward_into(d, a.angle_cumsum.data(), g.d_q.data(), a.q.data(), g.d_c_pre_rope.data(),
                     g.d_angle_cumsum.data());
}

template <class S>
void angle_backward(const Dims& d, const LayerActs<S>& a, LayerGrads<S>& g) {
  std::fill(g.d_angles_raw.begin(), g.d_angles_raw.end(), S(0));
  std::fill(g.d_dt_angle.begin(), g.d_dt_angle.end(), S(0));
  // Loop order (b, t, h, a) with Θ̄ carried per (h, a) keeps each Σ_h / Σ_a in ascending order.
  std::vector<S> run(static_cast<size_t>(d.nh * d.na));
  for (Idx b = 0; b < d.B; ++b) {
    for (Idx i = 0; i < d.nh * d.na; ++i) run[i] = g.d_angle_out[b * d.nh * d.na + i];
    for (Idx t = d.T - 1; t >= 0; --t) {
      const Idx r = b * d.T + t;
      for (Idx i = 0; i < d.nh * d.na; ++i) run[i] += g.d_angle_cumsum[r * d.nh * d.na + i];
      for (Idx h = 0; h < d.nh; ++h)
        for (Idx k = 0; k < d.na; ++k) {
          const S th = std::tanh(a.angles_raw[r * d.na + k]);
          const S bar = run[h * d.na + k];
          g.d_angles_raw[r * d.na + k] += bar * S(kPi) * a.dt[r * d.nh + h] * (S(1) - th * th);
          g.d_dt_angle[r * d.nh + h] += bar * S(kPi) * th;
        }
    }
    for (Idx i = 0; i < d.nh * d.na; ++i) g.d_angle_in[b * d.nh * d.na + i] = run[i];
  }
}

#define M3_INSTANTIATE(S)                                                                  \
  template void angle_forward<S>(const Dims&, LayerActs<S>&);                             \
  template void rope_forward<S>(const Dims&, LayerActs<S>&);                              \
  template void rope_backward_into<S>(const Dims&, const S*, const S*, const S*, S*, S*); \
  template void rope_backward<S>(const Dims&, const LayerActs<S>&, LayerGrads<S>&);       \
  template void angle_backward<S>(const Dims&, const LayerActs<S>&, LayerGrads<S>&);
M3_INSTANTIATE(double)
M3_INSTANTIATE(float)
#undef M3_INSTANTIATE

}  // namespace m3::ref
