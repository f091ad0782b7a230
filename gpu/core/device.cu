// CUDA build (M3_CUDA=ON): device query through the CUDA runtime, and a self-test kernel.
//
// query_device(): cudaGetDeviceCount, then cudaGetDeviceProperties of device 0; never throws.
// gpu_selftest(): c[i] = a[i] + b[i] for i < n (n = 1000, a[i] = i, b[i] = 2i, all float),
// computed by add_kernel on device 0 and checked exactly on the host (small integers are
// exact in float). It exists so that nvcc compiles and the device runs real device code.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "common.cuh"
#include "cuda_check.hpp"
#include "device.hpp"

namespace m3::gpu {

namespace {

// c[i] = a[i] + b[i]; a, b, c are (n,).
__global__ void add_kernel(const float* a, const float* b, float* c, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) c[i] = a[i] + b[i];
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
using DeviceBuffer = std::unique_ptr<float, CudaFree>;

DeviceBuffer device_alloc(std::size_t count) {
  void* p = nullptr;
  M3_CUDA_CHECK(cudaMalloc(&p, count * sizeof(float)));
  return DeviceBuffer(static_cast<float*>(p));
}

}  // namespace

bool cuda_compiled() { return true; }

DeviceInfo query_device() {
  DeviceInfo info;
  try {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();  // clear the error so later calls do not report it again
      info.why_absent = std::string("cudaGetDeviceCount: ") + cudaGetErrorString(err);
      return info;
    }
    info.count = count;
    if (count == 0) {
      info.why_absent = "no CUDA device found";
      return info;
    }
    cudaDeviceProp prop{};
    err = cudaGetDeviceProperties(&prop, 0);
    if (err != cudaSuccess) {
      cudaGetLastError();
      info.why_absent = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err);
      return info;
    }
    info.present = true;
    info.name = prop.name;
    info.cc_major = prop.major;
    info.cc_minor = prop.minor;
    info.total_mem = prop.totalGlobalMem;
    if (cudaRuntimeGetVersion(&info.runtime_version) != cudaSuccess) cudaGetLastError();
  } catch (const std::exception& e) {
    info.present = false;
    info.why_absent = std::string("device query failed: ") + e.what();
  }
  return info;
}

int cublas_version() {
  try {
    int major = 0, minor = 0, patch = 0;
    if (cublas().get_property(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
        cublas().get_property(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
        cublas().get_property(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS)
      return major * 10000 + minor * 100 + patch;
  } catch (const std::exception&) {
  }
  return 0;
}

bool gpu_selftest() {
  if (!query_device().present) return false;
  constexpr int n = 1000;
  std::vector<float> a(n), b(n), c(n, 0.0f);
  for (int i = 0; i < n; ++i) {
    a[i] = static_cast<float>(i);
    b[i] = static_cast<float>(2 * i);
  }
  M3_CUDA_CHECK(cudaSetDevice(0));
  DeviceBuffer da = device_alloc(n), db = device_alloc(n), dc = device_alloc(n);
  M3_CUDA_CHECK(cudaMemcpy(da.get(), a.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  M3_CUDA_CHECK(cudaMemcpy(db.get(), b.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  constexpr int block = 256;
  add_kernel<<<(n + block - 1) / block, block>>>(da.get(), db.get(), dc.get(), n);
  M3_CUDA_CHECK(cudaGetLastError());
  M3_CUDA_CHECK(cudaMemcpy(c.data(), dc.get(), n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int i = 0; i < n; ++i) {
    if (c[i] != static_cast<float>(3 * i)) return false;
  }
  return true;
}

namespace {
std::atomic<std::size_t> g_live{0}, g_peak{0};
}  // namespace

void count_device_bytes(std::ptrdiff_t delta) {
  const std::size_t now = g_live.fetch_add(static_cast<std::size_t>(delta)) +
                          static_cast<std::size_t>(delta);
  std::size_t peak = g_peak.load();
  while (now > peak && !g_peak.compare_exchange_weak(peak, now)) {
  }
}

std::size_t device_bytes_live() { return g_live.load(); }
std::size_t device_bytes_peak() { return g_peak.load(); }
void reset_device_bytes_peak() { g_peak.store(g_live.load()); }

}  // namespace m3::gpu
