// GpuBackbone (see backbone_gpu.hpp): the reference's backbone (reference/backbone.cpp) with
// every stage a launcher of gpu/stages/stages.cuh, in the same order:
//   forward : input_proj → per layer F1 F2 F3 F4 F5 F4ef F5b F6 F7 F8 (+ states) → norm_f
//   backward: norm_f → per layer (last first) B8 B7 B6 B5a B5b B4b/B4c B3 B2 B1 (+ d_states)
//             → input_proj
// The storage type T (float, __nv_bfloat16, __half) is dispatched ONCE, in the constructor;
// BackboneT<T> holds every buffer. Buffers are named exactly as the stage registry names the
// tensors (reference/registry.cpp) and allocated from it, typed (T) where the registry says
// `typed` (MODEL.md §8) and f32 otherwise — so a stage's capture is "download every registry
// tensor of that stage", and the isolated mode is "upload the oracle's tensors, run one stage".
// Two layouts (registry.hpp Life): production — per layer only the tensors the backward reads
// (saved), one buffer per workspace tensor shared by every layer, none for verification-only
// tensors; with Recompute::Scan, B6 first reruns the chunked scan's prep and state passes into
// the workspace instead of keeping them — and verification (a Capture, run_isolated,
// set_fusion(false), a fault switch to it once): every tensor its own buffer in every layer.
// Parameters and gradients are the flat arenas of ParamLayout; the typed GEMM weight copies
// one buffer refreshed in one launch (core/arena.cu).
// Per layer, beyond the registry: the entering states (ssm_in, k_in, v_in, angle_in) and the
// gradients wrt the leaving states (d_*_out). The leaving states are the registry's states/*
// tensors, the entering-state gradients its d_states/* tensors.
// The f32 residual-stream gradient δ gets a staged typed copy for the GEMMs that read it (as
// the reference's typed_copy).
// Nothing is copied between layers: a layer's input (residual) is a view of the previous
// layer's output, norm_f's input one of the last layer's output, and the residual-stream
// gradient δ one of the buffer that produced it (norm_f's d_norm, a layer's d_temporal).
// run_isolated gives each of them its own buffer back, for the oracle's values. In production
// (no capture, not isolated) F8's residual add is done by the next norm (the next layer's F1,
// or norm_f) as it reads the sum: rmsnorm_forward_add, the same bits in one pass.
#include "backbone_gpu.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <memory>

#include "backbone_t.cuh"
#include "error.hpp"

