// GpuContext (see context.hpp): device, stream, cuBLAS handle with a fixed 32 MiB workspace —
// MODEL.md §12.9. Math mode: the default, plus CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION —
// without it cuBLAS may pick a split-K algorithm for a typed-output GEMM whose partial sums are
// reduced in the output type (bf16/f16), rounding every output several times instead of once
// (MODEL.md §8: typed inputs, f32 accumulation, one rounding; found by a bf16 GEMM test at
// K = 1088 with few rows: 40 % of outputs off, by up to 3753 ulp). f32 GEMMs ask for
// CUBLAS_COMPUTE_32F_PEDANTIC themselves (no TF32), bf16/f16 GEMMs may use tensor cores with f32
// accumulation (gemm.cu); both are deterministic for this fixed configuration.
#include "common.cuh"
#include "device.hpp"

namespace m3::gpu {

namespace {
constexpr std::size_t kCublasWorkspaceBytes = std::size_t(32) << 20;
}

GpuContext::GpuContext(int device) : impl_(std::make_unique<Impl>()) {
  const DeviceInfo info = query_device();
  M3_REQUIRE(info.present, "GpuContext", "no usable CUDA device", info.why_absent);
  M3_REQUIRE(device >= 0 && device < info.count, "GpuContext", "device index out of range",
             "device ", device, ", count ", info.count);
  impl_->device = device;
  M3_CUDA_CHECK(cudaSetDevice(device));
  M3_CUDA_CHECK(cudaStreamCreateWithFlags(&impl_->stream, cudaStreamNonBlocking));
  M3_CUBLAS_CHECK(cublasCreate(&impl_->cublas));
  M3_CUBLAS_CHECK(cublasSetStream(impl_->cublas, impl_->stream));
  M3_CUBLAS_CHECK(cublasSetMathMode(
      impl_->cublas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                               CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  M3_CUDA_CHECK(cudaMalloc(&impl_->workspace, kCublasWorkspaceBytes));
  impl_->workspace_bytes = kCublasWorkspaceBytes;
  M3_CUBLAS_CHECK(cublasSetWorkspace(impl_->cublas, impl_->workspace, impl_->workspace_bytes));
}

GpuContext::~GpuContext() {
  if (!impl_) return;
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  if (impl_->cublas) cublasDestroy(impl_->cublas);
  if (impl_->workspace) cudaFree(impl_->workspace);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

int GpuContext::device() const { return impl_->device; }

void GpuContext::synchronize() const { M3_CUDA_CHECK(cudaStreamSynchronize(impl_->stream)); }

}  // namespace m3::gpu
