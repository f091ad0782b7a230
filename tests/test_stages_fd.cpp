// Every backward stage of the reference (MODEL.md §4–§6, §12) in isolation against central
// finite differences of its OWN forward, in double.
//
// One test = one stage pair (forward → backward) on tiny dims (B = 2, T ≤ 5, d_model 4–6,
// headdim 2–3, d_state 3–6, chunks partial):
//   1. seeded inputs inside the stage's domain (dt > 0, 0 < trap < 1, a_val < 0, α ∈ (0, 1), …);
//   2. the forward, and the scalar  L = Σ_o Σ_j G_o[j]·y_o[j]  over every output y_o of the
//      stage, with fixed seeded weights G_o ∈ U(−1, 1);
//   3. the backward with each G_o placed in the LayerGrads field of ∂L/∂y_o;
//   4. EVERY element of every input gradient and parameter gradient against
//        ∂L/∂x_i ≈ Σ_o Σ_j G_o[j]·(y_o[j](x_i + h) − y_o[j](x_i − h)) / 2h,  h = 1e-6·max(1, |x_i|).
// The difference is taken per output element before the weighted sum (no cancellation between
// two large L values); the wrapped angle output angle_out ∈ [0, 2π) uses the circular
// difference (MODEL.md §12.3), so a step across the wrap costs nothing.
// Pass rule per gradient tensor: max_i |analytic_i − fd_i| ≤ kRelTol · max(‖fd‖∞, ‖analytic‖∞).
//
// Two contracts of stages.hpp are checked on the way: activation gradients are OVERWRITTEN
// (every LayerGrads buffer holds kPoison before the backward; the G's are then written into
// the fields the backward reads, so a stray += or a read of a stale buffer shows up as an error
// of order 1e6), and parameter gradients ACCUMULATE (they start from a seeded offset that is
// subtracted before the comparison).
//
// Kinks — softplus threshold v = 20, heavy-tail φ at 0, the a_floor clamp — are kept ≥ 0.05
// away from every input value, far beyond any FD step, so no difference straddles one.
//
// Stages: F1/B1 RMSNorm; F2/B2, F8/B8 linear (± bias); F3+F5b / B5b+B3 split, activations and
// α, β, γ; F4 / B4b+B4c BCNorm + bias; F5+F4ef / B6-tail+B5a angles and RoPE; F6 sequential
// (§6.3); F4ef+F6 chunked (§6.4 steps 1–3, RoPE included); F7/B7 gating, both variants.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "fd.hpp"
#include "params.hpp"
#include "stages.hpp"
#include "test_util.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::Rng;
using m3::ScanMode;
using m3::ref::Dims;
using Acts = m3::ref::LayerActs<double>;
using Grads = m3::ref::LayerGrads<double>;
using PGrads = m3::LayerParams<double>;
using Vecd = std::vector<double>;

constexpr double kRelTol = 1e-8;
constexpr double kPoison = 1.0e6;
constexpr double kKinkMargin = 0.05;  // every input stays this far from every kink

// ---------------------------------------------------------------------------------------------
// Small helpers

std::uint64_t fnv1a(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

Vecd random_vec(size_t n, Rng& rng, double lo, double hi) {
  Vecd v(n);
  for (auto& e : v) e = rng.uniform(lo, hi);
  return v;
}

void fill(Vecd& v, Rng& rng, double lo, double hi) {
  for (auto& e : v) e = rng.uniform(lo, hi);
}

// Moves v at least `margin` away from each kink (to the side it is already on).
double away_from(double v, const std::vector<double>& kinks, double margin = kKinkMargin) {
  for (double k : kinks)
    if (std::abs(v - k) < margin) v = v >= k ? k + margin : k - margin;
  return v;
}

Vecd minus(const Vecd& a, const Vecd& b) {
  Vecd r(a.size());
  for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] - b[i];
  return r;
}

// A parameter-gradient buffer preloaded with a seeded offset (the backward must ADD to it);
// returns the offset so the test can subtract it.
Vecd preload(Vecd& grad, size_t n, Rng& rng) {
  grad = random_vec(n, rng, -0.5, 0.5);
  return grad;
}

