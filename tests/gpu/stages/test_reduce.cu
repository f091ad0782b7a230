// The deterministic reductions and elementwise helpers (gpu/stages/reduce.cu, reduce.cuh;
// MODEL.md §7): colsum against a double sum and, bit for bit, against its stated order;
// colsum_rows_pair against two colsum_rows; add and convert exact; the launchers' refusal of a
// short scratch; and every reducing launcher of family A run twice on the same inputs giving
// identical bits (GpuStagesA.ReducingStagesAreBitwiseDeterministic).
#include <gtest/gtest.h>

#include <algorithm>
#include <initializer_list>
#include <string>
#include <vector>

#include "reduce.cuh"

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

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
