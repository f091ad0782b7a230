// CPU-only build (M3_CUDA=OFF): the device optimizer's API exists so that the trainer links the
// same way in every build; every entry says in one line why it cannot run (the host step is
// reference/optimizer.hpp's, which every build has).
#include "error.hpp"
#include "optimizer_gpu.hpp"

namespace m3::gpu {

namespace {
[[noreturn]] void no_cuda(const char* where) {
  throw Error(where, "no GPU", "built without CUDA (M3_CUDA=OFF)");
}
}  // namespace

struct GpuOptimizer::Impl {};
GpuOptimizer::GpuOptimizer(GpuContext& ctx, const ParamLayout& layout)
    : GpuOptimizer(ctx, layout, 0, layout.total) {}
GpuOptimizer::GpuOptimizer(GpuContext&, const ParamLayout&, Idx, Idx) {
  no_cuda("GpuOptimizer");
}
GpuOptimizer::~GpuOptimizer() = default;
double GpuOptimizer::grad_norm(const float*) { no_cuda("GpuOptimizer::grad_norm"); }
void GpuOptimizer::norm_partials(const float*) { no_cuda("GpuOptimizer::norm_partials"); }
double* GpuOptimizer::partials_device() { no_cuda("GpuOptimizer::partials_device"); }
Idx GpuOptimizer::norm_blocks() const { no_cuda("GpuOptimizer::norm_blocks"); }
double GpuOptimizer::norm_from_partials() { no_cuda("GpuOptimizer::norm_from_partials"); }
void GpuOptimizer::step(const AdamWScalars&, float*, const float*) {
  no_cuda("GpuOptimizer::step");
}
std::vector<float> GpuOptimizer::m() const { no_cuda("GpuOptimizer::m"); }
std::vector<float> GpuOptimizer::v() const { no_cuda("GpuOptimizer::v"); }
void GpuOptimizer::set_moments(const std::vector<float>&, const std::vector<float>&) {
  no_cuda("GpuOptimizer::set_moments");
}
const ParamLayout& GpuOptimizer::layout() const { no_cuda("GpuOptimizer::layout"); }
Idx GpuOptimizer::begin() const { no_cuda("GpuOptimizer::begin"); }
Idx GpuOptimizer::end() const { no_cuda("GpuOptimizer::end"); }

}  // namespace m3::gpu
