// The chunked scan's backward (chunked_detail.cuh has the family's math): B1 (chunk_state in
// backward mode), B2 (state passing of dS), B2b (entering-state gradients), B3 (per chunk: dV,
// dK_mid, dQ_mid, dADT, dQK), dD, step 2's tail (the RoPE backward with the qk terms, and
// B4b's head sums fused in) and step 3 (dDT, d_trap_sig).
#include "chunk_tail.cuh"
#include "chunked_detail.cuh"

namespace m3::gpu {

namespace {

// ---- B2 -------------------------------------------------------------------------------------
// In place on the scratch dS buffer: slot c holds dcontrib_c on entry and dS_c on exit.
__global__ void __launch_bounds__(kThreads)
state_pass_bwd_kernel(ChunkGeom g, const float* da_cumsum, const float* d_ssm_out, float* dS,
                      float* d_ssm_in) {
  const Idx h = blockIdx.y, b = blockIdx.z, sb = b * g.nh + h;
  const Idx e = Idx(blockIdx.x) * kThreads + threadIdx.x, hds = g.hd * g.ds;
  if (e >= hds) return;
  float v = d_ssm_out[sb * hds + e];
  // Chunks descending (pass_chunks walking back, in place).
  const ChunkWalk w(g, b, h, e);
  const Idx last = g.nc - 1;
  float* from = dS + w.state0 + last * w.sstep;
  pass_chunks(static_cast<int>(g.nc), 0, from, from, da_cumsum + w.lam0 + last * w.lstep,
              -w.sstep, -w.lstep, w.last_fix, v);
  d_ssm_in[sb * hds + e] = v;
}

// ---- B2b ------------------------------------------------------------------------------------
// Per (b, h) [grid (nh, B)]: u[p] = Σ_n dS[p,n] k_in[n] (ascending n); d_v_in = sg_{−1}·u;
// d_k_in[n] = sg_{−1}·Σ_p dS[p,n] v_in[p] (ascending p); dScale_{−1} = Σ_p v_in[p]·u[p]
// (ascending p); every sum from +0 as a chain of fmas. dS (hd ≤ 128 rows of ds ≤ 128) comes
// through shared memory, kEgRows rows at a time, in coalesced loads: thread p reading its own
// row of dS from global memory had made every load of a warp touch 32 lines (17 µs at the
// official shape for 8 MB). Thread p < rows sums row p of the tile; thread n < ds carries its
// column sum across the tiles.
constexpr int kEgRows = 64;
template <class T>
__global__ void __launch_bounds__(kThreads)
entering_grad_kernel(ChunkGeom g, SsmChunkBwd<T> p, float* dscale_prev) {
  __shared__ float u[128];
  __shared__ float tile[kEgRows][128 + 1];  // +1: the rows of a warp's threads in distinct banks
  const Idx h = blockIdx.x, b = blockIdx.y, sb = b * g.nh + h;
  const Idx i0 = (b * g.T) * g.nh + h;
  const int hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds), tx = threadIdx.x;
  const float sgm1 = p.dt[i0] * (1.0f - p.trap[i0]);
  const float* dS = p.d_ssm_in + sb * g.hd * g.ds;
  const float* kin = p.k_in + sb * g.ds;
  const float* vin = p.v_in + sb * g.hd;
  float col = 0.0f;  // thread n < ds: Σ_p dS[p,n] v_in[p] over the tiles so far
  for (int q0 = 0; q0 < hd; q0 += kEgRows) {
    const int rows = min(kEgRows, hd - q0);
    __syncthreads();  // the previous tile is consumed
    for (int e = tx; e < rows * ds; e += kThreads) tile[e / ds][e % ds] = dS[q0 * ds + e];
    __syncthreads();
    if (tx < rows) {
      float s = 0.0f;
      for (int n = 0; n < ds; ++n) s = __fmaf_rn(tile[tx][n], kin[n], s);
      u[q0 + tx] = s;
      p.d_v_in[sb * g.hd + q0 + tx] = sgm1 * s;
    }
    if (tx < ds)
      for (int k = 0; k < rows; ++k) col = __fmaf_rn(tile[k][tx], vin[q0 + k], col);
  }
  if (tx < ds) p.d_k_in[sb * g.ds + tx] = sgm1 * col;
  __syncthreads();
  if (tx == 0) {
    float s = 0.0f;
    for (int q = 0; q < hd; ++q) s = __fmaf_rn(vin[q], u[q], s);
    dscale_prev[sb] = s;
  }
}

// ---- B3 -------------------------------------------------------------------------------------
// Per (b, h, c) [grid (nc, nh, B)], the chunk in row tiles (nt_c of them).
//  Phase A, per tile J (target side): dQ_mid = e^{cum}·(dO S) → global; dADT = e^{cum}(dO S)·Q;
//    dQK = dO·x.
//  Phase B, per source tile I: registers dV, dK_mid [kBR][RH|RD] start at the dS / diagonal
//    terms (dADT −= M_s); then for every target tile J ≥ I: A, P → MA, MP (shared);
//    dADT[t] += Σ_s W (row sums), colsum[s] += Σ_t W; dQ_mid[J] += MP Ks_I (read-modify-write
//    by its single owner thread); dV += MAᵀ dO_J, dK_mid += MPᵀ Q_J. At the end: d_x (+ d_v_out
//    at t = T−1), dK_mid stored, dADT[s] −= colsum[s].
//  Phase C: M_sc = e^{Λ}⟨S, dS⟩ (block_sum); reverse cumsum of dADT from M_sc + Σ_t M_t
//    (thread 0, serial over the staged tile).
// Shared: Qs [kTR][LDD] (Q_J), Os [kTR][LDH] (dO_J), Ks [kTR][LDD] (Ks_I), Xs [kTR][LDH] (X_I),
// MA, MP [kTR][kLM] (also the S / dS slices), cumJ, cumI, colsum, mrow [kTR],
// colred [16][kTR], red [32], scalars; typed runs: Cs, the product tile of mm.
// Threads: kBwdThreads = 512 as a 32 × 16 grid (rows tm + 32i, i < kBR; columns tn + 16j; the
// [kTR][kTR] tiles A, P: columns tn + 16j, j < kCM).
template <class T, int RH, int RD>
__global__ void __launch_bounds__(kBwdThreads, 1)
chunk_bwd_kernel(ChunkGeom g, SsmChunkBwd<T> p, const float* dS_all) {
  constexpr int HP = 16 * RH, DP = 16 * RD, LDH = HP + 4, LDD = DP + 4;
  constexpr int NT = kBwdThreads, kCM = kTR / 16, kWarpsB = NT / 32;
  extern __shared__ float sm[];
  float* Qs = sm;
  float* Os = Qs + kTR * LDD;
  float* Ks = Os + kTR * LDH;
  float* Xs = Ks + kTR * LDD;
  float* MA = Xs + kTR * LDH;
  float* MP = MA + kTR * kLM;
  float* Sl = MA;  // slices alias MA/MP (never live at the same time)
  float* cumJ = MP + kTR * kLM;
  float* cumI = cumJ + kTR;
  float* colsum = cumI + kTR;
  float* mrow = colsum + kTR;
  float* colred = mrow + kTR;         // [kWarpsB][kTR]
  float* red = colred + kWarpsB * kTR;  // [32]
  float* scal = red + 32;         // [0] Σ M_t, [1] running sum
  float* Cs = scal + 4;           // typed runs: [kTR][ld_c(max(RH, RD, kCM))] product tile
  const int tid = threadIdx.x, tm = tid >> 4, tn = tid & 15, warp = tid >> 5;
  const Idx c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int L = g.len(c), hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  const int nt = (L + kTR - 1) / kTR;
  const Idx row0 = b * g.T + g.t0(c), nh = g.nh, di = g.di, kst = g.nh * g.ds;
  const Idx sb = b * nh + h;
  const float* cum = p.da_cumsum_saved + g.cum_base(b, c, h);
  const float Lam = cum[L - 1];
  const float* S = p.chunk_states_saved + g.state_base(b, c, h);
  const float* dS = dS_all + g.state_base(b, c, h);
  const float D = p.d_param[h];
  if (tid == 0) scal[0] = 0.0f;

  auto load_target = [&](int J) {
    const int n = min(kTR, L - J * kTR);
    const Idx r = row0 + J * kTR;
    load_tile<DP, LDD, NT>(Qs, p.q + (r * nh + h) * ds, kst, n, ds);
    load_tile<HP, LDH, NT>(Os, p.d_y + r * di + h * hd, di, n, hd);
    if (tid < kTR) cumJ[tid] = tid < n ? cum[J * kTR + tid] : 0.0f;
  };

  // ---- phase A
  for (int J = 0; J < nt; ++J) {
    const int nJ = min(kTR, L - J * kTR);
    const Idx r = row0 + J * kTR;
    __syncthreads();
    load_target(J);
    load_tile<HP, LDH, NT>(Xs, p.x + r * g.ldx + h * hd, g.ldx, nJ, hd);
    float acc[kBR][RD];
    zero(acc);
    for (int p0 = 0; p0 < hd; p0 += kNK) {
      __syncthreads();
      load_pslice<DP, LDD, NT>(Sl, S, hd, ds, p0);
      __syncthreads();
      mm<T, true, false, kBR, RD, LDH, 1, LDD, 1>(acc, Os + p0, Sl, min(kNK, hd - p0), tm, tn, Cs);
    }
#pragma unroll
    for (int i = 0; i < kBR; ++i) {
      const int t = tm + kBwdRows * i;
      const float e = expf(cumJ[t]);
      float rx = 0.0f, qk = 0.0f;
#pragma unroll
      for (int j = 0; j < RD; ++j) {
        const int n = tn + 16 * j;
        rx += acc[i][j] * Qs[t * LDD + n];
        if (t < nJ && n < ds) p.dQ_mid[((r + t) * nh + h) * ds + n] = e * acc[i][j];
      }
#pragma unroll
      for (int j = 0; j < RH; ++j) {
        const int q = tn + 16 * j;
        qk += Os[t * LDH + q] * Xs[t * LDH + q];
      }
      rx = row16_sum(rx);
      qk = row16_sum(qk);
      if (tn == 0 && t < nJ) {
        p.dADT[(r + t) * nh + h] = e * rx;
        p.dQK_dot[(r + t) * nh + h] = qk;
      }
    }
  }

  // ---- phase B
  for (int I = 0; I < nt; ++I) {
    const int nI = min(kTR, L - I * kTR);
    const Idx rI = row0 + I * kTR;
    __syncthreads();
    if (nt > 1) load_target(I);  // with one tile, phase A left Q_0, dO_0 (and X_0) in place
    load_tile<DP, LDD, NT>(Ks, p.k_scaled_saved + (rI * nh + h) * ds, kst, nI, ds);
    if (nt > 1) load_tile<HP, LDH, NT>(Xs, p.x + rI * g.ldx + h * hd, g.ldx, nI, hd);
    if (tid < kTR) {
      cumI[tid] = tid < nI ? cum[I * kTR + tid] : 0.0f;
      colsum[tid] = 0.0f;
    }
    float dV[kBR][RH], dK[kBR][RD];
    zero(dV);
    zero(dK);
    for (int n0 = 0; n0 < ds; n0 += kNK) {  // dV = Ks dSᵀ
      __syncthreads();
      load_nslice<HP, NT>(Sl, dS, hd, ds, n0);
      __syncthreads();
      mm<T, true, false, kBR, RH, LDD, 1, 1, kLS>(dV, Ks + n0, Sl, min(kNK, ds - n0), tm, tn, Cs);
    }
    for (int p0 = 0; p0 < hd; p0 += kNK) {  // dK = X dS
      __syncthreads();
      load_pslice<DP, LDD, NT>(Sl, dS, hd, ds, p0);
      __syncthreads();
      mm<T, true, false, kBR, RD, LDH, 1, LDD, 1>(dK, Xs + p0, Sl, min(kNK, hd - p0), tm, tn, Cs);
    }
#pragma unroll
    for (int i = 0; i < kBR; ++i) {
      const int s = tm + kBwdRows * i;
      const float e = expf(Lam - cumI[s]);
      const float dq = s < nI ? D + p.qk_dot_saved[(rI + s) * nh + h] : 0.0f;
      float m = 0.0f;
#pragma unroll
      for (int j = 0; j < RD; ++j) m += dK[i][j] * Ks[s * LDD + tn + 16 * j];
      m = e * row16_sum(m);
#pragma unroll
      for (int j = 0; j < RD; ++j) dK[i][j] *= e;
#pragma unroll
      for (int j = 0; j < RH; ++j) dV[i][j] = e * dV[i][j] + dq * Os[s * LDH + tn + 16 * j];
      if (tn == 0) {
        mrow[s] = s < nI ? m : 0.0f;
        if (s < nI) p.dADT[(rI + s) * nh + h] -= m;
      }
    }
    __syncthreads();
    if (tid == 0) {
      float ms = scal[0];
      for (int s = 0; s < nI; ++s) ms += mrow[s];
      scal[0] = ms;
    }

    for (int J = I; J < nt; ++J) {
      const int nJ = min(kTR, L - J * kTR);
      const Idx rJ = row0 + J * kTR;
      if (J > I) {
        __syncthreads();
        load_target(J);
        __syncthreads();
      }
      float A[kBR][kCM], P[kBR][kCM];
      zero(A);
      zero(P);
      mm<T, true, true, kBR, kCM, LDD, 1, 1, LDD>(A, Qs, Ks, ds, tm, tn, Cs);
      mm<T, true, true, kBR, kCM, LDH, 1, 1, LDH>(P, Os, Xs, hd, tm, tn, Cs);
      float cpart[kCM];
#pragma unroll
      for (int j = 0; j < kCM; ++j) cpart[j] = 0.0f;
#pragma unroll
      for (int i = 0; i < kBR; ++i) {
        const int t = tm + kBwdRows * i;
        float rpart = 0.0f;
#pragma unroll
        for (int j = 0; j < kCM; ++j) {
          const int s = tn + 16 * j;
          const bool on = t < nJ && s < nI && I * kTR + s < J * kTR + t;
          const float dec = on ? expf(cumJ[t] - cumI[s]) : 0.0f;
          const float mp = dec * P[i][j];
          MA[t * kLM + s] = dec * A[i][j];
          MP[t * kLM + s] = mp;
          const float wv = mp * A[i][j];
          rpart += wv;
          cpart[j] += wv;
        }
        rpart = row16_sum(rpart);
        if (tn == 0 && t < nJ) p.dADT[(rJ + t) * nh + h] += rpart;
      }
#pragma unroll
      for (int j = 0; j < kCM; ++j) {
        const float v = cpart[j] + __shfl_xor_sync(0xffffffffu, cpart[j], 16);
        if ((tid & 31) < 16) colred[warp * kTR + tn + 16 * j] = v;
      }
      __syncthreads();
      if (tid < kTR) {
        float cs = colred[tid];
        for (int w = 1; w < kWarpsB; ++w) cs += colred[w * kTR + tid];
        colsum[tid] += cs;
      }
      float dq[kBR][RD];
      zero(dq);
      mm<T, false, true, kBR, RD, kLM, 1, LDD, 1>(dq, MP, Ks, nI, tm, tn, Cs);
#pragma unroll
      for (int i = 0; i < kBR; ++i) {
        const int t = tm + kBwdRows * i;
        if (t >= nJ) continue;
        float* o = p.dQ_mid + ((rJ + t) * nh + h) * ds;
#pragma unroll
        for (int j = 0; j < RD; ++j) {
          const int n = tn + 16 * j;
          if (n < ds) o[n] += dq[i][j];
        }
      }
      mm<T, false, true, kBR, RH, 1, kLM, LDH, 1>(dV, MA, Os, nJ, tm, tn, Cs);
      mm<T, false, true, kBR, RD, 1, kLM, LDD, 1>(dK, MP, Qs, nJ, tm, tn, Cs);
      __syncthreads();
    }

#pragma unroll
    for (int i = 0; i < kBR; ++i) {
      const int s = tm + kBwdRows * i;
      if (s >= nI) continue;
      const Idx r = rI + s;
      const bool last = g.t0(c) + I * kTR + s == g.T - 1;
#pragma unroll
      for (int j = 0; j < RH; ++j) {
        const int q = tn + 16 * j;
        if (q < hd)
          p.d_x[r * g.ldx + h * hd + q] =
              from_float<T>(last ? dV[i][j] + p.d_v_out[sb * hd + q] : dV[i][j]);
      }
#pragma unroll
      for (int j = 0; j < RD; ++j) {
        const int n = tn + 16 * j;
        if (n < ds) p.dK_mid[(r * nh + h) * ds + n] = dK[i][j];
      }
    }
    if (tid < nI) p.dADT[(rI + tid) * nh + h] -= colsum[tid];
  }

  // ---- phase C
  float part = 0.0f;
#pragma unroll 8
  for (Idx e = tid; e < g.hd * g.ds; e += NT) part += S[e] * dS[e];
  const float msc = expf(Lam) * block_sum(part, red);
  if (tid == 0) scal[1] = msc + scal[0];
  for (int I = nt - 1; I >= 0; --I) {
    const int nI = min(kTR, L - I * kTR);
    float* o = p.dADT + (row0 + I * kTR) * nh + h;
    __syncthreads();
    if (tid < nI) mrow[tid] = o[tid * nh];
    __syncthreads();
    if (tid == 0) {
      float run = scal[1];
      for (int k = nI - 1; k >= 0; --k) mrow[k] = (run += mrow[k]);
      scal[1] = run;
    }
    __syncthreads();
    if (tid < nI) o[tid * nh] = mrow[tid];
  }
}

// ---- dD -------------------------------------------------------------------------------------
// dD_partials[b, h] = Σ_t dQK_dot (threads stride over t, then block_sum); grid (nh, B).
__global__ void __launch_bounds__(kThreads)
dd_partials_kernel(Idx T, Idx nh, const float* dQK, float* dD_partials) {
  __shared__ float red[32];
  const Idx h = blockIdx.x, b = blockIdx.y;
  float s = 0.0f;
  for (Idx t = threadIdx.x; t < T; t += kThreads) s += dQK[(b * T + t) * nh + h];
  s = block_sum(s, red);
  if (threadIdx.x == 0) dD_partials[b * nh + h] = s;
}

// d D[h] += Σ_b dD_partials[b, h], ascending b (one thread per head).
__global__ void __launch_bounds__(kThreads)
dd_reduce_kernel(Idx B, Idx nh, const float* dD_partials, float* d_d_param) {
  const Idx h = Idx(blockIdx.x) * kThreads + threadIdx.x;
  if (h >= nh) return;
  float acc = 0.0f;
  for (Idx b = 0; b < B; ++b) acc += dD_partials[b * nh + h];
  d_d_param[h] += acc;
}

// ---- step 2: dqktheta, the RoPE backward and (optionally) B4b's head sums, fused -----------------
// A block takes kTailRows = kTailWarps·kTailRowsPerWarp consecutive rows r and every head; warp w
// the kTailRowsPerWarp consecutive rows from r0 + w·kTailRowsPerWarp, lane l the pairs p = l and
// p = l + 32 (values n = 2p, 2p + 1; ds ≤ 128). With na = 32 (the official RoPE half) every
// lane then rotates one pair and copies one (with 4 consecutive values per lane, half the
// lanes of a warp carried the rotated work: sincosf and four rotations). The warp walks the
// heads in ascending order and, for each head, its rows in ascending order. Without
// kRecompute the loads of the next (r, h) are issued before the arithmetic of this one (two
// sets of inputs in registers). kRecompute: what every (r, h) of a warp shares comes once, by
// cp.async into the warp's shared memory: its rows' b/c_normed once per group (every head of a
// group reads the same rows) and their scale, dQK, γ once per 32 heads (loaded per item, they
// hold its first arithmetic on three scalar loads: 4 % at the official shape); each item's own
// θ, dK_mid and dQ_mid come through a per-warp ring of cp.async stages, kTailRing − 1 items
// ahead.
// The head sums live in registers, so there is no consumer warp, row buffer or per-row barrier,
// and the shared memory does not grow with nh. At 128 registers, 16 warps per SM, the kernel
// is latency-bound at the official shape; fewer registers for more warps spill.
// Per (r, h), with the lane's values in 8-byte (f32) / 4-byte (T) accesses
// when kVec (ds even, aligned rows), else element by element; kFull: ds = 128, every lane's
// pairs inside the row (no bounds tests), and na = 32 (pair lane rotated, lane + 32 not, known
// when compiling: chunk_tail.cuh pair_rotated):
//   dv1 = scale·dK_mid (+ d_k_out at t = T−1), dv2 = dQ_mid, e = dQK·γ;
//   rotated pair (p < na, angle θ_p = theta[r, h, p], R its rotation):
//     d_b_pre_rope = Rᵀdv1 + e·c_biased, d_c_pre_rope = Rᵀdv2 + e·b_biased,
//     d_angle_cumsum_p = (−dv1_{2p}·k_{2p+1} + dv1_{2p+1}·k_{2p})
//                        + (−dv2_{2p}·q_{2p+1} + dv2_{2p+1}·q_{2p});
//   other pairs (p ≥ na, and the lone last value when ds is odd): the same without R;
//   dScale = Σ_n dK_mid·k, dGamma = dQK·Σ_n c_biased·b_biased (the lane's values in the order
//   n = 2l, 2l + 1, 2l + 64, 2l + 65; then both sums over the warp in one butterfly: lanes < 16
//   add the dScale partial of lane + 16 and lanes ≥ 16 the qk partial of lane − 16, then each
//   half-warp xor-sums its value over 8, 4, 2, 1).
// The formulas of rope_backward (rope.cu) with the qk extra; dv1 is never stored and dK_mid, k,
// c, b are read once.
// kRecompute: b_biased, c_biased, k, q are not read but recomputed, bit for bit the values F4 and
// F4ef stored: X_biased = T(float(X_normed[r, g(h)]) + X_bias[h]) (bcnorm.cu), k and q their
// T-rounded rotations by θ (rope_rotate, whose products and sums are pinned to the same
// roundings in every kernel). Reads [BT, ng, ds] instead of four [BT, nh, ds] tensors.
// kFuse (B4b, MODEL.md §6.2, done while d_X_pre_rope is in registers):
//   d_X_normed[r,g,n] = T( Σ_{h: g(h)=g} d_X_pre_rope[r,h,n] )   (ascending h from 0.0f: the
//   value bcnorm_backward_kernel computes) — each lane adds its rows' values head by head in
//   registers and stores the sums after the group's last head;
//   part_X[block, h·ds + n] = Σ_w ( Σ_ρ d_X_pre_rope[r0 + w·kTailRowsPerWarp + ρ, h, n] )   (ρ
//   ascending in the warp's registers, then w ascending through shared memory, where the warps'
//   sums are double-buffered by the head's parity: one __syncthreads per head; the buffer of
//   head h is rewritten at head h + 2, after the barrier of head h + 1, which every thread
//   reaches only once it has summed head h). The launcher sums part_X over the blocks with
//   colsum_rows (a fixed order) into d X_bias.
// d_X_pre_rope are stored when the pointers are set (capture, isolated mode, unfused runs).
constexpr int kTailWarps = 8;
constexpr int kTailThreads = 32 * kTailWarps;
constexpr int kTailRowsPerWarp = 4;
constexpr Idx kTailRows = Idx(kTailWarps) * kTailRowsPerWarp;  // the bias partial sums' rows
static_assert(kTailRowsPerWarp % 2 == 0, "the two input sets alternate within a head");
// kRecompute: stages of the warp's item ring (kTailRing − 1 items in flight), kTailStage floats
// each: θ [2][32], dK_mid and dQ_mid [2][32][2]. Six stages (104 KB per block, still two per
// SM) measured slower: the official tail 539 → 551 µs (bf16), 579 → 595 (f16).
constexpr int kTailRing = 4;
constexpr int kTailStage = 2 * 32 + 2 * 2 * 32 * 2;
static_assert(kTailThreads >= 2 * 128, "one summing thread per (X, n) of a head, ds ≤ 128");


template <class T, bool kRecompute, bool kFuse, bool kVec, bool kFull>
__global__ void __launch_bounds__(kTailThreads, 2)
qk_rope_bwd_kernel(TailGeom tg, TailArgs<T> a, float* part_b, float* part_c) {
  constexpr int R = kTailRowsPerWarp;
  // kFuse: [2 parities][kTailWarps][b, c][ds] floats; then kRecompute: [kTailWarps][R][3][32]
  // floats (the warp's per-(r, h) scalars, below) and [kTailWarps][R][b, c][ds] values of T (the
  // warp's rows of b/c_normed, group g).
  extern __shared__ float tail_smem[];
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned nh = tg.nh, ds = tg.ds, nhds = nh * ds;
  float* const staged = tail_smem + (kFuse ? 2 * kTailWarps * 2 * ds : 0);  // kRecompute's
  float* const ss = staged + warp * (R * 3 * 32);
  T* const xs = reinterpret_cast<T*>(staged + kTailWarps * R * 3 * 32) + warp * (R * 2 * ds);
  // kRecompute: the warp's ring of kTailRing item stages after the xs of every warp (8-byte
  // aligned: the regions before it are multiples of 8 bytes), each θ [2][32], dK_mid, dQ_mid
  // [2][32][2] floats (lane l's pairs p = l, l + 32).
  float* const stages =
      reinterpret_cast<float*>(reinterpret_cast<T*>(staged + kTailWarps * R * 3 * 32) +
                               kTailWarps * R * 2 * ds) +
      warp * (kTailRing * kTailStage);
  const unsigned rw = blockIdx.x * unsigned(kTailRows) + warp * unsigned(R);  // the warp's rows
  const unsigned nr = rw < tg.rows ? (tg.rows - rw < unsigned(R) ? tg.rows - rw : R) : 0;
  bool last[R];  // t = T − 1 at row rw + ρ
  {
    unsigned t = static_cast<unsigned>((tg.r_base + rw) % tg.T);
#pragma unroll
    for (int q = 0; q < R; ++q, t = t + 1 == tg.T ? 0 : t + 1) last[q] = t == tg.T - 1;
  }
  float sum_b[R][4], sum_c[R][4];  // kFuse: Σ over the current group's heads so far
#pragma unroll
  for (int q = 0; q < R; ++q)
#pragma unroll
    for (int v = 0; v < 4; ++v) sum_b[q][v] = sum_c[q][v] = 0.0f;
  // The biases of the head (kRecompute), and the inputs of (rw + ρ, h) in in[ρ % 2]. Without
  // kRecompute the set of the next (r, h) is loaded before this one's arithmetic (a warp with
  // an odd number of rows, only at the end of the rows, loads each (r, h) just before its
  // arithmetic instead); with it, they come from the warp's item ring (below).
  float ab[4] = {0.0f, 0.0f, 0.0f, 0.0f}, ac[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  TailIn in[2];
  const bool ring = nr % 2 == 0;
  if (nr > 0) {
    if constexpr (kRecompute) {
      pair_load<kVec, kFull>(a.b_bias, 0, lane, ds, ab);
      pair_load<kVec, kFull>(a.c_bias, 0, lane, ds, ac);
    } else {
      if (ring) tail_load<T, kVec, kFull>(tg, a, rw, 0, lane, in[0]);
    }
  }
  // kRecompute: item j = h·nr + ρ's θ, dK_mid, dQ_mid go into ring stage j mod kTailRing by
  // cp.async, kTailRing − 1 items ahead of their arithmetic, one cp.async group per item
  // (empty past the last). A register prefetch one item ahead does not hide their latency (ncu:
  // long-scoreboard stalls on the first use of a value whose scoreboard the compiler shares
  // with the next item's loads); the copies are tracked by their groups, not by
  // registers. Each lane reads back only its own slots: no barrier between lanes.
  const unsigned items = nr * nh;
  auto issue = [&](unsigned j) {
    if (j < items) {
      // j's head and row: nr is R (a power of two) but in the last warp of the rows.
      const unsigned hj = nr == unsigned(R) ? j / unsigned(R) : j / nr, q = j - hj * nr;
      const unsigned i = (rw + q) * nh + hj, base = i * ds;
      float* const st = stages + (j % kTailRing) * kTailStage;
#pragma unroll
      for (unsigned k = 0; k < 2; ++k) {
        const unsigned p = lane + 32 * k, n = 2 * p;
        const bool rot = pair_rotated<kFull>(k, lane, tg.na);
        cp_async_zfill<4>(st + k * 32 + lane, rot ? a.theta + i * tg.na + p : a.dK_mid, rot);
        float* const dk = st + 64 + k * 64 + 2 * lane;
        float* const dq = dk + 128;
        if constexpr (kVec) {  // ds even, rows 8-byte aligned: a pair is one copy
          const bool in_row = kFull || n < ds;
          cp_async_zfill<8>(dk, in_row ? a.dK_mid + base + n : a.dK_mid, in_row);
          cp_async_zfill<8>(dq, in_row ? a.dQ_mid + base + n : a.dK_mid, in_row);
        } else {
#pragma unroll
          for (unsigned e = 0; e < 2; ++e) {
            const bool in_row = n + e < ds;
            cp_async_zfill<4>(dk + e, in_row ? a.dK_mid + base + n + e : a.dK_mid, in_row);
            cp_async_zfill<4>(dq + e, in_row ? a.dQ_mid + base + n + e : a.dK_mid, in_row);
          }
        }
      }
    }
    cp_async_commit();
  };
  if constexpr (kRecompute) {
#pragma unroll
    for (unsigned j = 0; j + 1 < unsigned(kTailRing); ++j) issue(j);
  }
  // kRecompute: the per-(r, h) scalars of the warp's rows for heads h32 … h32 + 31 in ss
  // (ss[ρ][k][l] = scale, dQK, γ (k = 0, 1, 2) of (rw + ρ, h32 + l)) and the rows' b/c_normed of
  // the current group in xs, copied by cp.async once per 32 heads / per group instead of loaded
  // once per (r, h): every head of a group reads the same b/c_normed rows, and the item's
  // first arithmetic would wait on its 3 scalar loads (ncu). The same values: the same bits.
  unsigned g = 0, in_group = 0;
  for (unsigned h = 0; h < nh; ++h) {
    float pb[4] = {0.0f, 0.0f, 0.0f, 0.0f}, pc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    // Two rows' butterflies at a time (tail_item's first level, then tail_sums_finish, whose
    // shuffles then overlap; all four rows' at once spilled 16 B at the official shape), and
    // their dQK.
    float hs[2] = {0.0f, 0.0f}, hq[2] = {0.0f, 0.0f};
    const unsigned g_next = in_group + 1 == tg.hpg ? g + 1 : g;  // g(h + 1)
    if constexpr (kRecompute) {
      const bool scalars = h % 32 == 0, rows = in_group == 0;
      if (nr > 0 && (scalars || rows)) __syncwarp();  // every lane is done with the old values
      if (nr > 0 && scalars) {
        const unsigned hl = h + lane;
#pragma unroll
        for (int q = 0; q < R; ++q) {
          if (unsigned(q) < nr && hl < nh) {
            const unsigned i = (rw + q) * nh + hl;
            cp_async4(ss + (q * 3 + 0) * 32 + lane, a.scale_saved + i);
            cp_async4(ss + (q * 3 + 1) * 32 + lane, a.dQK_dot + i);
            cp_async4(ss + (q * 3 + 2) * 32 + lane, a.gamma_saved + i);
          }
        }
      }
      if (nr > 0 && rows) {  // group g's first head: its rows into xs, xs[ρ][X][n]
        // 4-byte words by cp.async, all in flight at once: f32 values, or pairs of 16-bit
        // values (kVec: ds even, rows aligned to pairs); else 16-bit values one by one.
        constexpr bool kWords = kVec || sizeof(T) == 4;
        constexpr unsigned kPer = kWords ? 4 / sizeof(T) : 1;  // values per copy
        const unsigned wr = ds / kPer, w2 = 2 * wr;              // copies per row, per ρ
        for (unsigned e = lane; e < nr * w2; e += 32) {
          const unsigned q = e / w2, x = e - q * w2, is_c = x >= wr;
          const unsigned n = (is_c ? x - wr : x) * kPer;
          const T* src = (is_c ? a.c_normed : a.b_normed) + ((rw + q) * tg.ng + g) * ds + n;
          T* dst = xs + q * 2 * ds + (is_c ? ds : 0) + n;
          if constexpr (kWords) {
            cp_async4(dst, src);
          } else {
            *dst = *src;
          }
        }
      }
      if (nr > 0 && (scalars || rows)) {
        cp_async_wait_all();
        __syncwarp();
      }
    }
#pragma unroll
    for (int q = 0; q < R; ++q) {
      if (unsigned(q) >= nr) continue;
      // Prefetch: (rw + q + 1, h), or (rw, h + 1) after the warp's last row (into in[0]: nr is
      // even).
      if constexpr (!kRecompute) {
        if (!ring) {
          tail_load<T, kVec, kFull>(tg, a, rw + q, h, lane, in[q % 2]);
        } else if (unsigned(q) + 1 < nr) {
          tail_load<T, kVec, kFull>(tg, a, rw + q + 1, h, lane, in[(q + 1) % 2]);
        } else if (h + 1 < nh) {
          tail_load<T, kVec, kFull>(tg, a, rw, h + 1, lane, in[(q + 1) % 2]);
        }
      }
      if constexpr (kRecompute) {
        TailIn& cur = in[q % 2];
        const unsigned j = h * nr + q;
        issue(j + kTailRing - 1);
        cp_async_wait_group<kTailRing - 1>();  // item j's group has landed
        const float* const st = stages + (j % kTailRing) * kTailStage;
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          cur.th[k] = st[k * 32 + lane];
          const float2 dk = *reinterpret_cast<const float2*>(st + 64 + k * 64 + 2 * lane);
          const float2 dq = *reinterpret_cast<const float2*>(st + 192 + k * 64 + 2 * lane);
          cur.dk[2 * k] = dk.x, cur.dk[2 * k + 1] = dk.y;
          cur.g2[2 * k] = dq.x, cur.g2[2 * k + 1] = dq.y;
        }
        cur.sc = ss[(q * 3 + 0) * 32 + h % 32];
        cur.dqk = ss[(q * 3 + 1) * 32 + h % 32];
        cur.gam = ss[(q * 3 + 2) * 32 + h % 32];
        pair_load<kVec, kFull>(xs, q * 2 * ds, lane, ds, cur.x1);
        pair_load<kVec, kFull>(xs, q * 2 * ds + ds, lane, ds, cur.x2);
      }
      float db[4], dc[4];
      hq[q % 2] = in[q % 2].dqk;
      tail_item<T, kRecompute, kVec, kFull>(tg, a, rw + q, h, lane, last[q], in[q % 2], ab, ac,
                                            db, dc, hs[q % 2]);
      if (q % 2 == 1) tail_sums_finish<2>(hs, hq, 2, rw + q - 1, h, nh, lane, a.dScale, a.dGamma);
      if constexpr (kFuse) {
#pragma unroll
        for (int v = 0; v < 4; ++v) {
          sum_b[q][v] += db[v];
          sum_c[q][v] += dc[v];
          pb[v] += db[v];
          pc[v] += dc[v];
        }
      }
    }
    if (nr % 2 == 1)  // the rows' last warp, with an odd count: its last row alone
      tail_sums_finish<2>(hs, hq, 1, rw + nr - 1, h, nh, lane, a.dScale, a.dGamma);
    if (kRecompute && nr > 0 && h + 1 < nh) {  // the next head's biases
      pair_load<kVec, kFull>(a.b_bias, (h + 1) * ds, lane, ds, ab);
      pair_load<kVec, kFull>(a.c_bias, (h + 1) * ds, lane, ds, ac);
    }
    if constexpr (kFuse) {
      if (++in_group == tg.hpg) {  // the group's last head: its sums are complete
#pragma unroll
        for (int q = 0; q < R; ++q) {
          if (unsigned(q) < nr) {
            const unsigned gn = ((rw + q) * tg.ng + g) * ds;
            pair_store<kVec, kFull>(a.d_b_normed, gn, lane, ds, sum_b[q]);
            pair_store<kVec, kFull>(a.d_c_normed, gn, lane, ds, sum_c[q]);
          }
#pragma unroll
          for (int v = 0; v < 4; ++v) sum_b[q][v] = sum_c[q][v] = 0.0f;
        }
        in_group = 0;
      }
      float* slot = tail_smem + (h & 1) * (kTailWarps * 2 * ds);
      pair_store<false, false>(slot + warp * 2 * ds, 0, lane, ds, pb);
      pair_store<false, false>(slot + warp * 2 * ds, ds, lane, ds, pc);
      __syncthreads();
      if (threadIdx.x < 2 * ds) {  // (X, n) = (b or c, n): Σ over the warps, ascending
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < kTailWarps; ++w) s += slot[w * 2 * ds + threadIdx.x];
        const bool is_c = threadIdx.x >= ds;
        const unsigned n = is_c ? threadIdx.x - ds : threadIdx.x;
        (is_c ? part_c : part_b)[Idx(blockIdx.x) * nhds + h * ds + n] = s;
      }
    } else {
      if (++in_group == tg.hpg) in_group = 0;
    }
    g = g_next;
  }
}

