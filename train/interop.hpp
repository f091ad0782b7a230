// Weights to and from PyTorch (docs/INTEROP.md): a checkpoint's f32 master weights as a
// safetensors file under the official state-spaces/mamba names and layouts, and back; and the
// logits of a checkpoint on given tokens with the budget another implementation is held to.
//
// Names (l = layer): our parameter (MODEL.md §2, TRAINING.md §1) → the file's tensor, in the
// layout of the official MambaLMHeadModel (backbone = MixerModel of Block(norm, mixer=Mamba3)):
//
//   input_proj_w [V, dm]      backbone.embedding.weight [V, dm]            token models
//   input_proj_b [dm]         backbone.embedding.bias [dm]                  no official one
//   input_proj_w [IN, dm]     backbone.input_proj.weight [dm, IN]  (ᵀ)     vocab_size = 0
//   input_proj_b [dm]         backbone.input_proj.bias [dm]                 vocab_size = 0
//   Ll/norm_weight [dm]       backbone.layers.l.norm.weight [dm]
//   Ll/in_proj_w [dm, ip]     backbone.layers.l.mixer.in_proj.weight [ip, dm]   (ᵀ)
//   Ll/dt_bias [nh]           backbone.layers.l.mixer.dt_bias [nh]
//   Ll/b_norm_weight [ds]     backbone.layers.l.mixer.B_norm.weight [ds]
//   Ll/c_norm_weight [ds]     backbone.layers.l.mixer.C_norm.weight [ds]
//   Ll/b_bias [nh, ds]        backbone.layers.l.mixer.B_bias [nh, 1, ds]
//   Ll/c_bias [nh, ds]        backbone.layers.l.mixer.C_bias [nh, 1, ds]
//   Ll/d_param [nh]           backbone.layers.l.mixer.D [nh]
//   Ll/norm_gate_weight [di]  backbone.layers.l.mixer.norm.weight [di]   (official: only with
//                                                                          is_outproj_norm)
//   Ll/out_proj_w [di, dm]    backbone.layers.l.mixer.out_proj.weight [dm, di]  (ᵀ)
//   norm_f_weight [dm]        backbone.norm_f.weight [dm]
//   head_w [dm, V]            lm_head.weight [V, dm]  (ᵀ)
//
// (ᵀ): our Linear weights are [in, out] (Y = X·W), nn.Linear's are [out, in], so the file holds
// the transpose: row j of in_proj.weight is column j of in_proj_w, and in_proj's column order
// (z, x, B, C, dd_dt, dd_A, trap, angles; MODEL.md §2.1) is the official split's, so no column
// moves. B_bias/C_bias carry the official rank axis (1 for SISO); the values are the same bytes.
// No parameter is stored as a logarithm or with another sign in either: dt_bias is the
// softplus⁻¹ bias, D the skip, and A comes from in_proj (dd_A) in both.
//
// Export writes every parameter of the checkpoint (f32), so a round trip is bit-exact; two have
// no official counterpart and may be absent on import: backbone.embedding.bias (absent → 0:
// the official nn.Embedding has no bias) and, without is_outproj_norm, the mixer's norm.weight
// (absent → 1: the plain SiLU gate never reads it). Every other tensor must be present with
// its exact shape, and nothing else may be: a missing, extra or mis-shaped tensor is an error
// naming it (and both shapes). F32, BF16 and F16 tensors import as the exact f32 value.
//
// __metadata__ (strings): format = "pt"; m3h.interop = "1"; m3h.settings = the setting names
// in order ("d_model,d_state,…", the model config under MODEL.md's field names first, then a
// checkpoint's run settings); m3h.setting.<name> = its value. Import needs nothing else.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "config.hpp"
#include "registry.hpp"
#include "safetensors.hpp"

namespace m3::train {

constexpr const char* kInteropVersion = "1";

// Where one of our parameters lives in the file.
struct InteropName {
  std::string name;           // "backbone.layers.0.mixer.in_proj.weight"
  std::vector<Idx> shape;     // the file's shape
  bool transposed = false;    // the file holds the transpose of our [in, out] matrix
  bool optional = false;      // import: may be absent, then every element is `fill`
  float fill = 0;
};
InteropName interop_name(const ParamSlot& slot, const Config& cfg);

// The safetensors file of a model: every parameter of `params` (param_layout(cfg), f32) under
// its interop name, in the flat order of MODEL.md §2, and `settings` (they must hold the model
// config, config_settings' fields) in the metadata.
st::File export_model(const Config& cfg, const Settings& settings,
                      const std::vector<float>& params);

struct ImportedModel {
  Config cfg;                          // rebuilt from the metadata's settings
  Settings settings;                   // as the metadata lists them
  std::vector<float> params;           // param_layout(cfg) order, gaps zero
  std::vector<std::string> defaulted;  // optional tensors that were absent (file names)
};
// Reads a file of export_model's naming (see the file comment); every refusal is one m3::Error
// line led by `where` (the file's name). Values must be finite, and the settings pass
// check_run_settings (a checkpoint of them must be readable).
ImportedModel import_model(const st::File& f, const std::string& where);

// Token rows from text: one sequence per line, token ids separated by blanks or commas, every
// line of the same length; blank lines and '#' comments are skipped. Throws m3::Error naming
// the line (a token outside [0, vocab), a ragged row, no row at all).
struct TokenRows {
  Idx B = 0, T = 0;
  std::vector<std::int32_t> tok;  // [B*T], row-major
};
TokenRows parse_token_rows(const std::string& text, Idx vocab, const std::string& where);

// The logits of a token model on `rows` (zero entering states): the double reference
// (MODEL.md, TRAINING.md §1; the oracle) rounded to f32, [B, T, V]; and per precision of
// `precisions` the end-to-end budget of head/logits (HARNESS.md §4) for a subject of that
// precision: the float reference with that precision's storage emulation as the same-precision
// baseline, k·baseline + floor, for rel_l2 and max_abs.
struct LogitsBudget {
  Precision precision = Precision::BF16;
  double rel_l2 = 0, max_abs = 0;                    // the limits
  double baseline_rel_l2 = 0, baseline_max_abs = 0;  // the emulation's own errors
};
struct ModelLogits {
  std::vector<float> logits;  // [B*T, V]
  std::vector<LogitsBudget> budgets;
};
ModelLogits model_logits(const Config& cfg, const std::vector<float>& params,
                         const TokenRows& rows, ScanMode mode,
                         const std::vector<Precision>& precisions);

}  // namespace m3::train
