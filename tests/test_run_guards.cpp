// Runs that cannot be lost or mixed, as `m3h` is driven from a shell (train/run_dir.hpp,
// train/trainer.hpp, tools/cli.hpp): one writer per run folder (run.lock, a live holder named,
// a stale lock taken over); a checkpoint resumes only into its own run and metrics.csv is kept
// gap-free and of one run; no input file is ever an output; nothing is left behind by a run
// that fails before its first step; a run stopped for non-finite values; absurd counts refused
// before any allocation; one-line messages; a run's own config.txt; a full disk.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "error.hpp"
#include "run_dir.hpp"
#include "test_io.hpp"

namespace fs = std::filesystem;

namespace {

#ifdef M3H_PATH
using m3::test::CliRun;
using m3::test::slurp;

// A tiny task model; kTiny adds the counts the size tests override.
const char* kModel = "train --device cpu --d-model 8 --d-state 4 --headdim 4 --task parity";
const std::string kTiny = std::string(kModel) + " --layers 1 --B 2 --T 16 --warmup 1 --val-batches 1";

class RunGuards : public ::testing::Test {
 protected:
  m3::test::TempDir tmp_{"m3_guards_"};
  const fs::path& dir_ = tmp_.dir;
  CliRun m3h(const std::string& args) const { return m3::test::run_m3h(args, dir_, dir_); }
  static int lines(const std::string& s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }
  // Exit 2, one line on stderr holding `needle`.
  CliRun refused(const std::string& args, const std::string& needle) const {
    const CliRun r = m3h(args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out << r.err;
    EXPECT_EQ(lines(r.err), 1) << args << "\n" << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << args << ": " << r.err;
    return r;
  }
  std::string text(const std::string& rel) const { return slurp(dir_ / rel); }
  void write(const std::string& rel, const std::string& s) const {
    std::ofstream(dir_ / rel, std::ios::binary) << s;
  }
};

// ---- 1: one writer per run folder -------------------------------------------------------------

TEST_F(RunGuards, ALiveRunsFolderIsRefusedNamingItsHolderEvenWithForce) {
  fs::create_directories(dir_ / "r");
  const std::string lock = (dir_ / "r" / m3::train::kRunLock).string();
  const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  const std::string holder = "pid 4242 on testhost";
  ASSERT_EQ(::write(fd, holder.data(), holder.size()), static_cast<ssize_t>(holder.size()));
  const std::string run = std::string(kTiny) + " --steps 2 --out r";
  refused(run, "in use by another run (" + holder + ")");
  refused(run + " --force", holder);
  refused(run + " --resume r/ckpt-00000002.h5", holder);
  EXPECT_EQ(fs::directory_iterator(dir_ / "r")->path().filename(), m3::train::kRunLock);
  // The holder ends without removing its file (a crash): the lock is stale and taken over.
  ::close(fd);
  const CliRun ok = m3h(run);
  EXPECT_EQ(ok.status, 0) << ok.out << ok.err;
  EXPECT_FALSE(fs::exists(lock)) << "a clean exit removes the lock file";
}

TEST_F(RunGuards, TwoRunsStartedTogetherInOneFolderOneIsRefused) {
  const std::string run = std::string(kTiny) + " --steps 40 --out same";
  const std::string cmd = std::string("cd '") + dir_.string() + "'; ('" + M3H_PATH + "' " + run +
                          " >a.out 2>a.err; echo $? >a.rc) & ('" + M3H_PATH + "' " + run +
                          " >b.out 2>b.err; echo $? >b.rc) & wait";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const int a = std::stoi(text("a.rc")), b = std::stoi(text("b.rc"));
  EXPECT_EQ(std::min(a, b), 0);
  EXPECT_EQ(std::max(a, b), 2) << "both runs wrote the same folder";
  const std::string err = text(a == 2 ? "a.err" : "b.err");
  EXPECT_EQ(lines(err), 1) << err;
  EXPECT_TRUE(err.find("in use by another run (pid ") != std::string::npos ||
              err.find("holds another run") != std::string::npos)
      << err;
}

// ---- 2: a checkpoint resumes only into its own run --------------------------------------------

std::vector<std::string> file_lines(const fs::path& p) {
  std::ifstream in(p);
  std::vector<std::string> v;
  for (std::string l; std::getline(in, l);) v.push_back(l);
  return v;
}

TEST_F(RunGuards, ACheckpointOfAnotherRunIsRefusedAndMetricsStayOneRunWithoutGaps) {
  const std::string base = std::string(kTiny) + " --steps 5 --ckpt-every 1 --keep 10";
  ASSERT_EQ(m3h(base + " --out A").status, 0);
  fs::copy(dir_ / "A", dir_ / "B", fs::copy_options::recursive);
  const CliRun b = m3h(base + " --seed 9 --out B --force");
  ASSERT_EQ(b.status, 0) << b.err;
  // The same settings as A's checkpoint, but B is another run.
  refused(base + " --out B --resume A/ckpt-00000002.h5", "is a checkpoint of run ");

  const std::vector<std::string> cfg = file_lines(dir_ / "B" / "config.txt");
  std::string id;
  for (const auto& l : cfg)
    if (l.rfind("# run-id = ", 0) == 0) id = l.substr(11);
  ASSERT_EQ(id.size(), 16u) << text("B/config.txt");
  EXPECT_EQ(m3::train::read_checkpoint((dir_ / "B" / "ckpt-00000003.h5").string(), nullptr, nullptr).run_id, id);
  const std::vector<std::string> rows = file_lines(dir_ / "B" / "metrics.csv");
  ASSERT_EQ(rows.size(), 6u);
  for (size_t i = 1; i < rows.size(); ++i) EXPECT_EQ(rows[i].substr(rows[i].size() - 16), id) << rows[i];

  // Its own checkpoint resumes; metrics.csv is cut back to step 3 and grows again to 5.
  const CliRun ok = m3h(base + " --seed 9 --out B --resume B/ckpt-00000003.h5");
  ASSERT_EQ(ok.status, 0) << ok.err;
  EXPECT_EQ(file_lines(dir_ / "B" / "metrics.csv").size(), 6u);

  // A gap, and a row of another run, are refused and the file is left as it was.
  std::vector<std::string> gap = rows;
  gap.erase(gap.begin() + 2);
  std::string g;
  for (const auto& l : gap) g += l + "\n";
  write("B/metrics.csv", g);
  refused(base + " --seed 9 --out B --resume B/ckpt-00000003.h5", "skip from step 1 to step 3");
  EXPECT_EQ(text("B/metrics.csv"), g);
  std::string foreign;
  for (size_t i = 0; i < rows.size(); ++i)
    foreign += (i == 2 ? rows[i].substr(0, rows[i].size() - 16) + "0123456789abcdef" : rows[i]) + "\n";
  write("B/metrics.csv", foreign);
  refused(base + " --seed 9 --out B --resume B/ckpt-00000003.h5", "belongs to another run");
}

// ---- 3: an output is never one of the command's inputs ----------------------------------------

TEST_F(RunGuards, NoOutputReplacesAnInputFileEvenWithForce) {
  ASSERT_EQ(m3h(std::string(kTiny) + " --steps 2 --out r").status, 0);
  fs::copy_file(dir_ / "r" / "ckpt-00000002.h5", dir_ / "ck.h5");
  fs::create_symlink("ck.h5", dir_ / "alias.h5");
  const std::string before = text("ck.h5");
  refused("dump --device cpu --checkpoint ck.h5 --T 8 --stage '*' --out ck.h5 --force",
          "--out ck.h5: is the run's --checkpoint file");
  refused("dump --device cpu --checkpoint ck.h5 --T 8 --stage '*' --out alias.h5 --force", "--checkpoint file");
  refused("compare --device cpu --checkpoint ck.h5 --T 8 --json ck.h5 --force",
          "--json ck.h5: is the run's --checkpoint file");
  write("cfg.txt", "d_model = 8\n");
  refused("compare --device cpu --config cfg.txt --json cfg.txt --force", "--config file");
  EXPECT_EQ(text("ck.h5"), before);
  EXPECT_EQ(text("cfg.txt"), "d_model = 8\n");
}

// ---- 4: a run that fails before its first step leaves nothing that blocks the rerun -----------

TEST_F(RunGuards, AFailedStartLeavesNothingBehindAndTheRerunWorks) {
  const std::string sized = std::string(kModel) + " --steps 2 --warmup 1 --out r";
  refused(sized + " --T 1000000000", "too large");
  refused(sized + " --B 99999999999", "--B");
  refused(sized + " --eval-len 1000000000", "too large");
  const std::string run = kTiny + " --steps 2 --out r";
  EXPECT_FALSE(fs::exists(dir_ / "r"));
  const CliRun ok = m3h(run);
  EXPECT_EQ(ok.status, 0) << ok.err;
  // What fails after the folder is made (the backend, memory) is taken back by the run dir:
  // a folder it created goes, a folder that was there stays, with only foreign files left.
  {
    m3::train::RunDir made((dir_ / "made").string(), false, false);
    made.write_config("x = 1\n");
    made.open_metrics(0);
    made.discard_new_run();
  }
  EXPECT_FALSE(fs::exists(dir_ / "made"));
  fs::create_directories(dir_ / "kept");
  {
    m3::train::RunDir kept((dir_ / "kept").string(), false, false);
    kept.write_config("x = 1\n");
    kept.discard_new_run();
  }
  EXPECT_TRUE(fs::is_directory(dir_ / "kept"));
  EXPECT_TRUE(fs::is_empty(dir_ / "kept"));
}

// ---- 5: a run stopped for non-finite values ---------------------------------------------------

TEST_F(RunGuards, ANonFiniteStopExitsOneNamesTheTensorAndKeepsTheLastFiniteCheckpoint) {
  const CliRun r = m3h(std::string(kTiny) + " --steps 6 --ckpt-every 1 --dtype f32 --lr 1e300 --out lr1");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("first non-finite tensor: weights/"), std::string::npos) << r.out;
  // Every checkpoint it names exists and reads back (finite); none of the stop's step.
  std::vector<std::string> ckpts;
  for (const auto& e : fs::directory_iterator(dir_ / "lr1"))
    if (e.path().extension() == ".h5") ckpts.push_back(e.path().filename().string());
  for (const auto& c : ckpts) EXPECT_NO_THROW(m3::train::read_checkpoint((dir_ / "lr1" / c).string(), nullptr, nullptr)) << c;
  const size_t at = r.out.find("last finite checkpoint is ");
  if (at != std::string::npos) {
    std::string named = r.out.substr(at + 26);
    named = named.substr(0, named.find_first_of("\n;"));
    EXPECT_TRUE(fs::exists(dir_ / named)) << named;
  } else {
    EXPECT_NE(r.out.find("no finite checkpoint was written"), std::string::npos) << r.out;
    EXPECT_TRUE(ckpts.empty());
  }
}

// ---- 6: a full disk ----------------------------------------------------------------------------

// A small tmpfs mounted for the test and unmounted however the test ends; `ok` is false (with
// the reason) where it cannot be mounted: no permission, no mount program.
struct SmallDisk {
  fs::path dir;
  bool ok = false;
  std::string why;
  SmallDisk(const fs::path& at, const char* size) : dir(at) {
    fs::create_directories(dir);
    if (::geteuid() != 0) {
      why = "mounting a tmpfs needs root";
      return;
    }
    const std::string cmd =
        std::string("mount -t tmpfs -o size=") + size + " tmpfs '" + dir.string() + "' 2>/dev/null";
    ok = std::system(cmd.c_str()) == 0;
    if (!ok) why = "cannot mount a tmpfs here (no mount program, or not allowed)";
  }
  ~SmallDisk() {
    if (ok) (void)!std::system(("umount '" + dir.string() + "' 2>/dev/null").c_str());
  }
  SmallDisk(const SmallDisk&) = delete;
  SmallDisk& operator=(const SmallDisk&) = delete;
  // Fills the disk up to `free_kb` KiB with one file, `fill`.
  void leave(int free_kb) const {
    fs::remove(dir / "fill");
    struct statvfs v {};
    ASSERT_EQ(::statvfs(dir.c_str(), &v), 0);
    const unsigned long long avail = static_cast<unsigned long long>(v.f_bavail) * v.f_frsize;
    const unsigned long long want = static_cast<unsigned long long>(free_kb) * 1024;
    std::ofstream f(dir / "fill", std::ios::binary);
    const std::string block(4096, 'x');
    for (unsigned long long n = 0; n + 4096 <= (avail > want ? avail - want : 0); n += 4096)
      f.write(block.data(), static_cast<std::streamsize>(block.size()));
  }
  // What the disk holds besides the filler and the files named in `keep`.
  std::vector<std::string> others(const std::vector<std::string>& keep = {}) const {
    std::vector<std::string> v;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      const std::string rel = fs::relative(e.path(), dir).string();
      if (rel != "fill" && !e.is_directory() &&
          std::find(keep.begin(), keep.end(), rel) == keep.end())
        v.push_back(rel);
    }
    return v;
  }
};

