// K5 of the chunked scan (MODEL.md §5.2; chunk_scan_kernel of gpu/scan/chunked_fwd.cu; chunked_detail.cuh's header
// states the algorithm) for typed runs (bf16 / f16) whose chunks fit one row tile (L ≤ kTR = 64),
// on the tensor cores with the operands in 16-bit planes and the accumulators in registers
// (gpu/tc_frag.cuh). Per (b, h, c) [grid (nc, nh, B), 256 threads], t, s < L:
//   y[t][p] = e^{cum_t} Σ_n Q[t][n] S[p][n]
//             + Σ_{s<t} e^{cum_t − cum_s} (Σ_n Q[t][n] Ks[s][n]) X[s][p] + (D + qk_t) X[t][p]
// Q = q, Ks = k_scaled_saved [BT, nh, ds] (typed); X = x [BT, di] (typed, columns h·hd…;
// row stride g.ldx: proj's width when x is its column view);
// S = chunk_states_saved [B, nc, nh, hd, ds], cum = da_cumsum_saved [B, nc, nh, cs], qk =
// qk_dot_saved [BT, nh] (f32); y [BT, di] rounded to T once, as it is stored.
//   1. Loads (all issued before their shared stores; typed rows by cp.async): planes Q, Ks
//      [64][DP] (one plane of the storage values each), S [HP][DP] (f32 split hi/lo of the
//      run's type; f16 runs: scaled by the tile's power of two, tc_frag.cuh); rows
//      ≥ L, columns ≥ ds / hd zero. DP = 16·RD ≥ ds, HP = 16·RH ≥ hd.
//   2. y = Q·Sᵀ (Frag<64, HP>), A = Q·Ksᵀ (Frag<64, 64>).
//   3. X [64][HP] (typed like Q) loads over Q, Ks (dead) while MA = [s < t < L]·e^{cum_t −
//      cum_s}·A goes as hi/lo planes over S (dead) and y ·= e^{cum_t} (f16 runs: MA's scale
//      from max|A| over the mask, taken before the barrier that frees S; y goes from S's
//      scale to MA's).
//   4. y += MA·X;  y + (D + qk_t)·x → y (typed).
// Products: mma.sync (Frag::add), or in sm_90a builds at HP and DP of 64 or 128 (kWgmma5)
// wgmma chains of two warpgroups (wg::frag_add, the same bits: tests/gpu/test_tc_wgmma.cu) over
// planes in wgmma's 128-byte swizzle on 1024-byte alignment; there A's and y's chains of step 2
// are issued together, and f16 runs take A's mask maximum while y's runs.
// Shared memory is the peak of steps 1–2 (Q, Ks, S) and no more: X is not live before step 3.
// At the official shape (bf16 or f16, hd 64, ds 128) that is 70,400 bytes (the wgmma path:
// 67,360, its planes unpadded and 1 KB of slack for their alignment), three blocks per SM
// (with X resident from step 1 it was 79,616 bytes and two: the kernel is bound by memory
// latency, so the third block's warps are worth more than X's load overlapping steps 1–2).
// Precision: tc_frag.cuh (products ≈ 2⁻¹⁶ of Σ|terms| for bf16 runs, 2⁻²² for f16 runs — MA's
// absolute floor 2⁻³⁹ of max|A| over the mask rather than of max|MA| — f32 accumulation); the
// inter and intra
// terms share one accumulator (chunked_fwd.cu's K5 keeps two), a reordering within f32 rounding.
// Determinism: fixed order everywhere, no atomics, one writer per y element.
#include <cstdint>
#include <type_traits>

#include "chunk_fwd_tc.cuh"
#include "convert.cuh"
#include "tc_frag.cuh"
#include "tc_tiles.cuh"
#include "tc_wgmma.cuh"

