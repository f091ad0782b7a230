// The GPU backbone end to end against the double oracle, with the float reference as the
// baseline (HARNESS.md §1, §4): every stage tensor and every gradient within the f32 budget,
// for a sample of the coverage grid of MODEL.md §12.7 in both scan modes (the whole grid with
// M3_GPU_FULL_GRID=1, as scripts/gpu-check.sh runs it); sequential ≡ chunked on the GPU;
// chained windows = one window; bit-identical results over 20 runs (§7, §12.9); the fused
// production path = every stage on its own; row slabs = one launch; graph replays = stream
// launches. Skips itself, with the reason, when no CUDA device is present.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <sstream>
#include <string>
#include <vector>

#include "../test_compare.hpp"
#include "backbone.hpp"
#include "backbone_gpu.hpp"
#include "compare.hpp"
#include "device.hpp"
#include "error.hpp"
#include "gpu_test_util.hpp"
#include "graph.hpp"
#include "params.hpp"
#include "problem.hpp"
#include "registry.hpp"

namespace {

using m3::Capture;
using m3::Config;
using m3::Idx;
using m3::Problem;
using m3::ScanMode;

m3::gpu::GpuContext& ctx() {
  static m3::gpu::GpuContext c(0);
  return c;
}

struct GridCase {
  std::string name;
  Config cfg;
  Idx B, T;
};

Config grid_config(Idx hd, Idx ds, double rope, bool outnorm, Idx ngroups) {
  Config c;
  c.headdim = hd;
  c.d_state = ds;
  c.d_model = 2 * hd;  // d_inner = 4·hd → 4 heads
  c.expand = 2;
  c.ngroups = ngroups;
  c.n_layers = 2;
  c.rope_fraction = rope;
  c.is_outproj_norm = outnorm;
  c.input_dim = c.d_model;
  c.chunk_size = 64;
  return c;
}

std::vector<GridCase> grid(bool full) {
  std::vector<GridCase> out;
  const std::vector<Idx> hds = {16, 32, 64, 128}, dss = {16, 32, 64, 128};
  int i = 0;
  for (Idx hd : hds)
    for (Idx ds : dss) {
      const bool outnorm = (i % 2) == 1;
      const double rope = (i % 3) == 2 ? 1.0 : 0.5;
      const Idx ng = (i % 4) == 3 ? 2 : 1;
      ++i;
      // The sample: the diagonal plus the official shape (hd 64, ds 128).
      if (!full && !(hd == ds || (hd == 64 && ds == 128))) continue;
      std::ostringstream n;
      n << "hd" << hd << "_ds" << ds << (outnorm ? "_outnorm" : "_silu") << "_rope" << rope
        << "_ng" << ng;
      out.push_back({n.str(), grid_config(hd, ds, rope, outnorm, ng), 2, 100});
    }
  // Edge shapes: no RoPE at all (na = 0), identity input_proj, chunk > T, T = 1, d_inner 4096.
  Config c = grid_config(16, 2, 0.5, false, 1);
  out.push_back({"na0_ds2", c, 2, 70});
  c = grid_config(32, 16, 1.0, true, 1);
  c.input_proj_identity = true;
  out.push_back({"identity_input", c, 1, 33});
  c = grid_config(16, 16, 0.5, false, 2);
  c.chunk_size = 200;
  out.push_back({"chunk_gt_T", c, 2, 50});
  c = grid_config(32, 32, 0.5, true, 1);
  out.push_back({"T1", c, 3, 1});
  // d_inner 4096 with the gated norm (the seeds' kernels stopped at 1024), 64 heads, 8 groups.
  c = grid_config(64, 64, 1.0, true, 8);
  c.d_model = 2048;
  c.input_dim = 2048;
  c.n_layers = 1;
  out.push_back({"d_inner4096_outnorm", c, 1, 24});
  return out;
}

// The cases of the full grid with these names, in grid order (a test asserts it got them all).
std::vector<GridCase> grid_cases(std::initializer_list<std::string> names) {
  std::vector<GridCase> out;
  for (const GridCase& g : grid(true))
    if (std::find(names.begin(), names.end(), g.name) != names.end()) out.push_back(g);
  return out;
}

bool full_grid() {
  const char* e = std::getenv("M3_GPU_FULL_GRID");
  return e && std::string(e) == "1";
}

std::string describe_failure(const m3::harness::CompareResult& r) {
  if (r.pass()) return "";
  const auto& row = r.rows[static_cast<size_t>(r.first_fail)];
  std::ostringstream os;
  os << r.n_fail() << " failing; first " << row.key << " (" << m3::harness::status_name(row.status)
     << ") rel_l2 " << row.subject.rel_l2 << " max_abs " << row.subject.max_abs << " at "
     << row.worst_coords << " " << row.note;
  return os.str();
}

TEST(GpuBackbone, CoverageGridWithinF32BudgetBothModes) {
  M3_SKIP_WITHOUT_GPU();
  for (const auto& gc : grid(full_grid())) {
    SCOPED_TRACE(gc.name);
    const Problem pb = m3::make_problem(gc.cfg, gc.B, gc.T, 77, true);
    for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
      const Capture oracle = m3::run_reference<double>(pb, mode);
      const Capture baseline = m3::run_reference<float>(pb, mode);
      const Capture subject = m3::gpu::run_gpu(ctx(), pb, mode);
      const auto r = m3::harness::compare_captures(oracle, subject, &baseline, pb.cfg, pb.B,
                                                   pb.T, mode);
      EXPECT_TRUE(r.pass()) << gc.name << " [" << m3::scan_mode_name(mode) << "] "
                            << describe_failure(r);
    }
  }
}

