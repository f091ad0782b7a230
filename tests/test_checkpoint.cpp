// Tests of the checkpoint file (train/checkpoint.hpp), the run directory (train/run_dir.hpp)
// and the console + Ctrl-C flag (train/progress.hpp).
//
//   Checkpoint  write + read bit-exact (params, m, v, every meta field, loss_scale 0.1 + 2^-40,
//               a data hash with the top bit set), the layout gaps read back as zero, each
//               of /weights, /optimizer/m and /optimizer/v in its own buffer (a file written
//               by hand read, a written file read with the HDF5 reader alone), the
//               dataset names of a golden file's /weights (head_w included), the overwrite
//               rule, one clear error naming the file and the dataset for a missing,
//               mis-shaped, non-finite or extra dataset, a loss scale not finite and > 0, and
//               for a wrong kind or schema version
//               (files written with h5::Writer directly), config <-> settings, resume_mismatch
//   RunDir      the folder rules (new, another run, --force leaving foreign files, resume),
//               metrics.csv rows and their truncation on resume (k + resume + N−k = N straight),
//               checkpoint names and pruning (newest K + the final), loss.png by gnuplot and
//               the note when gnuplot is missing
//   Progress    the exact plain-mode lines, the tty line's control sequences, h:mm:ss
//   StopFlag    one SIGINT / SIGTERM only sets the flag; the second removes registered
//               temporaries and kills the process by the signal
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "capture.hpp"
#include "test_io.hpp"
#include "checkpoint.hpp"
#include "digest_record.hpp"
#include "config.hpp"
#include "error.hpp"
#include "h5store.hpp"
#include "backend.hpp"
#include "progress.hpp"
#include "registry.hpp"
#include "run_dir.hpp"
#include "temp_files.hpp"
#include "error_of.hpp"

namespace fs = std::filesystem;
using m3::Config;
using m3::Idx;
using m3::ParamLayout;
using m3::ParamSlot;
using m3::Tensor;
using namespace m3::train;

namespace {

Config tiny_cfg() {
  Config c;
  c.d_model = 8;
  c.d_state = 4;
  c.expand = 2;
  c.headdim = 4;
  c.ngroups = 1;
  c.n_layers = 2;
  c.rope_fraction = 0.5;
  c.a_floor = 1e-4;
  c.chunk_size = 4;
  c.vocab_size = 5;
  c.input_dim = 5;
  return c;
}

CheckpointMeta tiny_meta(const Config& c) {
  CheckpointMeta m;
  m.settings = config_settings(c);
  const Settings rest = {{"task", "parity"}, {"lr", "0.001"},   {"warmup", "10"},
                         {"steps", "100"},   {"beta2", "0.95"}, {"precision", "f32"},
                         {"scan", "chunked"}, {"seed", "7"},    {"B", "2"},
                         {"T", "16"},        {"grad_accum", "1"}};
  m.settings.insert(m.settings.end(), rest.begin(), rest.end());
  m.step = 42;
  m.loss_scale = 0.1 + std::ldexp(1.0, -40);
  m.good_steps = 17;
  m.skipped = 3;
  m.data_size = 1234567;
  m.data_hash = 0xfedcba9876543210ULL;  // the top bit set: not an int64
  m.git_revision = "abc1234";
  return m;
}

// Every float of the three buffers random (gaps too: they must NOT come back), plus a few
// special values in the first slot.
TrainState random_state(const ParamLayout& layout, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  TrainState st;
  for (auto* b : {&st.params, &st.m, &st.v}) {
    b->resize(static_cast<std::size_t>(layout.total));
    for (float& x : *b) x = u(rng);
  }
  const float special[] = {-0.0f, FLT_MIN, FLT_TRUE_MIN, FLT_MAX, -FLT_MAX, 1.0f + FLT_EPSILON,
                           std::nextafter(1.0f, 2.0f) / 3.0f};
  for (std::size_t i = 0; i < std::size(special); ++i) st.params[i] = special[i];
  return st;
}

std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

bool in_a_slot(const ParamLayout& layout, Idx i) {
  for (const ParamSlot& s : layout.slots)
    if (i >= s.offset && i < s.offset + s.size) return true;
  return false;
}

using m3::test::error_of;

using m3::test::slurp;

void touch(const fs::path& p, const std::string& text = "x") {
  std::ofstream(p, std::ios::binary) << text;
}

// A fresh folder per test, removed afterwards.
struct TempDir : m3::test::TempDir {
  TempDir() : m3::test::TempDir("m3_ckpt_") {}
};

// A checkpoint written by hand with h5::Writer, as write_checkpoint lays it out, with one
// defect on request.
struct Defect {
  std::string kind = "checkpoint";
  Idx schema = 1;
  std::string omit;       // a dataset left out
  std::string reshape;    // a dataset stored flat
  std::string nan_in;     // a dataset with a NaN
  std::string extra;      // one more dataset
};
void write_by_hand(const std::string& path, const Config& cfg, const CheckpointMeta& meta,
                   const TrainState& st, const Defect& d) {
  m3::h5::Writer w(path, true);
  w.group("/meta");
  w.attr("/meta", "kind", d.kind);
  w.attr("/meta", "schema_version", d.schema);
  std::string names;
  for (const auto& kv : meta.settings) names += (names.empty() ? "" : ",") + kv.first;
  w.attr("/meta", "settings", names);
  for (const auto& [k, v] : meta.settings) w.attr("/meta", k, v);
  w.attr("/meta", "step", meta.step);
  w.attr("/meta", "loss_scale", meta.loss_scale);
  w.attr("/meta", "good_steps", meta.good_steps);
  w.attr("/meta", "skipped", meta.skipped);
  w.attr("/meta", "data_size", meta.data_size);
  w.attr("/meta", "data_hash", m3::harness::hex16(meta.data_hash));
  w.attr("/meta", "git_revision", meta.git_revision);
  const ParamLayout layout = m3::param_layout(cfg);
  const std::pair<const char*, const std::vector<float>*> groups[] = {
      {"/weights", &st.params}, {"/optimizer/m", &st.m}, {"/optimizer/v", &st.v}};
  for (const auto& [g, buf] : groups) {
    for (const ParamSlot& s : layout.slots) {
      const std::string p = std::string(g) + "/" + s.name;
      if (p == d.omit) continue;
      Tensor t{s.shape, std::vector<double>(buf->begin() + s.offset,
                                            buf->begin() + s.offset + s.size)};
      if (p == d.reshape) t.shape = {s.size};
      if (p == d.nan_in) t.data[0] = NAN;
      w.write(p, t, m3::h5::DType::F32, m3::h5::NonFinite::Allow);
    }
  }
  if (!d.extra.empty()) w.write(d.extra, Tensor{{2}, {1.0, 2.0}}, m3::h5::DType::F32);
  w.commit();
}

}  // namespace

