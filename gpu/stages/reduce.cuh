// Internal to gpu/ (.cu files only): the fixed-order reductions and launch helpers shared by the
// elementwise / row-wise stages (MODEL.md §7: no floating-point atomics, one writer per
// output, every sum in an order that depends only on the shapes, never on timing).
//
// colsum_rows: out[c] (+)= Σ_{r < rows} f(r, c) for a functor f giving element (r, c) of a
// virtual [rows, cols] matrix (so a weight gradient's per-row terms are never materialised).
//   f.load(r, c) → F::Term: the values element (r, c) is made of, loaded (no arithmetic);
//   f.add_to(acc, t) is acc + f(r, c) from them, with its rounding written out: a term that is
//   a product a·b adds as one fma(a, b, acc) (__fmaf_rn), never as a rounded product and an
//   add, so the bits do not depend on whether nvcc contracts the loop's code (which terms it
//   contracts depends on the loop's shape: all of them, or only some of f16's).
//   stage 1: rows are cut into fixed chunks of kColsumChunk rows; block (chunk, column tile)
//            has 32 × kColsumLanes threads; lane row ty sums rows chunk·kColsumChunk + ty,
//            + kColsumLanes, … in ascending order, then thread ty = 0 adds the kColsumLanes
//            lane sums in ascending ty → partial[chunk, c] (Scratch, [chunks, cols]).
//            A lane loads kColsumBatch terms before it adds them (in that order), so that
//            their loads are in flight together: the loop was a chain of one load and one
//            add (and, for the norm weights, one division) per row;
//   stage 2: one thread per column adds partial[0..chunks) in ascending order (s = p₀, then
//            s += p₁, …), then out = s or out += s. Block (column tile) of 32 × kColsumLanes
//            threads: all of them copy a slab of kColsumSlab partial rows to shared memory
//            (independent, coalesced loads), then lane row 0 adds the slab's rows in order.
//   With a single chunk (rows ≤ kColsumChunk) stage 1 writes out directly; no scratch.
// colsum_rows_pair: two such sums of the same [rows, cols] shape in one launch of each stage, as
//   one sum of a [rows, 2·cols] matrix, fa's columns then fb's (SideBySide), whose column c < cols
//   goes to out_a[c] and cols + c to out_b[c] (ColsumOut). Every column's sum is the same chain
//   as colsum_rows' of that functor alone, so the bits are too; what it saves is a launch of
//   each stage (the two sums of a pair are too small to fill the machine).
//
// Row kernels ("segments"): a warp is split into 32/L segments of L lanes (L a power of two);
// a segment owns one row of `dim` elements, lane l handles l, l + L, …; Σ over the row is the
// lane's ascending sum followed by segment_sum<L> (fixed butterfly). segment_lanes(dim) picks
// L = the smallest power of two ≥ dim, capped at 32, so rows of 16 use half-warps and rows of
// any width work.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <type_traits>

#include "common.cuh"
#include "stages.cuh"

