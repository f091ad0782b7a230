// The stage and parameter registries (see registry.hpp). Names and shapes follow MODEL.md §10;
// "F4ef" is MODEL.md's F4e/F4f (RoPE), "states"/"d_states" the leaving states of §9 and the
// gradients wrt the entering states of §12.4.
#include "registry.hpp"

#include "chain.hpp"
#include "error.hpp"
#include "layer_tensors.hpp"

namespace m3 {

namespace {

using S = Sym;
constexpr Scope BB = Scope::Backbone;
constexpr Scope LY = Scope::Layer;
constexpr Dir FW = Dir::Forward;
constexpr Dir BW = Dir::Backward;
constexpr Modes BOTH = Modes::Both;
constexpr Modes SEQ = Modes::Seq;
constexpr Modes CHK = Modes::Chunked;
constexpr When ALW = When::Always;
constexpr When ONRM = When::OutprojNorm;
constexpr When ANG = When::HasAngles;
constexpr When LM = When::Lm;
constexpr bool TYP = true;   // stored typed (bf16/f16 in those runs)
constexpr bool F32 = false;  // f32 in every run
constexpr Life SV = Life::Saved;
constexpr Life WS = Life::Workspace;
constexpr Life VF = Life::Verify;
constexpr Life CL = Life::Columns;
constexpr Life VW = Life::View;
// The shape symbols, unqualified for the rows of layer_tensors.hpp.
namespace sym {
constexpr Sym B = Sym::B, T = Sym::T, BT = Sym::BT, Tp1 = Sym::Tp1, DM = Sym::DM, DI = Sym::DI,
              IP = Sym::IP, NH = Sym::NH, HD = Sym::HD, DS = Sym::DS, NG = Sym::NG, NA = Sym::NA,
              NC = Sym::NC, CS = Sym::CS, IN = Sym::IN, V = Sym::V;
}  // namespace sym

// One row per tensor: scope, direction, scan modes, when it exists, stage, tensor, shape,
// circular, storage and, for a layer tensor, its production lifetime. The layer rows, and why
// each kept layer tensor is kept, are in layer_tensors.hpp; the backbone rows are here.
#define M3_UNPAREN(...) __VA_ARGS__
#define M3_LAYER_ROW(dir, modes, when, stage, tensor, member, shape, circular, storage, life) \
  {LY, dir, modes, when, #stage, #tensor, {M3_UNPAREN shape}, circular, storage, {M3_UNPAREN life}},
#define M3_LAYER_ROW_FW(...) M3_LAYER_ROW(FW, __VA_ARGS__)
#define M3_LAYER_ROW_BW(...) M3_LAYER_ROW(BW, __VA_ARGS__)
std::vector<TensorSpec> build_stage_registry() {
  using namespace sym;
  return {
      // ---- backbone forward (MODEL.md §3, §10.1)
      {BB, FW, BOTH, ALW, "input_proj", "input_proj_inputs", {S::BT, S::IN}, false, TYP},
      {BB, FW, BOTH, ALW, "input_proj", "input_proj_outputs", {S::BT, S::DM}, false, TYP},
      // ---- layer forward (MODEL.md §4, §10.2)
      M3_LAYER_FWD_TENSORS(M3_LAYER_ROW_FW)
      // ---- backbone forward end
      {BB, FW, BOTH, ALW, "norm_f", "norm_f_input", {S::BT, S::DM}, false, F32},
      {BB, FW, BOTH, ALW, "norm_f", "norm_f_rms", {S::BT}, false, F32},
      {BB, FW, BOTH, ALW, "norm_f", "Out", {S::BT, S::DM}, false, TYP},
      // ---- the language-model ends, token models only (TRAINING.md §1)
      {BB, FW, BOTH, LM, "head", "logits", {S::BT, S::V}, false, TYP},
      {BB, FW, BOTH, LM, "loss", "lse", {S::BT}, false, F32},
      {BB, FW, BOTH, LM, "loss", "value", {}, false, F32},
      {BB, BW, BOTH, LM, "head", "d_logits", {S::BT, S::V}, false, TYP},
      {BB, BW, BOTH, LM, "head", "d_Out", {S::BT, S::DM}, false, F32},
      // ---- backbone backward start (MODEL.md §6.1)
      {BB, BW, BOTH, ALW, "norm_f", "d_norm", {S::BT, S::DM}, false, F32},
      // ---- layer backward (MODEL.md §6.2–§6.4, §10.3)
      M3_LAYER_BWD_TENSORS(M3_LAYER_ROW_BW)
      // ---- backbone backward end
      {BB, BW, BOTH, ALW, "input_proj", "d_input_proj_dx", {S::BT, S::IN}, false, TYP},
  };
}
#undef M3_LAYER_ROW_BW
#undef M3_LAYER_ROW_FW
#undef M3_LAYER_ROW

std::vector<ParamSpec> build_param_registry() {
  using namespace sym;
#define M3_PARAM_ROW(scope, name, shape) {scope, #name, {M3_UNPAREN shape}},
  return {M3_PARAMS(M3_PARAM_ROW)};
#undef M3_PARAM_ROW
}
#undef M3_UNPAREN

}  // namespace

const std::vector<TensorSpec>& stage_registry() {
  static const std::vector<TensorSpec> reg = build_stage_registry();
  return reg;
}


const std::vector<ParamSpec>& param_registry() {
  static const std::vector<ParamSpec> reg = build_param_registry();
  return reg;
}

const char* life_name(Life l) {
  switch (l) {
    case Life::Saved: return "saved";
    case Life::View: return "view";
    case Life::Columns: return "columns";
    case Life::Workspace: return "workspace";
    case Life::Verify: return "verify";
  }
  return "?";
}

const char* recompute_name(Recompute r) { return r == Recompute::Scan ? "scan" : "none"; }

Recompute parse_recompute(const std::string& s) {
  if (s == "none") return Recompute::None;
  if (s == "scan") return Recompute::Scan;
  throw Error("registry", "unknown recompute policy '" + s + "'", "expected none or scan");
}

// Only a layer tensor has a lifetime, only a forward tensor can be saved or a view (a backward
// tensor never outlives its layer's backward), only a saved chunked tensor can be recomputed,
// and a column view lives in a tensor of its direction that is kept as long as it is read.
// Checked once, over every row.
void check_lifetimes() {
  for (const TensorSpec& s : stage_registry()) {
    const LifeRule& r = s.life;
    const bool workspace = r.seq == Life::Workspace && r.chunked == Life::Workspace && !r.scan;
    if (workspace) continue;
    const std::string name = std::string(s.stage) + "/" + s.tensor;
    M3_REQUIRE(s.scope == Scope::Layer, "registry::lifetime",
               "lifetime of '" + name + "', a backbone tensor",
               "only layer tensors have lifetimes");
    const bool kept = r.seq == Life::Saved || r.seq == Life::View || r.chunked == Life::Saved ||
                      r.chunked == Life::View;
    M3_REQUIRE(!kept || s.dir == Dir::Forward, "registry::lifetime",
               "backward tensor '" + name + "' is listed as saved",
               "only a forward tensor lives from forward to backward");
    M3_REQUIRE(!r.scan || r.chunked == Life::Saved, "registry::lifetime",
               "'" + name + "' is recomputed but not saved",
               "Recompute::Scan turns a saved chunked tensor into workspace");
    if (r.seq == Life::Columns || r.chunked == Life::Columns) {
      // The tensor it lives in: of the same direction, and kept as long as the view is read
      // (a forward view's tensor saved, a backward view's the layer's workspace).
      Config any;
      const ColumnView cv = column_view(s, any);
      const TensorSpec& of = find_spec(cv.stage, cv.tensor);
      M3_REQUIRE(of.dir == s.dir && r.seq == r.chunked, "registry::lifetime",
                 "column view '" + name + "' of '" + cv.stage + "/" + cv.tensor + "'",
                 "a column view is one in both scan modes, of a tensor of its direction");
      for (ScanMode m : {ScanMode::Sequential, ScanMode::Chunked}) {
        const Life lo = m == ScanMode::Sequential ? of.life.seq : of.life.chunked;
        M3_REQUIRE(s.dir == Dir::Forward ? lo == Life::Saved : lo == Life::Workspace,
                   "registry::lifetime",
                   "column view '" + name + "' of '" + cv.stage + "/" + cv.tensor +
                       "', which is " + life_name(lo),
                   "a forward view needs its tensor saved, a backward one in the workspace");
      }
    }
  }
}

ColumnView column_view(const TensorSpec& spec, const Config& cfg) {
  const std::string t = spec.tensor;
  // The split's order (MODEL.md §2.1): z | x | b_raw | c_raw | the f32 parts.
  const Idx di = cfg.d_inner(), bc = cfg.ngroups * cfg.d_state;
  if (t == "z") return {"F2", "proj", 0};
  if (t == "x") return {"F2", "proj", di};
  if (t == "b_raw") return {"F2", "proj", 2 * di};
  if (t == "c_raw") return {"F2", "proj", 2 * di + bc};
  if (t == "d_z") return {"B3", "d_proj", 0};
  if (t == "d_x") return {"B3", "d_proj", di};
  if (t == "d_b_raw") return {"B3", "d_proj", 2 * di};
  if (t == "d_c_raw") return {"B3", "d_proj", 2 * di + bc};
  throw Error("registry::column_view",
              std::string("'") + spec.stage + "/" + spec.tensor + "' is not a column view",
              "only the split's typed parts z, x, b_raw, c_raw and their gradients are");
}

Life lifetime(const TensorSpec& spec, ScanMode mode, Recompute rc) {
  static const bool checked = (check_lifetimes(), true);
  (void)checked;
  M3_REQUIRE(spec.scope == Scope::Layer, "registry::lifetime",
             std::string("backbone tensor '") + spec.stage + "/" + spec.tensor +
                 "' has no per-layer lifetime",
             "backbone tensors exist once per run");
  const LifeRule& r = spec.life;
  if (mode == ScanMode::Sequential) return r.seq;
  return r.scan && rc == Recompute::Scan ? Life::Workspace : r.chunked;
}

std::vector<LayerTensorBytes> layer_tensor_bytes(const Config& cfg, Idx B, Idx T, ScanMode mode,
                                                 Precision storage, Recompute rc) {
  const std::size_t typed = storage == Precision::BF16 || storage == Precision::F16 ? 2 : 4;
  std::vector<LayerTensorBytes> out;
  for (const auto& s : stage_registry()) {
    if (s.scope != Scope::Layer || !exists_in(s, cfg, mode)) continue;
    const Idx n = shape_numel(resolve_shape(s.shape, cfg, B, T));
    out.push_back({&s, lifetime(s, mode, rc), static_cast<std::size_t>(n) * (s.typed ? typed : 4)});
  }
  return out;
}

LayerBytes layer_bytes(const Config& cfg, Idx B, Idx T, ScanMode mode, Precision storage,
                       Recompute rc) {
  LayerBytes out;
  for (const LayerTensorBytes& t : layer_tensor_bytes(cfg, B, T, mode, storage, rc)) {
    switch (t.life) {
      case Life::Saved: out.saved += t.bytes; break;
      case Life::View: out.view += t.bytes; break;
      case Life::Columns: out.columns += t.bytes; break;
      case Life::Workspace: out.workspace += t.bytes; break;
      case Life::Verify: out.verify += t.bytes; break;
    }
  }
  return out;
}

Idx sym_value(Sym s, const Config& cfg, Idx B, Idx T) {
  switch (s) {
    case Sym::B: return B;
    case Sym::T: return T;
    case Sym::BT: return B * T;
    case Sym::Tp1: return T + 1;
    case Sym::DM: return cfg.d_model;
    case Sym::DI: return cfg.d_inner();
    case Sym::IP: return cfg.in_proj_dim();
    case Sym::NH: return cfg.nheads();
    case Sym::HD: return cfg.headdim;
    case Sym::DS: return cfg.d_state;
    case Sym::NG: return cfg.ngroups;
    case Sym::NA: return cfg.num_rope_angles();
    case Sym::NC: return cfg.n_chunks(T);
    case Sym::CS: return cfg.chunk_size;
    case Sym::IN: return cfg.input_dim;
    case Sym::V: return cfg.vocab_size;
  }
  throw Error("registry", "unknown dimension symbol", "");
}

std::vector<Idx> resolve_shape(const std::vector<Sym>& shape, const Config& cfg, Idx B, Idx T) {
  std::vector<Idx> out;
  out.reserve(shape.size());
  for (Sym s : shape) out.push_back(sym_value(s, cfg, B, T));
  return out;
}

Idx shape_numel(const std::vector<Idx>& shape) {
  Idx n = 1;
  for (Idx v : shape) n *= v;
  return n;
}

bool exists_in(const TensorSpec& spec, const Config& cfg, ScanMode mode) {
  if (spec.modes == Modes::Seq && mode != ScanMode::Sequential) return false;
  if (spec.modes == Modes::Chunked && mode != ScanMode::Chunked) return false;
  if (spec.when == When::OutprojNorm && !cfg.is_outproj_norm) return false;
  if (spec.when == When::HasAngles && cfg.num_rope_angles() == 0) return false;
  if (spec.when == When::Lm && cfg.vocab_size == 0) return false;
  return true;
}

bool param_exists(const ParamSpec& spec, const Config& cfg) {
  const std::string name = spec.name;
  if (name == "input_proj_w" || name == "input_proj_b") return !cfg.input_proj_identity;
  if (name == "head_w") return cfg.vocab_size > 0;
  return true;
}

const TensorSpec& find_spec(const std::string& stage, const std::string& tensor) {
  for (const auto& s : stage_registry())
    if (stage == s.stage && tensor == s.tensor) return s;
  throw Error("registry", "unknown stage tensor '" + stage + "/" + tensor + "'",
              "every captured tensor must be listed in reference/registry.cpp");
}

std::string stage_key(int layer, const char* stage, const char* tensor) {
  std::string k = layer >= 0 ? "L" + std::to_string(layer) + "/" : std::string();
  return k + stage + "/" + tensor;
}

std::string param_key(int layer, const char* name) {
  return layer >= 0 ? "grad/L" + std::to_string(layer) + "/" + name : std::string("grad/") + name;
}

namespace {

// The stage chain (chain.hpp) run for its order alone: each backbone stage's registry rows
// after it, each layer's rows of a direction as the layer is entered.
class KeyLister {
  friend struct m3::ChainAccess;

