// The run directory (run_dir.hpp): the folder rules, metrics.csv, checkpoint names and pruning,
// loss.png by gnuplot.
#include "run_dir.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include "backend.hpp"
#include "checkpoint.hpp"
#include "error.hpp"
#include "json.hpp"
#include "temp_files.hpp"

extern char** environ;

namespace m3::train {

namespace fs = std::filesystem;

namespace {

constexpr const char* kWhere = "run directory";
constexpr const char* kConfig = "config.txt";
constexpr const char* kMetrics = "metrics.csv";
constexpr const char* kPlot = "loss.png";
constexpr const char* kStepTimes = "step_times.csv";
constexpr const char* kStepPlot = "step_times.png";
constexpr int kMetricsColumns = 11;
constexpr const char* kRunIdTag = "# run-id = ";
constexpr int kStepTimesColumns = 7;

bool all_digits(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}

// "ckpt-<digits>.h5" → the step; −1 for any other name.
Idx checkpoint_step(const std::string& name) {
  const std::string pre = "ckpt-", post = ".h5";
  if (name.size() <= pre.size() + post.size() || name.compare(0, pre.size(), pre) != 0 ||
      name.compare(name.size() - post.size(), post.size(), post) != 0)
    return -1;
  const std::string digits = name.substr(pre.size(), name.size() - pre.size() - post.size());
  if (!all_digits(digits) || digits.size() > 18) return -1;
  return static_cast<Idx>(std::stoll(digits));
}

bool is_final_run_file(const std::string& name) {
  return name == kConfig || name == kMetrics || name == kPlot || name == kStepTimes ||
         name == kStepPlot || checkpoint_step(name) >= 0;
}

// The gnuplot script and log of a plot "<stem>.png": "<stem>.gp", "<stem>.log", only ever as
// temporaries.
bool is_plot_temporary(const std::string& name) {
  for (const char* png : {kPlot, kStepPlot}) {
    const std::string stem = std::string(png).substr(0, std::string(png).size() - 4);
    if (name == stem + ".gp" || name == stem + ".log") return true;
  }
  return false;
}

bool holds_run(const std::string& dir) {
  std::error_code ec;
  return fs::exists(fs::path(dir) / kConfig, ec) || fs::exists(fs::path(dir) / kMetrics, ec);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path, "cannot read the file", std::strerror(errno));
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// The lines of `text` ('\n'-separated); *torn is set when the last one has no '\n'.
std::vector<std::string> split_lines(const std::string& text, bool* torn) {
  std::vector<std::string> lines;
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t nl = text.find('\n', start);
    if (nl == std::string::npos) {
      lines.push_back(text.substr(start));
      *torn = true;
      return lines;
    }
    lines.push_back(text.substr(start, nl - start));
    start = nl + 1;
  }
  *torn = false;
  return lines;
}

std::vector<std::string> split_fields(const std::string& line) {
  std::vector<std::string> f;
  std::stringstream ss(line);
  std::string item;
  while (std::getline(ss, item, ',')) f.push_back(item);
  if (!line.empty() && line.back() == ',') f.emplace_back();
  return f;
}

std::string cell(const std::optional<double>& v) { return v ? exact_double(*v) : ""; }

// One row of a run's csv file: its step (the first cell), its line and its cells.
struct CsvRow {
  Idx step = 0;
  std::string line;
  std::vector<std::string> cells;
};

// The rows of the run's csv file `p` under `header`, each of `columns` cells with the step
// first; a last line without its newline (cut off by a killed run) is dropped. A wrong header or
// a malformed row is an m3::Error naming the file and the line; `what` names the file's rows
// ("metrics", "step times").
std::vector<CsvRow> read_rows(const std::string& p, const char* header, int columns,
                              const char* what) {
  bool torn = false;
  const std::vector<std::string> lines = split_lines(read_text(p), &torn);
  if (lines.empty() || lines[0] != header)
    throw Error(p, why("line 1 is not the ", what, " header"), "expected '" + std::string(header) + "'");
  std::vector<CsvRow> rows;
  for (std::size_t i = 1; i < lines.size(); ++i) {
    if (torn && i + 1 == lines.size()) break;
    CsvRow r{0, lines[i], split_fields(lines[i])};
    if (static_cast<int>(r.cells.size()) != columns || !all_digits(r.cells[0]) ||
        r.cells[0].size() > 18)
      throw Error(p, why("line ", i + 1, " is not a ", what, " row"), "'" + lines[i] + "'");
    r.step = static_cast<Idx>(std::stoll(r.cells[0]));
    rows.push_back(std::move(r));
  }
  return rows;
}

// The start of a run csv file `p` that a (resumed) run writes again: the header, then — when
// resuming and the file holds rows — its rows of steps <= last, in order (read_rows' checks).
std::string rows_through(const std::string& p, bool resume, const char* header, int columns,
                         const char* what, Idx last) {
  std::string kept = std::string(header) + "\n";
  std::error_code ec;
  if (resume && fs::exists(p, ec) && fs::file_size(p, ec) > 0)
    for (const CsvRow& r : read_rows(p, header, columns, what))
      if (r.step <= last) kept += r.line + "\n";
  return kept;
}

// A path inside a gnuplot single-quoted string ('' stands for ').
std::string gnuplot_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("''") : std::string(1, c);
  return q + "'";
}

