// The production GPU backbone: the same computation as the reference Backbone
// (reference/backbone.hpp, MODEL.md §3–§6) with every stage a CUDA kernel or a cuBLAS GEMM,
// both scan modes, entering states and their gradients, deterministic (§7, §12.9), in f32,
// bf16 or f16 storage (§8: typed activations at kernel boundaries, everything else f32; the
// storage type is chosen once, in the constructor).
//
// Plain C++ header (no CUDA types), so the harness and the tools include it without nvcc.
// All device memory for (config, B, T, mode, storage) is allocated in the constructor, in the
// production layout (reference/registry.hpp Life): per layer only what the backward reads
// (saved), one workspace buffer per tensor shared by all layers, no verification-only tensor;
// production forward() and backward() allocate nothing. The first Capture (or run_isolated,
// set_fusion(false), a fault) switches to the verification layout once, for good: every
// registry tensor its own buffer in every layer, as the harness compares them.
// Parameters and gradients are two flat f32 arenas in ParamLayout order (param_layout(cfg)). Data stays on the device between calls: set_*()
// upload, output()/states()/grads()/… download. A Capture passed to forward()/backward()
// receives every registry tensor of every stage under the reference's names (a download per
// tensor, so only for verification runs).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "context.hpp"
#include "params.hpp"
#include "precision.hpp"
#include "problem.hpp"
#include "registry.hpp"
#include "stage_ids.hpp"

namespace m3::gpu {

// Faults for the harness's negative controls (HARNESS.md §4, issue: "an injected fault in one
// GPU stage must fail the budget and be named as the first failing stage"). Each corrupts the
// stage's output on the device right after the stage, in layer `layer` only:
//   DropBeta          F5b: beta = 0 (the trapezoid's β·v_{t−1}k_{t−1} term dropped; in the
//                     chunked mode F5b's β is still computed and compared)
//   FlipAngleSign     F5:  θ → 2π − θ (the angle sign flipped)
//   ChunkBoundaryOff  F6:  y of the first step of every chunk replaced by the step before
//                     (a chunk boundary off by one; also applied in the sequential mode at the
//                     same positions, so both modes have the fault)
//   RoundTwice        F6:  y rounded once more, to a coarser format (bf16 for f32/f16 storage,
//                     bf16 with 2 fewer mantissa bits for bf16 storage)
enum class Fault { None, DropBeta, FlipAngleSign, ChunkBoundaryOff, RoundTwice };
const char* fault_name(Fault f);
Fault parse_fault(const std::string& s);  // "none", "drop-beta", …; throws m3::Error
const char* fault_stage(Fault f);         // the registry stage the fault corrupts ("F5b", …)

// Device bytes a GpuBackbone holds, by role (its own DeviceArrays; gpu/device.hpp counts the
// same allocations process-wide).
struct BackboneMemory {
  std::vector<std::size_t> layers;  // each layer's own buffers (saved tensors, state buffers)
  std::size_t workspace = 0;        // the shared workspace buffers (production layout)
  std::size_t backbone = 0;         // input_proj, norm_f, δ and dOut tensors
  std::size_t params = 0;           // the master, gradient and typed-copy arenas
  std::size_t states = 0;           // entering/leaving states, their gradients and the copy of
                                    // the entering states repeat_digests reruns from, all layers
  std::size_t scratch = 0;          // the stages' reduction scratch
  std::size_t tokens = 0;           // a token model's tokens, targets, weights, embedding order
                                    // and partials, loss terms and argmax (0 without a vocab)
  std::size_t digests = 0;          // repeat_digests' segments and digests (after its first call)
  std::size_t total() const {
    std::size_t t = workspace + backbone + params + states + scratch + tokens + digests;
    for (std::size_t b : layers) t += b;
    return t;
  }
};

// The production path's default recompute policy (registry.hpp Recompute): none, the fastest.
// Recompute::Scan halves the bytes per layer for one prep and one state pass more per layer's
// backward (docs/PERF.md has both figures); the constructor says so when the default does not
// fit the device.
constexpr Recompute kDefaultRecompute = Recompute::None;

class GpuBackbone {
 public:
  // Throws m3::Error when the config is invalid or the GPU path cannot run it (see unsupported).
  GpuBackbone(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode,
              Precision storage = Precision::F32, Recompute rc = kDefaultRecompute);
  ~GpuBackbone();
  GpuBackbone(const GpuBackbone&) = delete;
  GpuBackbone& operator=(const GpuBackbone&) = delete;

