// The bf16 and f16 instantiations of every GPU stage against the reference's storage emulation
// (MODEL.md §8, §12.8): the reference stage functions run in float on the same (already
// rounded) inputs, and every typed tensor is rounded where the reference rounds it
// (m3::ref::store_typed with a Dims of BF16/F16 storage, inside a stage where the reference
// does it there: BCNorm's normed before the bias add, d_normed before B4c, chunked Ks after K1).
//
//   TypedConversion/*         from_float<T> / to_float on the device (and on the host) give the
//                             bits of m3::float_to_*_bits / *_bits_to_float for edge cases
//                             (ties, overflow, subnormals, ±0, ±inf, NaN payloads), every
//                             16-bit pattern ± half an ulp, and random bit patterns; the
//                             convert / round_to / add launchers likewise.
//   TypedStages/*             each launcher of family A (norm, split, bcnorm, rope, gating) and
//                             the GEMMs, per config of kCases.
//   TypedSsm/*                F6/B6 in both scan modes, against the double reference with the
//                             same emulation (the float reference gives the baseline error).
// Typed outputs: |gpu − ref| ≤ 2 ulp_T(ref) + floor·max|ref| per element (a different float
// summation order can flip a rounding; floor covers f32 cancellation noise), and at least a
// fraction min_exact of the elements bit-equal — a rounding point the GPU got wrong (a missing
// or an extra rounding) flips far more elements than summation order does. f32 outputs:
// rel_l2 ≤ 1e-5, max|Δ|/max|ref| ≤ 1e-4 (SSM: the test_gpu_ssm rule against the double
// reference). Every GPU run is made twice and the two must be bit-identical (MODEL.md §7).
// Tests skip (GTEST_SKIP, saying why) without a device; the host conversion check always runs.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "config.hpp"
#include "context.hpp"
#include "convert.cuh"
#include "device.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "params.hpp"
#include "precision.hpp"
#include "stages.cuh"
#include "stages.hpp"

namespace {

using m3::bits_float;
using m3::Config;
using m3::float_bits;
using m3::Idx;
using m3::Rng;
using m3::ScanMode;
using m3::gpu::DeviceArray;
using m3::gpu::Scratch;
using m3::ref::Dims;
using Vec = std::vector<float>;
using Named = std::map<std::string, Vec>;
using LParams = m3::LayerParams<float>;

// ---- storage types ---------------------------------------------------------------------------
template <class T>
struct Storage;
template <>
struct Storage<__nv_bfloat16> {
  static constexpr m3::Precision kPrecision = m3::Precision::BF16;
  static constexpr int kMantissa = 7;   // stored fraction bits
  static constexpr int kMinExp = -126;  // exponent of the smallest normal
  static std::uint16_t bits(float f) { return m3::float_to_bf16_bits(f); }
  static float value(std::uint16_t h) { return m3::bf16_bits_to_float(h); }
};
template <>
struct Storage<__half> {
  static constexpr m3::Precision kPrecision = m3::Precision::F16;
  static constexpr int kMantissa = 10;
  static constexpr int kMinExp = -14;
  static std::uint16_t bits(float f) { return m3::float_to_f16_bits(f); }
  static float value(std::uint16_t h) { return m3::f16_bits_to_float(h); }
};

using StorageTypes = ::testing::Types<__nv_bfloat16, __half>;
struct StorageName {
  template <class T>
  static std::string GetName(int) {
    return std::is_same_v<T, __half> ? "f16" : "bf16";
  }
};

// The bits of a storage value, and back.
__host__ __device__ std::uint16_t raw(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }
__host__ __device__ std::uint16_t raw(__half h) { return __half_as_ushort(h); }
template <class T>
__host__ __device__ T from_raw(std::uint16_t b);
template <>
__host__ __device__ __nv_bfloat16 from_raw<__nv_bfloat16>(std::uint16_t b) {
  return __ushort_as_bfloat16(b);
}
template <>
__host__ __device__ __half from_raw<__half>(std::uint16_t b) {
  return __ushort_as_half(b);
}

// The storage value of f (what the reference's store_typed makes of it).
template <class T>
float rnd(float f) {
  return Storage<T>::value(Storage<T>::bits(f));
}
template <class T>
Vec rounded(Vec v) {
  for (auto& e : v) e = rnd<T>(e);
  return v;
}

// Unit in the last place of T at |x| (subnormal spacing below the smallest normal).
template <class T>
double ulp(double x) {
  int e = 0;
  std::frexp(std::abs(x), &e);  // |x| = m·2^e, m ∈ [0.5, 1)
  const int ex = x == 0 ? Storage<T>::kMinExp : std::max(e - 1, Storage<T>::kMinExp);
  return std::ldexp(1.0, ex - Storage<T>::kMantissa);
}

// ---- device helpers --------------------------------------------------------------------------
class Stream {
 public:
  Stream() { M3_CUDA_CHECK(cudaStreamCreate(&s_)); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

DeviceArray<float> up(const Vec& v, cudaStream_t s) {
  DeviceArray<float> a(static_cast<Idx>(v.size()));
  a.upload(v.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return a;
}

Vec down(const DeviceArray<float>& a, cudaStream_t s) {
  Vec v(static_cast<size_t>(a.size()));
  a.download(v.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

// Uploads v (every value must be representable in T: the inputs are rounded beforehand).
template <class T>
DeviceArray<T> up_t(const Vec& v, cudaStream_t s) {
  std::vector<T> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::uint16_t b = Storage<T>::bits(v[i]);
    if (!(Storage<T>::value(b) == v[i] || std::isnan(v[i])))
      throw m3::Error("up_t", "input not representable in the storage type",
                      "element " + std::to_string(i));
    h[i] = from_raw<T>(b);
  }
  DeviceArray<T> a(static_cast<Idx>(v.size()));
  a.upload(h.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return a;
}

template <class T>
Vec down_t(const DeviceArray<T>& a, cudaStream_t s) {
  std::vector<T> h(static_cast<size_t>(a.size()));
  a.download(h.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  Vec v(h.size());
  for (size_t i = 0; i < h.size(); ++i) v[i] = Storage<T>::value(raw(h[i]));
  return v;
}

struct ScratchBuf {
  DeviceArray<float> buf;
  explicit ScratchBuf(const Dims& d) : buf(m3::gpu::scratch_floats(d)) {}
  Scratch get() { return Scratch{buf.data(), buf.size()}; }
};

// ---- comparisons -----------------------------------------------------------------------------
constexpr double kRelL2 = 1e-5;
constexpr double kRelMax = 1e-4;

void expect_close(const std::string& what, const Vec& got, const Vec& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double d2 = 0, r2 = 0, dmax = 0, rmax = 0;
  size_t worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "] = " << got[i];
    const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
    d2 += diff * diff;
    r2 += static_cast<double>(want[i]) * want[i];
    if (diff > dmax) dmax = diff, worst = i;
    rmax = std::max(rmax, std::abs(static_cast<double>(want[i])));
  }
  const double rel_l2 = r2 > 0 ? std::sqrt(d2 / r2) : std::sqrt(d2);
  const double rel_max = rmax > 0 ? dmax / rmax : dmax;
  EXPECT_LE(rel_l2, kRelL2) << what << ": rel_l2, worst at " << worst;
  EXPECT_LE(rel_max, kRelMax) << what << ": max_abs/max, worst at [" << worst << "] gpu "
                              << (got.empty() ? 0.f : got[worst]) << " ref "
                              << (want.empty() ? 0.f : want[worst]);
}

// A typed output: per element |got − want| ≤ 2 ulp_T(want) + floor_rel·max|want|, and at least
// min_exact of the elements bit-equal. want is the reference value after its rounding to T.
template <class T>
void expect_typed(const std::string& what, const Vec& got, const Vec& want, double floor_rel,
                  double min_exact) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (got.empty()) return;
  double wmax = 0;
  for (float v : want) wmax = std::max(wmax, std::abs(static_cast<double>(v)));
  const double floor_abs = floor_rel * wmax;
  size_t exact = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "] = " << got[i];
    ASSERT_EQ(rnd<T>(want[i]), want[i]) << what << ": reference value not rounded at " << i;
    if (got[i] == want[i]) {
      ++exact;
      continue;
    }
    const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
    const double ratio = diff / (2.0 * ulp<T>(want[i]) + floor_abs);
    if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
  }
  const double frac = static_cast<double>(exact) / static_cast<double>(got.size());
  EXPECT_LE(worst_ratio, 1.0) << what << ": worst at [" << worst << "] gpu " << got[worst]
                              << " ref " << want[worst] << " = "
                              << (got[worst] - want[worst]) / ulp<T>(want[worst]) << " ulp";
  EXPECT_GE(frac, min_exact) << what << ": fraction of bit-equal elements";
}

// 2 ulps of T at the largest |value| of `want`, relative to that value (a floor for outputs
// that inherit the rounding of a larger operand).
template <class T>
double scale_ulps_rel(const Vec& want) {
  double wmax = 0;
  for (float v : want) wmax = std::max(wmax, std::abs(static_cast<double>(v)));
  return wmax > 0 ? 2.0 * ulp<T>(wmax) / wmax : 0.0;
}

void expect_bitwise(const std::string& what, const Named& a, const Named& b) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, v] : a) {
    const Vec& w = b.at(name);
    ASSERT_EQ(v.size(), w.size()) << what << ": " << name;
    EXPECT_EQ(0, v.empty() ? 0 : std::memcmp(v.data(), w.data(), v.size() * sizeof(float)))
        << what << ": " << name << " differs between two runs";
  }
}

// Runs f twice (it uploads its inputs and accumulators afresh each time): the two results must
// be bit-identical; returns the first.
template <class F>
Named twice(const std::string& what, F&& f) {
  Named a = f(), b = f();
  expect_bitwise(what, a, b);
  return a;
}

// ===============================================================================================
// Conversions
// ===============================================================================================
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

// ===============================================================================================
// Family A (norm, split, bcnorm, rope, gating) and the GEMMs
// ===============================================================================================
using Case = StageCase;
const std::vector<Case> kCases = stage_cases();

Config make_config(const Case& c, bool outproj_norm) {
  Config cfg;
  cfg.d_model = c.d_model;
  cfg.expand = 2;
  cfg.headdim = c.headdim;
  cfg.d_state = c.d_state;
  cfg.ngroups = c.ngroups;
  cfg.n_layers = 1;
  cfg.rope_fraction = c.rope_fraction;
  cfg.is_outproj_norm = outproj_norm;
  cfg.input_dim = c.d_model + 3;
  cfg.input_proj_identity = false;
  cfg.validate();
  return cfg;
}

void fill(Vec& v, Rng& rng, double lo, double hi) {
  for (auto& e : v) e = static_cast<float>(rng.uniform(lo, hi));
}

// Every host tensor a stage of family A reads or writes, from the reference forward in float
// with the storage emulation of T (typed tensors rounded where the reference stores them), and
// seeded upstream gradients (typed ones rounded).
template <class T>
struct World {
  Dims d;
  LParams p, pg0;  // parameters; initial values of the weight-gradient buffers
  m3::ref::LayerActs<float> a;
  m3::ref::LayerGrads<float> g;
};

template <class T>
World<T> make_world(const Case& c, bool outproj_norm, std::uint64_t seed = 7) {
  const Config cfg = make_config(c, outproj_norm);
  World<T> w;
  w.d = Dims::of(cfg, c.B, c.T, Storage<T>::kPrecision);
  const Dims& d = w.d;
  w.p = m3::make_params<float>(cfg, seed, m3::Init::Perturbed).layers[0];
  w.pg0 = m3::zero_params<float>(cfg).layers[0];
  Rng rng(seed * 1000 + 17);
  for (Vec* v : {&w.pg0.norm_weight, &w.pg0.dt_bias, &w.pg0.b_norm_weight, &w.pg0.c_norm_weight,
                 &w.pg0.b_bias, &w.pg0.c_bias, &w.pg0.norm_gate_weight})
    fill(*v, rng, -1.0, 1.0);
  auto& a = w.a;
  a.allocate(d, ScanMode::Sequential);
  w.g.allocate(d, ScanMode::Sequential);
  for (auto& e : a.proj) e = static_cast<float>(rng.normalish());
  const Idx ddt = 2 * d.di + 2 * d.ng * d.ds, dda = ddt + d.nh;
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx k = r + 3 * h;
      if (k % 17 == 0) a.proj[r * d.ip + ddt + h] = 30.0f;   // softplus: v > 20 branch
      if (k % 5 == 0) a.proj[r * d.ip + dda + h] = -2.0e4f;  // heavy-tail clamp active
      if (k % 11 == 0) a.proj[r * d.ip + dda + h] = 0.0f;    // φ'(0) = 1
    }
  m3::ref::store_typed(d, a.proj);
  m3::ref::split_forward(d, w.p, a);
  m3::ref::bcnorm_forward(d, w.p, a);  // rounds normed, then biased (typed Dims)
  fill(a.angle_in, rng, 0.0, 6.283);
  m3::ref::angle_forward(d, a);
  m3::ref::rope_forward(d, a);
  m3::ref::store_typed(d, a.k);
  m3::ref::store_typed(d, a.q);
  m3::ref::abg_forward(d, a);
  for (auto& e : a.y) e = static_cast<float>(rng.normalish());
  m3::ref::store_typed(d, a.y);
  m3::ref::gating_forward(d, w.p, a);
  m3::ref::store_typed(d, a.gated);
  auto& g = w.g;
  for (Vec* v : {&g.d_gated, &g.d_k, &g.d_q, &g.d_angle_cumsum, &g.d_b_pre_rope,
                 &g.d_c_pre_rope, &g.d_z, &g.d_x, &g.d_b_raw, &g.d_c_raw, &g.d_dd_dt, &g.d_dd_a,
                 &g.d_trap_raw, &g.d_angles_raw})
    fill(*v, rng, -1.0, 1.0);
  for (Vec* v : {&g.d_gated, &g.d_z, &g.d_x, &g.d_b_raw, &g.d_c_raw}) m3::ref::store_typed(d, *v);
  return w;
}

