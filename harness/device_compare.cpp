// The comparison on the device (see device_compare.hpp).
#include "device_compare.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <cstdint>
#include <map>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "backbone_gpu.hpp"
#include "budget.hpp"
#include "cell_judge.hpp"
#include "compare_gpu.hpp"
#include "error.hpp"
#include "gpu_lineup.hpp"
#include "oracle_gpu.hpp"
#include "perturbed.hpp"
#include "precision.hpp"
#include "resources.hpp"
#include "device.hpp"

namespace m3::harness {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Adds the wall time of its scope to a sum.
class ScopeTimer {
 public:
  explicit ScopeTimer(double& sum) : sum_(sum), t0_(Clock::now()) {}
  ~ScopeTimer() { sum_ += seconds_since(t0_); }
  ScopeTimer(const ScopeTimer&) = delete;
  ScopeTimer& operator=(const ScopeTimer&) = delete;

 private:
  double& sum_;
  Clock::time_point t0_;
};

// A stage's name in the time line: a backbone stage's backward is primed ("norm_f'").
std::string stage_label(const gpu::OracleStage& st) {
  std::string s = stage_name(st.stage);
  if (st.layer < 0 && st.dir == Dir::Backward) s += "'";
  return s;
}

gpu::ValueType value_type(Precision p) {
  switch (p) {
    case Precision::F64: return gpu::ValueType::F64;
    case Precision::F32: return gpu::ValueType::F32;
    case Precision::BF16: return gpu::ValueType::BF16;
    case Precision::F16: return gpu::ValueType::F16;
  }
  return gpu::ValueType::F64;
}

gpu::DeviceValues values_of(const gpu::OracleTensor& t) {
  return {t.data, gpu::ValueType::F64, t.numel()};
}
gpu::DeviceValues values_of(const gpu::GpuBackbone::DeviceTensor& t) {
  return {t.data, value_type(t.storage), t.n};
}

// A device buffer's values on the host, widened to double (exact for every stored type).
std::vector<double> host_values(gpu::DeviceComparer& dc, const gpu::DeviceValues& v) {
  const std::size_t n = static_cast<std::size_t>(v.n);
  std::vector<double> out(n);
  switch (v.type) {
    case gpu::ValueType::F64:
      dc.download(out.data(), v.data, n * sizeof(double));
      break;
    case gpu::ValueType::F32: {
      std::vector<float> f(n);
      dc.download(f.data(), v.data, n * sizeof(float));
      for (std::size_t i = 0; i < n; ++i) out[i] = f[i];
      break;
    }
    case gpu::ValueType::BF16:
    case gpu::ValueType::F16: {
      std::vector<std::uint16_t> h(n);
      dc.download(h.data(), v.data, n * sizeof(std::uint16_t));
      const bool bf = v.type == gpu::ValueType::BF16;
      for (std::size_t i = 0; i < n; ++i) out[i] = bf ? bf16_bits_to_float(h[i]) : f16_bits_to_float(h[i]);
      break;
    }
  }
  return out;
}

Metrics to_metrics(const gpu::DeviceMetrics& d) {
  Metrics m;
  m.numel = d.numel;
  m.max_abs = d.max_abs;
  m.worst_index = d.worst_index;
  m.worst_oracle = d.worst_oracle;
  m.worst_subject = d.worst_subject;
  m.oracle_scale = d.oracle_scale;
  m.oracle_l2 = d.oracle_l2;
  m.diff_l2 = d.diff_l2;
  m.rel_l2 = d.rel_l2;
  m.rel_l2_absolute = d.rel_l2_absolute;
  m.p95_rel = d.p95_rel;
  m.max_rel = d.max_rel;
  m.rel_count = d.rel_count;
  m.cosine = d.cosine;
  m.max_ulps = d.max_ulps;
  m.mean_ulps = d.mean_ulps;
  m.nan_count = d.nan_count;
  m.inf_count = d.inf_count;
  m.oracle_nonfinite = d.oracle_nonfinite;
  return m;
}

// What a row keeps on the device: the oracle's values (the draws' reference: a copy, or the
// teacher's own buffer in an isolated cell) and, for a row over its floor, each draw's
// |draw − oracle| per value; in an isolated cell also the subject's |Δ|, measured as its stage
// ran (the teacher's values replace the stage's outputs right after).
struct KeptRow {
  gpu::DeviceBuffer oracle;
  const double* teacher = nullptr;
  gpu::DeviceBuffer subject;
  std::vector<gpu::DeviceBuffer> devs;
  Idx n = 0;
  bool circular = false;
  const double* ref() const {
    return teacher ? teacher : static_cast<const double*>(oracle.data());
  }
  // Bytes held in `place` (gpu::Place::Device or Host).
  std::size_t bytes(gpu::Place place) const {
    std::size_t b = 0;
    for (const gpu::DeviceBuffer* d : {&oracle, &subject})
      if (d->place() == place) b += d->bytes();
    for (const gpu::DeviceBuffer& d : devs)
      if (d.place() == place) b += d.bytes();
    return b;
  }
};

// Device bytes a kept copy leaves free beside it for what a cell still allocates: the
// comparer's scratch, a stage's temporaries, cuBLAS's workspace.
constexpr std::size_t kKeptMargin = std::size_t{1} << 30;

// The oracle that runs the passes (OracleKeep::Backward), built on first use: an isolated cell
// whose rows all hold their floors never needs one.
using OracleSource = std::function<gpu::GpuOracle&()>;
// The host problem the draws are written into, made on first use.
using ScratchSource = std::function<Problem&()>;

// One cell on the device: end to end (`teacher` null) or isolated (`teacher`: the GPU oracle's
// unperturbed pass, OracleKeep::All; the source's oracle then runs the teacher-forced draws).
// The comparer queues on its own stream: each oracle stage is waited for before it is measured,
// and each copy of an oracle buffer before the oracle goes on.
class DeviceCell {
 public:
  DeviceCell(const RunSpec& spec, const Problem& pb, Precision p, ScanMode mode,
             const CellJudge::OracleShape& provided, const OracleSource& oracle,
             const ScratchSource& scratch, gpu::GpuOracle* teacher, gpu::DeviceComparer& dc,
             gpu::Fault fault, DeviceCompareCost& cost, const HostCopy& copy)
      : spec_(spec), pb_(pb), p_(p), mode_(mode), source_(oracle), scratch_(scratch),
        teacher_(teacher), dc_(dc),
        cost_(cost), copy_(copy), provided_(provided),
        judge_(provided, spec.cfg, spec.B, spec.T, mode, options(spec, p, teacher != nullptr),
               /*planned_baseline=*/true, spec.every_draw, /*only_provided=*/true) {
    ScopeTimer timer(cost_.setup_seconds);
    net_ = std::make_unique<gpu::GpuBackbone>(gpu_context(), spec.cfg, spec.B, spec.T, mode, p);
    gpu::load_problem(*net_, pb);
    net_->set_fault(fault, 0);
    if (teacher_)
      draws_oracle_bytes_ =
          gpu::oracle_memory(spec.cfg, spec.B, spec.T, gpu::OracleKeep::Backward).total();
    cost_.subject_bytes = std::max(cost_.subject_bytes, net_->memory().total());
  }

