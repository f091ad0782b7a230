// K0/K1 of the chunked scan (chunked_detail.cuh has the family's math): per (r, h) adt, γ,
// sg, scale, Ks = K·scale (stored typed) and qk = γ·(Q·K); with F4ef fused in
// (ssm_chunked_rope_prep) K and Q are formed here from b/c_normed, the biases and θ.
#include "chunked_detail.cuh"

namespace m3::gpu {

namespace {

// K0/K1's tensors (SsmChunkFwd's and RopePrep's names), every [BT, ...] one from the launch's
// first row on.
template <class T>
struct PrepArgs {
  const float *dt, *trap, *a_val;                  // [rows, nh] (dt, trap also at row + 1)
  const T *k_in, *q_in;                            // !kRope: the stored k, q
  const T *b_normed, *c_normed;                    // kRope: [rows, ng, ds]
  const float *b_bias, *c_bias, *theta;            // kRope: [nh, ds] (not shifted), [rows, nh, na]
  T *k, *q;                                        // kRope: F4ef's outputs
  T* k_scaled_saved;
  float *adt, *gamma_saved, *scale_saved, *qk_dot_saved;
};
struct PrepGeom {
  unsigned rows, nh, ds, na, ng, T;
  unsigned t_base;             // t of the launch's first row (t_base + rows < 2^31: launch_prep)
  FastDiv heads, time, group;  // i → (r, h); t_base + r → t; h → g(h)
  bool k_all;
};

// kRope: F4ef fused in (ssm_chunked_rope_prep). k and q are not read but computed as
// rope_forward_normed computes them, bit for bit: X_biased = T(float(X_normed[r, g(h)]) +
// X_bias[h]), the pair (2j, 2j + 1) rotated by θ[r, h, j] for j < na (rope_rotate), rounded to
// T; q is stored, k at t = T − 1 (k_out's source) or everywhere when k_all.
// (A minimum of 0 blocks per SM is none: the other instantiations' code is as without one.)
template <class T, bool kRope, bool kVec, bool kFull>
__global__ void __launch_bounds__(kThreads, kFull ? 6 : 0)
prep_kernel(PrepGeom pg, PrepArgs<T> a) {
  // Half a warp per (r, h) row (Seg<16>: two rows per warp in flight): lane l < 16 owns the
  // values n = 4l + 64k, k ∈ {0, 1} (ds ≤ 128, chunk_geom), read and written 4 at a time when
  // kVec (ds % 4 == 0, rows aligned), else element by element. Offsets are 32-bit (PrepGeom).
  // kFull (kRope, kVec, the official ds = 128 and na = 32): every value inside the row, the pairs
  // of k = 0 rotated and those of k = 1 not, known when compiling (no bounds or rotation tests;
  // the same arithmetic per value), at ≤ 40 registers: six blocks per SM instead of five (48).
  // bf16 fits in 39 registers unbounded; f16 takes 43 (five blocks, slower than the generic
  // kernel), so the launch bounds hold kFull to six blocks (ncu, official shape).
  // kFull: ds and na as the constants they are (rope_layout_full), so that the row offsets are
  // shifts, not products with values reloaded from the parameter bank (at ≤ 40 registers ptxas
  // reloads a run-time pg.ds for every use: ncu's source page).
  using S = Seg<kPrepLanes>;
  const unsigned items = pg.rows * pg.nh, ds = kFull ? 128u : pg.ds, na = kFull ? 32u : pg.na,
                 lane = S::lane();
  for (unsigned w0 = static_cast<unsigned>(S::first()); w0 < items;
       w0 += static_cast<unsigned>(S::stride())) {
    const unsigned i = w0 + S::seg();
    const bool on = i < items;
    const unsigned len = on ? ds : 0;  // values of this lane's row (none when off)
    // Whether the lane's 4 values from n on are inside the row (kFull: all of them, when on).
    auto in_row = [&](unsigned n) { return kFull ? on : n < len; };
    const unsigned r = pg.heads.div(i), h = i - r * pg.nh, base = i * ds;
    // sg = 0 at t = T − 1; t = (t_base + r) mod T in 32 bits (its 64-bit form was ≈ 30
    // instructions per row, the largest block of the kernel's index arithmetic).
    const unsigned tr = pg.t_base + r;
    const bool next = on && tr - pg.time.div(tr) * pg.T + 1 < pg.T;
    const float dt = on ? a.dt[i] : 0.0f, trap = on ? a.trap[i] : 0.0f;
    const float dt1 = next ? a.dt[i + pg.nh] : 0.0f, trap1 = next ? a.trap[i + pg.nh] : 1.0f;
    float kv[2][4], qv[2][4];
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const unsigned n = 4 * lane + 64 * c;
      const bool has = in_row(n);
      if constexpr (kRope) {
        const unsigned gn = (r * pg.ng + pg.group.div(h)) * ds, hn = h * ds;
        float nb[4], nc[4], ab[4], ac[4], th[2];
        lane_load<kVec, Use::kArith>(a.b_normed, gn, n, len, has, nb);
        lane_load<kVec, Use::kArith>(a.c_normed, gn, n, len, has, nc);
        lane_load<kVec>(a.b_bias, hn, n, len, has, ab);
        lane_load<kVec>(a.c_bias, hn, n, len, has, ac);
        const unsigned j0 = n / 2;  // the lane's pairs j0, j0 + 1
        if constexpr (kVec) {       // na is even, so both pairs are rotated or neither
          th[0] = th[1] = 0.0f;
          if (has && rope_pair_rotated<kFull>(c, j0, na)) load_n<2>(a.theta + (i * na + j0), th);
        } else {
#pragma unroll
          for (int u = 0; u < 2; ++u) th[u] = on && j0 + u < na ? a.theta[i * na + j0 + u] : 0.0f;
        }
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          kv[c][e] = nb[e] + ab[e];  // b_biased; k where not rotated
          qv[c][e] = nc[e] + ac[e];  // c_biased; q where not rotated
        }
        // round_trip2: the same values as round_trip (a NaN stays a NaN, and its store below
        // gives the bits a stored arithmetic NaN has).
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
          round_trip2<T>(kv[c][e], kv[c][e + 1]);
          round_trip2<T>(qv[c][e], qv[c][e + 1]);
        }
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          if (!rope_pair_rotated<kFull>(c, j0 + u, na)) continue;
          float sn, cs;
          sincosf(th[u], &sn, &cs);
          const float b0 = kv[c][2 * u], b1 = kv[c][2 * u + 1];
          const float c0 = qv[c][2 * u], c1 = qv[c][2 * u + 1];
          rope_rotate(sn, cs, b0, b1, kv[c][2 * u], kv[c][2 * u + 1]);
          rope_rotate(sn, cs, c0, c1, qv[c][2 * u], qv[c][2 * u + 1]);
          round_trip2<T>(kv[c][2 * u], kv[c][2 * u + 1]);
          round_trip2<T>(qv[c][2 * u], qv[c][2 * u + 1]);
        }
        lane_store<kVec>(a.q, base, n, len, has, qv[c]);
        if (pg.k_all || !next) lane_store<kVec>(a.k, base, n, len, has, kv[c]);
      } else {
        lane_load<kVec, Use::kArith>(a.k_in, base, n, len, has, kv[c]);
        lane_load<kVec, Use::kArith>(a.q_in, base, n, len, has, qv[c]);
      }
    }
    const float gam = dt * trap, sg = dt1 * (1.0f - trap1);
    // Not contracted into an fma: the reference rounds γ and sg, then adds, and Ks is stored
    // typed from K·scale, so the same scale gives the same rounded Ks.
    const float scale = __fadd_rn(gam, sg);
    // Q·K: the lane's values in ascending n (zeros past ds add nothing), then segment_sum.
    float qk = 0.0f;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const unsigned n = 4 * lane + 64 * c;
      float o[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        qk += qv[c][e] * kv[c][e];
        o[e] = kv[c][e] * scale;
      }
      lane_store<kVec>(a.k_scaled_saved, base, n, len, in_row(n), o);
    }
    qk = segment_sum<kPrepLanes>(qk);
    if (on && lane == 0) {
      a.adt[i] = a.a_val[i] * dt;
      a.gamma_saved[i] = gam;
      a.scale_saved[i] = scale;
      a.qk_dot_saved[i] = gam * qk;
    }
  }
}