// ---- Checkpoint -----------------------------------------------------------------------------

TEST(Checkpoint, WriteReadRoundTripIsBitExact) {
  TempDir dir;
  const Config cfg = tiny_cfg();
  const ParamLayout layout = m3::param_layout(cfg);
  const CheckpointMeta meta = tiny_meta(cfg);
  const TrainState st = random_state(layout, 1);
  const std::string path = dir.file("ckpt.h5");
  write_checkpoint(path, cfg, meta, st, false);

  Config cfg2;
  TrainState st2;
  const CheckpointMeta got = read_checkpoint(path, &cfg2, &st2);
  EXPECT_EQ(got.settings, meta.settings);
  EXPECT_EQ(got.step, meta.step);
  EXPECT_EQ(bits(static_cast<float>(got.loss_scale)), bits(static_cast<float>(meta.loss_scale)));
  EXPECT_EQ(std::memcmp(&got.loss_scale, &meta.loss_scale, sizeof(double)), 0)
      << "loss_scale " << got.loss_scale << " vs " << meta.loss_scale;
  EXPECT_EQ(got.good_steps, meta.good_steps);
  EXPECT_EQ(got.skipped, meta.skipped);
  EXPECT_EQ(got.data_size, meta.data_size);
  EXPECT_EQ(got.data_hash, meta.data_hash);
  EXPECT_EQ(got.git_revision, meta.git_revision);
  EXPECT_EQ(config_settings(cfg2), config_settings(cfg));
  EXPECT_EQ(cfg2.vocab_size, 5);

  const std::pair<const std::vector<float>*, const std::vector<float>*> bufs[] = {
      {&st.params, &st2.params}, {&st.m, &st2.m}, {&st.v, &st2.v}};
  Idx gaps = 0;
  for (const auto& [a, b] : bufs) {
    ASSERT_EQ(b->size(), static_cast<std::size_t>(layout.total));
    for (Idx i = 0; i < layout.total; ++i) {
      const auto k = static_cast<std::size_t>(i);
      if (in_a_slot(layout, i)) {
        ASSERT_EQ(bits((*a)[k]), bits((*b)[k])) << "index " << i;
      } else {
        ++gaps;
        ASSERT_EQ(bits((*b)[k]), 0u) << "gap index " << i << " not zero";
      }
    }
  }
  EXPECT_GT(gaps, 0) << "this layout has gaps (offsets are multiples of kParamAlign)";
}

TEST(Checkpoint, DatasetsCarryTheGoldenWeightNamesAndShapesHeadIncluded) {
  TempDir dir;
  const Config cfg = tiny_cfg();
  const ParamLayout layout = m3::param_layout(cfg);
  const std::string path = dir.file("ckpt.h5");
  write_checkpoint(path, cfg, tiny_meta(cfg), random_state(layout, 2), false);
  const m3::h5::Reader r(path);
  EXPECT_EQ(r.attr_string("/meta", "kind"), "checkpoint");
  EXPECT_EQ(r.attr_int("/meta", "schema_version"), kCheckpointSchemaVersion);
  EXPECT_EQ(r.attr_string("/meta", "data_hash"), "fedcba9876543210");
  EXPECT_EQ(r.attr_string("/meta", "lr"), "0.001");
  EXPECT_EQ(r.attr_string("/meta", "d_model"), "8");
  int n = 0;
  for (const m3::KeyedParam& kp : m3::expected_param_keys(cfg)) {
    const std::string name = kp.key.substr(5);  // as golden.cpp names /weights
    for (const char* g : {"/weights/", "/optimizer/m/", "/optimizer/v/"}) {
      ASSERT_TRUE(r.has(g + name)) << g << name;
      EXPECT_EQ(r.shape(g + name), kp.shape) << g << name;
      EXPECT_EQ(r.dtype(g + name), m3::h5::DType::F32);
    }
    ++n;
  }
  EXPECT_EQ(n, static_cast<int>(layout.slots.size()));
  ASSERT_TRUE(r.has("/weights/head_w"));
  EXPECT_EQ(r.shape("/weights/head_w"), (std::vector<Idx>{8, 5}));
  EXPECT_EQ(r.shape("/weights/L1/in_proj_w"), (std::vector<Idx>{8, cfg.in_proj_dim()}));
}