  // Why the GPU path cannot run this shape ("" when it can).
  static std::string unsupported(const Config& cfg, Idx B, Idx T);

  Precision storage() const;

  void set_params(const Params<float>& p);        // f32 masters; typed GEMM copies refreshed
  void set_input(const std::vector<float>& X);     // [B*T, input_dim] (rounded to storage)
  void set_states(const States<float>& s);        // entering states [L][B][…] (f32)
  void set_dout(const std::vector<float>& d_out);  // [B*T, d_model] (f32)
  void set_leaving_grads(const States<float>* d);  // nullptr: zero
  void zero_grads();
  void set_fault(Fault f, int layer = 0);          // a negative control; Fault::None clears it

  // forward: reads the entering states set last; the leaving states replace them (so a second
  // forward continues the sequence, as chained windows do).
  void forward(Capture* cap = nullptr);
  // backward of the last forward; gradients accumulate into the weight-gradient buffers.
  void backward(Capture* cap = nullptr);

  // Isolated (teacher-forced) mode, HARNESS.md §2: every stage, in execution order, is fed the
  // ORACLE's values of everything it reads (rounded to this storage), runs alone, and only its
  // own outputs are captured (then the oracle's values are restored for the next stage).
  // Parameter gradients: each comes from one stage of one layer, so the capture's "grad/…" are
  // that stage's contributions. Uses the parameters, entering states and dOut set before;
  // `oracle` must hold every registry tensor of this run (run_reference<double>).
  Capture run_isolated(const Capture& oracle);
  // For tests: the same, with every registry tensor that the stage table says a stage neither
  // reads nor writes poisoned (NaN) while that stage runs — equal to run_isolated bit for bit
  // exactly when the table lists every read of every stage.
  Capture run_isolated_poisoned_for_testing(const Capture& oracle);
  // The isolated mode with its teacher on the device (the device comparison's isolated cells,
  // docs/HARNESS.md §11). `teacher` gives a registry key's n values as f64 on the device, or
  // nullptr where it lacks the key: the GPU oracle provides the rows both scan modes share, not
  // the inside of one scan algorithm. Every key the teacher has is restored as run_isolated
  // restores a Capture's (each value rounded to f32, then to this storage where the buffer is
  // typed: the same bits). Where the teacher lacks F6's internals that B6 reads (sequential:
  // h_saved, k_prev_saved, v_prev_saved; chunked: k_scaled_saved, the saved scalars and cumsums,
  // chunk_states_saved), F6 runs again on the teacher's inputs just before B6 to rebuild them —
  // as Recompute::Scan rebuilds them in production — and then F6's outputs the teacher has are
  // the teacher's again. After each stage, with its outputs in their buffers (before the
  // teacher's values go back), `observe` is called: device_tensor reads the stage's keys then,
  // and the parameter gradients (each stage's contributions, as run_isolated's "grad/…") after
  // the run.
  using DeviceTeacher = std::function<const double*(const std::string& key, Idx n)>;
  using IsolatedObserver = std::function<void(StageId stage, int layer, Dir dir)>;
  void run_isolated(const DeviceTeacher& teacher, const IsolatedObserver& observe);

