// The temporary-file registry and the stale-file cleanup (temp_files.hpp).
#include "temp_files.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>

#include "error.hpp"

namespace m3::tmp {

namespace {

constexpr std::size_t kPathMax = 4096;
char g_paths[TempFile::kSlots][kPathMax];
std::atomic<bool> g_used[TempFile::kSlots];

extern "C" void remove_temps_and_die(int sig) {
  for (int i = 0; i < TempFile::kSlots; ++i)
    if (g_used[i].load()) ::unlink(g_paths[i]);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void install_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction old {};
      ::sigaction(sig, nullptr, &old);
      if (old.sa_handler == SIG_IGN) continue;  // e.g. a background job: leave it ignored
      struct sigaction sa {};
      sa.sa_handler = remove_temps_and_die;
      ::sigemptyset(&sa.sa_mask);
      ::sigaction(sig, &sa, nullptr);
    }
  });
}

}  // namespace

TempFile::TempFile(const std::string& path) {
  M3_REQUIRE(path.size() < kPathMax, "temporary file", "path too long", path.size(), " bytes");
  install_handlers();
  static std::mutex m;
  std::lock_guard<std::mutex> lock(m);
  for (int i = 0; i < kSlots; ++i) {
    if (g_used[i].load()) continue;
    std::memcpy(g_paths[i], path.c_str(), path.size() + 1);
    g_used[i].store(true);
    slot_ = i;
    return;
  }
  throw Error("temporary file", "too many temporary files at once", path);
}

TempFile::~TempFile() {
  if (slot_ >= 0) g_used[slot_].store(false);
}

int clean_stale_temps(const std::string& final_path) {
  namespace fs = std::filesystem;
  const fs::path fp(final_path);
  const fs::path dir = fp.parent_path().empty() ? fs::path(".") : fp.parent_path();
  const std::string prefix = fp.filename().string() + ".tmp.";
  std::error_code ec;
  int removed = 0;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    // "<pid>" or "<pid>.<n>", digits only.
    const std::string rest = name.substr(prefix.size());
    const std::size_t dot = rest.find('.');
    const std::string pid_text = rest.substr(0, dot);
    const std::string n_text = dot == std::string::npos ? "0" : rest.substr(dot + 1);
    auto digits = [](const std::string& s) {
      return !s.empty() && s.size() < 10 && s.find_first_not_of("0123456789") == std::string::npos;
    };
    if (!digits(pid_text) || !digits(n_text)) continue;
    const pid_t pid = static_cast<pid_t>(std::stol(pid_text));
    if (pid <= 0 || pid == ::getpid()) continue;
    if (::kill(pid, 0) == 0 || errno != ESRCH) continue;  // running (or not ours to ask)
    if (fs::remove(it->path(), ec)) ++removed;
  }
  return removed;
}

}  // namespace m3::tmp
