// GpuBackbone (see backbone_gpu.hpp): the reference's backbone (reference/backbone.cpp) with
// every stage a launcher of gpu/stages.cuh, in the same order:
//   forward : input_proj → per layer F1 F2 F3 F4 F5 F4ef F5b F6 F7 F8 (+ states) → norm_f
//   backward: norm_f → per layer (last first) B8 B7 B6 B5a B5b B4b/B4c B3 B2 B1 (+ d_states)
//             → input_proj
// Buffers are named exactly as the stage registry names the tensors (reference/registry.cpp)
// and allocated from it, so the capture of a stage is "download every registry tensor of that
// stage" — the registry is the single source of names and shapes for both implementations.
// Per layer, beyond the registry: the entering states (ssm_in, k_in, v_in, angle_in), the
// gradients wrt the leaving states (d_*_out) and the B6→B5b glue (d_adt_total, d_dt_direct,
// d_trap_sig). The leaving states are the registry's states/* tensors, the entering-state
// gradients its d_states/* tensors.
#include "backbone_gpu.hpp"

#include <algorithm>
#include <map>

#include "backbone.hpp"  // reference: capture_grads
#include "common.cuh"
#include "error.hpp"
#include "registry.hpp"
#include "stages.cuh"

namespace m3::gpu {

namespace {

using Buf = DeviceArray<float>;

// Device buffers of one scope (a layer, or the backbone), by tensor name.
class Buffers {
 public:
  void add(const std::string& name, Idx n) { m_[name].resize(n); }
  // nullptr when the run has no such tensor (e.g. angle tensors with na = 0).
  float* operator[](const std::string& name) {
    auto it = m_.find(name);
    return it == m_.end() || it->second.size() == 0 ? nullptr : it->second.data();
  }
  Buf& at(const std::string& name) {
    auto it = m_.find(name);
    M3_REQUIRE(it != m_.end(), "GpuBackbone", "no device buffer '" + name + "'", "");
    return it->second;
  }

 private:
  std::map<std::string, Buf> m_;
};

Idx numel(const std::vector<Idx>& shape) {
  Idx n = 1;
  for (Idx v : shape) n *= v;
  return n;
}

void copy_d2d(cudaStream_t s, float* dst, const float* src, Idx n) {
  if (n > 0)
    M3_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(float),
                                  cudaMemcpyDeviceToDevice, s));
}

}  // namespace

struct GpuBackbone::Impl {
  GpuContext& ctx;
  Config cfg;
  ref::Dims d;
  ScanMode mode;
  cudaStream_t s;
  std::vector<Buffers> layers;
  Buffers bb;                  // backbone tensors
  std::map<std::string, Buf> params, grads;  // by param_key(...) without "grad/"
  Buf st_ssm, st_k, st_v, st_angle;          // states [L][B][…]
  Buf dl_ssm, dl_k, dl_v, dl_angle;          // gradients wrt the leaving states
  Buf de_ssm, de_k, de_v, de_angle;          // gradients wrt the entering states
  Buf scratch;
  bool have_forward = false;

  // Stage profile: events from a pool (made on first use, reused), a mark after each stage.
  bool profiling = false;
  std::vector<cudaEvent_t> pool;
  std::vector<std::string> mark_names;  // the stage that ended at each recorded event
  std::vector<std::pair<std::string, double>> times;

  void mark(const std::string& stage) {
    if (!profiling) return;
    if (mark_names.size() == pool.size()) {
      cudaEvent_t e;
      M3_CUDA_CHECK(cudaEventCreate(&e));
      pool.push_back(e);
    }
    M3_CUDA_CHECK(cudaEventRecord(pool[mark_names.size()], s));
    mark_names.push_back(stage);
  }
  // Turns the marks of one forward() or backward() into per-stage times.
  void collect_marks() {
    if (!profiling || mark_names.size() < 2) {
      mark_names.clear();
      return;
    }
    M3_CUDA_CHECK(cudaEventSynchronize(pool[mark_names.size() - 1]));
    for (size_t i = 1; i < mark_names.size(); ++i) {
      float ms = 0;
      M3_CUDA_CHECK(cudaEventElapsedTime(&ms, pool[i - 1], pool[i]));
      auto it = std::find_if(times.begin(), times.end(),
                             [&](const auto& t) { return t.first == mark_names[i]; });
      if (it == times.end()) times.emplace_back(mark_names[i], ms);
      else it->second += ms;
    }
    mark_names.clear();
  }
  ~Impl() {
    for (cudaEvent_t e : pool) cudaEventDestroy(e);
  }

