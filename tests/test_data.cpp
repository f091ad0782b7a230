// The data of training (train/data.hpp, TRAINING.md §3): the counter-based generator is pure
// (same integers → same bytes; each integer matters; a row does not depend on B); text files
// split as documented (training windows never touch the validation part, validation windows
// fixed at stride T, wrapping, ⌊(S_val − 1)/T⌋ of them, all inside the file even where T
// divides S_val), every file error says which file and why; the tasks' targets
// recomputed here from the tokens alone (parity prefix, modular running value, selective-copy
// answers), scored positions as documented; accuracy counting; encode/decode; bad options.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "data.hpp"
#include "test_io.hpp"
#include "error.hpp"
#include "params.hpp"

namespace {

namespace fs = std::filesystem;
using m3::Idx;
using m3::train::Batch;
using m3::train::Dataset;
using Options = std::vector<std::pair<std::string, std::string>>;

// A fresh directory per test, removed at the end.
struct TempDir : m3::test::TempDir {
  TempDir() : m3::test::TempDir("m3_data_") {}
  std::string write(const std::string& name, const std::string& bytes) const {
    const fs::path p = dir / name;
    std::ofstream(p, std::ios::binary) << bytes;
    return p.string();
  }
};

// Seeded random bytes (all 256 values occur), so a window of 16+ bytes locates its offset.
std::string random_bytes(std::size_t n, std::uint64_t seed) {
  m3::Rng rng(seed);
  std::string s(n, '\0');
  for (auto& c : s) c = static_cast<char>(rng.next() >> 56);
  return s;
}

// The m3::Error thrown by f; fails the test when none is thrown or the message is not one line
// or lacks one of the pieces.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& pieces) {
  try {
    f();
  } catch (const m3::Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const auto& p : pieces)
      EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
    return;
  }
  ADD_FAILURE() << "no m3::Error thrown";
}

bool same(const Batch& a, const Batch& b) {
  return a.B == b.B && a.T == b.T && a.tok == b.tok && a.tgt == b.tgt && a.w == b.w;
}

// Row b of a batch as its own batch.
Batch row_of(const Batch& x, Idx b) { return m3::train::slice_rows(x, b, 1); }

// The offset of a text row in the file (npos when the row is not a window of the file).
std::size_t find_window(const std::string& file, const Batch& x, Idx b) {
  std::string w;
  for (Idx t = 0; t < x.T; ++t)
    w += static_cast<char>(x.tok[static_cast<std::size_t>(b * x.T + t)]);
  w += static_cast<char>(x.tgt[static_cast<std::size_t>(b * x.T + x.T - 1)]);
  return file.find(w);
}

std::vector<std::unique_ptr<Dataset>> every_task(Idx T) {
  std::vector<std::unique_ptr<Dataset>> out;
  out.push_back(m3::train::make_task("parity", {}, T));
  out.push_back(m3::train::make_task("modular", {}, T));
  out.push_back(m3::train::make_task("selective-copy", {}, T));
  return out;
}

// Purity and sensitivity of one dataset: same integers → same bytes; seed, step and micro
// each change the batch; a row does not depend on B; validation rows depend on j = i·B + b only.
void check_pure(const Dataset& d, Idx T) {
  SCOPED_TRACE(d.kind());
  const Batch a = d.train_batch(7, 3, 1, 8, T);
  EXPECT_TRUE(same(a, d.train_batch(7, 3, 1, 8, T)));
  EXPECT_FALSE(same(a, d.train_batch(8, 3, 1, 8, T)));
  EXPECT_FALSE(same(a, d.train_batch(7, 4, 1, 8, T)));
  EXPECT_FALSE(same(a, d.train_batch(7, 3, 0, 8, T)));
  // Rows differ from each other (the row index is in the seed).
  std::set<std::vector<std::int32_t>> rows;
  for (Idx b = 0; b < 8; ++b) rows.insert(row_of(a, b).tok);
  EXPECT_GE(rows.size(), 7u);
  // A smaller batch is a prefix of a larger one.
  EXPECT_TRUE(same(d.train_batch(7, 3, 1, 3, T), m3::train::slice_rows(a, 0, 3)));
  // Validation: fixed, and row j is the same whichever (i, B) reaches it.
  const Batch v = d.val_batch(0, 8, T);
  EXPECT_TRUE(same(v, d.val_batch(0, 8, T)));
  EXPECT_TRUE(same(d.val_batch(1, 4, T), m3::train::slice_rows(v, 4, 4)));
  EXPECT_FALSE(same(v, a));
  // Every token and target inside the vocabulary; weights 0 or 1.
  for (const Batch* x : {&a, &v})
    for (std::size_t r = 0; r < x->tok.size(); ++r) {
      EXPECT_GE(x->tok[r], 0);
      EXPECT_LT(x->tok[r], d.vocab());
      EXPECT_GE(x->tgt[r], 0);
      EXPECT_LT(x->tgt[r], d.vocab());
      EXPECT_TRUE(x->w[r] == 0.0f || x->w[r] == 1.0f);
    }
}

