// The stage and parameter registries (see registry.hpp). Names and shapes follow MODEL.md §10;
// "F4ef" is MODEL.md's F4e/F4f (RoPE), "states"/"d_states" the leaving states of §9 and the
// gradients wrt the entering states of §12.4.
#include "registry.hpp"

#include "error.hpp"

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

std::vector<TensorSpec> build_stage_registry() {
  return {
      // ---- backbone forward (MODEL.md §3, §10.1)
      {BB, FW, BOTH, ALW, "input_proj", "input_proj_inputs", {S::BT, S::IN}, false},
      {BB, FW, BOTH, ALW, "input_proj", "input_proj_outputs", {S::BT, S::DM}, false},
      // ---- layer forward (MODEL.md §4, §10.2)
      {LY, FW, BOTH, ALW, "F1", "residual", {S::BT, S::DM}, false},
      {LY, FW, BOTH, ALW, "F1", "rms_vals", {S::BT}, false},
      {LY, FW, BOTH, ALW, "F1", "post_norm", {S::BT, S::DM}, false},
      {LY, FW, BOTH, ALW, "F2", "proj", {S::BT, S::IP}, false},
      {LY, FW, BOTH, ALW, "F3", "z", {S::BT, S::NH, S::HD}, false},
      {LY, FW, BOTH, ALW, "F3", "x", {S::BT, S::NH, S::HD}, false},
      {LY, FW, BOTH, ALW, "F3", "b_raw", {S::BT, S::NG, S::DS}, false},
      {LY, FW, BOTH, ALW, "F3", "c_raw", {S::BT, S::NG, S::DS}, false},
      {LY, FW, BOTH, ALW, "F3", "dd_dt_raw", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ALW, "F3", "dd_a_raw", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ALW, "F3", "trap_raw", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ANG, "F3", "angles_raw", {S::BT, S::NA}, false},
      {LY, FW, BOTH, ALW, "F3", "dt", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ALW, "F3", "a_val", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ALW, "F3", "trap", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ALW, "F4", "b_normed", {S::BT, S::NG, S::DS}, false},
      {LY, FW, BOTH, ALW, "F4", "c_normed", {S::BT, S::NG, S::DS}, false},
      {LY, FW, BOTH, ALW, "F4", "b_rms", {S::BT, S::NG}, false},
      {LY, FW, BOTH, ALW, "F4", "c_rms", {S::BT, S::NG}, false},
      {LY, FW, BOTH, ALW, "F4", "b_biased", {S::BT, S::NH, S::DS}, false},
      {LY, FW, BOTH, ALW, "F4", "c_biased", {S::BT, S::NH, S::DS}, false},
      {LY, FW, BOTH, ANG, "F5", "angle_cumsum", {S::BT, S::NH, S::NA}, true},
      {LY, FW, BOTH, ALW, "F4ef", "k", {S::BT, S::NH, S::DS}, false},
      {LY, FW, BOTH, ALW, "F4ef", "q", {S::BT, S::NH, S::DS}, false},
      {LY, FW, BOTH, ALW, "F5b", "alpha", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ALW, "F5b", "beta", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ALW, "F5b", "gamma", {S::BT, S::NH}, false},
      {LY, FW, SEQ, ALW, "F6", "h_saved", {S::B, S::Tp1, S::DS, S::DI}, false},
      {LY, FW, SEQ, ALW, "F6", "k_prev_saved", {S::BT, S::NH, S::DS}, false},
      {LY, FW, SEQ, ALW, "F6", "v_prev_saved", {S::BT, S::NH, S::HD}, false},
      {LY, FW, CHK, ALW, "F6", "adt", {S::BT, S::NH}, false},
      {LY, FW, CHK, ALW, "F6", "k_scaled_saved", {S::BT, S::NH, S::DS}, false},
      {LY, FW, CHK, ALW, "F6", "qk_dot_saved", {S::BT, S::NH}, false},
      {LY, FW, CHK, ALW, "F6", "scale_saved", {S::BT, S::NH}, false},
      {LY, FW, CHK, ALW, "F6", "gamma_saved", {S::BT, S::NH}, false},
      {LY, FW, CHK, ALW, "F6", "da_cumsum_saved", {S::B, S::NC, S::NH, S::CS}, false},
      {LY, FW, CHK, ALW, "F6", "chunk_states", {S::B, S::NC, S::NH, S::HD, S::DS}, false},
      {LY, FW, CHK, ALW, "F6", "chunk_states_saved", {S::B, S::NC, S::NH, S::HD, S::DS}, false},
      {LY, FW, CHK, ALW, "F6", "final_states", {S::B, S::NH, S::HD, S::DS}, false},
      {LY, FW, BOTH, ALW, "F6", "y", {S::BT, S::NH, S::HD}, false},
      {LY, FW, BOTH, ONRM, "F7", "gated_rms_vals", {S::BT, S::NH}, false},
      {LY, FW, BOTH, ALW, "F7", "gated", {S::BT, S::DI}, false},
      {LY, FW, BOTH, ALW, "F8", "out_flat", {S::BT, S::DM}, false},
      {LY, FW, BOTH, ALW, "F8", "layer_output", {S::BT, S::DM}, false},
      {LY, FW, BOTH, ALW, "states", "ssm_state", {S::B, S::NH, S::HD, S::DS}, false},
      {LY, FW, BOTH, ALW, "states", "k_state", {S::B, S::NH, S::DS}, false},
      {LY, FW, BOTH, ALW, "states", "v_state", {S::B, S::NH, S::HD}, false},
      {LY, FW, BOTH, ANG, "states", "angle_state", {S::B, S::NH, S::NA}, true},
      // ---- backbone forward end
      {BB, FW, BOTH, ALW, "norm_f", "norm_f_input", {S::BT, S::DM}, false},
      {BB, FW, BOTH, ALW, "norm_f", "norm_f_rms", {S::BT}, false},
      {BB, FW, BOTH, ALW, "norm_f", "Out", {S::BT, S::DM}, false},
      // ---- backbone backward start (MODEL.md §6.1)
      {BB, BW, BOTH, ALW, "norm_f", "d_norm", {S::BT, S::DM}, false},
      // ---- layer backward (MODEL.md §6.2–§6.4, §10.3)
      {LY, BW, BOTH, ALW, "B8", "d_gated", {S::BT, S::DI}, false},
      {LY, BW, BOTH, ALW, "B7", "d_y", {S::BT, S::DI}, false},
      {LY, BW, BOTH, ALW, "B7", "d_z", {S::BT, S::DI}, false},
      {LY, BW, SEQ, ALW, "B6", "d_q", {S::BT, S::NH, S::DS}, false},
      {LY, BW, SEQ, ALW, "B6", "d_k", {S::BT, S::NH, S::DS}, false},
      {LY, BW, SEQ, ALW, "B6", "d_alpha", {S::BT, S::NH}, false},
      {LY, BW, SEQ, ALW, "B6", "d_beta", {S::BT, S::NH}, false},
      {LY, BW, SEQ, ALW, "B6", "d_gamma", {S::BT, S::NH}, false},
      {LY, BW, SEQ, ALW, "B6", "d_d_local", {S::B, S::DI}, false},
      {LY, BW, CHK, ALW, "B6", "da_cs_sum", {S::B, S::NC, S::NH}, false},
      {LY, BW, CHK, ALW, "B6", "dQ_mid", {S::BT, S::NH, S::DS}, false},
      {LY, BW, CHK, ALW, "B6", "dK_mid", {S::BT, S::NH, S::DS}, false},
      {LY, BW, CHK, ALW, "B6", "dADT", {S::BT, S::NH}, false},
      {LY, BW, CHK, ALW, "B6", "dQK_dot", {S::BT, S::NH}, false},
      {LY, BW, CHK, ALW, "B6", "dD_partials", {S::B, S::NH}, false},
      {LY, BW, CHK, ALW, "B6", "dScale", {S::BT, S::NH}, false},
      {LY, BW, CHK, ALW, "B6", "dGamma", {S::BT, S::NH}, false},
      {LY, BW, CHK, ALW, "B6", "dDT", {S::BT, S::NH}, false},
      {LY, BW, BOTH, ALW, "B6", "d_x", {S::BT, S::DI}, false},
      {LY, BW, BOTH, ALW, "B6", "d_b_pre_rope", {S::BT, S::NH, S::DS}, false},
      {LY, BW, BOTH, ALW, "B6", "d_c_pre_rope", {S::BT, S::NH, S::DS}, false},
      {LY, BW, BOTH, ANG, "B6", "d_angle_cumsum", {S::BT, S::NH, S::NA}, false},
      // What B5b consumes from either B6 variant: ∂L/∂adt, the direct ∂L/∂dt, ∂L/∂trap (σ out)
      {LY, BW, BOTH, ALW, "B6", "d_adt_total", {S::BT, S::NH}, false},
      {LY, BW, BOTH, ALW, "B6", "d_dt_direct", {S::BT, S::NH}, false},
      {LY, BW, BOTH, ALW, "B6", "d_trap_sig", {S::BT, S::NH}, false},
      {LY, BW, BOTH, ANG, "B5a", "d_angles_raw", {S::BT, S::NA}, false},
      {LY, BW, BOTH, ALW, "B5a", "d_dt_angle", {S::BT, S::NH}, false},
      {LY, BW, BOTH, ALW, "B5b", "d_dd_dt", {S::BT, S::NH}, false},
      {LY, BW, BOTH, ALW, "B5b", "d_dd_a", {S::BT, S::NH}, false},
      {LY, BW, BOTH, ALW, "B5b", "d_trap_raw", {S::BT, S::NH}, false},
      {LY, BW, BOTH, ALW, "B4b", "d_b_normed", {S::BT, S::NG, S::DS}, false},
      {LY, BW, BOTH, ALW, "B4b", "d_c_normed", {S::BT, S::NG, S::DS}, false},
      {LY, BW, BOTH, ALW, "B4c", "d_b_raw", {S::BT, S::NG, S::DS}, false},
      {LY, BW, BOTH, ALW, "B4c", "d_c_raw", {S::BT, S::NG, S::DS}, false},
      {LY, BW, BOTH, ALW, "B3", "d_proj", {S::BT, S::IP}, false},
      {LY, BW, BOTH, ALW, "B2", "d_norm", {S::BT, S::DM}, false},
      {LY, BW, BOTH, ALW, "B1", "d_pre_norm", {S::BT, S::DM}, false},
      {LY, BW, BOTH, ALW, "B1", "d_temporal", {S::BT, S::DM}, false},
      {LY, BW, BOTH, ALW, "d_states", "d_ssm_state", {S::B, S::NH, S::HD, S::DS}, false},
      {LY, BW, BOTH, ALW, "d_states", "d_k_state", {S::B, S::NH, S::DS}, false},
      {LY, BW, BOTH, ALW, "d_states", "d_v_state", {S::B, S::NH, S::HD}, false},
      {LY, BW, BOTH, ANG, "d_states", "d_angle_state", {S::B, S::NH, S::NA}, false},
      // ---- backbone backward end
      {BB, BW, BOTH, ALW, "input_proj", "d_input_proj_dx", {S::BT, S::IN}, false},
  };
}

