// Internal to gpu/scan/ (.cu files only): the per-(r, h) work of step 2 of the chunked backward
// (MODEL.md §6.4; chunked_detail.cuh has the family's math), shared by the standalone tail
// (qk_rope_bwd_kernel, chunked_bwd.cu) and the tail fused into B3 (chunk_bwd_tc.cu, kTail), so
// that both compute each pair's outputs (d_b/c_pre_rope, d_angle_cumsum) with the same
// instructions (tail_pair) and give the same bits; the row sums dScale and dGamma each tail
// adds in its own fixed order. Per (r, h) (the standalone tail's lanes: pairs p = lane and
// lane + 32, values n = 2p, 2p + 1; ds ≤ 128):
//   dv1 = scale·dK_mid (+ d_k_out at t = T−1), dv2 = dQ_mid, e = dQK·γ;
//   rotated pair (p < na, θ_p = theta[r, h, p], R its rotation):
//     d_b_pre_rope = Rᵀdv1 + e·c_biased, d_c_pre_rope = Rᵀdv2 + e·b_biased,
//     d_angle_cumsum_p = (−dv1_{2p}·k_{2p+1} + dv1_{2p+1}·k_{2p}) + (−dv2_{2p}·q_{2p+1} + dv2_{2p+1}·q_{2p});
//   other pairs: the same without R;  dScale = Σ_n dK_mid·k,  dGamma = dQK·Σ_n c_biased·b_biased.
// Shapes: [BT, nh] for scale, γ, dQK, dScale, dGamma; [BT, nh, ds] for dK_mid, dQ_mid, k, q,
// b/c_biased, d_b/c_pre_rope; [BT, nh, na] for θ and d_angle_cumsum; [BT, ng, ds] for b/c_normed
// and d_b/c_normed; [nh, ds] for the biases; [B, nh, ds] for d_k_out.
#pragma once

#include "common.cuh"
#include "convert.cuh"
#include "rope_pair.cuh"
#include "stages.cuh"

namespace m3::gpu {

// The tail's launch geometry over a slab of rows (ssm_chunked_backward launches the tail once per
// slab, with TailArgs shifted to the slab's first row, so that every in-kernel offset fits 32
// bits: rows·nh·max(ds, na) < 2^31).
struct TailGeom {
  unsigned rows, nh, ds, na, ng, hpg, T;
  Idx r_base;  // the slab's first row (global): t = (r_base + r) mod T
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

// The lane's values of the row at x + row (len values): v[2k], v[2k + 1] = values 2p, 2p + 1 of
// the pair p = lane + 32k (0 past len), and back (nothing written past len). kVec: len is even
// and the rows aligned to two values, so a pair inside the row is one access; kFull (with kVec):
// len = 128, every pair inside (and na = 32, pair_rotated).
template <bool kVec, bool kFull, class X>
__device__ __forceinline__ void pair_load(const X* x, unsigned row, unsigned lane, unsigned len,
                                          float (&v)[4]) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const unsigned n = 2 * (lane + 32 * k);
    float w[2] = {0.0f, 0.0f};
    if constexpr (kFull) {
      load_n<2>(x + (row + n), w);
    } else if constexpr (kVec) {
      if (n < len) load_n<2>(x + (row + n), w);
    } else {
#pragma unroll
      for (unsigned e = 0; e < 2; ++e)
        if (n + e < len) w[e] = to_float(x[row + n + e]);
    }
    v[2 * k] = w[0];
    v[2 * k + 1] = w[1];
  }
}
template <bool kVec, bool kFull, class X>
__device__ __forceinline__ void pair_store(X* x, unsigned row, unsigned lane, unsigned len,
                                           const float (&v)[4]) {
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const unsigned n = 2 * (lane + 32 * k);
    const float w[2] = {v[2 * k], v[2 * k + 1]};
    if constexpr (kFull) {
      store_n<2>(x + (row + n), w);
    } else if constexpr (kVec) {
      if (n < len) store_n<2>(x + (row + n), w);
    } else {
#pragma unroll
      for (unsigned e = 0; e < 2; ++e)
        if (n + e < len) x[row + n + e] = from_float<X>(w[e]);
    }
  }
}

// Whether the lane's pair p = lane + 32k (in half k of the row) is rotated: rope_pair_rotated.
template <bool kFull>
__device__ __forceinline__ bool pair_rotated(unsigned k, unsigned lane, unsigned na) {
  return rope_pair_rotated<kFull>(k, lane + 32 * k, na);
}