  Impl(GpuContext& c, const Config& cf, Idx B, Idx T, ScanMode m)
      : ctx(c), cfg(cf), d(ref::Dims::of(cf, B, T, Precision::F32)), mode(m), s(stream_of(c)) {
    layers.resize(static_cast<size_t>(cf.n_layers));
    const StateSizes z = state_sizes(cf);
    for (const auto& spec : stage_registry()) {
      if (!exists_in(spec, cf, m)) continue;
      const Idx n = numel(resolve_shape(spec.shape, cf, B, T));
      if (spec.scope == Scope::Layer) {
        for (auto& L : layers) L.add(spec.tensor, n);
      } else {
        bb.add(std::string(spec.stage) + "/" + spec.tensor, n);
      }
    }
    for (auto& L : layers) {
      L.add("ssm_in", B * z.ssm);
      L.add("k_in", B * z.k);
      L.add("v_in", B * z.v);
      L.add("angle_in", B * z.angle);
      L.add("d_ssm_out", B * z.ssm);
      L.add("d_k_out", B * z.k);
      L.add("d_v_out", B * z.v);
      L.add("d_angle_out", B * z.angle);
      for (const char* n : {"d_adt_total", "d_dt_direct", "d_trap_sig"}) L.add(n, d.BT * d.nh);
    }
    bb.add("d_out", d.BT * d.dm);
    bb.add("delta", d.BT * d.dm);
    const Params<float> shapes = zero_params<float>(cf);
    for_each_param(shapes, [&](int l, const char* name, const std::vector<float>& v) {
      const std::string key = param_key(l, name).substr(5);
      params[key].resize(static_cast<Idx>(v.size()));
      grads[key].resize(static_cast<Idx>(v.size()));
    });
    const Idx LB = cf.n_layers * B;
    for (Buf* b : {&st_ssm, &dl_ssm, &de_ssm}) b->resize(LB * z.ssm);
    for (Buf* b : {&st_k, &dl_k, &de_k}) b->resize(LB * z.k);
    for (Buf* b : {&st_v, &dl_v, &de_v}) b->resize(LB * z.v);
    for (Buf* b : {&st_angle, &dl_angle, &de_angle}) b->resize(LB * z.angle);
    scratch.resize(scratch_floats(d));
    for (Buf* b : {&dl_ssm, &dl_k, &dl_v, &dl_angle}) b->zero(s);
    for (auto& [k, g] : grads) g.zero(s);
  }

  Scratch scr() { return {scratch.data(), scratch.size()}; }
  float* P(int l, const char* name) { return params.at(param_key(l, name).substr(5)).data(); }
  float* G(int l, const char* name) { return grads.at(param_key(l, name).substr(5)).data(); }

  // Downloads every registry tensor of (scope of `layer`, stage, direction) into cap.
  void capture(Capture* cap, int layer, const char* stage, Dir dir) {
    mark(layer < 0 && dir == Dir::Backward ? std::string(stage) + " (bwd)" : std::string(stage));
    if (!cap) return;
    const Scope scope = layer >= 0 ? Scope::Layer : Scope::Backbone;
    std::vector<float> host;
    for (const auto& spec : stage_registry()) {
      if (spec.scope != scope || spec.dir != dir || std::string(spec.stage) != stage ||
          !exists_in(spec, cfg, mode))
        continue;
      Buf& b = layer >= 0 ? layers[layer].at(spec.tensor)
                          : bb.at(std::string(spec.stage) + "/" + spec.tensor);
      host.resize(static_cast<size_t>(b.size()));
      b.download(host.data(), s);
      M3_CUDA_CHECK(cudaStreamSynchronize(s));
      cap->put_stage(layer, spec.stage, spec.tensor, host.data(), b.size());
    }
  }

