// The GPU oracle's stages other than the SSM (stages.cuh), in f64, one thread per output
// element (per row for a row's sum; per (b, h, a) for the angle walk, which is sequential in t);
// a row's reduction is a loop in a fixed order inside one thread, a column's over all rows is
// column_sum's fixed order (common.cuh). Forward and backward of a stage
// sit together, forward first, in MODEL.md's order: RMSNorm (F1, norm_f, B1), split (F3, B3),
// α/β/γ (F5b) and the activations' backward (B5b), BCNorm (F4, B4b/B4c), angles and RoPE (F5,
// F4ef, B6's tail, B5a), gating (F7, B7), the language-model ends (TRAINING.md §1).
#include "stages.cuh"

#include "common.cuh"

namespace m3::gpu::oracle {

// ---- elementwise pieces -----------------------------------------------------------------------

void copy(cudaStream_t s, Idx n, const double* src, double* dst) {
  if (n > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(double),
                                  cudaMemcpyDeviceToDevice, s));
}

void add(cudaStream_t s, Idx n, const double* a, const double* b, double* out) {
  each(s, n, [=] __device__(Idx i) { out[i] = a[i] + b[i]; });
}

void add_row_vector(cudaStream_t s, Idx rows, Idx dim, const double* b, double* Y) {
  each(s, rows * dim, [=] __device__(Idx e) { Y[e] += b[e % dim]; });
}

void sum_rows_into(cudaStream_t s, Idx rows, Idx dim, const double* dY, double* db) {
  column_sum(s, rows, dim, [=] __device__(Idx r, Idx j) { return dY[r * dim + j]; }, db);
}

// ---- RMSNorm ----------------------------------------------------------------------------------

void rmsnorm_forward(cudaStream_t s, Idx rows, Idx dim, const double* u, const double* w, double* y,
                     double* rms) {
  each(s, rows, [=] __device__(Idx r) {
    double ss = 0.0;
    for (Idx i = 0; i < dim; ++i) ss += u[r * dim + i] * u[r * dim + i];
    rms[r] = sqrt(ss / static_cast<double>(dim) + kEps);
  });
  each(s, rows * dim, [=] __device__(Idx e) { y[e] = u[e] / rms[e / dim] * w[e % dim]; });
}

void rmsnorm_backward(cudaStream_t s, Idx rows, Idx dim, const double* u, const double* w,
                      const double* rms, const double* g, double* dx, double* dw,
                      double* c_scratch) {
  each(s, rows, [=] __device__(Idx r) {
    double c = 0.0;
    for (Idx i = 0; i < dim; ++i) c += g[r * dim + i] * w[i] * (u[r * dim + i] / rms[r]);
    c_scratch[r] = c / static_cast<double>(dim);
  });
  each(s, rows * dim, [=] __device__(Idx e) {
    const Idx r = e / dim;
    const double xhat = u[e] / rms[r];
    dx[e] = (w[e % dim] * g[e] - xhat * c_scratch[r]) / rms[r];
  });
  column_sum(
      s, rows, dim,
      [=] __device__(Idx r, Idx i) { return g[r * dim + i] * (u[r * dim + i] / rms[r]); }, dw);
}

// ---- F3 split / B3, F5b, B5b ------------------------------------------------------------------

namespace {
// Column offsets of in_proj's output (MODEL.md §2.1).
struct Cols {
  Idx z, x, b, c, ddt, dda, trap, ang;
  explicit Cols(const Dims& d)
      : z(0),
        x(d.di),
        b(2 * d.di),
        c(2 * d.di + d.ng * d.ds),
        ddt(2 * d.di + 2 * d.ng * d.ds),
        dda(ddt + d.nh),
        trap(ddt + 2 * d.nh),
        ang(ddt + 3 * d.nh) {}
};
}  // namespace

