// Files and processes of the tests:
//
//   TempDir tmp("m3_golden_");   a fresh folder per test (prefix + pid + suite + test name),
//                                removed afterwards: tmp.dir, tmp.file("x.h5"), tmp.str()
//   slurp(path), count_lines(s)
//   CliRun r = run_m3h(args, scratch, cwd);
//
// runs `M3H_PATH <args>` through the shell (the caller quotes `args` where needed), in the
// folder `cwd` when given, with stdout and stderr captured through two files in `scratch` (a
// folder the test owns; empty: a fresh temporary folder, removed afterwards). r.status is the
// exit status, or -1 when the process did not exit normally (or the build defines no M3H_PATH).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace m3::test {

struct TempDir {
  std::filesystem::path dir;
  explicit TempDir(const std::string& prefix) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = prefix + std::to_string(::getpid());
    if (info) name += std::string("_") + info->test_suite_name() + "_" + info->name();
    for (char& c : name)
      if (c == '/') c = '_';
    dir = std::filesystem::temp_directory_path() / name;
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string file(const std::string& name) const { return (dir / name).string(); }
  std::string str() const { return dir.string(); }
};

struct CliRun {
  int status = -1;  // exit status
  std::string out, err;
};

// The whole file as bytes ("" when it cannot be read).
inline std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline int count_lines(const std::string& s) {
  int n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

inline CliRun run_m3h(const std::string& args, std::filesystem::path scratch = {},
                      const std::filesystem::path& cwd = {}) {
  namespace fs = std::filesystem;
  CliRun r;
#ifdef M3H_PATH
  const bool own = scratch.empty();
  if (own) {
    static std::atomic<int> counter{0};
    scratch = fs::temp_directory_path() /
              ("m3h_cli_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::create_directories(scratch);
  }
  const fs::path out = scratch / "stdout.txt", err = scratch / "stderr.txt";
  std::string cmd;
  if (!cwd.empty()) cmd = "cd '" + cwd.string() + "' && ";
  cmd += std::string("'") + M3H_PATH + "' " + args + " >'" + out.string() + "' 2>'" +
         err.string() + "'";
  const int raw = std::system(cmd.c_str());
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = slurp(out);
  r.err = slurp(err);
  std::error_code ec;
  if (own) fs::remove_all(scratch, ec);
  else {
    fs::remove(out, ec);
    fs::remove(err, ec);
  }
#else
  (void)args;
  (void)scratch;
  (void)cwd;
  r.err = "this test build defines no M3H_PATH";
#endif
  return r;
}

}  // namespace m3::test
