// Internal to gpu/ (.cu files only): block-wide matrix products on the tensor cores for f32
// operands held in shared memory, used by the chunked scan (gpu/scan/chunked_*.cu) of the typed
// (bf16/f16) runs.
//
//   C[m][n] (+)= Σ_{k < K'} A(m, k) · B(k, n),   m < M, n < N,   K' = K rounded up to 16,
//   A(m, k) = A[m·AM + k·AK],   B(k, n) = B[k·BK + n·BN]   (shared memory).
// Acc<M, N, NW> holds C in registers (zero, add — any number of times — and for_each over the
// elements a thread holds); gemm() writes one product to a shared tile C[m·LDC + n].
//
// Precision. Every f32 operand v is split into two bf16 parts, hi = bf16(v) (round to nearest
// even) and lo = bf16(v − hi); hi + lo carries 16 significant bits (|v − hi − lo| ≤ 2⁻¹⁶·|v| for
// |v| ≥ 2⁻¹¹⁰; below, an absolute error under 2⁻¹²⁶; tests/gpu/test_tc_split.cu checks these
// bounds on the host), so a product is formed as
//   a·b ≈ ah·bh + (ah·bl + al·bh)          (the dropped al·bl is below 2⁻¹⁶·|a·b|)
// with the two bracketed groups in separate f32 accumulators (tensor-core mma.sync m16n8k16,
// bf16 in, f32 accumulate) that are added once at the end. An operand known to be a bf16 value
// (AX / BX: a bf16-typed activation loaded exactly) has lo = 0 and its correction term is
// skipped, so a product of two such operands costs one tensor-core pass and is exact up to the
// f32 accumulation. An f16 value splits exactly (11 significant bits ≤ 16) but is not exact in
// bf16 (callers pass AX = BX = false for f16 runs). The relative error of a dot product is
// therefore ≈ 2⁻¹⁶ of Σ|a·b| at worst — two orders of magnitude under the bf16/f16 storage
// rounding (2⁻⁹ / 2⁻¹²) that the typed runs are budgeted for; the f32 runs do not use this file
// (they keep f32 FMA products, MODEL.md §12.8 "TF32 off").
// Non-finite operands give non-finite results (an inf splits into inf and NaN).
//
// Work split: the M/16 × N/8 output tiles of the mma shape are dealt to the NW warps of the
// block as WM × WN warp groups (WM = min(M/16, 4), WN = NW / WM); each warp owns FM × FN tiles
// and keeps them in registers. An operand contiguous in k (AK = 1 or BK = 1) is read as float2
// pairs. Summation order is fixed (k ascending in steps of 16, the tensor core's fixed
// reduction inside a step), so results are bit-identical run to run.
// Caller: all NW·32 threads of the block call add / gemm together; A and B are in shared memory
// and visible (after a barrier); the k ∈ [K, K') padding of both operands holds finite values
// and A's (or B's) is zero; gemm's C is written by that call only (the caller synchronises
// before reading it).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>

namespace m3::gpu::tc {

// (x0, x1) → packed bf16 pairs hi, lo with hi + lo ≈ (x0, x1) (see the header). Host-callable
// so that tests/gpu/test_tc_split.cu can check the precision claims without a device.
__host__ __device__ __forceinline__ void split2(float x0, float x1, std::uint32_t& hi,
                                                std::uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const std::uint32_t*>(&h);
  lo = *reinterpret_cast<const std::uint32_t*>(&l);
}
__host__ __device__ __forceinline__ std::uint32_t pack2(float x0, float x1) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  return *reinterpret_cast<const std::uint32_t*>(&h);
}