// Launches prep_kernel<T, kRope> over the rows in slabs (32-bit offsets). rp: kRope's inputs and
// outputs (null for the plain K0/K1).
template <class T, bool kRope>
void launch_prep(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p, const RopePrep<T>* rp) {
  constexpr unsigned kVecBytes = 4 * sizeof(T);
  const bool vec = d.ds % 4 == 0 && d.na % 2 == 0 && is_aligned(p.k_scaled_saved, kVecBytes) &&
                   (kRope ? all_aligned(kVecBytes, rp->k, rp->q, rp->b_normed, rp->c_normed) &&
                                all_aligned(16, rp->b_bias, rp->c_bias) &&
                                all_aligned(8, rp->theta)
                          : all_aligned(kVecBytes, p.k, p.q));
  // kFull for the 16-bit types (the kernel's comment); f32, not measured, keeps the kVec path.
  constexpr bool kFullT = kRope && !std::is_same_v<T, float>;
  const bool full = kFullT && vec && rope_layout_full(d);
  auto kernel = full  ? prep_kernel<T, kRope, true, kFullT>
                : vec ? prep_kernel<T, kRope, true, false>
                      : prep_kernel<T, kRope, false, false>;
  const Idx slab = slab_rows(d, 1);
  for (Idx r0 = 0; r0 < d.BT; r0 += slab) {
    const Idx rows = std::min(slab, d.BT - r0), s1 = r0 * d.nh, sd = s1 * d.ds,
              sa = s1 * d.na, sg = r0 * d.ng * d.ds;
    PrepArgs<T> a{p.dt + s1, p.trap + s1, p.a_val + s1, shifted(p.k, sd),  shifted(p.q, sd),
                  nullptr,   nullptr,     nullptr,      nullptr,     nullptr,
                  nullptr,   nullptr,     p.k_scaled_saved + sd,     p.adt + s1,
                  p.gamma_saved + s1,     p.scale_saved + s1,        p.qk_dot_saved + s1};
    if constexpr (kRope) {
      a.b_normed = rp->b_normed + sg, a.c_normed = rp->c_normed + sg;
      a.b_bias = rp->b_bias, a.c_bias = rp->c_bias, a.theta = shifted(rp->theta, sa);
      a.k = rp->k + sd, a.q = rp->q + sd;
    }
    // t_base + r < 2^31 for the kernel's 32-bit time index (FastDiv::div(unsigned)).
    M3_REQUIRE(r0 % d.T + rows < (Idx(1) << 31), kChunkWhere,
               "a prep slab's time index passes 2^31", "T=", d.T, " rows=", rows);
    const PrepGeom pg{static_cast<unsigned>(rows), static_cast<unsigned>(d.nh),
                      static_cast<unsigned>(d.ds), static_cast<unsigned>(d.na),
                      static_cast<unsigned>(d.ng), static_cast<unsigned>(d.T),
                      static_cast<unsigned>(r0 % d.T), FastDiv(d.nh),
                      FastDiv(d.T),                FastDiv(d.hpg),
                      kRope && rp->k_all};
    kernel<<<grid_for(rows * d.nh, Seg<kPrepLanes>::kPerBlock), kThreads, 0, s>>>(pg, a);
    M3_LAUNCH_CHECK();
  }
}

}  // namespace

