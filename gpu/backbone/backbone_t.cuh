// Internal to gpu/backbone and gpu/verify: BackboneT<T>, the storage-typed implementation of
// GpuBackbone (backbone_gpu.cu has the whole story: the stage chain, the two layouts, the
// arenas), and the named device buffers it keeps. Production members are defined here; the
// verification members — the capture of a stage's tensors, the isolated mode's restore and its
// poisoned variant, the negative controls' faults, the test poisons — are declared here and
// defined in gpu/verify/backbone_verify.cu, beside the production path.
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

// Device buffers of one scope (a layer, or the backbone), by tensor name. Every name a stage
// may ask for is added (with n = 0 when the run has no such tensor), so an unknown name is a
// programming error and throws instead of reading as a null pointer.
class Buffers {
 public:
  NamedBuf& add(const std::string& name, Idx n, std::size_t elem, Life life = Life::Saved) {
    NamedBuf& b = m_[name];
    b.elem = elem;
    b.n = n;
    b.life = life;
    return b;
  }
  // nullptr when the run has no such tensor. Asking for the wrong element type (a typed tensor
  // as float, or the reverse), or for a tensor without a buffer in this layout, is an m3::Error.
  template <class U>
  U* get(const std::string& name) {
    NamedBuf& b = at(name);
    if (b.n == 0) return nullptr;
    M3_REQUIRE(b.elem == sizeof(U), "GpuBackbone",
               "buffer '" + name + "' accessed with the wrong storage type",
               "element size ", b.elem, ", asked ", sizeof(U));
    M3_REQUIRE(b.data() != nullptr, "GpuBackbone",
               "tensor '" + name + "' has no buffer in the production layout",
               "its lifetime is '", life_name(b.life),
               "' but a production stage uses it: list it as saved or workspace in "
               "reference/registry.cpp (kLife)");
    return reinterpret_cast<U*>(b.data());
  }
  float* f(const std::string& name) { return get<float>(name); }
  // `name` reads and writes `target`'s storage (same element size and count) until unview.
  void view(const std::string& name, NamedBuf& target) {
    NamedBuf& b = at(name);
    M3_REQUIRE(b.elem == target.elem && b.n == target.n, "GpuBackbone",
               "buffer '" + name + "' cannot view a buffer of another shape", "");
    b.viewed = target.data();
  }
  void unview(const std::string& name) { at(name).viewed = nullptr; }
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
  virtual std::vector<float> logits() = 0;
  virtual std::vector<std::int32_t> argmax() = 0;
};

namespace detail {

template <class T>
class BackboneT final : public GpuBackbone::Impl {
  friend struct m3::ChainAccess;

