// Internal to gpu/ (.cu files only): the language-model ends' kernels (TRAINING.md §1; the
// reference is reference/lm.cpp, the math in reference/lm.hpp). The head's GEMMs are
// stages/gemm.cu's; these are the rest:
//
//   embed_forward    h0[r, j] = from_float<T>(W[tok[r], j] + b[j])   W the GEMM weight's copy
//                    (typed; f32 master when T = float): the bits of the one-hot GEMM, whose
//                    product is exact, rounded once with the bias as gemm_forward does
//   embed_one_hot    x[r, v] = [v = tok[r]]   (the one-hot input, for a Capture only)
//   embed_backward   dW[v, j] += Σ_{r: tok[r] = v} dH[r, j], deterministic in two stages: the
//                    rows of each token (host-sorted by token, then r: `perm`) are cut into
//                    chunks of ≤ kEmbedChunk rows; stage 1 sums each chunk from zero in row
//                    order → partial[chunk, j]; stage 2 sums a token's chunks in order from
//                    zero, then adds the result to dW. No atomics; the order depends only on
//                    the tokens.
//   loss_forward     per row (one warp): m = max_v logits, se = Σ_v exp(l − m) by a fixed
//                    tree (256 threads' order, thread t folding v = t, t + 256, … then a halving
//                    tree, replayed on the warp's lanes: tests/gpu/test_gpu_lm_kernels.cu holds it to
//                    a block per row bit for bit), lse = m + log se (f32); row_loss[r] =
//                    w·(lse − l[tgt]) (f64); then one block sums row_loss in a fixed order
//                    (f64) → *loss_sum.
//   loss_backward    d[r, v] = from_float<T>(c_r · (exp(l − lse[r]) − [v = tgt[r]])),
//                    c_r = float(coef · w[r]), coef = scale / N
//   argmax           per row the first v of the largest logit
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "config.hpp"

namespace m3::gpu {

constexpr Idx kEmbedChunk = 64;  // rows per chunk of the embedding backward's stage 1

// A chunk of the embedding backward: rows perm[begin, end) all have token v.
struct EmbedChunk {
  std::int32_t v, begin, end;
};

template <class T>
void embed_forward(cudaStream_t s, Idx BT, Idx dm, const std::int32_t* tok, const T* W,
                   const float* b, T* h0);
template <class T>
void embed_one_hot(cudaStream_t s, Idx BT, Idx V, const std::int32_t* tok, T* x);
// chunks [n_chunks] (device), token_chunks [V + 1] (device: token v's chunks are
// token_chunks[v] … token_chunks[v+1]), partial ≥ n_chunks·dm floats.
template <class T>
void embed_backward(cudaStream_t s, Idx V, Idx dm, const T* dH, const std::int32_t* perm,
                    const EmbedChunk* chunks, Idx n_chunks, const std::int32_t* token_chunks,
                    float* partial, float* dW);

// row_loss ≥ BT doubles of scratch; loss_sum: one double (device), Σ_r w·(lse − logit[tgt]);
// value: one float (device), float(loss_sum · inv_n).
template <class T>
void loss_forward(cudaStream_t s, Idx BT, Idx V, const T* logits, const std::int32_t* tgt,
                  const float* w, double inv_n, float* lse, double* row_loss, double* loss_sum,
                  float* value);
template <class T>
void loss_backward(cudaStream_t s, Idx BT, Idx V, const T* logits, const float* lse,
                   const std::int32_t* tgt, const float* w, double coef, T* d_logits);
template <class T>
void argmax_rows(cudaStream_t s, Idx BT, Idx V, const T* logits, std::int32_t* out);

}  // namespace m3::gpu