 public:
  KeyLister(const Config& cfg, Idx B, Idx T, ScanMode mode)
      : cfg_(cfg), B_(B), T_(T), mode_(mode) {}
  std::vector<KeyedSpec> out;

 private:
  void emit(Scope scope, Dir dir, int layer, const char* only_stage) {
    for (const auto& s : stage_registry()) {
      if (s.scope != scope || s.dir != dir || !exists_in(s, cfg_, mode_)) continue;
      if (only_stage && std::string(s.stage) != only_stage) continue;
      out.push_back({stage_key(layer, s.stage, s.tensor), layer, &s,
                     resolve_shape(s.shape, cfg_, B_, T_)});
    }
  }
  void before(StageId, int, Dir) {}
  void after(StageId s, int l, Dir dir) {
    if (l < 0) emit(Scope::Backbone, dir, -1, stage_name(s));
  }
  void pseudo(StageId, int, Dir) {}
  void enter_layer(int l) { emit(Scope::Layer, Dir::Forward, l, nullptr); }
  void leave_layer(int) {}
  void enter_layer_backward(int l) { emit(Scope::Layer, Dir::Backward, l, nullptr); }
  void leave_layer_backward(int) {}
  template <class St>
  void forward(St, int) {}
  template <class St>
  void backward(St, int) {}

