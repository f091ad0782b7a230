// F6 as a chunked (parallel) scan, K0–K6 (MODEL.md §5.2, entering states §5.3/§12.4), and its
// backward, steps 1–3 of §6.4 (step 4 is B5b, split.cu). Same formulas as
// reference/ssm_chunked.cpp (its header comment is the authority; summarised here).
//
// Per (b, h); chunk c covers t ∈ [c·CS, min(T, (c+1)·CS)), local index τ, length L_c; any CS ≥ 1.
// Forward:
//   K0/K1 (prep_kernel, per (r, h)):  adt = a_val·dt;  γ = dt·trap;  sg = dt_{t+1}(1 − trap_{t+1})
//         (t < T−1, else 0);  scale = γ + sg;  Ks = K·scale (stored typed);  qk = γ·(Q·K)
//         (ssm_chunked_rope_prep: the same kernel with F4ef's K and Q computed in it from
//         b/c_normed, the biases and θ instead of read; then the forward skips K0/K1)
//   K2/K3 (chunk_state_kernel, per (b, h, c)):  cum_τ = Σ_{τ' ≤ τ} adt (serial, restarted per
//         chunk) → da_cumsum_saved [B, nc, nh, CS] (padding slots 0), Λ_c = cum at the end;
//         contrib_c = Σ_s e^{Λ_c − cum_s} x_s Ks_sᵀ → chunk_states [B, nc, nh, hd, ds]
//   K4/K6 (state_pass_fwd_kernel, per (b, h) element-parallel):  S_0 = ssm_in + sg_{−1} v_in k_inᵀ
//         (sg_{−1} = dt_0(1 − trap_0));  chunk_states_saved[c] = S_c;  S_{c+1} = e^{Λ_c} S_c +
//         contrib_c;  final_states = ssm_out = S_nc;  k_out = K_{T−1}, v_out = x_{T−1}
//   K5 (chunk_scan_kernel, per (b, h, c, row tile)):
//         y_t = e^{cum_t} S_c Q_t + Σ_{s∈c, s<t} e^{cum_t − cum_s}(Q_t·Ks_s) x_s + (D + qk_t) x_t
// Backward (dO = d_y; dS_c = ∂L/∂(state leaving chunk c)):
//   B1 (chunk_state_kernel, backward mode): dcontrib_c = Σ_t e^{cum_t} dO_t Q_tᵀ, da_cs_sum = Λ_c
//   B2 (state_pass_bwd_kernel): dS_{nc−1} = d_ssm_out;  dS_{c−1} = e^{Λ_c} dS_c + dcontrib_c;
//         after chunk 0: d_ssm_in = dS_{−1}
//   B2b (entering_grad_kernel): d_v_in = sg_{−1} dS k_in, d_k_in = sg_{−1} dSᵀ v_in,
//         dScale_{−1} = v_inᵀ dS k_in   (dS = d_ssm_in)
//   B3 (chunk_bwd_kernel, step 1 per (b, h, c)), with M[t,s] = e^{cum_t − cum_s} (s < t),
//         A = Q Ksᵀ, P = dO Xᵀ, W = M⊙P⊙A:
//         dV = (M⊙A)ᵀ dO + diag(e^{Λ−cum}) Ks dSᵀ + diag(D + qk) dO  (+ d_v_out at t = T−1)  → d_x
//         dQK_t = dO_t·x_t;  dK_mid = (M⊙P)ᵀ Q + diag(e^{Λ−cum}) X dS;
//         dQ_mid = (M⊙P) Ks + diag(e^{cum}) dO S
//         R_t = Σ_i W[t,i] − Σ_j W[j,t] + e^{cum_t}(dO S)_t·Q_t;  M_t = e^{Λ−cum_t}(X dS)_t·Ks_t;
//         M_sc = e^{Λ}⟨S, dS⟩;  dADT_τ = Σ_{t ≥ τ}(R_t − M_t) + M_sc + Σ_t M_t
//   dD: dD_partials[b,h] = Σ_t dQK_t;  d D[h] += Σ_b dD_partials (ascending b)
//   step 2 (qk_rope_bwd_kernel: the RoPE backward of rope.cu fused with the qk terms):
//         dScale = dK_mid·K; dGamma = dQK·(c_biased·b_biased); the RoPE backward with
//         dv1 = scale·dK_mid (+ d_k_out at t = T−1), rot1 = k, dv2 = dQ_mid, rot2 = q, plus
//         dQK·γ·c_biased, dQK·γ·b_biased → d_b_pre_rope, d_c_pre_rope, d_angle_cumsum;
//         optionally with b/c_biased, k, q recomputed from b/c_normed (bit for bit) and with
//         B4b fused in (d_b/c_normed, the bias gradients; d_X_pre_rope then need not be stored)
//   step 3 (ddt_dtrap_kernel): dDT_t = (dGamma_t + dScale_t)·trap_t + dScale_{t−1}(1 − trap_t);
//         d_trap_sig = ((dGamma_t + dScale_t) − dScale_{t−1})·dt_t; d_adt_total = dADT,
//         d_dt_direct = dDT
// Saved by the forward: adt, k_scaled_saved, qk_dot_saved, scale_saved, gamma_saved,
// da_cumsum_saved, chunk_states (contributions), chunk_states_saved (entering S_c), final_states.
// Typed storage T (MODEL.md §8): x, k, q, d_y, b_biased, c_biased are read as f32. K1 rounds Ks
// to T as it stores k_scaled_saved, and K3, K5 and B3 read that stored value (the reference's
// store_typed right after K1); y is rounded once as K5 stores it, d_x once, after the d_v_out
// term. Every other saved or gradient tensor is f32.
//
// Products. f32 runs: f32 FMA from shared memory (mma16; MODEL.md §12.8 keeps f32 off the
// tensor cores). bf16/f16 runs: tensor cores (tc_mma.cuh: bf16 split operands, f32
// accumulation, relative error ≲ 2⁻¹⁶ of Σ|terms|, two orders under the storage rounding);
// K3/B1 and K5 keep the accumulators in the mma fragment layout and apply their epilogues
// (decay mask, y) there, B3 goes through the shared tile Cs (mm below).
// Plane kernels: typed runs whose chunks fit one row tile (chunk_size ≤ 64) run K3/B1, K5 and B3
// as the kernels of chunk_state_tc.cu, chunk_fwd_tc.cu and chunk_bwd_tc.cu (bf16 operand planes,
// ldmatrix, accumulators in registers; tc_frag.cuh); the tiled kernels below serve f32 runs and
// longer chunks.
// Tiling: K3/B1 and K5 use 256 threads, B3 512 (kBwdThreads), as a (threads/16) × 16 grid
// (tm = tid/16, tn = tid%16); in the FMA path a thread owns rows tm + (threads/16)·i and columns
// tn + 16j of every product (operands contiguous in the reduction index read as float4).
// Global → shared tile loads are issued in batches (fill_tile), the state-passing kernels load
// kChunkBatch chunks ahead: these kernels are latency-bound (one or two blocks per SM), not
// bandwidth-bound (docs/PERF.md). Chunks are processed in row tiles of kTR = 64 steps, so any
// chunk length works; headdim and d_state are padded (with zeros) to 16·RH, 16·RD,
// RH, RD ∈ {2, 4, 8}.
// Shapes supported: headdim ≤ 128, d_state ≤ 128; others throw m3::Error.
// Scratch (backward only, floats): max(B·nc·nh·hd·ds (dS per chunk), step 2's bias partial
// sums 2·⌈BT/64⌉·nh·ds + their column-sum scratch) + B·nh (dScale_{−1}), each rounded up to 64.
// Index arithmetic: the per-row kernels (K0/K1's prep, step 2's tail) work in 32-bit offsets;
// their launchers split the rows into slabs (slab_rows: rows·nh·ds < 2^31) and shift the
// pointers to each slab's first row, so any shape works and the common one is one launch. The
// state passing walks its chunks by pointer steps (pass_chunks).
// Determinism: no atomics; every output has one writer; every sum runs in a fixed order.
#include <algorithm>

#include <type_traits>

#include "backbone_gpu.hpp"
#include "chunk_fwd_tc.cuh"
#include "chunk_state_tc.cuh"
#include "convert.cuh"
#include "fast_div.cuh"
#include "reduce.cuh"
#include "rope_pair.cuh"
#include "ssm_chunk_geom.cuh"
#include "tc_mma.cuh"