// f16 runs' planes of f32 tiles (tc_frag.cuh): (x0, x1), already scaled by the tile's power of
// two, → packed f16 pairs hi = f16(x), lo = f16(x − hi). For |x| < 2¹⁵:
//   |x − hi − lo| ≤ max(2⁻²²·|x|, 2⁻²⁵)
// (hi and lo each round to 11 significant bits while they are normal, |·| ≥ 2⁻¹⁴; below, f16's
// subnormal spacing 2⁻²⁴). tests/gpu/test_tc_split.cu checks it on the host.
__host__ __device__ __forceinline__ void split2_f16(float x0, float x1, std::uint32_t& hi,
                                                    std::uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 hf = __half22float2(h);
  const __half2 l = __floats2half2_rn(x0 - hf.x, x1 - hf.y);
  std::memcpy(&hi, &h, sizeof hi);
  std::memcpy(&lo, &l, sizeof lo);
}

// The exponent e of an f32 tile's f16 planes: max|tile|·2^e ∈ [2¹⁴, 2¹⁵) (the largest value's hi
// keeps clear of f16's 65504, the values down to 2⁻¹⁷·max keep a normal lo), clamped to
// [−64, 64] so that an accumulator brought into the tile's scale stays far inside f32's range.
// 0 for a zero or non-finite max (non-finite values stay non-finite through the split). With
// the clamp, a tile whose max reaches 2⁸⁰ would overflow f16: f16 runs' f32 intermediates are
// far below that (their inputs end at 65504).
__host__ __device__ __forceinline__ int tile_exponent(float max_abs) {
  std::uint32_t bits;
  std::memcpy(&bits, &max_abs, sizeof bits);
  const int biased = static_cast<int>((bits >> 23) & 0xFFu);
  if (biased == 0xFF || max_abs == 0.0f) return 0;
  const int e = 141 - biased;  // 14 − (biased − 127); subnormal maxima (biased 0) clamp to 64
  return e < -64 ? -64 : e > 64 ? 64 : e;
}
// 2^e as a float, |e| ≤ 126.
__host__ __device__ __forceinline__ float pow2f(int e) {
  const std::uint32_t bits = static_cast<std::uint32_t>(127 + e) << 23;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// A pair of operand values as packed bf16 (hi, lo): exact values (X) have lo = 0.
template <bool X>
__host__ __device__ __forceinline__ void operand_pair(float2 v, std::uint32_t& hi, std::uint32_t& lo) {
  if constexpr (X) {
    hi = pack2(v.x, v.y);
    lo = 0u;
  } else {
    split2(v.x, v.y, hi, lo);
  }
}

// d += a·b, one m16n8k16 tile (row-major A, column-major B, f32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4],
                                         const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// d += a·b with f16 operands (the same fragment layout as mma_bf16): f16·f16 products are
// exact in f32, so a product of two f16 tiles needs no split.
__device__ __forceinline__ void mma_f16(float (&d)[4], const std::uint32_t (&a)[4],
                                        const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The pair (k, k+1) of row m of A, or of column n of B, from shared memory.
template <int SM, int SK>
__device__ __forceinline__ float2 load_pair(const float* P, int m, int k) {
  if constexpr (SK == 1) {
    return *reinterpret_cast<const float2*>(P + m * SM + k);
  } else {
    return make_float2(P[m * SM + k * SK], P[m * SM + (k + 1) * SK]);
  }
}

// The accumulators of an M × N product held by a block of NW warps (the work split of the
// header): zero(), add(A, B, K) for C += A·B over k < K' (any number of times, e.g. over the row
// tiles of a chunk), then for_each(f) calls f(m, n, value) for every element this thread holds
// (each element of C is held by exactly one thread).
// The work split of an M × N output over NW warps (the header): TM × TN m16n8 tiles, a WM × WN
// warp grid, FM × FN tiles per warp. Shared with tc_frag.cuh's Frag.
template <int M, int N, int NW>
struct WarpSplit {
  static constexpr int TM = M / 16, TN = N / 8;
  static constexpr int WM = TM < 4 ? TM : 4, WN = NW / WM;
  static_assert(M % 16 == 0 && N % 8 == 0, "tile shape");
  static_assert(TM % WM == 0 && TN % WN == 0, "the warps must tile the output");
  static constexpr int FM = TM / WM, FN = TN / WN;
};

template <int M, int N, int NW>
struct Acc {
  using Split = WarpSplit<M, N, NW>;
  static constexpr int WM = Split::WM, FM = Split::FM, FN = Split::FN;
  float hi[FM][FN][4];   // Σ ah·bh
  float cor[FM][FN][4];  // Σ (ah·bl + al·bh)

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) hi[i][j][e] = cor[i][j][e] = 0.0f;
  }

  template <int AM, int AK, int BK, int BN, bool AX, bool BX>
  __device__ __forceinline__ void add(const float* A, const float* Bm, int K) {
    static_assert(AK != 1 || AM % 2 == 0, "float2 rows of A need an even stride");
    static_assert(BK != 1 || BN % 2 == 0, "float2 columns of B need an even stride");
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int wm = warp % WM, wn = warp / WM;
#pragma unroll 1
    for (int k0 = 0; k0 < K; k0 += 16) {
      std::uint32_t ah[FM][4], al[FM][4], bh[FN][2], bl[FN][2];
#pragma unroll
      for (int i = 0; i < FM; ++i) {
        const int m = (wm + WM * i) * 16 + g;
#pragma unroll
        for (int r = 0; r < 4; ++r)
          operand_pair<AX>(load_pair<AM, AK>(A, m + 8 * (r & 1), k0 + 2 * c + 8 * (r >> 1)),
                           ah[i][r], al[i][r]);
      }
#pragma unroll
      for (int j = 0; j < FN; ++j) {
        const int n = (wn * FN + j) * 8 + g;
#pragma unroll
        for (int r = 0; r < 2; ++r)  // B(k, n) = Bm[k·BK + n·BN]: the pair (k, k+1) of column n
          operand_pair<BX>(load_pair<BN, BK>(Bm, n, k0 + 2 * c + 8 * r), bh[j][r], bl[j][r]);
      }
#pragma unroll
      for (int i = 0; i < FM; ++i)
#pragma unroll
        for (int j = 0; j < FN; ++j) {
          mma_bf16(hi[i][j], ah[i], bh[j]);
          if constexpr (!BX) mma_bf16(cor[i][j], ah[i], bl[j]);
          if constexpr (!AX) mma_bf16(cor[i][j], al[i], bh[j]);
        }
    }
  }

  // f(m, n, hi + cor) for the elements of this thread: rows g, g + 8 and columns 2c, 2c + 1 of
  // each of its m16n8 tiles.
  template <class F>
  __device__ __forceinline__ void for_each(F&& f) const {
    visit([&](int i, int j, int e, int m, int n) { f(m, n, hi[i][j][e] + cor[i][j][e]); });
  }
  // The same over two accumulators of one shape: f(m, n, mine, other's).
  template <class F>
  __device__ __forceinline__ void for_each2(const Acc& o, F&& f) const {
    visit([&](int i, int j, int e, int m, int n) {
      f(m, n, hi[i][j][e] + cor[i][j][e], o.hi[i][j][e] + o.cor[i][j][e]);
    });
  }

 private:
  // v(i, j, e, m, n): register (i, j, e) of this thread holds element (m, n).
  template <class V>
  __device__ __forceinline__ void visit(V&& v) const {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int wm = warp % WM, wn = warp / WM;
#pragma unroll
    for (int i = 0; i < FM; ++i)
#pragma unroll
      for (int j = 0; j < FN; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          v(i, j, e, (wm + WM * i) * 16 + g + 8 * (e >> 1), (wn * FN + j) * 8 + 2 * c + (e & 1));
  }
};

// C[m·LDC + n] = (A·B)[m][n] into shared memory (overwritten).
template <int M, int N, int AM, int AK, int BK, int BN, bool AX, bool BX, int LDC, int NW>
__device__ __forceinline__ void gemm(float* C, const float* A, const float* Bm, int K) {
  Acc<M, N, NW> acc;
  acc.zero();
  acc.template add<AM, AK, BK, BN, AX, BX>(A, Bm, K);
  acc.for_each([&](int m, int n, float v) { C[m * LDC + n] = v; });
}

}  // namespace m3::gpu::tc
