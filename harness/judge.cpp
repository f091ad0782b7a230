// Judging another implementation's tensors (see judge.hpp).
#include "judge.hpp"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "error.hpp"
#include "h5store.hpp"
#include "json.hpp"
#include "npy.hpp"
#include "perturbed.hpp"
#include "registry.hpp"

namespace m3::harness {

namespace fs = std::filesystem;
using ojson = nlohmann::ordered_json;

namespace {

constexpr const char* kSubjectFormat = "m3h-subject";
constexpr const char* kProblemFormat = "m3h-problem";
constexpr int kFormatVersion = 1;
constexpr const char* kSubjectMeta = "meta.json";
constexpr const char* kProblemMeta = "problem.json";
// The declarations a subject's meta may hold; the only layout convention.
const char* const kMetaKeys[] = {"format", "format_version", "precision", "scan_mode",
                                 "implementation", "linear_layout"};
constexpr const char* kLayoutKey = "linear_layout";

std::string msg(const std::string& s) { return escape_for_message(s, 200); }

// "a, b, c and 4 more"
std::string list_some(const std::vector<std::string>& v, std::size_t max = 8) {
  std::string s;
  for (std::size_t i = 0; i < v.size() && i < max; ++i) s += (i ? ", " : "") + msg(v[i]);
  if (v.size() > max) s += " and " + std::to_string(v.size() - max) + " more";
  return s;
}

LinearLayout parse_layout(const std::string& v, const std::string& source, const std::string& at) {
  if (v == "in_out") return LinearLayout::InOut;
  if (v == "out_in") return LinearLayout::OutIn;
  throw Error(source, at + ": unknown linear_layout '" + msg(v) + "'",
              "in_out (ours, Y = X*W) or out_in (PyTorch's nn.Linear.weight [out, in])");
}

// The parameter name of a gradient key ("grad/L3/in_proj_w" → "in_proj_w"), "" for other keys.
std::string grad_param(const std::string& key) {
  if (key.rfind("grad/", 0) != 0) return "";
  return key.substr(key.find_last_of('/') + 1);
}

// A Linear weight's gradient: the tensors a per-tensor linear_layout may name.
bool is_linear_grad(const std::string& key) {
  const std::string p = grad_param(key);
  return p == "in_proj_w" || p == "out_proj_w" || p == "head_w" || p == "input_proj_w";
}

// The tensors a file-wide linear_layout applies to: the Linear weights' gradients, except a
// token model's embedding (PyTorch's nn.Embedding.weight [V, d_model] is already our layout).
bool file_layout_applies(const std::string& key, const Config& cfg) {
  return is_linear_grad(key) && !(grad_param(key) == "input_proj_w" && cfg.vocab_size > 0);
}

// One declaration of a subject's meta, checked and applied. `value` is the declared text
// (format_version as its decimal digits).
void declare(Subject& s, const std::string& where, const std::string& name, const std::string& value,
             std::set<std::string>& seen) {
  if (std::find(std::begin(kMetaKeys), std::end(kMetaKeys), name) == std::end(kMetaKeys)) {
    if (name.size() > 7 && name.compare(name.size() - 7, 7, "_layout") == 0)
      throw Error(where, "unknown layout convention '" + msg(name) + "'",
                  "the one convention is linear_layout");
    throw Error(where, "unknown declaration '" + msg(name) + "' in the subject's meta",
                "known: format, format_version, precision, scan_mode, implementation, "
                "linear_layout");
  }
  seen.insert(name);
  if (name == "format") {
    if (value != kSubjectFormat)
      throw Error(where, "format '" + msg(value) + "' is not a subject file's", "expected m3h-subject");
  } else if (name == "format_version") {
    if (value != std::to_string(kFormatVersion))
      throw Error(where, "subject format version " + msg(value) + " found", "version 1 expected");
  } else if (name == "precision") {
    if (value == "f32") s.precision = Precision::F32;
    else if (value == "bf16") s.precision = Precision::BF16;
    else if (value == "f16") s.precision = Precision::F16;
    else
      throw Error(where, "precision '" + msg(value) + "' is not a subject's storage precision",
                  "f32, bf16 or f16; f64 is the oracle's");
  } else if (name == "scan_mode") {
    if (value == "seq") s.mode = ScanMode::Sequential;
    else if (value == "chunked") s.mode = ScanMode::Chunked;
    else throw Error(where, "scan_mode '" + msg(value) + "' is unknown", "seq or chunked");
  } else if (name == "implementation") {
    s.implementation = value;
  } else {
    s.linear_layout = parse_layout(value, where, "meta");
  }
}

void require_declared(const std::string& where, const std::set<std::string>& seen) {
  for (const char* k : {"format", "format_version", "precision", "scan_mode"})
    if (!seen.count(k))
      throw Error(where, std::string("the subject's meta does not declare ") + k,
                  "format = m3h-subject, format_version = 1, precision and scan_mode are required");
}

void add_tensor(Subject& s, const std::string& key, Tensor t) {
  if (s.tensors.count(key)) throw Error(s.source, "tensor '" + msg(key) + "' is stored twice", "");
  s.keys.push_back(key);
  s.tensors.emplace(key, std::move(t));
}

// "<path>" without trailing separators (so that "out/" names the folder "out").
std::string strip_slashes(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

// Builds the folder `final_dir` atomically: `fill` writes into "<final>.tmp.<pid>" beside it,
// which is then renamed into place (an old folder is first moved aside, then removed). Checked
// before any work: the parent folder exists; an existing `final_dir` is a folder holding
// `marker` (a folder this code wrote) and force is set.
void write_folder_atomic(const std::string& final_dir, const char* marker, const char* what,
                         bool force, const std::function<void(const fs::path&)>& fill) {
  const fs::path dir(strip_slashes(final_dir));
  std::error_code ec;
  const fs::path parent = dir.parent_path();
  if (!parent.empty() && !fs::is_directory(parent, ec))
    throw Error(final_dir, "cannot write the " + std::string(what),
                "folder " + parent.string() + " does not exist");
  const bool exists = fs::exists(fs::symlink_status(dir, ec));
  if (exists) {
    if (fs::is_symlink(fs::symlink_status(dir, ec)) || !fs::is_directory(dir, ec))
      throw Error(final_dir, "exists and is not a folder", "nothing is written there");
    if (!force) throw Error(final_dir, "exists", "pass --force to replace it");
    if (!fs::is_regular_file(dir / marker, ec))
      throw Error(final_dir, std::string("exists and is not a ") + what,
                  std::string("it holds no ") + marker + "; not replaced");
  }
  const fs::path tmp = dir.string() + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec))
    throw Error(tmp.string(), "cannot create the temporary folder", ec.message());
  try {
    fill(tmp);
    if (exists) {
      const fs::path old = dir.string() + ".old." + std::to_string(::getpid());
      fs::remove_all(old, ec);
      fs::rename(dir, old);
      fs::rename(tmp, dir);
      fs::remove_all(old, ec);
    } else {
      fs::rename(tmp, dir);
    }
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, ec);
    throw Error(final_dir, "cannot write the " + std::string(what), e.code().message());
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
}

// Whether any entering state of the problem is not zero (the reports' "entering_states").
bool nonzero_states(const Problem& pb) {
  for (const auto* v : {&pb.states.ssm, &pb.states.k, &pb.states.v, &pb.states.angle})
    for (double x : *v)
      if (x != 0.0) return true;
  return false;
}

void write_text(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out) throw Error(p.string(), "cannot write the file", "");
}

