// Angle accumulation (F5), RoPE on B → k and C → q (F4e/f), and their backward (B6 RoPE tail,
// B5a). MODEL.md §4 F5, F4e/f, §6.2 B6-tail/B5a, §12.3; the same formulas, operation for
// operation, as reference/rope.cpp (F5 and B5a re-associated over t as stated below).
//
// F5, per (b, h, a) the serial recurrence of the reference, θ carried in DOUBLE:
//   τ      = tanh(angles_raw[r,a])            (float; once per (r, a), into Scratch [BT, na],
//                                              then read by the nh heads' walks)
//   p      = τ·dt[r,h]                        (float)
//   incr_t = π·p rounded once to float        (fma(p, π_hi, p·π_lo): π unrounded, ref::times_pi)
//   θ_t    = wrap(θ_{t−1} + incr_t),  θ_{−1} = angle_in[b,h,a]   (double)
//   wrap(v) = v − 2π·⌊v/2π⌋ ∈ [0, 2π)  (a result that rounds up to 2π becomes 0)
//   angle_cumsum[r,h,a] = float(θ_t);  angle_out[b,h,a] = float(θ_{T−1})
// Parallel over t. j = h·na + a (θ is [BT, nh·na], j fastest); one block of 512 threads per
// (b, group of kAngleJ = 32 consecutive j: a warp's lanes, so every row access of a warp is one
// 128-byte line); warp s owns segment s < kAngleSegs = 16 of kAngleSteps = 8 consecutive steps
// of a tile (16·8 = 128 steps), lane jl its j. Tiles run in ascending t with a carried θ c (c = θ_{−1}
// before the first tile, then the θ walked at the previous tile's last step); a tile's
// τ and dt are loaded while the previous tile is walked. With x_k = double(incr) at
// step k of segment s (0 past T):
//   1. Σ_s = ((x_0 + x_1) + (x_2 + x_3)) + ((x_4 + x_5) + (x_6 + x_7))                (double)
//   2. across warps (shared memory, one barrier per tile): P_s = (…(Σ_0 + Σ_1) + …) + Σ_{s−1};
//      entering value E_0 = c,  E_s = wrap(c + P_s)  for s ≥ 1
//   3. walk from E_s: θ = wrap(θ + x_k) after every step, store float(θ); c ← the θ of the
//      tile's last step.
// In exact arithmetic E_s = θ_{t−1} for t the segment's first step (wrap(wrap(x) + y) =
// wrap(x + y)), so this is the serial recurrence re-associated. Rounding, u = 2⁻⁵³, to first
// order (+ and wrap move a value on the circle by their own rounding only, so the roundings on
// the chain of operations that yields θ_t add up): the reference's chain rounds twice per step
// (the add; the wrap: exact, or by ≤ u·(|v| + 4π)); this one has, for each tile up to t's, c + Q_s
// and its wrap (≤ 2u·(|c| + Σ_tile |incr| + 2π)), P_s (each increment passes through ≤ 3 + 14 + 1
// = 18 additions: ≤ 18u·Σ_tile |incr|) and ≤ 8 walked steps. So |Δθ_t| ≲ u·(24·Σ_{t'≤t}
// |incr_t'| + 6·|θ_{−1}| + 9π·(t + 9)): below 1e-10 rad at T = 4096 with |incr| ≤ 2π and
// |θ_{−1}| ≤ 1e4, far below the f32 rounding of the stored θ (up to 2.4e-7 near 2π).
// wrap_two_pi takes ⌊v/2π⌋ ∈ {−1, 0, 1} without the division, bit for bit equal to the full
// formula; the walk in 3 is the serial recurrence itself.
// F4e/f, adjacent pairs (2a, 2a+1), a < na, c = cos θ[r,h,a], s = sin θ[r,h,a]; n ≥ 2na copied:
//   k[2a] = c·b[2a] − s·b[2a+1],   k[2a+1] = s·b[2a] + c·b[2a+1]     (b = b_biased; q from c)
// Fused with F4's bias add (rope_forward_normed): b_biased = T(float(b_normed[r, g(h)]) +
// b_bias[h]) computed here, bit for bit F4's stored value (likewise c_biased); the products and
// sums of the rotation are pinned to round-to-nearest operations (rope_pair.cuh).
// RoPE backward, two rotated vectors at once (path 1 = k, path 2 = q), dv = ∂L/∂rotated:
//   dpre[2a]   = c·dv[2a] + s·dv[2a+1] (+ extra_scale·extra_vec[2a])        (n ≥ 2na: dv + …)
//   dpre[2a+1] = −s·dv[2a] + c·dv[2a+1] (+ extra_scale·extra_vec[2a+1])
//   dθ[r,h,a]  = (−dv1[2a]·rot1[2a+1] + dv1[2a+1]·rot1[2a]) + (same for path 2)   (overwrite)
// B5a (wrap = identity for differentiation):
//   Θ̄_t = Σ_{s ≥ t} dθ_s (+ ∂L/∂angle_out at t = T−1), in Scratch [BT, nh, na], d_angle_in = Θ̄_0,
// in f32, parallel over t with the blocks, threads and tiles of F5, tiles in descending t with
// a carried c (c = ∂L/∂angle_out (0 if null) before the last tile, then Θ̄ at the first step of
// the tile just done); a tile's dθ is loaded while the tile after it is walked. With g_k = dθ at
// step k of segment s (0 past T):
//   1. R_s = ((g_0 + g_1) + (g_2 + g_3)) + ((g_4 + g_5) + (g_6 + g_7))
//   2. across warps: Q_s = (…(R_15 + R_14) + …) + R_{s+1}; entering value F_15 = c,
//      F_s = c + Q_s  for s ≤ 14
//   3. walk from F_s in descending t: Θ̄ += g_k, store Θ̄_t; c ← Θ̄ at the tile's first step.
// Exactly Θ̄ in exact arithmetic; in f32 a fixed summation order other than the reference's.
// Then one thread per output, with τ = tanh(angles_raw) formed once per (r, a) (Scratch, after Θ̄):
//   d_angles_raw[r,a] = Σ_h Θ̄[r,h,a]·π·dt[r,h]·(1 − τ[r,a]²)   (ascending h)
//   d_dt_angle[r,h]   = Σ_a Θ̄[r,h,a]·π·τ[r,a]                  (ascending a)
// τ once per (r, a) instead of once per (r, h, a) in each reader: the same float values in the
// same operations (tanhf is a function of its argument), nh times fewer tanhf. Fused runs also
// store d_angles_raw rounded to T into d_proj's angle columns (AngleBwd::d_angles_raw_cols,
// proj_cols.cuh), B3's copy of it.
// Every order above depends only on the shapes (deterministic, no atomics). Coalescing: a warp
// is 4 segments × 8 consecutive j, so each access to θ, dθ, Θ̄ is 4 whole 32-byte sectors;
// τ[r,a] (read by the nh threads of (r, a)) and dt[r,h] (by the na of (r, h)) are
// small and come from L1/L2.
// Typed storage T: b/c_biased, rot and extra_vec are read as f32, k and q rounded once at their
// store; θ, dv, dpre, dθ and every angle tensor are f32.
// RoPE threads: with ds % V == 0 and 16-byte aligned [BT, nh, ds] pointers, one thread per V =
// 16 / sizeof(T) consecutive values of a row (V/2 pairs; one 16-byte access per tensor, two for
// f32 next to a 16-bit T; θ/dθ of the V/2 pairs in one access when na % (V/2) == 0 and aligned);
// else one thread per pair slot. Same arithmetic per value either way.
// Shapes: angles_raw, d_angles_raw [BT, na]; dt, d_dt_angle [BT, nh]; θ, dθ [BT, nh, na];
// angle_in/out [B, nh, na]; b/c_biased, k, q, dv, rot, dpre, extra_vec [BT, nh, ds];
// extra_scale [BT, nh]. Nullable: angle_in (zeros), d_angle_out (zeros), d_angle_in (not
// written).
#include <climits>
#include <initializer_list>
#include <type_traits>

