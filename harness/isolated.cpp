// The teacher-forced CPU reference (see isolated.hpp): an executor of the stage chain
// (chain.hpp). Only glue lives here — loading the oracle's tensors before each stage, calling
// the reference's stage functions of stages.hpp, rounding where the backbone rounds,
// capturing — no stage's math and no order of stages.
#include "isolated.hpp"

#include "lm.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backbone.hpp"  // capture_grads
#include "chain.hpp"
#include "error.hpp"
#include "precision.hpp"
#include "registry.hpp"
#include "stages.hpp"

namespace m3::harness {

float round_mantissa(float f, int mantissa_bits) {
  M3_REQUIRE(mantissa_bits >= 1 && mantissa_bits <= 23, "round_mantissa",
             "mantissa bits out of range", mantissa_bits);
  if (!std::isfinite(f) || mantissa_bits == 23) return f;
  std::uint32_t u = float_bits(f);
  const int drop = 23 - mantissa_bits;
  const std::uint32_t lsb = (u >> drop) & 1u;
  u += ((1u << (drop - 1)) - 1u) + lsb;  // round to nearest, ties to even (a carry may overflow
  u &= ~((1u << drop) - 1u);             // into the exponent: the next binade, or ±inf)
  return bits_float(u);
}

namespace {

using ref::Dims;
using Acts = ref::LayerActs<float>;
using Grads = ref::LayerGrads<float>;
using Vec = std::vector<float>;

using Field = ref::TensorField<float>;
using ref::act_fields;
using ref::grad_fields;

class Runner {
  friend struct m3::ChainAccess;

 public:
  Runner(const Problem& pb, ScanMode mode, const Capture& oracle, Precision storage,
         gpu::Fault fault, const TensorSink& sink)
      : pb_(pb),
        cfg_(pb.cfg),
        mode_(mode),
        oracle_(oracle),
        d_(Dims::of(pb.cfg, pb.B, pb.T, storage)),
        fault_(fault),
        p_(cast_params<float>(pb.params)),
        states_(cast_states<float>(pb.states)),
        grads_(zero_params<float>(pb.cfg)),
        cap_(pb.cfg, pb.B, pb.T, sink) {
    a_.allocate(d_, mode);
    g_.allocate(d_, mode);
    w_input_ = typed(p_.input_proj_w);
    w_head_ = typed(p_.head_w);
    for (const auto& L : p_.layers) {
      w_in_.push_back(typed(L.in_proj_w));
      w_out_.push_back(typed(L.out_proj_w));
    }
  }

  Capture run() {
    chain_step(*this, plan_);
    capture_grads(grads_, cfg_, cap_);
    return std::move(cap_);
  }

 private:
  // ---- loading the oracle's values --------------------------------------------------------
  Vec typed(Vec v) const {
    ref::store_typed(d_, v);
    return v;
  }
  // The oracle's tensor `key`, rounded to float (and to the storage type when `is_typed`).
  void load(const std::string& key, Vec& v, bool is_typed) const {
    const Tensor* t = oracle_.find(key);
    M3_REQUIRE(t != nullptr, "run_reference_isolated", "the oracle lacks '" + key + "'",
               "an isolated run needs every registry tensor of the oracle");
    M3_REQUIRE(static_cast<size_t>(t->numel()) == v.size(), "run_reference_isolated",
               "the oracle's '" + key + "' has the wrong size", "got ", t->numel(),
               ", expected ", v.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(t->data[i]);
    if (is_typed) ref::store_typed(d_, v);
  }
  void load_fields(int l, const std::vector<Field>& fields) {
    for (const Field& f : fields) {
      const TensorSpec& spec = find_spec(stage_name(f.stage), f.tensor);
      if (!exists_in(spec, cfg_, mode_)) continue;
      load(stage_key(l, spec.stage, f.tensor), *f.v, spec.typed);
    }
  }
  // Before each forward stage of layer l: every forward tensor of the layer is the oracle's,
  // the entering states the Problem's.
  void fresh_forward(int l) {
    load_fields(l, act_fields(a_));
    take(states_.ssm, l, a_.ssm_in);
    take(states_.k, l, a_.k_in);
    take(states_.v, l, a_.v_in);
    take(states_.angle, l, a_.angle_in);
  }
  // Before each backward stage: the forward tensors, every backward tensor of the layer the
  // oracle's, zero gradients wrt the leaving states.
  void fresh_backward(int l) {
    fresh_forward(l);
    load_fields(l, grad_fields(g_));
    for (Vec* v : {&g_.d_ssm_out, &g_.d_k_out, &g_.d_v_out, &g_.d_angle_out})
      std::fill(v->begin(), v->end(), 0.0f);
  }
  static void take(const Vec& all, int l, Vec& slice) {
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(l * slice.size()), slice.size(),
                slice.begin());
  }