TEST(Checkpoint, RefusesAnExistingFileWithoutOverwrite) {
  TempDir dir;
  const Config cfg = tiny_cfg();
  const ParamLayout layout = m3::param_layout(cfg);
  const std::string path = dir.file("ckpt.h5");
  write_checkpoint(path, cfg, tiny_meta(cfg), random_state(layout, 3), false);
  const std::string before = slurp(path);
  const std::string msg = error_of(
      [&] { write_checkpoint(path, cfg, tiny_meta(cfg), random_state(layout, 4), false); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("file exists"), std::string::npos) << msg;
  EXPECT_EQ(slurp(path), before);
  CheckpointMeta m = tiny_meta(cfg);
  m.step = 43;
  write_checkpoint(path, cfg, m, random_state(layout, 4), true);
  EXPECT_EQ(read_checkpoint(path, nullptr, nullptr).step, 43);
  for (const auto& e : fs::directory_iterator(dir.str()))
    EXPECT_EQ(e.path().filename(), "ckpt.h5") << "a temporary was left: " << e.path();
}

TEST(Checkpoint, WriteChecksBuffersAndSettings) {
  TempDir dir;
  const Config cfg = tiny_cfg();
  const ParamLayout layout = m3::param_layout(cfg);
  const std::string path = dir.file("ckpt.h5");
  TrainState st = random_state(layout, 5);
  st.m.pop_back();
  EXPECT_NE(error_of([&] { write_checkpoint(path, cfg, tiny_meta(cfg), st, false); })
                .find("/optimizer/m buffer has the wrong size"),
            std::string::npos);
  st = random_state(layout, 5);
  CheckpointMeta m = tiny_meta(cfg);
  m.settings[0].second = "16";  // d_model
  EXPECT_NE(error_of([&] { write_checkpoint(path, cfg, m, st, false); })
                .find("setting 'd_model' disagrees with the model config"),
            std::string::npos);
  m = tiny_meta(cfg);
  m.settings[0].second = "8.0";  // the same number, but read_checkpoint wants an integer
  EXPECT_NE(error_of([&] { write_checkpoint(path, cfg, m, st, false); })
                .find("setting 'd_model' is not an integer"),
            std::string::npos);
  m = tiny_meta(cfg);
  m.settings.erase(m.settings.begin() + 12);  // vocab_size
  EXPECT_NE(error_of([&] { write_checkpoint(path, cfg, m, st, false); })
                .find("no setting 'vocab_size'"),
            std::string::npos);
  m = tiny_meta(cfg);
  m.settings.emplace_back("lr rate", "1");
  EXPECT_NE(error_of([&] { write_checkpoint(path, cfg, m, st, false); }).find("'lr rate'"),
            std::string::npos);
  m = tiny_meta(cfg);
  m.settings.emplace_back("step", "1");
  EXPECT_NE(error_of([&] { write_checkpoint(path, cfg, m, st, false); }).find("'step'"),
            std::string::npos);
  st.v[0] = NAN;
  const std::string msg = error_of([&] { write_checkpoint(path, cfg, tiny_meta(cfg), st, false); });
  EXPECT_NE(msg.find("/optimizer/v/input_proj_w"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(path));
}

// The helper below is a valid checkpoint, and each group comes back into its own buffer: the
// round trip through write_checkpoint cannot tell /optimizer/m from /optimizer/v, a file laid
// out independently of it can. (v ≥ 0 here, as Adam's second moment is, so that reading the
// two moments swapped would not be refused on other grounds.)
TEST(Checkpoint, HandWrittenFileReadsBackEachGroupIntoItsOwnBuffer) {
  TempDir dir;
  const Config cfg = tiny_cfg();
  const ParamLayout layout = m3::param_layout(cfg);
  TrainState st = random_state(layout, 6);
  for (float& x : st.v) x = std::abs(x);
  write_by_hand(dir.file("a.h5"), cfg, tiny_meta(cfg), st, {});
  TrainState back;
  EXPECT_EQ(read_checkpoint(dir.file("a.h5"), nullptr, &back).step, 42);
  const std::pair<const char*, std::pair<const std::vector<float>*, const std::vector<float>*>>
      bufs[] = {{"weights", {&st.params, &back.params}},
                {"m", {&st.m, &back.m}},
                {"v", {&st.v, &back.v}}};
  for (const auto& [name, ab] : bufs) {
    const auto& [a, b] = ab;
    ASSERT_EQ(b->size(), static_cast<std::size_t>(layout.total)) << name;
    for (Idx i = 0; i < layout.total; ++i) {
      const auto k = static_cast<std::size_t>(i);
      ASSERT_EQ(bits((*b)[k]), in_a_slot(layout, i) ? bits((*a)[k]) : 0u)
          << name << " index " << i;
    }
  }
}

// And the other way: write_checkpoint puts the first moment under /optimizer/m and the second
// under /optimizer/v, read back here with the HDF5 reader alone.
TEST(Checkpoint, WrittenMomentsSitInTheirOwnGroups) {
  TempDir dir;
  const Config cfg = tiny_cfg();
  const ParamLayout layout = m3::param_layout(cfg);
  TrainState st = random_state(layout, 8);
  for (float& x : st.v) x = std::abs(x);
  write_checkpoint(dir.file("a.h5"), cfg, tiny_meta(cfg), st, false);
  const m3::h5::Reader r(dir.file("a.h5"));
  const std::pair<const char*, const std::vector<float>*> groups[] = {
      {"/weights", &st.params}, {"/optimizer/m", &st.m}, {"/optimizer/v", &st.v}};
  for (const auto& [g, buf] : groups)
    for (const ParamSlot& s : layout.slots) {
      const std::string p = std::string(g) + "/" + s.name;
      const Tensor t = r.read(p);
      ASSERT_EQ(t.data.size(), static_cast<std::size_t>(s.size)) << p;
      for (Idx i = 0; i < s.size; ++i)
        ASSERT_EQ(bits(static_cast<float>(t.data[static_cast<std::size_t>(i)])),
                  bits((*buf)[static_cast<std::size_t>(s.offset + i)]))
            << p << " [" << i << "]";
    }
}

// A checkpoint of tiny_cfg() written by hand with one defect, and the error reading it gives.
class CheckpointDefect : public ::testing::Test {
 protected:
  std::string read_error(const Defect& d, std::uint64_t seed) {
    write_by_hand(path, cfg, tiny_meta(cfg), random_state(m3::param_layout(cfg), seed), d);
    return error_of([&] { read_checkpoint(path, nullptr, nullptr); });
  }
  TempDir dir;
  const Config cfg = tiny_cfg();
  const std::string path = dir.file("a.h5");
};

TEST_F(CheckpointDefect, MissingDatasetIsNamed) {
  Defect d;
  d.omit = "/optimizer/v/L1/dt_bias";
  const std::string msg = read_error(d, 7);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing dataset '/optimizer/v/L1/dt_bias'"), std::string::npos) << msg;
}

// A loss scale that is 0, negative or not finite would make every later step's gradient factor
// meaningless: refused on reading, as on writing.
TEST_F(CheckpointDefect, ALossScaleNotFiniteAndPositiveIsRefused) {
  for (const double bad : {0.0, -1.0, HUGE_VAL, std::nan("")}) {
    SCOPED_TRACE(bad);
    CheckpointMeta meta = tiny_meta(cfg);
    meta.loss_scale = bad;
    write_by_hand(path, cfg, meta, random_state(m3::param_layout(cfg), 3), {});
    const std::string msg = error_of([&] { read_checkpoint(path, nullptr, nullptr); });
    EXPECT_NE(msg.find("/meta loss_scale must be finite and > 0"), std::string::npos) << msg;
  }
}

TEST_F(CheckpointDefect, MisShapedDatasetIsNamed) {
  Defect d;
  d.reshape = "/weights/L1/in_proj_w";
  const std::string msg = read_error(d, 8);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("/weights/L1/in_proj_w"), std::string::npos) << msg;
  EXPECT_NE(msg.find(m3::shape_str({8, cfg.in_proj_dim()})), std::string::npos) << msg;
}

TEST_F(CheckpointDefect, NonFiniteAndExtraDatasetsAreNamed) {
  Defect d;
  d.nan_in = "/optimizer/m/head_w";
  std::string msg = read_error(d, 9);
  EXPECT_NE(msg.find("/optimizer/m/head_w"), std::string::npos) << msg;
  d = {};
  d.extra = "/weights/L2/in_proj_w";  // a layer this config does not have
  msg = read_error(d, 9);
  EXPECT_NE(msg.find("unexpected dataset '/weights/L2/in_proj_w'"), std::string::npos) << msg;
}

TEST_F(CheckpointDefect, WrongKindOrSchemaIsAnError) {
  Defect d;
  d.kind = "golden";
  std::string msg = read_error(d, 10);
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("not a checkpoint: /meta kind is 'golden'"), std::string::npos) << msg;
  d = {};
  d.schema = 2;
  msg = read_error(d, 10);
  EXPECT_NE(msg.find("checkpoint schema version 2 found, version 1 expected"), std::string::npos)
      << msg;
  {  // no kind at all (a golden file, say)
    m3::h5::Writer w(path, true);
    w.group("/meta");
    w.attr("/meta", "schema_version", 1);
    w.commit();
  }
  msg = error_of([&] { read_checkpoint(path, nullptr, nullptr); });
  EXPECT_NE(msg.find("not a checkpoint: /meta has no 'kind' attribute"), std::string::npos) << msg;
}

