// Determinism check (see determinism.hpp).
#include "determinism.hpp"

#include <cstring>

#include "compare.hpp"
#include "error.hpp"

namespace m3::harness {

namespace {
constexpr std::uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr std::uint64_t kFnvPrime = 0x100000001b3ull;

std::uint64_t fnv(std::uint64_t h, const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * kFnvPrime;
  return h;
}
}  // namespace

std::uint64_t content_hash(const Tensor& t) {
  std::uint64_t h = kFnvOffset;
  for (Idx d : t.shape) {
    const std::int64_t v = d;
    h = fnv(h, &v, sizeof v);
  }
  return fnv(h, t.data.data(), t.data.size() * sizeof(double));
}

std::uint64_t digest_of(const std::vector<std::uint64_t>& hashes) {
  return fnv(kFnvOffset, hashes.data(), hashes.size() * sizeof(std::uint64_t));
}

DeterminismReport check_determinism(const RunFn& run, const Problem& pb, ScanMode mode,
                                    int runs) {
  M3_REQUIRE(runs >= 2, "determinism", "needs at least 2 runs", "runs=", runs);
  const std::vector<std::string> keys = expected_keys(pb.cfg, pb.B, pb.T, mode, true);
  DeterminismReport rep;
  rep.mode = mode;
  rep.runs = runs;
  auto hashes_of = [&](const Capture& c) {
    std::vector<std::uint64_t> h;
    h.reserve(keys.size());
    for (const auto& k : keys) {
      const Tensor* t = c.find(k);
      h.push_back(t ? content_hash(*t) : 0);
    }
    return h;
  };
  const std::vector<std::uint64_t> ref = hashes_of(run(pb, mode));
  rep.tensors = static_cast<int>(keys.size());
  rep.digest = digest_of(ref);
  rep.keys = keys;
  rep.hashes = ref;
  for (int r = 1; r < runs; ++r) {
    const std::vector<std::uint64_t> h = hashes_of(run(pb, mode));
    for (size_t i = 0; i < keys.size(); ++i) {
      if (h[i] == ref[i]) continue;
      rep.identical = false;
      rep.first_key = keys[i];
      rep.first_run = r;
      rep.hash0 = ref[i];
      rep.hash_run = h[i];
      return rep;
    }
  }
  return rep;
}

DeterminismReport check_determinism_repeat(const RepeatRunner& runner, const Problem& pb,
                                           ScanMode mode, int runs) {
  M3_REQUIRE(runs >= 2, "determinism", "needs at least 2 runs", "runs=", runs);
  const std::vector<std::string> keys = expected_keys(pb.cfg, pb.B, pb.T, mode, true);
  DeterminismReport rep;
  rep.mode = mode;
  rep.runs = runs;
  rep.tensors = static_cast<int>(keys.size());
  Capture cap(pb.cfg, pb.B, pb.T);
  const std::vector<std::uint64_t> ref = runner.run(&cap);
  M3_REQUIRE(ref.size() == runner.keys.size(), "determinism", "digest count differs from its keys",
             ref.size(), " digests, ", runner.keys.size(), " keys");
  std::vector<std::uint64_t> hashes;
  for (const auto& k : keys) {
    const Tensor* t = cap.find(k);
    hashes.push_back(t ? content_hash(*t) : 0);
  }
  rep.digest = digest_of(hashes);
  rep.keys = keys;
  rep.hashes = hashes;
  for (int r = 1; r < runs; ++r) {
    const std::vector<std::uint64_t> h = runner.run(nullptr);
    for (size_t i = 0; i < ref.size(); ++i) {
      if (h[i] == ref[i]) continue;
      rep.identical = false;
      rep.first_key = runner.keys[i];
      rep.first_run = r;
      rep.hash0 = ref[i];
      rep.hash_run = h[i];
      return rep;
    }
  }
  return rep;
}

}  // namespace m3::harness
