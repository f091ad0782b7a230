// The GPU oracle's SSM, forward (F6) and backward (B6), as the exact recurrence of MODEL.md §4
// F6 and its BPTT §6.3, in f64, with h kept every K = ⌈√T⌉ steps and recomputed in between.
//
// Per (b, h), state h_t ∈ ℝ^{hd×ds}, x_t = x[r, h, :], K_t = k[r, h, :], Q_t = q[r, h, :]:
//   h_t = α_t·h_{t−1} + β_t·v_{t−1}k_{t−1}ᵀ + γ_t·x_t K_tᵀ       (h_{−1}, k_{−1}, v_{−1}) entering
//   y_t = h_t Q_t + D[h]·x_t;     k_t := K_t, v_t := x_t;     leaving (h_{T−1}, K_{T−1}, x_{T−1})
// Each state element h[p, n] follows its own scalar recurrence.
//
// Forward: one warp per row (b, h, p), all T steps in one launch. The row's ds states sit in
// shared memory, lane ℓ holding n ≡ ℓ (mod 32); y_t[p] = Σ_n h_t[p,n]·Q_t[n] is each lane's sum
// then the warp's butterfly sum (a fixed order). At each segment's start s0 the row writes
// h_{s0−1} into h_ckpt [S, B, nh, hd, ds].
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
// Segments from the last: recompute h_{s0−1} … h_{s1−1} from the checkpoint into scan_h's slots
// 0 … len (one thread per state element), then walk t from s1 − 1 down to s0 in one block per
// (b, h): G lives in scan_g [B, nh, hd, ds] (G_{t+1} read, G_t written in place), 512 threads in
// PG groups of CW ∈ {32, 64, 128} (layout.hpp), each thread one column n (n ≡ its place in the
// group, mod CW) and the rows p ≡ its group (mod PG); per step the block forms every
// row sum over n (the warp's butterfly, then the column warps in order, through scan_rows) and
// every column sum over p (each thread's rows, then the groups in order, in shared memory), and
// the per-(b, t, h) scalars (over p in order, through scan_parts). Every sum has one fixed order,
// so a pass is deterministic.
// Buffers: scan_h [(K+1), B, nh, hd, ds] (slot-major); scan_g [B, nh, hd, ds];
// scan_rows [B, nh, CW/32, hd, 4]; scan_parts [B, nh, hd, 3]; scan_dd [B, di].
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

// One step of one state element: α·h + β·(v_{t−1}·k_{t−1}) + γ·(x_t·K_t), written once so the
// forward and the backward's recomputation round alike.
__device__ inline double state_step(double al, double h, double be, double vprev, double kprev,
                                    double ga, double xt, double Kt) {
  return al * h + be * (vprev * kprev) + ga * (xt * Kt);
}

// The backward's recomputation: h through [s0, s1) from the segment's checkpoint, one thread per
// state element; scan_h's slots 0 … len receive h_{s0−1} … h_{s1−1}.
void walk_states(cudaStream_t s, const Dims& d, const LayerDev& L, Idx s0, Idx s1,
                 const double* start, double* hseg) {
  const Idx nh = d.nh, hd = d.hd, ds = d.ds, di = d.di, T = d.T;
  const Idx E = d.B * nh * hd * ds;
  const double *al = L.alpha, *be = L.beta, *ga = L.gamma, *x = L.x, *k = L.k, *k_in = L.k_in,
               *v_in = L.v_in;
  each(s, E, [=] __device__(Idx e) {
    const detail::Elem c(e, nh, hd, ds);
    double hv = start[e];
    hseg[e] = hv;
    for (Idx t = s0; t < s1; ++t) {
      const Idx r = c.b * T + t, i = r * nh + c.h;
      const double kprev = t == 0 ? k_in[(c.b * nh + c.h) * ds + c.n] : k[(i - nh) * ds + c.n];
      const double vprev =
          t == 0 ? v_in[(c.b * nh + c.h) * hd + c.p] : x[(r - 1) * di + c.h * hd + c.p];
      const double xt = x[r * di + c.h * hd + c.p], Kt = k[i * ds + c.n];
      hv = state_step(al[i], hv, be[i], vprev, kprev, ga[i], xt, Kt);
      hseg[(t - s0 + 1) * E + e] = hv;
    }
  });
}