TEST(Checkpoint, ConfigSettingsRoundTrip) {
  Config c = tiny_cfg();
  c.a_floor = 1.0 / 3.0;
  c.rope_fraction = 1.0;
  c.is_outproj_norm = true;
  const Settings s = config_settings(c);
  ASSERT_EQ(s.size(), 13u);
  EXPECT_EQ(s.front().first, "d_model");
  EXPECT_EQ(s.back().first, "vocab_size");
  const Config back = config_from_settings(s);
  EXPECT_EQ(std::memcmp(&back.a_floor, &c.a_floor, sizeof(double)), 0);
  EXPECT_EQ(config_settings(back), s);
  EXPECT_TRUE(back.is_outproj_norm);
  Settings missing = s;
  missing.erase(missing.begin() + 3);  // headdim
  EXPECT_NE(error_of([&] { config_from_settings(missing, "f.h5"); })
                .find("f.h5: no setting 'headdim'"),
            std::string::npos);
  EXPECT_EQ(exact_double(0.1), "0.1");
  EXPECT_EQ(std::strtod(exact_double(0.1 + std::ldexp(1.0, -40)).c_str(), nullptr),
            0.1 + std::ldexp(1.0, -40));
}

TEST(Checkpoint, ResumeMismatchNamesTheFirstDifferingSettingAndTheData) {
  const Config cfg = tiny_cfg();
  const CheckpointMeta saved = tiny_meta(cfg);
  CheckpointMeta now = saved;
  EXPECT_EQ(resume_mismatch(saved, now), "");
  now.step = 0;          // not a setting: the step, loss scale, revision may differ
  now.loss_scale = 1.0;
  now.git_revision = "other";
  EXPECT_EQ(resume_mismatch(saved, now), "");
  auto set = [](CheckpointMeta& m, const std::string& name, const std::string& v) {
    for (auto& kv : m.settings)
      if (kv.first == name) kv.second = v;
  };
  set(now, "lr", "1e-3");  // the same number
  EXPECT_EQ(resume_mismatch(saved, now), "");
  set(now, "seed", "8");
  set(now, "lr", "0.002");
  EXPECT_EQ(resume_mismatch(saved, now),
            "resume: --lr differs from the checkpoint's: checkpoint 0.001, now 0.002");
  now = saved;
  now.settings.emplace_back("val_fraction", "0.05");
  EXPECT_EQ(resume_mismatch(saved, now),
            "resume: --val-fraction differs from the checkpoint's: checkpoint not set, now 0.05");
  // Settings named by the option that sets them, never by an internal key.
  for (const auto& [setting, option] :
       std::vector<std::pair<std::string, std::string>>{{"d_model", "--d-model"},
                                                        {"n_layers", "--layers"},
                                                        {"precision", "--dtype"},
                                                        {"is_outproj_norm", "--outproj-norm"},
                                                        {"grad_accum", "--grad-accum"},
                                                        {"n_max", "--task-opt n_max"}}) {
    CheckpointMeta was, is;
    was.settings = {{setting, "1"}};
    is.settings = {{setting, "7"}};
    EXPECT_EQ(resume_mismatch(was, is),
              "resume: " + option + " differs from the checkpoint's: checkpoint 1, now 7");
  }
  now = saved;
  now.data_hash = 0x0123456789abcdefULL;
  const std::string msg = resume_mismatch(saved, now);
  EXPECT_EQ(msg.find("resume: the data file differs from the one the checkpoint was trained on"),
            0u)
      << msg;
  EXPECT_NE(msg.find("fedcba9876543210"), std::string::npos) << msg;
  EXPECT_NE(msg.find("0123456789abcdef"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1234567 bytes"), std::string::npos) << msg;
}

// ---- RunDir ---------------------------------------------------------------------------------

TEST(RunDir, CreatesANewFolderAndWritesConfig) {
  TempDir tmp;
  const std::string out = tmp.file("run/nested");
  RunDir rd(out, false, false);
  EXPECT_TRUE(fs::is_directory(out));
  rd.write_config("lr = 0.001\nsteps = 100\n");
  EXPECT_EQ(slurp(rd.path("config.txt")), "lr = 0.001\nsteps = 100\n");
  EXPECT_EQ(rd.checkpoint_path(120), (fs::path(out) / "ckpt-00000120.h5").string());
  EXPECT_EQ(rd.checkpoint_path(123456789), (fs::path(out) / "ckpt-123456789.h5").string());
  EXPECT_NO_THROW(RunDir(tmp.file("empty_is_fine"), false, false));
}

TEST(RunDir, RefusesAFolderHoldingAnotherRunAndForceLeavesForeignFiles) {
  TempDir tmp;
  const fs::path out = tmp.file("run");
  fs::create_directories(out);
  const char* run_files[] = {"config.txt", "metrics.csv", "loss.png", "ckpt-00000010.h5",
                             "ckpt-00000020.h5", "ckpt-00000020.h5.tmp.123.0",
                             "metrics.csv.tmp.99", "loss.gp.tmp.77", "step_times.csv",
                             "step_times.png", "step_times.log.tmp.5"};
  const char* foreign[] = {"notes.txt", "ckpt-best.h5", "config.txt.bak", "data.bin"};
  for (const char* f : run_files) touch(out / f);
  for (const char* f : foreign) touch(out / f, "keep me");
  fs::create_directories(out / "ckpt-00000030.h5");  // a folder by a run file's name stays

  const std::string msg = error_of([&] { RunDir(out.string(), false, false); });
  EXPECT_NE(msg.find("--out " + out.string() +
                     " holds another run (use --resume FILE to continue it or --force to start "
                     "over)"),
            std::string::npos)
      << msg;
  for (const char* f : run_files) EXPECT_TRUE(fs::exists(out / f)) << f;

  RunDir rd(out.string(), false, true);
  for (const char* f : run_files) EXPECT_FALSE(fs::exists(out / f)) << f;
  for (const char* f : foreign) EXPECT_EQ(slurp((out / f).string()), "keep me") << f;
  EXPECT_TRUE(fs::is_directory(out / "ckpt-00000030.h5"));
}

TEST(RunDir, OtherFolderRules) {
  TempDir tmp;
  // a non-empty folder without a run: refused without --force, kept with it
  const fs::path busy = tmp.file("busy");
  fs::create_directories(busy);
  touch(busy / "README");
  EXPECT_NE(error_of([&] { RunDir(busy.string(), false, false); }).find("is not empty"),
            std::string::npos);
  EXPECT_NO_THROW(RunDir(busy.string(), false, true));
  EXPECT_TRUE(fs::exists(busy / "README"));
  // a file where the folder should be
  touch(tmp.file("plain"));
  EXPECT_NE(error_of([&] { RunDir(tmp.file("plain"), false, true); })
                .find("exists and is not a directory"),
            std::string::npos);
  EXPECT_NE(error_of([&] { RunDir(tmp.file("plain"), true, false); })
                .find("exists and is not a directory"),
            std::string::npos);
  // resume needs an existing run
  EXPECT_NE(error_of([&] { RunDir(tmp.file("nothing"), true, false); }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([&] { RunDir(busy.string(), true, false); }).find("holds no run"),
            std::string::npos);
  touch(busy / "config.txt");
  EXPECT_NO_THROW(RunDir(busy.string(), true, false));
}

namespace {
RunDir::Row row(Idx step) {
  RunDir::Row r;
  r.step = step;
  r.loss = 3.0 / static_cast<double>(step);
  if (step % 5 == 0) r.val_loss = 3.5 / static_cast<double>(step);
  if (step % 5 == 0) r.accuracy = 0.5;
  r.lr = 1e-3 * static_cast<double>(step) / 10.0;
  r.grad_norm = 0.25 * static_cast<double>(step);
  r.tokens_per_s = 1000.0;  // a test must not depend on timing
  r.loss_scale = 65536;
  r.skipped = step / 4;
  if (step == 10) r.verify_pct = 12.5;
  return r;
}
}  // namespace

TEST(RunDir, MetricsRowsAreExactAndHaveEmptyCells) {
  RunDir::Row r;
  r.step = 3;
  r.loss = 0.1 + std::ldexp(1.0, -40);
  r.lr = 0.001;
  r.grad_norm = 1.5;
  r.tokens_per_s = 1234.56;
  r.loss_scale = 65536;
  r.skipped = 0;
  const std::string line = RunDir::format_row(r);
  EXPECT_EQ(line, exact_double(r.loss).insert(0, "3,") + ",,,0.001,1.5,1234.6,65536,0,");
  EXPECT_EQ(std::strtod(line.c_str() + 2, nullptr), r.loss);
  r.val_loss = 2.0;
  r.accuracy = 0.75;
  r.verify_pct = 3.25;
  EXPECT_EQ(RunDir::format_row(r).substr(line.find(",,")),
            ",2,0.75,0.001,1.5,1234.6,65536,0,3.25");
}

TEST(RunDir, MetricsAreTruncatedOnResumeSoKPlusRestEqualsStraight) {
  TempDir tmp;
  std::string straight;
  {
    RunDir rd(tmp.file("straight"), false, false);
    rd.open_metrics(0);
    for (Idx s = 1; s <= 10; ++s) rd.append(row(s));
    straight = slurp(rd.path("metrics.csv"));
  }
  EXPECT_EQ(straight.substr(0, straight.find('\n')), kMetricsHeader);
  {
    RunDir rd(tmp.file("resumed"), false, false);
    rd.write_config("# run-id = " + rd.run_id() + "\n");  // what the trainer writes
    rd.open_metrics(0);
    for (Idx s = 1; s <= 8; ++s) rd.append(row(s));  // the run went past its checkpoint at 6
  }
  // Each run has its own id in the last cell of every row: compare the rows without it.
  auto without_ids = [](const std::string& text) {
    std::string out, line;
    std::istringstream in(text);
    while (std::getline(in, line)) out += line.substr(0, line.rfind(',')) + "\n";
    return out;
  };
  // a torn row, as a killed process leaves it
  std::ofstream(tmp.file("resumed/metrics.csv"), std::ios::app) << "9,0.33";
  {
    RunDir rd(tmp.file("resumed"), true, false);
    rd.open_metrics(6);
    const std::string kept = slurp(rd.path("metrics.csv"));
    EXPECT_EQ(std::count(kept.begin(), kept.end(), '\n'), 7);  // header + rows 1..6
    for (Idx s = 7; s <= 10; ++s) rd.append(row(s));
    EXPECT_EQ(without_ids(slurp(rd.path("metrics.csv"))), without_ids(straight));
  }
  // a file that is not ours is refused, not rewritten
  touch(tmp.file("resumed/metrics.csv"), "a,b\n1,2\n");
  RunDir rd(tmp.file("resumed"), true, false);
  EXPECT_NE(error_of([&] { rd.open_metrics(3); }).find("line 1 is not the metrics header"),
            std::string::npos);
  EXPECT_EQ(slurp(tmp.file("resumed/metrics.csv")), "a,b\n1,2\n");
}

TEST(RunDir, PruneKeepsTheNewestKAndTheFinal) {
  TempDir tmp;
  RunDir rd(tmp.file("run"), false, false);
  for (Idx s : {10, 20, 30, 40, 50, 60}) touch(rd.checkpoint_path(s));
  touch(rd.path("ckpt-best.h5"));
  touch(rd.path("ckpt-00000010.h5.tmp.5.0"));
  rd.prune_checkpoints(2, 20);
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(tmp.file("run")))
    left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"ckpt-00000010.h5.tmp.5.0", "ckpt-00000020.h5",
                                            "ckpt-00000050.h5", "ckpt-00000060.h5",
                                            "ckpt-best.h5", "run.lock"}))
      << "run.lock: the live RunDir's lock, never a checkpoint";
  rd.prune_checkpoints(1, -1);
  EXPECT_FALSE(fs::exists(rd.checkpoint_path(20)));
  EXPECT_FALSE(fs::exists(rd.checkpoint_path(50)));
  EXPECT_TRUE(fs::exists(rd.checkpoint_path(60)));
  EXPECT_NE(error_of([&] { rd.prune_checkpoints(0, -1); }).find("--keep must be >= 1"),
            std::string::npos);
}

