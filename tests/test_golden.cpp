// Tests of the golden files (golden/golden.hpp, golden/SCHEMA.md) and of `m3h golden`.
//
//   GoldenCommitted   every committed case under golden/cases passes `check` (recomputed by
//                     run_reference<double> from the stored problem)
//   GoldenRoundTrip   write → read reconstructs the Problem and every oracle tensor bit-exactly
//                     (a token model too: tokens, targets, weights, head_w)
//   GoldenTokenModel  the lm_step case holds one training step (vocab_size in /meta, tok / tgt
//                     / w instead of x / d_out, the head and loss tensors, grad/head_w)
//   GoldenCheck       one value of one stored tensor changed → check fails naming exactly that
//                     tensor (the first in execution order when several differ); angles compare
//                     by circular distance; another implementation that provides a subset of
//                     the tensors (the GPU oracle's path) is compared on those, the rest counted
//   GoldenDiff        regen's comparison: new / removed tensors, changed inputs (tokens too),
//                     a tensor's change judged against rtol times its own scale
//   GoldenReader      schema-version mismatch, /meta precision other than f64, generator
//                     other than this harness or a flag other than 0 / 1, missing /
//                     mis-shaped / extra / non-f64 / non-finite datasets, truncated / empty / non-HDF5 files: one-line errors
//                     that name the problem; a token model's mis-shaped, non-integer or
//                     out-of-range tokens and targets and bad weights, naming the dataset
//   GoldenCli         the m3h binary: bad files exit 2 with one stderr line; a perturbed file
//                     exits 1 naming the tensor; regen without --force exits 2 and leaves the
//                     file byte-identical; regen --force on an unchanged case reports 0 changed;
//                     check --device gpu-oracle passes, or says in one line why it cannot run
//
// Files are edited by copying them through m3::h5::Reader / Writer (copy_golden below), so the
// tests depend on the store's API only, never on HDF5 itself.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "error.hpp"
#include "test_io.hpp"
#include "golden.hpp"
#include "h5store.hpp"
#include "problem.hpp"
#include "registry.hpp"

#ifndef M3_GOLDEN_CASES_DIR
#error "M3_GOLDEN_CASES_DIR must be defined (tests/CMakeLists.txt)"
#endif

namespace fs = std::filesystem;
using m3::Idx;
using m3::ScanMode;
using m3::Tensor;
namespace golden = m3::golden;
namespace h5 = m3::h5;

namespace {

// A fresh temporary folder per test, removed afterwards.
struct TempDir : m3::test::TempDir {
  TempDir() : m3::test::TempDir("m3_golden_") {}
};

std::string committed(const std::string& name) {
  return golden::case_path(M3_GOLDEN_CASES_DIR, name);
}

using m3::test::slurp;

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << bytes;
}

// The message of the m3::Error that f() throws ("" when it does not throw).
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const m3::Error& e) {
    return e.what();
  }
  return "";
}

// ---- copying a golden file with edits -----------------------------------------------------

// /meta attributes by kind (SCHEMA.md).
const std::vector<std::string> kMetaStrings = {"generator", "generator_version", "git_revision",
                                               "case",      "seed",              "scan_modes",
                                               "precision"};
const std::vector<std::string> kMetaDoubles = {"rope_fraction", "a_floor"};
const std::vector<std::string> kMetaInts = {
    "schema_version", "d_model",  "d_state",    "expand",     "headdim",
    "ngroups",        "n_layers", "is_outproj_norm", "input_dim", "input_proj_identity",
    "chunk_size",     "d_inner",  "nheads",     "num_rope_angles", "in_proj_dim",
    "B",              "T"};
// Written only in a token model (absent = 0; absent = no scale).
const std::vector<std::string> kMetaOptionalInts = {"vocab_size"};
const std::vector<std::string> kMetaOptionalDoubles = {"loss_scale"};

struct Edits {
  std::string skip;                                  // dataset not copied
  std::function<void(const std::string&, Tensor&)> tensor;  // may change a dataset's values
  std::function<void(h5::Writer&)> extra;            // more objects before commit
  std::function<bool(const std::string& attr, h5::Writer&)> meta;  // true: attr handled
  h5::DType dtype = h5::DType::F64;
  std::string dtype_for;                             // dataset stored as `dtype`
};

void walk(const h5::Reader& r, const std::string& group, std::vector<std::string>& out) {
  for (const auto& c : r.children(group)) {
    const std::string p = (group == "/" ? "" : group) + "/" + c;
    if (r.is_group(p))
      walk(r, p, out);
    else
      out.push_back(p);
  }
}

void copy_golden(const std::string& from, const std::string& to, const Edits& e) {
  const h5::Reader r(from);
  h5::Writer w(to, true);
  w.group("/meta");
  auto meta = [&](const std::string& a, auto&& copy) {
    if (e.meta && e.meta(a, w)) return;
    copy();
  };
  for (const auto& a : kMetaStrings)
    meta(a, [&] { w.attr("/meta", a, r.attr_string("/meta", a)); });
  for (const auto& a : kMetaDoubles)
    meta(a, [&] { w.attr("/meta", a, r.attr_double("/meta", a)); });
  for (const auto& a : kMetaInts) meta(a, [&] { w.attr("/meta", a, r.attr_int("/meta", a)); });
  for (const auto& a : kMetaOptionalInts)
    if (r.has_attr("/meta", a)) meta(a, [&] { w.attr("/meta", a, r.attr_int("/meta", a)); });
  for (const auto& a : kMetaOptionalDoubles)
    if (r.has_attr("/meta", a)) meta(a, [&] { w.attr("/meta", a, r.attr_double("/meta", a)); });
  std::vector<std::string> paths;
  walk(r, "/", paths);
  for (const auto& p : paths) {
    if (p == e.skip) continue;
    Tensor t = r.read(p);
    if (e.tensor) e.tensor(p, t);
    const h5::DType dt = p == e.dtype_for ? e.dtype : h5::DType::F64;
    w.write(p, t, dt, h5::NonFinite::Allow);
  }
  if (e.extra) e.extra(w);
  w.commit();
}

// ---- running the m3h binary -----------------------------------------------------------------

using CliResult = m3::test::CliRun;

bool have_m3h() {
#ifdef M3H_PATH
  return fs::exists(M3H_PATH);
#else
  return false;
#endif
}

CliResult run_m3h(const std::string& args, const TempDir& tmp) {
  return m3::test::run_m3h(args, tmp.str());
}

