// Internal to gpu/ (.cu files only): Hopper's warpgroup products (wgmma.mma_async, sm_90a) over
// 16-bit operand tiles in shared memory, and the tile layout they read. chunk_bwd_tc, K5
// (chunk_scan_tc) and, in bf16 runs, chunk_state_tc and the chunk walks form their products with
// it in sm_90a builds (M3_WGMMA); tests/gpu/test_tc_wgmma.cu holds its products to
// tc_frag.cuh's mma.sync products bit for bit, and bench/wgmma_probe.cu times
// chunk_bwd_tc's product set both ways.
// Needs a build for sm_90a (CUDA_ARCHITECTURES 90a; without it every instruction here traps).
//
//   C[m][n] (+)= Σ_{k < 16} A(m, k0 + k) · B(k0 + k, n),   m < 64, n < N   (one instruction)
//
// issued by the 128 threads of a warpgroup (4 consecutive warps, the first a multiple of 4),
// bf16 or f16 operands, f32 accumulators in registers. Each operand is read from shared memory
// through a 64-bit descriptor; none passes through registers.
//
// Layout (SW128, the canonical 128-byte swizzle). A tile of R rows × C columns of 16-bit values
// (C a multiple of 64) is stored as C/64 panels of 64 columns; panel p holds its R rows of 128
// bytes one after the other, and within each group of 8 rows (1024 bytes, 1024-byte aligned)
// the 16-byte chunk j of row r sits at chunk j ^ (r % 8):
//   offset(r, c) = (c / 64)·R·64 + r·64 + 8·(((c % 64) / 8) ^ (r % 8)) + c % 8   (elements)
// Every 8 consecutive values of a row at a column ≡ 0 (mod 8) stay contiguous, so ldmatrix reads
// the same tiles (lane addresses through sw128_offset), and the 8 rows of one ldmatrix phase
// land in 8 distinct chunks: no bank conflicts.
// A tile serves either role:
//   K-major: rows = M (or N), columns = k.  Descriptor for k0 (16 | k0): start at
//            offset(row0, k0), stride between 8-row groups (SBO) 1024 bytes, LBO unused.
//   MN-major: rows = k, columns = M (or N). Descriptor for k0: start at offset(k0, col0), SBO
//            1024 bytes (8 rows of k), LBO = R·128 bytes (the next 64 columns' panel).
// The start address may sit inside an 8-row group's 1024 bytes (k0 % 64 ≠ 0 in K-major, a
// column offset in MN-major): the swizzle is applied to the address bits, as tc_frag's planes
// are addressed.
//
// Accumulators (Wacc<N>): thread t of the warpgroup (warp w = t / 32, g = lane / 4, c = lane % 4)
// holds, for each n-tile j < N/8, d[4j + e] = C[16w + g + 8·(e >> 1)][8j + 2c + (e & 1)]: per
// warp and n-tile the m16n8 fragment of mma.sync (tc_frag.cuh's Frag with WM = 4).
// Order: a chain of instructions over k0 ascending accumulates like tc_frag's k loop (one m16n8k16
// step per k0), and gives its bits: test_tc_wgmma.cu, bf16 and f16, on the H200.
// Alignment: the 1024-byte groups want a 1024-byte aligned tile base: tile_base moves the
// dynamic shared memory's base up by (1024 − (smem_u32(base) mod 1024)) mod 1024 (kAlignSlack
// bytes more asked for). Not by rounding the pointer through an integer: that loses its address
// space, and every shared access made through it becomes a generic one (LD.E / ST.E: see
// tile_base).
// Synchronisation (the caller's): the tiles written by ordinary stores, then
// fence_async_smem() and a barrier before the first instruction reads them; fence() before the
// first instruction of a chain (and after the accumulators were written by other code);
// commit() after the chain, wait<0>() before the accumulators are read (wait<n> leaves the n
// most recent groups in flight); no thread of the warpgroup may be inactive.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "tc_frag.cuh"

// Whether this compilation pass has the sm_90a instructions (wgmma).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define M3_HAVE_WGMMA 1
#else
#define M3_HAVE_WGMMA 0
#endif

// Whether this build forms products with wgmma where a kernel takes that path (M3_WGMMA: CMake
// sets it to 1 when the build's one CUDA architecture is 90a; 0 otherwise and by default). A
// kernel then keeps its planes in Sw128 and runs its products through frag_add, whose bits are
// tc_frag's Frag::add's, so both paths give the same outputs bit for bit.
#ifndef M3_WGMMA
#define M3_WGMMA 0
#endif
#if M3_WGMMA && defined(__CUDA_ARCH__) && !M3_HAVE_WGMMA
#error "M3_WGMMA=1 needs every CUDA architecture of the build to be 90a"
#endif

