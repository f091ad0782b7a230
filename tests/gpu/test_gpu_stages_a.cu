// GPU stages of family A (reduce.cu, norm.cu, split.cu, bcnorm.cu, rope.cu, gating.cu) against
// the float reference, stage by stage (MODEL.md §4, §6, §7, §12).
//
// For each config of kCases, one "world" is built on the host: seeded realistic inputs run
// through the reference forward stages (split → BCNorm → angles → RoPE → α/β/γ → gating) in
// float, plus seeded U(−1, 1) upstream gradients and U(−1, 1) initial weight-gradient buffers
// (so the accumulate contract (+=) is checked). proj carries branch cases on purpose: dt
// logits above the softplus threshold (v > 20), heavy-tail logits at 0 and far below −1/a_floor
// (clamp active). Each test uploads exactly the inputs of one stage, runs the GPU launcher and
// the reference stage on the same inputs, and compares every output:
//   rel_l2 = ‖gpu − ref‖₂ / ‖ref‖₂ ≤ 1e-5   and   max|gpu − ref| / max|ref| ≤ 1e-4
// (float vs float, different summation orders, ulp-level differences of expf/tanhf/sincosf);
// angles θ ∈ [0, 2π) by circular distance ≤ 1e-4. Determinism (§7): the reducing launchers run
// twice on the same inputs give bitwise equal outputs. The launchers reject a short scratch.
// GpuSmem: opt_in_smem (core/smem.cuh), which every launcher of more than 48 KB calls.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "config.hpp"
#include "device.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "params.hpp"
#include "reduce.cuh"
#include "smem.cuh"
#include "stages.cuh"
#include "stages.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::Rng;
using m3::gpu::DeviceArray;
using m3::gpu::Scratch;
using m3::ref::Dims;
using Vec = std::vector<float>;
using Acts = m3::ref::LayerActs<float>;
using Grads = m3::ref::LayerGrads<float>;
using LParams = m3::LayerParams<float>;

constexpr double kRelL2 = 1e-5;
constexpr double kRelMax = 1e-4;
constexpr double kAngleTol = 1e-4;
constexpr double kTwoPi = 6.283185307179586476925286766559;

using Case = StageCase;

// The shared stage cases, plus hd 128 with every dim rotated.
const std::vector<Case> kCases = [] {
  std::vector<Case> c = stage_cases();
  c.push_back({"hd128_ds64_rf1_B1_T300", 128, 128, 64, 1, 1.0, 1, 300});
  return c;
}();

Config make_config(const Case& c, bool outproj_norm) {
  Config cfg;
  cfg.d_model = c.d_model;
  cfg.expand = 2;
  cfg.headdim = c.headdim;
  cfg.d_state = c.d_state;
  cfg.ngroups = c.ngroups;
  cfg.n_layers = 1;
  cfg.rope_fraction = c.rope_fraction;
  cfg.is_outproj_norm = outproj_norm;
  cfg.input_dim = c.d_model;
  cfg.validate();
  return cfg;
}

void fill(Vec& v, Rng& rng, double lo, double hi) {
  for (auto& e : v) e = static_cast<float>(rng.uniform(lo, hi));
}

// Every host tensor a stage of family A reads or writes, from the reference forward in float.
struct World {
  Dims d;
  LParams p, pg0;  // parameters; initial values of the weight-gradient buffers
  Acts a;
  Grads g;
};

World make_world(const Case& c, bool outproj_norm, std::uint64_t seed = 7) {
  const Config cfg = make_config(c, outproj_norm);
  World w;
  w.d = Dims::of(cfg, c.B, c.T, m3::Precision::F32);
  const Dims& d = w.d;
  w.p = m3::make_params<float>(cfg, seed, m3::Init::Perturbed).layers[0];
  w.pg0 = m3::zero_params<float>(cfg).layers[0];
  Rng rng(seed * 1000 + 17);
  for (Vec* v : {&w.pg0.norm_weight, &w.pg0.dt_bias, &w.pg0.b_norm_weight, &w.pg0.c_norm_weight,
                 &w.pg0.b_bias, &w.pg0.c_bias, &w.pg0.norm_gate_weight})
    fill(*v, rng, -1.0, 1.0);
  w.a.allocate(d, m3::ScanMode::Sequential);
  w.g.allocate(d, m3::ScanMode::Sequential);
  Acts& a = w.a;
  for (auto& e : a.proj) e = static_cast<float>(rng.normalish());
  const Idx ddt = 2 * d.di + 2 * d.ng * d.ds, dda = ddt + d.nh;
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx k = r + 3 * h;
      if (k % 17 == 0) a.proj[r * d.ip + ddt + h] = 30.0f;      // softplus: v > 20 branch
      if (k % 5 == 0) a.proj[r * d.ip + dda + h] = -2.0e4f;     // heavy-tail clamp active
      if (k % 11 == 0) a.proj[r * d.ip + dda + h] = 0.0f;       // φ'(0) = 1
    }
  m3::ref::split_forward(d, w.p, a);
  m3::ref::bcnorm_forward(d, w.p, a);
  fill(a.angle_in, rng, 0.0, kTwoPi);
  m3::ref::angle_forward(d, a);
  m3::ref::rope_forward(d, a);
  m3::ref::abg_forward(d, a);
  for (auto& e : a.y) e = static_cast<float>(rng.normalish());
  m3::ref::gating_forward(d, w.p, a);
  Grads& g = w.g;
  for (Vec* v : {&g.d_gated, &g.d_k, &g.d_q, &g.d_alpha, &g.d_beta, &g.d_gamma,
                 &g.d_angle_cumsum, &g.d_angle_out, &g.d_adt_total, &g.d_dt_direct,
                 &g.d_dt_angle, &g.d_trap_sig, &g.d_b_pre_rope, &g.d_c_pre_rope, &g.d_z, &g.d_x,
                 &g.d_b_raw, &g.d_c_raw, &g.d_dd_dt, &g.d_dd_a, &g.d_trap_raw, &g.d_angles_raw})
    fill(*v, rng, -1.0, 1.0);
  return w;
}

// ---- device helpers ----------------------------------------------------------------------
class Stream {
 public:
  Stream() { M3_CUDA_CHECK(cudaStreamCreate(&s_)); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

DeviceArray<float> up(const Vec& v, cudaStream_t s) {
  DeviceArray<float> a(static_cast<Idx>(v.size()));
  a.upload(v.data(), s);
  return a;
}

Vec down(const DeviceArray<float>& a, cudaStream_t s) {
  Vec v(static_cast<size_t>(a.size()));
  a.download(v.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

struct ScratchBuf {
  DeviceArray<float> buf;
  explicit ScratchBuf(const Dims& d) : buf(m3::gpu::scratch_floats(d)) {}
  Scratch get() { return Scratch{buf.data(), buf.size()}; }
};

// ---- comparisons -------------------------------------------------------------------------
void expect_close(const std::string& what, const Vec& got, const Vec& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double d2 = 0, r2 = 0, dmax = 0, rmax = 0;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "] = " << got[i];
    const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
    d2 += diff * diff;
    r2 += static_cast<double>(want[i]) * want[i];
    if (diff > dmax) dmax = diff, worst = i;
    rmax = std::max(rmax, std::abs(static_cast<double>(want[i])));
  }
  const double rel_l2 = r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2);
  const double rel_max = rmax > 0 ? dmax / rmax : dmax;
  EXPECT_LE(rel_l2, kRelL2) << what << ": rel_l2, worst at " << worst;
  EXPECT_LE(rel_max, kRelMax) << what << ": max_abs/max, worst at [" << worst << "] gpu "
                              << (got.empty() ? 0.f : got[worst]) << " ref "
                              << (want.empty() ? 0.f : want[worst]);
}

void expect_close_angles(const std::string& what, const Vec& got, const Vec& want,
                         double tol = kAngleTol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i] >= 0.0f && got[i] < static_cast<float>(kTwoPi) + 1e-6f)
        << what << "[" << i << "] = " << got[i] << " outside [0, 2π)";
    const double dist = std::abs(std::remainder(static_cast<double>(got[i]) - want[i], kTwoPi));
    worst = std::max(worst, dist);
  }
  EXPECT_LE(worst, tol) << what << ": max circular distance";
}