 public:
  BackboneT(GpuContext& c, const Config& cf, Idx B, Idx T_, ScanMode m, Recompute rc)
      : ctx_(c), cfg_(cf), d_(ref::Dims::of(cf, B, T_, precision_of<T>())), mode_(m), rc_(rc),
        s_(stream_of(c)) {
    layers_.resize(static_cast<size_t>(cf.n_layers));
    const StateSizes z = state_sizes(cf);
    // Every registry tensor of the run (n = 0 where the run has none), with its lifetime.
    for (const auto& spec : stage_registry()) {
      const Idx n = exists_in(spec, cf, m) ? shape_numel(resolve_shape(spec.shape, cf, B, T_)) : 0;
      const std::size_t elem = spec.typed ? sizeof(T) : sizeof(float);
      if (spec.scope == Scope::Layer) {
        const Life life = layer_life(spec);
        for (auto& L : layers_) L.add(spec.tensor, n, elem, life);
      } else {
        // Backbone tensors exist once per run: all kept, norm_f's input a view of the last
        // layer's output and the head's d_Out a view of d_out, the backbone's output gradient
        // (each its own buffer in the verification layout).
        const std::string tensor = spec.tensor, stage = spec.stage;
        const bool view = tensor == "norm_f_input" || (stage == "head" && tensor == "d_Out");
        bb_.add(backbone_name(spec.stage, spec.tensor), n, elem, view ? Life::View : Life::Saved);
      }
    }
    // Per layer, beyond the registry: the entering states (the backward reads k_in, v_in) and
    // the gradients wrt the leaving states.
    for (auto& L : layers_) {
      for (const char* nm : {"ssm_in", "d_ssm_out"}) L.add(nm, B * z.ssm, 4);
      for (const char* nm : {"k_in", "d_k_out"}) L.add(nm, B * z.k, 4);
      for (const char* nm : {"v_in", "d_v_out"}) L.add(nm, B * z.v, 4);
      for (const char* nm : {"angle_in", "d_angle_out"}) L.add(nm, B * z.angle, 4);
    }
    bb_.add("d_out", d_.BT * d_.dm, 4);
    bb_.add("delta", d_.BT * d_.dm, 4, Life::View);  // δ: a view of the buffer that made it
    bb_.add("delta_typed", d_.BT * d_.dm, sizeof(T));
    table_ = stage_table(cf, m);
    plan_ = ChainPlan::of(cf, m);
    // The flat arenas: f32 masters and gradients in param_layout order; the typed GEMM weight
    // copies in one buffer of T, one segment per weight (refresh_typed_copies: one launch).
    layout_ = m3::param_layout(cf);
    check_fits();
    lay_out();
    params_.resize(layout_.total);
    grads_.resize(layout_.total);
    params_.zero(s_);
    if constexpr (!std::is_same_v<T, float>) {
      std::vector<CopySegment> segs;
      Idx off = 0;
      auto segment = [&](int l, const char* name) {
        const ParamSlot& sl = layout_.at(l, name);
        segs.push_back({sl.offset, off, sl.size});
        max_segment_ = std::max(max_segment_, sl.size);
        const Idx at = off;
        off += (sl.size + 127) / 128 * 128;  // 256-byte aligned copies
        return at;
      };
      for (int l = 0; l < static_cast<int>(cf.n_layers); ++l) {
        w_in_off_.push_back(segment(l, "in_proj_w"));
        w_out_off_.push_back(segment(l, "out_proj_w"));
      }
      if (!cf.input_proj_identity) w_input_off_ = segment(-1, "input_proj_w");
      if (cf.vocab_size > 0) w_head_off_ = segment(-1, "head_w");
      typed_.resize(off);
      segments_.resize(static_cast<Idx>(segs.size() * sizeof(CopySegment)));
      M3_CUDA_CHECK(cudaMemcpyAsync(segments_.data(), segs.data(), segs.size() * sizeof(CopySegment),
                                    cudaMemcpyHostToDevice, s_));
      n_segments_ = static_cast<int>(segs.size());
    }
    const Idx LB = cf.n_layers * B;
    for (StateArrays* a : {&st_, &st0_, &dl_, &de_}) {
      a->ssm.resize(LB * z.ssm);
      a->k.resize(LB * z.k);
      a->v.resize(LB * z.v);
      a->angle.resize(LB * z.angle);
    }
    scratch_.resize(scratch_need());
    if (cf.vocab_size > 0) {  // the token model's inputs and the embedding backward's order
      const Idx BT = d_.BT, V = cf.vocab_size;
      tok_.resize(BT);
      tgt_.resize(BT);
      tw_.resize(BT);
      perm_.resize(BT);
      const Idx max_chunks = BT / kEmbedChunk + V;
      chunks_.resize(max_chunks * 3);
      token_chunks_.resize(V + 1);
      embed_partial_.resize(max_chunks * d_.dm);
      row_loss_.resize(BT);
      loss_sum_.resize(1);
      argmax_.resize(BT);
    }
    zero_states(dl_);
    grads_.zero(s_);
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
  }

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
  Life layer_life(const TensorSpec& spec) const {
    const std::string t = spec.tensor;
    // The chunked tail's fused head sums make d_b/c_pre_rope verification-only.
    if (mode_ == ScanMode::Chunked && (t == "d_b_pre_rope" || t == "d_c_pre_rope"))
      return Life::Verify;
    // B6's tail fused into B3 (cluster tail) keeps dQ_mid and dK_mid on chip.
    if (cluster_tail() && (t == "dQ_mid" || t == "dK_mid")) return Life::Verify;
    return lifetime(spec, mode_, rc_);
  }
  bool lean() const { return !full_; }
  // The registry spec of a layer tensor by its (unique) name.
  static const TensorSpec& layer_spec(const std::string& name) {
    for (const auto& s : stage_registry())
      if (s.scope == Scope::Layer && name == s.tensor) return s;
    throw Error("GpuBackbone", "no layer tensor '" + name + "'", "not in the stage registry");
  }
  // A layer tensor's row stride for the kernels: its tensor's row width when it is a column view
  // in this layout (ld), else 0 (contiguous rows).
  Idx ld_of(int l, const char* name) { return layers_[l].at(name).ld; }
  bool column_views(int l) { return ld_of(l, "x") != 0; }
  // Fused runs in the production layout: B5b and B5a write d_proj's f32 columns themselves
  // (split_f32_cols), so that B3 has nothing left to move and is not launched. Isolated runs
  // keep B3, which then moves the f32 parts the oracle restored.
  bool proj_grads_direct(int l) { return fused() && column_views(l); }
  // The one row stride a kernel takes for a tensor and its gradient (x and d_x, z and d_z:
  // proj and d_proj have the same rows).
  Idx shared_ld(int l, const char* name, const char* grad) {
    const Idx ld = ld_of(l, name);
    M3_REQUIRE(ld_of(l, grad) == ld, "GpuBackbone",
               std::string(name) + " and " + grad + " differ in layout", "");
    return ld;
  }
  // b/c_raw and d_b/c_raw share one row stride in the BCNorm kernels.
  Idx raw_ld(int l) {
    const Idx ld = shared_ld(l, "b_raw", "d_b_raw");
    M3_REQUIRE(shared_ld(l, "c_raw", "d_c_raw") == ld, "GpuBackbone",
               "b_raw and c_raw differ in layout", "");
    return ld;
  }
  // Before allocating: the production layout's bytes (registry plan, the arenas, the scratch,
  // the backbone tensors) against the device's free memory — a clear message instead of a
  // cudaMalloc failure halfway, naming the policy that would fit.
  void check_fits() const {
    std::size_t free_b = 0, total_b = 0;
    M3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    auto need = [&](Recompute rc) {
      const LayerBytes plan = layer_bytes(cfg_, d_.B, d_.T, mode_, precision_of<T>(), rc);
      std::size_t n = static_cast<std::size_t>(cfg_.n_layers) * plan.saved + plan.view +
                      plan.workspace + 4 * static_cast<std::size_t>(scratch_need()) +
                      12 * static_cast<std::size_t>(layout_.total);
      for (const auto& [name, b] : bb_.all()) n += b.nbytes();
      return n;
    };
    const std::size_t mine = need(rc_);
    if (mine <= free_b) return;
    const double gib = 1024.0 * 1024.0 * 1024.0;
    std::string why = "needs about " + std::to_string(mine / gib).substr(0, 6) + " GiB, " +
                      std::to_string(free_b / gib).substr(0, 6) + " GiB are free";
    if (mode_ == ScanMode::Chunked && rc_ == Recompute::None)
      why += "; with the scan recomputed (Recompute::Scan, m3h --recompute scan) about " +
             std::to_string(need(Recompute::Scan) / gib).substr(0, 6) + " GiB";
    throw Error("GpuBackbone", "the run does not fit the device's memory", why);
  }
  void lay_out() {
    for (auto& [name, b] : bb_.all()) {
      b.viewed = nullptr;
      const bool own = full_ || b.life != Life::View;
      if (b.n > 0 && own && b.bytes.size() == 0) b.bytes.resize(static_cast<Idx>(b.nbytes()));
      if (!own) b.bytes.resize(0);
    }
    const int L = static_cast<int>(layers_.size());
    for (int l = 0; l < L; ++l)
      for (auto& [name, b] : layers_[l].all()) {
        b.viewed = nullptr;
        b.shared = nullptr;
        const bool own = full_ || b.life == Life::Saved || (b.life == Life::View && l == 0);
        if (b.n == 0 || !own) b.bytes.resize(0);
        if (b.n > 0 && own && b.bytes.size() == 0) b.bytes.resize(static_cast<Idx>(b.nbytes()));
        b.ld = 0;
        if (b.n == 0 || own || b.life != Life::Workspace) continue;
        const bool on_d_norm = name == "d_temporal" && (L - 1 - l) % 2 == 1;
        b.shared = on_d_norm ? bb_.at("norm_f/d_norm").data() : workspace(name, b.nbytes());
      }
    // Column views (production layout), once their tensors have storage: z, x at proj's
    // columns 0 and di, d_z, d_x at d_proj's (registry column_view), read with its row stride.
    if (!full_)
      for (int l = 0; l < L; ++l)
        for (auto& [name, b] : layers_[l].all()) {
          if (b.n == 0 || b.life != Life::Columns) continue;
          const ColumnView cv = column_view(layer_spec(name), cfg_);
          NamedBuf& of = layers_[l].at(cv.tensor);
          M3_REQUIRE(of.data() != nullptr && of.n % d_.BT == 0 && b.n % d_.BT == 0 &&
                         cv.first + b.n / d_.BT <= of.n / d_.BT && of.elem == b.elem,
                     "GpuBackbone", "column view '" + name + "' does not fit '" + cv.tensor + "'",
                     "");
          b.viewed = of.data() + static_cast<std::size_t>(cv.first) * b.elem;
          b.ld = of.n / d_.BT;
        }
    if (full_) ws_.clear();
    have_forward_ = false;
  }
  unsigned char* workspace(const std::string& name, std::size_t bytes) {
    DeviceArray<unsigned char>& a = ws_[name];
    if (a.size() == 0) a.resize(static_cast<Idx>(bytes));
    return a.data();
  }
  // To the verification layout (once; buffers that already hold values keep them).
  void ensure_full() {
    if (full_) return;
    full_ = true;
    lay_out();  // the values of workspace tensors are gone: a backward needs a new forward
  }
  Recompute recompute() const override { return rc_; }
  void set_recompute(Recompute rc) override {
    if (rc == rc_) return;
    rc_ = rc;
    relayout();
  }
  // After a switch that changes layer_life: every layer tensor's lifetime again, and the layout
  // for them (the workspace's values are gone).
  void relayout() {
    for (auto& L : layers_)
      for (const auto& spec : stage_registry())
        if (spec.scope == Scope::Layer) L.at(spec.tensor).life = layer_life(spec);
    ws_.clear();
    lay_out();
  }
  // The chunked B6 with its tail in B3 (SsmChunkBwd::cluster_tail) where the shape allows it.
  bool cluster_tail() const override {
    return mode_ == ScanMode::Chunked && cluster_tail_ && ssm_chunked_cluster_tail<T>(d_);
  }
  // The scratch of every stage (reduce.cu scratch_floats), and the cluster tail's partials
  // after the chunked backward's own when it runs.
  Idx scratch_need() const {
    Idx n = scratch_floats(d_);
    if (cluster_tail())
      n = std::max(n, ssm_chunked_scratch_floats(d_) + ssm_chunked_cluster_scratch_floats(d_));
    return n;
  }
  void set_cluster_tail(bool on) override {
    if (on == cluster_tail_) return;
    cluster_tail_ = on;
    scratch_.resize(scratch_need());
    relayout();
  }
  bool verification_layout() const override { return full_; }
  BackboneMemory memory() const override {
    BackboneMemory m;
    for (size_t l = 0; l < layers_.size(); ++l) {
      std::size_t own = 0;
      for (const auto& [name, b] : layers_[l].all())
        own += static_cast<std::size_t>(b.bytes.size());
      m.layers.push_back(own);
    }
    for (const auto& [name, a] : ws_) m.workspace += static_cast<std::size_t>(a.size());
    for (const auto& [name, b] : bb_.all())
      m.backbone += static_cast<std::size_t>(b.bytes.size());
    m.params = 4 * static_cast<std::size_t>(params_.size() + grads_.size()) +
               sizeof(T) * static_cast<std::size_t>(typed_.size()) +
               static_cast<std::size_t>(segments_.size());
    for (const StateArrays* a : {&st_, &st0_, &dl_, &de_})
      m.states += 4 * static_cast<std::size_t>(a->ssm.size() + a->k.size() + a->v.size() +
                                               a->angle.size());
    m.scratch = 4 * static_cast<std::size_t>(scratch_.size());
    for (const DeviceArray<std::int32_t>* a : {&tok_, &tgt_, &perm_, &chunks_, &token_chunks_, &argmax_})
      m.tokens += 4 * static_cast<std::size_t>(a->size());
    m.tokens += 4 * static_cast<std::size_t>(tw_.size() + embed_partial_.size()) +
                8 * static_cast<std::size_t>(row_loss_.size() + loss_sum_.size());
    m.digests = static_cast<std::size_t>(digest_segs_.size()) +
                8 * static_cast<std::size_t>(digests_.size());
    return m;
  }
  // NaN into a tensor's buffer (all bits set: a quiet NaN in f32, bf16 and f16), or into every
  // workspace buffer with tensor "*workspace*".
  void poison_for_testing(int layer, const std::string& tensor) override;  // verify/backbone_verify.cu
  // m3h determinism at CI scale: the loaded run again from st0_, every tensor stored as for a
  // capture, then one device digest per key of repeat_digest_keys (verify/backbone_verify.cu).
  std::vector<std::uint64_t> repeat_digests(Capture* cap) override;

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
    NamedBuf& b = bb_.at("input_proj/input_proj_inputs");
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
  void set_tokens(const std::vector<std::int32_t>& tok) override {
    check_token_model("GpuBackbone::set_tokens");
    plain_perm_.resize(static_cast<size_t>(d_.BT));
    plain_chunks_.resize(chunks_.size());
    plain_token_chunks_.resize(token_chunks_.size());
    const Idx n_chunks = order_tokens("GpuBackbone::set_tokens", tok, plain_perm_.data(),
                                      plain_chunks_.data(), plain_token_chunks_.data());
    // No synchronisation: an asynchronous copy from pageable memory has taken the host data
    // when it returns, so the vectors may change; the kernels before it keep running meanwhile.
    upload_tokens(tok.data(), plain_perm_.data(), plain_chunks_.data(),
                  plain_token_chunks_.data(), n_chunks);
  }
  void set_targets(const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                   double n_norm) override {
    check_token_model("GpuBackbone::set_targets");
    check_targets("GpuBackbone::set_targets", tgt, w, n_norm);
    upload_targets(tgt.data(), w.data(), n_norm);  // pageable: taken when the copies return
  }
  void stage_batch(const std::vector<std::int32_t>& tok, const std::vector<std::int32_t>& tgt,
                   const std::vector<float>& w, double n_norm) override {
    // The checks of set_tokens and then set_targets, with their names; a failed stage leaves
    // nothing staged.
    check_token_model("GpuBackbone::set_tokens");
    const Idx BT = d_.BT;
    HostSlot& slot = slots_[next_slot_];
    if (!slot.tok.p) {  // first use: pinned arrays of the device arrays' sizes
      slot.tok.resize(BT);
      slot.perm.resize(BT);
      slot.chunks.resize(static_cast<Idx>(chunks_.size()));
      slot.token_chunks.resize(static_cast<Idx>(token_chunks_.size()));
      slot.tgt.resize(BT);
      slot.w.resize(BT);
    }
    if (slot.copying) M3_CUDA_CHECK(cudaEventSynchronize(slot.copied.e));  // its last copies
    slot.copying = false;
    slot.staged = false;
    slot.n_chunks = order_tokens("GpuBackbone::set_tokens", tok, slot.perm.p, slot.chunks.p,
                                 slot.token_chunks.p);
    check_targets("GpuBackbone::set_targets", tgt, w, n_norm);
    std::copy(tok.begin(), tok.end(), slot.tok.p);
    std::copy(tgt.begin(), tgt.end(), slot.tgt.p);
    std::copy(w.begin(), w.end(), slot.w.p);
    slot.n_norm = n_norm;
    slot.staged = true;
  }
  void upload_staged() override {
    HostSlot& slot = slots_[next_slot_];
    M3_REQUIRE(slot.staged, "GpuBackbone::upload_staged", "no staged batch",
               "stage_batch comes first (each staged batch is uploaded once)");
    upload_tokens(slot.tok.p, slot.perm.p, slot.chunks.p, slot.token_chunks.p, slot.n_chunks);
    upload_targets(slot.tgt.p, slot.w.p, slot.n_norm);
    M3_CUDA_CHECK(cudaEventRecord(slot.copied.e, s_));
    slot.copying = true;
    slot.staged = false;
    next_slot_ ^= 1;
  }
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
  std::vector<float> logits() override { return download(bb_.at("head/logits")); }
  std::vector<std::int32_t> argmax() override {
    M3_REQUIRE(have_loss_, "GpuBackbone::argmax", "argmax called before forward_loss", "");
    argmax_rows<T>(s_, d_.BT, cfg_.vocab_size, bb_.get<T>("head/logits"), argmax_.data());
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
    NamedBuf& b = bb_.at("d_out");
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

  std::vector<float> output() override { return download(bb_.at("norm_f/Out")); }
  std::vector<float> d_x() override { return download(bb_.at("input_proj/d_input_proj_dx")); }
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
    mark("start");
    delta_typed_of_ = nullptr;
    cap_ = cap;
    plan_fusion();
    chain_backward(*this, plan_);
    cap_ = nullptr;
    collect_marks();
  }

