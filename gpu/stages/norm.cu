// RMSNorm, forward and backward (MODEL.md §4 F1, §6.1: every layer's pre-norm and norm_f);
// the same math, operation for operation, as reference/rmsnorm.cpp:
//   rms[r]   = sqrt( (1/dim) Σ_i u[r,i]² + ε ),  ε = 1e-5     (saved: the RMS, not 1/rms)
//   y[r,i]   = u[r,i] / rms[r] · w[i]
// Backward, x̂ = u/rms, g = ∂L/∂y:
//   c[r]     = (1/dim) Σ_i g[r,i]·w[i]·x̂[r,i]
//   dx[r,i]  = ( w[i]·g[r,i] − x̂[r,i]·c[r] ) / rms[r]         (overwrite)
//   dw[i]   += Σ_r g[r,i]·x̂[r,i]                              (fixed order, below)
//   (y_again) y[r,i] written again from the same u, rms and w with the forward's expression,
//           so its bits (B1 of the production layout, which keeps no post_norm for B2's dW)
//   (kAdd)  add_out[r,i] = add_in[r,i] + dx[r,i]   (B1's δ + d_pre_norm, from dx in registers;
//           dx itself stored only when its pointer is set); with add_typed also add_out's
//           values rounded to T (δ's typed copy for the next B8: convert()'s bits). add_in's
//           row is read as the row starts, for the second pass: with 32 lanes per row, vectors
//           and dw fused (every dim in (124, 1024] with aligned rows: kStage) by cp.async into
//           the warp's row of the shared dw buffer, its latency under the first pass's loads,
//           and u's and g's rows come through a ring row per warp in shared memory, the warp's
//           next row copied there by cp.async as soon as the first pass has used this one's
//           (its latency under this row's second pass and the next row's start); otherwise
//           add_in's row is prefetched into L2 (prefetch_l2)
// Forward with the residual add in front (rmsnorm_forward_add, kSum): u[r,i] = a[r,i] + b[r,i]
// (f32 + typed, bit for bit add()) is stored to u as the row is first read, then normalised:
// the previous layer's F8 add and this F1 (or norm_f) in one pass over the residual stream.
// Shapes: u, dx f32 [rows, dim] (the residual stream); y, g typed T [rows, dim] (y rounded once
// at its store); w, dw [dim]; rms [rows]. One row per warp segment (reduce.cuh) of
// L = segment_lanes(⌈dim/4⌉) lanes; lane l owns the groups of kV = 4 consecutive elements
// starting at 4·(l + k·L), k = 0, 1, …, so any dim works. Σ_i is each lane's sum in ascending i,
// then segment_sum (a fixed order that depends on dim only). With dim % 4 == 0 and aligned
// pointers a group is one vector access (16 bytes of f32, 4·sizeof(T) of T), otherwise the same
// groups are read element by element. A lane holds a chunk of kGroups = 8 groups in registers,
// so a row of up to 32·L elements (dim ≤ 1024) is read from memory once for both passes.
// dw, for rows that fit one chunk (every dim ≤ 1024, and L < 32 always): the backward kernel
// sums its terms as it goes (kDw), so g and u are read once for dx and dw together. Block b
// owns rows [b·R, b·R + R) (R = max(128, rows per block pass)); its segment q takes rows
// b·R + q, + (segments per block), … in ascending order, each lane keeping its columns' sums in
// registers; then P[b, i] = Σ_q (segment q's sum) in ascending q (shared memory), and
// dw[i] += colsum_rows over P's rows (reduce.cuh's order). Wider rows (dim > 1024): dw from
// colsum_rows over the terms themselves after the kernel (g and u read a second time). Both are
// fixed orders that depend on (rows, dim) only.
#include <cstddef>
#include <utility>

#include "convert.cuh"
#include "reduce.cuh"
#include "smem.cuh"

