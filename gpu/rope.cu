// Angle accumulation (F5), RoPE on B → k and C → q (F4e/f), and their backward (B6 RoPE tail,
// B5a). MODEL.md §4 F5, F4e/f, §6.2 B6-tail/B5a, §12.3; the same formulas, operation for
// operation, as reference/rope.cpp.
//
// F5, one thread per (b, h, a), sequential in t, the running θ carried in DOUBLE:
//   ω      = π·tanh(angles_raw[r,a])          (float)
//   incr   = ω·dt[r,h]                        (float)
//   θ_t    = wrap(θ_{t−1} + incr),  θ_{−1} = angle_in[b,h,a]   (double)
//   wrap(v) = v − 2π·⌊v/2π⌋ ∈ [0, 2π)  (a result that rounds up to 2π becomes 0)
//   angle_cumsum[r,h,a] = float(θ_t);  angle_out[b,h,a] = float(θ_{T−1})
// F4e/f, adjacent pairs (2a, 2a+1), a < na, c = cos θ[r,h,a], s = sin θ[r,h,a]; n ≥ 2na copied:
//   k[2a] = c·b[2a] − s·b[2a+1],   k[2a+1] = s·b[2a] + c·b[2a+1]     (b = b_biased; q from c)
// RoPE backward, two rotated vectors at once (path 1 = k, path 2 = q), dv = ∂L/∂rotated:
//   dpre[2a]   = c·dv[2a] + s·dv[2a+1] (+ extra_scale·extra_vec[2a])        (n ≥ 2na: dv + …)
//   dpre[2a+1] = −s·dv[2a] + c·dv[2a+1] (+ extra_scale·extra_vec[2a+1])
//   dθ[r,h,a]  = (−dv1[2a]·rot1[2a+1] + dv1[2a+1]·rot1[2a]) + (same for path 2)   (overwrite)
// B5a (wrap = identity for differentiation): one thread per (b, h, a) forms
//   Θ̄_t = Σ_{s ≥ t} dθ_s  (+ ∂L/∂angle_out at t = T−1), in Scratch [BT, nh, na], d_angle_in = Θ̄_0;
// then one thread per output:
//   d_angles_raw[r,a] = Σ_h Θ̄[r,h,a]·π·dt[r,h]·(1 − tanh²(angles_raw[r,a]))   (ascending h)
//   d_dt_angle[r,h]   = Σ_a Θ̄[r,h,a]·π·tanh(angles_raw[r,a])                  (ascending a)
// Typed storage T: b/c_biased, rot and extra_vec are read as f32, k and q rounded once at their
// store; θ, dv, dpre, dθ and every angle tensor are f32.
// Shapes: angles_raw, d_angles_raw [BT, na]; dt, d_dt_angle [BT, nh]; θ, dθ [BT, nh, na];
// angle_in/out [B, nh, na]; b/c_biased, k, q, dv, rot, dpre, extra_vec [BT, nh, ds];
// extra_scale [BT, nh]. Nullable: angle_in (zeros), d_angle_out (zeros), d_angle_in (not
// written).
#include "convert.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

constexpr double kTwoPiD = ref::kTwoPi;
constexpr float kPiF = static_cast<float>(ref::kPi);
constexpr int kAngleBatch = 8;  // time steps whose loads are issued together

// v − 2π·⌊v/2π⌋ without contraction into an fma (the reference rounds the product first).
__device__ __forceinline__ double wrap_two_pi(double v) {
  const double w = __dsub_rn(v, __dmul_rn(kTwoPiD, floor(v / kTwoPiD)));
  return w >= kTwoPiD ? 0.0 : w;
}

