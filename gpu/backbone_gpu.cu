// GpuBackbone (see backbone_gpu.hpp): the reference's backbone (reference/backbone.cpp) with
// every stage a launcher of gpu/stages.cuh, in the same order:
//   forward : input_proj → per layer F1 F2 F3 F4 F5 F4ef F5b F6 F7 F8 (+ states) → norm_f
//   backward: norm_f → per layer (last first) B8 B7 B6 B5a B5b B4b/B4c B3 B2 B1 (+ d_states)
//             → input_proj
// The storage type T (float, __nv_bfloat16, __half) is dispatched ONCE, in the constructor;
// BackboneT<T> holds every buffer. Buffers are named exactly as the stage registry names the
// tensors (reference/registry.cpp) and allocated from it, typed (T) where the registry says
// `typed` (MODEL.md §8) and f32 otherwise — so a stage's capture is "download every registry
// tensor of that stage", and the isolated mode is "upload the oracle's tensors, run one stage".
// Per layer, beyond the registry: the entering states (ssm_in, k_in, v_in, angle_in) and the
// gradients wrt the leaving states (d_*_out). The leaving states are the registry's states/*
// tensors, the entering-state gradients its d_states/* tensors.
// Typed GEMM weights are compute copies of the f32 masters refreshed in set_params; the f32
// residual-stream gradient δ gets a staged typed copy for the GEMMs that read it (as the
// reference's typed_copy).
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
#include <array>
#include <cstring>
#include <map>
#include <type_traits>

#include "backbone.hpp"  // reference: capture_grads
#include "common.cuh"
#include "convert.cuh"
#include "error.hpp"
#include "registry.hpp"
#include "stages.cuh"

namespace m3::gpu {

namespace {

template <class T>
constexpr Precision precision_of() {
  if constexpr (std::is_same_v<T, float>) return Precision::F32;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return Precision::BF16;
  return Precision::F16;
}

// A device buffer of n elements of 4 (float) or 2 (bf16/f16) bytes: its own storage, or a
// view of another buffer's (Buffers::view) where one tensor is another's value (a layer's
// input is the previous layer's output), so that no copy is made.
struct NamedBuf {
  DeviceArray<unsigned char> bytes;
  unsigned char* viewed = nullptr;
  std::size_t elem = 4;
  Idx n = 0;
  unsigned char* data() { return viewed ? viewed : bytes.data(); }
  const unsigned char* data() const { return viewed ? viewed : bytes.data(); }
};

// Host floats → the buffer's storage (RNE to 16 bits for typed buffers), and back.
void upload_floats(NamedBuf& b, const float* host, Precision storage, cudaStream_t s) {
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

void download_floats(const NamedBuf& b, float* host, Precision storage, cudaStream_t s) {
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

// Device buffers of one scope (a layer, or the backbone), by tensor name.
class Buffers {
 public:
  void add(const std::string& name, Idx n, std::size_t elem) {
    NamedBuf& b = m_[name];
    b.elem = elem;
    b.n = n;
    b.bytes.resize(n * static_cast<Idx>(elem));
  }
  // nullptr when the run has no such tensor (e.g. angle tensors with na = 0). Asking for the
  // wrong element type (a typed tensor as float, or the reverse) is an m3::Error.
  template <class U>
  U* get(const std::string& name) {
    auto it = m_.find(name);
    if (it == m_.end() || it->second.n == 0) return nullptr;
    M3_REQUIRE(it->second.elem == sizeof(U), "GpuBackbone",
               "buffer '" + name + "' accessed with the wrong storage type",
               "element size ", it->second.elem, ", asked ", sizeof(U));
    return reinterpret_cast<U*>(it->second.data());
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
    M3_REQUIRE(it != m_.end(), "GpuBackbone", "no device buffer '" + name + "'", "");
    return it->second;
  }

 private:
  std::map<std::string, NamedBuf> m_;
};

Idx numel(const std::vector<Idx>& shape) {
  Idx n = 1;
  for (Idx v : shape) n *= v;
  return n;
}

template <class U>
void copy_d2d(cudaStream_t s, U* dst, const U* src, Idx n) {
  if (n > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(U),
                                  cudaMemcpyDeviceToDevice, s));
}

// ---- fault kernels (negative controls only; see Fault in backbone_gpu.hpp) ------------------
__global__ void fault_flip_angle_kernel(Idx n, float* theta) {
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n && theta[i] > 0.0f) theta[i] = 6.2831853071795864769f - theta[i];
}

// y[b, t] ← y[b, t−1] for every chunk start t = c·cs, c ≥ 1 (rows of width di).
template <class T>
__global__ void fault_chunk_boundary_kernel(Idx B, Idx T_, Idx cs, Idx di, T* y) {
  const Idx nc = (T_ + cs - 1) / cs;
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= B * (nc - 1) * di) return;
  const Idx col = i % di, c = 1 + (i / di) % (nc - 1), b = i / (di * (nc - 1));
  const Idx t = c * cs;
  y[(b * T_ + t) * di + col] = y[(b * T_ + t - 1) * di + col];
}

// One more rounding to a coarser format: bf16 (f32/f16 storage), or 5 mantissa bits (bf16).
template <class T>
__global__ void fault_round_twice_kernel(Idx n, T* y) {
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = to_float(y[i]);
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    unsigned int u = __float_as_uint(v);
    u = (u + 0x3FFFFu + ((u >> 18) & 1u)) & 0xFFFC0000u;  // RNE to 5 explicit mantissa bits
    v = __uint_as_float(u);
  } else {
    v = __bfloat162float(__float2bfloat16_rn(v));
  }
  y[i] = from_float<T>(v);
}

}  // namespace

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
  virtual std::vector<float> output() = 0;
  virtual States<float> states() = 0;
  virtual Params<float> grads() = 0;
  virtual std::vector<float> d_x() = 0;
  virtual States<float> d_entering() = 0;
  virtual void synchronize() = 0;
  virtual void set_profiling(bool on) = 0;
  virtual void set_fusion(bool on) = 0;
  virtual std::vector<std::pair<std::string, double>> stage_times() const = 0;
  virtual void reset_stage_times() = 0;
};

