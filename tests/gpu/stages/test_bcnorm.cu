// BCNorm with the per-head bias (gpu/stages/bcnorm.cu: F4a–d, B4b, B4c; MODEL.md §4, §6.2)
// against the reference: in f32 (GpuStagesA) and in the bf16/f16 storage emulation
// (TypedStages: normed rounded before the bias add, d_normed before B4c), and with the raw rows
// at a row stride wider than ng·ds (the production layout's column views), which must give the
// contiguous run's bits. Tolerances: tests/gpu/stage_fixtures.cuh.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

// 2 ulps of T at the largest |value| of `want`, relative to that value (a floor for outputs
// that inherit the rounding of a larger operand).
template <class T>
double scale_ulps_rel(const Vec& want) {
  double wmax = 0;
  for (float v : want) wmax = std::max(wmax, std::abs(static_cast<double>(v)));
  return wmax > 0 ? 2.0 * ulp<T>(wmax) / wmax : 0.0;
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

// F4 then B4b/B4c on the world's tensors, every output; d_b/c_raw come back in the contiguous
// layout. ldr: the raw rows' stride (0: contiguous; the production layout's column views have
// proj's); the pad columns of X_raw hold 7 and those of d_X_raw −5, and `second` says whether
// the latter are untouched. reference_rms: B4c reads the reference's X_rms instead of F4's.
template <class T>
std::pair<Named, bool> bcnorm_run(const TypedWorld<T>& w, cudaStream_t s, ScratchBuf& sc, Idx ld,
                                  bool reference_rms) {
  const Dims& d = w.d;
  const Idx bc = d.ng * d.ds, ngds = d.BT * bc, nhds = d.BT * d.nh * d.ds;
  const Idx L = ld ? ld : bc;
  auto wide = [&](const Vec& v, float pad) {
    Vec o(static_cast<size_t>(d.BT * L), pad);
    for (Idx r = 0; r < d.BT; ++r)
      for (Idx q = 0; q < bc; ++q) o[r * L + q] = v[r * bc + q];
    return o;
  };
  auto b_raw = up_t<T>(wide(w.a.b_raw, 7.0f), s), c_raw = up_t<T>(wide(w.a.c_raw, 7.0f), s);
  auto dbr = up_t<T>(Vec(static_cast<size_t>(d.BT * L), -5.0f), s),
       dcr = up_t<T>(Vec(static_cast<size_t>(d.BT * L), -5.0f), s);
  auto bw = up(w.p.b_norm_weight, s), cw = up(w.p.c_norm_weight, s), bb = up(w.p.b_bias, s),
       cb = up(w.p.c_bias, s);
  DeviceArray<T> b_normed(ngds), c_normed(ngds), b_biased(nhds), c_biased(nhds);
  DeviceArray<float> b_rms(d.BT * d.ng), c_rms(d.BT * d.ng);
  m3::gpu::BcnormFwd<T> f{b_raw.data(),    c_raw.data(),    bw.data(),       cw.data(),
                          bb.data(),       cb.data(),       b_normed.data(), c_normed.data(),
                          b_biased.data(), c_biased.data(), b_rms.data(),    c_rms.data()};
  f.ldr = ld;
  m3::gpu::bcnorm_forward<T>(s, d, f);
  auto r_brms = up(w.a.b_rms, s), r_crms = up(w.a.c_rms, s);
  auto dbp = up(w.g.d_b_pre_rope, s), dcp = up(w.g.d_c_pre_rope, s),
       dbw = up(w.pg0.b_norm_weight, s), dcw = up(w.pg0.c_norm_weight, s),
       dbb = up(w.pg0.b_bias, s), dcb = up(w.pg0.c_bias, s);
  DeviceArray<T> dbn(ngds), dcn(ngds);
  const float* brms = reference_rms ? r_brms.data() : b_rms.data();
  const float* crms = reference_rms ? r_crms.data() : c_rms.data();
  m3::gpu::BcnormBwd<T> b{b_raw.data(), c_raw.data(), bw.data(),  cw.data(),
                          brms,         crms,         dbp.data(), dcp.data(),
                          dbn.data(),   dcn.data(),   dbr.data(), dcr.data(),
                          dbw.data(),   dcw.data(),   dbb.data(), dcb.data()};
  b.ldr = ld;
  m3::gpu::bcnorm_backward<T>(s, d, b, sc.get());
  const Vec db = down_t(dbr, s), dc = down_t(dcr, s);
  Vec db_out(static_cast<size_t>(ngds)), dc_out(static_cast<size_t>(ngds));
  bool pads = true;
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx q = 0; q < L; ++q) {
      if (q < bc) {
        db_out[r * bc + q] = db[r * L + q];
        dc_out[r * bc + q] = dc[r * L + q];
      } else {
        pads = pads && db[r * L + q] == -5.0f && dc[r * L + q] == -5.0f;
      }
    }
  return {Named{{"b_normed", down_t(b_normed, s)}, {"c_normed", down_t(c_normed, s)},
                {"b_biased", down_t(b_biased, s)}, {"c_biased", down_t(c_biased, s)},
                {"b_rms", down(b_rms, s)},         {"c_rms", down(c_rms, s)},
                {"d_b_normed", down_t(dbn, s)},    {"d_c_normed", down_t(dcn, s)},
                {"d_b_raw", db_out},               {"d_c_raw", dc_out},
                {"d_b_norm_weight", down(dbw, s)}, {"d_c_norm_weight", down(dcw, s)},
                {"d_b_bias", down(dbb, s)},        {"d_c_bias", down(dcb, s)}},
          pads};
}

