// JSON writer (over nlohmann::ordered_json) and atomic file write (see json.hpp).
#include "json.hpp"
#include "temp_files.hpp"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>

#include "error.hpp"

#include <nlohmann/json.hpp>

namespace m3::harness {

// The document is built as an nlohmann::ordered_json tree (keys in insertion order) and
// serialised by the library; this class keeps the streaming interface report_json.cpp uses,
// its misuse checks, and the one rule JSON has no number for: a non-finite double becomes the
// string "inf", "-inf" or "nan". Invalid UTF-8 in a string is replaced (U+FFFD), not an error.
struct Json::Impl {
  nlohmann::ordered_json root;
  std::vector<nlohmann::ordered_json*> stack;  // the open containers, innermost last
  std::string pending_key;
  bool key_pending = false;
  bool done = false;
  mutable std::string text;
};

Json::Json() : impl_(std::make_unique<Impl>()) {}
Json::~Json() = default;
Json::Json(Json&&) noexcept = default;
Json& Json::operator=(Json&&) noexcept = default;

nlohmann::ordered_json& Json::place(nlohmann::ordered_json v) {
  Impl& m = *impl_;
  if (m.done) throw Error("json", "a second top-level value", "the document is complete");
  if (m.stack.empty()) {
    m.root = std::move(v);
    if (!m.root.is_structured()) m.done = true;
    return m.root;
  }
  nlohmann::ordered_json& top = *m.stack.back();
  if (top.is_object()) {
    if (!m.key_pending) throw Error("json", "a value inside an object without a key", "");
    m.key_pending = false;
    auto& slot = top[m.pending_key];
    slot = std::move(v);
    return slot;
  }
  if (m.key_pending) throw Error("json", "a key inside an array", m.pending_key);
  top.push_back(std::move(v));
  return top.back();
}

Json& Json::begin_object() {
  impl_->stack.push_back(&place(nlohmann::ordered_json::object()));
  return *this;
}
Json& Json::begin_array() {
  impl_->stack.push_back(&place(nlohmann::ordered_json::array()));
  return *this;
}
Json& Json::end_object() {
  Impl& m = *impl_;
  if (m.stack.empty() || !m.stack.back()->is_object())
    throw Error("json", "end_object without an open object", "");
  if (m.key_pending) throw Error("json", "end_object after a key without its value", m.pending_key);
  m.stack.pop_back();
  if (m.stack.empty()) m.done = true;
  return *this;
}
Json& Json::end_array() {
  Impl& m = *impl_;
  if (m.stack.empty() || !m.stack.back()->is_array())
    throw Error("json", "end_array without an open array", "");
  m.stack.pop_back();
  if (m.stack.empty()) m.done = true;
  return *this;
}
Json& Json::key(const std::string& k) {
  Impl& m = *impl_;
  if (m.stack.empty() || !m.stack.back()->is_object())
    throw Error("json", "a key outside an object", k);
  if (m.key_pending) throw Error("json", "two keys in a row", m.pending_key + ", " + k);
  if (m.stack.back()->contains(k)) throw Error("json", "a key given twice in one object", k);
  m.pending_key = k;
  m.key_pending = true;
  return *this;
}
Json& Json::str(const std::string& v) {
  place(v);
  return *this;
}
Json& Json::num(double v) {
  if (std::isnan(v)) {
    place("nan");
  } else if (std::isinf(v)) {
    place(v > 0 ? "inf" : "-inf");
  } else {
    place(v);
  }
  return *this;
}
Json& Json::num(std::int64_t v) {
  place(v);
  return *this;
}
Json& Json::num(std::uint64_t v) {
  place(v);
  return *this;
}
Json& Json::boolean(bool v) {
  place(v);
  return *this;
}
Json& Json::null() {
  place(nullptr);
  return *this;
}

const std::string& Json::text() const {
  const Impl& m = *impl_;
  if (!m.done)
    throw Error("json", "the document is incomplete", std::to_string(m.stack.size()) + " open");
  m.text = m.root.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
  return m.text;
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
