// The random sweep over the config space (see sweep.hpp).
#include "sweep.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <set>
#include <sstream>
#include <thread>

#include "backbone.hpp"  // capture_grads
#include "error.hpp"
#include "lm.hpp"  // ref::embed_*, loss_*
#include "params.hpp"  // Rng
#include "registry.hpp"
#include "stages.hpp"

namespace m3::harness {

namespace {

std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform integer in [lo, hi].
Idx uniform_int(Rng& rng, Idx lo, Idx hi) {
  if (hi <= lo) return lo;
  const auto span = static_cast<std::uint64_t>(hi - lo + 1);
  return lo + static_cast<Idx>(rng.next() % span);
}

// Uniform over the entries of `values` that are ≤ limit (values ascending; the first if none).
Idx pick(Rng& rng, const std::vector<Idx>& values, Idx limit) {
  std::vector<Idx> ok;
  for (Idx v : values)
    if (v <= limit) ok.push_back(v);
  if (ok.empty()) return values.front();
  return ok[static_cast<size_t>(rng.next() % ok.size())];
}

bool coin(Rng& rng, double p) { return rng.uniform() < p; }

bool within(const Config& c, Idx B, Idx T, bool random_states, const SweepLimits& lim) {
  if (B > lim.max_B || T > lim.max_T || c.n_layers > lim.max_layers) return false;
  if (c.d_model > lim.max_d_model || c.headdim > lim.max_headdim || c.nheads() > lim.max_heads)
    return false;
  if (c.d_state > lim.max_d_state) return false;
  if (c.d_model < lim.min_d_model || c.d_state < lim.min_d_state ||
      (c.is_outproj_norm && c.headdim < lim.min_gated_headdim))
    return false;
  if (!lim.scale_invariant_heads && c.is_outproj_norm && T == 1 && !random_states) return false;
  if (c.vocab_size > 0 ? c.vocab_size > lim.max_vocab
                       : (c.input_dim > std::max(lim.max_input_dim, c.d_model)))
    return false;
  try {
    validate_run(c, B, T);
  } catch (const Error&) {
    return false;
  }
  return true;
}

bool try_draw(Rng& rng, const SweepLimits& lim, RunSpec& s) {
  static const std::vector<Idx> kHeaddims = {1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64};
  static const std::vector<Idx> kStates = {1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64};
  static const std::vector<Idx> kChunks = {1, 2, 3, 4, 5, 7, 8, 12, 16, 32, 64};
  Config c;
  c.headdim = pick(rng, kHeaddims, lim.max_headdim);
  const double g = rng.uniform();
  c.ngroups = g < 0.5 ? 1 : g < 0.75 ? 2 : 4;
  const Idx hpg = uniform_int(rng, 1, 4);
  const Idx nheads = c.ngroups * hpg;
  const Idx d_inner = nheads * c.headdim;
  std::vector<Idx> expands;
  for (Idx e : {1, 2, 3})
    if (d_inner % e == 0 && d_inner / e >= 1 && d_inner / e <= lim.max_d_model) expands.push_back(e);
  if (expands.empty()) return false;
  c.expand = expands[static_cast<size_t>(rng.next() % expands.size())];
  c.d_model = d_inner / c.expand;
  c.d_state = pick(rng, kStates, lim.max_d_state);
  c.rope_fraction = coin(rng, 0.5) ? 0.5 : 1.0;
  c.is_outproj_norm = coin(rng, 0.5);
  c.n_layers = uniform_int(rng, 1, lim.max_layers);
  const Idx B = uniform_int(rng, 1, lim.max_B);
  c.chunk_size = pick(rng, kChunks, lim.max_T);
  const Idx cs = c.chunk_size;
  Idx T = 0;
  for (int tries = 0; tries < 8 && T == 0; ++tries) {
    const Idx cls = uniform_int(rng, 0, 2);
    if (cls == 0) {  // shorter than one chunk
      T = cs == 1 ? 1 : uniform_int(rng, 1, cs - 1);
    } else if (cls == 1) {  // whole chunks
      const Idx m_max = lim.max_T / cs;
      if (m_max >= 1) T = cs * uniform_int(rng, 1, m_max);
    } else {  // a ragged last chunk
      if (cs == 1) continue;
      const Idx m_max = (lim.max_T - 1) / cs;
      if (m_max < 1) continue;
      const Idx m = uniform_int(rng, 1, m_max);
      const Idx r_max = std::min(cs - 1, lim.max_T - cs * m);
      if (r_max >= 1) T = cs * m + uniform_int(rng, 1, r_max);
    }
  }
  if (T == 0) return false;
  if (coin(rng, lim.p_token)) {
    c.vocab_size = uniform_int(rng, 2, std::max<Idx>(2, lim.max_vocab));
    c.input_dim = c.vocab_size;
  } else {
    const double in = rng.uniform();
    if (in < 0.25) {
      c.input_proj_identity = true;
      c.input_dim = c.d_model;
    } else if (in < 0.625) {
      c.input_dim = c.d_model;
    } else {
      c.input_dim = uniform_int(rng, 1, lim.max_input_dim);
    }
  }
  const bool random_states = coin(rng, 0.5);
  const std::uint64_t seed = rng.next() & 0xffffffffULL;
  if (!within(c, B, T, random_states, lim)) return false;
  s = RunSpec{};
  s.preset = "default";
  s.cfg = c;
  s.B = B;
  s.T = T;
  s.seed = seed;
  s.random_states = random_states;
  return true;
}

std::string join(const std::vector<std::string>& items, const char* sep) {
  std::string s;
  for (const auto& i : items) s += (s.empty() ? "" : sep) + i;
  return s;
}

std::string precision_list(const std::vector<Precision>& ps) {
  std::vector<std::string> v;
  for (Precision p : ps) v.emplace_back(precision_name(p));
  return join(v, ",");
}
std::string mode_list(const std::vector<ScanMode>& ms) {
  std::vector<std::string> v;
  for (ScanMode m : ms) v.emplace_back(scan_mode_name(m));
  return join(v, ",");
}
std::string compare_mode_list(const std::vector<CompareMode>& cms) {
  if (cms.size() == 2) return "both";
  return cms.empty() ? "e2e" : compare_mode_name(cms.front());
}

template <class T>
void add_unique(std::vector<T>& v, T x) {
  if (std::find(v.begin(), v.end(), x) == v.end()) v.push_back(x);
}

// Keeps the order of `order` for the members of `v`.
template <class T>
std::vector<T> ordered(const std::vector<T>& v, const std::vector<T>& order) {
  std::vector<T> out;
  for (const T& x : order)
    if (std::find(v.begin(), v.end(), x) != v.end()) out.push_back(x);
  return out;
}

// ---- the perturbed oracle --------------------------------------------------------------------

// The GEMM weights: the GEMMs read their typed compute copies (MODEL.md §8).
bool is_gemm_weight(const std::string& name) {
  return name == "in_proj_w" || name == "out_proj_w" || name == "input_proj_w" || name == "head_w";
}

// The reference in double, chained stage by stage as Backbone<double> / LmModel<double> chain
// them (reference/backbone.cpp, lm.cpp: the registry's stage table, ref::layer_forward_step /
// layer_backward_step, the same captures), with every tensor a stage writes perturbed right
// after the stage. With a teacher (the oracle's Capture) every stage is instead fed the
// teacher's values, perturbed as a load (the isolated runner's rounding of the oracle's
// inputs, isolated.hpp), and captures only its own outputs. With a zero Perturbation and no
// teacher it is run_reference<double> bit for bit (a test holds it so).
class PerturbedRun {
 public:
  PerturbedRun(const Problem& pb, ScanMode mode, const Perturbation& pt, std::uint64_t seed,
               const Capture* teacher)
      : pb_(pb), cfg_(pb.cfg), mode_(mode), d_(ref::Dims::of(pb.cfg, pb.B, pb.T)),
        u_typed_(pt.u_typed), u_f32_(pt.u_f32), tiny_(pt.tiny), rng_(seed),
        teacher_(teacher), cap_(pb.cfg, pb.B, pb.T) {
    for (const StageEntry& e : stage_table(cfg_, mode_))
      if (e.scope == Scope::Layer) (e.dir == Dir::Forward ? fwd_ : bwd_).push_back(e.stage);
    acts_.resize(static_cast<size_t>(cfg_.n_layers));
    for (auto& a : acts_) a.allocate(d_, mode_);
    g_.allocate(d_, mode_);
  }