void split_forward(cudaStream_t s, const Dims& d, const LayerDev& L) {
  const Cols c(d);
  const Idx ip = d.ip, di = d.di, bc = d.ng * d.ds, nh = d.nh, na = d.na;
  const double* P = L.proj;
  double *z = L.z, *x = L.x, *braw = L.b_raw, *craw = L.c_raw;
  each(s, d.BT * di, [=] __device__(Idx e) {
    const Idx r = e / di, j = e % di;
    z[e] = P[r * ip + c.z + j];
    x[e] = P[r * ip + c.x + j];
  });
  each(s, d.BT * bc, [=] __device__(Idx e) {
    const Idx r = e / bc, j = e % bc;
    braw[e] = P[r * ip + c.b + j];
    craw[e] = P[r * ip + c.c + j];
  });
  double *ddt = L.dd_dt_raw, *dda = L.dd_a_raw, *trr = L.trap_raw, *dt = L.dt, *av = L.a_val,
         *tr = L.trap;
  const double* dt_bias = L.p.dt_bias;
  const double a_floor = d.a_floor;
  each(s, d.BT * nh, [=] __device__(Idx i) {
    const Idx r = i / nh, h = i % nh;
    ddt[i] = P[r * ip + c.ddt + h];
    dda[i] = P[r * ip + c.dda + h];
    trr[i] = P[r * ip + c.trap + h];
    dt[i] = softplus(ddt[i] + dt_bias[h]);
    const double a = -heavy_tail(dda[i]);
    av[i] = -a_floor < a ? -a_floor : a;  // min(−φ, −a_floor)
    tr[i] = sigmoid(trr[i]);
  });
  double* ang = L.angles_raw;
  if (na > 0)
    each(s, d.BT * na, [=] __device__(Idx e) { ang[e] = P[(e / na) * ip + c.ang + e % na]; });
}

void split_backward(cudaStream_t s, const Dims& d, const LayerDev& L) {
  const Cols c(d);
  const Idx ip = d.ip, di = d.di, bc = d.ng * d.ds, nh = d.nh, na = d.na;
  const double *dz = L.d_z, *dx = L.d_x, *db = L.d_b_raw, *dc = L.d_c_raw, *ddt = L.d_dd_dt,
               *dda = L.d_dd_a, *dtr = L.d_trap_raw, *dang = L.d_angles_raw;
  double* out = L.d_proj;
  each(s, d.BT * ip, [=] __device__(Idx e) {
    const Idx r = e / ip, j = e % ip;
    double v;
    if (j < c.x)
      v = dz[r * di + j];
    else if (j < c.b)
      v = dx[r * di + j - c.x];
    else if (j < c.c)
      v = db[r * bc + j - c.b];
    else if (j < c.ddt)
      v = dc[r * bc + j - c.c];
    else if (j < c.dda)
      v = ddt[r * nh + j - c.ddt];
    else if (j < c.trap)
      v = dda[r * nh + j - c.dda];
    else if (j < c.ang)
      v = dtr[r * nh + j - c.trap];
    else
      v = dang[r * na + j - c.ang];
    out[e] = v;
  });
}

void abg_forward(cudaStream_t s, const Dims& d, const LayerDev& L) {
  const double *av = L.a_val, *dtp = L.dt, *trp = L.trap;
  double *al = L.alpha, *be = L.beta, *ga = L.gamma;
  each(s, d.BT * d.nh, [=] __device__(Idx i) {
    const double dt = dtp[i], tr = trp[i];
    al[i] = exp(av[i] * dt);
    be[i] = al[i] * dt * (1.0 - tr);
    ga[i] = tr * dt;
  });
}

void activations_backward(cudaStream_t s, const Dims& d, const LayerDev& L) {
  const Idx nh = d.nh, BT = d.BT;
  const double a_floor = d.a_floor;
  const double *dadt = L.d_adt_total, *ddir = L.d_dt_direct, *dang = L.d_dt_angle,
               *dtrs = L.d_trap_sig, *av = L.a_val, *dtp = L.dt, *trp = L.trap,
               *ddtraw = L.dd_dt_raw, *ddaraw = L.dd_a_raw, *dt_bias = L.p.dt_bias;
  double *d_dd_dt = L.d_dd_dt, *d_dd_a = L.d_dd_a, *d_trap_raw = L.d_trap_raw;
  each(s, BT * nh, [=] __device__(Idx i) {
    const Idx h = i % nh;
    const double d_adt = dadt[i];
    const double d_dt_tot = d_adt * av[i] + ddir[i] + dang[i];
    d_dd_dt[i] = d_dt_tot * softplus_grad(ddtraw[i] + dt_bias[h]);
    const double tr = trp[i];
    d_trap_raw[i] = dtrs[i] * tr * (1.0 - tr);
    const double v = ddaraw[i];
    const bool clamped = -heavy_tail(v) > -a_floor;
    d_dd_a[i] = clamped ? 0.0 : d_adt * dtp[i] * (-heavy_tail_grad(v));
  });
  double* g_dt_bias = L.g.dt_bias;
  column_sum(s, BT, nh, [=] __device__(Idx r, Idx h) { return d_dd_dt[r * nh + h]; }, g_dt_bias);
}

