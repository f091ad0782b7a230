// The per-stage work model and the roofline rows (see roofline.hpp).
#include "roofline.hpp"

#include <algorithm>

#include "error.hpp"
#include "registry.hpp"

namespace m3::harness {

namespace {

// One tensor a stage reads.
enum class IoKind {
  Tensor,           // a registry tensor at its storage size
  TensorAtStorage,  // a registry f32 tensor read as its typed staged copy (δ into a GEMM)
  Param,            // an f32 parameter (master)
  GemmWeight,       // a GEMM weight: the typed compute copy (f32 when the storage is f32)
  Grad,             // a parameter gradient, accumulated: read + written, f32
};

struct Io {
  IoKind kind;
  const char* stage;  // registry stage (tensors); unused for parameters
  const char* name;   // registry tensor or parameter name
  bool outproj_norm_only = false;  // a parameter used only with is_outproj_norm
};

Io t(const char* stage, const char* name) { return {IoKind::Tensor, stage, name}; }
Io typed(const char* stage, const char* name) { return {IoKind::TensorAtStorage, stage, name}; }
Io p(const char* name, bool onrm = false) { return {IoKind::Param, "", name, onrm}; }
Io w(const char* name) { return {IoKind::GemmWeight, "", name}; }
Io g(const char* name, bool onrm = false) { return {IoKind::Grad, "", name, onrm}; }

// Shape proxies: the entering states and the gradients wrt the leaving states have the shapes
// of the registry's leaving states (states/*) and entering-state gradients (d_states/*); the
// residual-stream gradient δ and dOut are [B·T, dm] f32 like B1/d_temporal.
Io ssm_in() { return t("states", "ssm_state"); }
Io k_in() { return t("states", "k_state"); }
Io v_in() { return t("states", "v_state"); }
Io angle_in() { return t("states", "angle_state"); }
Io d_ssm_out() { return t("d_states", "d_ssm_state"); }
Io d_k_out() { return t("d_states", "d_k_state"); }
Io d_v_out() { return t("d_states", "d_v_state"); }
Io d_angle_out() { return t("d_states", "d_angle_state"); }
Io delta() { return t("B1", "d_temporal"); }
Io delta_typed() { return typed("B1", "d_temporal"); }
Io d_out() { return t("B1", "d_temporal"); }

// A profiled stage: its name in the profile, whether it runs per layer, and what it reads.
// What it writes comes from the registry (timed_stage below).
struct StageDef {
  std::string name;
  bool per_layer;
  std::vector<Io> reads;
};

// The profile stage that writes registry tensor s (see roofline.hpp), or "" for the registry
// tensors that are copies of another stage's output (counted as reads where they are read).
std::string timed_stage(const TensorSpec& s) {
  const std::string stage = s.stage, tensor = s.tensor;
  if ((stage == "input_proj" && tensor == "input_proj_inputs") ||
      (stage == "F1" && tensor == "residual") || (stage == "norm_f" && tensor == "norm_f_input"))
    return "";
  if (s.scope == Scope::Backbone) return s.dir == Dir::Backward ? stage + " (bwd)" : stage;
  if (stage == "states") return tensor == "angle_state" ? "F5" : "F6";
  if (stage == "d_states") return tensor == "d_angle_state" ? "B5a" : "B6";
  if (stage == "B4c") return "B4b";
  return stage;
}

// The stages in execution order with the tensors each launcher reads (gpu/backbone/backbone_gpu.cu).
std::vector<StageDef> stage_defs(const Config& cfg, ScanMode mode) {
  const bool seq = mode == ScanMode::Sequential;
  const bool ident = cfg.input_proj_identity;
  std::vector<StageDef> s;
  if (ident) {
    s.push_back({"input_proj", false, {t("input_proj", "input_proj_inputs")}});
  } else {
    s.push_back({"input_proj", false,
                 {t("input_proj", "input_proj_inputs"), w("input_proj_w"), p("input_proj_b")}});
  }
  s.push_back({"F1", true, {t("F1", "residual"), p("norm_weight")}});
  s.push_back({"F2", true, {t("F1", "post_norm"), w("in_proj_w")}});
  s.push_back({"F3", true, {t("F2", "proj"), p("dt_bias")}});
  s.push_back({"F4", true,
               {t("F3", "b_raw"), t("F3", "c_raw"), p("b_norm_weight"), p("c_norm_weight"),
                p("b_bias"), p("c_bias")}});
  s.push_back({"F5", true, {t("F3", "angles_raw"), t("F3", "dt"), angle_in()}});
  s.push_back({"F4ef", true, {t("F5", "angle_cumsum"), t("F4", "b_biased"), t("F4", "c_biased")}});
  s.push_back({"F5b", true, {t("F3", "a_val"), t("F3", "dt"), t("F3", "trap")}});
  if (seq) {
    s.push_back({"F6", true,
                 {t("F3", "x"), t("F4ef", "k"), t("F4ef", "q"), t("F5b", "alpha"),
                  t("F5b", "beta"), t("F5b", "gamma"), p("d_param"), ssm_in(), k_in(), v_in()}});
  } else {
    s.push_back({"F6", true,
                 {t("F3", "x"), t("F4ef", "k"), t("F4ef", "q"), t("F3", "dt"), t("F3", "trap"),
                  t("F3", "a_val"), p("d_param"), ssm_in(), k_in(), v_in()}});
  }
  s.push_back({"F7", true, {t("F6", "y"), t("F3", "z"), p("norm_gate_weight", true)}});
  s.push_back({"F8", true, {t("F7", "gated"), w("out_proj_w"), t("F1", "residual")}});
  s.push_back({"states", true, {}});
  s.push_back({"norm_f", false, {t("norm_f", "norm_f_input"), p("norm_f_weight")}});

  s.push_back({"norm_f (bwd)", false,
               {t("norm_f", "norm_f_input"), p("norm_f_weight"), t("norm_f", "norm_f_rms"),
                d_out(), g("norm_f_weight")}});
  s.push_back({"B8", true, {delta_typed(), t("F7", "gated"), w("out_proj_w"), g("out_proj_w")}});
  s.push_back({"B7", true,
               {t("F6", "y"), t("F3", "z"), t("B8", "d_gated"), p("norm_gate_weight", true),
                t("F7", "gated_rms_vals"), g("norm_gate_weight", true)}});
  if (seq) {
    s.push_back({"B6", true,
                 {t("F3", "x"), t("F4ef", "k"), t("F4ef", "q"), t("B7", "d_y"),
                  t("F5b", "alpha"), t("F5b", "beta"), t("F5b", "gamma"), p("d_param"),
                  t("F6", "h_saved"), t("F6", "k_prev_saved"), t("F6", "v_prev_saved"),
                  d_ssm_out(), d_k_out(), d_v_out(), t("F5", "angle_cumsum"), t("F3", "dt"),
                  t("F3", "trap"), g("d_param")}});
  } else {
    s.push_back({"B6", true,
                 {t("F3", "x"), t("F4ef", "k"), t("F4ef", "q"), t("F4", "b_biased"),
                  t("F4", "c_biased"), t("F6", "k_scaled_saved"), t("B7", "d_y"),
                  t("F5", "angle_cumsum"), t("F3", "dt"), t("F3", "trap"), t("F3", "a_val"),
                  p("d_param"), t("F6", "qk_dot_saved"), t("F6", "scale_saved"),
                  t("F6", "gamma_saved"), t("F6", "da_cumsum_saved"),
                  t("F6", "chunk_states_saved"), k_in(), v_in(), d_ssm_out(), d_k_out(),
                  d_v_out(), g("d_param")}});
  }
  s.push_back({"B5a", true,
               {t("F3", "angles_raw"), t("F3", "dt"), t("B6", "d_angle_cumsum"), d_angle_out()}});
  s.push_back({"B5b", true,
               {t("F3", "dd_dt_raw"), t("F3", "dd_a_raw"), p("dt_bias"), t("F3", "dt"),
                t("F3", "a_val"), t("F3", "trap"), t("B6", "d_adt_total"),
                t("B6", "d_dt_direct"), t("B5a", "d_dt_angle"), t("B6", "d_trap_sig"),
                g("dt_bias")}});
  s.push_back({"B4b", true,
               {t("F3", "b_raw"), t("F3", "c_raw"), p("b_norm_weight"), p("c_norm_weight"),
                t("F4", "b_rms"), t("F4", "c_rms"), t("B6", "d_b_pre_rope"),
                t("B6", "d_c_pre_rope"), g("b_norm_weight"), g("c_norm_weight"), g("b_bias"),
                g("c_bias")}});
  s.push_back({"B4c", true, {}});
  s.push_back({"B3", true,
               {t("B7", "d_z"), t("B6", "d_x"), t("B4c", "d_b_raw"), t("B4c", "d_c_raw"),
                t("B5b", "d_dd_dt"), t("B5b", "d_dd_a"), t("B5b", "d_trap_raw"),
                t("B5a", "d_angles_raw")}});
  s.push_back({"B2", true, {t("B3", "d_proj"), w("in_proj_w"), t("F1", "post_norm"),
                            g("in_proj_w")}});
  s.push_back({"B1", true,
               {t("F1", "residual"), p("norm_weight"), t("F1", "rms_vals"), t("B2", "d_norm"),
                delta(), g("norm_weight")}});
  s.push_back({"d_states", true, {}});
  if (ident) {
    s.push_back({"input_proj (bwd)", false, {delta()}});
  } else {
    s.push_back({"input_proj (bwd)", false,
                 {delta_typed(), t("input_proj", "input_proj_inputs"), w("input_proj_w"),
                  g("input_proj_w"), g("input_proj_b")}});
  }
  return s;
}

const ParamSpec& find_param(const char* name) {
  for (const auto& ps : param_registry())
    if (std::string(ps.name) == name) return ps;
  throw Error("harness::stage_work", std::string("unknown parameter '") + name + "'",
              "every parameter the model reads must be listed in reference/registry.cpp");
}

double numel(const std::vector<Idx>& shape) {
  double n = 1;
  for (Idx v : shape) n *= static_cast<double>(v);
  return n;
}

// Bytes read (and, for a gradient, written) by one Io of a stage, summed over its layers.
void add_io(const Io& io, const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage,
            StageWork& out) {
  const double L = static_cast<double>(cfg.n_layers);
  if (io.kind == IoKind::Tensor || io.kind == IoKind::TensorAtStorage) {
    const TensorSpec& spec = find_spec(io.stage, io.name);
    if (!exists_in(spec, cfg, mode)) return;
    const bool as_typed = spec.typed || io.kind == IoKind::TensorAtStorage;
    const double layers = spec.scope == Scope::Layer ? L : 1.0;
    out.read_bytes +=
        layers * numel(resolve_shape(spec.shape, cfg, B, T)) * element_bytes(as_typed, storage);
    return;
  }
  if (io.outproj_norm_only && !cfg.is_outproj_norm) return;
  const ParamSpec& ps = find_param(io.name);
  if (!param_exists(ps, cfg)) return;
  const double layers = ps.scope == Scope::Layer ? L : 1.0;
  const double n = layers * numel(resolve_shape(ps.shape, cfg, B, T));
  switch (io.kind) {
    case IoKind::Param: out.read_bytes += n * 4; break;
    case IoKind::GemmWeight: out.read_bytes += n * element_bytes(true, storage); break;
    case IoKind::Grad:
      out.read_bytes += n * 4;
      out.write_bytes += n * 4;
      break;
    default: break;
  }
}

// FLOPs of one stage (see roofline.hpp), summed over the layers.
void add_flops(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage,
               StageWork& s) {
  const double L = static_cast<double>(cfg.n_layers);
  const double BT = static_cast<double>(B * T);
  const double dm = static_cast<double>(cfg.d_model), ip = static_cast<double>(cfg.in_proj_dim());
  const double di = static_cast<double>(cfg.d_inner()), in = static_cast<double>(cfg.input_dim);
  const double nh = static_cast<double>(cfg.nheads()), hd = static_cast<double>(cfg.headdim);
  const double ds = static_cast<double>(cfg.d_state), cs = static_cast<double>(cfg.chunk_size);
  // Σ over the chunks of one sample of L_c and of L_c² (the last chunk may be short).
  const double full = static_cast<double>(T / cfg.chunk_size);
  const double rest = static_cast<double>(T % cfg.chunk_size);
  const double sum_l = static_cast<double>(T), sum_l2 = full * cs * cs + rest * rest;
  const double per_bh = static_cast<double>(B) * nh;
  const bool seq = mode == ScanMode::Sequential;
  const std::string& n = s.stage;
  auto matrix = [&](double f) {
    s.flops = f;
    s.unit = f > 0 ? FlopUnit::Matrix : FlopUnit::None;
  };
  auto fma32 = [&](double f) {
    s.flops = f;
    s.unit = FlopUnit::Fma32;
  };
  if (n == "input_proj") {
    matrix(cfg.input_proj_identity ? 0.0 : 2 * BT * in * dm);
  } else if (n == "input_proj (bwd)") {
    matrix(cfg.input_proj_identity ? 0.0 : 4 * BT * in * dm);
  } else if (n == "F2") {
    matrix(L * 2 * BT * dm * ip);
  } else if (n == "F8") {
    matrix(L * 2 * BT * di * dm);
  } else if (n == "B8") {
    matrix(L * 4 * BT * di * dm);
  } else if (n == "B2") {
    matrix(L * 4 * BT * dm * ip);
  } else if (n == "F6" || n == "B6") {
    const bool fwd = n == "F6";
    const double f =
        seq ? L * per_bh * static_cast<double>(T) * (fwd ? 7 : 15) * hd * ds
        : fwd ? L * per_bh * 2 * (sum_l2 * (ds + hd) + 2 * sum_l * hd * ds)
              : L * per_bh * 2 * (sum_l2 * (3 * ds + 2 * hd) + 4 * sum_l * hd * ds);
    // The chunked scan of typed runs forms its products on the tensor cores
    // (gpu/scan/ssm_chunked.cu, gpu/tc_mma.cuh); the sequential scan and f32 runs use f32 FMA.
    if (!seq && storage != Precision::F32) {
      matrix(f);
    } else {
      fma32(f);
    }
  }
}

}  // namespace

const char* flop_unit_name(FlopUnit u) {
  switch (u) {
    case FlopUnit::None: return "-";
    case FlopUnit::Matrix: return "gemm";
    case FlopUnit::Fma32: return "fma32";
  }
  return "?";
}

double element_bytes(bool typed, Precision storage) {
  switch (storage) {
    case Precision::F32: return 4;
    case Precision::BF16:
    case Precision::F16: return typed ? 2 : 4;
    case Precision::F64: break;
  }
  throw Error("harness::element_bytes", "f64 is not a GPU storage precision",
              "the work model counts f32, bf16 or f16 storage");
}

std::vector<StageWork> stage_work(const Config& cfg, Idx B, Idx T, ScanMode mode,
                                  Precision storage) {
  validate_run(cfg, B, T);
  element_bytes(false, storage);  // rejects F64 up front
  const std::vector<StageDef> defs = stage_defs(cfg, mode);
  std::vector<StageWork> out;
  out.reserve(defs.size());
  for (const auto& d : defs) {
    StageWork s;
    s.stage = d.name;
    for (const Io& io : d.reads) add_io(io, cfg, B, T, mode, storage, s);
    add_flops(cfg, B, T, mode, storage, s);
    out.push_back(s);
  }
  // Writes: every registry tensor of the run, at the stage that writes it.
  const double L = static_cast<double>(cfg.n_layers);
  for (const auto& spec : stage_registry()) {
    if (!exists_in(spec, cfg, mode)) continue;
    const std::string stage = timed_stage(spec);
    if (stage.empty()) continue;
    auto it = std::find_if(out.begin(), out.end(),
                           [&](const StageWork& s) { return s.stage == stage; });
    M3_REQUIRE(it != out.end(), "harness::stage_work",
               "registry tensor " + std::string(spec.stage) + "/" + spec.tensor +
                   " has no profiled stage",
               "the work model (harness/roofline.cpp) lacks stage '", stage, "'");
    const double layers = spec.scope == Scope::Layer ? L : 1.0;
    it->write_bytes += layers * numel(resolve_shape(spec.shape, cfg, B, T)) *
                       element_bytes(spec.typed, storage);
  }
  return out;
}

double Roof::flops_per_s(FlopUnit u) const {
  switch (u) {
    case FlopUnit::None: return 0;
    case FlopUnit::Matrix: return matrix_flops_per_s;
    case FlopUnit::Fma32: return fma32_flops_per_s;
  }
  return 0;
}

const char* RooflineRow::bound() const {
  if (!modeled || (bytes_floor_ms <= 0 && flops_floor_ms <= 0)) return "-";
  return bytes_floor_ms >= flops_floor_ms ? "memory" : "compute";
}

std::vector<RooflineRow> roofline_rows(const std::vector<std::pair<std::string, double>>& times,
                                       const std::vector<StageWork>& work, const Roof& roof) {
  double total = 0;
  for (const auto& [name, ms] : times) total += ms;
  std::vector<RooflineRow> rows;
  for (const auto& [name, ms] : times) {
    RooflineRow r;
    r.stage = name;
    r.ms = ms;
    r.share = total > 0 ? ms / total : 0;
    auto it = std::find_if(work.begin(), work.end(),
                           [&](const StageWork& s) { return s.stage == name; });
    if (it != work.end()) {
      r.modeled = true;
      r.bytes = it->bytes();
      r.flops = it->flops;
      r.unit = it->unit;
      const double sec = ms * 1e-3;
      r.bytes_per_s = sec > 0 ? r.bytes / sec : 0;
      r.flops_per_s = sec > 0 ? r.flops / sec : 0;
      const double peak = roof.flops_per_s(r.unit);
      r.bw_fraction = roof.bytes_per_s > 0 ? r.bytes_per_s / roof.bytes_per_s : 0;
      r.flop_fraction = peak > 0 ? r.flops_per_s / peak : 0;
      r.bytes_floor_ms = roof.bytes_per_s > 0 ? 1e3 * r.bytes / roof.bytes_per_s : 0;
      r.flops_floor_ms = peak > 0 ? 1e3 * r.flops / peak : 0;
      r.floor_ms = std::max(r.bytes_floor_ms, r.flops_floor_ms);
    }
    rows.push_back(r);
  }
  return rows;
}

RooflineRow roofline_total(const std::vector<RooflineRow>& rows) {
  RooflineRow t;
  t.stage = "total";
  t.modeled = true;
  for (const auto& r : rows) {
    t.ms += r.ms;
    t.share += r.share;
    t.bytes += r.bytes;
    t.flops += r.flops;
    t.bytes_floor_ms += r.bytes_floor_ms;
    t.flops_floor_ms += r.flops_floor_ms;
    t.floor_ms += r.floor_ms;
  }
  const double sec = t.ms * 1e-3;
  t.bytes_per_s = sec > 0 ? t.bytes / sec : 0;
  t.flops_per_s = sec > 0 ? t.flops / sec : 0;
  t.bw_fraction = t.ms > 0 ? t.bytes_floor_ms / t.ms : 0;
  t.flop_fraction = t.ms > 0 ? t.flops_floor_ms / t.ms : 0;
  return t;
}

}  // namespace m3::harness
