// m3h judge (harness/judge.hpp, HARNESS.md §10), CPU only: the judge passes the right and fails
// the wrong. The subject is our own float reference written out as another implementation
// would write it (f32, and the bf16 storage emulation), then altered:
//   * as is                                   → every tensor passes, none is missing
//   * L0/F6/y, or a gradient, moved by a few budget widths → fails, naming that tensor first
//   * Linear weight gradients stored [out, in] with linear_layout = out_in declared → passes;
//     undeclared → a shape error (or, for the square input_proj_w, a failure)
//   * a subset of the tensors                 → the others are listed as not provided
//   * unknown keys, other-mode keys, bad shapes, bad declarations → one-line errors
// plus the NumPy interchange (golden/npy.hpp: exact round trips, refused files), the subject
// folder form, the problem export, and m3h judge as a program (exit 0 / 1 / 2, --json).
//
// The golden case is the built-in "entering_states" (d_model 8, 4 heads of 4, d_state 8, 1 layer,
// B 2, T 8, random entering states, both scan modes; input_proj_w [8, 8] is square), computed
// here and written to a temporary folder.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <sstream>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "golden.hpp"
#include "h5store.hpp"
#include "judge.hpp"
#include "npy.hpp"
#include "problem.hpp"
#include "test_io.hpp"
#include "error_of.hpp"