#include "convert.cuh"
#include "fast_div.cuh"
#include "reduce.cuh"
#include "rope_pair.cuh"

namespace m3::gpu {

namespace {

constexpr double kTwoPiD = ref::kTwoPi;
// π as two floats (ref::times_pi). B5a's products take kPiHiF alone: π's rounding moves each
// by 2.8e-8 of itself, below their own rounding, and nothing sums them along t.
constexpr float kPiHiF = ref::kPiHi<float>, kPiLoF = ref::kPiLo<float>;
// F5 / B5a blocks: kAngleJ consecutive j = h·na + a (a warp's lanes) × kAngleSegs segments (one
// per warp) of kAngleSteps steps. A warp's row accesses are 128-byte lines: with 8 j per block
// and 4 segments per warp each access would be 4 sectors in 4 lines, and the kernels bound by
// L2 requests (ncu). The walk is a serial chain per thread (T / 16 steps), so the blocks are
// 16 warps wide and two fit an SM (≤ 64 registers): 32 warps per SM at B·nh·na / 32 blocks.
// F5's walk is no faster with 16 warps of 8 steps than with 8 of 16; what bounds it is still
// open (docs/log/PERF-history.md).
constexpr int kAngleThreads = 512;
constexpr int kAngleJ = 32;                               // 32 floats = one 128-byte line
constexpr int kAngleSegs = kAngleThreads / 32;            // 16 segments per tile
constexpr int kAngleSteps = 8;                            // steps per segment
constexpr Idx kAngleTile = Idx(kAngleSegs) * kAngleSteps;  // 128 steps per tile
static_assert(kAngleJ == 32 && kAngleSteps == 8,
              "F5 / B5a: one segment per warp, lanes over j; step 1's sum tree takes 8 steps");
// Fast-path bounds of wrap_two_pi: for 0 ≤ v < kWrapLo the rounded v/2π is < 1; for
// 2π ≤ v < kWrapHi it is in [1, 2); for −kWrapLo < v < −kWrapTiny it is in (−1, 0) (no underflow).
constexpr double kWrapLo = 6.28, kWrapHi = 12.5, kWrapTiny = 1e-300;

// v − 2π·⌊v/2π⌋ without contraction into an fma (the reference rounds the product first);
// ⌊v/2π⌋ ∈ {0, 1, −1} are taken without the division, with the same result bit for bit
// (2π·k is then exact and v + 0 turns −0 into +0 as v − 2π·(−0) does).
__device__ __forceinline__ double wrap_two_pi(double v) {
  if (v >= 0.0 && v < kWrapLo) return __dadd_rn(v, 0.0);
  if (v >= kTwoPiD && v < kWrapHi) return __dsub_rn(v, kTwoPiD);
  const double w = v < -kWrapTiny && v > -kWrapLo
                       ? __dadd_rn(v, kTwoPiD)
                       : __dsub_rn(v, __dmul_rn(kTwoPiD, floor(v / kTwoPiD)));
  return w >= kTwoPiD ? 0.0 : w;
}

// Steps t < T of the segment starting at ts: min(kAngleSteps, T − ts), 0 if ts ≥ T.
__device__ __forceinline__ int segment_steps(Idx T, Idx ts) {
  return ts >= T ? 0 : T - ts >= kAngleSteps ? kAngleSteps : static_cast<int>(T - ts);
}

// v[k] = p[k·stride] for k < steps (read-only data); v[k] for k ≥ steps keeps its value.
__device__ __forceinline__ void load_steps(const float* p, int stride, int steps,
                                           float (&v)[kAngleSteps]) {
#pragma unroll
  for (int k = 0; k < kAngleSteps; ++k)
    if (k < steps) v[k] = __ldg(p + k * stride);
}

// Pairwise sum of N values: (first half) + (second half), recursively; for N = 8
// ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)).
template <int N, class S>
__device__ __forceinline__ S pairwise_sum(const S* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return pairwise_sum<N / 2>(v) + pairwise_sum<N / 2>(v + N / 2);
  }
}
template <class S>
__device__ __forceinline__ S segment_sum(const S (&v)[kAngleSteps]) {
  return pairwise_sum<kAngleSteps>(v);
}

// One block per (b, group of kAngleJ consecutive j); thread (s, jl): warp s, lane jl; see the
// header (F5 1–3). One barrier per tile: Σ_s and c are double-buffered by tile parity p (a
// buffer is written only after the barrier that follows its last read). Row strides na, nh,
// nh·na fit in int (checked by the launcher).
// kNa, kNh > 0: na and nh known when compiling (the official 32 and 32, angle_forward_full), so
// that the row strides are immediates: a tile's 16 loads and 8 stores take their offsets from
// one base address each, where the generic instantiation forms 64-bit addresses from strides
// held opaque (so that they are not hoisted into registers per step). A spill at the kernel's
// 64 registers leaves a spill store waiting on a load of the next tile (ncu); with the
// increments held as floats below, ptxas reports no spill for the generic instantiation and
// 8 B for <32, 32> (74 registers unbounded, against 80).
// With the widths known, the tiles that lie wholly before T (all but the last, if T is no
// multiple of 128) also go without the per-step predicates `k < steps` on their increments,
// their walk and, where the next tile is whole too, its loads (with them, 25 ISETP and 8 FSEL
// of a tile's 83-instruction load run, in the SASS samples); <32, 32> then has no spill either.
// The same expressions in the same order: the same bits (GpuAnglesFull.ForwardGivesTheBits…).
template <int kNa, int kNh>
__global__ void __launch_bounds__(kAngleThreads, 2)
angle_forward_kernel(Idx B, Idx T, Idx nh_in, Idx na_in, const float* __restrict__ tau,
                     const float* __restrict__ dt, const float* __restrict__ angle_in,
                     float* __restrict__ angle_cumsum, float* __restrict__ angle_out) {
  static_assert((kNa > 0) == (kNh > 0), "both widths known, or neither");
  constexpr bool kFull = kNa > 0;
  static_assert(kNa * kNh % kAngleJ == 0, "with the widths known, every lane has a j < nj");
  __shared__ double seg_sum[2][kAngleSegs][kAngleJ];  // Σ_s
  __shared__ double carry[2][kAngleJ];                // c
  const int jl = threadIdx.x % kAngleJ, s = threadIdx.x / kAngleJ;
  const Idx nh = kFull ? Idx(kNh) : nh_in, na = kFull ? Idx(kNa) : na_in;
  const Idx nj = nh * na, groups = (nj + kAngleJ - 1) / kAngleJ;
  for (Idx u = blockIdx.x; u < B * groups; u += gridDim.x) {
    const Idx b = u / groups, j = (u % groups) * kAngleJ + jl;
    const bool on = j < nj;
    const Idx h = on ? j / na : 0, a = on ? j % na : 0, r0 = b * T + Idx(s) * kAngleSteps;
    // At the segment's first step r = b·T + ts of the current tile (advanced a tile at a time).
    const float* tp = tau + r0 * na + a;
    const float* dtp = dt + r0 * nh + h;
    float* out = angle_cumsum + r0 * nj + j;
    if (s == 0) carry[0][jl] = on && angle_in ? static_cast<double>(angle_in[b * nj + j]) : 0.0;
    float tv[kAngleSteps] = {}, dv[kAngleSteps] = {};  // τ, dt of the segment's steps
    const int first = on ? segment_steps(T, Idx(s) * kAngleSteps) : 0;
    load_steps(tp, static_cast<int>(na), first, tv);
    load_steps(dtp, static_cast<int>(nh), first, dv);
    int p = 0;
    // One tile. kWhole: every segment's kAngleSteps steps are < T (so every step's increment
    // is taken and the walk is the unpredicated one); kNextWhole: the next tile's are too (so
    // its loads need no step predicates). Both only with kFull (where every j < nj); either
    // way the same expressions in the same order as the predicated body.
    auto tile = [&](Idx t0, auto whole, auto next_whole) {
      constexpr bool kWhole = decltype(whole)::value, kNextWhole = decltype(next_whole)::value;
      const Idx ts = t0 + Idx(s) * kAngleSteps;  // this segment's first step
      const int steps = kWhole ? kAngleSteps : on ? segment_steps(T, ts) : 0;
      const int sa = kFull ? kNa : opaque(static_cast<int>(na)),
                sh = kFull ? kNh : opaque(static_cast<int>(nh)),
                sj = kFull ? kNa * kNh : opaque(static_cast<int>(nj));
      // The increments π·(tanh·dt), 0 past T, held as floats: x_k = double(inc[k]) is formed
      // again where the walk adds it (exact either way), so that the eight doubles are not live
      // beside the next tile's loads (at 64 registers they spilled).
      float inc[kAngleSteps];
      double x[kAngleSteps];
#pragma unroll
      for (int k = 0; k < kAngleSteps; ++k) {
        const float p = __fmul_rn(tv[k], dv[k]);
        const float v = __fmaf_rn(p, kPiHiF, __fmul_rn(p, kPiLoF));
        inc[k] = kWhole || k < steps ? v : 0.0f;
        x[k] = static_cast<double>(inc[k]);
      }
      const double sum = segment_sum(x);  // 1. Σ_s
      if (s < kAngleSegs - 1) seg_sum[p][s][jl] = sum;
      __syncthreads();
      // The next tile's τ and dt, in flight during this tile's walk.
      const int next = kNextWhole ? kAngleSteps : on ? segment_steps(T, ts + kAngleTile) : 0;
      if constexpr (kFull) {
        load_steps(tp + kAngleTile * kNa, kNa, next, tv);
        load_steps(dtp + kAngleTile * kNh, kNh, next, dv);
      } else {
        load_steps(opaque(tp + kAngleTile * Idx(sa)), sa, next, tv);
        load_steps(opaque(dtp + kAngleTile * Idx(sh)), sh, next, dv);
      }
      double theta = carry[p][jl];  // E_0 = c
      if (s > 0) {                  // 2. E_s = wrap(c + P_s)
        double ps = seg_sum[p][0][jl];
#pragma unroll
        for (int m = 1; m < kAngleSegs - 1; ++m)
          if (m < s) ps += seg_sum[p][m][jl];
        theta = wrap_two_pi(theta + ps);
      }
      if (kWhole || steps == kAngleSteps) {  // 3. walk
#pragma unroll
        for (int k = 0; k < kAngleSteps; ++k) {
          theta = wrap_two_pi(theta + static_cast<double>(inc[k]));
          out[k * sj] = static_cast<float>(theta);
        }
      } else {
#pragma unroll
        for (int k = 0; k < kAngleSteps - 1; ++k) {
          if (k < steps) {
            theta = wrap_two_pi(theta + static_cast<double>(inc[k]));
            out[k * sj] = static_cast<float>(theta);
          }
        }
      }
      if (s == kAngleSegs - 1 && t0 + kAngleTile < T) carry[p ^ 1][jl] = theta;
      if (steps > 0 && ts + steps == T) angle_out[b * nj + j] = static_cast<float>(theta);
      tp += kAngleTile * Idx(sa);
      dtp += kAngleTile * Idx(sh);
      out += kAngleTile * Idx(sj);
    };
    using Yes = std::true_type;
    using No = std::false_type;
    for (Idx t0 = 0; t0 < T; t0 += kAngleTile, p ^= 1) {
      if constexpr (kFull) {
        if (t0 + 2 * kAngleTile <= T)
          tile(t0, Yes{}, Yes{});
        else if (t0 + kAngleTile <= T)
          tile(t0, Yes{}, No{});
        else
          tile(t0, No{}, No{});
      } else {
        tile(t0, No{}, No{});
      }
    }
    __syncthreads();  // carry and seg_sum free for the next (b, group)
  }
}

// One thread per pair slot j < ⌈ds/2⌉ of one (r, h): a rotated pair (j < na) or two copies.
// Where F4ef takes b_biased and c_biased (value e of row rh = r·nh + h): the tensors F4 stored,
// or, fused with F4, recomputed from F4's stored X_normed and the bias exactly as F4 computes
// what it stores: X_biased = T(float(X_normed[r, g(h)]) + X_bias[h]) (bcnorm.cu).
template <class T>
struct StoredBiased {
  const T *b, *c;
  Idx ds;
  __device__ void at(Idx rh, Idx e, T& bv, T& cv) const {
    bv = b[rh * ds + e];
    cv = c[rh * ds + e];
  }
  template <int V>
  __device__ void vec(Idx rh, Idx e, VecOf<T, V>& bv, VecOf<T, V>& cv) const {
    bv = *reinterpret_cast<const VecOf<T, V>*>(b + rh * ds + e);
    cv = *reinterpret_cast<const VecOf<T, V>*>(c + rh * ds + e);
  }
};
template <class T>
struct BiasedFromNormed {
  const T *b_normed, *c_normed;
  const float *b_bias, *c_bias;
  Idx ds, ng;
  FastDiv nh, hpg;
  // Offsets of value e of row rh = r·nh + h in X_normed ([r, g(h)]) and in X_bias ([h]).
  __device__ void offsets(Idx rh, Idx e, Idx& gn, Idx& hn) const {
    Idx r;
    const Idx h = nh.divmod(rh, r);
    gn = (r * ng + hpg.div(h)) * ds + e;
    hn = h * ds + e;
  }
  __device__ void at(Idx rh, Idx e, T& bv, T& cv) const {
    Idx gn, hn;
    offsets(rh, e, gn, hn);
    bv = from_float<T>(to_float(b_normed[gn]) + b_bias[hn]);
    cv = from_float<T>(to_float(c_normed[gn]) + c_bias[hn]);
  }
  template <int V>
  __device__ void vec(Idx rh, Idx e, VecOf<T, V>& bv, VecOf<T, V>& cv) const {
    Idx gn, hn;
    offsets(rh, e, gn, hn);
    float bn[V], cn[V], bb[V], cb[V];
    load_vec<V>(b_normed + gn, bn);
    load_vec<V>(c_normed + gn, cn);
    load_vec<V>(b_bias + hn, bb);
    load_vec<V>(c_bias + hn, cb);
#pragma unroll
    for (int u = 0; u < V; ++u) {
      bv.e[u] = from_float<T>(bn[u] + bb[u]);
      cv.e[u] = from_float<T>(cn[u] + cb[u]);
    }
  }
};

template <class T, class Src>
__global__ void __launch_bounds__(kThreads)
rope_forward_kernel(Idx units, Idx ds, Idx na, const float* theta, Src src, T* k, T* q) {
  const Idx slots = (ds + 1) / 2;
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < units * slots;
       i += Idx(gridDim.x) * kThreads) {
    const Idx rh = i / slots, j = i % slots, n = rh * ds + 2 * j;
    T bt[2] = {}, ct[2] = {};
    src.at(rh, 2 * j, bt[0], ct[0]);
    if (2 * j + 1 < ds) src.at(rh, 2 * j + 1, bt[1], ct[1]);
    if (j < na) {
      float sn, cs;
      sincosf(theta[rh * na + j], &sn, &cs);
      const float b0 = to_float(bt[0]), b1 = to_float(bt[1]);
      const float c0 = to_float(ct[0]), c1 = to_float(ct[1]);
      float k0, k1, q0, q1;
      rope_rotate(sn, cs, b0, b1, k0, k1);
      rope_rotate(sn, cs, c0, c1, q0, q1);
      k[n] = from_float<T>(k0);
      k[n + 1] = from_float<T>(k1);
      q[n] = from_float<T>(q0);
      q[n + 1] = from_float<T>(q1);
    } else {
      k[n] = bt[0];
      q[n] = ct[0];
      if (2 * j + 1 < ds) {
        k[n + 1] = bt[1];
        q[n + 1] = ct[1];
      }
    }
  }
}