// The sum of v over the warp's 32 lanes, every lane receiving it (butterfly, a fixed order).
__device__ inline double warp_sum(double v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Forward rows: warp w of the grid walks row (b, h, p) = w through all T steps.
struct ForwardRows {
  Idx B, T, nh, hd, ds, di, K, rows;
  const double *al, *be, *ga, *x, *k, *q, *k_in, *v_in, *ssm_in, *D;
  double *y, *ckpt, *ssm_out;
};

constexpr int kRowWarps = 4;  // warps (rows) per block of forward_rows

__global__ void forward_rows(ForwardRows a) {
  extern __shared__ double state[];  // [kRowWarps][ds]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Idx row = static_cast<Idx>(blockIdx.x) * kRowWarps + warp;
  if (row >= a.rows) return;  // the whole warp: no barrier follows
  const Idx ds = a.ds, nh = a.nh, hd = a.hd, di = a.di, T = a.T, E = a.rows * ds;
  const Idx p = row % hd, h = (row / hd) % nh, b = row / (hd * nh), base = row * ds;
  double* hv = state + warp * ds;
  for (Idx n = lane; n < ds; n += 32) hv[n] = a.ssm_in[base + n];
  for (Idx t = 0; t < T; ++t) {
    if (t % a.K == 0)
      for (Idx n = lane; n < ds; n += 32) a.ckpt[(t / a.K) * E + base + n] = hv[n];
    const Idx r = b * T + t, i = r * nh + h;
    const double al = a.al[i], be = a.be[i], ga = a.ga[i];
    const double vprev = t == 0 ? a.v_in[(b * nh + h) * hd + p] : a.x[(r - 1) * di + h * hd + p];
    const double xt = a.x[r * di + h * hd + p];
    const double* kprev = t == 0 ? a.k_in + (b * nh + h) * ds : a.k + (i - nh) * ds;
    const double *Kt = a.k + i * ds, *Qt = a.q + i * ds;
    double acc = 0.0;
    for (Idx n = lane; n < ds; n += 32) {
      const double v = state_step(al, hv[n], be, vprev, kprev[n], ga, xt, Kt[n]);
      hv[n] = v;
      acc += v * Qt[n];
    }
    acc = warp_sum(acc);
    if (lane == 0) a.y[r * di + h * hd + p] = acc + a.D[h] * xt;
  }
  for (Idx n = lane; n < ds; n += 32) a.ssm_out[base + n] = hv[n];
}

// Backward of one segment [s0, s1): block (b, h), kBackThreads threads = PG groups of CW.
struct BackwardSegment {
  Idx B, T, nh, hd, ds, di, s0, s1, CW;
  const double *al, *be, *ga, *x, *k, *q, *dy, *D, *k_in, *v_in, *dtp, *trp, *d_ssm_out, *d_k_out,
      *d_v_out, *hseg;
  double *G, *rows, *parts, *d_x, *d_k, *d_q, *d_ssm_in, *d_adt, *d_dir, *d_trs;
};

constexpr int kBackThreads = 512;

__global__ void __launch_bounds__(kBackThreads) backward_segment(BackwardSegment a) {
  __shared__ double cols[kBackThreads][3];  // each thread's column sums over its rows
  const Idx nh = a.nh, hd = a.hd, ds = a.ds, di = a.di, T = a.T, CW = a.CW;
  const Idx E = a.B * nh * hd * ds, bh = blockIdx.x, b = bh / nh, h = bh % nh;
  const int tid = threadIdx.x, lane = tid % 32;
  const Idx PG = kBackThreads / CW, col = tid % CW, pg = tid / CW, cwarp = col / 32, NW = CW / 32;
  double* rows = a.rows + bh * NW * hd * 4;  // [NW][hd][4]: Σ_n G_t K_t, G_t k_{t−1}, G_t h_{t−1}, G_{t+1} K_t
  double* parts = a.parts + bh * hd * 3;     // [hd][3]: the per-p terms of dα, dβ, dγ
  for (Idx t = a.s1 - 1; t >= a.s0; --t) {
    const Idx j = t - a.s0, r = b * T + t, i = r * nh + h;
    const bool last = t == T - 1;
    const double anext = last ? 0.0 : a.al[i + nh];
    const double* kprev = t == 0 ? a.k_in + (b * nh + h) * ds : a.k + (i - nh) * ds;
    const double *Kt = a.k + i * ds, *Qt = a.q + i * ds;
    const double *xt = a.x + r * di + h * hd, *dyt = a.dy + r * di + h * hd;
    // Columns cb … cb + CW − 1: G_t, the row sums' terms and the column sums.
    for (Idx cb = 0; cb < ds; cb += CW) {
      const Idx n = cb + col;
      const bool on = n < ds;
      double sGx = 0.0, sGnx = 0.0, sq = 0.0;
      for (Idx p = pg; p < hd; p += PG) {
        double r0 = 0.0, r1 = 0.0, r2 = 0.0, r3 = 0.0;
        if (on) {
          const Idx e = ((b * nh + h) * hd + p) * ds + n;
          const double gn = last ? 0.0 : a.G[e];
          const double g = (last ? a.d_ssm_out[e] : anext * gn) + dyt[p] * Qt[n];
          a.G[e] = g;
          if (t == 0) a.d_ssm_in[e] = a.al[i] * g;
          const double hprev = a.hseg[j * E + e], ht = a.hseg[(j + 1) * E + e];
          r0 = g * Kt[n];
          r1 = g * kprev[n];
          r2 = g * hprev;
          r3 = gn * Kt[n];
          sGx += g * xt[p];
          sGnx += gn * xt[p];
          sq += ht * dyt[p];
        }
        r0 = warp_sum(r0);
        r1 = warp_sum(r1);
        r2 = warp_sum(r2);
        r3 = warp_sum(r3);
        if (lane == 0) {
          double* w = rows + (cwarp * hd + p) * 4;
          const bool first = cb == 0;
          w[0] = first ? r0 : w[0] + r0;
          w[1] = first ? r1 : w[1] + r1;
          w[2] = first ? r2 : w[2] + r2;
          w[3] = first ? r3 : w[3] + r3;
        }
      }
      cols[tid][0] = sGx;
      cols[tid][1] = sGnx;
      cols[tid][2] = sq;
      __syncthreads();
      if (pg == 0 && on) {
        double Sx = 0.0, Snx = 0.0, Sq = 0.0;
        for (Idx g = 0; g < PG; ++g) {
          Sx += cols[g * CW + col][0];
          Snx += cols[g * CW + col][1];
          Sq += cols[g * CW + col][2];
        }
        a.d_q[i * ds + n] = Sq;
        const double carry = last ? a.d_k_out[(b * nh + h) * ds + n] : a.be[i + nh] * Snx;
        a.d_k[i * ds + n] = carry + a.ga[i] * Sx;
      }
      __syncthreads();
    }
    // The rows: d_x and the per-p terms of dα, dβ, dγ.
    for (Idx p = tid; p < hd; p += kBackThreads) {
      double sGK = 0.0, sGkp = 0.0, sGH = 0.0, sGnK = 0.0;
      for (Idx w = 0; w < NW; ++w) {
        const double* v = rows + (w * hd + p) * 4;
        sGK += v[0];
        sGkp += v[1];
        sGH += v[2];
        sGnK += v[3];
      }
      const Idx xi = r * di + h * hd + p;
      const double carry = last ? a.d_v_out[(b * nh + h) * hd + p] : a.be[i + nh] * sGnK;
      a.d_x[xi] = carry + a.D[h] * a.dy[xi] + a.ga[i] * sGK;
      const double vprev = t == 0 ? a.v_in[(b * nh + h) * hd + p] : a.x[xi - di];
      parts[p * 3 + 0] = sGH;
      parts[p * 3 + 1] = vprev * sGkp;
      parts[p * 3 + 2] = a.x[xi] * sGK;
    }
    __syncthreads();
    if (tid == 0) {
      double da = 0.0, db = 0.0, dg = 0.0;
      for (Idx p = 0; p < hd; ++p) {
        da += parts[p * 3 + 0];
        db += parts[p * 3 + 1];
        dg += parts[p * 3 + 2];
      }
      const double al = a.al[i], dt = a.dtp[i], tr = a.trp[i];
      a.d_adt[i] = da * al + db * a.be[i];
      a.d_dir[i] = db * al * (1.0 - tr) + dg * tr;
      a.d_trs[i] = -db * al * dt + dg * dt;
    }
  }
}

}  // namespace detail

