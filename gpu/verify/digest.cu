// Device digests of buffers (digest.cuh has the rule).
#include "digest.cuh"

#include "common.cuh"

namespace m3::gpu {

namespace {

constexpr int kDigestThreads = 256;

__device__ __forceinline__ std::uint64_t mix64(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

__global__ void digest_kernel(const DigestSegment* __restrict__ segs, std::uint64_t* __restrict__ out) {
  const DigestSegment sg = segs[blockIdx.y];
  const Idx words = sg.bytes / 2;
  const auto* w = static_cast<const std::uint16_t*>(sg.p);
  const std::uint64_t salt = mix64(0x9e3779b97f4a7c15ull * (blockIdx.y + 1));
  std::uint64_t acc = 0;
  for (Idx i = blockIdx.x * Idx(blockDim.x) + threadIdx.x; i < words;
       i += Idx(gridDim.x) * blockDim.x)
    acc += mix64((static_cast<std::uint64_t>(i) << 16 | w[i]) ^ salt);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  __shared__ std::uint64_t warp_sums[kDigestThreads / 32];
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    std::uint64_t s = 0;
    for (int k = 0; k < kDigestThreads / 32; ++k) s += warp_sums[k];
    if (blockIdx.x == 0) s += mix64(static_cast<std::uint64_t>(sg.bytes) ^ salt);
    atomicAdd(reinterpret_cast<unsigned long long*>(out + blockIdx.y),
              static_cast<unsigned long long>(s));
  }
}

}  // namespace

void digest_segments(cudaStream_t s, const DigestSegment* segments, int n, Idx max_bytes,
                     std::uint64_t* out) {
  if (n == 0) return;
  M3_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<size_t>(n) * sizeof(std::uint64_t), s));
  const Idx words = max_bytes / 2;
  Idx blocks = (words + kDigestThreads * 8 - 1) / (kDigestThreads * 8);
  blocks = blocks < 1 ? 1 : (blocks > 1024 ? 1024 : blocks);
  M3_REQUIRE(n <= 65535, "digest_segments", "too many segments for one launch", "n=", n);
  digest_kernel<<<dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(n)), kDigestThreads, 0, s>>>(
      segments, out);
  M3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace m3::gpu