namespace m3 {
namespace {

namespace fs = std::filesystem;
using harness::Judgement;
using harness::LinearLayout;
using harness::Subject;
using test::TempDir;

const golden::GoldenCase& golden_case() {
  static const golden::GoldenCase g = golden::make_case(golden::find_case("entering_states"));
  return g;
}

// Our float reference at `p` as a subject: every tensor and gradient of the run, our layout.
Subject own_subject(Precision p, ScanMode mode) {
  const Capture cap = run_reference<float>(golden_case().problem, mode, p);
  Subject s;
  s.source = "own reference";
  s.implementation = "reference<float> written out";
  s.precision = p;
  s.mode = mode;
  for (const std::string& k : cap.keys()) {
    s.keys.push_back(k);
    s.tensors[k] = cap.at(k);
  }
  return s;
}

Judgement judge(Subject s) { return harness::judge_subject(golden_case(), "entering_states.h5", std::move(s)); }

const harness::TensorResult& row(const Judgement& j, const std::string& key) {
  for (const auto& r : j.comparison.cells.at(0).rows)
    if (r.key == key) return r;
  throw std::runtime_error("no row " + key);
}

std::string first_fail(const Judgement& j) {
  const auto& cell = j.comparison.cells.at(0);
  return cell.first_fail < 0 ? "" : cell.rows[static_cast<size_t>(cell.first_fail)].key;
}

// Moves `key` by ±δ per element (alternating signs). With widths ≥ 1: ‖Δ‖/‖o‖ = widths · (the
// rel_l2 limit the unaltered subject was judged by). With widths < 1: δ a fraction `widths` of
// the headroom the unaltered subject leaves, on rel_l2 and max_abs alike (it must still pass).
void push_out_of_budget(Subject& s, const std::string& key, double widths) {
  const Judgement clean = judge(s);
  const harness::TensorResult& r = row(clean, key);
  ASSERT_TRUE(r.pass()) << key;
  Tensor& t = s.tensors.at(key);
  const double root_n = std::sqrt(static_cast<double>(t.data.size()));
  const double delta =
      widths >= 1 ? widths * r.budget.rel_l2 * r.subject.oracle_l2 / root_n
                  : widths * std::min((r.budget.rel_l2 - r.subject.rel_l2) * r.subject.oracle_l2 / root_n,
                                      r.budget.max_abs - r.subject.max_abs);
  ASSERT_GT(delta, 0);
  for (size_t i = 0; i < t.data.size(); ++i) t.data[i] += i % 2 ? delta : -delta;
}

// The gradient of a Linear weight stored [out, in], as PyTorch's nn.Linear.weight.grad.
void transpose_into(Tensor& t) {
  const Idx rows = t.shape[0], cols = t.shape[1];
  std::vector<double> d(t.data.size());
  for (Idx i = 0; i < rows; ++i)
    for (Idx o = 0; o < cols; ++o) d[o * rows + i] = t.data[i * cols + o];
  t.data = std::move(d);
  t.shape = {cols, rows};
}

using m3::test::error_of;

// ---- the judge on our own reference -------------------------------------------------------------

struct Cell {
  Precision p;
  ScanMode mode;
};
class JudgeOwnReference : public ::testing::TestWithParam<Cell> {};

TEST_P(JudgeOwnReference, PassesEveryTensorAndMissesNone) {
  const Judgement j = judge(own_subject(GetParam().p, GetParam().mode));
  EXPECT_TRUE(j.pass()) << first_fail(j);
  EXPECT_TRUE(j.not_provided.empty());
  EXPECT_EQ(j.comparison.cells.at(0).rows.size(), static_cast<size_t>(j.n_expected));
  const Problem& pb = golden_case().problem;
  EXPECT_EQ(static_cast<size_t>(j.n_expected),
            harness::expected_keys(pb.cfg, pb.B, pb.T, GetParam().mode).size());
  EXPECT_EQ(j.comparison.lineups.at(0).conditioning.size(),
            static_cast<size_t>(harness::kPerturbationDraws));
  EXPECT_EQ(j.comparison.cells.at(0).precision, GetParam().p);
  EXPECT_EQ(j.comparison.cells.at(0).mode, GetParam().mode);
}

INSTANTIATE_TEST_SUITE_P(Cells, JudgeOwnReference,
                         ::testing::Values(Cell{Precision::F32, ScanMode::Sequential},
                                           Cell{Precision::F32, ScanMode::Chunked},
                                           Cell{Precision::BF16, ScanMode::Chunked},
                                           Cell{Precision::F16, ScanMode::Sequential}),
                         [](const auto& info) {
                           return std::string(precision_name(info.param.p)) + "_" +
                                  scan_mode_name(info.param.mode);
                         });

TEST(Judge, TheF32ReferenceJudgedAsBf16PassesButTheBf16OneJudgedAsF32Fails) {
  // The declared precision sets the budget: bf16 rounding is far outside f32's.
  Subject s = own_subject(Precision::BF16, ScanMode::Chunked);
  s.precision = Precision::F32;
  const Judgement j = judge(s);
  EXPECT_FALSE(j.pass());
  Subject t = own_subject(Precision::F32, ScanMode::Chunked);
  t.precision = Precision::BF16;
  EXPECT_TRUE(judge(t).pass());
}

TEST(Judge, YMovedByAFewBudgetWidthsFailsAndIsTheFirstFailingStage) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  push_out_of_budget(s, "L0/F6/y", 4);
  const Judgement j = judge(s);
  EXPECT_FALSE(j.pass());
  EXPECT_EQ(first_fail(j), "L0/F6/y");
  EXPECT_EQ(row(j, "L0/F6/y").status, harness::Status::OverBudget);
  EXPECT_EQ(j.comparison.n_fail(), 1);
  std::ostringstream os;
  harness::print_judgement(os, j);
  EXPECT_NE(os.str().find("summary: FAIL first failing stage: L0/F6/y [f32 chunked]"), std::string::npos)
      << os.str();
}

TEST(Judge, YWithinItsBudgetStillPasses) {
  // The other side of the line: a third of the headroom is accepted.
  Subject s = own_subject(Precision::BF16, ScanMode::Sequential);
  push_out_of_budget(s, "L0/F6/y", 0.3);
  EXPECT_TRUE(judge(s).pass());
}

TEST(Judge, AGradientMovedByAFewBudgetWidthsFailsAndIsNamed) {
  Subject s = own_subject(Precision::BF16, ScanMode::Sequential);
  push_out_of_budget(s, "grad/L0/in_proj_w", 4);
  const Judgement j = judge(s);
  EXPECT_FALSE(j.pass());
  EXPECT_EQ(first_fail(j), "grad/L0/in_proj_w");
  EXPECT_EQ(j.comparison.n_fail(), 1);
}

TEST(Judge, NonFiniteSubjectValuesFail) {
  Subject s = own_subject(Precision::F32, ScanMode::Sequential);
  s.tensors.at("L0/F3/dt").data[3] = std::nan("");
  const Judgement j = judge(s);
  EXPECT_EQ(first_fail(j), "L0/F3/dt");
  EXPECT_EQ(row(j, "L0/F3/dt").status, harness::Status::NonFinite);
}

// ---- layouts --------------------------------------------------------------------------------------

TEST(JudgeLayout, PyTorchOutInGradientsDeclaredFileWidePass) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  for (const char* k : {"grad/input_proj_w", "grad/L0/in_proj_w", "grad/L0/out_proj_w"})
    transpose_into(s.tensors.at(k));
  s.linear_layout = LinearLayout::OutIn;
  const Judgement j = judge(s);
  EXPECT_TRUE(j.pass()) << first_fail(j);
  EXPECT_EQ(j.transposed,
            (std::vector<std::string>{"grad/input_proj_w", "grad/L0/in_proj_w", "grad/L0/out_proj_w"}));
}