  // ---- token models (cfg.vocab_size = V > 0; TRAINING.md §1) -------------------------------
  // The input is tokens [B*T] in 0 … V−1 instead of X: input_proj runs as the embedding's row
  // gather (the bits of the one-hot GEMM) and its backward sums δ⁰'s typed rows per token in a
  // fixed order (no atomics). Replaces set_input until set_input is called again. A token
  // outside the vocabulary is an m3::Error naming the row.
  void set_tokens(const std::vector<std::int32_t>& tok);
  // Targets [B*T] in 0 … V−1, weights [B*T] (1 = scored) and N, the scored positions of the
  // whole optimizer step (> 0; the loss normalisation of TRAINING.md §2.7).
  void set_targets(const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                   double n_norm);
  // Staging (training's next batch, prepared while the device still works on this one):
  // stage_batch does set_tokens' and set_targets' host work — every check, with the same
  // errors, and the embedding backward's order — into pinned host memory and copies nothing;
  // upload_staged queues the copies of the batch staged last (from pinned memory, so the host
  // does not wait on them) and makes it the input, as set_tokens + set_targets would with the
  // same arguments. Two pinned slots alternate, so a batch can be staged while the one before
  // it is still being copied. upload_staged without a staged batch is an m3::Error.
  void stage_batch(const std::vector<std::int32_t>& tok, const std::vector<std::int32_t>& tgt,
                   const std::vector<float>& w, double n_norm);
  void upload_staged();
  // forward(), then the head (logits = Out · head_w, typed) and the loss: returns this batch's
  // share of the step's loss, Σ w·(lse − logit[tgt]) / N, summed in f64 in a fixed order (one
  // 8-byte download). `cap` also receives head/logits, loss/lse, loss/value.
  double forward_loss(Capture* cap = nullptr);
  // The same without waiting for the loss (the backward can be queued behind it); loss() waits
  // for the last forward_loss's loss.
  void forward_loss_async(Capture* cap = nullptr);
  double loss() const;
  // The backward of scale·loss: d_logits, the head's GEMMs (d_Out typed, head_w's gradient
  // accumulated), then backward(). `cap` also receives head/d_logits and head/d_Out.
  void backward_loss(double scale, Capture* cap = nullptr);
  // The scale of the loss whose gradient backward_loss makes (backward_loss sets it; the
  // isolated mode's head (bwd) uses the one set last; 1 at first).
  void set_loss_scale(double scale);
  std::vector<float> logits() const;               // [B*T, V] of the last forward_loss
  std::vector<std::int32_t> argmax() const;        // [B*T]: the first largest logit per row

  // m3h determinism at CI scale (HARNESS.md §7): reruns forward + backward of what was loaded
  // (the tokens/targets or the input and dOut set last) from the entering states set last, with
  // zero gradients and zero leaving-state gradients, every registry tensor stored as a Capture
  // would (the verification layout; `cap`, optional, receives them too), and returns one 64-bit
  // digest per key of repeat_digest_keys(cfg, B, T, mode): every registry tensor's buffer at
  // the end of the run, then every parameter gradient — computed on the device
  // (gpu/verify/digest.cuh), so a run copies no tensor to the host.
  std::vector<std::uint64_t> repeat_digests(Capture* cap = nullptr);
  // After repeat_digests: where a key of repeat_digest_keys (a registry tensor or a parameter
  // gradient "grad/…") lives on the device, as that run left it and as a Capture of it reads
  // (the verification layout: contiguous, its own buffer): the device comparison
  // (harness/device_compare.hpp) reads it in place. `storage` is F32 for an f32 buffer and the
  // run's bf16/f16 for a typed one. Valid until the next pass; throws m3::Error for a key this
  // run does not have, or before a repeat_digests (or the device-teacher run_isolated, during
  // which it reads the stage just run).
  struct DeviceTensor {
    const void* data = nullptr;
    Precision storage = Precision::F32;
    Idx n = 0;
  };
  DeviceTensor device_tensor(const std::string& key);

  std::vector<float> output() const;     // Out [B*T, d_model]
  States<float> states() const;          // current (leaving) states
  Params<float> grads() const;           // accumulated weight gradients
  std::vector<float> d_x() const;        // ∂L/∂X of the last backward
  States<float> d_entering() const;      // ∂L/∂(entering states) of the last backward

  void synchronize() const;

  // Stage profile (for m3h bench --profile): when on, a CUDA event is recorded after every
  // stage of forward()/backward() and stage_times() gives the milliseconds per stage name
  // ("F6", "B6", "norm_f", …; summed over layers), in first-seen order, since the last reset.
  // Events come from a pool made once; off, nothing is recorded.
  void set_profiling(bool on);
  std::vector<std::pair<std::string, double>> stage_times() const;
  void reset_stage_times();

