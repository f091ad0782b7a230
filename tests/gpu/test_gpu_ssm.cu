// The GPU SSM stage (F6 forward, B6 backward) in both scan modes against the reference stage
// functions on identical inputs (MODEL.md §4 F6, §5, §6.3, §6.4, §7, §12.4–§12.7):
//
//   SsmSeqGpu.MatchesReference/<case>      ssm_seq_forward/backward vs m3::ref::ssm_seq_*
//   SsmChunkedGpu.MatchesReference/<case>  ssm_chunked_forward/backward vs m3::ref::ssm_chunked_*
//   SsmGpu.SequentialEqualsChunked/<case>  the two GPU modes agree (y, leaving states, d_x,
//                                          RoPE-side gradients, B5b inputs, entering-state grads)
//   SsmGpu.RunsAreBitIdentical/<case>      two runs of each mode memcmp-equal (§7)
//   SsmGpuShapes.RejectsUnsupportedShape   headdim or d_state > 128 → m3::Error
//   SsmGpuShapes.ScratchFloatsCoverChunkedBackward   scratch_floats(d) ≥ the chunked need
//
// Inputs are seeded, rounded to float once, and fed unchanged to the double reference, the
// float reference and the GPU (k, q, α, β, γ come from the reference rope_forward/abg_forward
// in double, then rounded). Every output tensor is compared with the double reference:
// rel_l2 ≤ max(1e-5, 4·e_f) and max|Δ|/max|ref| ≤ max(1e-4, 4·m_f), where e_f, m_f are the
// float reference's own errors (the f32 baseline). GPU outputs are pre-filled with NaN, so an
// element a kernel never writes fails the comparison; the accumulated d D starts non-zero.
// The default cases sample the grid headdim × d_state ∈ {16, 32, 64, 128}² plus odd sizes,
// chunk sizes 1, 7, 64, > T (and chunks longer than one 64-row tile), T = 1 and ragged T, with
// and without entering states and leaving-state gradients; M3_GPU_FULL_GRID=1 adds all 16
// combinations of the grid in both chunk sizes 7 and 64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <ostream>
#include <string>
#include <vector>

#include "../test_compare.hpp"
#include "device.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "params.hpp"
#include "stages.cuh"
#include "stages.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::ScanMode;
using m3::gpu::DeviceArray;
using m3::ref::Dims;
using m3::ref::LayerActs;
using m3::ref::LayerGrads;
using m3::LayerParams;

bool env_on(const char* name) {
  const char* v = std::getenv(name);
  return v && std::string(v) == "1";
}

// ---- cases -----------------------------------------------------------------------------------
struct SsmCase {
  Idx hd, ds, nh, B, T, cs;
  bool states, dleave;
  std::string name() const {
    return "hd" + std::to_string(hd) + "_ds" + std::to_string(ds) + "_nh" + std::to_string(nh) +
           "_B" + std::to_string(B) + "_T" + std::to_string(T) + "_cs" + std::to_string(cs) +
           (states ? "_states" : "_fresh") + (dleave ? "_dleave" : "");
  }
};

std::vector<SsmCase> ssm_cases() {
  std::vector<SsmCase> c = {
      //  hd   ds nh  B     T    cs  states dleave
      {16, 16, 2, 2, 37, 7, true, true},
      {32, 64, 2, 2, 100, 64, false, false},
      {64, 128, 2, 2, 130, 64, true, true},    // official head shape, ragged last chunk
      {128, 128, 2, 1, 70, 64, true, false},
      {128, 16, 3, 2, 65, 64, false, true},
      {16, 128, 2, 2, 33, 1, true, true},      // chunk size 1
      {3, 6, 2, 2, 20, 7, true, true},         // odd sizes
      {5, 33, 3, 1, 29, 4, true, true},        // odd sizes, ds just above a padding class
      {32, 32, 2, 2, 1, 64, true, true},       // T = 1
      {64, 32, 2, 2, 50, 64, true, true},      // chunk > T
      {32, 16, 2, 2, 150, 200, true, true},    // one chunk of 150 rows = 3 row tiles
      {16, 64, 2, 1, 300, 130, true, true},    // chunks of 130 rows (3 tiles), ragged
      {16, 16, 1, 1, 4096, 64, true, true},    // long T
  };
  if (env_on("M3_GPU_FULL_GRID"))
    for (Idx hd : {16, 32, 64, 128})
      for (Idx ds : {16, 32, 64, 128})
        for (Idx cs : {7, 64}) c.push_back({hd, ds, 2, 2, 100, cs, true, true});
  return c;
}

