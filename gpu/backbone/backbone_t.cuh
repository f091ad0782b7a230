// Internal to gpu/backbone and gpu/verify: BackboneT<T>, the storage-typed implementation of
// GpuBackbone (backbone_gpu.cu has the whole story: the stage chain, the two layouts, the
// arenas), and the named device buffers it keeps. This header holds the class, its buffers
// and the passes as an executor of the stage chain (reference/chain.hpp); each other job is
// a file of its own, instantiated there for float, bf16 and f16:
//   backbone/layout.cu           the buffers from the registry, their lifetimes, the arenas
//   backbone/tokens.cu           token models' inputs: checks, the embedding's order, copies
//   backbone/launch_forward.cu   every forward stage's launches (and the LM ends')
//   backbone/launch_backward.cu  every backward stage's launches
//   verify/backbone_verify.cu    capture, the isolated mode, faults and test poisons
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "arena.cuh"
#include "lm.hpp"  // reference: embed_order
#include "lm_kernels.cuh"
#include "backbone.hpp"  // reference: capture_grads
#include "backbone_gpu.hpp"
#include "chain.hpp"
#include "common.cuh"
#include "convert.cuh"
#include "error.hpp"
#include "layer_tensors.hpp"
#include "registry.hpp"
#include "stage_profiler.hpp"
#include "stages.cuh"

namespace m3::gpu {

namespace detail {

template <class T>
constexpr Precision precision_of() {
  if constexpr (std::is_same_v<T, float>) return Precision::F32;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return Precision::BF16;
  return Precision::F16;
}

// A tensor's device buffer of n elements of 4 (float) or 2 (bf16/f16) bytes. Where its data
// lives depends on the layout (registry.hpp Life): its own storage (a saved tensor, or every
// tensor in the verification layout), the one workspace buffer of its name that every layer
// shares (production layout), a view of another tensor's buffer (Buffers::view: a layer's input
// is the previous layer's output, so that no copy is made), a block of another tensor's columns
// (Life::Columns in the production layout: z, x in proj, d_z, d_x in d_proj, with that tensor's
// row stride `ld`), or nowhere (a verification-only tensor in the production layout: get()
// then throws, naming it).
struct NamedBuf {
  DeviceArray<unsigned char> bytes;  // own storage
  unsigned char* shared = nullptr;   // the shared workspace buffer (production layout)
  unsigned char* viewed = nullptr;   // Buffers::view
  Life life = Life::Workspace;
  std::size_t elem = 4;
  Idx n = 0;   // 0: the tensor does not exist in this run (e.g. angle tensors with na = 0)
  Idx ld = 0;  // a column view's row stride (its tensor's row width); 0: contiguous rows
  unsigned char* data() { return viewed ? viewed : bytes.size() ? bytes.data() : shared; }
  const unsigned char* data() const {
    return viewed ? viewed : bytes.size() ? bytes.data() : shared;
  }
  std::size_t nbytes() const { return static_cast<std::size_t>(n) * elem; }
};

// Host floats → the buffer's storage (RNE to 16 bits for typed buffers), and back.
inline void upload_floats(NamedBuf& b, const float* host, Precision storage, cudaStream_t s) {
  if (b.n == 0) return;
  if (b.elem == 4) {
    M3_CUDA_CHECK(cudaMemcpyAsync(b.data(), host, static_cast<size_t>(b.n) * 4,
                                  cudaMemcpyHostToDevice, s));
    M3_CUDA_CHECK(cudaStreamSynchronize(s));
    return;
  }
  std::vector<std::uint16_t> bits(static_cast<size_t>(b.n));
  for (Idx i = 0; i < b.n; ++i)
    bits[i] = storage == Precision::BF16 ? float_to_bf16_bits(host[i]) : float_to_f16_bits(host[i]);
  M3_CUDA_CHECK(cudaMemcpyAsync(b.data(), bits.data(), bits.size() * 2,
                                cudaMemcpyHostToDevice, s));
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
}

inline void download_floats(const NamedBuf& b, float* host, Precision storage, cudaStream_t s) {
  if (b.n == 0) return;
  if (b.elem == 4) {
    M3_CUDA_CHECK(cudaMemcpyAsync(host, b.data(), static_cast<size_t>(b.n) * 4,
                                  cudaMemcpyDeviceToHost, s));
    M3_CUDA_CHECK(cudaStreamSynchronize(s));
    return;
  }
  std::vector<std::uint16_t> bits(static_cast<size_t>(b.n));
  M3_CUDA_CHECK(cudaMemcpyAsync(bits.data(), b.data(), bits.size() * 2,
                                cudaMemcpyDeviceToHost, s));
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  for (Idx i = 0; i < b.n; ++i)
    host[i] = storage == Precision::BF16 ? bf16_bits_to_float(bits[i]) : f16_bits_to_float(bits[i]);
}

// The buffer ids the launchers use (a misspelt one does not compile; no name is looked up on
// the hot path). A layer's: every layer row of reference/layer_tensors.hpp, then what the GPU
// keeps per layer beyond the registry: the entering states (the backward reads k_in, v_in) and
// the gradients wrt the leaving states.
#define M3_GPU_LAYER_EXTRA(X) \
  X(ssm_in) X(d_ssm_out) X(k_in) X(d_k_out) X(v_in) X(d_v_out) X(angle_in) X(d_angle_out)
// The backbone's: its registry rows (stage/tensor), then the backbone's output gradient d_out
// (the head's d_Out in a token model), δ (a view of the buffer that made it) and δ's typed copy.
#define M3_GPU_BACKBONE_BUFS(X)                                                           \
  X(input_proj_inputs, "input_proj/input_proj_inputs")                                    \
  X(input_proj_outputs, "input_proj/input_proj_outputs")                                  \
  X(norm_f_input, "norm_f/norm_f_input") X(norm_f_rms, "norm_f/norm_f_rms")                \
  X(Out, "norm_f/Out") X(logits, "head/logits") X(lse, "loss/lse") X(value, "loss/value")  \
  X(d_logits, "head/d_logits") X(d_Out, "head/d_Out") X(d_norm, "norm_f/d_norm")          \
  X(d_input_proj_dx, "input_proj/d_input_proj_dx") X(d_out, "d_out") X(delta, "delta")    \
  X(delta_typed, "delta_typed")

#define M3_LBUF_ROW(modes, when, stage, tensor, ...) tensor,
#define M3_LBUF_NAME_ROW(modes, when, stage, tensor, ...) #tensor,
#define M3_BUF_ID(id, ...) id,
#define M3_BUF_NAME(id) #id,
#define M3_BUF_PATH(id, path) path,
enum class LBuf : int {
  M3_LAYER_FWD_TENSORS(M3_LBUF_ROW) M3_LAYER_BWD_TENSORS(M3_LBUF_ROW)
  M3_GPU_LAYER_EXTRA(M3_BUF_ID) kCount
};
enum class BBuf : int { M3_GPU_BACKBONE_BUFS(M3_BUF_ID) kCount };
inline constexpr const char* kLBufNames[] = {M3_LAYER_FWD_TENSORS(M3_LBUF_NAME_ROW)
                                                 M3_LAYER_BWD_TENSORS(M3_LBUF_NAME_ROW)
                                                     M3_GPU_LAYER_EXTRA(M3_BUF_NAME)};
inline constexpr const char* kBBufNames[] = {M3_GPU_BACKBONE_BUFS(M3_BUF_PATH)};
#undef M3_BUF_PATH
#undef M3_BUF_NAME
#undef M3_BUF_ID
#undef M3_LBUF_NAME_ROW
#undef M3_LBUF_ROW
inline const char* buf_name(LBuf id) { return kLBufNames[static_cast<int>(id)]; }
inline const char* buf_name(BBuf id) { return kBBufNames[static_cast<int>(id)]; }
// The id of a buffer name (the layout's and the verification paths' lookups); m3::Error when
// no id has it.
template <class Id>
Id buf_id(const std::string& name) {
  for (int i = 0; i < static_cast<int>(Id::kCount); ++i)
    if (name == buf_name(static_cast<Id>(i))) return static_cast<Id>(i);
  throw Error("GpuBackbone", "no device buffer id for '" + name + "'",
              "a registry tensor without an id in backbone_t.cuh (M3_GPU_BACKBONE_BUFS)");
}

// The parameters by id (the launchers' P and G): the rows of M3_PARAMS (layer_tensors.hpp).
#define M3_PRM_ID(scope, id, ...) id,
#define M3_PRM_NAME(scope, id, ...) #id,
enum class Prm : int { M3_PARAMS(M3_PRM_ID) kCount };
inline constexpr const char* kPrmNames[] = {M3_PARAMS(M3_PRM_NAME)};
#undef M3_PRM_NAME
#undef M3_PRM_ID

// Device buffers of one scope (a layer: Id = LBuf, or the backbone: BBuf). The launchers reach
// them by id (an array index); the layout and the verification paths also by name. Every id
// the run may ask for is added (with n = 0 when the run has no such tensor), so an id without
// a buffer is a programming error and throws instead of reading as a null pointer. Iteration
// (all()) is in name order.
template <class Id>
class Buffers {
 public:
  NamedBuf& add(const std::string& name, Idx n, std::size_t elem, Life life = Life::Saved) {
    NamedBuf& b = m_[name];
    b.elem = elem;
    b.n = n;
    b.life = life;
    by_id_[static_cast<size_t>(buf_id<Id>(name))] = &b;
    return b;
  }
  // nullptr when the run has no such tensor. Asking for the wrong element type (a typed tensor
  // as float, or the reverse), or for a tensor without a buffer in this layout, is an m3::Error.
  template <class U>
  U* get(Id id) {
    NamedBuf& b = at(id);
    if (b.n == 0) return nullptr;
    M3_REQUIRE(b.elem == sizeof(U), "GpuBackbone",
               std::string("buffer '") + buf_name(id) + "' accessed with the wrong storage type",
               "element size ", b.elem, ", asked ", sizeof(U));
    M3_REQUIRE(b.data() != nullptr, "GpuBackbone",
               std::string("tensor '") + buf_name(id) + "' has no buffer in the production layout",
               "its lifetime is '", life_name(b.life),
               "' but a production stage uses it: list it as saved or workspace in "
               "reference/layer_tensors.hpp (the lifetime column)");
    return reinterpret_cast<U*>(b.data());
  }
  float* f(Id id) { return get<float>(id); }
  // `id` reads and writes `target`'s storage (same element size and count) until unview.
  void view(Id id, NamedBuf& target) {
    NamedBuf& b = at(id);
    M3_REQUIRE(b.elem == target.elem && b.n == target.n, "GpuBackbone",
               std::string("buffer '") + buf_name(id) + "' cannot view a buffer of another shape",
               "");
    b.viewed = target.data();
  }
  void unview(Id id) { at(id).viewed = nullptr; }
  NamedBuf& at(Id id) {
    NamedBuf* b = by_id_[static_cast<size_t>(id)];
    M3_REQUIRE(b != nullptr, "GpuBackbone", std::string("no device buffer '") + buf_name(id) + "'",
               "not added by the layout");
    return *b;
  }
  NamedBuf& at(const std::string& name) {
    auto it = m_.find(name);
    M3_REQUIRE(it != m_.end(), "GpuBackbone", "no device buffer '" + name + "'",
               "not a registry tensor of this scope");
    return it->second;
  }
  std::map<std::string, NamedBuf>& all() { return m_; }
  const std::map<std::string, NamedBuf>& all() const { return m_; }

