// The perturbed oracle (see perturbed.hpp).
#include "perturbed.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <functional>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "backbone.hpp"  // capture_grads
#include "chain.hpp"
#include "error.hpp"
#include "lm.hpp"  // ref::embed_*, loss_*
#include "params.hpp"  // Rng
#include "registry.hpp"
#include "stages.hpp"

namespace m3::harness {

std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

namespace {

// BCNorm's bias add cancels where |b_normed| is at least this many times |b_biased|.
constexpr double kCancelledBiasAdd = 4;

// The GEMM weights: the GEMMs read their typed compute copies (MODEL.md §8).
bool is_gemm_weight(const std::string& name) {
  return name == "in_proj_w" || name == "out_proj_w" || name == "input_proj_w" || name == "head_w";
}

using Vec = std::vector<double>;
using Fields = std::vector<ref::TensorField<double>>;

// The reference in double as an executor of the stage chain, with every tensor a stage writes
// perturbed right after the stage (stream order: the stages' in chain order, each stage's
// tensors in act_fields / grad_fields order). With a teacher every stage is instead fed the
// teacher's values, perturbed once per key at its first load, and captures only its own
// outputs. With a zero Perturbation and no teacher it is run_reference<double> bit for bit (a
// test holds it so).
// A coherent draw's ρ of value v (Perturbation::coherent): a hash of the tensor's salt and v's
// bits, on [−1, 1) in steps of 2⁻⁵², so equal values draw alike.
double coherent_rho(std::uint64_t salt, double v) {
  std::uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<double>(mix64(salt ^ mix64(bits)) >> 11) * 0x1p-52 - 1.0;
}

class PerturbedRun {
  friend struct m3::ChainAccess;

 public:
  PerturbedRun(const Problem& pb, ScanMode mode, const Perturbation& pt, std::uint64_t seed,
               const Capture* teacher, const TensorSink& sink)
      : pb_(pb), p_(pb.params), cfg_(pb.cfg), mode_(mode), d_(ref::Dims::of(pb.cfg, pb.B, pb.T)),
        plan_(ChainPlan::of(pb.cfg, mode)), u_typed_(pt.u_typed), u_f32_(pt.u_f32),
        tiny_(pt.tiny), coherent_(pt.coherent), rng_(seed), teacher_(teacher),
        cap_(pb.cfg, pb.B, pb.T, sink),
        grads_(zero_params<double>(pb.cfg)) {
    acts_.resize(static_cast<size_t>(cfg_.n_layers));
    for (auto& a : acts_) a.allocate(d_, mode_);
    g_.allocate(d_, mode_);
    const size_t BTdm = static_cast<size_t>(d_.BT * d_.dm);
    h0_.assign(BTdm, 0.0);
    out_.assign(BTdm, 0.0);
    rms_.assign(static_cast<size_t>(d_.BT), 0.0);
    d_out_ = pb_.d_out;
  }

  Capture run() {
    chain_step(*this, plan_);
    capture_grads(grads_, cfg_, cap_);
    return std::move(cap_);
  }

 private:
  // ---- the executor of chain.hpp ----------------------------------------------------------
  void before(StageId, int, Dir) {}
  void pseudo(StageId, int, Dir) {}  // its tensors are perturbed and captured after their writer
  // After a layer stage: perturb what it wrote, capture it, and with a teacher restore the
  // teacher's values of what it wrote (so the next stage reads the teacher's throughout).
  void after(StageId s, int l, Dir dir) {
    if (l < 0) return;
    const Fields fields =
        dir == Dir::Forward ? ref::act_fields(acts_[static_cast<size_t>(l)]) : ref::grad_fields(g_);
    after_stage(l, s, fields);
    if (teacher_) load_fields(l, fields, s);
  }

