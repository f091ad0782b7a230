// Angle accumulation (F5), RoPE on B → k and C → q (F4e/f), and their backward (B6 RoPE tail,
// B5a). MODEL.md §4 F5, F4e/f, §6.2 B6-tail/B5a, §12.3; the same formulas, operation for
// operation, as reference/rope.cpp (F5 and B5a re-associated over t as stated below).
//
// F5, per (b, h, a) the serial recurrence of the reference, θ carried in DOUBLE:
//   ω      = π·tanh(angles_raw[r,a])          (float)
//   incr_t = ω·dt[r,h]                        (float)
//   θ_t    = wrap(θ_{t−1} + incr_t),  θ_{−1} = angle_in[b,h,a]   (double)
//   wrap(v) = v − 2π·⌊v/2π⌋ ∈ [0, 2π)  (a result that rounds up to 2π becomes 0)
//   angle_cumsum[r,h,a] = float(θ_t);  angle_out[b,h,a] = float(θ_{T−1})
// Parallel over t. j = h·na + a (θ is [BT, nh·na], j fastest); one block per (b, group of
// kAngleJ = 8 consecutive j); thread (s, jl) owns segment s < kAngleSegs = 32 of kAngleSteps = 8
// consecutive steps of a tile (32·8 = 256 steps). Tiles run in ascending t with a carried θ c
// (c = θ_{−1} before the first tile, then the θ walked at the previous tile's last step):
//   1. Σ_s = Σ_k double(incr) over segment s, ascending k                           (double)
//   2. entering value E_0 = c,  E_s = wrap((…((c + Σ_0) + Σ_1) + …) + Σ_{s−1})  for s ≥ 1
//   3. walk from E_s: θ = wrap(θ + double(incr)) after every step, store float(θ); c ← the θ of
//      the tile's last step.
// In exact arithmetic E_s = θ_{t−1} for t the segment's first step (wrap(wrap(x) + y) =
// wrap(x + y)), so this is the serial recurrence re-associated; in double the two differ only by
// the rounding of the sums in 1–2 (magnitudes ≤ |c| + 256·max|incr|): |Δθ| ≲ 2⁻⁵²·(|θ_{−1}| +
// Σ_t |incr_t|), at most ~1e-11 rad at T = 4096 with |incr| ≤ 2π (0 whenever those sums of f32
// increments are exact in double), far below the f32 rounding of the stored θ (up to 2.4e-7
// near 2π). wrap_two_pi takes ⌊v/2π⌋ ∈ {−1, 0, 1} without the division, bit for bit equal to
// the full formula; the walk in 3 is the serial recurrence itself.
// F4e/f, adjacent pairs (2a, 2a+1), a < na, c = cos θ[r,h,a], s = sin θ[r,h,a]; n ≥ 2na copied:
//   k[2a] = c·b[2a] − s·b[2a+1],   k[2a+1] = s·b[2a] + c·b[2a+1]     (b = b_biased; q from c)
// RoPE backward, two rotated vectors at once (path 1 = k, path 2 = q), dv = ∂L/∂rotated:
//   dpre[2a]   = c·dv[2a] + s·dv[2a+1] (+ extra_scale·extra_vec[2a])        (n ≥ 2na: dv + …)
//   dpre[2a+1] = −s·dv[2a] + c·dv[2a+1] (+ extra_scale·extra_vec[2a+1])
//   dθ[r,h,a]  = (−dv1[2a]·rot1[2a+1] + dv1[2a+1]·rot1[2a]) + (same for path 2)   (overwrite)
// B5a (wrap = identity for differentiation):
//   Θ̄_t = Σ_{s ≥ t} dθ_s (+ ∂L/∂angle_out at t = T−1), in Scratch [BT, nh, na], d_angle_in = Θ̄_0,
// in f32, parallel over t with the blocks, threads and tiles of F5, tiles in descending t with
// a carried c (c = ∂L/∂angle_out (0 if null) before the last tile, then Θ̄ at the first step of
// the tile just done):
//   1. R_s = Σ dθ over segment s, descending t
//   2. entering value F_s = (…((c + R_{31}) + R_{30}) + …) + R_{s+1}   (non-empty segments only)
//   3. walk from F_s in descending t: Θ̄ += dθ_t, store Θ̄_t; c ← Θ̄ at the tile's first step.
// Exactly Θ̄ in exact arithmetic; in f32 a fixed summation order other than the reference's.
// Then one thread per output:
//   d_angles_raw[r,a] = Σ_h Θ̄[r,h,a]·π·dt[r,h]·(1 − tanh²(angles_raw[r,a]))   (ascending h)
//   d_dt_angle[r,h]   = Σ_a Θ̄[r,h,a]·π·tanh(angles_raw[r,a])                  (ascending a)
// Every order above depends only on the shapes (deterministic, no atomics). Coalescing: a warp
// is 4 segments × 8 consecutive j, so each access to θ, dθ, Θ̄ is 4 whole 32-byte sectors;
// angles_raw[r,a] (read by the nh threads of (r, a)) and dt[r,h] (by the na of (r, h)) are
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
#include <initializer_list>