std::vector<ParamSpec> build_param_registry() {
  return {
      {BB, "input_proj_w", {S::IN, S::DM}},
      {BB, "input_proj_b", {S::DM}},
      {LY, "norm_weight", {S::DM}},
      {LY, "in_proj_w", {S::DM, S::IP}},
      {LY, "dt_bias", {S::NH}},
      {LY, "b_norm_weight", {S::DS}},
      {LY, "c_norm_weight", {S::DS}},
      {LY, "b_bias", {S::NH, S::DS}},
      {LY, "c_bias", {S::NH, S::DS}},
      {LY, "d_param", {S::NH}},
      {LY, "norm_gate_weight", {S::DI}},
      {LY, "out_proj_w", {S::DI, S::DM}},
      {BB, "norm_f_weight", {S::DM}},
  };
}

// MODEL.md §8, typed storage: activations at kernel boundaries and the activation gradients
// that cross typed kernels. (The raw logits dd_dt_raw … are f32 copies of typed proj columns.)
bool is_typed_tensor(const std::string& stage, const std::string& tensor) {
  static const char* const kTyped[][2] = {
      {"input_proj", "input_proj_inputs"}, {"input_proj", "input_proj_outputs"},
      {"F1", "post_norm"},   {"F2", "proj"},         {"F3", "z"},          {"F3", "x"},
      {"F3", "b_raw"},       {"F3", "c_raw"},        {"F4", "b_normed"},   {"F4", "c_normed"},
      {"F4", "b_biased"},    {"F4", "c_biased"},     {"F4ef", "k"},        {"F4ef", "q"},
      {"F6", "k_scaled_saved"}, {"F6", "y"},         {"F7", "gated"},      {"F8", "out_flat"},
      {"norm_f", "Out"},     {"B8", "d_gated"},      {"B7", "d_y"},        {"B7", "d_z"},
      {"B6", "d_x"},         {"B4b", "d_b_normed"},  {"B4b", "d_c_normed"}, {"B4c", "d_b_raw"},
      {"B4c", "d_c_raw"},    {"B3", "d_proj"},       {"B2", "d_norm"},
      {"input_proj", "d_input_proj_dx"},
  };
  for (const auto& t : kTyped)
    if (stage == t[0] && tensor == t[1]) return true;
  return false;
}