using m3::test::count_lines;

// A Capture equal to `cap` with f applied to the tensor under `key`.
m3::Capture with_change(const m3::Capture& cap, const std::string& key,
                        const std::function<void(Tensor&)>& f) {
  m3::Capture out;
  for (const auto& k : cap.keys()) {
    Tensor t = cap.at(k);
    if (k == key) f(t);
    out.put(k, t.shape, t.data.data());
  }
  return out;
}

// ---- tests ------------------------------------------------------------------------------------

class GoldenCommitted : public ::testing::TestWithParam<std::string> {};

TEST_P(GoldenCommitted, CheckPasses) {
  const golden::CheckResult r = golden::check_file(committed(GetParam()));
  EXPECT_TRUE(r.pass()) << r.line();
  EXPECT_EQ(r.name, GetParam());
  EXPECT_FALSE(r.diff.inputs_changed) << r.diff.inputs_note;
  EXPECT_GT(r.diff.tensors.size(), 0u);
}

TEST_P(GoldenCommitted, StoredProblemIsTheCaseTable) {
  // The stored problem is exactly what the case table generates (regen would not change it).
  const golden::GoldenCase stored = golden::read_golden(committed(GetParam()));
  const golden::CaseDef& def = golden::find_case(GetParam());
  const m3::Problem pb = m3::make_problem(def.cfg, def.B, def.T, def.seed, def.random_states);
  golden::GoldenCase fresh;
  fresh.name = def.name;
  fresh.problem = pb;
  fresh.modes = def.modes;
  for (ScanMode m : def.modes) fresh.oracle[m] = stored.oracle.at(m);
  const golden::CaseDiff d = golden::diff_cases(stored, fresh);
  EXPECT_FALSE(d.inputs_changed) << d.inputs_note;
  EXPECT_FALSE(d.modes_changed);
}

std::vector<std::string> case_names() {
  std::vector<std::string> v;
  for (const auto& d : golden::builtin_cases()) v.push_back(d.name);
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GoldenCommitted, ::testing::ValuesIn(case_names()),
                         [](const auto& info) { return info.param; });

TEST(GoldenCases, EveryPropertyIsCovered) {
  bool ngroups = false, rope1 = false, no_rope = false, outnorm = false, states = false,
       ragged = false, deep_linear = false, identity = false, batch = false, seq = false,
       chunked = false, token = false;
  for (const auto& d : golden::builtin_cases()) {
    const m3::Config& c = d.cfg;
    ngroups |= c.ngroups > 1;
    rope1 |= c.rope_fraction == 1.0 && c.num_rope_angles() > 0;
    no_rope |= c.num_rope_angles() == 0;
    outnorm |= c.is_outproj_norm;
    states |= d.random_states;
    ragged |= d.T % c.chunk_size != 0 && c.n_chunks(d.T) > 1;
    deep_linear |= c.n_layers >= 3 && !c.input_proj_identity && c.input_dim != c.d_model;
    identity |= c.input_proj_identity;
    batch |= d.B > 1;
    // One training step: tokens in, loss and every gradient out, through several layers
    // and ragged chunks in both modes (TRAINING.md §1).
    token |= c.vocab_size > 0 && c.n_layers >= 2 && d.T % c.chunk_size != 0 &&
             d.modes.size() == 2;
    for (ScanMode m : d.modes) (m == ScanMode::Sequential ? seq : chunked) = true;
  }
  EXPECT_TRUE(ngroups && rope1 && no_rope && outnorm && states && ragged && deep_linear &&
              identity && batch && seq && chunked && token);
  EXPECT_NO_THROW(golden::find_case("default"));
  EXPECT_NE(error_of([] { golden::find_case("nope"); }).find("known cases: default"),
            std::string::npos);
}

TEST(GoldenRoundTrip, ProblemAndOracleAreBitExact) {
  TempDir tmp;
  const golden::GoldenCase gc = golden::make_case(golden::find_case("entering_states"));
  const std::string path = tmp.file("rt.h5");
  golden::write_golden(path, gc, false);
  const golden::GoldenCase back = golden::read_golden(path);
  EXPECT_EQ(back.name, gc.name);
  EXPECT_EQ(back.modes, gc.modes);
  EXPECT_EQ(back.problem.seed, gc.problem.seed);
  const golden::CaseDiff d = golden::diff_cases(gc, back);
  EXPECT_FALSE(d.inputs_changed) << d.inputs_note;
  ASSERT_EQ(d.count(golden::DiffStatus::Unchanged), static_cast<int>(d.tensors.size()));
  for (const auto& t : d.tensors) EXPECT_TRUE(t.identical) << t.path();
  // Every key of every mode made the round trip.
  for (ScanMode m : gc.modes) EXPECT_EQ(back.oracle.at(m).keys().size(), gc.oracle.at(m).keys().size());
}

TEST(GoldenRoundTrip, TokenModelIsBitExact) {
  TempDir tmp;
  const golden::GoldenCase gc = golden::make_case(golden::find_case("lm_step"));
  const m3::Problem& pb = gc.problem;
  ASSERT_TRUE(pb.token_model());
  ASSERT_EQ(pb.tok.size(), static_cast<size_t>(pb.B * pb.T));
  const std::string path = tmp.file("lm.h5");
  golden::write_golden(path, gc, false);
  const golden::GoldenCase back = golden::read_golden(path);
  const m3::Problem& bp = back.problem;
  EXPECT_EQ(bp.cfg.vocab_size, pb.cfg.vocab_size);
  EXPECT_EQ(bp.cfg.input_dim, pb.cfg.input_dim);
  EXPECT_EQ(bp.tok, pb.tok);
  EXPECT_EQ(bp.tgt, pb.tgt);
  EXPECT_EQ(bp.w, pb.w);
  EXPECT_EQ(bp.params.head_w, pb.params.head_w);
  EXPECT_EQ(bp.params.head_w.size(), static_cast<size_t>(pb.cfg.d_model * pb.cfg.vocab_size));
  EXPECT_EQ(bp.params.input_proj_w, pb.params.input_proj_w);
  EXPECT_TRUE(bp.x.empty());
  EXPECT_TRUE(bp.d_out.empty());
  EXPECT_EQ(bp.states.ssm, pb.states.ssm);
  const golden::CaseDiff d = golden::diff_cases(gc, back);
  EXPECT_FALSE(d.inputs_changed) << d.inputs_note;
  ASSERT_EQ(d.count(golden::DiffStatus::Unchanged), static_cast<int>(d.tensors.size()));
  for (const auto& t : d.tensors) EXPECT_TRUE(t.identical) << t.path();
  for (ScanMode m : gc.modes)
    EXPECT_EQ(back.oracle.at(m).keys().size(), gc.oracle.at(m).keys().size());
  // The token datasets are what the file holds instead of x and d_out.
  const h5::Reader r(path);
  EXPECT_EQ(r.attr_int("/meta", "vocab_size"), pb.cfg.vocab_size);
  for (const char* p : {"/inputs/tok", "/inputs/tgt", "/inputs/w"}) {
    EXPECT_EQ(r.dtype(p), h5::DType::F64) << p;
    EXPECT_EQ(r.shape(p), (std::vector<Idx>{pb.B * pb.T})) << p;
  }
  EXPECT_FALSE(r.has("/inputs/x"));
  EXPECT_FALSE(r.has("/inputs/d_out"));
  EXPECT_EQ(r.read("/inputs/tok").data[3], static_cast<double>(pb.tok[3]));
}