 private:
  std::map<std::string, NamedBuf> m_;
  std::array<NamedBuf*, static_cast<size_t>(Id::kCount)> by_id_{};
};

using LayerBufs = Buffers<LBuf>;
using BackboneBufs = Buffers<BBuf>;

// A mode flag set for one scope (a pass that stores every tensor, the isolated mode) and
// cleared on the way out, an exception's too.
struct ScopedFlag {
  bool& flag;
  explicit ScopedFlag(bool& f) : flag(f) { flag = true; }
  ~ScopedFlag() { flag = false; }
  ScopedFlag(const ScopedFlag&) = delete;
  ScopedFlag& operator=(const ScopedFlag&) = delete;
};

template <class U>
inline void copy_d2d(cudaStream_t s, U* dst, const U* src, Idx n) {
  if (n > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(U),
                                  cudaMemcpyDeviceToDevice, s));
}

}  // namespace detail

// The storage-independent interface behind GpuBackbone; BackboneT<T> implements it.
struct GpuBackbone::Impl {
  virtual ~Impl() = default;
  virtual Precision storage() const = 0;
  virtual void set_params(const Params<float>& p) = 0;
  virtual void set_input(const std::vector<float>& X) = 0;
  virtual void set_states(const States<float>& s) = 0;
  virtual void set_dout(const std::vector<float>& d) = 0;
  virtual void set_leaving_grads(const States<float>* d) = 0;
  virtual void zero_grads() = 0;
  virtual void set_fault(Fault f, int layer) = 0;
  virtual void forward(Capture* cap) = 0;
  virtual void backward(Capture* cap) = 0;
  virtual Capture run_isolated(const Capture& oracle) = 0;
  virtual void run_isolated(const GpuBackbone::DeviceTeacher& teacher,
                            const GpuBackbone::IsolatedObserver& observe) = 0;
  virtual Capture run_isolated_poisoned_for_testing(const Capture& oracle) = 0;
  virtual std::vector<float> output() = 0;
  virtual States<float> states() = 0;
  virtual Params<float> grads() = 0;
  virtual std::vector<float> d_x() = 0;
  virtual States<float> d_entering() = 0;
  virtual void synchronize() = 0;
  virtual void set_profiling(bool on) = 0;
  virtual void set_fusion(bool on) = 0;
  virtual void set_cluster_tail(bool on) = 0;
  virtual bool cluster_tail() const = 0;
  virtual std::vector<std::pair<std::string, double>> stage_times() const = 0;
  virtual void reset_stage_times() = 0;
  virtual void refresh_typed_copies() = 0;
  virtual const ParamLayout& param_layout() const = 0;
  virtual float* param_arena() = 0;
  virtual float* grad_arena() = 0;
  virtual Recompute recompute() const = 0;
  virtual void set_recompute(Recompute rc) = 0;
  virtual bool verification_layout() const = 0;
  virtual BackboneMemory memory() const = 0;
  virtual void poison_for_testing(int layer, const std::string& tensor) = 0;
  virtual std::vector<float> params_flat() = 0;
  virtual void set_params_flat(const std::vector<float>& flat) = 0;
  virtual void zero_entering_states() = 0;
  virtual void set_tokens(const std::vector<std::int32_t>& tok) = 0;
  virtual void set_targets(const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                           double n_norm) = 0;
  virtual void stage_batch(const std::vector<std::int32_t>& tok,
                           const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                           double n_norm) = 0;
  virtual void upload_staged() = 0;
  virtual double forward_loss(Capture* cap) = 0;
  virtual void forward_loss_async(Capture* cap) = 0;
  virtual double loss() = 0;
  virtual void backward_loss(double scale, Capture* cap) = 0;
  virtual void set_loss_scale(double scale) = 0;
  virtual std::vector<std::uint64_t> repeat_digests(Capture* cap) = 0;
  virtual GpuBackbone::DeviceTensor device_tensor(const std::string& key) = 0;
  virtual std::vector<float> logits() = 0;
  virtual std::vector<std::int32_t> argmax() = 0;
};

