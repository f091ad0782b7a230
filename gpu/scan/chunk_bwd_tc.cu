// B3 — step 1 of the chunked backward (MODEL.md §6.4) — for typed runs (bf16/f16) whose chunks
// fit one row tile (L ≤ kTR = 64), on the tensor cores with the operands as 16-bit planes in
// shared memory and the products in registers (tc_frag.cuh). Same formulas as
// chunk_bwd_kernel of scan/chunked_bwd.cu (chunked_detail.cuh's header is the authority); per (b, h, c), with
// M[t,s] = e^{cum_t − cum_s} (s < t), A = Q Ksᵀ, P = dO Xᵀ, MA = M⊙A, MP = M⊙P, W = MP⊙A,
// e_s = e^{Λ − cum_s}:
//   dQ_mid = e^{cum_t}·(dO S) + MP Ks                                   [t][n]
//   dV     = MAᵀ dO + e_s·(Ks dSᵀ) + (D + qk_s)·dO  (+ d_v_out at t = T−1) → d_x (typed)
//   (x and d_x with the row stride g.ldx: proj's / d_proj's width when they are column views)
//   dK_mid = MPᵀ Q + e_s·(X dS)                                         [s][n]
//   dQK_t  = dO_t·x_t
//   loc_t  = e^{cum_t}(dO S)_t·Q_t + Σ_s W[t,s] − Σ_j W[j,t];  M_t = e_t·(X dS)_t·Ks_t
//   dADT_τ = e^{Λ}⟨S, dS⟩ + Σ_t M_t + Σ_{t ≥ τ} (loc_t − M_t)
//
// Block: 256 threads (8 warps), grid (nc, nh, B); every product is a Frag<64, N, 8>, formed
// by mma.sync (Frag::add) or, in sm_90a builds at HP = 64 (kWgmma below), by wgmma chains of
// two warpgroups (wg::frag_add: the same bits, tests/gpu/test_tc_wgmma.cu), issued ahead so
// that a chain runs under the previous product's epilogue.
// Shared memory (16-bit planes of the run's type; plane_ld padding, or wgmma's 128-byte
// swizzle on 1024-byte alignment in the wgmma instantiations): Q, Ks [64][DP], dO, X
// [64][HP] (one plane of the storage values each, exact), and one region R that holds in turn
// S [HP][DP] (hi/lo), then MA, MP [64][64] (hi/lo each), then dS [HP][DP] (hi/lo); plus per-row
// floats. f16 runs give each of the four f32 tiles its power-of-two scale (tc_frag.cuh: the
// block's max of the tile, one barrier each — S's and dS's inside load_state, MA's and MP's at
// the barrier that frees R) and bring every product back by it. At the
// official shape (HP = 64, DP = 128, bf16 or f16) that is ≈ 92 KB: two blocks per SM, so one
// block's loads overlap the other's products.
// Order: (0) loads: typed tiles (rows aligned: cp.async straight into the planes), S split
// into R, ⟨S, dS⟩ from the f32 values (f16 runs: S's and dS's values requested first, S split
// once its tile's max is known); (1) dq = dO·S, rx; (2) A, P → MA, MP into R, row and
// column sums of W; dq += MP·Ks → dQ_mid; (3) dV = MAᵀ·dO, dK = MPᵀ·Q; dS split into R;
// (4) dV += e_s·(Ks·dSᵀ) + (D + qk)·dO → d_x; dK += e_s·(X·dS), M_t → dK_mid; (5) dADT (warp 0).
// Precision: products as tc_frag.cuh (≈ 2⁻¹⁶ of Σ|terms| for bf16 runs, 2⁻²² for f16 runs; A
// and P exact up to the f32 accumulation); ⟨S, dS⟩, the epilogues and every
// sum in f32. Determinism: no atomics, one writer per output, fixed orders (the cross-warp
// sums in ascending warp order, the dADT suffix sum as a fixed shuffle tree).
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "chunk_tail.cuh"
#include "convert.cuh"
#include "reduce.cuh"
#include "ssm_chunk_geom.cuh"
#include "tc_frag.cuh"
#include "tc_tiles.cuh"
#include "tc_wgmma.cuh"

