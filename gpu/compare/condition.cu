// The per-value analysis of ill-conditioned values (harness/cell_judge.cpp, CellJudge::condition;
// docs/HARNESS.md §4) on the device.
//
// abs_dev:   devᵢ = |xᵢ − refᵢ| (angles: |remainder(xᵢ − refᵢ, 2π)|), rounded to float — a
//            draw's deviation from its reference, or the subject's from the oracle.
// condition: over n values, with the draws' deviations devs[d] and the reference ref,
//              sᵢ = max_d devs[d][i]            (starting at 0; a NaN leaves the max)
//              κᵢ = sᵢ / (u·|refᵢ|), +Inf when |refᵢ| is not > 0
//              illᵢ = sᵢ > 0 and κᵢ ≥ from
//            n_ill = #ill, kmax = max κ over the ill; then for each array a of `rest`, over
//            the values not ill with aᵢ finite: Σ aᵢ², max aᵢ (from 0), the count.
// Steps: mark_ill writes one bit per value (a warp's 32 values are one word, by ballot) and one
// IllAcc per block; sum_rest reads the bits, one launch per rest array; each reduction is
// common.cuh's (blocks, then fold_partials), its total in the results buffer, downloaded once.
#include <cmath>
#include <cstring>
#include <vector>

#include "common.cuh"
#include "error.hpp"

namespace m3::gpu::compare {
namespace {

__global__ void abs_dev_kernel(Values ref, Values x, Idx n, bool circular, float* dst) {
  const Idx stride = static_cast<Idx>(gridDim.x) * kThreads;
  for (Idx i = static_cast<Idx>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride)
    dst[i] = static_cast<float>(fabs(signed_diff(load(x, i), load(ref, i), circular)));
}

struct ConditionParams {
  const double* ref;
  const float* const* devs;  // device table of n_devs device pointers
  int n_devs;
  Idx n;
  double u, from;
  std::uint32_t* ill_mask;  // ⌈n/32⌉ words: bit i%32 of word i/32 is illᵢ
};

struct IllAcc {
  Idx n_ill = 0;
  double kmax = 0;

  __device__ void merge(const IllAcc& b) {
    n_ill += b.n_ill;
    kmax = host_max(kmax, b.kmax);
  }
};

struct RestAcc {
  double d2 = 0, max = 0;
  Idx pairs = 0;