template <class T>
class TypedStages : public ::testing::Test {};
TYPED_TEST_SUITE(TypedStages, StorageTypes, StorageName);

// F1 / norm_f (u f32 → y typed) and B1 (g typed → dx, dw f32).
TYPED_TEST(TypedStages, RmsNormMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    World<T> w = make_world<T>(c, false);
    const Dims& d = w.d;
    Rng rng(99);
    Vec u(static_cast<size_t>(d.BT * d.dm)), gy(u.size());
    for (auto& e : u) e = static_cast<float>(3.0 * rng.normalish());
    fill(gy, rng, -1.0, 1.0);
    gy = rounded<T>(gy);
    Vec y(u.size()), rms(static_cast<size_t>(d.BT)), dx(u.size()), dw = w.pg0.norm_weight;
    m3::ref::rmsnorm_forward(d.BT, d.dm, u.data(), w.p.norm_weight.data(), y.data(), rms.data());
    m3::ref::store_typed(d, y);
    m3::ref::rmsnorm_backward(d.BT, d.dm, u.data(), w.p.norm_weight.data(), rms.data(),
                              gy.data(), dx.data(), dw.data());
    Stream s;
    ScratchBuf sc(d);
    const Named got = twice("rmsnorm", [&] {
      auto du = up(u, s), dwt = up(w.p.norm_weight, s), ddw = up(w.pg0.norm_weight, s),
           drms_ref = up(rms, s);
      auto dgy = up_t<T>(gy, s);
      DeviceArray<T> dy(d.BT * d.dm);
      DeviceArray<float> drms(d.BT), ddx(d.BT * d.dm);
      m3::gpu::rmsnorm_forward<T>(s, d.BT, d.dm, du.data(), dwt.data(), dy.data(), drms.data());
      m3::gpu::rmsnorm_backward<T>(s, d.BT, d.dm, du.data(), dwt.data(), drms_ref.data(),
                                   dgy.data(), ddx.data(), ddw.data(), sc.get());
      return Named{{"y", down_t(dy, s)}, {"rms", down(drms, s)}, {"dx", down(ddx, s)},
                   {"dw", down(ddw, s)}};
    });
    expect_typed<T>("y", got.at("y"), y, 1e-6, 0.99);
    expect_close("rms", got.at("rms"), rms);
    expect_close("dx", got.at("dx"), dx);
    expect_close("dw (accumulated)", got.at("dw"), dw);
  }
}

// The inputs of the RMSNorm backward's own tests, [rows, dim] from `seed`: u (≈ 3·N(0, 1)), g
// in [−1, 1], δ (a) in [−2, 2], w in [0.5, 1.5], and u's RMS per row (ε = 1e-5, in double).
struct RmsRows {
  Vec u, g, a, w, rms;
};
RmsRows rms_rows(Idx rows, Idx dim, std::uint64_t seed) {
  const Idx n = rows * dim;
  Rng rng(seed);
  RmsRows o{Vec(static_cast<size_t>(n)), Vec(static_cast<size_t>(n)),
            Vec(static_cast<size_t>(n)), Vec(static_cast<size_t>(dim)),
            Vec(static_cast<size_t>(rows))};
  for (auto& e : o.u) e = static_cast<float>(3.0 * rng.normalish());
  fill(o.g, rng, -1.0, 1.0);
  fill(o.a, rng, -2.0, 2.0);
  fill(o.w, rng, 0.5, 1.5);
  for (Idx r = 0; r < rows; ++r) {
    double ss = 0.0;
    for (Idx i = 0; i < dim; ++i) ss += double(o.u[r * dim + i]) * o.u[r * dim + i];
    o.rms[r] = static_cast<float>(std::sqrt(ss / double(dim) + 1e-5));
  }
  return o;
}

// B1's residual pass-through with δ's typed copy (rmsnorm_backward's add_typed, the fused
// runs' replacement of the convert before the next B8): add_out as without it, and add_typed
// the bits of convert<float, T>(add_out), contiguous rows (vectors) and an odd width (the
// element-by-element path of the same kernel).
TYPED_TEST(TypedStages, RmsnormBackwardTypedCopyIsTheConvertOfItsAdd) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  Stream s;
  for (const Idx dim : {Idx(256), Idx(1088), Idx(21)}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const Idx rows = 37, n = rows * dim;
    const RmsRows in = rms_rows(rows, dim, 5 + dim);
    auto du = up(in.u, s), dw = up(in.w, s), drms = up(in.rms, s), da = up(in.a, s);
    auto dg = up_t<T>(rounded<T>(in.g), s);
    DeviceArray<float> gw0(dim), gw1(dim), out0(n), out1(n);
    DeviceArray<T> typed(n), want(n);
    gw0.zero(s);
    gw1.zero(s);
    const Idx scr = m3::gpu::rmsnorm_backward_scratch_floats(rows, dim);
    DeviceArray<float> sc(scr);
    m3::gpu::rmsnorm_backward<T>(s, rows, dim, du.data(), dw.data(), drms.data(), dg.data(),
                                 nullptr, gw0.data(), {sc.data(), scr}, da.data(), out0.data());
    m3::gpu::rmsnorm_backward<T>(s, rows, dim, du.data(), dw.data(), drms.data(), dg.data(),
                                 nullptr, gw1.data(), {sc.data(), scr}, da.data(), out1.data(),
                                 typed.data());
    m3::gpu::convert<float, T>(s, n, out1.data(), want.data());
    EXPECT_EQ(down(out0, s), down(out1, s)) << "add_out changed with add_typed";
    EXPECT_EQ(down(gw0, s), down(gw1, s)) << "dw changed with add_typed";
    EXPECT_EQ(down_t(typed, s), down_t(want, s)) << "add_typed is not convert(add_out)";
  }
}

// B1 with δ at 32 lanes per row, vectors and dw in the kernel: norm.cu's kStage reads δ's row
// through shared memory and u's and g's through a ring row per warp (cp.async, the next row's
// copies in flight while this one is worked on); with it turned off, the same kernel reads all
// three from global memory. Every output has the same bits either way. Widths: the whole row
// in every lane's groups (1024), groups past the row's end in some lanes (1000, 260); rows:
// fewer than a block's warps (5: three warps without a row), part of one block (37) and a
// partial third block (300). (The element-by-element path is no reference here: nvcc
// contracts its dx arithmetic differently.)
TYPED_TEST(TypedStages, RmsnormBackwardStagedDeltaGivesTheBitsOfTheGlobalLoads) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  Stream s;
  struct Restore {
    ~Restore() { m3::gpu::set_rmsnorm_delta_staging_for_testing(true); }
  } restore;
  for (const Idx dim : {Idx(1024), Idx(1000), Idx(260)})
    for (const Idx rows : {Idx(5), Idx(37), Idx(300)}) {
      SCOPED_TRACE("dim " + std::to_string(dim) + ", rows " + std::to_string(rows));
      const Idx n = rows * dim;
      const RmsRows in = rms_rows(rows, dim, 11 + dim + rows);
      auto du = up(in.u, s), dw = up(in.w, s), da = up(in.a, s), drms = up(in.rms, s);
      auto dg = up_t<T>(rounded<T>(in.g), s);
      const Idx scr = m3::gpu::rmsnorm_backward_scratch_floats(rows, dim);
      auto run = [&](bool staged) {
        m3::gpu::set_rmsnorm_delta_staging_for_testing(staged);
        DeviceArray<float> gw(dim), dx(n), out(n), sc(std::max<Idx>(scr, 1));
        DeviceArray<T> typed(n);
        gw.zero(s);
        m3::gpu::rmsnorm_backward<T>(s, rows, dim, du.data(), dw.data(), drms.data(), dg.data(),
                                     dx.data(), gw.data(), {sc.data(), scr}, da.data(),
                                     out.data(), typed.data());
        return Named{{"dx", down(dx, s)},
                     {"add_out", down(out, s)},
                     {"add_typed", down_t(typed, s)},
                     {"dw", down(gw, s)}};
      };
      expect_bitwise("δ, u and g staged against global loads", run(true), run(false));
    }
}