void expect_bitwise(const std::string& what, const Vec& x, const Vec& y) {
  ASSERT_EQ(x.size(), y.size()) << what;
  EXPECT_EQ(0, x.empty() ? 0 : std::memcmp(x.data(), y.data(), x.size() * sizeof(float)))
      << what << ": two runs differ";
}

class GpuStagesA : public ::testing::TestWithParam<Case> {};

// ---- tests -------------------------------------------------------------------------------
TEST_P(GpuStagesA, RmsNormMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  Rng rng(99);
  Vec u(static_cast<size_t>(d.BT * d.dm)), gy(u.size());
  for (auto& e : u) e = static_cast<float>(3.0 * rng.normalish());
  fill(gy, rng, -1.0, 1.0);
  Vec y(u.size()), rms(static_cast<size_t>(d.BT)), dx(u.size()), dw = w.pg0.norm_weight;
  m3::ref::rmsnorm_forward(d.BT, d.dm, u.data(), w.p.norm_weight.data(), y.data(), rms.data());
  m3::ref::rmsnorm_backward(d.BT, d.dm, u.data(), w.p.norm_weight.data(), rms.data(), gy.data(),
                            dx.data(), dw.data());

  Stream s;
  ScratchBuf sc(d);
  auto du = up(u, s), dwt = up(w.p.norm_weight, s), dgy = up(gy, s), ddw = up(w.pg0.norm_weight, s);
  DeviceArray<float> dy(d.BT * d.dm), drms(d.BT), ddx(d.BT * d.dm);
  m3::gpu::rmsnorm_forward<float>(s, d.BT, d.dm, du.data(), dwt.data(), dy.data(), drms.data());
  expect_close("y", down(dy, s), y);
  expect_close("rms", down(drms, s), rms);
  // backward from the reference rms (the stage's own input)
  auto drms_ref = up(rms, s);
  m3::gpu::rmsnorm_backward<float>(s, d.BT, d.dm, du.data(), dwt.data(), drms_ref.data(),
                                   dgy.data(), ddx.data(), ddw.data(), sc.get());
  expect_close("dx", down(ddx, s), dx);
  expect_close("dw (accumulated)", down(ddw, s), dw);
}

TEST_P(GpuStagesA, SplitForwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  Stream s;
  auto proj = up(w.a.proj, s), dt_bias = up(w.p.dt_bias, s);
  DeviceArray<float> z(d.BT * d.di), x(d.BT * d.di), b_raw(d.BT * d.ng * d.ds),
      c_raw(d.BT * d.ng * d.ds), dd_dt(d.BT * d.nh), dd_a(d.BT * d.nh), trap_raw(d.BT * d.nh),
      ang(d.BT * d.na), dt(d.BT * d.nh), a_val(d.BT * d.nh), trap(d.BT * d.nh);
  m3::gpu::SplitFwd<float> p{proj.data(),   dt_bias.data(), z.data(),     x.data(),
                             b_raw.data(),  c_raw.data(),   dd_dt.data(), dd_a.data(),
                             trap_raw.data(), ang.data(),   dt.data(),    a_val.data(),
                             trap.data()};
  m3::gpu::split_forward<float>(s, d, p);
  expect_close("z", down(z, s), w.a.z);
  expect_close("x", down(x, s), w.a.x);
  expect_close("b_raw", down(b_raw, s), w.a.b_raw);
  expect_close("c_raw", down(c_raw, s), w.a.c_raw);
  expect_close("dd_dt_raw", down(dd_dt, s), w.a.dd_dt_raw);
  expect_close("dd_a_raw", down(dd_a, s), w.a.dd_a_raw);
  expect_close("trap_raw", down(trap_raw, s), w.a.trap_raw);
  expect_close("angles_raw", down(ang, s), w.a.angles_raw);
  expect_close("dt", down(dt, s), w.a.dt);
  expect_close("a_val", down(a_val, s), w.a.a_val);
  expect_close("trap", down(trap, s), w.a.trap);
}

TEST_P(GpuStagesA, AbgForwardAndBackwardMatchReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  m3::ref::abg_backward(d, w.a, w.g);
  Stream s;
  const Idx n = d.BT * d.nh;
  auto a_val = up(w.a.a_val, s), dt = up(w.a.dt, s), trap = up(w.a.trap, s);
  DeviceArray<float> alpha(n), beta(n), gamma(n);
  m3::gpu::abg_forward(s, d, a_val.data(), dt.data(), trap.data(), alpha.data(), beta.data(),
                       gamma.data());
  expect_close("alpha", down(alpha, s), w.a.alpha);
  expect_close("beta", down(beta, s), w.a.beta);
  expect_close("gamma", down(gamma, s), w.a.gamma);
  auto r_alpha = up(w.a.alpha, s), r_beta = up(w.a.beta, s), da = up(w.g.d_alpha, s),
       db = up(w.g.d_beta, s), dg = up(w.g.d_gamma, s);
  DeviceArray<float> d_adt(n), d_dt(n), d_trap(n);
  m3::gpu::AbgBwd p{r_alpha.data(), r_beta.data(), dt.data(),    trap.data(), da.data(),
                    db.data(),      dg.data(),     d_adt.data(), d_dt.data(), d_trap.data()};
  m3::gpu::abg_backward(s, d, p);
  expect_close("d_adt_total", down(d_adt, s), w.g.d_adt_total);
  expect_close("d_dt_direct", down(d_dt, s), w.g.d_dt_direct);
  expect_close("d_trap_sig", down(d_trap, s), w.g.d_trap_sig);
}

TEST_P(GpuStagesA, ActivationsBackwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  LParams pg = w.pg0;
  m3::ref::activations_backward(d, w.p, w.a, w.g, pg);
  Stream s;
  ScratchBuf sc(d);
  const Idx n = d.BT * d.nh;
  auto dd_dt = up(w.a.dd_dt_raw, s), dd_a = up(w.a.dd_a_raw, s), dt_bias = up(w.p.dt_bias, s),
       dt = up(w.a.dt, s), a_val = up(w.a.a_val, s), trap = up(w.a.trap, s),
       d_adt = up(w.g.d_adt_total, s), d_dt = up(w.g.d_dt_direct, s),
       d_ang = up(w.g.d_dt_angle, s), d_trap = up(w.g.d_trap_sig, s),
       d_bias = up(w.pg0.dt_bias, s);
  DeviceArray<float> o_dt(n), o_a(n), o_trap(n);
  m3::gpu::ActBwd p{dd_dt.data(), dd_a.data(),  dt_bias.data(), dt.data(),   a_val.data(),
                    trap.data(),  d_adt.data(), d_dt.data(),    d_ang.data(), d_trap.data(),
                    o_dt.data(),  o_a.data(),   o_trap.data(),  d_bias.data(), d.a_floor};
  m3::gpu::activations_backward(s, d, p, sc.get());
  expect_close("d_dd_dt", down(o_dt, s), w.g.d_dd_dt);
  expect_close("d_dd_a", down(o_a, s), w.g.d_dd_a);
  expect_close("d_trap_raw", down(o_trap, s), w.g.d_trap_raw);
  expect_close("d dt_bias (accumulated)", down(d_bias, s), pg.dt_bias);
}