  // input_proj (or the embedding), on the problem's (perturbed) X in both modes.
  void forward(Stage<StageId::input_proj>, int) {
    const std::int32_t* tok = pb_.token_model() ? pb_.tok.data() : nullptr;
    x_in_ = tok ? ref::one_hot<double>(tok, d_.BT, d_.in) : pb_.x;
    ref::input_proj_forward(d_.BT, d_.in, d_.dm, cfg_.input_proj_identity, tok, x_in_.data(),
                            p_.input_proj_w.data(), p_.input_proj_b.data(), h0_.data());
    if (!cfg_.input_proj_identity) perturb(h0_, "input_proj", "input_proj_outputs");
    put(-1, "input_proj", "input_proj_inputs", x_in_);
    put(-1, "input_proj", "input_proj_outputs", h0_);
  }
  // Layer l's input is H⁰ or layer l−1's output, its entering states the problem's; with a
  // teacher, every tensor of the layer the teacher's.
  void enter_layer(int l) {
    ref::LayerActs<double>& a = acts_[static_cast<size_t>(l)];
    a.residual = l == 0 ? h0_ : acts_[static_cast<size_t>(l - 1)].layer_output;
    take_states(l, a);
    if (teacher_) load_fields(l, ref::act_fields(a));
  }
  void leave_layer(int) {}
  template <StageId s>
  void forward(Stage<s>, int l) {
    const LayerParams<double>& lp = p_.layers[static_cast<size_t>(l)];
    ref::layer_forward_step(d_, mode_, s, lp, lp.in_proj_w.data(), lp.out_proj_w.data(),
                            acts_[static_cast<size_t>(l)]);
  }
  // norm_f (Out and its rms perturbed, in that order).
  void forward(Stage<StageId::norm_f>, int) {
    const Idx BT = d_.BT, dm = d_.dm;
    norm_f_input_ = acts_.back().layer_output;
    load_if_teacher("norm_f/norm_f_input", norm_f_input_, false);
    ref::rmsnorm_forward(BT, dm, norm_f_input_.data(), p_.norm_f_weight.data(), out_.data(),
                         rms_.data());
    perturb(out_, "norm_f", "Out");
    perturb(rms_, "norm_f", "norm_f_rms");
    put(-1, "norm_f", "norm_f_input", norm_f_input_);
    put(-1, "norm_f", "norm_f_rms", rms_);
    put(-1, "norm_f", "Out", out_);
  }
  // The LM ends (Backbone::forward_lm / backward_lm): logits = Out·head_w, the loss, d_logits,
  // d_Out = d_logits·head_wᵀ.
  void forward(Stage<StageId::head>, int) {
    const Idx BT = d_.BT, V = cfg_.vocab_size, dm = d_.dm;
    logits_.assign(static_cast<size_t>(BT * V), 0.0);
    load_if_teacher("norm_f/Out", out_, true);
    ref::linear_forward(BT, dm, V, out_.data(), p_.head_w.data(),
                        static_cast<const double*>(nullptr), logits_.data());
    perturb(logits_, "head", "logits");
    put(-1, "head", "logits", logits_);
  }
  void forward(Stage<StageId::loss>, int) {
    const Idx BT = d_.BT, V = cfg_.vocab_size;
    lse_.assign(static_cast<size_t>(BT), 0.0);
    load_if_teacher("head/logits", logits_, true);
    const double loss = ref::loss_forward(BT, V, logits_.data(), pb_.tgt.data(), pb_.w.data(),
                                          pb_.scored(), lse_.data());
    perturb(lse_, "loss", "lse");
    put(-1, "loss", "lse", lse_);
    cap_.put_stage(-1, "loss", "value", &loss, 1);
  }
  void backward(Stage<StageId::head>, int) {
    const Idx BT = d_.BT, V = cfg_.vocab_size, dm = d_.dm;
    Vec d_logits(logits_.size(), 0.0);
    d_out_.assign(static_cast<size_t>(BT * dm), 0.0);
    load_if_teacher("head/logits", logits_, true);
    load_if_teacher("loss/lse", lse_, false);
    ref::loss_backward(BT, V, logits_.data(), lse_.data(), pb_.tgt.data(), pb_.w.data(),
                       pb_.scored(), pb_.loss_scale(), d_logits.data());
    perturb(d_logits, "head", "d_logits");
    put(-1, "head", "d_logits", d_logits);
    load_if_teacher("head/d_logits", d_logits, true);
    load_if_teacher("norm_f/Out", out_, true);
    ref::linear_backward(BT, dm, V, out_.data(), p_.head_w.data(), d_logits.data(),
                         d_out_.data(), grads_.head_w.data(), static_cast<double*>(nullptr));
    perturb(d_out_, "head", "d_Out");
    put(-1, "head", "d_Out", d_out_);
    load_if_teacher("head/d_Out", d_out_, false);
  }
  void backward(Stage<StageId::norm_f>, int) {
    const Idx BT = d_.BT, dm = d_.dm;
    load_if_teacher("norm_f/norm_f_input", norm_f_input_, false);
    load_if_teacher("norm_f/norm_f_rms", rms_, false);
    Vec d_norm_f(static_cast<size_t>(BT * dm), 0.0);
    ref::rmsnorm_backward(BT, dm, norm_f_input_.data(), p_.norm_f_weight.data(), rms_.data(),
                          d_out_.data(), d_norm_f.data(), grads_.norm_f_weight.data());
    perturb(d_norm_f, "norm_f", "d_norm");
    put(-1, "norm_f", "d_norm", d_norm_f);
    delta_ = d_norm_f;
  }
  // δ entering the layer (the teacher's with one), its perturbed typed copy for B8's GEMMs,
  // zero gradients wrt the leaving states; with a teacher, every tensor of the layer the
  // teacher's.
  void enter_layer_backward(int l) {
    load_if_teacher(entering_gradient(l, plan_.n_layers).key(), delta_, false);
    delta_typed_ = typed_copy(delta_);  // the GEMMs' operand (B8)
    for (auto* v : {&g_.d_ssm_out, &g_.d_k_out, &g_.d_v_out, &g_.d_angle_out})
      std::fill(v->begin(), v->end(), 0.0);
    if (teacher_) {
      ref::LayerActs<double>& a = acts_[static_cast<size_t>(l)];
      take_states(l, a);
      load_fields(l, ref::act_fields(a));
      load_fields(l, ref::grad_fields(g_));
    }
  }
  template <StageId s>
  void backward(Stage<s>, int l) {
    const LayerParams<double>& lp = p_.layers[static_cast<size_t>(l)];
    ref::layer_backward_step(d_, mode_, s, lp, lp.in_proj_w.data(), lp.out_proj_w.data(),
                             acts_[static_cast<size_t>(l)], delta_, delta_typed_.data(), g_,
                             grads_.layers[static_cast<size_t>(l)]);
  }
  void leave_layer_backward(int) { delta_ = g_.d_temporal; }
  // input_proj's backward (ref::input_proj_backward, as the backbone; the typed copy of δ⁰
  // perturbed where the backbone rounds it).
  void backward(Stage<StageId::input_proj>, int) {
    load_if_teacher(entering_gradient(-1, plan_.n_layers).key(), delta_, false);
    const std::int32_t* tok = pb_.token_model() ? pb_.tok.data() : nullptr;
    const Vec dt = tok || !cfg_.input_proj_identity ? typed_copy(delta_) : Vec();
    Vec d_x(static_cast<size_t>(d_.BT * d_.in), 0.0);
    ref::input_proj_backward(d_.BT, d_.in, d_.dm, cfg_.input_proj_identity, tok, x_in_.data(),
                             p_.input_proj_w.data(), delta_.data(), dt.data(),
                             grads_.input_proj_w.data(), grads_.input_proj_b.data(), d_x.data());
    if (!cfg_.input_proj_identity) perturb(d_x, "input_proj", "d_input_proj_dx");
    put(-1, "input_proj", "d_input_proj_dx", d_x);
  }

