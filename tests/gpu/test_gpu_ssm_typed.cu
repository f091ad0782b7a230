// F6/B6 (gpu/scan: the sequential scan and the chunked path) in the bf16 and f16 storage
// emulation, both scan modes, against the double reference with the same emulation; the float
// reference gives the baseline error (MODEL.md §8, §12.8). Typed outputs (y, d_x,
// k_scaled_saved) within 2 ulps plus a floor of max(1e-5, 4 × the float reference's own max
// error), f32 outputs by the test_gpu_ssm rule: rel_l2 ≤ max(1e-5, 4·e_f), max|Δ|/max ≤
// max(1e-4, 4·m_f) (harness metrics, test_compare.hpp). Every GPU run is made twice and must
// be bit-identical. The chunk walk (fuse_states) and the wgmma products must give the bits of
// the two-kernel and mma.sync paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "stage_fixtures.cuh"

namespace {

using namespace m3::stage_test;

struct SsmCase {
  Idx hd, ds, nh, B, T, cs;
  std::string name() const {
    return "hd" + std::to_string(hd) + "_ds" + std::to_string(ds) + "_nh" + std::to_string(nh) +
           "_B" + std::to_string(B) + "_T" + std::to_string(T) + "_cs" + std::to_string(cs);
  }
};

const SsmCase kSsmCases[] = {
    {16, 16, 2, 2, 37, 7},
    {64, 128, 2, 2, 130, 64},   // official head shape, ragged last chunk
    {5, 33, 3, 1, 29, 4},       // odd sizes
    {32, 16, 2, 2, 150, 200},   // one chunk of 150 rows = 3 row tiles
    {128, 128, 2, 1, 70, 64},
};

Config ssm_config(const SsmCase& c) {
  Config cfg;
  cfg.headdim = c.hd;
  cfg.d_state = c.ds;
  cfg.expand = 1;
  cfg.d_model = c.nh * c.hd;
  cfg.ngroups = 1;
  cfg.n_layers = 1;
  cfg.rope_fraction = 0.5;
  cfg.chunk_size = c.cs;
  cfg.input_dim = cfg.d_model;
  return cfg;
}

using Tensors = std::map<std::string, std::vector<double>>;

// Inputs in double, every value representable in float; the typed ones (x, k, q, b_biased,
// c_biased, d_y) representable in T.
struct SsmInputs {
  std::vector<double> x, k, q, alpha, beta, gamma, dt, a_val, trap, b_biased, c_biased, theta;
  std::vector<double> ssm_in, k_in, v_in, d_param;
  std::vector<double> d_y, d_ssm_out, d_k_out, d_v_out, d_param_acc;
};

template <class T>
SsmInputs ssm_inputs(const Dims& d, std::uint64_t seed) {
  Rng rng(seed);
  SsmInputs in;
  auto fill_d = [&](std::vector<double>& v, Idx n, double lo, double hi, bool typed) {
    v.resize(static_cast<size_t>(n));
    for (auto& e : v) {
      const float f = static_cast<float>(rng.uniform(lo, hi));
      e = typed ? rnd<T>(f) : f;
    }
  };
  const Idx BT = d.BT, nh = d.nh;
  fill_d(in.x, BT * d.di, -1, 1, true);
  fill_d(in.b_biased, BT * nh * d.ds, -1, 1, true);
  fill_d(in.c_biased, BT * nh * d.ds, -1, 1, true);
  fill_d(in.theta, BT * nh * d.na, 0, 6.28, false);
  fill_d(in.dt, BT * nh, 0.01, 0.3, false);
  fill_d(in.a_val, BT * nh, -1.5, -0.05, false);
  fill_d(in.trap, BT * nh, 0.1, 0.9, false);
  fill_d(in.ssm_in, d.B * nh * d.hd * d.ds, -0.5, 0.5, false);
  fill_d(in.k_in, d.B * nh * d.ds, -0.5, 0.5, false);
  fill_d(in.v_in, d.B * nh * d.hd, -0.5, 0.5, false);
  fill_d(in.d_param, nh, 0.7, 1.3, false);
  fill_d(in.d_y, BT * d.di, -1, 1, true);
  fill_d(in.d_ssm_out, d.B * nh * d.hd * d.ds, -0.5, 0.5, false);
  fill_d(in.d_k_out, d.B * nh * d.ds, -0.5, 0.5, false);
  fill_d(in.d_v_out, d.B * nh * d.hd, -0.5, 0.5, false);
  fill_d(in.d_param_acc, nh, -0.5, 0.5, false);
  m3::ref::LayerActs<double> a;
  a.allocate(d, ScanMode::Sequential);
  a.b_biased = in.b_biased;
  a.c_biased = in.c_biased;
  a.angle_cumsum = in.theta;
  a.dt = in.dt;
  a.a_val = in.a_val;
  a.trap = in.trap;
  m3::ref::rope_forward(d, a);
  m3::ref::abg_forward(d, a);
  for (auto* v : {&a.k, &a.q})
    for (auto& e : *v) e = rnd<T>(static_cast<float>(e));
  for (auto* v : {&a.alpha, &a.beta, &a.gamma})
    for (auto& e : *v) e = static_cast<float>(e);
  in.k = a.k;
  in.q = a.q;
  in.alpha = a.alpha;
  in.beta = a.beta;
  in.gamma = a.gamma;
  return in;
}

template <class S>
std::vector<S> cast(const std::vector<double>& v) {
  return std::vector<S>(v.begin(), v.end());
}
template <class S>
std::vector<double> to_double(const std::vector<S>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// The reference F6 → B6 (+ the sequential glue) with the storage emulation of d (k_scaled_saved
// rounded inside the chunked stage); y and d_x are returned before their store rounding (the
// caller rounds them) so the f32 noise of the float reference can be measured on them.
template <class S>
Tensors ref_ssm(const Dims& d, const SsmInputs& in, ScanMode mode) {
  m3::ref::LayerActs<S> a;
  m3::ref::LayerGrads<S> g;
  m3::LayerParams<S> p, pg;
  a.allocate(d, mode);
  g.allocate(d, mode);
  a.x = cast<S>(in.x);
  a.k = cast<S>(in.k);
  a.q = cast<S>(in.q);
  a.alpha = cast<S>(in.alpha);
  a.beta = cast<S>(in.beta);
  a.gamma = cast<S>(in.gamma);
  a.dt = cast<S>(in.dt);
  a.a_val = cast<S>(in.a_val);
  a.trap = cast<S>(in.trap);
  a.b_biased = cast<S>(in.b_biased);
  a.c_biased = cast<S>(in.c_biased);
  a.angle_cumsum = cast<S>(in.theta);
  a.ssm_in = cast<S>(in.ssm_in);
  a.k_in = cast<S>(in.k_in);
  a.v_in = cast<S>(in.v_in);
  p.d_param = cast<S>(in.d_param);
  pg.d_param = cast<S>(in.d_param_acc);
  g.d_y = cast<S>(in.d_y);
  g.d_ssm_out = cast<S>(in.d_ssm_out);
  g.d_k_out = cast<S>(in.d_k_out);
  g.d_v_out = cast<S>(in.d_v_out);
  Tensors t;
  if (mode == ScanMode::Sequential) {
    m3::ref::ssm_seq_forward(d, p, a);
    m3::ref::ssm_seq_backward(d, p, a, g, pg);
    m3::ref::rope_backward(d, a, g);
    for (const auto& [name, v] : std::vector<std::pair<const char*, const std::vector<S>*>>{
             {"h_saved", &a.h_saved}, {"k_prev_saved", &a.k_prev_saved},
             {"v_prev_saved", &a.v_prev_saved}, {"d_k", &g.d_k}, {"d_q", &g.d_q},
             {"d_alpha", &g.d_alpha}, {"d_beta", &g.d_beta}, {"d_gamma", &g.d_gamma},
             {"d_d_local", &g.d_d_local}})
      t[name] = to_double(*v);
  } else {
    m3::ref::ssm_chunked_forward(d, p, a);
    m3::ref::ssm_chunked_backward(d, p, a, g, pg);
    for (const auto& [name, v] : std::vector<std::pair<const char*, const std::vector<S>*>>{
             {"adt", &a.adt}, {"k_scaled_saved", &a.k_scaled_saved},
             {"qk_dot_saved", &a.qk_dot_saved}, {"scale_saved", &a.scale_saved},
             {"gamma_saved", &a.gamma_saved}, {"da_cumsum_saved", &a.da_cumsum_saved},
             {"chunk_states", &a.chunk_states}, {"chunk_states_saved", &a.chunk_states_saved},
             {"final_states", &a.final_states}, {"da_cs_sum", &g.da_cs_sum},
             {"dQ_mid", &g.dQ_mid}, {"dK_mid", &g.dK_mid}, {"dADT", &g.dADT},
             {"dQK_dot", &g.dQK_dot}, {"dD_partials", &g.dD_partials}, {"dScale", &g.dScale},
             {"dGamma", &g.dGamma}, {"dDT", &g.dDT}, {"d_adt_total", &g.d_adt_total},
             {"d_dt_direct", &g.d_dt_direct}, {"d_trap_sig", &g.d_trap_sig}})
      t[name] = to_double(*v);
  }
  for (const auto& [name, v] : std::vector<std::pair<const char*, const std::vector<S>*>>{
           {"y", &a.y}, {"ssm_out", &a.ssm_out}, {"k_out", &a.k_out}, {"v_out", &a.v_out},
           {"d_x", &g.d_x}, {"d_ssm_in", &g.d_ssm_in}, {"d_k_in", &g.d_k_in},
           {"d_v_in", &g.d_v_in}, {"d_d_param", &pg.d_param},
           {"d_b_pre_rope", &g.d_b_pre_rope}, {"d_c_pre_rope", &g.d_c_pre_rope},
           {"d_angle_cumsum", &g.d_angle_cumsum}})
    t[name] = to_double(*v);
  return t;
}

// Named device buffers of one GPU run: inputs uploaded (typed ones in T), outputs pre-filled
// with NaN bytes (so an element never written fails), downloaded as double.
template <class T>
class Bufs {
 public:
  explicit Bufs(cudaStream_t s) : s_(s) {}
  float* in(const std::string& name, const std::vector<double>& v) {
    DeviceArray<float>& a = f_[name];
    a = up(cast<float>(v), s_);
    return a.data();
  }
  T* in_t(const std::string& name, const std::vector<double>& v) {
    DeviceArray<T>& a = t_[name];
    a = up_t<T>(cast<float>(v), s_);
    return a.data();
  }
  float* out(const std::string& name, Idx n) {
    DeviceArray<float>& a = f_[name];
    a.resize(n);
    nan_fill(a.data(), n * sizeof(float));
    outs_.push_back(name);
    return a.data();
  }
  T* out_t(const std::string& name, Idx n) {
    DeviceArray<T>& a = t_[name];
    a.resize(n);
    nan_fill(a.data(), n * sizeof(T));
    outs_t_.push_back(name);
    return a.data();
  }
  Tensors download() {
    Tensors t;
    for (const auto& name : outs_) t[name] = to_double(down(f_.at(name), s_));
    for (const auto& name : outs_t_) t[name] = to_double(down_t(t_.at(name), s_));
    return t;
  }

 private:
  void nan_fill(void* p, Idx bytes) {
    if (bytes) M3_CUDA_CHECK(cudaMemsetAsync(p, 0xff, static_cast<size_t>(bytes), s_));
  }
  cudaStream_t s_;
  std::map<std::string, DeviceArray<float>> f_;
  std::map<std::string, DeviceArray<T>> t_;
  std::vector<std::string> outs_, outs_t_;
};

template <class T>
Tensors gpu_ssm(const Dims& d, const SsmInputs& in, ScanMode mode, bool fuse_states = false) {
  Stream st;
  const cudaStream_t s = st;
  Bufs<T> b(s);
  const Idx BT = d.BT, nh = d.nh;
  DeviceArray<float> scr(m3::gpu::scratch_floats(d));
  const Scratch scratch{scr.data(), scr.size()};
  T* x = b.in_t("x", in.x);
  T* k = b.in_t("k", in.k);
  T* q = b.in_t("q", in.q);
  T* dy = b.in_t("d_y", in.d_y);
  float* d_param = b.in("d_param", in.d_param);
  float* ssm_in = b.in("ssm_in", in.ssm_in);
  float* k_in = b.in("k_in", in.k_in);
  float* v_in = b.in("v_in", in.v_in);
  float* theta = b.in("theta", in.theta);
  float* d_ssm_out = b.in("d_ssm_out", in.d_ssm_out);
  float* d_k_out = b.in("d_k_out", in.d_k_out);
  float* d_v_out = b.in("d_v_out", in.d_v_out);
  float* dD = b.in("d_d_param_acc", in.d_param_acc);
  if (mode == ScanMode::Sequential) {
    m3::gpu::SsmSeqFwd<T> f{};
    f.x = x;
    f.k = k;
    f.q = q;
    f.alpha = b.in("alpha", in.alpha);
    f.beta = b.in("beta", in.beta);
    f.gamma = b.in("gamma", in.gamma);
    f.d_param = d_param;
    f.ssm_in = ssm_in;
    f.k_in = k_in;
    f.v_in = v_in;
    f.y = b.out_t("y", BT * d.di);
    f.h_saved = b.out("h_saved", d.B * (d.T + 1) * d.ds * d.di);
    f.k_prev_saved = b.out("k_prev_saved", BT * nh * d.ds);
    f.v_prev_saved = b.out("v_prev_saved", BT * nh * d.hd);
    f.ssm_out = b.out("ssm_out", d.B * nh * d.hd * d.ds);
    f.k_out = b.out("k_out", d.B * nh * d.ds);
    f.v_out = b.out("v_out", d.B * nh * d.hd);
    m3::gpu::ssm_seq_forward<T>(s, d, f);
    m3::gpu::SsmSeqBwd<T> g{};
    g.x = x;
    g.k = k;
    g.q = q;
    g.d_y = dy;
    g.alpha = f.alpha;
    g.beta = f.beta;
    g.gamma = f.gamma;
    g.d_param = d_param;
    g.h_saved = f.h_saved;
    g.k_prev_saved = f.k_prev_saved;
    g.v_prev_saved = f.v_prev_saved;
    g.d_ssm_out = d_ssm_out;
    g.d_k_out = d_k_out;
    g.d_v_out = d_v_out;
    g.d_x = b.out_t("d_x", BT * d.di);
    g.d_k = b.out("d_k", BT * nh * d.ds);
    g.d_q = b.out("d_q", BT * nh * d.ds);
    g.d_alpha = b.out("d_alpha", BT * nh);
    g.d_beta = b.out("d_beta", BT * nh);
    g.d_gamma = b.out("d_gamma", BT * nh);
    g.d_d_local = b.out("d_d_local", d.B * d.di);
    g.d_ssm_in = b.out("d_ssm_in", d.B * nh * d.hd * d.ds);
    g.d_k_in = b.out("d_k_in", d.B * nh * d.ds);
    g.d_v_in = b.out("d_v_in", d.B * nh * d.hd);
    g.d_d_param = dD;
    m3::gpu::ssm_seq_backward<T>(s, d, g, scratch);
    m3::gpu::RopeBwd<T> rb{};
    rb.theta = theta;
    rb.dv1 = g.d_k;
    rb.dv2 = g.d_q;
    rb.rot1 = k;
    rb.rot2 = q;
    rb.dpre1 = b.out("d_b_pre_rope", BT * nh * d.ds);
    rb.dpre2 = b.out("d_c_pre_rope", BT * nh * d.ds);
    rb.dtheta = b.out("d_angle_cumsum", BT * nh * d.na);
    m3::gpu::rope_backward<T>(s, d, rb);
  } else {
    const Idx nstate = d.B * d.nc * nh * d.hd * d.ds;
    m3::gpu::SsmChunkFwd<T> f{};
    f.x = x;
    f.k = k;
    f.q = q;
    f.dt = b.in("dt", in.dt);
    f.trap = b.in("trap", in.trap);
    f.a_val = b.in("a_val", in.a_val);
    f.d_param = d_param;
    f.ssm_in = ssm_in;
    f.k_in = k_in;
    f.v_in = v_in;
    f.k_scaled_saved = b.out_t("k_scaled_saved", BT * nh * d.ds);
    f.y = b.out_t("y", BT * d.di);
    f.adt = b.out("adt", BT * nh);
    f.qk_dot_saved = b.out("qk_dot_saved", BT * nh);
    f.scale_saved = b.out("scale_saved", BT * nh);
    f.gamma_saved = b.out("gamma_saved", BT * nh);
    f.da_cumsum_saved = b.out("da_cumsum_saved", d.B * d.nc * nh * d.cs);
    f.chunk_states = b.out("chunk_states", nstate);
    f.chunk_states_saved = b.out("chunk_states_saved", nstate);
    f.final_states = b.out("final_states", d.B * nh * d.hd * d.ds);
    f.ssm_out = b.out("ssm_out", d.B * nh * d.hd * d.ds);
    f.k_out = b.out("k_out", d.B * nh * d.ds);
    f.v_out = b.out("v_out", d.B * nh * d.hd);
    f.fuse_states = fuse_states;
    m3::gpu::ssm_chunked_forward<T>(s, d, f, scratch);
    m3::gpu::SsmChunkBwd<T> g{};
    g.x = x;
    g.k = k;
    g.q = q;
    g.b_biased = b.in_t("b_biased", in.b_biased);
    g.c_biased = b.in_t("c_biased", in.c_biased);
    g.k_scaled_saved = f.k_scaled_saved;
    g.d_y = dy;
    g.theta = theta;
    g.dt = f.dt;
    g.trap = f.trap;
    g.a_val = f.a_val;
    g.d_param = d_param;
    g.qk_dot_saved = f.qk_dot_saved;
    g.scale_saved = f.scale_saved;
    g.gamma_saved = f.gamma_saved;
    g.da_cumsum_saved = f.da_cumsum_saved;
    g.chunk_states_saved = f.chunk_states_saved;
    g.k_in = k_in;
    g.v_in = v_in;
    g.d_ssm_out = d_ssm_out;
    g.d_k_out = d_k_out;
    g.d_v_out = d_v_out;
    g.da_cs_sum = b.out("da_cs_sum", d.B * d.nc * nh);
    g.dQ_mid = b.out("dQ_mid", BT * nh * d.ds);
    g.dK_mid = b.out("dK_mid", BT * nh * d.ds);
    g.dADT = b.out("dADT", BT * nh);
    g.dQK_dot = b.out("dQK_dot", BT * nh);
    g.dD_partials = b.out("dD_partials", d.B * nh);
    g.dScale = b.out("dScale", BT * nh);
    g.dGamma = b.out("dGamma", BT * nh);
    g.dDT = b.out("dDT", BT * nh);
    g.d_x = b.out_t("d_x", BT * d.di);
    g.d_b_pre_rope = b.out("d_b_pre_rope", BT * nh * d.ds);
    g.d_c_pre_rope = b.out("d_c_pre_rope", BT * nh * d.ds);
    g.d_angle_cumsum = b.out("d_angle_cumsum", BT * nh * d.na);
    g.d_adt_total = b.out("d_adt_total", BT * nh);
    g.d_dt_direct = b.out("d_dt_direct", BT * nh);
    g.d_trap_sig = b.out("d_trap_sig", BT * nh);
    g.d_ssm_in = b.out("d_ssm_in", d.B * nh * d.hd * d.ds);
    g.d_k_in = b.out("d_k_in", d.B * nh * d.ds);
    g.d_v_in = b.out("d_v_in", d.B * nh * d.hd);
    g.d_d_param = dD;
    g.fuse_states = fuse_states;
    m3::gpu::ssm_chunked_backward<T>(s, d, g, scratch);
  }
  Tensors t = b.download();
  std::vector<float> acc(static_cast<size_t>(nh));
  M3_CUDA_CHECK(cudaMemcpy(acc.data(), dD, acc.size() * sizeof(float), cudaMemcpyDeviceToHost));
  t["d_d_param"] = to_double(acc);
  return t;
}

// Every tensor of a has the bits of the same tensor of b (an, bn: how each was run); a
// difference is reported at its first element.
void expect_same_bits(const Tensors& a, const char* an, const Tensors& b, const char* bn) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [n, v] : a) {
    ASSERT_TRUE(b.count(n)) << n;
    const auto& w = b.at(n);
    ASSERT_EQ(v.size(), w.size()) << n;
    size_t first = v.size();
    for (size_t i = 0; i < v.size() && first == v.size(); ++i)
      if (std::memcmp(&v[i], &w[i], sizeof(double)) != 0) first = i;
    EXPECT_EQ(first, v.size()) << n << " differs first at " << first << ": " << an << " "
                               << (first < v.size() ? v[first] : 0.0) << ", " << bn << " "
                               << (first < w.size() ? w[first] : 0.0);
  }
}

