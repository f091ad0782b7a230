// The ZeRO-1 shard arithmetic (train/shard.hpp, TRAINING.md §8) without NCCL: the plan covers
// the arena with block-aligned contiguous shards; the ranks' gathered norm partials give the
// unsharded norm bit for bit; AdamW shard by shard, gathered, is the unsharded step bit for bit
// (params, m and v), for G = 1, 2, 3, 5 and 8 on a token model's real layout.
#include <gtest/gtest.h>

#include <vector>

#include "error.hpp"
#include "optimizer.hpp"
#include "params.hpp"
#include "registry.hpp"
#include "shard.hpp"
#include "test_util.hpp"

namespace {

using m3::Idx;
using m3::train::Shard;

TEST(ShardPlan, CoversTheArenaInRankOrderWithBlockAlignedBoundaries) {
  for (Idx total : {Idx(0), Idx(1), Idx(4095), Idx(4096), Idx(4097), Idx(100000), Idx(1) << 20})
    for (int G : {1, 2, 3, 7, 64}) {
      const auto plan = m3::train::shard_plan(total, G);
      ASSERT_EQ(static_cast<int>(plan.size()), G);
      Idx at = 0, most = 0, least = total;
      for (const Shard& s : plan) {
        EXPECT_EQ(s.begin, at);
        EXPECT_LE(s.begin, s.end);
        EXPECT_EQ(s.begin % m3::kNormBlock, 0) << "total " << total << " G " << G;
        at = s.end;
        most = std::max(most, s.size());
        least = std::min(least, s.size());
      }
      EXPECT_EQ(at, total);
      if (total >= G * m3::kNormBlock) {
        EXPECT_LE(most - least, m3::kNormBlock) << "balanced to a block";
      }
    }
  EXPECT_THROW(m3::train::shard_plan(10, 0), m3::Error);
}

TEST(ShardedStep, GatheredShardsEqualTheUnshardedStepBitForBit) {
  m3::Config cfg = m3::test::small_cfg(32, 8, 16, 1, 0.5, false, 3, 8, false, 40);
  cfg.vocab_size = 40;
  const m3::ParamLayout layout = m3::param_layout(cfg);
  const auto decay = m3::decay_flags(layout);
  ASSERT_GT(layout.total, 4 * m3::kNormBlock) << "several blocks, so shards cut slots";
  for (int G : {1, 2, 3, 5, 8}) {
    SCOPED_TRACE(G);
    m3::Rng rng(100 + G);
    std::vector<std::vector<float>> rank_g(static_cast<size_t>(G));
    std::vector<float> p0(static_cast<size_t>(layout.total), 0.0f), m0 = p0, v0 = p0;
    for (auto& g : rank_g) {
      g.assign(static_cast<size_t>(layout.total), 0.0f);
      for (const auto& s : layout.slots)
        for (Idx i = s.offset; i < s.offset + s.size; ++i) g[i] = static_cast<float>(rng.uniform(-1, 1));
    }
    for (const auto& s : layout.slots)
      for (Idx i = s.offset; i < s.offset + s.size; ++i) {
        p0[i] = static_cast<float>(rng.uniform(-1, 1));
        m0[i] = static_cast<float>(rng.uniform(-0.1, 0.1));
        v0[i] = static_cast<float>(rng.uniform(0, 0.01));
      }
    std::vector<const float*> ptrs;
    for (const auto& g : rank_g) ptrs.push_back(g.data());
    // One GPU: the summed gradient, its norm, one step.
    std::vector<float> sum(static_cast<size_t>(layout.total));
    m3::train::fixed_order_sum(ptrs, {0, layout.total}, sum.data());
    const double norm = m3::grad_norm(sum.data(), layout.total);
    m3::OptimConfig o;
    o.clip = 0.5;
    const m3::AdamWScalars a = m3::adamw_scalars(o, 7, m3::clip_coefficient(norm, o.clip), 4.0);
    std::vector<float> p = p0, m = m0, v = v0;
    m3::adamw_step(layout, decay, a, p.data(), m.data(), v.data(), sum.data());
    // G ranks: each sums its shard in rank order, contributes its norm partials, steps its shard.
    const auto plan = m3::train::shard_plan(layout.total, G);
    std::vector<double> partials;
    std::vector<std::vector<float>> shard_sum;
    for (const Shard& s : plan) {
      shard_sum.emplace_back(static_cast<size_t>(s.size()));
      m3::train::fixed_order_sum(ptrs, s, shard_sum.back().data());
      // the shard's partials, on a full-arena view of its summed piece
      std::vector<float> view(static_cast<size_t>(layout.total), 0.0f);
      std::copy(shard_sum.back().begin(), shard_sum.back().end(), view.begin() + s.begin);
      for (double x : m3::norm_partials(view.data(), s.begin, s.end)) partials.push_back(x);
    }
    EXPECT_EQ(m3::norm_from_partials(partials), norm) << "the global norm, bit for bit";
    std::vector<float> ps = p0, ms = m0, vs = v0, gathered_g(static_cast<size_t>(layout.total));
    for (size_t r = 0; r < plan.size(); ++r)
      std::copy(shard_sum[r].begin(), shard_sum[r].end(), gathered_g.begin() + plan[r].begin);
    for (const Shard& s : plan)
      m3::adamw_step_range(layout, decay, a, s.begin, s.end, ps.data(), ms.data(), vs.data(),
                           gathered_g.data());
    EXPECT_EQ(ps, p);
    EXPECT_EQ(ms, m);
    EXPECT_EQ(vs, v);
  }
}

TEST(ShardedStep, TheSummationOrderIsTheRanksOrder) {
  // 1e8 + 1 − 1e8 in float: 0 left to right, 1 in another order.
  const std::vector<float> a = {1e8f}, b = {1.0f}, c = {-1e8f};
  float out = -1;
  m3::train::fixed_order_sum({a.data(), b.data(), c.data()}, {0, 1}, &out);
  EXPECT_EQ(out, (1e8f + 1.0f) + -1e8f);
  m3::train::fixed_order_sum({a.data(), c.data(), b.data()}, {0, 1}, &out);
  EXPECT_EQ(out, (1e8f + -1e8f) + 1.0f);
}

}  // namespace