// F3 on the world's proj: every output, and proj after it. views: z, x, b_raw, c_raw null (the
// production layout's column views), so none of them is written or returned.
template <class T>
Named split_forward_run(const World<T>& w, cudaStream_t s, bool views) {
  const Dims& d = w.d;
  auto proj = up_t<T>(w.a.proj, s);
  auto dt_bias = up(w.p.dt_bias, s);
  DeviceArray<T> z(d.BT * d.di), x(d.BT * d.di), b_raw(d.BT * d.ng * d.ds),
      c_raw(d.BT * d.ng * d.ds);
  DeviceArray<float> dd_dt(d.BT * d.nh), dd_a(d.BT * d.nh), trap_raw(d.BT * d.nh),
      ang(d.BT * d.na), dt(d.BT * d.nh), a_val(d.BT * d.nh), trap(d.BT * d.nh);
  auto typed = [&](DeviceArray<T>& a) { return views ? nullptr : a.data(); };
  m3::gpu::SplitFwd<T> p{proj.data(),     dt_bias.data(), typed(z),     typed(x),
                         typed(b_raw),    typed(c_raw),   dd_dt.data(), dd_a.data(),
                         trap_raw.data(), ang.data(),     dt.data(),    a_val.data(),
                         trap.data()};
  m3::gpu::split_forward<T>(s, d, p);
  Named out{{"proj", down_t(proj, s)},     {"dd_dt_raw", down(dd_dt, s)},
            {"dd_a_raw", down(dd_a, s)},   {"trap_raw", down(trap_raw, s)},
            {"angles_raw", down(ang, s)},  {"dt", down(dt, s)},
            {"a_val", down(a_val, s)},     {"trap", down(trap, s)}};
  if (!views) {
    out["z"] = down_t(z, s);
    out["x"] = down_t(x, s);
    out["b_raw"] = down_t(b_raw, s);
    out["c_raw"] = down_t(c_raw, s);
  }
  return out;
}

// B3 from the world's gradients into a d_proj filled with `fill`. views: d_z, d_x, d_b_raw,
// d_c_raw null (d_proj's columns in the production layout), so those columns keep `fill`.
template <class T>
Vec split_backward_run(const World<T>& w, cudaStream_t s, bool views, float fill) {
  const Dims& d = w.d;
  auto dz = up_t<T>(w.g.d_z, s), dx = up_t<T>(w.g.d_x, s), db = up_t<T>(w.g.d_b_raw, s),
       dc = up_t<T>(w.g.d_c_raw, s);
  auto ddt = up(w.g.d_dd_dt, s), dda = up(w.g.d_dd_a, s), dtr = up(w.g.d_trap_raw, s),
       dan = up(w.g.d_angles_raw, s);
  auto d_proj = up_t<T>(Vec(static_cast<size_t>(d.BT * d.ip), fill), s);
  auto typed = [&](DeviceArray<T>& a) -> const T* { return views ? nullptr : a.data(); };
  m3::gpu::SplitBwd<T> p{typed(dz),  typed(dx),  typed(db),  typed(dc),     ddt.data(),
                         dda.data(), dtr.data(), dan.data(), d_proj.data()};
  m3::gpu::split_backward<T>(s, d, p);
  return down_t(d_proj, s);
}

// F3: the typed parts are copies (bit-equal), the raw logits exact f32 copies.
TYPED_TEST(TypedStages, SplitForwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    World<T> w = make_world<T>(c, false);
    Stream s;
    const Named got = twice("split_forward", [&] { return split_forward_run(w, s, false); });
    for (const auto& [name, ref] : std::vector<std::pair<const char*, const Vec*>>{
             {"z", &w.a.z}, {"x", &w.a.x}, {"b_raw", &w.a.b_raw}, {"c_raw", &w.a.c_raw}})
      expect_typed<T>(name, got.at(name), *ref, 0.0, 1.0);
    for (const auto& [name, ref] : std::vector<std::pair<const char*, const Vec*>>{
             {"dd_dt_raw", &w.a.dd_dt_raw}, {"dd_a_raw", &w.a.dd_a_raw},
             {"trap_raw", &w.a.trap_raw}, {"angles_raw", &w.a.angles_raw}})
      EXPECT_EQ(0, ref->empty() ? 0
                                : std::memcmp(got.at(name).data(), ref->data(),
                                              ref->size() * sizeof(float)))
          << name << ": not the exact f32 value of the typed proj column";
    expect_close("dt", got.at("dt"), w.a.dt);
    expect_close("a_val", got.at("a_val"), w.a.a_val);
    expect_close("trap", got.at("trap"), w.a.trap);
  }
}

// B3: d_proj typed; typed parts copied, f32 parts rounded once.
TYPED_TEST(TypedStages, SplitBackwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    World<T> w = make_world<T>(c, false);
    const Dims& d = w.d;
    m3::ref::split_backward(d, w.g);
    m3::ref::store_typed(d, w.g.d_proj);
    Stream s;
    const Named got = twice("split_backward", [&] {
      return Named{{"d_proj", split_backward_run(w, s, false, 3.0f)}};
    });
    expect_typed<T>("d_proj", got.at("d_proj"), w.g.d_proj, 0.0, 1.0);
  }
}

// The production layout's column views: F3 with z, x, b_raw, c_raw null leaves proj as it is and
// writes the f32 parts as with them; B3 with their gradients null leaves d_proj's typed columns
// (written in place by B7, B6, B4c) and writes the rest as with them; some but not all of the
// typed parts null is refused.
TYPED_TEST(TypedStages, SplitLeavesTheColumnViewsInPlace) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    World<T> w = make_world<T>(c, false);
    const Dims& d = w.d;
    Stream s;
    const Named fw = split_forward_run(w, s, false), fv = split_forward_run(w, s, true);
    for (const auto& [name, v] : fv) EXPECT_EQ(v, fw.at(name)) << "F3 " << name;
    EXPECT_EQ(fv.count("z") + fv.count("x") + fv.count("b_raw") + fv.count("c_raw"), 0u);
    const Vec bw = split_backward_run(w, s, false, 3.0f);
    const Vec bv = split_backward_run(w, s, true, 3.0f);
    for (Idx r = 0; r < d.BT; ++r)
      for (Idx j = 0; j < d.ip; ++j) {
        const size_t i = static_cast<size_t>(r * d.ip + j);
        if (j < 2 * d.di + 2 * d.ng * d.ds) {
          ASSERT_EQ(bv[i], 3.0f) << "B3 wrote d_proj[" << r << ", " << j << "] of a column view";
        } else {
          ASSERT_EQ(bv[i], bw[i]) << "B3 d_proj[" << r << ", " << j << "]";
        }
      }
    DeviceArray<T> one(d.BT * d.di), proj(d.BT * d.ip);
    m3::gpu::SplitFwd<T> half{};
    half.proj = proj.data();
    half.z = one.data();
    half.x = one.data();
    EXPECT_THROW(m3::gpu::split_forward<T>(s, d, half), m3::Error);
  }
}

// Production (fused runs, column views): B5b and B5a write d_proj's f32 columns themselves
// (ProjCols from split_f32_cols) and B3 is not launched. The d_proj they leave must be, bit for
// bit, the one B3 (split_backward with the typed parts null) stores from the same f32 outputs,
// the typed columns untouched by both; the f32 outputs are the same with and without the
// columns. Every stage case, and the official widths (nh = na = 32: angle_grads_kernel<32, 32>;
// B5b's one access per 4 heads, proj_cols4, where nh % 4 == 0 and ip % 4 == 0, its scalar
// stores in the other cases).
// Columns for some but not all of B5b's outputs, or a row stride shorter than the part, are
// refused.
TYPED_TEST(TypedStages, ProducersWriteTheF32PartsOfDprojAsB3Does) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  std::vector<Case> cases = kCases;
  cases.push_back({"official_widths_dm1024_hd64_ds128_B1_T33", 1024, 64, 128, 1, 0.5, 1, 33});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    World<T> w = make_world<T>(c, false);
    const Dims& d = w.d;
    const Idx n = d.BT * d.nh;
    Rng rng(23);
    Vec d_adt(static_cast<size_t>(n)), d_direct(d_adt.size()), d_sig(d_adt.size());
    for (Vec* v : {&d_adt, &d_direct, &d_sig}) fill(*v, rng, -1.0, 1.0);
    Stream s;
    ScratchBuf sc(d);
    auto raw = up(w.a.angles_raw, s), dt = up(w.a.dt, s), d_cum = up(w.g.d_angle_cumsum, s),
         dd_dt = up(w.a.dd_dt_raw, s), dd_a = up(w.a.dd_a_raw, s), dt_bias = up(w.p.dt_bias, s),
         a_val = up(w.a.a_val, s), trap = up(w.a.trap, s), dadt = up(d_adt, s),
         ddir = up(d_direct, s), dsig = up(d_sig, s);
    const Vec filled(static_cast<size_t>(d.BT * d.ip), 3.0f);
    // B5a then B5b, with d_proj's columns (direct) or without (B3 after them); the f32 outputs
    // and d_proj.
    auto run = [&](bool direct) {
      auto d_proj = up_t<T>(filled, s);
      DeviceArray<float> d_angles_raw(std::max<Idx>(d.BT * d.na, 1)), d_dt_angle(n), o_dt(n),
          o_a(n), o_trap(n), d_bias(d.nh);
      d_bias.zero(s);
      const m3::gpu::SplitF32Cols cols = m3::gpu::split_f32_cols(d, d_proj.data());
      m3::gpu::AngleBwd ab{raw.data(),          dt.data(),         d_cum.data(), nullptr,
                           d_angles_raw.data(), d_dt_angle.data(), nullptr};
      if (direct) ab.d_angles_raw_cols = cols.d_angles_raw;
      m3::gpu::angle_backward(s, d, ab, sc.get());
      m3::gpu::ActBwd p{dd_dt.data(), dd_a.data(),       dt_bias.data(), dt.data(),
                        a_val.data(), trap.data(),       dadt.data(),    ddir.data(),
                        d_dt_angle.data(), dsig.data(),  o_dt.data(),    o_a.data(),
                        o_trap.data(), d_bias.data(),    d.a_floor};
      if (direct) p.into_proj(cols);
      m3::gpu::activations_backward(s, d, p, sc.get());
      if (!direct) {
        m3::gpu::SplitBwd<T> q{nullptr,     nullptr,      nullptr,
                               nullptr,     o_dt.data(),  o_a.data(),
                               o_trap.data(), d_angles_raw.data(), d_proj.data()};
        m3::gpu::split_backward<T>(s, d, q);
      }
      Named out{{"d_proj", down_t(d_proj, s)}, {"d_dd_dt", down(o_dt, s)},
                {"d_dd_a", down(o_a, s)},     {"d_trap_raw", down(o_trap, s)},
                {"d_dt_angle", down(d_dt_angle, s)}, {"d dt_bias", down(d_bias, s)}};
      if (d.na > 0) out["d_angles_raw"] = down(d_angles_raw, s);
      return out;
    };
    const Named direct = run(true), b3 = run(false);
    expect_bitwise("B5b and B5a into d_proj against B3", direct, b3);
    const Vec& dp = direct.at("d_proj");
    size_t f32_cols = 0;
    for (Idx r = 0; r < d.BT; ++r)
      for (Idx j = 0; j < d.ip; ++j) {
        const float v = dp[static_cast<size_t>(r * d.ip + j)];
        if (j < 2 * d.di + 2 * d.ng * d.ds) {
          ASSERT_EQ(v, 3.0f) << "d_proj[" << r << ", " << j << "], a typed part, was written";
        } else if (v != 3.0f) {
          ++f32_cols;
        }
      }
    EXPECT_GT(f32_cols, static_cast<size_t>(d.BT)) << "the f32 parts were not written";

    auto d_proj = up_t<T>(filled, s);
    DeviceArray<float> o(n), bias(d.nh), ang_out(std::max<Idx>(d.BT * d.na, 1));
    const m3::gpu::SplitF32Cols cols = m3::gpu::split_f32_cols(d, d_proj.data());
    m3::gpu::ActBwd some{dd_dt.data(), dd_a.data(), dt_bias.data(), dt.data(), a_val.data(),
                         trap.data(),  dadt.data(), ddir.data(),    nullptr,   dsig.data(),
                         o.data(),     o.data(),    o.data(),       bias.data(), d.a_floor};
    some.d_dd_dt_cols = cols.d_dd_dt;
    EXPECT_THROW(m3::gpu::activations_backward(s, d, some, sc.get()), m3::Error);
    some.d_dd_a_cols = cols.d_dd_a;
    some.d_trap_raw_cols = cols.d_trap_raw;
    some.d_trap_raw_cols.ld = d.nh - 1;
    EXPECT_THROW(m3::gpu::activations_backward(s, d, some, sc.get()), m3::Error);
    if (d.na > 1) {
      m3::gpu::AngleBwd ab{raw.data(), dt.data(), d_cum.data(), nullptr, ang_out.data(), o.data(),
                           nullptr};
      ab.d_angles_raw_cols = cols.d_angles_raw;
      ab.d_angles_raw_cols.ld = d.na - 1;
      EXPECT_THROW(m3::gpu::angle_backward(s, d, ab, sc.get()), m3::Error);
    }
  }
}

