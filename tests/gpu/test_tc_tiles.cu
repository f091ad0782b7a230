// gpu/tc/tc_tiles.cuh's two ways of bringing an f32 state tile S [hd][ds] into the hi/lo planes
// [R][C] of a product (zeros beyond hd, ds), held to the same bits:
//   load_state<R, C, T, kDot = true, Lay>(planes, S, hd, ds, vec = true, red, O)
//     → the planes, the tile's scale (f16 runs: 2^e from max|S|; bf16: 1) and each thread's
//       part of ⟨S, O⟩;
//   StateInFlight<R, C, Lay>: issue(S), issue(O), then dot(O) and split_scaled<T>(planes, red)
//     — what chunk_bwd_tc and K5 run in f16 runs, and chunk_bwd_tc in bf16 runs, the values
//       requested before the typed tiles' copies.
// One block of 256 threads forms both from the same S and O; asserted bit for bit: both plane
// sets (every element, the padding included), the scale (up and down) and every thread's dot
// (both dtypes: load_state's bf16 path adds the dead slots' +0 terms, which StateInFlight::dot
// skips; the same bits, as a sum begun at +0 is never −0), and that dot against the host's
// dot4 rounding (y's product, then x's, z's, w's fused in), which nvcc's own contraction of the
// expression does not keep in every kernel (left to it, the default preset's digests move).
// load_state's f16 float4 path ends in the same split_scaled, so in f16 what differs is how
// the values arrive (its slots loaded one by one with O's read beside them, against issue) and
// the dot; bf16 runs compare load_state's batched split and dot with StateInFlight's. Cases:
// the official tile (64 × 128), a square one (32 × 32, the default preset's padded widths),
// partial tiles (hd < R, ds < C, ds % 4 = 0), values spread over 2⁻⁶⁰ … 2⁶⁰ with both signs,
// and an all-zero tile (scale 1); both plane layouts (padded rows, and wgmma's 128-byte
// swizzle where C is a multiple of 64).
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gpu_test_util.hpp"
#include "tc_tiles.cuh"