  // ---- perturbing ---------------------------------------------------------------------------
  // v + r·max(u·|v|, tiny): a rounding's error bound, relative, or absolute below the smallest
  // normal of the format (tiny = half its smallest subnormal; 0 where that does not matter).
  // Coherent: r is a hash of a salt drawn for this tensor and the value's bits, so equal nonzero
  // values of the tensor move alike (zeros take the stream's r).
  void perturb(Vec& v, double u, double tiny = 0) {
    if (u == 0) return;
    if (!coherent_) {
      for (double& e : v) e += rng_.uniform(-1.0, 1.0) * std::max(u * std::abs(e), tiny);
      return;
    }
    const std::uint64_t salt = rng_.next();
    for (double& e : v) {
      double r;
      if (e != 0.0) {
        r = coherent_rho(salt, e);
      } else {
        r = rng_.uniform(-1.0, 1.0);
      }
      e += r * std::max(u * std::abs(e), tiny);
    }
  }
  // out = x·w ([rows, n]·[n, cols]) gets a float GEMM's accumulation error at a random walk's
  // size, u_f32·√(n/2)·‖x_rk·w_kj‖₂ over k, with r keyed by the output's value (coherent).
  void accumulation(const Vec& x, const Vec& w, Vec& out) {
    const Idx rows = d_.BT;
    const Idx n = static_cast<Idx>(x.size()) / rows;
    const Idx m = static_cast<Idx>(out.size()) / rows;
    const double scale = u_f32_ * std::sqrt(0.5 * static_cast<double>(n));
    const std::uint64_t salt = rng_.next();
    std::vector<double> ss(static_cast<size_t>(m));
    for (Idx r = 0; r < rows; ++r) {
      std::fill(ss.begin(), ss.end(), 0.0);
      for (Idx k = 0; k < n; ++k) {
        const double xk = x[static_cast<size_t>(r * n + k)];
        const double* wk = w.data() + k * m;
        for (Idx j = 0; j < m; ++j) ss[static_cast<size_t>(j)] += xk * xk * wk[j] * wk[j];
      }
      for (Idx j = 0; j < m; ++j) {
        double& e = out[static_cast<size_t>(r * m + j)];
        e += coherent_rho(salt, e) * scale * std::sqrt(ss[static_cast<size_t>(j)]);
      }
    }
  }
  void perturb(Vec& v, bool typed) { perturb(v, typed ? u_typed_ : u_f32_, tiny_); }
  // A registry tensor: at the typed unit roundoff where MODEL.md §8 stores it typed.
  void perturb(Vec& v, const char* stage, const char* tensor) {
    perturb(v, find_spec(stage, tensor).typed);
  }
  // The staged typed copy of a residual-stream gradient that feeds a GEMM.
  Vec typed_copy(const Vec& v) {
    Vec c = v;
    perturb(c, true);
    return c;
  }
  // Whether stage s wrote field f (its own tensors and its pseudo-stages').
  bool wrote(StageId s, const ref::TensorField<double>& f) const {
    for (const TensorSpec* spec : plan_.written_by(s))
      if (f.is(*spec)) return true;
    return false;
  }
  // After a stage: perturb what it wrote (F1's residual is the layer input, written upstream),
  // then capture it. BCNorm (F4) stores b_normed typed and reads it back for the bias add, so
  // b_biased = b_normed + bias carries b_normed's rounding as well as its own (c alike): with
  // d_state 1, b_normed is ±w and the bias add a cancellation whose error is b_normed's.
  void after_stage(int l, StageId s, const Fields& fields) {
    std::vector<double> bn, cn;  // b_normed, c_normed before their perturbation
    if (s == StageId::F4 && l >= 0) {
      bn = acts_[static_cast<size_t>(l)].b_normed;
      cn = acts_[static_cast<size_t>(l)].c_normed;
    }
    if (coherent_ && l >= 0 && (s == StageId::F2 || s == StageId::F8)) {
      ref::LayerActs<double>& a = acts_[static_cast<size_t>(l)];
      const LayerParams<double>& lp = p_.layers[static_cast<size_t>(l)];
      if (s == StageId::F2) accumulation(a.post_norm, lp.in_proj_w, a.proj);
      else accumulation(a.gated, lp.out_proj_w, a.out_flat);
    }
    for (const auto& f : fields)
      if (wrote(s, f) && std::strcmp(f.tensor, "residual") != 0)
        perturb(*f.v, stage_name(f.stage), f.tensor);
    if (!bn.empty()) {
      ref::LayerActs<double>& a = acts_[static_cast<size_t>(l)];
      carry_into_bias_add(bn, a.b_normed, a.b_biased);
      carry_into_bias_add(cn, a.c_normed, a.c_biased);
    }
    ref::for_each_buffer(plan_.written_by(s), fields, [&](const TensorSpec& spec, const Vec& v) {
      put(l, spec.stage, spec.tensor, v);
    });
  }