// Every buffer of a LayerGrads: activation gradients must be overwritten, never accumulated.
void poison(Grads& g) {
  for (Vecd* v :
       {&g.d_ssm_out, &g.d_k_out, &g.d_v_out, &g.d_angle_out, &g.d_ssm_in, &g.d_k_in, &g.d_v_in,
        &g.d_angle_in, &g.d_gated, &g.d_y, &g.d_z, &g.d_q, &g.d_k, &g.d_alpha, &g.d_beta,
        &g.d_gamma, &g.d_d_local, &g.da_cs_sum, &g.dQ_mid, &g.dK_mid, &g.dADT, &g.dQK_dot,
        &g.dD_partials, &g.dScale, &g.dGamma, &g.dDT, &g.d_x, &g.d_b_pre_rope, &g.d_c_pre_rope,
        &g.d_angle_cumsum, &g.d_adt_total, &g.d_dt_direct, &g.d_trap_sig, &g.d_angles_raw,
        &g.d_dt_angle, &g.d_dd_dt, &g.d_dd_a, &g.d_trap_raw, &g.d_b_normed, &g.d_c_normed,
        &g.d_b_raw, &g.d_c_raw, &g.d_proj, &g.d_norm, &g.d_pre_norm, &g.d_temporal})
    std::fill(v->begin(), v->end(), kPoison);
}

// Worst relative error seen per stage family (the case-name prefix), printed at the end.
std::map<std::string, std::pair<double, std::string>>& worst_by_stage() {
  static std::map<std::string, std::pair<double, std::string>> m;
  return m;
}

class SummaryEnv : public ::testing::Environment {
 public:
  void TearDown() override {
    if (worst_by_stage().empty()) return;
    std::printf("[stage fd] worst max|analytic − fd| / max(|fd|, |analytic|) per stage:\n");
    for (const auto& [stage, w] : worst_by_stage())
      std::printf("[stage fd]   %-10s %.2e  (%s)\n", stage.c_str(), w.first, w.second.c_str());
  }
};
[[maybe_unused]] ::testing::Environment* const kSummaryEnv =
    ::testing::AddGlobalTestEnvironment(new SummaryEnv);

// ---------------------------------------------------------------------------------------------
// The checker: outputs with their weights, inputs with their analytic gradients, the FD loop.

class FdCheck {
 public:
  FdCheck(std::string case_name, std::function<void()> forward, std::uint64_t seed)
      : case_(std::move(case_name)), forward_(std::move(forward)), rng_(seed ^ 0x5EEDull) {}

  // Registers output y (read after every forward) with a fresh weight G; returns G, which the
  // test writes into the gradient field the backward reads for y.
  Vecd output(const std::string& name, const Vecd& y, bool circular = false) {
    outs_.push_back({name, &y, random_vec(y.size(), rng_, -1.0, 1.0), circular});
    return outs_.back().G;
  }

  // Registers input x, perturbed in place by the FD loop, with the backward's ∂L/∂x.
  void input(const std::string& name, Vecd& x, const Vecd& analytic) {
    ins_.push_back({name, &x, analytic});
  }

  void run() {
    std::vector<Vecd> plus(outs_.size()), minus_(outs_.size());
    auto snap = [&](std::vector<Vecd>& s) {
      for (size_t k = 0; k < outs_.size(); ++k) s[k] = *outs_[k].y;
    };
    const std::string family = case_.substr(0, case_.find('_'));
    auto& worst = worst_by_stage()[family];
    for (const auto& in : ins_) {
      Vecd& x = *in.x;
      ASSERT_EQ(in.analytic.size(), x.size()) << case_ << ": gradient wrt " << in.name
                                              << " has the wrong size";
      Vecd fd(x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        const double x0 = x[i], h = m3::test::fd_step(x0), xp = x0 + h, xm = x0 - h;
        x[i] = xp;
        forward_();
        snap(plus);
        x[i] = xm;
        forward_();
        snap(minus_);
        x[i] = x0;
        double dl = 0;
        for (size_t k = 0; k < outs_.size(); ++k) {
          const Out& o = outs_[k];
          for (size_t j = 0; j < o.G.size(); ++j) {
            const double dy = o.circular ? m3::test::circ_diff(plus[k][j], minus_[k][j])
                                         : plus[k][j] - minus_[k][j];
            dl += o.G[j] * dy;
          }
        }
        fd[i] = dl / (xp - xm);
      }
      double err = 0, scale = 0;
      size_t at = 0;
      bool finite = true;
      for (size_t i = 0; i < x.size(); ++i) {
        finite = finite && std::isfinite(in.analytic[i]) && std::isfinite(fd[i]);
        scale = std::max({scale, std::abs(fd[i]), std::abs(in.analytic[i])});
        const double e = std::abs(in.analytic[i] - fd[i]);
        if (e > err) {
          err = e;
          at = i;
        }
      }
      const double rel = scale > 0 ? err / scale : 0.0;
      std::printf("[stage fd] %-40s d/d %-16s n=%-4zu scale %.3e  max|Δ| %.2e  rel %.2e\n",
                  case_.c_str(), in.name.c_str(), x.size(), scale, err, rel);
      EXPECT_TRUE(finite) << case_ << ": gradient wrt " << in.name << " is not finite";
      EXPECT_LE(rel, kRelTol) << case_ << ": gradient wrt " << in.name << ", element [" << at
                              << "] of " << x.size() << ": analytic " << in.analytic[at]
                              << ", fd " << fd[at] << "; scale max(|fd|, |analytic|) = " << scale;
      if (rel >= worst.first) worst = {rel, case_ + " d/d " + in.name};
    }
    forward_();  // leave the outputs at the unperturbed point
  }

