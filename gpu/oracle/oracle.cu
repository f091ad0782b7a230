// GpuOracle (oracle_gpu.hpp): the buffers of layout.hpp on the device, the executor of the stage
// chain (reference/chain.hpp) over the stage functions of stages.cuh, and what reads the results
// (tensor(), the observer, a Capture, the downloads).
//
//   forward    H⁰ = X·W_in + b_in (or X, or the embedding's gather); per layer F1 … F8 on that
//              layer's buffers, entering states from a copy taken at the start, leaving states
//              into the state buffers; Out = RMSNorm(H^L)
//   lm ends    logits = Out·head_w, lse and the loss; d_logits, d_Out = d_logits·head_wᵀ,
//              d head_w += Outᵀ·d_logits
//   backward   δ^L = norm_f's backward of dOut (or d_Out); per layer from the last B8 … B1
//              with δ = the layer above's d_temporal; δ⁰ into input_proj's gradients and dX
// Weight gradients accumulate into the gradient arena (MODEL.md §6.0); everything else is
// overwritten. Every buffer is allocated and zeroed in the constructor (set_perturbation adds
// the staged typed copy of δ, [B·T, d_model]).
//
// The perturbed mode (oracle_gpu.hpp, perturb.cuh): after each layer stage, before the observer
// and the capture see it, every provided tensor the stage wrote (ChainPlan::written_by: its rows
// and its pseudo-stages', F1's residual excepted) gets one rounding at its registry storage;
// F4 first carries b/c_normed's rounding into a cancelling bias add. The backbone stages round
// their outputs inside their stage functions, where harness/perturbed.cpp's PerturbedRun does
// (the head's d_logits before its GEMMs), and the GEMMs that read δ (B8, input_proj's backward)
// read its perturbed typed copy.
//
// The teacher-forced mode (set_teacher; harness/perturbed.cpp's PerturbedRun with a teacher):
// before each stage every provided tensor it may read is the teacher's, copied from the teacher's
// buffer and, in the perturbed mode, rounded once as a load (its own stream, "L0/F6/y#teacher",
// so each load of a key gives the same values): for a layer stage every provided tensor of the
// layer (forward ones before a forward stage; forward and backward ones, and δ entering the
// layer, before a backward stage; not the states and state gradients, which no stage of the
// layer reads); norm_f, the head and the loss load what they read (norm_f's
// input and rms, Out, logits, lse; norm_f's backward the head's d_Out; input_proj's backward
// δ⁰). The head's GEMMs read the teacher's d_logits while the stage shows its own.
#include "oracle_gpu.hpp"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "backbone.hpp"  // reference: capture_grads
#include "chain.hpp"
#include "common.cuh"
#include "error.hpp"
#include "layout.hpp"
#include "lm.hpp"  // reference: embed_order
#include "perturb.cuh"
#include "stages.cuh"

namespace m3::gpu {

using oracle::Dims;
using oracle::LayerDev;

std::string oracle_unavailable() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return std::string("no usable CUDA device: ") + cudaGetErrorString(e);
  if (n == 0) return "no CUDA device";
  return "";
}

namespace {

std::string gib(std::size_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / (1u << 30));
  return buf;
}

// A provided registry row by key, for tensor().
struct Row {
  int layer;
  const TensorSpec* spec;
};

}  // namespace

struct GpuOracle::Impl {
  friend struct m3::ChainAccess;

  Config cfg;
  Idx B, T;
  OracleKeep keep;
  Dims d;
  ChainPlan plan;
  oracle::Layout layout;
  ParamLayout params_layout;
  std::vector<void*> mem;  // one device allocation per layout.allocs entry
  cudaStream_t s = nullptr;
  cublasHandle_t blas = nullptr;
  oracle::Work work{};
  std::map<std::string, Row> rows;  // every provided stage key

  OracleObserver observer;
  Capture* cap = nullptr;
  bool have_forward = false, tokens = false, targets = false, have_loss = false;
  bool dout_from_head = false;  // norm_f's backward reads head/d_Out (after backward_loss)
  double n_norm = 0, loss_scale = 1, loss_value = 0;
  OraclePerturbation pert;       // off unless set_perturbation turned it on
  double* delta_copy = nullptr;  // δ's perturbed typed copy [B·T, d_model] (when u_typed > 0)
  const Impl* teacher = nullptr;   // the teacher-forced mode (set_teacher)
  double* own_d_logits = nullptr;  // the head's own d_logits while its GEMMs read the teacher's
  // set_params' host image of the parameter arena, page-locked so that its upload runs at the
  // bus's speed; made on first use, zero where the config has no such parameter.
  double* param_staging = nullptr;

  Impl(const Config& c, Idx B_, Idx T_, OracleKeep k, int device)
      : cfg(c),
        B(B_),
        T(T_),
        keep(k),
        d(Dims::of(c, B_, T_)),
        plan(ChainPlan::of(c, ScanMode::Sequential)),
        layout(oracle::plan(c, B_, T_, k)),
        params_layout(param_layout(c)) {
    const std::string why = oracle_unavailable();
    M3_REQUIRE(why.empty(), "GpuOracle", "no GPU", why);
    M3_CUDA_CHECK(cudaSetDevice(device));
    std::size_t free_b = 0, total_b = 0;
    M3_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    const std::size_t need = layout.memory().total();
    M3_REQUIRE(need <= free_b, "GpuOracle", "not enough device memory for this shape", "needs ",
               gib(need), ", ", gib(free_b), " free",
               keep == OracleKeep::All
                   ? " (OracleKeep::Backward needs " +
                         gib(oracle_memory(c, B_, T_, OracleKeep::Backward).total()) + ")"
                   : std::string());
    mem.assign(layout.allocs.size(), nullptr);
    try {  // a failure half-way gives back what was taken (no destructor runs for it)
      M3_CUDA_CHECK(cudaStreamCreate(&s));
      M3_CUBLAS_CHECK(cublas().create(&blas));
      M3_CUBLAS_CHECK(cublas().set_stream(blas, s));
      M3_CUBLAS_CHECK(cublas().set_math_mode(blas, CUBLAS_PEDANTIC_MATH));
      M3_CUBLAS_CHECK(cublas().set_pointer_mode(blas, CUBLAS_POINTER_MODE_HOST));
      for (size_t i = 0; i < layout.allocs.size(); ++i) {
        const std::size_t bytes = std::max<std::size_t>(layout.allocs[i].bytes(), 8);
        M3_CUDA_CHECK(cudaMalloc(&mem[i], bytes));
        M3_CUDA_CHECK(cudaMemsetAsync(mem[i], 0, bytes, s));
      }
      M3_CUDA_CHECK(cudaStreamSynchronize(s));
    } catch (...) {
      release();
      throw;
    }
    work = {o("scan_h"),  o("scan_g"), o("scan_colpart"), o("scan_scalpart"), o("scan_dd"),
            o("d_k"),     o("d_q"),    o("theta_bar"), o("row_scratch")};
    for (const KeyedSpec& k : oracle_stage_keys(cfg, B, T)) rows[k.key] = {k.layer, k.spec};
  }

