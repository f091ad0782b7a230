// Output gating (F7) and its backward (B7). MODEL.md §4 F7, §6.2 B7; the same formulas,
// operation for operation, as reference/gating.cpp. s = σ(z), silu(z) = z·s,
// silu'(z) = s·(1 + z·(1 − s)), d = h·hd + p, w = norm_gate_weight.
//
// (a) is_outproj_norm = false, elementwise:
//     gated = y·silu(z);   d_y = d_gated·silu(z);   d_z = d_gated·y·silu'(z)
// (b) is_outproj_norm = true, RMSNormGated per (r, h) over the head's hd channels:
//     rstd[r,h]  = 1 / sqrt( (1/hd) Σ_p y[r,d]² + ε ),  ε = 1e-5   (saved as gated_rms_vals)
//     gated[r,d] = y[r,d]·(rstd·w[d])·silu(z[r,d])
//   backward, ŷ = y·rstd, g = d_gated·silu(z):
//     d_z  = d_gated·ŷ·w·silu'(z)
//     c1   = (1/hd) Σ_p ŷ·w·g;   d_y = (w·g − ŷ·c1)·rstd
//     d w[d] += Σ_r d_gated·silu(z)·y·rstd                 (colsum_rows, fixed order)
// Shapes: y, z, gated, d_gated, d_y, d_z typed T [BT, di]; gated_rms_vals [BT, nh]; w [di].
// gated, d_y, d_z are rounded to T once, at their store (the reference's store_typed after F7/B7).
// B7 can write gated again (GatingBwd::gated): the production layout keeps no gated per layer,
// and B8's weight gradient reads this copy. It is F7's expression (for (b) norm_gate, the one
// function of both) on the same inputs (for (b) the saved rstd, which is the float F7 used), so
// it has F7's bits.
// Vector access: V = 16 / sizeof(T) values per access of a typed tensor (16 bytes; f32 w in
// two) when the pointers are 16-byte aligned (for (b) also hd % V == 0), else V = 1.
// (a) runs one thread per vector of V values (the last n mod V values one per thread).
// (b) runs one (r, h) row per warp segment of L = min(32, pow2 ≥ hd / V) lanes (reduce.cuh), so
// any headdim works and short heads share a warp; lane l takes the V values at l·V, then at
// l·V + L·V, …. With V > 1 the sums for rstd and c1 thus add values in another fixed order than
// with V = 1 (a lane's vectors in ascending order, then the lanes by the butterfly).
// z (and d_z) may have a row stride ldz ≠ di: in the production layout they are column views of
// proj / d_proj (row stride ip). Element i = r·di + c of the [BT, di] tensors is then z's
// r·ldz + c (ZAt). (a) takes vectors only inside z's rows (else one value at a time: the same
// bits, each value is on its own); (b) keeps V and moves z's whole V-groups one value at a time
// when z's rows do not keep its vectors aligned (load_group / store_group with kZV false), so
// that its sums' order never depends on z's layout.
#include <initializer_list>
#include <type_traits>

#include "activations.cuh"
#include "convert.cuh"
#include "fast_div.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

constexpr float kEpsF = static_cast<float>(ref::kEps);

// (b)'s gate, y·(rstd·w)·silu(z), before its rounding to T: the one expression of F7 and of
// B7's rewrite of gated (from the saved rstd), so that the rewrite has F7's bits.
__device__ __forceinline__ float norm_gate(float y, float rstd, float w, float z) {
  return y * (rstd * w) * silu(z);
}

// Where element i = r·di + c of a [BT, di] tensor lies in z / d_z: r·ldz + c.
struct ZAt {
  FastDiv row;  // i → r (divisor di)
  Idx gap;      // ldz − di
  __device__ __forceinline__ Idx operator()(Idx i) const { return gap ? i + row.div(i) * gap : i; }
};
ZAt z_at(const Dims& d, Idx ldz) {
  return ZAt{FastDiv(d.di), row_stride(ldz, d.di, "gpu::gating", "z") - d.di};
}

// (a): values [0, nv·V) in vectors of V, then [nv·V, n) one per thread.
template <class T>
__global__ void __launch_bounds__(kThreads)
gate_silu_forward_kernel(Idx n, Idx nv, const T* y, const T* z, ZAt za, T* gated) {
  constexpr int V = 16 / sizeof(T);
  const Idx first = blockIdx.x * Idx(kThreads) + threadIdx.x, stride = Idx(gridDim.x) * kThreads;
  for (Idx i = first * V; i < nv * V; i += stride * V) {
    float yv[V], zv[V];
    load_n<V, Use::kArith>(y + i, yv);
    load_n<V, Use::kArith>(z + za(i), zv);
#pragma unroll
    for (int e = 0; e < V; ++e) yv[e] = yv[e] * silu(zv[e]);
    store_n<V>(gated + i, yv);
  }
  for (Idx i = nv * V + first; i < n; i += stride)
    gated[i] = from_float<T>(to_float(y[i]) * silu(to_float(z[za(i)])));
}