namespace m3::gpu {

namespace {

constexpr float kEpsF = static_cast<float>(ref::kEps);
constexpr int kV = 4;       // values per lane group (one 16-byte access of an f32 row)
constexpr int kGroups = 8;  // groups per lane in registers at a time: a chunk of the row
// Blocks per SM promised to ptxas (a 128-register budget): without it, ptxas squeezes some
// instantiations into 64 registers with spills.
constexpr int kMinBlocks = 2;

// Groups a lane holds at L lanes per row: kGroups, or one when L < 32 (segment_lanes then
// gives dim ≤ 4·L: the row is one group per lane).
constexpr int groups_of(int L) { return L < 32 ? 1 : kGroups; }

// The lane's chunk of a row from element c0: groups c0 + k·L·kV, k < G, all loads issued
// before any is used (U = Use::kArith for a typed row: f16's kStored loads would wait for
// each other, convert.cuh); groups past the row are left unset.
template <int L, bool kVec, Use U = Use::kStored, int G, class X>
__device__ __forceinline__ void load_chunk(const X* row, Idx c0, Idx dim, float (&v)[G][kV]) {
#pragma unroll
  for (int k = 0; k < G; ++k) {
    const Idx i = c0 + Idx(k) * L * kV;
    if (i < dim) load_group<kVec, U>(row + i, dim - i, v[k]);
  }
}

// The first pass walks the lane's chunks c0 = i0, i0 + kChunk, …; the second pass walks them
// backwards: the last one is still in registers, the earlier ones (rows over 32·L elements
// only) are loaded again. A lane past the row (i0 ≥ dim) finds no group in either pass.
// kSum: u is written, not read: u = a + b as each chunk is first loaded (the second pass's
// reloads of earlier chunks read back the lane's own stores).
template <class T, int L, bool kVec, bool kSum>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
rmsnorm_forward_kernel(Idx rows, Idx dim, float* __restrict__ u, const float* __restrict__ a,
                       const T* __restrict__ b, const float* __restrict__ w, T* __restrict__ y,
                       float* __restrict__ rms) {
  using S = Seg<L>;
  constexpr int G = groups_of(L);
  constexpr Idx kStep = Idx(L) * kV, kChunk = G * kStep;
  const Idx i0 = Idx(S::lane()) * kV;
  for (Idx w0 = S::first(); w0 < rows; w0 += S::stride()) {
    const Idx r = w0 + S::seg();
    const bool on = r < rows;
    const float* ur = u + r * dim;
    float x[G][kV];  // the lane's current chunk of u
    float ss = 0.0f;
    if (on)
      for (Idx c0 = i0; c0 < dim; c0 += kChunk) {
        if constexpr (kSum) {
          float bv[G][kV];
          load_chunk<L, kVec>(a + r * dim, c0, dim, x);
          load_chunk<L, kVec, Use::kArith>(b + r * dim, c0, dim, bv);
#pragma unroll
          for (int k = 0; k < G; ++k) {
            const Idx i = c0 + k * kStep;
            if (i >= dim) continue;
#pragma unroll
            for (int j = 0; j < kV; ++j) x[k][j] = x[k][j] + bv[k][j];
            store_group<kVec>(u + r * dim + i, dim - i, x[k]);
          }
        } else {
          load_chunk<L, kVec>(ur, c0, dim, x);
        }
#pragma unroll
        for (int k = 0; k < G; ++k) {
          const Idx i = c0 + k * kStep;
#pragma unroll
          for (int j = 0; j < kV; ++j)
            if (i + (kVec ? 0 : j) < dim) ss += x[k][j] * x[k][j];
        }
      }
    ss = segment_sum<L>(ss);
    if (!on) continue;
    const float rr = sqrtf(ss / static_cast<float>(dim) + kEpsF);
    if (S::lane() == 0) rms[r] = rr;
    T* yr = y + r * dim;
    const Idx last = i0 + (dim - 1 - i0) / kChunk * kChunk;  // the chunk still in x
    for (Idx c0 = last; c0 >= i0; c0 -= kChunk) {
      if (c0 != last) load_chunk<L, kVec>(ur, c0, dim, x);
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const Idx i = c0 + k * kStep;
        if (i >= dim) continue;
        float wv[kV], o[kV];
        load_group<kVec>(w + i, dim - i, wv);
#pragma unroll
        for (int j = 0; j < kV; ++j) o[j] = x[k][j] / rr * wv[j];
        store_group<kVec>(yr + i, dim - i, o);
      }
    }
  }
}

// The groups k < G at src + k·kStride (kV values each, k·kStride < m) to the same offsets from
// dst, by cp.async with the offsets as immediates, so that the copies of a row hold two address
// registers, not one per group (per-group addresses spilled at the backward's 128-register
// budget). The caller waits; the copies are visible to this thread.
// Groups of 4 values of X: 16 bytes of f32 by .cg (read once, past L1), 8 bytes of a 16-bit
// type by .ca (the only form of that size).
template <long long kOff, int kBytes>
__device__ __forceinline__ void copy_group_at(unsigned d, unsigned long long s, bool valid) {
  if constexpr (kBytes == 16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.u32 p, %2, 0;\n"
        " @p cp.async.cg.shared.global [%0+%3], [%1+%3], 16;\n}\n" ::"r"(d),
        "l"(s), "r"(static_cast<unsigned>(valid)), "n"(kOff)
        : "memory");
  } else {
    static_assert(kBytes == 8, "a group is 16 bytes of f32 or 8 of a 16-bit type");
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.u32 p, %2, 0;\n"
        " @p cp.async.ca.shared.global [%0+%3], [%1+%3], 8;\n}\n" ::"r"(d),
        "l"(s), "r"(static_cast<unsigned>(valid)), "n"(kOff)
        : "memory");
  }
}
template <Idx kStride, class X, int... k>
__device__ __forceinline__ void copy_groups(X* dst, const X* src, Idx m,
                                            std::integer_sequence<int, k...>) {
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  const unsigned long long s = __cvta_generic_to_global(src);
  constexpr int kBytes = kV * static_cast<int>(sizeof(X));
  (copy_group_at<k * kStride * static_cast<long long>(sizeof(X)), kBytes>(d, s, k * kStride < m),
   ...);
}
template <int G, Idx kStride, class X>
__device__ __forceinline__ void copy_groups(X* dst, const X* src, Idx m) {
  copy_groups<kStride>(dst, src, m, std::make_integer_sequence<int, G>{});
}