// The .npy of a tensor at `root`/<key>.npy, creating the folders of the key.
void write_npy_at(const fs::path& root, const std::string& key, const Tensor& t) {
  const fs::path p = root / (key + ".npy");
  fs::create_directories(p.parent_path());
  npy::write(p.string(), t);
}

}  // namespace

const char* linear_layout_name(LinearLayout l) {
  return l == LinearLayout::OutIn ? "out_in" : "in_out";
}

// ---- reading and writing subject files --------------------------------------------------------

Subject read_subject_h5(const std::string& path) {
  const h5::Reader r(path);
  Subject s;
  s.source = path;
  for (const std::string& c : r.children("/"))
    if (c != "meta" && c != "tensors")
      throw Error(path, "unexpected object '/" + msg(c) + "'", "a subject file holds /meta and /tensors");
  if (!r.is_group("/meta")) throw Error(path, "no /meta group", "the declarations live there");
  if (!r.is_group("/tensors")) throw Error(path, "no /tensors group", "the tensors live there");
  std::set<std::string> seen;
  for (const std::string& a : r.attr_names("/meta")) {
    const std::string value =
        a == "format_version" ? std::to_string(r.attr_int("/meta", a)) : r.attr_string("/meta", a);
    declare(s, path, a, value, seen);
  }
  require_declared(path, seen);
  // Every dataset below /tensors, depth first; its path below /tensors is its key.
  std::function<void(const std::string&)> walk = [&](const std::string& group) {
    for (const std::string& c : r.children(group)) {
      const std::string p = group + "/" + c;
      if (r.is_group(p)) {
        walk(p);
        continue;
      }
      const std::string key = p.substr(std::string("/tensors/").size());
      for (const std::string& a : r.attr_names(p)) {
        if (a == "dtype") continue;  // h5store's marker of bf16 / f16 bits
        if (a != kLayoutKey)
          throw Error(path, "dataset '" + msg(p) + "': unknown attribute '" + msg(a) + "'",
                      "a tensor may declare linear_layout only");
        s.tensor_layouts[key] = parse_layout(r.attr_string(p, a), path, "dataset '" + p + "'");
      }
      add_tensor(s, key, r.read(p));
    }
  };
  walk("/tensors");
  return s;
}