// ---- F4 BCNorm / B4b, B4c ---------------------------------------------------------------------

namespace detail {
// X_biased[r, h, n] = X_normed[r, g(h), n] + bias[h, n]
void bias_broadcast(cudaStream_t s, const Dims& d, const double* normed, const double* bias,
                    double* biased) {
  const Idx nh = d.nh, ds = d.ds, ng = d.ng, hpg = d.hpg;
  each(s, d.BT * nh * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, h = (e / ds) % nh, r = e / (ds * nh);
    biased[e] = normed[(r * ng + h / hpg) * ds + n] + bias[h * ds + n];
  });
}

// d_normed[r, g, n] = Σ_{h: g(h) = g} d_pre[r, h, n] (ascending h); d bias[h, n] += Σ_r d_pre.
void bias_backward(cudaStream_t s, const Dims& d, const double* d_pre, double* d_normed,
                   double* d_bias) {
  const Idx nh = d.nh, ds = d.ds, ng = d.ng, hpg = d.hpg, BT = d.BT;
  each(s, BT * ng * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, g = (e / ds) % ng, r = e / (ds * ng);
    double acc = 0.0;
    for (Idx h = g * hpg; h < (g + 1) * hpg; ++h) acc += d_pre[(r * nh + h) * ds + n];
    d_normed[e] = acc;
  });
  column_sum(s, BT, nh * ds, [=] __device__(Idx r, Idx i) { return d_pre[r * nh * ds + i]; },
             d_bias);
}
}  // namespace detail

void bcnorm_forward(cudaStream_t s, const Dims& d, const LayerDev& L) {
  const Idx rows = d.BT * d.ng;
  rmsnorm_forward(s, rows, d.ds, L.b_raw, L.p.b_norm_weight, L.b_normed, L.b_rms);
  rmsnorm_forward(s, rows, d.ds, L.c_raw, L.p.c_norm_weight, L.c_normed, L.c_rms);
  detail::bias_broadcast(s, d, L.b_normed, L.p.b_bias, L.b_biased);
  detail::bias_broadcast(s, d, L.c_normed, L.p.c_bias, L.c_biased);
}

void bcnorm_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w) {
  detail::bias_backward(s, d, L.d_b_pre_rope, L.d_b_normed, L.g.b_bias);
  detail::bias_backward(s, d, L.d_c_pre_rope, L.d_c_normed, L.g.c_bias);
  const Idx rows = d.BT * d.ng;
  rmsnorm_backward(s, rows, d.ds, L.b_raw, L.p.b_norm_weight, L.b_rms, L.d_b_normed, L.d_b_raw,
                   L.g.b_norm_weight, w.row_scratch);
  rmsnorm_backward(s, rows, d.ds, L.c_raw, L.p.c_norm_weight, L.c_rms, L.d_c_normed, L.d_c_raw,
                   L.g.c_norm_weight, w.row_scratch);
}

// ---- F5 angles, F4ef RoPE, B6's RoPE tail, B5a ------------------------------------------------

void angle_forward(cudaStream_t s, const Dims& d, const LayerDev& L) {
  const Idx nh = d.nh, na = d.na, T = d.T;
  if (na == 0) return;
  const double *araw = L.angles_raw, *dtp = L.dt, *in = L.angle_in;
  double *cum = L.angle_cumsum, *out = L.angle_out;
  each(s, d.B * nh * na, [=] __device__(Idx e) {
    const Idx a = e % na, h = (e / na) % nh, b = e / (na * nh);
    double theta = in[e];
    for (Idx t = 0; t < T; ++t) {
      const Idx r = b * T + t;
      const double omega = kPi * tanh(araw[r * na + a]);
      const double incr = __dmul_rn(omega, dtp[r * nh + h]);  // ω·dt rounded, then summed
      theta = wrap_two_pi(theta + incr);
      cum[(r * nh + h) * na + a] = theta;
    }
    out[e] = theta;
  });
}

namespace detail {
// out = R(θ)·in on the pairs (2a, 2a+1), a < na; the other dimensions copied.
void rotate(cudaStream_t s, const Dims& d, const double* theta, const double* in, double* out) {
  const Idx nh = d.nh, ds = d.ds, na = d.na;
  each(s, d.BT * nh * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, rh = e / ds;
    if (n >= 2 * na) {
      out[e] = in[e];
      return;
    }
    const Idx a = n / 2, base = rh * ds + 2 * a;
    const double th = theta[rh * na + a], c = cos(th), sn = sin(th);
    const double v0 = in[base], v1 = in[base + 1];
    out[e] = n % 2 == 0 ? c * v0 - sn * v1 : sn * v0 + c * v1;
  });
}

