// The safetensors format (see safetensors.hpp): encode, decode with every check, file I/O.
#include "safetensors.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "error.hpp"
#include "json.hpp"
#include "precision.hpp"

namespace m3::st {

namespace {

using OJson = nlohmann::ordered_json;

constexpr const char* kMetadataKey = "__metadata__";
// The largest header read: far above any real one (a few MB for thousands of tensors), and the
// limit of the format's own reader, so a corrupt length cannot make us allocate gigabytes.
constexpr std::uint64_t kMaxHeader = 100ull << 20;

std::string named(const std::string& name) { return "'" + escape_for_message(name, 80) + "'"; }

bool parse_dtype(const std::string& s, DType* out) {
  for (DType d : {DType::F32, DType::BF16, DType::F16, DType::I32})
    if (s == dtype_name(d)) {
      *out = d;
      return true;
    }
  return false;
}

// prod(shape), or −1 when it (or a dim) exceeds 2^62.
Idx checked_numel(const std::vector<Idx>& shape) {
  constexpr Idx kMax = Idx{1} << 62;
  Idx n = 1;
  for (Idx d : shape) {
    if (d < 0 || d > kMax) return -1;
    if (d != 0 && n > kMax / d) return -1;
    n *= d;
  }
  return n;
}

std::string shape_text(const std::vector<Idx>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

void put_le(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

std::uint64_t get_le64(const std::string& b) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(b[static_cast<std::size_t>(i)]);
  return v;
}

// The header as JSON, refusing a key that appears twice in one object (the JSON library would
// keep the last silently, and a tensor listed twice must not pass as one).
OJson parse_header(const std::string& text, const std::string& where) {
  std::vector<std::set<std::string>> open;  // the keys seen in each enclosing object
  std::string repeated;
  auto cb = [&](int, OJson::parse_event_t ev, OJson& parsed) {
    if (ev == OJson::parse_event_t::object_start) open.emplace_back();
    if (ev == OJson::parse_event_t::object_end && !open.empty()) open.pop_back();
    if (ev == OJson::parse_event_t::key && !open.empty() && repeated.empty() &&
        !open.back().insert(parsed.get<std::string>()).second)
      repeated = parsed.get<std::string>();
    return true;
  };
  OJson h;
  try {
    h = OJson::parse(text, cb);
  } catch (const OJson::exception& e) {
    // nlohmann's message: "[json.exception.parse_error.101] parse error at line 1, column 7: …"
    std::string msg = e.what();
    const auto at = msg.find("] ");
    if (at != std::string::npos) msg = msg.substr(at + 2);
    throw Error(where, "the header is not valid JSON", escape_for_message(msg, 160));
  }
  if (!repeated.empty())
    throw Error(where, "the header names " + named(repeated) + " twice", "keys must be unique");
  if (!h.is_object()) throw Error(where, "the header is not a JSON object", "");
  return h;
}

// An unsigned integer of a header entry, or an error naming the tensor and the field.
Idx header_uint(const OJson& v, const std::string& where, const std::string& tensor,
                const char* field) {
  if (!v.is_number_unsigned() || v.get<std::uint64_t>() > (std::uint64_t{1} << 62))
    throw Error(where, "tensor " + named(tensor) + ": " + field + " holds " +
                           escape_for_message(v.dump(), 40),
                "expected a non-negative integer");
  return static_cast<Idx>(v.get<std::uint64_t>());
}

}  // namespace

const char* dtype_name(DType d) {
  switch (d) {
    case DType::F32: return "F32";
    case DType::BF16: return "BF16";
    case DType::F16: return "F16";
    case DType::I32: return "I32";
  }
  return "?";
}

std::size_t dtype_size(DType d) { return d == DType::BF16 || d == DType::F16 ? 2 : 4; }

Idx TensorData::numel() const { return checked_numel(shape); }

const TensorData* File::find(const std::string& name) const {
  for (const TensorData& t : tensors)
    if (t.name == name) return &t;
  return nullptr;
}

const std::string* File::meta(const std::string& key) const {
  for (const auto& kv : metadata)
    if (kv.first == key) return &kv.second;
  return nullptr;
}

TensorData f32_tensor(std::string name, std::vector<Idx> shape, const std::vector<float>& values) {
  TensorData t{std::move(name), DType::F32, std::move(shape), {}};
  t.bytes.reserve(values.size() * 4);
  for (float v : values) {
    const std::uint32_t u = float_bits(v);
    for (int i = 0; i < 4; ++i) t.bytes.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
  }
  return t;
}

TensorData i32_tensor(std::string name, std::vector<Idx> shape,
                      const std::vector<std::int32_t>& values) {
  TensorData t{std::move(name), DType::I32, std::move(shape), {}};
  t.bytes.reserve(values.size() * 4);
  for (std::int32_t v : values) {
    const auto u = static_cast<std::uint32_t>(v);
    for (int i = 0; i < 4; ++i) t.bytes.push_back(static_cast<std::uint8_t>(u >> (8 * i)));
  }
  return t;
}

std::vector<float> to_floats(const TensorData& t, const std::string& where) {
  M3_REQUIRE(t.dtype != DType::I32, where, "tensor " + named(t.name) + " is I32",
             "expected a floating-point tensor (F32, BF16 or F16)");
  const std::size_t es = dtype_size(t.dtype), n = t.bytes.size() / es;
  std::vector<float> out(n);
  const std::uint8_t* b = t.bytes.data();
  for (std::size_t i = 0; i < n; ++i, b += es) {
    if (t.dtype == DType::F32) {
      out[i] = bits_float(static_cast<std::uint32_t>(b[0]) | static_cast<std::uint32_t>(b[1]) << 8 |
                          static_cast<std::uint32_t>(b[2]) << 16 |
                          static_cast<std::uint32_t>(b[3]) << 24);
    } else {
      const auto h = static_cast<std::uint16_t>(b[0] | b[1] << 8);
      out[i] = t.dtype == DType::BF16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
    }
  }
  return out;
}

std::vector<std::int32_t> to_ints(const TensorData& t, const std::string& where) {
  M3_REQUIRE(t.dtype == DType::I32, where,
             "tensor " + named(t.name) + " is " + dtype_name(t.dtype), "expected I32");
  std::vector<std::int32_t> out(t.bytes.size() / 4);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const std::uint8_t* b = t.bytes.data() + 4 * i;
    out[i] = static_cast<std::int32_t>(static_cast<std::uint32_t>(b[0]) | b[1] << 8 | b[2] << 16 |
                                       static_cast<std::uint32_t>(b[3]) << 24);
  }
  return out;
}

std::string encode(const File& f, const std::string& where) {
  OJson h = OJson::object();
  if (!f.metadata.empty()) {
    OJson m = OJson::object();
    for (const auto& [k, v] : f.metadata) {
      M3_REQUIRE(!m.contains(k), where, "metadata key " + named(k) + " is given twice", "");
      m[k] = v;
    }
    h[kMetadataKey] = std::move(m);
  }
  std::uint64_t offset = 0;
  for (const TensorData& t : f.tensors) {
    M3_REQUIRE(!t.name.empty() && t.name != kMetadataKey && !h.contains(t.name), where,
               "tensor name " + named(t.name) + " is empty, reserved or repeated", "");
    const Idx n = checked_numel(t.shape);
    M3_REQUIRE(n >= 0 && t.bytes.size() == static_cast<std::size_t>(n) * dtype_size(t.dtype),
               where, "tensor " + named(t.name) + " holds " + std::to_string(t.bytes.size()) +
                          " bytes",
               "its shape ", shape_text(t.shape), " of ", dtype_name(t.dtype), " needs ",
               n < 0 ? std::string("more than 2^62 elements")
                     : std::to_string(static_cast<std::size_t>(n) * dtype_size(t.dtype)));
    OJson e = OJson::object();
    e["dtype"] = dtype_name(t.dtype);
    e["shape"] = t.shape;
    e["data_offsets"] = {offset, offset + t.bytes.size()};
    h[t.name] = std::move(e);
    offset += t.bytes.size();
  }
  std::string header;
  try {
    header = h.dump();
  } catch (const OJson::exception& e) {  // a name or value that is not UTF-8
    throw Error(where, "a tensor name or metadata text is not valid UTF-8", e.what());
  }
  header.append((8 - header.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + header.size() + offset);
  put_le(out, header.size());
  out += header;
  for (const TensorData& t : f.tensors) out.append(t.bytes.begin(), t.bytes.end());
  return out;
}

File decode(const std::string& bytes, const std::string& where) {
  if (bytes.size() < 8)
    throw Error(where, "truncated: " + std::to_string(bytes.size()) + " bytes",
                "a safetensors file starts with an 8-byte header length");
  const std::uint64_t n = get_le64(bytes);
  const std::uint64_t rest = bytes.size() - 8;
  if (n > rest)
    throw Error(where, "the header length " + std::to_string(n) + " runs past the end of the file",
                why("the file has ", bytes.size(), " bytes, so at most ", rest, " after the length"));
  if (n > kMaxHeader)
    throw Error(where, "the header length " + std::to_string(n) + " is above 100 MiB",
                "not a safetensors file, or a corrupt one");
  const OJson h = parse_header(bytes.substr(8, static_cast<std::size_t>(n)), where);
  const std::uint64_t data_size = rest - n;
  const std::size_t data_at = 8 + static_cast<std::size_t>(n);

  File f;
  struct Range {
    std::uint64_t begin, end;
    std::size_t index;
  };
  std::vector<Range> ranges;
  for (const auto& [name, e] : h.items()) {
    if (name == kMetadataKey) {
      if (!e.is_object())
        throw Error(where, "__metadata__ is not a JSON object", "expected {\"key\": \"value\", …}");
      for (const auto& [k, v] : e.items()) {
        if (!v.is_string())
          throw Error(where, "__metadata__ " + named(k) + " is not a string",
                      "the format's metadata maps strings to strings");
        f.metadata.emplace_back(k, v.get<std::string>());
      }
      continue;
    }
    const std::string t = "tensor " + named(name);
    if (name.empty()) throw Error(where, "a tensor has an empty name", "");
    if (!e.is_object()) throw Error(where, t + " is not a JSON object", "expected dtype, shape, data_offsets");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!e.contains(field)) throw Error(where, t + " has no " + field, "");
    TensorData td;
    td.name = name;
    if (!e["dtype"].is_string() || !parse_dtype(e["dtype"].get<std::string>(), &td.dtype))
      throw Error(where, t + " has dtype " + escape_for_message(e["dtype"].dump(), 40),
                  "this reader takes F32, BF16, F16 and I32");
    if (!e["shape"].is_array()) throw Error(where, t + ": shape is not an array", "");
    for (const OJson& d : e["shape"]) td.shape.push_back(header_uint(d, where, name, "shape"));
    const OJson& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2)
      throw Error(where, t + ": data_offsets is not a pair [begin, end]", "");
    const auto begin = static_cast<std::uint64_t>(header_uint(off[0], where, name, "data_offsets"));
    const auto end = static_cast<std::uint64_t>(header_uint(off[1], where, name, "data_offsets"));
    const Idx numel = checked_numel(td.shape);
    if (numel < 0) throw Error(where, t + " has more than 2^62 elements", shape_text(td.shape));
    const std::uint64_t need = static_cast<std::uint64_t>(numel) * dtype_size(td.dtype);
    if (end < begin || end - begin != need)
      throw Error(where, t + ": data_offsets [" + std::to_string(begin) + ", " +
                             std::to_string(end) + "] do not hold its shape",
                  why(dtype_name(td.dtype), " ", shape_text(td.shape), " needs ", need, " bytes"));
    if (end > data_size)
      throw Error(where, t + ": data_offsets [" + std::to_string(begin) + ", " +
                             std::to_string(end) + "] run past the end of the data",
                  why("the data holds ", data_size, " bytes; truncated file?"));
    td.bytes.assign(bytes.begin() + static_cast<std::ptrdiff_t>(data_at + begin),
                    bytes.begin() + static_cast<std::ptrdiff_t>(data_at + end));
    ranges.push_back({begin, end, f.tensors.size()});
    f.tensors.push_back(std::move(td));
  }
  // The ranges must tile the data exactly: no overlap, no gap, nothing after the last one.
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const Range& r = ranges[i];
    if (i > 0 && r.begin < covered) {
      const Range& p = ranges[i - 1];
      throw Error(where, "tensors " + named(f.tensors[p.index].name) + " and " +
                             named(f.tensors[r.index].name) + " overlap",
                  why("bytes [", p.begin, ", ", p.end, ") and [", r.begin, ", ", r.end, ")"));
    }
    if (r.begin > covered)
      throw Error(where, why("data bytes [", covered, ", ", r.begin, ") belong to no tensor"),
                  "the format indexes the whole data buffer");
    covered = r.end;
  }
  if (covered != data_size)
    throw Error(where, why("data bytes [", covered, ", ", data_size, ") belong to no tensor"),
                "the format indexes the whole data buffer");
  std::vector<TensorData> ordered;
  ordered.reserve(ranges.size());
  for (const Range& r : ranges) ordered.push_back(std::move(f.tensors[r.index]));
  f.tensors = std::move(ordered);
  return f;
}

File read_file(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw Error(path, std::filesystem::exists(path, ec) ? "not a regular file" : "no such file", "");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(path, "cannot open the file", std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(path, "cannot read the file", std::strerror(errno));
  return decode(bytes, path);
}

void write_file(const std::string& path, const File& f) {
  harness::write_file_atomic(path, encode(f, path));
}

}  // namespace m3::st
