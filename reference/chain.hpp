// The chain of stages of one pass over the backbone, once (docs/MODEL.md §3, §6). Every
// implementation of the backbone — the Eigen reference, the teacher-forced isolated runner,
// the perturbed oracle, the GPU path and its isolated mode — is an executor that these
// templates drive; none of them writes the order of the stages again.
//
//   forward    input_proj → for ℓ = 0 … L−1: enter_layer(ℓ), the layer's forward stages,
//              leave_layer(ℓ) → norm_f
//   lm ends    head → loss                   (a token model, after the forward)
//              head's backward               (before the backward; loss has none of its own:
//                                             head's backward starts from d logits)
//   backward   norm_f's backward → for ℓ = L−1 … 0: enter_layer_backward(ℓ), the layer's
//              backward stages, leave_layer_backward(ℓ) → input_proj's backward
//
// The gradient that enters layer ℓ's backward from above, δ, is norm_f's d_norm for the last
// layer and layer ℓ+1's B1/d_temporal otherwise; input_proj's backward reads layer 0's
// d_temporal (entering_gradient). The layer stages run in the order of the registry's stage
// table for the run's scan mode; a pseudo-stage (stage_ids.hpp) runs no stage function: the
// executor's pseudo() hook sees it at its place in the table (after F8: the leaving states;
// after B4b: B4c; after B1: the entering-state gradients).
//
// An executor E provides, for every stage s it can be asked to run (a missing one is a
// compile error):
//   void forward(Stage<s>, int layer)     a layer stage (layer ≥ 0) or a backbone stage (−1)
//   void backward(Stage<s>, int layer)
// and the hooks around them:
//   void before(StageId, int layer, Dir)  before each stage that runs (load what it reads)
//   void after(StageId, int layer, Dir)   after it (round, perturb, inject a fault, capture)
//   void pseudo(StageId, int layer, Dir)  at a pseudo-stage's place in the layer's stages
//   void enter_layer(int), leave_layer(int), enter_layer_backward(int), leave_layer_backward(int)
// An executor may keep these private and declare `friend struct m3::ChainAccess;`.
#pragma once

#include <string>
#include <vector>

#include "config.hpp"
#include "error.hpp"
#include "registry.hpp"
#include "stage_ids.hpp"

namespace m3 {

// The stages one pass of (cfg, mode) runs, computed once per run.
struct ChainPlan {
  int n_layers = 0;
  bool lm = false;                        // a token model: the head and the loss follow
  std::vector<StageId> layer_fwd, layer_bwd;  // the layer stages in order, pseudo-stages too
  // Per stage, the layer tensors of the run in the registry's order: `rows`, those under its
  // name (a pseudo-stage's too); `writes`, those it writes (its own rows and the rows of the
  // pseudo-stages it fills).
  std::vector<std::vector<const TensorSpec*>> rows, writes;

