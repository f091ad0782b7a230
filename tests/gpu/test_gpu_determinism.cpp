// The GPU side of m3h determinism at CI scale (GpuBackbone::repeat_digests): a rerun digests
// every registry tensor and gradient on the device; the digests repeat run after run, a capture
// run digests the same (the rerun stores exactly what a Capture reads) and captures what
// run_gpu captures, and one changed weight changes the digests from the first tensor it
// reaches on. Every test skips without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include <string>
#include <vector>

#include "backbone.hpp"  // capture_grads
#include "backbone_gpu.hpp"
#include "context.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "precision.hpp"
#include "problem.hpp"

namespace {

using m3::Config;
using m3::Precision;
using m3::ScanMode;

Config small(bool lm) {
  Config c;
  c.d_model = 32;
  c.d_state = 16;
  c.headdim = 16;
  c.n_layers = 2;
  c.chunk_size = 16;
  c.input_dim = 32;
  if (lm) {
    c.vocab_size = 19;
    c.input_dim = 19;
  }
  return c;
}

// fn(lm, storage, mode) for every (model kind, storage, scan mode), traced.
template <class F>
void for_each_cell(F fn) {
  for (bool lm : {false, true})
    for (Precision st : {Precision::F32, Precision::BF16, Precision::F16})
      for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
        SCOPED_TRACE(std::string(lm ? "lm " : "") + m3::precision_name(st) + " " +
                     m3::scan_mode_name(mode));
        fn(lm, st, mode);
      }
}

TEST(GpuRepeat, DigestsRepeatAndACaptureRunDigestsAndCapturesTheSame) {
  M3_SKIP_WITHOUT_GPU();
  m3::gpu::GpuContext ctx;
  for_each_cell([&](bool lm, Precision st, ScanMode mode) {
        const Config cfg = small(lm);
        const m3::Problem pb = m3::make_problem(cfg, 2, 40, 7, true);
        m3::gpu::GpuBackbone net(ctx, cfg, pb.B, pb.T, mode, st);
        m3::gpu::load_problem(net, pb);
        m3::Capture cap(cfg, pb.B, pb.T);
        const auto d0 = net.repeat_digests(&cap);
        const auto d1 = net.repeat_digests();
        const auto d2 = net.repeat_digests();
        ASSERT_EQ(d0.size(), m3::gpu::repeat_digest_keys(cfg, pb.B, pb.T, mode).size());
        EXPECT_EQ(d0, d1) << "a capture run digests differently from a plain rerun";
        EXPECT_EQ(d1, d2);
        m3::capture_grads(net.grads(), cfg, cap);
        const m3::Capture ref = m3::gpu::run_gpu(ctx, pb, mode, st);
        EXPECT_EQ(first_bit_difference(ref, cap), "") << "the rerun computes what run_gpu does";
  });
}

// What the device comparison reads in place (GpuBackbone::device_tensor) is what a Capture of
// the same run holds, bit for bit, for every key: no buffer is overwritten after its stage.
TEST(GpuRepeat, EveryKeysBufferAfterTheRunHoldsWhatTheCaptureTook) {
  M3_SKIP_WITHOUT_GPU();
  m3::gpu::GpuContext ctx;
  for_each_cell([&](bool lm, Precision st, ScanMode mode) {
        const Config cfg = small(lm);
        const m3::Problem pb = m3::make_problem(cfg, 2, 40, 5, true);
        m3::gpu::GpuBackbone net(ctx, cfg, pb.B, pb.T, mode, st);
        m3::gpu::load_problem(net, pb);
        EXPECT_THROW(net.device_tensor("L0/F6/y"), m3::Error) << "readable before any run";
        m3::Capture cap(cfg, pb.B, pb.T);
        net.repeat_digests(&cap);
        m3::capture_grads(net.grads(), cfg, cap);
        for (const std::string& key : m3::gpu::repeat_digest_keys(cfg, pb.B, pb.T, mode)) {
          const auto t = net.device_tensor(key);
          const std::vector<double>& want = cap.at(key).data;
          ASSERT_EQ(static_cast<size_t>(t.n), want.size()) << key;
          const size_t elem = t.storage == Precision::F32 ? 4 : 2;
          std::vector<unsigned char> raw(want.size() * elem);
          ASSERT_EQ(cudaMemcpy(raw.data(), t.data, raw.size(), cudaMemcpyDeviceToHost), cudaSuccess);
          size_t bad = want.size();
          for (size_t i = 0; i < want.size() && bad == want.size(); ++i) {
            float v;
            if (elem == 4) {
              std::memcpy(&v, raw.data() + 4 * i, 4);
            } else {
              std::uint16_t h;
              std::memcpy(&h, raw.data() + 2 * i, 2);
              v = t.storage == Precision::BF16 ? m3::bf16_bits_to_float(h) : m3::f16_bits_to_float(h);
            }
            if (static_cast<double>(v) != want[i] && !(std::isnan(v) && std::isnan(want[i])))
              bad = i;
          }
          EXPECT_EQ(bad, want.size()) << key << ": the buffer differs from the capture at " << bad;
        }
        EXPECT_THROW(net.device_tensor("L9/F6/y"), m3::Error);
  });
}

TEST(GpuRepeat, OneChangedWeightChangesTheDigestsFromTheFirstTensorItReaches) {
  M3_SKIP_WITHOUT_GPU();
  m3::gpu::GpuContext ctx;
  const Config cfg = small(false);
  const m3::Problem pb = m3::make_problem(cfg, 2, 40, 9, true);
  m3::gpu::GpuBackbone net(ctx, cfg, pb.B, pb.T, ScanMode::Chunked, Precision::BF16);
  m3::gpu::load_problem(net, pb);
  const auto keys = m3::gpu::repeat_digest_keys(cfg, pb.B, pb.T, ScanMode::Chunked);
  const auto d0 = net.repeat_digests();
  m3::Params<float> p = m3::cast_params<float>(pb.params);
  p.layers[1].out_proj_w[5] *= 1.5f;
  net.set_params(p);
  const auto d1 = net.repeat_digests();
  size_t first = d0.size();
  for (size_t i = 0; i < d0.size() && first == d0.size(); ++i)
    if (d0[i] != d1[i]) first = i;
  ASSERT_LT(first, d0.size()) << "no digest changed";
  EXPECT_EQ(keys[first], "L1/F8/out_flat");
}

}  // namespace