std::string find_on_path(const std::string& program) {
  const char* env = std::getenv("PATH");
  const std::string path = env ? env : "/usr/local/bin:/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= path.size()) {
    std::size_t colon = path.find(':', start);
    if (colon == std::string::npos) colon = path.size();
    std::string d = path.substr(start, colon - start);
    if (d.empty()) d = ".";
    const std::string candidate = d + "/" + program;
    if (::access(candidate.c_str(), X_OK) == 0 && !fs::is_directory(candidate)) return candidate;
    start = colon + 1;
  }
  return "";
}

std::string first_line(const std::string& text) {
  std::stringstream ss(text);
  std::string line;
  while (std::getline(ss, line))
    if (line.find_first_not_of(" \t\r") != std::string::npos) return line;
  return "";
}

// Runs `program script` with stdin /dev/null and stdout + stderr into `log`; the exit status
// (−1 when it did not run or died by a signal).
int run_program(const std::string& program, const std::string& script, const std::string& log) {
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&fa, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  std::vector<char*> argv = {const_cast<char*>(program.c_str()),
                             const_cast<char*>(script.c_str()), nullptr};
  pid_t pid = -1;
  const int rc = ::posix_spawn(&pid, program.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return -1;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string new_run_id() {
  std::random_device rd;
  const std::uint64_t v = (static_cast<std::uint64_t>(rd()) << 32) ^ rd() ^
                          (static_cast<std::uint64_t>(::getpid()) << 16);
  char buf[20];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// The run id of a run folder's config.txt ("" when it has none).
std::string config_run_id(const std::string& dir) {
  std::ifstream in(fs::path(dir) / kConfig);
  std::string line;
  const std::string tag = kRunIdTag;
  while (std::getline(in, line))
    if (line.compare(0, tag.size(), tag) == 0) {
      std::string id = line.substr(tag.size());
      while (!id.empty() && (id.back() == '\r' || id.back() == ' ')) id.pop_back();
      return id;
    }
  return "";
}

std::string host_name() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "an unknown host";
  return host;
}

// Takes the flock of dir/run.lock and writes the holder's text into it; returns the fd. A lock
// held by a live process: m3::Error naming the holder from the file's text. The file is
// re-checked after the flock: a holder that unlinked it on exit between our open and our flock
// leaves us a lock on a removed inode, which guards nothing; then we start over.
int take_run_lock(const std::string& dir) {
  const std::string p = (fs::path(dir) / kRunLock).string();
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::open(p.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) throw Error(kWhere, "cannot create the lock " + p, std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      if (err != EWOULDBLOCK) throw Error(kWhere, "cannot lock " + p, std::strerror(err));
      // The holder writes its name right after its flock: wait a moment for it.
      std::string holder;
      for (int wait = 0; wait < 200 && holder.empty(); ++wait) {
        std::ifstream in(p);
        std::getline(in, holder);
        if (holder.empty()) ::usleep(5000);
      }
      throw Error(kWhere, "--out " + dir + " is in use by another run (" +
                              (holder.empty() ? std::string("its holder is still starting") : holder) + ")",
                  "wait for it to end, or choose another --out");
    }
    struct stat a {}, b {};
    if (::fstat(fd, &a) != 0 || ::stat(p.c_str(), &b) != 0 || a.st_ino != b.st_ino ||
        a.st_dev != b.st_dev) {
      ::close(fd);
      continue;
    }
    const std::string text = "pid " + std::to_string(::getpid()) + " on " + host_name() + "\n";
    if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) !=
                                       static_cast<ssize_t>(text.size())) {
      const int err = errno;
      ::close(fd);
      throw Error(kWhere, "cannot write the lock " + p, std::strerror(err));
    }
    return fd;
  }
  throw Error(kWhere, "cannot lock " + p, "the lock file keeps being replaced");
}

