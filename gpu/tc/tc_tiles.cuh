// Internal to gpu/ (.cu files only): global → shared loads of the operand planes of
// tc_frag.cuh for the per-chunk plane kernels (chunk_state_tc.cu, chunk_fwd_tc.cu,
// chunk_bwd_tc.cu), by a block of kTileThreads threads. These kernels are latency-bound: every
// loader issues a batch of loads per thread before any of the batch's shared stores, and typed
// rows go by cp.async (the caller waits with cp_async_wait_all() and a barrier).
//   load_typed: N [kTR][C] tiles of storage values (rows < rows, columns < cols live, zeros
//     elsewhere) → one plane each of the values themselves (bf16 or f16 bits, entering the
//     run's mma as they are: tc_frag.cuh's TypedOpnd);
//   load_state: an f32 [hd][ds] state → hi/lo planes [R][C] of the run's type (zeros beyond
//     hd, ds; f16 runs: scaled by the tile's power of two, tc_frag.cuh), optionally with this
//     thread's part of ⟨state, other⟩ in f32 (a fixed order per thread).
#pragma once

#include <cstdint>

#include "convert.cuh"
#include "ssm_chunk_geom.cuh"
#include "tc_frag.cuh"

namespace m3::gpu::tcf {

constexpr int kTileThreads = 256;
constexpr int kBatch = 8;  // loads in flight per thread before their stores

// Values n, n + 1 (n even) of a row of `cols` values, stored as T: one paired store (store_n:
// the bits of two scalar from_float) when `paired` (cols even, the row 8-byte (f32) / 4-byte
// (16-bit T) aligned), else the scalars that exist. The product kernels' epilogues store their
// fragments' pairs with it.
template <class T>
__device__ __forceinline__ void store_row_pair(T* row, int n, int cols, bool paired, float v0,
                                               float v1) {
  if (n >= cols) return;
  if (paired) {
    const float v[2] = {v0, v1};
    store_n<2>(row + n, v);
  } else {
    row[n] = from_float<T>(v0);
    if (n + 1 < cols) row[n + 1] = from_float<T>(v1);
  }
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(bytes)
               : "memory");
}

// This thread's slots of a tile of rows of kW slots each: slot e = tid + k·kTileThreads is at
// row e / kW = r0 + k·kRowStep and column e % kW = col, the same column for every k (kW divides
// kTileThreads: the widths here are powers of two ≤ 64). Taken once per loader, each slot's row
// is then r0 plus a constant; from the signed e of every slot, nvcc derives row, column, bounds
// and a sign-extended 64-bit address anew per slot (ncu: such straight-line address blocks make
// a quarter of chunk_bwd_tc's instructions).
template <int kW>
struct Slots {
  static_assert(kW > 0 && kTileThreads % kW == 0, "a row's slots divide the block");
  static constexpr int kRowStep = kTileThreads / kW;
  int r0 = static_cast<int>(threadIdx.x / kW), col = static_cast<int>(threadIdx.x % kW);
  __device__ __forceinline__ int row(int k) const { return r0 + k * kRowStep; }
};
// Row r and slot column j of this thread's slot k: from sl (kSlots), else from its e.
template <int kW, bool kSlots>
__device__ __forceinline__ void slot_at(const Slots<kW>& sl, int k, int& r, int& j) {
  if constexpr (kSlots) {
    r = sl.row(k);
    j = sl.col;
  } else {
    const int e = threadIdx.x + k * kTileThreads;
    r = e / kW;
    j = e % kW;
  }
}

// For the R × (C/W) slots (r, c = W·j) of a tile, thread tid takes slots tid + k·kTileThreads:
// v = ld(r, c) for a batch of up to kBatch slots, then st(r, c, v) for each; kSlots: slot_at's.
template <int R, int C, int W, bool kSlots, class Ld, class St>
__device__ __forceinline__ void batched(Ld&& ld, St&& st) {
  constexpr int kW = C / W, kIt = R * kW / kTileThreads, kB = kIt < kBatch ? kIt : kBatch;
  static_assert(R * kW % kTileThreads == 0 && kIt % kB == 0, "the block must tile the slots");
  const Slots<kW> sl;
#pragma unroll 1
  for (int k0 = 0; k0 < kIt; k0 += kB) {
    decltype(ld(0, 0)) v[kB];
#pragma unroll
    for (int k = 0; k < kB; ++k) {
      int r, j;
      slot_at<kW, kSlots>(sl, k0 + k, r, j);
      v[k] = ld(r, j * W);
    }
#pragma unroll
    for (int k = 0; k < kB; ++k) {
      int r, j;
      slot_at<kW, kSlots>(sl, k0 + k, r, j);
      st(r, j * W, v[k]);
    }
  }
}

