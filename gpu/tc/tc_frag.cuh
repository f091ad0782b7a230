// Internal to gpu/ (.cu files only): tensor-core products over 16-bit operand planes held in
// shared memory, with the accumulators kept in registers in the mma fragment layout. Used by
// the typed (bf16/f16) chunked-scan kernels that are built for speed (gpu/scan/chunk_bwd_tc.cu).
//
//   C[m][n] += Σ_{k < K} A(m, k) · B(k, n)        (K a multiple of 16, compile-time)
//
// Planes. A tile of storage values (T) is one plane of the values themselves: exact in their
// own type. A tile of f32 values v is stored once, when it is written to shared memory, as two
// planes of the run's 16-bit type:
//   bf16 runs: hi = bf16(v), lo = bf16(v − hi) (tc::split2): 16 significant bits,
//              |v − hi − lo| ≤ 2⁻¹⁶·|v|;
//   f16 runs:  hi = f16(v·2^e), lo = f16(v·2^e − hi) (tc::split2_f16) with one power of two per
//              tile (tc::tile_exponent: max|v|·2^e ∈ [2¹⁴, 2¹⁵)): 22 significant bits,
//              |v − (hi + lo)·2^−e| ≤ max(2⁻²²·|v|, 2⁻³⁹·max|tile|); the product is brought
//              back by 2^−e on the accumulator (exact: a power of two), TileScale.
// Both operands of a product are then of the run's type, so one mma kind serves every term:
//   a·b ≈ ah·bh + ah·bl + al·bh       (terms of an operand without a lo plane skipped)
// A typed operand has no lo plane, so a typed × f32 product is two mma per step (bf16 mma for
// bf16 runs, f16 mma for f16 runs) and a typed × typed product one, exact up to the f32
// accumulation. The terms go into one f32 accumulator per output element in a fixed order (k
// ascending in steps of 16; per step hh, then hl, then lh): the relative error of a dot product
// is ≈ 2⁻¹⁶ (bf16 runs) or 2⁻²² (f16 runs) of Σ|a·b| plus the f32 accumulation, as in
// tc_mma.cuh, and results are bit-identical run to run.
//
// Storage of an operand (Opnd<LD, KIn, Split, F16>): a row-major [rows][LD] plane of 16-bit
// values — bf16, or f16 with F16 — with, if Split, a lo plane lo_off elements after hi. KIn = the
// reduction index k is the column (contiguous) index: A stored [m][k] or B stored [n][k];
// otherwise A is stored [k][m] or B [k][n] and the fragments are loaded transposed (ldmatrix
// .trans). LD = columns + 8 (plane_ld): rows 16 bytes apart modulo 128, so the eight rows an
// ldmatrix phase reads hit distinct banks; addresses 16-byte aligned.
//
// Work split (Frag<M, N, NW>): the M/16 × N/8 m16n8 output tiles go to the NW warps as a
// WM × WN grid (WM = min(M/16, 4)); each warp owns FM × FN tiles (FN even: B fragments are loaded
// two n-tiles at a time). Element (m, n) of tile (i, j), register e: m = (wm + WM·i)·16 + g +
// 8·(e >> 1), n = (wn·FN + j)·8 + 2c + (e & 1), with g = lane / 4, c = lane % 4.
// Caller: all NW·32 threads call add() together, with the planes written and visible (after a
// barrier); rows/columns beyond the live data hold zeros (finite values at least in one operand
// and zeros in the other for k beyond the data).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "tc_mma.cuh"

