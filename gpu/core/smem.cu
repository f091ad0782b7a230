// opt_in_smem (smem.cuh): the one place a kernel is opted in to more than 48 KB of shared memory.
#include <cuda_runtime.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <utility>

#include "cuda_check.hpp"
#include "error.hpp"
#include "smem.cuh"

namespace m3::gpu {

namespace {

struct Record {
  std::size_t static_bytes = 0;  // the kernel's own __shared__ arrays
  std::size_t optin = 0;         // the device's per-block limit
  std::size_t raised = 0;        // dynamic bytes the attribute allows so far (0: not raised)
};

std::mutex g_mutex;
std::map<std::pair<const void*, int>, Record> g_records;  // (kernel, device) → Record

}  // namespace

void opt_in_smem_raw(const void* kernel, std::size_t dynamic, const char* where) {
  int dev = 0;
  M3_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lock(g_mutex);
  auto [it, fresh] = g_records.try_emplace({kernel, dev});
  Record& r = it->second;
  if (fresh) {
    cudaFuncAttributes attr{};
    int optin = 0;
    M3_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    M3_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    r.static_bytes = attr.sharedSizeBytes;
    r.optin = static_cast<std::size_t>(optin);
  }
  const std::size_t total = r.static_bytes + dynamic;
  M3_REQUIRE(total <= r.optin, where, "shared memory per block exceeds the device limit", "need ",
             total, " bytes (", r.static_bytes, " static + ", dynamic, " dynamic), have ",
             r.optin);
  if (total <= kDefaultSmemBytes || dynamic <= r.raised) return;
  M3_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     static_cast<int>(dynamic)));
  r.raised = dynamic;
}

}  // namespace m3::gpu