template <class V, int N>
struct Pack {
  V v[N];
};

// N typed tiles of one geometry: src[i][r·stride + c] (r < rows, c < cols) → the [kTR][C] planes
// dst[i] of their 16-bit values, zeros elsewhere. vec: 16-byte rows (cols % 8 == 0, sources
// 16-byte aligned), copied by cp.async straight into the planes (zero-filled outside).
// kSlots: the slots' rows and columns from Slots (slot_at). chunk_bwd_tc asks for it; the walks
// and K5 do not: with it, ptxas allocates their registers otherwise (K5 f16: 8 bytes of spill),
// and their f16 instantiations run 1–2 % slower.
// Lay: the planes' layout (tc_frag.cuh: Padded, or Sw128 for wgmma's operands).
template <class T, int C, int N, bool kSlots, class Lay = Padded>
__device__ __forceinline__ void load_typed(const T* const (&src)[N], bf16* const (&dst)[N],
                                           Idx stride, int rows, int cols, bool vec) {
  static_assert(sizeof(T) == 2, "typed tiles hold 16-bit storage values");
  if (vec) {
    constexpr int kW = C / 8;
    const Slots<kW> sl;
#pragma unroll
    for (int k = 0; k < kTR * kW / kTileThreads; ++k) {
      int r, j;
      slot_at<kW, kSlots>(sl, k, r, j);
      const int c = j * 8;
      const bool in = r < rows && c < cols;
#pragma unroll
      for (int i = 0; i < N; ++i)
        cp_async16(dst[i] + Lay::template at<kTR, C>(r, c), src[i] + (in ? r * stride + c : 0),
                   in ? 16 : 0);
    }
  } else {  // any width: pairs of values, their bits moved as they are
    batched<kTR, C, 2, kSlots>(
        [&](int r, int c) {
          Pack<std::uint32_t, N> v;
#pragma unroll
          for (int i = 0; i < N; ++i) {
            const unsigned short* a =
                reinterpret_cast<const unsigned short*>(src[i] + r * stride + c);
            const std::uint32_t x = r < rows && c < cols ? a[0] : 0u;
            const std::uint32_t y = r < rows && c + 1 < cols ? a[1] : 0u;
            v.v[i] = x | (y << 16);
          }
          return v;
        },
        [&](int r, int c, const Pack<std::uint32_t, N>& v) {
#pragma unroll
          for (int i = 0; i < N; ++i)
            *reinterpret_cast<std::uint32_t*>(dst[i] + Lay::template at<kTR, C>(r, c)) = v.v[i];
        });
  }
}

// Four values of a row of an f32 state (float4 rows) → hi/lo planes of the run's type at
// element `at` (hi; lo kLo further): split_pair<T> (bf16 runs tc::split2, sc unused; f16 runs
// scaled by sc). The float4 paths of load_state and StateInFlight store through it.
template <class T>
__device__ __forceinline__ void put_split4(bf16* dst, int kLo, int at, const float4& m,
                                           TileScale sc = {}) {
  uint2 hi, lo;
  split_pair<T>(m.x, m.y, sc, hi.x, lo.x);
  split_pair<T>(m.z, m.w, sc, hi.y, lo.y);
  *reinterpret_cast<uint2*>(dst + at) = hi;
  *reinterpret_cast<uint2*>(dst + kLo + at) = lo;
}
// A state tile's dot terms, each in one fixed rounding: y's product first, then x's, z's and w's
// fused in (dot2: y's, then x's). nvcc contracts `a·b + c·d + …` into FMAs by its own choice,
// and the choice depends on where the expression is inlined: left to it, StateInFlight::dot
// gets x's product first at the default shape's tiles, and so other bits than load_state's (the
// default preset's chunked digests move). Spelled out, the form is the one nvcc chooses for
// load_state's plain expression in every instantiation, so the digests keep their bits.
__device__ __forceinline__ float dot4(const float4& m, const float4& o) {
  return __fmaf_rn(m.w, o.w, __fmaf_rn(m.z, o.z, __fmaf_rn(m.x, o.x, __fmul_rn(m.y, o.y))));
}
__device__ __forceinline__ float dot2(float x0, float x1, float o0, float o1) {
  return __fmaf_rn(x0, o0, __fmul_rn(x1, o1));
}
// max|·| of the four values (f16 runs' tile scales; fmaxf: a NaN does not hide the others).
__device__ __forceinline__ float max_abs4(const float4& m) {
  return fmaxf(fmaxf(fabsf(m.x), fabsf(m.y)), fmaxf(fabsf(m.z), fabsf(m.w)));
}

