// The harness's comparison figures computed on the device (m3_gpu_compare): a subject tensor
// and its oracle, both in device memory, compared without copying either to the host.
//
// Every figure is the one harness/metrics.hpp defines (docs/HARNESS.md §3), with o = oracle,
// s = subject (n values each, widened to double):
//   Δᵢ = sᵢ − oᵢ, or for circular tensors (angles) remainder(sᵢ − oᵢ, 2π) (C remainder)
//   max_abs = maxᵢ |Δᵢ| with the lowest index of that value; oracle_scale = maxᵢ |oᵢ|
//   diff_l2 = ‖Δ‖₂, oracle_l2 = ‖o‖₂, rel_l2 = diff_l2 / oracle_l2, or ‖Δ‖₂/√(pairs) with
//     rel_l2_absolute when max|o| ≤ 1e-10 (a zero oracle)
//   R = {i : |oᵢ| ≥ 1e-2}: p95_rel (nearest rank: the ⌈0.95·|R|⌉−1-th smallest |Δᵢ|/|oᵢ|),
//     max_rel, max_ulps and mean_ulps of |Δᵢ| / ulp_p(oᵢ) (p the subject's storage precision,
//     harness/ulps.hpp's ulp)
//   cosine = Σ ŝᵢoᵢ / (‖ŝ‖₂‖o‖₂), ŝ = o + Δ; 1 when both are zero, 0 when one is
//   nan_count / inf_count: subject NaN / ±Inf where the oracle is finite; oracle_nonfinite
// Only pairs with both values finite enter the sums; a non-finite subject value where the
// oracle is finite makes max_abs, rel_l2, p95_rel and max_rel +Inf (cosine NaN).
// position_profile is harness/position.hpp's (max |Δ| and ‖Δ_t‖₂/‖o_t‖₂ per position t);
// abs_dev and condition are the per-value analysis of harness/cell_judge.cpp's
// CellJudge::condition (κᵢ = sᵢ / (u·|refᵢ|), sᵢ the largest deviation of the draws).
//
// Exactness: max_abs, the worst index and values, oracle_scale, p95_rel, max_rel, max_ulps and
// every count equal the host's bit for bit (the same expressions in IEEE double, no FMA
// contraction, an exact radix select for p95_rel); the sums (the l2 norms, cosine, mean_ulps)
// are the same terms added in another order (relative difference ~1e-13). Deterministic: every
// reduction is a fixed tree (per block, then one block over the blocks' partials, the grid a
// function of n alone), no floating-point atomics: the same inputs give the same bits on any
// device.
//
// Plain C++ header (no CUDA types), so the harness includes it without nvcc. A CPU-only build
// (M3_CUDA=OFF) links a stub: compare_unavailable() says why, every other entry throws m3::Error.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "config.hpp"     // reference/: m3::Idx
#include "precision.hpp"  // reference/: m3::Precision

namespace m3::gpu {

// The element type of a device buffer. BF16 and F16 are raw 16-bit storage (the bits of
// __nv_bfloat16 / __half).
enum class ValueType { F64, F32, BF16, F16 };

const char* value_type_name(ValueType t);  // "f64" | "f32" | "bf16" | "f16"

// A device buffer of n values of one type (data may be null only when n = 0).
struct DeviceValues {
  const void* data = nullptr;
  ValueType type = ValueType::F64;
  Idx n = 0;
};

// harness::Metrics' fields with the same meanings and defaults (harness/metrics.hpp).
struct DeviceMetrics {
  Idx numel = 0;
  double max_abs = 0;
  Idx worst_index = -1;      // -1 when no pair has a finite oracle value
  double worst_oracle = 0;
  double worst_subject = 0;
  double oracle_scale = 0;
  double oracle_l2 = 0;
  double diff_l2 = 0;
  double rel_l2 = 0;
  bool rel_l2_absolute = false;
  double p95_rel = 0;
  double max_rel = 0;
  Idx rel_count = 0;
  double cosine = 1;
  double max_ulps = 0;
  double mean_ulps = 0;
  Idx nan_count = 0;
  Idx inf_count = 0;
  Idx oracle_nonfinite = 0;
};

// Over the values of one array that are not ill-conditioned and finite: Σ a², max a, count.
struct RestSums {
  double d2 = 0, max = 0;
  Idx pairs = 0;
};

// DeviceComparer::condition's result: how many values are ill-conditioned, the largest κ among
// them (0 when none), and one RestSums per `rest` array, in their order.
struct ConditionSums {
  Idx n_ill = 0;
  double kmax = 0;
  std::vector<RestSums> rest;
};

// "" when a CUDA device is usable, else why not in one line. Never throws.
std::string compare_unavailable();

// Device memory in use on the current device, all processes and allocators together (total −
// free, cudaMemGetInfo): what a comparison samples for its peak. 0 without a device.
std::size_t device_bytes_in_use();

// Free device memory on the current device (cudaMemGetInfo). 0 without a device.
std::size_t device_bytes_free();

// Where a DeviceBuffer's bytes live. Host: page-locked host memory mapped into the device's
// address space (cudaHostAllocMapped); kernels and copies read and write it through data() as
// they would device memory, at the bus's speed, and the values are the same.
enum class Place { Device, Host };

// One allocation the device reads and writes, freed with its owner. Throws m3::Error naming the
// bytes and the place when the allocation fails. A size of 0 allocates nothing (data() is null).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes, Place place = Place::Device);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* data() { return data_; }
  const void* data() const { return data_; }
  std::size_t bytes() const { return bytes_; }
  Place place() const { return host_ ? Place::Host : Place::Device; }

