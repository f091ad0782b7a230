// The two training backends (backend.hpp): the GPU path and the float reference.
#include "backend.hpp"

#include <algorithm>
#include <deque>
#include <string>

#include "backbone_gpu.hpp"
#include "context.hpp"
#include "device.hpp"
#include "error.hpp"
#include "lm.hpp"
#include "optimizer_gpu.hpp"

namespace m3::train {

std::vector<float> to_flat(const Params<float>& p, const ParamLayout& layout) {
  std::vector<float> flat(static_cast<size_t>(layout.total), 0.0f);
  for_each_param(p, [&](int l, const char* name, const std::vector<float>& v) {
    if (v.empty()) return;  // a parameter this config does not have
    const ParamSlot& s = layout.at(l, name);
    M3_REQUIRE(static_cast<Idx>(v.size()) == s.size, "to_flat",
               "parameter '" + s.name + "' has the wrong size", "got ", v.size(), ", expected ",
               s.size);
    std::copy(v.begin(), v.end(), flat.begin() + s.offset);
  });
  return flat;
}

Params<float> from_flat(const std::vector<float>& flat, const Config& cfg,
                        const ParamLayout& layout) {
  M3_REQUIRE(static_cast<Idx>(flat.size()) == layout.total, "from_flat",
             "the flat buffer has the wrong size", "got ", flat.size(), ", expected ",
             layout.total);
  Params<float> p = zero_params<float>(cfg);
  for_each_param(p, [&](int l, const char* name, std::vector<float>& v) {
    if (v.empty()) return;
    const ParamSlot& s = layout.at(l, name);
    std::copy(flat.begin() + s.offset, flat.begin() + s.offset + s.size, v.begin());
  });
  return p;
}

TrainState initial_state(const Config& cfg, std::uint64_t seed) {
  const ParamLayout layout = param_layout(cfg);
  TrainState st;
  st.params = to_flat(cast_params<float>(make_params<double>(cfg, seed, Init::Spec)), layout);
  st.m.assign(static_cast<size_t>(layout.total), 0.0f);
  st.v.assign(static_cast<size_t>(layout.total), 0.0f);
  return st;
}

void check_state(const TrainState& st, Idx total, const char* where) {
  M3_REQUIRE(static_cast<Idx>(st.params.size()) == total &&
                 static_cast<Idx>(st.m.size()) == total && static_cast<Idx>(st.v.size()) == total,
             where, "the training state has the wrong size", "params/m/v ", st.params.size(), "/",
             st.m.size(), "/", st.v.size(), ", expected ", total, " each");
}

namespace {

// ---- the CPU: LmModel<float> + the host AdamW ------------------------------------------------
class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendSpec& s)
      : spec_(s),
        layout_(param_layout(s.cfg)),
        decay_(decay_flags(layout_)),
        model_(s.cfg, s.B, s.T, s.mode, s.storage) {
    M3_REQUIRE(s.storage != Precision::F64, "train (cpu)", "f64 is the oracle's precision",
               "the CPU path trains in f32 or with the bf16/f16 storage emulation");
    grads_ = zero_params<float>(s.cfg);
    set_state(initial_state(s.cfg, 0));
  }
  std::string name() const override { return "cpu"; }
  const ParamLayout& layout() const override { return layout_; }
  TrainState state() override { return {to_flat(params_, layout_), m_, v_}; }
  void set_state(const TrainState& st) override {
    check_state(st, layout_.total, "train (cpu)");
    params_ = from_flat(st.params, spec_.cfg, layout_);
    m_ = st.m;
    v_ = st.v;
  }
  void zero_grads() override { grads_ = zero_params<float>(spec_.cfg); }
  void forward(const Batch& b, double n_norm) override {
    loss_ = model_.forward(params_, b.tok, b.tgt, b.w, n_norm);
  }
  double loss() override { return loss_; }
  void backward(double scale) override { model_.backward(params_, scale, grads_); }
  std::vector<std::int32_t> argmax() override { return model_.argmax(); }
  std::vector<float> logits() override { return model_.logits(); }
  double grad_norm() override {
    const std::vector<float> g = to_flat(grads_, layout_);
    return m3::grad_norm(g.data(), layout_.total);
  }
  void adamw(const AdamWScalars& a) override {
    std::vector<float> p = to_flat(params_, layout_);
    const std::vector<float> g = to_flat(grads_, layout_);
    adamw_step(layout_, decay_, a, p.data(), m_.data(), v_.data(), g.data());
    params_ = from_flat(p, spec_.cfg, layout_);
  }
  std::vector<float> grads() override { return to_flat(grads_, layout_); }