TEST(GpuBackbone, SequentialEqualsChunkedOnTheGpu) {
  M3_SKIP_WITHOUT_GPU();
  Config c = grid_config(64, 128, 0.5, true, 1);
  c.chunk_size = 16;
  const Problem pb = m3::make_problem(c, 2, 77, 5, true);
  const Capture seq = m3::gpu::run_gpu(ctx(), pb, ScanMode::Sequential);
  const Capture chk = m3::gpu::run_gpu(ctx(), pb, ScanMode::Chunked);
  int compared = 0;
  for (const auto& key : seq.keys()) {
    const m3::Tensor* t = chk.find(key);
    if (!t) continue;  // mode-specific intermediate
    const auto& spec_key = key;
    if (spec_key.find("angle") != std::string::npos) continue;  // circular; covered by budget test
    // Near-zero tensors (e.g. d_angle_state without entering angles) are skipped by scale.
    double scale = 0;
    for (double v : seq.at(key).data) scale = std::max(scale, std::abs(v));
    if (scale < 1e-6) continue;
    EXPECT_LE(m3::test::rel_l2(t->data, seq.at(key).data), 2e-4) << key;
    ++compared;
  }
  EXPECT_GT(compared, 100);
}

TEST(GpuBackbone, TwoChainedWindowsEqualOneWindow) {
  M3_SKIP_WITHOUT_GPU();
  for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
    SCOPED_TRACE(m3::scan_mode_name(mode));
    Config c = grid_config(32, 32, 1.0, false, 1);
    c.chunk_size = 8;
    const Idx B = 2, T = 40, H = 20;
    const Problem pb = m3::make_problem(c, B, T, 9, true);
    const auto params = m3::cast_params<float>(pb.params);
    std::vector<float> x(pb.x.begin(), pb.x.end()), dout(pb.d_out.begin(), pb.d_out.end());
    // One window of T.
    m3::gpu::GpuBackbone whole(ctx(), c, B, T, mode);
    m3::gpu::load_problem(whole, pb);
    whole.forward();
    whole.backward();
    const auto out_whole = whole.output();
    const auto g_whole = whole.grads();
    // Two windows of T/2: rows (b, t) split per sample.
    auto half = [&](const std::vector<float>& v, Idx width, Idx t0) {
      std::vector<float> h(static_cast<size_t>(B * H * width));
      for (Idx b = 0; b < B; ++b)
        std::memcpy(h.data() + b * H * width, v.data() + (b * T + t0) * width,
                    sizeof(float) * static_cast<size_t>(H * width));
      return h;
    };
    m3::gpu::GpuBackbone w1(ctx(), c, B, H, mode), w2(ctx(), c, B, H, mode);
    for (auto* w : {&w1, &w2}) {
      w->set_params(params);
      w->zero_grads();
    }
    w1.set_input(half(x, c.input_dim, 0));
    w1.set_states(m3::cast_states<float>(pb.states));
    w1.set_dout(half(dout, c.d_model, 0));
    w1.forward();
    w2.set_input(half(x, c.input_dim, H));
    w2.set_states(w1.states());
    w2.set_dout(half(dout, c.d_model, H));
    w2.set_leaving_grads(nullptr);
    w2.forward();
    w2.backward();
    const auto d_enter2 = w2.d_entering();
    w1.set_leaving_grads(&d_enter2);
    w1.backward();
    const auto o1 = w1.output(), o2 = w2.output();
    std::vector<double> out_windows(out_whole.size());  // the two windows' outputs, in place
    for (Idx b = 0; b < B; ++b)
      for (Idx t = 0; t < T; ++t)
        for (Idx i = 0; i < c.d_model; ++i)
          out_windows[(b * T + t) * c.d_model + i] =
              t < H ? o1[(b * H + t) * c.d_model + i] : o2[(b * H + t - H) * c.d_model + i];
    EXPECT_LE(m3::test::rel_l2(out_windows, out_whole), 1e-5) << "Out";
    const auto g1 = w1.grads(), g2 = w2.grads();
    std::vector<const std::vector<float>*> a, b1, b2;
    m3::for_each_param(g_whole, [&](int, const char*, const std::vector<float>& v) { a.push_back(&v); });
    m3::for_each_param(g1, [&](int, const char*, const std::vector<float>& v) { b1.push_back(&v); });
    m3::for_each_param(g2, [&](int, const char*, const std::vector<float>& v) { b2.push_back(&v); });
    for (size_t p = 0; p < a.size(); ++p) {
      std::vector<double> sum(a[p]->size());  // the two windows' gradients, added in double
      for (size_t i = 0; i < sum.size(); ++i)
        sum[i] = double((*b1[p])[i]) + double((*b2[p])[i]);
      const m3::harness::Metrics m = m3::test::metrics(sum, *a[p]);
      if (m.oracle_l2 > 0) {
        EXPECT_LE(m3::test::rel_l2(m), 1e-4) << "param #" << p;
      }
    }
  }
}

