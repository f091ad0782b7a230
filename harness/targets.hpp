// The speed figures m3h bench holds its marginal layer against (official shape, H200): the
// official Mamba-3 block (RMSNorm + Mamba3 mixer + residual, PyTorch+Triton, bf16) as measured
// for issues 14 and 18, and issue 18's targets for the layer (chunked, determinism on):
//   bf16 forward+backward ≤ 3.7 ms (2× the official block's throughput), forward ≤ 1.5 ms;
//   f16 forward+backward within 5 % of bf16's.
// target_lines() states, for the marginal layers a bench run measured, each target, the
// figure and whether it is met (by how much it is short), so that a reader of the bench sees
// where the layer stands without the issue at hand.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace m3::harness {

constexpr double kOfficialBlockFwdMs = 2.99, kOfficialBlockFwdBwdMs = 7.43;
constexpr double kOfficialBlockGiBPerLayer = 1.34;
constexpr double kTargetFwdBwdMs = 3.7, kTargetFwdMs = 1.5, kTargetF16OverBf16 = 1.05;

// A marginal layer's times (2 layers − 1 layer), ms.
struct MarginalTimes {
  double fwd_ms = 0, fwdbwd_ms = 0;
};

// One line per target whose figures are present: bf16's two (bf16 given), the f16 ratio (both
// given); nothing when bf16 is absent. Throws m3::Error on a non-positive or non-finite time.
std::vector<std::string> target_lines(const std::optional<MarginalTimes>& bf16,
                                      const std::optional<MarginalTimes>& f16);

}  // namespace m3::harness
