// CPU-only build (M3_CUDA=OFF): the GPU API exists so that the harness and the tools link the
// same way in every build, and every entry says in one line why it cannot run. (The fault
// helpers fault_name, parse_fault and fault_stage are real in both builds: fault.cpp.)
#include "backbone_gpu.hpp"
#include "bench_gpu.hpp"
#include "error.hpp"

namespace m3::gpu {

namespace {
[[noreturn]] void no_cuda(const char* where) {
  throw Error(where, "no GPU", "built without CUDA (M3_CUDA=OFF)");
}
}  // namespace

struct GpuContext::Impl {};
GpuContext::GpuContext(int) { no_cuda("GpuContext"); }
GpuContext::~GpuContext() = default;
int GpuContext::device() const { no_cuda("GpuContext"); }
void GpuContext::synchronize() const { no_cuda("GpuContext"); }

struct StreamMarks::Impl {};
StreamMarks::StreamMarks(const GpuContext&) { no_cuda("StreamMarks"); }
StreamMarks::~StreamMarks() = default;
void StreamMarks::mark(int) { no_cuda("StreamMarks"); }
bool StreamMarks::marked(int) const { no_cuda("StreamMarks"); }
bool StreamMarks::ready(int) const { no_cuda("StreamMarks"); }
double StreamMarks::ms(int, int) const { no_cuda("StreamMarks"); }
double StreamMarks::ms(int, const StreamMarks&, int) const { no_cuda("StreamMarks"); }

struct GpuBackbone::Impl {};
GpuBackbone::GpuBackbone(GpuContext&, const Config&, Idx, Idx, ScanMode, Precision, Recompute) {
  no_cuda("GpuBackbone");
}
GpuBackbone::~GpuBackbone() = default;
std::string GpuBackbone::unsupported(const Config&, Idx, Idx) {
  return "built without CUDA (M3_CUDA=OFF)";
}
Precision GpuBackbone::storage() const { no_cuda("GpuBackbone"); }
void GpuBackbone::set_params(const Params<float>&) { no_cuda("GpuBackbone"); }
void GpuBackbone::set_input(const std::vector<float>&) { no_cuda("GpuBackbone"); }
void GpuBackbone::set_states(const States<float>&) { no_cuda("GpuBackbone"); }
void GpuBackbone::set_dout(const std::vector<float>&) { no_cuda("GpuBackbone"); }
void GpuBackbone::set_leaving_grads(const States<float>*) { no_cuda("GpuBackbone"); }
void GpuBackbone::zero_grads() { no_cuda("GpuBackbone"); }
void GpuBackbone::set_fault(Fault, int) { no_cuda("GpuBackbone"); }
void GpuBackbone::forward(Capture*) { no_cuda("GpuBackbone"); }
void GpuBackbone::backward(Capture*) { no_cuda("GpuBackbone"); }
Capture GpuBackbone::run_isolated(const Capture&) { no_cuda("GpuBackbone"); }
void GpuBackbone::run_isolated(const DeviceTeacher&, const IsolatedObserver&) {
  no_cuda("GpuBackbone");
}
std::vector<float> GpuBackbone::params_flat() const { no_cuda("GpuBackbone"); }
void GpuBackbone::set_params_flat(const std::vector<float>&) { no_cuda("GpuBackbone"); }
void GpuBackbone::zero_states() { no_cuda("GpuBackbone"); }
void GpuBackbone::set_tokens(const std::vector<std::int32_t>&) { no_cuda("GpuBackbone"); }
void GpuBackbone::set_targets(const std::vector<std::int32_t>&, const std::vector<float>&, double) {
  no_cuda("GpuBackbone");
}
void GpuBackbone::stage_batch(const std::vector<std::int32_t>&, const std::vector<std::int32_t>&,
                              const std::vector<float>&, double) {
  no_cuda("GpuBackbone");
}
void GpuBackbone::upload_staged() { no_cuda("GpuBackbone"); }
double GpuBackbone::forward_loss(Capture*) { no_cuda("GpuBackbone"); }
void GpuBackbone::forward_loss_async(Capture*) { no_cuda("GpuBackbone"); }
double GpuBackbone::loss() const { no_cuda("GpuBackbone"); }
void GpuBackbone::backward_loss(double, Capture*) { no_cuda("GpuBackbone"); }
void GpuBackbone::set_loss_scale(double) { no_cuda("GpuBackbone"); }
std::vector<std::uint64_t> GpuBackbone::repeat_digests(Capture*) { no_cuda("GpuBackbone"); }
GpuBackbone::DeviceTensor GpuBackbone::device_tensor(const std::string&) { no_cuda("GpuBackbone"); }
std::vector<std::string> repeat_digest_keys(const Config&, Idx, Idx, ScanMode) {
  no_cuda("repeat_digest_keys");
}
std::vector<float> GpuBackbone::logits() const { no_cuda("GpuBackbone"); }
std::vector<std::int32_t> GpuBackbone::argmax() const { no_cuda("GpuBackbone"); }
Capture GpuBackbone::run_isolated_poisoned_for_testing(const Capture&) { no_cuda("GpuBackbone"); }
std::vector<float> GpuBackbone::output() const { no_cuda("GpuBackbone"); }
States<float> GpuBackbone::states() const { no_cuda("GpuBackbone"); }
Params<float> GpuBackbone::grads() const { no_cuda("GpuBackbone"); }
std::vector<float> GpuBackbone::d_x() const { no_cuda("GpuBackbone"); }
States<float> GpuBackbone::d_entering() const { no_cuda("GpuBackbone"); }
void GpuBackbone::synchronize() const { no_cuda("GpuBackbone"); }
void GpuBackbone::set_profiling(bool) { no_cuda("GpuBackbone"); }
void GpuBackbone::set_fusion(bool) { no_cuda("GpuBackbone"); }
void GpuBackbone::set_cluster_tail(bool) { no_cuda("GpuBackbone"); }
bool GpuBackbone::cluster_tail() const { no_cuda("GpuBackbone"); }
std::vector<std::pair<std::string, double>> GpuBackbone::stage_times() const {
  no_cuda("GpuBackbone");
}
void GpuBackbone::reset_stage_times() { no_cuda("GpuBackbone"); }
const ParamLayout& GpuBackbone::param_layout() const { no_cuda("GpuBackbone"); }
float* GpuBackbone::param_arena() { no_cuda("GpuBackbone"); }
float* GpuBackbone::grad_arena() { no_cuda("GpuBackbone"); }
void GpuBackbone::refresh_typed_copies() { no_cuda("GpuBackbone"); }
Recompute GpuBackbone::recompute() const { no_cuda("GpuBackbone"); }
void GpuBackbone::set_recompute(Recompute) { no_cuda("GpuBackbone"); }
bool GpuBackbone::verification_layout() const { no_cuda("GpuBackbone"); }
BackboneMemory GpuBackbone::memory() const { no_cuda("GpuBackbone"); }
void GpuBackbone::poison_for_testing(int, const std::string&) { no_cuda("GpuBackbone"); }
void load_problem(GpuBackbone&, const Problem&) { no_cuda("load_problem"); }
Capture run_gpu(GpuContext&, const Problem&, ScanMode, Precision, Fault) { no_cuda("run_gpu"); }
Capture run_gpu_isolated(GpuContext&, const Problem&, ScanMode, const Capture&, Precision, Fault) {
  no_cuda("run_gpu_isolated");
}
GpuTiming bench_gpu(GpuContext&, const Config&, Idx, Idx, ScanMode, int, int, bool, Precision,
                    bool, Recompute, bool) {
  no_cuda("bench_gpu");
}
Ceilings measure_ceilings(GpuContext&, const CeilingSpec&) { no_cuda("measure_ceilings"); }

}  // namespace m3::gpu
