// BCNorm with the per-head bias broadcast (F4a–d) and its backward (B4b, B4c).
// MODEL.md §4 F4, §6.2 B4b/B4c; the same formulas, operation for operation, as
// reference/bcnorm.cpp (+ the RMSNorm core of reference/rmsnorm.cpp). For X ∈ {B, C}, per
// (r, g), n < ds, g(h) = ⌊h / hpg⌋:
//   X_rms[r,g]      = sqrt( (1/ds) Σ_n X_raw[r,g,n]² + ε ),  ε = 1e-5   (saved: the RMS)
//   X_normed[r,g,n] = X_raw[r,g,n] / X_rms[r,g] · w_X[n]                 (stored as T)
//   X_biased[r,h,n] = X_normed[r,g(h),n] + X_bias[h,n]   for the hpg heads h of group g
//                     (reads the stored X_normed); not stored when b/c_biased are null (F4ef
//                     and the chunked backward then recompute it, rope.cu / scan/chunked_bwd.cu)
// Backward from d_X_pre_rope [BT, nh, ds] (f32):
//   d_X_normed[r,g,n] = Σ_{h: g(h)=g} d_X_pre_rope[r,h,n]   (ascending h; stored as T)
//   x̂ = X_raw / X_rms,  c1 = (1/ds) Σ_n d_X_normed·w_X·x̂     (reads the stored d_X_normed)
//   d_X_raw[r,g,n]    = ( w_X[n]·d_X_normed[r,g,n] − x̂·c1 ) / X_rms[r,g]
//   d X_bias[h,n]    += Σ_r d_X_pre_rope[r,h,n]             (colsum_rows, fixed order)
//   d w_X[n]         += Σ_{(r,g)} d_X_normed[r,g,n]·x̂[r,g,n] (colsum_rows over rows (r,g))
// B4c alone (null d_X_pre_rope): the chunked scan's backward tail has stored d_X_normed and
// added the bias gradients (scan/chunked_bwd.cu, step 2); c1 and d_X_raw as above from the stored
// d_X_normed, the same values as after the head sum.
// Shapes: X_raw, X_normed, d_X_normed, d_X_raw [BT, ng, ds]; X_rms [BT, ng];
// X_biased, d_X_pre_rope [BT, nh, ds]; w_X [ds]; X_bias [nh, ds].
// One (r, g, X) row per warp segment (reduce.cuh): B and C rows interleave, unit = 2·(r·ng+g)+X.
// A segment has L = segment_lanes(⌈ds/V⌉) lanes; lane l owns the groups of V consecutive n
// starting at V·(l + k·L), k = 0, 1, …: V = 16/sizeof(T) in the forward (one 16-byte access of
// the typed rows, X_biased being most of its traffic), V = 4 in the backward (16 bytes of the f32
// d_X_pre_rope). Σ_n is each lane's sum in ascending n, then segment_sum (a fixed order that
// depends on ds and T only). With ds % V == 0 and aligned pointers a group is read and written
// with vector accesses, otherwise the same groups element by element (the same sums either way).
// X_raw and d_X_raw may have a row stride ldr ≠ ng·ds: in the production layout they are column
// views of proj / d_proj (row stride ip); row (r, g) then starts at r·ldr + g·ds (BcShape::raw).
// Where that stride breaks the vectors' alignment, only the X_raw / d_X_raw accesses go element
// by element (kRawVec false); the groups, and the code that sums them, stay those of the
// contiguous layout, so that the layout does not change a bit.
#include "convert.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

constexpr float kEpsF = static_cast<float>(ref::kEps);
constexpr int kHeadBatch = 4;  // heads whose d_X_pre_rope loads the backward issues together
template <class T>
constexpr int kFwdV = 16 / sizeof(T);  // forward group: 16 bytes of T
constexpr int kBwdV = 4;               // backward group: 16 bytes of f32

struct BcShape {
  Idx rows;  // BT·ng
  Idx ng, nh, hpg, ds;
  Idx ldr;   // X_raw's and d_X_raw's row stride (ng·ds when contiguous)
  // Where row (r, g) = r·ng + g of X_raw / d_X_raw starts. ng = 1 (the official shape) without
  // the 64-bit division: NormWeightTerm calls this per element of d w_X's column sums.
  __device__ __forceinline__ Idx raw(Idx row) const {
    if (ng == 1) return row * ldr;
    const Idx r = row / ng;
    return r * ldr + (row - r * ng) * ds;
  }
};