template <class T, int L, int V, bool kZV>
__global__ void __launch_bounds__(kThreads)
gate_norm_forward_kernel(Idx units, Idx hd, Idx nh, const T* y, const T* z, ZAt za,
                         const float* w, T* gated, float* rstd_out) {
  using S = Seg<L>;
  for (Idx w0 = S::first(); w0 < units; w0 += S::stride()) {
    const Idx unit = w0 + S::seg();  // r·nh + h
    const bool on = unit < units;
    const Idx row = unit * hd;
    float ss = 0.0f;
    if (on)
      for (Idx p = S::lane() * V; p < hd; p += L * V) {
        float yv[V];
        load_vec<V, Use::kArith>(y + row + p, yv);
#pragma unroll
        for (int e = 0; e < V; ++e) ss += yv[e] * yv[e];
      }
    ss = segment_sum<L>(ss);
    if (!on) continue;
    const float rstd = 1.0f / sqrtf(ss / static_cast<float>(hd) + kEpsF);
    if (S::lane() == 0) rstd_out[unit] = rstd;
    const float* wh = w + (unit % nh) * hd;
    for (Idx p = S::lane() * V; p < hd; p += L * V) {
      float yv[V], zv[V], wv[V];
      load_vec<V, Use::kArith>(y + row + p, yv);
      load_group<kZV, Use::kArith>(z + za(row + p), V, zv);
      load_vec(wh + p, wv);
#pragma unroll
      for (int e = 0; e < V; ++e) yv[e] = norm_gate(yv[e], rstd, wv[e], zv[e]);
      store_vec(gated + row + p, yv);
    }
  }
}

// kG: gated written again as well (p.gated), with the forward kernel's product y·silu(z).
template <class T, bool kG>
__global__ void __launch_bounds__(kThreads)
gate_silu_backward_kernel(Idx n, Idx nv, GatingBwd<T> p, ZAt za) {
  constexpr int V = 16 / sizeof(T);
  const Idx first = blockIdx.x * Idx(kThreads) + threadIdx.x, stride = Idx(gridDim.x) * kThreads;
  for (Idx i = first * V; i < nv * V; i += stride * V) {
    float dg[V], zv[V], yv[V];
    load_n<V, Use::kArith>(p.d_gated + i, dg);
    load_n<V, Use::kArith>(p.z + za(i), zv);
    load_n<V, Use::kArith>(p.y + i, yv);
    float dy[V], dz[V];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      dy[e] = dg[e] * silu(zv[e]);
      dz[e] = dg[e] * yv[e] * silu_grad(zv[e]);
    }
    store_n<V>(p.d_y + i, dy);
    store_n<V>(p.d_z + za(i), dz);
    if constexpr (kG) {
#pragma unroll
      for (int e = 0; e < V; ++e) yv[e] = yv[e] * silu(zv[e]);
      store_n<V>(p.gated + i, yv);
    }
  }
  for (Idx i = nv * V + first; i < n; i += stride) {
    const Idx iz = za(i);
    const float dg = to_float(p.d_gated[i]), zi = to_float(p.z[iz]), yi = to_float(p.y[i]);
    p.d_y[i] = from_float<T>(dg * silu(zi));
    p.d_z[iz] = from_float<T>(dg * yi * silu_grad(zi));
    if constexpr (kG) p.gated[i] = from_float<T>(yi * silu(zi));
  }
}