// ---------------------------------------------------------------------------------------------
// Data: the generator and the helpers
// ---------------------------------------------------------------------------------------------

TEST(Data, RowSeedChangesWithEveryField) {
  using m3::train::row_seed;
  const std::uint64_t s = row_seed(1, 2, 3, 4, 5);
  EXPECT_EQ(s, row_seed(1, 2, 3, 4, 5));
  EXPECT_NE(s, row_seed(0, 2, 3, 4, 5));
  EXPECT_NE(s, row_seed(1, 1, 3, 4, 5));
  EXPECT_NE(s, row_seed(1, 2, 2, 4, 5));
  EXPECT_NE(s, row_seed(1, 2, 3, 3, 5));
  EXPECT_NE(s, row_seed(1, 2, 3, 4, 4));
  // Swapping two fields is a different seed (the fields are not summed).
  EXPECT_NE(row_seed(1, 2, 3, 4, 5), row_seed(1, 3, 2, 4, 5));
  EXPECT_NE(row_seed(1, 2, 3, 4, 5), row_seed(1, 2, 4, 3, 5));
  // No collisions over a small grid.
  std::set<std::uint64_t> seen;
  for (Idx step = 1; step <= 20; ++step)
    for (Idx micro = 0; micro < 4; ++micro)
      for (Idx row = 0; row < 16; ++row) seen.insert(row_seed(42, step, micro, row, 1));
  EXPECT_EQ(seen.size(), 20u * 4u * 16u);
}

TEST(Data, UniformIndexIsInRangeAndCoversIt) {
  m3::Rng rng(3);
  std::vector<int> count(7, 0);
  for (int k = 0; k < 7000; ++k) {
    const std::uint64_t x = m3::train::uniform_index(rng, 7);
    ASSERT_LT(x, 7u);
    ++count[x];
  }
  for (int c : count) {
    EXPECT_GT(c, 850);
    EXPECT_LT(c, 1150);
  }
  EXPECT_EQ(m3::train::uniform_index(rng, 1), 0u);
  EXPECT_THROW(m3::train::uniform_index(rng, 0), m3::Error);
}

TEST(Data, Fnv1a64MatchesPublishedValues) {
  using m3::train::fnv1a64;
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar", 6), 0x85944171f73967e8ull);
}

TEST(Data, TaskNamesAndKinds) {
  EXPECT_EQ(m3::train::task_names(),
            (std::vector<std::string>{"parity", "modular", "selective-copy"}));
  for (const auto& name : m3::train::task_names())
    EXPECT_EQ(m3::train::make_task(name, {}, 64)->kind(), name);
}

TEST(Data, EveryTaskIsPure) {
  for (const auto& d : every_task(64)) check_pure(*d, 64);
}

TEST(Data, SliceRowsTakesWholeRows) {
  const auto d = m3::train::make_task("parity", {}, 8);
  const Batch a = d->train_batch(1, 1, 0, 4, 8);
  const Batch s = m3::train::slice_rows(a, 1, 2);
  EXPECT_EQ(s.B, 2);
  EXPECT_EQ(s.T, 8);
  EXPECT_EQ(s.tok, std::vector<std::int32_t>(a.tok.begin() + 8, a.tok.begin() + 24));
  EXPECT_EQ(s.w, std::vector<float>(a.w.begin() + 8, a.w.begin() + 24));
  EXPECT_THROW(m3::train::slice_rows(a, 3, 2), m3::Error);
  EXPECT_THROW(m3::train::slice_rows(a, -1, 1), m3::Error);
}

TEST(Data, BadBatchArgumentsAreRejected) {
  const auto d = m3::train::make_task("parity", {}, 16);
  expect_error([&] { d->train_batch(1, 0, 0, 2, 16); }, {"task parity", "step", "step = 0"});
  expect_error([&] { d->train_batch(1, 1, -1, 2, 16); }, {"micro"});
  expect_error([&] { d->train_batch(1, 1, 0, 0, 16); }, {"B = 0"});
  expect_error([&] { d->val_batch(-1, 2, 16); }, {"i = -1"});
}

// ---------------------------------------------------------------------------------------------
// Text
// ---------------------------------------------------------------------------------------------

