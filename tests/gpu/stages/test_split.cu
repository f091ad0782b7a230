// The split of in_proj's output and its activations (gpu/stages/split.cu: F3, F5b, the α/β/γ
// glue, B5b, B3; MODEL.md §2.1, §4, §6.2) against the reference: in f32 (GpuStagesA) and in the
// bf16/f16 storage emulation (TypedStages), including the production layout's column views of
// proj / d_proj and the f32 columns of d_proj that B5b and B5a write in place of B3.
// Tolerances: tests/gpu/stage_fixtures.cuh.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

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

// α = exp(a_val·dt) must be the correctly rounded f32 exponential, not one of bounded but
// one-signed error: the sequential scan multiplies every α of a head's memory into its state, so
// an error of the same sign from step to step adds up over T (docs/HARNESS.md, "One biased
// decay"). The arguments sweep what heads produce, a_val·dt from −2⁻²⁴ to −40, densely near 0
// where α ≈ 1 and the slow heads live. The host's exp in double, rounded once, is the correctly
// rounded value wherever the exact one lies more than a few double ulps from an f32 midpoint:
// every argument of this sweep lies more than 4 away (checked against the long double exp).
TEST(GpuSplit, AlphaIsTheCorrectlyRoundedExponential) {
  M3_SKIP_WITHOUT_GPU();
  const Idx nh = 32, rows = 1 << 15, n = rows * nh;
  Vec a_val(static_cast<size_t>(n)), dt(static_cast<size_t>(n)), trap(static_cast<size_t>(n), 0.5f);
  for (Idx i = 0; i < n; ++i) {
    // log-uniform |a_val·dt| over 2⁻²⁴ … 40, a_val in [−1.5, −0.5), dt the rest.
    const double u = static_cast<double>(i) / static_cast<double>(n);
    const double mag = std::exp2(-24.0 + u * (24.0 + std::log2(40.0)));
    const float a = -0.5f - static_cast<float>((i * 7919) % 1000) * 1e-3f;
    a_val[static_cast<size_t>(i)] = a;
    dt[static_cast<size_t>(i)] = static_cast<float>(mag / -static_cast<double>(a));
  }
  Dims d{};
  d.B = 1;
  d.T = rows;
  d.BT = rows;
  d.nh = nh;
  Stream s;
  auto av = up(a_val, s), dv = up(dt, s), tv = up(trap, s);
  DeviceArray<float> alpha(n), beta(n), gamma(n);
  m3::gpu::abg_forward(s, d, av.data(), dv.data(), tv.data(), alpha.data(), beta.data(),
                       gamma.data());
  const Vec got = down(alpha, s);
  Idx wrong = 0, first = -1;
  double signed_ulps = 0;
  for (Idx i = 0; i < n; ++i) {
    const float x = a_val[static_cast<size_t>(i)] * dt[static_cast<size_t>(i)];
    const float want = static_cast<float>(std::exp(static_cast<double>(x)));
    const float g = got[static_cast<size_t>(i)];
    if (g != want) {
      if (first < 0) first = i;
      ++wrong;
    }
    const float ulp = std::nextafter(want, 2.0f) - want;
    signed_ulps += (static_cast<double>(g) - static_cast<double>(want)) / ulp;
  }
  EXPECT_EQ(wrong, 0) << wrong << " of " << n << " alphas are not the correctly rounded exp; first at "
                      << first << ", mean error " << signed_ulps / static_cast<double>(n) << " ulp";
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

// F3 on the world's proj: every output, and proj after it. views: z, x, b_raw, c_raw null (the
// production layout's column views), so none of them is written or returned.
template <class T>
Named split_forward_run(const TypedWorld<T>& w, cudaStream_t s, bool views) {
  const Dims& d = w.d;
  auto proj = up_t<T>(w.a.proj, s);
  auto dt_bias = up(w.p.dt_bias, s);
  DeviceArray<T> z(d.BT * d.di), x(d.BT * d.di), b_raw(d.BT * d.ng * d.ds),
      c_raw(d.BT * d.ng * d.ds);
  DeviceArray<float> dd_dt(d.BT * d.nh), dd_a(d.BT * d.nh), trap_raw(d.BT * d.nh),
      ang(d.BT * d.na), dt(d.BT * d.nh), a_val(d.BT * d.nh), trap(d.BT * d.nh);
  auto typed = [&](DeviceArray<T>& a) { return views ? nullptr : a.data(); };
  m3::gpu::SplitFwd<T> p{proj.data(),     dt_bias.data(), typed(z),     typed(x),
                         typed(b_raw),    typed(c_raw),   dd_dt.data(), dd_a.data(),
                         trap_raw.data(), ang.data(),     dt.data(),    a_val.data(),
                         trap.data()};
  m3::gpu::split_forward<T>(s, d, p);
  Named out{{"proj", down_t(proj, s)},     {"dd_dt_raw", down(dd_dt, s)},
            {"dd_a_raw", down(dd_a, s)},   {"trap_raw", down(trap_raw, s)},
            {"angles_raw", down(ang, s)},  {"dt", down(dt, s)},
            {"a_val", down(a_val, s)},     {"trap", down(trap, s)}};
  if (!views) {
    out["z"] = down_t(z, s);
    out["x"] = down_t(x, s);
    out["b_raw"] = down_t(b_raw, s);
    out["c_raw"] = down_t(c_raw, s);
  }
  return out;
}

// B3 from the world's gradients into a d_proj filled with `fill`. views: d_z, d_x, d_b_raw,
// d_c_raw null (d_proj's columns in the production layout), so those columns keep `fill`.
template <class T>
Vec split_backward_run(const TypedWorld<T>& w, cudaStream_t s, bool views, float fill) {
  const Dims& d = w.d;
  auto dz = up_t<T>(w.g.d_z, s), dx = up_t<T>(w.g.d_x, s), db = up_t<T>(w.g.d_b_raw, s),
       dc = up_t<T>(w.g.d_c_raw, s);
  auto ddt = up(w.g.d_dd_dt, s), dda = up(w.g.d_dd_a, s), dtr = up(w.g.d_trap_raw, s),
       dan = up(w.g.d_angles_raw, s);
  auto d_proj = up_t<T>(Vec(static_cast<size_t>(d.BT * d.ip), fill), s);
  auto typed = [&](DeviceArray<T>& a) -> const T* { return views ? nullptr : a.data(); };
  m3::gpu::SplitBwd<T> p{typed(dz),  typed(dx),  typed(db),  typed(dc),     ddt.data(),
                         dda.data(), dtr.data(), dan.data(), d_proj.data()};
  m3::gpu::split_backward<T>(s, d, p);
  return down_t(d_proj, s);
}

// F3: the typed parts are copies (bit-equal), the raw logits exact f32 copies.
TYPED_TEST(TypedStages, SplitForwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    SCOPED_TRACE(c.name);
    TypedWorld<T> w = make_typed_world<T>(c, false);
    Stream s;
    const Named got = twice("split_forward", [&] { return split_forward_run(w, s, false); });
    for (const auto& [name, ref] : std::vector<std::pair<const char*, const Vec*>>{
             {"z", &w.a.z}, {"x", &w.a.x}, {"b_raw", &w.a.b_raw}, {"c_raw", &w.a.c_raw}})
      expect_typed<T>(name, got.at(name), *ref, 0.0, 1.0);
    for (const auto& [name, ref] : std::vector<std::pair<const char*, const Vec*>>{
             {"dd_dt_raw", &w.a.dd_dt_raw}, {"dd_a_raw", &w.a.dd_a_raw},
             {"trap_raw", &w.a.trap_raw}, {"angles_raw", &w.a.angles_raw}})
      EXPECT_EQ(0, ref->empty() ? 0
                                : std::memcmp(got.at(name).data(), ref->data(),
                                              ref->size() * sizeof(float)))
          << name << ": not the exact f32 value of the typed proj column";
    expect_close("dt", got.at("dt"), w.a.dt);
    expect_close("a_val", got.at("a_val"), w.a.a_val);
    expect_close("trap", got.at("trap"), w.a.trap);
  }
}