// kG: gated written again as well (p.gated), with the forward kernel's y·(rstd·w)·silu(z) from
// the saved rstd (the value the forward computed and used).
template <class T, int L, int V, bool kZV, bool kG>
__global__ void __launch_bounds__(kThreads)
gate_norm_backward_kernel(Idx units, Idx hd, Idx nh, GatingBwd<T> p, ZAt za) {
  using S = Seg<L>;
  for (Idx w0 = S::first(); w0 < units; w0 += S::stride()) {
    const Idx unit = w0 + S::seg();
    const bool on = unit < units;
    const Idx row = unit * hd;
    const float rstd = on ? p.gated_rms_vals[unit] : 0.0f;
    const float* wh = p.norm_gate_weight + (unit % nh) * hd;
    // The lane's group at q of d_gated, z, y and the weight (both passes read the same four).
    auto load4 = [&](Idx q, float (&dg)[V], float (&zv)[V], float (&yv)[V], float (&wv)[V]) {
      load_vec<V, Use::kArith>(p.d_gated + row + q, dg);
      load_group<kZV, Use::kArith>(p.z + za(row + q), V, zv);
      load_vec<V, Use::kArith>(p.y + row + q, yv);
      load_vec(wh + q, wv);
    };
    float c1 = 0.0f;
    if (on)
      for (Idx q = S::lane() * V; q < hd; q += L * V) {
        float dg[V], zv[V], yv[V], wv[V], dz[V];
        load4(q, dg, zv, yv, wv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          const float yh = yv[e] * rstd, gg = dg[e] * silu(zv[e]);
          dz[e] = dg[e] * yh * wv[e] * silu_grad(zv[e]);
          c1 += yh * wv[e] * gg;
        }
        store_group<kZV>(p.d_z + za(row + q), V, dz);
        if constexpr (kG) {
#pragma unroll
          for (int e = 0; e < V; ++e) yv[e] = norm_gate(yv[e], rstd, wv[e], zv[e]);
          store_vec(p.gated + row + q, yv);
        }
      }
    c1 = segment_sum<L>(c1) / static_cast<float>(hd);
    if (!on) continue;
#pragma unroll 1  // unrolled, ptxas spills 4 bytes in the bf16 instantiation
    for (Idx q = S::lane() * V; q < hd; q += L * V) {
      float dg[V], zv[V], yv[V], wv[V], dy[V];
      load4(q, dg, zv, yv, wv);
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float yh = yv[e] * rstd, gg = dg[e] * silu(zv[e]);
        // w·g − ŷ·c1 in fma_diff's rounding (common.cuh): the form ptxas had chosen in every
        // instantiation, so every instantiation the same bits.
        dy[e] = fma_diff(wv[e], gg, yh, c1) * rstd;
      }
      store_vec(p.d_y + row + q, dy);
    }
  }
}

// d norm_gate_weight term (r, d) = d_gated·silu(z)·y·rstd[r, d / hd]
template <class T>
struct GateWeightTerm {
  const T *d_gated, *z, *y;
  const float* rstd;
  Idx di, hd, nh, ldz;
  struct Term {
    T d_gated, z, y;
    float rstd;
  };
  __device__ Term load(Idx r, Idx d) const {
    const Idx i = r * di + d;
    return {d_gated[i], z[r * ldz + d], y[i], rstd[r * nh + d / hd]};
  }
  __device__ float add_to(float acc, const Term& t) const {
    return __fmaf_rn(to_float(t.d_gated) * silu(to_float(t.z)) * to_float(t.y), t.rstd, acc);
  }
};

void check_gating_dims(const Dims& d, const char* where) {
  M3_REQUIRE(d.BT >= 0 && d.hd >= 1 && d.nh >= 1 && d.di == d.nh * d.hd, where, "bad dims",
             "BT=", d.BT, " di=", d.di, " nh=", d.nh, " hd=", d.hd);
}

// Vectors of V = 16 / sizeof(T) values an (a) kernel takes: n / V if every pointer is 16-byte
// aligned, else 0; and its blocks (one thread per vector and per leftover value).
template <class T>
Idx silu_vectors(Idx n, std::initializer_list<const void*> ptrs, const ZAt& za, Idx di) {
  constexpr Idx V = 16 / sizeof(T);
  for (const void* q : ptrs)
    if (!is_aligned(q, 16)) return 0;
  if (za.gap && (di % V != 0 || za.gap % V != 0)) return 0;  // vectors inside z's rows, aligned
  return n / V;
}
template <class T>
unsigned int silu_blocks(Idx n, Idx nv) {
  return grid_for(std::max(nv, n - nv * static_cast<Idx>(16 / sizeof(T))), kThreads);
}

// Calls f(integral_constant L, integral_constant V, integral_constant kZV) for the (b) kernels:
// V = 16 / sizeof(T) when hd % V == 0 and every pointer of `ptrs` (all but z, d_z) is 16-byte
// aligned, else 1; L = segment_lanes(hd / V); kZV: z and d_z (`zs`) keep V-value vectors
// aligned at z's row stride (di + zgap) too.
template <class T, class F>
void with_norm_layout(Idx hd, Idx zgap, std::initializer_list<const void*> ptrs,
                      std::initializer_list<const void*> zs, F&& f) {
  constexpr int V = 16 / sizeof(T);
  bool vec = hd % V == 0;
  for (const void* q : ptrs) vec = vec && is_aligned(q, 16);
  bool zvec = vec && zgap % V == 0;
  for (const void* q : zs) zvec = zvec && is_aligned(q, 16);
  with_lanes(segment_lanes(vec ? hd / V : hd), [&](auto lanes) {
    if (!vec)
      f(lanes, std::integral_constant<int, 1>{}, std::true_type{});
    else if (zvec)
      f(lanes, std::integral_constant<int, V>{}, std::true_type{});
    else
      f(lanes, std::integral_constant<int, V>{}, std::false_type{});
  });
}

}  // namespace

