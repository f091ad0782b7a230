// harness/digest_record.hpp: the text of a determinism digest record read back exactly, every
// malformed record refused with a one-line error naming its file and line, and the comparison
// of a cell with its record (what moved, what is on one side only, the first of them in the
// current cell's execution order); a cell whose digest is not that of its hashes refused; and
// every committed card record (the H200's among them) whole, for every cell, made on the card its
// name says, and for the default preset's problem.
#include <gtest/gtest.h>

#include <cctype>
#include <filesystem>
#include <fstream>
#include <string>

#include "determinism.hpp"
#include "digest_record.hpp"
#include "error.hpp"
#include "presets.hpp"
#include "test_io.hpp"

namespace {

using m3::harness::DigestCell;
using m3::harness::DigestRecord;
using m3::harness::digest_of;

DigestRecord sample() {
  DigestRecord r;
  r.environment = "NVIDIA H200, sm_90, CUDA runtime 13.0, cuBLAS 13.1.0";
  r.problem = "seed=1234 B=2 T=256 d_model=128";
  const std::vector<std::uint64_t> h = {0x0123456789abcdefull, 0xfedcba9876543210ull};
  r.cells.push_back({"bf16", "chunked", digest_of(h), {"L0/F1/x", "L0/B6/d_q"}, h});
  r.cells.push_back({"f32", "seq", digest_of({0x1ull}), {"L0/F1/x"}, {0x1ull}});
  return r;
}

struct Files : m3::test::TempDir {
  Files() : m3::test::TempDir("m3_digests_") {}
  std::string put(const std::string& name, const std::string& text) const {
    const std::string p = (dir / name).string();
    std::ofstream(p) << text;
    return p;
  }
};

// The error text of reading `text` as a record, or "" when it reads.
std::string refusal(const Files& f, const std::string& text) {
  try {
    m3::harness::read_digest_record(f.put("r.txt", text));
  } catch (const m3::Error& e) {
    return e.what();
  }
  return "";
}

TEST(DigestRecord, TextReadsBackExactly) {
  Files f;
  const DigestRecord r = sample();
  const std::string text = m3::harness::format_digest_record(r);
  const DigestRecord back = m3::harness::read_digest_record(f.put("r.txt", text));
  EXPECT_EQ(back.environment, r.environment);
  EXPECT_EQ(back.problem, r.problem);
  ASSERT_EQ(back.cells.size(), 2u);
  for (size_t c = 0; c < 2; ++c) {
    EXPECT_EQ(back.cells[c].precision, r.cells[c].precision);
    EXPECT_EQ(back.cells[c].scan, r.cells[c].scan);
    EXPECT_EQ(back.cells[c].digest, r.cells[c].digest);
    EXPECT_EQ(back.cells[c].keys, r.cells[c].keys);
    EXPECT_EQ(back.cells[c].hashes, r.cells[c].hashes);
  }
  EXPECT_EQ(m3::harness::format_digest_record(back), text);
  ASSERT_NE(back.find("f32", "seq"), nullptr);
  EXPECT_EQ(back.find("f32", "chunked"), nullptr);
  EXPECT_NE(text.find("cell: bf16 chunked " + m3::harness::hex16(r.cells[0].digest) + " 2\n"),
            std::string::npos)
      << text;
}

TEST(DigestRecord, MalformedRecordsAreRefusedNamingTheLine) {
  Files f;
  // A cell of two tensors, hashes 1 and 2, with the digest of those hashes.
  const std::string head = "m3h-digests 1\nenvironment: E\nproblem: P\ncell: f32 seq " +
                           m3::harness::hex16(digest_of({1, 2})) + " 2\n";
  struct Case {
    const char* what;
    std::string text, says;
  };
  const Case cases[] = {
      {"empty", "", "empty"},
      {"another format", "{\"cells\": []}\n", "r.txt:1: not a digest record"},
      {"a short hash", head + "a 0123\nb 0000000000000002\n", "r.txt:5: a tensor line"},
      {"a hash that is not hex", head + "a 012345678901234z\nb 0000000000000002\n", "r.txt:5"},
      {"a count short of its lines", head + "a 0000000000000001\n", "r.txt:5: the last cell has 1"},
      {"a line beyond the count",
       head + "a 0000000000000001\nb 0000000000000002\nc 0000000000000003\n", "r.txt:7: a line"},
      {"a key twice", head + "a 0000000000000001\na 0000000000000002\n", "r.txt:6: tensor a twice"},
      {"a cell twice",
       head + "a 0000000000000001\nb 0000000000000002\ncell: f32 seq 0000000000000001 1\n"
              "a 0000000000000001\n",
       "r.txt:7: a second cell f32 seq"},
      {"a bad count",
       "m3h-digests 1\nenvironment: E\nproblem: P\ncell: f32 seq 0000000000000001 x\n",
       "r.txt:4: the cell's tensor count"},
      {"a cell before the headers", "m3h-digests 1\ncell: f32 seq 0000000000000001 1\n",
       "r.txt:2: a cell before"},
      {"no cell", "m3h-digests 1\nenvironment: E\nproblem: P\n", "no cell"},
      {"a hash edited (the last cell)", head + "a 0000000000000001\nb 0000000000000003\n",
       "r.txt:4: cell f32 seq's digest " + m3::harness::hex16(digest_of({1, 2})) +
           " is not that of its 2 tensor hashes (" + m3::harness::hex16(digest_of({1, 3})) +
           "): an edited record"},
      {"a digest edited (a cell before another)",
       "m3h-digests 1\nenvironment: E\nproblem: P\ncell: f32 seq 0000000000000001 1\n"
       "a 0000000000000001\ncell: f32 chunked " +
           m3::harness::hex16(digest_of({1})) + " 1\na 0000000000000001\n",
       "r.txt:4: cell f32 seq's digest 0000000000000001 is not that of its 1 tensor hashes"},
  };
  for (const Case& c : cases) {
    const std::string err = refusal(f, c.text);
    EXPECT_NE(err.find(c.says), std::string::npos) << c.what << ": " << err;
    EXPECT_EQ(err.find('\n'), std::string::npos) << c.what << ": more than one line";
  }
  EXPECT_EQ(refusal(f, head + "# a comment\n\na 0000000000000001\nb 0000000000000002\n"), "")
      << "comments and blank lines are skipped";
  try {
    m3::harness::read_digest_record((f.dir / "nowhere.txt").string());
    ADD_FAILURE() << "a missing file was read";
  } catch (const m3::Error& e) {
    EXPECT_NE(std::string(e.what()).find("nowhere.txt"), std::string::npos) << e.what();
  }
}

TEST(DigestRecord, DiffNamesTheFirstMovedTensorInTheCurrentOrder) {
  const DigestCell rec{"bf16", "chunked", 0, {"a", "b", "c", "d"}, {1, 2, 3, 4}};
  EXPECT_TRUE(m3::harness::diff_digests(rec, rec).same());

  DigestCell now = rec;
  now.hashes[2] = 30, now.hashes[3] = 40;  // c and d moved
  auto d = m3::harness::diff_digests(rec, now);
  EXPECT_FALSE(d.same());
  EXPECT_EQ(d.differ, 2);
  EXPECT_EQ(d.missing, 0);
  EXPECT_EQ(d.first_key, "c");
  EXPECT_EQ(d.recorded, 3u);
  EXPECT_EQ(d.now, 30u);

  now = rec;  // b gone, e new: one side only, both counted; the first is e (the current order)
  now.keys = {"a", "e", "c", "d"};
  d = m3::harness::diff_digests(rec, now);
  EXPECT_EQ(d.differ, 0);
  EXPECT_EQ(d.missing, 2);
  EXPECT_EQ(d.first_key, "e");
  EXPECT_EQ(d.recorded, 0u);

  now = rec;  // only a recorded tensor absent now
  now.keys.pop_back(), now.hashes.pop_back();
  d = m3::harness::diff_digests(rec, now);
  EXPECT_EQ(d.missing, 1);
  EXPECT_EQ(d.first_key, "d");
  EXPECT_EQ(d.now, 0u);
}

// The records gpu-check holds a card's determinism step to (golden/digests/README.md): each
// golden/digests/CARD-default.txt reads (every cell's digest that of its hashes), was made on the
// card its name says, has the six cells of m3h determinism's default run, and is for the problem
// that run builds. A change to the default preset fails here, not on the device: re-record on
// each card (the digests-record step) and commit the records with the change. The H200's record
// must be among them.
void expect_whole_default_record(const std::string& path, const std::string& card) {
  SCOPED_TRACE(path);
  const DigestRecord r = m3::harness::read_digest_record(path);
  EXPECT_EQ(r.environment.rfind("NVIDIA " + card, 0), 0u)
      << "recorded on '" << r.environment << "', but the file name says the " << card;
  EXPECT_NE(r.environment.find(", sm_90, "), std::string::npos) << r.environment;
  const m3::harness::RunSpec spec = m3::harness::preset_spec(m3::harness::find_preset("default"));
  EXPECT_EQ(r.problem, m3::harness::digest_problem(spec))
      << "the default preset changed: re-record " << path << " on the " << card;
  ASSERT_EQ(r.cells.size(), 6u);
  for (const char* precision : {"f32", "bf16", "f16"}) {
    for (const char* scan : {"seq", "chunked"}) {
      const DigestCell* c = r.find(precision, scan);
      ASSERT_NE(c, nullptr) << precision << " " << scan;
      EXPECT_GT(c->keys.size(), 300u) << precision << " " << scan << ": every tensor, not a few";
    }
  }
  // Sequential and chunked runs share the forward's prefix: the first tensor (the input) and the
  // norms before the scan carry the same bits in both scan modes of one precision.
  for (const char* precision : {"f32", "bf16", "f16"}) {
    const DigestCell &seq = *r.find(precision, "seq"), &chunked = *r.find(precision, "chunked");
    ASSERT_EQ(seq.keys.front(), chunked.keys.front());
    EXPECT_EQ(seq.hashes.front(), chunked.hashes.front()) << precision;
  }
}

}  // namespace

TEST(DigestRecord, EveryCommittedCardRecordIsWholeAndForTheDefaultProblem) {
  namespace fs = std::filesystem;
  const std::string suffix = "-default.txt";
  int n = 0;
  bool h200 = false;
  for (const fs::directory_entry& e : fs::directory_iterator(M3_DIGESTS_DIR)) {
    const std::string name = e.path().filename().string();
    if (name.size() <= suffix.size() || name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    std::string card = name.substr(0, name.size() - suffix.size());  // "h100" → "H100"
    for (char& ch : card) ch = char(std::toupper(static_cast<unsigned char>(ch)));
    expect_whole_default_record(e.path().string(), card);
    ++n, h200 = h200 || card == "H200";
  }
  EXPECT_TRUE(h200) << M3_DIGESTS_DIR << ": no h200-default.txt";
  EXPECT_GE(n, 1);
}