// θ of pairs j0 … j0 + P − 1 of row rh (those < na): one access when tvec and all are < na.
template <int P>
__device__ __forceinline__ void load_angles(const float* theta, Idx rh, Idx j0, Idx na, bool tvec,
                                            float (&th)[P]) {
  const float* t = theta + rh * na + j0;
  if (tvec && j0 + P <= na) {
    load_n<P>(t, th);
  } else {
#pragma unroll
    for (int e = 0; e < P; ++e) th[e] = j0 + e < na ? t[e] : 0.0f;
  }
}

// One thread per vector i of V values (row rh = i / (ds / V), pairs j0 … j0 + V/2 − 1): the
// vector path of the header; copied values keep their bits.
template <class T, class Src>
__global__ void __launch_bounds__(kThreads)
rope_forward_vec_kernel(Idx units, Idx ds, Idx na, bool tvec, const float* theta, Src src,
                        T* k, T* q, FastDiv per_row) {
  constexpr int V = 16 / sizeof(T), P = V / 2;
  using W = VecOf<T, V>;
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < units * per_row.divisor();
       i += Idx(gridDim.x) * kThreads) {
    Idx rh;
    const Idx j0 = per_row.divmod(i, rh) * P;
    W b, c;
    src.template vec<V>(rh, j0 * 2, b, c);
    W kv = b, qv = c;
    if (j0 < na) {
      float th[P];
      load_angles(theta, rh, j0, na, tvec, th);
#pragma unroll
      for (int e = 0; e < P; ++e) {
        if (j0 + e >= na) continue;
        float sn, cs;
        sincosf(th[e], &sn, &cs);
        const float b0 = to_float(b.e[2 * e]), b1 = to_float(b.e[2 * e + 1]);
        const float c0 = to_float(c.e[2 * e]), c1 = to_float(c.e[2 * e + 1]);
        float k0, k1, q0, q1;
        rope_rotate(sn, cs, b0, b1, k0, k1);
        rope_rotate(sn, cs, c0, c1, q0, q1);
        kv.e[2 * e] = from_float<T>(k0);
        kv.e[2 * e + 1] = from_float<T>(k1);
        qv.e[2 * e] = from_float<T>(q0);
        qv.e[2 * e + 1] = from_float<T>(q1);
      }
    }
    reinterpret_cast<W*>(k)[i] = kv;
    reinterpret_cast<W*>(q)[i] = qv;
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
rope_backward_kernel(Idx units, Idx ds, Idx na, RopeBwd<T> p) {
  const Idx slots = (ds + 1) / 2;
  const bool extra = p.extra_scale != nullptr;
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < units * slots;
       i += Idx(gridDim.x) * kThreads) {
    const Idx rh = i / slots, j = i % slots, n = rh * ds + 2 * j;
    const float e = extra ? p.extra_scale[rh] : 0.0f;
    if (j < na) {
      float sn, cs;
      sincosf(p.theta[rh * na + j], &sn, &cs);
      const float g0 = p.dv1[n], g1 = p.dv1[n + 1], h0 = p.dv2[n], h1 = p.dv2[n + 1];
      float o0, o1, u0, u1;
      rope_rotate_t(sn, cs, g0, g1, o0, o1);
      rope_rotate_t(sn, cs, h0, h1, u0, u1);
      if (extra) {
        o0 += e * to_float(p.extra_vec1[n]);
        o1 += e * to_float(p.extra_vec1[n + 1]);
        u0 += e * to_float(p.extra_vec2[n]);
        u1 += e * to_float(p.extra_vec2[n + 1]);
      }
      p.dpre1[n] = o0;
      p.dpre1[n + 1] = o1;
      p.dpre2[n] = u0;
      p.dpre2[n + 1] = u1;
      const float d1 = rope_angle_grad(g0, g1, to_float(p.rot1[n]), to_float(p.rot1[n + 1]));
      const float d2 = rope_angle_grad(h0, h1, to_float(p.rot2[n]), to_float(p.rot2[n + 1]));
      p.dtheta[rh * na + j] = d1 + d2;
    } else {
      const int m = 2 * j + 1 < ds ? 2 : 1;
      for (int o = 0; o < m; ++o) {
        float v1 = p.dv1[n + o], v2 = p.dv2[n + o];
        if (extra) {
          v1 += e * to_float(p.extra_vec1[n + o]);
          v2 += e * to_float(p.extra_vec2[n + o]);
        }
        p.dpre1[n + o] = v1;
        p.dpre2[n + o] = v2;
      }
    }
  }
}