// One (r, h)'s inputs for the lane: without kRecompute loaded by tail_load one (r, h) ahead of
// its arithmetic; with it filled by qk_rope_bwd_kernel from the warp's item ring and staged rows.
struct TailIn {
  float sc, dqk, gam, th[2], dk[4], g2[4];
  float x1[4], x2[4];  // kRecompute: b_normed, c_normed; else k, q
  float bb[4], cb[4];  // b_biased, c_biased (read unless kRecompute)
};

// The inputs of (r, h) without kRecompute (the stored k, q and b/c_biased).
template <class T, bool kVec, bool kFull>
__device__ __forceinline__ void tail_load(const TailGeom& tg, const TailArgs<T>& a, unsigned r,
                                          unsigned h, unsigned lane, TailIn& in) {
  const unsigned i = r * tg.nh + h, base = i * tg.ds, ds = tg.ds;
  in.sc = a.scale_saved[i];
  in.dqk = a.dQK_dot[i];
  in.gam = a.gamma_saved[i];
#pragma unroll
  for (unsigned k = 0; k < 2; ++k) {
    const unsigned p = lane + 32 * k;
    in.th[k] = pair_rotated<kFull>(k, lane, tg.na) ? a.theta[i * tg.na + p] : 0.0f;
  }
  pair_load<kVec, kFull>(a.dK_mid, base, lane, ds, in.dk);
  pair_load<kVec, kFull>(a.dQ_mid, base, lane, ds, in.g2);
  pair_load<kVec, kFull>(a.k, base, lane, ds, in.x1);
  pair_load<kVec, kFull>(a.q, base, lane, ds, in.x2);
  pair_load<kVec, kFull>(a.b_biased, base, lane, ds, in.bb);
  pair_load<kVec, kFull>(a.c_biased, base, lane, ds, in.cb);
}

// One pair's arithmetic of (r, h)'s step 2 (the header's formulas): values n, n + 1 of pair p,
// rotated when rot (th = θ_p). dk, g2: dK_mid, dQ_mid; kRecompute: x1, x2 = b/c_normed and
// ab, ac the head's biases; else x1, x2 = k, q and bb, cb = b/c_biased. dkout: d_k_out at
// t = T − 1, else 0; e = dQK·γ. Adds dK_mid·k to dsc and c_biased·b_biased to qk (value n, then
// n + 1: the caller's order over the pairs fixes the sums' bits), leaves d_b/c_pre_rope in db,
// dc and returns d_angle_cumsum_p (0 unless rot). Both tails call it, so every per-element
// output is the same instructions in each. The fmas are written out so that every
// instantiation rounds the same way.
template <class T, bool kRecompute>
__device__ __forceinline__ float tail_pair(float sc, float e, bool rot, float th, float2 dk,
                                           float2 g2, float2 x1, float2 x2, float2 bb, float2 cb,
                                           float2 ab, float2 ac, float2 dkout, float& dsc,
                                           float& qk, float2& db, float2& dc) {
  float kv[2], qv[2], bv[2], cv[2];
  if constexpr (kRecompute) {  // b/c_biased, and k, q as F4ef stored them (copies unless rot)
    bv[0] = x1.x + ab.x, bv[1] = x1.y + ab.y;
    cv[0] = x2.x + ac.x, cv[1] = x2.y + ac.y;
    // Values that only feed arithmetic: round_trip2 (NaN stays NaN).
    round_trip2<T>(bv[0], bv[1]);
    round_trip2<T>(cv[0], cv[1]);
    kv[0] = bv[0], kv[1] = bv[1], qv[0] = cv[0], qv[1] = cv[1];
  } else {
    kv[0] = x1.x, kv[1] = x1.y, qv[0] = x2.x, qv[1] = x2.y;
    bv[0] = bb.x, bv[1] = bb.y, cv[0] = cb.x, cv[1] = cb.y;
  }
  float sn = 0.0f, cs = 1.0f;
  if (rot) {
    sincosf(th, &sn, &cs);
    if constexpr (kRecompute) {
      rope_rotate(sn, cs, bv[0], bv[1], kv[0], kv[1]);
      rope_rotate(sn, cs, cv[0], cv[1], qv[0], qv[1]);
      round_trip2<T>(kv[0], kv[1]);
      round_trip2<T>(qv[0], qv[1]);
    }
  }
  const float g1[2] = {__fmaf_rn(sc, dk.x, dkout.x), __fmaf_rn(sc, dk.y, dkout.y)};
  dsc = __fmaf_rn(dk.x, kv[0], dsc);
  qk = __fmaf_rn(cv[0], bv[0], qk);
  dsc = __fmaf_rn(dk.y, kv[1], dsc);
  qk = __fmaf_rn(cv[1], bv[1], qk);
  float o1[2] = {g1[0], g1[1]}, o2[2] = {g2.x, g2.y}, dang = 0.0f;
  if (rot) {
    rope_rotate_t(sn, cs, g1[0], g1[1], o1[0], o1[1]);
    rope_rotate_t(sn, cs, g2.x, g2.y, o2[0], o2[1]);
    dang = rope_angle_grad(g1[0], g1[1], kv[0], kv[1]) + rope_angle_grad(g2.x, g2.y, qv[0], qv[1]);
  }
  db = make_float2(__fmaf_rn(e, cv[0], o1[0]), __fmaf_rn(e, cv[1], o1[1]));
  dc = make_float2(__fmaf_rn(e, bv[0], o2[0]), __fmaf_rn(e, bv[1], o2[1]));
  return dang;
}