namespace m3::gpu {

namespace {

using tcf::bf16;
using tcf::Frag;
using tcf::Opnd;

constexpr int kNT = tcf::kTileThreads, kNW = kNT / 32;

// Whether this build has a wgmma instantiation for these widths (tc_wgmma.cuh, wg::kBuild):
// HP = 64 and DP = 64 or 128 (SW128 tiles want multiples of 64; the official shape has HP = 64,
// DP = 128). HP = 128 stays on mma.sync: there ptxas spilled 176 B (bf16) and 376 B (f16) of the
// wgmma build's registers, against 0 and 148 B on mma.sync. The launcher takes it (kW) unless a
// test turned it off (set_chunked_wgmma_for_testing) to hold it to the mma.sync bits.
template <int HP, int DP>
constexpr bool kWgmma = wg::kBuild && HP == 64 && DP % 64 == 0;

// The fused tail's f32 rows (kTail): d_b_pre_rope and d_c_pre_rope, each [kTR][DP + 8] over the
// planes once they are dead (+8: a fragment's float2 stores of a half-warp hit 32 distinct banks).
constexpr int tail_ld(int dp) { return dp + 8; }
// θ's rows there: na ≤ DP/2 angles, then d_angle_cumsum in their place; +4, so that a
// fragment's 8 rows × 4 pairs hit 32 distinct banks.
constexpr int theta_ld(int dp) { return dp / 2 + 4; }

// kTail's region over the planes: the two row tiles, then θ [kTR][theta_ld], scale and γ [kTR]
// of the block's rows (fetched by cp.async as the planes die).
constexpr std::size_t tail_floats(int dp) {
  return std::size_t(2) * kTR * tail_ld(dp) + std::size_t(kTR) * theta_ld(dp) + 2 * kTR;
}
// The planes' bytes (kTail: at least the tail's region).
template <int HP, int DP, bool kTail, bool kW>
constexpr std::size_t plane_bytes() {
  using Lay = wg::PlaneLay<kW>;
  constexpr std::size_t typed =
      2 * std::size_t(Lay::template size<kTR, DP>()) + 2 * std::size_t(Lay::template size<kTR, HP>());
  constexpr std::size_t state = std::size_t(2) * Lay::template size<HP, DP>(),
                        mamp = std::size_t(4) * Lay::template size<kTR, kTR>();
  constexpr std::size_t planes = (typed + (state > mamp ? state : mamp)) * sizeof(bf16);
  constexpr std::size_t tail = kTail ? tail_floats(DP) * sizeof(float) : 0;
  return planes > tail ? planes : tail;
}
template <int HP, int DP, bool kTail, bool kW>
constexpr std::size_t smem_bytes() {
  return wg::kAlignSlack<kW> + plane_bytes<HP, DP, kTail, kW>() +
         sizeof(float) * (kTR * (2 + 2 + 2 + 4 + 1 + (kTail ? 1 : 0)) + 32 + 2 * kNW);
}

// Block rank q's share of the cluster's head sum: rows [q·kTR/cz, (q+1)·kTR/cz) (< L) of Fb
// (X = b) and Fc (X = c), V consecutive values n per item, summed over the cz blocks' rows in
// ascending rank from 0.0f into hsum_X at row plane + t.
template <int V, class T>
__device__ __forceinline__ void cluster_rows_sum(cooperative_groups::cluster_group& cl,
                                                 const ClusterTail<T>& ct, float* Fb, float* Fc,
                                                 int LDF, unsigned q, Idx plane, unsigned ds,
                                                 int L) {
  const unsigned cz = ct.cz, rows = kTR / cz, dsv = ds / V, items = rows * 2 * dsv;
  for (unsigned it = threadIdx.x; it < items; it += kNT) {
    const unsigned tl = it / (2 * dsv), x = it - tl * 2 * dsv, t = q * rows + tl;
    if (static_cast<int>(t) >= L) continue;
    const bool is_c = x >= dsv;
    const unsigned n = V * (is_c ? x - dsv : x);
    float* mine = (is_c ? Fc : Fb) + t * LDF + n;
    float v[8][V];
#pragma unroll
    for (unsigned j = 0; j < 8; ++j) {
      if (j < cz) {
        load_n<V>(cl.map_shared_rank(mine, j), v[j]);
      } else {
#pragma unroll
        for (int e = 0; e < V; ++e) v[j][e] = 0.0f;
      }
    }
    float sum[V];
#pragma unroll
    for (int e = 0; e < V; ++e) sum[e] = 0.0f;
#pragma unroll
    for (unsigned j = 0; j < 8; ++j)
      if (j < cz) {
#pragma unroll
        for (int e = 0; e < V; ++e) sum[e] += v[j][e];
      }
    store_n<V>((is_c ? ct.hsum_c : ct.hsum_b) + (plane + t) * ds + n, sum);
  }
}

// Step 2 and B4b's head sums for the block's rows of head h (chunk_tail.cuh ClusterTail), every
// plane dead: Fb, Fc hold dK_mid, dQ_mid [kTR][tail_ld(DP)] in rows, Th θ [kTR][theta_ld], then
// scale and γ [kTR]. Each thread takes the pairs (t, n), (t, n + 1) it held in B3's fragments
// (F's layout; n even, so each is RoPE pair n/2) and runs tail_pair on them, b/c_normed and the
// biases from global memory; it leaves d_b_pre_rope in Fb, d_c_pre_rope in Fc and
// d_angle_cumsum in θ's place. The row sums go
//   dScale_t = Σ_{wn} Σ_{quad} Σ_{j ascending} dK_mid·k,   dGamma_t = dQK_t·(the same over c·b)
// (the thread's pairs in ascending n, then the quad's lanes, then the warps' column halves in
// ascending order; rs, rq: [kNW / WM][kTR] each). Then one thread per (X, n) sums its column
// over the rows (the bias partial), and block rank q of the cluster sums rows
// [q·kTR/cz, (q+1)·kTR/cz) over the cz blocks' rows.
template <class T, int DP, class F>
__device__ __forceinline__ void fused_tail(const ChunkGeom& g, const ClusterTail<T>& ct,
                                           float* Fb, float* Fc, const float* dqk,
                                           float* Th, float* rs, float* rq, Idx row0, Idx b,
                                           Idx c, Idx h, int L) {
  namespace cg = cooperative_groups;
  constexpr int LDF = tail_ld(DP), TL = theta_ld(DP), kWN = kNW / F::WM;
  static_assert(F::FM == 1, "one 16-row tile per warp");
  const unsigned tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, c4 = lane & 3;
  const unsigned nh = static_cast<unsigned>(g.nh), ds = static_cast<unsigned>(g.ds);
  const unsigned na = ct.na, hu = static_cast<unsigned>(h);
  const TailArgs<T> a = tail_args_at(ct.a, row0, g.nh, g.ds, na, ct.ng);
  const T* const bn = a.b_normed + hu / ct.hpg * ds;  // the group's b/c_normed, row 0
  const T* const cn = a.c_normed + hu / ct.hpg * ds;
  const float* const ab_h = a.b_bias + hu * ds;
  const float* const ac_h = a.c_bias + hu * ds;
  const unsigned ngds = ct.ng * ds;
  const float* Sc = Th + kTR * TL;
  const float* Gm = Sc + kTR;
  // The thread's rows tb, tb + 8: scale, e = dQK·γ, and d_k_out's row where t = T − 1.
  const int tb = F::wm() * 16 + static_cast<int>(lane >> 2);
  float sc[2], e[2], dsc[2] = {0.0f, 0.0f}, qk[2] = {0.0f, 0.0f};
  bool last[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int t = tb + 8 * hh;
    sc[hh] = Sc[t];
    e[hh] = dqk[t] * Gm[t];
    last[hh] = t < L && g.t0(c) + t == g.T - 1;
  }
  const float* const dko = ct.a.d_k_out + (b * g.nh + h) * g.ds;
  // The thread's pairs (t, n) of the fragment layout, dK_mid and dQ_mid read from Fb and Fc and
  // d_b/c_pre_rope written over them. A rolled loop over the column tiles j (two rows per
  // step) keeps the kernel's code small: fully unrolled, its no-instruction stalls were 14× the
  // plain kernel's.
#pragma unroll 1
  for (int j = 0; j < F::FN; ++j) {
    const unsigned nu = static_cast<unsigned>((F::wn() * F::FN + j) * 8) + 2 * c4;
    if (nu >= ds) continue;  // ds is even: n + 1 < ds too
    const unsigned pp = nu / 2;
    const bool rot = pp < na;
    float ab[2], ac[2];  // the head's biases at n, n + 1: one load for both rows
    load_n<2>(ab_h + nu, ab);
    load_n<2>(ac_h + nu, ac);
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int t = tb + 8 * hh;
      const unsigned tu = static_cast<unsigned>(t);
      if (t >= L) continue;
      float x1[2], x2[2], dkout[2] = {0.0f, 0.0f};
      load_n<2>(bn + (tu * ngds + nu), x1);
      load_n<2>(cn + (tu * ngds + nu), x2);
      if (last[hh]) load_n<2>(dko + nu, dkout);
      float* const th = Th + tu * TL + pp;
      float2* const fb = reinterpret_cast<float2*>(Fb + tu * LDF + nu);
      float2* const fc = reinterpret_cast<float2*>(Fc + tu * LDF + nu);
      float2 db, dc;
      const float dang = tail_pair<T, true>(
          sc[hh], e[hh], rot, rot ? *th : 0.0f, *fb, *fc, make_float2(x1[0], x1[1]),
          make_float2(x2[0], x2[1]), make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f),
          make_float2(ab[0], ab[1]), make_float2(ac[0], ac[1]), make_float2(dkout[0], dkout[1]),
          dsc[hh], qk[hh], db, dc);
      if (rot) *th = dang;
      *fb = db;
      *fc = dc;
      if (a.d_b_pre_rope) {  // a capture's copy
        const unsigned o = (tu * nh + hu) * ds + nu;
        *reinterpret_cast<float2*>(a.d_b_pre_rope + o) = db;
        *reinterpret_cast<float2*>(a.d_c_pre_rope + o) = dc;
      }
    }
  }
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float v = tcf::quad_sum(dsc[hh]), w = tcf::quad_sum(qk[hh]);
    if (c4 == 0) {
      rs[F::wn() * kTR + tb + 8 * hh] = v;
      rq[F::wn() * kTR + tb + 8 * hh] = w;
    }
  }
  __syncthreads();
  if (static_cast<int>(tid) < L) {
    float v = 0.0f, w = 0.0f;
#pragma unroll
    for (int k = 0; k < kWN; ++k) v += rs[k * kTR + tid], w += rq[k * kTR + tid];
    a.dScale[tid * nh + hu] = v;
    a.dGamma[tid * nh + hu] = dqk[tid] * w;
  }
  // d_angle_cumsum: a warp per row, each row's na values contiguous in global memory.
  for (int t = static_cast<int>(warp); t < L; t += kNW)
    for (unsigned pp = lane; pp < na; pp += 32)
      a.d_angle_cumsum[(static_cast<unsigned>(t) * nh + hu) * na + pp] = Th[t * TL + pp];
  // The bias partials: (X, n) = (b, n) for threads < ds, (c, n) for ds ≤ thread < 2·ds.
  if (tid < 2 * ds) {
    const bool is_c = tid >= ds;
    const unsigned n = is_c ? tid - ds : tid;
    const float* Fx = is_c ? Fc : Fb;
    float sum = 0.0f;
#pragma unroll 8
    for (int t = 0; t < L; ++t) sum += Fx[t * LDF + n];
    (is_c ? ct.part_c : ct.part_b)[((b * g.nc + c) * g.nh + h) * g.ds + n] = sum;
  }
  // The head sums over the cluster (its blocks' rows visible after the cluster barrier; none
  // leaves before every block has read them).
  cg::cluster_group cl = cg::this_cluster();
  cl.sync();
  const unsigned q = cl.block_rank();
  const Idx plane = h / ct.cz * g.B * g.T + row0;
  if (ds % 4 == 0) {  // four values n … n + 3 per item: one 16-byte load per block
    cluster_rows_sum<4>(cl, ct, Fb, Fc, LDF, q, plane, ds, L);
  } else {
    cluster_rows_sum<1>(cl, ct, Fb, Fc, LDF, q, plane, ds, L);
  }
  cl.sync();
}

