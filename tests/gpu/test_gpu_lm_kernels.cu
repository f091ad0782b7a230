// The language-model ends' kernels of gpu/lm/lm_kernels.cu, bit for bit against plain reference
// forms (a block per row for the loss; one thread per element, a grid-stride loop over B·T·V
// or B·T·dm, for the loss's backward and the embedding).
//
// The loss per row is
//   m = max_v l[r, v],   se = Σ_v exp(l[r, v] − m),   lse[r] = m + log se          (f32)
//   row_loss[r] = w[r]·(lse[r] − l[r, tgt[r]])                                      (f64)
//   loss_sum = Σ_r row_loss[r]                                                      (f64)
// and its reductions have a fixed order: 256 threads, thread t folding v = t, t + 256, … in
// order, then a halving tree (pairs (i, i + s) for s = 128 … 1). loss_forward plays the 256
// threads of a row on one warp (8 per lane) and must give the tree's bits; the reference below
// is that tree in a block of 256 threads. loss_sum's order (256 threads of consecutive rows,
// then the tree) is replayed on the host in double.
//
// The loss's backward, d[r, v] = T(c_r·(exp(l[r, v] − lse[r]) − [v = tgt[r]])), c_r =
// float(coef·w[r]), now a warp per row: against the per-element kernel on the device (expf is
// the device's). The embedding's gather, h0[r, j] = T(float(W[tok[r], j]) + b[j]), now a block
// per row in 16-byte vectors where the row allows: against the host's float arithmetic and
// rounding, which are IEEE and so the device's.
#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "common.cuh"
#include "convert.cuh"
#include "gpu_test_util.hpp"
#include "lm_kernels.cuh"
#include "params.hpp"

namespace {

using m3::Idx;
using m3::gpu::DeviceArray;

constexpr int kThreads = 256;

template <class T>
__global__ void block_per_row_loss(Idx V, const T* __restrict__ logits,
                                   const std::int32_t* __restrict__ tgt,
                                   const float* __restrict__ w, float* __restrict__ lse,
                                   double* __restrict__ row_loss) {
  __shared__ float sh[kThreads];
  const T* l = logits + blockIdx.x * V;
  float mx = -FLT_MAX;
  for (Idx v = threadIdx.x; v < V; v += kThreads) mx = fmaxf(mx, m3::gpu::to_float(l[v]));
  sh[threadIdx.x] = mx;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + s]);
    __syncthreads();
  }
  mx = sh[0];
  __syncthreads();
  float se = 0.0f;
  for (Idx v = threadIdx.x; v < V; v += kThreads) se += expf(m3::gpu::to_float(l[v]) - mx);
  sh[threadIdx.x] = se;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sh[threadIdx.x] = sh[threadIdx.x] + sh[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float ls = mx + logf(sh[0]);
    lse[blockIdx.x] = ls;
    const float wr = w[blockIdx.x];
    row_loss[blockIdx.x] =
        wr != 0.0f ? static_cast<double>(wr) * (static_cast<double>(ls) -
                                                static_cast<double>(m3::gpu::to_float(l[tgt[blockIdx.x]])))
                   : 0.0;
  }
}

// loss_sum's order on the host: thread t sums rows t·per … in order, then the halving tree.
double tree_sum(const std::vector<double>& row) {
  const Idx BT = static_cast<Idx>(row.size());
  const Idx per = (BT + kThreads - 1) / kThreads;
  std::vector<double> acc(kThreads, 0.0);
  for (Idx t = 0; t < kThreads; ++t)
    for (Idx r = t * per; r < std::min(BT, t * per + per); ++r) acc[t] += row[r];
  for (int s = kThreads / 2; s > 0; s >>= 1)
    for (int i = 0; i < s; ++i) acc[i] = acc[i] + acc[i + s];
  return acc[0];
}

