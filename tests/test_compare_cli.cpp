// The m3h command line, run as a program (HARNESS.md §5): `m3h compare` over f32/bf16/f16 exits
// 0 on a small preset; --json writes valid JSON (checked by a small recursive-descent parser
// below, not by the writer's own code) holding every cell (key × precision × scan mode) with
// every metric; --config files are read, and their errors (unknown key, bad value) exit 2 with
// one line naming the key; --stage filters; `m3h dump` writes an HDF5 file readable by
// h5::Reader with the documented datasets and refuses to overwrite without --force; --golden
// takes the oracle from the file, not from a recomputation. The JSON writer's escaping and
// number formatting are checked directly too.
//
// M3H_PATH (a compile definition) is the m3h executable built alongside this test.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "compare.hpp"
#include "determinism.hpp"
#include "digest_record.hpp"
#include "test_io.hpp"
#include "device.hpp"
#include "golden.hpp"
#include "gpu_lineup.hpp"
#include "h5store.hpp"
#include "json.hpp"
#include "metrics.hpp"
#include "precision.hpp"
#include "presets.hpp"
#include "problem.hpp"
#include "registry.hpp"

#ifndef M3H_PATH
#error "M3H_PATH must name the m3h executable"
#endif
#ifndef M3_EXAMPLES_DIR
#error "M3_EXAMPLES_DIR must name docs/examples"
#endif

namespace m3 {
namespace {

namespace fs = std::filesystem;

// ---- the JSON reports, read with nlohmann::ordered_json (key order kept) -------------------

// A parsed value in the few terms the tests need (numbers as double).
struct JValue {
  enum Kind { Null, Bool, Number, String, Array, Object } kind = Null;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<JValue> arr;
  std::vector<std::pair<std::string, JValue>> obj;

  const JValue* find(const std::string& k) const {
    for (const auto& kv : obj)
      if (kv.first == k) return &kv.second;
    return nullptr;
  }
  const JValue& at(const std::string& k) const {
    const JValue* v = find(k);
    if (!v) throw std::runtime_error("missing key '" + k + "'");
    return *v;
  }
};

JValue to_jvalue(const nlohmann::ordered_json& j) {
  JValue v;
  if (j.is_boolean()) {
    v.kind = JValue::Bool;
    v.b = j.get<bool>();
  } else if (j.is_number()) {
    v.kind = JValue::Number;
    v.num = j.get<double>();
  } else if (j.is_string()) {
    v.kind = JValue::String;
    v.str = j.get<std::string>();
  } else if (j.is_array()) {
    v.kind = JValue::Array;
    for (const auto& e : j) v.arr.push_back(to_jvalue(e));
  } else if (j.is_object()) {
    v.kind = JValue::Object;
    for (auto it = j.begin(); it != j.end(); ++it) v.obj.emplace_back(it.key(), to_jvalue(it.value()));
  }
  return v;
}

// Throws (nlohmann::json::parse_error) on text that is not JSON.
JValue parse_json(const std::string& text) { return to_jvalue(nlohmann::ordered_json::parse(text)); }

// ---- running m3h ---------------------------------------------------------------------------

std::string read_file(const fs::path& p) { return m3::test::slurp(p); }

using RunResult = m3::test::CliRun;

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("m3h_cli_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  fs::path path(const std::string& name) const { return dir_ / name; }

  // Runs `m3h <args>` (args already shell-quoted where needed).
  RunResult m3h(const std::string& args) const { return m3::test::run_m3h(args, dir_); }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path(name)) << text;
  }
  fs::path dir_;
};

using m3::test::count_lines;

// A small, fast problem: default widths, 1 layer, B 1, T 48.
const char* kSmall = "--layers 1 --B 1 --T 48";

// ---- compare -----------------------------------------------------------------------------

TEST_F(CliTest, CompareAllThreePrecisionsOnASmallPresetExitsZero) {
  const RunResult r = m3h(std::string("compare --device cpu --dtype f32,bf16,f16 ") + kSmall);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("summary: PASS"), std::string::npos) << r.out;
  for (const char* col : {"f32 seq", "f32 chunked", "bf16 seq", "bf16 chunked", "f16 seq",
                          "f16 chunked"})
    EXPECT_NE(r.out.find(col), std::string::npos) << col;
  EXPECT_TRUE(r.err.empty()) << r.err;
}

// Every line of a report fits the terminal: COLUMNS when set, else 100 columns (a log). The
// table comes in blocks of whole (precision, scan mode) groups, each repeating the key column;
// --wide gives the one unbroken table (a key per line, however wide).
TEST_F(CliTest, TheReportFitsTheTerminalInBlocksAndWideKeepsOneLinePerKey) {
  auto longest = [](const std::string& text) {
    std::size_t most = 0;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) most = std::max(most, line.size());
    return most;
  };
  auto rows_of = [](const std::string& text, const std::string& key) {
    int n = 0;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) n += line.rfind(key + " ", 0) == 0;
    return n;
  };
  const std::string run =
      std::string("compare --device cpu --dtype f32,bf16 --mode both --stage 'L0/F3/*' ") + kSmall;
  RunResult r = m3h(run);  // no terminal, no COLUMNS: 100
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_LE(longest(r.out), 100u) << r.out;
  EXPECT_EQ(rows_of(r.out, "L0/F3/dt"), 4) << "one row per block of one group: " << r.out;
  ::setenv("COLUMNS", "72", 1);
  r = m3h(run);
  const RunResult wide = m3h(run + " --wide");
  ::unsetenv("COLUMNS");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_LE(longest(r.out), 72u) << r.out;
  EXPECT_NE(r.out.find("config: d_model=128"), std::string::npos) << r.out;
  // A broken line keeps its aligned spaces: only the spaces of a break go.
  EXPECT_NE(r.out.find("\ncell f32 seq iso     : "), std::string::npos) << r.out;
  ASSERT_EQ(wide.status, 0) << wide.err;
  EXPECT_EQ(rows_of(wide.out, "L0/F3/dt"), 1) << wide.out;
  EXPECT_GT(longest(wide.out), 300u) << wide.out;
}

