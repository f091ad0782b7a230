// The language-model ends of the reference (lm.hpp has the math): the embedding's gather and
// its fixed-order backward, softmax cross-entropy, and LmModel, one training step's model over
// Backbone::forward_lm / backward_lm (the chain driver runs embed → layers → head → loss).
#include "lm.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "error.hpp"
#include "registry.hpp"
#include "stages.hpp"

namespace m3 {

namespace ref {

void embed_order(const std::int32_t* tok, Idx BT, Idx V, std::vector<Idx>& order,
                 std::vector<Idx>& starts) {
  starts.assign(static_cast<size_t>(V + 1), 0);
  for (Idx r = 0; r < BT; ++r) {
    M3_REQUIRE(tok[r] >= 0 && tok[r] < V, "embed", "token outside the vocabulary", "row ", r,
               ": token ", tok[r], ", vocab_size ", V);
    ++starts[static_cast<size_t>(tok[r]) + 1];
  }
  for (Idx v = 0; v < V; ++v) starts[v + 1] += starts[v];
  order.assign(static_cast<size_t>(BT), 0);
  std::vector<Idx> next(starts.begin(), starts.end() - 1);
  for (Idx r = 0; r < BT; ++r) order[static_cast<size_t>(next[tok[r]]++)] = r;
}

template <class S>
void embed_forward(Idx BT, Idx V, Idx dm, const std::int32_t* tok, const S* W, const S* b,
                   S* h0) {
  for (Idx r = 0; r < BT; ++r) {
    M3_REQUIRE(tok[r] >= 0 && tok[r] < V, "embed", "token outside the vocabulary", "row ", r,
               ": token ", tok[r], ", vocab_size ", V);
    const S* w = W + static_cast<Idx>(tok[r]) * dm;
    for (Idx j = 0; j < dm; ++j) h0[r * dm + j] = b ? w[j] + b[j] : w[j];
  }
}

template <class S>
void embed_backward(Idx BT, Idx V, Idx dm, const std::int32_t* tok, const S* dH, S* dW, S* db) {
  std::vector<Idx> order, starts;
  embed_order(tok, BT, V, order, starts);
  std::vector<S> acc(static_cast<size_t>(dm));
  for (Idx v = 0; v < V; ++v) {
    if (starts[v] == starts[v + 1]) continue;
    std::fill(acc.begin(), acc.end(), S(0));
    for (Idx i = starts[v]; i < starts[v + 1]; ++i) {
      const S* g = dH + order[i] * dm;
      for (Idx j = 0; j < dm; ++j) acc[j] += g[j];
    }
    for (Idx j = 0; j < dm; ++j) dW[v * dm + j] += acc[j];
  }
  if (db) {
    std::fill(acc.begin(), acc.end(), S(0));
    for (Idx r = 0; r < BT; ++r)
      for (Idx j = 0; j < dm; ++j) acc[j] += dH[r * dm + j];
    for (Idx j = 0; j < dm; ++j) db[j] += acc[j];
  }
}

template <class S>
double loss_forward(Idx BT, Idx V, const S* logits, const std::int32_t* tgt, const float* w,
                    double n_norm, S* lse) {
  M3_REQUIRE(n_norm > 0, "loss", "no scored position (N = 0): the loss is undefined",
             "N=", n_norm);
  double sum = 0;
  for (Idx r = 0; r < BT; ++r) {
    const S* l = logits + r * V;
    S mx = l[0];
    for (Idx v = 1; v < V; ++v) mx = std::max(mx, l[v]);
    S se = 0;
    for (Idx v = 0; v < V; ++v) se += std::exp(l[v] - mx);
    lse[r] = mx + std::log(se);
    M3_REQUIRE(tgt[r] >= 0 && tgt[r] < V, "loss", "target outside the vocabulary", "row ", r,
               ": target ", tgt[r], ", vocab_size ", V);
    if (w[r] != 0.0f)
      sum += static_cast<double>(w[r]) * (static_cast<double>(lse[r]) - static_cast<double>(l[tgt[r]]));
  }
  return sum / n_norm;
}

template <class S>
void loss_backward(Idx BT, Idx V, const S* logits, const S* lse, const std::int32_t* tgt,
                   const float* w, double n_norm, double scale, S* d_logits) {
  M3_REQUIRE(n_norm > 0, "loss", "no scored position (N = 0): the loss is undefined",
             "N=", n_norm);
  for (Idx r = 0; r < BT; ++r) {
    const S c = static_cast<S>(scale * static_cast<double>(w[r]) / n_norm);
    const S* l = logits + r * V;
    S* d = d_logits + r * V;
    for (Idx v = 0; v < V; ++v) {
      const S p = std::exp(l[v] - lse[r]);
      d[v] = c * (v == tgt[r] ? p - S(1) : p);
    }
  }
}

template <class S>
void argmax_rows(Idx BT, Idx V, const S* logits, std::int32_t* argmax) {
  for (Idx r = 0; r < BT; ++r) {
    const S* l = logits + r * V;
    Idx best = 0;
    for (Idx v = 1; v < V; ++v)
      if (l[v] > l[best]) best = v;
    argmax[r] = static_cast<std::int32_t>(best);
  }
}

#define M3_INSTANTIATE(S)                                                                     \
  template void embed_forward<S>(Idx, Idx, Idx, const std::int32_t*, const S*, const S*, S*); \
  template void embed_backward<S>(Idx, Idx, Idx, const std::int32_t*, const S*, S*, S*);      \
  template double loss_forward<S>(Idx, Idx, const S*, const std::int32_t*, const float*,      \
                                  double, S*);                                                \
  template void loss_backward<S>(Idx, Idx, const S*, const S*, const std::int32_t*,           \
                                 const float*, double, double, S*);                           \
  template void argmax_rows<S>(Idx, Idx, const S*, std::int32_t*);
M3_INSTANTIATE(double)
M3_INSTANTIATE(float)
#undef M3_INSTANTIATE

}  // namespace ref

template <class S>
LmModel<S>::LmModel(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage)
    : cfg_(cfg), B_(B), T_(T), net_(cfg, B, T, mode, storage) {
  M3_REQUIRE(cfg.vocab_size > 0, "LmModel", "the config has no vocabulary (vocab_size = 0)",
             "a language model needs vocab_size > 0");
  zero_states_ = zero_states<S>(cfg, B);
}

template <class S>
double LmModel<S>::forward(const Params<S>& p, const std::vector<std::int32_t>& tok,
                           const std::vector<std::int32_t>& tgt, const std::vector<float>& w,
                           double n_norm, States<S>* states, Capture* cap) {
  const Idx BT = B_ * T_;
  M3_REQUIRE(static_cast<Idx>(tgt.size()) == BT && static_cast<Idx>(w.size()) == BT,
             "LmModel::forward", "targets and weights must have B*T entries", "got ", tgt.size(),
             " and ", w.size(), ", expected ", BT);
  ends_.tgt = tgt;
  ends_.w = w;
  ends_.n_norm = n_norm;
  States<S> zero;
  if (!states) zero = zero_states_;
  const double loss = net_.forward_lm(p, tok, states ? *states : zero, ends_, cap);
  have_forward_ = true;
  return loss;
}

template <class S>
void LmModel<S>::backward(const Params<S>& p, double scale, Params<S>& grads, Capture* cap) {
  M3_REQUIRE(have_forward_, "LmModel::backward", "backward called before forward", "");
  ends_.scale = scale;
  net_.backward_lm(p, ends_, grads, d_x_, d_entering_, cap);
}

template <class S>
const std::vector<S>& LmModel<S>::logits() const {
  return ends_.logits;
}

template <class S>
std::vector<std::int32_t> LmModel<S>::argmax() const {
  std::vector<std::int32_t> a(static_cast<size_t>(B_ * T_));
  ref::argmax_rows(B_ * T_, cfg_.vocab_size, ends_.logits.data(), a.data());
  return a;
}

template <class S>
Backbone<S>& LmModel<S>::backbone() {
  return net_;
}

template class LmModel<double>;
template class LmModel<float>;

}  // namespace m3
