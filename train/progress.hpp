// The training console (TRAINING.md §5) and Ctrl-C handling.
//
// Progress prints one status text per step:
//   "step 120/1000  loss 2.3456 (avg 2.4012)  val 2.4012  lr 3.00e-04  12345 tok/s  elapsed 0:01:23  eta 0:10:05"
// (avg: the losses smoothed, an exponential moving average a_k = β·a_{k−1} + (1 − β)·loss_k
// with β = kLossSmoothing (about the last 20 steps), divided by 1 − β^k so that the first
// steps are not pulled towards 0; k counts this process's updates. val: the last validation
// loss given, "-" before the first. elapsed: the run's time, set_elapsed_before's seconds (the
// time before a resume) plus this process's; eta from the mean time per step since the first
// update, so a resumed run estimates from its own steps.)
// A terminal narrower than the text (set_width) gets the fields that fit, the others dropped
// in this order: tok/s, lr, elapsed, avg; then the fields one space apart; then the text cut
// to width − 1 columns (a full-width line would wrap on some terminals); its notes and the
// summary are broken at spaces to the width. A log gets every field and every line whole,
// whatever the width.
//   tty      one updating line: "\r" + text + "\x1b[K" (clear to the end of the line), redrawn at
//            most every 0.1 s and always at the last step; note() clears it, prints the note on
//            a line of its own and redraws it below; busy(what) shows "  [what]" after the
//            status until the next update; finish() leaves the last state on screen, ends the
//            line and prints the summary.
//   not tty  the text as a plain line at every step that is a multiple of log_every and at the
//            last step (total_steps); note() and finish() print their line.
// The clock is injectable (seconds, monotonic) so the output is testable.
//
// StopFlag: the FIRST SIGINT / SIGTERM only sets a flag (the loop finishes its step, writes a
// checkpoint and exits 130); the second restores the actions that were there before install()
// — the temporary-file cleanup of golden/temp_files.cpp, which removes every registered
// temporary and then dies by the signal's default action — and re-raises, so no temporary file
// is left. install() first makes temp_files install its handler (it installs lazily, once, and
// would otherwise replace ours later), then chains to it. The handler touches lock-free
// atomics, sigaction() and raise() only: async-signal-safe. A signal ignored at install (a
// background job) stays ignored.
#pragma once

#include <functional>
#include <iostream>
#include <optional>
#include <string>

#include "config.hpp"

namespace m3::train {

inline constexpr double kLossSmoothing = 0.95;

class Progress {
 public:
  using Clock = std::function<double()>;  // seconds; empty = std::chrono::steady_clock
  Progress(Idx total_steps, Idx log_every, bool tty, std::ostream& out = std::cout,
           Clock now = {});
  void update(Idx step, double loss, std::optional<double> val_loss, double lr,
              double tokens_per_s);
  void note(const std::string& line);
  // tty: the latest status text with "  [what]" after it, drawn now, until the next update
  // (which then always redraws): what a long pause between steps is doing (a verification
  // check takes seconds). Not tty: nothing (the log's lines stay one per logged step).
  void busy(const std::string& what);
  void finish(const std::string& summary);
  // The columns of the terminal (0: no limit); only a tty's status line is fitted to them.
  void set_width(int columns) { width_ = columns; }
  // Seconds the run had taken before this process (a resumed run's), added to "elapsed".
  void set_elapsed_before(double seconds) { elapsed_before_ = seconds; }
  // The seconds the run has taken so far: the time before this process and this process's.
  double elapsed() const;

  static std::string hms(double seconds);  // "h:mm:ss" (hours unbounded), "-:--:--" if unknown

 private:
  double now() const;
  void draw();  // tty: "\r" + last_ + clear to the end of the line

  Idx total_, log_every_;
  bool tty_;
  std::ostream& out_;
  Clock clock_;
  double t0_ = 0, last_draw_ = -1e300;
  Idx first_step_ = -1;  // the step of the first update
  std::optional<double> val_;  // the last validation loss given
  std::string last_;           // the latest status text
  bool pending_ = false;       // tty: last_ not drawn yet (throttled)
  bool line_active_ = false;   // tty: the status line is on screen, not ended
  int width_ = 0;              // columns of the terminal (0: no limit)
  double elapsed_before_ = 0;  // seconds of the run before this process
  double avg_ = 0;             // the moving average of the losses, not yet debiased
  Idx updates_ = 0;            // losses averaged so far
};

class StopFlag {
 public:
  static void install();
  static bool requested();
  static int signal_number();  // the first signal received, 0 before one
  // Restores the actions install() replaced and clears the flag (for tests).
  static void reset_for_testing();
};

}  // namespace m3::train