  void put(int l, const char* stage, const char* tensor, const Vec& v) {
    if (!exists_in(find_spec(stage, tensor), cfg_, mode_)) return;
    cap_.put_stage(l, stage, tensor, v.data(), static_cast<Idx>(v.size()));
  }

  bool faulted(int l, gpu::Fault f) const { return l == 0 && fault_ == f; }
  // The registry tensors layer stage s wrote (its own and its pseudo-stages'), from `fields`.
  void put_written(StageId s, int l, const std::vector<Field>& fields) {
    ref::for_each_buffer(plan_.written_by(s), fields, [&](const TensorSpec& spec, const Vec& v) {
      put(l, spec.stage, spec.tensor, v);
    });
  }

  // ---- the executor of chain.hpp: every stage on the oracle's values -----------------------
  // Before each layer stage: every tensor of the layer the oracle's (fresh_forward /
  // fresh_backward); backbone stages load what they read themselves.
  void before(StageId, int l, Dir dir) {
    if (l < 0) return;
    dir == Dir::Forward ? fresh_forward(l) : fresh_backward(l);
  }
  // After a layer stage: the negative controls' fault of that stage, then the capture of what
  // it wrote.
  void after(StageId s, int l, Dir dir) {
    if (l < 0) return;
    if (dir == Dir::Backward) {
      put_written(s, l, grad_fields(g_));
      return;
    }
    if (s == StageId::F5 && faulted(l, gpu::Fault::FlipAngleSign))
      for (float& th : a_.angle_cumsum) th = static_cast<float>(ref::kTwoPi - th);
    if (s == StageId::F5b && faulted(l, gpu::Fault::DropBeta))
      std::fill(a_.beta.begin(), a_.beta.end(), 0.0f);
    if (s == StageId::F6) inject_f6_faults(l);
    put_written(s, l, act_fields(a_));
  }
  void pseudo(StageId, int, Dir) {}  // its tensors are captured after their writer
  void enter_layer(int) {}
  void leave_layer(int) {}
  // δ entering the layer is the oracle's; the GEMMs of B8 take its staged typed copy.
  void enter_layer_backward(int l) {
    delta_.resize(static_cast<size_t>(d_.BT * d_.dm));
    load(entering_gradient(l, plan_.n_layers).key(), delta_, false);
    delta_typed_ = typed(delta_);
  }
  void leave_layer_backward(int) {}

  template <StageId s>
  void forward(Stage<s>, int l) {
    const size_t li = static_cast<size_t>(l);
    ref::layer_forward_step(d_, mode_, s, p_.layers[li], w_in_[li].data(), w_out_[li].data(), a_);
  }
  template <StageId s>
  void backward(Stage<s>, int l) {
    const size_t li = static_cast<size_t>(l);
    ref::layer_backward_step(d_, mode_, s, p_.layers[li], w_in_[li].data(), w_out_[li].data(),
                             a_, delta_, delta_typed_.data(), g_, grads_.layers[li]);
  }