template <class T, int L, bool kVec, bool kRawVec>
__global__ void __launch_bounds__(kThreads) bcnorm_forward_kernel(BcShape sh, BcnormFwd<T> p) {
  using S = Seg<L>;
  constexpr int V = kFwdV<T>;
  constexpr Idx kStep = Idx(L) * V;  // values from one of a lane's groups to the next
  const Idx units = 2 * sh.rows, ds = sh.ds, n0 = Idx(S::lane()) * V;
  for (Idx w0 = S::first(); w0 < units; w0 += S::stride()) {
    const Idx unit = w0 + S::seg();
    const bool on = unit < units;
    const bool is_c = (unit & 1) != 0;
    const Idx row = unit >> 1;  // r·ng + g
    const T* raw = (is_c ? p.c_raw : p.b_raw) + sh.raw(row);
    float ss = 0.0f;
    if (on)
      for (Idx n = n0; n < ds; n += kStep) {
        float x[V];
        load_group<kRawVec, Use::kArith>(raw + n, ds - n, x);
#pragma unroll
        for (int j = 0; j < V; ++j)
          if (kVec || j < ds - n) ss += x[j] * x[j];
      }
    ss = segment_sum<L>(ss);
    if (!on) continue;
    const float rr = sqrtf(ss / static_cast<float>(ds) + kEpsF);
    if (S::lane() == 0) (is_c ? p.c_rms : p.b_rms)[row] = rr;
    const float* w = is_c ? p.c_norm_weight : p.b_norm_weight;
    const Idx r = row / sh.ng, h0 = (row % sh.ng) * sh.hpg;
    const float* bias = (is_c ? p.c_bias : p.b_bias) + h0 * ds;
    T* normed = (is_c ? p.c_normed : p.b_normed) + row * ds;
    T* biased = (is_c ? p.c_biased : p.b_biased) + (r * sh.nh + h0) * ds;
    for (Idx n = n0; n < ds; n += kStep) {
      float x[V], wv[V], nv[V];
      load_group<kRawVec, Use::kArith>(raw + n, ds - n, x);
      load_group<kVec>(w + n, ds - n, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) nv[j] = x[j] / rr * wv[j];
      store_group<kVec>(normed + n, ds - n, nv);
#pragma unroll
      for (int j = 0; j < V; ++j) nv[j] = round_trip<T>(nv[j]);  // the stored X_normed
      for (Idx k = 0; p.b_biased && k < sh.hpg; ++k) {
        float bv[V], o[V];
        load_group<kVec>(bias + k * ds + n, ds - n, bv);
#pragma unroll
        for (int j = 0; j < V; ++j) o[j] = nv[j] + bv[j];
        store_group<kVec>(biased + k * ds + n, ds - n, o);
      }
    }
  }
}