  // biased[r, h, n] += normed[r, g(h), n] − before[r, g(h), n] where the bias add cancels,
  // |normed| ≥ kCancelledBiasAdd · |biased|: there the read of the stored normed tensor
  // (ref::bcnorm_forward's broadcast of groups to heads) sets biased's error, many times its
  // own rounding. Elsewhere biased's own rounding, already drawn, is of the same size.
  void carry_into_bias_add(const Vec& before, const Vec& normed, Vec& biased) const {
    const Idx nh = d_.nh, ng = d_.ng, ds = d_.ds, hpg = d_.hpg;
    for (Idx r = 0; r < d_.BT; ++r)
      for (Idx h = 0; h < nh; ++h)
        for (Idx n = 0; n < ds; ++n) {
          const size_t src = static_cast<size_t>((r * ng + h / hpg) * ds + n);
          double& b = biased[static_cast<size_t>((r * nh + h) * ds + n)];
          if (std::abs(before[src]) >= kCancelledBiasAdd * std::abs(b)) b += normed[src] - before[src];
        }
  }

  // ---- the teacher's values (the isolated mode) -------------------------------------------
  // The teacher's `key`, perturbed once per run (a rounded value is the same at every load).
  void load(const std::string& key, Vec& v, bool typed) {
    auto it = loaded_.find(key);
    if (it == loaded_.end()) {
      const Tensor* t = teacher_->find(key);
      M3_REQUIRE(t != nullptr && static_cast<size_t>(t->numel()) == v.size(), "perturbed oracle",
                 "the teacher lacks '" + key + "' or its size differs",
                 "an isolated run needs every registry tensor of the oracle");
      Vec c(t->data.begin(), t->data.end());
      perturb(c, typed);
      it = loaded_.emplace(key, std::move(c)).first;
    }
    v = it->second;
  }
  void load_if_teacher(const std::string& key, Vec& v, bool typed) {
    if (teacher_) load(key, v, typed);
  }
  // Every registry field of layer l of the run (or, with `written_by`, those that stage
  // writes) set to the teacher's value.
  void load_fields(int l, const Fields& fields) {
    for (const auto& f : fields) load_field(l, f);
  }
  void load_fields(int l, const Fields& fields, StageId written_by) {
    for (const auto& f : fields)
      if (wrote(written_by, f)) load_field(l, f);
  }
  void load_field(int l, const ref::TensorField<double>& f) {
    const TensorSpec& spec = find_spec(stage_name(f.stage), f.tensor);
    if (!exists_in(spec, cfg_, mode_)) return;
    load(stage_key(l, spec.stage, f.tensor), *f.v, spec.typed);
  }
  void take_states(int l, ref::LayerActs<double>& a) const {
    take(pb_.states.ssm, l, a.ssm_in);
    take(pb_.states.k, l, a.k_in);
    take(pb_.states.v, l, a.v_in);
    take(pb_.states.angle, l, a.angle_in);
  }
  static void take(const Vec& all, int l, Vec& slice) {
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(l) * slice.size()),
                slice.size(), slice.begin());
  }