 private:
  struct Out {
    std::string name;
    const Vecd* y;
    Vecd G;
    bool circular;
  };
  struct In {
    std::string name;
    Vecd* x;
    Vecd analytic;
  };
  std::string case_;
  std::function<void()> forward_;
  Rng rng_;
  std::vector<Out> outs_;
  std::vector<In> ins_;
};

// ---------------------------------------------------------------------------------------------
// Cases

enum class F3Regime {
  Plain,              // softplus below 20, clamp inactive (a_floor 1e-4)
  SoftplusThreshold,  // half the heads have dt_bias = 20: dd_dt_raw + dt_bias on both sides
  AClampNegBranch,    // a_floor 0.5: clamp active for dd_a_raw < −1 (φ = 1/(1−v) branch)
  AClampPosBranch,    // a_floor 1.5: clamp active for dd_a_raw < 0.5 (both φ branches)
};

struct StageCase {
  std::string name;
  void (*run)(const StageCase&);
  Config cfg;
  Idx B = 2, T = 5;
  bool states = true;         // F5, F6: random entering states (false: zeros)
  bool bias = false;          // linear: with bias
  Idx lin_in = 0, lin_out = 0;  // linear: shape [in, out]
  double scale = 1.0;         // F1: input magnitude
  F3Regime f3 = F3Regime::Plain;
  std::uint64_t seed() const { return fnv1a(name); }
};

void PrintTo(const StageCase& c, std::ostream* os) { *os << c.name; }

// F1/B1: y = u/rms·w.  Inputs u [BT, dm], w [dm].
void run_rmsnorm(const StageCase& c) {
  const Dims d = Dims::of(c.cfg, c.B, c.T);
  Rng rng(c.seed());
  const Idx rows = d.BT, dim = d.dm;
  Vecd u = random_vec(rows * dim, rng, -c.scale, c.scale);
  Vecd w = random_vec(dim, rng, 0.7, 1.3);
  Vecd y(rows * dim), rms(rows);
  auto fwd = [&] { m3::ref::rmsnorm_forward(rows, dim, u.data(), w.data(), y.data(), rms.data()); };
  fwd();
  FdCheck chk(c.name, fwd, c.seed());
  const Vecd G = chk.output("y", y);
  Vecd dx(rows * dim, kPoison), dw;
  const Vecd dw0 = preload(dw, dim, rng);
  m3::ref::rmsnorm_backward(rows, dim, u.data(), w.data(), rms.data(), G.data(), dx.data(),
                            dw.data());
  chk.input("u", u, dx);
  chk.input("w", w, minus(dw, dw0));
  chk.run();
}

// F2/B2, F8/B8 (and the backbone input_proj): Y = X·W (+ b).
void run_linear(const StageCase& c) {
  const Dims d = Dims::of(c.cfg, c.B, c.T);
  Rng rng(c.seed());
  const Idx rows = d.BT, in = c.lin_in, out = c.lin_out;
  Vecd X = random_vec(rows * in, rng, -1, 1), W = random_vec(in * out, rng, -1, 1);
  Vecd b = random_vec(out, rng, -1, 1), Y(rows * out);
  const double* bp = c.bias ? b.data() : nullptr;
  auto fwd = [&] { m3::ref::linear_forward(rows, in, out, X.data(), W.data(), bp, Y.data()); };
  fwd();
  FdCheck chk(c.name, fwd, c.seed());
  const Vecd G = chk.output("Y", Y);
  Vecd dX(rows * in, kPoison), dW, db;
  const Vecd dW0 = preload(dW, in * out, rng), db0 = preload(db, out, rng);
  m3::ref::linear_backward(rows, in, out, X.data(), W.data(), G.data(), dX.data(), dW.data(),
                           c.bias ? db.data() : nullptr);
  chk.input("X", X, dX);
  chk.input("W", W, minus(dW, dW0));
  if (c.bias) chk.input("b", b, minus(db, db0));
  chk.run();
}

