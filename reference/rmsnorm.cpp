// RMSNorm, forward and backward (MODEL.md §4 F1, §6.1; also norm_f and the BCNorm core of F4).
//
//   rms[r]   = sqrt( (1/dim) Σ_i u[r,i]² + ε )            (the RMS itself is saved, not 1/rms)
//   y[r,i]   = u[r,i] / rms[r] · w[i]
// Backward, with x̂ = u/rms and upstream g = ∂L/∂y:
//   c[r]     = (1/dim) Σ_i g[r,i]·w[i]·x̂[r,i]
//   dx[r,i]  = ( w[i]·g[r,i] − x̂[r,i]·c[r] ) / rms[r]      (overwrite)
//   dw[i]   += Σ_r g[r,i]·x̂[r,i]     (rows summed in ascending order, then added once, §7)
// Shapes: u, y, g, dx [rows, dim]; w, dw [dim]; rms [rows].
#include "eigen.hpp"
#include "stages.hpp"

namespace m3::ref {

template <class S>
void rmsnorm_forward(Idx rows, Idx dim, const S* u, const S* w, S* y, S* rms) {
  CMapM<S> U(u, rows, dim);
  MapM<S> Y(y, rows, dim);
  Eigen::Map<const Vec<S>> W(w, dim);
  for (Idx r = 0; r < rows; ++r) {
    const S ms = U.row(r).squaredNorm() / S(dim);
    const S rr = std::sqrt(ms + S(kEps));
    rms[r] = rr;
    Y.row(r) = (U.row(r).array() / rr * W.transpose().array()).matrix();
  }
}

template <class S>
void rmsnorm_backward(Idx rows, Idx dim, const S* u, const S* w, const S* rms, const S* g, S* dx,
                      S* dw) {
  CMapM<S> U(u, rows, dim), G(g, rows, dim);
  MapM<S> DX(dx, rows, dim);
  Eigen::Map<const Vec<S>> W(w, dim);
  Vec<S> xhat(dim), dw_sum = Vec<S>::Zero(dim);
  for (Idx r = 0; r < rows; ++r) {
    xhat = U.row(r).transpose() / rms[r];
    const S c = (G.row(r).transpose().array() * W.array() * xhat.array()).sum() / S(dim);
    DX.row(r) = ((W.array() * G.row(r).transpose().array() - xhat.array() * c) / rms[r])
                    .matrix()
                    .transpose();
    dw_sum.array() += G.row(r).transpose().array() * xhat.array();
  }
  Eigen::Map<Vec<S>>(dw, dim) += dw_sum;  // rows summed in ascending order, then added once
}

template void rmsnorm_forward<double>(Idx, Idx, const double*, const double*, double*, double*);
template void rmsnorm_forward<float>(Idx, Idx, const float*, const float*, float*, float*);
template void rmsnorm_backward<double>(Idx, Idx, const double*, const double*, const double*,
                                       const double*, double*, double*);
template void rmsnorm_backward<float>(Idx, Idx, const float*, const float*, const float*,
                                      const float*, float*, float*);

}  // namespace m3::ref