 private:
  BackendSpec spec_;
  ParamLayout layout_;
  std::vector<std::uint8_t> decay_;
  LmModel<float> model_;
  Params<float> params_, grads_;
  std::vector<float> m_, v_;
  double loss_ = 0;
};

// ---- the GPU: GpuBackbone (token model) + GpuOptimizer ---------------------------------------
class GpuBackend final : public Backend {
 public:
  explicit GpuBackend(const BackendSpec& s)
      : spec_(s),
        ctx_(0),
        net_(ctx_, s.cfg, s.B, s.T, s.mode, s.storage, s.recompute),
        opt_(ctx_, net_.param_layout()) {
    set_state(initial_state(s.cfg, 0));
    net_.zero_grads();
  }
  std::string name() const override { return "gpu"; }
  const ParamLayout& layout() const override { return net_.param_layout(); }
  TrainState state() override { return {net_.params_flat(), opt_.m(), opt_.v()}; }
  void set_state(const TrainState& st) override {
    check_state(st, layout().total, "train (gpu)");
    net_.set_params_flat(st.params);
    opt_.set_moments(st.m, st.v);
  }
  void zero_grads() override {
    if (timing_) {
      timed_.push_back(TimedStep{std::make_unique<gpu::StreamMarks>(ctx_), 0});
      timed_.back().marks->mark(kBegin);
      phase_ = Phase::Passes;
    }
    net_.zero_grads();
  }
  void forward(const Batch& b, double n_norm) override {
    forward_after([&] {
      net_.set_tokens(b.tok);
      net_.set_targets(b.tgt, b.w, n_norm);
    });
  }
  void stage(const Batch& b, double n_norm) override {
    net_.stage_batch(b.tok, b.tgt, b.w, n_norm);
  }
  void forward_staged() override {
    forward_after([&] { net_.upload_staged(); });
  }
  double loss() override { return net_.loss(); }
  void backward(double scale) override {
    net_.backward_loss(scale);
    if (phase_ == Phase::Passes) {
      TimedStep& t = timed_.back();
      t.marks->mark(kPasses + kPerMicro * t.micro + 3);
      ++t.micro;
    }
  }
  std::vector<std::int32_t> argmax() override { return net_.argmax(); }
  std::vector<float> logits() override { return net_.logits(); }
  double grad_norm() override {
    const bool timed = phase_ == Phase::Passes;
    if (timed) timed_.back().marks->mark(kOptimizer);
    const double g = opt_.grad_norm(net_.grad_arena());
    if (timed) {
      timed_.back().marks->mark(kOptimizerEnd);  // a skipped step ends here
      phase_ = Phase::Optimizer;
    }
    return g;
  }
  void adamw(const AdamWScalars& a) override {
    opt_.step(a, net_.param_arena(), net_.grad_arena());
    net_.refresh_typed_copies();
    if (phase_ == Phase::Optimizer) timed_.back().marks->mark(kOptimizerEnd);
    phase_ = Phase::Off;
  }
  bool time_steps() override {
    timing_ = true;
    return true;
  }
  bool profile_stages(bool on) override {
    net_.set_profiling(on);
    return true;
  }
  std::vector<std::pair<std::string, double>> stage_times() override {
    return net_.stage_times();
  }
  std::vector<StepTimes> step_times(bool wait) override {
    if (wait) ctx_.synchronize();
    std::vector<StepTimes> out;
    // A step is done when the next one has begun on the device (its period ends there), or,
    // waiting, when it is the last.
    while (!timed_.empty()) {
      const bool next = timed_.size() >= 2;
      if (next ? !timed_[1].marks->ready(kBegin) : !wait) break;
      const TimedStep& t = timed_.front();
      const gpu::StreamMarks& m = *t.marks;
      StepTimes st;
      for (int k = 0; k < t.micro; ++k) {
        const int at = kPasses + kPerMicro * k;
        st.forward_ms += m.ms(at, at + 2);
        st.uploads_ms += m.ms(at, at + 1);
        st.backward_ms += m.ms(at + 2, at + 3);
      }
      if (m.marked(kOptimizer) && m.marked(kOptimizerEnd))
        st.optimizer_ms = m.ms(kOptimizer, kOptimizerEnd);
      st.to_next = next;
      if (next) {
        st.period_ms = m.ms(kBegin, *timed_[1].marks, kBegin);
      } else {
        const int last = m.marked(kOptimizerEnd) ? kOptimizerEnd
                         : t.micro > 0          ? kPasses + kPerMicro * t.micro - 1
                                                : kBegin;
        st.period_ms = m.ms(kBegin, last);
      }
      out.push_back(st);
      timed_.pop_front();
    }
    if (wait) phase_ = Phase::Off;
    return out;
  }
  std::vector<float> grads() override {
    const Params<float> g = net_.grads();
    return to_flat(g, layout());
  }

