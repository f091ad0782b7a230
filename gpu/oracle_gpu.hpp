// The GPU oracle: the whole backbone (MODEL.md §3–§6) and the language-model ends
// (TRAINING.md §1), forward and backward, in f64 on the GPU — a second oracle beside the Eigen
// Backbone<double>, for shapes the CPU cannot reach: the production path can be compared with
// it on the device, tensor by tensor, without copying either to the host.
//
// Written for clarity and independence from the production path (gpu/oracle/): every stage is
// a plain kernel with one thread per output element (per (b, h, a) for the angle walk) or a
// cuBLAS DGEMM, every tensor a contiguous f64 buffer, every index 64-bit; no tile, no fusion,
// no typed storage, no code shared with the production kernels and their helpers (gpu/stages,
// gpu/scan, gpu/tc, gpu/core; only core/cuda_check.hpp's status checks). The stage order is the
// chain driver's (reference/chain.hpp): the oracle is one more executor of it.
//
// The SSM (F6, B6) is the exact recurrence of MODEL.md §4 F6 / §6.3, not the chunked form:
//   h_t = α_t·h_{t−1} + β_t·v_{t−1}k_{t−1}ᵀ + γ_t·x_t K_tᵀ,   y_t = h_t Q_t + D·x_t
// walked in time, one thread per state element (b, h, p, n). The backward needs every h_t; the
// oracle keeps h only at segment boundaries (every K = ⌈√T⌉ steps) and recomputes a segment's
// states before its backward, so the scan holds about 3√T states per (b, h), not T + 1.
//
// Which registry tensors it provides: every stage tensor whose registry row exists in both
// scan modes (Modes::Both: the outputs, the leaving states and the entering-state gradients,
// and every stage tensor both modes share, e.g. L0/F6/y, L0/B6/d_x, L0/B6/d_adt_total), plus
// every parameter gradient (grad/…). The sequential-only (h_saved, k_prev_saved, d_q, d_alpha,
// …) and chunked-only (chunk_states, dQ_mid, …) intermediates are not provided: they describe
// one algorithm's inside, and the oracle's scan is the recurrence itself. oracle_stage_keys()
// lists them in execution order.
//
// Device memory (doubles; E = B·nh·hd·ds, the states of one layer; S = ⌈T/K⌉ segments):
//   OracleKeep::All       every provided tensor has its own buffer in every layer:
//                         L·(the layer tensors, forward and backward) + L·S·E checkpoints
//   OracleKeep::Backward  per layer only what that layer's backward reads (residual's source,
//                         rms_vals, post_norm, z, x, b/c_raw, dd_dt/dd_a/angles_raw, dt, a_val,
//                         trap, b/c_rms, angle_cumsum, k, q, α, β, γ, y, gated_rms_vals, gated,
//                         layer_output) + S·E checkpoints; every other layer tensor (the
//                         backward's, and proj, trap_raw, b/c_normed, b/c_biased, out_flat)
//                         has one buffer that every layer reuses (valid only while the
//                         observer runs; d_temporal alternates between two)
//   both add a workspace once: the scan's 2·(K+1)·E segment states and adjoints, E, 3·B·K·di
//   partials, d_k and d_q [B·T, nh, ds], the angle walk's Θ̄ [B·T, nh, na]; the backbone tensors
//   (X, H⁰, norm_f's, dOut, d_input_proj_dx; a token model's one-hot, logits, d_logits), the
//   states [L][B][…] (entering copy, leaving, both gradients) and the parameter and gradient
//   arenas. oracle_memory() gives the exact bytes of a shape before anything is allocated.
// At B 8, T 4096, the official widths (d_model 1024, headdim 64, d_state 128), 2 layers:
// 40.1 GB with OracleKeep::All, 29.9 GB with OracleKeep::Backward; 24 layers at B 1 with
// OracleKeep::Backward 23.9 GB (oracle_memory's figures; the scan's checkpoints are 1.07 GB a
// layer at B 8, where storing every h_t would take 68.7 GB a layer).
//
// The perturbed mode (set_perturbation; the GPU counterpart of harness/perturbed.hpp's
// run_perturbed_reference, the perturbed-oracle baseline of docs/HARNESS.md §4): after every
// stage, every tensor the stage stored gets the error of one rounding at its storage,
//   v ← v + ρ·max(u·|v|, tiny)   (v·(1 + u·ρ·sign v) where u·|v| ≥ tiny),   ρ uniform in [−1, 1),
// u = u_typed where the registry row is typed (stored in the run's bf16/f16 format, MODEL.md §8)
// and u_f32 elsewhere, tiny f16's absolute floor (harness::perturbation_of gives the three). The
// rounded value is what later stages read, what the observer sees and what a Capture receives,
// so the rounding propagates through the rest of the pass. The parameters, X, dOut and the
// entering states are rounded by the caller (harness::perturbed_problem, then set_params, …).
// ρ comes from a counter-based stream (gpu/oracle/perturb.cuh): the splitmix64 output
// (i + 1) of a stream keyed by (seed, the tensor's key string, which names its layer), 53 bits,
// so a value's ρ depends on the seed, the tensor and the element index only — not on the launch
// geometry, the order of the passes or OracleKeep; the same seed gives the same bits (each
// forward or backward pass draws the same ρ again: a new draw is a new seed).
// What is rounded, as harness/perturbed.cpp's PerturbedRun does it:
//   every layer stage's provided tensors (the rows both scan modes share, oracle_stage_keys,
//   forward and backward, the leaving states and the entering-state gradients with their
//   writers F5/F6 and B5a/B6), but F1/residual (the layer input, rounded where it was written);
//   b/c_biased also carry b/c_normed's rounding where the bias add cancels
//   (|b_normed| ≥ 4·|b_biased|); the backbone's input_proj_outputs and d_input_proj_dx (not
//   with an identity input projection), norm_f's Out, norm_f_rms and d_norm, a token model's
//   logits, lse, d_logits (before the head's GEMMs read it) and d_Out; and the staged typed
//   copy of δ that B8's GEMMs and input_proj's backward GEMMs (a token model: the embedding's
//   sum) read, at u_typed (the bias gradient and B1 read δ itself).
// Not rounded, as on the CPU: input_proj_inputs, F1/residual and norm_f_input (copies of
// rounded values), loss/value (from lse before its rounding) and the parameter gradients (the
// CPU's perturbed run leaves them unrounded: sums of rounded operands). Not modelled: the
// oracle's own internals (the scan's checkpoints and segment states, d_k, d_q, Θ̄, the per-row
// partials), and the tensors of one scan mode that the CPU's perturbed run also rounds —
// sequential: F6's h_saved, k_prev_saved, v_prev_saved (which the CPU's B6 reads back: there
// the GPU's B6 recomputes h from rounded inputs, without h's own f32 rounding) and B6's d_q,
// d_k, d_alpha, d_beta, d_gamma, d_d_local (consumed inside B6, so their rounding reaches
// nothing); chunked: F6's adt, *_saved, chunk_states, final_states and B6's chunked partials.
// So the GPU perturbed oracle models one rounding per stored registry tensor of the two modes'
// common rows.
// Cost: one elementwise pass per rounded tensor, reading and writing it once (16 bytes per
// element), plus δ's typed copy (read δ, write the copy: 16 bytes per element of [B·T,
// d_model]) per layer. At B 8, T 4096, the official widths (d_model 1024, headdim 64, d_state
// 128), per layer: 1.12e9 forward elements (17.9 GB) and 0.85e9 backward ones (13.5 GB), and
// 0.54 GB for δ's copy — about 32 GB of extra traffic per layer for a forward and a backward,
// some 10 ms at an H100's 3.35 TB/s (an estimate from the tensor sizes, not a measurement).
// set_perturbation allocates δ's copy ([B·T, d_model] doubles, 0.27 GB at that shape; memory()
// counts it as workspace).
//
// Plain C++ header (no CUDA types), so the harness and the tools include it without nvcc. A
// CPU-only build links a stub whose every entry that needs a device throws "no GPU"
// (oracle_stage_keys, oracle_memory and oracle_segment work in every build).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "params.hpp"
#include "problem.hpp"
#include "registry.hpp"
#include "stage_ids.hpp"