  CompareResult run() {
    teacher_ ? isolated_subject() : e2e_subject();
    // The subject's bytes in the verification layout its run switched to (every registry tensor
    // in its own buffer), not the production layout it was made with.
    cost_.subject_bytes = std::max(cost_.subject_bytes, net_->memory().total());
    judge_.subject_done();
    // An isolated cell's draws need only what the subject left in its kept rows (|Δ| per value),
    // so its buffers go before the oracle is built: the teacher, the oracle and a subject are
    // never on the device together.
    if (teacher_) free_subject();
    drop_unwanted();
    // The perturbed oracle's draws, while a verdict can still change. End to end: first the
    // exact one (every stored value rounded to its format: the production's own roundings,
    // equal for equal values), then random ones; with host copies the exact draw runs in any
    // case (its values are the copies' baseline). Isolated: random teacher-forced draws, as the
    // CPU's isolated baseline (harness::run_perturbed_isolated).
    for (int d = 0; d < kPerturbationDraws; ++d) {
      const bool judged = judge_.open();
      const bool copies = !teacher_ && d == 0 && copy_;
      if (!judged && !copies) break;
      const bool exact = !teacher_ && d == 0;
      const int draw = teacher_ ? d : d - 1;
      const Problem& pp = draw_inputs(exact, draw);
      oracle().set_perturbation(perturbation(draw, exact, false));
      if (judged) judge_.draw_begin(CellJudge::Term::Baseline);
      pass(pp, [this, judged, copies](const gpu::OracleTensor& t) {
        if (judged) draw_row(t);
        if (copies && copied_.count(t.key)) take(CopyOf::Baseline, t.key, t.shape, values_of(t));
      });
      if (judged) judge_.draw_end();
      oracle().set_perturbation({});
      drop_unwanted();
    }
    // A token model's coherent draws (HARNESS.md §4), all or none, where a tensor is still over
    // its limit after those: the baseline is then the larger of the two kinds' max + range.
    judge_.second_kind_from(kPerturbationDraws);
    for (int c = 0; pb_.token_model() && c < kCoherentDraws && judge_.open(); ++c) {
      if (c == 0 && !judge_.over_limit()) break;
      // After the random draws: 0 … 2 end to end (draw 0 is the exact one), 0 … 3 isolated.
      const int draw = (teacher_ ? kPerturbationDraws : kPerturbationDraws - 1) + c;
      oracle().set_perturbation(perturbation(draw, false, true));
      judge_.draw_begin(CellJudge::Term::Baseline);
      pass(draw_inputs(false, draw), [this](const gpu::OracleTensor& t) { draw_row(t); });
      judge_.draw_end();
      oracle().set_perturbation({});
      drop_unwanted();
    }
    if (oracle_) {
      oracle_->set_observer({});
      oracle_->set_teacher(nullptr);
    }
    CompareResult r = judge_.finish([this](int row, double u, double from) {
      ScopeTimer timer(cost_.analysis_seconds);
      return analyse(row, u, from);
    });
    kept_.clear();
    free_subject();
    return r;
  }