struct Err {
  double rel_l2 = 0, max_rel = 0;
};

// The harness metrics of a against b (test_compare.hpp): rel_l2 and max|a − b| / max|b|; a
// non-finite value anywhere → +inf.
Err err(const std::vector<double>& a, const std::vector<double>& b) {
  const m3::harness::Metrics m = m3::test::metrics(a, b);
  return {m3::test::rel_l2(m), m3::test::max_rel_err(m)};
}

constexpr double kSsmFactor = 4;

// GPU (typed emulation) vs the double reference (same emulation), each output:
//   typed (y, d_x; k_scaled_saved against the float reference, whose K·scale is the GPU's
//   exactly): expect_typed with floor max(1e-5, 4·(float reference's own max error));
//   f32: rel_l2 ≤ max(1e-5, 4·e_f), max rel ≤ max(1e-4, 4·m_f) — the test_gpu_ssm rule.
template <class T>
void check_ssm(const Dims& d, const SsmInputs& in, ScanMode mode) {
  const Tensors truth = ref_ssm<double>(d, in, mode), base = ref_ssm<float>(d, in, mode);
  Tensors got;
  {
    const Tensors a = gpu_ssm<T>(d, in, mode), b = gpu_ssm<T>(d, in, mode);
    for (const auto& [n, v] : a) {
      const auto& w = b.at(n);
      ASSERT_EQ(v.size(), w.size()) << n;
      EXPECT_EQ(0, std::memcmp(v.data(), w.data(), v.size() * sizeof(double)))
          << n << " differs between two runs";
    }
    got = a;
  }
  auto as_vec = [](const std::vector<double>& v) { return Vec(v.begin(), v.end()); };
  for (const auto& [n, g] : got) {
    ASSERT_TRUE(truth.count(n) && base.count(n)) << "reference lacks " << n;
    const auto& t = truth.at(n);
    const auto& f = base.at(n);
    ASSERT_EQ(g.size(), t.size()) << n;
    if (n == "y" || n == "d_x") {
      const Err ef = err(f, t);
      Vec want = as_vec(t);
      m3::ref::store_typed(d, want);
      expect_typed<T>(n, as_vec(g), want, std::max(1e-5, kSsmFactor * ef.max_rel), 0.9);
    } else if (n == "k_scaled_saved") {
      expect_typed<T>(n, as_vec(g), as_vec(f), 0.0, 0.999);
    } else {
      const Err e = err(g, t), ef = err(f, t);
      EXPECT_LE(e.rel_l2, std::max(kRelL2, kSsmFactor * ef.rel_l2))
          << n << " rel_l2 (float reference " << ef.rel_l2 << ")";
      EXPECT_LE(e.max_rel, std::max(kRelMax, kSsmFactor * ef.max_rel))
          << n << " max|Δ|/max|ref| (float reference " << ef.max_rel << ")";
    }
  }
}

