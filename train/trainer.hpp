// The training loop of `m3h train` (TRAINING.md §2–§6) and the sampler of `m3h sample` (§7).
//
// One optimizer step (train_step), the same for every backend:
//   N      = Σ scored positions over the step's micro-batches (0 is an error)
//   loss   = Σ_k forward(micro_k, N)          each micro-batch's share of the step's loss
//            backward(S) after each forward   gradients of S·loss accumulate, micro-batch order
//   ‖g‖    = grad_norm() / S                  f64, fixed order
//   S      the loss scale (f16: dynamic, 2^16 at first; bf16/f32: 1). A non-finite norm with
//          f16 skips the step (weights, moments and the optimizer step t unchanged, the scale
//          halved); with bf16/f32 it stops the run.
//   AdamW  with c = clip_coefficient(‖g‖, clip), gscale = c / S, lr = learning_rate(t),
//          t = the number of applied steps so far + 1; then the typed copies are refreshed.
// Batch k of step s is train_batch(seed, s, k, B, T): the loader's state is the step number.
// run_training makes step s+1's batches, and stages its first (Backend::stage), while the device
// runs step s's last backward, so the next forward does not wait for the host's batch work.
//
// A run (run_training): the data, the backend, the run directory (config.txt, metrics.csv,
// checkpoints ckpt-<step>.h5, loss.png), --resume from a checkpoint (every setting must match;
// bit-exact: k steps + resume + N − k steps give the weights, moments and losses of N steps),
// validation every --val-every steps over --val-batches fixed batches, a checkpoint every
// --ckpt-every steps keeping the last --keep and the final one, Ctrl-C = checkpoint + exit 130,
// a non-finite loss or state = exit 1 keeping the last finite checkpoint (none of that step).
// Data-parallel (parallel.hpp): the same loop over a backend of G ranks; checkpoints hold the
// gathered state (the format of one rank), so a run resumes with another rank count.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "backbone_gpu.hpp"  // gpu::Fault
#include "checkpoint.hpp"
#include "config.hpp"
#include "data.hpp"
#include "error.hpp"
#include "optimizer.hpp"
#include "parallel.hpp"
#include "problem.hpp"