#include "convert.cuh"
#include "reduce.cuh"
#include "rope_pair.cuh"

namespace m3::gpu {

namespace {

constexpr double kTwoPiD = ref::kTwoPi;
constexpr float kPiF = static_cast<float>(ref::kPi);
// F5 / B5a blocks: kAngleJ consecutive j = h·na + a × kAngleSegs segments of kAngleSteps steps.
constexpr int kAngleJ = 8;                                // 8 floats = one 32-byte sector
constexpr int kAngleSegs = kThreads / kAngleJ;            // 32 segments per tile
constexpr int kAngleSteps = 8;                            // steps per segment
constexpr Idx kAngleTile = Idx(kAngleSegs) * kAngleSteps;  // 256 steps per tile
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

// One block per (b, group of kAngleJ consecutive j); thread (s, jl); see the header (F5 1–3).
__global__ void __launch_bounds__(kThreads)
angle_forward_kernel(Idx B, Idx T, Idx nh, Idx na, const float* __restrict__ angles_raw,
                     const float* __restrict__ dt, const float* __restrict__ angle_in,
                     float* __restrict__ angle_cumsum, float* __restrict__ angle_out) {
  __shared__ double seg_sum[kAngleSegs][kAngleJ];
  __shared__ double carry[kAngleJ];
  const int jl = threadIdx.x % kAngleJ, s = threadIdx.x / kAngleJ;
  const Idx nj = nh * na, groups = (nj + kAngleJ - 1) / kAngleJ;
  for (Idx u = blockIdx.x; u < B * groups; u += gridDim.x) {
    const Idx b = u / groups, j = (u % groups) * kAngleJ + jl;
    const bool on = j < nj;
    const Idx h = on ? j / na : 0, a = on ? j % na : 0;
    const float* raw = angles_raw + b * T * na + a;
    const float* dtp = dt + b * T * nh + h;
    float* out = angle_cumsum + b * T * nj + j;
    if (s == 0) carry[jl] = on && angle_in ? static_cast<double>(angle_in[b * nj + j]) : 0.0;
    for (Idx t0 = 0; t0 < T; t0 += kAngleTile) {
      const Idx ts = t0 + Idx(s) * kAngleSteps;  // this segment's first step
      const int steps = on ? segment_steps(T, ts) : 0;
      const float *raw_s = raw + ts * na, *dt_s = dtp + ts * nh;
      double incr[kAngleSteps];  // double((π·tanh)·dt), 0 past T
#pragma unroll
      for (int k = 0; k < kAngleSteps; ++k) {
        const float inc = k < steps ? kPiF * tanhf(raw_s[k * na]) * dt_s[k * nh] : 0.0f;
        incr[k] = static_cast<double>(inc);
      }
      double sum = incr[0];  // 1. Σ_s
#pragma unroll
      for (int k = 1; k < kAngleSteps; ++k) sum += incr[k];
      seg_sum[s][jl] = sum;
      __syncthreads();
      double theta = carry[jl];  // 2. E_s
      if (s > 0) {
        for (int q = 0; q < s; ++q) theta += seg_sum[q][jl];
        theta = wrap_two_pi(theta);
      }
      __syncthreads();  // seg_sum and carry read before they are written again
      float* out_s = out + ts * nj;
#pragma unroll
      for (int k = 0; k < kAngleSteps; ++k) {  // 3. walk
        if (k < steps) {
          theta = wrap_two_pi(theta + incr[k]);
          out_s[k * nj] = static_cast<float>(theta);
        }
      }
      if (s == kAngleSegs - 1) carry[jl] = theta;
      if (steps > 0 && ts + steps == T) angle_out[b * nj + j] = static_cast<float>(theta);
    }
    __syncthreads();  // carry and seg_sum free for the next (b, group)
  }
}

// One thread per pair slot j < ⌈ds/2⌉ of one (r, h): a rotated pair (j < na) or two copies.
template <class T>
__global__ void __launch_bounds__(kThreads)
rope_forward_kernel(Idx units, Idx ds, Idx na, const float* theta, const T* b_biased,
                    const T* c_biased, T* k, T* q) {
  const Idx slots = (ds + 1) / 2;
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < units * slots;
       i += Idx(gridDim.x) * kThreads) {
    const Idx rh = i / slots, j = i % slots, n = rh * ds + 2 * j;
    if (j < na) {
      float sn, cs;
      sincosf(theta[rh * na + j], &sn, &cs);
      const float b0 = to_float(b_biased[n]), b1 = to_float(b_biased[n + 1]);
      const float c0 = to_float(c_biased[n]), c1 = to_float(c_biased[n + 1]);
      float k0, k1, q0, q1;
      rope_rotate(sn, cs, b0, b1, k0, k1);
      rope_rotate(sn, cs, c0, c1, q0, q1);
      k[n] = from_float<T>(k0);
      k[n + 1] = from_float<T>(k1);
      q[n] = from_float<T>(q0);
      q[n + 1] = from_float<T>(q1);
    } else {
      k[n] = b_biased[n];
      q[n] = c_biased[n];
      if (2 * j + 1 < ds) {
        k[n + 1] = b_biased[n + 1];
        q[n + 1] = c_biased[n + 1];
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
template <class T>
__global__ void __launch_bounds__(kThreads)
rope_forward_vec_kernel(Idx units, Idx ds, Idx na, bool tvec, const float* theta,
                        const T* b_biased, const T* c_biased, T* k, T* q) {
  constexpr int V = 16 / sizeof(T), P = V / 2;
  using W = VecOf<T, V>;
  const Idx per_row = ds / V;
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < units * per_row;
       i += Idx(gridDim.x) * kThreads) {
    const Idx rh = i / per_row, j0 = (i % per_row) * P;
    const W b = reinterpret_cast<const W*>(b_biased)[i];
    const W c = reinterpret_cast<const W*>(c_biased)[i];
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
// Blocks and threads as angle_forward_kernel; see the header (B5a 1–3).
__global__ void __launch_bounds__(kThreads)
angle_reverse_cumsum_kernel(Idx B, Idx T, Idx nh, Idx na,
                            const float* __restrict__ d_angle_cumsum,
                            const float* __restrict__ d_angle_out, float* __restrict__ bar,
                            float* __restrict__ d_angle_in) {
  __shared__ float seg_sum[kAngleSegs][kAngleJ];
  __shared__ float carry[kAngleJ];
  const int jl = threadIdx.x % kAngleJ, s = threadIdx.x / kAngleJ;
  const Idx nj = nh * na, groups = (nj + kAngleJ - 1) / kAngleJ;
  for (Idx u = blockIdx.x; u < B * groups; u += gridDim.x) {
    const Idx b = u / groups, j = (u % groups) * kAngleJ + jl;
    const bool on = j < nj;
    const float* dth = d_angle_cumsum + b * T * nj + j;
    float* out = bar + b * T * nj + j;
    if (s == 0) carry[jl] = on && d_angle_out ? d_angle_out[b * nj + j] : 0.0f;
    for (Idx t0 = (T - 1) / kAngleTile * kAngleTile; t0 >= 0; t0 -= kAngleTile) {
      const Idx ts = t0 + Idx(s) * kAngleSteps;
      const int steps = on ? segment_steps(T, ts) : 0;
      const float* dth_s = dth + ts * nj;
      float* out_s = out + ts * nj;
      float g[kAngleSteps];  // dθ, 0 past T
#pragma unroll
      for (int k = 0; k < kAngleSteps; ++k) g[k] = k < steps ? dth_s[k * nj] : 0.0f;
      float sum = g[kAngleSteps - 1];  // 1. R_s
#pragma unroll
      for (int k = kAngleSteps - 2; k >= 0; --k) sum += g[k];
      seg_sum[s][jl] = sum;
      __syncthreads();
      float run = carry[jl];  // 2. F_s
      for (int q = kAngleSegs - 1; q > s; --q)
        if (t0 + Idx(q) * kAngleSteps < T) run += seg_sum[q][jl];
      __syncthreads();  // seg_sum and carry read before they are written again
#pragma unroll
      for (int k = kAngleSteps - 1; k >= 0; --k) {  // 3. walk
        if (k < steps) {
          run += g[k];
          out_s[k * nj] = run;
        }
      }
      if (s == 0) carry[jl] = run;
      if (s == 0 && t0 == 0 && on && d_angle_in) d_angle_in[b * nj + j] = run;
    }
    __syncthreads();  // carry and seg_sum free for the next (b, group)
  }
}

// One thread per output of row r: j < na → d_angles_raw[r, j]; else d_dt_angle[r, j − na].
__global__ void __launch_bounds__(kThreads)
angle_grads_kernel(Idx BT, Idx nh, Idx na, const float* angles_raw, const float* dt,
                   const float* bar, float* d_angles_raw, float* d_dt_angle) {
  const Idx per_row = na + nh;
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < BT * per_row;
       i += Idx(gridDim.x) * kThreads) {
    const Idx r = i / per_row, j = i % per_row;
    const float* bar_r = bar + r * nh * na;
    float sum = 0.0f;
    if (j < na) {
      const float th = tanhf(angles_raw[r * na + j]);
      for (Idx h = 0; h < nh; ++h)
        sum += bar_r[h * na + j] * kPiF * dt[r * nh + h] * (1.0f - th * th);
      d_angles_raw[r * na + j] = sum;
    } else {
      const Idx h = j - na;
      for (Idx a = 0; a < na; ++a)
        sum += bar_r[h * na + a] * kPiF * tanhf(angles_raw[r * na + a]);
      d_dt_angle[r * nh + h] = sum;
    }
  }
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

}  // namespace

void angle_forward(cudaStream_t s, const Dims& d, const float* angles_raw, const float* dt,
                   const float* angle_in, float* angle_cumsum, float* angle_out) {
  check_rope_dims(d, "gpu::angle_forward");
  if (d.na == 0) return;
  angle_forward_kernel<<<angle_blocks(d), kThreads, 0, s>>>(d.B, d.T, d.nh, d.na, angles_raw, dt,
                                                            angle_in, angle_cumsum, angle_out);
  M3_LAUNCH_CHECK();
}

template <class T>
void rope_forward(cudaStream_t s, const Dims& d, const float* theta, const T* b_biased,
                  const T* c_biased, T* k, T* q) {
  check_rope_dims(d, "gpu::rope_forward");
  const Idx units = d.BT * d.nh;
  if (vector_rows<T>(d.ds, {b_biased, c_biased, k, q})) {
    const bool tvec = angles_vec<T>(d.na, {theta});
    rope_forward_vec_kernel<T><<<grid_for(units * (d.ds / kVec<T>), kThreads), kThreads, 0, s>>>(
        units, d.ds, d.na, tvec, theta, b_biased, c_biased, k, q);
  } else {
    rope_forward_kernel<T><<<grid_for(units * ((d.ds + 1) / 2), kThreads), kThreads, 0, s>>>(
        units, d.ds, d.na, theta, b_biased, c_biased, k, q);
  }
  M3_LAUNCH_CHECK();
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
  require_scratch(scratch, d.BT * d.nh * d.na, where);
  if (d.na > 0) {
    angle_reverse_cumsum_kernel<<<angle_blocks(d), kThreads, 0, s>>>(
        d.B, d.T, d.nh, d.na, p.d_angle_cumsum, p.d_angle_out, scratch.p, p.d_angle_in);
    M3_LAUNCH_CHECK();
  }
  angle_grads_kernel<<<grid_for(d.BT * (d.na + d.nh), kThreads), kThreads, 0, s>>>(
      d.BT, d.nh, d.na, p.angles_raw, p.dt, scratch.p, p.d_angles_raw, p.d_dt_angle);
  M3_LAUNCH_CHECK();
}

#define M3_INSTANTIATE(T)                                                                \
  template void rope_forward<T>(cudaStream_t, const Dims&, const float*, const T*, const T*, \
                                T*, T*);                                                 \
  template void rope_backward<T>(cudaStream_t, const Dims&, const RopeBwd<T>&);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
