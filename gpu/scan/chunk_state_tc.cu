// K2/K3 (forward) and B1 (backward) of the chunked scan (MODEL.md §5.2, §6.4; chunk_state_kernel
// of gpu/scan/chunked_detail.cuh, whose header states the algorithm) for typed runs (bf16 / f16) whose
// chunks fit one row tile (L ≤ kTR = 64), on the tensor cores with the operands in bf16 planes
// and the accumulators in registers (gpu/tc_frag.cuh). Per (b, h, c) [grid (nc, nh, B), 256
// threads], rows s < L, row0 = b·T + t0(c):
//   out[p][n] = Σ_s w_s U[s][p] V[s][n]          (p < hd, n < ds; [hd][ds] f32 at state_base)
//   forward  (K2/K3): cum_s = Σ_{s' ≤ s} adt[row0 + s'][h] (f32, serial, ascending) →
//                     da_cumsum_saved (slots [L, cs) zero); Λ = cum_{L−1}; w_s = e^{Λ − cum_s};
//                     U = x [BT, di] (columns h·hd…), V = k_scaled_saved [BT, nh, ds] (typed);
//                     out = chunk_states (the contributions)
//   backward (B1):    cum read from da_cumsum_saved; da_cs_sum[b, c, h] = cum_{L−1};
//                     w_s = e^{cum_s}; U = d_y (like x), V = q (like k); out = dcontrib (dS)
// Steps:
//   1. Warp 0 loads its row scalars (adt / cum of rows lane, lane + 32) into registers; then all
//      threads issue the tile loads (tc_tiles.cuh: bf16 rows by cp.async straight into the
//      planes, so their latency overlaps step 2): U → [64][HP] (bf16: one exact plane; f16:
//      hi/lo, exact), V → [64][DQ] likewise; rows ≥ L and columns ≥ hd / ds zero.
//   2. Warp 0: forward, the cumsum — every lane runs the same serial f32 sum over the 64 values
//      (shuffled from their lanes, ascending), keeping cum of its two rows: the same additions in
//      the same order as the reference and chunk_state_kernel (rows ≥ L add +0, a no-op: the sum
//      starts at +0 and is never −0), so da_cumsum_saved matches them bit for bit; it stores
//      da_cumsum_saved, and w_s (0 for s ≥ L) in shared memory; the other threads zero the
//      slots [64, cs). Backward: w_s = e^{cum_s}; lane 0 stores da_cs_sum.
//   3. W = w ⊙ U in place over U's planes: W[s][p] = w_s·U[s][p] in f32 (__fmul_rn: not
//      contracted with the split), split into hi/lo (tc::split2).
//   4. out = Wᵀ·V on Frag<HP, DQ, 8> (m = p, n = n, k = s < 64: A = W stored [k][m], B = V
//      stored [k][n], both loaded transposed), stored as float2 pairs when ds is even.
// Why scale U (not V): chunk_state_kernel forms w_s·U[s][p] in f32 and splits it, V staying the
// typed value (exact in bf16); scaling U here gives the very same operand planes (the products
// then differ from it only in the f32 accumulation order: tc_frag.cuh keeps one accumulator,
// tc_mma.cuh's Acc two), and U is the narrower tile (HP ≤ DP at the usual shapes), so step 3
// touches fewer values. Cost is the same either way: the scaled operand is split, the other is
// exact for bf16 storage (2 mma per k-step and tile; f16: 3).
// Shapes: HP = 16·RH ≥ hd, DP = 16·RD ≥ ds (RH, RD ∈ {2, 4, 8}). Frag<HP, N, 8> needs an even
// number of n-tiles per warp; every (HP, DP) gives one but (32, 32) (2 × 4 warps, one n-tile
// each): there V's plane is widened to DQ = 64 (zero columns ≥ ds; the extra products are
// zeros that are never stored). Else DQ = DP.
// Shared memory (bf16 elements, then floats): U/W [64][LDH] hi, lo; V [64][LDQ] (one plane for
// bf16 storage, hi/lo for f16); w [64]. bf16, HP = 64, DP = 128: 36,096 bytes.
// Precision: tc_frag.cuh (W split to 16 significant bits, V exact; products ≈ 2⁻¹⁶ of Σ|terms|,
// f32 accumulation, k ascending). Determinism: fixed order everywhere, no atomics, one writer
// per output (out, da_cumsum_saved, da_cs_sum).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "chunk_state_tc.cuh"
#include "convert.cuh"
#include "tc_frag.cuh"
#include "tc_tiles.cuh"