 private:
  static CompareOptions options(const RunSpec& spec, Precision p, bool isolated) {
    CompareOptions opt;
    opt.precision = p;
    opt.filter = spec.filter;
    opt.by_position = spec.by_position;
    opt.compare_mode = isolated ? CompareMode::Isolated : CompareMode::EndToEnd;
    opt.baseline_kind = BaselineKind::Perturbed;
    return opt;
  }

  // The device's rounding of draw `draw` of perturbed_problem's stream (exact: the exact one);
  // the stages' stream is role 1 end to end and role 2 teacher-forced, as on the CPU.
  gpu::OraclePerturbation perturbation(int draw, bool exact, bool coherent) const {
    gpu::OraclePerturbation op;
    op.u_typed = pt_.u_typed;
    op.u_f32 = pt_.u_f32;
    op.tiny = pt_.tiny;
    op.exact = exact;
    op.coherent = coherent;
    op.seed = perturbation_seed(pb_.seed, pt_.u_typed, draw, teacher_ ? 2 : 1);
    return op;
  }

  // A draw's problem on the host: the exact one (every value rounded to its storage) or random
  // draw `draw` of perturbed_problem's stream.
  // Written into the comparison's one scratch problem (a copy of pb made on first use), so a
  // draw allocates nothing on the host.
  const Problem& draw_inputs(bool exact, int draw) {
    ScopeTimer timer(cost_.inputs_seconds);
    Problem& q = scratch_();
    if (exact) rounded_problem_into(q, pb_, p_);
    else perturbed_problem_into(q, pb_, pt_, draw);
    return q;
  }

  void free_subject() {
    ScopeTimer timer(cost_.setup_seconds);
    net_.reset();
  }

  // The source's oracle; an isolated cell's is set teacher-forced (its draws' mode).
  gpu::GpuOracle& oracle() {
    if (!oracle_) {
      oracle_ = &source_();
      oracle_->set_perturbation({});
      oracle_->set_teacher(teacher_);
    }
    return *oracle_;
  }

  // End to end: the subject once, every tensor left in its own buffer; then the oracle, each
  // provided tensor measured against the subject's as its stage ends.
  void e2e_subject() {
    {
      ScopeTimer timer(cost_.subject_seconds);
      net_->repeat_digests();
      net_->synchronize();
    }
    pass(pb_, [this](const gpu::OracleTensor& t) {
      if (const int row = judge_.row(t.key); row >= 0) subject_row(row, t);
    });
  }