std::string case_name(const ::testing::TestParamInfo<SsmCase>& i) { return i.param.name(); }
void PrintTo(const SsmCase& c, std::ostream* os) { *os << c.name(); }

Config config_of(const SsmCase& c) {
  Config cfg;
  cfg.headdim = c.hd;
  cfg.d_state = c.ds;
  cfg.expand = 1;
  cfg.d_model = c.nh * c.hd;  // d_inner = nh·hd
  cfg.ngroups = 1;
  cfg.n_layers = 1;
  cfg.rope_fraction = 0.5;
  cfg.chunk_size = c.cs;
  cfg.input_dim = cfg.d_model;
  return cfg;
}

Dims dims_of(const SsmCase& c) {
  return Dims::of(config_of(c), c.B, c.T, m3::Precision::F32);
}

// ---- inputs (double, every value representable in float) -------------------------------------
struct Inputs {
  // forward inputs of the stage (both modes) and the chunked backward's extra inputs
  std::vector<double> x, k, q, alpha, beta, gamma, dt, a_val, trap, b_biased, c_biased, theta;
  std::vector<double> ssm_in, k_in, v_in, d_param;
  // backward inputs and the accumulator start of d D
  std::vector<double> d_y, d_ssm_out, d_k_out, d_v_out, d_param_acc;
};

double as_float(double v) { return static_cast<double>(static_cast<float>(v)); }

void fill(std::vector<double>& v, Idx n, m3::Rng& rng, double lo, double hi) {
  v.resize(static_cast<size_t>(n));
  for (auto& e : v) e = as_float(rng.uniform(lo, hi));
}