// F4 then B4b/B4c on the world's tensors, every output; d_b/c_raw come back in the contiguous
// layout. ldr: the raw rows' stride (0: contiguous; the production layout's column views have
// proj's); the pad columns of X_raw hold 7 and those of d_X_raw −5, and `second` says whether
// the latter are untouched. reference_rms: B4c reads the reference's X_rms instead of F4's.
template <class T>
std::pair<Named, bool> bcnorm_run(const World<T>& w, cudaStream_t s, ScratchBuf& sc, Idx ld,
                                  bool reference_rms) {
  const Dims& d = w.d;
  const Idx bc = d.ng * d.ds, ngds = d.BT * bc, nhds = d.BT * d.nh * d.ds;
  const Idx L = ld ? ld : bc;
  auto wide = [&](const Vec& v, float pad) {
    Vec o(static_cast<size_t>(d.BT * L), pad);
    for (Idx r = 0; r < d.BT; ++r)
      for (Idx q = 0; q < bc; ++q) o[r * L + q] = v[r * bc + q];
    return o;
  };
  auto b_raw = up_t<T>(wide(w.a.b_raw, 7.0f), s), c_raw = up_t<T>(wide(w.a.c_raw, 7.0f), s);
  auto dbr = up_t<T>(Vec(static_cast<size_t>(d.BT * L), -5.0f), s),
       dcr = up_t<T>(Vec(static_cast<size_t>(d.BT * L), -5.0f), s);
  auto bw = up(w.p.b_norm_weight, s), cw = up(w.p.c_norm_weight, s), bb = up(w.p.b_bias, s),
       cb = up(w.p.c_bias, s);
  DeviceArray<T> b_normed(ngds), c_normed(ngds), b_biased(nhds), c_biased(nhds);
  DeviceArray<float> b_rms(d.BT * d.ng), c_rms(d.BT * d.ng);
  m3::gpu::BcnormFwd<T> f{b_raw.data(),    c_raw.data(),    bw.data(),       cw.data(),
                          bb.data(),       cb.data(),       b_normed.data(), c_normed.data(),
                          b_biased.data(), c_biased.data(), b_rms.data(),    c_rms.data()};
  f.ldr = ld;
  m3::gpu::bcnorm_forward<T>(s, d, f);
  auto r_brms = up(w.a.b_rms, s), r_crms = up(w.a.c_rms, s);
  auto dbp = up(w.g.d_b_pre_rope, s), dcp = up(w.g.d_c_pre_rope, s),
       dbw = up(w.pg0.b_norm_weight, s), dcw = up(w.pg0.c_norm_weight, s),
       dbb = up(w.pg0.b_bias, s), dcb = up(w.pg0.c_bias, s);
  DeviceArray<T> dbn(ngds), dcn(ngds);
  const float* brms = reference_rms ? r_brms.data() : b_rms.data();
  const float* crms = reference_rms ? r_crms.data() : c_rms.data();
  m3::gpu::BcnormBwd<T> b{b_raw.data(), c_raw.data(), bw.data(),  cw.data(),
                          brms,         crms,         dbp.data(), dcp.data(),
                          dbn.data(),   dcn.data(),   dbr.data(), dcr.data(),
                          dbw.data(),   dcw.data(),   dbb.data(), dcb.data()};
  b.ldr = ld;
  m3::gpu::bcnorm_backward<T>(s, d, b, sc.get());
  const Vec db = down_t(dbr, s), dc = down_t(dcr, s);
  Vec db_out(static_cast<size_t>(ngds)), dc_out(static_cast<size_t>(ngds));
  bool pads = true;
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx q = 0; q < L; ++q) {
      if (q < bc) {
        db_out[r * bc + q] = db[r * L + q];
        dc_out[r * bc + q] = dc[r * L + q];
      } else {
        pads = pads && db[r * L + q] == -5.0f && dc[r * L + q] == -5.0f;
      }
    }
  return {Named{{"b_normed", down_t(b_normed, s)}, {"c_normed", down_t(c_normed, s)},
                {"b_biased", down_t(b_biased, s)}, {"c_biased", down_t(c_biased, s)},
                {"b_rms", down(b_rms, s)},         {"c_rms", down(c_rms, s)},
                {"d_b_normed", down_t(dbn, s)},    {"d_c_normed", down_t(dcn, s)},
                {"d_b_raw", db_out},               {"d_c_raw", dc_out},
                {"d_b_norm_weight", down(dbw, s)}, {"d_c_norm_weight", down(dcw, s)},
                {"d_b_bias", down(dbb, s)},        {"d_c_bias", down(dcb, s)}},
          pads};
}

// F4 (normed rounded, then the bias add reads the stored normed) and B4b/B4c (d_normed rounded,
// then B4c reads the stored d_normed).
TYPED_TEST(TypedStages, BcnormForwardAndBackwardMatchReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    World<T> w = make_world<T>(c, false);
    const Dims& d = w.d;
    LParams pg = w.pg0;
    m3::ref::bcnorm_backward(d, w.p, w.a, w.g, pg);  // rounds d_normed, then d_raw
    Stream s;
    ScratchBuf sc(d);
    const Named got =
        twice("bcnorm", [&] { return bcnorm_run(w, s, sc, 0, true).first; });
    expect_typed<T>("b_normed", got.at("b_normed"), w.a.b_normed, 1e-6, 0.99);
    expect_typed<T>("c_normed", got.at("c_normed"), w.a.c_normed, 1e-6, 0.99);
    // biased = round(round(normed) + bias): a one-ulp difference in the stored normed (the
    // RMS summed in another order) survives the add, and where normed and bias nearly cancel
    // it is many ulps of the small result — so the floor is 2 ulps at the tensor's scale.
    expect_typed<T>("b_biased", got.at("b_biased"), w.a.b_biased, scale_ulps_rel<T>(w.a.b_biased),
                    0.99);
    expect_typed<T>("c_biased", got.at("c_biased"), w.a.c_biased, scale_ulps_rel<T>(w.a.c_biased),
                    0.99);
    expect_close("b_rms", got.at("b_rms"), w.a.b_rms);
    expect_close("c_rms", got.at("c_rms"), w.a.c_rms);
    // Σ over the group's heads in ascending order on both sides: the same f32 sum, one rounding.
    expect_typed<T>("d_b_normed", got.at("d_b_normed"), w.g.d_b_normed, 0.0, 0.999);
    expect_typed<T>("d_c_normed", got.at("d_c_normed"), w.g.d_c_normed, 0.0, 0.999);
    expect_typed<T>("d_b_raw", got.at("d_b_raw"), w.g.d_b_raw, 1e-6, 0.98);
    expect_typed<T>("d_c_raw", got.at("d_c_raw"), w.g.d_c_raw, 1e-6, 0.98);
    expect_close("d b_norm_weight (accumulated)", got.at("d_b_norm_weight"), pg.b_norm_weight);
    expect_close("d c_norm_weight (accumulated)", got.at("d_c_norm_weight"), pg.c_norm_weight);
    expect_close("d b_bias (accumulated)", got.at("d_b_bias"), pg.b_bias);
    expect_close("d c_bias (accumulated)", got.at("d_c_bias"), pg.c_bias);
  }
}