// The folder holds nothing but (perhaps) its lock file.
bool empty_but_lock(const std::string& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename() != kRunLock) return false;
  return !ec;
}

}  // namespace

bool is_run_file(const std::string& name) {
  if (is_final_run_file(name)) return true;
  // "<run file>.tmp.<pid>[.<n>]", also of the plot's script and log.
  const std::size_t at = name.find(".tmp.");
  if (at == std::string::npos) return false;
  const std::string base = name.substr(0, at), rest = name.substr(at + 5);
  if (rest.empty() || rest.find_first_not_of("0123456789.") != std::string::npos) return false;
  return is_final_run_file(base) || is_plot_temporary(base);
}

RunDir::RunDir(const std::string& dir, bool resume, bool force, bool lock)
    : dir_(dir), resume_(resume) {
  try {
    open(force, lock);
  } catch (...) {
    // No destructor runs for a constructor that throws: the lock is given back here.
    if (lock_fd_ >= 0) ::close(lock_fd_);
    lock_fd_ = -1;
    throw;
  }
}

void RunDir::open(bool force, bool lock) {
  const std::string& dir = dir_;
  const bool resume = resume_;
  M3_REQUIRE(!dir.empty(), kWhere, "--out needs a folder", "");
  std::error_code ec;
  const fs::file_status st = fs::status(dir, ec);
  const bool exists = fs::exists(st);
  // A writer names its folder by train's --out; a reader (no lock) by plot's --run.
  const std::string named = (lock ? "--out " : "--run ") + dir;
  if (exists && !fs::is_directory(st))
    throw Error(kWhere, named + " exists and is not a directory", "name a folder");
  if (resume) {
    if (!exists)
      throw Error(kWhere, named + ": the run folder does not exist",
                  lock ? "resuming needs the run's folder" : "");
    if (lock) lock_fd_ = take_run_lock(dir);
    if (!holds_run(dir))
      throw Error(kWhere, named + " holds no run", "no config.txt or metrics.csv there");
    run_id_ = config_run_id(dir);
    return;
  }
  run_id_ = new_run_id();
  if (!exists) {
    fs::create_directories(dir, ec);
    if (ec) throw Error(kWhere, "cannot create --out " + dir, ec.message());
    created_dir_ = true;
    if (lock) lock_fd_ = take_run_lock(dir);
    return;
  }
  // The lock first: a live run's folder is refused before anything in it is looked at or
  // removed, --force or not.
  if (lock) lock_fd_ = take_run_lock(dir);
  if (holds_run(dir) && !force)
    throw Error(kWhere, "--out " + dir + " holds another run",
                "use --resume FILE to continue it or --force to start over");
  const bool empty = empty_but_lock(dir);
  if (!empty && !force)
    throw Error(kWhere, "--out " + dir + " is not empty",
                "use a new or empty folder, or --force (it removes only a run's own files)");
  if (!force) return;
  std::vector<fs::path> doomed;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (is_run_file(name) && !it->is_directory()) doomed.push_back(it->path());
  }
  if (ec) throw Error(kWhere, "cannot list --out " + dir, ec.message());
  for (const fs::path& p : doomed) {
    fs::remove(p, ec);
    if (ec) throw Error(kWhere, "cannot remove " + p.string() + " (--force)", ec.message());
  }
}

RunDir::~RunDir() {
  if (lock_fd_ < 0) return;
  // Unlinked while still held: a process that opened the old file meanwhile re-checks the
  // inode after its flock (take_run_lock) and starts over on a fresh file.
  std::error_code ec;
  fs::remove(path(kRunLock), ec);
  ::close(lock_fd_);
}

void RunDir::discard_new_run() noexcept {
  if (resume_) return;
  metrics_.reset();
  std::error_code ec;
  for (const char* name : {kConfig, kMetrics}) fs::remove(path(name), ec);
  if (created_dir_ && empty_but_lock(dir_)) {
    if (lock_fd_ >= 0) {
      fs::remove(path(kRunLock), ec);
      ::close(lock_fd_);
      lock_fd_ = -1;
    }
    fs::remove(dir_, ec);
  }
}

std::string RunDir::path(const std::string& name) const { return (fs::path(dir_) / name).string(); }