  // Isolated: the subject stage by stage, fed the teacher's values; each stage's provided
  // outputs measured against the teacher's as it ends, then every parameter gradient. The
  // draws that follow run teacher-forced.
  void isolated_subject() {
    // The subject's stages and their measuring interleave: the subject's share is the whole
    // less what subject_row adds to measure_seconds meanwhile.
    const double measured_before = cost_.measure_seconds;
    const Clock::time_point t0 = Clock::now();
    isolated_stages();
    cost_.subject_seconds += seconds_since(t0) - (cost_.measure_seconds - measured_before);
  }
  void isolated_stages() {
    gpu::GpuOracle& t = *teacher_;
    const gpu::GpuBackbone::DeviceTeacher teach = [this, &t](const std::string& key,
                                                             Idx n) -> const double* {
      const std::vector<Idx>* shape = provided_(key);
      if (!shape) return nullptr;
      const gpu::OracleTensor v = t.tensor(key);
      M3_REQUIRE(v.numel() == n, "compare --oracle gpu", "the teacher's '" + key + "' has " +
                 std::to_string(v.numel()) + " values, the subject's buffer " + std::to_string(n), "");
      return v.data;
    };
    net_->run_isolated(teach, [this, &t](StageId s, int l, Dir dir) {
      net_->synchronize();  // the stage's outputs, before the teacher's values replace them
      for (const TensorSpec& spec : stage_registry()) {
        if (spec.dir != dir || std::strcmp(spec.stage, stage_name(s)) != 0 ||
            (spec.scope == Scope::Layer) != (l >= 0))
          continue;
        const std::string key = stage_key(l, spec.stage, spec.tensor);
        if (!provided_(key)) continue;
        if (const int row = judge_.row(key); row >= 0) subject_row(row, t.tensor(key));
      }
    });
    for (const KeyedParam& kp : expected_param_keys(spec_.cfg))
      if (const int row = judge_.row(kp.key); row >= 0) subject_row(row, t.tensor(kp.key));
  }

  // One oracle pass of `pb` (loaded first), each stage's provided tensors and then every
  // parameter gradient handed to `row` as they come. Each stage's time runs from the end of
  // the previous stage's rows to the end of its own work.
  template <class Row>
  void pass(const Problem& pb, Row row) {
    gpu::GpuOracle& o = oracle();
    Clock::time_point mark = Clock::now();
    gpu::load_problem(o, pb);
    o.set_observer([this, row, &o, &mark](const gpu::OracleStage& st) {
      o.synchronize();
      cost_.oracle_stage_seconds[stage_label(st)] += seconds_since(mark);
      for (const gpu::OracleTensor& t : st.tensors) row(t);
      mark = Clock::now();
    });
    gpu::run_pass(o, pb);
    ++cost_.oracle_passes;
    o.synchronize();
    cost_.oracle_stage_seconds["tail"] += seconds_since(mark);
    for (const KeyedParam& kp : expected_param_keys(spec_.cfg)) row(o.tensor(kp.key));
  }

  // A judged row's values to the host (HostCopy).
  void take(CopyOf what, const std::string& key, const std::vector<Idx>& shape,
            const gpu::DeviceValues& v) {
    Tensor t;
    t.shape = shape;
    t.data = host_values(dc_, v);
    copy_(p_, mode_, what, key, std::move(t));
  }

  // The subject's buffer of row `row` measured against the oracle's (the teacher's) values `t`.
  void subject_row(int row, const gpu::OracleTensor& t) {
    ScopeTimer timer(cost_.measure_seconds);
    if (copy_) {
      take(CopyOf::Oracle, t.key, t.shape, values_of(t));
      copied_.insert(t.key);
    }
    gpu::GpuBackbone::DeviceTensor s;
    try {
      s = net_->device_tensor(t.key);
    } catch (const Error&) {
      return;  // stays "missing from the subject"
    }
    if (s.n != t.numel()) return judge_.subject_mismatch(row, {s.n});
    if (copy_) take(CopyOf::Subject, t.key, t.shape, values_of(s));
    const Metrics m = to_metrics(dc_.metrics(values_of(t), values_of(s), t.circular, p_, true));
    PositionProfile prof;
    if (judge_.wants_profile(row))
      dc_.position_profile(values_of(t), values_of(s), spec_.B, spec_.T, t.circular, &prof.max_abs,
                           &prof.rel_l2);
    const bool over = judge_.subject_measured(row, m, std::move(prof));
    if (over || spec_.every_draw) {
      KeptRow& k = kept_[row];
      k.n = t.numel();
      k.circular = t.circular;
      if (teacher_) {
        k.teacher = t.data;
        k.subject = kept_buffer(static_cast<std::size_t>(k.n) * sizeof(float));
        dc_.abs_dev(values_of(t), values_of(s), k.circular, static_cast<float*>(k.subject.data()));
      } else {
        k.oracle = kept_buffer(static_cast<std::size_t>(k.n) * sizeof(double));
        dc_.copy(k.oracle.data(), t.data, k.oracle.bytes());
        dc_.synchronize();  // the oracle reuses the buffer in its next layer
      }
      note_kept();
    }
  }