namespace m3::gpu::wg {

constexpr bool kBuild = M3_WGMMA != 0;

// The element offset of (r, c) in an R-row SW128 tile (the header's formula).
using tcf::sw128_offset;

// A kernel's planes: Sw128 on its wgmma path (kOn), tc_frag's Padded otherwise.
template <bool kOn>
using PlaneLay = std::conditional_t<kOn, tcf::Sw128, tcf::Padded>;
// The dynamic shared memory a kernel asks for beyond its tiles, so that tile_base can place
// them on 1024 bytes (the swizzle's 8-row groups): 1024 on the wgmma path, else 0.
template <bool kOn>
constexpr std::size_t kAlignSlack = kOn ? 1024 : 0;

// A shared-memory matrix descriptor of an SW128 tile: start address (bytes, shared window),
// leading and stride byte offsets.
__device__ __forceinline__ std::uint64_t sw128_desc(std::uint32_t start, std::uint32_t lbo,
                                                    std::uint32_t sbo) {
  std::uint64_t d = (start & 0x3FFFFu) >> 4;
  d |= static_cast<std::uint64_t>((lbo >> 4) & 0x3FFFu) << 16;
  d |= static_cast<std::uint64_t>((sbo >> 4) & 0x3FFFu) << 32;
  d |= static_cast<std::uint64_t>(1) << 62;  // 128-byte swizzle
  return d;
}

__device__ __forceinline__ std::uint32_t smem_u32(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// The descriptor of rows row0 … of an R-row K-major tile at k0 (the tile's shared address, or
// a pointer to it).
__device__ __forceinline__ std::uint64_t desc_k(std::uint32_t tile, int R, int row0, int k0) {
  return sw128_desc(tile + 2u * static_cast<std::uint32_t>(sw128_offset(row0, k0, R)), 16u,
                    1024u);
}
__device__ __forceinline__ std::uint64_t desc_k(const void* tile, int R, int row0, int k0) {
  return desc_k(smem_u32(tile), R, row0, k0);
}
// The descriptor of columns col0 … of an R-row (R = the k extent) MN-major tile at k0.
__device__ __forceinline__ std::uint64_t desc_mn(std::uint32_t tile, int R, int col0, int k0) {
  return sw128_desc(tile + 2u * static_cast<std::uint32_t>(sw128_offset(k0, col0, R)),
                    static_cast<std::uint32_t>(R) * 128u, 1024u);
}
__device__ __forceinline__ std::uint64_t desc_mn(const void* tile, int R, int col0, int k0) {
  return desc_mn(smem_u32(tile), R, col0, k0);
}

// The dynamic shared memory's base, moved up to the next 1024-byte boundary on the wgmma path
// (within kAlignSlack<kOn>). The offset is taken from the shared address and added to the
// pointer: rounding the pointer itself through an integer loses its address space, and every
// shared access made through it becomes a generic one (LD.E / ST.E, which make chunk_bwd_tc
// slower).
template <bool kOn>
__device__ __forceinline__ unsigned char* tile_base(unsigned char* base) {
  constexpr unsigned kAl = kAlignSlack<kOn> > 0 ? kAlignSlack<kOn> - 1 : 0;
  return base + ((kAl + 1 - (smem_u32(base) & kAl)) & kAl);
}

// Writes of the generic proxy (ordinary stores) made visible to the async proxy that wgmma
// reads shared memory through; a barrier must follow before another thread's wgmma.
__device__ __forceinline__ void fence_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#if M3_HAVE_WGMMA
__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
#else
// Without sm_90a there is no wgmma: a kernel that reaches one traps (callers check
// have_wgmma() on the host first).
__device__ __forceinline__ void fence() { __trap(); }
__device__ __forceinline__ void commit() { __trap(); }
template <int N>
__device__ __forceinline__ void wait() {
  __trap();
}
#endif

// Keeps the compiler from moving reads of an accumulator above wait() (the asm that wrote it
// is the wgmma, which returns before the value is there).
__device__ __forceinline__ void hold(float& v) { asm volatile("" : "+f"(v)::"memory"); }

#define M3_WG_D8(d, o)                                                                      \
  "+f"(d[o + 0]), "+f"(d[o + 1]), "+f"(d[o + 2]), "+f"(d[o + 3]), "+f"(d[o + 4]),         \
      "+f"(d[o + 5]), "+f"(d[o + 6]), "+f"(d[o + 7])
#define M3_WG_D16(d, o) M3_WG_D8(d, o), M3_WG_D8(d, o + 8)
#define M3_WG_R16 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define M3_WG_R32                                                                               \
  M3_WG_R16 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
// One wgmma of SHAPE on operands of type TY ("bf16" / "f16"): the accumulators REGS, then the
// descriptors, scale-d's flag and the two transposes as operands A, B, P, TA, TB.
#define M3_WG_TEXT(SHAPE, TY, REGS, A, B, P, TA, TB)                                          \
  "{\n.reg .pred p;\nsetp.ne.b32 p, %" #P ", 0;\nwgmma.mma_async.sync.aligned." SHAPE        \
  ".f32." TY "." TY " {" REGS "}, %" #A ", %" #B ", p, 1, 1, %" #TA ", %" #TB ";\n}\n"
#define M3_WG_ASM32(TY)                                                                        \
  asm volatile(M3_WG_TEXT("m64n32k16", TY, M3_WG_R16, 16, 17, 18, 19, 20)                     \
               : M3_WG_D16(d, 0)                                                              \
               : "l"(da), "l"(db), "r"(sd), "n"(kTA ? 1 : 0), "n"(kTB ? 1 : 0))
#define M3_WG_ASM64(TY)                                                                        \
  asm volatile(M3_WG_TEXT("m64n64k16", TY, M3_WG_R32, 32, 33, 34, 35, 36)                     \
               : M3_WG_D16(d, 0), M3_WG_D16(d, 16)                                            \
               : "l"(da), "l"(db), "r"(sd), "n"(kTA ? 1 : 0), "n"(kTB ? 1 : 0))

// One m64nNk16 instruction: d (+)= A·B; kF16: f16 operands, else bf16; kTA / kTB: A / B
// MN-major (transposed) instead of K-major; acc = false: d = A·B (the old d ignored).
template <int N, bool kF16, bool kTA, bool kTB>
__device__ __forceinline__ void mma(float (&d)[N / 2], std::uint64_t da, std::uint64_t db,
                                    bool acc = true) {
  static_assert(N == 32 || N == 64, "n32 and n64 only");
#if M3_HAVE_WGMMA
  const int sd = acc ? 1 : 0;
  if constexpr (N == 32) {
    if constexpr (kF16) {
      M3_WG_ASM32("f16");
    } else {
      M3_WG_ASM32("bf16");
    }
  } else {
    if constexpr (kF16) {
      M3_WG_ASM64("f16");
    } else {
      M3_WG_ASM64("bf16");
    }
  }
#else
  (void)d, (void)da, (void)db, (void)acc;
  __trap();
#endif
}

#undef M3_WG_ASM64
#undef M3_WG_ASM32
#undef M3_WG_TEXT
#undef M3_WG_R32
#undef M3_WG_R16
#undef M3_WG_D16
#undef M3_WG_D8

// A warpgroup's accumulators of a 64 × N product (the header's layout).
template <int N>
struct Wacc {
  float d[N / 2];
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int e = 0; e < N / 2; ++e) d[e] = 0.0f;
  }
  __device__ __forceinline__ void hold_all() {
#pragma unroll
    for (int e = 0; e < N / 2; ++e) hold(d[e]);
  }
  // f(m, n, v0, v1): the pair (m, n), (m, n + 1) this thread holds, as references.
  template <class F>
  __device__ __forceinline__ void pairs(F&& f) {
    const int t = threadIdx.x & 127, w = t >> 5, g = (t & 31) >> 2, c = t & 3;
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) f(16 * w + g + 8 * h, 8 * j + 2 * c, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
  }
};

