// F6, the SSM as a sequential recurrence (MODEL.md §4 F6), and its BPTT backward (§6.3), with
// entering states and gradients wrt them (§12.4). Same formulas as reference/ssm_sequential.cpp.
//
// Per (b, h), state h_t ∈ ℝ^{hd×ds}, x_t = x[r, h·hd:], K_t = k[r,h,:], Q_t = q[r,h,:]:
//   (h_{−1}, k_{−1}, v_{−1}) = (ssm_in, k_in, v_in)[b,h]
//   h_t = α_t·h_{t−1} + β_t·v_{t−1} k_{t−1}ᵀ + γ_t·x_t K_tᵀ
//   y_t = h_t Q_t + D[h]·x_t;     k_t := K_t,  v_t := x_t
//   ssm_out, k_out, v_out = h_{T−1}, K_{T−1}, x_{T−1}
// Saved: h_saved [B, T+1, ds, di] (slot t = h_{t−1}, slot T = h_{T−1}; element (b,t,n,h·hd+p)),
// k_prev_saved [BT, nh, ds], v_prev_saved [BT, nh, hd].
// Backward, G = ∂L/∂h_t starting at d_ssm_out; carries start at d_v_out, d_k_out; t = T−1 … 0:
//   G += d_y_t Q_tᵀ;  d_q_t = h_tᵀ d_y_t
//   dα_t = ⟨G, h_{t−1}⟩,  dβ_t = v_{t−1}ᵀ G k_{t−1},  dγ_t = x_tᵀ G K_t
//   d_x_t = carry_x + D·d_y_t + γ_t G K_t;   d_k_t = carry_k + γ_t Gᵀ x_t
//   carry_x = β_t G k_{t−1};  carry_k = β_t Gᵀ v_{t−1};  G ← α_t G
//   after t = 0: d_ssm_in = G, d_v_in = carry_x, d_k_in = carry_k
//   d_d_local[b, h·hd+p] = Σ_t d_y·x;   d D[h] += Σ_b Σ_p d_d_local (ascending b, then p)
//
// Kernels: one block per (b, h), serial in t. The block's NT = TP·TN threads tile the state:
// thread (tp, tn) = (tid mod TP, tid / TP) owns h[p, n] for p = tp + i·TP (i < MP) and
// n = tn + j·TN (j < MN) in registers (TP lanes cover p, so h_saved rows are coalesced).
//   Σ_n (y, G K, G k_prev): in-thread over j, then across the tn of a warp (xor ≥ TP), then the
//     per-warp partials in shared memory summed in ascending warp order.
//   Σ_p (d_q, Gᵀ x, Gᵀ v_prev) and the three scalars: one reduce-scatter butterfly over the TP
//     lanes of a segment (fixed order), leaving each total in one lane; scalars then summed over
//     the TN segments in ascending order.
// Per step, x/K/Q (and d_y, k_prev, v_prev) are staged in double-buffered shared memory.
// x and d_x have the row stride ldx (SeqGeom; proj's / d_proj's column views in production).
// Typed storage T (MODEL.md §8): x, k, q, d_y are read as f32; y and d_x are rounded once as they
// are stored (d_x after its carry and d_v_out terms); states, saves and other gradients are f32.
// Shapes supported: headdim ≤ 128, d_state ≤ 128 (any values in range); others throw m3::Error.
#include <algorithm>

#include "convert.cuh"
#include "reduce.cuh"
#include "smem.cuh"