namespace detail {

template <class T>
class BackboneT final : public GpuBackbone::Impl {
  friend struct m3::ChainAccess;

 public:
  BackboneT(GpuContext& c, const Config& cf, Idx B, Idx T_, ScanMode m, Recompute rc);

  Precision storage() const override { return precision_of<T>(); }

  // ---- the layout (registry.hpp Life) --------------------------------------------------------
  // The production layout: saved tensors their own buffer in every layer, workspace tensors
  // one shared buffer, views none (layer 0's residual, H⁰ in f32, its own), verification-only
  // tensors none. The residual-stream gradient alternates between two buffers, since layer
  // l − 1's B1 writes its d_temporal while reading layer l's as δ: layer L − 1 writes the
  // workspace one, layer L − 2 norm_f's d_norm (read by layer L − 1, free after it), and so on,
  // so no layer count needs a buffer more than one layer does. The verification layout
  // (full_, for a Capture, the isolated mode, set_fusion(false) or a fault): every tensor its
  // own buffer in every layer, as the stage-by-stage path and the harness need them.
  Life layer_life(const TensorSpec& spec) const;
  bool lean() const { return !full_; }
  // Whether the production layout keeps no copy of a GEMM's forward operand per layer (registry
  // lifetime: workspace), so that the backward writes it again before the GEMM's weight
  // gradient: gated (B7 from y and z, B8's dW after B7) and post_norm (B1 from the layer's
  // input, B2's dW after B1). The same operations as the forward's on the same inputs.
  bool rewritten(int l, LBuf id) { return lean() && layers_[l].at(id).life == Life::Workspace; }
  // The registry spec of a layer tensor by its (unique) name.
  static const TensorSpec& layer_spec(const std::string& name);
  // A layer tensor's row stride for the kernels: its tensor's row width when it is a column view
  // in this layout (ld), else 0 (contiguous rows).
  Idx ld_of(int l, LBuf id) { return layers_[l].at(id).ld; }
  bool column_views(int l) { return ld_of(l, LBuf::x) != 0; }
  // Fused runs in the production layout: B5b and B5a write d_proj's f32 columns themselves
  // (split_f32_cols), so that B3 has nothing left to move and is not launched. Isolated runs
  // keep B3, which then moves the f32 parts the oracle restored.
  bool proj_grads_direct(int l) { return fused() && column_views(l); }
  // The one row stride a kernel takes for a tensor and its gradient (x and d_x, z and d_z:
  // proj and d_proj have the same rows).
  Idx shared_ld(int l, LBuf id, LBuf grad);
  // b/c_raw and d_b/c_raw share one row stride in the BCNorm kernels.
  Idx raw_ld(int l);
  // Before allocating: the production layout's bytes (registry plan, the arenas, the scratch,
  // the backbone tensors) against the device's free memory — a clear message instead of a
  // cudaMalloc failure halfway, naming the policy that would fit.
  void check_fits() const;
  void lay_out();
  unsigned char* workspace(const std::string& name, std::size_t bytes);
  // To the verification layout (once; buffers that already hold values keep them).
  void ensure_full();
  Recompute recompute() const override { return rc_; }
  void set_recompute(Recompute rc) override {
    if (rc == rc_) return;
    rc_ = rc;
    relayout();
  }
  // After a switch that changes layer_life: every layer tensor's lifetime again, and the layout
  // for them (the workspace's values are gone).
  void relayout();
  // The chunked B6 with its tail in B3 (SsmChunkBwd::cluster_tail) where the shape allows it.
  bool cluster_tail() const override {
    return mode_ == ScanMode::Chunked && cluster_tail_ && ssm_chunked_cluster_tail<T>(d_);
  }
  // The scratch of every stage (reduce.cu scratch_floats), and the cluster tail's partials
  // after the chunked backward's own when it runs.
  Idx scratch_need() const;
  void set_cluster_tail(bool on) override {
    if (on == cluster_tail_) return;
    cluster_tail_ = on;
    scratch_.resize(scratch_need());
    relayout();
  }
  bool verification_layout() const override { return full_; }
  BackboneMemory memory() const override;
  // NaN into a tensor's buffer (all bits set: a quiet NaN in f32, bf16 and f16), or into every
  // workspace buffer with tensor "*workspace*".
  void poison_for_testing(int layer, const std::string& tensor) override;  // verify/backbone_verify.cu
  // m3h determinism at CI scale: the loaded run again from st0_, every tensor stored as for a
  // capture, then one device digest per key of repeat_digest_keys (verify/backbone_verify.cu).
  std::vector<std::uint64_t> repeat_digests(Capture* cap) override;
  // A key's buffer after repeat_digests (verify/backbone_verify.cu).
  GpuBackbone::DeviceTensor device_tensor(const std::string& key) override;