namespace {

// The layer stages in execution order (the registry's stage names).
constexpr const char* kForwardStages[] = {"F1", "F2", "F3", "F4", "F5", "F4ef",
                                          "F5b", "F6", "F7", "F8", "states"};
constexpr const char* kBackwardStages[] = {"B8", "B7", "B6", "B5a", "B5b", "B4b",
                                           "B4c", "B3", "B2", "B1", "d_states"};

template <class T>
class BackboneT final : public GpuBackbone::Impl {
 public:
  BackboneT(GpuContext& c, const Config& cf, Idx B, Idx T_, ScanMode m)
      : ctx_(c), cfg_(cf), d_(ref::Dims::of(cf, B, T_, precision_of<T>())), mode_(m),
        s_(stream_of(c)) {
    layers_.resize(static_cast<size_t>(cf.n_layers));
    const StateSizes z = state_sizes(cf);
    for (const auto& spec : stage_registry()) {
      if (!exists_in(spec, cf, m)) continue;
      const Idx n = numel(resolve_shape(spec.shape, cf, B, T_));
      const std::size_t elem = spec.typed ? sizeof(T) : sizeof(float);
      if (spec.scope == Scope::Layer) {
        for (auto& L : layers_) L.add(spec.tensor, n, elem);
      } else {
        bb_.add(backbone_name(spec.stage, spec.tensor), n, elem);
      }
    }
    for (auto& L : layers_) {
      L.add("ssm_in", B * z.ssm, 4);
      L.add("k_in", B * z.k, 4);
      L.add("v_in", B * z.v, 4);
      L.add("angle_in", B * z.angle, 4);
      L.add("d_ssm_out", B * z.ssm, 4);
      L.add("d_k_out", B * z.k, 4);
      L.add("d_v_out", B * z.v, 4);
      L.add("d_angle_out", B * z.angle, 4);
    }
    bb_.add("d_out", d_.BT * d_.dm, 4);
    bb_.add("delta", d_.BT * d_.dm, 4);
    bb_.add("delta_typed", d_.BT * d_.dm, sizeof(T));
    const Params<float> shapes = zero_params<float>(cf);
    for_each_param(shapes, [&](int l, const char* name, const std::vector<float>& v) {
      const std::string key = param_key(l, name).substr(5);
      params_[key].resize(static_cast<Idx>(v.size()));
      grads_[key].resize(static_cast<Idx>(v.size()));
    });
    if constexpr (!std::is_same_v<T, float>) {
      w_in_t_.resize(layers_.size());
      w_out_t_.resize(layers_.size());
      for (size_t l = 0; l < layers_.size(); ++l) {
        w_in_t_[l].resize(d_.dm * d_.ip);
        w_out_t_[l].resize(d_.di * d_.dm);
      }
      if (!cf.input_proj_identity) w_input_t_.resize(d_.in * d_.dm);
    }
    const Idx LB = cf.n_layers * B;
    for (StateArrays* a : {&st_, &dl_, &de_}) {
      a->ssm.resize(LB * z.ssm);
      a->k.resize(LB * z.k);
      a->v.resize(LB * z.v);
      a->angle.resize(LB * z.angle);
    }
    scratch_.resize(scratch_floats(d_));
    zero_states(dl_);
    for (auto& [k, g] : grads_) g.zero(s_);
  }

  ~BackboneT() override {
    for (cudaEvent_t e : pool_) cudaEventDestroy(e);
  }

  Precision storage() const override { return precision_of<T>(); }

  // ---- uploads / downloads ------------------------------------------------------------------
  void set_params(const Params<float>& p) override {
    check_params(p, cfg_, "GpuBackbone::set_params");
    for_each_param(p, [&](int l, const char* name, const std::vector<float>& v) {
      params_.at(param_key(l, name).substr(5)).upload(v.data(), s_);
    });
    if constexpr (!std::is_same_v<T, float>) {  // typed compute copies of the GEMM weights
      for (size_t l = 0; l < layers_.size(); ++l) {
        const int li = static_cast<int>(l);
        convert<float, T>(s_, d_.dm * d_.ip, P(li, "in_proj_w"), w_in_t_[l].data());
        convert<float, T>(s_, d_.di * d_.dm, P(li, "out_proj_w"), w_out_t_[l].data());
      }
      if (!cfg_.input_proj_identity)
        convert<float, T>(s_, d_.in * d_.dm, P(-1, "input_proj_w"), w_input_t_.data());
    }
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
  }

