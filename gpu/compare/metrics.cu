// DeviceComparer::metrics: harness::compute_metrics / error_norms (harness/metrics.hpp) on the
// device. With o = oracle, s = subject (n values), per value i with oᵢ finite:
//   sᵢ non-finite: counted (NaN or Inf); its |Δ| reads +Inf for the worst value
//   both finite:   Δᵢ = sᵢ − oᵢ (circular: remainder(sᵢ − oᵢ, 2π)), ŝᵢ = oᵢ + Δᵢ;
//                  Σ Δ², Σ o², (full) Σ ŝ², Σ ŝo; and over R = {|oᵢ| ≥ 1e-2}: rᵢ = |Δᵢ|/|oᵢ|
//                  (max, and the nearest-rank p95 below), ulpsᵢ = |Δᵢ| / ulp_p(oᵢ) (max, Σ)
// Three steps on the stream:
//  1. measure_pairs: one MetricsAcc per block (common.cuh's reduction), fold_partials over them.
//  2. finish_worst: the worst value. The host keeps the first index of the largest |Δ|, a
//     non-finite subject reading +Inf; a NaN |Δ| (an angle difference that overflows) is kept
//     only when it is the first value with a finite oracle, and then for good. The accumulator
//     keeps the first index of the largest non-NaN |Δ| and the first such value; this step
//     looks at that first value and reads the worst pair's values.
//  3. (full) p95_rel: the k-th smallest rᵢ over R, k = ⌈0.95·|R|⌉ − 1, by an exact radix select
//     on the bits of rᵢ (non-negative doubles order as their bits; a NaN r sorts last, as on the
//     host): kSelectPasses passes of kDigitBits bits from the top, each a histogram of the
//     digit over the values whose higher digits equal the chosen prefix (integer atomics: exact
//     counts), then one thread picks the digit whose bucket holds rank k. No value is stored.
// The host then forms the figures from the sums exactly as harness/metrics.cpp does.
#include <cmath>
#include <cstring>
#include <limits>

#include "common.cuh"
#include "error.hpp"

namespace m3::gpu::compare {
namespace {

// The ulp of storage precision p at |x| (harness/ulps.hpp's ulp_of): 2^(e − m) with
// e = floor(log2 max(|x|, min_normal(p))) and m the explicit mantissa bits.
struct UlpSpec {
  int mantissa_bits;
  double min_normal;
};

UlpSpec ulp_spec(Precision p) {
  switch (p) {
    case Precision::F64: return {52, 0x1p-1022};
    case Precision::F32: return {23, 0x1p-126};
    case Precision::BF16: return {7, 0x1p-126};
    case Precision::F16: return {10, 0x1p-14};
  }
  return {23, 0x1p-126};
}

__device__ double ulp_of(double x, const UlpSpec& u) {
  const double ax = fabs(x);
  const double a = ax > u.min_normal ? ax : u.min_normal;
  if (!isfinite(a)) return INFINITY;
  const long long bits = __double_as_longlong(a);
  const int k = static_cast<int>((bits >> 52) & 0x7ff) - 1023 - u.mantissa_bits;
  if (k < -1022) return ldexp(1.0, k);
  return __longlong_as_double(static_cast<long long>(k + 1023) << 52);
}

struct MetricsParams {
  Values oracle, subject;
  Idx n;
  bool circular;
  bool full;  // the cosine, R's figures and the ulps too
  UlpSpec ulp;
};

struct MetricsAcc {
  double d2 = 0, o2 = 0, s2 = 0, so = 0, ulp_sum = 0;
  double oracle_scale = 0, max_rel = 0, max_ulps = 0;
  double worst_key = -1;            // the largest non-NaN |Δ| (+Inf: a non-finite subject)
  Idx worst_index = kNoIndex;       // its first index
  Idx first_counted = kNoIndex;     // the first index whose oracle value is finite
  Idx oracle_nonfinite = 0, nan_count = 0, inf_count = 0, finite_pairs = 0, rel_count = 0;

