// Determinism check (HARNESS.md §7, MODEL.md §12.9): run the same implementation N times on
// the same Problem and compare a content hash of every captured tensor. Bit-identical output
// is the requirement; on any difference the report names the first tensor in execution order
// (forward, then backward, then parameter gradients) that diverged, and the run.
//
//   hash(t) = FNV-1a 64 over the shape (int64 little-endian) and the data bytes (the double
//             values the capture holds, which widen float/bf16/f16 exactly).
#pragma once

#include "run.hpp"

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "capture.hpp"
#include "config.hpp"
#include "problem.hpp"

namespace m3::harness {

std::uint64_t content_hash(const Tensor& t);
// A report's digest: FNV-1a 64 over its tensor hashes' bytes, in order (one value per run that
// names the whole capture; a record's cell line carries it beside the hashes it summarises).
std::uint64_t digest_of(const std::vector<std::uint64_t>& hashes);

struct DeterminismReport {
  ScanMode mode = ScanMode::Sequential;
  int runs = 0;
  int tensors = 0;                 // tensors hashed per run
  bool identical = true;
  std::string first_key;           // first divergent tensor (execution order), if any
  int first_run = -1;              // the run (1-based after run 0) where it diverged
  std::uint64_t hash0 = 0, hash_run = 0;
  std::uint64_t digest = 0;        // one hash over all tensor hashes of run 0
  std::vector<std::string> keys;   // run 0's tensors in execution order, and their content
  std::vector<std::uint64_t> hashes;  // hashes (the record of digest_record.hpp)
};

using RunFn = std::function<Capture(const Problem&, ScanMode)>;
struct RepeatRunner;  // run.hpp

// Runs `run` `runs` times (≥ 2). Keys are compared in expected_keys() order; a key missing in
// a later run is a divergence too.
DeterminismReport check_determinism(const RunFn& run, const Problem& pb, ScanMode mode,
                                    int runs);

// CI scale (a subject that digests on its device, RepeatRunner): run 0 captures every tensor —
// its content hashes give the report's digest, the same as check_determinism's — and digests
// its buffers where they live; runs 1 … runs−1 only digest (no tensor leaves the device), and
// the first digest that differs from run 0's names its key and the run.
DeterminismReport check_determinism_repeat(const RepeatRunner& runner, const Problem& pb,
                                           ScanMode mode, int runs);

}  // namespace m3::harness