Subject read_subject_dir(const std::string& dir_in) {
  const std::string dir = strip_slashes(dir_in);
  Subject s;
  s.source = dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(dir, "is not a folder", "a subject folder holds meta.json and .npy files");
  const fs::path meta = fs::path(dir) / kSubjectMeta;
  std::ifstream in(meta, std::ios::binary);
  if (!in) throw Error(meta.string(), "cannot be read", "a subject folder declares itself there");
  ojson j;
  try {
    j = ojson::parse(std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>()));
  } catch (const nlohmann::json::exception& e) {
    throw Error(meta.string(), "is not valid JSON", e.what());
  }
  if (!j.is_object()) throw Error(meta.string(), "is not a JSON object", "");
  std::set<std::string> seen;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "tensors") {
      if (!it.value().is_object())
        throw Error(meta.string(), "'tensors' is not an object", "{\"<key>\": {\"linear_layout\": \"out_in\"}}");
      for (auto t = it.value().begin(); t != it.value().end(); ++t) {
        if (!t.value().is_object())
          throw Error(meta.string(), "tensors['" + msg(t.key()) + "'] is not an object", "");
        for (auto d = t.value().begin(); d != t.value().end(); ++d) {
          if (d.key() != kLayoutKey) {
            const bool layout = d.key().size() > 7 && d.key().compare(d.key().size() - 7, 7, "_layout") == 0;
            throw Error(meta.string(),
                        "tensors['" + msg(t.key()) + "']: unknown " +
                            (layout ? "layout convention '" : "declaration '") + msg(d.key()) + "'",
                        "a tensor may declare linear_layout only");
          }
          if (!d.value().is_string())
            throw Error(meta.string(), "tensors['" + msg(t.key()) + "'].linear_layout is not a string", "");
          s.tensor_layouts[t.key()] =
              parse_layout(d.value().get<std::string>(), meta.string(), "tensors['" + t.key() + "']");
        }
      }
      continue;
    }
    std::string value;
    if (it.key() == "format_version" && it.value().is_number_integer())
      value = std::to_string(it.value().get<std::int64_t>());
    else if (it.value().is_string())
      value = it.value().get<std::string>();
    else
      throw Error(meta.string(), "'" + msg(it.key()) + "' is not a " +
                                     (it.key() == "format_version" ? "whole number" : "string"), "");
    declare(s, meta.string(), it.key(), value, seen);
  }
  require_declared(meta.string(), seen);
  // Every file below the folder: meta.json, or a tensor <key>.npy.
  std::vector<fs::path> files;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    if (it->is_directory(ec)) continue;
    files.push_back(it->path());
  }
  if (ec) throw Error(dir, "cannot be listed", ec.message());
  std::sort(files.begin(), files.end());
  for (const fs::path& f : files) {
    const std::string rel = fs::relative(f, dir).generic_string();
    if (rel == kSubjectMeta) continue;
    if (f.extension() != ".npy")
      throw Error(dir, "unexpected file '" + msg(rel) + "'",
                  "a subject folder holds meta.json and <key>.npy files only");
    add_tensor(s, rel.substr(0, rel.size() - 4), npy::read(f.string()));
  }
  for (const auto& [key, layout] : s.tensor_layouts)
    if (!s.tensors.count(key))
      throw Error(meta.string(), "tensors['" + msg(key) + "'] declares a layout for a tensor the folder lacks",
                  "no " + key + ".npy");
  return s;
}