template <class T>
T from_float_host(float v);
template <>
float from_float_host<float>(float v) {
  return v;
}
template <>
__nv_bfloat16 from_float_host<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <class T>
void check_loss_rows(Idx BT, Idx V, float spread, std::uint64_t seed) {
  SCOPED_TRACE("BT " + std::to_string(BT) + ", V " + std::to_string(V) + ", spread " +
               std::to_string(spread) + (sizeof(T) == 2 ? ", bf16" : ", f32"));
  m3::Rng rng(seed);
  std::vector<T> logits(static_cast<size_t>(BT * V));
  for (auto& x : logits) x = from_float_host<T>(spread * static_cast<float>(rng.normalish()));
  std::vector<std::int32_t> tgt(static_cast<size_t>(BT));
  std::vector<float> w(static_cast<size_t>(BT));
  for (Idx r = 0; r < BT; ++r) {
    tgt[r] = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(V));
    w[r] = r % 7 == 3 ? 0.0f : 1.0f;  // rows the loss leaves out
  }
  DeviceArray<T> d_logits(BT * V);
  DeviceArray<std::int32_t> d_tgt(BT);
  DeviceArray<float> d_w(BT), lse(BT), lse_ref(BT), value(1);
  DeviceArray<double> row(BT), row_ref(BT), sum(1);
  d_logits.upload(logits.data(), nullptr);
  d_tgt.upload(tgt.data(), nullptr);
  d_w.upload(w.data(), nullptr);
  const double inv_n = 1.0 / static_cast<double>(BT);
  m3::gpu::loss_forward<T>(nullptr, BT, V, d_logits.data(), d_tgt.data(), d_w.data(), inv_n,
                           lse.data(), row.data(), sum.data(), value.data());
  block_per_row_loss<T><<<static_cast<unsigned>(BT), kThreads>>>(
      V, d_logits.data(), d_tgt.data(), d_w.data(), lse_ref.data(), row_ref.data());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> a(BT), b(BT);
  std::vector<double> ra(BT), rb(BT);
  double s = 0;
  float v = 0;
  lse.download(a.data(), nullptr);
  lse_ref.download(b.data(), nullptr);
  row.download(ra.data(), nullptr);
  row_ref.download(rb.data(), nullptr);
  sum.download(&s, nullptr);
  value.download(&v, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (Idx r = 0; r < BT; ++r) {
    ASSERT_EQ(std::memcmp(&a[r], &b[r], sizeof(float)), 0) << "lse of row " << r << ": " << a[r]
                                                           << " against " << b[r];
    ASSERT_EQ(std::memcmp(&ra[r], &rb[r], sizeof(double)), 0) << "row_loss of row " << r;
  }
  const double want = tree_sum(rb);
  EXPECT_EQ(std::memcmp(&s, &want, sizeof(double)), 0) << s << " against " << want;
  EXPECT_EQ(v, static_cast<float>(want * inv_n));
}

template <class T>
__global__ void per_element_loss_backward(Idx BT, Idx V, const T* __restrict__ logits,
                                          const float* __restrict__ lse,
                                          const std::int32_t* __restrict__ tgt,
                                          const float* __restrict__ w, double coef,
                                          T* __restrict__ d) {
  const Idx n = BT * V;
  for (Idx i = blockIdx.x * Idx(blockDim.x) + threadIdx.x; i < n; i += Idx(gridDim.x) * blockDim.x) {
    const Idx r = i / V, v = i - r * V;
    const float c = static_cast<float>(coef * static_cast<double>(w[r]));
    const float p = expf(m3::gpu::to_float(logits[i]) - lse[r]);
    d[i] = m3::gpu::from_float<T>(c * (v == tgt[r] ? p - 1.0f : p));
  }
}

