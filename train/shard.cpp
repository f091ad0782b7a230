// The ZeRO-1 shard arithmetic (shard.hpp).
#include "shard.hpp"

#include "error.hpp"
#include "optimizer.hpp"

namespace m3::train {

std::vector<Shard> shard_plan(Idx total, int G) {
  M3_REQUIRE(G >= 1, "shard_plan", "the number of ranks must be >= 1", "G=", G);
  M3_REQUIRE(total >= 0, "shard_plan", "the arena size must be >= 0", "total=", total);
  const Idx blocks = (total + kNormBlock - 1) / kNormBlock;
  std::vector<Shard> out;
  Idx at = 0;
  for (int g = 0; g < G; ++g) {
    // rank g gets blocks [g·blocks/G, (g+1)·blocks/G): sizes differ by at most one block.
    const Idx b1 = blocks * (g + 1) / G;
    const Idx end = b1 * kNormBlock < total ? b1 * kNormBlock : total;
    out.push_back({at, end});
    at = end;
  }
  return out;
}

void fixed_order_sum(const std::vector<const float*>& rank_grads, Shard s, float* out) {
  M3_REQUIRE(!rank_grads.empty(), "fixed_order_sum", "no rank", "");
  for (Idx i = s.begin; i < s.end; ++i) {
    float acc = rank_grads[0][i];
    for (size_t r = 1; r < rank_grads.size(); ++r) acc += rank_grads[r][i];
    out[i - s.begin] = acc;
  }
}

}  // namespace m3::train
