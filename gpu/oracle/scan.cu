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
// 0 … len (one thread per state element), then walk t from s1 − 1 down to s0 in blocks of
// kScanBlockRows rows of one (b, h) (layout.hpp), one warp per row p, lane ℓ the columns
// n ≡ ℓ (mod 32). G lives in scan_g [B, nh, hd, ds] (G_{t+1} read, G_t written in place). Per step
// a row's sums over n are its lanes' then the warp's butterfly; the block sums its rows in order
// for the column sums over p (in tiles of 128 columns, through shared memory) and for the terms
// of dα, dβ, dγ, and writes them per row block (scan_colpart [B, nh, NB, K, ds, 3], scan_scalpart
// [B, nh, NB, K, 3]); after the walk, one thread per (b, t, h, n) and per (b, t, h) adds the
// row blocks in order and forms d_q, d_k and d_adt_total, d_dt_direct, d_trap_sig. Every sum has
// one fixed order, so a pass is deterministic.
// Buffers: scan_h [(K+1), B, nh, hd, ds] (slot-major); scan_g [B, nh, hd, ds]; scan_dd [B, di].
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

// Backward of one segment [s0, s1): block (b, h, rb) holds rows p = rb·kScanBlockRows + warp,
// one warp per row, lane ℓ the columns n ≡ ℓ (mod 32).
struct BackwardSegment {
  Idx B, T, nh, hd, ds, di, s0, s1, K, NB;
  const double *al, *be, *ga, *x, *k, *q, *dy, *D, *k_in, *v_in, *d_ssm_out, *d_v_out, *hseg;
  double *G, *colpart, *scalpart, *d_x, *d_ssm_in;
};

constexpr int kBackWarps = static_cast<int>(kScanBlockRows);
constexpr int kColTile = 128;  // columns per pass of the block's column sums