TEST(GoldenRoundTrip, BackboneFileHasNoVocabSize) {
  // vocab_size is written only in a token model: the backbone files keep their bytes.
  const h5::Reader r(committed("no_rope"));
  EXPECT_FALSE(r.has_attr("/meta", "vocab_size"));
  EXPECT_EQ(golden::read_golden(committed("no_rope")).problem.cfg.vocab_size, 0);
}

TEST(GoldenRoundTrip, LargeSeedSurvives) {
  TempDir tmp;
  const golden::CaseDef& def = golden::find_case("no_rope");
  const std::uint64_t seed = 0xFFFFFFFFFFFFFFF1ull;
  const golden::GoldenCase gc = golden::compute_case(
      "big_seed", m3::make_problem(def.cfg, def.B, def.T, seed, false), {ScanMode::Sequential});
  golden::write_golden(tmp.file("s.h5"), gc, false);
  EXPECT_EQ(golden::read_golden(tmp.file("s.h5")).problem.seed, seed);
}

TEST(GoldenWrite, RefusesToReplaceWithoutForce) {
  TempDir tmp;
  const std::string path = tmp.file("no_rope.h5");
  fs::copy_file(committed("no_rope"), path);
  const std::string before = slurp(path);
  const golden::GoldenCase gc = golden::read_golden(path);
  EXPECT_NE(error_of([&] { golden::write_golden(path, gc, false); }).find("file exists"),
            std::string::npos);
  EXPECT_EQ(slurp(path), before);
  EXPECT_NO_THROW(golden::write_golden(path, gc, true));
}

// One element of one oracle tensor changed → check names exactly that tensor and element.
TEST(GoldenCheck, OnePerturbedValueIsNamed) {
  TempDir tmp;
  golden::GoldenCase gc = golden::read_golden(committed("ragged_chunks"));
  const std::string key = "L0/F6/y";
  const Idx index = 37;
  Tensor orig = gc.oracle.at(ScanMode::Chunked).at(key);
  gc.oracle[ScanMode::Chunked] =
      with_change(gc.oracle.at(ScanMode::Chunked), key, [&](Tensor& t) { t.data[index] += 1e-7; });
  const std::string path = tmp.file("perturbed.h5");
  golden::write_golden(path, gc, false);

  const golden::CheckResult r = golden::check_file(path);
  ASSERT_FALSE(r.pass());
  const golden::TensorDiff* f = r.diff.first_mismatch();
  ASSERT_NE(f, nullptr);
  EXPECT_EQ(f->mode, ScanMode::Chunked);
  EXPECT_EQ(f->key, key);
  EXPECT_EQ(f->worst_index, index);
  EXPECT_NEAR(f->max_abs, 1e-7, 1e-12);
  EXPECT_EQ(f->old_value, orig.data[index] + 1e-7);
  EXPECT_EQ(r.diff.count(golden::DiffStatus::Changed), 1);
  EXPECT_NE(r.line().find("FAIL ragged_chunks: first mismatch chunked/L0/F6/y"), std::string::npos)
      << r.line();
  EXPECT_EQ(count_lines(r.line()), 0);
}

TEST(GoldenCheck, FirstMismatchIsInExecutionOrder) {
  TempDir tmp;
  golden::GoldenCase gc = golden::read_golden(committed("deep_linear_input"));
  m3::Capture& seq = gc.oracle[ScanMode::Sequential];
  // A parameter gradient (last in order), a backward tensor and a layer-2 forward tensor.
  seq = with_change(seq, "grad/L0/in_proj_w", [](Tensor& t) { t.data[0] += 1.0; });
  seq = with_change(seq, "L1/B6/d_x", [](Tensor& t) { t.data[3] *= 1.5; });
  seq = with_change(seq, "L2/F3/dt", [](Tensor& t) { t.data[1] += 1e-3; });
  golden::write_golden(tmp.file("p.h5"), gc, false);
  const golden::CheckResult r = golden::check_file(tmp.file("p.h5"));
  ASSERT_FALSE(r.pass());
  EXPECT_EQ(r.diff.first_mismatch()->path(), "seq/L2/F3/dt");
  EXPECT_EQ(r.diff.count(golden::DiffStatus::Changed), 3);
}

TEST(GoldenCheck, RoundOffWithinToleranceAndAnglesWrap) {
  golden::GoldenCase a = golden::read_golden(committed("rope_full"));
  golden::GoldenCase b = a;
  m3::Capture& cap = b.oracle[ScanMode::Sequential];
  // A relative change of 1e-13 passes; an angle moved by exactly 2π is the same angle.
  cap = with_change(cap, "L0/F4ef/k", [](Tensor& t) { t.data[0] *= 1 + 1e-13; });
  cap = with_change(cap, "L0/F5/angle_cumsum",
                    [](Tensor& t) { t.data[2] += 6.283185307179586476925286766559; });
  const golden::CaseDiff d = golden::diff_cases(a, b);
  EXPECT_EQ(d.first_mismatch(), nullptr) << golden::describe(*d.first_mismatch());
  int not_identical = 0;
  for (const auto& t : d.tensors) not_identical += !t.identical;
  EXPECT_EQ(not_identical, 2);
}

