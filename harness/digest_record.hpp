// A record of determinism digests (HARNESS.md §7): run 0's content hash of every tensor of each
// (precision, scan mode) cell, written once by `m3h determinism --record FILE` and held against
// later builds by `--expect FILE`. Determinism proper asks that a build repeat itself; the
// record asks that a change meant to keep the bits keeps them, and when it does not, names the
// first tensor in execution order whose bits moved — the stage that changed them.
//
// The bits depend on the machine (GPU model, CUDA runtime, cuBLAS) and on the problem (config,
// seed, B, T), so a record carries both as text and is compared only where both are equal.
// File (text, one item per line, '#' lines ignored):
//   m3h-digests 1
//   environment: <text>
//   problem: <text>                 (source, seed, B, T, initial states, config)
//   cell: <precision> <scan> <digest, 16 hex> <tensor count>
//   <key> <hash, 16 hex>            (one line per tensor of the cell, execution order)
// A cell's digest is digest_of(its hashes) (determinism.hpp): the reader holds it to them, so
// a hand-edited hash is refused rather than compared.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "run.hpp"

namespace m3::harness {

struct DigestCell {
  std::string precision, scan;  // "bf16", "chunked"
  std::uint64_t digest = 0;     // the report's digest over the hashes below
  std::vector<std::string> keys;
  std::vector<std::uint64_t> hashes;
};

struct DigestRecord {
  std::string environment, problem;
  std::vector<DigestCell> cells;
  const DigestCell* find(const std::string& precision, const std::string& scan) const;
};

// "0123456789abcdef": a digest or hash as the record and m3h determinism print it.
std::string hex16(std::uint64_t v);
// The record's problem line of a run: its source, seed, B, T, initial states and config — what
// the bits depend on besides the machine. m3h determinism writes and matches it.
std::string digest_problem(const RunSpec& spec);

std::string format_digest_record(const DigestRecord& r);
// Throws m3::Error with a one-line message naming the file and line: a missing or unreadable
// file, another format, a malformed line, a duplicate cell or key, a count that does not match.
DigestRecord read_digest_record(const std::string& path);

// A cell against its recorded counterpart.
struct DigestDiff {
  int differ = 0;             // tensors whose hash moved
  int missing = 0;            // keys of one side absent on the other
  std::string first_key;      // the first moved or missing tensor, in the current cell's order
  std::uint64_t recorded = 0, now = 0;  // its hashes (0: absent)
  bool same() const { return differ == 0 && missing == 0; }
};
DigestDiff diff_digests(const DigestCell& recorded, const DigestCell& now);

}  // namespace m3::harness
