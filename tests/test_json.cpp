// The JSON writer of the reports (harness/json.hpp, over nlohmann-json): escaping of control
// characters, non-finite doubles as strings, doubles that read back exactly, insertion order,
// invalid UTF-8 replaced, and every misuse an m3::Error.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>

#include <nlohmann/json.hpp>

#include "error.hpp"
#include "json.hpp"

namespace {

using m3::harness::Json;

TEST(JsonWriter, EscapesNonFiniteOrderAndRoundTrips) {
  Json j;
  j.begin_object();
  j.key("z").str("tab\tquote\"back\\slash\x01nl\n");
  j.key("a").num(0.1);
  j.key("nan").num(std::numeric_limits<double>::quiet_NaN());
  j.key("inf").num(std::numeric_limits<double>::infinity());
  j.key("ninf").num(-std::numeric_limits<double>::infinity());
  j.key("big").num(std::uint64_t{18446744073709551615ull});
  j.key("neg").num(std::int64_t{-5});
  j.key("shape").begin_array().num(2).num(3).end_array();
  j.key("bad_utf8").str(std::string("x\xff") + "y");
  j.key("none").null();
  j.end_object();
  const std::string text = j.text();
  EXPECT_EQ(text.find('\t'), std::string::npos) << "a raw control character";
  EXPECT_NE(text.find("\\u0001"), std::string::npos) << text;
  const nlohmann::ordered_json back = nlohmann::ordered_json::parse(text);
  EXPECT_EQ(back.begin().key(), "z") << "keys keep the order written";
  EXPECT_EQ(back["z"], "tab\tquote\"back\\slash\x01nl\n");
  EXPECT_EQ(back["a"].get<double>(), 0.1) << "a double reads back to the same value";
  EXPECT_EQ(back["nan"], "nan");
  EXPECT_EQ(back["inf"], "inf");
  EXPECT_EQ(back["ninf"], "-inf");
  EXPECT_EQ(back["big"].get<std::uint64_t>(), 18446744073709551615ull);
  EXPECT_EQ(back["neg"].get<std::int64_t>(), -5);
  EXPECT_EQ(back["shape"], nlohmann::ordered_json::array({2, 3}));
  EXPECT_EQ(back["bad_utf8"], "x\xEF\xBF\xBDy") << "invalid UTF-8 becomes U+FFFD";
  EXPECT_TRUE(back["none"].is_null());
}

TEST(JsonWriter, MisuseIsAnError) {
  {
    Json j;
    j.begin_object();
    EXPECT_THROW(j.num(1.0), m3::Error);  // a value without a key
  }
  {
    Json j;
    j.begin_object().key("k").num(1.0);
    EXPECT_THROW(j.key("k"), m3::Error);  // a key twice
    EXPECT_THROW(j.end_array(), m3::Error);
    EXPECT_THROW(j.text(), m3::Error);  // not closed
  }
  {
    Json j;
    j.begin_array();
    EXPECT_THROW(j.key("k"), m3::Error);  // a key in an array
    j.end_array();
    EXPECT_THROW(j.begin_object(), m3::Error);  // a second top-level value
    EXPECT_EQ(j.text(), "[]\n");
  }
}

}  // namespace