// Vector path of rope_backward_kernel: one thread per vector i of V values, as
// rope_forward_vec_kernel; all loads before the stores.
template <class T>
__global__ void __launch_bounds__(kThreads)
rope_backward_vec_kernel(Idx units, Idx ds, Idx na, bool tvec, RopeBwd<T> p) {
  constexpr int V = 16 / sizeof(T), P = V / 2;
  const Idx per_row = ds / V;
  const bool extra = p.extra_scale != nullptr;
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < units * per_row;
       i += Idx(gridDim.x) * kThreads) {
    const Idx rh = i / per_row, j0 = (i % per_row) * P, n = i * V;
    const bool rot = j0 < na;
    float g[V], h[V], x1[V], x2[V], r1[V], r2[V], th[P];  // dv1, dv2, extra_vec1/2, rot1/2, θ
    load_vec(p.dv1 + n, g);
    load_vec(p.dv2 + n, h);
    const float e = extra ? p.extra_scale[rh] : 0.0f;
    if (extra) {
      load_vec(p.extra_vec1 + n, x1);
      load_vec(p.extra_vec2 + n, x2);
    }
    if (rot) {
      load_vec(p.rot1 + n, r1);
      load_vec(p.rot2 + n, r2);
      load_angles(p.theta, rh, j0, na, tvec, th);
    }
    float o[V], u[V], dth[P];  // dpre1, dpre2, dθ
#pragma unroll
    for (int a = 0; a < P; ++a) {
      const int m = 2 * a;
      if (j0 + a < na) {
        float sn, cs;
        sincosf(th[a], &sn, &cs);
        rope_rotate_t(sn, cs, g[m], g[m + 1], o[m], o[m + 1]);
        rope_rotate_t(sn, cs, h[m], h[m + 1], u[m], u[m + 1]);
        const float d1 = rope_angle_grad(g[m], g[m + 1], r1[m], r1[m + 1]);
        const float d2 = rope_angle_grad(h[m], h[m + 1], r2[m], r2[m + 1]);
        dth[a] = d1 + d2;
      } else {
        o[m] = g[m];
        o[m + 1] = g[m + 1];
        u[m] = h[m];
        u[m + 1] = h[m + 1];
      }
    }
    if (extra) {
#pragma unroll
      for (int m = 0; m < V; ++m) {
        o[m] += e * x1[m];
        u[m] += e * x2[m];
      }
    }
    store_vec(p.dpre1 + n, o);
    store_vec(p.dpre2 + n, u);
    if (rot) {
      float* dtheta = p.dtheta + rh * na + j0;
      if (tvec && j0 + P <= na) {
        store_n<P>(dtheta, dth);
      } else {
#pragma unroll
        for (int a = 0; a < P; ++a)
          if (j0 + a < na) dtheta[a] = dth[a];
      }
    }
  }
}

