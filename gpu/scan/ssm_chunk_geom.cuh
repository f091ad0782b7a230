// Internal to gpu/ (.cu files only): the chunk geometry shared by the chunked-scan kernels
// (gpu/scan/chunked_*.cu, gpu/scan/chunk_bwd_tc.cu). Per (b, h); chunk c covers t ∈ [c·cs,
// min(T, (c+1)·cs)), local index τ, length len(c); per-chunk scalars ([B, nc, nh, cs]:
// da_cumsum_saved) at cum_base, per-chunk states ([B, nc, nh, hd, ds]) at state_base.
#pragma once

#include <cstddef>
#include <type_traits>

#include "common.cuh"
#include "smem.cuh"
#include "stages.cuh"

namespace m3::gpu {

constexpr int kTR = 64;  // rows (time steps) per tile of the per-chunk kernels

struct ChunkGeom {
  Idx B, T, nh, hd, ds, di, cs, nc;
  int nt;   // row tiles of kTR per (longest) chunk
  Idx ldx;  // row stride of x and d_x: di, or ip for proj's / d_proj's column views (with_ldx)
  __device__ Idx t0(Idx c) const { return c * cs; }
  __device__ int len(Idx c) const { return static_cast<int>(min(T, (c + 1) * cs) - c * cs); }
  __device__ Idx cum_base(Idx b, Idx c, Idx h) const { return ((b * nc + c) * nh + h) * cs; }
  __device__ Idx state_base(Idx b, Idx c, Idx h) const {
    return ((b * nc + c) * nh + h) * hd * ds;
  }
};

// The state passing's two expressions (K4/K6, B2 and the chunk walks of chunk_state_tc.cu), one
// definition each, so that every path forms the same bits:
//   S_0 = ssm_in + sg₋₁·(v_in[p]·k_in[n])   (sg₋₁ = dt₀·(1 − trap₀): the entering state's β term)
//   v ← e^Λ·v + contribution                (one FMA, the product of e^Λ and v not rounded)
__device__ __forceinline__ float entering_state(float ssm_in, float sgm1, float v_in, float k_in) {
  return ssm_in + sgm1 * (v_in * k_in);
}
__device__ __forceinline__ float state_step(float lam, float v, float contrib) {
  return __fmaf_rn(expf(lam), v, contrib);
}

// ---- host helpers of the launchers --------------------------------------------------------
inline const char* const kChunkWhere = "gpu::ssm_chunked";

// headdim and d_state are padded (with zeros) to 16·R, R ∈ {2, 4, 8}.
inline int pad_class(Idx v) { return v <= 32 ? 2 : v <= 64 ? 4 : 8; }

// Calls f(RH, RD) as integral constants for the padded sizes of headdim and d_state.
template <class F>
inline void with_pads(Idx hd, Idx ds, F&& f) {
  auto on_rd = [&](auto rh) {
    switch (pad_class(ds)) {
      case 2: f(rh, std::integral_constant<int, 2>{}); break;
      case 4: f(rh, std::integral_constant<int, 4>{}); break;
      default: f(rh, std::integral_constant<int, 8>{}); break;
    }
  };
  switch (pad_class(hd)) {
    case 2: on_rd(std::integral_constant<int, 2>{}); break;
    case 4: on_rd(std::integral_constant<int, 4>{}); break;
    default: on_rd(std::integral_constant<int, 8>{}); break;
  }
}

// Arguments of K2/K3 (forward) and B1 (backward): out[p, n] = Σ_s w_s U_s[p] V_s[n] per chunk.
struct ChunkStateArgs {
  const void *u, *v;        // typed [BT, di] (row stride ldu) and [BT, nh, ds]
  const float* adt;         // forward: adt [BT, nh]
  float* cum_out;           // forward: da_cumsum_saved (written)
  const float* cum_in;      // backward: da_cumsum_saved (read)
  float* da_cs_sum;         // backward: [B, nc, nh]
  float* out;               // [B, nc, nh, hd, ds]
  Idx ldu;                  // U's row stride: g.ldx (forward, U = x) or g.di (backward, U = d_y)
};

// The chunk walk (chunk_state_tc.cu): K2/K3 with K4/K6 (forward) or B1 with B2 (backward) in
// one kernel per (b, h), the state carried in registers from chunk to chunk, so that the
// contributions never go through global memory. s: as chunk_state_tc's (s.out: where the
// contributions are stored as well, for a capture; null: not at all).
struct ChunkWalkArgs {
  ChunkStateArgs s;
  float* states;                         // fwd: chunk_states_saved (S_c); bwd: dS (dS_c)
  const float* init;                     // fwd: ssm_in; bwd: d_ssm_out [B, nh, hd, ds]
  const float *dt, *trap, *k_in, *v_in;  // fwd: S_0's β term
  float *fin, *fin2;                     // fwd: final_states, ssm_out; bwd: d_ssm_in, null
  const void *k_last, *x_last;           // fwd: k [BT, nh, ds], x [BT, di] (K6 reads t = T − 1)
  float *k_out, *v_out;                  // fwd: K6
};

template <class T>
struct ClusterTail;  // chunk_tail.cuh

// Whether the chunked scan's tensor-core kernels take their wgmma instantiations where the build
// has them (tc_wgmma.cuh, M3_WGMMA); on unless a test turned it off
// (set_chunked_wgmma_for_testing, stages.cuh). Defined in chunk_bwd_tc.cu.
bool& chunked_wgmma_enabled();
// How many launches took a wgmma kernel (chunked_wgmma_launches, stages.cuh: so that a test can
// tell that the switch chose). Defined in chunk_bwd_tc.cu.
long& chunked_wgmma_launch_count();
// launch(std::true_type) where this build has a wgmma instantiation for the widths (kHas) and
// the switch is on, else launch(std::false_type): a launcher's one choice between its kernels.
template <bool kHas, class F>
void with_wgmma(F&& launch) {
  if constexpr (kHas) {
    if (chunked_wgmma_enabled()) {
      ++chunked_wgmma_launch_count();
      return launch(std::true_type{});
    }
  }
  launch(std::false_type{});
}

// B3 (step 1 of the chunked backward, §6.4) of a typed run whose chunks fit one row tile
// (g.nt == 1), on the tensor cores over bf16 planes (gpu/scan/chunk_bwd_tc.cu); dS: the per-chunk
// state gradients of state_pass_bwd. Writes dQ_mid, dK_mid, d_x, dADT, dQK_dot. With ct, step 2
// and B4b's head sums as well (chunk_tail.cuh ClusterTail), launched in clusters of ct->cz heads;
// dQ_mid and dK_mid are then written only where p's pointers are set (a capture).
template <class T>
void chunk_bwd_tc(cudaStream_t s, const ChunkGeom& g, const SsmChunkBwd<T>& p, const float* dS,
                  const ClusterTail<T>* ct = nullptr);

}  // namespace m3::gpu