// Whether the kDw kernel at L lanes reads δ, u and g through shared memory (kStage): 32 lanes,
// vectors, δ added; every such launch does, unless a test turned it off to compare the paths.
constexpr bool stages_delta(int L, bool vec, bool add) { return L == 32 && vec && add; }
bool& staging_enabled() {
  static bool on = true;
  return on;
}

// The kStage kernel's ring rows (dynamic shared memory): a row of u (f32) and one of g (T) per
// warp, a row being one chunk of 32 lanes (kStage serves only rows of ≤ 1024 elements):
// 48 KB for the 16-bit types, 64 KB for f32, beside part's 32 KB: two blocks per SM as before.
template <class T>
constexpr std::size_t ring_bytes() {
  return std::size_t(kWarps) * groups_of(32) * 32 * kV * (sizeof(float) + sizeof(T));
}

// Rows per block of the kDw kernel at L lanes per row: 128, or the rows one pass of the block
// takes (Seg<L>::kPerBlock) where that is more; a multiple of it either way.
constexpr Idx dw_rows(int L) {
  return Idx(kWarps) * (32 / L) > 128 ? Idx(kWarps) * (32 / L) : 128;
}
// Whether the kDw kernel serves rows of dim elements at L lanes: the row is one chunk.
inline bool dw_fused(int L, Idx dim) { return dim <= Idx(groups_of(L)) * L * kV; }
inline Idx dw_blocks(int L, Idx rows) { return (rows + dw_rows(L) - 1) / dw_rows(L); }

