// The GPU oracle's SSM, forward (F6) and backward (B6), as the exact recurrence of MODEL.md §4
// F6 and its BPTT §6.3, in f64, walked in time in segments of K = ⌈√T⌉ steps.
//
// Per (b, h), state h_t ∈ ℝ^{hd×ds}, x_t = x[r, h, :], K_t = k[r, h, :], Q_t = q[r, h, :]:
//   h_t = α_t·h_{t−1} + β_t·v_{t−1}k_{t−1}ᵀ + γ_t·x_t K_tᵀ       (h_{−1}, k_{−1}, v_{−1}) entering
//   y_t = h_t Q_t + D[h]·x_t;     k_t := K_t, v_t := x_t;     leaving (h_{T−1}, K_{T−1}, x_{T−1})
// Each state element h[p, n] follows its own scalar recurrence, so the walk is one thread per
// element (b, h, p, n); y's sum over n is a second kernel, one thread per (b, t, h, p).
//
// Forward, per segment [s0, s1): walk from h_{s0−1}, keep it as the segment's checkpoint
// (h_ckpt [S, B, nh, hd, ds]), write h_{s0−1} … h_{s1−1} into scan_h's slots 0 … len, then y.
//
// Backward. With G_t = ∂L/∂h_t in full, G_t = α_{t+1}·G_{t+1} + d_y_t Q_tᵀ
// (G_{T−1} = ∂L/∂ssm_out + d_y_{T−1} Q_{T−1}ᵀ), and with the term that step t + 1 adds through
// k_t = K_t and v_t = x_t (∂L/∂k_out and ∂L/∂v_out at t = T − 1):
//   d_q_t[n]  = Σ_p h_t[p,n]·d_y_t[p]
//   d_x_t[p]  = β_{t+1}·Σ_n G_{t+1}[p,n]K_t[n] + D·d_y_t[p] + γ_t·Σ_n G_t[p,n]K_t[n]
//   d_k_t[n]  = β_{t+1}·Σ_p G_{t+1}[p,n]x_t[p] + γ_t·Σ_p G_t[p,n]x_t[p]
//   dα_t = Σ_{p,n} G_t∘h_{t−1},  dβ_t = Σ_p v_{t−1}[p]·Σ_n G_t[p,n]k_{t−1}[n],
//   dγ_t = Σ_p x_t[p]·Σ_n G_t[p,n]K_t[n]
//   → d_adt_total = dα·α + dβ·β,  d_dt_direct = dβ·α·(1 − trap) + dγ·trap,
//     d_trap_sig = −dβ·α·dt + dγ·dt                                        (MODEL.md §6.2 B5b)
//   d_ssm_in = α_0·G_0,  d_v_in[p] = β_0·Σ_n G_0[p,n]k_in[n],  d_k_in[n] = β_0·Σ_p G_0[p,n]v_in[p]
//   d D[h] += Σ_b Σ_p d_d_local[b, h·hd + p],  d_d_local = Σ_t d_y·x (t descending)
// Segments from the last: recompute h_{s0−1} … h_{s1−1} from the checkpoint (scan_h), walk G
// back through the segment (scan_g slots 0 … len−1 = G_{s0} … G_{s1−1}, slot len = G_{s1}),
// then the row sums (one thread per (b, t, h, p): d_x and the per-p parts of dα, dβ, dγ into
// scan_part), the column sums (per (b, t, h, n): d_q, d_k) and the per-(b, t, h) scalars.
// scan_gnext carries G_{s0} to the segment before.
// Buffers: scan_h, scan_g [(K+1), B, nh, hd, ds] (slot-major); scan_gnext [B, nh, hd, ds];
// scan_part [3, B, K, nh, hd].
#include "stages.cuh"

#include "common.cuh"
#include "layout.hpp"

