// K2/K3 (forward) and B1 (backward) of the chunked scan, alone (chunk_state_tc) or with the
// state passing K4/K6 / B2 in one walk per (b, h) (chunk_walk_tc: S_{c+1} = e^{Λ_c}·S_c + out_c,
// forward over c ascending from S_0, backward over c descending from ∂L/∂S_leaving; see the
// walk's comment below). The per-chunk product, as in (MODEL.md §5.2, §6.4; chunk_state_kernel
// of gpu/scan/chunked_detail.cuh, whose header states the algorithm) for typed runs (bf16 / f16) whose
// chunks fit one row tile (L ≤ kTR = 64), on the tensor cores with the operands in 16-bit planes
// and the accumulators in registers (gpu/tc_frag.cuh). Per (b, h, c) [grid (nc, nh, B), 256
// threads], rows s < L, row0 = b·T + t0(c):
//   out[p][n] = Σ_s w_s U[s][p] V[s][n]          (p < hd, n < ds; [hd][ds] f32 at state_base)
//   forward  (K2/K3): cum_s = Σ_{s' ≤ s} adt[row0 + s'][h] (f32, serial, ascending) →
//                     da_cumsum_saved (slots [L, cs) zero); Λ = cum_{L−1}; w_s = e^{Λ − cum_s};
//                     U = x [BT, di] (columns h·hd…, row stride a.ldu = g.ldx),
//                     V = k_scaled_saved [BT, nh, ds] (typed);
//                     out = chunk_states (the contributions)
//   backward (B1):    cum read from da_cumsum_saved; da_cs_sum[b, c, h] = cum_{L−1};
//                     w_s = e^{cum_s}; U = d_y (like x), V = q (like k); out = dcontrib (dS)
// Steps:
//   1. Warp 0 loads its row scalars (adt / cum of rows lane, lane + 32) into registers; then all
//      threads issue the tile loads (tc_tiles.cuh: aligned rows by cp.async straight into the
//      planes, so their latency overlaps step 2): U → [64][HP], V → [64][DQ], one plane of the
//      storage values each (tc_frag.cuh);
//      rows ≥ L and columns ≥ hd / ds zero.
//   2. Warp 0: forward, the cumsum — every lane runs the same serial f32 sum over the 64 values
//      (shuffled from their lanes, ascending), keeping cum of its two rows: the same additions in
//      the same order as the reference and chunk_state_kernel (rows ≥ L add +0, a no-op: the sum
//      starts at +0 and is never −0), so da_cumsum_saved matches them bit for bit; it stores
//      da_cumsum_saved, and w_s (0 for s ≥ L) in shared memory; the other threads zero the
//      slots [64, cs). Backward: w_s = e^{cum_s}; lane 0 stores da_cs_sum. The walk's forward
//      reads cum like the backward (chunk_cumsum_kernel, launched before it, forms the same
//      sums), w_s = e^{Λ − cum_s} (Weights::kCumFwd).
//   3. W = w ⊙ U in place over U's planes: W[s][p] = w_s·U[s][p] in f32 (__fmul_rn: not
//      contracted with the split), split into hi/lo of the run's type (tc_frag.cuh: bf16 runs
//      tc::split2; f16 runs tc::split2_f16 scaled by W's power of two, from the block's max of
//      |W| — one more barrier — and the product brought back by it).
//   4. out = Wᵀ·V on Frag<HP, DQ, 8> (m = p, n = n, k = s < 64: A = W stored [k][m], B = V
//      stored [k][n], both loaded transposed), stored as float2 pairs when ds is even.
// Why scale U (not V): chunk_state_kernel forms w_s·U[s][p] in f32 and splits it, V staying the
// typed value (exact in bf16); scaling U here gives the very same operand planes (the products
// then differ from it only in the f32 accumulation order: tc_frag.cuh keeps one accumulator,
// tc_mma.cuh's Acc two), and U is the narrower tile (HP ≤ DP at the usual shapes), so step 3
// touches fewer values. Cost is the same either way: the scaled operand is split, the other is
// exact (2 mma per k-step and tile, bf16 mma for bf16 runs, f16 mma for f16 runs).
// Shapes: HP = 16·RH ≥ hd, DP = 16·RD ≥ ds (RH, RD ∈ {2, 4, 8}). Frag<HP, N, 8> needs an even
// number of n-tiles per warp; every (HP, DP) gives one but (32, 32) (2 × 4 warps, one n-tile
// each): there V's plane is widened to DQ = 64 (zero columns ≥ ds; the extra products are
// zeros that are never stored). Else DQ = DP.
// Shared memory (16-bit elements, then floats): U/W [64][HP] hi, lo; V [64][DQ] (one plane of
// the storage values); w [64]; the warps' maxima [8]. HP = 64, DP = 128 (bf16 or f16): 36,128
// bytes.
// wgmma (sm_90a builds, HP = 64 and DQ = 64 or 128: kWgmmaS): the planes in wgmma's 128-byte
// swizzle on 1024-byte alignment, step 4 as a wgmma chain of two warpgroups (wg::frag_add, the
// bits of Frag::add: tests/gpu/test_tc_wgmma.cu); the walk's stages on 1024 bytes.
// Precision: tc_frag.cuh (W split to 16 (bf16 runs) or 22 (f16 runs, relative to W's max)
// significant bits, V exact; products ≈ 2⁻¹⁶ / 2⁻²² of Σ|terms|,
// f32 accumulation, k ascending). Determinism: fixed order everywhere, no atomics, one writer
// per output (out, da_cumsum_saved, da_cs_sum).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "chunk_state_tc.cuh"
#include "convert.cuh"
#include "tc_frag.cuh"
#include "tc_tiles.cuh"
#include "tc_wgmma.cuh"