TEST(JudgeLayout, APerTensorDeclarationOverridesTheFileWideOne) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  for (const char* k : {"grad/L0/in_proj_w", "grad/L0/out_proj_w"}) transpose_into(s.tensors.at(k));
  s.linear_layout = LinearLayout::OutIn;
  s.tensor_layouts["grad/input_proj_w"] = LinearLayout::InOut;  // kept [in, out]
  const Judgement j = judge(s);
  EXPECT_TRUE(j.pass()) << first_fail(j);
  EXPECT_EQ(j.transposed.size(), 2u);
}

TEST(JudgeLayout, ATokenModelsEmbeddingKeepsOurLayoutUnderAFileWideOutIn) {
  // nn.Embedding.weight is [V, d_model], our input_proj_w's layout: the file-wide out_in
  // applies to the Linear weights (in_proj, out_proj, head) and not to it.
  const golden::GoldenCase lm = golden::make_case(golden::find_case("lm_step"));
  const Capture cap = run_reference<float>(lm.problem, ScanMode::Chunked, Precision::BF16);
  Subject s;
  s.source = "lm subject";
  s.precision = Precision::BF16;
  s.mode = ScanMode::Chunked;
  s.linear_layout = LinearLayout::OutIn;
  for (const char* k : {"grad/input_proj_w", "grad/L1/in_proj_w", "grad/L1/out_proj_w", "grad/head_w"}) {
    s.keys.push_back(k);
    s.tensors[k] = cap.at(k);
    if (std::string(k) != "grad/input_proj_w") transpose_into(s.tensors[k]);
  }
  const Judgement j = harness::judge_subject(lm, "lm_step.h5", s);
  EXPECT_TRUE(j.pass()) << first_fail(j);
  EXPECT_EQ(j.transposed, (std::vector<std::string>{"grad/L1/in_proj_w", "grad/L1/out_proj_w", "grad/head_w"}));
}

TEST(JudgeLayout, UndeclaredTransposedGradientIsAShapeErrorNamingBothShapes) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  transpose_into(s.tensors.at("grad/L0/in_proj_w"));  // [8, 62] stored as [62, 8]
  const std::string e = error_of([&] { judge(s); });
  EXPECT_NE(e.find("tensor 'grad/L0/in_proj_w' has shape [62, 8], expected [8, 62]"), std::string::npos) << e;
  EXPECT_NE(e.find("declare linear_layout = out_in"), std::string::npos) << e;
}

TEST(JudgeLayout, UndeclaredTransposedSquareWeightFailsItsBudget) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  transpose_into(s.tensors.at("grad/input_proj_w"));  // [8, 8]: only the values can tell
  const Judgement j = judge(s);
  EXPECT_EQ(first_fail(j), "grad/input_proj_w");
}

TEST(JudgeLayout, DeclaredOutInWithOurLayoutIsAShapeError) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  s.linear_layout = LinearLayout::OutIn;  // but nothing transposed
  const std::string e = error_of([&] { judge(s); });
  EXPECT_NE(e.find("expected [62, 8]"), std::string::npos) << e;
  EXPECT_NE(e.find("declared linear_layout out_in"), std::string::npos) << e;
}