// ---- step 3 ---------------------------------------------------------------------------------
template <class T>
__global__ void __launch_bounds__(kThreads)
ddt_dtrap_kernel(ChunkGeom g, SsmChunkBwd<T> p, const float* dscale_prev) {
  const Idx rows = g.B * g.T * g.nh, stride = Idx(gridDim.x) * kThreads;
  for (Idx i = Idx(blockIdx.x) * kThreads + threadIdx.x; i < rows; i += stride) {
    const Idx r = i / g.nh, h = i % g.nh, t = r % g.T;
    const float prev = t > 0 ? p.dScale[i - g.nh] : dscale_prev[(r / g.T) * g.nh + h];
    const float own = p.dGamma[i] + p.dScale[i];
    const float trap = p.trap[i];
    const float ddt = own * trap + prev * (1.0f - trap);
    p.dDT[i] = ddt;
    p.d_trap_sig[i] = (own - prev) * p.dt[i];
    p.d_dt_direct[i] = ddt;
    p.d_adt_total[i] = p.dADT[i];
  }
}

// The step-2 partial column sums (kFuse) reuse dS's space: dS is dead once B3 has run.
Idx tail_blocks(const Dims& d) { return (d.BT + kTailRows - 1) / kTailRows; }
// part_b, part_c [tail_blocks, nh·ds], then colsum_rows' own scratch for their column sums.
Idx tail_partials(const Dims& d) { return round64(tail_blocks(d) * d.nh * d.ds); }
Idx tail_colsum_scratch(const Dims& d) {
  return round64(colsum_pair_scratch_floats(tail_blocks(d), d.nh * d.ds));
}
Idx first_region(const Dims& d) {
  return std::max(round64(d.B * d.nc * d.nh * d.hd * d.ds),
                  2 * tail_partials(d) + tail_colsum_scratch(d));
}
// kFuse: the warps' per-head sums of the bias partials, double-buffered (≤ 16 KB at ds ≤ 128).
std::size_t tail_smem_bytes(const Dims& d, bool fuse, bool recompute, std::size_t t_bytes) {
  return (fuse ? sizeof(float) * 2 * kTailWarps * 2 * d.ds : 0) +
         (recompute ? sizeof(float) * kTailWarps * kTailRowsPerWarp * 3 * 32 +
                          t_bytes * kTailWarps * kTailRowsPerWarp * 2 * d.ds +
                          sizeof(float) * kTailWarps * kTailRing * kTailStage
                    : 0);
}