  Capture run() {
    const Params<double>& p = pb_.params;
    const Idx BT = d_.BT, dm = d_.dm, in = d_.in;
    // input_proj (or the embedding), on the problem's (perturbed) X in both modes
    std::vector<double> x_in, h0(static_cast<size_t>(BT * dm), 0.0);
    if (pb_.token_model()) {
      ref::embed_forward(BT, in, dm, pb_.tok.data(), p.input_proj_w.data(), p.input_proj_b.data(),
                         h0.data());
      x_in.assign(static_cast<size_t>(BT * in), 0.0);
      for (Idx r = 0; r < BT; ++r) x_in[static_cast<size_t>(r * in + pb_.tok[r])] = 1.0;
    } else {
      x_in = pb_.x;
      if (cfg_.input_proj_identity) {
        h0 = x_in;
      } else {
        ref::linear_forward(BT, in, dm, x_in.data(), p.input_proj_w.data(),
                            p.input_proj_b.data(), h0.data());
      }
    }
    if (!cfg_.input_proj_identity) perturb(h0, "input_proj", "input_proj_outputs");
    put(-1, "input_proj", "input_proj_inputs", x_in);
    put(-1, "input_proj", "input_proj_outputs", h0);
    // the layers
    const std::vector<double>* h = &h0;
    for (int l = 0; l < static_cast<int>(cfg_.n_layers); ++l) {
      ref::LayerActs<double>& a = acts_[static_cast<size_t>(l)];
      const LayerParams<double>& lp = p.layers[static_cast<size_t>(l)];
      const auto fields = ref::act_fields(a);
      a.residual = *h;
      take_states(l, a);
      if (teacher_) load_fields(l, fields);
      for (const std::string& st : fwd_) {
        if (teacher_ && is_pseudo(st)) continue;  // captured with the stage that writes it
        ref::layer_forward_step(d_, mode_, st, lp, lp.in_proj_w.data(), lp.out_proj_w.data(), a);
        after_stage(l, st, fields);
        if (teacher_) load_fields(l, fields, st);  // what the stage wrote: the teacher's again
      }
      h = &a.layer_output;
    }
    // norm_f (and the head and loss of a token model)
    std::vector<double> norm_f_input = *h;
    load_if_teacher("norm_f/norm_f_input", norm_f_input, false);
    std::vector<double> out(static_cast<size_t>(BT * dm), 0.0), rms(static_cast<size_t>(BT), 0.0);
    ref::rmsnorm_forward(BT, dm, norm_f_input.data(), p.norm_f_weight.data(), out.data(),
                         rms.data());
    perturb(out, "norm_f", "Out");
    perturb(rms, "norm_f", "norm_f_rms");
    put(-1, "norm_f", "norm_f_input", norm_f_input);
    put(-1, "norm_f", "norm_f_rms", rms);
    put(-1, "norm_f", "Out", out);
    Params<double> grads = zero_params<double>(cfg_);
    std::vector<double> d_out = pb_.d_out;
    if (pb_.token_model()) d_out = head_and_loss(p, out, grads);
    // backward
    load_if_teacher("norm_f/norm_f_input", norm_f_input, false);
    load_if_teacher("norm_f/norm_f_rms", rms, false);
    std::vector<double> d_norm_f(static_cast<size_t>(BT * dm), 0.0);
    ref::rmsnorm_backward(BT, dm, norm_f_input.data(), p.norm_f_weight.data(), rms.data(),
                          d_out.data(), d_norm_f.data(), grads.norm_f_weight.data());
    perturb(d_norm_f, "norm_f", "d_norm");
    put(-1, "norm_f", "d_norm", d_norm_f);
    std::vector<double> delta = d_norm_f;
    const auto gfields = ref::grad_fields(g_);
    for (int l = static_cast<int>(cfg_.n_layers) - 1; l >= 0; --l) {
      ref::LayerActs<double>& a = acts_[static_cast<size_t>(l)];
      const LayerParams<double>& lp = p.layers[static_cast<size_t>(l)];
      const auto fields = ref::act_fields(a);
      load_if_teacher(l + 1 == static_cast<int>(cfg_.n_layers)
                          ? std::string("norm_f/d_norm")
                          : stage_key(l + 1, "B1", "d_temporal"),
                      delta, false);
      const std::vector<double> delta_typed = typed_copy(delta);  // the GEMMs' operand (B8)
      for (auto* v : {&g_.d_ssm_out, &g_.d_k_out, &g_.d_v_out, &g_.d_angle_out})
        std::fill(v->begin(), v->end(), 0.0);
      if (teacher_) {
        take_states(l, a);
        load_fields(l, fields);
        load_fields(l, gfields);
      }
      for (const std::string& st : bwd_) {
        if (teacher_ && is_pseudo(st)) continue;
        ref::layer_backward_step(d_, mode_, st, lp, lp.in_proj_w.data(), lp.out_proj_w.data(), a,
                                 delta, delta_typed.data(), g_,
                                 grads.layers[static_cast<size_t>(l)]);
        after_stage(l, st, gfields);
        if (teacher_) load_fields(l, gfields, st);
      }
      delta = g_.d_temporal;
    }
    // input_proj backward (the bias gradient sums δ⁰ in row order, as the backbone does)
    load_if_teacher(stage_key(0, "B1", "d_temporal"), delta, false);
    std::vector<double> d_x(static_cast<size_t>(BT * in), 0.0);
    if (pb_.token_model()) {
      const std::vector<double> dt = typed_copy(delta);
      ref::embed_backward(BT, in, dm, pb_.tok.data(), dt.data(), grads.input_proj_w.data(),
                          static_cast<double*>(nullptr));
      add_bias_grad(delta, grads.input_proj_b);
      std::vector<double> unused(static_cast<size_t>(in * dm), 0.0);
      ref::linear_backward(BT, in, dm, x_in.data(), p.input_proj_w.data(), dt.data(),
                           d_x.data(), unused.data(), static_cast<double*>(nullptr));
    } else if (cfg_.input_proj_identity) {
      d_x = delta;
    } else {
      const std::vector<double> dt = typed_copy(delta);
      ref::linear_backward(BT, in, dm, x_in.data(), p.input_proj_w.data(), dt.data(),
                           d_x.data(), grads.input_proj_w.data(), static_cast<double*>(nullptr));
      add_bias_grad(delta, grads.input_proj_b);
    }
    if (!cfg_.input_proj_identity) perturb(d_x, "input_proj", "d_input_proj_dx");
    put(-1, "input_proj", "d_input_proj_dx", d_x);
    capture_grads(grads, cfg_, cap_);
    return std::move(cap_);
  }

