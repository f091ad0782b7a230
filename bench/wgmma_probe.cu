// m3_wgmma_probe: a benchmark, not a test. It times chunk_bwd_tc's products (MODEL.md §6.4,
// gpu/scan/chunk_bwd_tc.cu steps 1–5) at the official shape, formed two ways in the same
// shared-memory footprint (two blocks of 256 threads per SM) over the official grid
// (B·nh·nc = 16384 blocks):
//   mma.sync  tc_frag.cuh's Frag products over padded planes (what chunk_bwd_tc runs today)
//   wgmma     tc_wgmma.cuh's warpgroup products over SW128 tiles, each warpgroup half of the
//             columns of every product
// The products per block (bf16 and f16 runs alike; split = hi/lo planes, three terms less one):
//   dq  = dO·S (split)          64×128, k 64        A = Q·Ksᵀ 64×64, k 128;  P = dO·Xᵀ 64×64, k 64
//   dq += MP (split)·Ks         64×128, k 64        dV = MAᵀ (split)·dO 64×64, k 64
//   dK  = MPᵀ (split)·Q         64×128, k 64        v2 = Ks·dSᵀ (split) 64×64, k 128
//   k2  = X·dS (split)          64×128, k 64
// = 6.55 M multiply-adds per block, 215 GFLOP per grid. The planes hold fixed finite values
// (written once per block; the "fill" row times that alone), the products' results are summed
// into one float per thread so that none is dropped, and each variant runs its product set
// `reps` times per block: the per-set time is the difference of two rep counts, so that the
// fill and the launch drop out. Prints one line per variant and dtype: µs per grid for the
// product set, TFLOP/s, and the register count of the kernel.
// Usage: m3_wgmma_probe [--reps N] (default 4; sets are timed at 1 and N+1 reps, median of 5).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "tc_frag.cuh"
#include "tc_wgmma.cuh"