  // ---- uploads / downloads ------------------------------------------------------------------
  void set_params(const Params<float>& p) override {
    check_params(p, cfg_, "GpuBackbone::set_params");
    std::vector<float> host(static_cast<size_t>(layout_.total), 0.0f);  // the gaps stay zero
    for_each_param(p, [&](int l, const char* name, const std::vector<float>& v) {
      if (v.empty()) return;  // a parameter this config does not have (sizes checked above)
      const ParamSlot& sl = layout_.at(l, name);
      M3_REQUIRE(static_cast<Idx>(v.size()) == sl.size, "GpuBackbone::set_params",
                 "parameter '" + sl.name + "' has the wrong size", "got ", v.size(),
                 ", expected ", sl.size);
      std::copy(v.begin(), v.end(), host.begin() + sl.offset);
    });
    params_.upload(host.data(), s_);
    refresh_typed_copies();
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
  }

  // The typed compute copies of the GEMM weights from the f32 masters: one launch.
  void refresh_typed_copies() override {
    if constexpr (!std::is_same_v<T, float>)
      gpu::refresh_typed_copies<T>(s_, reinterpret_cast<const CopySegment*>(segments_.data()),
                                   n_segments_, max_segment_, params_.data(), typed_.data());
  }
  const ParamLayout& param_layout() const override { return layout_; }
  float* param_arena() override { return params_.data(); }
  float* grad_arena() override { return grads_.data(); }

  void set_input(const std::vector<float>& X) override {
    tokens_ = false;
    NamedBuf& b = bb_.at(BBuf::input_proj_inputs);
    M3_REQUIRE(static_cast<Idx>(X.size()) == b.n, "GpuBackbone::set_input",
               "input X has the wrong size", "got ", X.size(), ", expected ", b.n);
    upload_floats(b, X.data(), storage(), s_);
  }

  std::vector<float> params_flat() override {
    std::vector<float> host(static_cast<size_t>(layout_.total));
    params_.download(host.data(), s_);
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
    return host;
  }
  void set_params_flat(const std::vector<float>& flat) override {
    M3_REQUIRE(static_cast<Idx>(flat.size()) == layout_.total, "GpuBackbone::set_params_flat",
               "the flat parameters have the wrong size", "got ", flat.size(), ", expected ",
               layout_.total);
    params_.upload(flat.data(), s_);
    refresh_typed_copies();
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
  }
  void zero_entering_states() override { zero_states(st_); }

  // ---- token models (TRAINING.md §1) --------------------------------------------------------
  void set_tokens(const std::vector<std::int32_t>& tok) override;
  void set_targets(const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                   double n_norm) override;
  void stage_batch(const std::vector<std::int32_t>& tok, const std::vector<std::int32_t>& tgt,
                   const std::vector<float>& w, double n_norm) override;
  void upload_staged() override;
  double forward_loss(Capture* cap) override {
    forward_loss_async(cap);
    return loss();
  }
  void forward_loss_async(Capture* cap) override {
    M3_REQUIRE(tokens_ && targets_, "GpuBackbone::forward_loss",
               "set_tokens and set_targets come first", "");
    forward(cap);
    mark("start");
    cap_ = cap;
    plan_fusion();
    chain_lm_forward(*this);
    cap_ = nullptr;
    collect_marks();
    have_loss_ = true;
  }
  double loss() override {
    M3_REQUIRE(have_loss_, "GpuBackbone::loss", "loss called before forward_loss", "");
    M3_CUDA_CHECK(cudaEventSynchronize(loss_ready_.e));
    return *loss_host_.p / n_norm_;
  }
  void backward_loss(double scale, Capture* cap) override {
    M3_REQUIRE(have_loss_, "GpuBackbone::backward_loss",
               "backward_loss called before forward_loss", "");
    loss_scale_ = scale;
    mark("start");
    cap_ = cap;
    plan_fusion();
    chain_lm_backward(*this);
    cap_ = nullptr;
    collect_marks();
    backward(cap);
  }
  void set_loss_scale(double scale) override {
    M3_REQUIRE(std::isfinite(scale) && scale > 0, "GpuBackbone::set_loss_scale",
               "the loss scale must be finite and > 0", "scale=", scale);
    loss_scale_ = scale;
  }
  std::vector<float> logits() override { return download(bb_.at(BBuf::logits)); }
  std::vector<std::int32_t> argmax() override {
    M3_REQUIRE(have_loss_, "GpuBackbone::argmax", "argmax called before forward_loss", "");
    argmax_rows<T>(s_, d_.BT, cfg_.vocab_size, bb_.get<T>(BBuf::logits), argmax_.data());
    std::vector<std::int32_t> host(static_cast<size_t>(d_.BT));
    argmax_.download(host.data(), s_);
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
    return host;
  }

  void set_states(const States<float>& st) override {
    upload_states(st, st_, "GpuBackbone::set_states");
    upload_states(st, st0_, "GpuBackbone::set_states");  // repeat_digests starts from them
  }

  void set_dout(const std::vector<float>& d) override {
    NamedBuf& b = bb_.at(BBuf::d_out);
    M3_REQUIRE(static_cast<Idx>(d.size()) == b.n, "GpuBackbone::set_dout",
               "dOut has the wrong size", "got ", d.size(), ", expected ", b.n);
    upload_floats(b, d.data(), Precision::F32, s_);
  }

  void set_leaving_grads(const States<float>* dl) override {
    if (dl) {
      upload_states(*dl, dl_, "GpuBackbone::set_leaving_grads");
    } else {
      zero_states(dl_);
    }
  }

  void zero_grads() override { grads_.zero(s_); }