template <class T>
void gating_forward(cudaStream_t s, const Dims& d, const T* y, const T* z,
                    const float* norm_gate_weight, T* gated, float* gated_rms_vals, Idx ldz) {
  const char* where = "gpu::gating_forward";
  check_gating_dims(d, where);
  const Idx n = d.BT * d.di, units = d.BT * d.nh;
  if (n == 0) return;
  const ZAt za = z_at(d, ldz);
  if (!d.outproj_norm) {
    const Idx nv = silu_vectors<T>(n, {y, z, gated}, za, d.di);
    gate_silu_forward_kernel<T><<<silu_blocks<T>(n, nv), kThreads, 0, s>>>(n, nv, y, z, za, gated);
    M3_LAUNCH_CHECK();
    return;
  }
  M3_REQUIRE(norm_gate_weight && gated_rms_vals, where,
             "is_outproj_norm needs norm_gate_weight and gated_rms_vals", "a pointer is null");
  with_norm_layout<T>(d.hd, za.gap, {y, gated, norm_gate_weight}, {z},
                      [&](auto lanes, auto vec, auto zvec) {
    constexpr int L = decltype(lanes)::value, V = decltype(vec)::value;
    constexpr bool kZV = decltype(zvec)::value;
    gate_norm_forward_kernel<T, L, V, kZV>
        <<<grid_for(units, Seg<L>::kPerBlock), kThreads, 0, s>>>(
        units, d.hd, d.nh, y, z, za, norm_gate_weight, gated, gated_rms_vals);
  });
  M3_LAUNCH_CHECK();
}

template <class T>
void gating_backward(cudaStream_t s, const Dims& d, const GatingBwd<T>& p, Scratch scratch) {
  const char* where = "gpu::gating_backward";
  check_gating_dims(d, where);
  const Idx n = d.BT * d.di, units = d.BT * d.nh;
  const ZAt za = z_at(d, p.ldz);
  if (!d.outproj_norm) {
    if (n == 0) return;
    const Idx nv = silu_vectors<T>(n, {p.y, p.z, p.d_gated, p.d_y, p.d_z, p.gated}, za, d.di);
    auto k = p.gated ? gate_silu_backward_kernel<T, true> : gate_silu_backward_kernel<T, false>;
    k<<<silu_blocks<T>(n, nv), kThreads, 0, s>>>(n, nv, p, za);
    M3_LAUNCH_CHECK();
    return;
  }
  M3_REQUIRE(p.norm_gate_weight && p.gated_rms_vals && p.d_norm_gate_weight, where,
             "is_outproj_norm needs norm_gate_weight, gated_rms_vals and d_norm_gate_weight",
             "a pointer is null");
  require_scratch(scratch, colsum_scratch_floats(d.BT, d.di), where);
  if (n == 0) return;
  // The vector width V sets the order of c1's sum, so it must not depend on where gated lies:
  // gated is held to the 16 bytes every backbone buffer has instead of joining the list.
  M3_REQUIRE(!p.gated || is_aligned(p.gated, 16), where, "gated is not 16-byte aligned",
             "its rewrite may not change the vector width of d_y's sums");
  with_norm_layout<T>(d.hd, za.gap, {p.y, p.d_gated, p.d_y, p.norm_gate_weight},
                      {p.z, p.d_z}, [&](auto lanes, auto vec, auto zvec) {
    constexpr int L = decltype(lanes)::value, V = decltype(vec)::value;
    constexpr bool kZV = decltype(zvec)::value;
    auto k = p.gated ? gate_norm_backward_kernel<T, L, V, kZV, true>
                     : gate_norm_backward_kernel<T, L, V, kZV, false>;
    k<<<grid_for(units, Seg<L>::kPerBlock), kThreads, 0, s>>>(units, d.hd, d.nh, p, za);
  });
  M3_LAUNCH_CHECK();
  colsum_rows(s, d.BT, d.di,
              GateWeightTerm<T>{p.d_gated, p.z, p.y, p.gated_rms_vals, d.di, d.hd, d.nh,
                                d.di + za.gap},
              p.d_norm_gate_weight, true, scratch, where);
}

#define M3_INSTANTIATE(T)                                                                  \
  template void gating_forward<T>(cudaStream_t, const Dims&, const T*, const T*, const float*, \
                                  T*, float*, Idx);                                        \
  template void gating_backward<T>(cudaStream_t, const Dims&, const GatingBwd<T>&, Scratch);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