  void put(int layer, const char* stage, const char* tensor, const Vec& v) {
    if (!exists_in(find_spec(stage, tensor), cfg_, mode_)) return;
    cap_.put_stage(layer, stage, tensor, v.data(), static_cast<Idx>(v.size()));
  }

  const Problem& pb_;
  const Params<double>& p_;
  const Config& cfg_;
  ScanMode mode_;
  ref::Dims d_;
  ChainPlan plan_;
  double u_typed_, u_f32_;
  double tiny_;  // the absolute floor of every value's error (an f16 cell: 2^-25)
  bool coherent_;
  Rng rng_;
  const Capture* teacher_;
  std::map<std::string, Vec> loaded_;
  Capture cap_;
  Params<double> grads_;
  std::vector<ref::LayerActs<double>> acts_;
  ref::LayerGrads<double> g_;
  Vec x_in_, h0_, norm_f_input_, out_, rms_, logits_, lse_, d_out_, delta_, delta_typed_;
};

}  // namespace

std::uint64_t perturbation_seed(std::uint64_t problem_seed, double u, int draw, int role) {
  // u's binary exponent, negated (u = 2^-8 → 8); 0 for u = 0, where ilogb returns FP_ILOGB0
  // (INT_MIN with glibc), whose negation overflows int.
  const std::int64_t e = u == 0 ? 0 : -static_cast<std::int64_t>(std::ilogb(u));
  std::uint64_t z = problem_seed ^ 0x9e3779b97f4a7c15ULL;
  z = mix64(z + static_cast<std::uint64_t>(e) * 0xbf58476d1ce4e5b9ULL);
  z = mix64(z + static_cast<std::uint64_t>(draw + 1) * 0x94d049bb133111ebULL);
  return mix64(z + static_cast<std::uint64_t>(role + 1));
}