// Another implementation in the oracle's place (check_file with a Recomputer; the GPU oracle's
// path): one Capture against every stored mode, the stored tensors it lacks counted, not failed,
// and a perturbed tensor it does provide still named. The stand-in provides what the GPU oracle
// does: the sequential run's tensors of both scan modes, and every gradient.
TEST(GoldenCheck, ARecomputerOfASubsetComparesWhatItProvides) {
  TempDir tmp;
  int calls = 0;
  const golden::Recomputer both_modes{"the stand-in", [&](const m3::Problem& pb) {
                                        ++calls;
                                        const m3::Capture seq =
                                            m3::run_reference<double>(pb, ScanMode::Sequential);
                                        m3::Capture out;
                                        for (const auto& k : seq.keys()) {
                                          bool keep = k.rfind("grad/", 0) == 0;
                                          for (const auto& ks : m3::expected_stage_keys(
                                                   pb.cfg, pb.B, pb.T, ScanMode::Sequential))
                                            if (ks.key == k) keep = ks.spec->modes == m3::Modes::Both;
                                          if (keep) out.put(k, seq.at(k).shape, seq.at(k).data.data());
                                        }
                                        return out;
                                      }};
  const std::string path = committed("ragged_chunks");
  const golden::GoldenCase gc = golden::read_golden(path);
  golden::CheckResult r = golden::check_file(path, both_modes, golden::Tolerance{});
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(r.pass()) << r.line();
  int specific = 0;  // the stored tensors of one scan mode only
  for (ScanMode m : gc.modes)
    for (const auto& ks : m3::expected_stage_keys(gc.problem.cfg, gc.problem.B, gc.problem.T, m))
      specific += ks.spec->modes != m3::Modes::Both;
  EXPECT_EQ(r.diff.not_compared, specific);
  EXPECT_NE(r.line().find("; by the stand-in, " + std::to_string(specific) +
                          " stored tensors it does not provide not compared"),
            std::string::npos)
      << r.line();

  golden::GoldenCase bad = gc;
  bad.oracle[ScanMode::Chunked] = with_change(bad.oracle.at(ScanMode::Chunked), "L0/B6/d_x",
                                              [](Tensor& t) { t.data[4] += 1e-6; });
  golden::write_golden(tmp.file("bad.h5"), bad, false);
  r = golden::check_file(tmp.file("bad.h5"), both_modes, golden::Tolerance{});
  ASSERT_FALSE(r.pass());
  EXPECT_EQ(r.diff.first_mismatch()->path(), "chunked/L0/B6/d_x");
  EXPECT_EQ(count_lines(r.line()), 0);
}

TEST(GoldenDiff, NewRemovedAndInputs) {
  golden::GoldenCase a = golden::read_golden(committed("no_rope"));
  golden::GoldenCase b = a;
  b.modes = {ScanMode::Sequential};
  b.oracle.erase(ScanMode::Chunked);
  b.problem.x[0] += 1;
  const golden::CaseDiff d = golden::diff_cases(a, b);
  EXPECT_TRUE(d.inputs_changed);
  EXPECT_EQ(d.inputs_note, "inputs/x");
  EXPECT_TRUE(d.modes_changed);
  EXPECT_EQ(d.count(golden::DiffStatus::Removed),
            static_cast<int>(a.oracle.at(ScanMode::Chunked).keys().size()));
  const auto lines = golden::summarize(d, 3);
  ASSERT_GE(lines.size(), 4u);
  EXPECT_EQ(lines[0].rfind("unchanged: ", 0), 0u);
  EXPECT_NE(lines[0].find("removed: "), std::string::npos);
  EXPECT_EQ(lines.back().rfind("... and ", 0), 0u);
}

// A regenerated tensor is unchanged while its largest change is within rtol of its own scale
// (max|old|), not of 1: a tensor of values far above 1 that moves by rtol relative is unchanged;
// one that moves by twice that is changed.
TEST(GoldenDiff, TheToleranceIsRelativeToEachTensorsScale) {
  golden::GoldenCase a = golden::read_golden(committed("no_rope"));
  const ScanMode mode = ScanMode::Sequential;
  const std::string key = "L0/F3/dt";
  {  // the stored tensor 10^4 times larger: its scale far above 1
    m3::Tensor t = a.oracle.at(mode).at(key);
    for (double& v : t.data) v *= 1e4;
    a.oracle.at(mode).put(key, t.shape, t.data.data());
  }
  const std::vector<double>& v = a.oracle.at(mode).at(key).data;
  std::size_t at = 0;
  for (std::size_t i = 0; i < v.size(); ++i)
    if (std::abs(v[i]) > std::abs(v[at])) at = i;
  const double scale = std::abs(v[at]);
  ASSERT_GT(scale, 100.0) << key;
  const golden::Tolerance tol;
  auto status_after = [&](double delta) {
    golden::GoldenCase b = a;
    m3::Tensor t = b.oracle.at(mode).at(key);
    t.data[at] += delta;
    b.oracle.at(mode).put(key, t.shape, t.data.data());
    const golden::CaseDiff d = golden::diff_cases(a, b, tol);
    EXPECT_FALSE(d.inputs_changed);
    for (const golden::TensorDiff& td : d.tensors)
      if (td.mode == mode && td.key == key) return td.status;
    ADD_FAILURE() << key << " is not in the diff";
    return golden::DiffStatus::New;
  };
  EXPECT_EQ(status_after(0.5 * tol.rtol * scale), golden::DiffStatus::Unchanged) << key;
  EXPECT_EQ(status_after(2 * tol.rtol * scale), golden::DiffStatus::Changed) << key;
}

TEST(GoldenDiff, TokenInputsAreCompared) {
  const golden::GoldenCase a = golden::read_golden(committed("lm_step"));
  golden::GoldenCase b = a;
  b.problem.tgt[4] = (b.problem.tgt[4] + 1) % static_cast<std::int32_t>(a.problem.cfg.vocab_size);
  golden::CaseDiff d = golden::diff_cases(a, b);
  EXPECT_TRUE(d.inputs_changed);
  EXPECT_EQ(d.inputs_note, "inputs/tgt");
  b = a;
  b.problem.w[0] = 0.5f;
  d = golden::diff_cases(a, b);
  EXPECT_EQ(d.inputs_note, "inputs/w");
  b = a;
  b.problem.cfg.vocab_size = 0;  // the config differs first
  d = golden::diff_cases(a, b);
  EXPECT_EQ(d.inputs_note.rfind("config ", 0), 0u) << d.inputs_note;
}

// ---- the token-model case ---------------------------------------------------------------

