// cuBLAS is loaded when first used (gpu/core/cublas_api.hpp): the device query every command
// makes, and a comparison that never touches the GPU, leave it unloaded — its libraries are
// about 150 MB resident — and the first GPU context loads it. Each test runs in its own
// process (gtest_discover_tests under ctest), so "unloaded" is this test's own state.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

#include "context.hpp"
#include "cublas_api.hpp"
#include "device.hpp"
#include "run.hpp"

namespace {

using namespace m3;
using namespace m3::harness;

// Whether the process maps a file whose path contains `name` (/proc/self/maps).
bool maps_mention(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line))
    if (line.find(name) != std::string::npos) return true;
  return false;
}

TEST(CublasLoader, ACpuComparisonLeavesCublasUnloaded) {
  (void)gpu::query_device();  // what every command asks first, with or without a device
  RunSpec spec;
  spec.T = 16;
  spec.cfg.n_layers = 1;
  const Problem pb = build_problem(spec);
  const Comparison c =
      run_comparison(spec, pb, reference_oracle(), cpu_lineups({Precision::F32, Precision::BF16}));
  EXPECT_TRUE(c.pass());
  EXPECT_FALSE(gpu::cublas_loaded());
  EXPECT_FALSE(maps_mention("libcublas"));
}

TEST(CublasLoader, TheFirstGpuContextLoadsIt) {
  const gpu::DeviceInfo info = gpu::query_device();
  if (!info.present) GTEST_SKIP() << "no CUDA device: " << info.why_absent;
  {
    gpu::GpuContext ctx(0);
    EXPECT_TRUE(gpu::cublas_loaded());
    EXPECT_TRUE(maps_mention("libcublasLt"));
  }
  EXPECT_GT(gpu::cublas_version(), 0);
}

}  // namespace
