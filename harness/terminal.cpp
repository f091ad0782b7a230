// The terminal's width and word wrapping (see terminal.hpp).
#include "terminal.hpp"

#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstdlib>

namespace m3::harness {

int terminal_columns(int fd) {
  if (const char* env = std::getenv("COLUMNS")) {
    errno = 0;
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (errno == 0 && end != env && *end == '\0' && v > 0 && v < 100000) return static_cast<int>(v);
  }
  struct winsize ws {};
  if (isatty(fd) && ioctl(fd, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0) return ws.ws_col;
  return kDefaultColumns;
}

std::string wrap_words(const std::string& text, int width, int indent) {
  if (width <= 0 || static_cast<int>(text.size()) <= width) return text;
  const std::string pad(static_cast<std::size_t>(std::clamp(indent, 0, width - 1)), ' ');
  std::string out;
  std::size_t pos = 0;  // the start of the text not yet placed
  while (pos < text.size()) {
    const bool first = out.empty();
    const std::size_t room = static_cast<std::size_t>(width) - (first ? 0 : pad.size());
    if (!first) out += "\n" + pad;
    if (text.size() - pos <= room) {
      out += text.substr(pos);
      break;
    }
    // Break at the last run of spaces that starts after a word and within the room; without
    // one, after the first word, however long. The spaces of the break are dropped; every
    // other run of spaces (an aligned column) is kept.
    const std::size_t word = text.find_first_not_of(' ', pos);
    std::size_t cut = text.rfind(' ', pos + room);
    while (cut != std::string::npos && cut > word && text[cut - 1] == ' ') --cut;
    if (cut == std::string::npos || cut <= word) cut = text.find(' ', word);
    if (cut == std::string::npos) {
      out += text.substr(pos);
      break;
    }
    out += text.substr(pos, cut - pos);
    pos = text.find_first_not_of(' ', cut);
    if (pos == std::string::npos) break;
  }
  return out;
}

}  // namespace m3::harness
