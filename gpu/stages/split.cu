// The 8-way split of in_proj's output with its fused activations (F3), the SSM coefficients
// (F5b), and their backward (abg glue, B5b, B3). MODEL.md §2.1, §4 F3/F5b, §6.2 B5b/B3,
// §12.1–2; the same formulas, operation for operation, as reference/split.cpp.
//
// F3, per row r, the columns of proj [BT, ip] in this order:
//   [ z (di) | x (di) | b_raw (ng·ds) | c_raw (ng·ds) | dd_dt_raw (nh) | dd_a_raw (nh) |
//     trap_raw (nh) | angles_raw (na) ]
//   dt    = softplus(dd_dt_raw + dt_bias)     softplus(v) = v if v > 20 else log(1 + eᵛ)
//   a_val = min(−φ(dd_a_raw), −a_floor)       φ(v) = 1 + v (v ≥ 0), 1/(1 − v) (v < 0)
//   trap  = σ(trap_raw)
//   z, x, b_raw, c_raw are copied in the storage type T; the raw logits are stored f32.
// F5b, per (r, h):  alpha = exp(a_val·dt),  beta = alpha·dt·(1 − trap),  gamma = trap·dt
//   alpha is exp of the f32 product a_val·dt taken in double and rounded once to f32: the
//   correctly rounded value (but where double's exp lands within its own error of an f32
//   midpoint, a few arguments in 2²⁸), as the reference's float exp gives it to within 0.502 ulp.
//   Not expf: its error (up to 2 ulp) is a smooth function of the argument, so it keeps one sign
//   over the slowly varying a_val·dt of a head, and the sequential scan multiplies thousands of
//   alphas into each state: at T 4096 that bias makes the f32 seq output's error grow along t
//   (docs/HARNESS.md, "One biased decay"). The chunked scan forms its decays from sums of
//   a_val·dt and reads alpha nowhere, so this costs its path nothing (its capture aside).
// abg glue (sequential path): d_adt_total = dα·α + dβ·β,  d_dt_direct = dβ·α·(1 − trap) + dγ·trap,
//   d_trap_sig = −dβ·α·dt + dγ·dt
// B5b, per (r, h):
//   d_dt_tot   = d_adt_total·a_val + d_dt_direct + d_dt_angle
//   d_dd_dt    = d_dt_tot · softplus'(dd_dt_raw + dt_bias)   softplus' = 1 if v > 20 else σ(v)
//   d_trap_raw = d_trap_sig · trap·(1 − trap)
//   d_dd_a     = 0 if −φ(dd_a_raw) > −a_floor (clamp active; equality passes the gradient)
//                else d_adt_total·dt·(−φ'(dd_a_raw)),  φ'(v) = 1 (v ≥ 0), 1/(1 − v)² (v < 0)
//   d dt_bias += Σ_r d_dd_dt                             (colsum_rows, fixed order)
// B3: d_proj [BT, ip] = [d_z | d_x | d_b_raw | d_c_raw | d_dd_dt | d_dd_a | d_trap_raw |
//     d_angles_raw] in the column order above (f32 parts stored as T).
// Production layout (registry.hpp Life::Columns): z, x, b_raw, c_raw are read in place as
// column views of proj (row stride ip) and their gradients written in place into d_proj by
// B7, B6, B4c, so F3 and B3 move only the f32 parts (the typed pointers null). Fused runs go
// one step further: B5b and B5a write the f32 parts into d_proj themselves (ProjCols,
// split_f32_cols; the rounding B3 applies), and B3 is not launched at all.
// Per-head tensors are [BT, nh]. Nothing is saved beyond the outputs listed.
// Memory access: F3/B3 copy the typed parts (as bits) in 16-byte vectors and the f32 parts one
// value at a time; F5b, abg glue and B5b use float4. Each falls back to one value per access
// where the widths or the pointers do not allow vectors.
#include <algorithm>
#include <initializer_list>

#include "activations.cuh"
#include "convert.cuh"
#include "fast_div.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