  void set_input(const std::vector<float>& X) override {
    NamedBuf& b = bb_.at("input_proj/input_proj_inputs");
    M3_REQUIRE(static_cast<Idx>(X.size()) == b.n, "GpuBackbone::set_input",
               "input X has the wrong size", "got ", X.size(), ", expected ", b.n);
    upload_floats(b, X.data(), storage(), s_);
  }

  void set_states(const States<float>& st) override {
    upload_states(st, st_, "GpuBackbone::set_states");
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

  void zero_grads() override {
    for (auto& [k, g] : grads_) g.zero(s_);
  }

  void set_fault(Fault f, int layer) override {
    M3_REQUIRE(layer >= 0 && layer < static_cast<int>(cfg_.n_layers), "GpuBackbone::set_fault",
               "fault layer out of range", "layer ", layer, ", n_layers ", cfg_.n_layers);
    fault_ = f;
    fault_layer_ = layer;
  }

  std::vector<float> output() override { return download(bb_.at("norm_f/Out")); }
  std::vector<float> d_x() override { return download(bb_.at("input_proj/d_input_proj_dx")); }
  States<float> states() override { return download_states(st_); }
  States<float> d_entering() override { return download_states(de_); }
  Params<float> grads() override {
    Params<float> g = zero_params<float>(cfg_);
    for_each_param(g, [&](int l, const char* name, std::vector<float>& v) {
      grads_.at(param_key(l, name).substr(5)).download(v.data(), s_);
    });
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
    return g;
  }
  void synchronize() override { ctx_.synchronize(); }

  void set_profiling(bool on) override { profiling_ = on; }
  void set_fusion(bool on) override { fusion_ = on; }
  std::vector<std::pair<std::string, double>> stage_times() const override { return times_; }
  void reset_stage_times() override { times_.clear(); }

  // ---- the two passes ---------------------------------------------------------------------
  void forward(Capture* cap) override {
    pending_add_ = -1;
    mark("start");
    run_stage(-1, "input_proj", Dir::Forward, cap);
    for (int l = 0; l < static_cast<int>(cfg_.n_layers); ++l) {
      enter_layer(l);
      for (const char* st : kForwardStages) run_stage(l, st, Dir::Forward, cap);
      leave_layer(l);
    }
    bb_.view("norm_f/norm_f_input", layers_.back().at("layer_output"));
    run_stage(-1, "norm_f", Dir::Forward, cap);
    collect_marks();
    have_forward_ = true;
  }

  void backward(Capture* cap) override {
    M3_REQUIRE(have_forward_, "GpuBackbone::backward", "backward called before forward", "");
    mark("start");
    run_stage(-1, "norm_f", Dir::Backward, cap);
    // δ, the gradient wrt the residual stream entering each layer's backward from above, is
    // a view of the buffer its producer wrote (norm_f's d_norm, then layer l's d_temporal).
    bb_.view("delta", bb_.at("norm_f/d_norm"));
    for (int l = static_cast<int>(cfg_.n_layers) - 1; l >= 0; --l) {
      load_leaving_grads(l);
      for (const char* st : kBackwardStages) run_stage(l, st, Dir::Backward, cap);
      store_entering_grads(l);
      bb_.view("delta", layers_[l].at("d_temporal"));
    }
    run_stage(-1, "input_proj", Dir::Backward, cap);
    collect_marks();
  }

  Capture run_isolated(const Capture& oracle) override {
    // Each stage on its own, fed the oracle's inputs: no cross-stage fusion.
    struct Isolated {
      bool& flag;
      explicit Isolated(bool& f) : flag(f) { flag = true; }
      ~Isolated() { flag = false; }
    } guard(isolated_);
    Capture out(cfg_, d_.B, d_.T);
    // Every tensor gets its own buffer again: the oracle's value of a layer's input need not
    // be the GPU's value of the previous layer's output.
    for (auto& L : layers_) L.unview("residual");
    bb_.unview("norm_f/norm_f_input");
    bb_.unview("delta");
    pending_add_ = -1;
    zero_grads();
    zero_states(dl_);
    // Everything the oracle holds goes into the buffers of the same name.
    for (const auto& ks : expected_stage_keys(cfg_, d_.B, d_.T, mode_)) restore(oracle, ks);
    const auto keys = expected_stage_keys(cfg_, d_.B, d_.T, mode_);
    auto stage_keys = [&](int layer, const char* stage, Dir dir) {
      std::vector<const KeyedSpec*> v;
      for (const auto& ks : keys)
        if (ks.layer == layer && ks.spec->dir == dir && std::string(ks.spec->stage) == stage)
          v.push_back(&ks);
      return v;
    };
    auto isolated = [&](int layer, const char* stage, Dir dir) {
      run_stage(layer, stage, dir, &out);  // captures this stage's outputs
      for (const KeyedSpec* ks : stage_keys(layer, stage, dir)) restore(oracle, *ks);
    };
    isolated(-1, "input_proj", Dir::Forward);
    for (int l = 0; l < static_cast<int>(cfg_.n_layers); ++l) {
      load_entering_states(l);
      for (const char* st : kForwardStages) isolated(l, st, Dir::Forward);
    }
    isolated(-1, "norm_f", Dir::Forward);
    isolated(-1, "norm_f", Dir::Backward);
    const int L = static_cast<int>(cfg_.n_layers);
    for (int l = L - 1; l >= 0; --l) {
      // δ entering layer l's backward: the oracle's ∂L/∂(layer output).
      upload_floats(bb_.at("delta"),
                    oracle_data(oracle, l == L - 1 ? stage_key(-1, "norm_f", "d_norm")
                                                   : stage_key(l + 1, "B1", "d_temporal")),
                    Precision::F32, s_);
      // The gradients wrt the leaving states are zero here (dl_, as the oracle's run), not
      // whatever an earlier backward left in the layer's buffers.
      load_leaving_grads(l);
      for (const char* st : kBackwardStages) isolated(l, st, Dir::Backward);
    }
    upload_floats(bb_.at("delta"), oracle_data(oracle, stage_key(0, "B1", "d_temporal")),
                  Precision::F32, s_);
    isolated(-1, "input_proj", Dir::Backward);
    capture_grads(grads(), cfg_, out);
    have_forward_ = false;  // the buffers hold a mix of oracle and GPU values now
    return out;
  }

 private:

  static std::string backbone_name(const char* stage, const char* tensor) {
    return std::string(stage) + "/" + tensor;
  }

  Scratch scr() { return {scratch_.data(), scratch_.size()}; }
  float* P(int l, const char* name) { return params_.at(param_key(l, name).substr(5)).data(); }
  float* G(int l, const char* name) { return grads_.at(param_key(l, name).substr(5)).data(); }
  const T* w_in(int l) {
    if constexpr (std::is_same_v<T, float>) return P(l, "in_proj_w");
    else return w_in_t_[l].data();
  }
  const T* w_out(int l) {
    if constexpr (std::is_same_v<T, float>) return P(l, "out_proj_w");
    else return w_out_t_[l].data();
  }
  const T* w_input() {
    if constexpr (std::is_same_v<T, float>) return P(-1, "input_proj_w");
    else return w_input_t_.data();
  }
  // The staged typed copy of δ for the GEMMs that read it (the reference's typed_copy).
  const T* delta_typed() {
    if constexpr (std::is_same_v<T, float>) {
      return bb_.f("delta");
    } else {
      T* t = bb_.get<T>("delta_typed");
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
  // Layer l's input (residual): a view of layer l−1's output, or H⁰ (typed) widened to f32
  // for l = 0; then the entering states.
  void enter_layer(int l) {
    Buffers& L = layers_[l];
    if (l > 0) {
      L.view("residual", layers_[l - 1].at("layer_output"));
    } else {
      convert<T, float>(s_, d_.BT * d_.dm, bb_.get<T>("input_proj/input_proj_outputs"),
                        L.f("residual"));
    }
    load_entering_states(l);
  }
  void leave_layer(int l) {
    copy_states(l, st_, {"ssm_state", "k_state", "v_state", "angle_state"}, false);
  }
  void load_leaving_grads(int l) {
    copy_states(l, dl_, {"d_ssm_out", "d_k_out", "d_v_out", "d_angle_out"}, true);
  }
  void store_entering_grads(int l) {
    copy_states(l, de_, {"d_ssm_state", "d_k_state", "d_v_state", "d_angle_state"}, false);
  }

  // ---- one stage ----------------------------------------------------------------------------
  void run_stage(int l, const char* stage, Dir dir, Capture* cap) {
    const std::string st = stage;
    if (l < 0) {
      if (st == "input_proj") dir == Dir::Forward ? input_proj_forward() : input_proj_backward();
      if (st == "norm_f") dir == Dir::Forward ? norm_f_forward() : norm_f_backward();
    } else if (dir == Dir::Forward) {
      layer_forward_stage(l, st, cap != nullptr);
    } else {
      layer_backward_stage(l, st, cap != nullptr);
    }
    if (l == fault_layer_ && fault_ != Fault::None && st == fault_stage(fault_)) apply_fault(l);
    mark(l < 0 && dir == Dir::Backward ? st + " (bwd)" : st);
    capture(cap, l, stage, dir);
  }

  void input_proj_forward() {
    T* x = bb_.get<T>("input_proj/input_proj_inputs");
    T* h0 = bb_.get<T>("input_proj/input_proj_outputs");
    if (cfg_.input_proj_identity) {
      copy_d2d(s_, h0, x, d_.BT * d_.dm);
    } else {
      gemm_forward<T>(ctx_, d_.BT, d_.in, d_.dm, x, w_input(), P(-1, "input_proj_b"), h0, scr());
    }
  }
  // The norm that reads layer `prev`'s output u (a view of its layer_output): F1 of layer
  // prev + 1, or norm_f. When prev's F8 left its residual add pending, u = residual + out_flat
  // is formed and stored here, in the same pass (rmsnorm_forward_add).
  void norm_of_output(int prev, float* u, const float* w, T* y, float* rms) {
    if (prev >= 0 && pending_add_ == prev) {
      Buffers& L = layers_[prev];
      rmsnorm_forward_add<T>(s_, d_.BT, d_.dm, L.f("residual"), L.get<T>("out_flat"), u, w, y,
                             rms);
      pending_add_ = -1;
    } else {
      rmsnorm_forward<T>(s_, d_.BT, d_.dm, u, w, y, rms);
    }
  }
  void norm_f_forward() {
    norm_of_output(static_cast<int>(cfg_.n_layers) - 1, bb_.f("norm_f/norm_f_input"),
                   P(-1, "norm_f_weight"), bb_.get<T>("norm_f/Out"), bb_.f("norm_f/norm_f_rms"));
  }
  void norm_f_backward() {
    rmsnorm_backward<float>(s_, d_.BT, d_.dm, bb_.f("norm_f/norm_f_input"),
                            P(-1, "norm_f_weight"), bb_.f("norm_f/norm_f_rms"), bb_.f("d_out"),
                            bb_.f("norm_f/d_norm"), G(-1, "norm_f_weight"), scr());
  }
  void input_proj_backward() {
    T* dx = bb_.get<T>("input_proj/d_input_proj_dx");
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
  // (k then stored at t = T − 1 only) and (ssm_chunked_tail_fuses) B4b's head sums and bias
  // gradients done in B6's tail; F8's residual add done by the next norm (pending_add_).
  bool fused() const { return fusion_ && !isolated_; }

  SsmChunkFwd<T> chunked_fwd_args(int l, bool prep_done) {
    Buffers& L = layers_[l];
    auto t = [&](const char* n) { return L.get<T>(n); };
    auto f = [&](const char* n) { return L.f(n); };
    return {t("x"), t("k"), t("q"), f("dt"), f("trap"), f("a_val"), P(l, "d_param"),
            f("ssm_in"), f("k_in"), f("v_in"), t("k_scaled_saved"), t("y"), f("adt"),
            f("qk_dot_saved"), f("scale_saved"), f("gamma_saved"), f("da_cumsum_saved"),
            f("chunk_states"), f("chunk_states_saved"), f("final_states"), f("ssm_state"),
            f("k_state"), f("v_state"), prep_done};
  }

  // capturing: the registry's b/c_biased must be stored even when their readers recompute them.
  void layer_forward_stage(int l, const std::string& st, bool capturing) {
    Buffers& L = layers_[l];
    auto t = [&](const char* n) { return L.get<T>(n); };
    auto f = [&](const char* n) { return L.f(n); };
    if (st == "F1") {
      // Layer 0's residual is H⁰, no layer's output: prev = −1 never has a pending add.
      norm_of_output(l - 1, f("residual"), P(l, "norm_weight"), t("post_norm"), f("rms_vals"));
    } else if (st == "F2") {
      gemm_forward<T>(ctx_, d_.BT, d_.dm, d_.ip, t("post_norm"), w_in(l), nullptr, t("proj"));
    } else if (st == "F3") {
      split_forward<T>(s_, d_,
                       {t("proj"), P(l, "dt_bias"), t("z"), t("x"), t("b_raw"), t("c_raw"),
                        f("dd_dt_raw"), f("dd_a_raw"), f("trap_raw"), f("angles_raw"), f("dt"),
                        f("a_val"), f("trap")});
    } else if (st == "F4") {
      // b/c_biased are recomputed by their fused readers (F4ef, B6): stored for a capture only.
      const bool store = !fused() || capturing;
      bcnorm_forward<T>(s_, d_,
                        {t("b_raw"), t("c_raw"), P(l, "b_norm_weight"), P(l, "c_norm_weight"),
                         P(l, "b_bias"), P(l, "c_bias"), t("b_normed"), t("c_normed"),
                         store ? t("b_biased") : nullptr, store ? t("c_biased") : nullptr,
                         f("b_rms"), f("c_rms")});
    } else if (st == "F5") {
      angle_forward(s_, d_, f("angles_raw"), f("dt"), f("angle_in"), f("angle_cumsum"),
                    f("angle_state"), scr());
    } else if (st == "F4ef") {
      if (fused() && mode_ == ScanMode::Chunked) {
        // With F6's K0/K1 (which read k, q and would otherwise read them back): k is stored
        // at t = T − 1 only (k_out), or everywhere for a capture.
        ssm_chunked_rope_prep<T>(s_, d_,
                                 {t("b_normed"), t("c_normed"), P(l, "b_bias"), P(l, "c_bias"),
                                  f("angle_cumsum"), t("k"), t("q"), capturing},
                                 chunked_fwd_args(l, false));
        prep_fused_layer_ = l;
      } else if (fused()) {
        rope_forward_normed<T>(s_, d_, f("angle_cumsum"), t("b_normed"), t("c_normed"),
                               P(l, "b_bias"), P(l, "c_bias"), t("k"), t("q"));
      } else {
        rope_forward<T>(s_, d_, f("angle_cumsum"), t("b_biased"), t("c_biased"), t("k"), t("q"));
      }
    } else if (st == "F5b") {
      // α, β, γ feed the sequential scan only (the chunked prep forms γ itself): the fused
      // chunked path computes them for a capture only.
      if (mode_ == ScanMode::Sequential || !fused() || capturing)
        abg_forward(s_, d_, f("a_val"), f("dt"), f("trap"), f("alpha"), f("beta"), f("gamma"));
    } else if (st == "F6") {
      if (mode_ == ScanMode::Sequential) {
        ssm_seq_forward<T>(s_, d_,
                           {t("x"), t("k"), t("q"), f("alpha"), f("beta"), f("gamma"),
                            P(l, "d_param"), f("ssm_in"), f("k_in"), f("v_in"), t("y"),
                            f("h_saved"), f("k_prev_saved"), f("v_prev_saved"), f("ssm_state"),
                            f("k_state"), f("v_state")});
      } else {
        const bool prep_done = prep_fused_layer_ == l;  // K0/K1 ran with F4ef
        prep_fused_layer_ = -1;
        ssm_chunked_forward<T>(s_, d_, chunked_fwd_args(l, prep_done), scr());
      }
    } else if (st == "F7") {
      gating_forward<T>(s_, d_, t("y"), t("z"), P(l, "norm_gate_weight"), t("gated"),
                        f("gated_rms_vals"));
    } else if (st == "F8") {
      gemm_forward<T>(ctx_, d_.BT, d_.di, d_.dm, t("gated"), w_out(l), nullptr, t("out_flat"));
      // layer_output = residual + out_flat: done by the next norm (layer l + 1's F1, or
      // norm_f) in the production path; here for a capture or the isolated mode.
      if (fused() && !capturing)
        pending_add_ = l;
      else
        add<T>(s_, d_.BT * d_.dm, f("residual"), t("out_flat"), f("layer_output"));
    }
    // "states": the leaving states are written by F5/F6; nothing to run.
  }

  // capturing: the registry's d_b/c_pre_rope must be stored even when the tail is fused.
  void layer_backward_stage(int l, const std::string& st, bool capturing) {
    Buffers& L = layers_[l];
    auto t = [&](const char* n) { return L.get<T>(n); };
    auto f = [&](const char* n) { return L.f(n); };
    if (st == "B8") {
      const T* dt = delta_typed();
      gemm_backward_dx<T>(ctx_, d_.BT, d_.di, d_.dm, dt, w_out(l), t("d_gated"));
      gemm_backward_dw<T>(ctx_, d_.BT, d_.di, d_.dm, t("gated"), dt, G(l, "out_proj_w"));
    } else if (st == "B7") {
      gating_backward<T>(s_, d_,
                         {t("y"), t("z"), t("d_gated"), P(l, "norm_gate_weight"),
                          f("gated_rms_vals"), t("d_y"), t("d_z"), G(l, "norm_gate_weight")},
                         scr());
    } else if (st == "B6") {
      if (mode_ == ScanMode::Sequential) {
        ssm_seq_backward<T>(
            s_, d_,
            {t("x"), t("k"), t("q"), t("d_y"), f("alpha"), f("beta"), f("gamma"),
             P(l, "d_param"), f("h_saved"), f("k_prev_saved"), f("v_prev_saved"),
             f("d_ssm_out"), f("d_k_out"), f("d_v_out"), t("d_x"), f("d_k"), f("d_q"),
             f("d_alpha"), f("d_beta"), f("d_gamma"), f("d_d_local"), f("d_ssm_state"),
             f("d_k_state"), f("d_v_state"), G(l, "d_param")},
            scr());
        rope_backward<T>(s_, d_,
                         {f("angle_cumsum"), f("d_k"), f("d_q"), t("k"), t("q"),
                          f("d_b_pre_rope"), f("d_c_pre_rope"), f("d_angle_cumsum"), nullptr,
                          nullptr, nullptr});
        abg_backward(s_, d_,
                     {f("alpha"), f("beta"), f("dt"), f("trap"), f("d_alpha"), f("d_beta"),
                      f("d_gamma"), f("d_adt_total"), f("d_dt_direct"), f("d_trap_sig")});
      } else {
        // Production: B4b's head sums and bias gradients come out of B6's tail, which also
        // recomputes b/c_biased, k and q instead of reading them (stages.cuh SsmChunkBwd).
        const bool tail = fused() && ssm_chunked_tail_fuses(d_);
        const bool store_pre = !tail || capturing;
        SsmChunkBwd<T> a{
            t("x"), t("k"), t("q"), t("b_biased"), t("c_biased"), t("k_scaled_saved"), t("d_y"),
            f("angle_cumsum"), f("dt"), f("trap"), f("a_val"), P(l, "d_param"),
            f("qk_dot_saved"), f("scale_saved"), f("gamma_saved"), f("da_cumsum_saved"),
            f("chunk_states_saved"), f("k_in"), f("v_in"), f("d_ssm_out"), f("d_k_out"),
            f("d_v_out"), f("da_cs_sum"), f("dQ_mid"), f("dK_mid"), f("dADT"), f("dQK_dot"),
            f("dD_partials"), f("dScale"), f("dGamma"), f("dDT"), t("d_x"),
            store_pre ? f("d_b_pre_rope") : nullptr, store_pre ? f("d_c_pre_rope") : nullptr,
            f("d_angle_cumsum"), f("d_adt_total"), f("d_dt_direct"), f("d_trap_sig"),
            f("d_ssm_state"), f("d_k_state"), f("d_v_state"), G(l, "d_param")};
        if (fused()) {
          a.b_normed = t("b_normed");
          a.c_normed = t("c_normed");
          a.b_bias = P(l, "b_bias");
          a.c_bias = P(l, "c_bias");
        }
        if (tail) {
          a.d_b_normed = t("d_b_normed");
          a.d_c_normed = t("d_c_normed");
          a.d_b_bias = G(l, "b_bias");
          a.d_c_bias = G(l, "c_bias");
        }
        ssm_chunked_backward<T>(s_, d_, a, scr());
        tail_fused_layer_ = tail ? l : -1;
      }
    } else if (st == "B5a") {
      angle_backward(s_, d_,
                     {f("angles_raw"), f("dt"), f("d_angle_cumsum"), f("d_angle_out"),
                      f("d_angles_raw"), f("d_dt_angle"), f("d_angle_state")},
                     scr());
    } else if (st == "B5b") {
      const ActBwd act{f("dd_dt_raw"),    f("dd_a_raw"),    P(l, "dt_bias"),  f("dt"),
                       f("a_val"),        f("trap"),        f("d_adt_total"), f("d_dt_direct"),
                       f("d_dt_angle"),   f("d_trap_sig"),  f("d_dd_dt"),     f("d_dd_a"),
                       f("d_trap_raw"),   G(l, "dt_bias"),  cfg_.a_floor};
      activations_backward(s_, d_, act, scr());
    } else if (st == "B4b") {  // B4b and B4c are one launcher (bias/heads→groups + BCNorm)
      const bool done = tail_fused_layer_ == l;  // B4b ran in B6's tail: B4c alone
      tail_fused_layer_ = -1;
      bcnorm_backward<T>(s_, d_,
                         {t("b_raw"), t("c_raw"), P(l, "b_norm_weight"), P(l, "c_norm_weight"),
                          f("b_rms"), f("c_rms"), done ? nullptr : f("d_b_pre_rope"),
                          done ? nullptr : f("d_c_pre_rope"), t("d_b_normed"), t("d_c_normed"),
                          t("d_b_raw"), t("d_c_raw"), G(l, "b_norm_weight"),
                          G(l, "c_norm_weight"), G(l, "b_bias"), G(l, "c_bias")},
                         scr());
    } else if (st == "B3") {
      split_backward<T>(s_, d_,
                        {t("d_z"), t("d_x"), t("d_b_raw"), t("d_c_raw"), f("d_dd_dt"),
                         f("d_dd_a"), f("d_trap_raw"), f("d_angles_raw"), t("d_proj")});
    } else if (st == "B2") {
      gemm_backward_dx<T>(ctx_, d_.BT, d_.dm, d_.ip, t("d_proj"), w_in(l), t("d_norm"));
      gemm_backward_dw<T>(ctx_, d_.BT, d_.dm, d_.ip, t("post_norm"), t("d_proj"),
                          G(l, "in_proj_w"));
    } else if (st == "B1") {
      // d_temporal = δ + d_pre_norm in the same kernel; d_pre_norm stored for a capture only
      // (both are B1's own outputs, so this holds in the isolated mode too).
      rmsnorm_backward<T>(s_, d_.BT, d_.dm, f("residual"), P(l, "norm_weight"), f("rms_vals"),
                          t("d_norm"), capturing ? f("d_pre_norm") : nullptr,
                          G(l, "norm_weight"), scr(), bb_.f("delta"), f("d_temporal"));
    }
    // "B4c" ran with B4b; "d_states": written by B6/B5a.
  }

  void apply_fault(int l) {
    Buffers& L = layers_[l];
    switch (fault_) {
      case Fault::DropBeta:
        L.at("beta").bytes.zero(s_);
        break;
      case Fault::FlipAngleSign: {
        NamedBuf& b = L.at("angle_cumsum");
        if (b.n > 0) {
          fault_flip_angle_kernel<<<blocks_for(b.n, 256), 256, 0, s_>>>(b.n, L.f("angle_cumsum"));
          M3_LAUNCH_CHECK();
        }
        break;
      }
      case Fault::ChunkBoundaryOff:
        if (d_.nc > 1) {
          fault_chunk_boundary_kernel<T><<<blocks_for(d_.B * (d_.nc - 1) * d_.di, 256), 256, 0,
                                           s_>>>(d_.B, d_.T, d_.cs, d_.di, L.get<T>("y"));
          M3_LAUNCH_CHECK();
        }
        break;
      case Fault::RoundTwice:
        fault_round_twice_kernel<T><<<blocks_for(d_.BT * d_.di, 256), 256, 0, s_>>>(
            d_.BT * d_.di, L.get<T>("y"));
        M3_LAUNCH_CHECK();
        break;
      case Fault::None:
        break;
    }
  }

  // ---- capture, isolated-mode restore ---------------------------------------------------------
  NamedBuf& buffer_of(int layer, const char* stage, const char* tensor) {
    return layer >= 0 ? layers_[layer].at(tensor) : bb_.at(backbone_name(stage, tensor));
  }
  void capture(Capture* cap, int layer, const char* stage, Dir dir) {
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
  static const float* oracle_data(const Capture& oracle, const std::string& key) {
    static thread_local std::vector<float> tmp;
    const Tensor& t = oracle.at(key);
    tmp.assign(t.data.begin(), t.data.end());
    return tmp.data();
  }
  void restore(const Capture& oracle, const KeyedSpec& ks) {
    NamedBuf& b = buffer_of(ks.layer, ks.spec->stage, ks.spec->tensor);
    const Tensor& t = oracle.at(ks.key);
    M3_REQUIRE(static_cast<Idx>(t.data.size()) == b.n, "GpuBackbone::run_isolated",
               "oracle tensor '" + ks.key + "' has the wrong size", "got ", t.data.size(),
               ", expected ", b.n);
    std::vector<float> host(t.data.begin(), t.data.end());
    upload_floats(b, host.data(), storage(), s_);
  }

  // ---- stage profile ------------------------------------------------------------------------
  void mark(const std::string& stage) {
    if (!profiling_) return;
    if (mark_names_.size() == pool_.size()) {
      cudaEvent_t e;
      M3_CUDA_CHECK(cudaEventCreate(&e));
      pool_.push_back(e);
    }
    M3_CUDA_CHECK(cudaEventRecord(pool_[mark_names_.size()], s_));
    mark_names_.push_back(stage);
  }
  void collect_marks() {
    if (!profiling_ || mark_names_.size() < 2) {
      mark_names_.clear();
      return;
    }
    M3_CUDA_CHECK(cudaEventSynchronize(pool_[mark_names_.size() - 1]));
    for (size_t i = 1; i < mark_names_.size(); ++i) {
      float ms = 0;
      M3_CUDA_CHECK(cudaEventElapsedTime(&ms, pool_[i - 1], pool_[i]));
      auto it = std::find_if(times_.begin(), times_.end(),
                             [&](const auto& e) { return e.first == mark_names_[i]; });
      if (it == times_.end()) {
        times_.emplace_back(mark_names_[i], ms);
      } else {
        it->second += ms;
      }
    }
    mark_names_.clear();
  }

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
  cudaStream_t s_;
  std::vector<Buffers> layers_;
  Buffers bb_;
  std::map<std::string, DeviceArray<float>> params_, grads_;  // by param_key without "grad/"
  std::vector<DeviceArray<T>> w_in_t_, w_out_t_;              // typed GEMM weight copies
  DeviceArray<T> w_input_t_;
  StateArrays st_;  // the states: entering before forward(), leaving after it
  StateArrays dl_;  // ∂L/∂(leaving states), set_leaving_grads
  StateArrays de_;  // ∂L/∂(entering states), from the last backward
  DeviceArray<float> scratch_;
  bool have_forward_ = false;
  int pending_add_ = -1;  // the layer whose F8 residual add the next norm does (or −1)
  Fault fault_ = Fault::None;
  int fault_layer_ = 0;
  bool profiling_ = false;
  bool fusion_ = true;           // set_fusion
  bool isolated_ = false;        // inside run_isolated
  int tail_fused_layer_ = -1;    // the layer whose B6 tail did its B4b (until that B4b runs)
  int prep_fused_layer_ = -1;    // the layer whose F4ef did F6's K0/K1 (until that F6 runs)
  std::vector<cudaEvent_t> pool_;
  std::vector<std::string> mark_names_;
  std::vector<std::pair<std::string, double>> times_;
};

}  // namespace

std::string GpuBackbone::unsupported(const Config& cfg, Idx B, Idx T) {
  try {
    validate_run(cfg, B, T);
  } catch (const Error& e) {
    return e.what();
  }
  // cuBLAS takes int dimensions; every GEMM dimension is at most B*T or a weight dimension.
  const Idx big = std::max<Idx>({B * T * cfg.in_proj_dim(), B * T * cfg.d_inner(),
                                 B * T * cfg.input_dim});
  if (big >= (Idx(1) << 31))
    return "B*T*width = " + std::to_string(big) + " exceeds the 2^31 elements of one GEMM operand";
  return "";
}

GpuBackbone::GpuBackbone(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode,
                         Precision storage) {
  const std::string why = unsupported(cfg, B, T);
  M3_REQUIRE(why.empty(), "GpuBackbone", "configuration not supported on the GPU", why);
  switch (storage) {  // the one dtype dispatch of the GPU path
    case Precision::F32: impl_ = std::make_unique<BackboneT<float>>(ctx, cfg, B, T, mode); break;
    case Precision::BF16:
      impl_ = std::make_unique<BackboneT<__nv_bfloat16>>(ctx, cfg, B, T, mode);
      break;
    case Precision::F16: impl_ = std::make_unique<BackboneT<__half>>(ctx, cfg, B, T, mode); break;
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
std::vector<float> GpuBackbone::output() const { return impl_->output(); }
States<float> GpuBackbone::states() const { return impl_->states(); }
Params<float> GpuBackbone::grads() const { return impl_->grads(); }
std::vector<float> GpuBackbone::d_x() const { return impl_->d_x(); }
States<float> GpuBackbone::d_entering() const { return impl_->d_entering(); }
void GpuBackbone::synchronize() const { impl_->synchronize(); }
void GpuBackbone::set_profiling(bool on) { impl_->set_profiling(on); }
void GpuBackbone::set_fusion(bool on) { impl_->set_fusion(on); }
std::vector<std::pair<std::string, double>> GpuBackbone::stage_times() const {
  return impl_->stage_times();
}
void GpuBackbone::reset_stage_times() { impl_->reset_stage_times(); }

void load_problem(GpuBackbone& net, const Problem& pb) {
  net.set_params(cast_params<float>(pb.params));
  net.set_input(std::vector<float>(pb.x.begin(), pb.x.end()));
  net.set_states(cast_states<float>(pb.states));
  net.set_dout(std::vector<float>(pb.d_out.begin(), pb.d_out.end()));
  net.set_leaving_grads(nullptr);
  net.zero_grads();
}

Capture run_gpu(GpuContext& ctx, const Problem& pb, ScanMode mode, Precision storage,
                Fault fault) {
  Capture cap(pb.cfg, pb.B, pb.T);
  GpuBackbone net(ctx, pb.cfg, pb.B, pb.T, mode, storage);
  load_problem(net, pb);
  net.set_fault(fault, 0);
  net.forward(&cap);
  net.backward(&cap);
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
