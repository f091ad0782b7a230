// GpuContext (see context.hpp): device, stream, cuBLAS handle with a fixed 32 MiB workspace —
// MODEL.md §12.9. The handle keeps the default math mode: f32 GEMMs ask for
// CUBLAS_COMPUTE_32F_PEDANTIC themselves (no TF32), and bf16/f16 GEMMs may use tensor cores
// with f32 accumulation (gemm.cu); both are deterministic for this fixed configuration.
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
  M3_CUBLAS_CHECK(cublasSetMathMode(impl_->cublas, CUBLAS_DEFAULT_MATH));
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