Perturbation perturbation_of(Precision p) {
  Perturbation pt;
  pt.u_typed = unit_roundoff(p);
  pt.u_f32 = unit_roundoff(Precision::F32);
  pt.tiny = p == Precision::F16 ? 0x1p-25 : 0.0;
  return pt;
}

namespace {

// The arrays a draw's problem changes, paired (q's, pb's), in perturbed_problem's stream order,
// each with whether the production path stores it typed (the GEMM weights, and X where
// input_proj's inputs are typed) or in f32.
struct DrawArray {
  std::vector<double>* dst;
  const std::vector<double>* src;
  bool typed;
};

std::vector<DrawArray> draw_arrays(Problem& q, const Problem& pb) {
  std::vector<DrawArray> out;
  for_each_param(q.params, [&](int, const char* name, std::vector<double>& v) {
    out.push_back({&v, nullptr, is_gemm_weight(name)});
  });
  std::size_t k = 0;
  for_each_param(pb.params, [&](int, const char*, const std::vector<double>& v) {
    out[k++].src = &v;
  });
  out.push_back({&q.x, &pb.x, find_spec("input_proj", "input_proj_inputs").typed});
  out.push_back({&q.d_out, &pb.d_out, false});
  out.push_back({&q.states.ssm, &pb.states.ssm, false});
  out.push_back({&q.states.k, &pb.states.k, false});
  out.push_back({&q.states.v, &pb.states.v, false});
  out.push_back({&q.states.angle, &pb.states.angle, false});
  for (const DrawArray& a : out)
    M3_REQUIRE(a.dst->size() == a.src->size(), "perturbed problem",
               "the target problem's arrays differ in size from the problem's", "");
  return out;
}

// f(begin, end) over [0, n) in contiguous pieces on up to `threads` threads (0: the machine's),
// pieces of at least kMinPiece values; what a thread that cannot start would do runs here.
constexpr std::size_t kMinPiece = std::size_t(1) << 14;

void in_pieces(std::size_t n, int threads, const std::function<void(std::size_t, std::size_t)>& f) {
  std::size_t t = threads > 0 ? static_cast<std::size_t>(threads)
                              : std::max(1u, std::thread::hardware_concurrency());
  t = std::max<std::size_t>(1, std::min(t, n / kMinPiece));
  const std::size_t piece = (n + t - 1) / t;
  std::vector<std::thread> pool;
  std::size_t inline_from = n;
  for (std::size_t b = piece; b < n; b += piece) {
    try {
      pool.emplace_back(f, b, std::min(n, b + piece));
    } catch (const std::system_error&) {
      inline_from = b;
      break;
    }
  }
  f(0, std::min(n, piece));
  for (std::size_t b = inline_from; b < n; b += piece) f(b, std::min(n, b + piece));
  for (std::thread& th : pool) th.join();
}

}  // namespace

