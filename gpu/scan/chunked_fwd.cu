// The chunked scan's forward after the prep (chunked_detail.cuh has the family's math): K2/K3
// (cumsums, chunk contributions), K4/K6 (state passing, leaving states) and K5 (y).
#include "chunked_detail.cuh"

namespace m3::gpu {

namespace {

// ---- K4/K6 ----------------------------------------------------------------------------------
// grid (element tiles, nh, B): one thread per state element (p, n), serial over the chunks.
template <class T>
__global__ void __launch_bounds__(kThreads, kStatePassBlocks)
state_pass_fwd_kernel(ChunkGeom g, SsmChunkFwd<T> p) {
  const Idx h = blockIdx.y, b = blockIdx.z, sb = b * g.nh + h;
  const Idx e = Idx(blockIdx.x) * kThreads + threadIdx.x, hds = g.hd * g.ds;
  if (blockIdx.x == 0) {
    const Idx rl = b * g.T + g.T - 1;
    for (Idx q = threadIdx.x; q < g.ds; q += kThreads)
      p.k_out[sb * g.ds + q] = to_float(p.k[(rl * g.nh + h) * g.ds + q]);
    for (Idx q = threadIdx.x; q < g.hd; q += kThreads)
      p.v_out[sb * g.hd + q] = to_float(p.x[rl * g.ldx + h * g.hd + q]);
  }
  if (e >= hds) return;
  const Idx pi = e / g.ds, n = e % g.ds, i0 = (b * g.T) * g.nh + h;
  const float sgm1 = p.dt[i0] * (1.0f - p.trap[i0]);
  float S = entering_state(p.ssm_in[sb * hds + e], sgm1, p.v_in[sb * g.hd + pi], p.k_in[sb * g.ds + n]);
  const ChunkWalk w(g, b, h, e);
  const int nc = static_cast<int>(g.nc);
  pass_chunks(nc, nc - 1, p.chunk_states + w.state0, p.chunk_states_saved + w.state0,
              p.da_cumsum_saved + w.lam0, w.sstep, w.lstep, w.last_fix, S);
  p.final_states[sb * hds + e] = S;
  p.ssm_out[sb * hds + e] = S;
}

// ---- K5 -------------------------------------------------------------------------------------
// grid (nc·nt, nh, B); block = row tile J of chunk c (rows t of the tile, kTR at most).
// Shared: Qs [kTR][LDD] (Q_J), Ks [kTR][LDD] (Ks_I; first an n-slice [HP][kLS] of S_c),
// Xs [kTR][LDH] (X_I; X_J after the last I), MA [kTR][kLM], cumJ, cumI [kTR].
// Registers: y tile acc [kRM][RH], the A tile [kRM][kRM].
template <class T, int RH, int RD>
__global__ void __launch_bounds__(kCT)
chunk_scan_kernel(ChunkGeom g, SsmChunkFwd<T> p) {
  constexpr int HP = 16 * RH, DP = 16 * RD, LDH = HP + 4, LDD = DP + 4;
  constexpr int KS_SIZE = kTR * LDD > HP * kLS ? kTR * LDD : HP * kLS;
  extern __shared__ float sm[];
  float* Qs = sm;
  float* Ks = Qs + kTR * LDD;
  float* Xs = Ks + KS_SIZE;
  float* MA = Xs + kTR * LDH;
  float* cumJ = MA + kTR * kLM;
  float* cumI = cumJ + kTR;
  const int tid = threadIdx.x, tm = tid >> 4, tn = tid & 15;
  const Idx c = blockIdx.x / g.nt, h = blockIdx.y, b = blockIdx.z;
  const int J = static_cast<int>(blockIdx.x % g.nt);
  const int L = g.len(c), hd = static_cast<int>(g.hd), ds = static_cast<int>(g.ds);
  if (J * kTR >= L) return;
  const int nJ = min(kTR, L - J * kTR);
  const Idx row0 = b * g.T + g.t0(c);
  const float* cum = p.da_cumsum_saved + g.cum_base(b, c, h);
  const Idx kst = g.nh * g.ds;

  load_tile<DP, LDD>(Qs, p.q + ((row0 + J * kTR) * g.nh + h) * ds, kst, nJ, ds);
  if (tid < kTR) cumJ[tid] = tid < nJ ? cum[J * kTR + tid] : 0.0f;
  const float* S = p.chunk_states_saved + g.state_base(b, c, h);
  // Source tile I: Ks ← Ks_I, Xs ← X_I, cumI (after a barrier; the caller syncs before use).
  auto load_source = [&](int I, int nI) {
    __syncthreads();
    load_tile<DP, LDD>(Ks, p.k_scaled_saved + ((row0 + I * kTR) * g.nh + h) * ds, kst, nI, ds);
    load_tile<HP, LDH>(Xs, p.x + (row0 + I * kTR) * g.ldx + h * hd, g.ldx, nI, hd);
    if (tid < kTR) cumI[tid] = tid < nI ? cum[I * kTR + tid] : 0.0f;
    __syncthreads();
  };

  if constexpr (kTensorProducts<T>) {
    // The same three terms on the tensor cores, in the accumulators' own layout (tc_mma.cuh):
    // inter = Q S_cᵀ, intra = Σ_I MA_I X_I, then y = e^{cum_t}·inter + intra + (D + qk)·x.
    tc::Acc<kTR, HP, kCT / 32> inter, intra;
    inter.zero();
    intra.zero();
    for (int n0 = 0; n0 < ds; n0 += kNK) {
      __syncthreads();
      load_nslice<HP>(Ks, S, hd, ds, n0);
      __syncthreads();
      inter.template add<LDD, 1, 1, kLS, kExactBf16<T>, false>(Qs + n0, Ks, min(kNK, ds - n0));
    }
    for (int I = 0; I <= J; ++I) {
      const int nI = min(kTR, L - I * kTR);
      load_source(I, nI);
      tc::Acc<kTR, kTR, kCT / 32> A;
      A.zero();
      A.template add<LDD, 1, 1, LDD, kExactBf16<T>, kExactBf16<T>>(Qs, Ks, ds);
      A.for_each([&](int t, int s, float v) {
        const bool on = t < nJ && s < nI && I * kTR + s < J * kTR + t;
        MA[t * kLM + s] = on ? expf(cumJ[t] - cumI[s]) * v : 0.0f;
      });
      __syncthreads();
      intra.template add<kLM, 1, LDH, 1, false, kExactBf16<T>>(MA, Xs, nI);
    }
    // Xs holds X_J after I = J.
    inter.for_each2(intra, [&](int t, int q, float vi, float va) {
      if (t >= nJ || q >= hd) return;
      const Idx r = row0 + J * kTR + t;
      const float dq = p.d_param[h] + p.qk_dot_saved[r * g.nh + h];
      p.y[r * g.di + h * hd + q] = from_float<T>(expf(cumJ[t]) * vi + va + dq * Xs[t * LDH + q]);
    });
    return;
  }

  // Inter-chunk term: acc = e^{cum_t} Σ_n Q[t][n] S_c[p][n], S_c streamed in n-slices.
  float acc[kRM][RH];
  zero(acc);
  for (int n0 = 0; n0 < ds; n0 += kNK) {
    __syncthreads();
    load_nslice<HP>(Ks, S, hd, ds, n0);
    __syncthreads();
    mma16<kRM, RH, LDD, 1, 1, kLS>(acc, Qs + n0, Ks, min(kNK, ds - n0), tm, tn);
  }
#pragma unroll
  for (int i = 0; i < kRM; ++i) {
    const float e = expf(cumJ[tm + 16 * i]);
#pragma unroll
    for (int j = 0; j < RH; ++j) acc[i][j] *= e;
  }

  // Intra-chunk term over source tiles I ≤ J.
  for (int I = 0; I <= J; ++I) {
    const int nI = min(kTR, L - I * kTR);
    load_source(I, nI);
    float A[kRM][kRM];
    zero(A);
    mma16<kRM, kRM, LDD, 1, 1, LDD>(A, Qs, Ks, ds, tm, tn);
#pragma unroll
    for (int i = 0; i < kRM; ++i)
#pragma unroll
      for (int j = 0; j < kRM; ++j) {
        const int t = tm + 16 * i, s = tn + 16 * j;
        const bool on = t < nJ && s < nI && I * kTR + s < J * kTR + t;
        MA[t * kLM + s] = on ? expf(cumJ[t] - cumI[s]) * A[i][j] : 0.0f;
      }
    __syncthreads();
    mma16<kRM, RH, kLM, 1, LDH, 1>(acc, MA, Xs, nI, tm, tn);
  }

  // Diagonal term (Xs holds X_J after I = J) and the store.
#pragma unroll
  for (int i = 0; i < kRM; ++i) {
    const int t = tm + 16 * i;
    if (t >= nJ) continue;
    const Idx r = row0 + J * kTR + t;
    const float dq = p.d_param[h] + p.qk_dot_saved[r * g.nh + h];
#pragma unroll
    for (int j = 0; j < RH; ++j) {
      const int q = tn + 16 * j;
      if (q < hd) p.y[r * g.di + h * hd + q] = from_float<T>(acc[i][j] + dq * Xs[t * LDH + q]);
    }
  }
}

// K2/K3 (cumsums, chunk contributions) and K4/K6 (state passing): shared by the forward and
// the backward's recompute (ssm_chunked_states).
template <class T, int RH, int RD>
void launch_states(cudaStream_t s, const Dims& d, const ChunkGeom& g, bool planes,
                   const SsmChunkFwd<T>& p) {
  const ChunkStateArgs a{p.x, p.k_scaled_saved, p.adt, p.da_cumsum_saved, nullptr, nullptr,
                         p.chunk_states, g.ldx};
  if (planes && p.fuse_states) {
    if constexpr (kTensorProducts<T>) {
      ChunkWalkArgs w{};
      w.s = a;
      w.states = p.chunk_states_saved;
      w.init = p.ssm_in;
      w.dt = p.dt;
      w.trap = p.trap;
      w.k_in = p.k_in;
      w.v_in = p.v_in;
      w.fin = p.final_states;
      w.fin2 = p.ssm_out;
      w.k_last = p.k;
      w.x_last = p.x;
      w.k_out = p.k_out;
      w.v_out = p.v_out;
      chunk_walk_tc<T, true>(s, g, w);
    }
    return;
  }
  M3_REQUIRE(p.chunk_states, kChunkWhere, "the chunk contributions need a buffer",
             "chunk_states is null (allowed only with fuse_states on the walk's path)");
  if (planes) {
    if constexpr (kTensorProducts<T>) chunk_state_tc<T, true>(s, g, a);
  } else {
    auto k23 = chunk_state_kernel<T, RH, RD, true>;
    const std::size_t sm23 = smem_chunk_state(RH, RD, kTensorProducts<T>);
    opt_in_smem(k23, sm23, kChunkWhere);
    k23<<<grid3(d.nc, d.nh, d.B), kCT, sm23, s>>>(g, a);
    M3_LAUNCH_CHECK();
  }
  state_pass_fwd_kernel<T>
      <<<grid3(blocks_for(d.hd * d.ds, kThreads), d.nh, d.B), kThreads, 0, s>>>(g, p);
  M3_LAUNCH_CHECK();
}

}  // namespace

// Typed runs whose chunks fit one row tile (the usual case: chunk_size ≤ 64) take the plane
// kernels (chunk_state_tc.cu, chunk_fwd_tc.cu, chunk_bwd_tc.cu; instantiated for bf16 and f16
// only, hence the if constexpr); f32 runs and longer chunks the tiled kernels of this family.
template <class T>
void ssm_chunked_forward(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p, Scratch) {
  const ChunkGeom g = with_ldx(chunk_geom(d), p.ldx);
  const bool planes = kTensorProducts<T> && g.nt == 1;
  if (!p.prep_done) chunked_detail::chunked_prep<T>(s, d, p, nullptr);
  with_pads(d.hd, d.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    launch_states<T, RH, RD>(s, d, g, planes, p);
    if (planes) {
      if constexpr (kTensorProducts<T>) chunk_scan_tc<T>(s, g, p);
    } else {
      auto k5 = chunk_scan_kernel<T, RH, RD>;
      const std::size_t sm5 = smem_chunk_scan(RH, RD);
      opt_in_smem(k5, sm5, kChunkWhere);
      k5<<<grid3(d.nc * g.nt, d.nh, d.B), kCT, sm5, s>>>(g, p);
      M3_LAUNCH_CHECK();
    }
  });
}

template <class T>
void ssm_chunked_states(cudaStream_t s, const Dims& d, const SsmChunkFwd<T>& p) {
  M3_REQUIRE(p.prep_done, kChunkWhere, "the chunk states need the prep's outputs",
             "run ssm_chunked_rope_prep first (prep_done = true)");
  const ChunkGeom g = with_ldx(chunk_geom(d), p.ldx);
  const bool planes = kTensorProducts<T> && g.nt == 1;
  with_pads(d.hd, d.ds, [&](auto rh, auto rd) {
    constexpr int RH = decltype(rh)::value, RD = decltype(rd)::value;
    launch_states<T, RH, RD>(s, d, g, planes, p);
  });
}

template <class T>
bool ssm_chunked_walks(const Dims& d) {
  return kTensorProducts<T> && std::min(d.cs, d.T) <= kTR;
}

#define M3_INSTANTIATE(T)                                                                   \
  template void ssm_chunked_forward<T>(cudaStream_t, const Dims&, const SsmChunkFwd<T>&,    \
                                       Scratch);                                            \
  template void ssm_chunked_states<T>(cudaStream_t, const Dims&, const SsmChunkFwd<T>&);    \
  template bool ssm_chunked_walks<T>(const Dims&);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