  __device__ void merge(const RestAcc& b) {
    d2 += b.d2;
    max = host_max(max, b.max);
    pairs += b.pairs;
  }
};

// The loop's trip count is uniform over the block (every warp reaches each ballot whole).
__global__ void mark_ill(ConditionParams p, IllAcc* partials) {
  IllAcc acc;
  const Idx stride = static_cast<Idx>(gridDim.x) * kThreads;
  for (Idx base = static_cast<Idx>(blockIdx.x) * kThreads; base < p.n; base += stride) {
    const Idx i = base + threadIdx.x;
    bool ill = false;
    if (i < p.n) {
      double s = 0;
      for (int d = 0; d < p.n_devs; ++d) s = host_max(s, static_cast<double>(p.devs[d][i]));
      if (s > 0) {
        const double a = fabs(p.ref[i]);
        const double kappa = a > 0 ? s / (p.u * a) : INFINITY;
        if (kappa >= p.from) {
          ill = true;
          ++acc.n_ill;
          acc.kmax = host_max(acc.kmax, kappa);
        }
      }
    }
    const unsigned word = __ballot_sync(0xffffffffu, ill);
    if ((threadIdx.x & 31) == 0 && i < p.n) p.ill_mask[i >> 5] = word;
  }
  const IllAcc total = block_reduce(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void sum_rest(const float* a, const std::uint32_t* ill_mask, Idx n,
                         RestAcc* partials) {
  RestAcc acc;
  const Idx stride = static_cast<Idx>(gridDim.x) * kThreads;
  for (Idx i = static_cast<Idx>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    if ((ill_mask[i >> 5] >> (i & 31)) & 1u) continue;
    const double v = a[i];
    if (!isfinite(v)) continue;
    acc.d2 += v * v;
    acc.max = host_max(acc.max, v);
    ++acc.pairs;
  }
  const RestAcc total = block_reduce(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

}  // namespace
}  // namespace m3::gpu::compare

namespace m3::gpu {

void DeviceComparer::abs_dev(DeviceValues ref, DeviceValues x, bool circular, float* dst) {
  using namespace compare;
  const char* where = "DeviceComparer::abs_dev";
  check_values(where, "ref", ref);
  check_values(where, "x", x);
  M3_REQUIRE(ref.n == x.n, where, "x size differs from ref", "x ", x.n, ", ref ", ref.n);
  M3_REQUIRE(dst || ref.n == 0, where, "null destination", "n ", ref.n);
  if (ref.n == 0) return;
  abs_dev_kernel<<<grid_for(ref.n), kThreads, 0, impl_->stream>>>(values_of(ref), values_of(x),
                                                                   ref.n, circular, dst);
  M3_CUDA_CHECK(cudaGetLastError());
  M3_CUDA_CHECK(cudaStreamSynchronize(impl_->stream));
}

ConditionSums DeviceComparer::condition(const double* ref, const std::vector<const float*>& devs,
                                        const std::vector<const float*>& rest, Idx n, double u,
                                        double from) {
  using namespace compare;
  const char* where = "DeviceComparer::condition";
  M3_REQUIRE(n >= 0, where, "negative size", "n ", n);
  M3_REQUIRE(ref || n == 0, where, "null ref", "n ", n);
  for (std::size_t d = 0; d < devs.size(); ++d)
    M3_REQUIRE(devs[d] || n == 0, where, "null deviation array", "devs[", d, "], n ", n);
  for (std::size_t r = 0; r < rest.size(); ++r)
    M3_REQUIRE(rest[r] || n == 0, where, "null rest array", "rest[", r, "], n ", n);
  M3_REQUIRE(devs.size() <= 0x7fffffff, where, "too many deviation arrays", devs.size());
  ConditionSums out;
  out.rest.resize(rest.size());
  if (n == 0) return out;

  cudaStream_t s = impl_->stream;
  const unsigned blocks = grid_for(n);
  const std::size_t partial_bytes = blocks * std::max(sizeof(IllAcc), sizeof(RestAcc));
  void* partials = Impl::reserve(impl_->partials, partial_bytes);
  const std::size_t ill_bytes = sizeof(IllAcc);
  auto* totals = static_cast<unsigned char*>(
      Impl::reserve(impl_->results, ill_bytes + rest.size() * sizeof(RestAcc)));
  auto* ill_total = reinterpret_cast<IllAcc*>(totals);
  auto* rest_totals = reinterpret_cast<RestAcc*>(totals + ill_bytes);
  static_assert(sizeof(IllAcc) % alignof(RestAcc) == 0);

  ConditionParams p{ref, nullptr, static_cast<int>(devs.size()), n, u, from, nullptr};
  p.ill_mask = static_cast<std::uint32_t*>(Impl::reserve(
      impl_->ill_mask, static_cast<std::size_t>((n + 31) / 32) * sizeof(std::uint32_t)));
  if (!devs.empty()) {
    void* table = Impl::reserve(impl_->table, devs.size() * sizeof(const float*));
    // From pageable memory: the call returns once `devs` is staged, so it may go out of scope.
    M3_CUDA_CHECK(cudaMemcpyAsync(table, devs.data(), devs.size() * sizeof(const float*),
                                  cudaMemcpyHostToDevice, s));
    p.devs = static_cast<const float* const*>(table);
  }
  mark_ill<<<blocks, kThreads, 0, s>>>(p, static_cast<IllAcc*>(partials));
  M3_CUDA_CHECK(cudaGetLastError());
  fold_partials<<<1, kThreads, 0, s>>>(static_cast<const IllAcc*>(partials),
                                       static_cast<Idx>(blocks), ill_total);
  M3_CUDA_CHECK(cudaGetLastError());
  for (std::size_t r = 0; r < rest.size(); ++r) {
    sum_rest<<<blocks, kThreads, 0, s>>>(rest[r], p.ill_mask, n, static_cast<RestAcc*>(partials));
    M3_CUDA_CHECK(cudaGetLastError());
    fold_partials<<<1, kThreads, 0, s>>>(static_cast<const RestAcc*>(partials),
                                         static_cast<Idx>(blocks), rest_totals + r);
    M3_CUDA_CHECK(cudaGetLastError());
  }
  std::vector<unsigned char> h(ill_bytes + rest.size() * sizeof(RestAcc));
  impl_->download(h.data(), totals, h.size());
  IllAcc ill;
  std::memcpy(&ill, h.data(), sizeof ill);
  out.n_ill = ill.n_ill;
  out.kmax = ill.kmax;
  for (std::size_t r = 0; r < rest.size(); ++r) {
    RestAcc a;
    std::memcpy(&a, h.data() + ill_bytes + r * sizeof(RestAcc), sizeof a);
    out.rest[r].d2 = a.d2;
    out.rest[r].max = a.max;
    out.rest[r].pairs = a.pairs;
  }
  return out;
}

}  // namespace m3::gpu