  Capture run_isolated(const Capture& oracle) override { return isolated_run(oracle, false); }
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

  // run_isolated's pass: each stage fed the oracle's values, its outputs captured into `out`
  // and then restored (verify/backbone_verify.cu).
  struct IsolatedPass {
    const Capture& oracle;
    Capture& out;
    bool poison_unread;
    std::vector<KeyedSpec> keys;  // every registry tensor of the run
    bool poisoned = false;        // the stage in flight ran with its unread tensors poisoned
  };
  void isolated_before(StageId s, int l, Dir dir);  // verify/backbone_verify.cu
  void isolated_after(StageId s, int l, Dir dir);   // verify/backbone_verify.cu
  void upload_oracle_delta(int l);                  // verify/backbone_verify.cu

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
  float* P(int l, const char* name) { return params_.data() + layout_.at(l, name).offset; }
  float* G(int l, const char* name) { return grads_.data() + layout_.at(l, name).offset; }
  const T* w_in(int l) {
    if constexpr (std::is_same_v<T, float>) return P(l, "in_proj_w");
    else return typed_.data() + w_in_off_[l];
  }
  const T* w_out(int l) {
    if constexpr (std::is_same_v<T, float>) return P(l, "out_proj_w");
    else return typed_.data() + w_out_off_[l];
  }
  const T* w_input() {
    if constexpr (std::is_same_v<T, float>) return P(-1, "input_proj_w");
    else return typed_.data() + w_input_off_;
  }
  const T* w_head() {
    if constexpr (std::is_same_v<T, float>) return P(-1, "head_w");
    else return typed_.data() + w_head_off_;
  }
  // The staged typed copy of δ for the GEMMs that read it (the reference's typed_copy): made
  // here, unless the B1 that wrote δ stored it already (delta_typed_of_: the f32 buffer that
  // B1's copy was made from, the same bits).
  const T* delta_typed() {
    if constexpr (std::is_same_v<T, float>) {
      return bb_.f("delta");
    } else {
      T* t = bb_.get<T>("delta_typed");
      if (delta_typed_of_ != bb_.f("delta"))
        convert<float, T>(s_, d_.BT * d_.dm, bb_.f("delta"), t);
      return t;
    }
  }