// F3 split + activations and F5b α, β, γ  ↔  abg glue, B5b, B3.
// Inputs proj [BT, ip], dt_bias [nh]; outputs z, x, b_raw, c_raw, angles_raw, dt, a_val, trap,
// alpha, beta, gamma. B5b's inputs are ∂L/∂adt (adt = a_val·dt), the direct ∂L/∂dt and
// ∂L/∂trap, so the direct weights on dt, a_val and trap are injected in those coordinates:
// L_a = G_a·a_val = G_a·adt/dt gives ∂/∂adt = G_a/dt and ∂/∂dt|_adt = −G_a·a_val/dt (d_dt_angle
// is B5b's slot for an extra direct ∂L/∂dt); G_trap adds to d_trap_sig.
void run_split_abg(const StageCase& c) {
  Config cfg = c.cfg;
  if (c.f3 == F3Regime::AClampNegBranch) cfg.a_floor = 0.5;
  if (c.f3 == F3Regime::AClampPosBranch) cfg.a_floor = 1.5;
  const Dims d = Dims::of(cfg, c.B, c.T);
  Rng rng(c.seed());
  Acts a;
  Grads g;
  a.allocate(d, ScanMode::Sequential);
  g.allocate(d, ScanMode::Sequential);
  m3::LayerParams<double> p;
  p.dt_bias = random_vec(d.nh, rng, -0.5, 0.5);
  fill(a.proj, rng, -1, 1);
  const Idx ddt = 2 * d.di + 2 * d.ng * d.ds, dda = ddt + d.nh, trp = ddt + 2 * d.nh;
  std::vector<double> a_kinks = {0.0};
  if (c.f3 == F3Regime::AClampNegBranch) a_kinks.push_back(-1.0);
  if (c.f3 == F3Regime::AClampPosBranch) a_kinks.push_back(0.5);
  const bool thr = c.f3 == F3Regime::SoftplusThreshold;
  if (thr)
    for (Idx h = 0; h < d.nh; h += 2) p.dt_bias[h] = 20.0;
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      double* row = a.proj.data() + r * d.ip;
      // dt_bias = 20: dd_dt_raw ∈ ±[0.05, 1.5] puts the softplus argument on both sides of 20.
      row[ddt + h] = thr && h % 2 == 0 ? away_from(rng.uniform(-1.5, 1.5), {0.0})
                                       : rng.uniform(-2.0, 2.0);
      row[dda + h] = away_from(rng.uniform(-4.0, 3.0), a_kinks);
      row[trp + h] = rng.uniform(-3.0, 3.0);
    }
  auto fwd = [&] {
    m3::ref::split_forward(d, p, a);
    m3::ref::abg_forward(d, a);
  };
  fwd();
  if (c.f3 == F3Regime::SoftplusThreshold) {
    const auto above = std::count_if(a.dt.begin(), a.dt.end(), [](double v) { return v > 20; });
    EXPECT_GT(above, 0);
    EXPECT_LT(above, static_cast<long>(a.dt.size()));
  }
  if (c.f3 == F3Regime::AClampNegBranch || c.f3 == F3Regime::AClampPosBranch) {
    const auto clamped = std::count(a.a_val.begin(), a.a_val.end(), -cfg.a_floor);
    EXPECT_GT(clamped, 0);
    EXPECT_LT(clamped, static_cast<long>(a.a_val.size()));
  }
  FdCheck chk(c.name, fwd, c.seed());
  const Vecd Gz = chk.output("z", a.z), Gx = chk.output("x", a.x);
  const Vecd Gb = chk.output("b_raw", a.b_raw), Gc = chk.output("c_raw", a.c_raw);
  const Vecd Gang = chk.output("angles_raw", a.angles_raw);
  const Vecd Gdt = chk.output("dt", a.dt), Ga = chk.output("a_val", a.a_val);
  const Vecd Gtr = chk.output("trap", a.trap);
  const Vecd Gal = chk.output("alpha", a.alpha), Gbe = chk.output("beta", a.beta);
  const Vecd Gga = chk.output("gamma", a.gamma);
  poison(g);
  PGrads pg;
  const Vecd dtb0 = preload(pg.dt_bias, d.nh, rng);
  g.d_z = Gz;
  g.d_x = Gx;
  g.d_b_raw = Gb;
  g.d_c_raw = Gc;
  g.d_angles_raw = Gang;
  g.d_alpha = Gal;
  g.d_beta = Gbe;
  g.d_gamma = Gga;
  m3::ref::abg_backward(d, a, g);
  for (Idx i = 0; i < d.BT * d.nh; ++i) {
    g.d_adt_total[i] += Ga[i] / a.dt[i];
    g.d_dt_angle[i] = Gdt[i] - Ga[i] * a.a_val[i] / a.dt[i];
    g.d_trap_sig[i] += Gtr[i];
  }
  m3::ref::activations_backward(d, p, a, g, pg);
  m3::ref::split_backward(d, g);
  chk.input("proj", a.proj, g.d_proj);
  chk.input("dt_bias", p.dt_bias, minus(pg.dt_bias, dtb0));
  chk.run();
}