namespace m3::gpu::oracle {

namespace detail {

// Indices of one state element e = ((b·nh + h)·hd + p)·ds + n.
struct Elem {
  Idx b, h, p, n;
  __device__ Elem(Idx e, Idx nh, Idx hd, Idx ds)
      : b(e / (nh * hd * ds)), h((e / (hd * ds)) % nh), p((e / ds) % hd), n(e % ds) {}
};

// Walks h through [s0, s1) from start (the checkpoint or the running state): scan_h's slots
// 0 … len hold h_{s0−1} … h_{s1−1}; ckpt (if given) receives h_{s0−1}, last (if given) h_{s1−1}.
void walk_states(cudaStream_t s, const Dims& d, const LayerDev& L, Idx s0, Idx s1,
                 const double* start, double* ckpt, double* hseg, double* last) {
  const Idx nh = d.nh, hd = d.hd, ds = d.ds, di = d.di, T = d.T;
  const Idx E = d.B * nh * hd * ds;
  const double *al = L.alpha, *be = L.beta, *ga = L.gamma, *x = L.x, *k = L.k, *k_in = L.k_in,
               *v_in = L.v_in;
  each(s, E, [=] __device__(Idx e) {
    const detail::Elem c(e, nh, hd, ds);
    double hv = start[e];
    if (ckpt) ckpt[e] = hv;
    hseg[e] = hv;
    for (Idx t = s0; t < s1; ++t) {
      const Idx r = c.b * T + t, i = r * nh + c.h;
      const double kprev = t == 0 ? k_in[(c.b * nh + c.h) * ds + c.n] : k[(i - nh) * ds + c.n];
      const double vprev =
          t == 0 ? v_in[(c.b * nh + c.h) * hd + c.p] : x[(r - 1) * di + c.h * hd + c.p];
      const double xt = x[r * di + c.h * hd + c.p], Kt = k[i * ds + c.n];
      hv = al[i] * hv + be[i] * (vprev * kprev) + ga[i] * (xt * Kt);
      hseg[(t - s0 + 1) * E + e] = hv;
    }
    if (last) last[e] = hv;
  });
}

}  // namespace detail

void ssm_forward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w) {
  const Idx nh = d.nh, hd = d.hd, ds = d.ds, di = d.di, T = d.T, B = d.B;
  const Idx E = B * nh * hd * ds, K = segment_length(T), S = segment_count(T);
  for (Idx seg = 0; seg < S; ++seg) {
    const Idx s0 = seg * K, s1 = std::min(T, s0 + K), len = s1 - s0;
    // The running state is the leaving state's buffer: segment 0 starts from the entering one.
    detail::walk_states(s, d, L, s0, s1, seg == 0 ? L.ssm_in : L.ssm_out, L.h_ckpt + seg * E,
                        w.scan_h, L.ssm_out);
    const double *hseg = w.scan_h, *q = L.q, *x = L.x, *D = L.p.d_param;
    double* y = L.y;
    each(s, B * len * nh * hd, [=] __device__(Idx e) {
      const Idx p = e % hd, h = (e / hd) % nh, j = (e / (hd * nh)) % len, b = e / (hd * nh * len);
      const Idx r = b * T + s0 + j, i = r * nh + h;
      const double* hrow = hseg + (j + 1) * E + ((b * nh + h) * hd + p) * ds;
      double acc = 0.0;
      for (Idx n = 0; n < ds; ++n) acc += hrow[n] * q[i * ds + n];
      y[r * di + h * hd + p] = acc + D[h] * x[r * di + h * hd + p];
    });
  }
  // Leaving k and v: K_{T−1}, x_{T−1}.
  const double *k = L.k, *x = L.x;
  double *k_out = L.k_out, *v_out = L.v_out;
  each(s, B * nh * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, bh = e / ds, b = bh / nh, h = bh % nh;
    k_out[e] = k[((b * T + T - 1) * nh + h) * ds + n];
  });
  each(s, B * nh * hd, [=] __device__(Idx e) {
    const Idx p = e % hd, bh = e / hd, b = bh / nh, h = bh % nh;
    v_out[e] = x[(b * T + T - 1) * di + h * hd + p];
  });
}

