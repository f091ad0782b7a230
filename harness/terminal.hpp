// Fitting text to the terminal it is printed on: the width in columns, and long lines broken
// at spaces.
//
//   terminal_columns(fd)  COLUMNS when it is set to a positive integer (a user's or a test's
//                         choice wins), else the terminal's width (ioctl TIOCGWINSZ) when fd is
//                         a terminal, else kDefaultColumns: a log or a pipe gets lines that
//                         fit a common window.
//   wrap_words(text, w, indent)
//                         text broken at spaces into lines of at most w columns (a word
//                         longer than a line keeps a line of its own, uncut), the lines after
//                         the first indented by `indent` spaces; w <= 0 leaves the text alone.
//                         Columns are counted as bytes: the text here is ASCII.
#pragma once

#include <string>

namespace m3::harness {

constexpr int kDefaultColumns = 100;

int terminal_columns(int fd);

std::string wrap_words(const std::string& text, int width, int indent);

}  // namespace m3::harness
