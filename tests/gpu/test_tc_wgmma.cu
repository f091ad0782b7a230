// gpu/tc/tc_wgmma.cuh's warpgroup products against tc_frag.cuh's mma.sync products, on the
// operand kinds and orientations of chunk_bwd_tc's products (official shape: L = hd = 64,
// ds = 128), bf16 and f16:
//   Q·Ksᵀ   typed × typed, both K-major, K = 128, N = 64
//   dO·S    typed × split, B MN-major,    K = 64,  N = 128
//   MAᵀ·dO  split × typed, both MN-major, K = 64,  N = 64   (n32 halves: a column offset)
//   Ks·dSᵀ  typed × split, both K-major,  K = 128, N = 64
//   MPᵀ·Q   split × typed, both MN-major, K = 64,  N = 128  (n64 halves: the second panel)
// Each product is formed both ways in one kernel from the same values: tc_frag's Frag<64, N, 8>
// over padded planes, and wg::frag_add — two warpgroups of m64n(N/2)k16 wgmma over SW128 tiles
// (one half of the columns each), the split terms in tc_frag's order (per k-step hh, hl, lh). Asserted: every
// element within 2⁻¹³·Σ|a·b| of the double product (bf16 runs: 2⁻¹⁶ per split term plus the f32
// accumulation; a wrong descriptor is off by O(1)), and whether the two agree bit for bit is
// asserted too: the design of a wgmma chunk_bwd_tc keeps the digests only if they do.
// Built for sm_90a (its own executable, m3_wgmma_tests); skips without a device, and says so
// when the device code was built without sm_90a.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "device.hpp"
#include "tc_frag.cuh"
#include "tc_wgmma.cuh"