// --failures-only with nothing failing says so instead of printing an empty table.
TEST_F(CliTest, FailuresOnlyWithoutAFailureSaysNoFailures) {
  const RunResult r =
      m3h(std::string("compare --device cpu --dtype f32 --scan seq --failures-only ") + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("\nno failures (--failures-only: no row to show)\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("rel_l2  %budget"), std::string::npos) << "an empty table header: " << r.out;
  EXPECT_NE(r.out.find("summary: PASS"), std::string::npos) << r.out;
}

// ---- names round-trip: what a report, --json, /meta or a run prints is read back ----------

// The config as --json writes it (n_layers, is_outproj_norm as a JSON bool, a_floor, the derived
// d_inner …), with B, T, seed and entering_states, is a config file giving the same problem; so
// are the report's "config:" line's key=value pairs. A derived value that disagrees is refused
// naming it.
TEST_F(CliTest, TheNamesReportsAndJsonPrintAreReadBackFromAConfigFile) {
  const std::string run = "compare --device cpu --dtype f32 --scan seq --wide --stage 'L0/F3/*' ";
  RunResult r = m3h(run + "--d-model 32 --headdim 8 --layers 1 --B 1 --T 16 --seed 9 --zero-states "
                          "--outproj-norm --a-floor 0.001 --json '" + path("a.json").string() + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::ordered_json a = nlohmann::ordered_json::parse(read_file(path("a.json")));
  std::string cfg;
  for (const auto& [k, v] : a["config"].items())
    cfg += k + " = " + (v.is_boolean() ? (v.get<bool>() ? "true" : "false") : v.dump()) + "\n";
  cfg += "B = " + a["B"].dump() + "\nT = " + a["T"].dump() + "\nseed = " + a["seed"].dump() +
         "\nentering_states = " + a["entering_states"].get<std::string>() + "\n";
  write("from_json.cfg", cfg);
  r = m3h(run + "--config '" + path("from_json.cfg").string() + "' --json '" +
          path("b.json").string() + "'");
  ASSERT_EQ(r.status, 0) << cfg << r.err;
  const nlohmann::ordered_json b = nlohmann::ordered_json::parse(read_file(path("b.json")));
  EXPECT_EQ(a["config"], b["config"]);
  for (const char* k : {"B", "T", "seed", "entering_states"}) EXPECT_EQ(a[k], b[k]) << k;
  EXPECT_TRUE(r.err.empty()) << r.err;

  // The report's config line: "config: d_model=32 … (d_inner=64 …)".
  const std::string line = r.out.substr(r.out.find("config: ") + 8,
                                        r.out.find('\n', r.out.find("config: ")) - r.out.find("config: ") - 8);
  std::string from_line;
  std::istringstream words(line);
  for (std::string w; words >> w;) {
    w.erase(std::remove(w.begin(), w.end(), '('), w.end());
    w.erase(std::remove(w.begin(), w.end(), ')'), w.end());
    from_line += w.substr(0, w.find('=')) + " = " + w.substr(w.find('=') + 1) + "\n";
  }
  write("from_line.cfg", from_line + "B = 1\nT = 16\nseed = 9\nentering_states = zero\n");
  r = m3h(run + "--config '" + path("from_line.cfg").string() + "' --json '" +
          path("c.json").string() + "'");
  ASSERT_EQ(r.status, 0) << from_line << r.err;
  EXPECT_EQ(a["config"], nlohmann::ordered_json::parse(read_file(path("c.json")))["config"]);

  write("derived.cfg", "d_model = 32\nd_inner = 100\n");
  r = m3h("compare --device cpu --config '" + path("derived.cfg").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("d_inner = 100 disagrees with the config, which gives 64"), std::string::npos)
      << r.err;
}

// A run's own config.txt (m3h train's keys) is a problem for compare: the model's widths, B, T
// and the seed are read; the training keys are named in one note on stderr and skipped.
TEST_F(CliTest, ARunsConfigTxtIsReadByCompareWithItsTrainingKeysNamedAndSkipped) {
  RunResult r = m3h("train --device cpu --task parity --d-model 8 --d-state 4 --headdim 4 "
                    "--layers 1 --B 2 --T 16 --steps 2 --warmup 1 --val-batches 1 --out '" +
                    path("run").string() + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  r = m3h("compare --device cpu --dtype f32 --scan seq --wide --config '" +
          (path("run") / "config.txt").string() + "'");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("m3h train's keys ignored here: task, eval-len, steps"), std::string::npos)
      << r.err;
  EXPECT_NE(r.out.find("config: d_model=8 d_state=4 expand=2 headdim=4 ngroups=1 n_layers=1"),
            std::string::npos) << r.out;
  EXPECT_NE(r.out.find(" B=2 T=16 seed=0 "), std::string::npos) << r.out;
  // Keys neither a problem nor a training option are still refused.
  write("typo.cfg", "d_modle = 8\n");
  r = m3h("compare --device cpu --config '" + path("typo.cfg").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("unknown key 'd_modle'"), std::string::npos) << r.err;
}

// The example configs of docs/examples run as documented; train's reads the checkpoint /meta's
// names (n_layers, precision).
TEST_F(CliTest, TheShippedExampleConfigsRun) {
  const std::string dir = M3_EXAMPLES_DIR;
  RunResult r = m3h("compare --device cpu --dtype f32 --scan seq --config '" + dir + "/small-problem.cfg'");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("n_layers=2"), std::string::npos) << r.out;
  r = m3h("train --device cpu --config '" + dir + "/train-parity.cfg' --steps 3 --warmup 1 --out '" +
          path("parity").string() + "'");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const m3::h5::Reader ck((path("parity") / "ckpt-00000003.h5").string());
  EXPECT_EQ(ck.attr_string("/meta", "precision"), "f32");
  EXPECT_EQ(ck.attr_string("/meta", "n_layers"), "2");
}

// ---- dump: its size first, the keys listed, near keys for a pattern that matches nothing ----

// '*' on the default problem is over a gigabyte: refused before any work, saying the size,
// unless --force; a small dump says its size before writing it.
TEST_F(CliTest, DumpSaysItsSizeAndALargeOneNeedsForce) {
  const std::string out = path("all.h5").string();
  RunResult r = m3h("dump --device cpu --stage '*' --out '" + out + "'");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("dump: about "), std::string::npos) << r.err;
  EXPECT_NE(r.err.find(" MiB to write"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(out));
  r = m3h(std::string("dump --device cpu --stage 'L0/F3/*' --scan seq --out '") + out + "' " + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.find("m3h dump: about "), 0u) << "the size comes first: " << r.out;
  EXPECT_LT(r.out.find("KiB"), r.out.find("wrote")) << r.out;
}

TEST_F(CliTest, DumpListKeysListsEveryKeyWithItsShapeAndWritesNothing) {
  RunResult r = m3h(std::string("dump --list-keys --scan chunked ") + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  Config cfg = harness::find_preset("default").cfg;
  cfg.n_layers = 1;
  const auto want = harness::expected_keys(cfg, 1, 48, ScanMode::Chunked);
  EXPECT_EQ(count_lines(r.out), static_cast<int>(want.size()) + 1) << r.out;
  EXPECT_NE(r.out.find(std::to_string(want.size()) + " key(s)\n"), std::string::npos) << r.out;
  for (const std::string& k : {std::string("L0/F6/y "), std::string("grad/L0/in_proj_w ")})
    EXPECT_NE(r.out.find("\n" + k), std::string::npos) << k << r.out;
  EXPECT_NE(r.out.find("[48, 16, 16]  chunked"), std::string::npos) << r.out;  // L0/F6/y's shape
  r = m3h(std::string("dump --list-keys --stage 'L0/F3/dt' ") + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.rfind("L0/F3/dt ", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("seq,chunked"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("1 key(s)"), std::string::npos) << r.out;
  for (const auto& e : fs::directory_iterator(dir_))
    EXPECT_NE(e.path().extension(), ".h5") << "--list-keys wrote " << e.path();
}

// --list-keys --oracle gpu lists the keys the GPU oracle provides (no device needed: nothing
// runs) and counts the ones it leaves out; a bad --oracle is refused there too.
TEST_F(CliTest, DumpListKeysWithTheGpuOracleLeavesOutOneScanAlgorithmsInside) {
  RunResult r = m3h(std::string("dump --list-keys --oracle gpu --scan seq --stage 'L0/F6/*' ") + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out.rfind("L0/F6/y ", 0), 0u) << r.out;
  EXPECT_EQ(r.out.find("h_saved "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("more that the GPU oracle does not compute"), std::string::npos) << r.out;
  const RunResult all = m3h(std::string("dump --list-keys --scan seq --stage 'L0/F6/*' ") + kSmall);
  ASSERT_EQ(all.status, 0) << all.err;
  EXPECT_NE(all.out.find("h_saved "), std::string::npos) << all.out;
  EXPECT_GT(count_lines(all.out), count_lines(r.out)) << all.out << r.out;
  r = m3h(std::string("dump --list-keys --oracle tpu ") + kSmall);
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--oracle is cpu or gpu"), std::string::npos) << r.err;
}

// A pattern that matches nothing names the nearest keys by edit distance (dump and compare).
TEST_F(CliTest, AStagePatternThatMatchesNothingSuggestsTheNearestKeys) {
  for (const std::string& cmd :
       {"dump --device cpu --stage L0/F3/dtt --out '" + path("x.h5").string() + "' ",
        std::string("compare --device cpu --stage L0/F3/dtt ")}) {
    const RunResult r = m3h(cmd + kSmall);
    EXPECT_EQ(r.status, 2) << cmd;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("matches no tensor of this run; nearest: L0/F3/dt, "), std::string::npos)
        << cmd << ": " << r.err;
    EXPECT_NE(r.err.find("--list-keys"), std::string::npos) << r.err;
  }
  EXPECT_FALSE(fs::exists(path("x.h5")));
}

// m3h --version: the version, the source's git describe and the build, on one line.
TEST_F(CliTest, VersionNamesTheRevisionTheBuildAndCuda) {
  const RunResult r = m3h("--version");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(count_lines(r.out), 1) << r.out;
  EXPECT_EQ(r.out.rfind("m3h 0.1 (git ", 0), 0u) << r.out;
  EXPECT_EQ(r.out.find("(git unknown)"), std::string::npos) << "built from a git checkout: " << r.out;
  EXPECT_NE(r.out.find(" build, "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find(m3::gpu::cuda_compiled() ? "CUDA yes\n" : "CUDA no\n"), std::string::npos)
      << r.out;
  EXPECT_EQ(m3h("--version extra").status, 2);
}

// --json -: the JSON document alone on stdout (it parses), the report on stderr.
TEST_F(CliTest, JsonDashWritesTheDocumentToStdoutAndTheReportToStderr) {
  const RunResult r = m3h(std::string("compare --device cpu --dtype f32 --scan seq --stage 'L0/F3/*' --json - ") + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  const nlohmann::ordered_json j = nlohmann::ordered_json::parse(r.out);
  EXPECT_EQ(j["schema"], "m3h-compare/2");
  EXPECT_NE(r.err.find("summary: PASS"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(path("-")));
}

// --dtype says its real default: determinism on the CPU runs (and its header names) f32
// alone, and its help does not claim f32,bf16,f16 as the default; the other commands' helps
// name theirs too.
TEST_F(CliTest, DtypeDefaultsAreTheOnesThatRun) {
  const RunResult r = m3h(std::string("determinism --device cpu --runs 2 --scan seq ") + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("m3h determinism: device=cpu precisions=f32 runs=2"), std::string::npos) << r.out;
  const RunResult help = m3h("determinism --help");
  EXPECT_EQ(help.out.find("(=f32,bf16,f16)"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("--dtype arg  "), std::string::npos) << "no '(=…)' default: " << help.out;
  EXPECT_NE(help.out.find("(default: all on the GPU;"), std::string::npos) << help.out;
  EXPECT_NE(m3h("compare --help").out.find("--dtype arg (=all)"), std::string::npos);
  EXPECT_NE(m3h("dump --help").out.find("--dtype arg (=f32)"), std::string::npos);
}

TEST_F(CliTest, DefaultDtypeIsAllThreePrecisions) {
  const RunResult r = m3h(std::string("compare --device cpu --scan seq --stage 'L0/F3/*' ") + kSmall);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("precisions=f32,bf16,f16"), std::string::npos) << r.out;
}

TEST_F(CliTest, JsonIsValidAndHoldsEveryCellWithEveryMetric) {
  const fs::path json = path("out.json");
  const RunResult r = m3h("compare --device cpu --dtype f32,bf16,f16 --json '" + json.string() + "' " + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  const JValue doc = parse_json(read_file(json));
  ASSERT_EQ(doc.kind, JValue::Object);
  EXPECT_EQ(doc.at("schema").str, "m3h-compare/2");
  EXPECT_TRUE(doc.at("pass").b);
  EXPECT_EQ(doc.at("exit_status").num, 0);
  EXPECT_EQ(doc.at("seed").num, 1234);
  EXPECT_EQ(doc.at("B").num, 1);
  EXPECT_EQ(doc.at("T").num, 48);
  EXPECT_EQ(doc.at("config").at("d_model").num, 128);
  EXPECT_EQ(doc.at("config").at("n_layers").num, 1);
  EXPECT_FALSE(doc.at("build").at("compiler").str.empty());
  EXPECT_FALSE(doc.at("build").at("build_type").str.empty());
  EXPECT_FALSE(doc.at("build").at("git_revision").str.empty());
  EXPECT_FALSE(doc.at("device").at("cpu").str.empty());
  EXPECT_EQ(doc.at("first_fail").kind, JValue::Null);

  // Every (key, precision, mode) the registry expects, exactly once.
  Config cfg;
  cfg.n_layers = 1;
  std::multiset<std::string> expected, got;
  for (const char* p : {"f32", "bf16", "f16"})
    for (ScanMode m : {ScanMode::Sequential, ScanMode::Chunked})
      for (const auto& k : harness::expected_keys(cfg, 1, 48, m))
        expected.insert(k + "|" + p + "|" + scan_mode_name(m));
  const JValue& cells = doc.at("cells");
  ASSERT_EQ(cells.kind, JValue::Array);
  for (const JValue& c : cells.arr) {
    got.insert(c.at("key").str + "|" + c.at("precision").str + "|" + c.at("mode").str);
    const JValue& m = c.at("metrics");
    ASSERT_EQ(m.kind, JValue::Object) << c.at("key").str;
    for (const char* f : {"max_abs", "worst_index", "rel_l2", "p95_rel", "max_rel", "cosine",
                          "max_ulps", "mean_ulps", "nan_count", "inf_count", "oracle_scale"})
      EXPECT_EQ(m.at(f).kind, JValue::Number) << c.at("key").str << " " << f;
    EXPECT_EQ(m.at("worst_coords").kind, JValue::String);
    EXPECT_EQ(c.at("budget").at("rel_l2").kind, JValue::Number);
    EXPECT_EQ(c.at("budget").at("row").at("stage").kind, JValue::String);
    EXPECT_EQ(c.at("pct").kind, JValue::Number);
    EXPECT_TRUE(c.at("pass").b);
  }
  EXPECT_EQ(got, expected);
  EXPECT_EQ(static_cast<size_t>(doc.at("n_checks").num), expected.size());
  EXPECT_EQ(doc.at("groups").arr.size(), 6u);
  // The closing line counts the six (precision, scan mode) cells and their tensor checks.
  EXPECT_NE(r.out.find("(6 cells, " + std::to_string(expected.size()) + " tensor checks)"),
            std::string::npos)
      << r.out;
  // The angles are compared by circular distance, and say so.
  bool any_circular = false;
  for (const JValue& c : cells.arr)
    if (c.at("tensor").str == "angle_cumsum") any_circular = c.at("circular").b;
  EXPECT_TRUE(any_circular);
  // The rule as applied: on the CPU every cell's baseline is the perturbed oracle (k 5 f32,
  // 3 bf16/f16), and each cell's budget says so.
  const JValue& rule = doc.at("rule");
  EXPECT_EQ(rule.at("e2e").at("baseline").str, "perturbed");
  EXPECT_EQ(rule.at("e2e").at("k").at("f32").num, harness::kPerturbedKf32);
  EXPECT_EQ(rule.at("e2e").at("k").at("bf16").num, harness::kPerturbedKTyped);
  EXPECT_EQ(rule.at("e2e").at("conditioning_k").kind, JValue::Null);
  EXPECT_EQ(rule.at("draws").num, harness::kPerturbationDraws);
  for (const JValue& c : cells.arr) {
    const JValue& b = c.at("budget");
    EXPECT_EQ(b.at("baseline_kind").str, "perturbed") << c.at("key").str;
    EXPECT_EQ(b.at("k").num, c.at("precision").str == "f32" ? harness::kPerturbedKf32
                                                              : harness::kPerturbedKTyped)
        << c.at("key").str;
  }
  EXPECT_NE(r.out.find("rule: pass when rel_l2 and max_abs <= k*perturbed + floor"),
            std::string::npos)
      << r.out;
}

TEST_F(CliTest, StageFilterKeepsOnlyMatchingKeys) {
  const fs::path json = path("f.json");
  const RunResult r =
      m3h("compare --device cpu --stage 'L0/F5/*,grad/L0/dt_bias' --json '" + json.string() + "' " + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  const JValue doc = parse_json(read_file(json));
  std::set<std::string> keys;
  for (const JValue& c : doc.at("cells").arr) keys.insert(c.at("key").str);
  EXPECT_EQ(keys, (std::set<std::string>{"L0/F5/angle_cumsum", "grad/L0/dt_bias"}));
  EXPECT_EQ(r.out.find("L0/F3/dt"), std::string::npos);
  EXPECT_EQ(doc.at("stage_filter").str, "L0/F5/*,grad/L0/dt_bias");
}

TEST_F(CliTest, StageFilterThatMatchesNothingIsBadUsage) {
  const RunResult r = m3h(std::string("compare --device cpu --stage 'nothing/*' ") + kSmall);
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}

// A misspelt option is unknown, never the option it happens to begin (no prefix guessing), in
// every command.
TEST_F(CliTest, AMisspeltOptionIsUnknownNotGuessed) {
  for (const char* cmd : {"compare --device cpu --dtyp f32", "dump --device cpu --stag '*'",
                          "determinism --device cpu --run 2", "golden check --al",
                          "train --device cpu --task parity --step 2"}) {
    const RunResult r = m3h(cmd);
    EXPECT_EQ(r.status, 2) << cmd << "\n" << r.out << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << cmd << "\n" << r.err;
    EXPECT_NE(r.err.find("unrecognised option"), std::string::npos) << cmd << "\n" << r.err;
  }
}

// ---- bench (without a GPU only its arguments and help are testable here) ----------------------

TEST_F(CliTest, BenchHelpNamesGraphReplaysAndTheMarginalLayer) {
  const RunResult r = m3h("bench --help");
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* text : {"--graph", "official2", "--profile", "--ceilings", "--recompute"})
    EXPECT_NE(r.out.find(text), std::string::npos) << text << " missing from:\n" << r.out;
}

// Bad arguments are refused, with one line, before anything is timed, with or without a GPU.
// --memory-plan: the registry's count per tensor, no device: the saved total per further layer
// is layer_bytes', the chunk states lead with recompute none and are gone with scan, the
// sequential mode is listed once; a timing option beside it is refused in one line.
TEST_F(CliTest, BenchMemoryPlanIsTheRegistrysCountPerTensor) {
  RunResult r = m3h("bench --memory-plan --shapes official --dtype bf16 --scan chunked,seq "
                    "--recompute none,scan");
  ASSERT_EQ(r.status, 0) << r.err;
  Config off = harness::find_preset("official").cfg;
  char want[64];
  for (Recompute rc : {Recompute::None, Recompute::Scan}) {
    const LayerBytes b = layer_bytes(off, 8, 4096, ScanMode::Chunked, Precision::BF16, rc);
    std::snprintf(want, sizeof want, "saved per further layer %.3f GiB", b.saved / 1073741824.0);
    EXPECT_NE(r.out.find(want), std::string::npos) << want << "\n" << r.out;
  }
  const size_t none = r.out.find("recompute none"), scan = r.out.find("recompute scan");
  ASSERT_NE(none, std::string::npos);
  ASSERT_NE(scan, std::string::npos);
  EXPECT_NE(r.out.find("F6/chunk_states_saved"), std::string::npos);
  EXPECT_LT(r.out.find("F6/chunk_states_saved"), scan) << "only with recompute none";
  EXPECT_EQ(r.out.find("F6/chunk_states_saved", scan), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("bf16 seq, recompute"), std::string::npos) << "seq has no policy";
  EXPECT_NE(r.out.find("F6/h_saved"), std::string::npos) << r.out;
  for (const std::string& bad : {"--profile", "--reference", "--ceilings", "--graph"}) {
    r = m3h("bench --memory-plan " + bad);
    EXPECT_EQ(r.status, 2) << bad;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("--memory-plan runs nothing"), std::string::npos) << r.err;
  }
}

TEST_F(CliTest, BenchRejectsBadArgumentsWithOneLine) {
  for (const char* args :
       {"bench --repeats 0", "bench --warmup -1", "bench --shapes nonsense",
        "bench --shapes ''", "bench --dtype f64", "bench --scan sideways",
        "bench --graph --reference", "bench --profile --reference", "bench --graph --ceilings",
        "bench --ceilings --reference", "bench --recompute all", "bench --recompute ''"}) {
    const RunResult r = m3h(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << args << ": " << r.err;
  }
}

// ---- --config ------------------------------------------------------------------------------

TEST_F(CliTest, ConfigFileSetsTheProblemAndTheCommandLineWins) {
  write("p.cfg", "# a small problem\nd_model = 64\nlayers = 1\nT = 40  # trailing comment\n"
                 "B=1\nheaddim = 16\nseed = 7\n");
  const fs::path json = path("c.json");
  RunResult r = m3h("compare --device cpu --dtype f32 --config '" + path("p.cfg").string() + "' --T 24 --json '" +
                    json.string() + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const JValue doc = parse_json(read_file(json));
  EXPECT_EQ(doc.at("config").at("d_model").num, 64);
  EXPECT_EQ(doc.at("config").at("input_dim").num, 64);  // follows d_model as on the command line
  EXPECT_EQ(doc.at("T").num, 24);                        // the command line wins
  EXPECT_EQ(doc.at("seed").num, 7);
  EXPECT_NE(doc.at("source").str.find("config"), std::string::npos);
}

TEST_F(CliTest, ConfigFileUnknownKeyExitsTwoWithOneLineNamingIt) {
  write("bad.cfg", "d_model = 64\ncolour = blue\n");
  const RunResult r = m3h("compare --device cpu --config '" + path("bad.cfg").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("colour"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("bad.cfg:2"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty());
}

TEST_F(CliTest, ConfigFileBadValueExitsTwoWithOneLineNamingTheKey) {
  for (const char* text : {"d_model = sixty-four", "rope_fraction = half", "outproj_norm = maybe",
                           "seed = -3", "preset = nope"}) {
    const std::string line = text;
    write("v.cfg", "B = 1\n" + line + "\n");
    const RunResult r = m3h("compare --device cpu --config '" + path("v.cfg").string() + "'");
    EXPECT_EQ(r.status, 2) << line;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    const std::string key = line.substr(0, line.find(' '));
    EXPECT_NE(r.err.find("'" + key + "'"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("v.cfg:2"), std::string::npos) << r.err;
  }
}

TEST_F(CliTest, ConfigFileThatDoesNotExistExitsTwo) {
  const RunResult r = m3h("compare --device cpu --config '" + path("missing.cfg").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
}

// ---- bad input (one line, exit 2, nothing run) ------------------------------------------------

// Sizes whose products wrap around 64 bits used to run (B·T wrapped: a crash; d_inner wrapped
// to 0: a PASS on an empty model); they are refused, naming the product.
TEST_F(CliTest, SizesWhoseProductsOverflowAreRefusedNamingTheProduct) {
  const std::pair<const char*, const char*> cases[] = {
      {"compare --device cpu --B 4611686018427387904 --T 4 --layers 1", "B*T"},
      {"compare --device cpu --expand 2305843009213693952", "d_inner"},
      {"compare --device cpu --T 4 --chunk-size 9223372036854775807", "chunk_size"},
      {"determinism --device cpu --B 4611686018427387904 --T 4 --layers 1", "B*T"},
      {"dump --device cpu --stage '*' --out OUT --B 4611686018427387904 --T 4", "B*T"},
  };
  for (const auto& [args, named] : cases) {
    std::string a = args;
    if (a.find("OUT") != std::string::npos) a.replace(a.find("OUT"), 3, "'" + path("x.h5").string() + "'");
    const RunResult r = m3h(a);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find(named), std::string::npos) << args << ": " << r.err;
  }
  EXPECT_FALSE(fs::exists(path("x.h5")));
}

TEST_F(CliTest, NoCommandIsOneErrorLineAndTheHelpNamesEveryCommandWhole) {
  RunResult r = m3h("");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("no command"), std::string::npos) << r.err;
  EXPECT_TRUE(r.out.empty()) << r.out;
  r = m3h("--help");
  EXPECT_EQ(r.status, 0);
  for (const char* name : {"compare  ", "bench  ", "dump  ", "golden  ", "determinism  "})
    EXPECT_NE(r.out.find(std::string("  ") + name), std::string::npos) << name << "\n" << r.out;
}

// A seed is decimal unless it starts with 0x: 010 is ten (it was read as octal 8, while 09
// was refused).
TEST_F(CliTest, SeedsWithLeadingZerosAreDecimal) {
  const std::pair<const char*, int> cases[] = {{"010", 10}, {"09", 9}, {"0x10", 16}, {"0", 0}};
  for (const auto& [text, value] : cases) {
    const fs::path json = path("s.json");
    fs::remove(json);
    const RunResult r = m3h(std::string("compare --device cpu --dtype f32 --scan seq ") + kSmall +
                            " --seed " + text + " --json '" + json.string() + "'");
    ASSERT_EQ(r.status, 0) << text << ": " << r.err;
    EXPECT_EQ(parse_json(read_file(json)).at("seed").num, value) << text;
  }
  for (const char* bad : {"08x", "0x", "1e3", "- 1"}) {
    const RunResult r = m3h(std::string("compare --device cpu ") + kSmall + " --seed '" + bad + "'");
    EXPECT_EQ(r.status, 2) << bad;
    EXPECT_EQ(count_lines(r.err), 1) << bad << ": " << r.err;
  }
}

// An empty --stage (or an empty item of its list) would match every tensor: refused.
TEST_F(CliTest, EmptyStagePatternsAreBadUsage) {
  for (const char* pattern : {"''", "','", "'L0/F3/*,'", "'a,,b'", "' '"}) {
    for (const std::string& cmd : {std::string("compare --device cpu ") + kSmall,
                                  "dump --out '" + path("d.h5").string() + "' " + kSmall}) {
      const RunResult r = m3h(cmd + " --stage " + pattern);
      EXPECT_EQ(r.status, 2) << cmd << " --stage " << pattern << "\n" << r.out;
      EXPECT_EQ(count_lines(r.err), 1) << pattern << ": " << r.err;
      EXPECT_NE(r.err.find("empty pattern"), std::string::npos) << r.err;
    }
  }
  EXPECT_FALSE(fs::exists(path("d.h5")));
}

// --config naming a FIFO used to block forever reading it; a folder or a FIFO is refused at once.
TEST_F(CliTest, ConfigThatIsNotARegularFileIsRefusedWithoutReading) {
  const fs::path fifo = path("cfg.fifo");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const fs::path& p : {fifo, dir_}) {
    const RunResult r = m3h("compare --device cpu --config '" + p.string() + "'");
    EXPECT_EQ(r.status, 2) << p;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << r.err;
  }
}

// One rule for every output (compare --json, dump --out), checked before the run: an existing
// file only with --force, never a non-regular file (a device node stays one), never a dangling
// link's target, never the run's own --config.
TEST_F(CliTest, OutputsFollowOneRuleBeforeAnyWork) {
  const std::string run = std::string("compare --device cpu --dtype f32 --scan seq ") + kSmall;
  const fs::path json = path("r.json");
  write("r.json", "keep me");
  RunResult r = m3h(run + " --json '" + json.string() + "'");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(json), "keep me");
  EXPECT_EQ(r.out.find("summary"), std::string::npos) << "the run went ahead:\n" << r.out;
  r = m3h(run + " --json '" + json.string() + "' --force");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(read_file(json).find("\"cells\""), std::string::npos);
  // A character device is never replaced, --force or not.
  for (const char* force : {"", " --force"}) {
    r = m3h(run + " --json /dev/null" + force);
    EXPECT_EQ(r.status, 2) << force;
    EXPECT_NE(r.err.find("not a regular file"), std::string::npos) << r.err;
    EXPECT_TRUE(fs::is_character_file("/dev/null"));
  }
  // A dangling symbolic link is not followed into a new file.
  fs::create_symlink(path("nowhere/target.json"), path("dangling.json"));
  r = m3h(run + " --json '" + path("dangling.json").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("dangling"), std::string::npos) << r.err;
  // The run's own config file is never the output.
  write("p.cfg", "layers = 1\nT = 24\nB = 1\n");
  r = m3h("compare --device cpu --dtype f32 --config '" + path("p.cfg").string() + "' --json '" +
          path("p.cfg").string() + "' --force");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--config"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(path("p.cfg")), "layers = 1\nT = 24\nB = 1\n");
  // dump: an existing file without --force is refused before anything is computed.
  write("d.h5", "not hdf5");
  r = m3h(std::string("dump --stage '*' --out '") + path("d.h5").string() + "' " + kSmall);
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(read_file(path("d.h5")), "not hdf5");
}

// determinism --record / --expect (harness/digest_record.hpp), on the CPU reference: a record
// read back as recorded; a hash edited by hand is refused (its cell's digest no longer fits);
// another build's record, with one tensor's bits other, names that tensor as the first moved
// (exit 1); a record of another problem or machine, --record over an existing file
// without --force, and both options at once are refused before any work (exit 2, one line).
TEST_F(CliTest, DeterminismRecordIsHeldAndAMovedTensorIsNamed) {
  const std::string run = std::string("determinism --runs 2 --device cpu ") + kSmall;
  const std::string rec = path("d.txt").string();
  RunResult r = m3h(run + " --record '" + rec + "'");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const std::string text = read_file(rec);
  ASSERT_EQ(text.rfind("m3h-digests 1\n", 0), 0u) << text;
  EXPECT_NE(text.find("environment: CPU float reference"), std::string::npos) << text;
  EXPECT_NE(text.find("cell: f32 seq "), std::string::npos) << text;
  EXPECT_NE(text.find("cell: f32 chunked "), std::string::npos) << text;

  r = m3h(run + " --expect '" + rec + "'");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("as recorded"), std::string::npos) << r.out;

  // A hash edited by hand (the third tensor line of the chunked cell) no longer matches its
  // cell's digest: the record is refused as edited (exit 2, one line), nothing is compared.
  std::string edited = text;
  size_t at = edited.find("cell: f32 chunked ");
  ASSERT_NE(at, std::string::npos);
  for (int i = 0; i < 3; ++i) at = edited.find('\n', at) + 1;
  const size_t sp = edited.find(' ', at);
  edited[sp + 1] = edited[sp + 1] == '0' ? '1' : '0';
  write("edited.txt", edited);
  r = m3h(run + " --expect '" + path("edited.txt").string() + "'");
  EXPECT_EQ(r.status, 2) << r.out << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("an edited record"), std::string::npos) << r.err;

  // The record of a build whose third chunked tensor had other bits (that hash and the cell's
  // digest both as that build would write them): the tensor is named as the first moved one.
  m3::harness::DigestRecord other_build = m3::harness::read_digest_record(rec);
  m3::harness::DigestCell* cell = nullptr;
  for (auto& c : other_build.cells)
    if (c.scan == "chunked") cell = &c;
  ASSERT_NE(cell, nullptr);
  ASSERT_GT(cell->keys.size(), 3u);
  const std::string key = cell->keys[2];
  cell->hashes[2] ^= 1;
  cell->digest = m3::harness::digest_of(cell->hashes);
  write("moved.txt", m3::harness::format_digest_record(other_build));
  r = m3h(run + " --expect '" + path("moved.txt").string() + "'");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("NOT AS RECORDED: 1 of "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("first " + key + " ("), std::string::npos) << key << "\n" << r.out;

  // Not comparable: another seed, another machine.
  r = m3h(run + " --seed 7 --expect '" + rec + "'");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("another problem"), std::string::npos) << r.err;
  std::string other = text;
  other.replace(other.find("environment: ") + 13, 3, "GPU");
  write("other.txt", other);
  r = m3h(run + " --expect '" + path("other.txt").string() + "'");
  EXPECT_EQ(r.status, 2) << r.out;
  EXPECT_NE(r.err.find("not comparable"), std::string::npos) << r.err;
  EXPECT_EQ(r.out.find("IDENTICAL"), std::string::npos) << "the run went ahead:\n" << r.out;

  // The output rule, and one option at a time.
  write("keep.txt", "keep me");
  r = m3h(run + " --record '" + path("keep.txt").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_EQ(read_file(path("keep.txt")), "keep me");
  r = m3h(run + " --record '" + path("new.txt").string() + "' --expect '" + rec + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("one at a time"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(path("new.txt")));
  // A malformed record: one line naming it.
  write("bad.txt", "m3h-digests 1\nenvironment: x\n");
  r = m3h(run + " --expect '" + path("bad.txt").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("bad.txt"), std::string::npos) << r.err;
}

// --device gpu is a request, not a hint: without a usable GPU it is bad usage (it used to run
// the CPU and exit 0); auto still falls back, saying so.
TEST_F(CliTest, ExplicitGpuWithoutAGpuIsBadUsage) {
  if (m3::gpu::query_device().present) GTEST_SKIP() << "a GPU is present";
  for (const std::string& cmd :
       {std::string("compare ") + kSmall, std::string("determinism --runs 2 ") + kSmall,
        std::string("dump --stage '*' --out '") + path("g.h5").string() + "' " + kSmall}) {
    const RunResult r = m3h(cmd + " --device gpu");
    EXPECT_EQ(r.status, 2) << cmd << "\n" << r.out;
    EXPECT_EQ(count_lines(r.err), 1) << cmd << ": " << r.err;
    EXPECT_NE(r.err.find("--device gpu"), std::string::npos) << r.err;
  }
  EXPECT_FALSE(fs::exists(path("g.h5")));
  // The note is one line on stderr, headed by what it means; stdout stays the report.
  const RunResult r = m3h(std::string("compare --dtype f32 --scan seq ") + kSmall + " --device auto");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err.find("m3h: no GPU found: running the CPU rows only ("), 0u) << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(r.out.find("no GPU"), std::string::npos) << r.out;
}

// golden: an option the action does not use is bad usage (list --file was silently ignored),
// and a case named twice is refused before anything is written (it used to write, then fail).
TEST_F(CliTest, GoldenOptionsTheActionDoesNotUseAndRepeatedCasesAreBadUsage) {
  fs::create_directories(path("cases"));
  const std::string dir = " --dir '" + path("cases").string() + "'";
  for (const char* args :
       {"golden list --file x.h5", "golden list --case default", "golden list --all",
        "golden check --force", "golden regen --case default --file x.h5",
        "golden regen --case default --case default"}) {
    const RunResult r = m3h(std::string(args) + dir);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
    EXPECT_EQ(count_lines(r.err), 1) << args << ": " << r.err;
  }
  EXPECT_TRUE(fs::is_empty(path("cases"))) << "something was written";
}

// A problem that cannot fit the machine is refused before anything is allocated, naming the
// memory it needs and the override (it ended in std::bad_alloc or worse).
TEST_F(CliTest, ProblemsLargerThanTheMachineAreRefusedNamingTheOverride) {
  for (const char* cmd : {"compare --device cpu", "determinism --runs 2 --device cpu",
                          "dump --stage '*' --device cpu --out OUT", "bench --reference"}) {
    std::string c = cmd;
    if (c.find("OUT") != std::string::npos) c.replace(c.find("OUT"), 3, "'" + path("big.h5").string() + "'");
    const RunResult r = m3h(c + " --B 1048576 --T 1048576 --layers 1");
    EXPECT_EQ(r.status, 2) << cmd << "\n" << r.out;
    EXPECT_EQ(count_lines(r.err), 1) << cmd << ": " << r.err;
    EXPECT_NE(r.err.find("host memory"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("--allow-large"), std::string::npos) << r.err;
  }
  EXPECT_FALSE(fs::exists(path("big.h5")));
}

// Text from a file or the command line echoed in an error is one line: control characters
// escaped, a long value cut.
TEST_F(CliTest, EchoedTextIsEscapedAndCut) {
  write("bad.cfg", std::string("d_model = 6\x01\x1b[31m4\n"));
  RunResult r = m3h("compare --device cpu --config '" + path("bad.cfg").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("\\x01\\x1b"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << "a raw escape reached the terminal";
  write("long.cfg", "seed = " + std::string(100000, '7') + "x\n");
  r = m3h("compare --device cpu --config '" + path("long.cfg").string() + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1);
  EXPECT_LT(r.err.size(), 500u) << r.err.substr(0, 200);
  EXPECT_NE(r.err.find("bytes)"), std::string::npos) << r.err.substr(0, 300);
}

// A disk that fills during an HDF5 write: one error line naming the cause, exit 2 (not a crash
// in the HDF5 library's shutdown, which a temporary whose close failed used to cause), and no
// file left. Needs a small tmpfs (root); skipped, saying so, where it cannot be mounted.
TEST_F(CliTest, AFullDiskFailsTheWriteCleanlyAndLeavesNothing) {
  const fs::path small = path("small");
  fs::create_directories(small);
  const std::string mount = "mount -t tmpfs -o size=1m tmpfs '" + small.string() + "' 2>/dev/null";
  if (std::system(mount.c_str()) != 0) GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  struct Unmount {
    std::string cmd;
    ~Unmount() { (void)!std::system(cmd.c_str()); }
  } unmount{"umount '" + small.string() + "' 2>/dev/null"};
  for (const std::string& args :
       {"dump --device cpu --stage '*' --layers 2 --T 64 --out '" + (small / "d.h5").string() + "'",
        "golden regen --case default --dir '" + small.string() + "'"}) {
    const RunResult r = m3h(args);
    EXPECT_EQ(r.status, 2) << args << " (139 = a crash)\n" << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("buf = 0x"), std::string::npos) << "HDF5 internals: " << r.err;
    EXPECT_TRUE(fs::is_empty(small)) << args << " left a file behind";
  }
}

// An empty path is named as such, not echoed as an empty name in front of a message.
TEST_F(CliTest, EmptyPathsAreBadUsageNamingTheOption) {
  const std::pair<const char*, const char*> cases[] = {
      {"golden regen --case default --dir ''", "--dir"},
      {"golden check --file ''", "--file"},
      {"compare --device cpu --golden ''", "--golden"},
      {"compare --device cpu --config ''", "--config"},
      {"compare --device cpu --json ''", "--json"},
      {"dump --stage '*' --out ''", "--out"},
  };
  for (const auto& [args, option] : cases) {
    const RunResult r = m3h(args);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_EQ(count_lines(r.err), 1) << args << ": " << r.err;
    EXPECT_NE(r.err.find(std::string(option) + ": an empty path"), std::string::npos) << r.err;
  }
}

// Golden data for a user's own config (docs/HARNESS.md §8): regen --config … --out writes the
// built-in schema atomically with the config and problem in /meta; check --file checks it.
TEST_F(CliTest, GoldenRegenWritesAndChecksAUsersOwnConfig) {
  write("my.cfg", "d_model = 32\nheaddim = 16\nd_state = 8\nlayers = 2\nT = 20\nB = 2\n"
                  "seed = 42\nchunk_size = 8\noutproj_norm = 1\n");
  const std::string out = path("mine.h5").string();
  RunResult r = m3h("golden regen --config '" + path("my.cfg").string() + "' --T 24 --out '" +
                    out + "'");
  ASSERT_EQ(r.status, 0) << r.err;
  const m3::golden::GoldenCase gc = m3::golden::read_golden(out);
  EXPECT_EQ(gc.name, "mine");
  EXPECT_EQ(gc.problem.cfg.d_model, 32);
  EXPECT_EQ(gc.problem.cfg.n_layers, 2);
  EXPECT_TRUE(gc.problem.cfg.is_outproj_norm);
  EXPECT_EQ(gc.problem.T, 24) << "the command line wins over the config file";
  EXPECT_EQ(gc.problem.seed, 42u);
  EXPECT_EQ(gc.modes.size(), 2u);
  r = m3h("golden check --file '" + out + "'");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("PASS mine"), std::string::npos) << r.out;
  // --golden names a golden file in check as in compare (--file is its other name there).
  r = m3h("golden check --golden '" + out + "'");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("PASS mine"), std::string::npos) << r.out;
  r = m3h("golden regen --case default --golden '" + out + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--golden is for check"), std::string::npos) << r.err;
  // The output rule: no silent replacement; --force replaces.
  r = m3h("golden regen --d-model 16 --headdim 16 --out '" + out + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(m3::golden::read_golden(out).problem.cfg.d_model, 32);
  r = m3h("golden regen --d-model 16 --headdim 16 --layers 1 --T 8 --scan chunked --name small "
          "--out '" + out + "' --force");
  ASSERT_EQ(r.status, 0) << r.err;
  const m3::golden::GoldenCase again = m3::golden::read_golden(out);
  EXPECT_EQ(again.name, "small");
  EXPECT_EQ(again.problem.cfg.d_model, 16);
  EXPECT_EQ(again.modes, std::vector<m3::ScanMode>{m3::ScanMode::Chunked});
  // Problem options belong to regen --out only.
  for (const char* bad : {"golden regen --d-model 16", "golden check --file x.h5 --T 4",
                          "golden list --seed 3", "golden regen --case default --out y.h5"}) {
    r = m3h(std::string(bad) + " --dir '" + dir_.string() + "'");
    EXPECT_EQ(r.status, 2) << bad;
    EXPECT_EQ(count_lines(r.err), 1) << bad << ": " << r.err;
  }
}

// compare --by-position: the error of a [B·T, …] tensor against t, one line per chunk with the
// chunk's first position marked; a pattern that names no such tensor is bad usage.
TEST_F(CliTest, CompareByPositionPrintsOneLinePerChunk) {
  RunResult r = m3h(std::string("compare --device cpu --dtype bf16 --scan chunked --chunk-size 16 ") +
                    kSmall + " --stage 'L0/F6/*' --by-position 'L0/F6/y'");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("bf16 chunked L0/F6/y — error against position, per chunk of 16"),
            std::string::npos) << r.out;
  for (const char* line : {"t      0-15", "t     16-31", "t     32-47", "|t 16:", "|t 32:"})
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.out;
  for (const char* bad : {"'grad/*'", "'L0/states/*'", "'nothing'"}) {
    r = m3h(std::string("compare --device cpu ") + kSmall + " --by-position " + bad);
    EXPECT_EQ(r.status, 2) << bad;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
}

// ---- dump ----------------------------------------------------------------------------------

TEST_F(CliTest, DumpWritesOracleSubjectAndDiffReadableByTheH5Reader) {
  const fs::path h5 = path("d.h5");
  const RunResult r = m3h("dump --device cpu --stage 'L0/F5/*,grad/L0/dt_bias' --dtype f32,bf16 --scan seq --out '" +
                          h5.string() + "' " + kSmall);
  ASSERT_EQ(r.status, 0) << r.err;
  h5::Reader rd(h5.string());
  EXPECT_EQ(rd.attr_string("/meta", "kind"), "dump");
  EXPECT_EQ(rd.attr_int("/meta", "d_model"), 128);
  EXPECT_EQ(rd.attr_int("/meta", "T"), 48);
  EXPECT_EQ(rd.attr_string("/meta", "seed"), "1234");
  EXPECT_EQ(rd.attr_string("/meta", "precision"), "f64");
  EXPECT_EQ(rd.children("/dump"), std::vector<std::string>{"seq"});
  EXPECT_EQ(rd.children("/dump/seq"), (std::vector<std::string>{"bf16", "f32"}));
  Config cfg;
  const std::vector<Idx> th_shape = {48, cfg.nheads(), cfg.num_rope_angles()};
  for (const char* p : {"f32", "bf16"}) {
    const std::string g = std::string("/dump/seq/") + p + "/L0/F5/angle_cumsum";
    const Tensor o = rd.read(g + "/oracle", th_shape);
    const Tensor s = rd.read(g + "/subject", th_shape);
    const Tensor d = rd.read(g + "/diff", th_shape);
    // The baseline is compare's: on the CPU the perturbed oracle's first draw, which is not
    // the oracle, but within a few roundings of it.
    const Tensor bl = rd.read(g + "/baseline", th_shape);
    EXPECT_NE(bl.data, o.data);
    for (size_t i = 0; i < o.data.size(); ++i)
      ASSERT_LE(std::fabs(harness::circular_diff(bl.data[i], o.data[i])), 1e-1) << i;
    EXPECT_EQ(rd.attr_int(g, "circular"), 1);
    EXPECT_EQ(rd.attr_string(g, "axes"), "BT,NH,NA");
    for (size_t i = 0; i < o.data.size(); ++i)
      ASSERT_DOUBLE_EQ(d.data[i], harness::circular_diff(s.data[i], o.data[i])) << i;
    const std::string gg = std::string("/dump/seq/") + p + "/grad/L0/dt_bias";
    EXPECT_EQ(rd.shape(gg + "/oracle"), std::vector<Idx>{cfg.nheads()});
    EXPECT_TRUE(rd.has(gg + "/diff"));
    // [B·T, …] tensors carry their error against t (docs/HARNESS.md §5), parameters none; the
    // profile is the position-wise max of the stored difference.
    const Tensor pmax = rd.read(g + "/by_position/max_abs", std::vector<Idx>{48});
    rd.read(g + "/by_position/rel_l2", std::vector<Idx>{48});
    EXPECT_FALSE(rd.has(gg + "/by_position"));
    const Idx row = cfg.nheads() * cfg.num_rope_angles();
    for (Idx t = 0; t < 48; ++t) {
      double m = 0;
      for (Idx i = 0; i < row; ++i) m = std::max(m, std::fabs(d.data[static_cast<size_t>(t * row + i)]));
      ASSERT_DOUBLE_EQ(pmax.data[static_cast<size_t>(t)], m) << p << " t " << t;
    }
  }

  // An existing file is not replaced without --force, and stays as it was.
  const std::string before = read_file(h5);
  const RunResult again = m3h("dump --device cpu --stage 'L0/F5/*' --out '" + h5.string() + "' " + kSmall);
  EXPECT_EQ(again.status, 2);
  EXPECT_EQ(count_lines(again.err), 1) << again.err;
  EXPECT_NE(again.err.find("--force"), std::string::npos) << again.err;
  EXPECT_EQ(read_file(h5), before);
  const RunResult forced =
      m3h("dump --device cpu --force --stage 'L0/F3/dt' --scan chunked --out '" + h5.string() + "' " + kSmall);
  EXPECT_EQ(forced.status, 0) << forced.err;
  h5::Reader rd2(h5.string());
  EXPECT_TRUE(rd2.has("/dump/chunked/f32/L0/F3/dt/diff"));
  EXPECT_FALSE(rd2.has("/dump/seq"));
}

// --profiles-only: the [B·T, …] tensors' error-against-position profiles and attributes only,
// and every verdict equal to m3h compare's on the same run.
TEST_F(CliTest, DumpProfilesOnlyHoldsTheProfilesAndCompareVerdicts) {
  const fs::path h5 = path("p.h5"), json = path("p.json");
  const std::string run = "--device cpu --stage 'L0/*,grad/L0/dt_bias' --dtype bf16 " + std::string(kSmall);
  const RunResult r = m3h("dump --profiles-only --out '" + h5.string() + "' " + run);
  ASSERT_EQ(r.status, 0) << r.err;
  const RunResult c = m3h("compare --json '" + json.string() + "' " + run);
  ASSERT_EQ(c.status, 0) << c.err;
  std::map<std::string, std::string> status;  // mode|key -> compare's status
  const JValue doc = parse_json(read_file(json));
  for (const JValue& cell : doc.at("cells").arr)
    status[cell.at("mode").str + "|" + cell.at("key").str] = cell.at("status").str;

  h5::Reader rd(h5.string());
  EXPECT_EQ(rd.attr_int("/meta", "profiles_only"), 1);
  Config cfg;
  cfg.n_layers = 1;
  int n = 0;
  for (ScanMode m : {ScanMode::Sequential, ScanMode::Chunked})
    for (const KeyedSpec& ks : expected_stage_keys(cfg, 1, 48, m)) {
      if (!harness::key_matches(ks.key, "L0/*")) continue;
      const std::string g = std::string("/dump/") + scan_mode_name(m) + "/bf16/" + ks.key;
      if (!harness::has_position_axis(ks.spec->shape)) {
        EXPECT_FALSE(rd.has(g)) << g;
        continue;
      }
      ++n;
      ASSERT_TRUE(rd.has(g + "/by_position/rel_l2")) << g;
      EXPECT_EQ(rd.shape(g + "/by_position/max_abs"), std::vector<Idx>{48});
      for (const char* d : {"oracle", "subject", "diff", "baseline"}) EXPECT_FALSE(rd.has(g + "/" + d)) << g;
      EXPECT_EQ(rd.attr_string(g, "status"), status.at(std::string(scan_mode_name(m)) + "|" + ks.key)) << g;
    }
  EXPECT_GT(n, 10);
  EXPECT_FALSE(rd.has("/dump/seq/bf16/grad"));

  // A pattern without a [B·T, …] tensor has no profile to write: one line, exit 2, no file.
  const RunResult none =
      m3h("dump --device cpu --profiles-only --stage 'grad/*' --out '" + path("n.h5").string() + "' " + kSmall);
  EXPECT_EQ(none.status, 2);
  EXPECT_EQ(count_lines(none.err), 1) << none.err;
  EXPECT_NE(none.err.find("--profiles-only"), std::string::npos) << none.err;
  EXPECT_FALSE(fs::exists(path("n.h5")));
}

TEST_F(CliTest, DumpWithoutStageOrOutIsBadUsage) {
  EXPECT_EQ(m3h("dump --device cpu --out '" + path("x.h5").string() + "'").status, 2);
  EXPECT_EQ(m3h("dump --device cpu --stage 'L0/*'").status, 2);
  EXPECT_FALSE(fs::exists(path("x.h5")));
}

// --oracle gpu judges the GPU subject on the device (HARNESS.md §11): dump and compare refuse
// every misuse the same way (tools/cli.hpp, oracle_option), in one line, exit 2, before any
// work and without writing a file.
TEST_F(CliTest, OracleGpuMisusesAreOneLineBeforeAnyWork) {
  const std::string out = " --out '" + path("o.h5").string() + "'";
  const std::string golden = " --golden '" + path("g.h5").string() + "'";
  struct Case {
    std::string args, says;
  };
  std::vector<Case> cases = {
      {"dump --oracle tpu --device cpu --stage L0/F3/dt" + out, "--oracle 'tpu': expected cpu or gpu"},
      {"dump --oracle gpu --device cpu --stage L0/F3/dt" + out, "use it with --device gpu"},
      {"dump --oracle gpu --stage L0/F3/dt" + golden + out, "not with --golden"},
      {"compare --oracle tpu --device cpu", "--oracle 'tpu': expected cpu or gpu"},
      {"compare --oracle gpu --device cpu", "use it with --device gpu"},
      {"compare --oracle gpu --device cpu --mode isolated", "use it with --device gpu"},
      {"compare --oracle gpu --sweep 2", "not with --sweep"},
      {"compare --oracle gpu" + golden, "not with --golden"},
  };
  // Without a usable GPU, --device auto has nothing to run it on: one line says so (not auto's
  // fallback note followed by an error).
  if (!harness::gpu_absent_reason().empty()) {
    cases.push_back({"dump --oracle gpu --stage L0/F3/dt" + out, "no GPU found"});
    cases.push_back({"compare --oracle gpu", "no GPU found"});
  }
  for (const Case& c : cases) {
    const RunResult r = m3h(c.args + " " + kSmall);
    EXPECT_EQ(r.status, 2) << c.args << "\n" << r.out << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find(c.says), std::string::npos) << c.args << ": " << r.err;
    EXPECT_EQ(r.out, "") << c.args << ": nothing runs before the refusal";
  }
  EXPECT_FALSE(fs::exists(path("o.h5")));
  const std::string help = m3h("dump --help").out;
  EXPECT_NE(help.find("--oracle arg (=cpu)"), std::string::npos) << help;
  EXPECT_NE(help.find("exact"), std::string::npos) << "the help says what /baseline holds";
}

// ---- --golden ------------------------------------------------------------------------------

// A tiny golden case written by the golden library itself.
golden::GoldenCase tiny_case() {
  Config cfg;
  cfg.d_model = 32;
  cfg.headdim = 8;
  cfg.d_state = 8;
  cfg.n_layers = 1;
  cfg.input_dim = 32;
  cfg.chunk_size = 8;
  const Problem pb = make_problem(cfg, 1, 20, 5, true);
  return golden::compute_case("cli_tiny", pb, {ScanMode::Sequential, ScanMode::Chunked});
}

TEST_F(CliTest, GoldenFileIsTheOracleAndTheProblem) {
  const fs::path g = path("tiny.h5");
  golden::write_golden(g.string(), tiny_case(), false);
  const fs::path json = path("g.json");
  const RunResult r = m3h("compare --device cpu --dtype f32 --golden '" + g.string() + "' --json '" +
                          json.string() + "'");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const JValue doc = parse_json(read_file(json));
  EXPECT_EQ(doc.at("config").at("d_model").num, 32);
  EXPECT_EQ(doc.at("T").num, 20);
  EXPECT_EQ(doc.at("seed").num, 5);
  EXPECT_NE(doc.at("source").str.find("golden"), std::string::npos);
  EXPECT_NE(doc.at("oracle").str.find("stored"), std::string::npos);
}

TEST_F(CliTest, GoldenOracleIsReadNotRecomputed) {
  // A stored oracle tensor that disagrees with the math must show up as that tensor failing.
  golden::GoldenCase gc = tiny_case();
  Capture& seq = gc.oracle.at(ScanMode::Sequential);
  Tensor t = seq.at("L0/F3/dt");
  t.data[3] *= 1.5;
  seq.put("L0/F3/dt", t.shape, t.data.data());
  const fs::path g = path("tampered.h5");
  golden::write_golden(g.string(), gc, false);
  const RunResult r = m3h("compare --device cpu --dtype f32 --scan seq --golden '" + g.string() + "'");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("first failing stage: L0/F3/dt"), std::string::npos) << r.out;
}

TEST_F(CliTest, GoldenCannotBeCombinedWithProblemOptions) {
  const fs::path g = path("tiny.h5");
  golden::write_golden(g.string(), tiny_case(), false);
  for (const char* extra : {"--d-model 64", "--preset default", "--T 8", "--seed 3"}) {
    const RunResult r = m3h("compare --device cpu --golden '" + g.string() + "' " + extra);
    EXPECT_EQ(r.status, 2) << extra;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
  }
  const RunResult missing = m3h("compare --device cpu --golden '" + path("none.h5").string() + "'");
  EXPECT_EQ(missing.status, 2);
  EXPECT_EQ(count_lines(missing.err), 1) << missing.err;
}

// ---- the JSON writer itself ----------------------------------------------------------------

TEST(JsonWriter, EscapesStringsAndWritesNonFiniteNumbersAsStrings) {
  harness::Json j;
  const std::string nasty = std::string("q\"b\\s/n\nt\tc") + '\x01' + '\x1f' + "é";
  j.begin_object();
  j.key(nasty).str(nasty);
  j.key("inf").num(std::numeric_limits<double>::infinity());
  j.key("ninf").num(-std::numeric_limits<double>::infinity());
  j.key("nan").num(std::numeric_limits<double>::quiet_NaN());
  j.key("tiny").num(1e-300);
  j.key("third").num(1.0 / 3.0);
  j.key("big").num(static_cast<std::uint64_t>(18446744073709551615ull));
  j.key("neg").num(static_cast<std::int64_t>(-5));
  j.key("list").begin_array().num(1).num(2.5).end_array();
  j.key("empty").begin_object().end_object();
  j.key("objs").begin_array().begin_object().key("a").null().end_object().end_array();
  j.end_object();
  const std::string text = j.text();
  EXPECT_EQ(text.find('\x01'), std::string::npos);
  EXPECT_NE(text.find("\\u0001"), std::string::npos);
  EXPECT_NE(text.find("\\u001f"), std::string::npos);
  // Parsed back by nlohmann: every escape decodes to the original bytes (é as raw UTF-8).
  const JValue doc = parse_json(text);
  EXPECT_EQ(doc.at(nasty).str, nasty);
  EXPECT_EQ(doc.at("inf").str, "inf");
  EXPECT_EQ(doc.at("ninf").str, "-inf");
  EXPECT_EQ(doc.at("nan").str, "nan");
  EXPECT_EQ(doc.at("tiny").num, 1e-300);
  EXPECT_EQ(doc.at("third").num, 1.0 / 3.0);  // 17 significant digits round-trip
  EXPECT_NE(text.find("18446744073709551615"), std::string::npos);
  EXPECT_EQ(doc.at("neg").num, -5);
  EXPECT_EQ(doc.at("list").arr.size(), 2u);
  EXPECT_EQ(doc.at("objs").arr.at(0).at("a").kind, JValue::Null);
}

TEST(JsonWriter, MisuseThrows) {
  harness::Json j;
  j.begin_object();
  EXPECT_THROW(j.str("value without a key"), Error);
  EXPECT_THROW(j.end_array(), Error);
  EXPECT_THROW(j.text(), Error);
}

TEST(JsonWriter, AtomicWriteReplacesTheFileAndLeavesNoTemporary) {
  const fs::path dir = fs::temp_directory_path() / ("m3h_json_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path p = dir / "a.json";
  harness::write_file_atomic(p.string(), "{}\n");
  harness::write_file_atomic(p.string(), "[1]\n");
  EXPECT_EQ(read_file(p), "[1]\n");
  int files = 0;
  for (const auto& e : fs::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
  EXPECT_THROW(harness::write_file_atomic((dir / "no" / "such" / "x.json").string(), "{}"), Error);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace m3