// F4 BCNorm + per-head bias  ↔  B4b + B4c.
void run_bcnorm(const StageCase& c) {
  const Dims d = Dims::of(c.cfg, c.B, c.T);
  Rng rng(c.seed());
  Acts a;
  Grads g;
  a.allocate(d, ScanMode::Sequential);
  g.allocate(d, ScanMode::Sequential);
  m3::LayerParams<double> p;
  p.b_norm_weight = random_vec(d.ds, rng, 0.7, 1.3);
  p.c_norm_weight = random_vec(d.ds, rng, 0.7, 1.3);
  p.b_bias = random_vec(d.nh * d.ds, rng, -0.5, 0.5);
  p.c_bias = random_vec(d.nh * d.ds, rng, -0.5, 0.5);
  fill(a.b_raw, rng, -1, 1);
  fill(a.c_raw, rng, -1, 1);
  auto fwd = [&] { m3::ref::bcnorm_forward(d, p, a); };
  fwd();
  FdCheck chk(c.name, fwd, c.seed());
  const Vecd Gb = chk.output("b_biased", a.b_biased), Gc = chk.output("c_biased", a.c_biased);
  poison(g);
  g.d_b_pre_rope = Gb;
  g.d_c_pre_rope = Gc;
  PGrads pg;
  const Vecd bw0 = preload(pg.b_norm_weight, d.ds, rng), cw0 = preload(pg.c_norm_weight, d.ds, rng);
  const Vecd bb0 = preload(pg.b_bias, d.nh * d.ds, rng), cb0 = preload(pg.c_bias, d.nh * d.ds, rng);
  m3::ref::bcnorm_backward(d, p, a, g, pg);
  chk.input("b_raw", a.b_raw, g.d_b_raw);
  chk.input("c_raw", a.c_raw, g.d_c_raw);
  chk.input("b_norm_weight", p.b_norm_weight, minus(pg.b_norm_weight, bw0));
  chk.input("c_norm_weight", p.c_norm_weight, minus(pg.c_norm_weight, cw0));
  chk.input("b_bias", p.b_bias, minus(pg.b_bias, bb0));
  chk.input("c_bias", p.c_bias, minus(pg.c_bias, cb0));
  chk.run();
}

// F5 angle accumulation + F4ef RoPE  ↔  rope_backward (B6 tail) + angle_backward (B5a).
// Inputs angles_raw [BT, na], dt [BT, nh], b_biased, c_biased [BT, nh, ds], angle_in [B, nh, na];
// outputs k, q [BT, nh, ds] and angle_out [B, nh, na] (circular).
void run_angle_rope(const StageCase& c) {
  const Dims d = Dims::of(c.cfg, c.B, c.T);
  Rng rng(c.seed());
  Acts a;
  Grads g;
  a.allocate(d, ScanMode::Sequential);
  g.allocate(d, ScanMode::Sequential);
  fill(a.angles_raw, rng, -2, 2);
  fill(a.dt, rng, 0.1, 1.5);
  fill(a.b_biased, rng, -1, 1);
  fill(a.c_biased, rng, -1, 1);
  if (c.states) fill(a.angle_in, rng, 0, m3::ref::kTwoPi);
  auto fwd = [&] {
    m3::ref::angle_forward(d, a);
    m3::ref::rope_forward(d, a);
  };
  fwd();
  FdCheck chk(c.name, fwd, c.seed());
  const Vecd Gk = chk.output("k", a.k), Gq = chk.output("q", a.q);
  const Vecd Gao = chk.output("angle_out", a.angle_out, /*circular=*/true);
  poison(g);
  g.d_k = Gk;
  g.d_q = Gq;
  g.d_angle_out = Gao;
  m3::ref::rope_backward(d, a, g);
  m3::ref::angle_backward(d, a, g);
  chk.input("b_biased", a.b_biased, g.d_b_pre_rope);
  chk.input("c_biased", a.c_biased, g.d_c_pre_rope);
  chk.input("angles_raw", a.angles_raw, g.d_angles_raw);
  chk.input("dt", a.dt, g.d_dt_angle);
  chk.input("angle_in", a.angle_in, g.d_angle_in);
  chk.run();
}

