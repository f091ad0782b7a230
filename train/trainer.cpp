// The training loop and the sampler (trainer.hpp has the step's math and the run's rules).
#include "trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cmath>
#include <filesystem>
#include <ostream>
#include <sstream>

#include "backbone_gpu.hpp"
#include "bench.hpp"
#include "context.hpp"
#include "digest_record.hpp"  // hex16
#include "compare.hpp"
#include "device_compare.hpp"
#include "gpu_lineup.hpp"
#include "error.hpp"
#include "golden.hpp"
#include "lm.hpp"
#include "problem.hpp"
#include "progress.hpp"
#include "report.hpp"
#include "resources.hpp"
#include "run.hpp"
#include "run_dir.hpp"
#include "terminal.hpp"

namespace m3::train {

double scored_positions(const std::vector<Batch>& micro) {
  double n = 0;
  for (const Batch& b : micro) n += static_cast<double>(b.scored());
  return n;
}

StepResult train_step(Backend& be, const std::vector<Batch>& micro, Idx t, const OptimConfig& o,
                      LossScaler& scaler, bool staged, const std::function<void()>& meanwhile) {
  M3_REQUIRE(!micro.empty(), "train step", "no micro-batch", "");
  const double n = scored_positions(micro);
  M3_REQUIRE(n > 0, "train step", "the step's batches have no scored position (N = 0)",
             "every weight of the step is 0: the loss is undefined");
  const double scale = scaler.scale;
  StepResult r;
  r.lr = learning_rate(o, t);
  be.zero_grads();
  for (std::size_t k = 0; k < micro.size(); ++k) {
    if (k == 0 && staged)
      be.forward_staged();
    else
      be.forward(micro[k], n);
    be.backward(scale);
    if (k + 1 == micro.size() && meanwhile) meanwhile();  // the device runs the last backward
    r.loss += be.loss();
  }
  const double g_scaled = be.grad_norm();
  r.finite = std::isfinite(g_scaled);
  const bool apply = scaler.update(r.finite);
  if (!apply) {
    r.skipped = true;
    r.grad_norm = std::nan("");
    return r;
  }
  r.grad_norm = g_scaled / scale;
  if (!r.finite) return r;  // bf16/f32: the caller stops the run; nothing is applied
  be.adamw(adamw_scalars(o, t, clip_coefficient(r.grad_norm, o.clip), scale));
  return r;
}

EvalResult evaluate(Backend& be, const std::vector<Batch>& batches) {
  EvalResult e;
  double weighted = 0, n = 0;
  for (const Batch& b : batches) {
    const double nb = static_cast<double>(b.scored());
    if (nb == 0) continue;
    be.forward(b, nb);
    weighted += be.loss() * nb;
    n += nb;
    e.acc.add(accuracy(b, be.argmax()));
  }
  e.loss = n > 0 ? weighted / n : std::nan("");
  return e;
}

Problem verification_problem(const Config& cfg, const std::vector<float>& params,
                             const Batch& live, bool whole) {
  Batch cut = whole ? live : cut_batch(live, 1, std::min<Idx>(live.T, 256));
  Problem pb;
  pb.cfg = cfg;
  pb.B = cut.B;
  pb.T = cut.T;
  pb.params = cast_params<double>(from_flat(params, cfg, param_layout(cfg)));
  pb.tok = std::move(cut.tok);
  pb.tgt = std::move(cut.tgt);
  pb.w = std::move(cut.w);
  if (pb.scored() == 0) std::fill(pb.w.begin(), pb.w.end(), 1.0f);
  pb.states = zero_states<double>(cfg, pb.B);
  return pb;
}

Problem training_batch_problem(const CheckpointMeta& meta, const Config& cfg,
                               const std::vector<float>& params,
                               const std::vector<std::string>& data, Idx step, Idx micro, Idx B,
                               Idx T, const std::string& where) {
  const Idx run_B = int_setting(meta, "B", 0), run_T = int_setting(meta, "T", 0);
  const std::string* seed = setting(meta, "seed");
  M3_REQUIRE(run_B > 0 && run_T > 0 && seed, where,
             "the checkpoint records no B, T or seed of its run", "");
  M3_REQUIRE(step >= 1 && micro >= 0 && micro < int_setting(meta, "grad_accum", 1), where,
             "no such training batch: steps count from 1, micro-batches from 0 below grad_accum",
             "step ", step, ", micro-batch ", micro);
  if (B == 0) B = run_B;
  if (T == 0) T = run_T;
  M3_REQUIRE(B >= 1 && B <= run_B && T >= 1 && T <= run_T, where,
             "a cut of the batch has at most the run's rows and positions", "B ", B, " T ", T,
             "; the run's B ", run_B, " T ", run_T);
  std::unique_ptr<Dataset> ds;
  if (data.empty()) {
    ds = checkpoint_task(meta);
    M3_REQUIRE(ds != nullptr, where, "the run trained on text, whose file the checkpoint does not record",
               "give the file: --data FILE");
  } else {
    const std::string* fraction = setting(meta, "val_fraction");
    ds = make_text_dataset(data, fraction ? std::stod(*fraction) : 0.05, run_T);
    M3_REQUIRE(ds->content_size() == meta.data_size && ds->content_hash() == meta.data_hash, where,
               "the text is not the run's",
               "the checkpoint's ", meta.data_size, " bytes, hash ", harness::hex16(meta.data_hash),
               "; given ", ds->content_size(), " bytes, hash ", harness::hex16(ds->content_hash()));
  }
  M3_REQUIRE(ds->vocab() == cfg.vocab_size, where, "the data's vocabulary is not the model's",
             ds->vocab(), " symbols, the model ", cfg.vocab_size);
  const Batch full = ds->train_batch(std::stoull(*seed), step, micro, run_B, run_T);
  return verification_problem(cfg, params, cut_batch(full, B, T), true);
}

// The verdict is m3h compare's on the same problem, end to end in the run's scan mode: oracle
// "gpu", `m3h compare --device gpu --oracle gpu` on the whole batch (harness/device_compare.hpp);
// "cpu", the judged lineups against reference<double> on the slice (gpu_lineup.hpp: the subject
// beside the emulation of its storage, with the perturbed oracle's conditioning term).
VerifyResult verify_live_batch(const Config& cfg, const std::string& device, ScanMode mode,
                               Precision storage, const std::vector<float>& params,
                               const Batch& live, const std::string& oracle, gpu::Fault fault) {
  M3_REQUIRE(oracle == "cpu" || oracle == "gpu", "verify", "the oracle is cpu or gpu", oracle);
  M3_REQUIRE(oracle == "cpu" || device == "gpu", "verify", "the GPU oracle judges the GPU path",
             "device ", device);
  const Problem pb = verification_problem(cfg, params, live, oracle == "gpu");
  harness::RunSpec spec;
  spec.source = oracle == "gpu" ? "the live training batch" : "a slice of the live training batch";
  spec.cfg = cfg;
  spec.seed = pb.seed;  // what keys the perturbed draws, as the report's header says
  spec.B = pb.B;
  spec.T = pb.T;
  spec.modes = {mode};
  spec.compare_modes = {harness::CompareMode::EndToEnd};
  spec.device = device;
  const harness::Comparison c =
      oracle == "gpu"
          ? harness::run_device_comparison(spec, pb, {storage}, fault)
          : harness::run_comparison(spec, pb, harness::reference_oracle(),
                                    harness::judged_lineups(device, {storage}, fault));
  const harness::CompareResult& r = c.cells.front();
  VerifyResult v;
  v.pass = r.pass();
  v.tensors = static_cast<Idx>(r.rows.size());
  if (const auto* worst = r.largest_share()) {
    v.worst_pct = worst->verdict.pct();
    v.worst = worst->key;
  }
  if (r.first_fail >= 0) v.first_fail = r.rows[r.first_fail].key;
  if (r.first_nonfinite >= 0) v.first_nonfinite = r.rows[r.first_nonfinite].key;
  if (!v.pass) {
    std::ostringstream os;
    harness::ReportOptions ro;
    ro.failures_only = true;
    ro.details = true;
    ro.width = 100;
    harness::print_compare_table(os, c, ro);
    std::vector<const harness::TensorResult*> judged;
    for (const auto& row : r.rows)
      if (row.measured() && row.judged()) judged.push_back(&row);
    std::stable_sort(judged.begin(), judged.end(), [](const auto* a, const auto* b) {
      return a->verdict.pct() > b->verdict.pct();
    });
    os << "largest shares of budget:";
    os.setf(std::ios::fixed);
    os.precision(1);
    for (size_t i = 0; i < judged.size() && i < 5; ++i)
      os << " " << judged[i]->key << " " << judged[i]->verdict.pct() << " %"
         << (i + 1 < std::min<size_t>(5, judged.size()) ? "," : "");
    v.failures = os.str();
  }
  return v;
}

std::unique_ptr<Dataset> make_dataset(const TrainOptions& o, Idx T) {
  if (!o.data.empty()) return make_text_dataset(o.data, o.val_fraction, T);
  M3_REQUIRE(!o.task.empty(), "train", "no data: give --data FILE or --task NAME", "");
  return make_task(o.task, o.task_options, T);
}

Settings run_settings(const TrainOptions& o, const Dataset& data) {
  Settings s = config_settings(o.cfg);
  for (const auto& kv : data.settings())
    if (kv.first != "data") s.push_back(kv);  // the file is compared by size and hash, not path
  s.push_back({"eval_len", std::to_string(o.eval_len)});
  const OptimConfig& p = o.optim;
  s.push_back({"lr", exact_double(p.lr)});
  s.push_back({"warmup", std::to_string(p.warmup)});
  s.push_back({"steps", std::to_string(p.steps)});
  s.push_back({"min_lr_ratio", exact_double(p.min_lr_ratio)});
  s.push_back({"beta1", exact_double(p.beta1)});
  s.push_back({"beta2", exact_double(p.beta2)});
  s.push_back({"eps", exact_double(p.eps)});
  s.push_back({"wd", exact_double(p.wd)});
  s.push_back({"clip", exact_double(p.clip)});
  s.push_back({"precision", precision_name(o.storage)});
  s.push_back({"scan", scan_mode_name(o.mode)});
  s.push_back({"seed", std::to_string(o.seed)});
  s.push_back({"B", std::to_string(o.B)});
  s.push_back({"T", std::to_string(o.T)});
  s.push_back({"grad_accum", std::to_string(o.grad_accum)});
  return s;
}

std::unique_ptr<Dataset> checkpoint_task(const CheckpointMeta& meta) {
  std::string task;
  Settings opts;
  bool in_task = false;
  for (const auto& kv : meta.settings) {
    if (kv.first == "task") {
      task = kv.second;
      in_task = true;
      continue;
    }
    if (in_task && kv.first == "eval_len") break;
    if (in_task) opts.push_back(kv);
  }
  if (task.empty()) return nullptr;
  return make_task(task, opts, int_setting(meta, "T", 0));
}

namespace {

// The longer-length evaluation of a task: the same task with every sequence of length L.
std::unique_ptr<Dataset> eval_dataset(const TrainOptions& o, Idx L) {
  Settings opts;
  for (const auto& kv : o.task_options)
    if (kv.first != "n_min" && kv.first != "n_max") opts.push_back(kv);
  if (o.task == "parity") {
    opts.push_back({"n_min", std::to_string(L)});
    opts.push_back({"n_max", std::to_string(L)});
  } else if (o.task == "modular") {
    const Idx terms = (L + 1) / 2;
    opts.push_back({"n_min", std::to_string(terms)});
    opts.push_back({"n_max", std::to_string(terms)});
  }
  return make_task(o.task, opts, L);
}

}  // namespace

std::string human_count(double n) {
  static const char* const kUnits[] = {"", " k", " M", " G", " T"};
  int u = 0;
  while (u < 4 && std::fabs(n) >= 999.5) {  // 999.5 would print as "1e+03"
    n /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f%s" : "%.3g%s", n, kUnits[u]);
  return buf;
}

namespace {

std::string fixed(double v, int digits) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(digits);
  os << v;
  return os.str();
}

// The first array of the state (in checkpoint order: weights, then moments, each in layout
// order) holding a value that is not finite, as its checkpoint path ("weights/L0/in_proj_w");
// "" when every value is finite.
std::string first_nonfinite(const TrainState& st, const Config& cfg) {
  const ParamLayout layout = param_layout(cfg);
  const std::pair<const char*, const std::vector<float>*> arrays[] = {
      {"weights", &st.params}, {"optimizer/m", &st.m}, {"optimizer/v", &st.v}};
  for (const auto& [group, buf] : arrays)
    for (const ParamSlot& slot : layout.slots)
      for (Idx i = slot.offset; i < slot.offset + slot.size && i < static_cast<Idx>(buf->size()); ++i)
        if (!std::isfinite((*buf)[static_cast<std::size_t>(i)]))
          return std::string(group) + "/" + slot.name;
  return "";
}

// Host bytes of a run, counted from every dimension that grows it: the f32 state (weights,
// moments, gradients, the typed copies and the copy a checkpoint gathers: about six arrays of
// the parameter count), the batches held at once (the step's grad-accum micro-batches and the
// next step's, the validation batches; a token, a target and a weight per position), and on the
// CPU reference the activations of a pass (its registry tensors in float, twice: forward and
// gradients); the --eval-len model likewise.
double training_host_bytes(const TrainOptions& o) {
  const double bt = static_cast<double>(o.B) * static_cast<double>(o.T);
  const double per_position = 12.0;
  double bytes = 6.0 * 4.0 * harness::parameter_elements(o.cfg);
  bytes += per_position * bt *
           (2.0 * static_cast<double>(o.grad_accum) + static_cast<double>(o.val_batches));
  const bool host_passes = o.device == "cpu";
  if (host_passes) bytes += 2.0 * 4.0 * harness::stage_elements(o.cfg, o.B, o.T, o.mode);
  if (o.eval_len > 0) {
    const double bl = static_cast<double>(o.B) * static_cast<double>(o.eval_len);
    bytes += per_position * bl * static_cast<double>(std::max<Idx>(1, o.val_batches));
    if (host_passes) bytes += 2.0 * 4.0 * harness::stage_elements(o.cfg, o.B, o.eval_len, o.mode);
  }
  return bytes;
}

// config.txt's text: the options, with the run id as a comment after the first line (a comment,
// so that the file still loads with --config).
std::string with_run_id(const std::string& config_text, const std::string& run_id) {
  const std::size_t nl = config_text.find('\n');
  const std::size_t at = nl == std::string::npos ? config_text.size() : nl + 1;
  std::string s = config_text.substr(0, at);
  if (!s.empty() && s.back() != '\n') s += '\n';
  return s + "# run-id = " + run_id + "\n" + config_text.substr(at);
}

}  // namespace

std::string step_times_summary(const std::vector<StepTimes>& t, Idx first_step) {
  if (t.empty()) return "train: step times: none measured";
  const size_t skip = t.size() > 3 ? 3 : 0;
  std::vector<double> fwd, up, bwd, opt, period, rest;
  for (size_t k = skip; k < t.size(); ++k) {
    fwd.push_back(t[k].forward_ms);
    up.push_back(t[k].uploads_ms);
    bwd.push_back(t[k].backward_ms);
    opt.push_back(t[k].optimizer_ms);
  }
  // The period and the remainder: steps measured to the next one, unless there is none such.
  bool any_next = false;
  for (size_t k = skip; k < t.size(); ++k) any_next = any_next || t[k].to_next;
  for (size_t k = skip; k < t.size(); ++k) {
    if (any_next && !t[k].to_next) continue;
    period.push_back(t[k].period_ms);
    rest.push_back(t[k].period_ms - t[k].forward_ms - t[k].backward_ms - t[k].optimizer_ms);
  }
  const Idx a = first_step + static_cast<Idx>(skip), b = first_step + static_cast<Idx>(t.size()) - 1;
  std::ostringstream os;
  os << "train: step times on the device (CUDA events), medians of step" << (a == b ? " " : "s ")
     << a << (a == b ? "" : "–" + std::to_string(b)) << ": period " << fixed(harness::median(period), 3)
     << " ms = forward " << fixed(harness::median(fwd), 3) << " (its uploads "
     << fixed(harness::median(up), 3) << ") + backward " << fixed(harness::median(bwd), 3)
     << " + optimizer " << fixed(harness::median(opt), 3) << " + outside them "
     << fixed(harness::median(rest), 3) << " ms";
  if (!any_next) os << " (the period to the step's own end)";
  // The spread of the passes over those steps: a device that slows as a run goes on (its
  // clocks under sustained load) shows here, not in the medians.
  double lo = fwd[0] + bwd[0], hi = lo;
  for (size_t k = 1; k < fwd.size(); ++k) {
    lo = std::min(lo, fwd[k] + bwd[k]);
    hi = std::max(hi, fwd[k] + bwd[k]);
  }
  if (fwd.size() > 1)
    os << "; forward + backward " << fixed(lo, 3) << " to " << fixed(hi, 3) << " ms";
  return os.str();
}

std::string stage_times_table(const std::vector<std::pair<std::string, double>>& sums, Idx steps,
                              Idx first_step, Idx last_step) {
  if (steps < 1 || sums.empty()) return "train: stage times: none measured";
  std::ostringstream os;
  os << "train: stage times per step on the device (ms, means of step"
     << (first_step == last_step ? " " + std::to_string(first_step)
                                 : "s " + std::to_string(first_step) + "–" + std::to_string(last_step))
     << "; events between stages, layers summed; compare m3h bench --profile):";
  size_t width = 5;
  for (const auto& [name, ms] : sums) width = std::max(width, name.size());
  double total = 0;
  for (const auto& [name, ms] : sums) {
    const double per = ms / static_cast<double>(steps);
    total += per;
    os << "\n  " << name << std::string(width - name.size() + 2, ' ') << fixed(per, 3);
  }
  os << "\n  total" << std::string(width - 5 + 2, ' ') << fixed(total, 3);
  return os.str();
}

int run_training(const TrainOptions& opt, std::ostream& out) {
  TrainOptions o = opt;
  o.optim.validate();
  M3_REQUIRE(o.B >= 1 && o.T >= 1 && o.grad_accum >= 1, "train", "B, T and --grad-accum must be >= 1",
             "B=", o.B, " T=", o.T, " grad_accum=", o.grad_accum);
  M3_REQUIRE(o.optim.steps >= 1, "train", "--steps must be >= 1", "steps=", o.optim.steps);
  M3_REQUIRE(o.keep >= 1, "train", "--keep must be >= 1", "keep=", o.keep);
  M3_REQUIRE(o.resume.empty() || o.init.empty(), "train",
             "--resume continues a run, --init starts one from a checkpoint's weights",
             "give one of them");
  M3_REQUIRE(o.val_batches >= 0 && o.val_every >= 0 && o.ckpt_every >= 0 && o.log_every >= 1,
             "train", "--val-every, --val-batches and --ckpt-every must be >= 0, --log-every >= 1",
             "");
  M3_REQUIRE(o.verify_every == 0 || o.device == "gpu", "train",
             "--verify-every checks the GPU path against the double oracle",
             "with --device cpu the trained model IS the reference (in float); there is no "
             "kernel to verify");
  for (const auto& [on, name] : {std::pair<bool, const char*>{o.step_times, "--step-times"},
                                 std::pair<bool, const char*>{o.stage_times, "--stage-times"}})
    M3_REQUIRE(!on || (o.device == "gpu" && o.par.plain()), "train",
               std::string(name) + " times the GPU path of one process",
               o.device != "gpu" ? "with --device cpu there are no device events to time"
                                 : "not a data-parallel run (--gpus, --nccl-id-file)");
  M3_REQUIRE(!(o.step_times && o.stage_times), "train",
             "--step-times and --stage-times are separate runs",
             "the stage profile waits at the end of every pass, which changes the step's times");
  std::unique_ptr<Dataset> data = make_dataset(o, o.T);
  o.cfg.vocab_size = data->vocab();
  o.cfg.input_dim = data->vocab();
  o.cfg.input_proj_identity = false;
  validate_run(o.cfg, o.B, o.T);
  std::unique_ptr<Dataset> long_data;
  if (o.eval_len > 0) {
    M3_REQUIRE(!o.task.empty(), "train", "--eval-len is for the synthetic tasks", "");
    long_data = eval_dataset(o, o.eval_len);
    validate_run(o.cfg, o.B, o.eval_len);
  }
  // Every count that grows the run, against the machine, before anything is allocated or
  // created: a run too large for it is refused in one line instead of growing until killed.
  harness::check_host_bytes(training_host_bytes(o), "train: the run is too large",
                            "reduce --B, --T, the widths, --layers, --grad-accum, --val-batches "
                            "or --eval-len");

  CheckpointMeta now;
  now.settings = run_settings(o, *data);
  now.data_size = data->content_size();
  now.data_hash = data->content_hash();
  now.git_revision = golden::git_revision();

  check_parallel(o.device, o.B, o.par);
  // In a job of processes only rank 0 writes the run directory and the console.
  const bool lead = !o.par.multi_process() || o.par.rank == 0;
  std::unique_ptr<RunDir> dir;
  if (lead) dir = std::make_unique<RunDir>(o.out, !o.resume.empty(), o.force);
  // A new run that fails before its first step (a refused checkpoint, a backend that cannot
  // be built, memory) takes back what it created, so the same command can simply run again.
  struct DiscardUnlessStarted {
    RunDir* dir;
    bool started = false;
    ~DiscardUnlessStarted() {
      if (!started && dir) dir->discard_new_run();
    }
  } discard{dir.get()};
  std::ostream quiet(nullptr);
  std::ostream& console = lead ? out : quiet;
  LossScaler scaler = LossScaler::for_precision(o.storage);
  Idx step0 = 0;
  Idx extended_from = 0;     // the run's length before this resume extended it (0: not extended)
  double elapsed_before = 0;  // seconds the run had taken at the checkpoint
  TrainState st;
  if (!o.resume.empty()) {
    Config ck_cfg;
    const CheckpointMeta saved = read_checkpoint(o.resume, &ck_cfg, &st);
    // --steps may grow (the run is extended); every other setting must be the checkpoint's.
    const Idx saved_steps = int_setting(saved, "steps", o.optim.steps);
    CheckpointMeta same_length = now;
    for (auto& [name, value] : same_length.settings)
      if (name == "steps") value = std::to_string(saved_steps);
    const std::string why = resume_mismatch(saved, same_length);
    M3_REQUIRE(why.empty(), "train", why, "");
    M3_REQUIRE(o.optim.steps >= saved_steps, "train",
               "--steps " + std::to_string(o.optim.steps) + " is shorter than the run (" +
                   std::to_string(saved_steps) + " steps)",
               "a run is extended with a larger --steps, never shortened");
    if (saved.step >= o.optim.steps)
      throw RunFinished("train",
                        "the run is finished (step " + std::to_string(saved.step) + " of " +
                            std::to_string(saved_steps) + "); nothing to do",
                        "--steps N with N > " + std::to_string(saved_steps) + " extends it");
    if (o.optim.steps > saved_steps) extended_from = saved_steps;
    elapsed_before = saved.elapsed_s;
    // A checkpoint continues only the run that wrote it: its settings may equal another run's
    // (a copied folder, the same options), and resuming it there would mix two runs' logs.
    if (dir && saved.run_id != dir->run_id())
      throw Error("train",
                  "--resume " + o.resume + " is a checkpoint of run " +
                      (saved.run_id.empty() ? std::string("without an id") : saved.run_id) +
                      ", but --out " + o.out + " holds run " +
                      (dir->run_id().empty() ? std::string("without an id") : dir->run_id()),
                  "resume it into its own folder");
    step0 = saved.step;
    scaler.scale = saved.loss_scale;
    scaler.good_steps = saved.good_steps;
    scaler.skipped = saved.skipped;
    M3_REQUIRE(step0 <= o.optim.steps, "train", "the checkpoint is past --steps",
               "checkpoint step ", step0, ", --steps ", o.optim.steps);
  } else if (!o.init.empty()) {
    // A new run from another model's weights: only the weights carry over (an imported model
    // has no optimizer state), so AdamW starts from zero moments at step 0.
    Config ck_cfg;
    read_checkpoint(o.init, &ck_cfg, &st);
    const Settings want = config_settings(o.cfg), got = config_settings(ck_cfg);
    for (std::size_t i = 0; i < want.size(); ++i)
      M3_REQUIRE(got[i].second == want[i].second, "train",
                 "--init " + o.init + ": the checkpoint's " + want[i].first + " is " +
                     got[i].second + ", this run's " + want[i].second,
                 "the weights must fit the model");
    std::fill(st.m.begin(), st.m.end(), 0.0f);
    std::fill(st.v.begin(), st.v.end(), 0.0f);
  } else {
    st = initial_state(o.cfg, o.seed);
  }

  BackendSpec spec{o.cfg, o.B, o.T, o.mode, o.storage, o.recompute};
  std::unique_ptr<Backend> be = make_data_parallel(o.device, spec, o.par);
  // The options were refused above for any run but the GPU path of one process; its backend
  // switches the timing on here (and would say if it could not).
  M3_REQUIRE((!o.step_times || be->time_steps()) && (!o.stage_times || be->profile_stages(false)),
             "train", "this run's backend cannot time its steps or stages", "backend ",
             be->name());
  // --stage-times: the steps after the first three of this run (all of them in a run of three
  // or fewer), and only the training passes (not validation's forwards).
  const Idx profile_from = step0 + (o.optim.steps - step0 > 3 ? 4 : 1);
  Idx profiled = 0;
  // Only now, so that a backend that cannot be built leaves at most an empty new folder. An
  // extended run's config.txt takes the new length (a later --resume RUN continues it) and
  // says from what.
  if (dir && o.resume.empty()) dir->write_config(with_run_id(o.config_text, dir->run_id()));
  if (dir && extended_from > 0)
    dir->write_config(with_run_id(o.config_text, dir->run_id()) + "# extended from " +
                      std::to_string(extended_from) + " to " + std::to_string(o.optim.steps) +
                      " steps at step " + std::to_string(step0) + "\n");
  be->set_state(st);
  std::unique_ptr<Backend> long_be;  // one rank (the lead's device) evaluates the long length
  if (long_data && lead) {
    BackendSpec ls = spec;
    ls.T = o.eval_len;
    long_be = make_backend(o.device, ls);
  }
  std::vector<Batch> val;
  for (Idx i = 0; i < o.val_batches; ++i) val.push_back(data->val_batch(i, o.B, o.T));

  if (dir) dir->open_metrics(step0);
  StopFlag::install();
  Progress prog(o.optim.steps, o.log_every, o.tty && lead, console);
  prog.set_width(o.width);
  prog.set_elapsed_before(elapsed_before);
  prog.note("train: " + std::to_string(o.optim.steps) + " steps of " +
            std::to_string(o.grad_accum) + "x" + std::to_string(o.B) + "x" + std::to_string(o.T) +
            " tokens (global batch) on " + be->name() + " (" + precision_name(o.storage) + ", " +
            scan_mode_name(o.mode) + "), " +
            human_count(static_cast<double>(be->layout().total)) + " parameters" +
            (step0 ? "; resumed at step " + std::to_string(step0) : std::string()) +
            (o.init.empty() ? std::string()
                            : "; weights from " + escape_for_message(o.init, 200) +
                                  " (AdamW moments zero, step 0)"));
  prog.note(harness::wrap_words("config: " + o.cfg.describe(), o.width, 2));
  if (extended_from > 0)
    prog.note("train: extending the run from " + std::to_string(extended_from) + " to " +
              std::to_string(o.optim.steps) + " steps (the learning rate follows the " +
              std::to_string(o.optim.steps) + "-step schedule from step " +
              std::to_string(step0 + 1) + ")");

  // Every rank calls it (the state is gathered); the lead writes.
  if (dir) now.run_id = dir->run_id();
  // A checkpoint holds finite values only (write_checkpoint refuses others): save returns ""
  // when it wrote one (or this rank writes none), else the first non-finite array, and then
  // writes nothing, so the last checkpoint written stays the last finite one.
  std::string last_ckpt = o.resume;  // the newest checkpoint of this run on disk ("" = none)
  auto save = [&](Idx step) -> std::string {
    CheckpointMeta m = now;
    m.step = step;
    m.loss_scale = scaler.scale;
    m.good_steps = scaler.good_steps;
    m.skipped = scaler.skipped;
    m.elapsed_s = prog.elapsed();
    const TrainState state = be->state();
    const std::string bad = first_nonfinite(state, o.cfg);
    if (!bad.empty() || !dir) return bad;
    write_checkpoint(dir->checkpoint_path(step), o.cfg, m, state, true);
    dir->prune_checkpoints(o.keep, step == o.optim.steps ? step : -1);
    last_ckpt = dir->checkpoint_path(step);
    return "";
  };
  // What a stopped run says about its checkpoints: the one it wrote now, or the last finite
  // one kept instead (never a checkpoint it did not write).
  auto kept = [&](const std::string& bad) {
    const std::string shown = escape_for_message(last_ckpt, 400);
    if (bad.empty()) return "checkpoint " + shown;
    return "first non-finite tensor: " + bad + " (so no checkpoint of this step); " +
           (last_ckpt.empty() ? std::string("no finite checkpoint was written")
                              : "the last finite checkpoint is " + shown);
  };
  auto append = [&](const RunDir::Row& row) {
    if (dir) dir->append(row);
  };
  // The harness on a live batch, on the lead; every rank gathers the state. verify_seconds:
  // what the checks cost, for the summary.
  double verify_seconds = 0;
  int verify_count = 0;
  auto verify = [&](const Batch& live) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<float> params = be->state().params;
    const VerifyResult v =
        lead ? verify_live_batch(o.cfg, o.device, o.mode, o.storage, params, live, o.verify_oracle,
                                 o.verify_fault)
             : VerifyResult{};
    verify_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++verify_count;
    return v;
  };