void write_subject_h5(const std::string& path, const Subject& s, bool force) {
  h5::Writer w(path, force);
  w.group("/meta");
  w.attr("/meta", "format", kSubjectFormat);
  w.attr("/meta", "format_version", kFormatVersion);
  w.attr("/meta", "precision", precision_name(s.precision));
  w.attr("/meta", "scan_mode", scan_mode_name(s.mode));
  if (!s.implementation.empty()) w.attr("/meta", "implementation", s.implementation);
  if (s.linear_layout != LinearLayout::InOut)
    w.attr("/meta", kLayoutKey, linear_layout_name(s.linear_layout));
  w.group("/tensors");
  for (const std::string& key : s.keys) {
    const std::string p = "/tensors/" + key;
    w.write(p, s.tensors.at(key), h5::DType::F64, h5::NonFinite::Allow);
    auto it = s.tensor_layouts.find(key);
    if (it != s.tensor_layouts.end()) w.attr(p, kLayoutKey, linear_layout_name(it->second));
  }
  w.commit();
}

void write_subject_dir(const std::string& dir, const Subject& s, bool force) {
  ojson meta = ojson::object();
  meta["format"] = kSubjectFormat;
  meta["format_version"] = kFormatVersion;
  meta["precision"] = precision_name(s.precision);
  meta["scan_mode"] = scan_mode_name(s.mode);
  if (!s.implementation.empty()) meta["implementation"] = s.implementation;
  if (s.linear_layout != LinearLayout::InOut) meta[kLayoutKey] = linear_layout_name(s.linear_layout);
  if (!s.tensor_layouts.empty()) {
    ojson t = ojson::object();
    for (const auto& [key, layout] : s.tensor_layouts) t[key][kLayoutKey] = linear_layout_name(layout);
    meta["tensors"] = t;
  }
  write_folder_atomic(dir, kSubjectMeta, "subject folder", force, [&](const fs::path& tmp) {
    write_text(tmp / kSubjectMeta, meta.dump(2) + "\n");
    for (const std::string& key : s.keys) write_npy_at(tmp, key, s.tensors.at(key));
  });
}

// ---- the subject against the run ----------------------------------------------------------------

SubjectCapture subject_capture(const Subject& s, const Config& cfg, Idx B, Idx T) {
  if (s.keys.empty()) throw Error(s.source, "the subject holds no tensor", "nothing to judge");
  std::map<std::string, std::vector<Idx>> expected;
  for (const KeyedSpec& ks : expected_stage_keys(cfg, B, T, s.mode)) expected[ks.key] = ks.shape;
  for (const KeyedParam& kp : expected_param_keys(cfg)) expected[kp.key] = kp.shape;
  const ScanMode other = s.mode == ScanMode::Chunked ? ScanMode::Sequential : ScanMode::Chunked;
  std::set<std::string> other_keys;
  for (const KeyedSpec& ks : expected_stage_keys(cfg, B, T, other)) other_keys.insert(ks.key);

  std::vector<std::string> unknown;
  for (const std::string& key : s.keys)
    if (!expected.count(key))
      unknown.push_back(key + (other_keys.count(key) ? std::string(" (a ") + scan_mode_name(other) +
                                                           "-mode tensor)"
                                                     : ""));
  if (!unknown.empty())
    throw Error(s.source,
                std::to_string(unknown.size()) + " tensor(s) are not keys of this run (" +
                    scan_mode_name(s.mode) + ", MODEL.md §10): " + list_some(unknown),
                "names as in reference/registry.cpp: L<l>/<stage>/<tensor>, <stage>/<tensor>, grad/...");
  for (const auto& [key, layout] : s.tensor_layouts)
    if (!is_linear_grad(key))
      throw Error(s.source, "tensor '" + msg(key) + "' declares linear_layout",
                  "only the gradients of in_proj_w, out_proj_w, head_w and input_proj_w have one");

  SubjectCapture out;
  for (const std::string& key : s.keys) {
    const Tensor& t = s.tensors.at(key);
    const std::vector<Idx>& want = expected.at(key);
    auto declared = s.tensor_layouts.find(key);
    const LinearLayout layout =
        declared != s.tensor_layouts.end()
            ? declared->second
            : (file_layout_applies(key, cfg) ? s.linear_layout : LinearLayout::InOut);
    if (layout == LinearLayout::OutIn) {
      const std::vector<Idx> stored{want[1], want[0]};
      if (t.shape != stored)
        throw Error(s.source,
                    "tensor '" + key + "' has shape " + shape_str(t.shape) + ", expected " +
                        shape_str(stored),
                    "declared linear_layout out_in: the transpose of our " + shape_str(want));
      Tensor tt;
      tt.shape = want;
      tt.data.resize(t.data.size());
      for (Idx o = 0; o < want[1]; ++o)
        for (Idx i = 0; i < want[0]; ++i) tt.data[i * want[1] + o] = t.data[o * want[0] + i];
      out.capture.put(key, tt.shape, tt.data.data());
      out.transposed.push_back(key);
      continue;
    }
    if (t.shape != want) {
      std::string why = "the registry's shape for this run";
      if (is_linear_grad(key) && t.shape == std::vector<Idx>{want[1], want[0]})
        why = "it is the transpose: declare linear_layout = out_in for PyTorch [out, in] weights";
      throw Error(s.source,
                  "tensor '" + key + "' has shape " + shape_str(t.shape) + ", expected " + shape_str(want),
                  why);
    }
    out.capture.put(key, t.shape, t.data.data());
  }
  return out;
}