 private:
  // LmModel's ends: logits = Out·head_w, the loss, d_logits, d_Out = d_logits·head_wᵀ.
  std::vector<double> head_and_loss(const Params<double>& p, std::vector<double>& out,
                                    Params<double>& grads) {
    const Idx BT = d_.BT, V = cfg_.vocab_size, dm = d_.dm;
    std::vector<double> logits(static_cast<size_t>(BT * V), 0.0), lse(static_cast<size_t>(BT));
    load_if_teacher("norm_f/Out", out, true);
    ref::linear_forward(BT, dm, V, out.data(), p.head_w.data(), static_cast<const double*>(nullptr),
                        logits.data());
    perturb(logits, "head", "logits");
    put(-1, "head", "logits", logits);
    load_if_teacher("head/logits", logits, true);
    const double loss = ref::loss_forward(BT, V, logits.data(), pb_.tgt.data(), pb_.w.data(),
                                          pb_.scored(), lse.data());
    perturb(lse, "loss", "lse");
    put(-1, "loss", "lse", lse);
    cap_.put_stage(-1, "loss", "value", &loss, 1);
    std::vector<double> d_logits(logits.size(), 0.0), d_out(static_cast<size_t>(BT * dm), 0.0);
    load_if_teacher("head/logits", logits, true);
    load_if_teacher("loss/lse", lse, false);
    ref::loss_backward(BT, V, logits.data(), lse.data(), pb_.tgt.data(), pb_.w.data(),
                       pb_.scored(), pb_.loss_scale(), d_logits.data());
    perturb(d_logits, "head", "d_logits");
    put(-1, "head", "d_logits", d_logits);
    load_if_teacher("head/d_logits", d_logits, true);
    load_if_teacher("norm_f/Out", out, true);
    ref::linear_backward(BT, dm, V, out.data(), p.head_w.data(), d_logits.data(), d_out.data(),
                         grads.head_w.data(), static_cast<double*>(nullptr));
    perturb(d_out, "head", "d_Out");
    put(-1, "head", "d_Out", d_out);
    load_if_teacher("head/d_Out", d_out, false);
    return d_out;
  }