namespace m3::gpu {

namespace {

using tcf::bf16;
using tcf::plane_ld;
using tcf::load_state;
using tcf::load_typed;

constexpr int kThreads5 = tcf::kTileThreads, kWarps5 = kThreads5 / 32;

// Shared memory (16-bit elements, then floats): Q, Ks [kTR][LDD] aliased by X [kTR][LDH];
// S [HP][LDD]·2 aliased by MA [kTR][LDM]·2; then cum, e^{cum}, D + qk [kTR] (floats);
// a typed tile is one plane of its storage values (tc_frag.cuh). Blocks per SM: three where
// their shared memory fits the SM's 228 KB (1 KB of it reserved per block) and y has ≤ 16
// accumulators per thread (HP ≤ 64: 80 registers without spills, ptxas -v), else two (≤ 128
// registers).
// Whether this build has a wgmma instantiation for these widths (tc_wgmma.cuh, wg::kBuild):
// HP and DP of 64 or 128 (SW128 tiles want multiples of 64). The launcher takes it unless a test
// turned it off (set_chunked_wgmma_for_testing) to hold it to the mma.sync bits.
template <int HP, int DP>
constexpr bool kWgmma5 = wg::kBuild && (HP == 64 || HP == 128) && (DP == 64 || DP == 128);

// The wgmma path (kWg): planes in Sw128 (plane sizes without padding, every plane on 1024
// bytes: they are multiples of 512 elements), kAlignSlack bytes more for the base's alignment.
template <class T, int RH, int RD, bool kW>
struct Layout {
  static constexpr int HP = 16 * RH, DP = 16 * RD;
  static constexpr bool kWg = kW;
  static_assert(!kW || kWgmma5<HP, DP>, "no wgmma instantiation for these widths");
  using Lay = wg::PlaneLay<kWg>;
  static constexpr int LDH = plane_ld(HP), LDD = plane_ld(DP), LDM = plane_ld(kTR);
  static constexpr int kQ = Lay::template size<kTR, DP>(), kX = Lay::template size<kTR, HP>();
  static constexpr int kS = Lay::template size<HP, DP>(), kM = Lay::template size<kTR, kTR>();
  static constexpr int kQX = 2 * kQ > kX ? 2 * kQ : kX;
  static constexpr int kSM = kS > kM ? 2 * kS : 2 * kM;
  static constexpr std::size_t kBytes =
      wg::kAlignSlack<kWg> + 2 * std::size_t(kQX + kSM) + 4 * (3 * kTR + kWarps5);
  static constexpr int kMinBlocks = HP <= 64 && 3 * (kBytes + 1024) <= 228 * 1024 ? 3 : 2;
};

template <class T, int RH, int RD, bool kW>
__global__ void __launch_bounds__(kThreads5, (Layout<T, RH, RD, kW>::kMinBlocks))
chunk_scan_tc_kernel(ChunkGeom g, SsmChunkFwd<T> p) {
  using Ly = Layout<T, RH, RD, kW>;
  constexpr int HP = Ly::HP, DP = Ly::DP, LDH = Ly::LDH, LDD = Ly::LDD, LDM = Ly::LDM;
  constexpr bool kWg = Ly::kWg;
  using Lay = typename Ly::Lay;
  auto u = [](const bf16* q) { return wg::smem_u32(q); };
  extern __shared__ __align__(16) unsigned char smem_base[];
  unsigned char* const smem = wg::tile_base<kWg>(smem_base);
  bf16* Qp = reinterpret_cast<bf16*>(smem);
  bf16* Kp = Qp + Ly::kQ;
  bf16* Xp = Qp;               // after step 2
  bf16* Sp = Qp + Ly::kQX;     // S, then MA
  float* cum = reinterpret_cast<float*>(Sp + Ly::kSM);
  float* ecum = cum + kTR;
  float* dq = ecum + kTR;
  float* red = dq + kTR;  // [kWarps5] per-warp maxima (f16 runs' tile scales)
  constexpr bool kH = tcf::kF16Plane<T>;
  const int tid = threadIdx.x, st = tid % kTR;
  const Idx c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int L = g.len(c), hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  const Idx row0 = b * g.T + g.t0(c);

  // 1. Row scalars (stored after the tiles' loads are issued), Q and Ks, S.
  float sv = 0.0f;
  tcf::TileScale sS, sMA;  // f16 runs: S's and MA's planes (bf16: 1)
  if (tid < kTR && st < L) sv = p.da_cumsum_saved[g.cum_base(b, c, h) + st];
  if (tid >= kTR && tid < 2 * kTR && st < L)
    sv = p.d_param[h] + p.qk_dot_saved[(row0 + st) * g.nh + h];
  {
    // f16 runs with float4 state rows (kSEarly): S's values requested first, before Q's and
    // Ks's copies, and split once the tile's max is known (chunk_bwd_tc.cu's step 0, the same
    // bits as load_state's). Not bf16 runs, whose load_state splits each batch as it lands:
    // requested early, they make K5 ≈ 22 µs slower per launch (docs/log/PERF-history.md).
    using StateRegs = tcf::StateInFlight<HP, DP, Lay>;
    constexpr bool kSEarly = kH && StateRegs::kIt <= tcf::kBatch;
    const float* S = p.chunk_states_saved + g.state_base(b, c, h);
    const bool vs = ds % 4 == 0 && is_aligned(p.chunk_states_saved, 16);
    StateRegs s_in;
    if constexpr (kSEarly) {
      if (vs) s_in.issue(S, hd, ds);
    }
    const Idx qb = (row0 * g.nh + h) * ds;
    const T* const qk_src[2] = {p.q + qb, p.k_scaled_saved + qb};
    bf16* const qk_dst[2] = {Qp, Kp};
    load_typed<T, DP, 2, false, Lay>(
        qk_src, qk_dst, g.nh * ds, L, ds,
        ds % 8 == 0 && is_aligned(p.q, 16) && is_aligned(p.k_scaled_saved, 16));
    if (kSEarly && vs) {
      sS = s_in.template split_scaled<T>(Sp, red);
    } else {
      sS = load_state<HP, DP, T, false, Lay>(Sp, S, hd, ds, vs, red).sc;
    }
  }
  if (tid < kTR) {
    cum[st] = sv;
    ecum[st] = st < L ? expf(sv) : 0.0f;
  } else if (tid < 2 * kTR) {
    dq[st] = sv;
  }
  cp_async_wait_all();
  if constexpr (kWg) wg::fence_async_smem();  // the planes, to wgmma's proxy (barrier below)
  __syncthreads();

  // 2. y = Q Sᵀ, A = Q Ksᵀ (wgmma: A's chain, then y's; A's is waited for first).
  tcf::Frag<kTR, HP, kWarps5> y;
  y.zero();
  tcf::Frag<kTR, kTR, kWarps5> A;
  A.zero();
  if constexpr (kWg) {
    wg::frag_add<DP, kH, false, false, false, false, kTR, kTR, 0, 0, false>(A, u(Qp), u(Kp));
    wg::frag_add<DP, kH, false, false, false, true, kTR, HP, 0, 2 * Ly::kS, false>(y, u(Qp),
                                                                                   u(Sp));
    wg::wait<1>();
    wg::hold_frag(A);
  } else {
    const tcf::TypedOpnd<T, LDD, true> Q{Qp, 0}, Ks{Kp, 0};
    y.template add<DP>(Q, tcf::SplitOpnd<T, LDD, true>{Sp, HP * LDD});
    A.template add<DP>(Q, Ks);
  }
  // MA = mask · e^{cum_t − cum_s} · A, formed over A's registers after the barrier, with X's
  // loads in flight. f16 runs take MA's scale before it from max|A| over the mask: e^{cum_t −
  // cum_s} ≤ 1 there (adt = a_val·dt ≤ 0, MODEL.md §4 F3: cum does not increase along the chunk),
  // so |MA| ≤ max|A| (and the tile scale leaves a factor 2 below f16's 65504 besides).
  auto to_ma = [&](int t, int s, float& v0, float& v1) {
    const float ct = cum[t];
    // The product rounded before put_split's hi/lo split (as every build so far had it: the
    // split's subtraction must not take it in as an fma).
    v0 = t < L && s < t ? __fmul_rn(expf(ct - cum[s]), v0) : 0.0f;
    v1 = t < L && s + 1 < t ? __fmul_rn(expf(ct - cum[s + 1]), v1) : 0.0f;
  };
  if constexpr (kH) {
    float mx = 0.0f;
    A.pairs([&](int, int, int, int t, int s, float& v0, float& v1) {
      if (t < L && s < t) mx = fmaxf(mx, fabsf(v0));
      if (t < L && s + 1 < t) mx = fmaxf(mx, fabsf(v1));
    });
    tcf::post_max<T>(mx, red);
  }
  if constexpr (kWg) {
    wg::wait<0>();
    wg::hold_frag(y);
  }
  __syncthreads();  // every warp is done with Q, Ks and S: X and MA take their places
  sMA = tcf::scale_of<T, kWarps5>(red);

  // 3. X loads (in flight during the rest of step 3); MA into planes over S; y ·= e^{cum_t}.
  {
    const T* const x_src[1] = {p.x + row0 * g.ldx + h * hd};
    bf16* const x_dst[1] = {Xp};
    load_typed<T, HP, 1, false, Lay>(x_src, x_dst, g.ldx, L, hd,
                                     hd % 8 == 0 && g.ldx % 8 == 0 && is_aligned(p.x, 16));
  }
  bf16* MA = Sp;
  A.pairs([&](int, int, int, int t, int s, float& v0, float& v1) {
    to_ma(t, s, v0, v1);
    tcf::put_split<T>(MA, Ly::kM, Lay::template at<kTR, kTR>(t, s), v0, v1, sMA);
  });
  y.pairs([&](int, int, int, int t, int, float& v0, float& v1) {
    const float e = ecum[t];
    if constexpr (kH) {  // from S's scale to MA's, for the product to come (exact)
      v0 = v0 * sS.down * e * sMA.up;
      v1 = v1 * sS.down * e * sMA.up;
    } else {
      v0 *= e;
      v1 *= e;
    }
  });
  cp_async_wait_all();
  if constexpr (kWg) wg::fence_async_smem();  // X's and MA's planes, to wgmma's proxy
  __syncthreads();

  // 4. y += MA X;  y + (D + qk_t) x → global.
  if constexpr (kWg) {
    wg::frag_add<kTR, kH, false, true, true, false, kTR, kTR, 2 * Ly::kM, 0>(y, u(MA), u(Xp));
  } else {
    y.template add<kTR>(tcf::SplitOpnd<T, LDM, true>{MA, kTR * LDM},
                        tcf::TypedOpnd<T, LDH, false>{Xp, 0});
  }
  if constexpr (kH) y.scale(sMA.down);
  using T2 = std::conditional_t<std::is_same_v<T, bf16>, __nv_bfloat162, __half2>;
  const bool pair_store = hd % 2 == 0 && is_aligned(p.y, 4);
  // The thread's two rows t = wm·16 + g + 8·hh (FM = 1): y's row addresses (null beyond L) and
  // D + qk_t, formed once rather than per pair.
  static_assert(decltype(y)::FM == 1, "one row tile per warp");
  T* yrow[2];
  float dr[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = y.wm() * 16 + static_cast<int>((threadIdx.x & 31) >> 2) + 8 * hh;
    yrow[hh] = t < L ? p.y + (row0 + t) * g.di + h * hd : nullptr;
    dr[hh] = dq[t];
  }
  y.pairs([&](int, int hh, int, int t, int q, float& v0, float& v1) {
    if (!yrow[hh] || q >= hd) return;
    const float2 x = tcf::get_typed_pair<T>(Xp, Lay::template at<kTR, HP>(t, q));
    const float d = dr[hh];
    const T y0 = from_float<T>(v0 + d * x.x), y1 = from_float<T>(v1 + d * x.y);
    T* out = yrow[hh] + q;
    if (pair_store) {
      T2 w;
      w.x = y0;
      w.y = y1;
      *reinterpret_cast<T2*>(out) = w;
    } else {
      out[0] = y0;
      if (q + 1 < hd) out[1] = y1;
    }
  });
}

}  // namespace

template <class T>
void chunk_scan_tc(cudaStream_t s, const ChunkGeom& g, const SsmChunkFwd<T>& p) {
  M3_REQUIRE(g.nt == 1 && g.hd <= 128 && g.ds <= 128, "gpu::chunk_scan_tc",
             "unsupported chunk geometry", "row tiles per chunk=", g.nt, " headdim=", g.hd,
             " d_state=", g.ds, " (needs chunks of ≤ 64 steps, headdim ≤ 128, d_state ≤ 128)");
  const dim3 grid(static_cast<unsigned>(g.nc), static_cast<unsigned>(g.nh),
                  static_cast<unsigned>(g.B));
  with_pads(g.hd, g.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    auto launch = [&](auto w) {
      constexpr bool kW = decltype(w)::value;
      auto kernel = chunk_scan_tc_kernel<T, RH, RD, kW>;
      const std::size_t bytes = Layout<T, RH, RD, kW>::kBytes;
      opt_in_smem(kernel, bytes, kChunkWhere);
      kernel<<<grid, kThreads5, bytes, s>>>(g, p);
      M3_LAUNCH_CHECK();
    };
    with_wgmma<kWgmma5<16 * RH, 16 * RD>>(launch);
  });
}

#define M3_INST(T) \
  template void chunk_scan_tc<T>(cudaStream_t, const ChunkGeom&, const SsmChunkFwd<T>&);
M3_FOR_EACH_TYPED_STORAGE(M3_INST)
#undef M3_INST

}  // namespace m3::gpu