namespace {

using m3::gpu::tcf::bf16;
namespace tcf = m3::gpu::tcf;
namespace wg = m3::gpu::wg;

constexpr int kL = 64, kHP = 64, kDP = 128, kThreads = 256;
constexpr int kLDD = kDP + 8, kLDH = kHP + 8, kLD64 = kL + 8;

// Padded planes (mma.sync): Q, Ks [64][136], dO, X [64][72]; R = S [64][136] ×2, then MA, MP
// [64][72] ×2 each, then dS as S (R's size: the larger of the two uses).
constexpr int kPadTyped = 2 * kL * kLDD + 2 * kL * kLDH;
constexpr int kPadR = std::max(2 * kHP * kLDD, 4 * kL * kLD64);
// SW128 tiles (wgmma): Q, Ks [64][128], dO, X [64][64]; R = S [64][128] ×2, or MA, MP ×2 each.
constexpr int kSwTyped = 2 * kL * kDP + 2 * kL * kHP;
constexpr int kSwR = std::max(2 * kHP * kDP, 4 * kL * kL);
constexpr std::size_t kPadBytes = 2 * std::size_t(kPadTyped + kPadR);
constexpr std::size_t kSwBytes = wg::kAlignSlack<true> + 2 * std::size_t(kSwTyped + kSwR);

template <class T>
__device__ void fill_planes(bf16* p, int n) {
  // Finite values of both signs; the same every block.
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const T t(0.25f * static_cast<float>((i * 37) % 29 - 14));
    p[i] = *reinterpret_cast<const bf16*>(&t);
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads, 2) mma_sync_kernel(int reps, float* out) {
  constexpr bool kH = tcf::kF16Plane<T>;
  extern __shared__ __align__(16) unsigned char raw[];
  bf16* Q = reinterpret_cast<bf16*>(raw);
  bf16* Ks = Q + kL * kLDD;
  bf16* dO = Ks + kL * kLDD;
  bf16* X = dO + kL * kLDH;
  bf16* R = X + kL * kLDH;
  fill_planes<T>(Q, kPadTyped + kPadR);
  __syncthreads();
  using TO = tcf::Opnd<kLDD, true, false, kH>;    // [64][ds], k = ds
  using TOt = tcf::Opnd<kLDD, false, false, kH>;  // [64][ds], k = rows
  using HO = tcf::Opnd<kLDH, true, false, kH>;
  using HOt = tcf::Opnd<kLDH, false, false, kH>;
  float sink = 0.0f;
  auto drop = [&](auto& f) {
    f.pairs([&](int, int, int, int, int, float& a, float& b) { sink += a + b; });
  };
  for (int rep = 0; rep < reps; ++rep) {
    // Each accumulator is summed into sink where chunk_bwd_tc's would be stored or folded,
    // so that the live registers follow the kernel's.
    tcf::Frag<kL, kDP, 8> dq;
    {
      tcf::Frag<kL, kL, 8> A, P;
      dq.zero();
      dq.template add<kHP>(HO{dO, 0}, tcf::Opnd<kLDD, false, true, kH>{R, kHP * kLDD});
      A.zero();
      P.zero();
      A.template add<kDP>(TO{Q, 0}, TO{Ks, 0});
      P.template add<kHP>(HO{dO, 0}, HO{X, 0});
      drop(A), drop(P);
    }
    __syncthreads();
    dq.template add<kL>(tcf::Opnd<kLD64, true, true, kH>{R + 2 * kL * kLD64, kL * kLD64},
                        TOt{Ks, 0});
    drop(dq);
    tcf::Frag<kL, kL, 8> dV;
    tcf::Frag<kL, kDP, 8> dK;
    dV.zero();
    dK.zero();
    dV.template add<kL>(tcf::Opnd<kLD64, false, true, kH>{R, kL * kLD64}, HOt{dO, 0});
    dK.template add<kL>(tcf::Opnd<kLD64, false, true, kH>{R + 2 * kL * kLD64, kL * kLD64},
                        TOt{Q, 0});
    __syncthreads();
    {
      tcf::Frag<kL, kL, 8> v2;
      v2.zero();
      v2.template add<kDP>(TO{Ks, 0}, tcf::Opnd<kLDD, true, true, kH>{R, kHP * kLDD});
      drop(v2), drop(dV);
    }
    {
      tcf::Frag<kL, kDP, 8> k2;
      k2.zero();
      k2.template add<kHP>(HO{X, 0}, tcf::Opnd<kLDD, false, true, kH>{R, kHP * kLDD});
      drop(k2), drop(dK);
    }
    __syncthreads();
  }
  out[blockIdx.x * kThreads + threadIdx.x] = sink;
}

template <class T>
__global__ void __launch_bounds__(kThreads, 2) wgmma_kernel(int reps, float* out) {
  constexpr bool kH = tcf::kF16Plane<T>;
  extern __shared__ unsigned char raw[];
  bf16* Q = reinterpret_cast<bf16*>(wg::tile_base<true>(raw));
  // Then Ks [64][128], dO, X [64][64], R: S hi, lo [64][128], or MA hi, lo, MP hi, lo [64][64];
  // dS as S.
  fill_planes<T>(Q, kSwTyped + kSwR);
  wg::fence_async_smem();
  __syncthreads();
  const int g = threadIdx.x >> 7;
  const int n64 = 64 * g, n32 = 32 * g;
  constexpr unsigned kS = 2 * kHP * kDP, kM = 2 * kL * kL;  // lo offsets (bytes): S / dS, MA / MP
  // The tiles' shared addresses, through an opaque move at each phase, and the k loops rolled:
  // otherwise nvcc computes every descriptor of the unrolled loops up front (197 registers
  // wanted; at 128 it spills and serialises the wgmma). Rolled: 90 registers, no spill.
  const std::uint32_t base = wg::smem_u32(Q);
  std::uint32_t q_, ks_, do_, x_, r_, ma_, mp_;
  auto addresses = [&] {
    std::uint32_t b = base;
    asm volatile("" : "+r"(b));
    q_ = b, ks_ = b + 2 * kL * kDP, do_ = ks_ + 2 * kL * kDP, x_ = do_ + 2 * kL * kHP;
    r_ = x_ + 2 * kL * kHP, ma_ = r_, mp_ = r_ + 2 * kM;
  };
  float sink = 0.0f;
  auto drop = [&](auto& f) {
    f.hold_all();
    f.pairs([&](int, int, float& a, float& b) { sink += a + b; });
  };
  for (int rep = 0; rep < reps; ++rep) {
    // As the mma.sync kernel: each accumulator summed into sink where it would die.
    wg::Wacc<64> dq;
    dq.zero();
    {
      // (1) dq = dO·S; A = Q·Ksᵀ; P = dO·Xᵀ
      wg::Wacc<32> A, P;
      A.zero(), P.zero();
      addresses();
      wg::fence();
#pragma unroll 1
      for (int k0 = 0; k0 < kHP; k0 += 16) {
        const auto a = wg::desc_k(do_, kL, 0, k0);
        wg::mma<64, kH, false, true>(dq.d, a, wg::desc_mn(r_, kHP, n64, k0));
        wg::mma<64, kH, false, true>(dq.d, a, wg::desc_mn(r_ + kS, kHP, n64, k0));
        wg::mma<32, kH, false, false>(P.d, a, wg::desc_k(x_, kL, n32, k0));
      }
#pragma unroll 1
      for (int k0 = 0; k0 < kDP; k0 += 16)
        wg::mma<32, kH, false, false>(A.d, wg::desc_k(q_, kL, 0, k0), wg::desc_k(ks_, kL, n32, k0));
      wg::commit();
      wg::wait<0>();
      drop(A), drop(P);
    }
    __syncthreads();
    // (2) dq += MP·Ks; dV = MAᵀ·dO; dK = MPᵀ·Q
    wg::Wacc<32> dV;
    wg::Wacc<64> dK;
    dV.zero(), dK.zero();
    addresses();
    wg::fence();
#pragma unroll 1
    for (int k0 = 0; k0 < kL; k0 += 16) {
      const auto kb = wg::desc_mn(ks_, kL, n64, k0);
      wg::mma<64, kH, false, true>(dq.d, wg::desc_k(mp_, kL, 0, k0), kb);
      wg::mma<64, kH, false, true>(dq.d, wg::desc_k(mp_ + kM, kL, 0, k0), kb);
    }
    wg::commit();
    wg::wait<0>();
    drop(dq);
    wg::fence();
#pragma unroll 1
    for (int k0 = 0; k0 < kL; k0 += 16) {
      const auto ob = wg::desc_mn(do_, kL, n32, k0);
      wg::mma<32, kH, true, true>(dV.d, wg::desc_mn(ma_, kL, 0, k0), ob);
      wg::mma<32, kH, true, true>(dV.d, wg::desc_mn(ma_ + kM, kL, 0, k0), ob);
      const auto qb = wg::desc_mn(q_, kL, n64, k0);
      wg::mma<64, kH, true, true>(dK.d, wg::desc_mn(mp_, kL, 0, k0), qb);
      wg::mma<64, kH, true, true>(dK.d, wg::desc_mn(mp_ + kM, kL, 0, k0), qb);
    }
    wg::commit();
    wg::wait<0>();
    __syncthreads();
    // (3) v2 = Ks·dSᵀ, then k2 = X·dS
    {
      wg::Wacc<32> v2;
      v2.zero();
      addresses();
      wg::fence();
#pragma unroll 1
      for (int k0 = 0; k0 < kDP; k0 += 16) {
        const auto a = wg::desc_k(ks_, kL, 0, k0);
        wg::mma<32, kH, false, false>(v2.d, a, wg::desc_k(r_, kHP, n32, k0));
        wg::mma<32, kH, false, false>(v2.d, a, wg::desc_k(r_ + kS, kHP, n32, k0));
      }
      wg::commit();
      wg::wait<0>();
      drop(v2), drop(dV);
    }
    {
      wg::Wacc<64> k2;
      k2.zero();
      addresses();
      wg::fence();
#pragma unroll 1
      for (int k0 = 0; k0 < kHP; k0 += 16) {
        const auto a = wg::desc_k(x_, kL, 0, k0);
        wg::mma<64, kH, false, true>(k2.d, a, wg::desc_mn(r_, kHP, n64, k0));
        wg::mma<64, kH, false, true>(k2.d, a, wg::desc_mn(r_ + kS, kHP, n64, k0));
      }
      wg::commit();
      wg::wait<0>();
      drop(k2), drop(dK);
    }
    __syncthreads();
  }
  out[blockIdx.x * kThreads + threadIdx.x] = sink;
}

#define CHECK(x)                                                                         \
  do {                                                                                   \
    const cudaError_t e_ = (x);                                                          \
    if (e_ != cudaSuccess) {                                                             \
      std::fprintf(stderr, "m3_wgmma_probe: %s: %s\n", #x, cudaGetErrorString(e_));      \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

template <class K>
float time_ms(K kernel, std::size_t smem, int blocks, int reps, float* out) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  std::vector<float> t;
  kernel<<<blocks, kThreads, smem>>>(reps, out);  // warm-up
  CHECK(cudaGetLastError());
  for (int i = 0; i < 5; ++i) {
    CHECK(cudaEventRecord(a));
    kernel<<<blocks, kThreads, smem>>>(reps, out);
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[2];
}

template <class K>
void report(const char* variant, const char* dtype, K kernel, std::size_t smem, int reps,
            float* out) {
  constexpr int kBlocks = 8 * 32 * 64;  // B · nh · nc at the official shape
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(smem)));
  cudaFuncAttributes fa{};
  CHECK(cudaFuncGetAttributes(&fa, kernel));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem));
  const float t1 = time_ms(kernel, smem, kBlocks, 1, out);
  const float tn = time_ms(kernel, smem, kBlocks, reps + 1, out);
  const double set_us = 1e3 * (tn - t1) / reps;
  const double flop = 2.0 * 6553600.0 * kBlocks;
  std::printf("%-9s %-5s  product set %8.1f us per grid  %6.1f TFLOP/s   (1 rep %.1f us, %d reps "
              "%.1f us; %d registers, %zu B shared, %d blocks/SM)\n",
              variant, dtype, set_us, flop / (set_us * 1e-6) / 1e12, 1e3 * t1, reps + 1, 1e3 * tn,
              fa.numRegs, smem, per_sm);
}