namespace m3::gpu {

namespace {

constexpr int kCT = 256;  // threads of the per-chunk kernels (16 × 16)
constexpr int kRM = kTR / 16;
constexpr int kLM = kTR + 4;  // leading dimension of the [kTR][kTR] tiles
constexpr int kNK = 32;       // width of a streamed slice of S / dS
constexpr int kLS = kNK + 4;  // leading dimension of an n-slice [HP][kNK]

// acc[i][j] += Σ_{k<K} A[(tm + RS·i)·AM + k·AK] · Bm[k·BK + (tn + 16j)·BN]   (shared memory),
// k ascending; RS = the number of row threads (kCT/16 = 16, or 32 in chunk_bwd_kernel). With A contiguous in k (AK = 1) the operands are read as float4 along k (B too
// when BK = 1) and K is rounded up to a multiple of 4: the caller guarantees zeros in A (and
// finite values in B) for k ∈ [K, ⌈K⌉₄). Leading dimensions ≡ 4 (mod 32) floats keep the
// 16 rows a half-warp reads in distinct banks.
template <int RM, int RN, int AM, int AK, int BK, int BN, int RS = 16>
__device__ __forceinline__ void mma16(float (&acc)[RM][RN], const float* A, const float* Bm,
                                      int K, int tm, int tn) {
  const float* a0 = A + tm * AM;
  const float* b0 = Bm + tn * BN;
  if constexpr (AK == 1) {
    static_assert(AM % 4 == 0 && (BK != 1 || BN % 4 == 0), "float4 rows need 16-byte strides");
#pragma unroll 1
    for (int k = 0; k < K; k += 4) {
      float a[RM][4], bv[RN][4];
#pragma unroll
      for (int i = 0; i < RM; ++i) {
        const float4 v = *reinterpret_cast<const float4*>(a0 + RS * i * AM + k);
        a[i][0] = v.x;
        a[i][1] = v.y;
        a[i][2] = v.z;
        a[i][3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < RN; ++j) {
        if constexpr (BK == 1) {
          const float4 v = *reinterpret_cast<const float4*>(b0 + 16 * j * BN + k);
          bv[j][0] = v.x;
          bv[j][1] = v.y;
          bv[j][2] = v.z;
          bv[j][3] = v.w;
        } else {
#pragma unroll
          for (int kk = 0; kk < 4; ++kk) bv[j][kk] = b0[(k + kk) * BK + 16 * j * BN];
        }
      }
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int i = 0; i < RM; ++i)
#pragma unroll
          for (int j = 0; j < RN; ++j) acc[i][j] = fmaf(a[i][kk], bv[j][kk], acc[i][j]);
    }
  } else {
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      float a[RM], bv[RN];
#pragma unroll
      for (int i = 0; i < RM; ++i) a[i] = a0[RS * i * AM + k * AK];
#pragma unroll
      for (int j = 0; j < RN; ++j) bv[j] = b0[k * BK + 16 * j * BN];
#pragma unroll
      for (int i = 0; i < RM; ++i)
#pragma unroll
        for (int j = 0; j < RN; ++j) acc[i][j] = fmaf(a[i], bv[j], acc[i][j]);
    }
  }
}

// The products of chunk_bwd_kernel (B3), by storage type: acc += A·B with acc in the thread's
// (tm + kBwdRows·i, tn + 16j) layout. f32 runs: mma16. Typed runs: the tensor-core product into
// the shared tile Cs ([kTR][16·RN + 16]), then acc += Cs (B3's epilogues work in the thread
// layout; Cs costs shared memory, which B3 can spare: one block per SM either way).
// AX / BX: the operand holds values of a typed tensor (exact in bf16 when T is bf16, so its
// correction pass is skipped). Called by all threads of the block together (it has barriers),
// with A and B visible in shared memory.
template <class T>
constexpr bool kTensorProducts = !std::is_same_v<T, float>;
// A typed operand is exact in bf16 (its tensor-core correction pass can be skipped) only when
// the storage is bf16; an f16 value needs both halves of the split.
template <class T>
constexpr bool kExactBf16 = std::is_same_v<T, __nv_bfloat16>;
// chunk_bwd_kernel runs 512 threads (16 warps: the only block on its SM, for its registers and
// shared memory) as a 32 × 16 grid: a thread owns rows tm + 32i (i < kBR = 2) of a time tile
// and columns tn + 16j, so its register tiles are half those of the 256-thread kernels.
constexpr int kBwdThreads = 512;
constexpr int kBwdRows = kBwdThreads / 16;
constexpr int kBR = kTR / kBwdRows;
constexpr int ld_c(int rn) { return 16 * rn + 16; }

template <class T, bool AX, bool BX, int RM, int RN, int AM, int AK, int BK, int BN>
__device__ __forceinline__ void mm(float (&acc)[RM][RN], const float* A, const float* Bm, int K,
                                   int tm, int tn, float* Cs) {
  if constexpr (!kTensorProducts<T>) {
    mma16<RM, RN, AM, AK, BK, BN, kBwdRows>(acc, A, Bm, K, tm, tn);
  } else {
    constexpr int LDC = ld_c(RN);
    tc::gemm<kTR, 16 * RN, AM, AK, BK, BN, kExactBf16<T> && AX, kExactBf16<T> && BX, LDC,
             kBwdThreads / 32>(
        Cs, A, Bm, K);
    __syncthreads();
#pragma unroll
    for (int i = 0; i < RM; ++i)
#pragma unroll
      for (int j = 0; j < RN; ++j) acc[i][j] += Cs[(tm + kBwdRows * i) * LDC + tn + 16 * j];
    __syncthreads();
  }
}

template <int RM, int RN>
__device__ __forceinline__ void zero(float (&acc)[RM][RN]) {
#pragma unroll
  for (int i = 0; i < RM; ++i)
#pragma unroll
    for (int j = 0; j < RN; ++j) acc[i][j] = 0.0f;
}

// Tile loaders. The per-chunk kernels hold one block of 8 warps per SM (shared memory), so a
// global load that waits for the previous one costs a full memory latency: every loader issues
// its loads in batches of kLoadBatch per thread, all before the batch's shared-memory stores
// (which could alias them as far as the compiler knows), so that many are in flight at once.
constexpr int kLoadBatch = 8;
// Chunks per batch of the state-passing kernels (one thread per state element, serial over chunks).
constexpr int kChunkBatch = 16;
// Blocks per SM promised to ptxas for the forward state passing (64 registers): it is
// latency-bound, and the warps in flight carry the bytes in flight. (The backward spills at 64;
// it takes 80 registers, three blocks.)
constexpr int kStatePassBlocks = 4;

// The state-passing walk over the chunks of one (b, h), element e: chunk c's state at
// state0 + c·sstep, its Λ_c = da_cumsum[b, c, h, len(c) − 1] at lam0 + c·lstep for every chunk
// but the last, whose Λ is at lam0 + (nc − 1)·lstep + last_fix (it may be shorter).
struct ChunkWalk {
  Idx sstep, lstep, last_fix, state0, lam0;
  __device__ ChunkWalk(const ChunkGeom& g, Idx b, Idx h, Idx e)
      : sstep(g.nh * g.hd * g.ds),
        lstep(g.nh * g.cs),
        last_fix(g.len(g.nc - 1) - g.cs),
        state0(g.state_base(b, 0, h) + e),
        lam0(g.cum_base(b, 0, h) + g.cs - 1) {}
};

// The n chunks of one (b, h) from the pointers on, stepping sstep / lstep per chunk (negative:
// walking back), for each chunk in turn: out = v (the state entering it), v = e^Λ·v + its
// contribution (read at in). Λ of the walk's j-th chunk is at lam + j·lstep, plus last_fix for
// j = last_j (the last chunk, which may be shorter). In batches of kChunkBatch: a batch's loads
// are all issued before its stores (latency-bound: one batch is one memory round trip), so in
// and out may be the same tensor.
__device__ __forceinline__ void pass_chunks(int n, int last_j, const float* in, float* out,
                                            const float* lam, Idx sstep, Idx lstep,
                                            Idx last_fix, float& v) {
  for (int j0 = 0; j0 < n; j0 += kChunkBatch) {
    // Strides opaque per batch: the 2·kChunkBatch addresses are formed as the loads issue, not
    // hoisted out of the loop (160 registers otherwise).
    sstep = opaque(sstep), lstep = opaque(lstep);
    float cv[kChunkBatch], dv[kChunkBatch];
    const float *iq = in, *lq = lam;
#pragma unroll
    for (int k = 0; k < kChunkBatch; ++k, iq += sstep, lq += lstep) {
      const bool ok = j0 + k < n;
      cv[k] = ok ? *iq : 0.0f;
      dv[k] = ok ? *(j0 + k == last_j ? lq + last_fix : lq) : 0.0f;
    }
    float* oq = out;
#pragma unroll
    for (int k = 0; k < kChunkBatch; ++k, oq += sstep) {
      if (j0 + k >= n) break;
      *oq = v;
      v = expf(dv[k]) * v + cv[k];
    }
    in += kChunkBatch * sstep, out += kChunkBatch * sstep, lam += kChunkBatch * lstep;
  }
}

// dst[r·LD + c] = value(r, c) for the [R][CP] tile by a block of NT threads, R·CP a multiple of NT.
template <int R, int CP, int LD, int NT = kCT, class F>
__device__ __forceinline__ void fill_tile(float* dst, F&& value) {
  constexpr int kIter = R * CP / NT;
  static_assert(R * CP % NT == 0, "the block must tile the tile");
  constexpr int kB = kIter < kLoadBatch ? kIter : kLoadBatch;
  static_assert(kIter % kB == 0, "batches must tile the iterations");
#pragma unroll 1
  for (int i0 = 0; i0 < kIter; i0 += kB) {
    float v[kB];
#pragma unroll
    for (int k = 0; k < kB; ++k) {
      const int e = threadIdx.x + (i0 + k) * NT;
      v[k] = value(e / CP, e % CP);
    }
#pragma unroll
    for (int k = 0; k < kB; ++k) {
      const int e = threadIdx.x + (i0 + k) * NT;
      dst[(e / CP) * LD + e % CP] = v[k];
    }
  }
}

// dst[r·LD + c] = to_float(src[r·stride + c]) for r < rows, c < cols; 0 for the rest of the
// [kTR][CP] tile (padding rows and columns read as zeros).
template <int CP, int LD, int NT = kCT, class S>
__device__ __forceinline__ void load_tile(float* dst, const S* src, Idx stride, int rows,
                                          int cols) {
  fill_tile<kTR, CP, LD, NT>(dst, [&](int r, int c) {
    return (r < rows && c < cols) ? to_float(src[r * stride + c]) : 0.0f;
  });
}

// Sl[p·kLS + k] = M[p·ds + n0 + k] (an n-slice of a [hd][ds] matrix), zero-padded to [HP][kNK].
template <int HP, int NT = kCT>
__device__ __forceinline__ void load_nslice(float* Sl, const float* M, int hd, int ds, int n0) {
  fill_tile<HP, kNK, kLS, NT>(Sl, [&](int p, int k) {
    return (p < hd && n0 + k < ds) ? M[p * ds + n0 + k] : 0.0f;
  });
}

// Sl[k·LDD + n] = M[(p0 + k)·ds + n] (a p-slice of a [hd][ds] matrix), zero-padded to [kNK][DP].
template <int DP, int LDD, int NT = kCT>
__device__ __forceinline__ void load_pslice(float* Sl, const float* M, int hd, int ds, int p0) {
  fill_tile<kNK, DP, LDD, NT>(Sl, [&](int k, int n) {
    return (p0 + k < hd && n < ds) ? M[(p0 + k) * ds + n] : 0.0f;
  });
}

// Σ over the 16 tn lanes that share a row tm (xor 8, 4, 2, 1); every lane gets it.
__device__ __forceinline__ float row16_sum(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- K0/K1 --------------------------------------------------------------------------------
// Half a warp per (r, h); lanes over n.
constexpr int kPrepLanes = 16;  // lanes per (r, h) row in prep_kernel

// The lane's 4 values n0 … n0 + 3 of the row at x + row of a row of len values (zeros past its
// end), and back: kVec, one access when the group lies in the row (has = n0 < len; len % 4 == 0
// and the row aligned), at the 32-bit offset row + n0; else element by element
// (load_row_group).
template <bool kVec, class X>
__device__ __forceinline__ void lane_load(const X* x, unsigned row, unsigned n0, unsigned len,
                                          bool has, float (&v)[4]) {
  if constexpr (kVec) {
    if (has) {
      load_vec<4>(x + (row + n0), v);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = 0.0f;
    }
  } else {
    load_row_group<false>(x + row, n0, len, v);
  }
}
template <bool kVec, class X>
__device__ __forceinline__ void lane_store(X* x, unsigned row, unsigned n0, unsigned len,
                                           bool has, const float (&v)[4]) {
  if constexpr (kVec) {
    if (has) store_vec<4>(x + (row + n0), v);
  } else {
    store_row_group<false>(x + row, n0, len, v);
  }
}

// Rows of the [BT, ...] tensors per launch of the row kernels below (prep, the backward tail),
// so that their in-kernel offsets and indices fit 32 bits: rows·nh·ds ≤ 2^31 − 2^16 (na ≤ ds,
// ng ≤ nh; the margin covers a warp's rows past the end and FastDiv's 32-bit form, n < 2^31); a
// multiple of `align` (at least one).
// ptr + off for a slab's shifted pointer (null stays null: an optional tensor).
template <class P>
P* shifted(P* ptr, Idx off) {
  return ptr ? ptr + off : ptr;
}

Idx g_slab_limit = 0;  // set_row_slab_limit_for_testing (0: none)
Idx slab_rows(const Dims& d, Idx align) {
  Idx rows = 0x7fff0000 / (d.nh * d.ds);
  if (g_slab_limit > 0) rows = std::min(rows, g_slab_limit);
  return std::max<Idx>(1, rows / align) * align;
}

// K0/K1's tensors (SsmChunkFwd's and RopePrep's names), every [BT, ...] one from the launch's
// first row on.
template <class T>
struct PrepArgs {
  const float *dt, *trap, *a_val;                  // [rows, nh] (dt, trap also at row + 1)
  const T *k_in, *q_in;                            // !kRope: the stored k, q
  const T *b_normed, *c_normed;                    // kRope: [rows, ng, ds]
  const float *b_bias, *c_bias, *theta;            // kRope: [nh, ds] (not shifted), [rows, nh, na]
  T *k, *q;                                        // kRope: F4ef's outputs
  T* k_scaled_saved;
  float *adt, *gamma_saved, *scale_saved, *qk_dot_saved;
};
struct PrepGeom {
  unsigned rows, nh, ds, na, ng, T;
  Idx t_base;                  // t of the launch's first row
  FastDiv heads, time, group;  // i → (r, h); t_base + r → t; h → g(h)
  bool k_all;
};

// kRope: F4ef fused in (ssm_chunked_rope_prep). k and q are not read but computed as
// rope_forward_normed computes them, bit for bit: X_biased = T(float(X_normed[r, g(h)]) +
// X_bias[h]), the pair (2j, 2j + 1) rotated by θ[r, h, j] for j < na (rope_rotate), rounded to
// T; q is stored, k at t = T − 1 (k_out's source) or everywhere when k_all.
template <class T, bool kRope, bool kVec>
__global__ void __launch_bounds__(kThreads)
prep_kernel(PrepGeom pg, PrepArgs<T> a) {
  // Half a warp per (r, h) row (Seg<16>: two rows per warp in flight): lane l < 16 owns the
  // values n = 4l + 64k, k ∈ {0, 1} (ds ≤ 128, chunk_geom), read and written 4 at a time when
  // kVec (ds % 4 == 0, rows aligned), else element by element. Offsets are 32-bit (PrepGeom).
  using S = Seg<kPrepLanes>;
  const unsigned items = pg.rows * pg.nh, ds = pg.ds, na = pg.na, lane = S::lane();
  for (unsigned w0 = static_cast<unsigned>(S::first()); w0 < items;
       w0 += static_cast<unsigned>(S::stride())) {
    const unsigned i = w0 + S::seg();
    const bool on = i < items;
    const unsigned len = on ? ds : 0;  // values of this lane's row (none when off)
    const unsigned r = pg.heads.div(i), h = i - r * pg.nh, base = i * ds;
    Idx b;
    const bool next = on && pg.time.divmod(pg.t_base + r, b) + 1 < pg.T;  // sg = 0 at t = T − 1
    const float dt = on ? a.dt[i] : 0.0f, trap = on ? a.trap[i] : 0.0f;
    const float dt1 = next ? a.dt[i + pg.nh] : 0.0f, trap1 = next ? a.trap[i + pg.nh] : 1.0f;
    float kv[2][4], qv[2][4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const unsigned n = 4 * lane + 64 * c;
      const bool has = n < len;
      if constexpr (kRope) {
        const unsigned gn = (r * pg.ng + pg.group.div(h)) * ds, hn = h * ds;
        float nb[4], nc[4], ab[4], ac[4], th[2];
        lane_load<kVec>(a.b_normed, gn, n, len, has, nb);
        lane_load<kVec>(a.c_normed, gn, n, len, has, nc);
        lane_load<kVec>(a.b_bias, hn, n, len, has, ab);
        lane_load<kVec>(a.c_bias, hn, n, len, has, ac);
        const unsigned j0 = n / 2;  // the lane's pairs j0, j0 + 1
        if constexpr (kVec) {       // na is even, so both pairs are rotated or neither
          th[0] = th[1] = 0.0f;
          if (has && j0 < na) load_n<2>(a.theta + (i * na + j0), th);
        } else {
#pragma unroll
          for (int u = 0; u < 2; ++u) th[u] = on && j0 + u < na ? a.theta[i * na + j0 + u] : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          kv[c][e] = nb[e] + ab[e];  // b_biased; k where not rotated
          qv[c][e] = nc[e] + ac[e];  // c_biased; q where not rotated
        }
        // round_trip2: the same values as round_trip (a NaN stays a NaN, and its store below
        // gives the bits a stored arithmetic NaN has).
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          round_trip2<T>(kv[c][e], kv[c][e + 1]);
          round_trip2<T>(qv[c][e], qv[c][e + 1]);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (j0 + u >= na) continue;
          float sn, cs;
          sincosf(th[u], &sn, &cs);
          const float b0 = kv[c][2 * u], b1 = kv[c][2 * u + 1];
          const float c0 = qv[c][2 * u], c1 = qv[c][2 * u + 1];
          rope_rotate(sn, cs, b0, b1, kv[c][2 * u], kv[c][2 * u + 1]);
          rope_rotate(sn, cs, c0, c1, qv[c][2 * u], qv[c][2 * u + 1]);
          round_trip2<T>(kv[c][2 * u], kv[c][2 * u + 1]);
          round_trip2<T>(qv[c][2 * u], qv[c][2 * u + 1]);
        }
        lane_store<kVec>(a.q, base, n, len, has, qv[c]);
        if (pg.k_all || !next) lane_store<kVec>(a.k, base, n, len, has, kv[c]);
      } else {
        lane_load<kVec>(a.k_in, base, n, len, has, kv[c]);
        lane_load<kVec>(a.q_in, base, n, len, has, qv[c]);
      }
    }
    const float gam = dt * trap, sg = dt1 * (1.0f - trap1);
    // Not contracted into an fma: the reference rounds γ and sg, then adds, and Ks is stored
    // typed from K·scale, so the same scale gives the same rounded Ks.
    const float scale = __fadd_rn(gam, sg);
    // Q·K: the lane's values in ascending n (zeros past ds add nothing), then segment_sum.
    float qk = 0.0f;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const unsigned n = 4 * lane + 64 * c;
      float o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        qk += qv[c][e] * kv[c][e];
        o[e] = kv[c][e] * scale;
      }
      lane_store<kVec>(a.k_scaled_saved, base, n, len, n < len, o);
    }
    qk = segment_sum<kPrepLanes>(qk);
    if (on && lane == 0) {
      a.adt[i] = a.a_val[i] * dt;
      a.gamma_saved[i] = gam;
      a.scale_saved[i] = scale;
      a.qk_dot_saved[i] = gam * qk;
    }
  }
}

