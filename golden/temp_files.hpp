// Temporary files that neither a signal nor a killed run may leave behind: every
// atomic writer of the project (h5::Writer, harness::write_file_atomic) names its temporary
// "<final>.tmp.<pid>[.<n>]" and
//   * registers it while it exists (TempFile): SIGINT and SIGTERM unlink every registered
//     temporary, then the signal's default action ends the process (so the exit status still
//     says which signal);
//   * first removes the stale ones of its own final path (clean_stale_temps): files named
//     "<final>.tmp.<pid>…" whose process no longer runs — what a SIGKILL left.
// The handler is async-signal-safe: a fixed table of paths, unlink() and raise() only.
#pragma once

#include <string>

namespace m3::tmp {

// Registers `path` for removal on SIGINT / SIGTERM until destroyed (the file itself is the
// owner's to create, rename or remove). At most kSlots at once; more is an m3::Error.
class TempFile {
 public:
  static constexpr int kSlots = 16;
  explicit TempFile(const std::string& path);
  ~TempFile();
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

 private:
  int slot_ = -1;
};

// Removes "<final>.tmp.<pid>" and "<final>.tmp.<pid>.<n>" beside `final_path` whose pid is
// not a running process; returns how many it removed. Never touches another name.
int clean_stale_temps(const std::string& final_path);

}  // namespace m3::tmp