  // The [B, …] slice of layer l in a [L][B][…] state array.
  static float* slice(Buf& all, int l, Idx per_layer) { return all.data() + l * per_layer; }

  void layer_forward(int l, const float* u, Capture* cap) {
    Buffers& L = layers[l];
    const StateSizes z = state_sizes(cfg);
    const Idx B = d.B;
    copy_d2d(s, L["ssm_in"], slice(st_ssm, l, B * z.ssm), B * z.ssm);
    copy_d2d(s, L["k_in"], slice(st_k, l, B * z.k), B * z.k);
    copy_d2d(s, L["v_in"], slice(st_v, l, B * z.v), B * z.v);
    copy_d2d(s, L["angle_in"], slice(st_angle, l, B * z.angle), B * z.angle);

    copy_d2d(s, L["residual"], u, d.BT * d.dm);
    rmsnorm_forward<float>(s, d.BT, d.dm, u, P(l, "norm_weight"), L["post_norm"], L["rms_vals"]);
    capture(cap, l, "F1", Dir::Forward);
    gemm_forward<float>(ctx, d.BT, d.dm, d.ip, L["post_norm"], P(l, "in_proj_w"), nullptr,
                        L["proj"]);
    capture(cap, l, "F2", Dir::Forward);
    split_forward<float>(s, d,
                         {L["proj"], P(l, "dt_bias"), L["z"], L["x"], L["b_raw"], L["c_raw"],
                          L["dd_dt_raw"], L["dd_a_raw"], L["trap_raw"], L["angles_raw"], L["dt"],
                          L["a_val"], L["trap"]});
    capture(cap, l, "F3", Dir::Forward);
    bcnorm_forward<float>(s, d,
                          {L["b_raw"], L["c_raw"], P(l, "b_norm_weight"), P(l, "c_norm_weight"),
                           P(l, "b_bias"), P(l, "c_bias"), L["b_normed"], L["c_normed"],
                           L["b_biased"], L["c_biased"], L["b_rms"], L["c_rms"]});
    capture(cap, l, "F4", Dir::Forward);
    angle_forward(s, d, L["angles_raw"], L["dt"], L["angle_in"], L["angle_cumsum"],
                  L["angle_state"]);
    capture(cap, l, "F5", Dir::Forward);
    rope_forward<float>(s, d, L["angle_cumsum"], L["b_biased"], L["c_biased"], L["k"], L["q"]);
    capture(cap, l, "F4ef", Dir::Forward);
    abg_forward(s, d, L["a_val"], L["dt"], L["trap"], L["alpha"], L["beta"], L["gamma"]);
    capture(cap, l, "F5b", Dir::Forward);
    if (mode == ScanMode::Sequential) {
      ssm_seq_forward<float>(
          s, d,
          {L["x"], L["k"], L["q"], L["alpha"], L["beta"], L["gamma"], P(l, "d_param"),
           L["ssm_in"], L["k_in"], L["v_in"], L["y"], L["h_saved"], L["k_prev_saved"],
           L["v_prev_saved"], L["ssm_state"], L["k_state"], L["v_state"]});
    } else {
      ssm_chunked_forward<float>(
          s, d,
          {L["x"], L["k"], L["q"], L["dt"], L["trap"], L["a_val"], P(l, "d_param"), L["ssm_in"],
           L["k_in"], L["v_in"], L["k_scaled_saved"], L["y"], L["adt"], L["qk_dot_saved"],
           L["scale_saved"], L["gamma_saved"], L["da_cumsum_saved"], L["chunk_states"],
           L["chunk_states_saved"], L["final_states"], L["ssm_state"], L["k_state"],
           L["v_state"]},
          scr());
    }
    capture(cap, l, "F6", Dir::Forward);
    gating_forward<float>(s, d, L["y"], L["z"], P(l, "norm_gate_weight"), L["gated"],
                          L["gated_rms_vals"]);
    capture(cap, l, "F7", Dir::Forward);
    gemm_forward<float>(ctx, d.BT, d.di, d.dm, L["gated"], P(l, "out_proj_w"), nullptr,
                        L["out_flat"]);
    add<float>(s, d.BT * d.dm, L["residual"], L["out_flat"], L["layer_output"]);
    capture(cap, l, "F8", Dir::Forward);
    copy_d2d(s, slice(st_ssm, l, B * z.ssm), L["ssm_state"], B * z.ssm);
    copy_d2d(s, slice(st_k, l, B * z.k), L["k_state"], B * z.k);
    copy_d2d(s, slice(st_v, l, B * z.v), L["v_state"], B * z.v);
    copy_d2d(s, slice(st_angle, l, B * z.angle), L["angle_state"], B * z.angle);
    capture(cap, l, "states", Dir::Forward);
  }