TEST(GpuBackbone, BitIdenticalOverTwentyRunsBothModes) {
  M3_SKIP_WITHOUT_GPU();
  Config c = grid_config(64, 128, 0.5, true, 2);
  c.chunk_size = 32;
  const Problem pb = m3::make_problem(c, 2, 96, 3, true);
  for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
    const Capture first = m3::gpu::run_gpu(ctx(), pb, mode);
    for (int run = 1; run < 20; ++run) {
      const Capture again = m3::gpu::run_gpu(ctx(), pb, mode);
      ASSERT_EQ(first_bit_difference(first, again), "")
          << m3::scan_mode_name(mode) << " run " << run << ": the first divergent tensor";
    }
  }
}

// One forward+backward of pb on a fresh GpuBackbone (zero leaving-state gradients): with
// `captured`, every stage tensor goes into cap, and every gradient always does. With replays > 0
// (no capture: a Capture copies to the host) the forward+backward is recorded as a CUDA graph
// and replayed that many times, the entering states set and the gradients zeroed before each:
// the run is the last replay.
struct BackboneRun {
  Capture cap;
  std::vector<float> dx;
  m3::States<float> leaving;
};
// What the last pass left: every gradient into run.cap (beside any stage tensors a Capture put
// there), d_x and the leaving states.
void collect(m3::gpu::GpuBackbone& net, const Problem& pb, BackboneRun& run) {
  m3::capture_grads(net.grads(), pb.cfg, run.cap);
  run.dx = net.d_x();
  run.leaving = net.states();
}
// cluster_tail: GpuBackbone::set_cluster_tail (B6's tail inside B3 where the shape allows it).
BackboneRun run_backbone(const Problem& pb, ScanMode mode, m3::Precision storage, bool fused,
                         bool captured, int replays = 0, bool cluster_tail = false) {
  BackboneRun run{Capture(pb.cfg, pb.B, pb.T), {}, {}};
  m3::gpu::GpuBackbone net(ctx(), pb.cfg, pb.B, pb.T, mode, storage);
  net.set_fusion(fused);
  net.set_cluster_tail(cluster_tail);
  m3::gpu::load_problem(net, pb);
  Capture* cap = captured ? &run.cap : nullptr;
  if (replays > 0) {
    const m3::States<float> entering = m3::cast_states<float>(pb.states);
    const m3::gpu::StreamGraph graph(ctx(), [&] {
      net.forward(nullptr);
      net.backward(nullptr);
    });
    EXPECT_GT(graph.nodes(), 0);
    for (int i = 0; i < replays; ++i) {
      net.set_states(entering);
      net.zero_grads();
      graph.launch();
    }
  } else {
    net.forward(cap);
    net.backward(cap);
  }
  collect(net, pb, run);
  return run;
}

bool same_states(const m3::States<float>& a, const m3::States<float>& b) {
  return a.ssm == b.ssm && a.k == b.k && a.v == b.v && a.angle == b.angle;
}