namespace m3::gpu {

namespace {

struct SeqGeom {
  Idx B, T, nh, hd, ds, di;
  int TN;   // thread rows over n; block = TP·TN threads
  Idx ldx;  // row stride of x and d_x (di, or ip for proj's / d_proj's column views)
};

__host__ __device__ constexpr int log2_of(int v) { return v <= 1 ? 0 : 1 + log2_of(v / 2); }

// Sums v[k] over the TP lanes of the caller's aligned segment for every k < V (V a multiple of
// TP) and leaves V/TP totals in each lane: stage o = TP/2 … 1 keeps one half of the remaining
// values, sends the other half to lane ^ o and adds what comes back (own + received). Lane l of
// the segment ends with the totals of indices scatter_index<TP, V>(l, k), k < V/TP.
template <int O, int HALF, int V>
__device__ __forceinline__ void reduce_scatter_stage(float (&v)[V], int l) {
  if constexpr (O >= 1) {
    const bool hi = (l & O) != 0;
#pragma unroll
    for (int k = 0; k < HALF; ++k) {
      const float send = hi ? v[k] : v[k + HALF];
      const float keep = hi ? v[k + HALF] : v[k];
      v[k] = keep + __shfl_xor_sync(0xffffffffu, send, O);
    }
    reduce_scatter_stage<O / 2, HALF / 2>(v, l);
  }
}

template <int TP, int V>
__device__ __forceinline__ void reduce_scatter(float (&v)[V]) {
  static_assert(V % TP == 0, "V must be a multiple of TP");
  reduce_scatter_stage<TP / 2, V / 2>(v, static_cast<int>(threadIdx.x) & (TP - 1));
}

template <int TP, int V>
__device__ __forceinline__ int scatter_index(int l, int k) {
  int idx = k;
#pragma unroll
  for (int s = 0; s < log2_of(TP); ++s)
    if (l & (TP >> (s + 1))) idx += V >> (s + 1);
  return idx;
}

// Sum over the tn rows that share a warp (lanes l, l ^ TP, l ^ 2TP, …); every lane gets it.
template <int TP>
__device__ __forceinline__ float sum_over_tn_in_warp(float v) {
#pragma unroll
  for (int o = 16; o >= TP; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- forward ---------------------------------------------------------------------------------
// Shared: xs [2][hd], ks [2][ds] (double-buffered; the other buffer holds v_{t−1}, k_{t−1}),
// qs [ds], cf [4] (α, β, γ), red [W][hd].
template <class T, int TP, int MP, int MN, int NTMAX>
__global__ void __launch_bounds__(NTMAX)
ssm_seq_forward_kernel(SeqGeom g, SsmSeqFwd<T> p) {
  extern __shared__ float sm[];
  const int hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds), TN = g.TN;
  const int NT = TP * TN, W = NT / 32;
  float* xs = sm;
  float* ks = xs + 2 * hd;
  float* qs = ks + 2 * ds;
  float* cf = qs + ds;
  float* red = cf + 4;
  const int tid = threadIdx.x, tp = tid % TP, tn = tid / TP, lane = tid & 31, warp = tid >> 5;
  const Idx h = blockIdx.x, b = blockIdx.y, sb = b * g.nh + h;
  const Idx Tn = g.T, di = g.di, nh = g.nh;

  float H[MP][MN];
#pragma unroll
  for (int i = 0; i < MP; ++i)
#pragma unroll
    for (int j = 0; j < MN; ++j) {
      const int pi = tp + i * TP, n = tn + j * TN;
      H[i][j] = (pi < hd && n < ds) ? p.ssm_in[(sb * hd + pi) * ds + n] : 0.0f;
    }
  for (int e = tid; e < hd; e += NT) xs[hd + e] = p.v_in[sb * hd + e];
  for (int e = tid; e < ds; e += NT) ks[ds + e] = p.k_in[sb * ds + e];
  const float D = p.d_param[h];

  for (Idx t = 0; t < Tn; ++t) {
    const int cur = static_cast<int>(t & 1), prv = cur ^ 1;
    const Idx r = b * Tn + t, i_rh = r * nh + h;
    float* xc = xs + cur * hd;
    const float* xp = xs + prv * hd;
    float* kc = ks + cur * ds;
    const float* kp = ks + prv * ds;
    for (int e = tid; e < hd; e += NT) {
      xc[e] = to_float(p.x[r * g.ldx + h * hd + e]);
      p.v_prev_saved[i_rh * hd + e] = xp[e];
    }
    for (int e = tid; e < ds; e += NT) {
      kc[e] = to_float(p.k[i_rh * ds + e]);
      qs[e] = to_float(p.q[i_rh * ds + e]);
      p.k_prev_saved[i_rh * ds + e] = kp[e];
    }
    if (tid == 0) {
      cf[0] = p.alpha[i_rh];
      cf[1] = p.beta[i_rh];
      cf[2] = p.gamma[i_rh];
    }
    __syncthreads();
    const float al = cf[0], be = cf[1], ga = cf[2];
    float* slot = p.h_saved + ((b * (Tn + 1) + t) * ds) * di + h * hd;
    float yp[MP];
#pragma unroll
    for (int i = 0; i < MP; ++i) {
      yp[i] = 0.0f;
      const int pi = tp + i * TP;
      if (pi >= hd) continue;
      const float xv = xc[pi], vv = xp[pi];
#pragma unroll
      for (int j = 0; j < MN; ++j) {
        const int n = tn + j * TN;
        if (n >= ds) continue;
        slot[Idx(n) * di + pi] = H[i][j];
        H[i][j] = al * H[i][j] + be * (vv * kp[n]) + ga * (xv * kc[n]);
        yp[i] += H[i][j] * qs[n];
      }
    }
#pragma unroll
    for (int i = 0; i < MP; ++i) {
      yp[i] = sum_over_tn_in_warp<TP>(yp[i]);
      const int pi = tp + i * TP;
      if (lane < TP && pi < hd) red[warp * hd + pi] = yp[i];
    }
    __syncthreads();
    for (int e = tid; e < hd; e += NT) {
      float s = red[e];
      for (int w = 1; w < W; ++w) s += red[w * hd + e];
      p.y[r * di + h * hd + e] = from_float<T>(s + D * xc[e]);
    }
  }

  float* last = p.h_saved + ((b * (Tn + 1) + Tn) * ds) * di + h * hd;
#pragma unroll
  for (int i = 0; i < MP; ++i)
#pragma unroll
    for (int j = 0; j < MN; ++j) {
      const int pi = tp + i * TP, n = tn + j * TN;
      if (pi < hd && n < ds) {
        last[Idx(n) * di + pi] = H[i][j];
        p.ssm_out[(sb * hd + pi) * ds + n] = H[i][j];
      }
    }
  const int lc = static_cast<int>((Tn - 1) & 1);
  for (int e = tid; e < hd; e += NT) p.v_out[sb * hd + e] = xs[lc * hd + e];
  for (int e = tid; e < ds; e += NT) p.k_out[sb * ds + e] = ks[lc * ds + e];
}

// ---- backward --------------------------------------------------------------------------------
// Iterations t = T, T−1, …, 0. Iteration t streams slot t of h_saved (h_{t−1}) once and uses it
// twice: dα_t = ⟨G, h_{t−1}⟩ (t < T) and the d_q partials of step t−1 (t ≥ 1), so no copy of
// the state other than G stays in registers. Iteration T only produces d_q of step T−1.
// Shared, double-buffered per iteration: dy, x, vp, dyn (= d_y_{t−1}) [2][hd]; K, Q, kp [2][ds];
// cf [2][4] (α, β, γ); carry_k [2][ds] (β Gᵀ v_prev of the step after, read by the lane that
// holds Gᵀ x); red [W][2][hd] (Σ_n G K, Σ_n G k_prev per warp); rs [TN][4] (dα, dβ, dγ per
// segment). Reduce-scatter values v[V] = [d_q_{t−1} (MN) | Gᵀx (MN) | Gᵀv_prev (MN) |
// dα, dβ, dγ | 0 …].
template <int MN, int TP>
__host__ __device__ constexpr int seq_values() {
  return ((3 * MN + 3 + TP - 1) / TP) * TP;
}

template <class T, int TP, int MP, int MN, int NTMAX>
__global__ void __launch_bounds__(NTMAX)
ssm_seq_backward_kernel(SeqGeom g, SsmSeqBwd<T> p) {
  constexpr int V = seq_values<MN, TP>();
  extern __shared__ float sm[];
  const int hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds), TN = g.TN;
  const int NT = TP * TN, W = NT / 32;
  float* dys = sm;               // [2][hd]
  float* xs = dys + 2 * hd;      // [2][hd]
  float* vps = xs + 2 * hd;      // [2][hd]
  float* dyns = vps + 2 * hd;    // [2][hd]
  float* Ks = dyns + 2 * hd;     // [2][ds]
  float* Qs = Ks + 2 * ds;       // [2][ds]
  float* kps = Qs + 2 * ds;      // [2][ds]
  float* ck = kps + 2 * ds;      // [2][ds]
  float* cf = ck + 2 * ds;       // [2][4]
  float* red = cf + 8;           // [W][2][hd]
  float* rs = red + W * 2 * hd;  // [TN][4]
  const int tid = threadIdx.x, tp = tid % TP, tn = tid / TP, lane = tid & 31, warp = tid >> 5;
  const Idx h = blockIdx.x, b = blockIdx.y, sb = b * g.nh + h;
  const Idx Tn = g.T, di = g.di, nh = g.nh;
  const float D = p.d_param[h];

  float G[MP][MN];
#pragma unroll
  for (int i = 0; i < MP; ++i)
#pragma unroll
    for (int j = 0; j < MN; ++j) {
      const int pi = tp + i * TP, n = tn + j * TN;
      G[i][j] = (pi < hd && n < ds) ? p.d_ssm_out[(sb * hd + pi) * ds + n] : 0.0f;
    }
  float carry_x[MP], dD[MP];
#pragma unroll
  for (int i = 0; i < MP; ++i) {
    const int e = tid + i * NT;
    carry_x[i] = e < hd ? p.d_v_out[sb * hd + e] : 0.0f;
    dD[i] = 0.0f;
  }
  const int c0 = static_cast<int>((Tn - 1) & 1);
  for (int e = tid; e < ds; e += NT) ck[c0 * ds + e] = p.d_k_out[sb * ds + e];

  for (Idx t = Tn; t >= 0; --t) {
    const int cur = static_cast<int>(t & 1);
    const bool step = t < Tn, prev = t >= 1;  // block-uniform
    const Idx r = b * Tn + t, i_rh = r * nh + h;
    float* dy = dys + cur * hd;
    float* x = xs + cur * hd;
    float* vp = vps + cur * hd;
    float* dyn = dyns + cur * hd;
    float* K = Ks + cur * ds;
    float* Q = Qs + cur * ds;
    float* kp = kps + cur * ds;
    float* c = cf + cur * 4;
    for (int e = tid; e < hd; e += NT) {
      if (step) {
        dy[e] = to_float(p.d_y[r * di + h * hd + e]);
        x[e] = to_float(p.x[r * g.ldx + h * hd + e]);
        vp[e] = p.v_prev_saved[i_rh * hd + e];
      }
      if (prev) dyn[e] = to_float(p.d_y[(r - 1) * di + h * hd + e]);
    }
    if (step) {
      for (int e = tid; e < ds; e += NT) {
        K[e] = to_float(p.k[i_rh * ds + e]);
        Q[e] = to_float(p.q[i_rh * ds + e]);
        kp[e] = p.k_prev_saved[i_rh * ds + e];
      }
      if (tid == 0) {
        c[0] = p.alpha[i_rh];
        c[1] = p.beta[i_rh];
        c[2] = p.gamma[i_rh];
      }
    }
    __syncthreads();

    float v[V];
#pragma unroll
    for (int k = 0; k < V; ++k) v[k] = 0.0f;
    float gk[MP], gkp[MP], da = 0.0f, db = 0.0f, dg = 0.0f;
    const float* slot = p.h_saved + ((b * (Tn + 1) + t) * ds) * di + h * hd;  // h_{t−1}
#pragma unroll
    for (int i = 0; i < MP; ++i) {
      gk[i] = 0.0f;
      gkp[i] = 0.0f;
      const int pi = tp + i * TP;
      if (pi >= hd) continue;
      const float dyv = step ? dy[pi] : 0.0f, xv = step ? x[pi] : 0.0f;
      const float vv = step ? vp[pi] : 0.0f, dnv = prev ? dyn[pi] : 0.0f;
#pragma unroll
      for (int j = 0; j < MN; ++j) {
        const int n = tn + j * TN;
        if (n >= ds) continue;
        const float hv = slot[Idx(n) * di + pi];
        v[j] += dnv * hv;
        if (step) {
          G[i][j] += dyv * Q[n];
          gk[i] += G[i][j] * K[n];
          gkp[i] += G[i][j] * kp[n];
          v[MN + j] += G[i][j] * xv;
          v[2 * MN + j] += G[i][j] * vv;
          da += G[i][j] * hv;
        }
      }
      db += vv * gkp[i];
      dg += xv * gk[i];
    }
    v[3 * MN] = da;
    v[3 * MN + 1] = db;
    v[3 * MN + 2] = dg;
    const float al = step ? c[0] : 1.0f, be = step ? c[1] : 0.0f, ga = step ? c[2] : 0.0f;
#pragma unroll
    for (int i = 0; i < MP; ++i)
#pragma unroll
      for (int j = 0; j < MN; ++j) G[i][j] *= al;

    reduce_scatter<TP, V>(v);
#pragma unroll
    for (int i = 0; i < MP; ++i) {
      gk[i] = sum_over_tn_in_warp<TP>(gk[i]);
      gkp[i] = sum_over_tn_in_warp<TP>(gkp[i]);
      const int pi = tp + i * TP;
      if (lane < TP && pi < hd) {
        red[(warp * 2) * hd + pi] = gk[i];
        red[(warp * 2 + 1) * hd + pi] = gkp[i];
      }
    }
    const float* ck_in = ck + cur * ds;
    float* ck_out = ck + (cur ^ 1) * ds;
#pragma unroll
    for (int k = 0; k < V / TP; ++k) {
      const int m = scatter_index<TP, V>(tp, k);
      if (m < 3 * MN) {
        const int q = m / MN, j = m % MN, n = tn + j * TN;
        if (n < ds) {
          if (q == 0) {
            if (prev) p.d_q[(i_rh - nh) * ds + n] = v[k];
          } else if (step) {
            if (q == 1) p.d_k[i_rh * ds + n] = ck_in[n] + ga * v[k];
            else ck_out[n] = be * v[k];
          }
        }
      } else if (m < 3 * MN + 3) {
        rs[tn * 4 + (m - 3 * MN)] = v[k];
      }
    }
    __syncthreads();
    if (!step) continue;

#pragma unroll
    for (int i = 0; i < MP; ++i) {
      const int e = tid + i * NT;
      if (e >= hd) continue;
      float sk = red[e], skp = red[hd + e];
      for (int w = 1; w < W; ++w) {
        sk += red[(w * 2) * hd + e];
        skp += red[(w * 2 + 1) * hd + e];
      }
      p.d_x[r * g.ldx + h * hd + e] = from_float<T>(carry_x[i] + D * dy[e] + ga * sk);
      carry_x[i] = be * skp;
      dD[i] += dy[e] * x[e];
    }
    if (tid == 0) {
      float s0 = rs[0], s1 = rs[1], s2 = rs[2];
      for (int q = 1; q < TN; ++q) {
        s0 += rs[q * 4];
        s1 += rs[q * 4 + 1];
        s2 += rs[q * 4 + 2];
      }
      p.d_alpha[i_rh] = s0;
      p.d_beta[i_rh] = s1;
      p.d_gamma[i_rh] = s2;
    }
  }

#pragma unroll
  for (int i = 0; i < MP; ++i)
#pragma unroll
    for (int j = 0; j < MN; ++j) {
      const int pi = tp + i * TP, n = tn + j * TN;
      if (pi < hd && n < ds) p.d_ssm_in[(sb * hd + pi) * ds + n] = G[i][j];
    }
#pragma unroll
  for (int i = 0; i < MP; ++i) {
    const int e = tid + i * NT;
    if (e < hd) {
      p.d_v_in[sb * hd + e] = carry_x[i];
      p.d_d_local[b * di + h * hd + e] = dD[i];
    }
  }
  for (int e = tid; e < ds; e += NT) p.d_k_in[sb * ds + e] = ck[1 * ds + e];  // written at t = 0
}

// d D[h] += Σ_b Σ_p d_d_local[b, h·hd + p], ascending b then p (one thread per head).
__global__ void __launch_bounds__(kThreads)
seq_reduce_d_kernel(Idx B, Idx nh, Idx hd, const float* d_d_local, float* d_d_param) {
  const Idx h = Idx(blockIdx.x) * kThreads + threadIdx.x;
  if (h >= nh) return;
  float acc = 0.0f;
  for (Idx b = 0; b < B; ++b)
    for (Idx q = 0; q < hd; ++q) acc += d_d_local[b * nh * hd + h * hd + q];
  d_d_param[h] += acc;
}

// ---- launch geometry -------------------------------------------------------------------------
// Variant by headdim: TP lanes over p, MP p-rows and MN n-columns per thread, at most NTMAX
// threads. TN = the smallest power of two ≥ ds/MN (at least 32/TP, so blocks are whole warps).
template <int TP_, int MP_, int MN_, int NTMAX_>
struct SeqVariant {
  static constexpr int TP = TP_, MP = MP_, MN = MN_, NTMAX = NTMAX_;
};

const char* const kSeqWhere = "gpu::ssm_seq";

template <class F>
void with_seq_variant(const Dims& d, F&& f) {
  M3_REQUIRE(d.hd >= 1 && d.ds >= 1 && d.nh >= 1 && d.B >= 1 && d.T >= 1, kSeqWhere,
             "bad dims", "B=", d.B, " T=", d.T, " nh=", d.nh, " headdim=", d.hd,
             " d_state=", d.ds);
  M3_REQUIRE(d.hd <= 128 && d.ds <= 128, kSeqWhere, "unsupported SSM shape",
             "headdim=", d.hd, " d_state=", d.ds, " (the GPU scan supports headdim ≤ 128 and "
             "d_state ≤ 128)");
  M3_REQUIRE(d.nh <= 65535 && d.B <= 65535, kSeqWhere, "grid too large", "nheads=", d.nh,
             " B=", d.B, " (each ≤ 65535)");
  M3_REQUIRE(d.di == d.nh * d.hd, kSeqWhere, "d_inner != nheads·headdim", "d_inner=", d.di,
             " nheads=", d.nh, " headdim=", d.hd);
  if (d.hd <= 16) f(SeqVariant<16, 1, 8, 256>{});
  else if (d.hd <= 32) f(SeqVariant<32, 1, 16, 256>{});
  else if (d.hd <= 64) f(SeqVariant<32, 2, 16, 256>{});
  else f(SeqVariant<32, 4, 8, 512>{});
}

template <class Vt>
SeqGeom seq_geom(const Dims& d, Idx ldx) {
  int tn = 1;
  while (Idx(tn) * Vt::MN < d.ds) tn <<= 1;
  tn = std::max(tn, 32 / Vt::TP);
  M3_REQUIRE(Vt::TP * tn <= Vt::NTMAX, kSeqWhere, "unsupported SSM shape", "headdim=", d.hd,
             " d_state=", d.ds);
  return SeqGeom{d.B, d.T, d.nh, d.hd, d.ds, d.di, tn, row_stride(ldx, d.di, kSeqWhere, "x")};
}

}  // namespace

template <class T>
void ssm_seq_forward(cudaStream_t s, const Dims& d, const SsmSeqFwd<T>& p) {
  with_seq_variant(d, [&](auto vt) {
    using Vt = decltype(vt);
    const SeqGeom g = seq_geom<Vt>(d, p.ldx);
    const int nt = Vt::TP * g.TN, w = nt / 32;
    const std::size_t smem = sizeof(float) * (2 * d.hd + 3 * d.ds + 4 + w * d.hd);
    auto kernel = ssm_seq_forward_kernel<T, Vt::TP, Vt::MP, Vt::MN, Vt::NTMAX>;
    opt_in_smem(kernel, smem, kSeqWhere);
    kernel<<<dim3(static_cast<unsigned>(d.nh), static_cast<unsigned>(d.B)), nt, smem, s>>>(g, p);
    M3_LAUNCH_CHECK();
  });
}

template <class T>
void ssm_seq_backward(cudaStream_t s, const Dims& d, const SsmSeqBwd<T>& p, Scratch) {
  with_seq_variant(d, [&](auto vt) {
    using Vt = decltype(vt);
    const SeqGeom g = seq_geom<Vt>(d, p.ldx);
    const int nt = Vt::TP * g.TN, w = nt / 32;
    const std::size_t smem =
        sizeof(float) * (8 * d.hd + 8 * d.ds + 8 + w * 2 * d.hd + g.TN * 4);
    auto kernel = ssm_seq_backward_kernel<T, Vt::TP, Vt::MP, Vt::MN, Vt::NTMAX>;
    opt_in_smem(kernel, smem, kSeqWhere);
    kernel<<<dim3(static_cast<unsigned>(d.nh), static_cast<unsigned>(d.B)), nt, smem, s>>>(g, p);
    M3_LAUNCH_CHECK();
  });
  seq_reduce_d_kernel<<<blocks_for(d.nh, kThreads), kThreads, 0, s>>>(d.B, d.nh, d.hd,
                                                                     p.d_d_local, p.d_d_param);
  M3_LAUNCH_CHECK();
}

#define M3_INSTANTIATE(T)                                                             \
  template void ssm_seq_forward<T>(cudaStream_t, const Dims&, const SsmSeqFwd<T>&);   \
  template void ssm_seq_backward<T>(cudaStream_t, const Dims&, const SsmSeqBwd<T>&, Scratch);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
