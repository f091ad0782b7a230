// The verification members of BackboneT (backbone/backbone_t.cuh), beside the production path:
// capture (every registry tensor of a stage downloaded under the reference's names), the
// isolated mode (HARNESS.md §2: each stage fed the oracle's values, run alone, its outputs
// captured and then restored) and its poisoned variant for the stage-table test, the negative
// controls' faults (fault_kernels.cu) and the test poisons. Nothing here runs in a production
// pass: a Capture, run_isolated, a fault or a test poison switch the backbone to the
// verification layout first (or poison what they name).
#include "backbone_t.cuh"
#include "digest.cuh"
#include "fault_kernels.cuh"
#include "teacher_kernels.cuh"

namespace m3::gpu::detail {

template <class T>
void BackboneT<T>::poison_for_testing(int layer, const std::string& tensor) {
  if (tensor == "*workspace*") {
    for (auto& [name, a] : ws_)
      if (a.size()) M3_CUDA_CHECK(cudaMemsetAsync(a.data(), 0xFF, a.size(), s_));
    return;
  }
  NamedBuf& b = layer >= 0 ? layers_.at(layer).at(tensor) : bb_.at(tensor);
  if (b.n > 0 && b.data())
    M3_CUDA_CHECK(cudaMemsetAsync(b.data(), 0xFF, b.nbytes(), s_));
}

template <class T>
Capture BackboneT<T>::isolated_run(const Capture& oracle, bool poison_unread) {
  Capture out(cfg_, d_.B, d_.T);
  IsolatedPass pass;
  pass.oracle = &oracle;
  pass.out = &out;
  pass.poison_unread = poison_unread;
  isolated_pass(pass);
  return out;
}

template <class T>
void BackboneT<T>::run_isolated(const GpuBackbone::DeviceTeacher& teacher,
                                const GpuBackbone::IsolatedObserver& observe) {
  M3_REQUIRE(static_cast<bool>(teacher), "GpuBackbone::run_isolated", "no teacher", "");
  IsolatedPass pass;
  pass.device = &teacher;
  pass.observe = observe ? &observe : nullptr;
  // Every registry tensor stored (as for a capture), and device_tensor readable in `observe`
  // (isolated_pass).
  const ScopedFlag guard(store_all_);
  isolated_pass(pass);
}

template <class T>
void BackboneT<T>::isolated_pass(IsolatedPass& pass) {
  // Each stage on its own, fed the teacher's inputs: no cross-stage fusion.
  const ScopedFlag guard(isolated_);
  ensure_full();
  // A device teacher's observer reads the stage just run (device_tensor); after a host run the
  // buffers hold a mix of teacher and GPU values, which no digest describes.
  repeated_ = pass.device != nullptr;
  // Every tensor gets its own buffer again: the teacher's value of a layer's input need not
  // be the GPU's value of the previous layer's output.
  for (auto& L : layers_) L.unview(LBuf::residual);
  bb_.unview(BBuf::norm_f_input);
  bb_.unview(BBuf::delta);
  zero_grads();
  zero_states(dl_);
  struct Pass {
    BackboneT& b;
    Pass(BackboneT& bb, IsolatedPass& p) : b(bb) {
      b.iso_ = &p;
      b.cap_ = p.out;
    }
    ~Pass() {
      b.iso_ = nullptr;
      b.cap_ = nullptr;
    }
  } in_pass(*this, pass);
  // Everything the teacher holds goes into the buffers of the same name.
  pass.keys = expected_stage_keys(cfg_, d_.B, d_.T, mode_);
  for (const auto& ks : pass.keys) {
    const bool restored = restore_teacher(ks);
    if (!restored && writing_stage(*ks.spec) == "F6" && ks.spec->modes != Modes::Both)
      pass.rebuild_f6 = true;
  }
  plan_fusion();
  chain_step(*this, plan_);  // a token model's norm_f reads the teacher's d_Out (isolated_after)
  if (pass.out) capture_grads(grads(), cfg_, *pass.out);
  have_forward_ = false;  // the buffers hold a mix of teacher and GPU values now
}

// Before a stage of the isolated mode: with poison_unread, NaN into what the stage table says
// it neither reads nor writes; input_proj's backward reads the teacher's δ⁰. Before B6, where
// the teacher lacks F6's internals, F6 rebuilds them from the teacher's inputs, and F6's
// outputs the teacher has are set back to the teacher's.
template <class T>
void BackboneT<T>::isolated_before(StageId s, int l, Dir dir) {
  IsolatedPass& p = *iso_;
  if (s == StageId::input_proj && dir == Dir::Backward) upload_oracle_delta(-1);
  if (s == StageId::B6 && p.rebuild_f6) {
    layer_forward_stage(l, StageId::F6, true);
    for (const KeyedSpec& ks : p.keys)
      if (ks.layer == l && writing_stage(*ks.spec) == "F6") restore_teacher(ks);
  }
  const StageEntry& e = table_entry(l, stage_name(s), dir);
  p.poisoned = p.poison_unread && !e.reads.empty();  // pseudo-stages run nothing
  if (p.poisoned) poison_unread_by(e, l, p.keys);
}

// After it (captured already, or shown to the observer now): its outputs back to the teacher's
// values; with poison, every tensor, except what a stage wrote for a pseudo-stage to capture
// (states/*, d_states/*, B4c/*: restored after that capture). After the head's backward,
// norm_f's dOut is the teacher's d_Out.
template <class T>
void BackboneT<T>::isolated_after(StageId s, int l, Dir dir) {
  IsolatedPass& p = *iso_;
  if (p.observe) (*p.observe)(s, l, dir);
  for (const KeyedSpec& ks : p.keys)
    if (ks.layer == l && ks.spec->dir == dir && std::strcmp(ks.spec->stage, stage_name(s)) == 0)
      restore_teacher(ks);
  if (p.poisoned)
    for (const auto& ks : p.keys)
      if (!captured_later(*ks.spec)) restore_teacher(ks);
  if (s == StageId::head && dir == Dir::Backward)
    teacher_into(bb_.at(BBuf::d_out), stage_key(-1, "head", "d_Out"));
}

// δ entering layer l's backward (l = −1: input_proj's), the teacher's ∂L/∂(layer output).
template <class T>
void BackboneT<T>::upload_oracle_delta(int l) {
  teacher_into(bb_.at(BBuf::delta), entering_gradient(l, static_cast<int>(cfg_.n_layers)).key());
}

template <class T>
bool BackboneT<T>::restore_teacher(const KeyedSpec& ks) {
  const IsolatedPass& p = *iso_;
  NamedBuf& b = buffer_of(ks.layer, ks.spec->stage, ks.spec->tensor);
  if (p.oracle) {
    restore(*p.oracle, ks);
    return true;
  }
  const double* src = (*p.device)(ks.key, b.n);
  if (!src) return false;
  teacher_to_storage(s_, b.n, src, b.data(), b.elem, storage());
  return true;
}

// The teacher's values of one registry key of the run into its buffer (it must have them).
template <class T>
void BackboneT<T>::restore_key(const std::string& key) {
  for (const KeyedSpec& ks : iso_->keys)
    if (ks.key == key) {
      M3_REQUIRE(restore_teacher(ks), "GpuBackbone::run_isolated",
                 "the teacher lacks '" + key + "'", "");
      return;
    }
  throw Error("GpuBackbone::run_isolated", "no registry key '" + key + "' in this run", "");
}

template <class T>
void BackboneT<T>::teacher_into(NamedBuf& b, const std::string& key) {
  const IsolatedPass& p = *iso_;
  if (p.oracle) return upload_floats(b, oracle_data(*p.oracle, key), Precision::F32, s_);
  M3_REQUIRE(b.elem == 4, "GpuBackbone::run_isolated", "not an f32 buffer", key);
  const double* src = (*p.device)(key, b.n);
  M3_REQUIRE(src != nullptr, "GpuBackbone::run_isolated", "the teacher lacks '" + key + "'",
             "an isolated run needs the teacher's gradient entering each layer");
  teacher_to_storage(s_, b.n, src, b.data(), 4, Precision::F32);
}

template <class T>
const StageEntry& BackboneT<T>::table_entry(int layer, const std::string& stage, Dir dir) const {
  const Scope scope = layer >= 0 ? Scope::Layer : Scope::Backbone;
  for (const StageEntry& e : table_)
    if (e.scope == scope && e.dir == dir && e.stage == stage) return e;
  throw Error("GpuBackbone", "stage '" + stage + "' is not in the stage table",
              "reference/registry.cpp stage_table lists every stage the backbone runs");
}

template <class T>
void BackboneT<T>::poison_unread_by(const StageEntry& e, int layer, const std::vector<KeyedSpec>& keys) {
  auto listed = [&](const KeyedSpec& ks) {
    const bool own = ks.spec->scope == Scope::Backbone || ks.layer == layer;
    if (!own) return false;
    if (writing_stage(*ks.spec) == e.name) return true;
    for (const StageRead& r : e.reads)
      if ((r.kind == ReadKind::Tensor || r.kind == ReadKind::TensorAtStorage) && !r.proxy &&
          ks.spec->stage == std::string(r.stage) && ks.spec->tensor == std::string(r.name))
        return true;
    return false;
  };
  for (const auto& ks : keys) {
    // What an earlier stage wrote for a pseudo-stage to capture stays: no stage reads it in
    // between.
    if (listed(ks) || captured_later(*ks.spec)) continue;
    NamedBuf& b = buffer_of(ks.layer, ks.spec->stage, ks.spec->tensor);
    if (b.n > 0) M3_CUDA_CHECK(cudaMemsetAsync(b.data(), 0xFF, b.nbytes(), s_));
  }
}

template <class T>
void BackboneT<T>::apply_fault(int l) {  // the corruptions live in verify/fault_kernels.cu
  LayerBufs& L = layers_[l];
  switch (fault_) {
    case Fault::DropBeta:
      L.at(LBuf::beta).bytes.zero(s_);
      break;
    case Fault::FlipAngleSign:
      fault_flip_angle(s_, L.at(LBuf::angle_cumsum).n, L.f(LBuf::angle_cumsum));
      break;
    case Fault::ChunkBoundaryOff:
      fault_chunk_boundary<T>(s_, d_.B, d_.T, d_.cs, d_.di, L.get<T>(LBuf::y));
      break;
    case Fault::RoundTwice:
      fault_round_twice<T>(s_, d_.BT * d_.di, L.get<T>(LBuf::y));
      break;
    case Fault::None:
      break;
  }
}

template <class T>
void BackboneT<T>::capture(Capture* cap, int layer, const char* stage, Dir dir) {
  if (!cap) return;
  const Scope scope = layer >= 0 ? Scope::Layer : Scope::Backbone;
  std::vector<float> host;
  for (const auto& spec : stage_registry()) {
    if (spec.scope != scope || spec.dir != dir || std::string(spec.stage) != stage ||
        !exists_in(spec, cfg_, mode_))
      continue;
    NamedBuf& b = buffer_of(layer, spec.stage, spec.tensor);
    host.resize(static_cast<size_t>(b.n));
    download_floats(b, host.data(), storage(), s_);
    cap->put_stage(layer, spec.stage, spec.tensor, host.data(), b.n);
  }
}

template <class T>
void BackboneT<T>::restore(const Capture& oracle, const KeyedSpec& ks) {
  NamedBuf& b = buffer_of(ks.layer, ks.spec->stage, ks.spec->tensor);
  const Tensor& t = oracle.at(ks.key);
  M3_REQUIRE(static_cast<Idx>(t.data.size()) == b.n, "GpuBackbone::run_isolated",
             "oracle tensor '" + ks.key + "' has the wrong size", "got ", t.data.size(),
             ", expected ", b.n);
  std::vector<float> host(t.data.begin(), t.data.end());
  upload_floats(b, host.data(), storage(), s_);
}

template <class T>
std::vector<std::uint64_t> BackboneT<T>::repeat_digests(Capture* cap) {
  ensure_full();
  for (int i = 0; i < 4; ++i) {  // the entering states set last, again
    DeviceArray<float>* from[4] = {&st0_.ssm, &st0_.k, &st0_.v, &st0_.angle};
    DeviceArray<float>* to[4] = {&st_.ssm, &st_.k, &st_.v, &st_.angle};
    copy_d2d(s_, to[i]->data(), from[i]->data(), from[i]->size());
  }
  zero_states(dl_);
  zero_grads();
  const ScopedFlag guard(store_all_);
  if (tokens_) {
    forward_loss_async(cap);
    backward_loss(loss_scale_, cap);
  } else {
    forward(cap);
    backward(cap);
  }
  // Every registry tensor's buffer as it is at the end of the run, then every gradient slot.
  std::vector<DigestSegment> segs;
  Idx most = 0;
  for (const KeyedSpec& ks : expected_stage_keys(cfg_, d_.B, d_.T, mode_)) {
    NamedBuf& b = buffer_of(ks.layer, ks.spec->stage, ks.spec->tensor);
    segs.push_back({b.data(), static_cast<Idx>(b.nbytes())});
  }
  for (const KeyedParam& kp : expected_param_keys(cfg_)) {
    const ParamSlot& sl = layout_.at(kp.layer, kp.spec->name);
    segs.push_back({grads_.data() + sl.offset, sl.size * Idx(sizeof(float))});
  }
  for (const DigestSegment& s : segs) most = std::max(most, s.bytes);
  const Idx n = static_cast<Idx>(segs.size());
  if (digest_segs_.size() < n * Idx(sizeof(DigestSegment))) {
    digest_segs_.resize(n * Idx(sizeof(DigestSegment)));
    digests_.resize(n);
  }
  M3_CUDA_CHECK(cudaMemcpyAsync(digest_segs_.data(), segs.data(), segs.size() * sizeof(DigestSegment),
                                cudaMemcpyHostToDevice, s_));
  digest_segments(s_, reinterpret_cast<const DigestSegment*>(digest_segs_.data()), static_cast<int>(n),
                  most, digests_.data());
  std::vector<std::uint64_t> host(static_cast<size_t>(n));
  M3_CUDA_CHECK(cudaMemcpyAsync(host.data(), digests_.data(), host.size() * sizeof(std::uint64_t),
                                cudaMemcpyDeviceToHost, s_));
  M3_CUDA_CHECK(cudaStreamSynchronize(s_));
  repeated_ = true;
  return host;
}

template <class T>
GpuBackbone::DeviceTensor BackboneT<T>::device_tensor(const std::string& key) {
  M3_REQUIRE(repeated_, "GpuBackbone::device_tensor",
             "no repeat_digests run has left the buffers readable", key);
  GpuBackbone::DeviceTensor out;
  if (key.rfind("grad/", 0) == 0) {
    for (const KeyedParam& kp : expected_param_keys(cfg_))
      if (kp.key == key) {
        const ParamSlot& sl = layout_.at(kp.layer, kp.spec->name);
        out.data = grads_.data() + sl.offset;
        out.n = sl.size;
        return out;
      }
  } else {
    for (const KeyedSpec& ks : expected_stage_keys(cfg_, d_.B, d_.T, mode_))
      if (ks.key == key) {
        const NamedBuf& b = buffer_of(ks.layer, ks.spec->stage, ks.spec->tensor);
        M3_REQUIRE(b.ld == 0, "GpuBackbone::device_tensor",
                   "the tensor is a column view, not contiguous", key);
        out.data = b.data();
        out.n = b.n;
        out.storage = b.elem == 4 ? Precision::F32 : storage();
        return out;
      }
  }
  throw Error("GpuBackbone::device_tensor", "this run has no such key", key);
}

#define M3_INSTANTIATE(T)                                                                      \
  template void BackboneT<T>::poison_for_testing(int, const std::string&);                     \
  template Capture BackboneT<T>::isolated_run(const Capture&, bool);                           \
  template void BackboneT<T>::run_isolated(const GpuBackbone::DeviceTeacher&,                  \
                                           const GpuBackbone::IsolatedObserver&);              \
  template void BackboneT<T>::isolated_pass(IsolatedPass&);                                    \
  template bool BackboneT<T>::restore_teacher(const KeyedSpec&);                               \
  template void BackboneT<T>::restore_key(const std::string&);                                 \
  template void BackboneT<T>::teacher_into(NamedBuf&, const std::string&);                     \
  template void BackboneT<T>::isolated_before(StageId, int, Dir);                              \
  template void BackboneT<T>::isolated_after(StageId, int, Dir);                               \
  template void BackboneT<T>::upload_oracle_delta(int);                                        \
  template const StageEntry& BackboneT<T>::table_entry(int, const std::string&, Dir) const;    \
  template void BackboneT<T>::poison_unread_by(const StageEntry&, int,                         \
                                               const std::vector<KeyedSpec>&);                  \
  template void BackboneT<T>::apply_fault(int);                                                \
  template void BackboneT<T>::capture(Capture*, int, const char*, Dir);                        \
  template void BackboneT<T>::restore(const Capture&, const KeyedSpec&);                       \
  template std::vector<std::uint64_t> BackboneT<T>::repeat_digests(Capture*);               \
  template GpuBackbone::DeviceTensor BackboneT<T>::device_tensor(const std::string&);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu::detail