TEST(RunDir, PlotLossDrawsAPng) {
  // scripts/setup.sh installs gnuplot-nox; a machine without it (the GPU machine) gets the
  // note instead, tested below.
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "gnuplot is not installed here (apt-get install gnuplot-nox)";
  TempDir tmp;
  RunDir rd(tmp.file("run"), false, false);
  EXPECT_NE(rd.plot_loss().find("loss.png not drawn"), std::string::npos);  // no metrics yet
  rd.open_metrics(0);
  for (Idx s = 1; s <= 20; ++s) rd.append(row(s));
  const std::string note = rd.plot_loss();
  ASSERT_EQ(note, "");
  const std::string png = slurp(rd.path("loss.png"));
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  for (const auto& e : fs::directory_iterator(tmp.file("run")))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

TEST(RunDir, PlotLossWithoutGnuplotIsANote) {
  TempDir tmp;
  RunDir rd(tmp.file("run"), false, false);
  rd.open_metrics(0);
  rd.append(row(1));
  const char* old = std::getenv("PATH");
  const std::string saved = old ? old : "";
  ::setenv("PATH", tmp.file("no-such-bin").c_str(), 1);
  const std::string note = rd.plot_loss();
  ::setenv("PATH", saved.c_str(), 1);
  EXPECT_EQ(note, "loss.png not drawn: gnuplot not found (apt-get install gnuplot-nox)");
  EXPECT_FALSE(fs::exists(rd.path("loss.png")));
}

// step_times.csv: a row per step, four decimals; resuming at step k + 1 keeps the earlier rows
// of steps <= k and replaces the later ones, so a timed run and its resumed segment read as one.
TEST(RunDir, StepTimesAreARowPerStepAndResumeKeepsTheStepsBefore) {
  using m3::train::StepTimes;
  auto st = [](double f, double b, double o, double p, bool next) {
    return StepTimes{f, f / 10, b, o, p, next};  // forward, uploads, backward, optimizer, period
  };
  TempDir tmp;
  const std::string out = tmp.file("run");
  {
    RunDir rd(out, false, false);
    rd.write_config("x = 1\n");
    rd.write_step_times({st(2.5, 4.25, 0.125, 7.0, true), st(2.6, 4.3, 0.11, 7.1, true),
                         st(2.7, 4.4, 0.1, 7.3, false)},
                        1);
    EXPECT_EQ(slurp(rd.path("step_times.csv")),
              std::string(m3::train::kStepTimesHeader) +
                  "\n1,2.5000,0.2500,4.2500,0.1250,7.0000,1\n2,2.6000,0.2600,4.3000,0.1100,7.1000,1\n"
                  "3,2.7000,0.2700,4.4000,0.1000,7.3000,0\n");
  }
  {
    RunDir resumed(out, true, false);  // from the checkpoint of step 1: steps 2 and 3 again
    resumed.write_step_times({st(3, 5, 0.2, 8.5, true), st(3.1, 5.1, 0.2, 8.4, false)}, 2);
    EXPECT_EQ(slurp(resumed.path("step_times.csv")),
              std::string(m3::train::kStepTimesHeader) +
                  "\n1,2.5000,0.2500,4.2500,0.1250,7.0000,1\n2,3.0000,0.3000,5.0000,0.2000,8.5000,1\n"
                  "3,3.1000,0.3100,5.1000,0.2000,8.4000,0\n");
  }  // the resumed run ends (and gives its folder back) before the next one starts
  // A new run over the same folder with --force starts the file afresh.
  RunDir fresh(out, false, true);
  EXPECT_FALSE(fs::exists(fresh.path("step_times.csv")));
  fresh.write_step_times({st(1, 2, 0.5, 4, false)}, 1);
  EXPECT_EQ(slurp(fresh.path("step_times.csv")),
            std::string(m3::train::kStepTimesHeader) + "\n1,1.0000,0.1000,2.0000,0.5000,4.0000,0\n");
  EXPECT_NE(error_of([&] { fresh.write_step_times({}, 0); }).find("the first step must be >= 1"),
            std::string::npos);
}

TEST(RunDir, AMalformedStepTimesFileIsAnErrorNamingTheLineAndIsLeftAlone) {
  TempDir tmp;
  const std::string out = tmp.file("run");
  { RunDir(out, false, false).write_config("x = 1\n"); }
  const fs::path p = fs::path(out) / "step_times.csv";
  const std::string bad_row = std::string(m3::train::kStepTimesHeader) + "\n1,2.0,3.0\n";
  touch(p, bad_row);
  RunDir rd(out, true, false);
  std::string msg = error_of([&] { rd.write_step_times({}, 2); });
  EXPECT_NE(msg.find("line 2 is not a step times row"), std::string::npos) << msg;
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_EQ(slurp(p.string()), bad_row);
  touch(p, "step,fwd\n1,2\n");
  msg = error_of([&] { rd.write_step_times({}, 2); });
  EXPECT_NE(msg.find("line 1 is not the step times header"), std::string::npos) << msg;
  EXPECT_NE(rd.plot_step_times().find("step_times.png not drawn: "), std::string::npos);
}

TEST(RunDir, PlotStepTimesDrawsAPngAndSaysWhyWhenItCannot) {
  TempDir tmp;
  RunDir rd(tmp.file("run"), false, false);
  EXPECT_EQ(rd.plot_step_times(), "step_times.png not drawn: no step_times.csv yet");
  rd.write_step_times({}, 1);
  EXPECT_EQ(rd.plot_step_times(), "step_times.png not drawn: step_times.csv has no rows yet");
  std::vector<m3::train::StepTimes> t(12);
  for (size_t k = 0; k < t.size(); ++k) {
    t[k].forward_ms = 2.0 + 0.01 * static_cast<double>(k);
    t[k].uploads_ms = 0.1;
    t[k].backward_ms = 4.0;
    t[k].optimizer_ms = 0.1;
    t[k].period_ms = 6.2 + 0.01 * static_cast<double>(k);
    t[k].to_next = k + 1 < t.size();
  }
  rd.write_step_times(t, 1);
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "gnuplot is not installed here (apt-get install gnuplot-nox)";
  ASSERT_EQ(rd.plot_step_times(), "");
  const std::string png = slurp(rd.path("step_times.png"));
  ASSERT_GT(png.size(), 1000u);
  EXPECT_EQ(png.substr(0, 8), std::string("\x89PNG\r\n\x1a\n", 8));
  for (const auto& e : fs::directory_iterator(tmp.file("run")))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
}

// ---- Progress -------------------------------------------------------------------------------

TEST(Progress, PlainModePrintsEveryLogEveryStepsAndTheLast) {
  std::ostringstream os;
  double t = 0;
  Progress p(10, 4, false, os, [&] { return t; });
  for (Idx s = 1; s <= 10; ++s) {
    t = static_cast<double>(s);
    p.update(s, 3.0 - 0.1 * static_cast<double>(s),
             s == 5 ? std::optional<double>(2.5) : std::nullopt, 1e-3, 1000.4);
    if (s == 6) p.note("checkpoint written: ckpt-00000006.h5");
  }
  p.finish("done: 10 steps");
  EXPECT_EQ(os.str(),
            "step 4/10  loss 2.6000 (avg 2.7436)  val -  lr 1.00e-03  1000 tok/s  elapsed 0:00:04  eta 0:00:06\n"
            "checkpoint written: ckpt-00000006.h5\n"
            "step 8/10  loss 2.2000 (avg 2.5231)  val 2.5000  lr 1.00e-03  1000 tok/s  elapsed 0:00:08  eta 0:00:02\n"
            "step 10/10  loss 2.0000 (avg 2.4079)  val 2.5000  lr 1.00e-03  1000 tok/s  elapsed 0:00:10  eta 0:00:00\n"
            "done: 10 steps\n");
}

TEST(Progress, ResumedRunEstimatesFromItsOwnSteps) {
  std::ostringstream os;
  double t = 100;
  Progress p(12, 2, false, os, [&] { return t; });
  t = 103;  // step 7 took 3 s
  p.update(7, 1.0, std::nullopt, 5e-4, 20);
  t = 106;
  p.update(8, 1.0, 0.75, 5e-4, 20);  // 6 s for 2 steps, 4 to go
  EXPECT_EQ(os.str(),
            "step 8/12  loss 1.0000 (avg 1.0000)  val 0.7500  lr 5.00e-04  20 tok/s  elapsed 0:00:06  eta 0:00:12\n");
}

namespace {
// The tty tests' status lines: 3 steps at 10 tok/s, lr 1e-3, loss 1, the steps at t = 1 and 1.01.
const std::string kTtyStep1 =
    "step 1/3  loss 1.0000 (avg 1.0000)  val -  lr 1.00e-03  10 tok/s  elapsed 0:00:01  eta 0:00:02";
const std::string kTtyStep2 =
    "step 2/3  loss 1.0000 (avg 1.0000)  val -  lr 1.00e-03  10 tok/s  elapsed 0:00:01  eta 0:00:01";
}  // namespace

TEST(Progress, TtyModeRedrawsOneLine) {
  std::ostringstream os;
  double t = 0;
  Progress p(3, 100, true, os, [&] { return t; });
  const std::string l3 = "step 3/3  loss 1.0000 (avg 1.0000)  val -  lr 1.00e-03  10 tok/s  elapsed 0:00:02  eta 0:00:00";
  t = 1;
  p.update(1, 1.0, std::nullopt, 1e-3, 10);
  t = 1.01;  // within 0.1 s of the last draw: not drawn
  p.update(2, 1.0, std::nullopt, 1e-3, 10);
  EXPECT_EQ(os.str(), "\r" + kTtyStep1 + "\x1b[K");
  p.note("a note");  // the line cleared, the note, the latest state drawn again
  t = 2;
  p.update(3, 1.0, std::nullopt, 1e-3, 10);
  p.finish("summary");
  EXPECT_EQ(os.str(), "\r" + kTtyStep1 + "\x1b[K" + "\r\x1b[K" + "a note\n" + "\r" + kTtyStep2 +
                          "\x1b[K" + "\r" + l3 + "\x1b[K" + "\nsummary\n");
}

TEST(Progress, BusyShowsWhatThePauseIsDoingUntilTheNextUpdate) {
  std::ostringstream os;
  double t = 0;
  Progress p(3, 100, true, os, [&] { return t; });
  t = 1;
  p.update(1, 1.0, std::nullopt, 1e-3, 10);
  p.busy("checking");
  t = 1.01;  // within 0.1 s of the last draw, but the suffix must go: drawn
  p.update(2, 1.0, std::nullopt, 1e-3, 10);
  EXPECT_EQ(os.str(), "\r" + kTtyStep1 + "\x1b[K" + "\r" + kTtyStep1 + "  [checking]\x1b[K" + "\r" +
                          kTtyStep2 + "\x1b[K");
  std::ostringstream plain;  // a log gets no transient text
  Progress q(3, 1, false, plain, [&] { return t; });
  q.busy("checking");
  EXPECT_EQ(plain.str(), "");
}

// The smoothed loss: a_k = 0.95·a_{k−1} + 0.05·loss_k, divided by 1 − 0.95^k (steps 1–4 of
// losses 2.9, 2.8, 2.7, 2.6: Σ 0.05·0.95^(4−k)·loss_k / (1 − 0.95^4) = 2.7436, not the plain
// mean 2.75 nor the last loss).
TEST(Progress, TheAverageIsTheDebiasedMovingAverageOfTheLosses) {
  std::ostringstream os;
  double t = 0;
  Progress p(4, 4, false, os, [&] { return t; });
  for (Idx s = 1; s <= 4; ++s) p.update(s, 3.0 - 0.1 * static_cast<double>(s), std::nullopt, 1e-3, 1);
  EXPECT_NE(os.str().find("loss 2.6000 (avg 2.7436)"), std::string::npos) << os.str();
}

// A resumed run's elapsed time goes on from the checkpoint's (set_elapsed_before), while the
// estimate of the time left comes from this process's steps alone.
TEST(Progress, ElapsedContinuesFromTheTimeBeforeAResume) {
  std::ostringstream os;
  double t = 50;
  Progress p(12, 1, false, os, [&] { return t; });
  p.set_elapsed_before(3600);
  t = 52;
  p.update(11, 1.0, std::nullopt, 1e-3, 1);
  EXPECT_NE(os.str().find("elapsed 1:00:02  eta 0:00:02"), std::string::npos) << os.str();
  EXPECT_DOUBLE_EQ(p.elapsed(), 3602);
}

// On a terminal narrower than the status, fields go in the documented order (tok/s, lr,
// elapsed, avg), then the gaps shrink, then the text is cut; a log keeps every field.
TEST(Progress, ANarrowTerminalDropsFieldsInOrderAndALogKeepsThemAll) {
  const std::string full =
      "step 1/3  loss 1.0000 (avg 1.0000)  val -  lr 1.00e-03  10 tok/s  elapsed 0:00:01  eta 0:00:02";
  auto line = [](int width, bool tty) {
    std::ostringstream os;
    double t = 0;
    Progress p(3, 1, tty, os, [&] { return t; });
    p.set_width(width);
    t = 1;
    p.update(1, 1.0, std::nullopt, 1e-3, 10);
    std::string s = os.str();
    if (tty) s = s.substr(1, s.size() - 1 - 3);  // without "\r" and "\x1b[K"
    else s.pop_back();                           // without the newline
    return s;
  };
  EXPECT_EQ(line(0, true), full);
  EXPECT_EQ(line(static_cast<int>(full.size()) + 1, true), full);
  EXPECT_EQ(line(90, true),
            "step 1/3  loss 1.0000 (avg 1.0000)  val -  lr 1.00e-03  elapsed 0:00:01  eta 0:00:02");
  EXPECT_EQ(line(80, true), "step 1/3  loss 1.0000 (avg 1.0000)  val -  elapsed 0:00:01  eta 0:00:02");
  EXPECT_EQ(line(60, true), "step 1/3  loss 1.0000 (avg 1.0000)  val -  eta 0:00:02");
  EXPECT_EQ(line(44, true), "step 1/3  loss 1.0000  val -  eta 0:00:02");
  EXPECT_EQ(line(40, true), "step 1/3 loss 1.0000 val - eta 0:00:02");
  EXPECT_EQ(line(36, true), "step 1/3 loss 1.0000 val - eta 0:00");
  EXPECT_EQ(line(20, true), "step 1/3 loss 1.000");
  for (int w : {20, 36, 40, 44, 60, 80, 90}) EXPECT_LT(static_cast<int>(line(w, true).size()), w) << w;
  EXPECT_EQ(line(20, false), full);
}

// A tty's notes and summary are broken at spaces to its width; a log's stay whole.
TEST(Progress, ATerminalsNotesAreBrokenToItsWidthALogsAreNot) {
  const std::string note = "train: a note of some length that a narrow terminal cannot hold";
  std::ostringstream tty, log;
  Progress t(3, 1, true, tty, [] { return 0.0; }), l(3, 1, false, log, [] { return 0.0; });
  t.set_width(30);
  l.set_width(30);
  t.note(note);
  t.finish(note);
  l.note(note);
  EXPECT_EQ(tty.str(), "train: a note of some length\n  that a narrow terminal\n  cannot hold\n"
                       "train: a note of some length\n  that a narrow terminal\n  cannot hold\n");
  EXPECT_EQ(log.str(), note + "\n");
}

TEST(Progress, Hms) {
  EXPECT_EQ(Progress::hms(0), "0:00:00");
  EXPECT_EQ(Progress::hms(3725.4), "1:02:05");
  EXPECT_EQ(Progress::hms(360000), "100:00:00");
  EXPECT_EQ(Progress::hms(NAN), "-:--:--");
}

// ---- StopFlag -------------------------------------------------------------------------------

TEST(Progress, StopFlagFirstSignalOnlySetsTheFlag) {
  StopFlag::reset_for_testing();
  StopFlag::install();
  EXPECT_FALSE(StopFlag::requested());
  ::raise(SIGINT);
  EXPECT_TRUE(StopFlag::requested());
  EXPECT_EQ(StopFlag::signal_number(), SIGINT);
  StopFlag::reset_for_testing();
  StopFlag::install();
  ::raise(SIGTERM);
  EXPECT_TRUE(StopFlag::requested());
  EXPECT_EQ(StopFlag::signal_number(), SIGTERM);
  StopFlag::reset_for_testing();
  EXPECT_FALSE(StopFlag::requested());
}

TEST(Progress, StopFlagSecondSignalRemovesTemporariesAndKills) {
  TempDir tmp;
  const std::string temp = tmp.file("ckpt-00000005.h5.tmp.1.0");
  StopFlag::reset_for_testing();
  EXPECT_EXIT(
      {
        touch(temp);
        const m3::tmp::TempFile guard(temp);
        StopFlag::install();
        ::raise(SIGINT);
        if (!StopFlag::requested() || !fs::exists(temp)) std::_Exit(3);
        ::raise(SIGINT);
        std::_Exit(4);
      },
      ::testing::KilledBySignal(SIGINT), "");
  EXPECT_FALSE(fs::exists(temp)) << "the second signal left the temporary file";
}
