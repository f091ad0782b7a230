// JSON writer and atomic file write (see json.hpp).
#include "json.hpp"
#include "temp_files.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include "error.hpp"

namespace m3::harness {

std::string Json::escape(const std::string& s) {
  std::string o;
  o.reserve(s.size() + 2);
  o += '"';
  for (const char ch : s) {
    const unsigned char c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': o += "\\\""; break;
      case '\\': o += "\\\\"; break;
      case '\n': o += "\\n"; break;
      case '\r': o += "\\r"; break;
      case '\t': o += "\\t"; break;
      case '\b': o += "\\b"; break;
      case '\f': o += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          o += buf;
        } else {
          o += ch;
        }
    }
  }
  o += '"';
  return o;
}

std::string Json::number(double v) {
  if (std::isnan(v)) return "\"nan\"";
  if (std::isinf(v)) return v > 0 ? "\"inf\"" : "\"-inf\"";
  if (v == 0) return std::signbit(v) ? "-0.0" : "0";
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;  // %g never gives a leading '+', a bare '.', or hex: always a JSON number
}

void Json::newline() {
  out_ += '\n';
  out_.append(2 * stack_.size(), ' ');
}

void Json::before_value(bool scalar) {
  if (done_) throw Error("json", "a second top-level value", "the document is complete");
  if (stack_.empty()) return;
  Level& l = stack_.back();
  if (l.object) {
    if (!l.key_pending) throw Error("json", "a value inside an object without a key", "");
    l.key_pending = false;
    return;  // key() already wrote the separator, the newline and the indentation
  }
  if (l.count > 0) out_ += ',';
  if (scalar && l.inline_scalars) {
    if (l.count > 0) out_ += ' ';
  } else {
    l.inline_scalars = false;
    newline();
  }
  ++l.count;
}

Json& Json::key(const std::string& k) {
  if (stack_.empty() || !stack_.back().object)
    throw Error("json", "a key outside an object", k);
  Level& l = stack_.back();
  if (l.key_pending) throw Error("json", "two keys in a row", k);
  if (l.count > 0) out_ += ',';
  ++l.count;
  newline();
  out_ += escape(k);
  out_ += ": ";
  l.key_pending = true;
  return *this;
}

Json& Json::begin_object() {
  before_value(false);
  out_ += '{';
  stack_.push_back({true});
  return *this;
}

Json& Json::end_object() {
  if (stack_.empty() || !stack_.back().object || stack_.back().key_pending)
    throw Error("json", "end_object without a matching begin_object", "");
  const bool empty = stack_.back().count == 0;
  stack_.pop_back();
  if (!empty) newline();
  out_ += '}';
  if (stack_.empty()) done_ = true;
  return *this;
}

Json& Json::begin_array() {
  before_value(false);
  out_ += '[';
  stack_.push_back({false});
  return *this;
}

Json& Json::end_array() {
  if (stack_.empty() || stack_.back().object)
    throw Error("json", "end_array without a matching begin_array", "");
  const bool broken = !stack_.back().inline_scalars;
  stack_.pop_back();
  if (broken) newline();
  out_ += ']';
  if (stack_.empty()) done_ = true;
  return *this;
}

Json& Json::str(const std::string& v) {
  before_value(true);
  out_ += escape(v);
  if (stack_.empty()) done_ = true;
  return *this;
}

Json& Json::num(double v) {
  before_value(true);
  out_ += number(v);
  if (stack_.empty()) done_ = true;
  return *this;
}

Json& Json::num(std::int64_t v) {
  before_value(true);
  out_ += std::to_string(v);
  if (stack_.empty()) done_ = true;
  return *this;
}

Json& Json::num(std::uint64_t v) {
  before_value(true);
  out_ += std::to_string(v);
  if (stack_.empty()) done_ = true;
  return *this;
}

Json& Json::boolean(bool v) {
  before_value(true);
  out_ += v ? "true" : "false";
  if (stack_.empty()) done_ = true;
  return *this;
}

Json& Json::null() {
  before_value(true);
  out_ += "null";
  if (stack_.empty()) done_ = true;
  return *this;
}

const std::string& Json::text() const {
  if (!done_ || !stack_.empty())
    throw Error("json", "the document is incomplete", std::to_string(stack_.size()) + " open");
  return out_;
}

void write_file_atomic(const std::string& path, const std::string& content) {
  tmp::clean_stale_temps(path);  // what a killed earlier run left
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  const tmp::TempFile guard(temp);  // SIGINT / SIGTERM remove it
  auto fail = [&](const char* what) {
    const std::string why = std::strerror(errno);
    ::unlink(temp.c_str());
    throw Error(path, what, why);
  };
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw Error(path, "cannot create the temporary file " + temp, std::strerror(errno));
  }
  size_t off = 0;
  while (off < content.size()) {
    const ssize_t n = ::write(fd, content.data() + off, content.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      fail("write failed");
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail("fsync failed");
  }
  if (::close(fd) != 0) fail("close failed");
  if (::rename(temp.c_str(), path.c_str()) != 0) fail("rename over the final path failed");
}

}  // namespace m3::harness