TEST_P(GpuStagesA, SplitBackwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  m3::ref::split_backward(d, w.g);
  Stream s;
  auto dz = up(w.g.d_z, s), dx = up(w.g.d_x, s), db = up(w.g.d_b_raw, s), dc = up(w.g.d_c_raw, s),
       ddt = up(w.g.d_dd_dt, s), dda = up(w.g.d_dd_a, s), dtr = up(w.g.d_trap_raw, s),
       dan = up(w.g.d_angles_raw, s);
  DeviceArray<float> d_proj(d.BT * d.ip);
  m3::gpu::SplitBwd<float> p{dz.data(),  dx.data(),  db.data(),  dc.data(),    ddt.data(),
                             dda.data(), dtr.data(), dan.data(), d_proj.data()};
  m3::gpu::split_backward<float>(s, d, p);
  expect_close("d_proj", down(d_proj, s), w.g.d_proj);
}

TEST_P(GpuStagesA, BcnormForwardAndBackwardMatchReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  LParams pg = w.pg0;
  m3::ref::bcnorm_backward(d, w.p, w.a, w.g, pg);
  Stream s;
  ScratchBuf sc(d);
  const Idx ngds = d.BT * d.ng * d.ds, nhds = d.BT * d.nh * d.ds;
  auto b_raw = up(w.a.b_raw, s), c_raw = up(w.a.c_raw, s), bw = up(w.p.b_norm_weight, s),
       cw = up(w.p.c_norm_weight, s), bb = up(w.p.b_bias, s), cb = up(w.p.c_bias, s);
  DeviceArray<float> b_normed(ngds), c_normed(ngds), b_biased(nhds), c_biased(nhds),
      b_rms(d.BT * d.ng), c_rms(d.BT * d.ng);
  m3::gpu::BcnormFwd<float> f{b_raw.data(),    c_raw.data(),    bw.data(),       cw.data(),
                              bb.data(),       cb.data(),       b_normed.data(), c_normed.data(),
                              b_biased.data(), c_biased.data(), b_rms.data(),    c_rms.data()};
  m3::gpu::bcnorm_forward<float>(s, d, f);
  expect_close("b_normed", down(b_normed, s), w.a.b_normed);
  expect_close("c_normed", down(c_normed, s), w.a.c_normed);
  expect_close("b_biased", down(b_biased, s), w.a.b_biased);
  expect_close("c_biased", down(c_biased, s), w.a.c_biased);
  expect_close("b_rms", down(b_rms, s), w.a.b_rms);
  expect_close("c_rms", down(c_rms, s), w.a.c_rms);

  auto r_brms = up(w.a.b_rms, s), r_crms = up(w.a.c_rms, s), dbp = up(w.g.d_b_pre_rope, s),
       dcp = up(w.g.d_c_pre_rope, s), dbw = up(w.pg0.b_norm_weight, s),
       dcw = up(w.pg0.c_norm_weight, s), dbb = up(w.pg0.b_bias, s), dcb = up(w.pg0.c_bias, s);
  DeviceArray<float> dbn(ngds), dcn(ngds), dbr(ngds), dcr(ngds);
  m3::gpu::BcnormBwd<float> b{b_raw.data(),  c_raw.data(),  bw.data(),    cw.data(),
                              r_brms.data(), r_crms.data(), dbp.data(),   dcp.data(),
                              dbn.data(),    dcn.data(),    dbr.data(),   dcr.data(),
                              dbw.data(),    dcw.data(),    dbb.data(),   dcb.data()};
  m3::gpu::bcnorm_backward<float>(s, d, b, sc.get());
  expect_close("d_b_normed", down(dbn, s), w.g.d_b_normed);
  expect_close("d_c_normed", down(dcn, s), w.g.d_c_normed);
  expect_close("d_b_raw", down(dbr, s), w.g.d_b_raw);
  expect_close("d_c_raw", down(dcr, s), w.g.d_c_raw);
  expect_close("d b_norm_weight (accumulated)", down(dbw, s), pg.b_norm_weight);
  expect_close("d c_norm_weight (accumulated)", down(dcw, s), pg.c_norm_weight);
  expect_close("d b_bias (accumulated)", down(dbb, s), pg.b_bias);
  expect_close("d c_bias (accumulated)", down(dcb, s), pg.c_bias);
}

TEST_P(GpuStagesA, AngleForwardMatchesReferenceByCircularDistance) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  Stream s;
  auto raw = up(w.a.angles_raw, s), dt = up(w.a.dt, s), ain = up(w.a.angle_in, s);
  DeviceArray<float> cum(d.BT * d.nh * d.na), aout(d.B * d.nh * d.na);
  ScratchBuf sc(d);
  m3::gpu::angle_forward(s, d, raw.data(), dt.data(), ain.data(), cum.data(), aout.data(),
                         sc.get());
  expect_close_angles("angle_cumsum", down(cum, s), w.a.angle_cumsum);
  expect_close_angles("angle_out", down(aout, s), w.a.angle_out);
}

TEST_P(GpuStagesA, RopeForwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  Stream s;
  auto th = up(w.a.angle_cumsum, s), bb = up(w.a.b_biased, s), cb = up(w.a.c_biased, s);
  DeviceArray<float> k(d.BT * d.nh * d.ds), q(d.BT * d.nh * d.ds);
  m3::gpu::rope_forward<float>(s, d, th.data(), bb.data(), cb.data(), k.data(), q.data());
  expect_close("k", down(k, s), w.a.k);
  expect_close("q", down(q, s), w.a.q);
}

TEST_P(GpuStagesA, RopeBackwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  m3::ref::rope_backward(d, w.a, w.g);
  Stream s;
  const Idx n = d.BT * d.nh * d.ds;
  auto th = up(w.a.angle_cumsum, s), dk = up(w.g.d_k, s), dq = up(w.g.d_q, s), k = up(w.a.k, s),
       q = up(w.a.q, s);
  DeviceArray<float> db(n), dc(n), dth(d.BT * d.nh * d.na);
  m3::gpu::RopeBwd<float> p{th.data(), dk.data(), dq.data(),  k.data(), q.data(),
                            db.data(), dc.data(), dth.data(), nullptr,  nullptr, nullptr};
  m3::gpu::rope_backward<float>(s, d, p);
  expect_close("d_b_pre_rope", down(db, s), w.g.d_b_pre_rope);
  expect_close("d_c_pre_rope", down(dc, s), w.g.d_c_pre_rope);
  expect_close("d_angle_cumsum", down(dth, s), w.g.d_angle_cumsum);
}

// The chunked path's use (reference ssm_chunked.cpp step 2): path 1 = (scale·dK_mid, k),
// path 2 = (dQ_mid, q), then d_b_pre_rope += w·c_biased, d_c_pre_rope += w·b_biased with
// w = dQK_dot·γ per (r, h).
TEST_P(GpuStagesA, RopeBackwardWithQkExtraMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  Rng rng(5);
  Vec wqk(static_cast<size_t>(d.BT * d.nh));
  fill(wqk, rng, -1.0, 1.0);
  Vec db(w.g.d_b_pre_rope.size()), dc(db.size()), dth(w.g.d_angle_cumsum.size(), 0.0f);
  m3::ref::rope_backward_into(d, w.a.angle_cumsum.data(), w.g.d_k.data(), w.a.k.data(), db.data(),
                              dth.data());
  m3::ref::rope_backward_into(d, w.a.angle_cumsum.data(), w.g.d_q.data(), w.a.q.data(), dc.data(),
                              dth.data());
  for (Idx i = 0; i < d.BT * d.nh; ++i)
    for (Idx n = 0; n < d.ds; ++n) {
      db[i * d.ds + n] += wqk[i] * w.a.c_biased[i * d.ds + n];
      dc[i * d.ds + n] += wqk[i] * w.a.b_biased[i * d.ds + n];
    }
  Stream s;
  const Idx n = d.BT * d.nh * d.ds;
  auto th = up(w.a.angle_cumsum, s), dk = up(w.g.d_k, s), dq = up(w.g.d_q, s), k = up(w.a.k, s),
       q = up(w.a.q, s), ew = up(wqk, s), ev1 = up(w.a.c_biased, s), ev2 = up(w.a.b_biased, s);
  DeviceArray<float> gdb(n), gdc(n), gdth(d.BT * d.nh * d.na);
  m3::gpu::RopeBwd<float> p{th.data(),  dk.data(),  dq.data(),   k.data(),  q.data(),
                            gdb.data(), gdc.data(), gdth.data(), ew.data(), ev1.data(),
                            ev2.data()};
  m3::gpu::rope_backward<float>(s, d, p);
  expect_close("d_b_pre_rope", down(gdb, s), db);
  expect_close("d_c_pre_rope", down(gdc, s), dc);
  expect_close("d_angle_cumsum", down(gdth, s), dth);
}

