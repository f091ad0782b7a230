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

// Y[r, j] = from_float<T>(acc[r, j] + bias[j]) (Y, acc [rows, out]): the single rounding of a
// typed biased output; for float, acc = Y gives Y += bias in place. With vpr = out / V > 0
// (out % V == 0 and 16-byte aligned pointers) one thread per V = 16 / sizeof(T) values of a row,
// all loads before the store; else one thread per value.
template <class T>
__global__ void __launch_bounds__(kThreads)
bias_round_kernel(Idx rows, Idx out, Idx vpr, const float* acc, const float* bias, T* Y) {
  constexpr int V = 16 / sizeof(T);
  const Idx first = blockIdx.x * Idx(kThreads) + threadIdx.x, stride = Idx(gridDim.x) * kThreads;
  if (vpr > 0) {
    for (Idx i = first; i < rows * vpr; i += stride) {
      float a[V], b[V];
      load_vec(acc + i * V, a);
      load_vec(bias + (i % vpr) * V, b);
#pragma unroll
      for (int e = 0; e < V; ++e) a[e] = a[e] + b[e];
      store_n<V>(Y + i * V, a);
    }
  } else {
    for (Idx i = first; i < rows * out; i += stride) Y[i] = from_float<T>(acc[i] + bias[i % out]);
  }
}

// Launches bias_round_kernel over [rows, out] (n = rows·out > 0 values).
template <class T>
void bias_round(cudaStream_t s, Idx rows, Idx out, const float* acc, const float* bias, T* Y) {
  constexpr int V = 16 / sizeof(T);
  const bool vec = out % V == 0 && is_aligned(acc, 16) && is_aligned(bias, 16) && is_aligned(Y, 16);
  const Idx vpr = vec ? out / V : 0;
  bias_round_kernel<T><<<grid_for(vec ? rows * vpr : rows * out, kThreads), kThreads, 0, s>>>(
      rows, out, vpr, acc, bias, Y);
  M3_LAUNCH_CHECK();
}

template <class T>
void gemm(const GpuContext& c, cublasOperation_t ta, cublasOperation_t tb, Idx m, Idx n, Idx k,
          const T* A, Idx lda, const T* B, Idx ldb, float beta, void* C, cudaDataType_t ctype,
          Idx ldc) {
  if (m == 0 || n == 0) return;
  const float alpha = 1.0f;
  M3_CUBLAS_CHECK(cublas().gemm_ex(cublas_of(c), ta, tb, static_cast<int>(m), static_cast<int>(n),
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
    if (bias && n > 0) bias_round<float>(stream_of(c), rows, out, Y, bias, Y);
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
    bias_round<T>(stream_of(c), rows, out, scratch.p, bias, Y);
  }
}

template <class T>
void gemm_backward_dx(const GpuContext& c, Idx rows, Idx in, Idx out, const T* dY, const T* W,
                      T* dX) {
  gemm<T>(c, CUBLAS_OP_T, CUBLAS_OP_N, in, rows, out, W, out, dY, out, 0.0f, dX, cuda_type<T>(),
          in);
}

template <class T>
void gemm_backward_dx_f32(const GpuContext& c, Idx rows, Idx in, Idx out, const T* dY, const T* W,
                          float* dX) {
  gemm<T>(c, CUBLAS_OP_T, CUBLAS_OP_N, in, rows, out, W, out, dY, out, 0.0f, dX, CUDA_R_32F, in);
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
  template void gemm_backward_dx_f32<T>(const GpuContext&, Idx, Idx, Idx, const T*, const T*, \
                                        float*);                                              \
  template void gemm_backward_dw<T>(const GpuContext&, Idx, Idx, Idx, const T*, const T*,    \
                                    float*);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