namespace m3::gpu::tcf {

using bf16 = __nv_bfloat16;

constexpr int plane_ld(int cols) { return cols + 8; }

// Where a plane of R rows × C columns keeps element (r, c), and how many elements it takes (a
// lo plane follows its hi plane at that distance). Padded: row-major with plane_ld's padding,
// what Frag's ldmatrix addressing reads. Sw128: tc_wgmma.cuh's 128-byte swizzle (C a multiple
// of 64; every 8 values of a row at a column ≡ 0 (mod 8) contiguous), what wgmma reads. Every
// plane writer below stores at most 8 values from a column ≡ 0 (mod their count), so it writes
// either layout with the same stores.
__host__ __device__ __forceinline__ constexpr int sw128_offset(int r, int c, int R) {
  return (c >> 6) * R * 64 + r * 64 + 8 * (((c & 63) >> 3) ^ (r & 7)) + (c & 7);
}
struct Padded {
  template <int R, int C>
  static __device__ __forceinline__ int at(int r, int c) {
    return r * plane_ld(C) + c;
  }
  template <int R, int C>
  static constexpr int size() {
    return R * plane_ld(C);
  }
};
struct Sw128 {
  template <int R, int C>
  static __device__ __forceinline__ int at(int r, int c) {
    static_assert(C % 64 == 0 && R % 8 == 0, "SW128 tiles: 64-column panels of 8-row groups");
    return sw128_offset(r, c, R);
  }
  template <int R, int C>
  static constexpr int size() {
    return R * C;
  }
};

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8×8 b16 matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldsm4(std::uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm4t(std::uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

template <int LD, bool KIn, bool Split, bool F16 = false>
struct Opnd {
  const bf16* p;  // hi plane (F16: of f16 values)
  int lo_off;     // elements from hi to lo (Split only)
  static constexpr int kLD = LD;
  static constexpr bool kKIn = KIn, kSplit = Split, kF16 = F16;
};

// An f16 run's planes are f16, a bf16 run's bf16 (the header).
template <class T>
constexpr bool kF16Plane = std::is_same_v<T, __half>;
// A typed tile: one plane of its storage values.
template <class T, int LD, bool KIn>
using TypedOpnd = Opnd<LD, KIn, false, kF16Plane<T>>;
// An f32 tile as hi/lo planes of the run's type.
template <class T, int LD, bool KIn>
using SplitOpnd = Opnd<LD, KIn, true, kF16Plane<T>>;

// A word of two storage values (T) as floats: exact.
template <class T>
__device__ __forceinline__ float2 typed_pair(std::uint32_t w) {
  if constexpr (kF16Plane<T>) {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  } else {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w));
  }
}

// The power of two an f32 tile's planes carry (f16 runs; bf16 runs: 1, 1): up = 2^e multiplies
// the values before the split, down = 2^−e brings a product with them back.
struct TileScale {
  float up = 1.0f, down = 1.0f;
};

// A pair of a product's elements back from its planes' scale: ·down (exact) in f16 runs;
// nothing in bf16 runs, whose scale is 1.
template <class T>
__device__ __forceinline__ void unscale(TileScale sc, float& v0, float& v1) {
  if constexpr (kF16Plane<T>) {
    v0 *= sc.down;
    v1 *= sc.down;
  }
}

// Maximum over the 32 lanes (fmaxf: a NaN lane does not hide the others' values).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// A tile's scale from the block's per-warp maxima of |v|, in two halves around a barrier the
// caller places: post_max (every thread, its own max|v|) writes red[warp]; after the barrier,
// scale_of(red) (every thread) gives every thread the same TileScale. A max is independent of
// the order it is taken in, so the scale is deterministic.
template <class T>
__device__ __forceinline__ void post_max(float m, float* red) {
  if constexpr (kF16Plane<T>) {
    m = warp_max(m);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  }
}
template <class T, int NW>
__device__ __forceinline__ TileScale scale_of(const float* red) {
  TileScale s;
  if constexpr (kF16Plane<T>) {
    float m = red[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) m = fmaxf(m, red[w]);
    const int e = tc::tile_exponent(m);
    s.up = tc::pow2f(e);
    s.down = tc::pow2f(-e);
  }
  return s;
}

// The A fragment (m16 × k16 at m0, k0) of m16n8k16: regs a0..a3 = (g, 2c), (g+8, 2c),
// (g, 2c+8), (g+8, 2c+8) — matrices (m0–7, k0–7), (m8–15, k0–7), (m0–7, k8–15), (m8–15, k8–15).
template <int LD, bool KIn>
__device__ __forceinline__ void load_a(std::uint32_t (&a)[4], const bf16* p, int m0, int k0) {
  const int l = threadIdx.x & 31;
  if constexpr (KIn) {
    ldsm4(a, p + (m0 + (l & 7) + 8 * ((l >> 3) & 1)) * LD + k0 + 8 * (l >> 4));
  } else {
    ldsm4t(a, p + (k0 + (l & 7) + 8 * (l >> 4)) * LD + m0 + 8 * ((l >> 3) & 1));
  }
}

// The B fragments of the two n-tiles n0, n0 + 8 at k0: b0 = {r0, r1}, b1 = {r2, r3}; matrices
// (n0–7, k0–7), (n0–7, k8–15), (n8–15, k0–7), (n8–15, k8–15).
template <int LD, bool KIn>
__device__ __forceinline__ void load_b2(std::uint32_t (&b)[4], const bf16* p, int n0, int k0) {
  const int l = threadIdx.x & 31;
  if constexpr (KIn) {
    ldsm4(b, p + (n0 + (l & 7) + 8 * (l >> 4)) * LD + k0 + 8 * ((l >> 3) & 1));
  } else {
    ldsm4t(b, p + (k0 + (l & 7) + 8 * ((l >> 3) & 1)) * LD + n0 + 8 * (l >> 4));
  }
}

// One m16n8k16 step of the run's mma kind (F16: f16 operands, else bf16).
template <bool F16>
__device__ __forceinline__ void mma(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                                    std::uint32_t b1) {
  const std::uint32_t b[2] = {b0, b1};
  if constexpr (F16) {
    tc::mma_f16(d, a, b);
  } else {
    tc::mma_bf16(d, a, b);
  }
}

template <int M, int N, int NW>
struct Frag {
  using Split = tc::WarpSplit<M, N, NW>;
  static constexpr int WM = Split::WM, FM = Split::FM, FN = Split::FN;
  static_assert(FN % 2 == 0, "B fragments come two n-tiles at a time");
  float d[FM][FN][4];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) d[i][j][e] = 0.0f;
  }

  static __device__ __forceinline__ int wm() { return (threadIdx.x >> 5) % WM; }
  static __device__ __forceinline__ int wn() { return (threadIdx.x >> 5) / WM; }

  // C += A·B over k < K. kUnroll: k-steps per loop body; 0 (auto) is two where the
  // accumulators are few (≤ 16 per thread), so that ptxas can issue one step's fragment loads
  // under the other's mma, else one (larger products, unrolled, spill at hd 128). With two,
  // the bf16 forward walk has no spill and is faster, and so is K5 (ncu); the f16 walks are
  // 2–5 % slower, so they ask for one (chunk_state_tc.cu).
  template <int K, int kUnroll = 0, class OA, class OB>
  __device__ __forceinline__ void add(OA A, OB B) {
    static_assert(K % 16 == 0, "K is a multiple of 16");
    static_assert(OA::kF16 == OB::kF16, "both operands are planes of the run's type");
    constexpr bool kF16 = OA::kF16;
    const int m_w = wm(), n_w = wn();
    constexpr int kSteps = kUnroll > 0 ? kUnroll : FM * FN * 4 <= 16 ? 2 : 1;
#pragma unroll kSteps
    for (int k0 = 0; k0 < K; k0 += 16) {
      std::uint32_t ah[FM][4], al[FM][4];
#pragma unroll
      for (int i = 0; i < FM; ++i) {
        const int m0 = (m_w + WM * i) * 16;
        load_a<OA::kLD, OA::kKIn>(ah[i], A.p, m0, k0);
        if constexpr (OA::kSplit) load_a<OA::kLD, OA::kKIn>(al[i], A.p + A.lo_off, m0, k0);
      }
#pragma unroll
      for (int j = 0; j < FN; j += 2) {
        const int n0 = (n_w * FN + j) * 8;
        std::uint32_t bh[4], bl[4];
        load_b2<OB::kLD, OB::kKIn>(bh, B.p, n0, k0);
        if constexpr (OB::kSplit) load_b2<OB::kLD, OB::kKIn>(bl, B.p + B.lo_off, n0, k0);
#pragma unroll
        for (int i = 0; i < FM; ++i) {
          mma<kF16>(d[i][j], ah[i], bh[0], bh[1]);
          mma<kF16>(d[i][j + 1], ah[i], bh[2], bh[3]);
          if constexpr (OB::kSplit) {
            mma<kF16>(d[i][j], ah[i], bl[0], bl[1]);
            mma<kF16>(d[i][j + 1], ah[i], bl[2], bl[3]);
          }
          if constexpr (OA::kSplit) {
            mma<kF16>(d[i][j], al[i], bh[0], bh[1]);
            mma<kF16>(d[i][j + 1], al[i], bh[2], bh[3]);
          }
        }
      }
    }
  }

  // C ·= s (every element; a power of two is exact).
  __device__ __forceinline__ void scale(float s) {
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) d[i][j][e] *= s;
  }

  // f(i, h, j, m, n, v0, v1): the pair of elements (m, n), (m, n + 1) this thread holds in
  // tile (i, j), half h (rows g / g + 8), as references.
  template <class F>
  __device__ __forceinline__ void pairs(F&& f) {
    const int l = threadIdx.x & 31, g = l >> 2, c = l & 3;
    const int m_w = wm(), n_w = wn();
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          f(i, h, j, (m_w + WM * i) * 16 + g + 8 * h, (n_w * FN + j) * 8 + 2 * c,
            d[i][j][2 * h], d[i][j][2 * h + 1]);
  }
};

