// The run directory of TRAINING.md §5 (`--out DIR`). What a run writes there, and nothing else:
//
//   config.txt            the resolved options, loadable with --config (the caller formats it);
//                         written atomically (temp + rename)
//   metrics.csv           one row per logged step, header kMetricsHeader; empty cells for values
//                         not measured at that step; doubles as the shortest text that reads back
//                         to the same double (exact_double), tokens_per_s with one decimal
//   ckpt-<step>.h5        checkpoints, the step as 8 digits or more: "ckpt-00000120.h5"
//   loss.png              train and validation loss against step (gnuplot)
//   step_times.csv        m3h train --step-times: one row per step, header kStepTimesHeader, the
//                         device times of the step's parts in ms (StepTimes, backend.hpp) with
//                         four decimals; written atomically once the run ends
//   step_times.png        those times against step (gnuplot): a device that slows as the run
//                         goes on (its clocks under sustained load) shows here
//   *.tmp.<pid>[.<n>]     the temporaries of the above while they are written (loss.gp.tmp.<pid>,
//                         loss.log.tmp.<pid>: the gnuplot script and its output; step_times.gp
//                         and step_times.log likewise)
//
// The final checkpoint keeps its step name; prune_checkpoints never deletes the checkpoint of
// the step it is told is final. --force removes exactly these names (is_run_file) and leaves
// every other file of the folder alone.
//
// Resume: metrics.csv keeps the rows of the steps the checkpoint has done (step <= k) and drops
// the later ones, so k steps + resume + N−k steps give the same rows as N steps straight;
// step_times.csv likewise keeps the rows of the steps before the resumed segment's first.
//
// Ownership: a run folder belongs to one writer for the run's life. The writer holds an
// exclusive flock on "run.lock" in the folder, whose text names it ("pid <pid> on <host>"); a
// second writer (a new run, --force or --resume) is refused naming that holder. The kernel drops
// the flock when the process ends however it ends, so a lock file left by a crash is stale and
// taken over. The file is removed on a clean exit.
//
// Identity: each new run draws a run id (16 hex digits). config.txt carries it as the comment
// "# run-id = <id>" (so the file still loads with --config), every metrics.csv row ends with it
// and every checkpoint records it, so a checkpoint resumes only into its own run and a row of
// another run is never mixed into metrics.csv.
#pragma once

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config.hpp"

namespace m3::train {

struct StepTimes;  // backend.hpp

constexpr const char* kMetricsHeader =
    "step,loss,val_loss,accuracy,lr,grad_norm,tokens_per_s,loss_scale,skipped,verify_pct,run_id";
// The lock file of a run folder (not a run file: --force never removes a live run's lock).
constexpr const char* kRunLock = "run.lock";
// period_ms runs to the next step's start where to_next is 1, else to the step's own end.
constexpr const char* kStepTimesHeader =
    "step,forward_ms,uploads_ms,backward_ms,optimizer_ms,period_ms,to_next";

// True for the names a run writes (the list above): what --force may remove.
bool is_run_file(const std::string& name);

// A checkpoint named by the user: a file as it is, or a run folder's latest checkpoint (the
// ckpt-<step>.h5 of the highest step). A folder without one is an m3::Error naming it.
// `option` names the option in that message ("--resume", "--checkpoint").
std::string resolve_checkpoint(const std::string& path, const std::string& option);

class RunDir {
 public:
  // Opens or creates `dir`.
  //   new run (resume = false): dir must not exist (it is created), be empty, or — with force —
  //     have the run files removed (other files stay). A dir holding another run (config.txt or
  //     metrics.csv) without force: m3::Error "--out DIR holds another run (use --resume FILE to
  //     continue it or --force to start over)"; a non-empty dir without a run, without force:
  //     an error too.
  //   resume = true: dir must exist and hold a run.
  //   A path that exists and is not a directory is an error either way.
  //   lock = true: the folder's lock is taken first (see Ownership above); a folder locked by a
  //     live process is refused whatever resume and force say. lock = false (m3h plot, a reader
  //     of a finished or running run): no lock, resume's rules.
  RunDir(const std::string& dir, bool resume, bool force, bool lock = true);
  ~RunDir();
  RunDir(const RunDir&) = delete;  // it owns the folder's lock
  RunDir& operator=(const RunDir&) = delete;

  const std::string& dir() const { return dir_; }
  std::string path(const std::string& name) const;  // dir/name

  void write_config(const std::string& text);  // config.txt, atomic

  // The run's id: drawn for a new run; a resumed run's from its config.txt ("" for a run
  // written before run ids).
  const std::string& run_id() const { return run_id_; }

  // A new run that failed before its first step: removes the files it wrote (config.txt,
  // metrics.csv) and the folder when this RunDir created it and it is empty again, so that
  // the same command can simply be run again. Never throws.
  void discard_new_run() noexcept;

  // Opens metrics.csv for appending. A new run: a fresh file holding the header. Resuming at
  // step resume_step: the existing rows with step <= resume_step are kept and later ones
  // dropped (the file rewritten atomically; a torn last line without its newline is dropped
  // too). The kept rows must be steps 1 … resume_step, in order, each of this run's id: a gap
  // (a missing file included, when resume_step > 0) or a row of another run is an m3::Error and
  // the file is left as it was. A header other than kMetricsHeader or a malformed row is an
  // m3::Error naming the file and the line.
  void open_metrics(Idx resume_step);
  struct Row {
    Idx step = 0;
    double loss = 0;
    std::optional<double> val_loss, accuracy;
    double lr = 0, grad_norm = 0, tokens_per_s = 0, loss_scale = 1;
    Idx skipped = 0;
    std::optional<double> verify_pct;
  };
  void append(const Row& r);  // one line, flushed: format_row(r) and the run id
  static std::string format_row(const Row& r);  // the line's cells before the run id

  // dir/ckpt-<step, 8 digits or more>.h5
  std::string checkpoint_path(Idx step) const;
  // After a checkpoint is written: deletes every ckpt-<digits>.h5 of the folder except the
  // newest `keep` (keep >= 1, by step) and the one of final_step (the run's final checkpoint;
  // −1 when there is none yet). Other names are never touched.
  void prune_checkpoints(Idx keep, Idx final_step);

  // Draws loss.png (train loss per row, validation loss where measured, against step) from
  // metrics.csv with gnuplot (pngcairo, else png), written atomically. "" on success; a one-line
  // note instead of throwing when it cannot draw: "loss.png not drawn: gnuplot not found
  // (apt-get install gnuplot-nox)", no rows yet, or gnuplot's own first error line.
  std::string plot_loss() const;

  // Writes step_times.csv: t[k] is step first_step + k. A new run: the header and these rows.
  // Resuming: the existing file's rows of steps before first_step, then these (the file
  // rewritten atomically; a torn last line dropped); a header other than kStepTimesHeader or a
  // malformed row is an m3::Error naming the file and the line, and the file is left as it was.
  void write_step_times(const std::vector<StepTimes>& t, Idx first_step);
  // Draws step_times.png from step_times.csv (period, forward + backward, forward, backward,
  // optimizer and the forward's uploads against step), as plot_loss draws loss.png: "" or a one-line note
  // ("step_times.png not drawn: …").
  std::string plot_step_times() const;

 private:
  void open(bool force, bool lock);  // the constructor's rules
  std::string dir_;
  bool resume_ = false;
  std::string run_id_;
  int lock_fd_ = -1;        // the flock on run.lock, held for the object's life
  bool created_dir_ = false;
  struct FileCloser {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::unique_ptr<std::FILE, FileCloser> metrics_;
};

}  // namespace m3::train
