// Output gating (F7) and its backward (B7). MODEL.md §4 F7, §6.2 B7; the same formulas,
// operation for operation, as reference/gating.cpp. s = σ(z), silu(z) = z·s,
// silu'(z) = s·(1 + z·(1 − s)), d = h·hd + p, w = norm_gate_weight.
//
// (a) is_outproj_norm = false, elementwise:
//     gated = y·silu(z);   d_y = d_gated·silu(z);   d_z = d_gated·y·silu'(z)
// (b) is_outproj_norm = true, RMSNormGated per (r, h) over the head's hd channels:
//     rstd[r,h]  = 1 / sqrt( (1/hd) Σ_p y[r,d]² + ε ),  ε = 1e-5   (saved as gated_rms_vals)
//     gated[r,d] = y[r,d]·(rstd·w[d])·silu(z[r,d])
//   backward, ŷ = y·rstd, g = d_gated·silu(z):
//     d_z  = d_gated·ŷ·w·silu'(z)
//     c1   = (1/hd) Σ_p ŷ·w·g;   d_y = (w·g − ŷ·c1)·rstd
//     d w[d] += Σ_r d_gated·silu(z)·y·rstd                 (colsum_rows, fixed order)
// Shapes: y, z, gated, d_gated, d_y, d_z typed T [BT, di]; gated_rms_vals [BT, nh]; w [di].
// gated, d_y, d_z are rounded to T once, at their store (the reference's store_typed after F7/B7).
// (b) runs one (r, h) row per warp segment of min(32, pow2 ≥ hd) lanes (reduce.cuh), so any
// headdim works and hd = 16 packs two heads per warp.
#include "activations.cuh"
#include "convert.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

constexpr float kEpsF = static_cast<float>(ref::kEps);

template <class T>
__global__ void __launch_bounds__(kThreads)
gate_silu_forward_kernel(Idx n, const T* y, const T* z, T* gated) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < n; i += Idx(gridDim.x) * kThreads)
    gated[i] = from_float<T>(to_float(y[i]) * silu(to_float(z[i])));
}

template <class T, int L>
__global__ void __launch_bounds__(kThreads)
gate_norm_forward_kernel(Idx units, Idx hd, Idx nh, const T* y, const T* z, const float* w,
                         T* gated, float* rstd_out) {
  using S = Seg<L>;
  for (Idx w0 = S::first(); w0 < units; w0 += S::stride()) {
    const Idx unit = w0 + S::seg();  // r·nh + h
    const bool on = unit < units;
    const T* yr = y + unit * hd;
    float ss = 0.0f;
    if (on)
      for (Idx p = S::lane(); p < hd; p += L) {
        const float v = to_float(yr[p]);
        ss += v * v;
      }
    ss = segment_sum<L>(ss);
    if (!on) continue;
    const float rstd = 1.0f / sqrtf(ss / static_cast<float>(hd) + kEpsF);
    if (S::lane() == 0) rstd_out[unit] = rstd;
    const float* wh = w + (unit % nh) * hd;
    for (Idx p = S::lane(); p < hd; p += L) {
      const Idx i = unit * hd + p;
      gated[i] = from_float<T>(to_float(y[i]) * (rstd * wh[p]) * silu(to_float(z[i])));
    }
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
gate_silu_backward_kernel(Idx n, GatingBwd<T> p) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < n; i += Idx(gridDim.x) * kThreads) {
    const float dg = to_float(p.d_gated[i]), zi = to_float(p.z[i]);
    p.d_y[i] = from_float<T>(dg * silu(zi));
    p.d_z[i] = from_float<T>(dg * to_float(p.y[i]) * silu_grad(zi));
  }
}

template <class T, int L>
__global__ void __launch_bounds__(kThreads)
gate_norm_backward_kernel(Idx units, Idx hd, Idx nh, GatingBwd<T> p) {
  using S = Seg<L>;
  for (Idx w0 = S::first(); w0 < units; w0 += S::stride()) {
    const Idx unit = w0 + S::seg();
    const bool on = unit < units;
    const float rstd = on ? p.gated_rms_vals[unit] : 0.0f;
    const float* wh = p.norm_gate_weight + (unit % nh) * hd;
    float c1 = 0.0f;
    if (on)
      for (Idx q = S::lane(); q < hd; q += L) {
        const Idx i = unit * hd + q;
        const float dg = to_float(p.d_gated[i]), zi = to_float(p.z[i]);
        const float yh = to_float(p.y[i]) * rstd, gg = dg * silu(zi);
        p.d_z[i] = from_float<T>(dg * yh * wh[q] * silu_grad(zi));
        c1 += yh * wh[q] * gg;
      }
    c1 = segment_sum<L>(c1) / static_cast<float>(hd);
    if (!on) continue;
#pragma unroll 1  // unrolled, ptxas spills 4 bytes in the bf16 instantiation
    for (Idx q = S::lane(); q < hd; q += L) {
      const Idx i = unit * hd + q;
      const float yh = to_float(p.y[i]) * rstd;
      const float gg = to_float(p.d_gated[i]) * silu(to_float(p.z[i]));
      p.d_y[i] = from_float<T>((wh[q] * gg - yh * c1) * rstd);
    }
  }
}