namespace m3::gpu {

namespace {

using tcf::bf16;

constexpr int kNT = tcf::kTileThreads, kNW = kNT / 32;

// Whether this build has a wgmma instantiation for these widths (tc_wgmma.cuh, wg::kBuild):
// the product's Frag<HP, DQ, 8> must have 64 rows (HP = 64) and two warpgroups' halves of 32 or
// 64 columns (DQ = 64 or 128). The launchers take it unless a test turned it off
// (set_chunked_wgmma_for_testing) to hold it to the mma.sync bits.
constexpr int dq_of(int hp, int dp) { return hp == 32 && dp == 32 ? 64 : dp; }  // see the header
template <int HP, int DP>
constexpr bool kWgmmaS = wg::kBuild && HP == 64 && (dq_of(HP, DP) == 64 || dq_of(HP, DP) == 128);
// The launchers' choice: bf16 runs only. At the official shape f16's walks on wgmma are slower
// than on mma.sync (+6 µs forward, +18 µs backward per launch), bf16's faster (−6, −2;
// docs/log/PERF-history.md), so f16 runs keep mma.sync here (its wgmma kernels are not built).
template <class T, int HP, int DP>
constexpr bool kTakeWgmmaS = kWgmmaS<HP, DP> && !tcf::kF16Plane<T>;

template <class T, int RH, int RD, bool kWg>
struct Layout {
  static constexpr int HP = 16 * RH, DP = 16 * RD;
  static constexpr int DQ = dq_of(HP, DP);
  static_assert(!kWg || kWgmmaS<HP, DP>, "no wgmma instantiation for these widths");
  static constexpr bool kW = kWg;
  using Lay = wg::PlaneLay<kWg>;
  // U's lo-plane offset, V's plane (elements)
  static constexpr int kUo = Lay::template size<kTR, HP>(), kVo = Lay::template size<kTR, DQ>();
  static constexpr std::size_t kBytes =
      sizeof(bf16) * (std::size_t(2) * kUo + std::size_t(kVo)) + sizeof(float) * (kTR + kNW);
  // Blocks per SM (registers ≤ 64K / (256·kMinBlocks)), by the accumulators per thread
  // (HP·DQ / 256) and the operands' planes: no spills (ptxas -v) for every instantiation.
  // f16: W's values wait in registers for their scale (weight_planes): more live registers.
  static constexpr int kMinBlocks = HP * DQ / kNT > 32 ? 2 : tcf::kF16Plane<T> ? 3 : 4;
};

// ---- the steps, shared by the per-chunk kernel and the walk ----------------------------------

// The planes of one chunk in shared memory (Layout::kBytes from `base`).
template <class Ly>
struct Planes {
  bf16 *U, *V;  // U (its storage values) then W (hi, lo at kUo); V (its storage values)
  float* w;     // [kTR]
  float* red;   // [kNW] per-warp maxima (f16 runs' W scale)
  __device__ explicit Planes(unsigned char* base)
      : U(reinterpret_cast<bf16*>(base)), V(U + 2 * Ly::kUo),
        w(reinterpret_cast<float*>(V + Ly::kVo)), red(w + kTR) {}
};

// How step 2 forms a chunk's weights (and which row scalars step 1a loads):
//   kSumAdt  forward, the per-chunk kernel: warp 0 sums adt serially (cum, da_cumsum_saved
//            written), w_s = e^{Λ − cum_s}
//   kCumFwd  forward, the walk: cum already in da_cumsum_saved (chunk_cumsum_kernel, the same
//            sums), read like the backward's, w_s = e^{Λ − cum_s}
//   kCumBwd  backward: cum read from da_cumsum_saved, da_cs_sum written, w_s = e^{cum_s}
enum class Weights { kSumAdt, kCumFwd, kCumBwd };

// 1a. Warp 0: the row scalars of chunk c — adt (kSumAdt) or cum (from da_cumsum_saved) of rows
// lane and lane + 32 — in registers; 0 for rows ≥ L.
template <Weights kW>
__device__ __forceinline__ void chunk_rows(const ChunkGeom& g, const ChunkStateArgs& a, Idx b,
                                           Idx c, Idx h, float& r0, float& r1) {
  const int lane = threadIdx.x & 31, L = g.len(c);
  r0 = 0.0f;
  r1 = 0.0f;
  if constexpr (kW == Weights::kSumAdt) {
    const float* adt = a.adt + (b * g.T + g.t0(c)) * g.nh + h;
    if (lane < L) r0 = adt[lane * g.nh];
    if (lane + 32 < L) r1 = adt[(lane + 32) * g.nh];
  } else {
    const float* cum = (kW == Weights::kCumFwd ? a.cum_out : a.cum_in) + g.cum_base(b, c, h);
    if (lane < L) r0 = cum[lane];
    if (lane + 32 < L) r1 = cum[lane + 32];
  }
}

// 1b. All threads: chunk c's U and V tiles into the planes (by cp.async: the caller commits
// and waits).
// V's columns n0 … n0 + min(DQ, ds − n0) − 1 (n0 > 0: the walk's second half of d_state).
template <class T, class Ly>
__device__ __forceinline__ void issue_tiles(const ChunkGeom& g, const ChunkStateArgs& a, Idx b,
                                            Idx c, Idx h, const Planes<Ly>& pl, int n0 = 0) {
  const int L = g.len(c), hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  const int nv = min(Ly::DQ, ds - n0);
  const Idx row0 = b * g.T + g.t0(c);
  const T* U = static_cast<const T*>(a.u);
  const T* V = static_cast<const T*>(a.v);
  const T* const u_src[1] = {U + row0 * a.ldu + h * hd};
  bf16* const u_dst[1] = {pl.U};
  tcf::load_typed<T, Ly::HP, 1, false, typename Ly::Lay>(
      u_src, u_dst, a.ldu, L, hd, hd % 8 == 0 && a.ldu % 8 == 0 && is_aligned(U, 16));
  const T* const v_src[1] = {V + (row0 * g.nh + h) * ds + n0};
  bf16* const v_dst[1] = {pl.V};
  tcf::load_typed<T, Ly::DQ, 1, false, typename Ly::Lay>(
      v_src, v_dst, g.nh * ds, L, nv, ds % 8 == 0 && n0 % 8 == 0 && is_aligned(V, 16));
}

// 2. Warp 0: the weights w_s into pl.w (kW above; kSumAdt also writes da_cumsum_saved, kCumBwd
// da_cs_sum); returns Λ = cum_{L−1} (in warp 0). kSumAdt: the other threads zero the slots
// [kTR, cs) of da_cumsum_saved.
// write: this block writes da_cumsum_saved / da_cs_sum (the walk's first half only: one writer).
template <Weights kW>
__device__ __forceinline__ float chunk_weights(const ChunkGeom& g, const ChunkStateArgs& a, Idx b,
                                               Idx c, Idx h, float r0, float r1, float* wsm,
                                               bool write = true) {
  const int tid = threadIdx.x, lane = tid & 31, L = g.len(c);
  const Idx cb = g.cum_base(b, c, h);
  float lam = 0.0f;
  if (tid < 32) {
    float w0, w1;
    if constexpr (kW == Weights::kSumAdt) {
      float run = 0.0f, c0 = 0.0f, c1 = 0.0f;
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        run += __shfl_sync(0xffffffffu, r0, k);
        if (lane == k) c0 = run;
      }
#pragma unroll
      for (int k = 0; k < 32; ++k) {
        run += __shfl_sync(0xffffffffu, r1, k);
        if (lane == k) c1 = run;
      }
      // run = Λ = cum_{L−1}
      float* cw = a.cum_out + cb;
      if (write && lane < g.cs) cw[lane] = lane < L ? c0 : 0.0f;
      if (write && lane + 32 < g.cs) cw[lane + 32] = lane + 32 < L ? c1 : 0.0f;
      w0 = lane < L ? expf(run - c0) : 0.0f;
      w1 = lane + 32 < L ? expf(run - c1) : 0.0f;
      lam = run;
    } else {
      lam = __shfl_sync(0xffffffffu, L - 1 < 32 ? r0 : r1, (L - 1) & 31);
      if constexpr (kW == Weights::kCumFwd) {  // the values kSumAdt forms from the same cum
        w0 = lane < L ? expf(lam - r0) : 0.0f;
        w1 = lane + 32 < L ? expf(lam - r1) : 0.0f;
      } else {
        if (write && lane == 0) a.da_cs_sum[(b * g.nc + c) * g.nh + h] = lam;
        w0 = lane < L ? expf(r0) : 0.0f;
        w1 = lane + 32 < L ? expf(r1) : 0.0f;
      }
    }
    wsm[lane] = w0;
    wsm[lane + 32] = w1;
  } else if constexpr (kW == Weights::kSumAdt) {
    float* cw = a.cum_out + cb;
    if (write)
      for (Idx k = kTR + (tid - 32); k < g.cs; k += kNT - 32) cw[k] = 0.0f;
  }
  return lam;
}

// 3. All threads: W = w ⊙ U (hi/lo) in place, 8 values per slot, every row (rows ≥ L: zeros).
// f16 runs: W's values wait in registers for the tile's max (post_max, a barrier, scale_of) and
// go into the planes scaled; the returned scale brings the product back. bf16 runs: scale 1.
template <class T, class Ly>
__device__ __forceinline__ tcf::TileScale weight_planes(const Planes<Ly>& pl) {
  constexpr int HP = Ly::HP, kUo = Ly::kUo, kW = HP / 8, kIt = kTR * kW / kNT;
  auto at = [](int r, int c) { return Ly::Lay::template at<kTR, HP>(r, c); };
  static_assert(kTR * kW % kNT == 0, "the block must tile U");
  const int tid = threadIdx.x;
  float v[kIt][8], mx = 0.0f;
#pragma unroll
  for (int k = 0; k < kIt; ++k) {
    const int e = tid + k * kNT, r = e / kW, col = e % kW * 8;
    const uint4 u4 = *reinterpret_cast<const uint4*>(pl.U + at(r, col));
    const std::uint32_t in[4] = {u4.x, u4.y, u4.z, u4.w};
    const float ws = pl.w[r];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 u = tcf::typed_pair<T>(in[j]);  // the storage values, exactly
      v[k][2 * j] = __fmul_rn(ws, u.x);
      v[k][2 * j + 1] = __fmul_rn(ws, u.y);
      mx = fmaxf(mx, fmaxf(fabsf(v[k][2 * j]), fabsf(v[k][2 * j + 1])));
    }
  }
  tcf::TileScale sc;
  if constexpr (tcf::kF16Plane<T>) {
    tcf::post_max<T>(mx, pl.red);
    __syncthreads();
    sc = tcf::scale_of<T, kNW>(pl.red);
  }
#pragma unroll
  for (int k = 0; k < kIt; ++k) {
    const int e = tid + k * kNT, r = e / kW, col = e % kW * 8;
    bf16* dst = pl.U + at(r, col);
    std::uint32_t ho[4], lo[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) tcf::split_pair<T>(v[k][2 * j], v[k][2 * j + 1], sc, ho[j], lo[j]);
    *reinterpret_cast<uint4*>(dst) = make_uint4(ho[0], ho[1], ho[2], ho[3]);
    *reinterpret_cast<uint4*>(dst + kUo) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  }
  if constexpr (Ly::kW) wg::fence_async_smem();  // W and V (cp.async), to wgmma's proxy
  return sc;
}