// load_state's float4 path (ds % 4 == 0, S 16-byte aligned) in two halves, so that the loads
// can be in flight during other work: issue() loads this thread's slots of an f32 [hd][ds]
// state into registers (zeros outside), store<T>() splits them into hi/lo planes [R][C] — the
// slots, values and split of load_state<R, C, T> with vec, so the planes are its bits. f16
// runs: max_abs() is this thread's max|value| for the tile's scale (post_max, a barrier,
// scale_of, as load_state), which store<T> is then given. All of a thread's kIt slots at
// once: meant for kIt ≤ kBatch (one batch of load_state's); larger tiles hold too many
// registers: load_state.
template <int R, int C, class Lay = Padded>
struct StateInFlight {
  static constexpr int kW = C / 4, kIt = R * kW / kTileThreads;
  static_assert(R * kW % kTileThreads == 0, "the block must tile the state");
  float4 v[kIt];
  __device__ __forceinline__ void issue(const float* S, int hd, int ds) {
    const Slots<kW> sl;
#pragma unroll
    for (int k = 0; k < kIt; ++k) {
      const int r = sl.row(k), c = sl.col * 4;
      v[k] = r < hd && c < ds ? *reinterpret_cast<const float4*>(S + r * ds + c)
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
  }
  __device__ __forceinline__ float max_abs() const {
    float mx = 0.0f;
#pragma unroll
    for (int k = 0; k < kIt; ++k) mx = fmaxf(mx, max_abs4(v[k]));
    return mx;
  }
  // This thread's part of ⟨S, O⟩ (o: O's values issued with the same hd, ds), in load_state's
  // order and rounding (dot4), so the same bits: its f16 path adds the live slots, as here; its
  // bf16 path adds every slot, the dead ones' terms +0, and a sum begun at +0 is never −0 (round
  // to nearest: x + (−x) = +0), so adding +0 changes no bit of it.
  __device__ __forceinline__ float dot(const StateInFlight& o, int hd, int ds) const {
    const Slots<kW> sl;
    float d = 0.0f;
#pragma unroll
    for (int k = 0; k < kIt; ++k)
      if (sl.row(k) < hd && sl.col * 4 < ds)
        d += dot4(v[k], o.v[k]);
    return d;
  }
  // The whole split into planes, as load_state's float4 paths end. f16 runs: post_max into
  // red[kTileThreads / 32], a barrier, scale_of, store; bf16 runs: store (no barrier, red
  // unused). Returns the planes' scale (bf16: 1).
  template <class T>
  __device__ __forceinline__ TileScale split_scaled(bf16* dst, float* red) const {
    if constexpr (!kF16Plane<T>) {
      store<T>(dst);
      return {};
    } else {
      post_max<T>(max_abs(), red);
      __syncthreads();
      const TileScale sc = scale_of<T, kTileThreads / 32>(red);
      store<T>(dst, sc);
      return sc;
    }
  }
  template <class T>
  __device__ __forceinline__ void store(bf16* dst, TileScale sc = {}) const {
    const Slots<kW> sl;
#pragma unroll
    for (int k = 0; k < kIt; ++k)
      put_split4<T>(dst, Lay::template size<R, C>(),
                    Lay::template at<R, C>(sl.row(k), sl.col * 4), v[k], sc);
  }
};

// load_state's results: this thread's part of ⟨S, O⟩ (kDot, else 0) and the planes' scale.
struct StateLoad {
  float dot = 0.0f;
  TileScale sc;
};

// S [hd][ds] (f32) → hi/lo planes [R][C] in layout Lay (lo Lay's plane size further), zeros
// outside.
// vec: float4 rows (ds % 4 == 0, S 16-byte aligned). With kDot, also this thread's Σ S·O over
// the elements it loads (O: another [hd][ds] f32 state, read alongside).
// bf16 runs: the values split as their batch lands. f16 runs: every value of the thread is held
// in registers until the tile's max|S| is known (post_max into red[kTileThreads / 32], a
// barrier, scale_of), then split scaled; red may be reused once every thread has returned.
template <int R, int C, class T, bool kDot = false, class Lay = Padded>
__device__ __forceinline__ StateLoad load_state(bf16* dst, const float* S, int hd, int ds,
                                                bool vec, float* red, const float* O = nullptr) {
  constexpr int kLo = Lay::template size<R, C>();
  auto at = [](int r, int c) { return Lay::template at<R, C>(r, c); };
  StateLoad out;
  if constexpr (kF16Plane<T>) {
    if (vec) {  // float4 rows: the thread's values wait in registers for the scale
      using St = StateInFlight<R, C, Lay>;  // its slots; O's values read one by one, for the dot
      St s;
      const Slots<St::kW> sl;
#pragma unroll
      for (int k = 0; k < St::kIt; ++k) {
        const int r = sl.row(k), c = sl.col * 4;
        const bool in = r < hd && c < ds;
        s.v[k] = in ? *reinterpret_cast<const float4*>(S + r * ds + c)
                    : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if constexpr (kDot) {
          if (in) {
            const float4 o = *reinterpret_cast<const float4*>(O + r * ds + c);
            out.dot += dot4(s.v[k], o);
          }
        }
      }
      out.sc = s.template split_scaled<T>(dst, red);
    } else {  // element by element (rare shapes): the values read twice, to keep registers free
      constexpr int kW = C / 2, kIt = R * kW / kTileThreads;
      static_assert(R * kW % kTileThreads == 0, "the block must tile the state");
      const Slots<kW> sl;
      auto get = [&](const float* M, int r, int c) {
        return r < hd && c < ds ? M[r * ds + c] : 0.0f;
      };
      float mx = 0.0f;
#pragma unroll 1
      for (int k = 0; k < kIt; ++k) {
        const int r = sl.row(k), c = sl.col * 2;
        const float v0 = get(S, r, c), v1 = get(S, r, c + 1);
        if constexpr (kDot) out.dot += dot2(v0, v1, get(O, r, c), get(O, r, c + 1));
        mx = fmaxf(mx, fmaxf(fabsf(v0), fabsf(v1)));
      }
      post_max<T>(mx, red);
      __syncthreads();
      out.sc = scale_of<T, kTileThreads / 32>(red);
#pragma unroll 1
      for (int k = 0; k < kIt; ++k) {
        const int r = sl.row(k), c = sl.col * 2;
        put_split<T>(dst, kLo, at(r, c), get(S, r, c), get(S, r, c + 1), out.sc);
      }
    }
  } else if (vec) {
    auto get = [&](const float* M, int r, int c) {
      return r < hd && c < ds ? *reinterpret_cast<const float4*>(M + r * ds + c)
                              : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    };
    batched<R, C, 4, true>(
        [&](int r, int c) {
          return Pack<float4, 2>{{get(S, r, c), kDot ? get(O, r, c) : float4{}}};
        },
        [&](int r, int c, const Pack<float4, 2>& v) {
          const float4 m = v.v[0];
          put_split4<T>(dst, kLo, at(r, c), m);
          if constexpr (kDot) {
            const float4 o = v.v[1];
            out.dot += dot4(m, o);
          }
        });
  } else {
    auto get = [&](const float* M, int r, int c) {
      const bool in = r < hd;
      return make_float2(in && c < ds ? M[r * ds + c] : 0.0f,
                         in && c + 1 < ds ? M[r * ds + c + 1] : 0.0f);
    };
    batched<R, C, 2, true>(
        [&](int r, int c) {
          return Pack<float2, 2>{{get(S, r, c), kDot ? get(O, r, c) : float2{}}};
        },
        [&](int r, int c, const Pack<float2, 2>& v) {
          put_split<T>(dst, kLo, at(r, c), v.v[0].x, v.v[0].y);
          if constexpr (kDot) out.dot += dot2(v.v[0].x, v.v[0].y, v.v[1].x, v.v[1].y);
        });
  }
  return out;
}

}  // namespace m3::gpu::tcf
