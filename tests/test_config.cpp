// Config::validate(), the derived dimensions of MODEL.md §1.2, parse_scan_mode and
// validate_run. Every rule of reference/config.cpp has a failing case whose m3::Error names the
// field and the rule; valid configs include the official shape (headdim 64, d_state 128) and
// configs with num_rope_angles = 0.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "config.hpp"
#include "error.hpp"

namespace {

using m3::Config;
using m3::Idx;

// A small valid config; each failing case breaks exactly one rule of it.
Config small_config() {
  Config c;
  c.d_model = 8;
  c.expand = 2;
  c.headdim = 4;
  c.d_state = 8;
  c.ngroups = 2;
  c.n_layers = 2;
  c.rope_fraction = 0.5;
  c.a_floor = 1e-4;
  c.input_dim = 5;
  c.input_proj_identity = false;
  c.chunk_size = 4;
  return c;
}

// Runs cfg.validate() and returns the m3::Error message; fails the test if nothing is thrown.
std::string validate_error(const Config& cfg) {
  try {
    cfg.validate();
  } catch (const m3::Error& e) {
    EXPECT_EQ(e.where(), "config");
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "validate() threw a non-m3 exception: " << e.what();
    return {};
  }
  ADD_FAILURE() << "validate() accepted an invalid config: " << cfg.describe();
  return {};
}

struct InvalidCase {
  const char* name;
  void (*mutate)(Config&);
  std::vector<const char*> must_contain;  // field name, rule, offending value
};

class ConfigInvalid : public ::testing::TestWithParam<InvalidCase> {};

TEST_P(ConfigInvalid, ThrowsNamingFieldAndRule) {
  Config cfg = small_config();
  ASSERT_NO_THROW(cfg.validate());
  GetParam().mutate(cfg);
  const std::string msg = validate_error(cfg);
  for (const char* s : GetParam().must_contain)
    EXPECT_NE(msg.find(s), std::string::npos) << "message '" << msg << "' lacks '" << s << "'";
}

const InvalidCase kInvalidCases[] = {
    {"d_model_zero", [](Config& c) { c.d_model = 0; }, {"d_model", ">= 1", "d_model=0"}},
    {"d_model_negative", [](Config& c) { c.d_model = -3; }, {"d_model", ">= 1", "d_model=-3"}},
    {"expand_zero", [](Config& c) { c.expand = 0; }, {"expand", ">= 1", "expand=0"}},
    {"headdim_zero", [](Config& c) { c.headdim = 0; }, {"headdim", ">= 1", "headdim=0"}},
    {"d_state_zero", [](Config& c) { c.d_state = 0; }, {"d_state", ">= 1", "d_state=0"}},
    {"n_layers_zero", [](Config& c) { c.n_layers = 0; }, {"n_layers", ">= 1", "n_layers=0"}},
    {"d_inner_not_multiple_of_headdim", [](Config& c) { c.headdim = 3; },
     {"d_inner", "multiple of headdim", "d_inner=expand*d_model=16", "headdim=3"}},
    {"headdim_larger_than_d_inner", [](Config& c) { c.headdim = 32; },
     {"d_inner", "multiple of headdim", "headdim=32"}},
    {"ngroups_zero", [](Config& c) { c.ngroups = 0; }, {"ngroups", ">= 1", "ngroups=0"}},
    {"ngroups_does_not_divide_nheads", [](Config& c) { c.ngroups = 3; },
     {"ngroups", "divide nheads", "nheads=4", "ngroups=3"}},
    {"ngroups_larger_than_nheads", [](Config& c) { c.ngroups = 8; },
     {"ngroups", "divide nheads", "nheads=4", "ngroups=8"}},
    {"rope_fraction_quarter", [](Config& c) { c.rope_fraction = 0.25; },
     {"rope_fraction", "0.5 or 1.0", "rope_fraction=0.25"}},
    {"rope_fraction_zero", [](Config& c) { c.rope_fraction = 0.0; },
     {"rope_fraction", "0.5 or 1.0"}},
    {"rope_fraction_almost_half", [](Config& c) { c.rope_fraction = 0.5000001; },
     {"rope_fraction", "0.5 or 1.0"}},
    {"rope_fraction_nan",
     [](Config& c) { c.rope_fraction = std::numeric_limits<double>::quiet_NaN(); },
     {"rope_fraction", "0.5 or 1.0"}},
    {"a_floor_zero", [](Config& c) { c.a_floor = 0.0; }, {"a_floor", "finite and > 0", "a_floor=0"}},
    {"a_floor_negative", [](Config& c) { c.a_floor = -1e-4; }, {"a_floor", "finite and > 0"}},
    {"a_floor_nan", [](Config& c) { c.a_floor = std::numeric_limits<double>::quiet_NaN(); },
     {"a_floor", "finite and > 0"}},
    {"a_floor_inf", [](Config& c) { c.a_floor = std::numeric_limits<double>::infinity(); },
     {"a_floor", "finite and > 0"}},
    {"chunk_size_zero", [](Config& c) { c.chunk_size = 0; },
     {"chunk_size", ">= 1", "chunk_size=0"}},
    {"input_dim_zero", [](Config& c) { c.input_dim = 0; }, {"input_dim", ">= 1", "input_dim=0"}},
    {"identity_input_proj_with_input_dim_not_d_model",
     [](Config& c) { c.input_proj_identity = true; },
     {"input_dim", "equal d_model", "input_proj_identity", "input_dim=5", "d_model=8"}},
};

INSTANTIATE_TEST_SUITE_P(Rules, ConfigInvalid, ::testing::ValuesIn(kInvalidCases),
                         [](const auto& info) { return std::string(info.param.name); });

// Rule "2*num_rope_angles must not exceed d_state" (config.cpp) cannot fail once
// rope_fraction ∈ {0.5, 1.0} has passed: 2·floor(floor(ds·rf)/2) ≤ floor(ds·rf) ≤ ds.
// This test pins that reasoning over a range of d_state so the rule stays a pure safety net.
TEST(ConfigRules, RopeAngleRuleHoldsForEveryValidRopeFraction) {
  for (double rf : {0.5, 1.0})
    for (Idx ds = 1; ds <= 260; ++ds) {
      Config c = small_config();
      c.d_state = ds;
      c.rope_fraction = rf;
      EXPECT_LE(2 * c.num_rope_angles(), ds) << "rf=" << rf << " ds=" << ds;
      EXPECT_NO_THROW(c.validate()) << c.describe();
    }
}

TEST(ConfigValid, DefaultConfigIsValid) { EXPECT_NO_THROW(Config{}.validate()); }

TEST(ConfigValid, OfficialShapeHeaddim64DState128) {
  Config c;
  c.d_model = 256;
  c.expand = 2;
  c.headdim = 64;
  c.d_state = 128;
  c.ngroups = 1;
  c.n_layers = 2;
  c.input_dim = 256;
  c.input_proj_identity = true;
  ASSERT_NO_THROW(c.validate());
  EXPECT_EQ(c.d_inner(), 512);
  EXPECT_EQ(c.nheads(), 8);
  EXPECT_EQ(c.num_rope_angles(), 32);
  EXPECT_EQ(c.in_proj_dim(), 2 * 512 + 2 * 128 + 3 * 8 + 32);
  EXPECT_EQ(c.heads_per_group(), 8);
  c.rope_fraction = 1.0;
  ASSERT_NO_THROW(c.validate());
  EXPECT_EQ(c.num_rope_angles(), 64);
}

TEST(ConfigValid, LargeDimsBeyondMambaRsLimitsAreAccepted) {
  // MODEL.md §12.7: the reference is dimension-agnostic (no hd ≤ 32, ds ≤ 64, hd·ds ≤ 1024).
  Config c;
  c.d_model = 2048;
  c.expand = 2;
  c.headdim = 128;
  c.d_state = 128;
  c.ngroups = 4;
  c.input_dim = 7;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.nheads(), 32);
  EXPECT_EQ(c.heads_per_group(), 8);
}

