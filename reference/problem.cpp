// Seeded problems and the end-to-end reference run used by the harness (see problem.hpp).
#include "problem.hpp"

#include "lm.hpp"

#include <cmath>

#include "backbone.hpp"

namespace m3 {

Problem make_problem(const Config& cfg, Idx B, Idx T, std::uint64_t seed,
                     bool random_entering_states) {
  validate_run(cfg, B, T);
  Problem pb;
  pb.cfg = cfg;
  pb.B = B;
  pb.T = T;
  pb.seed = seed;
  // Independent streams per role, derived from the one seed.
  pb.params = make_params<double>(cfg, seed * 4 + 0, Init::Perturbed);
  if (cfg.vocab_size > 0) {
    Rng rng(seed * 4 + 1);
    const auto V = static_cast<std::uint64_t>(cfg.vocab_size);
    for (Idx r = 0; r < B * T; ++r) {
      pb.tok.push_back(static_cast<std::int32_t>(rng.next() % V));
      pb.tgt.push_back(static_cast<std::int32_t>(rng.next() % V));
      pb.w.push_back(r % 7 == 6 ? 0.0f : 1.0f);
    }
  } else {
    pb.x = make_input<double>(cfg, B, T, seed * 4 + 1);
    pb.d_out = make_dout<double>(cfg, B, T, seed * 4 + 2);
  }
  pb.states = random_entering_states ? random_states<double>(cfg, B, seed * 4 + 3)
                                     : zero_states<double>(cfg, B);
  return pb;
}

double Problem::scored() const {
  double n = 0;
  for (float v : w) n += v;
  return n;
}

double Problem::loss_scale() const {
  if (!token_model()) return 1.0;
  const double n = scored();
  return n > 1 ? std::exp2(std::ceil(std::log2(n))) : 1.0;
}

template <class S>
Capture run_reference(const Problem& pb, ScanMode mode, Precision storage,
                      const TensorSink& sink) {
  Capture cap(pb.cfg, pb.B, pb.T, sink);
  if (pb.token_model()) {
    LmModel<S> lm(pb.cfg, pb.B, pb.T, mode, storage);
    const Params<S> params = cast_params<S>(pb.params);
    States<S> states = cast_states<S>(pb.states);
    lm.forward(params, pb.tok, pb.tgt, pb.w, pb.scored(), &states, &cap);
    Params<S> grads = zero_params<S>(pb.cfg);
    lm.backward(params, pb.loss_scale(), grads, &cap);
    capture_grads(grads, pb.cfg, cap);
    return cap;
  }
  Backbone<S> net(pb.cfg, pb.B, pb.T, mode, storage);
  const Params<S> params = cast_params<S>(pb.params);
  States<S> states = cast_states<S>(pb.states);
  const std::vector<S> x(pb.x.begin(), pb.x.end());
  const std::vector<S> d_out(pb.d_out.begin(), pb.d_out.end());
  net.forward(params, x, states, &cap);
  Params<S> grads = zero_params<S>(pb.cfg);
  std::vector<S> d_x;
  States<S> d_entering;
  net.backward(params, d_out, nullptr, grads, d_x, d_entering, &cap);
  capture_grads(grads, pb.cfg, cap);
  return cap;
}

template Capture run_reference<double>(const Problem&, ScanMode, Precision, const TensorSink&);
template Capture run_reference<float>(const Problem&, ScanMode, Precision, const TensorSink&);

}  // namespace m3