void perturbed_problem_into(Problem& q, const Problem& pb, const Perturbation& pt, int draw,
                            int threads) {
  const std::uint64_t seed = perturbation_seed(pb.seed, pt.u_typed, draw, 0);
  std::uint64_t taken = 0;  // draws of the stream before the array
  for (const DrawArray& a : draw_arrays(q, pb)) {
    const double u = a.typed ? pt.u_typed : pt.u_f32;
    const double* src = a.src->data();
    double* dst = a.dst->data();
    const std::uint64_t first = taken;
    in_pieces(a.src->size(), threads, [=](std::size_t b, std::size_t e) {
      if (u == 0) {
        std::copy(src + b, src + e, dst + b);
        return;
      }
      Rng rng(seed);
      rng.discard(first + b);
      for (std::size_t i = b; i < e; ++i) dst[i] = src[i] * (1.0 + u * rng.uniform(-1.0, 1.0));
    });
    if (u != 0) taken += a.src->size();
  }
}

Problem perturbed_problem(const Problem& pb, const Perturbation& pt, int draw) {
  Problem q = pb;
  perturbed_problem_into(q, pb, pt, draw);
  return q;
}

void rounded_problem_into(Problem& q, const Problem& pb, Precision p, int threads) {
  for (const DrawArray& a : draw_arrays(q, pb)) {
    const double* src = a.src->data();
    double* dst = a.dst->data();
    const bool typed = a.typed;
    in_pieces(a.src->size(), threads, [=](std::size_t b, std::size_t e) {
      for (std::size_t i = b; i < e; ++i) {
        const float f = static_cast<float>(src[i]);
        dst[i] = static_cast<double>(typed && p == Precision::BF16 ? round_bf16(f)
                                     : typed && p == Precision::F16 ? round_f16(f)
                                                                    : f);
      }
    });
  }
}

Problem rounded_problem(const Problem& pb, Precision p) {
  Problem q = pb;
  rounded_problem_into(q, pb, p);
  return q;
}

Capture run_perturbed_reference(const Problem& pb, ScanMode mode, const Perturbation& pt,
                                int draw, const TensorSink& sink) {
  validate_run(pb.cfg, pb.B, pb.T);
  const Problem q = perturbed_problem(pb, pt, draw);
  return PerturbedRun(q, mode, pt, perturbation_seed(pb.seed, pt.u_typed, draw, 1), nullptr,
                      sink)
      .run();
}

Capture run_perturbed_isolated(const Problem& pb, ScanMode mode, const Capture& oracle,
                               const Perturbation& pt, int draw, const TensorSink& sink) {
  validate_run(pb.cfg, pb.B, pb.T);
  const Problem q = perturbed_problem(pb, pt, draw);
  return PerturbedRun(q, mode, pt, perturbation_seed(pb.seed, pt.u_typed, draw, 2), &oracle,
                      sink)
      .run();
}

Implementation perturbed_oracle(Precision p, int draw, bool coherent) {
  Perturbation pt = perturbation_of(p);
  pt.coherent = coherent;
  std::string name = "reference<double>~u(" + std::string(precision_name(p)) + ")";
  if (draw > 0) name += "#" + std::to_string(draw);
  if (coherent) name += " (coherent)";
  return {name,
          [pt, draw](const Problem& pb, ScanMode mode, const TensorSink& sink) {
            return run_perturbed_reference(pb, mode, pt, draw, sink);
          },
          [pt, draw](const Problem& pb, ScanMode mode, const Capture& oracle,
                     const TensorSink& sink) {
            return run_perturbed_isolated(pb, mode, oracle, pt, draw, sink);
          }};
}

namespace {

// The unperturbed runs the perturbed draws deviate from (Lineup::baseline_reference), computed
// once per problem and scan mode and shared by every precision's lineup of one
// cpu_lineups_perturbed / add_perturbed_baselines call. A run is reused only for the same
// problem and (isolated) the same oracle: same objects, same seed, shape and content marks.
class ReferenceRuns {
 public:
  Capture e2e(const Problem& pb, ScanMode mode) {
    return get(pb, mode, nullptr, [&] { return run_reference<double>(pb, mode); });
  }
  Capture isolated(const Problem& pb, ScanMode mode, const Capture& oracle) {
    return get(pb, mode, &oracle,
               [&] { return run_perturbed_isolated(pb, mode, oracle, Perturbation{}, 0); });
  }