// b/c_raw and d_b/c_raw read and written with a row stride ldr > ng·ds, as the production
// layout's column views of proj / d_proj: the bits of the contiguous run, and nothing written
// outside their columns; pads that keep the vectors aligned (8) and one that does not (3).
TYPED_TEST(TypedStages, BcnormWithStridedRawRowsGivesTheContiguousBits) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    World<T> w = make_world<T>(c, false);
    const Dims& d = w.d;
    Stream s;
    ScratchBuf sc(d);
    const Idx bc = d.ng * d.ds;
    auto run = [&](Idx ld) { return bcnorm_run(w, s, sc, ld, false); };
    const auto want = run(0);
    for (Idx pad : {Idx(8), Idx(3)}) {
      SCOPED_TRACE(std::string(c.name) + " ldr = ng·ds + " + std::to_string(pad));
      const auto got = run(bc + pad);
      EXPECT_TRUE(got.second) << "a value outside d_b/c_raw's columns was written";
      for (const auto& [name, v] : want.first)
        EXPECT_EQ(got.first.at(name), v) << name << " differs from the contiguous run";
    }
  }
}

// F4e/f: k, q rounded once.
TYPED_TEST(TypedStages, RopeForwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    World<T> w = make_world<T>(c, false);
    const Dims& d = w.d;
    Stream s;
    const Named got = twice("rope_forward", [&] {
      auto th = up(w.a.angle_cumsum, s);
      auto bb = up_t<T>(w.a.b_biased, s), cb = up_t<T>(w.a.c_biased, s);
      DeviceArray<T> k(d.BT * d.nh * d.ds), q(d.BT * d.nh * d.ds);
      m3::gpu::rope_forward<T>(s, d, th.data(), bb.data(), cb.data(), k.data(), q.data());
      return Named{{"k", down_t(k, s)}, {"q", down_t(q, s)}};
    });
    // c·b0 − s·b1 can cancel, and sincosf is not glibc's sin/cos: a few more flips than F4
    expect_typed<T>("k", got.at("k"), w.a.k, 1e-6, 0.98);
    expect_typed<T>("q", got.at("q"), w.a.q, 1e-6, 0.98);
  }
}

// The RoPE backward with typed rotated vectors (sequential B6 tail) and with the chunked path's
// qk extra (typed c_biased / b_biased); every output f32.
TYPED_TEST(TypedStages, RopeBackwardMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    for (bool extra : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (extra ? " with qk extra" : ""));
      World<T> w = make_world<T>(c, false);
      const Dims& d = w.d;
      Rng rng(5);
      Vec wqk(static_cast<size_t>(d.BT * d.nh));
      fill(wqk, rng, -1.0, 1.0);
      Vec db(w.g.d_b_pre_rope.size()), dc(db.size()), dth(w.g.d_angle_cumsum.size(), 0.0f);
      m3::ref::rope_backward_into(d, w.a.angle_cumsum.data(), w.g.d_k.data(), w.a.k.data(),
                                  db.data(), dth.data());
      m3::ref::rope_backward_into(d, w.a.angle_cumsum.data(), w.g.d_q.data(), w.a.q.data(),
                                  dc.data(), dth.data());
      if (extra)
        for (Idx i = 0; i < d.BT * d.nh; ++i)
          for (Idx n = 0; n < d.ds; ++n) {
            db[i * d.ds + n] += wqk[i] * w.a.c_biased[i * d.ds + n];
            dc[i * d.ds + n] += wqk[i] * w.a.b_biased[i * d.ds + n];
          }
      Stream s;
      const Idx n = d.BT * d.nh * d.ds;
      const Named got = twice("rope_backward", [&] {
        auto th = up(w.a.angle_cumsum, s), dk = up(w.g.d_k, s), dq = up(w.g.d_q, s),
             ew = up(wqk, s);
        auto k = up_t<T>(w.a.k, s), q = up_t<T>(w.a.q, s), ev1 = up_t<T>(w.a.c_biased, s),
             ev2 = up_t<T>(w.a.b_biased, s);
        DeviceArray<float> gdb(n), gdc(n), gdth(d.BT * d.nh * d.na);
        m3::gpu::RopeBwd<T> p{th.data(),  dk.data(),  dq.data(),   k.data(),
                              q.data(),   gdb.data(), gdc.data(),  gdth.data(),
                              extra ? ew.data() : nullptr, extra ? ev1.data() : nullptr,
                              extra ? ev2.data() : nullptr};
        m3::gpu::rope_backward<T>(s, d, p);
        return Named{{"d_b_pre_rope", down(gdb, s)}, {"d_c_pre_rope", down(gdc, s)},
                     {"d_angle_cumsum", down(gdth, s)}};
      });
      expect_close("d_b_pre_rope", got.at("d_b_pre_rope"), db);
      expect_close("d_c_pre_rope", got.at("d_c_pre_rope"), dc);
      expect_close("d_angle_cumsum", got.at("d_angle_cumsum"), dth);
    }
  }
}

// F7 (gated rounded) and B7 (d_y, d_z rounded; d norm_gate_weight f32), both variants.
TYPED_TEST(TypedStages, GatingMatchesReferenceBothVariants) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    for (bool norm : {false, true}) {
      SCOPED_TRACE(std::string(c.name) + (norm ? " is_outproj_norm" : " silu gate"));
      World<T> w = make_world<T>(c, norm);
      const Dims& d = w.d;
      LParams pg = w.pg0;
      m3::ref::gating_backward(d, w.p, w.a, w.g, pg);
      m3::ref::store_typed(d, w.g.d_y);
      m3::ref::store_typed(d, w.g.d_z);
      Stream s;
      ScratchBuf sc(d);
      const Idx n = d.BT * d.di;
      const Named got = twice("gating", [&] {
        auto y = up_t<T>(w.a.y, s), z = up_t<T>(w.a.z, s), dg = up_t<T>(w.g.d_gated, s);
        auto ngw = up(w.p.norm_gate_weight, s), r_rstd = up(w.a.gated_rms_vals, s),
             dngw = up(w.pg0.norm_gate_weight, s);
        DeviceArray<T> gated(n), dy(n), dz(n);
        DeviceArray<float> rstd(norm ? d.BT * d.nh : 0);
        m3::gpu::gating_forward<T>(s, d, y.data(), z.data(), ngw.data(), gated.data(),
                                   norm ? rstd.data() : nullptr);
        m3::gpu::GatingBwd<T> p{y.data(),  z.data(),  dg.data(),  ngw.data(),
                                norm ? r_rstd.data() : nullptr,  dy.data(),
                                dz.data(), dngw.data()};
        m3::gpu::gating_backward<T>(s, d, p, sc.get());
        return Named{{"gated", down_t(gated, s)}, {"rstd", down(rstd, s)},
                     {"d_y", down_t(dy, s)},       {"d_z", down_t(dz, s)},
                     {"d_norm_gate_weight", down(dngw, s)}};
      });
      expect_typed<T>("gated", got.at("gated"), w.a.gated, 1e-6, 0.99);
      if (norm) expect_close("gated_rms_vals", got.at("rstd"), w.a.gated_rms_vals);
      expect_typed<T>("d_y", got.at("d_y"), w.g.d_y, 1e-6, 0.98);
      expect_typed<T>("d_z", got.at("d_z"), w.g.d_z, 1e-6, 0.98);
      expect_close("d norm_gate_weight (accumulated / untouched)",
                   got.at("d_norm_gate_weight"), pg.norm_gate_weight);
    }
  }
}

// z (and d_z) read and written with a row stride ldz > di, as the production layout's column
// views of proj / d_proj: the bits of the contiguous run, and nothing written outside z's
// columns. Pads that keep 16-byte vectors (ld − di a multiple of 8) and one that does not (the
// one-value path), both variants.
TYPED_TEST(TypedStages, GatingWithAStridedZGivesTheContiguousBits) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const Case& c : kCases) {
    for (bool norm : {false, true}) {
      World<T> w = make_world<T>(c, norm);
      const Dims& d = w.d;
      Stream s;
      ScratchBuf sc(d);
      const Idx n = d.BT * d.di;
      // run(ld): z at row stride ld (0: contiguous); returns the outputs, d_z unpacked, and
      // whether every pad value of z's and d_z's buffers is still the sentinel.
      auto run = [&](Idx ld) {
        const Idx L = ld ? ld : d.di;
        Vec zw(static_cast<size_t>(d.BT * L), 7.0f), dzw(zw.size(), -5.0f);
        for (Idx r = 0; r < d.BT; ++r)
          for (Idx q = 0; q < d.di; ++q) zw[r * L + q] = w.a.z[r * d.di + q];
        auto y = up_t<T>(w.a.y, s), z = up_t<T>(zw, s), dg = up_t<T>(w.g.d_gated, s),
             dz = up_t<T>(dzw, s);
        auto ngw = up(w.p.norm_gate_weight, s), r_rstd = up(w.a.gated_rms_vals, s),
             dngw = up(w.pg0.norm_gate_weight, s);
        DeviceArray<T> gated(n), dy(n);
        DeviceArray<float> rstd(norm ? d.BT * d.nh : 0);
        m3::gpu::gating_forward<T>(s, d, y.data(), z.data(), ngw.data(), gated.data(),
                                   norm ? rstd.data() : nullptr, ld);
        m3::gpu::GatingBwd<T> p{y.data(),  z.data(),  dg.data(),  ngw.data(),
                                norm ? r_rstd.data() : nullptr,  dy.data(),
                                dz.data(), dngw.data()};
        p.ldz = ld;
        m3::gpu::gating_backward<T>(s, d, p, sc.get());
        const Vec zb = down_t(z, s), dzb = down_t(dz, s);
        Vec dz_packed(static_cast<size_t>(n));
        bool pads = true;
        for (Idx r = 0; r < d.BT; ++r)
          for (Idx q = 0; q < L; ++q) {
            if (q < d.di) {
              dz_packed[r * d.di + q] = dzb[r * L + q];
            } else {
              pads = pads && zb[r * L + q] == 7.0f && dzb[r * L + q] == -5.0f;
            }
          }
        return std::make_pair(Named{{"gated", down_t(gated, s)}, {"rstd", down(rstd, s)},
                                    {"d_y", down_t(dy, s)}, {"d_z", dz_packed},
                                    {"d_norm_gate_weight", down(dngw, s)}},
                              pads);
      };
      const auto want = run(0);
      for (Idx pad : {Idx(8), Idx(24), Idx(3)}) {
        SCOPED_TRACE(std::string(c.name) + (norm ? " is_outproj_norm" : " silu gate") +
                     " ld = di + " + std::to_string(pad));
        const auto got = run(d.di + pad);
        EXPECT_TRUE(got.second) << "a value outside z's columns was written";
        for (const auto& [name, v] : want.first)
          EXPECT_EQ(got.first.at(name), v) << name << " differs from the contiguous run";
      }
    }
  }
}

