// The GPU lineups (see gpu_lineup.hpp).
#include "gpu_lineup.hpp"

#include <memory>

#include "backbone.hpp"  // capture_grads
#include "device.hpp"
#include "error.hpp"
#include "sweep.hpp"

namespace m3::harness {

gpu::GpuContext& gpu_context() {
  static gpu::GpuContext ctx(0);
  return ctx;
}

std::string gpu_absent_reason() {
  const gpu::DeviceInfo info = gpu::query_device();
  return info.present ? std::string() : info.why_absent;
}

Implementation gpu_subject(Precision storage, gpu::Fault fault) {
  M3_REQUIRE(storage != Precision::F64, "gpu", "the GPU path stores f32, bf16 or f16",
             "f64 is the oracle's precision");
  std::string name = std::string("gpu<") + precision_name(storage) + ">";
  if (fault != gpu::Fault::None) name += std::string(" fault=") + gpu::fault_name(fault);
  // The GPU keeps its Capture (downloaded after the run); the harness streams it afterwards.
  return {name,
          [storage, fault](const Problem& pb, ScanMode mode, const TensorSink&) {
            return gpu::run_gpu(gpu_context(), pb, mode, storage, fault);
          },
          [storage, fault](const Problem& pb, ScanMode mode, const Capture& oracle,
                           const TensorSink&) {
            return gpu::run_gpu_isolated(gpu_context(), pb, mode, oracle, storage, fault);
          },
          [storage, fault](const Problem& pb, ScanMode mode) {
            // One backbone, loaded once, rerun per call (GpuBackbone::repeat_digests).
            auto net = std::make_shared<gpu::GpuBackbone>(gpu_context(), pb.cfg, pb.B, pb.T, mode,
                                                          storage);
            gpu::load_problem(*net, pb);
            net->set_fault(fault, 0);
            RepeatRunner r;
            r.keys = gpu::repeat_digest_keys(pb.cfg, pb.B, pb.T, mode);
            r.run = [net, cfg = pb.cfg](Capture* cap) {
              std::vector<std::uint64_t> d = net->repeat_digests(cap);
              if (cap) capture_grads(net->grads(), cfg, *cap);  // as run_gpu's capture
              return d;
            };
            return r;
          }};
}

std::vector<Lineup> gpu_lineups(const std::vector<Precision>& precisions, gpu::Fault fault) {
  std::vector<Lineup> out;
  for (Precision p : precisions)
    out.push_back({p, gpu_subject(p, fault), reference_emulation(p)});
  return out;
}

std::vector<Lineup> judged_lineups(const std::string& device,
                                   const std::vector<Precision>& precisions, gpu::Fault fault) {
  if (device == "gpu") {
    std::vector<Lineup> l = gpu_lineups(precisions, fault);
    add_perturbed_baselines(l);
    return l;
  }
  M3_REQUIRE(device == "cpu", "judged_lineups", "the device is gpu or cpu", "device=", device);
  M3_REQUIRE(fault == gpu::Fault::None, "judged_lineups",
             "a fault is injected into the GPU subject only", "fault=", gpu::fault_name(fault));
  return cpu_lineups_perturbed(precisions);
}

}  // namespace m3::harness