// (r, h)'s arithmetic: d_b/c_pre_rope into db, dc (the lane's values), d_angle_cumsum, dScale
// and dGamma stored. ab, ac: kRecompute's biases of head h. last: t = T − 1.
template <class T, bool kRecompute, bool kVec, bool kFull>
__device__ __forceinline__ void tail_item(const TailGeom& tg, const TailArgs<T>& a, unsigned r,
                                          unsigned h, unsigned lane, bool last,
                                          const TailIn& in, const float (&ab)[4],
                                          const float (&ac)[4], float (&db)[4], float (&dc)[4],
                                          float& half_sum) {
  const unsigned i = r * tg.nh + h, ds = tg.ds;
  const float e = in.dqk * in.gam;
  float dkout[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  if (last) {
    const float* row = a.d_k_out + ((tg.r_base + r) / tg.T) * Idx(tg.nh * ds);
    pair_load<kVec, kFull>(row, h * ds, lane, ds, dkout);
  }
  float dsc = 0.0f, qk = 0.0f;
#pragma unroll
  for (unsigned k = 0; k < 2; ++k) {  // pair p = lane + 32k: values 2k, 2k + 1 of the lane's 4
    // Values past ds are 0 in every input, so they add 0 to the sums and are not stored.
    const unsigned p = lane + 32 * k;
    const int a0 = 2 * k, a1 = 2 * k + 1;
    const bool rot = pair_rotated<kFull>(k, lane, tg.na);
    auto two = [&](const float(&v)[4]) { return make_float2(v[a0], v[a1]); };
    float2 b2, c2;
    const float dang = tail_pair<T, kRecompute>(in.sc, e, rot, in.th[k], two(in.dk), two(in.g2),
                                                two(in.x1), two(in.x2),
                                                two(kRecompute ? in.x1 : in.bb),  // (unread
                                                two(kRecompute ? in.x2 : in.cb),  //  if kRecompute)
                                                two(ab), two(ac), two(dkout), dsc, qk, b2, c2);
    if (rot) a.d_angle_cumsum[i * tg.na + p] = dang;
    db[a0] = b2.x, db[a1] = b2.y, dc[a0] = c2.x, dc[a1] = c2.y;
  }
  // Both sums in one butterfly (header), its first level here: lanes < 16 hold dsc's partial,
  // lanes ≥ 16 qk's; the caller runs the levels over 8, 4, 2, 1 for several items at once
  // (tail_sums_finish), so that their shuffles' latencies overlap.
  const bool lo = lane < 16;
  half_sum = (lo ? dsc : qk) + __shfl_xor_sync(0xffffffffu, lo ? qk : dsc, 16);
  if (a.d_b_pre_rope) {
    pair_store<kVec, kFull>(a.d_b_pre_rope, i * ds, lane, ds, db);
    pair_store<kVec, kFull>(a.d_c_pre_rope, i * ds, lane, ds, dc);
  }
}

// The rest of tail_item's butterfly for the items (r0 + q, h), q < n ≤ N, at once, level by
// level (each item's own tree unchanged, so its bits): v[q] ends as Σ dsc in lanes < 16 and
// Σ qk in lanes ≥ 16; item q stores dScale from lane 0 and dGamma = dqk[q]·Σ qk from lane 16
// (i = (r0 + q)·nh + h, tail_item's index).
template <int N>
__device__ __forceinline__ void tail_sums_finish(float (&v)[N], const float (&dqk)[N],
                                                 unsigned n, unsigned r0, unsigned h,
                                                 unsigned nh, unsigned lane, float* dScale,
                                                 float* dGamma) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1)