template <class T>
std::vector<unsigned char> bytes_of(const DeviceArray<T>& a) {
  std::vector<unsigned char> h(static_cast<size_t>(a.size()) * sizeof(T));
  EXPECT_EQ(cudaMemcpy(h.data(), a.data(), h.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

template <class T>
void check_loss_backward(Idx BT, Idx V, std::uint64_t seed) {
  SCOPED_TRACE("BT " + std::to_string(BT) + ", V " + std::to_string(V) +
               (sizeof(T) == 2 ? ", bf16" : ", f32"));
  m3::Rng rng(seed);
  std::vector<T> logits(static_cast<size_t>(BT * V));
  for (auto& x : logits) x = from_float_host<T>(3.0f * static_cast<float>(rng.normalish()));
  std::vector<std::int32_t> tgt(static_cast<size_t>(BT));
  std::vector<float> w(static_cast<size_t>(BT)), lse(static_cast<size_t>(BT));
  for (Idx r = 0; r < BT; ++r) {
    tgt[r] = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(V));
    w[r] = r % 5 == 2 ? 0.0f : 1.0f;
    lse[r] = 2.0f + static_cast<float>(rng.uniform());
  }
  DeviceArray<T> d_logits(BT * V), d(BT * V), d_ref(BT * V);
  DeviceArray<std::int32_t> d_tgt(BT);
  DeviceArray<float> d_w(BT), d_lse(BT);
  d_logits.upload(logits.data(), nullptr);
  d_tgt.upload(tgt.data(), nullptr);
  d_w.upload(w.data(), nullptr);
  d_lse.upload(lse.data(), nullptr);
  const double coef = 1.0 / 3.0;
  m3::gpu::loss_backward<T>(nullptr, BT, V, d_logits.data(), d_lse.data(), d_tgt.data(),
                            d_w.data(), coef, d.data());
  per_element_loss_backward<T><<<256, 256>>>(BT, V, d_logits.data(), d_lse.data(), d_tgt.data(),
                                             d_w.data(), coef, d_ref.data());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(bytes_of(d) == bytes_of(d_ref));
}

TEST(GpuLmKernels, TheLossBackwardByRowsGivesThePerElementBits) {
  M3_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 90;
  for (Idx V : {29, 256, 1000})
    for (Idx BT : {1, 13, 2053}) {
      check_loss_backward<__nv_bfloat16>(BT, V, ++seed);
      check_loss_backward<float>(BT, V, ++seed);
    }
}

template <class T>
void check_embed_forward(Idx BT, Idx dm, Idx V, bool bias, Idx offset, std::uint64_t seed) {
  SCOPED_TRACE("BT " + std::to_string(BT) + ", dm " + std::to_string(dm) + (bias ? ", bias" : "") +
               ", W offset " + std::to_string(offset) + (sizeof(T) == 2 ? ", bf16" : ", f32"));
  m3::Rng rng(seed);
  std::vector<T> W(static_cast<size_t>(offset + V * dm));
  for (auto& x : W) x = from_float_host<T>(static_cast<float>(rng.normalish()));
  std::vector<float> b(static_cast<size_t>(dm));
  for (auto& x : b) x = 0.1f * static_cast<float>(rng.normalish());
  std::vector<std::int32_t> tok(static_cast<size_t>(BT));
  for (auto& t : tok) t = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(V));
  std::vector<T> want(static_cast<size_t>(BT * dm));
  for (Idx r = 0; r < BT; ++r)
    for (Idx j = 0; j < dm; ++j) {
      const float x = static_cast<float>(W[offset + tok[r] * dm + j]);
      want[r * dm + j] = from_float_host<T>(bias ? x + b[j] : x);
    }
  DeviceArray<T> d_W(offset + V * dm), h0(BT * dm);
  DeviceArray<float> d_b(dm);
  DeviceArray<std::int32_t> d_tok(BT);
  d_W.upload(W.data(), nullptr);
  d_b.upload(b.data(), nullptr);
  d_tok.upload(tok.data(), nullptr);
  m3::gpu::embed_forward<T>(nullptr, BT, dm, d_tok.data(), d_W.data() + offset,
                            bias ? d_b.data() : nullptr, h0.data());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<unsigned char> w_bytes(want.size() * sizeof(T));
  std::memcpy(w_bytes.data(), want.data(), w_bytes.size());
  EXPECT_TRUE(bytes_of(h0) == w_bytes);
}

// Rows of whole vectors (dm 1024, 64), rows that end mid-vector (dm 36 in bf16, 30 in f32: the
// element path), a weight that starts off the 16-byte grid (the element path), with and
// without the bias.
TEST(GpuLmKernels, TheEmbeddingsGatherGivesTheBitsOfTheHostsArithmetic) {
  M3_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 130;
  for (bool bias : {true, false}) {
    check_embed_forward<__nv_bfloat16>(300, 1024, 50, bias, 0, ++seed);
    check_embed_forward<__nv_bfloat16>(77, 64, 7, bias, 0, ++seed);
    check_embed_forward<__nv_bfloat16>(77, 36, 7, bias, 0, ++seed);
    check_embed_forward<__nv_bfloat16>(77, 64, 7, bias, 3, ++seed);
    check_embed_forward<float>(300, 1024, 50, bias, 0, ++seed);
    check_embed_forward<float>(77, 30, 7, bias, 0, ++seed);
    check_embed_forward<float>(77, 64, 7, bias, 1, ++seed);
  }
}

// Vocabularies below, at and above the 256 threads (V = 256: one element per thread; 1000: four
// rounds, the last one partial), row counts not a multiple of the 8 rows of a block, and a
// spread that puts exp far from 1; bf16 and f32 logits.
TEST(GpuLmKernels, TheLossByWarpsGivesTheBitsOfTheBlockTree) {
  M3_SKIP_WITHOUT_GPU();
  std::uint64_t seed = 40;
  for (Idx V : {29, 256, 300, 1000})
    for (Idx BT : {1, 13, 2053}) {
      check_loss_rows<__nv_bfloat16>(BT, V, 3.0f, ++seed);
      check_loss_rows<float>(BT, V, 12.0f, ++seed);
    }
  check_loss_rows<__nv_bfloat16>(32768, 256, 3.0f, ++seed);  // the official shape's byte model
}

}  // namespace
