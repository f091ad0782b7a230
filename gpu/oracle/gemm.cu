// The GPU oracle's linear maps (F2, F8, input_proj, the head; B8, B2 and their weight
// gradients) through cuBLAS DGEMM with 64-bit dimensions (cublasDgemm_64), on row-major
// buffers. cuBLAS is column-major: a row-major [rows, cols] matrix is its column-major
// transpose, so
//   Y = X·W        is  Yᵀ = Wᵀ·Xᵀ           (m = out, n = rows, k = in)
//   dX = dY·Wᵀ     is  dXᵀ = W·dYᵀ          (W op T; m = in, n = rows, k = out)
//   dW += Xᵀ·dY    is  dWᵀ += dYᵀ·X          (X op T; m = out, n = in, k = rows; β = 1)
// The handle runs in CUBLAS_PEDANTIC_MATH (no emulated or reduced-precision FP64).
#include "stages.cuh"

#include "common.cuh"

namespace m3::gpu::oracle {

void gemm_xw(cublasHandle_t h, Idx rows, Idx in, Idx out, const double* X, const double* W,
             double* Y) {
  if (rows == 0 || out == 0) return;
  const double one = 1.0, zero = 0.0;
  M3_CUBLAS_CHECK(cublas().dgemm_64(h, CUBLAS_OP_N, CUBLAS_OP_N, out, rows, in, &one, W, out, X, in,
                                 &zero, Y, out));
}

void gemm_dx(cublasHandle_t h, Idx rows, Idx in, Idx out, const double* dY, const double* W,
             double* dX) {
  if (rows == 0 || in == 0) return;
  const double one = 1.0, zero = 0.0;
  M3_CUBLAS_CHECK(cublas().dgemm_64(h, CUBLAS_OP_T, CUBLAS_OP_N, in, rows, out, &one, W, out, dY, out,
                                 &zero, dX, in));
}

void gemm_dw(cublasHandle_t h, Idx rows, Idx in, Idx out, const double* X, const double* dY,
             double* dW) {
  if (in == 0 || out == 0) return;
  const double one = 1.0;
  M3_CUBLAS_CHECK(cublas().dgemm_64(h, CUBLAS_OP_N, CUBLAS_OP_T, out, in, rows, &one, dY, out, X, in,
                                 &one, dW, out));
}

}  // namespace m3::gpu::oracle
