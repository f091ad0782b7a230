// m3h dump --device gpu --oracle gpu (harness/dump.hpp, docs/HARNESS.md §5 and §11), run as a
// program on a small problem of two layers:
//   - the file holds exactly the asked keys that the GPU oracle provides, per scan mode and
//     precision, and says which matching key it left out (one scan algorithm's inside);
//   - its oracle arrays agree with the Eigen oracle's (m3h dump --oracle cpu of the same
//     problem) within 1e-10 of the tensor's scale; its subject arrays are --oracle cpu's, bit
//     for bit (the same GPU subject: its buffers after the run hold what a capture takes);
//     diff is subject − oracle (angles: the circular distance); the baseline is the exact draw,
//     near the oracle and, in bf16, not equal to it;
//   - every key's status, rel_l2 and pct are m3h compare --device gpu --oracle gpu's on the
//     same problem, and its rel_l2 is that of its own arrays;
//   - --profiles-only holds the [B*T, …] keys' profiles only, with compare's verdicts;
//   - a pattern of only keys the GPU oracle does not compute, and --profiles-only without a
//     [B*T, …] key, are one-line refusals that write nothing.
// Every test skips, saying why, without a usable device (harness::device_compare_unavailable).
// M3H_PATH (a compile definition) is the m3h executable built alongside this test.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "device_compare.hpp"
#include "h5store.hpp"
#include "metrics.hpp"
#include "position.hpp"
#include "registry.hpp"
#include "test_io.hpp"

#ifndef M3H_PATH
#error "M3H_PATH must name the m3h executable"
#endif

