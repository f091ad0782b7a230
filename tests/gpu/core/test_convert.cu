// The storage conversions (gpu/core/convert.cuh) against the reference's bits
// (reference/precision.cpp): from_float<T> / to_float on the host and on the device for edge
// cases (ties, overflow, subnormals, ±0, ±inf, NaN payloads), every 16-bit pattern ± half an
// ulp and random bit patterns; the vector loads load_n; and the convert / round_to / add
// launchers (reduce.cu), bit for bit. The host check runs without a device.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "convert.cuh"

#include "../stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;
using m3::bits_float;
using m3::float_bits;

template <class T>
__global__ void store_load_kernel(Idx n, const float* in, std::uint16_t* bits, float* back) {
  for (Idx i = blockIdx.x * Idx(blockDim.x) + threadIdx.x; i < n; i += Idx(gridDim.x) * blockDim.x) {
    bits[i] = raw(m3::gpu::from_float<T>(in[i]));
    back[i] = m3::gpu::round_trip<T>(in[i]);
  }
}

template <class T>
__global__ void load_all_kernel(float* out) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= 65536u) return;
  out[i] = m3::gpu::to_float(from_raw<T>(static_cast<std::uint16_t>(i)));
}

// load_n<N, U> (the vector loads every typed kernel reads through): thread i loads in[N·i …].
template <class T, int N, m3::gpu::Use U>
__global__ void load_n_kernel(unsigned int count, const T* in, float* out) {
  const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float v[N];
  m3::gpu::load_n<N, U>(in + N * i, v);
#pragma unroll
  for (int k = 0; k < N; ++k) out[N * i + k] = v[k];
}

template <class T, m3::gpu::Use U>
void launch_load_n(int n, unsigned int blocks, cudaStream_t s, unsigned int count, const T* in,
                   float* out) {
  if (n == 2) load_n_kernel<T, 2, U><<<blocks, 256, 0, s>>>(count, in, out);
  if (n == 4) load_n_kernel<T, 4, U><<<blocks, 256, 0, s>>>(count, in, out);
  if (n == 8) load_n_kernel<T, 8, U><<<blocks, 256, 0, s>>>(count, in, out);
}

// Floats that exercise every rounding rule of T: named edge cases, every 16-bit pattern of T
// as a float and its neighbours half an ulp of T away (ties), ± one f32 ulp around those, and
// random bit patterns over the whole float range.
template <class T>
Vec conversion_inputs() {
  std::vector<std::uint32_t> u = {
      0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u,               // ±0, ±inf
      0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FBFFFFFu,  // NaNs, payloads
      0x7FFFFFFFu, 0xFFFFFFFFu, 0x7F812345u, 0xFFA0F0F0u, 0x7FC0E001u,
      0x7F7FFFFFu, 0xFF7FFFFFu, 0x7F7F7FFFu, 0x7F7F8000u, 0x7F7F8001u,  // bf16 overflow edge
      0x7F7E8000u, 0xFF7F8000u,
      0x00000001u, 0x80000001u, 0x00008000u, 0x00018000u, 0x007FFFFFu,  // f32 subnormals
      0x00800000u, 0x00FF8000u,
      0x477FE000u, 0x477FEFFFu, 0x477FF000u, 0x477FF001u, 0x47800000u,  // f16 overflow edge
      0xC77FF000u, 0xC77FEFFFu,
      0x38800000u, 0x387FFFFFu, 0x387FF000u, 0x33800000u, 0x33000000u,  // f16 subnormal edges
      0x33000001u, 0x33C00000u, 0x34200000u, 0xB3000000u, 0xB3000001u,
      0x3F801000u, 0x3F803000u, 0x3F808000u, 0x3F818000u,               // ties near 1
  };
  for (std::uint32_t h = 0; h < 65536u; ++h) {
    const float f = Storage<T>::value(static_cast<std::uint16_t>(h));
    if (!std::isfinite(f)) continue;
    const std::uint32_t b = float_bits(f);
    u.push_back(b);
    // halfway to the next representable value (exact in f32), and ± one f32 ulp around it
    const float next = Storage<T>::value(static_cast<std::uint16_t>(h + 1 < 65536u ? h + 1 : h));
    if (std::isfinite(next) && std::signbit(next) == std::signbit(f) && next != f) {
      const std::uint32_t mid = float_bits(0.5f * f + 0.5f * next);
      for (std::uint32_t m : {mid - 1, mid, mid + 1}) u.push_back(m);
    }
  }
  Rng rng(12345);
  for (int i = 0; i < (1 << 20); ++i) u.push_back(static_cast<std::uint32_t>(rng.next()));
  Vec v(u.size());
  for (size_t i = 0; i < u.size(); ++i) v[i] = bits_float(u[i]);
  return v;
}