#pragma unroll
    for (int q = 0; q < N; ++q) v[q] += __shfl_xor_sync(0xffffffffu, v[q], o);
#pragma unroll
  for (int q = 0; q < N; ++q) {
    if (unsigned(q) >= n) continue;
    const unsigned i = (r0 + q) * nh + h;
    if (lane == 0) dScale[i] = v[q];
    if (lane == 16) dGamma[i] = dqk[q] * v[q];
  }
}

// a's [BT, ...] tensors from row r0 on (null stays null), for 32-bit offsets inside a kernel:
// the standalone tail's slabs (host) and the fused tail's chunk rows (device).
template <class T>
__host__ __device__ __forceinline__ TailArgs<T> tail_args_at(TailArgs<T> a, Idx r0, Idx nh,
                                                             Idx ds, Idx na, Idx ng) {
  const Idx rd = r0 * nh * ds, rs = r0 * nh, ra = r0 * nh * na, rg = r0 * ng * ds;
  a.scale_saved = shifted(a.scale_saved, rs);
  a.dQK_dot = shifted(a.dQK_dot, rs);
  a.gamma_saved = shifted(a.gamma_saved, rs);
  a.theta = shifted(a.theta, ra);
  a.dK_mid = shifted(a.dK_mid, rd);
  a.dQ_mid = shifted(a.dQ_mid, rd);
  a.k = shifted(a.k, rd);
  a.q = shifted(a.q, rd);
  a.b_biased = shifted(a.b_biased, rd);
  a.c_biased = shifted(a.c_biased, rd);
  a.b_normed = shifted(a.b_normed, rg);
  a.c_normed = shifted(a.c_normed, rg);
  a.d_angle_cumsum = shifted(a.d_angle_cumsum, ra);
  a.d_b_pre_rope = shifted(a.d_b_pre_rope, rd);
  a.d_c_pre_rope = shifted(a.d_c_pre_rope, rd);
  a.dScale = shifted(a.dScale, rs);
  a.dGamma = shifted(a.dGamma, rs);
  a.d_b_normed = shifted(a.d_b_normed, rg);
  a.d_c_normed = shifted(a.d_c_normed, rg);
  return a;
}
// p's step-2 tensors as TailArgs, from row 0.
template <class T>
TailArgs<T> tail_args_of(const SsmChunkBwd<T>& p) {
  return TailArgs<T>{p.scale_saved, p.dQK_dot,    p.gamma_saved,  p.theta,    p.dK_mid,
                     p.dQ_mid,      p.k,          p.q,            p.b_biased, p.c_biased,
                     p.b_normed,    p.c_normed,   p.b_bias,       p.c_bias,   p.d_k_out,
                     p.d_angle_cumsum, p.d_b_pre_rope, p.d_c_pre_rope, p.dScale, p.dGamma,
                     p.d_b_normed,  p.d_c_normed};
}

// The tail fused into B3 (chunk_bwd_tc's kTail blocks, one per (c, h, b), in clusters of cz
// consecutive heads of one (c, b); cz divides the heads per group): each block does step 2 for
// its chunk's rows of head h, then
//   part_X[b·nc + c, h·ds + n] = Σ_{τ < L} d_X_pre_rope[row0 + τ, h, n]        (τ ascending)
//   hsum_X[h / cz, r, n]       = Σ_{j < cz} d_X_pre_rope[r, cz·(h / cz) + j, n]  (j ascending)
// (X = b, c), the head sum through the cluster's distributed shared memory. The launcher then
// sums the hpg / cz cluster partials of each group into d_X_normed (ascending) and part_X over
// the B·nc chunks into d X_bias.
template <class T>
struct ClusterTail {
  TailArgs<T> a;           // from row 0
  float *part_b, *part_c;  // [B·nc, nh·ds]
  float *hsum_b, *hsum_c;  // [nh / cz, BT, ds]
  unsigned na, ng, hpg, cz;
};

}  // namespace m3::gpu