  const auto t_start = std::chrono::steady_clock::now();
  std::vector<StepTimes> timed;  // --step-times: steps step0 + 1, step0 + 2, … in order
  // Step s's batches: train_batch(seed, s, k) for its micro-batches k. The next step's are
  // made, and its first staged (Backend::stage), while the device runs this step's last
  // backward, so that its uploads do not wait for the host. A batch that stage() refuses is
  // left to the plain path, which stops the run with that error at its own step, as without
  // staging (a step with no scored position stops in train_step before any forward).
  auto batches_of = [&](Idx s) {
    std::vector<Batch> m;
    for (Idx k = 0; k < o.grad_accum; ++k) m.push_back(data->train_batch(o.seed, s, k, o.B, o.T));
    return m;
  };
  std::vector<Batch> micro, next;  // next: the next step's batches once made (else empty)
  bool staged = false;              // next[0] is staged
  Idx step = step0;
  double last_loss = std::nan(""), last_val = std::nan(""), worst_verify = -1;
  std::string worst_verify_at;  // "step S, TENSOR" of worst_verify
  int status = 0;
  while (step < o.optim.steps) {
    const Idx s = step + 1;
    const auto t0 = std::chrono::steady_clock::now();  // tokens/s counts the data too
    const bool micro_staged = staged;
    micro = next.empty() ? batches_of(s) : std::move(next);
    next.clear();
    staged = false;
    auto stage_next = [&] {
      if (s == o.optim.steps) return;
      next = batches_of(s + 1);
      try {
        be->stage(next[0], scored_positions(next));
        staged = true;
      } catch (const Error&) {
        // the plain path meets it again at step s + 1
      }
    };
    const Idx t = s - scaler.skipped;  // the optimizer step: applied steps so far + 1
    const bool profile = o.stage_times && s >= profile_from;
    if (profile) be->profile_stages(true);
    const StepResult r = train_step(*be, micro, t, o.optim, scaler, micro_staged, stage_next);
    if (profile) {
      be->profile_stages(false);
      ++profiled;
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (o.step_times)
      for (const StepTimes& st : be->step_times(false)) timed.push_back(st);
    step = s;
    last_loss = r.loss;
    RunDir::Row row;
    row.step = s;
    row.loss = r.loss;
    row.lr = r.lr;
    row.grad_norm = r.skipped ? 0.0 : r.grad_norm;
    row.tokens_per_s = static_cast<double>(o.grad_accum * o.B * o.T) / std::max(secs, 1e-9);
    row.loss_scale = scaler.scale;
    row.skipped = scaler.skipped;
    if (!std::isfinite(r.loss) || (!r.finite && !r.skipped)) {
      // Name the first non-finite stage: the harness on this batch.
      // The step was not applied, so the state is that of step s − 1: no checkpoint of step s
      // is written; the last one written stays.
      const VerifyResult v = verify(micro[0]);
      append(row);
      discard.started = true;
      const std::string bad = first_nonfinite(be->state(), o.cfg);
      prog.note("train: stopped at step " + std::to_string(s) + ": the " +
                (std::isfinite(r.loss) ? std::string("gradient norm") : std::string("loss")) +
                " is not finite (" + precision_name(o.storage) + "); " +
                (!bad.empty() ? "first non-finite tensor: " + bad
                 : v.first_nonfinite.empty()
                     ? std::string("what the harness checks of the batch stays finite in "
                                   "every tensor it compares")
                     : "first non-finite tensor: " + v.first_nonfinite) +
                "; " +
                (last_ckpt.empty() ? std::string("no finite checkpoint was written")
                                   : "the last finite checkpoint is " +
                                         escape_for_message(last_ckpt, 400)));
      status = 1;
      break;
    }
    if (o.verify_every > 0 && s % o.verify_every == 0) {
      prog.busy("step " + std::to_string(s) + ": verifying " +
                (o.verify_oracle == "gpu" ? "the batch" : "a slice of the batch") +
                " against the double oracle");
      const VerifyResult v = verify(micro[0]);
      row.verify_pct = v.worst_pct;
      if (v.worst_pct > worst_verify) {
        worst_verify = v.worst_pct;
        worst_verify_at = "step " + std::to_string(s) + ", " + v.worst;
      }
      if (be->any_rank(!v.pass)) {
        append(row);
        discard.started = true;
        const std::string bad = save(s);
        prog.note("train: verification failed at step " + std::to_string(s) +
                  ": first failing tensor " + v.first_fail + " (" + exact_double(v.worst_pct) +
                  " % of budget at worst); " + kept(bad));
        if (!v.failures.empty()) prog.note(v.failures);
        if (bad.empty() && !last_ckpt.empty()) {
          // The same judgement again, from the checkpoint of this step and its batch.
          std::string cmd = "m3h compare --checkpoint " + escape_for_message(last_ckpt, 400) +
                            " --train-batch " + std::to_string(s) + " --device gpu --dtype " +
                            precision_name(o.storage) + " --scan " + scan_mode_name(o.mode);
          for (const std::string& f : o.data) cmd += " --data " + escape_for_message(f, 400);
          if (o.verify_oracle == "gpu") {
            prog.note("reproduce: " + cmd + " --oracle gpu");
            // On trained weights and real text the perturbed draws can fail correct code where
            // the emulation's own error is larger (HARNESS.md §11, "Where the rule falls
            // short"): the Eigen oracle on the batch's first row is the verdict that settles it.
            prog.note("settle (the Eigen oracle on the first row, HARNESS.md §11): " + cmd +
                      " --B 1");
          } else {
            prog.note("reproduce: " + cmd + " --B 1 --T " +
                      std::to_string(std::min<Idx>(o.T, 256)));
          }
        }
        status = 1;
        break;
      }
    }
    if (r.skipped)
      prog.note("train: step " + std::to_string(s) + " skipped (non-finite f16 gradient); loss scale now " +
                exact_double(scaler.scale));
    const bool last = s == o.optim.steps;
    if (!val.empty() && ((o.val_every > 0 && s % o.val_every == 0) || last)) {
      const EvalResult e = evaluate(*be, val);
      row.val_loss = e.loss;
      row.accuracy = e.acc.token();
      last_val = e.loss;
    }
    append(row);
    discard.started = true;
    prog.update(s, r.loss, std::isfinite(last_val) ? std::optional<double>(last_val) : std::nullopt,
                r.lr, row.tokens_per_s);
    if ((o.ckpt_every > 0 && s % o.ckpt_every == 0) || last) {
      const std::string bad = save(s);
      if (!bad.empty()) {
        prog.note("train: stopped at step " + std::to_string(s) + ": " + kept(bad));
        status = 1;
        break;
      }
    }
    if (be->any_rank(StopFlag::requested()) && !last) {
      const std::string bad = save(s);
      prog.note("train: interrupted at step " + std::to_string(s) + "; " + kept(bad) +
                (bad.empty() ? " (continue with --resume)" : ""));
      status = bad.empty() ? 130 : 1;
      break;
    }
  }
  if (o.step_times) {
    for (const StepTimes& st : be->step_times(true)) timed.push_back(st);
    prog.note(step_times_summary(timed, step0 + 1));
    if (dir) {
      dir->write_step_times(timed, step0 + 1);
      const std::string drawn = dir->plot_step_times();
      if (!drawn.empty()) prog.note("train: " + drawn);
    }
  }
  if (o.stage_times)
    prog.note(stage_times_table(be->stage_times(), profiled, profile_from, profile_from + profiled - 1));
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  std::ostringstream sum;
  sum << "train: step " << step << "/" << o.optim.steps << ", loss " << fixed(last_loss, 4);
  if (std::isfinite(last_val)) sum << ", val loss " << fixed(last_val, 4);
  sum << ", " << fixed(total, 1) << " s";
  if (step0 > 0) sum << " (" << fixed(prog.elapsed(), 1) << " s since the run began)";
  if (worst_verify >= 0)
    sum << ", verification worst " << fixed(worst_verify, 1) << " % of budget (" << worst_verify_at
        << "; " << verify_count << " checks, " << fixed(verify_seconds, 1) << " s, "
        << fixed(100 * verify_seconds / std::max(total, 1e-9), 1) << " % of the run)";
  if (!o.par.plain() && step > step0)
    sum << ", exchange "
        << fixed(1e3 * be->exchange_seconds() / static_cast<double>(step - step0), 2)
        << " ms/step";
  if (status == 0 && !val.empty()) {
    const EvalResult e = evaluate(*be, val);
    sum << ", val accuracy " << fixed(100 * e.acc.token(), 2) << " %";
    if (data->sequence_accuracy()) sum << " (sequences " << fixed(100 * e.acc.sequence(), 2) << " %)";
  }
  const bool long_eval = status == 0 && long_data;
  const TrainState final_state = long_eval ? be->state() : TrainState{};  // every rank gathers
  if (long_eval && long_be) {
    long_be->set_state(final_state);
    std::vector<Batch> lv;
    for (Idx i = 0; i < std::max<Idx>(1, o.val_batches); ++i)
      lv.push_back(long_data->val_batch(i, o.B, o.eval_len));
    const EvalResult e = evaluate(*long_be, lv);
    sum << "; at length " << o.eval_len << ": accuracy " << fixed(100 * e.acc.token(), 2) << " %";
    if (long_data->sequence_accuracy()) sum << " (sequences " << fixed(100 * e.acc.sequence(), 2) << " %)";
  }
  const std::string note = dir ? dir->plot_loss() : std::string();
  if (!note.empty()) prog.note("train: " + note);
  prog.finish(sum.str());
  return status;
}

// ---- sampling ------------------------------------------------------------------------------

namespace {

std::int32_t choose(const float* logits, Idx V, double temperature, Idx top_k, Rng& rng) {
  std::vector<Idx> idx(static_cast<size_t>(V));
  for (Idx v = 0; v < V; ++v) idx[v] = v;
  std::stable_sort(idx.begin(), idx.end(), [&](Idx a, Idx b) { return logits[a] > logits[b]; });
  if (temperature <= 0) return static_cast<std::int32_t>(idx[0]);
  const Idx k = top_k > 0 ? std::min(top_k, V) : V;
  std::vector<double> p(static_cast<size_t>(k));
  double z = 0;
  for (Idx i = 0; i < k; ++i) {
    p[i] = std::exp((static_cast<double>(logits[idx[i]]) - logits[idx[0]]) / temperature);
    z += p[i];
  }
  double u = rng.uniform() * z;
  for (Idx i = 0; i < k; ++i) {
    if (u < p[i]) return static_cast<std::int32_t>(idx[i]);
    u -= p[i];
  }
  return static_cast<std::int32_t>(idx[k - 1]);
}

// A model that takes a window of tokens carrying its states: the prompt (P tokens), then
// single tokens. logits() are the window's.
struct Stepper {
  virtual ~Stepper() = default;
  virtual void run(const std::vector<std::int32_t>& tok) = 0;
  virtual std::vector<float> logits() = 0;
};

struct CpuStepper final : Stepper {
  CpuStepper(const Config& cfg, Idx T, ScanMode mode, Precision st, const std::vector<float>& flat,
             States<float>* states)
      : model(cfg, 1, T, mode, st), p(from_flat(flat, cfg, param_layout(cfg))), s(states) {}
  void run(const std::vector<std::int32_t>& tok) override {
    std::vector<std::int32_t> tgt(tok.size(), 0);
    std::vector<float> w(tok.size(), 1.0f);
    model.forward(p, tok, tgt, w, static_cast<double>(tok.size()), s);
  }
  std::vector<float> logits() override { return model.logits(); }
  LmModel<float> model;
  Params<float> p;
  States<float>* s;
};

struct GpuStepper final : Stepper {
  GpuStepper(gpu::GpuContext& ctx, const Config& cfg, Idx T, ScanMode mode, Precision st,
             const std::vector<float>& flat)
      : net(ctx, cfg, 1, T, mode, st) {
    net.set_params_flat(flat);
    net.zero_states();
  }
  void run(const std::vector<std::int32_t>& tok) override {
    net.set_tokens(tok);
    net.set_targets(std::vector<std::int32_t>(tok.size(), 0), std::vector<float>(tok.size(), 1.0f),
                    static_cast<double>(tok.size()));
    net.forward_loss();
  }
  std::vector<float> logits() override { return net.logits(); }
  gpu::GpuBackbone net;
};

}  // namespace

std::vector<std::int32_t> sample(const SampleOptions& o, const Config& cfg,
                                 const std::vector<float>& params, ScanMode prompt_mode,
                                 Precision storage, std::vector<std::vector<float>>* step_logits) {
  const Idx V = cfg.vocab_size, P = static_cast<Idx>(o.prompt.size());
  M3_REQUIRE(V > 0, "sample", "the checkpoint's model has no vocabulary", "");
  M3_REQUIRE(P >= 1, "sample", "the prompt is empty", "give at least one token of prompt");
  M3_REQUIRE(o.tokens >= 0, "sample", "--tokens must be >= 0", "");
  Rng rng(o.seed);
  std::unique_ptr<gpu::GpuContext> ctx;
  std::unique_ptr<Stepper> full, one;
  States<float> states = zero_states<float>(cfg, 1);
  if (o.device == "gpu") {
    ctx = std::make_unique<gpu::GpuContext>(0);
    auto f = std::make_unique<GpuStepper>(*ctx, cfg, P, prompt_mode, storage, params);
    f->run(o.prompt);
    const States<float> leaving = f->net.states();
    auto s = std::make_unique<GpuStepper>(*ctx, cfg, 1, ScanMode::Sequential, storage, params);
    s->net.set_states(leaving);
    full = std::move(f);
    one = std::move(s);
  } else {
    full = std::make_unique<CpuStepper>(cfg, P, prompt_mode, storage, params, &states);
    full->run(o.prompt);
    one = std::make_unique<CpuStepper>(cfg, 1, ScanMode::Sequential, storage, params, &states);
  }
  std::vector<float> lg = full->logits();
  if (step_logits)
    for (Idx r = 0; r < P; ++r) step_logits->emplace_back(lg.begin() + r * V, lg.begin() + (r + 1) * V);
  std::vector<float> last(lg.end() - V, lg.end());
  std::vector<std::int32_t> outp;
  for (Idx i = 0; i < o.tokens; ++i) {
    const std::int32_t next = choose(last.data(), V, o.temperature, o.top_k, rng);
    outp.push_back(next);
    if (i + 1 == o.tokens) break;
    one->run({next});
    last = one->logits();
    if (step_logits) step_logits->push_back(last);
  }
  return outp;
}

}  // namespace m3::train