  void set_fault(Fault f, int layer) override {
    M3_REQUIRE(layer >= 0 && layer < static_cast<int>(cfg_.n_layers), "GpuBackbone::set_fault",
               "fault layer out of range", "layer ", layer, ", n_layers ", cfg_.n_layers);
    fault_ = f;
    fault_layer_ = layer;
    if (f != Fault::None) ensure_full();  // a fault corrupts tensors the harness compares
  }

  std::vector<float> output() override { return download(bb_.at(BBuf::Out)); }
  std::vector<float> d_x() override { return download(bb_.at(BBuf::d_input_proj_dx)); }
  States<float> states() override { return download_states(st_); }
  States<float> d_entering() override { return download_states(de_); }
  Params<float> grads() override {
    std::vector<float> host(static_cast<size_t>(layout_.total));
    grads_.download(host.data(), s_);
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
    Params<float> g = zero_params<float>(cfg_);
    for_each_param(g, [&](int l, const char* name, std::vector<float>& v) {
      if (v.empty()) return;  // no input_proj
      const ParamSlot& sl = layout_.at(l, name);
      std::copy(host.begin() + sl.offset, host.begin() + sl.offset + sl.size, v.begin());
    });
    return g;
  }
  void synchronize() override { ctx_.synchronize(); }

  void set_profiling(bool on) override { profiler_.set_on(on); }
  void set_fusion(bool on) override {
    fusion_ = on;
    if (!on) ensure_full();  // every stage on its own reads what the fused path never stores
  }
  std::vector<std::pair<std::string, double>> stage_times() const override {
    return profiler_.times();
  }
  void reset_stage_times() override { profiler_.reset(); }

  // ---- the two passes ---------------------------------------------------------------------
  void forward(Capture* cap) override {
    if (cap) ensure_full();
    repeated_ = false;
    mark("start");
    cap_ = cap;
    plan_fusion();
    chain_forward(*this, plan_);
    cap_ = nullptr;
    collect_marks();
    have_forward_ = true;
  }

  void backward(Capture* cap) override {
    M3_REQUIRE(have_forward_, "GpuBackbone::backward", "backward called before forward", "");
    M3_REQUIRE(!cap || full_, "GpuBackbone::backward",
               "a Capture needs the verification layout from the forward on",
               "pass the Capture to forward() too (the production forward keeps only what its "
               "backward reads)");
    repeated_ = false;
    mark("start");
    delta_typed_of_ = nullptr;
    cap_ = cap;
    plan_fusion();
    chain_backward(*this, plan_);
    cap_ = nullptr;
    collect_marks();
  }

  Capture run_isolated(const Capture& oracle) override { return isolated_run(oracle, false); }
  void run_isolated(const GpuBackbone::DeviceTeacher& teacher,
                    const GpuBackbone::IsolatedObserver& observe) override;  // verify/backbone_verify.cu
  Capture run_isolated_poisoned_for_testing(const Capture& oracle) override {
    return isolated_run(oracle, true);
  }

  // The isolated mode (run_isolated). poison_unread: before each stage that runs, NaN into
  // every registry tensor of the run that the stage table says the stage neither reads nor
  // writes, and every tensor restored from the oracle after it — so a read the table lacks
  // shows as a difference from the plain isolated run (tests only: one upload per tensor per
  // stage).
  Capture isolated_run(const Capture& oracle, bool poison_unread);  // verify/backbone_verify.cu

 private:

  // run_isolated's pass: each stage fed the teacher's values — a host Capture's (`oracle`) or
  // a device teacher's (`device`) — its outputs captured into `out` (host) or shown to
  // `observe` (device), and then restored (verify/backbone_verify.cu).
  struct IsolatedPass {
    const Capture* oracle = nullptr;
    const GpuBackbone::DeviceTeacher* device = nullptr;
    Capture* out = nullptr;
    const GpuBackbone::IsolatedObserver* observe = nullptr;
    bool poison_unread = false;
    std::vector<KeyedSpec> keys;  // every registry tensor of the run
    bool poisoned = false;        // the stage in flight ran with its unread tensors poisoned
    bool rebuild_f6 = false;      // the teacher lacks F6's internals that B6 reads
  };
  void isolated_pass(IsolatedPass& pass);           // verify/backbone_verify.cu
  void isolated_before(StageId s, int l, Dir dir);  // verify/backbone_verify.cu
  void isolated_after(StageId s, int l, Dir dir);   // verify/backbone_verify.cu
  void upload_oracle_delta(int l);                  // verify/backbone_verify.cu
  // The teacher's values of a key into its buffer (a device teacher: nothing where it lacks
  // the key; returns whether it restored), and into an f32 backbone buffer (it must have them).
  bool restore_teacher(const KeyedSpec& ks);                       // verify/backbone_verify.cu
  void restore_key(const std::string& key);                        // verify/backbone_verify.cu
  void teacher_into(NamedBuf& b, const std::string& key);          // verify/backbone_verify.cu

  // The stage-table entry of (layer or backbone, registry stage, direction).
  const StageEntry& table_entry(int layer, const std::string& stage, Dir dir) const;  // verify/backbone_verify.cu
  // A layer tensor that one stage writes and a later pseudo-stage captures (states/* by F5/F6,
  // d_states/* by B5a/B6, B4c/* by B4b's launcher).
  static bool captured_later(const TensorSpec& spec) {
    const std::string w = writing_stage(spec);
    return spec.scope == Scope::Layer && !w.empty() && w != spec.stage;
  }
  // NaN into every registry tensor of the run except those entry e (of layer `layer`) reads
  // or writes by the stage table.
  void poison_unread_by(const StageEntry& e, int layer, const std::vector<KeyedSpec>& keys);  // verify/backbone_verify.cu

  static std::string backbone_name(const char* stage, const char* tensor) {
    return std::string(stage) + "/" + tensor;
  }