// The byte offset of k-step k0's operand start from k0 = 0's, in an R-row SW128 tile: K-major
// (the k columns: the next 16 values of the row, or the next panel), MN-major (the next 16 rows).
// Linear in k0 (k0 ≡ 0 mod 16 leaves the XOR of sw128_offset alone), so a chain's descriptors
// are its first plus constants.
template <bool kMN, int R>
__host__ __device__ constexpr std::uint32_t kstep_bytes(int k0) {
  return kMN ? static_cast<std::uint32_t>(k0) * 128u
             : static_cast<std::uint32_t>((k0 >> 6) * R * 128 + (k0 & 63) * 2);
}
// A descriptor moved by `bytes` (a multiple of 16): only the start address field changes (the
// shared window is < 2¹⁸ bytes, so the field does not carry).
__device__ __forceinline__ std::uint64_t desc_plus(std::uint64_t d, std::uint32_t bytes) {
  return d + (bytes >> 4);
}

// C += A·B over k < K into tc_frag's Frag<64, N, 8>, on the tensor cores by wgmma: with M = 64
// and 8 warps, Frag's split is WM = 4, WN = 2, FM = 1, so warp w + 4g holds rows 16w … 16w + 15
// of columns [g·N/2, (g + 1)·N/2) in d[0][j][e] — the registers of Wacc<N/2> of warpgroup g —
// and warpgroup g runs the chain for its half of the columns. Per k-step the terms go in Frag's
// order (hi·hi, then hi·lo when B is split, then lo·hi when A is), so the bits are Frag::add's
// (tests/gpu/test_tc_wgmma.cu). A: the shared address a of its tile, RA the tile's stored rows
// (K-major: 64, MN-major (kTA): K), its lo plane LA bytes further (kSA); B likewise (K-major: N
// rows, MN-major: K). The chain's descriptors are its first two plus constants (kstep_bytes).
// Every thread of the block calls it, the tiles written, fenced (fence_async_smem) and visible
// (a barrier); it returns with the products in f. kWait = false leaves the chain in flight
// (committed): the caller waits (wait<n>, then hold_frag) before it reads f.
template <int K, bool kF16, bool kTA, bool kTB, bool kSA, bool kSB, int RA, int RB, int LA, int LB,
          bool kWait = true, int N>