namespace m3::gpu {

// The agreement of the GPU oracle with the Eigen double oracle (Backbone<double>), held by
// tests/gpu/oracle over every golden case and a sweep of 64 random small problems
// (docs/HARNESS.md §6 has the measured worst values): every provided tensor within
//   max|oracle − Eigen| ≤ kOracleRtol·max(max|Eigen|, kOracleMinScale) + kOracleSpread·Δ
// against both of the Eigen oracle's scan modes (angles by circular distance), where Δ is the
// largest difference between the Eigen sequential and chunked runs of that tensor. Δ is
// rounding-level for every well-conditioned tensor, so the first term decides; a tensor whose
// two Eigen runs disagree by more is a cancellation of much larger terms (d_angle_state with
// zero entering states, which a common shift of every angle leaves unchanged, so it is zero in
// exact arithmetic; the q·k path's gradients at T = 1 with the gated norm, zero but for ε), and
// there Δ measures what rounding alone does to it. The floor is golden's (golden::Tolerance).
// Measured on an H100: the worst well-conditioned tensor at 3.3e-12 (B1/d_pre_norm of a
// one-value RMSNorm, d_model 1), then 2.3e-12 (B6/d_dt_direct at T = 1 with the gated norm),
// every other at most 1.2e-12, every golden case's at most 3.3e-13, the ill-conditioned ones at
// most 0.13 of their allowance; hence kOracleRtol 1e-11.
constexpr double kOracleRtol = 1e-11;
constexpr double kOracleMinScale = 1e-3;
constexpr double kOracleSpread = 10.0;

// Why the GPU oracle cannot run here ("" when a CUDA device is usable). Never throws.
std::string oracle_unavailable();

// The perturbed mode's rounding model (the file comment): relative u_typed for the registry's
// typed tensors, u_f32 for the others, each at least `tiny` absolutely, ρ from `seed`. All zero
// (the default): off, the plain oracle bit for bit. harness::Perturbation's fields, plus a seed.
// exact: instead of a random ±u, every such value is rounded to its storage format itself
// (round to nearest even: bf16 for u = 2^-8, f16 for 2^-11, f32 for 2^-24; another u stays
// random) — the roundings the production path makes at those values, deterministic, so that
// equal values round equally, as they do there (the seed is then unused).
struct OraclePerturbation {
  double u_typed = 0, u_f32 = 0, tiny = 0;
  std::uint64_t seed = 0;
  bool exact = false;
  // Coherent draws (harness/perturbed.hpp's Perturbation::coherent): ρ of a nonzero value is a
  // hash of its tensor's stream and the value's bits, so equal values of a tensor move alike;
  // and F2's proj and F8's out_flat also get the f32 accumulation error of their GEMM,
  // ρ·u_f32·√(n/2)·‖x_k·w_k‖₂ over the n terms, keyed the same way (oracle::accumulation).
  bool coherent = false;
  // Whether anything is rounded (tiny alone rounds nothing, as on the CPU: u = 0 skips a tensor).
  bool on() const { return u_typed != 0 || u_f32 != 0; }
};

enum class OracleKeep {
  All,       // every provided tensor of every layer stays readable after the pass
  Backward,  // per layer only what its backward reads; the rest is seen by the observer only
};

// A provided tensor's f64 values on the device (row-major, the registry's shape).
struct OracleTensor {
  std::string key;               // "L0/F6/y", "norm_f/Out", "grad/L1/in_proj_w", …
  int layer = -1;                // −1: a backbone tensor or a backbone parameter's gradient
  const double* data = nullptr;  // device pointer
  std::vector<Idx> shape;
  bool circular = false;  // an angle in [0, 2π): compare by circular distance
  Idx numel() const { return shape_numel(shape); }
};

// What one stage has just written: the observer's view (GpuOracle::set_observer).
struct OracleStage {
  StageId stage;
  int layer;  // −1 for a backbone stage
  Dir dir;
  std::vector<OracleTensor> tensors;  // the stage's provided tensors, registry order
};
using OracleObserver = std::function<void(const OracleStage&)>;

// The stage tensors the oracle provides for (cfg, B, T), in execution order (the registry rows
// that exist in both scan modes).
std::vector<KeyedSpec> oracle_stage_keys(const Config& cfg, Idx B, Idx T);

// Device bytes by role, as allocated (or as oracle_memory computes them for a shape).
struct OracleMemory {
  std::size_t layers = 0;     // every layer's own tensors and checkpoints
  std::size_t workspace = 0;  // the buffers every layer shares, and the scan's workspace
  std::size_t backbone = 0;   // input_proj, norm_f, dOut and the language-model ends
  std::size_t params = 0;     // the parameter and gradient arenas
  std::size_t states = 0;     // entering copy, leaving states and both state gradients
  std::size_t total() const { return layers + workspace + backbone + params + states; }
};
// Throws m3::Error for an invalid config or run shape (Config::validate, validate_run).
OracleMemory oracle_memory(const Config& cfg, Idx B, Idx T, OracleKeep keep);
// The scan's segment length K = ⌈√T⌉ (h is kept every K steps).
Idx oracle_segment(Idx T);

class GpuOracle {
 public:
  // Throws m3::Error for an invalid config or run shape, no usable device, or too little free
  // device memory (one line with the bytes needed and free, before any allocation).
  GpuOracle(const Config& cfg, Idx B, Idx T, OracleKeep keep = OracleKeep::All, int device = 0);
  ~GpuOracle();
  GpuOracle(const GpuOracle&) = delete;
  GpuOracle& operator=(const GpuOracle&) = delete;