Judgement judge_subject(const golden::GoldenCase& g, const std::string& golden_path, Subject s) {
  const Problem& pb = g.problem;
  auto stored = g.oracle.find(s.mode);
  if (stored == g.oracle.end()) {
    std::string modes;
    for (ScanMode m : g.modes) modes += (modes.empty() ? "" : ",") + std::string(scan_mode_name(m));
    throw Error(golden_path, std::string("stores no ") + scan_mode_name(s.mode) + " run",
                "the subject's scan_mode is " + std::string(scan_mode_name(s.mode)) + "; stored: " +
                    modes + " (write one with m3h golden regen --out)");
  }
  SubjectCapture sc = subject_capture(s, pb.cfg, pb.B, pb.T);

  Judgement j;
  j.golden_path = golden_path;
  j.transposed = sc.transposed;
  RunSpec spec;
  spec.preset = "";
  spec.source = "golden " + golden_path + " (case " + g.name + ")";
  spec.cfg = pb.cfg;
  spec.B = pb.B;
  spec.T = pb.T;
  spec.seed = pb.seed;
  spec.random_states = nonzero_states(pb);
  spec.modes = {s.mode};
  spec.compare_modes = {CompareMode::EndToEnd};
  spec.device = "file";

  const std::string name =
      (s.implementation.empty() ? std::string("subject") : s.implementation) + " [" + s.source + "]";
  std::vector<Lineup> lineups;
  lineups.push_back({s.precision, stored_captures(name, {{s.mode, std::move(sc.capture)}}),
                     reference_emulation(s.precision)});
  add_perturbed_baselines(lineups);
  const Implementation oracle = stored_captures(
      "golden:" + g.name + " (reference<double>, stored)", {{s.mode, stored->second}});
  j.comparison = run_comparison(spec, pb, oracle, lineups);

  // The rows the subject provided, in chain order; the others are listed, not judged.
  for (CompareResult& cell : j.comparison.cells) {
    j.n_expected = static_cast<int>(cell.rows.size());
    std::vector<TensorResult> kept;
    for (TensorResult& r : cell.rows) {
      if (s.tensors.count(r.key)) kept.push_back(std::move(r));
      else j.not_provided.push_back(r.key);
    }
    cell.rows = std::move(kept);
    cell.first_fail = cell.first_nonfinite = -1;
    for (std::size_t i = 0; i < cell.rows.size(); ++i) {
      const TensorResult& r = cell.rows[i];
      if (!r.pass() && cell.first_fail < 0) cell.first_fail = static_cast<int>(i);
      if (r.subject.nan_count + r.subject.inf_count > 0 && cell.first_nonfinite < 0)
        cell.first_nonfinite = static_cast<int>(i);
    }
  }
  s.tensors.clear();
  j.subject = std::move(s);
  return j;
}

// ---- reports ------------------------------------------------------------------------------------