namespace m3::gpu {

constexpr int kThreads = 256;               // threads per block of every kernel here
constexpr int kWarps = kThreads / 32;       // warps per block
constexpr Idx kMaxBlocks = Idx(1) << 20;    // grid cap; kernels loop grid-stride beyond it
constexpr int kColsumLanes = kThreads / 32;  // row lanes of a colsum block (32 columns wide)
constexpr Idx kColsumChunk = 256;           // rows per colsum chunk (stage 1)
constexpr int kColsumSlab = 128;            // partial rows stage 2 stages in shared memory
constexpr int kColsumBatch = 8;             // terms a stage-1 lane loads before adding them

// x unchanged, but opaque to the optimiser: an address p + k·x formed from it inside a loop is
// then formed where it is used instead of being hoisted and held in registers across the loop
// (the angle scans' steps, the state passing's chunk strides).
__device__ __forceinline__ int opaque(int x) {
  asm("" : "+r"(x));
  return x;
}
__device__ __forceinline__ Idx opaque(Idx x) {
  asm("" : "+l"(x));
  return x;
}
template <class P>
__device__ __forceinline__ P* opaque(P* x) {
  asm("" : "+l"(x));
  return x;
}

// Blocks for n work items of `per_block` items each, at least 1, at most kMaxBlocks.
inline unsigned int grid_for(Idx n, Idx per_block) {
  const Idx b = (n + per_block - 1) / per_block;
  return static_cast<unsigned int>(std::min<Idx>(std::max<Idx>(b, 1), kMaxBlocks));
}

inline Idx colsum_chunks(Idx rows) { return std::max<Idx>(1, (rows + kColsumChunk - 1) / kColsumChunk); }
// Scratch floats colsum_rows / colsum need for a [rows, cols] sum.
inline Idx colsum_scratch_floats(Idx rows, Idx cols) {
  const Idx chunks = colsum_chunks(rows);
  return chunks > 1 ? chunks * cols : 0;
}

inline void require_scratch(const Scratch& s, Idx need, const char* where) {
  M3_REQUIRE(need == 0 || (s.p != nullptr && s.n >= need), where, "scratch too small",
             "need ", need, " floats, have ", s.n, s.p ? "" : " (null pointer)");
}

// Smallest power of two ≥ dim, at most 32 (lanes per row segment).
inline int segment_lanes(Idx dim) {
  int l = 1;
  while (l < 32 && l < dim) l <<= 1;
  return l;
}

// Sum over aligned segments of L lanes (L a power of two ≤ 32), fixed butterfly order; every
// lane of a segment gets its segment's sum. All 32 lanes of the warp must call it.
template <int L>
__device__ __forceinline__ float segment_sum(float v) {
#pragma unroll
  for (int o = L / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Warp-uniform iteration over rows by segments of L lanes:
//   for (Idx w0 = Seg::first(); w0 < rows; w0 += Seg::stride()) {
//     const Idx row = w0 + Seg::seg();  const bool on = row < rows;  … segment_sum<L> …
//   }
// The loop bound is the warp's first row, so every lane reaches every segment_sum.
template <int L>
struct Seg {
  static constexpr int kPerWarp = 32 / L;   // rows per warp
  static constexpr int kPerBlock = kWarps * kPerWarp;
  __device__ static Idx first() {
    return (Idx(blockIdx.x) * kWarps + threadIdx.x / 32) * kPerWarp;
  }
  __device__ static Idx stride() { return Idx(gridDim.x) * kPerBlock; }
  __device__ static int seg() { return (threadIdx.x & 31) / L; }
  __device__ static int lane() { return threadIdx.x & (L - 1); }
};

// Calls f(std::integral_constant<int, L>{}) with L = lanes ∈ {1, 2, 4, 8, 16, 32}.
template <class F>
void with_lanes(int lanes, F&& f) {
  switch (lanes) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: f(std::integral_constant<int, 32>{}); break;
  }
}

// Calls f(std::bool_constant<a>{}, std::bool_constant<b>{}): the launcher's pick, at run time,
// among the four instantiations of a kernel with two bool template parameters.
template <class F>
void with_flags(bool a, bool b, F&& f) {
  using Y = std::true_type;
  using N = std::false_type;
  if (a) {
    b ? f(Y{}, Y{}) : f(Y{}, N{});
  } else {
    b ? f(N{}, Y{}) : f(N{}, N{});
  }
}

// f(r, c) for a plain float matrix.
struct LoadMatrix {
  const float* m;
  Idx cols;
  using Term = float;
  __device__ float load(Idx r, Idx c) const { return m[r * cols + c]; }
  __device__ static float add_to(float acc, float t) { return acc + t; }
};

// The [rows, 2·cols] matrix of a's columns then b's. F::add_to must be static (a function of the
// term alone), so that a's and b's columns add alike; only load differs.
template <class F>
struct SideBySide {
  F a, b;
  Idx cols;  // of each
  using Term = typename F::Term;
  __device__ Term load(Idx r, Idx c) const { return c < cols ? a.load(r, c) : b.load(r, c - cols); }
  __device__ static float add_to(float acc, const Term& t) { return F::add_to(acc, t); }
};

// Where column c's sum goes: out0[c] for c < split, else out1[c − split] (one output: out0
// with split = cols).
struct ColsumOut {
  float* out0;
  float* out1;
  Idx split;
  __device__ float* at(Idx c) const { return c < split ? out0 + c : out1 + (c - split); }
};

// partial == nullptr: one chunk, the sums go to out; else to partial[chunk, c].
template <class F>
__global__ void __launch_bounds__(kThreads)
colsum_partial_kernel(Idx rows, Idx cols, Idx col_tiles, F f, float* partial, ColsumOut out,
                      bool accumulate) {
  __shared__ float lane_sums[kColsumLanes][33];
  const Idx chunk = blockIdx.x / col_tiles;
  const Idx c = (blockIdx.x % col_tiles) * 32 + threadIdx.x;
  const Idx r1 = min(rows, (chunk + 1) * kColsumChunk);
  float acc = 0.0f;
  if (c < cols) {
    constexpr Idx kSpan = Idx(kColsumBatch - 1) * kColsumLanes;  // a batch's first to last row
    Idx r = chunk * kColsumChunk + threadIdx.y;
    for (; r + kSpan < r1; r += kSpan + kColsumLanes) {
      typename F::Term t[kColsumBatch];
#pragma unroll
      for (int k = 0; k < kColsumBatch; ++k) t[k] = f.load(r + Idx(k) * kColsumLanes, c);
#pragma unroll
      for (int k = 0; k < kColsumBatch; ++k) acc = f.add_to(acc, t[k]);
    }
    for (; r < r1; r += kColsumLanes) acc = f.add_to(acc, f.load(r, c));
  }
  lane_sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < cols) {
    float s = lane_sums[0][threadIdx.x];
#pragma unroll
    for (int k = 1; k < kColsumLanes; ++k) s += lane_sums[k][threadIdx.x];
    float* o = partial ? partial + chunk * cols + c : out.at(c);
    *o = accumulate ? *o + s : s;
  }
}

// Stage 2 (reduce.cu): *out.at(c) (+)= Σ_{k < chunks} partial[k, c], ascending k.
void colsum_finish(cudaStream_t s, Idx chunks, Idx cols, const float* partial, ColsumOut out,
                   bool accumulate);

// The two stages over f's [rows, cols], into out (cols = 2·split for a pair).
template <class F>
void colsum_launch(cudaStream_t s, Idx rows, Idx cols, const F& f, ColsumOut out, bool accumulate,
                   Scratch scratch, const char* where) {
  if (cols <= 0) return;
  if (rows <= 0) {
    if (!accumulate) {
      const Idx n0 = std::min(cols, out.split);
      M3_CUDA_CHECK(cudaMemsetAsync(out.out0, 0, static_cast<std::size_t>(n0) * sizeof(float), s));
      if (cols > n0)
        M3_CUDA_CHECK(cudaMemsetAsync(out.out1, 0,
                                      static_cast<std::size_t>(cols - n0) * sizeof(float), s));
    }
    return;
  }
  const Idx chunks = colsum_chunks(rows), tiles = (cols + 31) / 32;
  M3_REQUIRE(chunks * tiles <= INT_MAX, where, "column sum too large for one grid",
             "rows=", rows, ", cols=", cols);
  require_scratch(scratch, colsum_scratch_floats(rows, cols), where);
  colsum_partial_kernel<<<static_cast<unsigned int>(chunks * tiles), dim3(32, kColsumLanes), 0,
                          s>>>(rows, cols, tiles, f, chunks > 1 ? scratch.p : nullptr, out,
                               chunks > 1 ? false : accumulate);
  M3_LAUNCH_CHECK();
  if (chunks > 1) colsum_finish(s, chunks, cols, scratch.p, out, accumulate);
}

template <class F>
void colsum_rows(cudaStream_t s, Idx rows, Idx cols, const F& f, float* out, bool accumulate,
                 Scratch scratch, const char* where) {
  colsum_launch(s, rows, cols, f, ColsumOut{out, nullptr, cols}, accumulate, scratch, where);
}

// Scratch floats colsum_rows_pair needs for two [rows, cols] sums.
inline Idx colsum_pair_scratch_floats(Idx rows, Idx cols) {
  return colsum_scratch_floats(rows, 2 * cols);
}

template <class F>
void colsum_rows_pair(cudaStream_t s, Idx rows, Idx cols, const F& fa, float* out_a, const F& fb,
                      float* out_b, bool accumulate, Scratch scratch, const char* where) {
  colsum_launch(s, rows, 2 * cols, SideBySide<F>{fa, fb, cols}, ColsumOut{out_a, out_b, cols},
                accumulate, scratch, where);
}

}  // namespace m3::gpu