// F4 (normed rounded, then the bias add reads the stored normed) and B4b/B4c (d_normed rounded,
// then B4c reads the stored d_normed).
TYPED_TEST(TypedStages, BcnormForwardAndBackwardMatchReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    SCOPED_TRACE(c.name);
    TypedWorld<T> w = make_typed_world<T>(c, false);
    const Dims& d = w.d;
    LParams pg = w.pg0;
    m3::ref::bcnorm_backward(d, w.p, w.a, w.g, pg);  // rounds d_normed, then d_raw
    Stream s;
    ScratchBuf sc(d);
    const Named got =
        twice("bcnorm", [&] { return bcnorm_run(w, s, sc, 0, true).first; });
    expect_typed<T>("b_normed", got.at("b_normed"), w.a.b_normed, 1e-6, 0.99);
    expect_typed<T>("c_normed", got.at("c_normed"), w.a.c_normed, 1e-6, 0.99);
    // biased = round(round(normed) + bias): a one-ulp difference in the stored normed (the
    // RMS summed in another order) survives the add, and where normed and bias nearly cancel
    // it is many ulps of the small result — so the floor is 2 ulps at the tensor's scale.
    expect_typed<T>("b_biased", got.at("b_biased"), w.a.b_biased, scale_ulps_rel<T>(w.a.b_biased),
                    0.99);
    expect_typed<T>("c_biased", got.at("c_biased"), w.a.c_biased, scale_ulps_rel<T>(w.a.c_biased),
                    0.99);
    expect_close("b_rms", got.at("b_rms"), w.a.b_rms);
    expect_close("c_rms", got.at("c_rms"), w.a.c_rms);
    // Σ over the group's heads in ascending order on both sides: the same f32 sum, one rounding.
    expect_typed<T>("d_b_normed", got.at("d_b_normed"), w.g.d_b_normed, 0.0, 0.999);
    expect_typed<T>("d_c_normed", got.at("d_c_normed"), w.g.d_c_normed, 0.0, 0.999);
    expect_typed<T>("d_b_raw", got.at("d_b_raw"), w.g.d_b_raw, 1e-6, 0.98);
    expect_typed<T>("d_c_raw", got.at("d_c_raw"), w.g.d_c_raw, 1e-6, 0.98);
    expect_close("d b_norm_weight (accumulated)", got.at("d_b_norm_weight"), pg.b_norm_weight);
    expect_close("d c_norm_weight (accumulated)", got.at("d_c_norm_weight"), pg.c_norm_weight);
    expect_close("d b_bias (accumulated)", got.at("d_b_bias"), pg.b_bias);
    expect_close("d c_bias (accumulated)", got.at("d_c_bias"), pg.c_bias);
  }
}

// b/c_raw and d_b/c_raw read and written with a row stride ldr > ng·ds, as the production
// layout's column views of proj / d_proj: the bits of the contiguous run, and nothing written
// outside their columns; pads that keep the vectors aligned (8) and one that does not (3).
TYPED_TEST(TypedStages, BcnormWithStridedRawRowsGivesTheContiguousBits) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    TypedWorld<T> w = make_typed_world<T>(c, false);
    const Dims& d = w.d;
    Stream s;
    ScratchBuf sc(d);
    const Idx bc = d.ng * d.ds;
    auto run = [&](Idx ld) { return bcnorm_run(w, s, sc, ld, false); };
    const auto want = run(0);
    for (Idx pad : {Idx(8), Idx(3)}) {
      SCOPED_TRACE(std::string(c.name) + " ldr = ng·ds + " + std::to_string(pad));
      const auto got = run(bc + pad);
      EXPECT_TRUE(got.second) << "a value outside d_b/c_raw's columns was written";
      for (const auto& [name, v] : want.first)
        EXPECT_EQ(got.first.at(name), v) << name << " differs from the contiguous run";
    }
  }
}

}  // namespace