  ~Impl() { release(); }
  void release() {
    for (void*& p : mem) {
      if (p) cudaFree(p);
      p = nullptr;
    }
    if (delta_copy) cudaFree(delta_copy);
    delta_copy = nullptr;
    if (own_d_logits) cudaFree(own_d_logits);
    own_d_logits = nullptr;
    if (param_staging) cudaFreeHost(param_staging);
    param_staging = nullptr;
    if (blas) cublas().destroy(blas);
    blas = nullptr;
    if (s) cudaStreamDestroy(s);
    s = nullptr;
  }

  // ---- buffers ------------------------------------------------------------------------------
  double* o(const std::string& name) const {
    return static_cast<double*>(mem[static_cast<size_t>(layout.other.at(name))]);
  }
  template <class U>
  U* typed(const std::string& name) const {
    return static_cast<U*>(mem[static_cast<size_t>(layout.other.at(name))]);
  }
  // Layer l's buffer of a tensor (nullptr when the run has no such tensor).
  double* lt(int l, const std::string& name) const {
    const auto& m = layout.layer[static_cast<size_t>(l)];
    auto it = m.find(name);
    return it == m.end() ? nullptr : static_cast<double*>(mem[static_cast<size_t>(it->second)]);
  }
  bool shared(int l, const std::string& name) const {
    const auto& m = layout.layer[static_cast<size_t>(l)];
    auto it = m.find(name);
    return it != m.end() &&
           layout.allocs[static_cast<size_t>(it->second)].name.rfind("shared:", 0) == 0;
  }
  double* h0() const { return o("input_proj/input_proj_outputs"); }
  double* layer_input(int l) const { return l == 0 ? h0() : lt(l - 1, "layer_output"); }
  double* last_output() const { return lt(static_cast<int>(cfg.n_layers) - 1, "layer_output"); }
  // Layer l's slice of a [L][B][…] state buffer ("leaving/ssm", …).
  Idx state_per(const std::string& st) const {  // elements per (layer, b)
    const StateSizes z = state_sizes(cfg);
    return st == "ssm" ? z.ssm : st == "k" ? z.k : st == "v" ? z.v : z.angle;
  }
  double* state(const std::string& which, const char* st, int l) const {
    return o(which + "/" + st) + static_cast<Idx>(l) * B * state_per(st);
  }
  double* P(int l, const char* name) const {
    return o("params") + params_layout.at(l, name).offset;
  }
  double* G(int l, const char* name) const { return o("grads") + params_layout.at(l, name).offset; }
  LayerDev layer(int l) const {
    LayerDev L{};
    L.residual = layer_input(l);
#define M3_ORACLE_OWN(n) L.n = lt(l, #n);
    M3_ORACLE_LAYER_TENSORS(M3_ORACLE_OWN)
#undef M3_ORACLE_OWN
    L.ssm_in = state("entering", "ssm", l);
    L.k_in = state("entering", "k", l);
    L.v_in = state("entering", "v", l);
    L.angle_in = state("entering", "angle", l);
    L.ssm_out = state("leaving", "ssm", l);
    L.k_out = state("leaving", "k", l);
    L.v_out = state("leaving", "v", l);
    L.angle_out = state("leaving", "angle", l);
    L.d_ssm_out = state("d_leaving", "ssm", l);
    L.d_k_out = state("d_leaving", "k", l);
    L.d_v_out = state("d_leaving", "v", l);
    L.d_angle_out = state("d_leaving", "angle", l);
    L.d_ssm_in = state("d_entering", "ssm", l);
    L.d_k_in = state("d_entering", "k", l);
    L.d_v_in = state("d_entering", "v", l);
    L.d_angle_in = state("d_entering", "angle", l);
#define M3_ORACLE_PARAM(n) \
  L.p.n = P(l, #n);        \
  L.g.n = G(l, #n);
    M3_ORACLE_LAYER_PARAMS(M3_ORACLE_PARAM)
#undef M3_ORACLE_PARAM
    return L;
  }

  // The device buffer of a provided registry tensor of layer l (−1: backbone), and whether
  // OracleKeep::Backward shares it between layers.
  double* buffer(int l, const TensorSpec& spec, bool* is_shared = nullptr) const {
    const std::string st = spec.stage, t = spec.tensor;
    if (is_shared) *is_shared = false;
    if (l < 0) return st == "norm_f" && t == "norm_f_input" ? last_output() : o(st + "/" + t);
    if (st == "F1" && t == "residual") return layer_input(l);
    if (st == "states") return state("leaving", t.substr(0, t.size() - 6).c_str(), l);
    if (st == "d_states") return state("d_entering", t.substr(2, t.size() - 8).c_str(), l);
    if (is_shared) *is_shared = shared(l, t);
    return lt(l, t);
  }
  OracleTensor view(int l, const TensorSpec& spec) const {
    OracleTensor v;
    v.key = stage_key(l, spec.stage, spec.tensor);
    v.layer = l;
    v.data = buffer(l, spec);
    v.shape = resolve_shape(spec.shape, cfg, B, T);
    v.circular = spec.circular;
    return v;
  }

  std::vector<double> download(const double* p, Idx n) const {
    std::vector<double> host(static_cast<size_t>(n));
    if (n > 0)
      M3_CUDA_CHECK(cudaMemcpyAsync(host.data(), p, static_cast<size_t>(n) * sizeof(double),
                                    cudaMemcpyDeviceToHost, s));
    M3_CUDA_CHECK(cudaStreamSynchronize(s));
    return host;
  }
  template <class U>
  void upload(U* dst, const U* src, Idx n) {
    if (n > 0)
      M3_CUDA_CHECK(
          cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * sizeof(U), cudaMemcpyHostToDevice, s));
    M3_CUDA_CHECK(cudaStreamSynchronize(s));
  }

  // ---- the perturbed mode (perturb.cuh) -------------------------------------------------------
  double u_of(bool typed) const { return typed ? pert.u_typed : pert.u_f32; }
  std::uint64_t stream_of(int l, const char* stage, const char* tensor) const {
    return oracle::tensor_stream(pert.seed, stage_key(l, stage, tensor));
  }
  // One rounding of a provided tensor of layer l (−1: backbone), at its registry storage.
  void perturb(int l, const TensorSpec& spec) {
    if (!pert.on()) return;
    oracle::perturb(s, shape_numel(resolve_shape(spec.shape, cfg, B, T)), buffer(l, spec),
                    u_of(spec.typed), pert.tiny, stream_of(l, spec.stage, spec.tensor), pert.exact,
                    pert.coherent);
  }
  void perturb(int l, const char* stage, const char* tensor) {
    perturb(l, find_spec(stage, tensor));
  }
  // After layer stage st: every provided tensor it wrote (its pseudo-stages' too), but F1's
  // residual (the layer input, rounded where it was written). F4: b/c_biased with the carry of
  // b/c_normed's rounding (perturb.cuh), queued before b/c_normed's own pass.
  void perturb_stage(StageId st, int l) {
    if (!pert.on()) return;
    auto carry = [&](const char* normed, const char* biased) {
      const TensorSpec &sn = find_spec("F4", normed), &sb = find_spec("F4", biased);
      oracle::perturb_bias_add(s, d, buffer(l, sn), buffer(l, sb), u_of(sn.typed),
                               u_of(sb.typed), pert.tiny, stream_of(l, "F4", normed),
                               stream_of(l, "F4", biased), pert.exact, pert.coherent);
    };
    if (st == StageId::F4) {
      carry("b_normed", "b_biased");
      carry("c_normed", "c_biased");
    }
    for (const TensorSpec* spec : plan.written_by(st)) {
      const std::string t = spec->tensor;
      if (!oracle::provided(*spec, cfg) || (st == StageId::F1 && t == "residual") ||
          (st == StageId::F4 && (t == "b_biased" || t == "c_biased")))
        continue;
      perturb(l, *spec);
    }
  }
  // A coherent draw's accumulation error of a forward GEMM out = x·w (OraclePerturbation::
  // coherent), before out's storage rounding; its own stream ("L0/F2#accumulation").
  void accumulation(int l, const char* stage, Idx n, Idx m, const double* x, const double* w,
                    double* out) {
    if (!pert.on() || !pert.coherent || pert.exact) return;
    oracle::accumulation(s, d.BT, n, m, x, w, out, pert.u_f32,
                         oracle::tensor_stream(pert.seed, stage_key(l, stage, "#accumulation")));
  }
  // The GEMMs' operand δ (B8; input_proj's backward, key_layer −1): its perturbed typed copy, or
  // δ itself when typed values are not perturbed.
  const double* typed_delta(const double* dlt, int key_layer) {
    if (!pert.on() || pert.u_typed == 0) return dlt;
    oracle::perturbed_copy(s, d.BT * d.dm, dlt, delta_copy, pert.u_typed, pert.tiny,
                           stream_of(key_layer, key_layer < 0 ? "input_proj" : "B8",
                                     "delta_typed"),
                           pert.exact, pert.coherent);
    return delta_copy;
  }

  // ---- the teacher-forced mode (set_teacher) --------------------------------------------------
  // The teacher's values of a provided tensor in this oracle's buffer of it, rounded once as a
  // load in the perturbed mode (the same values at every load of the pass).
  void load(const std::string& key) {
    const Row& r = rows.at(key);
    const TensorSpec& spec = *r.spec;
    const Idx n = shape_numel(resolve_shape(spec.shape, cfg, B, T));
    double* dst = buffer(r.layer, spec);
    oracle::copy(s, n, teacher->buffer(r.layer, spec), dst);
    if (pert.on())
      oracle::perturb(s, n, dst, u_of(spec.typed), pert.tiny,
                      oracle::tensor_stream(pert.seed, key + "#teacher"), pert.exact,
                      pert.coherent);
  }
  // Before a layer stage: every provided tensor of the layer the teacher's (a backward stage:
  // the backward ones and δ entering the layer too) — but the leaving states and the
  // entering-state gradients, which no stage of the layer reads and which their pseudo-stages
  // show stages after F6 (B6, B5a) wrote them.
  void load_layer(int l, Dir dir) {
    for (const auto& [key, r] : rows) {
      const std::string_view stage = r.spec->stage;
      if (r.layer == l && (dir == Dir::Backward || r.spec->dir == Dir::Forward) &&
          stage != "states" && stage != "d_states")
        load(key);
    }
    if (dir == Dir::Backward) load(entering_gradient(l, static_cast<int>(cfg.n_layers)).key());
  }
  // Before a backbone stage: what it reads.
  void load_backbone(StageId st, Dir dir) {
    const bool bwd = dir == Dir::Backward;
    switch (st) {
      case StageId::input_proj:
        if (bwd) load(entering_gradient(-1, static_cast<int>(cfg.n_layers)).key());
        return;
      case StageId::norm_f:
        load("norm_f/norm_f_input");
        if (bwd) load("norm_f/norm_f_rms");
        if (bwd && dout_from_head) load("head/d_Out");
        return;
      case StageId::head:
        load("norm_f/Out");
        if (bwd) {
          load("head/logits");
          load("loss/lse");
        }
        return;
      case StageId::loss:
        load("head/logits");
        return;
      default:
        return;
    }
  }

  // ---- the executor of chain.hpp -----------------------------------------------------------
  void before(StageId st, int l, Dir dir) {
    if (!teacher) return;
    if (l >= 0) return load_layer(l, dir);
    load_backbone(st, dir);
  }
  // A layer stage's written tensors perturbed (the perturbed mode; the backbone stages round
  // inside their stage functions), then shown.
  void after(StageId st, int l, Dir dir) {
    if (l >= 0) perturb_stage(st, l);
    show(st, l, dir);
  }
  // The stage's provided tensors to the observer and the capture.
  void show(StageId st, int l, Dir dir) {
    if (!cap && !observer) return;
    OracleStage out{st, l, dir, {}};
    if (l >= 0) {
      for (const TensorSpec* spec : plan.rows_of(st))
        if (oracle::provided(*spec, cfg)) out.tensors.push_back(view(l, *spec));
    } else {
      for (const TensorSpec& spec : stage_registry())
        if (spec.scope == Scope::Backbone && spec.dir == dir &&
            spec.stage == std::string(stage_name(st)) && oracle::provided(spec, cfg))
          out.tensors.push_back(view(-1, spec));
    }
    if (observer) observer(out);
    if (cap) {
      for (const OracleTensor& v : out.tensors) {
        const std::vector<double> host = download(v.data, v.numel());
        const TensorSpec& spec = *rows.at(v.key).spec;
        cap->put_stage(l, spec.stage, spec.tensor, host.data(), v.numel());
      }
    }
  }
  void pseudo(StageId st, int l, Dir dir) { show(st, l, dir); }  // rounded by its writer
  void enter_layer(int) {}
  void leave_layer(int) {}
  void enter_layer_backward(int) {}
  void leave_layer_backward(int) {}

  // δ entering layer l's backward.
  const double* delta(int l) const {
    const TensorRef ref = entering_gradient(l, static_cast<int>(cfg.n_layers));
    return ref.layer < 0 ? o("norm_f/d_norm") : lt(ref.layer, "d_temporal");
  }

  template <StageId st>
  void forward(Stage<st>, int l) {
    const LayerDev L = layer(l);
    switch (st) {
      case StageId::F1:
        oracle::rmsnorm_forward(s, d.BT, d.dm, L.residual, L.p.norm_weight, L.post_norm,
                                L.rms_vals);
        return;
      case StageId::F2:
        oracle::gemm_xw(blas, d.BT, d.dm, d.ip, L.post_norm, L.p.in_proj_w, L.proj);
        accumulation(l, "F2", d.dm, d.ip, L.post_norm, L.p.in_proj_w, L.proj);
        return;
      case StageId::F3:
        oracle::split_forward(s, d, L);
        return;
      case StageId::F4:
        oracle::bcnorm_forward(s, d, L);
        return;
      case StageId::F5:
        oracle::angle_forward(s, d, L);
        return;
      case StageId::F4ef:
        oracle::rope_forward(s, d, L);
        return;
      case StageId::F5b:
        oracle::abg_forward(s, d, L);
        return;
      case StageId::F6:
        oracle::ssm_forward(s, d, L, work);
        return;
      case StageId::F7:
        oracle::gating_forward(s, d, L);
        return;
      case StageId::F8:
        oracle::gemm_xw(blas, d.BT, d.di, d.dm, L.gated, L.p.out_proj_w, L.out_flat);
        accumulation(l, "F8", d.di, d.dm, L.gated, L.p.out_proj_w, L.out_flat);
        oracle::add(s, d.BT * d.dm, L.residual, L.out_flat, L.layer_output);
        return;
      default:
        break;
    }
    throw Error("GpuOracle", "not a layer forward stage", stage_name(st));
  }

  template <StageId st>
  void backward(Stage<st>, int l) {
    const LayerDev L = layer(l);
    const double* dlt = delta(l);
    switch (st) {
      case StageId::B8: {
        const double* dlt_typed = typed_delta(dlt, l);
        oracle::gemm_dx(blas, d.BT, d.di, d.dm, dlt_typed, L.p.out_proj_w, L.d_gated);
        oracle::gemm_dw(blas, d.BT, d.di, d.dm, L.gated, dlt_typed, L.g.out_proj_w);
        return;
      }
      case StageId::B7:
        oracle::gating_backward(s, d, L, work);
        return;
      case StageId::B6:  // and the entering ssm, k, v state gradients
        oracle::ssm_backward(s, d, L, work);
        oracle::rope_backward(s, d, L, work);
        return;
      case StageId::B5a:
        oracle::angle_backward(s, d, L, work);
        return;
      case StageId::B5b:
        oracle::activations_backward(s, d, L);
        return;
      case StageId::B4b:
        oracle::bcnorm_backward(s, d, L, work);
        return;  // and B4c's tensors
      case StageId::B3:
        oracle::split_backward(s, d, L);
        return;
      case StageId::B2:
        oracle::gemm_dx(blas, d.BT, d.dm, d.ip, L.d_proj, L.p.in_proj_w, L.d_norm);
        oracle::gemm_dw(blas, d.BT, d.dm, d.ip, L.post_norm, L.d_proj, L.g.in_proj_w);
        return;
      case StageId::B1:
        oracle::rmsnorm_backward(s, d.BT, d.dm, L.residual, L.p.norm_weight, L.rms_vals, L.d_norm,
                                 L.d_pre_norm, L.g.norm_weight, work.row_scratch);
        oracle::add(s, d.BT * d.dm, dlt, L.d_pre_norm, L.d_temporal);
        return;
      default:
        break;
    }
    throw Error("GpuOracle", "not a layer backward stage", stage_name(st));
  }

  // input_proj: the embedding's gather (and the one-hot input), X itself, or X·W_in + b_in.
  void forward(Stage<StageId::input_proj>, int) {
    double* X = o("input_proj/input_proj_inputs");
    if (tokens) {
      oracle::embed_forward(s, d.BT, cfg.vocab_size, d.dm, typed<int>("tok"), P(-1, "input_proj_w"),
                            P(-1, "input_proj_b"), h0(), X);
    } else if (cfg.input_proj_identity) {
      oracle::copy(s, d.BT * d.dm, X, h0());
    } else {
      oracle::gemm_xw(blas, d.BT, d.in, d.dm, X, P(-1, "input_proj_w"), h0());
      oracle::add_row_vector(s, d.BT, d.dm, P(-1, "input_proj_b"), h0());
    }
    if (!cfg.input_proj_identity) perturb(-1, "input_proj", "input_proj_outputs");
  }
  void forward(Stage<StageId::norm_f>, int) {
    oracle::rmsnorm_forward(s, d.BT, d.dm, last_output(), P(-1, "norm_f_weight"), o("norm_f/Out"),
                            o("norm_f/norm_f_rms"));
    perturb(-1, "norm_f", "Out");
    perturb(-1, "norm_f", "norm_f_rms");
  }
  void forward(Stage<StageId::head>, int) {
    oracle::gemm_xw(blas, d.BT, d.dm, cfg.vocab_size, o("norm_f/Out"), P(-1, "head_w"),
                    o("head/logits"));
    perturb(-1, "head", "logits");
  }
  // The loss value from lse before lse's rounding (as the CPU's perturbed run).
  void forward(Stage<StageId::loss>, int) {
    oracle::loss_forward(s, d.BT, cfg.vocab_size, o("head/logits"), typed<int>("tgt"),
                         typed<float>("w"), n_norm, o("loss/lse"), o("loss/value"));
    perturb(-1, "loss", "lse");
  }
  void backward(Stage<StageId::head>, int) {
    const Idx V = cfg.vocab_size;
    oracle::loss_backward(s, d.BT, V, o("head/logits"), o("loss/lse"), typed<int>("tgt"),
                          typed<float>("w"), n_norm, loss_scale, o("head/d_logits"));
    perturb(-1, "head", "d_logits");  // what the head's GEMMs read
    if (teacher) {  // the GEMMs read the teacher's d_logits, the stage shows its own
      oracle::copy(s, d.BT * V, o("head/d_logits"), own_d_logits);
      load("head/d_logits");
    }
    oracle::gemm_dx(blas, d.BT, d.dm, V, o("head/d_logits"), P(-1, "head_w"), o("head/d_Out"));
    oracle::gemm_dw(blas, d.BT, d.dm, V, o("norm_f/Out"), o("head/d_logits"), G(-1, "head_w"));
    perturb(-1, "head", "d_Out");
    if (teacher) oracle::copy(s, d.BT * V, own_d_logits, o("head/d_logits"));
  }
  void backward(Stage<StageId::norm_f>, int) {
    const double* g = dout_from_head ? o("head/d_Out") : o("d_out");
    oracle::rmsnorm_backward(s, d.BT, d.dm, last_output(), P(-1, "norm_f_weight"),
                             o("norm_f/norm_f_rms"), g, o("norm_f/d_norm"), G(-1, "norm_f_weight"),
                             work.row_scratch);
    perturb(-1, "norm_f", "d_norm");
  }
  // dX = δ⁰·W_inᵀ (or δ⁰); d W_in += Xᵀ·δ⁰ (a token model: the per-token sum of δ⁰'s rows);
  // d b_in += Σ_r δ⁰. The perturbed mode: the GEMMs (and the embedding's sum) read δ⁰'s
  // perturbed typed copy, the bias gradient δ⁰ itself.
  void backward(Stage<StageId::input_proj>, int) {
    const double* d0 = lt(0, "d_temporal");
    double* dx = o("input_proj/d_input_proj_dx");
    if (cfg.input_proj_identity) {
      oracle::copy(s, d.BT * d.dm, d0, dx);
      return;
    }
    const double* d0_typed = typed_delta(d0, -1);
    if (tokens) {
      oracle::embed_backward(s, cfg.vocab_size, d.dm, typed<Idx>("embed_order"),
                             typed<Idx>("embed_starts"), d0_typed, G(-1, "input_proj_w"));
    } else {
      oracle::gemm_dw(blas, d.BT, d.in, d.dm, o("input_proj/input_proj_inputs"), d0_typed,
                      G(-1, "input_proj_w"));
    }
    oracle::gemm_dx(blas, d.BT, d.in, d.dm, d0_typed, P(-1, "input_proj_w"), dx);
    oracle::sum_rows_into(s, d.BT, d.dm, d0, G(-1, "input_proj_b"));
    perturb(-1, "input_proj", "d_input_proj_dx");
  }

  // ---- passes ---------------------------------------------------------------------------------
  void run_forward(Capture* c) {
    // The entering states of this pass (the backward and F5, F6 read them): a copy of the
    // current states, which the pass then replaces with the leaving ones.
    for (const char* st : {"ssm", "k", "v", "angle"})
      oracle::copy(s, static_cast<Idx>(cfg.n_layers) * B * state_per(st),
                   o(std::string("leaving/") + st), o(std::string("entering/") + st));
    cap = c;
    try {
      chain_forward(*this, plan);
    } catch (...) {
      cap = nullptr;
      throw;
    }
    cap = nullptr;
    M3_CUDA_CHECK(cudaStreamSynchronize(s));
    have_forward = true;
    have_loss = false;
    dout_from_head = false;
  }
  void run_backward(Capture* c) {
    M3_REQUIRE(have_forward, "GpuOracle::backward", "backward called before forward", "");
    cap = c;
    try {
      chain_backward(*this, plan);
    } catch (...) {
      cap = nullptr;
      throw;
    }
    cap = nullptr;
    M3_CUDA_CHECK(cudaStreamSynchronize(s));
  }
  template <class F>
  void with_capture(Capture* c, F&& f) {
    cap = c;
    try {
      f();
    } catch (...) {
      cap = nullptr;
      throw;
    }
    cap = nullptr;
  }
};

GpuOracle::GpuOracle(const Config& cfg, Idx B, Idx T, OracleKeep keep, int device)
    : impl_(std::make_unique<Impl>(cfg, B, T, keep, device)) {}
GpuOracle::~GpuOracle() = default;

const Config& GpuOracle::config() const { return impl_->cfg; }
OracleKeep GpuOracle::keep() const { return impl_->keep; }
OracleMemory GpuOracle::memory() const {
  const Impl& m = *impl_;
  OracleMemory out = m.layout.memory();
  if (m.delta_copy) out.workspace += static_cast<std::size_t>(m.d.BT * m.d.dm) * sizeof(double);
  if (m.own_d_logits)
    out.workspace += static_cast<std::size_t>(m.d.BT * m.cfg.vocab_size) * sizeof(double);
  return out;
}
void* GpuOracle::stream() const { return impl_->s; }
void GpuOracle::synchronize() const { M3_CUDA_CHECK(cudaStreamSynchronize(impl_->s)); }
void GpuOracle::set_observer(OracleObserver obs) { impl_->observer = std::move(obs); }

void GpuOracle::set_perturbation(const OraclePerturbation& p) {
  Impl& m = *impl_;
  const char* where = "GpuOracle::set_perturbation";
  for (const auto& [name, u] : {std::pair<const char*, double>{"u_typed", p.u_typed},
                                std::pair<const char*, double>{"u_f32", p.u_f32}})
    M3_REQUIRE(std::isfinite(u) && u >= 0 && u < 1, where,
               std::string(name) + " must be a unit roundoff in [0, 1)", name, "=", u);
  M3_REQUIRE(std::isfinite(p.tiny) && p.tiny >= 0, where, "tiny must be finite and >= 0",
             "tiny=", p.tiny);
  if (p.on() && p.u_typed != 0 && !m.delta_copy)
    M3_CUDA_CHECK(cudaMalloc(&m.delta_copy,
                             static_cast<std::size_t>(m.d.BT * m.d.dm) * sizeof(double)));
  m.pert = p;
}

const OraclePerturbation& GpuOracle::perturbation() const { return impl_->pert; }

void GpuOracle::set_teacher(const GpuOracle* teacher) {
  Impl& m = *impl_;
  const char* where = "GpuOracle::set_teacher";
  if (teacher) {
    const Impl& t = *teacher->impl_;
    M3_REQUIRE(teacher != this, where, "an oracle cannot be its own teacher", "");
    M3_REQUIRE(t.keep == OracleKeep::All, where,
               "the teacher must keep every tensor (OracleKeep::All)", "");
    M3_REQUIRE(t.cfg.describe() == m.cfg.describe() && t.B == m.B && t.T == m.T, where,
               "the teacher's config or shape differs", "teacher B=", t.B, " T=", t.T,
               ", this B=", m.B, " T=", m.T);
    M3_REQUIRE(t.have_forward && (m.cfg.vocab_size == 0 || t.have_loss), where,
               "the teacher has not run its pass", "");
    if (m.cfg.vocab_size > 0 && !m.own_d_logits)
      M3_CUDA_CHECK(cudaMalloc(&m.own_d_logits, static_cast<std::size_t>(m.d.BT) *
                                                    static_cast<std::size_t>(m.cfg.vocab_size) *
                                                    sizeof(double)));
  }
  m.teacher = teacher ? teacher->impl_.get() : nullptr;
}

void GpuOracle::set_params(const Params<double>& p) {
  Impl& m = *impl_;
  check_params(p, m.cfg, "GpuOracle::set_params");
  const std::size_t n = static_cast<std::size_t>(m.params_layout.total);
  if (!m.param_staging && n > 0) {
    M3_CUDA_CHECK(cudaMallocHost(&m.param_staging, n * sizeof(double)));
    std::fill(m.param_staging, m.param_staging + n, 0.0);
  }
  // The previous upload has finished (upload waits for it), so the image may be rewritten.
  for_each_param(p, [&](int l, const char* name, const std::vector<double>& v) {
    if (v.empty()) return;  // a parameter this config does not have (sizes checked above)
    const ParamSlot& sl = m.params_layout.at(l, name);
    std::copy(v.begin(), v.end(), m.param_staging + sl.offset);
  });
  m.upload(m.o("params"), m.param_staging, m.params_layout.total);
}

void GpuOracle::set_input(const std::vector<double>& X) {
  Impl& m = *impl_;
  M3_REQUIRE(m.cfg.vocab_size == 0, "GpuOracle::set_input",
             "a token model takes tokens (set_tokens), not X", "vocab_size ", m.cfg.vocab_size);
  M3_REQUIRE(static_cast<Idx>(X.size()) == m.d.BT * m.d.in, "GpuOracle::set_input",
             "input X has the wrong size", "got ", X.size(),
             ", expected B*T*input_dim = ", m.d.BT * m.d.in);
  m.upload(m.o("input_proj/input_proj_inputs"), X.data(), m.d.BT * m.d.in);
  m.tokens = false;
}

void GpuOracle::set_states(const States<double>& st) {
  Impl& m = *impl_;
  const StateSizes z = state_sizes(m.cfg);
  const Idx LB = m.cfg.n_layers * m.B;
  auto put = [&](const std::vector<double>& v, Idx per, const char* name) {
    M3_REQUIRE(static_cast<Idx>(v.size()) == LB * per, "GpuOracle::set_states",
               std::string("entering ") + name + " state has the wrong size", "got ", v.size(),
               ", expected L*B*", per, " = ", LB * per);
    m.upload(m.o(std::string("leaving/") + name), v.data(), LB * per);
  };
  put(st.ssm, z.ssm, "ssm");
  put(st.k, z.k, "k");
  put(st.v, z.v, "v");
  put(st.angle, z.angle, "angle");
}

void GpuOracle::set_dout(const std::vector<double>& d_out) {
  Impl& m = *impl_;
  M3_REQUIRE(static_cast<Idx>(d_out.size()) == m.d.BT * m.d.dm, "GpuOracle::set_dout",
             "dOut has the wrong size", "got ", d_out.size(),
             ", expected B*T*d_model = ", m.d.BT * m.d.dm);
  m.upload(m.o("d_out"), d_out.data(), m.d.BT * m.d.dm);
}

void GpuOracle::set_leaving_grads(const States<double>* dl) {
  Impl& m = *impl_;
  const StateSizes z = state_sizes(m.cfg);
  const Idx LB = m.cfg.n_layers * m.B;
  auto put = [&](const std::vector<double>* v, Idx per, const char* name) {
    double* dst = m.o(std::string("d_leaving/") + name);
    if (!v) {
      M3_CUDA_CHECK(cudaMemsetAsync(dst, 0, static_cast<size_t>(LB * per) * sizeof(double), m.s));
      M3_CUDA_CHECK(cudaStreamSynchronize(m.s));
      return;
    }
    M3_REQUIRE(static_cast<Idx>(v->size()) == LB * per, "GpuOracle::set_leaving_grads",
               std::string("leaving-state gradient ") + name + " has the wrong size", "got ",
               v->size(), ", expected L*B*", per, " = ", LB * per);
    m.upload(dst, v->data(), LB * per);
  };
  put(dl ? &dl->ssm : nullptr, z.ssm, "ssm");
  put(dl ? &dl->k : nullptr, z.k, "k");
  put(dl ? &dl->v : nullptr, z.v, "v");
  put(dl ? &dl->angle : nullptr, z.angle, "angle");
}

void GpuOracle::zero_grads() {
  Impl& m = *impl_;
  M3_CUDA_CHECK(cudaMemsetAsync(m.o("grads"), 0,
                                static_cast<size_t>(m.params_layout.total) * sizeof(double), m.s));
  M3_CUDA_CHECK(cudaStreamSynchronize(m.s));
}

void GpuOracle::set_tokens(const std::vector<std::int32_t>& tok) {
  Impl& m = *impl_;
  const char* where = "GpuOracle::set_tokens";
  M3_REQUIRE(m.cfg.vocab_size > 0, where, "the config is no token model (vocab_size = 0)", "");
  M3_REQUIRE(static_cast<Idx>(tok.size()) == m.d.BT, where, "tokens have the wrong size", "got ",
             tok.size(), ", expected B*T = ", m.d.BT);
  std::vector<Idx> order, starts;
  ref::embed_order(tok.data(), m.d.BT, m.cfg.vocab_size, order, starts);  // checks the range
  m.upload(m.typed<std::int32_t>("tok"), tok.data(), m.d.BT);
  m.upload(m.typed<Idx>("embed_order"), order.data(), m.d.BT);
  m.upload(m.typed<Idx>("embed_starts"), starts.data(), m.cfg.vocab_size + 1);
  m.tokens = true;
}

void GpuOracle::set_targets(const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                            double n_norm) {
  Impl& m = *impl_;
  const char* where = "GpuOracle::set_targets";
  M3_REQUIRE(m.cfg.vocab_size > 0, where, "the config is no token model (vocab_size = 0)", "");
  M3_REQUIRE(static_cast<Idx>(tgt.size()) == m.d.BT && static_cast<Idx>(w.size()) == m.d.BT, where,
             "targets and weights must have B*T entries", "got ", tgt.size(), " and ", w.size(),
             ", expected ", m.d.BT);
  M3_REQUIRE(std::isfinite(n_norm) && n_norm > 0, where,
             "no scored position (N = 0): the loss is undefined", "N=", n_norm);
  for (Idx r = 0; r < m.d.BT; ++r) {
    M3_REQUIRE(tgt[r] >= 0 && tgt[r] < m.cfg.vocab_size, where, "target outside the vocabulary",
               "row ", r, ": target ", tgt[r], ", vocab_size ", m.cfg.vocab_size);
    M3_REQUIRE(std::isfinite(w[r]) && w[r] >= 0, where, "a weight is negative or not finite",
               "row ", r, ": weight ", w[r]);
  }
  m.upload(m.typed<std::int32_t>("tgt"), tgt.data(), m.d.BT);
  m.upload(m.typed<float>("w"), w.data(), m.d.BT);
  m.n_norm = n_norm;
  m.targets = true;
}

void GpuOracle::forward(Capture* cap) {
  Impl& m = *impl_;
  M3_REQUIRE(m.cfg.vocab_size == 0 || m.tokens, "GpuOracle::forward",
             "a token model needs its tokens first (set_tokens)", "");
  m.run_forward(cap);
}

void GpuOracle::backward(Capture* cap) { impl_->run_backward(cap); }

double GpuOracle::forward_loss(Capture* cap) {
  Impl& m = *impl_;
  M3_REQUIRE(m.cfg.vocab_size > 0 && m.tokens && m.targets, "GpuOracle::forward_loss",
             "a token model with tokens and targets set comes first", "vocab_size ",
             m.cfg.vocab_size);
  m.run_forward(cap);
  m.with_capture(cap, [&] { chain_lm_forward(m); });
  const std::vector<double> v = m.download(m.o("loss/value"), 1);
  m.loss_value = v[0];
  m.have_loss = true;
  return m.loss_value;
}

void GpuOracle::backward_loss(double scale, Capture* cap) {
  Impl& m = *impl_;
  M3_REQUIRE(m.have_loss, "GpuOracle::backward_loss", "backward_loss called before forward_loss",
             "");
  M3_REQUIRE(std::isfinite(scale) && scale > 0, "GpuOracle::backward_loss",
             "the loss scale must be finite and > 0", "scale=", scale);
  m.loss_scale = scale;
  m.with_capture(cap, [&] { chain_lm_backward(m); });
  m.dout_from_head = true;
  m.run_backward(cap);
}

OracleTensor GpuOracle::tensor(const std::string& key) const {
  const Impl& m = *impl_;
  if (key.rfind("grad/", 0) == 0) {
    for (const ParamSlot& sl : m.params_layout.slots)
      if ("grad/" + sl.name == key) {
        OracleTensor t;
        t.key = key;
        t.layer = sl.layer;
        t.data = m.o("grads") + sl.offset;
        t.shape = sl.shape;
        return t;
      }
    throw Error("GpuOracle::tensor", "no parameter gradient '" + key + "' in this run",
                "see expected_param_keys");
  }
  auto it = m.rows.find(key);
  M3_REQUIRE(it != m.rows.end(), "GpuOracle::tensor", "the oracle does not provide '" + key + "'",
             "it provides the registry tensors of both scan modes (oracle_stage_keys)");
  bool is_shared = false;
  m.buffer(it->second.layer, *it->second.spec, &is_shared);
  M3_REQUIRE(!is_shared, "GpuOracle::tensor", "'" + key + "' is not kept after its stage",
             "OracleKeep::Backward reuses its buffer in every layer: read it in the observer, "
             "or keep OracleKeep::All");
  return m.view(it->second.layer, *it->second.spec);
}

std::vector<double> GpuOracle::download(const OracleTensor& t) const {
  return impl_->download(t.data, t.numel());
}

std::vector<double> GpuOracle::output() const {
  return impl_->download(impl_->o("norm_f/Out"), impl_->d.BT * impl_->d.dm);
}

namespace {
States<double> download_states(const GpuOracle::Impl& m, const std::string& which) {
  const StateSizes z = state_sizes(m.cfg);
  const Idx LB = m.cfg.n_layers * m.B;
  States<double> st;
  st.ssm = m.download(m.o(which + "/ssm"), LB * z.ssm);
  st.k = m.download(m.o(which + "/k"), LB * z.k);
  st.v = m.download(m.o(which + "/v"), LB * z.v);
  st.angle = m.download(m.o(which + "/angle"), LB * z.angle);
  return st;
}
}  // namespace

States<double> GpuOracle::states() const { return download_states(*impl_, "leaving"); }
States<double> GpuOracle::d_entering() const { return download_states(*impl_, "d_entering"); }

std::vector<double> GpuOracle::d_x() const {
  const Impl& m = *impl_;
  return m.download(m.o("input_proj/d_input_proj_dx"), m.d.BT * m.d.in);
}

double GpuOracle::loss() const {
  M3_REQUIRE(impl_->have_loss, "GpuOracle::loss", "loss called before forward_loss", "");
  return impl_->loss_value;
}

Params<double> GpuOracle::grads() const {
  const Impl& m = *impl_;
  const std::vector<double> host = m.download(m.o("grads"), m.params_layout.total);
  Params<double> g = zero_params<double>(m.cfg);
  for_each_param(g, [&](int l, const char* name, std::vector<double>& v) {
    if (v.empty()) return;
    const ParamSlot& sl = m.params_layout.at(l, name);
    std::copy(host.begin() + sl.offset, host.begin() + sl.offset + sl.size, v.begin());
  });
  return g;
}

Capture run_gpu_oracle(const Problem& pb, int device) {
  return run_gpu_oracle(pb, OraclePerturbation{}, device);
}

void load_problem(GpuOracle& o, const Problem& pb) {
  o.set_params(pb.params);
  o.set_states(pb.states);
  o.set_leaving_grads(nullptr);
  o.zero_grads();
  if (pb.token_model()) {
    o.set_tokens(pb.tok);
    o.set_targets(pb.tgt, pb.w, pb.scored());
  } else {
    o.set_input(pb.x);
    o.set_dout(pb.d_out);
  }
}

void run_pass(GpuOracle& o, const Problem& pb, Capture* cap) {
  if (pb.token_model()) {
    o.forward_loss(cap);
    o.backward_loss(pb.loss_scale(), cap);
  } else {
    o.forward(cap);
    o.backward(cap);
  }
}

Capture run_gpu_oracle(const Problem& pb, const OraclePerturbation& pert, int device) {
  GpuOracle net(pb.cfg, pb.B, pb.T, OracleKeep::Backward, device);
  net.set_perturbation(pert);
  load_problem(net, pb);
  Capture cap(pb.cfg, pb.B, pb.T);
  run_pass(net, pb, &cap);
  capture_grads(net.grads(), pb.cfg, cap);
  return cap;
}

Capture run_gpu_oracle_isolated(const Problem& pb, const Problem& pp,
                                const OraclePerturbation& pert, int device) {
  GpuOracle teacher(pb.cfg, pb.B, pb.T, OracleKeep::All, device);
  load_problem(teacher, pb);
  run_pass(teacher, pb);
  GpuOracle net(pb.cfg, pb.B, pb.T, OracleKeep::Backward, device);
  net.set_perturbation(pert);
  net.set_teacher(&teacher);
  load_problem(net, pp);
  Capture cap(pb.cfg, pb.B, pb.T);
  run_pass(net, pp, &cap);
  capture_grads(net.grads(), pb.cfg, cap);
  return cap;
}

}  // namespace m3::gpu