// Θ̄ (reverse cumulative sum over t) per (b, h, a) → bar [BT, nh, na]; d_angle_in = Θ̄_0.
// Blocks, threads and double-buffered R_s, c as angle_forward_kernel; see the header (B5a 1–3).
// kNa, kNh > 0: as angle_forward_kernel's (the row stride nh·na an immediate), taken with
// angle_grads_kernel<32, 32> (angle_grads_full); the same bits.
template <int kNa, int kNh>
__global__ void __launch_bounds__(kAngleThreads, 2)
angle_reverse_cumsum_kernel(Idx B, Idx T, Idx nh_in, Idx na_in,
                            const float* __restrict__ d_angle_cumsum,
                            const float* __restrict__ d_angle_out, float* __restrict__ bar,
                            float* __restrict__ d_angle_in) {
  static_assert((kNa > 0) == (kNh > 0), "both widths known, or neither");
  constexpr bool kFull = kNa > 0;
  __shared__ float seg_sum[2][kAngleSegs][kAngleJ];  // R_s
  __shared__ float carry[2][kAngleJ];                // c
  const int jl = threadIdx.x % kAngleJ, s = threadIdx.x / kAngleJ;
  const Idx nh = kFull ? Idx(kNh) : nh_in, na = kFull ? Idx(kNa) : na_in;
  const Idx nj = nh * na, groups = (nj + kAngleJ - 1) / kAngleJ;
  const Idx last = (T - 1) / kAngleTile * kAngleTile;  // first step of the last tile
  for (Idx u = blockIdx.x; u < B * groups; u += gridDim.x) {
    const Idx b = u / groups, j = (u % groups) * kAngleJ + jl;
    const bool on = j < nj;
    const Idx r0 = b * T + last + Idx(s) * kAngleSteps;
    // At the segment's first step r = b·T + ts of the current tile (moved back a tile at a time).
    const float* dth = d_angle_cumsum + r0 * nj + j;
    float* out = bar + r0 * nj + j;
    if (s == 0) carry[0][jl] = on && d_angle_out ? d_angle_out[b * nj + j] : 0.0f;
    float gn[kAngleSteps] = {};  // dθ of the segment's steps in the tile to do next
    load_steps(dth, static_cast<int>(nj), on ? segment_steps(T, last + Idx(s) * kAngleSteps) : 0,
               gn);
    int p = 0;
    for (Idx t0 = last; t0 >= 0; t0 -= kAngleTile, p ^= 1) {
      const int steps = on ? segment_steps(T, t0 + Idx(s) * kAngleSteps) : 0;
      const int sj = kFull ? kNa * kNh : opaque(static_cast<int>(nj));
      float g[kAngleSteps];  // dθ, 0 past T
#pragma unroll
      for (int k = 0; k < kAngleSteps; ++k) g[k] = k < steps ? gn[k] : 0.0f;
      // The previous tile's dθ (whole: its steps are < t0 ≤ T − 1), in flight during 1–3.
      if (t0 > 0) {
        if constexpr (kFull) {
          load_steps(dth - kAngleTile * kNa * kNh, kNa * kNh, on ? kAngleSteps : 0, gn);
        } else {
          load_steps(opaque(dth - kAngleTile * Idx(sj)), sj, on ? kAngleSteps : 0, gn);
        }
      }
      const float sum = segment_sum(g);  // 1. R_s
      if (s > 0) seg_sum[p][s][jl] = sum;
      __syncthreads();
      float run = carry[p][jl];  // F_15 = c
      if (s < kAngleSegs - 1) {  // 2. F_s = c + Q_s
        float q = seg_sum[p][kAngleSegs - 1][jl];
#pragma unroll
        for (int m = kAngleSegs - 2; m > 0; --m)
          if (m > s) q += seg_sum[p][m][jl];
        run += q;
      }
      if (steps == kAngleSteps) {  // 3. walk
#pragma unroll
        for (int k = kAngleSteps - 1; k >= 0; --k) {
          run += g[k];
          out[k * sj] = run;
        }
      } else {
#pragma unroll
        for (int k = kAngleSteps - 2; k >= 0; --k) {
          if (k < steps) {
            run += g[k];
            out[k * sj] = run;
          }
        }
      }
      if (s == 0 && t0 > 0) carry[p ^ 1][jl] = run;
      if (s == 0 && t0 == 0 && on && d_angle_in) d_angle_in[b * nj + j] = run;
      dth -= kAngleTile * Idx(sj);
      out -= kAngleTile * Idx(sj);
    }
    __syncthreads();  // carry and seg_sum free for the next (b, group)
  }
}