 private:
  struct Entry {
    std::string mark;
    Capture run;
  };
  static std::string mark_of(const Problem& pb, ScanMode mode, const Capture* oracle) {
    std::ostringstream m;
    m.precision(17);
    m << &pb << ' ' << pb.seed << ' ' << pb.cfg.describe() << ' ' << pb.B << ' ' << pb.T << ' '
      << scan_mode_name(mode);
    if (!pb.x.empty()) m << ' ' << pb.x.front() << ' ' << pb.x.back();
    if (oracle) {
      m << ' ' << oracle << ' ' << oracle->keys().size();
      for (const std::string& k : oracle->keys()) {
        const Tensor& t = oracle->at(k);
        double sum = 0;
        for (double v : t.data) sum += v;
        m << ' ' << sum;
      }
    }
    return m.str();
  }
  template <class F>
  Capture get(const Problem& pb, ScanMode mode, const Capture* oracle, F&& compute) {
    const std::string mark = mark_of(pb, mode, oracle);
    const int slot = (oracle ? 2 : 0) + (mode == ScanMode::Chunked ? 1 : 0);
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = entries_[slot];
    if (e.mark != mark) {
      e.run = compute();
      e.mark = mark;
    }
    return e.run;
  }
  std::mutex mu_;
  Entry entries_[4];
};

}  // namespace

void add_perturbed_baselines(std::vector<Lineup>& lineups, int draws) {
  M3_REQUIRE(draws >= 1, "add_perturbed_baselines", "at least one draw of the perturbed oracle",
             "draws=" + std::to_string(draws));
  auto refs = std::make_shared<ReferenceRuns>();
  for (Lineup& l : lineups) {
    l.isolated_baselines.clear();
    for (int d = 0; d < draws; ++d)
      l.isolated_baselines.push_back(perturbed_oracle(l.precision, d));
    l.coherent_isolated_baselines.clear();
    for (int d = 0; d < kCoherentDraws; ++d)
      l.coherent_isolated_baselines.push_back(perturbed_oracle(l.precision, draws + d, true));
    l.isolated_baseline_reference = [refs](const Problem& pb, ScanMode mode, const Capture& o,
                                           const TensorSink&) { return refs->isolated(pb, mode, o); };
    l.conditioning.clear();
    l.conditioning_reference = nullptr;
    if (!l.baseline || l.baseline_kind != BaselineKind::SamePrecision) continue;
    for (int d = 0; d < draws; ++d) l.conditioning.push_back(perturbed_oracle(l.precision, d));
    l.conditioning_reference = [refs](const Problem& pb, ScanMode mode) {
      return refs->e2e(pb, mode);
    };
  }
}

std::vector<Lineup> cpu_lineups_perturbed(const std::vector<Precision>& precisions, int draws) {
  M3_REQUIRE(draws >= 1, "cpu_lineups_perturbed", "at least one draw of the perturbed oracle",
             "draws=" + std::to_string(draws));
  std::vector<Lineup> out;
  auto refs = std::make_shared<ReferenceRuns>();
  for (Precision p : precisions) {
    Lineup l{p, reference_emulation(p), perturbed_oracle(p, 0)};
    l.baseline_kind = BaselineKind::Perturbed;
    l.baseline_reference = [refs](const Problem& pb, ScanMode mode) { return refs->e2e(pb, mode); };
    for (int d = 1; d < draws; ++d) l.more_baselines.push_back(perturbed_oracle(p, d));
    for (int d = 0; d < kCoherentDraws; ++d)
      l.coherent_baselines.push_back(perturbed_oracle(p, draws + d, true));
    if (draws > 1) l.baseline->name += " (max of " + std::to_string(draws) + " draws)";
    out.push_back(std::move(l));
  }
  add_perturbed_baselines(out, draws);
  return out;
}

}  // namespace m3::harness