  void add_bias_grad(const std::vector<double>& delta, std::vector<double>& db_acc) const {
    std::vector<double> db(static_cast<size_t>(d_.dm), 0.0);
    for (Idx r = 0; r < d_.BT; ++r)
      for (Idx j = 0; j < d_.dm; ++j)
        db[static_cast<size_t>(j)] += delta[static_cast<size_t>(r * d_.dm + j)];
    for (Idx j = 0; j < d_.dm; ++j) db_acc[static_cast<size_t>(j)] += db[static_cast<size_t>(j)];
  }

  // v + r·max(u·|v|, tiny): a rounding's error bound, relative, or absolute below the smallest
  // normal of the format (tiny = half its smallest subnormal; 0 where that does not matter).
  void perturb(std::vector<double>& v, double u, double tiny = 0) {
    if (u == 0) return;
    for (double& e : v) e += rng_.uniform(-1.0, 1.0) * std::max(u * std::abs(e), tiny);
  }
  void perturb(std::vector<double>& v, bool typed) {
    perturb(v, typed ? u_typed_ : u_f32_, tiny_);
  }
  // A registry tensor: at the typed unit roundoff where MODEL.md §8 stores it typed.
  void perturb(std::vector<double>& v, const char* stage, const char* tensor) {
    perturb(v, find_spec(stage, tensor).typed);
  }
  // The staged typed copy of a residual-stream gradient that feeds a GEMM.
  std::vector<double> typed_copy(const std::vector<double>& v) {
    std::vector<double> c = v;
    perturb(c, true);
    return c;
  }

  // The pseudo-stages: their tensors are written by F5/F6 (states), B6/B5a (d_states), B4b (B4c).
  static bool is_pseudo(const std::string& st) {
    return st == "states" || st == "d_states" || st == "B4c";
  }
  // The registry stages whose tensors `st` writes: its own, and the pseudo-stages' it fills.
  static std::vector<std::pair<std::string, std::string>> writes(const std::string& st) {
    if (st == "F5") return {{"F5", ""}, {"states", "angle_state"}};
    if (st == "F6") return {{"F6", ""}, {"states", "ssm_state"}, {"states", "k_state"}, {"states", "v_state"}};
    if (st == "B6") return {{"B6", ""}, {"d_states", "d_ssm_state"}, {"d_states", "d_k_state"}, {"d_states", "d_v_state"}};
    if (st == "B5a") return {{"B5a", ""}, {"d_states", "d_angle_state"}};
    if (st == "B4b") return {{"B4b", ""}, {"B4c", ""}};
    if (is_pseudo(st)) return {};
    return {{st, ""}};
  }
  // After a stage: perturb what it wrote (F1's residual is the layer input, written upstream),
  // then capture it.
  void after_stage(int l, const std::string& st, const std::vector<ref::TensorField<double>>& fields) {
    for (const auto& w : writes(st))
      for (const auto& f : fields) {
        if (w.first != f.stage || (!w.second.empty() && w.second != f.tensor)) continue;
        if (std::string(f.tensor) == "residual") continue;
        perturb(*f.v, f.stage, f.tensor);
      }
    for (const auto& w : writes(st)) put_stage(l, w.first, w.second, fields);
  }