TEST(GoldenTokenModel, CommittedCaseIsOneTrainingStep) {
  const golden::GoldenCase gc = golden::read_golden(committed("lm_step"));
  const m3::Problem& pb = gc.problem;
  ASSERT_TRUE(pb.token_model());
  EXPECT_EQ(pb.cfg.input_dim, pb.cfg.vocab_size);
  EXPECT_NE(pb.cfg.vocab_size, pb.cfg.d_model);  // a transposed head_w could not pass
  EXPECT_GT(pb.scored(), 0);
  EXPECT_LT(pb.scored(), static_cast<double>(pb.B * pb.T));  // some positions unscored
  EXPECT_EQ(gc.modes, (std::vector<ScanMode>{ScanMode::Sequential, ScanMode::Chunked}));
  for (ScanMode m : gc.modes) {
    const m3::Capture& cap = gc.oracle.at(m);
    for (const char* k : {"input_proj/input_proj_inputs", "head/logits", "loss/lse",
                          "loss/value", "head/d_logits", "head/d_Out", "grad/head_w",
                          "grad/input_proj_w", "grad/L1/in_proj_w"})
      EXPECT_NE(cap.find(k), nullptr) << m3::scan_mode_name(m) << " " << k;
    const Tensor& loss = cap.at("loss/value");
    ASSERT_EQ(loss.data.size(), 1u);
    EXPECT_TRUE(std::isfinite(loss.data[0]) && loss.data[0] > 0) << loss.data[0];
  }
  // Both modes compute the same loss up to round-off.
  EXPECT_NEAR(gc.oracle.at(ScanMode::Sequential).at("loss/value").data[0],
              gc.oracle.at(ScanMode::Chunked).at("loss/value").data[0], 1e-12);
}

TEST(GoldenTokenModel, WriterRejectsBadTokens) {
  TempDir tmp;
  golden::GoldenCase gc = golden::read_golden(committed("lm_step"));
  const auto V = static_cast<std::int32_t>(gc.problem.cfg.vocab_size);
  golden::GoldenCase bad = gc;
  bad.problem.tok[2] = V;
  std::string msg = error_of([&] { golden::write_golden(tmp.file("a.h5"), bad, false); });
  EXPECT_NE(msg.find("'/inputs/tok' holds a token out of range"), std::string::npos) << msg;
  bad = gc;
  bad.problem.tgt.pop_back();
  msg = error_of([&] { golden::write_golden(tmp.file("a.h5"), bad, false); });
  EXPECT_NE(msg.find("'/inputs/tgt' has the wrong size"), std::string::npos) << msg;
  bad = gc;
  bad.problem.x.assign(static_cast<size_t>(bad.problem.B * bad.problem.T * V), 0.0);
  msg = error_of([&] { golden::write_golden(tmp.file("a.h5"), bad, false); });
  EXPECT_NE(msg.find("holds x or d_out"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(tmp.file("a.h5")));
}

// ---- reader errors ------------------------------------------------------------------------

class GoldenReader : public ::testing::Test {
 protected:
  TempDir tmp;
  std::string src = committed("no_rope");
  std::string edited(const Edits& e) {
    const std::string p = tmp.file("edited.h5");
    copy_golden(src, p, e);
    return p;
  }
  std::string read_error(const std::string& path) {
    const std::string msg = error_of([&] { golden::read_golden(path); });
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    return msg;
  }
};

TEST_F(GoldenReader, UneditedCopyReads) {
  EXPECT_EQ(read_error(edited({})), "");
}

TEST_F(GoldenReader, SchemaVersionMismatchNamesBothAndTheFix) {
  Edits e;
  e.meta = [](const std::string& a, h5::Writer& w) {
    if (a != "schema_version") return false;
    w.attr("/meta", a, 7);
    return true;
  };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("schema version 7 found, version 1 expected"), std::string::npos) << msg;
  EXPECT_NE(msg.find("regenerate with m3h golden regen --case no_rope --force"), std::string::npos)
      << msg;
}

TEST_F(GoldenReader, MissingDatasetIsNamed) {
  Edits e;
  e.skip = "/stages/seq/L0/F3/dt";
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("missing dataset '/stages/seq/L0/F3/dt'"), std::string::npos) << msg;
}

TEST_F(GoldenReader, MissingWeightAndGradAreNamed) {
  Edits e;
  e.skip = "/weights/L0/dt_bias";
  EXPECT_NE(read_error(edited(e)).find("'/weights/L0/dt_bias'"), std::string::npos);
  e.skip = "/grads/chunked/norm_f_weight";
  EXPECT_NE(read_error(edited(e)).find("'/grads/chunked/norm_f_weight'"), std::string::npos);
}

TEST_F(GoldenReader, MisShapedDatasetIsNamedWithBothShapes) {
  Edits e;
  e.tensor = [](const std::string& p, Tensor& t) {
    if (p != "/stages/chunked/L0/F4/b_rms") return;
    t.shape = {t.shape[0] / 2, 2 * t.shape[1]};  // same element count, other shape
  };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("/stages/chunked/L0/F4/b_rms"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[4, 2]"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[8, 1]"), std::string::npos) << msg;
}

TEST_F(GoldenReader, ExtraDatasetIsRejected) {
  Edits e;
  e.extra = [](h5::Writer& w) { w.write("/stages/seq/L0/F9/bogus", Tensor{{2}, {1, 2}}, h5::DType::F64); };
  EXPECT_NE(read_error(edited(e)).find("unexpected dataset '/stages/seq/L0/F9/bogus'"),
            std::string::npos);
}

TEST_F(GoldenReader, NonFiniteValueIsNamed) {
  Edits e;
  e.tensor = [](const std::string& p, Tensor& t) {
    if (p == "/weights/L0/out_proj_w") t.data[5] = std::nan("");
  };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("/weights/L0/out_proj_w"), std::string::npos) << msg;
}

TEST_F(GoldenReader, NonF64DatasetIsRejected) {
  Edits e;
  e.dtype = h5::DType::F32;
  e.dtype_for = "/inputs/x";
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("'/inputs/x' is stored as f32"), std::string::npos) << msg;
}

