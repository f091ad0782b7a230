// Timing of the GPU backbone (METHOD.md: CUDA events around the region, warm-up first, the
// median of repeats): forward, and forward + backward, of one window of (B, T) with seeded
// realistic inputs resident on the device. Plain C++ header.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "context.hpp"
#include "precision.hpp"

namespace m3::gpu {

struct GpuTiming {
  double forward_ms = 0;           // median over repeats
  double forward_backward_ms = 0;  // median over repeats
  int repeats = 0;
  // With profile: ms per stage of one extra forward+backward after the timed ones (events
  // between stages; stage names as GpuBackbone::stage_times()).
  std::vector<std::pair<std::string, double>> stages;
};

GpuTiming bench_gpu(GpuContext& ctx, const Config& cfg, Idx B, Idx T, ScanMode mode,
                    int warmup, int repeats, bool profile = false,
                    Precision storage = Precision::F32);

}  // namespace m3::gpu