// The GEMMs: F2 (post_norm·in_proj_w → proj), input_proj with its f32 bias (one rounding after
// the bias add), B2 dX (typed), and dW (f32, accumulated onto a non-zero start).
TYPED_TEST(TypedStages, GemmsMatchReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  m3::gpu::GpuContext ctx(0);
  const cudaStream_t s = m3::gpu::stream_of(ctx);
  for (const Case& c : kCases) {
    SCOPED_TRACE(c.name);
    const Config cfg = make_config(c, false);
    const Dims d = Dims::of(cfg, c.B, c.T, Storage<T>::kPrecision);
    const m3::Params<float> p = m3::make_params<float>(cfg, 3, m3::Init::Perturbed);
    Rng rng(21);
    const Idx BT = d.BT;
    Vec X(static_cast<size_t>(BT * d.dm)), Xin(static_cast<size_t>(BT * d.in)),
        dY(static_cast<size_t>(BT * d.ip)), dW0(static_cast<size_t>(d.dm * d.ip));
    for (auto& e : X) e = static_cast<float>(rng.normalish());
    for (auto& e : Xin) e = static_cast<float>(rng.normalish());
    fill(dY, rng, -1.0, 1.0);
    fill(dW0, rng, -1.0, 1.0);
    X = rounded<T>(X);
    Xin = rounded<T>(Xin);
    dY = rounded<T>(dY);
    const Vec W = rounded<T>(p.layers[0].in_proj_w), Win = rounded<T>(p.input_proj_w);
    Vec bias = p.input_proj_b;
    fill(bias, rng, -2.0, 2.0);
    // reference: float GEMM, then store_typed
    Vec Y(static_cast<size_t>(BT * d.ip)), H(static_cast<size_t>(BT * d.dm)),
        dX(static_cast<size_t>(BT * d.dm)), dW = dW0;
    m3::ref::linear_forward(BT, d.dm, d.ip, X.data(), W.data(), static_cast<const float*>(nullptr),
                            Y.data());
    m3::ref::store_typed(d, Y);
    m3::ref::linear_forward(BT, d.in, d.dm, Xin.data(), Win.data(), bias.data(), H.data());
    m3::ref::store_typed(d, H);
    m3::ref::linear_backward(BT, d.dm, d.ip, X.data(), W.data(), dY.data(), dX.data(), dW.data(),
                             static_cast<float*>(nullptr));
    m3::ref::store_typed(d, dX);
    ScratchBuf sc(d);
    const Named got = twice("gemm", [&] {
      auto dx_in = up_t<T>(X, s), dw_t = up_t<T>(W, s), dxin = up_t<T>(Xin, s),
           dwin = up_t<T>(Win, s), ddy = up_t<T>(dY, s);
      auto dbias = up(bias, s), ddw = up(dW0, s);
      DeviceArray<T> dy_out(BT * d.ip), dh(BT * d.dm), ddx(BT * d.dm);
      m3::gpu::gemm_forward<T>(ctx, BT, d.dm, d.ip, dx_in.data(), dw_t.data(), nullptr,
                               dy_out.data());
      m3::gpu::gemm_forward<T>(ctx, BT, d.in, d.dm, dxin.data(), dwin.data(), dbias.data(),
                               dh.data(), sc.get());
      m3::gpu::gemm_backward_dx<T>(ctx, BT, d.dm, d.ip, ddy.data(), dw_t.data(), ddx.data());
      m3::gpu::gemm_backward_dw<T>(ctx, BT, d.dm, d.ip, dx_in.data(), ddy.data(), ddw.data());
      return Named{{"Y", down_t(dy_out, s)}, {"H", down_t(dh, s)}, {"dX", down_t(ddx, s)},
                   {"dW", down(ddw, s)}};
    });
    expect_typed<T>("proj = X·W", got.at("Y"), Y, 1e-5, 0.95);
    expect_typed<T>("input_proj X·W + b", got.at("H"), H, 1e-5, 0.95);
    expect_typed<T>("dX = dY·Wᵀ", got.at("dX"), dX, 1e-5, 0.95);
    expect_close("dW += Xᵀ·dY", got.at("dW"), dW);
    // a typed biased GEMM without its f32 scratch is refused
    DeviceArray<T> a(BT * d.in), wgt(d.in * d.dm), out(BT * d.dm);
    DeviceArray<float> b(d.dm);
    EXPECT_THROW(m3::gpu::gemm_forward<T>(ctx, BT, d.in, d.dm, a.data(), wgt.data(), b.data(),
                                          out.data(), Scratch{}),
                 m3::Error);
  }
}

// ===============================================================================================
// F6 / B6 in both scan modes
// ===============================================================================================
struct SsmCase {
  Idx hd, ds, nh, B, T, cs;
  std::string name() const {
    return "hd" + std::to_string(hd) + "_ds" + std::to_string(ds) + "_nh" + std::to_string(nh) +
           "_B" + std::to_string(B) + "_T" + std::to_string(T) + "_cs" + std::to_string(cs);
  }
};

const SsmCase kSsmCases[] = {
    {16, 16, 2, 2, 37, 7},
    {64, 128, 2, 2, 130, 64},   // official head shape, ragged last chunk
    {5, 33, 3, 1, 29, 4},       // odd sizes
    {32, 16, 2, 2, 150, 200},   // one chunk of 150 rows = 3 row tiles
    {128, 128, 2, 1, 70, 64},
};

Config ssm_config(const SsmCase& c) {
  Config cfg;
  cfg.headdim = c.hd;
  cfg.d_state = c.ds;
  cfg.expand = 1;
  cfg.d_model = c.nh * c.hd;
  cfg.ngroups = 1;
  cfg.n_layers = 1;
  cfg.rope_fraction = 0.5;
  cfg.chunk_size = c.cs;
  cfg.input_dim = cfg.d_model;
  return cfg;
}

using Tensors = std::map<std::string, std::vector<double>>;

// Inputs in double, every value representable in float; the typed ones (x, k, q, b_biased,
// c_biased, d_y) representable in T.
struct SsmInputs {
  std::vector<double> x, k, q, alpha, beta, gamma, dt, a_val, trap, b_biased, c_biased, theta;
  std::vector<double> ssm_in, k_in, v_in, d_param;
  std::vector<double> d_y, d_ssm_out, d_k_out, d_v_out, d_param_acc;
};

template <class T>
SsmInputs ssm_inputs(const Dims& d, std::uint64_t seed) {
  Rng rng(seed);
  SsmInputs in;
  auto fill_d = [&](std::vector<double>& v, Idx n, double lo, double hi, bool typed) {
    v.resize(static_cast<size_t>(n));
    for (auto& e : v) {
      const float f = static_cast<float>(rng.uniform(lo, hi));
      e = typed ? rnd<T>(f) : f;
    }
  };
  const Idx BT = d.BT, nh = d.nh;
  fill_d(in.x, BT * d.di, -1, 1, true);
  fill_d(in.b_biased, BT * nh * d.ds, -1, 1, true);
  fill_d(in.c_biased, BT * nh * d.ds, -1, 1, true);
  fill_d(in.theta, BT * nh * d.na, 0, 6.28, false);
  fill_d(in.dt, BT * nh, 0.01, 0.3, false);
  fill_d(in.a_val, BT * nh, -1.5, -0.05, false);
  fill_d(in.trap, BT * nh, 0.1, 0.9, false);
  fill_d(in.ssm_in, d.B * nh * d.hd * d.ds, -0.5, 0.5, false);
  fill_d(in.k_in, d.B * nh * d.ds, -0.5, 0.5, false);
  fill_d(in.v_in, d.B * nh * d.hd, -0.5, 0.5, false);
  fill_d(in.d_param, nh, 0.7, 1.3, false);
  fill_d(in.d_y, BT * d.di, -1, 1, true);
  fill_d(in.d_ssm_out, d.B * nh * d.hd * d.ds, -0.5, 0.5, false);
  fill_d(in.d_k_out, d.B * nh * d.ds, -0.5, 0.5, false);
  fill_d(in.d_v_out, d.B * nh * d.hd, -0.5, 0.5, false);
  fill_d(in.d_param_acc, nh, -0.5, 0.5, false);
  m3::ref::LayerActs<double> a;
  a.allocate(d, ScanMode::Sequential);
  a.b_biased = in.b_biased;
  a.c_biased = in.c_biased;
  a.angle_cumsum = in.theta;
  a.dt = in.dt;
  a.a_val = in.a_val;
  a.trap = in.trap;
  m3::ref::rope_forward(d, a);
  m3::ref::abg_forward(d, a);
  for (auto* v : {&a.k, &a.q})
    for (auto& e : *v) e = rnd<T>(static_cast<float>(e));
  for (auto* v : {&a.alpha, &a.beta, &a.gamma})
    for (auto& e : *v) e = static_cast<float>(e);
  in.k = a.k;
  in.q = a.q;
  in.alpha = a.alpha;
  in.beta = a.beta;
  in.gamma = a.gamma;
  return in;
}

