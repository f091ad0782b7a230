// The device optimizer step (gpu/optimizer_gpu.hpp) against the host reference
// (reference/optimizer.hpp): the gradient norm within 1e-12 relative of the host's and
// bit-identical over two calls (and non-finite on a NaN); one AdamW step (and a second one
// chained on it) equal to the host float adamw_step bit for bit in params, m and v, through the
// float4 path and, on arenas one float off 16-byte alignment, the scalar path; the gaps of the
// layout untouched; the moments' round trip. The ZeRO-1 shards (train/shard.hpp shard_plan, G = 2
// and 3, every inner boundary cutting a slot): their steps on the shard-local m and v equal the
// unsharded step bit for bit inside the shard and leave the rest of the arena alone; their norm
// partials, gathered into one array, give the unsharded grad_norm bit for bit; shards off the
// block boundaries and moments of the wrong size are refused. Skips itself, with the reason,
// when no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "config.hpp"
#include "context.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "optimizer.hpp"
#include "optimizer_gpu.hpp"
#include "registry.hpp"
#include "shard.hpp"

namespace {

using m3::Idx;
using m3::ParamLayout;
using m3::gpu::GpuOptimizer;

m3::gpu::GpuContext& ctx() {
  static m3::gpu::GpuContext c(0);
  return c;
}

// A token model whose layout spans several norm blocks and has ragged slots (gaps).
m3::Config token_config() {
  m3::Config cfg;
  cfg.d_model = 48;
  cfg.d_state = 16;
  cfg.expand = 2;
  cfg.headdim = 16;
  cfg.n_layers = 3;
  cfg.vocab_size = 97;
  cfg.input_dim = 97;
  cfg.validate();
  return cfg;
}

// A raw device buffer of n floats (+ `shift` floats in front, to misalign what data() returns).
class DeviceFloats {
 public:
  DeviceFloats(Idx n, Idx shift = 0) : n_(n), shift_(shift) {
    if (cudaMalloc(&base_, static_cast<std::size_t>(n + shift) * sizeof(float)) != cudaSuccess)
      throw m3::Error("DeviceFloats", "cudaMalloc failed", m3::why(n + shift, " floats"));
  }
  ~DeviceFloats() { cudaFree(base_); }
  DeviceFloats(const DeviceFloats&) = delete;
  DeviceFloats& operator=(const DeviceFloats&) = delete;
  float* data() { return base_ + shift_; }
  // Ordered with the context's non-blocking stream by a full synchronisation on each side.
  void upload(const std::vector<float>& h) {
    ctx().synchronize();
    ASSERT_EQ(h.size(), static_cast<std::size_t>(n_));
    ASSERT_EQ(cudaMemcpy(data(), h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }
  std::vector<float> download() {
    ctx().synchronize();
    std::vector<float> h(static_cast<std::size_t>(n_));
    EXPECT_EQ(cudaMemcpy(h.data(), data(), h.size() * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    return h;
  }

 private:
  float* base_ = nullptr;
  Idx n_, shift_;
};

std::vector<bool> in_slot_mask(const ParamLayout& layout) {
  std::vector<bool> in(static_cast<std::size_t>(layout.total), false);
  for (const auto& s : layout.slots)
    for (Idx i = s.offset; i < s.offset + s.size; ++i) in[static_cast<std::size_t>(i)] = true;
  return in;
}

// Random values in the slots, `gap` in the gaps.
std::vector<float> arena(const ParamLayout& layout, std::uint32_t seed, float lo, float hi,
                         float gap) {
  const std::vector<bool> in = in_slot_mask(layout);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> x(in.size(), gap);
  for (std::size_t i = 0; i < x.size(); ++i)
    if (in[i]) x[i] = d(rng);
  return x;
}

// A gradient arena over several decades of magnitude (every 7th value ×1e3, every 11th from
// the 3rd ×1e-4), the gaps zero, as the norm tests use it.
std::vector<float> spread_gradient(const ParamLayout& layout, std::uint32_t seed) {
  std::vector<float> g = arena(layout, seed, -1.0f, 1.0f, 0.0f);
  for (std::size_t i = 0; i < g.size(); i += 7) g[i] *= 1e3f;
  for (std::size_t i = 3; i < g.size(); i += 11) g[i] *= 1e-4f;
  return g;
}

// The first index where a and b differ in bits, or -1.
Idx first_bit_difference(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(float)) != 0) return static_cast<Idx>(i);
  return -1;
}

TEST(GpuGradNorm, MatchesTheHostWithin1e12AndRepeatsBitForBit) {
  M3_SKIP_WITHOUT_GPU();
  for (const m3::Config& cfg : {token_config(), [] {
         m3::Config c;  // the default backbone as a byte model: several hundred norm blocks
         c.vocab_size = 256;
         c.input_dim = 256;
         return c;
       }()}) {
    const ParamLayout layout = m3::param_layout(cfg);
    ASSERT_GT(layout.total, 4 * m3::kNormBlock);
    const std::vector<float> g = spread_gradient(layout, 5);
    DeviceFloats dg(layout.total);
    dg.upload(g);
    GpuOptimizer opt(ctx(), layout);
    const double host = m3::grad_norm(g.data(), layout.total);
    const double a = opt.grad_norm(dg.data());
    const double b = opt.grad_norm(dg.data());
    EXPECT_NEAR(a, host, 1e-12 * host) << "total=" << layout.total;
    EXPECT_EQ(std::memcmp(&a, &b, sizeof(double)), 0) << a << " vs " << b;
    GpuOptimizer other(ctx(), layout);  // a second instance: the same bits
    const double c = other.grad_norm(dg.data());
    EXPECT_EQ(std::memcmp(&a, &c, sizeof(double)), 0) << a << " vs " << c;
  }
}

TEST(GpuGradNorm, ANaNGradientGivesANonFiniteNorm) {
  M3_SKIP_WITHOUT_GPU();
  const ParamLayout layout = m3::param_layout(token_config());
  std::vector<float> g = arena(layout, 6, -1.0f, 1.0f, 0.0f);
  g[static_cast<std::size_t>(layout.slots.back().offset)] = std::numeric_limits<float>::quiet_NaN();
  DeviceFloats dg(layout.total);
  dg.upload(g);
  GpuOptimizer opt(ctx(), layout);
  EXPECT_FALSE(std::isfinite(opt.grad_norm(dg.data())));
}

// Two chained steps (t = 3, then t = 4) on the device and on the host from the same state:
// params, m and v equal bit for bit after each; the gaps keep their sentinels.
void expect_device_step_equals_host(Idx shift) {
  const ParamLayout layout = m3::param_layout(token_config());
  const std::vector<std::uint8_t> decay = m3::decay_flags(layout);
  const std::vector<bool> in = in_slot_mask(layout);
  m3::OptimConfig o;
  o.lr = 3e-3;
  o.warmup = 2;
  o.steps = 20;
  o.wd = 0.1;
  std::vector<float> p = arena(layout, 11, -1.0f, 1.0f, 3.25f);
  std::vector<float> m = arena(layout, 12, -0.05f, 0.05f, -1.5f);
  std::vector<float> v = arena(layout, 13, 0.0f, 1e-3f, 0.75f);
  DeviceFloats dp(layout.total, shift), dg(layout.total, shift);
  dp.upload(p);
  GpuOptimizer opt(ctx(), layout);
  opt.set_moments(m, v);
  for (Idx t = 3; t <= 4; ++t) {
    const std::vector<float> g = arena(layout, 20 + static_cast<std::uint32_t>(t), -2.0f, 2.0f,
                                       100.0f);  // a gradient in a gap must be ignored
    dg.upload(g);
    const double norm = opt.grad_norm(dg.data()) / 8.0;
    const m3::AdamWScalars a =
        m3::adamw_scalars(o, t, m3::clip_coefficient(norm, 0.5), 8.0);
    ASSERT_LT(a.gscale, 1.0 / 8.0) << "the clip should be active";
    m3::adamw_step(layout, decay, a, p.data(), m.data(), v.data(), g.data());
    opt.step(a, dp.data(), dg.data());
    const std::vector<float> gp = dp.download(), gm = opt.m(), gv = opt.v();
    EXPECT_EQ(first_bit_difference(gp, p), -1) << "params, t=" << t << " shift=" << shift;
    EXPECT_EQ(first_bit_difference(gm, m), -1) << "m, t=" << t << " shift=" << shift;
    EXPECT_EQ(first_bit_difference(gv, v), -1) << "v, t=" << t << " shift=" << shift;
    for (std::size_t i = 0; i < in.size(); ++i)
      if (!in[i]) {
        ASSERT_EQ(gp[i], 3.25f) << "gap element " << i;
        ASSERT_EQ(gm[i], -1.5f) << "gap element " << i;
        ASSERT_EQ(gv[i], 0.75f) << "gap element " << i;
      }
  }
}

TEST(GpuAdamW, OneStepEqualsTheHostFloatStepBitForBit) {
  M3_SKIP_WITHOUT_GPU();
  expect_device_step_equals_host(0);
}

TEST(GpuAdamW, TheScalarPathOnMisalignedArenasEqualsTheHostFloatStepBitForBit) {
  M3_SKIP_WITHOUT_GPU();
  expect_device_step_equals_host(1);
}

TEST(GpuAdamW, MomentsStartAtZeroAndRoundTrip) {
  M3_SKIP_WITHOUT_GPU();
  const ParamLayout layout = m3::param_layout(token_config());
  GpuOptimizer opt(ctx(), layout);
  const std::vector<float> zeros(static_cast<std::size_t>(layout.total), 0.0f);
  EXPECT_EQ(first_bit_difference(opt.m(), zeros), -1);
  EXPECT_EQ(first_bit_difference(opt.v(), zeros), -1);
  const std::vector<float> m = arena(layout, 31, -1.0f, 1.0f, 0.0f);
  const std::vector<float> v = arena(layout, 32, 0.0f, 1.0f, 0.0f);
  opt.set_moments(m, v);
  EXPECT_EQ(first_bit_difference(opt.m(), m), -1);
  EXPECT_EQ(first_bit_difference(opt.v(), v), -1);
  const std::vector<float> short_v(v.begin(), v.end() - 1);
  try {
    opt.set_moments(m, short_v);
    FAIL() << "set_moments accepted a short v";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("v must hold"), std::string::npos) << e.what();
  }
}

// [begin, end) of x.
std::vector<float> slice(const std::vector<float>& x, Idx begin, Idx end) {
  return std::vector<float>(x.begin() + begin, x.begin() + end);
}

// Whether the arena index `at` lies strictly inside a slot (a shard boundary there cuts it).
bool cuts_a_slot(const ParamLayout& layout, Idx at) {
  for (const auto& s : layout.slots)
    if (s.offset < at && at < s.offset + s.size) return true;
  return false;
}

// Two chained steps (t = 3, then t = 4) of the unsharded optimizer and of G shard optimizers
// (each on its own device copy of the params, the same grads): inside its shard each one's
// params, m and v equal the unsharded result bit for bit; outside, its params are the start's.
TEST(GpuOptimizerShard, ShardedStepsEqualTheUnshardedStepBitForBit) {
  M3_SKIP_WITHOUT_GPU();
  const ParamLayout layout = m3::param_layout(token_config());
  ASSERT_GT(layout.total, 4 * m3::kNormBlock);
  m3::OptimConfig o;
  o.lr = 3e-3;
  o.warmup = 2;
  o.steps = 20;
  o.wd = 0.1;
  const std::vector<float> p0 = arena(layout, 41, -1.0f, 1.0f, 0.0f);
  const std::vector<float> m0 = arena(layout, 42, -0.05f, 0.05f, 0.0f);
  const std::vector<float> v0 = arena(layout, 43, 0.0f, 1e-3f, 0.0f);
  const std::vector<float> g3 = arena(layout, 44, -2.0f, 2.0f, 0.0f);
  const std::vector<float> g4 = arena(layout, 45, -2.0f, 2.0f, 0.0f);
  const m3::AdamWScalars a3 = m3::adamw_scalars(o, 3, 0.75, 4.0);
  const m3::AdamWScalars a4 = m3::adamw_scalars(o, 4, 0.5, 4.0);
  DeviceFloats dg3(layout.total), dg4(layout.total);
  dg3.upload(g3);
  dg4.upload(g4);

  DeviceFloats dp(layout.total);
  dp.upload(p0);
  GpuOptimizer full(ctx(), layout);
  EXPECT_EQ(full.begin(), 0);
  EXPECT_EQ(full.end(), layout.total);
  full.set_moments(m0, v0);
  full.step(a3, dp.data(), dg3.data());
  full.step(a4, dp.data(), dg4.data());
  const std::vector<float> want_p = dp.download(), want_m = full.m(), want_v = full.v();
  ASSERT_NE(first_bit_difference(want_p, p0), -1) << "the unsharded step changed nothing";

  for (int G : {2, 3}) {
    const std::vector<m3::train::Shard> plan = m3::train::shard_plan(layout.total, G);
    ASSERT_EQ(plan.size(), static_cast<std::size_t>(G));
    for (int r = 1; r < G; ++r)
      ASSERT_TRUE(cuts_a_slot(layout, plan[static_cast<std::size_t>(r)].begin))
          << "G=" << G << ": the boundary " << plan[static_cast<std::size_t>(r)].begin
          << " cuts no slot, so the test would not cover cut slots";
    for (int r = 0; r < G; ++r) {
      const m3::train::Shard sh = plan[static_cast<std::size_t>(r)];
      GpuOptimizer opt(ctx(), layout, sh.begin, sh.end);
      EXPECT_EQ(opt.begin(), sh.begin);
      EXPECT_EQ(opt.end(), sh.end);
      opt.set_moments(slice(m0, sh.begin, sh.end), slice(v0, sh.begin, sh.end));
      DeviceFloats dps(layout.total);
      dps.upload(p0);
      opt.step(a3, dps.data(), dg3.data());
      opt.step(a4, dps.data(), dg4.data());
      const std::vector<float> gp = dps.download(), gm = opt.m(), gv = opt.v();
      const std::string at = "G=" + std::to_string(G) + " rank " + std::to_string(r) + " [" +
                             std::to_string(sh.begin) + ", " + std::to_string(sh.end) + ")";
      ASSERT_EQ(gm.size(), static_cast<std::size_t>(sh.size())) << at;
      ASSERT_EQ(gv.size(), static_cast<std::size_t>(sh.size())) << at;
      EXPECT_EQ(first_bit_difference(slice(gp, sh.begin, sh.end),
                                     slice(want_p, sh.begin, sh.end)), -1)
          << "params inside the shard, " << at;
      EXPECT_EQ(first_bit_difference(gm, slice(want_m, sh.begin, sh.end)), -1) << "m, " << at;
      EXPECT_EQ(first_bit_difference(gv, slice(want_v, sh.begin, sh.end)), -1) << "v, " << at;
      EXPECT_EQ(first_bit_difference(slice(gp, 0, sh.begin), slice(p0, 0, sh.begin)), -1)
          << "params before the shard, " << at;
      EXPECT_EQ(first_bit_difference(slice(gp, sh.end, layout.total),
                                     slice(p0, sh.end, layout.total)), -1)
          << "params after the shard, " << at;
    }
  }
}

// Each shard's norm partials of the same gradient, its blocks copied into one shard's partials
// array: norm_from_partials equals the unsharded grad_norm exactly; every shard's own grad_norm
// is still the whole arena's.
TEST(GpuOptimizerShard, GatheredPartialsGiveGradNormBitForBit) {
  M3_SKIP_WITHOUT_GPU();
  const ParamLayout layout = m3::param_layout(token_config());
  ASSERT_GT(layout.total, 4 * m3::kNormBlock);
  const std::vector<float> g = spread_gradient(layout, 51);
  DeviceFloats dg(layout.total);
  dg.upload(g);
  GpuOptimizer full(ctx(), layout);
  const Idx blocks = (layout.total + m3::kNormBlock - 1) / m3::kNormBlock;
  EXPECT_EQ(full.norm_blocks(), blocks);
  const double want = full.grad_norm(dg.data());

  for (int G : {2, 3}) {
    const std::vector<m3::train::Shard> plan = m3::train::shard_plan(layout.total, G);
    std::vector<std::unique_ptr<GpuOptimizer>> shards;
    for (const m3::train::Shard& sh : plan) {
      shards.push_back(std::make_unique<GpuOptimizer>(ctx(), layout, sh.begin, sh.end));
      EXPECT_EQ(shards.back()->norm_blocks(), blocks);
      shards.back()->norm_partials(dg.data());
    }
    ctx().synchronize();
    // The all-gather into rank 0's array, as the NCCL broadcasts would do it.
    double* gathered = shards[0]->partials_device();
    for (std::size_t r = 1; r < plan.size(); ++r) {
      const Idx b0 = plan[r].begin / m3::kNormBlock;
      const Idx b1 = (plan[r].end + m3::kNormBlock - 1) / m3::kNormBlock;
      if (b1 <= b0) continue;
      ASSERT_EQ(cudaMemcpy(gathered + b0, shards[r]->partials_device() + b0,
                           static_cast<std::size_t>(b1 - b0) * sizeof(double),
                           cudaMemcpyDeviceToDevice),
                cudaSuccess);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(shards[0]->norm_from_partials(), want) << "G=" << G;
    for (std::size_t r = 0; r < shards.size(); ++r)
      EXPECT_EQ(shards[r]->grad_norm(dg.data()), want) << "G=" << G << " rank " << r;
  }
}

TEST(GpuOptimizerShard, RejectsAShardNotOnBlockBoundaries) {
  M3_SKIP_WITHOUT_GPU();
  const ParamLayout layout = m3::param_layout(token_config());
  ASSERT_GT(layout.total, 4 * m3::kNormBlock);
  const Idx K = m3::kNormBlock;
  EXPECT_THROW(GpuOptimizer(ctx(), layout, 100, layout.total), m3::Error);
  EXPECT_THROW(GpuOptimizer(ctx(), layout, 0, K + 100), m3::Error);
  EXPECT_THROW(GpuOptimizer(ctx(), layout, 0, layout.total + K), m3::Error);
  EXPECT_THROW(GpuOptimizer(ctx(), layout, 2 * K, K), m3::Error);
  EXPECT_THROW(GpuOptimizer(ctx(), layout, -K, K), m3::Error);
  ASSERT_NE(layout.total % K, 0);
  // The empty shard at the end (a rank past the last block): accepted, and a step changes nothing.
  GpuOptimizer empty(ctx(), layout, layout.total, layout.total);
  EXPECT_TRUE(empty.m().empty());
  GpuOptimizer opt(ctx(), layout, K, 3 * K);
  const std::vector<float> shard(static_cast<std::size_t>(2 * K), 0.25f);
  const std::vector<float> whole(static_cast<std::size_t>(layout.total), 0.25f);
  opt.set_moments(shard, shard);
  EXPECT_EQ(first_bit_difference(opt.m(), shard), -1);
  try {
    opt.set_moments(whole, shard);
    FAIL() << "set_moments accepted an m of layout.total floats for a shard of " << 2 * K;
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("m must hold"), std::string::npos) << e.what();
  }
  EXPECT_THROW(opt.set_moments(shard, whole), m3::Error);
}

}  // namespace
