// RMSNorm (gpu/stages/norm.cu, MODEL.md §4 F1, §6.1 B1) against the reference, in f32 and in
// the bf16/f16 storage emulation (tests/gpu/stage_fixtures.cuh states the tolerances):
//   GpuStagesA.RmsNorm*      forward and backward on the f32 world of each stage case; this file
//                            also instantiates GpuStagesA over kCases for every family's file;
//   GpuReduce.RmsNorm*       both dw paths of the backward at widths on either side of every
//                            lane-count boundary, and rmsnorm_forward_add against add() then the
//                            norm, bit for bit;
//   TypedStages.RmsNorm*     the typed forward and backward, the backward's typed copy of its
//                            residual add, and its staged δ rows against plain global loads;
//   *.RmsnormBackwardRewritesTheForwardsY  the backward's rewrite of the forward's y (f32 and
//                            typed), bit for bit, leaving its other outputs unchanged.
#include <gtest/gtest.h>

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

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

// F1 / norm_f (u f32 → y typed) and B1 (g typed → dx, dw f32).
TYPED_TEST(TypedStages, RmsNormMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    SCOPED_TRACE(c.name);
    TypedWorld<T> w = make_typed_world<T>(c, false);
    const Dims& d = w.d;
    Rng rng(99);
    Vec u(static_cast<size_t>(d.BT * d.dm)), gy(u.size());
    for (auto& e : u) e = static_cast<float>(3.0 * rng.normalish());
    fill(gy, rng, -1.0, 1.0);
    gy = rounded<T>(gy);
    Vec y(u.size()), rms(static_cast<size_t>(d.BT)), dx(u.size()), dw = w.pg0.norm_weight;
    m3::ref::rmsnorm_forward(d.BT, d.dm, u.data(), w.p.norm_weight.data(), y.data(), rms.data());
    m3::ref::store_typed(d, y);
    m3::ref::rmsnorm_backward(d.BT, d.dm, u.data(), w.p.norm_weight.data(), rms.data(),
                              gy.data(), dx.data(), dw.data());
    Stream s;
    ScratchBuf sc(d);
    const Named got = twice("rmsnorm", [&] {
      auto du = up(u, s), dwt = up(w.p.norm_weight, s), ddw = up(w.pg0.norm_weight, s),
           drms_ref = up(rms, s);
      auto dgy = up_t<T>(gy, s);
      DeviceArray<T> dy(d.BT * d.dm);
      DeviceArray<float> drms(d.BT), ddx(d.BT * d.dm);
      m3::gpu::rmsnorm_forward<T>(s, d.BT, d.dm, du.data(), dwt.data(), dy.data(), drms.data());
      m3::gpu::rmsnorm_backward<T>(s, d.BT, d.dm, du.data(), dwt.data(), drms_ref.data(),
                                   dgy.data(), ddx.data(), ddw.data(), sc.get());
      return Named{{"y", down_t(dy, s)}, {"rms", down(drms, s)}, {"dx", down(ddx, s)},
                   {"dw", down(ddw, s)}};
    });
    expect_typed<T>("y", got.at("y"), y, 1e-6, 0.99);
    expect_close("rms", got.at("rms"), rms);
    expect_close("dx", got.at("dx"), dx);
    expect_close("dw (accumulated)", got.at("dw"), dw);
  }
}

// The inputs of the RMSNorm backward's own tests, [rows, dim] from `seed`: u (≈ 3·N(0, 1)), g
// in [−1, 1], δ (a) in [−2, 2], w in [0.5, 1.5], and u's RMS per row (ε = 1e-5, in double).
struct RmsRows {
  Vec u, g, a, w, rms;
};
RmsRows rms_rows(Idx rows, Idx dim, std::uint64_t seed) {
  const Idx n = rows * dim;
  Rng rng(seed);
  RmsRows o{Vec(static_cast<size_t>(n)), Vec(static_cast<size_t>(n)),
            Vec(static_cast<size_t>(n)), Vec(static_cast<size_t>(dim)),
            Vec(static_cast<size_t>(rows))};
  for (auto& e : o.u) e = static_cast<float>(3.0 * rng.normalish());
  fill(o.g, rng, -1.0, 1.0);
  fill(o.a, rng, -2.0, 2.0);
  fill(o.w, rng, 0.5, 1.5);
  for (Idx r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (Idx i = 0; i < dim; ++i) ss += double(o.u[r * dim + i]) * o.u[r * dim + i];
    o.rms[r] = static_cast<float>(std::sqrt(ss / double(dim) + 1e-5));
  }
  return o;
}