// dpre = R(θ)ᵀ·dv on the pairs (the other dimensions copied).
void rotate_back(cudaStream_t s, const Dims& d, const double* theta, const double* dv,
                 double* dpre) {
  const Idx nh = d.nh, ds = d.ds, na = d.na;
  each(s, d.BT * nh * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, rh = e / ds;
    if (n >= 2 * na) {
      dpre[e] = dv[e];
      return;
    }
    const Idx a = n / 2, base = rh * ds + 2 * a;
    const double th = theta[rh * na + a], c = cos(th), sn = sin(th);
    const double g0 = dv[base], g1 = dv[base + 1];
    dpre[e] = n % 2 == 0 ? c * g0 + sn * g1 : -sn * g0 + c * g1;
  });
}
}  // namespace detail

void rope_forward(cudaStream_t s, const Dims& d, const LayerDev& L) {
  detail::rotate(s, d, L.angle_cumsum, L.b_biased, L.k);
  detail::rotate(s, d, L.angle_cumsum, L.c_biased, L.q);
}

void rope_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w) {
  detail::rotate_back(s, d, L.angle_cumsum, w.d_k, L.d_b_pre_rope);
  detail::rotate_back(s, d, L.angle_cumsum, w.d_q, L.d_c_pre_rope);
  const Idx ds = d.ds, na = d.na;
  if (na == 0) return;
  const double *dk = w.d_k, *dq = w.d_q, *k = L.k, *q = L.q;
  double* dth = L.d_angle_cumsum;
  each(s, d.BT * d.nh * na, [=] __device__(Idx e) {
    const Idx a = e % na, base = (e / na) * ds + 2 * a;
    double acc = 0.0;
    acc += -dk[base] * k[base + 1] + dk[base + 1] * k[base];
    acc += -dq[base] * q[base + 1] + dq[base + 1] * q[base];
    dth[e] = acc;
  });
}

void angle_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w) {
  const Idx nh = d.nh, na = d.na, T = d.T;
  double* d_dt_angle = L.d_dt_angle;
  if (na == 0) {
    M3_CUDA_CHECK(cudaMemsetAsync(d_dt_angle, 0, static_cast<size_t>(d.BT * nh) * 8, s));
    return;
  }
  const double *dth = L.d_angle_cumsum, *dl = L.d_angle_out, *araw = L.angles_raw, *dtp = L.dt;
  double *bar = w.theta_bar, *d_in = L.d_angle_in, *d_raw = L.d_angles_raw;
  each(s, d.B * nh * na, [=] __device__(Idx e) {
    const Idx a = e % na, h = (e / na) % nh, b = e / (na * nh);
    double run = dl[e];
    for (Idx t = T - 1; t >= 0; --t) {
      const Idx i = ((b * T + t) * nh + h) * na + a;
      run += dth[i];
      bar[i] = run;
    }
    d_in[e] = run;
  });
  each(s, d.BT * na, [=] __device__(Idx e) {
    const Idx r = e / na, a = e % na;
    const double th = tanh(araw[e]);
    double acc = 0.0;
    for (Idx h = 0; h < nh; ++h)
      acc += bar[(r * nh + h) * na + a] * kPi * dtp[r * nh + h] * (1.0 - th * th);
    d_raw[e] = acc;
  });
  each(s, d.BT * nh, [=] __device__(Idx i) {
    const Idx r = i / nh;
    double acc = 0.0;
    for (Idx a = 0; a < na; ++a) acc += bar[i * na + a] * kPi * tanh(araw[r * na + a]);
    d_dt_angle[i] = acc;
  });
}

// ---- F7 gating / B7 ---------------------------------------------------------------------------

void gating_forward(cudaStream_t s, const Dims& d, const LayerDev& L) {
  const Idx hd = d.hd, nh = d.nh, di = d.di;
  const double *y = L.y, *z = L.z, *ngw = L.p.norm_gate_weight;
  double *gated = L.gated, *rstd = L.gated_rms_vals;
  if (!d.outproj_norm) {
    each(s, d.BT * di, [=] __device__(Idx i) { gated[i] = y[i] * silu(z[i]); });
    return;
  }
  each(s, d.BT * nh, [=] __device__(Idx rh) {
    double ss = 0.0;
    for (Idx p = 0; p < hd; ++p) ss += y[rh * hd + p] * y[rh * hd + p];
    rstd[rh] = 1.0 / sqrt(ss / static_cast<double>(hd) + kEps);
  });
  each(s, d.BT * di, [=] __device__(Idx i) {
    const double w = rstd[i / hd] * ngw[i % di];
    gated[i] = y[i] * w * silu(z[i]);
  });
}