namespace m3::gpu {

using detail::BackboneT;

std::string GpuBackbone::unsupported(const Config& cfg, Idx B, Idx T) {
  try {
    validate_run(cfg, B, T);
  } catch (const Error& e) {
    return e.what();
  }
  // cuBLAS takes int dimensions; every GEMM dimension is at most B*T or a weight dimension.
  const Idx big = std::max<Idx>({B * T * cfg.in_proj_dim(), B * T * cfg.d_inner(),
                                 B * T * cfg.input_dim, B * T * cfg.vocab_size});
  if (big >= (Idx(1) << 31))
    return "B*T*width = " + std::to_string(big) + " exceeds the 2^31 elements of one GEMM operand";
  return "";
}

GpuBackbone::GpuBackbone(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode,
                         Precision storage, Recompute rc) {
  const std::string why = unsupported(cfg, B, T);
  M3_REQUIRE(why.empty(), "GpuBackbone", "configuration not supported on the GPU", why);
  switch (storage) {  // the one dtype dispatch of the GPU path
    case Precision::F32: impl_ = std::make_unique<BackboneT<float>>(ctx, cfg, B, T, mode, rc); break;
    case Precision::BF16:
      impl_ = std::make_unique<BackboneT<__nv_bfloat16>>(ctx, cfg, B, T, mode, rc);
      break;
    case Precision::F16: impl_ = std::make_unique<BackboneT<__half>>(ctx, cfg, B, T, mode, rc); break;
    case Precision::F64:
      throw Error("GpuBackbone", "f64 storage is not a GPU precision",
                  "f64 is the oracle's; the GPU stores f32, bf16 or f16");
  }
}

GpuBackbone::~GpuBackbone() = default;

Precision GpuBackbone::storage() const { return impl_->storage(); }
void GpuBackbone::set_params(const Params<float>& p) { impl_->set_params(p); }
void GpuBackbone::set_input(const std::vector<float>& X) { impl_->set_input(X); }
void GpuBackbone::set_states(const States<float>& s) { impl_->set_states(s); }
void GpuBackbone::set_dout(const std::vector<float>& d) { impl_->set_dout(d); }
void GpuBackbone::set_leaving_grads(const States<float>* d) { impl_->set_leaving_grads(d); }
void GpuBackbone::zero_grads() { impl_->zero_grads(); }
void GpuBackbone::set_fault(Fault f, int layer) { impl_->set_fault(f, layer); }
void GpuBackbone::forward(Capture* cap) { impl_->forward(cap); }
void GpuBackbone::backward(Capture* cap) { impl_->backward(cap); }
Capture GpuBackbone::run_isolated(const Capture& oracle) { return impl_->run_isolated(oracle); }
void GpuBackbone::run_isolated(const DeviceTeacher& teacher, const IsolatedObserver& observe) {
  impl_->run_isolated(teacher, observe);
}
Capture GpuBackbone::run_isolated_poisoned_for_testing(const Capture& oracle) {
  return impl_->run_isolated_poisoned_for_testing(oracle);
}
void GpuBackbone::set_tokens(const std::vector<std::int32_t>& tok) { impl_->set_tokens(tok); }
void GpuBackbone::set_targets(const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                              double n_norm) {
  impl_->set_targets(tgt, w, n_norm);
}
void GpuBackbone::stage_batch(const std::vector<std::int32_t>& tok,
                              const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                              double n_norm) {
  impl_->stage_batch(tok, tgt, w, n_norm);
}
void GpuBackbone::upload_staged() { impl_->upload_staged(); }
double GpuBackbone::forward_loss(Capture* cap) { return impl_->forward_loss(cap); }
void GpuBackbone::forward_loss_async(Capture* cap) { impl_->forward_loss_async(cap); }
double GpuBackbone::loss() const { return impl_->loss(); }
void GpuBackbone::backward_loss(double scale, Capture* cap) { impl_->backward_loss(scale, cap); }
void GpuBackbone::set_loss_scale(double scale) { impl_->set_loss_scale(scale); }
std::vector<std::uint64_t> GpuBackbone::repeat_digests(Capture* cap) {
  return impl_->repeat_digests(cap);
}
GpuBackbone::DeviceTensor GpuBackbone::device_tensor(const std::string& key) {
  return impl_->device_tensor(key);
}

std::vector<std::string> repeat_digest_keys(const Config& cfg, Idx B, Idx T, ScanMode mode) {
  std::vector<std::string> keys;
  for (const KeyedSpec& ks : expected_stage_keys(cfg, B, T, mode)) keys.push_back(ks.key);
  for (const KeyedParam& kp : expected_param_keys(cfg)) keys.push_back(kp.key);
  return keys;
}
std::vector<float> GpuBackbone::logits() const { return impl_->logits(); }
std::vector<std::int32_t> GpuBackbone::argmax() const { return impl_->argmax(); }
std::vector<float> GpuBackbone::output() const { return impl_->output(); }
States<float> GpuBackbone::states() const { return impl_->states(); }
Params<float> GpuBackbone::grads() const { return impl_->grads(); }
std::vector<float> GpuBackbone::d_x() const { return impl_->d_x(); }
States<float> GpuBackbone::d_entering() const { return impl_->d_entering(); }
void GpuBackbone::synchronize() const { impl_->synchronize(); }
void GpuBackbone::set_profiling(bool on) { impl_->set_profiling(on); }
void GpuBackbone::set_fusion(bool on) { impl_->set_fusion(on); }
void GpuBackbone::set_cluster_tail(bool on) { impl_->set_cluster_tail(on); }
bool GpuBackbone::cluster_tail() const { return impl_->cluster_tail(); }
std::vector<std::pair<std::string, double>> GpuBackbone::stage_times() const {
  return impl_->stage_times();
}
void GpuBackbone::reset_stage_times() { impl_->reset_stage_times(); }
const ParamLayout& GpuBackbone::param_layout() const { return impl_->param_layout(); }
std::vector<float> GpuBackbone::params_flat() const { return impl_->params_flat(); }
void GpuBackbone::set_params_flat(const std::vector<float>& flat) { impl_->set_params_flat(flat); }
void GpuBackbone::zero_states() { impl_->zero_entering_states(); }
float* GpuBackbone::param_arena() { return impl_->param_arena(); }
float* GpuBackbone::grad_arena() { return impl_->grad_arena(); }
void GpuBackbone::refresh_typed_copies() { impl_->refresh_typed_copies(); }
Recompute GpuBackbone::recompute() const { return impl_->recompute(); }
void GpuBackbone::set_recompute(Recompute rc) { impl_->set_recompute(rc); }
bool GpuBackbone::verification_layout() const { return impl_->verification_layout(); }
BackboneMemory GpuBackbone::memory() const { return impl_->memory(); }
void GpuBackbone::poison_for_testing(int layer, const std::string& tensor) {
  impl_->poison_for_testing(layer, tensor);
}

void load_problem(GpuBackbone& net, const Problem& pb) {
  net.set_params(cast_params<float>(pb.params));
  if (pb.token_model()) {
    net.set_tokens(pb.tok);
    net.set_targets(pb.tgt, pb.w, pb.scored());
    net.set_loss_scale(pb.loss_scale());
  } else {
    net.set_input(std::vector<float>(pb.x.begin(), pb.x.end()));
    net.set_dout(std::vector<float>(pb.d_out.begin(), pb.d_out.end()));
  }
  net.set_states(cast_states<float>(pb.states));
  net.set_leaving_grads(nullptr);
  net.zero_grads();
}

Capture run_gpu(GpuContext& ctx, const Problem& pb, ScanMode mode, Precision storage,
                Fault fault) {
  Capture cap(pb.cfg, pb.B, pb.T);
  GpuBackbone net(ctx, pb.cfg, pb.B, pb.T, mode, storage);
  load_problem(net, pb);
  net.set_fault(fault, 0);
  if (pb.token_model()) {
    net.forward_loss(&cap);
    net.backward_loss(pb.loss_scale(), &cap);
  } else {
    net.forward(&cap);
    net.backward(&cap);
  }
  capture_grads(net.grads(), pb.cfg, cap);
  return cap;
}

Capture run_gpu_isolated(GpuContext& ctx, const Problem& pb, ScanMode mode,
                         const Capture& oracle, Precision storage, Fault fault) {
  GpuBackbone net(ctx, pb.cfg, pb.B, pb.T, mode, storage);
  load_problem(net, pb);
  net.set_fault(fault, 0);
  return net.run_isolated(oracle);
}

}  // namespace m3::gpu
