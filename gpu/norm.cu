// RMSNorm, forward and backward (MODEL.md §4 F1, §6.1: every layer's pre-norm and norm_f);
// the same math, operation for operation, as reference/rmsnorm.cpp:
//   rms[r]   = sqrt( (1/dim) Σ_i u[r,i]² + ε ),  ε = 1e-5     (saved: the RMS, not 1/rms)
//   y[r,i]   = u[r,i] / rms[r] · w[i]
// Backward, x̂ = u/rms, g = ∂L/∂y:
//   c[r]     = (1/dim) Σ_i g[r,i]·w[i]·x̂[r,i]
//   dx[r,i]  = ( w[i]·g[r,i] − x̂[r,i]·c[r] ) / rms[r]         (overwrite)
//   dw[i]   += Σ_r g[r,i]·x̂[r,i]                              (colsum_rows, fixed order)
// Shapes: u, dx f32 [rows, dim] (the residual stream); y, g typed T [rows, dim] (y rounded once
// at its store); w, dw [dim]; rms [rows]. One row per warp segment (reduce.cuh): lanes stride
// over the row, so any dim works; Σ_i is each lane's ascending sum, then segment_sum.
#include "convert.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

constexpr float kEpsF = static_cast<float>(ref::kEps);

template <class T, int L>
__global__ void __launch_bounds__(kThreads)
rmsnorm_forward_kernel(Idx rows, Idx dim, const float* u, const float* w, T* y, float* rms) {
  using S = Seg<L>;
  for (Idx w0 = S::first(); w0 < rows; w0 += S::stride()) {
    const Idx r = w0 + S::seg();
    const bool on = r < rows;
    const float* ur = u + r * dim;
    float ss = 0.0f;
    if (on)
      for (Idx i = S::lane(); i < dim; i += L) ss += ur[i] * ur[i];
    ss = segment_sum<L>(ss);
    if (!on) continue;
    const float rr = sqrtf(ss / static_cast<float>(dim) + kEpsF);
    if (S::lane() == 0) rms[r] = rr;
    for (Idx i = S::lane(); i < dim; i += L) y[r * dim + i] = from_float<T>(ur[i] / rr * w[i]);
  }
}

template <class T, int L>
__global__ void __launch_bounds__(kThreads)
rmsnorm_backward_kernel(Idx rows, Idx dim, const float* u, const float* w, const float* rms,
                        const T* g, float* dx) {
  using S = Seg<L>;
  for (Idx w0 = S::first(); w0 < rows; w0 += S::stride()) {
    const Idx r = w0 + S::seg();
    const bool on = r < rows;
    const float* ur = u + r * dim;
    const T* gr = g + r * dim;
    const float rr = on ? rms[r] : 1.0f;
    float c = 0.0f;
    if (on)
      for (Idx i = S::lane(); i < dim; i += L) c += to_float(gr[i]) * w[i] * (ur[i] / rr);
    c = segment_sum<L>(c) / static_cast<float>(dim);
    if (!on) continue;
    for (Idx i = S::lane(); i < dim; i += L)
      dx[r * dim + i] = (w[i] * to_float(gr[i]) - (ur[i] / rr) * c) / rr;
  }
}

// dw term (r, i) = g[r,i]·x̂[r,i]
template <class T>
struct RmsDwTerm {
  const float* u;
  const T* g;
  const float* rms;
  Idx dim;
  __device__ float operator()(Idx r, Idx i) const {
    return to_float(g[r * dim + i]) * (u[r * dim + i] / rms[r]);
  }
};

void check_dim(Idx rows, Idx dim, const char* where) {
  M3_REQUIRE(rows >= 0 && dim >= 1, where, "bad shape", "rows=", rows, ", dim=", dim);
}

}  // namespace

template <class T>
void rmsnorm_forward(cudaStream_t s, Idx rows, Idx dim, const float* u, const float* w, T* y,
                     float* rms) {
  check_dim(rows, dim, "gpu::rmsnorm_forward");
  if (rows == 0) return;
  with_lanes(segment_lanes(dim), [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    rmsnorm_forward_kernel<T, L><<<grid_for(rows, Seg<L>::kPerBlock), kThreads, 0, s>>>(
        rows, dim, u, w, y, rms);
  });
  M3_LAUNCH_CHECK();
}

template <class T>
void rmsnorm_backward(cudaStream_t s, Idx rows, Idx dim, const float* u, const float* w,
                      const float* rms, const T* g, float* dx, float* dw, Scratch scratch) {
  const char* where = "gpu::rmsnorm_backward";
  check_dim(rows, dim, where);
  require_scratch(scratch, colsum_scratch_floats(rows, dim), where);
  if (rows == 0) return;
  with_lanes(segment_lanes(dim), [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    rmsnorm_backward_kernel<T, L><<<grid_for(rows, Seg<L>::kPerBlock), kThreads, 0, s>>>(
        rows, dim, u, w, rms, g, dx);
  });
  M3_LAUNCH_CHECK();
  colsum_rows(s, rows, dim, RmsDwTerm<T>{u, g, rms, dim}, dw, true, scratch, where);
}

#define M3_INSTANTIATE(T)                                                                   \
  template void rmsnorm_forward<T>(cudaStream_t, Idx, Idx, const float*, const float*, T*,  \
                                   float*);                                                 \
  template void rmsnorm_backward<T>(cudaStream_t, Idx, Idx, const float*, const float*,     \
                                    const float*, const T*, float*, float*, Scratch);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