template <class T, int RH, int RD, bool kTail, bool kWg>
__global__ void __launch_bounds__(kNT, 2)
chunk_bwd_tc_kernel(ChunkGeom g, SsmChunkBwd<T> p, const float* dS_all, ClusterTail<T> ct) {
  constexpr int HP = 16 * RH, DP = 16 * RD;
  static_assert(!kWg || kWgmma<HP, DP>, "no wgmma instantiation for these widths");
  using Lay = wg::PlaneLay<kWg>;
  // Sizes of the typed tiles' planes, of S / dS's, and of MA / MP's; element (r, c) of each.
  constexpr int kQo = Lay::template size<kTR, DP>(), kHo = Lay::template size<kTR, HP>();
  constexpr int kSo = Lay::template size<HP, DP>(), kMo = Lay::template size<kTR, kTR>();
  auto atD = [](int r, int c) { return Lay::template at<kTR, DP>(r, c); };  // Q, Ks
  auto atH = [](int r, int c) { return Lay::template at<kTR, HP>(r, c); };  // dO, X
  auto atM = [](int r, int c) { return Lay::template at<kTR, kTR>(r, c); };  // MA, MP
  auto u = [](const bf16* p) { return wg::smem_u32(p); };
  constexpr bool kH = tcf::kF16Plane<T>;            // f16 run: f16 planes with tile scales
  extern __shared__ __align__(16) unsigned char smem_base[];
  // wg::tile_base<kWg>(smem_base), written out: through the function ptxas allocated the f16
  // instantiations' registers otherwise (official shape: 12 B of spill instead of 4), with the
  // same shared accesses in the PTX.
  constexpr unsigned kAl = wg::kAlignSlack<kWg> > 0 ? wg::kAlignSlack<kWg> - 1 : 0;
  unsigned char* const smem_raw = smem_base + ((kAl + 1 - (wg::smem_u32(smem_base) & kAl)) & kAl);
  bf16* Qp = reinterpret_cast<bf16*>(smem_raw);
  bf16* Kp = Qp + kQo;
  bf16* Op = Kp + kQo;
  bf16* Xp = Op + kHo;
  bf16* R = Xp + kHo;
  bf16* MAp = R;
  bf16* MPp = R + 2 * kMo;
  float* cum = reinterpret_cast<float*>(smem_raw + plane_bytes<HP, DP, kTail, kWg>());
  float* qkD = cum + kTR;       // D + qk_s (0 beyond L)
  float* rrow = qkD + kTR;      // [2][kTR] cross-warp row sums (rx, then M)
  float* wrow = rrow + 2 * kTR;  // [2][kTR] Σ_s W[t, s]
  float* wcol = wrow + 2 * kTR;  // [4][kTR] Σ_t W[t, s]
  float* loc = wcol + 4 * kTR;   // loc_t
  float* red = loc + kTR;        // [32] block_sum
  float* redm = red + 32;        // [2][kNW] per-warp maxima (f16 runs' tile scales)
  float* dqk = redm + 2 * kNW;   // kTail: dQK_t of the rows

  const int tid = threadIdx.x, lane = tid & 31;
  const Idx c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int L = g.len(c), hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  const Idx row0 = b * g.T + g.t0(c), nh = g.nh, di = g.di, kst = nh * g.ds;
  const Idx sb = b * nh + h;
  const float* cumg = p.da_cumsum_saved + g.cum_base(b, c, h);
  const float* S = p.chunk_states_saved + g.state_base(b, c, h);
  const float* dS = dS_all + g.state_base(b, c, h);

  // ---- (0) loads. Runs with float4 state rows and a state tile of one batch (kSEarly) request
  // S's and dS's values into registers first, before the typed tiles' copies, and split S once
  // they land (f16: once the tile's max is known; StateInFlight: load_state's slots, order and
  // split, so its bits); the others load S after the copies are issued (load_state).
  using StateRegs = tcf::StateInFlight<HP, DP, Lay>;
  constexpr bool kSEarly = StateRegs::kIt <= tcf::kBatch;
  const bool vs = ds % 4 == 0 && is_aligned(p.chunk_states_saved, 16) && is_aligned(dS_all, 16);
  StateRegs s_in, ds_in;
  if constexpr (kSEarly) {
    if (vs) {
      s_in.issue(S, hd, ds);
      ds_in.issue(dS, hd, ds);
    }
  }
  {
    const Idx qb = (row0 * nh + h) * ds, ob = row0 * di + h * hd, xb = row0 * g.ldx + h * hd;
    const T* const qk_src[2] = {p.q + qb, p.k_scaled_saved + qb};
    bf16* const qk_dst[2] = {Qp, Kp};
    tcf::load_typed<T, DP, 2, true, Lay>(qk_src, qk_dst, kst, L, ds,
                                    ds % 8 == 0 && is_aligned(p.q, 16) &&
                                        is_aligned(p.k_scaled_saved, 16));
    const T* const o_src[1] = {p.d_y + ob};
    const T* const x_src[1] = {p.x + xb};
    bf16* const o_dst[1] = {Op};
    bf16* const x_dst[1] = {Xp};
    tcf::load_typed<T, HP, 1, true, Lay>(o_src, o_dst, di, L, hd,
                                    hd % 8 == 0 && is_aligned(p.d_y, 16));
    tcf::load_typed<T, HP, 1, true, Lay>(x_src, x_dst, g.ldx, L, hd,
                                    hd % 8 == 0 && g.ldx % 8 == 0 && is_aligned(p.x, 16));
  }
  if (tid < kTR) {
    cum[tid] = tid < L ? cumg[tid] : 0.0f;
    qkD[tid] = tid < L ? p.d_param[h] + p.qk_dot_saved[(row0 + tid) * nh + h] : 0.0f;
  }
  tcf::StateLoad ls;
  if (kSEarly && vs) {
    ls.dot = s_in.dot(ds_in, hd, ds);
    ls.sc = s_in.template split_scaled<T>(R, redm);
  } else {
    ls = tcf::load_state<HP, DP, T, true, Lay>(R, S, hd, ds, vs, redm, dS);
  }
  cp_async_wait_all();
  if constexpr (kWg) wg::fence_async_smem();  // the planes, to wgmma's proxy (barrier below)
  const float Lam = cumg[L - 1];
  const float msc = expf(Lam) * block_sum(ls.dot, red);  // barriers: the planes are visible after

  // dQK_t = dO_t·x_t: four lanes per row, a quarter of the row each.
  {
    const int t = tid >> 2, q4 = tid & 3;
    float acc = 0.0f;
#pragma unroll
    for (int k = 0; k < HP / 4; k += 2) {
      const int at = atH(t, q4 * (HP / 4) + k);
      const float2 o = tcf::get_typed_pair<T>(Op, at), xv = tcf::get_typed_pair<T>(Xp, at);
      acc += tcf::dot2(o.x, o.y, xv.x, xv.y);
    }
    acc = tcf::quad_sum(acc);
    if (q4 == 0 && t < L) p.dQK_dot[(row0 + t) * nh + h] = acc;
    if constexpr (kTail) {
      if (q4 == 0) dqk[t] = acc;
    }
  }

  constexpr int LDH = tcf::plane_ld(HP), LDD = tcf::plane_ld(DP), kLD64 = tcf::plane_ld(kTR);
  const tcf::TypedOpnd<T, LDD, true> oQ{Qp, 0}, oK{Kp, 0};
  const tcf::TypedOpnd<T, LDH, true> oO{Op, 0}, oX{Xp, 0};
  const int g4 = lane >> 2, c4 = lane & 3;

  // ---- (1) dq = dO·S; rx_t = Σ_n (dO S)[t][n] Q[t][n]; dq ← e^{cum_t}·dq
  Frag<kTR, DP, kNW> dq;
  dq.zero();
  using F64 = Frag<kTR, kTR, kNW>;
  F64 A, P;  // step (2)'s products: wgmma builds issue their chains here, behind dq's
  if constexpr (kWg) {
    // Three chains in flight (one commit group each): dq's epilogue (rx) runs while A's and
    // P's products do.
    A.zero();
    P.zero();
    wg::frag_add<HP, kH, false, true, false, true, kTR, HP, 0, 2 * kSo, false>(dq, u(Op), u(R));
    wg::frag_add<DP, kH, false, false, false, false, kTR, kTR, 0, 0, false>(A, u(Qp), u(Kp));
    wg::frag_add<HP, kH, false, false, false, false, kTR, kTR, 0, 0, false>(P, u(Op), u(Xp));
    wg::wait<2>();
    wg::hold_frag(dq);
  } else {
    dq.template add<HP>(oO, tcf::SplitOpnd<T, LDD, false>{R, kSo});
  }
  {
    float rx[2] = {0.0f, 0.0f};
    const float e[2] = {expf(cum[dq.wm() * 16 + g4]), expf(cum[dq.wm() * 16 + g4 + 8])};
    dq.pairs([&](int, int hh, int, int m, int n, float& v0, float& v1) {
      tcf::unscale<T>(ls.sc, v0, v1);  // back from S's scale
      const float2 qv = tcf::get_typed_pair<T>(Qp, atD(m, n));
      rx[hh] += tcf::dot2(v0, v1, qv.x, qv.y);
      v0 *= e[hh];
      v1 *= e[hh];
    });
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float v = tcf::quad_sum(rx[hh]);
      if (c4 == 0) rrow[dq.wn() * kTR + dq.wm() * 16 + g4 + 8 * hh] = e[hh] * v;
    }
  }

  // ---- (2) A = Q·Ksᵀ, P = dO·Xᵀ → MA, MP (into R, once every warp is done with S)
  tcf::TileScale sMA, sMP;  // f16 runs: MA's and MP's planes (bf16: 1)
  {
    if constexpr (kWg) {
      wg::wait<0>();
      wg::hold_frag(A);
      wg::hold_frag(P);
    } else {
      A.zero();
      P.zero();
      A.template add<DP>(oQ, oK);
      P.template add<HP>(oO, oX);
    }
    float wr[2] = {0.0f, 0.0f}, wc[F64::FN][2];
#pragma unroll
    for (int j = 0; j < F64::FN; ++j) wc[j][0] = wc[j][1] = 0.0f;
    // f16 runs keep MA, MP in A, P until their tiles' maxima are known; bf16 runs write them.
    float mxa = 0.0f, mxp = 0.0f;
    if constexpr (!kH) __syncthreads();
    A.pairs([&](int i, int hh, int j, int t, int s, float& a0, float& a1) {
      float& p0 = P.d[i][j][2 * hh];
      float& p1 = P.d[i][j][2 * hh + 1];
      const bool on0 = t < L && s < t, on1 = t < L && s + 1 < t;  // s < t < L implies s < L
      const float d0 = on0 ? expf(cum[t] - cum[s]) : 0.0f;
      const float d1 = on1 ? expf(cum[t] - cum[s + 1]) : 0.0f;
      const float mp0 = d0 * p0, mp1 = d1 * p1;
      // W = MP·A's row and column sums (w = mp·a, a before MA's factor), each product rounded
      // as nvcc had chosen in every instantiation: the row's pair as dot2, each column's term
      // fused into its sum.
      wr[hh] += tcf::dot2(mp0, mp1, a0, a1);
      wc[j][0] = __fmaf_rn(mp0, a0, wc[j][0]);
      wc[j][1] = __fmaf_rn(mp1, a1, wc[j][1]);
      if constexpr (kH) {
        a0 *= d0;
        a1 *= d1;
        p0 = mp0;
        p1 = mp1;
        mxa = fmaxf(mxa, fmaxf(fabsf(a0), fabsf(a1)));
        mxp = fmaxf(mxp, fmaxf(fabsf(mp0), fabsf(mp1)));
      } else {
        tcf::put_split<T>(MAp, kMo, atM(t, s), __fmul_rn(d0, a0), __fmul_rn(d1, a1));
        tcf::put_split<T>(MPp, kMo, atM(t, s), mp0, mp1);
      }
    });
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float v = tcf::quad_sum(wr[hh]);
      if (c4 == 0) wrow[A.wn() * kTR + A.wm() * 16 + g4 + 8 * hh] = v;
    }
