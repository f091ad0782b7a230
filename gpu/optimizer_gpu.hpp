// The optimizer step of TRAINING.md §2 on the device, over the flat f32 arenas of ParamLayout
// (reference/registry.hpp): the gradient norm and one AdamW launch, with the optimizer moments
// m and v in two device arenas of the same layout. The per-step scalars (learning rate, clip and
// loss-scale factor, bias corrections) are reference/optimizer.hpp's AdamWScalars, computed on
// the host; the per-element arithmetic is reference adamw_step<float>'s, in the same order
// with round-to-nearest intrinsics (no FMA), so the device step equals the host float step bit
// for bit.
//
//   grad_norm: sqrt(Σ g_i²), g_i widened to f64; f64 partial sums per block of kNormBlock
//              elements (each block's in a fixed tree order), then one fixed-order sum of the
//              partials: run-to-run bit-identical, within ~1e-12 relative of the host's
//              index-order grad_norm (the order inside a block differs).
//   step:      per slot s with decay flag d_s, per element (p, m, v, g at offset + i):
//              g ← g·gscale; m ← β1 m + (1−β1) g; v ← β2 v + (1−β2) g²;
//              p ← p − lr · (m/bc1 / (sqrt(v/bc2) + ε) + d_s·wd·p). Gaps are never touched.
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
  // Device arenas for m and v (layout.total floats each, zeroed), the slot table (offset,
  // size, decay flag of every slot, decay_flags(layout)) uploaded once, and the norm's
  // partial-sum scratch. Keeps a copy of layout.
  GpuOptimizer(GpuContext& ctx, const ParamLayout& layout);
  ~GpuOptimizer();
  GpuOptimizer(const GpuOptimizer&) = delete;
  GpuOptimizer& operator=(const GpuOptimizer&) = delete;

  // The gradient norm of a device gradient arena (layout.total floats; the gaps zero). One
  // synchronisation: the result is copied to the host. Non-finite input gives a non-finite
  // result.
  double grad_norm(const float* grads);

  // One AdamW step: one launch over every slot, on the context's stream (asynchronous).
  // params and grads: device arenas of layout.total floats.
  void step(const AdamWScalars& a, float* params, const float* grads);

  // The moments (layout.total floats each), for checkpoints; both synchronise.
  std::vector<float> m() const;
  std::vector<float> v() const;
  // Throws m3::Error naming the moment whose size is not layout.total.
  void set_moments(const std::vector<float>& m, const std::vector<float>& v);

  const ParamLayout& layout() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::gpu