// Launches prep_kernel<T, kRope> over the rows in slabs (32-bit offsets). rp: kRope's inputs and
// outputs (null for the plain K0/K1).
template <class T, bool kRope>
void launch_prep(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p, const RopePrep<T>* rp) {
  constexpr unsigned kVecBytes = 4 * sizeof(T);
  const bool vec = d.ds % 4 == 0 && d.na % 2 == 0 && is_aligned(p.k_scaled_saved, kVecBytes) &&
                   (kRope ? all_aligned(kVecBytes, rp->k, rp->q, rp->b_normed, rp->c_normed) &&
                                all_aligned(16, rp->b_bias, rp->c_bias) &&
                                all_aligned(8, rp->theta)
                          : all_aligned(kVecBytes, p.k, p.q));
  auto kernel = vec ? prep_kernel<T, kRope, true> : prep_kernel<T, kRope, false>;
  const Idx slab = slab_rows(d, 1);
  for (Idx r0 = 0; r0 < d.BT; r0 += slab) {
    const Idx rows = std::min(slab, d.BT - r0), s1 = r0 * d.nh, sd = s1 * d.ds,
              sa = s1 * d.na, sg = r0 * d.ng * d.ds;
    PrepArgs<T> a{p.dt + s1, p.trap + s1, p.a_val + s1, shifted(p.k, sd),  shifted(p.q, sd),
                  nullptr,   nullptr,     nullptr,      nullptr,     nullptr,
                  nullptr,   nullptr,     p.k_scaled_saved + sd,     p.adt + s1,
                  p.gamma_saved + s1,     p.scale_saved + s1,        p.qk_dot_saved + s1};
    if constexpr (kRope) {
      a.b_normed = rp->b_normed + sg, a.c_normed = rp->c_normed + sg;
      a.b_bias = rp->b_bias, a.c_bias = rp->c_bias, a.theta = shifted(rp->theta, sa);
      a.k = rp->k + sd, a.q = rp->q + sd;
    }
    const PrepGeom pg{static_cast<unsigned>(rows), static_cast<unsigned>(d.nh),
                      static_cast<unsigned>(d.ds), static_cast<unsigned>(d.na),
                      static_cast<unsigned>(d.ng), static_cast<unsigned>(d.T),
                      r0 % d.T,                    FastDiv(d.nh),
                      FastDiv(d.T),                FastDiv(d.hpg),
                      kRope && rp->k_all};
    kernel<<<grid_for(rows * d.nh, Seg<kPrepLanes>::kPerBlock), kThreads, 0, s>>>(pg, a);
    M3_LAUNCH_CHECK();
  }
}