template <class T, int L, bool kVec, bool kAdd, bool kDw, bool kStage>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
rmsnorm_backward_kernel(Idx rows, Idx dim, const float* __restrict__ u,
                        const float* __restrict__ w, const float* __restrict__ rms,
                        const T* __restrict__ g, float* __restrict__ dx,
                        const float* __restrict__ add_in, float* __restrict__ add_out,
                        T* __restrict__ add_typed, T* __restrict__ y_again,
                        float* __restrict__ dw_part) {
  using S = Seg<L>;
  constexpr int G = groups_of(L);
  constexpr Idx kStep = Idx(L) * kV, kChunk = G * kStep;
  // kStage: δ's row through shared memory (below); with 32 lanes a row is a warp's, and kDw
  // rows are one chunk (dw_fused), so the warp's row of part holds all of it.
  static_assert(!kStage || (kDw && stages_delta(L, kVec, kAdd)), "kStage: see stages_delta");
  const Idx i0 = Idx(S::lane()) * kV;
  // kDw: this block's rows [r_begin, r_end), a pass of kPerBlock rows at a time; else all rows,
  // grid-stride.
  static_assert(dw_rows(L) % S::kPerBlock == 0, "a block's rows are whole passes");
  const Idx r_begin = kDw ? Idx(blockIdx.x) * dw_rows(L) : 0;
  const Idx r_end = kDw ? min(rows, r_begin + dw_rows(L)) : rows;
  const Idx w_first = kDw ? r_begin + Idx(threadIdx.x / 32) * S::kPerWarp : S::first();
  const Idx w_step = kDw ? Idx(S::kPerBlock) : S::stride();
  float dwa[kDw ? G : 1][kV] = {};  // kDw: the lane's column sums of g·x̂
  // kDw: P's rows (below); kStage: while the rows are walked, warp w's δ row (part[w]).
  __shared__ __align__(16) float part[kDw ? S::kPerBlock : 1][kDw ? kChunk : 1];
  float* const stage = part[kStage ? threadIdx.x / 32 : 0];  // kStage: one row per warp
  // kStage: the warp's ring row of u and of g (dynamic shared memory, ring_bytes<T>): the next
  // row's values land there while this row is worked on (a row per warp: S::kPerWarp == 1).
  extern __shared__ __align__(16) unsigned char ring[];
  float* const ur_s = reinterpret_cast<float*>(ring) + (threadIdx.x / 32) * kChunk;
  T* const gr_s = reinterpret_cast<T*>(ring + kWarps * kChunk * sizeof(float)) +
                  (threadIdx.x / 32) * kChunk;
  if constexpr (kStage) {  // the warp's first row's u and g (group B of that row)
    if (w_first < r_end) {
      copy_groups<G, kStep>(ur_s + i0, u + w_first * dim + i0, dim - i0);
      copy_groups<G, kStep>(gr_s + i0, g + w_first * dim + i0, dim - i0);
    }
    cp_async_commit();
  }
  for (Idx w0 = w_first; w0 < r_end; w0 += w_step) {
    const Idx r = w0 + S::seg();
    const bool on = r < r_end;
    const float* ur = kStage ? ur_s : u + r * dim;
    const T* gr = kStage ? gr_s : g + r * dim;
    const float rr = on ? rms[r] : 1.0f;
    // kAdd: δ's row (add_in) is read only in the second pass, a group at a time (holding it in
    // registers spills). kStage: each lane copies its own groups of it into the warp's row of
    // part by cp.async as the row starts (group A), so its latency passes under the first
    // pass's; else it is prefetched into L2, which makes the second pass's loads L2 hits.
    // kStage's groups, two per row, in this order: A_r (δ of r), then B_{r+1} (u, g of the
    // warp's next row, issued once the first pass has used this row's); every lane of the warp
    // has the same rows, and each reads back only its own copies (no barrier).
    if constexpr (kStage) {
      if (on) copy_groups<G, kStep>(stage + i0, add_in + r * dim + i0, dim - i0);
      cp_async_commit();           // A_r
      cp_async_wait_group<1>();    // B_r has landed (A_r may not have)
    } else if (kAdd && kVec && on && S::lane() == 0) {
      prefetch_l2(add_in + r * dim, static_cast<unsigned>(dim * sizeof(float)));
    }
    float x[G][kV], gx[G][kV];  // the lane's current chunk of u and of g
    float c = 0.0f;
    if (on)
      for (Idx c0 = i0; c0 < dim; c0 += kChunk) {
        load_chunk<L, kVec>(ur, c0, dim, x);
        load_chunk<L, kVec, Use::kArith>(gr, c0, dim, gx);
#pragma unroll
        for (int k = 0; k < G; ++k) {
          const Idx i = c0 + k * kStep;
          if (i >= dim) continue;
          float wv[kV];
          load_group<kVec>(w + i, dim - i, wv);
#pragma unroll
          for (int j = 0; j < kV; ++j)
            if (i + (kVec ? 0 : j) < dim) {
              c += gx[k][j] * wv[j] * (x[k][j] / rr);
              if constexpr (kDw) dwa[k][j] += gx[k][j] * (x[k][j] / rr);  // RmsDwTerm's value
            }
        }
      }
    c = segment_sum<L>(c) / static_cast<float>(dim);
    if constexpr (kStage) {
      // The ring row is read (x and gx hold all of it, and c has used every value): the
      // warp's next row's u and g go there now (B_{r+1}; empty past the block's rows).
      const Idx rn = r + w_step;
      if (rn < r_end) {
        copy_groups<G, kStep>(ur_s + i0, u + rn * dim + i0, dim - i0);
        copy_groups<G, kStep>(gr_s + i0, g + rn * dim + i0, dim - i0);
      }
      cp_async_commit();         // B_{r+1}
      cp_async_wait_group<1>();  // A_r (δ) has landed
    }
    if (!on) continue;
    float* dxr = dx ? dx + r * dim : nullptr;
    T* yr = y_again ? y_again + r * dim : nullptr;
    const Idx last = i0 + (dim - 1 - i0) / kChunk * kChunk;  // the chunk still in x, gx
    for (Idx c0 = last; c0 >= i0; c0 -= kChunk) {
      if (c0 != last) {
        load_chunk<L, kVec>(ur, c0, dim, x);
        load_chunk<L, kVec, Use::kArith>(gr, c0, dim, gx);
      }
#pragma unroll
      for (int k = 0; k < G; ++k) {
        const Idx i = c0 + k * kStep;
        if (i >= dim) continue;
        float wv[kV], o[kV];
        load_group<kVec>(w + i, dim - i, wv);
        // x̂ in place of u (this group of u is not read again in this row).
#pragma unroll
        for (int j = 0; j < kV; ++j) x[k][j] = x[k][j] / rr;
        if (yr) {  // the forward's y = u / rms · w: the same operations on the same values
#pragma unroll
          for (int j = 0; j < kV; ++j) o[j] = x[k][j] * wv[j];
          store_group<kVec>(yr + i, dim - i, o);
        }
        // w·g − x̂·c in one rounding form for every instantiation: w·g rounded, x̂·c fused
        // (−x̂·c + w·g in one fma). Spelled out because ptxas, left to contract the expression,
        // picks the fused product per instantiation (x̂·c with kVec and kAdd, w·g with one of
        // the two, per element with neither), which would round the same row differently in
        // norm_f's backward and in a layer's B1.
#pragma unroll
        for (int j = 0; j < kV; ++j)
          o[j] = __fmaf_rn(-x[k][j], c, __fmul_rn(wv[j], gx[k][j])) / rr;
        if (dxr) store_group<kVec>(dxr + i, dim - i, o);
        if constexpr (kAdd) {
          float a[kV];
          if constexpr (kStage) {
            const float4 a4 = *reinterpret_cast<const float4*>(&stage[i]);
            a[0] = a4.x, a[1] = a4.y, a[2] = a4.z, a[3] = a4.w;
          } else {
            load_group<kVec>(add_in + r * dim + i, dim - i, a);
          }
#pragma unroll
          for (int j = 0; j < kV; ++j) a[j] = a[j] + o[j];
          store_group<kVec>(add_out + r * dim + i, dim - i, a);
          if (add_typed) store_group<kVec>(add_typed + r * dim + i, dim - i, a);
        }
      }
    }
  }
  if constexpr (kDw) {  // P[b, i] = Σ_q (segment q's sums), ascending q
    // kStage: row q of part is warp q's δ row, whose copies this lane waited for (the last
    // group, B past the block's rows, is empty); it now overwrites its own groups there, which
    // no other lane reads before the barrier.
    const int q = static_cast<int>(threadIdx.x / 32) * S::kPerWarp + S::seg();
#pragma unroll
    for (int k = 0; k < G; ++k)
#pragma unroll
      for (int j = 0; j < kV; ++j) {
        const Idx i = i0 + k * kStep + j;
        if (i < dim) part[q][i] = dwa[k][j];
      }
    __syncthreads();
    for (Idx i = threadIdx.x; i < dim; i += kThreads) {
      float sum = part[0][i];
#pragma unroll 4
      for (int p = 1; p < S::kPerBlock; ++p) sum += part[p][i];
      dw_part[Idx(blockIdx.x) * dim + i] = sum;
    }
  }
}

