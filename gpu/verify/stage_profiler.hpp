// Internal to gpu/: the stage profile of GpuBackbone::set_profiling (m3h bench --profile),
// verification machinery beside the production path. mark(name) records a CUDA event on the
// stream after a stage; collect() waits for the last one and adds each stage's time (the event
// before it to its own) to the totals by name, in first-seen order. Events come from a pool
// made as needed and kept; off, mark() records nothing.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <utility>
#include <vector>

namespace m3::gpu {

class StageProfiler {
 public:
  explicit StageProfiler(cudaStream_t s) : s_(s) {}
  ~StageProfiler();
  StageProfiler(const StageProfiler&) = delete;
  StageProfiler& operator=(const StageProfiler&) = delete;

  void set_on(bool on) { on_ = on; }
  void mark(const std::string& stage);
  void collect();
  const std::vector<std::pair<std::string, double>>& times() const { return times_; }
  void reset() { times_.clear(); }

 private:
  cudaStream_t s_;
  bool on_ = false;
  std::vector<cudaEvent_t> pool_;
  std::vector<std::string> names_;
  std::vector<std::pair<std::string, double>> times_;
};

}  // namespace m3::gpu
