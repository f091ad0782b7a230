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

// User text for a one-line message: control characters as \xNN, at most `max` characters,
// then "... (N bytes)" — so a name or a line read from a file never breaks or floods the line.
inline std::string escape_for_message(const std::string& text, std::size_t max) {
  std::string out;
  std::size_t shown = 0;
  for (unsigned char c : text) {
    if (shown == max) {
      out += "... (" + std::to_string(text.size()) + " bytes)";
      break;
    }
    if (c < 0x20 || c == 0x7f) {
      static const char* const kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
    ++shown;
  }
  return out;
}

}  // namespace m3

// Throws m3::Error(where, #cond-style text, why) when cond is false.
#define M3_REQUIRE(cond, where, what, ...)                   \
  do {                                                       \
    if (!(cond)) throw ::m3::Error((where), (what), ::m3::why(__VA_ARGS__)); \
  } while (0)