void ssm_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w) {
  const Idx nh = d.nh, hd = d.hd, ds = d.ds, di = d.di, T = d.T, B = d.B;
  const Idx E = B * nh * hd * ds, K = segment_length(T), S = segment_count(T);
  const double *al = L.alpha, *be = L.beta, *ga = L.gamma, *x = L.x, *k = L.k, *q = L.q,
               *dy = L.d_y, *D = L.p.d_param, *k_in = L.k_in, *v_in = L.v_in, *dtp = L.dt,
               *trp = L.trap, *d_ssm_out = L.d_ssm_out, *d_k_out = L.d_k_out, *d_v_out = L.d_v_out;
  double *hseg = w.scan_h, *gseg = w.scan_g, *gnext = w.scan_gnext, *part = w.scan_part;
  double *d_x = L.d_x, *d_k = w.d_k, *d_q = w.d_q, *d_ssm_in = L.d_ssm_in;
  double *d_adt = L.d_adt_total, *d_dir = L.d_dt_direct, *d_trs = L.d_trap_sig;
  const Idx PS = B * K * nh * hd;  // one part of scan_part
  for (Idx seg = S - 1; seg >= 0; --seg) {
    const Idx s0 = seg * K, s1 = std::min(T, s0 + K), len = s1 - s0;
    detail::walk_states(s, d, L, s0, s1, L.h_ckpt + seg * E, nullptr, hseg, nullptr);
    // G back through the segment; gnext: G_{s1} in, G_{s0} out.
    each(s, E, [=] __device__(Idx e) {
      const detail::Elem c(e, nh, hd, ds);
      const bool last = s1 == T;
      double g = last ? d_ssm_out[e] : al[(c.b * T + s1) * nh + c.h] * gnext[e];
      gseg[len * E + e] = last ? 0.0 : gnext[e];
      for (Idx t = s1 - 1; t >= s0; --t) {
        const Idx r = c.b * T + t, i = r * nh + c.h;
        g += dy[r * di + c.h * hd + c.p] * q[i * ds + c.n];
        gseg[(t - s0) * E + e] = g;
        if (t > s0) g *= al[i];
      }
      gnext[e] = g;
      if (s0 == 0) d_ssm_in[e] = al[c.b * T * nh + c.h] * g;
    });
    // Row sums over n, one thread per (b, t, h, p): d_x and the parts of dα, dβ, dγ.
    each(s, B * len * nh * hd, [=] __device__(Idx e) {
      const Idx p = e % hd, h = (e / hd) % nh, j = (e / (hd * nh)) % len, b = e / (hd * nh * len);
      const Idx t = s0 + j, r = b * T + t, i = r * nh + h, row = ((b * nh + h) * hd + p) * ds;
      const double *Gt = gseg + j * E + row, *Gn = gseg + (j + 1) * E + row,
                   *Hp = hseg + j * E + row;
      const double* Kt = k + i * ds;
      const double* kp = t == 0 ? k_in + (b * nh + h) * ds : k + (i - nh) * ds;
      double sGK = 0.0, sGkp = 0.0, sGH = 0.0, sGnK = 0.0;
      for (Idx n = 0; n < ds; ++n) {
        sGK += Gt[n] * Kt[n];
        sGkp += Gt[n] * kp[n];
        sGH += Gt[n] * Hp[n];
        sGnK += Gn[n] * Kt[n];
      }
      const Idx xi = r * di + h * hd + p;
      const double carry = t + 1 < T ? be[i + nh] * sGnK : d_v_out[(b * nh + h) * hd + p];
      d_x[xi] = carry + D[h] * dy[xi] + ga[i] * sGK;
      const double vprev = t == 0 ? v_in[(b * nh + h) * hd + p] : x[xi - di];
      const Idx pi = ((b * K + j) * nh + h) * hd + p;
      part[pi] = sGH;
      part[PS + pi] = vprev * sGkp;
      part[2 * PS + pi] = x[xi] * sGK;
    });
    // Column sums over p, one thread per (b, t, h, n): d_q and d_k.
    each(s, B * len * nh * ds, [=] __device__(Idx e) {
      const Idx n = e % ds, h = (e / ds) % nh, j = (e / (ds * nh)) % len, b = e / (ds * nh * len);
      const Idx t = s0 + j, r = b * T + t, i = r * nh + h, col = (b * nh + h) * hd * ds + n;
      const double *Ht = hseg + (j + 1) * E + col, *Gt = gseg + j * E + col,
                   *Gn = gseg + (j + 1) * E + col;
      const double* xt = x + r * di + h * hd;
      const double* dyt = dy + r * di + h * hd;
      double sq = 0.0, sGx = 0.0, sGnx = 0.0;
      for (Idx p = 0; p < hd; ++p) {
        sq += Ht[p * ds] * dyt[p];
        sGx += Gt[p * ds] * xt[p];
        sGnx += Gn[p * ds] * xt[p];
      }
      d_q[i * ds + n] = sq;
      const double carry = t + 1 < T ? be[i + nh] * sGnx : d_k_out[(b * nh + h) * ds + n];
      d_k[i * ds + n] = carry + ga[i] * sGx;
    });
    // Per (b, t, h): dα, dβ, dγ summed over p, then what B5b reads.
    each(s, B * len * nh, [=] __device__(Idx e) {
      const Idx h = e % nh, j = (e / nh) % len, b = e / (nh * len);
      const Idx i = (b * T + s0 + j) * nh + h, pi = ((b * K + j) * nh + h) * hd;
      double da = 0.0, db = 0.0, dg = 0.0;
      for (Idx p = 0; p < hd; ++p) {
        da += part[pi + p];
        db += part[PS + pi + p];
        dg += part[2 * PS + pi + p];
      }
      const double a = al[i], dt = dtp[i], tr = trp[i];
      d_adt[i] = da * a + db * be[i];
      d_dir[i] = db * a * (1.0 - tr) + dg * tr;
      d_trs[i] = -db * a * dt + dg * dt;
    });
  }
  // The entering k and v gradients from G_0 (in gnext after the first segment).
  double *d_k_in = L.d_k_in, *d_v_in = L.d_v_in;
  each(s, B * nh * hd, [=] __device__(Idx e) {
    const Idx bh = e / hd, b = bh / nh, h = bh % nh;
    const double* G0 = gnext + e * ds;
    const double* kin = k_in + bh * ds;
    double acc = 0.0;
    for (Idx n = 0; n < ds; ++n) acc += G0[n] * kin[n];
    d_v_in[e] = be[b * T * nh + h] * acc;
  });
  each(s, B * nh * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, bh = e / ds, b = bh / nh, h = bh % nh;
    const double* vin = v_in + bh * hd;
    double acc = 0.0;
    for (Idx p = 0; p < hd; ++p) acc += gnext[(bh * hd + p) * ds + n] * vin[p];
    d_k_in[e] = be[b * T * nh + h] * acc;
  });
  // d D: Σ_t d_y·x per (b, h·hd + p) (t descending), then Σ_b Σ_p per head, added once.
  double* dd_local = part;  // [B, di]: scan_part is free again
  each(s, B * di, [=] __device__(Idx e) {
    const Idx b = e / di, c = e % di;
    double acc = 0.0;
    for (Idx t = T - 1; t >= 0; --t) acc += dy[(b * T + t) * di + c] * x[(b * T + t) * di + c];
    dd_local[e] = acc;
  });
  double* gD = L.g.d_param;
  each(s, nh, [=] __device__(Idx h) {
    double acc = 0.0;
    for (Idx b = 0; b < B; ++b)
      for (Idx p = 0; p < hd; ++p) acc += dd_local[b * di + h * hd + p];
    gD[h] += acc;
  });
}

}  // namespace m3::gpu::oracle
