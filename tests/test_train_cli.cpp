// `m3h train`, `m3h sample` and `m3h eval` as a new user meets them, run as a program on the
// CPU reference (TRAINING.md §4, §5, §7; docs/TOOLS.md):
//   resume   --resume RUN alone continues the run from its latest checkpoint with the run's
//            own options and gives the losses of the run straight; a larger --steps extends it
//            (said on the console), a finished run is refused in one line with exit 1, and a
//            refusal names the option the user changed, never a derived setting;
//   device   --device defaults to auto, and without a GPU the note "no GPU found" goes to
//            stderr, never into stdout (the product of sample);
//   defaults a warmup longer than the run is refused when given and cut with a note when
//            defaulted; validation runs every twentieth of the run; the parameter count is in
//            human units; the config line fits COLUMNS; the run's elapsed time goes on after a
//            resume;
//   sample   --checkpoint RUN takes its latest checkpoint, the default prompt works on a task
//            checkpoint, and --help has no raw line break;
//   eval     a checkpoint's loss on its run's validation batches is the run's validation loss,
//            --json - writes it to stdout, another vocabulary is refused;
//   data     several --data files are one text in the order given.
// Each run is tiny (d_model 8, T 16): seconds on two cores.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "device.hpp"
#include "test_io.hpp"

#ifndef M3H_PATH
#error "M3H_PATH must name the m3h executable"
#endif

namespace {

namespace fs = std::filesystem;
using m3::Idx;
using m3::test::CliRun;
using m3::test::count_lines;
using m3::test::slurp;

const char* kModel =
    "--d-model 8 --d-state 4 --headdim 4 --layers 1 --B 2 --T 16 --val-batches 1 --task parity";

class TrainCliUse : public ::testing::Test {
 protected:
  m3::test::TempDir tmp_{"m3_train_cli_"};
  CliRun m3h(const std::string& args) const { return m3::test::run_m3h(args, tmp_.dir, tmp_.dir); }
  fs::path path(const std::string& name) const { return tmp_.dir / name; }
  // The loss column of a run's metrics.csv, as written.
  std::vector<std::string> losses(const std::string& run) const {
    std::ifstream in(path(run) / "metrics.csv");
    std::string line;
    std::getline(in, line);
    std::vector<std::string> out;
    while (std::getline(in, line)) {
      const auto a = line.find(',');
      out.push_back(line.substr(a + 1, line.find(',', a + 1) - a - 1));
    }
    return out;
  }
  static std::string model(const std::string& more) {
    return std::string("train --device cpu ") + kModel + " " + more;
  }
};

TEST_F(TrainCliUse, ResumeWithTheRunFolderAloneContinuesTheRunAsIfStraight) {
  ASSERT_EQ(m3h(model("--steps 6 --warmup 2 --out straight")).status, 0);
  ASSERT_EQ(m3h(model("--steps 6 --warmup 2 --ckpt-every 3 --out parts")).status, 0);
  fs::remove(path("parts") / "ckpt-00000006.h5");  // the latest is now step 3's
  const CliRun r = m3h("train --resume parts");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("resumed at step 3"), std::string::npos) << r.out;
  EXPECT_EQ(losses("parts"), losses("straight"));
  EXPECT_EQ(losses("parts").size(), 6u);
  // The same run again: finished, one line on stderr naming what would extend it; no loss
  // line, no "nan".
  const CliRun again = m3h("train --resume parts");
  EXPECT_EQ(again.status, 1) << again.out << again.err;
  EXPECT_EQ(count_lines(again.err), 1) << again.err;
  EXPECT_NE(again.err.find("m3h train: "), std::string::npos) << again.err;
  EXPECT_NE(again.err.find("finished"), std::string::npos) << again.err;
  EXPECT_NE(again.err.find("--steps"), std::string::npos) << again.err;
  EXPECT_EQ(again.out.find("nan"), std::string::npos) << again.out;
  EXPECT_EQ(losses("parts").size(), 6u);
}