  // Inputs, all f64 (sizes checked; one m3::Error line naming the input otherwise).
  void set_params(const Params<double>& p);
  void set_input(const std::vector<double>& X);     // [B·T, input_dim]
  void set_states(const States<double>& s);         // entering states [L][B][…]
  void set_dout(const std::vector<double>& d_out);  // [B·T, d_model]
  void set_leaving_grads(const States<double>* d);  // nullptr: zero
  void zero_grads();
  // A token model (vocab_size = V > 0): tokens [B·T] in 0 … V−1 instead of X; targets [B·T],
  // weights [B·T] and N > 0, the scored positions of the optimizer step (TRAINING.md §1, §2.7).
  void set_tokens(const std::vector<std::int32_t>& tok);
  void set_targets(const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                   double n_norm);
  // The perturbed mode for the passes that follow (a zero OraclePerturbation: off, the
  // default). Throws m3::Error for a u outside [0, 1) or a negative or non-finite tiny; the first
  // call with u_typed > 0 allocates δ's typed copy ([B·T, d_model] doubles).
  void set_perturbation(const OraclePerturbation& p);
  const OraclePerturbation& perturbation() const;
  // The teacher-forced mode for the passes that follow (nullptr: off, the default): the GPU
  // counterpart of harness::run_perturbed_isolated, the isolated cells' baseline (HARNESS.md
  // §2). Before each stage every provided tensor it may read is set to the teacher's value —
  // for a layer stage every provided tensor of the layer (and, before a backward stage, its
  // backward tensors and δ entering the layer), for norm_f, the head and the loss what they
  // read — and in the perturbed mode rounded once as a load, with its own stream per key (the
  // same values at every load); the stage's outputs are then rounded as in any perturbed pass,
  // and the observer and a Capture see them. The parameters, X, dOut and the entering states
  // are the problem loaded here (harness::perturbed_problem for a draw). Without a perturbation
  // every stage recomputes the teacher's outputs from the teacher's inputs, bit for bit (a test
  // holds it so). The teacher: an oracle of the same config and shape with OracleKeep::All, after
  // its pass, that stays unchanged while it teaches. Throws m3::Error otherwise (one line).
  void set_teacher(const GpuOracle* teacher);