namespace m3::train {

struct StepResult {
  double loss = 0;       // the step's loss (the mean over its scored positions)
  double grad_norm = 0;  // ‖g‖ before clipping (unscaled); NaN when skipped
  double lr = 0;         // the learning rate used (of the step's t)
  bool skipped = false;  // f16: a non-finite gradient; nothing changed but the scale
  bool finite = true;    // the gradient norm was finite
};

// N of a step: Σ scored positions over its micro-batches.
double scored_positions(const std::vector<Batch>& micro);

// One optimizer step over `micro` (see the file comment). t: the optimizer step, ≥ 1.
// staged: micro[0] was staged with this step's N (Backend::stage), so its forward is
// forward_staged(). meanwhile: run once the last backward is queued, before the host waits for
// the device (run_training makes and stages the next step's batches there).
StepResult train_step(Backend& be, const std::vector<Batch>& micro, Idx t, const OptimConfig& o,
                      LossScaler& scaler, bool staged = false,
                      const std::function<void()>& meanwhile = {});

// Mean loss per scored position and accuracy over batches (no backward).
struct EvalResult {
  double loss = 0;
  Accuracy acc;
};
EvalResult evaluate(Backend& be, const std::vector<Batch>& batches);

// TRAINING.md §6: the harness on the live run, with the live weights and zero entering states
// (all positions weighted when none is scored), judged as m3h compare judges a problem. oracle
// "cpu": a slice of the live batch (row 0, its first min(T, 256) positions) against
// reference<double> with the judged lineups (the same-precision emulation beside the perturbed
// oracle); "gpu": the whole live batch at the run's shape against the GPU oracle in f64 with its
// perturbed draws as the baseline (harness/device_compare.hpp), every figure on the device.
// worst_pct: the largest % of budget of any tensor.
struct VerifyResult {
  bool pass = true;
  double worst_pct = 0;
  std::string worst;            // the tensor at worst_pct (the first in execution order if tied)
  std::string first_fail;       // the first failing tensor in execution order ("" if none)
  std::string first_nonfinite;  // the first tensor the subject has non-finite ("" if none)
  // When it fails: the report's table of the failing tensors, each with its worst-element line
  // (values, budget, baseline), then the five largest shares of budget — what the run's message
  // shows so that the failure can be read without rerunning it.
  std::string failures;
  Idx tensors = 0;
};
// The problem verify_live_batch judges: the current weights (in double), zero entering states,
// every position scored when none is; the whole live (micro-)batch at the run's B and T, or
// (whole = false) its slice: row 0, the first min(T, 256) positions.
Problem verification_problem(const Config& cfg, const std::vector<float>& params,
                             const Batch& live, bool whole);
VerifyResult verify_live_batch(const Config& cfg, const std::string& device, ScanMode mode,
                               Precision storage, const std::vector<float>& params,
                               const Batch& live, const std::string& oracle = "cpu",
                               gpu::Fault fault = gpu::Fault::None);

struct TrainOptions {
  Config cfg;                 // vocab_size / input_dim are set from the data
  std::string device = "gpu";
  Precision storage = Precision::BF16;
  ScanMode mode = ScanMode::Chunked;
  Recompute recompute = Recompute::None;
  Idx B = 8, T = 256, steps = 1000, grad_accum = 1;
  OptimConfig optim;
  std::uint64_t seed = 0;
  std::vector<std::string> data;  // --data FILE... (text, the files concatenated), or
  double val_fraction = 0.05;
  std::string task;           // --task NAME
  Settings task_options;      // its options
  Idx eval_len = 0;           // tasks: also evaluate at this length (0 = no)
  std::string out;
  bool force = false;
  std::string resume;         // a checkpoint file (of the run in `out`). Its settings must
                              // all match, but for steps: a larger one extends the run (the
                              // learning rate follows the new length's schedule from the
                              // checkpoint's step on; config.txt and the console say so); a
                              // smaller one, or the run's own when the checkpoint is its last
                              // step, is refused (RunFinished for the latter)
  std::string init;           // a checkpoint whose weights start a new run (moments zero, step 0)
  Idx ckpt_every = 0, keep = 3, val_every = 0, val_batches = 8, log_every = 10;
  Idx verify_every = 0;        // verify_live_batch every N steps (0: never)
  std::string verify_oracle = "cpu";  // "cpu": a slice, the Eigen oracle; "gpu": the whole batch
  bool step_times = false;     // time each step's parts on the device; their medians at the end
  bool stage_times = false;    // the backbone's stage profile over the steps; its means at the end
  gpu::Fault verify_fault = gpu::Fault::None;  // tests: a fault in the verified GPU run
  std::string config_text;    // the resolved options, written to config.txt
  bool tty = false;
  int width = 0;              // columns of the console (0: no limit): the config line is
                              // broken to fit, and on a tty the status line (progress.hpp)
  // Data parallelism (parallel.hpp): --gpus G ranks of this process, or this process as one
  // rank of a job (--rank, --world-size, --nccl-id-file). B is the global batch. In a job only
  // rank 0 writes the run directory and the console; every rank takes the same decisions (the
  // losses, norms and stop flags are gathered).
  ParallelSpec par;
};

// The dataset of the options (text or task). Errors are m3::Error.
std::unique_ptr<Dataset> make_dataset(const TrainOptions& o, Idx T);

// The settings a checkpoint records and a resume compares, in order.
Settings run_settings(const TrainOptions& o, const Dataset& data);

// The task a checkpoint was trained on, rebuilt from its settings (run_settings' "task" and the
// task's options after it) at the run's T; null for a text run (its file is not recorded).
std::unique_ptr<Dataset> checkpoint_task(const CheckpointMeta& meta);

// The problem of training batch `micro` of step `step` of a checkpoint's run, as --verify-every
// judges it (verification_problem, whole): the run's data rebuilt — its own task, or the text
// files `data`, which must be the run's (the size and hash the checkpoint records; one m3::Error
// line naming both otherwise) — its train_batch(seed, step, micro, B_run, T_run) cut to its first
// B rows and T positions (0: the run's), the given weights, zero entering states. `where` heads
// the errors.
Problem training_batch_problem(const CheckpointMeta& meta, const Config& cfg,
                               const std::vector<float>& params,
                               const std::vector<std::string>& data, Idx step, Idx micro, Idx B,
                               Idx T, const std::string& where);

// The --step-times line of a run's timed steps, the k-th being step first_step + k: the
// medians of period, forward, backward, optimizer and of each step's period minus its parts
// (StepTimes), over the steps after the first three (all of them when there are at most
// three); the period's and the remainder's only over steps measured to the next step, unless
// none is, and the range of forward + backward over them. "train: step times: none measured"
// for an empty list.
std::string step_times_summary(const std::vector<StepTimes>& t, Idx first_step);

// The --stage-times table: "train: stage times per step, …" then one line per stage (name and
// ms per step: the profile's sums over `steps` steps, first_step … last_step, divided by
// steps), in the profile's order, and their total. "train: stage times: none measured" when
// there is no step or no stage.
std::string stage_times_table(const std::vector<std::pair<std::string, double>>& sums, Idx steps,
                              Idx first_step, Idx last_step);

// A resume from a run's final checkpoint with the run's own --steps: nothing to do. The CLI
// says so in one line and exits 1 (not 2: the input is well-formed, the run is done).
struct RunFinished : Error {
  using Error::Error;
};

// "94.2 k", "8.58 k", "856", "1.25 M": a count with three significant digits and a unit.
std::string human_count(double n);

// Runs the whole training; returns the exit status (0 done, 1 stopped by a failure — a
// non-finite loss or gradient, a failed verification — 130 interrupted). `out`: the console.
int run_training(const TrainOptions& o, std::ostream& out);

// TRAINING.md §7: the prompt through one forward, then each new token as a T = 1 step
// carrying the states. Returns the generated tokens. With `step_logits`, the logits of every
// position after the prompt's first (prompt positions from the full forward, then one per
// generated token) — for the test that stepping equals one forward.
struct SampleOptions {
  std::string checkpoint;
  std::string device = "gpu";
  std::vector<std::int32_t> prompt;
  Idx tokens = 100;
  double temperature = 1.0;  // 0 = greedy
  Idx top_k = 0;             // 0 = all
  std::uint64_t seed = 0;
};
std::vector<std::int32_t> sample(const SampleOptions& o, const Config& cfg,
                                 const std::vector<float>& params, ScanMode prompt_mode,
                                 Precision storage,
                                 std::vector<std::vector<float>>* step_logits = nullptr);

}  // namespace m3::train