#pragma unroll
    for (int j = 0; j < F64::FN; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float v = tcf::column_sum(wc[j][e]);
        if (g4 == 0) wcol[A.wm() * kTR + (A.wn() * F64::FN + j) * 8 + 2 * c4 + e] = v;
      }
    if constexpr (kH) {
      tcf::post_max<T>(mxa, redm);
      tcf::post_max<T>(mxp, redm + kNW);
      __syncthreads();
      sMA = tcf::scale_of<T, kNW>(redm);
      sMP = tcf::scale_of<T, kNW>(redm + kNW);
      A.pairs([&](int i, int hh, int j, int t, int s, float& a0, float& a1) {
        tcf::put_split<T>(MAp, kMo, atM(t, s), a0, a1, sMA);
        tcf::put_split<T>(MPp, kMo, atM(t, s), P.d[i][j][2 * hh], P.d[i][j][2 * hh + 1], sMP);
      });
    }
  }
  if constexpr (kWg) wg::fence_async_smem();  // MA, MP, to wgmma's proxy
  __syncthreads();
  if (tid < kTR) {
    const float rowsums = (rrow[tid] + rrow[kTR + tid]) + (wrow[tid] + wrow[kTR + tid]);
    const float colsum =
        (wcol[tid] + wcol[kTR + tid]) + (wcol[2 * kTR + tid] + wcol[3 * kTR + tid]);
    loc[tid] = tid < L ? rowsums - colsum : 0.0f;
  }
  if constexpr (kH) dq.scale(sMP.up);  // into MP's scale for its product, back at the store
  Frag<kTR, HP, kNW> dV;  // step (3)'s products: wgmma builds issue them behind dq's
  Frag<kTR, DP, kNW> dK;
  dV.zero();
  dK.zero();
  if constexpr (kWg) {
    // dq's chain, then dV's and dK's: dq's stores run while those two multiply.
    wg::frag_add<kTR, kH, false, true, true, false, kTR, kTR, 2 * kMo, 0, false>(dq, u(MPp), u(Kp));
    wg::frag_add<kTR, kH, true, true, true, false, kTR, kTR, 2 * kMo, 0, false>(dV, u(MAp), u(Op));
    wg::frag_add<kTR, kH, true, true, true, false, kTR, kTR, 2 * kMo, 0, false>(dK, u(MPp), u(Qp));
    wg::wait<2>();
    wg::hold_frag(dq);
  } else {
    dq.template add<kTR>(tcf::SplitOpnd<T, kLD64, true>{MPp, kMo},
                         tcf::TypedOpnd<T, LDD, false>{Kp, 0});
  }
  // The f32 rows go out as pairs (one 8-byte store per lane) when ds is even: full sectors
  // per store instruction instead of every other word.
  // kTail: dq stays in registers for the tail, and is stored only for a capture (p.dQ_mid set).
  // Each thread stores to two rows, t = wm·16 + g4 + 8·hh (row_of): their addresses are formed
  // once, null where nothing is stored. Formed per pair, in 64 bits, they cost ≈ 30
  // instructions per stored pair (ncu source).
  const bool pairs_f = ds % 2 == 0 && is_aligned(p.dQ_mid, 8) && is_aligned(p.dK_mid, 8);
  const bool store_mid = !kTail || p.dQ_mid != nullptr, store_k = !kTail || p.dK_mid != nullptr;
  static_assert(decltype(dq)::FM == 1 && decltype(dq)::WM == kTR / 16, "one row tile per warp");
  auto row_of = [&](int hh) { return dq.wm() * 16 + g4 + 8 * hh; };  // every Frag<kTR, N, kNW>
  auto mid_rows = [&](float* base, bool on, float* (&r)[2]) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int t = row_of(hh);
      r[hh] = on && t < L ? base + ((row0 + t) * nh + h) * ds : nullptr;
    }
  };
  {
    float* qrow[2];
    mid_rows(p.dQ_mid, store_mid, qrow);
    dq.pairs([&](int, int hh, int, int, int n, float& v0, float& v1) {
      tcf::unscale<T>(sMP, v0, v1);
      if (qrow[hh]) tcf::store_row_pair(qrow[hh], n, ds, pairs_f, v0, v1);
    });
  }

  // ---- (3) dV = MAᵀ·dO, dK = MPᵀ·Q; then dS into R. Runs with float4 rows load dS's values
  // (L2-hot: step 0 read them for ⟨S, dS⟩) into registers before the products, so that their
  // latency overlaps them; the split into R waits for the barrier that frees R (f16 runs post
  // the values' max before it and take the scale after it, load_state's order). Not with
  // kTail, whose dq held through step (4) leaves no registers for them (ptxas: 64 B of spill).
  using DsRegs = tcf::StateInFlight<HP, DP, Lay>;
  constexpr bool kPre = !kTail && DsRegs::kIt <= tcf::kBatch;
  DsRegs dsr;
  if constexpr (kPre) {
    if (vs) dsr.issue(dS, hd, ds);
  }
  if constexpr (kWg) {
    wg::wait<0>();
    wg::hold_frag(dV);
    wg::hold_frag(dK);
  } else {
    dV.template add<kTR>(tcf::SplitOpnd<T, kLD64, false>{MAp, kMo},
                         tcf::TypedOpnd<T, LDH, false>{Op, 0});
    dK.template add<kTR>(tcf::SplitOpnd<T, kLD64, false>{MPp, kMo},
                         tcf::TypedOpnd<T, LDD, false>{Qp, 0});
  }
  if constexpr (kPre && kH) {
    if (vs) tcf::post_max<T>(dsr.max_abs(), redm);
  }
  __syncthreads();
  tcf::TileScale sdS;  // bf16 runs: 1
  if (kPre && vs) {
    if constexpr (kH) sdS = tcf::scale_of<T, kNW>(redm);
    dsr.template store<T>(R, sdS);
  } else {
    sdS = tcf::load_state<HP, DP, T, false, Lay>(R, dS, hd, ds, vs, redm).sc;
  }
  if constexpr (kWg) wg::fence_async_smem();  // dS's planes, to wgmma's proxy
  __syncthreads();

  // ---- (4) the dS terms, the diagonal term, stores (f16 runs: each product back from its
  // planes' scale first)
  const float es[2] = {expf(Lam - cum[dV.wm() * 16 + g4]), expf(Lam - cum[dV.wm() * 16 + g4 + 8])};
  // bf16 wgmma builds without the tail: k2's chain runs during v2's epilogue (f16's and the
  // tail's instantiations spilled 72–256 B with it, so they run the two chains one by one).
  constexpr bool kK2Early = kWg && !kH && !kTail;
  Frag<kTR, DP, kNW> k2;
  k2.zero();
  {
    const bool pairs_x = hd % 2 == 0 && g.ldx % 2 == 0 && is_aligned(p.d_x, 4);
    Frag<kTR, HP, kNW> v2;
    v2.zero();
    if constexpr (kK2Early) {
      wg::frag_add<DP, kH, false, false, false, true, kTR, HP, 0, 2 * kSo, false>(v2, u(Kp), u(R));
      wg::frag_add<HP, kH, false, true, false, true, kTR, HP, 0, 2 * kSo, false>(k2, u(Xp), u(R));
      wg::wait<1>();
      wg::hold_frag(v2);
    } else if constexpr (kWg) {
      wg::frag_add<DP, kH, false, false, false, true, kTR, HP, 0, 2 * kSo>(v2, u(Kp), u(R));
    } else {
      v2.template add<DP>(oK, tcf::SplitOpnd<T, LDD, true>{R, kSo});
    }
    // Per row: d_x's row (null beyond L), d_v_out's row where s = T − 1 (else null), D + qk_s.
    T* xrow[2];
    const float* dvo[2];
    float qd[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int s = row_of(hh);
      xrow[hh] = s < L ? p.d_x + (row0 + s) * g.ldx + h * hd : nullptr;
      dvo[hh] = s < L && g.t0(c) + s == g.T - 1 ? p.d_v_out + sb * hd : nullptr;
      qd[hh] = qkD[s];
    }
    dV.pairs([&](int i, int hh, int j, int s, int q4, float& v0, float& v1) {
      const float2 o = tcf::get_typed_pair<T>(Op, atH(s, q4));
      float u0 = v2.d[i][j][2 * hh], u1 = v2.d[i][j][2 * hh + 1];
      tcf::unscale<T>(sdS, u0, u1);
      // v += e_s·u + (D + qk_s)·o with the roundings nvcc had chosen in every instantiation (stop
      // 52's PTX): u's product fused, o's rounded; f16 runs fuse MA's unscale (·down, exact) of v
      // into the sum, bf16 runs (scale 1) add.
      const float t0 = __fmaf_rn(u0, es[hh], __fmul_rn(qd[hh], o.x));
      const float t1 = __fmaf_rn(u1, es[hh], __fmul_rn(qd[hh], o.y));
      if constexpr (kH) {
        v0 = __fmaf_rn(v0, sMA.down, t0);
        v1 = __fmaf_rn(v1, sMA.down, t1);
      } else {
        v0 = __fadd_rn(v0, t0);
        v1 = __fadd_rn(v1, t1);
      }
      if (!xrow[hh] || q4 >= hd) return;
      float w0 = v0, w1 = v1;
      if (dvo[hh]) {
        w0 = v0 + dvo[hh][q4];
        if (q4 + 1 < hd) w1 = v1 + dvo[hh][q4 + 1];
      }
      tcf::store_row_pair(xrow[hh], q4, hd, pairs_x, w0, w1);
    });
  }
  {
    if constexpr (kK2Early) {
      wg::wait<0>();
      wg::hold_frag(k2);
    } else if constexpr (kWg) {
      wg::frag_add<HP, kH, false, true, false, true, kTR, HP, 0, 2 * kSo>(k2, u(Xp), u(R));
    } else {
      k2.template add<HP>(oX, tcf::SplitOpnd<T, LDD, false>{R, kSo});
    }
    float m[2] = {0.0f, 0.0f};
    float* krow[2];
    mid_rows(p.dK_mid, store_k, krow);
    dK.pairs([&](int i, int hh, int j, int s, int n, float& v0, float& v1) {
      float u0 = k2.d[i][j][2 * hh], u1 = k2.d[i][j][2 * hh + 1];
      tcf::unscale<T>(sdS, u0, u1);
      const float2 kv = tcf::get_typed_pair<T>(Kp, atD(s, n));
      m[hh] += tcf::dot2(u0, u1, kv.x, kv.y);
      // v += e_s·u, rounded in the form nvcc chooses for the plain expression in every
      // instantiation (PTX), spelled out so that no instantiation differs. f16 runs unscale v
      // (·down, exact) by MP's scale first; nvcc fuses that into v0's sum and e_s·u1 into v1's,
      // and both forms are pinned. bf16 runs: one fma each.
      if constexpr (kH) {
        v0 = __fmaf_rn(v0, sMP.down, __fmul_rn(es[hh], u0));
        v1 = __fmaf_rn(u1, es[hh], __fmul_rn(v1, sMP.down));
      } else {
        v0 = __fmaf_rn(u0, es[hh], v0);
        v1 = __fmaf_rn(u1, es[hh], v1);
      }
      if (krow[hh]) tcf::store_row_pair(krow[hh], n, ds, pairs_f, v0, v1);
    });
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const float v = tcf::quad_sum(m[hh]);
      if (c4 == 0) rrow[dK.wn() * kTR + dK.wm() * 16 + g4 + 8 * hh] = es[hh] * v;
    }
  }
  __syncthreads();

  // ---- (5) dADT_τ = msc + Σ_t M_t + Σ_{t ≥ τ}(loc_t − M_t), warp 0, lane l holds τ = 2l, 2l+1
  if (tid < 32) {
    float mv[2], v[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int t = 2 * lane + k;
      mv[k] = t < L ? rrow[t] + rrow[kTR + t] : 0.0f;
      v[k] = t < L ? loc[t] - mv[k] : 0.0f;
    }
    const float base = msc + warp_sum(mv[0] + mv[1]);
    float suf = v[0] + v[1];  // becomes Σ over the lanes ≥ this one
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const float y = __shfl_down_sync(0xffffffffu, suf, o);
      if (lane + o < 32) suf += y;
    }
    float next = __shfl_down_sync(0xffffffffu, suf, 1);
    if (lane == 31) next = 0.0f;
    float* o = p.dADT + row0 * nh + h;
    if (2 * lane < L) o[(2 * lane) * nh] = base + suf;
    if (2 * lane + 1 < L) o[(2 * lane + 1) * nh] = base + (next + v[1]);
  }

  // ---- (6) kTail: step 2 and B4b's head sums, from dq and dK in registers
  if constexpr (kTail) {
    constexpr int TL = theta_ld(DP);
    float* Fb = reinterpret_cast<float*>(smem_raw);
    float* Fc = Fb + kTR * tail_ld(DP);
    float* Th = Fc + kTR * tail_ld(DP);  // θ [kTR][TL], then scale, γ [kTR]
    {
      const unsigned na = ct.na;
      const float* th = ct.a.theta + (row0 * nh + h) * na;
      for (int t = tid >> 5; t < L; t += kNW)
        for (unsigned pp = lane; pp < na; pp += 32)
          cp_async4(Th + t * TL + pp, th + Idx(t) * nh * na + pp);
      if (tid < L) {
        cp_async4(Th + kTR * TL + tid, ct.a.scale_saved + (row0 + tid) * nh + h);
        cp_async4(Th + kTR * TL + kTR + tid, ct.a.gamma_saved + (row0 + tid) * nh + h);
      }
    }
    dK.pairs([&](int, int, int, int t, int n, float& v0, float& v1) {
      *reinterpret_cast<float2*>(Fb + t * tail_ld(DP) + n) = make_float2(v0, v1);
    });
    dq.pairs([&](int, int, int, int t, int n, float& v0, float& v1) {
      *reinterpret_cast<float2*>(Fc + t * tail_ld(DP) + n) = make_float2(v0, v1);
    });
    cp_async_wait_all();
    __syncthreads();
    fused_tail<T, DP, decltype(dK)>(g, ct, Fb, Fc, dqk, Th, rrow, wrow, row0, b, c, h, L);
  }
}