  // forward: input_proj, the layers, norm_f (chain_forward); reads the entering states set
  // last and replaces them with the leaving ones. backward: gradients accumulate into the
  // gradient arena (zero_grads clears it); reads dOut (set_dout), or the head's d_Out after
  // backward_loss. A Capture receives every provided tensor as its stage finishes.
  void forward(Capture* cap = nullptr);
  void backward(Capture* cap = nullptr);
  // A token model: forward, then the head and the loss (chain_lm_forward); returns the batch's
  // share of the step's loss, Σ w·(lse − logit[tgt]) / N. backward_loss: the head's backward of
  // scale·loss (chain_lm_backward), then backward().
  double forward_loss(Capture* cap = nullptr);
  void backward_loss(double scale, Capture* cap = nullptr);

  // Called after every stage (and at each pseudo-stage's place) with the tensors it wrote, on
  // the device; the pointers are valid during the call (OracleKeep::Backward reuses workspace
  // buffers in the next layer). Work queued on stream() after the stage sees its results.
  void set_observer(OracleObserver obs);
  // The CUDA stream (a cudaStream_t) that the oracle's work is queued on.
  void* stream() const;
  void synchronize() const;

  // A provided tensor by key (a stage key of oracle_stage_keys or a "grad/…" key), after the
  // pass that writes it. Throws m3::Error for a key the oracle does not provide, or one whose
  // buffer OracleKeep::Backward reuses (it says so).
  OracleTensor tensor(const std::string& key) const;
  std::vector<double> download(const OracleTensor& t) const;