TEST_F(GoldenReader, InvalidConfigIsRejected) {
  Edits e;
  e.meta = [](const std::string& a, h5::Writer& w) {
    if (a != "ngroups") return false;
    w.attr("/meta", a, 3);  // does not divide 4 heads
    return true;
  };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("invalid config"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ngroups must divide nheads"), std::string::npos) << msg;
}

// SCHEMA.md: /meta precision is "f64" and generator "mamba3-harness"; a file saying otherwise
// is refused, naming the attribute, the value found and the one expected.
TEST_F(GoldenReader, MetaPrecisionOtherThanF64IsRefused) {
  for (const std::string bad : {"f32", "bf16", "F64", ""}) {
    SCOPED_TRACE("precision '" + bad + "'");
    Edits e;
    e.meta = [bad](const std::string& a, h5::Writer& w) {
      if (a != "precision") return false;
      w.attr("/meta", a, bad);
      return true;
    };
    const std::string msg = read_error(edited(e));
    EXPECT_NE(msg.find("/meta precision is '" + bad + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected f64"), std::string::npos) << msg;
  }
}

TEST_F(GoldenReader, MetaGeneratorOtherThanTheHarnessIsRefused) {
  for (const std::string bad : {"mamba3-harnesss", "pytorch", ""}) {
    SCOPED_TRACE("generator '" + bad + "'");
    Edits e;
    e.meta = [bad](const std::string& a, h5::Writer& w) {
      if (a != "generator") return false;
      w.attr("/meta", a, bad);
      return true;
    };
    const std::string msg = read_error(edited(e));
    EXPECT_NE(msg.find("/meta generator is '" + bad + "'"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("expected ") + golden::kGenerator), std::string::npos) << msg;
  }
}

// A /meta flag (is_outproj_norm, input_proj_identity) is 0 or 1; any other integer is refused.
TEST_F(GoldenReader, AMetaFlagOtherThanZeroOrOneIsRefused) {
  for (const int bad : {2, -1}) {
    SCOPED_TRACE(bad);
    Edits e;
    e.meta = [bad](const std::string& a, h5::Writer& w) {
      if (a != "is_outproj_norm") return false;
      w.attr("/meta", a, bad);
      return true;
    };
    const std::string msg = read_error(edited(e));
    EXPECT_NE(msg.find("/meta attribute 'is_outproj_norm' must be 0 or 1"), std::string::npos)
        << msg;
  }
}

TEST_F(GoldenReader, BadFilesGiveOneLine) {
  const std::string good = slurp(src);
  write_bytes(tmp.file("empty.h5"), "");
  write_bytes(tmp.file("text.h5"), "this is not an HDF5 file\n");
  write_bytes(tmp.file("trunc.h5"), good.substr(0, good.size() / 3));
  EXPECT_NE(read_error(tmp.file("empty.h5")).find("empty"), std::string::npos);
  EXPECT_NE(read_error(tmp.file("text.h5")).find("not an HDF5 file"), std::string::npos);
  EXPECT_NE(read_error(tmp.file("trunc.h5")).find("truncated"), std::string::npos);
  EXPECT_NE(read_error(tmp.file("absent.h5")).find("does not exist"), std::string::npos);
  // An HDF5 file that is not a golden file.
  {
    h5::Writer w(tmp.file("other.h5"), false);
    w.write("/x", Tensor{{1}, {1.0}}, h5::DType::F64);
    w.commit();
  }
  EXPECT_NE(read_error(tmp.file("other.h5")).find("not a golden file"), std::string::npos);
}

// A token model's file (lm_step): the token datasets are checked and named.
class GoldenTokenReader : public GoldenReader {
 protected:
  GoldenTokenReader() { src = committed("lm_step"); }
  // The read error of lm_step with the value at `index` of dataset `path` set to `v`.
  std::string with_value(const std::string& path, Idx index, double v) {
    Edits e;
    e.tensor = [&](const std::string& p, Tensor& t) {
      if (p == path) t.data[index] = v;
    };
    return read_error(edited(e));
  }
};

TEST_F(GoldenTokenReader, UneditedCopyReads) {
  EXPECT_EQ(read_error(edited({})), "");
}

// HARNESS.md §9: a token model's stored gradients are those of S·loss, S = 2^⌈log₂ N⌉; the
// file says S in /meta (lm_step: N = 19 scored positions of 22, S = 32), and a reader (so golden
// check) refuses a file that lacks it or whose S is not the one its weights give. A backbone
// file has none.
TEST_F(GoldenTokenReader, TheFileSaysTheScaleOfItsGradients) {
  const h5::Reader r(src);
  ASSERT_TRUE(r.has_attr("/meta", "loss_scale"));
  EXPECT_EQ(r.attr_double("/meta", "loss_scale"), 32.0);
  EXPECT_EQ(golden::read_golden(src).problem.loss_scale(), 32.0);
  EXPECT_FALSE(h5::Reader(committed("no_rope")).has_attr("/meta", "loss_scale"));
  Edits missing;
  missing.meta = [](const std::string& a, h5::Writer&) { return a == "loss_scale"; };
  std::string msg = read_error(edited(missing));
  EXPECT_NE(msg.find("/meta has no loss_scale attribute"), std::string::npos) << msg;
  EXPECT_NE(msg.find("regenerate with m3h golden regen --case lm_step --force"), std::string::npos) << msg;
  Edits wrong;
  wrong.meta = [](const std::string& a, h5::Writer& w) {
    if (a != "loss_scale") return false;
    w.attr("/meta", a, 1.0);
    return true;
  };
  msg = read_error(edited(wrong));
  EXPECT_NE(msg.find("/meta loss_scale disagrees with the weights (stored 1, the weights give S = "
                     "2^ceil(log2 N) = 32 (N = 19))"),
            std::string::npos) << msg;
}

TEST_F(GoldenTokenReader, MisShapedTokenDatasetsAreNamed) {
  for (const char* path : {"/inputs/tok", "/inputs/tgt", "/inputs/w"}) {
    Edits e;
    e.tensor = [&](const std::string& p, Tensor& t) {
      if (p == path) t.shape = {2, t.shape[0] / 2};  // [B, T] instead of [B*T]
    };
    const std::string msg = read_error(edited(e));
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2, 11]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[22]"), std::string::npos) << msg;
  }
  Edits e;
  e.tensor = [](const std::string& p, Tensor& t) {
    if (p == "/inputs/tok") {
      t.shape = {t.shape[0] - 1};
      t.data.pop_back();
    }
  };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("/inputs/tok"), std::string::npos) << msg;
  EXPECT_NE(msg.find("[21]"), std::string::npos) << msg;
}

TEST_F(GoldenTokenReader, OutOfRangeTokensAndTargetsAreNamed) {
  std::string msg = with_value("/inputs/tok", 5, 24);  // = vocab_size
  EXPECT_NE(msg.find("dataset '/inputs/tok' holds a token out of range"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("24 at [5], expected 0 <= token < vocab_size = 24"), std::string::npos)
      << msg;
  msg = with_value("/inputs/tgt", 0, -1);
  EXPECT_NE(msg.find("dataset '/inputs/tgt' holds a target out of range"), std::string::npos)
      << msg;
  msg = with_value("/inputs/tok", 1, 1e10);
  EXPECT_NE(msg.find("'/inputs/tok' holds a token out of range"), std::string::npos) << msg;
}

TEST_F(GoldenTokenReader, NonIntegerTokensAreNamed) {
  std::string msg = with_value("/inputs/tgt", 7, 2.5);
  EXPECT_NE(msg.find("dataset '/inputs/tgt' holds a target that is not an integer"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("2.5 at [7]"), std::string::npos) << msg;
  msg = with_value("/inputs/tok", 0, std::nan(""));
  EXPECT_NE(msg.find("/inputs/tok"), std::string::npos) << msg;
}

TEST_F(GoldenTokenReader, BadWeightsAreNamed) {
  std::string msg = with_value("/inputs/w", 3, -1);
  EXPECT_NE(msg.find("dataset '/inputs/w' holds a negative weight"), std::string::npos) << msg;
  msg = with_value("/inputs/w", 3, 0.1);  // no float32 value: the Problem could not hold it
  EXPECT_NE(msg.find("dataset '/inputs/w' holds a weight that is not a float32 value"),
            std::string::npos)
      << msg;
  msg = with_value("/inputs/w", 3, INFINITY);
  EXPECT_NE(msg.find("/inputs/w"), std::string::npos) << msg;
  Edits e;
  e.tensor = [](const std::string& p, Tensor& t) {
    if (p == "/inputs/w") std::fill(t.data.begin(), t.data.end(), 0.0);
  };
  msg = read_error(edited(e));
  EXPECT_NE(msg.find("dataset '/inputs/w' holds weights that are all 0"), std::string::npos)
      << msg;
  // Non-binary weights ≥ 0 are fine (finite, ≥ 0, float).
  EXPECT_EQ(with_value("/inputs/w", 3, 0.5), "");
}

TEST_F(GoldenTokenReader, MissingOrNonF64TokenDatasetsAreNamed) {
  Edits e;
  e.skip = "/inputs/tgt";
  std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("missing dataset '/inputs/tgt'"), std::string::npos) << msg;
  e = {};
  e.skip = "/weights/head_w";
  msg = read_error(edited(e));
  EXPECT_NE(msg.find("missing dataset '/weights/head_w'"), std::string::npos) << msg;
  e = {};
  e.skip = "/grads/seq/head_w";
  msg = read_error(edited(e));
  EXPECT_NE(msg.find("missing dataset '/grads/seq/head_w'"), std::string::npos) << msg;
  e = {};
  e.skip = "/stages/chunked/loss/value";
  msg = read_error(edited(e));
  EXPECT_NE(msg.find("missing dataset '/stages/chunked/loss/value'"), std::string::npos) << msg;
  e = {};
  e.dtype = h5::DType::F32;
  e.dtype_for = "/inputs/tok";
  msg = read_error(edited(e));
  EXPECT_NE(msg.find("'/inputs/tok' is stored as f32"), std::string::npos) << msg;
}

TEST_F(GoldenTokenReader, BackboneInputsInATokenFileAreRejected) {
  Edits e;
  e.extra = [](h5::Writer& w) {
    w.write("/inputs/x", Tensor{{22, 24}, std::vector<double>(22 * 24, 0.0)}, h5::DType::F64);
  };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("unexpected dataset '/inputs/x'"), std::string::npos) << msg;
}

TEST_F(GoldenTokenReader, WithoutVocabSizeTheFileIsNoTokenModel) {
  // What a reader from before token models sees: vocab_size 0, so it wants /inputs/x.
  Edits e;
  e.meta = [](const std::string& a, h5::Writer&) { return a == "vocab_size"; };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("missing dataset '/inputs/x'"), std::string::npos) << msg;
}

