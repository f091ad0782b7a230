// The one exception type of the project: every library throws m3::Error, never exits.
//
// An Error carries three parts: WHERE it was raised (a function or stage name), WHAT failed
// (the check or operation) and WHY (the values that made it fail). what() joins them on one
// line — "where: what (why)" — which is exactly what a tool prints before exiting non-zero.
#pragma once

#include <cstddef>
#include <sstream>
#include <stdexcept>
#include <string>

namespace m3 {

class Error : public std::runtime_error {
 public:
  Error(std::string where, std::string what, std::string why)
      : std::runtime_error(join(where, what, why)),
        where_(std::move(where)),
        what_(std::move(what)),
        why_(std::move(why)) {}

  const std::string& where() const { return where_; }
  const std::string& failed() const { return what_; }
  const std::string& why() const { return why_; }

 private:
  static std::string join(const std::string& where, const std::string& what,
                          const std::string& why) {
    std::string s = where + ": " + what;
    if (!why.empty()) s += " (" + why + ")";
    return s;
  }
  std::string where_, what_, why_;
};

// Builds the "why" text from streamable pieces: m3::why("got ", n, ", expected ", m).
template <class... Args>
std::string why(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// One byte of user text for a terminal: a control character (C0 or DEL) as \xNN, since it
// could move the cursor, recolour or clear the screen, or break a one-line message.
inline void append_escaped(std::string& out, unsigned char c) {
  if (c < 0x20 || c == 0x7f) {
    static const char* const kHex = "0123456789abcdef";
    out += "\\x";
    out += kHex[c >> 4];
    out += kHex[c & 15];
  } else {
    out += static_cast<char>(c);
  }
}

// User text for a one-line message: control characters as \xNN; text longer than `max`
// characters keeps its first and last max/2 with "…(N bytes)…" between them — so a name or a
// line read from a file never breaks or floods the line, and what follows a long name in a
// message (the reason) stays visible.
inline std::string escape_for_message(const std::string& text, std::size_t max) {
  std::string out;
  if (text.size() <= max) {
    for (unsigned char c : text) append_escaped(out, c);
    return out;
  }
  const std::size_t head = max - max / 2, tail = max / 2;
  for (std::size_t i = 0; i < head; ++i) append_escaped(out, static_cast<unsigned char>(text[i]));
  out += "\u2026(" + std::to_string(text.size()) + " bytes)\u2026";
  for (std::size_t i = text.size() - tail; i < text.size(); ++i)
    append_escaped(out, static_cast<unsigned char>(text[i]));
  return out;
}

// Text of many lines for a terminal (generated text): as escape_for_message, but newlines and
// tabs kept and nothing cut.
inline std::string escape_for_terminal(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (c == '\n' || c == '\t') out += static_cast<char>(c);
    else append_escaped(out, c);
  }
  return out;
}

}  // namespace m3

// Throws m3::Error(where, #cond-style text, why) when cond is false.
#define M3_REQUIRE(cond, where, what, ...)                   \
  do {                                                       \
    if (!(cond)) throw ::m3::Error((where), (what), ::m3::why(__VA_ARGS__)); \
  } while (0)