// One launch of chunk_bwd_tc_kernel: wgmma (kW) or mma.sync, with or without the cluster tail.
template <class T, int RH, int RD, bool kW>
void launch_bwd_tc(cudaStream_t s, const ChunkGeom& g, const SsmChunkBwd<T>& p, const float* dS,
                   const ClusterTail<T>* ct, dim3 grid) {
  if (!ct) {
    constexpr std::size_t bytes = smem_bytes<16 * RH, 16 * RD, false, kW>();
    auto k = chunk_bwd_tc_kernel<T, RH, RD, false, kW>;
    opt_in_smem(k, bytes, kChunkWhere);
    k<<<grid, kNT, bytes, s>>>(g, p, dS, ClusterTail<T>{});
    M3_LAUNCH_CHECK();
    return;
  }
  constexpr std::size_t bytes = smem_bytes<16 * RH, 16 * RD, true, kW>();
  auto k = chunk_bwd_tc_kernel<T, RH, RD, true, kW>;
  opt_in_smem(k, bytes, kChunkWhere);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(kNT);
  cfg.dynamicSmemBytes = bytes;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = ct->cz;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  M3_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k, g, p, dS, *ct));
  M3_LAUNCH_CHECK();
}

}  // namespace

bool& chunked_wgmma_enabled() {
  static bool on = true;
  return on;
}
long& chunked_wgmma_launch_count() {
  static long n = 0;
  return n;
}
bool chunked_wgmma_build() { return wg::kBuild; }
void set_chunked_wgmma_for_testing(bool on) { chunked_wgmma_enabled() = on; }
long chunked_wgmma_launches() { return chunked_wgmma_launch_count(); }