TEST_F(GoldenTokenReader, InvalidVocabSizeIsRejected) {
  Edits e;
  e.meta = [](const std::string& a, h5::Writer& w) {
    if (a != "vocab_size") return false;
    w.attr("/meta", a, 23);  // ≠ input_dim 24
    return true;
  };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("invalid config"), std::string::npos) << msg;
  EXPECT_NE(msg.find("input_dim must equal vocab_size"), std::string::npos) << msg;
}

TEST_F(GoldenReader, TokenDatasetsInABackboneFileAreRejected) {
  Edits e;
  e.extra = [](h5::Writer& w) {
    w.write("/inputs/tok", Tensor{{8}, std::vector<double>(8, 0.0)}, h5::DType::F64);
  };
  const std::string msg = read_error(edited(e));
  EXPECT_NE(msg.find("unexpected dataset '/inputs/tok'"), std::string::npos) << msg;
}

// ---- the m3h binary ---------------------------------------------------------------------------

class GoldenCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!have_m3h()) GTEST_SKIP() << "m3h was not built (Boost.Program_options missing)";
  }
  TempDir tmp;
};

TEST_F(GoldenCli, BadFilesExit2WithOneStderrLine) {
  const std::string good = slurp(committed("no_rope"));
  write_bytes(tmp.file("empty.h5"), "");
  write_bytes(tmp.file("text.h5"), "plain text");
  write_bytes(tmp.file("trunc.h5"), good.substr(0, 4096));
  for (const char* f : {"empty.h5", "text.h5", "trunc.h5", "absent.h5"}) {
    const CliResult r = run_m3h("golden check --file '" + tmp.file(f) + "'", tmp);
    EXPECT_EQ(r.status, 2) << f;
    EXPECT_EQ(count_lines(r.err), 1) << f << ": " << r.err;
    EXPECT_EQ(r.err.rfind("m3h: error: ", 0), 0u) << r.err;
    EXPECT_NE(r.err.find(f), std::string::npos) << r.err;
    EXPECT_EQ(r.out, "") << f;
  }
}

TEST_F(GoldenCli, PerturbedFileExits1NamingTheTensor) {
  golden::GoldenCase gc = golden::read_golden(committed("outproj_norm"));
  gc.oracle[ScanMode::Sequential] = with_change(
      gc.oracle.at(ScanMode::Sequential), "L0/F7/gated_rms_vals", [](Tensor& t) { t.data[2] *= 1.01; });
  golden::write_golden(tmp.file("outproj_norm.h5"), gc, false);
  const CliResult r = run_m3h("golden check --file '" + tmp.file("outproj_norm.h5") + "'", tmp);
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_EQ(count_lines(r.out), 1) << r.out;
  EXPECT_NE(r.out.find("FAIL outproj_norm: first mismatch seq/L0/F7/gated_rms_vals"),
            std::string::npos)
      << r.out;
  EXPECT_EQ(r.err, "");
}