// The tail fused into B3 (chunk_tail.cuh ClusterTail): clusters of cz heads of one group, the
// most (≤ 8, Hopper's portable cluster size) that divide the heads per group; 1 (no cluster
// tail) when hpg is odd.
unsigned tail_cluster(const Dims& d) {
  for (unsigned cz : {8u, 4u, 2u})
    if (d.hpg % cz == 0) return cz;
  return 1;
}
// Its scratch, written while B3 still reads dS, so beside it: hsum_b, hsum_c [nh/cz, BT, ds],
// part_b, part_c [B·nc, nh·ds] and their column sums' scratch (asked for only when it runs).
Idx cluster_hsum(const Dims& d) { return round64(d.nh / tail_cluster(d) * d.BT * d.ds); }
Idx cluster_parts(const Dims& d) { return round64(d.B * d.nc * d.nh * d.ds); }
Idx cluster_colsum_scratch(const Dims& d) {
  return round64(colsum_pair_scratch_floats(d.B * d.nc, d.nh * d.ds));
}
Idx cluster_region(const Dims& d) {
  return 2 * cluster_hsum(d) + 2 * cluster_parts(d) + cluster_colsum_scratch(d);
}

// B4b's head sums after the fused tail: d_X_normed[r, g, n] = T(Σ_k hsum_X[k, r, n]) over the
// kpg = hpg / cz cluster partials k of group g, ascending (from 0.0f); X = b, c (blockIdx.y).
template <class T>
__global__ void __launch_bounds__(kThreads)
cluster_head_sum_kernel(Idx rows, Idx ng, Idx ds, Idx kpg, const float* hb, const float* hc,
                        T* db, T* dc) {
  const bool is_c = blockIdx.y == 1;
  const float* hs = is_c ? hc : hb;
  T* out = is_c ? dc : db;
  const Idx n_all = rows * ng * ds, plane = rows * ds, stride = Idx(gridDim.x) * kThreads;
  for (Idx i = Idx(blockIdx.x) * kThreads + threadIdx.x; i < n_all; i += stride) {
    const Idx r = i / (ng * ds), gg = (i / ds) % ng, n = i % ds;
    const float* src = hs + gg * kpg * plane + r * ds + n;
    float sum = 0.0f;
    for (Idx k = 0; k < kpg; ++k) sum += src[k * plane];
    out[i] = from_float<T>(sum);
  }
}

