// The GPU lineups (see gpu_lineup.hpp).
#include "gpu_lineup.hpp"

#include "backbone_gpu.hpp"
#include "device.hpp"
#include "error.hpp"

namespace m3::harness {

namespace {
gpu::GpuContext& context() {
  static gpu::GpuContext ctx(0);
  return ctx;
}
}  // namespace

std::string gpu_absent_reason() {
  const gpu::DeviceInfo info = gpu::query_device();
  return info.present ? std::string() : info.why_absent;
}

Implementation gpu_subject(Precision storage) {
  M3_REQUIRE(storage == Precision::F32, "gpu", "the GPU path stores f32 only so far",
             precision_name(storage), " storage on the GPU comes with the mixed-precision path");
  return {"gpu<f32>", [](const Problem& pb, ScanMode mode) {
            return gpu::run_gpu(context(), pb, mode);
          }};
}

std::vector<Lineup> gpu_lineups(const std::vector<Precision>& precisions) {
  std::vector<Lineup> out;
  for (Precision p : precisions) out.push_back({p, gpu_subject(p), reference_emulation(p)});
  return out;
}

}  // namespace m3::harness