TEST_P(GpuStagesA, AngleBackwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), false);
  const Dims& d = w.d;
  m3::ref::angle_backward(d, w.a, w.g);
  Stream s;
  ScratchBuf sc(d);
  auto raw = up(w.a.angles_raw, s), dt = up(w.a.dt, s), dcs = up(w.g.d_angle_cumsum, s),
       dout = up(w.g.d_angle_out, s);
  DeviceArray<float> d_raw(d.BT * d.na), d_dt(d.BT * d.nh), d_in(d.B * d.nh * d.na);
  m3::gpu::AngleBwd p{raw.data(),   dt.data(),   dcs.data(), dout.data(),
                      d_raw.data(), d_dt.data(), d_in.data()};
  m3::gpu::angle_backward(s, d, p, sc.get());
  expect_close("d_angles_raw", down(d_raw, s), w.g.d_angles_raw);
  expect_close("d_dt_angle", down(d_dt, s), w.g.d_dt_angle);
  expect_close("d_angle_in", down(d_in, s), w.g.d_angle_in);
}

TEST_P(GpuStagesA, GatingMatchesReferenceBothVariants) {
  M3_SKIP_WITHOUT_GPU();
  for (bool norm : {false, true}) {
    SCOPED_TRACE(norm ? "is_outproj_norm" : "silu gate");
    World w = make_world(GetParam(), norm);
    const Dims& d = w.d;
    LParams pg = w.pg0;
    m3::ref::gating_backward(d, w.p, w.a, w.g, pg);
    Stream s;
    ScratchBuf sc(d);
    const Idx n = d.BT * d.di;
    auto y = up(w.a.y, s), z = up(w.a.z, s), ngw = up(w.p.norm_gate_weight, s);
    DeviceArray<float> gated(n), rstd(norm ? d.BT * d.nh : 0);
    m3::gpu::gating_forward<float>(s, d, y.data(), z.data(), ngw.data(), gated.data(),
                                   norm ? rstd.data() : nullptr);
    expect_close("gated", down(gated, s), w.a.gated);
    if (norm) expect_close("gated_rms_vals", down(rstd, s), w.a.gated_rms_vals);

    auto r_rstd = up(w.a.gated_rms_vals, s), dg = up(w.g.d_gated, s),
         dngw = up(w.pg0.norm_gate_weight, s);
    DeviceArray<float> dy(n), dz(n);
    m3::gpu::GatingBwd<float> p{y.data(),  z.data(),  dg.data(),   ngw.data(),
                                norm ? r_rstd.data() : nullptr,   dy.data(),
                                dz.data(), dngw.data()};
    m3::gpu::gating_backward<float>(s, d, p, sc.get());
    expect_close("d_y", down(dy, s), w.g.d_y);
    expect_close("d_z", down(dz, s), w.g.d_z);
    expect_close("d norm_gate_weight (accumulated / untouched)", down(dngw, s),
                 pg.norm_gate_weight);
  }
}

// Every reducing launcher twice on the same inputs (accumulators reset to the same start):
// identical bits (MODEL.md §7).
TEST_P(GpuStagesA, ReducingStagesAreBitwiseDeterministic) {
  M3_SKIP_WITHOUT_GPU();
  World w = make_world(GetParam(), true);
  const Dims& d = w.d;
  Stream s;
  ScratchBuf sc(d);
  const Idx nh = d.BT * d.nh, ngds = d.BT * d.ng * d.ds;
  auto run = [&]() {
    std::vector<Vec> out;
    {  // RMSNorm over [BT, di] rows (wide rows) with the gate weight as w
      auto u = up(w.a.y, s), wt = up(w.p.norm_gate_weight, s), g = up(w.g.d_gated, s),
           dw = up(w.pg0.norm_gate_weight, s);
      DeviceArray<float> y(d.BT * d.di), rms(d.BT), dx(d.BT * d.di);
      m3::gpu::rmsnorm_forward<float>(s, d.BT, d.di, u.data(), wt.data(), y.data(), rms.data());
      m3::gpu::rmsnorm_backward<float>(s, d.BT, d.di, u.data(), wt.data(), rms.data(), g.data(),
                                       dx.data(), dw.data(), sc.get());
      for (auto* a : {&y, &rms, &dx, &dw}) out.push_back(down(*a, s));
    }
    {
      auto dd_dt = up(w.a.dd_dt_raw, s), dd_a = up(w.a.dd_a_raw, s), bias = up(w.p.dt_bias, s),
           dt = up(w.a.dt, s), a_val = up(w.a.a_val, s), trap = up(w.a.trap, s),
           d_adt = up(w.g.d_adt_total, s), d_dt = up(w.g.d_dt_direct, s),
           d_ang = up(w.g.d_dt_angle, s), d_trap = up(w.g.d_trap_sig, s),
           d_bias = up(w.pg0.dt_bias, s);
      DeviceArray<float> o1(nh), o2(nh), o3(nh);
      m3::gpu::ActBwd p{dd_dt.data(), dd_a.data(),  bias.data(), dt.data(),    a_val.data(),
                        trap.data(),  d_adt.data(), d_dt.data(), d_ang.data(), d_trap.data(),
                        o1.data(),    o2.data(),    o3.data(),   d_bias.data(), d.a_floor};
      m3::gpu::activations_backward(s, d, p, sc.get());
      for (auto* a : {&o1, &o2, &o3, &d_bias}) out.push_back(down(*a, s));
    }
    {
      auto b_raw = up(w.a.b_raw, s), c_raw = up(w.a.c_raw, s), bw = up(w.p.b_norm_weight, s),
           cw = up(w.p.c_norm_weight, s), brms = up(w.a.b_rms, s), crms = up(w.a.c_rms, s),
           dbp = up(w.g.d_b_pre_rope, s), dcp = up(w.g.d_c_pre_rope, s),
           dbw = up(w.pg0.b_norm_weight, s), dcw = up(w.pg0.c_norm_weight, s),
           dbb = up(w.pg0.b_bias, s), dcb = up(w.pg0.c_bias, s);
      DeviceArray<float> dbn(ngds), dcn(ngds), dbr(ngds), dcr(ngds);
      m3::gpu::BcnormBwd<float> p{b_raw.data(), c_raw.data(), bw.data(),  cw.data(),
                                  brms.data(),  crms.data(),  dbp.data(), dcp.data(),
                                  dbn.data(),   dcn.data(),   dbr.data(), dcr.data(),
                                  dbw.data(),   dcw.data(),   dbb.data(), dcb.data()};
      m3::gpu::bcnorm_backward<float>(s, d, p, sc.get());
      for (auto* a : {&dbn, &dcn, &dbr, &dcr, &dbw, &dcw, &dbb, &dcb}) out.push_back(down(*a, s));
    }
    {
      auto raw = up(w.a.angles_raw, s), dt = up(w.a.dt, s), ain = up(w.a.angle_in, s),
           dcs = up(w.g.d_angle_cumsum, s), dout = up(w.g.d_angle_out, s);
      DeviceArray<float> cum(d.BT * d.nh * d.na), aout(d.B * d.nh * d.na), d_raw(d.BT * d.na),
          d_dt(nh), d_in(d.B * d.nh * d.na);
      m3::gpu::angle_forward(s, d, raw.data(), dt.data(), ain.data(), cum.data(), aout.data(),
                             sc.get());
      m3::gpu::AngleBwd p{raw.data(),   dt.data(),   dcs.data(), dout.data(),
                          d_raw.data(), d_dt.data(), d_in.data()};
      m3::gpu::angle_backward(s, d, p, sc.get());
      for (auto* a : {&cum, &aout, &d_raw, &d_dt, &d_in}) out.push_back(down(*a, s));
    }
    {
      auto y = up(w.a.y, s), z = up(w.a.z, s), ngw = up(w.p.norm_gate_weight, s),
           dg = up(w.g.d_gated, s), dngw = up(w.pg0.norm_gate_weight, s);
      DeviceArray<float> gated(d.BT * d.di), rstd(nh), dy(d.BT * d.di), dz(d.BT * d.di);
      m3::gpu::gating_forward<float>(s, d, y.data(), z.data(), ngw.data(), gated.data(),
                                     rstd.data());
      m3::gpu::GatingBwd<float> p{y.data(),  z.data(),  dg.data(),   ngw.data(),
                                  rstd.data(), dy.data(), dz.data(), dngw.data()};
      m3::gpu::gating_backward<float>(s, d, p, sc.get());
      for (auto* a : {&gated, &rstd, &dy, &dz, &dngw}) out.push_back(down(*a, s));
    }
    {
      auto in = up(w.g.d_b_pre_rope, s), acc = up(w.pg0.b_bias, s);
      m3::gpu::colsum(s, d.BT, d.nh * d.ds, in.data(), acc.data(), true, sc.get());
      out.push_back(down(acc, s));
    }
    return out;
  };
  const std::vector<Vec> first = run(), second = run();
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) expect_bitwise("output " + std::to_string(i), first[i], second[i]);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Configs, GpuStagesA, ::testing::ValuesIn(kCases), case_name);