TEST(ConfigValid, NonPowerOfTwoHeaddimAndOddDims) {
  Config c = small_config();
  c.d_model = 6;
  c.expand = 1;
  c.headdim = 3;
  c.d_state = 5;
  c.ngroups = 1;
  EXPECT_NO_THROW(c.validate());
  EXPECT_EQ(c.nheads(), 2);
  EXPECT_EQ(c.num_rope_angles(), 1);  // floor(floor(2.5)/2) = 1
}

struct RopeCase {
  Idx d_state;
  double rope_fraction;
  Idx expected_na;
};

class ConfigRopeAngles : public ::testing::TestWithParam<RopeCase> {};

TEST_P(ConfigRopeAngles, NumRopeAnglesIsFloorOfFloorHalf) {
  Config c = small_config();
  c.d_state = GetParam().d_state;
  c.rope_fraction = GetParam().rope_fraction;
  ASSERT_NO_THROW(c.validate()) << c.describe();
  EXPECT_EQ(c.num_rope_angles(), GetParam().expected_na);
  EXPECT_EQ(c.in_proj_dim(),
            2 * c.d_inner() + 2 * c.ngroups * c.d_state + 3 * c.nheads() + GetParam().expected_na);
}

const RopeCase kRopeCases[] = {
    {1, 0.5, 0},  {2, 0.5, 0},   {3, 0.5, 0},   {4, 0.5, 1},    {5, 0.5, 1},   {6, 0.5, 1},
    {7, 0.5, 1},  {8, 0.5, 2},   {16, 0.5, 4},  {128, 0.5, 32}, {1, 1.0, 0},   {2, 1.0, 1},
    {3, 1.0, 1},  {5, 1.0, 2},   {16, 1.0, 8},  {64, 1.0, 32},  {128, 1.0, 64},
};