// b gives the same bits as a: d_x, the leaving states, and every tensor a holds (b may hold
// more: a Capture against none).
void expect_same_bits(const BackboneRun& a, const BackboneRun& b, const std::string& what) {
  EXPECT_EQ(a.dx, b.dx) << what << ": d_x";
  EXPECT_TRUE(same_states(a.leaving, b.leaving))
      << what << ": leaving states (k_out: the k F6 reads at T − 1)";
  for (const auto& key : a.cap.keys()) {
    const auto& x = a.cap.at(key).data;
    const auto& y = b.cap.at(key).data;
    ASSERT_EQ(x.size(), y.size()) << what << " " << key;
    EXPECT_EQ(0, std::memcmp(x.data(), y.data(), x.size() * sizeof(double)))
        << what << ": " << key << " differs";
  }
}

// a and b are the same sums taken in two fixed orders: a few f32 roundings apart,
// max|a − b| ≤ 1e-5·max|a|, and not all zeros unless may_be_zero (then 0 must stay 0).
void expect_same_sums(const std::vector<double>& a, const std::vector<double>& b,
                      const std::string& what, bool may_be_zero = false) {
  double scale = 0, diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, std::abs(a[i]));
    diff = std::max(diff, std::abs(a[i] - b[i]));
  }
  if (!may_be_zero) {
    EXPECT_GT(scale, 0.0) << what << " is all zeros";
  }
  EXPECT_LE(diff, 1e-5 * scale) << what;
}

// The fused stages (F4's bias add recomputed in F4ef and B6; in the chunked mode F6's K0/K1
// in F4ef and B6's tail doing B4b; without a Capture, F8's residual add done by the next norm:
// the production path) against every stage on its own (set_fusion(false), the
// isolated mode's path), on the same inputs, both scan modes: every captured tensor and
// gradient bit for bit equal, except the bias gradients, which the fused tail sums in another
// fixed order (close to f32 rounding). With and without a Capture (without one the fused path
// stores neither b/c_biased nor d_b/c_pre_rope). The fused side runs the standalone tail
// (set_cluster_tail(false)); ClusterTailAgreesWithTheSeparateTail holds the tail inside B3 to it.
TEST(GpuBackbone, FusedBackwardTailEqualsStageByStage) {
  M3_SKIP_WITHOUT_GPU();
  auto is_bias_grad = [](const std::string& key) {
    return key.rfind("grad/", 0) == 0 && (key.find("/b_bias") != std::string::npos ||
                                          key.find("/c_bias") != std::string::npos);
  };
  std::vector<GridCase> cases =
      grid_cases({"hd16_ds16_silu_rope0.5_ng1", "hd64_ds128_outnorm_rope1_ng2",
                  "hd32_ds128_outnorm_rope0.5_ng2", "na0_ds2", "chunk_gt_T", "T1",
                  "d_inner4096_outnorm"});
  ASSERT_EQ(cases.size(), 7u) << "a named grid case is missing";
  // 40 heads × d_state 128, 2 groups: 20 heads per group, a head count that is no multiple of
  // the tail's 8 warps (its head sums were once too wide for shared memory here).
  Config wide = grid_config(16, 128, 0.5, false, 2);
  wide.d_model = 320;
  wide.input_dim = 320;
  wide.n_layers = 1;
  cases.push_back({"nh40_ds128_ng2", wide, 1, 24});
  for (const GridCase& gc : cases) {
    const Problem pb = m3::make_problem(gc.cfg, gc.B, gc.T, 11, true);
    for (m3::Precision storage :
         {m3::Precision::F32, m3::Precision::BF16, m3::Precision::F16}) {
      for (ScanMode mode : {ScanMode::Chunked, ScanMode::Sequential}) {
        // run[fused][captured]: the captured tensors (with a Capture) and every gradient.
        BackboneRun run[2][2];
        for (int fused = 0; fused < 2; ++fused)
          for (int captured = 0; captured < 2; ++captured)
            run[fused][captured] =
                run_backbone(pb, mode, storage, fused == 1, captured == 1, 0, false);
        const std::string what =
            gc.name + " " + m3::precision_name(storage) + " " + m3::scan_mode_name(mode);
        // A Capture changes nothing (tensors that only a capture stores, like d_pre_norm and
        // the unfused d_b/c_pre_rope, are computed either way).
        for (int fused = 0; fused < 2; ++fused)
          expect_same_bits(run[fused][0], run[fused][1],
                           what + (fused ? " fused" : " unfused") + ", capture vs none");
        // Fused against unfused, every captured tensor and gradient.
        const Capture &unf = run[0][1].cap, &fus = run[1][1].cap;
        ASSERT_EQ(unf.keys(), fus.keys()) << what;
        ASSERT_EQ(run[0][1].dx, run[1][1].dx) << what << ": d_x";
        EXPECT_TRUE(same_states(run[0][1].leaving, run[1][1].leaving))
            << what << ": leaving states, fused vs unfused";
        for (const auto& key : unf.keys()) {
          const auto& a = unf.at(key).data;
          const auto& b = fus.at(key).data;
          ASSERT_EQ(a.size(), b.size()) << what << " " << key;
          if (!is_bias_grad(key)) {
            EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(double)))
                << what << ": " << key << " differs between the fused and unfused stages";
            continue;
          }
          expect_same_sums(a, b, what + ": " + key);
        }
      }
    }
  }
}