// Column offsets of the split (§2.1) and the widths of its parts.
struct SplitCols {
  Idx di, bc, nh, na, ip;          // widths: z/x, b/c, per-head parts, angles; row length
  Idx x, b, c, ddt, dda, trap, ang;  // first column of each part (z starts at 0)
};

SplitCols split_cols(const Dims& d) {
  SplitCols c{};
  c.di = d.di;
  c.bc = d.ng * d.ds;
  c.nh = d.nh;
  c.na = d.na;
  c.ip = d.ip;
  c.x = d.di;
  c.b = 2 * d.di;
  c.c = c.b + c.bc;
  c.ddt = c.c + c.bc;
  c.dda = c.ddt + d.nh;
  c.trap = c.dda + d.nh;
  c.ang = c.trap + d.nh;
  return c;
}

void check_split_dims(const Dims& d, const char* where) {
  const SplitCols c = split_cols(d);
  M3_REQUIRE(d.BT >= 0 && d.di >= 1 && d.nh >= 1 && d.ds >= 1 && d.ng >= 1 && d.na >= 0, where,
             "bad dims", "BT=", d.BT, " di=", d.di, " nh=", d.nh, " ds=", d.ds, " ng=", d.ng,
             " na=", d.na);
  M3_REQUIRE(c.ang + c.na == d.ip, where, "in_proj width does not match the split",
             "ip=", d.ip, ", expected 2·di + 2·ng·ds + 3·nh + na = ", c.ang + c.na);
}

// Row work of F3 / B3, in items: the typed parts z | x | b_raw | c_raw (columns [0, ddt)) as
// vectors of V columns, then one item per f32 column (dd_dt … angles, columns [ddt, ip)).
// V = kVec<T> (16 bytes of T) when the typed widths, the row length and the typed pointers
// allow, else 1. The items [j_lo, items) of every row are one flat range (RowItems: item e is
// row e / m, item j_lo + e mod m), so that a short row (the column views leave ≈ 160 items)
// does not leave most of a block idle; each thread loads its kUnroll items (a grid apart)
// before it stores any. Typed parts are bit copies.
template <class T>
constexpr int kVec = 16 / sizeof(T);
constexpr int kUnroll = 4;

struct RowItems {
  Idx j_lo, total;  // first item of a row; rows · m
  FastDiv m;        // items per row
  __device__ __forceinline__ void at(Idx e, Idx& r, Idx& j) const {
    r = m.div(e);
    j = j_lo + (e - r * m.divisor());
  }
};
RowItems row_items(Idx rows, Idx items, Idx j_lo) {
  return RowItems{j_lo, rows * (items - j_lo), FastDiv(std::max<Idx>(items - j_lo, 1))};
}

// Whether V-column vectors stay inside one typed part and every row starts V-aligned.
bool split_vectorizable(const SplitCols& c, Idx v) {
  return c.di % v == 0 && c.bc % v == 0 && c.ip % v == 0;
}

// Whether every pointer is 16-byte aligned (a null pointer, an empty part, counts as aligned).
template <class... P>
bool aligned16(const P*... p) {
  return (is_aligned(p, 16) && ...);
}

// F3 outputs of the f32 column j ∈ [ddt, ip) of row r, whose proj value is raw.
template <class T>
__device__ __forceinline__ void split_store_f32(Idx r, Idx j, const SplitCols& c, float a_floor,
                                                const SplitFwd<T>& p, float raw) {
  if (j < c.dda) {
    const Idx h = j - c.ddt, i = r * c.nh + h;
    p.dd_dt_raw[i] = raw;
    p.dt[i] = softplus(raw + p.dt_bias[h]);
  } else if (j < c.trap) {
    const Idx i = r * c.nh + (j - c.dda);
    p.dd_a_raw[i] = raw;
    const float a = -heavy_tail(raw), f = -a_floor;
    p.a_val[i] = f < a ? f : a;  // std::min(a, f)
  } else if (j < c.ang) {
    const Idx i = r * c.nh + (j - c.trap);
    p.trap_raw[i] = raw;
    p.trap[i] = sigmoid(raw);
  } else {
    p.angles_raw[r * c.na + (j - c.ang)] = raw;
  }
}