namespace chunked_detail {
template <class T>
void chunked_prep(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p, const RopePrep<T>* rp) {
  if (rp) {
    launch_prep<T, true>(s, d, p, rp);
  } else {
    launch_prep<T, false>(s, d, p, nullptr);
  }
}
}  // namespace chunked_detail

void set_row_slab_limit_for_testing(Idx rows) {
  M3_REQUIRE(rows >= 0, "gpu::set_row_slab_limit_for_testing", "negative row limit", "rows=", rows);
  chunked_detail::slab_limit() = rows;
}

template <class T>
void ssm_chunked_rope_prep(cudaStream_t s, const Dims& d, const RopePrep<T>& rp,
                           const SsmChunkFwd<T>& p) {
  chunk_geom(d);  // checks the shape
  M3_REQUIRE(d.na >= 0 && 2 * d.na <= d.ds && d.ng >= 1 && d.hpg * d.ng == d.nh, kChunkWhere,
             "bad dims", "na=", d.na, " ds=", d.ds, " ng=", d.ng, " hpg=", d.hpg, " nh=", d.nh);
  M3_REQUIRE(rp.b_normed && rp.c_normed && rp.b_bias && rp.c_bias && rp.k && rp.q &&
                 (d.na == 0 || rp.theta),
             kChunkWhere, "missing rope_prep arguments", "b/c_normed, b/c_bias, theta, k, q");
  chunked_detail::chunked_prep<T>(s, d, p, &rp);
}

#define M3_INSTANTIATE(T)                                                                   \
  template void chunked_detail::chunked_prep<T>(cudaStream_t, const Dims&,                  \
                                                const SsmChunkFwd<T>&, const RopePrep<T>*); \
  template void ssm_chunked_rope_prep<T>(cudaStream_t, const Dims&, const RopePrep<T>&,     \
                                         const SsmChunkFwd<T>&);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