// B6's tail inside B3 (set_cluster_tail, off by default: step 2 and B4b's head sums in
// B3's blocks, clusters of heads summing through distributed shared memory) against the
// standalone fused tail, on the same inputs, with a Capture:
//   * bit for bit: every forward tensor, and the last layer's backward from B8 through B5a but
//     for dScale, dGamma and dDT — the per-element step 2 (d_angle_cumsum, d_b/c_pre_rope) is
//     tail_pair's instructions on the same values in both, and dQ_mid, dK_mid are B3's;
//   * dScale, dGamma (row sums that the fragments add in another order), the B6 tensors and B5b
//     gradients that follow from them: within 1e-5 of their scale;
//   * d_b/c_normed (B4b's head sums, which add the heads in clusters): each element within one
//     rounding of the storage type of the other (|a − b| ≤ 2^−p·max(|a|, |b|), p = 7 for bf16,
//     10 for f16) and rel_l2 ≤ 2^−p / 4 over the tensor;
//   * the bias gradients (summed per chunk instead of per 32 rows): within 1e-5 of their scale;
//   * every other tensor and gradient (downstream of the head sums): rel_l2 ≤ 2^−p.
// The path must actually run (GpuBackbone::cluster_tail), and the production pass (no Capture,
// no dQ_mid/dK_mid buffers) must give the captured pass's gradients, d_x and states bit for bit.
// f32 and the sequential mode have no cluster tail: there the switch changes no bit at all.
TEST(GpuBackbone, ClusterTailAgreesWithTheSeparateTail) {
  M3_SKIP_WITHOUT_GPU();
  std::vector<GridCase> cases = grid_cases(
      {"hd16_ds16_silu_rope0.5_ng1", "hd64_ds128_outnorm_rope1_ng2",
       "hd32_ds128_outnorm_rope0.5_ng2", "na0_ds2", "chunk_gt_T", "T1", "d_inner4096_outnorm"});
  ASSERT_EQ(cases.size(), 7u) << "a named grid case is missing";
  Config wide = grid_config(16, 128, 0.5, false, 2);  // 40 heads, 20 per group: clusters of 4
  wide.d_model = 320;
  wide.input_dim = 320;
  wide.n_layers = 1;
  cases.push_back({"nh40_ds128_ng2", wide, 1, 130});
  using m3::test::rel_l2;
  // B6's tensors that follow from dScale and dGamma (MODEL.md §6.4 step 3).
  auto from_row_sums = [](const std::string& t) {
    return t == "dScale" || t == "dGamma" || t == "dDT" || t == "d_trap_sig" ||
           t == "d_dt_direct";
  };
  int ran = 0;
  for (const GridCase& gc : cases) {
    const Problem pb = m3::make_problem(gc.cfg, gc.B, gc.T, 19, true);
    const int last = static_cast<int>(gc.cfg.n_layers) - 1;
    for (m3::Precision storage :
         {m3::Precision::F32, m3::Precision::BF16, m3::Precision::F16}) {
      for (ScanMode mode : {ScanMode::Chunked, ScanMode::Sequential}) {
        const std::string what =
            gc.name + " " + m3::precision_name(storage) + " " + m3::scan_mode_name(mode);
        bool active = false;
        {
          m3::gpu::GpuBackbone net(ctx(), gc.cfg, gc.B, gc.T, mode, storage);
          EXPECT_FALSE(net.cluster_tail()) << what << ": off by default";
          net.set_cluster_tail(true);
          active = net.cluster_tail();
          net.set_cluster_tail(false);
          EXPECT_FALSE(net.cluster_tail()) << what;
        }
        const bool typed_chunked =
            storage != m3::Precision::F32 && mode == ScanMode::Chunked;
        EXPECT_EQ(active, typed_chunked) << what << ": where the cluster tail runs";
        const BackboneRun sep = run_backbone(pb, mode, storage, true, true, 0, false);
        const BackboneRun clu = run_backbone(pb, mode, storage, true, true, 0, true);
        const BackboneRun prod = run_backbone(pb, mode, storage, true, false, 0, true);
        expect_same_bits(prod, clu, what + ": production pass vs captured, cluster tail");
        if (!active) {
          expect_same_bits(sep, clu, what + ": no cluster tail, so no change");
          continue;
        }
        ++ran;
        const int p = storage == m3::Precision::BF16 ? 7 : 10;
        const double tol = std::ldexp(1.0, -p);
        ASSERT_EQ(sep.cap.keys(), clu.cap.keys()) << what;
        for (const auto& key : sep.cap.keys()) {
          const auto& a = sep.cap.at(key).data;
          const auto& b = clu.cap.at(key).data;
          ASSERT_EQ(a.size(), b.size()) << what << " " << key;
          // "L<l>/<stage>/<tensor>", "<stage>/<tensor>" or "grad/…".
          std::string rest = key;
          int layer = -1;
          if (rest.rfind("L", 0) == 0 && rest.find('/') != std::string::npos) {
            layer = std::stoi(rest.substr(1, rest.find('/') - 1));
            rest = rest.substr(rest.find('/') + 1);
          }
          const std::string stage = rest.substr(0, rest.find('/'));
          const std::string tensor = rest.substr(rest.find('/') + 1);
          const bool grad = key.rfind("grad/", 0) == 0;
          bool same = false;
          if (!grad) {
            const m3::TensorSpec& spec = m3::find_spec(stage, tensor);
            same = spec.dir == m3::Dir::Forward ||
                   (layer == last && (stage == "B8" || stage == "B7" || stage == "B6" ||
                                      stage == "B5a"));
            if (layer == last && (stage == "B5b" || (stage == "B6" && from_row_sums(tensor)))) {
              // The row sums in another order (all zeros at T = 1).
              expect_same_sums(a, b, what + ": " + key, true);
              continue;
            }
          }
          if (same) {
            EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(double)))
                << what << ": " << key << " differs, but the two tails compute it alike";
            continue;
          }
          if (grad && (key.find("/b_bias") != std::string::npos ||
                       key.find("/c_bias") != std::string::npos) &&
              key.find("L" + std::to_string(last) + "/") != std::string::npos) {
            expect_same_sums(a, b, what + ": " + key);
            continue;
          }
          if (layer == last && (tensor == "d_b_normed" || tensor == "d_c_normed")) {
            // One rounding of each element, plus f32 reordering of a sum that cancels.
            double mx = 0;
            for (double v : a) mx = std::max(mx, std::abs(v));
            size_t bad = a.size();
            for (size_t i = 0; i < a.size() && bad == a.size(); ++i)
              if (std::abs(a[i] - b[i]) >
                  tol * std::max(std::abs(a[i]), std::abs(b[i])) + 1e-6 * mx)
                bad = i;
            EXPECT_EQ(bad, a.size()) << what << ": " << key << " more than one rounding apart at "
                                     << bad << ": " << (bad < a.size() ? a[bad] : 0.0) << " vs "
                                     << (bad < a.size() ? b[bad] : 0.0);
            EXPECT_LE(rel_l2(b, a), tol / 4) << what << ": " << key;
            continue;
          }
          EXPECT_LE(rel_l2(b, a), tol) << what << ": " << key;
        }
        EXPECT_LE(rel_l2(clu.dx, sep.dx), tol) << what << ": d_x";
      }
    }
  }
  EXPECT_EQ(ran, 2 * static_cast<int>(cases.size())) << "bf16 and f16 chunked, every case";
}