TEST(Text, SplitSizesAndSettings) {
  TempDir tmp;
  const std::string bytes = random_bytes(1000, 1);
  const std::string path = tmp.write("a.bin", bytes);
  const auto d = m3::train::make_text_dataset(path, 0.1, 16);
  EXPECT_EQ(d->kind(), "text");
  EXPECT_EQ(d->vocab(), 256);
  EXPECT_EQ(d->content_size(), 1000);
  EXPECT_EQ(d->content_hash(), m3::train::fnv1a64(bytes.data(), bytes.size()));
  EXPECT_FALSE(d->sequence_accuracy());
  EXPECT_EQ(d->settings(), (Options{{"data", path}, {"val_fraction", "0.1"}}));
  EXPECT_EQ(m3::train::make_text_dataset(path, 0.05, 16)->settings()[1].second, "0.05");
  // Validation = the last 100 bytes: windows at 900, 916, … while 17 bytes fit: ⌊99/16⌋ = 6.
  EXPECT_EQ(d->val_windows(16), 6);
  EXPECT_EQ(d->val_windows(99), 1);
  EXPECT_EQ(d->max_T(), 99);
  EXPECT_EQ(find_window(bytes, d->val_batch(0, 1, 16), 0), 900u);
  // ⌊S·f⌋: 1000 · 0.333 = 333 validation bytes.
  const auto third = m3::train::make_text_dataset(path, 0.333, 16);
  EXPECT_EQ(find_window(bytes, third->val_batch(0, 1, 16), 0), 667u);
}

TEST(Text, TrainingWindowsNeverTouchTheValidationPart) {
  TempDir tmp;
  const std::string bytes = random_bytes(200, 2);
  const auto d = m3::train::make_text_dataset(tmp.write("a.bin", bytes), 0.25, 16);
  const std::size_t S_train = 150, T = 16;
  std::set<std::size_t> offsets;
  for (Idx step = 1; step <= 100; ++step)
    for (Idx micro = 0; micro < 2; ++micro) {
      const Batch x = d->train_batch(99, step, micro, 8, 16);
      ASSERT_EQ(x.scored(), 8 * 16);
      for (Idx b = 0; b < 8; ++b) {
        const std::size_t o = find_window(bytes, x, b);
        ASSERT_NE(o, std::string::npos);
        ASSERT_LE(o + T, S_train - 1) << "the window's last byte is in the validation part";
        for (std::size_t t = 0; t < T; ++t) {
          ASSERT_EQ(x.tok[b * T + t], static_cast<unsigned char>(bytes[o + t]));
          ASSERT_EQ(x.tgt[b * T + t], static_cast<unsigned char>(bytes[o + t + 1]));
        }
        offsets.insert(o);
      }
    }
  // 1600 draws over the 134 possible offsets 0 … 133 reach both ends.
  EXPECT_EQ(*offsets.begin(), 0u);
  EXPECT_EQ(*offsets.rbegin(), S_train - T - 1);
  EXPECT_GT(offsets.size(), 125u);
}

TEST(Text, IsPure) {
  TempDir tmp;
  const auto d = m3::train::make_text_dataset(tmp.write("a.bin", random_bytes(5000, 3)), 0.2, 32);
  check_pure(*d, 32);
}

TEST(Text, ValidationIsFixedAtStrideTAndWraps) {
  TempDir tmp;
  const std::string bytes = random_bytes(1000, 4);
  const auto d = m3::train::make_text_dataset(tmp.write("a.bin", bytes), 0.1, 16);
  const Idx W = d->val_windows(16);  // 6
  const Batch v = d->val_batch(0, 4, 16);
  const Batch v2 = d->val_batch(1, 4, 16);  // windows 4, 5, then 0, 1 again
  for (Idx b = 0; b < 4; ++b) {
    EXPECT_EQ(find_window(bytes, v, b), 900u + 16u * static_cast<std::size_t>(b));
    EXPECT_EQ(v.scored(), 4 * 16);
  }
  EXPECT_EQ(find_window(bytes, v2, 0), 900u + 16u * 4);
  EXPECT_EQ(find_window(bytes, v2, 1), 900u + 16u * 5);
  EXPECT_TRUE(same(row_of(v2, 2), row_of(v, 0)));
  EXPECT_TRUE(same(row_of(v2, 3), row_of(v, 1)));
  EXPECT_EQ(W, 6);
  // Targets are the next bytes.
  for (Idx t = 0; t < 16; ++t)
    EXPECT_EQ(v.tgt[static_cast<std::size_t>(t)], static_cast<unsigned char>(bytes[901 + t]));
}