namespace m3 {
namespace {

#define M3_SKIP_WITHOUT_DEVICE()                                    \
  do {                                                              \
    const std::string why_ = harness::device_compare_unavailable(); \
    if (!why_.empty()) GTEST_SKIP() << why_;                        \
  } while (0)

using test::CliRun;
using test::count_lines;
using test::run_m3h;
using test::TempDir;

// A small problem the GPU path and both oracles run in seconds.
const char* kProblem =
    " --d-model 32 --headdim 16 --d-state 16 --layers 2 --B 2 --T 40 --chunk-size 16";
constexpr Idx kT = 40;

// The asked keys the GPU oracle provides, and one it does not (a sequential scan's inside).
const std::set<std::string> kProvided = {"L0/F5/angle_cumsum", "L1/F6/y", "grad/L0/dt_bias"};
const char* kInside = "L0/F6/h_saved";

// The key groups under `g` (groups with a status attribute), named relative to it.
void key_groups(const h5::Reader& rd, const std::string& g, const std::string& rel,
                std::set<std::string>& out) {
  if (rd.has_attr(g, "status")) {
    out.insert(rel);
    return;
  }
  for (const std::string& c : rd.children(g))
    if (rd.is_group(g + "/" + c)) key_groups(rd, g + "/" + c, rel.empty() ? c : rel + "/" + c, out);
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape == b.shape && a.data.size() == b.data.size() &&
         std::memcmp(a.data.data(), b.data.data(), a.data.size() * sizeof(double)) == 0;
}

// compare --json's cells by "mode|precision|key".
struct JsonCell {
  std::string status;
  nlohmann::json rel_l2, pct;
};
std::map<std::string, JsonCell> json_cells(const std::string& path) {
  std::map<std::string, JsonCell> out;
  const nlohmann::json doc = nlohmann::json::parse(test::slurp(path));
  for (const nlohmann::json& c : doc.at("cells")) {
    JsonCell jc;
    jc.status = c.at("status").get<std::string>();
    jc.pct = c.at("pct");
    if (c.at("metrics").is_object()) jc.rel_l2 = c.at("metrics").at("rel_l2");
    out[c.at("mode").get<std::string>() + "|" + c.at("precision").get<std::string>() + "|" +
        c.at("key").get<std::string>()] = jc;
  }
  return out;
}

// |a − b| ≤ rel·max(|a|, |b|), for figures printed and read back.
void expect_close(double a, double b, double rel, const std::string& what) {
  EXPECT_LE(std::fabs(a - b), rel * std::max(std::fabs(a), std::fabs(b))) << what << ": " << a << " vs " << b;
}

TEST(GpuDump, HoldsTheAskedKeysTheOraclesValuesTheSubjectAndCompareVerdicts) {
  M3_SKIP_WITHOUT_DEVICE();
  TempDir tmp("m3_gpu_dump_");
  const std::string gpu_h5 = tmp.file("gpu.h5"), cpu_h5 = tmp.file("cpu.h5"), json = tmp.file("c.json");
  const std::string pattern = "'L0/F5/angle_cumsum,L1/F6/y,grad/L0/dt_bias," + std::string(kInside) + "'";
  const std::string run = " --device gpu --dtype f32,bf16 --stage " + pattern + kProblem;

  const CliRun g = run_m3h("dump --oracle gpu --out '" + gpu_h5 + "'" + run);
  ASSERT_EQ(g.status, 0) << g.out << g.err;
  EXPECT_EQ(g.out.find("m3h dump: about "), 0u) << "the size comes first: " << g.out;
  EXPECT_NE(g.out.find("not dumped"), std::string::npos) << g.out;
  EXPECT_NE(g.out.find(kInside), std::string::npos) << "the key left out is named: " << g.out;
  const CliRun c = run_m3h("dump --oracle cpu --out '" + cpu_h5 + "'" + run);
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  const CliRun j = run_m3h("compare --oracle gpu --json '" + json + "'" + run);
  ASSERT_LE(j.status, 1) << j.out << j.err;
  const std::map<std::string, JsonCell> verdicts = json_cells(json);

  h5::Reader rd(gpu_h5), eigen(cpu_h5);
  EXPECT_EQ(rd.attr_string("/meta", "kind"), "dump");
  EXPECT_EQ(rd.attr_string("/meta", "oracle"), "gpu-oracle<double>");
  EXPECT_EQ(rd.attr_string("/meta", "precisions"), "f32,bf16");
  EXPECT_EQ(rd.attr_string("/meta", "scan_modes"), "seq,chunked");
  EXPECT_EQ(rd.attr_int("/meta", "profiles_only"), 0);
  EXPECT_NE(eigen.attr_string("/meta", "oracle"), "gpu-oracle<double>");
  // The same /meta names in both files (one schema).
  EXPECT_EQ(rd.attr_names("/meta"), eigen.attr_names("/meta"));
  EXPECT_EQ(rd.children("/dump"), (std::vector<std::string>{"chunked", "seq"}));

  int n_keys = 0;
  for (const char* mode : {"seq", "chunked"}) {
    EXPECT_EQ(rd.children(std::string("/dump/") + mode), (std::vector<std::string>{"bf16", "f32"}));
    for (const char* p : {"f32", "bf16"}) {
      const std::string cell = std::string("/dump/") + mode + "/" + p;
      SCOPED_TRACE(cell);
      std::set<std::string> keys;
      key_groups(rd, cell, "", keys);
      EXPECT_EQ(keys, kProvided) << "exactly the asked keys the GPU oracle provides";
      for (const std::string& key : kProvided) {
        SCOPED_TRACE(key);
        const std::string gk = cell + "/" + key;
        ++n_keys;
        // The same attributes as the Eigen oracle's dump (one schema), and the same datasets.
        EXPECT_EQ(rd.attr_names(gk), eigen.attr_names(gk));
        for (const char* d : {"oracle", "subject", "diff", "baseline"}) ASSERT_TRUE(rd.has(gk + "/" + d)) << d;
        const bool circular = rd.attr_int(gk, "circular") == 1;
        const Tensor o = rd.read(gk + "/oracle"), s = rd.read(gk + "/subject");
        const Tensor d = rd.read(gk + "/diff"), b = rd.read(gk + "/baseline");
        const Tensor eo = eigen.read(gk + "/oracle"), es = eigen.read(gk + "/subject");
        ASSERT_EQ(o.shape, eo.shape);
        ASSERT_EQ(s.shape, o.shape);
        ASSERT_EQ(d.shape, o.shape);
        ASSERT_EQ(b.shape, o.shape);

        // The oracle: the GPU oracle's values, within 1e-10 of the tensor's scale of the Eigen
        // oracle's.
        double scale = 1e-3, worst = 0;
        for (double v : eo.data) scale = std::max(scale, std::fabs(v));
        for (size_t i = 0; i < o.data.size(); ++i) {
          const double e = circular ? harness::circular_diff(o.data[i], eo.data[i]) : o.data[i] - eo.data[i];
          worst = std::max(worst, std::fabs(e));
        }
        EXPECT_LE(worst, 1e-10 * scale) << "GPU oracle against the Eigen oracle";
        // The subject: the same GPU subject as --oracle cpu's dump, bit for bit.
        EXPECT_TRUE(same_bits(s, es)) << "the subject differs from --oracle cpu's dump";
        // diff = subject − oracle (angles: the circular distance), as stored.
        for (size_t i = 0; i < o.data.size(); ++i) {
          const double want = circular ? harness::circular_diff(s.data[i], o.data[i]) : s.data[i] - o.data[i];
          ASSERT_EQ(d.data[i], want) << i;
        }
        // The baseline: the exact draw, the problem and every stored value rounded to p — near
        // the oracle, and in bf16 not the oracle itself.
        double b2 = 0, o2 = 0;
        for (size_t i = 0; i < o.data.size(); ++i) {
          ASSERT_TRUE(std::isfinite(b.data[i])) << i;
          const double e = circular ? harness::circular_diff(b.data[i], o.data[i]) : b.data[i] - o.data[i];
          b2 += e * e;
          o2 += o.data[i] * o.data[i];
        }
        EXPECT_LE(std::sqrt(b2 / o2), std::string(p) == "f32" ? 1e-3 : 0.25) << "the baseline's distance";
        if (std::string(p) == "bf16") {
          EXPECT_FALSE(same_bits(b, o)) << "the exact draw rounds";
        }

        // The verdicts: compare --oracle gpu's on the same problem.
        const auto it = verdicts.find(std::string(mode) + "|" + p + "|" + key);
        ASSERT_NE(it, verdicts.end()) << "compare --oracle gpu judged the key";
        EXPECT_EQ(rd.attr_string(gk, "status"), it->second.status);
        if (it->second.pct.is_number()) {
          expect_close(rd.attr_double(gk, "pct"), it->second.pct.get<double>(), 1e-12, "pct");
        }
        if (it->second.rel_l2.is_number()) {
          expect_close(rd.attr_double(gk, "rel_l2"), it->second.rel_l2.get<double>(), 1e-12, "rel_l2");
        }
        // ... and rel_l2 is that of the stored arrays (computed on the device, summed in another
        // order than the host's).
        const Precision prec = std::string(p) == "f32" ? Precision::F32 : Precision::BF16;
        const harness::Metrics m = harness::compute_metrics(o, s, circular, prec);
        expect_close(rd.attr_double(gk, "rel_l2"), m.rel_l2, 1e-10, "rel_l2 of the arrays");
        EXPECT_EQ(rd.attr_double(gk, "max_abs"), m.max_abs);
        // The [B*T, …] keys carry their error against t: the position-wise max of |diff|.
        if (key == "grad/L0/dt_bias") {
          EXPECT_FALSE(rd.has(gk + "/by_position"));
          continue;
        }
        const Tensor pmax = rd.read(gk + "/by_position/max_abs", std::vector<Idx>{kT});
        const size_t row = o.data.size() / static_cast<size_t>(2 * kT);
        for (Idx t = 0; t < kT; ++t) {
          double most = 0;
          for (Idx bi = 0; bi < 2; ++bi)
            for (size_t i = 0; i < row; ++i)
              most = std::max(most, std::fabs(d.data[static_cast<size_t>(bi * kT + t) * row + i]));
          ASSERT_EQ(pmax.data[static_cast<size_t>(t)], most) << "t " << t;
        }
      }
    }
  }
  EXPECT_EQ(n_keys, 12);
  // The Eigen oracle's dump holds the sequential scan's inside too; the GPU oracle's does not.
  EXPECT_TRUE(eigen.has(std::string("/dump/seq/f32/") + kInside));
  EXPECT_FALSE(rd.has(std::string("/dump/seq/f32/") + kInside));
}

TEST(GpuDump, ProfilesOnlyHoldsTheProfilesAndCompareVerdicts) {
  M3_SKIP_WITHOUT_DEVICE();
  TempDir tmp("m3_gpu_dump_");
  const std::string h5 = tmp.file("p.h5"), json = tmp.file("p.json");
  const std::string run = " --device gpu --dtype bf16 --scan chunked --stage 'L0/*'" + std::string(kProblem);
  const CliRun r = run_m3h("dump --oracle gpu --profiles-only --out '" + h5 + "'" + run);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const CliRun c = run_m3h("compare --oracle gpu --json '" + json + "'" + run);
  ASSERT_LE(c.status, 1) << c.out << c.err;
  const std::map<std::string, JsonCell> verdicts = json_cells(json);

  h5::Reader rd(h5);
  EXPECT_EQ(rd.attr_int("/meta", "profiles_only"), 1);
  EXPECT_EQ(rd.attr_string("/meta", "oracle"), "gpu-oracle<double>");
  Config cfg;
  cfg.d_model = 32;
  cfg.headdim = 16;
  cfg.d_state = 16;
  cfg.n_layers = 2;
  cfg.chunk_size = 16;
  const auto provided = harness::device_compared_shapes(cfg, 2, kT);
  int n = 0;
  for (const KeyedSpec& ks : expected_stage_keys(cfg, 2, kT, ScanMode::Chunked)) {
    if (!harness::key_matches(ks.key, "L0/*")) continue;
    const std::string g = "/dump/chunked/bf16/" + ks.key;
    if (!harness::has_position_axis(ks.spec->shape) || !provided.count(ks.key)) {
      EXPECT_FALSE(rd.has(g)) << g;
      continue;
    }
    ++n;
    ASSERT_TRUE(rd.has(g + "/by_position/rel_l2")) << g;
    EXPECT_EQ(rd.shape(g + "/by_position/max_abs"), std::vector<Idx>{kT}) << g;
    for (const char* d : {"oracle", "subject", "diff", "baseline"}) EXPECT_FALSE(rd.has(g + "/" + d)) << g;
    const auto it = verdicts.find("chunked|bf16|" + ks.key);
    ASSERT_NE(it, verdicts.end()) << g;
    EXPECT_EQ(rd.attr_string(g, "status"), it->second.status) << g;
  }
  EXPECT_GT(n, 10);
}

TEST(GpuDump, OnlyKeysTheGpuOracleLacksOrNoProfileAreOneLineRefusals) {
  M3_SKIP_WITHOUT_DEVICE();
  TempDir tmp("m3_gpu_dump_");
  const std::string out = tmp.file("x.h5");
  const CliRun inside = run_m3h("dump --device gpu --oracle gpu --scan seq --stage " +
                                std::string(kInside) + " --out '" + out + "'" + kProblem);
  EXPECT_EQ(inside.status, 2) << inside.out << inside.err;
  EXPECT_EQ(count_lines(inside.err), 1) << inside.err;
  EXPECT_NE(inside.err.find("does not compute"), std::string::npos) << inside.err;
  EXPECT_NE(inside.err.find("nearest"), std::string::npos) << "names keys it provides: " << inside.err;
  EXPECT_EQ(inside.out, "");
  const CliRun params = run_m3h("dump --device gpu --oracle gpu --profiles-only --stage 'grad/*' --out '" +
                                out + "'" + kProblem);
  EXPECT_EQ(params.status, 2) << params.out << params.err;
  EXPECT_EQ(count_lines(params.err), 1) << params.err;
  EXPECT_NE(params.err.find("--profiles-only"), std::string::npos) << params.err;
  EXPECT_FALSE(std::filesystem::exists(out));
}

}  // namespace
}  // namespace m3