void fill_entering_states(const StageCase& c, Acts& a, Rng& rng) {
  if (!c.states) return;
  fill(a.ssm_in, rng, -0.5, 0.5);
  fill(a.k_in, rng, -0.5, 0.5);
  fill(a.v_in, rng, -0.5, 0.5);
}

// F6 sequential (§4)  ↔  BPTT (§6.3). α, β, γ are independent inputs here.
void run_ssm_seq(const StageCase& c) {
  const Dims d = Dims::of(c.cfg, c.B, c.T);
  Rng rng(c.seed());
  Acts a;
  Grads g;
  a.allocate(d, ScanMode::Sequential);
  g.allocate(d, ScanMode::Sequential);
  m3::LayerParams<double> p;
  p.d_param = random_vec(d.nh, rng, 0.7, 1.3);
  fill(a.x, rng, -1, 1);
  fill(a.k, rng, -1, 1);
  fill(a.q, rng, -1, 1);
  fill(a.alpha, rng, 0.4, 0.99);
  fill(a.beta, rng, 0.05, 0.6);
  fill(a.gamma, rng, 0.05, 1.0);
  fill_entering_states(c, a, rng);
  auto fwd = [&] { m3::ref::ssm_seq_forward(d, p, a); };
  fwd();
  FdCheck chk(c.name, fwd, c.seed());
  const Vecd Gy = chk.output("y", a.y), Gs = chk.output("ssm_out", a.ssm_out);
  const Vecd Gk = chk.output("k_out", a.k_out), Gv = chk.output("v_out", a.v_out);
  poison(g);
  g.d_y = Gy;
  g.d_ssm_out = Gs;
  g.d_k_out = Gk;
  g.d_v_out = Gv;
  PGrads pg;
  const Vecd D0 = preload(pg.d_param, d.nh, rng);
  m3::ref::ssm_seq_backward(d, p, a, g, pg);
  chk.input("x", a.x, g.d_x);
  chk.input("k", a.k, g.d_k);
  chk.input("q", a.q, g.d_q);
  chk.input("alpha", a.alpha, g.d_alpha);
  chk.input("beta", a.beta, g.d_beta);
  chk.input("gamma", a.gamma, g.d_gamma);
  chk.input("d_param", p.d_param, minus(pg.d_param, D0));
  chk.input("ssm_in", a.ssm_in, g.d_ssm_in);
  chk.input("k_in", a.k_in, g.d_k_in);
  chk.input("v_in", a.v_in, g.d_v_in);
  chk.run();
}