  // ---- the teacher's values (the isolated mode) -------------------------------------------
  // The teacher's `key`, perturbed once per run (a rounded value is the same at every load).
  void load(const std::string& key, std::vector<double>& v, bool typed) {
    auto it = loaded_.find(key);
    if (it == loaded_.end()) {
      const Tensor* t = teacher_->find(key);
      M3_REQUIRE(t != nullptr && static_cast<size_t>(t->numel()) == v.size(), "perturbed oracle",
                 "the teacher lacks '" + key + "' or its size differs",
                 "an isolated run needs every registry tensor of the oracle");
      std::vector<double> c(t->data.begin(), t->data.end());
      perturb(c, typed);
      it = loaded_.emplace(key, std::move(c)).first;
    }
    v = it->second;
  }
  void load_if_teacher(const std::string& key, std::vector<double>& v, bool typed) {
    if (teacher_) load(key, v, typed);
  }
  // Every registry field of layer l (or, with `written_by`, those that stage writes) set to the
  // teacher's value. Stages write only the fields of their own and their pseudo-stages' names,
  // so restoring those after a stage gives the next stage the teacher's values throughout.
  void load_fields(int l, const std::vector<ref::TensorField<double>>& fields,
                   const std::string& written_by = "") {
    const auto w = written_by.empty() ? std::vector<std::pair<std::string, std::string>>{}
                                      : writes(written_by);
    for (const auto& f : fields) {
      if (!written_by.empty()) {
        bool hit = false;
        for (const auto& x : w) hit = hit || (x.first == f.stage && (x.second.empty() || x.second == f.tensor));
        if (!hit) continue;
      }
      const TensorSpec& spec = find_spec(f.stage, f.tensor);
      if (!exists_in(spec, cfg_, mode_)) continue;
      load(stage_key(l, f.stage, f.tensor), *f.v, spec.typed);
    }
  }
  void take_states(int l, ref::LayerActs<double>& a) const {
    take(pb_.states.ssm, l, a.ssm_in);
    take(pb_.states.k, l, a.k_in);
    take(pb_.states.v, l, a.v_in);
    take(pb_.states.angle, l, a.angle_in);
  }

  void put(int layer, const char* stage, const char* tensor, const std::vector<double>& v) {
    if (!exists_in(find_spec(stage, tensor), cfg_, mode_)) return;
    cap_.put_stage(layer, stage, tensor, v.data(), static_cast<Idx>(v.size()));
  }
  // The registry tensors of stage `st` (only `tensor`, when given) in the registry's order.
  void put_stage(int l, const std::string& st, const std::string& tensor,
                 const std::vector<ref::TensorField<double>>& fields) {
    for (const TensorSpec& spec : stage_registry()) {
      if (spec.scope != Scope::Layer || st != spec.stage) continue;
      if (!tensor.empty() && tensor != spec.tensor) continue;
      for (const auto& f : fields)
        if (st == f.stage && std::string(spec.tensor) == f.tensor)
          put(l, spec.stage, spec.tensor, *f.v);
    }
  }
  static void take(const std::vector<double>& all, int l, std::vector<double>& slice) {
    std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(l) * slice.size()),
                slice.size(), slice.begin());
  }