// ---- K2/K3 (forward) and B1 (backward) --------------------------------------------------------
// Per (b, h, c) [grid (nc, nh, B)]: out[p, n] = Σ_s w_s U_s[p] V_s[n] over the chunk's rows, with
// (U, V, w) = (x, Ks, e^{Λ − cum}) forward and (dO, Q, e^{cum}) backward. The forward first runs
// the serial cumsum (thread 0 over each staged tile) and writes da_cumsum_saved; the backward
// reads it and writes da_cs_sum. Shared: Us [kTR][LDH], Vs [kTR][LDD], w [kTR], scalars.

template <class T, int RH, int RD, bool kFwd>
__global__ void __launch_bounds__(kCT)
chunk_state_kernel(ChunkGeom g, ChunkStateArgs a) {
  // f32: odd leading dimensions for mma16's scalar column reads; typed (tensor cores): ≡ 4
  // (mod 32), so that a fragment's 32 scalar reads (8c + g) hit distinct banks.
  constexpr bool kTC = kTensorProducts<T>;
  constexpr int HP = 16 * RH, DP = 16 * RD;
  constexpr int LDH = kTC ? HP + 4 : HP + 1, LDD = kTC ? DP + 4 : DP + 1;
  extern __shared__ float sm[];
  float* Us = sm;
  float* Vs = Us + kTR * LDH;
  float* w = Vs + kTR * LDD;
  float* lam = w + kTR;
  const int tid = threadIdx.x, tm = tid >> 4, tn = tid & 15;
  const Idx c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int L = g.len(c), hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  const Idx t0 = g.t0(c), row0 = b * g.T + t0;
  const float* cum = (kFwd ? a.cum_out : a.cum_in) + g.cum_base(b, c, h);

  if constexpr (kFwd) {
    float* cum_w = a.cum_out + g.cum_base(b, c, h);
    float run = 0.0f;  // thread 0 only
    for (int base = 0; base < L; base += kTR) {
      const int n = min(kTR, L - base);
      if (tid < n) w[tid] = a.adt[(row0 + base + tid) * g.nh + h];
      __syncthreads();
      if (tid == 0)
        for (int k = 0; k < n; ++k) w[k] = (run += w[k]);
      __syncthreads();
      if (tid < n) cum_w[base + tid] = w[tid];
      __syncthreads();
    }
    for (Idx k = L + tid; k < g.cs; k += kCT) cum_w[k] = 0.0f;
    if (tid == 0) lam[0] = run;
  } else {
    if (tid == 0) {
      lam[0] = cum[L - 1];
      a.da_cs_sum[(b * g.nc + c) * g.nh + h] = cum[L - 1];
    }
  }
  __syncthreads();
  const float Lam = lam[0];

  float acc[kTC ? 1 : RH][kTC ? 1 : RD];
  tc::Acc<HP, DP, kCT / 32> tacc;
  if constexpr (kTC) {
    tacc.zero();
  } else {
    zero(acc);
  }
  const T* U = static_cast<const T*>(a.u);
  const T* Vv = static_cast<const T*>(a.v);
  for (int base = 0; base < L; base += kTR) {
    const int n = min(kTR, L - base);
    if (tid < kTR) {
      const float cv = tid < n ? cum[base + tid] : 0.0f;
      w[tid] = tid < n ? (kFwd ? expf(Lam - cv) : expf(cv)) : 0.0f;
    }
    __syncthreads();
    fill_tile<kTR, HP, LDH>(Us, [&](int r, int q) {
      return (r < n && q < hd) ? w[r] * to_float(U[(row0 + base + r) * g.di + h * hd + q]) : 0.0f;
    });
    load_tile<DP, LDD>(Vs, Vv + ((row0 + base) * g.nh + h) * ds, g.nh * g.ds, n, ds);
    __syncthreads();
    if constexpr (kTC) {
      tacc.template add<1, LDH, LDD, 1, false, kExactBf16<T>>(Us, Vs, n);  // w·U f32, V typed
    } else {
      mma16<RH, RD, 1, LDH, LDD, 1>(acc, Us, Vs, n, tm, tn);
    }
    __syncthreads();
  }
  float* out = a.out + g.state_base(b, c, h);
  if constexpr (kTC) {
    tacc.for_each([&](int pi, int nj, float v) {
      if (pi < hd && nj < ds) out[pi * ds + nj] = v;
    });
  } else {
#pragma unroll
    for (int i = 0; i < RH; ++i)
#pragma unroll
      for (int j = 0; j < RD; ++j) {
        const int pi = tm + 16 * i, nj = tn + 16 * j;
        if (pi < hd && nj < ds) out[pi * ds + nj] = acc[i][j];
      }
  }
}

// ---- K4/K6 ----------------------------------------------------------------------------------
// grid (element tiles, nh, B): one thread per state element (p, n), serial over the chunks.
template <class T>
__global__ void __launch_bounds__(kThreads, kStatePassBlocks)
state_pass_fwd_kernel(ChunkGeom g, SsmChunkFwd<T> p) {
  const Idx h = blockIdx.y, b = blockIdx.z, sb = b * g.nh + h;
  const Idx e = Idx(blockIdx.x) * kThreads + threadIdx.x, hds = g.hd * g.ds;
  if (blockIdx.x == 0) {
    const Idx rl = b * g.T + g.T - 1;
    for (Idx q = threadIdx.x; q < g.ds; q += kThreads)
      p.k_out[sb * g.ds + q] = to_float(p.k[(rl * g.nh + h) * g.ds + q]);
    for (Idx q = threadIdx.x; q < g.hd; q += kThreads)
      p.v_out[sb * g.hd + q] = to_float(p.x[rl * g.di + h * g.hd + q]);
  }
  if (e >= hds) return;
  const Idx pi = e / g.ds, n = e % g.ds, i0 = (b * g.T) * g.nh + h;
  const float sgm1 = p.dt[i0] * (1.0f - p.trap[i0]);
  float S = p.ssm_in[sb * hds + e] + sgm1 * (p.v_in[sb * g.hd + pi] * p.k_in[sb * g.ds + n]);
  const ChunkWalk w(g, b, h, e);
  const int nc = static_cast<int>(g.nc);
  pass_chunks(nc, nc - 1, p.chunk_states + w.state0, p.chunk_states_saved + w.state0,
              p.da_cumsum_saved + w.lam0, w.sstep, w.lstep, w.last_fix, S);
  p.final_states[sb * hds + e] = S;
  p.ssm_out[sb * hds + e] = S;
}