// τ[i] = tanhf(x[i]), i < n (F5's and B5a's τ = tanh(angles_raw), once per (r, a)).
__global__ void __launch_bounds__(kThreads)
tanh_kernel(Idx n, const float* __restrict__ x, float* __restrict__ tau) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < n; i += Idx(gridDim.x) * kThreads)
    tau[i] = tanhf(x[i]);
}

// One thread per output of row r: j < na → d_angles_raw[r, j]; else d_dt_angle[r, j − na]. With
// vec4 (na % 4 == 0, bar and τ 16-byte aligned) a d_dt_angle thread reads its rows of
// Θ̄ and τ 4 values per access (a quarter of the L1 wavefronts of its strided reads);
// the same terms in the same order either way. kNa, kNh > 0: na and nh known when compiling
// (the official 32 and 32, angle_grads_full): the row and column of i by shift and mask, and
// every loop unrolled, so that a d_angles_raw thread has its 32 terms' loads in flight at once
// where the rolled loop had 4 (ptxas unrolled it 4×) — the same terms, summed in the same order
// by the same expressions, so the same bits (GpuStagesA.AngleGradsFullGivesTheBitsOfTheGeneric…).
template <int kNa, int kNh>
__global__ void __launch_bounds__(kThreads)
angle_grads_kernel(Idx BT, Idx nh_in, Idx na_in, bool vec4, const float* tau, const float* dt,
                   const float* bar, float* d_angles_raw, float* d_dt_angle,
                   ProjCols d_angles_raw_cols) {
  static_assert((kNa > 0) == (kNh > 0), "both widths known, or neither");
  constexpr bool kFull = kNa > 0;
  const Idx na = kFull ? Idx(kNa) : na_in, nh = kFull ? Idx(kNh) : nh_in;
  const Idx per_row = na + nh;
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < BT * per_row;
       i += Idx(gridDim.x) * kThreads) {
    const Idx r = i / per_row, j = i % per_row;
    const float* bar_r = bar + r * nh * na;
    float sum = 0.0f;
    if (j < na) {
      const float th = tau[r * na + j];
      if constexpr (kFull) {  // every term's loads first, then the sum in ascending h
        float bv[kNh], dv[kNh];
#pragma unroll
        for (int h = 0; h < kNh; ++h) {
          bv[h] = bar_r[h * na + j];
          dv[h] = dt[r * nh + h];
        }
#pragma unroll
        for (int h = 0; h < kNh; ++h) sum += bv[h] * kPiHiF * dv[h] * (1.0f - th * th);
      } else {
        for (Idx h = 0; h < nh; ++h)
          sum += bar_r[h * na + j] * kPiHiF * dt[r * nh + h] * (1.0f - th * th);
      }
      d_angles_raw[r * na + j] = sum;
      store_col(d_angles_raw_cols, r, j, sum);  // production: d_proj's column too
    } else {
      const Idx h = j - na;
      const float *bar_h = bar_r + h * na, *tau_r = tau + r * na;
      if (vec4) {
        if constexpr (kFull) {  // the row's loads first, then the sum in ascending a
          static_assert(kNa % 4 == 0, "vec4 needs na % 4 == 0");
          float bv[kNa], tv[kNa];
#pragma unroll
          for (int a = 0; a < kNa; a += 4) {
            load_n<4>(bar_h + a, *reinterpret_cast<float(*)[4]>(bv + a));
            load_n<4>(tau_r + a, *reinterpret_cast<float(*)[4]>(tv + a));
          }
#pragma unroll
          for (int a = 0; a < kNa; ++a) sum += bv[a] * kPiHiF * tv[a];
        } else {
          for (Idx a = 0; a < na; a += 4) {
            float bv[4], tv[4];
            load_n<4>(bar_h + a, bv);
            load_n<4>(tau_r + a, tv);
#pragma unroll
            for (int e = 0; e < 4; ++e) sum += bv[e] * kPiHiF * tv[e];
          }
        }
      } else {
        for (Idx a = 0; a < na; ++a) sum += bar_h[a] * kPiHiF * tau_r[a];
      }
      d_dt_angle[r * nh + h] = sum;
    }
  }
}