// dw term (r, i) = g[r,i]·x̂[r,i]
template <class T>
struct RmsDwTerm {
  const float* u;
  const T* g;
  const float* rms;
  Idx dim;
  struct Term {
    T g;
    float u, rms;
  };
  __device__ Term load(Idx r, Idx i) const { return {g[r * dim + i], u[r * dim + i], rms[r]}; }
  __device__ float add_to(float acc, const Term& t) const {
    return __fmaf_rn(to_float(t.g), t.u / t.rms, acc);
  }
};

void check_dim(Idx rows, Idx dim, const char* where) {
  M3_REQUIRE(rows >= 0 && dim >= 1, where, "bad shape", "rows=", rows, ", dim=", dim);
}

int lanes_of(Idx dim) { return segment_lanes((dim + kV - 1) / kV); }

}  // namespace

Idx rmsnorm_backward_scratch_floats(Idx rows, Idx dim) {
  const int L = lanes_of(dim);
  if (!dw_fused(L, dim)) return colsum_scratch_floats(rows, dim);
  const Idx blocks = dw_blocks(L, rows);
  return blocks * dim + colsum_scratch_floats(blocks, dim);  // P, then colsum_rows' own
}

// Both entry points: u read (a, b null) or u = a + b written (kSum).
template <class T, bool kSum>
void launch_rmsnorm_forward(cudaStream_t s, Idx rows, Idx dim, float* u, const float* a,
                            const T* b, const float* w, T* y, float* rms, const char* where) {
  check_dim(rows, dim, where);
  if (rows == 0) return;
  const bool vec = dim % kV == 0 && is_aligned(u, 16) && is_aligned(w, 16) &&
                   is_aligned(y, kV * sizeof(T)) &&
                   (!kSum || (is_aligned(a, 16) && is_aligned(b, kV * sizeof(T))));
  with_lanes(segment_lanes((dim + kV - 1) / kV), [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    const unsigned int grid = grid_for(rows, Seg<L>::kPerBlock);
    if (vec)
      rmsnorm_forward_kernel<T, L, true, kSum>
          <<<grid, kThreads, 0, s>>>(rows, dim, u, a, b, w, y, rms);
    else
      rmsnorm_forward_kernel<T, L, false, kSum>
          <<<grid, kThreads, 0, s>>>(rows, dim, u, a, b, w, y, rms);
  });
  M3_LAUNCH_CHECK();
}