  // The four persistent states of every layer, [L][B][…] each (MODEL.md §9, §12.6).
  struct StateArrays {
    DeviceArray<float> ssm, k, v, angle;
  };
  // Copies layer l's [B, …] slices between a StateArrays and the layer's four buffers named
  // `names` (ssm, k, v, angle order): into the layer (to_layer) or out of it.
  void copy_states(int l, StateArrays& all, const std::array<const char*, 4>& names,
                   bool to_layer) {
    Buffers& L = layers_[l];
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
    copy_states(l, st_, {"ssm_in", "k_in", "v_in", "angle_in"}, true);
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
    Buffers& L = layers_[l];
    if (l > 0) {
      L.view("residual", layers_[l - 1].at("layer_output"));
    } else {
      convert<T, float>(s_, d_.BT * d_.dm, bb_.get<T>("input_proj/input_proj_outputs"),
                        L.f("residual"));
    }
    load_entering_states(l);
  }
  // The leaving states to their slices; norm_f reads the last layer's output in place.
  void leave_layer(int l) {
    if (iso_) return;
    copy_states(l, st_, {"ssm_state", "k_state", "v_state", "angle_state"}, false);
    if (l + 1 == plan_.n_layers) bb_.view("norm_f/norm_f_input", layers_[l].at("layer_output"));
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
    bb_.view("delta", layers_[l].at("d_temporal"));
  }
  void load_leaving_grads(int l) {
    copy_states(l, dl_, {"d_ssm_out", "d_k_out", "d_v_out", "d_angle_out"}, true);
  }
  void store_entering_grads(int l) {
    copy_states(l, de_, {"d_ssm_state", "d_k_state", "d_v_state", "d_angle_state"}, false);
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
    if (!iso_) bb_.view("delta", bb_.at("norm_f/d_norm"));
  }
  void forward(Stage<StageId::head>, int) { head_forward(); }
  void backward(Stage<StageId::head>, int) { head_backward(); }
  void forward(Stage<StageId::loss>, int) { loss_stage(); }