TEST(JudgeLayout, ALayoutOnATensorThatIsNoLinearWeightIsRefused) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  s.tensor_layouts["L0/F2/proj"] = LinearLayout::OutIn;
  EXPECT_NE(error_of([&] { judge(s); }).find("tensor 'L0/F2/proj' declares linear_layout"),
            std::string::npos);
}

// ---- what the subject lacks or holds in excess ------------------------------------------------------

TEST(JudgeKeys, TensorsNotProvidedAreListedAndNotJudged) {
  const Subject full = own_subject(Precision::F32, ScanMode::Sequential);
  Subject s = full;
  s.keys = {"norm_f/Out", "L0/F6/y", "grad/L0/d_param"};
  s.tensors = {};
  for (const auto& k : s.keys) s.tensors[k] = full.tensors.at(k);
  const Judgement j = judge(s);
  EXPECT_TRUE(j.pass());
  const auto& rows = j.comparison.cells.at(0).rows;
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].key, "L0/F6/y");  // chain order, not the file's
  EXPECT_EQ(rows[1].key, "norm_f/Out");
  EXPECT_EQ(rows[2].key, "grad/L0/d_param");
  EXPECT_EQ(j.not_provided.size(), static_cast<size_t>(j.n_expected - 3));
  EXPECT_EQ(j.not_provided.front(), "input_proj/input_proj_inputs");
  std::ostringstream os;
  harness::print_judgement(os, j);
  EXPECT_NE(os.str().find("provided: 3 of the run's " + std::to_string(j.n_expected) + " tensors"),
            std::string::npos)
      << os.str();
  EXPECT_NE(os.str().find("  L0/F6: h_saved k_prev_saved v_prev_saved\n"), std::string::npos) << os.str();
}

TEST(JudgeKeys, UnknownAndOtherModeKeysAreOneErrorNamingThem) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  for (const char* k : {"L0/F9/zz", "L0/F6/h_saved"}) {
    s.keys.push_back(k);
    s.tensors[k] = Tensor{{1}, {0.0}};
  }
  const std::string e = error_of([&] { judge(s); });
  EXPECT_NE(e.find("2 tensor(s) are not keys of this run (chunked"), std::string::npos) << e;
  EXPECT_NE(e.find("L0/F9/zz, L0/F6/h_saved (a seq-mode tensor)"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos);
}

TEST(JudgeKeys, AMisShapedTensorNamesExpectedAndGot) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  s.tensors.at("L0/F6/y").shape = {16, 16};  // [BT, NH, HD] = [16, 4, 4] flattened
  const std::string e = error_of([&] { judge(s); });
  EXPECT_NE(e.find("tensor 'L0/F6/y' has shape [16, 16], expected [16, 4, 4]"), std::string::npos) << e;
}

TEST(JudgeKeys, AnEmptySubjectAndAModeTheGoldenLacksAreErrors) {
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  Subject empty = s;
  empty.keys.clear();
  empty.tensors.clear();
  EXPECT_NE(error_of([&] { judge(empty); }).find("holds no tensor"), std::string::npos);
  golden::GoldenCase seq_only = golden_case();
  seq_only.modes = {ScanMode::Sequential};
  seq_only.oracle.erase(ScanMode::Chunked);
  const std::string e = error_of([&] { harness::judge_subject(seq_only, "g.h5", s); });
  EXPECT_NE(e.find("g.h5: stores no chunked run"), std::string::npos) << e;
}

// ---- subject files ----------------------------------------------------------------------------------