template <class T>
class TypedSsm : public ::testing::Test {};
TYPED_TEST_SUITE(TypedSsm, StorageTypes, StorageName);

TYPED_TEST(TypedSsm, SequentialMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const SsmCase& c : kSsmCases) {
    SCOPED_TRACE(c.name());
    const Dims d = Dims::of(ssm_config(c), c.B, c.T, Storage<T>::kPrecision);
    check_ssm<T>(d, ssm_inputs<T>(d, 17), ScanMode::Sequential);
  }
}

TYPED_TEST(TypedSsm, ChunkedMatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  for (const SsmCase& c : kSsmCases) {
    SCOPED_TRACE(c.name());
    const Dims d = Dims::of(ssm_config(c), c.B, c.T, Storage<T>::kPrecision);
    check_ssm<T>(d, ssm_inputs<T>(d, 23), ScanMode::Chunked);
  }
}

// The chunk walk (K2/K3 + K4/K6 and B1 + B2 in one kernel per (b, h), fuse_states) writes the
// bits of the two-kernel path: every output, the contributions it also stores included. Beyond
// kSsmCases, the shapes where the walk's cumsum kernel (chunk_cumsum_kernel: a warp per chunk and
// 32 heads) has a partial head tile (40 heads) and slots past a row tile (cs 96 > 64 with T 45:
// da_cumsum_saved zero on [45, 96)).
TYPED_TEST(TypedSsm, ChunkWalkGivesTheBitsOfTheTwoKernels) {
  M3_SKIP_WITHOUT_GPU();
  using T = TypeParam;
  std::vector<SsmCase> cases(std::begin(kSsmCases), std::end(kSsmCases));
  cases.push_back({64, 64, 40, 1, 100, 64});
  cases.push_back({16, 32, 3, 2, 45, 96});
  for (const SsmCase& c : cases) {
    SCOPED_TRACE(c.name());
    const Dims d = Dims::of(ssm_config(c), c.B, c.T, Storage<T>::kPrecision);
    const SsmInputs in = ssm_inputs<T>(d, 29);
    expect_same_bits(gpu_ssm<T>(d, in, ScanMode::Chunked, false), "two kernels",
                     gpu_ssm<T>(d, in, ScanMode::Chunked, true), "walk");
  }
}

