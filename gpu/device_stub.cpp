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

bool gpu_selftest() { return false; }

}  // namespace m3::gpu