  std::vector<double> output() const;  // Out [B·T, d_model]
  States<double> states() const;       // the leaving states of the last forward
  Params<double> grads() const;
  States<double> d_entering() const;  // ∂L/∂(entering states) of the last backward
  std::vector<double> d_x() const;  // ∂L/∂X (a token model: ∂L/∂ one-hot) [B·T, input_dim]
  double loss() const;              // the last forward_loss's value

  OracleMemory memory() const;
  const Config& config() const;
  OracleKeep keep() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// pb into an oracle: parameters, entering states, zero leaving-state gradients and weight
// gradients, and the input (X and dOut; a token model: tokens and targets).
void load_problem(GpuOracle& o, const Problem& pb);
// One forward and backward pass of what load_problem loaded (a token model: one training step
// with pb.loss_scale()); `cap` receives every provided stage tensor (not the gradients).
void run_pass(GpuOracle& o, const Problem& pb, Capture* cap = nullptr);

// run_reference<double>(pb, mode)'s counterpart on the GPU oracle: forward and backward (a
// token model: one training step with pb.loss_scale()) from pb's entering states with zero
// leaving-state gradients, capturing every provided stage tensor and every parameter gradient.
Capture run_gpu_oracle(const Problem& pb, int device = 0);
// The same pass in the perturbed mode: with pb = harness::perturbed_problem(problem, pt, draw)
// and pert = {pt.u_typed, pt.u_f32, pt.tiny, a seed of the draw, e.g.
// harness::perturbation_seed(problem.seed, pt.u_typed, draw, 1)}, the GPU counterpart of
// harness::run_perturbed_reference(problem, sequential, pt, draw) (the file comment says which
// tensors it rounds; tests/gpu/oracle/test_gpu_oracle_perturb.cpp compares the two).
Capture run_gpu_oracle(const Problem& pb, const OraclePerturbation& pert, int device = 0);
// The teacher-forced pass: a teacher (OracleKeep::All) runs pb's pass, then a second oracle runs
// on `pp` (pb itself, or harness::perturbed_problem(pb, pt, draw)) with `pert`, fed the teacher's
// values stage by stage (set_teacher), capturing every provided stage tensor and every parameter
// gradient: harness::run_perturbed_isolated's counterpart (with pert's seed of role 2,
// harness::perturbation_seed(pb.seed, pt.u_typed, draw, 2)).
Capture run_gpu_oracle_isolated(const Problem& pb, const Problem& pp,
                                const OraclePerturbation& pert, int device = 0);

}  // namespace m3::gpu