void RunDir::write_config(const std::string& text) { harness::write_file_atomic(path(kConfig), text); }

void RunDir::open_metrics(Idx resume_step) {
  M3_REQUIRE(resume_step >= 0, kWhere, "open_metrics: resume step must be >= 0", resume_step);
  metrics_.reset();
  const std::string p = path(kMetrics);
  std::string kept = std::string(kMetricsHeader) + "\n";
  if (resume_) {
    // The rows this run keeps must be its own steps 1 … resume_step, each exactly once.
    std::error_code ec;
    std::vector<CsvRow> rows;
    if (fs::exists(p, ec) && fs::file_size(p, ec) > 0)
      rows = read_rows(p, kMetricsHeader, kMetricsColumns, "metrics");
    Idx expect = 1;
    for (const CsvRow& r : rows) {
      if (r.step > resume_step) break;
      if (r.cells.back() != run_id_)
        throw Error(p, why("the row of step ", r.step, " belongs to another run"),
                    "run " + (r.cells.back().empty() ? std::string("without an id") : r.cells.back()) +
                        ", this folder's run is " + (run_id_.empty() ? std::string("without an id") : run_id_));
      if (r.step != expect)
        throw Error(p, why("the rows skip from step ", expect - 1, " to step ", r.step),
                    "a resume keeps steps 1 … " + std::to_string(resume_step) + " in order");
      kept += r.line + "\n";
      ++expect;
    }
    if (expect <= resume_step)
      throw Error(p, why("the rows end at step ", expect - 1, " but the checkpoint is of step ", resume_step),
                  "the loss log of the resumed steps is missing");
  }
  harness::write_file_atomic(p, kept);
  metrics_.reset(std::fopen(p.c_str(), "a"));
  if (!metrics_) throw Error(p, "cannot open for appending", std::strerror(errno));
}

std::string RunDir::format_row(const Row& r) {
  char tps[64];
  std::snprintf(tps, sizeof tps, "%.1f", r.tokens_per_s);
  std::string s;
  s += std::to_string(r.step) + ",";
  s += exact_double(r.loss) + ",";
  s += cell(r.val_loss) + ",";
  s += cell(r.accuracy) + ",";
  s += exact_double(r.lr) + ",";
  s += exact_double(r.grad_norm) + ",";
  s += std::string(tps) + ",";
  s += exact_double(r.loss_scale) + ",";
  s += std::to_string(r.skipped) + ",";
  s += cell(r.verify_pct);
  return s;
}

void RunDir::append(const Row& r) {
  const std::string p = path(kMetrics);
  if (!metrics_) throw Error(p, "append before open_metrics", "");
  const std::string line = format_row(r) + "," + run_id_ + "\n";
  if (std::fwrite(line.data(), 1, line.size(), metrics_.get()) != line.size() ||
      std::fflush(metrics_.get()) != 0)
    throw Error(p, "cannot append a row", std::strerror(errno));
}

std::string RunDir::checkpoint_path(Idx step) const {
  M3_REQUIRE(step >= 0, kWhere, "checkpoint step must be >= 0", step);
  char name[64];
  std::snprintf(name, sizeof name, "ckpt-%08lld.h5", static_cast<long long>(step));
  return path(name);
}

std::string resolve_checkpoint(const std::string& path, const std::string& option) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  Idx best = -1;
  fs::path latest;
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    const Idx step = checkpoint_step(it->path().filename().string());
    if (step > best && !it->is_directory()) {
      best = step;
      latest = it->path();
    }
  }
  if (ec) throw Error(option + " " + path, "cannot list the folder", ec.message());
  if (best < 0)
    throw Error(option + " " + path, "the folder holds no checkpoint (ckpt-<step>.h5)",
                "name a checkpoint file, or a run folder of m3h train that wrote one");
  return latest.string();
}