// ---- F5 / B5a over lengths (rope.cu: tiles of 32 segments × 8 steps, carried across tiles) --
// Shapes around the tiling: T = 1, T < 32, a last segment of one step (33, 257, 513, 4097),
// exactly one tile (256), several tiles (300, 513, 4097 = 16 tiles + 1 step); nh·na not a
// multiple of the 8-wide j groups (1, 15) and wider rows (64). Increments up to 2.5π reach
// every branch of the wrap; dt_max 40 (up to 40π) makes the general branch the common one.
struct AngleCase {
  const char* name;
  Idx B, T, nh, na;
  double dt_max;
};

const AngleCase kAngleCases[] = {
    {"B1_T1_nh1_na1", 1, 1, 1, 1, 2.5},
    {"B2_T1_nh3_na5", 2, 1, 3, 5, 2.5},
    {"B1_T31_nh2_na4", 1, 31, 2, 4, 2.5},
    {"B2_T33_nh3_na5", 2, 33, 3, 5, 2.5},
    {"B1_T256_nh2_na4", 1, 256, 2, 4, 2.5},
    {"B2_T257_nh3_na5", 2, 257, 3, 5, 2.5},
    {"B2_T300_nh4_na16_dt40", 2, 300, 4, 16, 40.0},
    {"B3_T513_nh5_na3", 3, 513, 5, 3, 2.5},
    {"B1_T4097_nh2_na32", 1, 4097, 2, 32, 2.5},
    {"B2_T300_nh32_na32", 2, 300, 32, 32, 2.5},  // the official widths: angle_grads_kernel<32, 32>
};

Dims angle_dims(const AngleCase& c) {
  Dims d{};
  d.B = c.B;
  d.T = c.T;
  d.BT = c.B * c.T;
  d.nh = c.nh;
  d.na = c.na;
  d.ds = 2 * c.na;
  return d;
}

// Entering angles: a third in [0, 2π), a third near 1000, a third near −50 (outside the range).
Vec angle_in_values(Idx n, Rng& rng) {
  Vec v(static_cast<size_t>(n));
  for (Idx i = 0; i < n; ++i)
    v[i] = static_cast<float>(i % 3 == 0 ? rng.uniform(0.0, kTwoPi)
                              : i % 3 == 1 ? 1000.0 + rng.uniform(0.0, 1.0)
                                           : -50.0 - rng.uniform(0.0, 1.0));
  return v;
}

class GpuAngles : public ::testing::TestWithParam<AngleCase> {};

// angles_raw ∈ {−20, 0, 20}: tanh is exactly −1, 0, 1 in float on host and device, so the f32
// increments are bit-identical to the reference's and θ agrees with its serial double
// recurrence up to double rounding: circular distance ≤ 1e-6 (one f32 ulp of θ near 2π is
// 4.8e-7), with and without angle_in, at every step and for angle_out.
TEST_P(GpuAngles, ForwardMatchesSerialReferenceAtEveryStep) {
  M3_SKIP_WITHOUT_GPU();
  const AngleCase& c = GetParam();
  const Dims d = angle_dims(c);
  Rng rng(static_cast<std::uint64_t>(c.T * 131 + c.nh * 7 + c.na));
  Acts a;
  a.angles_raw.resize(static_cast<size_t>(d.BT * d.na));
  for (auto& e : a.angles_raw) {
    const double u = rng.uniform(0.0, 1.0);
    e = u < 0.45 ? 20.0f : u < 0.8 ? -20.0f : 0.0f;
  }
  a.dt.resize(static_cast<size_t>(d.BT * d.nh));
  fill(a.dt, rng, 0.0, c.dt_max);
  a.angle_cumsum.resize(static_cast<size_t>(d.BT * d.nh * d.na));
  a.angle_out.resize(static_cast<size_t>(d.B * d.nh * d.na));
  Stream s;
  auto raw = up(a.angles_raw, s), dt = up(a.dt, s);
  DeviceArray<float> tau(m3::gpu::angle_forward_scratch_floats(d));  // τ = tanh(angles_raw)
  for (bool with_in : {true, false}) {
    SCOPED_TRACE(with_in ? "angle_in set" : "angle_in null (zeros)");
    a.angle_in = with_in ? angle_in_values(d.B * d.nh * d.na, rng)
                         : Vec(static_cast<size_t>(d.B * d.nh * d.na), 0.0f);
    m3::ref::angle_forward(d, a);
    auto ain = up(a.angle_in, s);
    DeviceArray<float> cum(d.BT * d.nh * d.na), aout(d.B * d.nh * d.na);
    m3::gpu::angle_forward(s, d, raw.data(), dt.data(), with_in ? ain.data() : nullptr,
                           cum.data(), aout.data(), Scratch{tau.data(), tau.size()});
    expect_close_angles("angle_cumsum", down(cum, s), a.angle_cumsum, 1e-6);
    expect_close_angles("angle_out", down(aout, s), a.angle_out, 1e-6);
  }
}