template <class Ly>
using ChunkFrag = tcf::Frag<Ly::HP, Ly::DQ, kNW>;

// 4. All threads: f = Wᵀ V (wgmma: W and V both MN-major, [k = s][m = p] and [k = s][n]).
template <class T, class Ly>
__device__ __forceinline__ void chunk_product(ChunkFrag<Ly>& f, const Planes<Ly>& pl) {
  f.zero();
  if constexpr (Ly::kW) {
    wg::frag_add<kTR, tcf::kF16Plane<T>, true, true, true, false, kTR, kTR, 2 * Ly::kUo, 0>(
        f, wg::smem_u32(pl.U), wg::smem_u32(pl.V));
  } else {
    // f16 runs: one k-step per loop body (Frag::add; two were 2–5 % slower in the f16 walks).
    f.template add<kTR, tcf::kF16Plane<T> ? 1 : 0>(
        tcf::SplitOpnd<T, tcf::plane_ld(Ly::HP), false>{pl.U, Ly::kUo},
        tcf::TypedOpnd<T, tcf::plane_ld(Ly::DQ), false>{pl.V, 0});
  }
}

// A [hd][ld] f32 state at `out` ← the pair (p, n), (p, n + 1) of its columns n < cols (p < hd
// and n < cols checked; cols ≤ ld).
__device__ __forceinline__ void store_pair(float* out, int hd, int cols, int ld, bool pair_store,
                                           int p, int n, float v0, float v1) {
  if (p >= hd || n >= cols) return;
  float* o = out + p * ld + n;
  if (pair_store) {  // n even and cols, ld even: n + 1 < cols, 8-byte aligned
    *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
  } else {
    o[0] = v0;
    if (n + 1 < cols) o[1] = v1;
  }
}

