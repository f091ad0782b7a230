// The device optimizer step (gpu/optimizer_gpu.hpp) against the host reference
// (reference/optimizer.hpp): the gradient norm within 1e-12 relative of the host's and
// bit-identical over two calls (and non-finite on a NaN); one AdamW step (and a second one
// chained on it) equal to the host float adamw_step bit for bit in params, m and v, through the
// float4 path and, on arenas one float off 16-byte alignment, the scalar path; the gaps of the
// layout untouched; the moments' round trip. Skips itself, with the reason, when no CUDA device
// is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
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
    // Gradients over several decades of magnitude, the gaps zero (as in the gradient arena).
    std::vector<float> g = arena(layout, 5, -1.0f, 1.0f, 0.0f);
    for (std::size_t i = 0; i < g.size(); i += 7) g[i] *= 1e3f;
    for (std::size_t i = 3; i < g.size(); i += 11) g[i] *= 1e-4f;
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

}  // namespace
