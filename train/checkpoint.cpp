// Checkpoints: write, read + validate, compare for resume (see checkpoint.hpp for the layout).
#include "checkpoint.hpp"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>

#include "capture.hpp"
#include "digest_record.hpp"
#include "error.hpp"
#include "h5store.hpp"
#include "registry.hpp"

namespace m3::train {

namespace {

constexpr const char* kMeta = "/meta";
constexpr const char* kKind = "checkpoint";
// The array groups, in file order, with the TrainState buffer each holds.
constexpr const char* kWeights = "/weights";
constexpr const char* kMoment1 = "/optimizer/m";
constexpr const char* kMoment2 = "/optimizer/v";

// /meta attributes of fixed meaning: no setting may take one of these names.
const std::set<std::string>& reserved_names() {
  static const std::set<std::string> names = {"kind",       "schema_version", "settings",
                                              "step",       "loss_scale",     "good_steps",
                                              "skipped",    "data_size",      "data_hash",
                                              "git_revision",  "run_id",       "elapsed_s"};
  return names;
}

// The three buffers of a TrainState with their groups.
template <class St>
auto arrays(St& st) {
  using V = decltype(&st.params);
  return std::vector<std::pair<const char*, V>>{
      {kWeights, &st.params}, {kMoment1, &st.m}, {kMoment2, &st.v}};
}

// Run settings of integer and of real value (see the trainer's run_settings).
const std::set<std::string> kIntegerSettings = {"B", "T", "steps", "warmup", "grad_accum", "eval_len"};
const std::set<std::string> kRealSettings = {"lr",  "min_lr_ratio", "beta1", "beta2",
                                             "eps", "wd",           "clip",  "val_fraction"};

bool parse_int(const std::string& s, Idx* out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(s.c_str(), &end, 10);
  if (errno == ERANGE || *end != '\0') return false;
  *out = static_cast<Idx>(v);
  return true;
}

bool parse_double(const std::string& s, double* out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (*end != '\0') return false;
  *out = v;
  return true;
}

const std::string* find_setting(const Settings& s, const std::string& name) {
  for (const auto& kv : s)
    if (kv.first == name) return &kv.second;
  return nullptr;
}

void check_setting_names(const Settings& settings, const std::string& where) {
  std::set<std::string> seen;
  for (const auto& [name, value] : settings) {
    M3_REQUIRE(!name.empty(), where, "a setting has an empty name", "value '", value, "'");
    M3_REQUIRE(name.find_first_not_of("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                      "0123456789_-.") == std::string::npos,
               where, "setting name '" + name + "' holds a character other than [A-Za-z0-9_.-]",
               "names are identifiers");
    M3_REQUIRE(reserved_names().count(name) == 0, where,
               "setting name '" + name + "' is a fixed /meta attribute of a checkpoint",
               "rename the setting");
    M3_REQUIRE(seen.insert(name).second, where, "setting '" + name + "' is listed twice", "");
  }
}

bool same_value(const std::string& a, const std::string& b) {
  if (a == b) return true;
  double x = 0, y = 0;
  return parse_double(a, &x) && parse_double(b, &y) && x == y;
}

// Every dataset below `group` (recursively), as absolute paths.
void collect_datasets(const h5::Reader& r, const std::string& group,
                      std::vector<std::string>& out) {
  for (const std::string& child : r.children(group)) {
    const std::string p = group + "/" + child;
    if (r.is_group(p))
      collect_datasets(r, p, out);
    else
      out.push_back(p);
  }
}

}  // namespace

void check_run_settings(const Settings& settings, const std::string& where) {
  for (const auto& [name, value] : settings) {
    const std::string attr = "/meta attribute '" + name + "'";
    const std::string shown = "'" + escape_for_message(value, 60) + "'";
    Idx i = 0;
    double d = 0;
    if (kIntegerSettings.count(name) && (!parse_int(value, &i) || i < 0))
      throw Error(where, attr + " is not a non-negative integer", shown);
    if (kRealSettings.count(name) && !parse_double(value, &d))
      throw Error(where, attr + " is not a number", shown);
    if (name == "precision" && value != "f32" && value != "bf16" && value != "f16")
      throw Error(where, attr + " is not a training precision (f32, bf16, f16)", shown);
    if (name == "scan" && value != "seq" && value != "chunked")
      throw Error(where, attr + " is not a scan mode (seq, chunked)", shown);
  }
}

std::string exact_double(double v) {
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, res.ptr);
}

Settings config_settings(const Config& c) {
  auto i = [](Idx v) { return std::to_string(v); };
  return {{"d_model", i(c.d_model)},
          {"d_state", i(c.d_state)},
          {"expand", i(c.expand)},
          {"headdim", i(c.headdim)},
          {"ngroups", i(c.ngroups)},
          {"n_layers", i(c.n_layers)},
          {"rope_fraction", exact_double(c.rope_fraction)},
          {"a_floor", exact_double(c.a_floor)},
          {"is_outproj_norm", c.is_outproj_norm ? "1" : "0"},
          {"input_dim", i(c.input_dim)},
          {"input_proj_identity", c.input_proj_identity ? "1" : "0"},
          {"chunk_size", i(c.chunk_size)},
          {"vocab_size", i(c.vocab_size)}};
}

Config config_from_settings(const Settings& settings, const std::string& where) {
  auto get = [&](const char* name) -> const std::string& {
    const std::string* v = find_setting(settings, name);
    if (!v) throw Error(where, std::string("no setting '") + name + "'", "a model config field");
    return *v;
  };
  auto integer = [&](const char* name) {
    Idx v = 0;
    const std::string& s = get(name);
    if (!parse_int(s, &v))
      throw Error(where, std::string("setting '") + name + "' is not an integer", "'" + s + "'");
    return v;
  };
  auto real = [&](const char* name) {
    double v = 0;
    const std::string& s = get(name);
    if (!parse_double(s, &v))
      throw Error(where, std::string("setting '") + name + "' is not a number", "'" + s + "'");
    return v;
  };
  auto flag = [&](const char* name) {
    const std::string& s = get(name);
    if (s == "1" || s == "true") return true;
    if (s == "0" || s == "false") return false;
    throw Error(where, std::string("setting '") + name + "' is not 0 or 1", "'" + s + "'");
  };
  Config c;
  c.d_model = integer("d_model");
  c.d_state = integer("d_state");
  c.expand = integer("expand");
  c.headdim = integer("headdim");
  c.ngroups = integer("ngroups");
  c.n_layers = integer("n_layers");
  c.rope_fraction = real("rope_fraction");
  c.a_floor = real("a_floor");
  c.is_outproj_norm = flag("is_outproj_norm");
  c.input_dim = integer("input_dim");
  c.input_proj_identity = flag("input_proj_identity");
  c.chunk_size = integer("chunk_size");
  c.vocab_size = integer("vocab_size");
  try {
    c.validate();
  } catch (const Error& e) {
    throw Error(where, "the settings describe an invalid model config", e.what());
  }
  return c;
}

void write_checkpoint(const std::string& path, const Config& cfg, const CheckpointMeta& meta,
                      const TrainState& st, bool overwrite) {
  const std::string where = "checkpoint " + path;
  cfg.validate();
  check_setting_names(meta.settings, where);
  {  // the settings must rebuild exactly cfg, as read_checkpoint will rebuild it
    const Settings want = config_settings(cfg);
    const Settings got = config_settings(config_from_settings(meta.settings, where));
    for (std::size_t i = 0; i < want.size(); ++i)
      M3_REQUIRE(got[i].second == want[i].second, where,
                 "setting '" + want[i].first + "' disagrees with the model config",
                 "setting ", *find_setting(meta.settings, want[i].first), ", config ",
                 want[i].second);
  }
  const ParamLayout layout = param_layout(cfg);
  for (const auto& [group, buf] : arrays(st))
    M3_REQUIRE(static_cast<Idx>(buf->size()) == layout.total, where,
               std::string("the ") + group + " buffer has the wrong size", "got ", buf->size(),
               " floats, the layout has ", layout.total);
  M3_REQUIRE(std::isfinite(meta.loss_scale) && meta.loss_scale > 0, where,
             "loss_scale must be finite and > 0", "got ", meta.loss_scale);
  M3_REQUIRE(std::isfinite(meta.elapsed_s) && meta.elapsed_s >= 0, where,
             "elapsed_s must be finite and >= 0", "got ", meta.elapsed_s);
  M3_REQUIRE(meta.step >= 0 && meta.good_steps >= 0 && meta.skipped >= 0 && meta.data_size >= 0,
             where, "step, good_steps, skipped and data_size must be >= 0", "step ", meta.step,
             ", good_steps ", meta.good_steps, ", skipped ", meta.skipped, ", data_size ",
             meta.data_size);

  h5::Writer w(path, overwrite);
  w.group(kMeta);
  w.attr(kMeta, "kind", kKind);
  w.attr(kMeta, "schema_version", kCheckpointSchemaVersion);
  std::string names;
  for (const auto& kv : meta.settings) names += (names.empty() ? "" : ",") + kv.first;
  w.attr(kMeta, "settings", names);
  for (const auto& [name, value] : meta.settings) w.attr(kMeta, name, value);
  w.attr(kMeta, "step", meta.step);
  w.attr(kMeta, "loss_scale", meta.loss_scale);
  w.attr(kMeta, "good_steps", meta.good_steps);
  w.attr(kMeta, "skipped", meta.skipped);
  w.attr(kMeta, "data_size", meta.data_size);
  w.attr(kMeta, "data_hash", harness::hex16(meta.data_hash));
  w.attr(kMeta, "git_revision", meta.git_revision);
  if (!meta.run_id.empty()) w.attr(kMeta, "run_id", meta.run_id);
  w.attr(kMeta, "elapsed_s", meta.elapsed_s);

  for (const auto& [group, buf] : arrays(st)) {
    for (const ParamSlot& s : layout.slots) {
      const auto first = buf->begin() + s.offset;
      w.write(std::string(group) + "/" + s.name,
              Tensor{s.shape, std::vector<double>(first, first + s.size)}, h5::DType::F32);
    }
  }
  w.commit();
}

CheckpointMeta read_checkpoint(const std::string& path, Config* cfg_out, TrainState* st_out) {
  const h5::Reader r(path);
  auto fail = [&](const std::string& what, const std::string& why = "") -> void {
    throw Error(path, what, why);
  };
  if (!r.is_group(kMeta)) fail("not a checkpoint: no /meta group");
  if (!r.has_attr(kMeta, "kind")) fail("not a checkpoint: /meta has no 'kind' attribute");
  const std::string kind = r.attr_string(kMeta, "kind");
  if (kind != kKind) fail("not a checkpoint: /meta kind is '" + kind + "'", "expected 'checkpoint'");
  const std::int64_t version = r.attr_int(kMeta, "schema_version");
  if (version != kCheckpointSchemaVersion)
    fail(why("checkpoint schema version ", version, " found, version ",
             kCheckpointSchemaVersion, " expected"),
         "this build cannot resume it");

  CheckpointMeta meta;
  {
    const std::string names = r.attr_string(kMeta, "settings");
    std::stringstream ss(names);
    std::string name;
    while (std::getline(ss, name, ','))
      meta.settings.emplace_back(name, r.attr_string(kMeta, name));
  }
  try {
    check_setting_names(meta.settings, path);
  } catch (const Error& e) {
    fail("/meta settings are invalid", e.what());
  }
  const Config cfg = config_from_settings(meta.settings, path);
  // Named here, with their attribute, not by whoever parses them later.
  check_run_settings(meta.settings, path);
  auto count = [&](const char* name) {
    const std::int64_t v = r.attr_int(kMeta, name);
    if (v < 0) fail(std::string("/meta ") + name + " is negative", why("got ", v));
    return static_cast<Idx>(v);
  };
  meta.step = count("step");
  meta.good_steps = count("good_steps");
  meta.skipped = count("skipped");
  meta.data_size = count("data_size");
  meta.loss_scale = r.attr_double(kMeta, "loss_scale");
  if (!std::isfinite(meta.loss_scale) || meta.loss_scale <= 0)
    fail("/meta loss_scale must be finite and > 0", why("got ", meta.loss_scale));
  {
    const std::string h = r.attr_string(kMeta, "data_hash");
    if (h.size() != 16 || h.find_first_not_of("0123456789abcdef") != std::string::npos)
      fail("/meta data_hash '" + h + "' is not 16 lowercase hex digits");
    meta.data_hash = std::strtoull(h.c_str(), nullptr, 16);
  }
  meta.git_revision = r.attr_string(kMeta, "git_revision");
  if (r.has_attr(kMeta, "run_id")) meta.run_id = r.attr_string(kMeta, "run_id");
  if (r.has_attr(kMeta, "elapsed_s")) {
    meta.elapsed_s = r.attr_double(kMeta, "elapsed_s");
    if (!std::isfinite(meta.elapsed_s) || meta.elapsed_s < 0)
      fail("/meta elapsed_s must be finite and >= 0", why("got ", meta.elapsed_s));
  }

  const ParamLayout layout = param_layout(cfg);
  TrainState st;
  std::set<std::string> expected;
  for (const auto& [group, buf] : arrays(st)) {
    buf->assign(static_cast<std::size_t>(layout.total), 0.0f);
    for (const ParamSlot& s : layout.slots) {
      const std::string p = std::string(group) + "/" + s.name;
      expected.insert(p);
      if (!r.has(p) || r.is_group(p))
        fail("missing dataset '" + p + "'",
             "expected f32 " + shape_str(s.shape) + " for the config in /meta");
      if (r.dtype(p) != h5::DType::F32)
        fail("dataset '" + p + "' is stored as " + precision_name(r.dtype(p)),
             "checkpoints hold f32");
      const Tensor t = r.read_finite(p, s.shape);
      for (Idx i = 0; i < s.size; ++i)
        (*buf)[static_cast<std::size_t>(s.offset + i)] =
            static_cast<float>(t.data[static_cast<std::size_t>(i)]);
    }
  }
  std::vector<std::string> present;
  for (const char* g : {kWeights, "/optimizer"})
    if (r.is_group(g)) collect_datasets(r, g, present);
  for (const std::string& p : present)
    if (expected.count(p) == 0)
      fail("unexpected dataset '" + p + "'", "not a parameter of the config in /meta");

  if (cfg_out) *cfg_out = cfg;
  if (st_out) *st_out = std::move(st);
  return meta;
}

const std::string* setting(const CheckpointMeta& meta, const std::string& name) {
  return find_setting(meta.settings, name);
}

Idx int_setting(const CheckpointMeta& meta, const std::string& name, Idx fallback) {
  const std::string* v = find_setting(meta.settings, name);
  Idx out = fallback;
  if (v && !parse_int(*v, &out)) out = fallback;
  return out;
}

std::string setting_option(const std::string& setting) {
  // The settings whose option is not "--" + the name with '-' for '_'.
  static const std::pair<const char*, const char*> kNamed[] = {
      {"n_layers", "--layers"},
      {"is_outproj_norm", "--outproj-norm"},
      {"precision", "--dtype"},
      {"task", "--task"},
      {"n_min", "--task-opt n_min"},
      {"n_max", "--task-opt n_max"},
      {"m", "--task-opt m"},
      {"K", "--task-opt K"},
      {"alphabet", "--task-opt alphabet"},
      {"vocab_size", "vocab_size (the data's vocabulary: --data or --task)"},
      {"input_dim", "input_dim (the data's vocabulary: --data or --task)"},
      {"input_proj_identity", "input_proj_identity (fixed for a token model)"},
      {"a_floor", "a_floor (fixed by the model)"},
  };
  for (const auto& [name, option] : kNamed)
    if (setting == name) return option;
  std::string option = "--" + setting;
  for (char& c : option)
    if (c == '_') c = '-';
  return option;
}

std::string resume_mismatch(const CheckpointMeta& saved, const CheckpointMeta& now) {
  auto differs = [](const std::string& name, const std::string& was, const std::string& is) {
    return "resume: " + setting_option(name) + " differs from the checkpoint's: checkpoint " +
           was + ", now " + is;
  };
  for (const auto& [name, value] : saved.settings) {
    const std::string* cur = find_setting(now.settings, name);
    if (!cur) return differs(name, value, "not set");
    if (!same_value(value, *cur)) return differs(name, value, *cur);
  }
  for (const auto& [name, value] : now.settings)
    if (!find_setting(saved.settings, name)) return differs(name, "not set", value);
  if (saved.data_size != now.data_size || saved.data_hash != now.data_hash)
    return "resume: the data file differs from the one the checkpoint was trained on: "
           "checkpoint " + std::to_string(saved.data_size) + " bytes, hash " +
           harness::hex16(saved.data_hash) + "; now " + std::to_string(now.data_size) +
           " bytes, hash " + harness::hex16(now.data_hash);
  return "";
}

}  // namespace m3::train
