// The message of the m3::Error that f throws; a test failure (and "") when it throws none. The
// tests of one-line errors read it: EXPECT_NE(error_of([&] { … }).find("…"), npos).
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "error.hpp"

namespace m3::test {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const m3::Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no m3::Error thrown";
  return "";
}

}  // namespace m3::test
