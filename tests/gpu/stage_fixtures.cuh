// What the GPU stage test files share (tests/gpu/stages/test_*.cu, one per stage family of
// gpu/stages/, tests/gpu/core/test_convert.cu, tests/gpu/test_gpu_ssm_typed.cu): the stream and
// upload/download helpers, the storage types bf16/f16 and their rounding, the host "worlds" of
// the family-A stages (the f32 one and the typed one), and the comparisons with their
// tolerances:
//   f32 outputs (expect_close): rel_l2 ≤ 1e-5 and max|gpu − ref| / max|ref| ≤ 1e-4, both the
//     harness metrics (test_compare.hpp) of gpu against ref — float vs float, different
//     summation orders, ulp-level differences of expf/tanhf/sincosf;
//   typed outputs (expect_typed): |gpu − ref| ≤ 2 ulp_T(ref) + floor·max|ref| per element, and
//     at least a fraction min_exact of the elements bit-equal;
//   two runs of one launch (expect_bitwise, twice): bit-identical (MODEL.md §7).
// The fixtures of suites whose tests live in several files (GpuStagesA, TypedStages) are
// defined here, outside any anonymous namespace, so that every file's tests belong to one
// fixture class; GpuStagesA is instantiated once, over kCases, in stages/test_norm.cu.
#pragma once

#include <gtest/gtest.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "../test_compare.hpp"
#include "common.cuh"
#include "config.hpp"
#include "device.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "params.hpp"
#include "precision.hpp"
#include "stages.cuh"
#include "stages.hpp"