__device__ __forceinline__ void frag_add(tcf::Frag<64, N, 8>& f, std::uint32_t a,
                                         std::uint32_t b) {
  constexpr int NH = N / 2;
  static_assert(tcf::Frag<64, N, 8>::FM == 1 && tcf::Frag<64, N, 8>::WM == 4, "Frag's split");
  static_assert(K % 16 == 0, "K is a multiple of 16");
  float(&d)[NH / 2] = *reinterpret_cast<float(*)[NH / 2]>(&f.d[0][0][0]);
  const int n0 = NH * static_cast<int>(threadIdx.x >> 7);
  const std::uint64_t da = kTA ? desc_mn(a, RA, 0, 0) : desc_k(a, RA, 0, 0);
  const std::uint64_t db = kTB ? desc_mn(b, RB, n0, 0) : desc_k(b, RB, n0, 0);
  fence();
  // Two k-steps per loop body (kS), the body's first at kb ≡ 0 (mod 32): there kstep_bytes(kb +
  // 16) = kstep_bytes(kb) + kstep_bytes(16) (a K-major step stays inside its 64-column panel),
  // so a body forms its operands from kb once and its second step's by a constant. With k0 per
  // step, each step would form its own from k0 at run time (ncu source, chunk_bwd_tc: ≈ 17
  // instructions per wgmma). Four steps per body spill 56–84 B in chunk_bwd_tc's official
  // instantiations, the whole chain unrolled 92–124 B (ptxas forms the steps' operands up
  // front); two spill nothing there.
  constexpr int kS = K % 32 == 0 ? 2 : 1;
  auto step = [&](std::uint64_t ak, std::uint64_t bk) {
    mma<NH, kF16, kTA, kTB>(d, ak, bk);
    if constexpr (kSB) mma<NH, kF16, kTA, kTB>(d, ak, desc_plus(bk, LB));
    if constexpr (kSA) mma<NH, kF16, kTA, kTB>(d, desc_plus(ak, LA), bk);
  };
#pragma unroll 1
  for (int kb = 0; kb < K; kb += 16 * kS) {
    const std::uint64_t a0 = desc_plus(da, kstep_bytes<kTA, RA>(kb));
    const std::uint64_t b0 = desc_plus(db, kstep_bytes<kTB, RB>(kb));
#pragma unroll
    for (int s = 0; s < kS; ++s)
      step(desc_plus(a0, kstep_bytes<kTA, RA>(16 * s)), desc_plus(b0, kstep_bytes<kTB, RB>(16 * s)));
  }
  commit();
  if constexpr (kWait) {
    wait<0>();
#pragma unroll
    for (int e = 0; e < NH / 2; ++e) hold(d[e]);
  }
}
// The accumulators of a frag_add<…, false> chain, after the caller's wait.
template <int N>
__device__ __forceinline__ void hold_frag(tcf::Frag<64, N, 8>& f) {
#pragma unroll
  for (int j = 0; j < tcf::Frag<64, N, 8>::FN; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) hold(f.d[0][j][e]);
}

}  // namespace m3::gpu::wg