  void input_proj_forward() {
    T* x = bb_.get<T>("input_proj/input_proj_inputs");
    T* h0 = bb_.get<T>("input_proj/input_proj_outputs");
    if (tokens_) {  // the embedding (TRAINING.md §1): a row gather; the one-hot for a capture
      embed_forward<T>(s_, d_.BT, d_.dm, tok_.data(), w_input(), P(-1, "input_proj_b"), h0);
      if (full_) embed_one_hot<T>(s_, d_.BT, d_.in, tok_.data(), x);
      return;
    }
    if (cfg_.input_proj_identity) {
      copy_d2d(s_, h0, x, d_.BT * d_.dm);
    } else {
      gemm_forward<T>(ctx_, d_.BT, d_.in, d_.dm, x, w_input(), P(-1, "input_proj_b"), h0, scr());
    }
  }
  // The norm that reads layer `prev`'s output u (a view of its layer_output): F1 of layer
  // prev + 1, or norm_f. When the pass leaves F8's residual add to the next norm, u = residual
  // + out_flat is formed and stored here, in the same pass (rmsnorm_forward_add).
  void norm_of_output(int prev, float* u, const float* w, T* y, float* rms) {
    if (prev >= 0 && fuse_.add_in_next_norm) {
      Buffers& L = layers_[prev];
      rmsnorm_forward_add<T>(s_, d_.BT, d_.dm, L.f("residual"), L.get<T>("out_flat"), u, w, y,
                             rms);
    } else {
      rmsnorm_forward<T>(s_, d_.BT, d_.dm, u, w, y, rms);
    }
  }
  void norm_f_forward() {
    norm_of_output(static_cast<int>(cfg_.n_layers) - 1, bb_.f("norm_f/norm_f_input"),
                   P(-1, "norm_f_weight"), bb_.get<T>("norm_f/Out"), bb_.f("norm_f/norm_f_rms"));
  }
  // ---- the language-model ends (TRAINING.md §1) ----
  // head: logits = Out · head_w (typed).
  void head_forward() {
    gemm_forward<T>(ctx_, d_.BT, d_.dm, cfg_.vocab_size, bb_.get<T>("norm_f/Out"), w_head(),
                    nullptr, bb_.get<T>("head/logits"), scr());
  }
  // loss: lse per row and Σ w·(lse − logit[tgt]) in f64; loss/value = float(Σ / N) on the
  // device; Σ copied into pinned host memory without waiting (loss() waits for it).
  void loss_stage() {
    loss_forward<T>(s_, d_.BT, cfg_.vocab_size, bb_.get<T>("head/logits"), tgt_.data(),
                    tw_.data(), 1.0 / n_norm_, bb_.f("loss/lse"), row_loss_.data(),
                    loss_sum_.data(), bb_.f("loss/value"));
    M3_CUDA_CHECK(cudaMemcpyAsync(loss_host_.p, loss_sum_.data(), sizeof(double),
                                  cudaMemcpyDeviceToHost, s_));
    M3_CUDA_CHECK(cudaEventRecord(loss_ready_.e, s_));
  }
  // head (bwd): d_logits of loss_scale_·loss (typed); d_Out = d_logits · head_wᵀ in f32
  // (norm_f's dOut, f32 as without a head); head_w's gradient accumulated. In the production
  // layout the GEMM writes d_out itself (head/d_Out is its view); the verification layout keeps
  // head/d_Out for the capture and copies it into d_out.
  void head_backward() {
    const Idx V = cfg_.vocab_size;
    T* d_logits = bb_.get<T>("head/d_logits");
    loss_backward<T>(s_, d_.BT, V, bb_.get<T>("head/logits"), bb_.f("loss/lse"), tgt_.data(),
                     tw_.data(), loss_scale_ / n_norm_, d_logits);
    if (!full_) bb_.view("head/d_Out", bb_.at("d_out"));
    float* d_head = bb_.f("head/d_Out");
    gemm_backward_dx_f32<T>(ctx_, d_.BT, d_.dm, V, d_logits, w_head(), d_head);
    gemm_backward_dw<T>(ctx_, d_.BT, d_.dm, V, bb_.get<T>("norm_f/Out"), d_logits,
                        G(-1, "head_w"));
    if (d_head != bb_.f("d_out")) copy_d2d(s_, bb_.f("d_out"), d_head, d_.BT * d_.dm);
  }
  void norm_f_backward() {
    rmsnorm_backward<float>(s_, d_.BT, d_.dm, bb_.f("norm_f/norm_f_input"),
                            P(-1, "norm_f_weight"), bb_.f("norm_f/norm_f_rms"), bb_.f("d_out"),
                            bb_.f("norm_f/d_norm"), G(-1, "norm_f_weight"), scr());
  }
  void input_proj_backward() {
    T* dx = bb_.get<T>("input_proj/d_input_proj_dx");
    if (tokens_) {  // the GEMM's dW of a one-hot X: δ⁰'s typed rows summed per token
      const T* dt = delta_typed();
      embed_backward<T>(s_, cfg_.vocab_size, d_.dm, dt, perm_.data(),
                        reinterpret_cast<const EmbedChunk*>(chunks_.data()), n_chunks_,
                        token_chunks_.data(), embed_partial_.data(), G(-1, "input_proj_w"));
      colsum(s_, d_.BT, d_.dm, bb_.f("delta"), G(-1, "input_proj_b"), true, scr());
      // ∂L/∂(one-hot): nothing reads it; made for a capture only.
      if (full_) gemm_backward_dx<T>(ctx_, d_.BT, d_.in, d_.dm, dt, w_input(), dx);
      return;
    }
    if (cfg_.input_proj_identity) {
      convert<float, T>(s_, d_.BT * d_.dm, bb_.f("delta"), dx);
    } else {
      const T* dt = delta_typed();
      gemm_backward_dx<T>(ctx_, d_.BT, d_.in, d_.dm, dt, w_input(), dx);
      gemm_backward_dw<T>(ctx_, d_.BT, d_.in, d_.dm, bb_.get<T>("input_proj/input_proj_inputs"),
                          dt, G(-1, "input_proj_w"));
      colsum(s_, d_.BT, d_.dm, bb_.f("delta"), G(-1, "input_proj_b"), true, scr());
    }
  }

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
  SsmChunkFwd<T> chunked_fwd_args(int l, bool prep_done) {
    Buffers& L = layers_[l];
    auto t = [&](const char* n) { return L.get<T>(n); };
    auto f = [&](const char* n) { return L.f(n); };
    SsmChunkFwd<T> a{};
    a.x = t("x");
    a.k = t("k");
    a.q = t("q");
    a.dt = f("dt");
    a.trap = f("trap");
    a.a_val = f("a_val");
    a.d_param = P(l, "d_param");
    a.ssm_in = f("ssm_in");
    a.k_in = f("k_in");
    a.v_in = f("v_in");
    a.k_scaled_saved = t("k_scaled_saved");
    a.y = t("y");
    a.adt = f("adt");
    a.qk_dot_saved = f("qk_dot_saved");
    a.scale_saved = f("scale_saved");
    a.gamma_saved = f("gamma_saved");
    a.da_cumsum_saved = f("da_cumsum_saved");
    // Production: K2/K3 + K4/K6 as one chunk walk (its bits), the contributions kept in
    // registers — stored only in the verification layout (a capture compares them). Isolated
    // and unfused runs keep the two kernels, so that each stage still runs on its own.
    a.fuse_states = fused();
    a.chunk_states = fused() && lean() && ssm_chunked_walks<T>(d_) ? nullptr : f("chunk_states");
    a.chunk_states_saved = f("chunk_states_saved");
    a.final_states = f("final_states");
    a.ssm_out = f("ssm_state");
    a.k_out = f("k_state");
    a.v_out = f("v_state");
    a.prep_done = prep_done;
    a.ldx = ld_of(l, "x");
    return a;
  }

  RopePrep<T> rope_prep_args(int l, bool k_all) {
    Buffers& L = layers_[l];
    RopePrep<T> r{};
    r.b_normed = L.get<T>("b_normed");
    r.c_normed = L.get<T>("c_normed");
    r.b_bias = P(l, "b_bias");
    r.c_bias = P(l, "c_bias");
    r.theta = L.f("angle_cumsum");
    r.k = L.get<T>("k");
    r.q = L.get<T>("q");
    r.k_all = k_all;
    return r;
  }