// B1's residual pass-through with δ's typed copy (rmsnorm_backward's add_typed, the fused
// runs' replacement of the convert before the next B8): add_out as without it, and add_typed
// the bits of convert<float, T>(add_out), contiguous rows (vectors) and an odd width (the
// element-by-element path of the same kernel).
TYPED_TEST(TypedStages, RmsnormBackwardTypedCopyIsTheConvertOfItsAdd) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  Stream s;
  for (const Idx dim : {Idx(256), Idx(1088), Idx(21)}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const Idx rows = 37, n = rows * dim;
    const RmsRows in = rms_rows(rows, dim, 5 + dim);
    auto du = up(in.u, s), dw = up(in.w, s), drms = up(in.rms, s), da = up(in.a, s);
    auto dg = up_t<T>(rounded<T>(in.g), s);
    DeviceArray<float> gw0(dim), gw1(dim), out0(n), out1(n);
    DeviceArray<T> typed(n), want(n);
    gw0.zero(s);
    gw1.zero(s);
    const Idx scr = m3::gpu::rmsnorm_backward_scratch_floats(rows, dim);
    DeviceArray<float> sc(scr);
    m3::gpu::rmsnorm_backward<T>(s, rows, dim, du.data(), dw.data(), drms.data(), dg.data(),
                                 nullptr, gw0.data(), {sc.data(), scr}, da.data(), out0.data());
    m3::gpu::rmsnorm_backward<T>(s, rows, dim, du.data(), dw.data(), drms.data(), dg.data(),
                                 nullptr, gw1.data(), {sc.data(), scr}, da.data(), out1.data(),
                                 typed.data());
    m3::gpu::convert<float, T>(s, n, out1.data(), want.data());
    EXPECT_EQ(down(out0, s), down(out1, s)) << "add_out changed with add_typed";
    EXPECT_EQ(down(gw0, s), down(gw1, s)) << "dw changed with add_typed";
    EXPECT_EQ(down_t(typed, s), down_t(want, s)) << "add_typed is not convert(add_out)";
  }
}

// B1 with δ at 32 lanes per row, vectors and dw in the kernel: norm.cu's kStage reads δ's row
// through shared memory and u's and g's through a ring row per warp (cp.async, the next row's
// copies in flight while this one is worked on); with it turned off, the same kernel reads all
// three from global memory. Every output has the same bits either way. Widths: the whole row
// in every lane's groups (1024), groups past the row's end in some lanes (1000, 260); rows:
// fewer than a block's warps (5: three warps without a row), part of one block (37) and a
// partial third block (300). (The element-by-element path is no reference here: nvcc
// contracts its dx arithmetic differently.)
TYPED_TEST(TypedStages, RmsnormBackwardStagedDeltaGivesTheBitsOfTheGlobalLoads) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  Stream s;
  struct Restore {
    ~Restore() { m3::gpu::set_rmsnorm_delta_staging_for_testing(true); }
  } restore;
  for (const Idx dim : {Idx(1024), Idx(1000), Idx(260)})
    for (const Idx rows : {Idx(5), Idx(37), Idx(300)}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + ", rows " + std::to_string(rows));
      const Idx n = rows * dim;
      const RmsRows in = rms_rows(rows, dim, 11 + dim + rows);
      auto du = up(in.u, s), dw = up(in.w, s), da = up(in.a, s), drms = up(in.rms, s);
      auto dg = up_t<T>(rounded<T>(in.g), s);
      const Idx scr = m3::gpu::rmsnorm_backward_scratch_floats(rows, dim);
      auto run = [&](bool staged) {
        m3::gpu::set_rmsnorm_delta_staging_for_testing(staged);
        DeviceArray<float> gw(dim), dx(n), out(n), sc(std::max<Idx>(scr, 1));
        DeviceArray<T> typed(n);
        gw.zero(s);
        m3::gpu::rmsnorm_backward<T>(s, rows, dim, du.data(), dw.data(), drms.data(), dg.data(),
                                     dx.data(), gw.data(), {sc.data(), scr}, da.data(),
                                     out.data(), typed.data());
        return Named{{"dx", down(dx, s)},
                     {"add_out", down(out, s)},
                     {"add_typed", down_t(typed, s)},
                     {"dw", down(gw, s)}};
      };
      expect_bitwise("δ, u and g staged against global loads", run(true), run(false));
    }
}

