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
      "norm_gate_weight", "out_proj_w", "norm_f_weight", "head_w"};
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

// ---- production lifetimes (registry.hpp Life) and the flat parameter layout ------------------

// Every layer tensor has a lifetime in both modes under both recompute policies (the table
// names only registry tensors: lifetime() checks it), only forward tensors outlive their pass,
// and the recompute policy moves exactly the chunked scan's prep outputs and states.
TEST(Registry, LifetimesCoverEveryLayerTensorAndKeepOnlyForwardTensors) {
  std::set<std::string> moved;
  for (const auto& s : m3::stage_registry()) {
    if (s.scope != m3::Scope::Layer) {
      EXPECT_THROW(m3::lifetime(s, ScanMode::Chunked, m3::Recompute::None), m3::Error)
          << s.stage << "/" << s.tensor;
      continue;
    }
    for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked})
      for (m3::Recompute rc : {m3::Recompute::None, m3::Recompute::Scan}) {
        const m3::Life life = m3::lifetime(s, mode, rc);
        if (s.dir == m3::Dir::Backward) {
          EXPECT_TRUE(life == m3::Life::Workspace || life == m3::Life::Verify ||
                      life == m3::Life::Columns)
              << s.stage << "/" << s.tensor << " is " << m3::life_name(life);
        }
      }
    const m3::Life none = m3::lifetime(s, ScanMode::Chunked, m3::Recompute::None);
    const m3::Life scan = m3::lifetime(s, ScanMode::Chunked, m3::Recompute::Scan);
    if (none != scan) {
      EXPECT_EQ(none, m3::Life::Saved) << s.tensor;
      EXPECT_EQ(scan, m3::Life::Workspace) << s.tensor;
      moved.insert(s.tensor);
    }
    EXPECT_EQ(m3::lifetime(s, ScanMode::Sequential, m3::Recompute::None),
              m3::lifetime(s, ScanMode::Sequential, m3::Recompute::Scan))
        << s.tensor << ": the recompute policy is the chunked mode's";
  }
  const std::set<std::string> expected = {"q", "k_scaled_saved", "qk_dot_saved", "scale_saved",
                                          "gamma_saved", "da_cumsum_saved", "chunk_states_saved"};
  EXPECT_EQ(moved, expected);
  EXPECT_EQ(m3::parse_recompute("scan"), m3::Recompute::Scan);
  EXPECT_EQ(m3::parse_recompute("none"), m3::Recompute::None);
  EXPECT_THROW(m3::parse_recompute("all"), m3::Error);
}