namespace {

using m3::gpu::tcf::bf16;
namespace tcf = m3::gpu::tcf;
namespace wg = m3::gpu::wg;

__global__ void have_wgmma_kernel(int* out) { *out = M3_HAVE_WGMMA; }

// A tile stored as R rows × C columns: value (r, c) of the logical operand.
//   A(m, k) = a[m·K + k]: K-major rows m, columns k; MN-major rows k, columns m.
//   B(k, n) = b[k·N + n]: K-major rows n, columns k; MN-major rows k, columns n.
template <class T, bool kSplit>
__device__ void fill(const float* src, int R, int C, bool rows_are_k, int ld_src_k, bool is_a,
                     bf16* pad, bf16* swz) {
  const int pad_lo = R * (C + 8), swz_lo = R * C;
  for (int i = threadIdx.x; i < R * C / 2; i += blockDim.x) {
    const int r = i / (C / 2), c = 2 * (i % (C / 2));
    float v[2];
    for (int e = 0; e < 2; ++e) {
      // (r, c + e) → (k, mn)
      const int k = rows_are_k ? r : c + e, mn = rows_are_k ? c + e : r;
      v[e] = is_a ? src[mn * ld_src_k + k] : src[k * ld_src_k + mn];
    }
    const int ap = r * (C + 8) + c, as = wg::sw128_offset(r, c, R);
    if constexpr (kSplit) {
      tcf::put_split<T>(pad, pad_lo, ap, v[0], v[1]);
      tcf::put_split<T>(swz, swz_lo, as, v[0], v[1]);
    } else {
      T t2[2] = {T(v[0]), T(v[1])};
      std::uint32_t w;
      std::memcpy(&w, t2, 4);
      *reinterpret_cast<std::uint32_t*>(pad + ap) = w;
      *reinterpret_cast<std::uint32_t*>(swz + as) = w;
    }
  }
}

template <class T, int K, int N, bool kTA, bool kTB, bool kSA, bool kSB>
struct Case {
  static constexpr int RA = kTA ? K : 64, CA = kTA ? 64 : K;  // A's stored rows × columns
  static constexpr int RB = kTB ? K : N, CB = kTB ? N : K;
  static constexpr int kSwzA = RA * CA * (kSA ? 2 : 1), kSwzB = RB * CB * (kSB ? 2 : 1);
  static constexpr int kPadA = RA * (CA + 8) * (kSA ? 2 : 1), kPadB = RB * (CB + 8) * (kSB ? 2 : 1);
  static constexpr std::size_t kBytes =
      wg::kAlignSlack<true> + 2 * std::size_t(kSwzA + kSwzB + kPadA + kPadB);
};

template <class T, int K, int N, bool kTA, bool kTB, bool kSA, bool kSB>
__global__ void __launch_bounds__(256) products_kernel(const float* a, const float* b,
                                                       float* c_mma, float* c_wg) {
  using C = Case<T, K, N, kTA, kTB, kSA, kSB>;
  constexpr bool kF16 = tcf::kF16Plane<T>;
  extern __shared__ unsigned char raw[];
  bf16* base = reinterpret_cast<bf16*>(wg::tile_base<true>(raw));
  bf16* swa = base;                 // 1024-byte aligned: sizes are multiples of 8 rows × 128 B
  bf16* swb = swa + C::kSwzA;
  bf16* pa = swb + C::kSwzB;
  bf16* pb = pa + C::kPadA;
  fill<T, kSA>(a, C::RA, C::CA, kTA, K, true, pa, swa);
  fill<T, kSB>(b, C::RB, C::CB, kTB, N, false, pb, swb);
  wg::fence_async_smem();
  __syncthreads();

  // tc_frag: the 8 warps over the 64 × N tiles.
  {
    tcf::Frag<64, N, 8> f;
    f.zero();
    f.template add<K>(tcf::Opnd<C::CA + 8, !kTA, kSA, kF16>{pa, C::RA * (C::CA + 8)},
                      tcf::Opnd<C::CB + 8, !kTB, kSB, kF16>{pb, C::RB * (C::CB + 8)});
    f.pairs([&](int, int, int, int m, int n, float& v0, float& v1) {
      c_mma[m * N + n] = v0;
      c_mma[m * N + n + 1] = v1;
    });
  }
  // wgmma (wg::frag_add): warpgroup g takes columns [g·N/2, (g + 1)·N/2), into a Frag of its own.
  {
    tcf::Frag<64, N, 8> f;
    f.zero();
    wg::frag_add<K, kF16, kTA, kTB, kSA, kSB, C::RA, C::RB, 2 * C::RA * C::CA, 2 * C::RB * C::CB>(
        f, wg::smem_u32(swa), wg::smem_u32(swb));
    f.pairs([&](int, int, int, int m, int n, float& v0, float& v1) {
      c_wg[m * N + n] = v0;
      c_wg[m * N + n + 1] = v1;
    });
  }
}

bool device_has_wgmma(std::string& why) {
  const auto info = m3::gpu::query_device();
  if (!info.present) {
    why = m3::gpu::describe(info);
    return false;
  }
  int* d = nullptr;
  int h = 0;
  if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) {
    why = "cudaMalloc failed";
    return false;
  }
  have_wgmma_kernel<<<1, 1>>>(d);
  const cudaError_t e = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(d);
  if (e != cudaSuccess) {
    why = std::string("no kernel image for this device: ") + cudaGetErrorString(e);
    return false;
  }
  if (!h) why = "the device code was built without sm_90a (CUDA_ARCHITECTURES 90a)";
  return h != 0;
}

// The typed operand's values in T (exact), the split one's in f32.
template <class T>
float as_typed(float v) {
  return float(T(v));
}