__global__ void have_wgmma_kernel(int* out) { *out = M3_HAVE_WGMMA; }

}  // namespace

int main(int argc, char** argv) {
  int reps = 4;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "m3_wgmma_probe: unknown argument '%s' (usage: [--reps N])\n",
                   argv[i]);
      return 2;
    }
  }
  if (reps < 1) {
    std::fprintf(stderr, "m3_wgmma_probe: --reps must be at least 1\n");
    return 2;
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::fprintf(stderr, "m3_wgmma_probe: no CUDA device\n");
    return 1;
  }
  int* flag = nullptr;
  int have = 0;
  CHECK(cudaMalloc(&flag, sizeof(int)));
  have_wgmma_kernel<<<1, 1>>>(flag);
  CHECK(cudaMemcpy(&have, flag, sizeof(int), cudaMemcpyDeviceToHost));
  if (!have) {
    std::fprintf(stderr, "m3_wgmma_probe: built without sm_90a: no wgmma\n");
    return 1;
  }
  float* out = nullptr;
  CHECK(cudaMalloc(&out, sizeof(float) * 8 * 32 * 64 * kThreads));
  report("mma.sync", "bf16", mma_sync_kernel<__nv_bfloat16>, kPadBytes, reps, out);
  report("wgmma", "bf16", wgmma_kernel<__nv_bfloat16>, kSwBytes, reps, out);
  report("mma.sync", "f16", mma_sync_kernel<__half>, kPadBytes, reps, out);
  report("wgmma", "f16", wgmma_kernel<__half>, kSwBytes, reps, out);
  cudaFree(out);
  cudaFree(flag);
  return 0;
}