TEST_F(TrainCliUse, ALargerStepsExtendsTheRunAndRefusalsNameTheOptionGiven) {
  ASSERT_EQ(m3h(model("--steps 4 --out r")).status, 0);  // the default warmup, cut to 1
  const CliRun ext = m3h("train --resume r/ckpt-00000004.h5 --steps 8");
  ASSERT_EQ(ext.status, 0) << ext.out << ext.err;
  EXPECT_NE(ext.out.find("extending the run from 4 to 8 steps"), std::string::npos) << ext.out;
  EXPECT_EQ(losses("r").size(), 8u);
  EXPECT_NE(slurp(path("r") / "config.txt").find("steps = 8"), std::string::npos);
  // Changed settings are named by their options; the derived warmup never is.
  for (const auto& [args, needle] : std::vector<std::pair<std::string, std::string>>{
           {"--steps 12 --d-model 16", "--d-model differs"},
           {"--steps 12 --dtype f32", "--dtype differs"},
           {"--steps 12 --task-opt n_max=8", "--task-opt n_max differs"},
           {"--steps 5", "--steps 5 is shorter than the run"}}) {
    const CliRun r = m3h("train --resume r " + args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << ": " << r.err;
    EXPECT_EQ(r.err.find("warmup"), std::string::npos) << r.err;
  }
  const CliRun none = m3h("train --resume nosuch");
  EXPECT_EQ(none.status, 2);
  EXPECT_NE(none.err.find("--resume nosuch: no such checkpoint or run folder"), std::string::npos)
      << none.err;
}

TEST_F(TrainCliUse, TheRunsElapsedTimeGoesOnAfterAResume) {
  ASSERT_EQ(m3h(model("--steps 6 --warmup 2 --ckpt-every 3 --out r")).status, 0);
  const double at3 = m3::train::read_checkpoint(path("r/ckpt-00000003.h5"), nullptr, nullptr).elapsed_s;
  const double at6 = m3::train::read_checkpoint(path("r/ckpt-00000006.h5"), nullptr, nullptr).elapsed_s;
  EXPECT_GT(at3, 0.0);
  EXPECT_GT(at6, at3);
  fs::remove(path("r/ckpt-00000006.h5"));
  ASSERT_EQ(m3h("train --resume r").status, 0);
  const double again = m3::train::read_checkpoint(path("r/ckpt-00000006.h5"), nullptr, nullptr).elapsed_s;
  EXPECT_GT(again, at3) << "the resumed segment starts from the checkpoint's time, not 0";
}

TEST_F(TrainCliUse, WithoutAGpuTheDefaultDeviceFallsBackSayingSoOnStderr) {
  if (m3::gpu::query_device().present) GTEST_SKIP() << "a GPU is present";
  const CliRun r = m3h(std::string("train ") + kModel + " --steps 2 --warmup 1 --out r");
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_EQ(r.err.find("m3h: no GPU found: "), 0u) << r.err;
  EXPECT_EQ(r.out.find("GPU"), std::string::npos) << r.out;
  const CliRun s = m3h("sample --checkpoint r --prompt 01 --tokens 4");
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_EQ(s.out.size(), 7u) << "the prompt, 4 tokens and a newline, nothing else: " << s.out;
  EXPECT_NE(s.err.find("no GPU found"), std::string::npos) << s.err;
  const CliRun gpu = m3h(std::string("train ") + kModel + " --steps 2 --out g --device gpu");
  EXPECT_EQ(gpu.status, 2);
  EXPECT_NE(gpu.err.find("--device gpu: no GPU found"), std::string::npos) << gpu.err;
}

TEST_F(TrainCliUse, AWarmupLongerThanTheRunIsRefusedWhenGivenAndCutWhenDefaulted) {
  const CliRun given = m3h(model("--steps 20 --warmup 30 --out g"));
  EXPECT_EQ(given.status, 2);
  EXPECT_NE(given.err.find("--warmup 30 is longer than the run (--steps 20)"), std::string::npos)
      << given.err;
  EXPECT_FALSE(fs::exists(path("g")));
  const CliRun cut = m3h(model("--steps 20 --out d"));
  ASSERT_EQ(cut.status, 0) << cut.err;
  EXPECT_NE(cut.out.find("warmup 2 step(s), a tenth of the run"), std::string::npos) << cut.out;
  EXPECT_NE(slurp(path("d") / "config.txt").find("warmup = 2\n"), std::string::npos);
  // The peak learning rate (3e-3) at step 2, not at the run's end.
  std::ifstream in(path("d") / "metrics.csv");
  std::string line;
  std::vector<double> lr;
  std::getline(in, line);
  while (std::getline(in, line)) {
    std::stringstream ss(line);
    std::string cell;
    for (int i = 0; i < 5 && std::getline(ss, cell, ','); ++i) {}
    lr.push_back(std::stod(cell));
  }
  ASSERT_EQ(lr.size(), 20u);
  EXPECT_DOUBLE_EQ(lr[1], 3e-3);
  EXPECT_LT(lr[19], lr[1]);
}

TEST_F(TrainCliUse, ValidationRunsEveryTwentiethOfTheRunByDefault) {
  ASSERT_EQ(m3h(model("--steps 40 --warmup 2 --out r")).status, 0);
  std::ifstream in(path("r") / "metrics.csv");
  std::string line;
  std::getline(in, line);
  std::vector<Idx> validated;
  while (std::getline(in, line)) {
    std::stringstream ss(line);
    std::string step, loss, val;
    std::getline(ss, step, ',');
    std::getline(ss, loss, ',');
    std::getline(ss, val, ',');
    if (!val.empty()) validated.push_back(std::stoll(step));
  }
  ASSERT_EQ(validated.size(), 20u);
  for (std::size_t k = 0; k < validated.size(); ++k) EXPECT_EQ(validated[k], 2 * Idx(k + 1));
  EXPECT_NE(slurp(path("r") / "config.txt").find("val-every = 2\n"), std::string::npos);
}

TEST_F(TrainCliUse, TheStartSaysTheParameterCountInUnitsAndFitsColumns) {
  ::setenv("COLUMNS", "60", 1);
  const CliRun r = m3h(model("--steps 2 --warmup 1 --out r"));
  ::unsetenv("COLUMNS");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find(" k parameters"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("parameter floats"), std::string::npos) << r.out;
  // The config line and its continuations: none longer than 60 columns.
  std::istringstream lines(r.out);
  std::string line;
  int config_lines = 0;
  bool in_config = false;
  while (std::getline(lines, line)) {
    in_config = line.rfind("config: ", 0) == 0 || (in_config && line.rfind("  ", 0) == 0);
    if (!in_config) continue;
    ++config_lines;
    EXPECT_LE(line.size(), 60u) << line;
  }
  EXPECT_GE(config_lines, 3) << r.out;
}

TEST_F(TrainCliUse, SampleTakesARunFolderAndItsDefaultPromptWorksOnATask) {
  ASSERT_EQ(m3h(model("--steps 2 --warmup 1 --out r")).status, 0);
  const CliRun s = m3h("sample --device cpu --checkpoint r --tokens 6");
  ASSERT_EQ(s.status, 0) << s.err;
  ASSERT_EQ(s.out.size(), 8u) << s.out;  // one prompt token, 6 generated, a newline
  for (char c : s.out.substr(0, 7)) EXPECT_TRUE(c == '0' || c == '1' || c == '.') << s.out;
  const CliRun help = m3h("sample --help");
  ASSERT_EQ(help.status, 0);
  EXPECT_EQ(help.out.find("(=\n"), std::string::npos) << help.out;
  std::istringstream lines(help.out);
  for (std::string line; std::getline(lines, line);)
    EXPECT_NE(line, "\")") << "a default value printed across two lines";
  fs::create_directories(path("empty"));
  const CliRun none = m3h("sample --device cpu --checkpoint empty");
  EXPECT_EQ(none.status, 2);
  EXPECT_NE(none.err.find("no checkpoint"), std::string::npos) << none.err;
}

// m3h eval on the run's own data, B, T and batch count gives the run's last validation loss
// bit for bit (the same weights, batches and forward); --json - is the same as JSON on stdout.
TEST_F(TrainCliUse, EvalOfACheckpointIsItsRunsValidationLoss) {
  ASSERT_EQ(m3h(model("--steps 4 --warmup 1 --out r")).status, 0);
  std::ifstream in(path("r") / "metrics.csv");
  std::string line, last;
  while (std::getline(in, line)) last = line;
  std::stringstream cells(last);
  std::string step, loss, val;
  std::getline(cells, step, ',');
  std::getline(cells, loss, ',');
  std::getline(cells, val, ',');
  ASSERT_EQ(step, "4");
  const CliRun r = m3h("eval --device cpu --checkpoint r --batches 1 --json -");
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.err.find("m3h eval: r/ckpt-00000004.h5 (step 4) on task parity (the checkpoint's), "
                       "1 batches of 2x16 (cpu, bf16, chunked): loss "),
            std::string::npos) << r.err;
  const std::string key = "\"loss\": ";
  const auto at = r.out.find(key);
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(std::stod(r.out.substr(at + key.size())), std::stod(val)) << r.out;
  EXPECT_NE(r.out.find("\"sequence_accuracy\": "), std::string::npos) << r.out;
  // Another task of the same vocabulary evaluates; a different vocabulary is refused.
  const CliRun other = m3h("eval --device cpu --checkpoint r --task parity --task-opt n_max=8 --T 8");
  EXPECT_EQ(other.status, 0) << other.err;
  EXPECT_NE(other.out.find("on task parity, 8 batches of 2x8"), std::string::npos) << other.out;
  const CliRun vocab = m3h("eval --device cpu --checkpoint r --task modular");
  EXPECT_EQ(vocab.status, 2);
  EXPECT_NE(vocab.err.find("the data's vocabulary is not the model's"), std::string::npos) << vocab.err;
}