  // delta: ∂L/∂(layer output) on entry; on return ∂L/∂(layer input) (= d_temporal).
  void layer_backward(int l, float* delta, Capture* cap) {
    Buffers& L = layers[l];
    const StateSizes z = state_sizes(cfg);
    const Idx B = d.B;
    copy_d2d(s, L["d_ssm_out"], slice(dl_ssm, l, B * z.ssm), B * z.ssm);
    copy_d2d(s, L["d_k_out"], slice(dl_k, l, B * z.k), B * z.k);
    copy_d2d(s, L["d_v_out"], slice(dl_v, l, B * z.v), B * z.v);
    copy_d2d(s, L["d_angle_out"], slice(dl_angle, l, B * z.angle), B * z.angle);

    gemm_backward_dx<float>(ctx, d.BT, d.di, d.dm, delta, P(l, "out_proj_w"), L["d_gated"]);
    gemm_backward_dw<float>(ctx, d.BT, d.di, d.dm, L["gated"], delta, G(l, "out_proj_w"));
    capture(cap, l, "B8", Dir::Backward);
    gating_backward<float>(s, d,
                           {L["y"], L["z"], L["d_gated"], P(l, "norm_gate_weight"),
                            L["gated_rms_vals"], L["d_y"], L["d_z"], G(l, "norm_gate_weight")},
                           scr());
    capture(cap, l, "B7", Dir::Backward);
    if (mode == ScanMode::Sequential) {
      ssm_seq_backward<float>(
          s, d,
          {L["x"], L["k"], L["q"], L["d_y"], L["alpha"], L["beta"], L["gamma"], P(l, "d_param"),
           L["h_saved"], L["k_prev_saved"], L["v_prev_saved"], L["d_ssm_out"], L["d_k_out"],
           L["d_v_out"], L["d_x"], L["d_k"], L["d_q"], L["d_alpha"], L["d_beta"], L["d_gamma"],
           L["d_d_local"], L["d_ssm_state"], L["d_k_state"], L["d_v_state"], G(l, "d_param")},
          scr());
      rope_backward<float>(s, d,
                           {L["angle_cumsum"], L["d_k"], L["d_q"], L["k"], L["q"],
                            L["d_b_pre_rope"], L["d_c_pre_rope"], L["d_angle_cumsum"], nullptr,
                            nullptr, nullptr});
      abg_backward(s, d,
                   {L["alpha"], L["beta"], L["dt"], L["trap"], L["d_alpha"], L["d_beta"],
                    L["d_gamma"], L["d_adt_total"], L["d_dt_direct"], L["d_trap_sig"]});
    } else {
      ssm_chunked_backward<float>(
          s, d,
          {L["x"], L["k"], L["q"], L["b_biased"], L["c_biased"], L["k_scaled_saved"], L["d_y"],
           L["angle_cumsum"], L["dt"], L["trap"], L["a_val"], P(l, "d_param"),
           L["qk_dot_saved"], L["scale_saved"], L["gamma_saved"], L["da_cumsum_saved"],
           L["chunk_states_saved"], L["k_in"], L["v_in"], L["d_ssm_out"], L["d_k_out"],
           L["d_v_out"], L["da_cs_sum"], L["dQ_mid"], L["dK_mid"], L["dADT"], L["dQK_dot"],
           L["dD_partials"], L["dScale"], L["dGamma"], L["dDT"], L["d_x"], L["d_b_pre_rope"],
           L["d_c_pre_rope"], L["d_angle_cumsum"], L["d_adt_total"], L["d_dt_direct"],
           L["d_trap_sig"], L["d_ssm_state"], L["d_k_state"], L["d_v_state"], G(l, "d_param")},
          scr());
    }
    capture(cap, l, "B6", Dir::Backward);
    angle_backward(s, d,
                   {L["angles_raw"], L["dt"], L["d_angle_cumsum"], L["d_angle_out"],
                    L["d_angles_raw"], L["d_dt_angle"], L["d_angle_state"]},
                   scr());
    capture(cap, l, "B5a", Dir::Backward);
    ActBwd act{L["dd_dt_raw"], L["dd_a_raw"], P(l, "dt_bias"), L["dt"], L["a_val"], L["trap"],
               L["d_adt_total"], L["d_dt_direct"], L["d_dt_angle"], L["d_trap_sig"],
               L["d_dd_dt"], L["d_dd_a"], L["d_trap_raw"], G(l, "dt_bias"), cfg.a_floor};
    activations_backward(s, d, act, scr());
    capture(cap, l, "B5b", Dir::Backward);
    bcnorm_backward<float>(
        s, d,
        {L["b_raw"], L["c_raw"], P(l, "b_norm_weight"), P(l, "c_norm_weight"), L["b_rms"],
         L["c_rms"], L["d_b_pre_rope"], L["d_c_pre_rope"], L["d_b_normed"], L["d_c_normed"],
         L["d_b_raw"], L["d_c_raw"], G(l, "b_norm_weight"), G(l, "c_norm_weight"),
         G(l, "b_bias"), G(l, "c_bias")},
        scr());
    capture(cap, l, "B4b", Dir::Backward);
    capture(cap, l, "B4c", Dir::Backward);
    split_backward<float>(s, d,
                          {L["d_z"], L["d_x"], L["d_b_raw"], L["d_c_raw"], L["d_dd_dt"],
                           L["d_dd_a"], L["d_trap_raw"], L["d_angles_raw"], L["d_proj"]});
    capture(cap, l, "B3", Dir::Backward);
    gemm_backward_dx<float>(ctx, d.BT, d.dm, d.ip, L["d_proj"], P(l, "in_proj_w"), L["d_norm"]);
    gemm_backward_dw<float>(ctx, d.BT, d.dm, d.ip, L["post_norm"], L["d_proj"],
                            G(l, "in_proj_w"));
    capture(cap, l, "B2", Dir::Backward);
    rmsnorm_backward<float>(s, d.BT, d.dm, L["residual"], P(l, "norm_weight"), L["rms_vals"],
                            L["d_norm"], L["d_pre_norm"], G(l, "norm_weight"), scr());
    add<float>(s, d.BT * d.dm, delta, L["d_pre_norm"], L["d_temporal"]);
    capture(cap, l, "B1", Dir::Backward);
    copy_d2d(s, slice(de_ssm, l, B * z.ssm), L["d_ssm_state"], B * z.ssm);
    copy_d2d(s, slice(de_k, l, B * z.k), L["d_k_state"], B * z.k);
    copy_d2d(s, slice(de_v, l, B * z.v), L["d_v_state"], B * z.v);
    copy_d2d(s, slice(de_angle, l, B * z.angle), L["d_angle_state"], B * z.angle);
    capture(cap, l, "d_states", Dir::Backward);
    copy_d2d(s, delta, L["d_temporal"], d.BT * d.dm);
  }