// Typed parts null: their columns stay in proj (the readers' column views).
template <int V, class T>
__global__ void __launch_bounds__(kThreads)
split_forward_kernel(SplitCols c, RowItems ri, float a_floor, SplitFwd<T> p) {
  using Vec = VecOf<T, V>;
  const Idx nv = c.ddt / V, stride = Idx(gridDim.x) * kThreads;
  for (Idx e0 = Idx(blockIdx.x) * kThreads + threadIdx.x; e0 < ri.total; e0 += kUnroll * stride) {
    Vec v[kUnroll];  // a typed vector, or in e[0] the value of an f32 column
    Idx r[kUnroll], j[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Idx e = e0 + u * stride;
      if (e >= ri.total) continue;
      ri.at(e, r[u], j[u]);
      const T* pr = p.proj + r[u] * c.ip;
      if (j[u] < nv) v[u] = reinterpret_cast<const Vec*>(pr)[j[u]];
      else v[u].e[0] = pr[c.ddt + (j[u] - nv)];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (e0 + u * stride >= ri.total) continue;
      const Idx k = j[u] * V;
      if (j[u] < nv) {
        T* dst = k < c.x   ? p.z + r[u] * c.di + k
                 : k < c.b ? p.x + r[u] * c.di + (k - c.x)
                 : k < c.c ? p.b_raw + r[u] * c.bc + (k - c.b)
                           : p.c_raw + r[u] * c.bc + (k - c.c);
        *reinterpret_cast<Vec*>(dst) = v[u];
      } else {
        split_store_f32(r[u], c.ddt + (j[u] - nv), c, a_floor, p, to_float(v[u].e[0]));
      }
    }
  }
}

// F5b, abg glue and B5b: V consecutive elements per thread (V = 4 when the sizes and the
// pointers allow, else 1), every input loaded before any store.
template <int V>
__global__ void __launch_bounds__(kThreads)
abg_forward_kernel(Idx n, const float* a_val, const float* dt, const float* trap, float* alpha,
                   float* beta, float* gamma) {
  for (Idx i = (blockIdx.x * Idx(kThreads) + threadIdx.x) * V; i < n;
       i += Idx(gridDim.x) * kThreads * V) {
    float av[V], dti[V], tr[V], al[V], be[V], ga[V];
    load_n<V>(a_val + i, av);
    load_n<V>(dt + i, dti);
    load_n<V>(trap + i, tr);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      al[k] = static_cast<float>(exp(static_cast<double>(av[k] * dti[k])));
      be[k] = al[k] * dti[k] * (1.0f - tr[k]);
      ga[k] = tr[k] * dti[k];
    }
    store_n<V>(alpha + i, al);
    store_n<V>(beta + i, be);
    store_n<V>(gamma + i, ga);
  }
}

template <int V>
__global__ void __launch_bounds__(kThreads) abg_backward_kernel(Idx n, AbgBwd p) {
  for (Idx i = (blockIdx.x * Idx(kThreads) + threadIdx.x) * V; i < n;
       i += Idx(gridDim.x) * kThreads * V) {
    float al[V], be[V], dt[V], tr[V], da[V], db[V], dg[V], o_adt[V], o_dt[V], o_trap[V];
    load_n<V>(p.alpha + i, al);
    load_n<V>(p.beta + i, be);
    load_n<V>(p.dt + i, dt);
    load_n<V>(p.trap + i, tr);
    load_n<V>(p.d_alpha + i, da);
    load_n<V>(p.d_beta + i, db);
    load_n<V>(p.d_gamma + i, dg);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      o_adt[k] = da[k] * al[k] + db[k] * be[k];
      // The two gradients that share d_β·α with their roundings written out, in the forms
      // nvcc and ptxas choose for the plain expressions (SASS of V = 1 and V = 4; nvcc
      // leaves o_trap's sum to ptxas): d_β·α rounded once; o_dt fuses it with (1 − λ) and adds
      // the rounded d_γ·λ; o_trap is fma_diff's d_γ·dt − (d_β·α)·dt.
      const float dba = __fmul_rn(db[k], al[k]);
      o_dt[k] = __fmaf_rn(dba, 1.0f - tr[k], __fmul_rn(dg[k], tr[k]));
      o_trap[k] = fma_diff(dg[k], dt[k], dba, dt[k]);
    }
    store_n<V>(p.d_adt_total + i, o_adt);
    store_n<V>(p.d_dt_direct + i, o_dt);
    store_n<V>(p.d_trap_sig + i, o_trap);
  }
}