// Where T divides the validation part's size, ⌊(S_val − 1)/T⌋ is one less than S_val/T: the
// last stride-T window would need the byte after the file's end as its final target. Every
// window served must lie inside the file, and the cycle must wrap before that one.
TEST(Text, ValidationWindowsWhereTDividesThePartStayInsideTheFile) {
  TempDir tmp;
  const std::string bytes = random_bytes(1000, 6);
  const auto d = m3::train::make_text_dataset(tmp.write("a.bin", bytes), 0.1, 20);
  // The validation part is bytes 900 … 999 (100 bytes).
  for (const Idx T : {20, 25, 50, 10, 4, 1}) {
    SCOPED_TRACE("T = " + std::to_string(T));
    const Idx W = d->val_windows(T);
    EXPECT_EQ(W, 99 / T);
    const Batch v = d->val_batch(0, W + 1, T);
    for (Idx b = 0; b < W; ++b) {
      const std::size_t o = find_window(bytes, v, b);
      ASSERT_EQ(o, 900u + static_cast<std::size_t>(b * T)) << "window " << b;
      EXPECT_LE(o + static_cast<std::size_t>(T) + 1, bytes.size()) << "window " << b;
    }
    EXPECT_TRUE(same(row_of(v, W), row_of(v, 0))) << "window " << W << " must wrap to window 0";
  }
}

TEST(Text, HashFollowsTheBytes) {
  TempDir tmp;
  std::string bytes = random_bytes(3000, 5);
  const auto a = m3::train::make_text_dataset(tmp.write("a.bin", bytes), 0.1, 8);
  const auto same_bytes = m3::train::make_text_dataset(tmp.write("b.bin", bytes), 0.1, 8);
  bytes[1234] = static_cast<char>(bytes[1234] ^ 1);
  const auto changed = m3::train::make_text_dataset(tmp.write("c.bin", bytes), 0.1, 8);
  EXPECT_EQ(a->content_hash(), same_bytes->content_hash());
  EXPECT_NE(a->content_hash(), changed->content_hash());
  EXPECT_EQ(a->content_size(), changed->content_size());
}

TEST(Text, EncodeDecodeRoundTrip) {
  TempDir tmp;
  const auto d = m3::train::make_text_dataset(tmp.write("a.bin", random_bytes(100, 6)), 0.5, 8);
  std::string all;
  for (int c = 0; c < 256; ++c) all += static_cast<char>(c);
  const auto tok = d->encode(all);
  ASSERT_EQ(tok.size(), 256u);
  for (int c = 0; c < 256; ++c) EXPECT_EQ(tok[static_cast<std::size_t>(c)], c);
  EXPECT_EQ(d->decode(tok), all);
  expect_error([&] { d->decode({65, 256}); }, {"token 256", "position 1"});
  expect_error([&] { d->decode({-1}); }, {"token -1"});
}

TEST(Text, MissingFileIsNamed) {
  TempDir tmp;
  const std::string path = (tmp.dir / "nope.txt").string();
  expect_error([&] { m3::train::make_text_dataset(path, 0.05, 8); }, {path, "does not exist"});
  expect_error([&] { m3::train::make_text_dataset("", 0.05, 8); }, {"no file name"});
}

TEST(Text, DirectoryIsNotARegularFile) {
  TempDir tmp;
  expect_error([&] { m3::train::make_text_dataset(tmp.dir.string(), 0.05, 8); },
               {tmp.dir.string(), "not a regular file", "directory"});
}

TEST(Text, EmptyFileIsRejected) {
  TempDir tmp;
  const std::string path = tmp.write("empty.txt", "");
  expect_error([&] { m3::train::make_text_dataset(path, 0.05, 8); }, {path, "is empty"});
}

// A regular file the process cannot open for reading: one without permissions, or, for root
// (whom file permissions do not stop, as in CI), a write-only sysctl, which procfs refuses to
// open for reading even to root.
TEST(Text, UnreadableFileIsRejected) {
  TempDir tmp;
  std::string path = "/proc/sys/vm/compact_memory";
  const bool root = ::geteuid() == 0;
  if (!root) {
    path = tmp.write("secret.txt", random_bytes(100, 7));
    fs::permissions(path, fs::perms::none);
  } else {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec) || std::ifstream(path).is_open())
      GTEST_SKIP() << "running as root, and " << path
                   << " is missing or readable here: no file to stop root from reading";
  }
  expect_error([&] { m3::train::make_text_dataset(path, 0.05, 8); },
               {path, "cannot be opened", "Permission denied"});
  if (!root) fs::permissions(path, fs::perms::owner_all);
}