namespace m3::gpu {

namespace {

using tcf::bf16;

constexpr int kNT = tcf::kTileThreads, kNW = kNT / 32;

template <class T, int RH, int RD>
struct Layout {
  static constexpr int HP = 16 * RH, DP = 16 * RD;
  static constexpr int DQ = HP == 32 && DP == 32 ? 64 : DP;  // see the header
  static constexpr int LDH = tcf::plane_ld(HP), LDQ = tcf::plane_ld(DQ);
  static constexpr int NPV = tcf::kSplitStorage<T> ? 2 : 1;
  static constexpr int kUo = kTR * LDH, kVo = kTR * LDQ;  // lo-plane offsets
  static constexpr std::size_t kBytes =
      sizeof(bf16) * (std::size_t(2) * kUo + std::size_t(NPV) * kVo) + sizeof(float) * kTR;
  // Blocks per SM (registers ≤ 64K / (256·kMinBlocks)), by the accumulators per thread
  // (HP·DQ / 256) and the operands' planes: no spills (ptxas -v) for every instantiation.
  static constexpr int kMinBlocks = HP * DQ / kNT > 32 ? 2 : NPV == 1 ? 4 : 3;
};

template <class T, int RH, int RD, bool kFwd>
__global__ void __launch_bounds__(kNT, (Layout<T, RH, RD>::kMinBlocks))
chunk_state_tc_kernel(ChunkGeom g, ChunkStateArgs a) {
  using Ly = Layout<T, RH, RD>;
  constexpr int HP = Ly::HP, DQ = Ly::DQ, LDH = Ly::LDH, LDQ = Ly::LDQ;
  constexpr int kUo = Ly::kUo, kVo = Ly::kVo;
  constexpr bool kSp = tcf::kSplitStorage<T>;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* Up = reinterpret_cast<bf16*>(smem);  // U, then W (hi, lo)
  bf16* Vp = Up + 2 * kUo;
  float* wsm = reinterpret_cast<float*>(Vp + Ly::NPV * kVo);
  const int tid = threadIdx.x, lane = tid & 31;
  const Idx c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int L = g.len(c), hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  const Idx row0 = b * g.T + g.t0(c), cb = g.cum_base(b, c, h);

  // ---- 1. row scalars (warp 0), then the tiles
  float r0 = 0.0f, r1 = 0.0f;  // rows lane, lane + 32: adt (forward) or cum (backward); 0 ≥ L
  if (tid < 32) {
    if constexpr (kFwd) {
      const float* adt = a.adt + row0 * g.nh + h;
      if (lane < L) r0 = adt[lane * g.nh];
      if (lane + 32 < L) r1 = adt[(lane + 32) * g.nh];
    } else {
      const float* cum = a.cum_in + cb;
      if (lane < L) r0 = cum[lane];
      if (lane + 32 < L) r1 = cum[lane + 32];
    }
  }
  {
    const T* U = static_cast<const T*>(a.u);
    const T* V = static_cast<const T*>(a.v);
    const T* const u_src[1] = {U + row0 * g.di + h * hd};
    bf16* const u_dst[1] = {Up};
    tcf::load_typed<T, HP, 1>(u_src, u_dst, g.di, L, hd, hd % 8 == 0 && is_aligned(U, 16));
    const T* const v_src[1] = {V + (row0 * g.nh + h) * ds};
    bf16* const v_dst[1] = {Vp};
    tcf::load_typed<T, DQ, 1>(v_src, v_dst, g.nh * ds, L, ds, ds % 8 == 0 && is_aligned(V, 16));
  }

  // ---- 2. cumsum / weights
  if (tid < 32) {
    float w0, w1;
    if constexpr (kFwd) {
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
      if (lane < g.cs) cw[lane] = lane < L ? c0 : 0.0f;
      if (lane + 32 < g.cs) cw[lane + 32] = lane + 32 < L ? c1 : 0.0f;
      w0 = lane < L ? expf(run - c0) : 0.0f;
      w1 = lane + 32 < L ? expf(run - c1) : 0.0f;
    } else {
      const float lam = __shfl_sync(0xffffffffu, L - 1 < 32 ? r0 : r1, (L - 1) & 31);
      if (lane == 0) a.da_cs_sum[(b * g.nc + c) * g.nh + h] = lam;
      w0 = lane < L ? expf(r0) : 0.0f;
      w1 = lane + 32 < L ? expf(r1) : 0.0f;
    }
    wsm[lane] = w0;
    wsm[lane + 32] = w1;
  } else if constexpr (kFwd) {
    float* cw = a.cum_out + cb;
    for (Idx k = kTR + (tid - 32); k < g.cs; k += kNT - 32) cw[k] = 0.0f;
  }
  tcf::cp_async_wait();
  __syncthreads();

  // ---- 3. W = w ⊙ U (hi/lo), in place: 8 values per slot, every row (rows ≥ L: zeros)
  {
    constexpr int kW = HP / 8;
    static_assert(kTR * kW % kNT == 0, "the block must tile U");
#pragma unroll
    for (int k = 0; k < kTR * kW / kNT; ++k) {
      const int e = tid + k * kNT, r = e / kW, col = e % kW * 8;
      bf16* at = Up + r * LDH + col;
      const uint4 hv = *reinterpret_cast<const uint4*>(at);
      uint4 lv = make_uint4(0u, 0u, 0u, 0u);
      if constexpr (kSp) lv = *reinterpret_cast<const uint4*>(at + kUo);
      const std::uint32_t hin[4] = {hv.x, hv.y, hv.z, hv.w}, lin[4] = {lv.x, lv.y, lv.z, lv.w};
      const float ws = wsm[r];
      std::uint32_t ho[4], lo[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hin[j]));
        if constexpr (kSp) {  // f16: hi + lo is the value, exactly
          const float2 l = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&lin[j]));
          u.x += l.x;
          u.y += l.y;
        }
        tc::split2(__fmul_rn(ws, u.x), __fmul_rn(ws, u.y), ho[j], lo[j]);
      }
      *reinterpret_cast<uint4*>(at) = make_uint4(ho[0], ho[1], ho[2], ho[3]);
      *reinterpret_cast<uint4*>(at + kUo) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
    }
  }
  __syncthreads();

  // ---- 4. out = Wᵀ V
  tcf::Frag<HP, DQ, kNW> f;
  f.zero();
  f.template add<kTR>(tcf::Opnd<LDH, false, true>{Up, kUo}, tcf::Opnd<LDQ, false, kSp>{Vp, kVo});
  float* out = a.out + g.state_base(b, c, h);
  const bool pair_store = ds % 2 == 0 && is_aligned(a.out, 8);
  f.pairs([&](int, int, int, int p, int n, float& v0, float& v1) {
    if (p >= hd || n >= ds) return;
    float* o = out + p * ds + n;
    if (pair_store) {  // n even and ds even: n + 1 < ds, 8-byte aligned
      *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
    } else {
      o[0] = v0;
      if (n + 1 < ds) o[1] = v1;
    }
  });
}

}  // namespace