// --data A --data B trains on A's bytes then B's, as one text: the checkpoint records the
// concatenation (size and hash), so a resume with the files swapped is refused, and eval on the
// two files equals eval on one file holding both.
TEST_F(TrainCliUse, SeveralDataFilesAreOneTextInTheOrderGiven) {
  std::string a, b;
  for (int i = 0; i < 60; ++i) a += "the quick brown fox jumps over the lazy dog. ";
  for (int i = 0; i < 40; ++i) b += "pack my box with five dozen liquor jugs! ";
  std::ofstream(path("a.txt")) << a;
  std::ofstream(path("b.txt")) << b;
  std::ofstream(path("ab.txt")) << a + b;
  const std::string text =
      "train --device cpu --d-model 8 --d-state 4 --headdim 4 --layers 1 --B 2 --T 16 "
      "--val-batches 1 --warmup 1 ";
  ASSERT_EQ(m3h(text + "--data a.txt --data b.txt --steps 4 --ckpt-every 2 --out r").status, 0);
  const m3::train::CheckpointMeta m =
      m3::train::read_checkpoint(path("r/ckpt-00000004.h5"), nullptr, nullptr);
  EXPECT_EQ(m.data_size, static_cast<Idx>(a.size() + b.size()));
  EXPECT_NE(slurp(path("r") / "config.txt").find("data = a.txt\ndata = b.txt\n"), std::string::npos);
  const CliRun swapped =
      m3h("train --resume r/ckpt-00000002.h5 --config r/config.txt --data b.txt --data a.txt");
  EXPECT_EQ(swapped.status, 2);
  EXPECT_NE(swapped.err.find("the data file differs"), std::string::npos) << swapped.err;
  // The command line's files replace the config's (not added to them): the same bytes in
  // another order.
  const std::string size = std::to_string(a.size() + b.size()) + " bytes";
  EXPECT_NE(swapped.err.find("checkpoint " + size), std::string::npos) << swapped.err;
  EXPECT_NE(swapped.err.find("now " + size), std::string::npos) << swapped.err;
  const CliRun two = m3h("eval --device cpu --checkpoint r --data a.txt --data b.txt");
  const CliRun one = m3h("eval --device cpu --checkpoint r --data ab.txt");
  ASSERT_EQ(two.status, 0) << two.err;
  ASSERT_EQ(one.status, 0) << one.err;
  EXPECT_EQ(two.out.substr(two.out.find("): loss")), one.out.substr(one.out.find("): loss")));
}

}  // namespace