TEST(Text, TooShortPartsSayHowManyBytes) {
  TempDir tmp;
  const std::string path = tmp.write("short.txt", random_bytes(100, 8));
  // 100 bytes, val 0.05 → validation 5 bytes, training 95; T = 8 needs 9.
  expect_error([&] { m3::train::make_text_dataset(path, 0.05, 8); },
               {path, "validation part is shorter than T+1", "it has 5 bytes", "needs 9"});
  // val 0.5 → training 50 bytes; T = 60 needs 61.
  expect_error([&] { m3::train::make_text_dataset(path, 0.5, 60); },
               {path, "training part is shorter than T+1", "it has 50 bytes", "needs 61"});
  // Built for T = 8, then asked for a longer T.
  const auto d = m3::train::make_text_dataset(path, 0.5, 8);
  expect_error([&] { d->train_batch(1, 1, 0, 1, 50); }, {path, "it has 50 bytes", "needs 51"});
  expect_error([&] { d->val_batch(0, 1, 50); }, {path, "needs 51"});
  EXPECT_NO_THROW(d->train_batch(1, 1, 0, 1, 49));
}

TEST(Text, BadValFractionIsRejected) {
  TempDir tmp;
  const std::string path = tmp.write("a.txt", random_bytes(1000, 9));
  for (double f : {0.0, 1.0, -0.1, 1.5, std::nan("")})
    expect_error([&] { m3::train::make_text_dataset(path, f, 8); }, {path, "val_fraction"});
  expect_error([&] { m3::train::make_text_dataset(path, 0.1, 0); }, {path, "T = 0"});
}