// F4ef RoPE + F6 chunked (K0–K6)  ↔  ssm_chunked_backward (§6.4 steps 1–3, RoPE inside).
// Inputs b_biased, c_biased, θ = angle_cumsum, dt, trap, a_val, x, D, entering states.
// adt = a_val·dt, so ∂L/∂a_val = d_adt_total·dt, ∂L/∂dt = d_adt_total·a_val + d_dt_direct,
// ∂L/∂trap = d_trap_sig.
void run_ssm_chunked(const StageCase& c) {
  const Dims d = Dims::of(c.cfg, c.B, c.T);
  Rng rng(c.seed());
  Acts a;
  Grads g;
  a.allocate(d, ScanMode::Chunked);
  g.allocate(d, ScanMode::Chunked);
  m3::LayerParams<double> p;
  p.d_param = random_vec(d.nh, rng, 0.7, 1.3);
  fill(a.b_biased, rng, -1, 1);
  fill(a.c_biased, rng, -1, 1);
  fill(a.angle_cumsum, rng, 0, m3::ref::kTwoPi);
  fill(a.dt, rng, 0.05, 1.2);
  fill(a.trap, rng, 0.05, 0.95);
  fill(a.a_val, rng, -2.0, -0.05);
  fill(a.x, rng, -1, 1);
  fill_entering_states(c, a, rng);
  auto fwd = [&] {
    m3::ref::rope_forward(d, a);
    m3::ref::ssm_chunked_forward(d, p, a);
  };
  fwd();
  FdCheck chk(c.name, fwd, c.seed());
  const Vecd Gy = chk.output("y", a.y), Gs = chk.output("ssm_out", a.ssm_out);
  const Vecd Gk = chk.output("k_out", a.k_out), Gv = chk.output("v_out", a.v_out);
  poison(g);
  g.d_y = Gy;
  g.d_ssm_out = Gs;
  g.d_k_out = Gk;
  g.d_v_out = Gv;
  PGrads pg;
  const Vecd D0 = preload(pg.d_param, d.nh, rng);
  m3::ref::ssm_chunked_backward(d, p, a, g, pg);
  Vecd d_dt(d.BT * d.nh), d_a(d.BT * d.nh);
  for (Idx i = 0; i < d.BT * d.nh; ++i) {
    d_a[i] = g.d_adt_total[i] * a.dt[i];
    d_dt[i] = g.d_adt_total[i] * a.a_val[i] + g.d_dt_direct[i];
  }
  chk.input("x", a.x, g.d_x);
  chk.input("b_biased", a.b_biased, g.d_b_pre_rope);
  chk.input("c_biased", a.c_biased, g.d_c_pre_rope);
  chk.input("angle_cumsum", a.angle_cumsum, g.d_angle_cumsum);
  chk.input("dt", a.dt, d_dt);
  chk.input("a_val", a.a_val, d_a);
  chk.input("trap", a.trap, g.d_trap_sig);
  chk.input("d_param", p.d_param, minus(pg.d_param, D0));
  chk.input("ssm_in", a.ssm_in, g.d_ssm_in);
  chk.input("k_in", a.k_in, g.d_k_in);
  chk.input("v_in", a.v_in, g.d_v_in);
  chk.run();
}

// F7 gating (variant from cfg.is_outproj_norm)  ↔  B7. In variant (a) norm_gate_weight is
// unused and its gradient must stay untouched (FD and analytic both 0).
void run_gating(const StageCase& c) {
  const Dims d = Dims::of(c.cfg, c.B, c.T);
  Rng rng(c.seed());
  Acts a;
  Grads g;
  a.allocate(d, ScanMode::Sequential);
  g.allocate(d, ScanMode::Sequential);
  m3::LayerParams<double> p;
  p.norm_gate_weight = random_vec(d.di, rng, 0.7, 1.3);
  fill(a.y, rng, -1, 1);
  fill(a.z, rng, -3, 3);
  auto fwd = [&] { m3::ref::gating_forward(d, p, a); };
  fwd();
  FdCheck chk(c.name, fwd, c.seed());
  const Vecd G = chk.output("gated", a.gated);
  poison(g);
  g.d_gated = G;
  PGrads pg;
  const Vecd w0 = preload(pg.norm_gate_weight, d.di, rng);
  m3::ref::gating_backward(d, p, a, g, pg);
  chk.input("y", a.y, g.d_y);
  chk.input("z", a.z, g.d_z);
  chk.input("norm_gate_weight", p.norm_gate_weight, minus(pg.norm_gate_weight, w0));
  chk.run();
}