std::vector<TensorSpec> typed_marked(std::vector<TensorSpec> reg) {
  for (auto& s : reg) s.typed = is_typed_tensor(s.stage, s.tensor);
  return reg;
}

}  // namespace

const std::vector<TensorSpec>& stage_registry() {
  static const std::vector<TensorSpec> reg = typed_marked(build_stage_registry());
  return reg;
}


const std::vector<ParamSpec>& param_registry() {
  static const std::vector<ParamSpec> reg = build_param_registry();
  return reg;
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
  }
  throw Error("registry", "unknown dimension symbol", "");
}

std::vector<Idx> resolve_shape(const std::vector<Sym>& shape, const Config& cfg, Idx B, Idx T) {
  std::vector<Idx> out;
  out.reserve(shape.size());
  for (Sym s : shape) out.push_back(sym_value(s, cfg, B, T));
  return out;
}

bool exists_in(const TensorSpec& spec, const Config& cfg, ScanMode mode) {
  if (spec.modes == Modes::Seq && mode != ScanMode::Sequential) return false;
  if (spec.modes == Modes::Chunked && mode != ScanMode::Chunked) return false;
  if (spec.when == When::OutprojNorm && !cfg.is_outproj_norm) return false;
  if (spec.when == When::HasAngles && cfg.num_rope_angles() == 0) return false;
  return true;
}