void print_judgement(std::ostream& os, const Judgement& j, const ReportOptions& opt) {
  const Comparison& c = j.comparison;
  const Subject& s = j.subject;
  const RunSpec& spec = c.spec;
  os << "m3h judge: subject=" << escape_for_message(s.source, 400) << " implementation="
     << (s.implementation.empty() ? "(not declared)" : escape_for_message(s.implementation, 200))
     << "\n";
  os << "  declared: precision=" << precision_name(s.precision) << " scan_mode=" << scan_mode_name(s.mode)
     << " linear_layout=" << linear_layout_name(s.linear_layout);
  for (const auto& [key, layout] : s.tensor_layouts) os << " " << key << ":" << linear_layout_name(layout);
  os << "\n";
  os << "  oracle=" << c.oracle_name << "\n";
  for (const Lineup& l : c.lineups)
    os << "  baseline=" << (l.baseline ? l.baseline->name : "none") << " (our float reference at the "
       << "subject's precision); conditioning: the perturbed oracle, " << l.conditioning.size()
       << " draws\n";
  os << "config: " << spec.cfg.describe() << "\n";
  os << "run: source=" << escape_for_message(spec.source, 1000) << " B=" << spec.B << " T=" << spec.T
     << " seed=" << spec.seed << " entering_states=" << (spec.random_states ? "random" : "zero")
     << "\n";
  os << "rule: pass when rel_l2 and max_abs <= " << rule_summary(c).e2e << "; floors x"
     << depth_factor(spec.cfg) << " for depth; %budget = err/limit, the larger of the two\n";
  os << "flags: FAIL over budget, NAN non-finite subject, ORCL oracle/baseline unusable\n";
  if (!j.transposed.empty())
    os << "layout: read as [out, in] and transposed (declared): " << list_some(j.transposed, 1000)
       << "\n";
  os << "\n";
  print_compare_table(os, c, opt);
  os << "\n";
  const int provided = j.n_expected - static_cast<int>(j.not_provided.size());
  os << "provided: " << provided << " of the run's " << j.n_expected << " tensors; not provided: "
     << j.not_provided.size() << (j.not_provided.empty() ? "" : ", by stage:") << "\n";
  // Grouped by stage (the key up to its last '/'), in chain order.
  std::string group, line;
  for (const std::string& k : j.not_provided) {
    const std::size_t cut = k.find_last_of('/');
    const std::string g = k.substr(0, cut);
    if (g != group) {
      if (!line.empty()) os << line << "\n";
      group = g;
      line = "  " + g + ":";
    }
    line += " " + k.substr(cut + 1);
  }
  if (!line.empty()) os << line << "\n";
  os << "\n";
  print_compare_summary(os, c);
}

std::string judgement_json(const Judgement& j, const RunInfo& info) {
  ojson doc = ojson::parse(comparison_json(j.comparison, info));
  const Subject& s = j.subject;
  ojson o = ojson::object();
  o["golden"] = j.golden_path;
  o["subject"] = s.source;
  o["implementation"] = s.implementation;
  o["precision"] = precision_name(s.precision);
  o["scan_mode"] = scan_mode_name(s.mode);
  o["linear_layout"] = linear_layout_name(s.linear_layout);
  ojson tl = ojson::object();
  for (const auto& [key, layout] : s.tensor_layouts) tl[key] = linear_layout_name(layout);
  o["tensor_layouts"] = tl;
  o["transposed"] = j.transposed;
  o["n_expected"] = j.n_expected;
  o["n_provided"] = j.n_expected - static_cast<int>(j.not_provided.size());
  o["not_provided"] = j.not_provided;
  doc["judge"] = o;
  return doc.dump(2, ' ', false, ojson::error_handler_t::replace) + "\n";
}

// ---- the problem, for the other implementation ---------------------------------------------------