void gating_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w) {
  const Idx hd = d.hd, nh = d.nh, di = d.di, BT = d.BT;
  const double *y = L.y, *z = L.z, *dg = L.d_gated, *ngw = L.p.norm_gate_weight,
               *rstd = L.gated_rms_vals;
  double *dy = L.d_y, *dz = L.d_z;
  if (!d.outproj_norm) {
    each(s, BT * di, [=] __device__(Idx i) {
      dy[i] = dg[i] * silu(z[i]);
      dz[i] = dg[i] * y[i] * silu_grad(z[i]);
    });
    return;
  }
  double* c1 = w.row_scratch;  // [BT, nh]
  each(s, BT * nh, [=] __device__(Idx rh) {
    const double rs = rstd[rh];
    double acc = 0.0;
    for (Idx p = 0; p < hd; ++p) {
      const Idx i = rh * hd + p;
      acc += y[i] * rs * ngw[i % di] * (dg[i] * silu(z[i]));
    }
    c1[rh] = acc / static_cast<double>(hd);
  });
  each(s, BT * di, [=] __device__(Idx i) {
    const Idx rh = i / hd;
    const double rs = rstd[rh], wgt = ngw[i % di], yh = y[i] * rs, gg = dg[i] * silu(z[i]);
    dz[i] = dg[i] * yh * wgt * silu_grad(z[i]);
    dy[i] = (wgt * gg - yh * c1[rh]) * rs;
  });
  double* g_ngw = L.g.norm_gate_weight;
  column_sum(
      s, BT, di,
      [=] __device__(Idx r, Idx j) {
        const Idx i = r * di + j;
        return dg[i] * silu(z[i]) * y[i] * rstd[r * nh + j / hd];
      },
      g_ngw);
}

// ---- the language-model ends ------------------------------------------------------------------

void embed_forward(cudaStream_t s, Idx BT, Idx V, Idx dm, const int* tok, const double* W,
                   const double* b, double* h0, double* one_hot) {
  each(s, BT * dm, [=] __device__(Idx e) {
    const Idx r = e / dm, j = e % dm;
    const double wv = W[static_cast<Idx>(tok[r]) * dm + j];
    h0[e] = b ? wv + b[j] : wv;
  });
  each(s, BT * V, [=] __device__(Idx e) { one_hot[e] = e % V == tok[e / V] ? 1.0 : 0.0; });
}

void embed_backward(cudaStream_t s, Idx V, Idx dm, const Idx* order, const Idx* starts,
                    const double* dH, double* dW) {
  each(s, V * dm, [=] __device__(Idx e) {
    const Idx v = e / dm, j = e % dm;
    if (starts[v] == starts[v + 1]) return;
    double acc = 0.0;
    for (Idx i = starts[v]; i < starts[v + 1]; ++i) acc += dH[order[i] * dm + j];
    dW[e] += acc;
  });
}

void loss_forward(cudaStream_t s, Idx BT, Idx V, const double* logits, const int* tgt,
                  const float* w, double n_norm, double* lse, double* value) {
  each(s, BT, [=] __device__(Idx r) {
    const double* l = logits + r * V;
    double mx = l[0];
    for (Idx v = 1; v < V; ++v) mx = l[v] > mx ? l[v] : mx;
    double se = 0.0;
    for (Idx v = 0; v < V; ++v) se += exp(l[v] - mx);
    lse[r] = mx + log(se);
  });
  each(s, 1, [=] __device__(Idx) {
    double sum = 0.0;
    for (Idx r = 0; r < BT; ++r)
      if (w[r] != 0.0f) sum += static_cast<double>(w[r]) * (lse[r] - logits[r * V + tgt[r]]);
    *value = sum / n_norm;
  });
}

void loss_backward(cudaStream_t s, Idx BT, Idx V, const double* logits, const double* lse,
                   const int* tgt, const float* w, double n_norm, double scale, double* d_logits) {
  each(s, BT * V, [=] __device__(Idx e) {
    const Idx r = e / V, v = e % V;
    const double c = scale * static_cast<double>(w[r]) / n_norm;
    const double p = exp(logits[e] - lse[r]);
    d_logits[e] = c * (v == tgt[r] ? p - 1.0 : p);
  });
}

}  // namespace m3::gpu::oracle