  const Problem& pb_;
  const Config& cfg_;
  ScanMode mode_;
  ref::Dims d_;
  double u_typed_, u_f32_;
  double tiny_;  // the absolute floor of every value's error (an f16 cell: 2^-25)
  Rng rng_;
  const Capture* teacher_;
  std::map<std::string, std::vector<double>> loaded_;
  Capture cap_;
  std::vector<std::string> fwd_, bwd_;
  std::vector<ref::LayerActs<double>> acts_;
  ref::LayerGrads<double> g_;
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

Problem perturbed_problem(const Problem& pb, const Perturbation& pt, int draw) {
  Problem q = pb;
  Rng rng(perturbation_seed(pb.seed, pt.u_typed, draw, 0));
  auto perturb = [&](std::vector<double>& v, double u) {
    if (u == 0) return;
    for (double& e : v) e *= 1.0 + u * rng.uniform(-1.0, 1.0);
  };
  for_each_param(q.params, [&](int, const char* name, std::vector<double>& v) {
    perturb(v, is_gemm_weight(name) ? pt.u_typed : pt.u_f32);
  });
  perturb(q.x, find_spec("input_proj", "input_proj_inputs").typed ? pt.u_typed : pt.u_f32);
  perturb(q.d_out, pt.u_f32);
  perturb(q.states.ssm, pt.u_f32);
  perturb(q.states.k, pt.u_f32);
  perturb(q.states.v, pt.u_f32);
  perturb(q.states.angle, pt.u_f32);
  return q;
}

Capture run_perturbed_reference(const Problem& pb, ScanMode mode, const Perturbation& pt,
                                int draw) {
  validate_run(pb.cfg, pb.B, pb.T);
  const Problem q = perturbed_problem(pb, pt, draw);
  return PerturbedRun(q, mode, pt, perturbation_seed(pb.seed, pt.u_typed, draw, 1), nullptr)
      .run();
}

Capture run_perturbed_isolated(const Problem& pb, ScanMode mode, const Capture& oracle,
                               const Perturbation& pt, int draw) {
  validate_run(pb.cfg, pb.B, pb.T);
  const Problem q = perturbed_problem(pb, pt, draw);
  return PerturbedRun(q, mode, pt, perturbation_seed(pb.seed, pt.u_typed, draw, 2), &oracle)
      .run();
}

Implementation perturbed_oracle(Precision p, int draw) {
  const Perturbation pt = perturbation_of(p);
  std::string name = "reference<double>~u(" + std::string(precision_name(p)) + ")";
  if (draw > 0) name += "#" + std::to_string(draw);
  return {name, [pt, draw](const Problem& pb, ScanMode mode) {
            return run_perturbed_reference(pb, mode, pt, draw);
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

IsolatedRun perturbed_isolated_oracle(Precision p, int draw) {
  const Perturbation pt = perturbation_of(p);
  return [pt, draw](const Problem& pb, ScanMode mode, const Capture& oracle) {
    return run_perturbed_isolated(pb, mode, oracle, pt, draw);
  };
}

void add_perturbed_baselines(std::vector<Lineup>& lineups, int draws) {
  M3_REQUIRE(draws >= 1, "add_perturbed_baselines", "at least one draw of the perturbed oracle",
             "draws=" + std::to_string(draws));
  auto refs = std::make_shared<ReferenceRuns>();
  for (Lineup& l : lineups) {
    l.isolated_baselines.clear();
    for (int d = 0; d < draws; ++d)
      l.isolated_baselines.push_back(perturbed_isolated_oracle(l.precision, d));
    l.isolated_baseline_reference = [refs](const Problem& pb, ScanMode mode, const Capture& o) {
      return refs->isolated(pb, mode, o);
    };
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
    if (draws > 1) l.baseline->name += " (max of " + std::to_string(draws) + " draws)";
    out.push_back(std::move(l));
  }
  add_perturbed_baselines(out, draws);
  return out;
}

std::uint64_t sweep_stream(std::uint64_t seed, std::uint64_t index) {
  return mix64(mix64(seed ^ 0x5eed5eed5eed5eedULL) + index * 0x9e3779b97f4a7c15ULL);
}

RunSpec draw_problem(std::uint64_t seed, std::uint64_t index, const SweepLimits& lim) {
  Rng rng(sweep_stream(seed, index));
  RunSpec s;
  for (int tries = 0; tries < 10000; ++tries)
    if (try_draw(rng, lim, s)) {
      s.source = "sweep seed " + std::to_string(seed) + " problem " + std::to_string(index);
      return s;
    }
  throw Error("sweep", "no valid problem within the limits",
              "seed " + std::to_string(seed) + " index " + std::to_string(index));
}

std::vector<std::string> reproducer_args(const RunSpec& spec) {
  const Config& c = spec.cfg;
  std::vector<std::string> a;
  auto opt = [&](const char* name, const std::string& value) {
    a.emplace_back(name);
    a.push_back(value);
  };
  auto num = [](Idx v) { return std::to_string(v); };
  if (!spec.preset.empty() && spec.preset != "default") opt("--preset", spec.preset);
  opt("--d-model", num(c.d_model));
  opt("--d-state", num(c.d_state));
  opt("--headdim", num(c.headdim));
  opt("--expand", num(c.expand));
  opt("--ngroups", num(c.ngroups));
  opt("--layers", num(c.n_layers));
  opt("--rope-fraction", c.rope_fraction == 1.0 ? "1.0" : "0.5");
  opt("--chunk-size", num(c.chunk_size));
  if (c.vocab_size > 0) {
    opt("--vocab-size", num(c.vocab_size));
  } else {
    opt("--input-dim", num(c.input_dim));
    if (c.input_proj_identity) a.emplace_back("--input-proj-identity");
  }
  if (c.is_outproj_norm) a.emplace_back("--outproj-norm");
  opt("--B", num(spec.B));
  opt("--T", num(spec.T));
  opt("--seed", std::to_string(spec.seed));
  if (!spec.random_states) a.emplace_back("--zero-states");
  return a;
}

std::string reproducer(const RunSpec& spec, const std::vector<Precision>& precisions,
                       const std::vector<ScanMode>& modes,
                       const std::vector<CompareMode>& compare_modes, const std::string& device,
                       const std::string& fault) {
  std::vector<std::string> a = {"m3h", "compare", "--device", device, "--dtype",
                                precision_list(precisions), "--scan", mode_list(modes),
                                "--mode", compare_mode_list(compare_modes)};
  if (!fault.empty() && fault != "none") {
    a.emplace_back("--fault");
    a.push_back(fault);
  }
  for (auto& s : reproducer_args(spec)) a.push_back(s);
  return join(a, " ");
}

ProblemOutcome run_problem(const RunSpec& spec_in, const SweepOptions& opt,
                           const std::vector<Precision>& precisions) {
  ProblemOutcome out;
  try {
    RunSpec spec = spec_in;
    spec.modes = opt.modes;
    spec.compare_modes = opt.compare_modes;
    M3_REQUIRE(static_cast<bool>(opt.lineups), "sweep", "no lineup factory", "");
    const Problem pb = build_problem(spec);
    const Comparison c = run_comparison(spec, pb, reference_oracle(), opt.lineups(precisions));
    std::set<std::string> tensors;
    for (const CompareResult& cell : c.cells) {
      if (cell.pass()) continue;
      out.pass = false;
      out.n_fail += cell.n_fail();
      add_unique(out.precisions, cell.precision);
      add_unique(out.modes, cell.mode);
      add_unique(out.compare_modes, cell.compare_mode);
      for (const TensorResult& r : cell.rows)
        if (!r.pass()) out.failing_tensors.push_back(r.stage + "/" + r.tensor);
      if (out.first_fail.empty()) {
        const TensorResult& r = cell.rows[static_cast<size_t>(cell.first_fail)];
        std::ostringstream os;
        os << r.key << " [" << precision_name(cell.precision) << " " << scan_mode_name(cell.mode)
           << " " << compare_mode_name(cell.compare_mode) << "] " << status_name(r.status) << ": "
           << r.note;
        out.first_fail = os.str();
        out.fail_tensor = r.stage + "/" + r.tensor;
      }
    }
    out.precisions = ordered(out.precisions, precisions);
    out.modes = ordered(out.modes, opt.modes);
    out.compare_modes = ordered(out.compare_modes, opt.compare_modes);
  } catch (const std::exception& e) {
    out.pass = false;
    out.error = e.what();
    out.first_fail = std::string("error: ") + e.what();
    out.precisions = precisions;
    out.modes = opt.modes;
    out.compare_modes = opt.compare_modes;
  }
  return out;
}

std::vector<RunSpec> shrink_candidates(const RunSpec& s, const SweepLimits& lim) {
  std::vector<RunSpec> out;
  std::set<std::string> seen;
  auto key = [](const RunSpec& r) {
    return r.cfg.describe() + " B=" + std::to_string(r.B) + " T=" + std::to_string(r.T) +
           " rs=" + std::to_string(r.random_states);
  };
  seen.insert(key(s));
  auto add = [&](RunSpec r) {
    Config& c = r.cfg;
    if (c.input_proj_identity) c.input_dim = c.d_model;
    if (c.vocab_size > 0) c.input_dim = c.vocab_size;
    if (!within(c, r.B, r.T, r.random_states, lim)) return;  // validates too
    if (seen.insert(key(r)).second) out.push_back(std::move(r));
  };
  auto with = [&](auto&& change) {
    RunSpec r = s;
    change(r);
    add(std::move(r));
  };
  with([](RunSpec& r) { r.cfg.n_layers = 1; });
  with([](RunSpec& r) { r.cfg.n_layers -= 1; });
  with([](RunSpec& r) { r.T = 1; });
  with([](RunSpec& r) { r.T /= 2; });
  with([](RunSpec& r) { r.T -= 1; });
  with([](RunSpec& r) { r.B = 1; });
  with([](RunSpec& r) { r.random_states = false; });
  with([](RunSpec& r) { r.cfg.is_outproj_norm = false; });
  with([](RunSpec& r) { r.cfg.rope_fraction = 0.5; });
  if (s.cfg.vocab_size > 0) {
    with([](RunSpec& r) { r.cfg.vocab_size = std::max<Idx>(1, r.cfg.vocab_size / 2); });
  } else {
    with([](RunSpec& r) { r.cfg.input_proj_identity = true; });
    with([](RunSpec& r) { r.cfg.input_dim = 1; });
    with([](RunSpec& r) { r.cfg.input_dim /= 2; });
  }
  // Fewer heads: fewer heads per group first, then fewer groups (d_model follows d_inner).
  auto heads = [&](Idx ngroups, Idx hpg) {
    with([&](RunSpec& r) {
      Config& c = r.cfg;
      const Idx di = ngroups * hpg * c.headdim;
      if (di % c.expand != 0) {
        c.d_model = 0;  // invalid: dropped by add()
        return;
      }
      const bool follow = !c.input_proj_identity && c.vocab_size == 0 && c.input_dim == c.d_model;
      c.ngroups = ngroups;
      c.d_model = di / c.expand;
      if (follow) c.input_dim = c.d_model;
    });
  };
  const Idx hpg = s.cfg.heads_per_group();
  if (hpg > 1) heads(s.cfg.ngroups, hpg / 2);
  if (s.cfg.ngroups > 1) heads(s.cfg.ngroups / 2, hpg);
  // headdim halved and expand 1, keeping the number of heads.
  auto width = [&](Idx headdim, Idx expand) {
    with([&](RunSpec& r) {
      Config& c = r.cfg;
      const Idx di = c.nheads() * headdim;
      if (headdim < 1 || di % expand != 0) {
        c.d_model = 0;
        return;
      }
      const bool follow = !c.input_proj_identity && c.vocab_size == 0 && c.input_dim == c.d_model;
      c.headdim = headdim;
      c.expand = expand;
      c.d_model = di / expand;
      if (follow) c.input_dim = c.d_model;
    });
  };
  if (s.cfg.headdim > 1) width(s.cfg.headdim / 2, s.cfg.expand);
  if (s.cfg.expand > 1) width(s.cfg.headdim, 1);
  with([](RunSpec& r) { r.cfg.d_state = std::max<Idx>(1, r.cfg.d_state / 2); });
  with([](RunSpec& r) { r.cfg.d_state -= 1; });
  with([](RunSpec& r) { r.cfg.chunk_size = std::max<Idx>(1, r.cfg.chunk_size / 2); });
  return out;
}

RunSpec shrink_failure(const RunSpec& spec, const std::function<bool(const RunSpec&)>& fails,
                       int max_steps, int* steps, const SweepLimits& lim) {
  RunSpec cur = spec;
  int n = 0;
  while (n < max_steps) {
    bool moved = false;
    for (RunSpec& cand : shrink_candidates(cur, lim)) {
      if (fails(cand)) {
        cur = std::move(cand);
        ++n;
        moved = true;
        break;
      }
    }
    if (!moved) break;
  }
  if (steps) *steps = n;
  return cur;
}

namespace {

// One problem of a sweep: drawn, run and, when it fails, shrunk.
SweepFailure evaluate(std::uint64_t seed, std::uint64_t i, const SweepOptions& opt, bool* pass) {
  SweepFailure f;
  f.index = i;
  f.problem = draw_problem(seed, i, opt.limits);
  f.outcome = run_problem(f.problem, opt, opt.precisions);
  f.shrunk = f.problem;
  f.shrunk_outcome = f.outcome;
  *pass = f.outcome.pass;
  if (f.outcome.pass || !opt.shrink) return f;
  const ProblemOutcome& o = f.outcome;
  SweepOptions sub = opt;  // only the cells that failed
  sub.modes = o.modes;
  sub.compare_modes = o.compare_modes;
  ProblemOutcome last = o;
  auto fails = [&](const RunSpec& cand) {
    ProblemOutcome r = run_problem(cand, sub, o.precisions);
    if (r.pass) return false;
    const bool same = !o.error.empty()
                          ? !r.error.empty()
                          : std::find(r.failing_tensors.begin(), r.failing_tensors.end(),
                                      o.fail_tensor) != r.failing_tensors.end();
    if (same) last = std::move(r);
    return same;
  };
  f.shrunk = shrink_failure(f.problem, fails, opt.max_shrink_steps, &f.shrink_steps, opt.limits);
  if (f.shrink_steps > 0) f.shrunk_outcome = last;
  return f;
}

void print_failure(std::ostream& out, const SweepFailure& f, const SweepOptions& opt) {
  out << "FAIL problem " << f.index << ": " << f.outcome.first_fail << "\n  reproduce: "
      << reproducer(f.problem, opt.precisions, opt.modes, opt.compare_modes, opt.device, opt.fault)
      << "\n";
  if (opt.shrink)
    out << "  shrunk (" << f.shrink_steps << " steps): " << f.shrunk_outcome.first_fail
        << "\n  reproduce: "
        << reproducer(f.shrunk, f.shrunk_outcome.precisions, f.shrunk_outcome.modes,
                      f.shrunk_outcome.compare_modes, opt.device, opt.fault)
        << "\n";
  out << std::flush;
}

}  // namespace

SweepResult run_sweep(std::uint64_t seed, std::uint64_t n, const SweepOptions& opt,
                      std::ostream& out, std::uint64_t first) {
  M3_REQUIRE(first < n, "harness::run_sweep", "the first problem is past the sweep's end",
             "first=", first, " n=", n);
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto elapsed = [&] {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f s", std::chrono::duration<double>(Clock::now() - t0).count());
    return std::string(buf);
  };
  SweepResult res;
  res.seed = seed;
  res.n = n;
  res.first = first;
  const std::string range = std::to_string(first) + " … " + std::to_string(n - 1) + " of " +
                            std::to_string(n);
  out << "sweep: seed " << seed << ", "
      << (first == 0 ? std::to_string(n) + " problems" : "problems " + range) << " on the "
      << opt.device << ", dtype "
      << precision_list(opt.precisions) << ", scan " << mode_list(opt.modes) << ", mode "
      << compare_mode_list(opt.compare_modes) << (opt.fault.empty() ? "" : ", fault " + opt.fault)
      << (opt.jobs > 1 ? ", " + std::to_string(opt.jobs) + " jobs" : std::string()) << "\n"
      << std::flush;
  // Problems run on opt.jobs threads (each its own problem: the reference keeps no shared
  // mutable state); the results are printed in index order, as a single thread would.
  struct Slot {
    bool done = false, pass = true;
    SweepFailure f;
  };
  std::vector<Slot> slots(static_cast<size_t>(n - first));  // slot k: problem first + k
  std::mutex mu;
  std::condition_variable cv;
  std::atomic<std::uint64_t> next{first};
  auto worker = [&] {
    for (std::uint64_t i; (i = next++) < n;) {
      bool pass = true;
      SweepFailure f = evaluate(seed, i, opt, &pass);
      std::lock_guard<std::mutex> lock(mu);
      Slot& s = slots[static_cast<size_t>(i - first)];
      s.f = std::move(f);
      s.pass = pass;
      s.done = true;
      cv.notify_all();
    }
  };
  std::vector<std::thread> threads;
  const int jobs = std::max(1, opt.jobs);
  if (jobs > 1)
    for (int j = 0; j < jobs; ++j) threads.emplace_back(worker);
  for (std::uint64_t i = first; i < n; ++i) {
    Slot slot;
    if (jobs > 1) {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return slots[static_cast<size_t>(i - first)].done; });
      slot = std::move(slots[static_cast<size_t>(i - first)]);
    } else {
      slot.f = evaluate(seed, i, opt, &slot.pass);
    }
    if (!slot.pass) {
      print_failure(out, slot.f, opt);
      res.failures.push_back(std::move(slot.f));
    }
    if (opt.progress_every > 0 && (i + 1) % static_cast<std::uint64_t>(opt.progress_every) == 0 &&
        i + 1 < n)
      out << "progress: " << (i + 1) << "/" << n << " problems, " << res.failures.size()
          << " failed, " << elapsed() << "\n"
          << std::flush;
  }
  for (auto& t : threads) t.join();
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  out << "sweep: " << (n - first) << " problems"
      << (first == 0 ? std::string() : " (" + range + ")") << ", " << res.failures.size()
      << " failed (seed " << seed << ", " << elapsed() << ")\n";
  return res;
}

}  // namespace m3::harness