// ---- K5 -------------------------------------------------------------------------------------
// grid (nc·nt, nh, B); block = row tile J of chunk c (rows t of the tile, kTR at most).
// Shared: Qs [kTR][LDD] (Q_J), Ks [kTR][LDD] (Ks_I; first an n-slice [HP][kLS] of S_c),
// Xs [kTR][LDH] (X_I; X_J after the last I), MA [kTR][kLM], cumJ, cumI [kTR].
// Registers: y tile acc [kRM][RH], the A tile [kRM][kRM].
template <class T, int RH, int RD>
__global__ void __launch_bounds__(kCT)
chunk_scan_kernel(ChunkGeom g, SsmChunkFwd<T> p) {
  constexpr int HP = 16 * RH, DP = 16 * RD, LDH = HP + 4, LDD = DP + 4;
  constexpr int KS_SIZE = kTR * LDD > HP * kLS ? kTR * LDD : HP * kLS;
  extern __shared__ float sm[];
  float* Qs = sm;
  float* Ks = Qs + kTR * LDD;
  float* Xs = Ks + KS_SIZE;
  float* MA = Xs + kTR * LDH;
  float* cumJ = MA + kTR * kLM;
  float* cumI = cumJ + kTR;
  const int tid = threadIdx.x, tm = tid >> 4, tn = tid & 15;
  const Idx c = blockIdx.x / g.nt, h = blockIdx.y, b = blockIdx.z;
  const int J = static_cast<int>(blockIdx.x % g.nt);
  const int L = g.len(c), hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  if (J * kTR >= L) return;
  const int nJ = min(kTR, L - J * kTR);
  const Idx row0 = b * g.T + g.t0(c);
  const float* cum = p.da_cumsum_saved + g.cum_base(b, c, h);
  const Idx kst = g.nh * g.ds;

  load_tile<DP, LDD>(Qs, p.q + ((row0 + J * kTR) * g.nh + h) * ds, kst, nJ, ds);
  if (tid < kTR) cumJ[tid] = tid < nJ ? cum[J * kTR + tid] : 0.0f;
  const float* S = p.chunk_states_saved + g.state_base(b, c, h);
  // Source tile I: Ks ← Ks_I, Xs ← X_I, cumI (after a barrier; the caller syncs before use).
  auto load_source = [&](int I, int nI) {
    __syncthreads();
    load_tile<DP, LDD>(Ks, p.k_scaled_saved + ((row0 + I * kTR) * g.nh + h) * ds, kst, nI, ds);
    load_tile<HP, LDH>(Xs, p.x + (row0 + I * kTR) * g.di + h * hd, g.di, nI, hd);
    if (tid < kTR) cumI[tid] = tid < nI ? cum[I * kTR + tid] : 0.0f;
    __syncthreads();
  };

  if constexpr (kTensorProducts<T>) {
    // The same three terms on the tensor cores, in the accumulators' own layout (tc_mma.cuh):
    // inter = Q S_cᵀ, intra = Σ_I MA_I X_I, then y = e^{cum_t}·inter + intra + (D + qk)·x.
    tc::Acc<kTR, HP, kCT / 32> inter, intra;
    inter.zero();
    intra.zero();
    for (int n0 = 0; n0 < ds; n0 += kNK) {
      __syncthreads();
      load_nslice<HP>(Ks, S, hd, ds, n0);
      __syncthreads();
      inter.template add<LDD, 1, 1, kLS, kExactBf16<T>, false>(Qs + n0, Ks, min(kNK, ds - n0));
    }
    for (int I = 0; I <= J; ++I) {
      const int nI = min(kTR, L - I * kTR);
      load_source(I, nI);
      tc::Acc<kTR, kTR, kCT / 32> A;
      A.zero();
      A.template add<LDD, 1, 1, LDD, kExactBf16<T>, kExactBf16<T>>(Qs, Ks, ds);
      A.for_each([&](int t, int s, float v) {
        const bool on = t < nJ && s < nI && I * kTR + s < J * kTR + t;
        MA[t * kLM + s] = on ? expf(cumJ[t] - cumI[s]) * v : 0.0f;
      });
      __syncthreads();
      intra.template add<kLM, 1, LDH, 1, false, kExactBf16<T>>(MA, Xs, nI);
    }
    // Xs holds X_J after I = J.
    inter.for_each2(intra, [&](int t, int q, float vi, float va) {
      if (t >= nJ || q >= hd) return;
      const Idx r = row0 + J * kTR + t;
      const float dq = p.d_param[h] + p.qk_dot_saved[r * g.nh + h];
      p.y[r * g.di + h * hd + q] = from_float<T>(expf(cumJ[t]) * vi + va + dq * Xs[t * LDH + q]);
    });
    return;
  }

  // Inter-chunk term: acc = e^{cum_t} Σ_n Q[t][n] S_c[p][n], S_c streamed in n-slices.
  float acc[kRM][RH];
  zero(acc);
  for (int n0 = 0; n0 < ds; n0 += kNK) {
    __syncthreads();
    load_nslice<HP>(Ks, S, hd, ds, n0);
    __syncthreads();
    mma16<kRM, RH, LDD, 1, 1, kLS>(acc, Qs + n0, Ks, min(kNK, ds - n0), tm, tn);
  }
#pragma unroll
  for (int i = 0; i < kRM; ++i) {
    const float e = expf(cumJ[tm + 16 * i]);
#pragma unroll
    for (int j = 0; j < RH; ++j) acc[i][j] *= e;
  }

  // Intra-chunk term over source tiles I ≤ J.
  for (int I = 0; I <= J; ++I) {
    const int nI = min(kTR, L - I * kTR);
    load_source(I, nI);
    float A[kRM][kRM];
    zero(A);
    mma16<kRM, kRM, LDD, 1, 1, LDD>(A, Qs, Ks, ds, tm, tn);
#pragma unroll
    for (int i = 0; i < kRM; ++i)
#pragma unroll
      for (int j = 0; j < kRM; ++j) {
        const int t = tm + 16 * i, s = tn + 16 * j;
        const bool on = t < nJ && s < nI && I * kTR + s < J * kTR + t;
        MA[t * kLM + s] = on ? expf(cumJ[t] - cumI[s]) * A[i][j] : 0.0f;
      }
    __syncthreads();
    mma16<kRM, RH, kLM, 1, LDH, 1>(acc, MA, Xs, nI, tm, tn);
  }

  // Diagonal term (Xs holds X_J after I = J) and the store.
#pragma unroll
  for (int i = 0; i < kRM; ++i) {
    const int t = tm + 16 * i;
    if (t >= nJ) continue;
    const Idx r = row0 + J * kTR + t;
    const float dq = p.d_param[h] + p.qk_dot_saved[r * g.nh + h];
#pragma unroll
    for (int j = 0; j < RH; ++j) {
      const int q = tn + 16 * j;
      if (q < hd) p.y[r * g.di + h * hd + q] = from_float<T>(acc[i][j] + dq * Xs[t * LDH + q]);
    }
  }
}

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
// d_k_in[n] = sg_{−1}·Σ_p dS[p,n] v_in[p] (ascending p); dScale_{−1} = Σ_p v_in[p]·u[p].
template <class T>
__global__ void __launch_bounds__(kThreads)
entering_grad_kernel(ChunkGeom g, SsmChunkBwd<T> p, float* dscale_prev) {
  __shared__ float u[128];
  const Idx h = blockIdx.x, b = blockIdx.y, sb = b * g.nh + h;
  const Idx i0 = (b * g.T) * g.nh + h;
  const float sgm1 = p.dt[i0] * (1.0f - p.trap[i0]);
  const float* dS = p.d_ssm_in + sb * g.hd * g.ds;
  const float* kin = p.k_in + sb * g.ds;
  const float* vin = p.v_in + sb * g.hd;
  for (Idx q = threadIdx.x; q < g.hd; q += kThreads) {
    float s = 0.0f;
    for (Idx n = 0; n < g.ds; ++n) s += dS[q * g.ds + n] * kin[n];
    u[q] = s;
    p.d_v_in[sb * g.hd + q] = sgm1 * s;
  }
  for (Idx n = threadIdx.x; n < g.ds; n += kThreads) {
    float s = 0.0f;
    for (Idx q = 0; q < g.hd; ++q) s += dS[q * g.ds + n] * vin[q];
    p.d_k_in[sb * g.ds + n] = sgm1 * s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (Idx q = 0; q < g.hd; ++q) s += vin[q] * u[q];
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
    load_tile<HP, LDH, NT>(Xs, p.x + r * di + h * hd, di, nJ, hd);
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
    if (nt > 1) load_tile<HP, LDH, NT>(Xs, p.x + rI * di + h * hd, di, nI, hd);
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
          p.d_x[r * di + h * hd + q] =
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
// A block takes kTailRows consecutive rows r, all heads; producer warp w < kTailWarps takes heads
// h = w, w + kTailWarps, … of each row, lane l the 4 values n = 4l … 4l + 3 (the pairs
// j = 2l, 2l + 1; ds ≤ 128) of that (r, h), in 16-byte (f32) / 8-byte (T) accesses when kVec
// (ds % 4 == 0, na even, aligned rows), else element by element:
//   dv1 = scale·dK_mid (+ d_k_out at t = T−1), dv2 = dQ_mid, e = dQK·γ;
//   rotated pair (j < na, angle θ_j = theta[r, h, j], R its rotation):
//     d_b_pre_rope = Rᵀdv1 + e·c_biased, d_c_pre_rope = Rᵀdv2 + e·b_biased,
//     d_angle_cumsum_j = (−dv1_{2j}·k_{2j+1} + dv1_{2j+1}·k_{2j}) + (−dv2_{2j}·q_{2j+1} + dv2_{2j+1}·q_{2j});
//   other elements (j ≥ na, and the last one when ds is odd): the same without R;
//   dScale = Σ_n dK_mid·k, dGamma = dQK·Σ_n c_biased·b_biased (lane sums, then warp_sum).
// The formulas of rope_backward (rope.cu) with the qk extra; dv1 is never stored and dK_mid, k,
// c, b are read once.
// kRecompute: b_biased, c_biased, k, q are not read but recomputed, bit for bit the values F4 and
// F4ef stored: X_biased = T(float(X_normed[r, g(h)]) + X_bias[h]) (bcnorm.cu), k and q their
// T-rounded rotations by θ (rope_rotate, whose products and sums are pinned to the same
// roundings in every kernel). Reads [BT, ng, ds] instead of four [BT, nh, ds] tensors.
// kFuse (B4b's head sums, MODEL.md §6.2 B4b, done here while d_X_pre_rope is in registers):
//   the producers put the row's d_X_pre_rope into a shared row buffer (two, alternating between
//   rows) and add each of their own (h, n) elements, which are the same ones in every row, to
//   acc_X[h, n] in shared memory (ascending r); kTailConsumers extra warps then form
//     d_X_normed[r,g,n] = T( Σ_{h: g(h)=g} d_X_pre_rope[r,h,n] )   (ascending h from 0.0f: the
//   value bcnorm_backward_kernel computes). Producers and consumers meet at a named barrier,
//   bar.sync by every thread of the block, once per row: row r's buffer is read by the
//   consumers after the barrier of row r, and rewritten (row r + 2) by the producers only
//   after the barrier of row r + 1, which the consumers reach once done with row r. Producers
//   run at most one row ahead, which costs nothing measurable (the consumers keep up). An
//   earlier variant, where producers arrived (bar.arrive) on a "full" barrier per buffer and
//   waited on an "empty" one that the consumers arrived at, is ordered by the PTX barrier
//   model as well, but compute-sanitizer racecheck reported read/write hazards on the row
//   buffers in 4 of 6 runs; with bar.sync on both sides it reports none.
//   At the end acc_X is stored as the block's partial column sums part_X[block, h·ds + n];
//   the launcher sums them over the blocks with colsum_rows (a fixed order) into d X_bias.
// d_X_pre_rope are stored when the pointers are set (capture, isolated mode, unfused runs).
constexpr int kTailWarps = 16;     // producer warps
constexpr int kTailConsumers = 1;  // consumer warps (kFuse)
constexpr int tail_threads(bool fuse) { return 32 * (kTailWarps + (fuse ? kTailConsumers : 0)); }
constexpr Idx kTailRows = 64;    // rows per block: the bias partial sums' row chunk
constexpr int kTailBuffers = 6;  // kFuse: shared floats per nh·ds: acc_b, acc_c, two rows × (b, c)
constexpr int kBarRow = 1;  // the named barrier the producers and consumers meet at, per row

// bar.sync kId, threads: wait until `threads` threads (all of the block here) have arrived, at
// whatever point of the code each does (unlike __syncthreads, whose callers must share one
// call site). Warp-aligned: the whole warp must reach it converged, or the warp may count as
// arrived while some of its lanes still work (a lane that left a loop early, e.g. the
// consumer's column loop when ds < 32): __syncwarp() reconverges it first.
template <int kId>
__device__ __forceinline__ void named_sync(int threads) {
  __syncwarp();
  asm volatile("bar.sync %0, %1;" ::"n"(kId), "r"(threads) : "memory");
}

// The tail's launch geometry over a slab of rows (ssm_chunked_backward launches the tail once per
// slab, with TailArgs shifted to the slab's first row, so that every in-kernel offset fits 32
// bits: rows·nh·max(ds, na) < 2^31).
struct TailGeom {
  unsigned rows, nh, ds, na, ng, hpg, T;
  Idx r_base;     // the slab's first row (global): t = (r_base + r) mod T
  FastDiv group;  // h → g(h) = h / hpg
};

// The step-2 tensors (SsmChunkBwd's names), every [BT, ...] one starting at the slab's first row.
template <class T>
struct TailArgs {
  const float *scale_saved, *dQK_dot, *gamma_saved, *theta, *dK_mid, *dQ_mid;
  const T *k, *q, *b_biased, *c_biased;  // read unless kRecompute
  const T *b_normed, *c_normed;          // kRecompute: [rows, ng, ds]
  const float *b_bias, *c_bias, *d_k_out;  // [nh, ds], [B, nh, ds]: not shifted
  float *d_angle_cumsum, *d_b_pre_rope, *d_c_pre_rope, *dScale, *dGamma;
  T *d_b_normed, *d_c_normed;  // kFuse: [rows, ng, ds]
};

template <class T, bool kRecompute, bool kFuse, bool kVec>
__global__ void __launch_bounds__(tail_threads(kFuse), 2)
qk_rope_bwd_kernel(TailGeom tg, TailArgs<T> a, float* part_b, float* part_c) {
  // ds ≤ 128 (chunk_geom): lane l owns the 4 values n0 = 4l … 4l + 3 of a row (the pairs
  // j = 2l, 2l + 1); all of a row's loads are issued before any store. Offsets are 32-bit
  // (TailGeom); the time index t of row r is carried from row to row.
  constexpr int kAll = tail_threads(kFuse);
  extern __shared__ float tail_smem[];  // kFuse: acc_b, acc_c, rows[2] (b, c); nh·ds floats each
  const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned nh = tg.nh, ds = tg.ds, na = tg.na, nhds = nh * ds, n0 = 4 * lane;
  const bool has = n0 < ds;
  float *acc_b = tail_smem, *acc_c = acc_b + nhds;
  if constexpr (kFuse) {
    for (unsigned e = threadIdx.x; e < 2 * nhds; e += kAll) tail_smem[e] = 0.0f;
    __syncthreads();
  }
  const bool consumer = kFuse && warp >= kTailWarps;
  const unsigned r0 = blockIdx.x * unsigned(kTailRows);
  const unsigned r1 = r0 + unsigned(kTailRows) < tg.rows ? r0 + unsigned(kTailRows) : tg.rows;
  unsigned t = static_cast<unsigned>((tg.r_base + r0) % tg.T);
  for (unsigned r = r0; r < r1; ++r, t = t + 1 == tg.T ? 0 : t + 1) {
    const unsigned buf = (r - r0) & 1;
    float* row_b = acc_c + (1 + 2 * buf) * nhds;  // this row's buffers
    float* row_c = row_b + nhds;
    if (consumer) {
      named_sync<kBarRow>(kAll);  // every producer has stored row r
      // d_X_normed[r, g, n] = Σ_{h ∈ g} row_X[h, n], ascending h; the shared loads go out kU
      // at a time.
      const unsigned gds = tg.ng * ds;
      for (unsigned x = threadIdx.x - 32 * kTailWarps; x < 2 * gds; x += 32 * kTailConsumers) {
        const bool is_c = x >= gds;
        const unsigned gn = is_c ? x - gds : x;  // g·ds + n
        const float* col = (is_c ? row_c : row_b) + (gn / ds) * tg.hpg * ds + gn % ds;
        constexpr unsigned kU = 8;
        float sum = 0.0f;
        unsigned k = 0;
        for (; k + kU <= tg.hpg; k += kU) {
          float v[kU];
#pragma unroll
          for (unsigned u = 0; u < kU; ++u) v[u] = col[(k + u) * ds];
#pragma unroll
          for (unsigned u = 0; u < kU; ++u) sum += v[u];
        }
        for (; k < tg.hpg; ++k) sum += col[k * ds];
        (is_c ? a.d_c_normed : a.d_b_normed)[r * gds + gn] = from_float<T>(sum);
      }
      continue;
    }
    const bool last = t == tg.T - 1;  // t = T − 1: d_k_out enters the k path
    const float* dkout_row =
        last ? a.d_k_out + ((tg.r_base + r) / tg.T) * Idx(nhds) : nullptr;
    for (unsigned h = warp; h < nh; h += kTailWarps) {
      const unsigned i = r * nh + h, base = i * ds;
      const float sc = a.scale_saved[i], dqk = a.dQK_dot[i], e = dqk * a.gamma_saved[i];
      float dk[4], g2[4], kv[4], qv[4], cv[4], bv[4], th[2];
      if constexpr (kVec) {  // na is even, so both pairs are rotated or neither
        th[0] = th[1] = 0.0f;
        if (2 * lane < na) load_n<2>(a.theta + (i * na + 2 * lane), th);
      } else {
#pragma unroll
        for (unsigned u = 0; u < 2; ++u)
          th[u] = 2 * lane + u < na ? a.theta[i * na + 2 * lane + u] : 0.0f;
      }
      lane_load<kVec>(a.dK_mid, base, n0, ds, has, dk);
      lane_load<kVec>(a.dQ_mid, base, n0, ds, has, g2);
      if constexpr (kRecompute) {
        const unsigned gn = (r * tg.ng + tg.group.div(h)) * ds, hn = h * ds;
        float nb[4], nc[4], ab[4], ac[4];
        lane_load<kVec>(a.b_normed, gn, n0, ds, has, nb);
        lane_load<kVec>(a.c_normed, gn, n0, ds, has, nc);
        lane_load<kVec>(a.b_bias, hn, n0, ds, has, ab);
        lane_load<kVec>(a.c_bias, hn, n0, ds, has, ac);
#pragma unroll
        for (int v = 0; v < 4; ++v) bv[v] = nb[v] + ab[v], cv[v] = nc[v] + ac[v];
        // Values that only feed arithmetic: round_trip2 (NaN stays NaN).
        round_trip2<T>(bv[0], bv[1]), round_trip2<T>(bv[2], bv[3]);
        round_trip2<T>(cv[0], cv[1]), round_trip2<T>(cv[2], cv[3]);
      } else {
        lane_load<kVec>(a.k, base, n0, ds, has, kv);
        lane_load<kVec>(a.q, base, n0, ds, has, qv);
        lane_load<kVec>(a.b_biased, base, n0, ds, has, bv);
        lane_load<kVec>(a.c_biased, base, n0, ds, has, cv);
      }
      float dkout[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (last) lane_load<kVec>(dkout_row, h * ds, n0, ds, has, dkout);
      float db[4], dc[4], dang[2];
      float dsc = 0.0f, qk = 0.0f;
#pragma unroll
      for (int u = 0; u < 2; ++u) {  // pair j = 2·lane + u: values 2u, 2u + 1 of the lane's 4
        const unsigned j = 2 * lane + u;
        const int a0 = 2 * u, a1 = 2 * u + 1;
        float sn = 0.0f, cs = 1.0f;
        if (j < na) sincosf(th[u], &sn, &cs);
        if constexpr (kRecompute) {  // k, q as F4ef stored them (copies for j ≥ na)
          kv[a0] = bv[a0], kv[a1] = bv[a1], qv[a0] = cv[a0], qv[a1] = cv[a1];
          if (j < na) {
            rope_rotate(sn, cs, bv[a0], bv[a1], kv[a0], kv[a1]);
            rope_rotate(sn, cs, cv[a0], cv[a1], qv[a0], qv[a1]);
            round_trip2<T>(kv[a0], kv[a1]);
            round_trip2<T>(qv[a0], qv[a1]);
          }
        }
        // Values past ds are 0 in every input, so they add 0 to the sums and are not stored.
        const float g1[2] = {sc * dk[a0] + dkout[a0], sc * dk[a1] + dkout[a1]};
        dsc += dk[a0] * kv[a0];
        qk += cv[a0] * bv[a0];
        dsc += dk[a1] * kv[a1];
        qk += cv[a1] * bv[a1];
        float o1[2] = {g1[0], g1[1]}, o2[2] = {g2[a0], g2[a1]};
        dang[u] = 0.0f;
        if (j < na) {
          rope_rotate_t(sn, cs, g1[0], g1[1], o1[0], o1[1]);
          rope_rotate_t(sn, cs, g2[a0], g2[a1], o2[0], o2[1]);
          dang[u] = rope_angle_grad(g1[0], g1[1], kv[a0], kv[a1]) +
                    rope_angle_grad(g2[a0], g2[a1], qv[a0], qv[a1]);
        }
        db[a0] = o1[0] + e * cv[a0], db[a1] = o1[1] + e * cv[a1];
        dc[a0] = o2[0] + e * bv[a0], dc[a1] = o2[1] + e * bv[a1];
      }
      if constexpr (kVec) {
        if (2 * lane < na) store_n<2>(a.d_angle_cumsum + (i * na + 2 * lane), dang);
      } else {
#pragma unroll
        for (unsigned u = 0; u < 2; ++u)
          if (2 * lane + u < na) a.d_angle_cumsum[i * na + 2 * lane + u] = dang[u];
      }
      if (a.d_b_pre_rope) {
        lane_store<kVec>(a.d_b_pre_rope, base, n0, ds, has, db);
        lane_store<kVec>(a.d_c_pre_rope, base, n0, ds, has, dc);
      }
      if constexpr (kFuse) {
        const unsigned hn = h * ds;
        lane_store<kVec>(row_b, hn, n0, ds, has, db);
        lane_store<kVec>(row_c, hn, n0, ds, has, dc);
        float ab[4], ac[4];
        lane_load<kVec>(acc_b, hn, n0, ds, has, ab);
        lane_load<kVec>(acc_c, hn, n0, ds, has, ac);
#pragma unroll
        for (int v = 0; v < 4; ++v) ab[v] += db[v], ac[v] += dc[v];
        lane_store<kVec>(acc_b, hn, n0, ds, has, ab);
        lane_store<kVec>(acc_c, hn, n0, ds, has, ac);
      }
      dsc = warp_sum(dsc);
      qk = warp_sum(qk);
      if (lane == 0) {
        a.dScale[i] = dsc;
        a.dGamma[i] = dqk * qk;
      }
    }
    // Row r stored. Returns once the consumer is here too, i.e. done with row r − 1, whose
    // buffer the producers fill next (row r + 1).
    if constexpr (kFuse) named_sync<kBarRow>(kAll);
  }
  if constexpr (kFuse) {
    __syncthreads();  // every owner's last acc_X update is done
    for (unsigned x = threadIdx.x; x < nhds; x += kAll) {
      part_b[Idx(blockIdx.x) * nhds + x] = acc_b[x];
      part_c[Idx(blockIdx.x) * nhds + x] = acc_c[x];
    }
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

// ---- launch helpers ---------------------------------------------------------------------------


ChunkGeom chunk_geom(const Dims& d) {
  M3_REQUIRE(d.hd >= 1 && d.ds >= 1 && d.nh >= 1 && d.B >= 1 && d.T >= 1 && d.cs >= 1,
             kChunkWhere, "bad dims", "B=", d.B, " T=", d.T, " nh=", d.nh, " headdim=", d.hd,
             " d_state=", d.ds, " chunk_size=", d.cs);
  M3_REQUIRE(d.hd <= 128 && d.ds <= 128, kChunkWhere, "unsupported SSM shape",
             "headdim=", d.hd, " d_state=", d.ds, " (the GPU scan supports headdim ≤ 128 and "
             "d_state ≤ 128)");
  M3_REQUIRE(d.nc == (d.T + d.cs - 1) / d.cs, kChunkWhere, "n_chunks != ceil(T / chunk_size)",
             "nc=", d.nc, " T=", d.T, " chunk_size=", d.cs);
  M3_REQUIRE(d.di == d.nh * d.hd, kChunkWhere, "d_inner != nheads·headdim", "d_inner=", d.di,
             " nheads=", d.nh, " headdim=", d.hd);
  M3_REQUIRE(d.nh <= 65535 && d.B <= 65535, kChunkWhere, "grid too large", "nheads=", d.nh,
             " B=", d.B, " (each ≤ 65535)");
  const Idx lmax = std::min(d.cs, d.T);
  const int nt = static_cast<int>((lmax + kTR - 1) / kTR);
  M3_REQUIRE(d.nc * nt <= 0x7fffffff, kChunkWhere, "grid too large", "chunks=", d.nc,
             " tiles per chunk=", nt);
  return ChunkGeom{d.B, d.T, d.nh, d.hd, d.ds, d.di, d.cs, d.nc, nt};
}


// Leading dimensions: odd (16R + 1) for chunk_state_kernel's scalar reads, 16R + 4 for the
// float4 rows of chunk_scan_kernel and chunk_bwd_kernel.
constexpr std::size_t ld_odd(int r) { return 16 * r + 1; }
constexpr std::size_t ld_vec(int r) { return 16 * r + 4; }

// The product tile Cs of the typed runs (0 floats in f32 runs): rows × ld_c(widest RN).
std::size_t cs_floats(bool typed, int rows, int rn) {
  return typed ? std::size_t(rows) * ld_c(rn) : 0;
}
std::size_t smem_chunk_state(int rh, int rd, bool typed) {
  return typed ? sizeof(float) * (kTR * ld_vec(rh) + kTR * ld_vec(rd) + kTR + 1)
               : sizeof(float) * (kTR * ld_odd(rh) + kTR * ld_odd(rd) + kTR + 1);
}
std::size_t smem_chunk_scan(int rh, int rd) {
  const std::size_t ks = std::max<std::size_t>(kTR * ld_vec(rd), 16 * rh * std::size_t(kLS));
  return sizeof(float) * (kTR * ld_vec(rd) + ks + kTR * ld_vec(rh) + kTR * kLM + 2 * kTR);
}
std::size_t smem_chunk_bwd(int rh, int rd, bool typed) {
  return sizeof(float) * (2 * kTR * ld_vec(rd) + 2 * kTR * ld_vec(rh) + 2 * kTR * kLM + 4 * kTR +
                          (kBwdThreads / 32) * kTR + 32 + 4 +
                          cs_floats(typed, kTR, std::max({rh, rd, kTR / 16})));
}


Idx round64(Idx n) { return (n + 63) / 64 * 64; }


// The step-2 partial column sums (kFuse) reuse dS's space: dS is dead once B3 has run.
Idx tail_blocks(const Dims& d) { return (d.BT + kTailRows - 1) / kTailRows; }
// part_b, part_c [tail_blocks, nh·ds], then colsum_rows' own scratch for their column sums.
Idx tail_partials(const Dims& d) { return round64(tail_blocks(d) * d.nh * d.ds); }
Idx tail_colsum_scratch(const Dims& d) {
  return round64(colsum_scratch_floats(tail_blocks(d), d.nh * d.ds));
}
Idx first_region(const Dims& d) {
  return std::max(round64(d.B * d.nc * d.nh * d.hd * d.ds),
                  2 * tail_partials(d) + tail_colsum_scratch(d));
}
std::size_t tail_smem_bytes(const Dims& d) { return sizeof(float) * kTailBuffers * d.nh * d.ds; }
constexpr std::size_t kTailSmemMax = 110 * 1024;  // two tail blocks per SM

struct BwdScratch {
  float *dS, *dscale_prev;
  float *part_b, *part_c, *part_sums;  // step 2's bias partial sums (and their colsum), over dS
};

BwdScratch carve(const Dims& d, Scratch scratch) {
  require_scratch(scratch, ssm_chunked_scratch_floats(d), "gpu::ssm_chunked_backward");
  BwdScratch s{};
  s.dS = scratch.p;
  s.part_b = scratch.p;
  s.part_c = s.part_b + tail_partials(d);
  s.part_sums = s.part_c + tail_partials(d);
  s.dscale_prev = s.dS + first_region(d);
  return s;
}

// p's step-2 tensors, each [BT, ...] one from row r0 on (null stays null).
template <class T>
TailArgs<T> tail_args(const SsmChunkBwd<T>& p, const Dims& d, Idx r0) {
  const Idx rd = r0 * d.nh * d.ds, rs = r0 * d.nh, ra = r0 * d.nh * d.na, rg = r0 * d.ng * d.ds;
  return TailArgs<T>{shifted(p.scale_saved, rs), shifted(p.dQK_dot, rs),
                     shifted(p.gamma_saved, rs), shifted(p.theta, ra),
                     shifted(p.dK_mid, rd),      shifted(p.dQ_mid, rd),
                     shifted(p.k, rd),           shifted(p.q, rd),
                     shifted(p.b_biased, rd),    shifted(p.c_biased, rd),
                     shifted(p.b_normed, rg),    shifted(p.c_normed, rg),
                     p.b_bias,                   p.c_bias,
                     p.d_k_out,                  shifted(p.d_angle_cumsum, ra),
                     shifted(p.d_b_pre_rope, rd), shifted(p.d_c_pre_rope, rd),
                     shifted(p.dScale, rs),      shifted(p.dGamma, rs),
                     shifted(p.d_b_normed, rg),  shifted(p.d_c_normed, rg)};
}

dim3 grid3(Idx x, Idx y, Idx z) {
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(z));
}

}  // namespace

void set_row_slab_limit_for_testing(Idx rows) {
  M3_REQUIRE(rows >= 0, "gpu::set_row_slab_limit_for_testing", "negative row limit", "rows=", rows);
  g_slab_limit = rows;
}

Idx ssm_chunked_scratch_floats(const Dims& d) { return first_region(d) + round64(d.B * d.nh); }

bool ssm_chunked_tail_fuses(const Dims& d) { return tail_smem_bytes(d) <= kTailSmemMax; }

namespace {

// K2/K3 (cumsums, chunk contributions) and K4/K6 (state passing): shared by the forward and
// the backward's recompute (ssm_chunked_states).
template <class T, int RH, int RD>
void launch_states(cudaStream_t s, const Dims& d, const ChunkGeom& g, bool planes,
                   const SsmChunkFwd<T>& p) {
  const ChunkStateArgs a{p.x, p.k_scaled_saved, p.adt, p.da_cumsum_saved, nullptr, nullptr,
                         p.chunk_states};
  if (planes) {
    if constexpr (kTensorProducts<T>) chunk_state_tc<T, true>(s, g, a);
  } else {
    auto k23 = chunk_state_kernel<T, RH, RD, true>;
    const std::size_t sm23 = smem_chunk_state(RH, RD, kTensorProducts<T>);
    set_smem(k23, sm23);
    k23<<<grid3(d.nc, d.nh, d.B), kCT, sm23, s>>>(g, a);
    M3_LAUNCH_CHECK();
  }
  state_pass_fwd_kernel<T>
      <<<grid3(blocks_for(d.hd * d.ds, kThreads), d.nh, d.B), kThreads, 0, s>>>(g, p);
  M3_LAUNCH_CHECK();
}

}  // namespace

// Typed runs whose chunks fit one row tile (the usual case: chunk_size ≤ 64) take the plane
// kernels (chunk_state_tc.cu, chunk_fwd_tc.cu, chunk_bwd_tc.cu; instantiated for bf16 and f16
// only, hence the if constexpr); f32 runs and longer chunks the tiled kernels of this file.
template <class T>
void ssm_chunked_forward(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p, Scratch) {
  const ChunkGeom g = chunk_geom(d);
  const bool planes = kTensorProducts<T> && g.nt == 1;
  if (!p.prep_done) launch_prep<T, false>(s, d, p, nullptr);
  with_pads(d.hd, d.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    launch_states<T, RH, RD>(s, d, g, planes, p);
    if (planes) {
      if constexpr (kTensorProducts<T>) chunk_scan_tc<T>(s, g, p);
    } else {
      auto k5 = chunk_scan_kernel<T, RH, RD>;
      const std::size_t sm5 = smem_chunk_scan(RH, RD);
      set_smem(k5, sm5);
      k5<<<grid3(d.nc * g.nt, d.nh, d.B), kCT, sm5, s>>>(g, p);
      M3_LAUNCH_CHECK();
    }
  });
}

template <class T>
void ssm_chunked_states(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p) {
  M3_REQUIRE(p.prep_done, kChunkWhere, "the chunk states need the prep's outputs",
             "run ssm_chunked_rope_prep first (prep_done = true)");
  const ChunkGeom g = chunk_geom(d);
  const bool planes = kTensorProducts<T> && g.nt == 1;
  with_pads(d.hd, d.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    launch_states<T, RH, RD>(s, d, g, planes, p);
  });
}

template <class T>
void ssm_chunked_rope_prep(cudaStream_t s, const Dims& d, const RopePrep<T>& rp,
                           const SsmChunkFwd<T>& p) {
  chunk_geom(d);  // checks the shape
  M3_REQUIRE(d.na >= 0 && 2 * d.na <= d.ds && d.ng >= 1 && d.hpg * d.ng == d.nh, kChunkWhere,
             "bad dims", "na=", d.na, " ds=", d.ds, " ng=", d.ng, " hpg=", d.hpg, " nh=", d.nh);
  M3_REQUIRE(rp.b_normed && rp.c_normed && rp.b_bias && rp.c_bias && rp.k && rp.q &&
                 (d.na == 0 || rp.theta),
             kChunkWhere, "missing rope_prep arguments", "b/c_normed, b/c_bias, theta, k, q");
  launch_prep<T, true>(s, d, p, &rp);
}

template <class T>
void ssm_chunked_backward(cudaStream_t s, const Dims& d, const SsmChunkBwd<T>& p,
                          Scratch scratch) {
  constexpr bool kTyped = kTensorProducts<T>;
  const ChunkGeom g = chunk_geom(d);
  const bool planes = kTyped && g.nt == 1;
  M3_REQUIRE(d.na >= 0 && 2 * d.na <= d.ds, kChunkWhere, "bad dims", "na=", d.na, " ds=", d.ds,
             " (needs 2·na ≤ ds)");
  const bool fuse = p.d_b_normed != nullptr, recompute = p.b_normed != nullptr;
  M3_REQUIRE(fuse || (p.d_b_pre_rope && p.d_c_pre_rope), kChunkWhere, "no step-2 output",
             "set d_b/c_pre_rope, or d_b/c_normed for the fused head sums");
  M3_REQUIRE(!fuse || (p.d_c_normed && p.d_b_bias && p.d_c_bias), kChunkWhere,
             "incomplete fused head sums", "d_b_normed needs d_c_normed, d_b_bias and d_c_bias");
  M3_REQUIRE(!fuse || ssm_chunked_tail_fuses(d), kChunkWhere,
             "the fused head sums do not fit this shape", "nheads·d_state = ", d.nh * d.ds,
             " needs ", tail_smem_bytes(d), " bytes of shared memory, limit ", kTailSmemMax,
             " (check ssm_chunked_tail_fuses)");
  M3_REQUIRE(recompute ? (p.c_normed && p.b_bias && p.c_bias)
                       : (p.k && p.q && p.b_biased && p.c_biased),
             kChunkWhere, "missing step-2 inputs",
             recompute ? "b_normed needs c_normed, b_bias and c_bias"
                       : "k, q, b_biased and c_biased are required without b_normed");
  M3_REQUIRE(d.ng >= 1 && d.hpg * d.ng == d.nh, kChunkWhere, "bad dims", "ng=", d.ng,
             " hpg=", d.hpg, " nh=", d.nh);
  const BwdScratch w = carve(d, scratch);
  const Idx rows = d.BT * d.nh;
  with_pads(d.hd, d.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    const ChunkStateArgs a{p.d_y, p.q, nullptr, nullptr, p.da_cumsum_saved, p.da_cs_sum, w.dS};
    if (planes) {
      if constexpr (kTyped) chunk_state_tc<T, false>(s, g, a);
    } else {
      auto k1 = chunk_state_kernel<T, RH, RD, false>;
      const std::size_t sm1 = smem_chunk_state(RH, RD, kTyped);
      set_smem(k1, sm1);
      k1<<<grid3(d.nc, d.nh, d.B), kCT, sm1, s>>>(g, a);
      M3_LAUNCH_CHECK();
    }
    state_pass_bwd_kernel<<<grid3(blocks_for(d.hd * d.ds, kThreads), d.nh, d.B), kThreads, 0,
                            s>>>(g, p.da_cumsum_saved, p.d_ssm_out, w.dS, p.d_ssm_in);
    M3_LAUNCH_CHECK();
    entering_grad_kernel<T><<<grid3(d.nh, d.B, 1), kThreads, 0, s>>>(g, p, w.dscale_prev);
    M3_LAUNCH_CHECK();
    if (planes) {
      if constexpr (kTyped) chunk_bwd_tc<T>(s, g, p, w.dS);
    } else {
      auto k3 = chunk_bwd_kernel<T, RH, RD>;
      const std::size_t sm3 = smem_chunk_bwd(RH, RD, kTyped);
      set_smem(k3, sm3);
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
  const unsigned int tail_grid = static_cast<unsigned int>(tail_blocks(d));
  // Vector accesses: 4-value groups of the [.., ds] rows and θ pairs of the [.., na] rows.
  const bool vec = d.ds % 4 == 0 && d.na % 2 == 0 &&
                   all_aligned(16, p.dK_mid, p.dQ_mid, p.d_b_pre_rope, p.d_c_pre_rope, p.d_k_out,
                               p.b_bias, p.c_bias) &&
                   all_aligned(8, p.theta, p.d_angle_cumsum) &&
                   all_aligned(4 * sizeof(T), p.k, p.q, p.b_biased, p.c_biased, p.b_normed,
                               p.c_normed);
  // Slabs of whole tail blocks whose offsets fit 32 bits (one slab up to 2^31 / (nh·ds) rows).
  const Idx slab = slab_rows(d, kTailRows);
  with_flags(recompute, fuse, [&](auto recompute_c, auto fuse_c) {
    constexpr bool kR = decltype(recompute_c)::value, kF = decltype(fuse_c)::value;
    auto k2 = vec ? qk_rope_bwd_kernel<T, kR, kF, true> : qk_rope_bwd_kernel<T, kR, kF, false>;
    const std::size_t sm2 = kF ? tail_smem_bytes(d) : 0;
    set_smem(k2, sm2);
    for (Idx r0 = 0; r0 < d.BT; r0 += slab) {
      const Idx rows_here = std::min(slab, d.BT - r0);
      const TailGeom tg{static_cast<unsigned>(rows_here), static_cast<unsigned>(d.nh),
                        static_cast<unsigned>(d.ds),      static_cast<unsigned>(d.na),
                        static_cast<unsigned>(d.ng),      static_cast<unsigned>(d.hpg),
                        static_cast<unsigned>(d.T),       r0,
                        FastDiv(d.hpg)};
      const Idx part0 = r0 / kTailRows * d.nh * d.ds;
      k2<<<static_cast<unsigned>((rows_here + kTailRows - 1) / kTailRows), tail_threads(kF), sm2,
           s>>>(tg, tail_args(p, d, r0), w.part_b + part0, w.part_c + part0);
      M3_LAUNCH_CHECK();
    }
  });
  if (fuse) {
    const Idx nhds = d.nh * d.ds;
    const Scratch sums{w.part_sums, tail_colsum_scratch(d)};
    colsum_rows(s, tail_grid, nhds, LoadMatrix{w.part_b, nhds}, p.d_b_bias, true, sums,
                kChunkWhere);
    colsum_rows(s, tail_grid, nhds, LoadMatrix{w.part_c, nhds}, p.d_c_bias, true, sums,
                kChunkWhere);
  }
  ddt_dtrap_kernel<T><<<grid_for(rows, kThreads), kThreads, 0, s>>>(g, p, w.dscale_prev);
  M3_LAUNCH_CHECK();
}

#define M3_INSTANTIATE(T)                                                                   \
  template void ssm_chunked_forward<T>(cudaStream_t, const Dims&, const SsmChunkFwd<T>&,    \
                                       Scratch);                                            \
  template void ssm_chunked_backward<T>(cudaStream_t, const Dims&, const SsmChunkBwd<T>&,   \
                                        Scratch);                                            \
  template void ssm_chunked_rope_prep<T>(cudaStream_t, const Dims&, const RopePrep<T>&,      \
                                         const SsmChunkFwd<T>&);                             \
  template void ssm_chunked_states<T>(cudaStream_t, const Dims&, const SsmChunkFwd<T>&);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