Inputs make_inputs(const Dims& d, const SsmCase& c, std::uint64_t seed) {
  m3::Rng rng(seed);
  Inputs in;
  const Idx BT = d.BT, nh = d.nh;
  fill(in.x, BT * d.di, rng, -1, 1);
  fill(in.b_biased, BT * nh * d.ds, rng, -1, 1);
  fill(in.c_biased, BT * nh * d.ds, rng, -1, 1);
  fill(in.theta, BT * nh * d.na, rng, 0, 6.28);
  fill(in.dt, BT * nh, rng, 0.01, 0.3);
  fill(in.a_val, BT * nh, rng, -1.5, -0.05);
  fill(in.trap, BT * nh, rng, 0.1, 0.9);
  const double st = c.states ? 0.5 : 0.0, dl = c.dleave ? 0.5 : 0.0;
  fill(in.ssm_in, d.B * nh * d.hd * d.ds, rng, -st, st);
  fill(in.k_in, d.B * nh * d.ds, rng, -st, st);
  fill(in.v_in, d.B * nh * d.hd, rng, -st, st);
  fill(in.d_param, nh, rng, 0.7, 1.3);
  fill(in.d_y, BT * d.di, rng, -1, 1);
  fill(in.d_ssm_out, d.B * nh * d.hd * d.ds, rng, -dl, dl);
  fill(in.d_k_out, d.B * nh * d.ds, rng, -dl, dl);
  fill(in.d_v_out, d.B * nh * d.hd, rng, -dl, dl);
  fill(in.d_param_acc, nh, rng, -0.5, 0.5);
  // k, q = RoPE(b_biased, c_biased); α, β, γ from dt, a_val, trap — in double, then rounded.
  LayerActs<double> a;
  a.allocate(d, ScanMode::Sequential);
  a.b_biased = in.b_biased;
  a.c_biased = in.c_biased;
  a.angle_cumsum = in.theta;
  a.dt = in.dt;
  a.a_val = in.a_val;
  a.trap = in.trap;
  m3::ref::rope_forward(d, a);
  m3::ref::abg_forward(d, a);
  for (auto* v : {&a.k, &a.q, &a.alpha, &a.beta, &a.gamma})
    for (auto& e : *v) e = as_float(e);
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

using Tensors = std::map<std::string, std::vector<double>>;

template <class S>
std::vector<double> to_double(const std::vector<S>& v) {
  return std::vector<double>(v.begin(), v.end());
}

// ---- reference runs ---------------------------------------------------------------------------
template <class S>
void load_acts(const Inputs& in, LayerActs<S>& a, LayerGrads<S>& g, LayerParams<S>& p,
               LayerParams<S>& pg) {
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
}

template <class S>
Tensors ref_seq(const Dims& d, const Inputs& in) {
  LayerActs<S> a;
  LayerGrads<S> g;
  LayerParams<S> p, pg;
  a.allocate(d, ScanMode::Sequential);
  g.allocate(d, ScanMode::Sequential);
  load_acts(in, a, g, p, pg);
  m3::ref::ssm_seq_forward(d, p, a);
  m3::ref::ssm_seq_backward(d, p, a, g, pg);
  m3::ref::rope_backward(d, a, g);
  m3::ref::abg_backward(d, a, g);
  Tensors t;
  for (const auto& [name, v] :
       std::vector<std::pair<const char*, const std::vector<S>*>>{
           {"y", &a.y}, {"h_saved", &a.h_saved}, {"k_prev_saved", &a.k_prev_saved},
           {"v_prev_saved", &a.v_prev_saved}, {"ssm_out", &a.ssm_out}, {"k_out", &a.k_out},
           {"v_out", &a.v_out}, {"d_x", &g.d_x}, {"d_k", &g.d_k}, {"d_q", &g.d_q},
           {"d_alpha", &g.d_alpha}, {"d_beta", &g.d_beta}, {"d_gamma", &g.d_gamma},
           {"d_d_local", &g.d_d_local}, {"d_ssm_in", &g.d_ssm_in}, {"d_k_in", &g.d_k_in},
           {"d_v_in", &g.d_v_in}, {"d_d_param", &pg.d_param},
           {"d_b_pre_rope", &g.d_b_pre_rope}, {"d_c_pre_rope", &g.d_c_pre_rope},
           {"d_angle_cumsum", &g.d_angle_cumsum}, {"d_adt_total", &g.d_adt_total},
           {"d_dt_direct", &g.d_dt_direct}, {"d_trap_sig", &g.d_trap_sig}})
    t[name] = to_double(*v);
  return t;
}

template <class S>
Tensors ref_chunked(const Dims& d, const Inputs& in) {
  LayerActs<S> a;
  LayerGrads<S> g;
  LayerParams<S> p, pg;
  a.allocate(d, ScanMode::Chunked);
  g.allocate(d, ScanMode::Chunked);
  load_acts(in, a, g, p, pg);
  m3::ref::ssm_chunked_forward(d, p, a);
  m3::ref::ssm_chunked_backward(d, p, a, g, pg);
  Tensors t;
  for (const auto& [name, v] :
       std::vector<std::pair<const char*, const std::vector<S>*>>{
           {"adt", &a.adt}, {"k_scaled_saved", &a.k_scaled_saved},
           {"qk_dot_saved", &a.qk_dot_saved}, {"scale_saved", &a.scale_saved},
           {"gamma_saved", &a.gamma_saved}, {"da_cumsum_saved", &a.da_cumsum_saved},
           {"chunk_states", &a.chunk_states}, {"chunk_states_saved", &a.chunk_states_saved},
           {"final_states", &a.final_states}, {"y", &a.y}, {"ssm_out", &a.ssm_out},
           {"k_out", &a.k_out}, {"v_out", &a.v_out}, {"da_cs_sum", &g.da_cs_sum},
           {"dQ_mid", &g.dQ_mid}, {"dK_mid", &g.dK_mid}, {"dADT", &g.dADT},
           {"dQK_dot", &g.dQK_dot}, {"dD_partials", &g.dD_partials}, {"dScale", &g.dScale},
           {"dGamma", &g.dGamma}, {"dDT", &g.dDT}, {"d_x", &g.d_x},
           {"d_b_pre_rope", &g.d_b_pre_rope}, {"d_c_pre_rope", &g.d_c_pre_rope},
           {"d_angle_cumsum", &g.d_angle_cumsum}, {"d_adt_total", &g.d_adt_total},
           {"d_dt_direct", &g.d_dt_direct}, {"d_trap_sig", &g.d_trap_sig},
           {"d_ssm_in", &g.d_ssm_in}, {"d_k_in", &g.d_k_in}, {"d_v_in", &g.d_v_in},
           {"d_d_param", &pg.d_param}})
    t[name] = to_double(*v);
  return t;
}

// ---- GPU runs ---------------------------------------------------------------------------------
// Scratch of the chunked backward (see gpu/scan/chunked_bwd.cu): dS per chunk and dScale_{−1}.
Idx chunked_scratch_floats(const Dims& d) {
  auto r64 = [](Idx n) { return (n + 63) / 64 * 64; };
  return r64(d.B * d.nc * d.nh * d.hd * d.ds) + r64(d.B * d.nh);
}

class Stream {
 public:
  Stream() { M3_CUDA_CHECK(cudaStreamCreate(&s_)); }
  ~Stream() { cudaStreamDestroy(s_); }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// Named device buffers: inputs uploaded from host values, outputs pre-filled with NaN.
class Bufs {
 public:
  explicit Bufs(cudaStream_t s) : s_(s) {}
  float* in(const std::string& name, const std::vector<double>& v) {
    DeviceArray<float>& a = arrays_[name];
    a.resize(static_cast<Idx>(v.size()));
    const std::vector<float> f = cast<float>(v);
    a.upload(f.data(), s_);
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
    return a.data();
  }
  float* out(const std::string& name, Idx n) {
    DeviceArray<float>& a = arrays_[name];
    a.resize(n);
    if (n) M3_CUDA_CHECK(cudaMemsetAsync(a.data(), 0xff, static_cast<size_t>(n) * 4, s_));
    outs_.push_back(name);
    return a.data();
  }
  Tensors download() {
    M3_CUDA_CHECK(cudaStreamSynchronize(s_));
    Tensors t;
    for (const auto& name : outs_) {
      const DeviceArray<float>& a = arrays_.at(name);
      std::vector<float> h(static_cast<size_t>(a.size()));
      a.download(h.data(), s_);
      M3_CUDA_CHECK(cudaStreamSynchronize(s_));
      t[name] = to_double(h);
    }
    return t;
  }

 private:
  cudaStream_t s_;
  std::map<std::string, DeviceArray<float>> arrays_;
  std::vector<std::string> outs_;
};

// x and d_x with a row stride di + pad (pad > 0), as the production layout's column views of
// proj / d_proj: x is laid into wider rows (pads 0.5), d_x taken back out of them, and every
// pad of d_x must still be the NaN the output was filled with.
std::vector<double> widen(const std::vector<double>& v, Idx rows, Idx cols, Idx pad) {
  if (pad == 0) return v;
  std::vector<double> w(static_cast<size_t>(rows * (cols + pad)), 0.5);
  for (Idx r = 0; r < rows; ++r)
    for (Idx c = 0; c < cols; ++c) w[r * (cols + pad) + c] = v[r * cols + c];
  return w;
}
void narrow(Tensors& t, const std::string& name, Idx rows, Idx cols, Idx pad) {
  if (pad == 0) return;
  const std::vector<double>& w = t.at(name);
  std::vector<double> v(static_cast<size_t>(rows * cols));
  bool pads_nan = true;
  for (Idx r = 0; r < rows; ++r)
    for (Idx c = 0; c < cols + pad; ++c) {
      const double e = w[r * (cols + pad) + c];
      if (c < cols) v[r * cols + c] = e;
      else pads_nan = pads_nan && std::isnan(e);
    }
  EXPECT_TRUE(pads_nan) << name << ": a value outside its columns was written";
  t[name] = v;
}

m3::gpu::Scratch make_scratch(DeviceArray<float>& buf, const Dims& d) {
  buf.resize(std::max(m3::gpu::scratch_floats(d), chunked_scratch_floats(d)));
  return {buf.data(), buf.size()};
}

// Sequential mode; with `glue`, also the GPU rope backward of d_k, d_q (as the backbone does) so
// that the RoPE-side gradients can be compared with the chunked mode; the B5b inputs
// (d_adt_total, …) are formed on the host by the reference abg_backward from d_alpha/β/γ.
Tensors gpu_seq(const Dims& d, const Inputs& in, bool glue, Idx pad = 0) {
  Stream st;
  const cudaStream_t s = st.get();
  Bufs b(s);
  const Idx BT = d.BT, nh = d.nh;
  m3::gpu::SsmSeqFwd<float> f{};
  f.x = b.in("x", widen(in.x, BT, d.di, pad));
  f.ldx = pad ? d.di + pad : 0;
  f.k = b.in("k", in.k);
  f.q = b.in("q", in.q);
  f.alpha = b.in("alpha", in.alpha);
  f.beta = b.in("beta", in.beta);
  f.gamma = b.in("gamma", in.gamma);
  f.d_param = b.in("d_param", in.d_param);
  f.ssm_in = b.in("ssm_in", in.ssm_in);
  f.k_in = b.in("k_in", in.k_in);
  f.v_in = b.in("v_in", in.v_in);
  f.y = b.out("y", BT * d.di);
  f.h_saved = b.out("h_saved", d.B * (d.T + 1) * d.ds * d.di);
  f.k_prev_saved = b.out("k_prev_saved", BT * nh * d.ds);
  f.v_prev_saved = b.out("v_prev_saved", BT * nh * d.hd);
  f.ssm_out = b.out("ssm_out", d.B * nh * d.hd * d.ds);
  f.k_out = b.out("k_out", d.B * nh * d.ds);
  f.v_out = b.out("v_out", d.B * nh * d.hd);
  m3::gpu::ssm_seq_forward<float>(s, d, f);

  DeviceArray<float> scr;
  m3::gpu::SsmSeqBwd<float> g{};
  g.x = f.x;
  g.k = f.k;
  g.q = f.q;
  g.d_y = b.in("d_y", in.d_y);
  g.alpha = f.alpha;
  g.beta = f.beta;
  g.gamma = f.gamma;
  g.d_param = f.d_param;
  g.h_saved = f.h_saved;
  g.k_prev_saved = f.k_prev_saved;
  g.v_prev_saved = f.v_prev_saved;
  g.d_ssm_out = b.in("d_ssm_out", in.d_ssm_out);
  g.d_k_out = b.in("d_k_out", in.d_k_out);
  g.d_v_out = b.in("d_v_out", in.d_v_out);
  g.d_x = b.out("d_x", BT * (d.di + pad));
  g.ldx = f.ldx;
  g.d_k = b.out("d_k", BT * nh * d.ds);
  g.d_q = b.out("d_q", BT * nh * d.ds);
  g.d_alpha = b.out("d_alpha", BT * nh);
  g.d_beta = b.out("d_beta", BT * nh);
  g.d_gamma = b.out("d_gamma", BT * nh);
  g.d_d_local = b.out("d_d_local", d.B * d.di);
  g.d_ssm_in = b.out("d_ssm_in", d.B * nh * d.hd * d.ds);
  g.d_k_in = b.out("d_k_in", d.B * nh * d.ds);
  g.d_v_in = b.out("d_v_in", d.B * nh * d.hd);
  g.d_d_param = b.in("d_d_param", in.d_param_acc);
  m3::gpu::ssm_seq_backward<float>(s, d, g, make_scratch(scr, d));
  if (glue) {
    m3::gpu::RopeBwd<float> rb{};
    rb.theta = b.in("theta", in.theta);
    rb.dv1 = g.d_k;
    rb.dv2 = g.d_q;
    rb.rot1 = f.k;
    rb.rot2 = f.q;
    rb.dpre1 = b.out("d_b_pre_rope", BT * nh * d.ds);
    rb.dpre2 = b.out("d_c_pre_rope", BT * nh * d.ds);
    rb.dtheta = b.out("d_angle_cumsum", BT * nh * d.na);
    m3::gpu::rope_backward<float>(s, d, rb);
  }
  Tensors t = b.download();
  narrow(t, "d_x", BT, d.di, pad);
  std::vector<float> acc(static_cast<size_t>(nh));
  M3_CUDA_CHECK(cudaMemcpy(acc.data(), g.d_d_param, acc.size() * 4, cudaMemcpyDeviceToHost));
  t["d_d_param"] = to_double(acc);
  if (glue) {
    LayerActs<double> a;
    LayerGrads<double> gr;
    a.alpha = in.alpha;
    a.beta = in.beta;
    a.dt = in.dt;
    a.trap = in.trap;
    gr.d_alpha = t["d_alpha"];
    gr.d_beta = t["d_beta"];
    gr.d_gamma = t["d_gamma"];
    for (auto* v : {&gr.d_adt_total, &gr.d_dt_direct, &gr.d_trap_sig}) v->resize(BT * nh);
    m3::ref::abg_backward(d, a, gr);
    t["d_adt_total"] = gr.d_adt_total;
    t["d_dt_direct"] = gr.d_dt_direct;
    t["d_trap_sig"] = gr.d_trap_sig;
  }
  return t;
}

Tensors gpu_chunked(const Dims& d, const Inputs& in, Idx pad = 0) {
  Stream st;
  const cudaStream_t s = st.get();
  Bufs b(s);
  const Idx BT = d.BT, nh = d.nh, nstate = d.B * d.nc * nh * d.hd * d.ds;
  DeviceArray<float> scr;
  const m3::gpu::Scratch scratch = make_scratch(scr, d);
  m3::gpu::SsmChunkFwd<float> f{};
  f.x = b.in("x", widen(in.x, BT, d.di, pad));
  f.ldx = pad ? d.di + pad : 0;
  f.k = b.in("k", in.k);
  f.q = b.in("q", in.q);
  f.dt = b.in("dt", in.dt);
  f.trap = b.in("trap", in.trap);
  f.a_val = b.in("a_val", in.a_val);
  f.d_param = b.in("d_param", in.d_param);
  f.ssm_in = b.in("ssm_in", in.ssm_in);
  f.k_in = b.in("k_in", in.k_in);
  f.v_in = b.in("v_in", in.v_in);
  f.k_scaled_saved = b.out("k_scaled_saved", BT * nh * d.ds);
  f.y = b.out("y", BT * d.di);
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
  m3::gpu::ssm_chunked_forward<float>(s, d, f, scratch);

  m3::gpu::SsmChunkBwd<float> g{};
  g.x = f.x;
  g.k = f.k;
  g.q = f.q;
  g.b_biased = b.in("b_biased", in.b_biased);
  g.c_biased = b.in("c_biased", in.c_biased);
  g.k_scaled_saved = f.k_scaled_saved;
  g.d_y = b.in("d_y", in.d_y);
  g.theta = b.in("theta", in.theta);
  g.dt = f.dt;
  g.trap = f.trap;
  g.a_val = f.a_val;
  g.d_param = f.d_param;
  g.qk_dot_saved = f.qk_dot_saved;
  g.scale_saved = f.scale_saved;
  g.gamma_saved = f.gamma_saved;
  g.da_cumsum_saved = f.da_cumsum_saved;
  g.chunk_states_saved = f.chunk_states_saved;
  g.k_in = f.k_in;
  g.v_in = f.v_in;
  g.d_ssm_out = b.in("d_ssm_out", in.d_ssm_out);
  g.d_k_out = b.in("d_k_out", in.d_k_out);
  g.d_v_out = b.in("d_v_out", in.d_v_out);
  g.da_cs_sum = b.out("da_cs_sum", d.B * d.nc * nh);
  g.dQ_mid = b.out("dQ_mid", BT * nh * d.ds);
  g.dK_mid = b.out("dK_mid", BT * nh * d.ds);
  g.dADT = b.out("dADT", BT * nh);
  g.dQK_dot = b.out("dQK_dot", BT * nh);
  g.dD_partials = b.out("dD_partials", d.B * nh);
  g.dScale = b.out("dScale", BT * nh);
  g.dGamma = b.out("dGamma", BT * nh);
  g.dDT = b.out("dDT", BT * nh);
  g.d_x = b.out("d_x", BT * (d.di + pad));
  g.ldx = f.ldx;
  g.d_b_pre_rope = b.out("d_b_pre_rope", BT * nh * d.ds);
  g.d_c_pre_rope = b.out("d_c_pre_rope", BT * nh * d.ds);
  g.d_angle_cumsum = b.out("d_angle_cumsum", BT * nh * d.na);
  g.d_adt_total = b.out("d_adt_total", BT * nh);
  g.d_dt_direct = b.out("d_dt_direct", BT * nh);
  g.d_trap_sig = b.out("d_trap_sig", BT * nh);
  g.d_ssm_in = b.out("d_ssm_in", d.B * nh * d.hd * d.ds);
  g.d_k_in = b.out("d_k_in", d.B * nh * d.ds);
  g.d_v_in = b.out("d_v_in", d.B * nh * d.hd);
  g.d_d_param = b.in("d_d_param", in.d_param_acc);
  m3::gpu::ssm_chunked_backward<float>(s, d, g, scratch);
  Tensors t = b.download();
  narrow(t, "d_x", BT, d.di, pad);
  std::vector<float> acc(static_cast<size_t>(nh));
  M3_CUDA_CHECK(cudaMemcpy(acc.data(), g.d_d_param, acc.size() * 4, cudaMemcpyDeviceToHost));
  t["d_d_param"] = to_double(acc);
  return t;
}

// ---- metrics ----------------------------------------------------------------------------------
struct Err {
  double rel_l2 = 0, max_rel = 0;
};

// The harness metrics of a against b (test_compare.hpp): rel_l2 = ‖a − b‖₂ / ‖b‖₂ and
// max|a − b| / max|b|; a non-finite value anywhere → +inf.
Err err(const std::vector<double>& a, const std::vector<double>& b) {
  const m3::harness::Metrics m = m3::test::metrics(a, b);
  return {m3::test::rel_l2(m), m3::test::max_rel_err(m)};
}

constexpr double kRelL2 = 1e-5, kMaxRel = 1e-4, kFactor = 4;

// got vs truth, allowed max(base, kFactor × err(base_got vs base_truth)): the same comparison
// made by the float reference (the f32 baseline).
void expect_close(const std::string& what, const Tensors& got, const Tensors& truth,
                  const Tensors& base_got, const Tensors& base_truth,
                  const std::vector<std::string>& names) {
  double worst = 0;
  std::string worst_name;
  for (const auto& n : names) {
    ASSERT_TRUE(got.count(n)) << what << ": GPU run lacks " << n;
    ASSERT_TRUE(truth.count(n)) << what << ": truth lacks " << n;
    ASSERT_TRUE(base_got.count(n) && base_truth.count(n)) << what << ": baseline lacks " << n;
    const auto& a = got.at(n);
    const auto& t = truth.at(n);
    const auto& fa = base_got.at(n);
    const auto& ft = base_truth.at(n);
    ASSERT_EQ(a.size(), t.size()) << what << ": " << n;
    ASSERT_EQ(fa.size(), t.size()) << what << ": " << n;
    ASSERT_EQ(ft.size(), t.size()) << what << ": " << n;
    const Err e = err(a, t), ef = err(fa, ft);
    const double tol_l2 = std::max(kRelL2, kFactor * ef.rel_l2);
    const double tol_mx = std::max(kMaxRel, kFactor * ef.max_rel);
    EXPECT_LE(e.rel_l2, tol_l2) << what << ": " << n << " rel_l2 (baseline " << ef.rel_l2 << ")";
    EXPECT_LE(e.max_rel, tol_mx) << what << ": " << n << " max|Δ|/max|ref| (baseline "
                                 << ef.max_rel << ")";
    const double w = std::max(e.rel_l2 / tol_l2, e.max_rel / tol_mx);
    if (w >= worst) {
      worst = w;
      worst_name = n;
    }
  }
  std::printf("[gpu-ssm] %-12s worst %.3f of tolerance (%s)\n", what.c_str(), worst,
              worst_name.c_str());
}

std::vector<std::string> keys_of(const Tensors& t) {
  std::vector<std::string> k;
  for (const auto& [n, v] : t) k.push_back(n);
  return k;
}

// ---- tests ------------------------------------------------------------------------------------
class SsmSeqGpu : public ::testing::TestWithParam<SsmCase> {};
class SsmChunkedGpu : public ::testing::TestWithParam<SsmCase> {};
class SsmGpu : public ::testing::TestWithParam<SsmCase> {};

TEST_P(SsmSeqGpu, MatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  const SsmCase& c = GetParam();
  const Dims d = dims_of(c);
  const Inputs in = make_inputs(d, c, 17);
  const Tensors truth = ref_seq<double>(d, in), base = ref_seq<float>(d, in);
  const Tensors got = gpu_seq(d, in, false);
  expect_close("seq", got, truth, base, truth, keys_of(got));
}

TEST_P(SsmChunkedGpu, MatchesReference) {
  M3_SKIP_WITHOUT_GPU();
  const SsmCase& c = GetParam();
  const Dims d = dims_of(c);
  const Inputs in = make_inputs(d, c, 23);
  const Tensors truth = ref_chunked<double>(d, in), base = ref_chunked<float>(d, in);
  const Tensors got = gpu_chunked(d, in);
  expect_close("chunked", got, truth, base, truth, keys_of(got));
}

// The two GPU modes agree; allowed: max(base, kFactor × the float reference's own
// sequential-vs-chunked difference).
TEST_P(SsmGpu, SequentialEqualsChunked) {
  M3_SKIP_WITHOUT_GPU();
  const SsmCase& c = GetParam();
  const Dims d = dims_of(c);
  const Inputs in = make_inputs(d, c, 29);
  const Tensors seq = gpu_seq(d, in, true), chk = gpu_chunked(d, in);
  const Tensors fseq = ref_seq<float>(d, in), fchk = ref_chunked<float>(d, in);
  const std::vector<std::string> common = {
      "y", "ssm_out", "k_out", "v_out", "d_x", "d_b_pre_rope", "d_c_pre_rope",
      "d_angle_cumsum", "d_adt_total", "d_dt_direct", "d_trap_sig", "d_ssm_in", "d_k_in",
      "d_v_in", "d_d_param"};
  expect_close("seq≡chunked", chk, seq, fchk, fseq, common);
}

// Every tensor of a is bit for bit the same tensor of b (what: how b was run).
void expect_bits_equal(const Tensors& a, const Tensors& b, const std::string& what) {
  for (const auto& [n, v] : a) {
    const auto& w = b.at(n);
    ASSERT_EQ(v.size(), w.size()) << n;
    EXPECT_EQ(0, std::memcmp(v.data(), w.data(), v.size() * sizeof(double)))
        << n << " differs " << what;
  }
}

TEST_P(SsmGpu, RunsAreBitIdentical) {
  M3_SKIP_WITHOUT_GPU();
  const SsmCase& c = GetParam();
  const Dims d = dims_of(c);
  const Inputs in = make_inputs(d, c, 31);
  expect_bits_equal(gpu_seq(d, in, false), gpu_seq(d, in, false), "between two seq runs");
  expect_bits_equal(gpu_chunked(d, in), gpu_chunked(d, in), "between two chunked runs");
}

// x and d_x with a row stride (the production layout's column views of proj and d_proj): the
// bits of the contiguous run in both modes, for an odd pad (f32 loads one value at a time).
TEST_P(SsmGpu, StridedXGivesTheContiguousBits) {
  M3_SKIP_WITHOUT_GPU();
  const SsmCase& c = GetParam();
  const Dims d = dims_of(c);
  const Inputs in = make_inputs(d, c, 37);
  expect_bits_equal(gpu_seq(d, in, false), gpu_seq(d, in, false, 5),
                    "in seq with x at row stride d_inner + 5");
  expect_bits_equal(gpu_chunked(d, in), gpu_chunked(d, in, 5),
                    "in chunked with x at row stride d_inner + 5");
}

INSTANTIATE_TEST_SUITE_P(Cases, SsmSeqGpu, ::testing::ValuesIn(ssm_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Cases, SsmChunkedGpu, ::testing::ValuesIn(ssm_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Cases, SsmGpu, ::testing::ValuesIn(ssm_cases()), case_name);

TEST(SsmGpuShapes, RejectsUnsupportedShape) {
  M3_SKIP_WITHOUT_GPU();
  for (const auto& [hd, ds] : std::vector<std::pair<Idx, Idx>>{{256, 16}, {16, 256}}) {
    const SsmCase c{hd, ds, 1, 1, 8, 4, false, false};
    const Dims d = dims_of(c);
    m3::gpu::SsmSeqFwd<float> f{};
    m3::gpu::SsmChunkFwd<float> cf{};
    EXPECT_THROW(m3::gpu::ssm_seq_forward<float>(nullptr, d, f), m3::Error) << c.name();
    EXPECT_THROW(m3::gpu::ssm_chunked_forward<float>(nullptr, d, cf, {}), m3::Error) << c.name();
  }
}

TEST(SsmGpuShapes, ScratchFloatsCoverChunkedBackward) {
  for (const SsmCase& c : ssm_cases()) {
    const Dims d = dims_of(c);
    EXPECT_GE(m3::gpu::scratch_floats(d), chunked_scratch_floats(d)) << c.name();
  }
}

}  // namespace
