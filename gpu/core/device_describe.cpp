// describe(): the one-line text of a DeviceInfo, shared by the CUDA and the CPU-only builds.
#include <cstdio>
#include <string>

#include "device.hpp"

namespace m3::gpu {

std::string describe(const DeviceInfo& info) {
  if (!info.present) return "no GPU: " + info.why_absent;
  char mem[32];
  std::snprintf(mem, sizeof mem, "%.1f GiB",
                static_cast<double>(info.total_mem) / (1024.0 * 1024.0 * 1024.0));
  return "GPU 0 of " + std::to_string(info.count) + ": " + info.name + ", sm_" +
         std::to_string(info.cc_major) + std::to_string(info.cc_minor) + ", " + mem;
}

std::string bits_environment(const DeviceInfo& info) {
  if (!info.present) return "no GPU: " + info.why_absent;
  auto dotted = [](int v, int parts) {  // 13000 → "13.0" (runtime), 130100 → "13.1.0" (cuBLAS)
    return parts == 2 ? std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10)
                      : std::to_string(v / 10000) + "." + std::to_string(v % 10000 / 100) + "." +
                            std::to_string(v % 100);
  };
  return info.name + ", sm_" + std::to_string(info.cc_major) + std::to_string(info.cc_minor) +
         ", CUDA runtime " + dotted(info.runtime_version, 2) + ", cuBLAS " +
         dotted(cublas_version(), 3);
}

}  // namespace m3::gpu