  // capturing: the registry's b/c_biased must be stored even when their readers recompute them.
  void layer_forward_stage(int l, StageId st, bool capturing) {
    Buffers& L = layers_[l];
    auto t = [&](const char* n) { return L.get<T>(n); };
    auto f = [&](const char* n) { return L.f(n); };
    switch (st) {
    case StageId::F1: {
      // Layer 0's residual is H⁰, no layer's output: prev = −1 never has a pending add.
      norm_of_output(l - 1, f("residual"), P(l, "norm_weight"), t("post_norm"), f("rms_vals"));
      break;
    }
    case StageId::F2: {
      gemm_forward<T>(ctx_, d_.BT, d_.dm, d_.ip, t("post_norm"), w_in(l), nullptr, t("proj"));
      break;
    }
    case StageId::F3: {
      SplitFwd<T> a{};
      a.proj = t("proj");
      a.dt_bias = P(l, "dt_bias");
      // Column views (production): z, x, b_raw, c_raw stay in proj, read in place.
      const bool views = column_views(l);
      a.z = views ? nullptr : t("z");
      a.x = views ? nullptr : t("x");
      a.b_raw = views ? nullptr : t("b_raw");
      a.c_raw = views ? nullptr : t("c_raw");
      a.dd_dt_raw = f("dd_dt_raw");
      a.dd_a_raw = f("dd_a_raw");
      a.trap_raw = f("trap_raw");
      a.angles_raw = f("angles_raw");
      a.dt = f("dt");
      a.a_val = f("a_val");
      a.trap = f("trap");
      split_forward<T>(s_, d_, a);
      break;
    }
    case StageId::F4: {
      // b/c_biased are recomputed by their fused readers (F4ef, B6): stored for a capture only.
      const bool store = !fused() || capturing;
      BcnormFwd<T> a{};
      a.b_raw = t("b_raw");
      a.c_raw = t("c_raw");
      a.ldr = raw_ld(l);
      a.b_norm_weight = P(l, "b_norm_weight");
      a.c_norm_weight = P(l, "c_norm_weight");
      a.b_bias = P(l, "b_bias");
      a.c_bias = P(l, "c_bias");
      a.b_normed = t("b_normed");
      a.c_normed = t("c_normed");
      a.b_biased = store ? t("b_biased") : nullptr;
      a.c_biased = store ? t("c_biased") : nullptr;
      a.b_rms = f("b_rms");
      a.c_rms = f("c_rms");
      bcnorm_forward<T>(s_, d_, a);
      break;
    }
    case StageId::F5: {
      angle_forward(s_, d_, f("angles_raw"), f("dt"), f("angle_in"), f("angle_cumsum"),
                    f("angle_state"), scr());
      break;
    }
    case StageId::F4ef: {
      if (fused() && mode_ == ScanMode::Chunked) {
        // With F6's K0/K1 (which read k, q and would otherwise read them back): k is stored
        // at t = T − 1 only (k_out), or everywhere for a capture.
        ssm_chunked_rope_prep<T>(s_, d_, rope_prep_args(l, capturing), chunked_fwd_args(l, false));
      } else if (fused()) {
        rope_forward_normed<T>(s_, d_, f("angle_cumsum"), t("b_normed"), t("c_normed"),
                               P(l, "b_bias"), P(l, "c_bias"), t("k"), t("q"));
      } else {
        rope_forward<T>(s_, d_, f("angle_cumsum"), t("b_biased"), t("c_biased"), t("k"), t("q"));
      }
      break;
    }
    case StageId::F5b: {
      // α, β, γ feed the sequential scan only (the chunked prep forms γ itself): the fused
      // chunked path computes them for a capture only.
      if (mode_ == ScanMode::Sequential || !fused() || capturing)
        abg_forward(s_, d_, f("a_val"), f("dt"), f("trap"), f("alpha"), f("beta"), f("gamma"));
      break;
    }
    case StageId::F6: {
      if (mode_ == ScanMode::Sequential) {
        SsmSeqFwd<T> a{};
        a.x = t("x");
        a.k = t("k");
        a.q = t("q");
        a.alpha = f("alpha");
        a.beta = f("beta");
        a.gamma = f("gamma");
        a.d_param = P(l, "d_param");
        a.ssm_in = f("ssm_in");
        a.k_in = f("k_in");
        a.v_in = f("v_in");
        a.y = t("y");
        a.h_saved = f("h_saved");
        a.k_prev_saved = f("k_prev_saved");
        a.v_prev_saved = f("v_prev_saved");
        a.ssm_out = f("ssm_state");
        a.k_out = f("k_state");
        a.v_out = f("v_state");
        a.ldx = ld_of(l, "x");
        ssm_seq_forward<T>(s_, d_, a);
      } else {
        const bool prep_done = fuse_.prep_in_f4ef;  // K0/K1 ran with F4ef
        ssm_chunked_forward<T>(s_, d_, chunked_fwd_args(l, prep_done), scr());
      }
      break;
    }
    case StageId::F7: {
      gating_forward<T>(s_, d_, t("y"), t("z"), P(l, "norm_gate_weight"), t("gated"),
                        f("gated_rms_vals"), ld_of(l, "z"));
      break;
    }
    case StageId::F8: {
      gemm_forward<T>(ctx_, d_.BT, d_.di, d_.dm, t("gated"), w_out(l), nullptr, t("out_flat"));
      // layer_output = residual + out_flat: done by the next norm (layer l + 1's F1, or
      // norm_f) in the production path; here for a capture or the isolated mode.
      if (!fuse_.add_in_next_norm)
        add<T>(s_, d_.BT * d_.dm, f("residual"), t("out_flat"), f("layer_output"));
      break;
    }
    case StageId::input_proj: case StageId::states: case StageId::norm_f: case StageId::head:
    case StageId::loss: case StageId::B8: case StageId::B7: case StageId::B6: case StageId::B5a:
    case StageId::B5b: case StageId::B4b: case StageId::B4c: case StageId::B3: case StageId::B2:
    case StageId::B1: case StageId::d_states:
      break;  // states are written by F5 and F6
    }
  }

  // Recompute::Scan, production layout: the chunked scan's prep (q, Ks, qk·γ, scale, γ, and k
  // at t = T − 1) and its chunk states (cumsums, entering states) again, into the workspace,
  // by the forward's kernels on the forward's saved inputs — the same bits the forward wrote.
  // (Overlapping it with the GEMMs of B8/B7 and the layer above on a second stream was tried:
  // 8.19–8.32 ms against 8.25 ms forward+backward at the official shape, no gain — the GEMMs
  // hold every SM — so it runs in line.)
  void recompute_scan(int l) {
    ssm_chunked_rope_prep<T>(s_, d_, rope_prep_args(l, false), chunked_fwd_args(l, false));
    ssm_chunked_states<T>(s_, d_, chunked_fwd_args(l, true));
  }

  // B6 in the sequential mode: the BPTT scan, the RoPE backward, the α/β/γ glue.
  void seq_b6(int l) {
    Buffers& L = layers_[l];
    auto t = [&](const char* n) { return L.get<T>(n); };
    auto f = [&](const char* n) { return L.f(n); };
    SsmSeqBwd<T> a{};
    a.x = t("x");
    a.k = t("k");
    a.q = t("q");
    a.d_y = t("d_y");
    a.alpha = f("alpha");
    a.beta = f("beta");
    a.gamma = f("gamma");
    a.d_param = P(l, "d_param");
    a.h_saved = f("h_saved");
    a.k_prev_saved = f("k_prev_saved");
    a.v_prev_saved = f("v_prev_saved");
    a.d_ssm_out = f("d_ssm_out");
    a.d_k_out = f("d_k_out");
    a.d_v_out = f("d_v_out");
    a.d_x = t("d_x");
    a.d_k = f("d_k");
    a.d_q = f("d_q");
    a.d_alpha = f("d_alpha");
    a.d_beta = f("d_beta");
    a.d_gamma = f("d_gamma");
    a.d_d_local = f("d_d_local");
    a.d_ssm_in = f("d_ssm_state");
    a.d_k_in = f("d_k_state");
    a.d_v_in = f("d_v_state");
    a.d_d_param = G(l, "d_param");
    a.ldx = shared_ld(l, "x", "d_x");
    ssm_seq_backward<T>(s_, d_, a, scr());
    RopeBwd<T> r{};
    r.theta = f("angle_cumsum");
    r.dv1 = f("d_k");
    r.dv2 = f("d_q");
    r.rot1 = t("k");
    r.rot2 = t("q");
    r.dpre1 = f("d_b_pre_rope");
    r.dpre2 = f("d_c_pre_rope");
    r.dtheta = f("d_angle_cumsum");
    rope_backward<T>(s_, d_, r);
    AbgBwd g{};
    g.alpha = f("alpha");
    g.beta = f("beta");
    g.dt = f("dt");
    g.trap = f("trap");
    g.d_alpha = f("d_alpha");
    g.d_beta = f("d_beta");
    g.d_gamma = f("d_gamma");
    g.d_adt_total = f("d_adt_total");
    g.d_dt_direct = f("d_dt_direct");
    g.d_trap_sig = f("d_trap_sig");
    abg_backward(s_, d_, g);
  }