namespace m3::stage_test {

using m3::Config;
using m3::Idx;
using m3::Rng;
using m3::ScanMode;
using m3::gpu::DeviceArray;
using m3::gpu::Scratch;
using m3::ref::Dims;
using Vec = std::vector<float>;
using Named = std::map<std::string, Vec>;
using Acts = m3::ref::LayerActs<float>;
using Grads = m3::ref::LayerGrads<float>;
using LParams = m3::LayerParams<float>;
using Case = StageCase;

constexpr double kRelL2 = 1e-5;
constexpr double kRelMax = 1e-4;
constexpr double kTwoPi = 6.283185307179586476925286766559;

inline void fill(Vec& v, Rng& rng, double lo, double hi) {
  for (auto& e : v) e = static_cast<float>(rng.uniform(lo, hi));
}

// ---- storage types ---------------------------------------------------------------------------
template <class T>
struct Storage;
template <>
struct Storage<__nv_bfloat16> {
  static constexpr m3::Precision kPrecision = m3::Precision::BF16;
  static constexpr int kMantissa = 7;   // stored fraction bits
  static constexpr int kMinExp = -126;  // exponent of the smallest normal
  static std::uint16_t bits(float f) { return m3::float_to_bf16_bits(f); }
  static float value(std::uint16_t h) { return m3::bf16_bits_to_float(h); }
};
template <>
struct Storage<__half> {
  static constexpr m3::Precision kPrecision = m3::Precision::F16;
  static constexpr int kMantissa = 10;
  static constexpr int kMinExp = -14;
  static std::uint16_t bits(float f) { return m3::float_to_f16_bits(f); }
  static float value(std::uint16_t h) { return m3::f16_bits_to_float(h); }
};

using StorageTypes = ::testing::Types<__nv_bfloat16, __half>;
struct StorageName {
  template <class T>
  static std::string GetName(int) {
    return std::is_same_v<T, __half> ? "f16" : "bf16";
  }
};

// The bits of a storage value, and back.
inline __host__ __device__ std::uint16_t raw(__nv_bfloat16 h) { return __bfloat16_as_ushort(h); }
inline __host__ __device__ std::uint16_t raw(__half h) { return __half_as_ushort(h); }
template <class T>
__host__ __device__ T from_raw(std::uint16_t b);
template <>
inline __host__ __device__ __nv_bfloat16 from_raw<__nv_bfloat16>(std::uint16_t b) {
  return __ushort_as_bfloat16(b);
}
template <>
inline __host__ __device__ __half from_raw<__half>(std::uint16_t b) {
  return __ushort_as_half(b);
}

// The storage value of f (what the reference's store_typed makes of it).
template <class T>
float rnd(float f) {
  return Storage<T>::value(Storage<T>::bits(f));
}
template <class T>
Vec rounded(Vec v) {
  for (auto& e : v) e = rnd<T>(e);
  return v;
}

// Unit in the last place of T at |x| (subnormal spacing below the smallest normal).
template <class T>
double ulp(double x) {
  int e = 0;
  std::frexp(std::abs(x), &e);  // |x| = m·2^e, m ∈ [0.5, 1)
  const int ex = x == 0 ? Storage<T>::kMinExp : std::max(e - 1, Storage<T>::kMinExp);
  return std::ldexp(1.0, ex - Storage<T>::kMantissa);
}

// ---- device helpers --------------------------------------------------------------------------
class Stream {
 public:
  Stream() { M3_CUDA_CHECK(cudaStreamCreate(&s_)); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  operator cudaStream_t() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// Uploads v and waits for the copy (v may be a temporary).
inline DeviceArray<float> up(const Vec& v, cudaStream_t s) {
  DeviceArray<float> a(static_cast<Idx>(v.size()));
  a.upload(v.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return a;
}

inline Vec down(const DeviceArray<float>& a, cudaStream_t s) {
  Vec v(static_cast<size_t>(a.size()));
  a.download(v.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return v;
}

// Uploads v (every value must be representable in T: the inputs are rounded beforehand).
template <class T>
DeviceArray<T> up_t(const Vec& v, cudaStream_t s) {
  std::vector<T> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    const std::uint16_t b = Storage<T>::bits(v[i]);
    if (!(Storage<T>::value(b) == v[i] || std::isnan(v[i])))
      throw m3::Error("up_t", "input not representable in the storage type",
                      "element " + std::to_string(i));
    h[i] = from_raw<T>(b);
  }
  DeviceArray<T> a(static_cast<Idx>(v.size()));
  a.upload(h.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  return a;
}

template <class T>
Vec down_t(const DeviceArray<T>& a, cudaStream_t s) {
  std::vector<T> h(static_cast<size_t>(a.size()));
  a.download(h.data(), s);
  M3_CUDA_CHECK(cudaStreamSynchronize(s));
  Vec v(h.size());
  for (size_t i = 0; i < h.size(); ++i) v[i] = Storage<T>::value(raw(h[i]));
  return v;
}

// up / down for f32 and up_t / down_t for the storage types, by T (for tests over both).
template <class T>
DeviceArray<T> up_as(const Vec& v, cudaStream_t s) {
  if constexpr (std::is_same_v<T, float>) return up(v, s);
  else return up_t<T>(v, s);
}
template <class T>
Vec down_as(const DeviceArray<T>& a, cudaStream_t s) {
  if constexpr (std::is_same_v<T, float>) return down(a, s);
  else return down_t(a, s);
}

struct ScratchBuf {
  DeviceArray<float> buf;
  explicit ScratchBuf(const Dims& d) : buf(m3::gpu::scratch_floats(d)) {}
  Scratch get() { return Scratch{buf.data(), buf.size()}; }
};

// ---- comparisons -----------------------------------------------------------------------------
// An f32 output against the reference: every element finite, then the harness metrics of got
// against want — rel_l2 ≤ kRelL2 and max|Δ| over want's scale ≤ kRelMax.
inline void expect_close(const std::string& what, const Vec& got, const Vec& want) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "] = " << got[i];
  const m3::harness::Metrics m = m3::test::metrics(got, want);
  const size_t worst = m.worst_index < 0 ? 0 : static_cast<size_t>(m.worst_index);
  EXPECT_LE(m3::test::rel_l2(m), kRelL2) << what << ": rel_l2, worst at " << worst;
  EXPECT_LE(m3::test::max_rel_err(m), kRelMax)
      << what << ": max_abs/max, worst at [" << worst << "] gpu "
      << (got.empty() ? 0.f : got[worst]) << " ref " << (want.empty() ? 0.f : want[worst]);
}

// A typed output: per element |got − want| ≤ 2 ulp_T(want) + floor_rel·max|want|, and at least
// min_exact of the elements bit-equal. want is the reference value after its rounding to T.
template <class T>
void expect_typed(const std::string& what, const Vec& got, const Vec& want, double floor_rel,
                  double min_exact) {
  ASSERT_EQ(got.size(), want.size()) << what;
  if (got.empty()) return;
  double wmax = 0;
  for (float v : want) wmax = std::max(wmax, std::abs(static_cast<double>(v)));
  const double floor_abs = floor_rel * wmax;
  size_t exact = 0, worst = 0;
  double worst_ratio = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << "[" << i << "] = " << got[i];
    ASSERT_EQ(rnd<T>(want[i]), want[i]) << what << ": reference value not rounded at " << i;
    if (got[i] == want[i]) {
      ++exact;
      continue;
    }
    const double diff = std::abs(static_cast<double>(got[i]) - want[i]);
    const double ratio = diff / (2.0 * ulp<T>(want[i]) + floor_abs);
    if (ratio > worst_ratio) worst_ratio = ratio, worst = i;
  }
  const double frac = static_cast<double>(exact) / static_cast<double>(got.size());
  EXPECT_LE(worst_ratio, 1.0) << what << ": worst at [" << worst << "] gpu " << got[worst]
                              << " ref " << want[worst] << " = "
                              << (got[worst] - want[worst]) / ulp<T>(want[worst]) << " ulp";
  EXPECT_GE(frac, min_exact) << what << ": fraction of bit-equal elements";
}

// Two results of one launch on the same inputs are bit-identical.
inline void expect_bitwise(const std::string& what, const Vec& x, const Vec& y) {
  ASSERT_EQ(x.size(), y.size()) << what;
  EXPECT_EQ(0, x.empty() ? 0 : std::memcmp(x.data(), y.data(), x.size() * sizeof(float)))
      << what << ": two runs differ";
}

inline void expect_bitwise(const std::string& what, const Named& a, const Named& b) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (const auto& [name, v] : a) {
    const Vec& w = b.at(name);
    ASSERT_EQ(v.size(), w.size()) << what << ": " << name;
    EXPECT_EQ(0, v.empty() ? 0 : std::memcmp(v.data(), w.data(), v.size() * sizeof(float)))
        << what << ": " << name << " differs between two runs";
  }
}

// Runs f twice (it uploads its inputs and accumulators afresh each time): the two results must
// be bit-identical; returns the first.
template <class F>
Named twice(const std::string& what, F&& f) {
  Named a = f(), b = f();
  expect_bitwise(what, a, b);
  return a;
}

// ---- the f32 world of family A (GpuStagesA) --------------------------------------------------
// The shared stage cases, plus hd 128 with every dim rotated.
inline const std::vector<Case> kCases = [] {
  std::vector<Case> c = stage_cases();
  c.push_back({"hd128_ds64_rf1_B1_T300", 128, 128, 64, 1, 1.0, 1, 300});
  return c;
}();

inline Config make_config(const Case& c, bool outproj_norm) {
  Config cfg;
  cfg.d_model = c.d_model;
  cfg.expand = 2;
  cfg.headdim = c.headdim;
  cfg.d_state = c.d_state;
  cfg.ngroups = c.ngroups;
  cfg.n_layers = 1;
  cfg.rope_fraction = c.rope_fraction;
  cfg.is_outproj_norm = outproj_norm;
  cfg.input_dim = c.d_model;
  cfg.validate();
  return cfg;
}

// Every host tensor a stage of family A reads or writes, from the reference forward in float:
// seeded realistic inputs through split → BCNorm → angles → RoPE → α/β/γ → gating, plus seeded
// U(−1, 1) upstream gradients and U(−1, 1) initial weight-gradient buffers (so the accumulate
// contract (+=) is checked). proj carries branch cases on purpose: dt logits above the softplus
// threshold (v > 20), heavy-tail logits at 0 and far below −1/a_floor (clamp active).
struct World {
  Dims d;
  LParams p, pg0;  // parameters; initial values of the weight-gradient buffers
  Acts a;
  Grads g;
};

inline World make_world(const Case& c, bool outproj_norm, std::uint64_t seed = 7) {
  const Config cfg = make_config(c, outproj_norm);
  World w;
  w.d = Dims::of(cfg, c.B, c.T, m3::Precision::F32);
  const Dims& d = w.d;
  w.p = m3::make_params<float>(cfg, seed, m3::Init::Perturbed).layers[0];
  w.pg0 = m3::zero_params<float>(cfg).layers[0];
  Rng rng(seed * 1000 + 17);
  for (Vec* v : {&w.pg0.norm_weight, &w.pg0.dt_bias, &w.pg0.b_norm_weight, &w.pg0.c_norm_weight,
                 &w.pg0.b_bias, &w.pg0.c_bias, &w.pg0.norm_gate_weight})
    fill(*v, rng, -1.0, 1.0);
  w.a.allocate(d, m3::ScanMode::Sequential);
  w.g.allocate(d, m3::ScanMode::Sequential);
  Acts& a = w.a;
  for (auto& e : a.proj) e = static_cast<float>(rng.normalish());
  const Idx ddt = 2 * d.di + 2 * d.ng * d.ds, dda = ddt + d.nh;
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx k = r + 3 * h;
      if (k % 17 == 0) a.proj[r * d.ip + ddt + h] = 30.0f;      // softplus: v > 20 branch
      if (k % 5 == 0) a.proj[r * d.ip + dda + h] = -2.0e4f;     // heavy-tail clamp active
      if (k % 11 == 0) a.proj[r * d.ip + dda + h] = 0.0f;       // φ'(0) = 1
    }
  m3::ref::split_forward(d, w.p, a);
  m3::ref::bcnorm_forward(d, w.p, a);
  fill(a.angle_in, rng, 0.0, kTwoPi);
  m3::ref::angle_forward(d, a);
  m3::ref::rope_forward(d, a);
  m3::ref::abg_forward(d, a);
  for (auto& e : a.y) e = static_cast<float>(rng.normalish());
  m3::ref::gating_forward(d, w.p, a);
  Grads& g = w.g;
  for (Vec* v : {&g.d_gated, &g.d_k, &g.d_q, &g.d_alpha, &g.d_beta, &g.d_gamma,
                 &g.d_angle_cumsum, &g.d_angle_out, &g.d_adt_total, &g.d_dt_direct,
                 &g.d_dt_angle, &g.d_trap_sig, &g.d_b_pre_rope, &g.d_c_pre_rope, &g.d_z, &g.d_x,
                 &g.d_b_raw, &g.d_c_raw, &g.d_dd_dt, &g.d_dd_a, &g.d_trap_raw, &g.d_angles_raw})
    fill(*v, rng, -1.0, 1.0);
  return w;
}

// The f32 stage tests, one per launcher, over kCases.
class GpuStagesA : public ::testing::TestWithParam<Case> {};

// ---- the typed world of family A and the GEMMs (TypedStages) ---------------------------------
inline const std::vector<Case> kTypedCases = stage_cases();

inline Config typed_config(const Case& c, bool outproj_norm) {
  Config cfg;
  cfg.d_model = c.d_model;
  cfg.expand = 2;
  cfg.headdim = c.headdim;
  cfg.d_state = c.d_state;
  cfg.ngroups = c.ngroups;
  cfg.n_layers = 1;
  cfg.rope_fraction = c.rope_fraction;
  cfg.is_outproj_norm = outproj_norm;
  cfg.input_dim = c.d_model + 3;
  cfg.input_proj_identity = false;
  cfg.validate();
  return cfg;
}

// Every host tensor a stage of family A reads or writes, from the reference forward in float
// with the storage emulation of T (typed tensors rounded where the reference stores them), and
// seeded upstream gradients (typed ones rounded).
template <class T>
struct TypedWorld {
  Dims d;
  LParams p, pg0;  // parameters; initial values of the weight-gradient buffers
  m3::ref::LayerActs<float> a;
  m3::ref::LayerGrads<float> g;
};

template <class T>
TypedWorld<T> make_typed_world(const Case& c, bool outproj_norm, std::uint64_t seed = 7) {
  const Config cfg = typed_config(c, outproj_norm);
  TypedWorld<T> w;
  w.d = Dims::of(cfg, c.B, c.T, Storage<T>::kPrecision);
  const Dims& d = w.d;
  w.p = m3::make_params<float>(cfg, seed, m3::Init::Perturbed).layers[0];
  w.pg0 = m3::zero_params<float>(cfg).layers[0];
  Rng rng(seed * 1000 + 17);
  for (Vec* v : {&w.pg0.norm_weight, &w.pg0.dt_bias, &w.pg0.b_norm_weight, &w.pg0.c_norm_weight,
                 &w.pg0.b_bias, &w.pg0.c_bias, &w.pg0.norm_gate_weight})
    fill(*v, rng, -1.0, 1.0);
  auto& a = w.a;
  a.allocate(d, ScanMode::Sequential);
  w.g.allocate(d, ScanMode::Sequential);
  for (auto& e : a.proj) e = static_cast<float>(rng.normalish());
  const Idx ddt = 2 * d.di + 2 * d.ng * d.ds, dda = ddt + d.nh;
  for (Idx r = 0; r < d.BT; ++r)
    for (Idx h = 0; h < d.nh; ++h) {
      const Idx k = r + 3 * h;
      if (k % 17 == 0) a.proj[r * d.ip + ddt + h] = 30.0f;   // softplus: v > 20 branch
      if (k % 5 == 0) a.proj[r * d.ip + dda + h] = -2.0e4f;  // heavy-tail clamp active
      if (k % 11 == 0) a.proj[r * d.ip + dda + h] = 0.0f;    // φ'(0) = 1
    }
  m3::ref::store_typed(d, a.proj);
  m3::ref::split_forward(d, w.p, a);
  m3::ref::bcnorm_forward(d, w.p, a);  // rounds normed, then biased (typed Dims)
  fill(a.angle_in, rng, 0.0, 6.283);
  m3::ref::angle_forward(d, a);
  m3::ref::rope_forward(d, a);
  m3::ref::store_typed(d, a.k);
  m3::ref::store_typed(d, a.q);
  m3::ref::abg_forward(d, a);
  for (auto& e : a.y) e = static_cast<float>(rng.normalish());
  m3::ref::store_typed(d, a.y);
  m3::ref::gating_forward(d, w.p, a);
  m3::ref::store_typed(d, a.gated);
  auto& g = w.g;
  for (Vec* v : {&g.d_gated, &g.d_k, &g.d_q, &g.d_angle_cumsum, &g.d_b_pre_rope,
                 &g.d_c_pre_rope, &g.d_z, &g.d_x, &g.d_b_raw, &g.d_c_raw, &g.d_dd_dt, &g.d_dd_a,
                 &g.d_trap_raw, &g.d_angles_raw})
    fill(*v, rng, -1.0, 1.0);
  for (Vec* v : {&g.d_gated, &g.d_z, &g.d_x, &g.d_b_raw, &g.d_c_raw}) m3::ref::store_typed(d, *v);
  return w;
}

// The bf16 and f16 stage tests, each over kTypedCases.
template <class T>
class TypedStages : public ::testing::Test {};
TYPED_TEST_SUITE(TypedStages, StorageTypes, StorageName);

}  // namespace m3::stage_test