// d norm_gate_weight term (r, d) = d_gated·silu(z)·y·rstd[r, d / hd]
template <class T>
struct GateWeightTerm {
  const T *d_gated, *z, *y;
  const float* rstd;
  Idx di, hd, nh;
  __device__ float operator()(Idx r, Idx d) const {
    const Idx i = r * di + d;
    return to_float(d_gated[i]) * silu(to_float(z[i])) * to_float(y[i]) * rstd[r * nh + d / hd];
  }
};

void check_gating_dims(const Dims& d, const char* where) {
  M3_REQUIRE(d.BT >= 0 && d.hd >= 1 && d.nh >= 1 && d.di == d.nh * d.hd, where, "bad dims",
             "BT=", d.BT, " di=", d.di, " nh=", d.nh, " hd=", d.hd);
}

}  // namespace

template <class T>
void gating_forward(cudaStream_t s, const Dims& d, const T* y, const T* z,
                    const float* norm_gate_weight, T* gated, float* gated_rms_vals) {
  const char* where = "gpu::gating_forward";
  check_gating_dims(d, where);
  const Idx n = d.BT * d.di, units = d.BT * d.nh;
  if (n == 0) return;
  if (!d.outproj_norm) {
    gate_silu_forward_kernel<T><<<grid_for(n, kThreads), kThreads, 0, s>>>(n, y, z, gated);
    M3_LAUNCH_CHECK();
    return;
  }
  M3_REQUIRE(norm_gate_weight && gated_rms_vals, where,
             "is_outproj_norm needs norm_gate_weight and gated_rms_vals", "a pointer is null");
  with_lanes(segment_lanes(d.hd), [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    gate_norm_forward_kernel<T, L><<<grid_for(units, Seg<L>::kPerBlock), kThreads, 0, s>>>(
        units, d.hd, d.nh, y, z, norm_gate_weight, gated, gated_rms_vals);
  });
  M3_LAUNCH_CHECK();
}

template <class T>
void gating_backward(cudaStream_t s, const Dims& d, const GatingBwd<T>& p, Scratch scratch) {
  const char* where = "gpu::gating_backward";
  check_gating_dims(d, where);
  const Idx n = d.BT * d.di, units = d.BT * d.nh;
  if (!d.outproj_norm) {
    if (n == 0) return;
    gate_silu_backward_kernel<T><<<grid_for(n, kThreads), kThreads, 0, s>>>(n, p);
    M3_LAUNCH_CHECK();
    return;
  }
  M3_REQUIRE(p.norm_gate_weight && p.gated_rms_vals && p.d_norm_gate_weight, where,
             "is_outproj_norm needs norm_gate_weight, gated_rms_vals and d_norm_gate_weight",
             "a pointer is null");
  require_scratch(scratch, colsum_scratch_floats(d.BT, d.di), where);
  if (n == 0) return;
  with_lanes(segment_lanes(d.hd), [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    gate_norm_backward_kernel<T, L><<<grid_for(units, Seg<L>::kPerBlock), kThreads, 0, s>>>(
        units, d.hd, d.nh, p);
  });
  M3_LAUNCH_CHECK();
  colsum_rows(s, d.BT, d.di,
              GateWeightTerm<T>{p.d_gated, p.z, p.y, p.gated_rms_vals, d.di, d.hd, d.nh},
              p.d_norm_gate_weight, true, scratch, where);
}

#define M3_INSTANTIATE(T)                                                                  \
  template void gating_forward<T>(cudaStream_t, const Dims&, const T*, const T*, const float*, \
                                  T*, float*);                                             \
  template void gating_backward<T>(cudaStream_t, const Dims&, const GatingBwd<T>&, Scratch);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