  static ChainPlan of(const Config& cfg, ScanMode mode);
  const std::vector<const TensorSpec*>& rows_of(StageId s) const {
    return rows[static_cast<size_t>(s)];
  }
  const std::vector<const TensorSpec*>& written_by(StageId s) const {
    return writes[static_cast<size_t>(s)];
  }
};

// A registry tensor of one layer (layer −1: a backbone tensor).
struct TensorRef {
  int layer;
  StageId stage;
  const char* tensor;
  std::string key() const { return stage_key(layer, stage_name(stage), tensor); }
};
// δ entering layer l's backward (l = −1: what input_proj's backward reads).
inline TensorRef entering_gradient(int l, int n_layers) {
  if (l + 1 == n_layers) return {-1, StageId::norm_f, "d_norm"};
  return {l + 1, StageId::B1, "d_temporal"};
}

// The driver's only way into an executor (friend of executors that keep their stages private).
struct ChainAccess {
  template <class E, class St>
  static void forward(E& e, St s, int l) { e.forward(s, l); }
  template <class E, class St>
  static void backward(E& e, St s, int l) { e.backward(s, l); }
  template <class E>
  static void before(E& e, StageId s, int l, Dir d) { e.before(s, l, d); }
  template <class E>
  static void after(E& e, StageId s, int l, Dir d) { e.after(s, l, d); }
  template <class E>
  static void pseudo(E& e, StageId s, int l, Dir d) { e.pseudo(s, l, d); }
  template <class E>
  static void enter_layer(E& e, int l) { e.enter_layer(l); }
  template <class E>
  static void leave_layer(E& e, int l) { e.leave_layer(l); }
  template <class E>
  static void enter_layer_backward(E& e, int l) { e.enter_layer_backward(l); }
  template <class E>
  static void leave_layer_backward(E& e, int l) { e.leave_layer_backward(l); }
};

namespace chain_detail {

using A = ChainAccess;

template <StageId s, class E>
void run_layer(E& e, int l, Dir dir) {
  if constexpr (stage_scope(s) == Scope::Layer && is_pseudo(s)) {
    A::pseudo(e, s, l, dir);
  } else if constexpr (stage_scope(s) == Scope::Layer) {
    A::before(e, s, l, dir);
    if constexpr (stage_row(s).dirs == Dirs::Forward) {
      A::forward(e, Stage<s>{}, l);
    } else {
      A::backward(e, Stage<s>{}, l);
    }
    A::after(e, s, l, dir);
  } else {
    throw Error("chain", "not a layer stage", stage_name(s));
  }
}

template <class E>
void run_layer_stage(E& e, StageId s, int l, Dir dir) {
  switch (s) {
#define M3_CHAIN_CASE(id, scope, dirs, writer) \
  case StageId::id:                           \
    run_layer<StageId::id>(e, l, dir);        \
    return;
    M3_STAGES(M3_CHAIN_CASE)
#undef M3_CHAIN_CASE
  }
}

template <StageId s, class E>
void run_backbone(E& e, Dir dir) {
  A::before(e, s, -1, dir);
  if (dir == Dir::Forward) {
    A::forward(e, Stage<s>{}, -1);
  } else {
    A::backward(e, Stage<s>{}, -1);
  }
  A::after(e, s, -1, dir);
}

}  // namespace chain_detail

// input_proj, the layers, norm_f.
template <class E>
void chain_forward(E& e, const ChainPlan& plan) {
  chain_detail::run_backbone<StageId::input_proj>(e, Dir::Forward);
  for (int l = 0; l < plan.n_layers; ++l) {
    ChainAccess::enter_layer(e, l);
    for (StageId s : plan.layer_fwd) chain_detail::run_layer_stage(e, s, l, Dir::Forward);
    ChainAccess::leave_layer(e, l);
  }
  chain_detail::run_backbone<StageId::norm_f>(e, Dir::Forward);
}

// A token model's ends after chain_forward: the head's logits, then the loss.
template <class E>
void chain_lm_forward(E& e) {
  ChainAccess::before(e, StageId::head, -1, Dir::Forward);
  ChainAccess::forward(e, Stage<StageId::head>{}, -1);
  ChainAccess::after(e, StageId::head, -1, Dir::Forward);
  ChainAccess::before(e, StageId::loss, -1, Dir::Forward);
  ChainAccess::forward(e, Stage<StageId::loss>{}, -1);
  ChainAccess::after(e, StageId::loss, -1, Dir::Forward);
}
// The head's backward (from the loss's d logits to norm_f's dOut), before chain_backward.
template <class E>
void chain_lm_backward(E& e) {
  chain_detail::run_backbone<StageId::head>(e, Dir::Backward);
}

// norm_f's backward, the layers from the last, input_proj's backward.
template <class E>
void chain_backward(E& e, const ChainPlan& plan) {
  chain_detail::run_backbone<StageId::norm_f>(e, Dir::Backward);
  for (int l = plan.n_layers - 1; l >= 0; --l) {
    ChainAccess::enter_layer_backward(e, l);
    for (StageId s : plan.layer_bwd) chain_detail::run_layer_stage(e, s, l, Dir::Backward);
    ChainAccess::leave_layer_backward(e, l);
  }
  chain_detail::run_backbone<StageId::input_proj>(e, Dir::Backward);
}

// A whole step: the forward, a token model's ends (head, loss, head's backward), the backward.
template <class E>
void chain_step(E& e, const ChainPlan& plan) {
  chain_forward(e, plan);
  if (plan.lm) {
    chain_lm_forward(e);
    chain_lm_backward(e);
  }
  chain_backward(e, plan);
}

}  // namespace m3