  Scratch scr() { return {scratch_.data(), scratch_.size()}; }
  // A parameter's (its gradient's) place in the flat arenas: an index into param_off_, the
  // layout's offsets by (layer, Prm) made once per run.
  Idx param_offset(int l, Prm id) const {
    const Idx off = param_off_[static_cast<size_t>((l + 1) * static_cast<int>(Prm::kCount) +
                                                   static_cast<int>(id))];
    M3_REQUIRE(off >= 0, "GpuBackbone", std::string("no parameter '") +
                   kPrmNames[static_cast<int>(id)] + "' in layer " + std::to_string(l),
               "not in this run's flat layout");
    return off;
  }
  float* P(int l, Prm id) { return params_.data() + param_offset(l, id); }
  float* G(int l, Prm id) { return grads_.data() + param_offset(l, id); }
  const T* w_in(int l) {
    if constexpr (std::is_same_v<T, float>) return P(l, Prm::in_proj_w);
    else return typed_.data() + w_in_off_[l];
  }
  const T* w_out(int l) {
    if constexpr (std::is_same_v<T, float>) return P(l, Prm::out_proj_w);
    else return typed_.data() + w_out_off_[l];
  }
  const T* w_input() {
    if constexpr (std::is_same_v<T, float>) return P(-1, Prm::input_proj_w);
    else return typed_.data() + w_input_off_;
  }
  const T* w_head() {
    if constexpr (std::is_same_v<T, float>) return P(-1, Prm::head_w);
    else return typed_.data() + w_head_off_;
  }
  // The staged typed copy of δ for the GEMMs that read it (the reference's typed_copy): made
  // here, unless the B1 that wrote δ stored it already (delta_typed_of_: the f32 buffer that
  // B1's copy was made from, the same bits).
  const T* delta_typed() {
    if constexpr (!std::is_same_v<T, float>)
      if (delta_typed_of_ != bb_.f(BBuf::delta))
        convert<float, T>(s_, d_.BT * d_.dm, bb_.f(BBuf::delta), bb_.get<T>(BBuf::delta_typed));
    return delta_typed_made();
  }
  // The same copy once this layer's B8 has made it (no conversion: δ is unchanged until B1).
  const T* delta_typed_made() {
    if constexpr (std::is_same_v<T, float>) return bb_.f(BBuf::delta);
    else return bb_.get<T>(BBuf::delta_typed);
  }

  // The four persistent states of every layer, [L][B][…] each (MODEL.md §9, §12.6).
  struct StateArrays {
    DeviceArray<float> ssm, k, v, angle;
  };
  // Copies layer l's [B, …] slices between a StateArrays and the layer's four buffers named
  // `names` (ssm, k, v, angle order): into the layer (to_layer) or out of it.
  void copy_states(int l, StateArrays& all, const std::array<LBuf, 4>& names,
                   bool to_layer) {
    LayerBufs& L = layers_[l];
    const StateSizes z = state_sizes(cfg_);
    DeviceArray<float>* arrays[4] = {&all.ssm, &all.k, &all.v, &all.angle};
    const Idx per[4] = {d_.B * z.ssm, d_.B * z.k, d_.B * z.v, d_.B * z.angle};
    for (int i = 0; i < 4; ++i) {
      float* slice = arrays[i]->data() + l * per[i];
      float* layer = L.f(names[i]);
      to_layer ? copy_d2d(s_, layer, slice, per[i]) : copy_d2d(s_, slice, layer, per[i]);
    }
  }
  void load_entering_states(int l) {
    copy_states(l, st_, {LBuf::ssm_in, LBuf::k_in, LBuf::v_in, LBuf::angle_in}, true);
  }
  // ---- the executor of the stage chain (reference/chain.hpp) --------------------------------
  // Layer l's input (residual): a view of layer l−1's output, or H⁰ (typed) widened to f32
  // for l = 0; then the entering states. The isolated mode loads only the entering states:
  // every tensor else is the oracle's already.
  void enter_layer(int l) {
    if (iso_) {
      load_entering_states(l);
      return;
    }
    LayerBufs& L = layers_[l];
    if (l > 0) {
      L.view(LBuf::residual, layers_[l - 1].at(LBuf::layer_output));
    } else {
      convert<T, float>(s_, d_.BT * d_.dm, bb_.get<T>(BBuf::input_proj_outputs),
                        L.f(LBuf::residual));
    }
    load_entering_states(l);
  }
  // The leaving states to their slices; norm_f reads the last layer's output in place.
  void leave_layer(int l) {
    if (iso_) return;
    copy_states(l, st_, {LBuf::ssm_state, LBuf::k_state, LBuf::v_state, LBuf::angle_state},
                false);
    if (l + 1 == plan_.n_layers) bb_.view(BBuf::norm_f_input, layers_[l].at(LBuf::layer_output));
  }
  // δ, the gradient wrt the residual stream entering each layer's backward from above, is a
  // view of the buffer its producer wrote (norm_f's d_norm, then layer l's d_temporal); the
  // isolated mode uploads the oracle's.
  void enter_layer_backward(int l) {
    if (iso_) upload_oracle_delta(l);
    load_leaving_grads(l);
  }
  void leave_layer_backward(int l) {
    if (iso_) return;
    store_entering_grads(l);
    bb_.view(BBuf::delta, layers_[l].at(LBuf::d_temporal));
  }
  void load_leaving_grads(int l) {
    copy_states(l, dl_, {LBuf::d_ssm_out, LBuf::d_k_out, LBuf::d_v_out, LBuf::d_angle_out}, true);
  }
  void store_entering_grads(int l) {
    copy_states(l, de_,
                {LBuf::d_ssm_state, LBuf::d_k_state, LBuf::d_v_state, LBuf::d_angle_state}, false);
  }

  // ---- one stage ----------------------------------------------------------------------------
  bool capturing() const { return cap_ != nullptr || store_all_; }
  void before(StageId s, int l, Dir dir) {
    if (iso_) isolated_before(s, l, dir);
  }
  // After a stage: a negative control's fault, the profiler's mark, the capture; in the
  // isolated mode the oracle's values back in place.
  void after(StageId s, int l, Dir dir) {
    if (fault_ != Fault::None && l == fault_layer_ &&
        std::strcmp(stage_name(s), fault_stage(fault_)) == 0)
      apply_fault(l);
    if (l < 0 && dir == Dir::Backward) {
      mark(std::string(stage_name(s)) + " (bwd)");
    } else {
      mark(stage_name(s));
    }
    capture(cap_, l, stage_name(s), dir);
    if (iso_) isolated_after(s, l, dir);
  }
  // A pseudo-stage: its place in the profile, the capture of its tensors (written by F5/F6,
  // B6/B5a or B4b before it).
  void pseudo(StageId s, int l, Dir dir) {
    before(s, l, dir);
    after(s, l, dir);
  }
  template <StageId s>
  void forward(Stage<s>, int l) {
    layer_forward_stage(l, s, capturing());
  }
  template <StageId s>
  void backward(Stage<s>, int l) {
    layer_backward_stage(l, s, capturing());
  }
  void forward(Stage<StageId::input_proj>, int) { input_proj_forward(); }
  void backward(Stage<StageId::input_proj>, int) { input_proj_backward(); }
  void forward(Stage<StageId::norm_f>, int) { norm_f_forward(); }
  void backward(Stage<StageId::norm_f>, int) {
    norm_f_backward();
    if (!iso_) bb_.view(BBuf::delta, bb_.at(BBuf::d_norm));
  }
  void forward(Stage<StageId::head>, int) { head_forward(); }
  void backward(Stage<StageId::head>, int) { head_backward(); }
  void forward(Stage<StageId::loss>, int) { loss_stage(); }