// In an sm_90a build (CMAKE_CUDA_ARCHITECTURES 90a) chunk_bwd_tc, K5 (chunk_scan_tc) and, in
// bf16 runs, chunk_state_tc and the chunk walks form their products with wgmma where the widths
// allow (headdim 33–64 with d_state 33–128; K5 also headdim 65–128; tc_wgmma.cuh); with
// set_chunked_wgmma_for_testing(false) the same launches take the mma.sync instantiations. Every
// output has the same bits both ways, with the two kernels and with the walk. Beyond kSsmCases
// (the official head shape with a ragged last chunk; headdim 128, where only K5 takes wgmma),
// the wgmma widths with padded columns: headdim 40 with d_state 100, and 64 with 64 over chunks
// of 7 and 64 rows.
TYPED_TEST(TypedSsm, WgmmaGivesTheBitsOfMmaSync) {
  M3_SKIP_WITHOUT_GPU();
  if (!m3::gpu::chunked_wgmma_build())
    GTEST_SKIP() << "this build has no wgmma path (CMAKE_CUDA_ARCHITECTURES is not 90a)";
  using T = TypeParam;
  struct Restore {
    ~Restore() { m3::gpu::set_chunked_wgmma_for_testing(true); }
  } restore;
  std::vector<SsmCase> cases(std::begin(kSsmCases), std::end(kSsmCases));
  cases.push_back({40, 100, 3, 2, 90, 64});
  cases.push_back({64, 64, 2, 1, 40, 7});
  cases.push_back({64, 64, 2, 2, 129, 64});
  long wg_launches = 0;  // the switch must choose: launches on wgmma with it on, none off
  for (const SsmCase& c : cases)
    for (const bool walk : {false, true}) {
      SCOPED_TRACE(c.name() + (walk ? ", walk" : ", two kernels"));
      const Dims d = Dims::of(ssm_config(c), c.B, c.T, Storage<T>::kPrecision);
      const SsmInputs in = ssm_inputs<T>(d, 31);
      m3::gpu::set_chunked_wgmma_for_testing(true);
      long n0 = m3::gpu::chunked_wgmma_launches();
      const Tensors wg = gpu_ssm<T>(d, in, ScanMode::Chunked, walk);
      wg_launches += m3::gpu::chunked_wgmma_launches() - n0;
      m3::gpu::set_chunked_wgmma_for_testing(false);
      n0 = m3::gpu::chunked_wgmma_launches();
      const Tensors ms = gpu_ssm<T>(d, in, ScanMode::Chunked, walk);
      EXPECT_EQ(m3::gpu::chunked_wgmma_launches(), n0) << "a wgmma launch with the switch off";
      expect_same_bits(wg, "wgmma", ms, "mma.sync");
    }
  EXPECT_GT(wg_launches, 0) << "no launch took a wgmma kernel: mma.sync was compared with itself";
}

}  // namespace
