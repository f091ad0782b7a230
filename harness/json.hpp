// The JSON documents of `m3h compare --json`: a streaming interface over Debian's
// nlohmann-json (nlohmann::ordered_json: keys stay in the order written), and an atomic file
// write.
//
//   Json j;                      j.begin_object();
//   j.key("rel_l2").num(1e-5);   j.key("key").str("L0/F3/dt");   j.key("shape").begin_array();
//   ...                          j.end_array(); j.end_object();   std::string text = j.text();
//
// The library escapes strings (" \ and the control characters U+0000…U+001F) and writes every
// double so that it reads back to the same value. JSON has no non-finite numbers: a NON-FINITE
// double is written as the STRING "inf", "-inf" or "nan" (a reader sees a string where it
// expects a number and the value is not lost). Invalid UTF-8 in a string is replaced by U+FFFD.
// Misuse (a value where a key is due, a key twice in one object, unbalanced ends, text()
// before the top value is closed) throws m3::Error. Indented by two spaces per level.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace m3::harness {

class Json {
 public:
  Json();
  ~Json();
  Json(Json&&) noexcept;
  Json& operator=(Json&&) noexcept;
  Json(const Json&) = delete;
  Json& operator=(const Json&) = delete;

  Json& begin_object();
  Json& end_object();
  Json& begin_array();
  Json& end_array();
  Json& key(const std::string& k);  // inside an object, before each value
  Json& str(const std::string& v);
  Json& num(double v);
  Json& num(std::int64_t v);
  Json& num(std::uint64_t v);
  Json& num(int v) { return num(static_cast<std::int64_t>(v)); }
  Json& boolean(bool v);
  Json& null();

  // The document; throws unless exactly one complete top-level value was written.
  const std::string& text() const;

 private:
  struct Impl;
  nlohmann::ordered_json& place(nlohmann::ordered_json v);
  std::unique_ptr<Impl> impl_;
};

// Writes `content` to "<path>.tmp.<pid>" beside `path`, flushes, fsyncs and renames it over
// `path` (atomic within one folder). On any failure the temporary file is removed and an
// m3::Error names the path and the system error.
void write_file_atomic(const std::string& path, const std::string& content);

}  // namespace m3::harness