// Σ over the four lanes of a quad (the lanes holding one row of a fragment): xor 1, 2.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
// Σ over the eight quads (the lanes holding one column of a fragment): xor 4, 8, 16.
__device__ __forceinline__ float column_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 4);
  v += __shfl_xor_sync(0xffffffffu, v, 8);
  v += __shfl_xor_sync(0xffffffffu, v, 16);
  return v;
}

// Writing planes: an f32 pair → the hi/lo planes of the run's type (`at`: the element index of
// the pair's first element, even). T = bf16: tc::split2 (sc unused); f16: tc::split2_f16 of the
// values times sc.up.
template <class T>
__device__ __forceinline__ void split_pair(float v0, float v1, TileScale sc, std::uint32_t& h,
                                           std::uint32_t& l) {
  if constexpr (kF16Plane<T>) {
    tc::split2_f16(v0 * sc.up, v1 * sc.up, h, l);
  } else {
    tc::split2(v0, v1, h, l);
  }
}
template <class T>
__device__ __forceinline__ void put_split(bf16* hi, int lo_off, int at, float v0, float v1,
                                          TileScale sc = {}) {
  std::uint32_t h, l;
  split_pair<T>(v0, v1, sc, h, l);
  *reinterpret_cast<std::uint32_t*>(hi + at) = h;
  *reinterpret_cast<std::uint32_t*>(hi + lo_off + at) = l;
}
// The pair at `at` (even) of a typed tile's plane, as floats.
template <class T>
__device__ __forceinline__ float2 get_typed_pair(const bf16* plane, int at) {
  return typed_pair<T>(*reinterpret_cast<const std::uint32_t*>(plane + at));
}

}  // namespace m3::gpu::tcf