  void forward(Capture* cap) {
    mark("start");
    float* x = bb["input_proj/input_proj_inputs"];
    float* h0 = bb["input_proj/input_proj_outputs"];
    if (cfg.input_proj_identity) {
      copy_d2d(s, h0, x, d.BT * d.dm);
    } else {
      gemm_forward<float>(ctx, d.BT, d.in, d.dm, x, P(-1, "input_proj_w"), P(-1, "input_proj_b"),
                          h0);
    }
    capture(cap, -1, "input_proj", Dir::Forward);
    const float* h = h0;
    for (int l = 0; l < static_cast<int>(cfg.n_layers); ++l) {
      layer_forward(l, h, cap);
      h = layers[l]["layer_output"];
    }
    float* hin = bb["norm_f/norm_f_input"];
    copy_d2d(s, hin, h, d.BT * d.dm);
    rmsnorm_forward<float>(s, d.BT, d.dm, hin, P(-1, "norm_f_weight"), bb["norm_f/Out"],
                           bb["norm_f/norm_f_rms"]);
    capture(cap, -1, "norm_f", Dir::Forward);
    collect_marks();
    have_forward = true;
  }

  void backward(Capture* cap) {
    M3_REQUIRE(have_forward, "GpuBackbone::backward", "backward called before forward", "");
    mark("start");
    float* dnorm = bb["norm_f/d_norm"];
    rmsnorm_backward<float>(s, d.BT, d.dm, bb["norm_f/norm_f_input"], P(-1, "norm_f_weight"),
                            bb["norm_f/norm_f_rms"], bb["d_out"], dnorm, G(-1, "norm_f_weight"),
                            scr());
    capture(cap, -1, "norm_f", Dir::Backward);
    float* delta = bb["delta"];
    copy_d2d(s, delta, dnorm, d.BT * d.dm);
    for (int l = static_cast<int>(cfg.n_layers) - 1; l >= 0; --l) layer_backward(l, delta, cap);
    float* dx = bb["input_proj/d_input_proj_dx"];
    if (cfg.input_proj_identity) {
      copy_d2d(s, dx, delta, d.BT * d.dm);
    } else {
      gemm_backward_dx<float>(ctx, d.BT, d.in, d.dm, delta, P(-1, "input_proj_w"), dx);
      gemm_backward_dw<float>(ctx, d.BT, d.in, d.dm, bb["input_proj/input_proj_inputs"], delta,
                              G(-1, "input_proj_w"));
      colsum(s, d.BT, d.dm, delta, G(-1, "input_proj_b"), true, scr());
    }
    capture(cap, -1, "input_proj", Dir::Backward);
    collect_marks();
  }
};

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