namespace {

namespace tcf = m3::gpu::tcf;
using tcf::bf16;

constexpr int kNT = tcf::kTileThreads;

// out: plane bits of load_state [2·P], then of StateInFlight [2·P] (P = Lay's plane size), as
// 16-bit words; f: scale up/down of each [4], then the dots of each [2·kNT].
template <class T, int R, int C, class Lay>
__global__ void __launch_bounds__(kNT) state_paths_kernel(const float* S, const float* O, int hd,
                                                          int ds, unsigned short* out,
                                                          float* f) {
  constexpr int P = Lay::template size<R, C>();
  extern __shared__ __align__(16) unsigned char tiles_smem[];
  bf16* const planes = reinterpret_cast<bf16*>(tiles_smem);  // [2 ways][hi, lo][P]
  __shared__ float red[kNT / 32];
  const int tid = static_cast<int>(threadIdx.x);
  for (int i = tid; i < 4 * P; i += kNT) planes[i] = __ushort_as_bfloat16(0x7fff);
  __syncthreads();
  const tcf::StateLoad a = tcf::load_state<R, C, T, true, Lay>(planes, S, hd, ds, true, red, O);
  __syncthreads();  // red is reused
  tcf::StateInFlight<R, C, Lay> s, o;
  s.issue(S, hd, ds);
  o.issue(O, hd, ds);
  const float dot = s.dot(o, hd, ds);
  const tcf::TileScale sc = s.template split_scaled<T>(planes + 2 * P, red);
  __syncthreads();
  for (int i = tid; i < 4 * P; i += kNT) out[i] = __bfloat16_as_ushort(planes[i]);
  if (tid == 0) {
    f[0] = a.sc.up;
    f[1] = a.sc.down;
    f[2] = sc.up;
    f[3] = sc.down;
  }
  f[4 + tid] = a.dot;
  f[4 + kNT + tid] = dot;
}

std::vector<float> spread_values(std::mt19937& rng, int n, bool zero) {
  std::vector<float> v(n, 0.0f);
  if (zero) return v;
  std::uniform_int_distribution<int> e(-60, 60);
  std::uniform_real_distribution<float> m(1.0f, 2.0f);
  std::bernoulli_distribution neg(0.5);
  for (auto& x : v) x = (neg(rng) ? -1.0f : 1.0f) * std::ldexp(m(rng), e(rng));
  return v;
}

// Thread t's part of ⟨S, O⟩ as tc_tiles.cuh's dot4 rounds it: its slots e = t + k·kNT (row
// e / (C/4), four values from column 4·(e % (C/4))), the live ones added in k's order, each
// term y·o_y rounded, then x's, z's and w's products fused in. The volatile keeps the host
// compiler from fusing y's product itself.
template <int R, int C>
float host_dot(const std::vector<float>& s, const std::vector<float>& o, int hd, int ds, int t) {
  constexpr int kW = C / 4;
  float d = 0.0f;
  for (int e = t; e < R * kW; e += kNT) {
    const int r = e / kW, c = 4 * (e % kW);
    if (r >= hd || c >= ds) continue;
    const float* a = &s[r * ds + c];
    const float* b = &o[r * ds + c];
    volatile float y = a[1] * b[1];
    d += std::fma(a[3], b[3], std::fma(a[2], b[2], std::fma(a[0], b[0], static_cast<float>(y))));
  }
  return d;
}

template <class T, int R, int C, class Lay>
void run_case(const std::string& name, int hd, int ds, unsigned seed, bool zero = false) {
  constexpr int P = Lay::template size<R, C>();
  std::mt19937 rng(seed);
  const std::vector<float> s = spread_values(rng, hd * ds, zero), o = spread_values(rng, hd * ds, zero);
  float *dS, *dO, *df;
  unsigned short* dout;
  ASSERT_EQ(cudaMalloc(&dS, s.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dO, o.size() * 4), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dout, 4 * P * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&df, (4 + 2 * kNT) * 4), cudaSuccess);
  cudaMemcpy(dS, s.data(), s.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(dO, o.data(), o.size() * 4, cudaMemcpyHostToDevice);
  cudaMemset(df, 0xff, (4 + 2 * kNT) * 4);  // NaN: a value never written fails
  auto k = state_paths_kernel<T, R, C, Lay>;
  const int bytes = 4 * P * 2;
  ASSERT_EQ(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
            cudaSuccess);
  k<<<1, kNT, bytes>>>(dS, dO, hd, ds, dout, df);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
  std::vector<unsigned short> planes(4 * P);
  std::vector<float> f(4 + 2 * kNT);
  cudaMemcpy(planes.data(), dout, planes.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(f.data(), df, f.size() * 4, cudaMemcpyDeviceToHost);
  cudaFree(dS), cudaFree(dO), cudaFree(dout), cudaFree(df);

  int differ = 0, live = 0;
  for (int i = 0; i < 2 * P; ++i) {
    differ += planes[i] != planes[2 * P + i];
    live += planes[i] != 0 && planes[i] != 0x7fff;
  }
  EXPECT_EQ(differ, 0) << name << ": " << differ << " of " << 2 * P
                       << " plane elements differ in their bits";
  if (!zero) EXPECT_GT(live, hd * ds / 2) << name << ": the planes were not written";
  EXPECT_EQ(std::memcmp(&f[0], &f[2], 8), 0)
      << name << ": scales " << f[0] << "/" << f[1] << " against " << f[2] << "/" << f[3];
  if constexpr (tcf::kF16Plane<T>) {
    if (!zero) EXPECT_NE(f[0], 1.0f) << name << ": values up to 2⁶⁰ need a scale";
  } else {
    EXPECT_EQ(f[0], 1.0f) << name << ": bf16 planes take no scale";
  }
  int dots = 0, nonzero = 0, off_form = 0;
  for (int t = 0; t < kNT; ++t) {
    dots += std::memcmp(&f[4 + t], &f[4 + kNT + t], 4) != 0;
    nonzero += f[4 + t] != 0.0f;
    const float want = host_dot<R, C>(s, o, hd, ds, t);
    off_form += std::memcmp(&f[4 + t], &want, 4) != 0;
  }
  EXPECT_EQ(dots, 0) << name << ": " << dots << " threads' parts of ⟨S, O⟩ differ";
  EXPECT_EQ(off_form, 0) << name << ": " << off_form
                         << " threads' parts of ⟨S, O⟩ are not dot4's rounding";
  if (!zero) EXPECT_GT(nonzero, 0) << name << ": no thread's part of ⟨S, O⟩ was formed";
}

template <class T>
void run_all() {
  run_case<T, 64, 128, tcf::Sw128>("64×128 swizzled, full", 64, 128, 1);
  run_case<T, 64, 128, tcf::Sw128>("64×128 swizzled, partial", 50, 124, 2);
  run_case<T, 64, 128, tcf::Padded>("64×128 padded, full", 64, 128, 3);
  run_case<T, 64, 64, tcf::Sw128>("64×64 swizzled, partial", 64, 60, 4);
  run_case<T, 32, 32, tcf::Padded>("32×32 padded, the default's 16×16", 16, 16, 5);
  run_case<T, 32, 32, tcf::Padded>("32×32 padded, zeros", 32, 32, 6, true);
}

TEST(TcTiles, StateInFlightGivesTheBitsOfLoadStateF16) {
  M3_SKIP_WITHOUT_GPU();
  run_all<__half>();
}

TEST(TcTiles, StateInFlightGivesTheBitsOfLoadStateBf16) {
  M3_SKIP_WITHOUT_GPU();
  run_all<__nv_bfloat16>();
}

}  // namespace