  void input_proj_forward();
  // The norm that reads layer `prev`'s output u (a view of its layer_output): F1 of layer
  // prev + 1, or norm_f. When the pass leaves F8's residual add to the next norm, u = residual
  // + out_flat is formed and stored here, in the same pass (rmsnorm_forward_add).
  void norm_of_output(int prev, float* u, const float* w, T* y, float* rms);
  void norm_f_forward();
  // ---- the language-model ends (TRAINING.md §1) ----
  // head: logits = Out · head_w (typed).
  void head_forward();
  // loss: lse per row and Σ w·(lse − logit[tgt]) in f64; loss/value = float(Σ / N) on the
  // device; Σ copied into pinned host memory without waiting (loss() waits for it).
  void loss_stage();
  // head (bwd): d_logits of loss_scale_·loss (typed); d_Out = d_logits · head_wᵀ in f32
  // (norm_f's dOut, f32 as without a head); head_w's gradient accumulated. In the production
  // layout the GEMM writes d_out itself (head/d_Out is its view); the verification layout keeps
  // head/d_Out for the capture and copies it into d_out.
  void head_backward();
  void norm_f_backward();
  void input_proj_backward();

  // Production fusions across registry stages (set_fusion; never in run_isolated, which feeds
  // each stage the oracle's inputs): F4's bias add recomputed inside F4ef and B6 instead of
  // b/c_biased being stored and read back; in the chunked mode F6's K0/K1 done inside F4ef
  // (k then stored at t = T − 1 only) and B4b's head sums and bias gradients done in B6's
  // tail; F8's residual add done by the next norm; δ's typed copy for B8 made by the B1 that
  // wrote δ.
  bool fused() const { return fusion_ && !isolated_; }
  // Which of them a pass makes, fixed when the pass starts (plan_fusion): a stage that leaves
  // part of its work to a later one and that later stage read the same plan.
  struct FusionPlan {
    bool prep_in_f4ef = false;      // chunked: F6's K0/K1 run inside F4ef
    bool tail_in_b6 = false;        // chunked: B4b's head sums and bias gradients in B6's tail
    bool add_in_next_norm = false;  // F8's residual add by the next norm (not for a capture)
  };
  void plan_fusion() {
    const bool chunked = mode_ == ScanMode::Chunked;
    fuse_ = {fused() && chunked, fused() && chunked, fused() && !capturing()};
  }

  // The launchers' parameter structs are filled by name: each field is the registry tensor (or
  // parameter, gradient, state buffer) of the same name, so a wrong pairing reads as one.
  SsmChunkFwd<T> chunked_fwd_args(int l, bool prep_done);

  RopePrep<T> rope_prep_args(int l, bool k_all);

  // capturing: the registry's b/c_biased must be stored even when their readers recompute them.
  void layer_forward_stage(int l, StageId st, bool capturing);

  // Recompute::Scan, production layout: the chunked scan's prep (q, Ks, qk·γ, scale, γ, and k
  // at t = T − 1) and its chunk states (cumsums, entering states) again, into the workspace,
  // by the forward's kernels on the forward's saved inputs — the same bits the forward wrote.
  // (Overlapping it with the GEMMs of B8/B7 and the layer above on a second stream was tried:
  // 8.19–8.32 ms against 8.25 ms forward+backward at the official shape, no gain — the GEMMs
  // hold every SM — so it runs in line.)
  void recompute_scan(int l);

  // B6 in the sequential mode: the BPTT scan, the RoPE backward, the α/β/γ glue.
  void seq_b6(int l);

  // B6 in the chunked mode. Production: B4b's head sums and bias gradients come out of B6's
  // tail, which also recomputes b/c_biased, k and q instead of reading them (stages.cuh
  // SsmChunkBwd); capturing: the registry's d_b/c_pre_rope are stored even then.
  void chunked_b6(int l, bool capturing);

  // capturing: the registry's d_b/c_pre_rope must be stored even when the tail is fused.
  void layer_backward_stage(int l, StageId st, bool capturing);

  void apply_fault(int l);  // verify/backbone_verify.cu

  // ---- capture, isolated-mode restore ---------------------------------------------------------
  NamedBuf& buffer_of(int layer, const char* stage, const char* tensor) {
    return layer >= 0 ? layers_[layer].at(tensor) : bb_.at(backbone_name(stage, tensor));
  }
  void capture(Capture* cap, int layer, const char* stage, Dir dir);  // verify/backbone_verify.cu
  static const float* oracle_data(const Capture& oracle, const std::string& key) {
    static thread_local std::vector<float> tmp;
    const Tensor& t = oracle.at(key);
    tmp.assign(t.data.begin(), t.data.end());
    return tmp.data();
  }
  void restore(const Capture& oracle, const KeyedSpec& ks);  // verify/backbone_verify.cu

  // ---- stage profile (verify/stage_profiler) -------------------------------------------------
  void mark(const std::string& stage) { profiler_.mark(stage); }
  void collect_marks() { profiler_.collect(); }

  // ---- host helpers ---------------------------------------------------------------------------
  std::vector<float> download(const NamedBuf& b) {
    std::vector<float> h(static_cast<size_t>(b.n));
    download_floats(b, h.data(), storage(), s_);
    return h;
  }
  void zero_states(StateArrays& a) {
    for (DeviceArray<float>* b : {&a.ssm, &a.k, &a.v, &a.angle}) b->zero(s_);
  }
  void upload_states(const States<float>& st, StateArrays& a, const char* what) {
    auto put = [&](const std::vector<float>& h, DeviceArray<float>& b, const char* name) {
      M3_REQUIRE(static_cast<Idx>(h.size()) == b.size(), what,
                 std::string(name) + " state has the wrong size", "got ", h.size(),
                 ", expected ", b.size());
      b.upload(h.data(), s_);
    };
    put(st.ssm, a.ssm, "ssm");
    put(st.k, a.k, "k");
    put(st.v, a.v, "v");
    put(st.angle, a.angle, "angle");
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
  }
  States<float> download_states(const StateArrays& a) {
    States<float> st;
    std::vector<float>* host[4] = {&st.ssm, &st.k, &st.v, &st.angle};
    const DeviceArray<float>* dev[4] = {&a.ssm, &a.k, &a.v, &a.angle};
    for (int i = 0; i < 4; ++i) {
      host[i]->resize(static_cast<size_t>(dev[i]->size()));
      dev[i]->download(host[i]->data(), s_);
    }
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
    return st;
  }

