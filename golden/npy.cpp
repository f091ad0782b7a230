// NumPy .npy encoding and decoding (see npy.hpp).
#include "npy.hpp"

#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

#include "error.hpp"
#include "precision.hpp"

namespace m3::npy {

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr std::size_t kMagicLen = 6;

// The header dict of a .npy file: a small parser for the literal NumPy writes (and any
// equivalent one: keys in any order, either quote, spaces anywhere, a trailing comma).
struct Header {
  std::string descr;
  bool fortran_order = false;
  std::vector<Idx> shape;
};

class HeaderParser {
 public:
  HeaderParser(const std::string& text, const std::string& name) : s_(text), name_(name) {}

  Header parse() {
    Header h;
    bool has_descr = false, has_order = false, has_shape = false;
    expect('{');
    skip();
    while (peek() != '}') {
      const std::string key = quoted();
      expect(':');
      if (key == "descr") {
        h.descr = quoted();
        has_descr = true;
      } else if (key == "fortran_order") {
        h.fortran_order = boolean();
        has_order = true;
      } else if (key == "shape") {
        h.shape = tuple();
        has_shape = true;
      } else {
        fail("unknown header key '" + key + "'");
      }
      skip();
      if (peek() == ',') {
        ++i_;
        skip();
      } else if (peek() != '}') {
        fail("expected ',' or '}' in the header");
      }
    }
    ++i_;
    skip();
    if (i_ != s_.size()) fail("text after the header's '}'");
    if (!has_descr || !has_order || !has_shape)
      fail("the header lacks one of 'descr', 'fortran_order', 'shape'");
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(name_, "not a valid .npy file", what);
  }
  void skip() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  char peek() {
    skip();
    if (i_ >= s_.size()) fail("the header ends early");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(std::string("expected '") + c + "' in the header");
    ++i_;
  }
  std::string quoted() {
    const char q = peek();
    if (q != '\'' && q != '"') fail("expected a quoted string in the header");
    const std::size_t end = s_.find(q, i_ + 1);
    if (end == std::string::npos) fail("an unterminated string in the header");
    std::string v = s_.substr(i_ + 1, end - i_ - 1);
    i_ = end + 1;
    return v;
  }
  bool boolean() {
    skip();
    if (s_.compare(i_, 4, "True") == 0) {
      i_ += 4;
      return true;
    }
    if (s_.compare(i_, 5, "False") == 0) {
      i_ += 5;
      return false;
    }
    fail("'fortran_order' is neither True nor False");
  }
  std::vector<Idx> tuple() {
    expect('(');
    std::vector<Idx> dims;
    while (peek() != ')') {
      if (!std::isdigit(static_cast<unsigned char>(s_[i_]))) fail("a shape entry that is not a count");
      Idx v = 0;
      while (i_ < s_.size() && std::isdigit(static_cast<unsigned char>(s_[i_]))) {
        const Idx d = s_[i_++] - '0';
        if (v > (std::numeric_limits<Idx>::max() - d) / 10) fail("a shape entry too large");
        v = v * 10 + d;
      }
      dims.push_back(v);
      if (peek() == ',') ++i_;
      else if (peek() != ')') fail("expected ',' or ')' in the shape");
    }
    ++i_;
    return dims;
  }

  const std::string& s_;
  const std::string& name_;
  std::size_t i_ = 0;
};

template <class U>
U load_le(const char* p) {
  U v = 0;
  for (std::size_t b = 0; b < sizeof(U); ++b)
    v |= static_cast<U>(static_cast<unsigned char>(p[b])) << (8 * b);
  return v;
}

void store_le(std::string& out, std::uint64_t v, int bytes) {
  for (int b = 0; b < bytes; ++b) out += static_cast<char>((v >> (8 * b)) & 0xff);
}

}  // namespace