template <class T, bool kFwd>
void chunk_state_tc(cudaStream_t s, const ChunkGeom& g, const ChunkStateArgs& a) {
  M3_REQUIRE(g.nt == 1 && g.hd <= 128 && g.ds <= 128, kChunkWhere,
             "unsupported chunk geometry for chunk_state_tc", "row tiles per chunk=", g.nt,
             " headdim=", g.hd, " d_state=", g.ds,
             " (needs chunks of ≤ 64 steps, headdim ≤ 128, d_state ≤ 128)");
  with_pads(g.hd, g.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    auto k = chunk_state_tc_kernel<T, RH, RD, kFwd>;
    constexpr std::size_t bytes = Layout<T, RH, RD>::kBytes;
    set_smem(k, bytes);
    k<<<dim3(static_cast<unsigned>(g.nc), static_cast<unsigned>(g.nh),
             static_cast<unsigned>(g.B)),
        kNT, bytes, s>>>(g, a);
    M3_LAUNCH_CHECK();
  });
}

#define M3_INSTANTIATE(T)                                                                  \
  template void chunk_state_tc<T, true>(cudaStream_t, const ChunkGeom&, const ChunkStateArgs&); \
  template void chunk_state_tc<T, false>(cudaStream_t, const ChunkGeom&, const ChunkStateArgs&);
M3_FOR_EACH_TYPED_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
