// The arithmetic of the data-parallel ZeRO-1 step (TRAINING.md §8), without NCCL.
//
// G ranks each hold the gradient of their share of the global batch over the whole flat arena
// (ParamLayout, layout.total floats). Rank g owns the contiguous shard [begin_g, end_g):
//   1. it receives the other ranks' pieces of its shard and sums them in rank order,
//        ĝ[i] = ((g_0[i] + g_1[i]) + g_2[i]) + … + g_{G−1}[i]      (never an order NCCL picks)
//   2. its f64 norm partials of ĝ over its shard's blocks (norm_partials); the ranks' partials
//      gathered in rank order are grad_norm's own, so every rank gets the global norm bit for
//      bit as one GPU would (shards start at multiples of kNormBlock);
//   3. AdamW on its shard with its shard of m and v (adamw_step_range: the same per-element
//      arithmetic as the unsharded step), and the updated parameters are all-gathered.
// So for a fixed G the step is deterministic, and it equals the one-GPU step on the summed
// gradient bit for bit; G ranks against one GPU on the same global batch differ only by the
// gradients' summation order (each rank's backward sums its own rows).
#pragma once

#include <vector>

#include "config.hpp"

namespace m3::train {

struct Shard {
  Idx begin = 0, end = 0;  // [begin, end) of the flat arena
  Idx size() const { return end - begin; }
};

// G ≥ 1 contiguous shards covering [0, total) in rank order, as equal as whole blocks of
// kNormBlock allow (every boundary a multiple of kNormBlock; a rank past the end gets an empty
// shard at total). Throws m3::Error for G < 1 or total < 0.
std::vector<Shard> shard_plan(Idx total, int G);

// out[i − s.begin] = ((g[0][i] + g[1][i]) + …) for i in the shard, in rank order, in float.
void fixed_order_sum(const std::vector<const float*>& rank_grads, Shard s, float* out);

}  // namespace m3::train