// Every amount of room left, the one too small for HDF5's own bookkeeping included: exit 2 with
// one line naming the cause (never a crash in the HDF5 library's shutdown, 139), no temporary
// left, and what was there before stays.
TEST_F(RunGuards, AFullDiskFailsAnHdf5WriteWithOneLineAndNoCrash) {
  SmallDisk disk(dir_ / "small", "1m");
  if (!disk.ok) GTEST_SKIP() << disk.why;
  const std::string at = (dir_ / "small").string();
  for (int free_kb : {0, 4, 8, 16, 64}) {
    for (const std::string& args :
         {"dump --device cpu --stage '*' --layers 2 --T 64 --out '" + at + "/d.h5'",
          "golden regen --case default --dir '" + at + "'"}) {
      disk.leave(free_kb);
      const CliRun r = m3h(args);
      EXPECT_EQ(r.status, 2) << free_kb << " KiB free: " << args << " (139 = a crash)\n" << r.err;
      EXPECT_EQ(lines(r.err), 1) << r.err;
      EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
      EXPECT_EQ(disk.others(), std::vector<std::string>{}) << free_kb << " KiB free: " << args;
    }
  }
}

// A training run whose checkpoint meets a full disk: exit 2 with one line, no crash at exit;
// the run's earlier files stay and no temporary is left.
TEST_F(RunGuards, AFullDiskAtACheckpointStopsTrainingWithOneLineAndNoCrash) {
  SmallDisk disk(dir_ / "small", "1m");
  if (!disk.ok) GTEST_SKIP() << disk.why;
  const std::string run = kTiny + " --steps 3 --ckpt-every 1 --out '" + (dir_ / "small" / "r").string() + "'";
  for (int free_kb : {8, 12, 16, 24}) {
    fs::remove_all(dir_ / "small" / "r");
    disk.leave(free_kb);
    const CliRun r = m3h(run);
    EXPECT_EQ(r.status, 2) << free_kb << " KiB free (139 = a crash)\n" << r.out << r.err;
    EXPECT_EQ(lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("No space left on device"), std::string::npos) << r.err;
    for (const std::string& f : disk.others())
      EXPECT_EQ(f.find(".tmp."), std::string::npos) << free_kb << " KiB free: left " << f;
  }
}