struct BwdScratch {
  float *dS, *dscale_prev;
  float *part_b, *part_c, *part_sums;  // step 2's bias partial sums (and their colsum), over dS
  float *hsum_b, *hsum_c, *cpart_b, *cpart_c, *cpart_sums;  // the cluster tail's (beside dS)
};

BwdScratch carve(const Dims& d, Scratch scratch, bool cluster) {
  require_scratch(scratch, ssm_chunked_scratch_floats(d) + (cluster ? cluster_region(d) : 0),
                  "gpu::ssm_chunked_backward");
  BwdScratch s{};
  s.dS = scratch.p;
  s.part_b = scratch.p;
  s.part_c = s.part_b + tail_partials(d);
  s.part_sums = s.part_c + tail_partials(d);
  s.dscale_prev = s.dS + first_region(d);
  s.hsum_b = scratch.p + ssm_chunked_scratch_floats(d);  // the cluster tail's region (cluster)
  s.hsum_c = s.hsum_b + cluster_hsum(d);
  s.cpart_b = s.hsum_c + cluster_hsum(d);
  s.cpart_c = s.cpart_b + cluster_parts(d);
  s.cpart_sums = s.cpart_c + cluster_parts(d);
  return s;
}

// p's step-2 tensors, each [BT, ...] one from row r0 on (null stays null).
template <class T>
TailArgs<T> tail_args(const SsmChunkBwd<T>& p, const Dims& d, Idx r0) {
  return tail_args_at(tail_args_of(p), r0, d.nh, d.ds, d.na, d.ng);
}

}  // namespace

