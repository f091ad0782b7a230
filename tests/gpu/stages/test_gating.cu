// Output gating (gpu/stages/gating.cu: F7, B7; MODEL.md §4, §6.2) against the reference, both
// variants (silu gate and is_outproj_norm): in f32 (GpuStagesA), in the bf16/f16 storage
// emulation (TypedStages), and with z read at a row stride wider than di (the production
// layout's column view), which must give the contiguous run's bits; and B7's rewrite of gated
// for the production layout's B8, which must give F7's bits and leave B7's outputs unchanged.
// Tolerances: tests/gpu/stage_fixtures.cuh.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

// z's values [rows, di] in a buffer of row stride L ≥ di, the columns past di holding the sentinel
// 7 (the production layout's view of z inside proj).
Vec at_row_stride(const Vec& z, Idx rows, Idx di, Idx L) {
  Vec zw(static_cast<size_t>(rows * L), 7.0f);
  for (Idx r = 0; r < rows; ++r)
    for (Idx q = 0; q < di; ++q) zw[r * L + q] = z[r * di + q];
  return zw;
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

// F7 (gated rounded) and B7 (d_y, d_z rounded; d norm_gate_weight f32), both variants.
TYPED_TEST(TypedStages, GatingMatchesReferenceBothVariants) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    for (bool norm : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (norm ? " is_outproj_norm" : " silu gate"));
      TypedWorld<T> w = make_typed_world<T>(c, norm);
      const Dims& d = w.d;
      LParams pg = w.pg0;
      m3::ref::gating_backward(d, w.p, w.a, w.g, pg);
      m3::ref::store_typed(d, w.g.d_y);
      m3::ref::store_typed(d, w.g.d_z);
      Stream s;
      ScratchBuf sc(d);
      const Idx n = d.BT * d.di;
      const Named got = twice("gating", [&] {
        auto y = up_t<T>(w.a.y, s), z = up_t<T>(w.a.z, s), dg = up_t<T>(w.g.d_gated, s);
        auto ngw = up(w.p.norm_gate_weight, s), r_rstd = up(w.a.gated_rms_vals, s),
             dngw = up(w.pg0.norm_gate_weight, s);
        DeviceArray<T> gated(n), dy(n), dz(n);
        DeviceArray<float> rstd(norm ? d.BT * d.nh : 0);
        m3::gpu::gating_forward<T>(s, d, y.data(), z.data(), ngw.data(), gated.data(),
                                   norm ? rstd.data() : nullptr);
        m3::gpu::GatingBwd<T> p{y.data(),  z.data(),  dg.data(),  ngw.data(),
                                norm ? r_rstd.data() : nullptr,  dy.data(),
                                dz.data(), dngw.data()};
        m3::gpu::gating_backward<T>(s, d, p, sc.get());
        return Named{{"gated", down_t(gated, s)}, {"rstd", down(rstd, s)},
                     {"d_y", down_t(dy, s)},       {"d_z", down_t(dz, s)},
                     {"d_norm_gate_weight", down(dngw, s)}};
      });
      expect_typed<T>("gated", got.at("gated"), w.a.gated, 1e-6, 0.99);
      if (norm) expect_close("gated_rms_vals", got.at("rstd"), w.a.gated_rms_vals);
      expect_typed<T>("d_y", got.at("d_y"), w.g.d_y, 1e-6, 0.98);
      expect_typed<T>("d_z", got.at("d_z"), w.g.d_z, 1e-6, 0.98);
      expect_close("d norm_gate_weight (accumulated / untouched)",
                   got.at("d_norm_gate_weight"), pg.norm_gate_weight);
    }
  }
}

// z (and d_z) read and written with a row stride ldz > di, as the production layout's column
// views of proj / d_proj: the bits of the contiguous run, and nothing written outside z's
// columns. Pads that keep 16-byte vectors (ld − di a multiple of 8) and one that does not (the
// one-value path), both variants.
TYPED_TEST(TypedStages, GatingWithAStridedZGivesTheContiguousBits) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    for (bool norm : {false, true}) {
      TypedWorld<T> w = make_typed_world<T>(c, norm);
      const Dims& d = w.d;
      Stream s;
      ScratchBuf sc(d);
      const Idx n = d.BT * d.di;
      // run(ld): z at row stride ld (0: contiguous); returns the outputs, d_z unpacked, and
      // whether every pad value of z's and d_z's buffers is still the sentinel.
      auto run = [&](Idx ld) {
        const Idx L = ld ? ld : d.di;
        const Vec zw = at_row_stride(w.a.z, d.BT, d.di, L);
        const Vec dzw(zw.size(), -5.0f);
        auto y = up_t<T>(w.a.y, s), z = up_t<T>(zw, s), dg = up_t<T>(w.g.d_gated, s),
             dz = up_t<T>(dzw, s);
        auto ngw = up(w.p.norm_gate_weight, s), r_rstd = up(w.a.gated_rms_vals, s),
             dngw = up(w.pg0.norm_gate_weight, s);
        DeviceArray<T> gated(n), dy(n);
        DeviceArray<float> rstd(norm ? d.BT * d.nh : 0);
        m3::gpu::gating_forward<T>(s, d, y.data(), z.data(), ngw.data(), gated.data(),
                                   norm ? rstd.data() : nullptr, ld);
        m3::gpu::GatingBwd<T> p{y.data(),  z.data(),  dg.data(),  ngw.data(),
                                norm ? r_rstd.data() : nullptr,  dy.data(),
                                dz.data(), dngw.data()};
        p.ldz = ld;
        m3::gpu::gating_backward<T>(s, d, p, sc.get());
        const Vec zb = down_t(z, s), dzb = down_t(dz, s);
        Vec dz_packed(static_cast<size_t>(n));
        bool pads = true;
        for (Idx r = 0; r < d.BT; ++r)
          for (Idx q = 0; q < L; ++q) {
            if (q < d.di) {
              dz_packed[r * d.di + q] = dzb[r * L + q];
            } else {
              pads = pads && zb[r * L + q] == 7.0f && dzb[r * L + q] == -5.0f;
            }
          }
        return std::make_pair(Named{{"gated", down_t(gated, s)}, {"rstd", down(rstd, s)},
                                    {"d_y", down_t(dy, s)}, {"d_z", dz_packed},
                                    {"d_norm_gate_weight", down(dngw, s)}},
                              pads);
      };
      const auto want = run(0);
      for (Idx pad : {Idx(8), Idx(24), Idx(3)}) {
        SCOPED_TRACE(std::string(c.name) + (norm ? " is_outproj_norm" : " silu gate") +
                     " ld = di + " + std::to_string(pad));
        const auto got = run(d.di + pad);
        EXPECT_TRUE(got.second) << "a value outside z's columns was written";
        for (const auto& [name, v] : want.first)
          EXPECT_EQ(got.first.at(name), v) << name << " differs from the contiguous run";
      }
    }
  }
}