std::string encode(const Tensor& t) {
  M3_REQUIRE(static_cast<Idx>(t.data.size()) == t.numel(), "npy::encode",
             "the data size differs from the shape", "shape ", shape_str(t.shape), ", ",
             t.data.size(), " values");
  std::string dict = "{'descr': '<f8', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < t.shape.size(); ++i)
    dict += std::to_string(t.shape[i]) + (t.shape.size() == 1 || i + 1 < t.shape.size() ? "," : "") +
            (i + 1 < t.shape.size() ? " " : "");
  dict += "), }";
  // magic (6) + version (2) + length (2) + dict + padding + '\n' ≡ 0 (mod 64)
  const std::size_t unpadded = kMagicLen + 2 + 2 + dict.size() + 1;
  dict.append((64 - unpadded % 64) % 64, ' ');
  dict += '\n';
  M3_REQUIRE(dict.size() <= 0xffff, "npy::encode", "the header is too long for version 1.0",
             dict.size(), " bytes");
  std::string out(kMagic, kMagicLen);
  out += '\x01';
  out += '\x00';
  store_le(out, dict.size(), 2);
  out += dict;
  out.reserve(out.size() + 8 * t.data.size());
  for (double v : t.data) {
    std::uint64_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    store_le(out, bits, 8);
  }
  return out;
}

Tensor decode(const std::string& bytes, const std::string& name) {
  auto fail = [&](const std::string& what) -> Error {
    return Error(name, "not a valid .npy file", what);
  };
  if (bytes.size() < kMagicLen + 4 || bytes.compare(0, kMagicLen, kMagic, kMagicLen) != 0)
    throw fail("no NumPy magic bytes at the start");
  const int major = static_cast<unsigned char>(bytes[kMagicLen]);
  std::size_t header_len = 0, start = 0;
  if (major == 1) {
    header_len = load_le<std::uint16_t>(bytes.data() + kMagicLen + 2);
    start = kMagicLen + 4;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < kMagicLen + 6) throw fail("the file ends inside the header length");
    header_len = load_le<std::uint32_t>(bytes.data() + kMagicLen + 2);
    start = kMagicLen + 6;
  } else {
    throw fail("format version " + std::to_string(major) + " (1, 2 and 3 are known)");
  }
  if (bytes.size() - start < header_len) throw fail("the file ends inside the header");
  const Header h = HeaderParser(bytes.substr(start, header_len), name).parse();
  if (h.fortran_order)
    throw Error(name, "Fortran-ordered array", "write it C-ordered: numpy.ascontiguousarray");
  int itemsize = 0;
  if (h.descr == "<f8") itemsize = 8;
  else if (h.descr == "<f4") itemsize = 4;
  else if (h.descr == "<f2") itemsize = 2;
  else
    throw Error(name, "unsupported dtype '" + escape_for_message(h.descr, 40) + "'",
                "little-endian float64, float32 or float16 ('<f8', '<f4', '<f2'); bfloat16 as "
                "float32");
  Tensor t;
  t.shape = h.shape;
  Idx n = 1;
  for (Idx d : t.shape) {
    if (d != 0 && n > std::numeric_limits<Idx>::max() / 8 / d)
      throw fail("the shape " + shape_str(t.shape) + " is too large");
    n *= d;
  }
  const std::size_t data_bytes = bytes.size() - start - header_len;
  const std::size_t want = static_cast<std::size_t>(n) * static_cast<std::size_t>(itemsize);
  if (data_bytes != want)
    throw fail("shape " + shape_str(t.shape) + " of " + h.descr + " needs " + std::to_string(want) +
               " data bytes, the file holds " + std::to_string(data_bytes));
  t.data.resize(static_cast<std::size_t>(n));
  const char* p = bytes.data() + start + header_len;
  for (std::size_t i = 0; i < t.data.size(); ++i, p += itemsize) {
    if (itemsize == 8) {
      const std::uint64_t u = load_le<std::uint64_t>(p);
      std::memcpy(&t.data[i], &u, sizeof u);
    } else if (itemsize == 4) {
      t.data[i] = static_cast<double>(bits_float(load_le<std::uint32_t>(p)));
    } else {
      t.data[i] = static_cast<double>(f16_bits_to_float(load_le<std::uint16_t>(p)));
    }
  }
  return t;
}

Tensor read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path, "cannot open the file", std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(path, "cannot read the file", std::strerror(errno));
  return decode(bytes, path);
}

void write(const std::string& path, const Tensor& t) {
  const std::string bytes = encode(t);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) throw Error(path, "cannot create the file", std::strerror(errno));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) throw Error(path, "cannot write the file", std::strerror(errno));
}

}  // namespace m3::npy
