// The data of training (TRAINING.md §3): byte-level text files and three synthetic tasks, every
// batch a pure function of integers.
//
// Generation rules
// ----------------
// * Counter-based: row r of training micro-batch `micro` of step `step` is drawn from its own
//   SplitMix64 stream (m3::Rng) seeded by row_seed(seed, step, micro, r, stream), with
//   stream = kTrainStream; nothing else is read. So a batch is the same bytes for the same
//   arguments, the loader's state is the step number alone, and row r does not depend on B:
//   the rows of a batch of B rows are the first B rows of any larger batch (data-parallel
//   ranks may take slices of the global micro-batch, see slice_rows).
// * Validation row j (= i·B + b of val_batch(i, B, T)) does not depend on the training seed:
//   text takes window j (mod the number of windows) at stride T of the validation part; a task
//   draws the row from row_seed(kValSeed, 0, 0, j, kValStream), a stream that training never
//   uses (training steps are ≥ 1 and use kTrainStream).
// * Integers in [0, n) are drawn by rejection (uniform_index), never by std::*_distribution,
//   so the bytes are the same on every machine. Draws happen in the order listed below.
// * Unscored positions have target 0 and weight 0; scored positions weight 1.
//
// text (make_text_dataset): V = 256, a token is a byte. The file has S bytes; the validation
//   part is the last S_val = ⌊S · val_fraction⌋ bytes, the training part the first
//   S_train = S − S_val. Training row: offset o = uniform_index(S_train − T), tok[t] = x[o+t],
//   tgt[t] = x[o+t+1] (t < T), all scored: the window x[o .. o+T] lies in the training part.
//   Validation window k: tok[t] = x[S_train + kT + t], tgt[t] = x[S_train + kT + t + 1];
//   there are ⌊(S_val − 1)/T⌋ windows (each needs T+1 bytes inside the validation part).
//
// parity (options n_min ≥ 1 default 3, n_max default min(64, T)): V = 3, tokens 0 and 1 are
//   bits, 2 = PAD. Draws: n = n_min + uniform_index(n_max − n_min + 1), then n bits
//   (next() >> 63). Row: tok[t] = bit_t, tgt[t] = bit_0 ⊕ … ⊕ bit_t, scored, for t < n;
//   tok[t] = PAD, tgt 0, unscored for n ≤ t < T. Needs T ≥ n_max. Spelling "0", "1", "." (PAD).
//   A longer evaluation is another parity Dataset, e.g. n_min = n_max = 256 with T = 256.
//
// modular (options m ∈ [2, 36] default 5, n_min ≥ 1 default 3 terms, n_max default
//   min(32, ⌊(T+1)/2⌋) terms): V = m + 3: tokens 0…m−1 are the digits, m = '+', m+1 = '-',
//   m+2 = PAD. Draws: the number of terms k = n_min + uniform_index(n_max − n_min + 1); then
//   d_0 = uniform_index(m); then for j = 1…k−1: the sign (next() >> 63: 1 = '-', 0 = '+') and
//   d_j = uniform_index(m). Row: d_0 op_1 d_1 op_2 d_2 … d_{k−1} (length 2k − 1), then PAD.
//   The target at digit position 2j is the running value v_j = (d_0 ± d_1 … ± d_j) mod m in
//   0…m−1, scored; operator and PAD positions are unscored. Needs T ≥ 2·n_max − 1. Spelling:
//   digits "0"…"9" then "a"…"z" (base 36), "+", "-", "." (PAD).
//
// selective-copy (options K ≥ 1 default 16 data tokens, alphabet ∈ [1, 36] default 8; the
//   sequence length L is T): V = alphabet + 2: tokens 0…alphabet−1 are data, alphabet = NOISE,
//   alphabet+1 = MARKER. With P = T − K − 1 noise positions: draws: the K data tokens
//   c_0…c_{K−1} = uniform_index(alphabet) each, then K distinct positions of 0…P−1 (a partial
//   Fisher–Yates shuffle of 0…P−1: for i < K, swap slot i with slot i + uniform_index(P − i)),
//   sorted ascending p_0 < … < p_{K−1}. Row: tok[p_j] = c_j, every other t < P is NOISE,
//   tok[P] = MARKER, tok[P+1+j] = NOISE for j < K (the answer positions); tgt[P+1+j] = c_j,
//   scored; everything else unscored. Needs T ≥ 2K + 1. Spelling: data "0"…"9", "a"…"z",
//   "." (NOISE), "|" (MARKER).
//
// Errors are m3::Error, one line, naming the file or the task and option; a file name or
// option value is shown cut to 200 characters with control characters escaped.
// Thread safety: a Dataset is immutable after construction; every method is const and may be
// called from several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "params.hpp"