void ssm_forward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w) {
  const Idx rows = d.B * d.nh * d.hd;
  detail::ForwardRows a{d.B,   d.T,    d.nh,    d.hd,   d.ds,   d.di,      segment_length(d.T),
                        rows,  L.alpha, L.beta, L.gamma, L.x,   L.k,       L.q,
                        L.k_in, L.v_in, L.ssm_in, L.p.d_param, L.y, L.h_ckpt, L.ssm_out};
  const Idx blocks = (rows + detail::kRowWarps - 1) / detail::kRowWarps;
  const std::size_t shared = static_cast<std::size_t>(detail::kRowWarps * d.ds) * sizeof(double);
  if (shared > 48 * 1024)
    M3_CUDA_CHECK(cudaFuncSetAttribute(detail::forward_rows,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(shared)));
  detail::forward_rows<<<static_cast<unsigned>(blocks), 32 * detail::kRowWarps, shared, s>>>(a);
  M3_CUDA_CHECK(cudaGetLastError());
  // Leaving k and v: K_{T−1}, x_{T−1}.
  const Idx nh = d.nh, hd = d.hd, ds = d.ds, di = d.di, T = d.T;
  const double *k = L.k, *x = L.x;
  double *k_out = L.k_out, *v_out = L.v_out;
  each(s, d.B * nh * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, bh = e / ds, b = bh / nh, h = bh % nh;
    k_out[e] = k[((b * T + T - 1) * nh + h) * ds + n];
  });
  each(s, d.B * nh * hd, [=] __device__(Idx e) {
    const Idx p = e % hd, bh = e / hd, b = bh / nh, h = bh % nh;
    v_out[e] = x[(b * T + T - 1) * di + h * hd + p];
  });
}