template <class S>
std::vector<S> cast(const std::vector<double>& v) {
  return std::vector<S>(v.begin(), v.end());
}
template <class S>
std::vector<double> to_double(const std::vector<S>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// The reference F6 → B6 (+ the sequential glue) with the storage emulation of d (k_scaled_saved
// rounded inside the chunked stage); y and d_x are returned before their store rounding (the
// caller rounds them) so the f32 noise of the float reference can be measured on them.
template <class S>
Tensors ref_ssm(const Dims& d, const SsmInputs& in, ScanMode mode) {
  m3::ref::LayerActs<S> a;
  m3::ref::LayerGrads<S> g;
  m3::LayerParams<S> p, pg;
  a.allocate(d, mode);
  g.allocate(d, mode);
  a.x = cast<S>(in.x);
  a.k = cast<S>(in.k);
  a.q = cast<S>(in.q);
  a.alpha = cast<S>(in.alpha);
  a.beta = cast<S>(in.beta);
  a.gamma = cast<S>(in.gamma);
  a.dt = cast<S>(in.dt);
  a.a_val = cast<S>(in.a_val);
  a.trap = cast<S>(in.trap);
  a.b_biased = cast<S>(in.b_biased);
  a.c_biased = cast<S>(in.c_biased);
  a.angle_cumsum = cast<S>(in.theta);
  a.ssm_in = cast<S>(in.ssm_in);
  a.k_in = cast<S>(in.k_in);
  a.v_in = cast<S>(in.v_in);
  p.d_param = cast<S>(in.d_param);
  pg.d_param = cast<S>(in.d_param_acc);
  g.d_y = cast<S>(in.d_y);
  g.d_ssm_out = cast<S>(in.d_ssm_out);
  g.d_k_out = cast<S>(in.d_k_out);
  g.d_v_out = cast<S>(in.d_v_out);
  Tensors t;
  if (mode == ScanMode::Sequential) {
    m3::ref::ssm_seq_forward(d, p, a);
    m3::ref::ssm_seq_backward(d, p, a, g, pg);
    m3::ref::rope_backward(d, a, g);
    for (const auto& [name, v] : std::vector<std::pair<const char*, const std::vector<S>*>>{
             {"h_saved", &a.h_saved}, {"k_prev_saved", &a.k_prev_saved},
             {"v_prev_saved", &a.v_prev_saved}, {"d_k", &g.d_k}, {"d_q", &g.d_q},
             {"d_alpha", &g.d_alpha}, {"d_beta", &g.d_beta}, {"d_gamma", &g.d_gamma},
             {"d_d_local", &g.d_d_local}})
      t[name] = to_double(*v);
  } else {
    m3::ref::ssm_chunked_forward(d, p, a);
    m3::ref::ssm_chunked_backward(d, p, a, g, pg);
    for (const auto& [name, v] : std::vector<std::pair<const char*, const std::vector<S>*>>{
             {"adt", &a.adt}, {"k_scaled_saved", &a.k_scaled_saved},
             {"qk_dot_saved", &a.qk_dot_saved}, {"scale_saved", &a.scale_saved},
             {"gamma_saved", &a.gamma_saved}, {"da_cumsum_saved", &a.da_cumsum_saved},
             {"chunk_states", &a.chunk_states}, {"chunk_states_saved", &a.chunk_states_saved},
             {"final_states", &a.final_states}, {"da_cs_sum", &g.da_cs_sum},
             {"dQ_mid", &g.dQ_mid}, {"dK_mid", &g.dK_mid}, {"dADT", &g.dADT},
             {"dQK_dot", &g.dQK_dot}, {"dD_partials", &g.dD_partials}, {"dScale", &g.dScale},
             {"dGamma", &g.dGamma}, {"dDT", &g.dDT}, {"d_adt_total", &g.d_adt_total},
             {"d_dt_direct", &g.d_dt_direct}, {"d_trap_sig", &g.d_trap_sig}})
      t[name] = to_double(*v);
  }
  for (const auto& [name, v] : std::vector<std::pair<const char*, const std::vector<S>*>>{
           {"y", &a.y}, {"ssm_out", &a.ssm_out}, {"k_out", &a.k_out}, {"v_out", &a.v_out},
           {"d_x", &g.d_x}, {"d_ssm_in", &g.d_ssm_in}, {"d_k_in", &g.d_k_in},
           {"d_v_in", &g.d_v_in}, {"d_d_param", &pg.d_param},
           {"d_b_pre_rope", &g.d_b_pre_rope}, {"d_c_pre_rope", &g.d_c_pre_rope},
           {"d_angle_cumsum", &g.d_angle_cumsum}})
    t[name] = to_double(*v);
  return t;
}

// Named device buffers of one GPU run: inputs uploaded (typed ones in T), outputs pre-filled
// with NaN bytes (so an element never written fails), downloaded as double.
template <class T>
class Bufs {
 public:
  explicit Bufs(cudaStream_t s) : s_(s) {}
  float* in(const std::string& name, const std::vector<double>& v) {
    DeviceArray<float>& a = f_[name];
    a = up(cast<float>(v), s_);
    return a.data();
  }
  T* in_t(const std::string& name, const std::vector<double>& v) {
    DeviceArray<T>& a = t_[name];
    a = up_t<T>(cast<float>(v), s_);
    return a.data();
  }
  float* out(const std::string& name, Idx n) {
    DeviceArray<float>& a = f_[name];
    a.resize(n);
    nan_fill(a.data(), n * sizeof(float));
    outs_.push_back(name);
    return a.data();
  }
  T* out_t(const std::string& name, Idx n) {
    DeviceArray<T>& a = t_[name];
    a.resize(n);
    nan_fill(a.data(), n * sizeof(T));
    outs_t_.push_back(name);
    return a.data();
  }
  Tensors download() {
    Tensors t;
    for (const auto& name : outs_) t[name] = to_double(down(f_.at(name), s_));
    for (const auto& name : outs_t_) t[name] = to_double(down_t(t_.at(name), s_));
    return t;
  }

 private:
  void nan_fill(void* p, Idx bytes) {
    if (bytes) M3_CUDA_CHECK(cudaMemsetAsync(p, 0xff, static_cast<size_t>(bytes), s_));
  }
  cudaStream_t s_;
  std::map<std::string, DeviceArray<float>> f_;
  std::map<std::string, DeviceArray<T>> t_;
  std::vector<std::string> outs_, outs_t_;
};

template <class T>
Tensors gpu_ssm(const Dims& d, const SsmInputs& in, ScanMode mode, bool fuse_states = false) {
  Stream st;
  const cudaStream_t s = st;
  Bufs<T> b(s);
  const Idx BT = d.BT, nh = d.nh;
  DeviceArray<float> scr(m3::gpu::scratch_floats(d));
  const Scratch scratch{scr.data(), scr.size()};
  T* x = b.in_t("x", in.x);
  T* k = b.in_t("k", in.k);
  T* q = b.in_t("q", in.q);
  T* dy = b.in_t("d_y", in.d_y);
  float* d_param = b.in("d_param", in.d_param);
  float* ssm_in = b.in("ssm_in", in.ssm_in);
  float* k_in = b.in("k_in", in.k_in);
  float* v_in = b.in("v_in", in.v_in);
  float* theta = b.in("theta", in.theta);
  float* d_ssm_out = b.in("d_ssm_out", in.d_ssm_out);
  float* d_k_out = b.in("d_k_out", in.d_k_out);
  float* d_v_out = b.in("d_v_out", in.d_v_out);
  float* dD = b.in("d_d_param_acc", in.d_param_acc);
  if (mode == ScanMode::Sequential) {
    m3::gpu::SsmSeqFwd<T> f{};
    f.x = x;
    f.k = k;
    f.q = q;
    f.alpha = b.in("alpha", in.alpha);
    f.beta = b.in("beta", in.beta);
    f.gamma = b.in("gamma", in.gamma);
    f.d_param = d_param;
    f.ssm_in = ssm_in;
    f.k_in = k_in;
    f.v_in = v_in;
    f.y = b.out_t("y", BT * d.di);
    f.h_saved = b.out("h_saved", d.B * (d.T + 1) * d.ds * d.di);
    f.k_prev_saved = b.out("k_prev_saved", BT * nh * d.ds);
    f.v_prev_saved = b.out("v_prev_saved", BT * nh * d.hd);
    f.ssm_out = b.out("ssm_out", d.B * nh * d.hd * d.ds);
    f.k_out = b.out("k_out", d.B * nh * d.ds);
    f.v_out = b.out("v_out", d.B * nh * d.hd);
    m3::gpu::ssm_seq_forward<T>(s, d, f);
    m3::gpu::SsmSeqBwd<T> g{};
    g.x = x;
    g.k = k;
    g.q = q;
    g.d_y = dy;
    g.alpha = f.alpha;
    g.beta = f.beta;
    g.gamma = f.gamma;
    g.d_param = d_param;
    g.h_saved = f.h_saved;
    g.k_prev_saved = f.k_prev_saved;
    g.v_prev_saved = f.v_prev_saved;
    g.d_ssm_out = d_ssm_out;
    g.d_k_out = d_k_out;
    g.d_v_out = d_v_out;
    g.d_x = b.out_t("d_x", BT * d.di);
    g.d_k = b.out("d_k", BT * nh * d.ds);
    g.d_q = b.out("d_q", BT * nh * d.ds);
    g.d_alpha = b.out("d_alpha", BT * nh);
    g.d_beta = b.out("d_beta", BT * nh);
    g.d_gamma = b.out("d_gamma", BT * nh);
    g.d_d_local = b.out("d_d_local", d.B * d.di);
    g.d_ssm_in = b.out("d_ssm_in", d.B * nh * d.hd * d.ds);
    g.d_k_in = b.out("d_k_in", d.B * nh * d.ds);
    g.d_v_in = b.out("d_v_in", d.B * nh * d.hd);
    g.d_d_param = dD;
    m3::gpu::ssm_seq_backward<T>(s, d, g, scratch);
    m3::gpu::RopeBwd<T> rb{};
    rb.theta = theta;
    rb.dv1 = g.d_k;
    rb.dv2 = g.d_q;
    rb.rot1 = k;
    rb.rot2 = q;
    rb.dpre1 = b.out("d_b_pre_rope", BT * nh * d.ds);
    rb.dpre2 = b.out("d_c_pre_rope", BT * nh * d.ds);
    rb.dtheta = b.out("d_angle_cumsum", BT * nh * d.na);
    m3::gpu::rope_backward<T>(s, d, rb);
  } else {
    const Idx nstate = d.B * d.nc * nh * d.hd * d.ds;
    m3::gpu::SsmChunkFwd<T> f{};
    f.x = x;
    f.k = k;
    f.q = q;
    f.dt = b.in("dt", in.dt);
    f.trap = b.in("trap", in.trap);
    f.a_val = b.in("a_val", in.a_val);
    f.d_param = d_param;
    f.ssm_in = ssm_in;
    f.k_in = k_in;
    f.v_in = v_in;
    f.k_scaled_saved = b.out_t("k_scaled_saved", BT * nh * d.ds);
    f.y = b.out_t("y", BT * d.di);
    f.adt = b.out("adt", BT * nh);
    f.qk_dot_saved = b.out("qk_dot_saved", BT * nh);
    f.scale_saved = b.out("scale_saved", BT * nh);
    f.gamma_saved = b.out("gamma_saved", BT * nh);
    f.da_cumsum_saved = b.out("da_cumsum_saved", d.B * d.nc * nh * d.cs);
    f.chunk_states = b.out("chunk_states", nstate);
    f.chunk_states_saved = b.out("chunk_states_saved", nstate);
    f.final_states = b.out("final_states", d.B * nh * d.hd * d.ds);
    f.ssm_out = b.out("ssm_out", d.B * nh * d.hd * d.ds);
    f.k_out = b.out("k_out", d.B * nh * d.ds);
    f.v_out = b.out("v_out", d.B * nh * d.hd);
    f.fuse_states = fuse_states;
    m3::gpu::ssm_chunked_forward<T>(s, d, f, scratch);
    m3::gpu::SsmChunkBwd<T> g{};
    g.x = x;
    g.k = k;
    g.q = q;
    g.b_biased = b.in_t("b_biased", in.b_biased);
    g.c_biased = b.in_t("c_biased", in.c_biased);
    g.k_scaled_saved = f.k_scaled_saved;
    g.d_y = dy;
    g.theta = theta;
    g.dt = f.dt;
    g.trap = f.trap;
    g.a_val = f.a_val;
    g.d_param = d_param;
    g.qk_dot_saved = f.qk_dot_saved;
    g.scale_saved = f.scale_saved;
    g.gamma_saved = f.gamma_saved;
    g.da_cumsum_saved = f.da_cumsum_saved;
    g.chunk_states_saved = f.chunk_states_saved;
    g.k_in = k_in;
    g.v_in = v_in;
    g.d_ssm_out = d_ssm_out;
    g.d_k_out = d_k_out;
    g.d_v_out = d_v_out;
    g.da_cs_sum = b.out("da_cs_sum", d.B * d.nc * nh);
    g.dQ_mid = b.out("dQ_mid", BT * nh * d.ds);
    g.dK_mid = b.out("dK_mid", BT * nh * d.ds);
    g.dADT = b.out("dADT", BT * nh);
    g.dQK_dot = b.out("dQK_dot", BT * nh);
    g.dD_partials = b.out("dD_partials", d.B * nh);
    g.dScale = b.out("dScale", BT * nh);
    g.dGamma = b.out("dGamma", BT * nh);
    g.dDT = b.out("dDT", BT * nh);
    g.d_x = b.out_t("d_x", BT * d.di);
    g.d_b_pre_rope = b.out("d_b_pre_rope", BT * nh * d.ds);
    g.d_c_pre_rope = b.out("d_c_pre_rope", BT * nh * d.ds);
    g.d_angle_cumsum = b.out("d_angle_cumsum", BT * nh * d.na);
    g.d_adt_total = b.out("d_adt_total", BT * nh);
    g.d_dt_direct = b.out("d_dt_direct", BT * nh);
    g.d_trap_sig = b.out("d_trap_sig", BT * nh);
    g.d_ssm_in = b.out("d_ssm_in", d.B * nh * d.hd * d.ds);
    g.d_k_in = b.out("d_k_in", d.B * nh * d.ds);
    g.d_v_in = b.out("d_v_in", d.B * nh * d.hd);
    g.d_d_param = dD;
    g.fuse_states = fuse_states;
    m3::gpu::ssm_chunked_backward<T>(s, d, g, scratch);
  }
  Tensors t = b.download();
  std::vector<float> acc(static_cast<size_t>(nh));
  M3_CUDA_CHECK(cudaMemcpy(acc.data(), dD, acc.size() * sizeof(float), cudaMemcpyDeviceToHost));
  t["d_d_param"] = to_double(acc);
  return t;
}

// Every tensor of a has the bits of the same tensor of b (an, bn: how each was run); a
// difference is reported at its first element.
void expect_same_bits(const Tensors& a, const char* an, const Tensors& b, const char* bn) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [n, v] : a) {
    ASSERT_TRUE(b.count(n)) << n;
    const auto& w = b.at(n);
    ASSERT_EQ(v.size(), w.size()) << n;
    size_t first = v.size();
    for (size_t i = 0; i < v.size() && first == v.size(); ++i)
      if (std::memcmp(&v[i], &w[i], sizeof(double)) != 0) first = i;
    EXPECT_EQ(first, v.size()) << n << " differs first at " << first << ": " << an << " "
                               << (first < v.size() ? v[first] : 0.0) << ", " << bn << " "
                               << (first < w.size() ? w[first] : 0.0);
  }
}

