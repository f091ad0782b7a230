// Weights to and from PyTorch: the name/layout map, export, import, and the logits with their
// budget (see interop.hpp and docs/INTEROP.md).
#include "interop.hpp"

#include <cmath>
#include <set>
#include <sstream>

#include "backend.hpp"
#include "budget.hpp"
#include "error.hpp"
#include "metrics.hpp"
#include "problem.hpp"

namespace m3::train {

namespace {

constexpr const char* kSettingsKey = "m3h.settings";
constexpr const char* kSettingPrefix = "m3h.setting.";

std::string named(const std::string& s) { return "'" + escape_for_message(s, 80) + "'"; }

// The layer parameters' names inside a mixer or block, and which are [in, out] matrices.
struct LayerName {
  const char* ours;
  const char* file;  // after "backbone.layers.<l>."
  bool transposed;
};
constexpr LayerName kLayerNames[] = {
    {"norm_weight", "norm.weight", false},
    {"in_proj_w", "mixer.in_proj.weight", true},
    {"dt_bias", "mixer.dt_bias", false},
    {"b_norm_weight", "mixer.B_norm.weight", false},
    {"c_norm_weight", "mixer.C_norm.weight", false},
    {"b_bias", "mixer.B_bias", false},
    {"c_bias", "mixer.C_bias", false},
    {"d_param", "mixer.D", false},
    {"norm_gate_weight", "mixer.norm.weight", false},
    {"out_proj_w", "mixer.out_proj.weight", true},
};

// The parameter's name without its "L<l>/" prefix.
std::string base_name(const ParamSlot& s) {
  const auto slash = s.name.rfind('/');
  return slash == std::string::npos ? s.name : s.name.substr(slash + 1);
}

}  // namespace

InteropName interop_name(const ParamSlot& slot, const Config& cfg) {
  const std::string base = base_name(slot);
  const bool tokens = cfg.vocab_size > 0;
  InteropName n;
  n.shape = slot.shape;
  if (slot.layer >= 0) {
    for (const LayerName& ln : kLayerNames) {
      if (base != ln.ours) continue;
      n.name = "backbone.layers." + std::to_string(slot.layer) + "." + ln.file;
      n.transposed = ln.transposed;
    }
    M3_REQUIRE(!n.name.empty(), "interop", "no file name for parameter '" + slot.name + "'", "");
    if (base == "b_bias" || base == "c_bias") n.shape = {cfg.nheads(), 1, cfg.d_state};
    if (base == "norm_gate_weight" && !cfg.is_outproj_norm) {
      n.optional = true;
      n.fill = 1;
    }
  } else if (base == "input_proj_w") {
    n.name = tokens ? "backbone.embedding.weight" : "backbone.input_proj.weight";
    n.transposed = !tokens;  // nn.Embedding is [V, dm] like ours; a Linear is [out, in]
  } else if (base == "input_proj_b") {
    n.name = tokens ? "backbone.embedding.bias" : "backbone.input_proj.bias";
    n.optional = tokens;
    n.fill = 0;
  } else if (base == "norm_f_weight") {
    n.name = "backbone.norm_f.weight";
  } else if (base == "head_w") {
    n.name = "lm_head.weight";
    n.transposed = true;
  } else {
    throw Error("interop", "no file name for parameter '" + slot.name + "'", "");
  }
  if (n.transposed) n.shape = {slot.shape.at(1), slot.shape.at(0)};
  return n;
}

st::File export_model(const Config& cfg, const Settings& settings,
                      const std::vector<float>& params) {
  cfg.validate();
  const ParamLayout layout = param_layout(cfg);
  M3_REQUIRE(static_cast<Idx>(params.size()) == layout.total, "export",
             "the parameter buffer has the wrong size", "got ", params.size(),
             " floats, the layout has ", layout.total);
  // The settings must describe this config (import rebuilds it from them alone).
  {
    const Settings want = config_settings(cfg);
    const Settings got = config_settings(config_from_settings(settings, "export settings"));
    for (std::size_t i = 0; i < want.size(); ++i)
      M3_REQUIRE(got[i].second == want[i].second, "export",
                 "setting '" + want[i].first + "' disagrees with the model config", "setting ",
                 got[i].second, ", config ", want[i].second);
  }
  st::File f;
  f.metadata.push_back({"format", "pt"});
  f.metadata.push_back({"m3h.interop", kInteropVersion});
  std::string names;
  for (const auto& kv : settings) {
    M3_REQUIRE(kv.first.find(',') == std::string::npos, "export",
               "setting name '" + kv.first + "' holds a comma", "");
    names += (names.empty() ? "" : ",") + kv.first;
  }
  f.metadata.push_back({kSettingsKey, names});
  for (const auto& [k, v] : settings) f.metadata.push_back({kSettingPrefix + k, v});

  for (const ParamSlot& s : layout.slots) {
    const InteropName n = interop_name(s, cfg);
    std::vector<float> v(params.begin() + s.offset, params.begin() + s.offset + s.size);
    if (n.transposed) {
      const Idx rows = s.shape[0], cols = s.shape[1];  // ours [in, out] → file [out, in]
      std::vector<float> t(v.size());
      for (Idx i = 0; i < rows; ++i)
        for (Idx j = 0; j < cols; ++j)
          t[static_cast<std::size_t>(j * rows + i)] = v[static_cast<std::size_t>(i * cols + j)];
      v.swap(t);
    }
    f.tensors.push_back(st::f32_tensor(n.name, n.shape, v));
  }
  return f;
}

ImportedModel import_model(const st::File& f, const std::string& where) {
  ImportedModel out;
  const std::string* names = f.meta(kSettingsKey);
  if (!names)
    throw Error(where, "__metadata__ has no 'm3h.settings'",
                "the model config must travel with the weights: m3h.settings and "
                "m3h.setting.<name> (docs/INTEROP.md)");
  {
    std::set<std::string> listed;
    std::stringstream ss(*names);
    std::string name;
    while (std::getline(ss, name, ',')) {
      const std::string* v = f.meta(kSettingPrefix + name);
      if (!v)
        throw Error(where, "__metadata__ lists setting " + named(name) + " but has no '" +
                               kSettingPrefix + escape_for_message(name, 60) + "'",
                    "");
      listed.insert(name);
      out.settings.push_back({name, *v});
    }
    for (const auto& [k, v] : f.metadata)
      if (k.rfind(kSettingPrefix, 0) == 0 && !listed.count(k.substr(std::string(kSettingPrefix).size())))
        throw Error(where, "__metadata__ " + named(k) + " is not listed in m3h.settings", "");
  }
  out.cfg = config_from_settings(out.settings, where + ": __metadata__");
  // What a checkpoint's reader would refuse is refused before one is written.
  check_run_settings(out.settings, where + ": __metadata__");
  const ParamLayout layout = param_layout(out.cfg);
  out.params.assign(static_cast<std::size_t>(layout.total), 0.0f);
  std::set<std::string> used;
  for (const ParamSlot& s : layout.slots) {
    const InteropName n = interop_name(s, out.cfg);
    used.insert(n.name);
    const st::TensorData* t = f.find(n.name);
    const auto at = out.params.begin() + s.offset;
    if (!t) {
      if (!n.optional)
        throw Error(where, "missing tensor " + named(n.name),
                    "expected " + shape_str(n.shape) + " (our " + s.name + ") for the config in __metadata__");
      std::fill(at, at + s.size, n.fill);
      out.defaulted.push_back(n.name);
      continue;
    }
    if (t->shape != n.shape)
      throw Error(where, "tensor " + named(n.name) + " has shape " + shape_str(t->shape) +
                             ", expected " + shape_str(n.shape),
                  "our " + s.name + (n.transposed ? " " + shape_str(s.shape) + ", transposed" : ""));
    if (t->dtype == st::DType::I32)
      throw Error(where, "tensor " + named(n.name) + " is I32", "weights are F32, BF16 or F16");
    const std::vector<float> v = st::to_floats(*t, where);
    for (std::size_t i = 0; i < v.size(); ++i)
      if (!std::isfinite(v[i]))
        throw Error(where, "tensor " + named(n.name) + " holds a non-finite value",
                    why(v[i], " at flat index ", i));
    if (n.transposed) {
      const Idx rows = s.shape[0], cols = s.shape[1];  // file [cols, rows] → ours [rows, cols]
      for (Idx j = 0; j < cols; ++j)
        for (Idx i = 0; i < rows; ++i)
          at[i * cols + j] = v[static_cast<std::size_t>(j * rows + i)];
    } else {
      std::copy(v.begin(), v.end(), at);
    }
  }
  for (const st::TensorData& t : f.tensors)
    if (!used.count(t.name))
      throw Error(where, "unexpected tensor " + named(t.name) + " " + shape_str(t.shape),
                  "not a parameter of the config in __metadata__");
  return out;
}

TokenRows parse_token_rows(const std::string& text, Idx vocab, const std::string& where) {
  TokenRows r;
  std::stringstream lines(text);
  std::string line;
  Idx lineno = 0;
  while (std::getline(lines, line)) {
    ++lineno;
    const auto hash = line.find('#');
    if (hash != std::string::npos) line.resize(hash);
    for (char& c : line)
      if (c == ',' || c == '\t' || c == '\r') c = ' ';
    std::stringstream items(line);
    std::string item;
    Idx n = 0;
    while (items >> item) {
      std::size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != item.size() || v < 0 || v >= vocab)
        throw Error(where, why("line ", lineno, ": token '", escape_for_message(item, 30), "'"),
                    why("expected an integer in [0, ", vocab, ")"));
      r.tok.push_back(static_cast<std::int32_t>(v));
      ++n;
    }
    if (n == 0) continue;
    if (r.B > 0 && n != r.T)
      throw Error(where, why("line ", lineno, " has ", n, " tokens"),
                  why("every row must have ", r.T, ", as the first"));
    r.T = n;
    ++r.B;
  }
  if (r.B == 0) throw Error(where, "no token row", "one sequence of token ids per line");
  return r;
}

