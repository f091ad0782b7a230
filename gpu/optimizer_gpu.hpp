// The optimizer step of TRAINING.md §2 on the device, over the flat f32 arenas of ParamLayout
// (reference/registry.hpp): the gradient norm and one AdamW launch, with the optimizer moments
// m and v in two device arenas. The per-step scalars (learning rate, clip and loss-scale
// factor, bias corrections) are reference/optimizer.hpp's AdamWScalars, computed on the host;
// the per-element arithmetic is reference adamw_step<float>'s, in the same order with
// round-to-nearest intrinsics (no FMA), so the device step equals the host float step bit for
// bit.
//
//   grad_norm: sqrt(Σ g_i²), g_i widened to f64; f64 partial sums per block of kNormBlock
//              elements (each block's in a fixed tree order), then one fixed-order sum of the
//              partials: run-to-run bit-identical, within ~1e-12 relative of the host's
//              index-order grad_norm (the order inside a block differs).
//   step:      per slot s with decay flag d_s, per element (p, m, v, g at offset + i):
//              g ← g·gscale; m ← β1 m + (1−β1) g; v ← β2 v + (1−β2) g²;
//              p ← p − lr · (m/bc1 / (sqrt(v/bc2) + ε) + d_s·wd·p). Gaps are never touched.
//
// The shard (ZeRO-1, TRAINING.md §8, train/shard.hpp): an optimizer owns the elements
// [begin, end) of the flat arena (begin a multiple of kNormBlock; end one too, or layout.total)
// and keeps only that part of m and v: element e of the arena is m[e − begin], v[e − begin]
// ((end − begin) floats each). step reads and writes the FULL params and grads arenas
// (layout.total floats, absolute indexing) but updates only e ∈ [begin, end), each slot cut to
// the shard, with the same per-element arithmetic: the shards' steps together are the unsharded
// step bit for bit. norm_partials writes the f64 partials of the shard's blocks
// [begin/kNormBlock, ceil(end/kNormBlock)) at their global block index, each bitwise grad_norm's
// partial of that block; once the other shards' blocks are copied in (an NCCL broadcast into
// partials_device()), norm_from_partials sums all norm_blocks() partials in grad_norm's order,
// so every rank gets grad_norm's value bit for bit. The two-argument constructor is the shard
// [0, layout.total); grad_norm is always the norm of the whole arena, whatever the shard.
//
// Plain C++ header (no CUDA types): device pointers are plain float*; every call runs on the
// context's stream. Implemented by optim/adamw.cu; stub/optimizer_stub.cpp in a CPU-only build.
#pragma once

#include <memory>
#include <vector>

#include "context.hpp"
#include "optimizer.hpp"
#include "registry.hpp"

namespace m3::gpu {

class GpuOptimizer {
 public:
  // The whole arena: the shard [0, layout.total).
  GpuOptimizer(GpuContext& ctx, const ParamLayout& layout);
  // The shard [begin, end): device arenas for m and v ((end − begin) floats each, zeroed), the
  // slot table (every slot intersected with [begin, end), empty intersections dropped, with
  // its decay flag, decay_flags(layout)) uploaded once, and the norm's partial-sum scratch
  // (norm_blocks() doubles). Keeps a copy of layout. Throws m3::Error unless
  // 0 <= begin <= end <= layout.total, (begin % kNormBlock == 0 or begin == layout.total: the
  // empty shard of a rank past the last block) and (end % kNormBlock == 0 or end == layout.total).
  GpuOptimizer(GpuContext& ctx, const ParamLayout& layout, Idx begin, Idx end);
  ~GpuOptimizer();
  GpuOptimizer(const GpuOptimizer&) = delete;
  GpuOptimizer& operator=(const GpuOptimizer&) = delete;

  // The gradient norm of a device gradient arena (layout.total floats; the gaps zero), over
  // every block whatever the shard. One synchronisation: the result is copied to the host.
  // Non-finite input gives a non-finite result.
  double grad_norm(const float* grads);

  // The partials of this shard's norm blocks b ∈ [begin/kNormBlock, ceil(end/kNormBlock)) of a
  // device gradient arena (layout.total floats), written to partials_device()[b]; the other
  // entries untouched. Asynchronous, on the context's stream.
  void norm_partials(const float* grads);
  // The partials array (norm_blocks() doubles, device memory): where a caller gathers the other
  // shards' blocks, ordered with the context's stream.
  double* partials_device();
  Idx norm_blocks() const;  // ceil(layout.total / kNormBlock)
  // sqrt of the fixed-order sum of all norm_blocks() partials; one synchronisation.
  double norm_from_partials();

  // One AdamW step over the shard: one launch over its slots, on the context's stream
  // (asynchronous). params and grads: device arenas of layout.total floats; only the elements
  // in [begin, end) of params are written.
  void step(const AdamWScalars& a, float* params, const float* grads);

  // The shard's moments ((end − begin) floats each), for checkpoints; both synchronise.
  std::vector<float> m() const;
  std::vector<float> v() const;
  // Throws m3::Error naming the moment whose size is not end − begin.
  void set_moments(const std::vector<float>& m, const std::vector<float>& v);

  const ParamLayout& layout() const;
  Idx begin() const;  // the shard [begin, end) of the flat arena
  Idx end() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::gpu