 private:
  void* data_ = nullptr;  // the device's address (for Host, the mapping of host_)
  void* host_ = nullptr;  // Host: the page-locked allocation
  std::size_t bytes_ = 0;
};

// Queues the comparisons on one stream and owns their scratch memory (a few hundred KB, plus
// n/8 bytes for condition()). Every call but copy() ends by waiting for its stream; the device
// inputs must stay valid and unchanged until it returns. Throws m3::Error on a wrong argument
// (naming it) and on a CUDA failure. A moved-from comparer may only be destroyed or assigned
// to.
class DeviceComparer {
 public:
  // `stream`: a cudaStream_t to queue on (null: the comparer creates its own).
  explicit DeviceComparer(void* stream = nullptr);
  ~DeviceComparer();
  DeviceComparer(DeviceComparer&&) noexcept;
  DeviceComparer& operator=(DeviceComparer&&) noexcept;
  DeviceComparer(const DeviceComparer&) = delete;
  DeviceComparer& operator=(const DeviceComparer&) = delete;

  void* stream() const;  // the cudaStream_t it queues on

  // full: every figure of harness::compute_metrics(oracle, subject, circular, storage);
  // otherwise harness::error_norms' subset (numel, max_abs and worst_*, oracle_scale,
  // oracle_l2, diff_l2, rel_l2, rel_l2_absolute, the non-finite counts), the rest at their
  // defaults. `storage`: the subject's precision, for the ulps. oracle.n must equal subject.n.
  DeviceMetrics metrics(DeviceValues oracle, DeviceValues subject, bool circular,
                        Precision storage, bool full);

  // harness::position_profile: the values are B·T rows (r = b·T + t) of n/(B·T) values each;
  // per position t over every b and every value of the row, max_abs[t] = max |Δ| and
  // rel_l2[t] = √(Σ Δ² / Σ o²) (√Σ Δ² when Σ o² = 0). Both are resized to T.
  // Requires B, T ≥ 1 and n a multiple of B·T.
  void position_profile(DeviceValues oracle, DeviceValues subject, Idx B, Idx T, bool circular,
                        std::vector<double>* max_abs, std::vector<double>* rel_l2);

  // dst[i] = |xᵢ − refᵢ| rounded to float (the circular distance |remainder(xᵢ − refᵢ, 2π)|
  // when circular). dst: device, ref.n floats; ref.n must equal x.n. Returns when dst is
  // written.
  void abs_dev(DeviceValues ref, DeviceValues x, bool circular, float* dst);

  // CellJudge::condition's per-value analysis over n values (every pointer on the device):
  //   sᵢ = max over `devs` of devs[d][i] (NaN ignored; 0 without devs)
  //   κᵢ = sᵢ / (u·|refᵢ|), +Inf when |refᵢ| is 0 (or NaN); values with sᵢ ≤ 0 are never ill
  //   illᵢ = κᵢ ≥ from
  // n_ill = #ill, kmax = max κ over the ill, and per array a of `rest` the sums over the values
  // that are not ill and where aᵢ is finite: Σ aᵢ², max aᵢ, count.
  ConditionSums condition(const double* ref, const std::vector<const float*>& devs,
                          const std::vector<const float*>& rest, Idx n, double u, double from);

  // Device to device on the stream; either side may be a Place::Host buffer's data().
  void copy(void* dst, const void* src, std::size_t bytes);
  // Host to device and device to host, on the stream; both return when the copy is done.
  void upload(void* device_dst, const void* host_src, std::size_t bytes);
  void download(void* host_dst, const void* device_src, std::size_t bytes);
  void synchronize();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace m3::gpu
