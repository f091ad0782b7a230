// The training console and the Ctrl-C flag (progress.hpp).
#include "progress.hpp"

#include <signal.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "error.hpp"
#include "temp_files.hpp"
#include "terminal.hpp"

namespace m3::train {

// ---- Progress -------------------------------------------------------------------------------

namespace {
constexpr double kRedrawSeconds = 0.1;
constexpr const char* kClearToEol = "\x1b[K";
}  // namespace

Progress::Progress(Idx total_steps, Idx log_every, bool tty, std::ostream& out, Clock now)
    : total_(total_steps), log_every_(log_every), tty_(tty), out_(out), clock_(std::move(now)) {
  M3_REQUIRE(total_steps >= 0, "progress", "total steps must be >= 0", total_steps);
  M3_REQUIRE(log_every >= 1, "progress", "--log-every must be >= 1", "got ", log_every);
  t0_ = this->now();
}

double Progress::now() const {
  if (clock_) return clock_();
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Progress::hms(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-:--:--";
  const long long s = static_cast<long long>(std::llround(seconds));
  char buf[48];
  std::snprintf(buf, sizeof buf, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  return buf;
}

double Progress::elapsed() const { return elapsed_before_ + (now() - t0_); }

void Progress::update(Idx step, double loss, std::optional<double> val_loss, double lr,
                      double tokens_per_s) {
  const double t = now();
  if (first_step_ < 0) first_step_ = step;
  if (val_loss) val_ = val_loss;
  ++updates_;
  avg_ = kLossSmoothing * avg_ + (1 - kLossSmoothing) * loss;
  const double smoothed = avg_ / (1 - std::pow(kLossSmoothing, static_cast<double>(updates_)));
  const double elapsed = t - t0_;
  const Idx done = step - first_step_ + 1;  // steps timed since the clock started
  const double eta = done > 0 ? elapsed / static_cast<double>(done) *
                                    static_cast<double>(std::max<Idx>(total_ - step, 0))
                              : NAN;
  char buf[96];
  // The fields in order; `drop` ranks the ones a narrow terminal loses first (0 = kept).
  struct Field {
    std::string text;
    int drop;
  };
  std::vector<Field> fields;
  std::snprintf(buf, sizeof buf, "step %lld/%lld", static_cast<long long>(step),
                static_cast<long long>(total_));
  fields.push_back({buf, 0});
  std::snprintf(buf, sizeof buf, "loss %.4f", loss);
  fields.push_back({buf, 0});
  std::snprintf(buf, sizeof buf, "(avg %.4f)", smoothed);
  fields.push_back({buf, 4});
  if (val_) std::snprintf(buf, sizeof buf, "val %.4f", *val_);
  else std::snprintf(buf, sizeof buf, "val -");
  fields.push_back({buf, 0});
  std::snprintf(buf, sizeof buf, "lr %.2e", lr);
  fields.push_back({buf, 2});
  std::snprintf(buf, sizeof buf, "%.0f tok/s", tokens_per_s);
  fields.push_back({buf, 1});
  fields.push_back({"elapsed " + hms(elapsed_before_ + elapsed), 3});
  fields.push_back({"eta " + hms(eta), 0});
  auto join = [&](int dropped, const char* gap) {
    std::string s;
    for (std::size_t i = 0; i < fields.size(); ++i) {
      if (fields[i].drop > 0 && fields[i].drop <= dropped) continue;
      // "(avg …)" belongs to the loss before it: one space.
      if (!s.empty()) s += fields[i].text[0] == '(' ? " " : gap;
      s += fields[i].text;
    }
    return s;
  };
  last_ = join(0, "  ");
  if (tty_ && width_ > 0) {
    const std::size_t fit = static_cast<std::size_t>(std::max(1, width_ - 1));
    for (int dropped = 1; dropped <= 4 && last_.size() > fit; ++dropped) last_ = join(dropped, "  ");
    if (last_.size() > fit) last_ = join(4, " ");
    if (last_.size() > fit) last_.resize(fit);
  }
  if (!tty_) {
    if (step % log_every_ == 0 || step == total_) out_ << last_ << "\n" << std::flush;
    return;
  }
  pending_ = true;
  if (step == total_ || t - last_draw_ >= kRedrawSeconds) {
    draw();
    last_draw_ = t;
  }
}

void Progress::draw() {
  out_ << "\r" << last_ << kClearToEol << std::flush;
  line_active_ = true;
  pending_ = false;
}

void Progress::note(const std::string& text) {
  const std::string line = tty_ ? harness::wrap_words(text, width_, 2) : text;
  if (tty_ && line_active_) {
    out_ << "\r" << kClearToEol << line << "\n";
    draw();
    return;
  }
  out_ << line << "\n" << std::flush;
}

void Progress::busy(const std::string& what) {
  if (!tty_) return;
  std::string text = last_ + "  [" + what + "]";
  if (width_ > 0 && text.size() > static_cast<std::size_t>(std::max(1, width_ - 1)))
    text.resize(static_cast<std::size_t>(std::max(1, width_ - 1)));
  out_ << "\r" << text << kClearToEol << std::flush;
  line_active_ = true;
  pending_ = true;        // the status without the suffix is not on screen
  last_draw_ = -1e300;    // so the next update draws, however soon it comes
}

void Progress::finish(const std::string& summary) {
  if (tty_) {
    if (pending_) draw();
    if (line_active_) out_ << "\n";
    line_active_ = false;
  }
  if (!summary.empty()) out_ << (tty_ ? harness::wrap_words(summary, width_, 2) : summary) << "\n";
  out_ << std::flush;
}

// ---- StopFlag -------------------------------------------------------------------------------

namespace {

static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs lock-free atomics");
// A closed terminal (SIGHUP) stops a run as Ctrl-C and SIGTERM do: with a checkpoint.
constexpr int kSignals[3] = {SIGINT, SIGTERM, SIGHUP};
constexpr int kNumSignals = 3;
std::atomic<int> g_received{0};  // signals received since install
std::atomic<int> g_first{0};     // the first one's number
std::atomic<bool> g_replaced[kNumSignals];  // whether install() replaced kSignals[i]'s action
struct sigaction g_previous[kNumSignals];   // the actions install() replaced
std::mutex g_install_mutex;       // install / reset (never taken by the handler)

extern "C" void stop_handler(int sig) {
  if (g_received.fetch_add(1) == 0) {
    g_first.store(sig);
    return;
  }
  // The second signal: the previous actions back (temp_files' cleanup, or the default), then
  // the signal again; it is blocked while this handler runs, so it arrives on return.
  for (int i = 0; i < kNumSignals; ++i)
    if (g_replaced[i].load()) ::sigaction(kSignals[i], &g_previous[i], nullptr);
  ::raise(sig);
}

}  // namespace

void StopFlag::install() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  for (int i = 0; i < kNumSignals; ++i)
    if (g_replaced[i].load()) return;
  // temp_files installs its SIGINT / SIGTERM handler once, on the first TempFile: make it do so
  // now (a registered empty path, unlink("") fails harmlessly), so that it sits under ours.
  { const tmp::TempFile force_install(""); }
  g_received.store(0);
  g_first.store(0);
  for (int i = 0; i < kNumSignals; ++i) {
    struct sigaction old {};
    ::sigaction(kSignals[i], nullptr, &old);
    if (old.sa_handler == SIG_IGN) continue;  // e.g. a background job: leave it ignored
    g_previous[i] = old;
    struct sigaction sa {};
    sa.sa_handler = stop_handler;
    ::sigemptyset(&sa.sa_mask);
    for (int s : kSignals) ::sigaddset(&sa.sa_mask, s);
    sa.sa_flags = SA_RESTART;  // the step in flight goes on: its system calls are not cut
    g_replaced[i].store(true);
    ::sigaction(kSignals[i], &sa, nullptr);
  }
}

bool StopFlag::requested() { return g_received.load() > 0; }

int StopFlag::signal_number() { return g_first.load(); }

void StopFlag::reset_for_testing() {
  std::lock_guard<std::mutex> lock(g_install_mutex);
  for (int i = 0; i < kNumSignals; ++i)
    if (g_replaced[i].exchange(false)) ::sigaction(kSignals[i], &g_previous[i], nullptr);
  g_received.store(0);
  g_first.store(0);
}

}  // namespace m3::train