// nh % V == 0, so the V elements of a vector are heads h .. h + V − 1 of one row.
template <int V>
__global__ void __launch_bounds__(kThreads)
activations_backward_kernel(Idx n, Idx nh, float a_floor, ActBwd p, bool cols4) {
  for (Idx i = (blockIdx.x * Idx(kThreads) + threadIdx.x) * V; i < n;
       i += Idx(gridDim.x) * kThreads * V) {
    const Idx h = i % nh;
    float d_adt[V], d_angle[V], a_val[V], d_direct[V], dd_dt[V], bias[V], tr[V], d_sig[V],
        dd_a[V], dt[V];
    load_n<V>(p.d_adt_total + i, d_adt);
    if (p.d_dt_angle) {
      load_n<V>(p.d_dt_angle + i, d_angle);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) d_angle[k] = 0.0f;
    }
    load_n<V>(p.a_val + i, a_val);
    load_n<V>(p.d_dt_direct + i, d_direct);
    load_n<V>(p.dd_dt_raw + i, dd_dt);
#pragma unroll
    for (int k = 0; k < V; ++k) bias[k] = p.dt_bias[h + k];
    load_n<V>(p.trap + i, tr);
    load_n<V>(p.d_trap_sig + i, d_sig);
    load_n<V>(p.dd_a_raw + i, dd_a);
    load_n<V>(p.dt + i, dt);
    float o_dt[V], o_trap[V], o_a[V];
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float d_dt_tot = d_adt[k] * a_val[k] + d_direct[k] + d_angle[k];
      o_dt[k] = d_dt_tot * softplus_grad(dd_dt[k] + bias[k]);
      o_trap[k] = d_sig[k] * tr[k] * (1.0f - tr[k]);
      const bool clamped = -heavy_tail(dd_a[k]) > -a_floor;
      o_a[k] = clamped ? 0.0f : d_adt[k] * dt[k] * (-heavy_tail_grad(dd_a[k]));
    }
    store_n<V>(p.d_dd_dt + i, o_dt);
    store_n<V>(p.d_trap_raw + i, o_trap);
    store_n<V>(p.d_dd_a + i, o_a);
    if (p.d_dd_dt_cols.p) {  // production: d_proj's columns too (all three or none)
      const Idx r = i / nh;
      if constexpr (V == 4) {
        if (cols4) {  // h % 4 == 0 (nh % 4 == 0): one access per output
          store_cols4(p.d_dd_dt_cols, r, h, o_dt);
          store_cols4(p.d_dd_a_cols, r, h, o_a);
          store_cols4(p.d_trap_raw_cols, r, h, o_trap);
          continue;
        }
      }
#pragma unroll
      for (int k = 0; k < V; ++k) {
        store_col(p.d_dd_dt_cols, r, h + k, o_dt[k]);
        store_col(p.d_dd_a_cols, r, h + k, o_a[k]);
        store_col(p.d_trap_raw_cols, r, h + k, o_trap[k]);
      }
    }
  }
}

// B3 value of the f32 column j ∈ [ddt, ip) of row r.
template <class T>
__device__ __forceinline__ float split_load_f32(Idx r, Idx j, const SplitCols& c,
                                                const SplitBwd<T>& p) {
  if (j < c.dda) return p.d_dd_dt[r * c.nh + (j - c.ddt)];
  if (j < c.trap) return p.d_dd_a[r * c.nh + (j - c.dda)];
  if (j < c.ang) return p.d_trap_raw[r * c.nh + (j - c.trap)];
  return p.d_angles_raw[r * c.na + (j - c.ang)];
}