// ---- one chunk per block ---------------------------------------------------------------------

template <class T, int RH, int RD, bool kFwd, bool kWg>
__global__ void __launch_bounds__(kNT, (Layout<T, RH, RD, kWg>::kMinBlocks))
chunk_state_tc_kernel(ChunkGeom g, ChunkStateArgs a) {
  using Ly = Layout<T, RH, RD, kWg>;
  extern __shared__ __align__(16) unsigned char smem_base[];
  const Planes<Ly> pl(wg::tile_base<kWg>(smem_base));
  const Idx c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  float r0 = 0.0f, r1 = 0.0f;
  constexpr Weights kW = kFwd ? Weights::kSumAdt : Weights::kCumBwd;
  if (threadIdx.x < 32) chunk_rows<kW>(g, a, b, c, h, r0, r1);
  issue_tiles<T, Ly>(g, a, b, c, h, pl);  // in flight during the cumsum
  chunk_weights<kW>(g, a, b, c, h, r0, r1, pl.w);
  cp_async_wait_all();
  __syncthreads();
  const tcf::TileScale sc = weight_planes<T, Ly>(pl);
  __syncthreads();
  ChunkFrag<Ly> f;
  chunk_product<T, Ly>(f, pl);
  if constexpr (tcf::kF16Plane<T>) f.scale(sc.down);
  float* out = a.out + g.state_base(b, c, h);
  const int hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  const bool pair_store = ds % 2 == 0 && is_aligned(a.out, 8);
  f.pairs([&](int, int, int, int p, int n, float& v0, float& v1) {
    store_pair(out, hd, ds, ds, pair_store, p, n, v0, v1);
  });
}

