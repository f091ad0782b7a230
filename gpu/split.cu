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
// Per-head tensors are [BT, nh]. Nothing is saved beyond the outputs listed.
#include "activations.cuh"
#include "convert.cuh"
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

// One row of proj per block iteration; threads stride over its ip columns.
template <class T>
__global__ void __launch_bounds__(kThreads)
split_forward_kernel(Idx rows, SplitCols c, float a_floor, SplitFwd<T> p) {
  for (Idx r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* pr = p.proj + r * c.ip;
    for (Idx j = threadIdx.x; j < c.ip; j += kThreads) {
      const T v = pr[j];
      if (j < c.x) {
        p.z[r * c.di + j] = v;
      } else if (j < c.b) {
        p.x[r * c.di + (j - c.x)] = v;
      } else if (j < c.c) {
        p.b_raw[r * c.bc + (j - c.b)] = v;
      } else if (j < c.ddt) {
        p.c_raw[r * c.bc + (j - c.c)] = v;
      } else if (j < c.dda) {
        const Idx h = j - c.ddt, i = r * c.nh + h;
        const float raw = to_float(v);
        p.dd_dt_raw[i] = raw;
        p.dt[i] = softplus(raw + p.dt_bias[h]);
      } else if (j < c.trap) {
        const Idx i = r * c.nh + (j - c.dda);
        const float raw = to_float(v);
        p.dd_a_raw[i] = raw;
        const float a = -heavy_tail(raw), f = -a_floor;
        p.a_val[i] = f < a ? f : a;  // std::min(a, f)
      } else if (j < c.ang) {
        const Idx i = r * c.nh + (j - c.trap);
        const float raw = to_float(v);
        p.trap_raw[i] = raw;
        p.trap[i] = sigmoid(raw);
      } else {
        p.angles_raw[r * c.na + (j - c.ang)] = to_float(v);
      }
    }
  }
}

__global__ void __launch_bounds__(kThreads)
abg_forward_kernel(Idx n, const float* a_val, const float* dt, const float* trap, float* alpha,
                   float* beta, float* gamma) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < n; i += Idx(gridDim.x) * kThreads) {
    const float dti = dt[i], tr = trap[i];
    const float al = expf(a_val[i] * dti);
    alpha[i] = al;
    beta[i] = al * dti * (1.0f - tr);
    gamma[i] = tr * dti;
  }
}

__global__ void __launch_bounds__(kThreads) abg_backward_kernel(Idx n, AbgBwd p) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < n; i += Idx(gridDim.x) * kThreads) {
    const float al = p.alpha[i], dt = p.dt[i], tr = p.trap[i];
    const float da = p.d_alpha[i], db = p.d_beta[i], dg = p.d_gamma[i];
    p.d_adt_total[i] = da * al + db * p.beta[i];
    p.d_dt_direct[i] = db * al * (1.0f - tr) + dg * tr;
    p.d_trap_sig[i] = -db * al * dt + dg * dt;
  }
}

__global__ void __launch_bounds__(kThreads)
activations_backward_kernel(Idx n, Idx nh, float a_floor, ActBwd p) {
  for (Idx i = blockIdx.x * Idx(kThreads) + threadIdx.x; i < n; i += Idx(gridDim.x) * kThreads) {
    const Idx h = i % nh;
    const float d_adt = p.d_adt_total[i];
    const float d_angle = p.d_dt_angle ? p.d_dt_angle[i] : 0.0f;
    const float d_dt_tot = d_adt * p.a_val[i] + p.d_dt_direct[i] + d_angle;
    p.d_dd_dt[i] = d_dt_tot * softplus_grad(p.dd_dt_raw[i] + p.dt_bias[h]);
    const float tr = p.trap[i];
    p.d_trap_raw[i] = p.d_trap_sig[i] * tr * (1.0f - tr);
    const float v = p.dd_a_raw[i];
    const bool clamped = -heavy_tail(v) > -a_floor;
    p.d_dd_a[i] = clamped ? 0.0f : d_adt * p.dt[i] * (-heavy_tail_grad(v));
  }
}

template <class T>
__global__ void __launch_bounds__(kThreads)
split_backward_kernel(Idx rows, SplitCols c, SplitBwd<T> p) {
  for (Idx r = blockIdx.x; r < rows; r += gridDim.x) {
    T* out = p.d_proj + r * c.ip;
    for (Idx j = threadIdx.x; j < c.ip; j += kThreads) {
      T v;
      if (j < c.x) v = p.d_z[r * c.di + j];
      else if (j < c.b) v = p.d_x[r * c.di + (j - c.x)];
      else if (j < c.c) v = p.d_b_raw[r * c.bc + (j - c.b)];
      else if (j < c.ddt) v = p.d_c_raw[r * c.bc + (j - c.c)];
      else if (j < c.dda) v = from_float<T>(p.d_dd_dt[r * c.nh + (j - c.ddt)]);
      else if (j < c.trap) v = from_float<T>(p.d_dd_a[r * c.nh + (j - c.dda)]);
      else if (j < c.ang) v = from_float<T>(p.d_trap_raw[r * c.nh + (j - c.trap)]);
      else v = from_float<T>(p.d_angles_raw[r * c.na + (j - c.ang)]);
      out[j] = v;
    }
  }
}

}  // namespace

template <class T>
void split_forward(cudaStream_t s, const Dims& d, const SplitFwd<T>& p) {
  check_split_dims(d, "gpu::split_forward");
  if (d.BT == 0) return;
  split_forward_kernel<T><<<grid_for(d.BT, 1), kThreads, 0, s>>>(
      d.BT, split_cols(d), static_cast<float>(d.a_floor), p);
  M3_LAUNCH_CHECK();
}

void abg_forward(cudaStream_t s, const Dims& d, const float* a_val, const float* dt,
                 const float* trap, float* alpha, float* beta, float* gamma) {
  const Idx n = d.BT * d.nh;
  if (n <= 0) return;
  abg_forward_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(n, a_val, dt, trap, alpha, beta,
                                                                gamma);
  M3_LAUNCH_CHECK();
}

void abg_backward(cudaStream_t s, const Dims& d, const AbgBwd& p) {
  const Idx n = d.BT * d.nh;
  if (n <= 0) return;
  abg_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(n, p);
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
  activations_backward_kernel<<<grid_for(n, kThreads), kThreads, 0, s>>>(
      n, d.nh, static_cast<float>(p.a_floor), p);
  M3_LAUNCH_CHECK();
  colsum_rows(s, d.BT, d.nh, LoadMatrix{p.d_dd_dt, d.nh}, p.d_dt_bias, true, scratch, where);
}

template <class T>
void split_backward(cudaStream_t s, const Dims& d, const SplitBwd<T>& p) {
  check_split_dims(d, "gpu::split_backward");
  if (d.BT == 0) return;
  split_backward_kernel<T><<<grid_for(d.BT, 1), kThreads, 0, s>>>(d.BT, split_cols(d), p);
  M3_LAUNCH_CHECK();
}

#define M3_INSTANTIATE(T)                                                          \
  template void split_forward<T>(cudaStream_t, const Dims&, const SplitFwd<T>&);   \
  template void split_backward<T>(cudaStream_t, const Dims&, const SplitBwd<T>&);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