template <class T>
void chunk_bwd_tc(cudaStream_t s, const ChunkGeom& g, const SsmChunkBwd<T>& p, const float* dS,
                  const ClusterTail<T>* ct) {
  M3_REQUIRE(g.nt == 1, kChunkWhere, "chunk_bwd_tc needs chunks of at most 64 rows",
             "chunk_size=", g.cs, " T=", g.T);
  M3_REQUIRE(!ct || (ct->cz >= 1 && ct->cz <= 8 && kTR % ct->cz == 0 && g.nh % ct->cz == 0 &&
                     g.ds % 2 == 0 && g.ds <= 128),
             kChunkWhere, "bad fused-tail cluster", "cz=", ct ? ct->cz : 0u, " nh=", g.nh,
             " ds=", g.ds);
  const dim3 grid(static_cast<unsigned>(g.nc), static_cast<unsigned>(g.nh),
                  static_cast<unsigned>(g.B));
  with_pads(g.hd, g.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    with_wgmma<kWgmma<16 * RH, 16 * RD>>([&](auto w) {
      launch_bwd_tc<T, RH, RD, decltype(w)::value>(s, g, p, dS, ct, grid);
    });
  });
}

#define M3_INSTANTIATE(T)                                                           \
  template void chunk_bwd_tc<T>(cudaStream_t, const ChunkGeom&, const SsmChunkBwd<T>&, \
                                const float*, const ClusterTail<T>*);
M3_FOR_EACH_TYPED_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