// The chunked scan's per-row kernels (F4ef's prep, B6's tail) split their rows into slabs with
// 32-bit offsets; a shape needs more than one slab only past 2^31 elements of [BT, nh, ds], too
// large for a test. With the slab limit forced down (70 rows: prep slabs of 70, tail slabs of
// 64, slab starts inside a sequence, the t = T − 1 rows in later slabs), the fused chunked
// forward+backward must give the same bits as one launch: every captured tensor, gradient
// (the tail's bias partial sums keep their 64-row blocks), d_x and leaving state.
TEST(GpuBackbone, RowSlabsGiveTheBitsOfOneLaunch) {
  M3_SKIP_WITHOUT_GPU();
  const std::vector<GridCase> cases =
      grid_cases({"hd16_ds16_silu_rope0.5_ng1", "hd32_ds128_outnorm_rope0.5_ng2"});
  ASSERT_EQ(cases.size(), 2u) << "a named grid case is missing";
  struct Reset {  // the default limit again, also when an assertion returns early
    ~Reset() { m3::gpu::set_row_slab_limit_for_testing(0); }
  } reset;
  for (const GridCase& gc : cases) {
    ASSERT_GT(gc.B * gc.T, 2 * 70) << "the case must span several slabs";
    const Problem pb = m3::make_problem(gc.cfg, gc.B, gc.T, 13, true);
    for (m3::Precision storage : {m3::Precision::F32, m3::Precision::BF16, m3::Precision::F16}) {
      // With a Capture, every stage tensor; without one (k stored at t = T − 1 only, no
      // d_b/c_pre_rope), the gradients.
      for (bool captured : {false, true}) {
        // The standalone tail (the cluster tail works per chunk, with no slabs).
        m3::gpu::set_row_slab_limit_for_testing(0);
        const BackboneRun one =
            run_backbone(pb, ScanMode::Chunked, storage, true, captured, 0, false);
        m3::gpu::set_row_slab_limit_for_testing(70);
        const BackboneRun sl =
            run_backbone(pb, ScanMode::Chunked, storage, true, captured, 0, false);
        const std::string what = gc.name + " " + m3::precision_name(storage) +
                                 (captured ? " (captured)" : " (no capture)") +
                                 ", one launch vs slabs";
        ASSERT_EQ(one.cap.keys(), sl.cap.keys()) << what;
        expect_same_bits(one, sl, what);
      }
    }
  }
}