void RunDir::prune_checkpoints(Idx keep, Idx final_step) {
  M3_REQUIRE(keep >= 1, kWhere, "--keep must be >= 1", "got ", keep);
  std::vector<std::pair<Idx, fs::path>> ckpts;
  std::error_code ec;
  for (fs::directory_iterator it(dir_, ec), end; !ec && it != end; it.increment(ec)) {
    const Idx step = checkpoint_step(it->path().filename().string());
    if (step >= 0 && !it->is_directory()) ckpts.emplace_back(step, it->path());
  }
  if (ec) throw Error(kWhere, "cannot list " + dir_, ec.message());
  std::sort(ckpts.begin(), ckpts.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (std::size_t i = static_cast<std::size_t>(keep); i < ckpts.size(); ++i) {
    if (ckpts[i].first == final_step) continue;
    fs::remove(ckpts[i].second, ec);
    if (ec) throw Error(kWhere, "cannot remove the old checkpoint " + ckpts[i].second.string(),
                        ec.message());
  }
}

namespace {

// Draws d/png with gnuplot: `body` is the script after the terminal and output lines; the
// picture is written to a temporary and renamed into place. "" when drawn, else the note's
// reason (what follows "<png> not drawn: ").
std::string draw_png(const RunDir& d, const std::string& png, const std::string& body) {
  const std::string gnuplot = find_on_path("gnuplot");
  if (gnuplot.empty()) return "gnuplot not found (apt-get install gnuplot-nox)";
  const std::string pid = std::to_string(::getpid());
  const std::string stem = png.substr(0, png.size() - 4);  // "<stem>.png"
  const std::string png_final = d.path(png);
  const std::string tmp_png = png_final + ".tmp." + pid;
  const std::string script = d.path(stem + ".gp.tmp." + pid);
  const std::string log = d.path(stem + ".log.tmp." + pid);
  const tmp::TempFile g1(tmp_png), g2(script), g3(log);
  auto cleanup = [&] {
    ::unlink(tmp_png.c_str());
    ::unlink(script.c_str());
    ::unlink(log.c_str());
  };
  {
    std::ofstream out(script, std::ios::binary | std::ios::trunc);
    out << "if (strstrt(GPVAL_TERMINALS, 'pngcairo') > 0) {\n"
           "  set terminal pngcairo size 960,540\n"
           "} else {\n"
           "  set terminal png size 960,540\n"
           "}\n"
        << "set output " << gnuplot_quote(tmp_png) << "\n"
        << body << "set output\n";
    if (!out.good()) {
      cleanup();
      return "cannot write the gnuplot script " + script;
    }
  }
  const int rc = run_program(gnuplot, script, log);
  std::error_code ec;
  const bool drawn = rc == 0 && fs::exists(tmp_png, ec) && fs::file_size(tmp_png, ec) > 0;
  if (!drawn) {
    std::string reason;
    try {
      reason = first_line(read_text(log));
    } catch (const Error&) {
    }
    cleanup();
    return "gnuplot failed" + (reason.empty() ? std::string() : ": " + reason);
  }
  if (::rename(tmp_png.c_str(), png_final.c_str()) != 0) {
    const std::string reason = std::strerror(errno);
    cleanup();
    return "cannot rename it into place (" + reason + ")";
  }
  cleanup();
  return "";
}

// The rows of d/csv for a plot; the reason when there are none to draw.
std::vector<CsvRow> rows_to_plot(const RunDir& d, const char* csv, const char* header, int columns,
                                 const char* what, std::string* reason) {
  const std::string p = d.path(csv);
  std::error_code ec;
  if (!fs::exists(p, ec)) {
    *reason = std::string("no ") + csv + " yet";
    return {};
  }
  try {
    return read_rows(p, header, columns, what);
  } catch (const Error& e) {
    *reason = e.what();
    return {};
  }
}

// "x y" lines of gnuplot inline data, 17 significant digits.
std::string point(double x, double y) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "%.17g %.17g\n", x, y);
  return buf;
}

}  // namespace

std::string RunDir::plot_loss() const {
  const std::string note = std::string(kPlot) + " not drawn: ";
  std::string reason;
  const std::vector<CsvRow> rows =
      rows_to_plot(*this, kMetrics, kMetricsHeader, kMetricsColumns, "metrics", &reason);
  if (!reason.empty()) return note + reason;
  // Train loss of every row, validation loss where measured; non-finite values left out.
  std::string train, val;
  Idx n_train = 0, n_val = 0;
  for (const CsvRow& r : rows) {
    const double loss = r.cells[1].empty() ? NAN : std::strtod(r.cells[1].c_str(), nullptr);
    const double vl = r.cells[2].empty() ? NAN : std::strtod(r.cells[2].c_str(), nullptr);
    if (std::isfinite(loss)) {
      train += point(static_cast<double>(r.step), loss);
      ++n_train;
    }
    if (std::isfinite(vl)) {
      val += point(static_cast<double>(r.step), vl);
      ++n_val;
    }
  }
  if (n_train + n_val == 0) return note + "metrics.csv has no finite loss yet";
  std::ostringstream gp;
  gp << "set xlabel 'step'\nset ylabel 'loss'\nset grid\nset key top right\n"
     << "set title 'loss against step'\n";
  if (n_train > 0) gp << "$train << EOD\n" << train << "EOD\n";
  if (n_val > 0) gp << "$val << EOD\n" << val << "EOD\n";
  gp << "plot ";
  if (n_train > 0)
    gp << "$train using 1:2 with " << (n_train > 1 ? "lines" : "points") << " lw 1.5 title 'train'";
  if (n_train > 0 && n_val > 0) gp << ", ";
  if (n_val > 0) gp << "$val using 1:2 with linespoints pt 7 ps 0.8 lw 1.5 title 'validation'";
  gp << "\n";
  reason = draw_png(*this, kPlot, gp.str());
  return reason.empty() ? "" : note + reason;
}

