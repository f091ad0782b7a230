// m3h eval's evaluation of a checkpoint (see evaluate.hpp).
#include "evaluate.hpp"

#include "backend.hpp"
#include "error.hpp"

namespace m3::train {

EvalReport evaluate_checkpoint(const EvalOptions& o) {
  const std::string where = "eval " + escape_for_message(o.checkpoint, 200);
  M3_REQUIRE(o.data.empty() || o.task.empty(), where, "give --data or --task, not both", "");
  M3_REQUIRE(o.batches >= 1, where, "--batches must be >= 1", "got ", o.batches);
  EvalReport rep;
  Config cfg;
  TrainState st;
  rep.meta = read_checkpoint(o.checkpoint, &cfg, &st);
  rep.B = o.B > 0 ? o.B : int_setting(rep.meta, "B", 8);
  rep.T = o.T > 0 ? o.T : int_setting(rep.meta, "T", 256);
  rep.batches = o.batches;
  const std::string* precision = setting(rep.meta, "precision");
  const std::string* scan = setting(rep.meta, "scan");
  M3_REQUIRE(precision && scan, where, "the checkpoint records no precision or scan mode", "");
  rep.storage = parse_precision(*precision);
  rep.mode = parse_scan_mode(*scan);

  std::unique_ptr<Dataset> data;
  if (!o.data.empty()) {
    double fraction = o.val_fraction;
    if (fraction < 0) {
      const std::string* v = setting(rep.meta, "val_fraction");
      fraction = v ? std::stod(*v) : 0.05;
    }
    data = make_text_dataset(o.data, fraction, rep.T);
    rep.data = "text '" + escape_for_message(data->settings().front().second, 200) + "'";
  } else if (!o.task.empty()) {
    data = make_task(o.task, o.task_options, rep.T);
    rep.data = "task " + o.task;
  } else {
    // The checkpoint's own task, at the T evaluated here.
    CheckpointMeta at_t = rep.meta;
    for (auto& kv : at_t.settings)
      if (kv.first == "T") kv.second = std::to_string(rep.T);
    data = checkpoint_task(at_t);
    M3_REQUIRE(data != nullptr, where, "the checkpoint was trained on text, whose file it does not record",
               "give the file: --data FILE");
    rep.data = "task " + data->kind() + " (the checkpoint's)";
  }
  M3_REQUIRE(data->vocab() == cfg.vocab_size, where,
             "the data's vocabulary is not the model's", rep.data, " has ", data->vocab(),
             " symbols, the model ", cfg.vocab_size);
  rep.sequences = data->sequence_accuracy();
  validate_run(cfg, rep.B, rep.T);

  BackendSpec spec{cfg, rep.B, rep.T, rep.mode, rep.storage, Recompute::None};
  std::unique_ptr<Backend> be = make_backend(o.device, spec);
  be->set_state(st);
  std::vector<Batch> val;
  for (Idx i = 0; i < rep.batches; ++i) val.push_back(data->val_batch(i, rep.B, rep.T));
  rep.result = evaluate(*be, val);
  return rep;
}

}  // namespace m3::train
