// Internal to gpu/ (.cu files only): the RoPE rotation of one pair (MODEL.md §4 F4ef and its
// backward), shared by the RoPE kernels (rope.cu) and the chunked scan's fused backward tail
// (qk_rope_bwd_kernel, gpu/scan/chunked_bwd.cu). With (sn, cs) = (sin θ, cos θ) of the pair's angle:
//   forward      (x0, x1) → (cs·x0 − sn·x1, sn·x0 + cs·x1)
//   backward     Rᵀ(g0, g1) = (cs·g0 + sn·g1, −sn·g0 + cs·g1)
//   angle grad   dθ = −g0·r1 + g1·r0      (r = the rotated pair of the forward)
// The forward rotation is written with explicit round-to-nearest products and sums (no fma
// contraction), so that every kernel that rotates a pair gets the same bits: the chunked
// backward tail recomputes k and q from b_biased and c_biased instead of reading them. The
// backward's are written out too (one fma each), for the same reason.
#pragma once

#include "common.cuh"

namespace m3::gpu {

__device__ __forceinline__ void rope_rotate(float sn, float cs, float x0, float x1, float& y0,
                                            float& y1) {
  y0 = __fsub_rn(__fmul_rn(cs, x0), __fmul_rn(sn, x1));
  y1 = __fadd_rn(__fmul_rn(sn, x0), __fmul_rn(cs, x1));
}

// The backward's two products per value are one fma and one rounded product, written out so
// that the RoPE kernels and every tail variant that inlines them round alike (the forms ptxas
// chooses for the plain expressions, as rope_backward_kernel's SASS shows).
__device__ __forceinline__ void rope_rotate_t(float sn, float cs, float g0, float g1, float& o0,
                                              float& o1) {
  o0 = __fmaf_rn(cs, g0, __fmul_rn(sn, g1));
  o1 = fma_diff(cs, g1, sn, g0);
}

__device__ __forceinline__ float rope_angle_grad(float g0, float g1, float r0, float r1) {
  return fma_diff(g1, r0, g0, r1);
}

// Whether pair j of a row is rotated (j < na), for a pair in half `half` of the row (0: pairs
// 0 … 31, 1: 32 … 63). kFull: the official layout, ds = 128 and na = 32 (rope_layout_full,
// chunked_detail.cuh): the first half's pairs always, the second's never — known when
// compiling, so the code for the unrotated half has no rotation, sincosf or test.
template <bool kFull>
__device__ __forceinline__ bool rope_pair_rotated(unsigned half, unsigned j, unsigned na) {
  return kFull ? half == 0 : j < na;
}

}  // namespace m3::gpu