// m3h bench --graph times replays of a recorded forward+backward (gpu/graph.hpp). A replay
// must be the stream-launched pass, bit for bit — and a second replay the same again (nothing
// the recording froze, no buffer that a pass accumulates into besides the zeroed gradients):
// every gradient, d_x and the leaving states, fused production path, all dtypes, both modes.
TEST(GpuBackbone, GraphReplayGivesTheBitsOfStreamLaunches) {
  M3_SKIP_WITHOUT_GPU();
  const std::vector<GridCase> cases =
      grid_cases({"hd16_ds16_silu_rope0.5_ng1", "hd32_ds128_outnorm_rope0.5_ng2"});
  ASSERT_EQ(cases.size(), 2u) << "a named grid case is missing";
  for (const GridCase& gc : cases) {
    const Problem pb = m3::make_problem(gc.cfg, gc.B, gc.T, 17, true);
    for (m3::Precision storage : {m3::Precision::F32, m3::Precision::BF16, m3::Precision::F16}) {
      for (ScanMode mode : {ScanMode::Chunked, ScanMode::Sequential}) {
        const std::string what = gc.name + " " + m3::precision_name(storage) + " " +
                                 m3::scan_mode_name(mode) + ", stream vs graph replay";
        const BackboneRun stream = run_backbone(pb, mode, storage, true, false);
        ASSERT_FALSE(stream.cap.keys().empty()) << what << ": no gradients captured";
        const BackboneRun graph = run_backbone(pb, mode, storage, true, false, 2);
        ASSERT_EQ(stream.cap.keys(), graph.cap.keys()) << what;
        expect_same_bits(stream, graph, what);
      }
    }
  }
}