// kHeadSum: B4b + B4c from d_X_pre_rope; otherwise B4c alone from the stored d_X_normed.
template <class T, int L, bool kVec, bool kRawVec, bool kHeadSum>
__global__ void __launch_bounds__(kThreads) bcnorm_backward_kernel(BcShape sh, BcnormBwd<T> p) {
  using S = Seg<L>;
  constexpr int V = kBwdV;
  constexpr Idx kStep = Idx(L) * V;
  const Idx units = 2 * sh.rows, ds = sh.ds, n0 = Idx(S::lane()) * V;
  for (Idx w0 = S::first(); w0 < units; w0 += S::stride()) {
    const Idx unit = w0 + S::seg();
    const bool on = unit < units;
    const bool is_c = (unit & 1) != 0;
    const Idx row = unit >> 1;
    const T* raw = (is_c ? p.c_raw : p.b_raw) + sh.raw(row);
    const float* w = is_c ? p.c_norm_weight : p.b_norm_weight;
    T* dnormed = (is_c ? p.d_c_normed : p.d_b_normed) + row * ds;
    const float rr = on ? (is_c ? p.c_rms : p.b_rms)[row] : 1.0f;
    float c1 = 0.0f;
    if (on) {
      const Idx r = row / sh.ng, h0 = (row % sh.ng) * sh.hpg;
      const float* dpre =
          kHeadSum ? (is_c ? p.d_c_pre_rope : p.d_b_pre_rope) + (r * sh.nh + h0) * ds : nullptr;
      for (Idx n = n0; n < ds; n += kStep) {
        float dn[V];  // d_X_normed as stored
        if constexpr (kHeadSum) {
          // Ascending h as always; the heads' loads are issued kHeadBatch at a time before they
          // are added, so that they are in flight together (hpg = nheads when ngroups = 1).
          float acc[V] = {};
          Idx k = 0;
          for (; k + kHeadBatch <= sh.hpg; k += kHeadBatch) {
            float v[kHeadBatch][V];
#pragma unroll
            for (int q = 0; q < kHeadBatch; ++q)
              load_group<kVec>(dpre + (k + q) * ds + n, ds - n, v[q]);
#pragma unroll
            for (int q = 0; q < kHeadBatch; ++q)
#pragma unroll
              for (int j = 0; j < V; ++j) acc[j] += v[q][j];
          }
          for (; k < sh.hpg; ++k) {
            float v[V];
            load_group<kVec>(dpre + k * ds + n, ds - n, v);
#pragma unroll
            for (int j = 0; j < V; ++j) acc[j] += v[j];
          }
          store_group<kVec>(dnormed + n, ds - n, acc);
#pragma unroll
          for (int j = 0; j < V; ++j) dn[j] = round_trip<T>(acc[j]);
        } else {
          load_group<kVec, Use::kArith>(dnormed + n, ds - n, dn);
        }
        float x[V], wv[V];
        load_group<kRawVec, Use::kArith>(raw + n, ds - n, x);
        load_group<kVec>(w + n, ds - n, wv);
#pragma unroll
        for (int j = 0; j < V; ++j)
          if (kVec || j < ds - n) c1 += dn[j] * wv[j] * (x[j] / rr);
      }
    }
    c1 = segment_sum<L>(c1) / static_cast<float>(ds);
    if (!on) continue;
    T* draw = (is_c ? p.d_c_raw : p.d_b_raw) + sh.raw(row);
    for (Idx n = n0; n < ds; n += kStep) {
      float x[V], d[V], wv[V], o[V];
      load_group<kRawVec, Use::kArith>(raw + n, ds - n, x);
      load_group<kVec, Use::kArith>(dnormed + n, ds - n, d);  // as stored
      load_group<kVec>(w + n, ds - n, wv);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        const float xh = x[j] / rr;
        // w·d − x̂·c1 in fma_diff's one rounding (common.cuh): left to ptxas, the vector and
        // the element-wise loops (kRawVec) differed in the last bit.
        o[j] = fma_diff(wv[j], d[j], xh, c1) / rr;
      }
      store_group<kRawVec>(draw + n, ds - n, o);
    }
  }
}

// d w_X term of row (r,g), column n: d_X_normed·x̂ (the stored d_X_normed).
template <class T>
struct NormWeightTerm {
  const T* dnormed;
  const T* raw;
  const float* rms;
  BcShape sh;
  struct Term {
    T raw, dnormed;
    float rms;
  };
  __device__ Term load(Idx row, Idx n) const {
    return {raw[sh.raw(row) + n], dnormed[row * sh.ds + n], rms[row]};
  }
  __device__ static float add_to(float acc, const Term& t) {
    const float xhat = to_float(t.raw) / t.rms;
    return __fmaf_rn(to_float(t.dnormed), xhat, acc);
  }
};

BcShape bc_shape(const Dims& d, Idx ldr, const char* where) {
  M3_REQUIRE(d.BT >= 0 && d.ds >= 1 && d.ng >= 1 && d.nh >= 1 && d.nh % d.ng == 0 &&
                 d.hpg * d.ng == d.nh,
             where, "bad dims", "BT=", d.BT, " ds=", d.ds, " ng=", d.ng, " nh=", d.nh,
             " hpg=", d.hpg);
  const Idx raw_ld = row_stride(ldr, d.ng * d.ds, where, "X_raw");
  return BcShape{d.BT * d.ng, d.ng, d.nh, d.hpg, d.ds, raw_ld};
}

Idx bcnorm_scratch_floats(const Dims& d) {
  return std::max(colsum_pair_scratch_floats(d.BT, d.nh * d.ds),
                  colsum_pair_scratch_floats(d.BT * d.ng, d.ds));
}

}  // namespace

