// The three GEMM shapes of the model (F2/F8/input_proj forward, B2/B8 dX, dW) through cuBLAS
// with one fixed configuration: FP32 compute in pedantic mode (no TF32), the context's fixed
// workspace, default algorithm — deterministic run to run on one GPU (MODEL.md §12.9).
//
// Row-major buffers are handed to column-major cuBLAS as their transposes:
//   Y[rows,out]  = X·W        ⇔  Yᵀ (out×rows)  = Wᵀ·Xᵀ            gemm(N, N, out, rows, in)
//   dX[rows,in]  = dY·Wᵀ      ⇔  dXᵀ (in×rows)  = W·dYᵀ            gemm(T, N, in, rows, out)
//   dW[in,out]  += Xᵀ·dY      ⇔  dWᵀ (out×in)  += dYᵀ·X            gemm(N, T, out, in, rows), β = 1
// The optional bias of the forward is added by a row-broadcast kernel after the product.
#include "common.cuh"
#include "convert.cuh"
#include "stages.cuh"

namespace m3::gpu {

namespace {

template <class T>
cudaDataType_t cuda_type();
template <>
cudaDataType_t cuda_type<float>() { return CUDA_R_32F; }

// Y[r, j] += bias[j]  (Y is [rows, out])
template <class T>
__global__ void add_bias_rows_kernel(Idx rows, Idx out, const float* bias, T* Y) {
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * out) return;
  Y[i] = from_float<T>(to_float(Y[i]) + bias[i % out]);
}

template <class T>
void gemm(const GpuContext& c, cublasOperation_t ta, cublasOperation_t tb, Idx m, Idx n, Idx k,
          const T* A, Idx lda, const T* B, Idx ldb, float beta, void* C, cudaDataType_t ctype,
          Idx ldc) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.0f;
  M3_CUBLAS_CHECK(cublasGemmEx(cublas_of(c), ta, tb, static_cast<int>(m), static_cast<int>(n),
                               static_cast<int>(k), &alpha, A, cuda_type<T>(),
                               static_cast<int>(lda), B, cuda_type<T>(), static_cast<int>(ldb),
                               &beta, C, ctype, static_cast<int>(ldc),
                               CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
}

}  // namespace

template <class T>
void gemm_forward(const GpuContext& c, Idx rows, Idx in, Idx out, const T* X, const T* W,
                  const float* bias, T* Y) {
  gemm<T>(c, CUBLAS_OP_N, CUBLAS_OP_N, out, rows, in, W, out, X, in, 0.0f, Y, cuda_type<T>(),
          out);
  if (bias) {
    add_bias_rows_kernel<T><<<blocks_for(rows * out, 256), 256, 0, stream_of(c)>>>(rows, out,
                                                                                  bias, Y);
    M3_LAUNCH_CHECK();
  }
}

template <class T>
void gemm_backward_dx(const GpuContext& c, Idx rows, Idx in, Idx out, const T* dY, const T* W,
                      T* dX) {
  gemm<T>(c, CUBLAS_OP_T, CUBLAS_OP_N, in, rows, out, W, out, dY, out, 0.0f, dX, cuda_type<T>(),
          in);
}

template <class T>
void gemm_backward_dw(const GpuContext& c, Idx rows, Idx in, Idx out, const T* X, const T* dY,
                      float* dW) {
  gemm<T>(c, CUBLAS_OP_N, CUBLAS_OP_T, out, in, rows, dY, out, X, in, 1.0f, dW, CUDA_R_32F, out);
}

template void gemm_forward<float>(const GpuContext&, Idx, Idx, Idx, const float*, const float*,
                                  const float*, float*);
template void gemm_backward_dx<float>(const GpuContext&, Idx, Idx, Idx, const float*,
                                      const float*, float*);
template void gemm_backward_dw<float>(const GpuContext&, Idx, Idx, Idx, const float*,
                                      const float*, float*);

}  // namespace m3::gpu