  __device__ void take_worst(double key, Idx i) {
    if (key > worst_key || (key == worst_key && i < worst_index)) {
      worst_key = key;
      worst_index = i;
    }
  }

  __device__ void merge(const MetricsAcc& b) {
    d2 += b.d2;
    o2 += b.o2;
    s2 += b.s2;
    so += b.so;
    ulp_sum += b.ulp_sum;
    oracle_scale = host_max(oracle_scale, b.oracle_scale);
    max_rel = host_max(max_rel, b.max_rel);
    max_ulps = host_max(max_ulps, b.max_ulps);
    take_worst(b.worst_key, b.worst_index);
    first_counted = first_counted < b.first_counted ? first_counted : b.first_counted;
    oracle_nonfinite += b.oracle_nonfinite;
    nan_count += b.nan_count;
    inf_count += b.inf_count;
    finite_pairs += b.finite_pairs;
    rel_count += b.rel_count;
  }
};

// The select's key of rᵢ: its bits, every NaN as the positive quiet NaN (above +Inf).
__device__ inline unsigned long long rel_key(double r) {
  return isnan(r) ? 0x7ff8000000000000ULL : static_cast<unsigned long long>(__double_as_longlong(r));
}

// Whether value i is in R with both values finite; then *key = rel_key(rᵢ).
__device__ inline bool rel_of(const MetricsParams& p, Idx i, unsigned long long* key) {
  const double o = load(p.oracle, i);
  const double s = load(p.subject, i);
  if (!isfinite(o) || !isfinite(s) || !(fabs(o) >= kRelThreshold)) return false;
  *key = rel_key(fabs(signed_diff(s, o, p.circular)) / fabs(o));
  return true;
}

__global__ void measure_pairs(MetricsParams p, MetricsAcc* partials) {
  MetricsAcc acc;
  const Idx stride = static_cast<Idx>(gridDim.x) * kThreads;
  for (Idx i = static_cast<Idx>(blockIdx.x) * kThreads + threadIdx.x; i < p.n; i += stride) {
    const double o = load(p.oracle, i);
    const double s = load(p.subject, i);
    if (!isfinite(o)) {
      ++acc.oracle_nonfinite;
      continue;
    }
    if (acc.first_counted == kNoIndex) acc.first_counted = i;
    acc.oracle_scale = host_max(acc.oracle_scale, fabs(o));
    if (!isfinite(s)) {
      if (isnan(s)) ++acc.nan_count;
      else ++acc.inf_count;
      acc.take_worst(INFINITY, i);
      continue;
    }
    const double d = signed_diff(s, o, p.circular);
    const double ad = fabs(d);
    ++acc.finite_pairs;
    acc.d2 += d * d;
    acc.o2 += o * o;
    if (!isnan(ad)) acc.take_worst(ad, i);
    if (p.full) {
      const double sh = o + d;
      acc.s2 += sh * sh;
      acc.so += sh * o;
      if (fabs(o) >= kRelThreshold) {
        const double r = ad / fabs(o);
        acc.max_rel = host_max(acc.max_rel, r);
        ++acc.rel_count;
        const double u = ad / ulp_of(o, p.ulp);
        acc.max_ulps = host_max(acc.max_ulps, u);
        acc.ulp_sum += u;
      }
    }
  }
  const MetricsAcc total = block_reduce(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

constexpr int kDigitBits = 9;
constexpr int kBuckets = 1 << kDigitBits;
constexpr int kSelectPasses = 7;  // 63 bits: a key's sign bit is 0

struct SelectState {
  unsigned long long prefix;  // the chosen digits so far
  unsigned long long rank;    // k within the values that match the prefix
  unsigned long long hist[kBuckets];
};

// What the host downloads: the folded accumulator, the worst value, the p95 select.
struct MetricsResult {
  MetricsAcc acc;
  Idx worst_index;  // -1: no value with a finite oracle
  double max_abs, worst_oracle, worst_subject;
  SelectState select;
};

// One thread: the worst value (see the top of the file) and the select's rank k.
__global__ void finish_worst(MetricsParams p, MetricsResult* res) {
  const MetricsAcc& acc = res->acc;
  Idx worst = acc.worst_index;
  double max_abs = acc.worst_key;
  if (acc.first_counted != kNoIndex) {
    const double o = load(p.oracle, acc.first_counted);
    const double s = load(p.subject, acc.first_counted);
    if (isfinite(s) && isnan(fabs(signed_diff(s, o, p.circular)))) {
      worst = acc.first_counted;
      max_abs = NAN;
    }
  }
  if (worst == kNoIndex) {
    res->worst_index = -1;
    res->max_abs = res->worst_oracle = res->worst_subject = 0;
  } else {
    res->worst_index = worst;
    res->max_abs = max_abs;
    res->worst_oracle = load(p.oracle, worst);
    res->worst_subject = load(p.subject, worst);
  }
  res->select.prefix = 0;
  res->select.rank =
      acc.rel_count > 0
          ? static_cast<unsigned long long>(ceil(0.95 * static_cast<double>(acc.rel_count))) - 1
          : 0;
}

// One pass of the select: the histogram of digit (key >> shift) & (kBuckets − 1) over the
// values of R whose bits above the digit equal the prefix's. A warp adds each bucket it hit
// once (its lanes grouped by bucket); the loop's trip count is uniform over the block.
__global__ void rel_histogram(MetricsParams p, SelectState* sel, int shift) {
  __shared__ unsigned int local[kBuckets];
  for (int j = threadIdx.x; j < kBuckets; j += kThreads) local[j] = 0;
  __syncthreads();
  const int high = shift + kDigitBits;
  const unsigned long long want = sel->prefix >> high;
  const Idx stride = static_cast<Idx>(gridDim.x) * kThreads;
  for (Idx base = static_cast<Idx>(blockIdx.x) * kThreads; base < p.n; base += stride) {
    const Idx i = base + threadIdx.x;
    int bucket = -1;
    unsigned long long key = 0;
    if (i < p.n && rel_of(p, i, &key) && (key >> high) == want)
      bucket = static_cast<int>((key >> shift) & (kBuckets - 1));
    const unsigned peers = __match_any_sync(0xffffffffu, bucket);
    if (bucket >= 0 && static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1)
      atomicAdd(&local[bucket], static_cast<unsigned>(__popc(peers)));
  }
  __syncthreads();
  for (int j = threadIdx.x; j < kBuckets; j += kThreads)
    if (local[j]) atomicAdd(&sel->hist[j], static_cast<unsigned long long>(local[j]));
}

// One thread: the digit whose bucket holds the rank; the histogram cleared for the next pass.
__global__ void rel_pick(SelectState* sel, int shift) {
  unsigned long long below = 0;
  for (int b = 0; b < kBuckets; ++b) {
    const unsigned long long count = sel->hist[b];
    if (sel->rank < below + count) {
      sel->prefix |= static_cast<unsigned long long>(b) << shift;
      sel->rank -= below;
      break;
    }
    below += count;
  }
  for (int b = 0; b < kBuckets; ++b) sel->hist[b] = 0;
}

}  // namespace
}  // namespace m3::gpu::compare

namespace m3::gpu {

DeviceMetrics DeviceComparer::metrics(DeviceValues oracle, DeviceValues subject, bool circular,
                                      Precision storage, bool full) {
  using namespace compare;
  const char* where = full ? "DeviceComparer::metrics" : "DeviceComparer::metrics (norms)";
  check_values(where, "oracle", oracle);
  check_values(where, "subject", subject);
  M3_REQUIRE(oracle.n == subject.n, where, "subject size differs from oracle", "subject ",
             subject.n, ", oracle ", oracle.n);
  cudaStream_t s = impl_->stream;
  const MetricsParams p{values_of(oracle), values_of(subject), oracle.n, circular, full,
                        ulp_spec(storage)};
  const unsigned blocks = grid_for(p.n);
  auto* partials =
      static_cast<MetricsAcc*>(Impl::reserve(impl_->partials, blocks * sizeof(MetricsAcc)));
  auto* res = static_cast<MetricsResult*>(Impl::reserve(impl_->results, sizeof(MetricsResult)));
  M3_CUDA_CHECK(cudaMemsetAsync(&res->select, 0, sizeof(SelectState), s));
  measure_pairs<<<blocks, kThreads, 0, s>>>(p, partials);
  M3_CUDA_CHECK(cudaGetLastError());
  fold_partials<<<1, kThreads, 0, s>>>(partials, static_cast<Idx>(blocks), &res->acc);
  M3_CUDA_CHECK(cudaGetLastError());
  finish_worst<<<1, 1, 0, s>>>(p, res);
  M3_CUDA_CHECK(cudaGetLastError());
  if (full) {
    for (int pass = 0; pass < kSelectPasses; ++pass) {
      const int shift = (kSelectPasses - 1 - pass) * kDigitBits;
      rel_histogram<<<blocks, kThreads, 0, s>>>(p, &res->select, shift);
      M3_CUDA_CHECK(cudaGetLastError());
      rel_pick<<<1, 1, 0, s>>>(&res->select, shift);
      M3_CUDA_CHECK(cudaGetLastError());
    }
  }
  MetricsResult h;
  impl_->download(&h, res, sizeof h);

  // The figures from the sums, as harness/metrics.cpp forms them.
  const MetricsAcc& a = h.acc;
  DeviceMetrics m;
  m.numel = p.n;
  m.max_abs = h.max_abs;
  m.worst_index = h.worst_index;
  m.worst_oracle = h.worst_oracle;
  m.worst_subject = h.worst_subject;
  m.oracle_scale = a.oracle_scale;
  m.nan_count = a.nan_count;
  m.inf_count = a.inf_count;
  m.oracle_nonfinite = a.oracle_nonfinite;
  m.diff_l2 = std::sqrt(a.d2);
  m.oracle_l2 = std::sqrt(a.o2);
  m.rel_l2_absolute = !(m.oracle_scale > kZeroOracle);
  if (m.rel_l2_absolute)
    m.rel_l2 =
        a.finite_pairs ? m.diff_l2 / std::sqrt(static_cast<double>(a.finite_pairs)) : 0.0;
  else
    m.rel_l2 = m.diff_l2 / m.oracle_l2;
  if (full) {
    const double sn = std::sqrt(a.s2);
    if (m.oracle_l2 > 0 && sn > 0) m.cosine = a.so / (sn * m.oracle_l2);
    else m.cosine = (m.oracle_l2 > 0 || sn > 0) ? 0.0 : 1.0;
    m.max_rel = a.max_rel;
    m.rel_count = a.rel_count;
    m.max_ulps = a.max_ulps;
    m.mean_ulps = a.rel_count ? a.ulp_sum / static_cast<double>(a.rel_count) : 0.0;
    if (a.rel_count > 0) {
      double p95 = 0;
      static_assert(sizeof p95 == sizeof h.select.prefix);
      std::memcpy(&p95, &h.select.prefix, sizeof p95);
      m.p95_rel = p95;
    }
  }
  if (m.nan_count + m.inf_count > 0) {
    m.rel_l2 = std::numeric_limits<double>::infinity();
    if (full) {
      m.p95_rel = m.max_rel = std::numeric_limits<double>::infinity();
      m.cosine = std::numeric_limits<double>::quiet_NaN();
    }
  }
  return m;
}

}  // namespace m3::gpu
