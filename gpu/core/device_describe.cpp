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

}  // namespace m3::gpu