// Θ̄ and the two reductions against the double reference on the same f32 inputs, with and
// without d_angle_out; d_angle_in = Θ̄_0. Bitwise equal on a second run.
TEST_P(GpuAngles, BackwardMatchesDoubleReference) {
  M3_SKIP_WITHOUT_GPU();
  const AngleCase& c = GetParam();
  const Dims d = angle_dims(c);
  Rng rng(static_cast<std::uint64_t>(c.T * 17 + c.nh * 3 + c.na));
  const size_t nraw = static_cast<size_t>(d.BT * d.na), ndt = static_cast<size_t>(d.BT * d.nh),
               nth = static_cast<size_t>(d.BT * d.nh * d.na),
               nst = static_cast<size_t>(d.B * d.nh * d.na);
  Vec raw(nraw), dt(ndt), dth(nth), dout(nst);
  fill(raw, rng, -3.0, 3.0);
  fill(dt, rng, 0.0, c.dt_max);
  fill(dth, rng, -1.0, 1.0);
  fill(dout, rng, -1.0, 1.0);
  Stream s;
  // Θ̄ and τ, all that angle_backward needs
  DeviceArray<float> scratch(m3::gpu::angle_backward_scratch_floats(d));
  auto draw = up(raw, s), ddt = up(dt, s), ddth = up(dth, s), ddout = up(dout, s);
  for (bool with_out : {true, false}) {
    SCOPED_TRACE(with_out ? "d_angle_out set" : "d_angle_out null (zeros)");
    m3::ref::LayerActs<double> a;
    m3::ref::LayerGrads<double> g;
    a.angles_raw.assign(raw.begin(), raw.end());
    a.dt.assign(dt.begin(), dt.end());
    g.d_angle_cumsum.assign(dth.begin(), dth.end());
    g.d_angle_out.assign(nst, 0.0);
    if (with_out) g.d_angle_out.assign(dout.begin(), dout.end());
    g.d_angles_raw.resize(nraw);
    g.d_dt_angle.resize(ndt);
    g.d_angle_in.resize(nst);
    m3::ref::angle_backward(d, a, g);
    auto run = [&]() {
      DeviceArray<float> d_raw(d.BT * d.na), d_dt(d.BT * d.nh), d_in(d.B * d.nh * d.na);
      m3::gpu::AngleBwd p{draw.data(),  ddt.data(),  ddth.data(),
                          with_out ? ddout.data() : nullptr,
                          d_raw.data(), d_dt.data(), d_in.data()};
      m3::gpu::angle_backward(s, d, p, Scratch{scratch.data(), scratch.size()});
      return std::vector<Vec>{down(d_raw, s), down(d_dt, s), down(d_in, s)};
    };
    const std::vector<Vec> first = run(), second = run();
    const char* names[] = {"d_angles_raw", "d_dt_angle", "d_angle_in"};
    const std::vector<double>* want[] = {&g.d_angles_raw, &g.d_dt_angle, &g.d_angle_in};
    for (int i = 0; i < 3; ++i) {
      expect_close(names[i], first[i], Vec(want[i]->begin(), want[i]->end()));
      expect_bitwise(names[i], first[i], second[i]);
    }
  }
}

// B5a at the official widths (na = nh = 32) takes angle_reverse_cumsum_kernel<32, 32> (the row
// stride an immediate) and angle_grads_kernel<32, 32> (every loop unrolled, the terms' loads
// first); they give the generic instantiations' bits, every output (d_angle_in is Θ̄_0),
// with Θ̄ and τ read 4 values per access (vec4) and one at a time (the scratch 4 bytes off its
// 16-byte alignment).
TEST(GpuAnglesFull, GradsGiveTheBitsOfTheGenericInstantiation) {
  M3_SKIP_WITHOUT_GPU();
  const Dims d = angle_dims({"full", 2, 300, 32, 32, 2.5});
  Rng rng(4242);
  Vec raw(static_cast<size_t>(d.BT * d.na)), dt(static_cast<size_t>(d.BT * d.nh)),
      dth(static_cast<size_t>(d.BT * d.nh * d.na)), dout(static_cast<size_t>(d.B * d.nh * d.na));
  fill(raw, rng, -3.0, 3.0);
  fill(dt, rng, 0.0, 2.5);
  fill(dth, rng, -1.0, 1.0);
  fill(dout, rng, -1.0, 1.0);
  Stream s;
  struct Restore {
    ~Restore() { m3::gpu::set_angle_grads_full_for_testing(true); }
  } restore;
  const Idx need = m3::gpu::angle_backward_scratch_floats(d);
  DeviceArray<float> scratch(need + 1);
  auto draw = up(raw, s), ddt = up(dt, s), ddth = up(dth, s), ddout = up(dout, s);
  for (const Idx off : {Idx(0), Idx(1)}) {
    SCOPED_TRACE(off ? "Θ̄ and τ one value at a time" : "Θ̄ and τ 4 values per access");
    auto run = [&](bool full) {
      m3::gpu::set_angle_grads_full_for_testing(full);
      DeviceArray<float> d_raw(d.BT * d.na), d_dt(d.BT * d.nh), d_in(d.B * d.nh * d.na);
      m3::gpu::AngleBwd p{draw.data(),  ddt.data(),  ddth.data(), ddout.data(),
                          d_raw.data(), d_dt.data(), d_in.data()};
      m3::gpu::angle_backward(s, d, p, Scratch{scratch.data() + off, need});
      return std::vector<Vec>{down(d_raw, s), down(d_dt, s), down(d_in, s)};
    };
    const std::vector<Vec> full = run(true), generic = run(false);
    const char* names[] = {"d_angles_raw", "d_dt_angle", "d_angle_in"};
    for (int i = 0; i < 3; ++i) expect_bitwise(names[i], full[i], generic[i]);
  }
}

// F5 at the official widths (na = nh = 32) takes angle_forward_kernel<32, 32> (the row strides
// known when compiling); it gives the generic instantiation's bits: angle_cumsum and angle_out,
// with angle_in set (values far outside [0, 2π) too) and null, over a length that ends in a
// partial tile and one of whole tiles. Increments up to 2.5π take every branch of the wrap.
TEST(GpuAnglesFull, ForwardGivesTheBitsOfTheGenericInstantiation) {
  M3_SKIP_WITHOUT_GPU();
  struct Restore {
    ~Restore() { m3::gpu::set_angle_forward_full_for_testing(true); }
  } restore;
  // Tiles of 128 steps: T = 300 takes the whole-tile path with and without a whole next tile,
  // then a partial tile; 256 ends on a whole tile; 129 has one whole tile and one step.
  for (const Idx T : {Idx(300), Idx(256), Idx(129)}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const Dims d = angle_dims({"full", 2, T, 32, 32, 2.5});
    Rng rng(static_cast<std::uint64_t>(977 + T));
    Vec raw(static_cast<size_t>(d.BT * d.na)), dt(static_cast<size_t>(d.BT * d.nh));
    fill(raw, rng, -3.0, 3.0);
    fill(dt, rng, 0.0, 2.5);
    const Vec ain = angle_in_values(d.B * d.nh * d.na, rng);
    Stream s;
    auto draw = up(raw, s), ddt = up(dt, s), dain = up(ain, s);
    DeviceArray<float> tau(m3::gpu::angle_forward_scratch_floats(d));
    for (bool with_in : {true, false}) {
      SCOPED_TRACE(with_in ? "angle_in set" : "angle_in null (zeros)");
      auto run = [&](bool full) {
        m3::gpu::set_angle_forward_full_for_testing(full);
        DeviceArray<float> cum(d.BT * d.nh * d.na), aout(d.B * d.nh * d.na);
        m3::gpu::angle_forward(s, d, draw.data(), ddt.data(), with_in ? dain.data() : nullptr,
                               cum.data(), aout.data(), Scratch{tau.data(), tau.size()});
        return std::vector<Vec>{down(cum, s), down(aout, s)};
      };
      const std::vector<Vec> full = run(true), generic = run(false);
      expect_bitwise("angle_cumsum", full[0], generic[0]);
      expect_bitwise("angle_out", full[1], generic[1]);
    }
  }
}

std::string angle_case_name(const ::testing::TestParamInfo<AngleCase>& info) {
  return info.param.name;
}

INSTANTIATE_TEST_SUITE_P(Lengths, GpuAngles, ::testing::ValuesIn(kAngleCases), angle_case_name);

// ---- reduce.cu on its own ----------------------------------------------------------------
// m3::gpu::colsum of random [rows, cols] inputs in [−1, 1) (edit(in) may change them first)
// into a random start, for every rows × cols, overwriting and accumulating;
// check(rows, cols, accumulate, in, start, got) judges each result.
template <class Edit, class Check>
void run_colsums(std::initializer_list<Idx> rows_set, std::initializer_list<Idx> cols_set,
                 int seed, Edit edit, Check check) {
  Stream s;
  Rng rng(seed);
  for (Idx rows : rows_set) {
    for (Idx cols : cols_set) {
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
                     (accumulate ? " accumulate" : " overwrite"));
        Vec in(static_cast<size_t>(rows * cols)), start(static_cast<size_t>(cols));
        fill(in, rng, -1.0, 1.0);
        fill(start, rng, -1.0, 1.0);
        edit(in);
        DeviceArray<float> scratch(((rows + 255) / 256) * cols);
        auto din = up(in, s), dout = up(start, s);
        m3::gpu::colsum(s, rows, cols, din.data(), dout.data(), accumulate,
                        Scratch{scratch.data(), scratch.size()});
        check(rows, cols, accumulate, in, start, down(dout, s));
      }
    }
  }
}