struct Err {
  double rel_l2 = 0, max_rel = 0;
};

// ‖a − b‖₂ / ‖b‖₂ and max|a − b| / max|b|; NaN anywhere → +inf.
Err err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0, mx = 0, mref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double dlt = a[i] - b[i];
    if (!std::isfinite(dlt)) return {INFINITY, INFINITY};
    num += dlt * dlt;
    den += b[i] * b[i];
    mx = std::max(mx, std::abs(dlt));
    mref = std::max(mref, std::abs(b[i]));
  }
  const double tiny = 1e-30;
  return {std::sqrt(num) / std::max(std::sqrt(den), tiny), mx / std::max(mref, tiny)};
}

constexpr double kSsmFactor = 4;

// GPU (typed emulation) vs the double reference (same emulation), each output:
//   typed (y, d_x; k_scaled_saved against the float reference, whose K·scale is the GPU's
//   exactly): expect_typed with floor max(1e-5, 4·(float reference's own max error));
//   f32: rel_l2 ≤ max(1e-5, 4·e_f), max rel ≤ max(1e-4, 4·m_f) — the test_gpu_ssm rule.
template <class T>
void check_ssm(const Dims& d, const SsmInputs& in, ScanMode mode) {
  const Tensors truth = ref_ssm<double>(d, in, mode), base = ref_ssm<float>(d, in, mode);
  Tensors got;
  {
    const Tensors a = gpu_ssm<T>(d, in, mode), b = gpu_ssm<T>(d, in, mode);
    for (const auto& [n, v] : a) {
      const auto& w = b.at(n);
      ASSERT_EQ(v.size(), w.size()) << n;
      EXPECT_EQ(0, std::memcmp(v.data(), w.data(), v.size() * sizeof(double)))
          << n << " differs between two runs";
    }
    got = a;
  }
  auto as_vec = [](const std::vector<double>& v) { return Vec(v.begin(), v.end()); };
  for (const auto& [n, g] : got) {
    ASSERT_TRUE(truth.count(n) && base.count(n)) << "reference lacks " << n;
    const auto& t = truth.at(n);
    const auto& f = base.at(n);
    ASSERT_EQ(g.size(), t.size()) << n;
    if (n == "y" || n == "d_x") {
      const Err ef = err(f, t);
      Vec want = as_vec(t);
      m3::ref::store_typed(d, want);
      expect_typed<T>(n, as_vec(g), want, std::max(1e-5, kSsmFactor * ef.max_rel), 0.9);
    } else if (n == "k_scaled_saved") {
      expect_typed<T>(n, as_vec(g), as_vec(f), 0.0, 0.999);
    } else {
      const Err e = err(g, t), ef = err(f, t);
      EXPECT_LE(e.rel_l2, std::max(kRelL2, kSsmFactor * ef.rel_l2))
          << n << " rel_l2 (float reference " << ef.rel_l2 << ")";
      EXPECT_LE(e.max_rel, std::max(kRelMax, kSsmFactor * ef.max_rel))
          << n << " max|Δ|/max|ref| (float reference " << ef.max_rel << ")";
    }
  }
}

template <class T>
class TypedSsm : public ::testing::Test {};
TYPED_TEST_SUITE(TypedSsm, StorageTypes, StorageName);

TYPED_TEST(TypedSsm, SequentialMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const SsmCase& c : kSsmCases) {
    SCOPED_TRACE(c.name());
    const Dims d = Dims::of(ssm_config(c), c.B, c.T, Storage<T>::kPrecision);
    check_ssm<T>(d, ssm_inputs<T>(d, 17), ScanMode::Sequential);
  }
}

TYPED_TEST(TypedSsm, ChunkedMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const SsmCase& c : kSsmCases) {
    SCOPED_TRACE(c.name());
    const Dims d = Dims::of(ssm_config(c), c.B, c.T, Storage<T>::kPrecision);
    check_ssm<T>(d, ssm_inputs<T>(d, 23), ScanMode::Chunked);
  }
}

// The chunk walk (K2/K3 + K4/K6 and B1 + B2 in one kernel per (b, h), fuse_states) writes the
// bits of the two-kernel path: every output, the contributions it also stores included. Beyond
// kSsmCases, the shapes where the walk's cumsum kernel (chunk_cumsum_kernel: a warp per chunk and
// 32 heads) has a partial head tile (40 heads) and slots past a row tile (cs 96 > 64 with T 45:
// da_cumsum_saved zero on [45, 96)).
TYPED_TEST(TypedSsm, ChunkWalkGivesTheBitsOfTheTwoKernels) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  std::vector<SsmCase> cases(std::begin(kSsmCases), std::end(kSsmCases));
  cases.push_back({64, 64, 40, 1, 100, 64});
  cases.push_back({16, 32, 3, 2, 45, 96});
  for (const SsmCase& c : cases) {
    SCOPED_TRACE(c.name());
    const Dims d = Dims::of(ssm_config(c), c.B, c.T, Storage<T>::kPrecision);
    const SsmInputs in = ssm_inputs<T>(d, 29);
    expect_same_bits(gpu_ssm<T>(d, in, ScanMode::Chunked, false), "two kernels",
                     gpu_ssm<T>(d, in, ScanMode::Chunked, true), "walk");
  }
}

// In an sm_90a build (CMAKE_CUDA_ARCHITECTURES 90a) chunk_bwd_tc, K5 (chunk_scan_tc) and, in
// bf16 runs, chunk_state_tc and the chunk walks form their products with wgmma where the widths
// allow (headdim 33–64 with d_state 33–128; K5 also headdim 65–128; tc_wgmma.cuh); with
// set_chunked_wgmma_for_testing(false) the same launches take the mma.sync instantiations. Every
// output has the same bits both ways, with the two kernels and with the walk. Beyond kSsmCases
// (the official head shape with a ragged last chunk; headdim 128, where only K5 takes wgmma),
// the wgmma widths with padded columns: headdim 40 with d_state 100, and 64 with 64 over chunks
// of 7 and 64 rows.
TYPED_TEST(TypedSsm, WgmmaGivesTheBitsOfMmaSync) {
  M3_SKIP_WITHOUT_GPU();
  if (!m3::gpu::chunked_wgmma_build())
    GTEST_SKIP() << "this build has no wgmma path (CMAKE_CUDA_ARCHITECTURES is not 90a)";
  using T = TypeParam;
  struct Restore {
    ~Restore() { m3::gpu::set_chunked_wgmma_for_testing(true); }
  } restore;
  std::vector<SsmCase> cases(std::begin(kSsmCases), std::end(kSsmCases));
  cases.push_back({40, 100, 3, 2, 90, 64});
  cases.push_back({64, 64, 2, 1, 40, 7});
  cases.push_back({64, 64, 2, 2, 129, 64});
  long wg_launches = 0;  // the switch must choose: launches on wgmma with it on, none off
  for (const SsmCase& c : cases)
    for (const bool walk : {false, true}) {
      SCOPED_TRACE(c.name() + (walk ? ", walk" : ", two kernels"));
      const Dims d = Dims::of(ssm_config(c), c.B, c.T, Storage<T>::kPrecision);
      const SsmInputs in = ssm_inputs<T>(d, 31);
      m3::gpu::set_chunked_wgmma_for_testing(true);
      long n0 = m3::gpu::chunked_wgmma_launches();
      const Tensors wg = gpu_ssm<T>(d, in, ScanMode::Chunked, walk);
      wg_launches += m3::gpu::chunked_wgmma_launches() - n0;
      m3::gpu::set_chunked_wgmma_for_testing(false);
      n0 = m3::gpu::chunked_wgmma_launches();
      const Tensors ms = gpu_ssm<T>(d, in, ScanMode::Chunked, walk);
      EXPECT_EQ(m3::gpu::chunked_wgmma_launches(), n0) << "a wgmma launch with the switch off";
      expect_same_bits(wg, "wgmma", ms, "mma.sync");
    }
  EXPECT_GT(wg_launches, 0) << "no launch took a wgmma kernel: mma.sync was compared with itself";
}

}  // namespace