// B1's rewrite of the forward's y (rmsnorm_backward's y_again, what the production layout's B2
// reads instead of a saved post_norm): over a buffer of NaN, the bits rmsnorm_forward wrote
// from the same u and w with the rms it saved; and dx, add_out, add_typed and dw are the bits of
// the run without it. Widths: the staged kernel (1024, 1000, 260, with δ), one group per lane
// (96), rows wider than one chunk (1088, the second dw path) and an odd width (21, element by
// element); with and without δ (add), staging on and off.
template <class T>
void expect_y_rewritten() {
  Stream s;
  struct Restore {
    ~Restore() { m3::gpu::set_rmsnorm_delta_staging_for_testing(true); }
  } restore;
  for (const Idx dim : {Idx(1024), Idx(1000), Idx(260), Idx(96), Idx(1088), Idx(21)})
    for (const bool add : {false, true})
      for (const bool staged : {false, true}) {
        if (staged && !add) continue;  // staging reads δ's rows
        SCOPED_TRACE("dim " + std::to_string(dim) + (add ? ", with δ" : "") +
                     (staged ? ", staged" : ""));
        m3::gpu::set_rmsnorm_delta_staging_for_testing(staged);
        const Idx rows = 37, n = rows * dim;
        const RmsRows in = rms_rows(rows, dim, 31 + dim);
        auto du = up(in.u, s), dw = up(in.w, s), da = up(in.a, s);
        Vec g = in.g;  // typed: rounded to T first (up_t takes representable values only)
        if constexpr (!std::is_same_v<T, float>) g = rounded<T>(g);
        auto dg = up_as<T>(g, s);
        DeviceArray<T> y(n);
        DeviceArray<float> rms(rows);
        m3::gpu::rmsnorm_forward<T>(s, rows, dim, du.data(), dw.data(), y.data(), rms.data());
        const Idx scr = m3::gpu::rmsnorm_backward_scratch_floats(rows, dim);
        auto run = [&](bool rewrite) {
          DeviceArray<float> gw(dim), dx(n), out(add ? n : 0), sc(std::max<Idx>(scr, 1));
          DeviceArray<T> typed(add ? n : 0);
          auto again = up_as<T>(Vec(static_cast<size_t>(n), std::nanf("")), s);
          gw.zero(s);
          m3::gpu::rmsnorm_backward<T>(s, rows, dim, du.data(), dw.data(), rms.data(),
                                       dg.data(), dx.data(), gw.data(), {sc.data(), scr},
                                       add ? da.data() : nullptr, add ? out.data() : nullptr,
                                       add ? typed.data() : nullptr,
                                       rewrite ? again.data() : nullptr);
          Named o{{"dx", down(dx, s)}, {"dw", down(gw, s)}};
          if (add) {
            o["add_out"] = down(out, s);
            o["add_typed"] = down_as(typed, s);
          }
          if (rewrite) o["y"] = down_as(again, s);
          return o;
        };
        Named got = run(true);
        expect_bitwise("y written again against the forward's", {{"y", got.at("y")}},
                       {{"y", down_as(y, s)}});
        got.erase("y");
        expect_bitwise("the other outputs with and without y_again", got, run(false));
      }
}

TEST(GpuReduce, RmsnormBackwardRewritesTheForwardsY) {
  M3_SKIP_WITHOUT_GPU();
  expect_y_rewritten<float>();
}

TYPED_TEST(TypedStages, RmsnormBackwardRewritesTheForwardsY) {
  M3_SKIP_WITHOUT_GPU();
  expect_y_rewritten<TypeParam>();
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

// GpuStagesA's one instantiation, for its tests in every family's file: the f32 stage cases
// (kCases), each named by its case.
std::string case_name(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

INSTANTIATE_TEST_SUITE_P(Configs, GpuStagesA, ::testing::ValuesIn(kCases), case_name);

}  // namespace