TEST(GpuReduce, ColsumMatchesDoubleSumAcrossChunkBoundaries) {
  M3_SKIP_WITHOUT_GPU();
  run_colsums(
      {1, 255, 256, 257, 1000}, {1, 33, 300}, 3, [](Vec&) {},
      [](Idx rows, Idx cols, bool accumulate, const Vec& in, const Vec& start, const Vec& got) {
        Vec want(start.size());
        for (Idx c = 0; c < cols; ++c) {
          double sum = 0;
          for (Idx r = 0; r < rows; ++r) sum += in[r * cols + c];
          want[c] = static_cast<float>((accumulate ? start[c] : 0.0) + sum);
        }
        expect_close("colsum", got, want);
      });
}

// colsum's order, as reduce.cuh states it, emulated in float here: stage 1's lane sums (lane
// row y takes the chunk's rows y, y + 8, …) added in ascending y, stage 2's chunk partials in
// ascending chunk from p₀ itself. Bit for bit, at one chunk (no stage 2), several, and more
// than one shared-memory slab of partials (rows > 128 · 256); with −0 inputs (every 7th
// value), whose sign the order keeps. The determinism digests rest on this order.
TEST(GpuReduce, ColsumFollowsItsStatedOrderBitForBit) {
  M3_SKIP_WITHOUT_GPU();
  constexpr Idx kChunk = 256, kLanes = 8;
  run_colsums(
      {1, 255, 2049, 33000}, {1, 33, 130}, 11,
      [](Vec& in) {
        for (size_t i = 0; i < in.size(); i += 7) in[i] = -0.0f;
      },
      [](Idx rows, Idx cols, bool accumulate, const Vec& in, const Vec& start, const Vec& got) {
        const Idx chunks = (rows + kChunk - 1) / kChunk;
        Vec want(start.size());
        for (Idx c = 0; c < cols; ++c) {
          float total = 0.0f;
          for (Idx k = 0; k < chunks; ++k) {
            float lane[kLanes];
            for (Idx y = 0; y < kLanes; ++y) {
              lane[y] = 0.0f;
              for (Idx r = k * kChunk + y; r < std::min(rows, (k + 1) * kChunk); r += kLanes)
                lane[y] += in[r * cols + c];
            }
            float part = lane[0];
            for (Idx y = 1; y < kLanes; ++y) part += lane[y];
            total = k == 0 ? part : total + part;
          }
          want[c] = accumulate ? start[c] + total : total;
        }
        expect_bitwise("colsum", got, want);
      });
}

// colsum_rows_pair (reduce.cuh): two sums of one shape in one launch of each stage give each
// sum's bits of its own colsum_rows — at one chunk, several, and more than one slab; at widths
// where a column tile holds columns of both matrices (33, 130) and where it does not (1 per
// matrix: tile 0 holds both); overwriting and accumulating into distinct starts; exactly the
// scratch colsum_pair_scratch_floats asks for. With no rows, an overwrite zeroes both outputs
// and an accumulation leaves them.
TEST(GpuReduce, ColsumPairGivesEachSumsBitsOfItsOwn) {
  M3_SKIP_WITHOUT_GPU();
  Stream s;
  Rng rng(12);
  for (Idx rows : {Idx(0), Idx(1), Idx(255), Idx(2049), Idx(33000)}) {
    for (Idx cols : {Idx(1), Idx(33), Idx(130)}) {
      for (bool accumulate : {false, true}) {
        SCOPED_TRACE("rows=" + std::to_string(rows) + " cols=" + std::to_string(cols) +
                     (accumulate ? " accumulate" : " overwrite"));
        Vec a(static_cast<size_t>(rows * cols)), b(a.size()), sa(static_cast<size_t>(cols)),
            sb(sa.size());
        fill(a, rng, -1.0, 1.0);
        fill(b, rng, -1.0, 1.0);
        fill(sa, rng, -1.0, 1.0);
        fill(sb, rng, -1.0, 1.0);
        const Idx need = m3::gpu::colsum_pair_scratch_floats(rows, cols);
        DeviceArray<float> scratch(std::max<Idx>(need, 1));
        const Scratch scr{scratch.data(), need};
        auto da = up(a, s), db = up(b, s), pa = up(sa, s), pb = up(sb, s), oa = up(sa, s),
             ob = up(sb, s);
        m3::gpu::colsum_rows_pair(s, rows, cols, m3::gpu::LoadMatrix{da.data(), cols}, pa.data(),
                                  m3::gpu::LoadMatrix{db.data(), cols}, pb.data(), accumulate,
                                  scr, "test");
        m3::gpu::colsum_rows(s, rows, cols, m3::gpu::LoadMatrix{da.data(), cols}, oa.data(),
                             accumulate, scr, "test");
        m3::gpu::colsum_rows(s, rows, cols, m3::gpu::LoadMatrix{db.data(), cols}, ob.data(),
                             accumulate, scr, "test");
        const Vec got_a = down(pa, s), got_b = down(pb, s);
        expect_bitwise("pair, a's sums", got_a, down(oa, s));
        expect_bitwise("pair, b's sums", got_b, down(ob, s));
        if (rows == 0) {
          expect_bitwise("no rows, a", got_a, accumulate ? sa : Vec(sa.size(), 0.0f));
          expect_bitwise("no rows, b", got_b, accumulate ? sb : Vec(sb.size(), 0.0f));
        }
      }
    }
  }
}

TEST(GpuReduce, AddAndConvertAreExact) {
  M3_SKIP_WITHOUT_GPU();
  Stream s;
  Rng rng(4);
  const Idx n = 1000;
  Vec a(n), b(n), want(n);
  fill(a, rng, -1.0, 1.0);
  fill(b, rng, -1.0, 1.0);
  for (Idx i = 0; i < n; ++i) want[i] = a[i] + b[i];
  auto da = up(a, s), db = up(b, s);
  DeviceArray<float> sum(n), copy(n);
  m3::gpu::add<float>(s, n, da.data(), db.data(), sum.data());
  m3::gpu::convert<float, float>(s, n, da.data(), copy.data());
  expect_bitwise("add", down(sum, s), want);
  expect_bitwise("convert", down(copy, s), a);
}

// rmsnorm_backward has two dw paths (norm.cu): the sum inside the kernel for rows of up to 1024
// elements (every lane count, 1 … 32, and blocks of 128 or 256 rows, the last one partial), and
// colsum_rows over the terms for wider rows. Both against the reference at widths on either
// side of each lane-count boundary, including rows that need several blocks; dw accumulates
// into a nonzero start; the scratch is exactly what rmsnorm_backward_scratch_floats asks for.
TEST(GpuReduce, RmsNormBackwardAtEveryWidthMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  Stream s;
  Rng rng(7);
  // Lanes 1 (dim 2, 3), 2, 4, 8, 16, 32 (in-kernel dw up to 1024), 32 (colsum_rows). Not dim 1:
  // there dx = w·g·(1 − x̂²)/rms with x̂² = u²/(u² + ε) ≈ 1, a cancellation that leaves
  // nothing to compare but rounding.
  for (Idx dim : {Idx(2), Idx(3), Idx(6), Idx(12), Idx(20), Idx(40), Idx(129), Idx(1024),
                  Idx(1030), Idx(2100)}) {
    for (Idx rows : {Idx(1), Idx(129), Idx(700)}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + ", rows " + std::to_string(rows));
      Vec u(static_cast<size_t>(rows * dim)), g(u.size()), w(static_cast<size_t>(dim)),
          dw(w.size());
      for (auto& e : u) e = static_cast<float>(2.0 * rng.normalish());
      fill(g, rng, -1.0, 1.0);
      fill(w, rng, 0.5, 1.5);
      fill(dw, rng, -0.5, 0.5);
      Vec y(u.size()), rms(static_cast<size_t>(rows)), dx(u.size()), dw_ref = dw;
      m3::ref::rmsnorm_forward(rows, dim, u.data(), w.data(), y.data(), rms.data());
      m3::ref::rmsnorm_backward(rows, dim, u.data(), w.data(), rms.data(), g.data(), dx.data(),
                                dw_ref.data());
      auto du = up(u, s), dg = up(g, s), dwt = up(w, s), drms = up(rms, s), ddw = up(dw, s);
      DeviceArray<float> ddx(rows * dim),
          sc(std::max<Idx>(1, m3::gpu::rmsnorm_backward_scratch_floats(rows, dim)));
      m3::gpu::rmsnorm_backward<float>(s, rows, dim, du.data(), dwt.data(), drms.data(),
                                       dg.data(), ddx.data(), ddw.data(),
                                       Scratch{sc.data(), sc.size()});
      expect_close("dx", down(ddx, s), dx);
      expect_close("dw (accumulated)", down(ddw, s), dw_ref);
    }
  }
}