  void forward(Stage<StageId::input_proj>, int) {
    const Vec x_in = input();
    const std::int32_t* tok = pb_.token_model() ? pb_.tok.data() : nullptr;
    Vec h0(static_cast<size_t>(d_.BT * d_.dm));
    ref::input_proj_forward(d_.BT, d_.in, d_.dm, cfg_.input_proj_identity, tok, x_in.data(),
                            w_input_.data(), p_.input_proj_b.data(), h0.data());
    if (tok || !cfg_.input_proj_identity) ref::store_typed(d_, h0);
    put(-1, "input_proj", "input_proj_inputs", x_in);
    put(-1, "input_proj", "input_proj_outputs", h0);
  }
  void forward(Stage<StageId::norm_f>, int) {
    const Idx BT = d_.BT;
    Vec nf_in(static_cast<size_t>(BT * d_.dm)), nf_rms(static_cast<size_t>(BT)),
        out(static_cast<size_t>(BT * d_.dm));
    load("norm_f/norm_f_input", nf_in, false);
    ref::rmsnorm_forward(BT, d_.dm, nf_in.data(), p_.norm_f_weight.data(), out.data(),
                         nf_rms.data());
    ref::store_typed(d_, out);
    put(-1, "norm_f", "norm_f_input", nf_in);
    put(-1, "norm_f", "norm_f_rms", nf_rms);
    put(-1, "norm_f", "Out", out);
  }
  // head on the oracle's Out; loss on the oracle's logits (TRAINING.md §1).
  void forward(Stage<StageId::head>, int) {
    const Idx BT = d_.BT, V = cfg_.vocab_size;
    Vec out(static_cast<size_t>(BT * d_.dm)), logits(static_cast<size_t>(BT * V));
    load("norm_f/Out", out, true);
    ref::linear_forward(BT, d_.dm, V, out.data(), w_head_.data(),
                        static_cast<const float*>(nullptr), logits.data());
    ref::store_typed(d_, logits);
    put(-1, "head", "logits", logits);
  }
  void forward(Stage<StageId::loss>, int) {
    const Idx BT = d_.BT, V = cfg_.vocab_size;
    Vec logits(static_cast<size_t>(BT * V)), lse(static_cast<size_t>(BT));
    load("head/logits", logits, true);
    const float value = static_cast<float>(
        ref::loss_forward(BT, V, logits.data(), pb_.tgt.data(), pb_.w.data(), pb_.scored(),
                          lse.data()));
    put(-1, "loss", "lse", lse);
    put(-1, "loss", "value", Vec{value});
  }

  // X as the backbone reads it: the problem's input, or a token model's one-hot (typed).
  Vec input() const {
    Vec x_in = pb_.token_model() ? ref::one_hot<float>(pb_.tok.data(), d_.BT, d_.in)
                                 : Vec(pb_.x.begin(), pb_.x.end());
    ref::store_typed(d_, x_in);
    return x_in;
  }

  // The head's backward on the oracle's logits, lse and Out: d_logits (typed), d_Out = d_logits ·
  // head_wᵀ (f32), head_w's gradient; norm_f's dOut is then the oracle's d_Out.
  void backward(Stage<StageId::head>, int) {
    const Idx BT = d_.BT, V = cfg_.vocab_size;
    Vec logits(static_cast<size_t>(BT * V)), lse(static_cast<size_t>(BT)),
        out(static_cast<size_t>(BT * d_.dm)), d_logits(logits.size());
    d_out_.assign(out.size(), 0.0f);
    load("head/logits", logits, true);
    load("loss/lse", lse, false);
    load("norm_f/Out", out, true);
    ref::loss_backward(BT, V, logits.data(), lse.data(), pb_.tgt.data(), pb_.w.data(), pb_.scored(),
                       pb_.loss_scale(), d_logits.data());
    ref::store_typed(d_, d_logits);
    put(-1, "head", "d_logits", d_logits);
    load("head/d_logits", d_logits, true);
    ref::linear_backward(BT, d_.dm, V, out.data(), w_head_.data(), d_logits.data(), d_out_.data(),
                         grads_.head_w.data(), static_cast<float*>(nullptr));
    put(-1, "head", "d_Out", d_out_);
    load("head/d_Out", d_out_, false);
  }
  void backward(Stage<StageId::norm_f>, int) {
    const Idx BT = d_.BT;
    const size_t n_dm = static_cast<size_t>(BT * d_.dm);
    Vec nf_in(n_dm), nf_rms(static_cast<size_t>(BT)), d_norm_f(n_dm);
    load("norm_f/norm_f_input", nf_in, false);
    load("norm_f/norm_f_rms", nf_rms, false);
    if (!pb_.token_model()) d_out_.assign(pb_.d_out.begin(), pb_.d_out.end());
    ref::rmsnorm_backward(BT, d_.dm, nf_in.data(), p_.norm_f_weight.data(), nf_rms.data(),
                          d_out_.data(), d_norm_f.data(), grads_.norm_f_weight.data());
    put(-1, "norm_f", "d_norm", d_norm_f);
  }
  // input_proj's backward on the oracle's δ⁰ (ref::input_proj_backward, as the backbone).
  void backward(Stage<StageId::input_proj>, int) {
    delta_.resize(static_cast<size_t>(d_.BT * d_.dm));
    load(entering_gradient(-1, plan_.n_layers).key(), delta_, false);
    const std::int32_t* tok = pb_.token_model() ? pb_.tok.data() : nullptr;
    const Vec x_in = input();
    delta_typed_ = typed(delta_);
    Vec d_x(static_cast<size_t>(d_.BT * d_.in), 0.0f);
    ref::input_proj_backward(d_.BT, d_.in, d_.dm, cfg_.input_proj_identity, tok, x_in.data(),
                             w_input_.data(), delta_.data(), delta_typed_.data(),
                             grads_.input_proj_w.data(), grads_.input_proj_b.data(), d_x.data());
    ref::store_typed(d_, d_x);
    put(-1, "input_proj", "d_input_proj_dx", d_x);
  }