  void draw_row(const gpu::OracleTensor& t) {
    ScopeTimer timer(cost_.measure_seconds);
    const int row = judge_.row(t.key);
    if (row < 0 || !judge_.wants(row)) return;
    auto it = kept_.find(row);
    if (it == kept_.end())
      return judge_.draw_unusable(row, "the oracle's values of this key were not kept");
    KeptRow& k = it->second;
    if (t.numel() != k.n)
      return judge_.draw_unusable(row, "the perturbed oracle's shape differs from the oracle's");
    const gpu::DeviceValues ref = {k.ref(), gpu::ValueType::F64, k.n};
    judge_.draw_measured(row, to_metrics(dc_.metrics(ref, values_of(t), k.circular, p_, false)));
    if (judge_.kept(row)) {
      gpu::DeviceBuffer dev = kept_buffer(static_cast<std::size_t>(k.n) * sizeof(float));
      dc_.abs_dev(ref, values_of(t), k.circular, static_cast<float*>(dev.data()));
      k.devs.push_back(std::move(dev));
      note_kept();
    }
  }

  // The per-value analysis of a kept row: the subject's |Δ| against the oracle, then the draws'.
  ConditionSums analyse(int row, double u, double from) {
    ConditionSums cs;
    auto it = kept_.find(row);
    if (it == kept_.end()) return cs;
    KeptRow& k = it->second;
    if (!teacher_) {
      const gpu::GpuBackbone::DeviceTensor s = net_->device_tensor(judge_.result(row).key);
      k.subject = kept_buffer(static_cast<std::size_t>(k.n) * sizeof(float));
      dc_.abs_dev({k.ref(), gpu::ValueType::F64, k.n}, values_of(s), k.circular,
                  static_cast<float*>(k.subject.data()));
    }
    std::vector<const float*> devs, rest{static_cast<const float*>(k.subject.data())};
    for (const gpu::DeviceBuffer& d : k.devs) {
      devs.push_back(static_cast<const float*>(d.data()));
      rest.push_back(static_cast<const float*>(d.data()));
    }
    const gpu::ConditionSums g = dc_.condition(k.ref(), devs, rest, k.n, u, from);
    cs.n_ill = g.n_ill;
    cs.kmax = g.kmax;
    if (!g.rest.empty()) cs.subject = g.rest[0];
    for (size_t i = 1; i < g.rest.size(); ++i) cs.draws[0].push_back(g.rest[i]);
    return cs;
  }

  // Rows no longer measured by a draw free their copies (a pass decided on the floor).
  void drop_unwanted() {
    for (auto it = kept_.begin(); it != kept_.end();)
      it = judge_.wants(it->first) ? std::next(it) : kept_.erase(it);
  }

  // A kept copy's buffer: in device memory while the kept copies stay within the spec's
  // kept_device_limit and the device keeps kKeptMargin free beside it, plus, in an isolated
  // cell whose draws' oracle is not built yet, the room that oracle takes beyond the subject it
  // replaces; else in page-locked host memory. Either place gives the same values, so a
  // comparison's verdicts do not depend on the device's size, only its speed does.
  gpu::DeviceBuffer kept_buffer(std::size_t bytes) {
    std::size_t on_device = 0;
    for (const auto& [row, k] : kept_) on_device += k.bytes(gpu::Place::Device);
    std::size_t reserve = kKeptMargin;
    if (teacher_ && !oracle_) {
      const std::size_t subject = net_ ? net_->memory().total() : 0;
      if (draws_oracle_bytes_ > subject) reserve += draws_oracle_bytes_ - subject;
    }
    const bool device = on_device + bytes <= spec_.kept_device_limit &&
                        gpu::device_bytes_free() >= bytes + reserve;
    return gpu::DeviceBuffer(bytes, device ? gpu::Place::Device : gpu::Place::Host);
  }

  void note_kept() {
    std::size_t dev = 0, host = 0;
    for (const auto& [row, k] : kept_) {
      dev += k.bytes(gpu::Place::Device);
      host += k.bytes(gpu::Place::Host);
    }
    cost_.kept_bytes = std::max(cost_.kept_bytes, dev + host);
    cost_.kept_host_bytes = std::max(cost_.kept_host_bytes, host);
    cost_.device_peak = std::max(cost_.device_peak, gpu::device_bytes_in_use());
  }

  const RunSpec& spec_;
  const Problem& pb_;
  Precision p_;
  ScanMode mode_;
  const OracleSource& source_;
  const ScratchSource& scratch_;
  gpu::GpuOracle* oracle_ = nullptr;  // the source's, once a pass needs it
  gpu::GpuOracle* teacher_;
  std::size_t draws_oracle_bytes_ = 0;  // isolated: the device bytes of the draws' oracle
  gpu::DeviceComparer& dc_;
  DeviceCompareCost& cost_;
  const HostCopy& copy_;
  CellJudge::OracleShape provided_;
  CellJudge judge_;
  const Perturbation pt_ = perturbation_of(p_);
  std::unique_ptr<gpu::GpuBackbone> net_;
  std::map<int, KeptRow> kept_;
  std::set<std::string> copied_;  // the keys whose oracle values went to the host
};

}  // namespace