bool param_exists(const ParamSpec& spec, const Config& cfg) {
  const std::string name = spec.name;
  if (name == "input_proj_w" || name == "input_proj_b") return !cfg.input_proj_identity;
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

std::vector<KeyedSpec> expected_stage_keys(const Config& cfg, Idx B, Idx T, ScanMode mode) {
  std::vector<KeyedSpec> out;
  // Emits the registry rows of one (scope, direction[, backbone stage]) in table order.
  auto emit = [&](Scope scope, Dir dir, int layer, const char* only_stage) {
    for (const auto& s : stage_registry()) {
      if (s.scope != scope || s.dir != dir || !exists_in(s, cfg, mode)) continue;
      if (only_stage && std::string(s.stage) != only_stage) continue;
      out.push_back({stage_key(layer, s.stage, s.tensor), layer, &s,
                     resolve_shape(s.shape, cfg, B, T)});
    }
  };
  const int L = static_cast<int>(cfg.n_layers);
  emit(Scope::Backbone, Dir::Forward, -1, "input_proj");
  for (int l = 0; l < L; ++l) emit(Scope::Layer, Dir::Forward, l, nullptr);
  emit(Scope::Backbone, Dir::Forward, -1, "norm_f");
  emit(Scope::Backbone, Dir::Backward, -1, "norm_f");
  for (int l = L - 1; l >= 0; --l) emit(Scope::Layer, Dir::Backward, l, nullptr);
  emit(Scope::Backbone, Dir::Backward, -1, "input_proj");
  return out;
}

std::vector<KeyedParam> expected_param_keys(const Config& cfg) {
  std::vector<KeyedParam> out;
  const int L = static_cast<int>(cfg.n_layers);
  const auto& reg = param_registry();
  auto push = [&](const ParamSpec& p, int layer) {
    out.push_back({param_key(layer, p.name), layer, &p, resolve_shape(p.shape, cfg, 1, 1)});
  };
  for (const auto& p : reg)
    if (p.scope == Scope::Backbone && std::string(p.name) != "norm_f_weight" && param_exists(p, cfg))
      push(p, -1);
  for (int l = 0; l < L; ++l)
    for (const auto& p : reg)
      if (p.scope == Scope::Layer) push(p, l);
  for (const auto& p : reg)
    if (std::string(p.name) == "norm_f_weight") push(p, -1);
  return out;
}

}  // namespace m3
