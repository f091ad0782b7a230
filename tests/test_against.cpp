// harness/against.hpp: another implementation's figures read from the file that names their
// source, every refusal of a bad file with its file:line, and the lines m3h bench prints
// beside its marginal layers (the ratios' directions: time theirs/ours, memory ours/theirs).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "against.hpp"
#include "error.hpp"

namespace m3::harness {
namespace {

const char* kGood =
    "# a comment\n"
    "name = other block\n"
    "\n"
    "measured = some card, 2026-12\n"
    "dtype = bf16\n"
    "fwd_ms = 2.6\n"
    "fwdbwd_ms = 7.4\n"
    "gib_per_layer = 1.25\n";

std::string refusal(const std::string& text) {
  try {
    parse_other_figures(text, "f.txt");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Against, ReadsEveryKey) {
  const OtherFigures f = parse_other_figures(kGood, "f.txt");
  EXPECT_EQ(f.file, "f.txt");
  EXPECT_EQ(f.name, "other block");
  EXPECT_EQ(f.measured, "some card, 2026-12");
  EXPECT_EQ(f.dtype, Precision::BF16);
  EXPECT_EQ(f.fwd_ms, 2.6);
  EXPECT_EQ(f.fwdbwd_ms, 7.4);
  EXPECT_EQ(f.gib_per_layer, 1.25);
}

TEST(Against, RefusesABadFileNamingTheLine) {
  const std::string good = kGood;
  auto with = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    t.replace(t.find(from), from.size(), to);
    return t;
  };
  EXPECT_NE(refusal(with("dtype = bf16\n", "")).find("missing key 'dtype'"), std::string::npos);
  EXPECT_NE(refusal(good + "dtype = f16\n").find("given twice"), std::string::npos);
  EXPECT_NE(refusal(good + "dtype = f16\n").find("f.txt:9"), std::string::npos);
  EXPECT_NE(refusal(with("name =", "nam =")).find("unknown key 'nam'"), std::string::npos);
  EXPECT_NE(refusal(with("name =", "name")).find("expected 'key = value'"), std::string::npos);
  EXPECT_NE(refusal(with("dtype = bf16", "dtype = f64")).find("f32, bf16 or f16"),
            std::string::npos);
  EXPECT_NE(refusal(with("dtype = bf16", "dtype = b16")).find("f.txt:5"), std::string::npos);
  for (const char* bad : {"0", "-1", "nan", "inf", "2.6ms", ""})
    EXPECT_NE(refusal(with("fwd_ms = 2.6", std::string("fwd_ms = ") + bad)).find("fwd_ms"),
              std::string::npos)
        << bad;
  EXPECT_NE(refusal(with("gib_per_layer = 1.25", "gib_per_layer = 0")).find("f.txt:8"),
            std::string::npos);
}

TEST(Against, AMissingFileIsRefused) {
  EXPECT_THROW(read_other_figures("/nonexistent/figures.txt"), Error);
}

TEST(Against, TheProjectsDataFilesRead) {
  const std::pair<const char*, const char*> files[] = {{"official-block-h200.txt", "H200"},
                                                       {"official-block-h100.txt", "H100"}};
  for (const auto& [name, card] : files) {
    const OtherFigures f = read_other_figures(std::string(M3_DOCS_DATA_DIR "/") + name);
    EXPECT_EQ(f.dtype, Precision::BF16) << name;
    EXPECT_GT(f.fwdbwd_ms, f.fwd_ms) << name;
    EXPECT_GT(f.gib_per_layer, 0.0) << name;
    EXPECT_NE(f.measured.find(card), std::string::npos) << name;
  }
}

TEST(Against, LinesNameTheSourceAndTheRatios) {
  const OtherFigures f = parse_other_figures(kGood, "f.txt");
  const auto lines = against_lines(f, {{"chunked rc=none", 1.3, 3.7, 2.5}});
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], "beside: other block (some card, 2026-12; figures from f.txt)");
  EXPECT_EQ(lines[1],
            "  bf16                   fwd 2.600 ms, fwd+bwd 7.400 ms, 1.250 GiB per further layer");
  EXPECT_EQ(lines[2],
            "  ours, chunked rc=none  fwd 1.300 ms (2.00x), fwd+bwd 3.700 ms (2.00x), 2.500 GiB "
            "per further layer (2.00x)");
  EXPECT_NE(lines[3].find("above 1 is faster"), std::string::npos);
}

TEST(Against, BadFiguresOfOursAreRefused) {
  const OtherFigures f = parse_other_figures(kGood, "f.txt");
  EXPECT_THROW(against_lines(f, {{"x", 0.0, 3.7, 2.5}}), Error);
  EXPECT_THROW(against_lines(f, {{"x", 1.0, NAN, 2.5}}), Error);
  EXPECT_THROW(against_lines(f, {{"x", 1.0, 3.7, -1.0}}), Error);
}

}  // namespace
}  // namespace m3::harness