  // B6 in the chunked mode. Production: B4b's head sums and bias gradients come out of B6's
  // tail, which also recomputes b/c_biased, k and q instead of reading them (stages.cuh
  // SsmChunkBwd); capturing: the registry's d_b/c_pre_rope are stored even then.
  void chunked_b6(int l, bool capturing) {
    Buffers& L = layers_[l];
    auto t = [&](const char* n) { return L.get<T>(n); };
    auto f = [&](const char* n) { return L.f(n); };
    if (lean() && rc_ == Recompute::Scan) recompute_scan(l);
    const bool tail = fused();
    const bool store_pre = !tail || capturing;
    SsmChunkBwd<T> a{};
    a.fuse_states = fused();  // B1 + B2 as one chunk walk (their bits)
    a.ldx = shared_ld(l, "x", "d_x");
    a.x = t("x");
    a.k = t("k");
    a.q = t("q");
    a.k_scaled_saved = t("k_scaled_saved");
    a.d_y = t("d_y");
    a.theta = f("angle_cumsum");
    a.dt = f("dt");
    a.trap = f("trap");
    a.a_val = f("a_val");
    a.d_param = P(l, "d_param");
    a.qk_dot_saved = f("qk_dot_saved");
    a.scale_saved = f("scale_saved");
    a.gamma_saved = f("gamma_saved");
    a.da_cumsum_saved = f("da_cumsum_saved");
    a.chunk_states_saved = f("chunk_states_saved");
    a.k_in = f("k_in");
    a.v_in = f("v_in");
    a.d_ssm_out = f("d_ssm_out");
    a.d_k_out = f("d_k_out");
    a.d_v_out = f("d_v_out");
    a.da_cs_sum = f("da_cs_sum");
    // The cluster tail writes dQ_mid and dK_mid only for a capture (they are verification-only
    // in the production layout then).
    a.cluster_tail = fused() && cluster_tail();
    const bool mid = capturing || !a.cluster_tail;
    a.dQ_mid = mid ? f("dQ_mid") : nullptr;
    a.dK_mid = mid ? f("dK_mid") : nullptr;
    a.dADT = f("dADT");
    a.dQK_dot = f("dQK_dot");
    a.dD_partials = f("dD_partials");
    a.dScale = f("dScale");
    a.dGamma = f("dGamma");
    a.dDT = f("dDT");
    a.d_x = t("d_x");
    a.d_b_pre_rope = store_pre ? f("d_b_pre_rope") : nullptr;
    a.d_c_pre_rope = store_pre ? f("d_c_pre_rope") : nullptr;
    a.d_angle_cumsum = f("d_angle_cumsum");
    a.d_adt_total = f("d_adt_total");
    a.d_dt_direct = f("d_dt_direct");
    a.d_trap_sig = f("d_trap_sig");
    a.d_ssm_in = f("d_ssm_state");
    a.d_k_in = f("d_k_state");
    a.d_v_in = f("d_v_state");
    a.d_d_param = G(l, "d_param");
    if (fused()) {  // the tail recomputes the biased and rotated B, C from b/c_normed
      a.b_normed = t("b_normed");
      a.c_normed = t("c_normed");
      a.b_bias = P(l, "b_bias");
      a.c_bias = P(l, "c_bias");
    } else {
      a.b_biased = t("b_biased");
      a.c_biased = t("c_biased");
    }
    if (tail) {
      a.d_b_normed = t("d_b_normed");
      a.d_c_normed = t("d_c_normed");
      a.d_b_bias = G(l, "b_bias");
      a.d_c_bias = G(l, "c_bias");
    }
    ssm_chunked_backward<T>(s_, d_, a, scr());
  }

