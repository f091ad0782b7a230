// Angles and RoPE (gpu/stages/rope.cu: F5, F4e/f, the B6 RoPE tail, B5a; MODEL.md §4, §6.2,
// §12.3) against the reference:
//   GpuStagesA.*        each launcher on the f32 world of each stage case; angles θ ∈ [0, 2π)
//                       by circular distance ≤ 1e-4, the rest by rel_l2 and max|Δ|/max;
//   GpuAngles.*         F5 and B5a over lengths around the tiling (tiles of 32 segments × 8
//                       steps), against the serial reference and the double reference;
//   GpuAnglesFull.*     the official widths' instantiations (na = nh = 32) against the generic
//                       ones, bit for bit;
//   TypedStages.Rope*   RoPE forward and backward in the bf16/f16 storage emulation.
// Tolerances not stated here: tests/gpu/stage_fixtures.cuh.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

constexpr double kAngleTol = 1e-4;

// Angles in [0, 2π): every value in range, and the largest circular distance
// |remainder(gpu − ref, 2π)| — the harness's max_abs of a circular tensor — within tol.
void expect_close_angles(const std::string& what, const Vec& got, const Vec& want,
                         double tol = kAngleTol) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_TRUE(got[i] >= 0.0f && got[i] < static_cast<float>(kTwoPi) + 1e-6f)
        << what << "[" << i << "] = " << got[i] << " outside [0, 2π)";
  const double worst = m3::test::max_abs_err(got, want, /*circular=*/true);
  EXPECT_LE(worst, tol) << what << ": max circular distance";
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
// 4.8e-7), with and without angle_in, at every step and for angle_out. At T = 4097 with dt up to
// 2.5 an increment formed with π rounded to float would drift from the reference's by about
// 4.5e-5 (2.8e-8 of the net 1600 rad turned), far past 1e-6; the reference takes π unrounded
// (FloatAngles.TheIncrementCarriesNoErrorOfPisRounding), so this holds the device to that too.
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

// F4e/f: k, q rounded once.
TYPED_TEST(TypedStages, RopeForwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    SCOPED_TRACE(c.name);
    TypedWorld<T> w = make_typed_world<T>(c, false);
    const Dims& d = w.d;
    Stream s;
    const Named got = twice("rope_forward", [&] {
      auto th = up(w.a.angle_cumsum, s);
      auto bb = up_t<T>(w.a.b_biased, s), cb = up_t<T>(w.a.c_biased, s);
      DeviceArray<T> k(d.BT * d.nh * d.ds), q(d.BT * d.nh * d.ds);
      m3::gpu::rope_forward<T>(s, d, th.data(), bb.data(), cb.data(), k.data(), q.data());
      return Named{{"k", down_t(k, s)}, {"q", down_t(q, s)}};
    });
    // c·b0 − s·b1 can cancel, and sincosf is not glibc's sin/cos: a few more flips than F4
    expect_typed<T>("k", got.at("k"), w.a.k, 1e-6, 0.98);
    expect_typed<T>("q", got.at("q"), w.a.q, 1e-6, 0.98);
  }
}

// The RoPE backward with typed rotated vectors (sequential B6 tail) and with the chunked path's
// qk extra (typed c_biased / b_biased); every output f32.
TYPED_TEST(TypedStages, RopeBackwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kTypedCases) {
    for (bool extra : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (extra ? " with qk extra" : ""));
      TypedWorld<T> w = make_typed_world<T>(c, false);
      const Dims& d = w.d;
      Rng rng(5);
      Vec wqk(static_cast<size_t>(d.BT * d.nh));
      fill(wqk, rng, -1.0, 1.0);
      Vec db(w.g.d_b_pre_rope.size()), dc(db.size()), dth(w.g.d_angle_cumsum.size(), 0.0f);
      m3::ref::rope_backward_into(d, w.a.angle_cumsum.data(), w.g.d_k.data(), w.a.k.data(),
                                  db.data(), dth.data());
      m3::ref::rope_backward_into(d, w.a.angle_cumsum.data(), w.g.d_q.data(), w.a.q.data(),
                                  dc.data(), dth.data());
      if (extra)
        for (Idx i = 0; i < d.BT * d.nh; ++i)
          for (Idx n = 0; n < d.ds; ++n) {
            db[i * d.ds + n] += wqk[i] * w.a.c_biased[i * d.ds + n];
            dc[i * d.ds + n] += wqk[i] * w.a.b_biased[i * d.ds + n];
          }
      Stream s;
      const Idx n = d.BT * d.nh * d.ds;
      const Named got = twice("rope_backward", [&] {
        auto th = up(w.a.angle_cumsum, s), dk = up(w.g.d_k, s), dq = up(w.g.d_q, s),
             ew = up(wqk, s);
        auto k = up_t<T>(w.a.k, s), q = up_t<T>(w.a.q, s), ev1 = up_t<T>(w.a.c_biased, s),
             ev2 = up_t<T>(w.a.b_biased, s);
        DeviceArray<float> gdb(n), gdc(n), gdth(d.BT * d.nh * d.na);
        m3::gpu::RopeBwd<T> p{th.data(),  dk.data(),  dq.data(),   k.data(),
                              q.data(),   gdb.data(), gdc.data(),  gdth.data(),
                              extra ? ew.data() : nullptr, extra ? ev1.data() : nullptr,
                              extra ? ev2.data() : nullptr};
        m3::gpu::rope_backward<T>(s, d, p);
        return Named{{"d_b_pre_rope", down(gdb, s)}, {"d_c_pre_rope", down(gdc, s)},
                     {"d_angle_cumsum", down(gdth, s)}};
      });
      expect_close("d_b_pre_rope", got.at("d_b_pre_rope"), db);
      expect_close("d_c_pre_rope", got.at("d_c_pre_rope"), dc);
      expect_close("d_angle_cumsum", got.at("d_angle_cumsum"), dth);
    }
  }
}

}  // namespace