ModelLogits model_logits(const Config& cfg, const std::vector<float>& params,
                         const TokenRows& rows, ScanMode mode,
                         const std::vector<Precision>& precisions) {
  M3_REQUIRE(cfg.vocab_size > 0, "logits", "the model has no vocabulary", "vocab_size 0");
  Problem pb = make_problem(cfg, rows.B, rows.T, 0, false);
  pb.params = cast_params<double>(from_flat(params, cfg, param_layout(cfg)));
  pb.tok = rows.tok;
  // Targets and weights only feed the loss and the backward, not the logits.
  for (Idx b = 0; b < rows.B; ++b)
    for (Idx t = 0; t < rows.T; ++t)
      pb.tgt[static_cast<std::size_t>(b * rows.T + t)] =
          rows.tok[static_cast<std::size_t>(b * rows.T + std::min(t + 1, rows.T - 1))];
  std::fill(pb.w.begin(), pb.w.end(), 1.0f);
  const Capture oracle = run_reference<double>(pb, mode);
  const Tensor& o = oracle.at("head/logits");
  ModelLogits out;
  out.logits.assign(o.data.begin(), o.data.end());
  const harness::ToleranceRow& row = harness::find_tolerance("head", "logits", mode);
  for (Precision p : precisions) {
    const Capture base = run_reference<float>(pb, mode, p);
    const harness::Metrics m = harness::compute_metrics(o, base.at("head/logits"), false, p);
    const harness::Budget b =
        harness::make_budget(row, p, m, &m, harness::depth_factor(cfg));
    out.budgets.push_back({p, b.rel_l2, b.max_abs, m.rel_l2, m.max_abs});
  }
  return out;
}

}  // namespace m3::train
