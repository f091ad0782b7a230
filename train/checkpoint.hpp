// Training checkpoints (TRAINING.md §4): one HDF5 file per checkpoint, written atomically by the
// golden store (h5::Writer: temporary "<final>.tmp.<pid>.<n>" + fsync + rename), holding
//
//   /meta                 attributes only:
//                           kind = "checkpoint", schema_version (int, kCheckpointSchemaVersion)
//                           settings = "d_model,d_state,…"  the setting names, in order
//                           <name> = "<value>"              every setting, a string each
//                           step, good_steps, skipped, data_size   int64
//                           loss_scale                      f64 (exact)
//                           data_hash = "0123456789abcdef"  16 lowercase hex digits (a uint64)
//                           git_revision                    string
//                           run_id                          string: the run that wrote it
//                                                           (absent in a checkpoint written
//                                                           before runs had ids)
//                           elapsed_s                       f64: seconds the run had taken
//                                                           at this step, resumes included
//                                                           (absent: 0)
//   /weights/<p>          f32 masters, the names and shapes of a golden file's /weights
//                         ("input_proj_w", "L0/in_proj_w", …, "norm_f_weight", "head_w")
//   /optimizer/m/<p>      f32 first moments, same names and shapes
//   /optimizer/v/<p>      f32 second moments, same names and shapes
//
// In memory the arrays are flat f32 buffers in param_layout(cfg) order (TrainState); the gaps
// between slots are not stored and read back as zero. A float goes to the file and back with
// the same bits (f32 → double → f32 is exact); loss_scale is an f64 attribute (exact); setting
// values are text, and doubles among them are written by exact_double (shortest text that
// reads back to the same double).
//
// `settings` are what must match on resume (resume_mismatch): the model config (config_settings:
// the Config field names of MODEL.md), the data / task settings, the optimizer settings (lr,
// warmup, steps, min_lr_ratio, beta1, beta2, eps, wd, clip), precision, scan, seed, B, T,
// grad_accum — the caller's list, in the caller's order. The model config is rebuilt from the
// settings (config_from_settings), so a checkpoint describes its own shapes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"

namespace m3::train {

constexpr int kCheckpointSchemaVersion = 1;

using Settings = std::vector<std::pair<std::string, std::string>>;

// The shortest decimal text that reads back (strtod) to exactly v: "0.1", "1e-08", "nan".
std::string exact_double(double v);

// The model config as settings, in this order: d_model, d_state, expand, headdim, ngroups,
// n_layers, rope_fraction, a_floor, is_outproj_norm (0/1), input_dim, input_proj_identity (0/1),
// chunk_size, vocab_size. Doubles by exact_double.
Settings config_settings(const Config& cfg);
// The Config those names describe (other names are ignored); throws m3::Error naming a missing
// or unparsable field, or the rule an invalid config breaks. `where` names the source (a file).
Config config_from_settings(const Settings& settings, const std::string& where = "settings");

// Everything a checkpoint records besides the arrays.
struct CheckpointMeta {
  Settings settings;
  Idx step = 0;  // optimizer steps done
  double loss_scale = 1.0;
  Idx good_steps = 0;  // finite steps in a row since the loss scale last changed (f16)
  Idx skipped = 0;     // steps skipped for a non-finite gradient
  Idx data_size = 0;   // text data: the file's size in bytes (0 for a task)
  std::uint64_t data_hash = 0;  // text data: the hash of its bytes (0 for a task)
  std::string git_revision;     // the writer's golden::git_revision()
  std::string run_id;           // the run folder's id (RunDir::run_id); "" = none recorded
  double elapsed_s = 0;         // seconds the run had taken at `step` (over all its segments)
};

// Flat f32 buffers in param_layout(cfg) order, layout.total floats each.
struct TrainState {
  std::vector<float> params, m, v;
};

// Writes the checkpoint atomically. Throws m3::Error (naming the file) when the file exists and
// !overwrite, when the buffers are not layout.total floats, when a setting name is empty,
// repeated, holds a character other than [A-Za-z0-9_.-], or is one of the fixed /meta names,
// when the settings lack a config field or do not rebuild exactly cfg (config_from_settings),
// or when a value is not finite (naming the dataset).
void write_checkpoint(const std::string& path, const Config& cfg, const CheckpointMeta& meta,
                      const TrainState& st, bool overwrite);

// The run settings a reader of a checkpoint parses: B, T, steps, warmup, grad_accum, eval_len
// non-negative integers; lr, min_lr_ratio, beta1, beta2, eps, wd, clip, val_fraction numbers;
// precision f32 | bf16 | f16; scan seq | chunked. Throws m3::Error (led by `where`) naming the
// first bad one as "/meta attribute 'T' is not a non-negative integer ('abc')". read_checkpoint
// applies it; so does m3h import before it writes a checkpoint of a file's settings.
void check_run_settings(const Settings& settings, const std::string& where);

// Reads and checks a checkpoint: kind, schema version, the settings (the config they describe
// must be valid), every dataset present as f32 with the shape that config gives and nothing
// else under /weights and /optimizer, every value finite. Every error is one m3::Error line
// naming the file and the attribute or dataset. Returns the meta; fills *cfg (rebuilt from the
// settings) and *st (each buffer layout.total floats, the gaps zero). cfg / st may be null.
CheckpointMeta read_checkpoint(const std::string& path, Config* cfg, TrainState* st);

// An integer run setting of a checkpoint read by read_checkpoint (which refuses a file whose B,
// T, steps, warmup, grad_accum or eval_len is not a non-negative integer, naming the attribute
// and the value); `fallback` when the checkpoint has no such setting.
Idx int_setting(const CheckpointMeta& meta, const std::string& name, Idx fallback);
// A run setting of a checkpoint as recorded, or null when it has none.
const std::string* setting(const CheckpointMeta& meta, const std::string& name);

// The command-line option of m3h train that sets a checkpoint setting, for messages: "--lr",
// "--d-model", "--layers" (n_layers), "--dtype" (precision), "--task-opt n_min" (a task's
// option); a setting no option sets says where it comes from ("vocab_size (the data's
// vocabulary)", "a_floor (fixed by the model)").
std::string setting_option(const std::string& setting);

// "" when a run with `now` may resume from `saved`; otherwise one line naming the FIRST setting
// (in saved's order, then those only `now` has) that differs, by its option (setting_option),
// with both values:
//   "resume: --lr differs from the checkpoint's: checkpoint 0.001, now 0.002"
// Values are equal when their text is, or when both read as the same number ("1e-3" = "0.001").
// Then the data: "resume: the data file differs from the one the checkpoint was trained on:
// checkpoint 1234 bytes, hash 0123456789abcdef; now 1200 bytes, hash fedcba9876543210".
std::string resume_mismatch(const CheckpointMeta& saved, const CheckpointMeta& now);

}  // namespace m3::train