// B3: d_proj typed; typed parts copied, f32 parts rounded once.
TYPED_TEST(TypedStages, SplitBackwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    SCOPED_TRACE(c.name);
    TypedWorld<T> w = make_typed_world<T>(c, false);
    const Dims& d = w.d;
    m3::ref::split_backward(d, w.g);
    m3::ref::store_typed(d, w.g.d_proj);
    Stream s;
    const Named got = twice("split_backward", [&] {
      return Named{{"d_proj", split_backward_run(w, s, false, 3.0f)}};
    });
    expect_typed<T>("d_proj", got.at("d_proj"), w.g.d_proj, 0.0, 1.0);
  }
}

// The production layout's column views: F3 with z, x, b_raw, c_raw null leaves proj as it is and
// writes the f32 parts as with them; B3 with their gradients null leaves d_proj's typed columns
// (written in place by B7, B6, B4c) and writes the rest as with them; some but not all of the
// typed parts null is refused.
TYPED_TEST(TypedStages, SplitLeavesTheColumnViewsInPlace) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    SCOPED_TRACE(c.name);
    TypedWorld<T> w = make_typed_world<T>(c, false);
    const Dims& d = w.d;
    Stream s;
    const Named fw = split_forward_run(w, s, false), fv = split_forward_run(w, s, true);
    for (const auto& [name, v] : fv) EXPECT_EQ(v, fw.at(name)) << "F3 " << name;
    EXPECT_EQ(fv.count("z") + fv.count("x") + fv.count("b_raw") + fv.count("c_raw"), 0u);
    const Vec bw = split_backward_run(w, s, false, 3.0f);
    const Vec bv = split_backward_run(w, s, true, 3.0f);
    for (Idx r = 0; r < d.BT; ++r)
      for (Idx j = 0; j < d.ip; ++j) {
        const size_t i = static_cast<size_t>(r * d.ip + j);
        if (j < 2 * d.di + 2 * d.ng * d.ds) {
          ASSERT_EQ(bv[i], 3.0f) << "B3 wrote d_proj[" << r << ", " << j << "] of a column view";
        } else {
          ASSERT_EQ(bv[i], bw[i]) << "B3 d_proj[" << r << ", " << j << "]";
        }
      }
    DeviceArray<T> one(d.BT * d.di), proj(d.BT * d.ip);
    m3::gpu::SplitFwd<T> half{};
    half.proj = proj.data();
    half.z = one.data();
    half.x = one.data();
    EXPECT_THROW(m3::gpu::split_forward<T>(s, d, half), m3::Error);
  }
}

