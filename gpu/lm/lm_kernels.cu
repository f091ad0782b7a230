// The language-model ends' kernels and launchers (lm_kernels.cuh has the math). Every
// reduction is a fixed tree over a fixed assignment of elements to threads, so every result
// is bit-identical run to run (MODEL.md §7).
#include "lm_kernels.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>

#include "common.cuh"
#include "convert.cuh"
#include "reduce.cuh"

namespace m3::gpu {

namespace {

constexpr int kRowThreads = 256;  // one block per row for the loss and argmax kernels

// One block per row r: h0[r, :] = W[tok[r], :] (+ b), in 16-byte vectors where the rows allow
// (vec: dm a multiple of the vector and the arrays aligned), else element by element; either
// way each element is the one expression from_float(w + b[j]).
constexpr int kEmbedThreads = 128;
template <class T>
__global__ void embed_forward_kernel(Idx dm, bool vec, const std::int32_t* __restrict__ tok,
                                     const T* __restrict__ W, const float* __restrict__ b,
                                     T* __restrict__ h0) {
  const Idx r = blockIdx.x;
  const T* src = W + static_cast<Idx>(tok[r]) * dm;
  T* dst = h0 + r * dm;
  constexpr int E = 16 / sizeof(T);
  if (vec) {
    for (Idx j = Idx(threadIdx.x) * E; j < dm; j += Idx(blockDim.x) * E) {
      const uint4 in = *reinterpret_cast<const uint4*>(src + j);
      const T* x = reinterpret_cast<const T*>(&in);
      uint4 out;
      T* y = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const float w = to_float(x[e]);
        y[e] = from_float<T>(b ? w + b[j + e] : w);
      }
      *reinterpret_cast<uint4*>(dst + j) = out;
    }
    return;
  }
  for (Idx j = threadIdx.x; j < dm; j += blockDim.x) {
    const float w = to_float(src[j]);
    dst[j] = from_float<T>(b ? w + b[j] : w);
  }
}

template <class T>
__global__ void embed_one_hot_kernel(Idx BT, Idx V, const std::int32_t* __restrict__ tok,
                                     T* __restrict__ x) {
  const Idx n = BT * V;
  for (Idx i = blockIdx.x * Idx(blockDim.x) + threadIdx.x; i < n; i += Idx(gridDim.x) * blockDim.x) {
    const Idx r = i / V, v = i - r * V;
    x[i] = from_float<T>(v == tok[r] ? 1.0f : 0.0f);
  }
}

// Stage 1: block (chunk, column tile), thread j sums the chunk's rows in order.
template <class T>
__global__ void embed_chunk_kernel(Idx dm, const T* __restrict__ dH,
                                   const std::int32_t* __restrict__ perm,
                                   const EmbedChunk* __restrict__ chunks,
                                   float* __restrict__ partial) {
  const EmbedChunk c = chunks[blockIdx.y];
  const Idx j = blockIdx.x * Idx(blockDim.x) + threadIdx.x;
  if (j >= dm) return;
  float acc = 0.0f;
  for (int i = c.begin; i < c.end; ++i) acc += to_float(dH[static_cast<Idx>(perm[i]) * dm + j]);
  partial[static_cast<Idx>(blockIdx.y) * dm + j] = acc;
}

// Stage 2: block (token, column tile), thread j sums the token's chunk partials in order.
__global__ void embed_token_kernel(Idx dm, const std::int32_t* __restrict__ token_chunks,
                                   const float* __restrict__ partial, float* __restrict__ dW) {
  const Idx v = blockIdx.y;
  const Idx j = blockIdx.x * Idx(blockDim.x) + threadIdx.x;
  const int c0 = token_chunks[v], c1 = token_chunks[v + 1];
  if (j >= dm || c0 == c1) return;
  float acc = 0.0f;
  for (int c = c0; c < c1; ++c) acc += partial[static_cast<Idx>(c) * dm + j];
  dW[v * dm + j] += acc;
}

// A fixed tree over kRowThreads values in shared memory (the same pairing every run).
template <class V, class Op>
__device__ V block_tree(V* sh, V x, Op op) {
  sh[threadIdx.x] = x;
  __syncthreads();
  for (int s = kRowThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] = op(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  const V r = sh[0];
  __syncthreads();
  return r;
}

struct MaxOp {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct AddF {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct AddD {
  __device__ double operator()(double a, double b) const { return a + b; }
};

// kRowThreads "virtual threads" of one row on one warp: lane L plays t = L + 32·j, j < kPerLane.
// Each virtual thread folds its elements v = t, t + kRowThreads, … in order, then the pairs of
// block_tree are formed in block_tree's order (s = 128, 64, 32 among a lane's own values, then
// s = 16 … 1 across lanes), so the result has block_tree's bits: a row's reductions give the
// same floats as one block per row, on an eighth of the threads and without a barrier.
constexpr int kPerLane = kRowThreads / 32;

// The warp-per-row kernels' layout: kRowThreads / 32 rows per block, warp w of block b on row
// b·(kRowThreads / 32) + w; the blocks that cover BT rows.
constexpr Idx kWarpRows = kRowThreads / 32;
__device__ __forceinline__ Idx warp_row() {
  return blockIdx.x * kWarpRows + (threadIdx.x >> 5);
}
unsigned warp_row_blocks(Idx BT) {
  return static_cast<unsigned>((BT + kWarpRows - 1) / kWarpRows);
}
static_assert(kRowThreads == 256, "the warp replay below pairs 8 values per lane");

template <class Op>
__device__ float warp_replay_tree(float (&x)[kPerLane], Op op) {
#pragma unroll
  for (int j = 0; j < 4; ++j) x[j] = op(x[j], x[j + 4]);  // s = 128
#pragma unroll
  for (int j = 0; j < 2; ++j) x[j] = op(x[j], x[j + 2]);  // s = 64
  float r = op(x[0], x[1]);                                // s = 32
#pragma unroll
  for (int sh = 16; sh > 0; sh >>= 1) r = op(r, __shfl_down_sync(0xffffffffu, r, sh));
  return __shfl_sync(0xffffffffu, r, 0);
}

// One warp per row (kRowThreads / 32 rows per block): lse[r] and row_loss[r], the bits of one
// block per row with block_tree (above).
template <class T>
__global__ void loss_row_kernel(Idx BT, Idx V, const T* __restrict__ logits,
                                const std::int32_t* __restrict__ tgt, const float* __restrict__ w,
                                float* __restrict__ lse, double* __restrict__ row_loss) {
  const int lane = threadIdx.x & 31;
  const Idx r = warp_row();
  if (r >= BT) return;  // whole warps: every lane of a warp has the same r
  const T* l = logits + r * V;
  float x[kPerLane];
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    x[j] = -FLT_MAX;
    for (Idx v = lane + 32 * j; v < V; v += kRowThreads) x[j] = fmaxf(x[j], to_float(l[v]));
  }
  const float mx = warp_replay_tree(x, MaxOp{});
#pragma unroll
  for (int j = 0; j < kPerLane; ++j) {
    x[j] = 0.0f;
    for (Idx v = lane + 32 * j; v < V; v += kRowThreads) x[j] += expf(to_float(l[v]) - mx);
  }
  const float se = warp_replay_tree(x, AddF{});
  if (lane == 0) {
    const float ls = mx + logf(se);
    lse[r] = ls;
    const float wr = w[r];
    row_loss[r] = wr != 0.0f ? static_cast<double>(wr) *
                                   (static_cast<double>(ls) - static_cast<double>(to_float(l[tgt[r]])))
                             : 0.0;
  }
}

// One block: thread i sums rows i·per … in order, then a fixed tree. The loads go out
// kSumBatch at a time so that their latencies overlap; the additions keep their order.
constexpr int kSumBatch = 16;
__global__ void loss_sum_kernel(Idx BT, const double* __restrict__ row_loss, double inv_n,
                                double* __restrict__ out, float* __restrict__ value) {
  __shared__ double sh[kRowThreads];
  const Idx per = (BT + kRowThreads - 1) / kRowThreads;
  const Idx a = threadIdx.x * per, e = a + per < BT ? a + per : BT;
  double acc = 0.0;
  Idx r = a;
  for (; r + kSumBatch <= e; r += kSumBatch) {
    double x[kSumBatch];
#pragma unroll
    for (int j = 0; j < kSumBatch; ++j) x[j] = row_loss[r + j];
#pragma unroll
    for (int j = 0; j < kSumBatch; ++j) acc += x[j];
  }
  for (; r < e; ++r) acc += row_loss[r];
  acc = block_tree(sh, acc, AddD{});
  if (threadIdx.x == 0) {
    *out = acc;
    *value = static_cast<float>(acc * inv_n);
  }
}

// One warp per row (kRowThreads / 32 rows per block); lane L writes v = L, L + 32, …
template <class T>
__global__ void loss_backward_kernel(Idx BT, Idx V, const T* __restrict__ logits,
                                     const float* __restrict__ lse,
                                     const std::int32_t* __restrict__ tgt,
                                     const float* __restrict__ w, double coef,
                                     T* __restrict__ d) {
  const Idx r = warp_row();
  if (r >= BT) return;
  const float c = static_cast<float>(coef * static_cast<double>(w[r]));
  const float ls = lse[r];
  const Idx t = tgt[r];
  const T* l = logits + r * V;
  T* dr = d + r * V;
  for (Idx v = threadIdx.x & 31; v < V; v += 32) {
    const float p = expf(to_float(l[v]) - ls);
    dr[v] = from_float<T>(c * (v == t ? p - 1.0f : p));
  }
}

template <class T>
__global__ void argmax_kernel(Idx V, const T* __restrict__ logits, std::int32_t* __restrict__ out) {
  __shared__ float shv[kRowThreads];
  __shared__ int shi[kRowThreads];
  const Idx r = blockIdx.x;
  const T* l = logits + r * V;
  float best = -FLT_MAX;
  int bi = static_cast<int>(V);
  for (Idx v = threadIdx.x; v < V; v += kRowThreads) {
    const float x = to_float(l[v]);
    if (x > best) { best = x; bi = static_cast<int>(v); }
  }
  shv[threadIdx.x] = best;
  shi[threadIdx.x] = bi;
  __syncthreads();
  for (int s = kRowThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      const float ov = shv[threadIdx.x + s];
      const int oi = shi[threadIdx.x + s];
      if (ov > shv[threadIdx.x] || (ov == shv[threadIdx.x] && oi < shi[threadIdx.x])) {
        shv[threadIdx.x] = ov;
        shi[threadIdx.x] = oi;
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[r] = shi[0] < V ? shi[0] : 0;
}

unsigned blocks_for(Idx n) {
  const Idx b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < kMaxBlocks ? (b > 0 ? b : 1) : kMaxBlocks);
}

}  // namespace

template <class T>
void embed_forward(cudaStream_t s, Idx BT, Idx dm, const std::int32_t* tok, const T* W,
                   const float* b, T* h0) {
  if (BT * dm == 0) return;
  constexpr Idx E = 16 / sizeof(T);
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  const bool vec = dm % E == 0 && aligned(W) && aligned(h0) && (!b || aligned(b));
  embed_forward_kernel<T><<<static_cast<unsigned>(BT), kEmbedThreads, 0, s>>>(dm, vec, tok, W, b,
                                                                             h0);
  M3_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void embed_one_hot(cudaStream_t s, Idx BT, Idx V, const std::int32_t* tok, T* x) {
  if (BT * V == 0) return;
  embed_one_hot_kernel<T><<<blocks_for(BT * V), kThreads, 0, s>>>(BT, V, tok, x);
  M3_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void embed_backward(cudaStream_t s, Idx V, Idx dm, const T* dH, const std::int32_t* perm,
                    const EmbedChunk* chunks, Idx n_chunks, const std::int32_t* token_chunks,
                    float* partial, float* dW) {
  if (n_chunks == 0 || dm == 0) return;
  const unsigned tiles = static_cast<unsigned>((dm + kThreads - 1) / kThreads);
  embed_chunk_kernel<T><<<dim3(tiles, static_cast<unsigned>(n_chunks)), kThreads, 0, s>>>(
      dm, dH, perm, chunks, partial);
  M3_CUDA_CHECK(cudaGetLastError());
  embed_token_kernel<<<dim3(tiles, static_cast<unsigned>(V)), kThreads, 0, s>>>(dm, token_chunks,
                                                                                 partial, dW);
  M3_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void loss_forward(cudaStream_t s, Idx BT, Idx V, const T* logits, const std::int32_t* tgt,
                  const float* w, double inv_n, float* lse, double* row_loss, double* loss_sum,
                  float* value) {
  loss_row_kernel<T><<<warp_row_blocks(BT), kRowThreads, 0, s>>>(BT, V, logits, tgt, w, lse,
                                                                   row_loss);
  M3_CUDA_CHECK(cudaGetLastError());
  loss_sum_kernel<<<1, kRowThreads, 0, s>>>(BT, row_loss, inv_n, loss_sum, value);
  M3_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void loss_backward(cudaStream_t s, Idx BT, Idx V, const T* logits, const float* lse,
                   const std::int32_t* tgt, const float* w, double coef, T* d_logits) {
  if (BT * V == 0) return;
  loss_backward_kernel<T><<<warp_row_blocks(BT), kRowThreads, 0, s>>>(BT, V, logits, lse, tgt,
                                                                       w, coef, d_logits);
  M3_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void argmax_rows(cudaStream_t s, Idx BT, Idx V, const T* logits, std::int32_t* out) {
  argmax_kernel<T><<<static_cast<unsigned>(BT), kRowThreads, 0, s>>>(V, logits, out);
  M3_CUDA_CHECK(cudaGetLastError());
}

#define M3_INSTANTIATE(T)                                                                       \
  template void embed_forward<T>(cudaStream_t, Idx, Idx, const std::int32_t*, const T*,        \
                                 const float*, T*);                                            \
  template void embed_one_hot<T>(cudaStream_t, Idx, Idx, const std::int32_t*, T*);             \
  template void embed_backward<T>(cudaStream_t, Idx, Idx, const T*, const std::int32_t*,       \
                                  const EmbedChunk*, Idx, const std::int32_t*, float*, float*); \
  template void loss_forward<T>(cudaStream_t, Idx, Idx, const T*, const std::int32_t*,         \
                                const float*, double, float*, double*, double*, float*);       \
  template void loss_backward<T>(cudaStream_t, Idx, Idx, const T*, const float*,               \
                                 const std::int32_t*, const float*, double, T*);               \
  template void argmax_rows<T>(cudaStream_t, Idx, Idx, const T*, std::int32_t*);
M3_FOR_EACH_STORAGE(M3_INSTANTIATE)
#undef M3_INSTANTIATE

}  // namespace m3::gpu
