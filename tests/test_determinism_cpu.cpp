// The CPU reference is deterministic (MODEL.md §7.5: single-threaded, fixed loop orders): two
// runs of run_reference<double> and of run_reference<float> on the same Problem give the same
// keys in the same order and bit-identical data (memcmp) for every captured tensor, in both
// scan modes. A third run on a separately built Problem of the same seed must match as well
// (the seeded generators are pure functions of the seed).
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "problem.hpp"
#include "test_util.hpp"

namespace {

using m3::Config;
using m3::ScanMode;

struct DetParam {
  ScanMode mode;
  bool use_float;
};

void expect_bit_identical(const m3::Capture& a, const m3::Capture& b) {
  ASSERT_EQ(a.keys(), b.keys());
  for (const auto& key : a.keys()) {
    const m3::Tensor& x = a.at(key);
    const m3::Tensor& y = b.at(key);
    ASSERT_EQ(x.shape, y.shape) << key;
    ASSERT_EQ(x.data.size(), y.data.size()) << key;
    EXPECT_EQ(std::memcmp(x.data.data(), y.data.data(), x.data.size() * sizeof(double)), 0)
        << key << " differs between two runs";
  }
}

class DeterminismCpu : public ::testing::TestWithParam<DetParam> {};

TEST_P(DeterminismCpu, TwoRunsAreBitIdentical) {
  const auto [mode, use_float] = GetParam();
  const Config cfg = m3::test::small_cfg(16, 4, 8, 2, 1.0, true, 2, 5, false, 6);
  const m3::Problem pb = m3::make_problem(cfg, 2, 23, 89, true);
  const m3::Problem pb2 = m3::make_problem(cfg, 2, 23, 89, true);
  auto run = [&](const m3::Problem& p) {
    return use_float ? m3::run_reference<float>(p, mode) : m3::run_reference<double>(p, mode);
  };
  const m3::Capture a = run(pb);
  const m3::Capture b = run(pb);
  const m3::Capture c = run(pb2);
  EXPECT_GT(a.keys().size(), 60u);
  expect_bit_identical(a, b);
  expect_bit_identical(a, c);
}

INSTANTIATE_TEST_SUITE_P(Modes, DeterminismCpu,
                         ::testing::Values(DetParam{ScanMode::Sequential, false},
                                           DetParam{ScanMode::Chunked, false},
                                           DetParam{ScanMode::Sequential, true},
                                           DetParam{ScanMode::Chunked, true}),
                         [](const auto& info) {
                           return std::string(m3::scan_mode_name(info.param.mode)) + "_" +
                                  (info.param.use_float ? "float" : "double");
                         });

}  // namespace