// layer_bytes adds up to the layer's tensors, and at the official shape (bf16, chunked) the
// production layout keeps ≤ 1.0 GiB per further layer with the scan
// recomputed (the official block: 1.34), and what it costs without.
TEST(Registry, LayerBytesSumTheLayerTensorsAndMeetTheOfficialShapeTarget) {
  for (const auto& rc : reg_cases())
    for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked})
      for (m3::Precision p : {m3::Precision::F32, m3::Precision::BF16}) {
        std::size_t all = 0;
        for (const auto& s : m3::stage_registry()) {
          if (s.scope != m3::Scope::Layer || !m3::exists_in(s, rc.cfg, mode)) continue;
          Idx n = 1;
          for (Idx v : m3::resolve_shape(s.shape, rc.cfg, rc.B, rc.T)) n *= v;
          all += static_cast<std::size_t>(n) * (s.typed && p == m3::Precision::BF16 ? 2 : 4);
        }
        const m3::LayerBytes b = m3::layer_bytes(rc.cfg, rc.B, rc.T, mode, p, m3::Recompute::Scan);
        EXPECT_EQ(b.saved + b.view + b.columns + b.workspace + b.verify, all) << rc.name;
        // Per tensor: every layer tensor of the run once, its bytes and lifetime as counted.
        std::size_t per_tensor = 0, saved = 0;
        for (const m3::LayerTensorBytes& t :
             m3::layer_tensor_bytes(rc.cfg, rc.B, rc.T, mode, p, m3::Recompute::Scan)) {
          per_tensor += t.bytes;
          if (t.life == m3::Life::Saved) saved += t.bytes;
          EXPECT_EQ(t.life, m3::lifetime(*t.spec, mode, m3::Recompute::Scan)) << t.spec->tensor;
        }
        EXPECT_EQ(per_tensor, all) << rc.name;
        EXPECT_EQ(saved, b.saved) << rc.name;
        EXPECT_GT(b.saved, 0u) << rc.name;
      }
  Config off;  // the official Mamba-3 shape (harness/presets.cpp "official")
  off.d_model = 1024;
  off.d_state = 128;
  off.headdim = 64;
  off.expand = 2;
  off.ngroups = 1;
  off.n_layers = 1;
  off.input_dim = 1024;
  off.chunk_size = 64;
  const double gib = 1024.0 * 1024.0 * 1024.0;
  const m3::LayerBytes scan =
      m3::layer_bytes(off, 8, 4096, ScanMode::Chunked, m3::Precision::BF16, m3::Recompute::Scan);
  const m3::LayerBytes none =
      m3::layer_bytes(off, 8, 4096, ScanMode::Chunked, m3::Precision::BF16, m3::Recompute::None);
  EXPECT_LE(scan.saved / gib, 1.0);
  EXPECT_GT(none.saved, scan.saved + (std::size_t(1) << 30))
      << "the scan recompute frees the 0.5 GiB of chunk states and the 0.5 GiB of q and Ks";
  // The layer's input is the previous layer's output: no bytes of its own.
  EXPECT_EQ(scan.view, std::size_t(8) * 4096 * 1024 * 4);
}

// The column views (Life::Columns): z, x, b_raw, c_raw are proj's typed columns and their
// gradients d_proj's, in both modes; the tensor they live in is saved (forward) or workspace
// (backward), so the split moves only the f32 parts; every other tensor is not a column view.
TEST(Registry, ColumnViewsAreTheSplitsTypedColumnsOfAKeptTensor) {
  Config cfg;
  cfg.d_model = 48;
  cfg.expand = 2;
  cfg.ngroups = 2;
  cfg.d_state = 16;
  const std::map<std::string, std::pair<std::string, Idx>> expected = {
      {"z", {"proj", 0}},         {"x", {"proj", 96}},          {"b_raw", {"proj", 192}},
      {"c_raw", {"proj", 224}},   {"d_z", {"d_proj", 0}},       {"d_x", {"d_proj", 96}},
      {"d_b_raw", {"d_proj", 192}}, {"d_c_raw", {"d_proj", 224}}};
  std::set<std::string> seen;
  for (const auto& s : m3::stage_registry()) {
    if (s.scope != m3::Scope::Layer) continue;
    for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
      const m3::Life life = m3::lifetime(s, mode, m3::Recompute::Scan);
      const auto it = expected.find(s.tensor);
      if (it == expected.end()) {
        EXPECT_NE(life, m3::Life::Columns) << s.tensor;
        EXPECT_THROW(m3::column_view(s, cfg), m3::Error) << s.tensor;
        continue;
      }
      seen.insert(s.tensor);
      EXPECT_EQ(life, m3::Life::Columns) << s.tensor;
      const m3::ColumnView cv = m3::column_view(s, cfg);
      EXPECT_EQ(cv.tensor, it->second.first) << s.tensor;
      EXPECT_EQ(cv.first, it->second.second) << s.tensor;
      const m3::TensorSpec& of = m3::find_spec(cv.stage, cv.tensor);
      EXPECT_EQ(of.dir, s.dir) << s.tensor;
      EXPECT_EQ(m3::lifetime(of, mode, m3::Recompute::Scan),
                s.dir == m3::Dir::Forward ? m3::Life::Saved : m3::Life::Workspace)
          << s.tensor;
    }
  }
  EXPECT_EQ(seen.size(), expected.size());
}

