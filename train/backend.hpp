// A training backend: one device's model and optimizer state (TRAINING.md §1–§2), driven by
// the training loop (trainer.hpp), which owns the step's logic (micro-batches, loss scaling,
// norm, clipping, the schedule) so that the GPU and the CPU run the same step.
//
//   gpu  GpuBackbone in a token model (the embedding, the backbone, head and loss on the
//        device, production layout) + GpuOptimizer (f64 norm, AdamW on the flat arenas, one
//        launch each) + the typed-copy refresh
//   cpu  the reference LmModel<float> with the run's storage emulation (bf16/f16 rounding
//        points, MODEL.md §8) + the host AdamW of reference/optimizer.hpp, on flat vectors in
//        the same ParamLayout — for small models and for CI
//
// Every backend holds B×T micro-batches of one shape. Gradients accumulate over forward /
// backward pairs until zero_grads(); the entering states are zero for every batch (rows are
// independent sequences).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint.hpp"
#include "config.hpp"
#include "data.hpp"
#include "optimizer.hpp"
#include "params.hpp"
#include "precision.hpp"
#include "registry.hpp"

namespace m3::train {

// Device time of one training step's parts (m3h train --step-times), in ms. forward and
// backward sum over the step's micro-batches (the forward from its tokens' upload to the loss,
// the backward from the head's backward to the embedding's); uploads: the forward's first part,
// from its start to the end of the tokens', targets' and weights' uploads (the copies, and for
// a batch that was not staged the host's set_tokens and set_targets work while the device waits;
// run_training stages the first batch of every step but the run's first); optimizer: the
// gradient norm, AdamW and the typed-copy refresh. period: from the step's first queued work (the gradients'
// zeroing) to the next step's, or for the run's last step to its own last work (`to_next`
// false); so period − forward − backward − optimizer is the device's time outside the parts:
// the zeroing, validation, and idle while the host prepares a batch, launches or waits.
struct StepTimes {
  double forward_ms = 0, uploads_ms = 0, backward_ms = 0, optimizer_ms = 0, period_ms = 0;
  bool to_next = true;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;  // "gpu" | "cpu"
  virtual const ParamLayout& layout() const = 0;
  // Parameters and AdamW moments as flat f32 vectors in layout() order (layout().total each).
  virtual TrainState state() = 0;
  virtual void set_state(const TrainState& st) = 0;
  virtual void zero_grads() = 0;
  // Forward of one micro-batch (the GPU queues it and returns at once).
  virtual void forward(const Batch& b, double n_norm) = 0;
  // Staging (run_training): stage(b, n_norm) prepares the next forward's batch while the device
  // still works on this step — the GPU does set_tokens' and set_targets' host work into pinned
  // memory and copies nothing — and forward_staged() is forward(b, n_norm) of the batch staged
  // last, each staged batch once. A bad batch's error, the one forward() would give, comes from
  // stage() (GPU) or forward_staged() (the default, which keeps a copy for forward_staged()).
  // Staging changes no bit of any result.
  virtual void stage(const Batch& b, double n_norm) {
    staged_ = b;
    staged_norm_ = n_norm;
    has_staged_ = true;
  }
  virtual void forward_staged() {
    require_staged();
    has_staged_ = false;
    forward(staged_, staged_norm_);
  }
  // The last forward's share of the step's loss, Σ w·ce / n_norm (the GPU waits for it here,
  // so a backward queued before this call overlaps the wait).
  virtual double loss() = 0;
  // Backward of scale·loss of the last forward; gradients accumulate.
  virtual void backward(double scale) = 0;
  // argmax of the last forward's logits per row.
  virtual std::vector<std::int32_t> argmax() = 0;
  // The last forward's logits [B*T, V] (sampling).
  virtual std::vector<float> logits() = 0;
  // ‖g‖₂ of the accumulated gradients (f64, fixed order).
  virtual double grad_norm() = 0;
  // One AdamW step with these scalars, then the typed copies refreshed.
  virtual void adamw(const AdamWScalars& a) = 0;
  // The accumulated gradients, flat (tests, verification).
  virtual std::vector<float> grads() = 0;
  // Data parallelism (parallel.hpp). rank(): this process's rank of ranks() (0 of 1 for a
  // single-rank backend; 0 for a whole group driven by this process). any_rank: whether any
  // rank of the job says `mine` (a collective in a job of processes: every rank calls it at the
  // same point). exchange_seconds: the time spent in the gradient and parameter exchange so far.
  virtual int rank() const { return 0; }
  virtual int ranks() const { return 1; }
  virtual bool any_rank(bool mine) { return mine; }
  virtual double exchange_seconds() const { return 0.0; }
  // --step-times: whether this backend can time its steps' parts (the GPU path of one
  // process); once asked, it does from the next zero_grads() on. step_times: the timed steps,
  // in order, whose device work has finished since the last call (without waiting); with
  // `wait`, after waiting for the device, every remaining one (the last with to_next false).
  virtual bool time_steps() { return false; }
  virtual std::vector<StepTimes> step_times(bool wait) {
    (void)wait;
    return {};
  }
  // --stage-times: whether this backend can profile its stages (the GPU path of one process),
  // and the profile on or off (GpuBackbone::set_profiling: an event after every stage, and a
  // wait for the last at the end of every forward and backward). stage_times: ms per stage
  // name (layers summed) over every forward and backward run while it was on.
  virtual bool profile_stages(bool on) {
    (void)on;
    return false;
  }
  virtual std::vector<std::pair<std::string, double>> stage_times() { return {}; }

 protected:
  void require_staged() const;  // an m3::Error without a staged batch

 private:
  Batch staged_;
  double staged_norm_ = 0;
  bool has_staged_ = false;
};

struct BackendSpec {
  Config cfg;
  Idx B = 1, T = 1;
  ScanMode mode = ScanMode::Chunked;
  Precision storage = Precision::F32;
  Recompute recompute = Recompute::None;  // gpu only
};

// The initial state: parameters from make_params(cfg, seed, Init::Spec) in the layout, zero
// moments.
TrainState initial_state(const Config& cfg, std::uint64_t seed);

std::unique_ptr<Backend> make_cpu_backend(const BackendSpec& spec);
// Throws m3::Error (one line) when there is no usable GPU or the shape does not fit.
std::unique_ptr<Backend> make_gpu_backend(const BackendSpec& spec);
std::unique_ptr<Backend> make_backend(const std::string& device, const BackendSpec& spec);

// Throws m3::Error (one line, naming `where`) unless params, m and v hold `total` floats each.
void check_state(const TrainState& st, Idx total, const char* where);

// Params<float> ↔ flat layout vectors (gaps zero).
std::vector<float> to_flat(const Params<float>& p, const ParamLayout& layout);
Params<float> from_flat(const std::vector<float>& flat, const Config& cfg,
                        const ParamLayout& layout);

}  // namespace m3::train