// Items of a d_proj row as in the forward.
// Typed parts null: d_proj's typed columns were written by B7, B6 and B4c.
template <int V, class T>
__global__ void __launch_bounds__(kThreads)
split_backward_kernel(SplitCols c, RowItems ri, SplitBwd<T> p) {
  using Vec = VecOf<T, V>;
  const Idx nv = c.ddt / V, stride = Idx(gridDim.x) * kThreads;
  for (Idx e0 = Idx(blockIdx.x) * kThreads + threadIdx.x; e0 < ri.total; e0 += kUnroll * stride) {
    Vec v[kUnroll];  // a typed vector, or in e[0] the rounded value of an f32 column
    Idx r[kUnroll], j[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const Idx e = e0 + u * stride;
      if (e >= ri.total) continue;
      ri.at(e, r[u], j[u]);
      const Idx k = j[u] * V;
      if (j[u] < nv) {
        const T* src = k < c.x   ? p.d_z + r[u] * c.di + k
                       : k < c.b ? p.d_x + r[u] * c.di + (k - c.x)
                       : k < c.c ? p.d_b_raw + r[u] * c.bc + (k - c.b)
                                 : p.d_c_raw + r[u] * c.bc + (k - c.c);
        v[u] = *reinterpret_cast<const Vec*>(src);
      } else {
        v[u].e[0] = from_float<T>(split_load_f32(r[u], c.ddt + (j[u] - nv), c, p));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (e0 + u * stride >= ri.total) continue;
      T* out = p.d_proj + r[u] * c.ip;
      if (j[u] < nv) reinterpret_cast<Vec*>(out)[j[u]] = v[u];
      else out[c.ddt + (j[u] - nv)] = v[u].e[0];
    }
  }
}

}  // namespace

template <class T>
void split_forward(cudaStream_t s, const Dims& d, const SplitFwd<T>& p) {
  check_split_dims(d, "gpu::split_forward");
  M3_REQUIRE(!p.z == !p.x && !p.z == !p.b_raw && !p.z == !p.c_raw, "gpu::split_forward",
             "z, x, b_raw, c_raw are copied together or left in proj together",
             "some of them are null");
  if (d.BT == 0) return;
  const SplitCols c = split_cols(d);
  const bool vec =
      split_vectorizable(c, kVec<T>) && aligned16(p.proj, p.z, p.x, p.b_raw, p.c_raw);
  const Idx V = vec ? kVec<T> : 1, items = c.ddt / V + (c.ip - c.ddt);
  const RowItems ri = row_items(d.BT, items, p.z ? 0 : c.ddt / V);
  const auto kernel = vec ? split_forward_kernel<kVec<T>, T> : split_forward_kernel<1, T>;
  kernel<<<grid_for(ri.total, kThreads * kUnroll), kThreads, 0, s>>>(
      c, ri, static_cast<float>(d.a_floor), p);
  M3_LAUNCH_CHECK();
}

void abg_forward(cudaStream_t s, const Dims& d, const float* a_val, const float* dt,
                 const float* trap, float* alpha, float* beta, float* gamma) {
  const Idx n = d.BT * d.nh;
  if (n <= 0) return;
  const bool vec = n % 4 == 0 && aligned16(a_val, dt, trap, alpha, beta, gamma);
  const auto kernel = vec ? abg_forward_kernel<4> : abg_forward_kernel<1>;
  kernel<<<grid_for(vec ? n / 4 : n, kThreads), kThreads, 0, s>>>(n, a_val, dt, trap, alpha,
                                                                   beta, gamma);
  M3_LAUNCH_CHECK();
}

void abg_backward(cudaStream_t s, const Dims& d, const AbgBwd& p) {
  const Idx n = d.BT * d.nh;
  if (n <= 0) return;
  const bool vec = n % 4 == 0 && aligned16(p.alpha, p.beta, p.dt, p.trap, p.d_alpha, p.d_beta,
                                           p.d_gamma, p.d_adt_total, p.d_dt_direct, p.d_trap_sig);
  const auto kernel = vec ? abg_backward_kernel<4> : abg_backward_kernel<1>;
  kernel<<<grid_for(vec ? n / 4 : n, kThreads), kThreads, 0, s>>>(n, p);
  M3_LAUNCH_CHECK();
}