std::string trained_weights_note(bool passed, bool from_checkpoint, TrainedNote kind) {
  if (passed || !from_checkpoint || kind == TrainedNote::None) return "";
  if (kind == TrainedNote::GpuOracle)
    return "note: on trained weights the GPU oracle's perturbed baseline can fail correct code "
           "(HARNESS.md §11);\n  the Eigen oracle decides: the same command with --B 1 and "
           "without --oracle gpu\n";
  return "note: on trained weights the perturbed baseline can fail correct code (HARNESS.md §11):"
         "\n  the subject here is the emulation, the contract itself\n";
}

namespace {
// Device or host bytes as the report's lines give them: "29.9 GB" (decimal, three digits).
std::string gb(double bytes) {
  std::ostringstream os;
  os.precision(3);
  os << bytes / 1e9 << " GB";
  return os.str();
}

bool has_compare_mode(const RunSpec& spec, CompareMode cm) {
  return std::find(spec.compare_modes.begin(), spec.compare_modes.end(), cm) !=
         spec.compare_modes.end();
}
}  // namespace

std::string device_cost_line(const DeviceCompareCost& c) {
  std::ostringstream os;
  os.precision(3);
  os << "device compare: " << c.seconds << " s, " << c.oracle_passes << " oracle passes; device: "
     << "oracle " << gb(static_cast<double>(c.oracle_bytes)) << ", subject "
     << gb(static_cast<double>(c.subject_bytes)) << ", kept "
     << gb(static_cast<double>(c.kept_bytes));
  if (c.kept_host_bytes > 0)
    os << " (" << gb(static_cast<double>(c.kept_host_bytes)) << " of it in host memory)";
  os << ", peak in use "
     << gb(static_cast<double>(c.device_peak)) << "; host: peak " << gb(host_peak_rss_bytes());
  if (c.rows_not_provided > 0)
    os << "; " << c.rows_not_provided
       << " registry rows of one scan algorithm's inside not compared (the GPU oracle has one scan)";
  return os.str();
}

double DeviceCompareCost::oracle_seconds() const {
  double s = 0;
  for (const auto& [stage, t] : oracle_stage_seconds) s += t;
  return s;
}

