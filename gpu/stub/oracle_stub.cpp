// CPU-only build (M3_CUDA=OFF): the GPU oracle's API exists so that the tools link the same way
// in every build, and every entry that needs a device says in one line why it cannot run.
// (oracle_stage_keys, oracle_memory and oracle_segment are real in both builds:
// oracle/layout.cpp.)
#include "error.hpp"
#include "oracle_gpu.hpp"

namespace m3::gpu {

namespace {
[[noreturn]] void no_cuda(const char* where) {
  throw Error(where, "no GPU", "built without CUDA (M3_CUDA=OFF)");
}
}  // namespace

std::string oracle_unavailable() { return "built without CUDA (M3_CUDA=OFF)"; }

struct GpuOracle::Impl {};
GpuOracle::GpuOracle(const Config&, Idx, Idx, OracleKeep, int) { no_cuda("GpuOracle"); }
GpuOracle::~GpuOracle() = default;
void GpuOracle::set_params(const Params<double>&) { no_cuda("GpuOracle"); }
void GpuOracle::set_input(const std::vector<double>&) { no_cuda("GpuOracle"); }
void GpuOracle::set_states(const States<double>&) { no_cuda("GpuOracle"); }
void GpuOracle::set_dout(const std::vector<double>&) { no_cuda("GpuOracle"); }
void GpuOracle::set_leaving_grads(const States<double>*) { no_cuda("GpuOracle"); }
void GpuOracle::zero_grads() { no_cuda("GpuOracle"); }
void GpuOracle::set_tokens(const std::vector<std::int32_t>&) { no_cuda("GpuOracle"); }
void GpuOracle::set_targets(const std::vector<std::int32_t>&, const std::vector<float>&, double) {
  no_cuda("GpuOracle");
}
void GpuOracle::forward(Capture*) { no_cuda("GpuOracle"); }
void GpuOracle::backward(Capture*) { no_cuda("GpuOracle"); }
double GpuOracle::forward_loss(Capture*) { no_cuda("GpuOracle"); }
void GpuOracle::backward_loss(double, Capture*) { no_cuda("GpuOracle"); }
void GpuOracle::set_perturbation(const OraclePerturbation&) { no_cuda("GpuOracle"); }
const OraclePerturbation& GpuOracle::perturbation() const { no_cuda("GpuOracle"); }
void GpuOracle::set_teacher(const GpuOracle*) { no_cuda("GpuOracle"); }
void GpuOracle::set_observer(OracleObserver) { no_cuda("GpuOracle"); }
void* GpuOracle::stream() const { no_cuda("GpuOracle"); }
void GpuOracle::synchronize() const { no_cuda("GpuOracle"); }
OracleTensor GpuOracle::tensor(const std::string&) const { no_cuda("GpuOracle"); }
std::vector<double> GpuOracle::download(const OracleTensor&) const { no_cuda("GpuOracle"); }
std::vector<double> GpuOracle::output() const { no_cuda("GpuOracle"); }
States<double> GpuOracle::states() const { no_cuda("GpuOracle"); }
Params<double> GpuOracle::grads() const { no_cuda("GpuOracle"); }
States<double> GpuOracle::d_entering() const { no_cuda("GpuOracle"); }
std::vector<double> GpuOracle::d_x() const { no_cuda("GpuOracle"); }
double GpuOracle::loss() const { no_cuda("GpuOracle"); }
OracleMemory GpuOracle::memory() const { no_cuda("GpuOracle"); }
const Config& GpuOracle::config() const { no_cuda("GpuOracle"); }
OracleKeep GpuOracle::keep() const { no_cuda("GpuOracle"); }

Capture run_gpu_oracle(const Problem&, int) { no_cuda("run_gpu_oracle"); }
void load_problem(GpuOracle&, const Problem&) { no_cuda("GpuOracle"); }
void run_pass(GpuOracle&, const Problem&, Capture*) { no_cuda("GpuOracle"); }
Capture run_gpu_oracle(const Problem&, const OraclePerturbation&, int) {
  no_cuda("run_gpu_oracle");
}
Capture run_gpu_oracle_isolated(const Problem&, const Problem&, const OraclePerturbation&, int) {
  no_cuda("run_gpu_oracle_isolated");
}

}  // namespace m3::gpu
