#include "against.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include "error.hpp"

namespace m3::harness {

namespace {

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r");
  return s.substr(b, e - b + 1);
}

[[noreturn]] void refuse(const std::string& file, int line, const std::string& why) {
  throw Error("m3h bench --against", why, file + (line > 0 ? ":" + std::to_string(line) : ""));
}

double positive(const std::string& v, const std::string& file, int line, const std::string& key) {
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(x) || x <= 0)
    refuse(file, line, key + " must be a positive number, got '" + v + "'");
  return x;
}

}  // namespace

OtherFigures parse_other_figures(const std::string& text, const std::string& file) {
  static const char* kKeys[] = {"name", "measured", "dtype", "fwd_ms", "fwdbwd_ms",
                                "gib_per_layer"};
  std::map<std::string, std::pair<std::string, int>> kv;  // key → value, line
  std::istringstream in(text);
  std::string raw;
  int line = 0;
  while (std::getline(in, raw)) {
    ++line;
    const std::string s = trim(raw);
    if (s.empty() || s[0] == '#') continue;
    const auto eq = s.find('=');
    if (eq == std::string::npos) refuse(file, line, "expected 'key = value'");
    const std::string key = trim(s.substr(0, eq)), value = trim(s.substr(eq + 1));
    bool known = false;
    for (const char* k : kKeys) known = known || key == k;
    if (!known) refuse(file, line, "unknown key '" + key + "'");
    if (value.empty()) refuse(file, line, "key '" + key + "' has no value");
    if (!kv.emplace(key, std::make_pair(value, line)).second)
      refuse(file, line, "key '" + key + "' given twice");
  }
  for (const char* k : kKeys)
    if (!kv.count(k)) refuse(file, 0, std::string("missing key '") + k + "'");
  OtherFigures f;
  f.file = file;
  f.name = kv["name"].first;
  f.measured = kv["measured"].first;
  try {
    f.dtype = parse_precision(kv["dtype"].first);
  } catch (const Error&) {
    refuse(file, kv["dtype"].second, "dtype must be f32, bf16 or f16");
  }
  if (f.dtype == Precision::F64) refuse(file, kv["dtype"].second, "dtype must be f32, bf16 or f16");
  f.fwd_ms = positive(kv["fwd_ms"].first, file, kv["fwd_ms"].second, "fwd_ms");
  f.fwdbwd_ms = positive(kv["fwdbwd_ms"].first, file, kv["fwdbwd_ms"].second, "fwdbwd_ms");
  f.gib_per_layer =
      positive(kv["gib_per_layer"].first, file, kv["gib_per_layer"].second, "gib_per_layer");
  return f;
}

OtherFigures read_other_figures(const std::string& path) {
  std::ifstream in(path);
  if (!in) refuse(path, 0, "cannot read the figures file");
  std::ostringstream text;
  text << in.rdbuf();
  return parse_other_figures(text.str(), path);
}

std::vector<std::string> against_lines(const OtherFigures& other,
                                       const std::vector<MarginalLayer>& ours) {
  std::vector<std::string> out;
  char b[512];
  std::snprintf(b, sizeof b, "beside: %s (%s; figures from %s)", other.name.c_str(),
                other.measured.c_str(), other.file.c_str());
  out.emplace_back(b);
  std::snprintf(b, sizeof b, "  %-22s fwd %.3f ms, fwd+bwd %.3f ms, %.3f GiB per further layer",
                precision_name(other.dtype), other.fwd_ms, other.fwdbwd_ms, other.gib_per_layer);
  out.emplace_back(b);
  for (const MarginalLayer& m : ours) {
    for (double v : {m.fwd_ms, m.fwdbwd_ms, m.gib_per_layer})
      if (!(std::isfinite(v) && v > 0))
        throw Error("m3h bench --against", "bad marginal layer figure",
                    m.label + ": " + std::to_string(v));
    std::snprintf(b, sizeof b,
                  "  ours, %-16s fwd %.3f ms (%.2fx), fwd+bwd %.3f ms (%.2fx), %.3f GiB per "
                  "further layer (%.2fx)",
                  m.label.c_str(), m.fwd_ms, other.fwd_ms / m.fwd_ms, m.fwdbwd_ms,
                  other.fwdbwd_ms / m.fwdbwd_ms, m.gib_per_layer,
                  m.gib_per_layer / other.gib_per_layer);
    out.emplace_back(b);
  }
  std::snprintf(b, sizeof b,
                "  (time: their ms / ours, above 1 is faster; memory: ours / theirs, below 1 is "
                "less)");
  out.emplace_back(b);
  return out;
}

}  // namespace m3::harness