  // capturing: the registry's d_b/c_pre_rope must be stored even when the tail is fused.
  void layer_backward_stage(int l, StageId st, bool capturing) {
    Buffers& L = layers_[l];
    auto t = [&](const char* n) { return L.get<T>(n); };
    auto f = [&](const char* n) { return L.f(n); };
    switch (st) {
    case StageId::B8: {
      const T* dt = delta_typed();
      gemm_backward_dx<T>(ctx_, d_.BT, d_.di, d_.dm, dt, w_out(l), t("d_gated"));
      gemm_backward_dw<T>(ctx_, d_.BT, d_.di, d_.dm, t("gated"), dt, G(l, "out_proj_w"));
      break;
    }
    case StageId::B7: {
      GatingBwd<T> a{};
      a.y = t("y");
      a.z = t("z");
      a.d_gated = t("d_gated");
      a.norm_gate_weight = P(l, "norm_gate_weight");
      a.gated_rms_vals = f("gated_rms_vals");
      a.d_y = t("d_y");
      a.d_z = t("d_z");
      a.d_norm_gate_weight = G(l, "norm_gate_weight");
      a.ldz = shared_ld(l, "z", "d_z");
      gating_backward<T>(s_, d_, a, scr());
      break;
    }
    case StageId::B6: {
      mode_ == ScanMode::Sequential ? seq_b6(l) : chunked_b6(l, capturing);
      break;
    }
    case StageId::B5a: {
      AngleBwd a{};
      a.angles_raw = f("angles_raw");
      a.dt = f("dt");
      a.d_angle_cumsum = f("d_angle_cumsum");
      a.d_angle_out = f("d_angle_out");
      a.d_angles_raw = f("d_angles_raw");
      a.d_dt_angle = f("d_dt_angle");
      a.d_angle_in = f("d_angle_state");
      if (proj_grads_direct(l)) a.d_angles_raw_cols = split_f32_cols(d_, t("d_proj")).d_angles_raw;
      angle_backward(s_, d_, a, scr());
      break;
    }
    case StageId::B5b: {
      ActBwd a{};
      a.dd_dt_raw = f("dd_dt_raw");
      a.dd_a_raw = f("dd_a_raw");
      a.dt_bias = P(l, "dt_bias");
      a.dt = f("dt");
      a.a_val = f("a_val");
      a.trap = f("trap");
      a.d_adt_total = f("d_adt_total");
      a.d_dt_direct = f("d_dt_direct");
      a.d_dt_angle = f("d_dt_angle");
      a.d_trap_sig = f("d_trap_sig");
      a.d_dd_dt = f("d_dd_dt");
      a.d_dd_a = f("d_dd_a");
      a.d_trap_raw = f("d_trap_raw");
      a.d_dt_bias = G(l, "dt_bias");
      a.a_floor = cfg_.a_floor;
      if (proj_grads_direct(l)) a.into_proj(split_f32_cols(d_, t("d_proj")));
      activations_backward(s_, d_, a, scr());
      break;
    }
    case StageId::B4b: {  // B4b and B4c are one launcher (bias/heads→groups + BCNorm)
      const bool done = fuse_.tail_in_b6;  // B4b ran in B6's tail: B4c alone
      BcnormBwd<T> a{};
      a.b_raw = t("b_raw");
      a.c_raw = t("c_raw");
      a.ldr = raw_ld(l);
      a.b_norm_weight = P(l, "b_norm_weight");
      a.c_norm_weight = P(l, "c_norm_weight");
      a.b_rms = f("b_rms");
      a.c_rms = f("c_rms");
      a.d_b_pre_rope = done ? nullptr : f("d_b_pre_rope");
      a.d_c_pre_rope = done ? nullptr : f("d_c_pre_rope");
      a.d_b_normed = t("d_b_normed");
      a.d_c_normed = t("d_c_normed");
      a.d_b_raw = t("d_b_raw");
      a.d_c_raw = t("d_c_raw");
      a.d_b_norm_weight = G(l, "b_norm_weight");
      a.d_c_norm_weight = G(l, "c_norm_weight");
      a.d_b_bias = G(l, "b_bias");
      a.d_c_bias = G(l, "c_bias");
      bcnorm_backward<T>(s_, d_, a, scr());
      break;
    }
    case StageId::B3: {
      if (proj_grads_direct(l)) return;  // B7, B6, B4c, B5b and B5a wrote all of d_proj
      SplitBwd<T> a{};
      // Column views (production): B7, B6 and B4c wrote the typed parts into d_proj already.
      const bool views = column_views(l);
      a.d_z = views ? nullptr : t("d_z");
      a.d_x = views ? nullptr : t("d_x");
      a.d_b_raw = views ? nullptr : t("d_b_raw");
      a.d_c_raw = views ? nullptr : t("d_c_raw");
      a.d_dd_dt = f("d_dd_dt");
      a.d_dd_a = f("d_dd_a");
      a.d_trap_raw = f("d_trap_raw");
      a.d_angles_raw = f("d_angles_raw");
      a.d_proj = t("d_proj");
      split_backward<T>(s_, d_, a);
      break;
    }
    case StageId::B2: {
      gemm_backward_dx<T>(ctx_, d_.BT, d_.dm, d_.ip, t("d_proj"), w_in(l), t("d_norm"));
      gemm_backward_dw<T>(ctx_, d_.BT, d_.dm, d_.ip, t("post_norm"), t("d_proj"),
                          G(l, "in_proj_w"));
      break;
    }
    case StageId::B1: {
      // d_temporal = δ + d_pre_norm in the same kernel; d_pre_norm stored for a capture only
      // (both are B1's own outputs, so this holds in the isolated mode too).
      // Fused runs: δ's typed copy for the next layer's B8 too (delta_typed then converts
      // nothing; the isolated mode restores δ from the oracle between stages, so it converts).
      T* typed = nullptr;
      if constexpr (!std::is_same_v<T, float>)
        if (fused()) typed = bb_.get<T>("delta_typed");
      rmsnorm_backward<T>(s_, d_.BT, d_.dm, f("residual"), P(l, "norm_weight"), f("rms_vals"),
                          t("d_norm"), capturing ? f("d_pre_norm") : nullptr,
                          G(l, "norm_weight"), scr(), bb_.f("delta"), f("d_temporal"), typed);
      delta_typed_of_ = typed ? f("d_temporal") : nullptr;
      break;
    }
    case StageId::input_proj: case StageId::F1: case StageId::F2: case StageId::F3:
    case StageId::F4: case StageId::F5: case StageId::F4ef: case StageId::F5b: case StageId::F6:
    case StageId::F7: case StageId::F8: case StageId::states: case StageId::norm_f:
    case StageId::head: case StageId::loss: case StageId::B4c: case StageId::d_states:
      break;  // B4c runs with B4b; d_states is written by B6 and B5a
    }
  }

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
  void check_token_model(const char* where) const {
    M3_REQUIRE(cfg_.vocab_size > 0, where, "the config is no token model (vocab_size = 0)", "");
  }
  // The embedding backward's order of tok (ref::embed_order, which checks every token's range):
  // perm [B*T] the rows sorted by token then r; chunks EmbedChunk triples (token, begin, end)
  // of at most kEmbedChunk rows; token_chunks [V + 1] each token's first chunk. Returns the
  // number of chunks.
  Idx order_tokens(const char* where, const std::vector<std::int32_t>& tok, std::int32_t* perm,
                   std::int32_t* chunks, std::int32_t* token_chunks) const {
    M3_REQUIRE(static_cast<Idx>(tok.size()) == d_.BT, where, "tokens have the wrong size",
               "got ", tok.size(), ", expected B*T = ", d_.BT);
    const Idx V = cfg_.vocab_size;
    std::vector<Idx> order, starts;
    ref::embed_order(tok.data(), d_.BT, V, order, starts);
    for (Idx i = 0; i < d_.BT; ++i) perm[i] = static_cast<std::int32_t>(order[i]);
    Idx n = 0;
    for (Idx v = 0; v < V; ++v) {
      token_chunks[v] = static_cast<std::int32_t>(n);
      for (Idx a = starts[v]; a < starts[v + 1]; a += kEmbedChunk, ++n) {
        chunks[3 * n] = static_cast<std::int32_t>(v);
        chunks[3 * n + 1] = static_cast<std::int32_t>(a);
        chunks[3 * n + 2] = static_cast<std::int32_t>(std::min(a + kEmbedChunk, starts[v + 1]));
      }
    }
    token_chunks[V] = static_cast<std::int32_t>(n);
    return n;
  }
  void check_targets(const char* where, const std::vector<std::int32_t>& tgt,
                     const std::vector<float>& w, double n_norm) const {
    const Idx V = cfg_.vocab_size;
    M3_REQUIRE(static_cast<Idx>(tgt.size()) == d_.BT && static_cast<Idx>(w.size()) == d_.BT,
               where, "targets and weights must have B*T entries", "got ", tgt.size(), " and ",
               w.size(), ", expected ", d_.BT);
    M3_REQUIRE(n_norm > 0, where, "no scored position (N = 0): the loss is undefined", "N=",
               n_norm);
    for (Idx r = 0; r < d_.BT; ++r) {
      M3_REQUIRE(tgt[r] >= 0 && tgt[r] < V, where, "target outside the vocabulary", "row ", r,
                 ": target ", tgt[r], ", vocab_size ", V);
      M3_REQUIRE(std::isfinite(w[r]) && w[r] >= 0, where,
                 "a position weight is not finite and >= 0", "row ", r, ": ", w[r]);
    }
  }
  void upload_tokens(const std::int32_t* tok, const std::int32_t* perm, const std::int32_t* chunks,
                     const std::int32_t* token_chunks, Idx n_chunks) {
    tok_.upload(tok, s_);
    perm_.upload(perm, s_);
    M3_CUDA_CHECK(cudaMemcpyAsync(chunks_.data(), chunks, static_cast<size_t>(n_chunks) * 12,
                                  cudaMemcpyHostToDevice, s_));
    token_chunks_.upload(token_chunks, s_);
    n_chunks_ = n_chunks;
    tokens_ = true;
  }
  void upload_targets(const std::int32_t* tgt, const float* w, double n_norm) {
    tgt_.upload(tgt, s_);
    tw_.upload(w, s_);
    n_norm_ = n_norm;
    targets_ = true;
  }

  std::vector<Buffers> layers_;
  Buffers bb_;
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