template <class T>
class TypedConversion : public ::testing::Test {};
TYPED_TEST_SUITE(TypedConversion, StorageTypes, StorageName);

// The host path of convert.cuh (no device needed): the same bits as reference/precision.cpp.
TYPED_TEST(TypedConversion, HostStoreAndLoadMatchReferenceBits) {
  using T = TypeParam;
  const Vec in = conversion_inputs<T>();
  size_t bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const std::uint16_t want = Storage<T>::bits(in[i]);
    const std::uint16_t got = raw(m3::gpu::from_float<T>(in[i]));
    const float back = m3::gpu::to_float(from_raw<T>(want));
    if (got != want || float_bits(back) != float_bits(Storage<T>::value(want))) {
      if (++bad <= 5)
        ADD_FAILURE() << std::hex << "float 0x" << float_bits(in[i]) << ": store 0x" << got
                      << " (reference 0x" << want << "), load 0x" << float_bits(back)
                      << " (reference 0x" << float_bits(Storage<T>::value(want)) << ")";
    }
  }
  EXPECT_EQ(bad, 0u) << "of " << in.size() << " inputs";
}

TYPED_TEST(TypedConversion, DeviceStoreAndLoadMatchReferenceBits) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  Stream s;
  const Vec in = conversion_inputs<T>();
  const Idx n = static_cast<Idx>(in.size());
  auto din = up(in, s);
  DeviceArray<std::uint16_t> dbits(n);
  DeviceArray<float> dback(n), dall(65536);
  store_load_kernel<T><<<256, 256, 0, s>>>(n, din.data(), dbits.data(), dback.data());
  M3_CUDA_CHECK(cudaGetLastError());
  load_all_kernel<T><<<256, 256, 0, s>>>(dall.data());
  M3_CUDA_CHECK(cudaGetLastError());
  std::vector<std::uint16_t> bits(static_cast<size_t>(n));
  dbits.download(bits.data(), s);
  const Vec back = down(dback, s), all = down(dall, s);
  size_t bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const std::uint16_t want = Storage<T>::bits(in[i]);
    const float want_back = Storage<T>::value(want);
    if (bits[i] != want || float_bits(back[i]) != float_bits(want_back)) {
      if (++bad <= 5)
        ADD_FAILURE() << std::hex << "float 0x" << float_bits(in[i]) << ": device store 0x"
                      << bits[i] << " (reference 0x" << want << "), round trip 0x"
                      << float_bits(back[i]) << " (reference 0x" << float_bits(want_back) << ")";
    }
  }
  EXPECT_EQ(bad, 0u) << "stores of " << in.size() << " inputs";
  size_t bad_load = 0;
  for (std::uint32_t h = 0; h < 65536u; ++h) {
    const float want = Storage<T>::value(static_cast<std::uint16_t>(h));
    if (float_bits(all[h]) != float_bits(want) && ++bad_load <= 5)
      ADD_FAILURE() << std::hex << "load of 0x" << h << ": 0x" << float_bits(all[h])
                    << " (reference 0x" << float_bits(want) << ")";
  }
  EXPECT_EQ(bad_load, 0u) << "loads of the 65536 patterns";
}