// ---- the walk's cumsums (K2's da_cumsum_saved, before the forward walk) ----------------------
// da_cumsum_saved[b, c, h, τ] = Σ_{s ≤ τ} adt[b·T + t0(c) + s][h] for τ < L, 0 for τ ∈ [L, cs):
// f32, serial from +0 in ascending s — the additions and order of kSumAdt (step 2), of
// chunk_state_kernel and of the reference, so the bits are theirs. A thread per (b, c, h), the
// lanes of a warp 32 consecutive heads of one chunk: each of a thread's kTR loads is one
// 128-byte row across the warp, all in flight before the serial adds; the warp's sums go through
// shared memory and out as one contiguous run (heads h0 … h0 + 31 of chunk c are consecutive in
// [B, nc, nh, cs]). kCumWarps chunks per block; grid (⌈nc / kCumWarps⌉, ⌈nh / 32⌉, B).
// Why a kernel of its own: inside the walk, warp 0's 64-step chain held every chunk's barrier
// (the forward walk took ≈ 0.7 µs per chunk more than the backward walk, which reads cum).
constexpr int kCumWarps = 4;
__global__ void __launch_bounds__(32 * kCumWarps)
chunk_cumsum_kernel(ChunkGeom g, const float* adt, float* cum) {
  __shared__ float sums[kCumWarps][32][kTR + 1];  // +1: lane l's row starts in bank l
  const int lane = threadIdx.x & 31, wq = threadIdx.x >> 5;
  const Idx c = Idx(blockIdx.x) * kCumWarps + wq, b = blockIdx.z, h0 = Idx(blockIdx.y) * 32;
  if (c >= g.nc) return;  // the whole warp
  const int L = g.len(c), cs = static_cast<int>(g.cs);
  const int heads = static_cast<int>(min(Idx(32), g.nh - h0));
  float(*my)[kTR + 1] = sums[wq];
  if (lane < heads) {
    const float* a = adt + (b * g.T + g.t0(c)) * g.nh + h0 + lane;
    float v[kTR];
#pragma unroll
    for (int s = 0; s < kTR; ++s) v[s] = s < L ? a[s * g.nh] : 0.0f;
    float run = 0.0f;
#pragma unroll
    for (int s = 0; s < kTR; ++s) {
      run += v[s];  // rows ≥ L add +0: run is never −0, so that is a no-op
      my[lane][s] = run;
    }
  }
  __syncwarp();
  float* out = cum + g.cum_base(b, c, h0);
  for (int e = lane; e < heads * cs; e += 32) {
    const int hl = e / cs, s = e - hl * cs;
    out[e] = s < L ? my[hl][s] : 0.0f;
  }
}