template <class T>
void bcnorm_forward(cudaStream_t s, const Dims& d, const BcnormFwd<T>& p) {
  const BcShape sh = bc_shape(d, p.ldr, "gpu::bcnorm_forward");
  M3_REQUIRE((p.b_biased == nullptr) == (p.c_biased == nullptr), "gpu::bcnorm_forward",
             "bad arguments", "b_biased and c_biased are both set or both null");
  if (sh.rows == 0) return;
  constexpr int V = kFwdV<T>;
  const bool vec = d.ds % V == 0 &&
                   all_aligned(16, p.b_norm_weight, p.c_norm_weight, p.b_bias, p.c_bias,
                               p.b_normed, p.c_normed, p.b_biased, p.c_biased);
  const bool raw_vec = vec && sh.ldr % V == 0 && all_aligned(16, p.b_raw, p.c_raw);
  with_lanes(segment_lanes((d.ds + V - 1) / V), [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    const unsigned int grid = grid_for(2 * sh.rows, Seg<L>::kPerBlock);
    if (raw_vec)
      bcnorm_forward_kernel<T, L, true, true><<<grid, kThreads, 0, s>>>(sh, p);
    else if (vec)
      bcnorm_forward_kernel<T, L, true, false><<<grid, kThreads, 0, s>>>(sh, p);
    else
      bcnorm_forward_kernel<T, L, false, false><<<grid, kThreads, 0, s>>>(sh, p);
  });
  M3_LAUNCH_CHECK();
}

template <class T>
void bcnorm_backward(cudaStream_t s, const Dims& d, const BcnormBwd<T>& p, Scratch scratch) {
  const char* where = "gpu::bcnorm_backward";
  const BcShape sh = bc_shape(d, p.ldr, where);
  require_scratch(scratch, bcnorm_scratch_floats(d), where);
  if (sh.rows == 0) return;
  const bool head_sum = p.d_b_pre_rope != nullptr;
  M3_REQUIRE(head_sum == (p.d_c_pre_rope != nullptr), where, "bad arguments",
             "d_b_pre_rope and d_c_pre_rope are both set (B4b + B4c) or both null (B4c alone)");
  constexpr int V = kBwdV;
  const bool vec = d.ds % V == 0 &&
                   all_aligned(16, p.b_norm_weight, p.c_norm_weight, p.d_b_pre_rope,
                               p.d_c_pre_rope) &&
                   all_aligned(V * sizeof(T), p.d_b_normed, p.d_c_normed);
  const bool raw_vec = vec && sh.ldr % V == 0 &&
                       all_aligned(V * sizeof(T), p.b_raw, p.c_raw, p.d_b_raw, p.d_c_raw);
  with_lanes(segment_lanes((d.ds + V - 1) / V), [&](auto lanes) {
    constexpr int L = decltype(lanes)::value;
    const unsigned int grid = grid_for(2 * sh.rows, Seg<L>::kPerBlock);
    with_flags(vec, head_sum, [&](auto vec_c, auto sum_c) {
      constexpr bool kV = decltype(vec_c)::value, kS = decltype(sum_c)::value;
      if (kV && raw_vec)
        bcnorm_backward_kernel<T, L, kV, true, kS><<<grid, kThreads, 0, s>>>(sh, p);
      else
        bcnorm_backward_kernel<T, L, kV, false, kS><<<grid, kThreads, 0, s>>>(sh, p);
    });
  });
  M3_LAUNCH_CHECK();
  // The reductions run one after another on the stream and share the scratch; b's and c's sums
  // of each pair in one launch (colsum_rows_pair).
  const Idx nhds = d.nh * d.ds;
  if (head_sum)
    colsum_rows_pair(s, d.BT, nhds, LoadMatrix{p.d_b_pre_rope, nhds}, p.d_b_bias,
                     LoadMatrix{p.d_c_pre_rope, nhds}, p.d_c_bias, true, scratch, where);
  colsum_rows_pair(s, sh.rows, d.ds, NormWeightTerm<T>{p.d_b_normed, p.b_raw, p.b_rms, sh},
                   p.d_b_norm_weight, NormWeightTerm<T>{p.d_c_normed, p.c_raw, p.c_rms, sh},
                   p.d_c_norm_weight, true, scratch, where);
}

#define M3_INSTANTIATE(T)                                                               \
  template void bcnorm_forward<T>(cudaStream_t, const Dims&, const BcnormFwd<T>&);      \
  template void bcnorm_backward<T>(cudaStream_t, const Dims&, const BcnormBwd<T>&, Scratch);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
