// Golden files: compute, write, read + validate, compare (see golden.hpp; layout SCHEMA.md).
//
// Object paths, for a case with config cfg, run shape (B, T) and stored modes M:
//   /meta                                   attributes only (SCHEMA.md)
//   /weights/<p>, /weights/L<ℓ>/<p>         every parameter of expected_param_keys(cfg)
//   /inputs/x, /inputs/d_out, /inputs/states/{ssm,k,v,angle}
//                                           (a token model, vocab_size > 0: /inputs/tok,
//                                           /inputs/tgt, /inputs/w instead of x and d_out)
//   /stages/<m>/<key>                       every key of expected_stage_keys(cfg, B, T, m)
//   /grads/<m>/<p>, /grads/<m>/L<ℓ>/<p>     every parameter gradient, per mode
// Everything is f64 (tokens and targets too: small integers, exact in f64); nothing else may
// be in the file.
#include "golden.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <set>
#include <sstream>
#include <utility>

#include "error.hpp"
#include "h5store.hpp"
#include "params.hpp"
#include "registry.hpp"

#ifndef M3_GIT_REVISION
#define M3_GIT_REVISION "unknown"
#endif

namespace m3::golden {

namespace fs = std::filesystem;

const char* git_revision() { return M3_GIT_REVISION; }

namespace {

constexpr const char* kMeta = "/meta";
constexpr double kTwoPi = 6.283185307179586476925286766559;

std::string mode_list(const std::vector<ScanMode>& modes) {
  std::string s;
  for (ScanMode m : modes) s += (s.empty() ? "" : ",") + std::string(scan_mode_name(m));
  return s;
}

// "grad/L0/in_proj_w" → "L0/in_proj_w"
std::string strip_grad(const std::string& key) { return key.substr(5); }

std::string weight_path(const KeyedParam& kp) { return "/weights/" + strip_grad(kp.key); }
std::string stage_path(ScanMode m, const std::string& key) {
  return std::string("/stages/") + scan_mode_name(m) + "/" + key;
}
std::string grad_path(ScanMode m, const KeyedParam& kp) {
  return std::string("/grads/") + scan_mode_name(m) + "/" + strip_grad(kp.key);
}

// The parameter vector of a (const or not) Params for a "grad/…" key.
template <class P>
auto& param_vec(P& p, const std::string& key) {
  decltype(&p.norm_f_weight) found = nullptr;
  for_each_param(p, [&](int layer, const char* name, auto& v) {
    if (param_key(layer, name) == key) found = &v;
  });
  if (!found) throw Error("golden", "no parameter for key '" + key + "'", "");
  return *found;
}

struct InputSpec {
  const char* path;
  std::vector<Idx> shape;
};

// The double-valued inputs with their shapes: X and dOut (not in a token model), then the four
// entering states [L, B, …].
std::vector<InputSpec> input_specs(const Config& c, Idx B, Idx T) {
  const Idx L = c.n_layers, nh = c.nheads();
  std::vector<InputSpec> v;
  if (c.vocab_size == 0) {
    v.push_back({"/inputs/x", {B * T, c.input_dim}});
    v.push_back({"/inputs/d_out", {B * T, c.d_model}});
  }
  v.push_back({"/inputs/states/ssm", {L, B, nh, c.headdim, c.d_state}});
  v.push_back({"/inputs/states/k", {L, B, nh, c.d_state}});
  v.push_back({"/inputs/states/v", {L, B, nh, c.headdim}});
  v.push_back({"/inputs/states/angle", {L, B, nh, c.num_rope_angles()}});
  return v;
}

// The Problem's vectors of input_specs, in the same order.
template <class P>
auto input_vecs(P& pb) {
  std::vector<decltype(&pb.x)> v;
  if (pb.cfg.vocab_size == 0) {
    v.push_back(&pb.x);
    v.push_back(&pb.d_out);
  }
  for (auto* s : {&pb.states.ssm, &pb.states.k, &pb.states.v, &pb.states.angle}) v.push_back(s);
  return v;
}

// ---- the token inputs of a token model (TRAINING.md §1; SCHEMA.md /inputs) -----------------
// tok, tgt: int32 in the Problem, integers in [0, V) stored as f64 (exact); w: float in the
// Problem, finite, ≥ 0 and Σ w > 0, stored as f64 (exact: every float is a double).

enum class TokenInput { Tok, Tgt, W };
constexpr TokenInput kTokenInputs[] = {TokenInput::Tok, TokenInput::Tgt, TokenInput::W};

const char* token_path(TokenInput k) {
  switch (k) {
    case TokenInput::Tok: return "/inputs/tok";
    case TokenInput::Tgt: return "/inputs/tgt";
    case TokenInput::W: return "/inputs/w";
  }
  return "?";
}

// The Problem's values of one token input, as doubles (exact).
std::vector<double> token_values(const Problem& pb, TokenInput k) {
  if (k == TokenInput::W) return std::vector<double>(pb.w.begin(), pb.w.end());
  const std::vector<std::int32_t>& v = k == TokenInput::Tok ? pb.tok : pb.tgt;
  return std::vector<double>(v.begin(), v.end());
}

// What is wrong with the values of one token input ({"", ""} when nothing): a token or target
// that is no integer in [0, V), a weight that is negative, not finite or no float value, or
// weights that sum to 0 (the loss is undefined). {what, why}, the index in the why.
std::pair<std::string, std::string> token_values_error(TokenInput k, const std::vector<double>& v,
                                                       Idx V) {
  const Idx n = static_cast<Idx>(v.size());
  const std::vector<Idx> shape{n};
  if (k == TokenInput::W) {
    double sum = 0;
    for (Idx i = 0; i < n; ++i) {
      const double x = v[i];
      const std::string at = " at " + h5::index_str(shape, i);
      if (!std::isfinite(x)) return {"holds a non-finite weight", why(x, at)};
      if (x < 0) return {"holds a negative weight", why(x, at, ", expected w >= 0")};
      if (static_cast<double>(static_cast<float>(x)) != x)
        return {"holds a weight that is not a float32 value",
                why(x, at, ": the problem holds the weights as float")};
      sum += x;
    }
    if (n > 0 && !(sum > 0))
      return {"holds weights that are all 0",
              "N = sum of w = 0 scores no position: the loss is undefined"};
    return {"", ""};
  }
  const char* what = k == TokenInput::Tok ? "token" : "target";
  for (Idx i = 0; i < n; ++i) {
    const double x = v[i];
    const std::string at = " at " + h5::index_str(shape, i);
    if (!std::isfinite(x) || x != std::floor(x))
      return {std::string("holds a ") + what + " that is not an integer", why(x, at)};
    if (x < 0 || x >= static_cast<double>(V) ||
        x > static_cast<double>(std::numeric_limits<std::int32_t>::max()))
      return {std::string("holds a ") + what + " out of range",
              why(x, at, ", expected 0 <= ", what, " < vocab_size = ", V)};
  }
  return {"", ""};
}

// Checks that a Problem is complete and consistent (sizes of everything; a token model's token
// values).
void check_problem(const Problem& pb, const char* where) {
  validate_run(pb.cfg, pb.B, pb.T);
  check_params(pb.params, pb.cfg, where);
  const auto specs = input_specs(pb.cfg, pb.B, pb.T);
  const auto vecs = input_vecs(pb);
  for (size_t i = 0; i < specs.size(); ++i)
    M3_REQUIRE(static_cast<Idx>(vecs[i]->size()) == shape_numel(specs[i].shape), where,
               std::string("problem tensor '") + specs[i].path + "' has the wrong size", "got ",
               vecs[i]->size(), ", expected ", shape_str(specs[i].shape));
  const Idx BT = pb.B * pb.T;
  if (!pb.token_model()) {
    M3_REQUIRE(pb.tok.empty() && pb.tgt.empty() && pb.w.empty(), where,
               "the problem holds tokens but its config is no token model (vocab_size = 0)",
               pb.tok.size(), " tokens, ", pb.tgt.size(), " targets, ", pb.w.size(), " weights");
    return;
  }
  M3_REQUIRE(pb.x.empty() && pb.d_out.empty(), where,
             "a token model's problem holds x or d_out (it has tokens instead)", "x ",
             pb.x.size(), " values, d_out ", pb.d_out.size());
  for (TokenInput k : kTokenInputs) {
    const std::vector<double> v = token_values(pb, k);
    M3_REQUIRE(static_cast<Idx>(v.size()) == BT, where,
               std::string("problem tensor '") + token_path(k) + "' has the wrong size", "got ",
               v.size(), ", expected [", BT, "]");
    const auto [what, reason] = token_values_error(k, v, pb.cfg.vocab_size);
    M3_REQUIRE(what.empty(), where, std::string("problem tensor '") + token_path(k) + "' " + what,
               reason);
  }
}

void check_modes(const std::vector<ScanMode>& modes, const char* where) {
  M3_REQUIRE(!modes.empty(), where, "no scan mode given", "at least one of seq, chunked");
  for (size_t i = 0; i < modes.size(); ++i)
    for (size_t j = i + 1; j < modes.size(); ++j)
      M3_REQUIRE(modes[i] != modes[j], where, "scan mode listed twice", scan_mode_name(modes[i]));
}

bool same_config(const Config& a, const Config& b) {
  return a.d_model == b.d_model && a.d_state == b.d_state && a.expand == b.expand &&
         a.headdim == b.headdim && a.ngroups == b.ngroups && a.n_layers == b.n_layers &&
         a.rope_fraction == b.rope_fraction && a.a_floor == b.a_floor &&
         a.is_outproj_norm == b.is_outproj_norm && a.input_dim == b.input_dim &&
         a.input_proj_identity == b.input_proj_identity && a.chunk_size == b.chunk_size &&
         a.vocab_size == b.vocab_size;
}

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

// ---- reading helpers ------------------------------------------------------------------------

// How to make the file again, for a message about what is wrong with it: a built-in case's
// regen command; for an m3h dump (kind = "dump"), that it is no golden file; else the command
// that writes a golden file of one's own problem. Never a command that would fail (regen
// --case of a name that is no built-in case).
std::string regen_hint(const h5::Reader& r, const std::string& name) {
  for (const CaseDef& d : builtin_cases())
    if (d.name == name) return "regenerate with m3h golden regen --case " + name + " --force";
  if (r.is_group(kMeta) && r.has_attr(kMeta, "kind") && r.attr_string(kMeta, "kind") == "dump")
    return "an m3h dump, not a golden file; m3h golden regen --out FILE.h5 writes a golden file "
           "of a problem of your own";
  return "not a built-in case; m3h golden regen --out " + r.path() +
         " --force with its problem options writes it again";
}

struct FileReader {
  const h5::Reader& r;
  std::string name;  // case name, for the regen hint

