// harness/targets.hpp: issue 18's target lines of m3h bench, for figures on both sides of
// every target, the f16 line only with both dtypes, nothing without bf16, and the refusal of
// a non-positive or non-finite time. The figures of the last measured layer (PERF.md v22:
// bf16 6.489 / 2.179 ms, f16 6.878) give three "not met" lines with their margins.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "error.hpp"
#include "targets.hpp"

namespace m3::harness {
namespace {

TEST(Targets, MeasuredLayerIsShortOfEveryTargetByItsMargin) {
  const auto lines = target_lines(MarginalTimes{2.179, 6.489}, MarginalTimes{2.404, 6.878});
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0],
            "issue 18 target, bf16 marginal layer: fwd+bwd 6.489 ms against <= 3.70 ms (2x the "
            "official block's 7.43): not met, 2.789 ms over");
  EXPECT_EQ(lines[1],
            "issue 18 target, bf16 marginal layer: fwd 2.179 ms against <= 1.50 ms: not met, "
            "0.679 ms over");
  EXPECT_EQ(lines[2],
            "issue 18 target, f16 marginal layer: fwd+bwd 6.878 ms = 1.060x bf16's against <= "
            "1.05x: not met, 0.010x over");
}

TEST(Targets, FiguresWithinTheTargetsAreMet) {
  const auto lines = target_lines(MarginalTimes{1.5, 3.7}, MarginalTimes{1.6, 3.8});
  ASSERT_EQ(lines.size(), 3u);
  for (const std::string& l : lines) EXPECT_NE(l.find(": met"), std::string::npos) << l;
  EXPECT_EQ(lines[0].find("not met"), std::string::npos);
}

TEST(Targets, LinesNeedTheirFigures) {
  EXPECT_TRUE(target_lines(std::nullopt, MarginalTimes{2.0, 6.0}).empty());
  EXPECT_EQ(target_lines(MarginalTimes{2.0, 6.0}, std::nullopt).size(), 2u);
}

TEST(Targets, BadTimesAreRefused) {
  EXPECT_THROW(target_lines(MarginalTimes{0.0, 6.0}, std::nullopt), Error);
  EXPECT_THROW(target_lines(MarginalTimes{2.0, -1.0}, std::nullopt), Error);
  EXPECT_THROW(target_lines(MarginalTimes{2.0, 6.0}, MarginalTimes{NAN, 6.0}), Error);
  EXPECT_THROW(target_lines(MarginalTimes{2.0, 6.0}, MarginalTimes{2.0, INFINITY}), Error);
}

}  // namespace
}  // namespace m3::harness