namespace m3::train {

// One micro-batch, rows r = b*T + t.
struct Batch {
  Idx B = 0, T = 0;
  std::vector<std::int32_t> tok, tgt;  // [B*T], each in 0..V-1
  std::vector<float> w;                // [B*T], 1 = scored, 0 = not
  Idx scored() const;                  // N = number of w == 1
};

// Rows [r0, r0 + n) of a batch (a data-parallel rank's share of a micro-batch).
Batch slice_rows(const Batch& b, Idx r0, Idx n);
// The first `rows` rows of a batch, each cut to its first T positions (the slices the harness
// judges while training, and cuts of a run's batch). An m3::Error outside the batch.
Batch cut_batch(const Batch& b, Idx rows, Idx T);

// Stream ids of row_seed.
inline constexpr std::uint64_t kTrainStream = 1;
inline constexpr std::uint64_t kValStream = 2;
inline constexpr std::uint64_t kValSeed = 0x7A11DA7A5EED0001ull;  // tasks' fixed validation seed

// The counter-based generator's seed: a SplitMix64 finaliser chain over (seed, stream, step,
// micro, row); every batch is a pure function of these integers, so the loader's state is the
// step number alone.
std::uint64_t row_seed(std::uint64_t seed, Idx step, Idx micro, Idx row, std::uint64_t stream);

// A uniform integer in [0, n), n ≥ 1, by rejection on rng.next() (unbiased, portable).
std::uint64_t uniform_index(Rng& rng, std::uint64_t n);

// FNV-1a 64 of bytes (offset basis 0xcbf29ce484222325, prime 0x100000001b3).
std::uint64_t fnv1a64(const void* data, std::size_t n);

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual Idx vocab() const = 0;
  virtual std::string kind() const = 0;  // "text", "parity", "modular", "selective-copy"
  // The settings that define the data, as name=value pairs in a fixed order (they go into
  // checkpoints; a resume with different values is refused by name):
  //   text            {"data", path}, {"val_fraction", shortest round-trip decimal}
  //   parity          {"task","parity"}, {"n_min",…}, {"n_max",…}
  //   modular         {"task","modular"}, {"m",…}, {"n_min",…}, {"n_max",…}
  //   selective-copy  {"task","selective-copy"}, {"K",…}, {"alphabet",…}
  virtual std::vector<std::pair<std::string, std::string>> settings() const = 0;
  virtual Idx content_size() const { return 0; }            // text: file size in bytes
  virtual std::uint64_t content_hash() const { return 0; }  // text: fnv1a64 of the bytes
  // The T the data allows, min_T ≤ T ≤ max_T (text: 1 … min(S_train, S_val) − 1; tasks: the
  // minimum of the rules above … no limit, reported as 2^40).
  virtual Idx min_T() const { return 1; }
  virtual Idx max_T() const { return Idx{1} << 40; }
  // Training micro-batch `micro` (≥ 0) of step `step` (≥ 1), B ≥ 1 rows of length T. Pure:
  // same arguments → same bytes. A T outside [min_T, max_T] is an m3::Error.
  virtual Batch train_batch(std::uint64_t seed, Idx step, Idx micro, Idx B, Idx T) const = 0;
  // Validation batch i (0-based) of B rows of length T, fixed for the whole run and
  // independent of the training seed: rows j = i·B + b (text: window j mod val_windows(T)).
  virtual Batch val_batch(Idx i, Idx B, Idx T) const = 0;
  // How many distinct validation windows exist for T (text); tasks: a large number (2^40).
  virtual Idx val_windows(Idx T) const = 0;
  virtual bool sequence_accuracy() const { return false; }  // parity and modular: true
  // For sampling: text ↔ tokens (text: bytes; tasks: the spellings above, one character per
  // token). encode throws m3::Error on a character outside the vocabulary, decode on a token
  // outside 0..V-1.
  virtual std::vector<std::int32_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<std::int32_t>& tokens) const = 0;
};

// --data FILE: byte-level text, V = 256, split as above (0 < val_fraction < 1). Reads the
// whole file once. Errors (one line, naming the file): missing, not a regular file,
// unreadable, empty, a training or validation part shorter than T+1 bytes (with how many bytes
// it has and how many are needed), a bad val_fraction, T < 1.
std::unique_ptr<Dataset> make_text_dataset(const std::string& path, double val_fraction, Idx T);
// Several files (--data A --data B): their bytes concatenated in the order given, nothing
// between them, as one text of S = Σ sizes bytes split as above (so the validation part is the
// end of the last file); its name, in settings and messages, the paths joined by ",". The
// same errors, naming the file; an empty list is an error.
std::unique_ptr<Dataset> make_text_dataset(const std::vector<std::string>& paths,
                                           double val_fraction, Idx T);

// --task NAME with options "key=value" (e.g. {"n_min","3"},{"n_max","64"}); T is the training
// length (it sets defaults and is checked against the task's minimum). Unknown task or option,
// an option given twice, a bad value, or a T that is too small → m3::Error naming it.
std::unique_ptr<Dataset> make_task(const std::string& name,
                                   const std::vector<std::pair<std::string, std::string>>& options,
                                   Idx T);
std::vector<std::string> task_names();  // parity, modular, selective-copy

struct Accuracy {
  Idx tokens = 0, correct = 0, sequences = 0, sequences_correct = 0;
  double token() const;     // correct / tokens; 0 when tokens = 0
  double sequence() const;  // sequences_correct / sequences; 0 when sequences = 0
  void add(const Accuracy& o);
};

// Over the scored positions of a batch: argmax[r] == tgt[r]; a sequence (row) counts as
// correct when every scored position of the row is right (rows with no scored position are
// not counted). argmax has B*T entries.
Accuracy accuracy(const Batch& b, const std::vector<std::int32_t>& argmax);

}  // namespace m3::train