// ---- 7: absurd counts are refused before any allocation ---------------------------------------

TEST_F(RunGuards, AbsurdCountsAreRefusedAtOnceAndNegativeOnesAsNegative) {
  const std::string run = std::string(kModel) + " --B 2 --T 16 --warmup 1 --steps 2 --out r";
  for (const char* opt : {" --layers 99999999999", " --val-batches 99999999999",
                          " --grad-accum 99999999999"})
    refused(run + opt, "too large");
  EXPECT_FALSE(fs::exists(dir_ / "r"));
  refused("compare --device cpu --layers 99999999999", "too large");
  refused("golden regen --layers 99999999999 --out g.h5", "too large");
  refused("compare --device cpu --sweep -1", "cannot be negative");
  refused("compare --device cpu --sweep 3 --sweep-from -1", "cannot be negative");
  refused("compare --device cpu --sweep 1 --jobs 100000", "hardware threads");
  const CliRun one = m3h("compare --device cpu --sweep 1 --jobs 2 --dtype f32 --scan seq --mode e2e");
  EXPECT_TRUE(one.status == 0 || one.status == 1) << one.out << one.err;
  EXPECT_EQ(one.err.find("terminate"), std::string::npos) << one.err;
}

// ---- 8: one line, no internals -----------------------------------------------------------------

