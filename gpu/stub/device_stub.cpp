// CPU-only build (M3_CUDA=OFF): the device API of device.hpp with no CUDA behind it.
// query_device() reports that no device is present and why; gpu_selftest() returns false.
#include "device.hpp"

namespace m3::gpu {

bool cuda_compiled() { return false; }

DeviceInfo query_device() {
  DeviceInfo info;
  info.why_absent = "built without CUDA (M3_CUDA=OFF)";
  return info;
}

int cublas_version() { return 0; }

bool gpu_selftest() { return false; }

std::size_t device_bytes_live() { return 0; }
std::size_t device_bytes_peak() { return 0; }
void reset_device_bytes_peak() {}

}  // namespace m3::gpu