// The official widths that the angle kernels' <kFullNa, kFullNh> instantiations compile in.
constexpr int kFullNa = 32, kFullNh = 32;
bool full_widths(const Dims& d) { return d.na == kFullNa && d.nh == kFullNh; }
// Whether angle_backward runs angle_grads_kernel<32, 32> (the official widths) where it can: on
// by default; tests turn it off to hold it to the generic instantiation's bits.
bool& angle_grads_full() {
  static bool on = true;
  return on;
}
// The same for angle_forward and angle_forward_kernel<32, 32>.
bool& angle_forward_full() {
  static bool on = true;
  return on;
}

void check_rope_dims(const Dims& d, const char* where) {
  M3_REQUIRE(d.B >= 1 && d.T >= 1 && d.BT == d.B * d.T && d.nh >= 1 && d.ds >= 1 && d.na >= 0 &&
                 2 * d.na <= d.ds,
             where, "bad dims", "B=", d.B, " T=", d.T, " BT=", d.BT, " nh=", d.nh, " ds=", d.ds,
             " na=", d.na, " (needs 2·na ≤ ds)");
}

// Values per thread of the RoPE vector path.
template <class T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));
// Whether the RoPE vector path applies: ds % V == 0 and the [BT, nh, ds] pointers (null ones
// aside) 16-byte aligned.
template <class T>
bool vector_rows(Idx ds, std::initializer_list<const void*> ptrs) {
  bool ok = ds % kVec<T> == 0;
  for (const void* q : ptrs) ok = ok && is_aligned(q, 16);
  return ok;
}
// Whether θ / dθ ([BT·nh, na]) go V/2 at a time: na % (V/2) == 0 and the pointers aligned to it.
template <class T>
bool angles_vec(Idx na, std::initializer_list<const float*> ptrs) {
  constexpr int P = kVec<T> / 2;
  bool ok = na % P == 0;
  for (const float* q : ptrs) ok = ok && is_aligned(q, P * sizeof(float));
  return ok;
}

// Blocks of angle_forward_kernel / angle_reverse_cumsum_kernel: one per (b, group of kAngleJ j).
unsigned int angle_blocks(const Dims& d) {
  return grid_for(d.B * ((d.nh * d.na + kAngleJ - 1) / kAngleJ), 1);
}

// The angle kernels address the steps of a segment by int offsets k·(row stride), k < kAngleSteps.
void check_angle_rows(const Dims& d, const char* where) {
  M3_REQUIRE(d.nh * d.na <= INT_MAX / kAngleSteps, where, "angle rows too wide", "nh·na=",
             d.nh * d.na, " (at most ", INT_MAX / kAngleSteps, ")");
}

template <class T, class Src>
void rope_forward_from(cudaStream_t s, const Dims& d, const float* theta, const Src& src,
                       bool vec, T* k, T* q) {
  const Idx units = d.BT * d.nh;
  if (vec) {
    const bool tvec = angles_vec<T>(d.na, {theta});
    rope_forward_vec_kernel<T><<<grid_for(units * (d.ds / kVec<T>), kThreads), kThreads, 0, s>>>(
        units, d.ds, d.na, tvec, theta, src, k, q, FastDiv(d.ds / kVec<T>));
  } else {
    rope_forward_kernel<T><<<grid_for(units * ((d.ds + 1) / 2), kThreads), kThreads, 0, s>>>(
        units, d.ds, d.na, theta, src, k, q);
  }
  M3_LAUNCH_CHECK();
}

}  // namespace

// τ = tanh(angles_raw) [BT, na] into tau.
void tanh_rows(cudaStream_t s, const Dims& d, const float* angles_raw, float* tau) {
  const Idx n = d.BT * d.na;
  tanh_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(n, angles_raw, tau);
  M3_LAUNCH_CHECK();
}

