// Temporary files never left behind (golden/temp_files.hpp): SIGINT and SIGTERM
// remove the registered temporaries and still end the process by the signal; a later writer
// removes the stale temporaries of its own final path whose process is gone, and nothing else;
// h5::Writer and write_file_atomic do both.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "h5store.hpp"
#include "test_io.hpp"
#include "json.hpp"
#include "temp_files.hpp"

namespace {

namespace fs = std::filesystem;

struct TempDir : m3::test::TempDir {
  TempDir() : m3::test::TempDir("m3_tmpfiles_") {}
};

void touch(const fs::path& p) { std::ofstream(p) << "x"; }

// A pid that names no running process.
pid_t dead_pid() {
  for (pid_t p = 4194000; p > 1000; --p)
    if (::kill(p, 0) != 0 && errno == ESRCH) return p;
  return -1;
}

TEST(TempFiles, SigintAndSigtermRemoveRegisteredTemporariesAndEndByTheSignal) {
  TempDir t;
  for (int sig : {SIGINT, SIGTERM}) {
    const fs::path temp = t.dir / ("out.h5.tmp.x" + std::to_string(sig));
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      touch(temp);
      m3::tmp::TempFile guard(temp.string());
      ::raise(sig);
      ::_exit(0);  // not reached: the default action ends the process
    }
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status;
    EXPECT_FALSE(fs::exists(temp)) << "signal " << sig << " left " << temp;
  }
}

TEST(TempFiles, StaleTemporariesOfTheSamePathAreRemovedAndNothingElse) {
  TempDir t;
  const pid_t dead = dead_pid();
  ASSERT_GT(dead, 0);
  const std::string out = (t.dir / "r.json").string();
  const fs::path stale1 = out + ".tmp." + std::to_string(dead);
  const fs::path stale2 = out + ".tmp." + std::to_string(dead) + ".3";
  const fs::path alive = out + ".tmp." + std::to_string(::getppid()) + ".0";  // running
  const fs::path other = t.dir / ("q.json.tmp." + std::to_string(dead));      // another path
  const fs::path odd = out + ".tmp.notapid";
  for (const auto& p : {stale1, stale2, alive, other, odd}) touch(p);
  EXPECT_EQ(m3::tmp::clean_stale_temps(out), 2);
  EXPECT_FALSE(fs::exists(stale1));
  EXPECT_FALSE(fs::exists(stale2));
  for (const auto& p : {alive, other, odd}) EXPECT_TRUE(fs::exists(p)) << p;
  // The writers clean before they write.
  touch(stale1);
  m3::harness::write_file_atomic(out, "{}");
  EXPECT_FALSE(fs::exists(stale1));
  const std::string h5 = (t.dir / "d.h5").string();
  const fs::path stale_h5 = h5 + ".tmp." + std::to_string(dead) + ".0";
  touch(stale_h5);
  {
    m3::h5::Writer w(h5, false);
    EXPECT_FALSE(fs::exists(stale_h5));
    w.group("/g");
    w.commit();
  }
  EXPECT_TRUE(fs::exists(h5));
}

}  // namespace
