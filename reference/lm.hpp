// The language-model ends (TRAINING.md §1) of the reference, templated on the scalar:
// LmModel<double> is the oracle of a training step, LmModel<float> (with the bf16/f16 storage
// emulation of MODEL.md §8) its baseline and the CPU training path.
//
//   embed  h0[r, :]     = input_proj_w[tok[r], :] + input_proj_b      (= input_proj on one-hot)
//          d input_proj_w[v, :] += Σ_{r: tok[r] = v} δ⁰[r, :]  rows in the fixed order of
//          embed_order (sorted by token, then by r), summed per token from zero, then added
//   head   logits       = Out · head_w                    Out [B*T, dm], head_w [dm, V]
//   loss   lse[r]       = m_r + log Σ_v exp(logits[r, v] − m_r),  m_r = max_v logits[r, v]
//          loss         = (1/N) Σ_r w[r] (lse[r] − logits[r, tgt[r]]),  N = Σ_r w[r] of the step
//          d logits[r,v] = s · w[r]/N · (exp(logits[r, v] − lse[r]) − [v = tgt[r]])
//   with s the loss scale (f16 dynamic loss scaling, TRAINING.md §2.6; 1 otherwise) and N the
//   scored positions of the whole optimizer step (gradient accumulation normalises over the
//   step, §2.7), so each micro-batch's loss is its share of the step's loss.
//
// Storage (MODEL.md §8): logits and d_logits are typed (rounded to bf16/f16 where the GPU
// stores them: a GEMM's output or operand); lse and the head's d_Out (norm_f's dOut, f32 as
// without a head) are f32 (S); the loss is summed in double over rows in order, in every
// implementation. The head GEMMs read head_w's typed copy.
// Shapes: tok, tgt, w [B*T]; logits, d_logits [B*T, V]; lse [B*T].
#pragma once

#include <cstdint>
#include <vector>

#include "backbone.hpp"
#include "capture.hpp"
#include "config.hpp"
#include "params.hpp"
#include "precision.hpp"

namespace m3 {

namespace ref {

// The embedding backward's fixed order: order[i] for i in [starts[v], starts[v+1]) are the rows
// r with tok[r] = v, in increasing r (a counting sort). Throws m3::Error naming the first token
// outside 0 … V−1.
void embed_order(const std::int32_t* tok, Idx BT, Idx V, std::vector<Idx>& order,
                 std::vector<Idx>& starts);

// h0[r, :] = W[tok[r], :] + b  (W [V, dm], b [dm]; b may be nullptr).
template <class S>
void embed_forward(Idx BT, Idx V, Idx dm, const std::int32_t* tok, const S* W, const S* b, S* h0);
// dW[v, :] += Σ_{r: tok[r] = v} dH[r, :] in embed_order's order (each token's sum from zero,
// then added to dW); db (if not nullptr) += Σ_r dH[r, :] in r order.
template <class S>
void embed_backward(Idx BT, Idx V, Idx dm, const std::int32_t* tok, const S* dH, S* dW, S* db);

// lse[r] as above; returns Σ_r w[r]·(lse[r] − logits[r, tgt[r]]) / n_norm, summed in double in
// r order. Throws m3::Error when n_norm ≤ 0 or a target is outside 0 … V−1.
template <class S>
double loss_forward(Idx BT, Idx V, const S* logits, const std::int32_t* tgt, const float* w,
                    double n_norm, S* lse);
// d_logits (overwrite) = scale · w[r]/n_norm · (softmax − one-hot(tgt)).
template <class S>
void loss_backward(Idx BT, Idx V, const S* logits, const S* lse, const std::int32_t* tgt,
                   const float* w, double n_norm, double scale, S* d_logits);
// argmax[r] = the first v with the largest logits[r, v].
template <class S>
void argmax_rows(Idx BT, Idx V, const S* logits, std::int32_t* argmax);

}  // namespace ref

// The language-model ends of one step, as Backbone<S>::forward_lm / backward_lm run them
// (the head and the loss stages of the chain, chain.hpp). In: tgt, w, n_norm (forward), scale
// (backward). Out: logits, lse, loss; d_logits and d_out (the head's d_Out, norm_f's dOut).
template <class S>
struct LmEnds {
  std::vector<std::int32_t> tgt;
  std::vector<float> w;
  double n_norm = 0, scale = 1, loss = 0;
  std::vector<S> logits, lse, d_logits, d_out, head_w_typed;
};

// One training step's model: tokens → embed → the backbone (MODEL.md §3) → head → loss, and
// its backward. The backbone runs with zero entering states per call unless `states` are given.
template <class S>
class LmModel {
 public:
  // cfg.vocab_size must be > 0.
  LmModel(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage = Precision::F64);

  // The loss of the batch (its share of the step: Σ w·ce / n_norm). Keeps what backward needs.
  // `states` (optional): entering states, replaced by the leaving ones; nullptr: zero.
  double forward(const Params<S>& p, const std::vector<std::int32_t>& tok,
                 const std::vector<std::int32_t>& tgt, const std::vector<float>& w, double n_norm,
                 States<S>* states = nullptr, Capture* cap = nullptr);
  // Backward of scale·loss; every parameter gradient (head_w included) accumulates into grads.
  void backward(const Params<S>& p, double scale, Params<S>& grads, Capture* cap = nullptr);

  const std::vector<S>& logits() const;  // [B*T, V] (typed-rounded when storage is bf16/f16)
  std::vector<std::int32_t> argmax() const;
  Backbone<S>& backbone();

 private:
  Config cfg_;
  Idx B_, T_;
  Backbone<S> net_;
  LmEnds<S> ends_;
  std::vector<S> d_x_;
  States<S> zero_states_, d_entering_;
  bool have_forward_ = false;
};

}  // namespace m3
