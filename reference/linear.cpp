// Linear layers without activation: F2 in_proj, F8 out_proj, the backbone input_proj, and their
// backward B2, B8 (MODEL.md §4, §6.2). Weights are [in, out], Y = X·W (+ b).
//
//   forward:   Y[rows,out]  = X[rows,in] · W[in,out] (+ b[out])
//   backward:  dX           = dY · Wᵀ          (overwrite)
//              dW          += Xᵀ · dY          (accumulate, §6.0)
//              db          += Σ_r dY[r,:]      (accumulate)
// All three are Eigen GEMMs; Eigen's blocked product is deterministic for a fixed build.
#include "eigen.hpp"
#include "stages.hpp"

namespace m3::ref {

template <class S>
void linear_forward(Idx rows, Idx in, Idx out, const S* X, const S* W, const S* b, S* Y) {
  CMapM<S> Xm(X, rows, in), Wm(W, in, out);
  MapM<S> Ym(Y, rows, out);
  Ym.noalias() = Xm * Wm;
  if (b) Ym.rowwise() += Eigen::Map<const Vec<S>>(b, out).transpose();
}

template <class S>
void linear_backward(Idx rows, Idx in, Idx out, const S* X, const S* W, const S* dY, S* dX,
                     S* dW, S* db) {
  CMapM<S> Xm(X, rows, in), Wm(W, in, out), dYm(dY, rows, out);
  if (dX) MapM<S>(dX, rows, in).noalias() = dYm * Wm.transpose();
  MapM<S>(dW, in, out).noalias() += Xm.transpose() * dYm;
  if (db) {
    Vec<S> sum = Vec<S>::Zero(out);
    for (Idx r = 0; r < rows; ++r) sum += dYm.row(r).transpose();
    Eigen::Map<Vec<S>>(db, out) += sum;  // ascending rows, then added once (MODEL.md §7)
  }
}

template void linear_forward<double>(Idx, Idx, Idx, const double*, const double*, const double*,
                                     double*);
template void linear_forward<float>(Idx, Idx, Idx, const float*, const float*, const float*,
                                    float*);
template void linear_backward<double>(Idx, Idx, Idx, const double*, const double*, const double*,
                                      double*, double*, double*);
template void linear_backward<float>(Idx, Idx, Idx, const float*, const float*, const float*,
                                     float*, float*, float*);

}  // namespace m3::ref