  GpuContext& ctx_;
  Config cfg_;
  ref::Dims d_;
  ScanMode mode_;
  Recompute rc_;
  cudaStream_t s_;
  // ---- token inputs: the host's work and the copies (set_tokens, set_targets, staging) ----
  void check_token_model(const char* where) const;
  // The embedding backward's order of tok (ref::embed_order, which checks every token's range):
  // perm [B*T] the rows sorted by token then r; chunks EmbedChunk triples (token, begin, end)
  // of at most kEmbedChunk rows; token_chunks [V + 1] each token's first chunk. Returns the
  // number of chunks.
  Idx order_tokens(const char* where, const std::vector<std::int32_t>& tok, std::int32_t* perm,
                   std::int32_t* chunks, std::int32_t* token_chunks) const;
  void check_targets(const char* where, const std::vector<std::int32_t>& tgt,
                     const std::vector<float>& w, double n_norm) const;
  void upload_tokens(const std::int32_t* tok, const std::int32_t* perm, const std::int32_t* chunks,
                     const std::int32_t* token_chunks, Idx n_chunks);
  void upload_targets(const std::int32_t* tgt, const float* w, double n_norm);

  std::vector<LayerBufs> layers_;
  BackboneBufs bb_;
  std::vector<Idx> param_off_;  // [(layer + 1) · Prm::kCount + Prm]: the offset, −1 if none
  bool full_ = false;  // the verification layout (every tensor its own buffer in every layer)
  std::map<std::string, DeviceArray<unsigned char>> ws_;  // the shared workspace buffers
  ParamLayout layout_;
  DeviceArray<float> params_, grads_;  // the flat arenas (f32 masters, gradients)
  DeviceArray<T> typed_;               // the typed GEMM weight copies (T ≠ float)
  DeviceArray<unsigned char> segments_;  // CopySegment[n_segments_] on the device
  int n_segments_ = 0;
  Idx max_segment_ = 0;
  std::vector<Idx> w_in_off_, w_out_off_;  // offsets into typed_
  Idx w_input_off_ = 0, w_head_off_ = 0;
  // Token models (vocab_size > 0): tokens, targets and weights, the embedding backward's order
  // (perm: rows sorted by token then r; chunks_: EmbedChunk[n_chunks_]; token_chunks_ [V + 1]),
  // its stage-1 partials, the loss's per-row terms and sum, the argmax.
  bool tokens_ = false, targets_ = false, have_loss_ = false;
  double n_norm_ = 0, loss_scale_ = 1.0;
  // The loss's sum, copied to the host asynchronously (pinned), and the event after the copy.
  template <class E>
  struct Pinned {  // page-locked host memory (a copy from it does not make the host wait)
    E* p = nullptr;
    Pinned() = default;
    explicit Pinned(Idx n) { resize(n); }
    void resize(Idx n) {
      if (p) cudaFreeHost(p);
      p = nullptr;
      M3_CUDA_CHECK(cudaMallocHost(&p, static_cast<size_t>(std::max<Idx>(n, 1)) * sizeof(E)));
      std::fill(p, p + std::max<Idx>(n, 1), E{});
    }
    ~Pinned() {
      if (p) cudaFreeHost(p);
    }
    Pinned(const Pinned&) = delete;
    Pinned& operator=(const Pinned&) = delete;
  };
  Pinned<double> loss_host_{1};
  struct Event {
    cudaEvent_t e = nullptr;
    Event() { M3_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
    ~Event() { cudaEventDestroy(e); }
    Event(const Event&) = delete;
    Event& operator=(const Event&) = delete;
  } loss_ready_;
  Idx n_chunks_ = 0;
  DeviceArray<std::int32_t> tok_, tgt_, perm_, chunks_, token_chunks_, argmax_;
  // set_tokens' host arrays (pageable), and stage_batch's two pinned slots: a slot's batch is
  // staged (prepared, not yet uploaded) or copying (uploaded; its copies end at `copied`).
  std::vector<std::int32_t> plain_perm_, plain_chunks_, plain_token_chunks_;
  struct HostSlot {
    Pinned<std::int32_t> tok, perm, chunks, token_chunks, tgt;
    Pinned<float> w;
    Idx n_chunks = 0;
    double n_norm = 0;
    bool staged = false, copying = false;
    Event copied;
  };
  HostSlot slots_[2];
  int next_slot_ = 0;
  DeviceArray<float> tw_, embed_partial_;
  DeviceArray<double> row_loss_, loss_sum_;
  StateArrays st_;  // the states: entering before forward(), leaving after it
  StateArrays st0_;  // the entering states set last (repeat_digests reruns from them)
  bool store_all_ = false;  // repeat_digests: every stage stores what a Capture would read
  bool repeated_ = false;   // a repeat_digests run left every key's buffer readable
  StateArrays dl_;  // ∂L/∂(leaving states), set_leaving_grads
  DeviceArray<unsigned char> digest_segs_;  // repeat_digests: DigestSegment[n] on the device
  DeviceArray<std::uint64_t> digests_;
  StateArrays de_;  // ∂L/∂(entering states), from the last backward
  DeviceArray<float> scratch_;
  bool have_forward_ = false;
  Fault fault_ = Fault::None;
  int fault_layer_ = 0;
  bool fusion_ = true;           // set_fusion
  bool cluster_tail_ = false;    // set_cluster_tail
  const float* delta_typed_of_ = nullptr;  // δ's typed copy is of this buffer (B1 made it)
  bool isolated_ = false;        // inside run_isolated
  FusionPlan fuse_;              // the pass's fusions (plan_fusion)
  StageProfiler profiler_{s_};
  std::vector<StageEntry> table_;  // the registry's stage table of the run (what stages read)
  ChainPlan plan_;                 // the stages of the run, in order
  Capture* cap_ = nullptr;         // the pass's capture, or none
  IsolatedPass* iso_ = nullptr;    // inside run_isolated: its oracle and state
};

}  // namespace detail

}  // namespace m3::gpu