GpuBackbone::GpuBackbone(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode) {
  const std::string why = unsupported(cfg, B, T);
  M3_REQUIRE(why.empty(), "GpuBackbone", "configuration not supported on the GPU", why);
  impl_ = std::make_unique<Impl>(ctx, cfg, B, T, mode);
}

GpuBackbone::~GpuBackbone() = default;

void GpuBackbone::set_params(const Params<float>& p) {
  check_params(p, impl_->cfg, "GpuBackbone::set_params");
  for_each_param(p, [&](int l, const char* name, const std::vector<float>& v) {
    impl_->params.at(param_key(l, name).substr(5)).upload(v.data(), impl_->s);
  });
}

void GpuBackbone::set_input(const std::vector<float>& X) {
  Buf& b = impl_->bb.at("input_proj/input_proj_inputs");
  M3_REQUIRE(static_cast<Idx>(X.size()) == b.size(), "GpuBackbone::set_input",
             "input X has the wrong size", "got ", X.size(), ", expected ", b.size());
  b.upload(X.data(), impl_->s);
}

namespace {
void upload_states(const States<float>& st, Buf& ssm, Buf& k, Buf& v, Buf& angle,
                   cudaStream_t s, const char* what) {
  auto put = [&](const std::vector<float>& h, Buf& b, const char* name) {
    M3_REQUIRE(static_cast<Idx>(h.size()) == b.size(), what,
               std::string(name) + " state has the wrong size", "got ", h.size(), ", expected ",
               b.size());
    b.upload(h.data(), s);
  };
  put(st.ssm, ssm, "ssm");
  put(st.k, k, "k");
  put(st.v, v, "v");
  put(st.angle, angle, "angle");
}
States<float> download_states(const Buf& ssm, const Buf& k, const Buf& v, const Buf& angle,
                              cudaStream_t s) {
  States<float> st;
  st.ssm.resize(static_cast<size_t>(ssm.size()));
  st.k.resize(static_cast<size_t>(k.size()));
  st.v.resize(static_cast<size_t>(v.size()));
  st.angle.resize(static_cast<size_t>(angle.size()));
  ssm.download(st.ssm.data(), s);
  k.download(st.k.data(), s);
  v.download(st.v.data(), s);
  angle.download(st.angle.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return st;
}
}  // namespace

void GpuBackbone::set_states(const States<float>& st) {
  Impl& m = *impl_;
  upload_states(st, m.st_ssm, m.st_k, m.st_v, m.st_angle, m.s, "GpuBackbone::set_states");
}

void GpuBackbone::set_dout(const std::vector<float>& d_out) {
  Buf& b = impl_->bb.at("d_out");
  M3_REQUIRE(static_cast<Idx>(d_out.size()) == b.size(), "GpuBackbone::set_dout",
             "dOut has the wrong size", "got ", d_out.size(), ", expected ", b.size());
  b.upload(d_out.data(), impl_->s);
}

void GpuBackbone::set_leaving_grads(const States<float>* dl) {
  Impl& m = *impl_;
  if (!dl) {
    for (Buf* b : {&m.dl_ssm, &m.dl_k, &m.dl_v, &m.dl_angle}) b->zero(m.s);
    return;
  }
  upload_states(*dl, m.dl_ssm, m.dl_k, m.dl_v, m.dl_angle, m.s,
                "GpuBackbone::set_leaving_grads");
}

void GpuBackbone::zero_grads() {
  for (auto& [k, g] : impl_->grads) g.zero(impl_->s);
}

void GpuBackbone::forward(Capture* cap) { impl_->forward(cap); }
void GpuBackbone::backward(Capture* cap) { impl_->backward(cap); }
void GpuBackbone::synchronize() const { impl_->ctx.synchronize(); }

void GpuBackbone::set_profiling(bool on) { impl_->profiling = on; }
std::vector<std::pair<std::string, double>> GpuBackbone::stage_times() const {
  return impl_->times;
}
void GpuBackbone::reset_stage_times() { impl_->times.clear(); }

std::vector<float> GpuBackbone::output() const {
  const Buf& b = impl_->bb.at("norm_f/Out");
  std::vector<float> h(static_cast<size_t>(b.size()));
  b.download(h.data(), impl_->s);
  impl_->ctx.synchronize();
  return h;
}

std::vector<float> GpuBackbone::d_x() const {
  const Buf& b = impl_->bb.at("input_proj/d_input_proj_dx");
  std::vector<float> h(static_cast<size_t>(b.size()));
  b.download(h.data(), impl_->s);
  impl_->ctx.synchronize();
  return h;
}

States<float> GpuBackbone::states() const {
  const Impl& m = *impl_;
  return download_states(m.st_ssm, m.st_k, m.st_v, m.st_angle, m.s);
}

States<float> GpuBackbone::d_entering() const {
  const Impl& m = *impl_;
  return download_states(m.de_ssm, m.de_k, m.de_v, m.de_angle, m.s);
}

Params<float> GpuBackbone::grads() const {
  Params<float> g = zero_params<float>(impl_->cfg);
  for_each_param(g, [&](int l, const char* name, std::vector<float>& v) {
    impl_->grads.at(param_key(l, name).substr(5)).download(v.data(), impl_->s);
  });
  impl_->ctx.synchronize();
  return g;
}

Capture run_gpu(GpuContext& ctx, const Problem& pb, ScanMode mode) {
  Capture cap(pb.cfg, pb.B, pb.T);
  GpuBackbone net(ctx, pb.cfg, pb.B, pb.T, mode);
  net.set_params(cast_params<float>(pb.params));
  net.set_input(std::vector<float>(pb.x.begin(), pb.x.end()));
  net.set_states(cast_states<float>(pb.states));
  net.set_dout(std::vector<float>(pb.d_out.begin(), pb.d_out.end()));
  net.set_leaving_grads(nullptr);
  net.zero_grads();
  net.forward(&cap);
  net.backward(&cap);
  capture_grads(net.grads(), pb.cfg, cap);
  return cap;
}

}  // namespace m3::gpu