TEST_F(GoldenCli, CheckAllOnACopyPassesAndAMissingCaseIsExit2) {
  for (const auto& d : golden::builtin_cases())
    if (d.name != "default" && d.name != "official_small")
      fs::copy_file(committed(d.name), tmp.file(d.name + ".h5"));
  // Two built-in cases are missing from this folder: exit 2, one stderr line each.
  CliResult r = run_m3h("golden check --all --dir '" + tmp.str() + "'", tmp);
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 2) << r.err;
  EXPECT_EQ(count_lines(r.out), static_cast<int>(golden::builtin_cases().size()) - 2) << r.out;
  r = run_m3h("golden check --case no_rope --case ngroups2 --dir '" + tmp.str() + "'", tmp);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
  EXPECT_EQ(r.out.rfind("PASS no_rope", 0), 0u) << r.out;
}

// --device gpu-oracle: every line a PASS by the GPU oracle where a device is present, else one
// stderr line saying why (exit 2); a device other than cpu or gpu-oracle, or --device on
// another action, is bad usage.
TEST_F(GoldenCli, DeviceGpuOracleChecksOrSaysWhyNot) {
  CliResult r = run_m3h("golden check --case no_rope --case lm_step --device gpu-oracle", tmp);
  if (r.status == 0) {
    EXPECT_EQ(count_lines(r.out), 2) << r.out;
    EXPECT_EQ(r.out.rfind("PASS no_rope", 0), 0u) << r.out;
    EXPECT_NE(r.out.find("by the GPU oracle"), std::string::npos) << r.out;
  } else {
    EXPECT_EQ(r.status, 2) << r.out << r.err;
    EXPECT_EQ(count_lines(r.err), 1) << r.err;
    EXPECT_NE(r.err.find("m3h: error: golden check --device gpu-oracle: no usable GPU"),
              std::string::npos)
        << r.err;
    EXPECT_EQ(r.out, "");
  }
  r = run_m3h("golden check --case no_rope --device gpu", tmp);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("expected cpu or gpu-oracle"), std::string::npos) << r.err;
  r = run_m3h("golden list --device gpu-oracle", tmp);
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.err.find("--device is for check"), std::string::npos) << r.err;
}

TEST_F(GoldenCli, RegenWithoutForceRefusesAndLeavesTheFileAlone) {
  const std::string path = tmp.file("no_rope.h5");
  fs::copy_file(committed("no_rope"), path);
  const std::string before = slurp(path);
  const CliResult r = run_m3h("golden regen --case no_rope --dir '" + tmp.str() + "'", tmp);
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("file exists"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--force"), std::string::npos) << r.err;
  EXPECT_EQ(slurp(path), before);
  size_t n_files = 0;
  for (const auto& e : fs::directory_iterator(tmp.str())) n_files += e.path().extension() == ".h5";
  EXPECT_EQ(n_files, 1u);  // no temporary file left behind
}

TEST_F(GoldenCli, RegenForceOnAnUnchangedCaseReportsNothingChanged) {
  const std::string path = tmp.file("ngroups2.h5");
  fs::copy_file(committed("ngroups2"), path);
  CliResult r = run_m3h("golden regen --case ngroups2 --force --dir '" + tmp.str() + "'", tmp);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("changed: 0; new: 0; removed: 0; shape: 0"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("inputs changed"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("wrote"), std::string::npos) << r.out;
  r = run_m3h("golden check --file '" + path + "'", tmp);
  EXPECT_EQ(r.status, 0) << r.out << r.err;
}

TEST_F(GoldenCli, RegenForceReportsWhatChanged) {
  // An old file whose stored oracle differs in one tensor: regen --force names it.
  golden::GoldenCase gc = golden::read_golden(committed("ngroups2"));
  gc.oracle[ScanMode::Chunked] = with_change(gc.oracle.at(ScanMode::Chunked), "L0/B3/d_proj",
                                             [](Tensor& t) { t.data[0] += 0.5; });
  golden::write_golden(tmp.file("ngroups2.h5"), gc, false);
  const CliResult r =
      run_m3h("golden regen --case ngroups2 --force --dir '" + tmp.str() + "'", tmp);
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_NE(r.out.find("changed: 1;"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("changed: chunked/L0/B3/d_proj max_abs 0.5"), std::string::npos) << r.out;
}

// golden check on a file that is no golden file suggests only what works: an m3h dump is
// said to be one (no "regen --case <its stem>", which is no case); every line of regen is
// headed "m3h golden: <case>: ".
TEST_F(GoldenCli, CheckOnADumpSaysSoAndRegenLinesNameTheTool) {
  CliResult r = run_m3h("dump --device cpu --stage 'L0/F3/dt' --layers 1 --B 1 --T 8 --out '" +
                            tmp.file("y.h5") + "'",
                        tmp);
  ASSERT_EQ(r.status, 0) << r.err;
  r = run_m3h("golden check --golden '" + tmp.file("y.h5") + "'", tmp);
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(count_lines(r.err), 1) << r.err;
  EXPECT_NE(r.err.find("an m3h dump, not a golden file"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("--case"), std::string::npos) << r.err;
  fs::copy_file(committed("ngroups2"), tmp.file("ngroups2.h5"));
  r = run_m3h("golden regen --case ngroups2 --force --dir '" + tmp.str() + "'", tmp);
  ASSERT_EQ(r.status, 0) << r.err;
  ASSERT_GE(count_lines(r.out), 3) << r.out;  // replacing, the comparison, wrote
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);)
    EXPECT_EQ(line.rfind("m3h golden: ngroups2: ", 0), 0u) << line;
}

TEST_F(GoldenCli, UsageErrorsExit2) {
  for (const char* args : {"golden", "golden frobnicate", "golden regen", "golden regen --all --case no_rope",
                           "golden check --case nope", "golden check stray"}) {
    const CliResult r = run_m3h(args, tmp);
    EXPECT_EQ(r.status, 2) << args;
    EXPECT_EQ(count_lines(r.err), 1) << args << ": " << r.err;
  }
}

}  // namespace