// ---- the walk: one block per (b, h, half of d_state) over its chunks --------------------------
// grid (nh, B, NS), 256 threads; chunks ascending (forward) or descending (backward). Block z
// holds the state columns n ∈ [z·DQ, (z + 1)·DQ) (NS = 2 halves when d_state > 64, so that the
// state and one chunk's product fit the registers of two blocks per SM; the columns of a
// product are independent, so a half's values are the whole product's). The state S (forward)
// or dS (backward) lives in a ChunkFrag in the product's own layout (one owner per element).
// Per chunk c (its plane stage landed, the next chunks' in flight):
//   store S as states[c] (and f as the contribution when a.s.out); S = state_step(Λ_c, S, f)
// — the order, the values and the expressions of state_pass_fwd/bwd_kernel over the
// contributions chunk_state_tc_kernel stores, so the bits are theirs. The forward's cum comes
// from chunk_cumsum_kernel (launched just before); block z = 0 alone writes the backward's
// da_cs_sum and K6. Shared: kS plane stages
// (walk_stages: 3 where they fit, the next two chunks' tiles in flight by cp.async while one
// computes; else 2) of Layout::kBytes (16-byte aligned) + Λ [kS].
template <class Ly>
constexpr std::size_t stage_bytes() {
  constexpr std::size_t al = Ly::kW ? 1024 : 16;  // wgmma's planes start on 1024 bytes
  return (Ly::kBytes + al - 1) / al * al;
}
// Blocks per SM: S and f hold HP·DQ / 256 floats each per thread; two blocks (128 registers)
// while that is ≤ 16, else one.
template <class Ly>
constexpr int walk_blocks() {
  return Ly::HP * Ly::DQ / kNT > 16 ? 1 : 2;
}
// Plane stages: three (two chunks in flight while one computes) where they fit the blocks per
// SM in 200 KB of shared memory, else two.
template <class Ly>
constexpr int walk_stages() {
  return 3 * stage_bytes<Ly>() * walk_blocks<Ly>() <= 200 * 1024 ? 3 : 2;
}
template <class Ly>
constexpr std::size_t walk_smem() {
  return wg::kAlignSlack<Ly::kW> + walk_stages<Ly>() * (stage_bytes<Ly>() + sizeof(float));
}

