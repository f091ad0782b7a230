// `m3h eval` (TRAINING.md §7.1): the validation loss and accuracy of a checkpoint's weights on
// some data.
//
//   loss      = Σ_batches Σ_r w[r]·(lse[r] − logits[r, tgt[r]]) / Σ w        (TRAINING.md §1)
//   accuracy  = the scored positions whose most likely token is the target, over all of them;
//               parity and modular also count whole sequences (rows) with every position right
//
// over `batches` validation batches val_batch(i, B, T), i = 0 … batches − 1, of the data
// (TRAINING.md §3: a text's held-out tail, a task's fixed validation rows): the batches the
// training run validates on, so a checkpoint's figure here is its run's "val loss" at equal
// B, T and batch count. The model runs forward only, on the checkpoint's weights, in its
// storage precision and scan mode, on the CPU reference or the GPU path.
//
// The data: text files (concatenated, make_text_dataset; the held-out fraction is the
// checkpoint's val_fraction unless given), a task by name and options, or — neither given —
// the task the checkpoint was trained on (a text run's file is not recorded: it must be given).
// Its vocabulary must be the model's.
#pragma once

#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "data.hpp"
#include "trainer.hpp"

namespace m3::train {

struct EvalOptions {
  std::string checkpoint;          // a checkpoint file
  std::string device = "cpu";      // "cpu" or "gpu"
  std::vector<std::string> data;   // text files, or
  double val_fraction = -1;        // < 0: the checkpoint's (text runs), else 0.05
  std::string task;                // a task, with
  Settings task_options;           // its options ("" task and no data: the checkpoint's task)
  Idx B = 0, T = 0;                // 0: the checkpoint's
  Idx batches = 8;                 // validation batches
};

struct EvalReport {
  CheckpointMeta meta;        // the checkpoint's
  std::string data;           // what was evaluated: "task parity" / "text 'a.txt'"
  bool sequences = false;     // the data counts whole sequences (parity, modular)
  Idx B = 0, T = 0, batches = 0;
  Precision storage = Precision::F32;
  ScanMode mode = ScanMode::Chunked;
  EvalResult result;          // loss and accuracy
};

// Throws m3::Error (one line) on a bad checkpoint, data the model cannot read (another
// vocabulary, a text too short for T) or a bad shape.
EvalReport evaluate_checkpoint(const EvalOptions& o);

}  // namespace m3::train
