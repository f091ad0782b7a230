// The per-stage work model of m3h bench --profile (harness/roofline.hpp), checked by hand:
//   * stage names and order are the profile's (gpu/backbone/backbone_gpu.cu marks);
//   * the F2 GEMM FLOPs are 2·B·T·dm·ip per layer, B2 twice that; the chunked and sequential
//     scan FLOPs follow the documented per-chunk / per-step counts, with a short last chunk;
//   * the bytes of F1 and F2 (reads + writes, f32 and bf16 storage) and the sequential F6's
//     h_saved, written out element by element;
//   * every registry tensor (less the three copies) is written by exactly one stage and every
//     parameter gradient is accumulated exactly once, for several configs and both scan modes;
//   * the roofline rows: achieved rates, fractions of the ceilings, floors and the bound.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "error.hpp"
#include "registry.hpp"
#include "roofline.hpp"
#include "test_util.hpp"

namespace m3::harness {
namespace {

// d_model 128, headdim 16, d_state 16, expand 2 → di 256, nh 16, na 4, ip 2·256 + 2·16 + 3·16
// + 4 = 596; 2 layers, chunk 32; B = 2, T = 100 (chunks of 32, 32, 32, 4).
Config hand_cfg() {
  Config c;
  c.d_model = 128;
  c.d_state = 16;
  c.headdim = 16;
  c.expand = 2;
  c.ngroups = 1;
  c.n_layers = 2;
  c.rope_fraction = 0.5;
  c.input_dim = 128;
  c.chunk_size = 32;
  return c;
}
constexpr Idx kB = 2, kT = 100;

const StageWork& stage(const std::vector<StageWork>& w, const std::string& name) {
  for (const auto& s : w)
    if (s.stage == name) return s;
  throw Error("test", "no stage " + name, "");
}

TEST(Roofline, StagesAreTheProfileStagesInExecutionOrder) {
  const std::vector<std::string> expected = {
      "input_proj", "F1",  "F2",  "F3",  "F4",  "F5",  "F4ef", "F5b", "F6",
      "F7",         "F8",  "states", "norm_f", "norm_f (bwd)", "B8", "B7", "B6", "B5a",
      "B5b",        "B4b", "B4c", "B3", "B2", "B1", "d_states", "input_proj (bwd)"};
  for (auto mode : {ScanMode::Sequential, ScanMode::Chunked}) {
    std::vector<std::string> got;
    for (const auto& s : stage_work(hand_cfg(), kB, kT, mode, Precision::F32))
      got.push_back(s.stage);
    EXPECT_EQ(got, expected) << scan_mode_name(mode);
  }
}

TEST(Roofline, GemmFlopsAreTwoMNKPerLayer) {
  const auto w = stage_work(hand_cfg(), kB, kT, ScanMode::Chunked, Precision::BF16);
  const double BT = 200, dm = 128, ip = 596, di = 256, in = 128, L = 2;
  EXPECT_DOUBLE_EQ(stage(w, "F2").flops, L * 2 * BT * dm * ip);  // 2·200·128·596 per layer
  EXPECT_DOUBLE_EQ(stage(w, "F2").flops, 61030400.0);
  EXPECT_EQ(stage(w, "F2").unit, FlopUnit::Matrix);
  EXPECT_DOUBLE_EQ(stage(w, "B2").flops, 2 * stage(w, "F2").flops);
  EXPECT_DOUBLE_EQ(stage(w, "F8").flops, L * 2 * BT * di * dm);
  EXPECT_DOUBLE_EQ(stage(w, "B8").flops, L * 4 * BT * di * dm);
  EXPECT_DOUBLE_EQ(stage(w, "input_proj").flops, 2 * BT * in * dm);  // backbone: once
  EXPECT_DOUBLE_EQ(stage(w, "input_proj (bwd)").flops, 4 * BT * in * dm);
  for (const char* elementwise : {"F1", "F3", "F4", "F5", "F4ef", "F5b", "F7", "norm_f", "B7",
                                  "B5a", "B5b", "B4b", "B3", "B1"}) {
    EXPECT_EQ(stage(w, elementwise).flops, 0.0) << elementwise;
    EXPECT_EQ(stage(w, elementwise).unit, FlopUnit::None) << elementwise;
  }
  Config ident = hand_cfg();
  ident.input_proj_identity = true;
  const auto wi = stage_work(ident, kB, kT, ScanMode::Chunked, Precision::BF16);
  EXPECT_EQ(stage(wi, "input_proj").flops, 0.0);
  EXPECT_EQ(stage(wi, "input_proj").unit, FlopUnit::None);
}

TEST(Roofline, ScanFlopsFollowTheDocumentedCounts) {
  const double B = 2, nh = 16, hd = 16, ds = 16, L = 2;
  // Chunks of 32, 32, 32, 4: Σ L_c = 100, Σ L_c² = 3·1024 + 16 = 3088.
  const double sum_l = 100, sum_l2 = 3088;
  const auto wc = stage_work(hand_cfg(), kB, kT, ScanMode::Chunked, Precision::F32);
  const double fwd_chunked =  // Q·Ksᵀ, masked·X, Q·S, Xᵀ·Ks
      2 * (sum_l2 * ds + sum_l2 * hd + sum_l * hd * ds + sum_l * hd * ds);
  const double bwd_chunked =  // A, P, dV, Ks·dSᵀ, dK_mid, X·dS, dQ_mid, dO·S, dcontrib
      2 * (sum_l2 * ds + sum_l2 * hd + sum_l2 * hd + sum_l * hd * ds + sum_l2 * ds +
           sum_l * ds * hd + sum_l2 * ds + sum_l * ds * hd + sum_l * hd * ds);
  EXPECT_DOUBLE_EQ(stage(wc, "F6").flops, L * B * nh * fwd_chunked);
  EXPECT_DOUBLE_EQ(stage(wc, "B6").flops, L * B * nh * bwd_chunked);
  EXPECT_EQ(stage(wc, "F6").unit, FlopUnit::Fma32);
  EXPECT_EQ(stage(wc, "B6").unit, FlopUnit::Fma32);
  // Typed runs: the chunked scan's products run on the tensor cores; the sequential scan's
  // do not.
  const auto wt = stage_work(hand_cfg(), kB, kT, ScanMode::Chunked, Precision::BF16);
  EXPECT_EQ(stage(wt, "F6").unit, FlopUnit::Matrix);
  EXPECT_EQ(stage(wt, "B6").unit, FlopUnit::Matrix);
  EXPECT_DOUBLE_EQ(stage(wt, "F6").flops, stage(wc, "F6").flops);
  EXPECT_DOUBLE_EQ(stage(wt, "B6").flops, stage(wc, "B6").flops);
  const auto wts = stage_work(hand_cfg(), kB, kT, ScanMode::Sequential, Precision::F16);
  EXPECT_EQ(stage(wts, "F6").unit, FlopUnit::Fma32);
  EXPECT_EQ(stage(wts, "B6").unit, FlopUnit::Fma32);
  const auto ws = stage_work(hand_cfg(), kB, kT, ScanMode::Sequential, Precision::F32);
  EXPECT_DOUBLE_EQ(stage(ws, "F6").flops, L * B * nh * 100 * 7 * hd * ds);
  EXPECT_DOUBLE_EQ(stage(ws, "B6").flops, L * B * nh * 100 * 15 * hd * ds);
}

TEST(Roofline, F1AndF2BytesByHand) {
  const double BT = 200, dm = 128, ip = 596, L = 2;
  for (auto [p, typed] : {std::pair{Precision::F32, 4.0}, std::pair{Precision::BF16, 2.0},
                          std::pair{Precision::F16, 2.0}}) {
    const auto w = stage_work(hand_cfg(), kB, kT, ScanMode::Chunked, p);
    // F1: reads residual (f32) and norm_weight (f32); writes post_norm (typed), rms_vals (f32).
    EXPECT_DOUBLE_EQ(stage(w, "F1").read_bytes, L * (BT * dm * 4 + dm * 4)) << precision_name(p);
    EXPECT_DOUBLE_EQ(stage(w, "F1").write_bytes, L * (BT * dm * typed + BT * 4))
        << precision_name(p);
    // F2: reads post_norm and the in_proj_w compute copy (both typed); writes proj (typed).
    EXPECT_DOUBLE_EQ(stage(w, "F2").read_bytes, L * (BT * dm + dm * ip) * typed)
        << precision_name(p);
    EXPECT_DOUBLE_EQ(stage(w, "F2").write_bytes, L * BT * ip * typed) << precision_name(p);
    EXPECT_DOUBLE_EQ(stage(w, "F2").bytes(), L * (BT * dm + dm * ip + BT * ip) * typed);
  }
  // bf16, 2 layers: F2 moves 2·(200·128 + 128·596 + 200·596)·2 bytes.
  const auto w = stage_work(hand_cfg(), kB, kT, ScanMode::Chunked, Precision::BF16);
  EXPECT_DOUBLE_EQ(stage(w, "F2").bytes(), 884352.0);
}

TEST(Roofline, SequentialF6WritesHSaved) {
  const auto w = stage_work(hand_cfg(), kB, kT, ScanMode::Sequential, Precision::BF16);
  // y (typed) + h_saved [B, T+1, ds, di] + k_prev_saved [BT, nh, ds] + v_prev_saved [BT, nh, hd]
  // + the leaving states ssm [B, nh, hd, ds], k [B, nh, ds], v [B, nh, hd]; 2 layers.
  const double BT = 200, di = 256, nh = 16, hd = 16, ds = 16, B = 2, L = 2;
  const double expected = L * (BT * di * 2 + B * 101 * ds * di * 4 + BT * nh * ds * 4 +
                               BT * nh * hd * 4 + B * nh * hd * ds * 4 + B * nh * ds * 4 +
                               B * nh * hd * 4);
  EXPECT_DOUBLE_EQ(stage(w, "F6").write_bytes, expected);
}

// Every registry tensor the run produces, except the three copies (input X, the layer input
// residual, norm_f_input), is written by exactly one stage; every parameter gradient is
// accumulated (4 bytes read + 4 written) exactly once (norm_gate_weight only with
// is_outproj_norm); "states", "d_states" and "B4c" are empty.
TEST(Roofline, EveryRegistryTensorAndGradientIsWrittenOnce) {
  using test::small_cfg;
  //                           d_model hd ds ng  rf   outnorm L cs identity in
  const std::vector<Config> cfgs = {
      hand_cfg(),
      small_cfg(4, 2, 4, 1, 0.5, true, 2, 3, false, 3),
      small_cfg(4, 2, 3, 1, 0.5, false, 1, 4, false, 3),  // na = 0
      small_cfg(4, 2, 4, 1, 1.0, false, 1, 4, true),      // identity input_proj
      small_cfg(8, 2, 6, 2, 1.0, true, 2, 3, false, 5),
  };
  for (const Config& cfg : cfgs) {
    for (auto mode : {ScanMode::Sequential, ScanMode::Chunked}) {
      for (auto p : {Precision::F32, Precision::BF16}) {
        const Idx B = 2, T = 7;
        double registry = 0;
        for (const auto& k : expected_stage_keys(cfg, B, T, mode)) {
          const std::string name = std::string(k.spec->stage) + "/" + k.spec->tensor;
          if (name == "input_proj/input_proj_inputs" || name == "F1/residual" ||
              name == "norm_f/norm_f_input")
            continue;
          double n = 1;
          for (Idx v : k.shape) n *= static_cast<double>(v);
          registry += n * (k.spec->typed && p != Precision::F32 ? 2 : 4);
        }
        double grads = 0;
        for (const auto& k : expected_param_keys(cfg)) {
          // norm_gate_weight has a gradient only with is_outproj_norm (F7 variant b).
          if (!cfg.is_outproj_norm && std::string(k.spec->name) == "norm_gate_weight") continue;
          double n = 1;
          for (Idx v : k.shape) n *= static_cast<double>(v);
          grads += 4 * n;
        }
        double written = 0;
        const auto w = stage_work(cfg, B, T, mode, p);
        for (const auto& s : w) written += s.write_bytes;
        EXPECT_DOUBLE_EQ(written, registry + grads)
            << cfg.describe() << " " << scan_mode_name(mode) << " " << precision_name(p);
        for (const char* empty : {"states", "d_states", "B4c"})
          EXPECT_EQ(stage(w, empty).bytes(), 0.0) << empty;
      }
    }
  }
}

TEST(Roofline, RejectsF64StorageAndBadShapes) {
  EXPECT_THROW(stage_work(hand_cfg(), kB, kT, ScanMode::Chunked, Precision::F64), Error);
  EXPECT_THROW(stage_work(hand_cfg(), 0, kT, ScanMode::Chunked, Precision::F32), Error);
}

TEST(Roofline, RowsHoldTimesAgainstTheCeilings) {
  std::vector<StageWork> work(3);
  work[0] = {"G", 1e9, 1e9, 4e12, FlopUnit::Matrix};  // 2 GB, 4 TFLOP
  work[1] = {"E", 3e9, 1e9, 0, FlopUnit::None};       // 4 GB
  work[2] = {"S", 1e8, 0, 1e12, FlopUnit::Fma32};     // 0.1 GB, 1 TFLOP
  Roof roof;
  roof.bytes_per_s = 4e12;         // 4 TB/s
  roof.matrix_flops_per_s = 8e14;  // 800 TFLOP/s
  roof.fma32_flops_per_s = 5e13;   // 50 TFLOP/s
  const std::vector<std::pair<std::string, double>> times = {
      {"G", 10.0}, {"E", 2.0}, {"unmodeled", 3.0}, {"S", 25.0}};
  const auto rows = roofline_rows(times, work, roof);
  ASSERT_EQ(rows.size(), 4u);
  const RooflineRow& g = rows[0];
  EXPECT_EQ(g.stage, "G");
  EXPECT_DOUBLE_EQ(g.share, 10.0 / 40.0);
  EXPECT_DOUBLE_EQ(g.bytes_per_s, 2e9 / 10e-3);  // 200 GB/s
  EXPECT_DOUBLE_EQ(g.bw_fraction, 0.05);
  EXPECT_DOUBLE_EQ(g.flops_per_s, 4e14);
  EXPECT_DOUBLE_EQ(g.flop_fraction, 0.5);
  EXPECT_DOUBLE_EQ(g.bytes_floor_ms, 0.5);
  EXPECT_DOUBLE_EQ(g.flops_floor_ms, 5.0);
  EXPECT_DOUBLE_EQ(g.floor_ms, 5.0);
  EXPECT_STREQ(g.bound(), "compute");
  const RooflineRow& e = rows[1];
  EXPECT_DOUBLE_EQ(e.bw_fraction, 0.5);  // 4 GB in 2 ms = 2 TB/s
  EXPECT_EQ(e.flop_fraction, 0.0);
  EXPECT_DOUBLE_EQ(e.floor_ms, 1.0);
  EXPECT_STREQ(e.bound(), "memory");
  const RooflineRow& u = rows[2];
  EXPECT_FALSE(u.modeled);
  EXPECT_STREQ(u.bound(), "-");
  EXPECT_EQ(u.floor_ms, 0.0);
  const RooflineRow& s = rows[3];
  EXPECT_DOUBLE_EQ(s.flops_floor_ms, 20.0);  // 1 TFLOP at 50 TFLOP/s (the fma32 ceiling)
  EXPECT_DOUBLE_EQ(s.flop_fraction, 0.8);
  EXPECT_STREQ(s.bound(), "compute");

  const RooflineRow tot = roofline_total(rows);
  EXPECT_DOUBLE_EQ(tot.ms, 40.0);
  EXPECT_DOUBLE_EQ(tot.bytes, 6.1e9);
  EXPECT_DOUBLE_EQ(tot.flops, 5e12);
  EXPECT_DOUBLE_EQ(tot.floor_ms, 5.0 + 1.0 + 0.0 + 20.0);
  EXPECT_DOUBLE_EQ(tot.bw_fraction, (0.5 + 1.0 + 0.025) / 40.0);
  EXPECT_DOUBLE_EQ(tot.flop_fraction, 25.0 / 40.0);
  EXPECT_DOUBLE_EQ(tot.share, 1.0);
}

}  // namespace
}  // namespace m3::harness