TEST(JudgeFiles, HdfAndFolderSubjectsReadBackExactly) {
  TempDir tmp("m3_judge_");
  Subject s = own_subject(Precision::BF16, ScanMode::Sequential);
  s.linear_layout = LinearLayout::OutIn;
  s.tensor_layouts["grad/input_proj_w"] = LinearLayout::InOut;
  harness::write_subject_h5(tmp.file("s.h5"), s, false);
  harness::write_subject_dir(tmp.file("s"), s, false);
  for (const Subject& r : {harness::read_subject_h5(tmp.file("s.h5")), harness::read_subject_dir(tmp.file("s"))}) {
    EXPECT_EQ(r.precision, Precision::BF16);
    EXPECT_EQ(r.mode, ScanMode::Sequential);
    EXPECT_EQ(r.implementation, s.implementation);
    EXPECT_EQ(r.linear_layout, LinearLayout::OutIn);
    EXPECT_EQ(r.tensor_layouts, s.tensor_layouts);
    ASSERT_EQ(r.tensors.size(), s.tensors.size());
    for (const auto& [k, t] : s.tensors) {
      EXPECT_EQ(r.tensors.at(k).shape, t.shape) << k;
      EXPECT_EQ(r.tensors.at(k).data, t.data) << k;
    }
  }
  // Written again: refused without force, replaced with it.
  EXPECT_NE(error_of([&] { harness::write_subject_dir(tmp.file("s"), s, false); }).find("exists"),
            std::string::npos);
  harness::write_subject_dir(tmp.file("s"), s, true);
  // A folder that is no subject folder is never replaced.
  fs::create_directories(tmp.dir / "other");
  EXPECT_NE(error_of([&] { harness::write_subject_dir(tmp.file("other"), s, true); }).find("holds no meta.json"),
            std::string::npos);
}