// One GpuBackbone serves production passes (a layer's input a view of the previous layer's
// output, δ of the buffer that produced it, F8's add in the next norm) and isolated runs (every
// tensor its own buffer, the oracle's values): neither may leak into the other. A pass with
// nonzero leaving-state gradients, then an isolated run, then the pass again: the second pass
// gives the first one's bits (Out, every gradient, d_x, the leaving states), and the isolated
// run gives the bits of one on a fresh GpuBackbone (which never saw those gradients).
TEST(GpuBackbone, IsolatedRunBetweenPassesChangesNothing) {
  M3_SKIP_WITHOUT_GPU();
  const std::vector<GridCase> cases = grid_cases({"hd16_ds16_silu_rope0.5_ng1"});
  ASSERT_EQ(cases.size(), 1u) << "a named grid case is missing";
  const GridCase& gc = cases[0];
  ASSERT_GE(gc.cfg.n_layers, 2) << "the views need a second layer";
  const Problem pb = m3::make_problem(gc.cfg, gc.B, gc.T, 23, true);
  const m3::States<float> entering = m3::cast_states<float>(pb.states);
  const m3::States<float> d_leaving = entering;  // any nonzero values of the right shapes
  for (m3::Precision storage : {m3::Precision::F32, m3::Precision::BF16}) {
    for (ScanMode mode : {ScanMode::Chunked, ScanMode::Sequential}) {
      const std::string what = std::string(m3::precision_name(storage)) + " " +
                               m3::scan_mode_name(mode);
      const Capture oracle = m3::run_reference<double>(pb, mode);
      m3::gpu::GpuBackbone net(ctx(), pb.cfg, pb.B, pb.T, mode, storage);
      m3::gpu::load_problem(net, pb);
      auto pass = [&](std::vector<float>& out) {
        BackboneRun run{Capture(pb.cfg, pb.B, pb.T), {}, {}};
        net.set_states(entering);
        net.set_leaving_grads(&d_leaving);
        net.zero_grads();
        net.forward(nullptr);
        net.backward(nullptr);
        collect(net, pb, run);
        out = net.output();
        return run;
      };
      std::vector<float> out1, out2;
      const BackboneRun first = pass(out1);
      net.set_states(entering);
      net.set_leaving_grads(nullptr);
      const Capture between = net.run_isolated(oracle);
      const BackboneRun second = pass(out2);
      expect_same_bits(first, second, what + ": pass after an isolated run");
      EXPECT_EQ(out1, out2) << what << ": Out after an isolated run";
      const Capture fresh = m3::gpu::run_gpu_isolated(ctx(), pb, mode, oracle, storage);
      ASSERT_EQ(fresh.keys(), between.keys()) << what;
      EXPECT_EQ(first_bit_difference(fresh, between), "")
          << what << ": this isolated tensor differs after production passes";
    }
  }
}

// A recording that synchronizes the stream fails: StreamGraph throws m3::Error naming the
// CUDA call, ends the capture (the stream can synchronize again) and leaves nothing behind:
// a recording after it replays the stream-launched pass bit for bit.
TEST(GpuGraph, AFailedRecordingThrowsAndLeavesTheStreamUsable) {
  M3_SKIP_WITHOUT_GPU();
  try {
    const m3::gpu::StreamGraph graph(ctx(), [] { ctx().synchronize(); });
    FAIL() << "recording a stream synchronize must fail";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaStreamSynchronize"), std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(ctx().synchronize()) << "the stream is still capturing";
  const std::vector<GridCase> cases = grid_cases({"hd16_ds16_silu_rope0.5_ng1"});
  ASSERT_EQ(cases.size(), 1u) << "a named grid case is missing";
  const Problem pb = m3::make_problem(cases[0].cfg, cases[0].B, cases[0].T, 29, true);
  const BackboneRun stream =
      run_backbone(pb, ScanMode::Chunked, m3::Precision::BF16, true, false);
  const BackboneRun graph =
      run_backbone(pb, ScanMode::Chunked, m3::Precision::BF16, true, false, 1);
  expect_same_bits(stream, graph, "a recording after a failed one");
}

TEST(GpuBackbone, RejectsAnInvalidConfigWithAMessage) {
  M3_SKIP_WITHOUT_GPU();
  Config c;
  c.headdim = 48;  // d_inner 256 is not a multiple of 48
  try {
    m3::gpu::GpuBackbone net(ctx(), c, 1, 8, ScanMode::Chunked);
    FAIL() << "expected an error";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("headdim"), std::string::npos) << e.what();
  }
}

}  // namespace

namespace {

// Small enough to run under compute-sanitizer memcheck / racecheck (scripts/gpu-check.sh).
TEST(GpuSanitizer, SmallConfigBothModesForwardBackward) {
  M3_SKIP_WITHOUT_GPU();
  Config c = grid_config(16, 16, 0.5, true, 2);
  c.chunk_size = 8;
  const Problem pb = m3::make_problem(c, 2, 21, 4, true);
  for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
    const Capture oracle = m3::run_reference<double>(pb, mode);
    const Capture baseline = m3::run_reference<float>(pb, mode);
    const Capture subject = m3::gpu::run_gpu(ctx(), pb, mode);
    const auto r =
        m3::harness::compare_captures(oracle, subject, &baseline, pb.cfg, pb.B, pb.T, mode);
    EXPECT_TRUE(r.pass()) << describe_failure(r);
  }
}

}  // namespace