template <class T>
void rmsnorm_forward(cudaStream_t s, Idx rows, Idx dim, const float* u, const float* w, T* y,
                     float* rms) {
  // kSum = false never writes u.
  launch_rmsnorm_forward<T, false>(s, rows, dim, const_cast<float*>(u), nullptr, nullptr, w, y,
                                   rms, "gpu::rmsnorm_forward");
}

template <class T>
void rmsnorm_forward_add(cudaStream_t s, Idx rows, Idx dim, const float* a, const T* b, float* u,
                         const float* w, T* y, float* rms) {
  launch_rmsnorm_forward<T, true>(s, rows, dim, u, a, b, w, y, rms, "gpu::rmsnorm_forward_add");
}

template <class T>
void rmsnorm_backward(cudaStream_t s, Idx rows, Idx dim, const float* u, const float* w,
                      const float* rms, const T* g, float* dx, float* dw, Scratch scratch,
                      const float* add_in, float* add_out, T* add_typed, T* y_again) {
  const char* where = "gpu::rmsnorm_backward";
  check_dim(rows, dim, where);
  const bool add = add_out != nullptr;
  M3_REQUIRE(add == (add_in != nullptr), where, "bad arguments",
             "add_in and add_out are both set or both null");
  M3_REQUIRE(dx || add, where, "bad arguments", "nothing to write: dx and add_out are null");
  M3_REQUIRE(!add_typed || add, where, "bad arguments", "add_typed needs add_out");
  // The vector choice sets the order of c's sum, so y_again does not take part in it: it must
  // have the alignment every backbone buffer has.
  M3_REQUIRE(!y_again || is_aligned(y_again, kV * sizeof(T)), where, "bad arguments",
             "y_again is not aligned to ", kV * sizeof(T), " bytes");
  require_scratch(scratch, rmsnorm_backward_scratch_floats(rows, dim), where);
  if (rows == 0) return;
  const bool vec = dim % kV == 0 && is_aligned(u, 16) && is_aligned(w, 16) &&
                   is_aligned(dx, 16) && is_aligned(g, kV * sizeof(T)) &&
                   is_aligned(add_in, 16) && is_aligned(add_out, 16) &&
                   is_aligned(add_typed, kV * sizeof(T));
  const int lanes = lanes_of(dim);
  const bool fused = dw_fused(lanes, dim);
  const Idx blocks = dw_blocks(lanes, rows);
  with_lanes(lanes, [&](auto lanes_c) {
    constexpr int L = decltype(lanes_c)::value;
    with_flags(vec, add, [&](auto vec_c, auto add_c) {
      constexpr bool V = decltype(vec_c)::value, A = decltype(add_c)::value;
      if (fused) {
        auto launch = [&](auto stage) {
          constexpr bool kSt = decltype(stage)::value;
          auto kernel = rmsnorm_backward_kernel<T, L, V, A, true, kSt>;
          const std::size_t ring = kSt ? ring_bytes<T>() : 0;
          opt_in_smem(kernel, ring, where);  // with part's 32 KB static, past the default 48 KB
          kernel<<<static_cast<unsigned int>(blocks), kThreads, ring, s>>>(
              rows, dim, u, w, rms, g, dx, add_in, add_out, add_typed, y_again, scratch.p);
        };
        if constexpr (stages_delta(L, V, A)) {
          if (staging_enabled()) return launch(std::true_type{});
        }
        launch(std::false_type{});
      } else if constexpr (L == 32) {  // only rows of more than 32·L = 1024 elements
        rmsnorm_backward_kernel<T, L, V, A, false, false>
            <<<grid_for(rows, Seg<L>::kPerBlock), kThreads, 0, s>>>(
                rows, dim, u, w, rms, g, dx, add_in, add_out, add_typed, y_again, nullptr);
      }
    });
  });
  M3_LAUNCH_CHECK();
  if (fused) {
    const Idx part = blocks * dim;
    colsum_rows(s, blocks, dim, LoadMatrix{scratch.p, dim}, dw, true,
                Scratch{scratch.p + part, scratch.n - part}, where);
  } else {
    colsum_rows(s, rows, dim, RmsDwTerm<T>{u, g, rms, dim}, dw, true, scratch, where);
  }
}

void set_rmsnorm_delta_staging_for_testing(bool on) { staging_enabled() = on; }

#define M3_INSTANTIATE(T)                                                                   \
  template void rmsnorm_forward<T>(cudaStream_t, Idx, Idx, const float*, const float*, T*,  \
                                   float*);                                                 \
  template void rmsnorm_forward_add<T>(cudaStream_t, Idx, Idx, const float*, const T*,      \
                                       float*, const float*, T*, float*);                   \
  template void rmsnorm_backward<T>(cudaStream_t, Idx, Idx, const float*, const float*,     \
                                    const float*, const T*, float*, float*, Scratch,        \
                                    const float*, float*, T*, T*);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