// The flat parameter layout: expected_param_keys order, 256-byte aligned slots that do not
// overlap, a total that covers them all; at() names what it cannot find.
TEST(Registry, ParamLayoutIsTheFlatOrderWithAlignedSlots) {
  for (bool identity : {false, true}) {
    const Config cfg = m3::test::small_cfg(4, 2, 4, 1, 0.5, false, 3, 4, identity);
    const m3::ParamLayout lay = m3::param_layout(cfg);
    const auto keys = m3::expected_param_keys(cfg);
    ASSERT_EQ(lay.slots.size(), keys.size());
    Idx end = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      const m3::ParamSlot& s = lay.slots[i];
      EXPECT_EQ("grad/" + s.name, keys[i].key);
      EXPECT_EQ(s.offset % m3::kParamAlign, 0);
      EXPECT_GE(s.offset, end) << s.name << " overlaps the slot before it";
      Idx n = 1;
      for (Idx v : keys[i].shape) n *= v;
      EXPECT_EQ(s.size, n) << s.name;
      end = s.offset + s.size;
      EXPECT_EQ(&lay.at(s.layer, s.spec->name), &s);
    }
    EXPECT_GE(lay.total, end);
    EXPECT_EQ(lay.total % m3::kParamAlign, 0);
    EXPECT_THROW(lay.at(7, "in_proj_w"), m3::Error);
    EXPECT_THROW(lay.at(0, "no_such_param"), m3::Error);
    if (identity) {
      EXPECT_THROW(lay.at(-1, "input_proj_w"), m3::Error);
    }
  }
}

// The stage table (registry.hpp stage_table): every registry tensor of a run is written by one
// of its entries (or is one of the three copies), every read names a registry tensor or
// parameter, and the entries run in the registry's order of stages.
TEST(Registry, StageTableCoversTheRegistryInExecutionOrder) {
  for (const auto& rc : reg_cases())
    for (ScanMode mode : {ScanMode::Sequential, ScanMode::Chunked}) {
      const auto table = m3::stage_table(rc.cfg, mode);
      auto position = [&](const std::string& name) {
        for (size_t i = 0; i < table.size(); ++i)
          if (table[i].name == name) return static_cast<int>(i);
        return -1;
      };
      int copies = 0;
      for (const auto& s : m3::stage_registry()) {
        if (!m3::exists_in(s, rc.cfg, mode)) continue;
        const std::string w = m3::writing_stage(s);
        if (w.empty()) {
          ++copies;
          continue;
        }
        const int at = position(w);
        ASSERT_GE(at, 0) << rc.name << ": " << s.stage << "/" << s.tensor << " written by '" << w
                         << "', which the table lacks";
        EXPECT_EQ(table[at].dir, s.dir) << s.stage << "/" << s.tensor;
        EXPECT_EQ(table[at].scope, s.scope) << s.stage << "/" << s.tensor;
      }
      EXPECT_EQ(copies, 3) << rc.name;
      // Reads resolve; stages in the registry's order (forward before backward).
      int last_dir = 0;
      for (const auto& e : table) {
        const int d = e.dir == m3::Dir::Forward ? 0 : 1;
        EXPECT_GE(d, last_dir) << e.name << " runs forward after a backward stage";
        last_dir = d;
        for (const auto& r : e.reads) {
          if (r.kind == m3::ReadKind::Tensor || r.kind == m3::ReadKind::TensorAtStorage) {
            EXPECT_NO_THROW(m3::find_spec(r.stage, r.name)) << e.name << " reads " << r.name;
          } else {
            bool found = false;
            for (const auto& p : m3::param_registry()) found |= std::string(p.name) == r.name;
            EXPECT_TRUE(found) << e.name << " reads unknown parameter " << r.name;
          }
        }
      }
      std::vector<std::string> layer_fwd, registry_fwd;
      for (const auto& e : table)
        if (e.scope == m3::Scope::Layer && e.dir == m3::Dir::Forward) layer_fwd.push_back(e.stage);
      for (const auto& s : m3::stage_registry())
        if (s.scope == m3::Scope::Layer && s.dir == m3::Dir::Forward &&
            (registry_fwd.empty() || registry_fwd.back() != s.stage))
          registry_fwd.push_back(s.stage);
      EXPECT_EQ(layer_fwd, registry_fwd) << rc.name;
    }
}
