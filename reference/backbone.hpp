// The Eigen reference of the whole Mamba-3 SISO backbone (MODEL.md §3–§6), templated on the
// scalar: Backbone<double> is the oracle, Backbone<float> the f32 baseline.
//
//   H⁰    = X · input_proj_w + input_proj_b            (or H⁰ = X with input_proj_identity)
//   Hˡ⁺¹  = Layer_ℓ(Hˡ; entering states ℓ) for ℓ = 0 … L−1   (F1 … F8, §4)
//   Out   = RMSNorm(H^L; norm_f_weight)
//
// Shapes: X [B*T, input_dim], Out and dOut [B*T, d_model], states [L][B][…] (params.hpp).
// forward() reads the entering states and overwrites them with the leaving states; it keeps
// everything backward needs. backward() takes dOut and, optionally, gradients wrt the leaving
// states (to chain windows with gradient flow, MODEL.md §12.4), ACCUMULATES every parameter
// gradient into `grads` (§6.0) and OVERWRITES d_x and the gradients wrt the entering states.
// Single-threaded, fixed loop orders: the same build gives the same bytes on every run.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "params.hpp"
#include "precision.hpp"

namespace m3 {

template <class S>
struct LmEnds;  // lm.hpp

template <class S>
class Backbone {
 public:
  // `storage`: F64 (double) / F32 (float) store every tensor exactly; BF16 / F16 (float
  // compute only) emulate the GPU's mixed-precision storage policy, MODEL.md §8: each "typed"
  // tensor and the GEMM weight copies are rounded to nearest even where the GPU stores them.
  Backbone(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage = Precision::F64);
  ~Backbone();
  Backbone(Backbone&&) noexcept;
  Backbone& operator=(Backbone&&) noexcept;

  // Returns Out [B*T, d_model]. `cap` (optional) receives every forward stage tensor.
  const std::vector<S>& forward(const Params<S>& p, const std::vector<S>& X, States<S>& states,
                                Capture* cap = nullptr);

  // A token model (cfg.vocab_size = V > 0, TRAINING.md §1): the input is tokens [B*T] in
  // 0 … V−1 and input_proj runs as the embedding's row gather, the same math as forward() of
  // X = one-hot(tok) (a test holds them equal); the following backward() sums input_proj_w's
  // gradient per token in a fixed order (ref::embed_backward) and produces d_x (∂L/∂ one-hot,
  // nothing reads it) only for a Capture (else d_x is left empty). `cap` receives the one-hot
  // as input_proj_inputs.
  const std::vector<S>& forward_tokens(const Params<S>& p, const std::vector<std::int32_t>& tok,
                                       States<S>& states, Capture* cap = nullptr);

  // Requires a preceding forward() with the same parameters.
  void backward(const Params<S>& p, const std::vector<S>& d_out, const States<S>* d_leaving,
                Params<S>& grads, std::vector<S>& d_x, States<S>& d_entering,
                Capture* cap = nullptr);

  // A token model's step, the head and the loss on `ends` (lm.hpp) after the backbone:
  // forward_tokens, then logits and the loss of (ends.tgt, ends.w, ends.n_norm), returned;
  // backward_lm: the head's backward from the d logits of ends.scale·loss, then backward()
  // from its d_Out, with zero gradients wrt the leaving states.
  double forward_lm(const Params<S>& p, const std::vector<std::int32_t>& tok, States<S>& states,
                    LmEnds<S>& ends, Capture* cap = nullptr);
  void backward_lm(const Params<S>& p, LmEnds<S>& ends, Params<S>& grads, std::vector<S>& d_x,
                   States<S>& d_entering, Capture* cap = nullptr);

  const std::vector<S>& output() const;  // Out of the last forward
  const Config& config() const;
  Idx batch() const;
  Idx seq_len() const;
  ScanMode mode() const;
  Precision storage() const;

 private:
  // forward_tokens' checks (named `where`) and its token input.
  void prepare_tokens(const Params<S>& p, const std::vector<std::int32_t>& tok,
                      const States<S>& states, const char* where);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Puts every parameter gradient into `cap` under "grad/…" keys (registry order).
template <class S>
void capture_grads(const Params<S>& grads, const Config& cfg, Capture& cap);

}  // namespace m3