void ssm_backward(cudaStream_t s, const Dims& d, const LayerDev& L, const Work& w) {
  const Idx nh = d.nh, hd = d.hd, ds = d.ds, di = d.di, T = d.T, B = d.B;
  const Idx E = B * nh * hd * ds, K = segment_length(T), S = segment_count(T);
  for (Idx seg = S - 1; seg >= 0; --seg) {
    const Idx s0 = seg * K, s1 = std::min(T, s0 + K);
    detail::walk_states(s, d, L, s0, s1, L.h_ckpt + seg * E, w.scan_h);
    const detail::BackwardSegment a{
        B,          T,          nh,       hd,          ds,         di,          s0,
        s1,         scan_column_width(ds), L.alpha, L.beta,     L.gamma,     L.x,
        L.k,        L.q,        L.d_y,    L.p.d_param, L.k_in,     L.v_in,      L.dt,
        L.trap,     L.d_ssm_out, L.d_k_out, L.d_v_out, w.scan_h,   w.scan_g,    w.scan_rows,
        w.scan_parts, L.d_x,    w.d_k,    w.d_q,       L.d_ssm_in, L.d_adt_total, L.d_dt_direct,
        L.d_trap_sig};
    detail::backward_segment<<<static_cast<unsigned>(B * nh), detail::kBackThreads, 0, s>>>(a);
    M3_CUDA_CHECK(cudaGetLastError());
  }
  // The entering k and v gradients from G_0 (in scan_g after the first segment).
  const double *be = L.beta, *k_in = L.k_in, *v_in = L.v_in, *G0 = w.scan_g;
  double *d_k_in = L.d_k_in, *d_v_in = L.d_v_in;
  each(s, B * nh * hd, [=] __device__(Idx e) {
    const Idx bh = e / hd, b = bh / nh, h = bh % nh;
    const double* g = G0 + e * ds;
    const double* kin = k_in + bh * ds;
    double acc = 0.0;
    for (Idx n = 0; n < ds; ++n) acc += g[n] * kin[n];
    d_v_in[e] = be[b * T * nh + h] * acc;
  });
  each(s, B * nh * ds, [=] __device__(Idx e) {
    const Idx n = e % ds, bh = e / ds, b = bh / nh, h = bh % nh;
    const double* vin = v_in + bh * hd;
    double acc = 0.0;
    for (Idx p = 0; p < hd; ++p) acc += G0[(bh * hd + p) * ds + n] * vin[p];
    d_k_in[e] = be[b * T * nh + h] * acc;
  });
  // d D: Σ_t d_y·x per (b, h·hd + p) (t descending), then Σ_b Σ_p per head, added once.
  const double *dy = L.d_y, *x = L.x;
  double* dd_local = w.scan_dd;
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