void RunDir::write_step_times(const std::vector<StepTimes>& t, Idx first_step) {
  M3_REQUIRE(first_step >= 1, kWhere, "write_step_times: the first step must be >= 1", first_step);
  const std::string p = path(kStepTimes);
  std::string text =
      rows_through(p, resume_, kStepTimesHeader, kStepTimesColumns, "step times", first_step - 1);
  char buf[160];
  for (std::size_t k = 0; k < t.size(); ++k) {
    std::snprintf(buf, sizeof buf, "%lld,%.4f,%.4f,%.4f,%.4f,%.4f,%d\n",
                  static_cast<long long>(first_step + static_cast<Idx>(k)), t[k].forward_ms,
                  t[k].uploads_ms, t[k].backward_ms, t[k].optimizer_ms, t[k].period_ms,
                  t[k].to_next ? 1 : 0);
    text += buf;
  }
  harness::write_file_atomic(p, text);
}

std::string RunDir::plot_step_times() const {
  const std::string note = std::string(kStepPlot) + " not drawn: ";
  std::string reason;
  const std::vector<CsvRow> rows =
      rows_to_plot(*this, kStepTimes, kStepTimesHeader, kStepTimesColumns, "step times", &reason);
  if (!reason.empty()) return note + reason;
  if (rows.empty()) return note + "step_times.csv has no rows yet";
  // Columns: step, period, forward + backward, forward, backward, optimizer, uploads. The y
  // range fits the steps after the first three (those the summary's medians take): the first
  // step's warm-up (allocation, cuBLAS' first calls) would otherwise flatten the rest.
  std::string data;
  double top = 0;
  for (size_t k = 0; k < rows.size(); ++k) {
    const CsvRow& r = rows[k];
    double v[5];  // forward, uploads, backward, optimizer, period
    for (int c = 0; c < 5; ++c) v[c] = std::strtod(r.cells[1 + c].c_str(), nullptr);
    if (k >= 3 || rows.size() <= 3) top = std::max({top, v[4], v[0] + v[2]});
    char buf[224];
    std::snprintf(buf, sizeof buf, "%lld %.17g %.17g %.17g %.17g %.17g %.17g\n",
                  static_cast<long long>(r.step), v[4], v[0] + v[2], v[0], v[2], v[3], v[1]);
    data += buf;
  }
  char top_text[64] = "*";
  if (top > 0 && std::isfinite(top)) std::snprintf(top_text, sizeof top_text, "%.6g", 1.08 * top);
  const char* style = rows.size() > 1 ? "lines" : "points";
  std::ostringstream gp;
  gp << "set xlabel 'step'\nset ylabel 'ms on the device'\nset grid\nset key outside right\n"
     << "set yrange [0:" << top_text << "]\nset title 'step times against step (CUDA events"
     << (rows.size() > 3 ? "; the scale fits the steps after the first three" : "") << ")'\n"
     << "$t << EOD\n" << data << "EOD\n"
     << "plot $t using 1:2 with " << style << " lw 1.5 title 'period',"
     << " $t using 1:3 with " << style << " lw 1.5 title 'forward + backward',"
     << " $t using 1:4 with " << style << " lw 1.5 title 'forward',"
     << " $t using 1:5 with " << style << " lw 1.5 title 'backward',"
     << " $t using 1:6 with " << style << " lw 1.5 title 'optimizer',"
     << " $t using 1:7 with " << style << " lw 1.5 title 'uploads (of the forward)'\n";
  reason = draw_png(*this, kStepPlot, gp.str());
  return reason.empty() ? "" : note + reason;
}

}  // namespace m3::train