void write_file(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

TEST(JudgeFiles, FolderDeclarationsAreCheckedOneLineEach) {
  TempDir tmp("m3_judge_");
  Subject s = own_subject(Precision::F32, ScanMode::Chunked);
  s.keys = {"norm_f/Out"};
  harness::write_subject_dir(tmp.file("s"), s, false);
  const fs::path meta = tmp.dir / "s" / "meta.json";
  const std::string good = test::slurp(meta);
  struct Case {
    std::string meta, expect;
  };
  const std::vector<Case> cases = {
      {R"({"format": "m3h-subject", "format_version": 1, "precision": "bf16", "scan_mode": "chunked", "time_layout": "b_h_t"})",
       "unknown layout convention 'time_layout'"},
      {R"({"format": "m3h-subject", "format_version": 1, "precision": "bf16", "scan_mode": "chunked", "linear_layout": "col"})",
       "unknown linear_layout 'col'"},
      {R"({"format": "m3h-subject", "format_version": 1, "precision": "f64", "scan_mode": "chunked"})",
       "precision 'f64' is not a subject's storage precision"},
      {R"({"format": "m3h-subject", "format_version": 1, "scan_mode": "chunked"})",
       "does not declare precision"},
      {R"({"format": "m3h-subject", "format_version": 2, "precision": "f32", "scan_mode": "chunked"})",
       "subject format version 2 found"},
      {R"({"format": "m3h-subject", "format_version": 1, "precision": "f32", "scan_mode": "both"})",
       "scan_mode 'both' is unknown"},
      {R"({"format": "m3h-subject", "format_version": 1, "precision": "f32", "scan_mode": "chunked", "notes": "x"})",
       "unknown declaration 'notes'"},
      {R"({"format": "m3h-subject", "format_version": 1, "precision": "f32", "scan_mode": "chunked", "tensors": {"grad/L0/in_proj_w": {"linear_layout": "out_in"}}})",
       "declares a layout for a tensor the folder lacks"},
      {"{ not json", "is not valid JSON"},
  };
  for (const Case& c : cases) {
    write_file(meta, c.meta);
    const std::string e = error_of([&] { harness::read_subject_dir(tmp.file("s")); });
    EXPECT_NE(e.find(c.expect), std::string::npos) << c.meta << "\n" << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
  write_file(meta, good);
  write_file(tmp.dir / "s" / "notes.txt", "x");
  EXPECT_NE(error_of([&] { harness::read_subject_dir(tmp.file("s")); }).find("unexpected file 'notes.txt'"),
            std::string::npos);
}

TEST(JudgeFiles, HdfDeclarationsAreCheckedToo) {
  TempDir tmp("m3_judge_");
  {
    h5::Writer w(tmp.file("s.h5"), false);
    w.group("/meta");
    w.attr("/meta", "format", "m3h-subject");
    w.attr("/meta", "format_version", 1);
    w.attr("/meta", "precision", "f32");
    w.attr("/meta", "scan_mode", "seq");
    w.attr("/meta", "angle_layout", "degrees");
    w.write("/tensors/norm_f/Out", Tensor{{1}, {1.0}}, h5::DType::F32);
    w.commit();
  }
  EXPECT_NE(error_of([&] { harness::read_subject_h5(tmp.file("s.h5")); })
                .find("unknown layout convention 'angle_layout'"),
            std::string::npos);
  {
    h5::Writer w(tmp.file("t.h5"), false);
    w.group("/meta");
    w.attr("/meta", "format", "m3h-subject");
    w.attr("/meta", "format_version", 1);
    w.attr("/meta", "precision", "f32");
    w.attr("/meta", "scan_mode", "seq");
    w.write("/tensors/norm_f/Out", Tensor{{1}, {1.0}}, h5::DType::F32);
    w.attr("/tensors/norm_f/Out", "units", "m");
    w.commit();
  }
  EXPECT_NE(error_of([&] { harness::read_subject_h5(tmp.file("t.h5")); })
                .find("dataset '/tensors/norm_f/Out': unknown attribute 'units'"),
            std::string::npos);
}

// ---- NumPy files -------------------------------------------------------------------------------------

TEST(Npy, RoundTripsDoublesExactlyWithAnyRank) {
  for (const Tensor& t : {Tensor{{}, {3.25}}, Tensor{{5}, {1, -2, 1e-300, 7, 0.1}},
                          Tensor{{2, 0, 3}, {}}, Tensor{{2, 3}, {1, 2, 3, 4, 5, std::nan("")}}}) {
    const std::string b = npy::encode(t);
    EXPECT_EQ(b.size() % 8, 0u);
    EXPECT_EQ((b.size() - 8 * t.data.size()) % 64, 0u);  // header padded to 64 bytes
    const Tensor r = npy::decode(b, "t.npy");
    EXPECT_EQ(r.shape, t.shape);
    ASSERT_EQ(r.data.size(), t.data.size());
    for (size_t i = 0; i < t.data.size(); ++i)
      EXPECT_TRUE(r.data[i] == t.data[i] || (std::isnan(r.data[i]) && std::isnan(t.data[i])));
  }
}

// A .npy as numpy.save writes it (version 1.0, the header padded to 64).
std::string npy_bytes(const std::string& dict, const std::string& data, char major = 1) {
  std::string h = dict;
  const size_t fixed = major == 1 ? 10 : 12;
  h.append((64 - (fixed + h.size() + 1) % 64) % 64, ' ');
  h += '\n';
  std::string b = "\x93NUMPY";
  b += major;
  b += '\0';
  b += static_cast<char>(h.size() & 0xff);
  b += static_cast<char>(h.size() >> 8);
  if (major != 1) b += std::string(2, '\0');
  return b + h + data;
}

TEST(Npy, ReadsFloat32AndFloat16AsNumpyWritesThem) {
  std::string f32(8, '\0');  // 1.5f, -2.0f
  const float v[2] = {1.5f, -2.0f};
  std::memcpy(f32.data(), v, 8);
  Tensor t = npy::decode(npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", f32), "a.npy");
  EXPECT_EQ(t.data, (std::vector<double>{1.5, -2.0}));
  const std::string f16("\x00\x3c\x00\xc0", 4);  // 1.0, -2.0 as IEEE half
  t = npy::decode(npy_bytes("{\"shape\": (1, 2), \"fortran_order\": False, \"descr\": \"<f2\"}", f16, 2),
                  "b.npy");
  EXPECT_EQ(t.shape, (std::vector<Idx>{1, 2}));
  EXPECT_EQ(t.data, (std::vector<double>{1.0, -2.0}));
}

TEST(Npy, RefusesWhatItCannotReadExactly) {
  const std::string d8(16, '\0');
  struct Case {
    std::string bytes, expect;
  };
  const std::vector<Case> cases = {
      {"PK\x03\x04 not npy", "no NumPy magic bytes"},
      {npy_bytes("{'descr': '>f8', 'fortran_order': False, 'shape': (2,), }", d8), "unsupported dtype '>f8'"},
      {npy_bytes("{'descr': '<i4', 'fortran_order': False, 'shape': (4,), }", d8), "unsupported dtype '<i4'"},
      {npy_bytes("{'descr': '<f8', 'fortran_order': True, 'shape': (2,), }", d8), "Fortran-ordered"},
      {npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (3,), }", d8), "needs 24 data bytes, the file holds 16"},
      {npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", d8), "needs 8 data bytes, the file holds 16"},
      {npy_bytes("{'descr': '<f8', 'shape': (2,), }", d8), "lacks one of"},
      {npy_bytes("{'descr': '<f8', 'fortran_order': False, 'shape': (2,), 'x': 1}", d8), "unknown header key 'x'"},
  };
  for (const Case& c : cases) {
    const std::string e = error_of([&] { npy::decode(c.bytes, "t.npy"); });
    EXPECT_NE(e.find(c.expect), std::string::npos) << e;
    EXPECT_EQ(e.rfind("t.npy: ", 0), 0u) << e;
  }
}

// ---- the problem export -----------------------------------------------------------------------------

TEST(JudgeExport, WritesEveryWeightAndInputExactlyWithProblemJson) {
  TempDir tmp("m3_judge_");
  const golden::GoldenCase& g = golden_case();
  harness::export_problem(g, "g.h5", tmp.file("p"), false);
  const fs::path p = tmp.dir / "p";
  EXPECT_EQ(npy::read((p / "weights/L0/in_proj_w.npy").string()).data, g.problem.params.layers[0].in_proj_w);
  EXPECT_EQ(npy::read((p / "weights/input_proj_w.npy").string()).shape, (std::vector<Idx>{8, 8}));
  EXPECT_EQ(npy::read((p / "inputs/x.npy").string()).data, g.problem.x);
  EXPECT_EQ(npy::read((p / "inputs/d_out.npy").string()).data, g.problem.d_out);
  const Tensor ssm = npy::read((p / "inputs/states/ssm.npy").string());
  EXPECT_EQ(ssm.shape, (std::vector<Idx>{1, 2, 4, 4, 8}));
  EXPECT_EQ(ssm.data, g.problem.states.ssm);
  const auto j = nlohmann::json::parse(test::slurp(p / "problem.json"));
  EXPECT_EQ(j.at("format"), "m3h-problem");
  EXPECT_EQ(j.at("config").at("d_model"), 8);
  EXPECT_EQ(j.at("B"), 2);
  EXPECT_EQ(j.at("entering_states"), "nonzero");
  EXPECT_EQ(j.at("arrays").size(), 10u + 3u + 2u + 4u);  // layer, backbone weights, x/d_out, states
  size_t files = 0;
  for (const auto& e : fs::recursive_directory_iterator(p)) files += e.is_regular_file();
  EXPECT_EQ(files, j.at("arrays").size() + 1);
  // Replaced only with force, and a folder that is no problem export never.
  EXPECT_NE(error_of([&] { harness::export_problem(g, "g.h5", tmp.file("p"), false); }).find("exists"),
            std::string::npos);
  harness::export_problem(g, "g.h5", tmp.file("p"), true);
  EXPECT_FALSE(fs::exists(tmp.dir / ("p.tmp." + std::to_string(::getpid()))));
  fs::create_directories(tmp.dir / "home");
  EXPECT_NE(error_of([&] { harness::export_problem(g, "g.h5", tmp.file("home"), true); })
                .find("holds no problem.json"),
            std::string::npos);
  EXPECT_NE(error_of([&] { harness::export_problem(g, "g.h5", tmp.file("no/such/p"), false); })
                .find("does not exist"),
            std::string::npos);
}

// ---- m3h judge, the program -------------------------------------------------------------------------

class JudgeCli : public ::testing::Test {
 protected:
  void SetUp() override { golden::write_golden(tmp.file("g.h5"), golden_case(), false); }
  std::string g() const { return "--golden '" + tmp.file("g.h5") + "'"; }
  TempDir tmp{"m3_judge_cli_"};
};

TEST_F(JudgeCli, ExitZeroOnAPassingSubjectWithCompareJsonAndTheJudgeObject) {
  harness::write_subject_h5(tmp.file("s.h5"), own_subject(Precision::BF16, ScanMode::Chunked), false);
  const auto r = test::run_m3h("judge " + g() + " --subject '" + tmp.file("s.h5") + "' --json '" +
                               tmp.file("r.json") + "'");
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("summary: PASS all"), std::string::npos) << r.out;
  const auto j = nlohmann::json::parse(test::slurp(tmp.dir / "r.json"));
  EXPECT_EQ(j.at("schema"), "m3h-compare/2");
  EXPECT_EQ(j.at("exit_status"), 0);
  EXPECT_EQ(j.at("judge").at("precision"), "bf16");
  EXPECT_EQ(j.at("judge").at("not_provided").size(), 0u);
  EXPECT_EQ(j.at("cells").size(), j.at("judge").at("n_provided").get<size_t>());
  EXPECT_NE(r.out.find("(1 cell, " + std::to_string(j.at("cells").size()) + " tensor checks)"),
            std::string::npos)
      << r.out;
  // An existing --json is not replaced without --force.
  const auto again = test::run_m3h("judge " + g() + " --subject '" + tmp.file("s.h5") + "' --json '" +
                                   tmp.file("r.json") + "'");
  EXPECT_EQ(again.status, 2);
  EXPECT_NE(again.err.find("exists (pass --force to replace it)"), std::string::npos) << again.err;
}

TEST_F(JudgeCli, ExitOneNamingTheFirstFailingStageFromANumpyFolder) {
  Subject s = own_subject(Precision::F32, ScanMode::Sequential);
  push_out_of_budget(s, "L0/F6/y", 4);
  harness::write_subject_dir(tmp.file("s"), s, false);
  const auto r = test::run_m3h("judge " + g() + " --subject-dir '" + tmp.file("s") + "'");
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_NE(r.out.find("summary: FAIL first failing stage: L0/F6/y [f32 seq]"), std::string::npos) << r.out;
}

TEST_F(JudgeCli, BadInputIsExitTwoWithOneLine) {
  Subject s = own_subject(Precision::F32, ScanMode::Sequential);
  transpose_into(s.tensors.at("grad/L0/out_proj_w"));
  harness::write_subject_h5(tmp.file("t.h5"), s, false);
  write_file(tmp.dir / "junk.h5", "not hdf5");
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--subject '" + tmp.file("t.h5") + "'", "tensor 'grad/L0/out_proj_w' has shape [8, 16], expected [16, 8]"},
      {"--subject '" + tmp.file("junk.h5") + "'", "not an HDF5 file"},
      {"--subject-dir '" + tmp.file("none") + "'", "is not a folder"},
      {"", "give exactly one of --subject FILE, --subject-dir DIR and --export-problem DIR"},
      {"--subject '" + tmp.file("t.h5") + "' --export-problem '" + tmp.file("p") + "'", "give exactly one of"},
  };
  for (const auto& [args, expect] : cases) {
    const auto r = test::run_m3h("judge " + g() + " " + args);
    EXPECT_EQ(r.status, 2) << args << "\n" << r.out << r.err;
    EXPECT_EQ(r.err.rfind("m3h judge: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(expect), std::string::npos) << r.err;
    EXPECT_EQ(test::count_lines(r.err), 1) << r.err;
  }
  const auto r = test::run_m3h("judge --subject '" + tmp.file("t.h5") + "'");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--golden FILE is required"), std::string::npos) << r.err;
}

TEST_F(JudgeCli, ExportProblemWritesTheFolder) {
  const auto r = test::run_m3h("judge " + g() + " --export-problem '" + tmp.file("p") + "'");
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(tmp.dir / "p" / "problem.json"));
  EXPECT_EQ(npy::read((tmp.dir / "p/weights/norm_f_weight.npy").string()).data,
            golden_case().problem.params.norm_f_weight);
  const auto again = test::run_m3h("judge " + g() + " --export-problem '" + tmp.file("p") + "'");
  EXPECT_EQ(again.status, 2);
  EXPECT_NE(again.err.find("exists (pass --force to replace it)"), std::string::npos) << again.err;
}

}  // namespace
}  // namespace m3