// B7's rewrite of gated (GatingBwd::gated, what the production layout's B8 reads instead of a
// saved gated): the bits F7 wrote, over a buffer of NaN, with z contiguous and at row strides
// that keep and that break the 16-byte vectors; and d_y, d_z and d norm_gate_weight are the
// bits of the run without the rewrite.
template <class T>
void expect_gated_rewritten(const Dims& d, const Vec& y_h, const Vec& z_h, const Vec& dg_h,
                            const Vec& ngw_h, const Vec& dngw_h, bool norm) {
  Stream s;
  ScratchBuf sc(d);
  const Idx n = d.BT * d.di;
  for (Idx pad : {Idx(0), Idx(8), Idx(3)}) {
    SCOPED_TRACE("z at row stride di + " + std::to_string(pad));
    const Idx L = d.di + pad;
    const Vec zw = at_row_stride(z_h, d.BT, d.di, L);
    const Idx ld = pad ? L : 0;
    auto y = up_as<T>(y_h, s), z = up_as<T>(zw, s), dg = up_as<T>(dg_h, s);
    auto ngw = up(ngw_h, s);
    DeviceArray<T> gated(n);
    DeviceArray<float> rstd(norm ? d.BT * d.nh : 0);
    m3::gpu::gating_forward<T>(s, d, y.data(), z.data(), ngw.data(), gated.data(),
                               norm ? rstd.data() : nullptr, ld);
    const Vec want_gated = down_as(gated, s);
    // Without and with the rewrite; each with its own d_z and weight-gradient buffers.
    auto backward = [&](bool rewrite) {
      auto dngw = up(dngw_h, s);
      auto dz = up_as<T>(Vec(zw.size(), -5.0f), s);
      DeviceArray<T> dy(n);
      auto again = up_as<T>(Vec(static_cast<size_t>(n), std::nanf("")), s);
      m3::gpu::GatingBwd<T> p{y.data(),  z.data(),  dg.data(),  ngw.data(),
                              norm ? rstd.data() : nullptr,  dy.data(),
                              dz.data(), dngw.data()};
      p.ldz = ld;
      if (rewrite) p.gated = again.data();
      m3::gpu::gating_backward<T>(s, d, p, sc.get());
      return Named{{"gated", down_as(again, s)}, {"d_y", down_as(dy, s)}, {"d_z", down_as(dz, s)},
                   {"d_norm_gate_weight", down(dngw, s)}};
    };
    const Named plain = backward(false), got = backward(true);
    expect_bitwise("gated written again by B7 against F7's", got.at("gated"), want_gated);
    for (const char* name : {"d_y", "d_z", "d_norm_gate_weight"})
      EXPECT_EQ(got.at(name), plain.at(name)) << name << " changed by the rewrite";
  }
}

TEST_P(GpuStagesA, GatingBackwardRewritesTheForwardsGated) {
  M3_SKIP_WITHOUT_GPU();
  for (bool norm : {false, true}) {
    SCOPED_TRACE(norm ? "is_outproj_norm" : "silu gate");
    const World w = make_world(GetParam(), norm);
    expect_gated_rewritten<float>(w.d, w.a.y, w.a.z, w.g.d_gated, w.p.norm_gate_weight,
                                  w.pg0.norm_gate_weight, norm);
  }
}

TYPED_TEST(TypedStages, GatingBackwardRewritesTheForwardsGated) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases)
    for (bool norm : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (norm ? " is_outproj_norm" : " silu gate"));
      const TypedWorld<T> w = make_typed_world<T>(c, norm);
      expect_gated_rewritten<T>(w.d, w.a.y, w.a.z, w.g.d_gated, w.p.norm_gate_weight,
                                w.pg0.norm_gate_weight, norm);
    }
}

}  // namespace