// Production (fused runs, column views): B5b and B5a write d_proj's f32 columns themselves
// (ProjCols from split_f32_cols) and B3 is not launched. The d_proj they leave must be, bit for
// bit, the one B3 (split_backward with the typed parts null) stores from the same f32 outputs,
// the typed columns untouched by both; the f32 outputs are the same with and without the
// columns. Every stage case, and the official widths (nh = na = 32: angle_grads_kernel<32, 32>;
// B5b's one access per 4 heads, proj_cols4, where nh % 4 == 0 and ip % 4 == 0, its scalar
// stores in the other cases).
// Columns for some but not all of B5b's outputs, or a row stride shorter than the part, are
// refused.
TYPED_TEST(TypedStages, ProducersWriteTheF32PartsOfDprojAsB3Does) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  std::vector<Case> cases = kTypedCases;
  cases.push_back({"official_widths_dm1024_hd64_ds128_B1_T33", 1024, 64, 128, 1, 0.5, 1, 33});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    TypedWorld<T> w = make_typed_world<T>(c, false);
    const Dims& d = w.d;
    const Idx n = d.BT * d.nh;
    Rng rng(23);
    Vec d_adt(static_cast<size_t>(n)), d_direct(d_adt.size()), d_sig(d_adt.size());
    for (Vec* v : {&d_adt, &d_direct, &d_sig}) fill(*v, rng, -1.0, 1.0);
    Stream s;
    ScratchBuf sc(d);
    auto raw = up(w.a.angles_raw, s), dt = up(w.a.dt, s), d_cum = up(w.g.d_angle_cumsum, s),
         dd_dt = up(w.a.dd_dt_raw, s), dd_a = up(w.a.dd_a_raw, s), dt_bias = up(w.p.dt_bias, s),
         a_val = up(w.a.a_val, s), trap = up(w.a.trap, s), dadt = up(d_adt, s),
         ddir = up(d_direct, s), dsig = up(d_sig, s);
    const Vec filled(static_cast<size_t>(d.BT * d.ip), 3.0f);
    // B5a then B5b, with d_proj's columns (direct) or without (B3 after them); the f32 outputs
    // and d_proj.
    auto run = [&](bool direct) {
      auto d_proj = up_t<T>(filled, s);
      DeviceArray<float> d_angles_raw(std::max<Idx>(d.BT * d.na, 1)), d_dt_angle(n), o_dt(n),
          o_a(n), o_trap(n), d_bias(d.nh);
      d_bias.zero(s);
      const m3::gpu::SplitF32Cols cols = m3::gpu::split_f32_cols(d, d_proj.data());
      m3::gpu::AngleBwd ab{raw.data(),          dt.data(),         d_cum.data(), nullptr,
                           d_angles_raw.data(), d_dt_angle.data(), nullptr};
      if (direct) ab.d_angles_raw_cols = cols.d_angles_raw;
      m3::gpu::angle_backward(s, d, ab, sc.get());
      m3::gpu::ActBwd p{dd_dt.data(), dd_a.data(),       dt_bias.data(), dt.data(),
                        a_val.data(), trap.data(),       dadt.data(),    ddir.data(),
                        d_dt_angle.data(), dsig.data(),  o_dt.data(),    o_a.data(),
                        o_trap.data(), d_bias.data(),    d.a_floor};
      if (direct) p.into_proj(cols);
      m3::gpu::activations_backward(s, d, p, sc.get());
      if (!direct) {
        m3::gpu::SplitBwd<T> q{nullptr,     nullptr,      nullptr,
                               nullptr,     o_dt.data(),  o_a.data(),
                               o_trap.data(), d_angles_raw.data(), d_proj.data()};
        m3::gpu::split_backward<T>(s, d, q);
      }
      Named out{{"d_proj", down_t(d_proj, s)}, {"d_dd_dt", down(o_dt, s)},
                {"d_dd_a", down(o_a, s)},     {"d_trap_raw", down(o_trap, s)},
                {"d_dt_angle", down(d_dt_angle, s)}, {"d dt_bias", down(d_bias, s)}};
      if (d.na > 0) out["d_angles_raw"] = down(d_angles_raw, s);
      return out;
    };
    const Named direct = run(true), b3 = run(false);
    expect_bitwise("B5b and B5a into d_proj against B3", direct, b3);
    const Vec& dp = direct.at("d_proj");
    size_t f32_cols = 0;
    for (Idx r = 0; r < d.BT; ++r)
      for (Idx j = 0; j < d.ip; ++j) {
        const float v = dp[static_cast<size_t>(r * d.ip + j)];
        if (j < 2 * d.di + 2 * d.ng * d.ds) {
          ASSERT_EQ(v, 3.0f) << "d_proj[" << r << ", " << j << "], a typed part, was written";
        } else if (v != 3.0f) {
          ++f32_cols;
        }
      }
    EXPECT_GT(f32_cols, static_cast<size_t>(d.BT)) << "the f32 parts were not written";

    auto d_proj = up_t<T>(filled, s);
    DeviceArray<float> o(n), bias(d.nh), ang_out(std::max<Idx>(d.BT * d.na, 1));
    const m3::gpu::SplitF32Cols cols = m3::gpu::split_f32_cols(d, d_proj.data());
    m3::gpu::ActBwd some{dd_dt.data(), dd_a.data(), dt_bias.data(), dt.data(), a_val.data(),
                         trap.data(),  dadt.data(), ddir.data(),    nullptr,   dsig.data(),
                         o.data(),     o.data(),    o.data(),       bias.data(), d.a_floor};
    some.d_dd_dt_cols = cols.d_dd_dt;
    EXPECT_THROW(m3::gpu::activations_backward(s, d, some, sc.get()), m3::Error);
    some.d_dd_a_cols = cols.d_dd_a;
    some.d_trap_raw_cols = cols.d_trap_raw;
    some.d_trap_raw_cols.ld = d.nh - 1;
    EXPECT_THROW(m3::gpu::activations_backward(s, d, some, sc.get()), m3::Error);
    if (d.na > 1) {
      m3::gpu::AngleBwd ab{raw.data(), dt.data(), d_cum.data(), nullptr, ang_out.data(), o.data(),
                           nullptr};
      ab.d_angles_raw_cols = cols.d_angles_raw;
      ab.d_angles_raw_cols.ld = d.na - 1;
      EXPECT_THROW(m3::gpu::angle_backward(s, d, ab, sc.get()), m3::Error);
    }
  }
}

}  // namespace
