// F6 as a chunked (parallel) scan, K0–K6 (MODEL.md §5.2, entering states §5.3/§12.4), and its
// backward, steps 1–3 of §6.4 (step 4 is B5b, split.cu). Internal to scan/: what the files of
// the family share — chunked_prep.cu (K0/K1, with F4ef fused in), chunked_fwd.cu (K2–K6),
// chunked_bwd.cu (the backward: B1–B3, dD, the tail of step 2, step 3) — and the tensor-core
// plane kernels chunk_state_tc.cu, chunk_fwd_tc.cu, chunk_bwd_tc.cu. Same formulas as
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
// sums 2·⌈BT/64⌉·nh·ds + their column-sum scratch) + B·nh (dScale_{−1}) + the cluster tail's
// region beside them (written while B3 reads dS; only when the cluster tail runs): its
// head-sum partials 2·(nh/cz)·BT·ds, its bias partials 2·B·nc·nh·ds and their column-sum
// scratch; each rounded up to 64.
// The tail fused into B3 (chunk_bwd_tc.cu kTail, chunk_tail.cuh): typed runs with chunks ≤ 64 and
// an even number of heads per group run step 2 and B4b's head sums in B3's blocks, in clusters
// of cz heads (cz = 8, 4 or 2, dividing hpg) that add their d_X_pre_rope rows through
// distributed shared memory; dQ_mid and dK_mid stay on chip.
// Index arithmetic: the per-row kernels (K0/K1's prep, step 2's tail) work in 32-bit offsets;
// their launchers split the rows into slabs (slab_rows: rows·nh·ds < 2^31) and shift the
// pointers to each slab's first row, so any shape works and the common one is one launch. The
// state passing walks its chunks by pointer steps (pass_chunks).
// Determinism: no atomics; every output has one writer; every sum runs in a fixed order.
#pragma once

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

namespace chunked_detail {
// set_row_slab_limit_for_testing's value (0: none), shared by the prep and the tail.
inline Idx& slab_limit() {
  static Idx v = 0;
  return v;
}
// K0/K1 (chunked_prep.cu): with rp, F4ef fused in (ssm_chunked_rope_prep), else reading k, q.
template <class T>
void chunked_prep(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p, const RopePrep<T>* rp);
}  // namespace chunked_detail

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
      v = state_step(dv[k], v, cv[k]);
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
// (load_row_group). U: what the values are for (convert.cuh).
template <bool kVec, Use U = Use::kStored, class X>
__device__ __forceinline__ void lane_load(const X* x, unsigned row, unsigned n0, unsigned len,
                                          bool has, float (&v)[4]) {
  if constexpr (kVec) {
    if (has) {
      load_vec<4, U>(x + (row + n0), v);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) v[e] = 0.0f;
    }
  } else {
    load_row_group<false, U>(x + row, n0, len, v);
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
inline Idx slab_rows(const Dims& d, Idx align) {
  Idx rows = 0x7fff0000 / (d.nh * d.ds);
  const Idx limit = chunked_detail::slab_limit();
  if (limit > 0) rows = std::min(rows, limit);
  return std::max<Idx>(1, rows / align) * align;
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
      return (r < n && q < hd) ? w[r] * to_float(U[(row0 + base + r) * a.ldu + h * hd + q]) : 0.0f;
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

// ---- launch helpers ---------------------------------------------------------------------------


inline ChunkGeom chunk_geom(const Dims& d) {
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
  return ChunkGeom{d.B, d.T, d.nh, d.hd, d.ds, d.di, d.cs, d.nc, nt, d.di};
}
// chunk_geom with x's and d_x's row stride (SsmChunkFwd/Bwd::ldx; 0: d_inner, contiguous).
inline ChunkGeom with_ldx(ChunkGeom g, Idx ldx) {
  g.ldx = row_stride(ldx, g.di, kChunkWhere, "x");
  return g;
}


// Leading dimensions: odd (16R + 1) for chunk_state_kernel's scalar reads, 16R + 4 for the
// float4 rows of chunk_scan_kernel and chunk_bwd_kernel.
constexpr std::size_t ld_odd(int r) { return 16 * r + 1; }
constexpr std::size_t ld_vec(int r) { return 16 * r + 4; }

// The product tile Cs of the typed runs (0 floats in f32 runs): rows × ld_c(widest RN).
inline std::size_t cs_floats(bool typed, int rows, int rn) {
  return typed ? std::size_t(rows) * ld_c(rn) : 0;
}
inline std::size_t smem_chunk_state(int rh, int rd, bool typed) {
  return typed ? sizeof(float) * (kTR * ld_vec(rh) + kTR * ld_vec(rd) + kTR + 1)
               : sizeof(float) * (kTR * ld_odd(rh) + kTR * ld_odd(rd) + kTR + 1);
}
inline std::size_t smem_chunk_scan(int rh, int rd) {
  const std::size_t ks = std::max<std::size_t>(kTR * ld_vec(rd), 16 * rh * std::size_t(kLS));
  return sizeof(float) * (kTR * ld_vec(rd) + ks + kTR * ld_vec(rh) + kTR * kLM + 2 * kTR);
}
inline std::size_t smem_chunk_bwd(int rh, int rd, bool typed) {
  return sizeof(float) * (2 * kTR * ld_vec(rd) + 2 * kTR * ld_vec(rh) + 2 * kTR * kLM + 4 * kTR +
                          (kBwdThreads / 32) * kTR + 32 + 4 +
                          cs_floats(typed, kTR, std::max({rh, rd, kTR / 16})));
}


inline Idx round64(Idx n) { return (n + 63) / 64 * 64; }


inline dim3 grid3(Idx x, Idx y, Idx z) {
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y), static_cast<unsigned>(z));
}

// The official RoPE layout, ds = 128 and na = 32, which the prep's and the tail's kFull compile
// in: a lane's rotated and unrotated pairs are known from its index.
inline bool rope_layout_full(const Dims& d) { return d.ds == 128 && d.na == 32; }

}  // namespace

}  // namespace m3::gpu
