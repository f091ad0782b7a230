// Determinism digest records (see digest_record.hpp).
#include "digest_record.hpp"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "determinism.hpp"
#include "error.hpp"

namespace m3::harness {

namespace {
constexpr const char* kMagic = "m3h-digests 1";
constexpr const char* kWhere = "digest record";

// 16 lowercase or uppercase hex digits, nothing else.
bool parse_hex16(const std::string& s, std::uint64_t& v) {
  if (s.size() != 16) return false;
  v = 0;
  for (char c : s) {
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return false;
    v = (v << 4) | static_cast<std::uint64_t>(d);
  }
  return true;
}

std::vector<std::string> words(const std::string& line) {
  std::istringstream is(line);
  std::vector<std::string> w;
  for (std::string s; is >> s;) w.push_back(s);
  return w;
}

// The text after "name: " of a header line, or false.
bool header(const std::string& line, const std::string& name, std::string& value) {
  const std::string p = name + ": ";
  if (line.compare(0, p.size(), p) != 0) return false;
  value = line.substr(p.size());
  return true;
}
}  // namespace

std::string hex16(std::uint64_t v) {
  char s[20];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

std::string digest_problem(const RunSpec& spec) {
  return spec.source + ", seed=" + std::to_string(spec.seed) + " B=" + std::to_string(spec.B) +
         " T=" + std::to_string(spec.T) + (spec.random_states ? ", random states, " : ", ") +
         spec.cfg.describe();
}

const DigestCell* DigestRecord::find(const std::string& precision, const std::string& scan) const {
  for (const auto& c : cells)
    if (c.precision == precision && c.scan == scan) return &c;
  return nullptr;
}

std::string format_digest_record(const DigestRecord& r) {
  std::string s = std::string(kMagic) + "\n";
  s += "# run 0's FNV-1a 64 content hash of every tensor (HARNESS.md §7), by m3h determinism\n";
  s += "environment: " + r.environment + "\n";
  s += "problem: " + r.problem + "\n";
  for (const auto& c : r.cells) {
    M3_REQUIRE(c.keys.size() == c.hashes.size(), kWhere, "a cell's keys and hashes differ in count",
               c.keys.size(), " keys, ", c.hashes.size(), " hashes");
    s += "cell: " + c.precision + " " + c.scan + " " + hex16(c.digest) + " " +
         std::to_string(c.keys.size()) + "\n";
    for (size_t i = 0; i < c.keys.size(); ++i) s += c.keys[i] + " " + hex16(c.hashes[i]) + "\n";
  }
  return s;
}

DigestRecord read_digest_record(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(kWhere, "cannot read " + path, "missing or unreadable");
  DigestRecord r;
  std::string line;
  int n = 0;
  auto bad = [&](const std::string& what) {
    return Error(kWhere, path + ":" + std::to_string(n) + ": " + what, "");
  };
  bool magic = false, env = false, prob = false;
  size_t want = 0;  // tensor lines still owed to the last cell
  int cell_line = 0;  // the last cell's line
  std::unordered_set<std::string> cell_keys;
  // The last cell, whole: its digest must be the digest of its hashes.
  auto close_cell = [&] {
    if (r.cells.empty()) return;
    const DigestCell& c = r.cells.back();
    const std::uint64_t d = digest_of(c.hashes);
    if (d != c.digest)
      throw Error(kWhere,
                  path + ":" + std::to_string(cell_line) + ": cell " + c.precision + " " +
                      c.scan + "'s digest " + hex16(c.digest) + " is not that of its " +
                      std::to_string(c.hashes.size()) + " tensor hashes (" + hex16(d) +
                      "): an edited record",
                  "");
  };
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    if (!magic) {
      if (line != kMagic) throw bad("not a digest record (its first line should be '" +
                                    std::string(kMagic) + "')");
      magic = true;
      continue;
    }
    std::string v;
    if (header(line, "environment", v)) {
      if (env) throw bad("a second environment line");
      r.environment = v, env = true;
      continue;
    }
    if (header(line, "problem", v)) {
      if (prob) throw bad("a second problem line");
      r.problem = v, prob = true;
      continue;
    }
    const std::vector<std::string> w = words(line);
    if (header(line, "cell", v)) {
      if (want)
        throw bad("the cell before has " + std::to_string(want) +
                  " tensor lines fewer than its count");
      if (!env || !prob) throw bad("a cell before the environment and problem lines");
      if (w.size() != 5) throw bad("a cell line is 'cell: PRECISION SCAN DIGEST COUNT'");
      DigestCell c;
      c.precision = w[1], c.scan = w[2];
      if (!parse_hex16(w[3], c.digest)) throw bad("the cell's digest is not 16 hex digits");
      char* end = nullptr;
      const unsigned long long cnt = std::strtoull(w[4].c_str(), &end, 10);
      if (w[4].empty() || *end != '\0' || cnt == 0 || cnt > 1000000)
        throw bad("the cell's tensor count is not a number from 1 to 1000000");
      if (r.find(c.precision, c.scan)) throw bad("a second cell " + c.precision + " " + c.scan);
      close_cell();
      cell_line = n;
      want = static_cast<size_t>(cnt);
      c.keys.reserve(want), c.hashes.reserve(want);
      r.cells.push_back(std::move(c));
      cell_keys.clear();
      continue;
    }
    if (!want) throw bad("a line outside any cell, or beyond its cell's count");
    std::uint64_t h;
    if (w.size() != 2 || !parse_hex16(w[1], h))
      throw bad("a tensor line is 'KEY HASH' (16 hex digits)");
    if (!cell_keys.insert(w[0]).second) throw bad("tensor " + w[0] + " twice in one cell");
    r.cells.back().keys.push_back(w[0]);
    r.cells.back().hashes.push_back(h);
    --want;
  }
  if (!magic) throw Error(kWhere, path + ": empty", "not a digest record");
  if (want)
    throw bad("the last cell has " + std::to_string(want) + " tensor lines fewer than its count");
  if (!env || !prob) throw Error(kWhere, path + ": no environment or problem line", "");
  if (r.cells.empty()) throw Error(kWhere, path + ": no cell", "");
  close_cell();
  return r;
}

DigestDiff diff_digests(const DigestCell& recorded, const DigestCell& now) {
  DigestDiff d;
  std::unordered_map<std::string, std::uint64_t> rec;
  for (size_t i = 0; i < recorded.keys.size(); ++i)
    rec.emplace(recorded.keys[i], recorded.hashes[i]);
  auto first = [&](const std::string& k, std::uint64_t a, std::uint64_t b) {
    if (d.first_key.empty()) d.first_key = k, d.recorded = a, d.now = b;
  };
  std::unordered_set<std::string> seen;
  for (size_t i = 0; i < now.keys.size(); ++i) {
    seen.insert(now.keys[i]);
    const auto it = rec.find(now.keys[i]);
    if (it == rec.end()) {
      ++d.missing;
      first(now.keys[i], 0, now.hashes[i]);
    } else if (it->second != now.hashes[i]) {
      ++d.differ;
      first(now.keys[i], it->second, now.hashes[i]);
    }
  }
  for (size_t i = 0; i < recorded.keys.size(); ++i) {
    if (seen.count(recorded.keys[i])) continue;
    ++d.missing;
    first(recorded.keys[i], recorded.hashes[i], 0);
  }
  return d;
}

}  // namespace m3::harness