TEST_F(RunGuards, ACheckpointsBadSettingIsNamedWithItsAttributeAndValue) {
  ASSERT_EQ(m3h(std::string(kTiny) + " --steps 2 --out r").status, 0);
  m3::Config cfg;
  m3::train::TrainState st;
  m3::train::CheckpointMeta meta =
      m3::train::read_checkpoint((dir_ / "r" / "ckpt-00000002.h5").string(), &cfg, &st);
  for (auto& kv : meta.settings)
    if (kv.first == "T") kv.second = "abc";
  m3::train::write_checkpoint((dir_ / "bad.h5").string(), cfg, meta, st, false);
  const std::string said = "bad.h5: /meta attribute 'T' is not a non-negative integer ('abc')";
  refused("dump --device cpu --checkpoint bad.h5 --stage '*' --out d.h5", said);
  refused("compare --device cpu --checkpoint bad.h5", said);
  refused("sample --device cpu --checkpoint bad.h5 --tokens 2", said);
  EXPECT_FALSE(fs::exists(dir_ / "d.h5"));
}

TEST_F(RunGuards, AnEmptyPathIsRefusedNamingItsOption) {
  for (const auto& [args, option] : std::vector<std::pair<std::string, std::string>>{
           {"dump --device cpu --stage '*' --checkpoint '' --out d.h5", "--checkpoint"},
           {"compare --device cpu --checkpoint ''", "--checkpoint"},
           {"sample --device cpu --checkpoint ''", "--checkpoint"},
           {kTiny + " --steps 2 --out r --resume ''", "--resume"},
           {kTiny + " --steps 2 --out ''", "--out"},
           {"plot --run ''", "--run"},
           {"determinism --device cpu --runs 2 --record ''", "--record"},
           {"determinism --device cpu --runs 2 --expect ''", "--expect"},
       })
    refused(args, option + ": an empty path");
}