Idx angle_forward_scratch_floats(const Dims& d) { return d.BT * d.na; }
Idx angle_backward_scratch_floats(const Dims& d) { return d.BT * d.nh * d.na + d.BT * d.na; }

void angle_forward(cudaStream_t s, const Dims& d, const float* angles_raw, const float* dt,
                   const float* angle_in, float* angle_cumsum, float* angle_out,
                   Scratch scratch) {
  const char* where = "gpu::angle_forward";
  check_rope_dims(d, where);
  require_scratch(scratch, angle_forward_scratch_floats(d), where);
  if (d.na == 0) return;
  check_angle_rows(d, where);
  tanh_rows(s, d, angles_raw, scratch.p);
  const bool full = angle_forward_full() && full_widths(d);
  auto kernel = full ? angle_forward_kernel<kFullNa, kFullNh> : angle_forward_kernel<0, 0>;
  kernel<<<angle_blocks(d), kAngleThreads, 0, s>>>(d.B, d.T, d.nh, d.na, scratch.p, dt, angle_in,
                                                    angle_cumsum, angle_out);
  M3_LAUNCH_CHECK();
}

template <class T>
void rope_forward(cudaStream_t s, const Dims& d, const float* theta, const T* b_biased,
                  const T* c_biased, T* k, T* q) {
  check_rope_dims(d, "gpu::rope_forward");
  rope_forward_from(s, d, theta, StoredBiased<T>{b_biased, c_biased, d.ds},
                    vector_rows<T>(d.ds, {b_biased, c_biased, k, q}), k, q);
}

template <class T>
void rope_forward_normed(cudaStream_t s, const Dims& d, const float* theta, const T* b_normed,
                         const T* c_normed, const float* b_bias, const float* c_bias, T* k,
                         T* q) {
  const char* where = "gpu::rope_forward_normed";
  check_rope_dims(d, where);
  M3_REQUIRE(d.ng >= 1 && d.hpg * d.ng == d.nh, where, "bad dims", "ng=", d.ng, " hpg=", d.hpg,
             " nh=", d.nh);
  rope_forward_from(s, d, theta,
                    BiasedFromNormed<T>{b_normed, c_normed, b_bias, c_bias, d.ds, d.ng,
                                        FastDiv(d.nh), FastDiv(d.hpg)},
                    vector_rows<T>(d.ds, {b_normed, c_normed, b_bias, c_bias, k, q}), k, q);
}

template <class T>
void rope_backward(cudaStream_t s, const Dims& d, const RopeBwd<T>& p) {
  const char* where = "gpu::rope_backward";
  check_rope_dims(d, where);
  const bool e1 = p.extra_scale != nullptr, e2 = p.extra_vec1 != nullptr,
             e3 = p.extra_vec2 != nullptr;
  M3_REQUIRE(e1 == e2 && e2 == e3, where, "extra_scale, extra_vec1, extra_vec2 must be all set "
             "or all null", "extra_scale ", e1 ? "set" : "null", ", extra_vec1 ",
             e2 ? "set" : "null", ", extra_vec2 ", e3 ? "set" : "null");
  const Idx units = d.BT * d.nh;
  if (vector_rows<T>(d.ds, {p.dv1, p.dv2, p.rot1, p.rot2, p.dpre1, p.dpre2, p.extra_vec1,
                            p.extra_vec2})) {
    const bool tvec = angles_vec<T>(d.na, {p.theta, p.dtheta});
    rope_backward_vec_kernel<T><<<grid_for(units * (d.ds / kVec<T>), kThreads), kThreads, 0, s>>>(
        units, d.ds, d.na, tvec, p);
  } else {
    rope_backward_kernel<T><<<grid_for(units * ((d.ds + 1) / 2), kThreads), kThreads, 0, s>>>(
        units, d.ds, d.na, p);
  }
  M3_LAUNCH_CHECK();
}

void angle_backward(cudaStream_t s, const Dims& d, const AngleBwd& p, Scratch scratch) {
  const char* where = "gpu::angle_backward";
  check_rope_dims(d, where);
  require_scratch(scratch, angle_backward_scratch_floats(d), where);
  float* tau = scratch.p + d.BT * d.nh * d.na;  // after Θ̄
  const bool full = angle_grads_full() && full_widths(d);  // the reverse cumsum's and the grads'
  if (d.na > 0) {
    check_angle_rows(d, where);
    auto scan = full ? angle_reverse_cumsum_kernel<kFullNa, kFullNh>
                     : angle_reverse_cumsum_kernel<0, 0>;
    scan<<<angle_blocks(d), kAngleThreads, 0, s>>>(d.B, d.T, d.nh, d.na, p.d_angle_cumsum,
                                                 p.d_angle_out, scratch.p, p.d_angle_in);
    M3_LAUNCH_CHECK();
    tanh_rows(s, d, p.angles_raw, tau);
  }
  const bool vec4 = d.na % 4 == 0 && is_aligned(scratch.p, 16) && is_aligned(tau, 16);
  require_cols(p.d_angles_raw_cols, d.na, "na", where);
  auto kernel = full ? angle_grads_kernel<kFullNa, kFullNh> : angle_grads_kernel<0, 0>;
  kernel<<<grid_for(d.BT * (d.na + d.nh), kThreads), kThreads, 0, s>>>(
      d.BT, d.nh, d.na, vec4, tau, p.dt, scratch.p, p.d_angles_raw, p.d_dt_angle,
      p.d_angles_raw_cols);
  M3_LAUNCH_CHECK();
}

void set_angle_grads_full_for_testing(bool on) { angle_grads_full() = on; }
void set_angle_forward_full_for_testing(bool on) { angle_forward_full() = on; }

#define M3_INSTANTIATE(T)                                                                \
  template void rope_forward<T>(cudaStream_t, const Dims&, const float*, const T*, const T*, \
                                T*, T*);                                                 \
  template void rope_forward_normed<T>(cudaStream_t, const Dims&, const float*, const T*,   \
                                       const T*, const float*, const float*, T*, T*);      \
  template void rope_backward<T>(cudaStream_t, const Dims&, const RopeBwd<T>&);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