  // Cross-stage fusion (on by default): F4 stores no b/c_biased (F4ef and the chunked B6
  // recompute them from b/c_normed and the biases, bit for bit); in the chunked mode F4ef also
  // runs F6's K0/K1 (and stores k only where F6 reads it, t = T − 1), and B6's backward tail
  // also does B4b (the head sums into d_b/c_normed and the bias gradients) and stores no
  // d_b/c_pre_rope; B4b then runs B4c alone. Tensors a Capture asks for are stored
  // anyway. Off: every stage on its own, as run_isolated always runs them. Same results
  // either way (test FusedBackwardTailEqualsStageByStage: bit for bit, except the bias
  // gradients, which the fused tail sums in another fixed order).
  void set_fusion(bool on);
  // The chunked B6's tail inside B3 (off by default; typed runs whose shape allows it,
  // gpu::ssm_chunked_cluster_tail): step 2 and B4b's head sums run in B3's blocks, in clusters
  // of heads, so dQ_mid and dK_mid stay on chip (and need no buffer; the scratch grows by the
  // cluster partials). The head sums, the bias gradients and dScale/dGamma then add in another
  // fixed order (clusters of heads; chunks of rows; the fragment layout's row sums): the results
  // are the standalone tail's within rounding (test ClusterTailAgreesWithTheSeparateTail). Off
  // by default because it is the slower of the two per marginal layer (bf16;
  // docs/log/PERF-history.md); off: the standalone tail kernel.
  // Changing it re-lays out the buffers and the scratch.
  void set_cluster_tail(bool on);
  // Whether the chunked B6 runs its tail inside B3 in this run (set_cluster_tail on, and the
  // mode, storage and shape allow it).
  bool cluster_tail() const;

  // The flat arenas: f32 master parameters and f32 gradients, one device buffer each of
  // param_layout().total floats (slots in MODEL.md §2 order, 256-byte aligned, gaps zero).
  // Device pointers, for a whole-buffer optimizer step or collective; the backbone works on them
  // on the context's stream, so work on another stream is ordered with it (synchronize(), or
  // events) on both sides. After the masters were changed on the device,
  // refresh_typed_copies() re-rounds the GEMM weights' bf16/f16 compute copies from them (one
  // launch, on the context's stream; nothing for f32).
  const ParamLayout& param_layout() const;
  // Host copies of the whole master arena (param_layout().total floats, gaps zero), for
  // checkpoints; set_params_flat uploads one (gaps must be zero) and refreshes the typed copies.
  std::vector<float> params_flat() const;
  void set_params_flat(const std::vector<float>& flat);
  // Zero entering states for every layer, on the device (a new sequence).
  void zero_states();
  float* param_arena();
  float* grad_arena();
  void refresh_typed_copies();

  // The production recompute policy; changing it re-lays out the production buffers (their
  // values are gone: run a forward before the next backward; graphs recorded before are void).
  Recompute recompute() const;
  void set_recompute(Recompute rc);
  // True once a Capture, run_isolated, set_fusion(false) or a fault switched to the
  // verification layout.
  bool verification_layout() const;
  BackboneMemory memory() const;
  // For tests: NaN into layer `layer`'s tensor `tensor` (a registry or state-buffer name;
  // layer −1: a backbone buffer "stage/tensor"), or into every shared workspace buffer when
  // tensor is "*workspace*". A tensor without a buffer in this layout is left alone.
  void poison_for_testing(int layer, const std::string& tensor);

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The keys of GpuBackbone::repeat_digests, in its order: the registry tensors of
// expected_stage_keys, then the parameter gradients of expected_param_keys.
std::vector<std::string> repeat_digest_keys(const Config& cfg, Idx B, Idx T, ScanMode mode);

// For tests: the chunked scan's per-row kernels (K0/K1's prep with F4ef, step 2's tail) launch
// at most `rows` rows at a time (rounded down to whole tail blocks of 64 rows for the tail; 0
// restores the default, the most rows whose 32-bit offsets fit, one launch at usual shapes).
// Lets a test check that a launch split into slabs gives the same bits as one launch.
void set_row_slab_limit_for_testing(Idx rows);

// pb's parameters, input, entering states and dOut into net, with zero leaving-state
// gradients and zeroed weight gradients: what run_gpu, run_gpu_isolated and bench_gpu run on.
void load_problem(GpuBackbone& net, const Problem& pb);

// The GPU counterpart of run_reference<float>(pb, mode, storage): forward + backward of
// pb.d_out with zero leaving-state gradients, capturing every stage tensor and every parameter
// gradient. `fault` (layer 0) is for negative controls.
Capture run_gpu(GpuContext& ctx, const Problem& pb, ScanMode mode,
                Precision storage = Precision::F32, Fault fault = Fault::None);

// The isolated (teacher-forced) run of GpuBackbone::run_isolated on pb.
Capture run_gpu_isolated(GpuContext& ctx, const Problem& pb, ScanMode mode,
                         const Capture& oracle, Precision storage = Precision::F32,
                         Fault fault = Fault::None);

}  // namespace m3::gpu