// The vector loads (load_n of 2, 4 and 8 values) give to_float's bits for every 16-bit pattern:
// in order, and shuffled so that NaNs share vectors with finite values (f16's load converts the
// pairs in hardware and takes the exact path only for a vector holding a NaN). Use::kArith's
// loads (values that only feed arithmetic) give the same bits for every pattern but a NaN, and a
// NaN for a NaN: the payload is all they may drop.
TYPED_TEST(TypedConversion, DeviceVectorLoadsMatchReferenceBits) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  using m3::gpu::Use;
  Stream s;
  std::vector<std::uint16_t> order(65536);
  for (std::uint32_t h = 0; h < 65536u; ++h) order[h] = static_cast<std::uint16_t>(h);
  std::vector<std::uint16_t> shuffled = order;
  Rng rng(99);
  for (size_t i = shuffled.size() - 1; i > 0; --i)
    std::swap(shuffled[i], shuffled[static_cast<size_t>(rng.next() % (i + 1))]);
  for (const auto* pattern : {&order, &shuffled}) {
    std::vector<T> h(pattern->size());
    for (size_t i = 0; i < h.size(); ++i) h[i] = from_raw<T>((*pattern)[i]);
    DeviceArray<T> din(65536);
    din.upload(h.data(), s);
    for (const Use use : {Use::kStored, Use::kArith})
      for (int n : {2, 4, 8}) {
        const bool arith = use == Use::kArith;
        SCOPED_TRACE(std::string(pattern == &order ? "in order" : "shuffled") + ", vectors of " +
                     std::to_string(n) + (arith ? ", Use::kArith" : ", Use::kStored"));
        DeviceArray<float> dout(65536);
        const unsigned int count = 65536u / static_cast<unsigned int>(n);
        const unsigned int blocks = (count + 255) / 256;
        const T* in = din.data();
        float* out = dout.data();
        if (arith) {
          launch_load_n<T, Use::kArith>(n, blocks, s, count, in, out);
        } else {
          launch_load_n<T, Use::kStored>(n, blocks, s, count, in, out);
        }
        M3_CUDA_CHECK(cudaGetLastError());
        const Vec got = down(dout, s);
        size_t bad = 0, nans = 0;
        for (size_t i = 0; i < got.size(); ++i) {
          const float want = Storage<T>::value((*pattern)[i]);
          const bool nan = want != want;
          nans += nan;
          const bool ok = arith && nan ? got[i] != got[i] : float_bits(got[i]) == float_bits(want);
          if (!ok && ++bad <= 5)
            ADD_FAILURE() << std::hex << "load of 0x" << (*pattern)[i] << ": 0x"
                          << float_bits(got[i]) << " (reference 0x" << float_bits(want) << ")";
        }
        EXPECT_EQ(bad, 0u) << "vector loads of the 65536 patterns";
        EXPECT_GT(nans, 250u) << "the patterns hold NaNs";  // f16 2·1023 of them, bf16 2·127
      }
  }
}

// convert<float, T>, round_to<T>, convert<T, float> and add<T> (reduce.cu) against the host.
TYPED_TEST(TypedConversion, ConvertRoundToAndAddLaunchersAreExact) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  Stream s;
  const Vec in = conversion_inputs<T>();
  const Idx n = static_cast<Idx>(in.size());
  auto din = up(in, s);
  DeviceArray<T> c1(n), c2(n);
  m3::gpu::convert<float, T>(s, n, din.data(), c1.data());
  m3::gpu::round_to<T>(s, n, din.data(), c2.data());
  std::vector<T> h1(static_cast<size_t>(n)), h2(h1.size());
  c1.download(h1.data(), s);
  c2.download(h2.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  size_t bad = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const std::uint16_t want = Storage<T>::bits(in[i]);
    if ((raw(h1[i]) != want || raw(h2[i]) != want) && ++bad <= 5)
      ADD_FAILURE() << std::hex << "float 0x" << float_bits(in[i]) << ": convert 0x" << raw(h1[i])
                    << ", round_to 0x" << raw(h2[i]) << " (reference 0x" << want << ")";
  }
  EXPECT_EQ(bad, 0u);

  // back to f32 (exact) and the residual add a + b (f32 + typed → f32), finite values only
  Rng rng(8);
  const Idx m = 100000;
  Vec a(static_cast<size_t>(m)), b(a.size()), sum(a.size()), back(a.size());
  for (Idx i = 0; i < m; ++i) {
    a[i] = static_cast<float>(rng.normalish());
    b[i] = rnd<T>(static_cast<float>(rng.normalish() * 3.0));
    sum[i] = a[i] + b[i];
  }
  auto da = up(a, s);
  auto db = up_t<T>(b, s);
  DeviceArray<float> dsum(m), dback(m);
  m3::gpu::add<T>(s, m, da.data(), db.data(), dsum.data());
  m3::gpu::convert<T, float>(s, m, db.data(), dback.data());
  EXPECT_EQ(0, std::memcmp(down(dsum, s).data(), sum.data(), sum.size() * sizeof(float)))
      << "add<T>";
  EXPECT_EQ(0, std::memcmp(down(dback, s).data(), b.data(), b.size() * sizeof(float)))
      << "convert<T, float>";
}

}  // namespace
