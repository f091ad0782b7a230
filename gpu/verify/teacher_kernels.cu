// The isolated mode's f64 → storage restore (teacher_kernels.cuh).
#include "teacher_kernels.cuh"

#include <cstdint>

#include "common.cuh"
#include "error.hpp"

namespace m3::gpu {

namespace {

constexpr int kTeacherThreads = 256;

// float_to_bf16_bits of reference/precision.cpp, on the device.
__device__ std::uint16_t bf16_bits(float f) {
  const std::uint32_t u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// float_to_f16_bits of reference/precision.cpp, on the device: NaN quiet with its top mantissa
// bits; at or above 65520 infinity; below 2⁻¹⁴ the subnormal m·2⁻²⁴ with m rounded half to even;
// else the mantissa rounded to nearest even (a carry may reach the exponent, or infinity).
__device__ std::uint16_t f16_bits(float f) {
  const std::uint32_t u = __float_as_uint(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x03FFu));
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);
  if (a < 0x38800000u) {
    const float scaled = __uint_as_float(a) * 16777216.0f;  // exact
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(rintf(scaled)));
  }
  const std::uint32_t exp = (a >> 23) - 127 + 15;
  const std::uint32_t mant = a & 0x7FFFFFu;
  std::uint32_t h = (exp << 10) | (mant >> 13);
  const std::uint32_t rest = mant & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<std::uint16_t>(sign | h);
}

__global__ void teacher_f32_kernel(Idx n, const double* src, float* dst) {
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) dst[i] = __double2float_rn(src[i]);
}

__global__ void teacher_16_kernel(Idx n, const double* src, std::uint16_t* dst, bool bf16) {
  const Idx i = static_cast<Idx>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float f = __double2float_rn(src[i]);
  dst[i] = bf16 ? bf16_bits(f) : f16_bits(f);
}

}  // namespace

void teacher_to_storage(cudaStream_t s, Idx n, const double* src, void* dst, std::size_t elem,
                        Precision storage) {
  if (n <= 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kTeacherThreads - 1) / kTeacherThreads);
  if (elem == 4) {
    teacher_f32_kernel<<<blocks, kTeacherThreads, 0, s>>>(n, src, static_cast<float*>(dst));
  } else {
    M3_REQUIRE(elem == 2 && (storage == Precision::BF16 || storage == Precision::F16),
               "teacher_to_storage", "a 2-byte buffer is bf16 or f16", precision_name(storage));
    teacher_16_kernel<<<blocks, kTeacherThreads, 0, s>>>(
        n, src, static_cast<std::uint16_t*>(dst), storage == Precision::BF16);
  }
  M3_CUDA_CHECK(cudaGetLastError());
}

}  // namespace m3::gpu
