// opt_in_smem (gpu/core/smem.cuh), which every launcher of more than 48 KB of shared memory
// calls: a kernel of static plus dynamic shared memory past 48 KB is refused without the
// opt-in, launches after it, and the opt-in refuses (m3::Error) past the device limit.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "error.hpp"
#include "smem.cuh"

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

// 40 KB of static shared memory, plus `n_dyn` floats of dynamic: out = fixed[last] + dyn[last].
constexpr int kProbeStatic = 10 * 1024;
template <int Tag>
__global__ void smem_probe_kernel(int n_dyn, float* out) {
  __shared__ float fixed[kProbeStatic];
  extern __shared__ float dyn[];
  for (int i = threadIdx.x; i < kProbeStatic; i += blockDim.x) fixed[i] = float(i);
  for (int i = threadIdx.x; i < n_dyn; i += blockDim.x) dyn[i] = 2.0f * float(i);
  __syncthreads();
  if (threadIdx.x == 0) out[0] = fixed[kProbeStatic - 1] + dyn[n_dyn - 1] + float(Tag);
}

// Static plus dynamic past 48 KB: refused without the opt-in (so the test can fail), launched
// after it (once, and again with fewer bytes), and refused with m3::Error past the device limit.
TEST(GpuSmem, OptInCountsStaticBytesAndRefusesPastTheDeviceLimit) {
  M3_SKIP_WITHOUT_GPU();
  const int n_dyn = 4 * 1024;  // 16 KB: 56 KB in all
  const std::size_t dyn = n_dyn * sizeof(float);
  DeviceArray<float> out(1);
  smem_probe_kernel<0><<<1, 128, dyn>>>(n_dyn, out.data());
  EXPECT_NE(cudaGetLastError(), cudaSuccess) << "56 KB launched without the opt-in";

  auto probe = smem_probe_kernel<1>;
  for (int k : {n_dyn, n_dyn / 2, n_dyn}) {
    const std::size_t bytes = k * sizeof(float);
    m3::gpu::opt_in_smem(probe, bytes, "test");
    probe<<<1, 128, bytes>>>(k, out.data());
    ASSERT_EQ(cudaGetLastError(), cudaSuccess) << k << " dynamic floats";
    float h = 0;
    ASSERT_EQ(cudaMemcpy(&h, out.data(), sizeof h, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(h, float(kProbeStatic - 1) + 2.0f * float(k - 1) + 1.0f);
  }
  int optin = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0),
            cudaSuccess);
  try {
    m3::gpu::opt_in_smem(probe, static_cast<std::size_t>(optin), "test");
    ADD_FAILURE() << "static + the whole opt-in limit was accepted";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the device limit"), std::string::npos)
        << e.what();
  }
}

}  // namespace