template <class T, int RH, int RD, bool kFwd, bool kWg>
__global__ void __launch_bounds__(kNT, (walk_blocks<Layout<T, RH, RD, kWg>>()))
chunk_walk_tc_kernel(ChunkGeom g, ChunkWalkArgs w) {
  using Ly = Layout<T, RH, RD, kWg>;
  extern __shared__ __align__(16) unsigned char smem_base[];
  unsigned char* const smem = wg::tile_base<kWg>(smem_base);
  constexpr std::size_t kStage = stage_bytes<Ly>();
  constexpr int kS = walk_stages<Ly>();
  float* lam_s = reinterpret_cast<float*>(smem + kS * kStage);
  const int tid = threadIdx.x;
  const Idx h = blockIdx.x, b = blockIdx.y, sb = b * g.nh + h;
  const int n0 = static_cast<int>(blockIdx.z) * Ly::DQ;
  const bool first = blockIdx.z == 0;
  const int hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  const int nc = static_cast<int>(g.nc);
  const Idx hds = g.hd * g.ds;
  auto chunk_of = [&](int k) -> Idx { return kFwd ? k : nc - 1 - k; };

  // The entering value: S_0 (forward) or ∂L/∂(leaving state) (backward), columns n0 + n.
  ChunkFrag<Ly> S;
  {
    const float* init = w.init + sb * hds;
    float sgm1 = 0.0f;
    if constexpr (kFwd) {
      const Idx i0 = (b * g.T) * g.nh + h;
      sgm1 = w.dt[i0] * (1.0f - w.trap[i0]);
    }
    auto at = [&](int p, int n) {
      if constexpr (kFwd)
        return entering_state(init[p * ds + n], sgm1, w.v_in[sb * g.hd + p], w.k_in[sb * g.ds + n]);
      else
        return init[p * ds + n];
    };
    S.pairs([&](int, int, int, int p, int n, float& v0, float& v1) {
      v0 = p < hd && n0 + n < ds ? at(p, n0 + n) : 0.0f;
      v1 = p < hd && n0 + n + 1 < ds ? at(p, n0 + n + 1) : 0.0f;
    });
  }
  if (kFwd && first) {  // K6: k and x at t = T − 1, as floats
    const Idx rl = b * g.T + g.T - 1;
    const T* k = static_cast<const T*>(w.k_last);
    const T* x = static_cast<const T*>(w.x_last);
    for (Idx q = tid; q < g.ds; q += kNT) w.k_out[sb * g.ds + q] = to_float(k[(rl * g.nh + h) * g.ds + q]);
    for (Idx q = tid; q < g.hd; q += kNT) w.v_out[sb * g.hd + q] = to_float(x[rl * g.ldx + h * g.hd + q]);
  }

  const bool pair_store = ds % 2 == 0 && is_aligned(w.states, 8) &&
                          (w.s.out == nullptr || is_aligned(w.s.out, 8));
  float r0 = 0.0f, r1 = 0.0f;
  constexpr Weights kW = kFwd ? Weights::kCumFwd : Weights::kCumBwd;
  if (tid < 32) chunk_rows<kW>(g, w.s, b, chunk_of(0), h, r0, r1);
  // Chunks 0 … kS − 2 in flight (one cp.async group each, empty ones past the end).
#pragma unroll
  for (int j = 0; j < kS - 1; ++j) {
    if (j < nc) issue_tiles<T, Ly>(g, w.s, b, chunk_of(j), h, Planes<Ly>(smem + j * kStage), n0);
    cp_async_commit();
  }
  for (int k = 0; k < nc; ++k) {
    const int st = k % kS;
    const Idx c = chunk_of(k);
    const Planes<Ly> pl(smem + st * kStage);
    // Chunk k + kS − 1's tiles into stage (k − 1) mod kS (last read by chunk k − 1's product,
    // before the barrier that ended it); an empty group past the end keeps the wait uniform.
    const int ahead = k + kS - 1;
    if (ahead < nc)
      issue_tiles<T, Ly>(g, w.s, b, chunk_of(ahead), h, Planes<Ly>(smem + (ahead % kS) * kStage),
                         n0);
    cp_async_commit();
    float nx0 = 0.0f, nx1 = 0.0f;
    if (tid < 32 && k + 1 < nc) chunk_rows<kW>(g, w.s, b, chunk_of(k + 1), h, nx0, nx1);
    const float lam = chunk_weights<kW>(g, w.s, b, c, h, r0, r1, pl.w, first);
    if (tid == 0) lam_s[st] = lam;
    cp_async_wait_group<kS - 1>();  // chunk c's group (the kS − 1 newer may be pending)
    __syncthreads();
    const tcf::TileScale sc = weight_planes<T, Ly>(pl);
    __syncthreads();
    ChunkFrag<Ly> f;
    chunk_product<T, Ly>(f, pl);
    if constexpr (tcf::kF16Plane<T>) f.scale(sc.down);
    const float lc = lam_s[st];
    float* so = w.states + g.state_base(b, c, h) + n0;
    float* co = w.s.out ? w.s.out + g.state_base(b, c, h) + n0 : nullptr;
    f.pairs([&](int i, int hh, int j, int p, int n, float& f0, float& f1) {
      float& s0 = S.d[i][j][2 * hh];
      float& s1 = S.d[i][j][2 * hh + 1];
      store_pair(so, hd, ds - n0, ds, pair_store, p, n, s0, s1);
      if (co) store_pair(co, hd, ds - n0, ds, pair_store, p, n, f0, f1);
      s0 = state_step(lc, s0, f0);
      s1 = state_step(lc, s1, f1);
    });
    r0 = nx0;
    r1 = nx1;
    __syncthreads();  // this stage's planes, w and Λ are rewritten kS chunks on
  }
  // The leaving value: final_states and ssm_out (forward) or ∂L/∂(entering state) (backward).
  float* f1p = w.fin + sb * hds + n0;
  float* f2p = w.fin2 ? w.fin2 + sb * hds + n0 : nullptr;
  const bool pair_fin = ds % 2 == 0 && is_aligned(w.fin, 8) && (!f2p || is_aligned(w.fin2, 8));
  S.pairs([&](int, int, int, int p, int n, float& v0, float& v1) {
    store_pair(f1p, hd, ds - n0, ds, pair_fin, p, n, v0, v1);
    if (f2p) store_pair(f2p, hd, ds - n0, ds, pair_fin, p, n, v0, v1);
  });
}

}  // namespace