  const Config& cfg_;
  Idx B_, T_;
  ScanMode mode_;
};

}  // namespace

std::vector<KeyedSpec> expected_stage_keys(const Config& cfg, Idx B, Idx T, ScanMode mode) {
  KeyLister k(cfg, B, T, mode);
  chain_step(k, ChainPlan::of(cfg, mode));
  return std::move(k.out);
}

std::vector<KeyedParam> expected_param_keys(const Config& cfg) {
  std::vector<KeyedParam> out;
  const int L = static_cast<int>(cfg.n_layers);
  const auto& reg = param_registry();
  auto push = [&](const ParamSpec& p, int layer) {
    out.push_back({param_key(layer, p.name), layer, &p, resolve_shape(p.shape, cfg, 1, 1)});
  };
  for (const auto& p : reg)
    if (p.scope == Scope::Backbone && std::string(p.name) != "norm_f_weight" &&
        std::string(p.name) != "head_w" && param_exists(p, cfg))
      push(p, -1);
  for (int l = 0; l < L; ++l)
    for (const auto& p : reg)
      if (p.scope == Scope::Layer) push(p, l);
  for (const auto& p : reg)
    if (std::string(p.name) == "norm_f_weight") push(p, -1);
  for (const auto& p : reg)
    if (std::string(p.name) == "head_w" && param_exists(p, cfg)) push(p, -1);
  return out;
}

ParamLayout param_layout(const Config& cfg) {
  ParamLayout out;
  for (const KeyedParam& kp : expected_param_keys(cfg)) {
    const Idx n = shape_numel(kp.shape);
    out.slots.push_back({kp.key.substr(5), kp.layer, kp.spec, kp.shape, out.total, n});
    out.total += (n + kParamAlign - 1) / kParamAlign * kParamAlign;
  }
  return out;
}

const ParamSlot& ParamLayout::at(int layer, const std::string& name) const {
  for (const ParamSlot& s : slots)
    if (s.layer == layer && name == s.spec->name) return s;
  throw Error("ParamLayout", "no parameter '" + param_key(layer, name.c_str()).substr(5) + "'",
              "not in this run's flat layout (an identity input_proj has no input_proj_w/_b)");
}

// ---- the stage table ----------------------------------------------------------------------

namespace {

StageRead t(const char* stage, const char* name) { return {ReadKind::Tensor, stage, name}; }
StageRead typed(const char* stage, const char* name) { return {ReadKind::TensorAtStorage, stage, name}; }
StageRead p(const char* name, bool onrm = false) { return {ReadKind::Param, "", name, onrm}; }
StageRead w(const char* name) { return {ReadKind::GemmWeight, "", name}; }
StageRead g(const char* name, bool onrm = false) { return {ReadKind::Grad, "", name, onrm}; }

// Shape proxies: the entering states and the gradients wrt the leaving states have the shapes
// of the registry's leaving states (states/*) and entering-state gradients (d_states/*); the
// residual-stream gradient δ and dOut are [B·T, dm] f32 like B1/d_temporal.
StageRead proxy(StageRead r) {
  r.proxy = true;
  return r;
}
StageRead ssm_in() { return proxy(t("states", "ssm_state")); }
StageRead k_in() { return proxy(t("states", "k_state")); }
StageRead v_in() { return proxy(t("states", "v_state")); }
StageRead angle_in() { return proxy(t("states", "angle_state")); }
StageRead d_ssm_out() { return proxy(t("d_states", "d_ssm_state")); }
StageRead d_k_out() { return proxy(t("d_states", "d_k_state")); }
StageRead d_v_out() { return proxy(t("d_states", "d_v_state")); }
StageRead d_angle_out() { return proxy(t("d_states", "d_angle_state")); }
StageRead delta() { return proxy(t("B1", "d_temporal")); }
StageRead delta_typed() { return proxy(typed("B1", "d_temporal")); }
StageRead d_out() { return proxy(t("B1", "d_temporal")); }

// An entry: backward when its name is a B stage, d_states or "… (bwd)".
StageEntry entry(const std::string& name, bool per_layer, std::vector<StageRead> reads) {
  const std::string bwd = " (bwd)";
  const bool tagged = name.size() > bwd.size() &&
                      name.compare(name.size() - bwd.size(), bwd.size(), bwd) == 0;
  const bool backward = tagged || name[0] == 'B' || name == "d_states";
  const std::string stage = tagged ? name.substr(0, name.size() - bwd.size()) : name;
  return {name, stage, stage_id(stage), per_layer ? Scope::Layer : Scope::Backbone,
          backward ? Dir::Backward : Dir::Forward, std::move(reads)};
}

}  // namespace

StageId stage_id(std::string_view name) {
  for (const StageRow& r : kStageRows)
    if (name == r.name) return r.id;
  throw Error("stage_id", "no such stage", std::string(name));
}
bool is_stage_name(std::string_view name) {
  for (const StageRow& r : kStageRows)
    if (name == r.name) return true;
  return false;
}

std::string writing_stage(const TensorSpec& s) {
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

std::vector<StageEntry> stage_table(const Config& cfg, ScanMode mode) {
  const bool seq = mode == ScanMode::Sequential;
  const bool ident = cfg.input_proj_identity;
  std::vector<StageEntry> s;
  if (ident) {
    s.push_back(entry("input_proj", false, {t("input_proj", "input_proj_inputs")}));
  } else {
    s.push_back(entry("input_proj", false,
                 {t("input_proj", "input_proj_inputs"), w("input_proj_w"), p("input_proj_b")}));
  }
  s.push_back(entry("F1", true, {t("F1", "residual"), p("norm_weight")}));
  s.push_back(entry("F2", true, {t("F1", "post_norm"), w("in_proj_w")}));
  s.push_back(entry("F3", true, {t("F2", "proj"), p("dt_bias")}));
  s.push_back(entry("F4", true,
               {t("F3", "b_raw"), t("F3", "c_raw"), p("b_norm_weight"), p("c_norm_weight"),
                p("b_bias"), p("c_bias")}));
  s.push_back(entry("F5", true, {t("F3", "angles_raw"), t("F3", "dt"), angle_in()}));
  s.push_back(entry("F4ef", true, {t("F5", "angle_cumsum"), t("F4", "b_biased"), t("F4", "c_biased")}));
  s.push_back(entry("F5b", true, {t("F3", "a_val"), t("F3", "dt"), t("F3", "trap")}));
  if (seq) {
    s.push_back(entry("F6", true,
                 {t("F3", "x"), t("F4ef", "k"), t("F4ef", "q"), t("F5b", "alpha"),
                  t("F5b", "beta"), t("F5b", "gamma"), p("d_param"), ssm_in(), k_in(), v_in()}));
  } else {
    s.push_back(entry("F6", true,
                 {t("F3", "x"), t("F4ef", "k"), t("F4ef", "q"), t("F3", "dt"), t("F3", "trap"),
                  t("F3", "a_val"), p("d_param"), ssm_in(), k_in(), v_in()}));
  }
  s.push_back(entry("F7", true, {t("F6", "y"), t("F3", "z"), p("norm_gate_weight", true)}));
  s.push_back(entry("F8", true, {t("F7", "gated"), w("out_proj_w"), t("F1", "residual")}));
  s.push_back(entry("states", true, {}));
  s.push_back(entry("norm_f", false, {t("norm_f", "norm_f_input"), p("norm_f_weight")}));
  if (cfg.vocab_size > 0) {  // the language-model ends (TRAINING.md §1)
    s.push_back(entry("head", false, {t("norm_f", "Out"), w("head_w")}));
    s.push_back(entry("loss", false, {t("head", "logits")}));  // + the targets and weights
    s.push_back(entry("head (bwd)", false,
                 {t("head", "logits"), t("loss", "lse"), t("norm_f", "Out"), w("head_w"),
                  g("head_w")}));
  }

  s.push_back(entry("norm_f (bwd)", false,
               {t("norm_f", "norm_f_input"), p("norm_f_weight"), t("norm_f", "norm_f_rms"),
                d_out(), g("norm_f_weight")}));
  s.push_back(entry("B8", true, {delta_typed(), t("F7", "gated"), w("out_proj_w"), g("out_proj_w")}));
  s.push_back(entry("B7", true,
               {t("F6", "y"), t("F3", "z"), t("B8", "d_gated"), p("norm_gate_weight", true),
                t("F7", "gated_rms_vals"), g("norm_gate_weight", true)}));
  if (seq) {
    s.push_back(entry("B6", true,
                 {t("F3", "x"), t("F4ef", "k"), t("F4ef", "q"), t("B7", "d_y"),
                  t("F5b", "alpha"), t("F5b", "beta"), t("F5b", "gamma"), p("d_param"),
                  t("F6", "h_saved"), t("F6", "k_prev_saved"), t("F6", "v_prev_saved"),
                  d_ssm_out(), d_k_out(), d_v_out(), t("F5", "angle_cumsum"), t("F3", "dt"),
                  t("F3", "trap"), g("d_param")}));
  } else {
    s.push_back(entry("B6", true,
                 {t("F3", "x"), t("F4ef", "k"), t("F4ef", "q"), t("F4", "b_biased"),
                  t("F4", "c_biased"), t("F6", "k_scaled_saved"), t("B7", "d_y"),
                  t("F5", "angle_cumsum"), t("F3", "dt"), t("F3", "trap"), t("F3", "a_val"),
                  p("d_param"), t("F6", "qk_dot_saved"), t("F6", "scale_saved"),
                  t("F6", "gamma_saved"), t("F6", "da_cumsum_saved"),
                  t("F6", "chunk_states_saved"), k_in(), v_in(), d_ssm_out(), d_k_out(),
                  d_v_out(), g("d_param")}));
  }
  s.push_back(entry("B5a", true,
               {t("F3", "angles_raw"), t("F3", "dt"), t("B6", "d_angle_cumsum"), d_angle_out()}));
  s.push_back(entry("B5b", true,
               {t("F3", "dd_dt_raw"), t("F3", "dd_a_raw"), p("dt_bias"), t("F3", "dt"),
                t("F3", "a_val"), t("F3", "trap"), t("B6", "d_adt_total"),
                t("B6", "d_dt_direct"), t("B5a", "d_dt_angle"), t("B6", "d_trap_sig"),
                g("dt_bias")}));
  s.push_back(entry("B4b", true,
               {t("F3", "b_raw"), t("F3", "c_raw"), p("b_norm_weight"), p("c_norm_weight"),
                t("F4", "b_rms"), t("F4", "c_rms"), t("B6", "d_b_pre_rope"),
                t("B6", "d_c_pre_rope"), g("b_norm_weight"), g("c_norm_weight"), g("b_bias"),
                g("c_bias")}));
  s.push_back(entry("B4c", true, {}));
  s.push_back(entry("B3", true,
               {t("B7", "d_z"), t("B6", "d_x"), t("B4c", "d_b_raw"), t("B4c", "d_c_raw"),
                t("B5b", "d_dd_dt"), t("B5b", "d_dd_a"), t("B5b", "d_trap_raw"),
                t("B5a", "d_angles_raw")}));
  s.push_back(entry("B2", true, {t("B3", "d_proj"), w("in_proj_w"), t("F1", "post_norm"),
                            g("in_proj_w")}));
  s.push_back(entry("B1", true,
               {t("F1", "residual"), p("norm_weight"), t("F1", "rms_vals"), t("B2", "d_norm"),
                delta(), g("norm_weight")}));
  s.push_back(entry("d_states", true, {}));
  if (ident) {
    s.push_back(entry("input_proj (bwd)", false, {delta()}));
  } else {
    s.push_back(entry("input_proj (bwd)", false,
                 {delta_typed(), t("input_proj", "input_proj_inputs"), w("input_proj_w"),
                  g("input_proj_w"), g("input_proj_b")}));
  }
  return s;
}



}  // namespace m3
