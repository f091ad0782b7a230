// A small streaming JSON writer (RFC 8259) and an atomic file write, for `m3h compare --json`.
//
//   Json j;                      j.begin_object();
//   j.key("rel_l2").num(1e-5);   j.key("key").str("L0/F3/dt");   j.key("shape").begin_array();
//   ...                          j.end_array(); j.end_object();   std::string text = j.text();
//
// Strings are escaped: " \ and the control characters U+0000…U+001F (\n \t \r \b \f or \u00XX);
// everything else, UTF-8 included, is copied as is. Numbers: integers exactly (int64 / uint64
// as decimal digits), doubles with 17 significant digits ("%.17g", round-trips), never a bare
// "inf"/"nan": a NON-FINITE double is written as the STRING "inf", "-inf" or "nan" (JSON has no
// such numbers; a reader sees a string where it expects a number and the value is not lost).
// Misuse (a value where a key is due, unbalanced ends, text() before the top value is closed)
// throws m3::Error. Objects are indented by two spaces per level; arrays of numbers stay on
// one line so that shapes and small vectors read compactly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace m3::harness {

class Json {
 public:
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

  static std::string escape(const std::string& s);  // with the surrounding quotes
  static std::string number(double v);               // "1.0000000000000001e-05", "\"inf\""

 private:
  struct Level {
    bool object;
    int count = 0;
    bool key_pending = false;
    bool inline_scalars = true;  // an array with only scalars so far (kept on one line)
  };
  void before_value(bool scalar);
  void newline();
  std::string out_;
  std::vector<Level> stack_;
  bool done_ = false;
};

// Writes `content` to "<path>.tmp.<pid>" beside `path`, flushes, fsyncs and renames it over
// `path` (atomic within one folder). On any failure the temporary file is removed and an
// m3::Error names the path and the system error.
void write_file_atomic(const std::string& path, const std::string& content);

}  // namespace m3::harness