Idx ssm_chunked_scratch_floats(const Dims& d) { return first_region(d) + round64(d.B * d.nh); }
Idx ssm_chunked_cluster_scratch_floats(const Dims& d) { return cluster_region(d); }

template <class T>
bool ssm_chunked_cluster_tail(const Dims& d) {
  return kTensorProducts<T> && std::min(d.cs, d.T) <= kTR && tail_cluster(d) >= 2 &&
         d.ds % 2 == 0 && d.ds <= 128;
}

template <class T>
void ssm_chunked_backward(cudaStream_t s, const Dims& d, const SsmChunkBwd<T>& p,
                          Scratch scratch) {
  constexpr bool kTyped = kTensorProducts<T>;
  const ChunkGeom g = with_ldx(chunk_geom(d), p.ldx);
  const bool planes = kTyped && g.nt == 1;
  M3_REQUIRE(d.na >= 0 && 2 * d.na <= d.ds, kChunkWhere, "bad dims", "na=", d.na, " ds=", d.ds,
             " (needs 2·na ≤ ds)");
  const bool fuse = p.d_b_normed != nullptr, recompute = p.b_normed != nullptr;
  M3_REQUIRE(fuse || (p.d_b_pre_rope && p.d_c_pre_rope), kChunkWhere, "no step-2 output",
             "set d_b/c_pre_rope, or d_b/c_normed for the fused head sums");
  M3_REQUIRE(!fuse || (p.d_c_normed && p.d_b_bias && p.d_c_bias), kChunkWhere,
             "incomplete fused head sums", "d_b_normed needs d_c_normed, d_b_bias and d_c_bias");
  M3_REQUIRE(recompute ? (p.c_normed && p.b_bias && p.c_bias)
                       : (p.k && p.q && p.b_biased && p.c_biased),
             kChunkWhere, "missing step-2 inputs",
             recompute ? "b_normed needs c_normed, b_bias and c_bias"
                       : "k, q, b_biased and c_biased are required without b_normed");
  M3_REQUIRE(d.ng >= 1 && d.hpg * d.ng == d.nh, kChunkWhere, "bad dims", "ng=", d.ng,
             " hpg=", d.hpg, " nh=", d.nh);
  const Idx rows = d.BT * d.nh;
  // Vector accesses: the lanes' pairs of the [.., ds] rows (θ and dθ are read value by value).
  const bool vec = d.ds % 2 == 0 &&
                   all_aligned(8, p.dK_mid, p.dQ_mid, p.d_b_pre_rope, p.d_c_pre_rope, p.d_k_out,
                               p.b_bias, p.c_bias) &&
                   all_aligned(2 * sizeof(T), p.k, p.q, p.b_biased, p.c_biased, p.b_normed,
                               p.c_normed, p.d_b_normed, p.d_c_normed);
  // Step 2 and B4b fused into B3 (chunk_tail.cuh ClusterTail) where asked for and the shape
  // allows it; otherwise the standalone tail, which reads dQ_mid and dK_mid.
  const bool cluster = p.cluster_tail && ssm_chunked_cluster_tail<T>(d) && fuse && recompute && vec;
  M3_REQUIRE(cluster || (p.dQ_mid && p.dK_mid), kChunkWhere, "missing dQ_mid / dK_mid",
             "the standalone tail reads them (only the cluster tail runs without them)");
  const BwdScratch w = carve(d, scratch, cluster);
  with_pads(d.hd, d.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    const ChunkStateArgs a{p.d_y,  p.q,  nullptr, nullptr, p.da_cumsum_saved, p.da_cs_sum,
                           w.dS,   g.di};  // U = d_y: contiguous
    if (planes && p.fuse_states) {  // B1 + B2 in one walk: dS written, dcontrib never stored
      if constexpr (kTyped) {
        ChunkWalkArgs cw{};
        cw.s = a;
        cw.s.out = nullptr;
        cw.states = w.dS;
        cw.init = p.d_ssm_out;
        cw.fin = p.d_ssm_in;
        chunk_walk_tc<T, false>(s, g, cw);
      }
    } else {
      if (planes) {
        if constexpr (kTyped) chunk_state_tc<T, false>(s, g, a);
      } else {
        auto k1 = chunk_state_kernel<T, RH, RD, false>;
        const std::size_t sm1 = smem_chunk_state(RH, RD, kTyped);
        opt_in_smem(k1, sm1, kChunkWhere);
        k1<<<grid3(d.nc, d.nh, d.B), kCT, sm1, s>>>(g, a);
        M3_LAUNCH_CHECK();
      }
      state_pass_bwd_kernel<<<grid3(blocks_for(d.hd * d.ds, kThreads), d.nh, d.B), kThreads, 0,
                              s>>>(g, p.da_cumsum_saved, p.d_ssm_out, w.dS, p.d_ssm_in);
      M3_LAUNCH_CHECK();
    }
    entering_grad_kernel<T><<<grid3(d.nh, d.B, 1), kThreads, 0, s>>>(g, p, w.dscale_prev);
    M3_LAUNCH_CHECK();
    if (planes) {
      if constexpr (kTyped) {
        if (cluster) {
          const ClusterTail<T> ct{tail_args_of(p),
                                  w.cpart_b,
                                  w.cpart_c,
                                  w.hsum_b,
                                  w.hsum_c,
                                  static_cast<unsigned>(d.na),
                                  static_cast<unsigned>(d.ng),
                                  static_cast<unsigned>(d.hpg),
                                  tail_cluster(d)};
          chunk_bwd_tc<T>(s, g, p, w.dS, &ct);
        } else {
          chunk_bwd_tc<T>(s, g, p, w.dS);
        }
      }
    } else {
      auto k3 = chunk_bwd_kernel<T, RH, RD>;
      const std::size_t sm3 = smem_chunk_bwd(RH, RD, kTyped);
      opt_in_smem(k3, sm3, kChunkWhere);
      k3<<<grid3(d.nc, d.nh, d.B), kBwdThreads, sm3, s>>>(g, p, w.dS);
      M3_LAUNCH_CHECK();
    }
  });
  dd_partials_kernel<<<grid3(d.nh, d.B, 1), kThreads, 0, s>>>(d.T, d.nh, p.dQK_dot,
                                                              p.dD_partials);
  M3_LAUNCH_CHECK();
  dd_reduce_kernel<<<blocks_for(d.nh, kThreads), kThreads, 0, s>>>(d.B, d.nh, p.dD_partials,
                                                                  p.d_d_param);
  M3_LAUNCH_CHECK();
  const Idx nhds = d.nh * d.ds;
  if (cluster) {  // the tail ran in B3: the groups' sums of the cluster partials
    const unsigned hs_grid =
        static_cast<unsigned>(std::min<Idx>(blocks_for(d.BT * d.ng * d.ds, kThreads), 65535));
    cluster_head_sum_kernel<T><<<dim3(hs_grid, 2), kThreads, 0, s>>>(
        d.BT, d.ng, d.ds, d.hpg / tail_cluster(d), w.hsum_b, w.hsum_c, p.d_b_normed,
        p.d_c_normed);
    M3_LAUNCH_CHECK();
  } else {
    // Slabs of whole tail blocks whose offsets fit 32 bits (one slab up to 2^31 / (nh·ds) rows).
    const Idx slab = slab_rows(d, kTailRows);
    with_flags(recompute, fuse, [&](auto recompute_c, auto fuse_c) {
      constexpr bool kR = decltype(recompute_c)::value, kF = decltype(fuse_c)::value;
      auto k2 = !vec          ? qk_rope_bwd_kernel<T, kR, kF, false, false>
                : rope_layout_full(d) ? qk_rope_bwd_kernel<T, kR, kF, true, true>
                              : qk_rope_bwd_kernel<T, kR, kF, true, false>;
      const std::size_t sm2 = tail_smem_bytes(d, kF, kR, sizeof(T));
      opt_in_smem(k2, sm2, kChunkWhere);
      for (Idx r0 = 0; r0 < d.BT; r0 += slab) {
        const Idx rows_here = std::min(slab, d.BT - r0);
        const TailGeom tg{static_cast<unsigned>(rows_here), static_cast<unsigned>(d.nh),
                          static_cast<unsigned>(d.ds),      static_cast<unsigned>(d.na),
                          static_cast<unsigned>(d.ng),      static_cast<unsigned>(d.hpg),
                          static_cast<unsigned>(d.T),       r0};
        const Idx part0 = r0 / kTailRows * d.nh * d.ds;
        k2<<<static_cast<unsigned>((rows_here + kTailRows - 1) / kTailRows), kTailThreads, sm2,
             s>>>(tg, tail_args(p, d, r0), w.part_b + part0, w.part_c + part0);
        M3_LAUNCH_CHECK();
      }
    });
  }
  if (fuse) {  // d X_bias: the bias partials over the tail's row blocks (or B3's chunks)
    const Idx parts = cluster ? d.B * d.nc : tail_blocks(d);
    const Scratch sums = cluster ? Scratch{w.cpart_sums, cluster_colsum_scratch(d)}
                                 : Scratch{w.part_sums, tail_colsum_scratch(d)};
    colsum_rows_pair(s, parts, nhds, LoadMatrix{cluster ? w.cpart_b : w.part_b, nhds},
                     p.d_b_bias, LoadMatrix{cluster ? w.cpart_c : w.part_c, nhds}, p.d_c_bias,
                     true, sums, kChunkWhere);
  }
  ddt_dtrap_kernel<T><<<grid_for(rows, kThreads), kThreads, 0, s>>>(g, p, w.dscale_prev);
  M3_LAUNCH_CHECK();
}
#define M3_INSTANTIATE(T)                                                                   \
  template void ssm_chunked_backward<T>(cudaStream_t, const Dims&, const SsmChunkBwd<T>&,   \
                                        Scratch);                                           \
  template bool ssm_chunked_cluster_tail<T>(const Dims&);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