__global__ void __launch_bounds__(32 * kBackWarps) backward_segment(BackwardSegment a) {
  __shared__ double cols[kBackWarps][kColTile][3];  // each row's column terms of one tile
  __shared__ double parts[kBackWarps][3];           // each row's terms of dα, dβ, dγ
  const Idx nh = a.nh, hd = a.hd, ds = a.ds, di = a.di, T = a.T, K = a.K, NB = a.NB;
  const Idx E = a.B * nh * hd * ds, rb = blockIdx.x % NB, bh = blockIdx.x / NB, b = bh / nh,
            h = bh % nh;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const Idx p = rb * kBackWarps + warp;
  const bool row = p < hd;
  for (Idx t = a.s1 - 1; t >= a.s0; --t) {
    const Idx j = t - a.s0, r = b * T + t, i = r * nh + h, xi = r * di + h * hd + p;
    const bool last = t == T - 1;
    const double anext = last ? 0.0 : a.al[i + nh];
    const double xp = row ? a.x[xi] : 0.0, dyp = row ? a.dy[xi] : 0.0;
    const double* kprev = t == 0 ? a.k_in + bh * ds : a.k + (i - nh) * ds;
    const double *Kt = a.k + i * ds, *Qt = a.q + i * ds;
    // The row's sums over n: Σ G_t K_t, G_t k_{t−1}, G_t∘h_{t−1}, G_{t+1} K_t.
    double sGK = 0.0, sGkp = 0.0, sGH = 0.0, sGnK = 0.0;
    for (Idx cb = 0; cb < ds; cb += kColTile) {
      for (int c = lane; c < kColTile; c += 32) {
        const Idx n = cb + c;
        double cg = 0.0, cgn = 0.0, ch = 0.0;
        if (row && n < ds) {
          const Idx e = (bh * hd + p) * ds + n;
          const double gn = last ? 0.0 : a.G[e];
          const double g = (last ? a.d_ssm_out[e] : anext * gn) + dyp * Qt[n];
          a.G[e] = g;
          if (t == 0) a.d_ssm_in[e] = a.al[i] * g;
          const double hprev = a.hseg[j * E + e], ht = a.hseg[(j + 1) * E + e];
          sGK += g * Kt[n];
          sGkp += g * kprev[n];
          sGH += g * hprev;
          sGnK += gn * Kt[n];
          cg = g * xp;
          cgn = gn * xp;
          ch = ht * dyp;
        }
        cols[warp][c][0] = cg;
        cols[warp][c][1] = cgn;
        cols[warp][c][2] = ch;
      }
      __syncthreads();
      // The tile's columns summed over the block's rows in order: Σ_p G_t x_t, G_{t+1} x_t, h_t d_y_t.
      for (int c = threadIdx.x; c < kColTile && cb + c < ds; c += 32 * kBackWarps) {
        double* out = a.colpart + (((bh * NB + rb) * K + j) * ds + cb + c) * 3;
        for (int q = 0; q < 3; ++q) {
          double acc = 0.0;
          for (int w = 0; w < kBackWarps; ++w) acc += cols[w][c][q];
          out[q] = acc;
        }
      }
      __syncthreads();
    }
    sGK = warp_sum(sGK);
    sGkp = warp_sum(sGkp);
    sGH = warp_sum(sGH);
    sGnK = warp_sum(sGnK);
    if (lane == 0) {
      if (row) {
        const double carry = last ? a.d_v_out[bh * hd + p] : a.be[i + nh] * sGnK;
        a.d_x[xi] = carry + a.D[h] * dyp + a.ga[i] * sGK;
        const double vprev = t == 0 ? a.v_in[bh * hd + p] : a.x[xi - di];
        parts[warp][0] = sGH;
        parts[warp][1] = vprev * sGkp;
        parts[warp][2] = xp * sGK;
      } else {
        parts[warp][0] = parts[warp][1] = parts[warp][2] = 0.0;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double* out = a.scalpart + ((bh * NB + rb) * K + j) * 3;
      for (int q = 0; q < 3; ++q) {
        double acc = 0.0;
        for (int w = 0; w < kBackWarps; ++w) acc += parts[w][q];
        out[q] = acc;
      }
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
  const Idx NB = scan_row_blocks(hd);
  const double *al = L.alpha, *be = L.beta, *ga = L.gamma, *dtp = L.dt, *trp = L.trap,
               *d_k_out = L.d_k_out, *colpart = w.scan_colpart, *scalpart = w.scan_scalpart;
  double *d_k = w.d_k, *d_q = w.d_q, *d_adt = L.d_adt_total, *d_dir = L.d_dt_direct,
         *d_trs = L.d_trap_sig;
  for (Idx seg = S - 1; seg >= 0; --seg) {
    const Idx s0 = seg * K, s1 = std::min(T, s0 + K), len = s1 - s0;
    detail::walk_states(s, d, L, s0, s1, L.h_ckpt + seg * E, w.scan_h);
    const detail::BackwardSegment a{B,       T,      nh,       hd,          ds,     di,
                                    s0,      s1,     K,        NB,          L.alpha, L.beta,
                                    L.gamma, L.x,    L.k,      L.q,         L.d_y,  L.p.d_param,
                                    L.k_in,  L.v_in, L.d_ssm_out, L.d_v_out, w.scan_h, w.scan_g,
                                    w.scan_colpart, w.scan_scalpart, L.d_x, L.d_ssm_in};
    detail::backward_segment<<<static_cast<unsigned>(B * nh * NB), 32 * detail::kBackWarps, 0,
                               s>>>(a);
    M3_CUDA_CHECK(cudaGetLastError());
    // Over the row blocks in order: d_q, d_k per (b, t, h, n); dα, dβ, dγ per (b, t, h).
    each(s, B * len * nh * ds, [=] __device__(Idx e) {
      const Idx n = e % ds, h = (e / ds) % nh, j = (e / (ds * nh)) % len, b = e / (ds * nh * len);
      const Idx bh = b * nh + h, t = s0 + j, i = (b * T + t) * nh + h;
      double Sx = 0.0, Snx = 0.0, Sq = 0.0;
      for (Idx rb = 0; rb < NB; ++rb) {
        const double* v = colpart + (((bh * NB + rb) * K + j) * ds + n) * 3;
        Sx += v[0];
        Snx += v[1];
        Sq += v[2];
      }
      d_q[i * ds + n] = Sq;
      const double carry = t == T - 1 ? d_k_out[bh * ds + n] : be[i + nh] * Snx;
      d_k[i * ds + n] = carry + ga[i] * Sx;
    });
    each(s, B * len * nh, [=] __device__(Idx e) {
      const Idx h = e % nh, j = (e / nh) % len, b = e / (nh * len), bh = b * nh + h;
      const Idx i = (b * T + s0 + j) * nh + h;
      double da = 0.0, db = 0.0, dg = 0.0;
      for (Idx rb = 0; rb < NB; ++rb) {
        const double* v = scalpart + ((bh * NB + rb) * K + j) * 3;
        da += v[0];
        db += v[1];
        dg += v[2];
      }
      const double a = al[i], dt = dtp[i], tr = trp[i];
      d_adt[i] = da * a + db * be[i];
      d_dir[i] = db * a * (1.0 - tr) + dg * tr;
      d_trs[i] = -db * a * dt + dg * dt;
    });
  }
  // The entering k and v gradients from G_0 (in scan_g after the first segment).
  const double *k_in = L.k_in, *v_in = L.v_in, *G0 = w.scan_g;
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
