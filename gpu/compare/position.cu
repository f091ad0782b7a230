// DeviceComparer::position_profile: harness::position_profile (harness/position.hpp) on the
// device. The n values are B·T rows r = b·T + t of `row` = n/(B·T) values; per position t,
// over every b and every value j of the row (value (b·T + t)·row + j):
//   max_abs[t] = max |Δ|  (a NaN Δ leaves the max, as std::max does on the host),
//   Σ Δ², Σ o²            (every value, finite or not, as on the host),
// with Δ = s − o, or remainder(s − o, 2π) for angles. One block per position (a grid-stride
// loop over t), its threads over the B·row values in order, then common.cuh's block tree; the
// host forms rel_l2[t] = √(ΣΔ²/Σo²), or √ΣΔ² when Σo² = 0, as position.cpp does.
#include <cmath>

#include "common.cuh"
#include "error.hpp"

namespace m3::gpu::compare {
namespace {

constexpr Idx kMaxPositionBlocks = 4096;

struct PositionParams {
  Values oracle, subject;
  Idx B, T, row;
  bool circular;
};

struct PositionAcc {
  double max_abs = 0, d2 = 0, o2 = 0;

  __device__ void merge(const PositionAcc& b) {
    max_abs = host_max(max_abs, b.max_abs);
    d2 += b.d2;
    o2 += b.o2;
  }
};

__global__ void position_sums(PositionParams p, PositionAcc* out) {
  const Idx per_position = p.B * p.row;
  for (Idx t = blockIdx.x; t < p.T; t += gridDim.x) {
    PositionAcc acc;
    for (Idx j = threadIdx.x; j < per_position; j += kThreads) {
      const Idx b = j / p.row;
      const Idx i = (b * p.T + t) * p.row + (j - b * p.row);
      const double o = load(p.oracle, i);
      const double d = signed_diff(load(p.subject, i), o, p.circular);
      acc.max_abs = host_max(acc.max_abs, fabs(d));
      acc.d2 += d * d;
      acc.o2 += o * o;
    }
    const PositionAcc total = block_reduce(acc);
    if (threadIdx.x == 0) out[t] = total;
  }
}

}  // namespace
}  // namespace m3::gpu::compare

namespace m3::gpu {

void DeviceComparer::position_profile(DeviceValues oracle, DeviceValues subject, Idx B, Idx T,
                                      bool circular, std::vector<double>* max_abs,
                                      std::vector<double>* rel_l2) {
  using namespace compare;
  const char* where = "DeviceComparer::position_profile";
  check_values(where, "oracle", oracle);
  check_values(where, "subject", subject);
  M3_REQUIRE(oracle.n == subject.n, where, "subject size differs from oracle", "subject ",
             subject.n, ", oracle ", oracle.n);
  M3_REQUIRE(B >= 1 && T >= 1 && oracle.n % (B * T) == 0, where,
             "the values are not B*T rows of equal length", "n ", oracle.n, ", B ", B, ", T ", T);
  M3_REQUIRE(max_abs && rel_l2, where, "null output vector", "");
  cudaStream_t s = impl_->stream;
  const PositionParams p{values_of(oracle), values_of(subject), B, T, oracle.n / (B * T),
                         circular};
  auto* sums = static_cast<PositionAcc*>(
      Impl::reserve(impl_->results, static_cast<std::size_t>(T) * sizeof(PositionAcc)));
  const unsigned blocks = static_cast<unsigned>(std::min<Idx>(T, kMaxPositionBlocks));
  position_sums<<<blocks, kThreads, 0, s>>>(p, sums);
  M3_CUDA_CHECK(cudaGetLastError());
  std::vector<PositionAcc> h(static_cast<std::size_t>(T));
  impl_->download(h.data(), sums, h.size() * sizeof(PositionAcc));
  max_abs->assign(h.size(), 0.0);
  rel_l2->assign(h.size(), 0.0);
  for (std::size_t t = 0; t < h.size(); ++t) {
    (*max_abs)[t] = h[t].max_abs;
    (*rel_l2)[t] = h[t].o2 > 0 ? std::sqrt(h[t].d2 / h[t].o2) : std::sqrt(h[t].d2);
  }
}

}  // namespace m3::gpu