std::string device_time_line(const DeviceCompareCost& c) {
  std::vector<std::pair<double, std::string>> stages;
  for (const auto& [stage, t] : c.oracle_stage_seconds) stages.push_back({t, stage});
  std::sort(stages.begin(), stages.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  const double oracle = c.oracle_seconds();
  const double measuring = c.measure_seconds + c.analysis_seconds;
  const double parts =
      c.setup_seconds + c.subject_seconds + c.inputs_seconds + oracle + measuring;
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(1);
  os << "time (s): setup " << c.setup_seconds << ", subjects " << c.subject_seconds
     << ", draws' inputs " << c.inputs_seconds << ", oracle " << oracle << ", measuring "
     << measuring << ", other " << std::max(0.0, c.seconds - parts) << "\n";
  os << "  oracle by stage (s):";
  if (stages.empty()) os << " none";
  double shown = 0;
  const std::size_t top = std::min<std::size_t>(5, stages.size());
  for (std::size_t i = 0; i < top; ++i) {
    os << (i ? ", " : " ") << stages[i].second << " " << stages[i].first;
    shown += stages[i].first;
  }
  if (stages.size() > top) os << ", rest " << oracle - shown;
  return os.str();
}

std::string device_compare_unavailable() {
  std::string why = gpu::oracle_unavailable();
  if (why.empty()) why = gpu::compare_unavailable();
  if (why.empty()) why = gpu_absent_reason();
  return why;
}

std::map<std::string, std::vector<Idx>> device_compared_shapes(const Config& cfg, Idx B, Idx T) {
  std::map<std::string, std::vector<Idx>> shapes;
  for (const KeyedSpec& ks : gpu::oracle_stage_keys(cfg, B, T)) shapes[ks.key] = ks.shape;
  for (const KeyedParam& kp : expected_param_keys(cfg)) shapes[kp.key] = kp.shape;
  return shapes;
}

void check_device_comparison(const RunSpec& spec, const std::vector<Precision>& precisions,
                             const std::string& command) {
  validate_run(spec.cfg, spec.B, spec.T);
  M3_REQUIRE(!precisions.empty(), command, "no precision to compare", "");
  M3_REQUIRE(!spec.modes.empty(), command, "no scan mode to compare", "");
  M3_REQUIRE(!spec.compare_modes.empty(), command, "no comparison mode (e2e, isolated)", "");
  for (Precision p : precisions)
    M3_REQUIRE(p != Precision::F64, command, "the GPU path stores f32, bf16 or f16",
               "f64 is the oracle's precision");
  const std::string why = device_compare_unavailable();
  M3_REQUIRE(why.empty(), command, "no usable GPU", why);
  const std::string refused = gpu::GpuBackbone::unsupported(spec.cfg, spec.B, spec.T);
  M3_REQUIRE(refused.empty(), command, "the GPU path cannot run this shape", refused);

  // Before any work, each phase of run_device_comparison must fit the free device memory: an
  // end-to-end cell holds the oracle and one scan mode's subject (every registry tensor in its
  // own buffer, at most 4 bytes a value); an isolated cell holds the teacher (every tensor kept)
  // with the subject, then, once the subject is gone, with the oracle of its draws. The kept
  // copies of rows over their floor take what is left and page-locked host memory past it
  // (DeviceCell::kept_buffer), so they are not counted here.
  {
    const double total = static_cast<double>(gpu::query_device().total_mem);
    const double free_b = total - static_cast<double>(gpu::device_bytes_in_use());
    const double oracle_b =
        static_cast<double>(gpu::oracle_memory(spec.cfg, spec.B, spec.T, gpu::OracleKeep::Backward).total());
    const double teacher_b =
        static_cast<double>(gpu::oracle_memory(spec.cfg, spec.B, spec.T, gpu::OracleKeep::All).total());
    auto refuse = [&](const std::string& what, double need, const std::string& parts) {
      throw Error(command, what + " do not fit the device's memory together",
                  "needs about " + gb(need) + " (" + parts + "), " + gb(free_b) + " are free");
    };
    for (ScanMode m : spec.modes) {
      const std::string mode = scan_mode_name(m);
      const double subject_b = 4.0 * stage_elements(spec.cfg, spec.B, spec.T, m);
      if (has_compare_mode(spec, CompareMode::EndToEnd) && oracle_b + subject_b > free_b)
        refuse("the oracle and the " + mode + " subject", oracle_b + subject_b,
               "the oracle " + gb(oracle_b) + ", the " + mode + " subject up to " + gb(subject_b));
      if (has_compare_mode(spec, CompareMode::Isolated) && teacher_b + std::max(subject_b, oracle_b) > free_b)
        refuse("the isolated cells' teacher and " +
                   (subject_b >= oracle_b ? "the " + mode + " subject" : "the oracle of the draws"),
               teacher_b + std::max(subject_b, oracle_b),
               "the teacher " + gb(teacher_b) + "; beside it the " + mode + " subject up to " +
                   gb(subject_b) + ", then the oracle of the draws " + gb(oracle_b));
    }
  }
}

Comparison run_device_comparison(const RunSpec& spec, const Problem& pb,
                                 const std::vector<Precision>& precisions, gpu::Fault fault,
                                 DeviceCompareCost* cost, const CellProgress& progress,
                                 const HostCopy& copy) {
  const Clock::time_point t0 = Clock::now();
  check_device_comparison(spec, precisions, "compare --oracle gpu");

  DeviceCompareCost local;
  DeviceCompareCost& c = cost ? *cost : local;
  c = {};
  // The end-to-end cells run first, with the oracle; then the isolated cells, with the teacher
  // (the unperturbed pass with every tensor kept: it depends on neither the precision nor the
  // scan mode, so it runs once) and an oracle built again only where a draw is needed. So the
  // device never holds the teacher beside an end-to-end cell, nor the oracle beside an isolated
  // cell's subject (check_device_comparison counts the phases so).
  std::unique_ptr<gpu::GpuOracle> oracle;
  std::unique_ptr<gpu::GpuOracle> teacher;
  auto note_oracles = [&] {
    const std::size_t b = (oracle ? oracle->memory().total() : 0) +
                          (teacher ? teacher->memory().total() : 0);
    c.oracle_bytes = std::max(c.oracle_bytes, b);
    c.device_peak = std::max(c.device_peak, gpu::device_bytes_in_use());
  };
  const OracleSource source = [&]() -> gpu::GpuOracle& {
    if (!oracle) {
      ScopeTimer timer(c.setup_seconds);
      oracle = std::make_unique<gpu::GpuOracle>(spec.cfg, spec.B, spec.T, gpu::OracleKeep::Backward);
      note_oracles();
    }
    return *oracle;
  };
  std::optional<Problem> scratch;
  const ScratchSource scratch_source = [&]() -> Problem& {
    if (!scratch) {
      ScopeTimer timer(c.inputs_seconds);
      scratch.emplace(pb);
    }
    return *scratch;
  };
  gpu::DeviceComparer dc;

  Comparison out;
  out.spec = spec;
  out.oracle_name = "gpu-oracle<double>";
  for (Precision p : precisions) {
    Lineup l{p, gpu_subject(p, fault), std::nullopt};
    const std::string draw = "gpu-oracle<double>~u(" + std::string(precision_name(p)) + ")";
    l.baseline = Implementation{draw, nullptr};
    l.baseline_kind = BaselineKind::Perturbed;
    // What the report's rule line names (DeviceCell runs these draws itself).
    for (int d = 1; d < kPerturbationDraws; ++d)
      l.more_baselines.push_back({draw + "#" + std::to_string(d), nullptr});
    for (int d = 0; d < kCoherentDraws; ++d)
      l.coherent_baselines.push_back({draw + " (coherent)", nullptr});
    if (has_compare_mode(spec, CompareMode::Isolated)) {
      for (int d = 0; d < kPerturbationDraws; ++d)
        l.isolated_baselines.push_back({draw + " teacher-forced#" + std::to_string(d), nullptr});
      for (int d = 0; d < kCoherentDraws; ++d)
        l.coherent_isolated_baselines.push_back({draw + " teacher-forced (coherent)", nullptr});
    }
    out.lineups.push_back(std::move(l));
  }
  const std::map<std::string, std::vector<Idx>> shapes =
      device_compared_shapes(spec.cfg, spec.B, spec.T);
  const CellJudge::OracleShape provided = [&shapes](const std::string& key) {
    auto it = shapes.find(key);
    return it == shapes.end() ? nullptr : &it->second;
  };
  {
    const std::size_t stage_rows = shapes.size() - expected_param_keys(spec.cfg).size();
    std::size_t most = 0;
    for (ScanMode m : spec.modes)
      most = std::max(most, expected_stage_keys(spec.cfg, spec.B, spec.T, m).size());
    c.rows_not_provided = static_cast<int>(most - std::min(most, stage_rows));
  }
  // Reported precision-major, as run_comparison orders them; run end to end first.
  const std::size_t n_modes = spec.modes.size(), n_cm = spec.compare_modes.size();
  std::vector<std::optional<CompareResult>> cells(precisions.size() * n_modes * n_cm);
  auto run_phase = [&](CompareMode phase) {
    for (std::size_t pi = 0; pi < precisions.size(); ++pi)
      for (std::size_t mi = 0; mi < n_modes; ++mi)
        for (std::size_t ci = 0; ci < n_cm; ++ci) {
          if (spec.compare_modes[ci] != phase) continue;
          const Precision p = precisions[pi];
          const ScanMode mode = spec.modes[mi];
          const Clock::time_point tc = Clock::now();
          DeviceCell cell(spec, pb, p, mode, provided, source, scratch_source,
                          phase == CompareMode::Isolated ? teacher.get() : nullptr, dc, fault, c,
                          copy);
          const CompareResult& r = cells[(pi * n_modes + mi) * n_cm + ci].emplace(cell.run());
          if (phase == CompareMode::Isolated) oracle.reset();  // before the next subject
          if (progress) {
            std::ostringstream os;
            os.precision(3);
            os << precision_name(p) << " " << scan_mode_name(mode) << " "
               << compare_mode_name(phase) << ": " << r.rows.size() << " checks, " << r.n_fail()
               << " failed, " << seconds_since(tc) << " s";
            progress(os.str());
          }
        }
  };
  run_phase(CompareMode::EndToEnd);
  if (has_compare_mode(spec, CompareMode::Isolated)) {
    oracle.reset();
    {
      ScopeTimer timer(c.setup_seconds);
      teacher = std::make_unique<gpu::GpuOracle>(spec.cfg, spec.B, spec.T, gpu::OracleKeep::All);
    }
    {
      ScopeTimer timer(c.oracle_stage_seconds["teacher"]);
      gpu::load_problem(*teacher, pb);
      gpu::run_pass(*teacher, pb);
      teacher->synchronize();  // the comparer reads its buffers on its own stream
    }
    ++c.oracle_passes;
    note_oracles();
    run_phase(CompareMode::Isolated);
  }
  for (std::optional<CompareResult>& r : cells) out.cells.push_back(std::move(*r));
  note_oracles();
  c.seconds = seconds_since(t0);
  return out;
}

}  // namespace m3::harness
