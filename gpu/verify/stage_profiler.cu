// StageProfiler (stage_profiler.hpp).
#include "stage_profiler.hpp"

#include <algorithm>

#include "cuda_check.hpp"

namespace m3::gpu {

StageProfiler::~StageProfiler() {
  for (cudaEvent_t e : pool_) cudaEventDestroy(e);
}

void StageProfiler::mark(const std::string& stage) {
  if (!on_) return;
  if (names_.size() == pool_.size()) {
    cudaEvent_t e;
    M3_CUDA_CHECK(cudaEventCreate(&e));
    pool_.push_back(e);
  }
  M3_CUDA_CHECK(cudaEventRecord(pool_[names_.size()], s_));
  names_.push_back(stage);
}

void StageProfiler::collect() {
  if (!on_ || names_.size() < 2) {
    names_.clear();
    return;
  }
  M3_CUDA_CHECK(cudaEventSynchronize(pool_[names_.size() - 1]));
  for (size_t i = 1; i < names_.size(); ++i) {
    float ms = 0;
    M3_CUDA_CHECK(cudaEventElapsedTime(&ms, pool_[i - 1], pool_[i]));
    auto it = std::find_if(times_.begin(), times_.end(),
                           [&](const auto& e) { return e.first == names_[i]; });
    if (it == times_.end()) {
      times_.emplace_back(names_[i], ms);
    } else {
      it->second += ms;
    }
  }
  names_.clear();
}

}  // namespace m3::gpu