void export_problem(const golden::GoldenCase& g, const std::string& golden_path,
                    const std::string& dir, bool force) {
  const Problem& pb = g.problem;
  const Config& c = pb.cfg;
  const Idx BT = pb.B * pb.T, L = c.n_layers, nh = c.nheads();
  // name (path below the folder, without .npy) → tensor, in the golden file's order
  std::vector<std::pair<std::string, Tensor>> arrays;
  std::map<std::string, const std::vector<double>*> param;
  for_each_param(pb.params, [&](int layer, const char* n, const std::vector<double>& v) {
    param[param_key(layer, n)] = &v;
  });
  for (const KeyedParam& kp : expected_param_keys(c))
    arrays.push_back({"weights/" + kp.key.substr(5), Tensor{kp.shape, *param.at(kp.key)}});
  auto input = [&](const std::string& n, std::vector<Idx> shape, std::vector<double> v) {
    arrays.push_back({"inputs/" + n, Tensor{std::move(shape), std::move(v)}});
  };
  if (pb.token_model()) {
    input("tok", {BT}, std::vector<double>(pb.tok.begin(), pb.tok.end()));
    input("tgt", {BT}, std::vector<double>(pb.tgt.begin(), pb.tgt.end()));
    input("w", {BT}, std::vector<double>(pb.w.begin(), pb.w.end()));
  } else {
    input("x", {BT, c.input_dim}, pb.x);
    input("d_out", {BT, c.d_model}, pb.d_out);
  }
  input("states/ssm", {L, pb.B, nh, c.headdim, c.d_state}, pb.states.ssm);
  input("states/k", {L, pb.B, nh, c.d_state}, pb.states.k);
  input("states/v", {L, pb.B, nh, c.headdim}, pb.states.v);
  input("states/angle", {L, pb.B, nh, c.num_rope_angles()}, pb.states.angle);

  ojson j = ojson::object();
  j["format"] = kProblemFormat;
  j["format_version"] = kFormatVersion;
  j["case"] = g.name;
  j["golden"] = golden_path;
  ojson cfg = ojson::object();
  cfg["d_model"] = c.d_model;
  cfg["d_state"] = c.d_state;
  cfg["expand"] = c.expand;
  cfg["headdim"] = c.headdim;
  cfg["ngroups"] = c.ngroups;
  cfg["n_layers"] = c.n_layers;
  cfg["rope_fraction"] = c.rope_fraction;
  cfg["a_floor"] = c.a_floor;
  cfg["is_outproj_norm"] = c.is_outproj_norm;
  cfg["input_dim"] = c.input_dim;
  cfg["input_proj_identity"] = c.input_proj_identity;
  cfg["chunk_size"] = c.chunk_size;
  cfg["vocab_size"] = c.vocab_size;
  j["config"] = cfg;
  j["derived"] = {{"d_inner", c.d_inner()},
                  {"nheads", c.nheads()},
                  {"num_rope_angles", c.num_rope_angles()},
                  {"in_proj_dim", c.in_proj_dim()},
                  {"n_chunks", c.n_chunks(pb.T)}};
  j["B"] = pb.B;
  j["T"] = pb.T;
  j["seed"] = std::to_string(pb.seed);
  std::vector<std::string> modes;
  for (ScanMode m : g.modes) modes.push_back(scan_mode_name(m));
  j["scan_modes"] = modes;
  j["entering_states"] = nonzero_states(pb) ? "nonzero" : "zero";
  j["gradients_of"] =
      pb.token_model()
          ? "S * loss, S = " + std::to_string(pb.loss_scale()) +
                " (loss = sum_r w_r * cross-entropy_r / sum_r w_r; TRAINING.md §1)"
          : std::string("sum over rows and columns of Out * d_out (d_out = inputs/d_out)");
  j["conventions"] = {
      "row-major (C order); rows r = b*T + t (sample-major, then time)",
      "Linear weights [in, out], applied as Y = X*W: the transpose of nn.Linear.weight",
      "b_bias, c_bias [NH, DS] (the official B_bias, C_bias are [NH, 1, DS])",
      "in_proj columns: z, x, B, C, dd_dt, dd_A, trap, angles (MODEL.md §2.1)",
      "entering states [L, B, ...]; the run's gradients wrt the leaving states are zero",
      "subject tensors: names and shapes of MODEL.md §10 (m3h judge, HARNESS.md §10)"};
  ojson list = ojson::object();
  for (const auto& [n, t] : arrays) list[n + ".npy"] = t.shape;
  j["arrays"] = list;

  write_folder_atomic(dir, kProblemMeta, "problem folder", force, [&](const fs::path& tmp) {
    write_text(tmp / kProblemMeta, j.dump(2) + "\n");
    for (const auto& [n, t] : arrays) write_npy_at(tmp, n, t);
  });
}

}  // namespace m3::harness