INSTANTIATE_TEST_SUITE_P(Derived, ConfigRopeAngles, ::testing::ValuesIn(kRopeCases),
                         [](const auto& info) {
                           return "ds" + std::to_string(info.param.d_state) + "_rf" +
                                  (info.param.rope_fraction == 0.5 ? "05" : "10") + "_na" +
                                  std::to_string(info.param.expected_na);
                         });

TEST(ConfigDerived, NChunksIsCeilOfTOverChunkSize) {
  Config c = small_config();
  c.chunk_size = 4;
  EXPECT_EQ(c.n_chunks(1), 1);
  EXPECT_EQ(c.n_chunks(4), 1);
  EXPECT_EQ(c.n_chunks(5), 2);
  EXPECT_EQ(c.n_chunks(13), 4);
  c.chunk_size = 64;
  EXPECT_EQ(c.n_chunks(13), 1);
  EXPECT_EQ(c.n_chunks(64), 1);
  EXPECT_EQ(c.n_chunks(65), 2);
  c.chunk_size = 1;
  EXPECT_EQ(c.n_chunks(13), 13);
}

TEST(ConfigDerived, DescribeNamesEveryField) {
  const std::string d = small_config().describe();
  for (const char* f : {"d_model=8", "d_state=8", "expand=2", "headdim=4", "ngroups=2",
                        "n_layers=2", "rope_fraction=0.5", "a_floor=", "is_outproj_norm=0",
                        "input_dim=5", "input_proj_identity=0", "chunk_size=4", "d_inner=16",
                        "nheads=4", "num_rope_angles=2", "in_proj_dim="})
    EXPECT_NE(d.find(f), std::string::npos) << "describe() '" << d << "' lacks '" << f << "'";
}