// rmsnorm_forward_add (the residual add folded into the next norm) must give the bits of add()
// then rmsnorm_forward: u = a + b, y, rms. f32 and bf16 (b, y typed), at widths across the
// lane-count boundaries and past one register chunk (1024), in vectors and (pointers one
// element off alignment) element by element.
template <class T>
void check_forward_add(Stream& s, Rng& rng, Idx rows, Idx dim, Idx off) {
  const Idx n = rows * dim;
  Vec a(static_cast<size_t>(n)), b(a.size()), w(static_cast<size_t>(dim));
  for (auto& e : a) e = static_cast<float>(2.0 * rng.normalish());
  fill(b, rng, -1.0, 1.0);
  fill(w, rng, 0.5, 1.5);
  Vec a_off(static_cast<size_t>(off), 0.0f), b_off = a_off;
  a_off.insert(a_off.end(), a.begin(), a.end());
  b_off.insert(b_off.end(), b.begin(), b.end());
  auto da = up(a_off, s), db32 = up(b_off, s), dw = up(w, s);
  DeviceArray<T> db(n + off), y_ref(n + off), y_fused(n + off);
  DeviceArray<float> u_ref(n + off), u_fused(n + off), rms_ref(rows), rms_fused(rows);
  m3::gpu::convert<float, T>(s, n + off, db32.data(), db.data());
  m3::gpu::add<T>(s, n, da.data() + off, db.data() + off, u_ref.data() + off);
  m3::gpu::rmsnorm_forward<T>(s, rows, dim, u_ref.data() + off, dw.data(), y_ref.data() + off,
                              rms_ref.data());
  m3::gpu::rmsnorm_forward_add<T>(s, rows, dim, da.data() + off, db.data() + off,
                                  u_fused.data() + off, dw.data(), y_fused.data() + off,
                                  rms_fused.data());
  DeviceArray<float> y_ref32(n + off), y_fused32(n + off);
  m3::gpu::convert<T, float>(s, n + off, y_ref.data(), y_ref32.data());
  m3::gpu::convert<T, float>(s, n + off, y_fused.data(), y_fused32.data());
  auto tail = [&](const Vec& v) { return Vec(v.begin() + off, v.end()); };
  expect_bitwise("u", tail(down(u_fused, s)), tail(down(u_ref, s)));
  expect_bitwise("y", tail(down(y_fused32, s)), tail(down(y_ref32, s)));
  expect_bitwise("rms", down(rms_fused, s), down(rms_ref, s));
  const Vec u = tail(down(u_fused, s));
  if constexpr (std::is_same_v<T, float>)  // and u is the sum itself
    for (Idx i = 0; i < n; ++i) ASSERT_EQ(u[i], a[i] + b[i]) << "element " << i;
}

TEST(GpuReduce, RmsNormForwardAddGivesTheBitsOfAddThenNorm) {
  M3_SKIP_WITHOUT_GPU();
  Stream s;
  Rng rng(11);
  for (Idx dim : {Idx(3), Idx(20), Idx(129), Idx(1024), Idx(1030), Idx(2100)}) {
    for (Idx rows : {Idx(1), Idx(129), Idx(700)}) {
      for (Idx off : {Idx(0), Idx(1)}) {
        SCOPED_TRACE("dim " + std::to_string(dim) + ", rows " + std::to_string(rows) +
                     ", offset " + std::to_string(off));
        check_forward_add<float>(s, rng, rows, dim, off);
        check_forward_add<__nv_bfloat16>(s, rng, rows, dim, off);
      }
    }
  }
}

// 40 KB of static shared memory, plus `n_dyn` floats of dynamic: out = fixed[last] + dyn[last].
constexpr int kProbeStatic = 10 * 1024;
template <int Tag>
__global__ void smem_probe_kernel(int n_dyn, float* out) {
  __shared__ float fixed[kProbeStatic];
  extern __shared__ float dyn[];
  for (int i = threadIdx.x; i < kProbeStatic; i += blockDim.x) fixed[i] = float(i);
  for (int i = threadIdx.x; i < n_dyn; i += blockDim.x) dyn[i] = 2.0f * float(i);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = fixed[kProbeStatic - 1] + dyn[n_dyn - 1] + float(Tag);
}

// Static plus dynamic past 48 KB: refused without the opt-in (so the test can fail), launched
// after it (once, and again with fewer bytes), and refused with m3::Error past the device limit.
TEST(GpuSmem, OptInCountsStaticBytesAndRefusesPastTheDeviceLimit) {
  M3_SKIP_WITHOUT_GPU();
  const int n_dyn = 4 * 1024;  // 16 KB: 56 KB in all
  const std::size_t dyn = n_dyn * sizeof(float);
  DeviceArray<float> out(1);
  smem_probe_kernel<0><<<1, 128, dyn>>>(n_dyn, out.data());
  EXPECT_NE(cudaGetLastError(), cudaSuccess) << "56 KB launched without the opt-in";

  auto probe = smem_probe_kernel<1>;
  for (int k : {n_dyn, n_dyn / 2, n_dyn}) {
    const std::size_t bytes = k * sizeof(float);
    m3::gpu::opt_in_smem(probe, bytes, "test");
    probe<<<1, 128, bytes>>>(k, out.data());
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << k << " dynamic floats";
    float h = 0;
    ASSERT_EQ(cudaMemcpy(&h, out.data(), sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(h, float(kProbeStatic - 1) + 2.0f * float(k - 1) + 1.0f);
  }
  int optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0),
            cudaSuccess);
  try {
    m3::gpu::opt_in_smem(probe, static_cast<std::size_t>(optin), "test");
    ADD_FAILURE() << "static + the whole opt-in limit was accepted";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the device limit"), std::string::npos)
        << e.what();
  }
}

TEST(GpuReduce, LaunchersRejectShortScratch) {
  M3_SKIP_WITHOUT_GPU();
  Stream s;
  const Idx rows = 1000, cols = 8;
  DeviceArray<float> in(rows * cols), out(cols), small(cols);
  EXPECT_THROW(m3::gpu::colsum(s, rows, cols, in.data(), out.data(), false, Scratch{}),
               m3::Error);
  EXPECT_THROW(m3::gpu::colsum(s, rows, cols, in.data(), out.data(), false,
                               Scratch{small.data(), small.size()}),
               m3::Error);
  DeviceArray<float> w(cols), rms(rows), dx(rows * cols);
  EXPECT_THROW(m3::gpu::rmsnorm_backward<float>(s, rows, cols, in.data(), w.data(), rms.data(),
                                                in.data(), dx.data(), out.data(), Scratch{}),
               m3::Error);
}

}  // namespace