template <class T, int K, int N, bool kTA, bool kTB, bool kSA, bool kSB>
void run_case(const char* name, unsigned seed) {
  using C = Case<T, K, N, kTA, kTB, kSA, kSB>;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> a(64 * K), b(K * N);
  for (auto& v : a) v = kSA ? nd(rng) : as_typed<T>(nd(rng));
  for (auto& v : b) v = kSB ? nd(rng) : as_typed<T>(nd(rng));
  float *da, *db, *dm, *dw;
  ASSERT_EQ(cudaMalloc(&da, a.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&db, b.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dm, 64 * N * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dw, 64 * N * 4), cudaSuccess);
  cudaMemcpy(da, a.data(), a.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(db, b.data(), b.size() * 4, cudaMemcpyHostToDevice);
  cudaMemset(dm, 0xff, 64 * N * 4);  // NaN: a missed element fails
  cudaMemset(dw, 0xff, 64 * N * 4);
  auto k = products_kernel<T, K, N, kTA, kTB, kSA, kSB>;
  ASSERT_EQ(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(C::kBytes)),
            cudaSuccess);
  k<<<1, 256, C::kBytes>>>(da, db, dm, dw);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
  std::vector<float> cm(64 * N), cw(64 * N);
  cudaMemcpy(cm.data(), dm, cm.size() * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(cw.data(), dw, cw.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(da), cudaFree(db), cudaFree(dm), cudaFree(dw);
  int worse = 0, differ = 0;
  double worst = 0.0;
  for (int m = 0; m < 64; ++m)
    for (int n = 0; n < N; ++n) {
      double ref = 0.0, mag = 0.0;
      for (int kk = 0; kk < K; ++kk) {
        ref += double(a[m * K + kk]) * double(b[kk * N + n]);
        mag += std::fabs(double(a[m * K + kk]) * double(b[kk * N + n]));
      }
      const float w = cw[m * N + n], v = cm[m * N + n];
      const double err = std::fabs(double(w) - ref) / mag;
      if (!(err <= std::ldexp(1.0, -13))) ++worse;
      if (err > worst || std::isnan(err)) worst = err;
      if (std::memcmp(&w, &v, 4) != 0) ++differ;
    }
  EXPECT_EQ(worse, 0) << name << ": wgmma elements off the double product (worst relative "
                      << worst << " of Σ|a·b|)";
  EXPECT_EQ(differ, 0) << name << ": " << differ << " of " << 64 * N
                       << " elements differ in their bits from tc_frag's mma.sync product";
}

template <class T>
void run_all() {
  run_case<T, 128, 64, false, false, false, false>("Q·Ksᵀ", 1);
  run_case<T, 64, 128, false, true, false, true>("dO·S", 2);
  run_case<T, 64, 64, true, true, true, false>("MAᵀ·dO", 3);
  run_case<T, 128, 64, false, false, false, true>("Ks·dSᵀ", 4);
  run_case<T, 64, 128, true, true, true, false>("MPᵀ·Q", 5);
}

TEST(TcWgmma, Bf16ProductsMatchTheMmaSyncProducts) {
  std::string why;
  if (!device_has_wgmma(why)) GTEST_SKIP() << why;
  run_all<__nv_bfloat16>();
}

TEST(TcWgmma, F16ProductsMatchTheMmaSyncProducts) {
  std::string why;
  if (!device_has_wgmma(why)) GTEST_SKIP() << why;
  run_all<__half>();
}

// The layout formula itself (host): a bijection of each tile onto its R·C slots, 8 values of a
// row at a column ≡ 0 (mod 8) contiguous, and the 8 rows of a chunk column in 8 distinct chunks
// of their 1024-byte group.
TEST(TcWgmma, Sw128OffsetIsABijectionWithContiguousChunks) {
  for (int R : {16, 64, 128})
    for (int Cc : {64, 128}) {
      std::vector<int> seen(R * Cc, 0);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < Cc; ++c) {
          const int o = wg::sw128_offset(r, c, R);
          ASSERT_GE(o, 0);
          ASSERT_LT(o, R * Cc);
          ++seen[o];
          if (c % 8) EXPECT_EQ(o, wg::sw128_offset(r, c - c % 8, R) + c % 8);
        }
      for (int s : seen) ASSERT_EQ(s, 1) << "R " << R << " C " << Cc;
      for (int r0 = 0; r0 < R; r0 += 8)
        for (int c = 0; c < Cc; c += 8) {
          unsigned chunks = 0;
          for (int r = r0; r < r0 + 8; ++r) chunks |= 1u << ((wg::sw128_offset(r, c, R) / 8) % 8);
          EXPECT_EQ(chunks, 0xFFu) << "rows " << r0 << "+ column " << c;
        }
    }
}

}  // namespace
