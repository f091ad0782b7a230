// The three GEMM shapes of the model (F2/F8/input_proj forward, B2/B8/input_proj dX, dW)
// through cuBLAS with one fixed configuration per storage type, the context's fixed workspace
// and the default algorithm — deterministic run to run on one GPU (MODEL.md §12.9):
//   float        A, B, C f32, CUBLAS_COMPUTE_32F_PEDANTIC (no TF32)
//   bf16 / f16   A, B typed (CUDA_R_16BF / CUDA_R_16F), f32 accumulation (CUBLAS_COMPUTE_32F;
//                tensor cores allowed), C typed for forward/dX (the f32 result rounded once, to
//                nearest even), f32 for dW (β = 1 into the f32 master gradient) — MODEL.md §8.
// This is the reference's "float GEMM, then store_typed" up to the summation order.
//
// Row-major buffers are handed to column-major cuBLAS as their transposes:
//   Y[rows,out]  = X·W        ⇔  Yᵀ (out×rows)  = Wᵀ·Xᵀ            gemm(N, N, out, rows, in)
//   dX[rows,in]  = dY·Wᵀ      ⇔  dXᵀ (in×rows)  = W·dYᵀ            gemm(T, N, in, rows, out)
//   dW[in,out]  += Xᵀ·dY      ⇔  dWᵀ (out×in)  += dYᵀ·X            gemm(N, T, out, in, rows), β = 1
// Forward bias (input_proj_b, f32): the reference adds it in float to the float product and
// rounds once. float: Y = XW, then Y += bias in place (both steps round to f32, as Eigen does).
// Typed: cuBLAS would round XW to 16 bits before the add (double rounding), so the product goes
// to an f32 scratch [rows, out] and one kernel forms from_float<T>(XW + bias).
#include "common.cuh"
#include "convert.cuh"
#include "reduce.cuh"
#include "stages.cuh"

namespace m3::gpu {

namespace {

template <class T>
cudaDataType_t cuda_type();
template <>
cudaDataType_t cuda_type<float>() { return CUDA_R_32F; }
template <>
cudaDataType_t cuda_type<__nv_bfloat16>() { return CUDA_R_16BF; }
template <>
cudaDataType_t cuda_type<__half>() { return CUDA_R_16F; }

// The compute type of a GEMM with inputs of type T (f32 accumulation in every case).
template <class T>
cublasComputeType_t compute_type() { return CUBLAS_COMPUTE_32F; }
template <>
cublasComputeType_t compute_type<float>() { return CUBLAS_COMPUTE_32F_PEDANTIC; }

// Y[r, j] (+)= bias[j]  (Y is [rows, out]): float in place.
__global__ void __launch_bounds__(kThreads)
add_bias_rows_kernel(Idx rows, Idx out, const float* bias, float* Y) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < rows * out;
       i += Idx(gridDim.x) * kThreads)
    Y[i] = Y[i] + bias[i % out];
}

// Y[r, j] = from_float<T>(acc[r, j] + bias[j]): the single rounding of a typed biased output.
template <class T>
__global__ void __launch_bounds__(kThreads)
bias_round_kernel(Idx rows, Idx out, const float* acc, const float* bias, T* Y) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < rows * out;
       i += Idx(gridDim.x) * kThreads)
    Y[i] = from_float<T>(acc[i] + bias[i % out]);
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
                               &beta, C, ctype, static_cast<int>(ldc), compute_type<T>(),
                               CUBLAS_GEMM_DEFAULT));
}

}  // namespace

template <class T>
void gemm_forward(const GpuContext& c, Idx rows, Idx in, Idx out, const T* X, const T* W,
                  const float* bias, T* Y, Scratch scratch) {
  const Idx n = rows * out;
  if constexpr (std::is_same_v<T, float>) {
    gemm<T>(c, CUBLAS_OP_N, CUBLAS_OP_N, out, rows, in, W, out, X, in, 0.0f, Y, CUDA_R_32F,
            out);
    if (bias && n > 0) {
      add_bias_rows_kernel<<<grid_for(n, kThreads), kThreads, 0, stream_of(c)>>>(rows, out,
                                                                               bias, Y);
      M3_LAUNCH_CHECK();
    }
  } else {
    if (!bias) {
      gemm<T>(c, CUBLAS_OP_N, CUBLAS_OP_N, out, rows, in, W, out, X, in, 0.0f, Y,
              cuda_type<T>(), out);
      return;
    }
    require_scratch(scratch, n, "gpu::gemm_forward (typed, with bias: f32 product [rows, out])");
    if (n == 0) return;
    gemm<T>(c, CUBLAS_OP_N, CUBLAS_OP_N, out, rows, in, W, out, X, in, 0.0f, scratch.p,
            CUDA_R_32F, out);
    bias_round_kernel<T><<<grid_for(n, kThreads), kThreads, 0, stream_of(c)>>>(
        rows, out, scratch.p, bias, Y);
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

#define M3_INSTANTIATE(T)                                                                     \
  template void gemm_forward<T>(const GpuContext&, Idx, Idx, Idx, const T*, const T*,        \
                                const float*, T*, Scratch);                                   \
  template void gemm_backward_dx<T>(const GpuContext&, Idx, Idx, Idx, const T*, const T*,    \
                                    T*);                                                      \
  template void gemm_backward_dw<T>(const GpuContext&, Idx, Idx, Idx, const T*, const T*,    \
                                    float*);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