// The plane kernels' geometry: chunks of one row tile, headdim and d_state ≤ 128.
static void require_plane_geometry(const ChunkGeom& g, const char* kernel) {
  M3_REQUIRE(g.nt == 1 && g.hd <= 128 && g.ds <= 128, kChunkWhere,
             std::string("unsupported chunk geometry for ") + kernel, "row tiles per chunk=",
             g.nt, " headdim=", g.hd, " d_state=", g.ds,
             " (needs chunks of ≤ 64 steps, headdim ≤ 128, d_state ≤ 128)");
}

template <class T, bool kFwd>
void chunk_state_tc(cudaStream_t s, const ChunkGeom& g, const ChunkStateArgs& a) {
  require_plane_geometry(g, "chunk_state_tc");
  with_pads(g.hd, g.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    auto launch = [&](auto wgm) {
      constexpr bool kWg = decltype(wgm)::value;
      auto k = chunk_state_tc_kernel<T, RH, RD, kFwd, kWg>;
      constexpr std::size_t bytes = wg::kAlignSlack<kWg> + Layout<T, RH, RD, kWg>::kBytes;
      opt_in_smem(k, bytes, kChunkWhere);
      k<<<dim3(static_cast<unsigned>(g.nc), static_cast<unsigned>(g.nh),
               static_cast<unsigned>(g.B)),
          kNT, bytes, s>>>(g, a);
      M3_LAUNCH_CHECK();
    };
    with_wgmma<kTakeWgmmaS<T, 16 * RH, 16 * RD>>(launch);
  });
}

template <class T, bool kFwd>
void chunk_walk_tc(cudaStream_t s, const ChunkGeom& g, const ChunkWalkArgs& a) {
  require_plane_geometry(g, "chunk_walk_tc");
  with_pads(g.hd, g.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    // d_state > 64: two halves of 64 columns per (b, h) (see the kernel's comment).
    constexpr int RDh = RD == 8 ? 4 : RD, NS = RD == 8 ? 2 : 1;
    if constexpr (kFwd) {
      chunk_cumsum_kernel<<<dim3(static_cast<unsigned>((g.nc + kCumWarps - 1) / kCumWarps),
                                 static_cast<unsigned>((g.nh + 31) / 32),
                                 static_cast<unsigned>(g.B)),
                            32 * kCumWarps, 0, s>>>(g, a.s.adt, a.s.cum_out);
      M3_LAUNCH_CHECK();
    }
    auto launch = [&](auto wgm) {
      constexpr bool kWg = decltype(wgm)::value;
      auto k = chunk_walk_tc_kernel<T, RH, RDh, kFwd, kWg>;
      constexpr std::size_t bytes = walk_smem<Layout<T, RH, RDh, kWg>>();
      opt_in_smem(k, bytes, kChunkWhere);
      k<<<dim3(static_cast<unsigned>(g.nh), static_cast<unsigned>(g.B), NS), kNT, bytes, s>>>(g,
                                                                                            a);
      M3_LAUNCH_CHECK();
    };
    with_wgmma<kTakeWgmmaS<T, 16 * RH, 16 * RDh>>(launch);
  });
}

#define M3_INSTANTIATE(T)                                                                  \
  template void chunk_state_tc<T, true>(cudaStream_t, const ChunkGeom&, const ChunkStateArgs&); \
  template void chunk_state_tc<T, false>(cudaStream_t, const ChunkGeom&, const ChunkStateArgs&); \
  template void chunk_walk_tc<T, true>(cudaStream_t, const ChunkGeom&, const ChunkWalkArgs&);    \
  template void chunk_walk_tc<T, false>(cudaStream_t, const ChunkGeom&, const ChunkWalkArgs&);
M3_FOR_EACH_TYPED_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
