// The data of training (TRAINING.md §3): the counter-based generator, byte-level text files and
// the synthetic tasks parity, modular and selective-copy. The generation rules (token layouts,
// vocabularies, the order of the draws) are in data.hpp.
#include "data.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "error.hpp"

namespace m3::train {

namespace {

constexpr Idx kLarge = Idx{1} << 40;  // "no limit" for tasks: T, validation windows
constexpr std::size_t kShown = 200;   // user text is shown cut to this many characters

// User text for a message: cut to kShown characters, control characters as \xNN.
std::string show(const std::string& text) { return escape_for_message(text, kShown); }

// The shortest decimal that reads back as v (so settings compare by value, not by format).
std::string format_double(double v) {
  char buf[40];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

// The SplitMix64 output function of (z + golden gamma): a bijection of 64-bit words.
std::uint64_t mix64(std::uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A fraction as a percentage for messages ("95", "12.5").
std::string percent(double f) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4g", 100 * f);
  return buf;
}

Batch empty_batch(Idx B, Idx T) {
  Batch b;
  b.B = B;
  b.T = T;
  const auto n = static_cast<std::size_t>(B * T);
  b.tok.assign(n, 0);
  b.tgt.assign(n, 0);
  b.w.assign(n, 0.0f);
  return b;
}

// The checks every batch entry shares; `what` names the entry ("train_batch", "val_batch").
void check_shape(const std::string& where, const char* what, Idx B, Idx T, Idx min_T,
                 Idx max_T) {
  M3_REQUIRE(B >= 1 && B <= kLarge, where, std::string(what) + ": B must be in [1, 2^40]",
             "B = ", B);
  M3_REQUIRE(T >= min_T && T <= max_T, where,
             std::string(what) + ": T is outside the range this data allows",
             "T = ", T, ", allowed ", min_T, " <= T <= ", max_T);
  M3_REQUIRE(B <= kLarge / T, where, std::string(what) + ": B*T is too large", "B = ", B,
             ", T = ", T);
}

void check_train_args(const std::string& where, Idx step, Idx micro) {
  M3_REQUIRE(step >= 1, where, "train_batch: step must be >= 1", "step = ", step);
  M3_REQUIRE(micro >= 0, where, "train_batch: micro must be >= 0", "micro = ", micro);
}

void check_val_args(const std::string& where, Idx i, Idx B) {
  M3_REQUIRE(i >= 0 && i <= kLarge / B, where, "val_batch: i must be in [0, 2^40 / B]",
             "i = ", i, ", B = ", B);
}

std::string decode_with(const std::string& where, const std::string& spelling,
                        const std::vector<std::int32_t>& tokens) {
  std::string out;
  out.reserve(tokens.size());
  for (std::size_t k = 0; k < tokens.size(); ++k) {
    const std::int32_t v = tokens[k];
    M3_REQUIRE(v >= 0 && static_cast<std::size_t>(v) < spelling.size(), where,
               "decode: a token outside the vocabulary", "token ", v, " at position ", k,
               ", V = ", spelling.size());
    out += spelling[static_cast<std::size_t>(v)];
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// text
// ---------------------------------------------------------------------------------------------

class TextDataset final : public Dataset {
 public:
  TextDataset(std::string path, double val_fraction, std::vector<unsigned char> bytes)
      : path_(std::move(path)), val_fraction_(val_fraction), x_(std::move(bytes)) {
    const Idx S = static_cast<Idx>(x_.size());
    n_val_ = static_cast<Idx>(std::floor(static_cast<double>(S) * val_fraction_));
    n_train_ = S - n_val_;
    hash_ = fnv1a64(x_.data(), x_.size());
  }

  Idx vocab() const override { return 256; }
  std::string kind() const override { return "text"; }
  std::vector<std::pair<std::string, std::string>> settings() const override {
    return {{"data", path_}, {"val_fraction", format_double(val_fraction_)}};
  }
  Idx content_size() const override { return static_cast<Idx>(x_.size()); }
  std::uint64_t content_hash() const override { return hash_; }
  Idx min_T() const override { return 1; }
  Idx max_T() const override { return std::min(n_train_, n_val_) - 1; }
  Idx train_size() const { return n_train_; }
  Idx val_size() const { return n_val_; }

  // The T+1 bytes each part must hold, said with the sizes (the one message for every entry).
  void check_T(Idx T) const {
    const std::string w = where();
    M3_REQUIRE(T >= 1, w, "T must be >= 1", "T = ", T);
    M3_REQUIRE(n_train_ >= T + 1, w, "the training part is shorter than T+1 bytes",
               "it has ", n_train_, " bytes (the first ", percent(1 - val_fraction_),
               "% of ", x_.size(), "), T = ", T, " needs ", T + 1);
    M3_REQUIRE(n_val_ >= T + 1, w, "the validation part is shorter than T+1 bytes",
               "it has ", n_val_, " bytes (the last ", percent(val_fraction_),
               "% of ", x_.size(), "), T = ", T, " needs ", T + 1);
  }

  Batch train_batch(std::uint64_t seed, Idx step, Idx micro, Idx B, Idx T) const override {
    const std::string w = where();
    check_train_args(w, step, micro);
    check_T(T);
    check_shape(w, "train_batch", B, T, min_T(), max_T());
    Batch out = empty_batch(B, T);
    const auto offsets = static_cast<std::uint64_t>(n_train_ - T);  // o ∈ [0, S_train − T)
    for (Idx b = 0; b < B; ++b) {
      Rng rng(row_seed(seed, step, micro, b, kTrainStream));
      fill(out, b, static_cast<Idx>(uniform_index(rng, offsets)));
    }
    return out;
  }

  Batch val_batch(Idx i, Idx B, Idx T) const override {
    const std::string w = where();
    check_T(T);
    check_shape(w, "val_batch", B, T, min_T(), max_T());
    check_val_args(w, i, B);
    Batch out = empty_batch(B, T);
    const Idx W = val_windows(T);
    for (Idx b = 0; b < B; ++b) fill(out, b, n_train_ + ((i * B + b) % W) * T);
    return out;
  }

  Idx val_windows(Idx T) const override {
    check_T(T);
    return (n_val_ - 1) / T;
  }

  std::vector<std::int32_t> encode(const std::string& text) const override {
    std::vector<std::int32_t> out;
    out.reserve(text.size());
    for (unsigned char c : text) out.push_back(c);
    return out;
  }

  std::string decode(const std::vector<std::int32_t>& tokens) const override {
    std::string out;
    out.reserve(tokens.size());
    for (std::size_t k = 0; k < tokens.size(); ++k) {
      const std::int32_t v = tokens[k];
      M3_REQUIRE(v >= 0 && v < 256, where(), "decode: a token outside the vocabulary",
                 "token ", v, " at position ", k, ", V = 256");
      out += static_cast<char>(static_cast<unsigned char>(v));
    }
    return out;
  }

 private:
  std::string where() const { return "text data '" + show(path_) + "'"; }

  // Row b = the window x[o .. o+T]: tok = its first T bytes, tgt = its last T, all scored.
  void fill(Batch& out, Idx b, Idx o) const {
    const Idx T = out.T;
    for (Idx t = 0; t < T; ++t) {
      const auto r = static_cast<std::size_t>(b * T + t);
      out.tok[r] = x_[static_cast<std::size_t>(o + t)];
      out.tgt[r] = x_[static_cast<std::size_t>(o + t + 1)];
      out.w[r] = 1.0f;
    }
  }

  std::string path_;
  double val_fraction_;
  std::vector<unsigned char> x_;
  Idx n_train_ = 0, n_val_ = 0;
  std::uint64_t hash_ = 0;
};

std::vector<unsigned char> read_whole_file(const std::string& where, const std::string& path) {
  namespace fs = std::filesystem;
  M3_REQUIRE(!path.empty(), where, "no file name given", "");
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (st.type() == fs::file_type::not_found)
    throw Error(where, "does not exist", "");
  if (ec) throw Error(where, "cannot be examined", ec.message());
  if (!fs::is_regular_file(st)) {
    const char* type = fs::is_directory(st)   ? "a directory"
                       : fs::is_fifo(st)      ? "a FIFO"
                       : fs::is_socket(st)    ? "a socket"
                       : fs::is_block_file(st) ? "a block device"
                       : fs::is_character_file(st) ? "a character device"
                                                   : "another kind of file";
    throw Error(where, "is not a regular file", type);
  }
  errno = 0;
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(where, "cannot be opened for reading", errno ? std::strerror(errno) : "");
  std::vector<unsigned char> bytes;
  std::vector<char> chunk(1 << 20);
  while (in) {
    in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
    const std::streamsize got = in.gcount();
    bytes.insert(bytes.end(), chunk.data(), chunk.data() + got);
  }
  if (in.bad()) throw Error(where, "cannot be read", errno ? std::strerror(errno) : "read error");
  M3_REQUIRE(!bytes.empty(), where, "is empty", "0 bytes");
  return bytes;
}

// ---------------------------------------------------------------------------------------------
// the synthetic tasks
// ---------------------------------------------------------------------------------------------

// The 36 digit/data spellings of modular and selective-copy.
constexpr char kBase36[] = "0123456789abcdefghijklmnopqrstuvwxyz";

// A task: the batch loops, validation, spelling; a subclass writes one row.
class TaskDataset : public Dataset {
 public:
  Idx max_T() const override { return kLarge; }
  Idx val_windows(Idx) const override { return kLarge; }

  Batch train_batch(std::uint64_t seed, Idx step, Idx micro, Idx B, Idx T) const override {
    const std::string w = where();
    check_train_args(w, step, micro);
    check_T(T);
    check_shape(w, "train_batch", B, T, min_T(), max_T());
    Batch out = empty_batch(B, T);
    for (Idx b = 0; b < B; ++b) {
      Rng rng(row_seed(seed, step, micro, b, kTrainStream));
      row(rng, out, b);
    }
    return out;
  }

  Batch val_batch(Idx i, Idx B, Idx T) const override {
    const std::string w = where();
    check_T(T);
    check_shape(w, "val_batch", B, T, min_T(), max_T());
    check_val_args(w, i, B);
    Batch out = empty_batch(B, T);
    for (Idx b = 0; b < B; ++b) {
      Rng rng(row_seed(kValSeed, 0, 0, i * B + b, kValStream));
      row(rng, out, b);
    }
    return out;
  }

  std::vector<std::int32_t> encode(const std::string& text) const override {
    const std::string sp = spelling();
    std::vector<std::int32_t> out;
    out.reserve(text.size());
    for (std::size_t k = 0; k < text.size(); ++k) {
      const auto pos = sp.find(text[k]);
      if (pos == std::string::npos)
        throw Error(where(), "encode: a character outside the vocabulary",
                    "'" + show(std::string(1, text[k])) + "' at position " + std::to_string(k) +
                        "; the vocabulary is \"" + sp + "\"");
      out.push_back(static_cast<std::int32_t>(pos));
    }
    return out;
  }

  std::string decode(const std::vector<std::int32_t>& tokens) const override {
    return decode_with(where(), spelling(), tokens);
  }

 protected:
  std::string where() const { return "task " + kind(); }
  // One character per token, in token order (size V).
  virtual std::string spelling() const = 0;
  // Writes row b of out (tok, tgt, w at b*T … b*T + T − 1; the batch arrives zero-filled).
  virtual void row(Rng& rng, Batch& out, Idx b) const = 0;

 private:
  void check_T(Idx T) const {
    M3_REQUIRE(T >= min_T(), where(), "T is too small for this task", "T = ", T, "; needs T >= ",
               min_T());
  }
};

class ParityTask final : public TaskDataset {
 public:
  static constexpr std::int32_t kPad = 2;
  ParityTask(Idx n_min, Idx n_max) : n_min_(n_min), n_max_(n_max) {}
  Idx vocab() const override { return 3; }
  std::string kind() const override { return "parity"; }
  std::vector<std::pair<std::string, std::string>> settings() const override {
    return {{"task", "parity"}, {"n_min", std::to_string(n_min_)},
            {"n_max", std::to_string(n_max_)}};
  }
  Idx min_T() const override { return n_max_; }
  bool sequence_accuracy() const override { return true; }

 protected:
  std::string spelling() const override { return "01."; }
  void row(Rng& rng, Batch& out, Idx b) const override {
    const Idx T = out.T;
    const Idx n = n_min_ + static_cast<Idx>(uniform_index(rng, static_cast<std::uint64_t>(
                                                                   n_max_ - n_min_ + 1)));
    std::int32_t parity = 0;
    for (Idx t = 0; t < T; ++t) {
      const auto r = static_cast<std::size_t>(b * T + t);
      if (t < n) {
        const auto bit = static_cast<std::int32_t>(rng.next() >> 63);
        parity ^= bit;
        out.tok[r] = bit;
        out.tgt[r] = parity;
        out.w[r] = 1.0f;
      } else {
        out.tok[r] = kPad;
      }
    }
  }

 private:
  Idx n_min_, n_max_;
};

class ModularTask final : public TaskDataset {
 public:
  ModularTask(Idx m, Idx n_min, Idx n_max) : m_(m), n_min_(n_min), n_max_(n_max) {}
  Idx vocab() const override { return m_ + 3; }
  std::string kind() const override { return "modular"; }
  std::vector<std::pair<std::string, std::string>> settings() const override {
    return {{"task", "modular"}, {"m", std::to_string(m_)}, {"n_min", std::to_string(n_min_)},
            {"n_max", std::to_string(n_max_)}};
  }
  Idx min_T() const override { return 2 * n_max_ - 1; }
  bool sequence_accuracy() const override { return true; }

 protected:
  std::string spelling() const override {
    return std::string(kBase36, static_cast<std::size_t>(m_)) + "+-.";
  }
  void row(Rng& rng, Batch& out, Idx b) const override {
    const Idx T = out.T;
    const auto m = static_cast<std::uint64_t>(m_);
    const auto mi = static_cast<std::int32_t>(m_);
    const auto plus = static_cast<std::int32_t>(m_), minus = plus + 1, pad = plus + 2;
    const Idx k = n_min_ + static_cast<Idx>(uniform_index(rng, static_cast<std::uint64_t>(
                                                                   n_max_ - n_min_ + 1)));
    const std::size_t r0 = static_cast<std::size_t>(b * T);
    std::int32_t value = 0;
    for (Idx j = 0; j < k; ++j) {
      bool subtract = false;
      if (j > 0) {
        subtract = (rng.next() >> 63) != 0;
        out.tok[r0 + static_cast<std::size_t>(2 * j - 1)] = subtract ? minus : plus;
      }
      const auto d = static_cast<std::int32_t>(uniform_index(rng, m));
      value = (value + (subtract ? mi - d : d)) % mi;
      const std::size_t r = r0 + static_cast<std::size_t>(2 * j);
      out.tok[r] = d;
      out.tgt[r] = value;
      out.w[r] = 1.0f;
    }
    for (Idx t = 2 * k - 1; t < T; ++t) out.tok[r0 + static_cast<std::size_t>(t)] = pad;
  }

 private:
  Idx m_, n_min_, n_max_;
};

class SelectiveCopyTask final : public TaskDataset {
 public:
  SelectiveCopyTask(Idx K, Idx alphabet) : K_(K), A_(alphabet) {}
  Idx vocab() const override { return A_ + 2; }
  std::string kind() const override { return "selective-copy"; }
  std::vector<std::pair<std::string, std::string>> settings() const override {
    return {{"task", "selective-copy"}, {"K", std::to_string(K_)},
            {"alphabet", std::to_string(A_)}};
  }
  Idx min_T() const override { return 2 * K_ + 1; }

 protected:
  std::string spelling() const override {
    return std::string(kBase36, static_cast<std::size_t>(A_)) + ".|";
  }
  void row(Rng& rng, Batch& out, Idx b) const override {
    const Idx T = out.T;
    const Idx P = T - K_ - 1;  // noise positions 0 … P−1, the marker at P, answers P+1 … T−1
    const auto noise = static_cast<std::int32_t>(A_), marker = noise + 1;
    std::vector<std::int32_t> data(static_cast<std::size_t>(K_));
    for (auto& c : data)
      c = static_cast<std::int32_t>(uniform_index(rng, static_cast<std::uint64_t>(A_)));
    std::vector<Idx> slots(static_cast<std::size_t>(P));
    for (Idx p = 0; p < P; ++p) slots[static_cast<std::size_t>(p)] = p;
    for (Idx i = 0; i < K_; ++i) {
      const Idx j = i + static_cast<Idx>(uniform_index(rng, static_cast<std::uint64_t>(P - i)));
      std::swap(slots[static_cast<std::size_t>(i)], slots[static_cast<std::size_t>(j)]);
    }
    std::sort(slots.begin(), slots.begin() + K_);
    const std::size_t r0 = static_cast<std::size_t>(b * T);
    for (Idx t = 0; t < T; ++t) out.tok[r0 + static_cast<std::size_t>(t)] = noise;
    for (Idx j = 0; j < K_; ++j)
      out.tok[r0 + static_cast<std::size_t>(slots[static_cast<std::size_t>(j)])] =
          data[static_cast<std::size_t>(j)];
    out.tok[r0 + static_cast<std::size_t>(P)] = marker;
    for (Idx j = 0; j < K_; ++j) {
      const std::size_t r = r0 + static_cast<std::size_t>(P + 1 + j);
      out.tgt[r] = data[static_cast<std::size_t>(j)];
      out.w[r] = 1.0f;
    }
  }

 private:
  Idx K_, A_;
};

// The options of one task: each given at most once, each known, each a decimal integer.
class Options {
 public:
  Options(std::string where, const std::vector<std::pair<std::string, std::string>>& given,
          std::vector<std::string> known)
      : where_(std::move(where)), given_(given) {
    for (std::size_t a = 0; a < given_.size(); ++a) {
      const std::string& key = given_[a].first;
      if (std::find(known.begin(), known.end(), key) == known.end()) {
        std::string list;
        for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
        throw Error(where_, "unknown option '" + show(key) + "'", "options: " + list);
      }
      for (std::size_t c = 0; c < a; ++c)
        M3_REQUIRE(given_[c].first != key, where_, "option " + key + " is given twice", "");
    }
  }
  bool has(const std::string& key) const {
    for (const auto& kv : given_)
      if (kv.first == key) return true;
    return false;
  }
  // The value of key as an integer in [lo, hi], or fallback when it is not given.
  Idx integer(const std::string& key, Idx fallback, Idx lo, Idx hi) const {
    for (const auto& kv : given_) {
      if (kv.first != key) continue;
      const std::string& text = kv.second;
      Idx v = 0;
      bool ok = !text.empty() && text.size() <= 12;
      for (char c : text) {
        if (c < '0' || c > '9') ok = false;
        if (ok) v = v * 10 + (c - '0');
      }
      M3_REQUIRE(ok && v >= lo && v <= hi, where_,
                 "option " + key + "='" + show(text) + "' is not an integer in [" +
                     std::to_string(lo) + ", " + std::to_string(hi) + "]",
                 "");
      return v;
    }
    return fallback;
  }

 private:
  std::string where_;
  std::vector<std::pair<std::string, std::string>> given_;
};

constexpr Idx kMaxLength = Idx{1} << 30;  // the largest length option a task accepts

}  // namespace

// ---------------------------------------------------------------------------------------------

Idx Batch::scored() const {
  Idx n = 0;
  for (float x : w) n += (x == 1.0f);
  return n;
}

Batch slice_rows(const Batch& b, Idx r0, Idx n) {
  M3_REQUIRE(r0 >= 0 && n >= 0 && r0 + n <= b.B, "slice_rows", "rows outside the batch",
             "rows [", r0, ", ", r0 + n, ") of B = ", b.B);
  Batch out;
  out.B = n;
  out.T = b.T;
  const auto lo = static_cast<std::ptrdiff_t>(r0 * b.T);
  const auto hi = static_cast<std::ptrdiff_t>((r0 + n) * b.T);
  out.tok.assign(b.tok.begin() + lo, b.tok.begin() + hi);
  out.tgt.assign(b.tgt.begin() + lo, b.tgt.begin() + hi);
  out.w.assign(b.w.begin() + lo, b.w.begin() + hi);
  return out;
}

Batch cut_batch(const Batch& b, Idx rows, Idx T) {
  M3_REQUIRE(rows >= 0 && rows <= b.B && T >= 0 && T <= b.T, "cut_batch",
             "a cut outside the batch", "rows ", rows, " T ", T, " of B = ", b.B, ", T = ", b.T);
  Batch out;
  out.B = rows;
  out.T = T;
  for (Idx r = 0; r < rows; ++r) {
    const auto lo = static_cast<std::ptrdiff_t>(r * b.T), hi = lo + static_cast<std::ptrdiff_t>(T);
    out.tok.insert(out.tok.end(), b.tok.begin() + lo, b.tok.begin() + hi);
    out.tgt.insert(out.tgt.end(), b.tgt.begin() + lo, b.tgt.begin() + hi);
    out.w.insert(out.w.end(), b.w.begin() + lo, b.w.begin() + hi);
  }
  return out;
}

std::uint64_t row_seed(std::uint64_t seed, Idx step, Idx micro, Idx row, std::uint64_t stream) {
  // Each stage is a bijection of the running word for a fixed prefix, so two tuples that
  // differ in one field never give the same seed.
  std::uint64_t h = mix64(seed);
  h = mix64(h ^ stream);
  h = mix64(h ^ static_cast<std::uint64_t>(step));
  h = mix64(h ^ static_cast<std::uint64_t>(micro));
  return mix64(h ^ static_cast<std::uint64_t>(row));
}

std::uint64_t uniform_index(Rng& rng, std::uint64_t n) {
  M3_REQUIRE(n >= 1, "uniform_index", "n must be >= 1", "n = ", n);
  // Accept x ≥ 2^64 mod n: the accepted range is a whole number of n-blocks.
  const std::uint64_t threshold = (0 - n) % n;
  for (;;) {
    const std::uint64_t x = rng.next();
    if (x >= threshold) return x % n;
  }
}

std::uint64_t fnv1a64(const void* data, std::size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  std::uint64_t h = 0xcbf29ce484222325ull;
  for (std::size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ull;
  }
  return h;
}

std::unique_ptr<Dataset> make_text_dataset(const std::string& path, double val_fraction, Idx T) {
  return make_text_dataset(std::vector<std::string>{path}, val_fraction, T);
}

std::unique_ptr<Dataset> make_text_dataset(const std::vector<std::string>& paths,
                                           double val_fraction, Idx T) {
  M3_REQUIRE(!paths.empty(), "text data", "no file given", "");
  std::string name;
  for (const std::string& p : paths) name += (name.empty() ? "" : ",") + p;
  const std::string where = "text data '" + show(name) + "'";
  M3_REQUIRE(std::isfinite(val_fraction) && val_fraction > 0 && val_fraction < 1, where,
             "val_fraction must be in (0, 1)", "val_fraction = ", val_fraction);
  M3_REQUIRE(T >= 1, where, "T must be >= 1", "T = ", T);
  std::vector<unsigned char> bytes;
  for (const std::string& p : paths) {
    const std::vector<unsigned char> one = read_whole_file("text data '" + show(p) + "'", p);
    bytes.insert(bytes.end(), one.begin(), one.end());
  }
  auto ds = std::make_unique<TextDataset>(name, val_fraction, std::move(bytes));
  ds->check_T(T);
  return ds;
}

std::unique_ptr<Dataset> make_task(const std::string& name,
                                   const std::vector<std::pair<std::string, std::string>>& options,
                                   Idx T) {
  const std::string where = "task " + show(name);
  M3_REQUIRE(T >= 1, where, "T must be >= 1", "T = ", T);
  std::unique_ptr<Dataset> ds;
  std::string rule;  // how min_T follows from the options
  if (name == "parity") {
    Options o(where, options, {"n_min", "n_max"});
    const Idx n_min = o.integer("n_min", 3, 1, kMaxLength);
    M3_REQUIRE(o.has("n_max") || T >= n_min, where, "T is too small for this task",
               "T = ", T, "; needs T >= ", n_min, ", from n_min = ", n_min);
    const Idx n_max = o.integer("n_max", std::min<Idx>(64, T), n_min, kMaxLength);
    ds = std::make_unique<ParityTask>(n_min, n_max);
    rule = "n_max = " + std::to_string(n_max);
  } else if (name == "modular") {
    Options o(where, options, {"m", "n_min", "n_max"});
    const Idx m = o.integer("m", 5, 2, 36);
    const Idx n_min = o.integer("n_min", 3, 1, kMaxLength);
    M3_REQUIRE(o.has("n_max") || T >= 2 * n_min - 1, where, "T is too small for this task",
               "T = ", T, "; needs T >= ", 2 * n_min - 1, ", from 2*n_min - 1 with n_min = ",
               n_min, " terms");
    const Idx n_max = o.integer("n_max", std::min<Idx>(32, (T + 1) / 2), n_min, kMaxLength);
    ds = std::make_unique<ModularTask>(m, n_min, n_max);
    rule = "2*n_max - 1 with n_max = " + std::to_string(n_max) + " terms";
  } else if (name == "selective-copy") {
    Options o(where, options, {"K", "alphabet"});
    const Idx K = o.integer("K", 16, 1, kMaxLength);
    const Idx A = o.integer("alphabet", 8, 1, 36);
    ds = std::make_unique<SelectiveCopyTask>(K, A);
    rule = "2K + 1 with K = " + std::to_string(K);
  } else {
    std::string list;
    for (const auto& n : task_names()) list += (list.empty() ? "" : ", ") + n;
    throw Error("task", "unknown task '" + show(name) + "'", "tasks: " + list);
  }
  M3_REQUIRE(T >= ds->min_T(), where, "T is too small for this task", "T = ", T,
             "; needs T >= ", ds->min_T(), ", from ", rule);
  return ds;
}

std::vector<std::string> task_names() { return {"parity", "modular", "selective-copy"}; }

double Accuracy::token() const {
  return tokens > 0 ? static_cast<double>(correct) / static_cast<double>(tokens) : 0.0;
}

double Accuracy::sequence() const {
  return sequences > 0 ? static_cast<double>(sequences_correct) / static_cast<double>(sequences)
                       : 0.0;
}

void Accuracy::add(const Accuracy& o) {
  tokens += o.tokens;
  correct += o.correct;
  sequences += o.sequences;
  sequences_correct += o.sequences_correct;
}

Accuracy accuracy(const Batch& b, const std::vector<std::int32_t>& argmax) {
  const auto n = static_cast<std::size_t>(b.B * b.T);
  M3_REQUIRE(b.tok.size() == n && b.tgt.size() == n && b.w.size() == n, "accuracy",
             "the batch's buffers are not B*T long", "B = ", b.B, ", T = ", b.T, ", tgt ",
             b.tgt.size(), ", w ", b.w.size());
  M3_REQUIRE(argmax.size() == n, "accuracy", "argmax must have B*T entries",
             "got ", argmax.size(), ", B*T = ", n);
  Accuracy a;
  for (Idx r = 0; r < b.B; ++r) {
    Idx scored = 0, right = 0;
    for (Idx t = 0; t < b.T; ++t) {
      const auto i = static_cast<std::size_t>(r * b.T + t);
      if (b.w[i] != 1.0f) continue;
      ++scored;
      right += (argmax[i] == b.tgt[i]);
    }
    a.tokens += scored;
    a.correct += right;
    if (scored > 0) {
      ++a.sequences;
      a.sequences_correct += (right == scored);
    }
  }
  return a;
}

}  // namespace m3::train
