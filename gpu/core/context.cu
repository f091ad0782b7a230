// GpuContext (see context.hpp): device, stream, cuBLAS handle with a fixed 32 MiB workspace —
// MODEL.md §12.9. Math mode: the default, plus CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION —
// without it cuBLAS may pick a split-K algorithm for a typed-output GEMM whose partial sums are
// reduced in the output type (bf16/f16), rounding every output several times instead of once
// (MODEL.md §8: typed inputs, f32 accumulation, one rounding; found by a bf16 GEMM test at
// K = 1088 with few rows: 40 % of outputs off, by up to 3753 ulp). f32 GEMMs ask for
// CUBLAS_COMPUTE_32F_PEDANTIC themselves (no TF32), bf16/f16 GEMMs may use tensor cores with f32
// accumulation (gemm.cu); both are deterministic for this fixed configuration.
#include <string>
#include <vector>

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
  M3_CUBLAS_CHECK(cublas().create(&impl_->cublas));
  M3_CUBLAS_CHECK(cublas().set_stream(impl_->cublas, impl_->stream));
  M3_CUBLAS_CHECK(cublas().set_math_mode(
      impl_->cublas, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                               CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  M3_CUDA_CHECK(cudaMalloc(&impl_->workspace, kCublasWorkspaceBytes));
  impl_->workspace_bytes = kCublasWorkspaceBytes;
  M3_CUBLAS_CHECK(cublas().set_workspace(impl_->cublas, impl_->workspace, impl_->workspace_bytes));
}

GpuContext::~GpuContext() {
  if (!impl_) return;
  if (impl_->stream) cudaStreamSynchronize(impl_->stream);
  if (impl_->cublas) cublas().destroy(impl_->cublas);
  if (impl_->workspace) cudaFree(impl_->workspace);
  if (impl_->stream) cudaStreamDestroy(impl_->stream);
}

int GpuContext::device() const { return impl_->device; }

void GpuContext::synchronize() const { M3_CUDA_CHECK(cudaStreamSynchronize(impl_->stream)); }

// ---- StreamMarks: one timing event per point, created on first mark ------------------------

struct StreamMarks::Impl {
  cudaStream_t stream = nullptr;
  int device = 0;
  std::vector<cudaEvent_t> events;  // nullptr: never marked
  ~Impl() {
    for (cudaEvent_t e : events)
      if (e) cudaEventDestroy(e);
  }
  cudaEvent_t at(int i, const char* what) const {
    M3_REQUIRE(i >= 0 && i < static_cast<int>(events.size()) && events[i], "StreamMarks",
               "a point that was never marked", what, " point ", i);
    return events[i];
  }
};

StreamMarks::StreamMarks(const GpuContext& ctx) : impl_(std::make_unique<Impl>()) {
  impl_->stream = ctx.impl().stream;
  impl_->device = ctx.impl().device;
}

StreamMarks::~StreamMarks() = default;

void StreamMarks::mark(int i) {
  M3_REQUIRE(i >= 0, "StreamMarks", "a negative point", "point ", i);
  if (i >= static_cast<int>(impl_->events.size())) impl_->events.resize(i + 1, nullptr);
  if (!impl_->events[i]) M3_CUDA_CHECK(cudaEventCreate(&impl_->events[i]));
  M3_CUDA_CHECK(cudaEventRecord(impl_->events[i], impl_->stream));
}

bool StreamMarks::marked(int i) const {
  return i >= 0 && i < static_cast<int>(impl_->events.size()) && impl_->events[i];
}

bool StreamMarks::ready(int i) const {
  const cudaError_t r = cudaEventQuery(impl_->at(i, "ready:"));
  if (r == cudaErrorNotReady) return false;
  M3_CUDA_CHECK(r);
  return true;
}

double StreamMarks::ms(int a, int b) const { return ms(a, *this, b); }

double StreamMarks::ms(int a, const StreamMarks& other, int b) const {
  M3_REQUIRE(impl_->device == other.impl_->device, "StreamMarks",
             "points of two devices cannot be timed against each other", "devices ",
             impl_->device, " and ", other.impl_->device);
  const cudaEvent_t ea = impl_->at(a, "from"), eb = other.impl_->at(b, "to");
  M3_REQUIRE(ready(a) && other.ready(b), "StreamMarks",
             "a point the device has not passed yet", "from ", a, " to ", b,
             " (synchronize first)");
  float out = 0;
  M3_CUDA_CHECK(cudaEventElapsedTime(&out, ea, eb));
  return static_cast<double>(out);
}

}  // namespace m3::gpu