TEST(ScanMode, ParsesAcceptedSpellings) {
  EXPECT_EQ(m3::parse_scan_mode("seq"), m3::ScanMode::Sequential);
  EXPECT_EQ(m3::parse_scan_mode("sequential"), m3::ScanMode::Sequential);
  EXPECT_EQ(m3::parse_scan_mode("chunked"), m3::ScanMode::Chunked);
  EXPECT_EQ(m3::parse_scan_mode("chunk"), m3::ScanMode::Chunked);
  EXPECT_STREQ(m3::scan_mode_name(m3::ScanMode::Sequential), "seq");
  EXPECT_STREQ(m3::scan_mode_name(m3::ScanMode::Chunked), "chunked");
  // The name round-trips through the parser.
  for (auto m : {m3::ScanMode::Sequential, m3::ScanMode::Chunked})
    EXPECT_EQ(m3::parse_scan_mode(m3::scan_mode_name(m)), m);
}

TEST(ScanMode, RejectsUnknownSpellingsWithMessage) {
  for (const char* s : {"", "Seq", "SEQ", "parallel", "chunked ", "scan"}) {
    try {
      m3::parse_scan_mode(s);
      ADD_FAILURE() << "parse_scan_mode accepted '" << s << "'";
    } catch (const m3::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("unknown scan mode '" + std::string(s) + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find("expected seq or chunked"), std::string::npos) << msg;
    }
  }
}

TEST(ValidateRun, AcceptsPositiveShape) {
  EXPECT_NO_THROW(m3::validate_run(small_config(), 1, 1));
  EXPECT_NO_THROW(m3::validate_run(small_config(), 3, 257));
}

TEST(ValidateRun, RejectsZeroOrNegativeBatch) {
  for (Idx B : {Idx(0), Idx(-1)}) {
    try {
      m3::validate_run(small_config(), B, 8);
      ADD_FAILURE() << "validate_run accepted B=" << B;
    } catch (const m3::Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.where(), "run shape");
      EXPECT_NE(msg.find("batch B must be >= 1"), std::string::npos) << msg;
      EXPECT_NE(msg.find("B=" + std::to_string(B)), std::string::npos) << msg;
    }
  }
}

TEST(ValidateRun, RejectsZeroOrNegativeSequenceLength) {
  for (Idx T : {Idx(0), Idx(-5)}) {
    try {
      m3::validate_run(small_config(), 2, T);
      ADD_FAILURE() << "validate_run accepted T=" << T;
    } catch (const m3::Error& e) {
      const std::string msg = e.what();
      EXPECT_EQ(e.where(), "run shape");
      EXPECT_NE(msg.find("sequence length T must be >= 1"), std::string::npos) << msg;
      EXPECT_NE(msg.find("T=" + std::to_string(T)), std::string::npos) << msg;
    }
  }
}

TEST(ValidateRun, ChecksTheConfigFirst) {
  Config c = small_config();
  c.ngroups = 3;
  try {
    m3::validate_run(c, 2, 8);
    ADD_FAILURE() << "validate_run accepted an invalid config";
  } catch (const m3::Error& e) {
    EXPECT_EQ(e.where(), "config");
    EXPECT_NE(std::string(e.what()).find("ngroups must divide nheads"), std::string::npos);
  }
}

TEST(ErrorType, WhatJoinsWhereWhatWhy) {
  const m3::Error e("stage F6", "shape mismatch", m3::why("got ", 3, ", expected ", 4));
  EXPECT_STREQ(e.what(), "stage F6: shape mismatch (got 3, expected 4)");
  EXPECT_EQ(e.where(), "stage F6");
  EXPECT_EQ(e.failed(), "shape mismatch");
  EXPECT_EQ(e.why(), "got 3, expected 4");
  const m3::Error bare("w", "x", "");
  EXPECT_STREQ(bare.what(), "w: x");
}

}  // namespace