__global__ void __launch_bounds__(kThreads)
angle_forward_kernel(Idx B, Idx T, Idx nh, Idx na, const float* angles_raw, const float* dt,
                     const float* angle_in, float* angle_cumsum, float* angle_out) {
  const Idx units = B * nh * na;
  for (Idx u = blockIdx.x * Idx(kThreads) + threadIdx.x; u < units;
       u += Idx(gridDim.x) * kThreads) {
    const Idx a = u % na, h = (u / na) % nh, b = u / (na * nh);
    const float* raw = angles_raw + b * T * na + a;
    const float* dtp = dt + b * T * nh + h;
    float* out = angle_cumsum + (b * T * nh + h) * na + a;
    double theta = angle_in ? static_cast<double>(angle_in[u]) : 0.0;
    // Steps in batches of kAngleBatch: the increments (independent of θ) are loaded and
    // formed first, so the loads of a batch are in flight together; then the θ chain.
    for (Idx t0 = 0; t0 < T; t0 += kAngleBatch) {
      float incr[kAngleBatch];
#pragma unroll
      for (int k = 0; k < kAngleBatch; ++k) {
        const Idx t = t0 + k;
        incr[k] = t < T ? kPiF * tanhf(raw[t * na]) * dtp[t * nh] : 0.0f;  // (π·tanh)·dt
      }
#pragma unroll
      for (int k = 0; k < kAngleBatch; ++k) {
        if (t0 + k >= T) break;
        theta = wrap_two_pi(theta + static_cast<double>(incr[k]));
        out[(t0 + k) * nh * na] = static_cast<float>(theta);
      }
    }
    angle_out[u] = static_cast<float>(theta);
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
      k[n] = from_float<T>(cs * b0 - sn * b1);
      k[n + 1] = from_float<T>(sn * b0 + cs * b1);
      q[n] = from_float<T>(cs * c0 - sn * c1);
      q[n + 1] = from_float<T>(sn * c0 + cs * c1);
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
      float o0 = cs * g0 + sn * g1, o1 = -sn * g0 + cs * g1;
      float u0 = cs * h0 + sn * h1, u1 = -sn * h0 + cs * h1;
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
      const float d1 = -g0 * to_float(p.rot1[n + 1]) + g1 * to_float(p.rot1[n]);
      const float d2 = -h0 * to_float(p.rot2[n + 1]) + h1 * to_float(p.rot2[n]);
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

// Θ̄ (reverse cumulative sum over t) per (b, h, a) → bar [BT, nh, na]; d_angle_in = Θ̄_0.
__global__ void __launch_bounds__(kThreads)
angle_reverse_cumsum_kernel(Idx B, Idx T, Idx nh, Idx na, const float* d_angle_cumsum,
                            const float* d_angle_out, float* bar, float* d_angle_in) {
  const Idx units = B * nh * na;
  for (Idx u = blockIdx.x * Idx(kThreads) + threadIdx.x; u < units;
       u += Idx(gridDim.x) * kThreads) {
    const Idx a = u % na, h = (u / na) % nh, b = u / (na * nh);
    const Idx first = (b * T * nh + h) * na + a, step = nh * na;
    float run = d_angle_out ? d_angle_out[u] : 0.0f;
    for (Idx t1 = T - 1; t1 >= 0; t1 -= kAngleBatch) {  // batches of steps t1, t1 − 1, …
      float dth[kAngleBatch];
#pragma unroll
      for (int k = 0; k < kAngleBatch; ++k)
        dth[k] = t1 - k >= 0 ? d_angle_cumsum[first + (t1 - k) * step] : 0.0f;
#pragma unroll
      for (int k = 0; k < kAngleBatch; ++k) {
        if (t1 - k < 0) break;
        run += dth[k];
        bar[first + (t1 - k) * step] = run;
      }
    }
    if (d_angle_in) d_angle_in[u] = run;
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

}  // namespace

void angle_forward(cudaStream_t s, const Dims& d, const float* angles_raw, const float* dt,
                   const float* angle_in, float* angle_cumsum, float* angle_out) {
  check_rope_dims(d, "gpu::angle_forward");
  const Idx units = d.B * d.nh * d.na;
  if (units == 0) return;
  angle_forward_kernel<<<grid_for(units, kThreads), kThreads, 0, s>>>(
      d.B, d.T, d.nh, d.na, angles_raw, dt, angle_in, angle_cumsum, angle_out);
  M3_LAUNCH_CHECK();
}

template <class T>
void rope_forward(cudaStream_t s, const Dims& d, const float* theta, const T* b_biased,
                  const T* c_biased, T* k, T* q) {
  check_rope_dims(d, "gpu::rope_forward");
  const Idx units = d.BT * d.nh;
  rope_forward_kernel<T><<<grid_for(units * ((d.ds + 1) / 2), kThreads), kThreads, 0, s>>>(
      units, d.ds, d.na, theta, b_biased, c_biased, k, q);
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
  rope_backward_kernel<T><<<grid_for(units * ((d.ds + 1) / 2), kThreads), kThreads, 0, s>>>(
      units, d.ds, d.na, p);
  M3_LAUNCH_CHECK();
}

void angle_backward(cudaStream_t s, const Dims& d, const AngleBwd& p, Scratch scratch) {
  const char* where = "gpu::angle_backward";
  check_rope_dims(d, where);
  const Idx units = d.B * d.nh * d.na;
  require_scratch(scratch, d.BT * d.nh * d.na, where);
  if (units > 0) {
    angle_reverse_cumsum_kernel<<<grid_for(units, kThreads), kThreads, 0, s>>>(
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