  // The F6 faults of backbone_gpu.hpp on y [B·T, nh, hd] (after y's typed store).
  void inject_f6_faults(int l) {
    if (faulted(l, gpu::Fault::ChunkBoundaryOff)) {
      const size_t row = static_cast<size_t>(d_.nh * d_.hd);
      for (Idx b = 0; b < d_.B; ++b)
        for (Idx c = 1; c < d_.nc; ++c) {
          const Idx t = d_.chunk_begin(c);
          std::copy_n(a_.y.begin() + static_cast<std::ptrdiff_t>((b * d_.T + t - 1) * row), row,
                      a_.y.begin() + static_cast<std::ptrdiff_t>((b * d_.T + t) * row));
        }
    }
    if (faulted(l, gpu::Fault::RoundTwice)) {
      const int bits = d_.storage == Precision::BF16 ? 5 : 7;
      for (float& v : a_.y) v = round_mantissa(v, bits);
    }
  }

  const Problem& pb_;
  const Config& cfg_;
  ScanMode mode_;
  const Capture& oracle_;
  Dims d_;
  gpu::Fault fault_;
  Params<float> p_;
  States<float> states_;
  Params<float> grads_;
  Capture cap_;
  Acts a_;
  Grads g_;
  Vec w_input_, w_head_;
  std::vector<Vec> w_in_, w_out_;
  ChainPlan plan_ = ChainPlan::of(cfg_, mode_);  // the stages of the run
  Vec delta_, delta_typed_;  // δ entering the layer's backward, and its typed copy
  Vec d_out_;                // norm_f's dOut: the problem's, or the oracle's head d_Out
};

// Every per-layer registry tensor of (cfg, mode) must have a buffer above (a registry entry
// added without one here would silently be left out of the isolated run).
void check_fields_cover_registry(const Config& cfg, ScanMode mode) {
  Acts a;
  Grads g;
  std::vector<Field> all = act_fields(a);
  for (const Field& f : grad_fields(g)) all.push_back(f);
  for (const TensorSpec& spec : stage_registry()) {
    if (spec.scope != Scope::Layer || !exists_in(spec, cfg, mode)) continue;
    bool found = false;
    for (const Field& f : all) found = found || f.is(spec);
    M3_REQUIRE(found, "run_reference_isolated", "no buffer for a registry tensor",
               spec.stage, "/", spec.tensor);
  }
}

}  // namespace

Capture run_reference_isolated(const Problem& pb, ScanMode mode, const Capture& oracle,
                               Precision storage, gpu::Fault fault, const TensorSink& sink) {
  M3_REQUIRE(storage == Precision::F32 || storage == Precision::BF16 ||
                 storage == Precision::F16,
             "run_reference_isolated", "storage must be f32, bf16 or f16",
             precision_name(storage));
  validate_run(pb.cfg, pb.B, pb.T);
  check_fields_cover_registry(pb.cfg, mode);
  return Runner(pb, mode, oracle, storage, fault, sink).run();
}

}  // namespace m3::harness