  [[noreturn]] void fail(const std::string& what, const std::string& why = "") const {
    throw Error(r.path(), what, why);
  }
  std::int64_t meta_int(const char* attr) const { return r.attr_int(kMeta, attr); }
  double meta_double(const char* attr) const { return r.attr_double(kMeta, attr); }
  std::string meta_string(const char* attr) const { return r.attr_string(kMeta, attr); }
  bool meta_bool(const char* attr) const {
    const std::int64_t v = meta_int(attr);
    if (v != 0 && v != 1)
      fail(std::string("/meta attribute '") + attr + "' must be 0 or 1", why("got ", v));
    return v == 1;
  }

  // A dataset of the expected shape, stored as f64, every value finite.
  Tensor dataset(const std::string& path, const std::vector<Idx>& shape) const {
    if (!r.has(path) || r.is_group(path))
      fail("missing dataset '" + path + "'",
           "the registry expects it, shape " + shape_str(shape) + "; " + regen_hint(r, name));
    if (r.dtype(path) != h5::DType::F64)
      fail("dataset '" + path + "' is stored as " + precision_name(r.dtype(path)),
           "golden files hold f64 only");
    return r.read_finite(path, shape);
  }
};

// Every dataset below `group` (recursively), as absolute paths.
void collect_datasets(const h5::Reader& r, const std::string& group,
                      std::vector<std::string>& out) {
  for (const std::string& child : r.children(group)) {
    const std::string p = (group == "/" ? "" : group) + "/" + child;
    if (r.is_group(p))
      collect_datasets(r, p, out);
    else
      out.push_back(p);
  }
}

// ---- diff helpers ---------------------------------------------------------------------------

TensorDiff diff_tensor(ScanMode mode, const std::string& key, const Tensor* a, const Tensor* b,
                       bool circular, const Tolerance& tol) {
  TensorDiff d;
  d.mode = mode;
  d.key = key;
  if (a) d.old_shape = a->shape;
  if (b) d.new_shape = b->shape;
  if (!a || !b) {
    d.status = a ? DiffStatus::Removed : DiffStatus::New;
    d.identical = false;
    return d;
  }
  if (a->shape != b->shape || a->data.size() != b->data.size()) {
    d.status = DiffStatus::ShapeChanged;
    d.identical = false;
    return d;
  }
  d.identical = same_bits(a->data, b->data);
  double old_l2 = 0, diff_l2 = 0;
  const Idx n = static_cast<Idx>(a->data.size());
  for (Idx i = 0; i < n; ++i) {
    const double o = a->data[i], c = b->data[i];
    double delta = c - o;
    if (circular) delta = std::remainder(delta, kTwoPi);
    double e = std::fabs(delta);
    if (std::isnan(e)) e = std::isnan(o) && std::isnan(c) ? 0.0 : HUGE_VAL;
    if (std::isfinite(o)) {
      d.scale = std::max(d.scale, std::fabs(o));
      old_l2 += o * o;
    }
    diff_l2 += std::isfinite(e) ? e * e : HUGE_VAL;
    if (d.worst_index < 0 || e > d.max_abs) {
      d.worst_index = i;
      d.max_abs = e;
      d.old_value = o;
      d.new_value = c;
    }
  }
  const double floor_scale = std::max(d.scale, tol.min_scale);
  const double floor_l2 =
      std::max(std::sqrt(old_l2), tol.min_scale * std::sqrt(static_cast<double>(n)));
  d.rel_l2 = n == 0 ? 0.0 : std::sqrt(diff_l2) / floor_l2;
  const bool within = d.max_abs <= tol.rtol * floor_scale && d.rel_l2 <= tol.rtol;
  d.status = d.identical || within ? DiffStatus::Unchanged : DiffStatus::Changed;
  return d;
}

std::string fmt(double v) {
  std::ostringstream os;
  os.precision(3);
  os << v;
  return os.str();
}

std::string fmt17(double v) {
  std::ostringstream os;
  os.precision(17);
  os << v;
  return os.str();
}

}  // namespace

// ---- compute / write / read -----------------------------------------------------------------

GoldenCase compute_case(const std::string& name, const Problem& pb,
                        const std::vector<ScanMode>& modes) {
  const char* where = "golden::compute_case";
  M3_REQUIRE(!name.empty(), where, "empty case name", "");
  check_modes(modes, where);
  check_problem(pb, where);
  GoldenCase gc;
  gc.name = name;
  gc.problem = pb;
  gc.modes = modes;
  for (ScanMode m : modes) gc.oracle[m] = run_reference<double>(pb, m, Precision::F64);
  return gc;
}

void write_run_attrs(h5::Writer& w, const std::string& g, const Config& c, Idx B, Idx T,
                     std::uint64_t seed) {
  w.attr(g, "d_model", c.d_model);
  w.attr(g, "d_state", c.d_state);
  w.attr(g, "expand", c.expand);
  w.attr(g, "headdim", c.headdim);
  w.attr(g, "ngroups", c.ngroups);
  w.attr(g, "n_layers", c.n_layers);
  w.attr(g, "rope_fraction", c.rope_fraction);
  w.attr(g, "a_floor", c.a_floor);
  w.attr(g, "is_outproj_norm", c.is_outproj_norm ? 1 : 0);
  w.attr(g, "input_dim", c.input_dim);
  w.attr(g, "input_proj_identity", c.input_proj_identity ? 1 : 0);
  w.attr(g, "chunk_size", c.chunk_size);
  // Only in a token model: a file without it has vocab_size 0 (the files written before token
  // models stay valid, and the backbone-only files keep their bytes).
  if (c.vocab_size > 0) w.attr(g, "vocab_size", c.vocab_size);
  w.attr(g, "d_inner", c.d_inner());
  w.attr(g, "nheads", c.nheads());
  w.attr(g, "num_rope_angles", c.num_rope_angles());
  w.attr(g, "in_proj_dim", c.in_proj_dim());
  w.attr(g, "B", B);
  w.attr(g, "T", T);
  w.attr(g, "seed", std::to_string(seed));
}

void write_golden(const std::string& path, const GoldenCase& gc, bool force) {
  const char* where = "golden::write_golden";
  M3_REQUIRE(!gc.name.empty(), where, "empty case name", path);
  check_modes(gc.modes, where);
  const Problem& pb = gc.problem;
  check_problem(pb, where);
  const Config& c = pb.cfg;
  for (ScanMode m : gc.modes)
    M3_REQUIRE(gc.oracle.count(m) == 1, where, "no oracle capture for a listed scan mode",
               scan_mode_name(m));

  h5::Writer w(path, force);
  w.group(kMeta);
  w.attr(kMeta, "schema_version", kSchemaVersion);
  w.attr(kMeta, "generator", kGenerator);
  w.attr(kMeta, "generator_version", kGeneratorVersion);
  w.attr(kMeta, "git_revision", git_revision());
  w.attr(kMeta, "case", gc.name);
  write_run_attrs(w, kMeta, c, pb.B, pb.T, pb.seed);
  w.attr(kMeta, "scan_modes", mode_list(gc.modes));
  w.attr(kMeta, "precision", precision_name(Precision::F64));
  // A token model's gradients are those of S·loss (HARNESS.md §9), so the file says S; only
  // there, so that the backbone-only files keep their bytes.
  if (pb.token_model()) w.attr(kMeta, "loss_scale", pb.loss_scale());

  const auto params = expected_param_keys(c);
  for (const KeyedParam& kp : params)
    w.write(weight_path(kp), Tensor{kp.shape, param_vec(pb.params, kp.key)}, h5::DType::F64);
  const auto specs = input_specs(c, pb.B, pb.T);
  const auto vecs = input_vecs(pb);
  if (pb.token_model())
    for (TokenInput k : kTokenInputs)
      w.write(token_path(k), Tensor{{pb.B * pb.T}, token_values(pb, k)}, h5::DType::F64);
  for (size_t i = 0; i < specs.size(); ++i)
    w.write(specs[i].path, Tensor{specs[i].shape, *vecs[i]}, h5::DType::F64);

  for (ScanMode m : gc.modes) {
    const Capture& cap = gc.oracle.at(m);
    size_t n_expected = 0;
    auto put = [&](const std::string& key, const std::string& h5path,
                   const std::vector<Idx>& shape) {
      const Tensor* t = cap.find(key);
      M3_REQUIRE(t != nullptr, where, "the oracle capture lacks a registry tensor",
                 scan_mode_name(m), " ", key);
      M3_REQUIRE(t->shape == shape, where, "oracle tensor shape differs from the registry",
                 scan_mode_name(m), " ", key, ": ", shape_str(t->shape), " vs ",
                 shape_str(shape));
      w.write(h5path, *t, h5::DType::F64);
      ++n_expected;
    };
    for (const KeyedSpec& ks : expected_stage_keys(c, pb.B, pb.T, m))
      put(ks.key, stage_path(m, ks.key), ks.shape);
    for (const KeyedParam& kp : params) put(kp.key, grad_path(m, kp), kp.shape);
    M3_REQUIRE(cap.keys().size() == n_expected, where,
               "the oracle capture holds tensors the registry does not expect",
               scan_mode_name(m), ": ", cap.keys().size(), " captured, ", n_expected,
               " expected");
  }
  w.commit();
}

GoldenCase read_golden(const std::string& path) {
  const h5::Reader r(path);
  FileReader f{r, fs::path(path).stem().string()};

  if (!r.is_group(kMeta)) f.fail("not a golden file: no /meta group");
  if (r.has_attr(kMeta, "case")) f.name = f.meta_string("case");
  const std::string regen = regen_hint(r, f.name);
  if (!r.has_attr(kMeta, "schema_version"))
    f.fail("not a golden file: /meta has no schema_version attribute", regen);
  const std::int64_t version = f.meta_int("schema_version");
  if (version != kSchemaVersion)
    f.fail(why("golden schema version ", version, " found, version ", kSchemaVersion,
               " expected"),
           regen);
  const std::string generator = f.meta_string("generator");
  if (generator != kGenerator)
    f.fail("/meta generator is '" + generator + "'", std::string("expected ") + kGenerator);
  const std::string precision = f.meta_string("precision");
  if (precision != "f64") f.fail("/meta precision is '" + precision + "'", "expected f64");
  f.meta_string("generator_version");
  f.meta_string("git_revision");

  GoldenCase gc;
  gc.name = f.name;
  Problem& pb = gc.problem;
  Config& c = pb.cfg;
  c.d_model = f.meta_int("d_model");
  c.d_state = f.meta_int("d_state");
  c.expand = f.meta_int("expand");
  c.headdim = f.meta_int("headdim");
  c.ngroups = f.meta_int("ngroups");
  c.n_layers = f.meta_int("n_layers");
  c.rope_fraction = f.meta_double("rope_fraction");
  c.a_floor = f.meta_double("a_floor");
  c.is_outproj_norm = f.meta_bool("is_outproj_norm");
  c.input_dim = f.meta_int("input_dim");
  c.input_proj_identity = f.meta_bool("input_proj_identity");
  c.chunk_size = f.meta_int("chunk_size");
  c.vocab_size = r.has_attr(kMeta, "vocab_size") ? f.meta_int("vocab_size") : 0;
  pb.B = f.meta_int("B");
  pb.T = f.meta_int("T");
  try {
    validate_run(c, pb.B, pb.T);
  } catch (const Error& e) {
    f.fail("invalid config or run shape in /meta", e.what());
  }
  const std::pair<const char*, Idx> derived[] = {{"d_inner", c.d_inner()},
                                                 {"nheads", c.nheads()},
                                                 {"num_rope_angles", c.num_rope_angles()},
                                                 {"in_proj_dim", c.in_proj_dim()}};
  for (const auto& [attr, want] : derived)
    if (f.meta_int(attr) != want)
      f.fail(std::string("/meta ") + attr + " disagrees with the config",
             why("stored ", f.meta_int(attr), ", the config gives ", want));
  {
    const std::string s = f.meta_string("seed");
    errno = 0;
    char* end = nullptr;
    const unsigned long long v = std::strtoull(s.c_str(), &end, 10);
    if (s.empty() || s[0] == '-' || s[0] == '+' || errno == ERANGE || *end != '\0')
      f.fail("/meta seed '" + s + "' is not an unsigned 64-bit decimal integer");
    pb.seed = static_cast<std::uint64_t>(v);
  }
  {
    const std::string s = f.meta_string("scan_modes");
    std::stringstream ss(s);
    std::string item;
    try {
      while (std::getline(ss, item, ',')) gc.modes.push_back(parse_scan_mode(item));
      check_modes(gc.modes, "scan_modes");
    } catch (const Error& e) {
      f.fail("/meta scan_modes '" + s + "' is invalid", e.what());
    }
  }

  // Every dataset the file must hold, in a fixed order; anything else is an error.
  std::set<std::string> expected_paths;
  const auto params = expected_param_keys(c);
  pb.params = zero_params<double>(c);
  for (const KeyedParam& kp : params) {
    const std::string p = weight_path(kp);
    param_vec(pb.params, kp.key) = f.dataset(p, kp.shape).data;
    expected_paths.insert(p);
  }
  if (pb.token_model())
    for (TokenInput k : kTokenInputs) {
      const std::vector<double> v = f.dataset(token_path(k), {pb.B * pb.T}).data;
      const auto [what, reason] = token_values_error(k, v, c.vocab_size);
      if (!what.empty()) f.fail(std::string("dataset '") + token_path(k) + "' " + what, reason);
      if (k == TokenInput::W)
        pb.w.assign(v.begin(), v.end());
      else
        (k == TokenInput::Tok ? pb.tok : pb.tgt).assign(v.begin(), v.end());
      expected_paths.insert(token_path(k));
    }
  // The scale of a token model's gradients: stored, and the one its weights give (N = Σ w).
  if (pb.token_model()) {
    if (!r.has_attr(kMeta, "loss_scale"))
      f.fail("/meta has no loss_scale attribute",
             "a token model's gradients are of S*loss and the file must say S; " + regen);
    const double stored = f.meta_double("loss_scale");
    if (stored != pb.loss_scale())
      f.fail("/meta loss_scale disagrees with the weights",
             why("stored ", stored, ", the weights give S = 2^ceil(log2 N) = ", pb.loss_scale(),
                 " (N = ", pb.scored(), ")"));
  }
  const auto specs = input_specs(c, pb.B, pb.T);
  const auto vecs = input_vecs(pb);
  for (size_t i = 0; i < specs.size(); ++i) {
    *vecs[i] = f.dataset(specs[i].path, specs[i].shape).data;
    expected_paths.insert(specs[i].path);
  }
  for (ScanMode m : gc.modes) {
    Capture cap(c, pb.B, pb.T);
    for (const KeyedSpec& ks : expected_stage_keys(c, pb.B, pb.T, m)) {
      const std::string p = stage_path(m, ks.key);
      const Tensor t = f.dataset(p, ks.shape);
      cap.put(ks.key, t.shape, t.data.data());
      expected_paths.insert(p);
    }
    for (const KeyedParam& kp : params) {
      const std::string p = grad_path(m, kp);
      const Tensor t = f.dataset(p, kp.shape);
      cap.put(kp.key, t.shape, t.data.data());
      expected_paths.insert(p);
    }
    gc.oracle[m] = std::move(cap);
  }
  for (const std::string& top : r.children("/"))
    if (top != "meta" && top != "weights" && top != "inputs" && top != "stages" &&
        top != "grads")
      f.fail("unexpected object '/" + top + "'", "schema version 1 has /meta /weights /inputs "
             "/stages /grads only");
  std::vector<std::string> found;
  for (const char* g : {"/weights", "/inputs", "/stages", "/grads"}) collect_datasets(r, g, found);
  for (const std::string& p : found)
    if (!expected_paths.count(p))
      f.fail("unexpected dataset '" + p + "'",
             "not produced by the registry for this config and scan_modes '" +
                 mode_list(gc.modes) + "'; " + regen);
  // Last, so that a file of the other kind is named by its datasets first.
  if (!pb.token_model() && r.has_attr(kMeta, "loss_scale"))
    f.fail("/meta has a loss_scale attribute but no vocab_size",
           "only a token model's gradients are scaled");
  check_problem(pb, r.path().c_str());
  return gc;
}

// ---- diff -----------------------------------------------------------------------------------

const char* diff_status_name(DiffStatus s) {
  switch (s) {
    case DiffStatus::Unchanged: return "unchanged";
    case DiffStatus::Changed: return "changed";
    case DiffStatus::New: return "new";
    case DiffStatus::Removed: return "removed";
    case DiffStatus::ShapeChanged: return "shape";
  }
  return "?";
}

std::string TensorDiff::path() const { return std::string(scan_mode_name(mode)) + "/" + key; }

int CaseDiff::count(DiffStatus s) const {
  int n = 0;
  for (const auto& t : tensors) n += t.status == s;
  return n;
}

const TensorDiff* CaseDiff::first_mismatch() const {
  for (const auto& t : tensors)
    if (t.status != DiffStatus::Unchanged) return &t;
  return nullptr;
}

CaseDiff diff_cases(const GoldenCase& ref, const GoldenCase& cand, const Tolerance& tol,
                    bool candidate_subset) {
  CaseDiff out;
  const Problem& a = ref.problem;
  const Problem& b = cand.problem;
  // Inputs: the first difference, in the order a reader would look for it.
  auto note = [&](const std::string& s) {
    if (!out.inputs_changed) out.inputs_note = s;
    out.inputs_changed = true;
  };
  if (!same_config(a.cfg, b.cfg)) note("config " + a.cfg.describe() + " → " + b.cfg.describe());
  if (a.B != b.B || a.T != b.T)
    note(why("run shape B=", a.B, " T=", a.T, " → B=", b.B, " T=", b.T));
  if (a.seed != b.seed) note(why("seed ", a.seed, " → ", b.seed));
  if (same_config(a.cfg, b.cfg)) {
    for (const KeyedParam& kp : expected_param_keys(a.cfg))
      if (!same_bits(param_vec(a.params, kp.key), param_vec(b.params, kp.key)))
        note("weights " + strip_grad(kp.key));
    const auto specs = input_specs(a.cfg, a.B, a.T);
    const auto va = input_vecs(a);
    const auto vb = input_vecs(b);
    if (a.token_model())
      for (TokenInput k : kTokenInputs)
        if (!same_bits(token_values(a, k), token_values(b, k)))
          note(std::string(token_path(k) + 1));
    for (size_t i = 0; i < specs.size(); ++i)
      if (!same_bits(*va[i], *vb[i])) note(std::string(specs[i].path + 1));
  }
  out.modes_changed = ref.modes != cand.modes;

  std::vector<ScanMode> modes = ref.modes;
  for (ScanMode m : cand.modes)
    if (std::find(modes.begin(), modes.end(), m) == modes.end()) modes.push_back(m);
  for (ScanMode m : modes) {
    const Capture* ca = ref.oracle.count(m) ? &ref.oracle.at(m) : nullptr;
    const Capture* cb = cand.oracle.count(m) ? &cand.oracle.at(m) : nullptr;
    // Keys in the candidate's registry order, then keys only the reference has.
    std::vector<std::pair<std::string, bool>> keys;  // key, circular
    std::set<std::string> seen;
    const GoldenCase& order_src = cb ? cand : ref;
    const Problem& op = order_src.problem;
    for (const KeyedSpec& ks : expected_stage_keys(op.cfg, op.B, op.T, m))
      if (seen.insert(ks.key).second) keys.push_back({ks.key, ks.spec->circular});
    for (const KeyedParam& kp : expected_param_keys(op.cfg))
      if (seen.insert(kp.key).second) keys.push_back({kp.key, false});
    for (const Capture* c : {ca, cb})
      if (c)
        for (const std::string& k : c->keys())
          if (seen.insert(k).second) keys.push_back({k, false});
    for (const auto& [key, circular] : keys) {
      const Tensor* ta = ca ? ca->find(key) : nullptr;
      const Tensor* tb = cb ? cb->find(key) : nullptr;
      if (!ta && !tb) continue;
      if (candidate_subset && ta && !tb) {
        ++out.not_compared;
        continue;
      }
      out.tensors.push_back(diff_tensor(m, key, ta, tb, circular, tol));
    }
  }
  return out;
}

std::string describe(const TensorDiff& d) {
  std::string s = d.path();
  switch (d.status) {
    case DiffStatus::New: return s + " (new, shape " + shape_str(d.new_shape) + ")";
    case DiffStatus::Removed: return s + " (removed, shape " + shape_str(d.old_shape) + ")";
    case DiffStatus::ShapeChanged:
      return s + " (shape " + shape_str(d.old_shape) + " → " + shape_str(d.new_shape) + ")";
    default: break;
  }
  s += " max_abs " + fmt(d.max_abs) + " (scale " + fmt(d.scale) + ", rel_l2 " + fmt(d.rel_l2) +
       ")";
  if (d.worst_index >= 0 && !d.identical)
    s += " at " + h5::index_str(d.old_shape, d.worst_index) + ": " + fmt17(d.old_value) +
         " → " + fmt17(d.new_value);
  return s;
}

std::vector<std::string> summarize(const CaseDiff& d, int max_lines) {
  std::vector<std::string> out;
  int identical = 0;
  for (const auto& t : d.tensors) identical += t.identical;
  std::string head = "unchanged: " + std::to_string(d.count(DiffStatus::Unchanged)) +
                     " tensors (" + std::to_string(identical) + " bit-identical); changed: " +
                     std::to_string(d.count(DiffStatus::Changed));
  for (DiffStatus s : {DiffStatus::New, DiffStatus::Removed, DiffStatus::ShapeChanged})
    head += std::string("; ") + diff_status_name(s) + ": " + std::to_string(d.count(s));
  out.push_back(head);
  if (d.inputs_changed) out.push_back("inputs changed: " + d.inputs_note);
  if (d.modes_changed) out.push_back("scan modes changed");
  int shown = 0, hidden = 0;
  for (const auto& t : d.tensors) {
    if (t.status == DiffStatus::Unchanged) continue;
    if (shown < max_lines) {
      out.push_back(t.status == DiffStatus::Changed ? "changed: " + describe(t) : describe(t));
      ++shown;
    } else {
      ++hidden;
    }
  }
  if (hidden > 0) out.push_back("... and " + std::to_string(hidden) + " more");
  return out;
}

std::string CheckResult::line() const {
  const int n = static_cast<int>(diff.tensors.size());
  std::string modes;
  std::set<std::string> seen;
  for (const auto& t : diff.tensors)
    if (seen.insert(scan_mode_name(t.mode)).second)
      modes += (modes.empty() ? "" : ",") + std::string(scan_mode_name(t.mode));
  if (pass()) {
    int identical = 0;
    double worst = 0;
    for (const auto& t : diff.tensors) {
      identical += t.identical;
      worst = std::max(worst, t.max_abs / std::max(t.scale, Tolerance{}.min_scale));
    }
    return "PASS " + name + " (" + modes + ": " + std::to_string(n) + " tensors, " +
           std::to_string(identical) + " bit-identical, worst max_abs/scale " + fmt(worst) +
           by_note() + ")";
  }
  const TensorDiff* f = diff.first_mismatch();
  const int bad = n - diff.count(DiffStatus::Unchanged);
  std::string s = "FAIL " + name + ": ";
  if (f)
    s += "first mismatch " + describe(*f) + "; " + std::to_string(bad) + " of " +
         std::to_string(n) + " tensors differ";
  else
    s += "scan modes differ";
  return s + by_note();
}

std::string CheckResult::by_note() const {
  if (by.empty()) return "";
  return "; by " + by + ", " + std::to_string(diff.not_compared) +
         " stored tensors it does not provide not compared";
}

CheckResult check_file(const std::string& path, const Tolerance& tol) {
  const GoldenCase stored = read_golden(path);
  const GoldenCase now = compute_case(stored.name, stored.problem, stored.modes);
  CheckResult res;
  res.name = stored.name;
  res.path = path;
  res.diff = diff_cases(stored, now, tol);
  return res;
}

CheckResult check_file(const std::string& path, const Recomputer& how, const Tolerance& tol) {
  const GoldenCase stored = read_golden(path);
  GoldenCase now;
  now.name = stored.name;
  now.problem = stored.problem;
  now.modes = stored.modes;
  const Capture once = how.run(stored.problem);
  for (ScanMode m : stored.modes) now.oracle[m] = once;
  CheckResult res;
  res.name = stored.name;
  res.path = path;
  res.by = how.name;
  res.diff = diff_cases(stored, now, tol, true);
  return res;
}

std::string default_dir() {
  const char* env = std::getenv("M3_GOLDEN_DIR");
  if (env && *env) return env;
#ifdef M3_GOLDEN_DIR_DEFAULT
  return M3_GOLDEN_DIR_DEFAULT;
#else
  return "golden/cases";
#endif
}

std::string case_path(const std::string& dir, const std::string& name) {
  return (fs::path(dir) / (name + ".h5")).string();
}

}  // namespace m3::golden