void activations_backward(cudaStream_t s, const Dims& d, const ActBwd& p, Scratch scratch) {
  const char* where = "gpu::activations_backward";
  M3_REQUIRE(d.BT >= 0 && d.nh >= 1, where, "bad dims", "BT=", d.BT, ", nh=", d.nh);
  M3_REQUIRE(p.a_floor == d.a_floor, where, "ActBwd::a_floor differs from the config's a_floor",
             "p.a_floor=", p.a_floor, ", d.a_floor=", d.a_floor);
  require_scratch(scratch, colsum_scratch_floats(d.BT, d.nh), where);
  const Idx n = d.BT * d.nh;
  if (n == 0) return;
  const bool vec = d.nh % 4 == 0 && aligned16(p.dd_dt_raw, p.dd_a_raw, p.dt, p.a_val, p.trap,
                                              p.d_adt_total, p.d_dt_direct, p.d_dt_angle,
                                              p.d_trap_sig, p.d_dd_dt, p.d_dd_a, p.d_trap_raw);
  const bool cols = p.d_dd_dt_cols.p;
  M3_REQUIRE(cols == !!p.d_dd_a_cols.p && cols == !!p.d_trap_raw_cols.p, where,
             "d_proj's columns are written for all three outputs or for none", "some are null");
  for (const ProjCols* c : {&p.d_dd_dt_cols, &p.d_dd_a_cols, &p.d_trap_raw_cols})
    require_cols(*c, d.nh, "nh", where);
  const auto kernel = vec ? activations_backward_kernel<4> : activations_backward_kernel<1>;
  const bool cols4 = vec && proj_cols4(p.d_dd_dt_cols) && proj_cols4(p.d_dd_a_cols) &&
                     proj_cols4(p.d_trap_raw_cols);
  kernel<<<grid_for(vec ? n / 4 : n, kThreads), kThreads, 0, s>>>(
      n, d.nh, static_cast<float>(p.a_floor), p, cols4);
  M3_LAUNCH_CHECK();
  colsum_rows(s, d.BT, d.nh, LoadMatrix{p.d_dd_dt, d.nh}, p.d_dt_bias, true, scratch, where);
}

template <class T>
void split_backward(cudaStream_t s, const Dims& d, const SplitBwd<T>& p) {
  check_split_dims(d, "gpu::split_backward");
  M3_REQUIRE(!p.d_z == !p.d_x && !p.d_z == !p.d_b_raw && !p.d_z == !p.d_c_raw,
             "gpu::split_backward",
             "d_z, d_x, d_b_raw, d_c_raw are copied together or already in d_proj together",
             "some of them are null");
  if (d.BT == 0) return;
  const SplitCols c = split_cols(d);
  const bool vec =
      split_vectorizable(c, kVec<T>) && aligned16(p.d_z, p.d_x, p.d_b_raw, p.d_c_raw, p.d_proj);
  const Idx V = vec ? kVec<T> : 1, items = c.ddt / V + (c.ip - c.ddt);
  const RowItems ri = row_items(d.BT, items, p.d_z ? 0 : c.ddt / V);
  const auto kernel = vec ? split_backward_kernel<kVec<T>, T> : split_backward_kernel<1, T>;
  kernel<<<grid_for(ri.total, kThreads * kUnroll), kThreads, 0, s>>>(c, ri, p);
  M3_LAUNCH_CHECK();
}

template <class T>
SplitF32Cols split_f32_cols(const Dims& d, T* d_proj) {
  check_split_dims(d, "gpu::split_f32_cols");
  const SplitCols c = split_cols(d);
  return {proj_cols(d_proj + c.ddt, c.ip), proj_cols(d_proj + c.dda, c.ip),
          proj_cols(d_proj + c.trap, c.ip), proj_cols(d_proj + c.ang, c.ip)};
}

#define M3_INSTANTIATE(T)                                                          \
  template void split_forward<T>(cudaStream_t, const Dims&, const SplitFwd<T>&);   \
  template void split_backward<T>(cudaStream_t, const Dims&, const SplitBwd<T>&);  \
  template SplitF32Cols split_f32_cols<T>(const Dims&, T*);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