// small_cfg(d_model, headdim, d_state, ngroups, rope_fraction, outproj_norm, n_layers,
//           chunk_size, identity, input_dim); d_inner = 2·d_model.
std::vector<StageCase> stage_cases() {
  using m3::test::small_cfg;
  const Config base = small_cfg(4, 2, 4, 1, 0.5, false, 1, 2);  // nh 4, na 1
  const Config ng2 = small_cfg(6, 3, 6, 2, 1.0, false, 1, 2);   // nh 4, 2 heads/group, na 3
  const Config r05 = small_cfg(6, 3, 6, 2, 0.5, false, 1, 2);   // na 1: dims 2..5 pass through
  const Config r1 = small_cfg(5, 2, 5, 1, 1.0, false, 1, 2);    // nh 5, na 2, dim 4 passes
  const Config na0 = small_cfg(4, 2, 3, 1, 0.5, false, 1, 2);   // na 0: no rotation
  std::vector<StageCase> v;
  auto add = [&](std::string name, void (*run)(const StageCase&), Config cfg) -> StageCase& {
    StageCase c;
    c.name = std::move(name);
    c.run = run;
    c.cfg = cfg;
    v.push_back(c);
    return v.back();
  };
  auto with_cs = [](Config c, Idx cs) {
    c.chunk_size = cs;
    return c;
  };

  add("F1_RmsNorm", run_rmsnorm, small_cfg(5, 2, 4));
  add("F1_RmsNorm_SmallInputs", run_rmsnorm, small_cfg(5, 2, 4)).scale = 0.03;  // ε matters

  {
    StageCase& c = add("F2_InProj", run_linear, base);
    c.lin_in = base.d_model;
    c.lin_out = base.in_proj_dim();
  }
  {
    StageCase& c = add("F8_OutProj", run_linear, ng2);
    c.lin_in = ng2.d_inner();
    c.lin_out = ng2.d_model;
  }
  {
    StageCase& c = add("Linear_WithBias", run_linear, base);
    c.lin_in = 3;
    c.lin_out = base.d_model;
    c.bias = true;
  }

  add("F3_Split_Plain", run_split_abg, base);
  add("F3_Split_ng2_rope1", run_split_abg, ng2);
  add("F3_Split_na0", run_split_abg, na0);
  add("F3_Split_SoftplusThreshold", run_split_abg, base).f3 = F3Regime::SoftplusThreshold;
  add("F3_Split_AClampNegBranch", run_split_abg, r1).f3 = F3Regime::AClampNegBranch;
  add("F3_Split_AClampPosBranch", run_split_abg, ng2).f3 = F3Regime::AClampPosBranch;

  add("F4_BcNorm_ng1", run_bcnorm, base);
  add("F4_BcNorm_ng2", run_bcnorm, ng2);

  add("F5_AngleRope_rope05_ds6", run_angle_rope, r05);
  add("F5_AngleRope_rope1", run_angle_rope, ng2);
  add("F5_AngleRope_rope1_ds5", run_angle_rope, r1);
  add("F5_AngleRope_ZeroAngleIn", run_angle_rope, base).states = false;  // −h wraps to 2π
  add("F5_AngleRope_na0", run_angle_rope, na0);
  add("F5_AngleRope_T1", run_angle_rope, ng2).T = 1;

  add("F6seq_FreshStates", run_ssm_seq, base).states = false;
  add("F6seq_WithEnteringStates", run_ssm_seq, base);
  add("F6seq_WithEnteringStates_hd3_ng2", run_ssm_seq, ng2);
  add("F6seq_T1_WithEnteringStates", run_ssm_seq, base).T = 1;

  add("F6chunked_cs1", run_ssm_chunked, with_cs(base, 1));
  add("F6chunked_cs2_PartialChunk", run_ssm_chunked, with_cs(base, 2));
  add("F6chunked_cs3_rope05_ds6", run_ssm_chunked, with_cs(r05, 3));
  add("F6chunked_cs2_rope1_ds5", run_ssm_chunked, with_cs(r1, 2));
  add("F6chunked_cs8_ChunkLongerThanT", run_ssm_chunked, with_cs(ng2, 8));
  add("F6chunked_cs5_OneFullChunk", run_ssm_chunked, with_cs(base, 5));
  add("F6chunked_T1", run_ssm_chunked, with_cs(base, 2)).T = 1;
  add("F6chunked_FreshStates_cs2", run_ssm_chunked, with_cs(base, 2)).states = false;
  add("F6chunked_na0_cs2", run_ssm_chunked, with_cs(na0, 2));

  add("F7_Gating_Silu", run_gating, small_cfg(6, 3, 4));
  add("F7_Gating_Norm", run_gating, small_cfg(6, 3, 4, 1, 0.5, true));
  add("F7_Gating_Norm_hd2", run_gating, small_cfg(4, 2, 4, 1, 0.5, true));
  return v;
}

class StageFd : public ::testing::TestWithParam<StageCase> {};

TEST_P(StageFd, BackwardMatchesCentralDifferences) {
  const StageCase& c = GetParam();
  c.cfg.validate();
  c.run(c);
}

INSTANTIATE_TEST_SUITE_P(Reference, StageFd, ::testing::ValuesIn(stage_cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