TEST_F(RunGuards, PlotOfAMissingRunSaysTheFolderDoesNotExist) {
  const CliRun r = refused("plot --run missing", "--run missing: the run folder does not exist");
  EXPECT_EQ(r.err.find("--out"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("resum"), std::string::npos) << r.err;
}

TEST_F(RunGuards, AConfigLineWithoutAKeyIsNamedByFileAndLine) {
  write("c.txt", "d_model = 8\n= 8\n");
  const CliRun r = refused("compare --device cpu --config c.txt", "config c.txt:2: a value without a key ('= 8')");
  EXPECT_EQ(r.err.find("ambiguous"), std::string::npos) << r.err;
}

TEST_F(RunGuards, AConfigFileWithAByteOrderMarkLoads) {
  write("bom.txt", "\xEF\xBB\xBFT = 8\nB = 1\nd_model = 8\nd_state = 4\nheaddim = 4\nlayers = 1\n");
  const CliRun r = m3h("compare --device cpu --config bom.txt --dtype f32 --scan seq --mode e2e");
  EXPECT_TRUE(r.status == 0 || r.status == 1) << r.out << r.err;
  EXPECT_EQ(r.err.find("unknown key"), std::string::npos) << r.err;
  EXPECT_NE(r.out.find("T=8"), std::string::npos) << r.out;
}

TEST_F(RunGuards, ATooLongOutputNameKeepsTheReasonOnItsOneLine) {
  const std::string name(300, 'a');
  const CliRun r = refused("dump --device cpu --stage '*' --T 8 --out " + name + ".h5", "File name too long");
  EXPECT_LT(r.err.size(), 600u) << r.err;
  EXPECT_NE(r.err.find("bytes)"), std::string::npos) << "the name is shortened in the middle: " << r.err;
}

TEST_F(RunGuards, GoldenCheckOfAMissingFolderIsOneLine) {
  refused("golden check --all --dir nowhere", "nowhere: golden folder does not exist");
  refused("golden check --case default --dir nowhere", "golden folder does not exist");
}

TEST_F(RunGuards, GpuOnlyBenchOptionsWithoutAGpuExitTwoAsCeilingsDoes) {
  const CliRun ceilings = m3h("bench --ceilings");
  if (ceilings.status == 0) GTEST_SKIP() << "a GPU is present";
  ASSERT_EQ(ceilings.status, 2) << ceilings.err;
  ASSERT_NE(ceilings.err.find("no GPU"), std::string::npos) << ceilings.err;
  refused("bench --profile", "bench --profile: no GPU");
  refused("bench --graph", "bench --graph: no GPU");
}

TEST(MessageEscaping, ControlCharactersAreEscapedAndLongTextKeepsBothEnds) {
  EXPECT_EQ(m3::escape_for_message("a\x1b[31mb\n\x7f", 60), "a\\x1b[31mb\\x0a\\x7f");
  const std::string long_text = std::string(100, 'a') + "TAIL";
  const std::string shown = m3::escape_for_message(long_text, 20);
  EXPECT_EQ(shown.substr(0, 10), std::string(10, 'a'));
  EXPECT_NE(shown.find("(104 bytes)"), std::string::npos) << shown;
  EXPECT_EQ(shown.substr(shown.size() - 4), "TAIL") << shown;
  EXPECT_EQ(m3::escape_for_terminal("line\x1b]0;x\x07\n\tnext"), "line\\x1b]0;x\\x07\n\tnext");
}

TEST_F(RunGuards, NamesAreEscapedOnStdoutAndSampleKeepsRawBytesForAPipe) {
  const CliRun d = m3h("dump --device cpu --stage '*' --T 8 --out \"$(printf 'e\\033[31m.h5')\"");
  ASSERT_EQ(d.status, 0) << d.err;
  EXPECT_EQ(d.out.find('\x1b'), std::string::npos) << "a raw escape reached stdout";
  EXPECT_NE(d.out.find("e\\x1b[31m.h5"), std::string::npos) << d.out;

  write("text.txt", std::string(4096, 'a'));
  ASSERT_EQ(m3h("train --device cpu --d-model 8 --d-state 4 --headdim 4 --layers 1 --B 2 --T 16 "
                "--data text.txt --steps 2 --warmup 1 --val-batches 1 --out t")
                .status,
            0);
  // A checkpoint's path in compare's report header.
  std::error_code ec;
  fs::copy_file(dir_ / "t" / "ckpt-00000002.h5", dir_ / "c\033[31m.h5", ec);
  ASSERT_FALSE(ec) << ec.message();
  const CliRun c = m3h("compare --device cpu --dtype f32 --scan seq --stage 'norm_f/*' "
                       "--checkpoint \"$(printf 'c\\033[31m.h5')\"");
  EXPECT_EQ(c.out.find('\x1b'), std::string::npos) << "a raw escape reached stdout: " << c.out;
  EXPECT_NE(c.out.find("c\\x1b[31m.h5"), std::string::npos) << c.out;

  // Not a terminal: the bytes as they are, the prompt's escape included.
  const CliRun s = m3h("sample --device cpu --checkpoint t/ckpt-00000002.h5 --tokens 4 --prompt \"$(printf '<\\033[31m>')\"");
  ASSERT_EQ(s.status, 0) << s.err;
  EXPECT_EQ(s.out.rfind("<\x1b[31m>", 0), 0u) << s.out;
}

// ---- 9: a run's own config.txt, data options, parents of --out, SIGHUP -------------------------

TEST_F(RunGuards, ARunsOwnConfigLoadsAndMismatchedDataOptionsAreRefused) {
  const std::string opts = " --task-opt n_min=2 --task-opt n_max=8 --steps 2";
  ASSERT_EQ(m3h(kTiny + opts + " --out r").status, 0);
  const CliRun again = m3h("train --config r/config.txt --out r2");
  EXPECT_EQ(again.status, 0) << again.err;
  refused(kTiny + " --steps 2 --val-fraction 0.2 --out v", "--val-fraction is for --data");
  write("text.txt", std::string(4096, 'a'));
  refused("train --device cpu --d-model 8 --d-state 4 --headdim 4 --layers 1 --B 2 --T 16 "
          "--data text.txt --task-opt n_min=2 --steps 2 --out d",
          "--task-opt is for --task");
  refused(kTiny + " --steps 2 --out no/such/r", "folder no/such does not exist");
  refused("dump --device cpu --stage '*' --out no/such/d.h5", "folder no/such does not exist");
}

TEST_F(RunGuards, SighupCheckpointsLikeSigint) {
  const std::string out = (dir_ / "h").string();
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    execl(M3H_PATH, M3H_PATH, "train", "--device", "cpu", "--task", "parity", "--d-model", "8",
          "--d-state", "4", "--headdim", "4", "--layers", "1", "--B", "2", "--T", "16", "--steps",
          "200000", "--warmup", "1", "--val-batches", "0", "--log-every", "100000", "--out",
          out.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  const fs::path csv = dir_ / "h" / "metrics.csv";
  int rows = 0;
  for (int i = 0; i < 3000 && rows < 4; ++i) {
    usleep(10000);
    rows = static_cast<int>(file_lines(csv).size());
  }
  ASSERT_GE(rows, 4);
  kill(pid, SIGHUP);
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  bool ckpt = false;
  for (const auto& e : fs::directory_iterator(dir_ / "h")) ckpt = ckpt || e.path().extension() == ".h5";
  EXPECT_TRUE(ckpt);
}
#endif

}  // namespace
