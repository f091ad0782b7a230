// The stage registry against what the reference actually captures.
//
// run_reference<double>(problem, mode) must capture EXACTLY expected_stage_keys(cfg, B, T, mode)
// ∪ expected_param_keys(cfg) — no missing key, no extra key, every shape as the registry
// resolves it — for both scan modes and for configs with/without is_outproj_norm, with
// num_rope_angles = 0 and with an identity input_proj. Stage tensors are captured in the
// registry's execution order (the harness names the first failing stage by that order).
// Registry names are unique per (stage, tensor); Capture rejects unknown keys and wrong sizes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "capture.hpp"
#include "error.hpp"
#include "problem.hpp"
#include "registry.hpp"
#include "test_util.hpp"

namespace {

using m3::Config;
using m3::Idx;
using m3::ScanMode;

struct RegCase {
  const char* name;
  Config cfg;
  Idx B, T;
};

std::vector<RegCase> reg_cases() {
  using m3::test::small_cfg;
  //          d_model hd ds ng  rf  outnorm L  cs  identity in
  return {
      {"base", small_cfg(4, 2, 4, 1, 0.5, false, 1, 4, false, 3), 2, 7},
      {"outproj_norm", small_cfg(4, 2, 4, 1, 0.5, true, 1, 3, false, 3), 2, 7},
      {"na0", small_cfg(4, 2, 3, 1, 0.5, false, 1, 4, false, 3), 2, 6},
      {"identity_input_proj", small_cfg(4, 2, 4, 1, 1.0, false, 1, 4, true), 1, 5},
      {"ng2_L2_outnorm_rope1", small_cfg(8, 2, 6, 2, 1.0, true, 2, 3, false, 5), 2, 10},
      {"chunk_gt_T", small_cfg(4, 2, 4, 1, 0.5, false, 1, 16, false, 3), 2, 5},
  };
}

struct RegParam {
  RegCase c;
  ScanMode mode;
};

std::vector<RegParam> reg_params() {
  std::vector<RegParam> out;
  for (const auto& c : reg_cases())
    for (auto m : {ScanMode::Sequential, ScanMode::Chunked}) out.push_back({c, m});
  return out;
}

class RegistryCapture : public ::testing::TestWithParam<RegParam> {};

TEST_P(RegistryCapture, CapturesExactlyTheRegistryKeysWithRegistryShapes) {
  const auto& [c, mode] = GetParam();
  const m3::Problem pb = m3::make_problem(c.cfg, c.B, c.T, 7, true);
  const m3::Capture cap = m3::run_reference<double>(pb, mode);

  std::map<std::string, std::vector<Idx>> expected;
  for (const auto& k : m3::expected_stage_keys(c.cfg, c.B, c.T, mode))
    ASSERT_TRUE(expected.emplace(k.key, k.shape).second) << "duplicate expected key " << k.key;
  for (const auto& k : m3::expected_param_keys(c.cfg))
    ASSERT_TRUE(expected.emplace(k.key, k.shape).second) << "duplicate expected key " << k.key;

  std::set<std::string> captured(cap.keys().begin(), cap.keys().end());
  EXPECT_EQ(captured.size(), cap.keys().size()) << "Capture::keys() lists a key twice";
  for (const auto& [key, shape] : expected) {
    const m3::Tensor* t = cap.find(key);
    if (!t) {
      ADD_FAILURE() << "missing capture '" << key << "' (" << c.cfg.describe() << ", mode "
                    << m3::scan_mode_name(mode) << ")";
      continue;
    }
    EXPECT_EQ(t->shape, shape) << key << ": captured " << m3::shape_str(t->shape)
                               << ", registry " << m3::shape_str(shape);
    EXPECT_EQ(static_cast<Idx>(t->data.size()), t->numel()) << key;
  }
  for (const auto& key : cap.keys())
    EXPECT_TRUE(expected.count(key)) << "unexpected capture '" << key << "' (mode "
                                     << m3::scan_mode_name(mode) << ")";
}

TEST_P(RegistryCapture, StageTensorsAreCapturedInRegistryExecutionOrder) {
  const auto& [c, mode] = GetParam();
  const m3::Problem pb = m3::make_problem(c.cfg, c.B, c.T, 7, true);
  const m3::Capture cap = m3::run_reference<double>(pb, mode);
  std::vector<std::string> want;
  for (const auto& k : m3::expected_stage_keys(c.cfg, c.B, c.T, mode)) want.push_back(k.key);
  std::vector<std::string> got;
  for (const auto& k : cap.keys())
    if (k.rfind("grad/", 0) != 0) got.push_back(k);
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    ASSERT_EQ(got[i], want[i]) << "stage capture #" << i << " out of registry order";
}

TEST_P(RegistryCapture, EveryCapturedValueIsFinite) {
  const auto& [c, mode] = GetParam();
  const m3::Problem pb = m3::make_problem(c.cfg, c.B, c.T, 7, true);
  const m3::Capture cap = m3::run_reference<double>(pb, mode);
  for (const auto& key : cap.keys()) {
    const auto& d = cap.at(key).data;
    const auto bad = std::find_if(d.begin(), d.end(), [](double v) { return !std::isfinite(v); });
    EXPECT_EQ(bad, d.end()) << key << " has a non-finite value at " << (bad - d.begin());
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, RegistryCapture, ::testing::ValuesIn(reg_params()),
                         [](const auto& info) {
                           return std::string(info.param.c.name) + "_" +
                                  m3::scan_mode_name(info.param.mode);
                         });

TEST(Registry, StageNamesAreUniquePerStageAndTensor) {
  std::set<std::pair<std::string, std::string>> seen;
  for (const auto& s : m3::stage_registry())
    EXPECT_TRUE(seen.emplace(s.stage, s.tensor).second)
        << "duplicate registry entry " << s.stage << "/" << s.tensor;
  EXPECT_GT(seen.size(), 50u);
}

TEST(Registry, ParamNamesAreUniqueAndInFlatGradientOrder) {
  const std::vector<std::string> want = {
      "input_proj_w",  "input_proj_b", "norm_weight", "in_proj_w",        "dt_bias",
      "b_norm_weight", "c_norm_weight", "b_bias",     "c_bias",           "d_param",
      "norm_gate_weight", "out_proj_w", "norm_f_weight"};
  std::vector<std::string> got;
  for (const auto& p : m3::param_registry()) got.push_back(p.name);
  EXPECT_EQ(got, want);
}

TEST(Registry, ExpectedParamKeysFollowForEachParamOrder) {
  for (bool identity : {false, true}) {
    const Config cfg = m3::test::small_cfg(4, 2, 4, 1, 0.5, false, 3, 4, identity);
    m3::Params<double> p = m3::zero_params<double>(cfg);
    std::vector<std::string> from_params;
    for (const auto& r : m3::test::param_refs(p)) from_params.push_back(r.key);
    std::vector<std::string> from_registry;
    for (const auto& k : m3::expected_param_keys(cfg)) from_registry.push_back(k.key);
    EXPECT_EQ(from_params, from_registry) << "identity=" << identity;
    // Sizes agree too.
    const auto keys = m3::expected_param_keys(cfg);
    const auto refs = m3::test::param_refs(p);
    ASSERT_EQ(keys.size(), refs.size());
    for (size_t i = 0; i < keys.size(); ++i) {
      Idx n = 1;
      for (Idx d : keys[i].shape) n *= d;
      EXPECT_EQ(static_cast<Idx>(refs[i].v->size()), n) << keys[i].key;
    }
  }
}

TEST(Registry, KeysNameLayerAndStage) {
  EXPECT_EQ(m3::stage_key(-1, "norm_f", "Out"), "norm_f/Out");
  EXPECT_EQ(m3::stage_key(3, "F6", "y"), "L3/F6/y");
  EXPECT_EQ(m3::param_key(-1, "norm_f_weight"), "grad/norm_f_weight");
  EXPECT_EQ(m3::param_key(0, "in_proj_w"), "grad/L0/in_proj_w");
}

TEST(Registry, ExistenceFollowsModeAndConfig) {
  Config cfg = m3::test::small_cfg(4, 2, 3, 1, 0.5, false);  // na = 0, no outproj norm
  ASSERT_EQ(cfg.num_rope_angles(), 0);
  auto has = [&](ScanMode mode, const std::string& key) {
    for (const auto& k : m3::expected_stage_keys(cfg, 2, 5, mode))
      if (k.key == key) return true;
    return false;
  };
  for (auto m : {ScanMode::Sequential, ScanMode::Chunked}) {
    EXPECT_FALSE(has(m, "L0/F5/angle_cumsum"));
    EXPECT_FALSE(has(m, "L0/states/angle_state"));
    EXPECT_FALSE(has(m, "L0/F7/gated_rms_vals"));
    EXPECT_TRUE(has(m, "L0/F6/y"));
    EXPECT_TRUE(has(m, "norm_f/Out"));
  }
  EXPECT_TRUE(has(ScanMode::Sequential, "L0/F6/h_saved"));
  EXPECT_FALSE(has(ScanMode::Chunked, "L0/F6/h_saved"));
  EXPECT_TRUE(has(ScanMode::Chunked, "L0/F6/chunk_states_saved"));
  EXPECT_FALSE(has(ScanMode::Sequential, "L0/F6/chunk_states_saved"));
  cfg.is_outproj_norm = true;
  cfg.d_state = 4;
  EXPECT_TRUE(has(ScanMode::Chunked, "L0/F7/gated_rms_vals"));
  EXPECT_TRUE(has(ScanMode::Chunked, "L0/F5/angle_cumsum"));
}

TEST(Registry, FindSpecRejectsUnknownNames) {
  EXPECT_NO_THROW(m3::find_spec("F6", "y"));
  EXPECT_TRUE(m3::find_spec("F5", "angle_cumsum").circular);
  EXPECT_TRUE(m3::find_spec("states", "angle_state").circular);
  EXPECT_FALSE(m3::find_spec("F6", "y").circular);
  EXPECT_THROW(m3::find_spec("F6", "nope"), m3::Error);
  EXPECT_THROW(m3::find_spec("F99", "y"), m3::Error);
}

// ---- Capture checks its input --------------------------------------------------------------

TEST(Capture, RejectsUnknownStageKey) {
  const Config cfg = m3::test::small_cfg();
  m3::Capture cap(cfg, 2, 5);
  const std::vector<double> data(1000, 1.0);
  try {
    cap.put_stage(0, "F1", "no_such_tensor", data.data(), 10);
    ADD_FAILURE() << "put_stage accepted an unknown tensor";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("F1/no_such_tensor"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cap.put_stage(0, "F42", "residual", data.data(), 10), m3::Error);
  EXPECT_TRUE(cap.keys().empty());
}

TEST(Capture, RejectsWrongSizeNamingKeyAndShape) {
  const Config cfg = m3::test::small_cfg();
  const Idx B = 2, T = 5;
  m3::Capture cap(cfg, B, T);
  const std::vector<float> data(1000, 1.0f);
  try {
    cap.put_stage(1, "F1", "rms_vals", data.data(), B * T + 1);
    ADD_FAILURE() << "put_stage accepted a wrong size";
  } catch (const m3::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("L1/F1/rms_vals"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[10]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("got 11"), std::string::npos) << msg;
  }
  EXPECT_THROW(cap.put_stage(0, "F6", "y", data.data(), B * T * cfg.d_inner() - 1), m3::Error);
  EXPECT_FALSE(cap.has("L0/F6/y"));
  // The right size is accepted, widened to double, shaped by the registry.
  cap.put_stage(0, "F6", "y", data.data(), B * T * cfg.d_inner());
  ASSERT_TRUE(cap.has("L0/F6/y"));
  EXPECT_EQ(cap.at("L0/F6/y").shape,
            (std::vector<Idx>{B * T, cfg.nheads(), cfg.headdim}));
  EXPECT_EQ(cap.at("L0/F6/y").data[0], 1.0);
}

TEST(Capture, UnboundCaptureRejectsStageTensors) {
  m3::Capture cap;
  const std::vector<double> data(10, 0.0);
  EXPECT_THROW(cap.put_stage(0, "F1", "rms_vals", data.data(), 10), m3::Error);
}

TEST(Capture, AtNamesMissingKey) {
  m3::Capture cap;
  EXPECT_EQ(cap.find("nope"), nullptr);
  try {
    cap.at("L0/F6/y");
    ADD_FAILURE() << "at() returned a missing key";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("L0/F6/y"), std::string::npos) << e.what();
  }
}

}  // namespace