TEST(Text, LongOrOddFileNamesAreCut) {
  const std::string path = "/nonexistent/" + std::string(500, 'x') + "\n";
  try {
    m3::train::make_text_dataset(path, 0.05, 8);
    ADD_FAILURE() << "no error";
  } catch (const m3::Error& e) {
    const std::string msg = e.what();
    EXPECT_LT(msg.size(), 330u) << msg;
    EXPECT_NE(msg.find("(514 bytes)"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos);
  }
}

// ---------------------------------------------------------------------------------------------
// Parity
// ---------------------------------------------------------------------------------------------

// Every row: n = the scored count, bits 0/1 before n with target = prefix parity; PAD after.
void check_parity(const Batch& x, Idx n_min, Idx n_max, std::set<Idx>* lengths = nullptr) {
  for (Idx b = 0; b < x.B; ++b) {
    Idx n = 0;
    while (n < x.T && x.w[static_cast<std::size_t>(b * x.T + n)] == 1.0f) ++n;
    ASSERT_GE(n, n_min);
    ASSERT_LE(n, n_max);
    if (lengths) lengths->insert(n);
    int parity = 0;
    for (Idx t = 0; t < x.T; ++t) {
      const auto r = static_cast<std::size_t>(b * x.T + t);
      if (t < n) {
        ASSERT_TRUE(x.tok[r] == 0 || x.tok[r] == 1);
        parity ^= x.tok[r];
        ASSERT_EQ(x.tgt[r], parity) << "row " << b << " t " << t;
        ASSERT_EQ(x.w[r], 1.0f);
      } else {
        ASSERT_EQ(x.tok[r], 2);
        ASSERT_EQ(x.tgt[r], 0);
        ASSERT_EQ(x.w[r], 0.0f);
      }
    }
  }
}

TEST(Parity, TargetsAreThePrefixParity) {
  const auto d = m3::train::make_task("parity", {{"n_min", "3"}, {"n_max", "20"}}, 24);
  EXPECT_EQ(d->vocab(), 3);
  EXPECT_TRUE(d->sequence_accuracy());
  std::set<Idx> lengths;
  Idx ones = 0, bits = 0;
  for (Idx step = 1; step <= 20; ++step) {
    const Batch x = d->train_batch(5, step, 0, 16, 24);
    check_parity(x, 3, 20, &lengths);
    for (std::size_t r = 0; r < x.tok.size(); ++r)
      if (x.w[r] == 1.0f) {
        ++bits;
        ones += x.tok[r];
      }
  }
  EXPECT_EQ(lengths.size(), 18u) << "every length 3 … 20 occurs in 320 rows";
  EXPECT_NEAR(static_cast<double>(ones) / static_cast<double>(bits), 0.5, 0.03);
  check_parity(d->val_batch(0, 64, 24), 3, 20);
}

TEST(Parity, DefaultsFollowT) {
  EXPECT_EQ(m3::train::make_task("parity", {}, 32)->settings(),
            (Options{{"task", "parity"}, {"n_min", "3"}, {"n_max", "32"}}));
  EXPECT_EQ(m3::train::make_task("parity", {}, 256)->settings()[2].second, "64");
  expect_error([] { m3::train::make_task("parity", {}, 2); }, {"task parity", "T = 2", "T >= 3"});
}

TEST(Parity, LongerEvaluationIsAnotherDataset) {
  const auto d = m3::train::make_task("parity", {{"n_min", "256"}, {"n_max", "256"}}, 256);
  const Batch v = d->val_batch(0, 4, 256);
  check_parity(v, 256, 256);
  EXPECT_EQ(v.scored(), 4 * 256);
  // The training dataset at T = 64 runs at a longer T too (padding after n).
  const auto train = m3::train::make_task("parity", {}, 64);
  check_parity(train->train_batch(1, 1, 0, 8, 100), 3, 64);
  expect_error([&] { train->train_batch(1, 1, 0, 8, 63); }, {"task parity", "T = 63", "T >= 64"});
}

TEST(Parity, BadOptionsAreRejected) {
  using m3::train::make_task;
  expect_error([] { make_task("parity", {{"n_mx", "4"}}, 64); },
               {"task parity", "unknown option 'n_mx'", "n_min, n_max"});
  expect_error([] { make_task("parity", {{"n_min", "abc"}}, 64); }, {"n_min='abc'"});
  expect_error([] { make_task("parity", {{"n_min", "-3"}}, 64); }, {"n_min='-3'"});
  expect_error([] { make_task("parity", {{"n_min", ""}}, 64); }, {"n_min=''"});
  expect_error([] { make_task("parity", {{"n_min", "0"}}, 64); }, {"n_min='0'"});
  expect_error([] { make_task("parity", {{"n_min", "10"}, {"n_max", "5"}}, 64); },
               {"n_max='5'", "[10,"});
  expect_error([] { make_task("parity", {{"n_max", "100"}}, 64); },
               {"T = 64", "T >= 100", "n_max = 100"});
  expect_error([] { make_task("parity", {{"n_min", "3"}, {"n_min", "4"}}, 64); }, {"twice"});
  expect_error([] { make_task("parity", {{"n_min", "99999999999999999999"}}, 64); }, {"n_min="});
  expect_error([] { make_task("xor", {}, 64); }, {"unknown task 'xor'", "parity, modular"});
}

TEST(Parity, EncodeDecode) {
  const auto d = m3::train::make_task("parity", {}, 16);
  EXPECT_EQ(d->encode("0110."), (std::vector<std::int32_t>{0, 1, 1, 0, 2}));
  EXPECT_EQ(d->decode({1, 0, 2}), "10.");
  const Batch x = d->train_batch(3, 1, 0, 1, 16);
  EXPECT_EQ(d->encode(d->decode(x.tok)), x.tok);
  expect_error([&] { d->encode("01x"); }, {"task parity", "'x' at position 2", "\"01.\""});
  expect_error([&] { d->decode({3}); }, {"token 3"});
}

// ---------------------------------------------------------------------------------------------
// Modular
// ---------------------------------------------------------------------------------------------

// Every row parsed from its tokens: digit (op digit)* then PAD; targets = the running value.
void check_modular(const Batch& x, Idx m, Idx n_min, Idx n_max, std::set<Idx>* terms = nullptr,
                   std::set<int>* ops = nullptr) {
  const int plus = static_cast<int>(m), minus = plus + 1, pad = plus + 2;
  for (Idx b = 0; b < x.B; ++b) {
    const auto at = [&](Idx t) { return static_cast<std::size_t>(b * x.T + t); };
    Idx len = 0;
    while (len < x.T && x.tok[at(len)] != pad) ++len;
    ASSERT_EQ(len % 2, 1) << "a row is digit (op digit)*";
    const Idx k = (len + 1) / 2;
    ASSERT_GE(k, n_min);
    ASSERT_LE(k, n_max);
    if (terms) terms->insert(k);
    long value = 0;
    for (Idx t = 0; t < x.T; ++t) {
      const auto r = at(t);
      if (t >= len) {
        ASSERT_EQ(x.tok[r], pad);
        ASSERT_EQ(x.w[r], 0.0f);
        ASSERT_EQ(x.tgt[r], 0);
      } else if (t % 2 == 0) {
        ASSERT_GE(x.tok[r], 0);
        ASSERT_LT(x.tok[r], m);
        const int sign = t == 0 ? 1 : (x.tok[at(t - 1)] == minus ? -1 : 1);
        value = ((value + sign * x.tok[r]) % m + m) % m;
        ASSERT_EQ(x.tgt[r], value) << "row " << b << " t " << t;
        ASSERT_EQ(x.w[r], 1.0f);
      } else {
        ASSERT_TRUE(x.tok[r] == plus || x.tok[r] == minus);
        if (ops) ops->insert(x.tok[r]);
        ASSERT_EQ(x.w[r], 0.0f);
        ASSERT_EQ(x.tgt[r], 0);
      }
    }
  }
}

TEST(Modular, TargetsAreTheRunningValueModM) {
  const auto d = m3::train::make_task("modular", {}, 32);
  EXPECT_EQ(d->vocab(), 8);
  EXPECT_TRUE(d->sequence_accuracy());
  EXPECT_EQ(d->settings(),
            (Options{{"task", "modular"}, {"m", "5"}, {"n_min", "3"}, {"n_max", "16"}}));
  std::set<Idx> terms;
  std::set<int> ops;
  for (Idx step = 1; step <= 10; ++step)
    check_modular(d->train_batch(11, step, 0, 16, 32), 5, 3, 16, &terms, &ops);
  EXPECT_EQ(terms.size(), 14u);
  EXPECT_EQ(ops.size(), 2u);
  check_modular(d->val_batch(2, 16, 32), 5, 3, 16);
  // Another modulus, at a longer T than built for.
  const auto d7 = m3::train::make_task("modular", {{"m", "7"}, {"n_max", "5"}}, 9);
  EXPECT_EQ(d7->vocab(), 10);
  check_modular(d7->train_batch(1, 1, 0, 32, 20), 7, 3, 5);
}

TEST(Modular, SpellingAndBadOptions) {
  using m3::train::make_task;
  const auto d = make_task("modular", {}, 16);
  EXPECT_EQ(d->encode("3+4-1."), (std::vector<std::int32_t>{3, 5, 4, 6, 1, 7}));
  EXPECT_EQ(d->decode({3, 5, 4, 6, 1, 7}), "3+4-1.");
  const Batch x = d->train_batch(3, 1, 0, 2, 16);
  EXPECT_EQ(d->encode(d->decode(x.tok)), x.tok);
  expect_error([&] { d->encode("3+5"); }, {"task modular", "'5' at position 2"});
  EXPECT_EQ(make_task("modular", {{"m", "12"}}, 16)->decode({10, 11, 12, 13, 14}), "ab+-.");
  expect_error([] { make_task("modular", {{"m", "1"}}, 16); },
               {"task modular", "m='1'", "[2, 36]"});
  expect_error([] { make_task("modular", {{"m", "37"}}, 16); }, {"m='37'"});
  expect_error([] { make_task("modular", {{"K", "3"}}, 16); },
               {"unknown option 'K'", "m, n_min, n_max"});
  expect_error([] { make_task("modular", {{"n_max", "10"}}, 16); },
               {"T = 16", "T >= 19", "2*n_max - 1"});
  expect_error([] { make_task("modular", {}, 4); }, {"T = 4", "T >= 5"});
  EXPECT_NO_THROW(make_task("modular", {}, 5));
}

// ---------------------------------------------------------------------------------------------
// SelectiveCopy
// ---------------------------------------------------------------------------------------------

// Every row: K data tokens among NOISE before P = T − K − 1, MARKER at P, answers after it
// (NOISE tokens, targets = the data in position order, the only scored positions).
void check_selective(const Batch& x, Idx K, Idx A) {
  const int noise = static_cast<int>(A), marker = noise + 1;
  const Idx P = x.T - K - 1;
  for (Idx b = 0; b < x.B; ++b) {
    const auto at = [&](Idx t) { return static_cast<std::size_t>(b * x.T + t); };
    std::vector<int> data;
    for (Idx t = 0; t < P; ++t) {
      const int v = x.tok[at(t)];
      ASSERT_TRUE(v == noise || (v >= 0 && v < A)) << v;
      if (v != noise) data.push_back(v);
      ASSERT_EQ(x.w[at(t)], 0.0f);
    }
    ASSERT_EQ(static_cast<Idx>(data.size()), K) << "row " << b;
    ASSERT_EQ(x.tok[at(P)], marker);
    ASSERT_EQ(x.w[at(P)], 0.0f);
    for (Idx j = 0; j < K; ++j) {
      const auto r = at(P + 1 + j);
      ASSERT_EQ(x.tok[r], noise);
      ASSERT_EQ(x.tgt[r], data[static_cast<std::size_t>(j)]) << "row " << b << " answer " << j;
      ASSERT_EQ(x.w[r], 1.0f);
    }
  }
}

TEST(SelectiveCopy, AnswersReproduceTheDataInOrder) {
  const auto d = m3::train::make_task("selective-copy", {}, 64);
  EXPECT_EQ(d->vocab(), 10);
  EXPECT_FALSE(d->sequence_accuracy());
  EXPECT_EQ(d->settings(), (Options{{"task", "selective-copy"}, {"K", "16"}, {"alphabet", "8"}}));
  std::set<Idx> first_positions;
  for (Idx step = 1; step <= 10; ++step) {
    const Batch x = d->train_batch(2, step, 0, 16, 64);
    check_selective(x, 16, 8);
    EXPECT_EQ(x.scored(), 16 * 16);
    for (Idx b = 0; b < 16; ++b) {
      Idx t = 0;
      while (x.tok[static_cast<std::size_t>(b * 64 + t)] == 8) ++t;
      first_positions.insert(t);
    }
  }
  EXPECT_GT(first_positions.size(), 3u) << "the data positions vary";
  check_selective(d->val_batch(0, 16, 64), 16, 8);
  check_selective(d->train_batch(2, 1, 0, 4, 200), 16, 8);  // any T >= 2K + 1
}

TEST(SelectiveCopy, SmallestTAndBadOptions) {
  using m3::train::make_task;
  const auto d = make_task("selective-copy", {{"K", "4"}, {"alphabet", "3"}}, 9);
  const Batch x = d->train_batch(1, 1, 0, 8, 9);  // every noise position holds data
  check_selective(x, 4, 3);
  expect_error([&] { d->train_batch(1, 1, 0, 8, 8); }, {"task selective-copy", "T = 8", "T >= 9"});
  expect_error([] { make_task("selective-copy", {}, 32); }, {"T = 32", "T >= 33", "2K + 1"});
  expect_error([] { make_task("selective-copy", {{"K", "0"}}, 32); }, {"K='0'"});
  expect_error([] { make_task("selective-copy", {{"alphabet", "37"}}, 64); }, {"alphabet='37'"});
  expect_error([] { make_task("selective-copy", {{"n_max", "3"}}, 64); },
               {"unknown option 'n_max'", "K, alphabet"});
}

TEST(SelectiveCopy, EncodeDecode) {
  const auto d = m3::train::make_task("selective-copy", {{"K", "2"}}, 8);
  EXPECT_EQ(d->encode("3..7.|.."), (std::vector<std::int32_t>{3, 8, 8, 7, 8, 9, 8, 8}));
  const Batch x = d->train_batch(4, 1, 0, 3, 8);
  EXPECT_EQ(d->encode(d->decode(x.tok)), x.tok);
  expect_error([&] { d->encode("8"); }, {"'8' at position 0", "\"01234567.|\""});
}

// ---------------------------------------------------------------------------------------------
// Accuracy
// ---------------------------------------------------------------------------------------------

TEST(Accuracy, CountsTokensAndSequences) {
  Batch x;
  x.B = 3;
  x.T = 4;
  x.tok.assign(12, 0);
  x.tgt = {1, 2, 3, 4, /**/ 1, 2, 3, 4, /**/ 5, 5, 5, 5};
  x.w = {1, 1, 0, 1, /**/ 1, 1, 1, 0, /**/ 0, 0, 0, 0};
  // Row 0: all three scored right (t = 2 wrong but unscored). Row 1: one of three wrong,
  // plus a wrong unscored one. Row 2: nothing scored, not a sequence.
  const std::vector<std::int32_t> argmax = {1, 2, 0, 4, /**/ 1, 0, 3, 9, /**/ 0, 0, 0, 0};
  const auto a = m3::train::accuracy(x, argmax);
  EXPECT_EQ(x.scored(), 6);
  EXPECT_EQ(a.tokens, 6);
  EXPECT_EQ(a.correct, 5);
  EXPECT_EQ(a.sequences, 2);
  EXPECT_EQ(a.sequences_correct, 1);
  EXPECT_DOUBLE_EQ(a.token(), 5.0 / 6.0);
  EXPECT_DOUBLE_EQ(a.sequence(), 0.5);
  auto sum = a;
  sum.add(a);
  EXPECT_EQ(sum.tokens, 12);
  EXPECT_EQ(sum.correct, 10);
  EXPECT_EQ(sum.sequences, 4);
  EXPECT_EQ(sum.sequences_correct, 2);
  EXPECT_DOUBLE_EQ(sum.token(), 5.0 / 6.0);
  EXPECT_EQ(m3::train::Accuracy{}.token(), 0.0);
  EXPECT_EQ(m3::train::Accuracy{}.sequence(), 0.0);
  expect_error([&] { m3::train::accuracy(x, {1, 2}); }, {"accuracy", "got 2", "B*T = 12"});
}

TEST(Accuracy, TargetsAsPredictionsAreAllRight) {
  for (const auto& d : every_task(64)) {
    const Batch x = d->train_batch(1, 1, 0, 8, 64);
    const auto a = m3::train::accuracy(x, x.tgt);
    EXPECT_EQ(a.tokens, x.scored());
    EXPECT_EQ(a.correct, a.tokens);
    EXPECT_EQ(a.sequences, 8);
    EXPECT_EQ(a.sequences_correct, 8);
    // One wrong scored position spoils one sequence.
    auto wrong = x.tgt;
    const auto r = static_cast<std::size_t>(
        std::find(x.w.begin(), x.w.end(), 1.0f) - x.w.begin());
    wrong[r] = (wrong[r] + 1) % static_cast<std::int32_t>(d->vocab());
    const auto b = m3::train::accuracy(x, wrong);
    EXPECT_EQ(b.correct, a.tokens - 1);
    EXPECT_EQ(b.sequences_correct, 7);
  }
}

}  // namespace