 private:
  // The forward of the inputs that `upload` gives the backbone (its host work and copies are
  // the step's uploads).
  template <class Upload>
  void forward_after(Upload&& upload) {
    const bool timed = phase_ == Phase::Passes;  // not validation's forwards
    const int at = timed ? kPasses + kPerMicro * timed_.back().micro : 0;
    if (timed) timed_.back().marks->mark(at);
    upload();
    if (timed) timed_.back().marks->mark(at + 1);
    net_.zero_states();
    net_.forward_loss_async();
    if (timed) timed_.back().marks->mark(at + 2);
  }

  BackendSpec spec_;
  gpu::GpuContext ctx_;
  gpu::GpuBackbone net_;
  gpu::GpuOptimizer opt_;
  // --step-times: a step's points on the stream: kBegin before the gradients' zeroing, the
  // optimizer's start and end, then per micro-batch k the forward's start (kPasses + 4k), the
  // end of its uploads (+1), its end = the backward's start (+2) and the backward's end (+3).
  // Phase: which marks the next calls set (Off between steps: validation's forwards are not the
  // step's).
  static constexpr int kBegin = 0, kOptimizer = 1, kOptimizerEnd = 2, kPasses = 3, kPerMicro = 4;
  enum class Phase { Off, Passes, Optimizer };
  struct TimedStep {
    std::unique_ptr<gpu::StreamMarks> marks;
    int micro = 0;
  };
  bool timing_ = false;
  Phase phase_ = Phase::Off;
  std::deque<TimedStep> timed_;
};

}  // namespace

void Backend::require_staged() const {
  M3_REQUIRE(has_staged_, "train", "no staged batch",
             "stage() comes before forward_staged(), once per staged batch");
}

std::unique_ptr<Backend> make_cpu_backend(const BackendSpec& spec) {
  return std::make_unique<CpuBackend>(spec);
}

std::unique_ptr<Backend> make_gpu_backend(const BackendSpec& spec) {
  const std::string why = gpu::GpuBackbone::unsupported(spec.cfg, spec.B, spec.T);
  M3_REQUIRE(why.empty(), "train (gpu)", "the GPU path cannot run this shape", why);
  return std::make_unique<GpuBackend>(spec);
}

std::unique_ptr<Backend> make_backend(const std::string& device, const BackendSpec& spec) {
  if (device == "gpu") return make_gpu_backend(spec);
  if (device == "cpu") return make_cpu_backend(spec);
  throw Error("train", "unknown device '" + device + "'", "use gpu or cpu");
}

}  // namespace m3::train
